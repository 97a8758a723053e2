"""A minimal io_uring ring driven through raw syscalls (ctypes).

Why not a binding: the PyPI ``liburing`` package needs Linux 6.14+, while DGX OS
ships 5.15. The three io_uring syscalls have the same numbers (425-427) on
x86-64 and aarch64, and the ring ABI used here (READ/WRITE, READ_FIXED/
WRITE_FIXED, registered buffers, single mmap) exists since Linux 5.6.

Memory ordering. The kernel does not post completions only inside
io_uring_enter(): io-wq workers (buffered I/O, requests punted to a worker)
post them from other CPUs at any time, also after the syscall returned, so the
syscall orders nothing for them. Reading the CQ tail and then the CQEs it covers
needs an acquire load of the tail (else a weakly ordered CPU, e.g. aarch64 on
Grace, may return a CQE's old contents), and handing slots back needs a release
store of the CQ head (else the kernel may overwrite a CQE that is still being
read). The SQ tail is published with a release store, so that the SQEs are
visible before the tail that covers them. Without SQPOLL (never used here) a
plain store would do there: the kernel reads the SQ ring only inside
io_uring_enter() called by this same thread, in program order after the store
(a migration to another CPU in between passes the scheduler's full barriers);
the release store keeps it right regardless. The SQ head, which the kernel
writes with a release store, is read with an acquire load.

Python has no fences, so these accesses go through one ``MemoryOrdering``,
chosen at import (``ORDERING``):

* x86-64: plain loads and stores. x86 is TSO: every load is an acquire and
  every store a release, and each access here is a separate C call that no
  compiler moves across another.
* elsewhere, libatomic's ``__atomic_load_4``/``__atomic_store_4`` with
  __ATOMIC_ACQUIRE/__ATOMIC_RELEASE, called through ctypes (LDAR/STLR on
  aarch64), where libatomic.so.1 exists (it ships with gcc's runtime);
* else membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED), which executes smp_mb()
  on the calling CPU: after a plain load it makes an acquire, before a plain
  store a release.

Where none of them works, probe() reports io_uring unavailable (the POSIX
engine is used instead).

Failures. The ring's counts are read from the ring itself (our SQ tail and CQ
head, the kernel's SQ head), never from Python counters that an exception
(Ctrl-C between two statements) could leave stale, so ``in_flight`` and
``queued`` are right whatever was interrupted. enter() retries EINTR; under
EAGAIN/EBUSY (the kernel cannot allocate requests, or its completion queue is
full) it first reaps and waits for completions that free kernel resources,
as liburing advises; a call that makes no progress is retried a bounded number
of times with backoff, then ``RingError`` is raised. drain() leaves nothing the
kernel can act on: it withdraws queued SQEs and waits for every submitted one.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RingError

SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426
SYS_IO_URING_REGISTER = 427

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000

IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_ENTER_GETEVENTS = 1 << 0
IORING_REGISTER_BUFFERS = 0
IORING_UNREGISTER_BUFFERS = 1

OP_READ_FIXED = 4
OP_WRITE_FIXED = 5
OP_READ = 22
OP_WRITE = 23

_SQE = struct.Struct("=BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("=QiI")  # struct io_uring_cqe, 16 bytes
_U32 = struct.Struct("=I")
assert _SQE.size == 64 and _CQE.size == 16
_WRAP = 0xFFFFFFFF  # ring indices are free-running u32

# A call that makes no progress (nothing submitted, nothing completed) is retried this many
# times, sleeping BACKOFF_S, doubling up to BACKOFF_MAX_S, in between: about 1.3 s in all. Public
# module constants: tests shorten the backoff by setting them (an option would widen EngineOptions for
# tests only).
STALL_RETRIES = 12
BACKOFF_S = 0.001
BACKOFF_MAX_S = 0.25


class _SqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("sq_entries", "cq_entries", "flags", "sq_thread_cpu", "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


# ---------------------------------------------------------------------------
# Ordered access to the u32 cells shared with the kernel
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryOrdering:
    """How acquire loads and release stores of a u32 at a raw address are made here."""

    name: str
    load_acquire: Callable[[int], int]
    store_release: Callable[[int, int], None]


_u32_at = ctypes.c_uint32.from_address


def _plain_load(addr: int) -> int:
    return _u32_at(addr).value


def _plain_store(addr: int, value: int) -> None:
    _u32_at(addr).value = value


def _plain() -> MemoryOrdering:
    return MemoryOrdering("x86-64 TSO: plain loads and stores", _plain_load, _plain_store)


def _libatomic() -> MemoryOrdering | None:
    try:
        lib = ctypes.CDLL("libatomic.so.1")
        load, store = lib["__atomic_load_4"], lib["__atomic_store_4"]
    except (OSError, AttributeError):
        return None
    load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint32
    store.argtypes, store.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int], None
    acquire, release = 2, 3  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE

    def load_acquire(addr: int) -> int:
        return load(addr, acquire)

    def store_release(addr: int, value: int) -> None:
        store(addr, value, release)

    return MemoryOrdering("libatomic __atomic_load_4/__atomic_store_4 (acquire/release)", load_acquire,
                          store_release)


_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283, "arm64": 283, "riscv64": 283, "ppc64le": 365, "ppc64": 365,
                   "s390x": 356}
_MEMBARRIER_CMD_PRIVATE_EXPEDITED = 1 << 3
_MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED = 1 << 4


def _membarrier() -> MemoryOrdering | None:
    nr = _SYS_MEMBARRIER.get(platform.machine())
    if nr is None or _syscall(nr, _MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) != 0:
        return None

    def barrier() -> None:
        if _syscall(nr, _MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0:  # registered above: cannot fail
            raise RingError(ctypes.get_errno(), "membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed")

    def load_acquire(addr: int) -> int:
        value = _u32_at(addr).value
        barrier()
        return value

    def store_release(addr: int, value: int) -> None:
        barrier()
        _u32_at(addr).value = value

    return MemoryOrdering("membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) around plain accesses", load_acquire,
                          store_release)


def available_orderings() -> dict[str, MemoryOrdering]:
    """Every mechanism that works on this machine, by kind ("plain" only on x86-64)."""
    found = {"plain": _plain()} if platform.machine() in ("x86_64", "AMD64") else {}
    for kind, make in (("libatomic", _libatomic), ("membarrier", _membarrier)):
        o = make()
        if o is not None:
            found[kind] = o
    return found


def _choose() -> MemoryOrdering | None:
    if platform.machine() in ("x86_64", "AMD64"):
        return _plain()
    return _libatomic() or _membarrier()


ORDERING: MemoryOrdering | None = _choose()


# ---------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------
def _mmap_address(m: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # release the buffer export, so the mmap can be closed


class IoUring:
    """One submission/completion ring. Not thread-safe: one thread drives it."""

    def __init__(self, entries: int, *, ordering: MemoryOrdering | None = None):
        if entries < 1 or entries & (entries - 1):
            raise ValueError(f"io_uring entries must be a power of two >= 1, got {entries}")
        ordering = ordering or ORDERING
        if ordering is None:
            raise OSError(errno.ENOTSUP, "no way to order memory accesses shared with the kernel here")
        self._load_acquire, self._store_release = ordering.load_acquire, ordering.store_release
        params = _Params()
        self.fd = _check(_syscall(SYS_IO_URING_SETUP, ctypes.c_long(entries), ctypes.byref(params)),
                         "io_uring_setup")
        try:
            self._map(params)
        except BaseException:
            os.close(self.fd)
            raise
        self.registered_buffers = 0

    def _map(self, p: _Params) -> None:
        sq, cq = p.sq_off, p.cq_off
        sq_size = sq.array + p.sq_entries * 4
        cq_size = cq.cqes + p.cq_entries * _CQE.size
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
            self._sq_ring = self._cq_ring = mmap.mmap(self.fd, sq_size, flags, prot, offset=IORING_OFF_SQ_RING)
        else:
            self._sq_ring = mmap.mmap(self.fd, sq_size, flags, prot, offset=IORING_OFF_SQ_RING)
            self._cq_ring = mmap.mmap(self.fd, cq_size, flags, prot, offset=IORING_OFF_CQ_RING)
        self._sqes = mmap.mmap(self.fd, p.sq_entries * _SQE.size, flags, prot, offset=IORING_OFF_SQES)
        self.sq_entries, self.cq_entries = p.sq_entries, p.cq_entries
        sq_base, cq_base = _mmap_address(self._sq_ring), _mmap_address(self._cq_ring)
        self._sq_head, self._sq_tail = sq_base + sq.head, sq_base + sq.tail
        self._sq_array = sq.array
        self._sq_mask = _U32.unpack_from(self._sq_ring, sq.ring_mask)[0]
        self._cq_head, self._cq_tail, self._cqes = cq_base + cq.head, cq_base + cq.tail, cq.cqes
        self._cq_mask = _U32.unpack_from(self._cq_ring, cq.ring_mask)[0]
        # Our own cells (SQ tail, CQ head): only this thread writes them, so plain loads read them.
        self._sq_tail_now = ctypes.c_uint32.from_address(self._sq_tail)
        self._cq_head_now = ctypes.c_uint32.from_address(self._cq_head)

    # -- counts, read from the ring ------------------------------------------
    @property
    def queued(self) -> int:
        """SQEs prepared that the kernel has not taken yet (0 once closed)."""
        if self.fd < 0:
            return 0
        return (self._sq_tail_now.value - self._load_acquire(self._sq_head)) & _WRAP

    @property
    def in_flight(self) -> int:
        """Requests prepared whose completion was not reaped yet, queued ones included (0 once closed)."""
        if self.fd < 0:
            return 0
        return (self._sq_tail_now.value - self._cq_head_now.value) & _WRAP

    def sq_space(self) -> int:
        return self.sq_entries - self.queued

    # -- buffers -----------------------------------------------------------
    def register_buffers(self, regions: list[tuple[int, int]]) -> None:
        """Register (address, length) regions for READ_FIXED/WRITE_FIXED. Raises OSError."""
        iovs = (_IoVec * len(regions))(*[_IoVec(a, n) for a, n in regions])
        _check(_syscall(SYS_IO_URING_REGISTER, ctypes.c_long(self.fd), ctypes.c_long(IORING_REGISTER_BUFFERS),
                        iovs, ctypes.c_long(len(regions))), "io_uring_register(BUFFERS)")
        self.registered_buffers = len(regions)

    def unregister_buffers(self) -> None:
        """Drop the registered regions (none may be in use by a request). Raises OSError."""
        _check(_syscall(SYS_IO_URING_REGISTER, ctypes.c_long(self.fd), ctypes.c_long(IORING_UNREGISTER_BUFFERS),
                        None, ctypes.c_long(0)), "io_uring_register(UNREGISTER_BUFFERS)")
        self.registered_buffers = 0

    # -- submission ----------------------------------------------------------
    def prep(self, opcode: int, fd: int, addr: int, length: int, offset: int, user_data: int,
             buf_index: int = 0) -> None:
        """Queue one read/write SQE; it reaches the kernel on the next submit() or wait()."""
        if self.fd < 0:
            raise ValueError("this io_uring ring is closed")
        tail = self._sq_tail_now.value
        if ((tail - self._load_acquire(self._sq_head)) & _WRAP) >= self.sq_entries:
            raise RuntimeError("io_uring submission queue full: call submit() first")
        idx = tail & self._sq_mask
        _SQE.pack_into(self._sqes, idx * _SQE.size, opcode, 0, 0, fd, offset, addr, length, 0, user_data,
                       buf_index, 0, 0, 0, 0)
        _U32.pack_into(self._sq_ring, self._sq_array + idx * 4, idx)
        self._store_release(self._sq_tail, (tail + 1) & _WRAP)  # publishes the SQE: the one state change

    def enter_syscall(self, to_submit: int, min_complete: int, flags: int) -> int:
        """One io_uring_enter syscall: its result, or -errno, never retried. A seam: the fault-injecting
        engine (gdswriter.testing) and tests replace it on a ring to fail or interrupt the syscall."""
        ret = _syscall(SYS_IO_URING_ENTER, ctypes.c_long(self.fd), ctypes.c_long(to_submit),
                       ctypes.c_long(min_complete), ctypes.c_long(flags), None, ctypes.c_long(0))
        return ret if ret >= 0 else -ctypes.get_errno()

    def submit(self) -> None:
        """Hand the queued SQEs to the kernel without waiting. Under pressure (EAGAIN/EBUSY) with
        requests in the kernel, the rest stays queued for wait(), which first makes room."""
        self._run(0, None)

    def wait(self, min_complete: int = 1) -> list[tuple[int, int]]:
        """Submit everything queued, then return [(user_data, res)] for every completion posted,
        at least ``min_complete`` of them (at most as many as are in flight)."""
        out = self.reap()
        self._run(min_complete, out)
        return out

    def _run(self, min_complete: int, out: list | None) -> None:
        """Submit what is queued and, with ``out``, reap into it until it holds ``min_complete``
        completions. Raises RingError on a hard error or when no progress comes after retries."""
        stalls = 0
        hold = False  # after EAGAIN/EBUSY: wait for completions (freeing kernel resources) before submitting
        while True:
            in_flight, queued = self.in_flight, self.queued
            in_kernel = in_flight - queued
            want = min(min_complete - len(out), in_flight) if out is not None else 0
            to_submit = 0 if hold and in_kernel else queued
            if hold and in_kernel and out is not None:
                want = max(want, 1)
            if not to_submit and want <= 0:
                return
            # The kernel skips the wait when it took fewer SQEs than offered, so ``want`` may count
            # SQEs submitted by this very call without blocking forever.
            ret = self.enter_syscall(to_submit, max(want, 0), IORING_ENTER_GETEVENTS if want > 0 else 0)
            got = self.reap() if out is not None else []
            if out is not None:
                out.extend(got)
            if ret == -errno.EINTR:
                continue  # a signal; Python runs its handler at the next check (Ctrl-C raises there)
            if ret < 0 and -ret not in (errno.EAGAIN, errno.EBUSY):
                raise RingError(-ret, f"io_uring_enter: {os.strerror(-ret)}")
            hold = ret < 0
            if ret > 0 or got:
                stalls = 0
                continue
            if hold and in_kernel and to_submit:  # the submission was refused
                if out is None:
                    return  # submit(): wait() reaps first, then submits the rest
                continue  # next: wait for a completion, submitting nothing (if that fails too, it is a stall)
            stalls += 1
            if stalls > STALL_RETRIES:
                e = -ret if ret < 0 else errno.EAGAIN
                raise RingError(e, f"io_uring_enter made no progress in {STALL_RETRIES} retries "
                                   f"({queued} requests queued, {in_kernel} in the kernel): {os.strerror(e)}")
            time.sleep(min(BACKOFF_S * 2 ** (stalls - 1), BACKOFF_MAX_S))

    # -- completion ----------------------------------------------------------
    def reap(self) -> list[tuple[int, int]]:
        """Return [(user_data, res)] for every posted completion and free their slots."""
        head = self._cq_head_now.value
        tail = self._load_acquire(self._cq_tail)  # orders the CQE reads below after it
        out = []
        while head != tail:
            user_data, res, _ = _CQE.unpack_from(self._cq_ring, self._cqes + (head & self._cq_mask) * _CQE.size)
            out.append((user_data, res))
            head = (head + 1) & _WRAP
        if out:
            self._store_release(self._cq_head, head)  # the CQEs are read before the kernel may reuse them
        return out

    # -- teardown ------------------------------------------------------------
    def withdraw(self) -> int:
        """Take back the queued SQEs the kernel has not taken; returns how many. Safe because,
        without SQPOLL, the kernel reads the SQ ring only inside io_uring_enter() called by the
        one thread driving this ring, and that thread is here."""
        head = self._load_acquire(self._sq_head)
        n = (self._sq_tail_now.value - head) & _WRAP
        if n:
            self._store_release(self._sq_tail, head)
        return n

    def drain(self) -> None:
        """Leave nothing the kernel can act on: withdraw what is queued, wait for (and discard)
        every completion still due. Raises RingError where the kernel does not let us wait."""
        self.withdraw()
        while self.in_flight:
            self._run(self.in_flight, [])

    def close(self) -> None:
        """Drain, then close the ring. Raises RingError (after closing) when the drain failed:
        the kernel then cancels what it can and finishes the rest on its own, so the memory and
        files those requests use must not be released."""
        if self.fd < 0:
            return
        try:
            self.drain()
        finally:
            for m in {id(x): x for x in (self._sqes, self._sq_ring, self._cq_ring)}.values():
                m.close()
            os.close(self.fd)
            self.fd = -1

    def __del__(self):  # best effort; owners call close()
        try:
            self.close()
        except Exception:
            pass


def probe() -> str | None:
    """None when io_uring works here, else the reason it does not."""
    if ORDERING is None:
        return (f"no way to order memory shared with the kernel on {platform.machine()} (no libatomic.so.1, "
                f"membarrier refused)")
    try:
        ring = IoUring(2)
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return "the kernel has no io_uring (ENOSYS: older than 5.1 or built without it)"
        if e.errno == errno.EPERM:
            return "io_uring is forbidden here (EPERM: kernel.io_uring_disabled or a seccomp filter)"
        return f"io_uring_setup failed: {e.strerror}"
    except Exception as e:  # pragma: no cover - e.g. mmap refused
        return f"io_uring could not be mapped: {e}"
    ring.close()
    return None
