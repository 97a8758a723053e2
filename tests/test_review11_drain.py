"""Review (eleventh session): a drain directory left by a save of an earlier job whose world
was larger (a node lost, the job restarted on fewer ranks: elastic) holds the marks of ranks
0..W'-1 and the draft. The next drain's clean-up (drain.py enter_drain_dir: _settled) judged
"every rank marked" by the *new* world: it found the directory finished and committed it at
the drain root, with the lost ranks' files never copied in: a committed step there that does
not load. The save's own world (its draft's) decides. Real gloo ranks (3, then 2), node-local
roots, one shared drain root; DCP's drain and GDSCheckpointer's."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-")))


def _failing_mark(real):
    """put_mark whose write of this rank's mark fails (EIO): the rank never marks."""
    def put_mark(d, rank, mark):
        if rank is not None:
            raise OSError(errno.EIO, "injected: writing the drain mark failed", str(d))
        return real(d, rank, mark)
    return put_mark


def _dcp_old_job(rank: int, world: int, tmp: str) -> dict:
    """World 3: step 1 saved and committed; rank 2's mark fails (EIO): it never marks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import gdswriter.distributed.dcp_drain as dcp_drain
    from gdswriter.errors import DrainError
    from support.dcp import dcp_state, node_writer

    if rank == 2:
        dcp_drain.put_mark = _failing_mark(dcp_drain.put_mark)
    w = node_writer(rank, Path(tmp, f"old{rank}"), drain_root=str(Path(tmp, "shared")), drain_every=1)
    w.reset(1)
    dcp.save(dcp_state(700 + rank, 1), storage_writer=w)
    failed = False
    try:
        w.wait_drained()
    except DrainError:
        failed = True
    dist.barrier()
    w.close()
    return {"failed": failed}


def _dcp_new_job(rank: int, world: int, tmp: str) -> dict:
    """World 2 (a node lost), the same drain root: step 2 saved and drained."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gdswriter.errors import DrainError
    from support.dcp import dcp_state, node_writer

    w = node_writer(rank, Path(tmp, f"new{rank}"), drain_root=str(Path(tmp, "shared")), drain_every=1)
    w.reset(2)
    dcp.save(dcp_state(700 + rank, 2), storage_writer=w)
    error = None
    try:
        w.wait_drained()
    except DrainError as e:
        error = str(e)
    dist.barrier()
    w.close()
    return {"error": error}


def test_a_dcp_drain_left_by_a_larger_world_is_not_committed_by_a_smaller_one(tmp_path):
    old = run_ranks(3, _dcp_old_job, str(tmp_path), out=tmp_path / "old")
    assert [x["failed"] for x in old] == [False, False, True], old
    shared = tmp_path / "shared"
    assert not (shared / "step_000000000001").exists() and len(_leftovers(shared)) == 1
    new = run_ranks(2, _dcp_new_job, str(tmp_path), out=tmp_path / "new")
    assert all(x["error"] is None for x in new), new
    steps = sorted(n for n in os.listdir(shared) if n.startswith("step_"))
    assert steps == ["step_000000000002"], (steps, _leftovers(shared))  # step 1 lacks rank 2's files
    assert (shared / "latest").read_text().strip() == "2"
    assert _leftovers(shared) == []  # and it can never commit: removed


def _ck_job(rank: int, world: int, tmp: str, tag: str, step: int) -> dict:
    """A GDSCheckpointer job of ``world`` ranks on roots ``<tag><rank>`` saving ``step``; in the
    old job (world 3) rank 2's mark fails (EIO): it never marks."""
    import torch.distributed as dist

    import gdswriter.distributed.drain as drain_mod
    from gdswriter import CheckpointOptions, DrainError, GDSCheckpointer
    from test_drain_ranks import state

    if world == 3 and rank == 2:
        drain_mod.put_mark = _failing_mark(drain_mod.put_mark)
    holder = state(rank, step)
    ck = GDSCheckpointer(holder, root=f"{tmp}/{tag}{rank}", options=CheckpointOptions(drain_root=f"{tmp}/shared"))
    ck.save(step)
    failed = False
    try:
        ck.wait_drained()
    except DrainError:
        failed = True
    dist.barrier()
    ck.close()
    return {"failed": failed}


def test_a_checkpointer_drain_left_by_a_larger_world_is_removed_by_a_smaller_one(tmp_path):
    """As above, GDSCheckpointer's drain: the directory (marks 0 and 1 of a world of 3) was not
    committed (its publish refuses 2 shards of 3), but ranks 0 and 1 each kept it for good (their
    mark is in): a whole copy of the step left at the drain root, and a warning at every drain."""
    old = run_ranks(3, _ck_job, str(tmp_path), "old", 1, out=tmp_path / "old")
    assert [x["failed"] for x in old] == [False, False, True], old
    shared = tmp_path / "shared"
    assert len(_leftovers(shared)) == 1
    new = run_ranks(2, _ck_job, str(tmp_path), "new", 2, out=tmp_path / "new")
    assert not any(x["failed"] for x in new), new
    assert sorted(n for n in os.listdir(shared) if n.startswith("step_")) == ["step_000000000002"]
    assert _leftovers(shared) == [], _leftovers(shared)
