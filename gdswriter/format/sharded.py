"""Format 1.3: a multi-rank step as one small global manifest and one manifest shard per rank.

A 1.2 manifest held every rank's records, so its size (and what rank 0 gathered and every
loading rank received) grew with the world size times the tensors per rank. In 1.3:

* each rank writes ``manifest-rank<R>.json`` (a **shard**: ``RankShard``) into its step
  directory on its first root, durably, before the vote: its data files, the items (storages)
  it holds with their holders, the chunks it wrote, the records of every tensor it holds and
  its state tree. Its size depends on the rank's own state only;
* the step's ``manifest.json`` (``GlobalManifest``, the commit point, written by the primary
  rank as before) holds the root table and, per rank, where its shard is with its size and
  crc32c: a few dozen bytes per rank (about 1 MiB at 16,384 ranks); and the layout index
  (``LayoutIndex``): per DTensor name its dtype, global shape, mesh and placements, so that a
  load on another layout finds which shards hold the blocks it needs (nothing per block).

Items are named by keys that equal across ranks exactly when they hold the same bytes
(distributed/save.py ``storage_keys``): ``L<rank>:<n>`` for rank-local state, ``R<digest>``
for replicated state (every rank), ``S<digest>`` for a DTensor block (its replica group).
Several holders split an item with planner/ranks.py ``split_stream``, each holder writing its
pieces and recording them in its own shard.

``merge`` turns a global manifest and every shard back into the in-memory ``Manifest`` a
1.2 step parses to, so the single-process readers (load_state, ``gdswriter`` ls/inspect/
verify/export) read 1.3 through the code they already had; a multi-rank load of the same
layout reads only its own shard (distributed/load.py), one of another layout the shards the
layout index points it to (distributed/reshard.py). docs/format.md section 10.
"""

from __future__ import annotations

import errno
import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from itertools import chain, compress, repeat
from operator import itemgetter, ne
from pathlib import Path
from typing import Any, TypeVar, overload
from collections.abc import Callable, Iterator, Sequence

import crc32c as _crc32c

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnreachableDataError
from ..fs import name_problem, read_regular_file
from .assembly import build_manifest
from .commit import root_identity, step_dir_name
from .dtypes import dtype_from_name
from .manifest import (FORMAT_NAME, INT64_LIMIT, MANIFEST_MAX_BYTES, MANIFEST_NAME, ChunkRecord, FileRecord, Manifest,
                       RootInfo, ShardInfo, TensorRecord, decode_json)
from .state_codec import tensor_refs

SHARDED_VERSION = (1, 3)
REPLICAS_VERSION = (1, 4)  # a step saved with replicas (the "replicas" key; 1.3 otherwise, byte for byte)
MAX_COPY_ROOTS = 16  # copy roots one rank's entry of "replicas" may list (DistOptions.replicas' bound)
SHARD_FORMAT = "gdswriter-shard"
ONLY_THIS_RANK = -1  # an item's holders: the writing rank alone
EVERY_RANK = -2      # an item's holders: every rank of the world
MAX_KEY_CHARS = 256


def shard_name(rank: int) -> str:
    """The file name of rank ``rank``'s manifest shard (in its step directory on its first root)."""
    return f"manifest-rank{rank:05d}.json"


@dataclass(frozen=True)
class ItemRecord:
    """An item (storage) a rank holds: its key, size and holders (None: every rank)."""

    key: str
    nbytes: int
    holders: tuple[int, ...] | None

    def holder_ranks(self, world_size: int) -> Sequence[int]:
        return range(world_size) if self.holders is None else self.holders

    def holder_count(self, world_size: int) -> int:
        return world_size if self.holders is None else len(self.holders)

    @property
    def first_holder(self) -> int:
        """The lowest holder (it describes the item's tensors in a merged manifest)."""
        return 0 if self.holders is None else self.holders[0]


@dataclass(frozen=True)
class RankShard:
    """What one rank wrote for a step and what it holds (the module docstring). ``chunks[i]``
    are the pieces of item i this rank wrote (``file`` indexes ``files``; ``storage_offset`` is
    the offset in the item); ``tensors`` are views of items (``storage`` indexes ``items``)."""

    step: int
    rank: int
    world_size: int
    files: tuple[FileRecord, ...]
    items: tuple[ItemRecord, ...]
    chunks: tuple[tuple[ChunkRecord, ...], ...]
    tensors: tuple[TensorRecord, ...]
    tree: Any

    def chunks_by_file(self) -> list[list[ChunkRecord]]:
        """Entry i: the chunks this rank wrote into its data file ``files[i]`` (for reading a
        file once, each chunk's crc32c checked as it streams: the drain, the replication)."""
        out: list[list[ChunkRecord]] = [[] for _ in self.files]
        for cs in self.chunks:
            for c in cs:
                out[c.file].append(c)
        return out

    def to_json_bytes(self, static: ShardStatic | None = None) -> bytes:
        """The shard file's bytes. ``static``: ShardStatic.of(rank, items, tensors) computed
        before (a training loop's saves share it), else made here."""
        if static is None or static.key != (self.rank, self.items, self.tensors):
            static = ShardStatic.of(self.rank, self.items, self.tensors)
        head = _json({"format": SHARD_FORMAT, "version": list(SHARDED_VERSION), "step": self.step, "rank": self.rank,
                      "world_size": self.world_size})
        files = _json([[f.root, f.path, f.size] + ([dict(f.info)] if f.info else []) for f in self.files])
        chunks = _json([[i, c.file, c.file_offset, c.storage_offset, c.length, c.crc32c]
                        for i, cs in enumerate(self.chunks) for c in cs])
        return (f'{head[:-1]},"groups":{static.groups},"items":{static.items},"files":{files},"chunks":{chunks},'
                f'"tensors":{static.tensors},"tree":{_json(self.tree)}}}\n').encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, where: str, step: int, rank: int, world_size: int,
                        n_roots: int) -> RankShard:
        """Parse and validate a shard that must be rank ``rank``'s of ``step`` in a world of
        ``world_size`` whose root table has ``n_roots`` roots; damage is CorruptCheckpointError."""
        try:
            return _parse_shard(json.loads(raw), where, step, rank, world_size, n_roots)
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, OverflowError,
                UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where} is malformed ({type(e).__name__}: {e}); the checkpoint is "
                                         f"damaged: load an earlier step") from e


@dataclass(frozen=True)
class ShardStatic:
    """A shard's holder groups, items and tensor records, encoded: what the layout alone decides
    (the plan of a save keeps it, so that a training loop's saves encode only chunks and tree)."""

    key: tuple
    groups: str
    items: str
    tensors: str

    @staticmethod
    def of(rank: int, items: tuple[ItemRecord, ...], tensors: tuple[TensorRecord, ...]) -> ShardStatic:
        groups: dict[tuple[int, ...], int] = {}
        rows = []
        for it in items:
            if it.holders is None:
                ref = EVERY_RANK
            elif it.holders == (rank,):
                ref = ONLY_THIS_RANK
            else:
                ref = groups.setdefault(it.holders, len(groups))
            rows.append([it.key, it.nbytes, ref])
        trows = [[t.storage, t.name, t.byte_offset, t.dtype, list(t.shape), list(t.stride), t.device, t.kind,
                  [list(t.shard.global_shape), list(t.shard.offsets)] if t.shard is not None else None]
                 for t in tensors]
        return ShardStatic((rank, items, tensors), _json([list(g) for g in groups]), _json(rows), _json(trows))


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class ShardRef:
    """Where rank ``rank``'s shard is: file ``name`` in the step directory on root ``root``."""

    rank: int
    root: int
    name: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class GlobalManifest:
    """The manifest.json of a 1.3 step (the module docstring). ``totals`` are for people and
    tools, over all ranks: "bytes" of state, "tensors" (each shared one once), data "files",
    and "on_disk" (the data files' and shards' sizes)."""

    step: int
    world_size: int
    roots: Sequence[RootInfo]  # a tuple, or parsed: a RootTable
    shards: Sequence[ShardRef]  # a tuple, or parsed: a ShardTable
    metadata: dict
    created_unix: float
    totals: dict
    layout_index: LayoutIndex | None = None  # None: a step saved without one (loads reshard by merging)
    # per rank, the table roots holding a copy of its shard and data files, in the order a reader
    # tries them (its own roots not listed); None: a step saved without replicas (format.md 11)
    replicas: tuple[tuple[int, ...], ...] | None = None

    @property
    def version(self) -> tuple[int, int]:
        return REPLICAS_VERSION if self.replicas is not None else SHARDED_VERSION

    def to_json_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME, "version": list(self.version), "step": self.step,
            "created_unix": self.created_unix, "metadata": self.metadata,
            "dist": {"world_size": self.world_size, "layout": "gdswriter",
                     "roots": [{"id": r.id, "path": r.path, "ranks": _ranks_json(r.ranks, self.world_size)}
                               for r in self.roots]},
            "shards": [[s.root, s.name, s.size, s.crc32c] for s in self.shards],
            "totals": self.totals,
        }
        if self.layout_index is not None:
            body["layout_index"] = self.layout_index.to_json()
        if self.replicas is not None:
            body["replicas"] = [list(r) for r in self.replicas]
        crc = _crc32c.crc32c(_canonical(body))
        return (json.dumps({**body, "manifest_crc32c": crc}, separators=(",", ":"), allow_nan=False) + "\n").encode()

    @classmethod
    def from_body(cls, body: dict, where: str) -> GlobalManifest:
        """Validate a parsed manifest.json whose version is 1.3 or later (format.manifest checks
        the format name and major version first)."""
        try:
            return _parse_global(body, where)
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, OverflowError) as e:
            raise CorruptCheckpointError(f"{where} is malformed ({type(e).__name__}: {e}); the checkpoint is "
                                         f"damaged: load an earlier step") from e

    @staticmethod
    def new(step: int, world_size: int, roots: Sequence[RootInfo], shards: Sequence[ShardRef], metadata: dict,
            totals: dict, layout_index: LayoutIndex | None = None,
            replicas: Sequence[Sequence[int]] | None = None) -> GlobalManifest:
        return GlobalManifest(step, world_size, tuple(roots), tuple(shards), dict(metadata), time.time(),
                              dict(totals), layout_index,
                              None if replicas is None else tuple(tuple(r) for r in replicas))


def is_sharded(body: Any) -> bool:
    """Whether a parsed manifest.json is a 1.3 global manifest (it lists shards)."""
    return isinstance(body, dict) and "shards" in body


def parse_global(raw: bytes, where: str) -> GlobalManifest | None:
    """The global manifest in ``raw``, or None when ``raw`` is a 1.0-1.2 manifest (parse_step
    parses either from one decode). Damage is CorruptCheckpointError."""
    body = decode_json(raw, where)  # a 16,384-rank manifest is ~10^5 objects
    return GlobalManifest.from_body(body, where) if is_sharded(body) else None


def parse_step(raw: bytes, where: str) -> GlobalManifest | Manifest:
    """A step's manifest.json, decoded once: a 1.3 step's GlobalManifest (its shards unread), or
    a 1.0-1.2 step's Manifest. Damage is CorruptCheckpointError."""
    body = decode_json(raw, where)
    return GlobalManifest.from_body(body, where) if is_sharded(body) else Manifest.from_body(body, where, raw=raw)


def check_shard_bytes(ref: ShardRef, raw: bytes, where: str) -> None:
    """A shard file's bytes are the ones the global manifest recorded (size and crc32c)."""
    if len(raw) != ref.size or _crc32c.crc32c(raw) != ref.crc32c:
        raise CorruptCheckpointError(f"{where}: {len(raw)} bytes with crc32c {_crc32c.crc32c(raw):#010x}, the step's "
                                     f"{MANIFEST_NAME} recorded {ref.size} bytes with {ref.crc32c:#010x}: the "
                                     f"checkpoint is damaged; load an earlier step")


def merge(g: GlobalManifest, shards: Sequence[RankShard]) -> Manifest:
    """The whole step as one in-memory Manifest (as a 1.2 step parses), from the global manifest
    and every rank's shard (rank order). Every item must be covered exactly once by the pieces
    its holders wrote, and holders must agree on its size: CorruptCheckpointError otherwise."""
    if len(shards) != g.world_size:
        raise CorruptCheckpointError(f"step {g.step}: {len(shards)} shards for a world of {g.world_size}")
    index: dict[str, int] = {}
    sizes: list[int] = []
    reports = []
    for sh in shards:
        local = []
        for it in sh.items:
            n = index.setdefault(it.key, len(sizes))
            if n == len(sizes):
                sizes.append(it.nbytes)
            elif sizes[n] != it.nbytes:
                raise CorruptCheckpointError(f"step {g.step}: item {it.key[:40]} is {sizes[n]} bytes in one shard and "
                                             f"{it.nbytes} in rank {sh.rank}'s: the checkpoint is damaged")
            local.append(n)
        first_holder = [it.first_holder == sh.rank for it in sh.items]
        position: dict[int, int] = {}
        tensors = []
        for t in sh.tensors:
            pos = position.get(t.storage, 0)
            position[t.storage] = pos + 1
            tensors.append([local[t.storage], pos])
        reports.append({
            "files": [[f.root, f.path.rpartition("/")[2], f.size, f.info] for f in sh.files],  # copies: below
            "chunks": [[local[i], c.file, c.file_offset, c.storage_offset, c.length, c.crc32c]
                       for i, cs in enumerate(sh.chunks) for c in cs],
            "records": [[local[t.storage], _record_row(t)] for t in sh.tensors if first_holder[t.storage]],
            "tree": sh.tree,
            "tensors": tensors,
        })
    m = build_manifest(g.step, sizes, reports, g.roots, layout="gdswriter", metadata=g.metadata)
    # Through the 1.2 validation: coverage of every storage, chunk bounds, views inside storages.
    try:
        data = m.to_json_bytes()
    except Exception as e:  # noqa: BLE001 - a record no reader accepts: the shards are damaged
        raise CorruptCheckpointError(f"step {g.step}: the shards describe a tensor no reader accepts ({e}); the "
                                     f"checkpoint is damaged: load an earlier step") from e
    merged = Manifest.from_json_bytes(data, where=f"step {g.step} (its {g.world_size} manifest shards merged)")
    # the files in rank order, as build_manifest lists them, under their own paths (a copy's: in its folder)
    files = tuple(chain.from_iterable(sh.files for sh in shards))
    return Manifest(step=merged.step, files=files, storages=merged.storages, tensors=merged.tensors,
                    state=merged.state, created_unix=g.created_unix, metadata=merged.metadata,
                    version=SHARDED_VERSION, dist=merged.dist)


def _record_row(t: TensorRecord) -> list:
    shard = [list(t.shard.global_shape), list(t.shard.offsets)] if t.shard is not None else None
    return [t.name, t.byte_offset, t.dtype, list(t.shape), list(t.stride), t.device, t.kind, shard]


# -- the layout index ------------------------------------------------------------------------
MAX_MESH_DIMS = 16
MAX_TENSOR_DIMS = 64
REPLICATE = "R"  # a mesh dimension a DTensor is replicated over (an int d: it is sharded on tensor dim d)


@dataclass(frozen=True)
class MeshInfo:
    """A device mesh: its shape and its global ranks in mesh (row-major) order, written as
    ``first`` + ``step`` * i (the usual mesh: two numbers whatever its size) or, for any other
    order, as the list ``ranks``."""

    shape: tuple[int, ...]
    first: int = 0
    step: int = 1
    ranks: tuple[int, ...] | None = None

    @staticmethod
    def of(shape: Sequence[int], ranks: Sequence[int]) -> MeshInfo:
        ranks = [int(r) for r in ranks]
        step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        if step >= 1 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return MeshInfo(tuple(int(n) for n in shape), ranks[0], step)
        return MeshInfo(tuple(int(n) for n in shape), 0, 1, tuple(ranks))

    @property
    def size(self) -> int:
        n = 1
        for k in self.shape:
            n *= k
        return n

    def rank_at(self, coord: Sequence[int]) -> int:
        flat = 0
        for c, k in zip(coord, self.shape):
            flat = flat * k + c
        return self.first + self.step * flat if self.ranks is None else self.ranks[flat]

    def members(self) -> Sequence[int]:
        return range(self.first, self.first + self.step * self.size, self.step) if self.ranks is None else self.ranks

    def to_json(self) -> dict:
        if self.ranks is None:
            return {"shape": list(self.shape), "first": self.first, "step": self.step}
        return {"shape": list(self.shape), "ranks": list(self.ranks)}


@dataclass(frozen=True)
class DTensorLayout:
    """How a DTensor lies on its mesh, as every rank of the mesh knows it alike: per mesh
    dimension the tensor dimension it shards (torch.chunk's split, Shard(d)) or None (Replicate)."""

    mesh: MeshInfo
    placements: tuple[int | None, ...]


@dataclass(frozen=True)
class LayoutEntry:
    """One DTensor name of a step: its dtype, global shape and layout. Every block of it, and the
    ranks holding each, follow (``overlapping``): nothing is listed per block or per rank."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    layout: DTensorLayout

    def row(self) -> list:
        return [self.name, self.dtype, list(self.global_shape), self.layout.mesh.to_json(),
                [REPLICATE if d is None else d for d in self.layout.placements]]

    def overlapping(self, offsets: Sequence[int], shape: Sequence[int]
                    ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(holder rank, block offsets, block shape) of every saved block intersecting the block
        [offsets, offsets + shape), one holder per block (its replica at coordinate 0 of the
        dimensions it is replicated over). The work is the number of such blocks times the mesh
        dimensions, not the mesh's size."""
        mesh, placements = self.layout.mesh, self.layout.placements
        if any(n == 0 for n in shape) or any(n == 0 for n in self.global_shape):
            return []
        out: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

        def walk(i: int, coord: list[int], off: list[int], size: list[int]) -> None:
            if i == len(mesh.shape):
                if all(o < t + n and t < o + m for o, m, t, n in zip(off, size, offsets, shape)):
                    out.append((mesh.rank_at(coord), tuple(off), tuple(size)))
                return
            d = placements[i]
            if d is None:
                walk(i + 1, coord + [0], off, size)
                return
            k, n = mesh.shape[i], size[d]
            chunk = -(-n // k)
            lo, hi = max(0, offsets[d] - off[d]), offsets[d] + shape[d] - off[d]
            if chunk == 0 or hi <= lo:
                return
            for c in range(lo // chunk, min(k - 1, (hi - 1) // chunk) + 1):
                start = min(n, chunk * c)
                length = max(0, min(n, start + chunk) - start)
                if length:
                    walk(i + 1, coord + [c], off[:d] + [off[d] + start] + off[d + 1:],
                         size[:d] + [length] + size[d + 1:])

        walk(0, [], [0] * len(self.global_shape), list(self.global_shape))
        return out


def layout_digest(entries: Sequence[LayoutEntry]) -> str:
    """What a rank reports in the vote of a save: a digest of the layouts of the DTensors it holds
    (a few bytes whatever it holds), so the primary can check that its index describes them."""
    rows = sorted(e.row() for e in entries)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LayoutIndex:
    """The layout index of a 1.3 step's global manifest: per DTensor name its dtype, global shape,
    mesh and placements (meshes listed once). A loader on another layout finds from it which
    ranks' shards hold the blocks it needs, and reads those shards only: its size grows with the
    tensor names and meshes, never with the blocks (world size x tensors)."""

    entries: dict[str, LayoutEntry]
    # what mismatched() expects per set of meshes, kept: a training loop's saves reuse one index
    _expected: dict = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict:
        meshes: dict[MeshInfo, int] = {}
        rows = []
        for name in sorted(self.entries):
            e = self.entries[name]
            m = meshes.setdefault(e.layout.mesh, len(meshes))
            rows.append([e.name, e.dtype, list(e.global_shape), m,
                         [REPLICATE if d is None else d for d in e.layout.placements]])
        return {"meshes": [m.to_json() for m in meshes], "tensors": rows}

    def mismatched(self, reported: Sequence[str | None]) -> list[int]:
        """The ranks whose layout_digest (``reported``, rank order) is not that of the index's
        entries on the meshes they are part of. The work is the meshes' sizes, once."""
        world = len(reported)
        by_mesh: dict[MeshInfo, list[LayoutEntry]] = {}
        for e in self.entries.values():
            by_mesh.setdefault(e.layout.mesh, []).append(e)
        member_of: list[list[int]] = [[] for _ in range(world)]
        meshes = list(by_mesh)
        for k, mesh in enumerate(meshes):
            for r in mesh.members():
                if r < world:
                    member_of[r].append(k)
        expected: dict[tuple[int, ...], str] = self._expected
        bad = []
        for r in range(world):
            key = tuple(member_of[r])
            if key not in expected:
                expected[key] = layout_digest([e for k in key for e in by_mesh[meshes[k]]])
            if reported[r] != expected[key]:
                bad.append(r)
        return bad

    @staticmethod
    def from_json(body: Any, world: int) -> LayoutIndex:
        """Validate an index of a world of ``world`` ranks (every rank, shape and placement in range)
        before anything is sized from it; ValueError and friends when it is not."""
        meshes = []
        for x in _list(body["meshes"], "layout_index.meshes"):
            shape = tuple(_int(n, "a mesh dimension", world + 1) for n in _list(x["shape"], "a mesh shape"))
            if not 1 <= len(shape) <= MAX_MESH_DIMS or 0 in shape:
                raise ValueError(f"mesh shape {list(shape)[:MAX_MESH_DIMS + 1]} is not 1 to {MAX_MESH_DIMS} "
                                 f"dimensions of at least 1")
            size = 1
            for n in shape:
                size *= n
                if size > world:
                    raise ValueError(f"a mesh of shape {list(shape)} has more ranks than the world's {world}")
            if "ranks" in x:
                ranks = tuple(_int(r, "a mesh rank", world) for r in _list(x["ranks"], "a mesh's ranks"))
                if len(ranks) != size or len(set(ranks)) != size:
                    raise ValueError(f"a mesh of shape {list(shape)} lists {len(ranks)} ranks, not {size} distinct")
                meshes.append(MeshInfo(shape, 0, 1, ranks))
            else:
                first, step = _int(x["first"], "a mesh's first rank", world), _int(x["step"], "a mesh's step", world + 1)
                if step < 1 or first + step * (size - 1) >= world:
                    raise ValueError(f"a mesh of ranks {first} + {step} * i for {size} ranks runs past the world")
                meshes.append(MeshInfo(shape, first, step))
        entries: dict[str, LayoutEntry] = {}
        for x in _list(body["tensors"], "layout_index.tensors"):
            name, dtype, gshape, m, placements = _list(x, "a layout entry")
            name, dtype = _text(name, "a tensor name", 4096), _text(dtype, "a dtype")
            dtype_from_name(dtype)  # CorruptCheckpointError for an unknown dtype name
            shape = tuple(_int(n, "a global dimension") for n in _list(gshape, "a global shape"))
            mesh = meshes[_int(m, "a layout entry's mesh", len(meshes))]
            dims = []
            for p in _list(placements, "placements"):
                dims.append(None if p == REPLICATE else _int(p, "a sharded dimension", len(shape)))
            if len(shape) > MAX_TENSOR_DIMS or len(dims) != len(mesh.shape):
                raise ValueError(f"layout of {name[:200]!r}: {len(dims)} placements for a {len(mesh.shape)}-D mesh")
            if name in entries:
                raise ValueError(f"tensor {name[:200]!r} is listed twice")
            entries[name] = LayoutEntry(name, dtype, shape, DTensorLayout(mesh, tuple(dims)))
        return LayoutIndex(entries)


# -- validation ---------------------------------------------------------------------------
def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _ranks_json(ranks: tuple[int, ...], world_size: int) -> Any:
    """A root's ranks: "all" when every rank wrote to it (one shared root), else the list."""
    return "all" if len(ranks) == world_size and ranks == tuple(range(world_size)) else list(ranks)


def _int(v: Any, what: str, limit: int = INT64_LIMIT) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
        raise ValueError(f"{what}: expected an integer in [0, {limit}), got {v!r}")
    return v


def _text(v: Any, what: str, limit: int = MAX_KEY_CHARS) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise ValueError(f"{what}: expected a string of at most {limit} characters")
    return v


def _list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise ValueError(f"{what}: expected a list, got {type(v).__name__}")
    return v


def _plain_name(v: Any) -> str:
    """A file name that stays in the step directory it is joined to, and that the file system can
    name at all (fs.name_problem)."""
    s = _text(v, "a file name")
    problem = name_problem(s)
    if problem is not None:
        raise ValueError(f"data file name {problem}")
    return s


def _parse_global(body: dict, where: str) -> GlobalManifest:
    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {msg}; the checkpoint is damaged: load an earlier step")

    expected = body.pop("manifest_crc32c", None)
    if not isinstance(expected, int) or _crc32c.crc32c(_canonical(body)) != expected:
        raise bad("manifest checksum does not match its content")
    d = body["dist"]
    world = _int(d["world_size"], "dist.world_size")
    if world < 1 or d["layout"] != "gdswriter":
        raise bad(f"dist: world_size {world} or layout {d['layout']!r} is invalid for a sharded manifest")
    rows = _list(d["roots"], "dist.roots")
    if not _roots_ok(rows, world):  # the checks below, entry by entry, for the message
        for r in rows:
            if r["ranks"] != "all":
                [_int(x, "a root's rank", world) for x in _list(r["ranks"], "ranks")]
            _text(r["id"], "a root id"), _text(r["path"], "a root path", 4096)
        raise bad("its root table is malformed")
    if not rows:
        raise bad("no root table")
    roots = RootTable(rows, world)
    entries = _list(body["shards"], "shards")
    if not _shards_ok(entries, len(roots)):
        for x in entries:
            root, name, size, crc = _list(x, "a shard entry")
            _int(root, "a shard's root", len(roots)), _plain_name(name), _int(size, "a shard's size")
            _int(crc, "a shard's crc32c", 1 << 32)
            if not name.endswith(".json"):
                raise bad(f"shard file name {name!r}")
        raise bad("its shard table is malformed")
    shards = ShardTable(entries)
    if len(shards) != world:
        raise bad(f"{len(shards)} shards listed for a world of {world} ranks")
    metadata, totals = body.get("metadata", {}), body.get("totals", {})
    created = body.get("created_unix", 0.0)
    if not isinstance(metadata, dict) or not isinstance(totals, dict) or not isinstance(created, (int, float)):
        raise bad("metadata, totals or created_unix has the wrong type")
    index = None
    if "layout_index" in body:
        try:
            index = LayoutIndex.from_json(body["layout_index"], world)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, OverflowError) as e:
            raise bad(f"its layout index is malformed ({type(e).__name__}: {e})") from e
    replicas = _replicas_in(body, world, len(roots), bad)
    return GlobalManifest(_int(body["step"], "step"), world, roots, shards, metadata, float(created), totals, index,
                          replicas)


def _replicas_in(body: dict, world: int, n_roots: int,
                 bad: Callable[[str], CorruptCheckpointError]) -> tuple[tuple[int, ...], ...] | None:
    """A global manifest's "replicas" entry (format 1.4), None where it has none."""
    if "replicas" not in body:
        return None
    replicas = _replicas(body["replicas"], world, n_roots)
    if not replicas:
        raise bad(f"its replicas table is malformed (one list per rank of the {world}, each of at most "
                  f"{MAX_COPY_ROOTS} distinct root indices below {n_roots})")
    return replicas


def _replicas(value: Any, world: int, n_roots: int) -> tuple[tuple[int, ...], ...]:
    """The "replicas" table checked (() when malformed: a world has at least one rank):
    ``world`` lists of distinct root indices in [0, n_roots), each at most MAX_COPY_ROOTS long."""
    if not isinstance(value, list) or len(value) != world or set(map(type, value)) - {list}:
        return ()
    if max(map(len, value), default=0) > MAX_COPY_ROOTS:
        return ()
    if not _ints_in(list(chain.from_iterable(value)), n_roots):
        return ()
    out = tuple(map(tuple, value))
    return out if all(len(set(e)) == len(e) for e in out) else ()


def _parse_shard(body: Any, where: str, step: int, rank: int, world: int, n_roots: int) -> RankShard:
    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {msg}; the checkpoint is damaged: load an earlier step")

    if not isinstance(body, dict) or body.get("format") != SHARD_FORMAT:
        raise bad("not a gdswriter manifest shard")
    if (body["step"], body["rank"], body["world_size"]) != (step, rank, world):
        raise bad(f"it is rank {body['rank']}'s shard of step {body['step']} (world {body['world_size']}), not rank "
                  f"{rank}'s of step {step} (world {world})")
    groups = _holder_groups(body["groups"], rank, world, bad)
    items = _shard_items(body["items"], groups, rank, bad)
    files = _shard_files(body["files"], n_roots, bad)
    chunks = _shard_chunks(body["chunks"], items, files, bad)
    tensors = _shard_tensors(body["tensors"], items, bad)
    tensor_refs(body["tree"], len(tensors))  # every reference names one of its records
    return RankShard(step, rank, world, files, items, chunks, tensors, body["tree"])


def _holder_groups(rows: Any, rank: int, world: int,
                   bad: Callable[[str], CorruptCheckpointError]) -> list[tuple[int, ...]]:
    """A shard's holder groups: each a sorted set of at least two ranks, this ``rank`` among them."""
    groups = []
    for g in _list(rows, "groups"):
        ranks = tuple(_int(x, "a holder rank", world) for x in _list(g, "a group"))
        if len(ranks) < 2 or list(ranks) != sorted(set(ranks)) or rank not in ranks:
            raise bad(f"holder group {list(ranks)[:8]} is not a sorted set of ranks including rank {rank}")
        groups.append(ranks)
    return groups


def _shard_items(rows: Any, groups: list[tuple[int, ...]], rank: int,
                 bad: Callable[[str], CorruptCheckpointError]) -> tuple[ItemRecord, ...]:
    """A shard's items, each with its holders (every rank, this rank only, or one of ``groups``);
    keys are distinct."""
    items = []
    for x in _list(rows, "items"):
        key, nbytes, ref = _list(x, "an item")
        if isinstance(ref, bool) or not isinstance(ref, int) or not EVERY_RANK <= ref < len(groups):
            raise bad(f"an item's holders {ref!r}")
        holders = None if ref == EVERY_RANK else (rank,) if ref == ONLY_THIS_RANK else groups[ref]
        items.append(ItemRecord(_text(key, "an item key"), _int(nbytes, "an item's size"), holders))
    if len({it.key for it in items}) != len(items):
        raise bad("an item is listed twice")
    return tuple(items)


def _shard_files(rows: Any, n_roots: int, bad: Callable[[str], CorruptCheckpointError]) -> tuple[FileRecord, ...]:
    """A shard's data files, each on one of the ``n_roots`` roots with a small info object of
    short scalars; none listed twice."""
    files = []
    for x in _list(rows, "files"):
        x = _list(x, "a file entry")
        info = x[3] if len(x) > 3 else {}
        if len(x) not in (3, 4) or not isinstance(info, dict) or len(info) > 16 or not all(
                v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 256)
                for v in info.values()):
            raise bad("a data file entry is [root, name, size] or [root, name, size, {info}] of short scalars")
        files.append(FileRecord(_int(x[0], "a file's root", n_roots), _plain_name(x[1]), _int(x[2], "a file size"),
                                dict(info)))
    if len({(f.root, f.path) for f in files}) != len(files):
        raise bad("a data file is listed twice")
    return tuple(files)


def _shard_chunks(rows: Any, items: tuple[ItemRecord, ...], files: tuple[FileRecord, ...],
                  bad: Callable[[str], CorruptCheckpointError]) -> tuple[tuple[ChunkRecord, ...], ...]:
    """Each item's chunks, by item offset: inside their file and their item, no two overlapping
    in an item or in a data file."""
    chunks: list[list[ChunkRecord]] = [[] for _ in items]
    in_files: list[tuple[int, int, int]] = []
    for x in _list(rows, "chunks"):
        i, f, fo, so, ln, crc = _list(x, "a chunk")
        i, f = _int(i, "a chunk's item", len(items)), _int(f, "a chunk's file", len(files))
        c = ChunkRecord(f, _int(fo, "file offset"), _int(so, "item offset"), _int(ln, "length"),
                        _int(crc, "crc32c", 1 << 32))
        if c.file_offset + c.length > files[f].size or c.storage_offset + c.length > items[i].nbytes:
            raise bad(f"a chunk of item {i} runs past the end of {files[f].path} or of its item")
        chunks[i].append(c)
        if c.length:
            in_files.append((f, c.file_offset, c.file_offset + c.length))
    for cs in chunks:
        cs.sort(key=lambda c: c.storage_offset)
        if any(a.storage_offset + a.length > b.storage_offset for a, b in zip(cs, cs[1:])):
            raise bad("two chunks of one item overlap")
    in_files.sort()
    if any(fa == fb and sb < ea for (fa, _, ea), (fb, sb, _) in zip(in_files, in_files[1:])):
        raise bad("two chunks overlap in one data file")
    return tuple(tuple(cs) for cs in chunks)


def _shard_tensors(rows: Any, items: tuple[ItemRecord, ...],
                   bad: Callable[[str], CorruptCheckpointError]) -> tuple[TensorRecord, ...]:
    """A shard's tensor records: each a valid view of its item, with its block of a global tensor if any."""
    tensors = []
    for x in _list(rows, "tensors"):
        i, name, byte_offset, dtype, shape, stride, device, kind, shard = _list(x, "a tensor")
        i = _int(i, "a tensor's item", len(items))
        rec = TensorRecord(_text(name, "a tensor name", 4096), i, _int(byte_offset, "byte_offset"),
                           _text(dtype, "a dtype"), tuple(_int(v, "a dimension") for v in _list(shape, "shape")),
                           tuple(_int(v, "a stride") for v in _list(stride, "stride")), _text(device, "a device"),
                           _text(kind, "a kind"))
        if rec.kind not in ("tensor", "ndarray"):
            raise bad(f"tensor {rec.name[:200]!r} has kind {rec.kind!r}")
        why = rec.problem(items[i].nbytes)
        if why:
            raise bad(f"tensor {rec.name[:200]!r} has {why}")
        if shard is not None:
            rec = _with_block(rec, shard, bad)
        tensors.append(rec)
    return tuple(tensors)


def _with_block(rec: TensorRecord, shard: Any, bad: Callable[[str], CorruptCheckpointError]) -> TensorRecord:
    """``rec`` with its block ([global shape, offsets]), which must fit in the global shape."""
    gshape = tuple(_int(v, "a global dimension") for v in _list(shard[0], "global shape"))
    offsets = tuple(_int(v, "an offset") for v in _list(shard[1], "offsets"))
    if len(gshape) != len(rec.shape) or len(offsets) != len(rec.shape) or any(
            o + n > s for o, n, s in zip(offsets, rec.shape, gshape)):
        raise bad(f"tensor {rec.name[:200]!r}: its block does not fit in its global shape")
    return TensorRecord(rec.name, rec.storage, rec.byte_offset, rec.dtype, rec.shape, rec.stride, rec.device,
                        rec.kind, ShardInfo(gshape, offsets))


# -- the root and shard tables of a parsed global manifest ----------------------------------------
# They list every rank (W entries), and a rank's load needs a few of them: they are checked in
# bulk, by passes in C over their columns (map, zip, min, max), and an entry becomes a RootInfo
# or ShardRef only when read. Any entry the bulk checks refuse is checked again one by one
# (_parse_global), for a message that names what is wrong.
def _ints_in(values: Sequence[Any], limit: int) -> bool:
    """Whether ``values`` are all ints (not bools) in [0, limit)."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0 and max(values) < limit)


def _texts_of(values: Sequence[Any], limit: int) -> bool:
    """Whether ``values`` are all strings of at most ``limit`` characters."""
    return not values or (set(map(type, values)) == {str} and max(map(len, values)) <= limit)


def _shards_ok(entries: list, n_roots: int) -> bool:
    """Whether every entry of the shard table is [root, plain file name ending .json, size, crc32c]
    (the checks _parse_global's entry-by-entry loop makes)."""
    if not entries:
        return True
    if set(map(type, entries)) != {list} or set(map(len, entries)) != {4}:
        return False
    roots, names, sizes, crcs = zip(*entries)
    if not (_ints_in(roots, n_roots) and _ints_in(sizes, INT64_LIMIT) and _ints_in(crcs, 1 << 32)
            and _texts_of(names, MAX_KEY_CHARS)):
        return False
    joined = "\n".join(names)  # ending in ".json", a name is neither empty nor "." nor ".."
    return (all(map(str.endswith, names, repeat(".json"))) and not any(c in joined for c in "/\\\0")
            and name_problem(joined) is None)


def _roots_ok(rows: list, world: int) -> bool:
    """Whether every entry of the root table is {"id": id, "path": path, "ranks": "all" or [ranks
    of the world]} (the checks _parse_global's entry-by-entry loop makes)."""
    if not rows:
        return True
    if set(map(type, rows)) != {dict}:
        return False
    try:
        ids, paths, ranks = (list(map(itemgetter(k), rows)) for k in ("id", "path", "ranks"))
    except KeyError:
        return False
    if not (_texts_of(ids, MAX_KEY_CHARS) and _texts_of(paths, 4096)) or not set(map(type, ranks)) <= {str, list}:
        return False
    listed = list(compress(ranks, map(ne, ranks, repeat("all"))))
    return set(map(type, listed)) <= {list} and _ints_in(list(chain.from_iterable(listed)), world)


_T = TypeVar("_T")


class _LazyTable(Sequence[_T]):
    """A table of a parsed global manifest whose entries become objects only when read (``_make``),
    so a rank reading a few of W entries makes a few."""

    def __init__(self, rows: list):
        self._rows = rows

    def _make(self, i: int) -> _T:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> _T: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[_T, ...]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[k] for k in range(len(self))[i])
        return self._make(range(len(self._rows))[i])  # IndexError past the end; a negative index counts from it

    def __iter__(self) -> Iterator[_T]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} entries)"


class RootTable(_LazyTable[RootInfo]):
    """The root table of a parsed global manifest (dist.roots, checked by _roots_ok): a RootInfo
    per entry read, and the ids and paths of every entry as lists (for matching a rank's own
    roots against them in C: distributed/loadplan.py ``reach_of``)."""

    def __init__(self, rows: list[dict], world: int):
        super().__init__(rows)
        self._world = world
        self._made: dict[int, RootInfo] = {}  # made once: a root of every rank ("all") lists W ranks
        self._ids: list[str] | None = None
        self._paths: list[str] | None = None

    def _make(self, i: int) -> RootInfo:
        info = self._made.get(i)
        if info is None:
            r = self._rows[i]
            ranks = tuple(range(self._world)) if r["ranks"] == "all" else tuple(r["ranks"])
            info = self._made[i] = RootInfo(r["id"], r["path"], ranks)
        return info

    @property
    def ids(self) -> list[str]:
        if self._ids is None:
            self._ids = list(map(itemgetter("id"), self._rows))
        return self._ids

    @property
    def paths(self) -> list[str]:
        if self._paths is None:
            self._paths = list(map(itemgetter("path"), self._rows))
        return self._paths


class ShardTable(_LazyTable[ShardRef]):
    """The shard table of a parsed global manifest (checked by _shards_ok): a ShardRef per entry
    read, so a rank that reads its own shard makes one, whatever the world size."""

    def _make(self, rank: int) -> ShardRef:
        root, name, size, crc = self._rows[rank]
        return ShardRef(rank, root, name, size, crc)


def root_columns(roots: Sequence[RootInfo]) -> tuple[list[str], list[str]]:
    """The ids and the paths of ``roots`` (a RootTable's, made in C)."""
    if isinstance(roots, RootTable):
        return roots.ids, roots.paths
    return [r.id for r in roots], [r.path for r in roots]


def match_roots(saved: Sequence[RootInfo], roots: Sequence[Path]) -> list[Path | None]:
    """Where each saved root is among ``roots`` (directories given to one process): by the id
    in its ``.gdswriter-root``, else by path for a root that has no marker; None where absent."""
    ids: dict[str, Path] = {}
    paths: dict[str, Path] = {}
    for r in roots:
        ident = root_identity(r, create=False) if r.is_dir() else None
        if ident is not None:
            ids.setdefault(ident.id, r)
        else:
            paths.setdefault(str(r.resolve()), r)
    return [ids.get(info.id) or paths.get(info.path) for info in saved]


def step_vanished(step: int, created_unix: float, primary: Path | None, step_dir: Path | None = None) -> bool:
    """Whether step ``step``, committed at ``created_unix`` when its manifest.json was read, is
    no longer committed as read: deleted (a running checkpointer's retention, delete_step) or
    saved again. ``primary``: the primary root, where this process sees it: then its manifest.json
    decides (missing, or another save's). Else ``step_dir``, the step's directory on the root
    that lacked a file, decides: retention retires a step's directories by renaming them away,
    the primary's first, so a directory gone from its name means the step was deleted. A file
    missing while the step is still committed as read is damage. The one rule of every reader
    (load/reader.py ``step_gone``, ``read_shard``, the multi-rank loads); docs/format.md 10.4."""
    if primary is None:
        return step_dir is not None and not step_dir.is_dir()
    try:
        raw = read_regular_file(primary / step_dir_name(step) / MANIFEST_NAME, MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # unreadable now: damage, reported as it was found
    try:
        body = decode_json(raw, "manifest.json")
        return float(body["created_unix"]) != created_unix
    except (CorruptCheckpointError, KeyError, TypeError, ValueError):
        return False


def vanished_error(step: int, where: Path | str, problem: BaseException | str) -> CheckpointNotFoundError:
    """The error of a read that lost a race with a deletion (``step_vanished``): the step is gone,
    not damaged."""
    return CheckpointNotFoundError(errno.ENOENT, f"step {step} under {where} was deleted (or saved again) while it "
                                                 f"was being read, by a running checkpointer's retention "
                                                 f"(keep_last?): read a newer step ({' '.join(str(problem).split())})")


def read_shard(where: Path, g: GlobalManifest, ref: ShardRef, primary: Path | None = None) -> bytes:
    """The bytes of shard ``ref`` in step directory ``where`` (a regular file, size and crc32c as
    recorded). Missing or other bytes: CheckpointNotFoundError when the step vanished meanwhile
    (``step_vanished``; ``primary``: the primary root where this process sees it), else
    CorruptCheckpointError."""
    path = where / ref.name
    try:
        raw = read_regular_file(path, ref.size)
        check_shard_bytes(ref, raw, str(path))
    except (FileNotFoundError, CorruptCheckpointError) as e:
        if step_vanished(g.step, g.created_unix, primary, where):
            raise vanished_error(g.step, primary or where.parent, e) from e
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"manifest shard {path} of step {g.step} (rank {ref.rank}) is missing: the "
                                     f"checkpoint is incomplete, or its root is not the one given here") from e
    return raw


def parse_shard(raw: bytes, g: GlobalManifest, ref: ShardRef, where: str) -> RankShard:
    """Shard ``ref``'s bytes, parsed and validated. A shard read from a folder of the step
    directory (a copy: format/copies.py ``copy_ref``) has its data files beside it, on its root."""
    shard = RankShard.from_json_bytes(raw, where=where, step=g.step, rank=ref.rank, world_size=g.world_size,
                                      n_roots=len(g.roots))
    folder = ref.name.rpartition("/")[0]
    if not folder:
        return shard
    return replace(shard, files=tuple(FileRecord(ref.root, f"{folder}/{f.path}", f.size, f.info) for f in shard.files))


def load_merged(g: GlobalManifest, roots: Sequence[Path]) -> Manifest:
    """The whole step (merge) in one process that sees every root among ``roots``."""
    where = match_roots(g.roots, roots)
    shards = []
    for ref in g.shards:
        root = where[ref.root]
        if root is None:
            info = g.roots[ref.root]
            raise UnreachableDataError(errno.ENOENT, f"step {g.step}: rank {ref.rank}'s manifest shard is on root id "
                                                     f"{info.id} (saved at {info.path}), which is not among the "
                                                     f"roots given: pass every node's roots, the primary first")
        d = root / step_dir_name(g.step)
        shards.append(parse_shard(read_shard(d, g, ref, where[0]), g, ref, str(d / ref.name)))
    return merge(g, shards)
