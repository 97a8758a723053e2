"""DCP's Metadata as JSON, so a DCP checkpoint's manifest needs no pickle.

Encodes torch.distributed.checkpoint.metadata's dataclasses (Metadata, TensorStorageMetadata,
BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta)
field by field; ``planner_data`` goes through gdswriter's state codec (DCP's default planner
puts tuples of key names there); ``storage_data`` maps each MetadataIndex to the index of the
manifest's tensor record holding it. Decoding treats its input as untrusted: anything
malformed raises CorruptCheckpointError.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ..errors import CorruptCheckpointError, UnsupportedObjectError
from ..format.dtypes import dtype_from_name, dtype_to_name
from ..format.state_codec import decode_state, encode_state, shown

_INT64 = 1 << 63
_MAX_DIMS = 64

_LAYOUTS = {str(v).removeprefix("torch."): v for v in (getattr(torch, n, None) for n in (
    "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"))
    if isinstance(v, torch.layout)}
_FORMATS = {str(v).removeprefix("torch."): v for v in (
    torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)}


def _name(v: Any, table: dict) -> str:
    for k, x in table.items():
        if x == v:
            return k
    raise UnsupportedObjectError("dcp metadata", v, f"{v} has no name in the DCP metadata codec")


def properties_to_json(p: TensorProperties) -> dict:
    return {"dtype": dtype_to_name(p.dtype), "layout": _name(p.layout, _LAYOUTS), "requires_grad": bool(p.requires_grad),
            "memory_format": _name(p.memory_format, _FORMATS), "pin_memory": bool(p.pin_memory)}


def index_to_json(i: MetadataIndex) -> list:
    return [i.fqn, list(i.offset) if i.offset is not None else None]


def metadata_to_json(md: Metadata) -> dict:
    """``md`` as plain JSON. ``storage_data`` must map MetadataIndex to ints (record indices)."""
    entries = []
    for fqn, e in md.state_dict_metadata.items():
        if isinstance(e, BytesStorageMetadata):
            entries.append([fqn, {"bytes": {}}])
        else:
            entries.append([fqn, {"tensor": {"properties": properties_to_json(e.properties), "size": list(e.size),
                                             "chunks": [[list(c.offsets), list(c.sizes)] for c in e.chunks]}}])
    planner = None
    if md.planner_data is not None:
        planner, tensors = encode_state(md.planner_data, key_path="planner_data")
        if tensors:
            raise UnsupportedObjectError("planner_data", md.planner_data, "a DCP planner put tensors in its "
                                                                          "planner_data")
    storage = None
    if md.storage_data is not None:
        storage = []
        for k, v in md.storage_data.items():
            if not isinstance(k, MetadataIndex) or not isinstance(v, int):
                raise UnsupportedObjectError("storage_data", v, "storage_data must map MetadataIndex to ints")
            storage.append(index_to_json(k) + [v])
    sm = md.storage_meta
    meta = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id), "save_id": sm.save_id,
        "load_id": sm.load_id, "modules": list(sm.modules)}
    return {"version": md.version, "state_dict_metadata": entries, "planner_data": planner,
            "storage_data": storage, "storage_meta": meta}


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"the DCP metadata in the manifest is damaged: {msg}; load an earlier step")


def _ints(v: Any) -> list[int]:
    """Sizes and offsets: torch keeps them as int64 (a torch.Size takes a larger int, and fails
    later, wherever it is used)."""
    if not isinstance(v, list) or len(v) > _MAX_DIMS or not all(type(x) is int and 0 <= x < _INT64 for x in v):
        raise _bad(f"expected a list of at most {_MAX_DIMS} integers in [0, 2**63), got {shown(v, 80)}")
    return v


def _opt_str(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _bad(f"expected a string, got {str(v)[:80]}")
    return v


def _tensor_entry(fqn: str, t: dict) -> TensorStorageMetadata:
    """A tensor item's metadata (its properties, size and chunks), validated; the caller turns
    a KeyError, TypeError or ValueError into CorruptCheckpointError."""
    p = t["properties"]
    if p["layout"] not in _LAYOUTS or p["memory_format"] not in _FORMATS or not isinstance(
            p["requires_grad"], bool) or not isinstance(p["pin_memory"], bool):
        raise _bad(f"bad tensor properties of {fqn!r}")
    props = TensorProperties(dtype=dtype_from_name(p["dtype"]), layout=_LAYOUTS[p["layout"]],
                             requires_grad=p["requires_grad"], memory_format=_FORMATS[p["memory_format"]],
                             pin_memory=p["pin_memory"])
    size = _ints(t["size"])
    chunks = []
    for off, sizes in t["chunks"]:
        if len(_ints(off)) != len(size) or len(_ints(sizes)) != len(size):
            raise _bad(f"a chunk of {fqn!r} has the wrong number of dimensions")
        if any(o + n > s for o, n, s in zip(off, sizes, size)):
            raise _bad(f"a chunk of {fqn!r} lies outside its tensor's size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _storage_data(entries: Any) -> dict[MetadataIndex, int] | None:
    if entries is None:
        return None
    storage = {}
    for fqn, off, v in entries:
        if not isinstance(fqn, str) or type(v) is not int:
            raise _bad("bad storage_data entry")
        storage[MetadataIndex(fqn, _ints(off) if off is not None else None)] = v
    return storage


def metadata_from_json(x: Any) -> Metadata:
    """The Metadata ``metadata_to_json`` wrote (validated)."""
    try:
        sdm: dict = {}
        for fqn, e in x["state_dict_metadata"]:
            if not isinstance(fqn, str) or fqn in sdm or not isinstance(e, dict) or len(e) != 1:
                raise _bad(f"bad entry for {str(fqn)[:80]}")
            sdm[fqn] = BytesStorageMetadata() if "bytes" in e else _tensor_entry(fqn, e["tensor"])
        planner = None if x["planner_data"] is None else decode_state(x["planner_data"], [])
        storage = _storage_data(x["storage_data"])
        sm = x["storage_meta"]
        meta = None if sm is None else StorageMeta(
            checkpoint_id=_opt_str(sm["checkpoint_id"]), save_id=_opt_str(sm["save_id"]),
            load_id=_opt_str(sm["load_id"]), modules=[m for m in sm["modules"] if isinstance(m, str)])
        return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage, storage_meta=meta,
                        version=_opt_str(x["version"]))
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(f"{type(e).__name__}: {e}") from e
