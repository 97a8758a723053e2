"""`gdswriter bench`: checkpoint save/load methods compared on this node's disk (gdswriter/tools/bench.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..tools.bench import COMPARABLE, COUNT_METHODS, COUNT_SIZE, DEFAULT_COUNTS, BenchOptions, count_steps, plot, run_bench, run_counts, steps_of
from ..progress import Progress
from ..units import human, parse_size
from ._common import EXIT_OK, UsageError, out


def register(sub) -> None:
    sp = sub.add_parser("bench", help="compare checkpoint save/load methods on this node's disk",
                        description="Save and load the same model + AdamW state with gdswriter and the methods "
                                    "in --compare, interleaved round by round, and measure the disk's ceiling "
                                    "(fio when installed, else gdswriter's built-in multi-queue O_DIRECT loop) "
                                    "in the same rounds. Saves end durable (fsync), loads start cold (files "
                                    "evicted from the page cache). Prints median GB/s with min-max and ratios to "
                                    "the ceiling and to torch.save/torch.load. Methods whose package is missing "
                                    "(e.g. DeepSpeed) are skipped with the reason. Needs about 2 x SIZE of free "
                                    "disk and 2.3 x SIZE of RAM; everything written is removed afterwards.")
    sp.add_argument("--dir", metavar="D", help="directory on the disk to test (default: a temporary directory "
                                               "under the current one)")
    sp.add_argument("--size", default="2G", metavar="S", help="bytes of model + optimizer state (default 2G)")
    sp.add_argument("--rounds", type=int, default=3, metavar="N", help="interleaved rounds (default 3)")
    sp.add_argument("--compare", default=",".join(COMPARABLE), metavar="M,M",
                    help=f"methods besides gdswriter, from {','.join(COMPARABLE)} (default: all)")
    sp.add_argument("--settle", type=float, default=1.0, metavar="SEC",
                    help="seconds to wait after a sync before each cold load (default 1; virtual disks may "
                         "need 5)")
    sp.add_argument("--tensors", default=",".join(map(str, DEFAULT_COUNTS)), metavar="N,N",
                    help="also save and load a state of N tensors (a nested dict) per count, beside the ceiling in "
                         "the same rounds: a fresh checkpointer's first save, its second save and a cold load "
                         f"(default {','.join(map(str, DEFAULT_COUNTS))}; 0 leaves it out)")
    sp.add_argument("--tensors-size", metavar="S", help="bytes of that state (default: --size, at most 256M)")
    sp.add_argument("--no-fio", action="store_true", help="use the built-in ceiling reference even if fio is installed")
    sp.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    sp.add_argument("--markdown", action="store_true", help="print the table as Markdown (for a README)")
    sp.add_argument("--plot", metavar="OUT.png", help="also draw a chart (needs matplotlib: the 'plot' extra)")
    sp.set_defaults(func=run)


def run(args) -> int:
    compare = tuple(m.strip() for m in args.compare.split(",") if m.strip())
    base = Path(args.dir) if args.dir else Path.cwd()
    if base.exists() and not base.is_dir():
        raise UsageError(f"--dir {base} is not a directory")
    if args.plot:  # fail before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'gdswriter[plot]' (or pip install matplotlib)") \
                from None
    try:
        counts = [int(x) for x in args.tensors.split(",") if x.strip() and int(x) > 0]
    except ValueError:
        raise UsageError(f"--tensors {args.tensors!r}: give tensor counts, e.g. 64,10000 (0: none)") from None
    opts = BenchOptions(directory=base, size=parse_size(args.size), rounds=args.rounds, compare=compare,
                        settle=args.settle, use_fio=not args.no_fio)
    if not args.json:
        out(f"gdswriter bench: {human(opts.size)} of state x {opts.rounds} rounds of gdswriter, "
            f"{', '.join(compare) or 'no other method'} and the disk's ceiling in {base.resolve()}; needs about "
            f"{human(2 * opts.size)} free there, removed afterwards")
    made = not base.exists()
    try:
        count_size = parse_size(args.tensors_size) if args.tensors_size else min(opts.size, COUNT_SIZE)
        beside = tuple(m for m in COUNT_METHODS if m in compare)  # the many-tensor rounds' other methods
        with Progress("bench", total=steps_of(opts) + count_steps(counts, opts.rounds, 2 + len(beside)),
                      unit="steps") as bar:
            result = run_bench(opts, step=lambda note: bar.advance(1, note=note))
            by_count = (run_counts(base, counts=counts, size=count_size, rounds=opts.rounds, settle_s=opts.settle,
                                   compare=beside, step=lambda note: bar.advance(1, note=note)) if counts else None)
    finally:
        if made:
            with contextlib.suppress(OSError):
                base.rmdir()
    if args.json:
        out(json.dumps({**result.to_json(), "tensor_counts": by_count.to_json() if by_count else None}, indent=2))
    else:
        for line in result.header() + [""] + (result.markdown() if args.markdown else result.table()):
            out(line)
        if by_count is not None:
            for line in [""] + by_count.table():
                out(line)
    if args.plot:
        path = plot(result, args.plot)
        if not args.json:
            out(f"chart: {path}")
    return EXIT_OK

