"""Does the placement of the staging buffers in memory change read bandwidth? (diagnostic)

Creates three io_uring engines with the same options, whose page-locked staging pools
differ only in when they were allocated:

  A  right after the process freed ``--ballast`` bytes (the pool reuses those pages),
  B  while ``--ballast`` bytes are held,
  C  ``--wait`` seconds after that.

It then reads one file cold with each engine in turn, round after round, and prints the
bandwidth and the block device's mean time per read request (from /sys/dev/block/*/stat).
The requests are the same for every engine, so on bare metal the three rows agree. On this
project's VM (Firecracker, nested KVM, virtio-balloon free page reporting) A took twice as
long per request as C: see README "Benchmarks". A training job builds its model (and frees
its gradients) just before it creates its checkpointer, which is case A.

    .venv/bin/python benchmarks/staging_placement.py [--size 1G] [--rounds 4] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util  # noqa: E402

from gdswriter import ReadSpan, WriteSpan, create_engine  # noqa: E402
from gdswriter.cli import parse_size  # noqa: E402


def device_stat(path: Path) -> Path | None:
    """The sysfs stat file of the block device that holds ``path`` (None if there is none)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def read_counters(stat: Path | None) -> tuple[int, int]:
    """(completed reads, milliseconds spent on reads) of the device, or zeros."""
    if stat is None:
        return 0, 0
    fields = stat.read_text().split()
    return int(fields[0]), int(fields[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="file size (default 1G)")
    ap.add_argument("--ballast", default="2G", help="bytes allocated before the pools (default 2G)")
    ap.add_argument("--wait", type=float, default=3.0, help="seconds between pools B and C (default 3)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=str(HERE))
    a = ap.parse_args()
    n, ballast_bytes = parse_size(a.size), parse_size(a.ballast)
    need, avail = 2 * n + ballast_bytes + 512 * _util.MiB, _util.mem_available()
    if avail is not None and avail < need:
        raise SystemExit(f"needs about {_util.human(need)} of RAM, {_util.human(avail)} available: "
                         f"use a smaller --size or --ballast")

    touched = torch.empty(ballast_bytes, dtype=torch.uint8)
    touched.fill_(1)
    del touched
    engines = {"A (after a free)": create_engine()}
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8)
    ballast.fill_(1)
    engines["B (ballast held)"] = create_engine()
    time.sleep(a.wait)
    engines[f"C ({a.wait:g} s later)"] = create_engine()

    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    # Unaligned destination (like a live parameter), so every byte goes through staging.
    dst = torch.zeros(n + 4096, dtype=torch.uint8)[64:64 + n]
    work = Path(tempfile.mkdtemp(prefix=".placement-", dir=a.dir))
    path = work / "data.bin"
    speed: dict[str, list[float]] = {k: [] for k in engines}
    ms_per_request: dict[str, list[float]] = {k: [] for k in engines}
    try:
        next(iter(engines.values())).write_file(path, [WriteSpan(0, src)])
        stat = device_stat(path)
        for r in range(a.rounds):
            order = list(engines.items())
            for name, engine in order if r % 2 == 0 else order[::-1]:
                _util.settle(1.0)
                _util.evict(path)
                reads0, ms0 = read_counters(stat)
                t = time.perf_counter()
                engine.read_file(path, [ReadSpan(0, dst)])
                seconds = time.perf_counter() - t
                reads1, ms1 = read_counters(stat)
                speed[name].append(n / seconds / 1e9)
                ms_per_request[name].append((ms1 - ms0) / max(1, reads1 - reads0))
            if not torch.equal(dst, src):
                raise SystemExit("read-back differs from what was written")
        print(f"cold reads of {_util.human(n)}, {a.rounds} rounds, alternating order (medians)")
        for name in engines:
            lat = f"{statistics.median(ms_per_request[name]):6.1f} ms/request" if stat else "n/a"
            print(f"  {name:20s} {statistics.median(speed[name]):5.2f} GB/s   {lat}   "
                  f"rounds: {' '.join(f'{x:.2f}' for x in speed[name])}")
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
        del ballast


if __name__ == "__main__":
    main()
