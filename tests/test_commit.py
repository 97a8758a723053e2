"""CommitProtocol, RootLock and clean_leftovers (format/commit.py), on real directories."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from support import models as M
import gdswriter.format.commit as commit_mod
from gdswriter import GDSCheckpointer, RootUnavailableError, UnsafePathError, load_state
from gdswriter.errors import CheckpointLockedError, CheckpointNotFoundError, CorruptCheckpointError, EngineIOError
from gdswriter.format.commit import (LATEST_NAME, OWNER_ID_NAME, OWNER_NAME, ROOT_MARKER_NAME, CommitProtocol,
                                     RootLock, parse_step_dir, root_identity, step_dir_name)
from gdswriter.format.manifest import MANIFEST_NAME


def roots_in(tmp_path, n=1) -> list[Path]:
    rs = [tmp_path / f"r{i}" for i in range(n)]
    for r in rs:
        r.mkdir()
    return rs


def do_commit(p: CommitProtocol, step: int, tag: str = "x") -> None:
    """Write one data file per root holding ``tag`` and commit with a manifest naming ``tag``."""
    pending = p.begin(step)
    for i, d in enumerate(pending.dirs):
        (d / f"data-{i}.bin").write_text(f"{tag}:{step}:{i}")
    pending.commit(f'{{"tag":"{tag}","step":{step}}}'.encode())


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} - {ROOT_MARKER_NAME}


def names(root: Path) -> set[str]:
    """What a root holds besides its identity marker."""
    return set(os.listdir(root)) - {ROOT_MARKER_NAME}


def test_step_dir_names():
    assert step_dir_name(42) == "step_000000000042"
    assert parse_step_dir("step_000000000042") == 42
    assert parse_step_dir(step_dir_name(10 ** 13)) == 10 ** 13
    for bad in ("step_42", "step_00000000004x", ".tmp-step_000000000042", "step_000000000042-abc", "latest"):
        assert parse_step_dir(bad) is None


def test_commit_layout_single_root(tmp_path):
    (r,) = roots_in(tmp_path)
    p = CommitProtocol([r])
    assert p.committed_steps() == [] and p.latest() is None
    do_commit(p, 3)
    assert tree(r) == {"step_000000000003", "step_000000000003/data-0.bin", f"step_000000000003/{MANIFEST_NAME}",
                       LATEST_NAME}
    assert (r / LATEST_NAME).read_text() == "3\n"
    assert p.committed_steps() == [3] and p.latest() == 3 and p.require(None) == 3


def test_commit_layout_multi_root(tmp_path):
    rs = roots_in(tmp_path, 3)
    p = CommitProtocol(rs)
    do_commit(p, 1)
    for i, r in enumerate(rs):
        names = set(os.listdir(r / step_dir_name(1)))
        assert f"data-{i}.bin" in names
        assert (MANIFEST_NAME in names) == (i == 0)
        assert (OWNER_NAME in names) == (OWNER_ID_NAME in names) == (i > 0)
        if i:
            assert (r / step_dir_name(1) / OWNER_NAME).read_text().strip() == str(rs[0].resolve())
            assert (r / step_dir_name(1) / OWNER_ID_NAME).read_text().strip() == root_identity(rs[0]).id
        assert (LATEST_NAME in os.listdir(r)) == (i == 0)
        assert [n for n in os.listdir(r) if n.startswith(".")] == [ROOT_MARKER_NAME]
    # every root has its own identity
    assert len({root_identity(r).id for r in rs}) == 3


def test_abort_removes_temporaries(tmp_path):
    rs = roots_in(tmp_path, 2)
    p = CommitProtocol(rs)
    do_commit(p, 1)
    pending = p.begin(2)
    assert all(d.name.startswith(".tmp-step_000000000002-") for d in pending.dirs)
    (pending.dirs[0] / "data.bin").write_bytes(b"1")
    pending.abort()
    assert pending.finished
    assert names(rs[0]) == {step_dir_name(1), LATEST_NAME}
    assert names(rs[1]) == {step_dir_name(1)}
    assert p.committed_steps() == [1]


def test_recommit_same_step_replaces(tmp_path):
    rs = roots_in(tmp_path, 2)
    p = CommitProtocol(rs)
    do_commit(p, 5, "old")
    do_commit(p, 5, "new")
    assert p.committed_steps() == [5]
    assert (rs[0] / step_dir_name(5) / MANIFEST_NAME).read_text() == '{"tag":"new","step":5}'
    assert (rs[1] / step_dir_name(5) / "data-1.bin").read_text() == "new:5:1"
    assert not [n for r in rs for n in names(r) if n.startswith(".")]


def test_exchange_paths_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    assert commit_mod.exchange_paths(a, b)  # ext4, tmpfs, xfs, btrfs all support it
    assert os.listdir(a) == ["y"] and os.listdir(b) == ["x"]
    with pytest.raises(FileNotFoundError):
        commit_mod.exchange_paths(a, tmp_path / "missing")


def test_resave_on_one_root_is_one_swap_and_a_crash_keeps_old_or_new(tmp_path, monkeypatch):
    (r,) = roots_in(tmp_path)
    p = CommitProtocol([r])
    do_commit(p, 5, "old")
    seen = []

    def crash_after_swap(path, *a, **kw):  # the deletion of the old step is cut short
        seen.append(sorted(os.listdir(r)))
        raise KeyboardInterrupt

    monkeypatch.setattr(commit_mod.shutil, "rmtree", crash_after_swap)
    with pytest.raises(KeyboardInterrupt):
        do_commit(p, 5, "new")
    monkeypatch.undo()
    # At the moment the old step was to be deleted, step 5 was never missing: it is the new one,
    # and the old one waits under a temporary name for the next writer to remove it.
    (names,) = seen
    assert step_dir_name(5) in names and any(n.startswith(".tmp-step_000000000005-") for n in names)
    assert p.committed_steps() == [5]
    assert (r / step_dir_name(5) / MANIFEST_NAME).read_text() == '{"tag":"new","step":5}'
    (old,) = [r / n for n in os.listdir(r) if n.startswith(".tmp-step_")]
    assert (old / MANIFEST_NAME).read_text() == '{"tag":"old","step":5}'
    assert p.clean_leftovers() == [old]
    assert p.committed_steps() == [5] and (r / step_dir_name(5) / "data-0.bin").read_text() == "new:5:0"


def test_resave_on_one_root_without_exchange_falls_back_to_uncommit_first(tmp_path, monkeypatch):
    (r,) = roots_in(tmp_path)
    p = CommitProtocol([r])
    do_commit(p, 5, "old")
    monkeypatch.setattr(commit_mod, "exchange_paths", lambda a, b: False)  # e.g. a file system without it
    do_commit(p, 5, "new")
    assert p.committed_steps() == [5]
    assert (r / step_dir_name(5) / MANIFEST_NAME).read_text() == '{"tag":"new","step":5}'
    assert not [n for n in os.listdir(r) if n.startswith(".")]


def test_delete_step_every_root(tmp_path):
    rs = roots_in(tmp_path, 3)
    p = CommitProtocol(rs)
    do_commit(p, 1)
    do_commit(p, 2)
    p.delete_step(1)
    assert p.committed_steps() == [2]
    for r in rs:
        assert names(r) - {LATEST_NAME} == {step_dir_name(2)}
    p.delete_step(7)  # nothing there: no error


def test_delete_uncommits_primary_first(tmp_path, monkeypatch):
    rs = roots_in(tmp_path, 2)
    p = CommitProtocol(rs)
    do_commit(p, 1)
    order = []
    import gdswriter.format.commit as commit_mod
    real = commit_mod.retire
    monkeypatch.setattr(commit_mod, "retire", lambda path: (order.append(path), real(path)))
    p.delete_step(1)
    assert order == [rs[0] / step_dir_name(1), rs[1] / step_dir_name(1)]


# ----------------------------------------------------------------------------- latest
@pytest.mark.parametrize("content", [b"", b"garbage\n", b"7\n", b"-1\n", b"\xff\xfe", b"2 3", b"99999999999999999999"])
def test_latest_falls_back_when_stale_or_garbage(tmp_path, content):
    (r,) = roots_in(tmp_path)
    p = CommitProtocol([r])
    for s in (1, 4, 2):
        do_commit(p, s)
    assert p.latest() == 2  # names the last committed step, not the largest
    (r / LATEST_NAME).write_bytes(content)
    assert p.latest() == 4
    assert p.require(None) == 4


def test_latest_missing_or_a_directory(tmp_path):
    (r,) = roots_in(tmp_path)
    p = CommitProtocol([r])
    do_commit(p, 1)
    do_commit(p, 3)
    (r / LATEST_NAME).unlink()
    assert p.latest() == 3
    (r / LATEST_NAME).mkdir()
    assert p.latest() == 3


def test_latest_names_uncommitted_step(tmp_path):
    (r,) = roots_in(tmp_path)
    p = CommitProtocol([r])
    do_commit(p, 1)
    do_commit(p, 2)
    (r / step_dir_name(2) / MANIFEST_NAME).unlink()
    assert (r / LATEST_NAME).read_text() == "2\n"
    assert p.committed_steps() == [1] and p.latest() == 1
    with pytest.raises(CheckpointNotFoundError, match=r"step 2.*\[1\]"):
        p.require(2)


def test_require_messages(tmp_path):
    (r,) = roots_in(tmp_path)
    p = CommitProtocol([r])
    with pytest.raises(CheckpointNotFoundError, match="save one first"):
        p.require(None)
    p2 = CommitProtocol([tmp_path / "does-not-exist"])
    assert p2.committed_steps() == [] and p2.latest() is None


# ----------------------------------------------------------------------------- cleaning
def test_clean_leftovers_removes_only_what_crashes_leave(tmp_path):
    rs = roots_in(tmp_path, 2)
    p = CommitProtocol(rs)
    do_commit(p, 1)
    do_commit(p, 2)
    primary, secondary = rs
    # leftovers of crashed saves and deletions
    (primary / ".tmp-step_000000000003-1-abcd").mkdir()
    (primary / ".tmp-step_000000000003-1-abcd" / "data-0.bin").write_bytes(b"x")
    (primary / ".trash-step_000000000000-beef").mkdir()
    (primary / ".tmp-latest-1234").write_text("3\n")
    (secondary / ".tmp-step_000000000003-1-abcd").mkdir()
    orphan = secondary / step_dir_name(3)  # renamed on the secondary, primary never committed
    orphan.mkdir()
    (orphan / OWNER_NAME).write_text(p.identity + "\n")
    (orphan / "data-1.bin").write_text("o")
    # things that must survive
    foreign = secondary / step_dir_name(4)  # written for another primary
    foreign.mkdir()
    (foreign / OWNER_NAME).write_text("/somewhere/else\n")
    (foreign / "data-1.bin").write_text("theirs")
    ownerless = secondary / step_dir_name(6)  # no owner file: not ours to judge
    ownerless.mkdir()
    (ownerless / "data.bin").write_text("?")
    foreign_same_step = secondary / step_dir_name(2)  # ours and committed
    (primary / "notes.txt").write_text("user file")
    (secondary / "step_12").mkdir()  # not a step directory name
    (primary / step_dir_name(9)).mkdir()  # a primary step dir without manifest: never deleted

    before_primary, before_secondary = tree(primary), tree(secondary)
    removed = p.clean_leftovers()
    assert set(removed) == {primary / ".tmp-step_000000000003-1-abcd", primary / ".trash-step_000000000000-beef",
                            primary / ".tmp-latest-1234", secondary / ".tmp-step_000000000003-1-abcd", orphan}
    assert tree(primary) == {x for x in before_primary if not x.startswith(".")}
    assert tree(secondary) == {x for x in before_secondary if not x.startswith(".") and
                               not x.startswith(step_dir_name(3))}
    assert (foreign / "data-1.bin").read_text() == "theirs"
    assert (ownerless / "data.bin").read_text() == "?"
    assert foreign_same_step.is_dir() and (foreign_same_step / "data-1.bin").read_text() == "x:2:1"
    assert p.committed_steps() == [1, 2]
    assert p.clean_leftovers() == []  # idempotent


def test_clean_leftovers_keeps_other_primarys_dirs_in_shared_secondary(tmp_path):
    a0, b0, shared = roots_in(tmp_path, 3)
    pa = CommitProtocol([a0, shared])
    pb = CommitProtocol([b0, shared])
    do_commit(pa, 1, "a")
    do_commit(pa, 2, "a")
    do_commit(pb, 10, "b")
    # an orphan of B's crashed save
    orphan_b = shared / step_dir_name(11)
    orphan_b.mkdir()
    (orphan_b / OWNER_NAME).write_text(pb.identity + "\n")
    assert pa.clean_leftovers() == []  # A must not touch B's committed step 10 nor B's orphan
    assert {step_dir_name(s) for s in (1, 2, 10, 11)} <= set(os.listdir(shared))
    assert pb.clean_leftovers() == [orphan_b]
    assert {step_dir_name(s) for s in (1, 2, 10)} <= set(os.listdir(shared))
    assert (shared / step_dir_name(1) / "data-1.bin").read_text() == "a:1:1"
    assert (shared / step_dir_name(10) / "data-1.bin").read_text() == "b:10:1"


def test_commit_never_destroys_another_primarys_step(tmp_path):
    """A and B share a secondary root and both save step 5: B's commit must not replace
    (delete) A's bytes of step 5, which A's manifest still points to."""
    a0, b0, shared = roots_in(tmp_path, 3)
    pa = CommitProtocol([a0, shared])
    pb = CommitProtocol([b0, shared])
    do_commit(pa, 5, "a")
    with pytest.raises(EngineIOError) as ei:
        do_commit(pb, 5, "b")
    assert ei.value.errno == errno.EEXIST and str(shared / step_dir_name(5)) in str(ei.value)
    assert (shared / step_dir_name(5) / "data-1.bin").read_text() == "a:5:1"
    assert pa.committed_steps() == [5] and pb.committed_steps() == []
    pb.clean_leftovers()  # B's temporaries go; A's step stays
    assert not [n for r in (b0, shared) for n in os.listdir(r) if n.startswith(".tmp-")]
    assert (shared / step_dir_name(5) / "data-1.bin").read_text() == "a:5:1"


class Crash(BaseException):
    """Stands for the process dying at that point (nothing after it runs)."""


@pytest.mark.parametrize("k", range(1, 12))
def test_recommit_interrupted_never_pairs_old_manifest_with_new_data(tmp_path, monkeypatch, k):
    """Re-saving a committed step on two roots and dying after the k-th rename/fsync: the step
    is either the old one, complete, or absent (then an older step is still there)."""
    rs = roots_in(tmp_path, 2)
    p = CommitProtocol(rs)
    do_commit(p, 4, "base")
    do_commit(p, 5, "old")
    calls = [0]

    def counting(real):
        def f(*a, **kw):
            calls[0] += 1
            if calls[0] == k:
                raise Crash()
            return real(*a, **kw)
        return f

    monkeypatch.setattr(commit_mod.os, "rename", counting(os.rename))
    monkeypatch.setattr(commit_mod.os, "replace", counting(os.replace))
    monkeypatch.setattr(commit_mod, "fsync_dir", counting(commit_mod.fsync_dir))
    try:
        do_commit(p, 5, "new")
    except Crash:
        pass
    monkeypatch.undo()
    fresh = CommitProtocol(rs)
    fresh.clean_leftovers()
    steps = fresh.committed_steps()
    assert 4 in steps
    assert fresh.latest() in steps
    for s in steps:
        tag = (rs[0] / step_dir_name(s) / MANIFEST_NAME).read_text().split('"')[3]
        for i, r in enumerate(rs):
            assert (r / step_dir_name(s) / f"data-{i}.bin").read_text() == f"{tag}:{s}:{i}", (s, i)
    for r in rs:
        assert not [n for n in os.listdir(r) if n.startswith((".tmp-", ".trash-"))]
        # no orphaned secondary step directory survives cleaning
        for n in os.listdir(r):
            if parse_step_dir(n) is not None:
                assert parse_step_dir(n) in steps


# ----------------------------------------------------------------------------- lock
def test_root_lock(tmp_path):
    rs = roots_in(tmp_path, 2)
    lock = RootLock(rs)
    assert (rs[0] / ".gdswriter.lock").read_text().strip() == str(os.getpid())
    with pytest.raises(CheckpointLockedError, match=f"pid {os.getpid()}"):
        RootLock([rs[1]])
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointLockedError):
        RootLock([tmp_path / "other", rs[0]])
    # the failed attempt released what it had taken
    other = RootLock([tmp_path / "other"])
    other.release()
    lock.release()
    lock.release()  # idempotent
    again = RootLock(rs)
    again.release()


# ----------------------------------------------------------------------------- root identity




def saved_on_two_roots(tmp_path, steps=(1, 2)):
    """A checkpoint with ``steps`` on [primary, secondary]; returns (primary, secondary, state)."""
    p, s = tmp_path / "nvme0" / "ck", tmp_path / "nvme1" / "ck"
    state = {"w": torch.randn(3000), "b": torch.randn(5000)}
    with GDSCheckpointer(state, None, [p, s], options=M.small_options()) as ck:
        for step in steps:
            with torch.no_grad():
                state["w"].add_(1)
            ck.save(step)
    return p, s, {k: v.clone() for k, v in state.items()}


def secondary_steps(s: Path) -> list[int]:
    return sorted(x for x in (parse_step_dir(n) for n in os.listdir(s)) if x is not None)


@pytest.mark.parametrize("unmounted", ["missing", "empty mount point"])
def test_unmounted_primary_leaves_the_secondary_data_alone(tmp_path, unmounted):
    """Item 1 of issue 10: with the primary's disk not mounted, opening the roots must not
    create an empty primary and then clean every secondary step as an orphan."""
    p, s, want = saved_on_two_roots(tmp_path)
    hidden = tmp_path / "hidden"
    os.rename(p, hidden)  # the disk is not mounted
    if unmounted == "empty mount point":
        p.mkdir()
    with pytest.raises(RootUnavailableError, match="is the primary's disk mounted") as ei:
        GDSCheckpointer({"w": torch.zeros(3000)}, None, [p, s], options=M.small_options())
    assert str(p) in str(ei.value) and str(s) in str(ei.value) and "[1, 2]" in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)
    assert p.exists() == (unmounted == "empty mount point")  # a missing primary is not created
    if p.exists():
        assert os.listdir(p) == []
    assert secondary_steps(s) == [1, 2]
    # the disk is back: everything loads
    if p.exists():
        p.rmdir()
    os.rename(hidden, p)
    live = {"w": torch.zeros(3000), "b": torch.zeros(5000)}
    with GDSCheckpointer(live, None, [p, s], options=M.small_options()) as ck:
        assert ck.load() == 2
    for k in want:
        assert torch.equal(live[k], want[k]), k


def test_unmounted_secondary_is_refused_too(tmp_path):
    p, s, _ = saved_on_two_roots(tmp_path)
    os.rename(s, tmp_path / "hidden")
    with pytest.raises(RootUnavailableError, match=r"secondary checkpoint root #1 .* does not exist.*mounted"):
        GDSCheckpointer({"w": torch.zeros(1)}, None, [p, s], options=M.small_options())
    s.mkdir()  # an empty mount point
    with pytest.raises(RootUnavailableError, match="no step directory and no identity marker"):
        GDSCheckpointer({"w": torch.zeros(1)}, None, [p, s], options=M.small_options())
    s.rmdir()
    os.rename(tmp_path / "hidden", s)
    # a secondary added to a checkpoint that never used it is fine
    with GDSCheckpointer({"w": torch.ones(1)}, None, [p, s, tmp_path / "new"], options=M.small_options()) as ck:
        assert ck.steps() == [1, 2]


def strip_identities(*roots: Path) -> None:
    """Make a checkpoint look as gdswriter wrote it before root identities existed."""
    for r in roots:
        (r / ROOT_MARKER_NAME).unlink()
        for _, d in ((n, r / n) for n in os.listdir(r) if parse_step_dir(n) is not None):
            (d / OWNER_ID_NAME).unlink(missing_ok=True)


def test_checkpoints_from_before_root_identities_open_and_get_markers(tmp_path):
    p, s, want = saved_on_two_roots(tmp_path)
    strip_identities(p, s)
    orphan = s / step_dir_name(3)  # an old crash left a secondary step the primary never committed
    orphan.mkdir()
    (orphan / OWNER_NAME).write_text(str(p.resolve()) + "\n")
    live = {"w": torch.zeros(3000), "b": torch.zeros(5000)}
    with GDSCheckpointer(live, None, [p, s], options=M.small_options()) as ck:
        assert ck.load() == 2
        ck.save(4)
    assert torch.equal(live["w"], want["w"])
    assert root_identity(p) is not None and root_identity(s) is not None  # migrated
    assert secondary_steps(s) == [1, 2, 4]  # the legacy orphan went, the legacy steps stayed
    assert (s / step_dir_name(4) / OWNER_ID_NAME).read_text().strip() == root_identity(p).id
    assert load_state([p, s], 1)[0] == 1


def test_unmarked_empty_primary_with_legacy_secondary_steps_is_refused(tmp_path):
    p, s, _ = saved_on_two_roots(tmp_path)
    strip_identities(p, s)
    os.rename(p, tmp_path / "hidden")
    p.mkdir()
    with pytest.raises(RootUnavailableError, match="no identity marker.*and no committed step"):
        GDSCheckpointer({"w": torch.zeros(1)}, None, [p, s], options=M.small_options())
    assert secondary_steps(s) == [1, 2]


def test_marker_lost_on_a_primary_with_steps_is_refused(tmp_path):
    """Secondaries name the primary by identity, but the directory at its path has no marker:
    not the disk they were saved with (or the marker was deleted): refuse, delete nothing."""
    p, s, _ = saved_on_two_roots(tmp_path)
    (p / ROOT_MARKER_NAME).unlink()
    (p / step_dir_name(2) / MANIFEST_NAME).unlink()  # so that cleaning would have an orphan to take
    with pytest.raises(RootUnavailableError, match="has no identity marker"):
        GDSCheckpointer({"w": torch.zeros(1)}, None, [p, s], options=M.small_options())
    assert secondary_steps(s) == [1, 2]


def test_steps_of_another_primary_at_the_same_path_are_left_alone(tmp_path, caplog):
    """Another disk (another identity) is mounted at the primary's path: the secondary steps
    written for the first one are never cleaned, and the user is told."""
    p, s, _ = saved_on_two_roots(tmp_path)
    os.rename(p, tmp_path / "hidden")
    p.mkdir()
    root_identity(p, create=True)  # a different, marked root at the same path
    with caplog.at_level(logging.WARNING, logger="gdswriter"), \
            GDSCheckpointer({"w": torch.ones(1)}, None, [p, s], options=M.small_options()) as ck:
        assert ck.steps() == []
        ck.save(7)
    assert "identity differs" in caplog.text and "[1, 2]" in caplog.text
    assert secondary_steps(s) == [1, 2, 7]


def test_root_identity_api(tmp_path):
    r = tmp_path / "r"
    r.mkdir()
    assert root_identity(r) is None and not (r / ROOT_MARKER_NAME).exists()
    ident = root_identity(r, create=True)
    assert len(ident.id) == 32 and ident.path == str(r.resolve()) and ident.created_unix > 0 and ident.host
    assert root_identity(r) == ident == root_identity(r, create=True)  # written once, never changed
    assert not [n for n in os.listdir(r) if n != ROOT_MARKER_NAME]  # no temporary left
    # racing creators (ranks sharing a root) agree on one identity
    shared = tmp_path / "shared"
    shared.mkdir()
    got, barrier = [], threading.Barrier(8)

    def create():
        barrier.wait()
        got.append(root_identity(shared, create=True).id)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and got[0] == root_identity(shared).id
    # a damaged or linked marker is a typed error
    (shared / ROOT_MARKER_NAME).write_text("{}")
    with pytest.raises(CorruptCheckpointError, match="not a gdswriter root marker"):
        root_identity(shared)
    (shared / ROOT_MARKER_NAME).unlink()
    (shared / ROOT_MARKER_NAME).symlink_to(r / ROOT_MARKER_NAME)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        root_identity(shared, create=True)


# ----------------------------------------------------------------------------- links
@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_lock_file_is_never_followed(tmp_path, kind):
    root = tmp_path / "ck"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = root / ".gdswriter.lock"
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)
    with pytest.raises(UnsafePathError, match="remove it"):
        RootLock([root])
    with pytest.raises(UnsafePathError):
        GDSCheckpointer({"w": torch.ones(1)}, None, root, options=M.small_options())
    assert victim.read_text() == "precious"  # not truncated, not overwritten with a pid


def test_linked_manifest_and_latest_are_not_followed(tmp_path):
    root = tmp_path / "ck"
    with GDSCheckpointer({"w": torch.ones(4)}, None, root, options=M.small_options()) as ck:
        ck.save(1)
        ck.save(2)
    p = CommitProtocol([root])
    # `latest` planted as a link to a file naming step 1: ignored, the newest committed step counts
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("1\n")
    (root / LATEST_NAME).unlink()
    (root / LATEST_NAME).symlink_to(elsewhere)
    assert p.latest() == 2
    # a manifest that is a link is not a commit record: the step is not listed, and loading it by
    # name says why
    m2 = root / step_dir_name(2) / MANIFEST_NAME
    real = tmp_path / "manifest-2.json"
    os.rename(m2, real)
    m2.symlink_to(real)
    assert p.committed_steps() == [1] and p.latest() == 1
    with pytest.raises(CheckpointNotFoundError):
        load_state(root, 2)
    from gdswriter.load.reader import read_manifest_bytes
    with pytest.raises(UnsafePathError, match="symbolic link"):
        read_manifest_bytes(p, 2)
