"""Low-level tests of the raw io_uring ring (gdswriter.engines.uring) on real files."""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import pytest
import torch

from gdswriter.engines.base import ReadSpan, WriteSpan
from gdswriter.engines import uring
from gdswriter.engines.buffers import AlignedBufferPool
from gdswriter.engines.staged import IoUringEngine
from gdswriter.options import KiB, MiB
from support.engines import host_tensor
from support.timeouts import deadline

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
        _src, addr = cbuf(payload)
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
        r.submit()  # submitted, not waited for
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


# ---------------------------------------------------------------------------
# Failures of io_uring_enter, on a real ring: the syscall is wrapped, the kernel is real.
# ---------------------------------------------------------------------------
@pytest.fixture
def fast_backoff(monkeypatch):
    """Keep the bounded retries of a stalled ring short in tests."""
    # Short ring backoff: module constants, not options (an option would widen EngineOptions for tests only).
    monkeypatch.setattr(uring, "BACKOFF_S", 1e-4)
    monkeypatch.setattr(uring, "BACKOFF_MAX_S", 1e-3)


class ScriptedEnter:
    """Replaces ring.enter_syscall: answers the first calls from ``script`` (an int is returned as the
    syscall's result without calling the kernel, None passes the call through), then passes
    every call through. Records (to_submit, min_complete, result) of every call."""

    def __init__(self, ring: uring.IoUring, script):
        self.real, self.script, self.calls = ring.enter_syscall, list(script), []
        ring.enter_syscall = self

    def __call__(self, to_submit, min_complete, flags):
        answer = self.script.pop(0) if self.script else None
        ret = self.real(to_submit, min_complete, flags) if answer is None else answer
        self.calls.append((to_submit, min_complete, ret))
        return ret


def write_requests(ring, fd, n: int, first: int = 0, size: int = 8192):
    """Queue writes number first..first+n-1 (user_data = number), each of its own bytes at its
    own offset; returns the buffers (keep them alive)."""
    bufs = [cbuf(bytes([i + 1]) * size) for i in range(first, first + n)]
    for i, (_, addr) in enumerate(bufs, first):
        ring.prep(uring.OP_WRITE, fd, addr, size, i * size, user_data=i)
    return bufs


def test_eagain_waits_for_completions_before_submitting_again(ring, tmp_path):
    """As liburing advises: under EAGAIN/EBUSY (the kernel cannot allocate requests, or its
    completion queue is full) with requests in the kernel, wait for one of them to complete
    (freeing kernel resources) before submitting again. A read from an empty pipe stays in the
    kernel until a thread feeds the pipe."""
    rpipe, wpipe = os.pipe()
    fd = os.open(tmp_path / "eagain.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        pipe_buf, pipe_addr = cbuf(bytes(5))
        ring.prep(uring.OP_READ, rpipe, pipe_addr, 5, 0, user_data=100)
        ring.submit()
        assert ring.queued == 0 and ring.in_flight == 1
        keep = write_requests(ring, fd, 3)
        scripted = ScriptedEnter(ring, [-errno.EAGAIN, -errno.EBUSY])
        feeder = threading.Timer(0.3, os.write, (wpipe, b"hello"))
        feeder.start()
        with deadline(20):
            got = wait_for(ring, 4)
        feeder.join()
        assert got == {100: 5, 0: 8192, 1: 8192, 2: 8192} and pipe_buf.raw == b"hello"
        (s0, _, r0), (s1, m1, r1), (s2, m2, r2) = scripted.calls[:3]
        assert (s0, r0) == (3, -errno.EAGAIN)
        assert (s1, r1) == (0, -errno.EBUSY) and m1 >= 1  # waits, submitting nothing
        assert (s2, r2) == (0, 0) and m2 >= 1  # the real wait: returns once the pipe read completed
        assert scripted.calls[3][0] == 3  # only then the writes go in
        assert os.pread(fd, 3 * 8192, 0) == b"".join(b.raw for b, _ in keep)
    finally:
        for f in (fd, rpipe, wpipe):
            os.close(f)


def test_eintr_storm_is_retried_without_error(ring, tmp_path):
    fd = os.open(tmp_path / "eintr.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        keep = write_requests(ring, fd, 5)
        scripted = ScriptedEnter(ring, [-errno.EINTR] * 200)
        with deadline(20):
            got = wait_for(ring, 5)
        assert got == {i: 8192 for i in range(5)} and len(scripted.calls) > 200
        assert os.pread(fd, 5 * 8192, 0) == b"".join(b.raw for b, _ in keep)
    finally:
        os.close(fd)


@pytest.mark.parametrize("answer", [0, -errno.EAGAIN, -errno.EBUSY])
@pytest.mark.parametrize("in_kernel", [False, True], ids=["idle-kernel", "request-in-kernel"])
def test_no_progress_is_retried_a_bounded_number_of_times_then_typed(ring, tmp_path, fast_backoff, answer,
                                                                      in_kernel):
    """io_uring_enter taking and completing nothing (0, or EAGAIN/EBUSY, also when the wait
    for a request still in the kernel fails the same way) never spins forever: bounded retries
    with backoff, then RingError. A read from an empty pipe stays in the kernel."""
    rpipe, wpipe = os.pipe()
    fd = os.open(tmp_path / "stall.bin", os.O_RDWR | os.O_CREAT, 0o644)
    _pipe_buf, pipe_addr = cbuf(bytes(5))
    try:
        if in_kernel:
            ring.prep(uring.OP_READ, rpipe, pipe_addr, 5, 0, user_data=100)
            ring.submit()
        keep = write_requests(ring, fd, 3)
        scripted = ScriptedEnter(ring, [answer] * 10_000)
        with deadline(20):
            with pytest.raises(uring.RingError) as ei:
                ring.wait(1)
            assert uring.STALL_RETRIES + 1 <= len(scripted.calls) <= uring.STALL_RETRIES + 2
            assert ei.value.errno == (errno.EAGAIN if answer == 0 else -answer) and "no progress" in str(ei.value)
            assert isinstance(ei.value, OSError)
            if not in_kernel:
                with pytest.raises(uring.RingError):
                    ring.submit()  # submit() alone is bounded too
            # The ring is intact: the SQEs are still queued, and a healthy kernel takes them.
            assert ring.queued == 3 and ring.in_flight == 3 + in_kernel
            scripted.script.clear()
            os.write(wpipe, b"hello")
            assert wait_for(ring, 3 + in_kernel) == {0: 8192, 1: 8192, 2: 8192, **({100: 5} if in_kernel else {})}
        del keep
    finally:
        for f in (fd, rpipe, wpipe):
            os.close(f)


def test_hard_enter_error_raises_ring_error(ring, tmp_path):
    keep = write_requests(ring, -1, 1)
    ScriptedEnter(ring, [-errno.EFAULT])
    with pytest.raises(uring.RingError) as ei:
        ring.wait(1)
    assert ei.value.errno == errno.EFAULT
    assert wait_for(ring, 1) == {0: -errno.EBADF}  # retried by the caller: the request was still queued
    del keep


def test_withdraw_takes_back_what_the_kernel_has_not_seen(ring, tmp_path):
    path = tmp_path / "withdraw.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        keep = write_requests(ring, fd, 2)
        ring.submit()
        keep += write_requests(ring, fd, 3, first=2)  # queued, never submitted
        assert (ring.queued, ring.in_flight) == (3, 5)
        assert ring.withdraw() == 3
        assert (ring.queued, ring.in_flight, ring.sq_space()) == (0, 2, ring.sq_entries)
        assert wait_for(ring, 2) == {0: 8192, 1: 8192}
        ring.submit()
        ring.wait(0)
        assert os.fstat(fd).st_size == 2 * 8192, "a withdrawn request reached the kernel"
        # The ring carries on where it stands.
        keep += write_requests(ring, fd, 1, first=9)
        assert wait_for(ring, 1) == {9: 8192}
    finally:
        os.close(fd)


@pytest.mark.parametrize("interrupt_after", [True, False])
def test_counts_survive_an_interruption_between_syscall_and_bookkeeping(ring, tmp_path, interrupt_after):
    """Ctrl-C right after io_uring_enter returned (its result lost) or right before it: the
    ring's counts come from the ring itself, so they stay right, and drain() ends everything."""
    fd = os.open(tmp_path / "intr.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        keep = write_requests(ring, fd, 6)
        real = ring.enter_syscall

        def interrupted(*args):
            if interrupt_after:
                real(*args)
            raise KeyboardInterrupt

        ring.enter_syscall = interrupted
        with pytest.raises(KeyboardInterrupt):
            ring.wait(6)
        ring.enter_syscall = real
        assert ring.queued == (6 if not interrupt_after else 0)
        assert ring.in_flight == 6
        with deadline(20):
            ring.drain()
        assert (ring.queued, ring.in_flight) == (0, 0)
        assert os.fstat(fd).st_size == (6 * 8192 if interrupt_after else 0)
        del keep
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# Memory ordering
# ---------------------------------------------------------------------------
def test_x86_64_uses_plain_accesses_and_others_a_real_barrier():
    import platform

    orderings = uring.available_orderings()
    if platform.machine() == "x86_64":
        assert uring.ORDERING.name == orderings["plain"].name and "TSO" in uring.ORDERING.name
    else:
        assert uring.ORDERING.name in (orderings.get("libatomic", orderings.get("membarrier")).name,)
    assert "membarrier" in orderings  # the fallback exists on every kernel with io_uring


@pytest.mark.parametrize("kind", sorted(uring.available_orderings()))
def test_ordering_helpers_load_and_store_the_right_values(kind):
    o = uring.available_orderings()[kind]
    cells = (ctypes.c_uint32 * 4)(11, 22, 33, 44)
    addr = ctypes.addressof(cells) + 4
    assert o.load_acquire(addr) == 22
    for v in (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789):
        o.store_release(addr, v)
        assert cells[1] == v and o.load_acquire(addr) == v
    assert (cells[0], cells[2], cells[3]) == (11, 33, 44)  # exactly 4 bytes touched


@pytest.mark.parametrize("kind", sorted(uring.available_orderings()))
def test_ring_works_under_load_with_every_ordering(kind, tmp_path):
    """Buffered I/O, so most completions are posted by io-wq workers on other CPUs after the
    syscall returned: the acquire/release path is what reads them. Many wraps of the rings."""
    r = uring.IoUring(8, ordering=uring.available_orderings()[kind])
    path = tmp_path / f"load-{kind}.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    n, size = 400, 4096
    payload = os.urandom(n * size)
    _src, addr = cbuf(payload)
    dst, daddr = cbuf(bytes(n * size))
    try:
        with deadline(60):
            for op, base in ((uring.OP_WRITE, addr), (uring.OP_READ, daddr)):
                done, nxt = {}, 0
                while len(done) < n:
                    while nxt < n and r.sq_space() > 0 and r.in_flight < r.sq_entries:
                        r.prep(op, fd, base + nxt * size, size, nxt * size, user_data=nxt)
                        nxt += 1
                    for ud, res in r.wait(1):
                        assert ud not in done
                        done[ud] = res
                assert done == {i: size for i in range(n)}
        assert dst.raw == payload
        assert r.in_flight == 0
    finally:
        os.close(fd)
        r.close()
