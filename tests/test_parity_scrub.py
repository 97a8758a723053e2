"""The scrub (issue 39): ``gdswriter verify`` re-reads every parity block and every copy that
protects a multi-rank step, against the crc32c the step records for them, so damage is found
before a lost node needs them; ``--repair`` withdraws ``protected`` and sets the damage aside,
and the next multi-rank load's refill re-creates it bit-exact and marks the step protected
again (format.md 11.1, 11.2). Real files, real gloo ranks (each rank its own node-local root,
its own GDSWRITER_HOSTNAME)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from support.dcp import dcp_load, dcp_state, flip, save_two_steps
from support.ranks import caught, run_ranks

from gdswriter.format.copies import STEP_LOCK_NAME

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = "step_000000000001"
PARITY = {"copies": 1, "parity_group": 3}


def verify(capsys, roots: list[Path], *more: str) -> tuple[int, str]:
    """``gdswriter verify`` of step 1 over ``roots`` (the primary first): (exit status, output)."""
    from gdswriter.cli import main

    capsys.readouterr()
    code = main(["verify", str(roots[0]), *[a for r in roots[1:] for a in ("--secondary", str(r))], "--step", "1",
                 *more])
    return code, capsys.readouterr().out


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, by its path relative to it."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- parity (a DCP step)
def dcp_state_of(step: int) -> dict:
    return dcp_state(300, step)


def _dcp_save(rank: int, world: int, tmp: str) -> list:
    return save_two_steps(rank, Path(tmp, f"node{rank}"), dcp_state_of, parity_group=3)


def _dcp_load(rank: int, world: int, tmp: str) -> dict:
    from support.dcp import load_refilled

    return load_refilled(Path(tmp, f"node{rank}"), 1, dcp_state_of(1))


def test_a_flipped_byte_in_a_parity_block_is_found_set_aside_and_re_created(tmp_path, capsys):
    """parity_group=3 over 3 nodes, step 1 protected: the scrub passes (3 blocks re-read, exit
    0). A byte flipped in rank 1's parity block (its length unchanged): exit 3 ("intact but
    protection damaged", not 1), naming rank 1, its root and the block's file. --repair: the
    step stops saying ``protected`` (``parity/refilling`` keeps its group), the block and its
    description set aside (nothing deleted: the damaged bytes are still on disk); a scrub now
    reports the block missing. The next load (bit-exact) re-creates the block: byte for byte
    the one saved, ``protected`` back, the note gone, and the scrub passes again."""
    run_ranks(3, _dcp_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"node{k}" for k in range(3)]
    code, said = verify(capsys, roots)
    assert code == 0 and "protection intact (3 parity blocks" in said, said
    pdir = roots[1] / STEP / "parity"
    saved = {n: (pdir / n).read_bytes() for n in ("rank00001.xor", "rank00001.json")}
    flip(pdir / "rank00001.xor")
    damaged = (pdir / "rank00001.xor").read_bytes()
    assert len(damaged) == len(saved["rank00001.xor"])

    code, said = verify(capsys, roots)
    assert code == 3, said
    assert "PROTECTION DAMAGED: rank 1's parity block on table root 1" in said and str(pdir / "rank00001.xor") in said
    assert "crc32c" in said and "CORRUPT" not in said, said
    code, said = verify(capsys, roots, "--repair")
    assert code == 3 and "set aside" in said, said
    marks = roots[0] / STEP
    assert not (marks / "protected").exists()
    assert json.loads((marks / "parity" / "refilling").read_bytes()) == PARITY
    assert not (pdir / "rank00001.xor").exists() and not (pdir / "rank00001.json").exists()
    aside = sorted(p.name for p in pdir.glob(".damaged-*"))
    assert [n.rsplit("-", 1)[0] for n in aside] == [".damaged-rank00001.json", ".damaged-rank00001.xor"], aside
    assert (pdir / aside[1]).read_bytes() == damaged  # nothing deleted
    assert not (marks / "copies").exists()  # the step lock made no copies/ on a parity step's primary
    assert (marks / STEP_LOCK_NAME).is_file()  # its file instead
    code, said = verify(capsys, roots)
    assert code == 3 and "missing" in said, said

    got = run_ranks(3, _dcp_load, str(tmp_path), out=tmp_path / "load")
    for rank, x in enumerate(got):
        assert x["load"] == [None, True] and x["refilled"] == 1, (rank, x)
    assert (pdir / "rank00001.xor").read_bytes() == saved["rank00001.xor"]
    assert json.loads((pdir / "rank00001.json").read_bytes()) == json.loads(saved["rank00001.json"])
    assert json.loads((marks / "protected").read_bytes()) == PARITY and not (marks / "parity" / "refilling").exists()
    assert not list(pdir.glob(".damaged-*")) and not (marks / "copies").exists()
    code, said = verify(capsys, roots)
    assert code == 0 and "protection intact (3 parity blocks" in said, said


def test_a_damaged_parity_description_and_a_missing_block_are_reported(tmp_path, capsys):
    """The scrub reads what it checks as untrusted: rank 2's description cut short, and rank 0's
    block removed, are each reported (rank, root, file), exit 3; the step's own files are intact."""
    run_ranks(3, _dcp_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"node{k}" for k in range(3)]
    desc = roots[2] / STEP / "parity" / "rank00002.json"
    desc.write_bytes(desc.read_bytes()[:40])
    (roots[0] / STEP / "parity" / "rank00000.xor").unlink()
    code, said = verify(capsys, roots)
    assert code == 3, said
    assert f"rank 2's parity block on table root 2: {desc}: its description" in said, said
    assert "rank 0's parity block on table root 0" in said and "missing" in said, said


# ----------------------------------------------------------------------------- copies (GDSCheckpointer)
def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(700 + step)
    return {"a": torch.randn(1 << 20, generator=g), "b": torch.randint(0, 1 << 30, (1 << 20,), generator=g)}


def _checkpointer(tmp: str, rank: int, holder: dict):
    """replicas=2 on 2 ranks, parity_group=3 on 3."""
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    from support.models import small_options

    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    world = torch.distributed.get_world_size()
    protect = {"replicas": 2} if world == 2 else {"parity_group": 3}
    return GDSCheckpointer(holder, root=f"{tmp}/n{rank}", options=small_options(),
                           dist_options=DistOptions(timeout_s=60, **protect))


def _ck_save(rank: int, world: int, tmp: str) -> int | None:
    with _checkpointer(tmp, rank, state_of(1)) as ck:
        ck.save(1)
        return ck.wait_protected(120)


def _ck_load(rank: int, world: int, tmp: str) -> dict:
    holder = {k: torch.zeros_like(v) for k, v in state_of(1).items()}
    with _checkpointer(tmp, rank, holder) as ck:
        got = ck.load(1)
        exact = all(torch.equal(holder[k], v) for k, v in state_of(1).items())
        refilled = caught(lambda: ck.wait_protected(120))
        return {"load": [got, exact], "refilled": refilled, "protected": ck.protected_step()}


def test_a_flipped_byte_in_a_replica_copy_is_found_set_aside_and_re_created(tmp_path, capsys):
    """replicas=2 over 2 nodes, step 1 protected: the scrub re-reads both copies (exit 0). A
    byte flipped in rank 1's data file as its copy on node 0 holds it (same length): exit 3,
    naming rank 1's copy, table root 0 and the file. --repair: ``protected`` gone
    (``copies/refilling`` keeps the marker), the copy's folder set aside whole. The next load
    (bit-exact, from the intact own files) refills: the copy is back, byte for byte the files
    rank 1 holds, ``protected`` back, the note gone, the scrub passes. The root holding the
    manifest's copy is withdrawn and restored alike (``copies/protected``, ``copies/refilling``)."""
    run_ranks(2, _ck_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "n0", tmp_path / "n1"]
    code, said = verify(capsys, roots)
    assert code == 0 and "protection intact (0 parity blocks" in said, said
    copy = roots[0] / STEP / "copies" / "rank00001"
    own = {n: (roots[1] / STEP / n).read_bytes() for n in tree(copy)}
    assert tree(copy) == own  # byte-identical copies
    marker = (roots[0] / STEP / "protected").read_bytes()
    victim = next(copy.glob("data-rank1-*.bin"))
    flip(victim)

    code, said = verify(capsys, roots)
    assert code == 3, said
    assert f"the copy of rank 1's files on table root 0: {victim}: bytes [" in said and "CORRUPT" not in said, said
    code, said = verify(capsys, roots, "--repair")
    assert code == 3 and "set aside" in said, said
    assert not (roots[0] / STEP / "protected").exists()
    assert (roots[0] / STEP / "copies" / "refilling").read_bytes() == marker
    assert not copy.exists() and len(list(copy.parent.glob(".damaged-rank00001-*"))) == 1
    keeper = roots[1] / STEP / "copies"  # the manifest's copy: its claim withdrawn too, noted alike
    assert not (keeper / "protected").exists() and (keeper / "refilling").read_bytes() == marker

    got = run_ranks(2, _ck_load, str(tmp_path), out=tmp_path / "load")
    for rank, x in enumerate(got):
        assert x["load"] == [1, True] and x["refilled"] is None and x["protected"] == 1, (rank, x)
    assert tree(copy) == own
    assert (roots[0] / STEP / "protected").read_bytes() == marker
    assert not (roots[0] / STEP / "copies" / "refilling").exists()
    assert (keeper / "protected").read_bytes() == marker and not (keeper / "refilling").exists()
    assert not list(copy.parent.glob(".damaged-*"))  # the evidence removed once re-created and protected
    code, said = verify(capsys, roots)
    assert code == 0 and "protection intact" in said, said


def test_a_damaged_manifest_copy_is_rewritten_and_a_cut_or_missing_copy_is_reported(tmp_path, capsys):
    """A damaged copy of the global manifest (``copies/manifest.json``) is reported and
    ``--repair`` rewrites it from ``manifest.json`` (no refill needed); a copy's shard cut short
    is reported too."""
    run_ranks(2, _ck_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "n0", tmp_path / "n1"]
    mcopy = roots[1] / STEP / "copies" / "manifest.json"
    flip(mcopy)
    code, said = verify(capsys, roots)
    assert code == 3 and f"the global manifest's copy on table root 1: {mcopy}" in said, said
    code, said = verify(capsys, roots, "--repair")
    assert code == 3 and "rewritten from manifest.json" in said, said
    assert mcopy.read_bytes() == (roots[0] / STEP / "manifest.json").read_bytes()
    assert (roots[0] / STEP / "protected").exists()  # nothing else was wrong: still protected
    assert verify(capsys, roots)[0] == 0
    shard = roots[1] / STEP / "copies" / "rank00000" / "manifest-rank00000.json"
    shard.write_bytes(shard.read_bytes()[:-3])
    code, said = verify(capsys, roots)
    assert code == 3 and str(shard) in said, said
    shutil.rmtree(roots[1] / STEP / "copies" / "rank00000")
    code, said = verify(capsys, roots)
    assert code == 3 and "the copy of rank 0's files on table root 1" in said and "missing" in said, said


def test_a_gdscheckpointer_parity_block_set_aside_is_re_created_by_the_next_loads_refill(tmp_path, capsys):
    """parity_group=3 over 3 nodes (GDSCheckpointer: format 1.4, its refill.py): a byte flipped in
    rank 2's parity block is found (exit 3), --repair sets it aside and withdraws ``protected``;
    the next load (bit-exact) re-creates the block byte for byte, ``protected`` comes back as
    parity wrote it (protected_step() is 1 on every rank) and the scrub passes. The primary's
    step directory holds an empty ``copies/``, as the step lock left it before it was a file."""
    run_ranks(3, _ck_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"n{k}" for k in range(3)]
    pdir = roots[2] / STEP / "parity"
    saved = (pdir / "rank00002.xor").read_bytes()
    marker = (roots[0] / STEP / "protected").read_bytes()
    assert json.loads(marker) == PARITY
    assert verify(capsys, roots)[0] == 0
    (roots[0] / STEP / "copies").mkdir()  # as a step lock before the lock file left it: still fine
    flip(pdir / "rank00002.xor")
    code, said = verify(capsys, roots, "--repair")
    assert code == 3 and f"rank 2's parity block on table root 2: {pdir / 'rank00002.xor'}" in said, said
    assert not (roots[0] / STEP / "protected").exists() and not (pdir / "rank00002.xor").exists()

    got = run_ranks(3, _ck_load, str(tmp_path), out=tmp_path / "load")
    for rank, x in enumerate(got):
        assert x["load"] == [1, True] and x["refilled"] is None and x["protected"] == 1, (rank, x)
    assert (pdir / "rank00002.xor").read_bytes() == saved
    assert not list(pdir.glob(".damaged-*"))
    assert (roots[0] / STEP / "protected").read_bytes() == marker
    assert not (roots[0] / STEP / "parity" / "refilling").exists()
    assert verify(capsys, roots)[0] == 0


# ----------------------------------------------------------------------------- a replaced primary root
def _marks(tmp: str) -> dict:
    """Per node: which of step 1's markers it holds (``protected``, ``copies/protected``,
    ``parity/refilling``) and whether its step directory exists."""
    return {k: [(Path(tmp, k, STEP) / n).exists() for n in ("", "protected", "copies/protected", "parity/refilling")]
            for k in ("node0", "node1", "node2")}


def _primary_replaced_stopped(rank: int, world: int, tmp: str) -> dict:
    from support.dcp import engine, load_with_parity_refill_stopped, refilled
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    _dcp_save(rank, world, tmp)
    # the primary root's node replaced (an empty directory), its refill stopped before its parity block
    out = load_with_parity_refill_stopped(root, 1, dcp_state_of(1), replaced=rank == 0)
    torch.distributed.barrier()
    out["after stop"] = _marks(tmp)
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out["next"] = [dcp_load(root, 1, dcp_state_of(1), reader)[:2], refilled(reader)]
    reader.close()
    torch.distributed.barrier()
    out["after next"] = _marks(tmp)
    return out


def test_a_parity_refill_onto_a_replaced_primary_root_claims_no_protection_while_it_runs(tmp_path):
    """parity_group=3 (DCP), the primary root's node (rank 0's) replaced; the refill stopped after
    rank 0's files landed, before its parity block: no root of the step says ``protected`` (the
    refill made the replaced root's step directory, wrote ``parity/refilling`` there and removed
    every ``protected`` claim first); the next load finishes the refill: ``protected`` back on the
    primary, the note gone."""
    got = run_ranks(3, _primary_replaced_stopped, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["first"] == [None, True], (rank, x)
        assert isinstance(x["stopped"], list) and x["stopped"][0] == "ReplicationError", (rank, x["stopped"])
        stop = x["after stop"]
        # [step directory, protected, copies/protected, parity/refilling]: the replaced root is noted, claims nothing
        assert stop["node0"] == [True, False, False, True], (rank, stop)
        assert not any(m[1] for m in stop.values()), (rank, stop)
        assert x["next"] == [[None, True], 1], (rank, x["next"])
        done = x["after next"]
        assert done["node0"] == [True, False, True, False], (rank, done)
        assert [m[1] for m in done.values()].count(True) == 1 and not any(m[3] for m in done.values()), (rank, done)
    primary = next(k for k, m in got[0]["after next"].items() if m[1])
    assert json.loads(Path(tmp_path, primary, STEP, "protected").read_bytes()) == PARITY


def test_a_gdscheckpointer_refill_does_not_run_while_a_repair_of_the_step_runs(tmp_path, capsys):
    """replicas=2 (GDSCheckpointer): rank 1's copy set aside by a first repair (the step noted),
    then rank 0's copy damaged and ``verify --repair`` run in another process, stopped after its
    scrub: a load meanwhile (bit-exact) refills nothing (wait_protected raises, naming the
    repair; no file changes). The repair then ends; the next load re-creates both copies, the
    step is protected and the scrub passes."""
    from test_dcp_repair import repair_held

    run_ranks(2, _ck_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "n0", tmp_path / "n1"]
    flip(next((roots[0] / STEP / "copies" / "rank00001").glob("data-rank1-*.bin")))
    assert verify(capsys, roots, "--repair")[0] == 3
    flip(next((roots[1] / STEP / "copies" / "rank00000").glob("data-rank0-*.bin")))
    before = tree(roots[0] / STEP), tree(roots[1] / STEP)
    with repair_held(tmp_path, roots) as repair:
        got = run_ranks(2, _ck_load, str(tmp_path), out=tmp_path / "load")
        for rank, x in enumerate(got):
            assert x["load"] == [1, True], (rank, x)
            assert isinstance(x["refilled"], list) and "verify --repair of this step is running" in x["refilled"][1], x
        assert (tree(roots[0] / STEP), tree(roots[1] / STEP)) == before  # the step's files: the root lock's pid changes
    assert repair["code"] == 3 and "rank00000: set aside as" in repair["said"], repair["said"]
    got = run_ranks(2, _ck_load, str(tmp_path), out=tmp_path / "load2")
    assert all(x["load"] == [1, True] and x["refilled"] is None and x["protected"] == 1 for x in got), got
    assert verify(capsys, roots)[0] == 0


def _ck_save_next(rank: int, world: int, tmp: str) -> int | None:
    """Step 2 saved and protected with keep_last=1: retention deletes step 1 on every root."""
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    from support.models import small_options

    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    with GDSCheckpointer(state_of(2), root=f"{tmp}/n{rank}", options=small_options(keep_last=1),
                         dist_options=DistOptions(timeout_s=60, replicas=2)) as ck:
        ck.save(2)
        got = ck.wait_protected(120)
        ck.wait()
    return got


def test_what_a_repair_set_aside_goes_with_its_step(tmp_path, capsys):
    """replicas=2: rank 1's copy set aside by --repair (kept: ``ls`` names it) and no load after;
    a newer step saved and protected with keep_last=1 deletes step 1 on both nodes, its
    ``.damaged-`` folder with it."""
    from gdswriter.cli import main

    run_ranks(2, _ck_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / "n0", tmp_path / "n1"]
    flip(next((roots[0] / STEP / "copies" / "rank00001").glob("data-rank1-*.bin")))
    assert verify(capsys, roots, "--repair")[0] == 3
    assert len(list((roots[0] / STEP / "copies").glob(".damaged-rank00001-*"))) == 1
    capsys.readouterr()
    main(["ls", "--json", str(roots[0])])
    assert len(json.loads(capsys.readouterr().out)[0]["damaged"]) == 1
    assert run_ranks(2, _ck_save_next, str(tmp_path), out=tmp_path / "next") == [2, 2]
    for root in roots:
        assert not (root / STEP).exists() and not list(root.glob("*/copies/.damaged-*")), sorted(root.rglob("*"))
    main(["ls", "--json", str(roots[0])])
    assert json.loads(capsys.readouterr().out)[0]["damaged"] == []
