"""A Hugging Face Trainer run for the integration's kill tests: the model, data and arguments a
test uses in its own process, and a child (``python -m support.hf_run OUT MODE ASYNC STEP``)
that trains through GDSTrainer and dies of SIGKILL at a chosen point:

* ``in-save``: while step STEP's data file is being written (the engine that writes it kills
  the process right after that file is on disk: the step is not committed);
* ``between``: at the end of step STEP (after the earlier saves are in place).

The model is a 1-layer GPT-2 with a 4 MiB embedding (above every small-copy threshold) and
dropout, trained on shuffled data: any slip of weights, optimizer, scheduler or RNG shows in
the final weights.

Every run trains on one intra-op thread (the child here; the tests' uninterrupted and resumed
runs inside ``one_thread``): a run split over two processes is compared bit for bit with one
made in a single process, and with torch's default threads a parallel kernel's threads may
finish in another order under load and round differently (CI once ended a resumed run's
embedding a few ulps off an uninterrupted one; issue 37 found the same in Lightning's)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

MAX_STEPS = 12
SAVE_STEPS = 4


def model(seed: int):
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=256, vocab_size=4096, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (16, 12), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]  # 8 steps per epoch at batch size 2


def args(out, **kw):
    import transformers

    return transformers.TrainingArguments(**{
        "output_dir": str(out), "max_steps": MAX_STEPS, "per_device_train_batch_size": 2, "learning_rate": 5e-3,
        "warmup_steps": 2, "lr_scheduler_type": "linear", "save_strategy": "steps", "save_steps": SAVE_STEPS,
        "save_total_limit": 1, "logging_steps": 100, "report_to": [], "use_cpu": True, "seed": 7,
        "disable_tqdm": True, "dataloader_num_workers": 0, **kw})


def final_state(trainer) -> dict:
    return {"weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.lr_scheduler.state_dict(),
            "step": trainer.state.global_step, "rng": torch.get_rng_state()}


def killing_engine_factory(step: int):
    """Engines that SIGKILL the process once they have written a data file of ``step``."""
    from support.engines import HookedWrites

    marker = f"step_{step:012d}"

    class KillAfterWrite(HookedWrites):
        def after(self, path):
            if marker in str(path):
                print("KILLED-IN-SAVE", path, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    return KillAfterWrite


def main(out: str, mode: str, async_save: bool, step: int) -> None:
    import transformers

    from gdswriter.integrations.transformers import GDSTrainer

    torch.set_num_threads(1)  # as the tests' runs (see the module's docstring)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.set_verbosity_error()

    class KillAtStepEnd(transformers.TrainerCallback):
        def __init__(self):
            self.trainer = None

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == step:
                self.trainer.gds_wait()  # the earlier saves are in place
                print("KILLED-BETWEEN", state.global_step, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return control

    cb = KillAtStepEnd() if mode == "between" else None
    factory = killing_engine_factory(step) if mode == "in-save" else None
    trainer = GDSTrainer(model=model(1), args=args(Path(out)), train_dataset=data(), callbacks=[cb] if cb else [],
                         gds_async_save=async_save, gds_engine_factory=factory)
    if cb:
        cb.trainer = trainer
    trainer.train()
    print("FINISHED", flush=True)  # the kill never came


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]))
