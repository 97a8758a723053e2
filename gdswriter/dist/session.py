"""GDSCheckpointer under torch.distributed: what its hooks delegate to.

``open_session`` (collective, from GDSCheckpointer.__init__) agrees on the roots, locks the
ones this rank leads and cleans their leftovers. Then, on every rank in the same order:
``prepare`` (DTensors -> local shards) before the snapshot, ``write_and_commit`` and
``apply_retention`` in the save worker, ``load``. ``protocol`` answers steps()/latest_step()
on every rank, also where the primary root is another node's disk. ``close`` (from
GDSCheckpointer.close) releases the locks and the checkpointer's own coordination channel.

Each session has a channel of its own (group.py): another checkpointer's save thread never
shares its collectives. Its collective operations (a save's writes and commit, a retention,
a load) run one at a time, each whole (a lock), as every rank issues them in the same order.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from ..engine import IOEngine
from ..errors import CheckpointNotFoundError, GDSWriterError
from ..format.commit import CommitProtocol, retire, step_dir_name
from ..format.manifest import Manifest, ShardInfo
from ..restore import LiveState
from ..snapshot import Snapshot
from ..snapshot_pool import HostSnapshotPool
from ..writer import Release
from .group import Coordinator, describe, raise_failures
from .load import collective_load
from .options import DistOptions
from .roots import RootLayout, clean_led, discover_layout, lock_led, owned
from .save import collective_save
from .shards import split_dtensors

log = logging.getLogger("gdswriter")


class RankProtocol(CommitProtocol):
    """This rank's roots, with the committed steps of the whole checkpoint: read from the
    primary root where this rank sees it as its first root, else as rank 0 last reported them."""

    def __init__(self, layout: RootLayout):
        super().__init__(layout.local_paths)
        self.identity = layout.primary_identity
        self.primary_here = layout.local_to_global[0] == 0
        self.known: list[int] = []
        self.known_latest: int | None = None

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
    def __init__(self, coord: Coordinator, layout: RootLayout, lock: Any, options: DistOptions):
        self.coord, self.layout, self.lock, self.options = coord, layout, lock, options
        self.protocol = RankProtocol(layout)
        self._shards: collections.deque[tuple[int, dict[str, ShardInfo], dict[str, list[int]]]] = collections.deque()
        self._mutex = threading.Lock()
        self._serial = threading.Lock()  # one collective operation at a time (the module docstring)

    @property
    def rank(self) -> int:
        return self.coord.rank

    def _learn(self, committed: Sequence[int], latest: int | None) -> None:
        self.protocol.known, self.protocol.known_latest = sorted(committed), latest

    # -- save ----------------------------------------------------------------
    def prepare(self, state: Any, step: int) -> Any:
        """Replace DTensors by their local shards (remembered, with their meshes, for this step's write)."""
        prepared, shards, meshes = split_dtensors(state)
        with self._mutex:
            self._shards.append((step, shards, meshes))
        return prepared

    def _shards_of(self, step: int) -> tuple[dict[str, ShardInfo], dict[str, list[int]]]:
        with self._mutex:
            while self._shards:  # entries of snapshots that failed after prepare() are skipped
                s, shards, meshes = self._shards.popleft()
                if s == step:
                    return shards, meshes
        raise GDSWriterError(f"internal: no prepared state for step {step} (call prepare() before the snapshot)")

    def write_and_commit(self, snap: Snapshot, engines: Sequence[IOEngine], files_per_root: int, *,
                         pool: HostSnapshotPool | None = None, release: Release | None = None) -> Manifest | None:
        """Collective: write and commit ``snap`` with every rank (dist/save.py)."""
        shards, meshes = self._shards_of(snap.step)
        with self._serial:
            manifest = collective_save(self.coord, self.layout, snap, shards, engines, files_per_root=files_per_root,
                                       replicated=self.options.replicated, pool=pool, release=release, meshes=meshes)
            self._learn(set(self.protocol.known) | {snap.step}, snap.step)
        return manifest

    def apply_retention(self, newest: int, retained: Callable[[list[int], int], Any]) -> None:
        """Collective: rank 0 un-commits the steps the policy drops (primary first), then every
        root's leader deletes their secondary directories. I/O failures deleting a step are logged,
        not raised; any other failure on rank 0 (the policy, listing the steps) raises on every rank."""
        with self._serial:
            self._apply_retention(newest, retained)

    def _apply_retention(self, newest: int, retained: Callable[[list[int], int], Any]) -> None:
        what = f"retention after step {newest}"
        mine: dict = {}
        error = None
        if self.rank == 0:
            try:
                drop: list[int] = []
                steps = self.protocol.committed_steps()
                keep = retained(steps, newest)
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
        msg = self.coord.broadcast(mine, what)
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
    def load(self, live: LiveState, live_state: dict, step: int | None, engine: IOEngine, *, strict: bool,
             verify: bool) -> int:
        with self._serial:
            return collective_load(self.coord, self.layout, self.protocol, live, live_state, step, engine,
                                   strict=strict, verify=verify)

    def close(self) -> None:
        """Release the roots' locks and this checkpointer's coordination channel (local; after its
        last collective). Idempotent."""
        with self._serial:
            if self.lock is not None:
                self.lock.release()
            self.coord.close()


def open_session(roots: Sequence[Path], coord: Coordinator, options: DistOptions,
                 failed: BaseException | None = None) -> DistSession:
    """Collective: agree on the roots, lock the ones this rank leads, clean their leftovers.
    ``failed``: an error this rank hit before (reported in the first collective: every rank raises)."""
    layout = discover_layout(coord, roots, failed=failed)
    lock, error, mine = None, None, {}
    try:
        lock = lock_led(layout)
        if coord.rank == 0:
            probe = CommitProtocol([layout.local_paths[0]])
            mine = {"committed": probe.committed_steps(), "latest": probe.latest()}
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    everyone = coord.all_gather({"error": describe(error)} if error else mine, "opening the roots (locks)")
    try:
        raise_failures([x.get("error") for x in everyone], error, "opening the checkpoint roots",
                       hint="no root was changed; close the other checkpointer or choose other roots")
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    error = None
    try:
        clean_led(layout, everyone[0]["committed"])
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    try:
        coord.agree(error, "opening the checkpoint roots (cleaning)",
                    hint="no committed step was touched; fix the failing rank's roots and open again")
    except BaseException:
        lock.release()
        raise
    session = DistSession(coord, layout, lock, options)
    session._learn(everyone[0]["committed"], everyone[0]["latest"])
    return session
