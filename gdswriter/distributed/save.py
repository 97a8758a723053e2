"""A GDSCheckpointer save across ranks: every rank's snapshot -> one committed step.

What a rank sends and receives does not grow with the world size: every rank plans its own
writes from what it holds, writes its records into a manifest shard of its own, and only a
few hundred bytes per rank travel to the primary rank (format/sharded.py, docs/format.md 10).

1. Each rank names its storages (``storage_keys``): replicated ones (plain tensors under
   DistOptions.replicated, identical on every rank) by their content description, DTensor
   blocks by block and device mesh, everything else by rank; each item's holders are this
   rank alone, every rank (replicated), or the DTensor's replica group, which its mesh gives
   (shards.replica_group). No list of items is exchanged.
2. Each rank computes its byte ranges itself (planner/ranks.py ``split_stream``: a pure
   function of the item's size and holders, so every holder computes the same split) and lays
   them out in its own data files. A save whose layout is the previous save's reuses that plan
   (``PlanCache``), as a training loop's saves do.
3. The primary rank broadcasts the step and the save's token (a fixed-size message); a rank
   saving another step writes nothing and says so in the vote, so no rank commits.
4. Each rank writes its pieces, then its shard (durable, in its step directory on its first
   root), and votes (dist/commit.py) with the shard's name, size and crc32c, its step, and a
   digest of its items per holder set. The primary refuses the step when holders of one set
   disagree (ranks holding different "replicated" state, or replicas of a block that differ),
   else commits the global manifest: the root table and the shard list.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Sequence

import crc32c as _crc32c

from ..engines.base import IOEngine
from ..errors import CorruptCheckpointError, GDSWriterError, RankFailedError, UnsupportedObjectError
from ..format.manifest import ChunkRecord, FileRecord, ShardInfo, TensorRecord
from ..format.sharded import (GlobalManifest, ItemRecord, LayoutEntry, LayoutIndex, RankShard, ShardRef, ShardStatic,
                              layout_digest, parse_global, shard_name)
from ..fs import write_durable
from ..planner.assign import SavePlan, plan_save
from ..save.handle import Release
from ..save.pool import HostSnapshotPool
from ..save.snapshot import Extent, Snapshot
from ..save.writer import write_snapshot_files
from .commit import RankCommit
from .group import Coordinator
from .rankfiles import disagreeing_holders, file_entries, holder_set_digests, item_pieces, rank_targets
from .roots import RootLayout

MAX_SHOWN_STEPS = 16


@dataclass(frozen=True)
class DTensors:
    """What shards.split_dtensors found in one save's state: each DTensor's block, the ranks of
    its device mesh and its replica group, by key path."""

    shards: dict[str, ShardInfo] = field(default_factory=dict)
    meshes: dict[str, str] = field(default_factory=dict)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)


def storage_keys(snap: Snapshot, shards: dict[str, ShardInfo], replicated: Sequence[str], rank: int,
                 meshes: dict[str, str] | None = None) -> tuple[list[str], dict[int, list[int]]]:
    """A name per storage that equals another rank's exactly when both hold the same bytes, and
    the record indices of each storage. ``meshes``: each DTensor's device mesh (shards.mesh_id:
    a block of one name on another mesh, e.g. another pipeline stage, is other data).

    A record is described by its key path where no other record shares it, else by its place in
    the state tree (``tree_positions``): key paths are not unique ("a/b" beside {"a": {"b": ..}},
    1 beside "1"), places are, so two storages of one rank never get one key."""
    meshes = meshes or {}
    by_storage: dict[int, list[int]] = {}
    for i, rec in enumerate(snap.records):
        by_storage.setdefault(rec.storage, []).append(i)
    missing = set(shards) - {rec.name for rec in snap.records}
    if missing:
        name = min(missing)
        raise UnsupportedObjectError(name, None, "a DTensor whose key path the snapshot names differently (keys "
                                                 "must be str or int)", type_name="DTensor")
    places = ambiguous_places(snap)
    clash = sorted({snap.records[i].name for i in places} & set(shards))
    if clash:
        raise UnsupportedObjectError(clash[0], None, "a DTensor whose key path another tensor of the state has too "
                                                     "(e.g. a key \"a/b\" beside {\"a\": {\"b\": ...}}, or 1 beside "
                                                     "\"1\"): rename one of them", type_name="DTensor")
    keys = []
    for sid, ext in enumerate(snap.extents):
        ids = by_storage.get(sid, [])
        recs = [snap.records[i] for i in ids]
        desc = [[places.get(i, r.name), r.byte_offset, r.dtype, list(r.shape), list(r.stride), r.kind,
                 [list(shards[r.name].global_shape), list(shards[r.name].offsets), meshes.get(r.name)]
                 if r.name in shards else None]
                for i, r in zip(ids, recs)]
        if any(r.name in shards for r in recs):
            kind = "S"  # a block of a DTensor: the same on every replica
        elif recs and all(r.name.split("/", 1)[0] in replicated for r in recs):
            kind = "R"  # replicated state: the same on every rank
        else:
            keys.append(f"L{rank}:{sid}")
            continue
        digest = hashlib.sha256(json.dumps([desc, ext.nbytes]).encode()).hexdigest()[:32]
        keys.append(f"{kind}{digest}")
    return keys, by_storage


def ambiguous_places(snap: Snapshot) -> dict[int, list]:
    """{record index: its place in the state tree} for the records whose key path another
    record has too (none in the usual state, found in one pass over the names)."""
    names = [r.name for r in snap.records]
    if len(set(names)) == len(names):
        return {}
    seen: set[str] = set()
    shared = {n for n in names if n in seen or seen.add(n)}
    wanted = {i for i, n in enumerate(names) if n in shared}
    return {i: place for i, place in tree_positions(snap.tree).items() if i in wanted}


def tree_positions(tree: Any) -> dict[int, list]:
    """{tensor index: its first place in an encoded state tree (state_codec), depth first}.
    A place is a list of steps that JSON tells apart: an int (a list's index), ["t", i] (a
    tuple's), ["k", key] (a dict key as encoded: "1" and 1 differ, "a/b" is one step) and
    "meta" (an OrderedDict's _metadata)."""
    found: dict[int, list] = {}
    stack: list[tuple[Any, tuple]] = [(tree, ())]
    while stack:
        node, at = stack.pop()
        kids: list[tuple[Any, tuple]] = []
        if type(node) is list:
            kids = [(v, at + (i,)) for i, v in enumerate(node)]
        elif type(node) is dict:
            if len(node) == 1 and ("$tensor" in node or "$ndarray" in node):
                (i,) = node.values()
                found.setdefault(i, list(at))
            elif "$tuple" in node:
                kids = [(v, at + (["t", i],)) for i, v in enumerate(node["$tuple"])]
            elif "$dict" in node or "$odict" in node:
                kids = [(v, at + (["k", k],)) for k, v in node.get("$dict", node.get("$odict", []))]
                if "meta" in node:
                    kids.append((node["meta"], at + ("meta",)))
        stack.extend(reversed(kids))
    return found


@dataclass(frozen=True)
class RankSavePlan:
    """One rank's save, planned from its own state alone (the module docstring, steps 1-2)."""

    items: tuple[ItemRecord, ...]           # per storage of the snapshot
    pieces: tuple[tuple[int, int, int], ...]  # (storage, offset, length) this rank writes
    fplan: SavePlan                         # the pieces laid out in this rank's files
    tensors: tuple[TensorRecord, ...]        # the snapshot's records, with their blocks
    digests: tuple[tuple[str, int, str], ...]  # (holder set, its size, digest of its items)
    nbytes: int
    static: ShardStatic                      # the shard's parts that only the layout decides, encoded
    layouts: tuple[LayoutEntry, ...] = ()     # its DTensors' layouts (every rank of a mesh has the same)
    layout_digest: str | None = None         # their layout_digest, for the vote (None: not indexable)
    index: list = field(default_factory=list, compare=False)  # the primary's LayoutIndex of them, once made
    read_back: list = field(default_factory=list, compare=False)  # [True] once a shard of this plan parsed


def plan_rank_save(snap: Snapshot, found: DTensors, replicated: Sequence[str], layout: RootLayout,
                   files_per_root: int) -> RankSavePlan:
    """This rank's plan (steps 1-2): its items with their holders, the pieces it writes of each
    (all of a rank-local one; its split_stream share of a shared one), their file layout."""
    rank, world = layout.rank, layout.world_size
    keys, by_storage = storage_keys(snap, found.shards, replicated, rank, found.meshes)
    items = []
    for sid, key in enumerate(keys):
        nbytes = snap.extents[sid].nbytes
        if key.startswith("R"):
            holders: tuple[int, ...] | None = None
        elif key.startswith("S"):
            names = [snap.records[i].name for i in by_storage.get(sid, []) if snap.records[i].name in found.groups]
            groups = {found.groups[n] for n in names}
            if len(groups) != 1:
                raise UnsupportedObjectError(names[0] if names else "", None, "a storage viewed by DTensors with "
                                             "different replica groups", type_name="DTensor")
            holders = groups.pop()
            holders = None if len(holders) == world else holders  # a sorted set of ranks: all of them
        else:
            holders = (rank,)
        items.append(ItemRecord(key, nbytes, holders))
    pieces = [(sid, off, n) for sid, split in enumerate(item_pieces(items, world)) for w, off, n in split if w == rank]
    digests = holder_set_digests(items, rank, world)
    fplan = plan_save([n for _, _, n in pieces], rank_targets(layout, rank, files_per_root))
    tensors = tuple(replace(r, shard=found.shards[r.name]) if r.name in found.shards else r for r in snap.records)
    layouts = tuple(LayoutEntry(t.name, t.dtype, t.shard.global_shape, t.shard.layout) for t in tensors
                    if t.shard is not None and t.shard.layout is not None)
    indexable = len(layouts) == sum(1 for t in tensors if t.shard is not None)
    return RankSavePlan(tuple(items), tuple(pieces), fplan, tensors, digests, sum(n for _, _, n in pieces),
                        ShardStatic.of(rank, tuple(items), tensors), layouts,
                        layout_digest(layouts) if indexable else None)


class PlanCache:
    """The last save's plan, reused while the layout stays the same (the usual case in a training
    loop): same records, storage sizes, DTensor blocks and groups, replicated names, roots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[tuple, RankSavePlan] | None = None
        self.hits = 0

    @staticmethod
    def signature(snap: Snapshot, found: DTensors, replicated: Sequence[str], layout: RootLayout,
                  files_per_root: int) -> tuple:
        places = ambiguous_places(snap)  # where key paths repeat, the keys follow the tree's places
        return (tuple(snap.records), tuple(e.nbytes for e in snap.extents), tuple(found.shards.items()),
                tuple(found.groups.items()), tuple(found.meshes.items()), tuple(replicated),
                layout, files_per_root, json.dumps(sorted(places.items())) if places else None)

    def plan(self, snap: Snapshot, found: DTensors, replicated: Sequence[str], layout: RootLayout,
             files_per_root: int) -> RankSavePlan:
        sig = self.signature(snap, found, replicated, layout, files_per_root)
        with self._lock:
            if self._last is not None and self._last[0] == sig:
                self.hits += 1
                return self._last[1]
        plan = plan_rank_save(snap, found, replicated, layout, files_per_root)
        with self._lock:
            self._last = (sig, plan)
        return plan


def collective_save(coord: Coordinator, layout: RootLayout, snap: Snapshot, found: DTensors,
                    engines: Sequence[IOEngine], *, files_per_root: int, replicated: Sequence[str],
                    pool: HostSnapshotPool | None = None, release: Release | None = None,
                    plans: PlanCache | None = None, saved: dict | None = None,
                    copy_roots: Sequence[str] | None = None) -> GlobalManifest | None:
    """Collective: write ``snap`` as step ``snap.step`` with every rank and commit it once.
    Returns the global manifest on the primary rank (None elsewhere); raises on every rank if
    any rank failed. ``pool``/``release`` as in writer.write_and_commit: this rank's pieces go
    through the host snapshot pool (host mode) or straight from the extents (live), and
    ``release`` is set once the live tensors are free (or the save failed). ``saved``: once the
    step committed, its "token" and this rank's "shard" ([root, name, size, crc32c]) go in it
    (what this rank's drain needs: distributed/drain.py). ``copy_roots``: with replicas, the ids
    of the roots that will hold copies of this rank's files (replicate.py), which its vote
    carries to the manifest's "replicas" entry (format 1.4)."""
    release = release if release is not None else Release()
    plans = plans if plans is not None else PlanCache()
    rank, p = coord.rank, layout.primary_rank
    what = f"saving step {snap.step}"
    error: BaseException | None = None
    plan: RankSavePlan | None = None
    try:
        plan = plans.plan(snap, found, replicated, layout, files_per_root)
    except Exception as e:  # noqa: BLE001 - reported in the vote, so all ranks abort together
        error = e
    # 3. the primary's step and token
    hello = coord.broadcast({"step": snap.step, "token": secrets.token_hex(4)} if rank == p else None,
                            f"{what} (step)", src=p)
    in_step = hello["step"] == snap.step
    rc = RankCommit(coord, layout, hello["step"], hello["token"])
    outcome: Any
    try:
        if error is not None:
            raise error
        if rc.setup_error is not None:
            raise rc.setup_error
        if not in_step:
            raise _OutOfStep()
        assert plan is not None
        outcome = _write_rank(snap, plan, layout, rc, engines, pool, release)
        if copy_roots is not None:
            outcome["copies"] = list(copy_roots)
    except _OutOfStep:
        outcome = {"step": snap.step}
        release.set(error=RankFailedError(what, {rank: f"saving step {snap.step}"}))
    except Exception as e:  # noqa: BLE001 - every failure goes to the vote, so all ranks abort together
        outcome = e
        release.set(error=e)
    try:
        reports = rc.vote(outcome, check=lambda reps: check_reports(reps, hello["step"], what))
    except RankFailedError as e:
        if not in_step:  # this rank's own save is not the one the vote was about
            raise RankFailedError(f"saving step {snap.step}", e.failures, e.hint, total=e.total) from e
        raise
    manifest, error = None, None
    if reports is not None:
        try:
            manifest = _global_manifest(snap, layout, reports, plan)
            data = manifest.to_json_bytes()
            parse_global(data, f"the manifest of step {snap.step}")  # never committed unless it reads back
            rc.commit(data)
        except Exception as e:  # noqa: BLE001 - announced to every rank
            error = e
    rc.announce(error)
    if rc.coordinates:
        rc.move_latest()
    if saved is not None and isinstance(outcome, dict) and "shard" in outcome:
        saved.update(token=hello["token"], shard=outcome["shard"])
    return manifest


class _OutOfStep(Exception):
    """This rank saves another step than the primary rank (reported in the vote)."""


def _write_rank(snap: Snapshot, plan: RankSavePlan, layout: RootLayout, rc: RankCommit,
                engines: Sequence[IOEngine], pool: HostSnapshotPool | None, release: Release) -> dict:
    """Step 4 on this rank: its pieces, then its durable shard; returns its vote report."""
    pieces = plan.pieces
    extents = snap.extents  # a whole item is its own extent; a piece, a view of it
    mine = Snapshot(snap.step, None, [extents[sid] if off == 0 and n == extents[sid].nbytes
                                      else Extent("", flat=extents[sid].flat[off:off + n]) for sid, off, n in pieces],
                    [], {}, ready=snap.ready)
    written_by: dict[int, str] = {}
    crcs = write_snapshot_files(mine, plan.fplan, rc, engines, pool=pool, release=release, written_by=written_by)
    chunks: list[list[ChunkRecord]] = [[] for _ in plan.items]
    for c, crc in crcs.items():  # the host pool may have cut pieces where its own pieces end
        sid, off, _ = pieces[c.storage]
        chunks[sid].append(ChunkRecord(c.file, c.file_offset, off + c.storage_offset, c.length, crc))
    files = tuple(FileRecord(root, name, size, info) for root, name, size, info
                  in file_entries(layout, plan.fplan, written_by, layout.rank))
    shard = RankShard(snap.step, layout.rank, layout.world_size, files, plan.items,
                      tuple(tuple(sorted(cs, key=lambda c: c.storage_offset)) for cs in chunks), plan.tensors,
                      snap.tree)
    data = shard.to_json_bytes(static=plan.static)
    name = shard_name(layout.rank)
    if not plan.read_back:
        check_shard(data, layout, snap.step, name)
        plan.read_back.append(True)
    write_durable(rc.dirs[0] / name, data)
    described = sum(1 for t in plan.tensors if plan.items[t.storage].first_holder == layout.rank)
    return {"step": snap.step, "shard": [layout.local_to_global[0], name, len(data), _crc32c.crc32c(data)],
            "sets": [list(d) for d in plan.digests], "layout": plan.layout_digest,
            "totals": [plan.nbytes, described, len(files), sum(f.size for f in files) + len(data)]}


def check_shard(data: bytes, layout: RootLayout, step: int, name: str) -> None:
    """Parse a shard about to be written with the code every reader parses it with, so that no
    step is committed that a reader would refuse. Once per plan: what the parse checks (items,
    holders, tensors, files, chunk bounds and overlaps) the plan alone decides, and a training
    loop's saves share the plan; what changes between them (checksums, the state tree's plain
    values) is checked for type by the parse, or not by the shard parse at all (the tree)."""
    try:
        RankShard.from_json_bytes(data, where=f"rank {layout.rank}'s {name} of step {step}", step=step,
                                  rank=layout.rank, world_size=layout.world_size, n_roots=layout.root_count)
    except CorruptCheckpointError as e:
        raise GDSWriterError(f"{e.args[0]}. A reader would refuse this shard, so step {step} was not "
                             f"committed; the steps committed before are intact. Where the message names your state "
                             f"(a key path too long, say), change it; else report this message as a gdswriter bug"
                             ) from e


def check_reports(reports: Sequence[dict], step: int, what: str) -> tuple[dict[int, str], str] | None:
    """The primary rank, in the vote: (failures, hint) when the ranks cannot commit together:
    ranks saving another step, or holders of one set of items that disagree about it."""
    steps = [x.get("step", step) for x in reports]
    odd = {r: f"saving step {s}" for r, s in enumerate(steps) if s != step}
    if odd:
        shown = steps if len(steps) <= MAX_SHOWN_STEPS else f"{steps[:MAX_SHOWN_STEPS]} ..."
        return odd, (f"the ranks are not saving the same step (steps by rank: {shown}), so nothing was committed: "
                     f"every rank must call save()/save_async() for the same steps in the same order (no "
                     f"on_busy='skip'; a rank whose save_async raised must not go on alone); restart the job from "
                     f"the latest committed step")
    bad = disagreeing_holders([x.get("sets", []) for x in reports])
    if bad:
        return bad, ("ranks that must hold identical state do not (DistOptions.replicated names state that is not "
                     "the same on every rank, or replicas of a DTensor differ), so nothing was committed: make the "
                     "replicated state identical (broadcast it) or leave it out of DistOptions.replicated")
    return None


def _global_manifest(snap: Snapshot, layout: RootLayout, reports: Sequence[dict],
                     plan: RankSavePlan | None) -> GlobalManifest:
    if len(reports) != layout.world_size:
        raise GDSWriterError(f"internal: {len(reports)} reports for {layout.world_size} ranks")
    shards = [ShardRef(r, *x["shard"]) for r, x in enumerate(reports)]
    totals = {k: sum(x["totals"][i] for x in reports) for i, k in enumerate(("bytes", "tensors", "files", "on_disk"))}
    return GlobalManifest.new(snap.step, layout.world_size, layout.table, shards, snap.metadata, totals,
                              layout_index(plan, reports), copy_table(layout, reports))


def copy_table(layout: RootLayout, reports: Sequence[dict]) -> list[list[int]] | None:
    """The manifest's "replicas" entry (format 1.4): each rank's copy roots, from the root ids
    its vote names, as indices of the table the primary rank holds; None without replicas."""
    if not any("copies" in x for x in reports):
        return None
    index = {info.id: g for g, info in enumerate(layout.table)}
    try:
        return [[index[i] for i in x.get("copies", [])] for x in reports]
    except KeyError as e:
        raise GDSWriterError(f"internal: a rank's copy root {e} is not in the root table") from e


def layout_index(plan: RankSavePlan | None, reports: Sequence[dict]) -> LayoutIndex | None:
    """The step's layout index, from the primary's own DTensors' layouts (every rank of a mesh
    knows a DTensor's layout alike), when it describes every rank's: each rank's vote carries a
    digest of its layouts, and a rank whose digest is not what the index says of its meshes (a
    DTensor on a mesh the primary is not part of, e.g. another pipeline stage) leaves the step
    without an index (its loads on another layout then merge every shard, as before)."""
    if plan is None or plan.layout_digest is None:
        return None
    if not plan.index:  # made once per plan: the saves of a training loop commit the same index
        plan.index.append(LayoutIndex({e.name: e for e in plan.layouts}))
    index = plan.index[0]
    return None if index.mismatched([x.get("layout") for x in reports]) else index

