"""How much a concurrent durable write slows computation on this machine, whoever writes.

The floor under any overlapped checkpoint: while the bytes go to disk, training runs on.
Here a background thread writes a page-aligned buffer to a file over and over with plain
O_DIRECT pwrites (16 MiB each) and an fsync per pass (no gdswriter code), while the main
thread runs fixed blocks of work: matrix products (compute-bound) and an in-place multiply
over a large tensor (memory-bound). Blocks with and without the writer alternate in
interleaved rounds (the order flips each round), so a machine whose speed drifts affects
both alike. Reported: median block times each way, the slowdown, the main thread's own
CPU time per block (growing when the same work runs slower, not when it waits), the
writer thread's CPU share and the write rate.

On a bare-metal NVMe machine the write is DMA and the slowdown should be about nil. On a
virtual machine whose disk is emulated by the host, the emulation competes with the guest's
CPUs and memory, so a write costs the computation even though the writing thread is idle.

    python benchmarks/write_interference.py --dir /nvme/scratch
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdswriter.units import parse_size

REQUEST = 16 << 20


class Writer(threading.Thread):
    """Writes ``size`` bytes to ``path`` with O_DIRECT, fsync, and again, until stopped."""

    def __init__(self, path: Path, size: int):
        super().__init__(daemon=True)
        self.path, self.size = path, size
        self.stop = threading.Event()
        self.cpu_s = self.wall_s = 0.0
        self.written = 0
        self.direct = True  # False: the file system refused O_DIRECT; buffered writes + fsync
        self.error: BaseException | None = None

    def run(self) -> None:
        buf = mmap.mmap(-1, min(REQUEST, self.size))  # page-aligned, as O_DIRECT needs
        buf.write(b"\x5a" * len(buf))
        flags = os.O_WRONLY | os.O_CREAT
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            while not self.stop.is_set():
                try:
                    fd = os.open(self.path, flags | (getattr(os, "O_DIRECT", 0) if self.direct else 0), 0o644)
                except OSError as e:
                    if not (self.direct and e.errno == errno.EINVAL):
                        raise
                    self.direct = False  # tmpfs and the like
                    continue
                try:
                    for off in range(0, self.size, len(buf)):
                        n = os.pwrite(fd, buf, off)
                        if n != len(buf):
                            raise OSError(f"short write: {n} of {len(buf)} bytes at {off}")
                        self.written += n
                        if self.stop.is_set():
                            break
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e
        finally:
            self.cpu_s, self.wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
            buf.close()


def work_block(a: torch.Tensor, b: torch.Tensor, big: torch.Tensor, matmuls: int) -> tuple[float, float, float]:
    """(compute ms, memory ms, main-thread CPU ms) of one block of fixed work."""
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(matmuls):
        torch.mm(a, b)
    t1 = time.perf_counter()
    for _ in range(4):
        big.mul_(1.0000001)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.thread_time() - cpu0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512M", help="bytes per write pass (default 512M)")
    ap.add_argument("--memory", default="256M", help="tensor of the memory-bound work (default 256M)")
    ap.add_argument("--dim", type=int, default=1024, help="matrix size of the compute-bound work")
    ap.add_argument("--matmuls", type=int, default=20, help="matrix products per block")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per case and round")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the main thread's work")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = parse_size(args.size)
    a, b = torch.randn(args.dim, args.dim), torch.randn(args.dim, args.dim)
    big = torch.randn(max(parse_size(args.memory) // 4, 1))
    scratch = Path(tempfile.mkdtemp(prefix="write-interference-", dir=args.dir))
    times: dict[str, list[tuple[float, float, float]]] = {"idle": [], "writing": []}
    writers: list[Writer] = []
    try:
        work_block(a, b, big, args.matmuls)  # warm-up
        for r in range(args.rounds):
            for case in ("idle", "writing") if r % 2 == 0 else ("writing", "idle"):
                writer = None
                if case == "writing":
                    writer = Writer(scratch / "data.bin", size)
                    writer.start()
                    time.sleep(0.05)  # the writer is under way before the work starts
                try:
                    times[case] += [work_block(a, b, big, args.matmuls) for _ in range(args.blocks)]
                finally:
                    if writer is not None:
                        writer.stop.set()
                        writer.join()
                        writers.append(writer)
                if writer is not None and writer.error is not None:
                    raise writer.error
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {c: [statistics.median(x[k] for x in v) for k in range(3)] for c, v in times.items()}
    cpu_share = sum(w.cpu_s for w in writers) / max(sum(w.wall_s for w in writers), 1e-9)
    rate = sum(w.written for w in writers) / max(sum(w.wall_s for w in writers), 1e-9) / 1e9
    how = "O_DIRECT" if all(w.direct for w in writers) else "buffered (the file system refuses O_DIRECT)"
    print(f"{args.rounds} rounds x {args.blocks} blocks per case; writer: {how} {REQUEST >> 20} MiB pwrites "
          f"+ fsync per {args.size} pass, {rate:.2f} GB/s, {100 * cpu_share:.1f}% of a CPU")
    print("| work | idle ms (median) | while writing ms (median) | slowdown |")
    print("|---|---:|---:|---:|")
    for k, name in enumerate(("compute-bound (matmul)", "memory-bound (in-place multiply)", "main-thread CPU time")):
        idle, busy = med["idle"][k], med["writing"][k]
        print(f"| {name} | {idle:.1f} | {busy:.1f} | {100 * (busy / idle - 1):+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
