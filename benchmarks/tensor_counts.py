"""At the disk's ceiling with any number of tensors? 256 MiB as 64 and as 10,000 tensors (a
nested dict), in interleaved rounds with the disk's ceiling (the built-in O_DIRECT loop, same
bytes): a fresh checkpointer's first save, its second save (both durable) and a cold load
(files evicted first). Medians of GB/s and of per-round ratios to the ceiling
(gdswriter/tools/bench.py ``run_counts``, as ``gdswriter bench`` shows it).

``--profile N``: instead, profile a first and a second save of N tensors (cProfile, per
thread: the calling thread, the save thread, the pool's copier and the writers; the save
thread is let go idle before each, so that a new one starts under the profiler) and a load,
and print the top entries of each by own time.

    .venv/bin/python benchmarks/tensor_counts.py [--counts 64,10000] [--size 256M] [--rounds 3] [--dir D]
    .venv/bin/python benchmarks/tensor_counts.py --profile 10000 [--top 15]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402,F401

from gdswriter import GDSCheckpointer  # noqa: E402
from gdswriter.save.pool import release_kept_pool  # noqa: E402
from gdswriter.save.queue import WORKER_IDLE_S  # noqa: E402
from gdswriter.tools.bench import run_counts, tensor_state  # noqa: E402
from gdswriter.units import parse_size  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="64,10000", help="tensor counts (default 64,10000)")
    ap.add_argument("--size", default="256M", help="bytes of state for every count (default 256M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds to wait after a sync before a cold load")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="also print every round's figures as JSON")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="profile N tensors' saves and load instead")
    ap.add_argument("--top", type=int, default=15, help="entries per profile (default 15)")
    a = ap.parse_args()
    size = parse_size(a.size)
    if a.profile:
        profile(a.profile, size, a.top, a.dir)
        return
    counts = [int(x) for x in a.counts.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        result = run_counts(Path(d), counts=counts, size=size, rounds=a.rounds, settle_s=a.settle)
    for line in result.table():
        print(line)
    if a.json:
        print(json.dumps(result.to_json()))


if __name__ == "__main__":
    main()
