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
took 6-260 ms to lock). A pool made with ``lock_ahead`` returns at once, and a thread of its own
locks it front to back, LOCK_AHEAD_STEP at a time; ``wait_locked(end)`` returns once bytes
[0, end) are locked (or locking stopped: refused, the pool then unlocked as above), taking the
steps it needs itself where the thread has not claimed them yet (on a loaded machine the
scheduler may not run that thread when the user needs it). A user that waits before it
touches a range (the host snapshot pool's copier, before each piece: the engines write a
piece only once it is filled) gets the same page-locked memory, while the locking overlaps
its work on the ranges already locked. A forked child gets a new condition and an unlocked
pool (``_FrontToBack.after_fork_in_child``): the parent's locker may have held the condition.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
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


class _FrontToBack:
    """The locking of one pool, [base, base + total), front to back in ``step``-byte steps, by
    whoever asks: the pool's own thread (``run``), or a user waiting for a range
    (``wait_locked``), which takes the next step it needs itself rather than wait for a thread
    the scheduler may not run now (on a loaded machine it is one more runnable thread). A
    step is claimed under the condition and locked outside it; ``prefix``: [0, prefix) is
    locked. Refused (RLIMIT_MEMLOCK): no further step is claimed, and once none is under way
    what was claimed is unlocked (``run``) and the pool is used unlocked, said once."""

    def __init__(self, base: int, total: int, step: int):
        self.base, self.total, self.step = base, total, step
        _every.add(self)
        self.cv = threading.Condition()
        self.next = 0  # the first byte no step claimed
        self.prefix = 0  # [0, prefix) is locked
        self.ahead: set[int] = set()  # steps locked past the prefix (a helper's, or the thread's)
        self.busy = 0  # steps being locked now
        self.error = 0  # the errno that refused a step
        self.stop = False  # close(): claim no more
        self.running = True  # run() has not ended
        self.whole = False  # every byte locked

    def _claim(self, below: int) -> int | None:
        """The next step, if one starting below ``below`` is left to claim (under ``cv``)."""
        if self.error or self.stop or self.next >= min(below, self.total):
            return None
        off, self.next = self.next, self.next + self.step
        self.busy += 1
        return off

    def _take(self, off: int) -> None:
        e = mlock(self.base + off, min(self.step, self.total - off))
        with self.cv:
            self.busy -= 1
            if e:
                self.error = self.error or e
            else:
                self.ahead.add(off)
                while self.prefix in self.ahead:
                    self.ahead.discard(self.prefix)
                    self.prefix = min(self.total, self.prefix + self.step)
            self.cv.notify_all()

    def run(self) -> None:
        """Lock every step not claimed yet; then, once the helpers' steps are done, settle."""
        try:
            while True:
                with self.cv:
                    off = self._claim(self.total)
                if off is None:
                    break
                self._take(off)
            with self.cv:
                while self.busy:
                    self.cv.wait()
                error, claimed = self.error, self.next
                self.whole = not error and self.prefix >= self.total
            if error:
                _libc.munlock(ctypes.c_void_p(self.base), ctypes.c_size_t(min(claimed, self.total)))
                with self.cv:
                    self.prefix = 0
                log_once("mlock", f"gdswriter: mlock of {self.total} staging bytes refused "
                                  f"({os.strerror(error)}); using unlocked aligned memory. Raise `ulimit -l` "
                                  f"(RLIMIT_MEMLOCK) for page-locked buffers")
        finally:
            with self.cv:
                self.running = False
                self.cv.notify_all()

    def after_fork_in_child(self) -> None:
        """In a forked child: only the forking thread lives on, with none of the parent's page
        locks (mlock is not inherited). The locker thread, or a user's waiting thread, may have
        held ``cv`` at the fork: a child touching it would wait for good. So: a new condition,
        nothing locked, nothing under way, no step to claim (the pool is used unlocked there)."""
        self.cv = threading.Condition()
        self.prefix, self.busy, self.running, self.stop, self.whole = 0, 0, False, True, False
        self.ahead = set()

    def wait_locked(self, end: int, thread: threading.Thread | None) -> bool:
        """Until [0, end) is locked (taking the steps it needs that nobody took yet) or locking
        stopped; whether it is locked. ``thread``: the pool's locker (not alive while "running":
        a forked child, which has neither the thread nor its parent's locks: no waiting then)."""
        while True:
            with self.cv:
                if self.prefix >= end or self.error or not self.running or (thread and not thread.is_alive()):
                    return self.prefix >= end
                off = self._claim(end)
                if off is None:  # the steps it needs are being locked: wait for them
                    self.cv.wait()
                    continue
            self._take(off)


_every: weakref.WeakSet[_FrontToBack] = weakref.WeakSet()  # every pool's locking (for the fork hook)


def _after_fork_in_child() -> None:
    for locking in list(_every):
        locking.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
        self.cuda_pinned = False
        self._cuda_device: torch.device | None = None  # the device current when registration was tried
        self.buffers = [
            StagingBuffer(i, self._base + i * self.size, self.size, whole[i * self.size:(i + 1) * self.size],
                          torch.frombuffer(whole[i * self.size:(i + 1) * self.size], dtype=torch.uint8))
            for i in range(count)
        ]
        whole.release()
        # mlock in steps: it faults every page in while it holds the process's memory map lock,
        # which blocks other threads' mmap/munmap (large allocations) until it returns
        self._locking = _FrontToBack(self._base, total, LOCK_AHEAD_STEP if lock_ahead else LOCK_STEP) \
            if lock_memory else None
        self._locker: threading.Thread | None = None
        if self._locking is not None and lock_ahead:
            self._locker = threading.Thread(target=self._locking.run, name="gdswriter-mlock", daemon=True)
            self._locker.start()
        elif self._locking is not None:
            self._locking.run()

    @property
    def locked(self) -> bool:
        """Whether the whole pool is page-locked (with lock_ahead: once its locking is done)."""
        return self._locking is not None and self._locking.whole

    def wait_locked(self, end: int) -> bool:
        """Wait until bytes [0, ``end``) of the pool are locked, or until locking stopped; returns
        whether they are locked (False: mlock was refused or not asked for, the memory is used
        unlocked). At once for a pool locked at creation. A step nobody took yet is taken by
        the caller itself (see _FrontToBack)."""
        if self._locking is None:
            return end <= 0
        return self._locking.wait_locked(end, self._locker)

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
        if self._locking is not None:
            self._locking.stop = True  # a locker still running claims no further step
        self.finish_locking()
        if self.cuda_pinned:
            with torch.cuda.device(self._cuda_device):
                torch.cuda.cudart().cudaHostUnregister(self._base)
        for b in self.buffers:
            b.tensor = None  # type: ignore[assignment]
            b.view.release()
        self.buffers = []
        if self._locking is not None and self._locking.next:  # what any step claimed (unlocking the rest is a no-op)
            _libc.munlock(ctypes.c_void_p(self._base), ctypes.c_size_t(min(self._locking.next, self._locking.total)))
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
