"""Parity for DCP steps (issue 39 items 5 and 6; GDSStorageWriter with DistOptions(parity_group=G),
dcp_replicas.py over parity.py and parityload.py): three real gloo ranks, each its own node (its
own node-local root, its own GDSWRITER_HOSTNAME), one lane of 3. Each step is protected by one
XOR parity block per member (3/2 the bytes on the drives); a node replaced (its root emptied)
or a damaged data file is rebuilt from the rest of the lane, checked against its crc32c, and
loads bit-exact, saying so; two members of the lane lost is a typed error on every rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from support.dcp import dcp_load, dcp_state, flip, save_two_steps
from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = "step_000000000001"


def state(step: int) -> dict:
    return dcp_state(300, step)


def _save(rank: int, root: Path) -> list:
    return save_two_steps(rank, root, state, parity_group=3)


def _loaded_after_node2_replaced(rank: int, root: Path) -> tuple[list[str] | None, bool, list[str]]:
    """Rank 2's node replaced (its root an empty directory; every rank past it), then step 1
    loaded: dcp_load's (error, bit-exact, warnings) on this rank."""
    if rank == 2:
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()
    return dcp_load(root, 1, state(1))


def _worker(rank: int, world: int, tmp: str) -> dict:
    root = Path(tmp, f"node{rank}")
    out: dict = {"protected": _save(rank, root)}
    step = root / STEP
    out["marker"] = json.loads((step / "protected").read_bytes()) if rank == 0 else None
    out["own"] = sum(p.stat().st_size for p in step.glob("*.bin"))
    out["parity"] = sum(p.stat().st_size for p in (step / "parity").glob("*.xor"))
    torch.distributed.barrier()
    out["intact"] = dcp_load(root, 1, state(1))
    torch.distributed.barrier()
    damaged = sorted(step.glob("*.bin"))[0]
    kept = damaged.read_bytes()
    if rank == 2:  # a byte flipped in one of rank 2's data files of step 1
        flip(damaged)
    torch.distributed.barrier()
    out["flipped"] = dcp_load(root, 1, state(1))
    out["rebuilt"] = sorted(p.name for p in step.glob("copies/rank*"))
    torch.distributed.barrier()
    if rank == 2:  # mended again
        damaged.write_bytes(kept)
    shutil.rmtree(step / "copies" / "rank00002", ignore_errors=True)  # the rebuilt copy put away
    if rank == 1:  # rank 1's node replaced: its root is an empty directory
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()
    out["replaced"] = dcp_load(root, 1, state(1))
    torch.distributed.barrier()
    if rank == 2:  # and now rank 2's node too, for step 0 (rank 1's files of step 0 are gone already)
        shutil.rmtree(root / "step_000000000000")
    torch.distributed.barrier()
    out["two"] = dcp_load(root, 0, state(0))
    return out


def test_dcp_parity_protects_at_3_over_2_and_rebuilds_a_lost_or_damaged_member(tmp_path):
    """parity_group=3 on 3 nodes: steps 0 and 1 protected (``protected`` says the group), each
    member's parity block half its data (bytes on the drives 1.5x); an intact load reads no
    rebuild; a flipped byte in rank 2's file: rebuilt from ranks 0 and 1 and loaded bit-exact;
    rank 1's root emptied: rebuilt from ranks 0 and 2, bit-exact on every rank, saying so;
    ranks 1 and 2 of step 0 both lost: CorruptCheckpointError on every rank, never a wrong load."""
    got = run_ranks(3, _worker, str(tmp_path), out=tmp_path / "ranks")
    own, parity = sum(x["own"] for x in got), sum(x["parity"] for x in got)
    assert 1.45 < (own + parity) / own < 1.55, (own, parity)
    assert got[0]["marker"] == {"copies": 1, "parity_group": 3}, got[0]["marker"]
    for rank, x in enumerate(got):
        assert x["protected"] == [0, 1], (rank, x)
        err, exact, lines = x["intact"]
        assert err is None and exact and not [li for li in lines if "rebuilt" in li], (rank, x["intact"])
        for case in ("flipped", "replaced"):
            err, exact, lines = x[case]
            assert err is None and exact, (rank, case, x[case])
        err, exact, _ = x["two"]
        assert err is not None and err[0] == "CorruptCheckpointError" and "cannot rebuild" in err[1], (rank, err)
    said = [li for x in got for li in x["replaced"][2] if "rebuilt rank 1's files" in li]
    assert said, [x["replaced"][2] for x in got]
    said = [li for x in got for li in x["flipped"][2] if "rebuilt rank 2's files" in li]
    assert said, [x["flipped"][2] for x in got]
    assert [x["rebuilt"] for x in got].count(["rank00002"]) == 1, got  # one copy, on a surviving member's root


def _refill_worker(rank: int, world: int, tmp: str) -> dict:
    from support.dcp import engine, refilled
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    _save(rank, root)
    torch.distributed.barrier()
    if rank == 1:  # rank 1's node replaced: its root is an empty directory
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out: dict = {"first": dcp_load(root, 1, state(1), reader)[:2]}
    out["refilled"] = refilled(reader)
    reader.close()
    out["files"] = sorted(str(p.relative_to(root / STEP)) for p in (root / STEP).rglob("*") if p.is_file())
    torch.distributed.barrier()
    # before the next load's refill (left running in the background) unprotects the step while it runs
    out["protected"] = json.loads(Path(tmp, "node0", STEP, "protected").read_bytes())
    torch.distributed.barrier()
    # then rank 2's node too: a second member of the lane, survived thanks to the refill
    out["second"] = _loaded_after_node2_replaced(rank, root)
    return out


def test_a_dcp_step_rebuilt_from_parity_is_refilled_and_survives_a_second_members_loss(tmp_path):
    """parity_group=3, rank 1's node replaced: the load rebuilds rank 1's files from the lane and
    loads bit-exact; wait_refilled names step 1: node 1's new root holds rank 1's data files
    again (every chunk checked against the manifest's crc32c as it streamed) and its parity block
    and description, re-created from ranks 0 and 2; the rebuilt copy is gone from every root;
    ``protected`` says the group; then rank 2's node replaced too: the step still loads bit-exact
    on every rank (rebuilt from ranks 0 and 1, which a lane missing rank 1's block could not)."""
    got = run_ranks(3, _refill_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        err, exact = x["first"]
        assert err is None and exact, (rank, x["first"])
        assert x["refilled"] == 1, (rank, x["refilled"])
        assert not [f for f in x["files"] if f.startswith("copies/rank00001/")], (rank, x["files"])
    files = got[1]["files"]
    assert any(f.startswith("data-rank1") for f in files), files
    assert "parity/rank00001.xor" in files and "parity/rank00001.json" in files, files
    assert got[0]["protected"] == {"copies": 1, "parity_group": 3}, got[0]["protected"]
    for rank, x in enumerate(got):
        err, exact, _ = x["second"]
        assert err is None and exact, (rank, x["second"])


def _stopped_worker(rank: int, world: int, tmp: str) -> dict:
    from support.dcp import engine, load_with_parity_refill_stopped, refilled
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    _save(rank, root)
    # rank 1's node replaced, its refill stopped once rank 1's files landed, before its parity block
    out = load_with_parity_refill_stopped(root, 1, state(1), replaced=rank == 1)
    marks = Path(tmp, "node0", STEP)
    block = Path(tmp, "node1", STEP, "parity", "rank00001.xor")
    out["after stop"] = [(marks / "protected").exists(), (marks / "parity" / "refilling").exists(), block.exists()]
    out["rebuilt"] = sorted(str(p.relative_to(tmp)) for p in Path(tmp).glob("node*/step_*/copies/rank*"))
    torch.distributed.barrier()
    loads = []
    for case in ("refilling", "protected", "intact"):
        if rank == 1 and case == "protected":  # the block lost again while the step says it is protected
            block.unlink(missing_ok=True)
        torch.distributed.barrier()
        reader = GDSStorageReader(root, 1, engine_options=engine())
        loads.append([case, dcp_load(root, 1, state(1), reader)[:2], refilled(reader)])
        reader.close()
        torch.distributed.barrier()
        said = json.loads((marks / "protected").read_bytes()) if (marks / "protected").exists() else None
        loads[-1].append([said, (marks / "parity" / "refilling").exists(), block.exists(),
                          sorted(str(p.relative_to(tmp)) for p in Path(tmp).glob("node*/step_*/copies/rank*"))])
        torch.distributed.barrier()
    out["loads"] = loads
    # then rank 2's node too: a second member of the lane, survived thanks to rank 1's block
    out["second"] = _loaded_after_node2_replaced(rank, root)
    return out


def test_a_dcp_parity_block_missing_on_a_reached_root_is_re_created(tmp_path):
    """parity_group=3, rank 1's node replaced; the refill is stopped once rank 1's files landed,
    before its parity block is re-created: the step is then not ``protected`` (the marker is
    removed when the refill starts; ``parity/refilling`` keeps its group). The next load finds
    the files whole but the block missing on a reached root and re-creates it (wait_refilled
    names step 1), ``protected`` rewritten last, the note gone; the block removed again while the
    step says it is protected: found and re-created alike; an intact load refills nothing; then
    rank 2's node replaced: the step loads bit-exact (rebuilt with rank 1's block)."""
    got = run_ranks(3, _stopped_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        err, exact = x["first"]
        assert err is None and exact, (rank, x["first"])
        assert isinstance(x["stopped"], list) and x["stopped"][0] == "ReplicationError", (rank, x["stopped"])
        assert x["after stop"] == [False, True, False], (rank, x["after stop"])
        assert x["rebuilt"], (rank, x["rebuilt"])  # the stopped refill left the rebuilt copy
        for case, (err, exact), done, marks in x["loads"]:
            assert err is None and exact, (rank, case, err)
            assert done == (None if case == "intact" else 1), (rank, case, done)
            assert marks == [{"copies": 1, "parity_group": 3}, False, True, []], (rank, case, marks)  # no copy left
        err, exact, _ = x["second"]
        assert err is None and exact, (rank, x["second"])
