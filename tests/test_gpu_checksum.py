"""crc32c computed with torch ops where the tensor lives (gdswriter/cuda/checksum.py) must equal
the crc32c package's value: on CPU tensors here, on CUDA tensors on a GPU machine."""

from __future__ import annotations

import random

import crc32c
import pytest
import torch

from gdswriter.cuda import checksum
from gdswriter.cuda.checksum import ROW, SMALL_BYTES, crc32c_tensor, crc32c_tensors, zeros_crc32c
from gdswriter.errors import InvalidOptionError

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def ref(t: torch.Tensor) -> int:
    return crc32c.crc32c(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def rand(n: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


SIZES = [0, 1, 2, 3, 4, 5, 255, 4095, 4096, 4097, ROW - 1, ROW, ROW + 1, 2 * ROW, 16 * ROW + 1, 17 * ROW - 3,
         SMALL_BYTES - 1, SMALL_BYTES, SMALL_BYTES + 1, 3 * SMALL_BYTES + 12345]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_equals_crc32c_package(device, n):
    t = rand(n, device, seed=n)
    assert crc32c_tensor(t) == ref(t)


@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_at_once(device):
    """Small and large tensors mixed in one call: small ones share padded batches, large ones'
    heads join the batch and their rows are read in place."""
    g = torch.Generator().manual_seed(5)
    sizes = [int(x) for x in torch.randint(0, 20_000, (300,), generator=g)] + [0, 1, SMALL_BYTES + 7, 2 * ROW]
    ts = [rand(n, device, seed=i) for i, n in enumerate(sizes)]
    assert crc32c_tensors(ts) == [ref(t) for t in ts]


@pytest.mark.parametrize("device", DEVICES)
def test_several_blocks_and_distances_of_several_digits(device, monkeypatch):
    """Small blocks force one tensor's rows through several batches, and rows far from the
    end of their tensor (>= 16**2 rows) need three base-16 advance steps."""
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 7 * ROW)
    monkeypatch.setattr(checksum, "SMALL_BYTES", 3 * ROW)
    ts = [rand(300 * ROW + 11, device, 1), rand(5 * ROW, device, 2), rand(100, device, 3), rand(40 * ROW, device, 4)]
    assert crc32c_tensors(ts) == [ref(t) for t in ts]


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_views_and_other_dtypes(device):
    base = rand(3 * ROW + 999, device, seed=9)
    for start in (1, 3, 7, 63, 4097):
        for n in (1, 4095, 4097, ROW + 5):
            v = base[start:start + n]
            assert v.storage_offset() == start
            assert crc32c_tensor(v) == ref(v), (start, n)
    f = torch.randn(1000, 3, device=device)  # contiguous float32: its bytes
    assert crc32c_tensor(f) == ref(f)
    assert crc32c_tensor(f[1:]) == ref(f[1:])
    b = torch.ones(17, dtype=torch.bool, device=device)
    assert crc32c_tensor(b) == crc32c.crc32c(bytes([1] * 17))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_is_refused(device):
    t = rand(10_000, device)
    with pytest.raises(InvalidOptionError, match="contiguous"):
        crc32c_tensor(t[::2])
    with pytest.raises(InvalidOptionError, match="contiguous"):
        crc32c_tensor(t.view(100, 100).t())


@pytest.mark.parametrize("device", DEVICES)
def test_zeros(device):
    for n in (0, 1, ROW, 5 * ROW + 3):
        z = torch.zeros(n, dtype=torch.uint8, device=device)
        assert crc32c_tensor(z) == zeros_crc32c(n) == crc32c.crc32c(bytes(n))


@pytest.mark.parametrize("device", DEVICES)
def test_random_sizes(device):
    rnd = random.Random(2024)
    for trial in range(30):
        sizes = [rnd.choice([rnd.randint(0, 3 * ROW + 50), rnd.randint(0, 40)]) for _ in range(rnd.randint(1, 6))]
        ts = [rand(n, device, seed=trial * 10 + i) for i, n in enumerate(sizes)]
        assert crc32c_tensors(ts) == [ref(t) for t in ts], sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_result_needs_no_host_copy_of_the_data(monkeypatch):
    """Only the per-tensor results cross to the host: no tensor of the data's size is copied."""
    t = rand(8 << 20, "cuda", seed=3)
    copied = []
    real = torch.Tensor.cpu

    def spy(self, *a, **k):
        copied.append(self.numel() * self.element_size())
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", spy)
    got = crc32c_tensor(t)
    monkeypatch.setattr(torch.Tensor, "cpu", real)
    assert got == ref(t)
    assert copied and max(copied) <= 8 * 1, copied
