"""At the disk's ceiling with any number of tensors, and ahead of FastPersist? 256 MiB as 64,
10,000 and 100,000 tensors (a nested dict), in interleaved rounds with the disk's ceiling (the
built-in O_DIRECT loop, same bytes): gdswriter (a fresh checkpointer's first save, its second
save, both durable, and a cold load), DeepSpeed's FastPersist (``torch.save`` into its
FastFileWriter over libaio, as its fast checkpoint engine does, + fsync; loaded with torch.load),
torch.save + fsync, and optionally DCP. Medians of GB/s and of per-round ratios to the ceiling
(gdswriter/tools/bench.py ``run_counts``, as ``gdswriter bench`` shows gdswriter's part).
FastPersist is skipped with the reason where DeepSpeed or its async_io op cannot be built
(libaio-dev); the op JIT-compiles on first use (about a minute, before the first round).

``--tree LABEL=PATH`` (repeatable): gdswriter from each of these checkouts instead of this
one, each in a worker process (PYTHONPATH=PATH) driven round by round, interleaved with the
rest: before / after in one command (``--tree before=/work/main --tree after=.``).

``--device cuda``: the state on the GPU (FastPersist's own setting: torch.save copies each
tensor to the host; gdswriter saves from the device).

``--profile N``: instead, profile a first and a second save of N tensors (cProfile, per
thread: the calling thread, the save thread, the pool's copier and the writers; the save
thread is let go idle before each, so that a new one starts under the profiler) and a load,
and print the top entries of each by own time.

``--async-call N``: instead, the time ``save_async`` takes to return at N tensors (a
ParameterList and its SGD-momentum state, N/2 each, so every tensor is guarded by the
optimizer's step hook: a training loop's save) against the goal of 10 ms of gdswriter's own
work: every call's return time, its objects' ``state_dict()`` calls (SaveStats.state_dict_s)
and the rest, gdswriter's own; medians and min of ``--rounds`` x 5 calls, each after the last
save finished. Compare checkouts by running it with each one on PYTHONPATH.

The issue's table, before and after, in one command:

    .venv/bin/python benchmarks/tensor_counts.py --counts 64@2G,10000,100000 --tree before=/work/main --tree after=.

    .venv/bin/python benchmarks/tensor_counts.py [--counts 64,10000,100000] [--size 256M] [--rounds 3]
        [--compare deepspeed,torch[,dcp]] [--device cpu|cuda] [--tree LABEL=PATH ...] [--dir D] [--json]
    .venv/bin/python benchmarks/tensor_counts.py --profile 10000 [--top 15]
    .venv/bin/python benchmarks/tensor_counts.py --async-call 10000 [--size 256M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker() -> None:
    """``--worker``: gdswriter's rounds for a parent run, with the gdswriter on PYTHONPATH (another
    checkout's) measured by this checkout's harness (bench.py's ``gdswriter_counts_round``,
    loaded into that gdswriter package). One JSON request per stdin line, one "RESULT" line back."""
    import importlib.util

    import gdswriter.tools  # the package the harness's relative imports resolve in

    tree = Path(os.environ["PYTHONPATH"]).resolve()
    if not Path(gdswriter.tools.__file__).resolve().is_relative_to(tree):
        sys.exit(f"tensor_counts.py --worker: gdswriter comes from {gdswriter.tools.__file__}, not from {tree}")
    print(f"worker: gdswriter from {Path(gdswriter.tools.__file__).parent.parent}", file=sys.stderr, flush=True)
    spec = importlib.util.spec_from_file_location("gdswriter.tools.bench_harness",
                                                  HERE.parent / "gdswriter" / "tools" / "bench.py")
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness
    spec.loader.exec_module(harness)
    state, key = None, None
    for line in sys.stdin:
        req = json.loads(line)
        if key != (req["count"], req["size"]):
            state, key = None, (req["count"], req["size"])
            state = harness.tensor_state(req["count"], req["size"], req["device"])
        got = harness.gdswriter_counts_round(state, Path(req["root"]), settle_s=req["settle"])
        print("RESULT " + json.dumps(got), flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    worker()
    sys.exit(0)

sys.path.insert(0, str(HERE))
import _util  # noqa: E402

from gdswriter import GDSCheckpointer  # noqa: E402
from gdswriter.save.pool import release_kept_pool  # noqa: E402
from gdswriter.save.queue import WORKER_IDLE_S  # noqa: E402
from gdswriter.tools.bench import run_counts, state_nbytes, tensor_state  # noqa: E402
from gdswriter.units import parse_size  # noqa: E402


class TreeWorker(_util.TreeWorker):
    """gdswriter's rounds from another checkout: a ``--worker`` process with PYTHONPATH=tree,
    called as run_counts's round function (state, root) -> GB/s per case."""

    def __init__(self, tree: Path, settle_s: float, device: str) -> None:
        if not (tree / "gdswriter" / "__init__.py").is_file():
            sys.exit(f"--tree {tree}: not a gdswriter checkout (no gdswriter/__init__.py there)")
        super().__init__(__file__, tree)
        self.settle_s, self.device = settle_s, device

    def __call__(self, state: dict, root: Path) -> dict[str, float]:
        count = sum(len(g) for g in state.values())  # the same state again: tensor_state(count, its bytes)
        req = {"count": count, "size": state_nbytes(state), "root": str(root), "settle": self.settle_s, "device": self.device}
        return self.ask(json.dumps(req))


class ThreadProfiles:
    """cProfile in every thread started while it is on (threading.setprofile), one profile per
    thread name, plus the calling thread's own; ``report`` prints each one's top entries."""

    def __init__(self) -> None:
        self.profiles: dict[str, list[cProfile.Profile]] = {}
        self.lock = threading.Lock()

    def _hook(self, frame, event, arg):  # the first event of a new thread: its own profiler takes over
        prof = cProfile.Profile()
        with self.lock:
            self.profiles.setdefault(threading.current_thread().name, []).append(prof)
        prof.enable()

    def __enter__(self) -> ThreadProfiles:
        threading.setprofile(self._hook)
        self.main = cProfile.Profile()
        self.main.enable()
        return self

    def __exit__(self, *exc) -> None:
        self.main.disable()
        threading.setprofile(None)  # type: ignore[arg-type]

    def report(self, title: str, top: int) -> None:
        groups = {"calling thread": [self.main], **self.profiles}
        for name, profs in groups.items():
            s = io.StringIO()
            stats = pstats.Stats(profs[0], stream=s)
            for p in profs[1:]:
                stats.add(p)
            if stats.total_tt < 0.005:
                continue
            stats.sort_stats("tottime").print_stats(top)
            body = s.getvalue()
            print(f"--- {title}: {name} ({len(profs)} thread(s), {stats.total_tt:.3f} s profiled)")
            print("\n".join(line for line in body.splitlines()[body.splitlines().index(next(
                ln for ln in body.splitlines() if "ncalls" in ln)):] if line.strip()))


def profile(n: int, size: int, top: int, directory: str | None) -> None:
    state = tensor_state(n, size)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        release_kept_pool()
        for what in ("first save", "second save", "load"):
            if what == "first save":
                ck = GDSCheckpointer(state, None, Path(d) / "gds")
            else:  # the save thread ends when idle: the next save starts one the profiler sees
                ck.wait()
                time.sleep(WORKER_IDLE_S + 1)
            _util.quiesce()
            with ThreadProfiles() as prof:
                t = time.perf_counter()
                if what == "load":
                    ck.load(2)
                else:
                    ck.save(1 if what == "first save" else 2)
                took = time.perf_counter() - t
            print(f"=== {what} of {n:,} tensors ({size / 1e9:.2f} GB): {took:.3f} s, "
                  f"{size / took / 1e9:.2f} GB/s (with the profiler's overhead)")
            prof.report(what, top)
        ck.close()


ASYNC_GOAL_S = 0.010  # the goal: save_async under 10 ms of its own work at 10,000 tensors


def async_call(n: int, size: int, rounds: int, directory: str | None) -> None:
    """Print save_async's return time at ``n`` tensors (see ``--async-call``)."""
    import statistics

    import torch

    half = max(1, n // 2)
    g = torch.Generator().manual_seed(half)
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(max(1, size // 4 // n), generator=g))
                                     for _ in range(half)])
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    took, own = [], []
    with tempfile.TemporaryDirectory(dir=directory) as d:
        with GDSCheckpointer(params, opt, Path(d) / "gds", keep_last=2) as ck:
            ck.save(0)  # the first save lays out and reserves; a training loop's calls come after it
            for step in range(1, rounds * 5 + 1):
                ck.wait()
                _util.quiesce()
                t = time.perf_counter()
                h = ck.save_async(step)
                took.append(time.perf_counter() - t)
                h.result()
                own.append(took[-1] - (getattr(h.stats, "state_dict_s", None) or 0.0))
                opt.step()  # the step hook waits for the save's snapshot, as in training
    med = statistics.median(own)
    print(f"save_async at {2 * half:,} tensors ({size / 1e6:.0f} MB), {len(took)} calls: returns in "
          f"{statistics.median(took) * 1e3:.2f} ms (median; min {min(took) * 1e3:.2f}), gdswriter's own "
          f"{med * 1e3:.2f} ms (min {min(own) * 1e3:.2f}); goal < {ASYNC_GOAL_S * 1e3:.0f} ms: "
          f"{'met' if med < ASYNC_GOAL_S else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="64,10000,100000",
                    help="tensor counts, each with @SIZE where not --size, e.g. 64@2G,10000 (default 64,10000,100000)")
    ap.add_argument("--size", default="256M", help="bytes of state for every count (default 256M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", default="deepspeed,torch",
                    help="methods beside gdswriter, from deepspeed,torch,dcp (default deepspeed,torch; '' none)")
    ap.add_argument("--device", default="cpu", help="where the state lives (cpu, cuda)")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="measure gdswriter from this checkout (repeatable), in a worker process each")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds to wait after a sync before a cold load")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="also print every round's figures as JSON")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="profile N tensors' saves and load instead")
    ap.add_argument("--top", type=int, default=15, help="entries per profile (default 15)")
    ap.add_argument("--async-call", type=int, default=0, metavar="N",
                    help="time save_async's return at N tensors instead (goal: under 10 ms of its own)")
    a = ap.parse_args()
    size = parse_size(a.size)
    if a.async_call:
        async_call(a.async_call, size, a.rounds, a.dir)
        return
    if a.profile:
        profile(a.profile, size, a.top, a.dir)
        return
    counts = [int(x.partition("@")[0]) for x in a.counts.split(",") if x.strip()]
    sizes = {int(x.partition("@")[0]): parse_size(x.partition("@")[2]) for x in a.counts.split(",") if "@" in x}
    compare = [m.strip() for m in a.compare.split(",") if m.strip()]
    workers = {}
    try:
        for t in a.tree:
            label, _, path = t.partition("=")
            workers[label] = TreeWorker(Path(path).resolve(), a.settle, a.device)
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            result = run_counts(Path(d), counts=counts, size=size, rounds=a.rounds, settle_s=a.settle,
                                compare=compare, device=a.device, trees=workers or None, sizes=sizes,
                                step=lambda note: print(f"  done: {note}", file=sys.stderr, flush=True))
    finally:
        for w in workers.values():
            w.close()
    for line in result.table():
        print(line)
    if a.json:
        print(json.dumps(result.to_json()))


if __name__ == "__main__":
    main()
