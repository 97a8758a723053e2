"""Opening a checkpoint's roots: one procedure, carried by either of two exchanges.

Opening the roots takes one round: every rank offers what it can learn of its roots alone
(``offer_roots``: each made if missing, its identity, created once, and what it holds; rank 0,
which leads every root it sees, locks them first), rank 0 decides from every offer
(``decide_roots``: the table of distinct roots, each root's leader's probe, the primary,
refused unless it is rank 0's where only rank 0 may commit, and each rank's part of the
table), and every rank takes its part (``take_roots``: its layout; another rank than 0 locks the
roots it leads and checks that they did not change since it probed them).

The round's gather and scatter are either the process group's (``open_roots``, for
session.open_session: the checkpointer's own channel, each failure reported to every rank) or
DCP's plan exchange (dcp_writer.py: the offer in the rank's local plan, the decision in
``prepare_global_plan``, the part back in its global plan: no collective of its own).
"""

from __future__ import annotations

import errno
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from ..errors import EngineIOError, RootUnavailableError
from ..format.commit import ROOT_MARKER_NAME, TMP_PREFIX, RootIdentity, RootLock
from ..fs import fsync_dir, link_no_clobber, write_durable
from .dcp_messages import RootsOffer
from .group import Coordinator, describe
from .roots import (
    RootLayout,
    build_table,
    decide_at_rank0,
    identify_roots,
    layout_of_part,
    layout_parts,
    lock_led,
    primary_of,
    probe_root,
    raise_decided,
    root_identity,
    table_runs,
    table_of_runs,
)

WHAT = "opening the checkpoint roots"
HINT = "no root was changed; fix the failing rank's roots (or close the other checkpointer) and open again"


@dataclass
class Opening:
    """What this rank learnt of its roots alone while it opens them (offer_roots): their paths
    and ids, the offer it sends rank 0, and rank 0's lock on its roots (taken before probing)."""
    paths: list[Path]
    ids: list[str]
    offer: RootsOffer
    lock: RootLock | None = None
    whole: bool = True  # whether its probes list every committed step (probe_for_save)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@dataclass(frozen=True)
class RootsDecision:
    """Rank 0's decision (decide_roots): its own layout (the whole table, the primary first),
    each rank's part of the table, and the primary's probe (its committed steps, ``latest``)."""
    layout: RootLayout
    parts: list[dict]
    probe: dict


def probe_for_save(root: Path, *, whole: bool) -> dict:
    """roots.probe_root of ``root``; not ``whole``: only its last three committed steps (all that
    choose_primary and its refusals read of a root that cannot be the primary)."""
    probe = probe_root(root)
    if not whole:
        probe["committed"] = probe["committed"][-3:]
    return probe


def offer_roots(roots: Sequence[Path], rank: int, *, whole: bool = True) -> Opening:
    """Local: each root made if missing, its identity (created once), and what it holds
    (roots.probe_root). Rank 0, the lowest rank, leads every root it sees: it locks them all
    before probing them; another rank does not know yet which roots it leads, so it probes them
    unlocked and checks them again once it holds their lock (take_roots). ``whole=False``: a
    probe lists only the last committed steps (where the primary can only be rank 0's)."""
    roots = list(roots)
    ids = identify_roots(roots)
    lock = RootLock(roots) if rank == 0 else None
    try:
        probes = [probe_for_save(r, whole=whole or rank == 0) for r in roots]
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    offer = RootsOffer(tuple((i, str(r.resolve())) for i, r in zip(ids, roots)), tuple(probes))
    return Opening(roots, ids, offer, lock, whole or rank == 0)


def decide_roots(own: Opening, offers: Sequence[RootsOffer], *, movable_primary: bool) -> RootsDecision:
    """Rank 0: the table of distinct roots (by identity), the primary (roots.choose_primary, from
    each root's leader's probe), each rank's part of the table (roots.layout_parts: what its own
    roots take; the primary rank's also the whole table, which it writes into the manifests).
    ``movable_primary``: another rank than 0 may lead the primary (GDSCheckpointer); else
    (DCP's coordinator commits) such a primary is refused, RootUnavailableError."""
    table, where = build_table([o.to_wire() for o in offers])
    probes = {}
    for g, info in enumerate(table):
        leader = min(info.ranks)
        probes[str(g)] = offers[leader].probes[where[leader].index(g)]
    found = RootLayout(0, len(offers), table, tuple(own.paths), tuple(own.ids), tuple(where[0]), table[0].path)
    g = primary_of(found, probes)
    layout = found.with_primary(g)
    if layout.primary_rank != 0 and not movable_primary:
        raise primary_not_on_rank_0(layout)
    index = {info.id: h for h, info in enumerate(layout.table)}
    parts = layout_parts(layout.table, [[index[rid] for rid, _ in o.roots] for o in offers])
    if layout.primary_rank != 0:
        parts[layout.primary_rank]["table"] = table_runs(layout.table)
    return RootsDecision(layout, parts, probes[str(g)])


def take_roots(opening: Opening, rank: int, world_size: int, part: dict) -> RootLayout:
    """Another rank than 0: its layout from its ``part`` of rank 0's decision (the primary rank
    with the whole table)."""
    layout = layout_of_part(rank, world_size, opening.paths, opening.ids, part)
    if "table" in part:
        layout = layout.with_whole_table(table_of_runs(part["table"]))
    return layout


def lock_checked(layout: RootLayout, opening: Opening) -> RootLock:
    """Another rank than 0: lock the roots it leads and probe them again: one that changed since
    offer_roots probed it (another job wrote there before this rank held its lock) is refused,
    RootUnavailableError, as rank 0 decided on what it saw before."""
    lock = lock_led(layout)
    for i in layout.led:
        root = layout.local_paths[i]
        if probe_for_save(root, whole=opening.whole) != opening.offer.probes[i]:
            lock.release()
            raise RootUnavailableError(
                errno.EAGAIN, f"checkpoint root {root} changed while this save opened it (another writer "
                              f"saved there before rank {layout.rank} held its lock); nothing was written to it: "
                              f"save again")
    return lock


def relock(layout: RootLayout) -> RootLock:
    """Lock the roots a kept layout's rank leads again, after checking that each of its roots is
    still the one opened (one deleted since gets its directory and id back; one replaced by
    another root raises RootUnavailableError: open the roots afresh)."""
    for path, ident in zip(layout.local_paths, layout.local_ids):
        found = root_identity(path, create=False) if path.is_dir() else None
        if found is None and not ident.startswith("path:"):
            restore_identity(path, ident)
            found = root_identity(path, create=False)
        if found != ident:
            raise RootUnavailableError(
                errno.ESTALE, f"checkpoint root {path} is not the root this writer's previous save wrote to (its "
                              f"{ROOT_MARKER_NAME} says {found}, not {ident}): it was replaced by another "
                              f"directory; nothing was written, and the next save opens the roots afresh")
    return lock_led(layout)


def restore_identity(path: Path, ident: str) -> None:
    """Give root ``path`` (deleted since it was opened) its directory and id back, as
    format/commit.py creates a marker (durable, no-clobber: ranks sharing the root may race)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        marker = path / ROOT_MARKER_NAME
        tmp = path / f"{TMP_PREFIX}{ROOT_MARKER_NAME}-{secrets.token_hex(4)}"
        write_durable(tmp, RootIdentity(ident, time.time(), socket.gethostname(), str(path.resolve())).to_json_bytes())
        if link_no_clobber(tmp, marker):
            fsync_dir(path)
            fsync_dir(path.parent)
    except OSError as e:
        raise EngineIOError(e.errno or errno.EIO, path / ROOT_MARKER_NAME, 0, "restore root identity") from e


def open_roots(coord: Coordinator, roots: Sequence[Path], *, failed: BaseException | None = None,
               movable_primary: bool = True) -> tuple[RootLayout, RootLock, dict]:
    """Collective, over ``coord``: the round of the module docstring, its offers gathered to rank
    0 and the parts scattered; a rank's failure (``failed``: one it hit before), or rank 0's
    refusal, raised on every rank; then the locks of the roots each rank leads, agreed. Returns
    this rank's layout, its lock and the primary's probe."""
    opening, error = None, failed
    if error is None:
        try:
            opening = offer_roots(roots, coord.rank)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
    decided = None

    def decide(got: list[dict]) -> list[dict]:
        nonlocal decided
        assert opening is not None
        decided = decide_roots(opening, [RootsOffer.from_wire(x["offer"]) for x in got],
                               movable_primary=movable_primary)
        return [{**p, "probe": decided.probe} for p in decided.parts]

    part, refused = decide_at_rank0(coord, {"error": describe(error)} if opening is None else
                                    {"offer": opening.offer.to_wire()}, WHAT, decide)
    error = error or refused
    try:
        raise_decided(part, error, WHAT, HINT)
    except BaseException:
        if opening is not None:
            opening.release()
        raise
    assert opening is not None
    return _locked(coord, opening, decided, part)


def _locked(coord: Coordinator, opening: Opening, decided: RootsDecision | None,
            part: dict) -> tuple[RootLayout, RootLock, dict]:
    """open_roots' end: this rank's layout and its led roots locked (rank 0's since its offer),
    every rank's outcome agreed."""
    lock, error = opening.lock, None
    layout = decided.layout if decided is not None else take_roots(opening, coord.rank, coord.world_size, part)
    if lock is None:
        try:
            lock = lock_checked(layout, opening)
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
    try:
        coord.agree(error, f"{WHAT} (locking)", hint=HINT)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    assert lock is not None
    return layout, lock, part["probe"]


def primary_not_on_rank_0(layout: RootLayout) -> RootUnavailableError:
    """The refusal of a primary root (roots.choose_primary) that is not rank 0's where only rank 0
    commits (DCP's coordinator, which commits in finish(), is rank 0)."""
    info = layout.root(0)
    return RootUnavailableError(
        errno.ENOENT,
        f"the checkpoint's primary root (id {info.id}, holding its manifests) is rank "
        f"{layout.primary_rank}'s {info.path}, not one of rank 0's roots: rank 0 is on another node than "
        f"when it was saved. dcp.save commits on rank 0: start the job with rank 0 on the node that holds "
        f"that root (or give rank 0 that root first); nothing was changed")
