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
  writing a part), only the shards of the writers whose pieces it reads for every rank: saved
  rank w's pieces are read by loading rank w mod N (``reader_of``; N: the loading world), and
  spread from there to every rank (``SharedRead``), so a rank opens about W / N of those
  shards, reads about 1 / N of the replicated bytes, and they are read from disk once in all.
  Every rank computes the save's split from its own tree's shard (item_pieces), so no record
  of another writer travels; the ranks agree on a digest of the split's items first.

It then reads its chunks itself (``read_reached``): no rank receives other ranks' records,
and no message grows with the world size. When some rank does not see a shard or a data file
it needs (node-local roots), or the step has no index (a 1.3 step saved before it existed),
every rank takes the merging path instead (load.py ``gather_merged``), which sends chunks
between ranks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..engines.base import IOEngine
from ..errors import CorruptCheckpointError, UnreachableDataError
from ..format.assembly import remap_tree
from ..format.commit import step_dir_name
from ..format.manifest import MULTI_RANK_VERSION, ChunkRecord, DistInfo, FileRecord, Manifest, StorageRecord, TensorRecord
from ..format.sharded import SHARDED_VERSION, GlobalManifest, ItemRecord, RankShard, parse_shard, read_shard
from ..load.reader import host_buffer
from .fetch import Reach, _read_chunks, check_reached_files
from .group import Coordinator, Transfer
from .rankfiles import item_pieces
from .roots import RootLayout
from .shards import target_block


class _Unreached(Exception):
    """A shard or data file this rank needs is on a root it does not see."""


@dataclass(frozen=True)
class SharedRead:
    """The replicated items (DistOptions.replicated: every saved rank held them) that the loading
    ranks read together: a loading rank reads the pieces of the writers ``reader_of`` gives it
    and passes them on, so it opens only those writers' manifest shards. ``storages``: their
    numbers in the plan's Manifest (where each records only this rank's chunks), in key order;
    ``pieces``: per storage, the save's split (writer, offset, length); ``digest``: of the saved
    set they belong to (its keys and sizes), the same on every loading rank or the split is not."""

    storages: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    digest: str


def reader_of(writer: int, world: int) -> int:
    """The loading rank (of ``world``) that reads the pieces saved rank ``writer`` wrote of the
    replicated items: writer mod world, so a loading rank reads its own rank's pieces (the shard
    whose tree it takes) and every world-th writer's after it."""
    return writer % world


def _every_rank_set(items: Sequence[ItemRecord]) -> str:
    """A digest of the items every saved rank holds (their split depends on all of them)."""
    every = sorted([it.key, it.nbytes] for it in items if it.holders is None)
    return hashlib.sha256(json.dumps(every).encode()).hexdigest()[:32]


def _read_together(it: ItemRecord, saved_world: int) -> bool:
    """Whether the loading ranks read item ``it`` together (SharedRead): replicated state that
    every saved rank held and wrote a part of; every loading rank needs all of it."""
    return it.holders is None and it.key.startswith("R") and saved_world > 1


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
    shards: dict[int, RankShard] = {}
    keys: dict[int, dict[str, int]] = {}
    blocks_of: dict[int, dict[tuple, list[TensorRecord]]] = {}  # per shard: (name, offsets) -> its records
    pieces: dict[int, list] = {}

    def shard(r: int) -> RankShard:
        if r not in shards:
            ref = g.shards[r]
            root = reach[ref.root]
            if root is None:
                raise _Unreached()
            d = root / step_dir_name(g.step)
            shards[r] = parse_shard(read(d, g, ref), g, ref, str(d / ref.name))
            keys[r] = {it.key: k for k, it in enumerate(shards[r].items)}
            blocks_of[r] = {}
            for t in shards[r].tensors:
                if t.shard is not None:
                    blocks_of[r].setdefault((t.name, t.shard.offsets), []).append(t)
        return shards[r]

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"step {g.step}: {msg}; the checkpoint is damaged: load an earlier step")

    try:
        tree_rank = rank if rank < g.world_size else 0
        own = shard(tree_rank)
        items: dict[str, tuple[int, int]] = {}  # key -> (a holder's rank, the item's index in its shard)
        tensors: list[TensorRecord] = []
        where: dict[int, int] = {}  # the tree shard's tensor index -> ours
        names: dict[str, int] = {}  # a sharded tensor -> our first block of it
        from .load import tensor_refs

        def add(r: int, rec: TensorRecord) -> int:
            it = shards[r].items[rec.storage]
            items.setdefault(it.key, (r, rec.storage))
            tensors.append(replace(rec, storage=it.key))  # type: ignore[arg-type] - numbered below
            return len(tensors) - 1

        for i in tensor_refs(own.tree):
            if not 0 <= i < len(own.tensors):
                raise bad(f"rank {tree_rank}'s state tree references tensor {i} of {len(own.tensors)}")
            rec = own.tensors[i]
            if rec.shard is None:
                where[i] = add(tree_rank, rec)
                continue
            if rec.name in names:
                where[i] = names[rec.name]
                continue
            entry = index.entries.get(rec.name)
            if entry is None or entry.global_shape != rec.shard.global_shape or entry.dtype != rec.dtype:
                raise bad(f"rank {tree_rank}'s manifest shard has DTensor {rec.name[:200]!r} (global shape "
                          f"{list(rec.shard.global_shape)}, {rec.dtype}) that the layout index "
                          + ("does not list" if entry is None else
                             f"describes as {list(entry.global_shape)}, {entry.dtype}"))
            offsets, shape, _ = target_block(template_of(templates, rec.name), rec.shard.global_shape)
            blocks = entry.overlapping(offsets, shape)
            if not blocks:  # an empty block: any record of the name stands for it
                names[rec.name] = where[i] = add(tree_rank, rec)
                continue
            for holder, boff, bshape in blocks:
                shard(holder)
                held = blocks_of[holder].get((rec.name, boff), [])
                if len(held) != 1 or held[0].shape != bshape or held[0].shard.global_shape != entry.global_shape \
                        or held[0].dtype != entry.dtype:
                    raise bad(f"the layout index says rank {holder} holds the block {list(boff)} + {list(bshape)} "
                              f"of {rec.name[:200]!r}, its manifest shard does not")
                j = add(holder, held[0])
                names.setdefault(rec.name, j)
            where[i] = names[rec.name]
        # the replicated items, read together: all of them, whatever this rank's tree references
        for k, it in enumerate(own.items):
            if _read_together(it, g.world_size):
                items[it.key] = (tree_rank, k)
        # each item's chunks, from the shards of the holders that wrote its pieces (of an item
        # read together, those of the writers this rank reads for every rank)
        order = list(items)
        number = {k: n for n, k in enumerate(order)}
        files: dict[tuple[int, str], int] = {}
        file_list: list[FileRecord] = []
        storages = []
        together: list[int] = []
        split: list[tuple[tuple[int, int, int], ...]] = []
        from .load import _tiles

        for key in order:
            r, k = items[key]
            it = shards[r].items[k]
            if it.holder_count(g.world_size) == 1:
                writers = [it.first_holder]
            else:
                if r not in pieces:
                    pieces[r] = item_pieces(shards[r].items, g.world_size)
                writers = sorted({w for w, _, n in pieces[r][k] if n})
            shared = _read_together(it, g.world_size)
            if shared:
                together.append(number[key])
                split.append(tuple(pieces[r][k]))
                writers = [w for w in writers if reader_of(w, world) == rank]
            chunks: list[ChunkRecord] = []
            for w in writers:
                sw = shard(w)
                kw = keys[w].get(key)
                if kw is None or sw.items[kw].nbytes != it.nbytes:
                    raise bad(f"rank {w} wrote part of item {key[:40]} ({it.nbytes} bytes) by its holders' "
                              f"split, its manifest shard does not record it so")
                if shared and not _tiles(sw.chunks[kw], [(off, n) for v, off, n in split[-1] if v == w]):
                    raise bad(f"rank {w}'s manifest shard does not record exactly the pieces of item {key[:40]} "
                              f"its holders' split gives it")
                for c in sw.chunks[kw]:
                    f = sw.files[c.file]
                    fid = files.setdefault((f.root, f.path), len(file_list))
                    if fid == len(file_list):
                        file_list.append(f)
                    chunks.append(replace(c, file=fid))
            storages.append(StorageRecord(it.nbytes, tuple(sorted(chunks, key=lambda c: c.storage_offset))))
        if any(reach[f.root] is None for f in file_list):
            raise _Unreached()
    except _Unreached:
        return None
    records = tuple(replace(t, storage=number[t.storage]) for t in tensors)  # type: ignore[index]
    # its root table: the roots its files are on (renumbered), not the step's (a root per rank or more)
    used = sorted({f.root for f in file_list}) or [0]
    renumber = {r: k for k, r in enumerate(used)}
    file_list = [replace(f, root=renumber[f.root]) for f in file_list]
    m = Manifest(step=g.step, files=tuple(file_list), storages=tuple(storages), tensors=records,
                 state=remap_tree(own.tree, lambda i: where[i]), created_unix=g.created_unix, metadata=g.metadata,
                 version=MULTI_RANK_VERSION, dist=DistInfo(g.world_size, "gdswriter", tuple(g.roots[r] for r in used)))
    try:  # through the 1.2 validation: every item covered once, chunks inside their files, views inside items
        data = _covered(m, together).to_json_bytes()
    except Exception as e:  # noqa: BLE001 - a record no reader accepts: the shards are damaged
        raise bad(f"the shards describe a tensor no reader accepts ({e})") from e
    checked = Manifest.from_json_bytes(data, where=f"step {g.step} (the manifest shards rank {rank} needs)")
    checked = replace(checked, files=m.files, storages=m.storages, version=SHARDED_VERSION,
                      created_unix=g.created_unix)
    return checked, sorted(shards), SharedRead(tuple(together), tuple(split), _every_rank_set(own.items))


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
    The items ``shared`` names are read together: each rank reads the pieces of its writers
    (``reader_of``) and every piece spreads from its reader to every rank down a binomial tree
    (load.py ``relay``), so their bytes are read from disk once in all, as in a load of the same
    layout (the reader checks each chunk's crc32c; a receiver has no records of them)."""
    together = shared.storages if shared is not None else ()
    needed = sorted(set(storages) | set(together))
    mine = [(s, ci) for s in needed for ci, c in enumerate(m.storages[s].chunks) if c.length]
    error = None
    try:
        if any(reach.paths[m.files[m.storages[s].chunks[ci].file].root] is None for s, ci in mine):
            raise UnreachableDataError(2, f"{what}: a data file this rank needs is on a root it does not see")
        check_reached_files(m, reach, {m.storages[s].chunks[ci].file for s, ci in mine})
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (checking the data files)", hint="the live state was not changed")
    buffers: dict[int, torch.Tensor] = {}
    error = None
    try:
        buffers = {s: host_buffer(m.storages[s].nbytes) for s in needed}
        wanted = []
        for s, ci in mine:
            c = m.storages[s].chunks[ci]
            wanted.append((s, ci, buffers[s][c.storage_offset:c.storage_offset + c.length]))
        _read_chunks(m, reach, wanted, engine, verify=verify)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (reading)", hint="the live state was not changed")
    if shared is not None:
        _pass_pieces(coord, m, shared, buffers, what)
    return buffers


def _pass_pieces(coord: Coordinator, m: Manifest, shared: SharedRead, buffers: dict[int, torch.Tensor],
                 what: str) -> None:
    """Spread each piece of the items read together from its reader to every loading rank (the
    same schedule on every rank, computed from the save's split alone: no message)."""
    from .load import relay

    rank, world = coord.rank, coord.world_size
    rounds: list[list[tuple[int, int, int, int, int]]] = []
    for s, split in zip(shared.storages, shared.pieces):
        item = ItemRecord("", m.storages[s].nbytes, None)
        for w, off, n in split:
            if n:
                for k, a, b in relay(item, reader_of(w, world), rank, world):
                    while len(rounds) <= k:
                        rounds.append([])
                    rounds[k].append((a, b, s, off, n))
    tags: dict[tuple[int, int], int] = {}  # numbered across rounds: a pair's messages never match another's
    for k, moves in enumerate(rounds):
        transfers = []
        for a, b, s, off, n in moves:
            tag = tags[(a, b)] = tags.get((a, b), -1) + 1
            transfers.append(Transfer(a, b, tag, buffers[s][off:off + n]))
        coord.exchange(transfers, f"{what} (sending replicated pieces, round {k + 1})")


def load_indexed(coord: Coordinator, layout: RootLayout, g: GlobalManifest, templates: dict[str, Any],
                 optimizer: Any, engine: IOEngine, *, verify: bool, what: str, src: int) -> Any | None:
    """Collective: this rank's state of step ``g`` from the shards it needs alone (the module
    docstring), or None on every rank when the step has no layout index or some rank does not
    see what it needs (then load.py's merging path). The ranks agree that they split the
    replicated items alike (the digest of SharedRead) before any reads them."""
    if g.layout_index is None:
        return None
    from .load import _template, reach_of, rebuild_state

    plan, error = None, None
    try:
        plan = plan_from_shards(g, reach_of(g, layout), coord.rank, templates, _template, world=coord.world_size)
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
    return rebuild_state(coord, layout, plan[0], templates, optimizer, engine, verify=verify, what=what,
                         fetch=partial(read_reached, shared=plan[2]))
