"""Ranks on one host pulling each other's pieces of a load straight from memory (process_vm_readv).

A load of replicated state reads its bytes from disk once across the ranks: each rank reads
the pieces it wrote (distributed/load.py ``load_own``). Where the ranks of a host see each
other's processes (one kernel, one PID namespace, one user: ``domain``), each then copies the
pieces it lacks from its peers' buffers into its own with process_vm_readv(2): one copy per
byte, into private memory the rank owns (so a rank writing into its loaded state changes
no other rank's), no tmpfs file, no page of shared memory to set up or tear down, nothing
over the process group but each rank's (pid, address) of one buffer (a fixed-size entry),
which rank 0 passes on to the ranks of its host only (``Coordinator.decide_each``).

The call needs ptrace access to the peer (the same uid; Yama's ptrace_scope 0, or the peer
naming this rank through PR_SET_PTRACER; a seccomp profile such as Docker's default may refuse
it with EPERM or ENOSYS). Whether it works is learnt before any byte is read (``probe``: each
rank reads a marker from every peer on its host), and agreed by every rank: where it fails
anywhere, the ranks share through the tmpfs (hostshare.py) or the process group, as they
would without it. A pull that fails later raises CrossMemoryError, which the ranks agree on
and answer by sending the pieces over the process group instead. A peer's buffer must stay
mapped and unchanged until every rank has pulled from it: load.py agrees on that before it
hands any state out.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from pathlib import Path
from collections.abc import Sequence

from ..errors import EngineIOError

_IOV_MAX = 1024  # the kernel's UIO_MAXIOV: iovecs per call
MAGIC = b"gdswriter-cma-v1"  # what ``probe`` expects at a peer's marker address


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _bind():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


# The bound syscall (None where there is none): a seam, looked up at each call, that tests replace
# to make it fail (EPERM) or transfer short.
process_vm_readv = _bind()
_marker = ctypes.create_string_buffer(MAGIC, len(MAGIC))  # lives as long as the process


class CrossMemoryError(EngineIOError):
    """Reading a peer rank's memory failed (refused, the peer gone, or fewer bytes than asked)."""

    def __init__(self, err: int, pid: int, address: int, what: str):
        super().__init__(err, f"process {pid}", address, f"{what} (process_vm_readv)",
                         "the ranks pass the pieces over the process group instead; to allow the call give the "
                         "ranks the same uid and ptrace access (kernel.yama.ptrace_scope=0, or a seccomp profile "
                         "that allows process_vm_readv), or set DistOptions(load_cross_memory=False)")


def domain() -> str | None:
    """Who can pull from this process: the same string on two ranks exactly when they run under
    one kernel (boot id), in one PID namespace and as one user; None where process_vm_readv is
    missing."""
    if process_vm_readv is None:
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/pid')}:{os.getuid()}"
    except OSError:
        return None


def marker() -> tuple[int, int]:
    """(pid, address) of this process's marker, for its peers' ``probe``."""
    return os.getpid(), ctypes.addressof(_marker)


def probe(pid: int, address: int) -> None:
    """Read the marker of process ``pid`` at ``address``: raises CrossMemoryError unless the call
    is allowed and returns the marker."""
    got = ctypes.create_string_buffer(len(MAGIC))
    pull(pid, [(address, ctypes.addressof(got), len(MAGIC))], "probing a peer rank's memory")
    if got.raw != MAGIC:
        raise CrossMemoryError(errno.EFAULT, pid, address, "probing a peer rank's memory (not its marker)")


def pull(pid: int, moves: Sequence[tuple[int, int, int]], what: str = "copying a peer rank's pieces") -> int:
    """Copy each (remote address, local address, length) of ``moves`` from process ``pid`` into
    this one; returns the bytes copied (all of them). The kernel may copy fewer bytes than asked
    (a fault part way, or its per-call cap): the rest is asked for again from where it stopped,
    and a call that copies nothing raises CrossMemoryError, as does any refusal."""
    if process_vm_readv is None:
        raise CrossMemoryError(errno.ENOSYS, pid, 0, what)
    todo = [(r, d, n) for r, d, n in moves if n > 0]
    done = 0
    while todo:
        batch = todo[:_IOV_MAX]
        local = (_Iovec * len(batch))(*[_Iovec(d, n) for _, d, n in batch])
        remote = (_Iovec * len(batch))(*[_Iovec(r, n) for r, _, n in batch])
        got = process_vm_readv(pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            raise CrossMemoryError(ctypes.get_errno() or errno.EIO, pid, batch[0][0], what)
        if got == 0:
            raise CrossMemoryError(errno.EFAULT, pid, batch[0][0], f"{what}: no byte copied")
        done += got
        # skip what was copied: whole moves, then the copied head of a partly copied one
        k = 0
        while k < len(batch) and got >= batch[k][2]:
            got -= batch[k][2]
            k += 1
        rest = todo[k:]
        if got:
            r, d, n = rest[0]
            rest[0] = (r + got, d + got, n - got)
        todo = rest
    return done
