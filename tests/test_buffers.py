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
