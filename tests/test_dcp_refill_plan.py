"""dcp_refill.plan_dcp_refill alone (pure: no processes, no files): which moves a DCP step's
refill makes for a replaced root, for files unfit on a reached root, with several copies, and
for a step protected by parity; copies always move before a root's own files."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gdswriter.distributed.dcp_refill import DcpMove, plan_dcp_refill
from gdswriter.distributed.dcp_replicas import Placed
from gdswriter.errors import GDSWriterError
from gdswriter.format.manifest import DistInfo, FileRecord, Manifest, RootInfo


def _manifest(world: int) -> Manifest:
    """``world`` ranks, each alone on its root, two data files each."""
    roots = tuple(RootInfo(f"id{r}", f"/nodes/node{r}", (r,)) for r in range(world))
    files = tuple(FileRecord(r, f"data-rank{r}-{k}.bin", 4096) for r in range(world) for k in range(2))
    return Manifest(1, files, (), (), None, dist=DistInfo(world, "dcp", roots))


def _placed(m: Manifest, at: dict[int, tuple[int, str]], lost: tuple[int, ...] = (),
            unfit: tuple[int, ...] = ()) -> Placed:
    """``m`` with rank R's files pointed at ``copies/<dir>`` on table root g, for ``at`` {R: (g, dir)}."""
    files = list(m.files)
    for i, f in enumerate(files):
        r = int(f.path.split("-")[1][4:])
        if r in at:
            g, d = at[r]
            files[i] = replace(f, root=g, path=f"copies/{d}/{f.path}")
    return Placed(replace(m, files=tuple(files)), True, lost=lost, unfit=unfit)


def test_a_replaced_root_gets_its_ranks_files_and_the_copies_it_held_copies_first():
    """2 ranks, replicas=2, root 1 replaced: rank 1's files come from copies/rank00001 on root 0
    (sent by rank 0, written by rank 1), and rank 0's copy, which root 1 held, moves first."""
    m = _manifest(2)
    placed = _placed(m, {1: (0, "rank00001")}, lost=(1,))
    moves = plan_dcp_refill(m, placed, {0: 0}, {1: 1}, 2)
    assert moves == [DcpMove(0, 0, "", 0, 1, 1, False, (0, 1)),
                     DcpMove(1, 0, "copies/rank00001", 0, 1, 1, True, (2, 3))]


def test_unfit_files_on_a_reached_root_are_refilled_alone():
    """No root lost; rank 1's second file missing or damaged on root 1: that file alone moves
    from its copy on root 0 to root 1, written by the rank looking at root 1; no copy moves (each
    rank keeps its C - 1 copies)."""
    m = _manifest(2)
    placed = _placed(m, {}, unfit=(3,))
    placed = replace(placed, m=replace(placed.m, files=placed.m.files[:3] + (
        replace(m.files[3], root=0, path=f"copies/rank00001/{m.files[3].path}"),)))
    moves = plan_dcp_refill(m, placed, {0: 0, 1: 1}, {0: 1, 1: 1}, 2)
    assert moves == [DcpMove(1, 0, "copies/rank00001", 0, 1, 1, True, (3,))]


def test_with_three_copies_each_rank_short_of_copies_gets_one_on_the_replaced_root():
    """3 ranks, replicas=3, root 2 replaced (it held a copy of ranks 0 and 1): rank 2's files come
    from the lowest copy the load read (root 0); ranks 0 and 1, left with one copy each, get one
    on root 2 from their own roots, before rank 2's own files; rank 2 (two copies left) none."""
    m = _manifest(3)
    placed = _placed(m, {2: (0, "rank00002")}, lost=(2,))
    moves = plan_dcp_refill(m, placed, {0: 0, 1: 1}, {0: 1, 1: 1, 2: 2}, 3)
    assert moves == [DcpMove(0, 0, "", 0, 2, 2, False, (0, 1)),
                     DcpMove(1, 1, "", 1, 2, 2, False, (2, 3)),
                     DcpMove(2, 0, "copies/rank00002", 0, 2, 2, True, (4, 5))]
    assert plan_dcp_refill(m, placed, {0: 0, 1: 1}, {0: 2, 1: 2, 2: 2}, 3) == moves[2:]  # no copy short


def test_a_parity_step_moves_the_rebuilt_copy_only():
    """parity_group=3, root 1 replaced, its files rebuilt into copies/rank00001 on root 2: they
    move from there to root 1 (the refill plans with c=1: no copies to top up)."""
    m = _manifest(3)
    placed = _placed(m, {1: (2, "rank00001")}, lost=(1,))
    assert plan_dcp_refill(m, placed, {0: 0, 2: 2}, {}, 1) == [DcpMove(1, 2, "copies/rank00001", 2, 1, 1, True,
                                                                       (2, 3))]


def test_nothing_lost_nothing_moved_and_files_from_no_copy_are_refused():
    """Nothing lost nor unfit: no move. A file placed somewhere that is no rank's copy
    directory: GDSWriterError naming it, never a guess."""
    m = _manifest(2)
    assert plan_dcp_refill(m, _placed(m, {}), {0: 0, 1: 1}, {0: 1, 1: 1}, 2) == []
    odd = _placed(m, {1: (0, "elsewhere")}, lost=(1,))
    with pytest.raises(GDSWriterError, match="not from one rank's copy"):
        plan_dcp_refill(m, odd, {0: 0}, {1: 1}, 2)


def test_a_rank_looking_at_both_roots_is_sender_and_receiver():
    """Rank 0 looks at both roots (it sees both disks): rank 1's unfit file is read from its copy
    on root 0 and written on root 1 by rank 0 alike (dcp_refill runs it as a local move)."""
    m = _manifest(2)
    placed = _placed(m, {}, unfit=(2,))
    placed = replace(placed, m=replace(placed.m, files=placed.m.files[:2] + (
        replace(m.files[2], root=0, path=f"copies/rank00001/{m.files[2].path}"),) + placed.m.files[3:]))
    assert plan_dcp_refill(m, placed, {0: 0, 1: 0}, {0: 1, 1: 1}, 2) == [
        DcpMove(1, 0, "copies/rank00001", 0, 0, 1, True, (2,))]
