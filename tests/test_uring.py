"""Low-level tests of the raw io_uring ring (gdswriter.fallback.uring) on real files."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

from gdswriter.engine import ReadSpan, WriteSpan
from gdswriter.fallback import uring
from gdswriter.fallback.buffers import AlignedBufferPool
from gdswriter.fallback.engine import IoUringEngine
from gdswriter.options import KiB, MiB
from test_engine_contract import host_tensor

_why = uring.probe()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"io_uring unavailable: {_why}")


@pytest.fixture
def ring():
    r = uring.IoUring(8)
    yield r
    r.close()


def cbuf(data: bytes):
    """A C buffer holding ``data`` and its address (kept alive by the returned object)."""
    b = ctypes.create_string_buffer(data, len(data))
    return b, ctypes.addressof(b)


def wait_for(ring: uring.IoUring, n: int) -> dict[int, int]:
    """Collect exactly ``n`` completions as {user_data: res}."""
    got: dict[int, int] = {}
    while len(got) < n:
        for ud, res in ring.wait(1):
            assert ud not in got
            got[ud] = res
    assert ring.in_flight == 0
    return got


def test_probe_and_entries():
    assert uring.probe() is None
    for bad in (0, 3, 6, 100):
        with pytest.raises(ValueError):
            uring.IoUring(bad)
    r = uring.IoUring(4)
    try:
        assert r.sq_entries == 4 and r.cq_entries >= 4 and r.sq_space() == 4 and r.in_flight == 0
    finally:
        r.close()


def test_write_then_read(ring, tmp_path):
    path = tmp_path / "plain.bin"
    payload = os.urandom(10_000)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        src, addr = cbuf(payload)
        ring.prep(uring.OP_WRITE, fd, addr, len(payload), 100, user_data=42)
        assert ring.in_flight == 1
        assert ring.wait(1) == [(42, len(payload))]
        assert ring.in_flight == 0
        assert os.pread(fd, len(payload) + 100, 0) == bytes(100) + payload

        dst, daddr = cbuf(bytes(len(payload)))
        ring.prep(uring.OP_READ, fd, daddr, len(payload), 100, user_data=7)
        assert ring.wait(1) == [(7, len(payload))]
        assert dst.raw == payload

        # Reading past the end: a short count, then 0 at EOF.
        ring.prep(uring.OP_READ, fd, daddr, 4096, len(payload) + 100 - 10, user_data=8)
        ring.prep(uring.OP_READ, fd, daddr, 4096, len(payload) + 100, user_data=9)
        assert wait_for(ring, 2) == {8: 10, 9: 0}
        assert dst.raw[:10] == payload[-10:]
    finally:
        os.close(fd)


def test_batch_fills_ring_then_refuses(ring, tmp_path):
    path = tmp_path / "batch.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    chunks = [os.urandom(1000 + i) for i in range(ring.sq_entries)]
    keep = []
    try:
        for i, c in enumerate(chunks):
            b, a = cbuf(c)
            keep.append(b)
            ring.prep(uring.OP_WRITE, fd, a, len(c), i * 4096, user_data=1000 + i)
        assert ring.sq_space() == 0 and ring.in_flight == ring.sq_entries
        b, a = cbuf(b"x")
        with pytest.raises(RuntimeError, match="submission queue full"):
            ring.prep(uring.OP_WRITE, fd, a, 1, 0, user_data=1)
        got = wait_for(ring, len(chunks))
        assert got == {1000 + i: len(c) for i, c in enumerate(chunks)}
        assert ring.sq_space() == ring.sq_entries
        for i, c in enumerate(chunks):
            assert os.pread(fd, len(c), i * 4096) == c
    finally:
        os.close(fd)


def test_bad_fd_completes_with_ebadf(ring, tmp_path):
    b, a = cbuf(b"hello")
    ring.prep(uring.OP_WRITE, -1, a, 5, 0, user_data=1)
    path = tmp_path / "ro.bin"
    path.write_bytes(b"data")
    rfd = os.open(path, os.O_RDONLY)
    try:
        ring.prep(uring.OP_WRITE, rfd, a, 5, 0, user_data=2)  # write to a read-only fd
        got = wait_for(ring, 2)
    finally:
        os.close(rfd)
    assert got == {1: -errno.EBADF, 2: -errno.EBADF}
    assert path.read_bytes() == b"data"


def test_direct_io_rejects_misaligned(ring, tmp_path):
    fd = os.open(tmp_path / "d.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    with AlignedBufferPool(8192, 1, lock_memory=False) as pool:
        buf = pool.buffers[0]
        try:
            ring.prep(uring.OP_WRITE, fd, buf.address, 100, 0, user_data=1)  # length not aligned
            ring.prep(uring.OP_WRITE, fd, buf.address + 1, 4096, 0, user_data=2)  # address not aligned
            ring.prep(uring.OP_WRITE, fd, buf.address, 4096, 4096, user_data=3)  # fine
            got = wait_for(ring, 3)
        finally:
            os.close(fd)
    assert got == {1: -errno.EINVAL, 2: -errno.EINVAL, 3: 4096}


def test_registered_buffers_fixed_ops(ring, tmp_path):
    fd = os.open(tmp_path / "fixed.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    with AlignedBufferPool(64 * KiB, 2) as pool:
        try:
            ring.register_buffers(pool.regions())
            assert ring.registered_buffers == 2
            src, dst = pool.buffers
            payload = torch.randint(0, 256, (src.size,), dtype=torch.uint8)
            src.tensor.copy_(payload)
            dst.tensor.zero_()
            ring.prep(uring.OP_WRITE_FIXED, fd, src.address, src.size, 8192, user_data=1, buf_index=src.index)
            assert wait_for(ring, 1) == {1: src.size}
            ring.prep(uring.OP_READ_FIXED, fd, dst.address + 4096, 16 * KiB, 8192 + 4096, user_data=2,
                      buf_index=dst.index)
            assert wait_for(ring, 1) == {2: 16 * KiB}
            assert torch.equal(dst.tensor[4096:4096 + 16 * KiB], payload[4096:4096 + 16 * KiB])
            with open(tmp_path / "fixed.bin", "rb") as f:
                assert f.read() == bytes(8192) + payload.numpy().tobytes()
            # A range outside the registered buffer it names is refused by the kernel.
            ring.prep(uring.OP_WRITE_FIXED, fd, dst.address, 4096, 0, user_data=3, buf_index=src.index)
            res = wait_for(ring, 1)[3]
            assert res == -errno.EFAULT
        finally:
            os.close(fd)
            ring.close()  # unregisters with the ring before the pool unmaps


def test_fixed_op_without_registration_fails(ring, tmp_path):
    fd = os.open(tmp_path / "nofixed.bin", os.O_RDWR | os.O_CREAT, 0o644)
    b, a = cbuf(b"z" * 4096)
    try:
        ring.prep(uring.OP_WRITE_FIXED, fd, a, 4096, 0, user_data=1, buf_index=0)
        res = wait_for(ring, 1)[1]
    finally:
        os.close(fd)
    assert res < 0 and -res in (errno.EFAULT, errno.EINVAL)


def test_close_drains_in_flight_and_is_idempotent(tmp_path):
    r = uring.IoUring(4)
    fd = os.open(tmp_path / "c.bin", os.O_RDWR | os.O_CREAT, 0o644)
    b, a = cbuf(os.urandom(50_000))
    try:
        for i in range(4):
            r.prep(uring.OP_WRITE, fd, a, 50_000, i * 50_000, user_data=i)
        r.enter(0)  # submitted, not waited for
        r.close()
        assert r.in_flight == 0 and r.fd == -1
        r.close()
        assert os.fstat(fd).st_size == 200_000
    finally:
        os.close(fd)


@pytest.mark.parametrize("depth,entries", [(1, 1), (2, 2), (3, 4), (16, 16)])
def test_engine_keeps_more_requests_than_ring_entries_in_its_backlog(tmp_path, monkeypatch, io_small_options,
                                                                      depth, entries):
    """Many more requests than ring slots: the engine queues them and never overfills the ring."""
    with IoUringEngine(io_small_options(queue_depth=depth)) as eng:
        ring = eng._backend.ring
        assert ring.sq_entries == entries and eng._backend.capacity == depth
        seen = []
        real_prep = ring.prep

        def prep(*args, **kw):
            real_prep(*args, **kw)
            seen.append(ring.in_flight)

        monkeypatch.setattr(ring, "prep", prep)
        # 33 requests of 64 KiB, in memory 64 bytes into a page (as torch places large tensors),
        # so every byte is staged: a page-aligned tensor would go zero-copy, past the staging bound.
        data = host_tensor(2 * MiB + 5, "aligned+64", gen=torch.Generator().manual_seed(0))
        path = tmp_path / "deep.bin"
        eng.write_file(path, [WriteSpan(0, data)])
        out = host_tensor(data.numel(), "aligned+64", fill=0)
        eng.read_file(path, [ReadSpan(0, out)])
        assert torch.equal(out, data)
        assert len(seen) >= 2 * 33
        # Full pipeline, never beyond queue_depth (nor beyond what the staging buffers hold).
        o = eng.options
        assert max(seen) == min(depth, o.num_buffers * o.requests_per_buffer)
        assert ring.in_flight == 0
