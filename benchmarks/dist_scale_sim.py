"""What a multi-rank save and load cost one rank as the world grows, simulated in one process.

For each world size W, rank 0 and a typical rank (rank W // 2) run the real code of a
GDSCheckpointer save (distributed/save.py: planning, writing their pieces and shard, the vote,
rank 0's commit) and of a load's planning (reading the global manifest and the rank's own shard,
working out its pieces and transfers), on an in-process coordinator
(gdswriter/testing/simcoord.py) that plays the other W - 1 ranks: their vote reports are the
typical rank's, with their rank, shard and root put in. Every rank has its own root (one NVMe
per GPU) and holds 2,000 tensors:

* ``fsdp``: 1,950 FSDP2-like blocks of sharded parameters (a rank's own) + 50 small tensors
  replicated on every rank (DistOptions.replicated);
* ``ddp``: all 2,000 replicated on every rank.

Reported per W: CPU time of a save on the typical rank (first, with planning; then cached)
and on rank 0 (its commit of W reports), without the snapshot and the data writes (timed
apart: they depend on the state, not on W), the whole save's too, the bytes each sends and
receives in the save's collectives, the global manifest's size, the bytes a rank reads to plan its load and
the CPU time of that planning (the least of 3 runs; and, for ``ddp``, of a load on W / 2 ranks: the
shards it opens and the share of the replicated bytes it reads itself), and what opening the
roots (the first collectives of a GDSCheckpointer: the root table, the primary's choice) sends
to a typical rank and to rank 0. DCP's
anchor: its DefaultSavePlanner's global plan over W local plans of 2,000 items (rank 0's work in
every dcp.save), without and with its plan caching (the second save of an unchanged layout).
Replication (issue 39; ``--replicas`` copies, 0: not run): placing the replicas and parity
groups at open (benchmarks/replica_plan_sim.py's simulate, on the same coordinator: a gather of
hosts and failure domains to rank 0, a scatter of each rank's part), in a table of its own:
what a typical rank sends and receives (flat in W: the ranks it sends its copies to and
receives them from), its CPU time, and rank 0's.

Parity rows (``--parity-groups``, DistOptions(parity_group=G), hosts of ``--ranks-per-host``
ranks): rank 0's placement (planner parity_groups and the lanes, distributed/parity.py
``lanes_of``: CPU time over W messages), the bytes of the part each rank receives, the summary
a rank sends each lane peer after a save (its files and crc32c values, a rank of the ``fsdp``
state's 2 files), the bytes a rank sends and receives per byte of its state in the parity
rounds, and the bytes on the drives per state byte (ParityPlan.drive_factor): all flat in W.

Refill rows (2 copies when ``--replicas`` > 1, and each parity group; distributed/refill.py): a
load after the host of rank W // 2 was replaced, then its refill. Per W: the moves (flat: the
lost host's ranks, and the copies it held), the plan's CPU time on a typical rank and rank 0 (a
pass over the manifest's W ranks, microseconds each), the bytes a typical rank sends to rank 0
and receives in the refill's own rounds (flat), what rank 0 receives, and the global manifest
each rank receives first (the same bytes a load of the step receives: the fsdp row's).

    python benchmarks/dist_scale_sim.py                       # W = 8, 64, 512, 4096, 16384
    python benchmarks/dist_scale_sim.py --worlds 8,64 --dcp-max 64 --markdown
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from gdswriter.distributed.load import reach_of, relay
from gdswriter.distributed.rankfiles import item_pieces
from gdswriter.distributed.opening import open_roots
from gdswriter.distributed.roots import RootLayout
from gdswriter.distributed import save as save_mod
from gdswriter.distributed.save import DTensors, PlanCache, collective_save
from gdswriter.engines.select import create_engine
from gdswriter.format.commit import step_dir_name
from gdswriter.format.manifest import MANIFEST_NAME, RootInfo, ShardInfo
from gdswriter.format.sharded import DTensorLayout, MeshInfo, parse_global, parse_shard, read_shard, shard_name
from gdswriter.options import EngineOptions, KiB
from gdswriter.save.snapshot import LayoutCache, take_snapshot
from gdswriter.testing.simcoord import Peers, SimCoordinator

TENSORS = 2000
REPLICATED = 50
ELEMS = 256  # per tensor: the counts matter here, not the bytes


def state_of(kind: str, rank: int, world: int) -> tuple[dict, DTensors, tuple[str, ...]]:
    """A rank's state (plain local tensors, as prepare() leaves them) and what its DTensors were."""
    g = torch.Generator().manual_seed(rank)
    if kind == "ddp":
        g = torch.Generator().manual_seed(0)  # the same on every rank
        model = {f"layer{i}.weight": torch.randn(ELEMS, generator=g) for i in range(TENSORS)}
        return {"model": model}, DTensors(), ("model",)
    blocks = {f"layer{i}.weight": torch.randn(ELEMS // 8, 8, generator=g) for i in range(TENSORS - REPLICATED)}
    fsdp = DTensorLayout(MeshInfo.of((world,), range(world)), (0,))  # Shard(0) over every rank, as FSDP2
    shards = {f"model/{k}": ShardInfo((world * v.shape[0], 8), (rank * v.shape[0], 0), fsdp)
              for k, v in blocks.items()}
    g0 = torch.Generator().manual_seed(0)
    shared = {f"norm{i}": torch.randn(ELEMS, generator=g0) for i in range(REPLICATED)}
    found = DTensors(shards, {k: "mesh-fsdp" for k in shards}, {k: (rank,) for k in shards})
    return {"model": blocks, "replicated": shared}, found, ("replicated",)


def layout_of(rank: int, world: int, roots: dict[int, Path]) -> RootLayout:
    table = tuple(RootInfo(f"{r:032x}", str(roots.get(r, f"/sim/nvme{r}")), (r,)) for r in range(world))
    return RootLayout(rank, world, table, (roots[rank],), (table[rank].id,), (rank,), table[0].path)


def report_of(world: int):
    def of(rank: int, template: dict) -> dict:
        out = json.loads(json.dumps(template))
        out["shard"][0], out["shard"][1] = rank, shard_name(rank)
        return out
    return of


class _DataWrites:
    """Times the data writes of a save (save.write_snapshot_files), to report them apart from
    the planning, shard and commit work around them."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self._write = save_mod.write_snapshot_files

    def __call__(self, *args, **kwargs):
        t0 = time.process_time()
        try:
            return self._write(*args, **kwargs)
        finally:
            self.cpu_s += time.process_time() - t0


def run_rank(kind: str, rank: int, world: int, roots: dict[int, Path], peers: Peers, engine, steps=(1, 2)) -> dict:
    state, found, replicated = state_of(kind, rank, world)
    layout = layout_of(rank, world, roots)
    coord = SimCoordinator(rank, world, peers)
    plans, cache = PlanCache(), LayoutCache()
    writes = _DataWrites()
    save_mod.write_snapshot_files = writes  # timed apart (the module's own name for it)
    out: dict = {}
    try:
        for n, step in enumerate(steps):
            peers.step = step
            before = coord.stats.snapshot()
            writes.cpu_s = coord.peer_cpu_s = 0.0
            t0 = time.process_time()
            snap = take_snapshot(state, step, layout=cache)
            t1 = time.process_time()
            collective_save(coord, layout, snap, found, [engine], files_per_root=1, replicated=replicated,
                            plans=plans)
            t2 = time.process_time() - coord.peer_cpu_s
            sent, received, rounds = (a - b for a, b in zip(coord.stats.snapshot(), before))
            out["first" if n == 0 else "cached"] = {
                "cpu_s": t2 - t0, "snapshot_s": t1 - t0, "data_write_s": writes.cpu_s,
                "coordination_s": t2 - t1 - writes.cpu_s, "sent": sent, "received": received, "rounds": rounds}
    finally:
        save_mod.write_snapshot_files = writes._write
    return out


def plan_load(layout: RootLayout, roots: dict[int, Path], step: int) -> dict:
    """The load's planning on ``layout.rank`` (load.py ``load_own``): the global manifest and its own
    shard, its pieces and transfers. ``layout``: the rank's (layout_of), made before, as a
    checkpointer holds it from its opening."""
    rank, world = layout.rank, layout.world_size
    t0 = time.process_time()
    raw = (roots[0] / step_dir_name(step) / MANIFEST_NAME).read_bytes()
    g = parse_global(raw, "sim")
    ref = g.shards[rank]
    where = reach_of(g, layout)[ref.root]
    data = read_shard(where / step_dir_name(step), g, ref)
    shard = parse_shard(data, g, ref, "sim")
    pieces = item_pieces(shard.items, world)
    transfers = sum(1 for i, p in enumerate(pieces) for w, _, n in p
                    if n and shard.items[i].holder_count(world) > 1
                    for _, a, _ in relay(shard.items[i], w, rank, world) if a == rank)
    return {"cpu_s": time.process_time() - t0, "read": len(raw) + len(data), "manifest": len(raw),
            "shard": len(data), "sends": transfers}


def reshard_layout(world: int, roots: dict[int, Path]) -> RootLayout:
    """Loading rank 0's layout in a load of a ``world``-rank step on half the ranks, seeing the
    roots of the saved ranks the simulation wrote (0 and W / 2), where it finds their shards."""
    table = layout_of(0, world, roots).table
    mine = sorted(roots)
    return RootLayout(0, max(world // 2, 1), table, tuple(roots[r] for r in mine), tuple(table[r].id for r in mine),
                      tuple(mine), table[0].path)


def plan_reshard_load(layout: RootLayout, roots: dict[int, Path], step: int) -> dict:
    """A load of the ``ddp`` state on half the ranks (reshard.plan_from_shards), on loading rank 0
    (``layout``: reshard_layout's, made before): the global manifest, its own tree's shard and
    those of the writers whose replicated pieces it reads for every rank (saved ranks 0 and W / 2,
    the ones the simulation wrote)."""
    from gdswriter.distributed.reshard import plan_from_shards

    t0 = time.process_time()
    raw = (roots[0] / step_dir_name(step) / MANIFEST_NAME).read_bytes()
    g = parse_global(raw, "sim")
    shards: list[int] = []

    def read(where, g, ref):
        data = read_shard(where, g, ref)
        shards.append(len(data))
        return data

    plan = plan_from_shards(g, reach_of(g, layout), 0, {}, lambda t, n: None, read, world=layout.world_size)
    assert plan is not None, "the simulated shards are not where the plan looks"
    return {"cpu_s": time.process_time() - t0, "read": len(raw) + sum(shards), "shards": len(shards),
            "shared_bytes": sum(plan[0].storages[s].nbytes for s in plan[2].storages),
            "read_bytes": sum(n for split in plan[2].pieces for j, _, n in split if j == 0)}


def dcp_anchor(world: int, cached: bool) -> float:
    """Seconds of DCP's DefaultSavePlanner.create_global_plan over ``world`` local plans of TENSORS
    FSDP-like items (with ``cached``: a second call after an unchanged first, as plan caching does)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

    rows = ELEMS // 8

    def plan(r: int) -> SavePlan:
        return SavePlan([WriteItem(index=MetadataIndex(f"model.layer{i}.weight", torch.Size([r * rows, 0])),
                                   type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([r * rows, 0]),
                                                                                        torch.Size([rows, 8])),
                                                               properties=TensorProperties(dtype=torch.float32),
                                                               size=torch.Size([world * rows, 8])))
                         for i in range(TENSORS)])

    plans = [plan(r) for r in range(world)]
    for d in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata,
              SavePlanner._cached_final_save_plan, SavePlanner._cached_save_plan):
        d.clear()
    planner = DefaultSavePlanner(flatten_state_dict=False, enable_plan_caching=cached)
    t0 = time.perf_counter()
    planner.create_global_plan(plans)
    if not cached:
        return time.perf_counter() - t0
    unchanged = [SavePlan([], usable=False)] * world  # what ranks send when their plan did not change
    t0 = time.perf_counter()
    planner.create_global_plan(unchanged)
    return time.perf_counter() - t0


def simulate_open(world: int, base: Path) -> dict:
    """What opening a checkpointer's roots coordinates (opening.open_roots: the offers, the table
    and the primary's choice, the locks agreed), on rank 0 and then on the typical rank, every
    rank with its own root: [sent, received, collectives] and CPU time of each."""
    typical = world // 2

    def message_of(rank: int, what: str, mine):
        if what == "opening the checkpoint roots" and "offer" in mine:
            return {"offer": {"roots": [[f"{rank:032x}", f"/sim/nvme{rank}"]],
                              "probes": [{"committed": [], "latest": None, "names": [], "copied": []}]}}
        return mine

    peers = Peers(1, message_of=message_of)  # rank 0 first: the typical rank receives what it sent
    out = {}
    for rank in (0, typical):
        root = base / f"open-rank{rank}"
        coord = SimCoordinator(rank, world, peers)
        t0 = time.process_time()
        _, lock, _ = open_roots(coord, [root])
        lock.release()
        out["rank0" if rank == 0 else "typical"] = {"cpu_s": time.process_time() - t0 - coord.peer_cpu_s,
                                                    "stats": list(coord.stats.snapshot())}
    return out


def simulate(kind: str, world: int, base: Path, engine) -> dict:
    typical = world // 2
    roots = {0: base / "rank0", typical: base / f"rank{typical}"}
    for p in roots.values():
        p.mkdir(parents=True, exist_ok=True)
    peers = Peers(1)
    t = run_rank(kind, typical, world, roots, peers, engine)
    peers_0 = Peers(1, report_of=report_of(world), template=peers.last_report)
    r0 = run_rank(kind, 0, world, roots, peers_0, engine)
    manifest = (roots[0] / step_dir_name(2) / MANIFEST_NAME).stat().st_size
    return {"kind": kind, "world": world, "typical": t, "rank0": r0, "manifest": manifest,
            "load": least(plan_load, layout_of(typical, world, roots), roots, 2), "open": simulate_open(world, base),
            **({"reshard": least(plan_reshard_load, reshard_layout(world, roots), roots, 2)} if kind == "ddp" else {})}


def simulate_parity(world: int, group: int, per_host: int) -> dict:
    """Rank 0's parity placement for ``world`` ranks on hosts of ``per_host``, and what a typical
    rank receives and sends (the module docstring)."""
    from gdswriter.distributed.parity import lanes_of
    from gdswriter.format.parity import chunk_lengths
    from gdswriter.planner.replicas import parity_groups

    hosts = [f"node{r // per_host:05d}" for r in range(world)]
    got = [{"host": h, "domain": [], "group": group, "root": f"{r:032x}"} for r, h in enumerate(hosts)]
    t0 = time.process_time()
    parts = lanes_of(got, group)
    cpu = time.process_time() - t0
    part = parts[world // 2]
    n = len(part["lane"])
    files = [["shard", shard_name(world // 2), 1 << 20]] + [["data", f"data-rank{world // 2}-r0-f{i}.bin", 1 << 30]
                                                             for i in range(2)]
    total = sum(f[2] for f in files)  # every member alike
    summary = {"rank": world // 2, "files": files, "roots": [world // 2] * 3, "total": total,
               "file_crcs": [0xFFFFFFFF] * 3, "chunk_crcs": [0xFFFFFFFF] * (n - 1), "ok": True}
    return {"world": world, "group": group, "hosts": world // per_host if world >= per_host else 1,
            "groups": len(parity_groups(hosts, group).groups), "lane": n, "cpu_s": cpu,
            "part": len(json.dumps(part)), "summary": len(json.dumps(summary)),
            "sent_per_byte": sum(chunk_lengths(total, n)) / total,  # chunk c to member i + 1 + c, each once
            "received_per_byte": sum(chunk_lengths(total, n)[c] for c in range(n - 1)) / total,  # chunk c of i - 1 - c
            "drive_factor": parity_groups(hosts, group).drive_factor()}


def simulate_refill(world: int, mode: str, per_host: int) -> dict:
    """The refill after a load in which the host of rank W // 2 was replaced (distributed/refill.py):
    the plan a typical rank (W // 2 + per_host, on another host) and rank 0 compute from the
    global manifest (the least CPU time of 3 runs), the moves it holds, and what each sends to
    rank 0 in the refill's own rounds (``mode``: "copies", replicas=2 on the next host; or
    "parity:G", lanes_of's lanes: then also rebuilt_copies' report)."""
    from gdswriter.distributed.parity import lanes_of
    from gdswriter.distributed.refill import plan_parity_refill, plan_refill
    from gdswriter.format.sharded import GlobalManifest, ShardRef

    hosts = [r // per_host for r in range(world)]
    lost_host = hosts[world // 2]
    if mode == "copies":
        replicas = tuple(((r + per_host) % world,) for r in range(world))
    else:
        got = [{"host": f"node{h:05d}", "domain": [], "group": int(mode.split(":")[1]), "root": f"{r:032x}"}
               for r, h in enumerate(hosts)]
        replicas = tuple(tuple(k for k in part["lane"] if k != r) for r, part in enumerate(lanes_of(got, int(mode.split(":")[1]))))
    roots = tuple(RootInfo(f"{r:032x}", f"/sim/nvme{r}", (r,)) for r in range(world))
    g = GlobalManifest(2, world, roots, tuple(ShardRef(r, r, shard_name(r), 1 << 20, 0) for r in range(world)), {},
                       0.0, {}, None, replicas)
    table = tuple(RootInfo(f"{r:032x}" if hosts[r] != lost_host else f"{r:031x}n", f"/sim/nvme{r}", (r,))
                  for r in range(world))
    out: dict = {"world": world, "mode": mode}
    for who, rank in (("typical", (world // 2 + per_host) % world), ("rank0", 0)):
        layout = RootLayout(rank, world, table, (Path(table[rank].path),), (table[rank].id,), (rank,), table[0].path)
        plan = plan_refill if mode == "copies" else plan_parity_refill
        runs = []
        for _ in range(3):
            t0 = time.process_time()
            made = plan(g, layout)
            runs.append(time.process_time() - t0)
        mine = [m for m in made.moves if rank == m.sender or any(t[0] == rank for t in m.targets)]
        out[who] = {"cpu_s": min(runs), "moves": len(made.moves), "mine": len(mine), "skipped": made.skipped}
    # the refill's rounds beyond the moves and the manifest: the outcomes (a message each, "" when
    # fine; rank 0 broadcasts at most 8 failures) and, for parity, rebuilt_copies (each rank's
    # [rank, root] pairs: the rebuilt copies on the roots it leads, at most the lost ranks of its
    # lanes; rank 0 broadcasts the first per lost rank)
    lost = [r for r in range(world) if hosts[r] == lost_host]
    t = (world // 2 + per_host) % world
    pairs = [[r, t] for r in lost if t in replicas[r]] if mode != "copies" else None
    sent = len(json.dumps({"mine": ""})) + (len(json.dumps({"mine": pairs})) if pairs is not None else 0)
    back = len(json.dumps({"decision": []})) + (len(json.dumps({"decision": [[r, 0] for r in lost]}))
                                                if pairs is not None else 0)
    out["typical"].update(sent=sent, received=back)
    out["rank0"].update(received=world * sent)
    return out


def least(plan, *args, runs: int = 3) -> dict:
    """The run of ``plan(*args)`` (a load's planning) with the least CPU time of ``runs``: the
    machine is shared, and its other jobs add to one run's time, never take from it."""
    return min((plan(*args) for _ in range(runs)), key=lambda r: r["cpu_s"])


def reshard_cell(r: dict) -> str:
    x = r.get("reshard")
    if x is None:
        return "not run"
    return (f"{x['read'] / 1024:.0f} / {x['shards']} / {x['cpu_s'] * 1e3:.0f} / "
            f"{x['read_bytes'] / max(x['shared_bytes'], 1):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="8,64,512,4096,16384")
    ap.add_argument("--kinds", default="fsdp,ddp")
    ap.add_argument("--dcp-max", type=int, default=512, help="largest W for DCP's planner (it is O(W x tensors))")
    ap.add_argument("--dir", default=None, help="where the simulated ranks' roots go (default: a temporary dir)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--replicas", type=int, default=2, help="copies for the replication rows (0: none)")
    ap.add_argument("--parity-groups", default="2,4", help="parity rows for these DistOptions(parity_group=G) "
                                                           "('' for none)")
    ap.add_argument("--ranks-per-host", type=int, default=8, help="ranks per host in the parity rows")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    engine = create_engine(EngineOptions(buffer_bytes=256 * KiB, request_bytes=64 * KiB, num_buffers=2))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for kind in args.kinds.split(","):
            for w in worlds:
                r = simulate(kind, w, Path(tmp) / f"{kind}-{w}", engine)
                if kind == "fsdp" and w <= args.dcp_max:
                    r["dcp_s"], r["dcp_cached_s"] = dcp_anchor(w, False), dcp_anchor(w, True)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    engine.close()
    replication = replication_rows(worlds, args.replicas) if args.replicas > 1 else []
    if args.json:
        Path(args.json).write_text(json.dumps(rows + replication, indent=1))
    head = ["state", "W", "typical: plan+shard+commit CPU first / cached (ms)", "typical: whole save cached (ms)",
            "typical sends / receives (B)", "rounds", "rank 0: plan+shard+commit cached (ms)", "rank 0 receives (KiB)",
            "global manifest (KiB)", "load plan reads (KiB)", "load plan CPU (ms)",
            "load on W/2 ranks: plan reads (KiB) / shards / CPU (ms) / share of replicated bytes read",
            "open: typical rank receives (B)", "open: rank 0 receives (KiB) / CPU (ms)", "DCP global plan / cached (ms)"]
    table = [head]
    for r in rows:
        t, z = r["typical"], r["rank0"]
        dcp = f"{r['dcp_s'] * 1e3:.0f} / {r['dcp_cached_s'] * 1e3:.1f}" if "dcp_s" in r else "not run"
        table.append([r["kind"], r["world"],
                      f"{t['first']['coordination_s'] * 1e3:.0f} / {t['cached']['coordination_s'] * 1e3:.0f}",
                      f"{t['cached']['cpu_s'] * 1e3:.0f}", f"{t['cached']['sent']} / {t['cached']['received']}",
                      t["cached"]["rounds"], f"{z['cached']['coordination_s'] * 1e3:.0f}",
                      f"{z['cached']['received'] / 1024:.0f}", f"{r['manifest'] / 1024:.0f}",
                      f"{r['load']['read'] / 1024:.0f}", f"{r['load']['cpu_s'] * 1e3:.0f}", reshard_cell(r),
                      r["open"]["typical"]["stats"][1],
                      f"{r['open']['rank0']['stats'][1] / 1024:.0f} / {r['open']['rank0']['cpu_s'] * 1e3:.0f}", dcp])
    show(table, args.markdown)
    if replication:
        print()
        show(replication_table(replication, args.replicas), args.markdown)
    print_parity(args, worlds)
    print_refill(args, worlds, {r["world"]: r["manifest"] for r in rows if r["kind"] == "fsdp"})
    return 0


def print_refill(args, worlds: list[int], manifests: dict[int, int]) -> None:
    """The refill rows (simulate_refill), for 2 copies and each parity group."""
    modes = (["copies"] if args.replicas > 1 else []) + [f"parity:{g}" for g in args.parity_groups.split(",") if g]
    head = ["refill", "W", "moves", "typical: plan CPU (ms) / its moves", "typical sends / receives (B)",
            "rank 0: plan CPU (ms) / receives (KiB)", "manifest each rank receives (KiB, the fsdp row's)"]
    table: list[list] = [head]
    for mode in modes:
        for w in worlds:
            if w < 2 * args.ranks_per_host:
                continue
            r = simulate_refill(w, mode, args.ranks_per_host)
            print(json.dumps(r), file=sys.stderr, flush=True)
            t, z = r["typical"], r["rank0"]
            table.append([mode if mode == "copies" else f"parity G={mode.split(':')[1]}", w, t["moves"],
                          f"{t['cpu_s'] * 1e3:.1f} / {t['mine']}", f"{t['sent']} / {t['received']}",
                          f"{z['cpu_s'] * 1e3:.1f} / {z['received'] / 1024:.0f}",
                          f"{manifests[w] / 1024:.0f}" if w in manifests else "not run"])
    print()
    show(table, args.markdown)


def replication_rows(worlds: list[int], copies: int) -> list[dict]:
    """The replication rows (module docstring): replica_plan_sim.simulate per W, consecutive
    ranks per host (torchrun's numbering), parity groups of 5 hosts."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from replica_plan_sim import simulate as placement

    rows = []
    for w in worlds:
        r = placement(max(w, 4), "torchrun", copies, 5)  # at least 4 hosts
        r["kind"] = f"replicas={copies}"
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    return rows


def replication_table(rows: list[dict], copies: int) -> list[list]:
    head = ["replication", "W", "typical sends / receives (B)", "rounds", "typical: CPU (ms)",
            "rank 0: receives (KiB) / CPU (ms)", "drives per state byte: copies / parity"]
    table: list[list] = [head]
    for r in rows:
        t, z = r["typical"], r["rank0"]
        table.append([f"{copies} copies + parity", r["world"], f"{t['sent']} / {t['received']}", t["rounds"],
                      f"{t['cpu_s'] * 1e3:.2f}", f"{z['received'] / 1024:.0f} / {z['cpu_s'] * 1e3:.1f}",
                      f"{r['copies_factor']:.3f} / {r['parity_factor']:.3f}"])
    return table


def show(table: list[list], markdown: bool) -> None:
    head = table[0]
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in table[1:]:
            print("| " + " | ".join(str(x) for x in row) + " |")
    else:
        widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
        for row in table:
            print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def print_parity(args, worlds: list[int]) -> None:
    """The parity rows (the module docstring)."""
    if not args.parity_groups:
        return
    head = ["G", "W", "hosts", "groups", "lane", "rank 0: placement CPU (ms)", "a rank's part (B)",
            "summary to each lane peer (B)", "parity rounds: sent / received per state byte", "drive bytes per state byte"]
    table = [head]
    for g in (int(x) for x in args.parity_groups.split(",")):
        for w in worlds:
            if w < 2 * args.ranks_per_host:
                continue
            r = simulate_parity(w, g, args.ranks_per_host)
            print(json.dumps(r), file=sys.stderr, flush=True)
            table.append([g, w, r["hosts"], r["groups"], r["lane"], f"{r['cpu_s'] * 1e3:.1f}", r["part"], r["summary"],
                          f"{r['sent_per_byte']:.2f} / {r['received_per_byte']:.2f}", f"{r['drive_factor']:.3f}"])
    print()
    show(table, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
