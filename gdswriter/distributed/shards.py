"""Sharded tensors: DTensor (FSDP2, tensor parallel) shards as blocks of a global tensor.

Saving, a DTensor is replaced by its local tensor and remembered as the block
[offsets, offsets + local shape) of its global shape (ShardInfo); ranks holding the same
block (replicas over a mesh dimension) write it once. Loading, each rank computes the block
its live tensor (a DTensor template, or a plain tensor: the whole tensor) needs and fills it
from the intersecting saved blocks, whatever world size and placements saved them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch

from ..errors import CorruptCheckpointError, UnsupportedObjectError
from ..format.manifest import ShardInfo
from ..format.sharded import DTensorLayout, MeshInfo


def join(path: str, part: object) -> str:
    """Key paths as the manifest names tensors ("model/0.weight", "optimizer/state/0/exp_avg")."""
    return f"{path}/{part}" if path else str(part)


def is_dtensor(v: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(v, DTensor)


def leaves(state: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(key path, tensor) for every tensor in nested dicts, lists and tuples."""
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from leaves(v, join(path, k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from leaves(v, join(path, i))


def dtensor_block(t: Any, path: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) of a DTensor's local shard; refuses layouts that are not one block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if p.is_partial():
            raise UnsupportedObjectError(path, t, "a Partial DTensor holds unreduced values: redistribute it to "
                                                  "Shard/Replicate placements before saving")
        if type(p) not in (Shard, Replicate):  # e.g. _StridedShard (FSDP2 + TP): not one block per rank
            raise UnsupportedObjectError(path, t, f"DTensor placement {p} does not make one rectangular block "
                                                  f"per rank; save it through DCP (GDSStorageWriter) instead")
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedObjectError(path, t, f"its local tensor {list(local.shape)} is not the block "
                                              f"{list(shape)} its placements describe")
    return tuple(int(o) for o in offsets), tuple(int(n) for n in shape)


def replica_group(t: Any) -> tuple[int, ...]:
    """The global ranks holding the same block as this rank's shard of DTensor ``t``: those
    whose mesh coordinates equal this rank's on every mesh dimension ``t`` is sharded over (it
    is replicated over the others). Computed from the mesh alone, with no message."""
    mesh = t.device_mesh
    here = mesh.get_coordinate()
    if here is None:
        raise UnsupportedObjectError("", t, "a DTensor on a device mesh this rank is not part of")
    index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(t.placements, here))
    return tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))


def mesh_id(ranks: Sequence[int], shape: Sequence[int]) -> str:
    """A short name for a device mesh (its shape and global ranks), so that what names a block
    does not grow with the mesh's size."""
    return hashlib.sha256(json.dumps([list(shape), list(ranks)]).encode()).hexdigest()[:16]


def split_dtensors(state: Any, path: str = "") -> tuple[Any, dict[str, ShardInfo], dict[str, str],
                                                         dict[str, tuple[int, ...]]]:
    """``state`` with every DTensor replaced by its local tensor (containers on the way copied,
    keeping their type and ``_metadata``), {key path: its block}, {key path: its device mesh's
    mesh_id} (DTensors of one name on different meshes, e.g. pipeline stages, are different
    tensors) and {key path: its replica group} (replica_group). Each mesh and placement is
    looked at once, not once per tensor."""
    found: dict[str, ShardInfo] = {}
    meshes: dict[str, str] = {}
    groups: dict[str, tuple[int, ...]] = {}
    seen: dict[tuple, tuple[str, tuple[int, ...], DTensorLayout]] = {}  # per (mesh, placements): computed once

    def walk(v: Any, p: str) -> Any:
        if is_dtensor(v):
            offsets, _ = dtensor_block(v, p)
            key = (id(v.device_mesh), tuple(v.placements))
            if key not in seen:
                mesh = v.device_mesh.mesh
                ranks = mesh.flatten().tolist()
                layout = DTensorLayout(MeshInfo.of(tuple(mesh.shape), ranks),
                                       tuple(None if q.is_replicate() else int(q.dim) for q in v.placements))
                seen[key] = (mesh_id(ranks, mesh.shape), replica_group(v), layout)
            meshes[p], groups[p], layout = seen[key]
            found[p] = ShardInfo(tuple(v.shape), offsets, layout)
            return v.to_local()
        if isinstance(v, dict):
            out = type(v)((k, walk(x, join(p, k))) for k, x in v.items())
            if hasattr(v, "_metadata"):
                out._metadata = v._metadata  # type: ignore[attr-defined]
            return out
        if type(v) in (list, tuple):
            return type(v)(walk(x, join(p, i)) for i, x in enumerate(v))
        return v

    return walk(state, path), found, meshes, groups


def target_block(template: Any, global_shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...],
                                                                      Callable[[torch.Tensor], Any]]:
    """What a live tensor needs of a saved global tensor: (offsets, shape, wrap), ``wrap`` turning
    the assembled block into what the live state holds (a DTensor like the template, or the tensor)."""
    if template is not None and is_dtensor(template) and tuple(template.shape) == tuple(global_shape):
        from torch.distributed.tensor import DTensor

        offsets, shape = dtensor_block(template)
        device = template.to_local().device

        def wrap(local: torch.Tensor) -> Any:
            return DTensor.from_local(local.to(device), template.device_mesh, template.placements, run_check=False,
                                      shape=template.shape, stride=template.stride())

        return offsets, shape, wrap
    return (0,) * len(global_shape), tuple(global_shape), lambda local: local


def overlap(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]
            ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection [lo, hi) of two blocks, or None when it is empty."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + m, b + n) for a, m, b, n in zip(a_off, a_shape, b_off, b_shape))
    return (lo, hi) if all(h > low for low, h in zip(lo, hi)) else None


def assemble(name: str, offsets: Sequence[int], shape: Sequence[int], dtype: torch.dtype,
             saved: Sequence[tuple[ShardInfo, torch.Tensor]]) -> torch.Tensor:
    """The block [offsets, offsets + shape) of global tensor ``name`` from the saved blocks that
    intersect it; CorruptCheckpointError when they do not cover it."""
    hits = []
    covered = 0
    for info, data in saved:
        hit = overlap(offsets, shape, info.offsets, data.shape)
        if hit is None:
            continue
        hits.append((info, data, hit))
        n = 1
        for low, h in zip(*hit):
            n *= h - low
        covered += n
    total = 1
    for n in shape:
        total *= n
    # Checked before the block is allocated: its shape comes from the manifest (the global shape),
    # and saved blocks that cannot fill it must not make a few bytes on disk a huge allocation.
    if covered != total:
        raise CorruptCheckpointError(f"the saved shards of {name!r} cover {covered} of the {total} elements "
                                     f"of the block {list(offsets)} + {list(shape)} this rank needs: the checkpoint "
                                     f"is incomplete")
    # ... nor may blocks that overlap each other or view one another's bytes (stride 0, shared
    # storage): the blocks of a real save fill the block from distinct bytes, at least as many.
    held = _distinct_bytes([data for _, data, _ in hits])
    if total * dtype.itemsize > held:
        raise CorruptCheckpointError(f"the saved shards of {name!r} hold {held} distinct bytes, too few for the "
                                     f"{total * dtype.itemsize} bytes of the block {list(offsets)} + {list(shape)} "
                                     f"(they overlap or view the same bytes): the checkpoint is damaged; load an "
                                     f"earlier step")
    out = torch.empty(tuple(shape), dtype=dtype)
    for info, data, (lo, hi) in hits:
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))
        src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, info.offsets))
        out[dst] = data[src]
    return out


def _distinct_bytes(views: Sequence[torch.Tensor]) -> int:
    """How many distinct bytes of memory ``views`` span together (each from its first to its last
    element; overlapping spans counted once)."""
    spans = []
    for v in views:
        if v.numel():
            last = sum((n - 1) * st for n, st in zip(v.shape, v.stride()))
            spans.append((v.data_ptr(), v.data_ptr() + (last + 1) * v.element_size()))
    held, reached = 0, 0
    for begin, end in sorted(spans):
        begin = max(begin, reached)
        if end > begin:
            held += end - begin
            reached = end
    return held
