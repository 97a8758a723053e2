"""A minimal io_uring ring driven through raw syscalls (ctypes).

Why not a binding: the PyPI ``liburing`` package needs Linux 6.14+, while DGX OS
ships 5.15. The three io_uring syscalls have the same numbers (425-427) on
x86-64 and aarch64, and the ring ABI used here (READ/WRITE, READ_FIXED/
WRITE_FIXED, registered buffers, single mmap) exists since Linux 5.6.

Memory ordering: we never poll the completion queue without a syscall in
between. The kernel publishes a CQE before its tail with a release store and
io_uring_enter() executes full barriers on this CPU before it returns, so the
plain loads that follow it see complete CQEs on weakly ordered CPUs (aarch64)
as well. Submissions are consumed inside io_uring_enter() on this thread (no
SQPOLL), so program order suffices there.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct

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


class IoUring:
    """One submission/completion ring. Not thread-safe: one thread drives it."""

    def __init__(self, entries: int):
        if entries < 1 or entries & (entries - 1):
            raise ValueError(f"io_uring entries must be a power of two >= 1, got {entries}")
        params = _Params()
        self.fd = _check(_syscall(SYS_IO_URING_SETUP, ctypes.c_long(entries), ctypes.byref(params)),
                         "io_uring_setup")
        try:
            self._map(params)
        except BaseException:
            os.close(self.fd)
            raise
        self.registered_buffers = 0
        self.in_flight = 0

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
        self._sq_head, self._sq_tail, self._sq_array = sq.head, sq.tail, sq.array
        self._sq_mask = _U32.unpack_from(self._sq_ring, sq.ring_mask)[0]
        self._cq_head, self._cq_tail, self._cqes = cq.head, cq.tail, cq.cqes
        self._cq_mask = _U32.unpack_from(self._cq_ring, cq.ring_mask)[0]
        self._local_tail = _U32.unpack_from(self._sq_ring, self._sq_tail)[0]
        self._to_submit = 0

    # -- buffers -----------------------------------------------------------
    def register_buffers(self, regions: list[tuple[int, int]]) -> None:
        """Register (address, length) regions for READ_FIXED/WRITE_FIXED. Raises OSError."""
        iovs = (_IoVec * len(regions))(*[_IoVec(a, n) for a, n in regions])
        _check(_syscall(SYS_IO_URING_REGISTER, ctypes.c_long(self.fd), ctypes.c_long(IORING_REGISTER_BUFFERS),
                        iovs, ctypes.c_long(len(regions))), "io_uring_register(BUFFERS)")
        self.registered_buffers = len(regions)

    # -- submission ----------------------------------------------------------
    def sq_space(self) -> int:
        head = _U32.unpack_from(self._sq_ring, self._sq_head)[0]
        return self.sq_entries - ((self._local_tail - head) & 0xFFFFFFFF)

    def prep(self, opcode: int, fd: int, addr: int, length: int, offset: int, user_data: int,
             buf_index: int = 0) -> None:
        """Queue one read/write SQE; it reaches the kernel on the next enter()."""
        if self.sq_space() <= 0:
            raise RuntimeError("io_uring submission queue full: call enter() first")
        idx = self._local_tail & self._sq_mask
        _SQE.pack_into(self._sqes, idx * _SQE.size, opcode, 0, 0, fd, offset, addr, length, 0, user_data,
                       buf_index, 0, 0, 0, 0)
        _U32.pack_into(self._sq_ring, self._sq_array + idx * 4, idx)
        self._local_tail = (self._local_tail + 1) & 0xFFFFFFFF
        _U32.pack_into(self._sq_ring, self._sq_tail, self._local_tail)
        self._to_submit += 1
        self.in_flight += 1

    def enter(self, min_complete: int = 0) -> None:
        """Submit queued SQEs and wait for at least ``min_complete`` completions."""
        flags = IORING_ENTER_GETEVENTS if min_complete else 0
        while True:
            ret = _syscall(SYS_IO_URING_ENTER, ctypes.c_long(self.fd), ctypes.c_long(self._to_submit),
                           ctypes.c_long(min_complete), ctypes.c_long(flags), None, ctypes.c_long(0))
            if ret >= 0:
                self._to_submit -= ret
                if self._to_submit == 0 or min_complete:
                    return
                continue  # the kernel took fewer than queued (ring pressure): push the rest
            e = ctypes.get_errno()
            if e == errno.EINTR:
                continue
            # EBUSY/EAGAIN cannot happen while callers keep in_flight <= sq_entries (cq is 2x sq).
            raise OSError(e, f"io_uring_enter: {os.strerror(e)}")

    # -- completion ----------------------------------------------------------
    def reap(self) -> list[tuple[int, int]]:
        """Return [(user_data, res)] for every posted completion and free their slots."""
        head = _U32.unpack_from(self._cq_ring, self._cq_head)[0]
        tail = _U32.unpack_from(self._cq_ring, self._cq_tail)[0]
        out = []
        while head != tail:
            user_data, res, _ = _CQE.unpack_from(self._cq_ring, self._cqes + (head & self._cq_mask) * _CQE.size)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        _U32.pack_into(self._cq_ring, self._cq_head, head)
        self.in_flight -= len(out)
        return out

    def wait(self, min_complete: int = 1) -> list[tuple[int, int]]:
        """Submit anything queued, then return at least ``min_complete`` completions."""
        self.enter(min_complete)
        return self.reap()

    def close(self) -> None:
        if self.fd < 0:
            return
        # Drain what is in flight: the kernel may still DMA into our buffers.
        while self.in_flight > 0:
            try:
                self.wait(1)
            except OSError:
                break
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
