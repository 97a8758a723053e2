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
import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import _util
from _util import RESULTS, RoundTimer, finish, ratio

from gdswriter import CheckpointOptions, EngineOptions, GDSCheckpointer

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


# ----------------------------------------------------------------------------- state
def plan_layers(total: int) -> tuple[int, int]:
    """(dim, n_layers) of square Linear layers so that 3 x params (fp32) ~= total bytes."""
    param_bytes = total / 3
    layer_bytes = min(64 * _util.MiB, max(param_bytes / 4, 64 * _util.KiB))
    dim = max(64, int(math.sqrt(layer_bytes / 4)) // 64 * 64)
    n = max(1, round(param_bytes / (dim * dim * 4)))
    return dim, n


def build_state(total: int):
    torch.manual_seed(0)
    dim, n = plan_layers(total)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.empty_like(p).uniform_(-1, 1)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model, opt) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def collect(model, opt) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def flat_tensors(model, opt) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors view: one flat name -> tensor dict, param_groups as JSON metadata."""
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optimizer.state.{pid}.{k}"] = v
    return flat, {"param_groups": json.dumps(osd["param_groups"])}


class Canary:
    """Remember a few tensors (first weight, last exp_avg_sq); spoil them before each load
    round and check the load restored them."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.saved = [t.clone() for t in self._live()]

    def _live(self):
        first = next(iter(self.model.parameters()))
        last = list(self.model.parameters())[-2]
        return [first.detach(), self.opt.state[last]["exp_avg_sq"]]

    def spoil(self) -> None:
        with torch.no_grad():
            for t in self._live():
                t.fill_(-1.0)

    def check(self, what: str) -> None:
        for live, want in zip(self._live(), self.saved):
            assert torch.equal(live, want), f"{what} did not restore the state"


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def workdir(bench_root, size):
    with _util.size_workdir(bench_root, size, SUITE) as d:
        yield d


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
    ckpt.engine_info  # create the engines (staging buffers, ring) now, outside the timed rounds
    yield ckpt
    ckpt.close()


class Formats:
    """How each format saves and loads, and where its checkpoint lives."""

    def __init__(self, workdir, model, opt, gds: GDSCheckpointer):
        self.dir, self.model, self.opt, self.gds = workdir, model, opt, gds
        self.step = 0

    def path(self, case: str):
        return {"torch": self.dir / "state.pt", "dcp1": self.dir / "dcp", "dcp4": self.dir / "dcp",
                "dcp": self.dir / "dcp", "safetensors": self.dir / "state.safetensors",
                "gdswriter": self.dir / "gdswriter"}[case]

    def clear(self, case: str) -> None:
        if case == "gdswriter":
            for s in self.gds.steps():
                self.gds.protocol.delete_step(s)
        else:
            _util.remove(self.path(case))

    def exists(self, case: str) -> bool:
        if case == "gdswriter":
            return bool(self.gds.steps())
        return self.path(case).exists()

    # -- save -------------------------------------------------------------------
    def save(self, case: str) -> None:
        m, o, p = self.model, self.opt, self.path(case)
        if case == "torch":
            with open(p, "wb") as f:
                torch.save(collect(m, o), f)
                f.flush()
                os.fsync(f.fileno())
        elif case in ("dcp1", "dcp4", "dcp"):
            writer = dcp.FileSystemWriter(p, thread_count=1 if case == "dcp1" else 4, sync_files=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(collect(m, o), storage_writer=writer)
        elif case == "safetensors":
            flat, meta = flat_tensors(m, o)
            save_file(flat, p, metadata=meta)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif case == "gdswriter":
            self.step += 1
            self.gds.save(self.step)
        else:
            raise ValueError(case)

    # -- load -------------------------------------------------------------------
    def load(self, case: str) -> None:
        m, o, p = self.model, self.opt, self.path(case)
        if case == "torch":
            state = torch.load(p, weights_only=True, mmap=False)
            m.load_state_dict(state["model"])
            o.load_state_dict(state["optimizer"])
        elif case == "dcp":
            sd = collect(m, o)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, storage_reader=dcp.FileSystemReader(p))
            o.load_state_dict(sd["optimizer"])  # model tensors were filled in place
        elif case == "safetensors":
            flat = load_file(p)
            with safe_open(p, framework="pt") as f:
                groups = json.loads(f.metadata()["param_groups"])
            m.load_state_dict({k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")})
            params = [q for g in o.param_groups for q in g["params"]]
            with torch.no_grad():
                for pid, q in enumerate(params):
                    for k, live in o.state[q].items():
                        live.copy_(flat[f"optimizer.state.{pid}.{k}"])
            for g, saved in zip(o.param_groups, groups):
                g.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
            del flat
        elif case == "gdswriter":
            self.gds.load(self.step)
        else:
            raise ValueError(case)

    def files(self, case: str) -> list:
        return [self.path(case)]


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
