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
(load.py ``relay_between_hosts``) into that host's file; elsewhere the pieces go rank to rank
over the process group (``relay``).

The files live only while the ranks open them: every rank creates and maps them (O_EXCL is
not needed: the name carries a random token the primary rank chose for this load), and all
unlink them as soon as every rank has mapped them, so a crash later leaves nothing behind;
one between creating and that moment can leave ``gdswriter-load-*`` files there, which
``clean_stale`` removes at the next load on the host when their token is older than a day.
Space is reserved up front (posix_fallocate), so a tmpfs too small (Docker's default 64 MiB
/dev/shm) is an ENOSPC at set-up, never a SIGBUS mid-read; then every rank falls back to the
process group.

Each rank's tensors are a private (copy-on-write) mapping of the shared file: a rank that
later writes into a loaded tensor (an optimizer state handed over without a copy) changes
only its own pages, never another rank's.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Sequence

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


class SharedItems:
    """The tmpfs files of one load's shared items, mapped: ``shared[i]`` (writable, where this
    rank reads its pieces into) and ``private[i]`` (copy-on-write, what its tensors view)."""

    def __init__(self, share_dir: str, token: str, items: Sequence[tuple[str, int, int]]):
        """``items``: (name, index, nbytes) of each shared item; the name (the same on every
        holder) names its file, the index keys ``shared`` and ``private``."""
        self.paths: list[Path] = []
        self.shared: dict[int, torch.Tensor] = {}
        self.private: dict[int, torch.Tensor] = {}
        self._maps: list[mmap.mmap] = []
        self._cows: list[mmap.mmap] = []
        try:
            for name, sid, nbytes in items:
                path = Path(share_dir) / f"{PREFIX}{token}-{name}"
                self.paths.append(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
        mapped)."""
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError:
                pass  # another user's file of that name cannot exist (random token); nothing to undo
        self.paths = []

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
    """A name for one load's files: its creation time (for clean_stale) and random bits."""
    return f"{int(time.time()):x}-{os.urandom(6).hex()}"


def clean_stale(share_dir: str | None, now: float | None = None) -> int:
    """Remove this host's leftovers of loads that crashed before unlinking (older than a day);
    returns how many. Best effort: a file another user owns is left."""
    if not share_dir:
        return 0
    now = time.time() if now is None else now
    removed = 0
    try:
        names = os.listdir(share_dir)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            created = int(name[len(PREFIX):].split("-", 1)[0], 16)
        except ValueError:
            continue
        if now - created > _STALE_S:
            try:
                os.unlink(os.path.join(share_dir, name))
                removed += 1
            except OSError:
                pass
    return removed
