"""`gdswriter verify`: re-read and re-hash every chunk of one step or all of them."""

from __future__ import annotations

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatVersionError
from ..format.commit import CommitProtocol
from ..progress import Progress
from ..units import gbps, human, parse_size
from ._common import (EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, add_roots_argument, check_roots, load_manifest, open_roots,
                      out)


def register(sub) -> None:
    sp = sub.add_parser("verify", help="re-read and re-hash every chunk",
                        description="Re-read every chunk of the data files through the I/O engine and compare its "
                                    "crc32c with the manifest; also check file sizes and the state tree. Memory "
                                    "stays bounded by --scratch. Exit status 0: intact; 1: corrupt (each problem "
                                    "names the file, byte range and tensors; with --all, one line per "
                                    "step); 2: no such root/step.")
    add_roots_argument(sp)
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, metavar="N", help="step to verify (default: the latest)")
    g.add_argument("--all", action="store_true",
                   help="verify every committed step: one line per step, OK or CORRUPT with the first problem")
    sp.add_argument("--scratch", default="256M", metavar="SIZE",
                    help="read buffer size; bounds memory use (default 256M)")
    sp.set_defaults(func=run)


def run(args) -> int:
    from ..engines.select import create_engine
    from ..options import EngineOptions
    from ..load.reader import step_gone
    from ..load.verify import verify_step

    roots = open_roots(args.root, args.secondary)
    protocol = CommitProtocol(roots)
    scratch = parse_size(args.scratch)
    if args.all:
        steps = protocol.committed_steps()
        if not steps:
            protocol.require(None)  # raises CheckpointNotFoundError with the usual message
    else:
        steps = [protocol.require(args.step)]
    corrupt = vanished = 0
    with create_engine(EngineOptions.from_env()) as engine:
        for step in steps:
            problems: list[str] = []
            m = None
            try:
                _, m, _ = load_manifest(protocol, step)
                check_roots(protocol, step, m)
                with Progress(f"verify step {step}") as bar:  # drawn on a terminal only
                    stats = verify_step(protocol, m, bar.reads(engine), scratch, problems)
            except CheckpointNotFoundError:
                stats = None
                problems.append("deleted")
            except (CorruptCheckpointError, UnsupportedFormatVersionError) as e:
                stats = None
                problems.append(str(e))
            # Problems of a step deleted (or saved again) meanwhile are a race with retention, not damage.
            if problems and (not protocol.is_committed(step) if m is None else step_gone(protocol, m)):
                vanished += 1
                out(f"step {step}: deleted while being verified (a running checkpointer's retention?); skipped")
                continue
            if problems:
                corrupt += 1
                more = f" (+{len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
                if args.all:  # one line per step
                    out(f"step {step}: CORRUPT: {problems[0]}{more}")
                    continue
                for p in problems:
                    out(f"step {step}: CORRUPT: {p}")
                out(f"step {step}: CORRUPT ({len(problems)} problem{'s' if len(problems) != 1 else ''})")
            else:
                assert stats is not None
                out(f"step {step}: OK ({stats.files} file{'s' if stats.files != 1 else ''}, {stats.chunks} "
                    f"chunk{'s' if stats.chunks != 1 else ''}, {human(stats.bytes)} re-read and re-hashed in "
                    f"{stats.seconds:.2f} s, {gbps(stats.bytes, stats.seconds):.2f} GB/s; engine {engine.info.name})")
    if len(steps) > 1:
        out(f"{len(steps) - corrupt - vanished} of {len(steps)} steps intact" +
            (f", {corrupt} corrupt" if corrupt else "") + (f", {vanished} deleted meanwhile" if vanished else ""))
    if corrupt:
        return EXIT_CORRUPT
    if vanished and vanished == len(steps):
        return EXIT_USAGE
    return EXIT_OK
