"""CPU time and wall of a fresh checkpointer's cold load, before and after, interleaved.

Each ``--tree LABEL=PATH`` runs in a worker process (PYTHONPATH=PATH) that saves 256 MiB as
each ``--counts`` number of tensors once, then, round by round (the trees interleaved),
opens a fresh checkpointer on it, evicts its files, and loads it: wall (perf_counter) and
the process's CPU time (all threads) of ``load``. Medians over the rounds.

    .venv/bin/python benchmarks/cold_loads.py --tree before=/work/main --tree after=. --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def worker() -> None:
    """One JSON request a line: {"count", "size", "root", "setup"}; one RESULT line back."""
    from gdswriter import GDSCheckpointer
    from gdswriter.tools.bench import quiesce, tensor_state
    from gdswriter.tools.measure import evict_paths

    states: dict[int, dict] = {}
    for line in sys.stdin:
        req = json.loads(line)
        n, root = req["count"], Path(req["root"])
        state = states.get(n) or states.setdefault(n, tensor_state(n, req["size"]))
        if req["setup"]:
            with GDSCheckpointer(state, None, root) as ck:
                ck.save(1)
            print("RESULT {}", flush=True)
            continue
        with GDSCheckpointer(state, None, root) as ck:
            quiesce()
            os.sync()
            evict_paths(root)
            time.sleep(0.5)
            w, c = time.perf_counter(), time.process_time()
            ck.load(1)
            got = {"wall": time.perf_counter() - w, "cpu": time.process_time() - c}
        print("RESULT " + json.dumps(got), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH")
    ap.add_argument("--counts", default="64,10000,100000")
    ap.add_argument("--size", type=int, default=256 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    counts = [int(x) for x in a.counts.split(",")]
    import _util

    procs = {label: _util.TreeWorker(__file__, path) for label, _, path in (t.partition("=") for t in a.tree)}

    def ask(label: str, **req) -> dict:
        return procs[label].ask(json.dumps(req))

    rows: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        for n in counts:
            for label in procs:
                ask(label, count=n, size=a.size, root=f"{d}/{label}-{n}", setup=True)
        for r in range(a.rounds):
            for n in counts:
                for label in (list(procs) if r % 2 == 0 else list(procs)[::-1]):
                    rows.setdefault((label, n), []).append(
                        ask(label, count=n, size=a.size, root=f"{d}/{label}-{n}", setup=False))
            print(f"  round {r + 1} done", file=sys.stderr, flush=True)
    for w in procs.values():
        w.close()
    print(f"{'tree':<8} {'tensors':>8} {'wall s':>8} {'GB/s':>6} {'CPU s':>7}   (medians of {a.rounds}; wall/CPU all rounds)")
    for (label, n), got in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        wall = statistics.median(g["wall"] for g in got)
        cpu = statistics.median(g["cpu"] for g in got)
        each = " ".join(f"{g['wall']:.2f}/{g['cpu']:.2f}" for g in got)
        print(f"{label:<8} {n:>8,} {wall:>8.3f} {a.size / wall / 1e9:>6.2f} {cpu:>7.3f}   {each}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
