"""``gdswriter verify --repair`` while the step's own replication runs (issue 39): the repair
refuses a step that is neither marked protected nor noted for a refill (format/copies.py
``repairable``), touching nothing; otherwise it would set aside a copy the replication has
counted and withdraw a protection the replication then writes over (``protected`` claimed with a
copy gone). Real gloo ranks (each rank its own node-local root and GDSWRITER_HOSTNAME), real
files, the repair in a real second process; the replication held just before its primary rank
writes ``protected`` (every copy published), for GDSCheckpointer and for the DCP writer
(format.md 11.2, *The scrub*)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gdswriter.format.copies import STEP_LOCK_NAME

from support.dcp import flip, save_two_steps
from test_dcp_repair import ranks_held, state_of as dcp_state_of
from test_parity_scrub import _checkpointer, state_of

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = "step_000000000001"


def hold_protected(pause: str) -> None:
    """In a rank: the primary rank's write of step 1's ``protected`` (replicate.Replicator._mark
    on the primary step directory) waits until ``pause``/go exists, having made
    ``pause``/paused; every copy is published by then."""
    from gdswriter.distributed.parity import ParityReplicator
    from gdswriter.distributed.replicate import Replicator

    for cls in (Replicator, ParityReplicator):
        def held(self, d: Path, real=cls._mark):
            if d.name == STEP:
                Path(pause, "paused").touch()
                deadline = time.monotonic() + 120
                while not Path(pause, "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            return real(self, d)
        cls._mark = held  # type: ignore[method-assign]


def _ck_save(rank: int, world: int, tmp: str, pause: str) -> int | None:
    hold_protected(pause)
    with _checkpointer(tmp, rank, state_of(1)) as ck:
        ck.save(1)
        return ck.wait_protected(180)


def _dcp_save(rank: int, world: int, tmp: str, pause: str) -> list:
    hold_protected(pause)
    protect = {"replicas": 2} if world == 2 else {"parity_group": 3}
    return save_two_steps(rank, Path(tmp, f"node{rank}"), dcp_state_of, **protect)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the step lock's empty file (the repair makes it to flock)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != STEP_LOCK_NAME}


def verify_args(roots: list[Path]) -> list[str]:
    return ["verify", str(roots[0]), *[a for r in roots[1:] for a in ("--secondary", str(r))], "--step", "1"]


def repair(roots: list[Path]) -> tuple[int, str]:
    """``gdswriter verify --repair`` of step 1 in another process: (exit status, output)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    got = subprocess.run([sys.executable, "-c", "import sys; from gdswriter.cli import main; sys.exit(main(sys.argv[1:]))",
                          *verify_args(roots), "--repair"],
                         capture_output=True, text=True, env=env, timeout=300)
    return got.returncode, got.stdout + got.stderr


def repair_while_replicating(tmp_path: Path, save: Callable, roots: list[Path], victim: Callable[[], Path]) -> list:
    """The ranks (one a root) save step 1 (``save``), their replication held before ``protected``; meanwhile a
    byte of ``victim()`` (a published copy's file) is flipped and a repair runs: it must refuse,
    touching nothing. Then the replication ends; what the ranks returned."""
    with ranks_held(tmp_path, save, "save", "paused", len(roots)) as box:
        assert not (roots[0] / STEP / "protected").exists()
        flip(victim())
        before = [tree(r) for r in roots]
        code, said = repair(roots)
        assert code == 3 and "refused, nothing touched" in said and "set aside" not in said, (code, said)
        assert [tree(r) for r in roots] == before  # no note, nothing set aside
    return box["got"]


def _after(capsys, roots: list[Path], victim: Path) -> None:
    """The step protected as its replication said, no note; the damage still found, and a
    repair now (the step protected) sets the copy aside as it would have without the race."""
    from gdswriter.cli import main
    from gdswriter.format.copies import refilling_marker

    assert (roots[0] / STEP / "protected").exists() and refilling_marker(roots[0] / STEP) is None
    capsys.readouterr()
    args = verify_args(roots)
    assert main(args) == 3 and str(victim) in capsys.readouterr().out
    assert main([*args, "--repair"]) == 3
    said = capsys.readouterr().out
    assert "set aside as" in said and "refused, nothing touched" not in said, said
    assert not (roots[0] / STEP / "protected").exists()


def test_a_repair_is_refused_while_a_gdscheckpointer_step_replicates(tmp_path, capsys):
    """replicas=2 over 2 nodes (GDSCheckpointer): rank 1's copy on node 0 damaged while the
    replication of step 1 waits to write ``protected``; ``verify --repair`` refuses (exit 3, the
    scrub's finding stands) and writes nothing; the step then becomes protected, and a repair
    now sets the copy aside."""
    roots = [tmp_path / "n0", tmp_path / "n1"]

    def victim() -> Path:
        return next((roots[0] / STEP / "copies" / "rank00001").glob("data-rank1-*"))
    got = repair_while_replicating(tmp_path, _ck_save, roots, victim)
    assert got == [1, 1], got
    _after(capsys, roots, victim())


def test_a_repair_is_refused_while_a_dcp_step_replicates(tmp_path, capsys):
    """The same for a DCP step (GDSStorageWriter, replicas=2): step 1's replication held before
    ``protected``, rank 0's copy on node 1 damaged, the repair refused touching nothing."""
    roots = [tmp_path / "node0", tmp_path / "node1"]

    def victim() -> Path:
        return next((roots[1] / STEP / "copies" / "rank00000").glob("data-rank0-*.bin"))
    got = repair_while_replicating(tmp_path, _dcp_save, roots, victim)
    assert [x[1] for x in got] == [1, 1], got
    _after(capsys, roots, victim())


def test_a_repair_is_refused_while_a_dcp_parity_step_replicates(tmp_path, capsys):
    """parity_group=3 over 3 nodes (DCP): step 1's parity round held before ``protected``, rank
    1's published parity block damaged (its length kept), the repair refused touching nothing;
    the step then protected, and a repair now sets the block aside."""
    roots = [tmp_path / f"node{k}" for k in range(3)]

    def victim() -> Path:
        return roots[1] / STEP / "parity" / "rank00001.xor"
    got = repair_while_replicating(tmp_path, _dcp_save, roots, victim)
    assert [x[1] for x in got] == [1, 1, 1], got
    _after(capsys, roots, victim())
