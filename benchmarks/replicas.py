"""Replicas on peer nodes (DistOptions(replicas=2)): what they cost a save and a training loop.

For each world size (--ranks, default 2 and 4), processes joined by gloo on 127.0.0.1 stand for
nodes: each has its own root (``n<R>/``) and its own GDSWRITER_HOSTNAME. Every rank holds the
same state of --size bytes (replicated: each rank writes its share). Rounds are interleaved
(round 1 of every case, then round 2...), each case saving with a checkpointer kept for all
rounds (built, with its engines, by an untimed first save):

  no replicas     save(): time to committed, replicas=1
  replicas=2      save(): time to committed; then wait_protected(): time to protected, both from
                  the save's start
  local 2x bytes  save() of the state twice (the same total bytes a step with two replicas puts
                  on the drives), replicas=1: the local engine's time for those bytes

Times are the slowest rank's (an all_reduce of the maximum); medians of the rounds, and their
ratios within a round (medians). "drive bytes / state byte" counts the data files of the last
replicas=2 step (its own and its copies) over the state's tensor bytes.

Training: a small MLP with AdamW (its state about --train-size bytes) trains --iters iterations
and calls save_async every --every iterations, without a checkpointer (none), with replicas=1
and with replicas=2 (interleaved, --train-rounds each); the overhead is the mean step time
against none's, in points.

Restore (interleaved, --restore-rounds each, on the last replicas=2 step): every rank builds a
fresh checkpointer (what a restarted job does anyway: "set-up", timed on its own) and loads the
step into zeroed tensors, bit exact, with every root intact ("local load") and with node 1's root
replaced by an empty one ("from peers": node 1's files are read from their copy on a peer and
sent over gloo); each as state bytes per second of the slowest rank's load call (from a barrier
after the set-up to the load's end: the engines a first load builds included, alike in both).
Against, in the same rounds: gloo's loopback throughput (every rank sends the state's size to
the next rank and receives as much from the previous one, in PIECE_BYTES messages: bytes per
second of the slowest), and the local cold read (every rank reads its own data files of the step
with O_DIRECT, at once: the state's bytes per second of the slowest); the goal is a restore from
peers of at least 0.8x the slower of the two, round by round (medians). "read all, then send
all" is the same restore with fetch.STREAM_BYTES unbounded (one round: every chunk read before
any is sent, the schedule before the streaming), in the same rounds. "load(atomic=False)": the same
local load and load from peers with load(atomic=False) (bytes read and received straight into
the live tensors; the rows above stay atomic, the default), in the same rounds.

Restart to the first training step: fresh ranks are spawned (a new process group), each opens
the training loop's replicas=2 checkpointer, loads the newest step and trains one step; the
time from the spawn to the slowest rank's first step done, with every node intact and with
node 1 replaced by an empty root (interleaved, --train-rounds each).

Every simulated node shares this machine's disks and cores: a copy costs disk time here that it
would not on a cluster, where each node's NVMe writes only its own bytes.

    .venv/bin/python benchmarks/replicas.py [--size 256M] [--ranks 2,4] [--rounds 3] [--restore-rounds 3] [--dir D]
    .venv/bin/python benchmarks/replicas.py --restore-only [--size 256M] [--ranks 2,4] [--restore-rounds 5]
    .venv/bin/python benchmarks/replicas.py --saves-only [--profile] [--size 256M] [--ranks 2,4] [--rounds 3]

--saves-only: the save rounds alone (no restore, training or restart). --profile: each rank logs,
per step, where its replication spent its time (replicate.py, at debug: sources, sizes+headers,
copies dir, pipeline, trailers, publish, settle; and the pipeline's stages: read, wait read, wire,
write).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from gdswriter import DistOptions, GDSCheckpointer  # noqa: E402
from gdswriter.distributed import fetch  # noqa: E402
from gdswriter.distributed.replicastream import PIECE_BYTES  # noqa: E402
from gdswriter.engines.buffers import AlignedBufferPool  # noqa: E402
from gdswriter.format.commit import step_dir_name  # noqa: E402
from gdswriter.units import human, parse_size  # noqa: E402

TENSORS = 8
CASES = ("no replicas", "replicas=2", "local 2x bytes")


def make_state(nbytes: int, seed: int = 0) -> dict:
    n = max(nbytes // TENSORS // 4, 1)
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(TENSORS)}


def slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed_save(ck: GDSCheckpointer, step: int, protected: bool) -> dict:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    ck.save(step)
    committed = time.perf_counter() - t0
    out = {"committed": slowest(committed)}
    if protected:
        got = ck.wait_protected()
        assert got == step, (got, step)
        out["protected"] = slowest(time.perf_counter() - t0)
    return out


def _drive_bytes(base: Path, world: int, step: int) -> int:
    total = 0
    for r in range(world):
        d = base / f"n{r}" / step_dir_name(step)
        total += sum(p.stat().st_size for p in d.rglob("data-*") if p.is_file())
    return total


def _saves(rank: int, world: int, base: Path, size: int, rounds: int, restore_rounds: int) -> dict:
    state = make_state(size)
    twice = {"a": state, "b": {k: v.clone() for k, v in state.items()}}
    cks = {}
    for case in CASES:  # the same order on every rank (each checkpointer has a channel of its own)
        root = base / case.replace(" ", "-").replace("=", "") / f"n{rank}"
        cks[case] = GDSCheckpointer(twice if case == "local 2x bytes" else state, root=root, keep_last=1,
                                    dist_options=DistOptions(replicas=2 if case == "replicas=2" else 1))
        cks[case].save(0)  # engines, pools, plans
        if case == "replicas=2":
            cks[case].wait_protected()
    rows: dict = {c: [] for c in CASES}
    for r in range(1, rounds + 1):
        for case in CASES:
            rows[case].append(timed_save(cks[case], r, case == "replicas=2"))
    stored = 0
    if rank == 0:
        rep = base / "replicas2"
        stored = _drive_bytes(rep, world, rounds)
    for ck in cks.values():
        ck.close()
    out = {"rows": rows, "drive_bytes": stored, "state_bytes": sum(v.nbytes for v in state.values())}
    if restore_rounds:
        out["restore"] = _restores(rank, world, base / "replicas2", state, rounds, restore_rounds)
    return out


def _gloo_ring(rank: int, world: int, nbytes: int) -> float:
    """Seconds (slowest rank) for every rank to send ``nbytes`` to the next rank and receive as
    many from the previous one, in PIECE_BYTES messages, two in flight."""
    import torch.distributed as dist

    piece = min(PIECE_BYTES, nbytes)
    out, got = torch.ones(piece, dtype=torch.uint8), [torch.empty(piece, dtype=torch.uint8) for _ in range(2)]
    dist.barrier()
    t0 = time.perf_counter()
    works: list = []
    for k in range(-(-nbytes // piece)):
        if len(works) >= 4:
            for w in works[:2]:
                w.wait()
            works = works[2:]
        works += [dist.isend(out, (rank + 1) % world, tag=k), dist.irecv(got[k % 2], (rank - 1) % world, tag=k)]
    for w in works:
        w.wait()
    return slowest(time.perf_counter() - t0)


def _cold_read(root: Path, step: int) -> float:
    """Seconds (slowest rank) to read this rank's data files of ``step`` with O_DIRECT (cold:
    no page cache), every rank at once."""
    import torch.distributed as dist

    files = sorted(p for p in (root / step_dir_name(step)).glob("data-*") if p.is_file())
    pool = AlignedBufferPool(PIECE_BYTES, 1)
    view = pool.buffers[0].view
    dist.barrier()
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            off = 0
            while (k := os.preadv(fd, [view], off)) == len(view):  # a short read: the file's end
                off += k
        finally:
            os.close(fd)
    seconds = slowest(time.perf_counter() - t0)
    pool.close()
    return seconds


def _timed_load(rank: int, base: Path, state: dict, step: int, atomic: bool | None = None) -> dict:
    """A fresh replicas=2 checkpointer loads ``step`` into zeroed tensors, bit exact: seconds
    (slowest rank) of its set-up (the constructor) and of the load call (``atomic``: load's)."""
    import torch.distributed as dist

    live = {k: torch.zeros_like(v) for k, v in state.items()}
    dist.barrier()
    t0 = time.perf_counter()
    ck = GDSCheckpointer(live, root=base / f"n{rank}", dist_options=DistOptions(replicas=2))
    setup = slowest(time.perf_counter() - t0)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        got = ck.load(step, strict=False, atomic=atomic)
        seconds = slowest(time.perf_counter() - t0)
    finally:
        ck.close()
    assert got == step and all(torch.equal(live[k], v) for k, v in state.items()), "the load is not bit exact"
    return {"setup": setup, "load": seconds}


def _lose_node(base: Path, node: int, lost: bool) -> None:
    """Node ``node``'s root replaced by an empty one (``lost``), or put back."""
    root, kept = base / f"n{node}", base / f"n{node}.kept"
    if lost:
        root.rename(kept)
        root.mkdir()
    else:
        shutil.rmtree(root)
        kept.rename(root)


def _small_files(root: Path) -> dict[Path, bytes]:
    """Every file of ``root`` but the data files (manifests, shards, markers): what a refill
    rewrites (refill.py: the step's manifest names the replaced root afterwards)."""
    return {f: f.read_bytes() for f in root.rglob("*") if f.is_file() and not f.name.startswith("data-")}


def _restores(rank: int, world: int, base: Path, state: dict, step: int, rounds: int) -> dict:
    """Interleaved rounds of: gloo ring, cold read, local load, load with node 1 lost."""
    import torch.distributed as dist

    nbytes = sum(v.nbytes for v in state.values())
    out: dict = {"gloo": [], "cold read": [], "local load": [], "from peers": [], "from peers, one round": [],
                 "setup local": [], "setup peers": [], "local load, in place": [], "from peers, in place": []}
    # each load from peers refills node 1's empty root (closing the checkpointer waits for it) and
    # names it in the step's manifest: every round puts the roots back as they were saved
    kept = _small_files(base / f"n{rank}")
    for _ in range(rounds):
        out["gloo"].append(_gloo_ring(rank, world, nbytes))
        out["cold read"].append(_cold_read(base / f"n{rank}", step))
        t = _timed_load(rank, base, state, step)
        out["local load"].append(t["load"])
        out["setup local"].append(t["setup"])
        out["local load, in place"].append(_timed_load(rank, base, state, step, atomic=False)["load"])
        if rank == 1:
            _lose_node(base, 1, True)
        dist.barrier()
        t = _timed_load(rank, base, state, step)
        out["from peers"].append(t["load"])
        out["setup peers"].append(t["setup"])
        _put_back(rank, base, kept, lost=True)
        out["from peers, in place"].append(_timed_load(rank, base, state, step, atomic=False)["load"])
        _put_back(rank, base, kept, lost=True)
        fetch.STREAM_BYTES, streamed = 1 << 62, fetch.STREAM_BYTES  # every chunk read, then all sent (as before)
        try:
            out["from peers, one round"].append(_timed_load(rank, base, state, step)["load"])
        finally:
            fetch.STREAM_BYTES = streamed
        _put_back(rank, base, kept, lost=False)
    return out


def _put_back(rank: int, base: Path, kept: dict[Path, bytes], lost: bool) -> None:
    """Collective: every root as saved (``kept``: its small files), node 1's root empty again if
    ``lost``, else its own root back."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        shutil.rmtree(base / "n1")
        if lost:
            (base / "n1").mkdir()
        else:
            (base / "n1.kept").rename(base / "n1")
    else:
        for f, data in kept.items():
            f.write_bytes(data)
    dist.barrier()


def _model(train_size: int) -> tuple:
    """The training loop's MLP (two square layers: weights + 2 AdamW moments ~ ``train_size``),
    its optimizer and its input."""
    width = max(int((train_size / 4 / 3 / 2) ** 0.5), 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.randn(64, width)


def _train(rank: int, base: Path, train_size: int, iters: int, every: int, rounds: int) -> dict:
    """Mean step time of a small MLP + AdamW loop, per case (interleaved)."""
    import torch.distributed as dist

    model, opt, x = _model(train_size)
    cks = {c: GDSCheckpointer(model, opt, root=base / f"train-{c}" / f"n{rank}", keep_last=2,
                              dist_options=DistOptions(replicas=c)) for c in (1, 2)}
    for ck in cks.values():  # the first save builds the engines and the pool
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        ck.save(0)
    times: dict = {"none": [], "replicas=1": [], "replicas=2": []}
    step = 1
    for _ in range(rounds):
        for case in times:
            ck = cks.get(int(case[-1])) if case != "none" else None
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(iters):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                if ck is not None and i % every == every - 1:
                    ck.save_async(step)
                    step += 1
            elapsed = time.perf_counter() - t0
            if ck is not None:
                ck.wait()
                if case == "replicas=2":
                    ck.wait_protected()
            times[case].append(slowest(elapsed) / iters)
    for ck in cks.values():
        ck.close()
    state = sum(p.nbytes for p in model.parameters()) * 3
    return {"times": times, "train_state": state}


def _join(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))


def restart(rank: int, base: Path, a: dict, spawned: float) -> dict:
    """A restarted rank: open the training loop's replicas=2 checkpointer, load its newest step,
    train one step; the seconds from ``spawned`` (the parent's time.time() at the spawn)."""
    model, opt, x = _model(a["train_size"])
    with GDSCheckpointer(model, opt, root=base / "train-2" / f"n{rank}",
                         dist_options=DistOptions(replicas=2)) as ck:
        step = ck.load()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        seconds = slowest(time.time() - spawned)
    return {"step": step, "seconds": seconds}


def worker(rank: int, world: int, port: int, base: str, a: dict, spawned: float | None = None) -> None:
    try:
        import torch.distributed as dist

        _join(rank, world, port)
        if spawned is not None:
            out = restart(rank, Path(base), a, spawned)
        elif a.get("restore_only"):
            out = _restore_only(rank, world, Path(base), a["size"], a["restore_rounds"])
        else:
            if a.get("profile"):  # each step's replication phases, per rank (replicate.py logs them at debug)
                logging.basicConfig(format=f"rank {rank}: %(message)s")
                logging.getLogger("gdswriter").setLevel(logging.DEBUG)
            out = _saves(rank, world, Path(base), a["size"], a["rounds"], a["restore_rounds"])
            if not a.get("saves_only"):
                out.update(_train(rank, Path(base), a["train_size"], a["iters"], a["every"], a["train_rounds"]))
        if rank == 0:
            Path(base, "result.json").write_text(json.dumps(out))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - the parent reports it
        Path(base, f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _restore_only(rank: int, world: int, base: Path, size: int, rounds: int) -> dict:
    """--restore-only: one replicas=2 step (untimed), then the restore rounds alone."""
    state = make_state(size)
    with GDSCheckpointer(state, root=base / "replicas2" / f"n{rank}", dist_options=DistOptions(replicas=2)) as ck:
        ck.save(1)
        ck.wait_protected()
    return {"state_bytes": sum(v.nbytes for v in state.values()),
            "restore": _restores(rank, world, base / "replicas2", state, 1, rounds)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, base: Path, a: dict) -> dict:
    """The saves, restores and training loop; then the restarts (interleaved: intact, node 1 lost)."""
    res = spawn(world, base, a, None)
    if a.get("restore_only") or a.get("saves_only"):
        return res
    res["restart"] = {"intact": [], "node 1 lost": []}
    for _ in range(a["train_rounds"]):
        for case in res["restart"]:
            lost = case != "intact"
            if lost:
                _lose_node(base / "train-2", 1, True)
            res["restart"][case].append(spawn(world, base, a, time.time())["seconds"])
            if lost:
                _lose_node(base / "train-2", 1, False)
    return res


def spawn(world: int, base: Path, a: dict, spawned: float | None) -> dict:
    return spawn_ranks(worker, world, base, a, spawned)


def spawn_ranks(target, world: int, base: Path, *args) -> dict:
    """``target(rank, world, port, base, *args)`` in ``world`` fresh processes (benchmarks/parity.py
    too); the result.json rank 0 wrote, or SystemExit with the ranks' tracebacks."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(base), *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    errors = [(base / f"error-{r}.txt").read_text() for r in range(world) if (base / f"error-{r}.txt").exists()]
    if errors or any(p.exitcode for p in procs):
        raise SystemExit(f"{world} ranks failed:\n" + "\n".join(errors))
    return json.loads((base / "result.json").read_text())


def run_worlds(run_one, table_of, prefix: str, ranks: str, a: dict, where: str | None, json_path: str | None) -> dict:
    """For each world size of ``ranks`` ("2,4"): ``run_one(world, base, a)`` in a temporary
    directory (under ``where``; removed after), its ``table_of(world, result)`` printed; every
    result written to ``json_path`` if given (benchmarks/parity.py too). Returns them by world."""
    results = {}
    for world in [int(w) for w in ranks.split(",")]:
        base = Path(tempfile.mkdtemp(prefix=f"{prefix}-{world}-", dir=where))
        try:
            results[world] = run_one(world, base, a)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print("\n".join(table_of(world, results[world])), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results


def _ratio(rows: dict, a: tuple[str, str], b: tuple[str, str]) -> float:
    return statistics.median(x[a[1]] / y[b[1]] for x, y in zip(rows[a[0]], rows[b[0]]))


def table(world: int, res: dict) -> list[str]:
    if "rows" not in res:  # --restore-only
        return [f"{world} ranks, state {human(res['state_bytes'])} (every rank the same; each writes its share)",
                *restore_lines(res)]
    rows, mb = res["rows"], res["state_bytes"] / 1e6
    med = {(c, k): statistics.median(x[k] for x in rows[c]) for c in CASES for k in rows[c][0]}
    lines = [f"{world} ranks, state {human(res['state_bytes'])} (every rank the same; each writes its share)",
             f"  {'case':<16} {'committed s':>12} {'protected s':>12} {'MB/s (state)':>13}"]
    for c in CASES:
        prot = med.get((c, "protected"))
        lines.append(f"  {c:<16} {med[(c, 'committed')]:>12.3f} {'' if prot is None else f'{prot:.3f}':>12} "
                     f"{mb / (prot or med[(c, 'committed')]):>13.0f}")
    lines += [f"  time to committed, replicas=2 / no replicas:          "
              f"{_ratio(rows, ('replicas=2', 'committed'), ('no replicas', 'committed')):.2f}",
              f"  time to protected, replicas=2 / no replicas:          "
              f"{_ratio(rows, ('replicas=2', 'protected'), ('no replicas', 'committed')):.2f}",
              f"  time to protected / local engine, same total bytes:   "
              f"{_ratio(rows, ('replicas=2', 'protected'), ('local 2x bytes', 'committed')):.2f}  (goal <= 1.10)",
              f"  drive bytes / state byte (replicas=2, data files):    {res['drive_bytes'] / res['state_bytes']:.3f}"]
    if "times" not in res:  # --saves-only
        return lines
    t = res["times"]
    none = statistics.median(t["none"])
    lines.append(f"  training (state {human(res['train_state'])}): mean step " +
                 ", ".join(f"{c} {statistics.median(v) * 1e3:.2f} ms" for c, v in t.items()))
    for c in ("replicas=1", "replicas=2"):
        lines.append(f"  save_async overhead, {c}: {(statistics.median(t[c]) / none - 1) * 100:+.1f} points")
    return lines + restore_lines(res)


def restore_lines(res: dict) -> list[str]:
    """The restore and restart figures (module docstring)."""
    rs, gb = res["restore"], res["state_bytes"] / 1e9
    cases = ("local load", "from peers", "from peers, one round", "gloo", "cold read", "local load, in place",
             "from peers, in place")
    rate = {k: statistics.median(gb / x for x in rs[k]) for k in cases}
    floor = min(rate["gloo"], rate["cold read"])
    ratios = {p: [a / min(g, c) for a, g, c in zip(*([gb / x for x in rs[k]] for k in (p, "gloo", "cold read")))]
              for p in ("from peers", "from peers, one round", "from peers, in place")}
    rt = res.get("restart")
    lines = [f"  restore GB/s (state bytes / slowest rank's load call): local load {rate['local load']:.2f}, "
            f"from peers (node 1 lost) {rate['from peers']:.2f} (read all, then send all: "
            f"{rate['from peers, one round']:.2f}); gloo loopback {rate['gloo']:.2f}, local cold read "
            f"{rate['cold read']:.2f}",
            f"  restore set-up (a fresh checkpointer, s): local {statistics.median(rs['setup local']):.3f}, "
            f"from peers {statistics.median(rs['setup peers']):.3f}",
            f"  restore from peers / local load:                      "
            f"{statistics.median(x / y for x, y in zip(rs['local load'], rs['from peers'])):.2f}",
            f"  restore from peers / slower of gloo and cold read:    {statistics.median(ratios['from peers']):.2f}  "
            f"(goal >= 0.80; that floor {floor:.2f} GB/s; read all, then send all: "
            f"{statistics.median(ratios['from peers, one round']):.2f})",
            f"  load(atomic=False) GB/s: local load {rate['local load, in place']:.2f}, from peers "
            f"{rate['from peers, in place']:.2f}; from peers / slower of gloo and cold read: "
            f"{statistics.median(ratios['from peers, in place']):.2f} (min {min(ratios['from peers, in place']):.2f}, "
            f"max {max(ratios['from peers, in place']):.2f})"]
    if rt is not None:
        lines.append(f"  restart to first training step (spawn, load, one step): intact "
                     f"{statistics.median(rt['intact']):.2f} s, node 1 lost {statistics.median(rt['node 1 lost']):.2f} s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-size", default="64M")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--train-rounds", type=int, default=2)
    ap.add_argument("--restore-rounds", type=int, default=3)
    ap.add_argument("--restore-only", action="store_true", help="only the restore rounds (one untimed step)")
    ap.add_argument("--saves-only", action="store_true", help="only the save rounds (no restore, training, restart)")
    ap.add_argument("--profile", action="store_true", help="log each rank's replication phases (debug)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    a = {"size": parse_size(ns.size), "rounds": ns.rounds, "train_size": parse_size(ns.train_size),
         "iters": ns.iters, "every": ns.every, "train_rounds": ns.train_rounds, "restore_rounds": ns.restore_rounds,
         "restore_only": ns.restore_only, "saves_only": ns.saves_only, "profile": ns.profile}
    if ns.saves_only:
        a["restore_rounds"] = 0
    run_worlds(run, table, "gdswriter-replicas", ns.ranks, a, ns.dir, ns.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
