"""Rank 0 builds the one manifest of a multi-rank step from every rank's report.

A report (JSON, sent in the vote) says what one rank wrote::

    {"files":   [[table root, name, size, info], ...],           this rank's data files
     "chunks":  [[item, file, file_offset, item_offset, length, crc32c], ...]
     "records": [[item, [name, byte_offset, dtype, shape, stride, device, kind, shard]], ...]
     "tree":    the rank's encoded state tree (or null),
     "tensors": [[item, position], ...]}                          its tensor i = that record

``item`` is a storage's index in the save's item list (which every rank derives alike);
``file`` indexes the rank's own files. Every item is described (records) by one rank.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Sequence

from ..errors import CorruptCheckpointError, GDSWriterError
from .manifest import (MULTI_RANK_VERSION, ChunkRecord, DistInfo, FileRecord, Manifest, RootInfo,
                               ShardInfo, StorageRecord, TensorRecord)


def record_json(rec: TensorRecord) -> list:
    shard = [list(rec.shard.global_shape), list(rec.shard.offsets)] if rec.shard is not None else None
    return [rec.name, rec.byte_offset, rec.dtype, list(rec.shape), list(rec.stride), rec.device, rec.kind, shard]


def record_from_json(item: int, x: list) -> TensorRecord:
    name, byte_offset, dtype, shape, stride, device, kind, shard = x
    return TensorRecord(name, item, byte_offset, dtype, tuple(shape), tuple(stride), device, kind,
                        ShardInfo(tuple(shard[0]), tuple(shard[1])) if shard is not None else None)


def remap_tree(tree: Any, index: Any) -> Any:
    """``tree`` with every tensor reference i replaced by index(i)."""
    if isinstance(tree, list):
        return [remap_tree(x, index) for x in tree]
    if isinstance(tree, dict):
        if len(tree) == 1 and ("$tensor" in tree or "$ndarray" in tree):
            (tag, i), = tree.items()
            return {tag: index(i)}
        return {k: remap_tree(x, index) for k, x in tree.items()}
    return tree


def _pairs(tree: Any) -> list:
    if not (isinstance(tree, dict) and len(tree) == 1 and isinstance(tree.get("$dict"), list)):
        raise GDSWriterError("a multi-rank GDSCheckpointer state must be a dict at the top")
    return tree["$dict"]


def tree_for_rank(m: Manifest, rank: int) -> Any:
    """The state tree rank ``rank`` saved: ``state`` with that rank's own top-level entries. A rank
    beyond the saved world (loading on more ranks) gets rank 0's."""
    overrides = m.dist.rank_states.get(rank) if m.dist is not None else None
    if not overrides:
        return m.state
    pairs = [list(p) for p in _pairs(m.state)]
    for k, v in overrides:
        hit = next((p for p in pairs if p[0] == k), None)
        if hit is None:
            pairs.append([k, v])
        else:
            hit[1] = v
    return {"$dict": pairs}


def build_manifest(step: int, items: Sequence[int], reports: Sequence[dict], table: Sequence[RootInfo], *,
                   layout: str, metadata: dict, state: Any = None, dcp: dict | None = None) -> Manifest:
    """The manifest of a multi-rank step. ``items`` are the storages' sizes. With ``state``
    None, the state is rank 0's tree and ranks whose trees differ keep their own entries."""
    files: list[FileRecord] = []
    chunks: list[list[ChunkRecord]] = [[] for _ in items]
    described: dict[int, list[TensorRecord]] = {}
    for rep in reports:
        base = len(files)
        files += [FileRecord(root, name, size, info) for root, name, size, info in rep["files"]]
        for item, f, file_offset, item_offset, length, crc in rep["chunks"]:
            chunks[item].append(ChunkRecord(base + f, file_offset, item_offset, length, crc))
        for item, rec in rep["records"]:
            described.setdefault(item, []).append(record_from_json(item, rec))
    storages = tuple(StorageRecord(n, tuple(sorted(cs, key=lambda c: c.storage_offset))) for n, cs in zip(items, chunks))
    tensors: list[TensorRecord] = []
    first: dict[int, int] = {}
    for item in range(len(items)):
        first[item] = len(tensors)
        tensors += described.get(item, [])
    canonical: dict[str, int] = {}  # a sharded tensor's leaves all point at its first block
    for i, rec in enumerate(tensors):
        if rec.shard is not None:
            canonical.setdefault(rec.name, i)

    def index_of(rep: dict) -> Any:
        refs = rep["tensors"]

        def index(i: int) -> int:
            item, pos = refs[i]
            if pos >= len(described.get(item, ())):  # a holder with more views of an item than its first
                raise CorruptCheckpointError(f"step {step}: item {item} has {len(described.get(item, ()))} tensor "
                                             f"records, a rank's state refers to view {pos} of it: the checkpoint "
                                             f"is damaged; load an earlier step")
            g = first[item] + pos
            return canonical.get(tensors[g].name, g) if tensors[g].shard is not None else g
        return index

    rank_states: dict[int, list] = {}
    if state is None:
        trees = [remap_tree(rep["tree"], index_of(rep)) for rep in reports]
        state = trees[0]
        base_pairs = _pairs(state)
        for r, tree in enumerate(trees[1:], start=1):
            own = [p for p in _pairs(tree) if p not in base_pairs]
            if own:
                rank_states[r] = own
    dist = DistInfo(len(reports), layout, tuple(table), rank_states, dcp)
    return Manifest(step=step, files=tuple(files), storages=storages, tensors=tuple(tensors), state=state,
                    created_unix=time.time(), metadata=dict(metadata), version=MULTI_RANK_VERSION, dist=dist)
