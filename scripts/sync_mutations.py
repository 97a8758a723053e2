#!/usr/bin/env python3
"""Remove each durability call of gdswriter in turn and check that the power-loss test notices.

Finds every call in gdswriter/ that asks the kernel for durability: ``os.fsync``,
``os.fdatasync``, ``os.sync``, ``os.syncfs``, ``fsync_dir(...)`` and ``fsync_parents(...)``
(the package's directory fsyncs), ``msync``/``sync_file_range`` if any appear, and reports O_SYNC/O_DSYNC opens (which
the mutations do not cover). For each call it copies the package to a scratch directory,
replaces that one call by ``None`` there (the real tree is never edited), runs
tests/test_powerloss.py against the copy (cwd and PYTHONPATH point at it; the script checks
that the copy is what gets imported) and prints a table: call site -> caught (the test
failed, with its first complaint) or NOT caught.

Some calls are known not to matter to the power-loss test; EXEMPT says why for each. They run
all the same (``--skip-exempt`` leaves them out); the exit status is 1 when a call that is not
exempt goes uncaught, or when the test fails without any mutation.

Usage: python scripts/sync_mutations.py [--list] [--only SUBSTRING] [--skip-exempt]
                                        [--timeout S] [-- PYTEST ARGS]
Takes a while: a caught mutation stops at the test's first failure (pytest -x), an uncaught
one runs the whole test (a few minutes each).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gdswriter"
TEST = REPO / "tests" / "test_powerloss.py"
SYNC_FUNCTIONS = {"fsync", "fdatasync", "sync", "syncfs", "sync_file_range", "msync", "fsync_dir", "fsync_parents"}
SYNC_FLAGS = {"O_SYNC", "O_DSYNC"}

# (file relative to gdswriter/, enclosing [Class.]function) -> why removing the call cannot fail the test.
EXEMPT = {
    ("tools/measure.py", "builtin_reference"):
        "benchmark reference, not durability: it times a plain write loop including the flush to the device "
        "(as fio's --end_fsync=1 does) into a scratch file that is deleted; nothing is ever read back from it",
    ("tools/bench.py", "quiesce"):
        "measurement, not durability: `gdswriter bench` flushes every dirty page of the machine before a "
        "timed write so that foreign writeback does not land in the timing",
    ("tools/bench.py", "Methods.save"):
        "measurement, not durability: ends the compared method's (torch.save's) save durably, as gdswriter's "
        "ends, so that the benchmark compares like with like; the file is a scratch file of the benchmark",
    ("engines/kvikio.py", "GdsEngine.write_file"):
        "cannot run here: the GDS engine needs KvikIO and libcuda.so.1, and this test runs without a GPU. "
        "tests/test_gds_engine.py::test_durable_write_syncs_the_file (KvikIO replaced by a stand-in that "
        "writes through the file descriptor) fails when this fdatasync is removed",
    ("tools/pagecache.py", "evict"):
        "measurement, not durability: cleans the pages of a file that is already durable so that "
        "POSIX_FADV_DONTNEED can drop them before a cold-read measurement (demo, benchmarks); an error is ignored",
    ("format/commit.py", "CommitProtocol.clean_leftovers"):
        "not needed for safety: if the removal of a leftover (.tmp-/.trash- directory, or a secondary step "
        "directory whose primary has no manifest) is lost to a power cut, the same leftover comes back and the "
        "next open removes it again; none of them is ever listed as committed (only a primary step directory "
        "holding a manifest is), so nothing can be loaded from one. The fsync only keeps a crash from bringing "
        "back the space",
}


@dataclass(frozen=True)
class Site:
    path: str  # relative to gdswriter/
    line: int
    start: int  # byte offsets into the file
    end: int
    function: str
    text: str

    @property
    def label(self) -> str:
        return f"{self.path}:{self.line} {self.function}: {self.text}"

    @property
    def exempt(self) -> str | None:
        return EXEMPT.get((self.path, self.function))


def _called_name(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return None


def find_sites(package: Path = PACKAGE) -> tuple[list[Site], list[str]]:
    """Every durability call in ``package`` (in file order), and O_SYNC/O_DSYNC uses to report."""
    sites, flags = [], []
    for file in sorted(package.rglob("*.py")):
        raw = file.read_bytes()
        line_starts = [0]
        for line in raw.splitlines(keepends=True):
            line_starts.append(line_starts[-1] + len(line))
        rel = file.relative_to(package).as_posix()
        tree = ast.parse(raw, str(file))
        parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                parents[child] = parent
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in SYNC_FLAGS:
                flags.append(f"{rel}:{node.lineno}: {node.attr}")
            if not (isinstance(node, ast.Call) and _called_name(node) in SYNC_FUNCTIONS):
                continue
            if isinstance(node.func, ast.Attribute) and not (
                    _called_name(node) in ("fsync_dir", "fsync_parents") or (isinstance(node.func.value, ast.Name)
                                                         and node.func.value.id in ("os", "mmap"))):
                continue  # e.g. a method named sync on some object: not a kernel durability call
            scopes, p = [], parents.get(node)
            while p is not None:
                if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    scopes.insert(0, p.name)
                p = parents.get(p)
            fn = ".".join(scopes) or "<module>"
            start = line_starts[node.lineno - 1] + node.col_offset
            end = line_starts[node.end_lineno - 1] + node.end_col_offset
            sites.append(Site(rel, node.lineno, start, end, fn, raw[start:end].decode()))
    sites.sort(key=lambda s: (s.path, s.start))
    return sites, flags


def mutate(scratch_pkg: Path, site: Site) -> None:
    """Replace the call by ``None`` in the scratch copy (the copy's file must be pristine)."""
    file = scratch_pkg / site.path
    raw = file.read_bytes()
    file.write_bytes(raw[:site.start] + b"None" + raw[site.end:])
    ast.parse(file.read_bytes(), str(file))  # still valid Python


def run_test(scratch: Path, timeout: float, pytest_args: list[str]) -> tuple[str, str, float]:
    """Run the power-loss test against the copy in ``scratch``: ("passed"|"failed"|"timeout", summary, s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), PYTHONDONTWRITEBYTECODE="1")
    # -m "": the whole file, the slow power-cut scenarios included (pyproject's addopts leave them out).
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "", str(TEST), *pytest_args]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result within {timeout:.0f} s", time.monotonic() - t0
    took = time.monotonic() - t0
    if proc.returncode == 0:
        return "passed", "", took
    return "failed", _first_complaint(proc.stdout + proc.stderr), took


def _first_complaint(out: str) -> str:
    """The test's own message (pytest.fail or assert) if there is one, else the first error."""
    lines = [ln[1:].strip() for ln in out.splitlines() if ln.startswith("E ")]
    for wanted in ("Failed:", "AssertionError:", "Error"):
        for text in lines:
            if wanted in text:
                return re.sub(r"/tmp/\S+/", "", text)[:200]
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return (failed[0] if failed else out.strip().splitlines()[-1] if out.strip() else "no output")[:200]


def check_import(scratch: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    got = subprocess.run([sys.executable, "-c", "import gdswriter.engines.base as e; print(e.__file__)"], cwd=scratch,
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(got).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit(f"the scratch copy is not what gets imported (got {got}); the results would be meaningless")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the call sites and exit")
    ap.add_argument("--only", action="append", default=[], help="run only sites whose label contains this")
    ap.add_argument("--skip-exempt", action="store_true", help="do not run the exempt sites")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per test run (default 1800)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()

    sites, flags = find_sites()
    for f in flags:
        print(f"note: {f} (an O_SYNC/O_DSYNC open: not mutated here)")
    if args.list:
        for s in sites:
            print(s.label + (f"   [exempt: {s.exempt}]" if s.exempt else ""))
        return 0
    chosen = [s for s in sites if (not args.only or any(o in s.label for o in args.only))
              and not (args.skip_exempt and s.exempt)]

    with tempfile.TemporaryDirectory(prefix="gdswriter-sync-mutations-") as tmp:
        scratch = Path(tmp)
        pkg = scratch / "gdswriter"
        shutil.copytree(PACKAGE, pkg, ignore=shutil.ignore_patterns("__pycache__"))
        check_import(scratch)
        print(f"{len(sites)} durability call sites in gdswriter/; running {len(chosen)} mutations "
              f"of {TEST.relative_to(REPO)}", flush=True)
        outcome, summary, took = run_test(scratch, args.timeout, args.pytest_args)
        print(f"baseline (no mutation): {outcome} in {took:.0f} s {summary}", flush=True)
        if outcome != "passed":
            print("the power-loss test fails without any mutation: fix that first", file=sys.stderr)
            return 1
        rows = []
        for s in chosen:
            original = (pkg / s.path).read_bytes()
            mutate(pkg, s)
            try:
                outcome, summary, took = run_test(scratch, args.timeout, args.pytest_args)
            finally:
                (pkg / s.path).write_bytes(original)
            verdict = "caught" if outcome in ("failed", "timeout") else "NOT caught"
            rows.append((s, verdict, summary, took))
            print(f"{verdict:10} {took:6.0f} s  {s.label}  {summary}", flush=True)

    print("\n| call site | result | how the test failed / why it cannot |")
    print("|---|---|---|")
    for s, verdict, summary, _ in rows:
        why = summary if verdict == "caught" else (f"exempt: {s.exempt}" if s.exempt else "**the test passed**")
        print(f"| `{s.label}` | {verdict} | {why.replace('|', '/')} |")
    missed = [s for s, verdict, _, _ in rows if verdict != "caught" and not s.exempt]
    wrongly_exempt = [s for s, verdict, _, _ in rows if verdict == "caught" and s.exempt]
    for s in wrongly_exempt:
        print(f"note: {s.label} is listed as exempt but the test caught its removal: update EXEMPT")
    print(f"\n{sum(v == 'caught' for _, v, _, _ in rows)} of {len(rows)} caught; "
          f"{len(missed)} not caught and not exempt")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
