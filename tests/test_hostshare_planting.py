"""Another local user planting a load's files on the tmpfs (distributed/hostshare.py).

The ranks of a host share a load through files on a world-writable tmpfs. Another user who
can guess or watch the names must not get a rank to map a file it made (then it could read
the state, or change it after its checksums were verified): the files live in a private
directory per load, checked before use, and created O_EXCL inside it. The planting user here
is uid 65534 (nobody), so the tests that plant need root.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from gdswriter.distributed import hostshare
from gdswriter.errors import EngineIOError
from support.ranks import run_ranks

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: another uid plants the files")


# ----------------------------------------------------------------------------- the private directory
def test_private_dir_is_made_0700_and_found_again_by_a_peer(tmp_path):
    fd = hostshare.private_dir(str(tmp_path), "load-a")
    peer = hostshare.private_dir(str(tmp_path), "load-a")  # another rank of the load: same directory
    try:
        st = os.fstat(fd)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert os.fstat(peer).st_ino == st.st_ino
    finally:
        os.close(fd)
        os.close(peer)


def _planted(tmp_path: Path, kind: str) -> Path:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    p = tmp_path / "load-x"
    if kind == "another-owner":
        p.mkdir(mode=0o700)
        os.chown(p, NOBODY, NOBODY)
    elif kind == "symlink":  # to a private directory of this user: still not the one it made
        p.symlink_to(mine)
    elif kind == "mode-0777":
        p.mkdir()
        p.chmod(0o777)
    elif kind == "mode-0750":
        p.mkdir()
        p.chmod(0o750)
    elif kind == "regular-file":
        p.write_bytes(b"")
    return p


@needs_root
@pytest.mark.parametrize("kind", ["another-owner", "symlink", "mode-0777", "mode-0750", "regular-file"])
def test_private_dir_refuses_an_entry_it_cannot_trust(tmp_path, kind):
    p = _planted(tmp_path, kind)
    before = os.lstat(p)
    with pytest.raises(EngineIOError) as got:
        hostshare.private_dir(str(tmp_path), p.name)
    assert got.value.errno in (errno.EPERM, errno.ELOOP, errno.ENOTDIR), got.value
    assert "process group" in str(got.value)  # says what happens instead
    after = os.lstat(p)
    assert (after.st_ino, after.st_mode, after.st_uid) == (before.st_ino, before.st_mode, before.st_uid)


@needs_root
@pytest.mark.parametrize("mode,owner,ok", [(0o1777, 0, True), (0o755, 0, True), (0o777, 0, False),
                                           (0o1777, NOBODY, False)],
                         ids=["sticky", "private", "world-writable-not-sticky", "another-users"])
def test_private_dir_refuses_a_parent_where_another_user_could_swap_it(tmp_path, mode, owner, ok):
    share = tmp_path / "share"
    share.mkdir()
    share.chmod(mode)
    os.chown(share, owner, owner)
    if ok:
        os.close(hostshare.private_dir(str(share), "load-y"))
    else:
        with pytest.raises(EngineIOError):
            hostshare.private_dir(str(share), "load-y")
        assert not (share / "load-y").exists()


@needs_root
def test_shared_items_refuse_a_file_of_another_owner_in_the_directory(tmp_path):
    """Belt and braces: even inside a checked directory, a file this user did not make is
    never mapped."""
    tok = hostshare.token()
    d = tmp_path / f"{hostshare.PREFIX}{tok}"
    os.close(hostshare.private_dir(str(tmp_path), d.name))
    (d / "item").write_bytes(b"")
    os.chown(d / "item", NOBODY, NOBODY)
    with pytest.raises(EngineIOError):
        hostshare.SharedItems(str(tmp_path), tok, [("item", 0, 4096)])
    assert (d / "item").stat().st_size == 0  # never reserved, never written


@needs_root
def test_clean_stale_removes_this_users_old_directories_only(tmp_path):
    old = int(time.time()) - 2 * 86400
    stale = tmp_path / f"{hostshare.PREFIX}{old:x}-{'a' * 32}"
    fresh = tmp_path / f"{hostshare.PREFIX}{int(time.time()):x}-{'b' * 32}"
    theirs = tmp_path / f"{hostshare.PREFIX}{old:x}-{'c' * 32}"
    for d in (stale, fresh, theirs):
        d.mkdir(mode=0o700)
        (d / "item").write_bytes(b"x")
    os.chown(theirs, NOBODY, NOBODY)
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_bytes(b"x")
    link = tmp_path / f"{hostshare.PREFIX}{old:x}-{'d' * 32}"
    link.symlink_to(target)  # the link goes, never what it points to
    assert hostshare.clean_stale(str(tmp_path)) == 2
    assert not stale.exists() and not link.is_symlink()
    assert (fresh / "item").exists() and (theirs / "item").exists() and (target / "keep").exists()


def test_holders_share_one_directory_and_the_last_to_unlink_removes_it(tmp_path):
    """Two holders (ranks) of a load: the second opens the files the first made (one memory),
    and the directory goes with the last holder's unlink, whatever items each holds."""
    tok = hostshare.token()
    a = hostshare.SharedItems(str(tmp_path), tok, [("x", 0, 8192), ("y", 1, 4096)])
    b = hostshare.SharedItems(str(tmp_path), tok, [("x", 0, 8192), ("z", 1, 4096)])
    a.shared[0][:16] = 7
    assert bool((b.private[0][:16] == 7).all())
    d = tmp_path / f"{hostshare.PREFIX}{tok}"
    assert sorted(os.listdir(d)) == ["x", "y", "z"]
    a.unlink()
    assert os.listdir(d) == ["z"]
    b.unlink()
    assert not d.exists()


def test_a_crash_before_unlinking_leaves_only_what_clean_stale_removes(tmp_path):
    """A rank killed between making the load's directory and unlinking it leaves the directory;
    clean_stale removes it, with its files, once its token is older than a day."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            hostshare.SharedItems(str(tmp_path), hostshare.token(), [("x", 0, 8192), ("y", 1, 4096)])
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and sorted(os.listdir(left[0])) == ["x", "y"], left
    assert hostshare.clean_stale(str(tmp_path)) == 0  # a load of today may still be running
    assert hostshare.clean_stale(str(tmp_path), now=time.time() + 2 * 86400) == 1
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- another user planting, two ranks
def _as_nobody(fn, *args) -> tuple[int, int, int]:
    """Fork a child that becomes uid/gid 65534 and runs ``fn(cmd_fd, out_fd, *args)``; returns
    (pid, the fd to send it a byte, the fd its JSON report comes on). It uses os calls only."""
    cmd_r, cmd_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(cmd_w)
            os.close(out_r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn(cmd_r, out_w, *args)
            code = 0
        finally:
            os._exit(code)
    os.close(cmd_r)
    os.close(out_w)
    return pid, cmd_w, out_r


def _finish(child: tuple[int, int, int]) -> dict:
    """Tell the child to stop; its report."""
    pid, cmd_w, out_r = child
    os.write(cmd_w, b"x")
    os.close(cmd_w)
    data = b""
    while True:
        b = os.read(out_r, 65536)
        if not b:
            break
        data += b
    os.close(out_r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return json.loads(data.split(b"\n", 1)[1])


def _plant_file(path: str, planted: list) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    except OSError:
        return False
    os.fchmod(fd, 0o666)
    planted.append((path, fd))
    return True


def _report(out_w: int, planted: list, extra: dict) -> None:
    """Sizes of the planted files now (a rank that used one reserved and wrote it), then remove them."""
    used = {p: os.fstat(fd).st_size for p, fd in planted if os.fstat(fd).st_size}
    for p, fd in reversed(planted):
        os.close(fd)
        try:
            os.unlink(p)
        except OSError:
            pass
    os.write(out_w, b"\n" + json.dumps({"planted": len(planted), "used": used, **extra}).encode())


def _planter(cmd_r: int, out_w: int, share: str, token: str, names: list) -> None:
    """Knowing the load's token: plant the files of the old layout (``PREFIX<token>-<item>`` in
    the tmpfs) and the load's directory, open to all, with a file per item, mode 0666."""
    planted: list = []
    for n in names:
        _plant_file(f"{share}/{hostshare.PREFIX}{token}-{n}", planted)
    d = f"{share}/{hostshare.PREFIX}{token}"
    os.mkdir(d)
    os.chmod(d, 0o777)
    for n in names:
        _plant_file(f"{d}/{n}", planted)
    os.write(out_w, b"ready")
    os.read(cmd_r, 1)
    try:
        foreign = sorted(set(os.listdir(d)) - set(names))  # what a rank made in the planted directory
    except OSError as e:
        foreign = [f"the directory itself: {e}"]  # a rank that used it removed it
    _report(out_w, planted, {"foreign": foreign})
    try:
        os.rmdir(d)
    except OSError:
        pass


def _watcher(cmd_r: int, out_w: int, share: str, names: list) -> None:
    """Not knowing the token: watch the tmpfs, and as soon as a load's entry appears plant the
    old layout's names of its token and try to enter its directory."""
    planted: list = []
    seen = set(os.listdir(share))
    entered: list = []
    os.write(out_w, b"ready")
    while not select.select([cmd_r], [], [], 0)[0]:
        for e in os.listdir(share):
            if e in seen or not e.startswith(hostshare.PREFIX):
                continue
            seen.add(e)
            tok = "-".join(e[len(hostshare.PREFIX):].split("-")[:2])
            for n in names:
                _plant_file(f"{share}/{hostshare.PREFIX}{tok}-{n}", planted)
                if os.path.isdir(f"{share}/{e}") and _plant_file(f"{share}/{e}/{n}", planted):
                    entered.append(f"{e}/{n}")
    os.read(cmd_r, 1)
    _report(out_w, planted, {"entered": entered})


def _planting_worker(rank: int, world: int, root: str, share: str, token: str, watch: bool) -> dict:
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions
    from support.models import small_options

    names: list = []
    plain = hostshare.SharedItems

    def recording(share_dir, tok, items):  # the items' names: what a user knowing the model's layout knows
        names.extend(n for n, _, _ in items)
        return plain(share_dir, tok, items)

    hostshare.SharedItems = recording
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 768))  # 4 MiB + 3 MiB
    want = {k: v.clone() for k, v in model.state_dict().items()}
    options = DistOptions(replicated=("model",), timeout_s=60, load_share_dir=share, load_cross_memory=False)

    def load(ck) -> list[str]:
        for p in model.parameters():
            p.data.zero_()
        ck.load(1)
        return [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])]

    out: dict = {}
    with GDSCheckpointer(model, root=root, options=small_options(), dist_options=options) as ck:
        ck.save(1)
        out["diff-plain"] = load(ck)  # through the tmpfs: learns the names
        out["names"] = sorted(set(names))
        plain_token = hostshare.token
        hostshare.token = lambda: token  # the token the planting user guessed
        child = None
        if rank == 0:
            child = _as_nobody(_planter, share, token, out["names"])
            assert os.read(child[2], 5) == b"ready"
        torch.distributed.barrier()
        out["diff-planted"] = load(ck)
        torch.distributed.barrier()
        if child is not None:
            out["planter"] = _finish(child)
        hostshare.token = plain_token
        if watch:
            if rank == 0:
                child = _as_nobody(_watcher, share, out["names"])
                assert os.read(child[2], 5) == b"ready"
            torch.distributed.barrier()
            out["diff-watched"] = load(ck)
            torch.distributed.barrier()
            if rank == 0:
                out["watcher"] = _finish(child)
    return out


def _private_tmpfs() -> str | None:
    """A tmpfs of our own, mode 1777 as /dev/shm, that uid 65534 can reach (another test's
    loads on /dev/shm are not disturbed); None where mounting is not allowed."""
    d = tempfile.mkdtemp(prefix="gdswriter-shm-test-")
    os.chmod(d, 0o755)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", d],
                      capture_output=True).returncode == 0:
        return d
    os.rmdir(d)
    return None


@needs_root
def test_a_load_never_maps_a_file_another_user_planted(tmp_path):
    """uid 65534 plants, with the load's token guessed, the files of the old layout and a
    directory of the load's name with every item's file (mode 0666); and, where a private
    tmpfs can be mounted, watches it during a load with a fresh token, planting the old
    layout's names of the token it sees and trying to enter the directory. The ranks never
    reserve or write a planted file, make nothing in the planted directory, and load the
    state bit-exact (over the process group where the directory is refused)."""
    mounted = _private_tmpfs()
    share = mounted or hostshare.DEFAULT_DIR
    if hostshare.domain(share) is None:
        pytest.skip(f"{share} is not a writable tmpfs here")
    token = hostshare.token()
    try:
        res = run_ranks(2, _planting_worker, str(tmp_path / "ckpt"), share, token, mounted is not None,
                        out=tmp_path / "ranks")
        left = sorted(p.name for p in Path(share).glob(f"{hostshare.PREFIX}*"))
    finally:
        if mounted:
            subprocess.run(["umount", mounted], check=False)
            os.rmdir(mounted)
    assert len(res[0]["names"]) >= 2, res  # the first load shared through the tmpfs
    assert all(x[k] == [] for x in res for k in x if k.startswith("diff-")), res
    planter = res[0]["planter"]
    assert planter["planted"] == 2 * len(res[0]["names"]), planter
    assert planter["used"] == {} and planter["foreign"] == [], planter
    if mounted:
        watcher = res[0]["watcher"]
        assert watcher["entered"] == [] and watcher["used"] == {}, watcher
        assert left == [], left  # every name of the loads is gone
    else:
        assert not [n for n in left if token in n], left
