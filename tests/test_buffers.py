"""The staging buffer pool: alignment, page locking, and the unlocked fallback."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from gdswriter.fallback.buffers import AlignedBufferPool


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
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
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
    unlocked memory, io_uring runs without registered buffers, one warning each, data intact."""
    child = textwrap.dedent(f"""
        import logging, torch
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from gdswriter import EngineOptions, ReadSpan, WriteSpan, create_engine
        opts = EngineOptions(buffer_bytes=1 << 20, request_bytes=256 << 10, num_buffers=2)
        src = torch.randint(0, 256, (3_000_001,), dtype=torch.uint8)
        for _ in range(2):
            with create_engine(opts) as eng:
                info = eng.info
                eng.write_file({str(tmp_path / 'f')!r}, [WriteSpan(0, src)])
                out = torch.empty_like(src)
                eng.read_file({str(tmp_path / 'f')!r}, [ReadSpan(0, out)])
                assert torch.equal(out, src)
        print("INFO", info.name, info.page_locked, info.registered_buffers)
    """)
    cmd = ["prlimit", "--memlock=65536:65536", "setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock",
           sys.executable, "-c", child]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "INFO io_uring False False" in r.stdout
    assert r.stderr.count("mlock of") == 1, r.stderr
    assert r.stderr.count("buffer registration refused") == 1, r.stderr
