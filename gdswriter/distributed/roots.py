"""Which ranks share which roots.

Each rank is given its own list of roots (directories on its SSDs). Two ranks may name one
directory (a shared file system, or ranks of one node), or the same path may be two disks
(node-local SSDs on different nodes). A root's identity is therefore an id stored inside it
(``.gdswriter-root``, created once), not its path: ranks exchange the ids of their roots and
agree on one table of distinct roots, the primary first. Each root is led by the lowest rank
that sees it: that rank locks it, cleans it, and commits its step directory; the other ranks
sharing it only write their own files there.

Which root is the primary (the one holding the manifests) is decided when the roots are
opened (``choose_primary``), from what is on them, not from the rank order alone: node ranks
are not kept across restarts (torchrun's rendezvous may put rank 0 on another node), so rank
0's first root may be a disk that holds only secondary step directories of the checkpoint
while the primary's manifests are on another node's disk. Each root's leader reports the
steps committed on it and the primary ids its secondary step directories name; the primary
is rank 0's first root when that holds a committed step (or nothing says otherwise), else the
one root of the job that holds committed steps (the one the secondaries name, if several do),
else the root that rank 0's first root's secondary directories name. Its leader (the
*primary rank*, rank 0 unless the job was restarted this way) then does what rank 0 does
otherwise: gathers the votes, writes the manifest, moves ``latest``, applies retention and
reads the manifest for a load. Nothing is written before every rank agrees on the table.

An id is taken to be one root seen by several ranks; a root copied with its marker (rsync -a,
a machine image) breaks that. Each save checks it (dist/commit.py): the leader creates the
step's temporary directory, under a name no earlier save used, and every other rank sharing
the root must find that directory in its own root before anything is written.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import EngineIOError, InvalidOptionError, RootUnavailableError
from ..format.commit import (ROOT_MARKER_NAME, CommitProtocol, RootLock, step_dirs, owned_by, step_owner,
                             write_owner)
from ..format.commit import root_identity as commit_root_identity
from ..format.manifest import MANIFEST_NAME, RootInfo
from .group import Coordinator, describe, raise_failures

log = logging.getLogger("gdswriter")

ROOT_ID_NAME = ROOT_MARKER_NAME


def root_identity(path: str | os.PathLike, create: bool = True) -> str | None:
    """The id in root ``path``'s identity marker (format/commit.py ``root_identity``; None if it
    has none and not ``create``). Creating it is atomic (the first of several racing ranks wins,
    the others read its id) and durable."""
    try:
        ident = commit_root_identity(path, create=create)
    except OSError as e:
        if isinstance(e, EngineIOError):
            raise
        raise EngineIOError(e.errno or errno.EIO, Path(os.fspath(path)) / ROOT_MARKER_NAME, 0,
                            "create root identity") from e
    return None if ident is None else ident.id


@dataclass(frozen=True)
class RootLayout:
    """This rank's place in the job's roots: the table every rank agrees on (``table[0]`` is the
    primary), this rank's own roots and their index in the table."""

    rank: int
    world_size: int
    table: tuple[RootInfo, ...]
    local_paths: tuple[Path, ...]
    local_ids: tuple[str, ...]
    local_to_global: tuple[int, ...]
    primary_identity: str  # what secondary step directories name in ``primary-root``

    def leader(self, g: int) -> int:
        return min(self.table[g].ranks)

    @property
    def primary_rank(self) -> int:
        """The rank that leads the primary: it commits steps and reads manifests (rank 0 unless
        choose_primary moved the primary to another rank's root)."""
        return self.leader(0)

    @property
    def shares_roots(self) -> bool:
        """Whether some root is seen by more than one rank."""
        return any(len(info.ranks) > 1 for info in self.table)

    def with_primary(self, g: int) -> "RootLayout":
        """This layout with table root ``g`` as the primary (moved to the front, the other roots
        keeping their order)."""
        if g == 0:
            return self
        order = [g] + [h for h in range(len(self.table)) if h != g]
        new_of = {old: new for new, old in enumerate(order)}
        return RootLayout(self.rank, self.world_size, tuple(self.table[h] for h in order), self.local_paths,
                          self.local_ids, tuple(new_of[h] for h in self.local_to_global), self.table[g].path)

    def leads(self, i: int) -> bool:
        """Whether this rank leads its local root ``i``."""
        return self.leader(self.local_to_global[i]) == self.rank

    def is_primary(self, i: int) -> bool:
        return self.local_to_global[i] == 0

    def local_of(self, g: int) -> int | None:
        """This rank's index of table root ``g``, if it sees it."""
        return self.local_to_global.index(g) if g in self.local_to_global else None

    @property
    def led(self) -> list[int]:
        return [i for i in range(len(self.local_paths)) if self.leads(i)]


def discover_layout(coord: Coordinator, roots: Sequence[Path], *, create: bool = True,
                    failed: BaseException | None = None) -> RootLayout:
    """Collective: every rank's roots' ids -> the shared root table. With ``create`` (writing)
    missing roots are made; without (reading only), a root without an id stands for itself, by
    path. ``failed``: an error this rank hit before this first collective, reported here so that
    every rank raises at once instead of waiting out the timeout."""
    mine: dict = {}
    error = failed
    try:
        if failed is not None:
            raise failed
        if create:
            for r in roots:
                try:
                    r.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise InvalidOptionError(f"cannot create checkpoint root {r}: {e.strerror}; choose a writable "
                                             f"directory") from e
        ids = [root_identity(r, create) or f"path:{r.resolve()}" for r in roots]
        if len(set(ids)) != len(ids):
            raise InvalidOptionError(f"roots {[str(r) for r in roots]} name one directory twice (through a link): "
                                     f"give each SSD's directory once")
        mine = {"roots": [[i, str(r.resolve())] for i, r in zip(ids, roots)]}
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    everyone = coord.all_gather(mine if error is None else {"error": describe(error)}, "opening the roots")
    raise_failures([x.get("error") for x in everyone], error, "opening the checkpoint roots",
                   hint="no root was changed; fix the failing rank's roots and open again")
    order: dict[str, int] = {}
    paths: list[str] = []
    ranks: list[list[int]] = []
    for r, x in enumerate(everyone):
        for rid, path in x["roots"]:
            if rid not in order:
                order[rid] = len(paths)
                paths.append(path)
                ranks.append([])
            ranks[order[rid]].append(r)
    table = tuple(RootInfo(rid, paths[g], tuple(ranks[g])) for rid, g in order.items())
    return RootLayout(coord.rank, coord.world_size, table, tuple(roots), tuple(ids),
                      tuple(order[rid] for rid in ids), everyone[0]["roots"][0][1])


def probe_led(layout: RootLayout) -> dict:
    """What the roots this rank leads hold, for choose_primary: per table root (str index), the
    steps committed on it (as if it were a primary), the step ``latest`` names there, and the
    primary ids that its secondary step directories name. Reads only."""
    out = {}
    for i in layout.led:
        root = layout.local_paths[i]
        probe = CommitProtocol([root])
        names = {owner_id for s, d in step_dirs(root) if not (d / MANIFEST_NAME).exists()
                 for _, owner_id in [step_owner(d)] if owner_id}
        out[str(layout.local_to_global[i])] = {"committed": probe.committed_steps(), "latest": probe.latest(),
                                               "names": sorted(names)}
    return out


def choose_primary(layout: RootLayout, probes: dict) -> RootLayout:
    """The layout with the job's primary first (module docstring), from every leader's
    ``probe_led`` (merged: one entry per table root). Every rank computes the same from the
    same probes. RootUnavailableError when several roots hold committed steps and none of them
    is rank 0's first root: which checkpoint to continue is then not the roots' to say."""
    table = layout.table
    committed = [probes[str(g)]["committed"] for g in range(len(table))]
    if committed[0]:
        return layout
    named = {i for p in probes.values() for i in p["names"]}
    holders = [g for g in range(len(table)) if committed[g]]
    if holders:
        pick = [g for g in holders if table[g].id in named] or holders
        if len(pick) > 1:
            where = "; ".join(f"{table[g].path} (id {table[g].id}, rank {min(table[g].ranks)}): steps "
                              f"{committed[g][-3:]}" for g in pick)
            raise RootUnavailableError(
                errno.EEXIST,
                f"rank 0's first root {table[0].path} holds no committed step, and several other roots of this job "
                f"hold committed steps of different checkpoints ({where}): gdswriter cannot tell which one to "
                f"continue. Give each rank the roots it was saved with (rank 0 on the node holding the checkpoint's "
                f"primary), or move the other checkpoint's steps away; nothing was changed")
        return layout.with_primary(pick[0])
    by_id = {info.id: g for g, info in enumerate(table)}
    mine = sorted({by_id[i] for i in probes["0"]["names"] if i in by_id and by_id[i] != 0})
    return layout.with_primary(mine[0]) if len(mine) == 1 else layout


def lock_led(layout: RootLayout) -> RootLock:
    """Lock the roots this rank leads (CheckpointLockedError if another job holds one)."""
    return RootLock([layout.local_paths[i] for i in layout.led])


class _LedRoots(CommitProtocol):
    """The roots one rank leads, as commit.py's cleaning sees a checkpoint's roots: the primary
    first (a path that does not exist when another rank leads it), the steps the primary committed,
    and the primary's identity that secondary step directories name."""

    def __init__(self, layout: RootLayout, committed: Sequence[int]):
        led = layout.led
        primary = [layout.local_paths[i] for i in led if layout.is_primary(i)]
        super().__init__((primary or [layout.local_paths[0] / ".not-led-here"]) +
                         [layout.local_paths[i] for i in led if not layout.is_primary(i)])
        self.identity = layout.primary_identity
        self.primary_id = layout.table[0].id  # the ranks agreed on the roots: cleaning claims nothing
        self._committed = sorted(committed)

    def committed_steps(self) -> list[int]:
        return list(self._committed)


def clean_led(layout: RootLayout, committed: Sequence[int]) -> list[Path]:
    """Remove what interrupted saves left on the roots this rank leads (commit.py's cleaning:
    temporary and trash entries, secondary step directories of this checkpoint whose step
    the primary has not committed). Refuses (RootUnavailableError, nothing removed) when the
    primary has no committed step while
    - the primary itself holds step directories that another primary wrote as its secondary
      ones (rank 0 is on another node than at the save, and no root of this job is the
      primary they name: writing there would destroy them), or
    - a led secondary root holds steps that name the primary's path but not its id: they
      belong to another primary at that path (node-local disks, or an unmounted primary
      disk), and cleaning them would destroy that checkpoint's data."""
    if not committed:
        for i in layout.led:
            root = layout.local_paths[i]
            if layout.is_primary(i):
                foreign = [(s, owner_id) for s, d in step_dirs(root) if not (d / MANIFEST_NAME).exists()
                           for path, owner_id in [step_owner(d)]
                           if (path, owner_id) != (None, None) and not owned(layout, d)]
                if foreign:
                    ids = sorted({owner_id or "(none recorded)" for _, owner_id in foreign})
                    steps = [s for s, _ in foreign]
                    raise RootUnavailableError(
                        errno.ENOENT,
                        f"primary checkpoint root {root} (id {layout.table[0].id}, rank {layout.rank}'s root) holds no "
                        f"committed step, only {len(steps)} step director{'y' if len(steps) == 1 else 'ies'} (steps "
                        f"{steps[:5]}{' ...' if len(steps) > 5 else ''}) that another primary root (id "
                        f"{', '.join(ids)}) wrote there as its secondary data, and no root of this job is that "
                        f"primary: rank 0 is probably on another node than when they were saved (node ranks are not "
                        f"kept across restarts). Start the job with the node that holds the primary's disk among its "
                        f"nodes (its rank then finds the checkpoint), or mount that disk. gdswriter refuses to write "
                        f"(and never cleans) these roots until then; if that checkpoint is really abandoned, move "
                        f"those directories out of {root} yourself")
                continue
            held = [s for s, d in step_dirs(root) for path, owner_id in [step_owner(d)]
                    if path == layout.primary_identity and owner_id != layout.table[0].id]
            if held:
                raise RootUnavailableError(
                    errno.ENOENT,
                    f"primary checkpoint root {layout.primary_identity} (id {layout.table[0].id}) holds no committed "
                    f"step, but secondary root {root} holds {len(held)} step director{'y' if len(held) == 1 else 'ies'} "
                    f"(steps {held[:5]}{' ...' if len(held) > 5 else ''}) written for another primary root at that "
                    f"path: is the right disk mounted there, and is rank 0 on the node that saved them? Start the job "
                    f"as it was saved (or mount the disk) and open the checkpoint again. gdswriter refuses to write "
                    f"(and never cleans) these roots until then; if that checkpoint is really abandoned, move those "
                    f"directories out of {root} yourself")
    removed = _LedRoots(layout, committed).clean_leftovers()
    if removed:
        log.info("gdswriter: rank %d removed %d leftover(s) of interrupted saves", layout.rank, len(removed))
    return removed


def write_owner_files(layout: RootLayout, step_dir: Path) -> None:
    """Record in a secondary step directory of this checkpoint its primary: the primary's path
    and id, as format/commit.py records them."""
    write_owner(step_dir, layout.primary_identity, layout.table[0].id)


def owned(layout: RootLayout, step_dir: Path) -> bool:
    """True when a secondary step directory was written for this checkpoint's primary root: by
    the primary's id when it names one, else (written before ids were recorded) by its path."""
    return owned_by(step_dir, layout.primary_identity, layout.table[0].id)
