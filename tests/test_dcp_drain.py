"""The drain of DCP steps to a shared root (issue 39 items 4 and 6; distributed/dcp_drain.py):
two real gloo ranks, each its own node-local root, save through GDSStorageWriter with
CheckpointOptions(drain_root=SHARED); every drained step becomes a complete, committed step
under SHARED that GDSStorageReader(SHARED) loads bit-exact with no node-local copy left."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gdswriter.cli import main as cli_main
from support.dcp import dcp_load, dcp_state, flip, node_writer
from support.drain import drain_errors
from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def state(step: int) -> dict:
    return dcp_state(700, step)


def _drain_worker(rank: int, world: int, tmp: str, every: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from support.dcp import engine
    from gdswriter.distributed import GDSStorageReader

    root, shared = Path(tmp, f"node{rank}"), Path(tmp, "shared")
    w = node_writer(rank, root, drain_root=str(shared), drain_every=every)
    drained = []
    for step in range(3):
        w.reset(step)
        if step == 2:
            dcp.async_save(state(step), storage_writer=w).result()
        else:
            dcp.save(state(step), storage_writer=w)
    drained = w.wait_drained()
    w.close()
    torch.distributed.barrier()
    shutil.rmtree(root)  # every node replaced: no local copy left
    torch.distributed.barrier()
    out: dict = {"drained": drained, "loads": {}}
    for step in range(3):
        err, exact, _ = dcp_load(shared, step, state(step))
        out["loads"][str(step)] = [err and err[0], exact]
    back = {k: torch.zeros_like(v) for k, v in state(2).items()}
    dcp.load(back, checkpoint_id=str(shared), storage_reader=GDSStorageReader(engine_options=engine()))
    out["latest"] = all(torch.equal(back[k], v) for k, v in state(2).items())
    return out


@pytest.mark.parametrize("every", [1, 2])
def test_drained_dcp_steps_load_from_the_drain_root_alone(tmp_path, capsys, every):
    """Steps 0-2 (step 2 by async_save) with drain_every=1 and 2: the drained steps (all; 0 and 2)
    are committed under the drain root (no temporary directory left), `gdswriter verify` passes
    there, and after every node-local root is removed each loads bit-exact from the drain root
    (by step, and as its latest through checkpoint_id); a step not drained is not there."""
    got = run_ranks(2, _drain_worker, str(tmp_path), every, out=tmp_path / "ranks")
    wanted = [s for s in range(3) if s % every == 0]
    assert sorted(s for x in got for s in x["drained"]) == wanted, got
    shared = tmp_path / "shared"
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith("step_")) == \
        [f"step_{s:012d}" for s in wanted]
    assert not [p for p in shared.iterdir() if p.name.startswith(".tmp")]
    assert (shared / ".metadata").exists() and (shared / "latest").read_text().strip() == "2"
    for rank, x in enumerate(got):
        for step in range(3):
            err, exact = x["loads"][str(step)]
            if step in wanted:
                assert err is None and exact, (rank, step, x)
            else:
                assert err is not None, (rank, step, x)
        assert x["latest"], (rank, x)
    assert cli_main(["verify", str(shared), "--all"]) == 0


def _flipped_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import gdswriter.distributed.dcp_writer as dcp_mod
    from gdswriter.errors import DrainError

    root, shared = Path(tmp, f"node{rank}"), Path(tmp, "shared")
    w = node_writer(rank, root, drain_root=str(shared))
    real = dcp_mod.write_files

    def flipping(*a, **k):  # a byte of rank 1's newest data file goes bad after its write, before the drain
        out = real(*a, **k)
        flip(max((p for p in root.rglob("*.bin") if "copies" not in p.parts), key=lambda p: p.stat().st_mtime_ns))
        return out
    out: dict = {"errors": {}}
    for step in range(3):
        if rank == 1 and step == 1:
            dcp_mod.write_files = flipping
        w.reset(step)
        try:
            dcp.save(state(step), storage_writer=w)
        finally:
            dcp_mod.write_files = real
        try:
            w.wait_drained()
        except DrainError as e:
            out["errors"][str(step)] = str(e)
    w.close()
    torch.distributed.barrier()
    out["load1"] = dcp_load(shared, 1, state(1))[0]
    return out


def test_a_dcp_step_with_a_damaged_local_file_is_not_drained(tmp_path):
    """A byte of rank 1's data file of step 1 flipped after its write, before the drain copies it:
    the drain's crc32c check refuses it, so step 1 never commits at the drain root (rank 1's
    wait_drained says why; loading step 1 there fails on every rank), while steps 0 and 2 are
    drained and no temporary directory is left."""
    got = run_ranks(2, _flipped_worker, str(tmp_path), out=tmp_path / "ranks")
    shared = tmp_path / "shared"
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith("step_")) == \
        ["step_000000000000", "step_000000000002"], got
    assert list(got[1]["errors"]) == ["1"] and "checksum" in got[1]["errors"]["1"], got
    assert not got[0]["errors"], got
    assert not [p for p in shared.iterdir() if p.name.startswith(".tmp")], got
    assert all(x["load1"] is not None for x in got), got


def _retained_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp

    root, shared = Path(tmp, f"node{rank}"), Path(tmp, "shared")
    w = node_writer(rank, root, drain_root=str(shared), keep_last=2, keep_every=3)
    for step in range(6):
        w.reset(step)
        dcp.save(state(step), storage_writer=w)
        w.wait_drained()
        if step == 1 and rank == 0:  # a deletion a crash interrupted: renamed out of the way, not yet removed
            (shared / ".trash-step_000000000099-deadbeef").mkdir()
            (shared / ".trash-step_000000000099-deadbeef" / "manifest.json").write_bytes(b"{")
        torch.distributed.barrier()
    w.close()
    torch.distributed.barrier()
    return {"loads": {str(s): dcp_load(shared, s, state(s))[:2] for s in (3, 4, 5)}}


def test_the_dcp_drain_root_keeps_drain_keep_last_and_keep_every(tmp_path):
    """Steps 0-5 drained with keep_last=2 (drain_keep_last defaults to it) and keep_every=3: the
    drain root keeps steps 0 and 3 (keep_every) and 4 and 5 (the newest two), no temporary
    directory nor the trash a crashed deletion left, `latest` names 5, and steps 3-5 load
    bit-exact from it on every rank."""
    got = run_ranks(2, _retained_worker, str(tmp_path), out=tmp_path / "ranks")
    shared = tmp_path / "shared"
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith("step_")) == \
        [f"step_{s:012d}" for s in (0, 3, 4, 5)], got
    assert not [p for p in shared.iterdir() if p.name.startswith((".tmp", ".trash"))]
    assert (shared / "latest").read_text().strip() == "5"
    for rank, x in enumerate(got):
        for s, (err, exact) in x["loads"].items():
            assert err is None and exact, (rank, s, x)


def test_a_mark_written_as_another_rank_commits_the_step_is_no_error(tmp_path, monkeypatch):
    """A rank's mark is the last one: the other rank, finding every mark, renames the temporary
    directory to step_S before this rank has fsynced and listed it. This rank still sees its
    mark and the draft (drain.put_mark: one descriptor of the directory, shared by both drains),
    and its own commit then finds the step committed by the other: no DrainError (a rank's drain
    used to fail there, by the path)."""
    import os

    from gdswriter.distributed import dcp_drain
    from gdswriter.distributed.drain import DRAFT_NAME, MARK_PREFIX, put_mark

    root = tmp_path / "shared"
    d = root / ".tmp-step_000000000001-abcd"
    d.mkdir(parents=True)
    (d / DRAFT_NAME).write_bytes(b"{}")
    (d / f"{MARK_PREFIX}1").write_bytes(b'{"size": 7}')
    rename = os.rename

    def rename_then_commit(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if not (root / "step_000000000001").exists():
            (d / "manifest.json").write_bytes(b"{}")
            rename(d, root / "step_000000000001")  # the other rank's commit point

    drain = dcp_drain.DcpDrain.__new__(dcp_drain.DcpDrain)
    drain.root = root
    monkeypatch.setattr(os, "rename", rename_then_commit)
    marks = put_mark(d, 0, {"size": 3})
    assert marks is not None and marks.complete(2) and not marks.complete(3)
    assert marks.found == {0: {"size": 3}, 1: {"size": 7}}
    monkeypatch.setattr(os, "rename", rename)
    assert drain._publish(1, d) is False
    assert sorted(p.name for p in (root / "step_000000000001").iterdir()) == \
        sorted([f"{MARK_PREFIX}0", f"{MARK_PREFIX}1", DRAFT_NAME, "manifest.json"])
    # rank 0 wrote the draft last, and the other rank, marking then, committed before rank 0 looked
    assert put_mark(d, None, {}) is None
    with pytest.raises(FileNotFoundError):  # a rank with a mark: its mark must be in before any commit
        put_mark(d, 0, {})
    with pytest.raises(FileNotFoundError):  # gone, and not committed: not drained (a DrainError)
        put_mark(root / ".tmp-step_000000000002-abcd", None, {})


def test_a_mark_that_is_not_a_json_object_fails_the_drain_and_leaves_the_directory(tmp_path):
    """A mark another job (or a damaged disk) left that is no JSON object is a DrainError naming
    it, raised before this rank could commit from it; nothing is removed."""
    from gdswriter.distributed.drain import DRAFT_NAME, MARK_PREFIX, put_mark
    from gdswriter.errors import DrainError

    d = tmp_path / ".tmp-step_000000000004-abcd"
    d.mkdir()
    (d / DRAFT_NAME).write_bytes(b"{}")
    (d / f"{MARK_PREFIX}1").write_bytes(b"[1, 2]")
    with pytest.raises(DrainError, match=f"{MARK_PREFIX}1 is not a drain mark") as e:
        put_mark(d, 0, {"size": 1})
    assert e.value.step == 4
    assert sorted(p.name for p in d.iterdir()) == sorted([DRAFT_NAME, f"{MARK_PREFIX}0", f"{MARK_PREFIX}1"])


def test_a_draft_gone_between_its_check_and_its_read_is_the_other_ranks_commit(tmp_path, monkeypatch):
    """The other rank's rename (the commit point) lands between this rank's look for the draft
    and its read of it: the step is committed, by the other rank; no DrainError (the read of the
    draft's path used to raise FileNotFoundError out of the commit)."""
    import os
    import pathlib

    from gdswriter.distributed import dcp_drain
    from gdswriter.distributed.drain import DRAFT_NAME, MARK_PREFIX

    root = tmp_path / "shared"
    d = root / ".tmp-step_000000000001-abcd"
    d.mkdir(parents=True)
    (d / DRAFT_NAME).write_bytes(b"{}")
    (d / f"{MARK_PREFIX}0").write_bytes(b"{}")
    final = root / "step_000000000001"
    read_bytes = pathlib.Path.read_bytes

    def committed_first(self):
        if self == d / DRAFT_NAME and d.exists():
            (d / "manifest.json").write_bytes(b"{}")
            os.rename(d, final)  # the other rank's commit point
        return read_bytes(self)

    drain = dcp_drain.DcpDrain.__new__(dcp_drain.DcpDrain)
    drain.root = root
    monkeypatch.setattr(pathlib.Path, "read_bytes", committed_first)
    assert drain._publish(1, d) is False
    assert sorted(os.listdir(final)) == sorted([f"{MARK_PREFIX}0", DRAFT_NAME, "manifest.json"])


def _slow_rank_one(rank: int, world: int, tmp: str) -> dict:
    """Rank 1's drain of step 0 waits before its first copy until rank 0 did its whole part of
    steps 0 and 1 (rank 0's draft of step 1 cleans the drain root); then every drain ends."""
    import time

    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import dcp_drain

    root, shared, signal_file = Path(tmp, f"node{rank}"), Path(tmp, "shared"), Path(tmp, "rank0-drained-1")
    real = dcp_drain.copy_checked

    def held(*a, **k):
        deadline = time.monotonic() + 120
        while not signal_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return real(*a, **k)
    if rank == 1:
        dcp_drain.copy_checked = held
    w = node_writer(rank, root, drain_root=str(shared))
    for step in range(2):
        w.reset(step)
        dcp.save(state(step), storage_writer=w)
    errors = drain_errors(w.wait_drained, signal_after_two=signal_file if rank == 0 else None)
    w.close()
    torch.distributed.barrier()
    return {"errors": errors}


def test_a_slower_ranks_dcp_drain_of_a_step_survives_the_next_steps_draft(tmp_path):
    """Rank 0 drains its part and the draft of steps 0 and 1 while rank 1 has not copied step 0
    yet: rank 0's clean-up at step 1 used to remove step 0's directory under rank 1 (a DrainError,
    step 0 never drained); now both steps drain, no error, nothing left over."""
    got = run_ranks(2, _slow_rank_one, str(tmp_path), out=tmp_path / "ranks")
    assert got == [{"errors": []}] * 2, got
    shared = tmp_path / "shared"
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith("step_")) == \
        ["step_000000000000", "step_000000000001"]
    assert not [p for p in shared.iterdir() if p.name.startswith((".tmp", ".trash"))]
