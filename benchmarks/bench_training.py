"""Checkpoint every iteration of a training loop (pytest-benchmark): the cases of
training_loop.py (see its docstring) for each GDSWRITER_BENCH_SIZES size.

One benchmark round is a whole loop of GDSWRITER_BENCH_ITERS (default 20) timed iterations,
each saving after its optimizer step; extra_info has what the issue asks for: mean and median
step time, time blocked per save, and the overhead of the mean step against "none" (which
runs first). The batch is calibrated once per size so that a step takes about one durable
checkpoint write. GDSWRITER_BENCH_DEVICE=cuda runs the model on the GPU.

Goals (issue 11): save_async blocks under 10 ms; with the write fitting within a step the
overhead of gdswriter is at most 5% (under 1% with a CUDA model) and well below
dcp.async_save's. The stand-alone ``training_loop.py`` interleaves the cases round by round,
which is fairer on a machine whose speed drifts.
"""

from __future__ import annotations

import gc
import os
import statistics

import pytest
import torch

import _util
import training_loop as TL

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled",
                                        "ignore:Detected an existing checkpoint")

SUITE = "training"
_BASE: dict[str, float] = {}  # size label -> mean step s of "none"


def _iters() -> int:
    return int(os.environ.get("GDSWRITER_BENCH_ITERS", "20"))


def _device() -> str:
    return os.environ.get("GDSWRITER_BENCH_DEVICE", "cpu")


@pytest.fixture(scope="module")
def trainer(size, workdir):
    device = _device()
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("GDSWRITER_BENCH_DEVICE=cuda: no CUDA device")
    # live state (1x), the host snapshot pool (1x), one staged copy (torch.save / DCP, 1x)
    _util.require_memory(int(3.5 * size.nbytes), f"training-loop benchmark {size}")
    model, opt = TL.build(size.nbytes, device)
    batch, write_s, _ = TL.calibrate(workdir / "calibrate", model, opt, device)
    yield model, opt, batch, write_s
    del model, opt
    gc.collect()


@pytest.mark.parametrize("case", list(TL.CASES))
def test_training_loop(benchmark, size, case, trainer, workdir):
    model, opt, batch, write_s = trainer
    device = _device()
    benchmark.group = f"training loop {size} {device}"
    out = {}

    def loop():
        out["r"] = TL.run_cases([case], workdir, model, opt, batch, _iters(), device)[0]

    benchmark.pedantic(loop, rounds=1, iterations=1, warmup_rounds=0)
    r = out["r"]
    if case == "none":
        _BASE[size.label] = r.mean_step
    info = benchmark.extra_info
    info.update({"training case": case, "device": device, "batch": batch, "iterations": len(r.step_s),
                 "state bytes": TL.state_nbytes(model, opt), "write ms (calibration)": round(write_s * 1e3, 1),
                 "step ms mean": round(r.mean_step * 1e3, 2),
                 "step ms median": round(statistics.median(r.step_s) * 1e3, 2)})
    if case != "none":
        info["save call ms median"] = round(statistics.median(r.call_s) * 1e3, 2)
        info["blocked ms per save"] = round(r.blocked_per_save * 1e3, 2)
        if r.write_s:  # the write fitted within the step when this is below the step time
            info["write ms median"] = round(statistics.median(r.write_s) * 1e3, 1)
        base = _BASE.get(size.label)
        if base:
            info["overhead vs none %"] = round((r.mean_step / base - 1) * 100, 2)
