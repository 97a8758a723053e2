"""Copies of DCP steps on peer nodes (GDSStorageWriter with DistOptions(replicas=C); format.md 9.5).

A DCP step stays one format 1.2 manifest. **Save**: at the writer's first save every rank opens
a replication channel of its own and places the copies (replicate.py ``plan_peers``, as
GDSCheckpointer does). Every rank that reached write_data hands its files (its RankReport: data
files, chunks and their crc32c) to a Replicator (replicate.py ``SourcedJob``); the coordinator
hands its own in finish(), with whether the step committed and the committed manifest's bytes.
On the replication thread rank 0 first tells every rank whether the step committed (a broadcast
on that channel: the other ranks learn of the commit nowhere else); then the step is streamed,
written and marked exactly as a GDSCheckpointer step: ``step_S/copies/rank<R>/`` on the peers'
first roots, ``copies/manifest.json`` beside rank 0's copy, ``step_S/protected`` last.

**Load** (``place_files``): the copies are found, not recorded (the manifest is committed
before them): every rank lists the files on its roots and the copies there, one all_gather;
where some copy exists, every place of every file (its own root, each copy) is checked against
the manifest's chunk crc32c by the rank reaching it, and each file is read from its own root when
that is good, else from the first good copy (a warning names the file and why); none good:
StepFilesLostError (all missing) or CorruptCheckpointError (some damaged), on every rank."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import crc32c as _crc32c

from ..errors import CorruptCheckpointError, InvalidOptionError, ReplicationError, StepFilesLostError
from ..format.commit import ROOT_MARKER_NAME, step_dir_name
from ..format.manifest import MANIFEST_NAME, ChunkRecord, FileRecord, Manifest
from ..format.replicas import COPIES_DIR
from .dcp_messages import RankReport
from .group import Coordinator, describe
from .options import DistOptions
from .replicastream import Source
from .replicate import ReplicaPeers, Replicator, SourcedJob, plan_peers
from .roots import RootLayout

log = logging.getLogger("gdswriter")

READ_BYTES = 8 << 20  # a verification's reads


@dataclass(frozen=True)
class FirstRoot:
    """What plan_peers reads of a layout: this rank's first root's id (the writer places the
    copies at set_up, before its layout is decided)."""

    local_ids: tuple[str, ...]


@dataclass(frozen=True)
class Committed:
    """Rank 0's word on a save, sent to every rank before its replication."""

    step: int
    token: str
    committed: bool
    manifest: bytes | None = None  # the committed manifest (rank 0 only)


class DcpReplication:
    """A GDSStorageWriter's copies: its channel, its peers, its Replicator (made at the first
    submit; pointed at each save's layout, the writer's session may change between saves)."""

    def __init__(self, channel: Coordinator, peers: ReplicaPeers):
        self.channel, self.peers = channel, peers
        self.replicator: Replicator | None = None

    @classmethod
    def open(cls, process_group: Any, options: DistOptions, root_id: str) -> DcpReplication:
        """Collective, every rank at set_up of the writer's first save: the channel and the placement."""
        channel = Coordinator.create(process_group, timeout_s=options.timeout_s,
                                     label=f"GDSStorageWriter(replicas={options.replicas})")
        try:
            peers = plan_peers(channel, FirstRoot((root_id,)), options.replicas,  # type: ignore[arg-type]
                               options.failure_domains)
        except BaseException:
            channel.close()
            raise
        return cls(channel, peers)

    def submit(self, layout: RootLayout, word: Committed, report: RankReport | None,
               error: BaseException | None) -> None:
        """Hand a save that reached write_data to the replication thread (every rank, every such
        save, in order): ``word`` is rank 0's (the others' is a placeholder, replaced by rank 0's
        broadcast), ``report`` this rank's files (None with ``error``: its write failed)."""
        rep = self.replicator
        if rep is None:
            rep = self.replicator = Replicator(self.channel, layout, self.peers)
        elif rep.layout is not layout:
            rep.wait()
            rep.layout = layout
        rank = self.channel.rank

        def sources(channel: Coordinator) -> tuple[list[Source], BaseException | None]:
            said = channel.broadcast({"step": word.step, "token": word.token, "committed": word.committed}
                                     if rank == 0 else None, f"replicating DCP step {word.step} "
                                     f"(committed?)", src=0)
            if (said["step"], said["token"]) != (word.step, word.token):
                return [], ReplicationError(f"rank 0 replicates step {said['step']} (save {said['token']}), this rank "
                                            f"step {word.step} (save {word.token}): internal, report it", word.step)
            if not said["committed"]:
                return [], ReplicationError(f"step {word.step} was not committed: nothing to protect", word.step)
            if error is not None or report is None:
                return [], error or ReplicationError("no report", word.step)
            return rank_sources(layout, report, word.manifest), None

        rep.submit(SourcedJob(word.step, rank == 0, sources))

    def wait(self, timeout: float | None = None) -> bool:
        return True if self.replicator is None else self.replicator.wait(timeout)

    def take_error(self) -> ReplicationError | None:
        return None if self.replicator is None else self.replicator.take_error()

    @property
    def protected(self) -> int | None:
        return None if self.replicator is None else self.replicator.protected

    def close(self) -> None:
        """Wait for the replications submitted, then give the channel back."""
        if self.replicator is not None:
            self.replicator.close()
        else:
            self.channel.close()


def rank_sources(layout: RootLayout, report: RankReport, manifest: bytes | None) -> list[Source]:
    """This rank's files of a committed DCP step as replication sources (every chunk's crc32c
    checked as it streams), and on rank 0 the committed manifest."""
    d = step_dir_name(report.step)
    out = []
    for fid, (g, name, size, *_) in enumerate(report.files):
        local = layout.local_of(g)
        if local is None:
            raise CorruptCheckpointError(f"step {report.step}: this rank's data file {name} is on a root it does "
                                         f"not see (internal: report it)")
        chunks = tuple(ChunkRecord(fid, c.file_offset, c.item_offset, c.length, c.crc)
                       for c in report.chunks if c.file == fid)
        out.append(Source("data", name, size, path=layout.local_paths[local] / d / name, chunks=chunks))
    if manifest is not None:
        out.append(Source("global", MANIFEST_NAME, len(manifest), data=manifest))
    return out


# ---------------------------------------------------------------------------------------------
# loading


def _file_problem(path: Path, f: FileRecord, chunks: Sequence[ChunkRecord]) -> str | None:
    """Why the file at ``path`` is not ``f`` with ``chunks`` (size, every chunk's crc32c), or None."""
    try:
        st = os.stat(path)
        if st.st_size != f.size:
            return f"{path}: {st.st_size} bytes, the manifest records {f.size}"
        with open(path, "rb", buffering=0) as fh:
            for c in sorted(chunks, key=lambda c: c.file_offset):
                fh.seek(c.file_offset)
                crc, left = 0, c.length
                while left:
                    data = fh.read(min(left, READ_BYTES))
                    if not data:
                        return f"{path}: short read at {c.file_offset}"
                    crc, left = _crc32c.crc32c(data, crc), left - len(data)
                if crc != c.crc32c:
                    return f"{path}: the chunk at offset {c.file_offset} fails its crc32c (damaged)"
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as e:
        return f"{path}: {describe(e)}"
    return None


def _copy_names(step_dir: Path) -> dict[str, list[str]]:
    """{copy directory: its file names} under ``step_dir/copies``."""
    base = step_dir / COPIES_DIR
    try:
        dirs = sorted(p for p in base.iterdir() if p.is_dir() and p.name.startswith("rank"))
    except OSError:
        return {}
    return {p.name: sorted(q.name for q in p.iterdir() if q.is_file()) for p in dirs}


def _checked_places(m: Manifest, mine: dict[int, Path], copies: dict[int, dict[str, list[str]]]) -> dict:
    """{"own": [[fid, problem], ...], "copies": [[g, dir, fid, problem], ...]}: the places this rank checks."""
    by_name = {f.path: i for i, f in enumerate(m.files)}
    chunks: dict[int, list[ChunkRecord]] = {}
    for s in m.storages:
        for c in s.chunks:
            chunks.setdefault(c.file, []).append(c)
    d = step_dir_name(m.step)
    own = [[i, _file_problem(mine[f.root] / d / f.path, f, chunks.get(i, ()))]
           for i, f in enumerate(m.files) if f.root in mine]
    out = []
    for g, dirs in copies.items():
        for name, files in dirs.items():
            for fn in files:
                i = by_name.get(fn)
                if i is not None:
                    path = mine[g] / d / COPIES_DIR / name / fn
                    out.append([g, name, i, _file_problem(path, m.files[i], chunks.get(i, ()))])
    return {"own": own, "copies": out}


def held_paths(m: Manifest, reach: Sequence[Path | None]) -> tuple[Path | None, ...]:
    """``reach`` without the roots this rank matched by path alone (its root has no
    ``.gdswriter-root`` while the manifest recorded an id) that hold none of the step: a wiped or
    replaced node's disk, mounted at the path another node's root has (the same path on every
    node): this rank does not hold that root."""
    if m.dist is None:
        return tuple(reach)
    d = step_dir_name(m.step)
    return tuple(None if p is not None and not info.id.startswith("path:") and not (p / ROOT_MARKER_NAME).exists()
                 and not (p / d).exists() else p for info, p in zip(m.dist.roots, reach))


def _unreached(m: Manifest, reached: set[int]) -> None:
    """StepFilesLostError when a root holding some of step ``m``'s files is reached by no rank."""
    lost = sorted({f.root for f in m.files} - reached)
    if lost and m.dist is not None:
        info = m.dist.roots[lost[0]]
        raise StepFilesLostError(f"step {m.step}: root {info.path} (table root {lost[0]}, id {info.id}, ranks "
                                 f"{list(info.ranks)}) holds none of it any more on any rank of this job (a wiped or "
                                 f"replaced node's disk?), and no copy of its files is on a peer node. Restore that "
                                 f"disk, or load a step saved elsewhere (for DCP steps that survive a lost node, save "
                                 f"with GDSStorageWriter(..., dist_options=DistOptions(replicas=2)))")


def place_files(coord: Coordinator, m: Manifest, reach: Sequence[Path | None], what: str) -> Manifest:
    """Collective (module docstring): ``m`` with each file whose own root lost or damaged it
    pointed at a verified copy (``copies/rank<R>/<name>`` on the copy's table root); ``m``
    itself where the step has no copies (StepFilesLostError where a root of it is reached by no
    rank: held_paths). Raises alike on every rank when some file has no good place."""
    if m.dist is None:
        return m
    d = step_dir_name(m.step)
    reached = {g: p for g, p in enumerate(reach) if p is not None}
    some = any((p / d / COPIES_DIR).is_dir() for p in reached.values())
    every = coord.all_gather([some, sorted(reached)], f"{what} (finding copies)")
    if not any(n for n, _ in every):
        _unreached(m, {g for _, gs in every for g in gs})
        return m
    checker: dict[int, int] = {}  # each root checked by the lowest rank of this job reaching it
    for r, (_, gs) in enumerate(every):
        for g in gs:
            checker.setdefault(g, r)
    mine = {g: p for g, p in reached.items() if checker[g] == coord.rank}
    listed = {g: _copy_names(p / d) for g, p in mine.items()}
    checked, error = {}, None
    try:
        checked = _checked_places(m, mine, listed)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (checking copies)", hint="nothing was loaded")
    views = coord.all_gather(checked, f"{what} (checked copies)")
    return _chosen(m, views)


def _chosen(m: Manifest, views: Sequence[dict]) -> Manifest:
    """Every file from its own root when good there, else from its first good copy (same on every rank)."""
    own: dict[int, str | None] = {}
    good: dict[int, list[tuple[int, str]]] = {}
    bad: dict[int, list[str]] = {}
    for v in views:
        for i, problem in v["own"]:
            own[i] = problem
        for g, name, i, problem in v["copies"]:
            (good.setdefault(i, []).append((g, name)) if problem is None else bad.setdefault(i, []).append(problem))
    files, lost, damaged = list(m.files), [], False
    for i, f in enumerate(m.files):
        problem = own.get(i, f"root {f.root} of the step is on no rank of this job (a replaced node?)")
        if problem is None:
            continue
        damaged = damaged or "damaged" in problem or any("damaged" in b for b in bad.get(i, ()))
        if not good.get(i):
            lost.append(f"{f.path} ({'; '.join([problem, *bad.get(i, [])])})")
            continue
        g, name = sorted(good[i])[0]
        files[i] = replace(f, root=g, path=f"{COPIES_DIR}/{name}/{f.path}")
        log.warning("gdswriter: step %d: data file %s is not usable from its own root (%s); reading the verified "
                    "copy %s on table root %d instead", m.step, f.path, problem, files[i].path, g)
    if lost:
        cls = CorruptCheckpointError if damaged else StepFilesLostError
        raise cls(f"step {m.step}: {len(lost)} data file(s) have no good place left, neither their own root nor a "
                  f"copy on a peer node (first: {lost[0]}); load an older step, or restore those disks")
    return replace(m, files=tuple(files))


def check_replicas_supported(dist_options: DistOptions, single_process: bool) -> None:
    """GDSStorageWriter's copies need peers: refused in one process."""
    if dist_options.replicas > 1 and single_process:
        raise InvalidOptionError(f"DistOptions(replicas={dist_options.replicas}) with single_process=True: there "
                                 f"are no peer nodes to copy to; pass replicas=1, or save from every rank")
