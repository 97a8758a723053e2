"""GDSCheckpointer under torch.distributed, on real ranks (gloo on CPU): replicated (DDP) state
split across ranks, DTensor/FSDP2 shards written once, one shared root or private per-rank
roots (standing for node-local SSDs), resharding on load (4 -> 2 -> 1 ranks), and failures
(a rank that raises, hangs or is SIGKILLed mid-save)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from support.steps import step_manifest
from support.ranks import run_ranks


# ----------------------------------------------------------------------------- helpers (run in ranks too)
def _options(**kw):
    from support.models import small_options

    return small_options(**kw)


def _ddp_model(seed: int = 0):
    """The same model and optimizer on every rank (as DDP keeps them), one Adam step taken."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(96, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 160))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 96)).sum().backward()
    opt.step()
    return model, opt


def _train(model, opt, seed: int) -> None:
    torch.manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 96)).sum().backward()
    opt.step()


def _tensors(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of a model and its optimizer, full (DTensors gathered), by name."""
    out = {}
    for k, v in model.state_dict().items():
        out[f"model/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{pid}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def _same(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _my_bytes(roots, rank: int, step: int) -> int:
    return sum(f.stat().st_size for r in roots for f in Path(r, f"step_{step:012d}").glob(f"data-rank{rank}-*"))


def _cli(capsys, *args: str) -> tuple[int, str]:
    """The gdswriter command, in this process: (exit status, stdout)."""
    from gdswriter.cli import main

    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().out


def _roots(tmp: Path, world: int, private: bool) -> list:
    return [str(tmp / f"node{r}") for r in range(world)] if private else [str(tmp / "shared")] * world


# ----------------------------------------------------------------------------- DDP: replicated state
def _ddp_worker(rank: int, world: int, roots: list[str], out: str) -> dict:
    from gdswriter import GDSCheckpointer

    model, opt = _ddp_model()
    mine = {"count": torch.full((5,), float(rank)), "note": f"rank {rank}"}  # rank-local: not replicated
    ck = GDSCheckpointer(model, opt, root=roots[rank], state={"mine": mine}, options=_options(keep_last=2))
    ck.save(1)
    at1 = _tensors(model, opt)
    _train(model, opt, 1)
    ck.save_async(2).result()
    at2 = _tensors(model, opt)
    mine["count"] += 100
    _train(model, opt, 2)
    ck.save(3)  # keep_last=2 drops step 1 on every root
    at3 = _tensors(model, opt)
    written = _my_bytes({roots[rank]}, rank, 3)
    if rank == 0:
        torch.save({"at2": at2, "at3": at3}, Path(out, "expected.pt"))
    _train(model, opt, 3)
    mine["count"].zero_()
    ck.load(2)
    diff2 = _same(_tensors(model, opt), at2)
    count2 = mine["count"].tolist()
    ck.load()
    diff3 = _same(_tensors(model, opt), at3)
    result = {"bytes": written, "steps": ck.steps(), "latest": ck.latest_step(), "diff2": diff2, "diff3": diff3,
              "count2": count2, "count3": mine["count"].tolist(), "at1_differs": bool(_same(at1, at3))}
    ck.close()
    return result


def _check_ddp(res: list[dict], world: int, roots: list[str], out: Path, capsys) -> None:
    from gdswriter import GDSCheckpointer

    for r, x in enumerate(res):
        assert x["diff2"] == [] and x["diff3"] == [], (r, x)
        assert x["steps"] == [2, 3] and x["latest"] == 3
        assert x["count2"] == [float(r)] * 5 and x["count3"] == [float(r) + 100] * 5, "rank-local state is per rank"
    written = [x["bytes"] for x in res]
    assert max(written) / (sum(written) / world) <= 1.05, written  # each rank wrote about 1/N
    distinct = list(dict.fromkeys(roots))
    for root in distinct:
        assert not (Path(root) / "step_000000000001").exists(), "retention removed step 1 on every root"
        assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    m = step_manifest(distinct, 3)
    assert m.version == (1, 3) and m.dist.world_size == world and len(m.dist.roots) == len(distinct)
    assert sorted({f.info["rank"] for f in m.files}) == list(range(world))
    for f in m.files:  # every rank writes only on its own roots
        assert world in m.dist.roots[f.root].ranks or f.info["rank"] in m.dist.roots[f.root].ranks
    assert sorted(m.dist.rank_states) == list(range(1, world)), "only the rank-local entries are kept per rank"
    # one process (no process group) loads the multi-rank step: rank 0's own state, the replicated model
    expected = torch.load(out / "expected.pt")
    model, opt = _ddp_model(seed=5)
    mine = {"count": torch.zeros(5), "note": ""}
    with GDSCheckpointer(model, opt, root=distinct, state={"mine": mine}, options=_options()) as ck:
        assert ck.load() == 3
    assert _same(_tensors(model, opt), expected["at3"]) == []
    assert mine == {"count": mine["count"], "note": "rank 0"} and mine["count"].tolist() == [100.0] * 5
    # the gdswriter command lists, inspects, verifies and exports it like any other
    sec = [a for r in distinct[1:] for a in ("--secondary", r)]
    assert "latest" in _cli(capsys, "ls", distinct[0])[1]
    rc, text = _cli(capsys, "verify", distinct[0], *sec, "--all")
    assert rc == 0 and "2 of 2 steps intact" in text, text
    doc = json.loads(_cli(capsys, "inspect", distinct[0], *sec, "--json")[1])
    assert doc["version"] == "1.3" and len(doc["files"]) == world  # one file per rank (one root each)
    assert _cli(capsys, "export", distinct[0], *sec, "--to", "safetensors", str(out / "x.safetensors"))[0] == 0


def test_ddp_replicated_state_two_ranks_one_shared_root(tmp_path, capsys):
    roots = _roots(tmp_path, 2, private=False)
    res = run_ranks(2, _ddp_worker, roots, str(tmp_path), out=tmp_path / "ranks")
    _check_ddp(res, 2, roots, tmp_path, capsys)


def test_ddp_replicated_state_four_ranks_node_local_roots(tmp_path, capsys):
    """Each rank has a private root (another node's SSD): it cannot see the others' files, so
    loading sends every rank the chunks it cannot read from the rank that wrote them."""
    roots = _roots(tmp_path, 4, private=True)
    res = run_ranks(4, _ddp_worker, roots, str(tmp_path), out=tmp_path / "ranks")
    _check_ddp(res, 4, roots, tmp_path, capsys)
    for r, root in enumerate(roots):
        names = {f.name for f in Path(root, "step_000000000003").iterdir()}
        assert all(n.startswith(f"data-rank{r}-") for n in names if n.startswith("data-")), names


# ----------------------------------------------------------------------------- FSDP2 / DTensor: resharding
TP_FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def _fsdp_model(world: int, seed: int):
    from support.models import fsdp_mlp

    return fsdp_mlp(world, seed)


def _fsdp_save_worker(rank: int, world: int, root: str, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gdswriter import GDSCheckpointer

    model, opt, _ = _fsdp_model(world, seed=0)
    _train(model, opt, 1)
    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    tp = {"w": distribute_tensor(TP_FULL, mesh2d, [Replicate(), Shard(1)])}  # a TP shard, replicated over dp
    with GDSCheckpointer(model, opt, root=root, state={"tp": tp}, options=_options()) as ck:
        ck.save(10)
    full = _tensors(model, opt)
    if rank == 0:
        torch.save(full, Path(out, "expected10.pt"))
    return {"local": list(model[2].weight.to_local().shape)}


def _fsdp_reload_worker(rank: int, world: int, root: str, out: str) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    from gdswriter import GDSCheckpointer

    model, opt, mesh = _fsdp_model(world, seed=7)  # other values, a fresh optimizer without state
    tp = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)])}  # another mesh and placement
    with GDSCheckpointer(model, opt, root=root, state={"tp": tp}, options=_options()) as ck:
        ck.load(10)
        diff = _same(_tensors(model, opt), torch.load(Path(out, "expected10.pt")))
        tp_ok = torch.equal(tp["w"].full_tensor(), TP_FULL)
        _train(model, opt, 11)  # the restored optimizer steps on
        ck.save(20)
    full = _tensors(model, opt)
    if rank == 0:
        torch.save(full, Path(out, "expected20.pt"))
    return {"diff": diff, "tp": tp_ok, "local": list(model[2].weight.to_local().shape)}


def test_fsdp2_and_dtensor_reshard_4_to_2_to_1(tmp_path):
    """FSDP2 (fully_shard on a CPU mesh) saved on 4 ranks, loaded and saved again on 2, loaded in
    one process into a plain model; a 2-D-mesh DTensor (Shard over tp, Replicate over dp) is
    written once per replica group and comes back on a 1-D mesh, then whole."""
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import load_state

    root = str(tmp_path / "shared")
    res4 = run_ranks(4, _fsdp_save_worker, root, str(tmp_path), out=tmp_path / "r4")
    assert [x["local"] for x in res4] == [[18, 256]] * 3 + [[16, 256]]
    m = step_manifest(tmp_path / "shared", 10)
    tp_blocks = [t for t in m.tensors if t.name == "extra/tp/w"]
    assert sorted(t.shard.offsets for t in tp_blocks) == [(0, 0), (0, 3)], "one block per replica group"
    weight = sorted((t.shard.offsets, t.shape) for t in m.tensors if t.name == "model/2.weight")
    assert weight == [((0, 0), (18, 256)), ((18, 0), (18, 256)), ((36, 0), (18, 256)), ((54, 0), (16, 256))]

    res2 = run_ranks(2, _fsdp_reload_worker, root, str(tmp_path), out=tmp_path / "r2")
    assert all(x["diff"] == [] and x["tp"] for x in res2), res2
    assert [x["local"] for x in res2] == [[35, 256]] * 2

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.ReLU(), torch.nn.Linear(256, 70))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tp = {"w": torch.zeros(8, 6)}
    with GDSCheckpointer(model, opt, root=root, state={"tp": tp}, options=_options()) as ck:
        assert ck.load() == 20
    expected = torch.load(tmp_path / "expected20.pt")
    assert _same(_tensors(model, opt), expected) == []
    assert torch.equal(tp["w"], TP_FULL)
    step, state = load_state(root)  # no live objects: every sharded tensor whole
    assert step == 20 and torch.equal(state["model"]["2.weight"], expected["model/2.weight"])
    assert torch.equal(state["extra"]["tp"]["w"], TP_FULL)


# ----------------------------------------------------------------------------- failures mid-save
def _failure_worker(rank: int, world: int, roots: list[str], out: str, timeout: float) -> dict:
    import gdswriter.distributed.save as save_mod
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions
    from gdswriter.errors import EngineIOError

    model, opt = _ddp_model()
    ck = GDSCheckpointer(model, opt, root=roots[rank], options=_options(),
                         dist_options=DistOptions(timeout_s=timeout))
    ck.save(1)
    original = save_mod.write_snapshot_files

    def out_of_space(*a, **k):
        if rank == 1:
            raise EngineIOError(errno.ENOSPC, f"{roots[rank]}/data-rank1-r1-f0.bin", 0, "write")
        return original(*a, **k)

    def killed_after_writing(*a, **k):
        crcs = original(*a, **k)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # its files are durable; it never votes
        return crcs

    result: dict = {}
    save_mod.write_snapshot_files = out_of_space
    try:
        ck.save(2)
    except Exception as e:  # noqa: BLE001 - the test looks at what each rank got
        result["raised"] = [type(e).__name__, str(e)]
    save_mod.write_snapshot_files = original
    result["steps_after_raise"] = ck.steps()
    result["tmp_after_raise"] = sorted(n for n in os.listdir(roots[rank]) if n.startswith(".tmp-"))
    _train(model, opt, 1)
    ck.save(3)  # a rank that raised leaves the job able to save again
    if rank == 0:
        torch.save(_tensors(model, opt), Path(out, "expected3.pt"))
    save_mod.write_snapshot_files = killed_after_writing
    _train(model, opt, 2)
    start = time.monotonic()
    try:
        ck.save(4)
    except Exception as e:  # noqa: BLE001
        result["killed"] = [type(e).__name__, str(e)]
    result["seconds"] = time.monotonic() - start
    result["steps_after_kill"] = ck.steps()
    ck.close()
    return result


def test_rank_raising_then_rank_killed_mid_save(tmp_path):
    """A rank that raises mid-save: every rank gets a typed error, nothing commits, the next
    save works. A rank SIGKILLed mid-save: the survivor gets CollectiveFailedError at once (the
    peer's connections close), step 3 stays the latest, and the next open removes the leftovers."""
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions, open_session
    from gdswriter.distributed.group import Coordinator

    roots = _roots(tmp_path, 2, private=True)
    res = run_ranks(2, _failure_worker, roots, str(tmp_path), 60.0, out=tmp_path / "ranks", killed=(1,))
    r0, r1 = res[0], res[1]
    assert r1 is None
    assert r0["raised"][0] == "RankFailedError" and "rank 1: EngineIOError" in r0["raised"][1], r0["raised"]
    assert r0["steps_after_raise"] == [1] and r0["tmp_after_raise"] == []
    assert r0["killed"][0] == "CollectiveFailedError", r0["killed"]
    assert r0["seconds"] < 30, "a dead rank is noticed when its connections close, well within the timeout"
    assert r0["steps_after_kill"] == [1, 3]
    assert (Path(roots[0]) / "latest").read_text() == "3\n"
    leftovers = [n for n in os.listdir(roots[1]) if n.startswith(".tmp-step_000000000004")]
    assert leftovers, "the killed rank's durable files are still in its temporary directory"
    # as if it had died after publishing its secondary directory: a step_4 without a primary manifest
    shutil.copytree(Path(roots[1], leftovers[0]), Path(roots[1], "step_000000000004"))
    session = open_session([Path(r) for r in roots], Coordinator.solo(), DistOptions())  # the next open
    session.lock.release()
    assert sorted(os.listdir(roots[1])) == [".gdswriter-root", ".gdswriter.lock", "step_000000000001",
                                            "step_000000000003"]
    model, opt = _ddp_model(seed=9)
    with GDSCheckpointer(model, opt, root=roots, options=_options()) as ck:
        assert ck.steps() == [1, 3] and ck.load() == 3
    assert _same(_tensors(model, opt), torch.load(tmp_path / "expected3.pt")) == []


def _hang_worker(rank: int, world: int, root: str, timeout: float) -> dict:
    import gdswriter.distributed.save as save_mod
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    model, opt = _ddp_model()
    ck = GDSCheckpointer(model, opt, root=root, options=_options(), dist_options=DistOptions(timeout_s=timeout))
    ck.save(1)
    original = save_mod.write_snapshot_files

    def stuck(*a, **k):
        if rank == 1:
            time.sleep(3 * timeout)  # a hung rank (a stuck disk, a dead NFS server...)
        return original(*a, **k)

    save_mod.write_snapshot_files = stuck
    start = time.monotonic()
    errors = []
    for _ in range(2):  # the second save fails at once: the coordination group is known broken
        try:
            ck.save(2)
        except Exception as e:  # noqa: BLE001
            errors.append([type(e).__name__, round(time.monotonic() - start, 1)])
    ck.close()
    return {"errors": errors, "steps": ck.steps()}


@pytest.mark.slow  # about 13 s: ranks wait out their collective timeouts
def test_hung_rank_times_out(tmp_path):
    timeout = 3.0
    root = str(tmp_path / "shared")
    res = run_ranks(2, _hang_worker, root, timeout, out=tmp_path / "ranks")
    (name, first), (name2, second) = res[0]["errors"]
    assert name == name2 == "CollectiveFailedError", res
    assert timeout - 0.5 <= first < 2 * timeout + 5 and second - first < 1, res
    assert [e[0] for e in res[1]["errors"]] == ["CollectiveFailedError"] * 2, res
    assert res[0]["steps"] == [1] and (Path(root) / "latest").read_text() == "1\n"


# ----------------------------------------------------------------------------- fallback and atomic loads
def _fallback_state(rank: int, seed: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(512, 640)  # 1.25 MiB of weights: above every small-copy threshold
    mine = {"count": torch.full((300_000,), float(rank * 1000 + seed))}  # rank-local (1.2 MB), saved per rank
    return model, mine


def _values(model: torch.nn.Module, mine: dict) -> dict[str, torch.Tensor]:
    return {**{f"model/{k}": v.clone() for k, v in model.state_dict().items()}, "count": mine["count"].clone()}


def _flip(root: Path, step: int, tensors: set[int] | None = None, name: str | None = None) -> str:
    """Flip one byte of step ``step``'s data: in the first chunk of a tensor of index in
    ``tensors``, or of the tensor named ``name``; returns the damaged file."""

    d = root / f"step_{step:012d}"
    m = step_manifest(root, step)
    i = next(i for i, t in enumerate(m.tensors) if (tensors is not None and i in tensors) or t.name == name)
    c = next(c for c in m.storages[m.tensors[i].storage].chunks if c.length)
    path = d / m.files[c.file].path
    with open(path, "r+b") as f:
        f.seek(c.file_offset)
        b = f.read(1)
        f.seek(c.file_offset)
        f.write(bytes([b[0] ^ 0xFF]))
    return str(path)


def _fallback_worker(rank: int, world: int, root: str, out: str) -> dict:
    import logging

    import torch.distributed as dist

    from gdswriter import GDSCheckpointer
    from gdswriter.format.assembly import tree_for_rank
    from gdswriter.format.state_codec import tensor_refs

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gdswriter").addHandler(handler)
    model, mine = _fallback_state(rank, 1)
    ck = GDSCheckpointer(model, None, root=root, state={"mine": mine}, options=_options())
    ck.save(1)
    at1 = _values(model, mine)
    fresh, fresh_mine = _fallback_state(rank, 2)
    model.load_state_dict(fresh.state_dict())
    mine["count"].copy_(fresh_mine["count"])
    ck.save(2)
    res: dict = {}
    dist.barrier()
    if rank == 0:  # damage a tensor only rank 1 saved and loads: only rank 1 finds it
        m = step_manifest(root, 2)
        n = len(m.tensors)
        only1 = set(tensor_refs(tree_for_rank(m, 1), n)) - set(tensor_refs(tree_for_rank(m, 0), n))
        res["damaged"] = _flip(Path(root), 2, tensors=only1)
    dist.barrier()
    sentinel, sentinel_mine = _fallback_state(rank, 3)
    model.load_state_dict(sentinel.state_dict())
    mine["count"].copy_(sentinel_mine["count"])
    res["fallback"] = ck.load(fallback=True, atomic=True)
    res["damaged_steps"] = list(ck.last_load.damaged)
    res["atomic"] = ck.last_load.atomic
    res["equal_at1"] = _same(_values(model, mine), at1)
    res["warnings"] = [r for r in records if "damaged" in r]
    dist.barrier()
    if rank == 0:  # now the shared model weight too: both ranks find damage
        _flip(Path(root), 2, name="model/weight")
    dist.barrier()
    model.load_state_dict(sentinel.state_dict())
    mine["count"].copy_(sentinel_mine["count"])
    before = _values(model, mine)
    try:
        ck.load(atomic=True)
        res["atomic_load"] = "loaded"
    except Exception as e:  # noqa: BLE001
        res["atomic_load"] = type(e).__name__
    res["untouched"] = _same(_values(model, mine), before)
    res["fallback2"] = ck.load(fallback=True)
    res["equal_at1_2"] = _same(_values(model, mine), at1)
    if rank == 0:
        torch.save(at1, Path(out, "at1.pt"))
    ck.close()
    return res


def test_fallback_and_atomic_loads_of_a_multi_rank_checkpoint(tmp_path, caplog):
    """Issue 22, 7: load(fallback=True) and atomic= were ignored for multi-rank checkpoints (a
    damaged latest step raised ChecksumMismatchError). On 2 ranks, damage only one rank sees
    makes every rank fall back to the same intact step, with the warning; a damaged step loaded
    with atomic=True leaves every live tensor untouched. In one process, the same."""
    import logging

    from gdswriter import ChecksumMismatchError, GDSCheckpointer

    root = tmp_path / "shared"
    res = run_ranks(2, _fallback_worker, str(root), str(tmp_path), out=tmp_path / "ranks")
    for r, x in enumerate(res):
        assert x["fallback"] == 1 and x["damaged_steps"] == [2] and x["atomic"], (r, x)
        assert x["equal_at1"] == [], (r, x)
        assert any("step 2" in w and "trying an older step" in w for w in x["warnings"]), (r, x)
        assert any("loaded step 1, the newest intact step" in w for w in x["warnings"]), (r, x)
        assert x["atomic_load"] in ("ChecksumMismatchError", "RankFailedError"), (r, x)
        assert x["untouched"] == [], (r, x)
        assert x["fallback2"] == 1 and x["equal_at1_2"] == [], (r, x)
    assert "rank1" in res[0]["damaged"], "the damage was in a file only rank 1 reads"
    at1 = torch.load(tmp_path / "at1.pt")
    # one process: rank 0's state of the newest intact step
    model, mine = _fallback_state(0, 3)
    with GDSCheckpointer(model, None, root=root, state={"mine": mine}, options=_options()) as ck:
        before = _values(model, mine)
        with pytest.raises(ChecksumMismatchError):
            ck.load(atomic=True)
        assert _same(_values(model, mine), before) == []
        with caplog.at_level(logging.WARNING, logger="gdswriter"):
            assert ck.load(fallback=True, atomic=True) == 1
        assert ck.last_load.damaged == (2,) and ck.last_load.step == 1 and ck.last_load.atomic
        assert _same(_values(model, mine), at1) == []
        assert "step 2 under" in caplog.text and "checksum mismatch" in caplog.text, caplog.text
        assert "loaded step 1, the newest intact step" in caplog.text, caplog.text
        # the latest manifest itself damaged: the one-process load still finds the multi-rank step 1
        Path(root, "step_000000000002", "manifest.json").write_text("{")
        model.load_state_dict(_fallback_state(0, 3)[0].state_dict())
        assert ck.load(fallback=True) == 1 and ck.last_load.damaged == (2,)
        assert _same(_values(model, mine), at1) == []
