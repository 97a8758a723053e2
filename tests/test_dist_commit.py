"""The multi-rank commit, root identities and loading from partly reachable roots, in one
process (the solo coordinator runs every collective trivially): fast checks of the mechanics
that the multi-process tests (test_dist.py) exercise end to end."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from gdswriter.distributed import DistOptions, open_session
from gdswriter.distributed.group import Coordinator
from gdswriter.distributed.roots import ROOT_ID_NAME, discover_layout, root_identity
from gdswriter.errors import CheckpointLockedError, EngineIOError, RootUnavailableError, UnreachableDataError
from gdswriter.format.commit import OWNER_ID_NAME, OWNER_NAME
from gdswriter.load.apply import LiveState

from support.steps import step_manifest
from support.models import small_engine


def _session(roots):
    for r in roots:
        Path(r).mkdir(parents=True, exist_ok=True)
    return open_session([Path(r) for r in roots], Coordinator.solo(), DistOptions())


def _save(session, state, step, engines):
    from gdswriter.save.snapshot import take_snapshot

    prepared, found = session.prepare(state, step)
    snap = take_snapshot(prepared, step, prepared=found)
    return session.write_and_commit(snap, engines, 2)


@pytest.fixture
def engines():
    from gdswriter.engines.select import create_engine

    made = [create_engine(small_engine()) for _ in range(2)]
    yield made
    for e in made:
        e.close()


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(300, 50), "b": torch.randn(7)}, "extra": {"n": seed}}


def test_two_roots_commit_resave_and_load(tmp_path, engines):
    roots = [tmp_path / "a", tmp_path / "b"]
    s = _session(roots)
    m = _save(s, _state(1), 5, engines)
    assert [r.ranks for r in m.roots] == [(0,), (0,)] and [x.name for x in m.shards] == ["manifest-rank00000.json"]
    assert sorted(os.listdir(roots[0] / "step_000000000005")) == [
        "data-rank0-r0-f0.bin", "data-rank0-r0-f1.bin", "manifest-rank00000.json", "manifest.json"]
    names = sorted(os.listdir(roots[1] / "step_000000000005"))
    assert names == ["data-rank0-r1-f0.bin", "data-rank0-r1-f1.bin", OWNER_ID_NAME, OWNER_NAME]
    assert (roots[1] / "step_000000000005" / OWNER_NAME).read_text() == f"{roots[0].resolve()}\n"
    assert (roots[1] / "step_000000000005" / OWNER_ID_NAME).read_text() == f"{root_identity(roots[0])}\n"
    assert (roots[0] / "latest").read_text() == "5\n" and s.protocol.committed_steps() == [5]
    _save(s, _state(2), 5, engines)  # a re-save replaces the step on both roots
    assert [n for r in roots for n in os.listdir(r) if n.startswith((".tmp-", ".trash-"))] == []
    live = {"w": torch.zeros(300, 50), "b": torch.zeros(7)}
    from gdswriter.distributed.load import collective_load

    extra: dict = {"n": 0}
    layout = discover_layout(Coordinator.solo(), roots, create=False)
    assert collective_load(Coordinator.solo(), layout, s.protocol, LiveState(live, None, {"x": extra}),
                           {"model": live, "extra": {"x": extra}}, None, engines[0], strict=False, verify=True) == 5
    want = _state(2)["model"]
    assert torch.equal(live["w"], want["w"]) and torch.equal(live["b"], want["b"])
    s.lock.release()


def test_failed_write_commits_nothing(tmp_path, engines, monkeypatch):
    import gdswriter.distributed.save as save_mod

    roots = [tmp_path / "a", tmp_path / "b"]
    s = _session(roots)
    _save(s, _state(1), 1, engines)

    def full_disk(*a, **k):
        raise EngineIOError(28, str(roots[1] / "x"), 0, "write")

    monkeypatch.setattr(save_mod, "write_snapshot_files", full_disk)
    with pytest.raises(EngineIOError, match="No space left"):
        _save(s, _state(2), 2, engines)
    assert s.protocol.committed_steps() == [1] and (roots[0] / "latest").read_text() == "1\n"
    assert [n for r in roots for n in os.listdir(r) if n.startswith(".tmp-")] == [], "aborted saves clean up"
    s.lock.release()


def test_a_foreign_secondary_step_is_refused(tmp_path, engines):
    roots = [tmp_path / "a", tmp_path / "b"]
    s = _session(roots)
    (roots[1] / "step_000000000003").mkdir()
    (roots[1] / "step_000000000003" / OWNER_NAME).write_text("/some/other/primary\n")
    with pytest.raises(EngineIOError, match="another checkpoint"):
        _save(s, _state(1), 3, engines)
    assert s.protocol.committed_steps() == []
    assert (roots[1] / "step_000000000003" / OWNER_NAME).read_text() == "/some/other/primary\n"
    assert not (roots[1] / "step_000000000003" / "data-rank0-r1-f0.bin").exists()
    s.lock.release()


def test_leaders_lock_their_roots(tmp_path):
    s = _session([tmp_path / "a"])
    with pytest.raises(CheckpointLockedError):
        _session([tmp_path / "a"])
    s.lock.release()
    _session([tmp_path / "a"]).lock.release()


def test_root_identity_is_created_once_by_racing_ranks(tmp_path):
    ids: list[str] = []
    threads = [threading.Thread(target=lambda: ids.append(root_identity(tmp_path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and len(ids[0]) == 32
    assert sorted(os.listdir(tmp_path)) == [ROOT_ID_NAME]
    assert root_identity(tmp_path / "missing", create=False) is None


def test_a_root_no_rank_reaches_is_a_typed_error(tmp_path, engines):
    roots = [tmp_path / "a", tmp_path / "b"]
    s = _session(roots)
    _save(s, _state(1), 1, engines)
    s.lock.release()
    (roots[1] / ROOT_ID_NAME).unlink()
    moved = tmp_path / "elsewhere"
    roots[1].rename(moved)  # the second root is gone (another node's disk)
    from gdswriter.distributed.load import collective_load
    from gdswriter.format.commit import CommitProtocol

    layout = discover_layout(Coordinator.solo(), [roots[0]], create=False)
    live = {"w": torch.zeros(300, 50), "b": torch.zeros(7)}
    with pytest.raises(UnreachableDataError, match="root #1"):
        collective_load(Coordinator.solo(), layout, CommitProtocol([roots[0]]), LiveState(live, None, {}),
                        {"model": live}, None, engines[0], strict=False, verify=True)
    assert not live["w"].any(), "nothing was applied"
    m = step_manifest(roots, 1)
    assert m.dist.roots[1].path == str(roots[1].resolve())


def test_open_removes_leftovers_of_interrupted_saves(tmp_path, engines):
    roots = [tmp_path / "a", tmp_path / "b"]
    s = _session(roots)
    _save(s, _state(1), 1, engines)
    s.lock.release()
    primary = f"{roots[0].resolve()}\n"
    for name, owner in (("step_000000000002", primary), ("step_000000000009", "/another/primary\n")):
        (roots[1] / name).mkdir()  # a secondary step of ours that never committed; one of another checkpoint
        (roots[1] / name / OWNER_NAME).write_text(owner)
    (roots[0] / ".tmp-step_000000000002-ab12cd34").mkdir()
    (roots[1] / ".trash-step_000000000000-ab12cd34").mkdir()
    _session(roots).lock.release()
    assert sorted(os.listdir(roots[0])) == [ROOT_ID_NAME, ".gdswriter.lock", "latest", "step_000000000001"]
    assert sorted(os.listdir(roots[1])) == [ROOT_ID_NAME, ".gdswriter.lock", "step_000000000001",
                                            "step_000000000009"]


def _step_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "step_" in str(p))


def test_steps_of_another_primary_at_the_same_path_are_never_cleaned(tmp_path, engines):
    """The primary's path now holds another disk (node-local roots, rank 0 on another node, or an
    unmounted disk): secondary steps naming that path but the old primary's id are not this
    checkpoint's leftovers. With no committed step on the primary the open refuses; with some,
    the foreign steps are left alone."""
    a, c, d = tmp_path / "a", tmp_path / "c", tmp_path / "d"
    s = _session([a, c])
    _save(s, _state(1), 1, engines)
    _save(s, _state(2), 2, engines)
    s.lock.release()
    before = _step_files(c)
    a.rename(tmp_path / "old-a")  # another disk at the primary's path
    with pytest.raises(RootUnavailableError, match=r"holds no committed step.*steps \[1, 2\]"):
        _session([a, c])
    assert _step_files(c) == before
    s = _session([a, d])  # the new disk gets a checkpoint of its own
    _save(s, _state(3), 5, engines)
    s.lock.release()
    s = _session([a, c])
    assert _step_files(c) == before, "steps written for the other primary (by id) stay"
    s.lock.release()


def test_an_fsync_failure_after_the_commit_rename_uncommits_the_step(tmp_path, engines, monkeypatch):
    """The primary's step_S is visible once renamed; if fsync of the root then fails, the save
    fails: the step must be un-committed before the leaders hear of it, and its secondary data
    kept, so no visible step ever lacks its data files."""
    import gdswriter.distributed.commit as commit_mod
    from gdswriter.format.commit import CommitProtocol

    roots = [tmp_path / "a", tmp_path / "b"]
    s = _session(roots)
    _save(s, _state(1), 1, engines)
    real = commit_mod.fsync_dir

    def failing(path):
        if Path(path) == roots[0] and (roots[0] / "step_000000000002").exists():
            raise OSError(5, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(commit_mod, "fsync_dir", failing)
    with pytest.raises(EngineIOError, match="Input/output error") as info:
        _save(s, _state(2), 2, engines)
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.setattr(commit_mod, "fsync_dir", real)
    protocol = CommitProtocol(roots)
    assert protocol.committed_steps() == [1] and (roots[0] / "latest").read_text() == "1\n"
    assert (roots[1] / "step_000000000002").is_dir(), "kept: were the rename durable after all, step 2 is whole"
    for step in protocol.committed_steps():  # every visible step has all its data files
        m = step_manifest(roots, step)
        assert all((roots[f.root] / f"step_{step:012d}" / f.path).is_file() for f in m.files)
    s.lock.release()
    _session(roots).lock.release()  # the next open removes the uncommitted secondary step 2
    assert not (roots[1] / "step_000000000002").exists()


def test_a_latest_file_that_cannot_move_leaves_the_step_committed(tmp_path, engines, monkeypatch, caplog):
    import gdswriter.distributed.commit as commit_mod

    roots = [tmp_path / "a"]
    s = _session(roots)
    _save(s, _state(1), 1, engines)
    real = commit_mod.atomic_write

    def failing(path, data):
        if Path(path).name == "latest":
            raise OSError(28, "No space left on device", str(path))
        return real(path, data)

    # Fault injection at the commit's own durable writes: no public seam (FaultInjectingEngine covers data files only).
    monkeypatch.setattr(commit_mod, "atomic_write", failing)
    assert _save(s, _state(2), 2, engines) is not None, "the save succeeds: the step is committed"
    assert s.protocol.committed_steps() == [1, 2] and (roots[0] / "latest").read_text() == "1\n"
    assert "could not be updated" in caplog.text
    s.lock.release()


def test_an_error_raised_later_keeps_its_os_cause(tmp_path, engines, monkeypatch):
    import gdswriter.format.commit as commit_mod  # the owner files of secondary roots are written through it

    roots = [tmp_path / "a", tmp_path / "b"]
    s = _session(roots)

    def failing(path, data):
        raise OSError(13, "Permission denied", str(path))

    # Fault injection at the commit's own durable writes: no public seam (FaultInjectingEngine covers data files only).
    monkeypatch.setattr(commit_mod, "write_durable", failing)
    with pytest.raises(EngineIOError, match="Permission denied") as info:
        _save(s, _state(1), 1, engines)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == 13
    s.lock.release()
