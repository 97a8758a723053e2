"""Which ranks share which roots.

Each rank is given its own list of roots (directories on its SSDs). Two ranks may name one
directory (a shared file system, or ranks of one node), or the same path may be two disks
(node-local SSDs on different nodes). A root's identity is therefore an id stored inside it
(``.gdswriter-root``, created once), not its path: the ranks send the ids of their roots to
rank 0, which builds the one table of distinct roots (the primary first) and sends each rank
its part of it (opening.py when the roots are opened to save, ``discover_layout`` for a load:
what a rank receives does not grow with the world; the whole table is held by the primary
rank, which records it in each manifest, and by every rank only once a load needs it,
``share_table``). Each root is led by the lowest rank
that sees it: that rank locks it, cleans it, and commits its step directory; the other ranks
sharing it only write their own files there.

Which root is the primary (the one holding the manifests) is decided when the roots are
opened (``choose_primary``), from what is on them, not from the rank order alone: node ranks
are not kept across restarts (torchrun's rendezvous may put rank 0 on another node), so rank
0's first root may be a disk that holds only secondary step directories of the checkpoint
while the primary's manifests are on another node's disk. Rank 0 learns of each root the
steps committed on it and the primary ids its secondary step directories name (opening.py's
offers, or ``settle_primary`` for a load: rank 0 decides and every rank receives the decision
alone); the primary
is rank 0's first root when that holds a committed step (or nothing says otherwise), else the
one root of the job that holds committed steps (the one the secondaries name, if several do),
else the root that rank 0's first root's secondary directories name. Its leader (the
*primary rank*, rank 0 unless the job was restarted this way) then does what rank 0 does
otherwise: gathers the votes, writes the manifest, moves ``latest``, applies retention and
reads the manifest for a load. Nothing is written before every rank agrees on the table.

An id is taken to be one root seen by several ranks; a root copied with its marker (rsync -a,
a machine image) breaks that. Each save checks it (dist/commit.py): the leader creates the
step's temporary directory, under a name no earlier save used, and every other rank sharing
the root must find that directory in its own root before anything is written. (The DCP
writer's roots shared per node that another rank than rank 0 leads are checked at the end
instead: each sharing rank marks the directory, and a copy never gathers every rank's mark;
commit.py OrderedCommit. Each rank's part of the table therefore carries how many ranks see
each of its roots.)
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence

from ..errors import EngineIOError, InvalidOptionError, RankFailedError, RootUnavailableError
from ..format.commit import (ROOT_MARKER_NAME, CommitProtocol, RootLock, step_dirs, owned_by, step_owner,
                             write_owner)
from ..format.commit import root_identity as commit_root_identity
from ..format.commit import step_dir_name
from ..format.copies import adopt_copy, copied_steps
from ..format.manifest import MANIFEST_NAME, RootInfo
from .group import Coordinator, bounded, describe, unbound

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
class KnownRoot:
    """What a rank knows of one root of the job's table: its id, the path its leader sees it
    at, and its leader (the lowest rank that sees it)."""

    id: str
    path: str
    leader: int
    count: int = 1  # how many ranks see it (where known: a rank's own roots and, on the primary rank, every root)


@dataclass(frozen=True)
class RootLayout:
    """This rank's place in the job's roots: this rank's own roots and their index in the job's
    table of distinct roots (index 0 is the primary). The whole ``table`` (every root with the
    ranks that see it: O(roots) entries, which grows with the world when each node has its own
    disks) is held only where it is needed: on the primary rank, which writes it into each
    step's manifest, and after ``with_table`` (a load that needs it). Every rank ``known``s the
    roots it sees and the primary, which is what it needs to save and to lead its roots."""

    rank: int
    world_size: int
    table: tuple[RootInfo, ...]  # every root (the primary first) where held, else ()
    local_paths: tuple[Path, ...]
    local_ids: tuple[str, ...]
    local_to_global: tuple[int, ...]
    primary_identity: str  # what secondary step directories name in ``primary-root``
    known: Mapping[int, KnownRoot] | None = field(default=None, hash=False)  # table index -> entry (every root where ``table`` is held)
    root_count: int | None = None  # how many roots the table has (len(table) where held)
    shares: bool | None = None  # whether some root is seen by more than one rank

    def __post_init__(self) -> None:
        if self.known is None:
            object.__setattr__(self, "known", {g: KnownRoot(info.id, info.path, min(info.ranks), len(info.ranks))
                                               for g, info in enumerate(self.table)})
        if self.root_count is None:
            object.__setattr__(self, "root_count", len(self.table))
        if self.shares is None:
            object.__setattr__(self, "shares", any(len(info.ranks) > 1 for info in self.table))

    def root(self, g: int) -> KnownRoot:
        """Table root ``g``, which this rank must know (one of its own, or the primary)."""
        assert self.known is not None
        return self.known[g]

    def leader(self, g: int) -> int:
        return self.root(g).leader

    @property
    def primary_rank(self) -> int:
        """The rank that leads the primary: it commits steps and reads manifests (rank 0 unless
        choose_primary moved the primary to another rank's root)."""
        return self.leader(0)

    @property
    def primary_id(self) -> str:
        return self.root(0).id

    @property
    def shares_roots(self) -> bool:
        """Whether some root is seen by more than one rank (the same on every rank)."""
        return bool(self.shares)

    @property
    def holds_table(self) -> bool:
        return len(self.table) == self.root_count

    def with_primary(self, g: int, primary: KnownRoot | None = None) -> RootLayout:
        """This layout with table root ``g`` as the primary (moved to the front, the other roots
        keeping their order). ``primary``: root ``g``'s entry, where this rank does not know it."""
        if g == 0:
            return self
        assert self.known is not None and self.root_count is not None

        def moved(h: int) -> int:
            return 0 if h == g else h + 1 if h < g else h

        new = primary or self.known[g]
        known = {moved(h): k for h, k in self.known.items()}
        known[0] = new
        table = (self.table[g],) + self.table[:g] + self.table[g + 1:] if self.holds_table else ()
        return RootLayout(self.rank, self.world_size, table, self.local_paths, self.local_ids,
                          tuple(moved(h) for h in self.local_to_global), new.path, known, self.root_count,
                          self.shares)

    def with_whole_table(self, table: Sequence[RootInfo]) -> RootLayout:
        """This layout holding the whole ``table`` (in this layout's order)."""
        return RootLayout(self.rank, self.world_size, tuple(table), self.local_paths, self.local_ids,
                          self.local_to_global, self.primary_identity)

    def sharers(self, i: int) -> int:
        """How many ranks see this rank's local root ``i``."""
        return self.root(self.local_to_global[i]).count

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


def _ranges(ranks: Sequence[int]) -> list[list[int]]:
    """Sorted ranks as [first, last] runs: one run for the ranks of a node or of a shared root."""
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def _unranges(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(r for a, b in runs for r in range(int(a), int(b) + 1))


def table_runs(table: Sequence[RootInfo]) -> list[list]:
    """``table`` as sent: [[id, path, ranks as runs of consecutive ranks], ...] (table_of_runs)."""
    return [[info.id, info.path, _ranges(info.ranks)] for info in table]


def table_of_runs(msg: Sequence[Sequence]) -> list[RootInfo]:
    """The table table_runs sent."""
    return [RootInfo(rid, path, _unranges(runs)) for rid, path, runs in msg]


def build_table(everyone: Sequence[dict]) -> tuple[tuple[RootInfo, ...], list[list[int]]]:
    """The table of distinct roots (by id, in rank order: rank 0's first root first) from every
    rank's [[id, path], ...], and each rank's roots' table indices."""
    order: dict[str, int] = {}
    paths: list[str] = []
    ranks: list[list[int]] = []
    where: list[list[int]] = []
    for r, x in enumerate(everyone):
        mine = []
        for rid, path in x["roots"]:
            if rid not in order:
                order[rid] = len(paths)
                paths.append(path)
                ranks.append([])
            ranks[order[rid]].append(r)
            mine.append(order[rid])
        where.append(mine)
    return tuple(RootInfo(rid, paths[g], tuple(ranks[g])) for rid, g in order.items()), where


def raise_decided(msg: dict, error: BaseException | None, what: str, hint: str) -> None:
    """Raise what a decision broadcast says: a refusal (``refused``: the error type, errno and
    message the deciding rank raised, raised alike on every rank), or the failed ranks
    (``bounded``: this rank's own error where it failed, RankFailedError elsewhere)."""
    refused = msg.get("refused")
    if refused is not None:
        if error is not None:
            raise error
        kinds = {"RootUnavailableError": RootUnavailableError, "InvalidOptionError": InvalidOptionError}
        kind = kinds.get(refused["type"])
        if kind is RootUnavailableError:
            raise RootUnavailableError(refused["errno"], refused["message"])
        if kind is InvalidOptionError:
            raise InvalidOptionError(refused["message"])
        raise RankFailedError(what, {msg.get("rank", 0): f"{refused['type']}: {refused['message']}"}, hint)
    if "failed" in msg:
        shown, total = unbound(msg)
        if total:
            if error is not None:
                raise error
            raise RankFailedError(what, shown, hint, total=total)


def decide_at_rank0(coord: Coordinator, mine: dict, what: str, decide: Callable[[list[dict]], list[dict]],
                    refusable: tuple[type[BaseException], ...] = (Exception,)) -> tuple[dict, BaseException | None]:
    """Collective, the shape of the decisions made at open (the roots' table, their opening, the
    placement of copies and parity lanes): every rank's ``mine`` (``{"error": ...}`` where it
    failed) is gathered to rank 0, which ``decide``s every rank's part unless a rank failed
    (then every part is the bounded failure set); a ``refusable`` error of ``decide`` becomes a
    refusal that every rank raises alike (raise_decided). Returns this rank's part, and rank
    0's own refusal (None elsewhere): raise_decided(part, error, ...) raises what it says."""
    got = coord.gather(mine, what, dst=0)
    parts: list | None = None
    error: BaseException | None = None
    if got is not None:
        failures = {r: x["error"] for r, x in enumerate(got) if "error" in x}
        if failures:
            parts = [bounded(failures)] * coord.world_size
        else:
            try:
                parts = decide(got)
            except refusable as e:
                error, parts = e, [{"refused": refusal(e)}] * coord.world_size
    return coord.scatter(parts, f"{what} (parts)", src=0), error


def refusal(e: BaseException) -> dict:
    """An error of the deciding rank, as every rank re-raises it (raise_decided)."""
    return {"type": type(e).__name__, "errno": getattr(e, "errno", None) or errno.EIO,
            "message": e.strerror if isinstance(e, OSError) and e.strerror else str(e)}


def identify_roots(roots: Sequence[Path], create: bool = True) -> list[str]:
    """Each root's id (made, with the root, when ``create``; without, a root that has none
    stands for itself by path), refusing two roots that are one directory."""
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
    return ids


def discover_layout(coord: Coordinator, roots: Sequence[Path], *, create: bool = True,
                    failed: BaseException | None = None) -> RootLayout:
    """Collective: every rank's roots' ids -> the shared root table. With ``create`` (writing)
    missing roots are made; without (reading only), a root without an id stands for itself, by
    path. ``failed``: an error this rank hit before this first collective, reported here so that
    every rank raises at once instead of waiting out the timeout.

    Rank 0 gathers every rank's ids and paths, builds the table (it leads its first root, the
    primary until choose_primary says otherwise) and sends each rank only its part: its roots'
    table indices and leaders, the primary's entry, the table's size and whether any root is
    shared (a scatter). A rank receives what its own roots take, whatever the world size."""
    mine: dict = {}
    error = failed
    ids: list[str] = []
    try:
        if failed is not None:
            raise failed
        ids = identify_roots(roots, create)
        mine = {"roots": [[i, str(r.resolve())] for i, r in zip(ids, roots)]}
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    table: tuple[RootInfo, ...] = ()

    def decide(everyone: list[dict]) -> list[dict]:
        nonlocal table
        table, where = build_table(everyone)
        return layout_parts(table, where)

    part, _ = decide_at_rank0(coord, mine if error is None else {"error": describe(error)}, "opening the roots",
                              decide)
    raise_decided(part, error, "opening the checkpoint roots",
                   "no root was changed; fix the failing rank's roots and open again")
    if table:
        return RootLayout(coord.rank, coord.world_size, table, tuple(roots), tuple(ids),
                          tuple(g for g, _, _ in part["mine"]), table[0].path)
    return layout_of_part(coord.rank, coord.world_size, roots, ids, part)


def layout_parts(table: Sequence[RootInfo], where: Sequence[Sequence[int]]) -> list[dict]:
    """Each rank's part of ``table`` (``where[r]``: rank r's roots' table indices): its roots'
    indices, paths and leaders, the primary's entry, the table's size and whether any root is
    shared. A part's size is its rank's roots', whatever the world size."""
    first = table[0]
    common = {"primary": [first.id, first.path, min(first.ranks)], "count": len(table),
              "shares": any(len(info.ranks) > 1 for info in table)}
    return [{**common, "mine": [[g, table[g].path, min(table[g].ranks)] for g in mine],
             "counts": [len(table[g].ranks) for g in mine]} for mine in where]


def layout_of_part(rank: int, world_size: int, roots: Sequence[Path], ids: Sequence[str], part: dict) -> RootLayout:
    """The layout of a rank that received ``part`` (layout_parts) for its ``roots`` (ids ``ids``)."""
    counts = part.get("counts") or [1] * len(part["mine"])
    known = {int(g): KnownRoot(rid, path, int(leader), int(n))
             for (g, path, leader), rid, n in zip(part["mine"], ids, counts)}
    pid, ppath, pleader = part["primary"]
    known[0] = KnownRoot(pid, ppath, int(pleader))
    return RootLayout(rank, world_size, (), tuple(roots), tuple(ids), tuple(int(g) for g, _, _ in part["mine"]),
                      ppath, known, int(part["count"]), bool(part["shares"]))


def probe_led(layout: RootLayout) -> dict:
    """What the roots this rank leads hold, for choose_primary: per table root (str index), the
    steps committed on it (as if it were a primary), the step ``latest`` names there, and the
    primary ids that its secondary step directories name. Reads only."""
    return {str(layout.local_to_global[i]): probe_root(layout.local_paths[i]) for i in layout.led}


def probe_root(root: Path) -> dict:
    """What root ``root`` holds, for choose_primary (probe_led's entry of one root). Reads only."""
    probe = CommitProtocol([root])
    names = {owner_id for s, d in step_dirs(root) if not (d / MANIFEST_NAME).exists()
             for _, owner_id in [step_owner(d)] if owner_id}
    return {"committed": probe.committed_steps(), "latest": probe.latest(), "names": sorted(names),
            "copied": copied_steps(root)}


def choose_primary(layout: RootLayout, probes: dict) -> RootLayout:
    """The layout with the job's primary first (module docstring), from every leader's
    ``probe_led`` (merged: one entry per table root), on the rank holding the whole table
    (``settle_primary`` runs it on rank 0 and sends the decision). RootUnavailableError when
    several roots hold committed steps and none of them is rank 0's first root: which checkpoint
    to continue is then not the roots' to say."""
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
    copied = [(max(probes[str(g)].get("copied") or [-1]), -g) for g in range(len(table))]
    if named and not named & by_id.keys() and max(copied)[0] >= 0:
        # the primary root the secondaries name is no root of this job (its node is gone): the root
        # holding the newest copy of a global manifest becomes the primary (adopt_copies)
        return layout.with_primary(-max(copied)[1])
    mine = sorted({by_id[i] for i in probes["0"]["names"] if i in by_id and by_id[i] != 0})
    return layout.with_primary(mine[0]) if len(mine) == 1 else layout


def primary_of(layout: RootLayout, probes: dict) -> int:
    """The table index (in ``layout``) of the root choose_primary puts first."""
    chosen = choose_primary(layout, probes)
    return next(g for g, info in enumerate(layout.table) if info.id == chosen.table[0].id)


def settle_primary(coord: Coordinator, layout: RootLayout, probes: dict | None, error: BaseException | None,
                   what: str, hint: str) -> tuple[RootLayout, dict]:
    """Collective: choose the primary (choose_primary) from every leader's ``probes`` (this
    rank's probe_led, or ``error``: it failed before), gathered to rank 0, which holds the table
    and decides; every rank receives the decision alone (the primary's table index, entry and
    probe, or a bounded failure set, or the refusal that every rank raises alike). A primary
    that moved to another rank's root then gathers every rank's roots once more, to hold the
    table it writes into the manifests. Returns the layout and the primary's probe (its
    committed steps and ``latest``)."""
    got = coord.gather({"error": describe(error)} if error is not None else {"probes": probes}, what, dst=0)
    decision: dict = {}
    if got is not None:
        failures = {r: x["error"] for r, x in enumerate(got) if "error" in x}
        if failures:
            decision = bounded(failures)
        else:
            merged = {g: p for x in got for g, p in x["probes"].items()}
            try:
                g = primary_of(layout, merged)
                info = layout.table[g]
                decision = {"primary": g, "entry": [info.id, info.path, min(info.ranks)], "probe": merged[str(g)]}
            except Exception as e:  # noqa: BLE001 - raised alike on every rank
                error, decision = e, {"refused": refusal(e)}
    decision = coord.broadcast(decision, f"{what} (decision)", src=0)
    raise_decided(decision, error, what, hint)
    g = int(decision["primary"])
    pid, ppath, pleader = decision["entry"]
    moved = layout.with_primary(g, KnownRoot(pid, ppath, int(pleader)))
    probe = decision["probe"]
    if probe.get("copied") and not probe["committed"]:
        probe = adopt_copies(coord, moved, probe, what, hint)
    if g != 0:  # the new primary rank builds the table again from every rank's roots (in moved's order)
        mine = {"roots": [[i, str(r.resolve())] for i, r in zip(layout.local_ids, layout.local_paths)]}
        everyone = coord.gather(mine, f"{what} (the primary's table)", dst=moved.primary_rank)
        if everyone is not None:
            table, _ = build_table(everyone)
            moved = moved.with_whole_table((table[g],) + table[:g] + table[g + 1:])
    return moved, probe


def adopt_copies(coord: Coordinator, layout: RootLayout, probe: dict, what: str, hint: str) -> dict:
    """Collective, when choose_primary made a root holding copies of the global manifests the
    primary (the old primary's node is gone, issue 39): its leader makes each copy that checks
    its step's commit point (format/copies.py ``adopt_copy``), and every rank gets the primary's
    probe with those steps committed, so the cleaning keeps them and the job goes on from them
    (the next save commits on this root)."""
    adopted: list[int] = []
    error = None
    if coord.rank == layout.primary_rank:
        try:
            root = layout.local_paths[layout.local_of(0)]  # type: ignore[index]
            # the newest first: a crash midway leaves it committed, and the next open goes on from it
            adopted = [s for s in sorted(probe["copied"], reverse=True) if adopt_copy(root / step_dir_name(s))]
            if adopted:
                log.warning("gdswriter: the checkpoint's primary root is gone (no rank of this job has it); %s (id "
                            "%s), which holds copies of its manifests, is the primary now, with steps %s", root,
                            layout.primary_id, adopted)
            else:
                log.warning("gdswriter: the checkpoint's primary root is gone, and no copy of its manifests on %s "
                            "(steps %s) checks: none is adopted", root, probe["copied"])
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
    adopted = coord.decide(error, adopted, f"{what} (adopting the copies of the manifests)",
                           lambda outs: outs[layout.primary_rank], hint=hint, root=layout.primary_rank)
    return {**probe, "committed": sorted(adopted), "latest": max(adopted) if adopted else None}


def share_table(coord: Coordinator, layout: RootLayout, what: str) -> RootLayout:
    """Collective: ``layout`` holding the whole table on every rank, sent by the primary rank
    (each root's ranks as runs of consecutive ranks). O(roots) bytes per rank, for the loads
    that need every root's ranks (reading other ranks' manifest shards to reshard, a
    single-process checkpoint's roots): a load already receives the global manifest, which
    lists the same roots."""
    p = layout.primary_rank
    msg = None
    if coord.rank == p:
        msg = table_runs(layout.table)
    msg = coord.broadcast(msg, f"{what} (the root table)", src=p)
    if layout.holds_table:
        return layout
    return layout.with_whole_table(table_of_runs(msg))


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
        self.primary_id = layout.primary_id  # the ranks agreed on the roots: cleaning claims nothing
        self._committed = sorted(committed)

    def committed_steps(self) -> list[int]:
        return list(self._committed)


def clean_led(layout: RootLayout, committed: Sequence[int], keep: str | None = None) -> list[Path]:
    """Remove what interrupted saves left on the roots this rank leads (commit.py's cleaning:
    temporary and trash entries, secondary step directories of this checkpoint whose step
    the primary has not committed). Refuses (RootUnavailableError, nothing removed) when the
    primary has no committed step while
    - the primary itself holds step directories that another primary wrote as its secondary
      ones (rank 0 is on another node than at the save, and no root of this job is the
      primary they name: writing there would destroy them), or
    - a led secondary root holds steps that name the primary's path but not its id: they
      belong to another primary at that path (node-local disks, or an unmounted primary
      disk), and cleaning them would destroy that checkpoint's data.
    ``keep``: the current save's token (its entries stay: commit.py OrderedCommit, joint roots)."""
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
                        f"primary checkpoint root {root} (id {layout.primary_id}, rank {layout.rank}'s root) holds no "
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
                    if path == layout.primary_identity and owner_id != layout.primary_id]
            if held:
                raise RootUnavailableError(
                    errno.ENOENT,
                    f"primary checkpoint root {layout.primary_identity} (id {layout.primary_id}) holds no committed "
                    f"step, but secondary root {root} holds {len(held)} step director{'y' if len(held) == 1 else 'ies'} "
                    f"(steps {held[:5]}{' ...' if len(held) > 5 else ''}) written for another primary root at that "
                    f"path: is the right disk mounted there, and is rank 0 on the node that saved them? Start the job "
                    f"as it was saved (or mount the disk) and open the checkpoint again. gdswriter refuses to write "
                    f"(and never cleans) these roots until then; if that checkpoint is really abandoned, move those "
                    f"directories out of {root} yourself")
    removed = _LedRoots(layout, committed).clean_leftovers(keep)
    if removed:
        log.info("gdswriter: rank %d removed %d leftover(s) of interrupted saves", layout.rank, len(removed))
    return removed


def write_owner_files(layout: RootLayout, step_dir: Path) -> None:
    """Record in a secondary step directory of this checkpoint its primary: the primary's path
    and id, as format/commit.py records them."""
    write_owner(step_dir, layout.primary_identity, layout.primary_id)


def owned(layout: RootLayout, step_dir: Path) -> bool:
    """True when a secondary step directory was written for this checkpoint's primary root: by
    the primary's id when it names one, else (written before ids were recorded) by its path."""
    return owned_by(step_dir, layout.primary_identity, layout.primary_id)
