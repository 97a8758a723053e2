"""distributed/opening.py: the one round that opens a checkpoint's roots, for open_session and
for the DCP writer. Rank 0's decision is tested without ranks (from offers), the locks and
checks on real directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdswriter.distributed.dcp_messages import RootsOffer
from gdswriter.distributed.group import Coordinator
from gdswriter.distributed.opening import Opening, decide_roots, lock_checked, offer_roots, open_roots, take_roots
from gdswriter.errors import RootUnavailableError
from gdswriter.format.commit import step_dir_name, write_owner


def _probe(committed: list[int]) -> dict:
    return {"committed": committed, "latest": committed[-1] if committed else None, "names": [], "copied": []}


def _offers() -> tuple[Opening, list[RootsOffer]]:
    """Two ranks on their own disks; only rank 1's holds committed steps (rank 0 restarted on
    another node)."""
    o0 = RootsOffer((("id0", "/n0/nvme"),), (_probe([]),))
    o1 = RootsOffer((("id1", "/n1/nvme"),), (_probe([4, 5]),))
    return Opening([Path("/n0/nvme")], ["id0"], o0), [o0, o1]


def test_a_primary_on_another_rank_is_refused_where_only_rank_0_commits():
    own, offers = _offers()
    with pytest.raises(RootUnavailableError, match="not one of rank 0's roots"):
        decide_roots(own, offers, movable_primary=False)


def test_a_moved_primary_goes_to_its_rank_with_the_whole_table():
    """GDSCheckpointer's open (movable): rank 1's root is the primary, and rank 1's part carries
    the whole table (it writes the manifests); rank 0's layout holds it too."""
    own, offers = _offers()
    decided = decide_roots(own, offers, movable_primary=True)
    assert decided.layout.primary_rank == 1 and decided.layout.primary_id == "id1"
    assert decided.probe["committed"] == [4, 5]
    assert "table" in decided.parts[1] and "table" not in decided.parts[0]
    rank1 = Opening([Path("/n1/nvme")], ["id1"], offers[1])
    layout = take_roots(rank1, 1, 2, decided.parts[1])
    assert layout.holds_table and [info.id for info in layout.table] == ["id1", "id0"]
    assert layout.leads(0) and layout.is_primary(0)


def test_a_root_changed_between_its_probe_and_its_lock_is_refused(tmp_path):
    """Another rank than 0 probes its roots unlocked (it does not know yet which it leads): a
    root another writer changed before this rank held its lock is refused, not taken on what
    rank 0 decided from the old probe."""
    r0, r1 = tmp_path / "r0", tmp_path / "r1"
    own = offer_roots([r0], 0)
    try:
        mine = offer_roots([r1], 1, whole=False)
        decided = decide_roots(own, [own.offer, mine.offer], movable_primary=False)
        layout = take_roots(mine, 1, 2, decided.parts[1])
        assert layout.leads(0)
        step = r1 / step_dir_name(7)  # another writer's secondary step directory, made meanwhile
        step.mkdir()
        write_owner(step, "/elsewhere", "another-primary")
        with pytest.raises(RootUnavailableError, match="changed while"):
            lock_checked(layout, mine)
        lock_checked(layout, offer_roots([r1], 1, whole=False)).release()  # probed again: taken
    finally:
        own.release()


def test_open_roots_in_one_process_locks_its_roots(tmp_path):
    layout, lock, probe = open_roots(Coordinator.solo(), [tmp_path / "a", tmp_path / "b"])
    try:
        assert layout.holds_table and layout.primary_rank == 0 and probe["committed"] == []
        assert [layout.leads(i) for i in range(2)] == [True, True]
    finally:
        lock.release()
