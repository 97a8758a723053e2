"""Reading: a committed step's manifest and bytes into fresh tensors.

``read_manifest`` parses and validates a step's manifest and checks every data file against
it (a regular file of exactly the recorded size) before anything is allocated, so a hostile
manifest cannot make a load commit more memory than the files hold. ``read_storages`` streams
the data files through the engines into per-storage buffers and checks each chunk's crc32c;
``tensors_from_storages`` rebuilds the saved views (sharing restored). ``read_tensors`` and
``load_state`` read a step into fresh CPU tensors.

Readers take no lock, so a running checkpointer's retention may delete the step being read:
a missing file (or any failure reading it) of a step that is no longer committed as it was
read (``step_gone``) is CheckpointNotFoundError, while the same in a step still committed is
damage (CorruptCheckpointError), as before. A 1.3 step's shards and data files follow the same
rule (format/sharded.py ``step_vanished``, which ``step_gone`` applies to them).

The bottom of gdswriter.load: it imports format/, engines/ and threads.py, never the rest of
load/ (verify, apply, policy), gdswriter.save or anything above them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import operator
import os
import stat
from itertools import repeat
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from crc32c import crc32c as _crc32c

from ..crc import crc32c_spans
from ..engines.base import IOEngine, ReadSpan
from ..engines.buffers import HUGE_PAGE
from ..engines.select import create_engine, sized_for
from ..errors import (CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError, GDSWriterError,
                      TruncatedFileError)
from ..format.commit import CommitProtocol, normalize_roots, step_dir_name
from ..fs import read_regular_file
from ..format.dtypes import dtype_from_name
from ..format.manifest import (MANIFEST_MAX_BYTES, MANIFEST_NAME, FileRecord, Manifest, StorageRecord, TensorColumns,
                               chunk_columns, tensor_table_columns)
from ..format.copies import merged_with_copies, replicas_of
from ..format.sharded import SHARDED_VERSION, GlobalManifest, load_merged, parse_step, step_vanished, vanished_error
from ..format.state_codec import decode_state, key_text
from ..options import EngineOptions
from ..threads import gc_paused, run_per_file

log = logging.getLogger("gdswriter")


_ALIGNED_MIN = 1 << 20
_MAPPED_MIN = 4 << 20


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh flat uint8 CPU tensor to read a storage into, a storage of exactly its bytes
    (torch.save, an export and torch.set_rng_state take a tensor's whole storage). From 1 MiB
    on 4 KiB-aligned, read zero-copy under O_DIRECT: from torch's allocator below 4 MiB (memory
    freed by earlier loads is reused, its pages already there), an anonymous mapping above,
    not populated: the read itself faults its pages in, a piece at a time while earlier
    requests are in flight, instead of one pass over all of them before the first byte is
    read. Huge pages populated up front (MADV_HUGEPAGE plus MADV_POPULATE_WRITE, as before)
    stalled on compaction after the page cache was dropped: a cold load of 2 GiB in 64
    tensors spent 4.4 s of its 5.8 s in that madvise, and took 2.1 s without it."""
    if nbytes < _ALIGNED_MIN:
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes < _MAPPED_MIN:
        raw = torch.empty(nbytes + 4095, dtype=torch.uint8)
        skip = -raw.data_ptr() % 4096
        # from its first byte, not a view into raw's larger storage
        return torch.frombuffer(raw.numpy(), dtype=torch.uint8, count=nbytes, offset=skip)
    # the tensor keeps the mapping alive
    return torch.frombuffer(mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def read_manifest_bytes(protocol: CommitProtocol, step: int) -> bytes:
    """The raw manifest of committed ``step`` (a regular file; links are refused)."""
    path = protocol.step_dir(step) / MANIFEST_NAME
    try:
        return read_regular_file(path, MANIFEST_MAX_BYTES)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(errno.ENOENT, f"{path} is missing: step {step} is not committed (deleted "
                                                    f"meanwhile?)") from e


def parse_manifest(protocol: CommitProtocol, step: int, raw: bytes | Manifest | GlobalManifest) -> Manifest:
    """Parse and validate the manifest of ``step`` (it must describe that step); ``raw``: its
    bytes, or what parse_step made of them."""
    path = protocol.step_dir(step) / MANIFEST_NAME
    parsed = parse_step(raw, str(path)) if isinstance(raw, bytes) else raw
    # format 1.3: the global manifest and every rank's shard, merged (format/sharded.py); 1.4: a
    # rank's shard and files from a copy where its own are not among the roots or damaged (format/copies.py)
    copies = replicas_of(parsed, str(path)) if isinstance(parsed, GlobalManifest) else None
    if isinstance(parsed, Manifest):
        m = parsed
    elif copies is None:
        m = load_merged(parsed, protocol.roots)
    else:
        m = merged_with_copies(parsed, copies, protocol.roots)
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
    the files each rank reads (distributed/fetch.py), before any rank allocates."""
    seen: dict[tuple[int, int], str] = {}
    for path, rec in files:
        try:
            st = os.lstat(path)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"data file {path} is missing: the checkpoint is incomplete; "
                                         f"load an earlier step") from e
        except OSError as e:
            if e.errno not in (errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP):
                raise
            raise CorruptCheckpointError(f"data file name {rec.path[:80]!r} in the manifest is not one gdswriter "
                                         f"writes ({os.strerror(e.errno)}): the checkpoint is damaged or was "
                                         f"tampered with; load an earlier step") from e
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


def check_step_files(step: int, created_unix: float, reach: Sequence[Path | None],
                     files: Iterable[FileRecord]) -> None:
    """check_file_sizes of data ``files`` of ``step`` (committed at ``created_unix``) on the
    roots this process sees (``reach``: a path per root of the step, the primary first, None
    where unseen; files on unseen roots are skipped): a multi-rank load's check. A file missing
    because the step vanished meanwhile is CheckpointNotFoundError (``vanished_instead``);
    otherwise damage, as check_file_sizes says."""
    files = [f for f in files if reach[f.root] is not None]
    d = step_dir_name(step)
    try:
        check_file_sizes((reach[f.root] / d / f.path, f) for f in files)  # type: ignore[operator]
    except CorruptCheckpointError as e:
        gone = vanished_instead(step, created_unix, reach, [f.root for f in files], e)
        if gone is None:
            raise
        raise gone from e


def vanished_instead(step: int, created_unix: float, reach: Sequence[Path | None], roots: Iterable[int],
                     e: BaseException) -> CheckpointNotFoundError | None:
    """For failure ``e`` (a missing or short file, a checksum, an I/O error) reading files of
    ``step`` (committed at ``created_unix``) on ``roots`` (indices into ``reach``: a path per
    root of the step, the primary first, None where unseen): the CheckpointNotFoundError to
    raise instead when the step vanished meanwhile (format/sharded.py ``step_vanished``: by the
    primary's manifest.json where seen, else by the step's directories on those roots); None
    when it did not (then ``e`` stands: damage). The multi-rank loads' deleted_while_reading."""
    if isinstance(e, CheckpointNotFoundError) or not isinstance(e, (CorruptCheckpointError, OSError)):
        return None
    primary = reach[0] if reach else None
    d = step_dir_name(step)
    dirs = [None] if primary is not None else [reach[r] / d for r in sorted(set(roots))  # type: ignore[operator]
                                               if reach[r] is not None]
    for x in dirs:
        if step_vanished(step, created_unix, primary, x):
            return vanished_error(step, primary or x, e)  # type: ignore[arg-type]
    return None


def step_gone(protocol: CommitProtocol, manifest: Manifest) -> bool:
    """True when the step ``manifest`` describes is no longer committed as that manifest: un-committed
    (a running checkpointer's retention, delete_step) or replaced by a new save of the same step.
    A reader that hits a missing file asks this: then it lost a race, the checkpoint is not damaged.
    A 1.3 step (its shards merged) is compared by its global manifest (format/sharded.py
    ``step_vanished``, the rule read_shard applies to its shards), without merging it again."""
    if manifest.dist is not None and manifest.version >= SHARDED_VERSION:  # merged from a 1.3+ step's shards
        return step_vanished(manifest.step, manifest.created_unix, protocol.primary)
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
    return vanished_error(manifest.step, protocol.primary, e)


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


RUN_SLACK = 8  # a run of chunks is read as one span when the gaps in it are at most 1/8 of its bytes
RUN_GAP = 4096  # (plus one alignment gap): its buffer holds at most 1/8 + 4 KiB more than its storages
RUN_MAX = HUGE_PAGE
"""A run's buffer holds at most this many bytes: small tensors are what runs batch, and a loaded
tensor keeps its run's buffer alive. Runs of 1-2 MiB are read zero-copy (an engine moves spans of
at least ZERO_COPY_MIN, 1 MiB, straight into their memory: host_buffer's are page-aligned);
the runs below 1 MiB they replaced were staged, a copy of every byte (10,000 tensors of 26 KiB:
0.16-0.28 s of a 256 MiB load)."""
SPARSE_SCRATCH = 32 << 20  # file bytes of sparse runs read at a time (the scratch buffer they pass through)


def read_storages(protocol: CommitProtocol, manifest: Manifest, dests: list[torch.Tensor | None],
                  engines: Sequence[IOEngine], *, verify: bool) -> list[torch.Tensor]:
    """Fill ``dests[i]`` (flat uint8, nbytes of storage i) from the data files; check crc32c.
    A None in ``dests`` is replaced by a fresh buffer (in place); returns ``dests``.

    Fresh storages of one chunk that lie next to each other in a file (a state of many small
    tensors: most of its storages) are read as one run: one buffer, one span (zero-copy
    under O_DIRECT, however many tensors it holds), each chunk checksummed there, each
    storage a view of it (runs up to RUN_MAX bytes: larger storages have buffers of their own,
    mapped by host_buffer). The buffers cover disjoint byte ranges of the files, so what is
    allocated stays within the files' sizes (checked before: check_data_files). The chunks are
    taken as arrays: a format 2 manifest's columns, else made from its records.

    A fresh storage in a run that one tensor views alone is made in that tensor's dtype
    (``_kinds``), so that its tensor is the buffer itself (tensors_from_storages): one
    torch.frombuffer per tensor, not a frombuffer and a view. Other buffers are flat uint8;
    every buffer is a flat storage of exactly storage i's bytes either way."""
    every, sizes = _chunk_table(manifest, dests)
    every, kinds = _kinds(manifest, every)
    fids = np.unique(every.fid).tolist()
    out = dests
    tables = {fids[0]: every} if len(fids) == 1 else {f: _take(every, every.fid == f) for f in fids}
    tables = {fid: _sorted(t) for fid, t in tables.items()}
    runs = {fid: _runs(t, out, kinds) for fid, t in tables.items()}
    for sid, n in enumerate(sizes):
        if out[sid] is None:
            out[sid] = host_buffer(n)
    step_dir = {i: protocol.step_dir(manifest.step, i) for i in range(len(protocol.roots))}

    def read_one(fid: int) -> None:
        rec = manifest.files[fid]
        path = step_dir[rec.root] / rec.path
        t = tables[fid]
        crcs = _read_spans(engines[rec.root % len(engines)], path, t, runs[fid], out, verify)
        if verify and (bad := _first_bad(crcs, t.crc)) is not None:
            sid = int(t.sid[bad])
            raise ChecksumMismatchError(path, _storage_name(manifest, sid), int(t.offs[bad]), int(t.lens[bad]),
                                        int(t.crc[bad]), int(crcs[bad]))

    run_per_file(read_one, fids, len(engines))
    return out  # type: ignore[return-value]


def _first_bad(crcs: np.ndarray, expected: np.ndarray) -> int | None:
    """The first chunk whose crc32c is not the recorded one, or None."""
    bad = np.flatnonzero(crcs.astype(np.int64) != expected)
    return int(bad[0]) if len(bad) else None


def _storage_name(manifest: Manifest, sid: int) -> str:
    """The name of a tensor viewing storage ``sid``, for messages."""
    cols = tensor_table_columns(manifest.tensors)
    if cols is not None:
        rows = np.flatnonzero(cols.storage == sid)
        return cols.names[int(rows[0])] if len(rows) else f"<storage {sid}>"
    return next((t.name for t in manifest.tensors if t.storage == sid), f"<storage {sid}>")


class _Run(NamedTuple):
    """Chunks [first, end) of a file's sorted chunks, read as one span of ``span`` bytes at file
    offset ``lo``. Dense (``packed`` None): read straight into ``buf``, whose storages are views
    of it. Sparse: read through a scratch buffer, each chunk then copied to ``packed[i]`` of
    ``buf`` (its storages' memory, without the gaps between them); ``step`` > 0 when its chunks
    are of one length at evenly spaced file offsets, ``step`` bytes apart (one strided copy)."""

    first: int
    end: int
    lo: int
    span: int
    buf: torch.Tensor
    packed: tuple[int, ...] | None
    step: int = 0


class _Table(NamedTuple):
    """Chunks as arrays (int64): their file, file offsets, lengths, ends, storage offsets,
    crc32c, storages, which may join a run (the only chunk of a fresh storage, not empty),
    the dtype its run's view is made in (an index into _kinds' list; 0: uint8), and (once
    sorted by _sorted, per file) running byte totals (``cum[j]``: bytes before j)."""

    fid: np.ndarray
    offs: np.ndarray
    lens: np.ndarray
    ends: np.ndarray
    so: np.ndarray
    crc: np.ndarray
    sid: np.ndarray
    alone: np.ndarray
    kind: np.ndarray
    cum: np.ndarray


def _chunk_table(manifest: Manifest, dests: list[torch.Tensor | None]) -> tuple[_Table, list[int]]:
    """Every chunk of ``manifest`` as a _Table (storage by storage), and each storage's size:
    from the manifest's validated columns (format 2), else one pass over its records."""
    fresh = np.fromiter(map(operator.is_, dests, repeat(None)), bool, len(dests))
    cols = chunk_columns(manifest.storages)
    if cols is not None:
        sid = np.repeat(np.arange(len(cols.nbytes)), cols.counts)
        alone = (fresh & (cols.counts == 1))[sid] & (cols.ln > 0)
        empty = np.zeros(0, np.int64)
        return (_Table(cols.fid, cols.fo, cols.ln, cols.fo + cols.ln, cols.so, cols.crc, sid, alone,
                       np.zeros(len(sid), np.int64), empty),
                cols.nbytes.tolist())
    storages = manifest.storages
    pairs = [(c, s) for s, st in enumerate(storages) for c in st.chunks]
    n = len(pairs)
    fid, fo, so, ln, crc = (np.fromiter((getattr(c, k) for c, _ in pairs), np.int64, n)
                                 for k in ("file", "file_offset", "storage_offset", "length", "crc32c"))
    sid = np.fromiter((s for _, s in pairs), np.int64, n)
    single = np.fromiter((len(st.chunks) == 1 for st in storages), bool, len(storages))
    alone = (fresh & single)[sid] & (ln > 0) if n else np.zeros(0, bool)
    return (_Table(fid, fo, ln, fo + ln, so, crc, sid, alone, np.zeros(n, np.int64), np.zeros(0, np.int64)),
            [s.nbytes for s in storages])


_TYPED = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
                    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})
"""The dtypes a run's storage may be made in (_kinds): plain ones, which torch.frombuffer makes."""


def _kinds(manifest: Manifest, t: _Table) -> tuple[_Table, tuple[list[torch.dtype], np.ndarray]]:
    """``t`` with each chunk's ``kind``: the dtype of the one tensor that views the chunk's
    storage, where exactly one does, its dtype is in _TYPED and the chunk is whole elements of
    it; else 0 (uint8). With the dtypes the kinds index (uint8 first) and their item sizes.
    By whole columns (format 2); a manifest of records gets uint8 throughout."""
    cols = tensor_table_columns(manifest.tensors)
    if cols is None or not len(t.sid):
        return t, ([torch.uint8], np.ones(1, np.int64))
    dtypes = [torch.uint8, *map(dtype_from_name, cols.dtype_names)]
    size = np.array([d.itemsize for d in dtypes], np.int64)
    usable = np.array([d in _TYPED for d in dtypes])
    n = len(manifest.storages)
    of = np.zeros(n, np.int64)
    rows = np.flatnonzero((np.bincount(cols.storage, minlength=n) == 1)[cols.storage])
    of[cols.storage[rows]] = cols.dtype[rows] + 1
    kind = of[t.sid]
    kind[~usable[kind] | (t.lens % size[kind] != 0)] = 0
    return t._replace(kind=kind), (dtypes, size)


def _take(t: _Table, which: np.ndarray) -> _Table:
    """The chunks of ``t`` that ``which`` (a mask or an index array) selects, in its order."""
    return _Table(*(a[which] for a in t[:-1]), t.cum)


def _run_end(t: _Table, k: int, stop: int) -> tuple[int, int]:
    """(end of the dense run, end of the sparse one) that start at chunk ``k``, before ``stop``
    (the first chunk that may not join): the following chunks within RUN_MAX bytes of file;
    dense while the gaps stay within 1/RUN_SLACK of the chunks' bytes plus RUN_GAP."""
    lo = int(t.offs[k])
    wide = k + 1 + int(np.searchsorted(t.ends[k + 1:stop], lo + RUN_MAX, "right"))
    if wide == k + 1:
        return wide, wide
    gappy = t.ends[k + 1:wide] - lo > (t.cum[k + 2:wide + 1] - t.cum[k]) * (RUN_SLACK + 1) // RUN_SLACK + RUN_GAP
    first = int(gappy.argmax())
    return (k + 1 + first if gappy[first] else wide), wide


def _sorted(t: _Table) -> _Table:
    """A file's chunks ``t`` in file order (an empty chunk before one at its offset; as they are
    when already in that order: a save writes them so), with their running byte totals."""
    order = np.lexsort((t.lens, t.offs))
    if (order[1:] < order[:-1]).any():
        t = _take(t, order)
    cum = np.zeros(len(t.lens) + 1, np.int64)
    np.cumsum(t.lens, out=cum[1:])
    return t._replace(cum=cum)


def _runs(t: _Table, dests: list[torch.Tensor | None], kinds: tuple[list[torch.dtype], np.ndarray]) -> list[_Run]:
    """The runs of a file's chunks ``t`` (sorted by offset): two or more consecutive chunks, each
    the only chunk of a fresh storage. Dense where the gaps allow (its buffer holds at most
    1/RUN_SLACK + RUN_GAP more than its storages) and the run is long enough to be read
    zero-copy; else sparse, up to RUN_MAX bytes of file (small storages laid out 4 KiB apart:
    100,000 tensors of 2.7 KB, each once a staged span of its own). Each run's storages get
    their part of its buffer in ``dests``: each a storage of its own that starts at its first
    byte (torch.frombuffer; code that reads a tensor's storage from its start, as
    torch.set_rng_state does, gets its bytes), keeping the buffer alive, in the dtype of its
    chunk's kind (``kinds``: _kinds). Cut with numpy, a few array operations per run, not per
    chunk."""
    runs: list[_Run] = []
    edges = np.flatnonzero(np.diff(t.alone.astype(np.int8), prepend=0, append=0))
    for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):  # [a, b): chunks that may join runs
        k = a
        while k < b:
            end, wide = _run_end(t, k, b)
            packed = None
            if t.ends[end - 1] - t.offs[k] < RUN_MAX // 2 and wide > end:
                end = wide
                packed = (t.cum[k:end] - t.cum[k]).tolist()
            if end - k > 1:
                runs.append(_make_run(t, k, end, packed, dests, kinds))
            k = end
    return runs


def _make_run(t: _Table, k: int, end: int, packed: list[int] | None, dests: list[torch.Tensor | None],
              kinds: tuple[list[torch.dtype], np.ndarray]) -> _Run:
    """Run ``[k, end)``: its buffer, and each storage's part of it in ``dests`` (torch.frombuffer
    at an offset: a storage of exactly its bytes, a third of the cost of slicing a memoryview),
    in its chunk's kind (_kinds) where its place in the buffer is aligned to that dtype, else uint8.
    A dense run of at least _ALIGNED_MIN bytes starts its buffer at the 4 KiB boundary at or
    below its first chunk (packed storages, format 2.1, start anywhere 64 bytes apart): at most
    4 KiB more per MiB, so what a load allocates stays within the files' sizes plus 0.4%."""
    lo = int(t.offs[k])
    if packed is None and int(t.ends[end - 1]) - lo >= _ALIGNED_MIN:
        lo = lo // 4096 * 4096  # the buffer mirrors the file's 4 KiB phase: read zero-copy (_read_spans)
    span = int(t.ends[end - 1]) - lo
    buf = host_buffer(span if packed is None else int(t.cum[end] - t.cum[k]))
    base = buf.numpy()
    at = np.array(packed, np.int64) if packed is not None else t.offs[k:end] - lo
    dtypes, size = kinds
    kind = t.kind[k:end]
    kind = np.where(at % size[kind] == 0, kind, 0)  # (host_buffer's memory is 64-byte aligned at least)
    frombuffer = torch.frombuffer
    for sid, o, n, dt in zip(t.sid[k:end].tolist(), at.tolist(), (t.lens[k:end] // size[kind]).tolist(),
                             map(dtypes.__getitem__, kind.tolist())):
        dests[sid] = frombuffer(base, dtype=dt, count=n, offset=o)
    if packed is None:
        return _Run(k, end, lo, span, buf, None)
    step = int(t.offs[k + 1] - t.offs[k])
    lens, gaps = t.lens[k:end], np.diff(t.offs[k:end])
    even = step >= t.lens[k] and bool((lens == lens[0]).all()) and bool((gaps == step).all())
    return _Run(k, end, lo, span, buf, tuple(packed), step if even else 0)


def _read_spans(engine: IOEngine, path: Path, t: _Table, runs: list[_Run], out: list, verify: bool) -> np.ndarray:
    """Read a file's chunks ``t``: each dense run as one span, each other chunk as its own, then
    the sparse runs (_read_sparse); returns every chunk's crc32c (uint32; a run's chunks summed
    from its buffer in one crc32c_spans call; zeros without ``verify``)."""
    spans: list[ReadSpan] = []
    owner: list[int] = []  # per span: the dense run it reads (index into runs), or -1 - its chunk
    shared: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # see _dense_span
    sparse: list[_Run] = []
    offs, lens, so, sids = t.offs.tolist(), t.lens.tolist(), t.so.tolist(), t.sid.tolist()
    k, r = 0, 0
    while k < len(offs):
        if r < len(runs) and runs[r].first == k:
            if runs[r].packed is None:
                spans.append(_dense_span(runs, r, spans, owner, shared))  # summed per chunk below
                owner.append(r)
            else:
                sparse.append(runs[r])
            k, r = runs[r].end, r + 1
            continue
        spans.append(ReadSpan(offs[k], out[sids[k]][so[k]:so[k] + lens[k]], checksum=verify))
        owner.append(-1 - k)
        k += 1
    crcs = np.zeros(len(offs), np.uint32)
    got = engine.read_file(path, spans) if spans else []
    for dst, src, _ in shared:  # a span's last bytes, read into the next run's first block
        dst.copy_(src)
    for crc, o in zip(got if verify else (), owner):
        if o < 0:
            crcs[-1 - o] = crc
            continue
        run = runs[o]  # all of a run's chunks in one call (compiled: the GIL released)
        crc32c_spans(run.buf.numpy(), t.offs[run.first:run.end] - run.lo,
                     np.ascontiguousarray(t.lens[run.first:run.end]), crcs[run.first:run.end])
    for _, _, o in shared if verify else ():
        if o < 0:  # a chunk's span that was cut: its engine checksum covers part of it
            k = -1 - o
            crcs[k] = _crc32c(out[sids[k]][so[k]:so[k] + lens[k]].numpy())
    if sparse:
        _read_sparse(engine, path, (offs, lens, sids), sparse, out, crcs, verify)
    return crcs


def _dense_span(runs: list[_Run], r: int, spans: list[ReadSpan], owner: list[int],
                shared: list[tuple[torch.Tensor, torch.Tensor, int]]) -> ReadSpan:
    """The span that reads dense run ``r`` into its buffer, from its buffer's first byte where
    the span before it allows. Packed storages (format 2.1) share 4 KiB blocks, so that span
    (the run before, or a chunk of its own) may end inside this run's first block: it is cut
    at the block, so both stay 4 KiB-aligned and are read zero-copy, and the bytes cut off are
    copied from this run's buffer once read (``shared``: destination, source, that span's
    owner). When the span before starts past the block's start, this one starts where it ends."""
    run = runs[r]
    start = run.lo
    if spans and spans[-1].end > start:
        prev = spans[-1]
        if prev.offset <= start:  # (cut to nothing where it starts at the block: all copied)
            cut = start - prev.offset
            spans[-1] = ReadSpan(prev.offset, prev.out[:cut], checksum=prev.checksum)
            shared.append((prev.out[cut:], run.buf[:prev.end - start], owner[-1]))
        else:
            start = prev.end
    return ReadSpan(start, run.buf[start - run.lo:], checksum=False)


def _read_sparse(engine: IOEngine, path: Path, chunks: tuple[list[int], list[int], list[int]], runs: list[_Run],
                 out: list, crcs: np.ndarray, verify: bool) -> None:
    """Read sparse ``runs`` through one scratch buffer, as many runs at a time as it holds (each
    4 KiB-aligned in it: read zero-copy where long enough), then copy each chunk to its place in
    its run's buffer (one memmove each) and sum it there. ``chunks``: the file's chunks' file
    offsets, lengths and storages. The scratch holds at most the gaps between the runs' chunks
    (bytes of the file no chunk holds) and SPARSE_SCRATCH, so what a load allocates stays within
    the files' sizes; a run it cannot hold is read chunk by chunk."""
    offs, lens, sids = chunks
    placed = [-(-r.span // 4096) * 4096 for r in runs]
    size = min(SPARSE_SCRATCH, sum(r.span - r.buf.numel() for r in runs))
    fits = [i for i, n in enumerate(placed) if n <= size]
    if len(fits) < len(runs):
        alone = [(j, r) for i, r in enumerate(runs) if placed[i] > size for j in range(r.first, r.end)]
        got = engine.read_file(path, [ReadSpan(offs[j], r.buf[r.packed[j - r.first]:][:lens[j]])  # type: ignore[index]
                                      for j, r in alone])  # (its storage's place in its run: out[sid] may be typed)
        for (j, _), crc in zip(alone, got):
            crcs[j] = crc
    if not fits:
        return
    scratch = host_buffer(size)
    base = scratch.data_ptr()
    i = 0
    while i < len(fits):
        batch, at = [], 0
        while i < len(fits) and at + placed[fits[i]] <= size:
            batch.append((runs[fits[i]], at))
            at += placed[fits[i]]
            i += 1
        engine.read_file(path, [ReadSpan(run.lo, scratch[pos:pos + run.span], checksum=False)  # summed per chunk
                                for run, pos in batch])
        for run, pos in batch:
            _pack(run, offs[run.first:run.end], lens[run.first:run.end], scratch, pos, base)
            if verify:
                crc32c_spans(run.buf.numpy(), np.array(run.packed, np.int64),
                             np.array(lens[run.first:run.end], np.int64), crcs[run.first:run.end])


def _pack(run: _Run, offs: list[int], lens: list[int], scratch: torch.Tensor, pos: int, base: int) -> None:
    """Copy sparse ``run``'s chunks (file offsets ``offs``, lengths ``lens``) from where its file
    bytes lie in ``scratch`` (from byte ``pos``; ``base``: its address) to their places in the
    run's buffer. Chunks of one length at evenly spaced offsets (``run.step``: small tensors of
    one size laid out 4 KiB apart) move in one strided copy (numpy: one thread, no per-chunk
    call); others one memmove each."""
    n, length, step = len(offs), lens[0], run.step
    first = pos + offs[0] - run.lo
    if step:
        src = np.lib.stride_tricks.as_strided(scratch[first:first + (n - 1) * step + length].numpy(),
                                              (n, length), (step, 1), writeable=False)
        np.copyto(run.buf.numpy().reshape(n, length), src)
        return
    dst = run.buf.data_ptr()
    for fo, ln, o in zip(offs, lens, run.packed):  # type: ignore[arg-type]
        ctypes.memmove(dst + o, base + pos + fo - run.lo, ln)


def tensors_from_storages(manifest: Manifest, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Build each saved tensor as a typed strided view of its storage buffer (sharing restored):
    from a format 2 manifest's columns (_tensors_from_columns), else from its records.
    ``buffers``: per storage a flat tensor of its bytes (uint8, or a dtype read_storages chose)."""
    cols = tensor_table_columns(manifest.tensors)
    if cols is not None:
        return _tensors_from_columns(cols, buffers)
    kinds: dict[tuple[str, tuple], tuple] = {}  # (dtype, shape) -> (dtype, C-contiguous strides, bytes, 1-D)
    out = []
    append = out.append
    for t in manifest.tensors:
        buf = buffers[t.storage]
        kind = kinds.get((t.dtype, t.shape))
        if kind is None:
            dtype = dtype_from_name(t.dtype)
            kind = kinds[t.dtype, t.shape] = (dtype, torch.empty(t.shape, device="meta").stride(),
                                              math.prod(t.shape) * dtype.itemsize, len(t.shape) == 1)
        dtype, contiguous, nbytes, flat = kind
        # The usual record, the whole storage as one C-contiguous view: buf.view(dtype), a third
        # of the cost of set_ (10,000 tensors: 0.1 s); any other view (sharing, offsets) by set_
        if (t.byte_offset == 0 and t.stride == contiguous and nbytes and buf.nbytes == nbytes
                and (dtype.itemsize == 1 or buf.storage_offset() * buf.itemsize % dtype.itemsize == 0)):
            typed = buf.view(dtype)
            append(typed if flat else typed.view(t.shape))
            continue
        append(torch.empty(0, dtype=dtype, device=buf.device).set_(
            buf.untyped_storage(), (buf.storage_offset() * buf.itemsize + t.byte_offset) // dtype.itemsize, t.shape,
            t.stride))
    return out


def contiguous_rows(cols: TensorColumns) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor of ``cols``: its element count, and whether it is a C-contiguous view with every
    dimension at least 1 (its strides the products of the sizes after them). By ndim, a few
    array operations each; no overflow (the columns' checks bound every product of sizes)."""
    n = len(cols.names)
    numel = np.ones(n, np.int64)
    contiguous = np.ones(n, bool)
    starts = cols.starts
    for k in np.unique(cols.ndim).tolist():
        if k == 0:
            continue
        rows = np.flatnonzero(cols.ndim == k)
        at = starts[rows][:, None] + np.arange(k)
        shape, stride = cols.shape[at], cols.stride[at]
        rev = np.cumprod(shape[:, ::-1], axis=1)  # rev[:, j]: the product of the last j + 1 sizes
        want = np.concatenate((rev[:, -2::-1], np.ones((len(rows), 1), np.int64)), axis=1)
        numel[rows] = rev[:, -1]
        contiguous[rows] = (stride == want).all(axis=1) & (shape >= 1).all(axis=1)
    return numel, contiguous


def _scatter(out: list, rows: np.ndarray, values: Iterable) -> None:
    """``out[rows[j]] = values[j]`` (rows ascending); all of ``out`` at once when rows are all of it."""
    if len(rows) == len(out):
        out[:] = values
        return
    for r, v in zip(rows.tolist(), values):
        out[r] = v


def _tensors_from_columns(cols: TensorColumns, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """tensors_from_storages over a format 2 manifest's columns. The usual view (the whole
    storage, C-contiguous, 1-D: ``buf.view(dtype)``) is found by whole columns, per dtype: the
    buffer itself where it already has that dtype (not uint8: a buffer the caller passed) and
    no other tensor views it (read_storages made it so), found by a map over the buffers, no
    Python step per tensor; a view made for the others. Any other view (sharing, offsets, other
    shapes) one by one."""
    dtypes = [dtype_from_name(d) for d in cols.dtype_names]
    itemsize = np.array([d.itemsize for d in dtypes] or [1], np.int64)[cols.dtype]
    numel, contiguous = contiguous_rows(cols)
    nbytes = numel * itemsize
    sid = cols.storage
    have, skew = _buffer_columns(buffers)
    have, skew = have[sid], skew[sid] % itemsize
    plain = contiguous & (cols.byte_offset == 0) & (nbytes > 0) & (have == nbytes) & (skew == 0)
    out: list = [None] * len(cols.names)
    alone = (np.bincount(sid, minlength=len(buffers)) == 1)[sid]  # the only tensor viewing its storage
    for d in np.unique(cols.dtype[plain & (cols.ndim == 1)]).tolist():
        rows = np.flatnonzero(plain & (cols.ndim == 1) & (cols.dtype == d))
        dt, bufs = dtypes[d], list(map(buffers.__getitem__, sid[rows].tolist()))
        same = np.fromiter(map(operator.is_, map(_DTYPE, bufs), repeat(dt)), bool, len(bufs)) & alone[rows]
        viewed = ~same if dt is not torch.uint8 else np.ones(len(bufs), bool)  # (uint8: a caller's flat buffer?)
        for j in np.flatnonzero(viewed).tolist():
            bufs[j] = bufs[j].view(dt)  # (the others: each the buffer itself, no step per tensor)
        _scatter(out, rows, bufs)
    shapes, strides, starts = cols.shape.tolist(), cols.stride.tolist(), cols.starts.tolist()
    for i in np.flatnonzero(~plain | (cols.ndim != 1)).tolist():
        buf, dtype, at, k = buffers[sid[i]], dtypes[cols.dtype[i]], starts[i], int(cols.ndim[i])
        if plain[i]:
            out[i] = (buf if buf.dtype is dtype else buf.view(dtype)).view(shapes[at:at + k])
            continue
        out[i] = torch.empty(0, dtype=dtype, device=buf.device).set_(
            buf.untyped_storage(), (buf.storage_offset() * buf.itemsize + int(cols.byte_offset[i])) // dtype.itemsize,
            shapes[at:at + k], strides[at:at + k])
    return out


def _buffer_columns(buffers: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Each buffer's byte count and storage offset in bytes (-1, 0 for a storage left unread: None)."""
    n = len(buffers)
    if not any(map(operator.is_, buffers, repeat(None))):
        skew = np.fromiter(map(torch.Tensor.storage_offset, buffers), np.int64, n)
        moved = np.flatnonzero(skew)  # in elements: to bytes (read_storages' fresh buffers start their storages)
        skew[moved] *= np.fromiter((buffers[i].itemsize for i in moved.tolist()), np.int64, len(moved))
        return np.fromiter(map(_NBYTES, buffers), np.int64, n), skew
    return (np.fromiter((-1 if b is None else b.nbytes for b in buffers), np.int64, n),
            np.fromiter((0 if b is None else b.storage_offset() * b.itemsize for b in buffers), np.int64, n))


_NBYTES = operator.attrgetter("nbytes")
_DTYPE = operator.attrgetter("dtype")


def placeholder_tensors(manifest: Manifest) -> list[torch.Tensor]:
    """One stand-in per saved tensor with its dtype and shape and no memory of its own (a
    0-stride expansion of one element, one per dtype): decode_state with these shows the
    saved structure before a byte is read. From a format 2 manifest's columns: one stand-in
    per distinct (dtype, shape), found with numpy, no tuple per tensor."""
    cols = tensor_table_columns(manifest.tensors)
    if cols is None:
        return _placeholders([(t.dtype, t.shape) for t in manifest.tensors])
    out: list = [None] * len(cols.names)
    for k in np.unique(cols.ndim).tolist():
        rows = np.flatnonzero(cols.ndim == k)
        at = cols.starts[rows][:, None] + np.arange(k)
        table = np.concatenate((cols.dtype[rows][:, None], cols.shape[at]), axis=1)
        which = _row_kinds(table)
        first = np.zeros(int(which.max()) + 1, np.int64)
        first[which[::-1]] = np.arange(len(which))[::-1]  # each kind's first row
        made = _placeholders([(cols.dtype_names[row[0]], tuple(row[1:])) for row in table[first].tolist()])
        _scatter(out, rows, map(made.__getitem__, which.tolist()))
    return out


def _row_kinds(table: np.ndarray) -> np.ndarray:
    """Per row of ``table`` (int64, rows x columns): a number in [0, distinct rows), the same
    for equal rows. Column by column, each a 1-D unique (np.unique over whole rows sorts them
    as records: 0.1 s at 100,000 tensors)."""
    ids = np.zeros(len(table), np.int64)
    for col in table.T:
        inv = np.unique(col, return_inverse=True)[1].reshape(-1)
        ids = np.unique(ids * (int(inv.max()) + 1) + inv, return_inverse=True)[1].reshape(-1)
    return ids


def _placeholders(keys: list[tuple[str, tuple]]) -> list[torch.Tensor]:
    """placeholder_tensors of these (dtype name, shape) pairs."""
    one: dict[str, torch.Tensor] = {}
    made: dict[tuple[str, tuple], torch.Tensor] = {}  # one stand-in per dtype and shape (expand: 3 us each)
    out = []
    for key in keys:
        stand_in = made.get(key)
        if stand_in is None:
            if key[0] not in one:
                one[key[0]] = torch.empty((), dtype=dtype_from_name(key[0]))
            stand_in = made[key] = one[key[0]].expand(key[1])
        out.append(stand_in)
    return out


def load_state(root: str | os.PathLike | Sequence[str | os.PathLike], step: int | None = None, *,
               verify: bool = True, engine_options: EngineOptions | None = None) -> tuple[int, Any]:
    """Read a checkpoint into fresh CPU tensors: returns (step, state) where state is the saved
    tree (``{"model": ..., "optimizer": ..., ...}``). Never unpickles; takes no lock.

    Beside a running checkpointer, the step may be deleted while it is read (retention): that is
    CheckpointNotFoundError, and with ``step`` None the newest step is then tried once more."""
    protocol = CommitProtocol(normalize_roots(root))

    def read(step: int) -> tuple[int, Any]:
        # Garbage collection held off: the manifest's objects are freed by reference counting
        # before it resumes, not walked by a collection after the parse (threads.gc_paused)
        with gc_paused():
            manifest = read_manifest(protocol, step)
            state = decode_state(manifest.state, read_tensors(protocol, manifest, verify=verify,
                                                              engine_options=engine_options))
            del manifest
            return step, state

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
    try:
        # A small read gets an engine with small staging buffers (engines/select.py: sized_for)
        options = sized_for(engine_options or EngineOptions.from_env(), part.storage_bytes())
        with create_engine(options) as engine, gc_paused():  # objects per storage and tensor, no cycles
            buffers: list = [None] * len(part.storages)
            read_storages(protocol, part, buffers, [progress.reads(engine) if progress else engine], verify=verify)
    except (CorruptCheckpointError, OSError) as e:
        gone = deleted_while_reading(protocol, manifest, e)
        if gone is None:
            raise
        raise gone from e
    if indices is None:
        with gc_paused():
            return tensors_from_storages(part, buffers)  # type: ignore[return-value]
    out: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    views = tensors_from_storages(replace(part, tensors=tuple(manifest.tensors[i] for i in wanted)), buffers)
    for i, t in zip(wanted, views):
        out[i] = t
    return out


def state_keys(m: Manifest) -> list[str] | None:
    """The top-level keys of a step's state ("model", "optimizer", ...), None when it is no dict."""
    try:
        state = decode_state(m.state, [torch.empty(0)] * len(m.tensors))
    except CorruptCheckpointError:
        return None
    return [key_text(k) for k in state] if isinstance(state, dict) else None
