"""`gdswriter doctor`: what this node can do for checkpoints, with the fix for each problem."""

from __future__ import annotations

import json

from ..units import parse_size
from ._common import EXIT_CORRUPT, EXIT_OK, out


def register(sub) -> None:
    sp = sub.add_parser("doctor", help="check GPUs, GDS, io_uring, limits and target directories",
                        description="Check what this node offers gdswriter: GPUs, driver and CUDA versions, cuFile, "
                                    "the nvidia-fs driver, cufile.json, KvikIO's mode, io_uring, the mlock limit, "
                                    "huge pages, and for each DIR its file system, block device, its drives' NVMe "
                                    "health log and remaining rated endurance (GDSWRITER_DRIVE_TBW gives a rating "
                                    "the built-in table lacks), O_DIRECT alignment and a short durable write + "
                                    "verified cold read with each engine available. "
                                    "Each finding is OK, WARN or FAIL with its fix; exit status 1 if any FAIL.")
    sp.add_argument("dirs", nargs="*", metavar="DIR", help="checkpoint directories to check (default: the current "
                                                           "directory)")
    sp.add_argument("--json", action="store_true", help="print the findings as JSON")
    sp.add_argument("--test-size", default="64M", metavar="SIZE", help="bytes per engine write/read test "
                                                                        "(default 64M)")
    sp.add_argument("--no-io-test", action="store_true", help="skip the write/read tests")
    sp.set_defaults(func=run)


def run(args) -> int:
    from .._version import __version__
    from ..crc import native_status
    from ..tools.doctor import FAIL, OK, run_checks, worst

    findings = run_checks(args.dirs or ["."], test_bytes=parse_size(args.test_size), io_test=not args.no_io_test)
    verdict = worst(findings)
    if args.json:
        print(json.dumps({"gdswriter": __version__, "status": verdict, "snapshot_copier": native_status(),
                          "findings": [vars(f) for f in findings]}, indent=1, default=str))
    else:
        out(f"gdswriter {__version__} doctor\nsnapshot copier: {native_status()}")
        width = max(len(f.check) for f in findings)
        scope = None
        for f in findings:
            if f.scope != scope:
                scope = f.scope
                out(scope)
            out(f"  {f.status:<4}  {f.check:<{width}}  {f.summary}")
            if f.fix and f.status != OK:
                out(f"  {'':<4}  {'':<{width}}  fix: {f.fix}")
        counts = {s: sum(f.status == s for f in findings) for s in ("OK", "WARN", "FAIL")}
        out(f"{verdict}: {counts['OK']} ok, {counts['WARN']} warning(s), {counts['FAIL']} failure(s)")
    return EXIT_CORRUPT if verdict == FAIL else EXIT_OK
