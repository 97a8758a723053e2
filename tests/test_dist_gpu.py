"""Multi-rank checkpoints of GPU memory (skipped without CUDA): two ranks share one GPU (gloo
coordinates; NCCL would need a GPU per rank), save a replicated CUDA model with GDSCheckpointer
and CUDA tensors through DCP, and load them back into CUDA tensors, on 2 ranks and in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.ranks import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.Linear(4096, 33)).cuda()


def _gpu_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter

    torch.cuda.set_device(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256, device="cuda")).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({k: v.cpu() for k, v in want.items()}, Path(root).parent / "trained.pt")
    with GDSCheckpointer(model, opt, root=root) as ck:
        ck.save(1)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        ck.load()
    same = all(torch.equal(v, want[k]) and v.is_cuda for k, v in model.state_dict().items())
    sd = {"w": torch.arange(3 * 4099, dtype=torch.float16, device="cuda").reshape(3, 4099), "n": 5}
    dcp.save(sd, storage_writer=GDSStorageWriter(Path(root) / "dcp", 2))
    back = {"w": torch.zeros(3, 4099, dtype=torch.float16, device="cuda"), "n": 0}
    dcp.load(back, storage_reader=GDSStorageReader(Path(root) / "dcp", 2))
    return {"model": same, "dcp": bool(torch.equal(back["w"], sd["w"])) and back["n"] == 5}


def test_two_ranks_save_and_load_gpu_memory(tmp_path):
    from gdswriter import GDSCheckpointer

    root = str(tmp_path / "shared")
    res = run_ranks(2, _gpu_worker, root, out=tmp_path / "ranks")
    assert all(x["model"] and x["dcp"] for x in res), res
    model = _model()
    with GDSCheckpointer(model, None, root=root) as ck:  # one process reads the 2-rank step into CUDA
        ck.load()
    want = torch.load(tmp_path / "trained.pt")
    assert all(torch.equal(v.cpu(), want[k]) and v.is_cuda for k, v in model.state_dict().items())
