"""save_async of CUDA state while training goes on: events, side streams, the pinned host pool,
the stream-ordered optimizer pre-hook. Skipped without a GPU; run with scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gdswriter import CheckpointOptions, EngineOptions, GDSCheckpointer, load_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = EngineOptions(buffer_bytes=1 << 20, request_bytes=256 << 10, num_buffers=3)


def build(device="cuda"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.BatchNorm1d(2048), nn.GELU(), nn.Linear(2048, 1023)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, n):
    for _ in range(n):
        x = torch.randn(64, 1024, device=next(model.parameters()).device)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt):
    out = {f"model/{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        out.update({f"opt/{pid}/{k}": v.detach().cpu().clone() for k, v in st.items()})
    return out


def saved(root, step):
    _, st = load_state(root, step)
    out = {f"model/{k}": v for k, v in st["model"].items()}
    for pid, s in st["optimizer"]["state"].items():
        out.update({f"opt/{pid}/{k}": v for k, v in s.items()})
    return out


@pytest.mark.parametrize("mode", ["host", "live"])
@pytest.mark.parametrize("side", [False, True], ids=["default-stream", "training-on-a-side-stream"])
@pytest.mark.parametrize("bound", [None, 4 << 20], ids=["pool-holds-state", "pool-smaller-than-state"])
def test_training_right_after_save_async_does_not_reach_the_saved_step(tmp_path, mode, side, bound):
    model, opt = build()
    train(model, opt, 1)
    want = snapshot(model, opt)
    extra = {} if bound is None else {"snapshot_pool_bytes": bound}
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    with torch.cuda.stream(stream), GDSCheckpointer(model, opt, tmp_path, options=CheckpointOptions(
            engine=SMALL, snapshot=mode, **extra)) as ck:
        h = ck.save_async(1)
        train(model, opt, 5)  # the pre-hook orders each step after the save released the tensors
        assert h.result(timeout=120) == 1
        if mode == "host":
            assert ck.snapshot_pool._pinned is not None, "the pool is registered with CUDA"
    got = saved(tmp_path, 1)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_pool_is_pinned_at_its_exact_size_and_reused(tmp_path):
    model, opt = build()
    train(model, opt, 1)
    with GDSCheckpointer(model, opt, tmp_path, options=CheckpointOptions(engine=SMALL, snapshot="host")) as ck:
        ck.save(1)
        pool = ck.snapshot_pool
        nbytes = sum(v.numel() * v.element_size() for v in snapshot(model, opt).values())
        first = (pool.address, pool.capacity)
        assert nbytes <= pool.capacity < nbytes + (4 << 20), "no power-of-two rounding of pinned memory"
        for s in range(2, 5):
            train(model, opt, 1)
            ck.save_async(s)
        ck.wait()
        assert (pool.address, pool.capacity) == first


def test_manual_edit_after_wait_snapshotted(tmp_path):
    model, opt = build()
    train(model, opt, 1)
    want = snapshot(model, opt)
    with GDSCheckpointer(model, opt, tmp_path, options=CheckpointOptions(engine=SMALL)) as ck:
        h = ck.save_async(1)
        assert h.wait_snapshotted(timeout=120)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # allowed once snapshotted
        h.result(timeout=120)
    got = saved(tmp_path, 1)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("mode", ["host", "live"])
def test_state_on_two_gpus(tmp_path, mode):
    a = torch.randn(1 << 20, device="cuda:0")
    b = torch.randn(1 << 20, device="cuda:1")
    want = {"a": a.cpu(), "b": b.cpu()}
    with GDSCheckpointer({"a": a, "b": b}, None, tmp_path, options=CheckpointOptions(engine=SMALL, snapshot=mode)) as ck:
        h = ck.save_async(1)
        h.wait_snapshotted()
        a.fill_(1.0)
        b.fill_(2.0)
        h.result(timeout=120)
    _, st = load_state(tmp_path)
    assert torch.equal(st["model"]["a"], want["a"]) and torch.equal(st["model"]["b"], want["b"])
