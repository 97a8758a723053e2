"""Rebuilding a rank's state from a whole step's manifest (the general path of a multi-rank load).

Each rank takes the state tree it saved (a rank the save did not have takes rank 0's) and
works out what it needs: every plain tensor its tree references, and of each sharded tensor
the block its live tensor holds now, assembled from the saved blocks that intersect it; a
single-process step's plain tensor a live DTensor holds becomes that rank's block of it. The
storages are fetched (fetch.py: read where reachable, sent by another rank where not), or read
once across the ranks when every rank needs the same ones (reshard.read_replicated_once).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..engines.base import IOEngine
from ..format.assembly import tree_for_rank
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest, StorageRecord, TensorRecord
from ..format.state_codec import decode_state, tensor_refs
from ..load.reader import tensors_from_storages
from .fetch import fetch_storages, manifest_reach
from .group import Coordinator
from .loadplan import template_of
from .reshard import read_replicated_once
from .roots import RootLayout
from .shards import assemble, is_dtensor, join, leaves, overlap, target_block


def live_templates(state: Any, optimizer: Any) -> dict[str, Any]:
    """Key path -> live tensor (DTensor or plain) of the live ``state`` (as the checkpointer
    collects it), named as the manifest names saved ones; the optimizer's parameters also stand
    for their (not yet created) per-parameter state."""
    out = dict(leaves(state))
    if optimizer is not None and hasattr(optimizer, "param_groups") and isinstance(state.get("optimizer"), dict):
        for saved, group in zip(state["optimizer"].get("param_groups", []), optimizer.param_groups):
            for pid, p in zip(saved.get("params", []), group["params"]):
                out.setdefault(join("optimizer/state", pid), p)
    return out


def plain_blocks(m: Manifest, parts: dict[int, tuple], whole: set[int]) -> tuple[Manifest, dict[int, int], set[int]]:
    """For plain saved tensors (index -> target_block's (offsets, shape, wrap)) of which a live
    DTensor holds a block: ``m`` with a record of each block appended (the same strides, its
    first element as its offset), {tensor index: its block's record} (none for an empty block)
    and the storages added for them. A block whose storage is not needed ``whole`` anyway gets a
    storage of its own made of the saved chunks holding its bytes (whole chunks: each is
    checked against its crc32c), so a rank reads about its block, not the tensor."""
    blocks: dict[int, TensorRecord] = {}
    spans: dict[int, list[int]] = {}  # storage -> [begin, end) of the bytes its blocks touch
    for i, (offsets, shape, _) in parts.items():
        rec = m.tensors[i]
        first = sum(o * s for o, s in zip(offsets, rec.stride)) * dtype_from_name(rec.dtype).itemsize
        block = replace(rec, byte_offset=rec.byte_offset + first, shape=tuple(shape))
        lo, hi = block.byte_extent()
        if hi <= lo:
            continue
        blocks[i] = block
        if rec.storage not in whole:
            span = spans.setdefault(rec.storage, [lo, hi])
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
    storages = list(m.storages)
    moved: dict[int, tuple[int, int]] = {}  # storage -> (the storage standing for it, its first byte there)
    for s, (lo, hi) in spans.items():
        chunks = [c for c in m.storages[s].chunks if c.length and c.storage_offset < hi and lo < c.storage_offset + c.length]
        start, end = min(c.storage_offset for c in chunks), max(c.storage_offset + c.length for c in chunks)
        moved[s] = (len(storages), start)
        storages.append(StorageRecord(end - start, tuple(replace(c, storage_offset=c.storage_offset - start)
                                                         for c in chunks)))
    tensors = list(m.tensors)
    at: dict[int, int] = {}
    for i, block in blocks.items():
        if block.storage in moved:
            k, start = moved[block.storage]
            block = replace(block, storage=k, byte_offset=block.byte_offset - start)
        at[i] = len(tensors)
        tensors.append(block)
    return replace(m, storages=tuple(storages), tensors=tuple(tensors)), at, {k for k, _ in moved.values()}


def rebuild_state(coord: Coordinator, layout: RootLayout, m: Manifest, templates: dict[str, Any],
                  optimizer: Any, engine: IOEngine, *, verify: bool, what: str, fetch: Any = fetch_storages,
                  single: bool = False, read_once: Any = read_replicated_once) -> Any:
    """Collective: the state this rank saved in ``m``, its sharded tensors assembled as the
    ``templates`` (live tensors by key path) hold them now; the whole tensor without one.
    ``fetch``: fetch_storages, or reshard.read_reached when ``m`` is this rank's part alone.
    ``single``: ``m`` is a single-process step (every rank loads its one tree): a plain tensor
    whose live tensor is a DTensor (FSDP, TP) becomes that rank's block of it, and when every
    rank needs bytes of the same storages (DDP: all of them whole; FSDP: a block of each) they
    are read from disk once across the ranks (reshard.read_replicated_once: each rank about
    1 / N; ``read_once``: that function, or a stand-in that declines); else each rank reads what it needs, of a block the saved chunks holding it
    (``plain_blocks``), or where some rank does not reach the files (node-local roots: ranks
    then read chunks for each other, named by the storages every rank has) the storages whole."""
    unchanged = "the live state was not changed"
    needed: set[int] = set()
    jobs: dict[str, tuple] = {}
    parts: dict[int, tuple] = {}  # a plain saved tensor a live DTensor holds: index -> target_block's answer
    refs: list[int] = []
    tree = None
    error = None
    spanned: set[int] = set()
    alone: tuple[Manifest, dict[int, int], set[int]] = (m, {}, set())
    together = alone
    try:
        tree = tree_for_rank(m, coord.rank)
        refs = tensor_refs(tree, len(m.tensors))
        for i in refs:
            rec = m.tensors[i]
            template = template_of(templates, rec.name) if single and rec.shard is None else None
            if template is not None and is_dtensor(template) and tuple(template.shape) == tuple(rec.shape):
                parts[i] = target_block(template, rec.shape)
            elif rec.shard is None:
                needed.add(rec.storage)
            elif rec.name not in jobs:
                offsets, shape, wrap = target_block(template_of(templates, rec.name), rec.shard.global_shape)
                blocks = [j for j, r in enumerate(m.tensors) if r.shard is not None and r.name == rec.name
                          and overlap(offsets, shape, r.shard.offsets, r.shape) is not None]
                needed.update(m.tensors[j].storage for j in blocks)
                jobs[rec.name] = (offsets, shape, wrap, blocks)
        spanned = needed | {m.tensors[i].storage for i in parts}  # every storage this rank needs bytes of
        alone = plain_blocks(m, parts, needed) if parts else (m, {}, set())  # its blocks' chunks, read alone
        together = plain_blocks(m, parts, spanned) if parts else alone  # its blocks in the storages read together
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (planning)", hint=unchanged)
    # buffers are allocated once every rank has checked the files it reads (fetch_storages)
    reach = manifest_reach(m, layout)
    buffers, reached = None, True
    if single and coord.world_size > 1:  # None: the ranks do not need the same storages, or some do not reach them
        buffers, reached = read_once(coord, reach, m, spanned, engine, verify=verify, what=what)
    if buffers is None and reached:  # every rank reads its own chunks (a block's alone)
        read, block_of, partial = alone
        buffers = fetch(coord, reach, read, needed | partial, engine, verify=verify, what=what)
    elif buffers is None:  # ranks read chunks for others (node-local roots): named alike on every rank, whole
        read, block_of, partial = together
        buffers = fetch(coord, reach, read, spanned, engine, verify=verify, what=what)
    else:
        read, block_of, partial = together
    error, state = None, None
    try:
        state = _assemble(m, tree, refs, parts, jobs, read, block_of, buffers)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (rebuilding the state)", hint=unchanged)
    return state


def _assemble(m: Manifest, tree: Any, refs: list[int], parts: dict[int, tuple], jobs: dict[str, tuple],
              read: Manifest, block_of: dict[int, int], buffers: Any) -> Any:
    """The state of ``tree`` from the storages read (``read``'s records, in ``buffers``): plain
    tensors as saved, sharded ones assembled from their saved blocks (``jobs``), a plain
    tensor's block (``parts``) from its own record (``block_of``)."""
    views = [i for i in refs if m.tensors[i].shard is None and i not in parts]
    views += sorted({j for *_, blocks in jobs.values() for j in blocks}) + sorted(block_of.values())
    built = dict(zip(views, tensors_from_storages(replace(read, tensors=tuple(read.tensors[i] for i in views)),
                                                  buffers)))
    tensors = [built.get(i, torch.empty(0, dtype=dtype_from_name(r.dtype))) for i, r in enumerate(m.tensors)]
    for i in refs:
        rec = m.tensors[i]
        if i in parts:
            _, shape, wrap = parts[i]
            j = block_of.get(i)
            tensors[i] = wrap(built[j].contiguous() if j is not None else
                              torch.empty(shape, dtype=dtype_from_name(rec.dtype)))
        elif rec.shard is not None:
            offsets, shape, wrap, blocks = jobs[rec.name]
            local = assemble(rec.name, offsets, shape, dtype_from_name(rec.dtype),
                             [(m.tensors[j].shard, built[j]) for j in blocks])
            tensors[i] = wrap(local)
    return decode_state(tree, tensors)
