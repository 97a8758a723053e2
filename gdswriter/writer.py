"""Writing a snapshot: plan -> engines -> manifest -> commit.

The planner (planner/assign.py) cuts the snapshot's extents into chunks per data file;
each root's engine writes its files durably (files on different roots in parallel);
the manifest records every chunk's crc32c; the commit protocol (format/commit.py)
makes the step visible atomically.
"""

from __future__ import annotations

import time
from typing import Sequence

from .engine import IOEngine, WriteSpan
from .format.commit import CommitProtocol, PendingCommit
from .format.manifest import ChunkRecord, FileRecord, Manifest, StorageRecord
from .planner.assign import FileTarget, PlannedChunk, SavePlan, plan_save
from .restore import run_per_file
from .snapshot import Snapshot


def file_targets(n_roots: int, files_per_root: int) -> list[FileTarget]:
    return [FileTarget(r, f"data-r{r}-f{k}.bin") for r in range(n_roots) for k in range(files_per_root)]


def write_and_commit(snap: Snapshot, protocol: CommitProtocol, engines: Sequence[IOEngine],
                     targets: Sequence[FileTarget]) -> Manifest:
    """Write ``snap`` as step ``snap.step`` under ``protocol``'s roots and commit it."""
    plan: SavePlan = plan_save([e.flat.numel() for e in snap.extents], targets)
    pending: PendingCommit = protocol.begin(snap.step)
    try:
        crcs = write_files(plan, snap, pending, engines)
        by_storage: dict[int, list[ChunkRecord]] = {}
        for c in sorted((c for f in plan.files for c in f.chunks), key=lambda c: (c.storage, c.storage_offset)):
            by_storage.setdefault(c.storage, []).append(
                ChunkRecord(c.file, c.file_offset, c.storage_offset, c.length, crcs[c]))
        storages = [StorageRecord(ext.flat.numel(), tuple(by_storage[sid])) for sid, ext in enumerate(snap.extents)]
        files = tuple(FileRecord(f.target.root, f.target.name, f.size, {"engine": engines[f.target.root].info.name})
                      for f in plan.files)
        manifest = Manifest(step=snap.step, files=files, storages=tuple(storages), tensors=tuple(snap.records),
                            state=snap.tree, created_unix=time.time(), metadata=snap.metadata)
        pending.commit(manifest.to_json_bytes())
    except BaseException:
        if not pending.finished:
            pending.abort()
        raise
    return manifest


def write_files(plan: SavePlan, snap: Snapshot, pending: PendingCommit,
                engines: Sequence[IOEngine]) -> dict[PlannedChunk, int]:
    """Write every file of ``plan`` into the pending step; returns each chunk's crc32c."""
    # Keyed by the chunk itself: a zero-byte storage's empty chunk shares its file_offset
    # with the next chunk, so (file, file_offset) is not unique.
    crcs: dict[PlannedChunk, int] = {}

    def write_one(fid: int) -> None:
        fp = plan.files[fid]
        spans = [WriteSpan(c.file_offset, snap.extents[c.storage].flat[c.storage_offset:c.storage_offset + c.length])
                 for c in fp.chunks]
        got = engines[fp.target.root].write_file(pending.dirs[fp.target.root] / fp.target.name, spans, size=fp.size)
        for c, crc in zip(fp.chunks, got):
            crcs[c] = crc

    # Files on different roots (SSDs) are written in parallel; files sharing a root take turns.
    by_root: dict[int, list[int]] = {}
    for fid, f in enumerate(plan.files):
        by_root.setdefault(f.target.root, []).append(fid)
    run_per_file(lambda r: [write_one(fid) for fid in by_root[r]], sorted(by_root), len(by_root))
    return crcs
