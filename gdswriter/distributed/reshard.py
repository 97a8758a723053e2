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
  the holder set's items that any of its holders records).

It then reads its chunks itself (``read_reached``): no rank receives other ranks' records,
and no message grows with the world size. When some rank does not see a shard or a data file
it needs (node-local roots), or the step has no index (a 1.3 step saved before it existed),
every rank takes the merging path instead (load.py ``gather_merged``), which sends chunks
between ranks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..engines.base import IOEngine
from ..errors import CorruptCheckpointError, UnreachableDataError
from ..format.assembly import remap_tree
from ..format.commit import step_dir_name
from ..format.manifest import MULTI_RANK_VERSION, ChunkRecord, DistInfo, FileRecord, Manifest, StorageRecord, TensorRecord
from ..format.sharded import SHARDED_VERSION, GlobalManifest, RankShard, parse_shard, read_shard
from ..load.reader import host_buffer
from .fetch import Reach, _read_chunks, check_reached_files
from .group import Coordinator
from .rankfiles import item_pieces
from .roots import RootLayout
from .shards import target_block


class _Unreached(Exception):
    """A shard or data file this rank needs is on a root it does not see."""


def plan_from_shards(g: GlobalManifest, reach: list[Path | None], rank: int, templates: dict[str, Any],
                     template_of: Callable[[dict[str, Any], str], Any],
                     read: Callable[[Path, GlobalManifest, Any], bytes] = read_shard
                     ) -> tuple[Manifest, list[int]] | None:
    """(the part of step ``g`` rank ``rank`` needs as a Manifest, the saved ranks whose shards it
    read), from those shards alone; None when one of them, or a data file it needs, is on a root
    this rank does not see. A shard that contradicts the index is CorruptCheckpointError."""
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
        # each item's chunks, from the shards of the holders that wrote its pieces
        order = list(items)
        number = {k: n for n, k in enumerate(order)}
        files: dict[tuple[int, str], int] = {}
        file_list: list[FileRecord] = []
        storages = []
        for key in order:
            r, k = items[key]
            it = shards[r].items[k]
            if it.holder_count(g.world_size) == 1:
                writers = [it.first_holder]
            else:
                if r not in pieces:
                    pieces[r] = item_pieces(shards[r].items, g.world_size)
                writers = sorted({w for w, _, n in pieces[r][k] if n})
            chunks: list[ChunkRecord] = []
            for w in writers:
                sw = shard(w)
                kw = keys[w].get(key)
                if kw is None or sw.items[kw].nbytes != it.nbytes:
                    raise bad(f"rank {w} wrote part of item {key[:40]} ({it.nbytes} bytes) by its holders' "
                              f"split, its manifest shard does not record it so")
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
    m = Manifest(step=g.step, files=tuple(file_list), storages=tuple(storages), tensors=records,
                 state=remap_tree(own.tree, lambda i: where[i]), created_unix=g.created_unix, metadata=g.metadata,
                 version=MULTI_RANK_VERSION, dist=DistInfo(g.world_size, "gdswriter", g.roots))
    try:  # through the 1.2 validation: every item covered once, chunks inside their files, views inside items
        data = m.to_json_bytes()
    except Exception as e:  # noqa: BLE001 - a record no reader accepts: the shards are damaged
        raise bad(f"the shards describe a tensor no reader accepts ({e})") from e
    checked = Manifest.from_json_bytes(data, where=f"step {g.step} (the manifest shards rank {rank} needs)")
    return replace(checked, version=SHARDED_VERSION, created_unix=g.created_unix), sorted(shards)


def read_reached(coord: Coordinator, reach: Reach, m: Manifest, storages: Any, engine: IOEngine, *, verify: bool,
                 what: str) -> dict[int, torch.Tensor]:
    """Collective: fetch.fetch_storages for a manifest whose every chunk this rank reaches (as
    plan_from_shards makes it): each rank reads its own, no rank tells another what it needs.
    Every file is checked against its recorded size on every rank before any buffer is allocated."""
    needed = sorted(set(storages))
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
    return buffers


def load_indexed(coord: Coordinator, layout: RootLayout, g: GlobalManifest, templates: dict[str, Any],
                 optimizer: Any, engine: IOEngine, *, verify: bool, what: str, src: int) -> Any | None:
    """Collective: this rank's state of step ``g`` from the shards it needs alone (the module
    docstring), or None on every rank when the step has no layout index or some rank does not
    see what it needs (then load.py's merging path)."""
    if g.layout_index is None:
        return None
    from .load import _template, reach_of, rebuild_state

    plan, error = None, None
    try:
        plan = plan_from_shards(g, reach_of(g, layout), coord.rank, templates, _template)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (reading the manifest shards it needs)", hint="the live state was not changed",
                root=src)
    if not coord.all_true(plan is not None, f"{what} (every rank sees the shards it needs)", root=src):
        return None
    assert plan is not None
    return rebuild_state(coord, layout, plan[0], templates, optimizer, engine, verify=verify, what=what,
                         fetch=read_reached)
