"""The Hugging Face Trainer integration (gdswriter/integrations/transformers.py) on the CPU with a
tiny GPT-2 built from a config (no download): a run stopped mid-epoch at step 4 and resumed from
its gdswriter checkpoint ends exactly where an uninterrupted run ends (weights, optimizer,
scheduler, RNG: the model has dropout and the data is shuffled, so any RNG slip shows)."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
from support.trees import assert_same_tree

transformers = pytest.importorskip("transformers")

from gdswriter import load_state  # noqa: E402
from gdswriter.cli import main  # noqa: E402
from gdswriter.integrations.transformers import GDS_DIR, GDSCheckpointing, GDSTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model(seed: int):
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def _data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (16, 12), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]  # 8 steps per epoch at batch size 2


def _args(out, **kw):
    return transformers.TrainingArguments(**{
        "output_dir": str(out), "max_steps": 8, "per_device_train_batch_size": 2, "learning_rate": 5e-3,
        "warmup_steps": 2, "lr_scheduler_type": "linear", "save_strategy": "steps", "save_steps": 4,
        "logging_steps": 100, "report_to": [], "use_cpu": True, "seed": 7, "disable_tqdm": True,
        "dataloader_num_workers": 0, **kw})


class StopAt(transformers.TrainerCallback):
    """Stops the run after ``step`` (a crash right after a checkpoint)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def _final(trainer) -> dict:
    return {"weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.lr_scheduler.state_dict(),
            "step": trainer.state.global_step, "rng": torch.get_rng_state()}


def test_trainer_stopped_mid_epoch_and_resumed_matches_an_uninterrupted_run(tmp_path, capsys):
    straight = GDSTrainer(model=_model(1), args=_args(tmp_path / "a"), train_dataset=_data())
    straight.train()
    expected = _final(straight)
    assert expected["step"] == 8

    first = GDSTrainer(model=_model(1), args=_args(tmp_path / "b"), train_dataset=_data(), callbacks=[StopAt(4)])
    first.train()
    ckpt = tmp_path / "b" / "checkpoint-4"
    names = sorted(os.listdir(ckpt))
    assert names == [GDS_DIR, "trainer_state.json"], names  # no optimizer.pt, rng_state.pth, training_args.bin

    resumed = GDSTrainer(model=_model(99), args=_args(tmp_path / "b"), train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(ckpt))
    got = _final(resumed)
    assert_same_tree(expected, got)

    # the checkpoint also exports to a from_pretrained directory, config included
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "b" / "checkpoint-8" / GDS_DIR), "--to", "hf", str(out)]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert_same_tree(got["weights"], loaded.state_dict())
    capsys.readouterr()


def test_resume_true_picks_the_newest_and_rotation_and_best_model_work(tmp_path):
    args = _args(tmp_path, save_total_limit=1)
    t = GDSTrainer(model=_model(2), args=args, train_dataset=_data())
    t.train()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-8"]
    again = GDSTrainer(model=_model(3), args=args,
                       train_dataset=_data())
    again.train(resume_from_checkpoint=True)  # newest checkpoint: already at max_steps, nothing to train
    assert_same_tree({k: v for k, v in t.model.state_dict().items()}, again.model.state_dict())


def test_save_only_model_and_plain_trainer_checkpoints(tmp_path):
    t = GDSTrainer(model=_model(4), args=_args(tmp_path / "m", save_only_model=True), train_dataset=_data(),
                   callbacks=[StopAt(4)])
    t.train()
    r = GDSTrainer(model=_model(5), args=_args(tmp_path / "m", save_only_model=True), train_dataset=_data())
    r.train(resume_from_checkpoint=str(tmp_path / "m" / "checkpoint-4"))  # model only: loads, trains on
    assert r.state.global_step == 8
    # a checkpoint the plain Trainer wrote still resumes through its own loading
    plain = transformers.Trainer(model=_model(6), args=_args(tmp_path / "p"), train_dataset=_data(),
                                 callbacks=[StopAt(4)])
    plain.train()
    assert (tmp_path / "p" / "checkpoint-4" / "model.safetensors").exists()
    back = GDSTrainer(model=_model(7), args=_args(tmp_path / "p"), train_dataset=_data())
    back.train(resume_from_checkpoint=str(tmp_path / "p" / "checkpoint-4"))
    assert back.state.global_step == 8


def test_mixin_composes_with_a_trainer_subclass(tmp_path):
    class Custom(transformers.Trainer):
        pass

    class Mine(GDSCheckpointing, Custom):
        pass

    t = Mine(model=_model(8), args=_args(tmp_path, max_steps=4), train_dataset=_data())
    t.train()
    assert (tmp_path / "checkpoint-4" / GDS_DIR / "latest").exists()


class RecordEachStep(transformers.TrainerCallback):
    """The weights and optimizer state at each step's end (on_step_end runs right before the
    Trainer saves that step), by global step."""

    def __init__(self):
        self.trainer = None
        self.at: dict[int, dict] = {}

    def on_step_end(self, args, state, control, **kw):
        opt = self.trainer.optimizer.state_dict()["state"]
        self.at[state.global_step] = {
            "weights": {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()},
            "optimizer": {i: {k: v.clone() for k, v in st.items()} for i, st in opt.items()}}
        return control


def test_each_checkpoint_holds_exactly_the_weights_of_its_step(tmp_path):
    """Issue 22 item 3, for the Hugging Face Trainer: saved every step, with a 4 MiB embedding
    (above every small-copy threshold) and its AdamW moments, each checkpoint-N holds exactly
    the weights and optimizer state at step N (the save returns durable before training goes
    on: GDSCheckpointing saves with ckpt.save, not save_async)."""
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=256, vocab_size=4096, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.transformer.wte.weight.numel() * 4 == 4 << 20
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (10, 12), generator=g)
    rec = RecordEachStep()
    trainer = GDSTrainer(model=model, args=_args(tmp_path, max_steps=5, save_steps=1, warmup_steps=0),
                         train_dataset=[{"input_ids": r, "labels": r} for r in ids], callbacks=[rec])
    rec.trainer = trainer
    trainer.train()
    assert sorted(rec.at) == [1, 2, 3, 4, 5]
    torn = []
    for step, want in rec.at.items():
        _, st = load_state(tmp_path / f"checkpoint-{step}" / GDS_DIR)
        got_w, got_o = st["model"], st["optimizer"]["state"]
        assert got_w.keys() == want["weights"].keys() and got_o.keys() == want["optimizer"].keys()
        same = all(torch.equal(got_w[k], v) for k, v in want["weights"].items()) and all(
            torch.equal(got_o[i][k], v) for i, s in want["optimizer"].items() for k, v in s.items())
        if not same:
            torn.append(step)
    assert not torn, f"checkpoints not holding the weights of the step they name: {torn}"
