"""The session under a GDSCheckpointer: who owns its roots, and how a step is written,
committed, retained and loaded there.

``Session`` is what the checkpointer asks of it. Two implementations: ``LocalSession`` (this
module: one process owns every root) and ``DistSession`` (gdswriter/distributed/session.py:
every rank of a process group, collective). ``open_session`` chooses; the multi-rank package is
imported only for a multi-rank session, or to load a multi-rank checkpoint in one process.

The order of the calls, the same on every rank: ``prepare`` (in save_async, before the
snapshot), ``write_and_commit`` and ``apply_retention`` (in the save thread, one save at a
time), ``load`` (once no save runs), ``close``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .drain import Drainer
from .engines.base import IOEngine
from .errors import GDSWriterError, ReadOnlyRootError
from .format.commit import CommitProtocol, RootLock
from .format.manifest import MANIFEST_NAME, Manifest
from .format.sharded import GlobalManifest, parse_step
from ._log import log_once
from .load.apply import LiveState, LoadResult
from .load.policy import restore_into, restore_newest_intact
from .load.reader import parse_manifest, read_manifest_bytes
from .options import CheckpointOptions, EngineOptions
from .planner.affinity import plan_for_save
from .planner.assign import PACK_BELOW, SavePlan, plan_save
from .planner.discover import discover
from .planner.topology import Topology
from .save.handle import Release
from .save.pool import HostSnapshotPool
from .save.snapshot import Snapshot
from .save.writer import file_targets, write_and_commit

if TYPE_CHECKING:
    from .distributed.options import DistOptions

log = logging.getLogger("gdswriter")

TIMEOUT_ENV = "GDSWRITER_DIST_TIMEOUT"  # DistOptions.from_env's (distributed/options.py)

__all__ = ["LocalSession", "Session", "open_session", "peek_manifest"]


class Session(Protocol):
    """What GDSCheckpointer needs of the roots it saves to (see the module docstring).

    ``protocol``: the commit protocol, answering committed_steps()/latest() (on every rank);
    ``lock``: the roots' lock this process holds (None: none, e.g. opened for loading only)."""

    protocol: CommitProtocol
    lock: RootLock | None
    replicator: Any  # the copies on peer nodes (distributed/replicate.py Replicator), or None

    def protected_step(self) -> int | None:
        """The newest step whose copies on peer nodes are all durable (None without replicas)."""

    def check_options(self, options: CheckpointOptions) -> None:
        """InvalidOptionError for options this session cannot honour."""

    def check_writable(self, step: int) -> None:
        """ReadOnlyRootError when ``step`` cannot be saved (roots opened for loading only)."""

    def drainer(self, options: CheckpointOptions, engine: IOEngine | None) -> Drainer:
        """The drain to ``options.drain_root`` (drain.py; several ranks: distributed/drain.py)."""

    def prepare(self, state: Any, step: int) -> tuple[Any, Any]:
        """(the state to snapshot for ``step``, what this save's write_and_commit needs of it);
        the second travels in the snapshot (Snapshot.prepared), so a snapshot that failed
        after prepare() leaves nothing behind that a later save could take for its own.
        Multi-rank: the DTensors replaced by their local shards, and their blocks."""

    def write_and_commit(self, snap: Snapshot, engines: Sequence[IOEngine], files_per_root: int, *,
                         pool: HostSnapshotPool | None = None, release: Release | None = None) -> Manifest | None:
        """Write ``snap`` (one engine per root; through ``pool`` in host mode) and commit it;
        ``release`` is set once the saved tensors' memory is free (or the save failed)."""

    def apply_retention(self, newest: int, retained: Callable[[list[int], int], Any]) -> None:
        """Delete the committed steps ``retained(steps, newest)`` drops (never ``newest``)."""

    def load(self, live: LiveState, state: Callable[[], dict], step: int | None,
             engines: Callable[..., Sequence[IOEngine]], *, strict: bool, verify: bool, fallback: bool = False,
             atomic: bool | None = None, engine_options: EngineOptions | None = None) -> LoadResult:
        """Restore ``live`` in place from ``step`` (None: the latest; ``fallback``: the newest
        intact). ``state()``: the live state as saved (its tensors' shapes), ``engines()``: the
        engines, both asked for only when needed; ``engines(nbytes)`` may be asked instead, with
        the bytes the load reads, for engines sized to it (GDSCheckpointer's: small staging
        buffers for a small load)."""

    def close(self) -> None:
        """Release the lock (and a multi-rank session's coordination channel). Idempotent."""


def open_session(roots: Sequence[Path], process_group: Any = None, dist_options: DistOptions | None = None, *,
                 label: str = "GDSCheckpointer") -> Session:
    """GDSCheckpointer's session: a DistSession (collective) under torch.distributed with
    several ranks, or with ``process_group`` (see DistOptions.collective), else a LocalSession.
    Only the first imports gdswriter.distributed."""
    collective = None if dist_options is None else dist_options.collective
    if collective is False or (collective is None and process_group is None and not _several_ranks()):
        if dist_options is None and os.environ.get(TIMEOUT_ENV, "").strip():
            from .distributed.options import DistOptions

            DistOptions.from_env()  # a malformed value is an error here too, as on several ranks
        return LocalSession(roots)
    from .distributed import session_for

    session = session_for(roots, process_group, dist_options, label=label)
    return LocalSession(roots) if session is None else session


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def peek_manifest(protocol: CommitProtocol, step: int | None) -> Manifest | GlobalManifest | None:
    """The parsed manifest of ``step`` (None: the latest), for a load to choose its path (several
    ranks saved it when it is a 1.3 GlobalManifest or its ``dist`` is set: ``saved_by_ranks``)
    and then restore from without parsing it again. A 1.3 step's global manifest comes back
    alone, its shards unread: the multi-rank load reads those it needs, once. None when it
    cannot tell (no such step, a damaged manifest): the single-process path then reports the
    problem in its own words."""
    try:
        step = protocol.require(step)
        raw = read_manifest_bytes(protocol, step)
        parsed = parse_step(raw, str(protocol.step_dir(step) / MANIFEST_NAME))
        return parsed if isinstance(parsed, GlobalManifest) else parse_manifest(protocol, step, parsed)
    except (GDSWriterError, OSError, ValueError):
        return None


def saved_by_ranks(m: Manifest | GlobalManifest) -> bool:
    """Whether a peeked manifest is a multi-rank step's."""
    return isinstance(m, GlobalManifest) or m.dist is not None


class LocalSession:
    """One process owns the roots. Opening them locks them and removes the leftovers of
    crashed saves; roots it cannot write (read-only file system, no permission) are opened for
    loading only: no lock, nothing cleaned, and saving raises ReadOnlyRootError."""

    def __init__(self, roots: Sequence[Path]):
        self.protocol = CommitProtocol(roots)
        self.lock: RootLock | None = None
        self.replicator = None  # replicas on peer nodes need several ranks (DistOptions.replicas)
        self.read_only: ReadOnlyRootError | None = None
        removed: list = []
        try:
            self.lock, removed = self.protocol.open_writer()
        except ReadOnlyRootError as e:
            self.read_only = e
            log.info("gdswriter: %s", e)
        if removed:
            log.info("gdswriter: removed %d leftover(s) of interrupted saves under %s", len(removed), roots[0])
        self._topology: Topology | None = None  # discovered at the first save of GPU state
        self._last_plan: tuple[tuple, SavePlan] | None = None  # (what it was planned from, the plan)

    def check_options(self, options: CheckpointOptions) -> None:
        pass

    def protected_step(self) -> int | None:
        return None

    def drainer(self, options: CheckpointOptions, engine: IOEngine | None) -> Drainer:
        return Drainer(self.protocol, options, engine)

    def check_writable(self, step: int) -> None:
        if self.read_only is not None:
            raise ReadOnlyRootError(self.read_only.errno, f"cannot save step {step}: "
                                                          f"{self.read_only.strerror}") from self.read_only

    def prepare(self, state: Any, step: int) -> tuple[Any, Any]:
        return state, None

    # -- save ----------------------------------------------------------------
    def write_and_commit(self, snap: Snapshot, engines: Sequence[IOEngine], files_per_root: int, *,
                         pool: HostSnapshotPool | None = None, release: Release | None = None) -> None:
        """Plan (see _plan), write and commit ``snap`` (save/writer.py)."""
        targets = file_targets(len(self.protocol.roots), files_per_root)
        write_and_commit(snap, self.protocol, engines, pool=pool, release=release or Release(),
                         plan=self._plan(snap, targets))

    def _plan(self, snap: Snapshot, targets: list) -> SavePlan:
        """Which bytes go to which file: the topology planner's GPU-local plan when storages live
        on GPUs (each GPU writes to its nearest root; the topology is discovered once), else the
        balanced plan. A planner failure falls back to the balanced plan, with a warning: where
        bytes go is an optimisation, never a reason not to save."""
        sizes, where = snap.extent_sizes(), snap.extent_devices()
        names = {d: str(d) for d in set(where)}  # str() per device, not per storage
        devices = list(map(names.__getitem__, where))
        # A plan is a function of these (the topology is discovered once): in a training loop
        # every save after the first reuses the last one.
        key = (sizes, devices, targets)
        if self._last_plan is not None and self._last_plan[0] == key:
            return self._last_plan[1]
        plan = self.new_plan(sizes, devices, targets)
        self._last_plan = (key, plan)
        return plan

    def new_plan(self, sizes: list[int], devices: list[str], targets: list) -> SavePlan:
        """A fresh plan for storages of these sizes on these devices (uncached: _plan keeps the
        last one). A seam too: tests replace it to force a plan (a GPU-local one, a lagging root)."""
        if not any(d.startswith("cuda") for d in set(devices)):  # a look per device, not per storage
            return plan_save(sizes, targets, pack_below=PACK_BELOW)
        try:
            if self._topology is None:
                self._topology = discover(roots=self.protocol.roots)
            return plan_for_save(sizes, devices, self.protocol.roots, targets, self._topology)
        except Exception as e:  # noqa: BLE001 - see _plan's docstring
            log_once("topology-plan", f"gdswriter: the topology planner failed ({type(e).__name__}: {e}); "
                                      f"balancing bytes across the roots without GPU locality")
            return plan_save(sizes, targets, pack_below=PACK_BELOW)

    def apply_retention(self, newest: int, retained: Callable[[list[int], int], Any]) -> None:
        """Delete committed steps the policy no longer keeps (never ``newest``). A step that
        cannot be deleted is logged and retried after the next save."""
        steps = self.protocol.committed_steps()
        keep = retained(steps, newest)
        for s in steps:
            if s not in keep:
                try:
                    self.protocol.delete_step(s)
                except OSError as e:
                    log.warning("gdswriter: could not delete old step %d under %s: %s", s, self.protocol.primary, e)

    # -- load ----------------------------------------------------------------
    def load(self, live: LiveState, state: Callable[[], dict], step: int | None,
             engines: Callable[..., Sequence[IOEngine]], *, strict: bool, verify: bool, fallback: bool = False,
             atomic: bool | None = None, engine_options: EngineOptions | None = None) -> LoadResult:
        """A checkpoint of one process, or a multi-rank one read in this process (always
        atomic then: see GDSCheckpointer.load)."""
        peeked = peek_manifest(self.protocol, step)
        multi_rank = peeked is not None and saved_by_ranks(peeked)
        if peeked is None and fallback:  # the latest manifest is damaged: ask an older one
            older = (peek_manifest(self.protocol, s) for s in self.protocol.fallback_order()[1:])
            multi_rank = next((saved_by_ranks(m) for m in older if m is not None), False)
        if multi_rank:
            from .distributed import load_in_one_process

            live_state = state()
            return load_in_one_process(self.protocol, live, live_state, step, engines()[0], strict=strict,
                                       verify=verify, fallback=fallback)
        kw = dict(strict=strict, verify=verify, engine_options=engine_options or EngineOptions(), atomic=atomic,
                  manifest=peeked)
        if fallback:
            return restore_newest_intact(live, self.protocol, engines(), **kw)
        # The bytes to read, for engines(nbytes) to size its staging for (a small load needs little)
        nbytes = peeked.storage_bytes() if peeked is not None else None
        return restore_into(live, self.protocol, self.protocol.require(step), engines(nbytes), **kw)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()

