"""The manifest: the one file that makes a step directory a checkpoint.

It is JSON (readable by anything, no pickle) and it is written last, so a step
whose manifest exists and parses is complete. It records the data files, each
storage's chunks (file, byte range, crc32c), each tensor as a typed strided
view of a storage, and the non-tensor state tree (see state_codec). See
docs/format.md for the full description.
"""

from __future__ import annotations

import base64
import binascii
import json
import marshal
from json.encoder import encode_basestring_ascii
from itertools import accumulate, chain, islice, repeat
from operator import add, attrgetter, le
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple
from collections.abc import Callable, Iterator, Sequence

import crc32c as _crc32c
import numpy as np
import torch

from ..errors import CorruptCheckpointError, UnsupportedFormatVersionError, UnsupportedObjectError
from ..fs import name_problem
from ..threads import gc_paused
from .dtypes import all_dtypes, dtype_from_name, dtype_to_name

FORMAT_NAME = "gdswriter"
FORMAT_VERSION = (3, 0)  # (major, minor): readers refuse a newer major, accept any minor
COLUMNS_VERSION = (2, 0)  # column tables, the checksum over the bytes as written (docs/format.md 3)
DENSE_VERSION = (2, 1)  # small storages packed PACK_ALIGN apart; files exactly as long as their chunks (docs/format.md 2)
BINARY_VERSION = (3, 0)  # integer columns as base64 of little-endian arrays (docs/format.md 3.0)
PACK_ALIGN = 64  # every non-empty chunk of a 2.1 step starts at a multiple of this in its file (planner/assign.py)
MULTI_RANK_VERSION = (1, 2)  # what multi-rank saves write: adds "dist" and tensor "shard" (docs/format.md 9)
MANIFEST_NAME = "manifest.json"


FILE_INFO_MAX_KEYS = 16
FILE_INFO_MAX_TEXT = 256

_QUANTIZED = {d for d in (getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4"))
              if d is not None}
INT64_LIMIT = 1 << 63  # sizes, strides and offsets are int64 in torch
EXPANDED_VIEW_MAX_BYTES = 64 << 20
MANIFEST_MAX_BYTES = 1 << 30  # far beyond a real manifest (~300 B per tensor); a bigger one is damaged
"""A view whose elements overlap (an ``expand()``ed tensor, stride 0) may present more bytes than
its storage holds, up to this many (or its storage's size, if larger). Beyond, a manifest is
damaged: a few bytes on disk must not become gigabytes in memory when a reader materialises it."""


def decode_json(raw: bytes, where: str) -> Any:
    """A manifest file's JSON, decoded once for every parser that needs it (a 100,000-tensor
    manifest is 25 MB: each decode takes about 0.3 s); not valid JSON is CorruptCheckpointError.
    Automatic garbage collection is held off meanwhile: its objects hold no cycles."""
    try:
        with gc_paused():
            return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e}); the checkpoint is damaged: "
                                     f"load an earlier step") from e


@dataclass(frozen=True)
class FileRecord:
    """A data file: ``path`` inside the step directory of root number ``root``; exactly ``size`` bytes.

    ``info`` (format 1.1) says who wrote it, for people and tools, never for reading it back:
    ``engine`` (io_uring, posix, gds, kvikio-compat...), ``rank`` (the writing process's global
    rank), ``gpu`` (the CUDA device its bytes came from), ``host``. Plain JSON scalars only."""

    root: int
    path: str
    size: int
    info: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ChunkRecord:
    """Bytes [storage_offset, storage_offset+length) of a storage, stored at file_offset of file ``file``."""

    file: int
    file_offset: int
    storage_offset: int
    length: int
    crc32c: int


@dataclass(frozen=True)
class StorageRecord:
    """A run of bytes that one or more tensors view (tied weights are one storage)."""

    nbytes: int
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class ShardInfo:
    """(format 1.2) The tensor is the block [offsets, offsets + shape) of a global tensor of
    ``global_shape`` with the same name: a DTensor shard or a DCP chunk. The other blocks are
    records with the same name."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    # (saving a DTensor only) its format.sharded.DTensorLayout, for the step's layout index; no
    # part of the record (never written into it, never compared)
    layout: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TensorRecord:
    """Tensor ``name`` (its key path) is a view of storage ``storage`` starting at byte ``byte_offset``."""

    name: str
    storage: int
    byte_offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str = "cpu"  # where it lived at save time (informational)
    kind: str = "tensor"  # "tensor" or "ndarray"
    shard: ShardInfo | None = None  # format 1.2: a block of a global tensor

    def byte_extent(self) -> tuple[int, int]:
        """[begin, end) bytes of its storage that this strided view touches (empty if numel is 0)."""
        if not all(self.shape):
            return self.byte_offset, self.byte_offset
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return self.byte_offset, self.byte_offset + (last + 1) * dtype_from_name(self.dtype).itemsize

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def problem(self, storage_nbytes: int) -> str:
        """Why this record cannot be a view of a storage of ``storage_nbytes`` bytes ("" if it can).
        Checked in Python integers (no overflow): every size, stride and offset is an int64, the
        element count with zero-size dimensions counted as 1 too (torch multiplies them), the
        view lies inside the storage, and it presents at most max(storage, EXPANDED_VIEW_MAX_BYTES)
        bytes (expanded tensors have stride 0 and overlapping elements)."""
        dtype = dtype_from_name(self.dtype)
        if dtype in _QUANTIZED:
            return f"dtype {self.dtype} (quantized tensors are never saved)"
        if len(self.shape) != len(self.stride) or len(self.shape) > 64:
            return f"shape {list(self.shape)[:8]} and stride {list(self.stride)[:8]} do not fit together"
        if any(not 0 <= v < INT64_LIMIT for v in (*self.shape, *self.stride, self.byte_offset)):
            return "a size, stride or offset outside [0, 2**63)"
        product = 1
        for d in self.shape:
            product *= max(d, 1)
        if product >= INT64_LIMIT:
            return f"shape {list(self.shape)} with more than 2**63 elements"
        if self.byte_offset % dtype.itemsize:
            return f"byte_offset {self.byte_offset} that is not a multiple of its item size"
        if self.byte_extent()[1] > storage_nbytes:
            return "a view reaching past the end of its storage"
        presented = self.numel() * dtype.itemsize
        if presented > max(storage_nbytes, EXPANDED_VIEW_MAX_BYTES):
            return (f"{presented} bytes presented over a storage of {storage_nbytes} (an expanded view larger "
                    f"than {EXPANDED_VIEW_MAX_BYTES} bytes)")
        return ""


@dataclass(frozen=True)
class RootInfo:
    """(format 1.2) A root of a multi-rank checkpoint: its identity (the id in the root's
    ``.gdswriter-root`` file), where the rank that led it saw it, and the ranks that wrote to it."""

    id: str
    path: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class DistInfo:
    """(format 1.2) How a multi-rank save was laid out. ``roots`` is the table ``files[i].root``
    indexes (the primary first); ``rank_states`` holds, per rank, the top-level entries of its
    state tree that differ from ``state`` (rank 0's); ``dcp`` is DCP's Metadata (layout "dcp")."""

    world_size: int
    layout: str  # "gdswriter" (GDSCheckpointer) or "dcp" (torch.distributed.checkpoint)
    roots: tuple[RootInfo, ...]
    rank_states: dict = field(default_factory=dict)  # {rank: [[key, value], ...]} (encoded tree pairs)
    dcp: dict | None = None


DIST_LAYOUTS = ("gdswriter", "dcp")


@dataclass(frozen=True)
class Manifest:
    step: int
    files: tuple[FileRecord, ...]
    storages: tuple[StorageRecord, ...]
    tensors: tuple[TensorRecord, ...]
    state: Any
    created_unix: float = 0.0
    metadata: dict = field(default_factory=dict)
    version: tuple[int, int] = FORMAT_VERSION
    dist: DistInfo | None = None  # format 1.2: a multi-rank checkpoint

    def storage_bytes(self) -> int:
        """The bytes of all its storages (what a whole load reads): a format 2 manifest's column
        summed, no records made."""
        cols = chunk_columns(self.storages)
        return int(cols.nbytes.sum()) if cols is not None else sum(s.nbytes for s in self.storages)

    def storage_sizes(self) -> list[int]:
        """Each storage's byte count (no records made for a format 2 manifest)."""
        cols = chunk_columns(self.storages)
        return cols.nbytes.tolist() if cols is not None else [s.nbytes for s in self.storages]

    def tensor_names(self) -> list[str]:
        """The tensors' names, in record order (a format 2 manifest's column: no records made)."""
        cols = tensor_table_columns(self.tensors)
        return cols.names if cols is not None else [t.name for t in self.tensors]

    def tensor_storages(self) -> list[int]:
        """The storage each tensor views, in record order (no records made for format 2)."""
        cols = tensor_table_columns(self.tensors)
        return cols.storage.tolist() if cols is not None else [t.storage for t in self.tensors]

    def tensor_view(self, i: int) -> tuple[int, int, str, tuple[int, ...], tuple[int, ...]]:
        """Tensor ``i``'s (storage, byte_offset, dtype name, shape, stride), without making the
        records of a format 2 manifest."""
        cols = tensor_table_columns(self.tensors)
        if cols is None:
            t = self.tensors[i]
            return t.storage, t.byte_offset, t.dtype, t.shape, t.stride
        at, k = int(cols.starts[i]), int(cols.ndim[i])
        return (int(cols.storage[i]), int(cols.byte_offset[i]), cols.dtype_names[int(cols.dtype[i])],
                tuple(cols.shape[at:at + k].tolist()), tuple(cols.stride[at:at + k].tolist()))

    # -- serialisation -------------------------------------------------------
    def to_json_bytes(self, *, storages: EncodedStorages | None = None, encoded_state: bool = False) -> bytes:
        """The manifest file's bytes. Refuses (UnsupportedObjectError) a tensor a reader would
        refuse, so that nothing is committed that cannot be loaded back. ``storages``: the
        "storages" entry encoded already (StorageTableTemplate.fill; ``self.storages`` is then
        not read). ``encoded_state``: ``state`` is what state_codec's encoder made, whose
        objects' keys are in sorted order (one key, or "$odict" and "meta"), so its canonical
        text is its plain text: encoded once. Format 2 (``version``'s major) writes column
        tables and a checksum over the bytes (docs/format.md 3); 1.x a record per row."""
        if self.version[0] >= 2:
            return columns_bytes(self, storages)
        sizes = storages.sizes if storages is not None else tuple(s.nbytes for s in self.storages)
        canonical_tensors, plain_tensors = _tensor_table(self.tensors, sizes)
        body = {
            "format": FORMAT_NAME,
            "version": list(self.version),
            "step": self.step,
            "created_unix": self.created_unix,
            "metadata": self.metadata,
            "files": [[f.root, f.path, f.size] + ([dict(f.info)] if f.info else []) for f in self.files],
            "storages": None,  # encoded by storage_table
            "tensors": None,  # encoded by _tensor_table
            "state": self.state,
        }
        if self.dist is not None:
            d = self.dist
            body["dist"] = {"world_size": d.world_size, "layout": d.layout,
                            "roots": [{"id": r.id, "path": r.path, "ranks": list(r.ranks)} for r in d.roots],
                            "rank_states": [[r, pairs] for r, pairs in sorted(d.rank_states.items())],
                            **({"dcp": d.dcp} if d.dcp is not None else {})}
        # The same text as json.dumps of the whole body, one top-level entry at a time, so that
        # the tensor table is encoded once per layout rather than twice per save.
        canonical_storages, plain_storages = (storage_table(self.storages) if storages is None
                                              else (storages.canonical, storages.plain))
        made = {"tensors": (canonical_tensors, plain_tensors), "storages": (canonical_storages, plain_storages)}
        if encoded_state:
            state = _json(self.state)
            made["state"] = (state, state)
        canonical = {k: made[k][0] if k in made else _json(v, sort_keys=True) for k, v in body.items()}
        crc = _crc32c.crc32c(_join(sorted(canonical.items())).encode())
        plain = [(k, made[k][1] if k in made else _json(v)) for k, v in body.items()]
        return (_join([*plain, ("manifest_crc32c", str(crc))]) + "\n").encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes, where: str = "manifest") -> Manifest:
        """Parse and validate; any damage raises CorruptCheckpointError naming ``where``."""
        return cls.from_body(decode_json(raw, where), where, raw=raw)

    @classmethod
    def from_body(cls, body: Any, where: str = "manifest", *, raw: bytes | None = None) -> Manifest:
        """Validate a manifest.json decoded by decode_json (taken over: its checksum entry is
        removed); any damage raises CorruptCheckpointError naming ``where``. ``raw``: the file's
        bytes, which a format 2 manifest's checksum covers (required for one)."""
        try:
            with gc_paused():  # a record per chunk, storage and tensor beside the decoded body: no cycles
                return cls._from_body(body, where, raw)
        except (CorruptCheckpointError, UnsupportedFormatVersionError):
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, OverflowError) as e:
            raise CorruptCheckpointError(f"{where} is malformed ({type(e).__name__}: {e}); the checkpoint is "
                                         f"damaged: load an earlier step") from e

    @classmethod
    def _from_body(cls, body: Any, where: str, raw: bytes | None) -> Manifest:
        version = _checked_header(body, where, raw)
        files = _files(body["files"], where)
        if version[0] >= 2:  # column tables, checked by vectorised passes over each column
            storages, tensors = column_tables(body, files, where, binary=version >= BINARY_VERSION)
            if version >= DENSE_VERSION:
                check_dense_layout(storages.columns, files, where)
            if "dist" in body:
                raise _damaged(where, "a format 2 manifest has no \"dist\" (multi-rank steps are 1.x)")
            dist = None
        else:  # the usual tables checked as a whole (C-level passes over their columns); anything odd: per record
            storages = tuple(_bulk_storages(body["storages"], files) or _storages(body["storages"], files, where))
            tensors = tuple(_bulk_tensors(body["tensors"], storages) or _tensors(body["tensors"], storages, where))
            dist = _dist_info(body["dist"], files) if "dist" in body else None
        metadata = body.get("metadata", {})
        if not isinstance(metadata, dict):
            raise _damaged(where, "metadata is not an object")
        created = body.get("created_unix", 0.0)
        if not isinstance(created, (int, float)) or isinstance(created, bool) or not abs(created) < 1e300:
            raise _damaged(where, "created_unix is not a number")
        return cls(step=_nonneg(body["step"]), files=files, storages=storages, tensors=tensors,
                   state=body["state"], created_unix=float(created), metadata=metadata,
                   version=version, dist=dist)


def _damaged(where: str, msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {msg}; the checkpoint is damaged: load an earlier step")


def _checked_header(body: Any, where: str, raw: bytes | None = None) -> tuple[int, int]:
    """The format version of a manifest body, after its format name, its version (a newer major
    one is UnsupportedFormatVersionError) and its checksum (taken out of ``body``) are checked:
    format 2's over ``raw``, the bytes as written (check_trailer), 1.x's over the canonical JSON."""
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise _damaged(where, "not a gdswriter manifest (no \"format\": \"gdswriter\")")
    version = body.get("version")
    if not (isinstance(version, list) and len(version) == 2 and all(_is_int(v) and v >= 0 for v in version)):
        raise _damaged(where, f"bad version field {version!r}")
    if version[0] > FORMAT_VERSION[0]:
        raise UnsupportedFormatVersionError(
            f"{where} uses format version {version[0]}.{version[1]}, newer than this gdswriter reads "
            f"({FORMAT_VERSION[0]}.x): upgrade gdswriter (pip install -U gdswriter)")
    expected = body.pop("manifest_crc32c", None)
    if version[0] >= 2:
        if raw is None:
            raise _damaged(where, "a format 2 manifest's checksum covers its bytes, which were not given "
                                  "(Manifest.from_body(..., raw=...))")
        if check_trailer(raw, where) != expected:
            raise _damaged(where, "manifest checksum entry is not the file's last")
    elif not _is_int(expected) or _crc32c.crc32c(canonical_json(body)) != expected:
        raise _damaged(where, "manifest checksum does not match its content")
    return version[0], version[1]


def _files(rows: Any, where: str) -> tuple[FileRecord, ...]:
    """The data file table; a file listed twice is damage (its bytes would count, and be allocated, twice)."""
    files = tuple(FileRecord(_nonneg(r[0]), _relpath(r[1]), _nonneg(r[2]), _file_info(r[3:])) for r in _list(rows))
    if len({(f.root, f.path) for f in files}) != len(files):
        raise _damaged(where, "a data file is listed twice")
    return files


def _storages(rows: Any, files: tuple[FileRecord, ...], where: str) -> tuple[StorageRecord, ...]:
    """The storage table: each storage's chunks cover it exactly, inside their files, and no two
    chunks share a byte of a file."""
    storages = []
    n_files = len(files)
    for s in _list(rows):
        nbytes = _nonneg(s["nbytes"])
        chunks = []
        covered = 0
        listed = [_chunk(x, n_files) for x in _list(s["chunks"])]
        if len(listed) > 1:
            listed.sort(key=lambda c: c.storage_offset)
        for c in listed:
            if c.storage_offset != covered:
                raise _damaged(where, f"storage {len(storages)} has a gap or overlap at byte {covered}")
            if c.file_offset + c.length > files[c.file].size:
                raise _damaged(where, f"chunk of storage {len(storages)} runs past the end of {files[c.file].path}")
            covered += c.length
            chunks.append(c)
        if covered != nbytes:
            raise _damaged(where, f"storage {len(storages)} chunks cover {covered} of {nbytes} bytes")
        storages.append(StorageRecord(nbytes, tuple(chunks)))
    extents = sorted((c.file, c.file_offset, c.file_offset + c.length) for st in storages for c in st.chunks
                     if c.length)
    for (fa, _, end_a), (fb, start_b, _) in zip(extents, extents[1:]):
        if fa == fb and start_b < end_a:
            raise _damaged(where, f"two chunks overlap in {files[fa].path} at byte {start_b}")
    return tuple(storages)


def _tensors(rows: Any, storages: tuple[StorageRecord, ...], where: str) -> tuple[TensorRecord, ...]:
    """The tensor table: each record a valid view of its storage (the usual C-contiguous one
    answered by _contiguous_inside, the rest by TensorRecord.problem), with its shard if any."""
    tensors = []
    itemsizes = _itemsizes()
    for t in _list(rows):
        rec = TensorRecord(_str(t["name"]), _nonneg(t["storage"]), _nonneg(t["byte_offset"]), _str(t["dtype"]),
                           tuple([_nonneg(x) for x in _list(t["shape"])]),
                           tuple([_int(x) for x in _list(t["stride"])]), _str(t.get("device", "cpu")),
                           _str(t.get("kind", "tensor")))
        if rec.storage >= len(storages) or rec.kind not in ("tensor", "ndarray"):
            raise _damaged(where, f"tensor {rec.name[:200]!r} has an invalid storage index or kind")
        if rec.stride and min(rec.stride) < 0:
            raise _damaged(where, f"tensor {rec.name[:200]!r} has a negative stride")
        nbytes = storages[rec.storage].nbytes
        why = "" if _contiguous_inside(rec, itemsizes.get(rec.dtype, 0), nbytes) else rec.problem(nbytes)
        if why:
            raise _damaged(where, f"tensor {rec.name[:200]!r} has {why}")
        if "shard" in t:
            rec = replace(rec, shard=_shard(t["shard"], rec))
        tensors.append(rec)
    return tuple(tensors)


_ITEMSIZES: dict[str, int] = {}


def _itemsizes() -> dict[str, int]:
    """Item size per dtype name, of the dtypes that are not quantized (quantized ones are never saved)."""
    if not _ITEMSIZES:
        _ITEMSIZES.update({dtype_to_name(d): d.itemsize for d in all_dtypes() if d not in _QUANTIZED})
    return _ITEMSIZES


def _contiguous_inside(rec: TensorRecord, itemsize: int, storage_nbytes: int) -> bool:
    """The usual record, answered without TensorRecord.problem: a C-contiguous view (every
    dimension at least 1) of a dtype that is not quantized (``itemsize`` > 0), aligned, inside
    its storage. Then problem() finds nothing (every stride and the element count are at most
    the storage's size, an int64); False: ask problem()."""
    shape, stride = rec.shape, rec.stride
    if not itemsize or len(shape) != len(stride) or len(shape) > 64 or rec.byte_offset % itemsize:
        return False
    want = 1
    for d, st in zip(reversed(shape), reversed(stride)):
        if st != want or d < 1:
            return False
        want *= d
    return rec.byte_offset + want * itemsize <= storage_nbytes


def _bulk_storages(rows: Any, files: tuple[FileRecord, ...]) -> list[StorageRecord] | None:
    """The "storages" table checked as a whole, with C-level passes over the columns of its
    chunks, by the rules _from_body applies record by record: plain ints in [0, 2**63), each
    storage covered by its chunks from byte 0 without gap or overlap, every chunk inside a
    listed file, crc32c in range, no two chunks overlapping in a file. None when something
    is malformed or refused: _from_body's per-record path then checks it (and names the damage)."""
    if type(rows) is not list or not rows or not files:
        return None
    try:
        nbytes = [s["nbytes"] for s in rows]
        listed = [s["chunks"] for s in rows]
    except (TypeError, KeyError, IndexError):
        return None
    if set(map(type, listed)) != {list}:
        return None
    counts = list(map(len, listed))
    one = list(chain.from_iterable(listed))
    if not one or set(map(type, one)) != {list} or set(map(len, one)) != {5}:
        return None
    flat = list(chain.from_iterable(one))
    if set(map(type, flat)) != {int} or set(map(type, nbytes)) != {int}:  # bools and floats: per record
        return None
    if min(flat) < 0 or max(flat) >= INT64_LIMIT or min(nbytes) < 0 or max(nbytes) >= INT64_LIMIT:
        return None
    fid, fo, so, ln, crc = flat[0::5], flat[1::5], flat[2::5], flat[3::5], flat[4::5]
    if max(fid) >= len(files) or max(crc) > 0xFFFFFFFF:
        return None
    ends = list(map(add, fo, ln))
    if not all(map(le, ends, map([f.size for f in files].__getitem__, fid))):
        return None
    if _overlap(fid, fo, ends):
        return None
    return _covering(list(map(ChunkRecord, fid, fo, so, ln, crc)), counts, nbytes)


def _overlap(fid: list[int], starts: list[int], ends: list[int]) -> bool:
    """Whether two of the chunks [starts, ends) of files ``fid`` overlap (empty ones never do)."""
    last_file, last_end = -1, 0
    for f, start, end in sorted(zip(fid, starts, ends)):  # an empty chunk may share an offset
        if f == last_file and start < last_end:
            return True
        if start != end:
            last_file, last_end = f, end
    return False


def _covering(chunks: list[ChunkRecord], counts: list[int], nbytes: list[int]) -> list[StorageRecord] | None:
    """The StorageRecords of ``chunks`` (``counts[i]`` of them for storage i, in order), each
    storage covered from byte 0 without gap or overlap (sorted by offset); None if one is not."""
    out, at = [], 0
    for n, size in zip(counts, nbytes):
        mine = chunks[at:at + n] if n != 1 else [chunks[at]]
        at += n
        if n > 1:
            mine.sort(key=_STORAGE_OFFSET)
        covered = 0
        for c in mine:
            if c.storage_offset != covered:
                return None
            covered += c.length
        if covered != size:
            return None
        out.append(StorageRecord(size, tuple(mine)))
    return out


def _bulk_tensors(rows: Any, storages: list[StorageRecord]) -> list[TensorRecord] | None:
    """The "tensors" table, checked in one pass by the rules _from_body applies (the usual
    record, a C-contiguous view, answered by its shape's contiguous strides, computed once per
    shape; any other by TensorRecord.problem); None when some record has a "shard", is
    malformed or is refused: _from_body's per-record path then checks it (and names the damage)."""
    if type(rows) is not list or not rows or not storages:
        return None
    try:
        if any("shard" in t for t in rows):
            return None
        names, sids, offsets = [t["name"] for t in rows], [t["storage"] for t in rows], [t["byte_offset"] for t in rows]
        dtypes, shapes, strides = [t["dtype"] for t in rows], [t["shape"] for t in rows], [t["stride"] for t in rows]
        devices, kinds = [t.get("device", "cpu") for t in rows], [t.get("kind", "tensor") for t in rows]
    except (TypeError, KeyError, IndexError, AttributeError):
        return None
    if (set(map(type, names)) | set(map(type, dtypes)) | set(map(type, devices)) | set(map(type, kinds)) != {str}
            or set(map(type, sids)) | set(map(type, offsets)) != {int}
            or set(map(type, shapes)) | set(map(type, strides)) != {list}
            or not set(kinds) <= {"tensor", "ndarray"}
            or not set(map(type, chain.from_iterable(shapes))) | set(map(type, chain.from_iterable(strides))) <= {int}
            or min(sids) < 0 or max(sids) >= len(storages) or min(offsets) < 0 or max(offsets) >= INT64_LIMIT):
        return None
    itemsizes, sizes = _itemsizes(), [s.nbytes for s in storages]
    contiguous: dict[tuple, tuple[tuple, int] | None] = {}  # shape -> (its C-contiguous strides, numel), or None
    out = []
    for name, sid, offset, dtype, shape, stride, device, kind in zip(names, sids, offsets, dtypes, shapes, strides,
                                                                     devices, kinds):
        shape, stride, itemsize = tuple(shape), tuple(stride), itemsizes.get(dtype, 0)
        if shape not in contiguous:
            contiguous[shape] = _contiguous_strides(shape)
        want = contiguous[shape]
        rec = TensorRecord(name, sid, offset, dtype, shape, stride, device, kind)
        if (want is None or stride != want[0] or not itemsize or offset % itemsize
                or offset + want[1] * itemsize > sizes[sid]) and rec.problem(sizes[sid]):
            return None  # problem() also refuses negative sizes and strides, as _from_body does
        out.append(rec)
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
    """The strides of a C-contiguous view of ``shape`` and its element count; None if some
    dimension is below 1 or there are more than 64 (such records go to TensorRecord.problem)."""
    if len(shape) > 64 or (shape and min(shape) < 1):
        return None
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return tuple(reversed(out)), n


def canonical_json(body: dict) -> bytes:
    """The canonical JSON of a manifest's keys, which its manifest_crc32c covers (docs/format.md)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _json(value: Any, *, sort_keys: bool = False) -> str:
    return json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), allow_nan=False)


def _join(entries: list[tuple[str, str]]) -> str:
    """A JSON object from (key, encoded value) pairs, as json.dumps with compact separators writes it."""
    return "{" + ",".join(f"{_json(k)}:{v}" for k, v in entries) + "}"


def storage_table(storages: tuple[StorageRecord, ...], *, open_crcs: bool = False) -> tuple[str, str]:
    """The manifest's "storages" entry, with sorted keys (for the checksum) and as written: the
    text json.dumps gives (compact separators), formatted directly, each chunk's list once for
    both (a state of 100,000 tensors has 100,000 storages: json.dumps of their dicts and lists,
    twice, took most of the manifest's encoding). Every field is a plain int (the records are
    made from the plan's ints and crc32c's); anything else is refused as json.dumps would.
    ``open_crcs``: every crc32c is written ``%d`` (StorageTableTemplate; the texts hold no
    other "%")."""
    counts = list(map(len, map(_CHUNKS, storages)))
    every = list(chain.from_iterable(map(_CHUNKS, storages)))
    cols = [[s.nbytes for s in storages], *([getattr(c, k) for c in every]
                                           for k in ("file", "file_offset", "storage_offset", "length", "crc32c"))]
    if set(map(type, chain.from_iterable(cols))) <= {int}:  # plain ints (the usual table): formatted by columns
        chunks = list(map("[{},{},{},{},%d]".format if open_crcs else "[{},{},{},{},{}]".format,
                          *cols[1:5 if open_crcs else 6]))
        if set(counts) != {1}:  # storages cut in several chunks (or none): joined per storage
            at = list(accumulate(counts, initial=0))
            chunks = [",".join(chunks[a:b]) for a, b in zip(at, at[1:])]
        return ("[" + ",".join(map('{{"chunks":[{}],"nbytes":{}}}'.format, chunks, cols[0])) + "]",
                "[" + ",".join(map('{{"nbytes":{},"chunks":[{}]}}'.format, cols[0], chunks)) + "]")
    canonical, plain = [], []
    for s in storages:
        n = s.nbytes
        if type(n) is not int:
            raise TypeError(f"storage size {n!r} is not an int")
        chunks = ",".join([f"[{c.file},{c.file_offset},{c.storage_offset},{c.length},{'%d' if open_crcs else c.crc32c}]"
                           if type(c.file) is type(c.file_offset) is type(c.storage_offset) is type(c.length)
                           is type(c.crc32c) is int else _json([c.file, c.file_offset, c.storage_offset, c.length,
                                                                 c.crc32c])
                           for c in s.chunks])
        canonical.append(f'{{"chunks":[{chunks}],"nbytes":{n}}}')
        plain.append(f'{{"nbytes":{n},"chunks":[{chunks}]}}')
    return "[" + ",".join(canonical) + "]", "[" + ",".join(plain) + "]"


_CHUNKS, _STORAGE_OFFSET, _NBYTES = attrgetter("chunks"), attrgetter("storage_offset"), attrgetter("nbytes")


class EncodedStorages:
    """A manifest's "storages" entry, encoded, and each storage's size: ``columns`` (format 2),
    or storage_table's two texts (1.x: ``canonical`` and ``plain``, made when first asked)."""

    __slots__ = ("_crcs", "_in_table", "_template", "sizes")

    def __init__(self, template: StorageTableTemplate, crcs: Sequence[int]) -> None:
        self._template, self._crcs, self.sizes = template, tuple(crcs), template.sizes
        self._in_table = crcs if template.order is None else list(map(crcs.__getitem__, template.order))

    @property
    def columns(self) -> str:
        """The entry with JSON list columns (format 2.x)."""
        return self._template.columns % _ints(self._in_table, "crc32c")

    @property
    def binary(self) -> str:
        """The entry with base64 integer columns (format 3.0)."""
        return self._template.binary_columns() % _ints(self._in_table, "crc32c", binary=True)

    @property
    def canonical(self) -> str:
        return self._template.rows()[0] % self._crcs

    @property
    def plain(self) -> str:
        return self._template.rows()[1] % self._crcs


class StorageTableTemplate:
    """The "storages" entry of every save of one layout (the same storages, cut into the same
    chunks at the same places) with each chunk's crc32c left open, as printf templates: a
    save fills in its checksums (``fill``) in one C-level formatting, instead of a ChunkRecord
    and a StorageRecord per chunk and the table formatted anew (at 100,000 tensors, most of the
    manifest's encoding). ``fill`` gives what storage_columns (and storage_table, for 1.x) give
    for the same records with those checksums."""

    __slots__ = ("_binary", "_columns", "_rows", "_storages", "chunk_count", "order", "sizes")

    def __init__(self, storages: tuple[StorageRecord, ...]) -> None:
        """The template of ``storages`` (their crc32c are ignored), whose chunks' checksums
        ``fill`` takes in their order: storage by storage, each storage's chunks in order.
        ``order``: per chunk of the table, its checksum's place in that order (None: the same)."""
        self._storages, self._rows, self._binary = storages, None, None
        self._columns, order = storage_columns(storages, open_crcs=True)
        self.order = None if order == list(range(len(order))) else order
        self.chunk_count = len(order)
        self.sizes = tuple(s.nbytes for s in storages)

    @classmethod
    def of_columns(cls, nbytes: Sequence[int], counts: np.ndarray, fid: np.ndarray, fo: np.ndarray, so: np.ndarray,
                   ln: np.ndarray) -> StorageTableTemplate:
        """The template of the table of these columns (ChunkColumns' meaning, non-negative int64
        arrays in table order: storage by storage, each storage's chunks by storage offset), whose
        checksums ``fill`` takes in that order: no record made (made for the 1.x texts if those
        are asked for)."""
        self = cls.__new__(cls)
        self._rows, self._binary, self.order, self.sizes, self.chunk_count = None, None, None, tuple(nbytes), len(fid)
        names = ("nbytes", "chunks", *_CHUNK_COLUMNS)

        def columns() -> str:  # 2.x's text, made only if a 2.x manifest is written of this template
            cols = [_ints(list(nbytes), "storage nbytes"), *map(_array_ints, (counts, fid, fo, so, ln))]
            return "{" + ",".join(f'"{k}":{v}' for k, v in zip(names, [*cols, "%s"])) + "}"

        self._columns = columns
        binary = [_binary_ints(_checked_array(list(nbytes), "storage nbytes")), *map(_binary_ints, (counts, fid, fo, so, ln))]
        self._binary = "{" + ",".join(f'"{k}":{v}' for k, v in zip(names, [*binary, "%s"])) + "}"
        self._storages = lambda: _column_records(nbytes, *(a.tolist() for a in (counts, fid, fo, so, ln)))
        return self

    @property
    def columns(self) -> str:
        """The format 2.x entry (JSON list columns, crc32c open as "%s"), made once when first asked."""
        if callable(self._columns):
            self._columns = self._columns()
        return self._columns

    def binary_columns(self) -> str:
        """The format 3.0 entry (base64 integer columns, crc32c open as "%s"), made once when first asked."""
        if self._binary is None:
            storages = self._storages() if callable(self._storages) else self._storages
            self._binary = storage_columns(storages, open_crcs=True, binary=True)[0]
        return self._binary

    def rows(self) -> tuple[str, str]:
        """The 1.x texts (storage_table's, crc32c open), made once when first asked."""
        if self._rows is None:
            storages = self._storages() if callable(self._storages) else self._storages
            self._rows = storage_table(storages, open_crcs=True)
        return self._rows

    def fill(self, crcs: Sequence[int]) -> EncodedStorages:
        """The entry with these checksums, in the template's order (plain ints below 2**32)."""
        if set(map(type, crcs)) - {int} or (crcs and not 0 <= min(crcs) <= max(crcs) <= 0xFFFFFFFF):
            raise TypeError("a chunk's crc32c is not an int in [0, 2**32)")
        if len(crcs) != self.chunk_count:
            raise TypeError(f"{len(crcs)} checksums for a table of {self.chunk_count} chunks")
        return EncodedStorages(self, crcs)


def _column_records(nbytes: Sequence[int], counts: list[int], fid: list[int], fo: list[int], so: list[int],
                    ln: list[int]) -> tuple[StorageRecord, ...]:
    """The StorageRecords of StorageTableTemplate.of_columns' columns (every crc32c 0: the template leaves them open)."""
    at = list(accumulate(counts, initial=0))
    chunks = list(map(ChunkRecord, fid, fo, so, ln, repeat(0)))
    return tuple(StorageRecord(n, tuple(chunks[a:b])) for n, a, b in zip(nbytes, at, at[1:]))


# The last tensor table: (records, their storages' sizes, canonical text, file text). A
# training loop's saves have the same records (the same objects: snapshot.LayoutCache), so
# each is checked and encoded once, not at every save.
_last_table: tuple[tuple[TensorRecord, ...], tuple[int, ...], str, str] | None = None


def _tensor_table(tensors: tuple[TensorRecord, ...], sizes: tuple[int, ...]) -> tuple[str, str]:
    """The manifest's "tensors" entry, encoded with sorted keys (for the checksum) and as
    written; refuses (UnsupportedObjectError) a record a reader would refuse. ``sizes``: the
    storages' sizes."""
    global _last_table
    last = _last_table
    if last is not None and last[1] == sizes and last[0] == tensors:
        return last[2], last[3]
    itemsizes = _itemsizes()
    for t in tensors:
        if t.storage < len(sizes) and _contiguous_inside(t, itemsizes.get(t.dtype, 0), sizes[t.storage]):
            continue  # the usual record: problem() would find nothing
        why = t.problem(sizes[t.storage]) if t.storage < len(sizes) else "no storage"
        if why:
            raise UnsupportedObjectError(t.name, None, f"it would be saved with {why}; save t.contiguous() "
                                         f"(or the tensor before expand())", type_name="torch.Tensor")
    made = _plain_tensor_table(tensors)
    if made is not None:
        canonical, plain = made
    else:
        rows = [{"name": t.name, "storage": t.storage, "byte_offset": t.byte_offset, "dtype": t.dtype,
                 "shape": list(t.shape), "stride": list(t.stride), "device": t.device, "kind": t.kind,
                 **({"shard": {"global_shape": list(t.shard.global_shape), "offsets": list(t.shard.offsets)}}
                    if t.shard is not None else {})}
                for t in tensors]
        canonical, plain = _json(rows, sort_keys=True), _json(rows)
    _last_table = (tuple(tensors), sizes, canonical, plain)
    return canonical, plain


_TENSOR_COLUMNS = ("name", "storage", "byte_offset", "dtype", "shape", "stride", "device", "kind")
_CANONICAL_ROW = '{{"byte_offset":{2},"device":{6},"dtype":{3},"kind":{7},"name":{0},"shape":{4},"storage":{1},"stride":{5}}}'
_PLAIN_ROW = '{{"name":{0},"storage":{1},"byte_offset":{2},"dtype":{3},"shape":{4},"stride":{5},"device":{6},"kind":{7}}}'


def _plain_tensor_table(tensors: tuple[TensorRecord, ...]) -> tuple[str, str] | None:
    """_tensor_table's two texts, formatted by columns (the text json.dumps gives, compact
    separators): each name JSON-encoded once, each distinct dtype, device, kind, shape and
    stride once, and a record per row formatted in one C-level pass (json.dumps of a dict
    per record, twice, took most of a first save's manifest at 100,000 tensors). None
    where a record has a shard or a field that is not a plain int or str (json.dumps then)."""
    if not tensors or any(t.shard is not None for t in tensors):
        return None
    cols = [list(map(attrgetter(k), tensors)) for k in _TENSOR_COLUMNS]
    names, sids, offsets, dtypes, shapes, strides, devices, kinds = cols
    if (set(map(type, names)) | set(map(type, dtypes)) | set(map(type, devices)) | set(map(type, kinds)) != {str}
            or set(map(type, sids)) | set(map(type, offsets)) != {int}
            or not set(map(type, chain.from_iterable(shapes))) | set(map(type, chain.from_iterable(strides))) <= {int}):
        return None
    texts = {v: _json(v) for v in {*dtypes, *devices, *kinds}}
    dims = {v: _json(list(v)) for v in {*shapes, *strides}}
    row = [list(map(encode_basestring_ascii, names)), sids, offsets, list(map(texts.__getitem__, dtypes)),
           list(map(dims.__getitem__, shapes)), list(map(dims.__getitem__, strides)),
           list(map(texts.__getitem__, devices)), list(map(texts.__getitem__, kinds))]
    return ("[" + ",".join(map(_CANONICAL_ROW.format, *row)) + "]",
            "[" + ",".join(map(_PLAIN_ROW.format, *row)) + "]")


def _is_int(v: Any) -> bool:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


def _int(v: Any) -> int:
    if type(v) is not int and not _is_int(v):
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def _nonneg(v: Any) -> int:
    """A non-negative int64 (every count, size and offset in a manifest is one). Called a few
    times per chunk and per tensor: a plain int in range is answered by its type and one
    comparison (a state of 100,000 tensors has a million of them)."""
    if type(v) is int and 0 <= v < INT64_LIMIT:
        return v
    if not 0 <= _int(v) < INT64_LIMIT:
        raise ValueError(f"expected an integer in [0, 2**63), got {v!r}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def _list(v: Any) -> list:
    if not isinstance(v, list):
        raise ValueError(f"expected a list, got {type(v).__name__}")
    return v


def _relpath(v: Any) -> str:
    """A plain file name that the file system can name: no directories, no '..' (a manifest must
    not point outside its step), no lone surrogate (fs.name_problem)."""
    s = _str(v)
    problem = name_problem(s)
    if problem is not None:
        raise ValueError(f"data file name {problem}")
    return s


def _file_info(rest: list) -> dict:
    """The optional fourth element of a file entry: a small object of JSON scalars."""
    if not rest:
        return {}
    if len(rest) != 1 or not isinstance(rest[0], dict) or len(rest[0]) > FILE_INFO_MAX_KEYS:
        raise ValueError("a data file entry is [root, path, size] or [root, path, size, {info}]")
    for k, v in rest[0].items():
        if len(k) > FILE_INFO_MAX_TEXT or not (v is None or isinstance(v, (bool, int, float)) or
                                               (isinstance(v, str) and len(v) <= FILE_INFO_MAX_TEXT)):
            raise ValueError(f"data file info {k!r} is not a short JSON scalar")
    return dict(rest[0])


def _chunk(x: Any, n_files: int) -> ChunkRecord:
    f, fo, so, ln, crc = [_nonneg(v) for v in _list(x)]
    if f >= n_files:
        raise ValueError(f"chunk names file {f}, but there are only {n_files}")
    if crc > 0xFFFFFFFF:
        raise ValueError("crc32c out of range")
    return ChunkRecord(f, fo, so, ln, crc)


def _shard(x: Any, rec: TensorRecord) -> ShardInfo:
    """A tensor record's "shard": its block must lie inside the global shape."""
    if not isinstance(x, dict):
        raise ValueError(f"tensor {rec.name!r}: shard is not an object")
    shape = tuple(_nonneg(v) for v in _list(x["global_shape"]))
    offsets = tuple(_nonneg(v) for v in _list(x["offsets"]))
    if len(shape) != len(rec.shape) or len(offsets) != len(rec.shape) or any(
            o + n > g for o, n, g in zip(offsets, rec.shape, shape)):
        raise ValueError(f"tensor {rec.name!r}: shard block {list(offsets)} + {list(rec.shape)} does not fit in "
                         f"the global shape {list(shape)}")
    return ShardInfo(shape, offsets)


def _dist_info(x: Any, files: tuple[FileRecord, ...]) -> DistInfo:
    """The "dist" object of a multi-rank manifest (format 1.2)."""
    if not isinstance(x, dict):
        raise ValueError("dist is not an object")
    world = _nonneg(x["world_size"])
    layout = _str(x["layout"])
    if world < 1 or layout not in DIST_LAYOUTS:
        raise ValueError(f"dist: world_size {world} or layout {layout!r} is invalid")
    roots = []
    for r in _list(x["roots"]):
        ranks = tuple(_nonneg(v) for v in _list(r["ranks"]))
        if any(v >= world for v in ranks) or len(_str(r["id"])) > FILE_INFO_MAX_TEXT:
            raise ValueError("dist: a root names a rank outside the world, or has an over-long id")
        roots.append(RootInfo(r["id"], _str(r["path"]), ranks))
    if not roots or any(f.root >= len(roots) for f in files):
        raise ValueError(f"dist: the data files name roots beyond the {len(roots)} in the root table")
    rank_states: dict[int, list] = {}
    for entry in _list(x.get("rank_states", [])):
        rank, pairs = _list(entry)
        if not 0 < _nonneg(rank) < world or rank in rank_states or not all(
                isinstance(p, list) and len(p) == 2 for p in _list(pairs)):
            raise ValueError(f"dist: rank_states entry for rank {rank!r} is invalid")
        rank_states[rank] = pairs
    dcp = x.get("dcp")
    if (dcp is None) != (layout != "dcp") or not (dcp is None or isinstance(dcp, dict)):
        raise ValueError("dist: a \"dcp\" object goes with layout \"dcp\", and only with it")
    return DistInfo(world, layout, tuple(roots), rank_states, dcp)


# ----------------------------------------------------------------------------- format 2: column tables
TRAILER_KEY = b',"manifest_crc32c":'
KINDS = ("tensor", "ndarray")  # a format 2 tensor's "kind" column indexes this
_TENSOR_INT_COLUMNS = ("storage", "byte_offset", "dtype", "ndim", "device", "kind")
_CHUNK_COLUMNS = ("file", "file_offset", "storage_offset", "length", "crc32c")
_CHUNK_FIELDS = attrgetter(*_CHUNK_COLUMNS)
_TENSOR_FIELDS = attrgetter("name", "storage", "byte_offset", "dtype", "shape", "stride", "device", "kind", "shard")
_EXACT_BELOW = float(1 << 52)  # a float64 estimate below this: the int64 arithmetic cannot overflow


class ChunkColumns(NamedTuple):
    """A format 2 storage table's validated columns (int64, read-only): per storage its
    ``nbytes``, chunk ``counts`` and ``first`` chunk; per chunk, storage by storage and each
    storage's by storage offset, its file ``fid``, file offset ``fo``, storage offset ``so``,
    length ``ln`` and ``crc`` (crc32c)."""

    nbytes: np.ndarray
    counts: np.ndarray
    first: np.ndarray
    fid: np.ndarray
    fo: np.ndarray
    so: np.ndarray
    ln: np.ndarray
    crc: np.ndarray


class TensorColumns(NamedTuple):
    """A format 2 tensor table's validated columns: ``names``, per tensor its ``storage``,
    ``byte_offset``, ``dtype`` (an index into ``dtype_names``) and ``ndim``; ``shape`` and
    ``stride`` flattened (``ndim`` values per tensor, from ``starts``). Arrays are int64 and
    read-only."""

    names: list[str]
    storage: np.ndarray
    byte_offset: np.ndarray
    dtype: np.ndarray
    dtype_names: tuple[str, ...]
    ndim: np.ndarray
    shape: np.ndarray
    stride: np.ndarray
    starts: np.ndarray  # where each tensor's sizes and strides begin in ``shape`` and ``stride``


class RecordTable(Sequence):
    """A format 2 manifest's storages or tensors: a tuple of records, made on first use from the
    validated ``columns`` (a single-process load reads the columns and never makes them: at
    100,000 tensors, a third of the manifest's parse). Equal to the tuple of its records;
    pickles and copies as that tuple. ``dataclasses.replace`` with another sequence drops the
    columns with the table, so columns always describe the records beside them."""

    __slots__ = ("_len", "_make", "_made", "columns")

    def __init__(self, n: int, make: Callable[[], tuple], columns: Any) -> None:
        for a in columns:
            if isinstance(a, np.ndarray):
                a.setflags(write=False)
        self._len, self._make, self._made, self.columns = n, make, None, columns

    @property
    def made(self) -> bool:
        """Whether the records were made (a load that read only the columns made none)."""
        return self._made is not None

    def records(self) -> tuple:
        """The records, made once."""
        made = self._made
        if made is None:
            made = self._made = self._make()
        return made

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        return self.records()[i]

    def __iter__(self) -> Iterator:
        return iter(self.records())

    def __eq__(self, other: object) -> bool:
        return self.records() == (other.records() if isinstance(other, RecordTable) else other)

    def __hash__(self) -> int:
        return hash(self.records())

    def __add__(self, other: tuple) -> tuple:
        return self.records() + tuple(other)

    def __radd__(self, other: tuple) -> tuple:
        return tuple(other) + self.records()

    def __reduce__(self) -> tuple:
        return tuple, (self.records(),)

    def __repr__(self) -> str:
        return repr(self.records())


class StorageTable(RecordTable):
    """RecordTable of StorageRecords; ``columns``: ChunkColumns."""

    columns: ChunkColumns


class TensorTable(RecordTable):
    """RecordTable of TensorRecords; ``columns``: TensorColumns."""

    columns: TensorColumns


def chunk_columns(storages: Sequence[StorageRecord]) -> ChunkColumns | None:
    """The validated columns of a manifest's ``storages`` when it was read from format 2 columns
    (and not replaced since), else None: the caller walks the records."""
    return storages.columns if isinstance(storages, StorageTable) else None


def tensor_table_columns(tensors: Sequence[TensorRecord]) -> TensorColumns | None:
    """The validated columns of a manifest's ``tensors`` (as chunk_columns), else None."""
    return tensors.columns if isinstance(tensors, TensorTable) else None


def check_trailer(raw: bytes, where: str) -> int:
    """The checksum of a format 2 manifest, checked: the file ends with
    ``,"manifest_crc32c":N}`` and a newline, N decimal digits (no leading zero), and N is the
    crc32c of every byte before that trailer's comma (docs/format.md 3)."""
    at = raw.rfind(TRAILER_KEY)
    digits = raw[at + len(TRAILER_KEY):-2] if at >= 0 else b""
    if (at < 0 or not raw.endswith(b"}\n") or not digits.isdigit() or len(digits) > 10
            or (digits[:1] == b"0" and len(digits) > 1)):
        raise _damaged(where, "no manifest_crc32c trailer at its end")
    if _crc32c.crc32c(memoryview(raw)[:at]) != int(digits):
        raise _damaged(where, "manifest checksum does not match its content")
    return int(digits)


def _array_ints(a: np.ndarray) -> str:
    """_ints' text of an int64 array."""
    if len(a) > 1 and a.min() == a.max():
        return _repeated(int(a[0]), len(a))
    return repr(a.tolist()).replace(" ", "")


def _repeated(one: int, n: int) -> str:
    """The JSON list of ``n`` > 0 times ``one``."""
    text = str(one)
    return "[" + (text + ",") * (n - 1) + text + "]"


def _ints_and_array(v: list, what: str, typed: bool = False, want_text: bool = True) -> tuple[str, np.ndarray | None]:
    """A column's _ints text ("" unless ``want_text``), and its values as an int64 array (None where
    one is outside [0, 2**63)). ``typed``: every value is known to be a plain int (not looked at again)."""
    if want_text:
        text = _ints(v, what, typed)
    elif not typed and set(map(type, v)) - {int}:
        raise TypeError(f"{what}: a value that is not a plain int")
    else:
        text = ""
    if len(v) > 1 and v.count(v[0]) == len(v):
        return text, np.full(len(v), v[0], dtype=np.int64) if 0 <= v[0] < INT64_LIMIT else None
    try:
        arr = np.array(v, dtype=np.int64)
    except OverflowError:
        return text, None
    return text, arr if not len(arr) or arr.min() >= 0 else None


_WIDTHS = ((0xFF, "1", "<u1"), (0xFFFF, "2", "<u2"), (0xFFFFFFFF, "4", "<u4"), (INT64_LIMIT - 1, "8", "<i8"))


def _binary_ints(a: np.ndarray) -> str:
    """The format 3.0 text of a column of non-negative int64s (docs/format.md 3.0): a JSON string,
    the byte width of each value ("1", "2", "4" or "8", the narrowest that holds the largest), a
    colon, and the base64 of the values as little-endian unsigned integers of that width (a reader
    decodes it with one numpy.frombuffer: no JSON number and no Python int per value)."""
    top = int(a.max()) if len(a) else 0
    code, dtype = next((c, d) for limit, c, d in _WIDTHS if top <= limit)
    return '"' + code + ":" + base64.b64encode(a.astype(dtype, copy=False).tobytes()).decode("ascii") + '"'


def _checked_array(v: list, what: str) -> np.ndarray:
    """``v`` (plain ints) as an int64 array; ValueError where a value is outside [0, 2**63)."""
    try:
        arr = np.array(v, dtype=np.int64)
    except OverflowError as e:
        raise ValueError(f"{what}: a value of 2**63 or more") from e
    if len(arr) and arr.min() < 0:
        raise ValueError(f"{what}: a negative value")
    return arr


def _ints(v: Any, what: str, typed: bool = False, binary: bool = False) -> str:
    """A JSON list of plain ints, formatted ("[1,2]"); anything else is refused as json.dumps would.
    A list of plain ints is its repr without the spaces (one C-level pass, about twice as fast
    as formatting each int and joining); ``binary``: the format 3.0 text (_binary_ints); a list of one value repeated (chunks per storage,
    storage offsets, ndim, dtype, device, kind: mostly one value) is that value's text repeated,
    a C-level pass of a count and no formatting."""
    if type(v) is not list:
        v = list(v)
    if not typed and set(map(type, v)) - {int}:
        raise TypeError(f"{what}: a value that is not a plain int")
    if binary:
        return _binary_ints(_checked_array(v, what))
    if len(v) > 1 and v.count(v[0]) == len(v):  # one value throughout (most columns of a state): repeated
        return _repeated(v[0], len(v))
    return repr(v).replace(" ", "")


def columns_bytes(m: Manifest, storages: EncodedStorages | None) -> bytes:
    """A format 2 manifest's bytes (docs/format.md 3): the head, the column tables, the state
    tree, then the checksum of everything before it as the last entry. ``storages``: the
    "storages" entry already encoded (StorageTableTemplate.fill). 3.0 and later: integer
    columns in base64 (_binary_ints); 2.x: JSON lists."""
    if m.dist is not None:
        raise ValueError("format 2 holds single-process steps: a multi-rank manifest is 1.x")
    sizes = storages.sizes if storages is not None else tuple(s.nbytes for s in m.storages)
    binary = tuple(m.version) >= BINARY_VERSION
    if storages is not None:
        stored = storages.binary if binary else storages.columns
    else:
        stored = storage_columns(m.storages, binary=binary)[0]
    entries = [("format", _json(FORMAT_NAME)), ("version", _json(list(m.version))), ("step", _json(m.step)),
               ("created_unix", _json(m.created_unix)), ("metadata", _json(m.metadata)),
               ("files", _json([[f.root, f.path, f.size] + ([dict(f.info)] if f.info else []) for f in m.files])),
               ("storages", stored), ("tensors", tensor_columns(m.tensors, sizes, binary=binary)), ("state", state_text(m.state))]
    if type(m.step) is not int or not 0 <= m.step < INT64_LIMIT:
        raise ValueError(f"step {m.step!r} is not an integer in [0, 2**63)")
    head = _join(entries)[:-1].encode()
    return head + b'%s%d}\n' % (TRAILER_KEY, _crc32c.crc32c(head))


_last_state: tuple[bytes, str] | None = None


def state_text(tree: Any) -> str:
    """The JSON text of a state tree (what state_codec's encoder made: dicts, lists, str, int,
    float, bool, None), the last save's text again when the tree is the same: a training loop's
    saves have one tree, whose text is most of a later save's manifest at 100,000 tensors. The
    same tree: the same marshal bytes (version 2: no back-references, so no dependence on
    reference counts), which tell True from 1 from 1.0 and -0.0 from 0.0 (``==`` does not, JSON
    does), and keep every container's order; marshal takes a quarter of json.dumps' time."""
    global _last_state
    try:
        key = marshal.dumps(tree, 2)
    except ValueError:  # not a marshal type (not an encoded tree): no reuse
        return _json(tree)
    last = _last_state
    if last is not None and last[0] == key:
        return last[1]
    text = _json(tree)
    _last_state = (key, text)
    return text


def storage_columns(storages: tuple[StorageRecord, ...], *, open_crcs: bool = False,
                    binary: bool = False) -> tuple[str, list[int]]:
    """The format 2 "storages" entry of ``storages`` (each storage's chunks by storage offset),
    and the order of its chunks in the records' own order (their checksums, in that order, fill
    a template: ``open_crcs`` leaves the crc32c column as "%s"). Plain ints only. ``binary``:
    format 3.0's base64 columns."""
    counts = list(map(len, map(_CHUNKS, storages)))
    every = list(chain.from_iterable(map(_CHUNKS, storages)))
    order = list(range(len(every)))
    if any(n > 1 for n in counts):  # each storage's chunks by offset (format 2 requires it)
        at = list(accumulate(counts, initial=0))
        order = list(chain.from_iterable(sorted(range(a, b), key=lambda i: every[i].storage_offset)
                                         for a, b in zip(at, at[1:])))
        every = [every[i] for i in order]
    fields = list(zip(*map(_CHUNK_FIELDS, every))) or [()] * len(_CHUNK_COLUMNS)  # one pass: a tuple per column
    cols = [_ints(list(map(_NBYTES, storages)), "storage nbytes", binary=binary),
            _ints(counts, "chunks", binary=binary), *(_ints(v, k, binary=binary) for v, k in zip(fields, _CHUNK_COLUMNS[:4]))]
    crcs = "%s" if open_crcs else _ints(fields[4], "crc32c", binary=binary)
    names = ("nbytes", "chunks", *_CHUNK_COLUMNS)
    return "{" + ",".join(f'"{k}":{v}' for k, v in zip(names, [*cols, crcs])) + "}", order


_last_columns: tuple[Any, tuple[tuple[int, ...], bool], str] | None = None


def tensor_columns(tensors: Sequence[TensorRecord], sizes: tuple[int, ...], *, binary: bool = False) -> str:
    """The format 2 "tensors" entry: one JSON list per field, dtype and device names in tables
    of their own, shapes and strides flattened (``ndim`` per tensor). ``tensors``: a save's
    SavedTensors (encoded from its columns: no record made), or records. Refuses
    (UnsupportedObjectError) a record a reader would refuse, by the reader's own vectorised
    checks (check_tensor_columns). The same table as the last save's (the same SavedTensors
    object, or equal records) over the same storage sizes: encoded once. ``binary``: format
    3.0's base64 integer columns."""
    global _last_columns
    last = _last_columns
    saved = isinstance(tensors, SavedTensors)
    if last is not None and last[1] == (sizes, binary) and (last[0] is tensors if saved else last[0] == tensors):
        return last[2]
    cols = tensors.columns if saved else _record_columns(tensors)
    out = _encoded_tensor_columns(cols, sizes, tensors, saved, binary)
    _last_columns = (tensors if saved else tuple(tensors), (sizes, binary), out)
    return out


def _encoded_tensor_columns(cols: SavedColumns, sizes: tuple[int, ...], tensors: Sequence[TensorRecord],
                            made_by_save: bool, binary: bool = False) -> str:
    """tensor_columns' text of ``cols`` (whose records ``tensors`` are, for the rare row the
    vectorised checks leave to TensorRecord.problem), checked. ``made_by_save``: the columns are
    a SavedTensors', whose names are the encoder's str, whose tables and indices saved_tensors
    made, and whose shapes and strides torch's: only the storages and offsets (the layout's)
    have their types checked (a pass per column less each, at 100,000 tensors)."""
    names, shapes, strides, kinds = cols.names, cols.shapes, cols.strides, cols.kinds
    if not made_by_save and (set(map(type, names)) | set(map(type, cols.dtype_names))
                             | set(map(type, cols.device_names))) - {str}:
        raise TypeError("a tensor record's name, dtype or device is not a str")
    kind_index = {k: i for i, k in enumerate(KINDS)}
    ndim = list(map(len, shapes))
    bad = None
    if list(map(len, strides)) != ndim:
        bad = next(i for i, (a, b) in enumerate(zip(ndim, map(len, strides))) if a != b)
    elif not set(kinds) <= kind_index.keys():
        bad = next(i for i, k in enumerate(kinds) if k not in kind_index)
    flat = {"name": names, "storage": cols.storage, "byte_offset": cols.byte_offset, "dtype": cols.dtype,
            "ndim": ndim, "shape": list(chain.from_iterable(shapes)), "stride": list(chain.from_iterable(strides)),
            "device": cols.device, "kind": list(map(kind_index.get, kinds, repeat(len(KINDS))))}
    made = {k: _ints_and_array(v, f"tensor {k}", made_by_save and k not in ("storage", "byte_offset"), not binary)
            for k, v in flat.items() if k != "name"}  # the text, the array
    found = (bad, "a shape and stride of different lengths or an unknown kind") if bad is not None else \
        _saved_problem(tensors, {k: a for k, (_, a) in made.items()}, names, cols.dtype_names,
                       len(cols.device_names), sizes)
    if found is not None:
        row, why = found
        raise UnsupportedObjectError(names[row] if 0 <= row < len(names) else "<tensors>", None,
                                     f"it would be saved with {why}; save t.contiguous() (or the tensor before "
                                     f"expand())", type_name="torch.Tensor")
    if binary:
        if any(a is None for _, a in made.values()):  # a value outside [0, 2**63) that no check refused
            raise ValueError("a tensor column holds a value outside [0, 2**63)")
        texts = {k: _binary_ints(a) for k, (_, a) in made.items()}
    else:
        texts = {k: text for k, (text, _) in made.items()}
    return ('{"name":' + _json(names) + ","  # (str checked above) json's C encoder: no Python step per name
            + ",".join(f'"{k}":{v}' for k, v in texts.items())
            + f',"dtype_names":{_json(cols.dtype_names)},"device_names":{_json(cols.device_names)}}}')


class SavedColumns(NamedTuple):
    """A save's tensor table as columns (what the snapshot makes of its layout, with no record
    per tensor): per tensor its ``names``, ``storage``, ``byte_offset``, ``dtype`` (an index
    into ``dtype_names``), ``shapes`` and ``strides`` (a tuple of ints each), ``device`` (an
    index into ``device_names``) and ``kinds`` ("tensor" or "ndarray"). Lists, never changed
    once made."""

    names: list[str]
    storage: list[int]
    byte_offset: list[int]
    dtype: list[int]
    dtype_names: list[str]
    shapes: list[tuple[int, ...]]
    strides: list[tuple[int, ...]]
    device: list[int]
    device_names: list[str]
    kinds: list[str]


class SavedTensors(RecordTable):
    """A save's tensors (snapshot.Snapshot.records): a sequence of TensorRecords, made on first
    use from ``columns`` (SavedColumns), which tensor_columns encodes without making them."""

    columns: SavedColumns


def saved_tensors(names: list[str], storage: list[int], byte_offset: list[int], dtypes: Sequence[Any],
                  shapes: list[tuple[int, ...]], strides: list[tuple[int, ...]], devices: Sequence[Any],
                  kinds: list[str]) -> SavedTensors:
    """The SavedTensors of these columns, one value per tensor: ``dtypes`` torch dtypes (or their
    names), ``devices`` torch devices (or their names). Each distinct dtype and device is named
    once; the tables list the names in the order the tensors first give them (as the records'
    encoding does). C-level passes, no object per tensor."""
    dtype, dtype_names = _indexed(dtypes, lambda d: d if type(d) is str else dtype_to_name(d))
    device, device_names = _indexed(devices, str)
    cols = SavedColumns(names, storage, byte_offset, dtype, dtype_names, shapes, strides, device, device_names,
                        kinds)
    return SavedTensors(len(names), lambda: _saved_records(cols), cols)


def _indexed(values: Sequence[Any], name_of: Callable[[Any], str]) -> tuple[list[int], list[str]]:
    """Each value's index in the table of their names (in the order the values first give them), and that table."""
    named = {v: name_of(v) for v in dict.fromkeys(values)}
    table = list(dict.fromkeys(named.values()))
    at = {n: i for i, n in enumerate(table)}
    index = {v: at[n] for v, n in named.items()}
    return list(map(index.__getitem__, values)), table


def _saved_records(c: SavedColumns) -> tuple[TensorRecord, ...]:
    return tuple(map(TensorRecord, c.names, c.storage, c.byte_offset, map(c.dtype_names.__getitem__, c.dtype),
                     map(tuple, c.shapes), map(tuple, c.strides), map(c.device_names.__getitem__, c.device), c.kinds))


def _record_columns(tensors: Sequence[TensorRecord]) -> SavedColumns:
    """The SavedColumns of records (one pass over them, a tuple per field); a record with a
    shard is refused (format 2 holds single-process steps)."""
    names, sids, offsets, dtypes, shapes, strides, devices, kinds, shards = (
        map(list, zip(*map(_TENSOR_FIELDS, tensors))) if tensors else ([] for _ in range(9)))
    if shards.count(None) != len(shards):
        raise ValueError("format 2 holds no shard records: a multi-rank manifest is 1.x")
    if (set(map(type, dtypes)) | set(map(type, devices))) - {str}:
        raise TypeError("a tensor record's name, dtype or device is not a str")
    dtype, dtype_names = _indexed(dtypes, str)
    device, device_names = _indexed(devices, str)
    return SavedColumns(names, sids, offsets, dtype, dtype_names, shapes, strides, device, device_names, kinds)


def _saved_problem(tensors: Sequence[TensorRecord], arrays: dict[str, np.ndarray | None], names: list[str],
                   dtype_names: list[str], n_devices: int, sizes: tuple[int, ...]) -> tuple[int, str] | None:
    """The first record to be saved that a reader would refuse (row, why), by the reader's checks
    (check_tensor_columns) over the columns' ``arrays``; where a column has a value beyond int64
    or negative (its array None): found by TensorRecord.problem."""
    if any(a is None for a in arrays.values()):
        return next(((i, why) for i, t in enumerate(tensors)
                     if (why := t.problem(sizes[t.storage]) if t.storage < len(sizes) else "no storage")), None)
    return check_tensor_columns(arrays, dtype_names, n_devices, np.array(sizes, dtype=np.int64), names)


def _first(mask: np.ndarray) -> int | None:
    """The first row where ``mask`` holds, or None."""
    return int(np.argmax(mask)) if mask.any() else None


def check_tensor_columns(c: dict[str, np.ndarray], dtype_names: list[str], n_devices: int, sizes: np.ndarray,
                         names: list[str]) -> tuple[int, str] | None:
    """The first tensor (row, why) that is not a possible view of its storage (``sizes``: the
    storages' byte counts), by docs/format.md 3's rules over whole columns at once; None when
    all are. Columns are non-negative int64s (the callers checked); a row whose arithmetic
    might not fit in an int64 is checked exactly by TensorRecord.problem."""
    n, ndim = len(names), c["ndim"]
    if any(len(c[k]) != n for k in _TENSOR_INT_COLUMNS):
        return -1, f"columns of different lengths ({n} names)"
    for key, bound, what in (("storage", len(sizes), "a storage index"), ("dtype", len(dtype_names), "a dtype index"),
                             ("device", n_devices, "a device index"), ("kind", len(KINDS), "a kind index"),
                             ("ndim", 65, "more than 64 dimensions (ndim)")):
        row = _first(c[key] >= bound)
        if row is not None:
            return row, what if key == "ndim" else f"{what} {int(c[key][row])} outside its table"
    total = int(ndim.sum())
    if total != len(c["shape"]) or total != len(c["stride"]):
        return -1, f"ndim summing to {total} over {len(c['shape'])} sizes and {len(c['stride'])} strides"
    itemsize = np.array([_itemsizes().get(d, 0) for d in dtype_names] or [0], dtype=np.int64)[c["dtype"]]
    row = _first(itemsize == 0)
    if row is not None:
        return row, f"dtype {dtype_names[int(c['dtype'][row])]!r} (unknown to this torch, or quantized)"
    row = _first(c["byte_offset"] % itemsize != 0)
    if row is not None:
        return row, f"byte_offset {int(c['byte_offset'][row])} that is not a multiple of its item size"
    return _view_problem(c, itemsize, sizes, names, dtype_names)


def _view_problem(c: dict[str, np.ndarray], itemsize: np.ndarray, sizes: np.ndarray, names: list[str],
                  dtype_names: list[str]) -> tuple[int, str] | None:
    """check_tensor_columns' view rules: inside the storage, at most max(storage, 64 MiB)
    presented, fewer than 2**63 elements; exact in int64 where float64 estimates show no
    overflow, by TensorRecord.problem for the rare other rows."""
    n, ndim, shape, stride = len(names), c["ndim"], c["shape"], c["stride"]
    owner = np.repeat(np.arange(n), ndim)
    shape_f = shape.astype(np.float64)
    log_numel = np.bincount(owner, np.log2(np.maximum(shape_f, 1.0)), minlength=n)
    span_f = np.bincount(owner, np.maximum(shape_f - 1.0, 0.0) * stride.astype(np.float64), minlength=n)
    empty = np.bincount(owner, (shape == 0).astype(np.float64), minlength=n) > 0
    nbytes = sizes[c["storage"]]
    exact = (log_numel < 52.0) & (span_f < _EXACT_BELOW)
    for row in np.flatnonzero(~exact).tolist():  # huge sizes or strides: Python integers
        at = int(ndim[:row].sum())
        k = int(ndim[row])
        rec = TensorRecord(names[row], int(c["storage"][row]), int(c["byte_offset"][row]),
                           dtype_names[int(c["dtype"][row])], tuple(shape[at:at + k].tolist()),
                           tuple(stride[at:at + k].tolist()))
        why = rec.problem(int(nbytes[row]))
        if why:
            return row, why
    starts = np.flatnonzero(ndim > 0)
    first = np.cumsum(ndim) - ndim
    numel = np.ones(n, dtype=np.int64)
    span = np.zeros(n, dtype=np.int64)
    if len(starts):  # rows of ndim 0: one element, offset 0
        numel[starts] = np.multiply.reduceat(np.where(np.repeat(exact, ndim), shape, 1), first[starts])
        span[starts] = np.add.reduceat(np.where(np.repeat(exact & ~empty, ndim), np.maximum(shape - 1, 0) * stride, 0),
                                       first[starts])
    extent = np.where(empty, 0, (span + 1) * itemsize)  # an empty view's offset stays inside too
    row = _first(exact & (extent > nbytes - c["byte_offset"]))
    if row is not None:
        return row, "a view reaching past the end of its storage"
    row = _first(exact & (numel * itemsize > np.maximum(nbytes, EXPANDED_VIEW_MAX_BYTES)))
    if row is not None:
        return row, (f"{int(numel[row] * itemsize[row])} bytes presented over a storage of {int(nbytes[row])} "
                     f"(an expanded view larger than {EXPANDED_VIEW_MAX_BYTES} bytes)")
    return None


_DECODED = {"1": np.dtype("<u1"), "2": np.dtype("<u2"), "4": np.dtype("<u4"), "8": np.dtype("<i8")}


def _binary_column(col: str, key: str, n: int | None) -> np.ndarray:
    """A format 3.0 column (_binary_ints' text) as an int64 array of ``n`` (if given) values in
    [0, 2**63). Its length is checked before it is decoded, and what it decodes to is at most
    three quarters of the text the manifest already holds: no allocation beyond the manifest's size."""
    code, colon, text = col.partition(":")
    dtype = _DECODED.get(code)
    if dtype is None or not colon:
        raise ValueError(f"column {key!r} is a string without a width prefix (1:, 2:, 4: or 8:)")
    if n is not None and len(text) != (n * dtype.itemsize + 2) // 3 * 4:
        raise ValueError(f"column {key!r} is not {n} values of {dtype.itemsize} bytes in base64")
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except binascii.Error as e:
        raise ValueError(f"column {key!r} is not base64 ({e})") from e
    if len(raw) % dtype.itemsize:
        raise ValueError(f"column {key!r} holds {len(raw)} bytes, not whole {dtype.itemsize}-byte values")
    arr = np.frombuffer(raw, dtype=dtype).astype(np.int64)
    if len(arr) and arr.min() < 0:
        raise ValueError(f"column {key!r} holds a value of 2**63 or more")
    return arr


def _int_column(table: dict, key: str, n: int | None = None, binary: bool = False) -> tuple[list[int] | None, np.ndarray]:
    """Column ``key`` of a format 2 table: a list of ``n`` (if given) plain ints in [0, 2**63),
    and the same as an int64 array; ``binary`` (format 3.0): a base64 column (_binary_column),
    its list None (made from the array where records are asked for)."""
    col = table[key]
    if binary:
        if type(col) is not str:
            raise ValueError(f"column {key!r} is not a base64 string (format 3.0)")
        return None, _binary_column(col, key, n)
    if type(col) is not list or (n is not None and len(col) != n):
        raise ValueError(f"column {key!r} is not a list" + (f" of {n} values" if n is not None else ""))
    if set(map(type, col)) - {int}:
        raise ValueError(f"column {key!r} holds a value that is not an integer")
    arr = np.array(col, dtype=np.int64)  # OverflowError: a value of 2**63 or more
    if len(arr) and arr.min() < 0:
        raise ValueError(f"column {key!r} holds a negative value")
    return col, arr


def column_tables(body: dict, files: tuple[FileRecord, ...], where: str,
                  binary: bool = False) -> tuple[StorageTable, TensorTable]:
    """A format 2 manifest's storage and tensor tables, checked as whole columns (docs/format.md
    3, "Reader validation"); their records are made only when a caller asks for them.
    ``binary``: a 3.0 manifest's, whose integer columns are base64 (_binary_column)."""
    storages = _column_storages(body["storages"], files, where, binary)
    t = body["tensors"]
    if type(t) is not dict:
        raise ValueError("\"tensors\" is not an object of columns")
    names = t["name"]
    dtype_names, device_names = t["dtype_names"], t["device_names"]
    for v in (names, dtype_names, device_names):
        if type(v) is not list or set(map(type, v)) - {str}:
            raise ValueError("a tensor column of names is not a list of strings")
    lists, arrays = {}, {}
    for k in (*_TENSOR_INT_COLUMNS, "shape", "stride"):  # their lengths: check_tensor_columns
        lists[k], arrays[k] = _int_column(t, k, len(names) if binary and k in _TENSOR_INT_COLUMNS else None, binary)
    found = check_tensor_columns(arrays, dtype_names, len(device_names), storages.columns.nbytes, names)
    if found is not None:
        row, why = found
        raise _damaged(where, f"tensor {names[row][:200]!r} has {why}" if row >= 0 else f"its tensor table has {why}")
    cols = TensorColumns(names, arrays["storage"], arrays["byte_offset"], arrays["dtype"], tuple(dtype_names),
                         arrays["ndim"], arrays["shape"], arrays["stride"], np.cumsum(arrays["ndim"]) - arrays["ndim"])

    def records() -> tuple[TensorRecord, ...]:
        for k, v in lists.items():
            if v is None:
                lists[k] = arrays[k].tolist()
        shapes, strides = iter(lists["shape"]), iter(lists["stride"])
        dims = lists["ndim"]
        return tuple(map(TensorRecord, names, lists["storage"], lists["byte_offset"],
                         map(dtype_names.__getitem__, lists["dtype"]),
                         [tuple(islice(shapes, k)) for k in dims], [tuple(islice(strides, k)) for k in dims],
                         map(device_names.__getitem__, lists["device"]), map(KINDS.__getitem__, lists["kind"])))

    return storages, TensorTable(len(names), records, cols)


def check_dense_layout(cols: ChunkColumns, files: tuple[FileRecord, ...], where: str) -> None:
    """What a 2.1 manifest promises beyond 2.0's rules (docs/format.md 3.0), checked on whole
    columns: every non-empty chunk starts at a multiple of PACK_ALIGN in its file (so each
    storage read into a buffer that mirrors the file's 4 KiB phase starts aligned for its
    dtype), and each file's recorded size is exactly the end of its last chunk (0 without any).
    A 2.0 manifest is not held to these (nothing it was accepted with is refused now)."""
    full = cols.ln > 0
    row = _first(full & (cols.fo % PACK_ALIGN != 0))
    if row is not None:
        raise _damaged(where, f"a chunk of {files[int(cols.fid[row])].path} starts at offset {int(cols.fo[row])}, "
                              f"not a multiple of {PACK_ALIGN} (format 2.1)")
    ends = np.zeros(max(len(files), 1), dtype=np.int64)
    np.maximum.at(ends, cols.fid, cols.fo + cols.ln)
    sizes = np.array([f.size for f in files] or [0], dtype=np.int64)
    row = _first(ends != sizes)
    if row is not None:
        raise _damaged(where, f"{files[row].path} is recorded as {int(sizes[row])} bytes but its chunks end at "
                              f"{int(ends[row])} (format 2.1: a file is exactly as long as its chunks)")


def _column_storages(t: Any, files: tuple[FileRecord, ...], where: str, binary: bool = False) -> StorageTable:
    """The format 2 storage table: each storage's chunks, listed by storage offset, tile it from
    byte 0; every chunk lies inside a listed file; no two chunks share a byte of a file."""
    if type(t) is not dict:
        raise ValueError("\"storages\" is not an object of columns")
    nbytes, sizes = _int_column(t, "nbytes", None, binary)
    counts, count_arr = _int_column(t, "chunks", len(sizes), binary)
    first_file = _int_column(t, "file", None, binary) if binary else (None, None)
    m = len(first_file[1]) if binary else len(t["file"]) if type(t["file"]) is list else -1
    cols = [first_file] + [_int_column(t, k, m, binary) for k in _CHUNK_COLUMNS[1:]] if binary else \
        [_int_column(t, k, m) for k in _CHUNK_COLUMNS]
    fid, fo, so, ln, crc = (a for _, a in cols)
    if len(count_arr) and (count_arr.max() > m or int(count_arr.sum()) != m):
        raise _damaged(where, f"its storages' chunk counts do not add up to the {m} chunks listed")
    if m and (fid.max() >= len(files) or crc.max() > 0xFFFFFFFF):
        raise _damaged(where, "a chunk names a file not listed, or has a crc32c beyond 32 bits")
    file_sizes = [f.size for f in files]
    if sum(file_sizes) >= INT64_LIMIT:
        raise _damaged(where, "its data files add up to 2**63 bytes or more")
    room = np.array(file_sizes or [0], dtype=np.int64)[fid] - fo  # both in [0, 2**63): no overflow
    row = _first(ln > room)
    if row is not None:
        raise _damaged(where, f"a chunk runs past the end of {files[int(fid[row])].path}")
    full = np.flatnonzero(ln > 0)
    order = full[np.lexsort((fo[full], fid[full]))]
    clash = (fid[order][1:] == fid[order][:-1]) & (fo[order][1:] < (fo + ln)[order][:-1])
    if clash.any():
        raise _damaged(where, f"two chunks overlap in {files[int(fid[order][1:][clash][0])].path}")
    ends = np.cumsum(ln)  # at most the files' total (no chunks overlap): no overflow
    first = np.cumsum(count_arr) - count_arr
    base = np.zeros(len(sizes), dtype=np.int64)
    used = count_arr > 0
    base[used] = (ends - ln)[first[used]]
    owner = np.repeat(np.arange(len(sizes)), count_arr)
    if _first(so != (ends - ln) - base[owner]) is not None:
        raise _damaged(where, "a storage's chunks (by storage offset) leave a gap or overlap")
    covered = np.concatenate(([0], ends))
    if len(sizes) and _first(covered[first + count_arr] - covered[first] != sizes) is not None:
        raise _damaged(where, "a storage's chunks do not cover exactly its nbytes")
    lists = [c for c, _ in cols]

    def records() -> tuple[StorageRecord, ...]:
        nonlocal nbytes, counts
        if binary:
            nbytes, counts = sizes.tolist(), count_arr.tolist()
            lists[:] = [a.tolist() for _, a in cols]
        chunks = list(map(ChunkRecord, *lists))
        if all(n == 1 for n in counts):
            return tuple(map(StorageRecord, nbytes, zip(chunks)))
        at = list(accumulate(counts, initial=0))
        return tuple(StorageRecord(b, tuple(chunks[x:y])) for b, x, y in zip(nbytes, at, at[1:]))

    return StorageTable(len(sizes), records, ChunkColumns(sizes, count_arr, first, fid, fo, so, ln, crc))
