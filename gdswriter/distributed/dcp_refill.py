"""Refill of a DCP step after a load from copies or parity (issue 39 item 3 for the DCP plug-in; format.md 9.5).

A DCP load (``GDSStorageReader``) of a step saved with ``replicas=C`` where a node was replaced
(a table root of the step no rank reaches: its disk at the same path is empty) reads that node's
ranks' files from their copies; the step then keeps one copy fewer of them, and of the copies
the lost root held, until the next save. The reader then refills it in the background, on a
channel of its own (``DcpRefill``), over replication's verified stream (refill.py ``move_files``):

1. Every rank names the copy directories (``copies/rank<R>``) on the roots it looked at and the
   ``protected`` marker's copies there (one fixed-size gather to rank 0, which decides the moves
   and broadcasts them: their number is that of the lost node's ranks and of the ranks whose
   copies it held, never the world size). ``plan_dcp_refill`` (pure): each lost root's ranks get
   their files back on the replacement root (the same path, now seen by the lowest of its ranks),
   read from the copy the load read; so do the load's ``unfit`` files, read from a copy though
   their root is reached (missing or of the wrong size there, as a refill killed midway leaves
   them, or failing their crc32c in the fetch), written by the rank looking at that root; each
   rank left with fewer than C - 1 copies on the roots reached gets one on a refilled root (a
   lost one first); rank 0's files carry the committed manifest, written as
   ``copies/manifest.json`` beside them (with ``copies/protected``). The copies move first,
   the own files last: a refill stopped before its end leaves some own file missing, so the
   next load refills again (all files there: the copies are too).
2. Each file streams from the rank that sees it, every chunk checked against the crc32c the
   manifest records, into a ``.tmp-`` folder of ``step_S/copies`` on the replacement root, each
   file fdatasynced and checked against the sender's crc32c (a rank that sees both the copy's
   root and the target's, as one process seeing both disks, is sender and receiver: the same
   read and checks, in one process, ``_local_move``), then renamed whole to
   ``copies/rank<R>`` (a rank's own files then moved up into ``step_S``, beside the owner files
   naming the primary; a damaged file is replaced by that rename, after the load: a reader
   holding it open keeps the old bytes). A crash leaves the ``.tmp-`` folder, which no load
   reads and the next load of the step removes (dcp_leftovers.py); that load finds the files
   still missing and refills them.
3. When every rank succeeded, the primary rank rewrites ``step_S/protected`` last; each
   reached root noted beside the manifest's copy (``verify --repair`` withdrew its
   ``copies/protected`` too: format/copies.py ``withdraw_everywhere``) gets it back and loses
   its note (a note a crash leaves is seen by the next load, ``Placed.noted``, which refills).

A step protected by parity (its ``protected`` names the group), whose load rebuilt the lost
members into ``copies/rank<R>`` on a surviving member's root (parityload.rebuild_members), is
refilled alike: each lost rank's files move from that rebuilt copy (step 1: nothing else, no
copies to top up); then, collectively, the parity block each lost rank stored is re-created
on its replacement root by the rank that received its files (parityrefill.py
``refill_lane_stripes``, GDSCheckpointer's code: every member's chunk checked against the crc32c
its description records, the block fsynced and read back before its description is written);
step 3 writes the group's marker (removed at the start, ``parity/refilling`` keeping the group
meanwhile: the step lacks a member's files or block until then, and claims no protection it
lacks; ``_mark``); a load that finds a member's block missing or cut short on a reached root
(``Placed.stripes``: a refill stopped after the files landed) re-creates it alike, written by
the rank looking at that root, no file moving; then each rank that sent a rebuilt copy removes it
(refill.py ``drop_copy``: renamed, fsynced, deleted), so disk use does not grow per load. A
copy the load held in memory (no root could be written) is gone after the load: not refilled.

The 1.2 manifest is not rewritten (its own commit point): the replacement root is found by its
path, as at the load that triggered the refill."""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CollectiveFailedError, GDSWriterError, ReplicationError
from ..format.commit import step_dir_name, write_owner
from ..format.copies import (DAMAGED_PREFIX, drop_damage_in, refilling_marker, restore_holders,
                              restore_protection, step_lock, withdraw_protection, write_note)
from ..format.manifest import MANIFEST_NAME, ChunkRecord, Manifest
from ..format.parity import PARITY_DIR
from ..format.replicas import COPIES_DIR, PROTECTED_NAME, copy_dir_name, parity_marker, protected_marker
from ..format.sharded import parse_step
from ..fs import atomic_write, read_regular_file
from .dcp_leftovers import RefillLocks
from .dcp_replicas import REFILLING_NAME, Placed
from .group import Coordinator, describe
from .parityload import StepRoots
from .parityrefill import refill_lane_stripes
from .refill import FileMove, drop_copy, durable_copies_dir, move_files, publish_copy
from .replicastream import Incoming, Outgoing, Source
from .roots import RootLayout

log = logging.getLogger("gdswriter")
_RANK_FILE = re.compile(r"^data-rank(\d+)-")
_COPY_DIR = re.compile(r"^rank(\d+)$")
_ASIDE = re.compile(rf"^{re.escape(DAMAGED_PREFIX)}rank(\d+)-[0-9a-f]+$")  # a copy verify --repair set aside
MANIFEST_LIMIT = 1 << 30
LOCAL_PIECE = 8 << 20  # a move within one rank (it sees both roots) copies in pieces of this size


@dataclass(frozen=True)
class DcpMove:
    """Rank ``rank``'s files ``files`` (indices into the manifest's), read by ``sender`` at
    ``prefix`` in the step directory on table root ``source``, written by ``receiver`` on its
    root at the lost table root ``target``'s path (``own``: moved up into the step directory)."""

    rank: int
    source: int
    prefix: str
    sender: int
    receiver: int
    target: int
    own: bool
    files: tuple[int, ...]

    def wire(self) -> list:
        return [self.rank, self.source, self.prefix, self.sender, self.receiver, self.target, self.own,
                list(self.files)]


def plan_dcp_refill(m: Manifest, placed: Placed, checkers: dict[int, int], copies: dict[int, int],
                    c: int, aside: Sequence[tuple[int, int]] = ()) -> list[DcpMove]:
    """Pure, on rank 0 (module docstring, 1): ``placed`` the load's placement (its ``lost``
    roots and its ``unfit`` files, each pointed at a copy), ``checkers`` the rank looking at
    each reached root, ``copies`` the number of ``copies/rank<R>`` directories per rank R on
    reached roots, ``c`` the step's copies, ``aside`` (root g, rank R): rank R's copy on reached
    root g set aside by ``verify --repair`` (a ``.damaged-rank<R>-`` folder, no ``rank<R>``),
    re-created there from R's own files. A lost root is written by the lowest of its ranks,
    a reached root's unfit files by the rank looking at it."""
    assert m.dist is not None
    roots, lost = m.dist.roots, list(placed.lost)
    unfit = set(placed.unfit)
    moves: list[DcpMove] = []
    on_lost = {r for j in lost for r in roots[j].ranks}
    writer = {j: min(roots[j].ranks) for j in lost}
    writer.update({m.files[i].root: checkers[m.files[i].root] for i in sorted(unfit) if m.files[i].root in checkers})
    groups: dict[tuple[int, int, str], list[int]] = {}
    for i, f in enumerate(m.files):
        if f.root in lost or i in unfit:
            at = placed.m.files[i]
            groups.setdefault((f.root, at.root, at.path.rsplit("/", 1)[0] if "/" in at.path else ""), []).append(i)
    for (j, g, prefix), files in sorted(groups.items(), key=lambda kv: (kv[0][0] not in lost, kv[0])):
        k = _COPY_DIR.match(prefix.rsplit("/", 1)[-1])
        if k is None or g not in checkers or j not in writer:
            raise GDSWriterError(f"table root {j}'s files are read from {prefix or 'their root'} on table root "
                                 f"{g}, not from one rank's copy: not refilled")
        moves.append(DcpMove(int(k.group(1)), g, prefix, checkers[g], writer[j], j, True, tuple(files)))
    by_rank: dict[int, list[int]] = {}  # one pass over the files, not one per rank
    for i, f in enumerate(m.files):
        if (k := _RANK_FILE.match(f.path)) is not None:
            by_rank.setdefault(int(k.group(1)), []).append(i)
    repaired = _repairs(m, aside, checkers, by_rank, on_lost | {r for r, mine in by_rank.items()
                                                                 if unfit.intersection(mine)})
    moves += repaired
    for r in range(m.dist.world_size):
        if r in on_lost or copies.get(r, 0) >= c - 1 or any(mv.rank == r for mv in repaired):
            continue
        mine = by_rank.get(r, [])
        where = {m.files[i].root for i in mine}
        j = next((j for j in writer if r not in roots[j].ranks), None)  # a lost root first, then a refilled one
        if not mine or j is None or len(where) != 1 or min(where) not in checkers or unfit.intersection(mine):
            continue
        g = min(where)
        moves.append(DcpMove(r, g, "", checkers[g], writer[j], j, False, tuple(mine)))
    # the copies first, a root's own files last: a refill stopped midway leaves some own file missing,
    # which the next load finds (place_files' size check) and refills, copies included
    return sorted(moves, key=lambda mv: mv.own)


def _repairs(m: Manifest, aside: Sequence[tuple[int, int]], checkers: dict[int, int], by_rank: dict[int, list[int]],
             skip: set[int]) -> list[DcpMove]:
    """``plan_dcp_refill``'s moves of the copies ``verify --repair`` set aside: rank R's files
    (all on one reached root, not ``skip``: lost, or read from a copy) sent by the rank looking
    at their root to the rank looking at the root whose copy was set aside."""
    moves = []
    for g, r in sorted(set(map(tuple, aside))):  # type: ignore[arg-type]
        mine = by_rank.get(r, [])
        where = {m.files[i].root for i in mine}
        if r in skip or len(where) != 1 or g in where or g not in checkers or min(where) not in checkers:
            continue
        src = min(where)
        moves.append(DcpMove(r, src, "", checkers[src], checkers[g], g, False, tuple(mine)))
    return moves


def _chunks(m: Manifest, files: tuple[int, ...]) -> dict[int, list[ChunkRecord]]:
    """The chunks the manifest records in each of ``files`` (each checked as the file streams):
    one pass over the storages."""
    out: dict[int, list[ChunkRecord]] = {i: [] for i in files}
    for s in m.storages:
        for c in s.chunks:
            if c.file in out:
                out[c.file].append(c)
    return out


@dataclass(frozen=True)
class DcpRefillJob:
    """What a refill needs of its load: the manifest, the placement, this rank's roots; the
    locks it holds on the ``copies`` directories it writes into while it runs (dcp_leftovers.py:
    no other reader's load removes its temporaries)."""

    m: Manifest
    placed: Placed
    layout: RootLayout
    locks: RefillLocks = field(default_factory=RefillLocks, compare=False)


def _survey(job: DcpRefillJob) -> dict:
    """This rank's part of the gather: the copy directories per rank and the ``protected``
    marker's copies on the roots it looked at."""
    d = step_dir_name(job.m.step)
    ranks: list[int] = []
    aside: list[list[int]] = []
    c = n = 0
    for g in job.placed.check:
        base = job.placed.reach[g] / d  # type: ignore[operator]
        for marker in (base / PROTECTED_NAME, base / COPIES_DIR / PROTECTED_NAME,  # copies/: beside the manifest's copy
                       base / PARITY_DIR / REFILLING_NAME,  # a parity refill stopped after it unprotected the step
                       base / COPIES_DIR / REFILLING_NAME):  # verify --repair set a copy aside
            try:
                body = json.loads(read_regular_file(marker, 4096))
                c, n = max(c, int(body.get("copies", 0))), max(n, int(body.get("parity_group", 0)))
            except (OSError, ValueError, GDSWriterError, AttributeError):
                pass
        try:
            names = os.listdir(base / COPIES_DIR)
        except OSError:
            continue
        here = [int(k.group(1)) for p in names if (k := _COPY_DIR.match(p)) and (base / COPIES_DIR / p).is_dir()]
        ranks += here
        aside += [[g, int(k.group(1))] for p in names if (k := _ASIDE.match(p)) and int(k.group(1)) not in here]
    return {"copies": ranks, "c": c, "parity": n, "aside": aside}


def _sources(job: DcpRefillJob, mv: DcpMove) -> list[Source]:
    """The files of one move where the sender reads them, with the committed manifest for rank 0's."""
    m, d = job.m, step_dir_name(job.m.step)
    base = job.placed.reach[mv.source] / d  # type: ignore[operator]
    chunks = _chunks(m, mv.files)
    out = [Source("data", m.files[i].path, m.files[i].size,
                  path=base / mv.prefix / m.files[i].path if mv.prefix else base / m.files[i].path,
                  chunks=tuple(chunks[i])) for i in mv.files]
    if mv.rank == 0:
        at = base / MANIFEST_NAME
        raw = read_regular_file(at if at.is_file() else base / COPIES_DIR / MANIFEST_NAME, MANIFEST_LIMIT)
        got = parse_step(raw, str(at))
        if not isinstance(got, Manifest) or got.step != m.step:
            raise GDSWriterError(f"{at}: not step {m.step}'s DCP manifest")
        out.append(Source("global", MANIFEST_NAME, len(raw), data=raw))
    return out


def _copies_dir(job: DcpRefillJob, mv: DcpMove) -> Path:
    """``step_S/copies`` on this rank's root at the lost root's path, made durably (the step
    directory with the owner files naming the step's primary), locked shared until the refill
    ends (dcp_leftovers.RefillLocks) before anything is written into it."""
    assert job.m.dist is not None
    want = job.m.dist.roots[mv.target].path
    root = next((p for p in job.layout.local_paths if str(p.resolve()) == want), None)
    if mv.target not in job.placed.lost and mv.target < len(job.placed.reach):  # a reached root: where this rank sees it
        root = job.placed.reach[mv.target] or root
    if root is None:
        raise GDSWriterError(f"no root of this rank is at {want} (the replaced root's path): not refilled")
    primary = job.m.dist.roots[0]
    return job.locks.hold(durable_copies_dir(root, job.m.step, lambda d: write_owner(d, primary.path, primary.id)))


def _local_move(job: DcpRefillJob, mv: DcpMove) -> list[str]:
    """A move whose sender is its receiver (a rank seeing both the copy's root and the target's):
    the files copied locally with move_files' checks (replicastream's Outgoing read, every chunk
    against its crc32c, into an Incoming: each file fdatasynced and checked against the crc32c
    of what was read, the folder renamed whole, the own files moved up); what failed."""
    try:
        out = Outgoing(_sources(job, mv), None)
        inc = Incoming(_copies_dir(job, mv), mv.rank, out.header)
    except Exception as e:  # noqa: BLE001 - reported to rank 0
        return [f"rank {mv.rank}'s files: {describe(e)}"]
    # page-aligned (O_DIRECT reads and writes); unmapped when collected: a read error Outgoing keeps holds
    # views of it in its traceback, so closing it here could fail
    view = memoryview(mmap.mmap(-1, LOCAL_PIECE))
    try:
        while n := out.fill(view):
            inc.write(view[:n])
        publish_copy(inc, json.loads(out.trailer()), mv.rank, mv.own)
    except Exception as e:  # noqa: BLE001 - reported to rank 0
        inc.discard()
        return [f"rank {mv.rank}'s files: {describe(e)}"]
    finally:
        out.close()
    return []


def _plan(coord: Coordinator, job: DcpRefillJob, what: str) -> tuple[list[DcpMove], int, int]:
    """Collective: the moves (rank 0 decides from every rank's survey), the step's copies and
    its parity group (0: none)."""
    error, mine = None, {"copies": [], "c": 0, "parity": 0, "aside": []}
    try:
        mine = _survey(job)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e

    def rule(outs: list) -> dict:
        count: dict[int, int] = {}
        for o in outs:
            for r in o["copies"]:
                count[r] = count.get(r, 0) + 1
        c, n = max(o["c"] for o in outs), max(o["parity"] for o in outs)
        if c < 2 and n < 2:
            return {"moves": [], "c": c, "parity": 0}
        aside = [] if n >= 2 else [x for o in outs for x in o["aside"]]
        moves = plan_dcp_refill(job.m, job.placed, job.placed.checkers or {}, count, 1 if n >= 2 else c, aside)
        return {"moves": [mv.wire() for mv in moves], "c": c, "parity": n if n >= 2 else 0}

    got = coord.decide(error, mine, f"{what} (planning)", rule)
    return ([DcpMove(r, g, p, s, d, t, bool(o), tuple(f)) for r, g, p, s, d, t, o, f in got["moves"]], got["c"],
            got["parity"])


def run_dcp_refill(coord: Coordinator, job: DcpRefillJob) -> bool:
    """Collective on the refill channel (module docstring): True when the step was refilled; the
    locks on the ``copies`` directories written into released at its end, whatever it was."""
    held: list[int] = []
    try:
        return _refill(coord, job, held)
    finally:
        job.locks.release()
        for fd in held:
            os.close(fd)


def _hold_step(coord: Coordinator, job: DcpRefillJob, what: str) -> list[int]:
    """Collective, first: the primary rank takes the step's lock shared (format/copies.py
    ``step_lock``; ``verify --repair`` takes it exclusive), before any rank looks for what to
    re-create, so a repair never sets a copy aside that this refill counted, nor withdraws the
    ``protected`` it writes back; refused (a repair runs), the refill fails on every rank
    (the step loads as it did; the next load refills). The descriptor held, on the primary rank."""
    error, held = None, []
    layout = job.layout
    if coord.rank == layout.primary_rank:
        local = layout.local_of(0)
        d = layout.local_paths[local if local is not None else 0] / step_dir_name(job.m.step)
        try:
            if d.is_dir():  # else a replaced primary root: no repair can run on a step directory not there yet
                held.append(step_lock(d, exclusive=False))
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
    try:
        coord.agree(error, f"{what} (the step's lock)", root=layout.primary_rank)
    except GDSWriterError as e:
        for fd in held:
            os.close(fd)
        if isinstance(e, (ReplicationError, CollectiveFailedError)):
            raise
        raise ReplicationError(f"DCP step {job.m.step} was loaded but not refilled: {describe(e)}",
                               job.m.step) from e
    return held


def _refill(coord: Coordinator, job: DcpRefillJob, held: list[int]) -> bool:
    """``run_dcp_refill``'s work (``held``: the step lock's descriptor, closed by the caller)."""
    step = job.m.step
    what = f"refilling DCP step {step}"
    held += _hold_step(coord, job, what)
    moves, c, parity = _plan(coord, job, what)
    if not moves and not (parity and job.placed.stripes) and not job.placed.noted:
        return False
    marker = parity_marker(parity) if parity else protected_marker(c)
    zero = tuple(mv for mv in moves if parity and mv.rank == 0 and mv.own and mv.receiver == coord.rank)
    if parity:  # the step lacks a member's files or parity block until the end: not protected meanwhile
        _mark(coord, job, marker, what, refilling=True, zero=zero)
    problems: list[str] = []
    for mv in moves:
        if coord.rank == mv.sender == mv.receiver:  # this rank sees both roots: no stream
            problems += _local_move(job, mv)
        elif coord.rank in (mv.sender, mv.receiver):
            problems += move_files(coord, FileMove(step, mv.rank, mv.sender, (mv.receiver,), mv.own),
                                   lambda mv=mv: _sources(job, mv), lambda mv=mv: _copies_dir(job, mv), what)
            if coord.rank == mv.receiver and mv.rank == 0 and not problems and not parity:  # parity: at the end
                try:
                    atomic_write(_copies_dir(job, mv) / PROTECTED_NAME, marker)
                except Exception as e:  # noqa: BLE001 - reported to rank 0
                    problems.append(describe(e))
    if parity and (job.placed.stripes or any(mv.own and mv.target in job.placed.lost for mv in moves)):
        problems += _stripes(coord, job, moves, what)
    failed = coord.decide(None, "; ".join(problems)[:2000], f"{what} (outcomes)",
                          lambda outs: [[r, m] for r, m in enumerate(outs) if m][:8])
    if failed:
        raise ReplicationError(f"DCP step {step} was loaded but not refilled: "
                               f"{'; '.join(f'rank {r}: {m}' for r, m in failed)}; it loads as it did, with fewer "
                               f"copies; fix what the message names (a full or failing disk?) and load again", step)
    _mark(coord, job, marker, what, refilling=False, zero=zero)
    if parity:  # the copies the load rebuilt, read by this refill: the step is protected without them
        _drop_rebuilt(coord, job, moves)
    _drop_damage(job)
    return True


def _drop_damage(job: DcpRefillJob) -> None:
    """The ``.damaged-`` entries ``verify --repair`` set aside on the roots this rank looks at,
    removed once what they held is re-created (format/copies.py ``drop_damage_in``)."""
    drop_damage_in((job.placed.reach[g] / step_dir_name(job.m.step)  # type: ignore[operator]
                    for g in job.placed.check[:len(job.m.dist.roots)]), f"DCP step {job.m.step}")  # type: ignore[union-attr]


def _drop_rebuilt(coord: Coordinator, job: DcpRefillJob, moves: list[DcpMove]) -> None:
    """A parity step's rebuilt copies removed once it is protected again: those this rank sent,
    and on the roots it looks at those of the ranks whose block was re-created alone (a copy a
    stopped refill left: a parity step holds no other ``copies/rank<R>``)."""
    step = job.m.step
    for mv in moves:
        if mv.sender == coord.rank and mv.own:
            drop_copy(job.placed.reach[mv.source] / step_dir_name(step) / mv.prefix.rsplit("/", 1)[0],  # type: ignore[operator]
                      mv.rank, step)
    for g in job.placed.check[:len(job.m.dist.roots)]:  # type: ignore[union-attr]
        copies = job.placed.reach[g] / step_dir_name(step) / COPIES_DIR  # type: ignore[operator]
        for r in job.placed.stripes:
            if (copies / copy_dir_name(r)).is_dir():
                drop_copy(copies, r, step)


def _stripes(coord: Coordinator, job: DcpRefillJob, moves: list[DcpMove], what: str) -> list[str]:
    """Collective: the parity block each lost rank stored, re-created on its replacement root
    by the rank that received its files (parityrefill.refill_lane_stripes, as GDSCheckpointer's
    refill does); what failed here."""
    assert job.m.dist is not None
    roots, placed = tuple(job.m.dist.roots), job.placed
    ranks = placed.checkers if coord.rank == 0 and placed.checkers is not None else \
        {g: coord.rank for g in placed.check}
    seen = {roots[g].id: (r,) for g, r in ranks.items() if g < len(roots)}  # not a copy held in memory
    own = {mv.rank: mv for mv in moves if mv.own and mv.target in placed.lost}  # a reached root keeps its block

    def own_root(k: int) -> int:
        return next(j for j, info in enumerate(roots) if k in info.ranks)
    writers = {r: mv.receiver for r, mv in own.items()}
    # a block missing on a reached root (a refill stopped after the files): written by the rank looking at it
    # (known on rank 0, which plans the stripes: the others need the ranks alone)
    writers.update({r: ranks.get(own_root(r), -1) for r in placed.stripes if r not in writers})

    def step_dir(r: int) -> Path:
        if r in own:
            return _copies_dir(job, own[r]).parent
        return placed.reach[own_root(r)] / step_dir_name(job.m.step)  # type: ignore[operator]
    try:
        return refill_lane_stripes(coord, StepRoots(job.m.step, roots), placed.reach[:len(roots)], seen, own_root,
                                   writers, step_dir, what, 0)
    except (ReplicationError, CollectiveFailedError):
        raise
    except GDSWriterError as e:
        raise ReplicationError(f"DCP step {job.m.step} was loaded but not refilled ({describe(e)}); it loads as it "
                               f"did, rebuilding its lost members at each load", job.m.step) from e


def _mark(coord: Coordinator, job: DcpRefillJob, marker: bytes, what: str, refilling: bool,
          zero: tuple[DcpMove, ...] = ()) -> None:
    """The primary rank's ``step_S/protected``: rewritten last once every rank's files are
    durable (``refilling`` False); for a parity step, at the start (``refilling`` True) the
    marker removed (the step lacks a member's files or parity block until the refill ends: it
    claims no protection it lacks) with ``parity/refilling`` (the marker's body) written first,
    so a load after a stop still knows the step's group and refills it; removed after the
    rewrite. ``zero``: a parity step's moves of rank 0's files that this rank receives (onto a
    replaced root, where the manifest's copy lands): its step directory is made at the start
    (it does not exist yet) and noted alike; at the end, each root this rank looks at that holds
    the note beside the manifest's copy gets its ``copies/protected`` (written then only), and
    the note goes. Collective: every rank learns the outcome."""
    error = None
    layout = job.layout
    try:
        if coord.rank == layout.primary_rank:
            local = layout.local_of(0)
            _marks(job, layout.local_paths[local if local is not None else 0] / step_dir_name(job.m.step), marker,
                   refilling)
            if not refilling:
                log.warning("gdswriter: DCP step %d is refilled: the files of replaced root(s) %s and %d file(s) "
                            "missing or damaged on reached roots re-created from their copies%s, and the step is "
                            "protected again", job.m.step, list(job.placed.lost), len(job.placed.unfit),
                            f" (rebuilt from parity) and the parity blocks of ranks "
                            f"{sorted(set(job.placed.stripes) | _lost_ranks(job))}" if job.placed.parity else "")
        for mv in zero if refilling else ():
            write_note(_copies_dir(job, mv).parent, marker, parity=True)
        if not refilling:  # the roots noted beside the manifest's copy (this refill's, a stopped one's, or
            # verify --repair's, which withdrew copies/protected there too): the copy's marker back, the note gone
            for g in job.placed.check[:len(job.m.dist.roots)]:  # type: ignore[union-attr]
                base = job.placed.reach[g] / step_dir_name(job.m.step)  # type: ignore[operator]
                if refilling_marker(base) is not None and not (base / MANIFEST_NAME).exists():
                    restore_holders([base], marker)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} ({'unprotected' if refilling else 'protected'})", root=layout.primary_rank)


def _marks(job: DcpRefillJob, d: Path, marker: bytes, refilling: bool) -> None:
    """``_mark``'s files in the primary's step directory ``d`` (made, with its owner file, where
    it does not exist yet: a replaced root's)."""
    if refilling:
        if not d.is_dir():
            primary = job.m.dist.roots[0]  # type: ignore[union-attr]
            durable_copies_dir(d.parent, job.m.step, lambda x: write_owner(x, primary.path, primary.id))
        withdraw_protection(d, marker, parity=True)
        return
    restore_protection(d, refilling_marker(d) or marker)  # the note verify --repair wrote keeps the marker


def _lost_ranks(job: DcpRefillJob) -> set[int]:
    assert job.m.dist is not None
    return {k for j in job.placed.lost for k in job.m.dist.roots[j].ranks}


class DcpRefill:
    """A refill running in the background on its own channel (made at the load, collectively):
    ``wait()`` returns the step once refilled (None: nothing to refill) or raises its
    ReplicationError. The channel is given back by the first ``wait()`` that finds the refill
    ended (the reader's close, wait_refilled or next refilling load: every rank at the same
    point), never by the thread nor at a garbage collection: a channel given back goes to a pool
    the next ``Coordinator.create`` takes from, so a rank giving it back sooner than another
    would take the pooled group where the other creates a new one (a hang). A refill whose
    reader is dropped unclosed keeps its channel."""

    def __init__(self, process_group: Any, timeout_s: float, job: DcpRefillJob):
        self.job = job
        self.channel = Coordinator.create(process_group, timeout_s=timeout_s, label="GDSStorageReader(refill)")
        self.result: int | None = None
        self.error: ReplicationError | None = None
        self._thread = threading.Thread(target=self._run, name="gdswriter-dcp-refill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if run_dcp_refill(self.channel, self.job):
                self.result = self.job.m.step
        except ReplicationError as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - handed to wait()
            self.error = ReplicationError(f"DCP step {self.job.m.step} was loaded but not refilled: {describe(e)}; "
                                          f"it loads as it did, with fewer copies", self.job.m.step)
            self.error.__cause__ = e
            log.warning("gdswriter: %s", self.error)

    def running(self) -> bool:
        """Whether it still runs (its ``.tmp-`` folders are then its own, not a crash's)."""
        return self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ReplicationError(f"the refill of DCP step {self.job.m.step} is still running after {timeout} s; "
                                   f"call wait_refilled() again", self.job.m.step)
        self.channel.close()  # idempotent
        if self.error is not None:
            raise self.error
        return self.result


def start_refill(process_group: Any, timeout_s: float, job: DcpRefillJob) -> DcpRefill | None:
    """Collective (every rank of the load, alike): a DcpRefill of ``job``, or None where its
    channel could not be made (logged: the load stands, the step keeps its fewer copies)."""
    try:
        return DcpRefill(process_group, timeout_s, job)
    except Exception as e:  # noqa: BLE001 - the load's data is fetched: a refill failing costs redundancy only
        log.warning("gdswriter: DCP step %d was loaded from copies but is not refilled (its channel: %s); it loads "
                    "as it did, with fewer copies, until it is loaded again or a newer step is protected",
                    job.m.step, describe(e))
        return None
