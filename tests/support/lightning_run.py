"""A Lightning ``Trainer.fit`` run for the plug-in's kill tests: the model, data, trainer and
checkpoint callback a test uses in its own process, and a child (``python -m
support.lightning_run OUT MODE ASYNC STEP [ROOT [KEEP]]``) that trains through GDSCheckpointIO and dies
of SIGKILL at a chosen point:

* ``in-save``: while a data file of step STEP is being written under the checkpoint path whose
  name contains ROOT (``step=12``: the new ``epoch=1-step=12.ckpt``; ``last``: the re-save of
  ``last.ckpt``, which holds the previous step): the engine that writes it kills the process
  right after that file is on disk, so the step is not committed (with asynchronous saves the
  other paths' writes of STEP are held until then: not committed either);
* ``between``: at the end of step STEP (after the earlier saves are in place).

KEEP ``top1`` is ModelCheckpoint's default (one checkpoint, no ``last.ckpt``); there the killing
write first waits until training has gone on to the next step, as a slow background write lets it.

GDSCheckpointIO takes its engines from the process's shelf (gdswriter/integrations/engines.py),
which builds them with ``create_engine``: the child replaces that one name with a factory of
killing engines, so every save of the run writes through them, exactly as it would otherwise.

The model holds a 2 MiB weight (above every small-copy threshold) behind dropout, trained with
AdamW and a per-epoch StepLR on shuffled data, 6 steps per epoch; ModelCheckpoint saves every 6
steps (the last batch of each epoch: Lightning cannot resume a plain shuffled DataLoader
exactly mid-epoch) and ``last.ckpt``, with ``save_rng`` (Lightning
saves no RNG state). Any slip of weights, optimizer, scheduler or RNG shows in the final state.

Every run trains on one intra-op thread (``one_thread``: the child, the uninterrupted run and
the resumed one). The test compares a run split over two processes with one made in a single
process bit for bit, and with torch's default threads (two here) a step's result was once not
a function of its inputs (issue 37: beside a CPU hog, one run in 235 had a child whose
gradients at its second step differed from bit-identical weights, AdamW state, batch and RNG
state, ending 4e-7 off). Thread count, buffer alignment and denormals do not change the results
here, which leaves the order in which a parallel kernel's threads finish: one thread has none."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch

from support.models import one_thread  # noqa: F401 - the tests use it from here too

EPOCHS = 4
STEPS_PER_EPOCH = 6
SEED = 5


def _lightning():
    import lightning as L

    return L


def model(seed: int):
    L = _lightning()

    class Noisy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Dropout(0.3), torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                           torch.nn.Dropout(0.3), torch.nn.Linear(1024, 1))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return torch.nn.functional.mse_loss(self.net(x), x[:, :1])

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    torch.manual_seed(seed)
    return Noisy()


def data():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * STEPS_PER_EPOCH, 512, generator=g)
    return DataLoader(TensorDataset(x), batch_size=4, shuffle=True)  # shuffled from torch's global RNG


def plugin(async_save: bool):
    from gdswriter import CheckpointOptions
    from gdswriter.integrations.lightning import GDSCheckpointIO

    return GDSCheckpointIO(async_save=async_save, options=CheckpointOptions(save_rng=True))


def checkpoints(dirpath: Path, keep: str = "all"):
    """ModelCheckpoint every epoch's last step: ``all`` keeps every save and ``last.ckpt``;
    ``top1`` is ModelCheckpoint's default (one checkpoint: the previous one is removed as soon
    as the next save returns, and no ``last.ckpt``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if keep == "top1":
        return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=STEPS_PER_EPOCH)
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1, save_last=True)


def trainer(root: Path, *, callbacks=(), plugins=(), **kw):
    L = _lightning()
    return L.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, callbacks=list(callbacks),
                     plugins=list(plugins), **kw)


def final_state(t, m) -> dict:
    return {"weights": {k: v.clone() for k, v in m.state_dict().items()},
            "optimizer": t.optimizers[0].state_dict(),
            "scheduler": t.lr_scheduler_configs[0].scheduler.state_dict(),
            "step": t.global_step, "epoch": t.current_epoch, "rng": torch.get_rng_state()}


def killing_engine_factory(step: int, root: str, wait: threading.Event | None = None, hold_others: bool = False):
    """Engines that SIGKILL the process once they have written a data file of ``step`` under a
    checkpoint path whose name contains ``root`` (first waiting for ``wait``, when given: a
    slow write, during which training goes on). ``hold_others`` (asynchronous saves, which
    write several paths at once): the writes of ``step`` to other paths wait for the kill, so
    that what it leaves does not depend on which background write got further."""
    from support.engines import HookedWrites

    marker = f"step_{step:012d}"

    def hit(path) -> bool:
        return marker in str(path) and root in Path(path).parent.parent.name  # ROOT/.tmp-step_S-*/data-*

    class KillAfterWrite(HookedWrites):
        def before(self, path):
            if marker in str(path) and not hit(path) and hold_others:
                threading.Event().wait()  # until the kill
            if hit(path) and wait is not None:
                wait.wait(60)

        def after(self, path):
            if hit(path):
                print("KILLED-IN-SAVE", path, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    return KillAfterWrite


def main(out: str, mode: str, async_save: bool, step: int, root: str = "", keep: str = "all") -> None:
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    L = _lightning()
    import gdswriter.integrations.engines as shelf

    io = plugin(async_save)
    went_on = threading.Event() if keep == "top1" else None  # set once the step after ``step`` starts

    class AtStep(L.Callback):
        """At the end of step ``step``, before ModelCheckpoint (Lightning runs checkpoint
        callbacks last): wait for the earlier saves (so what the kill leaves does not depend on
        how far a background save got), then, between saves, die."""

        def on_train_batch_start(self, t, pl_module, batch, batch_idx):
            if went_on is not None and t.global_step == step:
                went_on.set()

        def on_train_batch_end(self, t, pl_module, outputs, batch, batch_idx):
            if t.global_step == step:
                io.teardown()  # the earlier saves are in place
                if mode == "between":
                    print("KILLED-BETWEEN", t.global_step, flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

    if mode == "in-save":
        shelf.create_engine = killing_engine_factory(step, root, went_on, async_save)  # the shelf builds every save's engines
    m = model(SEED)
    t = trainer(Path(out) / "run", callbacks=[AtStep(), checkpoints(Path(out) / "ckpts", keep)], plugins=[io])
    with one_thread():
        t.fit(m, data())
    print("FINISHED", flush=True)  # the kill never came


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), *sys.argv[5:])  # [ROOT [KEEP]]
