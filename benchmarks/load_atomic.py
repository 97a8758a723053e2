"""What a load that verifies every byte before touching the live model costs (diagnostic).

``GDSCheckpointer.load`` reads the live tensors through fresh buffers, verifies every crc32c,
then copies into the live tensors (``atomic=True``: a damaged step leaves the model as it
was), for states up to ``load.policy.ATOMIC_LOAD_MAX_BYTES``; above, it reads straight into the
live tensors (``atomic=False``, zero-copy, a mid-load checksum failure can leave them partly
overwritten). This script times both on the same step, cold (page cache evicted, device
settled before each round), alternating the two, and prints the medians.

    .venv/bin/python benchmarks/load_atomic.py [--size 256M] [--rounds 5] [--dir D] [--settle 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402

from gdswriter import GDSCheckpointer  # noqa: E402
from gdswriter.units import human, parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256M", help="state size (default 256M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait after sync before each read")
    args = ap.parse_args()
    size = parse_size(args.size)
    n_tensors = 8
    state = {f"w{i}": torch.randn(size // n_tensors // 4) for i in range(n_tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d) / "ck"
        times: dict[bool, list[float]] = {True: [], False: []}
        with GDSCheckpointer(state, None, root) as ck:
            ck.save(1)
            for _ in range(args.rounds):
                for atomic in (True, False):
                    _util.settle(args.settle)
                    _util.evict(root)
                    t0 = time.perf_counter()
                    ck.load(1, atomic=atomic)
                    times[atomic].append(time.perf_counter() - t0)
                    assert ck.last_load.atomic == atomic
            engine = ck.engine_info.name
    print(f"load of {human(nbytes)} in {n_tensors} tensors, engine {engine}, {args.rounds} cold rounds each:")
    for atomic, label in ((False, "in place (atomic=False)"), (True, "verified first (atomic=True)")):
        med = statistics.median(times[atomic])
        print(f"  {label:30s} median {med * 1e3:7.1f} ms  {nbytes / med / 1e9:5.2f} GB/s  "
              f"(min {min(times[atomic]) * 1e3:.1f} ms)")
    cost = statistics.median(times[True]) / statistics.median(times[False]) - 1
    print(f"  atomic costs {cost * 100:+.0f}% (one memory copy of the state, and as much transient memory)")


if __name__ == "__main__":
    os.environ.setdefault("GDSWRITER_BENCH_SETTLE_S", "0")
    main()
