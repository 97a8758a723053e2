"""Megatron-Core's dist_checkpointing with gdswriter's strategies (gdswriter.integrations.megatron):
Megatron's own ShardedTensor/ShardedObject and save/load on real gloo ranks, tensor- and
data-parallel shardings, a reshard on load, and SIGKILLs during and between saves."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from tests.support.ranks import run_ranks
from tests.support.megatron_run import ForkedCaller, KillAfterFirstFile  # noqa: E402

pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core is not installed: pip install "
                    "--no-deps megatron-core==0.16.1 (.ci/run does)")

ROWS, COLS = 1024, 1024  # 4 MiB of float32 per global tensor, 2 MiB per shard at TP=2


def _global(key: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{step}".encode()))
    shape = {"w_col": (ROWS, COLS), "w_row": (ROWS // 2, 2 * COLS), "emb": (ROWS, COLS), "exp_avg": (ROWS, COLS)}[key]
    return torch.randn(shape, generator=g)


def _sharded_sd(rank: int, world: int, tp: int, step: int, objects: bool = True) -> dict:
    """A Megatron-style sharded state dict of this rank at TP=tp, DP=world//tp: columns and rows
    split over TP (replicated over DP), an embedding replicated everywhere, and an optimizer
    state split over TP (dim 0) and DP (dim 1), plus this rank's RNG-like ShardedObject."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    dp = world // tp
    t, d = rank % tp, rank // tp
    col = _global("w_col", step).chunk(tp, 0)[t].clone()
    row = _global("w_row", step).chunk(tp, 1)[t].clone()
    opt = _global("exp_avg", step).chunk(tp, 0)[t].chunk(dp, 1)[d].clone()
    sd = {
        "model": {
            "w_col": ShardedTensor.from_rank_offsets("w_col", col, (0, t, tp), replica_id=(0, 0, d)),
            "w_row": ShardedTensor.from_rank_offsets("w_row", row, (1, t, tp), replica_id=(0, 0, d)),
            "emb": ShardedTensor.from_rank_offsets("emb", _global("emb", step).clone(), replica_id=(0, t, d)),
        },
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets("exp_avg", opt, (0, t, tp), (1, d, dp))},
        "iteration": step,
    }
    if objects:
        sd["rng"] = ShardedObject("rng", {"seed": 1234 + rank, "state": torch.arange(rank, rank + 5),
                                          "name": f"rank{rank}"}, (world,), (rank,), replica_id=0)
    return sd


def _expected(rank: int, world: int, tp: int, step: int) -> dict:
    sd = _sharded_sd(rank, world, tp, step, objects=False)
    return {k: v.data for k, v in {**sd["model"], **sd["optimizer"]}.items()}


def _zeroed(sd: dict) -> dict:
    for group in ("model", "optimizer"):
        for sh in sd[group].values():
            sh.data = torch.zeros_like(sh.data)
    if "rng" in sd:
        sd["rng"].data = None
    return sd


def _check(loaded: dict, rank: int, world: int, tp: int, step: int, objects: bool) -> list[str]:
    want = _expected(rank, world, tp, step)
    got = {**loaded["model"], **loaded["optimizer"]}
    bad = [k for k, v in want.items() if not torch.equal(got[k], v)]
    if loaded["iteration"] != step:
        bad.append(f"iteration {loaded['iteration']}")
    if objects:
        rng = loaded["rng"]
        if rng["seed"] != 1234 + rank or rng["name"] != f"rank{rank}" or not torch.equal(
                rng["state"], torch.arange(rank, rank + 5)):
            bad.append(f"rng {rng}")
    return bad


def _save_load(rank: int, world: int, folder: str, tp_save: int, tp_load: int, use_async: bool) -> list[str]:
    from megatron.core import dist_checkpointing

    from gdswriter.integrations.megatron import GDSLoadShardedStrategy, GDSSaveShardedStrategy

    strategy = GDSSaveShardedStrategy()
    bad = []
    for step in (1, 2):
        ckpt = os.path.join(folder, f"iter_{step:07d}")
        os.makedirs(ckpt, exist_ok=True)
        sd = _sharded_sd(rank, world, tp_save, step)
        if use_async:
            caller = ForkedCaller(dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True))
            for sh in nested_tensors(sd):  # training goes on: the save holds its own copy
                sh.data.add_(1.0)
            caller.finalize()
        else:
            dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)
    strategy.close()
    same = tp_save == tp_load
    for step in (1, 2):
        ckpt = os.path.join(folder, f"iter_{step:07d}")
        target = _zeroed(_sharded_sd(rank, world, tp_load, 0, objects=same))
        loaded = dist_checkpointing.load(target, ckpt, sharded_strategy=GDSLoadShardedStrategy())
        bad += [f"step {step}: {b}" for b in _check(loaded, rank, world, tp_load, step, objects=same)]
    return bad


def nested_tensors(sd: dict) -> list:
    return [*sd["model"].values(), *sd["optimizer"].values()]


def _reload(rank: int, world: int, folder: str, tp: int, step: int) -> list[str]:
    from megatron.core import dist_checkpointing

    from gdswriter.integrations.megatron import register

    register()  # load picks the strategy from metadata.json's backend
    ckpt = os.path.join(folder, f"iter_{step:07d}")
    loaded = dist_checkpointing.load(_zeroed(_sharded_sd(rank, world, tp, 0)), ckpt)
    return _check(loaded, rank, world, tp, step, objects=True)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_two_ranks_tensor_parallel_round_trip_bit_exact(tmp_path, use_async):
    """TP=2: Megatron's save/load through the gdswriter strategies, blocking and through the
    AsyncRequest (the live tensors change before the finalize: the step holds the saved ones)."""
    results = run_ranks(2, _save_load, str(tmp_path / "ckpt"), 2, 2, use_async, out=tmp_path / "out")
    assert results == [[], []]
    step = tmp_path / "ckpt" / "iter_0000002"
    assert (step / "metadata.json").exists() and (step / ".metadata").exists()
    import json

    assert json.loads((step / "metadata.json").read_text())["sharded_backend"] == "gdswriter"


def test_two_ranks_data_parallel_then_reshard_to_tp1(tmp_path):
    """Saved at TP=1 DP=2 (replicas deduplicated, the optimizer state split over DP), loaded back;
    then saved at TP=2 and loaded at TP=1 (every rank reads whole tensors)."""
    assert run_ranks(2, _save_load, str(tmp_path / "dp"), 1, 1, False, out=tmp_path / "o1") == [[], []]
    assert run_ranks(2, _save_load, str(tmp_path / "re"), 2, 1, False, out=tmp_path / "o2") == [[], []]


@pytest.mark.slow
def test_four_ranks_tp2_dp2_then_reshard_to_tp4(tmp_path):
    """4 ranks: TP=2 x DP=2 round trip (async), and TP=2 x DP=2 saved, TP=4 loaded."""
    assert run_ranks(4, _save_load, str(tmp_path / "a"), 2, 2, True, out=tmp_path / "o1") == [[]] * 4
    assert run_ranks(4, _save_load, str(tmp_path / "b"), 2, 4, False, out=tmp_path / "o2") == [[]] * 4


def _killed(rank: int, world: int, folder: str, mode: str) -> None:
    """Save iter 1 and 2 (async) and die of SIGKILL: while iter 2's data files are written (after
    the first file is on disk, held 2 s so that a commit not waiting for the writes would land),
    or after iter 2 is finalized ("between")."""
    import signal
    import time

    from megatron.core import dist_checkpointing

    import gdswriter.distributed.dcp_writer as plugin
    from gdswriter.integrations.megatron import GDSSaveShardedStrategy

    strategy = GDSSaveShardedStrategy()
    for step in (1, 2):
        ckpt = os.path.join(folder, f"iter_{step:07d}")
        os.makedirs(ckpt, exist_ok=True)
        if mode == "in-save" and step == 2:
            written = plugin.write_files

            def write_then_die(fplan, spans, rc, engines, **kw):
                return written(fplan, spans, rc, [KillAfterFirstFile(e) for e in engines], **kw)

            plugin.write_files = write_then_die  # the plug-in's own (public) name for its writes
        sd = _sharded_sd(rank, world, 2, step)
        caller = ForkedCaller(dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True))
        time.sleep(0.5 if mode == "in-save" and step == 2 else 0)
        caller.finalize()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("mode", ["in-save", "between"])
def test_a_kill_leaves_the_last_committed_checkpoint_loadable(tmp_path, mode):
    """kill -9 of both ranks while iter 2's files are written: iter 2 has no metadata.json and no
    committed step (its load is refused), iter 1 loads bit for bit on fresh ranks; killed after
    iter 2's finalize, iter 2 loads bit for bit."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import CheckpointingException

    folder = tmp_path / "ckpt"
    run_ranks(2, _killed, str(folder), mode, out=tmp_path / "o1", killed=(0, 1))
    torn = folder / "iter_0000002"
    if mode == "in-save":
        assert not (torn / "metadata.json").exists() and not (torn / ".metadata").exists()
        with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
            dist_checkpointing.load({}, str(torn))
        import torch.distributed.checkpoint as dcp

        from gdswriter.distributed import GDSStorageReader, dcp_errors
        from gdswriter.errors import CheckpointNotFoundError

        with pytest.raises(CheckpointNotFoundError), dcp_errors():
            dcp.load({}, checkpoint_id=str(torn), storage_reader=GDSStorageReader(), no_dist=True)
    last = 1 if mode == "in-save" else 2
    assert run_ranks(2, _reload, str(folder), 2, last, out=tmp_path / "o2") == [[], []]


def test_objects_are_stored_without_pickle_and_refused_with_their_path():
    """A ShardedObject's data goes through gdswriter's state codec (JSON and raw bytes): decoded
    equal, no pickle opcode in the bytes; an object the codec cannot store is refused."""
    import argparse

    from gdswriter.errors import CorruptCheckpointError, UnsupportedObjectError
    from gdswriter.integrations.megatron import decode_object, encode_object

    obj = {"a": [1, 2.5, None], "t": torch.arange(6, dtype=torch.int16).reshape(2, 3), "b": b"\x80\x04"}
    data = encode_object(obj, "rng/shard_0_2")
    back = decode_object(data, "rng/shard_0_2")
    assert back["a"] == obj["a"] and back["b"] == obj["b"] and torch.equal(back["t"], obj["t"])
    assert b"\x80\x04\x95" not in data  # pickle protocol 4's frame header
    with pytest.raises(UnsupportedObjectError, match="args"):
        encode_object({"args": argparse.Namespace(lr=1.0)}, "common")
    with pytest.raises(CorruptCheckpointError):
        decode_object(data[:-3], "rng/shard_0_2")


def _one_rank_fails(rank: int, world: int, folder: str) -> list:
    """Rank 1's engine fails iter 2's write: every rank raises from the finalize (rank 1 its own
    error, rank 0 RankFailedError), nothing is committed, and iter 3 saves and loads."""
    import errno
    import time

    from megatron.core import dist_checkpointing

    import gdswriter.distributed.dcp_writer as plugin
    from gdswriter.errors import EngineIOError
    from gdswriter.integrations.megatron import GDSLoadShardedStrategy, GDSSaveShardedStrategy
    from tests.support.ranks import caught

    strategy = GDSSaveShardedStrategy()
    written = plugin.write_files
    got = []
    for step in (1, 2, 3):
        ckpt = os.path.join(folder, f"iter_{step:07d}")
        os.makedirs(ckpt, exist_ok=True)
        if step == 2 and rank == 1:
            def fail(*args, **kwargs):
                raise EngineIOError(errno.EIO, "data-rank1.bin", 0, "writing iter 2 (a test's failure)")

            plugin.write_files = fail  # the plug-in's own (public) name for its writes
        else:
            plugin.write_files = written
        request = dist_checkpointing.save(_sharded_sd(rank, world, 2, step), ckpt, sharded_strategy=strategy,
                                          async_sharded_save=True)
        if step == 2:
            time.sleep(1)  # rank 1's write has failed (closing its end of the FIFO) before the worker starts
        got.append(caught(ForkedCaller(request).finalize))
    strategy.close()
    loaded = dist_checkpointing.load(_zeroed(_sharded_sd(rank, world, 2, 0)), os.path.join(folder, "iter_0000003"),
                                     sharded_strategy=GDSLoadShardedStrategy())
    return [got, _check(loaded, rank, world, 2, 3, objects=True)]


def test_a_rank_failing_its_write_fails_the_save_on_every_rank(tmp_path):
    folder = tmp_path / "ckpt"
    (r0, bad0), (r1, bad1) = run_ranks(2, _one_rank_fails, str(folder), out=tmp_path / "out")
    assert bad0 == [] and bad1 == []
    assert r0[0] is None and r0[2] is None and r1[0] is None and r1[2] is None
    assert r1[1][0] == "EngineIOError" and "iter 2" in r1[1][1]
    assert r0[1][0] == "RankFailedError" and "rank 1" in r0[1][1]
    assert not (folder / "iter_0000002" / "metadata.json").exists()
    assert not (folder / "iter_0000002" / ".metadata").exists()


@pytest.mark.slow
def test_the_benchmark_script_runs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "megatron_strategy.py"
    proc = subprocess.run([sys.executable, str(script), "--ranks", "2", "--size", "8M", "--rounds", "1",
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch_dist / gdswriter" in proc.stdout and "gdswriter " in proc.stdout
    assert list(tmp_path.iterdir()) == []


def _common_in_the_step(rank: int, world: int, folder: str) -> list:
    """gdswriter's save (Megatron's arguments) with a common state: no common.pt, the common state
    in the step; loaded back by Megatron's own load after register(); an argparse.Namespace in
    the common state refused on every rank before anything is written."""
    import argparse

    from megatron.core import dist_checkpointing

    from gdswriter.integrations import megatron as gds_megatron
    from tests.support.ranks import caught

    gds_megatron.register()
    strategy = gds_megatron.GDSSaveShardedStrategy()
    bad = []
    for step, use_async in ((1, True), (2, False)):
        ckpt = os.path.join(folder, f"iter_{step:07d}")
        os.makedirs(ckpt, exist_ok=True)
        sd = _sharded_sd(rank, world, 2, step)
        sd["scheduler"] = {"num_steps": 7 * step, "lr": [0.5, 1e-4], "name": "cosine"}
        request = gds_megatron.save(sd, ckpt, strategy, async_sharded_save=use_async)
        if use_async:
            ForkedCaller(request).finalize()
        loaded = dist_checkpointing.load(_zeroed(_sharded_sd(rank, world, 2, 0)), ckpt)
        bad += _check(loaded, rank, world, 2, step, objects=True)
        if loaded["scheduler"] != {"num_steps": 7 * step, "lr": [0.5, 1e-4], "name": "cosine"}:
            bad.append(f"scheduler {loaded['scheduler']}")
    ckpt = os.path.join(folder, "iter_0000003")
    os.makedirs(ckpt, exist_ok=True)
    sd = _sharded_sd(rank, world, 2, 3)
    sd["args"] = argparse.Namespace(lr=1.0)
    refused = caught(lambda: gds_megatron.save(sd, ckpt, strategy))
    strategy.close()
    return [bad, refused]


def test_common_state_goes_into_the_step_without_pickle(tmp_path):
    import json

    folder = tmp_path / "ckpt"
    results = run_ranks(2, _common_in_the_step, str(folder), out=tmp_path / "out")
    for bad, refused in results:
        assert bad == []
        assert refused[0] == "UnsupportedObjectError" and "args" in refused[1], refused
    for step in (1, 2):
        ckpt = folder / f"iter_{step:07d}"
        assert not (ckpt / "common.pt").exists() and not list(ckpt.glob("*.pt"))
        assert json.loads((ckpt / "metadata.json").read_text())["common_backend"] == "gdswriter"
    assert sorted(p.name for p in (folder / "iter_0000003").iterdir()) == []
