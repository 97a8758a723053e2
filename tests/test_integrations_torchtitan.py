"""torchtitan's own CheckpointManager (torchtitan 0.3.0) through gdswriter
(gdswriter/integrations/torchtitan.py, GDSCheckpointManager), on 2 real gloo ranks with an FSDP2
model (fully_shard on a CPU mesh), torchtitan's own OptimizersContainer (AdamW) and
LRSchedulersContainer. Every run is fresh processes (tests/support/ranks.py), one intra-op
thread; a resumed run is compared with an uninterrupted one bit for bit (sha256 of every whole
parameter and optimizer tensor)."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan (0.3.0, with tyro, spmd-types, torchdata, "
                    "docstring-parser, typeguard) is not installed: see .ci/run")

from support.ranks import run_ranks  # noqa: E402

STEPS = 6
EVERY = 2  # checkpoint.interval
WIDE = 1536  # the layers' weights are 1536 x 1024 fp32: 6 MiB, 3 MiB per rank's shard


# ----------------------------------------------------------------------------- in the ranks
class TrainState:
    """The trainer's own state, as torchtitan's Trainer saves it (states={"train_state": ...})."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def _setup(world: int):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, WIDE), nn.ReLU(), nn.Linear(WIDE, 1024))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opts = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop").build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=STEPS)
    return model, opts, scheds


def _manager(kind: str, folder: str, mode: str, model, opts, scheds, ts, **extra):
    from torchtitan.components.checkpoint import CheckpointManager

    from gdswriter.integrations.torchtitan import GDSCheckpointManager

    cls = GDSCheckpointManager if kind == "gds" else CheckpointManager
    config = cls.Config(enable=True, folder="checkpoint", interval=EVERY, async_mode=mode, keep_latest_k=0,
                        last_save_model_only=False, **extra)
    return config.build(dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                        states={"train_state": ts}, sd_adapter=None, base_folder=folder)


def _train_step(model, opts, scheds, rank: int, step: int) -> None:
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(100 * step + rank))
    model(x).pow(2).mean().backward()
    opts.step()
    scheds.step()
    opts.zero_grad()


def _digest(model, opts) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        out[f"model/{k}"] = v.full_tensor()
    for k, v in opts.state_dict().items():
        if isinstance(v, torch.Tensor):
            out[f"opt/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return {k: hashlib.sha256(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in sorted(out.items())}


def _die_in_write_files() -> None:
    """SIGKILL once this rank's data files of the save are written, before the step commits (the
    plug-in's public write_files: the seam the plug-in's own kill test uses)."""
    import gdswriter.distributed.dcp_writer as plugin

    written = plugin.write_files

    def write_then_die(*args, **kwargs):
        out = written(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    plugin.write_files = write_then_die


def _titan_run(rank: int, world: int, folder: str, kind: str, mode: str, upto: int, kill: str = "",
               extra: dict | None = None) -> dict:
    """torchtitan's loop: build, load (resume), train and save through the manager up to step
    ``upto`` (its last step saved with last_step=True when it is STEPS), then close. ``kill``:
    "in-save" dies in step 4's save, "between" after step 4's save, at the end of step 5."""
    from support.models import one_thread

    with one_thread():
        model, opts, scheds = _setup(world)
        ts = TrainState()
        manager = _manager(kind, folder, mode, model, opts, scheds, ts, **(extra or {}))
        built = type(manager).__name__
        manager.load()
        resumed = ts.step
        for step in range(ts.step + 1, upto + 1):
            _train_step(model, opts, scheds, rank, step)
            ts.step = step
            if kill == "between" and step == 5:
                manager.maybe_wait_for_saving()  # step 4's async save has committed: a kill between saves
                os.kill(os.getpid(), signal.SIGKILL)
            if kill == "in-save" and step == 4:
                _die_in_write_files()
            manager.save(step, last_step=step == STEPS)
        manager.maybe_wait_for_saving()
        found = manager._find_load_step()
        writer = getattr(manager, "gds_writer", None)
        manager.close()
        return {"built": built, "resumed": resumed, "found": found, "digest": _digest(model, opts),
                "closed": writer is None or getattr(manager, "gds_writer", None) is None}


def _run(tmp: Path, name: str, *args, killed: tuple[int, ...] = ()) -> list:
    return run_ranks(2, _titan_run, *args, out=tmp / name, killed=killed)


def _is_gdswriter_step(path: Path) -> bool:
    return (path / ".metadata").read_bytes().startswith(b"{")


# ----------------------------------------------------------------------------- tests
def test_config_builds_the_gds_manager_and_guards_enable_false():
    """One line of config selects the manager (its own nested Config); enable=False builds it
    without a process group or writer, and close()/save() do nothing; the pinned-memory mode is
    refused with the reason."""
    from torchtitan.components.checkpoint import CheckpointManager

    from gdswriter.errors import InvalidOptionError
    from gdswriter.integrations.torchtitan import GDSCheckpointManager

    assert isinstance(GDSCheckpointManager.Config(), CheckpointManager.Config)
    off = GDSCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=None)
    assert type(off) is GDSCheckpointManager and off.gds_writer is None and not hasattr(off, "pg")
    assert off.save(1) is False and off.load() is False
    off.close()
    with pytest.raises(InvalidOptionError, match="async_with_pinned_mem"):
        GDSCheckpointManager.Config(async_mode="async_with_pinned_mem")


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_torchtitan_manager_saves_and_resumes_bit_for_bit(tmp_path, mode):
    """torchtitan's real manager on 2 ranks (FSDP2): saves (sync or async) write gdswriter steps
    that _find_load_step finds; a run resumed from step 4 (checkpoint.load_step-style: the
    folder's newest step after removing step-6) ends bit for bit like the uninterrupted run; the
    kept writer is closed in torchtitan's close path."""
    import shutil

    straight = _run(tmp_path, "straight", str(tmp_path / "a"), "gds", mode, STEPS)
    assert all(r["built"] == "GDSCheckpointManager" and r["found"] == STEPS and r["closed"] for r in straight)
    folder = tmp_path / "a" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6"]
    assert all(_is_gdswriter_step(folder / f"step-{s}") for s in (2, 4, 6))
    shutil.rmtree(folder / "step-6")
    resumed = _run(tmp_path, "resumed", str(tmp_path / "a"), "gds", mode, STEPS)
    assert [r["resumed"] for r in resumed] == [4, 4]
    assert resumed[0]["digest"] == straight[0]["digest"] and resumed[1]["digest"] == straight[1]["digest"]


def test_switch_from_filesystemwriter_steps_to_gdswriter_in_one_folder(tmp_path):
    """A job saved with torchtitan's stock manager (DCP's FileSystemWriter: step-2, step-4), then
    switches to GDSCheckpointManager with the same folder: it resumes from the FileSystemWriter
    step-4, writes gdswriter's step-6, and ends bit for bit like a run that never stopped; a
    restart then finds step-6 (gdswriter); initial_load_path naming a FileSystemWriter step
    seeds a fresh folder."""
    base = str(tmp_path / "job")
    straight = _run(tmp_path, "straight", str(tmp_path / "ref"), "gds", "disabled", STEPS)
    stock = _run(tmp_path, "stock", base, "stock", "disabled", 4)
    assert stock[0]["built"] == "CheckpointManager"
    folder = Path(base) / "checkpoint"
    assert not _is_gdswriter_step(folder / "step-4") and (folder / "step-4" / "__0_0.distcp").is_file()
    switched = _run(tmp_path, "switched", base, "gds", "async", STEPS)
    assert [r["resumed"] for r in switched] == [4, 4] and [r["found"] for r in switched] == [STEPS, STEPS]
    assert _is_gdswriter_step(folder / "step-6")
    assert [r["digest"] for r in switched] == [r["digest"] for r in straight]
    again = _run(tmp_path, "again", base, "gds", "disabled", STEPS)
    assert [r["resumed"] for r in again] == [STEPS, STEPS]
    assert [r["digest"] for r in again] == [r["digest"] for r in straight]
    seeded = _run(tmp_path, "seeded", str(tmp_path / "fresh"), "gds", "disabled", 4,
                  "", {"initial_load_path": str(folder / "step-2"), "initial_load_model_only": False})
    assert [r["resumed"] for r in seeded] == [2, 2]
    assert [r["digest"] for r in seeded] == [r["digest"] for r in stock]


@pytest.mark.slow  # 4 x 3 two-rank runs (about 9 minutes here under load): .ci/run runs it
@pytest.mark.parametrize("mode", ["disabled", "async"])
@pytest.mark.parametrize("kill", ["in-save", "between"])
def test_a_killed_torchtitan_run_resumes_bit_for_bit(tmp_path, mode, kill):
    """SIGKILL on both ranks during step 4's save (its data files written, not committed) or
    between saves (end of step 5, step 4's async save finished): the restart's _find_load_step picks the last committed step
    (2, or 4), the torn step-4 has no .metadata, and the resumed run ends bit for bit like an
    uninterrupted one."""
    base = str(tmp_path / "job")
    straight = _run(tmp_path, "straight", str(tmp_path / "ref"), "gds", mode, STEPS)
    _run(tmp_path, "killed", base, "gds", mode, STEPS, kill, killed=(0, 1))
    folder = Path(base) / "checkpoint"
    if kill == "in-save":
        assert not (folder / "step-4" / ".metadata").exists()
    resumed = _run(tmp_path, "resumed", base, "gds", mode, STEPS)
    assert [r["resumed"] for r in resumed] == [{"in-save": 2, "between": 4}[kill]] * 2
    assert [r["digest"] for r in resumed] == [r["digest"] for r in straight]
