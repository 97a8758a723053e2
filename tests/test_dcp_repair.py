"""``gdswriter verify --repair`` of a DCP step protected by replica copies (issue 39): the copy
it sets aside is re-created by the next load's refill (GDSStorageReader), which then writes
``protected`` back, removes the refilling note and the ``.damaged-`` evidence; ``ls`` and
``verify`` say the evidence is there meanwhile; a repair and a refill of the same step exclude
each other (format/copies.py ``step_lock``). Real files, real gloo ranks (each rank its own
node-local root, its own GDSWRITER_HOSTNAME), a real second process (format.md 11.2)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.dcp import dcp_state, flip, save_two_steps
from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = "step_000000000001"


def state_of(step: int) -> dict:
    return dcp_state(500, step)


def verify(capsys, roots: list[Path], *more: str) -> tuple[int, str]:
    """``gdswriter verify`` of step 1 over ``roots`` (the primary first): (exit status, output)."""
    from gdswriter.cli import main

    capsys.readouterr()
    code = main(["verify", str(roots[0]), *[a for r in roots[1:] for a in ("--secondary", str(r))], "--step", "1",
                 *more])
    got = capsys.readouterr()
    return code, got.out + got.err


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _save(rank: int, world: int, tmp: str) -> list:
    return save_two_steps(rank, Path(tmp, f"node{rank}"), state_of, replicas=2)


def _load(rank: int, world: int, tmp: str, pause: str = "") -> dict:
    """A DCP load of step 1 and its refill (``pause``: the primary rank's refill waits before it
    writes ``protected`` back until the file ``pause``/go exists, having made ``pause``/paused-<rank>)."""
    from support.dcp import load_refilled
    import gdswriter.distributed.dcp_refill as dcp_refill

    if pause:  # the primary rank's write of ``protected`` (format/copies.restore_protection), held
        real = dcp_refill.restore_protection

        def held(step_dir, marker):
            Path(pause, f"paused-{rank}").touch()
            while not Path(pause, "go").exists():
                time.sleep(0.05)
            return real(step_dir, marker)
        dcp_refill.restore_protection = held
    return load_refilled(Path(tmp, f"node{rank}"), 1, state_of(1))


def _damage_and_repair(capsys, roots: list[Path], rank: int) -> Path:
    """A byte flipped in rank ``rank``'s copy (on the other node), found (exit 3) and set aside by
    --repair; the copy's folder."""
    copy = roots[1 - rank] / STEP / "copies" / f"rank{rank:05d}"
    flip(next(copy.glob(f"data-rank{rank}-*.bin")))
    code, said = verify(capsys, roots, "--repair")
    assert code == 3 and f"the copy of rank {rank}'s files on table root" in said and "set aside as" in said, said
    return copy


def test_a_dcp_replica_copy_set_aside_is_re_created_by_the_next_load(tmp_path, capsys):
    """replicas=2 (DCP) over 2 nodes, step 1 protected. A byte flipped in rank 1's copy on node
    0: --repair withdraws ``protected`` (``copies/refilling`` keeps the marker) and sets the copy
    folder aside; ``ls`` and ``verify`` name the ``.damaged-`` folder. The next load (bit-exact,
    from the intact own files) refills: the copy is back byte for byte rank 1's files,
    ``protected`` back as it was, the note and the ``.damaged-`` folder gone, the scrub passes.
    Node 1, beside the manifest's copy, loses ``copies/protected`` to a note alike, and gets it back."""
    from gdswriter.cli import main

    run_ranks(2, _save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "node0", tmp_path / "node1"]
    code, said = verify(capsys, roots)
    assert code == 0 and "protection intact" in said, said
    marker = json.loads((roots[0] / STEP / "protected").read_bytes())
    copy = roots[0] / STEP / "copies" / "rank00001"
    own = {n: (roots[1] / STEP / n).read_bytes() for n in tree(copy)}
    assert own and tree(copy) == own

    _damage_and_repair(capsys, roots, 1)
    assert not copy.exists() and not (roots[0] / STEP / "protected").exists()
    assert json.loads((roots[0] / STEP / "copies" / "refilling").read_bytes()) == marker
    keeper = roots[1] / STEP / "copies"  # beside the manifest's copy: the claim withdrawn, noted alike
    assert not (keeper / "protected").exists() and json.loads((keeper / "refilling").read_bytes()) == marker
    aside = list(copy.parent.glob(".damaged-rank00001-*"))
    assert len(aside) == 1, aside
    code, said = verify(capsys, roots)
    assert code == 0 and "set aside by verify --repair" in said and str(aside[0]) in said, said
    capsys.readouterr()
    assert main(["ls", str(roots[0])]) == 0
    said = capsys.readouterr().out
    assert "1 damaged copy or parity block set aside" in said and str(aside[0]) in said, said

    got = run_ranks(2, _load, str(tmp_path), out=tmp_path / "load")
    for rank, x in enumerate(got):
        assert x["load"] == [None, True] and x["refilled"] == 1, (rank, x)
    assert tree(copy) == own
    assert json.loads((roots[0] / STEP / "protected").read_bytes()) == marker
    assert not (roots[0] / STEP / "copies" / "refilling").exists()
    assert json.loads((keeper / "protected").read_bytes()) == marker and not (keeper / "refilling").exists()
    assert not list(copy.parent.glob(".damaged-*")) and not list(copy.parent.glob(".trash-*"))
    code, said = verify(capsys, roots)
    assert code == 0 and "protection intact" in said and "set aside" not in said, said


def test_a_set_aside_copy_of_rank_0_comes_back_with_the_manifests_copy(tmp_path, capsys):
    """Rank 0's copy (on node 1, beside ``copies/manifest.json`` and ``copies/protected``) set
    aside and re-created: its files byte for byte, the manifest's copy intact, the step protected."""
    run_ranks(2, _save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "node0", tmp_path / "node1"]
    copy = roots[1] / STEP / "copies" / "rank00000"
    own = {n: (roots[0] / STEP / n).read_bytes() for n in tree(copy)}
    _damage_and_repair(capsys, roots, 0)
    got = run_ranks(2, _load, str(tmp_path), out=tmp_path / "load")
    assert all(x["load"] == [None, True] and x["refilled"] == 1 for x in got), got
    assert tree(copy) == own
    assert (roots[1] / STEP / "copies" / "manifest.json").read_bytes() == (roots[0] / STEP / "manifest.json").read_bytes()
    assert (roots[0] / STEP / "protected").exists() and verify(capsys, roots)[0] == 0


def test_a_repair_is_refused_while_a_refill_of_the_step_runs(tmp_path, capsys):
    """Rank 1's copy set aside; the next load's refill re-creates it and stops before it writes
    ``protected`` back. Meanwhile rank 0's copy is found damaged, and ``verify --repair`` (this
    process, while the ranks' refill runs) is refused, touching nothing: had it set rank 0's copy
    aside, the refill would then mark the step protected with a copy gone. Once the refill
    ended, the step is protected, the scrub still finds rank 0's copy damaged, and a repair and
    a load re-create it."""
    run_ranks(2, _save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "node0", tmp_path / "node1"]
    _damage_and_repair(capsys, roots, 1)
    with ranks_held(tmp_path, _load, "load", "paused-0") as box:
        victim = next((roots[1] / STEP / "copies" / "rank00000").glob("data-rank0-*.bin"))
        flip(victim)
        before = tree(roots[0]), tree(roots[1])
        code, said = verify(capsys, roots, "--repair")
        assert code != 0 and "a refill of this step is running" in said, (code, said)
        assert (tree(roots[0]), tree(roots[1])) == before  # refused before it touched anything
    assert all(x["load"] == [None, True] and x["refilled"] == 1 for x in box["got"]), box
    assert (roots[0] / STEP / "protected").exists()
    code, said = verify(capsys, roots)
    assert code == 3 and str(victim) in said, said
    code, said = verify(capsys, roots, "--repair")
    assert code == 3 and "set aside as" in said, said
    got = run_ranks(2, _load, str(tmp_path), out=tmp_path / "load2")
    assert all(x["refilled"] == 1 for x in got), got
    assert verify(capsys, roots)[0] == 0


@contextlib.contextmanager
def ranks_held(tmp_path: Path, fn: Callable, out: str, flag: str, world: int = 2) -> Iterator[dict]:
    """``world`` ranks running ``fn(rank, world, tmp, pause)`` (in a thread), held where they made the
    file ``pause``/``flag`` (until ``pause``/go exists) while the block runs; then let go and
    joined. The dict gets the ranks' results ("got")."""
    pause = tmp_path / "pause"
    pause.mkdir()
    box: dict = {}
    ranks = threading.Thread(target=lambda: box.update(got=run_ranks(world, fn, str(tmp_path), str(pause),
                                                                        out=tmp_path / out)))
    ranks.start()
    try:
        deadline = time.monotonic() + 180
        while not (pause / flag).exists() and ranks.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (pause / flag).exists(), f"the ranks never reached {flag}"
        yield box
    finally:
        (pause / "go").touch()
        ranks.join(300)
    assert not ranks.is_alive()


REPAIR_HELD = """
import sys, time
from pathlib import Path
import gdswriter.load.verify as v
from gdswriter.cli import main
real = v.set_aside_damage
def held(protocol, report):
    Path(sys.argv[1], "repairing").touch()
    while not Path(sys.argv[1], "go").exists():
        time.sleep(0.05)
    return real(protocol, report)
v.set_aside_damage = held
sys.exit(main(["verify", sys.argv[2], "--secondary", sys.argv[3], "--step", "1", "--repair"]))
"""


@contextlib.contextmanager
def repair_held(tmp_path: Path, roots: list[Path]) -> Iterator[dict]:
    """``verify --repair`` of step 1 over ``roots`` in another process, held after its scrub
    (before it sets anything aside) while the block runs; then let go. The dict gets the
    repair's exit status and output ("code", "said") once it ended."""
    sig = tmp_path / "sig"
    sig.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", REPAIR_HELD, str(sig), *map(str, roots)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out: dict = {}
    try:
        deadline = time.monotonic() + 120
        while not (sig / "repairing").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (sig / "repairing").exists(), proc.communicate()[0] if proc.poll() is not None else "no scrub"
        yield out
    finally:
        (sig / "go").touch()
        out["said"] = proc.communicate(timeout=120)[0]
        out["code"] = proc.returncode


def test_a_refill_does_not_run_while_a_repair_of_the_step_runs(tmp_path, capsys):
    """Rank 1's copy set aside by a first repair (the step noted for a refill); then rank 0's
    copy damaged and ``verify --repair`` run in another process, stopped after its scrub, before
    it sets the copy aside. A load meanwhile (bit-exact) refills nothing: its refill fails on
    every rank, naming the repair, and writes nothing (no ``protected`` claimed while the repair
    withdraws it). The repair then ends as it would alone, and the next load re-creates both
    copies and protects the step."""
    run_ranks(2, _save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "node0", tmp_path / "node1"]
    _damage_and_repair(capsys, roots, 1)
    flip(next((roots[1] / STEP / "copies" / "rank00000").glob("data-rank0-*.bin")))
    before = tree(roots[0]), tree(roots[1])
    with repair_held(tmp_path, roots) as repair:
        got = run_ranks(2, _load, str(tmp_path), out=tmp_path / "load")
        for rank, x in enumerate(got):
            assert x["load"] == [None, True], (rank, x)
            assert isinstance(x["refilled"], list) and x["refilled"][0] == "ReplicationError", (rank, x)
            assert "verify --repair of this step is running" in x["refilled"][1], (rank, x)
        assert (tree(roots[0]), tree(roots[1])) == before  # the refill wrote nothing
    assert repair["code"] == 3 and "rank00000: set aside as" in repair["said"], repair["said"]
    assert not (roots[0] / STEP / "protected").exists()
    got = run_ranks(2, _load, str(tmp_path), out=tmp_path / "load2")
    assert all(x["load"] == [None, True] and x["refilled"] == 1 for x in got), got
    assert (roots[0] / STEP / "protected").exists() and verify(capsys, roots)[0] == 0
