"""Copies of DCP steps on peer nodes (GDSStorageWriter with DistOptions(replicas=C); format.md 9.5).

A DCP step stays one format 1.2 manifest. **Save**: at the writer's first save every rank opens
a replication channel of its own and places the copies (replicate.py ``plan_peers``, as
GDSCheckpointer does). Every rank that reached write_data hands its files (its RankReport: data
files, chunks and their crc32c) to a Replicator (replicate.py ``SourcedJob``); the coordinator
hands its own in finish(), with whether the step committed and the committed manifest's bytes.
On the replication thread rank 0 first tells every rank whether the step committed (a broadcast
on that channel: the other ranks learn of the commit nowhere else); then the step is streamed,
written and marked exactly as a GDSCheckpointer step: ``step_S/copies/rank<R>/`` on the peers'
first roots, ``copies/manifest.json`` beside rank 0's copy, ``step_S/protected`` last.

**Load** (``place_files``, ``fetch_placed``): the copies are found, not recorded (the manifest
is committed before them). Rank 0 gathers the roots each rank reaches and whether it holds
copies, and sends each rank the roots it looks at (the lowest rank reaching each); each file
there is checked by its size alone, and rank 0 broadcasts the problems: nothing where nothing is
lost (a rank sends and receives a fixed few bytes: no all_gather). The fetch reads each file
once, checking every chunk's crc32c as it reads. A file missing, of the wrong size, or failing
its crc32c in the fetch (every rank agrees on which) is pointed at a copy of the right size on
a peer's root (a warning names the file and why), and the fetch is done again; a copy that
fails its check too gives way to the next; none left: StepFilesLostError (all missing) or
CorruptCheckpointError (some damaged), on every rank. Such files of a reached root are the
placement's ``unfit``: the load's refill re-creates them from their copy (dcp_refill.py). For a
parity step the same round reports the parity blocks on the roots each rank looks at; a lane
member of a reached root whose block is missing or of the wrong length is in ``stripes``: the
refill re-creates that block."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable, Sequence

from ..errors import (
    ChecksumMismatchError,
    CollectiveFailedError,
    CorruptCheckpointError,
    GDSWriterError,
    InvalidOptionError,
    RankFailedError,
    ReplicationError,
    StepFilesLostError,
)
from ..format.commit import ROOT_MARKER_NAME, step_dir_name
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, RootInfo
from ..format.parity import PARITY_DIR, REFILLING_NAME
from ..format.replicas import COPIES_DIR, PROTECTED_NAME
from .dcp_leftovers import drop_leftovers
from .dcp_messages import RankReport
from .group import Coordinator, describe
from .options import DistOptions
from .replicastream import Source
from .parity import plan_parity, replicator_for
from .parityload import HeldCopies, StepRoots, rebuild_members
from .parityrefill import blocks_held
from .replicate import ReplicaPeers, Replicator, SourcedJob, plan_peers
from .roots import RootLayout

log = logging.getLogger("gdswriter")

T = TypeVar("T")


@dataclass(frozen=True)
class FirstRoot:
    """What plan_peers reads of a layout: this rank's first root's id (the writer places the
    copies at set_up, before its layout is decided)."""

    local_ids: tuple[str, ...]


class Word:
    """Rank 0's word on a save that reached its write_data: settled at the commit (committed,
    the committed manifest's bytes, a failure reading them) or when the save ends without one
    (the first settle stands)."""

    def __init__(self, step: int, token: str):
        self.step, self.token = step, token
        self.committed, self.manifest, self.error = False, None, None
        self._settled = threading.Event()

    def settle(self, committed: bool, manifest: bytes | None = None, error: BaseException | None = None) -> None:
        if not self._settled.is_set():
            self.committed, self.manifest, self.error = committed, manifest, error
            self._settled.set()

    def wait(self, timeout: float) -> bool:
        return self._settled.wait(timeout)


class DcpReplication:
    """A GDSStorageWriter's copies: its channel, its peers, its Replicator (made at the first
    submit; pointed at each save's layout, the writer's session may change between saves)."""

    def __init__(self, channel: Coordinator, peers: ReplicaPeers):
        self.channel, self.peers = channel, peers
        self.replicator: Replicator | None = None

    @classmethod
    def open(cls, process_group: Any, options: DistOptions, root_id: str) -> DcpReplication:
        """Collective, every rank at set_up of the writer's first save: the channel and the
        placement (the copies' peers, or the parity lanes: parity.py plan_parity)."""
        asked = f"parity_group={options.parity_group}" if options.parity_group else f"replicas={options.replicas}"
        channel = Coordinator.create(process_group, timeout_s=options.timeout_s, label=f"GDSStorageWriter({asked})")
        try:
            first = FirstRoot((root_id,))
            peers = (plan_parity(channel, first, options.parity_group, options.failure_domains)  # type: ignore[arg-type]
                     if options.parity_group else
                     plan_peers(channel, first, options.replicas, options.failure_domains))  # type: ignore[arg-type]
        except BaseException:
            channel.close()
            raise
        return cls(channel, peers)

    def submit(self, layout: RootLayout, step: int, token: str, report: RankReport | None,
               error: BaseException | None, word: Word | None = None) -> None:
        """Hand a save that reached write_data to the replication thread (every rank, every such
        save, in order, at its write_data): ``report`` this rank's files (None with ``error``: its
        write failed); ``word`` rank 0's, settled at its commit or when its save ends. On the
        thread every rank first says whether it wrote its part (one fixed-size round): where one
        did not, DCP commits nothing and calls no finish, so no rank waits for rank 0's word.
        Otherwise rank 0 waits for its word, telling the others every timeout_s / 4 that it still
        does (their wait then never breaks the channel), and sends it."""
        rep = self.replicator
        if rep is None:
            rep = self.replicator = replicator_for(self.channel, layout, self.peers)
        elif rep.layout is not layout:
            rep.wait()
            rep.layout = layout
        rank = self.channel.rank

        def sources(channel: Coordinator) -> tuple[list[Source] | None, BaseException | None]:
            what = f"replicating DCP step {step}"
            if not channel.all_true(error is None and report is not None, f"{what} (written on every rank?)"):
                return None, not_written(step, error)
            said = word_of(channel, word, what)
            if (said["step"], said["token"]) != (step, token):
                return [], ReplicationError(f"rank 0 replicates step {said['step']} (save {said['token']}), this rank "
                                            f"step {step} (save {token}): internal, report it", step)
            if not said["committed"]:
                return [], ReplicationError(f"step {step} was not committed: nothing to protect", step)
            if word is not None and word.error is not None:
                return [], word.error
            assert report is not None
            return rank_sources(layout, report, word.manifest if word is not None else None), None

        rep.submit(SourcedJob(step, rank == 0, sources))

    def missed(self, layout: RootLayout | None) -> None:
        """This rank's answer for a save it set up but whose write_data it never reached (it
        failed before: DCP calls nothing more on it until its next save or close): the first
        round of that save's replication says so, so the ranks that reached write_data (waiting
        there) end it with ReplicationError, no round follows, and every rank's rounds stay in
        step for the next save. Called at the next set_up, or at close."""
        rep = self.replicator
        if rep is None:
            rep = self.replicator = replicator_for(self.channel, layout, self.peers)  # type: ignore[arg-type]

        def sources(channel: Coordinator) -> tuple[list[Source] | None, BaseException | None]:
            channel.all_true(False, "replicating a DCP step (written on every rank?)")
            return None, not_written(-1, None)
        rep.submit(SourcedJob(-1, self.channel.rank == 0, sources))

    def wait(self, timeout: float | None = None) -> bool:
        return True if self.replicator is None else self.replicator.wait(timeout)

    def take_error(self) -> ReplicationError | None:
        return None if self.replicator is None else self.replicator.take_error()

    @property
    def protected(self) -> int | None:
        return None if self.replicator is None else self.replicator.protected

    def close(self) -> None:
        """Wait for the replications submitted, then give the channel back."""
        if self.replicator is not None:
            self.replicator.close()
        else:
            self.channel.close()


def not_written(step: int, error: BaseException | None) -> ReplicationError:
    """A save some rank did not write (its write failed, or it never reached write_data)."""
    said = f"step {step}" if step >= 0 else "a save"
    why = f" (this rank: {describe(error)})" if error is not None else ""
    return ReplicationError(f"{said} was not written on every rank{why}: nothing to protect; it was not committed, "
                            f"the earlier protected steps stand", step)


def word_of(channel: Coordinator, word: Word | None, what: str) -> dict:
    """Collective on the replication channel: rank 0's ``word`` ({step, token, committed}) on
    every rank, once settled; meanwhile rank 0 broadcasts {"wait": True} every timeout_s / 4."""
    if channel.rank == 0:
        assert word is not None
        while not word.wait(channel.timeout_s / 4):
            channel.broadcast({"wait": True}, f"{what} (waiting for the commit)", src=0)
        return channel.broadcast({"step": word.step, "token": word.token, "committed": word.committed},
                                 f"{what} (committed?)", src=0)
    said = channel.broadcast(None, f"{what} (committed?)", src=0)
    while said.get("wait"):
        said = channel.broadcast(None, f"{what} (committed?)", src=0)
    return said


def rank_sources(layout: RootLayout, report: RankReport, manifest: bytes | None) -> list[Source]:
    """This rank's files of a committed DCP step as replication sources (every chunk's crc32c
    checked as it streams), and on rank 0 the committed manifest."""
    d = step_dir_name(report.step)
    out = []
    for fid, (g, name, size, *_) in enumerate(report.files):
        local = layout.local_of(g)
        if local is None:
            raise CorruptCheckpointError(f"step {report.step}: this rank's data file {name} is on a root it does "
                                         f"not see (internal: report it)")
        out.append(Source("data", name, size, path=layout.local_paths[local] / d / name,
                          chunks=report.file_chunks(fid)))
    if manifest is not None:
        out.append(Source("global", MANIFEST_NAME, len(manifest), data=manifest))
    return out


# ---------------------------------------------------------------------------------------------
# loading


@dataclass(frozen=True)
class Placed:
    """A step's manifest with each file placed (its own root, or a copy), and what a retry after
    a damaged read needs; the same on every rank (built from broadcast decisions)."""

    m: Manifest
    copies: bool  # some root of the step holds copies
    check: tuple[int, ...] = ()  # the table roots this rank looks at for the others
    problems: tuple[tuple[int, str], ...] = ()  # (file, why a place of it was not usable), so far
    failed: frozenset[tuple[int, int, str]] = frozenset()  # (file, root, path) places found bad
    reach: tuple[Path | None, ...] = ()  # this rank's path of each table root (one more per held copy)
    parity: bool = False  # some root of the step holds parity (parity.py): a lost member is rebuilt
    checkers: dict[int, int] | None = None  # rank 0: the rank looking at each reached table root
    rebuilt: bool = False  # the lost members were rebuilt from their parity once (never twice)
    held: HeldCopies | None = None  # rebuilt copies held in memory for this load (closed after it)
    lost: tuple[int, ...] = ()  # the step's table roots no rank reaches (replaced nodes: dcp_refill.py)
    unfit: tuple[int, ...] = ()  # files read from a copy though their root is reached: refilled too (dcp_refill.py)
    stripes: tuple[int, ...] = ()  # ranks of reached roots whose parity block is missing: re-created (dcp_refill.py)
    noted: bool = False  # a refilling note (verify --repair, a stopped refill): the load refills (dcp_refill.py)


def _blocks(reach: Sequence[Path | None], check: Sequence[int], d: str) -> list[list[int]]:
    """[the lane members the stripe descriptions name, the ranks whose parity block is there
    with the length its description records] on the roots ``check`` (parityrefill.blocks_held
    of each)."""
    lanes: set[int] = set()
    have: set[int] = set()
    for g in check:
        named, held = blocks_held(reach[g] / d / PARITY_DIR)  # type: ignore[operator]
        lanes |= named
        have |= held
    return [sorted(lanes), sorted(have)]


def _missing_blocks(m: Manifest, lost: set[int], outs: list) -> list[int]:
    """Rank 0: the lane members with no parity block on any reached root, whose roots are all
    reached (a lost root's ranks get theirs with their files)."""
    lanes = {k for _, blocks in outs for k in blocks[0]}
    have = {k for _, blocks in outs for k in blocks[1]}
    gone = {k for j in lost for k in m.dist.roots[j].ranks}  # type: ignore[union-attr]
    return sorted(lanes - have - gone)


def _size_problem(path: Path, f: FileRecord) -> str | None:
    """Why the file at ``path`` is not ``f`` by its size (missing, short, long), or None: the
    cheap check; the bytes are checked against their crc32c as the fetch reads them."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as e:
        return f"{path}: {describe(e)}"
    return None if st.st_size == f.size else f"{path}: {st.st_size} bytes, the manifest records {f.size}"


def _copy_names(step_dir: Path) -> dict[str, list[str]]:
    """{copy directory: its file names} under ``step_dir/copies``."""
    base = step_dir / COPIES_DIR
    try:
        dirs = sorted(p for p in base.iterdir() if p.is_dir() and p.name.startswith("rank"))
    except OSError:
        return {}
    return {p.name: sorted(q.name for q in p.iterdir() if q.is_file()) for p in dirs}


def held_paths(m: Manifest, reach: Sequence[Path | None]) -> tuple[Path | None, ...]:
    """``reach`` without the roots this rank matched by path alone (its root has no
    ``.gdswriter-root`` while the manifest recorded an id) that hold none of the step: a wiped or
    replaced node's disk, mounted at the path another node's root has (the same path on every
    node): this rank does not hold that root."""
    if m.dist is None:
        return tuple(reach)
    d = step_dir_name(m.step)
    return tuple(None if p is not None and not info.id.startswith("path:") and not (p / ROOT_MARKER_NAME).exists()
                 and not (p / d).exists() else p for info, p in zip(m.dist.roots, reach))


def _lost_message(m: Manifest, lost: Sequence[int]) -> str:
    info = m.dist.roots[lost[0]]  # type: ignore[union-attr]
    return (f"step {m.step}: root {info.path} (table root {lost[0]}, id {info.id}, ranks {list(info.ranks)}) holds "
            f"none of it any more on any rank of this job (a wiped or replaced node's disk?), and no copy of its "
            f"files is on a peer node. Restore that disk, or load a step saved elsewhere (for DCP steps that survive "
            f"a lost node, save with GDSStorageWriter(..., dist_options=DistOptions(replicas=2)))")


def place_files(coord: Coordinator, m: Manifest, reach: Sequence[Path | None], what: str,
                clean: bool = True) -> Placed:
    """Collective, two rounds of fixed size per rank in the common case (module docstring):
    rank 0 gathers the roots each rank reaches and whether it holds copies, and sends each rank
    the roots it looks at (the lowest rank reaching each); there each rank checks the step's
    files by size alone, and rank 0 broadcasts the problems: none where nothing is lost. Only
    then are the copies of the lost files looked for (``_from_copies``). Without copies, a root
    of the step no rank reaches is StepFilesLostError on every rank. With ``clean`` (no refill
    of this rank's still writing) and the step protected (a ``protected`` marker in ``step_S``
    or beside the manifest's copy in ``copies``: its replication is done), each rank
    first removes what a crashed refill left in ``copies/`` of the roots it looks at
    (dcp_refill.drop_leftovers)."""
    if m.dist is None:
        return Placed(m, False)
    d = step_dir_name(m.step)
    reached = {g: p for g, p in enumerate(reach) if p is not None}
    some = [any((p / d / COPIES_DIR).is_dir() for p in reached.values()),
            any((p / d / PARITY_DIR).is_dir() for p in reached.values()),
            any((p / d / PROTECTED_NAME).is_file() or (p / d / COPIES_DIR / PROTECTED_NAME).is_file()
                or (p / d / PARITY_DIR / REFILLING_NAME).is_file() for p in reached.values()),
            any((p / d / COPIES_DIR / REFILLING_NAME).is_file() or (p / d / PARITY_DIR / REFILLING_NAME).is_file()
                for p in reached.values())]
    needed = sorted({f.root for f in m.files})
    checker: dict[int, int] = {}

    def assign(outs: list) -> list:
        for r, (_, gs) in enumerate(outs):
            for g in gs:
                checker.setdefault(g, r)
        lost = [g for g in needed if g not in checker]
        copies, parity, protected, noted = (any(n[k] for n, _ in outs) for k in range(4))
        return [{"check": [g for g, c in checker.items() if c == r], "copies": copies or parity, "parity": parity,
                 "lost": lost, "protected": protected, "noted": noted} for r in range(len(outs))]

    mine = coord.decide_each(None, [some, sorted(reached)], f"{what} (finding the step's files)", assign)
    if not mine["copies"]:
        if mine["lost"]:
            raise StepFilesLostError(_lost_message(m, mine["lost"]))
        return Placed(m, False, reach=tuple(reach))
    check = tuple(mine["check"])
    if clean and mine["protected"]:
        for g in check:
            drop_leftovers(reach[g] / d / COPIES_DIR, m.step)  # type: ignore[operator]
    problems, blocks, error = [], [[], []], None
    lost = set(mine["lost"])
    try:
        problems = [[i, p] for i, f in enumerate(m.files) if f.root in check
                    and (p := _size_problem(reach[f.root] / d / f.path, f)) is not None]  # type: ignore[operator]
        if mine["parity"] and mine["protected"]:  # a parity block a stopped refill did not re-create
            blocks = _blocks(reach, check, d)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    said = coord.decide(error, [problems, blocks], f"{what} (checking the step's files)",
                        lambda outs: {"bad": [x for out, _ in outs for x in out],
                                      "stripes": _missing_blocks(m, lost, outs)}, hint="nothing was loaded")
    bad = said["bad"]
    unfit = tuple(sorted({i for i, _ in bad}))  # missing or of the wrong size on a root a rank reaches
    bad += [[i, f"root {f.root} of the step is on no rank of this job (a replaced node?)"]
            for i, f in enumerate(m.files) if f.root in lost]
    placed = Placed(m, True, check, reach=tuple(reach), parity=mine["parity"], checkers=checker or None,
                    lost=tuple(mine["lost"]), unfit=unfit, stripes=tuple(said["stripes"]), noted=mine["noted"])
    return _from_copies(coord, placed, [(i, p) for i, p in bad], what) if bad else placed


def _from_copies(coord: Coordinator, placed: Placed, bad: Sequence[tuple[int, str]], what: str) -> Placed:
    """Collective: ``placed`` with the files ``bad`` (with why) pointed at a copy of the right
    size not yet found bad (the lowest root, then directory), which the fetch checks against
    its crc32c as it reads; a parity step's files with none are first rebuilt from their lanes
    (``_from_parity``, once); raises alike on every rank when a file has none left."""
    m, d, reach = placed.m, step_dir_name(placed.m.step), placed.reach
    wanted = {f.path: i for i, f in enumerate(m.files) if i in {i for i, _ in bad}}
    found, error = [], None
    try:
        for g in placed.check:
            for name, files in _copy_names(reach[g] / d).items():  # type: ignore[operator]
                for fn in files:
                    i = wanted.get(fn)
                    rel = f"{COPIES_DIR}/{name}/{fn}"
                    if i is not None and (i, g, rel) not in placed.failed:
                        found.append([i, g, rel, _size_problem(reach[g] / d / rel, m.files[i])])  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    found = coord.decide(error, found, f"{what} (finding copies)", lambda outs: [x for out in outs for x in out],
                         hint="nothing was loaded")
    problems = placed.problems + tuple((i, p) for i, p in bad)
    problems += tuple((i, p) for i, _, _, p in found if p is not None)
    files, lost = list(m.files), []
    for i, why in bad:
        good = sorted((g, rel) for j, g, rel, p in found if j == i and p is None)
        if not good:
            lost.append(f"{m.files[i].path} ({'; '.join(p for j, p in problems if j == i)})")
            continue
        files[i] = replace(m.files[i], root=good[0][0], path=good[0][1])
        log.warning("gdswriter: step %d: data file %s is not usable where it was (%s); reading the copy %s on table "
                    "root %d instead (checked against its crc32c as it is read)", m.step, m.files[i].path, why,
                    good[0][1], good[0][0])
    if lost and placed.parity and not placed.rebuilt:
        gone = {m.files[i].path for i, _ in bad if not any(j == i and p is None for j, _, _, p in found)}
        return _from_copies(coord, _from_parity(coord, placed, gone, what), bad, what)
    if lost:
        damaged = any("damaged" in p for j, p in problems)
        cls = CorruptCheckpointError if damaged else StepFilesLostError
        raise cls(f"step {m.step}: {len(lost)} data file(s) have no good place left, neither their own root nor a "
                  f"copy on a peer node (first: {lost[0]}); load an older step, or restore those disks")
    return replace(placed, m=replace(m, files=tuple(files)), problems=problems)


def fetch_placed(coord: Coordinator, placed: Placed, fetch: Callable[[Placed], T], what: str) -> tuple[T, Placed]:
    """``fetch(placed)`` (a collective read of ``placed.m`` from ``placed.reach`` verifying every
    chunk's crc32c), again with the
    files that failed their check pointed at another copy, until it succeeds or a file has no
    good copy left (then raises alike on every rank); with the placement that succeeded (its
    ``unfit`` names the files found damaged on their own root too). Only where the step has copies, and after
    a failure the fetch's agreement gave every rank (its own typed error where it failed,
    RankFailedError elsewhere): every rank then says which file failed its check, if any, and
    when some rank failed otherwise, each raises its error as it is."""
    try:
        while True:
            try:
                return fetch(placed), placed
            except GDSWriterError as e:
                if not placed.copies or isinstance(e, CollectiveFailedError):  # a broken channel: no round left
                    raise
                placed = _after_damage(coord, placed, e, what)
    finally:
        if placed.held is not None:
            placed.held.close()


def _after_damage(coord: Coordinator, placed: Placed, e: BaseException, what: str) -> Placed:
    """Collective, after a fetch failed on every rank: the files whose bytes failed their
    crc32c where they were read (every rank says which, if any), pointed at their next copy;
    ``e`` raised again when some rank failed otherwise."""
    m, d, reach = placed.m, step_dir_name(placed.m.step), placed.reach
    mine: int | str | None = None if isinstance(e, RankFailedError) else "other"
    if isinstance(e, ChecksumMismatchError):
        paths = {str(reach[f.root] / d / f.path): i for i, f in enumerate(m.files)  # type: ignore[operator]
                 if f.root < len(reach) and reach[f.root] is not None}
        mine = paths.get(e.path, "other")

    def rule(outs: list) -> list[int] | None:
        if any(isinstance(x, str) for x in outs) or not any(x is not None for x in outs):
            return None
        return sorted({x for x in outs if x is not None})

    try:
        damaged = coord.decide(None, mine, f"{what} (after a damaged read)", rule)
    except GDSWriterError as lost:
        raise e from lost
    if damaged is None:
        raise e
    failed = placed.failed | {(i, m.files[i].root, m.files[i].path) for i in damaged}
    bad = [(i, f"{m.files[i].path} on table root {m.files[i].root}: fails its crc32c check (damaged)")
           for i in damaged]
    own = {i for i in damaged if not m.files[i].path.startswith(f"{COPIES_DIR}/")}  # not a copy: its own place
    return _from_copies(coord, replace(placed, failed=failed, unfit=tuple(sorted(set(placed.unfit) | own))), bad, what)


def _from_parity(coord: Coordinator, placed: Placed, gone: set[str], what: str) -> Placed:
    """Collective: the lane members whose files include ``gone`` (data file names with no good
    place) rebuilt from the rest of their parity lanes (parityload.rebuild_members) into
    ``copies/rank<R>/`` on a root a surviving member keeps its parity on, every chunk checked
    against its crc32c, where ``_from_copies`` then finds them; a copy no root can take is held
    in memory: one more table root, seen by its rebuilder alone. Two members of one lane lost:
    CorruptCheckpointError on every rank (never a guess)."""
    m = placed.m
    assert m.dist is not None
    roots = tuple(m.dist.roots)
    ranks = placed.checkers if placed.checkers is not None else {g: coord.rank for g in placed.check}
    seen = {roots[g].id: (r,) for g, r in ranks.items()}
    held = rebuild_members(coord, StepRoots(m.step, roots), placed.reach, seen,
                           lambda _r, member: any(f[1] in gone for f in member["files"]), None, what=what, src=0)
    placed = replace(placed, rebuilt=True)
    if held is None:
        return placed
    reach, check = list(placed.reach), list(placed.check)
    for e in held.entries:
        roots += (RootInfo(e["id"], f"(memory of rank {e['rebuilder']})", (e["rebuilder"],)),)
        reach.append(held.paths.get(e["rank"]))
        if e["rebuilder"] == coord.rank:
            check.append(len(roots) - 1)
    return replace(placed, m=replace(m, dist=replace(m.dist, roots=roots)), reach=tuple(reach), check=tuple(check),
                   held=held)


def check_replicas_supported(dist_options: DistOptions, single_process: bool) -> None:
    """GDSStorageWriter's copies and parity need peers: refused in one process."""
    if dist_options.replicas > 1 and single_process:
        raise InvalidOptionError(f"DistOptions(replicas={dist_options.replicas}) with single_process=True: there "
                                 f"are no peer nodes to copy to; pass replicas=1, or save from every rank")
    if dist_options.parity_group and single_process:
        raise InvalidOptionError(f"DistOptions(parity_group={dist_options.parity_group}) with single_process=True: "
                                 f"there are no peer nodes to hold the parity; pass dist_options=DistOptions() (or "
                                 f"unset GDSWRITER_PARITY_GROUP), or save from every rank")
