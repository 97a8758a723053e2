"""The one executor of the multi-rank reads: a pure read plan carried out through an engine.

The own-shard short path (load.py ``carry_out_own``), the reshard path (reshard.py
``read_reached``) and the fetch under GDSStorageReader (fetch.py ``fetch_storages``) each plan
which byte ranges of which data files go into which buffers, and which of them to check
against their crc32c (a ``ReadPlan``: frozen dataclasses, no tensor in it); ``execute`` carries
one out. It allocates the plan's buffers (those the caller does not give), reads each file's
ranges in one engine call in file order (the engine streams them through its staging pool, so
what it holds beyond the buffers is bounded by that pool), checks each whole chunk's crc32c as
it is read, and reports the result as one typed outcome (``ReadOutcome``: the buffers and the
failure, damage or otherwise, a step deleted meanwhile turned into CheckpointNotFoundError), which
the caller agrees on with the other ranks. Chunks that arrive from other ranks, or that several
ranks read parts of, are checked whole afterwards (``check_chunks``); the bytes travel between
ranks in rounds of moves over the process group (``send_moves``, ``send_rounds``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Hashable, Mapping, Sequence

import crc32c as _crc32c
import torch

from ..engines.base import IOEngine, ReadSpan
from ..errors import ChecksumMismatchError, CorruptCheckpointError
from ..format.commit import step_dir_name
from ..format.manifest import ChunkRecord, FileRecord
from ..load.reader import host_buffer, vanished_instead
from .group import Coordinator, Transfer
from .ownplan import Move

UNSEEN_ROOT = Path("/nonexistent-root")  # where a range on a root this rank does not see is looked for


@dataclass(frozen=True)
class RangeRead:
    """``length`` bytes at ``file_offset`` of the plan's data file ``file`` into buffer ``dest``
    at ``dest_offset``; ``crc32c``: the chunk's checksum, checked when it is read (None: a part
    of a chunk, checked whole once its parts are together, or not at all); ``name``: what a
    checksum error names."""

    file: int
    file_offset: int
    length: int
    dest: Hashable
    dest_offset: int
    crc32c: int | None
    name: str


@dataclass(frozen=True)
class ReadPlan:
    """What one rank reads of step ``step`` (committed at ``created_unix``): ``reads`` from
    ``files`` (each on a root of the step: an index into the reach the executor is given), into
    the buffers ``buffers`` names ((key, bytes): allocated by the executor unless given)."""

    step: int
    created_unix: float
    files: tuple[FileRecord, ...]
    reads: tuple[RangeRead, ...]
    buffers: tuple[tuple[Hashable, int], ...] = ()


@dataclass(frozen=True)
class ChunkCheck:
    """A chunk whole in buffer ``dest`` at ``dest_offset`` (``length`` bytes) against its
    ``crc32c``; a mismatch names ``where`` (its file, or the rank it came from), ``name`` and
    its ``file_offset``."""

    dest: Hashable
    dest_offset: int
    length: int
    crc32c: int
    where: str
    name: str
    file_offset: int


@dataclass(frozen=True)
class ReadOutcome:
    """What ``execute`` did: the buffers by key, and the failure (None: every range read and
    every whole chunk checked). ``damaged``: the failure is damage (CorruptCheckpointError: a
    checksum, a short or missing file of a step still committed)."""

    buffers: dict = field(default_factory=dict)
    error: BaseException | None = None

    @property
    def damaged(self) -> bool:
        return isinstance(self.error, CorruptCheckpointError)


def chunk_range(c: ChunkRecord, dest: Hashable, dest_offset: int, name: str, lo: int | None = None,
                hi: int | None = None, *, check: bool = True) -> RangeRead:
    """The read of chunk ``c``'s bytes [lo, hi) (its storage's offsets; default: all of it) into
    ``dest`` at ``dest_offset``, checked against the chunk's crc32c when it is read whole and
    ``check``."""
    lo = c.storage_offset if lo is None else lo
    hi = c.storage_offset + c.length if hi is None else hi
    whole = (lo, hi) == (c.storage_offset, c.storage_offset + c.length)
    return RangeRead(c.file, c.file_offset + lo - c.storage_offset, hi - lo, dest, dest_offset,
                     c.crc32c if whole and check else None, name)


def read_ranges(plan: ReadPlan, reach: Sequence[Path | None], buffers: Mapping[Hashable, torch.Tensor],
                engine: IOEngine, *, verify: bool) -> None:
    """Read ``plan``'s ranges into ``buffers``: each file's in one engine call, in file order,
    each whole chunk checked (ChecksumMismatchError naming its file) with ``verify``."""
    by_file: dict[int, list[RangeRead]] = {}
    for r in plan.reads:
        if r.length:
            by_file.setdefault(r.file, []).append(r)
    d = step_dir_name(plan.step)
    for fid in sorted(by_file):
        reads = sorted(by_file[fid], key=lambda r: r.file_offset)
        f = plan.files[fid]
        root = reach[f.root] if f.root < len(reach) else None
        path = (root if root is not None else UNSEEN_ROOT) / d / f.path
        got = engine.read_file(path, [ReadSpan(r.file_offset, buffers[r.dest][r.dest_offset:r.dest_offset + r.length])
                                      for r in reads])
        if not verify:
            continue
        for r, crc in zip(reads, got):
            if r.crc32c is not None and crc != r.crc32c:
                raise ChecksumMismatchError(path, r.name, r.file_offset, r.length, r.crc32c, crc)


def execute(plan: ReadPlan, reach: Sequence[Path | None], engine: IOEngine, *, verify: bool,
            alloc: Callable[[int], torch.Tensor] = host_buffer,
            given: Mapping[Hashable, torch.Tensor] | None = None) -> ReadOutcome:
    """Carry out ``plan``: its buffers (``given`` ones used as they are, the others from
    ``alloc``), then its ranges (``read_ranges``). Never raises an Exception: the failure is
    the outcome's, a read failure of a step deleted meanwhile (``vanished_instead``, by the
    roots of the plan's files) as CheckpointNotFoundError."""
    buffers: dict = dict(given or {})
    try:
        for key, nbytes in plan.buffers:
            if key not in buffers:
                buffers[key] = alloc(nbytes)
    except Exception as e:  # noqa: BLE001 - the outcome carries it
        return ReadOutcome(buffers, e)
    try:
        read_ranges(plan, reach, buffers, engine, verify=verify)
    except Exception as e:  # noqa: BLE001 - the outcome carries it
        return ReadOutcome(buffers, vanished_instead(plan.step, plan.created_unix, reach,
                                                     {f.root for f in plan.files}, e) or e)
    return ReadOutcome(buffers)


def check_chunks(checks: Sequence[ChunkCheck], buffers: Mapping[Hashable, torch.Tensor]) -> None:
    """Each chunk of ``checks``, now whole in ``buffers``, against its crc32c: the first that
    differs is ChecksumMismatchError."""
    for k in checks:
        got = _crc32c.crc32c(buffers[k.dest][k.dest_offset:k.dest_offset + k.length].numpy())
        if got != k.crc32c:
            raise ChecksumMismatchError(k.where, k.name, k.file_offset, k.length, k.crc32c, got)


def send_moves(coord: Coordinator, moves: Sequence[Move], buffers: Mapping | Sequence, tags: dict[tuple[int, int], int],
               what: str) -> None:
    """One round of ``moves`` over the process group, from and into ``buffers`` (by a move's
    ``sid``; only the moves this rank takes part in use them); ``tags`` numbers each pair's
    messages across rounds and calls (every rank derives the same)."""
    transfers = []
    for a, b, sid, off, n in moves:
        tag = tags[(a, b)] = tags.get((a, b), -1) + 1
        if coord.rank in (a, b):
            transfers.append(Transfer(a, b, tag, buffers[sid][off:off + n]))
    coord.exchange(transfers, what)


def send_rounds(coord: Coordinator, rounds: Sequence[Sequence[Move]], into: Mapping | Sequence,
                tags: dict[tuple[int, int], int], what: str) -> None:
    """Run ``rounds`` (ownplan.relay_rounds, reshard's spread of pieces) over the process group,
    from and into ``into``; ``tags`` numbers each pair's messages across calls."""
    for k, moves in enumerate(rounds):  # a rank runs the rounds of the deepest tree it is in
        send_moves(coord, moves, into, tags, f"{what} (sending replicated pieces, round {k + 1})")
