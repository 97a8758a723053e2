"""GDSCheckpointer under torch.distributed: its multi-rank Session (gdswriter/session.py).

``open_session`` (collective, from GDSCheckpointer.__init__ through gdswriter.session's
open_session) agrees on the roots, locks the ones this rank leads, finds which root holds
the checkpoint's manifests (roots.py ``choose_primary``: not necessarily rank 0's after a
restart put rank 0 on another node) and cleans their leftovers. Then, on every rank in the same order: ``prepare`` (DTensors -> local
shards) before the snapshot, ``write_and_commit`` and ``apply_retention`` in the save worker,
``load``. ``protocol`` answers steps()/latest_step() on every rank, also where the primary
root is another node's disk. ``close`` (from GDSCheckpointer.close) releases the locks and the
checkpointer's own coordination channel.

With ``DistOptions(replicas=C)``, C > 1, the roots' opening also places the copies
(replicate.py ``plan_peers``), and every committed step is handed to the session's
``replicator`` (replicate.py), whose thread copies it to peer nodes over a second channel of its
own; ``close`` waits for it. Retention then keeps the newest protected step. After each load
the loaded step goes to the same thread (refill.py): the files a replaced node held are
re-created from their copies in the background; ``wait_protected`` waits for that too. With
``DistOptions(parity_group=G)`` the same thread protects each step with parity instead
(parity.py), and refills a lost member's files and parity block after a load.

Each session has a channel of its own (group.py): another checkpointer's save thread never
shares its collectives. Its collective operations (a save's writes and commit, a retention,
a load) run one at a time, each whole (a lock), as every rank issues them in the same order.
"""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from ..engines.base import IOEngine
from ..errors import CheckpointNotFoundError, GDSWriterError, InvalidOptionError
from ..format.commit import CommitProtocol, retire, step_dir_name
from ..format.manifest import Manifest
from ..format.replicas import newest_protected
from ..load.apply import LiveState, LoadResult
from ..options import CheckpointOptions, EngineOptions
from ..save.snapshot import Snapshot
from ..save.pool import HostSnapshotPool
from ..save.handle import Release
from .drain import RankDrainer
from .group import Coordinator, describe, raise_failures
from .load import collective_restore
from .options import DistOptions
from .parity import plan_parity, replicator_for
from .refill import RefillJob
from .replicate import ReplicaPeers, ReplicationJob, Replicator, plan_peers
from .opening import open_roots
from .roots import RootLayout, adopt_copies, clean_led, owned, share_table
from .save import DTensors, PlanCache, collective_save
from .shards import split_dtensors

log = logging.getLogger("gdswriter")

DRAIN_SAVES_KEPT = 8  # saves whose token and shard ref a rank keeps for its drain (DistSession.saved)


class RankProtocol(CommitProtocol):
    """This rank's roots (``roots`` in its order), with the committed steps of the whole
    checkpoint: read from the primary root where this rank sees it (``primary`` and
    ``step_dir(s)`` are then that root's, whichever of this rank's roots it is), else as the
    primary rank last reported them."""

    def __init__(self, layout: RootLayout):
        super().__init__(layout.local_paths)
        self.identity = layout.primary_identity
        self.primary_index = layout.local_of(0)
        self.primary_here = self.primary_index is not None
        self.known: list[int] = []
        self.known_latest: int | None = None
        first = self.primary_index or 0
        self._order = [first] + [i for i in range(len(self.roots)) if i != first]  # the primary first

    @property
    def primary(self) -> Path:
        return self.roots[self._order[0]]

    def step_dir(self, step: int, root: int = 0) -> Path:
        """The step's directory on this rank's ``root``-th root counting the primary first (root
        0 is the primary where this rank sees it), as CommitProtocol numbers them."""
        return self.roots[self._order[root]] / step_dir_name(step)

    def committed_steps(self) -> list[int]:
        return super().committed_steps() if self.primary_here else list(self.known)

    def latest(self) -> int | None:
        return super().latest() if self.primary_here else self.known_latest

    def require(self, step: int | None) -> int:
        if self.primary_here:
            return super().require(step)
        resolved = self.known_latest if step is None else step
        if resolved is None or resolved not in self.known:
            raise CheckpointNotFoundError(errno.ENOENT, f"no committed checkpoint{'' if step is None else f' for step {step}'} "
                                                        f"(committed steps: {self.known})")
        return resolved


class DistSession:
    """The Session of a checkpointer on every rank of a process group (the module docstring)."""

    def __init__(self, coord: Coordinator, layout: RootLayout, lock: Any, options: DistOptions,
                 peers: ReplicaPeers | None = None):
        self.coord, self.layout, self.lock, self.options = coord, layout, lock, options
        self.peers = peers  # this rank's part of the replicas' placement (replicate.py), with replicas > 1
        self.replicator: Replicator | None = None  # made by start_replication
        self.protocol = RankProtocol(layout)
        self._plans = PlanCache()
        self._serial = threading.Lock()  # one collective operation at a time (the module docstring)
        self._table_shared = layout.world_size == 1  # the whole root table on every rank (share_table)
        self.saved: dict[int, tuple[str, list]] = {}  # step -> (token, this rank's shard ref) of its last saves

    @property
    def plans(self) -> PlanCache:
        """The cache of save plans (distributed/save.py): its hits, for diagnosis."""
        return self._plans

    @property
    def rank(self) -> int:
        return self.coord.rank

    def _learn(self, committed: Sequence[int], latest: int | None) -> None:
        self.protocol.known, self.protocol.known_latest = sorted(committed), latest

    def check_options(self, options: CheckpointOptions) -> None:
        if options.on_busy == "skip":
            raise InvalidOptionError(
                "on_busy='skip' cannot be used by a checkpointer of several ranks: each rank would decide alone "
                "whether its previous save is still running, so the ranks would save different steps and their "
                "collective saves would no longer match. Use on_busy='wait' (the default)")

    def check_writable(self, step: int) -> None:
        pass

    def start_replication(self, channel: Coordinator) -> None:
        """Replicate every committed step over ``channel`` (a gloo group of its own: replicate.py)."""
        assert self.peers is not None
        self.replicator = replicator_for(channel, self.layout, self.peers)

    def protected_step(self) -> int | None:
        """The newest protected step: from the markers where this rank sees the primary root,
        else the newest this session's replication protected (None without replicas)."""
        if self.replicator is None:
            return None
        if self.protocol.primary_here:
            return newest_protected(self.protocol.primary, self.protocol.committed_steps())
        return self.replicator.protected

    def drainer(self, options: CheckpointOptions, engine: IOEngine | None) -> RankDrainer:
        """This rank's part of the drain to ``options.drain_root`` (distributed/drain.py)."""
        return RankDrainer(self, options, engine)

    # -- save ----------------------------------------------------------------
    def prepare(self, state: Any, step: int) -> tuple[Any, DTensors]:
        """DTensors replaced by their local shards, and their blocks and meshes for this save's
        write: they travel in its snapshot (Snapshot.prepared), not in the session, so a retry of
        a step whose snapshot failed after prepare() writes its own blocks."""
        prepared, shards, meshes, groups = split_dtensors(state)
        return prepared, DTensors(shards, meshes, groups)

    def write_and_commit(self, snap: Snapshot, engines: Sequence[IOEngine], files_per_root: int, *,
                         pool: HostSnapshotPool | None = None, release: Release | None = None) -> Manifest | None:
        """Collective: write and commit ``snap`` with every rank (dist/save.py)."""
        found = snap.prepared
        if not isinstance(found, DTensors):
            raise GDSWriterError(f"internal: the snapshot of step {snap.step} was not made from prepare()'s "
                                 f"state (pass prepare()'s second value to take_snapshot(prepared=...))")
        with self._serial:
            saved: dict = {}
            manifest = collective_save(self.coord, self.layout, snap, found, engines, files_per_root=files_per_root,
                                       replicated=self.options.replicated, pool=pool, release=release,
                                       plans=self._plans, saved=saved,
                                       copy_roots=None if self.peers is None else self.peers.roots)
            if saved:
                self.saved[snap.step] = (saved["token"], saved["shard"])
            for s in sorted(self.saved)[:-DRAIN_SAVES_KEPT]:
                del self.saved[s]
            self._learn(set(self.protocol.known) | {snap.step}, snap.step)
            if self.replicator is not None and saved:  # committed: its copies go in the background
                self.replicator.submit(ReplicationJob(snap.step, tuple(saved["shard"]),
                                                      self.rank == self.layout.primary_rank))
        return manifest

    def apply_retention(self, newest: int, retained: Callable[[list[int], int], Any]) -> None:
        """Collective: the primary rank un-commits the steps the policy drops (primary first), then
        every root's leader deletes their secondary directories. I/O failures deleting a step are
        logged, not raised; any other failure on the primary rank (the policy, listing the steps)
        raises on every rank."""
        with self._serial:
            self._apply_retention(newest, retained)

    def _apply_retention(self, newest: int, retained: Callable[[list[int], int], Any]) -> None:
        what = f"retention after step {newest}"
        mine: dict = {}
        error = None
        if self.rank == self.layout.primary_rank:
            try:
                drop: list[int] = []
                steps = self.protocol.committed_steps()
                keep = set(retained(steps, newest))
                if self.replicator is not None:  # never the newest protected step, nor one replicating
                    keep |= self.replicator.pinned()
                    keep |= {s for s in [newest_protected(self.protocol.primary, steps)] if s is not None}
                for s in steps:
                    if s not in keep:
                        try:
                            retire(self.protocol.step_dir(s))
                            drop.append(s)
                        except OSError as e:
                            log.warning("gdswriter: could not delete old step %d under %s: %s", s,
                                        self.protocol.primary, e)
                mine = {"drop": drop, "committed": self.protocol.committed_steps(), "latest": self.protocol.latest()}
            except Exception as e:  # noqa: BLE001 - every rank learns of it
                error, mine = e, {"error": describe(e)}
        msg = self.coord.broadcast(mine, what, src=self.layout.primary_rank)
        if "error" in msg:
            raise_failures([msg["error"]], error, what, hint="no step was deleted on the secondary roots; the "
                                                             "retention runs again after the next save")
        for s in msg["drop"]:
            for i in self.layout.led:
                path = self.layout.local_paths[i] / step_dir_name(s)
                if not self.layout.is_primary(i) and path.exists() and owned(self.layout, path):
                    try:
                        retire(path)
                    except OSError as e:
                        log.warning("gdswriter: could not delete old step %d under %s: %s", s, path.parent, e)
        self._learn(msg["committed"], msg["latest"])

    # -- load ----------------------------------------------------------------
    def load(self, live: LiveState, state: Callable[[], dict], step: int | None,
             engines: Callable[[], Sequence[IOEngine]], *, strict: bool, verify: bool, fallback: bool = False,
             atomic: bool | None = None, engine_options: EngineOptions | None = None) -> LoadResult:
        """Collective: every rank reads into fresh buffers and verifies them, and all agree, before
        any live tensor changes on any rank (atomic: the default, ``atomic`` None or True);
        ``atomic=False`` reads into the live tensors in place (load.py ``collective_restore``: a
        failure leaves them partly written); ``fallback``: the newest intact step, as every rank
        agrees (load.py; always atomic). ``state()``: this rank's live state; the first of
        ``engines()`` reads."""
        with self._serial:
            if not self._table_shared:  # once, on every rank: until then a rank holds only its own part of it
                self.layout = share_table(self.coord, self.layout, "loading")
                self._table_shared = True
            live_state = state()
            result = collective_restore(self.coord, self.layout, self.protocol, live, live_state, step, engines()[0],
                                        strict=strict, verify=verify, fallback=fallback,
                                        share_dir=self.options.load_share_dir,
                                        cross_memory=self.options.load_cross_memory, atomic=atomic is not False)
            if self.replicator is not None:  # files a replaced node held: re-created in the background from
                # their full copies, or from the copy the load rebuilt from parity, with its parity block (refill.py)
                self.replicator.submit(RefillJob(result.step, self.layout))
            return result

    def close(self) -> None:
        """Release the roots' locks and this checkpointer's coordination channel (local; after its
        last collective). Idempotent."""
        if self.replicator is not None:
            self.replicator.close()  # waits for the replications submitted
        with self._serial:
            if self.lock is not None:
                self.lock.release()
            self.coord.close()


def open_session(roots: Sequence[Path], coord: Coordinator, options: DistOptions,
                 failed: BaseException | None = None, *, movable_primary: bool = False) -> DistSession:
    """Collective: open the roots (opening.py ``open_roots``: agree on them, lock the ones this
    rank leads, choose the primary, the root holding the checkpoint's manifests: roots.py
    ``choose_primary``), adopt the copies of its manifests where it holds only those, clean the
    leftovers. ``failed``: an error this rank hit before (reported in the first collective: every
    rank raises). ``movable_primary``: the caller lets another rank than rank 0 commit
    (GDSCheckpointer does; where only rank 0 may, a primary elsewhere is refused)."""
    layout, lock, primary = open_roots(coord, roots, failed=failed, movable_primary=movable_primary)
    try:
        if primary.get("copied") and not primary["committed"]:
            primary = adopt_copies(coord, layout, primary, "opening the checkpoint roots",
                                   "no root was changed; close the other checkpointer or choose other roots")
        error = None
        try:
            clean_led(layout, primary["committed"])
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
        coord.agree(error, "opening the checkpoint roots (cleaning)",
                    hint="no committed step was touched; fix the failing rank's roots and open again")
        if layout.primary_rank != 0 and coord.rank == 0:
            log.warning("gdswriter: the checkpoint's primary root %s (id %s, with its manifests) is rank %d's, not "
                        "rank 0's (rank 0 is on another node than when it was saved): rank %d commits the steps and "
                        "reads the manifests", layout.root(0).path, layout.primary_id, layout.primary_rank,
                        layout.primary_rank)
        peers = None
        if options.replicas > 1:
            peers = plan_peers(coord, layout, options.replicas, options.failure_domains)
        elif options.parity_group:
            peers = plan_parity(coord, layout, options.parity_group, options.failure_domains)
    except BaseException:
        lock.release()
        raise
    session = DistSession(coord, layout, lock, options, peers)
    session._learn(primary["committed"], primary["latest"])
    return session
