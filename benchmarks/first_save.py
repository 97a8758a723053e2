"""The first save of a fresh GDSCheckpointer against its steady state and the disk's ceiling.

Each round, in an order rotated from round to round: the disk's durable O_DIRECT write ceiling
(fio when installed, else gdswriter's built-in loop, as ``gdswriter bench``), the first save
of a checkpointer constructed right before it, by ``save_async(...).result()`` and by
``save()`` (each in a process whose kept snapshot pool was released first: a process's first
save), and the steady save of a checkpointer that saved before. Prints GB/s (median, min-max)
and the medians of per-round ratios to the ceiling.

    .venv/bin/python benchmarks/first_save.py [--size 2G] [--rounds 3] [--dir D]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402

from gdswriter import GDSCheckpointer  # noqa: E402
from gdswriter.tools.measure import disk_reference  # noqa: E402
from gdswriter.units import human, parse_size  # noqa: E402

CASES = ("ceiling", "first save_async", "first save", "steady save")


def _release_kept_pool() -> None:
    """A process's first save: no pool an earlier checkpointer left (older versions keep none)."""
    try:
        from gdswriter.save.pool import release_kept_pool
    except ImportError:
        return
    release_kept_pool()


def first_save(state: dict, root: Path, blocking: bool) -> float:
    _release_kept_pool()
    _util.quiesce()
    try:
        with GDSCheckpointer(state, None, root) as ck:
            t = time.perf_counter()
            if blocking:
                ck.save(1)
            else:
                ck.save_async(1).result()
            return time.perf_counter() - t
    finally:
        _util.remove(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="2G", help="state size (default 2G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--no-fio", action="store_true", help="the built-in ceiling even if fio is installed")
    args = ap.parse_args()
    size = parse_size(args.size)
    n_tensors = 8
    state = {f"w{i}": torch.randint(0, 256, (size // n_tensors,), dtype=torch.uint8) for i in range(n_tensors)}
    nbytes = sum(t.numel() for t in state.values())
    pattern = memoryview(torch.randint(0, 256, (4 << 20,), dtype=torch.uint8).numpy())
    gbps: dict[str, list[float]] = {c: [] for c in CASES}
    cache: dict = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        work = Path(d)
        with GDSCheckpointer(state, None, work / "steady") as steady:
            steady.save_async(1).result()  # its pool and engines are there from now on
            step = 1
            for r in range(args.rounds):
                order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
                for case in order:
                    if case == "ceiling":
                        _util.quiesce()
                        ref, why = disk_reference(work / "ceiling.bin", nbytes, pattern, cache,
                                                  use_fio=not args.no_fio)
                        gbps[case].append(ref.write_bps / 1e9)
                        ceiling = f"{ref.name} ({why})"
                    elif case == "steady save":
                        step += 1
                        _util.quiesce()
                        t = time.perf_counter()
                        steady.save_async(step).result()
                        gbps[case].append(nbytes / (time.perf_counter() - t) / 1e9)
                        for s in steady.steps()[:-1]:
                            steady.protocol.delete_step(s)
                    else:
                        secs = first_save(state, work / f"first-{r}", blocking=case == "first save")
                        gbps[case].append(nbytes / secs / 1e9)
            engine = steady.engine_info.name
    print(f"first save vs steady save of {human(nbytes)} ({n_tensors} tensors, snapshot='host'), engine {engine}, "
          f"{args.rounds} interleaved round(s); ceiling: {ceiling}")
    print(f"  {'case':18s} {'GB/s median (min-max)':>24s} {'x ceiling':>10s}")
    for case in CASES:
        v = gbps[case]
        ratio = statistics.median(a / b for a, b in zip(v, gbps["ceiling"]))
        print(f"  {case:18s} {statistics.median(v):11.2f} ({min(v):.2f}-{max(v):.2f}) {ratio:9.2f}x")


if __name__ == "__main__":
    main()
