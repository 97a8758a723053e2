"""torch.distributed.checkpoint through gdswriter: DCP's own CPU test scenarios (adapted from
torch's test/distributed/checkpoint/test_file_system_checkpoint_cpu.py) with GDSStorageWriter and
GDSStorageReader in place of FileSystemWriter/FileSystemReader, async_save in thread and process
modes, DTensor resharding (4 -> 2 -> 1 ranks), node-local roots, and the gdswriter command."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _engine():
    from support.models import small_engine

    return small_engine()


def writer(root: Any, step: int | None = None, **kw):
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageWriter

    return GDSStorageWriter(root, step, options=CheckpointOptions(engine=_engine()), **kw)


def reader(root: Any, step: int | None = None, **kw):
    from gdswriter.distributed import GDSStorageReader

    return GDSStorageReader(root, step, engine_options=_engine(), **kw)


class MyTestModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class BlobState:
    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlobState) and self.state == other.state


def assert_state_dict_equal(a: dict, b: dict) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, ShardedTensor):
            for s1, s2 in zip(v.local_shards(), b[k].local_shards()):
                assert torch.equal(s1.tensor, s2.tensor), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


# ----------------------------------------------------------------------------- one process (no_dist)
def test_read_write_only_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp

    saved = MyTestModule().state_dict()
    dcp.save(saved, storage_writer=writer(tmp_path), no_dist=True)
    loaded = MyTestModule().state_dict()
    with pytest.raises(AssertionError):
        assert_state_dict_equal(loaded, saved)
    dcp.load(loaded, storage_reader=reader(tmp_path), no_dist=True)
    assert_state_dict_equal(loaded, saved)


def test_dtype_mismatch_casting(tmp_path):
    """Narrowing and widening casts on load (torch 2.13's DefaultLoadPlanner has no strict
    allow_unsafe_types mode yet, so that part of torch's test does not apply)."""
    import torch.distributed.checkpoint as dcp

    fp32 = {"w": torch.rand(4, 3, dtype=torch.float32)}
    dcp.save(fp32, storage_writer=writer(tmp_path / "a"))
    bf16 = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    dcp.load(bf16, storage_reader=reader(tmp_path / "a"))
    assert bf16["w"].dtype == torch.bfloat16 and torch.equal(bf16["w"], fp32["w"].to(torch.bfloat16))
    saved = {"w": torch.rand(4, 3, dtype=torch.bfloat16)}
    dcp.save(saved, storage_writer=writer(tmp_path / "b"))
    wide = {"w": torch.zeros(4, 3)}
    dcp.load(wide, storage_reader=reader(tmp_path / "b"))
    assert wide["w"].dtype == torch.float32 and torch.equal(wide["w"], saved["w"].float())


def test_read_write_tensor_and_blob_then_the_gdswriter_command(tmp_path, capsys):
    """A Stateful holding bytes becomes a BytesIO item (a uint8 storage); the step is listed,
    inspected, verified and exported like any other, and the DCP metadata in it is JSON."""
    import torch.distributed.checkpoint as dcp

    from gdswriter.cli import main
    from gdswriter.format.manifest import Manifest

    saved = MyTestModule().state_dict()
    saved["test_blob"] = BlobState(b"SomeBlobForTesting")
    dcp.save(saved, storage_writer=writer(tmp_path, step=7))
    loaded = MyTestModule().state_dict()
    loaded["test_blob"] = BlobState(b"")
    dcp.load(loaded, storage_reader=reader(tmp_path))
    assert_state_dict_equal(loaded, saved)

    m = Manifest.from_json_bytes((tmp_path / "step_000000000007" / "manifest.json").read_bytes())
    assert m.dist.layout == "dcp" and m.version == (1, 2)
    entries = dict(m.dist.dcp["state_dict_metadata"])
    assert "bytes" in entries["test_blob.blob"] and "tensor" in entries["linear_1.weight"]
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 0 and "OK" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    names = {t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert {"linear_1.weight", "emb.weight", "test_blob.blob"} <= names
    assert main(["export", str(tmp_path), "--to", "torch", str(tmp_path / "x.pt")]) == 0
    flat = torch.load(tmp_path / "x.pt", weights_only=True)
    assert torch.equal(flat["linear_1.weight"], saved["linear_1.weight"])


def test_a_writer_keeps_its_engines_from_save_to_save_until_closed(tmp_path, monkeypatch):
    """Engines (rings, page-locked buffers) are built at a writer's first save and reused by the
    next ones; close() releases them; a pickled writer (DCP's process mode) carries none; a
    failed write drops them, so the next save starts from fresh ones."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import gdswriter.distributed.dcp_writer as dcp_mod

    built = []
    real = dcp_mod.create_engine
    monkeypatch.setattr(dcp_mod, "create_engine", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    w = writer(tmp_path)
    saved = MyTestModule().state_dict()
    for step in (1, 2, 3):
        saved["linear_1.bias"] = torch.full((5,), float(step))
        dcp.save(saved, storage_writer=w, checkpoint_id=step, no_dist=True)
    assert len(built) == 1 and w._engines == built
    loaded = MyTestModule().state_dict()
    dcp.load(loaded, storage_reader=reader(tmp_path, 2), no_dist=True)
    assert torch.equal(loaded["linear_1.bias"], torch.full((5,), 2.0))
    assert pickle.loads(pickle.dumps(w))._engines is None
    w.close()
    assert w._engines is None and built[0]._backend is None  # closed: no ring, no buffers
    monkeypatch.setattr(dcp_mod, "write_files", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(CheckpointException) as ei:
        dcp.save(saved, storage_writer=w, checkpoint_id=4, no_dist=True)
    assert "No space" in repr(ei.value.failures)
    assert w._engines is None and built[-1] is not built[0] and built[-1]._backend is None
    assert sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("step_*")) == [1, 2, 3]


def test_async_save_thread_mode_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp

    saved = MyTestModule().state_dict()
    fut = dcp.async_save(saved, storage_writer=writer(tmp_path, step=3), no_dist=True)
    fut.result()
    loaded = MyTestModule().state_dict()
    dcp.load(loaded, storage_reader=reader(tmp_path, 3), no_dist=True)
    assert_state_dict_equal(loaded, saved)


def test_async_save_holds_the_values_at_the_call(tmp_path):
    """Issue 22 item 3, for the DCP writer: dcp.async_save (torch 2.13) stages the state dict to
    CPU memory before it returns (DefaultStager: GDSStorageWriter is no AsyncStager), and the
    writer reads only that copy, so changes made at once to the live 8 MiB tensor (above
    every small-copy threshold) do not reach the saved step."""
    import torch.distributed.checkpoint as dcp

    live = {"w": torch.randn(2048, 1024), "b": torch.randn(7)}
    want = {k: v.clone() for k, v in live.items()}
    fut = dcp.async_save(live, storage_writer=writer(tmp_path, step=5), no_dist=True)
    for v in live.values():
        v.add_(1.0)
    fut.result()
    loaded = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(loaded, storage_reader=reader(tmp_path, 5), no_dist=True)
    assert_state_dict_equal(loaded, want)


def test_metadata_codec_refuses_damage(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from gdswriter.distributed.dcp_codec import metadata_from_json, metadata_to_json
    from gdswriter.errors import CorruptCheckpointError

    md = dcp.save(MyTestModule().state_dict(), storage_writer=writer(tmp_path))
    md = dataclasses.replace(md, storage_data={MetadataIndex("linear_1.weight", [0, 0]): 0})
    doc = metadata_to_json(md)
    again = metadata_from_json(json.loads(json.dumps(doc)))
    assert again.state_dict_metadata == md.state_dict_metadata and again.planner_data == md.planner_data
    assert again.storage_data == md.storage_data and again.storage_meta == md.storage_meta
    for bad in ({**doc, "state_dict_metadata": [["x", {"tensor": {"size": [2]}}]]},
                {**doc, "state_dict_metadata": [["x", {"tensor": {"properties": {}, "size": "2", "chunks": []}}]]},
                {**doc, "storage_data": [["x", None, "zero"]]}, {**doc, "planner_data": {"$evil": 1}}, {}):
        with pytest.raises(CorruptCheckpointError):
            metadata_from_json(bad)


# ----------------------------------------------------------------------------- 2 ranks
def _specs(size: int | None = None):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    def enum(*shards):
        return EnumerableShardingSpec(shards=[ShardMetadata(shard_offsets=o, shard_sizes=s, placement=f"rank:{r}/cpu")
                                              for o, s, r in shards])
    if size is not None:  # 1-D, as test_switch_between_sharded_tensor_to_tensor
        return [ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]),
                ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu", "rank:0/cpu"]),
                enum(([0], [8], 1), ([8], [size - 8], 0)), enum(([0], [10], 0), ([10], [size - 10], 1))]
    return [ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]),
            ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu", "rank:0/cpu"]),
            enum(([0, 0], [2, 20], 0), ([2, 0], [1, 20], 1), ([3, 0], [3, 20], 0), ([6, 0], [3, 20], 1),
                 ([9, 0], [1, 20], 0)),
            enum(([0, 0], [8, 20], 1), ([8, 0], [2, 20], 0))]


def _gather(st) -> torch.Tensor | None:
    import torch.distributed as dist

    out = torch.zeros(st.shape) if dist.get_rank() == 0 else None
    st.gather(out=out)
    return out


def _two_rank_scenarios(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard import sharded_tensor
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    done = []
    root = Path(tmp, "two")

    # test_read_write_shard_tensor
    spec = _specs()[0]
    st = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)
    dcp.save({"sharded": st}, storage_writer=writer(root))
    other = {"sharded": sharded_tensor.zeros(spec, 10, 20, init_rrefs=False)}
    dcp.load(other, storage_reader=reader(root))
    assert_state_dict_equal(other, {"sharded": st})
    done.append("read_write_shard_tensor")

    # test_load_with_different_shard_plan: every pair of the four layouts
    specs = _specs()
    for i, s0 in enumerate(specs):
        for j, s1 in enumerate(specs):
            if i == j:
                continue
            st0 = sharded_tensor.rand(s0, 10, 20, init_rrefs=False)
            dcp.save({"sharded_tensor": st0}, storage_writer=writer(root))
            st1 = sharded_tensor.zeros(s1, 10, 20, init_rrefs=False)
            dcp.load({"sharded_tensor": st1}, storage_reader=reader(root))
            a, b = _gather(st0), _gather(st1)
            assert rank != 0 or torch.equal(a, b), (i, j)
    done.append("load_with_different_shard_plan")

    # test_load_rowwise_to_colwise (a CUDA test in torch; the same resharding on CPU)
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    rows = sharded_tensor.rand(ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]), 10, 20,
                               init_rrefs=False)
    dcp.save({"sharded_tensor": rows}, storage_writer=writer(root))
    cols = sharded_tensor.zeros(ChunkShardingSpec(dim=1, placements=["rank:0/cpu", "rank:1/cpu"]), 10, 20,
                                init_rrefs=False)
    dcp.load({"sharded_tensor": cols}, storage_reader=reader(root))
    a, b = _gather(rows), _gather(cols)
    assert rank != 0 or torch.equal(a, b)
    done.append("load_rowwise_to_colwise")

    # test_save_load_bytes
    dcp.save({"bytes0": [1], "bytes1": "string"}, storage_writer=writer(root))
    back = {"bytes0": [2], "bytes1": "other"}
    dcp.load(back, storage_reader=reader(root))
    assert back == {"bytes0": [1], "bytes1": "string"}
    done.append("save_load_bytes")

    # test_switch_between_sharded_tensor_to_tensor
    size = 32
    for save_spec in _specs(size):
        for load_spec in _specs(size):
            save_dict = {"sharded": sharded_tensor.rand(save_spec, size), "replicated": torch.rand(size)}
            dist.broadcast(save_dict["replicated"], src=0)
            dcp.save(save_dict, storage_writer=writer(root))
            load_dict = {"sharded": torch.zeros(size), "replicated": sharded_tensor.zeros(load_spec, size)}
            dcp.load(load_dict, storage_reader=reader(root))
            a, b = _gather(save_dict["sharded"]), _gather(load_dict["replicated"])
            assert rank != 0 or (torch.equal(a, load_dict["sharded"]) and torch.equal(save_dict["replicated"], b))
    done.append("switch_between_sharded_tensor_to_tensor")

    # the 4-rank DTensor checkpoint, loaded on 2 ranks with another placement
    mesh = init_device_mesh("cpu", (world,))
    loaded = {"dt": distribute_tensor(torch.zeros(12, 10), mesh, [Shard(1)]), "rep": torch.zeros(4096 + 8),
              "blob": b""}
    dcp.load(loaded, storage_reader=reader(Path(tmp, "four")))
    assert torch.equal(loaded["dt"].full_tensor(), torch.arange(120.0).reshape(12, 10))
    assert torch.equal(loaded["rep"], torch.arange(4096 + 8.0)) and loaded["blob"] == b"four ranks"
    done.append("dtensor_4_to_2")

    # async_save, thread and process modes (the writer is pickled to DCP's checkpoint process)
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        sd = {"dt": distribute_tensor(torch.arange(64.0).reshape(8, 8) * (1 + rank * 0), mesh, [Shard(0)]),
              "rep": torch.full((3000,), 7.0)}
        fut = dcp.async_save(sd, storage_writer=writer(Path(tmp, f"async-{kind.value}"), step=11),
                             async_checkpointer_type=kind)
        fut.result()
        back = {"dt": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)]), "rep": torch.zeros(3000)}
        dcp.load(back, storage_reader=reader(Path(tmp, f"async-{kind.value}"), 11))
        assert torch.equal(back["dt"].full_tensor(), torch.arange(64.0).reshape(8, 8))
        assert torch.equal(back["rep"], sd["rep"])
        done.append(f"async_save_{kind.value}")
    return {"done": done}


def _four_rank_save(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(120.0).reshape(12, 10)
    sd = {"dt": distribute_tensor(full, mesh, [Shard(0)]), "rep": torch.arange(4096 + 8.0), "blob": b"four ranks"}
    dcp.save(sd, storage_writer=writer(Path(tmp, "four")))
    # node-local roots: every rank its own; loading needs the replicated tensor, split across all four
    private = Path(tmp, f"node{rank}")
    dcp.save(sd, storage_writer=writer(private, step=5))
    back = {"dt": distribute_tensor(torch.zeros(12, 10), mesh, [Shard(0)]), "rep": torch.zeros(4096 + 8),
            "blob": b""}
    dcp.load(back, storage_reader=reader(private, 5))
    ok = torch.equal(back["dt"].full_tensor(), full) and torch.equal(back["rep"], sd["rep"]) and \
        back["blob"] == b"four ranks"
    mine = sum(f.stat().st_size for f in (private / "step_000000000005").glob("data-*"))
    return {"ok": ok, "bytes": mine}


@pytest.mark.slow  # about 16 s: a dozen DCP scenarios on spawned ranks
def test_dcp_scenarios_on_2_and_4_ranks(tmp_path):
    """DCP's CPU scenarios on 2 ranks (ShardedTensor round trip and resharding between four shard
    layouts, row- to column-wise, bytes, sharded <-> plain tensors, async_save thread and process
    modes), a 4-rank DTensor checkpoint loaded on 2 ranks and in one process, and a 4-rank save to
    node-local roots loaded back through the exchange of chunks between ranks."""
    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import load_state

    res4 = run_ranks(4, _four_rank_save, str(tmp_path), out=tmp_path / "r4")
    assert all(x["ok"] for x in res4), res4
    sizes = [x["bytes"] for x in res4]
    assert min(sizes) > 0, "the replicated tensor is split across the four ranks: each wrote a part"
    res2 = run_ranks(2, _two_rank_scenarios, str(tmp_path), out=tmp_path / "r2")
    assert res2[0]["done"] == res2[1]["done"] and len(res2[0]["done"]) == 8, res2
    one = {"dt": torch.zeros(12, 10), "rep": torch.zeros(4096 + 8), "blob": b""}
    dcp.load(one, storage_reader=reader(tmp_path / "four"), no_dist=True)
    assert torch.equal(one["dt"], torch.arange(120.0).reshape(12, 10)) and one["blob"] == b"four ranks"
    step, whole = load_state(tmp_path / "four")  # gdswriter's own reader: DCP chunks assembled
    assert step == 0 and torch.equal(whole["dt"], one["dt"]) and torch.equal(whole["rep"], one["rep"])


# ----------------------------------------------------------------------------- the storage side's own collectives
_C10D = ("gather", "scatter", "broadcast", "all_gather", "all_reduce", "reduce", "all_to_all", "barrier", "send",
         "recv", "isend", "irecv", "gather_object", "all_gather_object", "scatter_object_list",
         "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier")


def _count_dist_calls(fn) -> int:
    """How many torch.distributed communication calls ``fn()`` makes on this rank (DCP's and
    the storage layer's alike, nested ones included: gather_object counts with what it calls)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    calls = [0]
    saved = {}
    for name in _C10D:
        f = getattr(c10d, name, None)
        if f is None:
            continue

        def counted(*a, _f=f, **k):
            calls[0] += 1
            return _f(*a, **k)

        saved[name] = (f, getattr(dist, name, None))
        setattr(c10d, name, counted)
        setattr(dist, name, counted)
    try:
        fn()
    finally:
        for name, (f, g) in saved.items():
            setattr(c10d, name, f)
            if g is not None:
                setattr(dist, name, g)
    return calls[0]


def _saved(root: Path, step: int, sd: dict) -> bool:
    """Step ``step`` under ``root`` loads back as ``sd``."""
    import torch.distributed.checkpoint as dcp

    back = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else b"") for k, v in sd.items()}
    dcp.load(back, storage_reader=reader(root, step))
    return all(torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v for k, v in sd.items())


def _collectives_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from gdswriter.distributed.group import Coordinator

    sd = {"rep": torch.arange(5000.0), "other": torch.ones(300, dtype=torch.float16), "blob": b"x" * 10}
    out: dict = {}
    fs = [_count_dist_calls(lambda i=i: dcp.save(sd, storage_writer=FileSystemWriter(Path(tmp, f"fs{i}"))))
          for i in range(3)]
    out["fs"] = fs
    # fresh writers first: nothing has made the plug-in's coordination channel yet
    saved = {}
    for name, root in (("fresh_shared", Path(tmp, "fresh")), ("fresh_node_local", Path(tmp, f"fresh{rank}"))):
        out[name] = {"calls": [_count_dist_calls(lambda: dcp.save(sd, storage_writer=writer(root)))
                               for _ in range(3)]}
        saved[name] = (root, 2)
    kept = writer(None)  # torchtitan's: one writer, a new checkpoint_id directory per save (each opened afresh)
    out["paths"] = {"calls": [_count_dist_calls(lambda i=i: dcp.save(sd, storage_writer=kept,
                                                                       checkpoint_id=Path(tmp, "run", f"step-{i}")))
                              for i in range(3)]}
    kept.close()
    saved["paths"] = (Path(tmp, "run", "step-2"), 2)
    out["channels"] = Coordinator.shared_channels()  # no save made the writer's coordination channel
    for name, (root, step) in saved.items():
        out[name]["ok"] = _saved(root, step, sd)
    for name, root in (("shared", Path(tmp, "shared")), ("node_local", Path(tmp, f"node{rank}"))):
        w = writer(root)
        coord = w.coordinator()
        own, calls = [], []
        for _ in range(3):
            before = coord.stats.collectives
            calls.append(_count_dist_calls(lambda: dcp.save(sd, storage_writer=w)))
            own.append(coord.stats.collectives - before)
        w.close()
        out[name] = {"own": own, "calls": calls, "ok": _saved(root, 2, sd),
                     "step_dirs": sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp")))}
    return out


def test_dcp_save_adds_no_collective_of_the_storage_layer(tmp_path):
    """Every dcp.save through GDSStorageWriter makes exactly the torch.distributed calls a
    FileSystemWriter save makes (DCP's own plan gather/scatter and result gather/broadcast), and
    none on the writer's coordination channel: a writer's first save too (a new writer per save,
    or a kept one given a new checkpoint_id directory per save, as torchtitan does), whose roots'
    identities and probes travel in the local plans and the root table and primary come back in
    the global plans, and a kept writer's later saves, whose step and token travel in the plans
    and reports in its WriteResults. With one root every rank shares, and with node-local roots
    (rank 1 publishes its secondary step directory inside write_data). Before, a fresh writer
    opened its roots with collectives of its own (root table, primary, cleaning: 28 calls here, 33
    with the coordination channel's creation, against FileSystemWriter's 13)."""
    res = run_ranks(2, _collectives_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(res):
        fs = x["fs"][-1]
        assert x["channels"] == 0, (rank, x)
        for name in ("fresh_shared", "fresh_node_local", "paths"):
            got = x[name]
            assert got["ok"], (rank, name, got)
            assert got["calls"] == [fs, fs, fs], (rank, name, got, x["fs"])
        for name in ("shared", "node_local"):
            got = x[name]
            assert got["ok"], (rank, name, got)
            assert got["own"] == [0, 0, 0], (rank, name, got)
            assert got["calls"] == [fs, fs, fs], (rank, name, got, x["fs"])
            assert got["step_dirs"] == ["step_000000000000", "step_000000000001", "step_000000000002"], got


def _failures_worker(rank: int, world: int, tmp: str) -> dict:
    import errno
    import os

    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import commit, dcp_errors
    from gdswriter.errors import EngineIOError
    from support.ranks import caught

    root = Path(tmp, f"node{rank}")  # node-local roots: rank 1 leads its own secondary root
    w = writer(root)
    numel = 1 << 19  # 2 MiB: above the small-copy thresholds, so every path of a save and a load runs
    sd = {"rep": torch.arange(float(numel)), "blob": b"one"}

    def save(value: float, fail: str | None = None) -> list[str] | None:
        sd["rep"].fill_(value)
        real = (commit.OrderedCommit.commit_manifest, commit.OrderedCommit.publish_led)

        def broken(self, *a, **k):
            raise EngineIOError(errno.ENOSPC, str(self.dirs[0]), 0, "write")

        if fail == "finish" and rank == 0:
            commit.OrderedCommit.commit_manifest = broken
        if fail == "publish" and rank == 1:
            commit.OrderedCommit.publish_led = broken
        def run() -> None:
            with dcp_errors():
                dcp.save(sd, storage_writer=w)

        try:
            return caught(run)
        finally:
            commit.OrderedCommit.commit_manifest, commit.OrderedCommit.publish_led = real

    def tree() -> list[str]:
        return sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp-")))

    out: dict = {"first": save(1.0)}
    out["finish"] = save(2.0, "finish")  # step 1: rank 1 has published its secondary, rank 0 fails to commit
    out["after_finish"] = tree()
    out["publish"] = save(3.0, "publish")  # step 1 again: rank 1 fails to publish
    out["after_publish"] = tree()
    out["next"] = save(4.0)  # step 1, committed now; the leftovers are cleaned
    out["after_next"] = tree()
    # re-saving step 1 with rank 1 leading a secondary root: rank 1 writes beside the committed step_1
    # there, under names of its own (OrderedCommit): as many torch.distributed calls as FileSystemWriter
    from torch.distributed.checkpoint import FileSystemWriter

    from gdswriter.distributed.dcp import GDSStorageWriter
    from gdswriter.distributed.rankfiles import save_tag
    from gdswriter.format.commit import root_identity
    from gdswriter.format.sharded import parse_step

    def tags() -> list[str]:  # the saves whose data files rank 1's step_1 holds
        return sorted({t for n in os.listdir(root / "step_000000000001") for t in [save_tag(n)] if t is not None})

    def load_step_1() -> tuple:
        back = {"rep": torch.zeros(numel), "blob": b""}
        err = caught(lambda: dcp.load(back, storage_reader=reader(root, 1)))
        return err, [float(back["rep"].min()), float(back["rep"].max())]  # [v, v]: every element is v

    out["fs_calls"] = _count_dist_calls(lambda: dcp.save(sd, storage_writer=FileSystemWriter(Path(tmp, "fs"))))
    again = writer(root, step=1)
    calls: list[int] = []
    out["resave"] = caught(lambda: calls.extend(
        _count_dist_calls(lambda: dcp.save({**sd, "rep": torch.full((numel,), 5.0)}, storage_writer=again))
        for _ in range(2)))
    out["resave_calls"] = calls
    again.close()
    out["loaded"] = load_step_1()
    out["after_resave"] = tree()
    out["tags_after_resaves"] = tags()  # the second re-save removed the first step_1's files, not the first re-save's
    # re-saving step 1 again, rank 0's write fails: rank 1 wrote beside the committed step, which stays whole
    real_write = GDSStorageWriter._write

    def failing(self, *a, **k):
        raise EngineIOError(errno.ENOSPC, "rank0", 0, "write")

    if rank == 0:
        GDSStorageWriter._write = failing
    fw = writer(root, step=1)
    try:
        out["resave_failed"] = caught(lambda: dcp.save({**sd, "rep": torch.full((numel,), 6.0)}, storage_writer=fw))
    finally:
        GDSStorageWriter._write = real_write
        fw.close()
    out["after_failed"] = load_step_1()
    out["tags_after_failed"] = tags()  # a fresh writer found two saves' files, and kept the committed ones
    # re-saving step 1 again, rank 1 fails after writing beside it: it removes its own files, never the step's
    real_publish = commit.OrderedCommit.publish_led

    def publish_fails(self, *a, **k):
        raise EngineIOError(errno.ENOSPC, str(self.dirs[-1]), 0, "write")

    if rank == 1:
        commit.OrderedCommit.publish_led = publish_fails
    fw = writer(root, step=1)
    try:
        def run() -> None:
            with dcp_errors():
                dcp.save({**sd, "rep": torch.full((numel,), 7.0)}, storage_writer=fw)
        out["resave_publish"] = caught(run)
    finally:
        commit.OrderedCommit.publish_led = real_publish
        fw.close()
    out["after_publish_failed"] = load_step_1()
    out["tags_after_publish_failed"] = tags()
    # a fresh writer's save of another step: what the failed re-save left beside step 1 goes
    w.close()
    out["step_2"] = caught(lambda: dcp.save(sd, storage_writer=writer(root, step=2)))
    out["tags_cleaned"] = tags()
    out["files"] = sorted(n for n in os.listdir(root / "step_000000000001") if not n.startswith("primary-"))
    if rank == 0:  # the names step 1's manifest lists on rank 1's root
        m = parse_step((root / "step_000000000001" / "manifest.json").read_bytes(), "step 1")
        g = next(g for g, info in enumerate(m.dist.roots) if info.id == root_identity(Path(tmp, "node1")).id)
        out["listed"] = sorted(f.path for f in m.files if f.root == g)
    out["after_cleaned"] = load_step_1()
    return out


def test_a_failure_on_any_rank_commits_nothing_and_the_next_save_cleans_up(tmp_path):
    """Node-local roots (rank 1 publishes its own secondary step directory in write_data): when
    rank 0's commit fails in finish, or rank 1's publishing fails in write_data, DCP raises on
    both ranks and no step is committed (rank 0's root holds only step 0); the writer's next save
    (its roots kept, no new open) removes what the failed ones left and commits. Re-saving that
    step (rank 1 leads a secondary root: it writes beside the committed step there) makes
    FileSystemWriter's torch.distributed calls and replaces it, and each save removes the files
    the committed step no longer names (the old ones after a re-save); a re-save that fails on
    rank 0 after rank 1 wrote leaves the old step whole, as does one failing on rank 1 after it
    wrote beside the step (it removes its own files there), and a fresh writer's next save removes
    what they left, keeping exactly the files the committed manifest names."""
    res = run_ranks(2, _failures_worker, str(tmp_path), out=tmp_path / "ranks")
    r0, r1 = res
    assert r0["first"] is None and r1["first"] is None, res
    for x in res:
        assert x["finish"] and x["finish"][0] in ("EngineIOError", "RankFailedError", "CheckpointException"), res
        assert x["publish"] and x["publish"][0] in ("EngineIOError", "RankFailedError", "CheckpointException"), res
    assert r0["finish"][0] == "EngineIOError" and r1["publish"][0] == "EngineIOError", res
    assert r0["after_finish"] == ["step_000000000000"], r0  # nothing committed; rank 0 removed its directories
    assert r1["after_finish"] == ["step_000000000000", "step_000000000001"], r1  # published, never committed
    # rank 0 does not learn that rank 1 failed (DCP raises after write_data): its directory waits to be cleaned
    assert [n for n in r0["after_publish"] if not n.startswith(".tmp-step_000000000001-")] == \
        ["step_000000000000"], r0
    assert r1["after_publish"] == ["step_000000000000"], r1  # its own failure removed what it made
    assert r0["next"] is None and r1["next"] is None, res
    assert r0["after_next"] == r1["after_next"] == ["step_000000000000", "step_000000000001"], res
    assert r0["resave"] is None and r1["resave"] is None, res
    for x in res:  # the first re-save (a fresh writer) opens the roots in DCP's plans: no call of its own either
        assert x["resave_calls"] == [x["fs_calls"]] * 2, res
    assert r0["loaded"] == r1["loaded"] == [None, [5.0, 5.0]], res
    assert r0["after_resave"] == r1["after_resave"] == ["step_000000000000", "step_000000000001"], res
    assert r0["resave_failed"] and r1["resave_failed"], res
    assert r0["after_failed"] == [None, [5.0, 5.0]], res  # the old step, whole
    assert len(r1["tags_after_resaves"]) == 2 and "" not in r1["tags_after_resaves"], r1
    assert len(r1["tags_after_failed"]) == 2 and r1["tags_after_failed"] != r1["tags_after_resaves"], r1
    assert r0["resave_publish"] and r1["resave_publish"][0] == "EngineIOError", res
    assert r0["after_publish_failed"] == [None, [5.0, 5.0]], res  # rank 1's failure left the step whole
    # the fresh writer removed the failed re-save's files before it wrote; rank 1 removed its own on failing
    assert len(r1["tags_after_publish_failed"]) == 1 and \
        r1["tags_after_publish_failed"][0] in r1["tags_after_failed"], r1
    assert r0["step_2"] is None and r1["step_2"] is None, res
    assert len(r1["tags_cleaned"]) == 1 and r1["tags_cleaned"][0] in r1["tags_after_failed"], r1
    assert r1["files"] == r0["listed"] and len(r0["listed"]) == 1, res  # only what the manifest names
    assert r0["after_cleaned"] == [None, [5.0, 5.0]], res


def _opening_worker(rank: int, world: int, tmp: str) -> dict:
    import os

    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import dcp_errors
    from gdswriter.format.commit import RootLock
    from support.ranks import caught

    root = Path(tmp, f"node{rank}")  # node-local roots: rank 1 leads its own, and locks it in write_data
    root.mkdir()
    sd = {"rep": torch.arange(3000.0), "blob": b"opening"}
    other = RootLock([root]) if rank == 1 else None  # another job's writer holds rank 1's root
    w = writer(root)

    def save() -> list[str] | None:
        def run() -> None:
            with dcp_errors():
                dcp.save(sd, storage_writer=w)
        return caught(run)

    def tree() -> list[str]:
        return sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp-")))

    out: dict = {"locked": save(), "locked_tree": tree()}
    if other is not None:
        other.release()
    out["next"], out["next_tree"] = save(), tree()  # the layout kept from the refused save; the leftovers cleaned
    if rank == 1:
        w._wrote = False  # as if rank 1 had failed before write_data last time: it opens afresh, rank 0 keeps its roots
    out["mixed"], out["mixed_tree"] = save(), tree()
    out["after"], out["after_tree"] = save(), tree()  # every rank opens afresh
    w.close()
    # re-saving step 1 (rank 1 writes beside the committed step on the root it leads) while another job
    # holds rank 1's root: refused in rank 1's write_data, before it writes there
    other = RootLock([root]) if rank == 1 else None
    w = writer(root, step=1)
    sd["rep"].fill_(9.0)
    out["resave_locked"], out["resave_locked_tree"] = save(), tree()
    out["resave_locked_files"] = sorted(os.listdir(root / "step_000000000001"))
    w.close()
    if other is not None:
        other.release()
    back = {"rep": torch.zeros(3000), "blob": b""}
    dcp.load(back, storage_reader=reader(root, 1))
    out["resave_loaded"] = [float(back["rep"][0]), float(back["rep"][-1])]
    # another writer's save reaches rank 1's root after rank 1 probed it, before it holds its lock
    from gdswriter.distributed.dcp import GDSStorageWriter

    root = Path(tmp, f"late{rank}")
    w = writer(root)
    real = GDSStorageWriter.prepare_local_plan

    def late_write(self, plan):
        step = root / "step_000000000007"
        step.mkdir()
        (step / "primary-root").write_text("/elsewhere\n")
        (step / "primary-id").write_text("e" * 32 + "\n")
        return real(self, plan)

    if rank == 1:
        GDSStorageWriter.prepare_local_plan = late_write
    try:
        out["late"] = save()
    finally:
        GDSStorageWriter.prepare_local_plan = real
    out["late_tree"] = tree()
    w.close()
    return out


def test_a_fresh_writer_refused_its_lock_on_another_rank_commits_nothing(tmp_path):
    """Another job holds rank 1's root: a fresh writer's rank 1 learns that it leads it from its
    global plan, fails to lock it in write_data, and writes nothing there; DCP raises on every
    rank (CheckpointLockedError through dcp_errors) and nothing commits. The lock released, the
    next save (the layout kept) cleans rank 0's leftover and commits. A save in which some ranks
    open their roots afresh while others keep theirs is refused on every rank before anything is
    written; the one after opens them on every rank and commits. Re-saving step 1 (rank 1 leads
    a secondary root, and would write beside the committed step there) while rank 1's root is
    held: rank 1 writes nothing there, every rank raises, step 1 stays whole. A root that another writer
    changed after rank 1 probed it (before rank 1 held its lock) is refused: the coordinator
    decided on what rank 1 saw before."""
    res = run_ranks(2, _opening_worker, str(tmp_path), out=tmp_path / "ranks")
    r0, r1 = res
    for x in res:
        assert x["locked"] and x["locked"][0] == "CheckpointLockedError" and "in use" in x["locked"][1], res
        assert x["next"] is None and x["next_tree"] == ["step_000000000000"], res
        assert x["mixed"] and x["mixed"][0] == "GDSWriterError" and "afresh" in x["mixed"][1], res
        assert x["mixed_tree"] == ["step_000000000000"], res
        assert x["after"] is None and x["after_tree"] == ["step_000000000000", "step_000000000001"], res
    assert r1["locked_tree"] == [], r1  # rank 1 made nothing on the root it could not lock
    for x in res:  # rank 1's lock refused: nothing written beside step 1 on its root, the committed step 1 whole
        assert x["resave_locked"] and x["resave_locked"][0] == "CheckpointLockedError", res
        assert [n for n in x["resave_locked_tree"] if not n.startswith(".tmp-step_000000000001-")] == \
            ["step_000000000000", "step_000000000001"], res
        assert x["resave_loaded"] == [0.0, 2999.0], res
    assert r1["resave_locked_tree"] == ["step_000000000000", "step_000000000001"], r1
    assert r1["resave_locked_files"] == ["data-rank1-r1-f0.bin", "primary-id", "primary-root"], r1
    for x in res:  # rank 1's root changed between its probe and its lock: refused, nothing committed
        assert x["late"] and x["late"][0] == "RootUnavailableError" and "changed while" in x["late"][1], res
    assert r1["late_tree"] == ["step_000000000007"], r1
    assert [n for n in r0["late_tree"] if not n.startswith(".tmp-step_000000000000-")] == [], r0
    assert [n for n in r0["locked_tree"] if not n.startswith(".tmp-step_000000000000-")] == [], r0


def _tree(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp-")))


def _node_roots_worker(rank: int, world: int, tmp: str) -> dict:  # noqa: C901
    import errno
    import os
    import shutil
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from gdswriter.distributed import commit, dcp_errors
    from gdswriter.distributed.group import Coordinator
    from gdswriter.errors import EngineIOError
    from support.ranks import caught

    out: dict = {}
    sd = {"rep": torch.arange(2000.0), "blob": b"nodes"}
    fs = [_count_dist_calls(lambda i=i: dcp.save(sd, storage_writer=FileSystemWriter(Path(tmp, f"fs{i}"))))
          for i in range(2)]
    # a root shared by each node's two ranks, node 1's led by rank 2 (a joint root: the last one publishes)
    root = Path(tmp, f"node{rank // 2}")
    w = writer(root)
    calls = [_count_dist_calls(lambda: dcp.save(sd, storage_writer=w)) for _ in range(3)]
    channels = Coordinator.shared_channels()  # before the load (a reader may make its own)
    w.close()
    back = {"rep": torch.zeros(2000), "blob": b""}
    dcp.load(back, storage_reader=reader(root, 2))
    verified = None
    if rank == 0:  # the markers in node 1's step directories confuse no tool
        from gdswriter.cli import main

        verified = main(["verify", str(root), "--secondary", str(Path(tmp, "node1")), "--all"])
    out["nodes"] = {"fs": fs[-1], "calls": calls, "channels": channels, "verified": verified,
                    "ok": torch.equal(back["rep"], sd["rep"]) and back["blob"] == b"nodes", "steps": _tree(root),
                    "markers": sorted(p.name for p in (root / "step_000000000002").iterdir()
                                      if p.name.startswith(commit.JOINED_PREFIX))}

    # re-saving committed step 1: ranks 2 and 3 write beside node 1's step_1, each marking it with the
    # save's token; the one finding both marks publishes it with no rename. No call of the writer's own
    from gdswriter.distributed.dcp import GDSStorageWriter
    from gdswriter.distributed.rankfiles import save_tag

    node1 = Path(tmp, "node1") / "step_000000000001"

    def beside() -> list[str]:  # the saves whose data files (and marks) node 1's step_1 holds
        dist.barrier()
        names = os.listdir(node1)
        dist.barrier()
        return sorted({save_tag(n) for n in names if save_tag(n) is not None} |
                      {n for n in names if n.startswith(commit.JOINED_PREFIX)})

    def load_1() -> bool:
        back = {"rep": torch.zeros(2000), "blob": b""}
        dcp.load(back, storage_reader=reader(root, 1))
        return torch.equal(back["rep"], again["rep"])

    again = {"rep": torch.arange(2000.0) * 3, "blob": b"again"}
    rw = writer(root, step=1)
    resave = {"calls": _count_dist_calls(lambda: dcp.save(again, storage_writer=rw)), "beside": beside(),
              "ok": load_1()}
    # once more, and rank 0's write fails after ranks 2 and 3 wrote beside step 1: step 1 stays as above
    real_write = GDSStorageWriter._write

    def failing(self, *a, **k):
        raise EngineIOError(errno.ENOSPC, "rank0", 0, "write")

    if rank == 0:
        GDSStorageWriter._write = failing
    try:
        resave["failed"] = caught(lambda: dcp.save({"rep": torch.zeros(2000), "blob": b"no"}, storage_writer=rw))
    finally:
        GDSStorageWriter._write = real_write
    resave["beside_failed"], resave["failed_ok"] = beside(), load_1()
    rw.close()
    nw = writer(root, step=3)
    resave["next"] = caught(lambda: dcp.save(sd, storage_writer=nw))  # a fresh writer: cleans beside step 1
    nw.close()
    resave["beside_cleaned"], resave["cleaned_ok"] = beside(), load_1()
    out["resave"] = resave

    # rank 3 fails after rank 2 (sharing its root) wrote its marker: nothing commits, the next save cleans
    froot = Path(tmp, f"fail{rank // 2}")
    fw = writer(froot)

    def late(self, i):
        d = self.dirs[i]
        for _ in range(600):
            if (d / f"{commit.JOINED_PREFIX}2").exists():
                break
            time.sleep(0.05)
        out["saw_marker"] = (d / f"{commit.JOINED_PREFIX}2").exists()
        raise EngineIOError(errno.ENOSPC, str(d), 0, "write")

    def save() -> list[str] | None:
        def run() -> None:
            with dcp_errors():
                dcp.save(sd, storage_writer=fw)
        return caught(run)

    def failing_then_next(method: str, on_rank: int, broken) -> tuple:
        """(the outcome of a save whose ``method`` fails on ``on_rank``, the tree after it, the
        next save's outcome, the tree after that)."""
        real = getattr(commit.OrderedCommit, method)
        if rank == on_rank:
            setattr(commit.OrderedCommit, method, broken)
        try:
            failed = save()
        finally:
            setattr(commit.OrderedCommit, method, real)
        dist.barrier()
        tree = _tree(froot)
        dist.barrier()
        return failed, tree, save(), _tree(froot)

    out["fail_first"] = save()
    out["fail"], out["after_fail"], out["fail_next"], out["after_next"] = failing_then_next("_publish_joint", 3, late)

    # rank 0's commit fails in finish after ranks 2 and 3 published step 2 on their root: the next save cleans it
    def broken(self, *a, **k):
        raise EngineIOError(errno.ENOSPC, str(self.dirs[0]), 0, "write")

    out["finish"], out["after_finish"], out["finish_next"], out["after_finish_next"] = failing_then_next(
        "commit_manifest", 0, broken)
    fw.close()
    back = {"rep": torch.zeros(2000), "blob": b""}
    dcp.load(back, storage_reader=reader(froot, 1))
    out["fail_ok"] = torch.equal(back["rep"], sd["rep"])

    # rank 3's root is a copy of rank 0's (one id, two directories): refused before anything commits
    from gdswriter.distributed.roots import root_identity

    if rank == 0:
        for name in ("orig", "jorig"):
            Path(tmp, name).mkdir()
            root_identity(Path(tmp, name))
        shutil.copytree(Path(tmp, "orig"), Path(tmp, "copy"))
        shutil.copytree(Path(tmp, "jorig"), Path(tmp, "jcopy"))
    dist.barrier()
    mine = Path(tmp, "copy" if rank == 3 else "orig")
    out["copied"] = caught(lambda: dcp.save(sd, storage_writer=writer(mine)))
    out["copied_tree"] = sorted(p.name for p in mine.iterdir() if p.name.startswith("step_"))
    dist.barrier()
    # a joint root copied: ranks 2 and 3 see one id in two directories, led by rank 2 (not the coordinator)
    mine = Path(tmp, "j01") if rank < 2 else Path(tmp, "jcopy" if rank == 3 else "jorig")

    def jsave() -> None:
        with dcp_errors():
            dcp.save(sd, storage_writer=writer(mine))

    out["jcopied"] = caught(jsave)
    dist.barrier()
    out["jcopied_tree"] = sorted(p.name for p in mine.iterdir() if p.name.startswith("step_"))
    out["jcopied_tmp"] = [sorted(os.listdir(p)) for p in mine.iterdir() if p.name.startswith(".tmp-step")]
    return out


@pytest.mark.slow  # about 15 s: 4 spawned ranks
def test_dcp_on_roots_shared_per_node_and_a_copied_root(tmp_path):
    """Four ranks on two "nodes", each node's root shared by its two ranks: node 1's root is led
    by rank 2, whose step directory is published by whichever of ranks 2 and 3 finds both
    ranks' markers in it (commit.py OrderedCommit, joint roots), so every save makes exactly
    FileSystemWriter's torch.distributed calls, none on the writer's coordination channel (before:
    a vote over it on every save), and the checkpoint commits on both roots and loads bit-exact.
    Re-saving committed step 1, ranks 2 and 3 write beside node 1's step_1 under names of the
    save's own, and the one finding both token-tagged marks publishes it with no rename: the same
    calls, bit-exact; a re-save failing on rank 0 after they wrote leaves step 1 as it was, and
    the next save removes every file and mark its manifest does not need.
    Rank 3 failing after rank 2 wrote its marker (a temporary directory left), and rank 0's
    commit failing after node 1's step directory was published (a secondary step_N without a
    committed manifest): every rank raises, nothing commits, the next save cleans the leftovers
    and commits. A root that is a copy of rank 0's (the same id in
    another directory) is refused on the rank that has it, with how to fix it; a copy of rank 2's
    (a joint root) is refused by the coordinator (nobody published it): nothing commits."""
    res = run_ranks(4, _node_roots_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(res):
        nodes = x["nodes"]
        assert nodes["ok"], (rank, x)
        assert nodes["channels"] == 0, (rank, nodes)  # no vote: the coordination channel was never made
        assert nodes["calls"] == [nodes["fs"]] * 3, (rank, nodes)
        assert nodes["steps"] == ["step_000000000000", "step_000000000001", "step_000000000002"], (rank, x)
        assert x["fail_first"] is None and x["fail"] is not None and x["fail_next"] is None, (rank, x)
        assert x["after_next"] == ["step_000000000000", "step_000000000001"], (rank, x)
        assert x["fail_ok"], (rank, x)
        assert x["copied"] is not None and x["copied_tree"] == [], (rank, x)
        assert x["jcopied"] is not None and x["jcopied_tree"] == [], (rank, x)
    assert res[0]["nodes"]["verified"] == 0, res[0]
    assert res[2]["nodes"]["markers"] == [".written-rank-2", ".written-rank-3"], res[2]
    for rank, x in enumerate(res):  # a re-save of step 1, beside it on node 1: FileSystemWriter's calls
        rs = x["resave"]
        assert rs["calls"] == x["nodes"]["fs"] and rs["ok"], (rank, rs)
        assert rs["failed"] is not None and rs["failed_ok"] and rs["next"] is None and rs["cleaned_ok"], (rank, rs)
    rs = res[2]["resave"]
    # step 1's first files and marks, and the re-save's files and token-tagged marks of ranks 2 and 3
    token = next(t for t in rs["beside"] if t and not t.startswith("."))
    assert rs["beside"] == ["", ".written-rank-2", f".written-rank-2.{token}", ".written-rank-3",
                            f".written-rank-3.{token}", token], rs
    # the failed one's: the first files and marks removed by it, its own left beside the step
    failed = next(t for t in rs["beside_failed"] if t not in rs["beside"] and not t.startswith("."))
    assert rs["beside_failed"] == sorted([f".written-rank-2.{failed}", f".written-rank-3.{failed}", failed, token]), rs
    assert rs["beside_cleaned"] == [token], rs  # the next save left only what the committed manifest names
    assert res[3]["saw_marker"] and res[3]["fail"][0] == "EngineIOError", res[3]
    for rank, x in enumerate(res):  # published on node 1, never committed; then cleaned by the next save
        assert x["finish"] is not None and x["finish_next"] is None, (rank, x)
        assert x["after_finish_next"] == ["step_000000000000", "step_000000000001", "step_000000000002"], (rank, x)
    assert res[0]["after_finish"] == ["step_000000000000", "step_000000000001"], res[0]
    assert res[2]["after_finish"] == res[3]["after_finish"] == \
        ["step_000000000000", "step_000000000001", "step_000000000002"], res[2:]
    for rank in (0, 1):
        assert res[rank]["after_fail"] == ["step_000000000000"] or \
            [n for n in res[rank]["after_fail"] if not n.startswith(".tmp-")] == ["step_000000000000"], res[rank]
    # node 1: rank 2's marker is in the temporary directory, nobody published step 1
    assert [n for n in res[2]["after_fail"] if n.startswith("step_")] == ["step_000000000000"], res[2]
    assert "RootUnavailableError" in res[3]["copied"][1] and "same identity" in res[3]["copied"][1], res[3]
    assert res[0]["jcopied"][0] == "RootUnavailableError" and "not published" in res[0]["jcopied"][1], res[0]
    for rank in (2, 3):  # each copy holds a temporary directory with its one rank's marker
        assert [[n for n in t if n.startswith(".written-rank-")] for t in res[rank]["jcopied_tmp"]] == \
            [[f".written-rank-{rank}"]], res[rank]


def _load_rounds_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gdswriter.distributed import dcp_errors
    from support.ranks import caught

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(2 * 300_000, dtype=torch.float32).reshape(2, 300_000)  # 1.2 MB shards
    sd = {"dt": distribute_tensor(full, mesh, [Shard(0)]), "rep": torch.arange(200_000.0)}

    def zeros() -> dict:
        return {"dt": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "rep": torch.zeros(200_000)}

    out: dict = {}
    for name, root in (("shared", Path(tmp, "shared")), ("node_local", Path(tmp, f"node{rank}"))):
        w = writer(root)
        dcp.save(sd, storage_writer=w)
        w.close()
        r = reader(root)
        coord = r.coordinator()
        before = coord.stats.collectives
        back = zeros()
        dcp.load(back, storage_reader=r)
        out[name] = {"own": coord.stats.collectives - before,
                     "ok": torch.equal(back["dt"].to_local(), sd["dt"].to_local()) and torch.equal(back["rep"], sd["rep"])}
    # a byte of what rank 1 wrote (its shard) damaged: rank 1 fails alone, and every rank raises its error
    dist.barrier()
    if rank == 0:
        data = Path(tmp, "shared", "step_000000000000", "data-rank1-r0-f0.bin")
        with open(data, "r+b") as f:
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()

    def damaged() -> None:
        with dcp_errors():
            dcp.load(zeros(), storage_reader=reader(Path(tmp, "shared")))

    out["damaged"] = caught(damaged)
    return out


def test_a_dcp_load_from_one_shared_root_takes_one_round_of_its_own(tmp_path):
    """Issue 25: where every rank names one root, the same one, a dcp.load through
    GDSStorageReader makes one decision round of its own (gather and broadcast: rank 0 sends
    the manifest with the decision) and none in read_data, where each rank reads what it needs
    alone and DCP's own gather of read_data's outcomes tells every rank of a failure: a byte of
    rank 1's shard damaged raises the checksum error on both ranks. Node-local roots still open
    through the full protocol (the root table, the primary, the manifest, the readers of each
    chunk; 17 collectives, and this decision's 2 on top). Before: 16 collectives of its own with one
    shared root too."""
    res = run_ranks(2, _load_rounds_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(res):
        assert x["shared"] == {"own": 2, "ok": True}, (rank, x)
        assert x["node_local"]["ok"] and x["node_local"]["own"] > 2, (rank, x)
        assert x["damaged"] is not None and x["damaged"][0] == "ChecksumMismatchError", (rank, x)


def test_two_ranks_that_both_find_every_mark_on_a_joint_root_publish_it_once(tmp_path, monkeypatch):
    """The race of "the last one publishes" (commit.py OrderedCommit, step 2): ranks 2 and 3
    share a root (rank 2 leads it, rank 0 is P) and both count every mark; rank 3 renames the
    directory between rank 2's count and its rename. Rank 2 then finds the step directory
    published with every mark, fsyncs the root, and reports it published too, without
    failing and without taking the directory for its own (its undo must not remove it). Where
    the directory is gone instead of published, rank 2 raises and publishes nothing."""
    from types import SimpleNamespace

    from gdswriter.distributed.commit import JOINED_PREFIX, OrderedCommit
    from gdswriter.distributed.roots import KnownRoot, RootLayout
    from gdswriter.format.commit import step_dir_name

    root = tmp_path / "node1"
    root.mkdir()
    known = {0: KnownRoot("id-a", str(tmp_path / "node0"), 0, 2), 1: KnownRoot("id-b", str(root), 2, 2)}
    layout = RootLayout(2, 4, (), (root,), ("id-b",), (1,), str(tmp_path / "node0"), known, 2, True)
    rc = OrderedCommit(SimpleNamespace(rank=2), layout, 7, "tok")
    assert rc.joint(0)
    rc.make_dirs()
    tmp, final = rc.dirs[0], root / step_dir_name(7)
    (tmp / f"{JOINED_PREFIX}3").touch()  # rank 3's files there are durable

    def rank_3_renames_first(i: int) -> None:  # between rank 2's count and its rename
        os.rename(tmp, final)

    monkeypatch.setattr(rc, "_check_secondary_final", rank_3_renames_first)
    assert rc.publish_led() == [1]
    assert sorted(p.name for p in final.iterdir() if p.name.startswith(JOINED_PREFIX)) == [
        f"{JOINED_PREFIX}2", f"{JOINED_PREFIX}3"]
    assert final not in rc.renamed
    rc.abort()
    assert final.is_dir()

    # the directory gone instead (removed by another job's cleaning): rank 2 publishes nothing and raises
    import shutil

    from gdswriter.errors import EngineIOError

    rc = OrderedCommit(SimpleNamespace(rank=2), layout, 8, "tok2")
    rc.make_dirs()
    (rc.dirs[0] / f"{JOINED_PREFIX}3").touch()
    monkeypatch.setattr(rc, "_check_secondary_final", lambda i: shutil.rmtree(rc.dirs[0]))
    with pytest.raises(EngineIOError, match="vanished"):
        rc.publish_led()
    assert not (root / step_dir_name(8)).exists()


def _resave_then_elsewhere_worker(rank: int, world: int, tmp: str) -> dict:
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from gdswriter.distributed.rankfiles import save_tag
    from gdswriter.format.commit import root_identity
    from gdswriter.format.sharded import parse_step
    from support.ranks import caught

    node = Path(tmp, f"node{rank}")  # node-local disks: rank 1 leads its own root under each path
    numel = 1 << 19  # 2 MiB
    w = writer(None)
    out: dict = {}

    def save(name: str, value: float) -> list[str] | None:
        return caught(lambda: dcp.save({"rep": torch.full((numel,), value)}, checkpoint_id=node / name,
                                       storage_writer=w))

    def files(name: str) -> list[str]:  # step 1's data files under path ``name`` on this rank's disk
        d = node / name / "step_000000000001"
        return sorted(n for n in os.listdir(d) if save_tag(n) is not None)

    out["first"] = save("P/step-1", 1.0)
    out["resave"] = save("P/step-1", 2.0)  # rank 1 writes beside the committed step_1 on its root under P
    out["after_resave"] = files("P/step-1")
    out["fs_calls"] = _count_dist_calls(lambda: dcp.save({"rep": torch.zeros(numel)},
                                                          storage_writer=FileSystemWriter(node / "fs")))
    result: list = []  # the next save targets another path: DCP's collectives only, as FileSystemWriter's
    out["elsewhere_calls"] = _count_dist_calls(lambda: result.append(save("Q/step-1", 3.0)))
    out["elsewhere"] = result[0]
    out["after_elsewhere"] = files("P/step-1")
    out["q_files"] = files("Q/step-1")
    w.close()
    if rank == 0:  # the names step 1's manifest under P lists on rank 1's root
        m = parse_step((node / "P/step-1/step_000000000001/manifest.json").read_bytes(), "step 1")
        g = next(g for g, info in enumerate(m.dist.roots) if info.id == root_identity(Path(tmp, "node1/P/step-1")).id)
        out["listed"] = sorted(f.path for f in m.files if f.root == g)
    back = {"rep": torch.zeros(numel)}
    out["loaded"] = caught(lambda: dcp.load(back, checkpoint_id=node / "P/step-1", storage_reader=reader(None)))
    out["values"] = [float(back["rep"].min()), float(back["rep"].max())]
    return out


def test_a_resaves_leftovers_go_at_the_next_save_to_another_path(tmp_path):
    """Re-saving step 1 under path P, rank 1 (leading its own root there) writes beside the
    committed files; the replaced ones must go at the writer's next save even when that save
    targets another path Q (they stayed until a writer opened P again), leaving exactly the
    files P's committed manifest names, and P still loads the re-saved values; that save makes
    FileSystemWriter's torch.distributed calls, no more."""
    res = run_ranks(2, _resave_then_elsewhere_worker, str(tmp_path), out=tmp_path / "ranks")
    r0, r1 = res
    for x in res:
        assert x["first"] is None and x["resave"] is None and x["elsewhere"] is None, res
        assert x["loaded"] is None and x["values"] == [2.0, 2.0], res
        assert x["elsewhere_calls"] == x["fs_calls"], res
    assert len(r1["after_resave"]) == 2, r1  # the old file and the re-save's, side by side
    assert r1["after_elsewhere"] == r0["listed"] and len(r0["listed"]) == 1, res
    assert len(r1["q_files"]) == 1, r1
