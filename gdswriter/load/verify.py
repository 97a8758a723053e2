"""Verifying: re-read and re-hash every chunk of a committed step in bounded memory
(``verify_step``), for ``gdswriter verify`` and for the checksum pass ``load(fallback=True)``
makes before it reads a step in place. The crc32c check of an ordinary read is part of
reading (reader.read_storages).

It imports reader (and crc, format/, engines/), never apply, policy, gdswriter.save or anything
above them.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import crc32c as _crc32c
import torch

from ..crc import crc32c_combine
from ..engines.base import IOEngine, ReadSpan
from ..errors import CorruptCheckpointError, GDSWriterError
from ..format.commit import CommitProtocol, step_dir_name
from ..format.copies import (copy_dir, damaged_entries, manifest_copy_holders, refilling_marker, replicas_of,
                             set_aside, withdraw_everywhere)
from ..format.manifest import MANIFEST_NAME, ChunkRecord, Manifest
from ..format.parity import PARITY_DIR, parity_name, protected_parity, read_stripe, refilling_parity, stripe_name
from ..format.replicas import (COPIES_DIR, PROTECTED_NAME, copy_dir_name, parity_marker, protected_copies,
                               protected_marker)
from ..format.sharded import GlobalManifest, match_roots, parse_shard, parse_step, shard_name
from ..format.state_codec import decode_state
from ..fs import atomic_write, read_regular_file
from .reader import placeholder_tensors, read_manifest_bytes


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
    scratch = _Scratch(scratch_bytes).get(biggest)
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


# ---------------------------------------------------------------------------------------------
# the scrub: the copies and parity blocks that protect a multi-rank step (format.md 11, 11.1)


@dataclass(frozen=True)
class ProtectionProblem:
    """A copy or parity block of step ``step`` found damaged or missing: rank ``rank``'s
    (its copy, or the parity block it stores), on table root ``root`` (None: not known), at
    ``path``; ``kind``: "parity", "copy" or "manifest copy"."""

    step: int
    rank: int
    root: int | None
    path: str
    kind: str
    why: str

    def __str__(self) -> str:
        what = {"parity": f"rank {self.rank}'s parity block", "copy": f"the copy of rank {self.rank}'s files",
                "manifest copy": "the global manifest's copy"}[self.kind]
        return f"{what} on table root {self.root}: {self.path}: {self.why}"


@dataclass
class ScrubReport:
    """What ``scrub_protection`` found: ``problems``; ``parity``: the step's parity group
    (None: copies, or not protected at all); ``copies``: how many places hold each rank's files
    (1: none besides its own); the blocks and copy files re-read, and their bytes; ``damaged``:
    the ``.damaged-`` entries an earlier ``--repair`` set aside, still on the roots given (a
    load's refill removes them once it re-created what they held)."""

    step: int
    problems: list[ProtectionProblem]
    parity: int | None = None
    copies: int = 1
    blocks: int = 0
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dcp: bool = False
    damaged: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Span:
    file_offset: int
    length: int


class _Scratch:
    """One reusable read buffer, grown to at most ``cap`` bytes (``--scratch``)."""

    def __init__(self, cap: int):
        self.cap, self.buf = max(4096, -(-cap // 4096) * 4096), torch.empty(0, dtype=torch.uint8)

    def get(self, want: int) -> torch.Tensor:
        n = max(4096, -(-min(self.cap, max(want, 1)) // 4096) * 4096)
        if len(self.buf) < n:
            self.buf = torch.empty(n, dtype=torch.uint8)
        return self.buf


def _file_problem(path: Path, size: int, spans: list, crcs: list[int], engine: IOEngine, scratch: _Scratch,
                  report: ScrubReport) -> str | None:
    """Why the file at ``path`` is not ``size`` bytes whose ``spans`` (file_offset, length) have
    the crc32c ``crcs``, or None: re-read through ``engine`` in scratch-sized pieces."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a link?)"
    if st.st_size != size:
        return f"{st.st_size} bytes, {size} recorded"
    todo = [(s, i) for i, s in enumerate(spans) if s.length > 0]
    problems: list[str] = []
    hasher = _PieceHasher(path, engine, scratch.get(max((s.length for s, _ in todo), default=0)), VerifyStats(),
                          problems)
    hasher.read(todo)
    report.bytes += hasher.stats.bytes
    report.seconds += hasher.stats.seconds
    if problems:
        return problems[0]
    for ci, (s, i) in enumerate(todo):
        got, n = hasher.acc.get(ci, (0, 0))
        if n != s.length or got != crcs[i]:
            return f"bytes [{s.file_offset}, {s.file_offset + s.length}): crc32c {got:#010x}, {crcs[i]:#010x} recorded"
    bad = [i for i, s in enumerate(spans) if s.length == 0 and crcs[i] != 0]
    return f"an empty chunk records crc32c {crcs[bad[0]]:#010x}" if bad else None


def scrub_protection(protocol: CommitProtocol, step: int, engine: IOEngine, scratch_bytes: int) -> ScrubReport:
    """Re-read every parity block and every copy of committed multi-rank ``step`` on the roots
    ``protocol`` holds (the table roots matched by id) against the crc32c the step records for
    them: a block against its stripe description (``parity/rank<R>.json``: length, crc32c); a
    copy's shard against the global manifest (size, crc32c) and its data files chunk by chunk
    against the shard (a DCP step's against its manifest); ``copies/manifest.json`` against
    ``manifest.json``. A lane member, or a copy the manifest's ``replicas`` places on a root
    given, that is not there is reported missing. Memory: one buffer of at most
    ``scratch_bytes``. A single-process step has nothing to scrub (an empty report)."""
    raw = read_manifest_bytes(protocol, step)
    parsed = parse_step(raw, str(protocol.step_dir(step) / MANIFEST_NAME))
    report = ScrubReport(step, [])
    if isinstance(parsed, GlobalManifest):
        table = parsed.roots

        def own_root(r: int) -> int | None:
            return parsed.shards[r].root if r < len(parsed.shards) else None
    elif parsed.dist is not None:
        table, report.dcp = parsed.dist.roots, True

        def own_root(r: int) -> int | None:
            return next((j for j, info in enumerate(table) if r in info.ranks), None)
    else:
        return report
    reach = match_roots(table, protocol.roots)
    scratch = _Scratch(scratch_bytes)
    primary = protocol.step_dir(step)
    report.parity = protected_parity(primary) or refilling_parity(primary)
    _scrub_parity(report, reach, own_root, engine, scratch)
    if report.parity is None:
        if isinstance(parsed, GlobalManifest):
            _scrub_copies(report, parsed, reach, engine, scratch)
        else:
            _scrub_dcp_copies(report, parsed, reach, engine, scratch, primary)
    for j, p in enumerate(reach):
        report.damaged += [] if p is None else [str(e) for e in damaged_entries(p / step_dir_name(step))]
        copy = None if p is None else p / step_dir_name(step) / COPIES_DIR / MANIFEST_NAME
        if copy is not None and copy.exists():
            report.files += 1
            try:
                why = None if read_regular_file(copy, len(raw) + 1) == raw else "its bytes differ from manifest.json"
            except (OSError, GDSWriterError) as e:
                why = f"unreadable: {e}"
            if why is not None:
                report.problems.append(ProtectionProblem(step, 0, j, str(copy), "manifest copy", why))
    return report


def _scrub_parity(report: ScrubReport, reach: list[Path | None], own_root, engine: IOEngine,
                  scratch: _Scratch) -> None:
    """The parity blocks and descriptions on the roots reached; members named by a lane and
    described nowhere, on a root reached, reported missing."""
    step, d = report.step, step_dir_name(report.step)
    lanes: set[int] = set()
    described: set[int] = set()
    for j, p in enumerate(reach):
        pdir = None if p is None else p / d / PARITY_DIR
        for f in sorted(pdir.glob("rank*.json")) if pdir is not None and pdir.is_dir() else ():
            if (k := re.fullmatch(r"rank(\d{5})\.json", f.name)) is None:
                continue
            r = int(k.group(1))
            described.add(r)
            try:
                body = read_stripe(f)
            except CorruptCheckpointError as e:
                report.problems.append(ProtectionProblem(step, r, j, str(f), "parity", f"its description: {e}"))
                continue
            lanes.update(int(x) for x in body["lane"])
            report.parity = max(report.parity or 0, len(body["lane"]))
            par = body["parity"]
            block = pdir / parity_name(r)  # type: ignore[operator]
            if int(par["rank"]) != r or par["file"] != parity_name(r):
                report.problems.append(ProtectionProblem(step, r, j, str(f), "parity",
                                                         f"its description names another block ({par['file']})"))
                continue
            report.blocks += 1
            why = _file_problem(block, int(par["length"]), [_Span(0, int(par["length"]))], [int(par["crc32c"])],
                                engine, scratch, report)
            if why is not None:
                report.problems.append(ProtectionProblem(step, r, j, str(block), "parity", why))
    for r in sorted(lanes - described):
        j = own_root(r)
        if j is not None and j < len(reach) and reach[j] is not None:
            report.problems.append(ProtectionProblem(step, r, j, str(reach[j] / d / PARITY_DIR / parity_name(r)),
                                                     "parity", "missing (neither block nor description)"))


def _rank_files(g: GlobalManifest, r: int, places: list[Path]) -> list[tuple[str, int, list, list[int]]] | None:
    """Rank ``r``'s data files (name, size, chunk spans, their crc32c), from the first of its
    shards at ``places`` (its own, then its copies) whose bytes match the global manifest."""
    ref = g.shards[r]
    for at in places:
        try:
            raw = read_regular_file(at, ref.size + 1)
            if len(raw) != ref.size or _crc32c.crc32c(raw) != ref.crc32c:
                continue
            shard = parse_shard(raw, g, ref, str(at))
        except (OSError, GDSWriterError):
            continue
        per_file = shard.chunks_by_file()
        return [(f.path, f.size, [_Span(c.file_offset, c.length) for c in per_file[i]], [c.crc32c for c in per_file[i]])
                for i, f in enumerate(shard.files)]
    return None


def _scrub_copies(report: ScrubReport, g: GlobalManifest, reach: list[Path | None], engine: IOEngine,
                  scratch: _Scratch) -> None:
    """The copies the global manifest's ``replicas`` places on the roots reached: each one's
    shard (size, crc32c) and data files (chunk by chunk); a copy folder not there: missing."""
    rows = replicas_of(g, f"step {g.step}'s manifest")
    if not rows:
        return
    step, d = report.step, step_dir_name(report.step)
    report.copies = 1 + max(len(row) for row in rows)
    for r, row in enumerate(rows):
        ref, files = g.shards[r], None
        for j in row:
            if reach[j] is None:
                continue
            cdir = reach[j] / d / copy_dir(r)  # type: ignore[operator]
            if not cdir.is_dir():
                report.problems.append(ProtectionProblem(step, r, j, str(cdir), "copy", "missing"))
                continue
            report.files += 1
            why = _file_problem(cdir / shard_name(r), ref.size, [_Span(0, ref.size)], [ref.crc32c], engine, scratch,
                                report)
            if why is not None:
                report.problems.append(ProtectionProblem(step, r, j, str(cdir / shard_name(r)), "copy", why))
            if files is None:
                own = reach[ref.root]
                files = _rank_files(g, r, ([own / d / ref.name] if own is not None else []) + [cdir / shard_name(r)])
            if files is None:
                report.problems.append(ProtectionProblem(step, r, j, str(cdir), "copy", "no intact shard of rank "
                                                         f"{r} names its files: they cannot be checked"))
                continue
            _scrub_files(report, r, j, cdir, files, engine, scratch)


def _scrub_files(report: ScrubReport, r: int, j: int, cdir: Path, files: list, engine: IOEngine,
                 scratch: _Scratch) -> None:
    """The data files of rank ``r``'s copy in ``cdir``, each against its chunks' crc32c."""
    for name, size, spans, crcs in files:
        report.files += 1
        why = _file_problem(cdir / name, size, spans, crcs, engine, scratch, report)
        if why is not None:
            report.problems.append(ProtectionProblem(report.step, r, j, str(cdir / name), "copy", why))


def _scrub_dcp_copies(report: ScrubReport, m: Manifest, reach: list[Path | None], engine: IOEngine,
                      scratch: _Scratch, primary: Path) -> None:
    """A DCP step's copies (found, not recorded: format.md 9.5): each ``copies/rank<R>`` on the
    roots reached holds rank R's data files (``data-rank<R>-...``), checked against the
    manifest's chunks."""
    d = step_dir_name(report.step)
    spans: dict[int, list] = {i: [] for i in range(len(m.files))}
    for s in m.storages:
        for c in s.chunks:
            spans[c.file].append(c)
    by_rank: dict[int, list] = {}
    for i, f in enumerate(m.files):
        if (k := re.match(r"data-rank(\d+)-", f.path.rsplit("/", 1)[-1])) is not None:
            by_rank.setdefault(int(k.group(1)), []).append(
                (f.path.rsplit("/", 1)[-1], f.size, [_Span(c.file_offset, c.length) for c in spans[i]],
                 [c.crc32c for c in spans[i]]))
    report.copies = protected_copies(primary) or 1
    for j, p in enumerate(reach):
        base = None if p is None else p / d / COPIES_DIR
        for cdir in sorted(base.iterdir()) if base is not None and base.is_dir() else ():
            if cdir.is_dir() and (k := re.fullmatch(r"rank(\d{5})", cdir.name)) is not None:
                _scrub_files(report, int(k.group(1)), j, cdir, by_rank.get(int(k.group(1)), []), engine, scratch)


def set_aside_damage(protocol: CommitProtocol, report: ScrubReport) -> list[str]:
    """``gdswriter verify --repair``, for a step whose own files verified intact: make what
    ``report`` found damaged re-creatable, deleting nothing. First the step stops claiming
    protection (format/copies.py ``withdraw_protection``: the refilling note, then ``protected``
    removed); then each damaged parity block (with its description) and each damaged copy folder
    is set aside (``.damaged-`` names: no reader looks at it), so the next multi-rank load's
    refill finds it missing and re-creates it, as it re-creates a lost one, and writes
    ``protected`` back (a DCP step's copy on the root where it was set aside: dcp_refill.py),
    then removes the ``.damaged-`` entries. A damaged ``copies/manifest.json`` is rewritten from
    ``manifest.json``. The caller holds ``format/copies.step_lock`` (no refill of the step runs
    meanwhile). The protection is withdrawn on the primary and on every root given that holds
    the global manifest's copy (format/copies.py ``withdraw_everywhere``), which an open adopts
    if the primary's node is lost (the command needs every root of the step's table anyway).
    Returns one line per action."""
    primary, done = protocol.step_dir(report.step), []
    if any(p.kind != "manifest copy" for p in report.problems):
        holders = manifest_copy_holders(protocol.step_dir(report.step, i) for i in range(1, len(protocol.roots)))
        try:  # the marker the step says now, else the one a note keeps, else the one it would say
            marker = read_regular_file(primary / PROTECTED_NAME, 4096)
        except (OSError, GDSWriterError):
            marker = refilling_marker(primary) or (parity_marker(report.parity) if report.parity
                                                   else protected_marker(report.copies))
        withdraw_everywhere(primary, holders, marker, report.parity is not None)
        done.append(f"step {report.step}: no longer marked protected (on {1 + len(holders)} root(s): the primary "
                    f"and those holding the manifest's copy) until a load's refill re-creates what is damaged or "
                    f"missing")
    for p in report.problems:
        path = Path(p.path)
        if p.kind == "manifest copy":
            atomic_write(path, read_manifest_bytes(protocol, report.step))
            done.append(f"{path}: rewritten from manifest.json")
        elif p.kind == "parity":
            for q in (path.parent / parity_name(p.rank), path.parent / stripe_name(p.rank)):
                if os.path.lexists(q):
                    done.append(f"{q}: set aside as {set_aside(q).name}")
        else:
            folder = next((q for q in (path, *path.parents) if q.name == copy_dir_name(p.rank)), None)
            if folder is not None and os.path.lexists(folder):
                done.append(f"{folder}: set aside as {set_aside(folder).name}")
    if any("set aside as" in line for line in done):
        done.append(f"step {report.step}: what was set aside stays until the next multi-rank load's refill has "
                    f"re-created it and marked the step protected, then that refill removes it (copy it elsewhere "
                    f"first to keep the damaged bytes)")
    return done

