"""Copies of DCP steps on peer nodes (issue 39 item 6; distributed/dcp_replicas.py): two real gloo
ranks, each its own node (its own node-local root, its own GDSWRITER_HOSTNAME), save through
GDSStorageWriter(dist_options=DistOptions(replicas=2)) with dcp.save and dcp.async_save. Every
step becomes protected in the background, its copies byte-identical; GDSStorageReader then loads
bit-exact after a node is replaced (its root emptied) or a byte of a file is flipped, from the
verified copy, saying so; and raises a typed error on every rank when no good copy is left."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gdswriter.cli import main as cli_main
from gdswriter.distributed import GDSStorageReader
from support.dcp import dcp_load, dcp_state, engine, flip, node_writer, refilled, save_two_steps
from support.ranks import caught, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = "step_000000000001"


def state(step: int) -> dict:
    """Two 4 MiB tensors (above the small-copy thresholds), the same on every rank (split)."""
    return dcp_state(900, step)


def _save(rank: int, root: Path) -> list:
    return save_two_steps(rank, root, state, replicas=2)


def _load(root: Path, step: int) -> tuple[list[str] | None, bool, list[str]]:
    """(error, bit-exact, warnings) of a DCP load of ``step`` on this rank."""
    return dcp_load(root, step, state(step))


def _protected_worker(rank: int, world: int, tmp: str) -> dict:
    root = Path(tmp, f"node{rank}")
    out: dict = {"protected": _save(rank, root)}
    torch.distributed.barrier()
    before = _rchar()
    out["intact"] = _load(root, 1)
    out["read"] = _rchar() - before
    out["own"] = sum(p.stat().st_size for p in (root / STEP).glob("*.bin"))
    return out


def _rchar() -> int:
    """The bytes this process read through read(2) and its kin so far (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_dcp_save_with_two_replicas_becomes_protected(tmp_path, capsys):
    """After dcp.save and dcp.async_save with replicas=2, wait_protected names each step; each
    rank's data files lie byte-identical in copies/rank<R> on the other node's root, the
    committed manifest's copy beside rank 0's, ``protected`` on rank 0's step; `gdswriter ls`
    shows both steps protected; the step loads bit-exact (no warning: the own files are good),
    reading the step's data once (rchar: not every file and every copy checked before the fetch)."""
    got = run_ranks(2, _protected_worker, str(tmp_path), out=tmp_path / "ranks")
    # the load reads each data file once, as the fetch checks it (not every file and copy first)
    assert sum(x["read"] for x in got) < 1.5 * sum(x["own"] for x in got), got
    for rank, x in enumerate(got):
        assert x["protected"] == [0, 1], (rank, x)
        err, exact, lines = x["intact"]
        assert err is None and exact and not [li for li in lines if "copy" in li], (rank, x["intact"])
    for step in ("step_000000000000", STEP):
        n0, n1 = tmp_path / "node0" / step, tmp_path / "node1" / step
        assert json.loads((n0 / "protected").read_bytes()) == {"copies": 2}
        assert (n1 / "copies" / "manifest.json").read_bytes() == (n0 / "manifest.json").read_bytes()
        for own, other, r in ((n0, n1, 0), (n1, n0, 1)):
            mine = sorted(p.name for p in own.iterdir() if p.suffix == ".bin")
            copy = other / "copies" / f"rank{r:05d}"
            assert mine and sorted(p.name for p in copy.iterdir()) == mine, (r, mine)
            assert all((copy / n).read_bytes() == (own / n).read_bytes() for n in mine)
    capsys.readouterr()
    assert cli_main(["ls", str(tmp_path / "node0")]) == 0
    listed = capsys.readouterr().out
    assert listed.count("protected (2 copies)") == 2, listed


def _fallback_worker(rank: int, world: int, tmp: str) -> dict:
    root = Path(tmp, f"node{rank}")
    out: dict = {"protected": _save(rank, root)}
    torch.distributed.barrier()
    if rank == 0:  # a byte flipped in a data file of rank 0's own root (its copy on node1 is good)
        flip(sorted((root / STEP).glob("*.bin"))[0])
    torch.distributed.barrier()
    out["flipped"] = _load(root, 1)
    torch.distributed.barrier()
    if rank == 0:  # mended: step 1's file back from its copy
        for p in (Path(tmp, "node1", STEP, "copies", "rank00000")).iterdir():
            shutil.copyfile(p, root / STEP / p.name)
    if rank == 1:  # rank 1's node replaced: its root is an empty directory
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out["replaced"] = dcp_load(root, 1, state(1), reader)
    out["refilled"] = refilled(reader)  # rank 1's files re-created on its new root (dcp_refill.py)
    torch.distributed.barrier()
    if rank == 0:  # and now the copy of rank 1's files of step 1 damaged too
        flip(sorted((root / STEP / "copies" / "rank00001").iterdir())[0])
        shutil.rmtree(root / "step_000000000000" / "copies" / "rank00001")  # step 0's copy gone
    else:  # as the files the refill re-created: no good place left
        flip(sorted((root / STEP).glob("data-rank1-*"))[0])
    torch.distributed.barrier()
    out["damaged"] = _load(root, 1)
    out["gone"] = _load(root, 0)
    return out


def test_a_dcp_load_reads_a_lost_or_damaged_file_from_its_verified_copy(tmp_path):
    """A flipped byte in rank 0's own file: the step loads bit-exact from its copy on node1 and
    the warning names the damaged file; rank 1's root emptied (a replaced node): bit-exact from
    the copies on node0, saying so (and refilled); that copy and the refilled files damaged too: CorruptCheckpointError on every rank,
    nothing loaded wrong; step 0 with its copy removed: StepFilesLostError on every rank."""
    got = run_ranks(2, _fallback_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["protected"] == [0, 1], (rank, x)
        err, exact, lines = x["flipped"]
        assert err is None and exact, (rank, x["flipped"])
        if rank == 0:
            assert any("damaged" in li and "copies/rank00000" in li for li in lines), lines
        err, exact, lines = x["replaced"]
        assert err is None and exact, (rank, x["replaced"])
        if rank == 0:
            assert any("replaced node" in li and "copies/rank00001" in li for li in lines), lines
        assert x["refilled"] == 1, (rank, x["refilled"])
        err, exact, _ = x["damaged"]
        assert err is not None and err[0] == "CorruptCheckpointError" and "no good place" in err[1], (rank, err)
        err, exact, _ = x["gone"]
        assert err is not None and err[0] == "StepFilesLostError", (rank, err)


def _failed_save_worker(rank: int, world: int, tmp: str) -> dict:
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import gdswriter.distributed.dcp_writer as dcp_mod
    from gdswriter.errors import ReplicationError

    w = node_writer(rank, Path(tmp, f"node{rank}"), replicas=2, timeout_s=5.0)
    w.reset(0)
    dcp.save(state(0), storage_writer=w)
    out: dict = {"first": w.wait_protected(), "failed": False, "errors": []}
    real = dcp_mod.write_files
    if rank == 1:  # step 1's save fails on rank 1 (its disk is full): DCP calls no finish on rank 0
        dcp_mod.write_files = lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    w.reset(1)
    try:
        dcp.save(state(1), storage_writer=w)
    except CheckpointException:
        out["failed"] = True
    finally:
        dcp_mod.write_files = real
    time.sleep(12)  # the next save comes later than timeout_s
    w.reset(2)
    dcp.save(state(2), storage_writer=w)
    for _ in range(3):
        try:
            out["last"] = w.wait_protected()
            break
        except ReplicationError as e:
            out["errors"].append(str(e))
    w.close()
    return out


def test_a_dcp_save_failing_on_one_rank_does_not_stop_the_replication(tmp_path):
    """Step 1's save fails on rank 1 and the next save comes after timeout_s: the replication
    of step 1 ends at once on every rank (each says whether it wrote its part), not when rank
    0's next save settles its word (past the channel's timeout, which broke the channel and
    left every later step unprotected); step 2 is protected."""
    got = run_ranks(2, _failed_save_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["first"] == 0 and x["failed"], (rank, x)
        assert x.get("last") == 2, (rank, x)
        assert not [e for e in x["errors"] if "replication stops" in e or "stopped" in e], (rank, x)
    assert json.loads((tmp_path / "node0" / "step_000000000002" / "protected").read_bytes()) == {"copies": 2}


def _rank0_lost_worker(rank: int, world: int, tmp: str) -> dict:

    from gdswriter.distributed import GDSStorageReader, dcp_errors

    root = Path(tmp, f"node{rank}")
    out: dict = {"protected": _save(rank, root)}
    torch.distributed.barrier()
    if rank == 0:  # rank 0's node replaced: its root (the step's manifests) is an empty directory
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()

    def metadata() -> None:
        with dcp_errors():
            out["items"] = sorted(GDSStorageReader(root, 1).read_metadata().state_dict_metadata)
    out["metadata"] = caught(metadata)
    torch.distributed.barrier()
    reader = GDSStorageReader(root, 1, engine_options=engine())
    out["replaced"] = dcp_load(root, 1, state(1), reader)
    out["refilled"] = refilled(reader)  # rank 0's files, rank 1's copy, the manifest's copy on node0
    reader.close()
    torch.distributed.barrier()
    if rank == 1:  # then node 1 (the adopted primary) replaced too: the step loads from what the refill wrote
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()
    out["second"] = _load(root, 1)
    return out


def test_a_dcp_load_after_rank_0s_node_is_replaced_uses_the_manifests_copy(tmp_path):
    """Rank 0's root (the committed manifest, its data files) emptied after a protected save:
    read_metadata and dcp.load of step 1 take the verified copy of the manifest on the node
    holding rank 0's copies (which becomes the primary, as GDSCheckpointer's load adopts it) and
    load bit-exact from the copies, saying so; the load refills node 0's new root (rank 0's files,
    rank 1's copy, the manifest's copy), so once node 1 is replaced too the step loads bit-exact
    again (node 0 adopting the manifest's copy in its turn)."""
    got = run_ranks(2, _rank0_lost_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["protected"] == [0, 1], (rank, x)
        assert x["metadata"] is None and x["items"] == ["a", "b"], (rank, x)
        err, exact, lines = x["replaced"]
        assert err is None and exact, (rank, x["replaced"])
        assert any("copies/rank00000" in li for li in lines), (rank, lines)
        assert x["refilled"] == 1, (rank, x["refilled"])
        err, exact, _ = x["second"]
        assert err is None and exact, (rank, x["second"])
    assert (tmp_path / "node0" / STEP / "manifest.json").read_bytes() == (
        tmp_path / "node0" / STEP / "copies" / "manifest.json").read_bytes()


def _placing_worker(rank: int, world: int, tmp: str) -> dict:
    """A step saved without copies on W node-local roots, an empty copies/ directory added on
    each (so place_files takes its copies path), then what place_files moved on this rank."""
    import torch.distributed.checkpoint as dcp

    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageWriter
    from gdswriter.distributed.dcp_replicas import place_files
    from gdswriter.distributed.group import Coordinator
    from gdswriter.format.sharded import parse_step

    root = Path(tmp, f"node{rank}")
    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    w = GDSStorageWriter(root, options=CheckpointOptions(engine=engine()))
    w.reset(1)
    dcp.save(state(1), storage_writer=w)
    w.close()
    (root / STEP / "copies").mkdir()
    torch.distributed.barrier()
    m = parse_step(Path(tmp, "node0", STEP, "manifest.json").read_bytes(), "manifest.json")
    reach = [root if rank in info.ranks else None for info in m.dist.roots]
    coord = Coordinator.for_group(None, timeout_s=120.0)
    before = coord.stats.snapshot()
    placed = place_files(coord, m, reach, "test")
    after = coord.stats.snapshot()
    return {"sent": after[0] - before[0], "received": after[1] - before[1], "same": placed.m == m}


def test_placing_a_dcp_steps_files_moves_the_same_bytes_per_rank_at_any_world_size(tmp_path):
    """place_files with every file in place: rank 1 sends and receives the same bytes with 2
    ranks and with 4 (two fixed-size rounds through rank 0, no all_gather of every rank's
    roots, which grew with the world), and the manifest is left as it is."""
    got = {w: run_ranks(w, _placing_worker, str(tmp_path / f"w{w}"), out=tmp_path / f"r{w}") for w in (2, 4)}
    assert all(x["same"] for xs in got.values() for x in xs), got
    assert got[4][1]["received"] == got[2][1]["received"] and got[4][1]["sent"] == got[2][1]["sent"], got


def _slow_commit_worker(rank: int, world: int, tmp: str) -> dict:
    import time

    import torch.distributed.checkpoint as dcp

    import gdswriter.distributed.dcp_writer as dcp_mod
    from gdswriter.errors import ReplicationError

    w = node_writer(rank, Path(tmp, f"node{rank}"), replicas=2, timeout_s=3.0)
    real = dcp_mod.read_regular_file

    def slow(*a, **k):  # rank 0's finish reads the committed manifest late: past timeout_s
        time.sleep(9)
        return real(*a, **k)
    out: dict = {"protected": [], "errors": []}
    for step in range(2):
        if rank == 0 and step == 0:
            dcp_mod.read_regular_file = slow
        w.reset(step)
        try:
            dcp.save(state(step), storage_writer=w)
        finally:
            dcp_mod.read_regular_file = real
        try:
            out["protected"].append(w.wait_protected())
        except ReplicationError as e:
            out["errors"].append(str(e))
    w.close()
    return out


def test_a_slow_dcp_commit_does_not_break_the_replication(tmp_path):
    """Rank 0's finish takes longer than timeout_s between every rank's write and its word on
    the commit: rank 0 tells the others it still waits (every timeout_s / 4), so their wait
    never times out the replication channel; both steps are protected."""
    got = run_ranks(2, _slow_commit_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["protected"] == [0, 1] and not x["errors"], (rank, x)


def _dropped_writer_worker(rank: int, world: int, tmp: str) -> dict:
    import gc

    import torch.distributed.checkpoint as dcp

    root = Path(tmp, f"node{rank}")
    w = node_writer(rank, root, replicas=2, timeout_s=20.0)
    w.reset(0)
    dcp.save(state(0), storage_writer=w)
    out: dict = {"first": w.wait_protected()}
    kept = None
    if rank == 0:  # dropped unclosed, in a reference cycle: collected here, on this rank only
        w.cycle = w
        del w
        gc.collect()
    else:
        kept = w
    torch.distributed.barrier()
    w2 = node_writer(rank, root, replicas=2, timeout_s=20.0)
    w2.reset(1)
    out["second"] = caught(lambda: dcp.save(state(1), storage_writer=w2)) or caught(
        lambda: out.__setitem__("protected", w2.wait_protected()))
    w2.close()
    if kept is not None:
        kept.close()
    return out


def test_a_writer_collected_unclosed_on_one_rank_keeps_the_next_writers_channels_matched(tmp_path):
    """A GDSStorageWriter with replicas dropped without close() in a reference cycle is collected
    at another moment on each rank; were its replication channel given back to the pool then,
    the next writer's channel would be the pooled group on that rank and a new one on the other,
    and its replication would time out. The collection releases locks and engines only: the
    next writer's step becomes protected on both ranks."""
    got = run_ranks(2, _dropped_writer_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["first"] == 0 and x["second"] is None and x.get("protected") == 1, (rank, x)
