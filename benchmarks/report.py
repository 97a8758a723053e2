#!/usr/bin/env python3
"""Summarise a pytest-benchmark JSON (``--benchmark-json=FILE``) of the gdswriter benchmarks
as compact markdown tables plus a goal check, and optionally a PNG chart.

    python benchmarks/report.py bench.json [more.json ...] [--check-goals] [--png chart.png]

The chart (needs matplotlib: ``pip install 'gdswriter[plot]'``) shows each checkpoint
method's save and load GB/s per size (median round, whiskers from the fastest to the slowest
round) and the best raw engine write/read of the largest size as dashed lines.

GB/s is decimal (1e9 bytes/s) and comes from each benchmark's extra_info: bytes / median
round time, except fio rows, whose GB/s is fio's own reported bandwidth (median of rounds;
"wall GB/s" there includes fio's process start-up). Ratios are bandwidth ratios.
With --check-goals the exit status is 1 when a goal with all its inputs present is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gdswriter, run from anywhere

ENGINE_RAW = ("fio io_uring", "dd-loop")
ENGINE = "gdswriter io_uring"
SAVE_REFS = ("torch.save", "dcp.save t4")
LOAD_REFS = ("torch.load", "dcp.load", "safetensors.load_file")
CASE_ORDER = ["fio io_uring", "dd-loop", "gdswriter posix", "gdswriter io_uring",
              "torch.save", "dcp.save t1", "dcp.save t4", "safetensors.save_file", "gdswriter.save",
              "torch.load", "dcp.load", "safetensors.load_file", "gdswriter.load"]


def load_rows(paths: list[str]) -> OrderedDict[tuple, dict]:
    rows: OrderedDict[tuple, dict] = OrderedDict()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for b in data.get("benchmarks", []):
            info = dict(b.get("extra_info") or {})
            if "suite" not in info or "case" not in info:
                continue
            median = float(info.get("median s") or b["stats"]["median"])
            gbps = info.get("GB/s")
            if gbps is None and info.get("bytes"):
                gbps = info["bytes"] / median / 1e9
            row = {"suite": info["suite"], "kind": info["kind"], "case": info["case"], "size": info["size"],
                   "bytes": int(info.get("bytes", 0)), "median": median, "gbps": float(gbps),
                   "wall": float(info.get("wall GB/s", gbps)), "rounds": b["stats"].get("rounds"),
                   "fio": "bw source" in info, "min_s": b["stats"].get("min"), "max_s": b["stats"].get("max")}
            rows[(row["suite"], row["kind"], row["size"], row["case"])] = row
    return rows


def fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def table(headers: list[str], body: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


def sizes_of(rows) -> list[str]:
    seen: dict[str, int] = {}
    for r in rows.values():
        seen.setdefault(r["size"], r["bytes"])
        seen[r["size"]] = max(seen[r["size"]], r["bytes"])
    return sorted(seen, key=lambda s: seen[s])


def ordered(rows, suite, kind, size) -> list[dict]:
    sel = [r for r in rows.values() if r["suite"] == suite and r["kind"] == kind and r["size"] == size]
    return sorted(sel, key=lambda r: CASE_ORDER.index(r["case"]) if r["case"] in CASE_ORDER else len(CASE_ORDER))


def get(rows, suite, kind, size, case) -> float | None:
    r = rows.get((suite, kind, size, case))
    return r["gbps"] if r else None


def best(rows, suite, kind, size, cases) -> tuple[float | None, str]:
    vals = [(get(rows, suite, kind, size, c), c) for c in cases]
    vals = [v for v in vals if v[0]]
    return max(vals) if vals else (None, "")


def report(rows) -> tuple[str, list[bool]]:
    sizes = sizes_of(rows)
    parts = [*engine_tables(rows, sizes), *save_table(rows, sizes), *load_table(rows, sizes)]
    goals, verdicts = goal_lines(rows, sizes)
    if goals:
        parts.append("### Goals\n\n" + "\n".join(goals))
    if any(r["fio"] for r in rows.values()):
        parts.append("\\* fio rows: GB/s is fio's own reported bandwidth (its job runtime, which for writes "
                     "includes the end_fsync); wall GB/s is the whole fio process, start-up included.")
    return "\n\n".join(parts) + "\n", verdicts


def engine_tables(rows, sizes) -> list[str]:
    """The engine's sequential write and read tables (none where there are no engine rows)."""
    parts = []
    for kind in ("write", "read"):
        body = []
        for size in sizes:
            ref, _ = best(rows, "engine", kind, size, ENGINE_RAW)
            for r in ordered(rows, "engine", kind, size):
                body.append([r["case"] + (" *" if r["fio"] else ""), size, fmt(r["median"], 3), fmt(r["gbps"]),
                             fmt(r["wall"]), fmt(ratio(r["gbps"], ref), 2, "x")])
        if body:
            parts.append(f"### Engine sequential {kind} ({'durable, fdatasync' if kind == 'write' else 'cold cache'})\n\n"
                         + table(["case", "size", "median s", "GB/s", "wall GB/s", "x best raw"], body))
    return parts


def save_table(rows, sizes) -> list[str]:
    """The checkpoint save table, against torch.save, dcp.save t4 and the engine's raw write."""
    body = []
    for size in sizes:
        eng = get(rows, "engine", "write", size, ENGINE)
        ts, d4 = (get(rows, "checkpoint", "save", size, c) for c in SAVE_REFS)
        for r in ordered(rows, "checkpoint", "save", size):
            body.append([r["case"], size, fmt(r["bytes"] / 1e9), fmt(r["median"], 3), fmt(r["gbps"]),
                         fmt(ratio(r["gbps"], ts), 2, "x"), fmt(ratio(r["gbps"], d4), 2, "x"),
                         fmt(ratio(r["gbps"], eng), 2, "x")])
    if not body:
        return []
    return ["### Checkpoint save (durable)\n\n" + table(
        ["case", "size", "GB", "median s", "GB/s", "x torch.save", "x dcp.save t4", "x engine raw write"], body)]


def load_table(rows, sizes) -> list[str]:
    """The checkpoint load table, against torch.load and the fastest other loader."""
    body = []
    for size in sizes:
        tl = get(rows, "checkpoint", "load", size, "torch.load")
        fastest, _ = best(rows, "checkpoint", "load", size, LOAD_REFS)
        for r in ordered(rows, "checkpoint", "load", size):
            body.append([r["case"], size, fmt(r["bytes"] / 1e9), fmt(r["median"], 3), fmt(r["gbps"]),
                         fmt(ratio(r["gbps"], tl), 2, "x"), fmt(ratio(r["gbps"], fastest), 2, "x")])
    if not body:
        return []
    return ["### Checkpoint load (cold cache)\n\n" + table(
        ["case", "size", "GB", "median s", "GB/s", "x torch.load", "x fastest other loader"], body)]


def goal_lines(rows, sizes) -> tuple[list[str], list[bool]]:
    """One line per goal that can be judged or is missing a figure, and the verdicts (True: met)."""
    goals: list[str] = []
    verdicts: list[bool] = []

    def goal(label: str, value: float | None, ref: float | None, ref_name: str, want: float) -> None:
        r = ratio(value, ref)
        if r is None:
            goals.append(f"- {label}: n/a (missing {ref_name if value else 'gdswriter result'})")
            return
        ok = r >= want
        verdicts.append(ok)
        goals.append(f"- {label}: {r:.2f}x {ref_name} (goal >= {want:g}x) **{'PASS' if ok else 'FAIL'}**")

    for size in sizes:
        for kind, want in (("write", 0.95), ("read", 0.90)):
            ref, name = best(rows, "engine", kind, size, ENGINE_RAW)
            if (get(rows, "engine", kind, size, ENGINE) or ref) is not None:
                goal(f"{size} engine {kind}", get(rows, "engine", kind, size, ENGINE), ref,
                     f"best raw ({name})" if name else "best raw", want)
        save = get(rows, "checkpoint", "save", size, "gdswriter.save")
        if save or rows.get(("checkpoint", "save", size, "torch.save")):
            goal(f"{size} save vs engine raw write", save, get(rows, "engine", "write", size, ENGINE),
                 "engine raw write", 0.9)
            goal(f"{size} save vs torch.save", save, get(rows, "checkpoint", "save", size, "torch.save"), "torch.save", 3.0)
            goal(f"{size} save vs dcp.save t4", save, get(rows, "checkpoint", "save", size, "dcp.save t4"),
                 "dcp.save t4", 1.7)
        load = get(rows, "checkpoint", "load", size, "gdswriter.load")
        fastest, name = best(rows, "checkpoint", "load", size, LOAD_REFS)
        if load or fastest:
            goal(f"{size} load vs fastest loader", load, fastest, f"fastest loader ({name})" if name else "fastest loader", 1.0)
    return goals, verdicts


FAMILIES = {"torch": ("torch.save", "torch.load"), "dcp t1": ("dcp.save t1", None),
            "dcp t4": ("dcp.save t4", "dcp.load"), "safetensors": ("safetensors.save_file", "safetensors.load_file"),
            "gdswriter": ("gdswriter.save", "gdswriter.load")}


def spread(row: dict | None):
    """Median GB/s with the slowest and fastest rounds' GB/s (fio rows: fio's own figure only)."""
    from gdswriter.tools.bench import Spread

    if row is None:
        return None
    g = row["gbps"]
    if row["fio"] or not row["bytes"] or not row["min_s"] or not row["max_s"]:
        return Spread(g, g, g)
    return Spread(g, row["bytes"] / row["max_s"] / 1e9, row["bytes"] / row["min_s"] / 1e9)


def chart(rows, path: str, title: str) -> Path:
    """The checkpoint save/load chart of ``rows`` (see the module doc) as a PNG at ``path``."""
    from gdswriter.tools.bench import bar_chart

    sizes = sizes_of(rows)
    groups = [f for f, (s, ld) in FAMILIES.items()
              if any(("checkpoint", k, z, c) in rows for z in sizes for k, c in (("save", s), ("load", ld)))]
    series = {}
    for size in sizes:
        for kind, pick in (("save", 0), ("load", 1)):
            values = [spread(rows.get(("checkpoint", kind, size, FAMILIES[f][pick]))) for f in groups]
            if any(values):
                series[f"{kind} {size}"] = values
    lines = {}
    if sizes:
        for kind in ("write", "read"):
            best_raw, name = best(rows, "engine", kind, sizes[-1], ENGINE_RAW)
            if best_raw:
                lines[f"raw {kind} {sizes[-1]} ({name})"] = best_raw
    return bar_chart(path, groups, series, title=title, lines=lines,
                     note="GB/s = 1e9 bytes/s; saves durable, loads cold; bars: median round, whiskers: slowest-fastest")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="pytest-benchmark JSON file(s) (--benchmark-json=FILE)")
    ap.add_argument("--check-goals", action="store_true", help="exit 1 if a goal is missed")
    ap.add_argument("--png", metavar="PATH", help="also write a chart of the checkpoint cases (needs matplotlib)")
    ap.add_argument("--title", default="gdswriter checkpoint save and load", help="the chart's title")
    args = ap.parse_args(argv)
    rows = load_rows(args.json)
    if not rows:
        print("no gdswriter benchmark results in " + ", ".join(args.json), file=sys.stderr)
        return 2
    text, verdicts = report(rows)
    sys.stdout.write(text)
    if args.png:
        from gdswriter.errors import InvalidOptionError

        try:
            print(f"\nchart: {chart(rows, args.png, args.title)}")
        except InvalidOptionError as e:  # matplotlib missing: the tables above still stand
            print(f"report.py: no chart: {e}", file=sys.stderr)
            return 2
    return 1 if args.check_goals and not all(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
