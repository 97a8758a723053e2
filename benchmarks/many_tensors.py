"""Per-tensor costs: a state of N tensors (a ParameterList and its SGD-momentum state, N/2 each),
saved and loaded by gdswriter, torch.save/torch.load and DCP; and a small (16 MiB) checkpoint's load.

For each N (default 1,000 / 10,000 / 100,000; --size bytes in all), in interleaved rounds:
``save_async`` return time (--async-repeats calls per round), split into the objects' own
``state_dict()`` calls (SaveStats.state_dict_s, measured apart where an older gdswriter lacks
it) and gdswriter's own work (its median and min: ``--async-repeats 5`` gives five warm calls in a
row, a training loop's steady state);
a durable save (``save()``; torch.save + fsync; dcp.save with sync_files) and a cold load
(files evicted first) into the live model and optimizer (``load()``; torch.load + both
load_state_dict; dcp.load + the optimizer's load_state_dict). Then the 16 MiB load: a cold
``GDSCheckpointer(...).load()`` of a fresh checkpointer (what a job that resumes does) against
torch.load and dcp.load. Medians of the rounds, in ms or s.

    .venv/bin/python benchmarks/many_tensors.py [--counts 1000,10000,100000] [--size 256M] [--rounds 2]
                                                [--async-repeats 3] [--small 16M] [--no-dcp] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402

from gdswriter import GDSCheckpointer  # noqa: E402
from gdswriter.units import human, parse_size  # noqa: E402


def build(n_tensors: int, nbytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    n = max(1, n_tensors // 2)
    per = max(1, nbytes // 4 // (2 * n))
    g = torch.Generator().manual_seed(n)
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per, generator=g)) for _ in range(n)])
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Cases:
    """One N: every method's save and cold load, and where its files are."""

    def __init__(self, work: Path, model, opt, dcp: bool):
        self.work, self.model, self.opt = work, model, opt
        self.methods = ["gdswriter", "torch"] + (["dcp"] if dcp else [])
        self.ck = GDSCheckpointer(model, opt, work / "gds")
        self.step = 0

    def save(self, m: str) -> float:
        _util.quiesce()
        t = time.perf_counter()
        if m == "gdswriter":
            self.step += 1
            self.ck.save(self.step)
        elif m == "torch":
            p = self.work / "state.pt"
            with open(p, "wb") as f:
                torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()},
                         storage_writer=dcp.FileSystemWriter(self.work / f"dcp{self.step}-{time.time_ns()}",
                                                             thread_count=4, sync_files=True))
        return time.perf_counter() - t

    def files(self, m: str) -> Path:
        if m == "gdswriter":
            return self.work / "gds"
        if m == "torch":
            return self.work / "state.pt"
        return max(self.work.glob("dcp*"), key=lambda p: p.stat().st_mtime)

    def load(self, m: str, settle: float) -> float:
        _util.settle(settle)
        _util.evict(self.files(m))
        t = time.perf_counter()
        if m == "gdswriter":
            self.ck.load(self.step)
        elif m == "torch":
            st = torch.load(self.files(m), weights_only=True)
            self.model.load_state_dict(st["model"])
            self.opt.load_state_dict(st["optimizer"])
        else:
            import torch.distributed.checkpoint as dcp

            sd = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, storage_reader=dcp.FileSystemReader(self.files(m)))
            self.opt.load_state_dict(sd["optimizer"])
        return time.perf_counter() - t

    def clear(self, m: str) -> None:
        if m == "gdswriter":
            for s in self.ck.steps():
                self.ck.protocol.delete_step(s)
        else:
            for p in self.work.glob("dcp*" if m == "dcp" else "state.pt"):
                _util.remove(p)

    def save_async(self) -> tuple[float, float]:
        """(seconds save_async took, of which state_dict() calls)."""
        self.step += 1
        self.ck.wait()  # the last save's background work (retention) is done
        t = time.perf_counter()
        h = self.ck.save_async(self.step)
        took = time.perf_counter() - t
        h.result()
        sd = getattr(h.stats, "state_dict_s", None)
        if sd is None:  # an older gdswriter: time the same calls apart
            t = time.perf_counter()
            self.model.state_dict(), self.opt.state_dict()
            sd = time.perf_counter() - t
        return took, sd


def many(args, work: Path) -> None:
    print(f"{human(args.size)} as N tensors (ParameterList + SGD momentum), median of {args.rounds} interleaved "
          f"round(s) (save_async: of {args.rounds * args.async_repeats} calls); save = durable, load = cold, into the "
          f"live model and optimizer")
    print("| N | save_async returns (own + state_dict) | own: median (min) | gdswriter save | gdswriter load | "
          + ("DCP save / load | " if not args.no_dcp else "") + "torch.save / torch.load |")
    print("|---:|---:|---:|---:|---:|---:|" + ("---:|" if not args.no_dcp else ""))
    for n in args.counts:
        model, opt = build(n, args.size)
        d = work / f"n{n}"
        d.mkdir()
        cases = Cases(d, model, opt, not args.no_dcp)
        save: dict[str, list[float]] = {m: [] for m in cases.methods}
        load: dict[str, list[float]] = {m: [] for m in cases.methods}
        ret, own = [], []
        try:
            cases.ck.save(0)  # the steady state: layout, plan, pool and engines are there
            cases.clear("gdswriter")
            for r in range(args.rounds):
                for _ in range(args.async_repeats):
                    took, sd = cases.save_async()
                    ret.append(took)
                    own.append(took - sd)
                cases.clear("gdswriter")
                k = r % len(cases.methods)
                for m in cases.methods[k:] + cases.methods[:k]:
                    save[m].append(cases.save(m))
                    load[m].append(cases.load(m, args.settle))
                    cases.clear(m)
        finally:
            cases.ck.close()
            _util.remove(d)
        med = statistics.median
        row = [f"{n:,}", f"{med(ret) * 1e3:.1f} ms ({med(own) * 1e3:.1f} + {(med(ret) - med(own)) * 1e3:.1f})",
               f"{med(own) * 1e3:.1f} ({min(own) * 1e3:.1f}) ms",
               f"{med(save['gdswriter']):.2f} s", f"{med(load['gdswriter']):.2f} s"]
        if not args.no_dcp:
            row.append(f"{med(save['dcp']):.2f} / {med(load['dcp']):.2f} s")
        row.append(f"{med(save['torch']):.2f} / {med(load['torch']):.2f} s")
        print("| " + " | ".join(row) + " |", flush=True)


def small(args, work: Path) -> None:
    """The small checkpoint: a fresh checkpointer's cold load against torch.load and dcp.load."""
    state = {f"w{i}": torch.randn(args.small // 4 // 4) for i in range(4)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    root = work / "small"
    with GDSCheckpointer(state, None, root) as ck:
        ck.save(1)
    torch.save(state, work / "small.pt")
    fsync_file(work / "small.pt")
    methods = ["gdswriter", "torch"] + ([] if args.no_dcp else ["dcp"])
    if not args.no_dcp:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(work / "small-dcp", sync_files=True))
    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(max(3, args.rounds)):
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            path = {"gdswriter": root, "torch": work / "small.pt", "dcp": work / "small-dcp"}[m]
            _util.settle(args.settle)
            _util.evict(path)
            t = time.perf_counter()
            if m == "gdswriter":
                with GDSCheckpointer(state, None, root) as ck:
                    ck.load()
            elif m == "torch":
                got = torch.load(path, weights_only=True)
                for k2, v in got.items():
                    state[k2].copy_(v)
            else:
                import torch.distributed.checkpoint as dcp

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
            times[m].append(time.perf_counter() - t)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"\n{human(nbytes)} checkpoint, cold load into live tensors, median of {max(3, args.rounds)} rounds "
          f"(gdswriter: a fresh GDSCheckpointer(...).load()):")
    for m in methods:
        print(f"  {m:10s} {med[m] * 1e3:7.1f} ms  ({med[m] / med['torch']:.2f}x torch.load)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1000,10000,100000", help="tensor counts N (default 1000,10000,100000)")
    ap.add_argument("--size", default="256M", help="bytes of state for every N (default 256M)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--async-repeats", type=int, default=3,
                    help="save_async calls per round (the medians are over all of them; default 3)")
    ap.add_argument("--small", default="16M", help="the small checkpoint's size (default 16M)")
    ap.add_argument("--no-dcp", action="store_true", help="leave DCP out (slow at 100,000 tensors)")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds to wait after sync before each cold load")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    args.counts = [int(x) for x in args.counts.split(",") if x.strip()]
    args.size, args.small = parse_size(args.size), parse_size(args.small)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        many(args, Path(d))
        small(args, Path(d))


if __name__ == "__main__":
    main()
