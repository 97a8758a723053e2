"""Replicas on peer nodes when a peer fails (issue 39): a peer killed or hung during the
replication breaks the replication group, so the Replicator stops trying: every later step is
committed but reports ReplicationError at once, saying the job must restart; no save, wait or
close() outlasts DistOptions.timeout_s; retention keeps the newest protected step. Real gloo
ranks, each its own root and GDSWRITER_HOSTNAME (distinct nodes), tensors of 4 MiB and more."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch

from gdswriter import DistOptions, GDSCheckpointer
from gdswriter.format.commit import step_dir_name
from support.ranks import caught, run_ranks

MiB = 1 << 20
TIMEOUT_S = 10.0
RESTART = "restart the job to protect steps again"


def state(step: int) -> dict:
    """48 MiB on every rank (two replicated tensors; each rank writes, then streams, its half)."""
    g = torch.Generator().manual_seed(700 + step)
    return {"a": torch.randn(6 * MiB, generator=g), "b": torch.randint(0, 1 << 30, (6 * MiB,), generator=g)}


def _open(tmp: str, rank: int, holder: dict) -> GDSCheckpointer:
    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    return GDSCheckpointer(holder, root=f"{tmp}/n{rank}", keep_last=1,
                           dist_options=DistOptions(replicas=2, timeout_s=TIMEOUT_S))


def _next(holder: dict, step: int) -> None:
    for k, v in state(step).items():
        holder[k].copy_(v)


def _timed(fn) -> tuple[list[str] | None, float]:
    t0 = time.monotonic()
    got = caught(fn)
    return got, time.monotonic() - t0


def _die_mid_stream(copies: Path) -> None:
    """SIGKILL this process once rank 0's copy has started to land in ``copies`` (mid-stream)."""
    while True:
        if copies.is_dir() and any(p.name.startswith("data-") for d in copies.glob(".tmp-rank*")
                                   for p in d.iterdir()):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.001)


def _killed_mid_stream(rank: int, world: int, tmp: str) -> dict:
    holder = state(1)
    ck = _open(tmp, rank, holder)
    ck.save(1)
    first = ck.wait_protected()
    if rank == 1:
        copies = Path(tmp, "n1", step_dir_name(2), "copies")
        threading.Thread(target=_die_mid_stream, args=(copies,), daemon=True).start()
    _next(holder, 2)
    ck.save(2)  # committed on both ranks; rank 1 dies while rank 0's copy streams to it
    if rank == 1:
        time.sleep(600)
    second, t_wait = _timed(ck.wait_protected)
    third, t_save = _timed(lambda: ck.save(3))  # the peer is gone: the save fails, it does not hang
    t0 = time.monotonic()
    ck.close()
    return {"first": first, "second": second, "t_wait": t_wait, "third": third, "t_save": t_save,
            "t_close": time.monotonic() - t0, "protected": ck.protected_step()}


def test_a_peer_killed_mid_stream_stops_replication_and_nothing_hangs(tmp_path):
    got = run_ranks(2, _killed_mid_stream, str(tmp_path), out=tmp_path / "out", killed=(1,))[0]
    assert got["first"] == 1 and got["protected"] == 1, got
    assert got["second"] is not None and got["second"][0] == "ReplicationError", got
    assert "step 2 is committed but not protected" in got["second"][1] and RESTART in got["second"][1], got
    assert got["third"] is not None, got
    for k in ("t_wait", "t_save", "t_close"):
        assert got[k] < TIMEOUT_S + 5, (k, got)
    n0 = tmp_path / "n0"
    assert sorted(p.name for p in n0.glob("step_*")) == [step_dir_name(1), step_dir_name(2)]  # keep_last=1
    assert (n0 / step_dir_name(1) / "protected").exists() and not (n0 / step_dir_name(2) / "protected").exists()
    assert not list((n0 / step_dir_name(2) / "copies").glob(".tmp-*"))  # rank 1's half copy is removed


class _HangAtReplication(logging.Handler):
    """Holds this rank's replication thread (not the save's) for ``seconds`` as it begins
    replicating ``step``: a peer that hangs past the timeout, while the job goes on."""

    def __init__(self, step: int, seconds: float):
        super().__init__(logging.DEBUG)
        self.step, self.seconds = step, seconds

    def handle(self, record: logging.LogRecord) -> bool:  # no handler lock: other threads log freely
        if f"replicates step {self.step} " in record.getMessage():
            time.sleep(self.seconds)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        pass


def _hung_peer(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    holder = state(1)
    ck = _open(tmp, rank, holder)
    ck.save(1)
    first = ck.wait_protected()
    if rank == 1:
        log = logging.getLogger("gdswriter")
        log.setLevel(logging.DEBUG)
        log.addHandler(_HangAtReplication(2, TIMEOUT_S + 3))
    _next(holder, 2)
    ck.save(2)
    second = caught(ck.wait_protected) if rank == 0 else None  # rank 0 times out waiting for rank 1
    dist.barrier()  # the training's own group: the job goes on together
    _next(holder, 3)
    ck.save(3)  # the job goes on: committed on every rank
    third, t_third = _timed(ck.wait_protected)
    t0 = time.monotonic()
    ck.close()
    return {"first": first, "second": second, "third": third, "t_third": t_third,
            "t_close": time.monotonic() - t0, "steps": ck.steps(), "protected": ck.protected_step()}


def test_a_broken_replication_group_fails_later_steps_at_once(tmp_path):
    got = run_ranks(2, _hung_peer, str(tmp_path), out=tmp_path / "out")
    zero, one = got
    assert zero["first"] == one["first"] == 1, got
    assert zero["second"] is not None and "step 2 is committed but not protected" in zero["second"][1], got
    for g in got:  # step 3 is committed, never tried: ReplicationError at once, saying to restart
        assert g["third"] is not None and g["third"][0] == "ReplicationError", g
        assert "step 3 is committed but not protected" in g["third"][1] and RESTART in g["third"][1], g
        assert "stopped after" in g["third"][1] and "saw, 1, is kept by retention" in g["third"][1], g
        assert g["t_close"] < 5, g
    assert zero["t_third"] < 5, zero  # rank 0's group broke at step 2: step 3 fails at once
    assert one["t_third"] < 2 * TIMEOUT_S + 10, one  # rank 1 waits out one timeout at most, then stops
    assert zero["steps"] == [1, 3] and zero["protected"] == 1, zero  # keep_last=1 keeps the newest protected
    n0 = tmp_path / "n0"
    assert (n0 / step_dir_name(1) / "protected").exists() and not (n0 / step_dir_name(3) / "protected").exists()
