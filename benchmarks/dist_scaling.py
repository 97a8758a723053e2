"""Multi-rank save scaling: gdswriter's parallel writes against DCP's FileSystemWriter.

For 1, 2 and 4 ranks (processes joined by gloo on 127.0.0.1) holding one replicated state
(DDP: every rank has the same tensors), and one or two roots (directories standing for SSDs;
every rank is given all of them), measure:

  gdswriter      GDSCheckpointer.save(step): collective; the replicated bytes are split across
                 the ranks (planner/ranks.py), each rank writes its share to every root. One
                 checkpointer serves every round (as in training: its engines and buffers exist
                 before the first timed save); load() reads back into the live state. Ranks
                 on one host copy the pieces they did not read from each other's memory
                 (DistOptions.load_cross_memory, distributed/crossmem.py)
  gdswriter-tmpfs  the same with load_cross_memory=False: ranks on one host share what they
                 read through /dev/shm (DistOptions.load_share_dir), the default until then
  gdswriter-relay  the same with neither: the replicated pieces each rank read travel to the
                 others over gloo, as they do between hosts
  gdswriter-dcp  dcp.save through GDSStorageWriter (the same split and commit, DCP's planning),
                 a new writer for each save (as FileSystemWriter is used): it opens its roots
  dcp-kept       the same through one GDSStorageWriter kept for all rounds (a step each), as a
                 training job keeps one: its roots are opened and its engines built by a first,
                 untimed save, so each timed save is DCP's collectives plus the writes and commit
  dcp-node-local the same with node-local roots: each rank is given directories of its own (as
                 one SSD per node), so every rank but 0 leads a secondary root it publishes
  dcp-resave     the same, re-saving one committed step every round (overwrite=True): each rank
                 but 0 writes beside the committed step on its own roots, with no vote
                 (distributed/commit.py OrderedCommit); compare with dcp-node-local
  dcp-fs         dcp.save(FileSystemWriter(dir, sync_files=True)): DCP gives each replicated
                 tensor, whole, to one rank; it takes one directory, so it runs with one root

Every save is durable when it returns (fdatasync/fsync; gdswriter also commits atomically). A
round: fresh directories, a barrier, the timed save on every rank, a barrier; the time is the
slowest rank's. Aggregate bandwidth = state bytes / that time. "bytes/rank" is what each rank
wrote (min..max). Load: the files are evicted from the page cache, then every rank loads the
whole replicated state (GDSCheckpointer.load / dcp.load with each writer's reader), timed the
same way. Rounds are interleaved across the cases (round 1 of each case, then round 2...), so
the disk's drift from minute to minute hits every case alike; the table shows the median and
the spread (min..max) of the load times.

    python benchmarks/dist_scaling.py --size 256M --ranks 1,2,4 --roots 1,2 --rounds 3 [--json out.json]

Use a directory on the disks to measure (--dir; default benchmarks/.bench-tmp/). What a
machine shows depends on what limits it: with one disk and two cores, more ranks add CPU for
copying and checksumming but share one device, so the aggregate stops growing once the disk
is saturated.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CASES = ("gdswriter", "gdswriter-tmpfs", "gdswriter-relay", "gdswriter-dcp", "dcp-kept", "dcp-node-local",
         "dcp-resave", "dcp-fs")


def make_state(nbytes: int) -> dict:
    """A model-like replicated state of about ``nbytes``: one large embedding (35%), eight
    layers of weights (8%) and small biases; the same on every rank (seeded)."""
    import torch

    g = torch.Generator().manual_seed(0)
    words = nbytes // 4
    state = {"emb": torch.randn(int(words * 0.35), generator=g)}
    for i in range(8):
        state[f"layers.{i}.w"] = torch.randn(int(words * 0.08), generator=g)
        state[f"layers.{i}.b"] = torch.randn(1000 + i, generator=g)
    return state


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _evict(dirs) -> None:
    from gdswriter.tools import pagecache

    for d in dirs:
        for base, _, files in os.walk(d):
            for f in files:
                pagecache.evict(os.path.join(base, f))


def _timed(fn, *args, **kwargs) -> float:
    """Run ``fn(*args, **kwargs)`` on every rank between barriers; the slowest rank's seconds."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn(*args, **kwargs)
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rank_bytes(dirs, pattern: str) -> int:
    return sum(f.stat().st_size for d in dirs for f in Path(d).rglob(pattern))


def _save_bytes(dirs, rank: int) -> int:
    """The bytes of this rank's data files of the newest save in ``dirs`` (a re-saved step's
    directory may also hold the files of the save before: distributed/commit.py OrderedCommit)."""
    from gdswriter.distributed.rankfiles import save_tag

    saves: dict = {}
    for d in dirs:
        for f in Path(d).glob(f"data-rank{rank}-*"):
            st = f.stat()
            got = saves.setdefault(save_tag(f.name), [0, 0])
            got[0] += st.st_size
            got[1] = max(got[1], st.st_mtime_ns)
    return max(saves.values(), key=lambda x: x[1])[0] if saves else 0


def _close_kept(kept, dirs, rank: int, own: bool = False) -> None:
    """After a kept checkpointer's or writer's last round: close it, then remove its roots
    (``own``: each rank has roots of its own)."""
    import torch.distributed as dist

    kept.close()
    dist.barrier()
    if rank == 0 or own:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def _gather_bytes(n: int) -> list[int]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([n]))
    return [int(x) for x in out]


def _round(run: dict, case: str, nroots: int, rnd: int, rounds: int, rank: int, world: int, base: str, state: dict,
           target: dict, reference: dict) -> None:
    """One round of ``case``: a save and a load, their times appended to ``run``, which also
    keeps the case's checkpointer or writer from round to round ("ck")."""
    import torch.distributed.checkpoint  # noqa: F401 - imported before any timed save, whichever case runs first

    import gdswriter.distributed  # noqa: F401
    if case in ("gdswriter", "gdswriter-tmpfs", "gdswriter-relay"):
        _round_checkpointer(run, case, nroots, rnd, rounds, rank, world, base, state, reference)
    elif case in ("dcp-kept", "dcp-node-local", "dcp-resave"):
        _round_kept_writer(run, case, nroots, rnd, rounds, rank, world, base, state, target)
    else:
        _round_fresh(run, case, nroots, rnd, rank, world, base, state, target)


def _round_checkpointer(run: dict, case: str, nroots: int, rnd: int, rounds: int, rank: int, world: int, base: str,
                        state: dict, reference: dict) -> None:
    """A round of a GDSCheckpointer case: one checkpointer for all rounds, as a training job keeps
    one (its engines and buffers are made before the first timed save); loads into the live state."""
    import torch
    import torch.distributed as dist

    from gdswriter import CheckpointOptions, GDSCheckpointer
    from gdswriter.distributed import DistOptions
    from gdswriter.format.commit import step_dir_name

    saves, loads, mine, ck = run["saves"], run["loads"], run["mine"], run["ck"]
    if ck is None:
        dirs = [os.path.join(base, f"w{world}-r{nroots}-{case}-root{i}") for i in range(nroots)]
        share = {"gdswriter": {}, "gdswriter-tmpfs": {"load_cross_memory": False},
                 "gdswriter-relay": {"load_share_dir": None, "load_cross_memory": False}}[case]
        ck = run["ck"] = GDSCheckpointer(state, root=dirs, options=CheckpointOptions(keep_last=1),
                                         dist_options=DistOptions(**share))
        _ = ck.engine_info  # the engines exist before the timed rounds
    dirs = [str(r) for r in ck.protocol.roots]
    saves.append(_timed(ck.save, rnd))
    ck.wait()  # retention (keep_last=1) has deleted the previous round's step
    step_dirs = [os.path.join(d, step_dir_name(rnd)) for d in dirs]
    # one process writes data-r<root>-f<k>.bin (the single-process path)
    mine.append(_rank_bytes(step_dirs, f"data-rank{rank}-*" if world > 1 else "data-*"))
    dist.barrier()
    if rank == 0:
        _evict(step_dirs)
    for t in state.values():
        t.zero_()
    loads.append(_timed(ck.load, rnd))  # into the live state, as a resumed job does
    assert all(torch.equal(state[k], v) for k, v in reference.items()), f"{case}: load differs"
    dist.barrier()
    if rnd == rounds - 1:
        _close_kept(ck, dirs, rank)


def _round_kept_writer(run: dict, case: str, nroots: int, rnd: int, rounds: int, rank: int, world: int, base: str,
                       state: dict, target: dict) -> None:
    """A round of a dcp case with one GDSStorageWriter kept for all rounds: on shared roots
    (dcp-kept), on each rank's own (dcp-node-local), or saving the same step again (dcp-resave)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter
    from gdswriter.format.commit import step_dir_name

    saves, loads, mine, ck = run["saves"], run["loads"], run["mine"], run["ck"]
    own = case != "dcp-kept"  # each rank its own roots
    dirs = [os.path.join(base, f"w{world}-r{nroots}-{case}{f'-rank{rank}' if own else ''}-root{i}")
            for i in range(nroots)]
    step = 0 if case == "dcp-resave" else rnd
    if ck is None:
        ck = run["ck"] = GDSStorageWriter(dirs)
        # opens the roots, builds engines (and commits the step dcp-resave saves again)
        dcp.save(state, storage_writer=ck, checkpoint_id=0 if case == "dcp-resave" else rounds)
    saves.append(_timed(dcp.save, state, storage_writer=ck, checkpoint_id=step))
    step_dirs = [os.path.join(d, step_dir_name(step)) for d in dirs]
    mine.append(_save_bytes(step_dirs, rank))
    if rank == 0 or own:
        _evict(step_dirs)
    loads.append(_timed(dcp.load, target, storage_reader=GDSStorageReader(dirs, step)))
    assert all(torch.equal(target[k], v) for k, v in state.items()), f"{case}: load differs"
    for t in target.values():
        t.zero_()
    dist.barrier()
    if rnd == rounds - 1:
        _close_kept(ck, dirs, rank, own)
    dist.barrier()


def _round_fresh(run: dict, case: str, nroots: int, rnd: int, rank: int, world: int, base: str, state: dict,
                 target: dict) -> None:
    """A round of a case that keeps nothing between rounds (gdswriter-dcp: a new GDSStorageWriter;
    dcp-fs: DCP's own FileSystemWriter); its directories are removed afterwards."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter

    saves, loads, mine = run["saves"], run["loads"], run["mine"]
    dirs = [os.path.join(base, f"w{world}-r{nroots}-{case}-{rnd}-root{i}") for i in range(nroots)]
    if case == "gdswriter-dcp":
        saves.append(_timed(dcp.save, state, storage_writer=GDSStorageWriter(dirs, rnd)))
        mine.append(_rank_bytes(dirs, f"data-rank{rank}-*"))
        if rank == 0:
            _evict(dirs)
        loads.append(_timed(dcp.load, target, storage_reader=GDSStorageReader(dirs, rnd)))
    else:
        saves.append(_timed(dcp.save, state,
                            storage_writer=FileSystemWriter(dirs[0], sync_files=True)))
        mine.append(_rank_bytes(dirs, f"__{rank}_*.distcp"))
        if rank == 0:
            _evict(dirs)
        loads.append(_timed(dcp.load, target, storage_reader=FileSystemReader(dirs[0])))
    assert all(torch.equal(target[k], v) for k, v in state.items()), f"{case}: load differs"
    for t in target.values():
        t.zero_()
    dist.barrier()
    if rank == 0:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()


def worker(rank: int, world: int, port: int, base: str, size: int, roots_list: list[int], rounds: int,
           result_path: str, cases: tuple[str, ...] = CASES) -> None:
    try:
        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        state = make_state(size)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        reference = {k: v.clone() for k, v in state.items()}
        results: dict = {"bytes": state_bytes(state), "cases": {}}
        for nroots in roots_list:
            todo = [c for c in cases if not (c == "dcp-fs" and nroots > 1)]
            runs = {c: {"saves": [], "loads": [], "mine": [], "ck": None} for c in todo}
            for rnd in range(rounds):  # rounds interleaved across the cases: the disk's drift hits them alike
                for case in todo:
                    _round(runs[case], case, nroots, rnd, rounds, rank, world, base, state, target, reference)
            for case, r in runs.items():
                results["cases"][f"{case}|{nroots}"] = {"save_s": r["saves"], "load_s": r["loads"],
                                                        "rank_bytes": _gather_bytes(int(statistics.median(r["mine"])))}
        if rank == 0:
            Path(result_path).write_text(json.dumps(results))
    except BaseException:  # noqa: BLE001 - reported, then the rank exits non-zero
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, base: Path, size: int, roots: list[int], rounds: int, cases: tuple[str, ...] = CASES) -> dict:
    result = base / f"result-{world}.json"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, str(base), size, roots, rounds, str(result), cases))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{world} ranks: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return json.loads(result.read_text())


def main(argv=None) -> int:
    from gdswriter.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64M", help="replicated state size (default 64M)")
    ap.add_argument("--ranks", default="1,2,4", help="rank counts (default 1,2,4)")
    ap.add_argument("--roots", default="1,2", help="root counts (default 1,2)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per case; the median is reported (default 2)")
    ap.add_argument("--dir", default=str(HERE / ".bench-tmp"), help="where the roots go")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--cases", default=",".join(CASES), help=f"which cases, comma-separated (default {','.join(CASES)})")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    ranks = [int(x) for x in args.ranks.split(",")]
    roots = [int(x) for x in args.roots.split(",")]
    cases = tuple(c for c in args.cases.split(",") if c)
    if not cases or any(c not in CASES for c in cases):
        ap.error(f"--cases: choose from {', '.join(CASES)}")
    base = Path(args.dir) / f"dist-scaling-{os.getpid()}"
    base.mkdir(parents=True)
    report: dict = {"size": size, "runs": {}}
    try:
        for world in ranks:
            report["runs"][world] = run(world, base, size, roots, args.rounds, cases)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"replicated state {size / 2**20:.0f} MiB, median of {args.rounds} round(s); GB/s = 1e9 bytes/s")
    print(f"{'ranks':>5} {'roots':>5}  {'case':<16} {'save s':>8} {'save GB/s':>10} {'bytes/rank MiB':>16} "
          f"{'load s':>8} {'load GB/s':>10} {'load min..max s':>16}")
    for world, res in report["runs"].items():
        total = res["bytes"]
        for key, c in res["cases"].items():
            case, nroots = key.split("|")
            s, ld = statistics.median(c["save_s"]), statistics.median(c["load_s"])
            per = c["rank_bytes"]
            span = f"{min(per) / 2**20:.1f}..{max(per) / 2**20:.1f}"
            spread = f"{min(c['load_s']):.3f}..{max(c['load_s']):.3f}"
            print(f"{world:>5} {nroots:>5}  {case:<16} {s:8.3f} {total / s / 1e9:10.2f} {span:>16} {ld:8.3f} "
                  f"{total / ld / 1e9:10.2f} {spread:>16}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
