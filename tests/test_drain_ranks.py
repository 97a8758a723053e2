"""The drain of a checkpointer of several ranks (issue 39 item 4, format.md 6.1), on 2 real
gloo ranks, each with its own node-local root and one shared drain root: the drained step loads
bit-exact from the drain root alone; a rank killed mid-drain or a damaged local file on one
rank leaves the drain root at its previous drained step, and the next drain removes what the
failed one left."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import gdswriter
from gdswriter import CheckpointOptions, GDSCheckpointer
from gdswriter.cli import main as cli_main
from support.drain import GatedEngine, drain_errors
from support.ranks import caught, run_ranks

MiB = 1 << 20


def state(rank: int, step: int) -> dict:
    """Two 4 MiB tensors (above every small-copy threshold) that depend on the step: the same on
    every rank (a data-parallel model: each rank writes its share of the bytes)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"a": torch.randn(MiB, generator=g), "b": torch.randint(0, 1 << 30, (MiB,), generator=g)}


def _set(holder: dict, rank: int, step: int) -> dict:
    for k, v in state(rank, step).items():
        holder[k].copy_(v)
    return holder


def _equal(got: dict, rank: int, step: int) -> bool:
    got, want = got.get("model", got), state(rank, step)
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-")))


def _open(tmp: str, rank: int, holder: dict, engine=None) -> GDSCheckpointer:
    return GDSCheckpointer(holder, root=f"{tmp}/n{rank}", options=CheckpointOptions(drain_root=f"{tmp}/shared"),
                           drain_engine=engine)


def _drained_everywhere(ck: GDSCheckpointer) -> int | None:
    """This rank's drains ended, then every rank's (a barrier): the drain root's newest step."""
    import torch.distributed as dist

    ck.wait_drained()
    dist.barrier()
    return ck.drained_step()


def _save_two(rank: int, world: int, tmp: str) -> dict:
    holder = _set(state(rank, 0), rank, 1)
    ck = _open(tmp, rank, holder)
    ck.save(1)
    first = _drained_everywhere(ck)
    _set(holder, rank, 2)
    ck.save(2)
    _set(holder, rank, 3)  # changed after the save: the drain copies the committed files, not the live state
    second = _drained_everywhere(ck)
    ck.close()
    return {"first": first, "second": second}


def _load_from_drain(rank: int, world: int, tmp: str) -> dict:
    holder = state(rank, 0)
    with GDSCheckpointer(holder, root=f"{tmp}/shared") as ck:
        res = ck.load()
    return {"step": res, "equal": _equal(holder, rank, 2)}


def test_drained_step_loads_bit_exact_from_the_drain_root_alone(tmp_path):
    got = run_ranks(2, _save_two, str(tmp_path), out=tmp_path / "out")
    assert got == [{"first": 1, "second": 2}] * 2
    shared = tmp_path / "shared"
    assert _leftovers(shared) == []
    for r in range(2):
        shutil.rmtree(tmp_path / f"n{r}")  # every node replaced: only the drain root is left
    assert run_ranks(2, _load_from_drain, str(tmp_path), out=tmp_path / "out2") == [{"step": 2, "equal": True}] * 2
    step, whole = gdswriter.load_state(shared)
    assert step == 2 and _equal(whole, 0, 2)
    assert _equal(gdswriter.load_state(shared, 1)[1], 0, 1)
    assert cli_main(["verify", str(shared)]) == 0


def _drained_then_armed(tmp: str, rank: int, armed: dict, before_read):
    """Step 1 saved and drained on every rank; then rank 1's read gate armed and step 2 saved:
    (the checkpointer, the step drained first)."""
    holder = _set(state(rank, 0), rank, 1)
    ck = _open(tmp, rank, holder, GatedEngine(before_read) if rank == 1 else None)
    ck.save(1)
    first = _drained_everywhere(ck)
    armed["on"] = True
    _set(holder, rank, 2)
    ck.save(2)
    return ck, first


def _killed_mid_drain(rank: int, world: int, tmp: str) -> dict:
    """Step 1 drained by both ranks; rank 1 dies of SIGKILL as its drain of step 2 reads its
    first data file (rank 0 drains its part of step 2 and marks it)."""
    armed = {"on": False}

    def before_read(n: int) -> None:
        if armed["on"]:
            os.kill(os.getpid(), signal.SIGKILL)

    ck, first = _drained_then_armed(tmp, rank, armed, before_read)
    if rank == 1:
        time.sleep(600)  # killed by its drain
    ck.wait_drained()
    return {"first": first, "after": ck.drained_step()}


def _next_drain(rank: int, world: int, tmp: str) -> dict:
    holder = _set(state(rank, 0), rank, 3)
    ck = _open(tmp, rank, holder)
    ck.save(3)
    drained = _drained_everywhere(ck)
    ck.close()
    return {"drained": drained}


def test_rank_killed_mid_drain_leaves_the_previous_drained_step(tmp_path):
    got = run_ranks(2, _killed_mid_drain, str(tmp_path), out=tmp_path / "out", killed=(1,))
    assert got[0] == {"first": 1, "after": 1}
    shared = tmp_path / "shared"
    step, whole = gdswriter.load_state(shared)
    assert step == 1 and _equal(whole, 0, 1)
    assert cli_main(["verify", str(shared)]) == 0
    left = _leftovers(shared)
    assert len(left) == 1 and left[0].startswith(".tmp-step_000000000002-")
    assert (shared / left[0] / ".drained-rank-0").exists() and not (shared / left[0] / ".drained-rank-1").exists()
    assert run_ranks(2, _next_drain, str(tmp_path), out=tmp_path / "out2") == [{"drained": 3}] * 2
    assert _leftovers(shared) == []
    assert _equal(gdswriter.load_state(shared)[1], 0, 3) and _equal(gdswriter.load_state(shared, 1)[1], 0, 1)


def _damaged_on_one_rank(rank: int, world: int, tmp: str) -> dict:
    """Rank 1's local data file of step 2 gets a flipped byte just before its drain reads it."""
    armed = {"on": False}

    def before_read(n: int) -> None:
        if armed["on"]:
            armed["on"] = False
            for f in Path(tmp, f"n{rank}", "step_000000000002").glob("data-*.bin"):
                with open(f, "r+b") as fh:
                    fh.seek(f.stat().st_size // 2)
                    b = fh.read(1)
                    fh.seek(-1, 1)
                    fh.write(bytes([b[0] ^ 0xFF]))

    ck, first = _drained_then_armed(tmp, rank, armed, before_read)
    error = caught(ck.wait_drained)
    import torch.distributed as dist
    dist.barrier()
    after = ck.drained_step()
    ck.close()
    return {"first": first, "after": after, "error": error and error[0]}


def test_damaged_local_file_on_one_rank_drains_nothing_of_that_step(tmp_path):
    got = run_ranks(2, _damaged_on_one_rank, str(tmp_path), out=tmp_path / "out")
    assert got == [{"first": 1, "after": 1, "error": None}, {"first": 1, "after": 1, "error": "DrainError"}]
    shared = tmp_path / "shared"
    step, whole = gdswriter.load_state(shared)
    assert step == 1 and _equal(whole, 0, 1)
    assert cli_main(["verify", str(shared)]) == 0


def test_a_rank_finding_the_step_committed_by_another_rank_after_its_listing_is_no_error(tmp_path):
    """Both ranks' listings found every mark and the draft; the other rank's rename (the commit
    point) lands before this rank reads the draft. This rank's commit finds the step committed
    by the other (the marks it listed are in step_S): no DrainError (the drain of a drained step
    used to fail, by the draft's path); an earlier drain's step_S there: not drained again. A
    directory gone and no step_S (removed by another drain) stays an error."""
    from gdswriter.distributed.drain import DRAFT_NAME, MARK_PREFIX, RankDrainer, put_mark

    root = tmp_path / "shared"
    final = root / "step_000000000001"
    drainer = RankDrainer.__new__(RankDrainer)
    drainer.root = root

    def drain_dir() -> Path:
        d = root / ".tmp-step_000000000001-abcd"
        d.mkdir(parents=True)
        (d / DRAFT_NAME).write_bytes(b"{}")
        (d / f"{MARK_PREFIX}1").write_bytes(b'{"size": 7}')
        marks = put_mark(d, 0, {"size": 3})
        assert marks is not None and marks.complete(2)
        return d

    def other_commits(d: Path) -> None:  # the other rank's commit point
        (d / "manifest.json").write_bytes(b"{}")
        os.rename(d, final)

    committed = [f"{MARK_PREFIX}0", f"{MARK_PREFIX}1", DRAFT_NAME, "manifest.json"]
    d = drain_dir()
    other_commits(d)
    assert drainer._publish(1, d, {0: {"size": 3}, 1: {"size": 7}}) is False
    assert sorted(os.listdir(final)) == sorted(committed)

    (final / f"{MARK_PREFIX}1").write_bytes(b'{"size": 8}')  # step_S is another drain's: not this one
    # (an earlier save's step S: this one is not drained again, as when the rename finds step_S;
    # d removed, finished, by a rank's next drain, drain._settled: no error either)
    assert drainer._publish(1, d, {0: {"size": 3}, 1: {"size": 7}}) is False
    shutil.rmtree(final)  # gone, and not committed: not drained, an error
    with pytest.raises(FileNotFoundError):
        drainer._publish(1, d, {0: {"size": 3}, 1: {"size": 7}})


def test_a_faster_ranks_next_drain_leaves_a_slower_ranks_drain_of_the_step_before(tmp_path):
    """Rank 1 marked step 1 and its drain of step 2 starts; rank 0 is still copying its files of
    step 1 into step 1's directory (no collective between drains). Rank 1's clean-up must leave
    that directory: removing it makes rank 0's drain of step 1 fail, and step 1 never drains."""
    from gdswriter.distributed.drain import enter_drain_dir, put_mark

    root = tmp_path / "shared"
    root.mkdir()
    d1 = enter_drain_dir(root, 1, "aaaa", clean=True)  # rank 0 and rank 1 in step 1 (save token aaaa)
    (d1 / "data-rank00000.bin").write_bytes(b"rank 0 still copying")
    assert put_mark(d1, 1, {"size": 1}) is not None  # rank 1 done with step 1
    enter_drain_dir(root, 2, "bbbb", clean=True, marked=1)  # rank 1's drain of step 2 (RankDrainer)
    (d1 / "data-rank00000.bin").write_bytes(b"rank 0 still copying, more")  # rank 0 goes on
    assert put_mark(d1, 0, {"size": 1}).complete(2) is False  # no draft here: only the marks matter
    enter_drain_dir(root, 3, "cccc", clean=True, marked=2)  # a rank with no mark there: it can never commit
    assert not d1.exists()


def _slow_rank_zero(rank: int, world: int, tmp: str) -> dict:
    """Rank 0's drain of step 1 waits at its first read until rank 1 has done its part of step 1
    and of step 2 (its drain of step 2 cleaned the drain root then); both ranks then wait for
    every drain. No collective links two ranks' drains, so this order happens by itself when
    one rank's disk is slower."""

    signal_file = Path(tmp) / "rank1-drained-2"

    def before_read(n: int) -> None:
        deadline = time.monotonic() + 120
        while n == 1 and not signal_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    holder = _set(state(rank, 0), rank, 1)
    ck = _open(tmp, rank, holder, GatedEngine(before_read) if rank == 0 else None)
    ck.save(1)
    _set(holder, rank, 2)
    ck.save(2)
    errors = drain_errors(ck.wait_drained, signal_after_two=signal_file if rank == 1 else None)
    import torch.distributed as dist

    dist.barrier()
    ck.close()
    return {"errors": errors}


def test_a_slower_ranks_drain_of_a_step_survives_a_faster_ranks_next_drain(tmp_path):
    """Rank 1 drains its part of steps 1 and 2 while rank 0 still copies step 1: rank 1's clean-up
    at step 2 used to remove step 1's directory under rank 0 (a DrainError, step 1 never
    drained); now both steps drain, with no error and nothing left over."""
    got = run_ranks(2, _slow_rank_zero, str(tmp_path), out=tmp_path / "out")
    assert got == [{"errors": []}] * 2, got
    shared = tmp_path / "shared"
    assert sorted(n for n in os.listdir(shared) if n.startswith("step_")) == \
        ["step_000000000001", "step_000000000002"]
    assert _leftovers(shared) == []
