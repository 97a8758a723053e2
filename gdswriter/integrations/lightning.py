"""PyTorch Lightning (2.x) checkpoints through gdswriter: ``Trainer(plugins=[GDSCheckpointIO()])``.

    from gdswriter.integrations.lightning import GDSCheckpointIO
    trainer = L.Trainer(plugins=[GDSCheckpointIO()], callbacks=[ModelCheckpoint(dirpath="ckpts")])
    trainer.fit(model)                                   # saves ckpts/epoch=0-step=100.ckpt, ...
    trainer.fit(model, ckpt_path="ckpts/last.ckpt")      # resumes exactly where that save stood

Paths. Lightning names one path per checkpoint (``ckpts/epoch=0-step=100.ckpt``). Here that
path is a gdswriter root, a directory holding one committed step (the global step) with its
data files and manifest: complete or absent after a crash, checksummed, never pickled.
Re-saving the same path (``last.ckpt``) commits the new step and drops the older one.
``ModelCheckpoint``'s top-k pruning removes whole directories; ``save_last="link"`` links
them. After a crash mid-save (kill -9) the previous checkpoint still loads: a re-saved path
(``last.ckpt``) keeps its older step until the new one is committed, and a removal Lightning
asks for while saves to other paths are in flight waits until they are committed (kept if one
fails); a new path whose save was cut holds no committed step, and loading it raises
CheckpointNotFoundError (Lightning names the next save of that path ``...-v1.ckpt``; with
``save_last="link"`` and asynchronous saves, ``last.ckpt`` may link to that torn path: resume
from the path before it). Everything that goes through the Trainer works
(``fit/validate/test(ckpt_path=...)``, ``"last"``, ``"best"``);
``LightningModule.load_from_checkpoint`` reads with torch.load and bypasses plug-ins: use
``GDSCheckpointIO().load_checkpoint(path)`` and ``model.load_state_dict(ckpt["state_dict"])``
instead, or ``gdswriter export PATH --to safetensors --model-only`` for the weights alone.

Asynchronous saves (default). ``save_checkpoint`` records the state and returns (see
``GDSCheckpointer.save_async``), so training goes on while the files are written; a save to a
path waits for an earlier save to the same path, loading or removing a path waits for its
save, and ``teardown`` (end of fit) waits for all. The saved step holds exactly the values at
the call: the trainer's optimizers (those of the Strategy that called the plug-in) get the
checkpointer's step pre-hook, so their next ``step()`` waits until the save has copied the
parameters and optimizer state into its host pool; every saved tensor no such optimizer
holds (large buffers, frozen weights; everything when the plug-in is called by hand, outside
a Trainer) is copied (in "live" snapshot mode: written) before ``save_checkpoint`` returns.
A failed background save is raised once, by the next optimizer step, ``save_checkpoint`` or
``teardown``, with its own type. ``async_save=False`` makes every save return durable and
committed.

One set of engines for all saves. Each path is a root of its own, so each save has a
GDSCheckpointer of its own; its I/O engines (staging buffers, io_uring ring: the costly part)
come from the process's shelf (gdswriter/integrations/engines.py) and go back to it when the
save is done, so only the first save builds them. A blocking save (``async_save=False``)
writes straight from the live tensors (snapshot "live": no host pool, no copy); an
asynchronous one copies into a host snapshot pool of its own, freed with its checkpointer once
the save is done. Between saves the process holds the shelf's idle engines and nothing else.

RNG (``options=CheckpointOptions(save_rng=True)``). Each save also stores the RNG state of
torch (CPU and CUDA), Python and numpy at the call, and ``load_checkpoint`` sets the process's
RNG back to it, as ``GDSCheckpointer.load`` does: ``trainer.fit(model, ckpt_path=...)`` loads
the checkpoint before the first batch, so a run resumed from a checkpoint saved at an epoch's
end draws the same numbers (dropout, shuffling) as the uninterrupted run. Lightning itself
saves no RNG state: without ``save_rng`` a resumed run draws from wherever the new process's
seed left it.

What is stored. The checkpoint dict's ``state_dict`` is the checkpoint's model (so ``gdswriter
export --model-only`` gives the LightningModule's weights); everything else (epoch, global
step, loops, callbacks' state, optimizer and scheduler states, hyper-parameters, precision
plug-in state, your ``on_save_checkpoint`` additions) is stored as gdswriter state: tensors,
numpy, plain Python values. Of the other types Lightning puts there, these round-trip exactly:
``argparse.Namespace``, ``pathlib`` paths and Lightning's ``AttributeDict`` (each recorded by
key path and rebuilt on load; no code from the checkpoint runs). Enum members, dataclass
instances, OmegaConf configs and other classes would need their class imported back, which is
what pickle does: they are refused with an ``UnsupportedObjectError`` naming the key path and
the fix (store ``.value``, ``dataclasses.asdict(x)``, ``OmegaConf.to_container(cfg)``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import logging
import os
import pathlib
import shutil
import sys
import threading
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import Strategy

from ..checkpointer import GDSCheckpointer, SaveHandle
from ..errors import CorruptCheckpointError, InvalidOptionError, UnsupportedObjectError
from ..options import CheckpointOptions
from ..load.reader import load_state
from ..rng import set_rng_state
from ..tensors import to_device
from .engines import ENGINES

log = logging.getLogger("gdswriter")

__all__ = ["GDSCheckpointIO", "to_plain", "from_plain"]

MODEL_KEY = "state_dict"
EXTRA_KEY = "lightning"
TYPES_KEY = "lightning_types"
_TAGS = ("namespace", "attribute_dict", "path")
_STACK_DEPTH = 16  # frames searched for the Strategy that called the plug-in


# ----------------------------------------------------------------------------- types Lightning stores
def to_plain(obj: Any, key_path: tuple = (), tags: list | None = None) -> Any:
    """``obj`` with the Lightning-specific types gdswriter's state codec does not store turned
    into plain values, each recorded in ``tags`` as ``[key path, tag]`` so ``from_plain`` can
    rebuild it. Refuses (UnsupportedObjectError, with the key path and the fix) the types whose
    rebuilding would import code. Containers are rebuilt; tensors and leaves are not copied."""
    tags = [] if tags is None else tags
    where = "/".join(map(str, key_path))
    if isinstance(obj, AttributeDict):
        tags.append([list(key_path), "attribute_dict"])
        return {k: to_plain(v, (*key_path, k), tags) for k, v in obj.items()}
    if isinstance(obj, argparse.Namespace):
        tags.append([list(key_path), "namespace"])
        return {k: to_plain(v, (*key_path, k), tags) for k, v in vars(obj).items()}
    if isinstance(obj, pathlib.PurePath):
        tags.append([list(key_path), "path"])
        return str(obj)
    if isinstance(obj, enum.Enum):
        raise UnsupportedObjectError(where, obj, f"enum members cannot be stored without pickle (loading them "
                                     f"would import {type(obj).__qualname__}): store its .value ({obj.value!r}) "
                                     f"instead, e.g. in save_hyperparameters() or on_save_checkpoint")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        raise UnsupportedObjectError(where, obj, "dataclass instances cannot be stored without pickle (loading "
                                     "them would import their class): store dataclasses.asdict(x) instead, e.g. "
                                     "self.save_hyperparameters(dataclasses.asdict(config))")
    if type(obj).__module__.startswith("omegaconf"):
        raise UnsupportedObjectError(where, obj, "OmegaConf configs cannot be stored without pickle: store "
                                     "OmegaConf.to_container(cfg, resolve=True) instead")
    if type(obj) in (dict, collections.OrderedDict):
        return _same_dict(obj, {k: to_plain(v, (*key_path, k), tags) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(to_plain(v, (*key_path, i), tags) for i, v in enumerate(obj))
    return obj  # tensors and plain values; anything else is refused by the state codec, by key path


def _same_dict(like: dict, items: dict) -> dict:
    """``items`` as a container of ``like``'s type (dict or OrderedDict, with its ``_metadata``)."""
    if type(like) is dict:
        return items
    out = collections.OrderedDict(items)
    if hasattr(like, "_metadata"):
        out._metadata = like._metadata
    return out


def from_plain(obj: Any, tags: Any) -> Any:
    """Inverse of ``to_plain``. ``tags`` come from a checkpoint: anything but a list of
    ``[key path, known tag]`` pointing at a value of the right kind is CorruptCheckpointError."""
    if not isinstance(tags, list):
        raise CorruptCheckpointError(f"{TYPES_KEY} must be a list, got {type(tags).__name__}")
    todo: dict[tuple, str] = {}
    for entry in tags:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and entry[1] in _TAGS):
            raise CorruptCheckpointError(f"bad {TYPES_KEY} entry {entry!r:.80}")
        todo[tuple(entry[0])] = entry[1]
    found: set[tuple] = set()

    def walk(o: Any, key_path: tuple) -> Any:
        if type(o) in (dict, collections.OrderedDict):
            o = _same_dict(o, {k: walk(v, (*key_path, k)) for k, v in o.items()})
        elif type(o) in (list, tuple):
            o = type(o)(walk(v, (*key_path, i)) for i, v in enumerate(o))
        tag = todo.get(key_path)
        if tag is None:
            return o
        found.add(key_path)
        if tag == "path" and type(o) is str:
            return Path(o)
        if tag == "namespace" and type(o) is dict and all(type(k) is str for k in o):
            return argparse.Namespace(**o)
        if tag == "attribute_dict" and type(o) is dict:
            return AttributeDict(o)
        raise CorruptCheckpointError(f"{'/'.join(map(str, key_path))}: recorded as {tag}, holds a {type(o).__name__}")

    out = walk(obj, ())
    if len(found) != len(todo):
        missing = sorted(set(todo) - found, key=str)[:3]
        raise CorruptCheckpointError(f"{TYPES_KEY} names key paths the checkpoint does not hold: {missing}")
    return out


# ----------------------------------------------------------------------------- the plug-in
class GDSCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO through gdswriter (see the module doc for paths and types).

    async_save: snapshot and return, writing in the background (default); False: each save
        returns durable. options: CheckpointOptions for every checkpoint (engine, verify,
        save_rng: store the RNG state with each save and restore it on load...).
    read_torch_files: load paths that are plain torch.save files (checkpoints written before
        this plug-in was used) with Lightning's TorchCheckpointIO; off by default, as that
        unpickles."""

    def __init__(self, *, async_save: bool = True, options: CheckpointOptions | None = None,
                 read_torch_files: bool = False):
        self.async_save = async_save
        self.options = options or CheckpointOptions()
        self.read_torch_files = read_torch_files
        self._pending: list[tuple[Path, GDSCheckpointer, SaveHandle]] = []
        self._removals: list[tuple[Path, list[SaveHandle]]] = []  # deferred until those saves are committed
        self._errors: list[BaseException] = []
        self._mutex = threading.Lock()

    # -- save -----------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not use storage_options: pass options= (CheckpointOptions) "
                            f"when creating it")
        root = Path(os.fspath(path)).absolute()
        self._finish(lambda p: p == root)  # also reports a failed earlier save, once
        with self._mutex:  # a path removed, then saved again: the new save stays
            self._removals = [r for r in self._removals if r[0] != root]
        if not isinstance(checkpoint.get(MODEL_KEY, {}), dict):
            raise InvalidOptionError(f"checkpoint[{MODEL_KEY!r}] must be a dict of tensors")
        tags: list = []
        rest = to_plain({k: v for k, v in checkpoint.items() if k != MODEL_KEY}, (), tags)
        step = int(checkpoint.get("global_step", 0))
        if root.is_symlink() or root.is_file():  # a save_last link, or a torch.save file from before
            root.unlink()
        # The dict holds the live parameters and optimizer state, not copies: the trainer's
        # optimizers must not step before the save has copied them (the checkpointer hooks them;
        # what they do not hold, save_async copies before it returns).
        engines = ENGINES.lease(self.options.engine, 1)  # the shelf's: built by the first save only
        try:
            # A blocking save needs no snapshot copy: it writes from the live tensors (no host pool).
            options = self.options if self.async_save else dataclasses.replace(self.options, snapshot="live")
            ckpt = GDSCheckpointer(checkpoint.get(MODEL_KEY, {}), root=root, options=options, keep_last=1,
                                   state={EXTRA_KEY: rest, TYPES_KEY: {"tags": tags}},
                                   guard=self._trainer_optimizers(), engines=engines)
        except BaseException:
            for e in engines:
                e.close()  # back to the shelf
            raise
        try:
            handle = ckpt.save_async(step) if self.async_save else None
            if handle is None:
                ckpt.save(step)
        except BaseException:
            ckpt.close()
            raise
        if handle is None:
            self._drop_other_steps(ckpt, step)
            ckpt.close()
        else:
            with self._mutex:
                self._pending.append((root, ckpt, handle))

    def _trainer_optimizers(self) -> list:
        """The optimizers of the Lightning Strategy whose save_checkpoint called this plug-in,
        found on the calling thread's stack (Lightning hands a CheckpointIO neither the trainer
        nor the strategy); none when the plug-in was called otherwise (by hand, or from
        AsyncCheckpointIO's thread, which saves copies)."""
        frame = sys._getframe(1)
        for _ in range(_STACK_DEPTH):
            if frame is None:
                break
            if frame.f_code.co_name == "save_checkpoint":  # Strategy's (or Trainer's) own: only their locals
                obj = frame.f_locals.get("self")
                strategy = obj if isinstance(obj, Strategy) else getattr(obj, "strategy", None)
                if isinstance(strategy, Strategy) and getattr(strategy, "_checkpoint_io", None) is self:
                    return list(strategy.optimizers)
            frame = frame.f_back
        return []

    @staticmethod
    def _drop_other_steps(ckpt: GDSCheckpointer, step: int) -> None:
        """A path holds one checkpoint: steps other than ``step`` (a rolled-back run's) go."""
        for s in ckpt.steps():
            if s != step:
                ckpt.protocol.delete_step(s)

    def _finish(self, which: Callable[[Path], bool]) -> None:
        """Wait for the pending saves to the paths ``which`` selects, close them and every save
        already done, then raise the first failure not reported yet (once; later ones are logged)."""
        with self._mutex:
            chosen = [p for p in self._pending if which(p[0]) or p[2].done()]
            self._pending = [p for p in self._pending if p not in chosen]
        for _, ckpt, handle in chosen:
            told = handle.reported  # raised already, by an optimizer step's pre-hook
            try:
                handle.result()
                self._drop_other_steps(ckpt, handle.step)
            except BaseException as e:  # noqa: BLE001 - kept to be raised below
                if not (told and e is handle.exception()):
                    self._errors.append(e)
            finally:
                try:
                    ckpt.close()
                except BaseException as e:  # noqa: BLE001
                    self._errors.append(e)
        self._remove_when_superseded()
        if self._errors:
            first, *rest = self._errors
            self._errors = []
            for e in rest:
                log.error("gdswriter: another checkpoint save also failed: %s", e)
            raise first

    # -- load -----------------------------------------------------------------
    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved at ``path`` (tensors on the CPU, or moved to ``map_location``
        given as a device or device string). ``weights_only`` is moot: nothing is unpickled."""
        root = Path(os.fspath(path)).absolute()
        self._finish(lambda p: p == root)
        if root.is_file() and self.read_torch_files:
            from lightning.fabric.plugins import TorchCheckpointIO

            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if root.is_file():
            raise InvalidOptionError(f"{path} is a file, not a gdswriter checkpoint (a torch.save file from before?): "
                                     f"create GDSCheckpointIO(read_torch_files=True) to read such files once")
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise InvalidOptionError(f"map_location must be None, a device or a device string, got "
                                     f"{type(map_location).__name__}")
        step, state = load_state(root, verify=self.options.verify, engine_options=self.options.engine)
        extra = state.get("extra") if isinstance(state, dict) else None
        if not isinstance(extra, dict) or not isinstance(extra.get(EXTRA_KEY), dict):
            raise CorruptCheckpointError(f"{path} (step {step}) was not written by GDSCheckpointIO: it holds no "
                                         f"Lightning checkpoint dict")
        types = extra.get(TYPES_KEY, {"tags": []})
        checkpoint = from_plain(extra[EXTRA_KEY], types.get("tags") if isinstance(types, dict) else types)
        checkpoint[MODEL_KEY] = state.get("model", {})
        if self.options.save_rng:
            if isinstance(state.get("rng"), dict):
                set_rng_state(state["rng"])  # as GDSCheckpointer.load(): the draws go on where the save stood
            else:
                log.info("gdswriter: %s (step %d) holds no RNG state (saved without save_rng): the process's RNG "
                         "is left as it is", path, step)
        if map_location is not None:
            device = torch.device(map_location)
            checkpoint = to_device(checkpoint, device)
        return checkpoint

    # -- remove / teardown ------------------------------------------------------
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Remove ``path`` (after its own save). Lightning removes the previous top-k checkpoint
        as soon as the next save returns: while saves to other paths are still being written,
        the removal waits for them (done by a later call: save, load, remove, teardown), and a
        path whose successors failed is kept, so that a crash or a failed save mid-write still
        leaves the previous checkpoint to resume from."""
        root = Path(os.fspath(path)).absolute()
        self._finish(lambda p: p == root)
        with self._mutex:
            newer = [h for _, _, h in self._pending]
            if newer:
                self._removals.append((root, newer))
        if not newer:
            _remove_path(root)

    def _remove_when_superseded(self) -> None:
        """Carry out the deferred removals whose saves are all done: the path goes when they
        were all committed, and stays (logged) when one of them failed."""
        with self._mutex:
            ready = [r for r in self._removals if all(h.done() for h in r[1])]
            self._removals = [r for r in self._removals if r not in ready]
        for root, handles in ready:
            if all(h.exception() is None for h in handles):
                _remove_path(root)
            else:
                log.warning("gdswriter: kept %s, which Lightning removed: a save made after it failed", root)

    def teardown(self) -> None:
        """Wait for every pending save; raise the first failure not reported yet."""
        self._finish(lambda p: True)


def _remove_path(root: Path) -> None:
    if root.is_symlink() or root.is_file():
        root.unlink()
    elif root.is_dir():
        shutil.rmtree(root)
