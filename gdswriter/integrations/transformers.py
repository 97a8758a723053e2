"""Hugging Face ``transformers.Trainer`` checkpoints through gdswriter, resumed exactly.

    from gdswriter.integrations.transformers import GDSTrainer
    trainer = GDSTrainer(model=model, args=TrainingArguments(output_dir="out", save_steps=500), ...)
    trainer.train()                                   # out/checkpoint-500/, out/checkpoint-1000/, ...
    trainer.train(resume_from_checkpoint=True)        # the newest one, or a checkpoint-N path

With a Trainer subclass of your own (or TRL's): ``class MyTrainer(GDSCheckpointing, SFTTrainer)``.

What changes. The Trainer keeps its own schedule (``save_strategy``, ``save_steps``,
``save_total_limit``, best-model tracking) and its ``checkpoint-N`` directories, with
``trainer_state.json`` as before (JSON). Instead of model.safetensors, optimizer.pt,
scheduler.pt, scaler.pt, rng_state.pth and training_args.bin (pickled), each checkpoint-N holds
``gdswriter/``: one committed step (N) with the model, the optimizer, the LR scheduler, the
gradient scaler (if any) and the RNG state of torch (CPU and CUDA), Python and numpy,
checksummed and never pickled. Resuming goes through the Trainer's own path: it reads
trainer_state.json, skips the batches already seen, and gets the model, optimizer, scheduler
and scaler from gdswriter (read straight into the live tensors) and the RNG state at the
moment it would load rng_state.pth, so the resumed run continues exactly as an uninterrupted
one. ``args.save_only_model`` saves the model alone. The model's config is recorded, so
``gdswriter export out/checkpoint-500/gdswriter --to hf DIR`` gives a ``from_pretrained``
directory. A checkpoint-N directory written by the plain Trainer still resumes (the Trainer's
own loading is used for it).

Limits. Single-process training (one GPU or CPU): with several processes, DeepSpeed or FSDP
the Trainer's own checkpointing stays in charge (this raises InvalidOptionError). Overrides
private Trainer methods (``_save_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_rng_state``...); tested with transformers 5.24.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from transformers import Trainer

from ..checkpointer import GDSCheckpointer
from ..errors import InvalidOptionError
from ..export import HF_CONFIG_KEY
from ..format.commit import CommitProtocol
from ..options import CheckpointOptions
from ..rng import rng_state, set_rng_state

log = logging.getLogger("gdswriter")

__all__ = ["GDSCheckpointing", "GDSTrainer", "GDS_DIR"]

GDS_DIR = "gdswriter"
"""The gdswriter root inside each checkpoint-N directory."""


class _RNG:
    """The process's RNG state as a state_dict()/load_state_dict() object: saved with the rest,
    applied only when the Trainer asks (after it skipped the batches already seen)."""

    def __init__(self) -> None:
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def is_gds_checkpoint(checkpoint: str | os.PathLike | None) -> bool:
    """Whether ``checkpoint`` (a checkpoint-N directory) holds a committed gdswriter step."""
    if checkpoint is None:
        return False
    root = Path(os.fspath(checkpoint)) / GDS_DIR
    return root.is_dir() and CommitProtocol([root]).latest() is not None


class GDSCheckpointing:
    """Mix into a ``transformers.Trainer`` (first in the bases) to checkpoint through gdswriter.

    ``gds_options``: CheckpointOptions for every save and load (engine, verify...)."""

    gds_options: CheckpointOptions | None = None
    _gds_saving = False
    _gds_rng: _RNG | None = None

    # -- which objects a checkpoint holds --------------------------------------
    def _gds_check_supported(self) -> None:
        if self.args.world_size > 1 or getattr(self, "is_deepspeed_enabled", False) \
                or getattr(self, "is_fsdp_enabled", False):
            raise InvalidOptionError("GDSCheckpointing handles single-process training; with several processes, "
                                     "DeepSpeed or FSDP use the plain Trainer (or gdswriter's DCP storage writer)")

    def _gds_checkpointer(self, root: Path, *, model_only: bool, rng: _RNG | None = None) -> GDSCheckpointer:
        state: dict[str, Any] = {}
        optimizer = None
        if not model_only:
            optimizer = self.optimizer
            state["lr_scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = rng or _RNG()
        return GDSCheckpointer(self.model, optimizer, root=root, state=state, options=self.gds_options, keep_last=1)

    # -- save ------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's own checkpoint step (directory, best-model bookkeeping, trainer_state.json,
        rotation), with its model, optimizer, scheduler, scaler and RNG files written by gdswriter."""
        self._gds_check_supported()
        self._gds_saving = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._gds_saving = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._gds_saving:
            return super().save_model(output_dir, _internal_call)
        root = Path(output_dir or self.args.output_dir) / GDS_DIR
        config = getattr(self.model, "config", None)
        metadata = {HF_CONFIG_KEY: json.loads(config.to_json_string())} if config is not None else None
        if self.args.should_save:
            with self._gds_checkpointer(root, model_only=self.args.save_only_model) as ckpt:
                ckpt.save(self.state.global_step, metadata=metadata)
            if getattr(self, "processing_class", None) is not None:
                self.processing_class.save_pretrained(output_dir)  # tokenizer files: JSON, text
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._gds_saving:
            super()._save_optimizer_and_scheduler(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        if not self._gds_saving:
            super()._save_scaler(output_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._gds_saving:
            super()._save_rng_state(output_dir)

    # -- load ------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not is_gds_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._gds_check_supported()
        # Loaded with the optimizer (_load_optimizer_and_scheduler), straight into the live tensors.
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not is_gds_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        root = Path(os.fspath(checkpoint)) / GDS_DIR
        saved = _saved_parts(root)
        self._gds_rng = _RNG()
        with self._gds_checkpointer(root, model_only="optimizer" not in saved, rng=self._gds_rng) as ckpt:
            step = ckpt.load()
        log.info("gdswriter: resumed model%s from %s (step %d)",
                 "" if "optimizer" not in saved else ", optimizer, scheduler and RNG", root, step)
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not is_gds_checkpoint(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not is_gds_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)
        rng = self._gds_rng.loaded if self._gds_rng is not None else None
        if rng is None:
            log.info("gdswriter: %s holds no RNG state (saved with save_only_model?): the resumed run is not "
                     "bit-exact", checkpoint)
            return None
        set_rng_state(rng)
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not is_gds_checkpoint(best):
            return super()._load_best_model()
        with GDSCheckpointer(self.model, root=Path(best) / GDS_DIR, options=self.gds_options) as ckpt:
            ckpt.load()
        return None


def _saved_parts(root: Path) -> set[str]:
    """Top-level parts ("model", "optimizer", "extra"...) of the latest step under ``root``."""
    from ..load.reader import read_manifest, state_keys

    protocol = CommitProtocol([root])
    return set(state_keys(read_manifest(protocol, protocol.require(None))) or ())


class GDSTrainer(GDSCheckpointing, Trainer):
    """``transformers.Trainer`` whose checkpoints go through gdswriter (see the module doc)."""
