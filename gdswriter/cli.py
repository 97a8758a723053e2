"""The ``gdswriter`` command: list, inspect, verify and export checkpoints; run the demo and the bench.

    gdswriter ls ROOT [ROOT...]
    gdswriter inspect ROOT [--step N] [--json]
    gdswriter verify ROOT [--step N | --all]
    gdswriter export ROOT [--step N] --to torch|safetensors|hf OUT [--model-only] [--force]
    gdswriter demo [--dir D] [--size 4G] [--engine auto|io_uring|posix]
    gdswriter topology [ROOT...] [--size S] [--json] [--replay FILE.json]
    gdswriter doctor [DIR...] [--json] [--test-size 64M] [--no-io-test]
    gdswriter bench [--dir D] [--size 2G] [--rounds 3] [--compare torch,dcp,safetensors,deepspeed] [--json] [--plot P]

Each command lives in its own module under gdswriter/commands/ (``register`` adds its
parser, ``run`` does the work); this module only parses and maps errors to exit codes.
Exit status: 0 success; 1 a checkpoint is corrupt (or another gdswriter/I/O error);
2 usage error, or no such root/step. Expected errors print one line to stderr.
Reading commands take no lock and never unpickle anything.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from ._version import __version__
from .commands._common import EXIT_CORRUPT, EXIT_USAGE
from .errors import UsageError
from .errors import CheckpointNotFoundError, GDSWriterError, InvalidOptionError, UnsupportedObjectError

COMMANDS = ("ls", "inspect", "verify", "export", "demo", "bench", "doctor", "topology")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gdswriter", description="List, inspect, verify and export gdswriter checkpoints; run the I/O demo and the bench.",
        epilog="Exit status: 0 ok; 1 corrupt checkpoint or I/O error; 2 usage error or no such root/step.")
    p.add_argument("--version", action="version", version=f"gdswriter {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log gdswriter's informational messages")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).register(sub)
    return p


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001
            self.handleError(record)


def _error_text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and type(e).__str__ is OSError.__str__:
        text = e.strerror + (f": {e.filename}" if e.filename and str(e.filename) not in e.strerror else "")
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors (argparse prints them)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    log = logging.getLogger("gdswriter")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level = log.level
    log.addHandler(handler)
    if args.verbose:
        log.setLevel(logging.INFO)
    try:
        return args.func(args)
    except (CheckpointNotFoundError, InvalidOptionError, UnsupportedObjectError, UsageError) as e:
        print(f"gdswriter: error: {_error_text(e)}", file=sys.stderr)
        return EXIT_USAGE
    except GDSWriterError as e:
        from .errors import OutputExistsError, UnsupportedDtypeError

        print(f"gdswriter: error: {_error_text(e)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, (OutputExistsError, UnsupportedDtypeError)) else EXIT_CORRUPT
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_CORRUPT
    except OSError as e:
        print(f"gdswriter: error: {_error_text(e)}", file=sys.stderr)
        return EXIT_CORRUPT
    except KeyboardInterrupt:
        print("gdswriter: interrupted", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


if __name__ == "__main__":
    sys.exit(main())
