"""Cold loads into a live model and a resumed AdamW, before and after, interleaved, as ratios to
the disk's cold read of the same files in the same round.

Each ``--tree LABEL=PATH`` runs in a worker process (PYTHONPATH=PATH) that builds a
ParameterList of ``--params`` parameters (about 256 MiB with the optimizer's two moments; its
``step`` tensors too: four tensors a parameter), steps AdamW once and saves it once. Each round
reads the first tree's step files cold (evicted; 8 MiB reads: the ceiling), then each tree's
worker evicts its files and times ``load`` (checked: a spoiled parameter is restored).

    .venv/bin/python benchmarks/live_loads.py --tree before=/work/main --tree after=. --params 25000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker() -> None:
    """Requests on stdin, one a line: "setup ROOT N" or "load"; one RESULT line back each."""
    import torch

    from gdswriter import GDSCheckpointer
    from gdswriter.tools.bench import quiesce
    from gdswriter.tools.measure import evict_paths

    model = opt = root = want = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "setup":
            root, n = Path(words[1]), int(words[2])
            torch.manual_seed(0)
            per = max(1, (256 << 20) // 3 // 4 // n)
            model = torch.nn.ParameterList([torch.nn.Parameter(torch.rand(per)) for _ in range(n)])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for p in model.parameters():
                p.grad = torch.rand_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            want = model[0].detach().clone()
            with GDSCheckpointer(model, opt, root) as ck:
                ck.save(1)
            print("RESULT {}", flush=True)
            continue
        with GDSCheckpointer(model, opt, root) as ck:
            quiesce()
            os.sync()
            evict_paths(root)
            time.sleep(0.5)
            with torch.no_grad():
                model[0].fill_(-1)
            t = time.perf_counter()
            ck.load(1)
            wall = time.perf_counter() - t
        assert torch.equal(model[0].detach(), want), "the load did not restore the model"
        print("RESULT " + json.dumps({"wall": wall}), flush=True)


def ceiling(root: Path) -> float:
    """Seconds to read every file under ``root`` cold, 8 MiB at a time."""
    from gdswriter.tools.measure import evict_paths

    os.sync()
    evict_paths(root)
    time.sleep(0.5)
    t = time.perf_counter()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH")
    ap.add_argument("--params", type=int, default=25000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="live-loads-", dir=a.dir))
    import _util

    procs = {label: _util.TreeWorker(__file__, path) for label, path in (spec.split("=", 1) for spec in a.tree)}

    def ask(label: str, line: str) -> dict:
        return procs[label].ask(line)

    for label in procs:
        ask(label, f"setup {work / label} {a.params}")
    walls: dict[str, list[float]] = {label: [] for label in procs}
    ratios: dict[str, list[float]] = {label: [] for label in procs}
    ceil: list[float] = []
    first = work / next(iter(procs))
    for r in range(a.rounds):
        ceil.append(ceiling(first))
        for label in procs:
            w = ask(label, "load")["wall"]
            walls[label].append(w)
            ratios[label].append(ceil[-1] / w)
        print(f"round {r}: ceiling {ceil[-1]:.3f} s, " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in walls.items()),
              flush=True)
    print(f"{a.params} parameters ({4 * a.params} tensors), medians of {a.rounds} rounds: ceiling "
          f"{statistics.median(ceil):.3f} s")
    for label in procs:
        print(f"  {label}: load {statistics.median(walls[label]):.3f} s, {statistics.median(ratios[label]):.2f}x "
              f"the ceiling")
    for w in procs.values():
        w.close()
    subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
