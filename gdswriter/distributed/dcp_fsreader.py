"""A checkpoint DCP's own FileSystemWriter wrote (``.metadata`` pickle, ``__R_N.distcp`` files),
read by GDSStorageReader, so a job can switch to gdswriter and resume from its existing
checkpoints (FileSystemReader's job, without its ``pickle.load``).

What is unpickled, and how (house rule 7: loading never unpickles untrusted bytes):

* ``.metadata`` is DCP's pickled ``Metadata``. It is read (at most MAX_METADATA_BYTES, checked
  before the read), its opcodes walked first (pickletools: a counted argument longer than the
  file is refused before the C unpickler would allocate what it claims), and loaded by a
  restricted unpickler: its ``find_class`` admits only DCP's
  metadata classes, torch's Size/dtype/layout/memory_format, pathlib's paths and plain
  containers, as ``torch.load(weights_only=True)`` does with its allowlist; anything else (a
  pickle calling ``os.system``) is UnsafeMetadataError before it is called. The result is then
  checked: a Metadata whose storage_data maps each item to a plain file name in the directory,
  an offset and a length, with no stream transforms.
* each tensor item in a data file is a ``torch.save`` archive: its recorded byte range is
  checked against the file's size before anything is allocated, then loaded with
  ``torch.load(weights_only=True)`` (torch's own allowlist: FileSystemReader's call) and
  checked against the item's dtype and chunk size before DCP gets it.
* each BytesIO item is a ``torch.save`` archive too, which DCP's planner loads with
  ``weights_only=False``: it is first restricted-loaded here (``weights_only=True``) and refused
  with UnsafeMetadataError unless that succeeds, so only allowlisted content reaches the planner.

Every rank reads ``.metadata`` and its own items itself, with no collective, as FileSystemReader
does (the directory is on storage every rank sees).
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from ..errors import CorruptCheckpointError, UnsafeMetadataError
from ..fs import open_regular, read_regular_file
from .dcp_paths import MARKER_NAME, is_gdswriter_marker

MAX_METADATA_BYTES = 1 << 30  # DCP's metadata of a very large job is tens of MiB
_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _MD: frozenset({"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}


def _layout_named(name: Any) -> torch.layout:
    """torch.layout by its str (what torch pickles a layout as: serialization._get_layout), nothing else."""
    for v in vars(torch).values():
        if isinstance(v, torch.layout) and str(v) == name:
            return v
    raise UnsafeMetadataError(f"DCP metadata names the layout {name!r}, which torch does not have: refused")


class _RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only the allowlisted classes and torch's dtype-like constants."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout_named
        if name in _ALLOWED.get(module, ()):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch":  # torch.float32, torch.strided, torch.contiguous_format: values, not callables
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeMetadataError(f"DCP metadata names {module}.{name}, which is not one of DCP's metadata "
                                  f"classes: gdswriter does not unpickle it (it could run any code). If this "
                                  f"checkpoint is yours and trusted, load it with DCP's FileSystemReader")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("DCP metadata holds a persistent reference, which DCP never writes: refused")


def is_fs_checkpoint(path: Path) -> bool:
    """``path`` is a directory holding DCP's pickled ``.metadata`` (not gdswriter's marker)."""
    md = path / MARKER_NAME
    try:
        return stat.S_ISREG(os.lstat(md).st_mode) and not is_gdswriter_marker(md)
    except OSError:
        return False


def load_metadata_bytes(data: bytes, where: str = ".metadata") -> Metadata:
    """DCP's Metadata from its pickle, through the restricted unpickler, checked (check_metadata)."""
    try:
        _check_opcodes(data)
        md = _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle
        raise CorruptCheckpointError(f"{where}: not DCP's metadata ({type(e).__name__}: {e}); the checkpoint "
                                     f"is damaged or was not written by DCP's FileSystemWriter") from e
    check_metadata(md, where)
    return md


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle's opcodes before it is loaded (pickletools reads each counted argument from
    the bytes there are, allocating nothing a length claims): a BINBYTES8 or BYTEARRAY8 claiming
    more bytes than the file holds, which the C unpickler would allocate before reading, is
    refused here; so are persistent ids and the extension registry, which DCP never writes."""
    for op, _, _ in pickletools.genops(data):
        if op.name in ("PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"):
            raise UnsafeMetadataError(f"DCP metadata uses the pickle opcode {op.name}, which DCP never writes: "
                                      f"refused")


def read_fs_metadata(path: Path) -> Metadata:
    """The Metadata of the FileSystemWriter checkpoint in directory ``path``."""
    where = str(path / MARKER_NAME)
    return load_metadata_bytes(read_regular_file(path / MARKER_NAME, MAX_METADATA_BYTES), where)


def check_metadata(md: Any, where: str) -> None:
    """CorruptCheckpointError unless ``md`` is a Metadata whose storage_data maps MetadataIndex to
    a file name in the directory (no separator, not a dot name), an int offset and length >= 0,
    and no stream transform (gdswriter applies none: FileSystemReader's extensions read those)."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) or not isinstance(
            md.storage_data, dict):
        raise CorruptCheckpointError(f"{where}: not DCP's Metadata with a storage_data map; the checkpoint is "
                                     f"damaged or was not written by DCP's FileSystemWriter")
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(index, MetadataIndex) or not isinstance(name, str) or name in ("", ".", "..") or (
                "/" in name or "\0" in name) or type(offset) is not int or type(length) is not int or min(
                offset, length) < 0:
            raise CorruptCheckpointError(f"{where}: a damaged storage entry for {index!r} ({info!r}); load an "
                                         f"earlier checkpoint")
        if getattr(info, "transform_descriptors", None):
            raise CorruptCheckpointError(f"{where}: item {index.fqn!r} was written through stream transforms "
                                         f"{info.transform_descriptors!r}, which gdswriter does not apply: read "
                                         f"this checkpoint with DCP's FileSystemReader")


def fs_metadata_for_load(path: Path, load_id: str) -> Metadata:
    """read_fs_metadata, with the load's id set in its storage_meta (as FileSystemReader does)."""
    md = read_fs_metadata(path)
    if not isinstance(md.storage_meta, StorageMeta):
        md.storage_meta = StorageMeta()
    md.storage_meta.load_id = load_id
    return md


def read_fs_items(path: Path, md: Metadata, plan: LoadPlan, planner: LoadPlanner) -> None:
    """Hand DCP each item of ``plan`` from the data files of the checkpoint in ``path``."""
    per_file: dict[str, list[Any]] = {}
    for req in plan.items:
        info = md.storage_data.get(req.storage_index)
        if info is None:
            raise CorruptCheckpointError(f"{path}: DCP asks for {req.storage_index}, which its metadata does not "
                                         f"map to a data file")
        per_file.setdefault(info.relative_path, []).append(req)
    for name, reqs in per_file.items():
        fd, _ = open_regular(str(path / name), False)
        try:
            size = os.fstat(fd).st_size
            for req in reqs:
                info = md.storage_data[req.storage_index]
                if info.offset + info.length > size:
                    raise CorruptCheckpointError(f"{path / name}: item {req.storage_index.fqn!r} is recorded at "
                                                 f"bytes {info.offset}+{info.length}, past the file's {size} bytes: "
                                                 f"the checkpoint is truncated; load an earlier one")
                data = os.pread(fd, info.length, info.offset)
                if len(data) != info.length:
                    raise CorruptCheckpointError(f"{path / name}: short read of item {req.storage_index.fqn!r}")
                _hand_item(req, data, md, planner, f"{path / name}")
        finally:
            os.close(fd)


def _restricted_load(data: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's allowlist refused it, or the archive is damaged
        raise UnsafeMetadataError(f"{what}: torch.load(weights_only=True) refuses it ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}): gdswriter does not unpickle it; "
                                  f"if this checkpoint is trusted, load it with DCP's FileSystemReader") from e


def _hand_item(req: Any, data: bytes, md: Metadata, planner: LoadPlanner, where: str) -> None:
    """Check one item's bytes (restricted load) and hand it to DCP's planner."""
    what = f"{where}: item {req.storage_index.fqn!r}"
    if req.type == LoadItemType.BYTE_IO:
        _restricted_load(data, what)
        planner.load_bytes(req, io.BytesIO(data))
        return
    tensor = _restricted_load(data, what)
    entry = md.state_dict_metadata.get(req.storage_index.fqn)
    if not isinstance(tensor, torch.Tensor) or not isinstance(entry, dcp_md.TensorStorageMetadata) or (
            tensor.dtype != entry.properties.dtype):
        raise CorruptCheckpointError(f"{what}: not a tensor of the dtype its metadata records; the checkpoint is "
                                     f"damaged")
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    if len(offsets) != tensor.dim() or any(o + n > k for o, n, k in zip(offsets, lengths, tensor.shape)):
        raise CorruptCheckpointError(f"{what}: DCP asks for the block {offsets} + {lengths} of a saved chunk of "
                                     f"shape {list(tensor.shape)}; the checkpoint's metadata does not match its data")
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(d, o, n)
    target = planner.resolve_tensor(req).detach()
    if target.shape != tensor.shape:
        raise CorruptCheckpointError(f"{what}: DCP asked for {list(target.shape)} elements, the saved chunk gives "
                                     f"{list(tensor.shape)}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)
