"""Verifying: re-read and re-hash every chunk of a committed step in bounded memory
(``verify_step``), for ``gdswriter verify`` and for the checksum pass ``load(fallback=True)``
makes before it reads a step in place. The crc32c check of an ordinary read is part of
reading (reader.read_storages).

It imports reader (and crc, format/, engines/), never apply, policy, gdswriter.save or anything
above them.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..crc import crc32c_combine
from ..engines.base import IOEngine, ReadSpan
from ..errors import CorruptCheckpointError, GDSWriterError
from ..format.commit import CommitProtocol
from ..format.manifest import ChunkRecord, Manifest
from ..format.state_codec import decode_state
from .reader import placeholder_tensors


@dataclass
class VerifyStats:
    files: int = 0
    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0


def verify_step(protocol: CommitProtocol, m: Manifest, engine: IOEngine, scratch_bytes: int,
                problems: list[str]) -> VerifyStats:
    """Re-read and re-hash every chunk of the step ``m`` describes, file by file through
    ``engine``, into one reusable scratch buffer of at most ``scratch_bytes`` (chunks larger
    than that are read in pieces whose crc32c are combined); also decode the state tree.
    Appends one line per problem to ``problems`` (the first names the worst damage found first)."""
    stats = VerifyStats(files=len(m.files))
    try:
        decode_state(m.state, placeholder_tensors(m))
    except CorruptCheckpointError as e:
        problems.append(f"state tree: {e}")
    holders = _Holders(m)
    per_file = _chunks_per_file(m)
    sizes = _file_sizes(protocol, m, per_file, holders, problems)
    # The scratch buffer is sized from chunks the real files hold, never from the manifest alone.
    biggest = max((c.length for fid, size in sizes.items() for c, _ in per_file[fid]
                   if c.file_offset + c.length <= size), default=0)
    scratch_len = max(4096, -(-min(scratch_bytes, max(biggest, 1)) // 4096) * 4096)
    scratch = torch.empty(scratch_len, dtype=torch.uint8)
    for fid, size in sizes.items():
        path = protocol.step_dir(m.step, m.files[fid].root) / m.files[fid].path
        todo = _readable_chunks(path, size, per_file[fid], holders, stats, problems)
        hasher = _PieceHasher(path, engine, scratch, stats, problems)
        hasher.read(todo)
        for ci, (c, sid) in enumerate(todo):
            stats.chunks += 1
            if ci in hasher.failed:
                continue
            got, n = hasher.acc[ci]
            if n != c.length or got != c.crc32c:
                problems.append(f"{path} bytes [{c.file_offset}, {c.file_offset + c.length}): crc32c expected "
                                f"{c.crc32c:#010x}, got {got:#010x}; {holders.who(sid, c.storage_offset, c.length)}")
    return stats


class _Holders:
    """The tensors viewing each storage, to name what a damaged chunk holds."""

    def __init__(self, m: Manifest) -> None:
        self.by_storage: dict[int, list[tuple[str, int, int]]] = {}
        for rec in m.tensors:
            lo, hi = rec.byte_extent()
            self.by_storage.setdefault(rec.storage, []).append((rec.name, lo, hi))

    def who(self, sid: int, so: int, length: int) -> str:
        """The tensors viewing bytes [so, so + length) of storage ``sid`` (else any viewing it), as text."""
        held = self.by_storage.get(sid, [])
        names = [n for n, lo, hi in held if lo < so + length and so < hi] or [n for n, _, _ in held]
        if not names:
            return f"storage {sid} (no tensor views it)"
        shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"storage {sid} bytes [{so}, {so + length}) holding tensor{'s' if len(names) > 1 else ''} {shown}"


def _chunks_per_file(m: Manifest) -> dict[int, list[tuple[ChunkRecord, int]]]:
    """Each data file's chunks, with their storage's index, in file order."""
    per_file: dict[int, list[tuple[ChunkRecord, int]]] = {i: [] for i in range(len(m.files))}
    for sid, s in enumerate(m.storages):
        for c in s.chunks:
            per_file[c.file].append((c, sid))
    for chunks in per_file.values():
        chunks.sort(key=lambda x: (x[0].file_offset, x[0].length))
    return per_file


def _file_sizes(protocol: CommitProtocol, m: Manifest, per_file: dict[int, list[tuple[ChunkRecord, int]]],
                holders: _Holders, problems: list[str]) -> dict[int, int]:
    """The size of each data file that is there and a regular file (by index); a missing one,
    one that is not a regular file and one of another size than the manifest's are problems."""
    sizes: dict[int, int] = {}
    for fid, rec in enumerate(m.files):
        path = protocol.step_dir(m.step, rec.root) / rec.path
        chunks = per_file[fid]
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{path} is missing; it holds " +
                            "; ".join(holders.who(sid, c.storage_offset, c.length) for c, sid in chunks[:3]) +
                            (" ..." if len(chunks) > 3 else ""))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{path} is not a regular file (a link?)")
            continue
        sizes[fid] = st.st_size
        if st.st_size != rec.size:
            problems.append(f"{path} is {st.st_size} bytes, the manifest says {rec.size} (truncated or replaced)")
    return sizes


def _readable_chunks(path: Path, size: int, chunks: list[tuple[ChunkRecord, int]], holders: _Holders,
                     stats: VerifyStats, problems: list[str]) -> list[tuple[ChunkRecord, int]]:
    """The chunks of a file of ``size`` bytes that have bytes to read. An empty chunk is checked
    here (its crc32c must be 0) and counted; one past the end of the file is a problem."""
    todo = []  # overlapping chunks cannot get here: Manifest.from_json_bytes refuses them
    for c, sid in chunks:
        if c.length == 0:
            stats.chunks += 1
            if c.crc32c != 0:
                problems.append(f"{path}: empty chunk of storage {sid} records crc32c {c.crc32c:#010x}, expected 0")
            continue
        if c.file_offset + c.length > size:
            problems.append(f"{path} bytes [{c.file_offset}, {c.file_offset + c.length}) are past the end of "
                            f"the file ({size} bytes): {holders.who(sid, c.storage_offset, c.length)} is lost")
            continue
        todo.append((c, sid))
    return todo


class _PieceHasher:
    """Reads a file's chunks in pieces of at most the scratch buffer's size, batched into it (one
    read_file per batch), and combines each chunk's pieces' crc32c: ``acc`` maps a chunk's index
    to (crc so far, bytes so far); ``failed`` holds the indices of chunks a failed read touched."""

    def __init__(self, path: Path, engine: IOEngine, scratch: torch.Tensor, stats: VerifyStats,
                 problems: list[str]) -> None:
        self.path, self.engine, self.scratch, self.stats, self.problems = path, engine, scratch, stats, problems
        self.acc: dict[int, tuple[int, int]] = {}
        self.failed: set[int] = set()
        self.batch: list[tuple[int, int, int]] = []  # (chunk index, file offset, length)
        self.used = 0

    def read(self, todo: list[tuple[ChunkRecord, int]]) -> None:
        scratch_len = len(self.scratch)
        for ci, (c, _) in enumerate(todo):
            for p in range(0, c.length, scratch_len):
                n = min(scratch_len, c.length - p)
                if self.used + n > scratch_len:
                    self.flush()
                self.batch.append((ci, c.file_offset + p, n))
                self.used += n
        self.flush()

    def flush(self) -> None:
        batch = self.batch
        if not batch:
            return
        spans, pos = [], 0
        for _, off, n in batch:
            spans.append(ReadSpan(off, self.scratch[pos:pos + n]))
            pos += n
        t0 = time.perf_counter()
        try:
            crcs = self.engine.read_file(self.path, spans)
        except (GDSWriterError, OSError) as e:
            a, b = batch[0][1], batch[-1][1] + batch[-1][2]
            self.problems.append(f"{self.path}: reading bytes [{a}, {b}) failed: {e}")
            self.failed.update(ci for ci, _, _ in batch)
            crcs = None
        self.stats.seconds += time.perf_counter() - t0
        if crcs is not None:
            for (ci, _, n), crc in zip(batch, crcs):
                if ci in self.failed:
                    continue
                prev = self.acc.get(ci)
                self.acc[ci] = (crc, n) if prev is None else (crc32c_combine(prev[0], crc, n), prev[1] + n)
                self.stats.bytes += n
        self.batch = []
        self.used = 0
