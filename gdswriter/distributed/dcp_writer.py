"""GDSStorageWriter: DCP's save on gdswriter's engine, format and commit protocol (see dcp.py)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..engines.base import IOEngine
from ..engines.select import create_engine
from ..errors import CheckpointExistsError, EngineIOError, GDSWriterError, InvalidOptionError
from ..format.assembly import record_json
from ..format.commit import RootLock
from ..format.commit import step_dir_name
from ..format.manifest import MANIFEST_NAME
from ..fs import atomic_write, read_regular_file
from ..options import CheckpointOptions
from ..planner.assign import plan_save
from ..save.snapshot import Extent, Snapshot
from ..save.writer import live_spans, write_files
from .commit import OrderedCommit, clean_resaved, saves_beside
from .dcp_messages import (
    ChunkEntry,
    Decision,
    GlobalPlanData,
    HeldChunk,
    KeepBeside,
    LocalPlanData,
    RankReport,
    RootsOffer,
    keep_wire,
)
from .dcp_drain import DcpDrain
from .dcp_replicas import DcpReplication, Word, check_replicas_supported
from .dcp_paths import MARKER_NAME, Collective, is_gdswriter_marker, local_path_ok, marker_bytes, step_in_name
from .dcp_writer_parts import (
    REPORT_FQN,
    Place,
    SaveInProgress,
    Source,
    check_fs_options,
    checked_reports,
    chunk_key,
    dcp_manifest,
    flat_bytes,
    item_record,
    live_beside,
    plan_items,
)
from .options import DistOptions
from .rankfiles import file_entries, rank_targets
from .opening import Opening, decide_roots, lock_checked, offer_roots, relock, take_roots
from .roots import clean_led
from .session import DistSession

log = logging.getLogger("gdswriter")

class GDSStorageWriter(Collective, StorageWriter):
    """A DCP StorageWriter. ``root``: this rank's root or list of roots (the first the primary on
    rank 0, as for GDSCheckpointer), or None when every save passes checkpoint_id=PATH (see the
    module docstring for what a checkpoint_id names). ``step``: the step to store under ``root``
    (None: the step after the latest). ``overwrite``: whether a save may replace a checkpoint
    already there (False: CheckpointExistsError). ``process_group``: the group DCP saves with
    (default: the default group; torchtitan passes its own gloo group to async_save: pass it here
    too); ``single_process=True`` for dcp.save(no_dist=True) in a distributed job.

    FileSystemWriter's other options are taken so that code written for it runs unchanged, and
    each says here what gdswriter does instead (a value other than FileSystemWriter's default is
    logged once, as a warning): ``sync_files`` (gdswriter always fdatasyncs every file before the commit: that
    is its crash safety, so False is not honoured), ``thread_count`` (gdswriter writes each root
    from one thread through io_uring with ``EngineOptions.queue_depth`` requests in flight),
    ``per_thread_copy_ahead`` (staging goes through ``EngineOptions.buffer_bytes`` x ``num_buffers``
    page-locked buffers), ``single_file_per_rank`` (each rank writes ``CheckpointOptions.
    files_per_root`` files per root). Refused, with the reason: ``cache_staged_state_dict=True``
    (this writer is no AsyncStager: give dcp.async_save an ``async_stager``), ``_extensions``
    (gdswriter stores raw bytes with crc32c, no stream transforms such as compression) and a
    ``serialization_format`` other than TORCH_SAVE (gdswriter has its own format; ``gdswriter
    export --to safetensors`` converts a step).

    ``DistOptions(replicas=C)``, C > 1: after each commit the step is copied to C - 1 peer nodes
    in the background and marked protected (dcp_replicas.py; ``wait_protected``); GDSStorageReader
    reads a lost or damaged file from a verified copy. ``DistOptions(parity_group=G)``: instead
    of copies, each lane of G nodes gets one XOR parity block per member ((G + 1) / G the bytes,
    format.md 11.1; the same ``wait_protected``); GDSStorageReader rebuilds a lost or damaged
    member's files from the rest of its lane, every chunk checked against its crc32c
    (parityload.py), and two lost in one lane is a typed error on every rank.
    ``CheckpointOptions(drain_root=...)``: committed steps are drained to a shared root in the
    background (dcp_drain.py; ``wait_drained``). In one process (single_process=True) copies
    and parity are refused (no peer node), never ignored."""

    def __init__(self, root: Any = None, step: int | None = None, *, options: CheckpointOptions | None = None,
                 dist_options: DistOptions | None = None, process_group: Any = None, single_process: bool = False,
                 overwrite: bool = True, sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, single_file_per_rank: bool = True,
                 cache_staged_state_dict: bool = False, _extensions: Sequence[Any] | None = None,
                 serialization_format: Any = SerializationFormat.TORCH_SAVE):
        check_fs_options(sync_files=sync_files, thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
                          single_file_per_rank=single_file_per_rank, cache_staged_state_dict=cache_staged_state_dict,
                          extensions=_extensions, serialization_format=serialization_format)
        if not isinstance(overwrite, bool):
            raise InvalidOptionError(f"overwrite={overwrite!r}: expected True or False")
        Collective.__init__(self, root, step, process_group, single_process, dist_options)
        self.options = options or CheckpointOptions()
        check_replicas_supported(self.dist_options, single_process)
        self._replication: DcpReplication | None = None  # replicas > 1: opened at the first save (dcp_replicas.py)
        self._unanswered = False  # a save set up whose write_data did not hand its part to the replication yet
        self._pending: tuple | None = None  # the coordinator: (layout, report, error) of the save awaiting finish
        self._word: Word | None = None  # the coordinator, replicas > 1: its word on the save awaiting finish
        self._drain = (DcpDrain(self.options, self.dist_options.timeout_s)  # dcp_drain.py
                       if self.options.drain_root is not None else None)
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex
        self._session: DistSession | None = None  # the opened roots, kept from save to save (their locks are not)
        self._session_roots: list[Path] | None = None  # the roots it was opened for
        self._wrote = False  # this save reached write_data (DCP's plans went out): its session may be kept
        self._opening: Opening | None = None  # this save opens the roots: what set_up found on them (with rank 0's lock)
        self._items: dict[str, Any] = {}   # chunk key -> this rank's WriteItem
        self._save: SaveInProgress | None = None  # commit, table, token and items of the save in progress
        self._engines: list[IOEngine] | None = None  # one per local root, kept from save to save
        self._beside: set[tuple[str, int]] = set()  # (root id, step): files of several saves in a step (OrderedCommit)
        self._formers: list[DistSession] | None = []  # sessions of roots left for others, owed a cleaning (_lock_formers)
        self._former_lock: RootLock | None = None  # another rank than 0: its former roots it cleans this save
        self._former_paths: set[Path] | None = set()  # those roots

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for what reset() takes: a local path whose nearest existing ancestor is a writable
        directory (as FileSystemWriter answers), or a step number; False for URLs and the rest."""
        return local_path_ok(checkpoint_id, must_exist=False)

    # -- DCP calls, in order -----------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the next save at ``checkpoint_id`` (a path or a step; None: the same as before)."""
        self._end_save()
        self._target(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Local: take the roots the last save opened (their locks, their identities checked), or
        prepare to open them (opening.offer_roots: what the coordinator needs travels in this rank's
        local plan, the table and the primary come back in its global plan: DCP's own gather and
        scatter carry opening.py's round). A session is kept only from a save that reached
        write_data: DCP's plans reached every rank then, so every rank decides the same."""
        kept = self._wrote
        self._end_save()
        self._answer_missed()
        self._wrote = False
        if kwargs.get("use_collectives", True) is False:
            raise InvalidOptionError("GDSStorageWriter commits one step for all ranks: dcp.save(use_collectives=False) "
                                     "(a metadata file per rank) is not supported; use FileSystemWriter for that")
        roots = self.current_roots()
        rank, _ = self.place()
        if "rank" in kwargs and kwargs["rank"] != rank:
            raise InvalidOptionError(f"DCP saves as rank {kwargs['rank']} but this writer's group has it as rank "
                                     f"{rank}: pass the same process_group (single_process=True for no_dist)")
        if bool(is_coordinator) != (rank == 0):
            raise InvalidOptionError(f"DCP's coordinator is {'' if is_coordinator else 'not '}rank {rank} of this "
                                     f"writer's group: GDSStorageWriter commits on rank 0; pass dcp.save the "
                                     f"writer's process_group")
        if self._session is not None and kept and self._session_roots == roots:
            self._session.lock = relock(self._session.layout)
            self._lock_formers(rank, set(self._session.layout.local_ids))
            self._open_replication(self._session.layout.local_ids[0])
            return
        if self._session is not None:  # roots left for others: a re-save's leftovers there go at this save
            self._formers = (self._formers or []) + [self._session]
        self._session = self._session_roots = None
        # opening.py's round: the offer travels in this rank's local plan, the decision is made in
        # prepare_global_plan, this rank's part comes back in its global plan (write_data)
        self._opening = offer_roots(roots, rank, whole=False)
        self._beside |= {(rid, step) for rid, r in zip(self._opening.ids, roots) for step in saves_beside(r)}
        self._lock_formers(rank, set(self._opening.ids))
        self._open_replication(self._opening.ids[0])

    def _open_replication(self, root_id: str) -> None:
        """replicas > 1 or parity_group: at the first save, every rank opens the replication
        channel and places the copies or the parity lanes (collective: every rank's set_up calls
        this at the same point)."""
        if (self.dist_options.replicas > 1 or self.dist_options.parity_group) and self._replication is None:
            self._replication = DcpReplication.open(self.process_group, self.dist_options, root_id)
        self._unanswered = self._replication is not None  # until this save's write_data hands its part over

    def _answer_missed(self) -> None:
        """A save set up on this rank whose write_data it never reached: its replication's first
        round still waits for this rank's answer on the others (dcp_replicas.py ``missed``)."""
        if self._unanswered and self._replication is not None:
            self._replication.missed(self._session.layout if self._session is not None else None)
        self._unanswered = False

    def wait_protected(self, timeout: float | None = None) -> int | None:
        """Wait for the copies or parity of the steps saved so far (replicas > 1, parity_group)
        and return the newest protected step (None: none yet, or no protection); ReplicationError
        once for a step whose protection failed (it stays committed, loadable where its own
        nodes are), or for a save not written on every rank."""
        if self._replication is None:
            return None
        self._replication.wait(timeout)
        error = self._replication.take_error()
        if error is not None:
            raise error
        return self._replication.protected

    def wait_drained(self, timeout: float | None = None) -> list[int]:
        """Wait for this rank's part of the drains submitted (CheckpointOptions(drain_root=...));
        the steps this rank committed at the drain root (the last rank to mark a step commits
        it). DrainError once for a step not drained (the drain root keeps its earlier steps)."""
        if self._drain is None:
            return []
        self._drain.wait(timeout)
        error = self._drain.take_error()
        if error is not None:
            raise error
        return list(self._drain.drained)

    def _replicate(self, layout: Any, step: int, token: str, report: RankReport | None, error: BaseException | None,
                   primary: bool = False) -> Word | None:
        """At write_data, this rank's part of the save to the replication (replicas > 1); the
        coordinator's Word, settled at its commit or when the save ends (dcp_replicas.py)."""
        if self._replication is None:
            return None
        self._unanswered = False
        word = Word(step, token) if primary else None
        self._replication.submit(layout, step, token, report, error, word)
        return word

    def _lock_formers(self, rank: int, current: set[str]) -> None:
        """Another rank than 0: lock the roots of earlier sessions (another checkpoint_id) where
        it wrote beside a committed step (``_beside``) and which this save's roots are not, so
        that it can remove there, in write_data, what the committed manifest no longer names
        (the coordinator sends the names: ``_formers_live``). Held until the save ends; a root
        it cannot lock now (another job's) is left for the next save. The coordinator never
        writes beside a step: it keeps its former sessions to read their manifests."""
        if rank == 0:
            return
        owed = {rid for rid, _ in self._beside} - current
        formers = [f for f in self._formers or [] if owed & set(f.layout.local_ids)]
        self._formers = formers
        paths = {f.layout.local_paths[i] for f in formers for i in f.layout.led
                 if f.layout.local_ids[i] in owed and not f.layout.is_primary(i)}
        if paths:
            try:
                self._former_lock, self._former_paths = RootLock(sorted(paths)), paths
            except (OSError, GDSWriterError) as e:
                log.info("gdswriter: the files an earlier re-save left beside a step under %s stay until a later "
                         "save (%s)", sorted(paths)[0], e)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Name this rank's tensor chunks, so that the global plan sees which ranks hold each."""
        self._items = {}
        held = []
        for wi in plan.items:
            if wi.type != WriteItemType.BYTE_IO:
                td = wi.tensor_data
                key = chunk_key(wi.index.fqn, td.chunk.offsets, td.chunk.sizes, td.properties.dtype)
                self._items[key] = wi
                n = 1
                for d in td.chunk.sizes:
                    n *= d
                held.append(HeldChunk(key, n * td.properties.dtype.itemsize))
        offer = self._opening.offer if self._opening is not None else None
        local = LocalPlanData(tuple(held), offer, tuple(sorted(self._beside)))
        return replace(plan, storage_data=local.to_wire())

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the roots if this save opens them (_session_for), decide the step and
        the token (checking ``overwrite`` under the root lock) and make the temporary directories
        it leads, then number every item: tensor chunks, split over the ranks holding them
        (planner/ranks.py), then BytesIO items, written whole by the rank DCP's deduplication
        gave them to. The decision (and each rank's part of the root table, and for a root's
        leader the names of the files to keep beside committed steps: live_beside) travels in
        each plan."""
        local = [LocalPlanData.from_wire(plan.storage_data) for plan in plans]
        session, parts = self._session_for([lp.offer for lp in local])
        items, pieces = plan_items(local, plans)
        decided = self._decide(session)
        beside = {(rid, step) for lp in local for rid, step in lp.beside}
        live = live_beside(session, beside)
        # the roots once led by others
        clean_resaved(session.layout, keep_wire(live.pop(session.rank, [])), keep=decided.token)
        self._beside = set()  # the coordinator never writes beside a step
        former = self._formers_live(session, beside)
        items_wire = [it.to_wire() for it in items]
        return [replace(plan, storage_data=GlobalPlanData(items, pieces[r], parts[r], tuple(live.get(r, ())),
                                                          tuple(former.get(r, ())), decided).to_wire(items_wire))
                for r, plan in enumerate(plans)]

    def _session_for(self, offers: list[RootsOffer | None]) -> tuple[DistSession, list[dict | None]]:
        """Coordinator: the session this save writes with (opened now when every rank offers its
        roots: opening.decide_roots, refused unless the primary is rank 0's; else the one kept from
        the last save) and each rank's part of the root table (None: nothing new)."""
        if all(o is None for o in offers):
            session, parts = self._session, [None] * len(offers)
        elif any(o is None for o in offers):
            raise GDSWriterError(f"dcp.save: ranks {[r for r, o in enumerate(offers) if o is not None][:8]} open "
                                 f"their roots afresh while the others keep theirs from an earlier save (a save "
                                 f"that failed on some ranks before write_data); nothing was written: save again, "
                                 f"and every rank opens them")
        else:
            own = self._opening
            assert own is not None
            decided = decide_roots(own, offers, movable_primary=False)  # type: ignore[arg-type]
            session = DistSession(Place(0, len(offers)), decided.layout, own.lock, self.dist_options)
            own.lock = None  # the session's now
            self._session, self._session_roots, self._opening = session, list(own.paths), None
            parts = [None] + list(decided.parts[1:])  # rank 0 holds the whole table
        if session is None:
            raise InvalidOptionError("prepare_global_plan before set_up_storage_writer: use this writer through "
                                     "dcp.save")
        return session, parts

    def _formers_live(self, session: DistSession, beside: set[tuple[str, int]]) -> dict[int, list[KeepBeside]]:
        """Coordinator: live_beside for the steps the ranks report files of several saves in on
        roots of this writer's earlier sessions (another checkpoint_id) that ``session`` does not
        have: the names their committed manifests list there, {leader: [KeepBeside, ...]}.
        An earlier session is kept while some rank reports such a step of its roots. Its primary
        is rank 0's: read here; the leaders hold their roots' locks since set_up (_lock_formers),
        so no save there can commit another manifest before they have cleaned."""
        current = {info.id for info in session.layout.table}
        out: dict[int, list[KeepBeside]] = {}
        kept = []
        done: set[str] = set()
        for former in self._formers or []:
            ids = {info.id for info in former.layout.table} - current - done
            mine = {(rid, step) for rid, step in beside if rid in ids}
            if not mine:
                continue
            kept.append(former)
            done |= ids
            try:
                for r, entries in live_beside(former, mine).items():
                    out.setdefault(r, []).extend(entries)
            except (OSError, GDSWriterError) as e:
                log.warning("gdswriter: the committed steps under %s could not be read (%s): the files of earlier "
                            "saves beside them stay", former.protocol.primary, e)
        self._formers = kept
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's pieces and make them durable (and publish the secondary roots only
        this rank sees); the last WriteResult carries its report to finish() (module docstring).
        When this save opens the roots, another rank than the coordinator first takes its layout
        from its plan and locks the roots it leads (_take_part)."""
        decided = GlobalPlanData.from_wire(plan.storage_data)
        self._wrote = True  # every rank that gets here holds the coordinator's layout for the next save
        if self._opening is not None and decided.layout is not None:
            self._take_part(decided)
        session = self._session
        if session is None:
            raise InvalidOptionError("write_data before set_up_storage_writer: use this writer through dcp.save")
        coordinates = session.rank == session.layout.primary_rank
        try:
            report = self._write_ordered(session, decided, plan, planner)
        except BaseException as e:
            if coordinates:
                self._pending = (session.layout, None, e)
            self._word = self._replicate(session.layout, decided.decision.step, decided.decision.token, None, e,
                                         primary=coordinates)
            raise
        if coordinates:
            self._pending = (session.layout, report, None)
        self._word = self._replicate(session.layout, decided.decision.step, decided.decision.token, report, None,
                                     primary=coordinates)
        if self._drain is not None and self._drain.wanted(report.step) and not coordinates:
            self._drain.submit(session.layout, report.step, report.token, report, None, session.layout.world_size)
        results = [WriteResult(index=wi.index, size_in_bytes=0, storage_data=None) for wi in plan.items]
        results.append(WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=report.nbytes,
                                   storage_data=report.to_wire()))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: check every rank's report, build the manifest (DCP's metadata as JSON in
        it), commit the step, then write the ``.metadata`` marker (so its presence means a
        committed checkpoint). Raises, committing nothing, if a report is missing or wrong."""
        if self._save is None:
            raise InvalidOptionError("finish before write_data: use this writer through dcp.save")
        try:
            rc = self._save.commit
            try:
                reports = checked_reports(results, rc.step, self._save.token, self._save.items or ())
                if isinstance(rc, OrderedCommit):  # every joint root published with all its ranks' files
                    rc.check_published([rep.to_wire() for rep in reports])
                manifest = dcp_manifest(rc.step, self._save, reports, metadata)
            except BaseException:
                rc.abort()  # nothing was renamed on this rank's roots yet (OrderedCommit) or only secondaries
                raise
            if isinstance(rc, OrderedCommit):
                rc.commit_ordered(manifest)
            else:
                rc.commit_manifest(manifest)
            self._replicate_committed(rc)
            rc.move_latest()
            marker = rc.layout.local_paths[0] / MARKER_NAME
            if not is_gdswriter_marker(marker):
                try:
                    atomic_write(marker, marker_bytes())
                except OSError as e:
                    raise EngineIOError(e.errno or errno.EIO, str(marker), 0, f"writing the {MARKER_NAME} marker",
                                        f"step {rc.step} is committed, but tools that look for that file "
                                        f"(torchtitan's resume) will not see it; gdswriter's reader will") from e
        finally:
            self._end_save()  # not committed: it tells the peers (their replication waits for rank 0's word)

    def _replicate_committed(self, rc: OrderedCommit) -> None:
        """The coordinator, at the commit: its files and the committed manifest to the replication
        and the drain (the draft: dcp_drain.py)."""
        pending, self._pending = self._pending, None
        if pending is None or (self._replication is None and self._drain is None):
            return
        layout, report, error = pending
        manifest = None
        try:
            manifest = read_regular_file(rc.layout.local_paths[0] / step_dir_name(rc.step) / MANIFEST_NAME, 1 << 30)
        except (OSError, GDSWriterError) as e:
            error = error or e
        if self._word is not None:
            self._word.settle(True, manifest, error)
        if self._drain is not None and self._drain.wanted(rc.step):
            if manifest is None:
                log.warning("gdswriter: step %d is committed but not drained: its manifest could not be read (%s)",
                            rc.step, error)
            else:
                if report is not None:
                    self._drain.submit(layout, rc.step, rc.token, report, None, layout.world_size)
                self._drain.submit(layout, rc.step, rc.token, None, manifest, layout.world_size)

    # -- internals -----------------------------------------------------------
    def _take_part(self, decided: GlobalPlanData) -> None:
        """Another rank than the coordinator, in write_data: its layout from its part of the table
        (opening.take_roots; kept as its session from now on, whatever follows), then the roots it
        leads locked and checked (opening.lock_checked)."""
        opening = self._opening
        assert opening is not None
        self._opening = None
        rank, world = self.place()
        layout = take_roots(opening, rank, world, decided.layout or {})
        session = DistSession(Place(rank, world), layout, None, self.dist_options)
        session._learn(list(decided.decision.clean), decided.decision.latest)
        self._session, self._session_roots = session, list(opening.paths)
        session.lock = lock_checked(layout, opening)

    def _decide(self, session: DistSession) -> Decision:
        """Coordinator: the step, the token and the committed steps each root's leader cleans
        with (the coordinator its own here); the temporary directories it leads are made here,
        before DCP scatters the plans."""
        path_mode = self._path_roots is not None
        named = self._override if self._override is not None else self.step
        steps = session.protocol.committed_steps()
        if path_mode:
            step = step_in_name(self._path_roots[0])
        else:
            step = named if named is not None else (steps[-1] + 1 if steps else 0)
        marker = session.layout.local_paths[0] / MARKER_NAME
        if named is not None and not path_mode:
            there = f"step {step} under {session.layout.local_paths[0]}" if step in steps else None
        elif steps or marker.exists():
            there = (f"{session.layout.local_paths[0]} (steps {steps})" if steps else
                     f"{session.layout.local_paths[0]} (its {MARKER_NAME})")
        else:
            there = None
        if there is not None and not self.overwrite:
            raise CheckpointExistsError(f"Checkpoint already exists and overwrite=False: {there}. Save to another "
                                        f"checkpoint_id/step, delete the old one, or pass "
                                        f"GDSStorageWriter(overwrite=True) to replace it")
        if there is not None and step in steps:
            log.warning("gdswriter: replacing the checkpoint in %s (overwrite=True; "
                        "GDSStorageWriter(overwrite=False) refuses instead)", there)
        token = secrets.token_hex(4)
        clean_led(session.layout, steps)
        rc = OrderedCommit(session.coord, session.layout, step, token)
        rc.make_dirs()
        self._save = SaveInProgress(rc, session.layout.table, token)
        return Decision(step, token, tuple(steps), session.protocol.latest())

    def _write_ordered(self, session: DistSession, plan_data: GlobalPlanData, plan: SavePlan,
                       planner: SavePlanner) -> RankReport:
        decided = plan_data.decision
        owed: set[tuple[str, int]] = set()  # files beside steps of earlier sessions' roots, not cleaned yet
        if session.rank == session.layout.primary_rank:
            assert self._save is not None and self._save.token == decided.token
            rc = self._save.commit
        else:
            # another rank sharing a joint root may have made this save's directory there already
            # (or written beside a committed step): kept
            clean_led(session.layout, list(decided.clean), keep=decided.token)
            clean_resaved(session.layout, keep_wire(plan_data.live), keep=decided.token)
            owed = self._clean_formers(plan_data.former, decided.token, set(session.layout.local_ids))
            rc = OrderedCommit(session.coord, session.layout, decided.step, decided.token,
                               resaving=decided.step in decided.clean)
            mine = {(session.layout.local_ids[i], rc.step) for i in rc.in_place}
            self._beside |= mine  # until this save is through: what it may leave beside the step
            rc.make_dirs()
        try:
            rc.check_shared()
            report = self._write(plan_data, plan, planner, rc)
            if not rc.coordinates:  # the secondary roots it alone sees, and its joint roots (the last one publishes)
                report = dataclasses.replace(report, published=tuple(rc.publish_led()))
        except BaseException:
            rc.abort()
            if not rc.coordinates:
                self._end_save()
            raise
        if rc.coordinates:
            self._save.items = plan_data.items
        else:
            self._beside = mine | owed  # the earlier ones were cleaned by their leaders in this save
            self._end_save()
        return report

    def _clean_formers(self, live: tuple[KeepBeside, ...], keep: str, current: set[str]) -> set[tuple[str, int]]:
        """Another rank than 0, in write_data: on the roots of earlier sessions it locked in
        set_up (_lock_formers), remove what the committed manifests no longer name (``live``,
        from the coordinator: commit.clean_resaved). Returns the (root id, step) still owed a
        cleaning (a root it could not lock, or a failure there: logged; this save goes on)."""
        locked = self._former_paths if self._former_lock is not None else set()
        owed: set[tuple[str, int]] = set()
        for former in self._formers or []:
            ids = {ident for ident, path in zip(former.layout.local_ids, former.layout.local_paths) if path in locked}
            left = set(former.layout.local_ids) - ids - current
            owed |= {(rid, step) for rid, step in self._beside if rid in left}
            try:
                clean_resaved(former.layout, keep_wire([e for e in live if e.root_id in ids]), keep=keep)
            except OSError as e:
                owed |= {(rid, step) for rid, step in self._beside if rid in ids}
                log.warning("gdswriter: removing the files an earlier re-save left beside a step under %s failed "
                            "(%s); the next save tries again", former.layout.local_paths[0], e)
        return owed

    def _sources(self, plan_data: GlobalPlanData, plan: SavePlan, planner: SavePlanner
                 ) -> tuple[list[Source], dict[int, torch.Tensor]]:
        """This rank's pieces as the bytes it writes, in plan order, and each item's flat bytes."""
        byte_items = {wi.index.fqn: wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO}
        sources: list[Source] = []
        resolved: dict[int, torch.Tensor] = {}
        for piece in plan_data.pieces:
            it = plan_data.items[piece.item]
            wi = self._items[it.key] if piece.length is not None else byte_items[it.fqn]
            if piece.item not in resolved:
                resolved[piece.item] = flat_bytes(planner.resolve_data(wi))
            flat = resolved[piece.item]
            part = flat[piece.offset:piece.offset + piece.length] if piece.length is not None else flat
            sources.append(Source(piece.item, piece.offset, wi, part))
        return sources, resolved

    def _write(self, plan_data: GlobalPlanData, plan: SavePlan, planner: SavePlanner,
               rc: OrderedCommit) -> RankReport:
        if rc.setup_error is not None:
            raise rc.setup_error
        layout, rank = rc.layout, rc.coord.rank
        sources, resolved = self._sources(plan_data, plan, planner)
        engines = self._engines_for(len(layout.local_paths))
        try:
            targets = rank_targets(layout, rank, self.options.files_per_root, tagged=rc.in_place, tag=rc.token)
            fplan = plan_save([s.data.numel() for s in sources], targets)
            pieces = Snapshot(rc.step, None, [Extent("", flat=s.data) for s in sources], [], {})
            written_by: dict[int, str] = {}
            crcs = write_files(fplan, live_spans(pieces, fplan), rc, engines, written_by=written_by)
        except BaseException:
            self._close_engines()  # the next save starts from fresh ones
            raise
        chunks = tuple(ChunkEntry(sources[c.storage].item, fid, c.file_offset,
                                  sources[c.storage].offset + c.storage_offset, c.length, crcs[c])
                       for fid, f in enumerate(fplan.files) for c in f.chunks)
        records = tuple((s.item, record_json(item_record(s.write_item, s.item, resolved[s.item].numel())))
                        for s in sources if s.offset == 0)
        sizes = tuple((item, flat.numel()) for item, flat in resolved.items() if plan_data.items[item].is_bytes)
        decided = plan_data.decision
        return RankReport(rank, decided.step, decided.token, tuple(file_entries(layout, fplan, written_by, rank)),
                          chunks, records, sizes)

    def _engines_for(self, roots: int) -> list[IOEngine]:
        """The writer's engines, one per local root, built at the first save and kept for the next
        ones: building an engine (ring, page-locked staging buffers) costs 25-150 ms here."""
        if self._engines is not None and len(self._engines) == roots:
            return self._engines
        self._close_engines()
        engines: list[IOEngine] = []
        try:
            for _ in range(roots):
                engines.append(create_engine(self.options.engine))
        except BaseException:
            for e in engines:
                e.close()
            raise
        self._engines = engines
        return engines

    def _close_engines(self) -> None:
        engines, self._engines = self._engines or [], None
        for e in engines:
            e.close()

    def _end_save(self) -> None:
        """Release what a save holds (its locks; the session stays for the next save). DCP calls
        nothing after a failed save, so the next save's set_up, reset() and garbage collection
        also do."""
        if self._session is not None and self._session.lock is not None:
            self._session.lock.release()
            self._session.lock = None
        if self._opening is not None:
            self._opening.release()
        if self._former_lock is not None:
            self._former_lock.release()
            self._former_lock, self._former_paths = None, set()
        self._pending = None
        word, self._word = self._word, None
        if word is not None:  # reached write_data, not committed: the peers wait for rank 0's word
            word.settle(False)
        self._opening = None
        self._save = None

    def close(self) -> None:
        """Release everything the writer holds: a save's locks, its opened roots and the engines
        kept between saves (the next save opens and builds new ones), and the replication's
        channel (given back to group.py's pool: every rank calls close at the same point)."""
        self._release(channel=True)

    def _release(self, *, channel: bool) -> None:
        self._end_save()
        self._answer_missed()
        self._session = self._session_roots = None
        self._formers = []
        self._close_engines()
        replication = self._replication
        if replication is not None and channel:
            self._replication = None
            replication.close()
        if self._drain is not None:
            self._drain.close()

    def __del__(self) -> None:
        # Locks and engines only. A replication's channel is never given back at a collection: a
        # writer in a reference cycle is collected at another moment on each rank, the next
        # Coordinator.create would then take a pooled group on one rank and a new one on another
        # and hang (dcp_refill.DcpRefill had that hazard). Unclosed, the channel stays open.
        session = getattr(self, "_session", None)
        if ((session is not None and session.lock is not None) or getattr(self, "_engines", None)
                or getattr(getattr(self, "_opening", None), "lock", None) is not None
                or getattr(self, "_former_lock", None) is not None):
            self._release(channel=False)
