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


# --- GPU-direct work (issue 12): every engine on a CUDA model, the manifest's per-file engine,
# the fallback's cudaHostRegister'ed pool, and `gdswriter verify` on what the GPU checksummed.
def _kvikio_missing() -> bool:
    from gdswriter.engines.kvikio import import_kvikio
    from gdswriter.errors import EngineUnavailableError

    try:
        import_kvikio()
        return False
    except EngineUnavailableError:
        return True


@pytest.mark.parametrize("engine", ["auto", "io_uring", "kvikio"])
def test_cuda_model_through_every_engine_verifies(tmp_path, engine):
    from gdswriter.cli import main
    from gdswriter.engines.kvikio import gds_status
    from gdswriter.format.commit import CommitProtocol
    from gdswriter.load.reader import read_manifest

    if engine == "kvikio" and _kvikio_missing():
        pytest.skip("KvikIO is not installed")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.LayerNorm(4096),
                                torch.nn.Linear(4096, 333)).cuda().to(torch.bfloat16)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    opts = CheckpointOptions(engine=EngineOptions.from_env(engine=engine))
    with GDSCheckpointer(model, None, root=tmp_path, options=opts) as ck:
        info = ck.engine_info
        ck.save(1)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0)
        ck.load(1)
        if info.cuda_path == "staged":
            pool = ck.engines[0]._pool
            assert pool.cuda_pinned, "the staging pool must be cudaHostRegister'ed on a GPU machine"
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    names = {f.info["engine"] for f in read_manifest(CommitProtocol([tmp_path]), 1).files}
    if engine == "kvikio":
        assert info.cuda_path == gds_status().mode and names <= {"gds", "kvikio-compat"}
    else:
        assert info.cuda_path == ("gds" if info.gpu_direct else "staged")
    print(f"\n{engine}: engine {info.name}, CUDA path {info.cuda_path}, files by {sorted(names)}; {info.reason}")
    assert main(["verify", str(tmp_path)]) == 0


def test_staging_buffers_are_registered_at_the_first_cuda_tensor_only(tmp_path):
    """CPU tensors never register the pool with CUDA; the first CUDA tensor does (portable)."""
    with create_engine(SMALL) as eng:
        host = torch.randint(0, 256, ((3 << 20) + 5,), dtype=torch.uint8)
        eng.write_file(tmp_path / "cpu", [WriteSpan(0, host)])
        eng.read_file(tmp_path / "cpu", [ReadSpan(0, torch.empty_like(host))])
        pool = eng._pool  # built by the first staged transfer (the write)
        assert not pool.cuda_pinned
        src = host.cuda()
        eng.write_file(tmp_path / "gpu", [WriteSpan(0, src)])
        assert pool.cuda_pinned and pool.cuda_device == src.device
        out = torch.empty_like(src)
        eng.read_file(tmp_path / "gpu", [ReadSpan(0, out)])
        assert torch.equal(out, src)


def test_every_gpu_through_an_engine_created_on_another_thread(tmp_path):
    """An engine made on a background thread (where device 0 is current) serves tensors on every
    GPU: registration happens with the first CUDA tensor's device current and is portable."""
    import threading

    made = {}
    t = threading.Thread(target=lambda: made.setdefault("eng", create_engine(SMALL)))
    t.start()
    t.join()
    eng = made["eng"]
    try:
        last = torch.cuda.device_count() - 1
        for d in range(last, -1, -1):  # the highest device first: it is the one registered with
            src = torch.randint(0, 256, ((3 << 20) + 5,), dtype=torch.uint8, device=f"cuda:{d}")
            crc_w = eng.write_file(tmp_path / f"d{d}", [WriteSpan(4096, src)])
            out = torch.empty_like(src)
            assert eng.read_file(tmp_path / f"d{d}", [ReadSpan(4096, out)]) == crc_w
            assert torch.equal(out, src), f"cuda:{d}"
        assert eng._pool.cuda_device == torch.device("cuda", last)
    finally:
        eng.close()


_CPU_JOB = """
import sys, torch
from gdswriter import GDSCheckpointer
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 256)).sum().backward()
opt.step()
with GDSCheckpointer(model, opt, root=sys.argv[1]) as ck:
    ck.save(1)
    ck.load(1)
print("INITIALIZED", torch.cuda.is_initialized())
"""


def test_cpu_only_job_on_a_gpu_machine_never_initialises_cuda(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _CPU_JOB, str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "INITIALIZED False" in r.stdout, r.stdout
