"""Which copy of each rank's files a multi-rank load reads (format 1.4 replicas, issue 39).

A step saved with replicas lists, per rank, the roots holding a copy of its shard and data
files (format/copies.py). Before the plans are made, ``reached_copies`` moves every rank whose
own root no rank of this job sees (a node replaced: its root has a new id; or gone) to the
first copy some rank sees: pure, from the root table every rank holds. The load then reads as
it would (the ranks that see a copy read it and send the bytes on, checked on both ends).

When that load finds damage (a shard or a chunk whose crc32c does not match, a missing or
short file), ``verified_copies`` finds out whose files are bad: each rank's current place is
checked by a rank that sees it (its shard against the manifest, every chunk against the
shard), a bad one moves to the next copy, which is checked in turn, and the load runs once
more on the places that passed (a step protected by parity first rebuilds the files of ranks
whose root is gone into such a copy: parityload.py). A rank with no good copy left is a
CorruptCheckpointError naming every copy tried: never a load of bytes no checksum vouched for.
Where every place of that rank was lost (no rank sees its root, or the copy's folder is
missing: a node lost before the step was protected) and none was damaged, it is
StepFilesLostError, and a plain ``load()`` loads the newest step that is complete instead
(``newest_complete``; format.md 11.3), saying which it passed.
"""

from __future__ import annotations

import errno
import logging
import socket
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..engines.base import IOEngine
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StepFilesLostError, UnreachableDataError
from ..format.commit import CommitProtocol, step_dir_name
from ..format.copies import copy_ref, describe_root, with_copies
from ..format.manifest import Manifest, StorageRecord
from ..format.sharded import GlobalManifest, ShardRef, parse_shard, read_shard
from ..load.verify import verify_step
from .group import Coordinator, describe
from .loadplan import reach_of
from .parityload import HeldCopies, rebuild_lost
from .roots import RootLayout

log = logging.getLogger("gdswriter")
SCRATCH_BYTES = 16 << 20  # the buffer a rank re-reads another rank's chunks through (verify_step)


def job_ranks(layout: RootLayout) -> dict[str, tuple[int, ...]]:
    """Root id -> the ranks of this job that see it (the whole table, which a load holds)."""
    return {info.id: tuple(info.ranks) for info in layout.table}


def reached_copies(layout: RootLayout, g: GlobalManifest, copies: Sequence[Sequence[int]], what: str
                   ) -> dict[int, int]:
    """Rank -> the copy root to read its files from, for each rank whose own shard root no rank
    of this job sees: the first of its copies some rank sees. None seen: UnreachableDataError
    naming them all (the same on every rank: a pure function of what every rank holds)."""
    seen = job_ranks(layout)
    out: dict[int, int] = {}
    for r in range(g.world_size):
        own = g.shards[r].root
        if g.roots[own].id in seen:
            continue
        hit = next((j for j in copies[r] if g.roots[j].id in seen), None)
        if hit is None:
            places = "; ".join(describe_root(g, j) for j in (own, *copies[r]))
            raise UnreachableDataError(errno.ENOENT, f"{what}: no rank of this job sees any root holding rank {r}'s "
                                                     f"files or a copy of them ({places}): give some rank one of "
                                                     f"those roots (mount it), or load an earlier step")
        out[r] = hit
    return out


def use_copies(layout: RootLayout, g: GlobalManifest, choice: Mapping[int, int], what: str) -> GlobalManifest:
    """``g`` reading each rank of ``choice`` from its copy (format/copies.py ``with_copies``);
    the lowest rank that sees each copy says so (a warning naming the rank, the root, the host)."""
    seen = job_ranks(layout)
    for r, j in sorted(choice.items()):
        readers = seen.get(g.roots[j].id, ())
        if readers and min(readers) == layout.rank:
            log.warning("gdswriter: %s: restored rank %d's files from the copy on %s (%s), read by rank %d: its own "
                        "root %s did not serve them", what, r, describe_root(g, j), socket.gethostname(),
                        layout.rank, describe_root(g, g.shards[r].root))
    return with_copies(g, choice)


def _chunks_view(g: GlobalManifest, shard) -> Manifest:
    """The chunks a shard records as a Manifest verify_step re-reads (a storage per item, holding
    the chunks this rank wrote of it; no tensor, no tree)."""
    return Manifest(step=g.step, files=shard.files,
                    storages=tuple(StorageRecord(it.nbytes, cs) for it, cs in zip(shard.items, shard.chunks)),
                    tensors=(), state=None)


def check_place(g: GlobalManifest, r: int, root: int, copy: bool, reach: Sequence[Path | None],
                engine: IOEngine) -> tuple[str, bool] | None:
    """Rank ``r``'s files at one place (its own root, or its copy on ``root``), read by this rank
    (it sees ``root``): None when its shard matches the manifest and every chunk its crc32c,
    else (what is wrong, whether the place is lost: its shard is not there at all). A step
    deleted meanwhile raises CheckpointNotFoundError."""
    ref = copy_ref(g.shards[r], root) if copy else g.shards[r]
    d = reach[root] / step_dir_name(g.step)  # type: ignore[operator]
    problem = _place_problem(g, ref, d, reach, engine)
    return None if problem is None else (problem, not (d / ref.name).exists())


def _place_problem(g: GlobalManifest, ref: ShardRef, d: Path, reach: Sequence[Path | None], engine: IOEngine) -> str | None:
    try:
        shard = parse_shard(read_shard(d, g, ref, reach[0]), g, ref, str(d / ref.name))
        away = sorted({f.root for f in shard.files if reach[f.root] is None})
        if away:
            return f"its data files on {describe_root(g, away[0])} are not seen by the rank reading its shard"
        problems: list[str] = []
        verify_step(CommitProtocol([p if p is not None else Path("/nonexistent-root") for p in reach]),
                    _chunks_view(g, shard), engine, SCRATCH_BYTES, problems)
    except CheckpointNotFoundError:
        raise
    except (CorruptCheckpointError, OSError) as e:
        return " ".join(describe(e).split())
    return "; ".join(problems[:2]) + (f" and {len(problems) - 2} more" if len(problems) > 2 else "") or None


@dataclass
class Verified:
    """verified_copies' answer: rank -> the copy root to read it from, and the layout and
    manifest to read through (with a root more per rebuilt copy held in memory: parityload.py
    HeldCopies); a context manager, whose exit drops those copies (the load has read them)."""

    choice: dict[int, int]
    layout: RootLayout
    g: GlobalManifest
    held: HeldCopies | None = None

    def __enter__(self) -> Verified:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.held is not None:
            self.held.close()


def verified_copies(coord: Coordinator, layout: RootLayout, g: GlobalManifest, copies: Sequence[Sequence[int]],
                    engine: IOEngine, *, what: str, src: int) -> Verified:
    """Collective: rank -> the copy root to read it from, for each rank whose own files (or
    earlier copies) failed their checks (``check_place``, run by a rank that sees the place);
    every rank gets the same answer. A rank with no good place left: CorruptCheckpointError
    naming every place tried, on every rank. A step protected by parity first rebuilds its lost
    ranks' files into copies (parityload.py), which are then checked as any copy."""
    held = rebuild_lost(coord, layout, g, copies, what=what, src=src)
    if held is not None:
        layout, g, copies = held.apply(layout, g, copies)
    try:
        return Verified(_verified(coord, layout, g, copies, engine, what, src), layout, g, held)
    except BaseException:
        if held is not None:
            held.close()
        raise


def _verified(coord: Coordinator, layout: RootLayout, g: GlobalManifest, copies: Sequence[Sequence[int]],
              engine: IOEngine, what: str, src: int) -> dict[int, int]:
    """verified_copies' checks, on the places it gives."""
    seen = job_ranks(layout)
    reach = reach_of(g, layout)
    pos = [0] * g.world_size
    tried: dict[int, list[str]] = {}
    damaged: dict[int, bool] = {}  # some place of the rank was there but bad (not only lost)

    def place(r: int) -> int:
        return g.shards[r].root if pos[r] == 0 else copies[r][pos[r] - 1]

    pending = list(range(g.world_size))
    while pending:
        mine, error = [], None
        try:
            for r in pending:
                ranks = seen.get(g.roots[place(r)].id, ())
                if ranks and ranks[r % len(ranks)] == coord.rank:
                    problem = check_place(g, r, place(r), pos[r] > 0, reach, engine)
                    if problem is not None:
                        mine.append([r, *problem])
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
        bad = {r: (m, lost) for r, m, lost in coord.decide(error, mine, f"{what} (checking the copies)",
                                                           lambda outs: sorted(x for out in outs for x in out),
                                                           hint="the live state was not changed", root=src)}
        for r in pending:
            if not seen.get(g.roots[place(r)].id):
                bad[r] = ("no rank of this job sees it", True)
        pending = sorted(bad)
        for r in pending:
            m, lost = bad[r]
            tried.setdefault(r, []).append(f"{'copy on ' if pos[r] else 'own '}{describe_root(g, place(r))}: {m}")
            damaged[r] = damaged.get(r, False) or not lost
            pos[r] += 1
            if pos[r] > len(copies[r]):
                kind = CorruptCheckpointError if damaged[r] else StepFilesLostError
                raise kind(f"{what}: no good copy of rank {r}'s files is left, tried: {'; '.join(tried[r])}: "
                           f"{'the checkpoint is damaged' if damaged[r] else 'every copy was lost with its node'}; "
                           f"load an earlier step (load(fallback=True))")
    return {r: place(r) for r in range(g.world_size) if pos[r]}


_Prepared = TypeVar("_Prepared")


def newest_complete(step: int | None, prepare: Callable[[int | None], _Prepared], order: Callable[[], list[int]],
                    where: Any) -> tuple[_Prepared, tuple[int, ...]]:
    """Collective: ``prepare(step)``; where ``step`` is None (the latest) and it raised
    StepFilesLostError (alike on every rank: verified_copies' verdict is every rank's), the
    newest older step of ``order()`` (the fallback order, newest first, every rank's) that
    prepares, passing over only steps that lost files the same way (a damaged step raises, as
    without); (what ``prepare`` returned, the steps passed over). No complete step: the first
    error."""
    if step is not None:
        return prepare(step), ()
    try:
        return prepare(None), ()
    except StepFilesLostError as e:
        first = e
    steps = order()
    lost = steps[:1]
    for s in steps[1:]:
        try:
            got = prepare(s)
        except StepFilesLostError as e:
            log.warning("gdswriter: step %d under %s lost files too (%s)", s, where, " ".join(str(e).split()))
            lost.append(s)
            continue
        log.warning("gdswriter: loaded step %d under %s, the newest step complete across the surviving copies: "
                    "passed over step(s) %s, whose files some lost node held with no copy left (%s)", s, where, lost,
                    " ".join(str(first).split()))
        return got, tuple(lost)
    raise first
