"""`gdswriter verify`: re-read and re-hash every chunk of one step or all of them."""

from __future__ import annotations

import os

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatVersionError
from ..format.commit import CommitProtocol
from ..format.copies import repairable, step_lock
from ..format.sharded import match_roots
from ..progress import Progress
from ..units import gbps, human, parse_size
from ._common import (EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, add_roots_argument, check_roots, load_manifest, open_roots,
                      out)

EXIT_UNPROTECTED = 3  # the step's own files intact, a copy or parity block protecting it damaged or missing


def register(sub) -> None:
    sp = sub.add_parser("verify", help="re-read and re-hash every chunk, copy and parity block",
                        description="Re-read every chunk of the data files through the I/O engine and compare its "
                                    "crc32c with the manifest; also check file sizes and the state tree. For a "
                                    "multi-rank step protected by replicas or parity (give every node's roots), also "
                                    "re-read every copy and parity block on the roots given against the crc32c the "
                                    "step records for them (a scrub: damage found before a lost node needs them). "
                                    "Memory stays bounded by --scratch. Exit status 0: intact; 1: corrupt (each "
                                    "problem names the file, byte range and tensors; with --all, one line per "
                                    "step); 2: no such root/step; 3: the step's own files are intact but a copy or "
                                    "parity block protecting it is damaged or missing (each named by rank, root "
                                    "and file; --repair makes it re-creatable).")
    add_roots_argument(sp)
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, metavar="N", help="step to verify (default: the latest)")
    g.add_argument("--all", action="store_true",
                   help="verify every committed step: one line per step, OK or CORRUPT with the first problem")
    sp.add_argument("--scratch", default="256M", metavar="SIZE",
                    help="read buffer size; bounds memory use (default 256M)")
    sp.add_argument("--repair", action="store_true",
                    help="for a step whose own files are intact: withdraw its 'protected' marker and set a damaged "
                         "copy or parity block aside (renamed .damaged-..., nothing deleted), so that the next "
                         "multi-rank load's refill re-creates it and marks the step protected again")
    sp.set_defaults(func=run)


def run(args) -> int:
    from ..engines.select import create_engine
    from ..options import EngineOptions

    roots = open_roots(args.root, args.secondary)
    protocol = CommitProtocol(roots)
    scratch = parse_size(args.scratch)
    if args.all:
        steps = protocol.committed_steps()
        if not steps:
            protocol.require(None)  # raises CheckpointNotFoundError with the usual message
    else:
        steps = [protocol.require(args.step)]
    counts = {"ok": 0, "corrupt": 0, "vanished": 0, "unprotected": 0}
    with create_engine(EngineOptions.from_env()) as engine:
        for step in steps:
            counts[_one_step(args, protocol, engine, step, scratch)] += 1
    corrupt, vanished, unprotected = counts["corrupt"], counts["vanished"], counts["unprotected"]
    if len(steps) > 1:
        out(f"{len(steps) - corrupt - vanished - unprotected} of {len(steps)} steps intact" +
            (f", {corrupt} corrupt" if corrupt else "") +
            (f", {unprotected} with damaged protection" if unprotected else "") +
            (f", {vanished} deleted meanwhile" if vanished else ""))
    if corrupt:
        return EXIT_CORRUPT
    if unprotected:
        return EXIT_UNPROTECTED
    if vanished and vanished == len(steps):
        return EXIT_USAGE
    return EXIT_OK


def _one_step(args, protocol: CommitProtocol, engine, step: int, scratch: int) -> str:
    """Verify (and scrub) one step, printing its lines: "ok", "corrupt", "vanished" or "unprotected"."""
    from ..load.verify import scrub_protection, verify_step

    problems: list[str] = []
    m = scrub = lock = None
    mend = True
    try:
        try:
            _, m, _ = load_manifest(protocol, step)
            check_roots(protocol, step, m)
            if args.repair and m.dist is not None:  # no refill of the step runs from the scrub to the repair's end
                lock = step_lock(protocol.step_dir(step), exclusive=True)
                mend = repairable(protocol.step_dir(step))  # before the scrub: a protected step's copies are all there
            with Progress(f"verify step {step}") as bar:  # drawn on a terminal only
                stats = verify_step(_in_table_order(protocol, m), m, bar.reads(engine), scratch, problems)
                scrub = scrub_protection(protocol, step, bar.reads(engine), scratch) if m.dist is not None else None
        except CheckpointNotFoundError:
            stats = None
            problems.append("deleted")
        except (CorruptCheckpointError, UnsupportedFormatVersionError) as e:
            stats = None
            problems.append(str(e))
        return _judged(args, protocol, engine, step, m, stats, scrub, problems, mend)
    finally:
        if lock is not None:
            os.close(lock)


def _in_table_order(protocol: CommitProtocol, m) -> CommitProtocol:
    """The roots given, in the order of a multi-rank step's root table (matched by id) where each
    table root is among them: a step whose primary's node was lost is committed on the root that
    adopted its manifest's copy (given first), while its table still names the replaced root
    first; else as given."""
    if m.dist is None:
        return protocol
    where = match_roots(m.dist.roots, protocol.roots)
    if any(p is None for p in where) or where == protocol.roots[:len(where)]:
        return protocol
    return CommitProtocol(where)  # type: ignore[arg-type]


def _judged(args, protocol: CommitProtocol, engine, step: int, m, stats, scrub, problems: list[str],
            mend: bool) -> str:
    """``_one_step``'s verdict and lines, once the step is read (and, with --repair, repaired where
    ``mend``: the step was protected or noted before its scrub)."""
    from ..load.reader import step_gone

    # Problems of a step deleted (or saved again) meanwhile are a race with retention, not damage.
    if (problems or (scrub and scrub.problems)) and \
            (not protocol.is_committed(step) if m is None else step_gone(protocol, m)):
        out(f"step {step}: deleted while being verified (a running checkpointer's retention?); skipped")
        return "vanished"
    if problems:
        more = f" (+{len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        if args.all:  # one line per step
            out(f"step {step}: CORRUPT: {problems[0]}{more}")
            return "corrupt"
        for p in problems:
            out(f"step {step}: CORRUPT: {p}")
        out(f"step {step}: CORRUPT ({len(problems)} problem{'s' if len(problems) != 1 else ''})")
        return "corrupt"
    assert stats is not None
    line = (f"step {step}: OK ({stats.files} file{'s' if stats.files != 1 else ''}, {stats.chunks} "
            f"chunk{'s' if stats.chunks != 1 else ''}, {human(stats.bytes)} re-read and re-hashed in "
            f"{stats.seconds:.2f} s, {gbps(stats.bytes, stats.seconds):.2f} GB/s; engine {engine.info.name})")
    if scrub is None or not (scrub.blocks or scrub.files or scrub.problems or scrub.damaged):
        out(line)
        return "ok"
    return _scrubbed(args, protocol, step, scrub, line, mend)


def _scrubbed(args, protocol: CommitProtocol, step: int, scrub, line: str, mend: bool) -> str:
    """The lines of a step whose own files are intact, after its scrub; --repair's actions."""
    from ..load.verify import set_aside_damage

    checked = (f"{scrub.blocks} parity block{'s' if scrub.blocks != 1 else ''}, {scrub.files} copy "
               f"file{'s' if scrub.files != 1 else ''}, {human(scrub.bytes)} re-read in {scrub.seconds:.2f} s")
    if scrub.damaged:
        out(f"step {step}: {len(scrub.damaged)} damaged cop{'ies or blocks' if len(scrub.damaged) != 1 else 'y or block'} "
            f"set aside by verify --repair, kept until a load's refill re-created and protected them: " +
            ", ".join(scrub.damaged))
    if not scrub.problems:
        out(f"{line}; protection intact ({checked})")
        return "ok"
    n = len(scrub.problems)
    if args.all:
        out(f"step {step}: PROTECTION DAMAGED: {scrub.problems[0]}" + (f" (+{n - 1} more)" if n > 1 else ""))
    else:
        out(line)
        for p in scrub.problems:
            out(f"step {step}: PROTECTION DAMAGED: {p}")
        out(f"step {step}: its own files are intact, but {n} cop{'ies or blocks' if n != 1 else 'y or block'} "
            f"protecting it {'are' if n != 1 else 'is'} damaged or missing: it would not survive the loss of the "
            f"node{'s' if n != 1 else ''} named" + ("" if args.repair else
                                                    "; run again with --repair, then load it on every rank"))
    if args.repair and not mend:
        out(f"repair: step {step}: refused, nothing touched: the step is not marked protected (its replication to "
            f"peer nodes is still running, or failed); run verify --repair again once wait_protected() returned; a "
            f"step whose replication failed is mended by a newer step's protection, not by --repair")
    elif args.repair:
        for done in set_aside_damage(protocol, scrub):
            out(f"repair: {done}")
    return "unprotected"
