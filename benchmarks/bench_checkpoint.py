"""Durable checkpoint save and cold load: gdswriter vs torch.save, DCP and safetensors.

Goals (issue): gdswriter save >= 0.9x the engine's raw write bandwidth (bench_engine's
"gdswriter io_uring" write of the same size), >= 3x torch.save, >= 1.7x DCP with 4
threads; gdswriter load at least as fast as the fastest of torch.load / dcp.load /
safetensors.load_file.

State: a stack of nn.Linear layers (about 64 MiB of fp32 weight each; smaller for small
sizes) plus AdamW state after one optimizer step, so params + exp_avg + exp_avg_sq ~= size.
Bytes = the tensor bytes of model.state_dict() + optimizer state (what every format stores).

Save cases (each round writes a fresh checkpoint; the previous one is removed, outside the
timed region; state_dict() collection is inside it for every case):
  torch.save              torch.save(state, f) + f.flush() + os.fsync
  dcp.save t1 / t4        torch.distributed.checkpoint.save(..., FileSystemWriter(thread_count=1|4,
                          sync_files=True)), single process, no process group
  safetensors.save_file   flat dict of model + optimizer tensors (param_groups as JSON metadata) + fsync
  gdswriter.save          GDSCheckpointer.save(step): durable and committed when it returns
Load cases (before each round: sync, wait GDSWRITER_BENCH_SETTLE_S seconds (default 5) so that
the device has finished the preceding writes, then evict every file of the checkpoint from the
page cache):
  torch.load              torch.load(weights_only=True, mmap=False) + model/optimizer.load_state_dict
  dcp.load                dcp.load in place into {model, optimizer} state dicts + optimizer.load_state_dict
                          (reads the "dcp.save t4" checkpoint)
  safetensors.load_file   load_file (mmap-backed) + copy into the live model and optimizer tensors
  gdswriter.load          GDSCheckpointer.load(step) into the live model/optimizer
"""

from __future__ import annotations

import gc

import pytest

import _util
from _util import RESULTS, RoundTimer, finish, ratio

from gdswriter import CheckpointOptions, EngineOptions, GDSCheckpointer
from gdswriter.tools.bench import Canary, build_state, plan_layers, state_bytes
from gdswriter.tools.bench import Methods as Formats

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SUITE = "checkpoint"
SAVES = {"torch": "torch.save", "dcp1": "dcp.save t1", "dcp4": "dcp.save t4",
         "safetensors": "safetensors.save_file", "gdswriter": "gdswriter.save"}
LOADS = {"torch": "torch.load", "dcp": "dcp.load", "safetensors": "safetensors.load_file",
         "gdswriter": "gdswriter.load"}
# Run order: each reference's save then its load, gdswriter last (so its ratios can be
# computed in-test); a checkpoint is deleted after its load, so disk holds about one at a time.
_FAMILY = ["torch", "dcp1", "dcp4", "dcp", "safetensors", "gdswriter"]
ENGINE_RAW = ("engine", "write", "gdswriter io_uring")


def bench_sort_key(item):
    case = item.callspec.params["case"]
    return (_FAMILY.index(case), 0 if item.originalname == "test_save" else 1)


# The state (build_state, state_bytes, plan_layers), the load check (Canary) and how each
# format saves and loads (Formats) live in gdswriter/tools/bench.py, shared with `gdswriter bench`.


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def trained(size, workdir):
    # Live state (1x) + a loaded copy (torch.load, gdswriter's optimizer buffers: up to 1x).
    _util.require_memory(int(2.3 * size.nbytes), f"checkpoint benchmark {size} (live state + one loaded copy)")
    model, opt = build_state(size.nbytes)
    yield model, opt, state_bytes(model, opt), Canary(model, opt)
    del model, opt
    gc.collect()  # free this size's state now: the next size needs the RAM


@pytest.fixture(scope="module")
def gds(trained, workdir):
    model, opt, _, _ = trained
    ckpt = GDSCheckpointer(model, opt, root=workdir / "gdswriter",
                           options=CheckpointOptions(engine=EngineOptions.from_env()))
    _ = ckpt.engine_info  # create the engines (staging buffers, ring) now, outside the timed rounds
    yield ckpt
    ckpt.close()


@pytest.fixture(scope="module")
def formats(workdir, trained, gds):
    model, opt, _, _ = trained
    return Formats(workdir, model, opt, gds)


# ----------------------------------------------------------------------------- save
@pytest.mark.parametrize("case", list(SAVES))
def test_save(benchmark, size, case, formats, trained, rounds):
    name = SAVES[case]
    _, _, nbytes, _ = trained
    benchmark.group = f"checkpoint save {size}"

    def setup():
        formats.clear(case)
        _util.quiesce()

    timer = RoundTimer(lambda: formats.save(case))
    benchmark.pedantic(timer, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    assert formats.exists(case)
    benchmark.extra_info["layers"] = "x".join(map(str, plan_layers(size.nbytes)))
    if case == "gdswriter":
        info = formats.gds.engine_info
        benchmark.extra_info["engine"] = info.name
        benchmark.extra_info["direct_io"] = info.direct_io
    gbps = finish(benchmark, timer, suite=SUITE, kind="save", size=size, case=name, nbytes=nbytes)
    if case == "gdswriter":
        ratio(benchmark, "x torch.save", gbps, RESULTS.get((SUITE, "save", size.label, "torch.save")))
        ratio(benchmark, "x dcp.save t4", gbps, RESULTS.get((SUITE, "save", size.label, "dcp.save t4")))
        ratio(benchmark, "x engine raw write", gbps, RESULTS.get((ENGINE_RAW[0], ENGINE_RAW[1], size.label, ENGINE_RAW[2])))
    if case == "dcp1":
        formats.clear(case)  # dcp.load reads the t4 checkpoint


# ----------------------------------------------------------------------------- load
@pytest.mark.parametrize("case", list(LOADS))
def test_load(benchmark, size, case, formats, trained, rounds):
    name = LOADS[case]
    _, _, nbytes, canary = trained
    benchmark.group = f"checkpoint load {size}"
    save_case = "dcp4" if case == "dcp" else case
    settle_s = _util.bench_settle()
    if not formats.exists(save_case):  # its save case was deselected or failed: make one, untimed
        formats.save(save_case)

    def setup():
        _util.settle(settle_s)
        _util.evict(*formats.files(case))
        canary.spoil()

    timer = RoundTimer(lambda: formats.load(case))
    try:
        benchmark.pedantic(timer, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
        canary.check(name)
        gbps = finish(benchmark, timer, suite=SUITE, kind="load", size=size, case=name, nbytes=nbytes)
        if case == "gdswriter":
            refs = {r: RESULTS.get((SUITE, "load", size.label, r)) for r in ("torch.load", "dcp.load",
                                                                             "safetensors.load_file")}
            for r, v in refs.items():
                ratio(benchmark, f"x {r}", gbps, v)
            known = [v for v in refs.values() if v]
            if known:
                ratio(benchmark, "x fastest loader", gbps, max(known))
    finally:
        formats.clear(save_case)
