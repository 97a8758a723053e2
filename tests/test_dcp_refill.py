"""The refill of a DCP step after a load from copies (issue 39 item 3 for the DCP plug-in;
distributed/dcp_refill.py): two real gloo ranks, each its own node, save with replicas=2; node 1
is replaced (its root emptied), a DCP load reads its files from their copies and re-creates them
(and rank 0's copy, the manifest's copy) on the new disk in the background; once refilled, the
OTHER node (rank 0's: the step's primary, its manifest and rank 1's copy) is replaced too, and
the step still loads bit-exact, from what the refill wrote. A refill killed midway (some own files
on the new root, no copies), a file damaged on a reached root, and a refill stopped after its
first move are all finished by the next load's refill, with the same outcome."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from support.dcp import dcp_load, dcp_state, engine, flip, refilled, save_two_steps
from support.ranks import caught, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = "step_000000000001"


def state(step: int) -> dict:
    return dcp_state(700, step)


def _replace(root: Path) -> None:
    """A replaced node: its root is an empty directory at the same path."""
    shutil.rmtree(root)
    root.mkdir()


def _saved_then_node1_replaced(rank: int, root: Path) -> None:
    """Steps 0 and 1 saved with replicas=2, then node 1 replaced (every rank past both)."""
    save_two_steps(rank, root, state, replicas=2)
    torch.distributed.barrier()
    if rank == 1:
        _replace(root)
    torch.distributed.barrier()


def _loaded_after_node0_replaced(rank: int, root: Path) -> tuple[list[str] | None, bool, list[str]]:
    """Node 0 replaced (every rank past it), then step 1 loaded: dcp_load's (error, bit-exact,
    warnings) on this rank."""
    torch.distributed.barrier()
    if rank == 0:
        _replace(root)
    torch.distributed.barrier()
    return dcp_load(root, 1, state(1))


def _worker(rank: int, world: int, tmp: str) -> dict:
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    out: dict = {"protected": save_two_steps(rank, root, state, replicas=2)}
    torch.distributed.barrier()
    if rank == 1:
        _replace(root)
    else:  # a crash mid-refill left a temporary folder: garbage under a copy's file name
        good = next((root / STEP / "copies" / "rank00001").iterdir())
        tmp_dir = root / STEP / "copies" / ".tmp-rank00001-deadbeef"
        tmp_dir.mkdir()
        (tmp_dir / good.name).write_bytes(b"\x55" * good.stat().st_size)
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out["first"] = dcp_load(root, 1, state(1), reader)
    out["refilled"] = refilled(reader)
    reader.close()
    out["files"] = sorted(str(p.relative_to(root / STEP)) for p in (root / STEP).rglob("*") if p.is_file()) \
        if (root / STEP).is_dir() else []
    torch.distributed.barrier()
    if rank == 0:
        _replace(root)
    else:  # a later refill killed midway on this (replacement) root: its folder, a marker's temporary, trash
        copies = root / STEP / "copies"
        good = next((copies / "rank00000").iterdir())
        (copies / ".tmp-rank00000-cafef00d").mkdir()
        (copies / ".tmp-rank00000-cafef00d" / good.name).write_bytes(b"\x55" * good.stat().st_size)
        (copies / ".tmp-protected-0badf00d").write_bytes(b"{")
        (copies / ".trash-.tmp-rank00000-feedf00d-1234").mkdir()
    torch.distributed.barrier()
    out["second"] = dcp_load(root, 1, state(1))
    out["copies"] = sorted(p.name for p in (root / STEP / "copies").iterdir()) if rank == 1 else []
    return out


def test_a_dcp_step_loaded_from_copies_is_refilled_and_survives_the_other_nodes_loss(tmp_path):
    """replicas=2, node 1 replaced: the load is bit-exact from the copies; wait_refilled names step
    1; a crash's temporary folder (garbage under a copy's file name) beside the copy on node 0 is
    removed by the load, the copy kept; node 1's new root holds rank 1's files, rank 0's copy,
    the manifest's copy and copies/protected; then node 0 replaced, with a killed refill's
    leftovers (.tmp- folder and file, .trash- folder) planted on node 1: the step loads bit-exact
    again on both ranks, and those leftovers are gone, the committed copies kept."""
    got = run_ranks(2, _worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["protected"] == [0, 1], (rank, x)
        err, exact, _ = x["first"]
        assert err is None and exact, (rank, x["first"])
        assert x["refilled"] == 1, (rank, x["refilled"])
    files = got[1]["files"]
    assert "copies/manifest.json" in files and "copies/protected" in files, files
    assert any(f.startswith("copies/rank00000/data-rank0") for f in files), files
    assert any(f.startswith("data-rank1") for f in files), files
    assert not [f for f in files if ".tmp-" in f], files
    assert not [f for f in got[0]["files"] if ".tmp-" in f], got[0]["files"]  # the crash's folder: removed
    assert any(f.startswith("copies/rank00001/") for f in got[0]["files"]), got[0]["files"]
    assert json.loads((tmp_path / "node1" / STEP / "copies" / "protected").read_bytes()) == {"copies": 2}
    for rank, x in enumerate(got):
        err, exact, _ = x["second"]
        assert err is None and exact, (rank, x["second"])
    assert got[1]["copies"] == ["manifest.json", "protected", "rank00000"], got[1]["copies"]


def _damaged_worker(rank: int, world: int, tmp: str) -> dict:
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    save_two_steps(rank, root, state, replicas=2)
    torch.distributed.barrier()
    if rank == 1:
        _replace(root)
    else:  # the copy the load (verify=False: it checks nothing) and the refill read, damaged
        flip(next((root / STEP / "copies" / "rank00001").iterdir()))
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, verify=False, engine_options=engine())
    out: dict = {"first": dcp_load(root, 1, state(1), reader)[0]}
    out["refill"] = caught(lambda: reader.wait_refilled(120))
    reader.close()
    out["files"] = sorted(str(p.relative_to(root / STEP)) for p in (root / STEP).rglob("*")) \
        if (root / STEP).is_dir() else []
    return out


def test_a_dcp_refill_publishes_no_file_that_fails_its_crc32c(tmp_path):
    """The copy of rank 1's files damaged (a byte flipped), loaded with verify=False (nothing
    checked): the refill checks every chunk as it streams, so wait_refilled raises
    ReplicationError naming the checksum on every rank, and node 1's new root holds none of
    rank 1's files (the temporary folder removed)."""
    got = run_ranks(2, _damaged_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["first"] is None, (rank, x)
        assert x["refill"] is not None and x["refill"][0] == "ReplicationError", (rank, x["refill"])
    assert "crc32c" in got[1]["refill"][1] or "checksum" in got[1]["refill"][1].lower(), got[1]["refill"]
    files = got[1]["files"]
    assert not [f for f in files if "data-rank1" in f or ".tmp-" in f], files


def _killed_worker(rank: int, world: int, tmp: str, killed: bool, flipped: bool) -> dict:
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    save_two_steps(rank, root, state, replicas=2, files_per_root=3)
    torch.distributed.barrier()
    step = root / STEP
    out: dict = {}
    own = sorted(step.glob("data-rank1-*"))
    out["own"] = [p.name for p in own]
    if rank == 1 and killed:  # node 1 replaced, its refill killed midway: one of rank 1's files landed, no copy
        for p in own[1:]:
            p.unlink()
        shutil.rmtree(step / "copies")
        (step / "copies").mkdir()
        (step / "copies" / ".tmp-rank00001-deadbeef").mkdir()
        (step / "copies" / ".tmp-rank00001-deadbeef" / own[1].name).write_bytes(b"\x55" * 4096)
    if rank == 1 and flipped:  # rank 1's first file damaged on the disk (a byte flipped)
        flip(own[0])
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out["first"] = dcp_load(root, 1, state(1), reader)
    out["refilled"] = refilled(reader)
    reader.close()
    out["files"] = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file())
    torch.distributed.barrier()
    if rank == 0:  # node 1's files as the copies on node 0 hold them
        out["same"] = all((Path(tmp, "node1", STEP, p.name)).read_bytes() == p.read_bytes()
                          for p in (step / "copies" / "rank00001").iterdir())
    # then the OTHER node (the step's primary, its manifest and rank 1's copy) is lost
    out["second"] = _loaded_after_node0_replaced(rank, root)
    return out


def _check_mended(tmp_path: Path, killed: bool, flipped: bool) -> None:
    got = run_ranks(2, _killed_worker, str(tmp_path), killed, flipped, out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        for load in ("first", "second"):  # the second: node 0 lost after the refill
            err, exact, _ = x[load]
            assert err is None and exact, (rank, load, x[load])
        assert x["refilled"] == 1, (rank, x["refilled"])
    own, files = got[1]["own"], got[1]["files"]
    assert len(own) == 3, own
    assert all(name in files for name in own), files
    assert got[0]["same"], "node 1's files differ from their copies on node 0"
    assert "copies/manifest.json" in files and "copies/protected" in files, files
    assert any(f.startswith("copies/rank00000/data-rank0") for f in files), files
    assert not [f for f in files if ".tmp-" in f or f.startswith("copies/rank00001")], files
    assert json.loads((tmp_path / "node1" / STEP / "copies" / "protected").read_bytes()) == {"copies": 2}


def test_a_dcp_refill_killed_midway_is_finished_by_the_next_load(tmp_path):
    """replicas=2, three files per root; node 1 replaced and its refill killed midway: one of
    rank 1's files landed, the others did not (a .tmp- folder left), nor its copy of rank 0's
    files. The next load reaches node 1's root (it holds the step's folder), reads the missing
    files from their copies bit-exact, and refills them and rank 0's copy (wait_refilled names
    step 1): node 1 holds every file again and copies/protected; then node 0 is lost too and
    the step still loads bit-exact on both ranks, from what this refill wrote."""
    _check_mended(tmp_path, killed=True, flipped=False)


def test_a_dcp_file_damaged_on_a_reached_root_is_refilled_from_its_copy(tmp_path):
    """As above, with a byte flipped in the one file of rank 1 the killed refill had written:
    the load finds it failing its crc32c, reads its copy, and the refill replaces it durably
    (after the load) with the good bytes: node 0's later loss is survived bit-exact."""
    _check_mended(tmp_path, killed=True, flipped=True)


def test_a_dcp_file_with_a_flipped_byte_on_a_reached_root_is_refilled(tmp_path):
    """No node lost: a byte flipped in one of rank 1's files on node 1. The load reads its copy
    on node 0 (bit-exact), the refill replaces the damaged file durably once the load is done
    (wait_refilled names step 1): node 1's files equal their copies again, and node 0's later
    loss is survived bit-exact."""
    _check_mended(tmp_path, killed=False, flipped=True)


def _stopped_worker(rank: int, world: int, tmp: str) -> dict:
    import gdswriter.distributed.dcp_refill as dcp_refill
    from gdswriter.distributed import GDSStorageReader
    from gdswriter.errors import GDSWriterError

    root = Path(tmp, f"node{rank}")
    _saved_then_node1_replaced(rank, root)
    real, calls = dcp_refill.move_files, []

    def first_move_only(*args, **kwargs):  # the refill killed once its first move is done (every rank)
        if calls:
            raise GDSWriterError("killed")
        calls.append(1)
        return real(*args, **kwargs)
    dcp_refill.move_files = first_move_only
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out: dict = {"first": dcp_load(root, 1, state(1), reader), "stopped": refilled(reader)}
    reader.close()
    dcp_refill.move_files = real
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out["again"] = dcp_load(root, 1, state(1), reader)
    out["refilled"] = refilled(reader)
    reader.close()
    out["second"] = _loaded_after_node0_replaced(rank, root)
    return out


def test_a_dcp_refill_stopped_after_its_first_move_is_finished_by_the_next_load(tmp_path):
    """replicas=2, node 1 replaced; its refill stops after its first move (every rank's
    move_files raises from its second call: as a kill there leaves it). The copies move first,
    so node 1 lacks some of its own files: the next load reads them from their copies and
    refills (wait_refilled names step 1), and node 0's later loss is survived bit-exact (with
    the own files first, the stopped refill left every own file and no copy of rank 0's: the
    next load found nothing to refill)."""
    got = run_ranks(2, _stopped_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        for load in ("first", "again", "second"):
            err, exact, _ = x[load]
            assert err is None and exact, (rank, load, x[load])
        assert x["stopped"] is not None and x["stopped"][0] == "ReplicationError", (rank, x["stopped"])
        assert x["refilled"] == 1, (rank, x["refilled"])


def _two_readers_worker(rank: int, world: int, tmp: str) -> dict:
    import threading

    import gdswriter.distributed.refill as refill
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    _saved_then_node1_replaced(rank, root)
    real, entered, go = refill.Incoming, threading.Event(), threading.Event()

    class Paused(real):  # type: ignore[misc,valid-type]
        """The first refill's first arrival paused once its .tmp- folder is made (a slow refill)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not entered.is_set():
                entered.set()
                go.wait(60)
    refill.Incoming = Paused
    copies = root / STEP / "copies"
    first = GDSStorageReader(root, 1, engine_options=engine())
    out: dict = {"first": dcp_load(root, 1, state(1), first)}
    if rank == 1:
        out["paused"] = entered.wait(60)
        out["tmp"] = sorted(p.name for p in copies.iterdir() if p.name.startswith(".tmp-"))
    refill.Incoming = real
    torch.distributed.barrier()
    second = GDSStorageReader(root, 1, engine_options=engine())  # a second reader loads the step meanwhile
    out["second"] = dcp_load(root, 1, state(1), second)
    if rank == 1:
        out["kept"] = [name for name in out["tmp"] if (copies / name).exists()]
    go.set()
    out["refilled"] = refilled(first)
    first.close()
    out["again"] = refilled(second)
    second.close()
    out["last"] = _loaded_after_node0_replaced(rank, root)
    return out


def test_a_second_readers_load_leaves_a_running_refills_temporaries_alone(tmp_path):
    """replicas=2, node 1 replaced; a first reader's load starts a refill, paused once its first
    .tmp- folder is made on node 1 (a slow refill still running); a second reader then loads the
    step (its load removes crash leftovers in copies/): the running refill's .tmp- folder is kept
    (it holds a lock there: dcp_leftovers.RefillLocks), so the first refill ends well
    (wait_refilled names step 1) and the step survives node 0's loss afterwards, bit-exact."""
    got = run_ranks(2, _two_readers_worker, str(tmp_path), out=tmp_path / "ranks")
    assert got[1]["paused"] and got[1]["tmp"], got[1]
    assert got[1]["kept"] == got[1]["tmp"], got[1]
    for rank, x in enumerate(got):
        for load in ("first", "second", "last"):
            err, exact, _ = x[load]
            assert err is None and exact, (rank, load, x[load])
        assert x["refilled"] == 1, (rank, x["refilled"])
        assert x["again"] == 1, (rank, x["again"])  # the second reader refilled too (the same files)


def _both_roots_worker(rank: int, world: int, tmp: str, bad_copy: bool) -> dict:
    from gdswriter.distributed import GDSStorageReader

    root = Path(tmp, f"node{rank}")
    save_two_steps(rank, root, state, replicas=2)
    torch.distributed.barrier()
    damaged = sorted((Path(tmp, "node1") / STEP).glob("data-rank1-*"))[0]
    copy = Path(tmp, "node0", STEP, "copies", "rank00001", damaged.name)
    torch.distributed.barrier()  # both ranks named the file before it changes
    if rank == 1 and not bad_copy:  # a byte flipped in rank 1's file on node 1
        flip(damaged)
    if rank == 1 and bad_copy:  # the file gone from node 1, its copy damaged (read unchecked: verify=False)
        damaged.unlink()
        flip(copy)
    torch.distributed.barrier()
    roots = [Path(tmp, "node0"), Path(tmp, "node1")] if rank == 0 else [root]  # rank 0 sees both disks
    reader = GDSStorageReader(roots, 1, verify=not bad_copy, engine_options=engine())
    out: dict = {"first": dcp_load(roots, 1, state(1), reader), "refilled": refilled(reader)}
    reader.close()
    torch.distributed.barrier()
    if rank == 0:
        out["same"] = all((damaged.parent / p.name).read_bytes() == p.read_bytes()
                          for p in copy.parent.iterdir() if p != copy or not bad_copy)
        out["there"] = damaged.exists()
        out["tmp"] = [str(p) for p in Path(tmp).rglob(".tmp-*")]
    return out


def test_a_rank_seeing_both_the_damaged_root_and_its_copys_root_refills_it(tmp_path):
    """replicas=2; a byte flipped in one of rank 1's files on node 1; at the load rank 0 sees both
    disks (node 0's, with rank 1's copy, and node 1's): it looks at both, so it both reads the
    copy and writes the refilled file. The load is bit-exact, the refill (a local move, every
    chunk checked against its crc32c, as the streamed one) names step 1, and node 1's files equal
    their copies again, no temporary left."""
    got = run_ranks(2, _both_roots_worker, str(tmp_path), False, out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        err, exact, _ = x["first"]
        assert err is None and exact, (rank, x["first"])
        assert x["refilled"] == 1, (rank, x["refilled"])
    assert got[0]["same"], "node 1's files differ from their copies on node 0"
    assert got[0]["tmp"] == [], got[0]["tmp"]


def test_a_local_refill_move_publishes_no_file_that_fails_its_crc32c(tmp_path):
    """As above, with rank 1's file missing on node 1 and its copy on node 0 damaged, loaded with
    verify=False (nothing checked): the local move checks every chunk as it reads, so
    wait_refilled raises ReplicationError naming the checksum, and node 1 gets no such file nor
    any temporary."""
    got = run_ranks(2, _both_roots_worker, str(tmp_path), True, out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["first"][0] is None, (rank, x["first"])
        assert isinstance(x["refilled"], list) and x["refilled"][0] == "ReplicationError", (rank, x["refilled"])
    assert "crc32c" in got[0]["refilled"][1] or "checksum" in got[0]["refilled"][1].lower(), got[0]["refilled"]
    assert not got[0]["there"] and got[0]["tmp"] == [], got[0]
