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
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

from .._log import log_once

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
LOCK_STEP = 64 << 20  # mlock this much at a time (see AlignedBufferPool)
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


@dataclass(eq=False)
class StagingBuffer:
    """One aligned buffer, seen as raw address, memoryview and uint8 tensor."""

    index: int
    address: int
    size: int
    view: memoryview
    tensor: torch.Tensor


class AlignedBufferPool:
    """``count`` buffers of ``size`` bytes each (size rounded up to 4 KiB)."""

    def __init__(self, size: int, count: int, *, lock_memory: bool = True, huge_pages: bool = True):
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
        if lock_memory:
            # In steps of LOCK_STEP: mlock faults every page in while it holds the process's memory
            # map lock, which blocks other threads' mmap/munmap (large allocations) until it returns.
            done, e = 0, 0
            while done < total:
                n = min(LOCK_STEP, total - done)
                if _libc.mlock(ctypes.c_void_p(self._base + done), ctypes.c_size_t(n)) != 0:
                    e = ctypes.get_errno()
                    break
                done += n
            if done == total:
                self.locked = True
            else:
                if done:
                    _libc.munlock(ctypes.c_void_p(self._base), ctypes.c_size_t(done))
                log_once("mlock", f"gdswriter: mlock of {total} staging bytes refused "
                                  f"({os.strerror(e)}); using unlocked aligned memory. Raise `ulimit -l` "
                                  f"(RLIMIT_MEMLOCK) for page-locked buffers")
        self.buffers = [
            StagingBuffer(i, self._base + i * self.size, self.size, whole[i * self.size:(i + 1) * self.size],
                          torch.frombuffer(whole[i * self.size:(i + 1) * self.size], dtype=torch.uint8))
            for i in range(count)
        ]
        whole.release()

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
        if self.cuda_pinned:
            with torch.cuda.device(self._cuda_device):
                torch.cuda.cudart().cudaHostUnregister(self._base)
        for b in self.buffers:
            b.tensor = None  # type: ignore[assignment]
            b.view.release()
        self.buffers = []
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self._base), ctypes.c_size_t(self.size * self.count))
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
