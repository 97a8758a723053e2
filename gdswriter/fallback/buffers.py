"""A pool of 4 KiB-aligned, page-locked host staging buffers.

Anonymous mmap gives page alignment; mlock keeps the pages resident so the
kernel can DMA without faulting; on a CUDA machine the pages are also
registered with the CUDA runtime (cudaHostRegister) so device-to-host copies
into them are asynchronous. Where mlock is refused (RLIMIT_MEMLOCK) the pool
works on unlocked memory and says so once.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

from ..options import log_once

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


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

    def __init__(self, size: int, count: int, *, lock_memory: bool = True, pin_for_cuda: bool | None = None):
        self.size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.count = count
        self._mm = mmap.mmap(-1, self.size * count, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        whole = memoryview(self._mm)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.locked = False
        self.cuda_pinned = False
        if lock_memory:
            if _libc.mlock(ctypes.c_void_p(self._base), ctypes.c_size_t(self.size * count)) == 0:
                self.locked = True
            else:
                e = ctypes.get_errno()
                log_once("mlock", f"gdswriter: mlock of {self.size * count} staging bytes refused "
                                  f"({os.strerror(e)}); using unlocked aligned memory. Raise `ulimit -l` "
                                  f"(RLIMIT_MEMLOCK) for page-locked buffers")
        if pin_for_cuda is None:
            pin_for_cuda = torch.cuda.is_available()
        if pin_for_cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self._base, self.size * count, 0)
            self.cuda_pinned = int(rc) == 0
            if not self.cuda_pinned:
                log_once("cudaHostRegister", f"gdswriter: cudaHostRegister failed ({rc}); device copies will be synchronous")
        self.buffers = [
            StagingBuffer(i, self._base + i * self.size, self.size, whole[i * self.size:(i + 1) * self.size],
                          torch.frombuffer(whole[i * self.size:(i + 1) * self.size], dtype=torch.uint8))
            for i in range(count)
        ]
        whole.release()

    def regions(self) -> list[tuple[int, int]]:
        return [(b.address, b.size) for b in self.buffers]

    def close(self) -> None:
        if self._mm is None:
            return
        if self.cuda_pinned:
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

    def __enter__(self) -> "AlignedBufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
