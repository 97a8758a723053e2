"""Checkpoint save/load vs torch.save, DCP (4 threads) and safetensors, interleaved round by round.

The same state and methods as bench_checkpoint.py and ``gdswriter bench`` (all three use
gdswriter/tools/bench.py), but each round runs every method's durable save and then its cold load
before the next method, in an order rotated from round to round, so every ratio compares runs
minutes apart at most, not a whole suite apart.

Each round also measures the device itself with the same number of bytes: a durable write and
a cold read by fio (io_uring, O_DIRECT, 4 MiB, QD 16) when it is installed, else by
gdswriter's built-in multi-queue O_DIRECT loop. Every method is bounded by those figures, so
they say how much room any writer has left.

Before each cold load the script syncs and waits ``--settle`` seconds. On a virtual disk
the host may still be flushing the save that just finished; without the pause, the method
that saved fastest pays for it in its load.

    .venv/bin/python benchmarks/interleaved_checkpoint.py [--size 2G] [--rounds 3] [--settle 5] [--dir D]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util  # noqa: E402

from gdswriter.tools.bench import CEILING, BenchOptions, run_bench  # noqa: E402
from gdswriter.units import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=_util.bench_settle(),
                    help="seconds to wait (after sync) before each cold load; 0 disables "
                         "(default: GDSWRITER_BENCH_SETTLE_S or 5)")
    ap.add_argument("--dir", default=str(HERE))
    a = ap.parse_args()
    if a.settle < 0:
        raise SystemExit("--settle must be >= 0")
    result = run_bench(BenchOptions(directory=Path(a.dir), size=parse_size(a.size), rounds=a.rounds,
                                    compare=("torch", "dcp", "safetensors"), settle=a.settle))
    for line in result.header():
        print(line)
    print(f"  {_util.torch_cpu_placement(Path(a.dir))}")
    print()
    for line in result.table():
        print(line)
    print("  per round, save | load GB/s:")
    for m in result.methods:
        print(f"    {result.label(m, 'save'):22s} {' '.join(f'{x:.2f}' for x in result.save[m])} | "
              f"{result.label(m, 'load'):22s} {' '.join(f'{x:.2f}' for x in result.load[m])}")

    def x(method: str, kind: str, ref: str) -> str:
        r = result.ratio(method, kind, ref)
        return f"{r:.2f}x" if r is not None else "-"

    g = "gdswriter"
    print(f"  gdswriter.save vs torch.save {x(g, 'save', 'torch')}, vs dcp.save t4 {x(g, 'save', 'dcp')}; "
          f"gdswriter.load vs torch.load {x(g, 'load', 'torch')}, vs dcp.load {x(g, 'load', 'dcp')}, "
          f"vs safetensors.load_file {x(g, 'load', 'safetensors')} (medians of per-round ratios)")
    print(f"  vs the device ({result.ceiling}): gdswriter.save {x(g, 'save', CEILING)}, dcp.save t4 "
          f"{x('dcp', 'save', CEILING)}, gdswriter.load {x(g, 'load', CEILING)}, safetensors.load_file "
          f"{x('safetensors', 'load', CEILING)}")


if __name__ == "__main__":
    main()
