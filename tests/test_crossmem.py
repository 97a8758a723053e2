"""crossmem.pull: copying from a process's memory with process_vm_readv, in this process (the
multi-rank loads that use it are in test_dist_scale.py)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import pytest

from gdswriter.distributed import crossmem
from gdswriter.distributed.crossmem import CrossMemoryError

pytestmark = pytest.mark.skipif(crossmem.domain() is None, reason="no process_vm_readv here")


def _filled(n: int, seed: int) -> ctypes.Array:
    return ctypes.create_string_buffer(bytes((i * 7 + seed) % 251 for i in range(n)), n)


def test_pull_copies_every_move_and_probe_reads_the_marker():
    src = [_filled(50_000, s) for s in range(3)]
    dst = [ctypes.create_string_buffer(50_000) for _ in range(3)]
    moves = [(ctypes.addressof(a) + 10, ctypes.addressof(b) + 10, 40_000) for a, b in zip(src, dst)]
    assert crossmem.pull(os.getpid(), moves) == 120_000
    assert all(b.raw[10:40_010] == a.raw[10:40_010] and b.raw[:10] == bytes(10) for a, b in zip(src, dst))
    crossmem.probe(*crossmem.marker())
    with pytest.raises(CrossMemoryError):  # not a marker there
        crossmem.probe(os.getpid(), ctypes.addressof(src[0]))


def test_short_copies_are_asked_for_again_from_where_they_stopped(monkeypatch):
    """The kernel may copy fewer bytes than asked (a fault part way, its per-call cap): the
    rest is asked for again; a call that copies nothing raises."""
    plain = crossmem.process_vm_readv
    calls = []

    def short(pid, local, nlocal, remote, nremote, flags):  # at most 3,000 bytes a call, across iovecs
        budget, got = 3000, 0
        for i in range(nremote):
            n = min(remote[i].iov_len, budget - got)
            if n <= 0:
                break
            ctypes.memmove(local[i].iov_base, remote[i].iov_base, n)
            got += n
        calls.append(got)
        return got

    monkeypatch.setattr(crossmem, "process_vm_readv", short)
    src = [_filled(5000, s) for s in range(4)]
    dst = [ctypes.create_string_buffer(5000) for _ in range(4)]
    moves = [(ctypes.addressof(a), ctypes.addressof(b), 5000 - 700 * k) for k, (a, b) in enumerate(zip(src, dst))]
    assert crossmem.pull(os.getpid(), moves) == sum(n for *_, n in moves)
    assert len(calls) > 1
    assert all(b.raw[:n] == a.raw[:n] for (a, b), (*_, n) in zip(zip(src, dst), moves))
    monkeypatch.setattr(crossmem, "process_vm_readv", lambda *args: 0)
    with pytest.raises(CrossMemoryError, match="no byte copied"):
        crossmem.pull(os.getpid(), moves)
    monkeypatch.setattr(crossmem, "process_vm_readv", plain)


def test_a_copy_running_into_unmapped_memory_raises_after_the_bytes_before_it():
    """A real partial copy: the remote range ends in a page that is not mapped; the kernel
    copies up to it and the next call fails: CrossMemoryError, never a silent short copy."""
    # Mapped and unmapped with libc alone: a Python mmap object would unmap both pages when freed,
    # the second one by then perhaps another mapping's (an io_uring ring's: a later test crashes)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = libc.mmap(None, 2 * mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        ctypes.memmove(base, b"x" * mmap.PAGESIZE, mmap.PAGESIZE)
        assert libc.munmap(base + mmap.PAGESIZE, mmap.PAGESIZE) == 0  # the second page goes
        dst = ctypes.create_string_buffer(2 * mmap.PAGESIZE)
        with pytest.raises(CrossMemoryError) as e:
            crossmem.pull(os.getpid(), [(base, ctypes.addressof(dst), 2 * mmap.PAGESIZE)])
        assert e.value.errno == errno.EFAULT
        assert dst.raw[:mmap.PAGESIZE] == b"x" * mmap.PAGESIZE  # the mapped page was copied first
    finally:
        libc.munmap(base, mmap.PAGESIZE)  # the first page: the second is gone already
