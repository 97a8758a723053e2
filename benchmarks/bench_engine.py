"""Sequential direct write and read through the engine vs a raw reference.

Goal (issue): gdswriter's engine durable write bandwidth >= 95% of the best raw
reference, read >= 90%.

Cases, per size (each round is one full durable write of ``size`` bytes, or one
cold read of a ``size``-byte file):

  write/read "fio io_uring"        fio --ioengine=io_uring --direct=1 --bs=4M --iodepth=16
                                   (--end_fsync=1 for write); GB/s is fio's own reported
                                   bandwidth (its JSON bw_bytes); "wall GB/s" is the whole
                                   fio process, start-up and file creation included.
  write/read "dd-loop"             Python, O_DIRECT, 8 MiB aligned buffer, synchronous
                                   pwrite loop + fdatasync / preadv loop (QD1), copying each
                                   block from/to the tensor.
  write/read "gdswriter posix"     PosixEngine.write_file (durable) / read_file
  write/read "gdswriter io_uring"  IoUringEngine.write_file (durable) / read_file

The best raw reference is the faster of fio and dd-loop. Engine knobs other than
the engine itself come from GDSWRITER_* variables (EngineOptions.from_env). The
engine computes crc32c of every byte; that is part of its cost.
"""

from __future__ import annotations

import gc
import os

import crc32c
import pytest
import torch

import _util
from _util import RESULTS, RoundTimer, finish, ratio

from gdswriter import EngineOptions, ReadSpan, WriteSpan
from gdswriter.errors import EngineUnavailableError
from gdswriter.engines.staged import IoUringEngine, PosixEngine

SUITE = "engine"
CASES = {  # param id -> display name; references first (see bench_sort_key)
    "fio": "fio io_uring",
    "dd": "dd-loop",
    "posix": "gdswriter posix",
    "io_uring": "gdswriter io_uring",
}
RAW = ("fio io_uring", "dd-loop")
ENGINE_CASE = "gdswriter io_uring"  # the engine whose bandwidth is "the engine's raw bandwidth"


def bench_sort_key(item):
    spec = item.callspec.params
    return (0 if item.originalname == "test_write" else 1, list(CASES).index(spec["case"]))


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def source(size):
    """Random bytes to write (one per size) and their crc32c."""
    _util.require_memory(int(2.2 * size.nbytes), f"engine benchmark {size} (source + read destination)")
    src = _util.random_tensor(size.nbytes, seed=1)
    yield src, crc32c.crc32c(src.numpy())
    del src
    gc.collect()  # free the size's bytes now, not at some later collection: the next size needs the RAM


@pytest.fixture(scope="module")
def read_target(workdir, source, size):
    """One file of ``size`` bytes that every read case reads (same extents for all), and a
    pre-faulted destination tensor."""
    src, _ = source
    path = workdir / "read.bin"
    buf = _util.AlignedBuffer()
    try:
        _util.dd_write(path, src, buf)
    finally:
        buf.close()
    dst = torch.zeros(size.nbytes, dtype=torch.uint8)
    yield path, dst
    del dst
    gc.collect()


@pytest.fixture(scope="module")
def engines():
    made: dict[str, object] = {}

    def get(case: str):
        if case not in made:
            kind = "io_uring" if case == "io_uring" else "posix"
            opts = EngineOptions.from_env(engine=kind)
            try:
                made[case] = IoUringEngine(opts) if kind == "io_uring" else PosixEngine(opts)
            except EngineUnavailableError as e:
                pytest.skip(f"io_uring engine unavailable here: {e}")
        return made[case]

    yield get
    for e in made.values():
        e.close()


def _fio_or_skip():
    if not _util.fio_path():
        pytest.skip("fio is not installed: the dd-style O_DIRECT loop is the only raw reference")


def _poison(dst: torch.Tensor) -> None:
    """Spoil one byte of every 4 KiB page so that a read that skips any block is caught."""
    dst[::4096].bitwise_not_()


class _Transfer:
    """One case's full write of ``data`` to ``path`` or read of ``path`` into ``data``."""

    def __init__(self, kind: str, case: str, path, data: torch.Tensor, engines):
        self.reported: list[float] = []  # fio's own bandwidth per round
        self.crcs: list[int] = []  # the engine's crc32c of the last round
        self.engine = None
        self._buf = None
        # The closures capture locals, never self: a self-referencing cycle would keep the
        # size's tensors alive until some later garbage collection.
        reported, crcs = self.reported, self.crcs
        if case == "fio":
            _fio_or_skip()
            self.run = lambda: reported.append(_util.fio_run(kind, path, data.numel()))
        elif case == "dd":
            buf = self._buf = _util.AlignedBuffer()
            loop = _util.dd_write if kind == "write" else _util.dd_read
            self.run = lambda: loop(path, data, buf)
        else:
            self.engine = engines(case)
            call = self.engine.write_file if kind == "write" else self.engine.read_file
            spans = [(WriteSpan if kind == "write" else ReadSpan)(0, data)]

            def run():
                crcs[:] = call(path, spans)

            self.run = run

    def measure(self, benchmark, setup, rounds: int) -> RoundTimer:
        timer = RoundTimer(self.run)
        try:
            benchmark.pedantic(timer, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
        except _util.FioError as e:
            pytest.skip(f"fio cannot run the io_uring reference here: {e}")
        return timer

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()


# ----------------------------------------------------------------------------- write
@pytest.mark.parametrize("case", list(CASES))
def test_write(benchmark, size, case, workdir, source, engines, rounds):
    name = CASES[case]
    src, src_crc = source
    path = workdir / f"write-{case}.bin"
    benchmark.group = f"engine write {size}"

    def setup():
        _util.remove(path)
        _util.quiesce()

    transfer = _Transfer("write", case, path, src, engines)
    try:
        timer = transfer.measure(benchmark, setup, rounds)
        assert os.path.getsize(path) == size.nbytes
        if transfer.engine is not None:
            assert transfer.crcs == [src_crc], "engine crc32c differs from the source's"
            info = transfer.engine.info
            benchmark.extra_info["engine"] = info.name
            benchmark.extra_info["direct_io"] = info.direct_io
            benchmark.extra_info["registered_buffers"] = info.registered_buffers
        gbps = finish(benchmark, timer, suite=SUITE, kind="write", size=size, case=name, nbytes=size.nbytes,
                      reported_bps=transfer.reported or None)
        _ratios(benchmark, "write", size, name, gbps)
    finally:
        transfer.close()
        _util.remove(path)


# ----------------------------------------------------------------------------- read
@pytest.mark.parametrize("case", list(CASES))
def test_read(benchmark, size, case, workdir, source, read_target, engines, rounds):
    name = CASES[case]
    src, src_crc = source
    path, dst = read_target
    benchmark.group = f"engine read {size}"

    def setup():
        _util.evict(path)
        if case != "fio":
            _poison(dst)

    transfer = _Transfer("read", case, path, dst, engines)
    try:
        timer = transfer.measure(benchmark, setup, rounds)
        if case != "fio":
            assert torch.equal(dst, src), f"{name} read back different bytes"
        if transfer.engine is not None:
            assert transfer.crcs == [src_crc], "engine crc32c differs from the source's"
        gbps = finish(benchmark, timer, suite=SUITE, kind="read", size=size, case=name, nbytes=size.nbytes,
                      reported_bps=transfer.reported or None)
        _ratios(benchmark, "read", size, name, gbps)
    finally:
        transfer.close()


def _ratios(benchmark, kind, size, name, gbps) -> None:
    raws = [RESULTS.get((SUITE, kind, size.label, r)) for r in RAW]
    raws = [r for r in raws if r]
    if raws and name not in RAW:
        ratio(benchmark, "x best raw", gbps, max(raws))
        goal = 0.95 if kind == "write" else 0.90
        benchmark.extra_info["goal x best raw"] = goal
