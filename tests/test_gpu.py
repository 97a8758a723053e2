"""CUDA tensors through the fallback engine (pinned staging buffers). Skipped without a GPU;
run on a GPU machine with scripts/gpu_check.sh."""

import pytest
import torch

from gdswriter import EngineOptions, GDSCheckpointer, ReadSpan, WriteSpan, create_engine
from gdswriter.checkpointer import CheckpointOptions

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = EngineOptions(buffer_bytes=1 << 20, request_bytes=256 << 10, num_buffers=3)


@pytest.mark.parametrize("n", [1, 4095, 4097, (5 << 20) + 3])
def test_engine_round_trips_cuda_tensors(tmp_path, n):
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    with create_engine(SMALL) as eng:
        assert eng.info.page_locked
        crc_w = eng.write_file(tmp_path / "f", [WriteSpan(4096, src)])
        out = torch.empty_like(src)
        crc_r = eng.read_file(tmp_path / "f", [ReadSpan(4096, out)])
    assert crc_w == crc_r
    assert torch.equal(out, src)


def test_checkpointer_saves_and_loads_cuda_model_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with GDSCheckpointer(model, opt, root=tmp_path, options=CheckpointOptions(engine=SMALL)) as ck:
        ck.save(1)
        h = ck.save_async(2)
        h.wait_snapshotted()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # an edit outside optimizer.step(): allowed once the save is snapshotted
        h.result()
        ck.load(2)
    for k, v in model.state_dict().items():
        assert v.is_cuda and v.data_ptr() == ptrs[k]
        assert torch.equal(v, ref[k]), k
    assert all(s["exp_avg"].is_cuda for s in opt.state.values())
