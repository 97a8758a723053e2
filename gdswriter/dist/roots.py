"""Which ranks share which roots.

Each rank is given its own list of roots (directories on its SSDs). Two ranks may name one
directory (a shared file system, or ranks of one node), or the same path may be two disks
(node-local SSDs on different nodes). A root's identity is therefore an id stored inside it
(``.gdswriter-root``, created once), not its path: ranks exchange the ids of their roots and
agree on one table of distinct roots, the primary (rank 0's first root) first. Each root is
led by the lowest rank that sees it: that rank locks it, cleans it, and commits its step
directory; the other ranks sharing it only write their own files there.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import EngineIOError, InvalidOptionError, RootUnavailableError
from ..format.commit import (ROOT_MARKER_NAME, CommitProtocol, RootLock, _step_dirs, owned_by, step_owner,
                             write_owner)
from ..format.commit import root_identity as commit_root_identity
from ..format.manifest import RootInfo
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


def lock_led(layout: RootLayout) -> RootLock:
    """Lock the roots this rank leads (CheckpointLockedError if another job holds one)."""
    return RootLock([layout.local_paths[i] for i in layout.led])


class _LedRoots(CommitProtocol):
    """The roots one rank leads, as commit.py's cleaning sees a checkpoint's roots: the primary
    first (a path that does not exist when another rank leads it), the steps rank 0 committed,
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
    rank 0 has not committed). Refuses (RootUnavailableError, nothing removed) when the primary
    has no committed step while a led secondary root holds steps that name the primary's path
    but not its id: they belong to another primary at that path (node-local disks, or an
    unmounted primary disk), and cleaning them would destroy that checkpoint's data."""
    if not committed:
        for i in layout.led:
            if layout.is_primary(i):
                continue
            root = layout.local_paths[i]
            held = [s for s, d in _step_dirs(root) for path, owner_id in [step_owner(d)]
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
