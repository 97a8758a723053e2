"""`gdswriter verify`: re-read and re-hash every chunk of one step or all of them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..crc import crc32c_combine
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, GDSWriterError, UnsupportedFormatVersionError
from ..format.commit import CommitProtocol
from ..format.manifest import MANIFEST_NAME, ChunkRecord
from ..progress import Progress
from ..units import gbps, human, parse_size
from ._common import (EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, add_roots_argument, check_roots, load_manifest, open_roots,
                      out)


def register(sub) -> None:
    sp = sub.add_parser("verify", help="re-read and re-hash every chunk",
                        description="Re-read every chunk of the data files through the I/O engine and compare its "
                                    "crc32c with the manifest; also check file sizes and the state tree. Memory "
                                    "stays bounded by --scratch. Exit status 0: intact; 1: corrupt (each problem "
                                    "names the file, byte range and tensors); 2: no such root/step.")
    add_roots_argument(sp)
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, metavar="N", help="step to verify (default: the latest)")
    g.add_argument("--all", action="store_true", help="verify every committed step")
    sp.add_argument("--scratch", default="256M", metavar="SIZE",
                    help="read buffer size; bounds memory use (default 256M)")
    sp.set_defaults(func=run)


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

    from ..engine import ReadSpan
    from ..format.state_codec import decode_state

    step, m, _ = load_manifest(protocol, step)
    check_roots(protocol, step, m)
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


def run(args) -> int:
    from ..engine_select import create_engine
    from ..options import EngineOptions

    roots = open_roots(args.root, args.secondary)
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
                with Progress(f"verify step {step}") as bar:  # drawn on a terminal only
                    stats = verify_step(protocol, step, bar.reads(engine), scratch, problems)
            except CheckpointNotFoundError:
                stats = None
                problems.append("deleted")
            except (CorruptCheckpointError, UnsupportedFormatVersionError) as e:
                stats = None
                problems.append(str(e))
            if problems and not (protocol.step_dir(step) / MANIFEST_NAME).is_file():
                vanished += 1
                out(f"step {step}: deleted while being verified (a running checkpointer's retention?); skipped")
                continue
            if problems:
                corrupt += 1
                for p in problems:
                    out(f"step {step}: CORRUPT: {p}")
                out(f"step {step}: CORRUPT ({len(problems)} problem{'s' if len(problems) != 1 else ''})")
            else:
                assert stats is not None
                out(f"step {step}: OK ({stats.files} file{'s' if stats.files != 1 else ''}, {stats.chunks} "
                     f"chunk{'s' if stats.chunks != 1 else ''}, {human(stats.bytes)} re-read and re-hashed in "
                     f"{stats.seconds:.2f} s, {gbps(stats.bytes, stats.seconds):.2f} GB/s; engine {engine.info.name})")
    if len(steps) > 1:
        out(f"{len(steps) - corrupt - vanished} of {len(steps)} steps intact" +
             (f", {corrupt} corrupt" if corrupt else "") + (f", {vanished} deleted meanwhile" if vanished else ""))
    if corrupt:
        return EXIT_CORRUPT
    if vanished and vanished == len(steps):
        return EXIT_USAGE
    return EXIT_OK
