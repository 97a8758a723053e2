"""The DeepSpeed checkpoint engine (gdswriter/integrations/deepspeed.py) with real DeepSpeed engines
on the CPU (DS_ACCELERATOR=cpu, gloo): ZeRO stages 0 to 3 on one rank, ZeRO-2 on two. Each
scenario runs in fresh processes (tests/support/ranks.py), as DeepSpeed initialises
torch.distributed. Saved and loaded states are compared with the state at the save, bit for bit,
and a resumed run with an uninterrupted one."""

from __future__ import annotations

import argparse
import enum
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from support.ranks import run_ranks  # noqa: E402
from support.trees import assert_same_tree  # noqa: E402

from gdswriter.errors import CorruptCheckpointError, UnsupportedObjectError  # noqa: E402
from gdswriter.integrations.deepspeed import ROOT_NAME, from_plain, to_plain  # noqa: E402

HIDDEN = 1024  # the first layer's weight is 512 x 1024 fp32: 2 MiB, above every small-copy threshold


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # inherited by the spawned ranks


# ----------------------------------------------------------------------------- helpers (run in the ranks)
def _engine(stage: int, world: int, **ds_extra):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, **ds_extra}
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _train(engine, steps: range) -> None:
    rank = torch.distributed.get_rank()
    for i in steps:
        g = torch.Generator().manual_seed(1000 * i + rank)
        loss = engine(torch.randn(4, 512, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, _clone(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _state(engine) -> dict:
    """The engine's model and optimizer state (clones), in plain values (to_plain: a ZeRO loss
    scaler object compares by its fields)."""
    return to_plain(_clone({"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                            "global_steps": engine.global_steps}))


class _Gate(threading.Event):
    """Holds every data-file write of the engines made below until set."""


_GATE = _Gate()


def _gated_engines():
    """An engine whose data-file writes wait for _GATE."""
    from gdswriter.options import EngineOptions
    from gdswriter.testing.faults import FaultInjectingEngine, FaultPlan

    class Gated(FaultInjectingEngine):
        def write_file(self, *args, **kwargs):
            _GATE.wait()
            return super().write_file(*args, **kwargs)

    return [Gated(EngineOptions(), FaultPlan())]


class _KillNow(BaseException):
    """Raised by the fault engine at a chosen backend call: kill -9 of this process, there."""

    def __init__(self, *args):
        os.kill(os.getpid(), signal.SIGKILL)


def _live_snapshot(rank: int, world: int, save_dir: str) -> dict:
    """snapshot="live" (no host copy): the writes of tag "a" are held for a second after
    save_checkpoint returned; the next optimizer step (ZeRO-1: the inner torch optimizer's, which
    also guards the weights) must wait until they are written, so "a" loads as it was at its save."""
    from gdswriter.integrations.deepspeed import use_gdswriter
    from gdswriter.options import CheckpointOptions

    engine = _engine(1, world)
    ckpt = use_gdswriter(engine, make_engines=_gated_engines, options=CheckpointOptions(snapshot="live"))
    _train(engine, range(2))
    _GATE.clear()
    engine.save_checkpoint(save_dir, tag="a")
    at_a = _state(engine)
    threading.Timer(1.0, _GATE.set).start()  # no assert on time: only the order of the writes and the steps
    _train(engine, range(2, 4))
    ckpt.wait()
    fresh = _engine(1, world)
    use_gdswriter(fresh)
    fresh.load_checkpoint(save_dir)
    assert_same_tree(_state(fresh), at_a)
    return {"blocked_s": ckpt.last_save["blocked_s"] > 0}


def test_live_snapshot_optimizer_step_waits_for_the_write(tmp_path):
    (res,) = run_ranks(1, _live_snapshot, str(tmp_path / "ckpts"), out=tmp_path / "out")
    assert res == {"blocked_s": True}


_ENGINES: list = []


def _killable_engines():
    """The save dir's engines, kept in _ENGINES: a fault engine that faults nothing until _kill_at."""
    from gdswriter.options import EngineOptions
    from gdswriter.testing.faults import FaultInjectingEngine, FaultPlan

    _ENGINES[:] = [FaultInjectingEngine(EngineOptions(), FaultPlan())]
    return list(_ENGINES)


def _kill_at_next_save() -> None:
    from gdswriter.testing.faults import FaultPlan

    # the 2nd backend call of the next save: its first data file is partly written, nothing committed
    _ENGINES[0].reset(FaultPlan(raise_at_call=2, raise_type=_KillNow))


class Color(enum.Enum):
    RED = 1


# ----------------------------------------------------------------------------- scenarios
def _roundtrip(rank: int, world: int, stage: int, save_dir: str, async_save: bool) -> dict:
    """Train, save tag "a", train on (while the save may still run), wait; a fresh engine loads
    the tag `latest` names: model and optimizer equal the state at the save, bit for bit, and both
    engines trained on stay equal."""
    from gdswriter.integrations.deepspeed import use_gdswriter

    engine = _engine(stage, world)
    ckpt = use_gdswriter(engine, async_save=async_save)
    _train(engine, range(3))
    args = argparse.Namespace(lr=1e-3, data=Path("/data/train"), layers=[1, 2])
    client = {"args": args, "seen": {3, 1}, "epoch": 7, "rng": torch.get_rng_state()}
    engine.save_checkpoint(save_dir, tag="a", client_state=client)
    at_save = _state(engine)
    _train(engine, range(3, 5))  # changes every saved tensor, maybe before the save has written them
    ckpt.wait()
    assert Path(save_dir, "latest").read_text() == "a"

    fresh = _engine(stage, world)
    use_gdswriter(fresh)
    path, loaded_client = fresh.load_checkpoint(save_dir)
    assert path is not None
    assert_same_tree(_state(fresh), at_save)
    assert loaded_client["args"] == args and loaded_client["seen"] == {1, 3} and loaded_client["epoch"] == 7
    assert torch.equal(loaded_client["rng"], client["rng"])
    _train(fresh, range(3, 5))
    assert_same_tree(_state(fresh), _state(engine))
    files = sorted(p.name for p in Path(save_dir, "a").iterdir())
    return {"files": files, "zero": type(engine.optimizer).__name__, "step": ckpt.last_save["step"]}


# ZeRO-1 in the default run; the other stages with the slow scenarios (a DeepSpeed start-up costs ~10 s)
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_save_load_bit_exact(tmp_path, stage):
    """One rank, each ZeRO stage (all four run on the CPU): the tag round-trips bit-exact (model,
    optimizer, fp32 partitions, loss scaler, global step, client_state with a Namespace, a path and
    a set), and the engines trained on from it stay equal."""
    (res,) = run_ranks(1, _roundtrip, stage, str(tmp_path / "ckpts"), True, out=tmp_path / "out")
    expected = ["zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"]
    if stage > 0:
        expected.append("zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert res["zero"] == ["AdamW", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"][stage]
    assert res["files"] == sorted(expected)


@pytest.mark.slow  # about 20 s: two ranks, four DeepSpeed engines
def test_two_ranks_zero2_one_step(tmp_path):
    """Two ranks, ZeRO-2 (each rank holds its own optimizer partition), asynchronous saves: both
    ranks' files are one committed gdswriter step, and each rank gets its own partition back."""
    save_dir = tmp_path / "ckpts"
    res = run_ranks(2, _roundtrip, 2, str(save_dir), True, out=tmp_path / "out")
    assert res[0]["files"] == sorted(["mp_rank_00_model_states.pt",
                                      "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                      "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
    from gdswriter.format.commit import CommitProtocol
    from gdswriter.load.reader import read_manifest

    protocol = CommitProtocol([save_dir / ROOT_NAME])
    (step,) = protocol.committed_steps()
    m = read_manifest(protocol, step)
    assert m.dist is not None and m.dist.world_size == 2 and m.metadata["deepspeed_tag"] == "a"


def _async_overlap(rank: int, world: int, save_dir: str) -> dict:
    """Tag "a" durable; tag "b" saved while its writes are held: training steps run meanwhile,
    `latest` names "a" and "b" is not committed; released, "b" is durable, `latest` names it and
    it loads as it was at its save."""
    from gdswriter.integrations.deepspeed import tag_step, use_gdswriter

    engine = _engine(1, world)
    _GATE.set()
    ckpt = use_gdswriter(engine, make_engines=_gated_engines)
    _train(engine, range(2))
    engine.save_checkpoint(save_dir, tag="a")
    ckpt.wait()
    _GATE.clear()
    _train(engine, range(2, 3))
    engine.save_checkpoint(save_dir, tag="b")  # returns with the writes held
    at_b = _state(engine)
    _train(engine, range(3, 6))                 # three optimizer steps while "b" is being saved
    overlapped = {"latest": Path(save_dir, "latest").read_text(),
                  "b_step": tag_step(save_dir, "b")}
    _GATE.set()
    ckpt.wait()
    fresh = _engine(1, world)
    use_gdswriter(fresh)
    fresh.load_checkpoint(save_dir)
    assert_same_tree(_state(fresh), at_b)
    return {**overlapped, "latest_after": Path(save_dir, "latest").read_text(),
            "b_after": tag_step(save_dir, "b")}


def test_async_save_overlaps_training_and_is_durable_once_committed(tmp_path):
    (res,) = run_ranks(1, _async_overlap, str(tmp_path / "ckpts"), out=tmp_path / "out")
    assert res == {"latest": "a", "b_step": None, "latest_after": "b", "b_after": 1}


def _killed_during_save(rank: int, world: int, save_dir: str, second: str) -> None:
    from gdswriter.integrations.deepspeed import use_gdswriter

    engine = _engine(2, world)
    ckpt = use_gdswriter(engine, make_engines=_killable_engines)
    _train(engine, range(3))
    engine.save_checkpoint(save_dir, tag="a")
    ckpt.wait()
    _train(engine, range(3, 5))
    _kill_at_next_save()
    engine.save_checkpoint(save_dir, tag=second)  # killed (SIGKILL) in the middle of writing it
    ckpt.wait()
    raise AssertionError("not killed")


def _killed_between_saves(rank: int, world: int, save_dir: str, second: str) -> None:
    import os
    import signal

    from gdswriter.integrations.deepspeed import use_gdswriter

    engine = _engine(2, world)
    ckpt = use_gdswriter(engine)
    _train(engine, range(3))
    engine.save_checkpoint(save_dir, tag="a")
    ckpt.wait()
    _train(engine, range(3, 5))  # killed with these steps' work unsaved
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_after_kill(rank: int, world: int, save_dir: str) -> dict:
    from gdswriter.errors import CheckpointNotFoundError
    from gdswriter.integrations.deepspeed import use_gdswriter

    resumed = _engine(2, world)
    use_gdswriter(resumed)
    path, _ = resumed.load_checkpoint(save_dir)  # `latest`
    _train(resumed, range(3, 8))
    straight = _engine(2, world)
    _train(straight, range(8))
    assert_same_tree(_state(resumed), _state(straight))
    try:
        resumed.load_checkpoint(save_dir, tag="b") if Path(save_dir, "b").exists() else None
        b = "loaded"
    except CheckpointNotFoundError as e:
        b = str(e)
    return {"path": path, "b": b}


@pytest.mark.slow  # about 35 s: three processes, four DeepSpeed engines
@pytest.mark.parametrize("second", ["b", "a", "between"])
def test_kill_during_save_leaves_previous_tag_and_resume_is_exact(tmp_path, second):
    """kill -9 while the next tag's data files are being written (a new tag "b", or "a" saved
    again, as with a fixed tag), or between saves: `latest` still names "a", whose first save
    loads, and the run resumed from it matches an uninterrupted run bit for bit; "b" is refused
    clearly."""
    save_dir = tmp_path / "ckpts"
    killed = _killed_between_saves if second == "between" else _killed_during_save
    run_ranks(1, killed, str(save_dir), second, out=tmp_path / "out1", killed=(0,))
    assert Path(save_dir, "latest").read_text() == "a"
    (res,) = run_ranks(1, _resume_after_kill, str(save_dir), out=tmp_path / "out2")
    assert res["path"].endswith("a/mp_rank_00_model_states.pt")
    assert res["b"] == "loaded" if second in ("a", "between") else "never committed" in res["b"]


def _refused_and_retention(rank: int, world: int, save_dir: str) -> list:
    import shutil

    from gdswriter.format.commit import CommitProtocol
    from gdswriter.integrations.deepspeed import use_gdswriter

    engine = _engine(0, world)
    use_gdswriter(engine, async_save=False)
    _train(engine, range(1))
    engine.save_checkpoint(save_dir, tag="a")
    try:
        engine.save_checkpoint(save_dir, tag="b", client_state={"cfg": {"color": Color.RED}})
        raise AssertionError("not refused")
    except UnsupportedObjectError as e:
        refused = [str(e), Path(save_dir, "latest").read_text()]

    def steps() -> list[int]:
        return CommitProtocol([Path(save_dir, ROOT_NAME)]).committed_steps()

    after_refusal = steps()
    engine.save_checkpoint(save_dir, tag="a")  # again: its older step goes once the new one is committed
    engine.save_checkpoint(save_dir, tag="c")
    resaved = steps()
    shutil.rmtree(Path(save_dir, "c"))         # a user prunes a tag: its step goes at the next save
    engine.save_checkpoint(save_dir, tag="d")
    return [*refused, after_refusal, resaved, steps()]


def test_unsupported_state_refused_and_unused_steps_dropped(tmp_path):
    """A client_state enum is refused at save_checkpoint with its file and key path, before
    anything is written; re-saving a tag, or removing a tag's directory, frees its step."""
    (res,) = run_ranks(1, _refused_and_retention, str(tmp_path / "ckpts"), out=tmp_path / "out")
    msg, latest, after_refusal, resaved, pruned = res
    assert "mp_rank_00_model_states.pt/cfg/color" in msg and ".value" in msg, msg
    assert latest == "a" and after_refusal == [0]
    assert resaved == [1, 2] and pruned == [1, 3]


# ----------------------------------------------------------------------------- the codec, in this process
def test_plain_codec_roundtrip_and_damage():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=100, min_scale=1.0, delayed_shift=2,
                               consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.float16)
    obj = {"stage": ZeroStageEnum.gradients, "scaler": scaler, "frag": fragment_address(numel=3, start=5),
           "ns": argparse.Namespace(a=1), "p": Path("/x"), "s": frozenset({"a"})}
    tags: list = []
    plain = to_plain(obj, "f.pt", tags)
    back = from_plain(plain, tags)
    assert back["stage"] is ZeroStageEnum.gradients and back["frag"] == fragment_address(numel=3, start=5)
    assert type(back["scaler"]) is DynamicLossScaler and vars(back["scaler"]) == vars(scaler)
    assert back["ns"] == argparse.Namespace(a=1) and back["p"] == Path("/x") and back["s"] == frozenset({"a"})
    with pytest.raises(CorruptCheckpointError, match="does not rebuild"):
        from_plain({"x": 1}, [[["x"], "enum", "os.system"]])
    with pytest.raises(CorruptCheckpointError):
        from_plain({"x": 1}, [[["y"], "path", None]])
    with pytest.raises(UnsupportedObjectError, match="f.pt/k"):
        to_plain({"k": object()}, "f.pt")


def test_engine_refuses_what_it_cannot_do_safely(tmp_path):
    """Without use_gdswriter nothing would mark a tag's end: create() refuses. A torch.save file
    is not unpickled unless asked. A tag with no gdswriter root is CheckpointNotFoundError."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from gdswriter.errors import CheckpointNotFoundError, InvalidOptionError
    from gdswriter.integrations.deepspeed import GDSCheckpointEngine

    ce = GDSCheckpointEngine()
    with pytest.raises(InvalidOptionError, match="use_gdswriter"):
        ce.create(CheckpointCommitInfo(tag="a", save_dir=str(tmp_path), save_latest=True))
    (tmp_path / "a").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "a" / "mp_rank_00_model_states.pt")
    with pytest.raises(InvalidOptionError, match="read_torch_files=True"):
        ce.load(str(tmp_path / "a" / "mp_rank_00_model_states.pt"))
    assert torch.equal(GDSCheckpointEngine(read_torch_files=True).load(
        str(tmp_path / "a" / "mp_rank_00_model_states.pt"))["w"], torch.ones(2))
    with pytest.raises(CheckpointNotFoundError, match="no gdswriter checkpoint"):
        ce.load(str(tmp_path / "b" / "mp_rank_00_model_states.pt"))
