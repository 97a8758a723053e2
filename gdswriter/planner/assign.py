"""Slice assignment: which bytes of which storage go to which file, where.

A pure function of sizes, so it is tested without GPUs or SSDs. Storages are
laid end to end in a virtual stream (each starting 4 KiB-aligned so direct I/O
and cuFile can read it in place); the stream is cut into one equal share per
target file at aligned boundaries. A storage that straddles a cut is split
into chunks, so bytes are balanced to within one alignment unit per storage,
and each file is written front to back.

Dense packing (format 2.1, ``pack_below``): a storage smaller than ``pack_below`` bytes starts
on a ``PACK_ALIGN`` (64-byte) boundary instead, right after the one before it, and is never
split across files (it moves to the next file whole). 100,000 storages of 2.7 KB took 410 MB
of file at 4 KiB each, 1.6x their bytes; packed they take what they hold. The engines still
move whole aligned blocks (they stage what shares a block); loads read such runs whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidOptionError

DEFAULT_ALIGN = 4096
PACK_ALIGN = 64  # a packed storage's start: a multiple of every element size (16 at most) and a cache line
PACK_BELOW = 4096  # single-process saves pack storages smaller than this (format 2.1); 0: none packed


@dataclass(frozen=True)
class FileTarget:
    """One output file: which root (SSD directory) it lives in and its name there."""

    root: int
    name: str


@dataclass(frozen=True)
class PlannedChunk:
    """``length`` bytes of storage ``storage`` from ``storage_offset`` go to ``file`` at ``file_offset``."""

    storage: int
    storage_offset: int
    length: int
    file: int
    file_offset: int


@dataclass(frozen=True)
class FilePlan:
    """One file's chunks; ``writer`` and ``gpu`` say whose memory they come from when the
    plan is GPU-local (planner/affinity.py): ``writer`` is the device ('cuda:0', 'cpu'),
    ``gpu`` the NVML index of that GPU. Code that does not care ignores them."""

    target: FileTarget
    size: int
    chunks: tuple[PlannedChunk, ...]  # sorted by file_offset
    writer: str = ""
    gpu: int | None = None


@dataclass(frozen=True)
class SavePlan:
    files: tuple[FilePlan, ...]
    notes: tuple[str, ...] = ()  # for people: why the plan is as it is

    def chunks_of(self, storage: int) -> list[PlannedChunk]:
        return sorted((c for f in self.files for c in f.chunks if c.storage == storage),
                      key=lambda c: c.storage_offset)


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def plan_save(storage_sizes: Sequence[int], targets: Sequence[FileTarget], *, align: int = DEFAULT_ALIGN,
              pack_below: int = 0) -> SavePlan:
    """Assign every byte of every storage to exactly one file of ``targets``, balanced.

    Zero-byte storages get one empty chunk in the first file so that every
    storage appears in the plan. ``pack_below``: storages smaller than this are packed
    (module docstring; single-process saves pass PACK_BELOW, multi-rank ones keep 0).
    """
    if not targets:
        raise InvalidOptionError("plan_save needs at least one target file")
    _check_sizes(storage_sizes, align, pack_below)
    total = _stream_bytes(storage_sizes, align, pack_below)
    n = len(targets)
    # File f takes the stream's [cut[f], cut[f+1]): each cut is the aligned point at or below
    # the exact f/n share, so the shares differ by at most one alignment unit (a rounded-up
    # share for every file would leave the last files short by up to n-1 units, or empty).
    units = total // align
    cut = [units * f // n * align for f in range(n + 1)]
    per_file = cut_stream(storage_sizes, [cut[f + 1] - cut[f] for f in range(n)], align=align,
                          pack_below=pack_below)
    files = []
    for i, t in enumerate(targets):
        chunks = tuple(per_file[i])
        size = max((c.file_offset + c.length for c in chunks), default=0)
        files.append(FilePlan(t, size, chunks))
    return SavePlan(tuple(files))


def _stream_bytes(storage_sizes: Sequence[int], align: int, pack_below: int) -> int:
    """The stream's length, up to an ``align`` boundary: the storages laid end to end, each at its alignment."""
    if not pack_below:
        return sum(align_up(s, align) for s in storage_sizes)
    pos = 0
    for s in storage_sizes:
        pos = align_up(pos, PACK_ALIGN if s < pack_below else align) + s
    return align_up(pos, align)


def _check_sizes(storage_sizes: Sequence[int], align: int, pack_below: int = 0) -> None:
    if align < 1 or align & (align - 1):
        raise InvalidOptionError(f"align={align} must be a power of two")
    if any(s < 0 for s in storage_sizes):
        raise InvalidOptionError("storage sizes must be >= 0")
    if pack_below < 0 or pack_below > align or (pack_below and align % PACK_ALIGN):
        raise InvalidOptionError(f"pack_below={pack_below} must be in [0, align={align}] (and align a multiple "
                                 f"of {PACK_ALIGN})")


def cut_stream(storage_sizes: Sequence[int], shares: Sequence[int], *, align: int = DEFAULT_ALIGN,
               pack_below: int = 0) -> list[list[PlannedChunk]]:
    """Lay the storages end to end (each starting aligned) and cut the stream into files of
    ``shares`` bytes (aligned; the last file takes whatever is left): the chunks of each file.

    A storage that straddles a cut is split at an aligned storage offset, so every chunk
    starts aligned in its storage and in its file. Zero-byte storages get one empty chunk
    in file 0. Chunk ``file`` fields index ``shares``. A storage under ``pack_below`` bytes
    starts on a PACK_ALIGN boundary and is never split: one that would cross a file's share
    starts the next file (module docstring).
    """
    _check_sizes(storage_sizes, align, pack_below)
    if not shares:
        raise InvalidOptionError("cut_stream needs at least one file")
    if any(s < 0 or s % align for s in shares):
        raise InvalidOptionError(f"file shares must be multiples of align={align}")
    n = len(shares)
    per_file: list[list[PlannedChunk]] = [[] for _ in shares]
    fill = [0] * n
    f = 0
    for sid, size in enumerate(storage_sizes):
        if size == 0:
            per_file[0].append(PlannedChunk(sid, 0, 0, 0, fill[0] if pack_below else align_up(fill[0], align)))
            continue
        if size < pack_below:
            while f < n - 1 and align_up(fill[f], PACK_ALIGN) + size > shares[f]:
                f += 1
            at = align_up(fill[f], PACK_ALIGN)
            per_file[f].append(PlannedChunk(sid, 0, size, f, at))
            fill[f] = at + size
            continue
        done = 0
        while done < size:
            while f < n - 1 and align_up(fill[f], align) >= shares[f]:
                f += 1
            fill[f] = align_up(fill[f], align)
            room = size - done if f == n - 1 else shares[f] - fill[f]
            length = min(size - done, room)
            if length < size - done:
                # Cut at an aligned storage offset so the continuation starts aligned too.
                length = max(align, (done + length) // align * align - done)
                length = min(length, size - done)
            per_file[f].append(PlannedChunk(sid, done, length, f, fill[f]))
            fill[f] += length
            done += length
    return per_file
