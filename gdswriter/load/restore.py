"""Loading: read a committed step's bytes into fresh or live tensors, and apply the state.

``read_manifest`` parses and validates a step's manifest and checks every data file against
it (a regular file of exactly the recorded size) before anything is allocated, so a hostile
manifest cannot make a load commit more memory than the files hold. ``read_storages`` streams
the data files through the engines into per-storage buffers and checks each chunk's crc32c;
``tensors_from_storages`` rebuilds the saved views (sharing restored). ``restore_into`` does
what ``GDSCheckpointer.load`` promises: it plans the whole load first (``plan_restore``: every
key, shape, dtype and the optimizer's structure, with no byte moved), then reads, then hands
each object its state.

Readers take no lock, so a running checkpointer's retention may delete the step being read:
a missing file (or any failure reading it) of a step that is no longer committed as it was
read (``step_gone``) is CheckpointNotFoundError, while the same in a step still committed is
damage (CorruptCheckpointError), as before.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..crc import crc32c_combine
from ..engines.base import IOEngine, ReadSpan
from ..engines.select import create_engine
from ..errors import (CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError, EngineIOError,
                     GDSWriterError, NothingToLoadError, StateMismatchError, TruncatedFileError,
                     UnsupportedFormatVersionError)
from ..format.commit import CommitProtocol, normalize_roots, read_regular_file
from ..format.dtypes import dtype_from_name, dtype_to_name
from ..format.manifest import MANIFEST_MAX_BYTES, MANIFEST_NAME, ChunkRecord, FileRecord, Manifest, StorageRecord
from ..format.state_codec import decode_state
from ..options import EngineOptions
from ..rng import set_rng_state
from ..tensors import flat_bytes, hint_unaligned
from ..threads import run_per_file

log = logging.getLogger("gdswriter")

_POPULATE_MIN = 1 << 20

ATOMIC_LOAD_MAX_BYTES = 64 << 20
"""``load()`` reads live tensors through fresh buffers, verified before the first live byte
changes, when it would otherwise read at most this many bytes in place. Staging costs a pass
over memory (fresh pages, then the copy) and as much transient memory: measured with
benchmarks/load_atomic.py on this project's VM, cold, 2.3x the in-place time at 16 MiB
(+25 ms), 2.9x at 64 MiB (+105 ms), 3.4x at 256 MiB (+430 ms). So it is the default only
where that is small in absolute terms; larger states keep the zero-copy in-place path
(``load(atomic=True)`` opts in, ``load(fallback=True)`` re-hashes a step before reading it
in place)."""

SCAN_SCRATCH_BYTES = 64 << 20
"""Read buffer of the checksum pass ``load(fallback=True)`` makes before an in-place load."""


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh flat uint8 CPU tensor to read a storage into. Large ones come from an anonymous
    mmap with MAP_POPULATE: the kernel maps all pages in one go, several times faster than
    taking one page fault per 4 KiB during the copy (measured 2.7 vs 1.5 GB/s here)."""
    if nbytes < _POPULATE_MIN or not hasattr(mmap, "MAP_POPULATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive


def read_manifest_bytes(protocol: CommitProtocol, step: int) -> bytes:
    """The raw manifest of committed ``step`` (a regular file; links are refused)."""
    path = protocol.step_dir(step) / MANIFEST_NAME
    try:
        return read_regular_file(path, MANIFEST_MAX_BYTES)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(errno.ENOENT, f"{path} is missing: step {step} is not committed (deleted "
                                                    f"meanwhile?)") from e


def parse_manifest(protocol: CommitProtocol, step: int, raw: bytes) -> Manifest:
    """Parse and validate the manifest of ``step`` (it must describe that step)."""
    path = protocol.step_dir(step) / MANIFEST_NAME
    m = Manifest.from_json_bytes(raw, where=str(path))
    if m.step != step:
        raise CorruptCheckpointError(f"{path} describes step {m.step}, not {step}: the checkpoint is damaged; "
                                     f"load an earlier step")
    return m


def check_data_files(protocol: CommitProtocol, manifest: Manifest) -> None:
    """Every data file must be on a given root and be a regular file (not a link) of exactly its
    recorded size. Run before any buffer is allocated: what a load allocates is then bounded by
    the real files (chunks lie inside their file's recorded size and do not overlap)."""
    path = protocol.step_dir(manifest.step) / MANIFEST_NAME
    for f in manifest.files:
        if f.root >= len(protocol.roots):
            raise CorruptCheckpointError(
                f"{path} names data file {f.path} on root #{f.root}, but only {len(protocol.roots)} root(s) "
                f"were given: pass the same list of roots that saved it")
    check_file_sizes((protocol.step_dir(manifest.step, rec.root) / rec.path, rec) for rec in manifest.files)


def check_file_sizes(files: Iterable[tuple[Path, FileRecord]]) -> None:
    """Each (path, record): a regular file (not a link) of exactly the recorded size, and no two
    of them the same file. check_data_files for every file of a step; a multi-rank load checks
    the files each rank reads (dist/fetch.py), before any rank allocates."""
    seen: dict[tuple[int, int], str] = {}
    for path, rec in files:
        try:
            st = os.lstat(path)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"data file {path} is missing: the checkpoint is incomplete; "
                                         f"load an earlier step") from e
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"data file {path} is not a regular file (a link?): the checkpoint is "
                                         f"damaged or was tampered with; load an earlier step")
        if st.st_size < rec.size:
            raise TruncatedFileError(path, rec.size, st.st_size)
        if st.st_size != rec.size:
            raise CorruptCheckpointError(f"{path} is {st.st_size} bytes, the manifest says {rec.size}: "
                                         f"the file was replaced; load an earlier step")
        other = seen.setdefault((st.st_dev, st.st_ino), str(path))
        if other != str(path):  # hard links: one file's bytes would be counted (and allocated) twice
            raise CorruptCheckpointError(f"data files {other} and {path} are the same file: the checkpoint is "
                                         f"damaged or was tampered with; load an earlier step")


def step_gone(protocol: CommitProtocol, manifest: Manifest) -> bool:
    """True when the step ``manifest`` describes is no longer committed as that manifest: un-committed
    (a running checkpointer's retention, delete_step) or replaced by a new save of the same step.
    A reader that hits a missing file asks this: then it lost a race, the checkpoint is not damaged."""
    try:
        raw = read_manifest_bytes(protocol, manifest.step)
    except CheckpointNotFoundError:
        return True
    except (GDSWriterError, OSError):
        return False  # unreadable now: damage, reported as it was found
    try:
        now = parse_manifest(protocol, manifest.step, raw)
    except (GDSWriterError, ValueError):
        return False
    # What a new save changes (the state tree is left out: a NaN in it never equals itself)
    return (now.created_unix, now.files, now.storages, now.tensors) != \
        (manifest.created_unix, manifest.files, manifest.storages, manifest.tensors)


def deleted_while_reading(protocol: CommitProtocol, manifest: Manifest,
                          e: BaseException) -> CheckpointNotFoundError | None:
    """For failure ``e`` reading ``manifest``'s step: the CheckpointNotFoundError to raise instead
    when the step was deleted (or saved again) meanwhile, its files going with it; None when it
    is still committed as read (then a missing or short file is damage, ``e`` stands)."""
    if isinstance(e, CheckpointNotFoundError) or not isinstance(e, (CorruptCheckpointError, OSError)):
        return None
    if not step_gone(protocol, manifest):
        return None
    return CheckpointNotFoundError(errno.ENOENT, f"step {manifest.step} under {protocol.primary} was deleted (or "
                                                 f"saved again) while it was being read, by a running "
                                                 f"checkpointer's retention (keep_last?): read a newer step "
                                                 f"({' '.join(str(e).split())})")


def read_manifest(protocol: CommitProtocol, step: int) -> Manifest:
    """The validated manifest of committed ``step``, its data files checked (check_data_files)."""
    m = parse_manifest(protocol, step, read_manifest_bytes(protocol, step))
    try:
        check_data_files(protocol, m)
    except CorruptCheckpointError as e:
        gone = deleted_while_reading(protocol, m, e)
        if gone is None:
            raise
        raise gone from e
    return m


def read_storages(protocol: CommitProtocol, manifest: Manifest, dests: list[torch.Tensor],
                  engines: Sequence[IOEngine], *, verify: bool) -> None:
    """Fill ``dests[i]`` (flat uint8, nbytes of storage i) from the data files; check crc32c."""
    per_file: dict[int, list[tuple[ChunkRecord, int]]] = {}
    for sid, s in enumerate(manifest.storages):
        for c in s.chunks:
            per_file.setdefault(c.file, []).append((c, sid))
    names = {}
    for t in manifest.tensors:
        names.setdefault(t.storage, t.name)
    step_dir = {i: protocol.step_dir(manifest.step, i) for i in range(len(protocol.roots))}

    def read_one(fid: int) -> None:
        rec = manifest.files[fid]
        path = step_dir[rec.root] / rec.path
        chunks = sorted(per_file[fid], key=lambda x: x[0].file_offset)
        spans = [ReadSpan(c.file_offset, dests[sid][c.storage_offset:c.storage_offset + c.length]) for c, sid in chunks]
        crcs = engines[rec.root % len(engines)].read_file(path, spans)
        if verify:
            for (c, sid), got in zip(chunks, crcs):
                if got != c.crc32c:
                    raise ChecksumMismatchError(path, names.get(sid, f"<storage {sid}>"), c.file_offset, c.length,
                                                c.crc32c, got)

    run_per_file(read_one, sorted(per_file), len(engines))


def tensors_from_storages(manifest: Manifest, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Build each saved tensor as a typed strided view of its storage buffer (sharing restored)."""
    out = []
    for t in manifest.tensors:
        dtype = dtype_from_name(t.dtype)
        buf = buffers[t.storage]
        out.append(torch.empty(0, dtype=dtype, device=buf.device).set_(
            buf.untyped_storage(), (buf.storage_offset() + t.byte_offset) // dtype.itemsize, t.shape, t.stride))
    return out


def placeholder_tensors(manifest: Manifest) -> list[torch.Tensor]:
    """One stand-in per saved tensor with its dtype and shape and no memory of its own (a
    0-stride expansion of one element): decode_state with these shows the saved structure
    before a byte is read."""
    return [torch.empty((), dtype=dtype_from_name(t.dtype)).expand(t.shape) for t in manifest.tensors]


def load_state(root: str | os.PathLike | Sequence[str | os.PathLike], step: int | None = None, *,
               verify: bool = True, engine_options: EngineOptions | None = None) -> tuple[int, Any]:
    """Read a checkpoint into fresh CPU tensors: returns (step, state) where state is the saved
    tree (``{"model": ..., "optimizer": ..., ...}``). Never unpickles; takes no lock.

    Beside a running checkpointer, the step may be deleted while it is read (retention): that is
    CheckpointNotFoundError, and with ``step`` None the newest step is then tried once more."""
    protocol = CommitProtocol(normalize_roots(root))

    def read(step: int) -> tuple[int, Any]:
        manifest = read_manifest(protocol, step)
        return step, decode_state(manifest.state, read_tensors(protocol, manifest, verify=verify,
                                                               engine_options=engine_options))

    resolved = protocol.require(step)
    try:
        return read(resolved)
    except CheckpointNotFoundError as e:
        if step is not None:
            raise
        log.info("gdswriter: step %d was deleted while it was being read (%s); reading the newest step", resolved, e)
    return read(protocol.require(None))


def read_tensors(protocol: CommitProtocol, manifest: Manifest, indices: Sequence[int] | None = None, *,
                 verify: bool = True, engine_options: EngineOptions | None = None,
                 progress: Any = None) -> list[torch.Tensor | None]:
    """The tensors of ``manifest`` (from read_manifest: files checked) at ``indices`` (None: all)
    as fresh CPU tensors, reading only the storages they view (views of a shared storage stay
    shared); other positions are None. ``progress`` (a gdswriter.progress.Progress) counts the
    bytes read."""
    part = manifest
    if indices is not None:  # the other storages become empty: nothing to read or allocate
        wanted = sorted(set(indices))
        needed = {manifest.tensors[i].storage for i in wanted}
        part = replace(manifest, storages=tuple(s if sid in needed else StorageRecord(0, ())
                                                for sid, s in enumerate(manifest.storages)))
    buffers = [host_buffer(s.nbytes) for s in part.storages]
    try:
        with create_engine(engine_options) as engine:
            read_storages(protocol, part, buffers, [progress.reads(engine) if progress else engine], verify=verify)
    except (CorruptCheckpointError, OSError) as e:
        gone = deleted_while_reading(protocol, manifest, e)
        if gone is None:
            raise
        raise gone from e
    if indices is None:
        return tensors_from_storages(part, buffers)  # type: ignore[return-value]
    out: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    views = tensors_from_storages(replace(part, tensors=tuple(manifest.tensors[i] for i in wanted)), buffers)
    for i, t in zip(wanted, views):
        out[i] = t
    return out


# ----------------------------------------------------------------------------- verify
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
    step = m.step
    stats = VerifyStats(files=len(m.files))
    try:
        decode_state(m.state, placeholder_tensors(m))
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
    sizes: dict[int, int] = {}
    for fid, rec in enumerate(m.files):
        path = protocol.step_dir(step, rec.root) / rec.path
        chunks = sorted(per_file[fid], key=lambda x: (x[0].file_offset, x[0].length))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{path} is missing; it holds " +
                            "; ".join(who(sid, c.storage_offset, c.length) for c, sid in chunks[:3]) +
                            (" ..." if len(chunks) > 3 else ""))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{path} is not a regular file (a link?)")
            continue
        sizes[fid] = st.st_size
        if st.st_size != rec.size:
            problems.append(f"{path} is {st.st_size} bytes, the manifest says {rec.size} (truncated or replaced)")
    # The scratch buffer is sized from chunks the real files hold, never from the manifest alone.
    biggest = max((c.length for fid, size in sizes.items() for c, _ in per_file[fid]
                   if c.file_offset + c.length <= size), default=0)
    scratch_len = max(4096, -(-min(scratch_bytes, max(biggest, 1)) // 4096) * 4096)
    scratch = torch.empty(scratch_len, dtype=torch.uint8)

    for fid, size in sizes.items():
        path = protocol.step_dir(step, m.files[fid].root) / m.files[fid].path
        chunks = sorted(per_file[fid], key=lambda x: (x[0].file_offset, x[0].length))
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


# ----------------------------------------------------------------------------- live state
@dataclass(frozen=True)
class LiveState:
    """What a checkpointer restores into: the model, the optimizer, extra named objects."""

    model: Any
    optimizer: Any
    extra: Mapping[str, Any]
    restore_rng: bool = False


@dataclass(frozen=True)
class LoadResult:
    """What ``GDSCheckpointer.load`` did (``checkpointer.last_load``). Names are "/"-joined
    paths as in the manifest: ``model/<key>`` (the live model's key), ``optimizer``,
    ``extra/<name>`` (``extra/<name>/<key>`` inside a dict or module), ``rng``.

    loaded: restored. skipped: in the checkpoint and live, but not restored (shape/dtype
    mismatch; an optimizer whose parameters were not all loaded). missing: live, not in the
    checkpoint. unexpected: in the checkpoint, not live (a dict target receives them as new keys,
    so for dicts they are in ``loaded`` too).
    atomic: every byte was verified before the first live tensor changed. damaged: steps
    ``load(fallback=True)`` passed over, newest first."""

    step: int
    loaded: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    atomic: bool = False
    damaged: tuple[int, ...] = ()


_COMPILED = re.compile(r"(^|\.)_orig_mod\.")


def _uncompiled(key: Any) -> Any:
    """``key`` without torch.compile's ``_orig_mod.`` components (compiled module state_dict keys)."""
    return _COMPILED.sub(r"\1", key) if isinstance(key, str) else key


def match_keys(saved: Iterable, live: Iterable) -> dict:
    """{saved key: live key}: equal keys, then keys equal once torch.compile's ``_orig_mod.``
    components are dropped, so a compiled model's checkpoint loads into the plain model and back."""
    live = list(live)
    live_set, out, used = set(live), {}, set()
    rest = []
    for k in saved:
        if k in live_set:
            out[k] = k
            used.add(k)
        else:
            rest.append(k)
    plain: dict[Any, list] = {}
    for k in live:
        if k not in used:
            plain.setdefault(_uncompiled(k), []).append(k)
    for k in rest:
        cands = plain.get(_uncompiled(k), [])
        if len(cands) == 1 and cands[0] not in used:
            out[k] = cands[0]
            used.add(cands[0])
    return out


def prefix_hint(missing: Sequence, unexpected: Sequence) -> str:
    """Why keys may differ, when every unexpected key is a missing key with one prefix added
    (or the other way round): a wrapped model (DistributedDataParallel's ``module.``...)."""
    miss = [k for k in missing if isinstance(k, str)]
    unexp = [k for k in unexpected if isinstance(k, str)]
    if not miss or not unexp:
        return ""
    for longer, shorter, whose in ((unexp, miss, "checkpoint's"), (miss, unexp, "live model's")):
        short = set(shorter)
        for k in shorter:
            if not longer[0].endswith(k):
                continue
            prefix = longer[0][:len(longer[0]) - len(k)]
            if prefix.endswith(".") and all(x.startswith(prefix) and x[len(prefix):] in short for x in longer):
                cause = " (DistributedDataParallel/DataParallel wraps models in .module)" if prefix == "module." else ""
                return f"; the keys differ by a prefix {prefix!r}: the {whose} keys carry it{cause}"
    return ""


@dataclass
class _Plan:
    """What restore_into will do, decided before any byte moves."""

    keys: dict[str, dict] = field(default_factory=dict)  # target name -> {saved key: live key} to load
    dropped: dict[str, set] = field(default_factory=dict)  # target name -> saved keys skipped (mismatch)
    apply: set[str] = field(default_factory=set)           # target names whose saved state gets applied
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _short(keys: Sequence) -> str:
    return f"{list(keys[:10])}" + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


def _desc(v: Any) -> str:
    return f"{dtype_to_name(v.dtype)}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def _plan_tensor_dict(plan: _Plan, name: str, live_sd: Mapping, saved: Any, strict: bool, *,
                      module: bool) -> None:
    """Match a module's state_dict (``module``) or a plain dict target with its saved dict."""
    if not isinstance(saved, Mapping):
        raise StateMismatchError(f"{name}: the checkpoint holds a {type(saved).__name__} for it, expected a dict")
    pairs = match_keys(saved.keys(), live_sd.keys())
    matched = set(pairs.values())
    missing = [k for k in live_sd if k not in matched]
    unexpected = [k for k in saved if k not in pairs]
    mismatched = [(s, lk) for s, lk in pairs.items()
                  if (isinstance(saved[s], torch.Tensor) or isinstance(live_sd[lk], torch.Tensor)) and not (
                      isinstance(saved[s], torch.Tensor) and isinstance(live_sd[lk], torch.Tensor)
                      and saved[s].shape == live_sd[lk].shape and saved[s].dtype == live_sd[lk].dtype)]
    hint = prefix_hint(missing, unexpected)
    if strict and (missing or (unexpected and module) or mismatched):
        parts = []
        if mismatched:
            s, lk = mismatched[0]
            parts.append(f"{name}/{lk}: checkpoint has {_desc(saved[s])}, the live tensor is {_desc(live_sd[lk])}"
                         + (f" (and {len(mismatched) - 1} more mismatched)" if len(mismatched) > 1 else ""))
        if module and (missing or unexpected):
            parts.append(f"{name}: missing keys {_short(missing)}, unexpected keys {_short(unexpected)}")
        elif missing:
            parts.append(f"{name}: keys {_short(missing)} are missing from the checkpoint")
        raise StateMismatchError("; ".join(parts) + hint + "; pass strict=False to load the keys that match")
    bad = {s for s, _ in mismatched}
    good = {s: lk for s, lk in pairs.items() if s not in bad}
    live_tensors = [k for k, v in live_sd.items() if isinstance(v, torch.Tensor)]
    if live_tensors and not any(isinstance(live_sd[lk], torch.Tensor) for lk in good.values()):
        raise NothingToLoadError(f"{name}: none of its {len(live_tensors)} tensors is in the checkpoint "
                                 f"(saved keys e.g. {_short(list(saved)[:3])}, live keys e.g. "
                                 f"{_short(live_tensors[:3])}){hint}; refusing to load nothing into it")
    for s, lk in mismatched:
        log.warning("gdswriter: %s/%s skipped: saved %s, live %s", name, lk, _desc(saved[s]), _desc(live_sd[lk]))
    if missing or unexpected:
        log.warning("gdswriter: %s: missing keys %s, unexpected keys %s%s", name, _short(missing),
                    _short(unexpected), hint)
    plan.keys[name] = good
    plan.dropped[name] = bad
    plan.apply.add(name)
    plan.loaded += [f"{name}/{lk}" for lk in good.values()]
    if not module:  # a dict target receives the keys it lacks
        plan.loaded += [f"{name}/{k}" for k in unexpected]
    plan.skipped += [f"{name}/{lk}" for _, lk in mismatched]
    plan.missing += [f"{name}/{k}" for k in missing]
    plan.unexpected += [f"{name}/{k}" for k in unexpected]


def _plan_optimizer(plan: _Plan, live: LiveState, saved: Any, strict: bool) -> None:
    """Check a torch optimizer's saved structure against the live one: parameter groups, parameters
    per group, and the state of a resumed optimizer (keys, shapes); and that every model parameter
    it updates is loaded. Other optimizer types are left to their load_state_dict."""
    opt = live.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        plan.apply.add("optimizer")
        plan.loaded.append("optimizer")
        return
    problem = ""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping) or not isinstance(groups, list) \
            or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        problem = "the saved state is not a torch optimizer state_dict"
    elif len(groups) != len(opt.param_groups):
        problem = f"the checkpoint has {len(groups)} parameter group(s), the live optimizer {len(opt.param_groups)}"
    elif [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        problem = (f"parameters per group differ: checkpoint {[len(g['params']) for g in groups]}, live "
                   f"{[len(g['params']) for g in opt.param_groups]}")
    else:
        params = [p for g in opt.param_groups for p in g["params"]]
        saved_ids = [i for g in groups for i in g["params"]]
        names = {}
        if isinstance(live.model, torch.nn.Module):
            names = {id(p): f"model/{k}" for k, p in live.model.named_parameters(remove_duplicate=False)}
        loaded = set(plan.loaded)
        for sid, p in zip(saved_ids, params):
            pname = names.get(id(p))
            if pname is not None and pname not in loaded:
                problem = (f"it updates {pname}, which is not loaded: its state would not fit; load the optimizer "
                           f"only with a model that loads completely")
                break
            have, want = opt.state.get(p), saved["state"].get(sid)
            if have and isinstance(want, Mapping):
                ht = {k: tuple(v.shape) for k, v in have.items() if isinstance(v, torch.Tensor)}
                wt = {k: tuple(v.shape) for k, v in want.items() if isinstance(v, torch.Tensor)}
                if ht != wt:
                    problem = (f"the state of parameter {pname or sid} differs: checkpoint {wt}, live {ht} (another "
                               f"model or optimizer?)")
                    break
    if problem:
        if strict:
            raise StateMismatchError(f"optimizer: {problem}; pass strict=False to skip the optimizer")
        log.warning("gdswriter: optimizer skipped: %s", problem)
        plan.skipped.append("optimizer")
        return
    plan.apply.add("optimizer")
    plan.loaded.append("optimizer")


def plan_restore(skeleton: Any, live: LiveState, strict: bool) -> _Plan:
    """Decide everything a restore does, from the saved structure (``skeleton``: the state tree
    decoded over placeholder tensors) and the live objects, before any byte is read. Raises
    StateMismatchError (strict) or NothingToLoadError."""
    if not isinstance(skeleton, dict):
        raise CorruptCheckpointError("the saved state is not a dict; it was not written by GDSCheckpointer")
    plan = _Plan()
    saved_extra = skeleton.get("extra") if isinstance(skeleton.get("extra"), dict) else {}
    targets = [("model", live.model, skeleton.get("model"))]
    targets += [(f"extra/{k}", v, saved_extra.get(k)) for k, v in live.extra.items()]
    for name, obj, saved in targets:
        if obj is None:
            continue
        if saved is None:
            if strict:
                raise StateMismatchError(f"{name}: the checkpoint holds no state for it; pass strict=False to "
                                         f"load the rest")
            log.warning("gdswriter: %s is not in the checkpoint; left as is", name)
            plan.missing.append(name)
        elif isinstance(obj, torch.nn.Module):
            _plan_tensor_dict(plan, name, obj.state_dict(), saved, strict, module=True)
        elif isinstance(obj, dict):
            _plan_tensor_dict(plan, name, obj, saved, strict, module=False)
        else:
            plan.apply.add(name)
            plan.loaded.append(name)
    if live.optimizer is not None:
        saved = skeleton.get("optimizer")
        if saved is None:
            if strict:
                raise StateMismatchError("optimizer: the checkpoint holds no state for it; pass strict=False to "
                                         "load the rest")
            log.warning("gdswriter: optimizer is not in the checkpoint; left as is")
            plan.missing.append("optimizer")
        elif isinstance(live.optimizer, dict):
            _plan_tensor_dict(plan, "optimizer", live.optimizer, saved, strict, module=False)
        else:
            _plan_optimizer(plan, live, saved, strict)
    if live.restore_rng and "rng" in skeleton:
        plan.apply.add("rng")
        plan.loaded.append("rng")
    if not plan.loaded and (plan.skipped or plan.missing):
        raise NothingToLoadError(f"nothing in the checkpoint fits the live state (saved: {sorted(map(str, skeleton))}; "
                                 f"missing: {_short(plan.missing)}, skipped: {_short(plan.skipped)}); refusing to load "
                                 f"nothing")
    return plan


def live_tensors(live: LiveState, plan: _Plan) -> dict[str, torch.Tensor]:
    """Manifest name ("model/<saved key>") -> live tensor, for the planned tensors that can be
    filled in place (model, dict and module extras)."""
    out: dict[str, torch.Tensor] = {}
    sources = [("model", live.model)] + [(f"extra/{k}", v) for k, v in live.extra.items()]
    for name, obj in sources:
        if name not in plan.keys:
            continue
        sd = obj.state_dict() if isinstance(obj, torch.nn.Module) else obj
        for saved_key, live_key in plan.keys[name].items():
            v = sd[live_key]
            if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_meta:
                out[f"{name}/{saved_key}"] = v.detach()
    return out


def live_optimizer_state(optimizer: Any) -> dict[str, torch.Tensor]:
    """The live optimizer's state tensors (exp_avg, ...), named as in the manifest. Filled in
    place when they match (a resumed optimizer that already stepped), else left alone:
    load_state_dict replaces them, so a mismatch here is no error."""
    if optimizer is None or not hasattr(optimizer, "state_dict"):
        return {}
    state = optimizer.state_dict().get("state")
    if not isinstance(state, dict):
        return {}
    return {f"optimizer/state/{pid}/{k}": v for pid, st in state.items() if isinstance(st, dict)
            for k, v in st.items() if isinstance(v, torch.Tensor) and v.layout == torch.strided}


def match_live(manifest: Manifest, live: Mapping[str, torch.Tensor]) -> dict[int, tuple[int, torch.Tensor]]:
    """Storages that can be read straight into a live tensor: {storage: (tensor record, flat view)}:
    the storage's only tensor, same dtype, shape and strides, contiguous, the whole storage."""
    users: dict[int, int] = {}
    seen: dict[str, int] = {}
    for t in manifest.tensors:
        users[t.storage] = users.get(t.storage, 0) + 1
        seen[t.name] = seen.get(t.name, 0) + 1
    direct = {}
    for i, rec in enumerate(manifest.tensors):
        lt = live.get(rec.name)
        if lt is None or seen[rec.name] > 1:  # an ambiguous name is never read in place
            continue
        if dtype_to_name(lt.dtype) != rec.dtype or tuple(lt.shape) != rec.shape:
            continue
        nbytes = lt.numel() * lt.element_size()
        if (users[rec.storage] == 1 and lt.is_contiguous() and rec.byte_offset == 0
                and manifest.storages[rec.storage].nbytes == nbytes and nbytes
                and rec.stride == tuple(lt.stride()) and not lt.is_conj() and not lt.is_neg()):
            direct[rec.storage] = (i, flat_bytes(lt.untyped_storage(), lt.device,
                                                  lt.storage_offset() * lt.element_size(), nbytes))
    return direct


def apply_state(live: LiveState, state: dict, plan: _Plan) -> None:
    """Hand each planned object its saved state (load_state_dict, or in-place copies for dicts)."""
    saved_extra = state.get("extra") or {}
    targets = [("model", live.model, state.get("model"))]
    targets += [(f"extra/{k}", v, saved_extra.get(k)) for k, v in live.extra.items()]
    targets.insert(1, ("optimizer", live.optimizer, state.get("optimizer")))  # after the model, as planned
    for name, obj, saved in targets:
        if name not in plan.apply:
            continue
        if isinstance(obj, torch.nn.Module):
            _load_module(name, obj, saved, plan.keys[name])
        elif isinstance(obj, dict):
            _load_dict(obj, saved, plan.keys[name], plan.dropped[name])
        else:
            try:
                obj.load_state_dict(saved)
            except (ValueError, KeyError, RuntimeError, TypeError) as e:
                raise StateMismatchError(f"{name}: load_state_dict refused the saved state: {e}") from e
    if "rng" in plan.apply:
        set_rng_state(state["rng"])


def _load_module(name: str, module: torch.nn.Module, saved: Mapping, keys: Mapping) -> None:
    """load_state_dict with the planned keys, renamed to the live module's (``_orig_mod.``)."""
    usable: Any = type(saved)() if isinstance(saved, dict) else {}
    for saved_key, live_key in keys.items():
        usable[live_key] = saved[saved_key]
    meta = getattr(saved, "_metadata", None)
    if isinstance(meta, Mapping):  # module versions, keyed by module prefix: rename them the same way
        live_meta = getattr(module.state_dict(), "_metadata", {}) or {}
        prefixes = match_keys([f"{k}." for k in meta], [f"{k}." for k in live_meta])
        usable._metadata = type(meta)((prefixes.get(f"{k}.", f"{k}.")[:-1], v) for k, v in meta.items())
    try:
        module.load_state_dict(usable, strict=False)
    except RuntimeError as e:
        raise StateMismatchError(f"{name}: {e}") from e


def _load_dict(target: dict, saved: Mapping, keys: Mapping, dropped: set) -> None:
    """Fill a plain dict target: planned tensors are copied in place, other planned values and
    keys the target lacks are set; ``dropped`` (mismatched) saved keys are left out."""
    for saved_key, v in saved.items():
        if saved_key in dropped:
            continue
        live_key = keys.get(saved_key, saved_key)
        cur = target.get(live_key)
        if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
            # An expanded tensor (stride 0) cannot be written in place: take the restored view.
            if not any(s == 0 and n > 1 for n, s in zip(cur.shape, cur.stride())):
                with torch.no_grad():
                    cur.copy_(v)
                continue
        target[live_key] = v


def restore_into(live: LiveState, protocol: CommitProtocol, step: int, engines: Sequence[IOEngine], *,
                 strict: bool, verify: bool, engine_options: EngineOptions, atomic: bool | None = None,
                 scan_first: bool = False, manifest: Manifest | None = None) -> LoadResult:
    """Restore ``live`` in place from committed ``step`` (see GDSCheckpointer.load). Nothing
    live changes before the plan is made; with ``atomic`` nothing changes before every byte
    is verified. ``scan_first``: a non-atomic load first re-hashes the step (bounded memory),
    so that damage found by checksums leaves the live state untouched too. ``manifest``: the
    step's manifest already parsed (parse_manifest), used when it describes ``step``."""
    if manifest is None or manifest.step != step:
        manifest = read_manifest(protocol, step)
    else:
        check_data_files(protocol, manifest)
    plan = plan_restore(decode_state(manifest.state, placeholder_tensors(manifest)), live, strict)
    tensors_live = live_tensors(live, plan)
    optimizer_state = live_optimizer_state(live.optimizer) if "optimizer" in plan.apply else {}
    direct = match_live(manifest, {**optimizer_state, **tensors_live})
    in_place = sum(flat.numel() for _, flat in direct.values())
    if atomic is None:
        atomic = verify and in_place <= ATOMIC_LOAD_MAX_BYTES
    if scan_first and verify and direct and not atomic:
        problems: list[str] = []
        verify_step(protocol, manifest, engines[0], SCAN_SCRATCH_BYTES, problems)
        if problems:
            raise CorruptCheckpointError(f"step {step} is damaged: {problems[0]}" +
                                         (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    buffers = [direct[sid][1] if sid in direct and not atomic else host_buffer(s.nbytes)
               for sid, s in enumerate(manifest.storages)]
    try:
        read_storages(protocol, manifest, buffers, engines, verify=verify)
    except (CorruptCheckpointError, EngineIOError) as e:
        if direct and not atomic:
            names = [manifest.tensors[i].name for i, _ in direct.values()]
            e.add_note(f"gdswriter: {len(names)} live tensor(s) read in place ({', '.join(names[:8])}"
                       f"{', ...' if len(names) > 8 else ''}) may now hold part of step {step}'s bytes; nothing "
                       f"else changed (load_state_dict was not called). Load an intact step "
                       f"(load(fallback=True)) before training on.")
        raise
    if atomic:
        for sid, (_, flat) in direct.items():
            flat.copy_(buffers[sid])
    else:
        hint_unaligned([flat for _, flat in direct.values()], engine_options, engines[0].info)
    tensors = tensors_from_storages(manifest, buffers)
    all_live = {**optimizer_state, **tensors_live}
    for sid, (rec_index, _) in direct.items():
        tensors[rec_index] = all_live[manifest.tensors[rec_index].name]
    state = decode_state(manifest.state, tensors)
    apply_state(live, state, plan)  # type: ignore[arg-type]
    return LoadResult(step, tuple(plan.loaded), tuple(plan.skipped), tuple(plan.missing), tuple(plan.unexpected),
                      atomic=bool(atomic and verify))


_DAMAGE = (CorruptCheckpointError, UnsupportedFormatVersionError, CheckpointNotFoundError, EngineIOError)


def restore_newest_intact(live: LiveState, protocol: CommitProtocol, engines: Sequence[IOEngine], *,
                          strict: bool, verify: bool, engine_options: EngineOptions,
                          atomic: bool | None = None, manifest: Manifest | None = None) -> LoadResult:
    """Restore the newest intact step: the latest first, then older committed ones; a damaged
    step (manifest, files, checksums, an I/O error reading it) is skipped with a warning naming
    the problem, without changing the live state. A state mismatch is no damage: it is raised.
    ``manifest``: one step's manifest already parsed, as restore_into takes it."""
    damaged: list[int] = []
    problems: list[str] = []
    for step in protocol.fallback_order():
        try:
            result = restore_into(live, protocol, step, engines, strict=strict, verify=verify,
                                  engine_options=engine_options, atomic=atomic, scan_first=True, manifest=manifest)
        except _DAMAGE as e:
            if isinstance(e, EngineIOError) and not isinstance(e, CorruptCheckpointError) and e.errno != errno.EIO:
                raise
            log.warning("gdswriter: step %d under %s is damaged, trying an older step: %s", step, protocol.primary, e)
            damaged.append(step)
            problems.append(f"step {step}: {e}")
            continue
        if damaged:
            log.warning("gdswriter: loaded step %d, the newest intact step (passed over damaged step(s) %s)",
                        step, damaged)
        return LoadResult(result.step, result.loaded, result.skipped, result.missing, result.unexpected,
                          result.atomic, tuple(damaged))
    if not problems:
        protocol.require(None)  # no committed step at all: the usual CheckpointNotFoundError
    raise CorruptCheckpointError(f"no intact step under {protocol.primary}: " + "; ".join(problems))
