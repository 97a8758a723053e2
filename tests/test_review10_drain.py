"""Review (tenth session): what a drain leaves at the drain root (format.md 6.1: a `.tmp-*`
directory left is removed by the next drain). A step saved again after it was drained is
"not drained again": its second drain directory holds every rank's mark, and since last
session a rank keeps any directory holding its own mark, so no rank ever removed it: a whole
copy of the step stayed at the drain root for good, one more per step saved again. 2 real gloo
ranks, node-local roots, one shared drain root; GDSCheckpointer's drain and DCP's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.ranks import run_ranks
from test_drain_ranks import _drained_everywhere, _leftovers, _open, _set, state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save_again(rank: int, world: int, tmp: str) -> dict:
    holder = _set(state(rank, 0), rank, 1)
    ck = _open(tmp, rank, holder)
    ck.save(1)
    _drained_everywhere(ck)
    _set(holder, rank, 2)
    ck.save(1)  # step 1 saved again (a resumed run): not drained again
    _drained_everywhere(ck)
    left = _leftovers(Path(tmp, "shared"))
    _set(holder, rank, 3)
    ck.save(2)
    newest = _drained_everywhere(ck)
    error = ck.drain_error() if hasattr(ck, "drain_error") else None
    ck.close()
    return {"left_between": left, "newest": newest, "error": error}


def test_a_step_saved_again_leaves_no_drain_directory_behind(tmp_path):
    res = run_ranks(2, _save_again, str(tmp_path), out=tmp_path / "r")
    assert [x["newest"] for x in res] == [2, 2], res
    assert _leftovers(tmp_path / "shared") == [], os.listdir(tmp_path / "shared")


def _dcp_save_again(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from support.dcp import node_writer
    from test_dcp_drain import state as dcp_state_of

    w = node_writer(rank, Path(tmp, f"node{rank}"), drain_root=str(Path(tmp, "shared")), drain_every=1)
    for step, values in ((0, 0), (0, 1), (1, 2)):  # step 0 saved again: not drained again
        w.reset(step)
        dcp.save(dcp_state_of(values), storage_writer=w)
        drained = w.wait_drained()  # the steps this rank committed at the drain root
        dist.barrier()  # every rank's drain of this step ended
    w.close()
    return {"drained": drained}


def test_a_dcp_step_saved_again_leaves_no_drain_directory_behind(tmp_path):
    res = run_ranks(2, _dcp_save_again, str(tmp_path), out=tmp_path / "r")
    assert sorted(s for x in res for s in x["drained"]) == [0, 1], res
    assert _leftovers(tmp_path / "shared") == [], os.listdir(tmp_path / "shared")


def test_only_a_finished_drain_directory_of_a_step_already_drained_is_removed_despite_its_mark(tmp_path):
    """Rank 0 enters step 3's drain (world 2). Kept, though of other saves: step 1's directory
    where rank 1 has not marked yet (rank 1 may still copy), and step 2's, finished but its
    step not at the drain root (its publisher may be renaming it now). Removed: step 1's
    finished one (every mark, the draft) while step 1 is committed there (a save again)."""
    from gdswriter.distributed.drain import DRAFT_NAME, MARK_PREFIX, enter_drain_dir

    root = tmp_path / "shared"
    (root / "step_000000000001").mkdir(parents=True)
    (root / "step_000000000001" / "manifest.json").write_bytes(b"{}")

    def drain_dir(step: int, token: str, marks: tuple[int, ...]) -> Path:
        d = root / f".tmp-step_{step:012d}-{token}"
        d.mkdir()
        (d / DRAFT_NAME).write_bytes(b'{"dist": {"world_size": 2}}')  # (what its draft says of its save's world)
        for r in marks:
            (d / f"{MARK_PREFIX}{r}").write_bytes(b"{}")
        return d

    waiting, finished_later = drain_dir(1, "aaaa", (0,)), drain_dir(2, "bbbb", (0, 1))
    superseded = drain_dir(1, "cccc", (0, 1))
    enter_drain_dir(root, 3, "dddd", clean=True, marked=0, world=2)
    assert waiting.is_dir() and finished_later.is_dir()
    assert not superseded.exists()
    assert sorted(n for n in os.listdir(root) if n.startswith(".trash-")) == []


def _publish_fails_once(rank: int, world: int, tmp: str) -> dict:
    """Step 1's publishing rename fails (EIO, on whichever rank marks last), after every rank
    marked and the draft went in; then step 2 is saved and drained as usual."""
    import errno

    import torch.distributed as dist

    from gdswriter import DrainError

    holder = _set(state(rank, 0), rank, 1)
    ck = _open(tmp, rank, holder)
    real, failing = os.rename, [True]

    def rename(src, dst, *a, **k):
        if failing[0] and Path(dst).parent == Path(tmp, "shared") and Path(dst).name.startswith("step_"):
            raise OSError(errno.EIO, "injected: the publishing rename failed", str(dst))
        return real(src, dst, *a, **k)

    os.rename = rename  # in this rank's process only
    failed = False
    try:
        ck.save(1)
        try:
            ck.wait_drained()
        except DrainError:
            failed = True  # the rank whose rename failed
        dist.barrier()
    finally:
        os.rename = real
    failing[0] = False
    left = _leftovers(Path(tmp, "shared"))
    _set(holder, rank, 2)
    ck.save(2)
    newest = _drained_everywhere(ck)
    ck.close()
    return {"left_after_1": left, "newest": newest, "failed": failed}


def test_a_finished_drain_whose_publish_failed_is_committed_by_the_next_drain(tmp_path):
    """Every rank marked step 1's directory and the draft is in, but its rename failed: no rank
    removes it (each holds its mark) and, before, none ever published it. The next drain (step
    2) of a rank that marked it finishes the protocol for it (any rank finding every mark and the
    draft may commit): step 1 is committed there and loads bit-exact, nothing is left behind."""
    res = run_ranks(2, _publish_fails_once, str(tmp_path), out=tmp_path / "r")
    # its directory left; the rank whose rename failed says so (both, where both found every mark at once)
    assert all(x["left_after_1"] for x in res) and any(x["failed"] for x in res), res
    assert [x["newest"] for x in res] == [2, 2], res
    shared = tmp_path / "shared"
    assert _leftovers(shared) == [], os.listdir(shared)
    assert (shared / "step_000000000001" / "manifest.json").is_file()
    got = run_ranks(2, _load_step_from_drain, str(tmp_path), out=tmp_path / "load")
    assert got == [True, True], got


def _load_step_from_drain(rank: int, world: int, tmp: str) -> bool:
    from gdswriter import GDSCheckpointer

    from test_drain_ranks import _equal

    holder = state(rank, 0)
    with GDSCheckpointer(holder, root=f"{tmp}/shared") as ck:
        ck.load(1)
    return _equal(holder, rank, 1)
