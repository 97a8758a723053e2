"""Kill-a-node scenarios with replicas (issue 39, "How to show it"), on the real harness
(tests/support/nodes.py: each node its own namespaces, hostname and /local_nvme): a node lost
and the job restarted on fewer nodes; two nodes lost at once; a copy or an original corrupted;
a node killed during the replication. Each ends with the job resuming: what loads equals what
was saved at that step bit for bit (or a typed error says why nothing can), and no protected
step is lost.

The state is replicated ("model", DistOptions.replicated's default: the same on every rank,
written once, split over the ranks), so a job restarted on fewer ranks reshards it."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest
import torch

from support.engines import HookedWrites
from support.models import small_engine, small_options
from support.nodes import NVME, Cluster, reached, unavailable
from support.ranks import WarningLines, caught

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

ROOT = f"{NVME}/ckpt"  # node-local on every node
TENSORS, NUMEL = 4, 512 * 1024  # four 2 MiB float32 tensors


class Model(torch.nn.Module):
    """TENSORS buffers of NUMEL float32: a model whose state_dict is the saved state."""

    def __init__(self):
        super().__init__()
        for i in range(TENSORS):
            self.register_buffer(f"t{i}", torch.zeros(NUMEL))


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {f"t{i}": torch.randn(NUMEL, generator=g) for i in range(TENSORS)}


def _exact(model: Model, step: int) -> bool:
    live = model.state_dict()
    return all(torch.equal(live[k].view(torch.int32), v.view(torch.int32)) for k, v in _state(step).items())


class HoldWrite(HookedWrites):
    """Once ``armed``, the first file write calls reached("writing") and holds there."""

    armed = False

    def before(self, path) -> None:
        if self.armed:
            reached("writing", hold_s=90)


class HoldReplication(logging.Handler):
    """Calls reached("replicating") and holds as this rank's replication of ``step`` begins
    (the step is committed; the Replicator thread logs it, at DEBUG, on the "gdswriter" logger)."""

    def __init__(self, step: int):
        super().__init__(logging.DEBUG)
        self.step = step

    def emit(self, record: logging.LogRecord) -> None:
        if f"replicates step {self.step} " in record.getMessage():
            reached("replicating", hold_s=90)


def _checkpointer(model: Model, engine=None, keep_last: int | None = None):
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    return GDSCheckpointer(model, root=ROOT, options=small_options(), keep_last=keep_last,
                           dist_options=DistOptions(timeout_s=30, replicas=2),
                           engines=None if engine is None else [engine])


def _save(rank: int, world: int, steps: list[int], hold: str | None = None, holder: int = -1,
          keep_last: int | None = None) -> dict:
    """Save ``steps``, each waited for until protected, but the last when ``hold`` is set: then
    rank ``holder`` holds in the last step's write ("write") or its replication ("replication")
    and the test kills its node there."""
    model = Model()
    engine = HoldWrite(small_engine())
    out: dict = {"host": socket.gethostname()}
    with _checkpointer(model, engine, keep_last) as ck:
        for step in steps:
            model.load_state_dict(_state(step))
            last = hold is not None and step == steps[-1]
            if last and rank == holder and hold == "write":
                engine.armed = True
            if last and rank == holder and hold == "replication":
                log = logging.getLogger("gdswriter")
                log.setLevel(logging.DEBUG)
                log.addHandler(HoldReplication(step))
            out[f"save{step}"] = caught(lambda: ck.save(step))
            out[f"protected{step}"] = caught(lambda: ck.wait_protected(120)) if last else ck.wait_protected(120)
        out["steps"], out["protected"] = ck.steps(), ck.protected_step()
    return out


def _load(rank: int, world: int, steps: list, save_next: int | None = None, keep_last: int | None = None,
          refill: bool = False) -> dict:
    """Load each of ``steps`` (None: the latest; "fallback": the latest with fallback=True) into
    a zeroed model: [step, bit exact] or the error and whether the model was left unchanged, the
    warnings, and ``lost``: the last load's LoadResult.lost. With ``refill``, then wait for the
    refill of the loaded step (wait_protected: "refilled"). With ``save_next``, the job then
    resumes: saves that step, waits until protected."""
    model = Model()
    seen = WarningLines()
    logging.getLogger("gdswriter").addHandler(seen)
    out: dict = {}
    with _checkpointer(model, keep_last=keep_last) as ck:
        for step in steps:
            got: list = []
            before = {k: v.clone() for k, v in model.state_dict().items()}
            err = caught(lambda: got.append(ck.load(None if step == "fallback" else step,
                                                    fallback=step == "fallback")))
            out[str(step)] = err or [got[0], _exact(model, got[0])]
            if err:
                after = model.state_dict()
                out[f"{step}-unchanged"] = all(torch.equal(after[k].view(torch.int32), v.view(torch.int32))
                                               for k, v in before.items())
            else:
                out["lost"] = list(ck.last_load.lost)
        if refill:
            out["refilled"] = caught(lambda: out.update(protected=ck.wait_protected(120)))
        if save_next is not None:
            model.load_state_dict(_state(save_next))
            ck.save(save_next)
            out["resumed"] = [ck.wait_protected(120), ck.steps()]
    out["warnings"] = seen.lines
    return out


def _data_file(step_dir: Path) -> Path:
    """The largest data file directly in ``step_dir`` (a rank's own files, or a copy's folder)."""
    return max((p for p in step_dir.iterdir() if p.name.startswith("data-")), key=lambda p: p.stat().st_size)


def _flip(path: Path) -> None:
    """Flip one byte in the middle of ``path`` (a disk returning bad bytes)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _step_dir(c: Cluster, node: int, step: int) -> Path:
    return c.nvme_dir(node) / "ckpt" / f"step_{step:012d}"


# ----------------------------------------------------------------------------- the scenarios
def test_node_lost_and_restarted_on_fewer_nodes(cluster):
    """3 nodes x 1 rank, replicas=2: steps 1 and 2 protected, node 2 killed while writing step
    3. The job restarts on nodes 0 and 1 only (2 ranks: a reshard): step 2, the newest
    protected step, loads bit exact (rank 2's part read from its copy on node 0), and the job
    saves on, protected again on two nodes."""
    c = cluster(3)
    job = c.start(_save, [1, 2, 3], "write", 2)
    assert job.wait_for("writing", rank=2, timeout=120) == "node2"
    c.kill_node(2)
    got = job.wait(killed_nodes=(2,))
    for x in got[:2]:
        assert (x["protected1"], x["protected2"], x["protected"]) == (1, 2, 2), x
        assert x["save3"][0] == "CollectiveFailedError" and x["steps"] == [1, 2], x
    assert (_step_dir(c, 0, 2) / "copies" / "rank00002").is_dir(), "rank 2's copy is on node 0"

    out = c.run(_load, [None, 1], 3, nodes=[0, 1])
    for x in out:
        assert (x["None"], x["1"], x["resumed"]) == ([2, True], [1, True], [3, [1, 2, 3]]), x
    assert any("restored rank 2's files from the copy" in w and "(node0)" in w for w in out[0]["warnings"]), out
    again = c.run(_load, [None], nodes=[0, 1])
    assert [x["None"] for x in again] == [[3, True]] * 2, again


def test_two_nodes_lost_at_once(cluster):
    """3 nodes, replicas=2: steps 1 and 2 protected, then nodes 1 and 2 lost at once (replaced
    by empty disks). With two copies on a ring of three, every pair of nodes holds both copies
    of some rank's files (here rank 1's: its own on node 1, its copy on node 2): no step
    survives, and every load (the latest, step 1, with fallback) is a typed
    CorruptCheckpointError saying no copy of rank 1's files is left (its own root and its copy:
    no rank of this job sees them; StepFilesLostError, lost not damaged, where no fallback ran:
    a plain load() found no older complete step either), the model untouched: never a wrong
    load. The job then resumes from
    nothing: a new step saves, is protected and loads bit exact."""
    c = cluster(3)
    got = c.run(_save, [1, 2])
    assert [(x["protected1"], x["protected2"]) for x in got] == [(1, 2)] * 3, got
    c.replace_node(1)
    c.replace_node(2)
    out = c.run(_load, [None, 1, "fallback"], 4)
    for x in out:
        for step in ("None", "1", "fallback"):
            err = x[step]
            assert err[0] == ("CorruptCheckpointError" if step == "fallback" else "StepFilesLostError"), (step, x)
            assert "no good copy of rank 1's files is left" in err[1], err
            assert err[1].count("no rank of this job sees it") >= 2, err  # its own root and its copy
            assert x[f"{step}-unchanged"], (step, x)
        assert x["resumed"][0] == 4, x
    assert [x["None"] for x in c.run(_load, [None])] == [[4, True]] * 3


def test_corrupted_original_uses_the_copy_and_corrupted_copy_is_an_error(cluster):
    """2 nodes, replicas=2, steps 1 and 2 protected. A flipped byte in rank 1's original data
    file of step 2 (node 1): the load reads the copy on node 0, bit exact, and the log says so.
    Then node 1 is lost (replaced) and the copy of rank 1's step-2 data file on node 0 gets a
    flipped byte: loading step 2 is a CorruptCheckpointError (no good copy left), the model
    untouched; with fallback=True step 1 (its copy intact) loads bit exact, and the job saves on."""
    c = cluster(2)
    got = c.run(_save, [1, 2])
    assert [(x["protected1"], x["protected2"]) for x in got] == [(1, 2)] * 2, got
    _flip(_data_file(_step_dir(c, 1, 2)))
    out = c.run(_load, [None])
    assert [x["None"] for x in out] == [[2, True]] * 2, out
    said = [w for x in out for w in x["warnings"] if "restored rank 1's files from the copy" in w]
    assert said and "(node0)" in said[0], out

    c.replace_node(1)
    _flip(_data_file(_step_dir(c, 0, 2) / "copies" / "rank00001"))
    out = c.run(_load, [2, None, "fallback"], 3)
    for x in out:
        for step in ("2", "None"):  # damaged, not lost: a plain load() does not pass over it either
            err = x[step]
            assert err[0] == "CorruptCheckpointError" and "no good copy of rank 1's files is left" in err[1], x
            assert x[f"{step}-unchanged"], x
        assert x["fallback"] == [1, True] and x["resumed"][0] == 3, x


def test_node_killed_during_replication_keeps_the_previous_protected_step(cluster):
    """2 nodes, replicas=2, keep_last=1: step 1 protected; step 2 committed, and node 1 killed
    while its replication of step 2 runs (held at its start, seen through the "gdswriter"
    logger). Step 2 stays committed, not protected (ReplicationError); step 1 stays protected,
    and kept (retention never deletes the newest protected step). Node 1 is
    replaced by an empty disk: step 1 loads bit exact on both ranks (from the copy on node 0);
    loading step 2 by its number is a StepFilesLostError (its copy of rank 1 never landed: lost,
    not damaged) leaving the model unchanged; a plain load() loads step 1, the newest step
    complete across the surviving copies, says so (LoadResult.lost, a warning naming step 2);
    load(fallback=True) loads step 1 too, and the job saves on."""
    c = cluster(2)
    job = c.start(_save, [1, 2], "replication", 1, 1)  # keep_last=1: only the protected step keeps step 1
    assert job.wait_for("replicating", rank=1, timeout=120) == "node1"
    c.kill_node(1)
    x = job.wait(killed_nodes=(1,))[0]
    assert x["save2"] is None and x["protected2"][0] == "ReplicationError", x
    assert x["steps"] == [1, 2] and x["protected"] == 1, x
    assert not (_step_dir(c, 0, 2) / "protected").exists() and (_step_dir(c, 0, 1) / "protected").exists()

    c.replace_node(1)
    out = c.run(_load, [1, 2, None, "fallback"], 3, 1)
    for y in out:
        assert y["1"] == [1, True], y
        err = y["2"]  # step 2: committed, rank 1's files lost with node 1, no copy made
        assert err[0] == "StepFilesLostError" and "no good copy of rank 1's files is left" in err[1], y
        assert "copies/rank00001/manifest-rank00001.json of step 2 (rank 1) is missing" in err[1], y
        assert "every copy was lost with its node" in err[1] and y["2-unchanged"], y
        assert y["None"] == [1, True], y  # a plain load(): the newest complete step
        assert y["fallback"] == [1, True] and y["resumed"] == [3, [1, 3]], y  # at 3's commit: 2 goes, 1 (protected) stays
        assert any("passed over step(s) [2]" in w and "loaded step 1" in w for w in y["warnings"]), y
    assert out[0]["lost"] == [], "the last load (fallback=True) passed over no lost step"
    assert [y["None"] for y in c.run(_load, [None])] == [[3, True]] * 2


def test_replaced_node_is_refilled_so_a_second_node_loss_is_survived(cluster):
    """3 nodes, replicas=2, step 1 protected. Node 1 is replaced by an empty disk: the job loads
    step 1 bit exact (rank 1's files from their copy), and in the background the refill
    re-creates on node 1 rank 1's own files and the copies node 1 held, checked by crc32c, then
    the step's manifest names node 1's new root (wait_protected() waits for it). Then node 2,
    another node, is replaced: with no new save, step 1 still loads bit exact on every rank
    (without the refill, rank 1's own files and its copy would both be gone)."""
    c = cluster(3)
    got = c.run(_save, [1])
    assert [x["protected1"] for x in got] == [1] * 3, got
    c.replace_node(1)
    out = c.run(_load, [None], None, None, True)
    for x in out:
        assert x["refilled"] is None, x["refilled"]
        assert x["None"] == [1, True], x
    refilled = (_step_dir(c, 1, 1) / "manifest-rank00001.json").is_file()
    c.replace_node(2)
    again = c.run(_load, [None])
    assert [x["None"] for x in again] == [[1, True]] * 3, again
    assert any("restored rank 2's files from the copy" in w for x in again for w in x["warnings"]), again
    assert refilled, "rank 1's own files were back on node 1 before node 2 was lost"
    assert [x["protected"] for x in out] == [1] * 3, "protected again, on every rank"
    assert any("step 1 is refilled" in w for w in out[0]["warnings"]), out[0]
