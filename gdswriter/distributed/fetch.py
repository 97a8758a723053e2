"""Reading a multi-rank step when each rank sees only some of its roots.

Roots may be node-local: a rank cannot open files another node wrote. A manifest's roots are
matched to this rank's roots by identity (``.gdswriter-root``; by path only for a local root
that has none, since one path on every node is a different disk on each).
Each rank reads, through its engine, the chunks it needs that lie on roots it reaches; every
other chunk it needs is read by a rank that reaches it (the least loaded one) and sent over
the coordination group. Rank 0 assigns those readers: each rank sends it the chunks it cannot
read and the roots it sees (a gather), and it sends each rank its own moves alone
(``scatter_own``), so a rank receives what its own needs and its share of the reading take,
whatever the world size. Before any rank allocates a buffer, each rank checks the files it
reads against their recorded sizes and all ranks agree on the outcome, so a manifest claiming
more than its files hold is refused before it costs memory anywhere. Chunks are checked
against their crc32c where they are read, and again where they arrive. All ranks agree on
failure: if one fails, all raise. A caller may name storages to read in place (``into``: the
DCP reader hands DCP's own target tensors, saving a buffer and a copy); those are the only
memory a failed fetch can leave partly written.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence

import crc32c as _crc32c
import torch

from ..engines.base import IOEngine
from ..errors import ChecksumMismatchError, CorruptCheckpointError, UnreachableDataError
from ..format.commit import CommitProtocol
from ..format.manifest import ChunkRecord, Manifest, StorageRecord, TensorRecord
from ..load.reader import check_step_files, host_buffer, read_storages, vanished_instead
from .group import Coordinator, Transfer
from .roots import RootLayout


@dataclass(frozen=True)
class Reach:
    """Where this rank finds each root of a manifest (None: it cannot)."""

    paths: tuple[Path | None, ...]


def manifest_reach(m: Manifest, layout: RootLayout) -> Reach:
    """Match the manifest's roots to this rank's: by the ids recorded in a multi-rank manifest;
    by path only where a root has no id (a local root without ``.gdswriter-root``, read as a
    "path:" pseudo-id): node-local disks mounted at one path on every node are different roots.
    A single-process checkpoint's roots are rank 0's, in order."""
    if m.dist is None:
        rank0 = [g for g, info in enumerate(layout.table) if 0 in info.ranks]
        n = 1 + max((f.root for f in m.files), default=0)
        if n > len(rank0):  # no rank reaches it (and its number, from the manifest, must not size anything)
            raise UnreachableDataError(errno.ENOENT, f"step {m.step} has data files on root #{n - 1}, but rank 0 was "
                                                     f"given {len(rank0)} root(s): pass every root that saved it, "
                                                     f"in order")
        return Reach(tuple(layout.local_paths[i] if g < len(rank0) and (i := layout.local_of(rank0[g])) is not None
                           else None for g in range(n)))
    unmarked = {str(p.resolve()): p for p, i in zip(layout.local_paths, layout.local_ids) if i.startswith("path:")}
    paths: list[Path | None] = []
    for info in m.dist.roots:
        if info.id in layout.local_ids:
            paths.append(layout.local_paths[layout.local_ids.index(info.id)])
        else:
            paths.append(unmarked.get(info.path))
    return Reach(tuple(paths))


def read_chunks(m: Manifest, reach: Reach, wanted: Sequence[tuple[int, int, torch.Tensor]], engine: IOEngine,
                *, verify: bool) -> None:
    """Read chunks (storage, chunk index, destination) from the roots this rank reaches, through
    load.reader.read_storages: each chunk is presented to it as a storage of its own."""
    if not wanted:
        return
    names: dict[int, str] = {}
    for t in m.tensors:
        names.setdefault(t.storage, t.name)
    storages, tensors = [], []
    for j, (s, ci, _) in enumerate(wanted):
        c = m.storages[s].chunks[ci]
        storages.append(StorageRecord(c.length, (ChunkRecord(c.file, c.file_offset, 0, c.length, c.crc32c),)))
        tensors.append(TensorRecord(names.get(s, f"<storage {s}>"), j, 0, "uint8", (c.length,), (1,)))
    view = replace(m, storages=tuple(storages), tensors=tuple(tensors))
    protocol = CommitProtocol([p if p is not None else Path("/nonexistent-root") for p in reach.paths])
    try:
        read_storages(protocol, view, [dest for _, _, dest in wanted], [engine], verify=verify)
    except (CorruptCheckpointError, OSError) as e:  # the step deleted meanwhile: gone, not damaged
        gone = vanished_instead(m.step, m.created_unix, reach.paths, {f.root for f in m.files}, e)
        if gone is None:
            raise
        raise gone from e


def check_reached_files(m: Manifest, reach: Reach, files: set[int]) -> None:
    """The data files ``files`` (indices into ``m.files``, on roots this rank reaches) are regular
    files of their recorded sizes (load.reader.check_step_files: CheckpointNotFoundError when the
    step vanished meanwhile)."""
    check_step_files(m.step, m.created_unix, reach.paths, (m.files[f] for f in sorted(files)))


def fetch_storages(coord: Coordinator, reach: Reach, m: Manifest, storages: Iterable[int], engine: IOEngine, *,  # noqa: C901
                   verify: bool, what: str, alloc: Callable[[int], torch.Tensor] = host_buffer,
                   into: Mapping[int, torch.Tensor] | None = None, alone: bool = False) -> dict[int, torch.Tensor]:
    """Collective: {storage: flat uint8 buffer of its nbytes, filled} for ``storages`` on every rank.

    Nothing is allocated before every rank has checked the files it reads (for itself or for
    others) against the manifest (check_reached_files): what a load allocates is then bounded by
    the real files, on every rank, whatever a damaged manifest claims. ``alloc`` makes a buffer;
    ``into`` gives the buffer of some storages (flat uint8 CPU tensors of their nbytes, e.g. the
    caller's live tensors): those are filled in place, and a failure may leave them partly
    written (the hints of the errors say so).

    ``alone`` (the same on every rank): every rank reaches every root of ``m`` and the caller's
    own protocol tells every rank of a failure (DCP's gather of read_data's outcomes): then
    each rank reads what it needs itself, with no collective, after checking its own files
    (so what it allocates is bounded by them) and raises its own error."""
    into = into or {}
    for s, t in into.items():
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != m.storages[s].nbytes:
            raise ValueError(f"fetch_storages: the buffer given for storage {s} is not a flat uint8 tensor of its "
                             f"{m.storages[s].nbytes} bytes")
    untouched = "the live state was not changed" if not into else \
        "tensors read in place may be partly overwritten: load again"
    needed = sorted(set(storages))
    local, remote = [], []
    for s in needed:
        for ci, c in enumerate(m.storages[s].chunks):
            if c.length:
                (local if reach.paths[m.files[c.file].root] is not None else remote).append([s, ci])
    if alone:
        if remote:
            raise ValueError(f"fetch_storages: alone=True, but this rank reaches no root of storage {remote[0][0]}")
        check_reached_files(m, reach, {m.storages[s].chunks[ci].file for s, ci in local})
        buffers = {s: into[s] if s in into else alloc(m.storages[s].nbytes) for s in needed}
        read_chunks(m, reach, [(s, ci, _slice(buffers[s], m.storages[s].chunks[ci])) for s, ci in local], engine,
                    verify=verify)
        return buffers
    asks = coord.gather({"need": remote, "reach": [g for g, p in enumerate(reach.paths) if p is not None]},
                        f"{what} (locating chunks)", dst=0)
    parts: list[dict] | None = None
    plan_error = None
    if asks is not None:  # rank 0 assigns every chunk a reader and tells each rank its own part
        try:
            parts = [{"moves": p} for p in assign_readers(m, asks, what)]
        except UnreachableDataError as e:
            plan_error, parts = e, [{"error": str(e)}] * coord.world_size
    part = scatter_own(coord, parts, f"{what} (the chunks each rank sends and receives)")
    if "error" in part:
        raise plan_error or UnreachableDataError(2, part["error"])
    moves: list[tuple[int, int, int, int, int]] = [tuple(x) for x in part["moves"]]  # type: ignore[misc]
    rank = coord.rank
    mine = [(s, ci) for s, ci in local] + [(s, ci) for _, src, _, s, ci in moves if src == rank]
    error = None
    try:  # every file this rank reads, checked before any rank allocates a byte for it
        check_reached_files(m, reach, {m.storages[s].chunks[ci].file for s, ci in mine})
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (checking the data files)", hint="the live state was not changed")
    buffers: dict[int, torch.Tensor] = {}
    sends: dict[tuple[int, int], torch.Tensor] = {}
    error = None
    try:
        buffers = {s: into[s] if s in into else alloc(m.storages[s].nbytes) for s in needed}
        wanted = [(s, ci, _slice(buffers[s], m.storages[s].chunks[ci])) for s, ci in local]
        sends = {(s, ci): dest for s, ci, dest in wanted}  # a chunk this rank reads for itself is sent from there
        for _, src, _, s, ci in moves:
            if src == rank and (s, ci) not in sends:
                sends[(s, ci)] = alloc(m.storages[s].chunks[ci].length)
                wanted.append((s, ci, sends[(s, ci)]))
        read_chunks(m, reach, wanted, engine, verify=verify)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = e
    coord.agree(error, f"{what} (reading)", hint=untouched)
    transfers = []
    for tag, src, dst, s, ci in moves:
        if rank == src:
            transfers.append(Transfer(src, dst, tag, sends[(s, ci)]))
        elif rank == dst:
            transfers.append(Transfer(src, dst, tag, _slice(buffers[s], m.storages[s].chunks[ci])))
    coord.exchange(transfers, f"{what} (sending chunks)")
    error = None
    if verify:
        for _, src, dst, s, ci in moves:
            c = m.storages[s].chunks[ci]
            got = _crc32c.crc32c(_slice(buffers[s], c).numpy()) if dst == rank else c.crc32c
            if got != c.crc32c:
                error = ChecksumMismatchError(f"<chunk received from rank {src}>", f"<storage {s}>", c.file_offset,
                                              c.length, c.crc32c, got)
                break
    coord.agree(error, f"{what} (checking received chunks)", hint=untouched)
    return buffers


def scatter_own(coord: Coordinator, parts: Sequence[dict] | None, what: str) -> dict:
    """Collective: rank 0's ``parts[r]`` (JSON) on each rank r, which receives its own part
    alone: the sizes go out in a fixed-size scatter, then each part point to point. (A plain
    scatter pads every message to the longest: a rank reading for many others has a long part,
    and every rank would receive that length.)"""
    if coord.solo_mode:
        assert parts is not None
        return json.loads(json.dumps(parts[0]))
    datas = [json.dumps(p, separators=(",", ":"), allow_nan=False).encode() for p in parts] \
        if coord.rank == 0 and parts is not None else []
    size = int(coord.scatter([len(d) for d in datas] if datas else None, f"{what} (sizes)", src=0))
    if coord.rank == 0:
        coord.exchange([Transfer(0, r, 0, torch.frombuffer(bytearray(d), dtype=torch.uint8))
                        for r, d in enumerate(datas) if r], what)
        return json.loads(datas[0])
    buf = torch.empty(size, dtype=torch.uint8)
    coord.exchange([Transfer(0, coord.rank, 0, buf)], what)
    return json.loads(bytes(buf.numpy()))


def assign_readers(m: Manifest, asks: Sequence[dict], what: str) -> list[list[list[int]]]:
    """On rank 0 of a fetch: given each rank's ask (the chunks it needs and cannot read, the roots
    it reaches), per rank the [tag, src, dst, storage, chunk] moves it takes part in: each chunk
    read by the least loaded rank that reaches its root. A rank's part holds its own needs and
    its share of the reading for others, whatever the world size (no rank receives every ask)."""
    readers: dict[int, list[int]] = {}
    for r, x in enumerate(asks):
        for root in x["reach"]:
            readers.setdefault(root, []).append(r)
    load = [0] * len(asks)
    parts: list[list[list[int]]] = [[] for _ in asks]
    tag = 0
    for dst, x in enumerate(asks):
        for s, ci in x["need"]:
            c = m.storages[s].chunks[ci]
            root = m.files[c.file].root
            providers = readers.get(root)
            if not providers:
                where = m.dist.roots[root] if m.dist is not None else None
                raise UnreachableDataError(
                    2, f"{what}: data file {m.files[c.file].path} is on root #{root}"
                       + (f" (id {where.id}, saved at {where.path} by ranks {list(where.ranks)[:16]})" if where else "")
                       + ", which no rank of this job can read: give some rank that root (mount it, or copy its "
                         "step directory and .gdswriter-root there)")
            src = min(providers, key=lambda r: (load[r], r))
            load[src] += c.length
            parts[src].append([tag, src, dst, s, ci])
            parts[dst].append([tag, src, dst, s, ci])
            tag += 1
    return parts


def _slice(buf: torch.Tensor, c: ChunkRecord) -> torch.Tensor:
    return buf[c.storage_offset:c.storage_offset + c.length]
