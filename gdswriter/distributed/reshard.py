"""A load on another layout (world size, mesh, placements) that reads only the shards it needs.

A 1.3 step with a layout index (format/sharded.py ``LayoutIndex``, docs/format.md 10) says, per
DTensor name, its global shape, mesh and placements: a rank computes from it which saved ranks
hold the blocks its live tensors need now (``LayoutEntry.overlapping``). So each rank reads the
step's manifest and then, straight from the roots it sees, only the shards it needs:

* the shard whose state tree it takes (its own rank's, rank 0's for a rank the save did not
  have), which also holds its rank-local items;
* for each DTensor block it needs, the shard of one of the block's holders (checked against
  the index: a shard that contradicts it is refused);
* for each item it needs, the shards of the holders that wrote its pieces (item_pieces, from
  the holder set's items that any of its holders records);
* of the replicated state (DistOptions.replicated: the items every saved rank held, each
  writing a part), only the shards of the writers of the bytes it reads for every rank
  (``read_split``), and spread from there to every rank (``SharedRead``), so the replicated
  bytes are read from disk once in all. On N loading ranks of W saved ones, N <= W: saved rank
  w's pieces are read by loading rank w mod N (``reader_of``): a rank opens about W / N of
  those shards and reads about 1 / N of the bytes. N > W: the items end to end are cut into N
  equal aligned shares, and loading rank j reads the share in writer j mod W's part where it
  can: each rank reads about 1 / N of the bytes from the shards of the writers its share meets
  (one or two as a rule; rank j < W from its own), and a saved chunk two ranks read parts of
  is checked against its crc32c whole once the pieces have spread. Every rank computes the
  save's split from its own tree's shard (item_pieces), so no record of another writer
  travels; the ranks agree on a digest of the split's items first.

It then reads its chunks itself (``read_reached``): no rank receives other ranks' records,
and no message grows with the world size. When some rank does not see a shard or a data file
it needs (node-local roots), or the step has no index (a 1.3 step saved before it existed),
every rank takes the merging path instead (loadmanifest.py ``gather_merged``), which sends chunks
between ranks.

A step saved by a single process has no shards: rebuild.py reads it whole on every rank's plan,
and ``read_replicated_once`` reads the storages every rank needs bytes of once across the ranks
with the same machinery (``read_split`` of one writer's items on N ranks, ``read_reached``).
Damage found while reading (a checksum, a short file) is CorruptCheckpointError on every rank,
the ranks that did not find it naming those that did (``_agree_on_damage``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import torch

from ..engines.base import IOEngine
from ..errors import CorruptCheckpointError, RankFailedError, UnreachableDataError
from ..format.assembly import remap_tree
from ..format.commit import step_dir_name
from ..format.manifest import MULTI_RANK_VERSION, ChunkRecord, DistInfo, FileRecord, Manifest, StorageRecord, TensorRecord
from ..format.sharded import SHARDED_VERSION, GlobalManifest, ItemRecord, RankShard, parse_shard, read_shard
from ..format.state_codec import tensor_refs
from ..load.reader import host_buffer
from ..planner.ranks import split_stream
from .fetch import Reach, check_reached_files
from .group import Coordinator, bounded, describe, unbound
from .loadplan import reach_of, relay, template_of, tiles
from .ownplan import Move
from .rankfiles import item_pieces
from .readexec import ChunkCheck, RangeRead, ReadPlan, check_chunks, chunk_range, execute, send_rounds
from .roots import RootLayout
from .shards import target_block


class _Unreached(Exception):
    """A shard or data file this rank needs is on a root it does not see."""


@dataclass(frozen=True)
class SharedRead:
    """The replicated items (DistOptions.replicated: every saved rank held them) that the loading
    ranks read together (``read_split``): each loading rank reads its pieces and passes them on,
    so it opens only the manifest shards of the writers of those bytes. ``storages``: their
    numbers in the plan's Manifest (where each records only the chunks this rank reads, whole),
    in key order; ``pieces``: per storage, (loading rank that reads it, offset, length), covering
    it once; ``digest``: of the saved set they belong to (its keys and sizes), the same on every
    loading rank or the split is not; ``cut``: whether pieces may cut a saved chunk (a load on
    more ranks than saved): each such chunk's crc32c is then checked after the spread, by the
    rank that read its first byte."""

    storages: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    digest: str
    cut: bool = False


def reader_of(writer: int, world: int) -> int:
    """The loading rank (of ``world``) that reads the pieces saved rank ``writer`` wrote of the
    replicated items, when ``world`` is at most the saved world: writer mod world, so a loading
    rank reads its own rank's pieces (the shard whose tree it takes) and every world-th writer's
    after it."""
    return writer % world


def read_split(saved: Sequence[Sequence[tuple[int, int, int]]], sizes: Sequence[int], saved_world: int,
               world: int) -> list[list[tuple[int, int, int]]]:
    """Per replicated item (in key order, ``sizes`` bytes, ``saved``: the save's split, (writer,
    offset, length)), (loading rank, offset, length) of the pieces the ``world`` loading ranks
    read, covering each item once. On at most the saved world, the writers' own pieces, by
    ``reader_of`` (a rank opens about W / N writers' shards). On more ranks than saved, the items
    end to end are cut into ``world`` equal aligned shares (split_stream, at least
    SPLIT_MIN_SHARE each), each share cut again where a writer's piece ends, so every rank reads
    about 1 / N of the bytes, from the shards of the writers its share meets (one or two as a
    rule, at most three: a share is no longer than a writer's part, to within the alignment). A
    share goes to a loading rank j with j mod W the writer of most of its bytes where one is
    left (so rank j < W reads from its own shard, the one whose tree it takes), else to the
    first rank left. A pure function of what every loading rank holds (the save's split of the
    agreed items, the two world sizes): no message, O(items + N) work."""
    if world <= saved_world:
        return [[(reader_of(w, world), off, n) for w, off, n in pieces if n] for pieces in saved]
    segments: list[list[tuple[int, int, int, int]]] = []  # per item: (share, writer, offset, length)
    held: list[dict[int, int]] = []  # per share: writer -> its bytes in the share
    for size, pieces, shares in zip(sizes, saved, split_stream(sizes, world, 0)):
        cuts = sorted({off for _, off, n in pieces if n} | {off for _, off, n in shares if n})
        starts = [off for _, off, n in pieces if n], [off for _, off, n in shares if n]
        writers, numbers = [w for w, _, n in pieces if n], [j for j, _, n in shares if n]
        segments.append([])
        for a, b in zip(cuts, cuts[1:] + [size]):
            j = numbers[bisect.bisect_right(starts[1], a) - 1]  # split_stream numbers share i as i (seed 0)
            w = writers[bisect.bisect_right(starts[0], a) - 1]
            segments[-1].append((j, w, a, b - a))
            while len(held) <= j:
                held.append({})
            held[j][w] = held[j].get(w, 0) + b - a
    free = [list(range(r, world, saved_world))[::-1] for r in range(saved_world)]  # per writer: its ranks left
    reader: list[int | None] = []
    for share in held:
        if not share:  # a share with no bytes (none with split_stream's shares): no reader
            reader.append(-1)
            continue
        w = min(share, key=lambda v: (-share[v], v))
        reader.append(free[w].pop() if free[w] else None)
    left = sorted(j for ranks in free for j in ranks)[::-1]
    reader = [j if j is not None else left.pop() for j in reader]
    return [[(reader[j], a, n) for j, _, a, n in item] for item in segments]


def _meets(off: int, n: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a < off + n and off < a + m for a, m in ranges)


def _every_rank_set(items: Sequence[ItemRecord]) -> str:
    """A digest of the items every saved rank holds (their split depends on all of them)."""
    every = sorted([it.key, it.nbytes] for it in items if it.holders is None)
    return hashlib.sha256(json.dumps(every).encode()).hexdigest()[:32]


def _read_together(it: ItemRecord, saved_world: int) -> bool:
    """Whether the loading ranks read item ``it`` together (SharedRead): replicated state that
    every saved rank held and wrote a part of; every loading rank needs all of it."""
    return it.holders is None and it.key.startswith("R") and saved_world > 1


class _Shards:
    """The manifest shards of step ``g`` a plan opens, each read once when first needed, with
    its items by key, its DTensor blocks by (name, offsets) and its holders' split."""

    def __init__(self, g: GlobalManifest, reach: list[Path | None], read: Callable[[Path, GlobalManifest, Any], bytes]):
        self.g, self.reach, self.read = g, reach, read
        self.shards: dict[int, RankShard] = {}
        self.keys: dict[int, dict[str, int]] = {}
        self.blocks_of: dict[int, dict[tuple, list[TensorRecord]]] = {}  # per shard: (name, offsets) -> its records
        self.pieces: dict[int, list] = {}

    def __call__(self, r: int) -> RankShard:
        if r not in self.shards:
            g = self.g
            ref = g.shards[r]
            root = self.reach[ref.root]
            if root is None:
                raise _Unreached()
            d = root / step_dir_name(g.step)
            self.shards[r] = parse_shard(self.read(d, g, ref), g, ref, str(d / ref.name))
            self.keys[r] = {it.key: k for k, it in enumerate(self.shards[r].items)}
            self.blocks_of[r] = {}
            for t in self.shards[r].tensors:
                if t.shard is not None:
                    self.blocks_of[r].setdefault((t.name, t.shard.offsets), []).append(t)
        return self.shards[r]

    def split(self, r: int) -> list:
        """item_pieces of shard ``r``'s items (its holders' split), computed once."""
        if r not in self.pieces:
            self.pieces[r] = item_pieces(self.shards[r].items, self.g.world_size)
        return self.pieces[r]

    def bad(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"step {self.g.step}: {msg}; the checkpoint is damaged: load an earlier step")


class _Picked:
    """The tensor records the plan's Manifest holds, and the items they view (by key: a
    holder's rank and the item's index in its shard)."""

    def __init__(self, shards: _Shards):
        self.shards = shards
        self.items: dict[str, tuple[int, int]] = {}
        self.tensors: list[TensorRecord] = []
        self.where: dict[int, int] = {}  # the tree shard's tensor index -> ours
        self.names: dict[str, int] = {}  # a sharded tensor -> our first block of it

    def add(self, r: int, rec: TensorRecord) -> int:
        it = self.shards.shards[r].items[rec.storage]
        self.items.setdefault(it.key, (r, rec.storage))
        self.tensors.append(replace(rec, storage=it.key))  # type: ignore[arg-type] - numbered below
        return len(self.tensors) - 1


def _pick_block(picked: _Picked, index: Any, tree_rank: int, rec: TensorRecord, templates: dict[str, Any],
                template_of: Callable[[dict[str, Any], str], Any]) -> int:
    """Our record of the block of DTensor ``rec`` this rank's live tensor holds: the saved
    blocks it meets (the layout index names their holders), each checked against its holder's
    shard; an empty block: ``rec`` itself."""
    shards = picked.shards
    entry = index.entries.get(rec.name)
    if entry is None or entry.global_shape != rec.shard.global_shape or entry.dtype != rec.dtype:  # type: ignore[union-attr]
        raise shards.bad(f"rank {tree_rank}'s manifest shard has DTensor {rec.name[:200]!r} (global shape "
                         f"{list(rec.shard.global_shape)}, {rec.dtype}) that the layout index "  # type: ignore[union-attr]
                         + ("does not list" if entry is None else
                            f"describes as {list(entry.global_shape)}, {entry.dtype}"))
    offsets, shape, _ = target_block(template_of(templates, rec.name), rec.shard.global_shape)  # type: ignore[union-attr]
    blocks = entry.overlapping(offsets, shape)
    if not blocks:  # an empty block: any record of the name stands for it
        picked.names[rec.name] = picked.add(tree_rank, rec)
        return picked.names[rec.name]
    for holder, boff, bshape in blocks:
        shards(holder)
        held = shards.blocks_of[holder].get((rec.name, boff), [])
        if len(held) != 1 or held[0].shape != bshape or held[0].shard.global_shape != entry.global_shape \
                or held[0].dtype != entry.dtype:
            raise shards.bad(f"the layout index says rank {holder} holds the block {list(boff)} + {list(bshape)} "
                             f"of {rec.name[:200]!r}, its manifest shard does not")
        j = picked.add(holder, held[0])
        picked.names.setdefault(rec.name, j)
    return picked.names[rec.name]


def _pick(shards: _Shards, index: Any, tree_rank: int, templates: dict[str, Any],
          template_of: Callable[[dict[str, Any], str], Any]) -> _Picked:
    """The records this rank's tree (shard ``tree_rank``'s) references: its plain tensors, and of
    each DTensor the saved blocks its live block meets (``_pick_block``); then every replicated
    item read together, whatever the tree references."""
    own = shards.shards[tree_rank]
    picked = _Picked(shards)
    for i in tensor_refs(own.tree, len(own.tensors)):
        rec = own.tensors[i]
        if rec.shard is None:
            picked.where[i] = picked.add(tree_rank, rec)
        elif rec.name in picked.names:
            picked.where[i] = picked.names[rec.name]
        else:
            picked.where[i] = _pick_block(picked, index, tree_rank, rec, templates, template_of)
    for k, it in enumerate(own.items):
        if _read_together(it, shards.g.world_size):
            picked.items[it.key] = (tree_rank, k)
    return picked


class _Files:
    """The data files the plan's chunks are in, numbered in the order first met."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, str], int] = {}
        self.records: list[FileRecord] = []

    def number(self, f: FileRecord) -> int:
        fid = self.ids.setdefault((f.root, f.path), len(self.records))
        if fid == len(self.records):
            self.records.append(f)
        return fid


def _item_storage(shards: _Shards, files: _Files, key: str, r: int, k: int, rank: int,
                  shared: tuple[list[tuple[int, int, int]], list[tuple[int, int]]] | None) -> StorageRecord:
    """Item ``key`` (index ``k`` of shard ``r``) as a storage of the plan: its chunks, from the
    shards of the holders that wrote its pieces; of an item read together (``shared``: the saved
    pieces, and the (offset, length) spans this rank reads for every rank), only the chunks of
    those spans, from their writers."""
    g = shards.g
    it = shards.shards[r].items[k]
    if it.holder_count(g.world_size) == 1:
        writers = [it.first_holder]
    else:
        writers = sorted({w for w, _, n in shards.split(r)[k] if n})
    saved, mine = shared if shared is not None else ([], [])
    if shared is not None:
        writers = [w for w in writers if any(_meets(off, n, mine) for v, off, n in saved if v == w)]
    chunks: list[ChunkRecord] = []
    for w in writers:
        sw = shards(w)
        kw = shards.keys[w].get(key)
        if kw is None or sw.items[kw].nbytes != it.nbytes:
            raise shards.bad(f"rank {w} wrote part of item {key[:40]} ({it.nbytes} bytes) by its holders' "
                             f"split, its manifest shard does not record it so")
        if shared is not None and not tiles(sw.chunks[kw], [(off, n) for v, off, n in saved if v == w]):
            raise shards.bad(f"rank {w}'s manifest shard does not record exactly the pieces of item {key[:40]} "
                             f"its holders' split gives it")
        for c in sw.chunks[kw]:
            if shared is not None and c.length and not _meets(c.storage_offset, c.length, mine):
                continue  # bytes other loading ranks read
            chunks.append(replace(c, file=files.number(sw.files[c.file])))
    return StorageRecord(it.nbytes, tuple(sorted(chunks, key=lambda c: c.storage_offset)))


def plan_from_shards(g: GlobalManifest, reach: list[Path | None], rank: int, templates: dict[str, Any],
                     template_of: Callable[[dict[str, Any], str], Any],
                     read: Callable[[Path, GlobalManifest, Any], bytes] = read_shard, *, world: int
                     ) -> tuple[Manifest, list[int], SharedRead] | None:
    """(the part of step ``g`` rank ``rank`` of ``world`` loading ranks needs as a Manifest, the
    saved ranks whose shards it read, the replicated items it reads with the other ranks), from
    those shards alone; None when one of them, or a data file it needs, is on a root this rank
    does not see. A shard that contradicts the index is CorruptCheckpointError."""
    index = g.layout_index
    assert index is not None
    shards = _Shards(g, reach, read)
    files = _Files()
    try:
        tree_rank = rank if rank < g.world_size else 0
        own = shards(tree_rank)
        picked = _pick(shards, index, tree_rank, templates, template_of)
        # each item's chunks, from the shards of the holders that wrote its pieces (of an item
        # read together, those of the writers of the pieces this rank reads for every rank)
        items = picked.items
        order = list(items)
        shared_keys = sorted(key for key in order if _read_together(shards.shards[items[key][0]].items[items[key][1]],
                                                                      g.world_size))
        saved = {key: shards.split(tree_rank)[items[key][1]] for key in shared_keys} if shared_keys else {}
        reads = dict(zip(shared_keys, read_split([saved[key] for key in shared_keys],
                                                 [own.items[items[key][1]].nbytes for key in shared_keys],
                                                 g.world_size, world)))
        storages = [_item_storage(shards, files, key, *items[key], rank,
                                  (saved[key], [(off, n) for j, off, n in reads[key] if j == rank])
                                  if key in reads else None) for key in order]
        if any(reach[f.root] is None for f in files.records):
            raise _Unreached()
    except _Unreached:
        return None
    number = {k: n for n, k in enumerate(order)}
    together = tuple(number[key] for key in shared_keys)
    records = tuple(replace(t, storage=number[t.storage]) for t in picked.tensors)  # type: ignore[index]
    m = _plan_manifest(g, own, files.records, storages, records, picked.where)
    # validated under plain names: a file read from a copy is in its copies folder (format/copies.py),
    # a path no manifest of its own may name; the plan keeps m's paths (below)
    plain = replace(m, files=tuple(replace(f, path=f.path.rpartition("/")[2]) for f in m.files))
    try:  # through the 1.2 validation: every item covered once, chunks inside their files, views inside items
        data = _covered(plain, together).to_json_bytes()
    except Exception as e:  # noqa: BLE001 - a record no reader accepts: the shards are damaged
        raise shards.bad(f"the shards describe a tensor no reader accepts ({e})") from e
    checked = Manifest.from_json_bytes(data, where=f"step {g.step} (the manifest shards rank {rank} needs)")
    checked = replace(checked, files=m.files, storages=m.storages, version=SHARDED_VERSION,
                      created_unix=g.created_unix)
    return checked, sorted(shards.shards), SharedRead(together, tuple(tuple(reads[key]) for key in shared_keys),
                                                      _every_rank_set(own.items), cut=world > g.world_size)


def _plan_manifest(g: GlobalManifest, own: RankShard, file_list: list[FileRecord], storages: list[StorageRecord],
                   records: tuple[TensorRecord, ...], where: dict[int, int]) -> Manifest:
    """The plan as a Manifest: its root table the roots its files are on (renumbered), not the
    step's (a root per rank or more); its tree the tree shard's, on our tensor numbers."""
    used = sorted({f.root for f in file_list}) or [0]
    renumber = {r: k for k, r in enumerate(used)}
    file_list = [replace(f, root=renumber[f.root]) for f in file_list]
    return Manifest(step=g.step, files=tuple(file_list), storages=tuple(storages), tensors=records,
                    state=remap_tree(own.tree, lambda i: where[i]), created_unix=g.created_unix, metadata=g.metadata,
                    version=MULTI_RANK_VERSION, dist=DistInfo(g.world_size, "gdswriter", tuple(g.roots[r] for r in used)))


OTHERS_PIECES = "replicated-pieces-other-ranks-read"


def _covered(m: Manifest, together: Sequence[int]) -> Manifest:
    """``m`` for its validation: the bytes of the items read together that other ranks read are
    given chunks of a placeholder file (never read), so every item is covered once as a whole
    step's manifest covers it, and this rank's own chunks are checked as any others."""
    if not together:
        return m
    storages = list(m.storages)
    spare = len(m.files)
    at = 0
    for s in together:
        rec = storages[s]
        filled, pos = [], 0
        for c in sorted(rec.chunks, key=lambda c: c.storage_offset) + [None]:
            end = rec.nbytes if c is None else c.storage_offset
            if end > pos:
                filled.append(ChunkRecord(spare, at, pos, end - pos, 0))
                at += end - pos
            if c is not None:
                filled.append(c)
                pos = max(pos, c.storage_offset + c.length)
        storages[s] = StorageRecord(rec.nbytes, tuple(filled))
    files = m.files + (FileRecord(0, OTHERS_PIECES, at),)
    return replace(m, files=files, storages=tuple(storages))


def read_reached(coord: Coordinator, reach: Reach, m: Manifest, storages: Any, engine: IOEngine, *, verify: bool,
                 what: str, shared: SharedRead | None = None) -> dict[int, torch.Tensor]:
    """Collective: fetch.fetch_storages for a manifest whose every chunk this rank reaches (as
    plan_from_shards makes it): each rank reads its own, no rank tells another what it needs.
    Every file is checked against its recorded size on every rank before any buffer is allocated.
    The items ``shared`` names are read together: each rank reads its pieces of them (of the
    chunks in ``m``, the bytes inside its pieces) and every piece spreads from its reader to
    every rank down a binomial tree (loadplan.py ``relay``), so their bytes are read from disk once
    in all. A chunk read whole is checked against its crc32c where it is read (a receiver has no
    records of it); a chunk the pieces cut (``shared.cut``) is checked whole once the pieces
    have spread, by the rank that read its first byte, and all ranks agree on the outcome
    before anything is rebuilt. The reads are one plan (``reached_plan``) carried out by
    readexec.py's executor."""
    together = shared.storages if shared is not None else ()
    ranges = {s: _runs([(off, n) for j, off, n in split if j == coord.rank])
              for s, split in zip(together, shared.pieces)} if shared is not None else {}
    plan, cut = reached_plan(m, sorted(set(storages) | set(together)), ranges)
    error = None
    try:
        if any(reach.paths[m.files[r.file].root] is None for r in plan.reads):
            raise UnreachableDataError(2, f"{what}: a data file this rank needs is on a root it does not see")
        check_reached_files(m, reach, {r.file for r in plan.reads})
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    _agree_on_damage(coord, error, f"{what} (checking the data files)")
    out = execute(plan, reach.paths, engine, verify=verify, alloc=host_buffer)
    _agree_on_damage(coord, out.error, f"{what} (reading)")
    if shared is not None:
        _pass_pieces(coord, m, shared, out.buffers, what)
    if shared is not None and shared.cut:
        error = None
        try:
            if verify:
                check_chunks(_cut_checks(reach, m, [(s, ci) for s, ci in dict.fromkeys(cut)
                                                    if _meets(m.storages[s].chunks[ci].storage_offset, 1, ranges[s])]),
                             out.buffers)
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
        _agree_on_damage(coord, error, f"{what} (checking the replicated chunks read in parts)")
    return out.buffers


def reached_plan(m: Manifest, needed: Sequence[int], ranges: dict[int, list[tuple[int, int]]]
                 ) -> tuple[ReadPlan, list[tuple[int, int]]]:
    """(the reads of ``read_reached``: a buffer per ``needed`` storage, each chunk with bytes read
    whole into it, or of a storage read together (``ranges``: the (offset, length) runs this
    rank reads of it) the bytes inside those runs; the (storage, chunk) of every chunk read in
    part, checked whole after the spread, not as it is read)."""
    names: dict[int, str] = {}
    for t in m.tensors:
        names.setdefault(t.storage, t.name)
    reads: list[RangeRead] = []
    cut: list[tuple[int, int]] = []
    for s in needed:
        for ci, c in enumerate(m.storages[s].chunks):
            if not c.length:
                continue
            end = c.storage_offset + c.length
            spans = [(max(a, c.storage_offset), min(a + n, end)) for a, n in ranges[s]] if s in ranges else \
                [(c.storage_offset, end)]
            for lo, hi in spans:
                if lo < hi:
                    reads.append(chunk_range(c, s, lo, names.get(s, f"<storage {s}>"), lo, hi))
                    if (lo, hi) != (c.storage_offset, end):
                        cut.append((s, ci))
    return ReadPlan(m.step, m.created_unix, m.files, tuple(reads), tuple((s, m.storages[s].nbytes) for s in needed)), cut


def _agree_on_damage(coord: Coordinator, error: BaseException | None, what: str) -> None:
    """Collective ``agree``, where damage (CorruptCheckpointError: a checksum, a short file) is
    CorruptCheckpointError on every rank, not only on the rank whose share held it: the others
    raise one naming the ranks that found it (a collective load fails alike everywhere). Any
    other failure is agreed as ``agree`` does (RankFailedError on the other ranks)."""
    unchanged = "the live state was not changed"
    damage = describe(error) if isinstance(error, CorruptCheckpointError) else None
    try:
        verdict = coord.decide(None if damage else error, damage, what,
                               lambda outs: bounded({r: d for r, d in enumerate(outs) if d}), hint=unchanged)
    except RankFailedError:
        if error is not None:
            raise error from None  # damage here, another failure elsewhere: this rank's own error
        raise
    shown, total = unbound(verdict)
    if not total:
        return
    if error is not None:
        raise error
    more = f" and {total - len(shown)} more" if total > len(shown) else ""
    first = next(iter(sorted(shown.items())))
    raise CorruptCheckpointError(f"{what}: rank(s) {sorted(shown)}{more} found the step damaged (rank {first[0]}: "
                                 f"{first[1]}); {unchanged}: load an earlier step (load(fallback=True) takes the "
                                 f"newest intact one)")


def read_replicated_once(coord: Coordinator, reach: Reach, m: Manifest, storages: Any, engine: IOEngine, *,
                         verify: bool, what: str) -> tuple[dict[int, torch.Tensor] | None, bool]:
    """Collective: the ``storages`` of a single-process step (``m``: one writer, and every rank
    loads its one tree) read from disk once across the ranks, when every rank needs bytes of
    the same storages (DDP: the model and optimizer whole; FSDP: a block of each): the items
    end to end are cut into N equal aligned shares (``read_split`` of one writer's items on N
    ranks), each rank reads its share and passes it on, and a chunk a share cuts is checked
    whole once the pieces have spread (``read_reached``). Returns ({storage: its buffer, whole},
    True), or (None, whether every rank reaches every file) on every rank when some rank names
    other storages (a digest of them, agreed first: fixed-size messages) or does not reach every
    file they are in (node-local roots): then each rank fetches what it needs (fetch_storages)."""
    together = sorted(s for s in set(storages) if m.storages[s].nbytes)
    sizes = [m.storages[s].nbytes for s in together]
    digest = hashlib.sha256(json.dumps([together, sizes]).encode()).hexdigest()[:32]
    reached = all(reach.paths[m.files[c.file].root] is not None for s in together for c in m.storages[s].chunks
                  if c.length)
    alike, everywhere = coord.decide(None, [digest, reached], f"{what} (reading the state every rank needs together)",
                                     lambda outs: [len({d for d, _ in outs}) == 1, all(r for _, r in outs)],
                                     hint="the live state was not changed")
    if not (alike and everywhere):
        return None, everywhere
    pieces = read_split([[(0, 0, n)] for n in sizes], sizes, 1, coord.world_size)
    shared = SharedRead(tuple(together), tuple(tuple(p) for p in pieces), digest, cut=True)
    return read_reached(coord, reach, m, set(storages), engine, verify=verify, what=what, shared=shared), True


def _runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (offset, length) sorted, the adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for off, n in sorted(r for r in ranges if r[1]):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def _cut_checks(reach: Reach, m: Manifest, chunks: Sequence[tuple[int, int]]) -> list[ChunkCheck]:
    """The checks of the chunks (storage, chunk index) read in parts by several ranks, each
    against its recorded crc32c once whole in its storage's buffer, naming its file."""
    checks = []
    for s, ci in chunks:
        c = m.storages[s].chunks[ci]
        f = m.files[c.file]
        root = reach.paths[f.root]
        name = next((t.name for t in m.tensors if t.storage == s), f"<storage {s}>")
        checks.append(ChunkCheck(s, c.storage_offset, c.length, c.crc32c,
                                 str(root / step_dir_name(m.step) / f.path) if root is not None else f.path, name,
                                 c.file_offset))
    return checks


def _pass_pieces(coord: Coordinator, m: Manifest, shared: SharedRead, buffers: dict[int, torch.Tensor],
                 what: str) -> None:
    """Spread each piece of the items read together from its reader to every loading rank (the
    same schedule on every rank, computed from ``read_split`` alone: no message)."""
    rank, world = coord.rank, coord.world_size
    rounds: list[list[Move]] = []
    for s, split in zip(shared.storages, shared.pieces):
        item = ItemRecord("", m.storages[s].nbytes, None)
        for reader, off, n in split:
            if n:
                for k, a, b in relay(item, reader, rank, world):
                    while len(rounds) <= k:
                        rounds.append([])
                    rounds[k].append(Move(a, b, s, off, n))
    send_rounds(coord, rounds, buffers, {}, what)  # numbered across rounds: a pair's messages never match another's


def plan_indexed(coord: Coordinator, layout: RootLayout, g: GlobalManifest, templates: dict[str, Any], *,
                 what: str, src: int) -> tuple[Manifest, Callable[..., Any]] | None:
    """Collective: the plan of this rank's state of step ``g`` from the shards it needs alone (the
    module docstring): the Manifest of its part, and the fetch that reads it (``read_reached``)
    for load.py's rebuild_state; or None on every rank when the step has no layout index or some
    rank does not see what it needs (then load.py's merging path). The ranks agree that they
    split the replicated items alike (the digest of SharedRead) before any reads them."""
    if g.layout_index is None:
        return None
    plan, error = None, None
    try:
        plan = plan_from_shards(g, reach_of(g, layout), coord.rank, templates, template_of, world=coord.world_size)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e

    def judge(outs: list[Any]) -> dict:
        digests = {x[1] for x in outs if x[0]}
        return {"ok": all(x[0] for x in outs), "alike": len(digests) <= 1}

    verdict = coord.decide(error, [plan is not None, plan[2].digest if plan is not None else None],
                           f"{what} (reading the manifest shards it needs)", judge,
                           hint="the live state was not changed", root=src)
    if not verdict["alike"]:
        raise CorruptCheckpointError(f"{what}: the manifest shards of step {g.step} disagree about the replicated "
                                     f"state every rank saved: the checkpoint is damaged; load an earlier step")
    if not verdict["ok"]:
        return None
    assert plan is not None
    return plan[0], partial(read_reached, shared=plan[2])
