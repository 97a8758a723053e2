"""Refill after a restore from copies (issue 39 item 3; format.md 11.2).

A load of a step saved with replicas in which some node was replaced (its root is new: an id no
rank of the step knew) reads that node's ranks' files from their copies; the step then has one
copy fewer of those files, and of the copies the lost node held. After every load the session
hands the step to its Replicator (``RefillJob``), whose thread and gloo group re-create, in the
background (never touching the next save, which runs on another channel):

1. ``plan_refill`` (pure, the same on every rank: the step's global manifest, which the primary
   rank sends, and the root table every rank holds): each root of the step no rank sees is
   replaced by the one root its ranks see now (a node replaced; a rank of two roots, or roots
   seen by ranks of different old roots, are not refilled: logged). For every rank whose own
   root or a copy root was replaced: its files are read where they survive (its own root, else
   its first copy), by the lowest rank that sees them, checked as they stream (the shard's
   size and crc32c against the manifest, every chunk against the shard), and sent to the
   leader of each replacement root, which writes them with replication's protocol
   (replicastream.py ``Incoming``: a temporary folder, each file fdatasynced and checked
   against the sender's crc32c, renamed into ``copies/rank<R>`` whole); the rank's own files
   are then renamed from there into the step directory (fsynced), beside an owner file.
2. When every rank succeeded: every root holding the copy of the primary's files writes the
   global manifest with the replaced roots' ids and paths (``relocate_roots``; the same bytes
   everywhere) into ``copies/manifest.json`` and marks ``copies/protected`` (removing a
   refilling note there, but on the primary's own root); then the primary rank replaces
   ``manifest.json`` by it (atomically: the old one or the new one, both commit the same bytes
   of state), rewrites ``protected`` and removes its note. A later load finds every rank's files
   and copies where the manifest says, so it survives another node's loss.

A step protected by parity (its ``protected`` marker names the group, which the primary rank
sends with the manifest) is planned by ``plan_parity_refill``: each lost rank's files are read
from the copy its load rebuilt (parityload.py; where it is, ``rebuilt_copies`` asks the ranks:
a read-only root sends it to a later root of the rank's ``replicas`` entry) and moved as above;
then the parity block it stored is re-created on its new root (parityrefill.py), before step 2.
Once the step is protected again, the rebuilt copies are removed (``drop_rebuilt``): disk use
does not grow with each load.

Where the primary's step directory holds a refilling note (``gdswriter verify --repair`` set a
damaged copy or parity block aside and withdrew ``protected``: load/verify.py
``set_aside_damage``), ``with_repairs`` adds what is missing on the roots reached (one round:
each root's leader reports; the primary rank decides): a copy is streamed again from its rank's
own root, a block re-created by parityrefill.py; then ``copies/protected`` on each root holding
the manifest's copy and last ``protected`` are written back and every note removed
(format/copies.py ``restore_holders``; ``_restore``), the manifest untouched where no root
changed. The repair noted those roots too (``withdraw_everywhere``), so where the primary's node
was lost after it, the root that adopted the manifest's copy holds the note, and this refill
re-creates what the repair set aside beside the lost node's files before it writes ``protected``.

A failure leaves the step as the load found it (loadable, with fewer copies): ReplicationError
from ``wait_protected``; a crash mid-way leaves files no manifest names (removed with the step).
A step whose primary root was replaced (the open adopted its manifest's copy on another root,
which is the primary now: roots.py adopt_copies) is refilled alike: the replacement gets rank
0's files and the copies the lost root held, and a copy of the manifest (``copies/``, not the
commit point: the adopted root keeps it, so the steps saved since stay the newest), so the
manifest is on two nodes again. A step loaded on another world size is not refilled: the
primary rank removes its ``protected`` marker (it is no longer protected; it stays loadable)
and logs why.

The refill never creates nor gives back a channel: it runs on the Replicator's thread and gloo
group (replicate.py), made at the checkpointer's construction and given back to group.py's pool
by ``Replicator.close`` alone, from the checkpointer's close(), which waits for the thread's jobs
first and which every rank calls at the same point of its program. A thread ending sooner on
one rank than on another so never changes which pooled group the next ``Coordinator.create``
takes (the hazard DCP's refill had, dcp_refill.DcpRefill: tests/test_replicas_save.py).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import crc32c as _crc32c
import torch

from ..errors import ChecksumMismatchError, CollectiveFailedError, GDSWriterError, ReplicationError
from ..format.commit import TMP_PREFIX, step_dir_name
from ..format.copies import (copy_ref, drop_damage_in, refilling_marker, relocate_roots, replicas_of,
                              restore_holders, restore_protection, step_lock)
from ..format.manifest import MANIFEST_NAME
from ..format.parity import PARITY_DIR, protected_parity, refilling_parity
from ..format.replicas import COPIES_DIR, PROTECTED_NAME, copy_dir_name, parity_marker, protected_marker
from ..format.sharded import GlobalManifest, parse_global, parse_shard
from ..fs import atomic_write, fsync_dir, read_regular_file, unlink_durably
from .group import Coordinator, Transfer, describe
from .loadplan import reach_of
from .parityrefill import blocks_held, refill_stripes
from .replicastream import Incoming, Outgoing, Pipeline, Source
from .roots import RootLayout, write_owner_files

log = logging.getLogger("gdswriter")
TRAILER_BYTES = 64 << 10
MANIFEST_LIMIT = 1 << 30


@dataclass(frozen=True)
class RefillJob:
    """A loaded step to refill; ``layout``: the session's, holding the whole root table."""

    step: int
    layout: RootLayout


@dataclass(frozen=True)
class Move:
    """Rank ``rank``'s files, read at table root ``source`` (``copy``: its copy there) by
    ``sender``, written by each of ``targets``: (receiver rank, its new root's id, own files?)."""

    rank: int
    source: int
    copy: bool
    sender: int
    targets: tuple[tuple[int, str, bool], ...]


@dataclass(frozen=True)
class RefillPlan:
    moves: tuple[Move, ...]
    mapping: dict[int, tuple[str, str]]  # table root of the step -> (new id, new path)
    skipped: str | None = None
    stripes: tuple[tuple[int, int, str], ...] = ()  # parity blocks missing on reached roots: (rank, writer, root id)


def _replacements(g: GlobalManifest, layout: RootLayout) -> tuple[dict[int, tuple[str, str, int]], list[int]]:
    """Each root of ``g`` no rank sees -> (id, path, leader) of the one root its ranks see now;
    and the unseen roots that have no such replacement."""
    seen = {info.id: info for info in layout.table}
    old = {g.roots[j].id for j in range(len(g.roots))}
    unseen = [j for j in range(len(g.roots)) if g.roots[j].id not in seen]
    wanted: dict[int, list[int]] = {}  # a rank of an unseen root -> those roots
    for j in unseen:
        for r in g.roots[j].ranks:
            wanted.setdefault(r, []).append(j)
    seeing: dict[int, list] = {j: [] for j in unseen}  # one pass over the table, not one per unseen root
    for info in layout.table:
        for j in {j for r in info.ranks if r in wanted for j in wanted[r]}:
            seeing[j].append(info)
    out, none = {}, []
    for j in unseen:
        ranks = set(g.roots[j].ranks)
        now = seeing[j]
        if len(now) == 1 and now[0].id not in old and set(now[0].ranks) == ranks:
            out[j] = (now[0].id, now[0].path, min(now[0].ranks))
        else:
            none.append(j)
    return out, none


def _replaced(g: GlobalManifest, layout: RootLayout) -> dict | RefillPlan:
    """Where each lost root of step ``g.step`` was replaced (_replacements), or the plan of no
    moves that says why no refill is done (another world size, a lost root
    with no single replacement)."""
    skipped = _not_refilled(g, layout)
    if skipped is not None:
        return RefillPlan((), {}, skipped)
    new, unmapped = _replacements(g, layout)
    if unmapped:
        return RefillPlan((), {}, f"roots {unmapped} of the step are gone with no single root replacing each")
    return new


def plan_refill(g: GlobalManifest, layout: RootLayout) -> RefillPlan:
    """Pure (the module docstring, 1): what to copy where to refill step ``g.step``."""
    copies = replicas_of(g, "the step's manifest")
    seen = {info.id: info.ranks for info in layout.table}
    if copies is None or all(g.roots[j].id in seen for j in range(len(g.roots))):
        return RefillPlan((), {})  # saved without replicas, or nothing lost: nothing to do, silently
    new = _replaced(g, layout)
    if isinstance(new, RefillPlan):
        return new
    moves = []
    for r in range(g.world_size):
        own = g.shards[r].root
        targets = [(new[j][2], new[j][0], j == own) for j in (own, *copies[r]) if j in new]
        if not targets:
            continue
        source = next(((j, k > 0) for k, j in enumerate((own, *copies[r])) if g.roots[j].id in seen), None)
        if source is None:
            return RefillPlan((), {}, f"no copy of rank {r}'s files survives")
        sender = min(seen[g.roots[source[0]].id])
        if any(t[0] == sender for t in targets):
            return RefillPlan((), {}, f"rank {sender} would send rank {r}'s files to itself")
        moves.append(Move(r, source[0], source[1], sender, tuple(targets)))
    return RefillPlan(tuple(moves), {j: (v[0], v[1]) for j, v in new.items()})


def plan_parity_refill(g: GlobalManifest, layout: RootLayout, found: Mapping[int, int] | None = None) -> RefillPlan:
    """Pure, for a step protected by parity (format.md 11.2): each lost rank's files, read from
    the copy its load rebuilt, go to the leader of its replacement root; its parity block follows
    (parityrefill.py). ``found``: lost rank -> the root of its ``replicas`` entry holding that
    copy (``rebuilt_copies``: the load puts it on the first such root some rank can write, not
    always the first seen; a rank not in it: its copy was held in memory, nothing to refill
    from); None: the first root of its entry some rank sees."""
    copies = replicas_of(g, "the step's manifest")
    seen = {info.id: info.ranks for info in layout.table}
    lost = [r for r in range(g.world_size) if g.roots[g.shards[r].root].id not in seen]
    if copies is None or not lost:
        return RefillPlan((), {})
    new = _replaced(g, layout)
    if isinstance(new, RefillPlan):
        return new
    moves = []
    for r in lost:
        own = g.shards[r].root
        source = next((j for j in copies[r] if g.roots[j].id in seen), None) if found is None else found.get(r)
        if source is None and found is not None:
            return RefillPlan((), {}, f"no root of rank {r}'s parity lane holds the copy its load rebuilt (the load "
                                      f"held it in memory: every such root was read-only)")
        if source is None:
            return RefillPlan((), {}, f"no member of rank {r}'s parity lane survives")
        sender = min(seen[g.roots[source].id])
        if sender == new[own][2]:
            return RefillPlan((), {}, f"rank {sender} would send rank {r}'s files to itself")
        moves.append(Move(r, source, True, sender, ((new[own][2], new[own][0], True),)))
    return RefillPlan(tuple(moves), {j: (v[0], v[1]) for j, v in new.items()})


def _not_refilled(g: GlobalManifest, layout: RootLayout) -> str | None:
    """Why a step whose roots changed is not refilled (format.md 11.2), or None."""
    if g.world_size != layout.world_size:
        return f"it was saved by {g.world_size} ranks, this job has {layout.world_size}"
    return None


def run_refill(coord: Coordinator, job: RefillJob, copies: int) -> bool:
    """Collective on the replication group: refill ``job.step`` (the module docstring; a step
    protected by parity: its lost members' files and parity blocks, parityrefill.py). True when
    something was refilled and the step is protected again; False when nothing was lost (or it
    cannot be refilled: logged); ReplicationError when a rank failed. The primary rank holds the
    step's lock (format/copies.py ``step_lock``, shared) from before it reads the refilling note
    until the end: ``verify --repair`` of the step never runs meanwhile."""
    held: list[int] = []
    try:
        done = _refill(coord, job, copies, held)
    finally:
        for fd in held:
            os.close(fd)
    if done:
        drop_damage(coord.rank, job.layout, job.step)
    return done


def drop_damage(me: int, layout: RootLayout, step: int) -> None:
    """The ``.damaged-`` entries ``verify --repair`` set aside on the roots rank ``me`` leads,
    removed once the refill re-created what they held (format/copies.py ``drop_damage_in``)."""
    drop_damage_in((root / step_dir_name(step) for i, root in enumerate(layout.local_paths) if layout.leads(i)),
                   f"step {step}")


def _refill(coord: Coordinator, job: RefillJob, copies: int, held: list[int]) -> bool:
    """``run_refill``'s work (``held``: the step lock's descriptor, closed by the caller)."""
    step, layout = job.step, job.layout
    what = f"refilling step {step}"
    raw, parity, note = _manifest_bytes(coord, layout, step, what, held)
    g = parse_global(raw, f"{step_dir_name(step)}/{MANIFEST_NAME}")
    if g is None:
        return False
    plan = plan_refill(g, layout) if parity is None else \
        plan_parity_refill(g, layout, rebuilt_copies(coord, layout, g, what))
    if note is not None and plan.skipped is None:  # the scrub set damage aside (load/verify.py set_aside_damage)
        plan = with_repairs(coord, layout, g, plan, parity, what)
        if not plan.moves and not plan.stripes:
            _restore(coord, layout, g, note, what)
            return True
    if plan.skipped is not None or not (plan.moves or plan.stripes):
        if plan.skipped is not None and coord.rank == layout.primary_rank:
            _unprotect(layout, step, plan.skipped)
        return False
    log.info("gdswriter: %s: %d rank(s)' files to re-create on replaced roots", what, len(plan.moves))
    problems: list[str] = []
    for move in plan.moves:
        if coord.rank == move.sender or any(t[0] == coord.rank for t in move.targets):
            problems += _move(coord, layout, g, move, what)
    if parity is not None:
        problems += _stripes(coord, layout, g, plan, what)
    failed = coord.decide(None, "; ".join(problems)[:2000], f"{what} (outcomes)",
                          lambda outs: [[r, m] for r, m in enumerate(outs) if m][:8], root=layout.primary_rank)
    if failed:
        raise ReplicationError(f"step {step} was restored but not refilled: "
                               f"{'; '.join(f'rank {r}: {m}' for r, m in failed)}; it loads as it did, with fewer "
                               f"copies; fix what the message names (a full or failing disk?) and load again", step)
    marker = note or (protected_marker(copies) if parity is None else parity_marker(parity))
    if plan.mapping:
        _commit(coord, layout, g, raw, plan, marker, what)
    else:  # damage set aside on reached roots re-created: the manifest names every root as it is
        _restore(coord, layout, g, marker, what)
    if parity is not None:
        drop_rebuilt(coord.rank, layout, g, plan)
    return True


def rebuilt_copies(coord: Coordinator, layout: RootLayout, g: GlobalManifest, what: str) -> dict[int, int]:
    """Collective: lost rank -> the root of its ``replicas`` entry that holds the copy a load
    rebuilt (parityload.py: its shard there), the first in the entry's order; each rank looks on
    the roots it leads and reports what it found (a few integers) to the primary rank."""
    copies = replicas_of(g, "the step's manifest")
    seen = {info.id: tuple(info.ranks) for info in layout.table}
    if copies is None or all(g.roots[g.shards[r].root].id in seen for r in range(g.world_size)):
        return {}  # nothing lost (every rank alike): no round
    mine: list = []
    error: BaseException | None = None
    try:
        reach = reach_of(g, layout)
        for r in range(g.world_size):
            if g.roots[g.shards[r].root].id in seen:
                continue
            for j in copies[r]:
                ranks = seen.get(g.roots[j].id)
                if ranks and min(ranks) == coord.rank and \
                        (reach[j] / step_dir_name(g.step) / copy_ref(g.shards[r], j).name).is_file():  # type: ignore[operator]
                    mine.append([r, j])
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e

    def first(outs: list) -> list:
        have = {(r, j) for out in outs for r, j in out}
        return [[r, next(j for j in copies[r] if (r, j) in have)] for r in sorted({r for r, _ in have})]

    return {int(r): int(j) for r, j in coord.decide(error, mine, f"{what} (finding the rebuilt copies)", first,
                                                     root=layout.primary_rank)}


def drop_rebuilt(me: int, layout: RootLayout, g: GlobalManifest, plan: RefillPlan) -> None:
    """After a parity refill is durable and the step protected again: each rebuilt copy the
    refill read (``copies/rank<R>`` on a lane member's root) removed by the rank that read it,
    so disk use does not grow per load: renamed to a temporary name (the copy is there whole or
    gone), the directory fsynced, then deleted. A failure is logged: the step is protected."""
    reach = reach_of(g, layout)
    for move in plan.moves:
        if move.sender == me and move.copy:
            drop_copy(reach[move.source] / step_dir_name(g.step) / COPIES_DIR, move.rank, g.step)  # type: ignore[operator]


def drop_copy(copies: Path, rank: int, step: int) -> None:
    """Rank ``rank``'s rebuilt copy in ``copies`` removed as ``drop_rebuilt`` says (shared with
    the DCP plug-in's refill, dcp_refill.py); a failure is logged."""
    try:
        gone = copies / f"{TMP_PREFIX}{copy_dir_name(rank)}-{secrets.token_hex(4)}"
        os.replace(copies / copy_dir_name(rank), gone)
        fsync_dir(copies)
        shutil.rmtree(gone)
    except OSError as e:
        log.warning("gdswriter: step %d is refilled, but rank %d's rebuilt copy in %s could not be removed "
                    "(%s): remove it by hand", step, rank, copies, describe(e))


def _unprotect(layout: RootLayout, step: int, why: str) -> None:
    """The primary rank: a step that lost files and is not refilled (``why``) is no longer
    protected: its ``protected`` marker removed (fsynced), so ``gdswriter ls``, retention and
    ``protected_step()`` say so; it stays committed and loadable (format.md 11.2)."""
    d = layout.local_paths[layout.local_of(0) or 0] / step_dir_name(step)
    try:
        unlink_durably(d / PROTECTED_NAME)
    except OSError as e:
        log.warning("gdswriter: step %d is not refilled after its restore (%s), and its protected marker could "
                    "not be removed (%s)", step, why, describe(e))
        return
    log.warning("gdswriter: step %d is not refilled after its restore: %s; it stays loadable, no longer protected "
                "(its files that lived on lost nodes have fewer copies): the next step saved is protected", step, why)


def _stripes(coord: Coordinator, layout: RootLayout, g: GlobalManifest, plan: RefillPlan, what: str) -> list[str]:
    """Collective: the parity blocks the lost ranks of ``plan`` stored, re-created on their new
    roots (parityrefill.py); what failed here. Its collective steps failing on some rank (a
    description that cannot be read) fail the refill on every rank."""
    try:
        targets = {m.rank: m.targets[0][:2] for m in plan.moves}
        targets.update({r: (w, rid) for r, w, rid in plan.stripes})
        return refill_stripes(coord, layout, g, targets, what, layout.primary_rank)
    except GDSWriterError as e:
        if isinstance(e, (ReplicationError, CollectiveFailedError)):
            raise
        raise ReplicationError(f"step {g.step} was restored but not refilled ({describe(e)}); it loads as it did, "
                               f"rebuilding its lost members at each load", g.step) from e


def _manifest_bytes(coord: Coordinator, layout: RootLayout, step: int, what: str,
                    held: list[int]) -> tuple[bytes, int | None, bytes | None]:
    """The step's manifest.json, read by the primary rank and sent to every rank; the group
    size its ``protected`` marker (or its refilling note) records where parity protects it
    (else None); the marker its refilling note keeps (the scrub set damage aside), else None."""
    mine: dict = {}
    if coord.rank == layout.primary_rank:
        try:
            path = layout.local_paths[layout.local_of(0) or 0] / step_dir_name(step) / MANIFEST_NAME
            held.append(step_lock(path.parent, exclusive=False))  # before the note is read: no repair meanwhile
            note = refilling_marker(path.parent)
            mine = {"raw": read_regular_file(path, MANIFEST_LIMIT).decode(),  # JSON: UTF-8, byte for byte
                    "parity": protected_parity(path.parent) or refilling_parity(path.parent),
                    "note": None if note is None else note.decode()}
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            mine = {"error": describe(e)}
    got = coord.broadcast(mine, f"{what} (manifest)", src=layout.primary_rank)
    if "error" in got:
        raise ReplicationError(f"step {step} was restored but not refilled: its manifest could not be read "
                               f"({got['error']})", step)
    note = got.get("note")
    return got["raw"].encode(), got.get("parity"), None if note is None else note.encode()


def _sources(layout: RootLayout, g: GlobalManifest, move: Move) -> list[Source]:
    """Rank ``move.rank``'s shard and data files where they survive, checked as they stream."""
    ref = copy_ref(g.shards[move.rank], move.source) if move.copy else g.shards[move.rank]
    reach = reach_of(g, layout)
    d = reach[move.source] / step_dir_name(g.step)  # type: ignore[operator]
    raw = read_regular_file(d / ref.name, ref.size + 1)
    if len(raw) != ref.size or _crc32c.crc32c(raw) != ref.crc32c:
        raise ChecksumMismatchError(str(d / ref.name), "its manifest shard", 0, ref.size, ref.crc32c,
                                    _crc32c.crc32c(raw))
    shard = parse_shard(raw, g, ref, str(d / ref.name))
    out = [Source("shard", ref.name.rsplit("/", 1)[-1], len(raw), data=raw)]
    per_file = shard.chunks_by_file()
    for fid, f in enumerate(shard.files):
        if f.root != move.source or reach[f.root] is None:
            raise GDSWriterError(f"rank {move.rank}'s data file {f.path} is not beside its shard on "
                                 f"{reach[move.source]}: a rank of several roots is not refilled")
        out.append(Source("data", f.path.rsplit("/", 1)[-1], f.size,
                          path=reach[f.root] / step_dir_name(g.step) / f.path,  # type: ignore[operator]
                          chunks=tuple(per_file[fid])))
    return out


def _move(coord: Coordinator, layout: RootLayout, g: GlobalManifest, move: Move, what: str) -> list[str]:
    """This rank's part of one move (sender or receiver); what failed here."""
    target = next((t for t in move.targets if t[0] == coord.rank), None)
    return move_files(coord, FileMove(g.step, move.rank, move.sender, tuple(t[0] for t in move.targets),
                                      bool(target and target[2])),
                      lambda: _sources(layout, g, move),
                      lambda: _copies_dir(layout, g.step, target[1]), what)  # type: ignore[index]


@dataclass(frozen=True)
class FileMove:
    """Rank ``rank``'s files of step ``step``, streamed by ``sender`` to each of ``receivers``
    (``own``: on a receiver, the rank's own files, moved up into the step directory)."""

    step: int
    rank: int
    sender: int
    receivers: tuple[int, ...]
    own: bool = False


def move_files(coord: Coordinator, move: FileMove, sources: Callable[[], list[Source]],
               copies_dir: Callable[[], Path], what: str) -> list[str]:
    """This rank's part of one move (called by its sender and receivers alone, in the same order
    of moves): the sender streams ``sources()`` (each chunk checked against its crc32c as it is
    read); each receiver writes them into ``copies_dir()/.tmp-...``, checks every file against
    the sender's crc32c, renames the folder to ``copies/rank<R>`` (replicastream.Incoming) and,
    for ``own``, moves the files up into the step directory. Returns what failed here (shared by
    GDSCheckpointer's refill and the DCP plug-in's, dcp_refill.py)."""
    me, s = coord.rank, move.sender
    dests = list(move.receivers) if me == s else []
    error: BaseException | None = None
    srcs: list[Source] = []
    if me == s:
        try:
            srcs = sources()
        except Exception as e:  # noqa: BLE001 - sent to the receivers in the trailer
            error = e
    out = Outgoing(srcs, error)
    head = torch.tensor([len(out.header), out.total], dtype=torch.int64)
    sizes = torch.zeros(2, dtype=torch.int64)
    coord.exchange([Transfer(s, d, 0, head) for d in dests] + ([Transfer(s, me, 0, sizes)] if me != s else []),
                   f"{what} (sizes)")
    header = torch.zeros(max(int(sizes[0]), 1), dtype=torch.uint8)
    mine = torch.frombuffer(bytearray(out.header), dtype=torch.uint8)
    coord.exchange([Transfer(s, d, 1, mine) for d in dests] +
                   ([Transfer(s, me, 1, header[:int(sizes[0])])] if me != s else []), f"{what} (headers)")
    problems: list[str] = []
    inc: Incoming | None = None
    if me != s:
        try:
            inc = Incoming(copies_dir(), move.rank, bytes(header[:int(sizes[0])].numpy()))
        except Exception as e:  # noqa: BLE001 - reported to the primary rank
            problems.append(f"rank {move.rank}'s files: {describe(e)}")
    incoming = {s: inc} if me != s else {}
    try:
        Pipeline(coord, move.step, out, dests, {s: int(sizes[1])} if me != s else {}, incoming, problems).run()
        trailer = _trailer(coord, out, s, dests, what)
    except BaseException:
        if inc is not None:
            inc.discard()
        raise
    finally:
        out.close()
    inc = incoming.get(s)
    if inc is not None:
        try:
            publish_copy(inc, trailer, move.rank, move.own)
        except Exception as e:  # noqa: BLE001 - reported to the primary rank
            inc.discard()
            problems.append(f"rank {move.rank}'s files: {describe(e)}")
    return problems


def _copies_dir(layout: RootLayout, step: int, root_id: str) -> Path:
    """``step_S/copies`` on this rank's root ``root_id`` (made durably, the step directory with
    its owner file)."""
    root = layout.local_paths[layout.local_ids.index(root_id)]
    return durable_copies_dir(root, step, lambda d: write_owner_files(layout, d))


def durable_copies_dir(root: Path, step: int, write_owners: Callable[[Path], None]) -> Path:
    """``step_S/copies`` on ``root``, made durably where missing: the step directory first, with
    the owner files ``write_owners`` puts in it (then ``root`` fsynced), then ``copies`` (then
    the step directory fsynced). The refills of GDSCheckpointer and of DCP steps both use it."""
    d = root / step_dir_name(step)
    if not d.is_dir():
        d.mkdir()
        write_owners(d)
        fsync_dir(root)
    copies = d / COPIES_DIR
    if not copies.is_dir():
        copies.mkdir()
        fsync_dir(d)
    return copies


def publish_copy(inc: Incoming, trailer: dict, rank: int, own: bool) -> None:
    """``inc``'s files put in place (Incoming.publish: ``copies/rank<R>``) and, for ``own``, moved
    up into the step directory, under an exclusive flock of the step directory: two refills of
    one step (two readers loading it at once, each refilling the same files) publish one after
    the other, never one into the other's folder as it is moved up and removed."""
    fd = os.open(inc.copies.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # brief: held by renames and fsyncs only
        inc.publish(trailer)
        if own:
            _move_up(inc.copies, rank)
    finally:
        os.close(fd)  # the lock goes with the descriptor


def _move_up(copies: Path, rank: int) -> None:
    """A rank's own files, received as ``copies/rank<R>``, renamed into the step directory."""
    src = copies / copy_dir_name(rank)
    for p in sorted(src.iterdir()):
        os.replace(p, copies.parent / p.name)
    fsync_dir(copies.parent)
    shutil.rmtree(src)
    fsync_dir(copies)


def _trailer(coord: Coordinator, out: Outgoing, s: int, dests: list[int], what: str) -> dict:
    """The sender's trailer (each file's crc32c, or why it stopped) on every receiver."""
    data = out.trailer()[:TRAILER_BYTES - 8]
    mine = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    mine[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    coord.exchange([Transfer(s, d, 1001, mine) for d in dests] +
                   ([Transfer(s, coord.rank, 1001, got)] if coord.rank != s else []), f"{what} (trailers)")
    n = int(got[:8].view(torch.int64))
    try:
        return json.loads(bytes(got[8:8 + n].numpy()))
    except ValueError:
        return {"ok": False, "error": "its trailer is not readable"}


def _commit(coord: Coordinator, layout: RootLayout, g: GlobalManifest, raw: bytes, plan: RefillPlan, marker: bytes,
            what: str) -> None:
    """Step 2 of the module docstring: the manifest's copies, then the manifest, then ``protected``."""
    step, p = g.step, layout.primary_rank
    new = relocate_roots(raw, plan.mapping, f"{step_dir_name(step)}/{MANIFEST_NAME}")
    holders = {plan.mapping.get(j, (g.roots[j].id,))[0] for j in replicas_of(g, "")[min(g.roots[0].ranks)]}
    if 0 in plan.mapping:  # the primary root replaced (its manifest adopted on another root): its
        holders.add(plan.mapping[0][0])  # replacement holds a copy too, so two nodes hold the manifest
    error = None
    try:
        for i, rid in enumerate(layout.local_ids):
            if rid in holders and layout.leads(i):
                d = layout.local_paths[i] / step_dir_name(step) / COPIES_DIR
                atomic_write(d / MANIFEST_NAME, new)
                _restore_holder(layout, i, d.parent, marker)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    _agree(coord, error, f"{what} (the manifest's copies)", step, p)
    error = None
    if coord.rank == p:
        try:
            d = layout.local_paths[layout.local_of(0) or 0] / step_dir_name(step)
            atomic_write(d / MANIFEST_NAME, new)
            restore_protection(d, marker)
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
    _agree(coord, error, f"{what} (the manifest)", step, p)
    if coord.rank == p:
        log.warning("gdswriter: step %d is refilled: the files of replaced root(s) %s re-created from their "
                    "copies, and the step is protected again", step, sorted(plan.mapping))


def with_repairs(coord: Coordinator, layout: RootLayout, g: GlobalManifest, plan: RefillPlan, parity: int | None,
                 what: str) -> RefillPlan:
    """Collective, where the step's refilling note says the scrub set damage aside (format.md
    11.2): ``plan`` with what is missing on the roots reached added, found as for a lost root:
    the leader of each reached root reports the copies its ``replicas`` entries place there and
    that are not there, or (parity) the lanes and the blocks of the right length it holds; the
    primary rank decides. A missing copy of rank r is sent from r's own root (a ``Move``); a
    missing block is re-created by the leader of its member's own root (``stripes``)."""
    copies = replicas_of(g, "the step's manifest") or ()
    seen = {info.id: tuple(info.ranks) for info in layout.table}
    mine: list = [[], [], []]  # lanes named, blocks held, [rank, root] of copies missing
    error: BaseException | None = None
    try:
        reach = reach_of(g, layout)
        for j, info in enumerate(g.roots):
            ranks = seen.get(info.id)
            if not ranks or min(ranks) != coord.rank or reach[j] is None:
                continue
            d = reach[j] / step_dir_name(g.step)  # type: ignore[operator]
            if parity is not None:
                lanes, have = blocks_held(d / PARITY_DIR)
                mine[0] += sorted(lanes)
                mine[1] += sorted(have)
                continue
            mine[2] += [[r, j] for r, row in enumerate(copies) if j in row
                        and not (d / COPIES_DIR / copy_dir_name(r)).is_dir()]
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    lost = {r for r in range(g.world_size) if g.roots[g.shards[r].root].id not in seen}

    def rule(outs: list) -> list:
        lanes = {k for out in outs for k in out[0]} - {k for out in outs for k in out[1]} - lost
        return [sorted(lanes), [x for out in outs for x in out[2] if x[0] not in lost]]

    blocks, missing = coord.decide(error, mine, f"{what} (finding what the scrub set aside)", rule,
                                   root=layout.primary_rank)
    moves, by_rank = list(plan.moves), {}
    for r, j in missing:
        by_rank.setdefault(r, []).append(j)
    for r, js in sorted(by_rank.items()):
        own = g.shards[r].root
        sender = min(seen[g.roots[own].id])
        targets = tuple((min(seen[g.roots[j].id]), g.roots[j].id, False) for j in js)
        if any(t[0] == sender for t in targets):
            log.warning("gdswriter: %s: rank %d would send rank %d's copy to itself: not re-created", what, sender, r)
            continue
        moves.append(Move(r, own, False, sender, targets))
    stripes = tuple((r, min(seen[g.roots[g.shards[r].root].id]), g.roots[g.shards[r].root].id) for r in blocks)
    return RefillPlan(tuple(moves), plan.mapping, plan.skipped, plan.stripes + stripes)


def _restore_holder(layout: RootLayout, i: int, d: Path, marker: bytes) -> None:
    """This rank's local root ``i``, holding the manifest's copy in step directory ``d``: its
    ``copies/protected`` written back and its refilling note removed (format/copies.py
    ``restore_holders``, which ``verify --repair`` withdrew there too); on the primary's own
    root (an adopted copy) the note stays for the primary's ``restore_protection``, last."""
    if layout.is_primary(i):
        atomic_write(d / COPIES_DIR / PROTECTED_NAME, marker)
    else:
        restore_holders([d], marker)


def _restore(coord: Coordinator, layout: RootLayout, g: GlobalManifest, marker: bytes, what: str) -> None:
    """Collective, once every rank's part is durable: 1. the leader of each root holding the
    copy of the primary's files (so the manifest's copy) writes ``copies/protected`` back and
    removes its refilling note (``verify --repair`` withdrew both); 2. then the primary rank
    writes ``protected`` back and removes its note (format/copies.py ``restore_holders``)."""
    step, error = g.step, None
    holders = {g.roots[j].id for j in (replicas_of(g, "") or ((),) * g.world_size)[min(g.roots[0].ranks)]}
    try:
        for i, rid in enumerate(layout.local_ids):
            d = layout.local_paths[i] / step_dir_name(step)
            if rid in holders and layout.leads(i) and d.is_dir():
                _restore_holder(layout, i, d, marker)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    _agree(coord, error, f"{what} (the manifest's copies protected again)", step, layout.primary_rank)
    error = None
    if coord.rank == layout.primary_rank:
        try:
            restore_protection(layout.local_paths[layout.local_of(0) or 0] / step_dir_name(step), marker)
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
    _agree(coord, error, f"{what} (protected again)", step, layout.primary_rank)
    if coord.rank == layout.primary_rank:
        log.warning("gdswriter: step %d is refilled: the copies and parity blocks found damaged or missing "
                    "re-created, and the step is protected again", step)


def _agree(coord: Coordinator, error: BaseException | None, what: str, step: int, p: int) -> None:
    try:
        coord.agree(error, what, root=p)
    except GDSWriterError as e:
        if isinstance(e, (ReplicationError, CollectiveFailedError)):
            raise
        raise ReplicationError(f"step {step} was restored but not refilled ({what}: {describe(e)}); it loads as it "
                               f"did, with fewer copies", step) from e
