"""A kill-a-node scenario for the DCP plug-in with replicas (issue 39 item 6), on the namespace
harness (tests/support/nodes.py: each node its own namespaces, hostname and /local_nvme): two
nodes save DCP steps through GDSStorageWriter(replicas=2); node 1 is killed while it replicates
step 3 (committed, not protected) and replaced by an empty disk. The restarted job loads step 2
bit-exact from the copies, refuses step 3 with a typed error (rank 1's files of it have no copy:
never a wrong load), and saves on: step 4 protected and loaded bit-exact."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
import torch

from support.models import small_engine
from support.nodes import NVME, reached, unavailable
from support.ranks import WarningLines, caught

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""), pytest.mark.slow]

ROOT = f"{NVME}/ckpt"  # node-local on every node
MiB = 1 << 20


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(1300 + step)
    return {"a": torch.randn(MiB, generator=g), "b": torch.randn(MiB, generator=g)}


class HoldReplication(logging.Handler):
    """As this rank's replication of ``step`` begins (the replication thread logs it), waits for
    ``saved`` (dcp.save returned: the step is committed), then calls reached("replicating") and
    holds there."""

    def __init__(self, step: int):
        super().__init__(logging.DEBUG)
        self.step, self.saved = step, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if f"replicates step {self.step} " in record.getMessage():
            self.saved.wait(60)
            reached("replicating", hold_s=90)


def _writer():
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import DistOptions, GDSStorageWriter

    return GDSStorageWriter(ROOT, options=CheckpointOptions(engine=small_engine()),
                            dist_options=DistOptions(timeout_s=20, replicas=2))


def _save(rank: int, world: int, steps: list[int], holder: int) -> dict:
    """Save ``steps``, each waited for until protected; rank ``holder`` holds in the last one's
    replication (the test kills its node there)."""
    import torch.distributed.checkpoint as dcp

    w = _writer()
    out: dict = {"host": socket.gethostname()}
    hold = HoldReplication(steps[-1])
    for step in steps:
        if step == steps[-1] and rank == holder:
            log = logging.getLogger("gdswriter")
            log.setLevel(logging.DEBUG)
            log.addHandler(hold)
        w.reset(step)
        dcp.save(_state(step), storage_writer=w)
        hold.saved.set() if step == steps[-1] else None
        out[f"protected{step}"] = caught(w.wait_protected) if step == steps[-1] else w.wait_protected()
    return out


def _load(rank: int, world: int, steps: list[int], save_next: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import GDSStorageReader, dcp_errors

    seen = WarningLines()
    logging.getLogger("gdswriter").addHandler(seen)
    out: dict = {}
    for step in steps:
        back = {k: torch.zeros_like(v) for k, v in _state(step).items()}

        def run() -> None:
            with dcp_errors():
                dcp.load(back, storage_reader=GDSStorageReader(ROOT, step, engine_options=small_engine()))
        err = caught(run)
        out[str(step)] = err or [step, all(torch.equal(back[k], v) for k, v in _state(step).items())]
    w = _writer()
    w.reset(save_next)
    dcp.save(_state(save_next), storage_writer=w)
    out["resumed"] = w.wait_protected()
    w.close()
    back = {k: torch.zeros_like(v) for k, v in _state(save_next).items()}
    dcp.load(back, storage_reader=GDSStorageReader(ROOT, save_next, engine_options=small_engine()))
    out["resumed_exact"] = all(torch.equal(back[k], v) for k, v in _state(save_next).items())
    out["warnings"] = seen.lines
    return out


def test_dcp_node_killed_during_replication_and_replaced(cluster):
    c = cluster(2)
    job = c.start(_save, [1, 2, 3], 1)
    assert job.wait_for("replicating", rank=1, timeout=180) == "node1"
    c.kill_node(1)
    got = job.wait(killed_nodes=(1,))
    x = got[0]
    assert (x["protected1"], x["protected2"]) == (1, 2), x
    assert x["protected3"][0] == "ReplicationError", x  # committed, not protected
    c.replace_node(1)
    out = c.run(_load, [2, 3], 4)
    for rank, x in enumerate(out):
        assert x["2"] == [2, True], (rank, x)
        assert x["3"][0] == "StepFilesLostError", (rank, x)  # rank 1's files of step 3: no copy anywhere
        assert x["resumed"] == 4 and x["resumed_exact"], (rank, x)
    said = [w for w in out[0]["warnings"] if "copies/rank00001" in w]
    assert said, out[0]["warnings"]


def _parity_save(rank: int, world: int) -> dict:
    """Step 1 through GDSStorageWriter(parity_group=3), waited for until protected."""
    import torch.distributed.checkpoint as dcp

    from gdswriter import CheckpointOptions
    from gdswriter.distributed import DistOptions, GDSStorageWriter

    w = GDSStorageWriter(ROOT, options=CheckpointOptions(engine=small_engine()),
                         dist_options=DistOptions(timeout_s=60, parity_group=3))
    w.reset(1)
    dcp.save(_state(1), storage_writer=w)
    out = {"protected": w.wait_protected()}
    w.close()
    return out


def _parity_load_read_only(rank: int, world: int, read_only: list[int]) -> dict:
    """A DCP load of step 1 where the ranks of ``read_only`` first make their root read-only (a
    bind mount remounted ro in their node's mount namespace)."""
    import subprocess
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import GDSStorageReader, dcp_errors

    if rank in read_only:
        for cmd in (["mount", "--bind", ROOT, ROOT], ["mount", "-o", "remount,bind,ro", ROOT]):
            subprocess.run(cmd, check=True, capture_output=True)
    seen = WarningLines()
    logging.getLogger("gdswriter").addHandler(seen)
    back = {k: torch.zeros_like(v) for k, v in _state(1).items()}

    def run() -> None:
        with dcp_errors():
            dcp.load(back, storage_reader=GDSStorageReader(ROOT, 1, engine_options=small_engine()))
    err = caught(run)
    return {"load": err or [1, all(torch.equal(back[k], v) for k, v in _state(1).items())],
            "held": sorted(p.name for p in Path("/dev/shm").glob("gdswriter-rebuilt-*")), "warnings": seen.lines}


def test_dcp_parity_rebuild_is_held_in_memory_when_no_root_can_be_written(cluster):
    """3 nodes, DCP steps with parity_group=3, step 1 protected, node 1 replaced (an empty disk).
    Nodes 0 and 2 (the lane's survivors) read-only: no root can take rank 1's rebuilt copy, so it
    is held in memory on node 1 (HeldCopies: one more root, seen by its rebuilder alone) for that
    load, bit-exact on every rank; nothing is written on any root and the copy is dropped after
    the load, with a warning that says so."""
    c = cluster(3)
    assert [x["protected"] for x in c.run(_parity_save)] == [1] * 3
    c.replace_node(1)
    before = {k: sorted(str(p.relative_to(c.nvme_dir(k))) for p in c.nvme_dir(k).rglob("*")) for k in range(3)}
    out = c.run(_parity_load_read_only, [0, 2])
    for rank, x in enumerate(out):
        assert x["load"] == [1, True] and x["held"] == [], (rank, x)
    assert any("holds them in memory for this load" in w and "read-only" in w for w in out[1]["warnings"]), out
    after = {k: sorted(str(p.relative_to(c.nvme_dir(k))) for p in c.nvme_dir(k).rglob("*")) for k in range(3)}
    assert after == before, (before, after)
