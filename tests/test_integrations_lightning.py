"""The PyTorch Lightning plug-in (gdswriter/integrations/lightning.py) with a real Trainer.fit on
the CPU: a run stopped after 2 epochs and resumed from its gdswriter checkpoint ends exactly
where an uninterrupted run ends (weights, optimizer, scheduler, global step); a run SIGKILLed in
a child process while a save's data file is written, or between saves, resumes from
``ckpt_path="last"`` and ends bit for bit where the uninterrupted run ends."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from support import lightning_run
from support.engines import count_staged_engines
from support.trees import assert_same_tree

L = pytest.importorskip("lightning")
from lightning.fabric.utilities.data import AttributeDict  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gdswriter import CheckpointNotFoundError, EngineIOError, UnsupportedObjectError  # noqa: E402
from gdswriter.integrations.lightning import GDSCheckpointIO, from_plain, to_plain  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def _quiet():
    """Lightning's logs and warnings off; torch's process-wide determinism switch (which
    Trainer(deterministic=...) would flip for every later test) as it was."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    deterministic = torch.are_deterministic_algorithms_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.use_deterministic_algorithms(deterministic)


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.05, args: argparse.Namespace | None = None, data_dir: Path = Path("/data"),
                 extra: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)]


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=False)  # 8 steps/epoch


def _model(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(args=argparse.Namespace(layers=2, name="tiny"), extra={"paths": [Path("/a"), Path("/b")]})


def _trainer(root: Path, epochs: int, **kw) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, **kw)


def _state(trainer: L.Trainer, model: Net) -> dict:
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step, "epoch": trainer.current_epoch}


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_fit_stopped_and_resumed_matches_an_uninterrupted_run(tmp_path, async_save):
    straight = _model(seed=1)
    t = _trainer(tmp_path / "a", 4, enable_checkpointing=False)
    t.fit(straight, _data())
    expected = _state(t, straight)
    assert expected["global_step"] == 32

    ckpts = tmp_path / "ckpts"
    first = _model(seed=1)
    t1 = _trainer(tmp_path / "b", 2, plugins=[GDSCheckpointIO(async_save=async_save)],
                  callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True, save_top_k=1)])
    t1.fit(first, _data())
    # top-k pruning removed epoch 0's checkpoint; each path is a gdswriter root directory
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=1-step=16.ckpt", "last.ckpt"]
    assert (ckpts / "last.ckpt" / "latest").exists()
    assert not list(ckpts.rglob("*.pt")) and not list(ckpts.rglob("*.pkl"))

    resumed = _model(seed=99)  # different initial weights: everything must come from the checkpoint
    t2 = _trainer(tmp_path / "c", 4, plugins=[GDSCheckpointIO(async_save=async_save)], enable_checkpointing=False)
    t2.fit(resumed, _data(), ckpt_path=ckpts / "last.ckpt")
    assert_same_tree(expected, _state(t2, resumed))


def test_checkpoint_dict_round_trips_with_lightning_types(tmp_path):
    model = _model(seed=2)
    t = _trainer(tmp_path, 1, plugins=[GDSCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck")])
    t.fit(model, _data())
    io = GDSCheckpointIO()
    ck = io.load_checkpoint(tmp_path / "ck" / "epoch=0-step=8.ckpt")
    hp = ck["hyper_parameters"]
    assert hp["args"] == argparse.Namespace(layers=2, name="tiny") and isinstance(hp["args"], argparse.Namespace)
    assert hp["data_dir"] == Path("/data") and hp["extra"] == {"paths": [Path("/a"), Path("/b")]}
    assert ck["global_step"] == 8 and ck["epoch"] == 0 and "loops" in ck and "callbacks" in ck
    assert_same_tree(dict(model.state_dict()), dict(ck["state_dict"]))
    assert ck["optimizer_states"][0]["param_groups"][0]["lr"] == 0.05
    fresh = Net()
    fresh.load_state_dict(ck["state_dict"])  # what load_from_checkpoint would do, without torch.load


def test_to_plain_and_from_plain():
    obj = {"ns": argparse.Namespace(a=1, p=Path("/x")), "ad": AttributeDict(lr=0.1), "t": (Path("r"), [1, 2]),
           "keep": torch.ones(2)}
    tags: list = []
    plain = to_plain(obj, (), tags)
    assert plain["ns"] == {"a": 1, "p": "/x"} and plain["t"] == ("r", [1, 2]) and plain["keep"] is obj["keep"]
    back = from_plain(plain, tags)
    assert back["ns"] == obj["ns"] and back["t"] == obj["t"] and type(back["ad"]) is AttributeDict
    od = collections.OrderedDict(args=argparse.Namespace(k=3))
    od._metadata = {"": {"version": 1}}  # as nn.Module.state_dict() keeps it
    tags = []
    back = from_plain(to_plain({"sd": od}, (), tags), tags)["sd"]
    assert type(back) is collections.OrderedDict and back._metadata == od._metadata
    assert back["args"] == argparse.Namespace(k=3)
    from gdswriter.errors import CorruptCheckpointError

    for bad in ([[["ns"], "pickle"]], [[["missing"], "path"]], [[["t"], "namespace"]], "nope"):
        with pytest.raises(CorruptCheckpointError):
            from_plain(plain, bad)


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Config:
    width: int = 4


@pytest.mark.parametrize("value, fix", [(Mode.FAST, "store its .value ('fast')"),
                                        (Config(), "dataclasses.asdict(x)")], ids=["enum", "dataclass"])
def test_types_that_would_need_pickle_are_refused_by_key_path(tmp_path, value, fix):
    io = GDSCheckpointIO()
    with pytest.raises(UnsupportedObjectError) as e:
        io.save_checkpoint({"state_dict": {}, "global_step": 1, "hyper_parameters": {"opts": [1, value]}},
                           tmp_path / "x.ckpt")
    assert "hyper_parameters/opts/1" in str(e.value) and fix in str(e.value)
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.raises(UnsupportedObjectError, match="hyper_parameters/fn"):  # left to the state codec
        io.save_checkpoint({"state_dict": {}, "hyper_parameters": {"fn": lambda x: x}}, tmp_path / "y.ckpt")
    io.teardown()


def test_a_failed_background_save_is_raised_once(tmp_path, monkeypatch):
    import gdswriter.session as session

    def broken(*a, **k):
        raise EngineIOError(28, str(tmp_path / "f"), 0, "write")

    io = GDSCheckpointIO()
    monkeypatch.setattr(session, "write_and_commit", broken)
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, tmp_path / "a.ckpt")  # returns
    with pytest.raises(EngineIOError, match="No space left"):
        io.teardown()
    io.teardown()  # reported once
    monkeypatch.undo()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 2}, tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "a.ckpt")["global_step"] == 2  # waits for the save to that path
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()


@pytest.mark.parametrize("later_save", ["commits", "fails"])
def test_a_removal_waits_for_the_saves_in_flight(tmp_path, monkeypatch, later_save):
    """Lightning removes the previous top-k path as soon as the next save returns, before that
    save is written: the removal must wait until it is committed, and keep the path when it
    fails, so that a crash or a failed save still leaves a checkpoint to resume from (the
    in-save-top1-async kill test shows it through a Trainer)."""
    from gdswriter.integrations.engines import LeasedEngine

    io = GDSCheckpointIO()
    old, new = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=1-step=2.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(512, 1024)}, "global_step": 1}, old)
    io.teardown()
    gate = threading.Event()
    real = LeasedEngine.write_file

    def held(self, path, spans, **kw):  # the later save's background write: held, then done or failed
        if new.name in str(path):
            gate.wait(30)
            if later_save == "fails":
                raise EngineIOError(28, str(path), 0, "write")
        return real(self, path, spans, **kw)

    monkeypatch.setattr(LeasedEngine, "write_file", held)  # the engines every save of the plug-in writes through
    try:
        io.save_checkpoint({"state_dict": {"w": torch.zeros(512, 1024)}, "global_step": 2}, new)
        io.remove_checkpoint(old)  # what ModelCheckpoint(save_top_k=1) does right after
        assert io.load_checkpoint(old)["global_step"] == 1, "removed before the later save was committed"
    finally:
        gate.set()
    if later_save == "fails":
        with pytest.raises(EngineIOError, match="No space left"):
            io.teardown()
        assert io.load_checkpoint(old)["global_step"] == 1  # kept: the only checkpoint there is
    else:
        io.teardown()
        assert not old.exists() and io.load_checkpoint(new)["global_step"] == 2


def test_resaving_a_path_keeps_one_step_and_plain_files_are_refused(tmp_path):
    io = GDSCheckpointIO(async_save=False)
    path = tmp_path / "last.ckpt"
    for step in (10, 4):  # the second: a run resumed from an older checkpoint
        io.save_checkpoint({"state_dict": {"w": torch.full((2,), float(step))}, "global_step": step}, path)
    steps = sorted(p.name for p in path.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_000000000004"]
    assert torch.equal(io.load_checkpoint(path, map_location="cpu")["state_dict"]["w"], torch.full((2,), 4.0))
    old = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 3}, old)
    with pytest.raises(ValueError, match="read_torch_files=True"):
        io.load_checkpoint(old)
    assert GDSCheckpointIO(read_torch_files=True).load_checkpoint(old)["global_step"] == 3
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 5}, old)  # replaces the old file
    assert old.is_dir() and io.load_checkpoint(old)["global_step"] == 5


# ----------------------------------------------------------------------------- issue 22 item 3: torn saves
class Big(L.LightningModule):
    """A 1024 x 1024 float32 weight (4 MiB) and its two AdamW moments: far above the 1 MiB that
    save_async copies at the call (snapshot.CAPTURE_MAX), so only a guard keeps them unchanged
    while the save copies them."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.lin(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Record(L.Callback):
    """The weights and optimizer state as each checkpoint is taken (on_save_checkpoint runs in
    dump_checkpoint, just before the plug-in's save_checkpoint), by global step; and, at each
    batch after the first, whether the trainer's optimizer carries a save's step pre-hook."""

    def __init__(self):
        self.at: dict[int, dict] = {}
        self.hooked: list[bool] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        opt = trainer.optimizers[0].state_dict()["state"]
        self.at[trainer.global_step] = {
            "weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "optimizer": {i: {k: v.clone() for k, v in st.items()} for i, st in opt.items()}}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step > 0:
            self.hooked.append(bool(trainer.optimizers[0]._optimizer_step_pre_hooks))


def test_fit_saving_every_step_async_saves_exactly_each_steps_weights(tmp_path):
    """Issue 22 item 3: the checkpointer was made without the trainer's optimizer, so the next
    optimizer.step() changed the 4 MiB weight and moments while the copier still read them
    (16 of 20 checkpoints held the next step's values, and verify passed). Every checkpoint
    must hold exactly the values of the step it names."""
    torch.manual_seed(0)
    x = torch.randn(4, 1024)
    data = DataLoader(TensorDataset(x.repeat(12, 1)), batch_size=4)  # 12 short steps
    rec = Record()
    ckpts = tmp_path / "ckpts"
    trainer = _trainer(tmp_path, 1, plugins=[GDSCheckpointIO()],
                       callbacks=[rec, ModelCheckpoint(dirpath=ckpts, every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(Big(), data)
    assert sorted(rec.at) == list(range(1, 13))
    io = GDSCheckpointIO()
    torn = []
    for step, want in rec.at.items():
        (path,) = ckpts.glob(f"*step={step}.ckpt")
        ck = io.load_checkpoint(path)
        got = {"weights": dict(ck["state_dict"]),
               "optimizer": {i: dict(st) for i, st in ck["optimizer_states"][0]["state"].items()}}
        assert ck["global_step"] == step
        same = all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items()) and all(
            torch.equal(got["optimizer"][i][k], v) for i, st in want["optimizer"].items() for k, v in st.items())
        if not same:
            torn.append(step)
    assert not torn, f"checkpoints not holding the weights of the step they name: {torn}"
    # ...because the trainer's optimizer was hooked (save_checkpoint returned at once), not only
    # because save_async waited for the copy
    assert rec.hooked and all(rec.hooked), "the trainer's optimizer must carry the pending save's step pre-hook"


def test_a_save_outside_a_trainer_returns_once_the_tensors_are_copied(tmp_path, monkeypatch):
    """Called by hand, the plug-in has no optimizer to hook: save_checkpoint must not return
    before the copier has read the tensors (here it is held for 0.3 s, then the tensor is
    changed at once)."""
    from gdswriter.save import pool as snapshot_pool

    gate = threading.Event()
    real = snapshot_pool.copy_all
    # Holding the copier, the snapshot pool's own thread: no public hook (one would widen the API for tests only).
    monkeypatch.setattr(snapshot_pool, "copy_all", lambda *a: (gate.wait(60), real(*a)))
    w = torch.arange(2 * 1024 * 1024, dtype=torch.float32)  # 8 MiB
    want = w.clone()
    io = GDSCheckpointIO()
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    try:
        io.save_checkpoint({"state_dict": {"w": w}, "global_step": 1}, tmp_path / "a.ckpt")
        w.add_(1.0)  # what the next optimizer step would do
    finally:
        gate.set()
        opener.cancel()
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], want)


def test_a_failed_save_in_fit_is_raised_by_the_next_optimizer_step_once(tmp_path, monkeypatch):
    """The trainer's optimizer carries the save's pre-hook, so a save that failed in the
    background is raised by the next optimizer step (that step does not run), and only there:
    the plug-in's teardown, which Lightning runs while it handles that error, does not raise it
    again (that would cut Lightning's own teardown short)."""
    from gdswriter import session

    def broken(*a, **k):
        raise EngineIOError(28, str(tmp_path / "f"), 0, "write")

    monkeypatch.setattr(session, "write_and_commit", broken)
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(12, 1024)), batch_size=4)
    io = GDSCheckpointIO()
    trainer = _trainer(tmp_path, 1, plugins=[io],
                       callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)])
    with pytest.raises(EngineIOError, match="No space left") as e:
        trainer.fit(Big(), data)
    assert any(f.name == "_before_optimizer_step" for f in e.traceback), "not raised by the optimizer step"
    assert trainer.global_step == 1 and trainer.state.stage is None, "Lightning's teardown did not finish"
    io.teardown()  # nothing left to report


class Noisy(L.LightningModule):
    """A 2 MiB weight (above every small-copy threshold) behind dropout, trained on shuffled
    batches: every RNG draw of the run shows in the weights."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Dropout(0.3), torch.nn.Linear(512, 1024), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(1024, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return torch.nn.functional.mse_loss(self.net(x), x[:, :1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def _noisy_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(24, 512, generator=g)), batch_size=4, shuffle=True)


@pytest.mark.parametrize("save_rng", [True, False], ids=["save_rng", "no_rng"])
def test_save_rng_resume_draws_what_the_uninterrupted_run_draws(tmp_path, save_rng):
    """Issue 26 item 3: with save_rng the checkpoint's RNG state comes back on load, so a run
    resumed in a process whose RNG went elsewhere ends bit for bit where the uninterrupted run
    ends (dropout masks and shuffling included). Without save_rng it does not: the test's
    check itself can fail."""
    from gdswriter import CheckpointOptions

    torch.manual_seed(5)
    straight = Noisy()
    t = _trainer(tmp_path / "a", 4, enable_checkpointing=False)
    t.fit(straight, _noisy_data())
    expected = {k: v.clone() for k, v in straight.state_dict().items()}

    opts = CheckpointOptions(save_rng=save_rng)
    torch.manual_seed(5)
    first = Noisy()
    t1 = _trainer(tmp_path / "b", 2, plugins=[GDSCheckpointIO(options=opts)],
                  callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)])
    t1.fit(first, _noisy_data())
    torch.manual_seed(1234)  # a new process's RNG: anywhere but where the save stood
    resumed = Noisy()
    t2 = _trainer(tmp_path / "c", 4, plugins=[GDSCheckpointIO(options=opts)], enable_checkpointing=False)
    t2.fit(resumed, _noisy_data(), ckpt_path=tmp_path / "ck" / "last.ckpt")
    same = all(torch.equal(expected[k], v) for k, v in resumed.state_dict().items())
    assert same is save_rng, "save_rng=True must resume the RNG exactly (and without it the draws differ)"


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _save_many(tmp_path, n: int, async_save: bool) -> list[int]:
    """``n`` saves of a 2 MiB state through one plug-in, each to a new path (the older one
    removed, as top-k pruning does); RSS after each save, and a check that the last path holds
    the last values."""
    io = GDSCheckpointIO(async_save=async_save)
    w = torch.zeros(512, 1024)
    rss = []
    prev = None
    for i in range(n):
        w.fill_(float(i))
        path = tmp_path / f"step={i}.ckpt"
        io.save_checkpoint({"state_dict": {"w": w}, "global_step": i}, path)
        if prev is not None:
            io.remove_checkpoint(prev)  # waits for that save
        prev = path
        rss.append(_rss_kib())
    io.teardown()
    return rss, lambda: torch.equal(io.load_checkpoint(prev)["state_dict"]["w"], w)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_saves_reuse_the_engines_and_memory_stays_flat(tmp_path, monkeypatch, async_save):
    """Issue 25: every save used to build a checkpointer with new engines (60 saves: 60 engines,
    each mapping and locking 128 MiB of staging buffers). Now the engines come from the
    process's shelf: 60 saves to 60 paths build at most two (an asynchronous save in flight
    and the next; none when an earlier test left them idle), and the RSS peaks of saves 35-60
    stay within 16 MiB of those of saves 10-35."""
    built = count_staged_engines(monkeypatch)
    rss, last_saved_right = _save_many(tmp_path, 60, async_save)
    assert len(built) <= 2, f"{len(built)} engines built for 60 saves: the saves do not share engines"
    assert last_saved_right()
    growth = max(rss[35:]) - max(rss[10:35])  # peaks: a sample may hold a save in flight
    assert growth < 16 * 1024, f"RSS peaks grew by {growth} KiB: {rss}"


@pytest.mark.slow
def test_rss_flat_over_1000_saves(tmp_path):
    """Issue 25: RSS flat over 1,000 saves through the plug-in (asynchronous, each to a new path)."""
    rss, last_saved_right = _save_many(tmp_path, 1000, True)
    assert last_saved_right()
    growth = max(rss[500:]) - max(rss[50:500])  # peaks: a sample may hold a save in flight
    assert growth < 16 * 1024, f"RSS peaks grew by {growth} KiB: {rss[::50]}"


# ----------------------------------------------------------------------------- issue 26: SIGKILL, resume
TESTS = Path(__file__).resolve().parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
LAST_STEP = lightning_run.EPOCHS * lightning_run.STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final state of an uninterrupted run of lightning_run's model and data, saving nothing."""
    m = lightning_run.model(lightning_run.SEED)
    t = lightning_run.trainer(tmp_path_factory.mktemp("straight"), enable_checkpointing=False)
    with warnings.catch_warnings(), lightning_run.one_thread():  # as the child and the resumed run
        warnings.simplefilter("ignore")
        t.fit(m, lightning_run.data())
    assert t.global_step == LAST_STEP
    return lightning_run.final_state(t, m)


def _step_of(path: Path) -> int:
    return int(path.name.split("step=")[1].split(".")[0].split("-")[0])


@pytest.mark.parametrize("mode,root,keep,async_save,step,resumes_from", [
    pytest.param("in-save", "step=12", "all", False, 12, 6, id="in-save-new-path-sync"),
    pytest.param("in-save", "step=12", "all", True, 12, 6, id="in-save-new-path-async", marks=pytest.mark.slow),
    pytest.param("in-save", "last", "all", False, 12, 6, id="in-resave-of-last-sync", marks=pytest.mark.slow),
    pytest.param("in-save", "last", "all", True, 12, 6, id="in-resave-of-last-async"),
    pytest.param("in-save", "step=12", "top1", True, 12, 6, id="in-save-top1-async"),
    pytest.param("between", "", "all", False, 15, 12, id="between-sync", marks=pytest.mark.slow),
    pytest.param("between", "", "all", True, 15, 12, id="between-async", marks=pytest.mark.slow)])
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, uninterrupted, mode, root, keep, async_save,
                                                          step, resumes_from):
    """Issue 26: a real Trainer.fit in a child process (lightning_run), SIGKILLed right after a
    data file of step 12 is written (not committed) under the new ``epoch=1-step=12.ckpt`` or
    under ``last.ckpt`` (a re-save of a path holding step 6), or at the end of step 15 between
    saves. The previous complete save is still there: ``last.ckpt`` holds it, and a user who
    lists the directory and tries the newest path gets a clear CheckpointNotFoundError for the
    torn one and loads the one before. A fresh trainer (other initial weights, other RNG)
    resumed from it (``ckpt_path="last"``, or the listed path where ModelCheckpoint keeps one
    checkpoint and no last.ckpt) ends bit for bit where the uninterrupted run ends: weights,
    AdamW moments, scheduler, step, RNG.
    All three runs train on one intra-op thread (issue 37; lightning_run.one_thread).

    top1 (ModelCheckpoint's default, async; the kill comes once training has gone on to step
    13): Lightning removes epoch=0-step=6.ckpt as soon as step 12's save returns. That removal
    used to run at once, so the kill left no committed checkpoint at all; now it waits until
    step 12 is committed."""
    child = subprocess.run([sys.executable, "-m", "support.lightning_run", str(tmp_path), mode,
                            "1" if async_save else "0", str(step), root, keep],
                           env=ENV, capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert child.returncode == -signal.SIGKILL, child.stdout[-2000:] + child.stderr[-3000:]
    assert "KILLED" in child.stdout
    ckpts = tmp_path / "ckpts"
    io = GDSCheckpointIO()
    if keep == "all":
        assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == resumes_from  # what "last" resumes from

    # A user picking the newest checkpoint path by its step: a torn save is refused, clearly, and
    # the one before it loads.
    listed = sorted(ckpts.glob("epoch=*-step=*.ckpt"), key=_step_of)
    torn = [p.name for p in listed if not (p / f"step_{_step_of(p):012d}" / "manifest.json").exists()]
    if root == "step=12":
        assert torn == ["epoch=1-step=12.ckpt"] and listed[-1].name == torn[0], (torn, listed)
    else:  # killed in last.ckpt's save: epoch=1-step=12.ckpt is complete, or (async) still being written
        assert torn == (["epoch=1-step=12.ckpt"] if async_save and mode == "in-save" else []), torn
    while listed and listed[-1].name in torn:
        with pytest.raises(CheckpointNotFoundError, match=f"no committed checkpoint under .*{listed[-1].name}"):
            io.load_checkpoint(listed[-1])
        listed.pop()
    assert listed, "the kill left no complete checkpoint: the previous one was removed before the next committed"
    newest = io.load_checkpoint(listed[-1])["global_step"]
    assert newest == _step_of(listed[-1]) >= resumes_from

    # the path of step 12 was left (torn, or complete: a kill in last.ckpt's save) and is saved again
    resaved_12 = (ckpts / "epoch=1-step=12.ckpt").exists() and resumes_from < 12
    m = lightning_run.model(99)  # other initial weights and RNG: everything must come from the checkpoint
    t = lightning_run.trainer(tmp_path / "resumed", callbacks=[lightning_run.checkpoints(ckpts, keep)],
                              plugins=[lightning_run.plugin(async_save)])
    with warnings.catch_warnings(), lightning_run.one_thread():  # issue 37: one thread, as the other two runs
        warnings.simplefilter("ignore")
        t.fit(m, lightning_run.data(), ckpt_path="last" if keep == "all" else listed[-1])
    assert_same_tree(uninterrupted, lightning_run.final_state(t, m))

    # Every path the resumed run wrote holds exactly its own step, committed, no leftover. A path
    # the kill left stays as it was (Lightning checks that the path exists, not the plug-in, and
    # names the re-save "...-v1.ckpt"): a torn one is still refused, its data file a hidden leftover.
    if keep == "all":
        assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == LAST_STEP
        want = ["epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt", "epoch=2-step=18.ckpt", "epoch=3-step=24.ckpt"]
        want += ["epoch=1-step=12-v1.ckpt"] if resaved_12 else []
    else:
        want = ["epoch=0-step=6.ckpt", "epoch=3-step=24.ckpt", *torn]  # Lightning keeps the one resumed from
    paths = sorted(p.name for p in ckpts.glob("epoch=*-step=*.ckpt"))
    assert paths == sorted(want)
    for name in paths:
        held = [p.name for p in (ckpts / name).iterdir() if p.name.startswith(("step_", ".tmp-"))]
        if name in torn:
            assert [h.split("-")[1] for h in held] == ["step_000000000012"], held
            with pytest.raises(CheckpointNotFoundError):
                io.load_checkpoint(ckpts / name)
        else:
            assert held == [f"step_{_step_of(ckpts / name):012d}"], (name, held)
