"""What O_DIRECT asks of one open file, as the kernel reports it (statx STATX_DIOALIGN, Linux 6.1+).

The host-memory alignment is the block device's DMA alignment: 512 bytes on this
project's virtio disk, 4 bytes on NVMe. Where it is below 4 KiB, tensors that are
not page-aligned (torch puts large CPU tensors 64 bytes into a page) can still
move straight between memory and file, without the staging copy.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256  # struct statx
_MASK_AT, _MEM_ALIGN_AT, _OFFSET_ALIGN_AT = 0, 152, 156  # byte offsets of stx_mask, stx_dio_mem_align, stx_dio_offset_align

_libc = ctypes.CDLL(None, use_errno=True)
_statx = getattr(_libc, "statx", None)  # glibc 2.28+
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]


@dataclass(frozen=True)
class DirectIOAlignment:
    """O_DIRECT needs host addresses that are multiples of ``memory`` and file offsets and
    lengths that are multiples of ``offset``."""

    memory: int
    offset: int


def direct_io_alignment(fd: int) -> DirectIOAlignment | None:
    """What O_DIRECT needs on open file ``fd``; None when the kernel or file system does not say."""
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return None  # ENOSYS (old kernel or seccomp) or the like: fall back to the safe default
    raw = buf.raw
    mask = int.from_bytes(raw[_MASK_AT:_MASK_AT + 4], sys.byteorder)
    memory = int.from_bytes(raw[_MEM_ALIGN_AT:_MEM_ALIGN_AT + 4], sys.byteorder)
    offset = int.from_bytes(raw[_OFFSET_ALIGN_AT:_OFFSET_ALIGN_AT + 4], sys.byteorder)
    if not mask & _STATX_DIOALIGN or not memory or not offset:
        return None  # not reported, or 0 = "direct I/O unsupported here" (the open says so anyway)
    return DirectIOAlignment(memory, offset)
