"""Refill of a step protected by parity after a load rebuilt a lost member (format.md 11.1, 11.2;
issue 39 item 3), on the kill-a-node harness (tests/support/nodes.py: each node its own
namespaces, hostname and /local_nvme, 1 rank each, gloo on loopback): the replaced node gets back
its rank's files and the parity block it stored, so a second node of the group lost is survived
with no new save."""

from __future__ import annotations

import json
import logging
import shutil
import socket
from pathlib import Path

import pytest
import torch

from support.models import small_options
from support.nodes import NVME, Cluster, unavailable
from support.ranks import WarningLines, caught

needs_nodes = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

ROOT = f"{NVME}/ckpt"
NUMEL = 3 * 256 * 1024 + 777  # 3 MiB (and a bit) float32 per tensor: chunks end mid-file


def state_of(rank: int, step: int) -> dict:
    """Rank-local state of different sizes per rank (members of unequal length)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"a": torch.randn(NUMEL + 1000 * rank, generator=g), "b": torch.randn(NUMEL // 2, generator=g)}


def checkpointer(live: dict, group: int):
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    return GDSCheckpointer(state={"own": live}, root=ROOT, options=small_options(),
                           dist_options=DistOptions(timeout_s=60, parity_group=group, replicated=()))


def save(rank: int, world: int, steps: list[int], group: int) -> dict:
    live: dict = {}
    out: dict = {"host": socket.gethostname()}
    with checkpointer(live, group) as ck:
        for step in steps:
            live.clear()
            live.update(state_of(rank, step))
            ck.save(step)
            out[f"protected{step}"] = caught(lambda: ck.wait_protected(120))
    return out


def load(rank: int, world: int, group: int, refill: bool) -> dict:
    """The latest step into zeroed tensors: [step, bit exact] or the error; with ``refill``, then
    wait for the refill (wait_protected: "refilled"); the warnings logged."""
    seen = WarningLines()
    logging.getLogger("gdswriter").addHandler(seen)
    live = {k: torch.zeros_like(v) for k, v in state_of(rank, 0).items()}
    out: dict = {}
    got: list = []
    with checkpointer(live, group) as ck:
        err = caught(lambda: got.append(ck.load(None, strict=False)))
        if err:
            out["load"] = err
        else:
            want = state_of(rank, got[0])
            out["load"] = [got[0], all(torch.equal(live[k].view(torch.int32), v.view(torch.int32))
                                       for k, v in want.items())]
        if refill:
            out["refilled"] = caught(lambda: ck.wait_protected(120))
    out["warnings"] = seen.lines
    return out


def step_dir(c: Cluster, node: int, step: int) -> Path:
    return c.nvme_dir(node) / "ckpt" / f"step_{step:012d}"


def no_rebuilt_copies(c: Cluster, nodes: int, step: int) -> bool:
    """No node's ``copies/`` folder of ``step`` holds a rank's copy (rebuilt, or its removal's
    temporary name) any more: only the manifest's copy and the marker."""
    left = [p for k in range(nodes) if (step_dir(c, k, step) / "copies").is_dir()
            for p in (step_dir(c, k, step) / "copies").iterdir() if p.name not in ("manifest.json", "protected")]
    assert not left, left
    return True


@needs_nodes
def test_parity_refill_survives_a_second_node_loss(cluster):
    """3 nodes, parity_group=3, step 1 protected. Node 1 replaced by an empty disk: the load
    rebuilds rank 1's files from the group and loads bit exact; in the background the refill
    re-creates on node 1 rank 1's shard and data files and its parity block (bit for bit the
    block saved: the same length and crc32c in its description), and the manifest names node
    1's new root (wait_protected() waits for it). Then node 2 is replaced: with no new save,
    step 1 loads bit exact on every rank, rank 2's files rebuilt from node 0 and the refilled
    node 1 (without the refill, two members of one lane would be lost: an error)."""
    c = cluster(3)
    assert [x["protected1"] for x in c.run(save, [1], 3)] == [None] * 3
    before = json.loads((step_dir(c, 1, 1) / "parity" / "rank00001.json").read_bytes())
    own = sorted(p.name for p in step_dir(c, 1, 1).iterdir() if p.name.startswith(("data-", "manifest-rank")))
    c.replace_node(1)
    out = c.run(load, 3, True)
    for x in out:
        assert x["load"] == [1, True] and x["refilled"] is None, x
    assert any("step 1 is refilled" in w for w in out[0]["warnings"]), out[0]["warnings"]
    after = json.loads((step_dir(c, 1, 1) / "parity" / "rank00001.json").read_bytes())
    assert after["parity"] == before["parity"] and after["members"] == before["members"], (before, after)
    assert (step_dir(c, 1, 1) / "parity" / "rank00001.xor").stat().st_size == before["parity"]["length"]
    back = {p.name for p in step_dir(c, 1, 1).iterdir() if p.is_file()}
    assert set(own) <= back, (own, back)
    assert no_rebuilt_copies(c, 3, 1)

    c.replace_node(2)
    again = c.run(load, 3, False)
    assert [x["load"] for x in again] == [[1, True]] * 3, again
    assert any("rebuilt rank 2's files from its parity group" in w for x in again for w in x["warnings"]), again


class Model(torch.nn.Module):
    """Buffers of 3 MiB float32, the same on every rank (DistOptions.replicated's default: written
    once, split over the ranks), so a job on fewer ranks reshards it."""

    def __init__(self):
        super().__init__()
        for i in range(3):
            self.register_buffer(f"t{i}", torch.zeros(NUMEL))


def model_state(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {f"t{i}": torch.randn(NUMEL, generator=g) for i in range(3)}


def copies_job(rank: int, world: int, save_step: int | None) -> dict:
    """replicas=2: save ``save_step`` and wait until protected; else load the latest into a
    zeroed model ([step, bit exact]), wait for its refill, and report protected_step() and the
    warnings."""
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    seen = WarningLines()
    logging.getLogger("gdswriter").addHandler(seen)
    model = Model()
    out: dict = {}
    with GDSCheckpointer(model, root=ROOT, options=small_options(),
                         dist_options=DistOptions(timeout_s=60, replicas=2)) as ck:
        if save_step is not None:
            model.load_state_dict(model_state(save_step))
            ck.save(save_step)
            out["protected"] = ck.wait_protected(120)
            return out
        got: list = []
        err = caught(lambda: got.append(ck.load()))
        live = model.state_dict()
        out["load"] = err or [got[0], all(torch.equal(live[k].view(torch.int32), v.view(torch.int32))
                                          for k, v in model_state(got[0]).items())]
        out["refilled"] = caught(lambda: ck.wait_protected(120))
        out["protected"] = ck.protected_step()
    out["warnings"] = seen.lines
    return out


@needs_nodes
def test_refill_not_done_on_another_world_size_leaves_the_step_loadable_not_protected(cluster, capsys):
    """3 nodes, replicas=2, step 1 protected; node 2 lost and the job restarted on nodes 0 and 1
    (2 ranks: a reshard). The load is bit exact; the refill is not done (a step saved by another
    world size: a documented limitation), and says so: the step is no longer protected
    (protected_step() is None, ``gdswriter ls`` shows it committed), nothing is changed on the
    disks beyond the marker, and it loads again bit exact, on 2 nodes and on all 3."""
    from gdswriter.cli import main

    c = cluster(3)
    assert [x["protected"] for x in c.run(copies_job, 1)] == [1] * 3
    out = c.run(copies_job, None, nodes=[0, 1])
    for x in out:
        assert x["load"] == [1, True] and x["refilled"] is None and x["protected"] is None, x
    assert any("step 1 is not refilled after its restore: it was saved by 3 ranks, this job has 2" in w
               and "no longer protected" in w for w in out[0]["warnings"]), out[0]["warnings"]
    capsys.readouterr()
    assert main(["ls", str(c.nvme_dir(0) / "ckpt")]) == 0
    shown = capsys.readouterr().out
    assert "committed (0/1 copies)" in shown and "protected (" not in shown, shown
    assert [x["load"] for x in c.run(copies_job, None, nodes=[0, 1])] == [[1, True]] * 2
    assert [x["load"] for x in c.run(copies_job, None)] == [[1, True]] * 3


@needs_nodes
def test_refill_with_an_adopted_primary_protects_the_step_again(cluster, capsys):
    """3 nodes, replicas=2, step 1 protected; node 0 (the primary root, with the step's manifest)
    replaced by an empty disk. The load adopts the manifest's copy (node 1 is the primary now)
    and is bit exact; the refill puts rank 0's files and the copies node 0 held back on node 0,
    with a copy of the manifest: the step is protected again (protected_step(), ``gdswriter
    ls``). Then node 1 is replaced too: the manifest's copy on node 0 is adopted and step 1
    loads bit exact (without the refill, nothing would be left of rank 0's files or the
    manifest: no step to load)."""
    from gdswriter.cli import main

    c = cluster(3)
    assert [x["protected"] for x in c.run(copies_job, 1)] == [1] * 3
    c.replace_node(0)
    out = c.run(copies_job, None)
    for x in out:
        assert x["load"] == [1, True] and x["refilled"] is None and x["protected"] == 1, x
    assert any("step 1 is refilled" in w for x in out for w in x["warnings"]), out
    assert (step_dir(c, 0, 1) / "copies" / "manifest.json").is_file()
    capsys.readouterr()
    assert main(["ls", str(c.nvme_dir(1) / "ckpt")]) == 0
    assert "protected (" in capsys.readouterr().out

    c.replace_node(1)
    assert [x["load"] for x in c.run(copies_job, None)] == [[1, True]] * 3


def load_read_only(rank: int, world: int, read_only: list[int]) -> dict:
    """``load`` (parity_group=3, then wait for the refill), where the ranks of ``read_only``
    make their root read-only (a bind mount remounted ro in their node's mount namespace: the
    file system turned read-only under a running job) once the checkpointer is open."""
    import subprocess

    seen = WarningLines()
    logging.getLogger("gdswriter").addHandler(seen)
    live = {k: torch.zeros_like(v) for k, v in state_of(rank, 0).items()}
    out: dict = {}
    got: list = []
    with checkpointer(live, 3) as ck:
        if rank in read_only:
            for cmd in (["mount", "--bind", ROOT, ROOT], ["mount", "-o", "remount,bind,ro", ROOT]):
                subprocess.run(cmd, check=True, capture_output=True)
        err = caught(lambda: got.append(ck.load(None, strict=False)))
        if err:
            out["load"] = err
            out["untouched"] = all(not t.any() for t in live.values())
        else:
            want = state_of(rank, got[0])
            out["load"] = [got[0], all(torch.equal(live[k].view(torch.int32), v.view(torch.int32))
                                       for k, v in want.items())]
        out["refilled"] = caught(lambda: ck.wait_protected(120))
    out["held"] = sorted(p.name for p in Path("/dev/shm").glob("gdswriter-rebuilt-*"))
    out["warnings"] = seen.lines
    return out


@needs_nodes
def test_parity_rebuild_onto_read_only_roots(cluster):
    """3 nodes, parity_group=3, step 1 protected, node 1 replaced. Node 0's root turns read-only
    under the job (the first root that may hold rank 1's rebuilt copy): the rebuilt copy goes to
    node 2's root instead and the load is bit exact on every rank (the refill, which must rewrite
    the manifest on node 0, fails with ReplicationError: the step stays as it was). Nodes 0 and 2
    both read-only: no root can hold the copy, so
    the rebuilt copy is held in memory (on node 1, the lost rank's replacement) for that load,
    which is bit exact on every rank; nothing is written on any root, the copy is dropped after
    the load, and a warning says the step cannot be refilled (not protected again). With the
    roots writable again, the step loads bit exact: nothing was damaged."""
    c = cluster(3)
    assert [x["protected1"] for x in c.run(save, [1], 3)] == [None] * 3
    c.replace_node(1)
    out = c.run(load_read_only, [0])
    for x in out:
        assert x["load"] == [1, True], x
        assert x["refilled"] is not None and x["refilled"][0] == "ReplicationError", x
    assert any("rebuilt rank 1's files from its parity group" in w and "copies" in w
               for w in out[2]["warnings"]), out[2]["warnings"]
    assert (step_dir(c, 2, 1) / "copies" / "rank00001" / "manifest-rank00001.json").is_file()
    assert not (step_dir(c, 0, 1) / "copies" / "rank00001").exists()

    shutil.rmtree(step_dir(c, 2, 1) / "copies" / "rank00001")  # the copy made above gone
    before = {k: sorted(str(p.relative_to(c.nvme_dir(k))) for p in c.nvme_dir(k).rglob("*")) for k in range(3)}
    held = c.run(load_read_only, [0, 2])
    for x in held:
        assert x["load"] == [1, True] and x["held"] == [], x
    assert any("holds them in memory for this load" in w and "cannot be refilled" in w and "read-only" in w
               for w in held[1]["warnings"]), held[1]["warnings"]
    after = {k: sorted(str(p.relative_to(c.nvme_dir(k))) for p in c.nvme_dir(k).rglob("*")) for k in range(3)}
    assert after == before, (before, after)
    assert [x["load"] for x in c.run(load, 3, False)] == [[1, True]] * 3


@needs_nodes
def test_parity_refill_finds_a_copy_rebuilt_off_a_read_only_root(cluster):
    """6 nodes, parity_group=3 (lanes [0, 2, 4] and [1, 3, 5]), step 1 protected; node 5 replaced,
    and node 1's root (the first that may hold rank 5's rebuilt copy) read-only under the job:
    the copy is rebuilt on node 3 and the load is bit exact. The refill finds it there (not on
    node 1, where the plan alone would look), puts rank 5's files and parity block back on node
    5, and the step is protected again; the rebuilt copy is then removed (disk use does not grow
    per load). Then node 3 is replaced: step 1 still loads bit exact, rank 3 rebuilt from nodes
    1 and 5 (without the refill, two members of one lane lost: an error)."""
    c = cluster(6)
    assert [x["protected1"] for x in c.run(save, [1], 3)] == [None] * 6
    assert json.loads((step_dir(c, 5, 1) / "parity" / "rank00005.json").read_bytes())["lane"] == [1, 3, 5]
    c.replace_node(5)
    out = c.run(load_read_only, [1])
    for x in out:
        assert x["load"] == [1, True] and x["refilled"] is None, x
    assert any("rebuilt rank 5's files" in w for w in out[3]["warnings"]), out[3]["warnings"]
    assert any("step 1 is refilled" in w for w in out[0]["warnings"]), out[0]["warnings"]
    assert (step_dir(c, 5, 1) / "parity" / "rank00005.xor").is_file()
    assert no_rebuilt_copies(c, 6, 1)

    c.replace_node(3)
    again = c.run(load, 3, False)
    assert [x["load"] for x in again] == [[1, True]] * 6, again
