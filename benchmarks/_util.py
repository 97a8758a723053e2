"""Shared helpers of the benchmark suites: sizes, disk/memory checks, raw references (fio, a
dd-style O_DIRECT loop) and result bookkeeping. Cache eviction, file removal and the state the
checkpoint suites store come from gdswriter (measure.py, bench.py), shared with `gdswriter bench`.

Bandwidth is reported in decimal GB/s (1 GB = 1e9 bytes) everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gdswriter import units
from gdswriter.tools.bench import quiesce, remove, settle  # noqa: F401  (for the suites)
from gdswriter.errors import GDSWriterError
from gdswriter.tools.measure import FioError, mem_available  # noqa: F401  (FioError: for the suites)
from gdswriter.tools.measure import evict_paths as evict  # noqa: F401  (cold reads: files or whole trees)
from gdswriter.tools.measure import fio_bandwidth as fio_run  # noqa: F401  (bytes/s of one fio job)
from gdswriter.units import human  # noqa: F401

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALIGN = 4096
DD_BLOCK = 8 * MiB  # the dd-style loop's buffer / request size
BENCH_DIR_DEFAULT = Path(__file__).resolve().parent / ".bench-tmp"


# ----------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class BenchSize:
    label: str   # as the user wrote it, e.g. "2G"
    nbytes: int  # rounded up to a multiple of 4 KiB

    def __str__(self) -> str:
        return self.label


def parse_size(text: str) -> int:
    """'64M' -> 67108864, as the CLI reads sizes, rounded up to a multiple of 4 KiB."""
    try:
        n = units.parse_size(text)
    except GDSWriterError as e:
        raise ValueError(str(e)) from e
    return -(-n // ALIGN) * ALIGN


def bench_sizes() -> list[BenchSize]:
    raw = os.environ.get("GDSWRITER_BENCH_SIZES", "2G,8G")
    out = [BenchSize(t.strip(), parse_size(t)) for t in raw.split(",") if t.strip()]
    if not out:
        raise ValueError(f"GDSWRITER_BENCH_SIZES={raw!r} names no size")
    return out


def _env_number(name: str, default: str, kind, minimum, what: str):
    """GDSWRITER_BENCH_* knob ``name`` parsed with ``kind`` (int/float), at least ``minimum``."""
    raw = os.environ.get(name, default)
    try:
        v = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None
    if v < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum}")
    return v


def bench_rounds() -> int:
    return _env_number("GDSWRITER_BENCH_ROUNDS", "3", int, 1, "an integer")


def bench_settle() -> float:
    """Seconds to wait, after a sync, before each cold read (GDSWRITER_BENCH_SETTLE_S, default 5).
    A virtual disk may still be flushing the write that just finished on the host side; a read
    started at once pays for it, and the fastest writer pays the most."""
    return _env_number("GDSWRITER_BENCH_SETTLE_S", "5", float, 0, "a number")


def bench_base_dir() -> Path:
    raw = os.environ.get("GDSWRITER_BENCH_DIR")
    return Path(raw).expanduser().resolve() if raw else BENCH_DIR_DEFAULT


# ----------------------------------------------------------------------------- environment checks
def fs_type(path: Path) -> str:
    """File-system type of the mount holding ``path`` (from /proc/mounts; '' if unknown)."""
    path = Path(os.path.realpath(path))
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def require_space(path: Path, need: int, what: str) -> None:
    import pytest

    free = free_bytes(path)
    if free < need:
        pytest.skip(f"{what}: needs {human(need)} free on {path}, only {human(free)} available "
                    f"(set GDSWRITER_BENCH_DIR to a bigger disk or use smaller GDSWRITER_BENCH_SIZES)")


@contextlib.contextmanager
def size_workdir(bench_root: Path, size: BenchSize, suite: str):
    """``bench_root/<suite>-<size>``, made after checking there is disk for two files of
    ``size`` (the one being read back and the next being written); removed afterwards."""
    require_space(bench_root, 2 * size.nbytes + 256 * MiB, f"{suite} benchmark {size}")
    d = bench_root / f"{suite}-{size.label}"
    d.mkdir()
    try:
        yield d
    finally:
        remove(d)


def direct_memory_alignment(directory: Path) -> int:
    """The host-memory alignment below which gdswriter's engine (GDSWRITER_* settings) stages
    data on a file in ``directory``; 0 when it uses buffered I/O there. Asked of the engine
    itself, through one tiny write."""
    from gdswriter import EngineOptions, WriteSpan, create_engine

    path = Path(directory) / f".align-probe-{os.getpid()}"
    options = EngineOptions.from_env(request_bytes=64 * KiB, buffer_bytes=64 * KiB, num_buffers=2)
    try:
        with create_engine(options) as engine:
            engine.write_file(path, [WriteSpan(0, torch.zeros(1, dtype=torch.uint8))], durable=False)
            return engine.info.direct_memory_alignment
    finally:
        path.unlink(missing_ok=True)


def torch_cpu_placement(directory: Path) -> str:
    """Where torch's CPU allocator puts a large tensor, and whether gdswriter can therefore move
    live CPU state without the staging copy on ``directory`` (THP_MEM_ALLOC_ENABLE=1 makes torch
    page-align large tensors; NVMe takes torch's default placement as it is)."""
    probe = torch.empty(4 * MiB, dtype=torch.uint8)
    where = probe.data_ptr() % ALIGN
    placed = ("page-aligned (THP_MEM_ALLOC_ENABLE=1)" if where == 0
              else f"{where} B into a page (default allocator)")
    need = direct_memory_alignment(directory)
    if not need:
        return f"torch CPU tensors {placed}; the engine uses buffered I/O on {directory}: everything is staged"
    if probe.data_ptr() % need == 0:
        return f"torch CPU tensors {placed}; O_DIRECT needs {need} B here: live state moves zero-copy"
    return (f"torch CPU tensors {placed}; O_DIRECT needs {need} B here: live state is staged "
            f"(THP_MEM_ALLOC_ENABLE=1 aligns it)")


def require_memory(need: int, what: str) -> None:
    import pytest

    avail = mem_available()
    if avail is not None and avail < need:
        pytest.skip(f"{what}: needs about {human(need)} of RAM, only {human(avail)} available "
                    f"(use smaller GDSWRITER_BENCH_SIZES)")


# ----------------------------------------------------------------------------- data and caches
def random_tensor(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A flat uint8 CPU tensor of random bytes (incompressible), filled in place in chunks."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    a = t.numpy()
    n64 = nbytes // 8
    words = a[: n64 * 8].view(np.uint64)
    gen = np.random.PCG64(seed)
    step = 8 * MiB
    for i in range(0, n64, step):
        words[i:i + step] = gen.random_raw(min(step, n64 - i))
    if nbytes % 8:
        a[n64 * 8:] = np.frombuffer(np.random.default_rng(seed).bytes(nbytes % 8), dtype=np.uint8)
    return t


# ----------------------------------------------------------------------------- dd-style loop
class AlignedBuffer:
    """An 8 MiB page-aligned anonymous mapping seen as memoryview and uint8 tensor."""

    def __init__(self, size: int = DD_BLOCK):
        self.size = size
        self.mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.mm)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.tensor.zero_()  # fault the pages in outside any timed region

    def close(self) -> None:
        del self.tensor
        self.view.release()
        self.mm.close()


def open_direct(path: str | os.PathLike, flags: int) -> int:
    import pytest

    try:
        return os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip(f"the file system under {os.path.dirname(os.fspath(path))} refuses O_DIRECT "
                        f"({fs_type(Path(os.fspath(path)).parent) or 'unknown type'}); set GDSWRITER_BENCH_DIR "
                        f"to a directory on a real disk")
        raise


def dd_write(path: str | os.PathLike, src: torch.Tensor, buf: AlignedBuffer) -> None:
    """O_DIRECT, one synchronous pwrite of 8 MiB at a time (QD1), then ftruncate + fdatasync.
    Like `dd if=src of=path bs=8M oflag=direct conv=fdatasync`: each block is copied from the
    source tensor into the aligned buffer first (the engine copies into its staging buffers too)."""
    n = src.numel()
    fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        bs = buf.size
        for off in range(0, n, bs):
            k = min(bs, n - off)
            buf.tensor[:k].copy_(src[off:off + k])
            kk = -(-k // ALIGN) * ALIGN
            if kk > k:
                buf.tensor[k:kk].zero_()
            done = 0
            while done < kk:
                w = os.pwrite(fd, buf.view[done:kk], off + done)
                if w <= 0:
                    raise OSError(errno.EIO, f"pwrite wrote {w} bytes at {off + done}")
                done += w
        os.ftruncate(fd, n)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def dd_read(path: str | os.PathLike, dst: torch.Tensor, buf: AlignedBuffer) -> None:
    """O_DIRECT, one synchronous preadv of 8 MiB at a time (QD1), copied out into ``dst``."""
    n = dst.numel()
    fd = open_direct(path, os.O_RDONLY)
    try:
        bs = buf.size
        for off in range(0, n, bs):
            k = min(bs, n - off)
            kk = -(-k // ALIGN) * ALIGN
            got = 0
            while got < k:
                r = os.preadv(fd, [buf.view[got:kk]], off + got)
                if r <= 0:
                    raise OSError(errno.EIO, f"short read at {off + got} of {path}")
                got += r
            dst[off:off + k].copy_(buf.tensor[:k])
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- fio
def fio_path() -> str | None:
    return shutil.which("fio")


# ----------------------------------------------------------------------------- results
# (suite, kind, size label, case) -> GB/s, for ratios between cases of the same session.
RESULTS: dict[tuple[str, str, str, str], float] = {}


class RoundTimer:
    """Wraps the timed function to keep our own per-round wall times (also when
    pytest-benchmark is run with --benchmark-disable)."""

    def __init__(self, fn):
        self.fn, self.times = fn, []

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.times.append(time.perf_counter() - t)


def finish(benchmark, timer: RoundTimer, *, suite: str, kind: str, size: BenchSize, case: str, nbytes: int,
           reported_bps: list[float] | None = None, note: str = "") -> float:
    """Record GB/s (from the median round) in extra_info and in RESULTS; returns GB/s."""
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    median = float(stats.median) if stats is not None and getattr(stats, "rounds", 0) else statistics.median(timer.times)
    wall = nbytes / median / 1e9
    gbps = statistics.median(reported_bps) / 1e9 if reported_bps else wall
    info = benchmark.extra_info
    info.update({"suite": suite, "kind": kind, "case": case, "size": size.label, "bytes": nbytes,
                 "GB/s": round(gbps, 4), "wall GB/s": round(wall, 4), "median s": round(median, 4)})
    if reported_bps:
        info["bw source"] = "fio-reported (median of rounds); 'wall GB/s' includes fio start-up"
    if note:
        info["note"] = note
    RESULTS[(suite, kind, size.label, case)] = gbps
    return gbps


def ratio(benchmark, name: str, value: float, ref: float | None) -> None:
    if ref:
        benchmark.extra_info[name] = round(value / ref, 3)


class TreeWorker:
    """``script --worker`` in a process of its own with PYTHONPATH=``tree`` (gdswriter from that
    checkout), for the scripts that compare checkouts in interleaved rounds (tensor_counts.py,
    cold_loads.py, live_loads.py): one request line in, one ``RESULT <json>`` line back."""

    def __init__(self, script: str, tree: str | os.PathLike) -> None:
        self.tree = Path(tree).resolve()
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        self.proc = subprocess.Popen([sys.executable, script, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, request: str) -> dict:
        """Send one request line; the worker's RESULT, parsed."""
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"the worker measuring {self.tree} ended (exit {self.proc.wait()}): see its stderr above "
                           f"(is it a gdswriter checkout?)")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
