"""The ``gdswriter`` command: list, inspect, verify and export checkpoints; run the demo.

    gdswriter ls ROOT [ROOT...]
    gdswriter inspect ROOT [--step N] [--json]
    gdswriter verify ROOT [--step N | --all]
    gdswriter export ROOT [--step N] --to torch|safetensors OUT [--force]
    gdswriter demo [--dir D] [--size 4G] [--engine auto|io_uring|posix]

Exit status: 0 success; 1 a checkpoint is corrupt (or another gdswriter/I/O error);
2 usage error, or no such root/step. Expected errors print one line to stderr.
Reading commands take no lock and never unpickle anything.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import crc32c as _crc32c

from . import __version__
from .pagecache import drop_caches, evict
from .errors import (CheckpointNotFoundError, CorruptCheckpointError, GDSWriterError, InvalidOptionError,
                     UnsupportedFormatVersionError, UnsupportedObjectError)
from .format.commit import LATEST_NAME, OWNER_NAME, TMP_PREFIX, TRASH_PREFIX, CommitProtocol, parse_step_dir
from .format.manifest import MANIFEST_NAME, ChunkRecord, Manifest

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2


class _UsageError(GDSWriterError):
    """Bad command-line input that argparse cannot catch (exit status 2)."""


# ----------------------------------------------------------------------------- small helpers
def parse_size(text: str) -> int:
    """'4G' -> 4 GiB. Suffixes K, M, G, T (binary; 'KiB'/'KB'/'k' accepted alike); decimals allowed."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise _UsageError(f"size {text!r} is not understood: use a number with an optional K, M, G or T suffix "
                          f"(binary units, e.g. 64M, 4G)")
    mult = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB}[m.group(2).lower()]
    value = int(float(m.group(1)) * mult)
    if value <= 0:
        raise _UsageError(f"size {text!r} must be positive")
    return value


def human(n: float) -> str:
    """Bytes in binary units: '1.50 GiB'."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def _when(unix: float) -> str:
    if not unix:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _table(rows: Sequence[Sequence[Any]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    rows = [[str(c) for c in r] for r in rows]
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    lines = []
    for r in rows:
        cells = [(c.rjust(widths[i]) if i in right else c.ljust(widths[i])) for i, c in enumerate(r)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _out(text: str = "") -> None:
    print(text, flush=False)


# ----------------------------------------------------------------------------- crc32c combine
_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _gf2_times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) and len(B) (zlib's crc32_combine, Castagnoli polynomial)."""
    if len2 <= 0:
        return crc1
    odd = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # first pass: one zero byte
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


# ----------------------------------------------------------------------------- opening checkpoints
def _roots(primary: str, secondary: Sequence[str] = ()) -> list[Path]:
    from .checkpointer import _roots as check_roots

    paths = check_roots([primary, *secondary])
    for i, p in enumerate(paths):
        if not p.exists():
            raise CheckpointNotFoundError(errno.ENOENT, f"checkpoint root {p} does not exist")
        if not p.is_dir():
            raise _UsageError(f"checkpoint root {p} is not a directory")
    return paths


def _load_manifest(protocol: CommitProtocol, step: int | None) -> tuple[int, Manifest, int]:
    """Resolve ``step`` (None: latest) and parse its manifest: (step, manifest, manifest bytes)."""
    step = protocol.require(step)
    path = protocol.step_dir(step) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFoundError(errno.ENOENT, f"step {step} under {protocol.primary} disappeared while it "
                                                    f"was being opened (deleted by a running checkpointer?)") from None
    return step, Manifest.from_json_bytes(raw, where=str(path)), len(raw)


def _check_roots(protocol: CommitProtocol, step: int, m: Manifest) -> None:
    need = 1 + max((f.root for f in m.files), default=0)
    if need > len(protocol.roots):
        raise _UsageError(f"step {step} keeps data files on {need} roots (one per SSD), but only "
                          f"{len(protocol.roots)} given: pass the others with --secondary DIR, in the order "
                          f"the checkpointer was given them")


def _secondary_owner(root: Path) -> str | None:
    """If ``root`` holds secondary step directories, the primary root they name."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        if parse_step_dir(name) is not None:
            with contextlib.suppress(OSError):
                return (root / name / OWNER_NAME).read_text().strip() or None
    return None


def _is_contiguous(rec) -> bool:
    expect = 1
    for n, s in reversed(list(zip(rec.shape, rec.stride))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _tensor_ranges(m: Manifest, rec) -> list[tuple[int, int, int]]:
    """[(file index, begin, end)] of the file bytes holding tensor ``rec``."""
    lo, hi = rec.byte_extent()
    out = []
    for c in m.storages[rec.storage].chunks:
        a, b = max(lo, c.storage_offset), min(hi, c.storage_offset + c.length)
        if b > a:
            out.append((c.file, c.file_offset + a - c.storage_offset, c.file_offset + b - c.storage_offset))
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _state_keys(m: Manifest) -> list[str] | None:
    import torch

    from .format.state_codec import decode_state

    try:
        state = decode_state(m.state, [torch.empty(0)] * len(m.tensors))
    except CorruptCheckpointError:
        return None
    return [str(k) for k in state] if isinstance(state, dict) else None


# ----------------------------------------------------------------------------- ls
def cmd_ls(args) -> int:
    rc = EXIT_OK
    report = []
    for i, root in enumerate(args.roots):
        p = Path(root)
        entry: dict[str, Any] = {"root": str(p), "steps": [], "latest": None}
        report.append(entry)
        if not args.json and len(args.roots) > 1:
            _out(("" if i == 0 else "\n") + f"{p}:")
        if not p.is_dir():
            what = "does not exist" if not p.exists() else "is not a directory"
            print(f"gdswriter: error: checkpoint root {p} {what}", file=sys.stderr)
            entry["error"] = what
            rc = max(rc, EXIT_USAGE)
            continue
        protocol = CommitProtocol([p])
        steps = protocol.committed_steps()
        latest = protocol.latest()
        entry["latest"] = latest
        rows = [["STEP", "SIZE", "TENSORS", "CREATED", ""]]
        for s in steps:
            item: dict[str, Any] = {"step": s, "latest": s == latest}
            try:
                _, m, mbytes = _load_manifest(protocol, s)
                nbytes = sum(f.size for f in m.files) + mbytes
                item.update(bytes=nbytes, tensors=len(m.tensors), created_unix=m.created_unix,
                            created=_when(m.created_unix), version=f"{m.version[0]}.{m.version[1]}")
                rows.append([s, human(nbytes), len(m.tensors), _when(m.created_unix), "latest" if s == latest else ""])
            except CheckpointNotFoundError:
                continue  # deleted while listing
            except (CorruptCheckpointError, UnsupportedFormatVersionError) as e:
                item["error"] = str(e)
                what = "NEWER FORMAT" if isinstance(e, UnsupportedFormatVersionError) else "DAMAGED"
                rows.append([s, "-", "-", "-", f"{what}: {e}"])
                rc = max(rc, EXIT_CORRUPT)
            entry["steps"].append(item)
        leftovers = sorted(n for n in os.listdir(p) if n.startswith((TMP_PREFIX, TRASH_PREFIX)))
        entry["leftovers"] = leftovers
        if args.json:
            continue
        if steps:
            for line in _table(rows, right={0, 1, 2}):
                _out(line)
        else:
            owner = _secondary_owner(p)
            if owner:
                _out(f"  no committed steps: {p} is a secondary root of {owner}; list that root instead")
            else:
                _out("  no committed steps")
        with contextlib.suppress(OSError, ValueError):
            named = int((p / LATEST_NAME).read_text().strip())
            if named != latest:
                _out(f"  note: '{LATEST_NAME}' names step {named}, which is not committed; the newest committed "
                     f"step counts as latest")
        if leftovers:
            _out(f"  note: {len(leftovers)} leftover(s) of interrupted saves or deletions "
                 f"({', '.join(leftovers[:3])}{', ...' if len(leftovers) > 3 else ''}); the next "
                 f"GDSCheckpointer opening this root removes them")
    if args.json:
        _out(json.dumps(report, indent=2))
    return rc


# ----------------------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    roots = _roots(args.root, args.secondary)
    protocol = CommitProtocol(roots)
    latest = protocol.latest()
    step, m, mbytes = _load_manifest(protocol, args.step)
    users: dict[int, list[str]] = {}
    for t in m.tensors:
        users.setdefault(t.storage, []).append(t.name)

    def file_path(fid: int) -> str:
        f = m.files[fid]
        return str(protocol.step_dir(step, f.root) / f.path) if f.root < len(roots) else f"<root #{f.root}>/{f.path}"

    tensors = []
    for rec in m.tensors:
        nbytes = _numel(rec.shape) * _item(rec.dtype)
        ranges = _tensor_ranges(m, rec)
        tensors.append({
            "name": rec.name, "dtype": rec.dtype, "shape": list(rec.shape), "stride": list(rec.stride),
            "bytes": nbytes, "contiguous": _is_contiguous(rec), "storage": rec.storage,
            "byte_offset": rec.byte_offset, "device": rec.device, "kind": rec.kind,
            "shared_with": [n for n in users[rec.storage] if n != rec.name],
            "ranges": [{"file": fid, "path": m.files[fid].path, "begin": a, "end": b} for fid, a, b in ranges],
        })
    if args.json:
        doc = {
            "root": str(roots[0]), "roots": [str(r) for r in roots], "step": step, "latest": step == latest,
            "format": "gdswriter", "version": f"{m.version[0]}.{m.version[1]}", "created_unix": m.created_unix,
            "metadata": m.metadata, "state_keys": _state_keys(m), "manifest_bytes": mbytes,
            "files": [{"index": i, "root": f.root, "path": f.path, "size": f.size, "location": file_path(i)}
                      for i, f in enumerate(m.files)],
            "storages": [{"nbytes": s.nbytes, "chunks": [
                {"file": c.file, "file_offset": c.file_offset, "storage_offset": c.storage_offset,
                 "length": c.length, "crc32c": c.crc32c} for c in s.chunks]} for s in m.storages],
            "tensors": tensors,
        }
        _out(json.dumps(doc, indent=2))
        return EXIT_OK

    total = sum(f.size for f in m.files)
    _out(f"checkpoint  {protocol.step_dir(step)}")
    _out(f"step        {step}" + (" (latest)" if step == latest else f" (latest is {latest})"))
    _out(f"format      gdswriter {m.version[0]}.{m.version[1]}")
    _out(f"created     {_when(m.created_unix)}")
    _out(f"metadata    {json.dumps(m.metadata, sort_keys=True)}")
    keys = _state_keys(m)
    if keys is not None:
        _out(f"state       {', '.join(keys) if keys else '(empty)'}")
    _out(f"data files  {len(m.files)}, {human(total)} ({total} bytes) + manifest {mbytes} bytes")
    for line in _table([["#", "ROOT", "FILE", "BYTES"]] +
                       [[i, f.root, file_path(i), f.size] for i, f in enumerate(m.files)], right={0, 1, 3}):
        _out(line)
    shared = sum(1 for t in tensors if t["shared_with"])
    _out(f"storages    {len(m.storages)}, {sum(s.nbytes for s in m.storages)} bytes")
    _out(f"tensors     {len(tensors)}" + (f" ({shared} share their storage with another tensor)" if shared else ""))
    rows = [["NAME", "DTYPE", "SHAPE", "BYTES", "FILE[BEGIN, END)", "NOTES"]]
    for t in tensors:
        where = " + ".join(f"{m.files[r['file']].path}[{r['begin']}, {r['end']})" for r in t["ranges"]) or "-"
        notes = []
        if not t["contiguous"]:
            notes.append(f"stride {tuple(t['stride'])}")
        if t["shared_with"]:
            shown = ", ".join(t["shared_with"][:3]) + (", ..." if len(t["shared_with"]) > 3 else "")
            notes.append(f"storage {t['storage']} shared with {shown}")
        if t["kind"] != "tensor":
            notes.append(t["kind"])
        if t["device"] != "cpu":
            notes.append(f"saved from {t['device']}")
        rows.append([t["name"], t["dtype"], list(t["shape"]), t["bytes"], where, "; ".join(notes)])
    for line in _table(rows, right={3}):
        _out(line)
    return EXIT_OK


def _item(dtype_name: str) -> int:
    from .format.dtypes import dtype_from_name

    return dtype_from_name(dtype_name).itemsize


# ----------------------------------------------------------------------------- verify
@dataclass
class _VerifyStats:
    files: int = 0
    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0


def verify_step(protocol: CommitProtocol, step: int, engine, scratch_bytes: int,
                problems: list[str]) -> _VerifyStats:
    """Re-read and re-hash every chunk of ``step`` file by file through ``engine``, into one
    reusable scratch buffer of at most ``scratch_bytes`` (chunks larger than that are read in
    pieces whose crc32c are combined). Appends one line per problem to ``problems``."""
    import torch

    from .engine import ReadSpan
    from .format.state_codec import decode_state

    step, m, _ = _load_manifest(protocol, step)
    _check_roots(protocol, step, m)
    stats = _VerifyStats(files=len(m.files))
    try:
        decode_state(m.state, [torch.empty(0)] * len(m.tensors))
    except CorruptCheckpointError as e:
        problems.append(f"state tree: {e}")

    holders: dict[int, list[tuple[str, int, int]]] = {}
    for rec in m.tensors:
        lo, hi = rec.byte_extent()
        holders.setdefault(rec.storage, []).append((rec.name, lo, hi))

    def who(sid: int, so: int, length: int) -> str:
        names = [n for n, lo, hi in holders.get(sid, []) if lo < so + length and so < hi] or \
                [n for n, _, _ in holders.get(sid, [])]
        if not names:
            return f"storage {sid} (no tensor views it)"
        shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"storage {sid} bytes [{so}, {so + length}) holding tensor{'s' if len(names) > 1 else ''} {shown}"

    per_file: dict[int, list[tuple[ChunkRecord, int]]] = {i: [] for i in range(len(m.files))}
    for sid, s in enumerate(m.storages):
        for c in s.chunks:
            per_file[c.file].append((c, sid))
    biggest = max((c.length for s in m.storages for c in s.chunks), default=0)
    scratch_len = max(4096, -(-min(scratch_bytes, max(biggest, 1)) // 4096) * 4096)
    scratch = torch.empty(scratch_len, dtype=torch.uint8)

    for fid, rec in enumerate(m.files):
        path = protocol.step_dir(step, rec.root) / rec.path
        chunks = sorted(per_file[fid], key=lambda x: (x[0].file_offset, x[0].length))
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing; it holds " +
                            "; ".join(who(sid, c.storage_offset, c.length) for c, sid in chunks[:3]) +
                            (" ..." if len(chunks) > 3 else ""))
            continue
        if size != rec.size:
            problems.append(f"{path} is {size} bytes, the manifest says {rec.size} (truncated or replaced)")
        todo = []  # overlapping chunks cannot get here: Manifest.from_json_bytes refuses them
        for c, sid in chunks:
            if c.length == 0:
                stats.chunks += 1
                if c.crc32c != 0:
                    problems.append(f"{path}: empty chunk of storage {sid} records crc32c {c.crc32c:#010x}, expected 0")
                continue
            if c.file_offset + c.length > size:
                problems.append(f"{path} bytes [{c.file_offset}, {c.file_offset + c.length}) are past the end of "
                                f"the file ({size} bytes): {who(sid, c.storage_offset, c.length)} is lost")
                continue
            todo.append((c, sid))

        # Pieces of at most scratch_len bytes, batched into the scratch buffer; one read_file per batch.
        acc: dict[int, tuple[int, int]] = {}  # chunk index -> (crc so far, bytes so far)
        failed: set[int] = set()
        batch: list[tuple[int, int, int]] = []  # (chunk index, file offset, length)
        used = 0

        def flush() -> None:
            nonlocal used
            if not batch:
                return
            spans, pos = [], 0
            for _, off, n in batch:
                spans.append(ReadSpan(off, scratch[pos:pos + n]))
                pos += n
            t0 = time.perf_counter()
            try:
                crcs = engine.read_file(path, spans)
            except (GDSWriterError, OSError) as e:
                a, b = batch[0][1], batch[-1][1] + batch[-1][2]
                problems.append(f"{path}: reading bytes [{a}, {b}) failed: {e}")
                failed.update(ci for ci, _, _ in batch)
                crcs = None
            stats.seconds += time.perf_counter() - t0
            if crcs is not None:
                for (ci, _, n), crc in zip(batch, crcs):
                    if ci in failed:
                        continue
                    prev = acc.get(ci)
                    acc[ci] = (crc, n) if prev is None else (crc32c_combine(prev[0], crc, n), prev[1] + n)
                    stats.bytes += n
            batch.clear()
            used = 0

        for ci, (c, sid) in enumerate(todo):
            for p in range(0, c.length, scratch_len):
                n = min(scratch_len, c.length - p)
                if used + n > scratch_len:
                    flush()
                batch.append((ci, c.file_offset + p, n))
                used += n
        flush()
        for ci, (c, sid) in enumerate(todo):
            stats.chunks += 1
            if ci in failed:
                continue
            got, n = acc[ci]
            if n != c.length or got != c.crc32c:
                problems.append(f"{path} bytes [{c.file_offset}, {c.file_offset + c.length}): crc32c expected "
                                f"{c.crc32c:#010x}, got {got:#010x}; {who(sid, c.storage_offset, c.length)}")
    return stats


def cmd_verify(args) -> int:
    from .engine import create_engine
    from .options import EngineOptions

    roots = _roots(args.root, args.secondary)
    protocol = CommitProtocol(roots)
    scratch = parse_size(args.scratch)
    if args.all:
        steps = protocol.committed_steps()
        if not steps:
            protocol.require(None)  # raises CheckpointNotFoundError with the usual message
    else:
        steps = [protocol.require(args.step)]
    corrupt = vanished = 0
    with create_engine(EngineOptions.from_env()) as engine:
        for step in steps:
            problems: list[str] = []
            try:
                stats = verify_step(protocol, step, engine, scratch, problems)
            except CheckpointNotFoundError:
                stats = None
                problems.append("deleted")
            except (CorruptCheckpointError, UnsupportedFormatVersionError) as e:
                stats = None
                problems.append(str(e))
            if problems and not (protocol.step_dir(step) / MANIFEST_NAME).is_file():
                vanished += 1
                _out(f"step {step}: deleted while being verified (a running checkpointer's retention?); skipped")
                continue
            if problems:
                corrupt += 1
                for p in problems:
                    _out(f"step {step}: CORRUPT: {p}")
                _out(f"step {step}: CORRUPT ({len(problems)} problem{'s' if len(problems) != 1 else ''})")
            else:
                assert stats is not None
                _out(f"step {step}: OK ({stats.files} file{'s' if stats.files != 1 else ''}, {stats.chunks} "
                     f"chunk{'s' if stats.chunks != 1 else ''}, {human(stats.bytes)} re-read and re-hashed in "
                     f"{stats.seconds:.2f} s, {gbps(stats.bytes, stats.seconds):.2f} GB/s; engine {engine.info.name})")
    if len(steps) > 1:
        _out(f"{len(steps) - corrupt - vanished} of {len(steps)} steps intact" +
             (f", {corrupt} corrupt" if corrupt else "") + (f", {vanished} deleted meanwhile" if vanished else ""))
    if corrupt:
        return EXIT_CORRUPT
    if vanished and vanished == len(steps):
        return EXIT_USAGE
    return EXIT_OK


# ----------------------------------------------------------------------------- export
def cmd_export(args) -> int:
    from .export import export_step

    roots = _roots(args.root, args.secondary)
    protocol = CommitProtocol(roots)
    step, m, _ = _load_manifest(protocol, args.step)
    _check_roots(protocol, step, m)  # a usage error (--secondary), not a damaged checkpoint
    res = export_step(roots, step, args.to, args.out, overwrite=args.force, verify=not args.no_verify,
                      nested=args.nested)
    what = "nested state" if args.nested else "{name: tensor} dict"
    _out(f"exported step {res.step} of {roots[0]} to {res.path}: {args.to} file, {res.tensors} tensors "
         f"({what}), {human(res.bytes)}")
    for old, new in res.renamed.items():
        _out(f"note: tensor name {old!r} occurs twice; the second is exported as {new!r}")
    return EXIT_OK


# ----------------------------------------------------------------------------- demo
def _cold(path: str | os.PathLike, state: dict) -> None:
    evict(path)
    state["dropped"] = drop_caches() and state.get("dropped", True)


def _mount_of(path: Path) -> str:
    """'ext4 on /dev/vda' for the file system holding ``path`` (best effort)."""
    best, desc = "", "unknown file system"
    real = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, desc = mnt, f"{parts[2]} on {parts[0]}"
    return desc


def _raw_reference(path: Path, size: int, pattern: memoryview, cache: dict) -> tuple[float, float, bool]:
    """A plain single-threaded, queue-depth-1 loop of 8 MiB O_DIRECT pwrite/preadv from an
    mmap'd (page-aligned) buffer: (write s incl. fdatasync, cold read s, direct?)."""
    bufsize = 8 * MiB
    mm = mmap.mmap(-1, bufsize)
    mv = memoryview(mm)
    try:
        for o in range(0, bufsize, len(pattern)):
            n = min(len(pattern), bufsize - o)
            mv[o:o + n] = pattern[:n]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        direct = True
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fd, direct = os.open(path, flags, 0o644), False
        try:
            t0 = time.perf_counter()
            off = 0
            while off < size:
                n = min(bufsize, size - off)
                w = os.pwrite(fd, mv[:n], off)
                if w <= 0:
                    raise OSError(errno.EIO, f"pwrite wrote nothing at {off}")
                off += w
            os.fdatasync(fd)
            tw = time.perf_counter() - t0
        finally:
            os.close(fd)
        _cold(path, cache)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            t0 = time.perf_counter()
            off = 0
            while off < size:
                n = os.preadv(fd, [mv[:min(bufsize, size - off)]], off)
                if n <= 0:
                    raise OSError(errno.EIO, f"preadv read nothing at {off}")
                off += n
            tr = time.perf_counter() - t0
        finally:
            os.close(fd)
        return tw, tr, direct
    finally:
        mv.release()
        mm.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


class FioError(RuntimeError):
    """fio ran but gave no bandwidth (it failed, or its job reported an error)."""


def fio_bandwidth(kind: str, path: str | os.PathLike, nbytes: int, *, timeout: float | None = None) -> float:
    """fio's own bandwidth (bytes/s) for one sequential job on ``path``: io_uring, O_DIRECT,
    4 MiB blocks, queue depth 16. write: a new file, --end_fsync=1 (durable); read: --readonly."""
    cmd = ["fio", "--name=gdswriter-ref", f"--filename={os.fspath(path).replace(':', chr(92) + ':')}",
           f"--rw={kind}", f"--size={nbytes}", "--bs=4M", "--iodepth=16", "--ioengine=io_uring", "--direct=1",
           "--numjobs=1", "--output-format=json", "--end_fsync=1" if kind == "write" else "--readonly"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
        if job.get("error"):
            raise ValueError(f"job error {job['error']}")
        bw = float(job[kind]["bw_bytes"])
        if bw <= 0:
            raise ValueError(f"no {kind} bandwidth reported")
        return bw
    except (ValueError, KeyError, IndexError) as e:
        why = (p.stderr.strip().splitlines() or [str(e)])[-1]
        raise FioError(f"fio {kind} failed (exit {p.returncode}): {why}\ncommand: {' '.join(cmd)}") from None


def _fio(path: Path, size: int, cache: dict) -> tuple[float, float]:
    """fio's durable write, then its cold read, of ``size`` bytes: (write B/s, read B/s)."""
    timeout = max(120.0, size / 20e6)
    try:
        w = fio_bandwidth("write", path, size, timeout=timeout)
        _cold(path, cache)
        return w, fio_bandwidth("read", path, size, timeout=timeout)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def cmd_demo(args) -> int:
    import torch

    from .engine import ReadSpan, WriteSpan, create_engine
    from .options import EngineOptions

    size = -(-parse_size(args.size) // 4096) * 4096
    ckpt_size = parse_size(args.ckpt_size)
    base = Path(args.dir) if args.dir else Path.cwd()
    if base.exists() and not base.is_dir():
        raise _UsageError(f"--dir {base} is not a directory")
    made_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    need = 2 * size + 2 * ckpt_size
    free = shutil.disk_usage(base).free
    if free < need:
        if made_base:
            with contextlib.suppress(OSError):
                base.rmdir()
        raise _UsageError(f"not enough free space in {base.resolve()}: the demo needs {human(need)} (2 x --size "
                          f"{human(size)} + the toy checkpoint), {human(free)} is free. Pass --dir on a bigger "
                          f"file system or a smaller --size")
    opts = EngineOptions.from_env(engine=args.engine)
    work = Path(tempfile.mkdtemp(prefix=".gdswriter-demo-", dir=base))
    cache: dict = {}
    ok = True
    try:
        _out(f"gdswriter {__version__} demo: {human(size)} through the engine in {work} "
             f"({_mount_of(work)})")
        block = min(size, 64 * MiB)
        gen = torch.Generator().manual_seed(1234)
        src = torch.randint(0, 256, (block,), dtype=torch.uint8, generator=gen)
        src_np = src.numpy()
        crc_block = _crc32c.crc32c(src_np)
        tail = size % block
        crc_tail = _crc32c.crc32c(src_np[:tail]) if tail else crc_block
        offsets = list(range(0, size, block))
        expect = [crc_tail if (o + block > size) else crc_block for o in offsets]

        # -- the engine: one file, written durably, then read back cold
        engine_file = work / "engine.bin"
        with create_engine(opts) as engine:
            spans = [WriteSpan(o, src[:min(block, size - o)]) for o in offsets]
            t0 = time.perf_counter()
            crcs = engine.write_file(engine_file, spans, size=size, durable=True)
            t_write = time.perf_counter() - t0
            info = engine.info
            bad_w = sum(1 for a, b in zip(crcs, expect) if a != b)
            _cold(engine_file, cache)
            avail = mem_available()
            dest_len = max(block, min(size, 1 * GiB, (avail // 4) // block * block if avail else GiB))
            dest = torch.zeros(dest_len, dtype=torch.uint8)  # touched: page faults are not the engine's time
            t_read, bad_r, bad_mem = 0.0, 0, 0
            for start in range(0, size, dest_len):
                batch = [o for o in offsets if start <= o < start + dest_len]
                rspans = [ReadSpan(o, dest[o - start:o - start + min(block, size - o)]) for o in batch]
                t0 = time.perf_counter()
                got = engine.read_file(engine_file, rspans)
                t_read += time.perf_counter() - t0
                for o, g, s in zip(batch, got, rspans):
                    want = expect[o // block]
                    bad_r += g != want
                    bad_mem += _crc32c.crc32c(s.out.numpy()) != want  # what landed in memory, recomputed
            del dest
        with contextlib.suppress(OSError):
            engine_file.unlink()
        ok = not (bad_w or bad_r or bad_mem)

        direct = (f"yes ({info.direct_memory_alignment}-byte aligned memory goes zero-copy)"
                  if info.direct_io else "no")
        _out(f"engine      {info.name}: direct I/O {direct}, registered buffers "
             f"{_yn(info.registered_buffers)}, page-locked {_yn(info.page_locked)}, "
             f"huge-page buffers {_yn(info.huge_page_buffers)}"
             + (f"; fallback reason: {info.reason}" if info.reason else ""))

        # -- references on the same directory
        refs: list[tuple[str, float | None, float | None, str]] = []
        pattern = memoryview(src_np)
        try:
            tw, tr, direct = _raw_reference(work / "raw.bin", size, pattern, cache)
            label = "raw O_DIRECT loop, QD1, 8 MiB" if direct else "raw buffered loop, QD1, 8 MiB (O_DIRECT refused)"
            refs.append((label, size / tw, size / tr, ""))
        except OSError as e:
            refs.append(("raw O_DIRECT loop, QD1, 8 MiB", None, None, f"failed: {e.strerror or e}"))
        if args.no_fio:
            refs.append(("fio io_uring, QD16, 4 MiB", None, None, "skipped (--no-fio)"))
        elif shutil.which("fio") is None:
            refs.append(("fio io_uring, QD16, 4 MiB", None, None, "fio not installed"))
        else:
            try:
                w, r = _fio(work / "fio.bin", size, cache)
                refs.append(("fio io_uring, QD16, 4 MiB", w, r, ""))
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                refs.append(("fio io_uring, QD16, 4 MiB", None, None, str(e)))
        ceil_w = max((r[1] for r in refs if r[1]), default=None)
        ceil_r = max((r[2] for r in refs if r[2]), default=None)
        how = "posix_fadvise(DONTNEED)" + (" + drop_caches" if cache.get("dropped") else
                                            " (drop_caches not permitted)")
        _out(f"cold cache  {how}; write timings include fdatasync")
        _out("")
        eng_w, eng_r = size / t_write, size / t_read

        def cell(x: float | None) -> str:
            return f"{x / 1e9:.2f}" if x else "-"

        rows = [["", "write GB/s", "read GB/s", ""],
                [f"gdswriter engine ({info.name})", cell(eng_w), cell(eng_r), ""]]
        rows += [[label, cell(w), cell(r), note] for label, w, r, note in refs]
        rows.append(["ceiling (best reference)", cell(ceil_w), cell(ceil_r), ""])
        rows.append(["engine / ceiling", f"{100 * eng_w / ceil_w:.0f}%" if ceil_w else "-",
                     f"{100 * eng_r / ceil_r:.0f}%" if ceil_r else "-", ""])
        for line in _table(rows, right={1, 2}):
            _out(line)
        _out(f"  crc32c: {len(offsets)} span(s) written, read back and recomputed from memory: "
             + ("ok" if ok else f"MISMATCH (write {bad_w}, read {bad_r}, memory {bad_mem})"))

        # -- a small end-to-end checkpoint
        _out("")
        ck_ok = _demo_checkpoint(work / "ckpt", ckpt_size, opts, cache)
        ok = ok and ck_ok
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made_base:
            with contextlib.suppress(OSError):
                base.rmdir()
    return EXIT_OK if ok else EXIT_CORRUPT


def _demo_checkpoint(root: Path, ckpt_size: int, opts, cache: dict) -> bool:
    import torch

    from . import CheckpointOptions, GDSCheckpointer

    d = max(64, math.isqrt(max(ckpt_size // 16, 1)) // 64 * 64)  # 4 fp32 d x d layers ~ ckpt_size
    torch.manual_seed(0)
    with torch.no_grad():
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(4)])
    params = [p for p in model.state_dict().values()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    before = [_crc32c.crc32c(p.detach().numpy()) for p in params]
    with GDSCheckpointer(model, root=root, options=CheckpointOptions(engine=opts)) as ck:
        ck.engine_info  # create the engine (buffers, ring) before timing
        t0 = time.perf_counter()
        ck.save(1)
        t_save = time.perf_counter() - t0
        for f in (root / "step_000000000001").iterdir():
            _cold(f, cache)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        t0 = time.perf_counter()
        ck.load(1)
        t_load = time.perf_counter() - t0
    after = [_crc32c.crc32c(p.detach().numpy()) for p in model.state_dict().values()]
    ok = after == before
    shutil.rmtree(root, ignore_errors=True)
    rows = [["checkpoint", "GB/s", "seconds", ""],
            ["save (durable + committed)", f"{gbps(nbytes, t_save):.2f}", f"{t_save:.3f}", ""],
            ["load (cold, verified)", f"{gbps(nbytes, t_load):.2f}", f"{t_load:.3f}", ""]]
    _out(f"checkpoint  GDSCheckpointer save + load of a toy model: {len(params)} tensors, {human(nbytes)}")
    for line in _table(rows, right={1, 2}):
        _out(line)
    _out("  loaded tensors equal the saved ones: " + ("ok" if ok else "MISMATCH"))
    return ok


def _yn(b: bool) -> str:
    return "yes" if b else "no"


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return None


# ----------------------------------------------------------------------------- parser and main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gdswriter", description="List, inspect, verify and export gdswriter checkpoints; run the I/O demo.",
        epilog="Exit status: 0 ok; 1 corrupt checkpoint or I/O error; 2 usage error or no such root/step.")
    p.add_argument("--version", action="version", version=f"gdswriter {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log gdswriter's informational messages")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def roots_opt(sp) -> None:
        sp.add_argument("root", metavar="ROOT", help="checkpoint root (the primary one if saved to several)")
        sp.add_argument("--secondary", metavar="DIR", action="append", default=[],
                        help="another root of a checkpoint saved to several (one per SSD); repeat, in the "
                             "order the checkpointer was given them")

    sp = sub.add_parser("ls", help="list committed steps", description="List the committed steps of each ROOT "
                        "with their size on disk, number of tensors and creation time; mark the latest.")
    sp.add_argument("roots", metavar="ROOT", nargs="+")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser("inspect", help="show a step's tensors, files and metadata",
                        description="Show a step's format version, metadata, data files and, per tensor: name, "
                                    "dtype, shape, bytes and the file byte ranges holding it. Reads only the "
                                    "manifest.")
    roots_opt(sp)
    sp.add_argument("--step", type=int, metavar="N", help="step to show (default: the latest)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_inspect)

    sp = sub.add_parser("verify", help="re-read and re-hash every chunk",
                        description="Re-read every chunk of the data files through the I/O engine and compare its "
                                    "crc32c with the manifest; also check file sizes and the state tree. Memory "
                                    "stays bounded by --scratch. Exit status 0: intact; 1: corrupt (each problem "
                                    "names the file, byte range and tensors); 2: no such root/step.")
    roots_opt(sp)
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, metavar="N", help="step to verify (default: the latest)")
    g.add_argument("--all", action="store_true", help="verify every committed step")
    sp.add_argument("--scratch", default="256M", metavar="SIZE",
                    help="read buffer size; bounds memory use (default 256M)")
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser("export", help="write a step as one torch or safetensors file",
                        description="Write a step as a single file other tools read. --to torch: a torch.save "
                                    "file of a flat {name: tensor} dict (names are the tensors' key paths, e.g. "
                                    "'model/0.weight'), readable with torch.load(OUT, weights_only=True); shared "
                                    "storage and views are kept. --to safetensors: a flat {name: tensor} "
                                    "safetensors file; safetensors cannot hold shared or non-contiguous tensors, "
                                    "so each tensor is written as its own contiguous copy, and non-tensor state is "
                                    "dropped (the step and the checkpoint metadata go to __metadata__). The output "
                                    "is written to a temporary file, fsynced and renamed into place.")
    roots_opt(sp)
    sp.add_argument("--step", type=int, metavar="N", help="step to export (default: the latest)")
    sp.add_argument("--to", required=True, choices=("torch", "safetensors"), help="output format")
    sp.add_argument("out", metavar="OUT", help="output file")
    sp.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    sp.add_argument("--nested", action="store_true",
                    help="torch only: save the whole nested state (model, optimizer, ...) instead of the flat "
                         "dict; refused unless torch.load(weights_only=True) reads it back")
    sp.add_argument("--no-verify", action="store_true", help="skip the crc32c check while reading")
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("demo", help="measure the engine against a raw O_DIRECT loop and fio",
                        description="Write SIZE bytes through the I/O engine (durably) and read them back from a "
                                    "cold cache, checking crc32c; compare with a plain O_DIRECT loop and fio on "
                                    "the same directory; then save and load a small toy checkpoint. Everything it "
                                    "writes is removed afterwards.")
    sp.add_argument("--dir", metavar="D", help="directory to test (default: a temporary directory under the "
                                               "current one)")
    sp.add_argument("--size", default="4G", metavar="SIZE", help="bytes to write and read (K/M/G suffixes; "
                                                                  "default 4G)")
    sp.add_argument("--engine", default="auto", choices=("auto", "io_uring", "posix"), help="I/O engine")
    sp.add_argument("--ckpt-size", default="256M", metavar="SIZE", help="toy checkpoint size (default 256M)")
    sp.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    sp.set_defaults(func=cmd_demo)
    return p


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001
            self.handleError(record)


def _error_text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and type(e).__str__ is OSError.__str__:
        text = e.strerror + (f": {e.filename}" if e.filename and str(e.filename) not in e.strerror else "")
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors (argparse prints them)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    log = logging.getLogger("gdswriter")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level = log.level
    log.addHandler(handler)
    if args.verbose:
        log.setLevel(logging.INFO)
    try:
        return args.func(args)
    except (CheckpointNotFoundError, InvalidOptionError, UnsupportedObjectError, _UsageError) as e:
        print(f"gdswriter: error: {_error_text(e)}", file=sys.stderr)
        return EXIT_USAGE
    except GDSWriterError as e:
        from .export import OutputExistsError, UnsupportedDtypeError

        print(f"gdswriter: error: {_error_text(e)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, (OutputExistsError, UnsupportedDtypeError)) else EXIT_CORRUPT
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_CORRUPT
    except OSError as e:
        print(f"gdswriter: error: {_error_text(e)}", file=sys.stderr)
        return EXIT_CORRUPT
    except KeyboardInterrupt:
        print("gdswriter: interrupted", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


if __name__ == "__main__":
    sys.exit(main())
