"""Slice assignment: which bytes of which storage go to which file, where.

A pure function of sizes, so it is tested without GPUs or SSDs. Storages are
laid end to end in a virtual stream (each starting 4 KiB-aligned so direct I/O
and cuFile can read it in place); the stream is cut into one equal share per
target file at aligned boundaries. A storage that straddles a cut is split
into chunks, so bytes are balanced to within one alignment unit per storage,
and each file is written front to back.

Dense packing (format 2.1, ``pack_below``): a storage smaller than ``pack_below`` bytes starts
on a ``PACK_ALIGN`` (64-byte) boundary instead, right after the one before it, and is never
split across files (it moves to the next file whole, past any file whose share it does not fit),
even where it is larger than ``align`` (``pack_below`` up to PACK_MAX). 100,000 storages of 2.7 KB took 410 MB
of file at 4 KiB each, 1.6x their bytes; packed they take what they hold (10,000 of 26.8 KB:
286.7 MB at 4 KiB each, 268.8 MB packed, hence PACK_BELOW 64 KiB: benchmarks/README.md). The
engines still move whole aligned blocks (they stage what shares a block, and spans under 1 MiB
anyway); loads read such runs whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import numpy as np

from ..errors import InvalidOptionError

DEFAULT_ALIGN = 4096
PACK_ALIGN = 64  # a packed storage's start: a multiple of every element size (16 at most) and a cache line
PACK_BELOW = 65536  # single-process saves pack storages smaller than this (format 2.1); 0: none packed
PACK_MAX = 1 << 20  # the largest pack_below: from 1 MiB a storage 4 KiB-aligned moves zero-copy (engines' ZERO_COPY_MIN)


@dataclass(frozen=True)
class FileTarget:
    """One output file: which root (SSD directory) it lives in and its name there."""

    root: int
    name: str


class PlannedChunk(NamedTuple):
    """``length`` bytes of storage ``storage`` from ``storage_offset`` go to ``file`` at ``file_offset``.
    A named tuple (immutable, compared and hashed by value, as the frozen dataclass it was): a
    plan of many tensors makes one per storage, and a tuple is made and hashed in C (a frozen
    dataclass took about 1 us to make and its hash ran in Python)."""

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
    sizes = _sizes_column(storage_sizes)
    _check_sizes(sizes, align, pack_below)
    total = _stream_bytes(sizes, align, pack_below)
    n = len(targets)
    # File f takes the stream's [cut[f], cut[f+1]): each cut is the aligned point at or below
    # the exact f/n share, so the shares differ by at most one alignment unit (a rounded-up
    # share for every file would leave the last files short by up to n-1 units, or empty).
    units = total // align
    cut = [units * f // n * align for f in range(n + 1)]
    columns = _cut_columns(sizes, [cut[f + 1] - cut[f] for f in range(n)], align, pack_below)
    files = []
    for t, cols in zip(targets, columns):
        size = int((cols[4] + cols[2]).max()) if len(cols[0]) else 0
        files.append(FilePlan(t, size, tuple(_chunks_of(cols))))
    return SavePlan(tuple(files))


def _sizes_column(storage_sizes: Sequence[int]) -> np.ndarray:
    return np.fromiter(storage_sizes, dtype=np.int64, count=len(storage_sizes))


def _stream_bytes(sizes: np.ndarray, align: int, pack_below: int) -> int:
    """The stream's length, up to an ``align`` boundary: the storages laid end to end, each at its alignment."""
    nonzero = sizes[sizes > 0]
    if not len(nonzero):
        return 0
    ends = _starts(nonzero, _large(nonzero, pack_below), align, pack_below) + nonzero
    return align_up(int(ends[-1]), align)


def _large(sizes: np.ndarray, pack_below: int) -> np.ndarray:
    """Which storages start on an ``align`` boundary (the others are packed PACK_ALIGN apart)."""
    return sizes >= pack_below if pack_below else np.ones(len(sizes), dtype=bool)


def _starts(sizes: np.ndarray, large: np.ndarray, align: int, pack_below: int) -> np.ndarray:
    """Where each of ``sizes`` (all > 0) starts, laid end to end from 0 with no end in sight:
    a large one at the ``align`` boundary at or after the end of the one before, a packed one at
    the PACK_ALIGN boundary. As columns: the storages from one large one to the next (a
    segment) lie each at its predecessors' sizes rounded up to the packing unit (every start in
    it is a multiple of that unit, so rounding each size up is rounding each end up); a
    segment takes its sizes' sum rounded up to ``align``, and starts where the ones before end."""
    unit = PACK_ALIGN if pack_below else align
    rounded = (sizes + (unit - 1)) // unit * unit
    before = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(rounded, out=before[1:])
    leads = np.flatnonzero(large)
    firsts = np.concatenate(([0], leads))  # segment 0: the packed ones before the first large one
    lasts = np.concatenate((leads, [len(sizes)]))
    lengths = (before[lasts] - before[firsts] + (align - 1)) // align * align
    seg_starts = np.zeros(len(firsts), dtype=np.int64)
    np.cumsum(lengths[:-1], out=seg_starts[1:])
    seg = np.cumsum(large)  # each storage's segment
    return seg_starts[seg] + before[:-1] - before[firsts][seg]


def _check_sizes(sizes: np.ndarray, align: int, pack_below: int = 0) -> None:
    if align < 1 or align & (align - 1):
        raise InvalidOptionError(f"align={align} must be a power of two")
    if len(sizes) and sizes.min() < 0:
        raise InvalidOptionError("storage sizes must be >= 0")
    if pack_below < 0 or pack_below > max(align, PACK_MAX) or (pack_below and align % PACK_ALIGN):
        raise InvalidOptionError(f"pack_below={pack_below} must be in [0, {max(align, PACK_MAX)}] (and align={align} "
                                 f"a multiple of {PACK_ALIGN} to pack): pass a smaller pack_below, or 0 to pack none")


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
    sizes = _sizes_column(storage_sizes)
    _check_sizes(sizes, align, pack_below)
    if not shares:
        raise InvalidOptionError("cut_stream needs at least one file")
    if any(s < 0 or s % align for s in shares):
        raise InvalidOptionError(f"file shares must be multiples of align={align}")
    return [list(_chunks_of(cols)) for cols in _cut_columns(sizes, shares, align, pack_below)]


Columns = tuple  # per file: (storages, storage offsets, lengths, file, file offsets), numpy int64 arrays and an int


def _chunks_of(cols: Columns):
    """The PlannedChunks of one file's columns (tuples made in C, no Python call per chunk)."""
    sids, offsets, lengths, f, at = cols
    return map(tuple.__new__, repeat(PlannedChunk),
               zip(sids.tolist(), offsets.tolist(), lengths.tolist(), repeat(f), at.tolist()))


def _cut_columns(sizes: np.ndarray, shares: Sequence[int], align: int, pack_below: int) -> list[Columns]:
    """cut_stream's chunks as columns, file by file: the storages left are laid out from the
    file's start (_starts); those that end within its share are its chunks; the first that
    does not moves to the next file, whole if it is packed or starts past the share, else
    split at the share (its first part here: an aligned length, as the share and its start
    are aligned). The last file takes all the rest. Zero-byte storages: file 0, in storage order."""
    ids = np.flatnonzero(sizes > 0)
    z, large = sizes[ids], _large(sizes[ids], pack_below)
    n, m = len(shares), len(ids)
    out: list[Columns] = []
    k = done = 0  # the first storage left, and how many of its bytes earlier files took
    for f in range(n):
        left = z[k:].copy()
        if len(left):
            left[0] -= done
        starts = _starts(left, large[k:], align, pack_below)
        j = len(left) if f == n - 1 else int(np.searchsorted(starts + left, shares[f], side="right"))
        offsets = np.zeros(j, dtype=np.int64)
        if j:
            offsets[0] = done
            done = 0
        sids, lengths, at = ids[k:k + j], left[:j], starts[:j]
        if k + j < m and large[k + j] and starts[j] < shares[f]:  # split at the share
            part = shares[f] - int(starts[j])
            sids, lengths = np.append(sids, ids[k + j]), np.append(lengths, part)
            offsets, at = np.append(offsets, done), np.append(at, starts[j])
            done += part
        out.append((sids, offsets, lengths, f, at))
        k += j
    if m < len(sizes):
        out[0] = _with_empty(sizes, out[0], align, pack_below)
    return out


def _with_empty(sizes: np.ndarray, first: Columns, align: int, pack_below: int) -> Columns:
    """File 0's columns with an empty chunk per zero-byte storage, where file 0 had been filled
    up to when the stream reached it (aligned unless packing), in storage order."""
    sids, offsets, lengths, f, at = first
    empty = np.flatnonzero(sizes == 0)
    ends = at + lengths
    before = np.searchsorted(sids, empty)  # file 0's chunks of earlier storages
    fill = np.where(before > 0, ends[np.maximum(before - 1, 0)], 0) if len(ends) else np.zeros(len(empty), np.int64)
    if not pack_below:
        fill = (fill + (align - 1)) // align * align
    order = np.argsort(np.concatenate((sids, empty)), kind="stable")
    zeros = np.zeros(len(empty), dtype=np.int64)
    return (np.concatenate((sids, empty))[order], np.concatenate((offsets, zeros))[order],
            np.concatenate((lengths, zeros))[order], f, np.concatenate((at, fill))[order])
