"""A pool of 4 KiB-aligned, page-locked host staging buffers.

Anonymous mmap gives page alignment; mlock keeps the pages resident so the
kernel can DMA without faulting. Where mlock is refused (RLIMIT_MEMLOCK) the
pool works on unlocked memory and says so once.

CUDA: the pool is registered with the CUDA runtime (cudaHostRegister, so that
copies between a GPU and the buffers are DMA from page-locked memory) only when
the engine first stages a CUDA tensor, never at creation: asking
torch.cuda.is_available() and registering up front initialised CUDA in CPU-only
jobs, and registered with whatever device was current on the thread creating the
engine (GPU 0 on every rank). Registration runs with the tensor's device
current and with cudaHostRegisterPortable, so the buffers count as page-locked
for every device's context.

By default the pool starts on a 2 MiB boundary and asks for transparent huge
pages (MADV_HUGEPAGE): a request then spans a few physically contiguous
segments instead of one per 4 KiB page, and the speed of staged I/O no longer
depends on which 4 KiB pages the pool happened to get. On this project's VM a
pool of 4 KiB pages allocated right after the process freed memory (as a
training job does before it creates its checkpointer) wrote 15-30% and read
33-41% slower than one allocated elsewhere; with huge pages both were as fast
(benchmarks/staging_placement.py). Where THP is off, the advice changes nothing.

Locking ahead (``lock_ahead``): mlock is where fresh memory costs (the kernel zeroes every page
it faults in; on this project's VM, which gives freed memory back to its host, a fresh 64 MiB
took 6-220 ms to lock). A pool made with ``lock_ahead`` returns at once, and a thread of its own
locks it front to back, LOCK_AHEAD_STEP at a time; ``wait_locked(end)`` waits until bytes
[0, end) are locked (or locking stopped: refused, the pool then unlocked as above). A user that
waits before it touches a range (the host snapshot pool's copier, before each piece: the
engines write a piece only once it is filled) gets the same page-locked memory, while the
locking overlaps its work on the ranges already locked.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from dataclasses import dataclass

import torch

from .._log import log_once

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
LOCK_STEP = 64 << 20  # mlock this much at a time (see AlignedBufferPool)
LOCK_AHEAD_STEP = 4 << 20  # with lock_ahead: this much at a time, so that a user starts on the first bytes early
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def mlock(address: int, n: int) -> int:
    """mlock bytes [address, address + n): 0, or the errno that refused it. A test seam (tests
    wrap it to slow a pool's locking down or refuse it; the pool looks it up at each step)."""
    if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(n)) != 0:
        return ctypes.get_errno()
    return 0


@dataclass(eq=False)
class StagingBuffer:
    """One aligned buffer, seen as raw address, memoryview and uint8 tensor."""

    index: int
    address: int
    size: int
    view: memoryview
    tensor: torch.Tensor


class AlignedBufferPool:
    """``count`` buffers of ``size`` bytes each (size rounded up to 4 KiB). ``lock_ahead``: lock
    on a thread of its own, see the module docstring (``wait_locked``)."""

    def __init__(self, size: int, count: int, *, lock_memory: bool = True, huge_pages: bool = True,
                 lock_ahead: bool = False):
        self.size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.count = count
        total = self.size * count
        # With huge pages, map one huge page more than needed and start the pool at the first
        # 2 MiB boundary in it (the slack stays untouched, so it costs no memory).
        slack = HUGE_PAGE if huge_pages else 0
        self._mm = mmap.mmap(-1, total + slack, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        mapped = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        skip = -mapped % HUGE_PAGE if huge_pages else 0
        self._base = mapped + skip
        self.huge_pages = False
        if huge_pages:
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE, skip, total)
                self.huge_pages = True
            except (AttributeError, OSError):  # no MADV_HUGEPAGE here, or a kernel without THP
                pass
        whole = memoryview(self._mm)[skip:skip + total]
        self.locked = False
        self.cuda_pinned = False
        self._cuda_device: torch.device | None = None  # the device current when registration was tried
        self._cv = threading.Condition()
        self._locked_bytes = 0  # [0, this) is locked
        self._locking = False  # the locker thread runs (lock_ahead)
        self._stop = False  # close() asks the locker to stop
        self._locker: threading.Thread | None = None
        self.buffers = [
            StagingBuffer(i, self._base + i * self.size, self.size, whole[i * self.size:(i + 1) * self.size],
                          torch.frombuffer(whole[i * self.size:(i + 1) * self.size], dtype=torch.uint8))
            for i in range(count)
        ]
        whole.release()
        if lock_memory and lock_ahead:
            self._locking = True
            self._locker = threading.Thread(target=self._lock, args=(LOCK_AHEAD_STEP,), name="gdswriter-mlock",
                                            daemon=True)
            self._locker.start()
        elif lock_memory:
            self._lock(LOCK_STEP)

    def _lock(self, step: int) -> None:
        """mlock the pool front to back, ``step`` bytes at a time: mlock faults every page in while
        it holds the process's memory map lock, which blocks other threads' mmap/munmap (large
        allocations) until it returns. Refused (RLIMIT_MEMLOCK): what was locked is unlocked, the
        pool stays unlocked, and it is said once."""
        total = self.size * self.count
        done, e = 0, 0
        try:
            while done < total and not self._stop:
                n = min(step, total - done)
                e = mlock(self._base + done, n)
                if e:
                    break
                done += n
                with self._cv:
                    self._locked_bytes = done
                    self._cv.notify_all()
            if done == total:
                self.locked = True
            elif e:
                with self._cv:
                    self._locked_bytes = 0
                if done:
                    _libc.munlock(ctypes.c_void_p(self._base), ctypes.c_size_t(done))
                log_once("mlock", f"gdswriter: mlock of {total} staging bytes refused "
                                  f"({os.strerror(e)}); using unlocked aligned memory. Raise `ulimit -l` "
                                  f"(RLIMIT_MEMLOCK) for page-locked buffers")
        finally:
            with self._cv:
                self._locking = False
                self._cv.notify_all()

    def wait_locked(self, end: int) -> bool:
        """Wait until bytes [0, ``end``) of the pool are locked, or until locking stopped; returns
        whether they are locked (False: mlock was refused or not asked for, the memory is used
        unlocked). At once for a pool locked at creation."""
        with self._cv:
            # (not alive, still "locking": a forked child, which has no locker and no locks of its parent)
            while self._locking and self._locked_bytes < end and self._locker.is_alive():  # type: ignore[union-attr]
                self._cv.wait()
            return self._locked_bytes >= end

    def finish_locking(self) -> None:
        """Wait until the locker thread (lock_ahead) is done with the whole pool."""
        locker = self._locker
        if locker is not None:
            locker.join()

    @property
    def closed(self) -> bool:
        """Whether close() unmapped the buffers (kept pools never are)."""
        return self._mm is None

    @property
    def cuda_device(self) -> torch.device | None:
        """The device current when the pool was registered with CUDA (None: never tried)."""
        return self._cuda_device

    def regions(self) -> list[tuple[int, int]]:
        return [(b.address, b.size) for b in self.buffers]

    def pin_for_cuda(self, device: torch.device) -> bool:
        """Register the pool with CUDA, ``device`` current, portable to every device; tried once
        (later calls return the first outcome). Returns whether the pool is registered."""
        if self._cuda_device is not None or self._mm is None:
            return self.cuda_pinned
        self.finish_locking()  # cudaHostRegister pins every page itself: not beside the locker
        self._cuda_device = device
        with torch.cuda.device(device):
            rc = torch.cuda.cudart().cudaHostRegister(self._base, self.size * self.count, CUDA_HOST_REGISTER_PORTABLE)
        self.cuda_pinned = int(rc) == 0
        if not self.cuda_pinned:
            log_once("cudaHostRegister", f"gdswriter: cudaHostRegister failed ({rc}); copies between GPUs and "
                                         f"the staging buffers will go through pageable memory (slower)")
        return self.cuda_pinned

    def close(self) -> None:
        if self._mm is None:
            return
        self._stop = True  # a locker still running stops at its next step
        self.finish_locking()
        if self.cuda_pinned:
            with torch.cuda.device(self._cuda_device):
                torch.cuda.cudart().cudaHostUnregister(self._base)
        for b in self.buffers:
            b.tensor = None  # type: ignore[assignment]
            b.view.release()
        self.buffers = []
        if self._locked_bytes:
            _libc.munlock(ctypes.c_void_p(self._base), ctypes.c_size_t(self._locked_bytes))
        try:
            self._mm.close()
        except BufferError:
            # A caller still holds a view; the mapping is freed with the last reference.
            pass
        self._mm = None

    def __enter__(self) -> AlignedBufferPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
