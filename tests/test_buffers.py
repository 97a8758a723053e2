"""The staging buffer pool: alignment, page locking, and the unlocked fallback."""

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from gdswriter.engines.buffers import CUDA_HOST_REGISTER_PORTABLE, AlignedBufferPool
from support.engines import is_locked, locked_ranges


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 3 << 20])
def test_buffers_are_page_aligned_disjoint_and_usable(size):
    with AlignedBufferPool(size, 3) as pool:
        assert pool.size % 4096 == 0 and pool.size >= size
        addrs = [b.address for b in pool.buffers]
        assert all(a % 4096 == 0 for a in addrs)
        assert sorted(addrs) == [addrs[0] + i * pool.size for i in range(3)]
        for i, b in enumerate(pool.buffers):
            assert b.tensor.data_ptr() == b.address and b.tensor.numel() == pool.size
            b.tensor.fill_(i + 1)
        assert [b.view[pool.size - 1] for b in pool.buffers] == [1, 2, 3]
        assert pool.locked  # root here has CAP_IPC_LOCK; see the next test for the refused case
    assert pool.buffers == []


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_bytes(lo: int, hi: int) -> int:
    """AnonHugePages of this process's mappings that overlap [lo, hi), from /proc/self/smaps."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                overlaps = start < hi and end > lo
            elif overlaps and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("huge", [True, False])
def test_pool_huge_pages_on_a_2mib_boundary_and_backed_as_asked(huge):
    """With huge_pages the pool starts on a 2 MiB boundary and the kernel backs it with huge
    pages (where THP is not off); without, in THP's default "madvise" mode, it gets none."""
    with AlignedBufferPool(16 << 20, 4, huge_pages=huge) as pool:
        assert pool.huge_pages == huge
        base = pool.buffers[0].address
        if huge:
            assert base % (2 << 20) == 0
        for b in pool.buffers:
            b.tensor.fill_(7)  # fault every page in (mlock already did, when it was allowed)
        backed = _anon_huge_bytes(base, base + 4 * pool.size)
        mode = _thp_mode()
        if huge and mode in ("always", "madvise"):
            assert backed >= 2 << 20, f"THP is {mode!r} but no huge page backs the pool"
        if not huge and mode == "madvise":
            assert backed == 0
        assert all(b.view[pool.size - 1] == 7 for b in pool.buffers)


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("prlimit")),
                    reason="needs root plus setpriv/prlimit to take CAP_IPC_LOCK away from a child")
def test_refused_mlock_falls_back_to_unlocked_memory_and_says_so_once(tmp_path):
    """A child without CAP_IPC_LOCK and with a 64 KiB RLIMIT_MEMLOCK: the pool works on
    unlocked memory, io_uring runs without registered buffers, one warning each, data intact;
    a checkpointer's save through its snapshot ring (locked ahead) too."""
    child = textwrap.dedent(f"""
        import logging, torch
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from gdswriter import EngineOptions, ReadSpan, WriteSpan, create_engine
        opts = EngineOptions(buffer_bytes=1 << 20, request_bytes=256 << 10, num_buffers=2)
        src = torch.randint(0, 256, (3_000_001,), dtype=torch.uint8)
        for _ in range(2):
            with create_engine(opts) as eng:
                eng.write_file({str(tmp_path / 'f')!r}, [WriteSpan(0, src)])
                out = torch.empty_like(src)
                eng.read_file({str(tmp_path / 'f')!r}, [ReadSpan(0, out)])
                assert torch.equal(out, src)
                info = eng.info  # the staging pool's, once a transfer built it
        print("INFO", info.name, info.page_locked, info.registered_buffers)
        from gdswriter import GDSCheckpointer  # the host snapshot pool's ring, locked ahead: refused too
        state = {{"w": src.clone()}}
        with GDSCheckpointer(state, None, {str(tmp_path / 'ck')!r}) as ck:
            ck.save(1)
            state["w"].zero_()
            ck.load(1)
        assert torch.equal(state["w"], src)
        print("SAVED")
    """)
    cmd = ["prlimit", "--memlock=65536:65536", "setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock",
           sys.executable, "-c", child]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "INFO io_uring False False" in r.stdout and "SAVED" in r.stdout
    assert r.stderr.count("mlock of") == 1, r.stderr
    assert r.stderr.count("buffer registration refused") == 1, r.stderr


# ---------------------------------------------------------------------------
# CUDA registration: lazy, with the tensor's device current, portable
# ---------------------------------------------------------------------------
_NO_CUDA_CHILD = textwrap.dedent(r"""
    import sys, torch
    calls = []

    class FakeCudart:  # what torch.cuda.cudart() gives on a GPU machine, recording every call
        def __getattr__(self, name):
            return lambda *args: calls.append(name) or 0

    real_lazy_init = torch.cuda._lazy_init

    def lazy_init():
        calls.append("torch.cuda._lazy_init")
        return real_lazy_init()

    # A GPU machine, as far as code that asks is concerned.
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 8
    torch.cuda.cudart = lambda: calls.append("cudart") or FakeCudart()
    torch.cuda._lazy_init = lazy_init

    from gdswriter import EngineOptions, GDSCheckpointer, ReadSpan, WriteSpan, create_engine
    from gdswriter.options import CheckpointOptions

    root = sys.argv[1]
    opts = EngineOptions(buffer_bytes=1 << 20, request_bytes=256 << 10, num_buffers=2)
    for kind in ("io_uring", "posix"):
        with create_engine(EngineOptions(**{**opts.__dict__, "engine": kind})) as eng:
            src = torch.randint(0, 256, (3_000_001,), dtype=torch.uint8)
            eng.write_file(f"{root}/{kind}.bin", [WriteSpan(0, src)])
            out = torch.empty_like(src)
            eng.read_file(f"{root}/{kind}.bin", [ReadSpan(0, out)])
            assert torch.equal(out, src)
    model = torch.nn.Linear(300, 300)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    opt.step()
    with GDSCheckpointer(model, opt, root=f"{root}/ck", options=CheckpointOptions(engine=opts)) as ck:
        ck.save(1)
        ck.load(1)
    print("CUDA CALLS", calls, torch.cuda.is_initialized())
""")


def test_cpu_only_save_and_load_never_touch_cuda(tmp_path):
    """On a machine with GPUs (torch.cuda.is_available() forced True, cudart faked), a job
    whose state is all on the CPU never calls the CUDA runtime and never initialises CUDA:
    no context on GPU 0 for every rank, no pinned-memory registration."""
    r = subprocess.run([sys.executable, "-c", _NO_CUDA_CHILD, str(tmp_path)], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CUDA CALLS [] False" in r.stdout, r.stdout


class _FakeCuda:
    """torch.cuda.cudart() and torch.cuda.device(), recording what the pool asks for."""

    def __init__(self, monkeypatch, rc: int = 0):
        self.current, self.calls, self.rc = None, [], rc
        fake = self

        class Cudart:
            def cudaHostRegister(self, ptr, size, flags):
                fake.calls.append(("register", ptr, size, flags, fake.current))
                return fake.rc

            def cudaHostUnregister(self, ptr):
                fake.calls.append(("unregister", ptr, fake.current))
                return 0

        @contextlib.contextmanager
        def device(d):
            before, fake.current = fake.current, d
            try:
                yield
            finally:
                fake.current = before

        monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
        monkeypatch.setattr(torch.cuda, "device", device)


def test_pool_registers_once_portable_with_the_tensors_device_current(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    gpu3 = torch.device("cuda", 3)
    with AlignedBufferPool(64 << 10, 3) as pool:
        assert not pool.cuda_pinned and fake.calls == []  # nothing at creation
        base, size = pool.buffers[0].address, pool.size * 3
        assert pool.pin_for_cuda(gpu3) is True and pool.cuda_pinned
        assert pool.pin_for_cuda(torch.device("cuda", 0)) is True  # once: portable to every device
        assert fake.calls == [("register", base, size, CUDA_HOST_REGISTER_PORTABLE, gpu3)]
        assert CUDA_HOST_REGISTER_PORTABLE == 1  # cudaHostRegisterPortable
    assert fake.calls[1:] == [("unregister", base, gpu3)]  # unregistered where it was registered


def test_pool_registration_refused_is_said_once_and_not_retried(monkeypatch, caplog, io_fresh_log_once):
    fake = _FakeCuda(monkeypatch, rc=2)
    with caplog.at_level(logging.WARNING, logger="gdswriter"), AlignedBufferPool(64 << 10, 2) as pool:
        assert pool.pin_for_cuda(torch.device("cuda", 1)) is False
        assert pool.pin_for_cuda(torch.device("cuda", 1)) is False
    assert [c[0] for c in fake.calls] == ["register"]  # never unregistered: it was not registered
    assert caplog.text.count("cudaHostRegister failed") == 1


class _FakeCudaTensor:
    """Enough of a CUDA tensor for the engine's memory check (no GPU here)."""

    is_cpu, is_meta, is_cuda = False, False, True

    def __init__(self, index: int):
        self.device = torch.device("cuda", index)


def test_engine_pins_its_staging_buffers_at_the_first_cuda_tensor_only(monkeypatch, io_small_options):
    from gdswriter.engines.staged import PosixEngine

    fake = _FakeCuda(monkeypatch)
    with PosixEngine(io_small_options()) as eng:
        eng.prepare_memory([torch.zeros(10, dtype=torch.uint8)] * 3)
        assert fake.calls == [] and eng._pool is None  # host tensors alone build no staging pool
        eng.prepare_memory([torch.zeros(10, dtype=torch.uint8), _FakeCudaTensor(5), _FakeCudaTensor(2)])
        eng.prepare_memory([_FakeCudaTensor(0)])
        assert [(c[0], c[3], c[4]) for c in fake.calls] == [("register", 1, torch.device("cuda", 5))]


def test_meta_tensors_are_refused_with_a_typed_error(tmp_path, io_small_options):
    from gdswriter.engines.base import ReadSpan, WriteSpan
    from gdswriter.errors import InvalidOptionError
    from gdswriter.engines.staged import IoUringEngine

    meta = torch.empty(5000, dtype=torch.uint8, device="meta")
    with IoUringEngine(io_small_options()) as eng:
        with pytest.raises(InvalidOptionError, match="meta device"):
            eng.write_file(tmp_path / "m.bin", [WriteSpan(0, meta)])
        assert not (tmp_path / "m.bin").exists()
        eng.write_file(tmp_path / "m.bin", [WriteSpan(0, torch.ones(5000, dtype=torch.uint8))])
        with pytest.raises(InvalidOptionError, match="meta device"):
            eng.read_file(tmp_path / "m.bin", [ReadSpan(0, meta)])


def _locked_bytes() -> int:
    """This process's page-locked memory (VmLck), what a staging pool's mlock adds to."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmLck:"))


@pytest.mark.parametrize("kind", ["io_uring", "posix"])
def test_reads_lock_only_the_staging_they_use_and_keep_it(tmp_path, kind):
    """A read that goes zero-copy builds no staging pool (locks nothing); a read that stages a
    few KiB locks a pool sized to them (8 x 64 KiB, not 8 x 16 MiB), kept for the next read;
    writes size it the same way: a zero-copy one or one staging a few KiB reuses it, one that
    stages 4 MiB grows it to 8 x 512 KiB, and the file is bit-exact."""
    from gdswriter import EngineOptions, ReadSpan, WriteSpan, create_engine
    from support.engines import host_tensor, kernel_takes_direct_io_from

    opts = EngineOptions(engine=kind)
    data = host_tensor(4 << 20, "aligned", fill=7)
    path = tmp_path / "f.bin"
    with create_engine(opts) as eng:
        eng.write_file(path, [WriteSpan(0, data)])
        if not eng.info.page_locked or not eng.info.direct_io:
            pytest.skip("needs page-locked staging and O_DIRECT here")
    full = opts.num_buffers * (512 << 10)  # 4 MiB staged: 8 x 512 KiB
    before = _locked_bytes()
    with create_engine(opts) as eng:
        out = host_tensor(4 << 20, "aligned", fill=0)
        eng.read_file(path, [ReadSpan(0, out)])
        assert torch.equal(out, data)
        if kernel_takes_direct_io_from(out, tmp_path):
            assert _locked_bytes() == before, "a zero-copy read locked staging memory"
        small = torch.zeros(3000, dtype=torch.uint8)
        eng.read_file(path, [ReadSpan(0, small)])
        grown = _locked_bytes() - before
        assert 0 < grown <= 1 << 20, f"3000 staged bytes locked {grown} bytes"
        eng.read_file(path, [ReadSpan(8192, small)])
        assert _locked_bytes() - before == grown and torch.equal(small, data[8192:11192])
        eng.write_file(tmp_path / "g.bin", [WriteSpan(0, data)])
        if kernel_takes_direct_io_from(data, tmp_path):
            assert _locked_bytes() - before == grown, "a zero-copy write grew the staging pool"
        eng.write_file(tmp_path / "h.bin", [WriteSpan(0, data[:-1])])  # the last partial block is staged
        assert _locked_bytes() - before == grown, "a write staging under 4 KiB grew the pool"
        eng.write_file(tmp_path / "i.bin", [WriteSpan(0, data[1:])])  # misaligned: all of it staged
        assert _locked_bytes() - before == full, "a write staging 4 MiB locks 8 x 512 KiB"
        assert (tmp_path / "i.bin").read_bytes() == data[1:].numpy().tobytes()
    assert _locked_bytes() == before


# ---------------------------------------------------------------------------
# Locking ahead: the pool usable at once, locked front to back on a thread of its own
# ---------------------------------------------------------------------------
class _SlowLock:
    """The pool's ``mlock`` seam: each step after the first held until ``go`` is set or ``delay``
    s passed (the real mlock then), or only the locker thread's steps (``locker_only``);
    recording (address, length, thread name) per step; ``refuse_at``: the first step that
    fails (it and every later one)."""

    def __init__(self, monkeypatch, *, delay: float = 10.0, refuse_at: int | None = None, err: int = 12,
                 locker_only: bool = False):
        import gdswriter.engines.buffers as buffers

        self.calls: list[tuple[int, int, str]] = []
        self.go, self.delay = threading.Event(), delay
        real = buffers.mlock

        def slow(address: int, n: int) -> int:
            me = threading.current_thread().name
            self.calls.append((address, n, me))
            if refuse_at is not None and len(self.calls) - 1 >= refuse_at:
                return err
            if len(self.calls) > 1 and (me == "gdswriter-mlock" or not locker_only):  # the first step at once
                self.go.wait(self.delay)
            return real(address, n)

        monkeypatch.setattr(buffers, "mlock", slow)

    def steps(self) -> list[tuple[int, int]]:
        return sorted((a, n) for a, n, _ in self.calls)


def test_a_pool_locked_ahead_returns_at_once_and_locks_front_to_back(monkeypatch):
    """lock_ahead: the pool is returned before its locking ends; wait_locked(end) returns once
    [0, end) is page-locked (checked in the kernel's own view, /proc/self/smaps), the rest
    following in LOCK_AHEAD_STEP steps in address order; in the end the pool is locked whole."""
    import gdswriter.engines.buffers as buffers

    monkeypatch.setattr(buffers, "LOCK_AHEAD_STEP", 2 << 20)
    slow = _SlowLock(monkeypatch)
    with AlignedBufferPool(8 << 20, 1, lock_ahead=True) as pool:
        base = pool.buffers[0].address
        assert not pool.locked  # its locker is held at the second step
        assert pool.wait_locked(2 << 20) and is_locked(base, base + (2 << 20))
        assert not is_locked(base, base + (4 << 20))  # nothing past the steps taken
        slow.go.set()
        assert pool.wait_locked(8 << 20)
        pool.finish_locking()
        assert pool.locked and is_locked(base, base + (8 << 20))
        assert slow.steps() == [(base + i * (2 << 20), 2 << 20) for i in range(4)]
        pool.buffers[0].tensor.fill_(3)
        assert pool.buffers[0].view[(8 << 20) - 1] == 3
    assert not is_locked(base, base + (8 << 20))  # close unlocked (and unmapped) it


def test_a_waiter_locks_the_steps_its_range_needs_that_the_locker_has_not_reached(monkeypatch):
    """On a loaded machine the locker thread may not run when the pool's user needs a range:
    wait_locked then takes the steps nobody claimed yet itself (here the locker is stuck in
    its second step: the caller locks the third and fourth, then waits for the second only)."""
    import gdswriter.engines.buffers as buffers

    monkeypatch.setattr(buffers, "LOCK_AHEAD_STEP", 2 << 20)
    slow = _SlowLock(monkeypatch, locker_only=True)
    with AlignedBufferPool(8 << 20, 1, lock_ahead=True) as pool:
        base = pool.buffers[0].address
        assert pool.wait_locked(2 << 20)
        timer = threading.Timer(1.0, slow.go.set)  # the stuck step ends a second from now
        timer.start()
        try:
            assert pool.wait_locked(8 << 20)
        finally:
            timer.cancel()
            slow.go.set()
        mine = sorted(a - base for a, _, who in slow.calls if who == threading.current_thread().name)
        assert mine == [4 << 20, 6 << 20]
        pool.finish_locking()
        assert pool.locked and slow.steps() == [(base + i * (2 << 20), 2 << 20) for i in range(4)]
        assert is_locked(base, base + (8 << 20))


def test_closing_a_pool_while_it_is_locked_ahead_stops_its_locker(monkeypatch):
    import gdswriter.engines.buffers as buffers

    monkeypatch.setattr(buffers, "LOCK_AHEAD_STEP", 2 << 20)
    slow = _SlowLock(monkeypatch, delay=0.05)
    pool = AlignedBufferPool(64 << 20, 1, lock_ahead=True)
    base = pool.buffers[0].address
    assert pool.wait_locked(2 << 20)
    pool.close()  # waits for the step under way only
    assert len(slow.calls) < 32 and not pool.locked and pool.closed
    assert not any(start < base + (64 << 20) and end > base for start, end in locked_ranges())


def test_a_refused_lock_ahead_leaves_the_pool_unlocked_says_so_once_and_lets_waiters_go(
        monkeypatch, caplog, io_fresh_log_once):
    """RLIMIT_MEMLOCK reached midway: what was locked is unlocked, wait_locked returns False
    (at once, for any range: nobody waits for a lock that will not come), and the pool works
    unlocked, as a pool locked at creation does when refused."""
    import gdswriter.engines.buffers as buffers

    monkeypatch.setattr(buffers, "LOCK_AHEAD_STEP", 2 << 20)
    slow = _SlowLock(monkeypatch, delay=0.0, refuse_at=2)
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        with AlignedBufferPool(8 << 20, 1, lock_ahead=True) as pool:
            base = pool.buffers[0].address
            assert pool.wait_locked(8 << 20) is False
            pool.finish_locking()
            assert not pool.locked and not is_locked(base, base + (2 << 20))
            assert len(slow.calls) == 3
            pool.buffers[0].tensor.fill_(5)
            assert pool.buffers[0].view[(8 << 20) - 1] == 5
        with AlignedBufferPool(4 << 20, 1, lock_ahead=True) as again:
            assert again.wait_locked(4 << 20) is False
    assert caplog.text.count("mlock of") == 1


def test_a_pool_locked_ahead_is_registered_with_cuda_once_its_locking_is_done(monkeypatch):
    """cudaHostRegister pins every page itself: it comes after the locker, never beside it."""
    import gdswriter.engines.buffers as buffers

    monkeypatch.setattr(buffers, "LOCK_AHEAD_STEP", 2 << 20)
    slow = _SlowLock(monkeypatch, delay=0.05)
    fake = _FakeCuda(monkeypatch)
    with AlignedBufferPool(8 << 20, 1, lock_ahead=True) as pool:
        assert pool.pin_for_cuda(torch.device("cuda", 1))
        assert pool.locked and len(slow.calls) == 4 and [c[0] for c in fake.calls] == ["register"]


def test_a_forked_child_does_not_wait_for_its_parents_locker(monkeypatch):
    """A child forked while a pool is locked ahead has no locker thread (and no locks: mlock is
    not inherited): its wait_locked returns at once instead of waiting forever."""
    import gdswriter.engines.buffers as buffers

    monkeypatch.setattr(buffers, "LOCK_AHEAD_STEP", 2 << 20)
    slow = _SlowLock(monkeypatch, delay=60)
    with AlignedBufferPool(8 << 20, 1, lock_ahead=True) as pool:
        assert pool.wait_locked(2 << 20)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 once wait_locked returned
            os._exit(0 if pool.wait_locked(8 << 20) is False else 1)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if done == (0, 0):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        slow.go.set()
        assert done != (0, 0), "the forked child waited for its parent's locker"
        assert os.waitstatus_to_exitcode(done[1]) == 0


def test_a_pool_locked_at_creation_answers_wait_locked_at_once():
    with AlignedBufferPool(1 << 20, 2) as pool:
        assert pool.locked and pool.wait_locked(2 << 20)
    with AlignedBufferPool(1 << 20, 1, lock_memory=False, lock_ahead=True) as pool:
        assert not pool.locked and pool.wait_locked(1 << 20) is False
