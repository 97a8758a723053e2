"""Ranks on one host sharing what they read during a load, through a tmpfs (``/dev/shm``).

Where the ranks of a host may read each other's memory, state every rank holds is copied from
peer to peer instead (crossmem.py, DistOptions.load_cross_memory: no tmpfs pages to reserve,
map, unmap and free, about 60 ms per 64 MiB here); this path serves where that is refused
(probed before the read), for state only some ranks hold, and with load_cross_memory=False.

A load of replicated state reads its bytes from disk once across the ranks (each reads the
pieces it wrote, distributed/load.py ``load_own``). Where every rank of the job sees the same
tmpfs (one host, one IPC namespace: the usual single-node job), the pieces need not travel
over the process group: each holder reads its pieces straight into one file per shared item
on the tmpfs, mapped by every rank, so after the read each rank already holds the whole item
(one copy in memory per host, no socket traffic). On several hosts, each a block of
consecutive ranks, a piece of state every rank holds then crosses to each other host once
(loadplan.py ``relay_between_hosts``) into that host's file; elsewhere the pieces go rank to rank
over the process group (``relay``).

The files live in a directory private to the load, ``gdswriter-load-<time>-<128 random
bits>`` (``private_dir``, mode 0700). A rank uses it only after checking, through a descriptor
opened without following links, that its own user owns it and no other user may enter it or
rename it away (the parent is root's or this user's, sticky where others may write). The ranks
of a job run as one user: each makes the directory or finds its peers' there; one another user
planted under the name is refused, and the ranks pass the pieces over the process group.
Inside, one holder creates each file (O_EXCL) and the others open it, relative to the checked
directory. So no rank maps a file another user made: in a world-writable ``/dev/shm`` with
``fs.protected_regular=0``, a planted 0666 file of a load's name would otherwise be opened, and
could be read, or changed after its checksums were verified.

All ranks unlink the files and the directory as soon as every rank has mapped them, so a
crash later leaves nothing behind; one between creating and that moment can leave a
``gdswriter-load-*`` directory, which ``clean_stale`` removes at the next load on the host
when its token is older than a day. Space is reserved up front (posix_fallocate), so a tmpfs
too small (Docker's default 64 MiB /dev/shm) is an ENOSPC at set-up, never a SIGBUS
mid-read; then every rank falls back to the process group.

Each rank's tensors are a private (copy-on-write) mapping of the shared file: a rank that
later writes into a loaded tensor (an optimizer state handed over without a copy) changes
only its own pages, never another rank's.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import stat
import sys
import time
from pathlib import Path
from collections.abc import Sequence

import torch

from ..errors import EngineIOError

DEFAULT_DIR = "/dev/shm"
PREFIX = "gdswriter-load-"
_TMPFS_MAGIC = 0x01021994
_STALE_S = 24 * 3600
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14

_libc = ctypes.CDLL(None, use_errno=True)


def _fs_type(path: str) -> int | None:
    """statfs(2)'s f_type of ``path`` (its first field on Linux's 64-bit ABIs), or None."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return int.from_bytes(buf.raw[:8], sys.byteorder, signed=False) & 0xFFFFFFFF


def domain(share_dir: str | None) -> str | None:
    """Who shares ``share_dir`` with this process: the same string on two ranks exactly when
    they see the same tmpfs instance (the kernel's boot id and the file system's device
    number), None when it is missing, not a tmpfs or not writable (then no sharing)."""
    if not share_dir:
        return None
    try:
        if _fs_type(share_dir) != _TMPFS_MAGIC or not os.access(share_dir, os.W_OK | os.X_OK):
            return None
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat(share_dir).st_dev}"
    except OSError:
        return None


def _refuse(err: int, path: str, why: str) -> EngineIOError:
    return EngineIOError(err, path, 0, "sharing a load through the tmpfs",
                         f"{why}; the ranks pass the pieces over the process group instead. To share through "
                         f"the tmpfs again remove that entry (a load uses none it cannot trust), or set "
                         f"DistOptions(load_share_dir=...) to a tmpfs directory only root or this user may write")


def _check_parent(fd: int, path: str) -> None:
    """``path`` (open as ``fd``) must keep its entries: root's or this user's, and sticky where
    others may write (else another user could rename a load's directory away, or swap one in)."""
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise _refuse(errno.EPERM, path, f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}: "
                                         f"another user could replace the entries in it")


def _check_private(fd: int, path: str) -> None:
    """``fd`` must be a directory this user owns that no other user may enter."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise _refuse(errno.EPERM, path, f"not a private directory of this user (uid {st.st_uid}, mode "
                                         f"{stat.S_IMODE(st.st_mode):o}): another user may have planted it")


def private_dir(share_dir: str, name: str) -> int:
    """This load's directory ``name`` in ``share_dir``, made (mode 0700) unless a peer rank
    made it: an O_DIRECTORY descriptor to open its files relative to. Raises EngineIOError,
    using nothing, where the entry is a link, not a directory, another user's, open to other
    users, or in a parent where another user may replace it."""
    path = os.path.join(share_dir, name)
    if not name or "/" in name or name in (".", ".."):
        raise _refuse(errno.EINVAL, path, "not a plain name")
    parent = os.open(share_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_parent(parent, share_dir)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass  # a peer rank made it (or someone else did: checked below)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError as e:  # ELOOP: a symbolic link; ENOTDIR: some other file
            raise _refuse(e.errno or errno.EPERM, path, "not a directory (a symbolic link or another file), or "
                                                        "gone") from e
    finally:
        os.close(parent)
    try:
        _check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_item(dir_fd: int, name: str, path: str) -> int:
    """The file ``name`` in the checked directory: created (O_EXCL) by the first holder,
    opened by the others, checked to be a regular file of this user either way."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        fd = os.open(name, flags, dir_fd=dir_fd)  # a peer holder of the item made it
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise _refuse(errno.EPERM, path, f"not a regular file of this user (uid {st.st_uid})")
    return fd


class SharedItems:
    """The tmpfs files of one load's shared items, mapped: ``shared[i]`` (writable, where this
    rank reads its pieces into) and ``private[i]`` (copy-on-write, what its tensors view)."""

    def __init__(self, share_dir: str, token: str, items: Sequence[tuple[str, int, int]]):
        """``items``: (name, index, nbytes) of each shared item; the name (the same on every
        holder) names its file in the load's directory (``PREFIX`` + ``token``), the index keys
        ``shared`` and ``private``."""
        self.directory = Path(share_dir) / f"{PREFIX}{token}"
        self.paths: list[Path] = []
        self.shared: dict[int, torch.Tensor] = {}
        self.private: dict[int, torch.Tensor] = {}
        self._maps: list[mmap.mmap] = []
        self._cows: list[mmap.mmap] = []
        self._dir: int | None = None
        try:
            self._dir = private_dir(share_dir, self.directory.name)
            for name, sid, nbytes in items:
                path = self.directory / name
                fd = _open_item(self._dir, name, str(path))
                self.paths.append(path)
                try:
                    try:
                        os.posix_fallocate(fd, 0, nbytes)  # idempotent: every rank reserves the same size
                    except OSError as e:
                        raise EngineIOError(e.errno or errno.ENOSPC, str(path), 0,
                                            f"reserving {nbytes} bytes to share a load on this host",
                                            f"{share_dir} is too small (Docker: --shm-size); the load passes "
                                            f"the pieces over the process group instead") from e
                    rw = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                    self._maps.append(rw)
                    cow = mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
                    self._cows.append(cow)
                finally:
                    os.close(fd)
                self.shared[sid] = torch.frombuffer(rw, dtype=torch.uint8)
                self.private[sid] = torch.frombuffer(cow, dtype=torch.uint8)  # the tensor keeps the mapping
        except BaseException:
            self.unlink()
            self.release_shared()
            raise

    def unlink(self) -> None:
        """Remove the names (every rank does, once all have mapped them; the memory stays while
        mapped), then the directory: the rank that unlinks last removes it."""
        if self._dir is None:
            return
        for p in self.paths:
            try:
                os.unlink(p.name, dir_fd=self._dir)
            except OSError:
                pass  # a peer holder unlinked it first
        self.paths = []
        os.close(self._dir)
        self._dir = None
        try:
            os.rmdir(self.directory)
        except OSError:
            pass  # a peer's files are still in it (it removes the directory), or it removed it first

    def release_shared(self) -> None:
        """After the read: drop the writable mappings (each is unmapped once the last view of it
        goes) and map the private ones' pages in one call each (MADV_POPULATE_READ), not one
        fault per page when the state is copied out."""
        self.shared = {}
        self._maps = []
        for m in self._cows:
            try:
                m.madvise(_MADV_POPULATE_READ)
            except OSError:  # before Linux 5.14: the pages fault in as they are read
                break
        self._cows = []


def token() -> str:
    """A name for one load's directory: its creation time (for clean_stale) and 128 random bits."""
    return f"{int(time.time()):x}-{secrets.token_hex(16)}"


def _remove_ours(parent: int, name: str) -> bool:
    """Remove the entry ``name`` of ``parent`` if this user owns it: a file, or a directory
    with the files in it. Never follows a link."""
    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if st.st_uid != os.geteuid():
        return False
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return True
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False
        for entry in os.listdir(fd):
            os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)
    return True


def clean_stale(share_dir: str | None, now: float | None = None) -> int:
    """Remove this host's leftovers of loads that crashed before unlinking (older than a day):
    this user's load directories and their files (and files of the layout before them);
    returns how many. Best effort: what another user owns is left."""
    if not share_dir:
        return 0
    now = time.time() if now is None else now
    removed = 0
    try:
        parent = os.open(share_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        for name in os.listdir(parent):
            if not name.startswith(PREFIX):
                continue
            try:
                created = int(name[len(PREFIX):].split("-", 1)[0], 16)
            except ValueError:
                continue
            if now - created > _STALE_S:
                try:
                    removed += _remove_ours(parent, name)
                except OSError:
                    pass
    except OSError:
        pass
    finally:
        os.close(parent)
    return removed
