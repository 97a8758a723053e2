"""Hugging Face ``transformers.Trainer`` checkpoints through gdswriter, resumed exactly.

    from gdswriter.integrations.transformers import GDSTrainer
    trainer = GDSTrainer(model=model, args=TrainingArguments(output_dir="out", save_steps=500), ...)
    trainer.train()                                   # out/checkpoint-500/, out/checkpoint-1000/, ...
    trainer.train(resume_from_checkpoint=True)        # the newest complete one, or a checkpoint-N path
    GDSTrainer(..., gds_async_save=True)              # training goes on while the files are written

With a Trainer subclass of your own (or TRL's): ``class MyTrainer(GDSCheckpointing, SFTTrainer)``.

What changes. The Trainer keeps its own schedule (``save_strategy``, ``save_steps``,
``save_total_limit``, best-model tracking) and its ``checkpoint-N`` directories, with
``trainer_state.json`` (and the tokenizer's files) as before. Instead of model.safetensors,
optimizer.pt, scheduler.pt, scaler.pt, rng_state.pth and training_args.bin (pickled), each
checkpoint-N holds ``gdswriter/``: one committed step (N) with the model, the optimizer, the
LR scheduler, the gradient scaler (if any) and the RNG state of torch (CPU and CUDA), Python
and numpy, checksummed and never pickled. Resuming goes through the Trainer's own path: it
reads trainer_state.json, skips the batches already seen, and gets the model, optimizer,
scheduler and scaler from gdswriter (read straight into the live tensors) and the RNG state at
the moment it would load rng_state.pth, so the resumed run continues exactly as an
uninterrupted one. ``args.save_only_model`` saves the model alone. The model's config is
recorded, so ``gdswriter export out/checkpoint-500/gdswriter --to hf DIR`` gives a
``from_pretrained`` directory. A checkpoint-N directory written by the plain Trainer still
resumes (the Trainer's own loading is used for it).

Crash safety. A checkpoint is written into a hidden sibling, ``out/.gdswriter-tmp-checkpoint-N-*``,
that neither ``get_last_checkpoint`` nor the Trainer's rotation looks at; once the gdswriter
step is committed and trainer_state.json and the tokenizer's files are fsynced, it is renamed
to ``checkpoint-N`` (the directory fsynced): a ``checkpoint-N`` is always complete. Only then
does the rotation (``save_total_limit``) delete older checkpoints, so a crash at any moment
(SIGKILL, power cut) leaves the previous checkpoint in place and ``resume_from_checkpoint=True``
resumes from it; the next save removes the hidden leftover. The rotation never deletes the
checkpoint just made. Each checkpoint it deletes is first renamed to a hidden
``.gdswriter-tmp-checkpoint-M-removed-*`` (one atomic rename: out of sight of
``get_last_checkpoint`` and of the next rotation, never seen half deleted), then deleted on a
helper thread, so the save does not wait for it (unlinking a 2 GiB file takes 0.3-0.5 s on
ext4 with discard). The next save and the end of ``train()`` wait until it is gone, so the disk
never holds more than with the plain Trainer; a crash meanwhile leaves a hidden leftover that
the next save removes. Re-saving an existing checkpoint-N swaps the new directory in with one
atomic exchange. ``resume_from_checkpoint=True`` also skips checkpoint-N directories that
another writer left incomplete (no trainer_state.json, or an uncommitted ``gdswriter/``), with
a warning, where the plain Trainer would stop.

Asynchronous saves (``gds_async_save=True``). The save records the state and returns; the
bytes are written in the background, then the directory is renamed and the rotation runs,
on a helper thread (the older checkpoints renamed away there, and deleted as above). The
checkpoint holds exactly the values of its step: the Trainer's optimizer gets the
checkpointer's step pre-hook, so its next ``step()`` waits until the
save has copied the weights and optimizer state into the host pool, and saved tensors it
does not update are copied before the save returns (see ``GDSCheckpointer.save_async``).
trainer_state.json, the config and the tokenizer files are written at the call, with the
step's values, into the hidden directory: after a crash they and the tensors are either
all in checkpoint-N or none is. One save is in flight at a time: a save that comes while the
previous one is still writing waits for it (``gds_options=CheckpointOptions(on_busy="skip")``
skips it instead, with a warning). A failed background save is raised once, by the next
optimizer step, save or the end of ``train()``; ``gds_wait()`` waits for the save in flight.
``push_to_hub`` uploads a checkpoint right after its save, so it needs synchronous saves
(refused with ``gds_async_save``).

Engines and memory. The saves share the process's I/O engines (gdswriter/integrations/engines.py):
only the first save builds them. A synchronous save writes straight from the live tensors
(snapshot "live": no host pool, no copy); an asynchronous one copies into a host snapshot pool
of its own, freed once it is done. Between saves the process holds the shelf's idle engines. ``gds_engine_factory`` (a callable taking EngineOptions and
returning an IOEngine) builds them otherwise, e.g. a testing engine.

Limits. Single-process training (one GPU or CPU): with several processes, DeepSpeed or FSDP
the Trainer's own checkpointing stays in charge (this raises InvalidOptionError). Overrides
private Trainer methods (``_save_checkpoint``, whose bookkeeping it repeats: FLOs, best-model
path, stateful callbacks; ``_load_optimizer_and_scheduler``, ``_load_rng_state``...); tested
with transformers 5.24.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from ..checkpointer import GDSCheckpointer, SaveHandle
from ..engines.base import IOEngine
from ..errors import InvalidOptionError
from ..export import HF_CONFIG_KEY
from ..format.commit import CommitProtocol
from ..fs import fsync_dir, fsync_file, replace_dir
from ..options import CheckpointOptions, EngineOptions
from ..rng import rng_state, set_rng_state
from .engines import ENGINES

log = logging.getLogger("gdswriter")

__all__ = ["GDSCheckpointing", "GDSTrainer", "GDS_DIR"]

GDS_DIR = "gdswriter"
"""The gdswriter root inside each checkpoint-N directory."""
TMP_PREFIX = ".gdswriter-tmp-"
"""A checkpoint-N being written: ``.gdswriter-tmp-checkpoint-N-<hex>``, renamed once complete."""
TRAINER_STATE_NAME = "trainer_state.json"

_IN_FLIGHT: set[Path] = set()  # this process's hidden directories still being written or deleted (not leftovers)
_IN_FLIGHT_LOCK = threading.Lock()


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


def is_complete(checkpoint: Path) -> bool:
    """Whether a checkpoint-N directory can be resumed from: trainer_state.json, and a committed
    step where it holds ``gdswriter/`` (one the plain Trainer wrote is taken as it is)."""
    if not (checkpoint / TRAINER_STATE_NAME).is_file():
        return False
    return not (checkpoint / GDS_DIR).exists() or is_gds_checkpoint(checkpoint)


def newest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The checkpoint-N directory with the highest N under ``output_dir`` that is complete
    (``is_complete``); incomplete ones (another writer's crash) are skipped with a warning."""
    found = []
    for p in Path(output_dir).iterdir() if Path(output_dir).is_dir() else ():
        head, _, n = p.name.rpartition("-")
        if head == PREFIX_CHECKPOINT_DIR and n.isdigit() and p.is_dir():
            found.append((int(n), p))
    for _, p in sorted(found, reverse=True):
        if is_complete(p):
            return str(p)
        log.warning("gdswriter: %s is incomplete (no %s, or no committed %s/ step: a crashed save): resuming "
                    "from an older checkpoint", p, TRAINER_STATE_NAME, GDS_DIR)
    return None


@dataclass
class _Job:
    """One checkpoint on its way: written into ``tmp``, to become ``final``."""

    step: int
    ckpt: GDSCheckpointer
    handle: SaveHandle
    tmp: Path
    final: Path
    run_dir: Path


def _fsync_files(top: Path, skip: str) -> None:
    """fsync every regular file and directory under ``top`` (not under ``top/skip``: gdswriter's
    root, durable already), then ``top``."""
    for dirpath, dirnames, filenames in os.walk(top):
        if Path(dirpath) == top and skip in dirnames:
            dirnames.remove(skip)
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        if Path(dirpath) != top:
            fsync_dir(dirpath)
    fsync_dir(top)


def publish_checkpoint(tmp: Path, final: Path) -> None:
    """Make the complete directory ``tmp`` appear as ``final`` durably (fs.replace_dir: replacing
    an older one in one atomic exchange where the file system allows), then delete the older one.
    Every publication goes through this module-level name: a seam that tests wrap to check
    the order of publications and deletions (as does delete_rotated)."""
    old = replace_dir(tmp, final, final.with_name(f"{TMP_PREFIX}{final.name}-old-{secrets.token_hex(4)}"))
    if old is not None:
        shutil.rmtree(old)


class GDSCheckpointing:
    """Mix into a ``transformers.Trainer`` (first in the bases) to checkpoint through gdswriter.

    ``gds_options``: CheckpointOptions for every save and load (engine, verify, on_busy...).
    ``gds_async_save``: write in the background (see the module doc). ``gds_engine_factory``:
    builds the I/O engines (EngineOptions -> IOEngine; default: create_engine). Each may be
    given to the constructor or set as a class attribute."""

    gds_options: CheckpointOptions | None = None
    gds_async_save: bool = False
    gds_engine_factory: Callable[[EngineOptions], IOEngine] | None = None
    _gds_rng: _RNG | None = None

    def __init__(self, *args, gds_options: CheckpointOptions | None = None, gds_async_save: bool | None = None,
                 gds_engine_factory: Callable[[EngineOptions], IOEngine] | None = None, **kwargs):
        if gds_options is not None:
            if not isinstance(gds_options, CheckpointOptions):
                raise InvalidOptionError(f"gds_options must be a CheckpointOptions, got {type(gds_options).__name__}")
            self.gds_options = gds_options
        if gds_async_save is not None:
            if not isinstance(gds_async_save, bool):
                raise InvalidOptionError(f"gds_async_save must be True or False, got {gds_async_save!r}")
            self.gds_async_save = gds_async_save
        if gds_engine_factory is not None:
            if not callable(gds_engine_factory):
                raise InvalidOptionError("gds_engine_factory must be a callable taking EngineOptions and returning "
                                         "an IOEngine")
            self.gds_engine_factory = gds_engine_factory
        super().__init__(*args, **kwargs)

    # -- bookkeeping of the saves in flight -------------------------------------
    def _gds_jobs(self) -> dict:
        """This trainer's background state, made on first use (a subclass's __init__ may skip ours)."""
        jobs = self.__dict__.get("_gds_bg")
        if jobs is None:
            jobs = self.__dict__.setdefault("_gds_bg", {"queue": [], "thread": None, "errors": [], "failed": [], "done": [],
                                                        "removing": [], "remover": None,
                                                        "cv": threading.Condition()})
        return jobs

    # -- which objects a checkpoint holds --------------------------------------
    def _gds_check_supported(self) -> None:
        if self.args.world_size > 1 or getattr(self, "is_deepspeed_enabled", False) \
                or getattr(self, "is_fsdp_enabled", False):
            raise InvalidOptionError("GDSCheckpointing handles single-process training; with several processes, "
                                     "DeepSpeed or FSDP use the plain Trainer (or gdswriter's DCP storage writer)")

    def _gds_checkpointer(self, root: Path, *, model_only: bool, rng: _RNG | None = None,
                          blocking: bool = True) -> GDSCheckpointer:
        state: dict[str, Any] = {}
        optimizer = None
        if not model_only:
            optimizer = self.optimizer
            state["lr_scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = rng or _RNG()
        return self._gds_open(self.model, optimizer, root=root, state=state, keep_last=1, blocking=blocking)

    def _gds_open(self, model: Any, optimizer: Any = None, *, blocking: bool = True, **kw) -> GDSCheckpointer:
        """A checkpointer on the process's shared engines (handed back when it closes). A
        ``blocking`` one (loads, synchronous saves) writes from the live tensors: nothing to
        copy while the caller waits anyway, so no host snapshot pool."""
        options = self.gds_options or CheckpointOptions()
        if blocking:
            options = dataclasses.replace(options, snapshot="live")
        engines = ENGINES.lease(options.engine, 1, self.gds_engine_factory)
        try:
            return GDSCheckpointer(model, optimizer, options=options, engines=engines, **kw)
        except BaseException:
            for e in engines:
                e.close()
            raise

    # -- save ------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's own checkpoint step (FLOs, best-model path, stateful callbacks,
        trainer_state.json, rotation), with the model, optimizer, scheduler, scaler and RNG
        written by gdswriter, into a hidden directory renamed to checkpoint-N once complete."""
        self._gds_check_supported()
        if self.gds_async_save and self.args.push_to_hub:
            raise InvalidOptionError("push_to_hub uploads each checkpoint right after its save; with "
                                     "gds_async_save=True it is not written yet: use gds_async_save=False")
        step = self.state.global_step
        if not self._gds_room(step):
            return
        self._gds_raise()  # a failed background save, once
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = Path(self._get_output_dir(trial=trial))
        final = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        # As the Trainer: the best checkpoint's path, once its directory exists (or is this one).
        best_step = self.state.best_global_step
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and best_step:
            best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{best_step}"
            if best_step == step or best.exists():
                self.state.best_model_checkpoint = str(best)
        if not self.args.should_save:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(run_dir)
        tmp = run_dir / f"{TMP_PREFIX}{final.name}-{secrets.token_hex(4)}"
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(tmp)
        try:
            tmp.mkdir()
            job = self._gds_write(step, tmp, final, run_dir)
        except BaseException:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.gds_async_save:
            self._gds_enqueue(job)
        else:
            self._gds_complete(job, close=True)  # raises a failure here
            if self.args.push_to_hub:
                self._push_from_checkpoint(str(final))

    def _gds_room(self, step: int) -> bool:
        """Wait until the earlier saves are in place (one in flight at a time); False (skip this
        one, warned) when one is still being written and CheckpointOptions.on_busy is "skip"."""
        bg = self._gds_jobs()
        with bg["cv"]:
            busy = [j for j in bg["queue"] if not j.handle.done()]
            if busy and (self.gds_options or CheckpointOptions()).on_busy == "skip":
                log.warning("gdswriter: checkpoint-%d not saved: checkpoint-%d is still being written "
                            "(on_busy='skip')", step, busy[0].step)
                return False
            while bg["queue"] or bg["remover"] is not None:  # and the rotated ones deleted: disk as before
                bg["cv"].wait()
        return True

    def _gds_write(self, step: int, tmp: Path, final: Path, run_dir: Path) -> _Job:
        """Start the step's save into ``tmp`` and write the Trainer's JSON files there, all with
        the values of this moment."""
        config = getattr(self.model, "config", None)
        metadata = {HF_CONFIG_KEY: json.loads(config.to_json_string())} if config is not None else None
        ckpt = self._gds_checkpointer(tmp / GDS_DIR, model_only=self.args.save_only_model,
                                      blocking=not self.gds_async_save)
        try:
            handle = ckpt.save_async(step, metadata=metadata)
            # Update `ExportableState` callbacks and `TrainerControl` state (the Trainer's own code)
            for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                       if isinstance(cb, ExportableState)]:
                cb_name = cb.__class__.__name__
                cb_state = cb.state()
                if isinstance(self.state.stateful_callbacks[cb_name], list):
                    self.state.stateful_callbacks[cb_name].append(cb_state)
                else:
                    self.state.stateful_callbacks[cb_name] = cb_state
            self.state.save_to_json(str(tmp / TRAINER_STATE_NAME))
            if getattr(self, "processing_class", None) is not None:
                self.processing_class.save_pretrained(str(tmp))  # tokenizer files: JSON, text
        except BaseException:
            try:
                ckpt.close()
            except BaseException as e:  # noqa: BLE001 - the first error is the one to raise
                log.error("gdswriter: closing the checkpointer of an abandoned save failed too: %s", e)
            raise
        return _Job(step, ckpt, handle, tmp, final, run_dir)

    def _gds_complete(self, job: _Job, *, close: bool) -> None:
        """Wait for ``job``'s step to commit, make its files durable, rename it into place, then
        rotate. On failure the hidden directory goes and the error is raised. ``close`` (the
        training thread): close the checkpointer here and report the save's failure. The helper
        thread does neither: closing removes the checkpointer's hook from the optimizer the
        training thread steps, and that hook is what raises a failure at the next step."""
        try:
            try:
                if close:
                    job.handle.result()
                else:
                    _wait_unreported(job.handle)
                job.ckpt.steps()  # waits for its retention pass, which lists the root
            finally:
                if close:
                    job.ckpt.close()
            _fsync_files(job.tmp, GDS_DIR)
            publish_checkpoint(job.tmp, job.final)
        except BaseException:
            shutil.rmtree(job.tmp, ignore_errors=True)
            raise
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(job.tmp)
        if self.args.should_save:  # only now: the newest checkpoint is complete before any older one goes
            self._gds_rotate(job)

    def _gds_rotate(self, job: _Job) -> None:
        """The Trainer's rotation (``rotate_checkpoints``: keep ``save_total_limit``, the most
        recent by mtime and the best), also keeping ``job.final``, the one just made; each one
        to go is renamed out of sight now and deleted by the remover thread."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        checkpoints = sort_checkpoints(str(job.run_dir), PREFIX_CHECKPOINT_DIR, use_mtime=True)
        if len(checkpoints) <= limit:
            return
        protected = {checkpoints[-1], str(job.final)}
        if self.state.best_model_checkpoint is not None:
            protected.add(str(Path(self.state.best_model_checkpoint)))
        remaining, keep = len(checkpoints), max(limit, len(protected))
        for checkpoint in checkpoints:
            if remaining <= keep:
                break
            if checkpoint not in protected:
                self._gds_remove(Path(checkpoint))
                remaining -= 1

    def _gds_remove(self, checkpoint: Path) -> None:
        """Rename ``checkpoint`` to a hidden name (it is gone for the Trainer at once), then
        delete it on the remover thread. A symbolic link is deleted here, as the Trainer does."""
        if checkpoint.is_symlink():
            shutil.rmtree(checkpoint, ignore_errors=True)
            return
        hidden = checkpoint.with_name(f"{TMP_PREFIX}{checkpoint.name}-removed-{secrets.token_hex(4)}")
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(hidden)  # not a leftover for another save's _remove_leftovers
        try:
            os.rename(checkpoint, hidden)
        except OSError as e:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(hidden)
            log.warning("gdswriter: could not remove %s (rotation, save_total_limit): %s", checkpoint, e)
            return
        bg = self._gds_jobs()
        with bg["cv"]:
            bg["removing"].append(hidden)
            if bg["remover"] is None:
                bg["remover"] = threading.Thread(target=self._gds_remover, name="gdswriter-hf-remove",
                                                 daemon=False)
                bg["remover"].start()

    def _gds_remover(self) -> None:
        """The remover thread: deletes the rotated checkpoints in turn, then ends."""
        bg = self._gds_jobs()
        while True:
            with bg["cv"]:
                if not bg["removing"]:
                    bg["remover"] = None
                    bg["cv"].notify_all()
                    return
                hidden = bg["removing"][0]
            try:
                delete_rotated(hidden)
            except BaseException as e:  # noqa: BLE001 - the thread must go on, and end, for the waiters
                log.warning("gdswriter: deleting %s (rotation, save_total_limit) failed: %s", hidden, e)
            finally:
                with _IN_FLIGHT_LOCK:
                    _IN_FLIGHT.discard(hidden)
                with bg["cv"]:
                    bg["removing"].pop(0)

    def _gds_wait_removed(self) -> None:
        """Wait until the checkpoints rotated away are deleted."""
        bg = self._gds_jobs()
        with bg["cv"]:
            while bg["remover"] is not None:
                bg["cv"].wait()

    def _gds_close_done(self) -> None:
        """Close the checkpointers of the saves the helper thread completed (training thread)."""
        bg = self._gds_jobs()
        with bg["cv"]:
            done, bg["done"] = bg["done"], []
        for job in done:
            try:
                job.ckpt.close()
            except BaseException as e:  # noqa: BLE001 - its failure was recorded by the helper thread
                log.debug("gdswriter: closing the checkpointer of step %d: %s", job.step, e)

    def _gds_enqueue(self, job: _Job) -> None:
        bg = self._gds_jobs()
        with bg["cv"]:
            bg["queue"].append(job)
            if bg["thread"] is None:
                bg["thread"] = threading.Thread(target=self._gds_finisher, name="gdswriter-hf-finish", daemon=False)
                bg["thread"].start()

    def _gds_finisher(self) -> None:
        """The helper thread: completes the queued saves in order, then ends (it never waits
        idle, so it never holds up the interpreter's exit)."""
        bg = self._gds_jobs()
        while True:
            with bg["cv"]:
                if not bg["queue"]:
                    bg["thread"] = None
                    bg["cv"].notify_all()
                    return
                job = bg["queue"][0]
            try:
                self._gds_complete(job, close=False)
            except BaseException as e:  # noqa: BLE001 - raised on the training thread (_gds_raise)
                with bg["cv"]:
                    if e is job.handle.exception():
                        bg["failed"].append(job)  # the save's own failure: the optimizer's hook may report it
                    else:
                        bg["errors"].append(e)  # making it durable or renaming it failed
            finally:
                with bg["cv"]:
                    bg["queue"].pop(0)
                    bg["done"].append(job)
                    bg["cv"].notify_all()

    def _gds_raise(self) -> None:
        """Raise the first background failure not reported yet (the others are logged), then
        close the checkpointers of the completed saves."""
        bg = self._gds_jobs()
        with bg["cv"]:
            failed, errors, bg["failed"], bg["errors"] = bg["failed"], bg["errors"], [], []
        found: list[BaseException] = []
        try:
            for job in failed:
                if job.handle.reported:  # raised already, by the optimizer step's hook
                    continue
                try:
                    job.handle.result()  # marks it reported: the hook will not raise it again
                except BaseException as e:  # noqa: BLE001 - raised below
                    found.append(e)
            found += errors
            if found:
                for e in found[1:]:
                    log.error("gdswriter: another checkpoint save also failed: %s", e)
                raise found[0]
        finally:
            self._gds_close_done()

    def gds_wait(self) -> None:
        """Wait until every checkpoint saved so far is in place (and the older ones rotated out
        of sight; their deletion may still run); raise a background failure not reported yet."""
        bg = self._gds_jobs()
        with bg["cv"]:
            while bg["thread"] is not None:
                bg["cv"].wait()
        self._gds_raise()

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """The Trainer's ``train``; ``resume_from_checkpoint=True`` takes the newest complete
        checkpoint, and the saves still in flight are in place (the rotated ones deleted) when it
        returns."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            try:
                self.gds_wait()
            except BaseException as e:  # noqa: BLE001 - the training error is the one to raise
                log.error("gdswriter: a background checkpoint save also failed: %s", e)
            finally:
                self._gds_wait_removed()
            raise
        self.gds_wait()
        self._gds_wait_removed()
        return out

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
        self.gds_wait()  # the best checkpoint may still be on its way
        best = self.state.best_model_checkpoint
        if not is_gds_checkpoint(best):
            return super()._load_best_model()
        with self._gds_open(self.model, root=Path(best) / GDS_DIR) as ckpt:
            ckpt.load()
        return None


def _wait_unreported(handle: SaveHandle) -> None:
    """Wait until ``handle``'s save is done without taking its failure (``result()`` would mark
    it reported, and the optimizer step's hook would then not raise it): after the snapshot,
    a poll every 2 ms for the commit."""
    handle.wait_snapshotted()
    while not handle.done():
        time.sleep(0.002)
    error = handle.exception()
    if error is not None:
        raise error


def delete_rotated(hidden: Path) -> None:
    """Delete a checkpoint the rotation renamed away (errors ignored, as the Trainer's rotation)."""
    shutil.rmtree(hidden, ignore_errors=True)


def _remove_leftovers(run_dir: Path) -> None:
    """Remove the hidden directories of saves that never completed (a crash), not this
    process's own in flight."""
    with _IN_FLIGHT_LOCK:
        mine = set(_IN_FLIGHT)
    for p in run_dir.iterdir():
        if p.name.startswith(f"{TMP_PREFIX}{PREFIX_CHECKPOINT_DIR}-") and p not in mine and not p.is_symlink() \
                and p.is_dir():
            log.info("gdswriter: removing %s, left by a save that did not complete", p)
            shutil.rmtree(p, ignore_errors=True)


def _saved_parts(root: Path) -> set[str]:
    """Top-level parts ("model", "optimizer", "extra"...) of the latest step under ``root``."""
    from ..load.reader import read_manifest, state_keys

    protocol = CommitProtocol([root])
    return set(state_keys(read_manifest(protocol, protocol.require(None))) or ())


class GDSTrainer(GDSCheckpointing, Trainer):
    """``transformers.Trainer`` whose checkpoints go through gdswriter (see the module doc)."""
