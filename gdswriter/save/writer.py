"""Writing a snapshot: plan -> engines write files -> manifest -> commit.

The planner (planner/assign.py) slices the snapshot's extents into files; each
root's engine writes its files durably (files on different roots in parallel);
the manifest records every chunk's crc32c; the commit protocol (format/commit.py)
makes the step visible atomically.

``write_and_commit`` is the one entry point that turns a Snapshot into a committed step.
The bytes come straight from the snapshot's extents (live) or through a host snapshot pool
(pool.py), copied piece by piece while the files are written. Either way a
``Release`` (handle.py) says when the saved tensors' own memory is no longer needed, which
is when training may change them again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from operator import attrgetter, is_

import numpy as np

from ..cuda import streams
from ..engines.base import IOEngine, WriteSpan
from ..format.commit import CommitProtocol, PendingCommit
from ..errors import CheckpointError
from ..format.manifest import EncodedStorages, FileRecord, Manifest, SavedTensors, StorageTableTemplate
from .._log import log_once
from ..planner.assign import FileTarget, PlannedChunk, SavePlan
from ..threads import gc_paused, run_per_file
from .handle import Release
from .snapshot import Snapshot
from .pool import ChunkCrcs, HostSnapshotPool


def file_targets(n_roots: int, files_per_root: int) -> list[FileTarget]:
    return [FileTarget(r, f"data-r{r}-f{k}.bin") for r in range(n_roots) for k in range(files_per_root)]


def write_and_commit(snap: Snapshot, protocol: CommitProtocol, engines: Sequence[IOEngine], *, plan: SavePlan,
                     release: Release, pool: HostSnapshotPool | None = None) -> None:
    """Write ``snap`` as step ``snap.step`` under ``protocol``'s roots and commit it (its
    manifest is on disk: peek_manifest reads it).

    ``pool``: copy the bytes through this host snapshot pool (mode "host"; only with engines
    that honour span guards, else live); None: the engines read the extents themselves
    (mode "live", CUDA extents on side streams behind ``snap.ready``). ``release`` is set
    when the extents' memory is no longer needed, or the save failed. ``plan``: which bytes go
    to which file (the checkpointer's: the topology planner's GPU-local plan when the state is
    on GPUs, else plan_save's balanced one)."""
    try:
        pending: PendingCommit = protocol.begin(snap.step)
    except BaseException as e:
        release.set(error=e)
        raise
    try:
        written_by: dict[int, str] = {}
        crcs = write_snapshot_files(snap, plan, pending, engines, pool=pool, release=release, written_by=written_by)
        with gc_paused():  # a record per chunk and per storage, no cycles (see gc_paused)
            manifest_bytes = _manifest(snap, plan, crcs, written_by)
        pending.commit(manifest_bytes)
    except BaseException as e:
        release.set(error=e)
        if not pending.finished:
            pending.abort()
        raise


def _manifest(snap: Snapshot, plan: SavePlan, crcs: Mapping[PlannedChunk, int], written_by: dict[int, str]) -> bytes:
    """The manifest of ``snap`` written by ``plan`` (each chunk's crc32c in ``crcs``), as bytes.
    Its storage table is the last save's template, filled, where the layout is the same
    (_StorageLayout), else a new template made from the chunks' columns; its tensor table is
    the snapshot's columns (SavedTensors): no record per chunk, storage or tensor."""
    global _last_storages
    files = tuple(FileRecord(f.target.root, f.target.name, f.size,
                             {"engine": written_by[fid],
                              **({"gpu": f.gpu} if f.gpu is not None else {})})
                  for fid, f in enumerate(plan.files))
    sizes = snap.extent_sizes()
    chunks, values = _chunks_and_crcs(crcs)
    last = _last_storages
    encoded = last.fill(plan, sizes, chunks, values) if last is not None else None
    if encoded is None:
        last = _last_storages = _StorageLayout.of(snap.step, plan, sizes, chunks)
        encoded = last.fill(plan, sizes, chunks, values)
    records = snap.records
    # storages=(): the encoded table stands for them (Manifest.to_json_bytes)
    manifest = Manifest(step=snap.step, files=files, storages=(),
                        tensors=records if isinstance(records, SavedTensors) else tuple(records),
                        state=snap.tree, created_unix=time.time(), metadata=snap.metadata)
    return manifest.to_json_bytes(storages=encoded, encoded_state=True)


def _chunks_and_crcs(crcs: Mapping[PlannedChunk, int]) -> tuple[list[PlannedChunk], list[int]]:
    """The chunks written and their crc32c, in the same order (the host pool's ChunkCrcs holds
    both lists: no look-up by chunk)."""
    if isinstance(crcs, ChunkCrcs):
        return crcs.chunks, crcs.crcs
    return list(crcs), list(crcs.values())


class _StorageLayout:
    """The storage table of the last save (module-wide, as format/manifest.py keeps the last
    tensor table) as a StorageTableTemplate, for the saves of the same layout: the same plan
    (object), storage sizes and chunks (the same objects, in the same order: the plan's own,
    or the host pool's, reused with its layout). ``order``: per chunk in table order, its
    position among the chunks written (None: the same order)."""

    __slots__ = ("chunks", "order", "plan", "sizes", "template")

    def __init__(self, plan: SavePlan, sizes: list[int], chunks: list, order: list[int] | None,
                 template: StorageTableTemplate) -> None:
        self.plan, self.sizes, self.chunks, self.order, self.template = plan, sizes, chunks, order, template

    @classmethod
    def of(cls, step: int, plan: SavePlan, sizes: list[int], chunks: list[PlannedChunk]) -> _StorageLayout:
        """The layout of a save that writes ``chunks`` (of storages of ``sizes`` bytes), from
        their columns in numpy: the table lists each storage's chunks by storage offset, storage
        by storage (the order they are written in, mostly: then no sort). Raises CheckpointError
        (nothing is committed) where the chunks do not tile every storage exactly."""
        m = len(chunks)
        sid, so, ln, fid, fo = (np.fromiter(map(get, chunks), dtype=np.int64, count=m) for get in _CHUNK_FIELDS)
        order = None
        if m > 1 and not ((sid[1:] > sid[:-1]) | ((sid[1:] == sid[:-1]) & (so[1:] > so[:-1]))).all():
            order = np.lexsort((so, sid))  # stable: as sorting each storage's chunks by offset
            sid, so, ln, fid, fo = sid[order], so[order], ln[order], fid[order], fo[order]
        counts = np.bincount(sid, minlength=len(sizes)) if m else np.zeros(len(sizes), dtype=np.int64)
        _check_tiling(step, sizes, sid, so, ln, counts)
        template = StorageTableTemplate.of_columns(sizes, counts, fid, fo, so, ln)
        return cls(plan, sizes, list(chunks), None if order is None else order.tolist(), template)  # (a copy: kept)

    def fill(self, plan: SavePlan, sizes: list[int], chunks: list[PlannedChunk],
             crcs: list[int]) -> EncodedStorages | None:
        """The storage table with ``crcs`` (of ``chunks``), if this save has the layout kept; else None."""
        kept = self.chunks
        if plan is not self.plan or sizes != self.sizes or len(chunks) != len(kept) or not all(map(is_, chunks, kept)):
            return None
        return self.template.fill(crcs if self.order is None else list(map(crcs.__getitem__, self.order)))


_last_storages: _StorageLayout | None = None


def _check_tiling(step: int, sizes: list[int], sid: np.ndarray, so: np.ndarray, ln: np.ndarray,
                  counts: np.ndarray) -> None:
    """Each storage's chunks (``sid``, ``so``, ``ln`` in table order, ``counts`` per storage)
    follow each other from its byte 0 to its end (what a reader checks): else CheckpointError."""
    n = len(sizes)
    ends = np.cumsum(ln)
    first = np.cumsum(counts) - counts
    covered = np.concatenate(([0], ends))
    base = covered[first]
    ok = len(counts) == n and (covered[first + counts] - base == np.array(sizes, dtype=np.int64)).all()
    if ok and len(sid):
        ok = bool((so == covered[:-1] - base[sid]).all())
    if not ok:
        raise CheckpointError(f"step {step} is not saved: the save plan's chunks do not cover each storage exactly "
                              f"once (a gdswriter bug: please report it); nothing was committed")


_CHUNK_FIELDS = tuple(map(attrgetter, ("storage", "storage_offset", "length", "file", "file_offset")))


def write_snapshot_files(snap: Snapshot, plan: SavePlan, pending: PendingCommit, engines: Sequence[IOEngine], *,
                         pool: HostSnapshotPool | None = None, release: Release,
                         written_by: dict[int, str]) -> Mapping[PlannedChunk, int]:
    """Write the files of ``plan`` (over ``snap``'s extents) into the pending step: through
    ``pool`` (host mode) or from the extents themselves (live mode), setting ``release`` once
    their memory is free. Returns each chunk's crc32c; ``written_by`` gets each file's engine."""
    if pool is not None and not all(e.honours_span_guards for e in engines):
        names = ", ".join(sorted({e.name for e in engines if not e.honours_span_guards}))
        log_once(f"no-guards:{names}", f"gdswriter: engine {names} cannot write from a host snapshot while it "
                                       f"is copied; writing from live memory (the optimizer step waits for the "
                                       f"write)")
        pool = None
    release.mode = "live" if pool is None else "host"
    if pool is None:
        crcs = write_files(plan, live_spans(snap, plan), pending, engines, written_by,
                           lambda: streams.on_side_streams(snap.ready))
        release.set()
        return crcs
    with pool.stream(snap, plan, release) as stream:
        write_files(plan, stream.spans, pending, engines, written_by, abort=stream.stop)
    return stream.chunk_crcs()


def live_spans(snap: Snapshot, plan: SavePlan) -> list[list[tuple[PlannedChunk, WriteSpan]]]:
    """Per file of ``plan``, its chunks with spans that view the snapshot's own extents."""
    return [[(c, WriteSpan(c.file_offset, snap.extents[c.storage].flat[c.storage_offset:c.storage_offset + c.length]))
             for c in fp.chunks] for fp in plan.files]


def write_files(plan: SavePlan, spans: Sequence[Sequence[tuple[Hashable, WriteSpan]]], pending: PendingCommit,
                engines: Sequence[IOEngine], written_by: dict[int, str],
                context: Callable[[], AbstractContextManager] = nullcontext,
                abort: Callable[[BaseException], None] | None = None) -> dict[Hashable, int]:
    """Write every file of ``plan`` into the pending step; returns the crc32c the engines gave
    for each span, keyed by what ``spans`` pairs it with. ``spans[f]``: file f's spans, in file
    order, each with its key: the plan's chunk it writes (live), or the host pool's piece
    (whose chunks' checksums the pool keeps). ``context`` is entered around each root's
    writes, in that root's thread. ``written_by`` gets, per file, the engine that really
    wrote it (an engine may change paths from file to file).
    ``abort`` (optional) gets a root's error at once, in that root's thread: the other roots
    may wait for what the failed root would have made possible (the host pool's copier waits
    for the room its unwritten files hold), so their producer must give up now. Raises the
    first root's error (the cause) once every root's thread has ended."""
    # Keyed by the chunk itself: a zero-byte storage's empty chunk shares its file_offset
    # with the next chunk, so (file, file_offset) is not unique.
    crcs: dict[Hashable, int] = {}
    first: list[BaseException] = []  # the roots' errors, in the order they happened
    first_lock = threading.Lock()

    def write_root(r: int) -> None:
        try:
            with context():
                for fid in by_root[r]:
                    fp = plan.files[fid]
                    got = engines[r].write_file(pending.dirs[r] / fp.target.name, [s for _, s in spans[fid]],
                                                size=fp.size)
                    crcs.update(zip((c for c, _ in spans[fid]), got))
                    written_by[fid] = engines[r].info.name
        except BaseException as e:  # kept, not raised: every root's thread must end first
            with first_lock:
                first.append(e)
            if abort is not None:
                abort(e)

    # Files on different roots (SSDs) are written in parallel; files sharing a root take turns.
    # Every root's thread has ended when run_per_file returns: they write into the pending step,
    # which the caller aborts on an error.
    by_root: dict[int, list[int]] = {}
    for fid, f in enumerate(plan.files):
        by_root.setdefault(f.target.root, []).append(fid)
    run_per_file(write_root, sorted(by_root), len(by_root))
    if first:
        raise first[0]
    return crcs
