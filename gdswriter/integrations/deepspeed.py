"""DeepSpeed checkpoints through gdswriter: ``use_gdswriter(engine)``, then DeepSpeed as usual.

    import deepspeed
    from gdswriter.integrations.deepspeed import use_gdswriter
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ckpt = use_gdswriter(engine)                      # engine.checkpoint_engine is now gdswriter's
    engine.save_checkpoint("ckpts", tag="step100")    # returns once the state is snapshotted
    engine.load_checkpoint("ckpts")                   # the tag `latest` names, as DeepSpeed does
    ckpt.wait()                                       # everything durable (also done by load and destroy)

One tag, one step. Everything DeepSpeed saves for a tag (the model states, every rank's ZeRO
optimizer partition, expert and pipeline layer files) becomes ONE gdswriter step of the root
``SAVE_DIR/gdswriter`` (checksummed, never pickled; ``gdswriter ls/verify/inspect`` read it, and
each step's metadata names its tag), committed once for all ranks (under torch.distributed the
ranks vote, as in any multi-rank gdswriter save). One checkpointer per SAVE_DIR serves every tag,
so its host pool and I/O engines are made once. ``SAVE_DIR/TAG/`` keeps DeepSpeed's file names
as small JSON marker files naming the step (what DeepSpeed's loader globs for, and what a person
sees); the data is in the step. A step lives while its tag does: re-saving a tag commits a new
step and only then drops the older one (so a crash leaves one of them), and the step of a tag
directory you removed is dropped at the next save. One process at a time saves to a SAVE_DIR
(gdswriter's root lock; ``engine.destroy()`` releases it).

``latest``. DeepSpeed writes ``SAVE_DIR/latest`` itself (truncate, write, no fsync), right after
its checkpoint engine says "committed". Here the engine tells DeepSpeed it is decoupled and has
nothing for it to commit, so DeepSpeed never writes it: gdswriter writes ``latest`` (global rank
0, temporary file, fsync, rename) once the tag's step is committed and the marker files are
durable. So after a kill -9 or a power cut during a save, ``latest`` names the previous tag, which
loads; the tag being saved is invisible (its directory may hold marker files of a step that was
never committed: loading that tag explicitly raises CheckpointNotFoundError). A marker file that
already names a committed step is rewritten only once the new step is committed.

Asynchronous saves (``async_save=True``, the default). ``save_checkpoint`` collects the state
dicts DeepSpeed hands to ``save()`` (references to the live tensors: the engine asks DeepSpeed
not to clone them) and starts the step (``GDSCheckpointer.save_async``); the files are written
in the background. The engine's optimizer (the torch optimizer inside a ZeRO or mixed-precision
wrapper) gets gdswriter's step pre-hook: its next ``step()`` waits until the save has copied the
tensors it updates into gdswriter's host pool (under ZeRO 1/2 also the model's weights, which
the ZeRO optimizer rewrites after that step: ``StepGuard``); the other saved tensors (large
buffers, and the weights under ZeRO-3 or a mixed-precision wrapper) are copied before
``save_checkpoint`` returns. Only one tag is in flight: the
next ``save_checkpoint`` first waits for the previous tag to be durable. ``load_checkpoint``,
``engine.destroy()`` and ``ckpt.wait()`` wait for every save; a failed background save is raised
once, by the next ``save_checkpoint``, ``load_checkpoint``, ``engine.step()`` (through the
decoupled engines' hook, ``get_commit_info``) or ``wait()``, with its own type.
``async_save=False``: ``save_checkpoint`` returns once the tag is durable and ``latest`` written.

What is stored, without pickle. DeepSpeed's state dicts hold tensors and plain values, which
gdswriter's state codec stores, and a few other objects, each rebuilt on load from what was
recorded (the class is chosen from a fixed list here, never named by the checkpoint):
``argparse.Namespace`` (Megatron's ``args``), ``pathlib`` paths, sets, and DeepSpeed's own
``ZeroStageEnum``, ``LossScaler``/``DynamicLossScaler`` (ZeRO's loss scaler object) and
``fragment_address`` (ZeRO's parameter slice map). Anything else (another enum, a dataclass, a
custom class in ``client_state``) is refused when ``save_checkpoint`` is called, with an
UnsupportedObjectError naming the file and key path and the fix; nothing is written then.

Other saves. Only what ``save_checkpoint`` saves goes to gdswriter: ``save_16bit_model``'s
``pytorch_model.bin`` is an export for other tools, written with ``torch.save`` (and fsynced) as
DeepSpeed's own engine writes it. Loading a file that is a torch.save file (a checkpoint written
before gdswriter was plugged in) unpickles, so it is refused unless ``read_torch_files=True``.

Limits. ``SAVE_DIR`` must be one directory all ranks see (a shared file system, or one node):
DeepSpeed's loader reads rank 0's model file on every rank. DeepSpeed's offline tools
(``zero_to_fp32.py``, universal checkpoint conversion) read torch files and do not read these
checkpoints. NVMe-offloaded optimizer state (DeepSpeed copies ``offloaded_tensors/`` with
``shutil``) is not part of the step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import functools
import importlib
import json
import logging
import os
import pathlib
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ..checkpointer import GDSCheckpointer, SaveHandle
from ..format.assembly import tree_for_rank
from ..distributed.options import DistOptions
from ..engines.base import IOEngine
from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, GDSWriterError, InvalidOptionError,
                      UnsupportedObjectError)
from ..format.commit import CommitProtocol
from ..format.state_codec import decode_state, tensor_refs
from ..fs import atomic_write, fsync_dir
from ..load.reader import read_manifest, read_tensors
from ..options import CheckpointOptions
from ..tensors import to_device

log = logging.getLogger("gdswriter")

__all__ = ["GDSCheckpointEngine", "ROOT_NAME", "StepGuard", "engine_guard", "from_plain", "load_file", "to_plain",
           "use_gdswriter"]

ENGINE_NAME = "GDSCheckpointEngine"
ROOT_NAME = "gdswriter"            # SAVE_DIR/gdswriter: the gdswriter root of SAVE_DIR's tags
FILES_KEY = "deepspeed"            # state["extra"][FILES_KEY][file name] = that file's state dict
TYPES_KEY = "deepspeed_types"      # state["extra"][TYPES_KEY][file name] = to_plain's tags
TAG_KEY = "deepspeed_tag"         # a step's metadata: the tag it holds
MARKER_KIND = "gdswriter-deepspeed-file"
MARKER_MAX_BYTES = 4096

# The classes other than plain values that DeepSpeed puts in its state dicts, rebuilt on load.
# Only these are ever imported back (the checkpoint names one of these keys, nothing else).
SAFE_CLASSES: dict[str, str] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": "enum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "object",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "object",
    "deepspeed.utils.tensor_fragment.fragment_address": "dataclass",
}
_TAGS = ("namespace", "path", "set", "frozenset", "enum", "object", "dataclass")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _safe_class(name: str) -> type:
    """The class SAFE_CLASSES names ``name`` (CorruptCheckpointError for any other name)."""
    if name not in SAFE_CLASSES:
        raise CorruptCheckpointError(f"{TYPES_KEY} names class {name!r:.80}, which gdswriter does not rebuild")
    module, _, qual = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), qual)
    except (ImportError, AttributeError) as e:
        raise CorruptCheckpointError(f"the checkpoint holds a {name}, which this DeepSpeed version does not "
                                     f"have: load it with the DeepSpeed version that saved it") from e


# ----------------------------------------------------------------------------- types DeepSpeed stores
def to_plain(obj: Any, where: str = "", tags: list | None = None, key_path: tuple = ()) -> Any:
    """``obj`` with the non-plain objects DeepSpeed stores turned into plain values, each
    recorded in ``tags`` as ``[key path, tag, class name or None]`` so that ``from_plain`` can
    rebuild it. Anything gdswriter's state codec cannot store and this does not know raises
    UnsupportedObjectError naming ``where`` and the key path, with the fix. Containers are
    rebuilt; tensors and leaves are not copied."""
    tags = [] if tags is None else tags

    def at() -> str:
        return "/".join([where, *map(str, key_path)]) if where else "/".join(map(str, key_path))

    t = type(obj)
    if obj is None or t in (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size) \
            or isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return obj
    if t in (dict, collections.OrderedDict):
        items = {k: to_plain(v, where, tags, (*key_path, k)) for k, v in obj.items()}
        if t is dict:
            return items
        out = collections.OrderedDict(items)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if t in (list, tuple):
        return t(to_plain(v, where, tags, (*key_path, i)) for i, v in enumerate(obj))
    if isinstance(obj, argparse.Namespace):
        tags.append([list(key_path), "namespace", None])
        return {k: to_plain(v, where, tags, (*key_path, k)) for k, v in vars(obj).items()}
    if isinstance(obj, pathlib.PurePath):
        tags.append([list(key_path), "path", None])
        return str(obj)
    if t in (set, frozenset):
        tags.append([list(key_path), t.__name__, None])
        return [to_plain(v, where, tags, (*key_path, i)) for i, v in enumerate(obj)]
    kind = SAFE_CLASSES.get(_qualname(t))
    if kind == "enum":
        tags.append([list(key_path), "enum", _qualname(t)])
        return obj.value
    if kind == "dataclass":
        tags.append([list(key_path), "dataclass", _qualname(t)])
        return {f.name: to_plain(getattr(obj, f.name), where, tags, (*key_path, f.name))
                for f in dataclasses.fields(obj)}
    if kind == "object":
        tags.append([list(key_path), "object", _qualname(t)])
        return {k: to_plain(v, where, tags, (*key_path, k)) for k, v in vars(obj).items()}
    if isinstance(obj, enum.Enum):
        why = (f"enum members cannot be stored without pickle (loading them would import {t.__qualname__}): "
               f"store its .value ({obj.value!r}) instead")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        why = "dataclass instances cannot be stored without pickle: store dataclasses.asdict(x) instead"
    else:
        why = ("gdswriter's DeepSpeed engine stores tensors, numpy arrays, plain values, lists, tuples, dicts, "
               "argparse.Namespace, paths, sets and DeepSpeed's own ZeroStageEnum, loss scalers and "
               "fragment_address, never pickle: convert it to those, e.g. in client_state")
    raise UnsupportedObjectError(at(), obj, why)


def from_plain(obj: Any, tags: Any) -> Any:
    """Inverse of ``to_plain``. ``tags`` come from a checkpoint: anything but a list of
    ``[key path, known tag, class]`` pointing at a value of the right kind is CorruptCheckpointError."""
    todo = _tag_table(tags)
    found: set[tuple] = set()

    def walk(o: Any, key_path: tuple) -> Any:
        o = _with_children(o, key_path, walk)
        hit = todo.get(key_path)
        if hit is None:
            return o
        found.add(key_path)
        return _rebuilt(o, key_path, *hit)

    out = walk(obj, ())
    if len(found) != len(todo):
        missing = sorted(set(todo) - found, key=str)[:3]
        raise CorruptCheckpointError(f"{TYPES_KEY} names key paths the checkpoint does not hold: {missing}")
    return out


def _tag_table(tags: Any) -> dict[tuple, tuple[str, Any]]:
    """A checkpoint's tags, checked, by key path: (tag, class name or None)."""
    if not isinstance(tags, list):
        raise CorruptCheckpointError(f"{TYPES_KEY} must be a list, got {type(tags).__name__}")
    todo: dict[tuple, tuple[str, Any]] = {}
    for entry in tags:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list) and entry[1] in _TAGS
                and (entry[2] is None or isinstance(entry[2], str))):
            raise CorruptCheckpointError(f"bad {TYPES_KEY} entry {entry!r:.80}")
        todo[tuple(entry[0])] = (entry[1], entry[2])
    return todo


def _with_children(o: Any, key_path: tuple, walk: Callable[[Any, tuple], Any]) -> Any:
    """A dict, OrderedDict (its ``_metadata`` kept), list or tuple remade of its values passed
    through ``walk`` (with their key paths); anything else as it is."""
    if type(o) in (dict, collections.OrderedDict):
        items = {k: walk(v, (*key_path, k)) for k, v in o.items()}
        if type(o) is collections.OrderedDict:
            meta = getattr(o, "_metadata", None)
            items = collections.OrderedDict(items)
            if meta is not None:
                items._metadata = meta
        return items
    if type(o) in (list, tuple):
        return type(o)(walk(v, (*key_path, i)) for i, v in enumerate(o))
    return o


def _rebuilt(o: Any, key_path: tuple, tag: str, name: Any) -> Any:
    """The object a tag recorded at ``key_path``, rebuilt from its plain form ``o``; a plain form
    of the wrong kind, or one the class refuses, is CorruptCheckpointError."""
    fields = type(o) is dict and all(type(k) is str for k in o)
    try:
        if tag == "path" and type(o) is str:
            return Path(o)
        if tag == "namespace" and fields:
            return argparse.Namespace(**o)
        if tag in ("set", "frozenset") and type(o) is list:
            return (set if tag == "set" else frozenset)(o)
        if tag in ("enum", "object", "dataclass"):
            made = _rebuilt_instance(o, tag, str(name), fields)
            if made is not _NOT_REBUILT:
                return made
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{'/'.join(map(str, key_path))}: cannot rebuild the {name or tag} "
                                     f"recorded there: {e}") from e
    raise CorruptCheckpointError(f"{'/'.join(map(str, key_path))}: recorded as {name or tag}, holds a "
                                 f"{type(o).__name__}")


_NOT_REBUILT = object()  # _rebuilt_instance: the plain form is not of the kind the tag needs


def _rebuilt_instance(o: Any, tag: str, name: str, fields: bool) -> Any:
    """An instance of the safe class ``name`` (an enum member, a dataclass or a plain object, as
    ``tag`` says and SAFE_CLASSES agrees), or _NOT_REBUILT where ``o`` is not the plain form it needs
    (``fields``: ``o`` is a dict of str keys)."""
    cls = _safe_class(name)
    if SAFE_CLASSES[name] != tag:
        raise CorruptCheckpointError(f"{TYPES_KEY} records {name} as {tag!r}")
    if tag == "enum":
        return cls(o)
    if tag == "dataclass" and fields:
        return cls(**o)
    if tag == "object" and fields:
        out = cls.__new__(cls)
        out.__dict__.update(o)
        return out
    return _NOT_REBUILT


# ----------------------------------------------------------------------------- reading a tag's step
def _entry(tree: Any, key: Any) -> Any:
    """The value under ``key`` of an encoded dict (``{"$dict"|"$odict": [[k, v], ...]}``), or None."""
    if not isinstance(tree, dict):
        return None
    pairs = tree.get("$dict", tree.get("$odict"))
    if not isinstance(pairs, list):
        return None
    for pair in pairs:
        if isinstance(pair, list) and len(pair) == 2 and pair[0] == key:
            return pair[1]
    return None


def _file_names(tree: Any) -> list[str]:
    files = _entry(_entry(tree, "extra"), FILES_KEY)
    pairs = files.get("$dict") if isinstance(files, dict) else None
    return [p[0] for p in pairs or [] if isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)]


def _rank_trees(m: Any) -> list[tuple[int, Any]]:
    """(rank, state tree) for every rank that saved step ``m`` (one, for a single-process step)."""
    if m.dist is None:
        return [(0, m.state)]
    return [(r, tree_for_rank(m, r)) for r in range(m.dist.world_size)]


def _marker(tag: str, name: str, rank: int, step: int | None) -> bytes:
    return (json.dumps({"kind": MARKER_KIND, "tag": tag, "file": name, "rank": rank, "step": step,
                        "note": f"a DeepSpeed checkpoint file kept in the gdswriter step {step} of ../{ROOT_NAME} "
                                f"(gdswriter ls/verify/inspect read it; DeepSpeed loads it through "
                                f"gdswriter.integrations.deepspeed)"}, indent=1) + "\n").encode()


def _read_marker(path: Path) -> dict | None:
    """The marker file at ``path`` as a dict, None when it is none (absent, or another file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(MARKER_MAX_BYTES + 1)
    except OSError:
        return None
    if len(head) > MARKER_MAX_BYTES:
        return None
    try:
        marker = json.loads(head)
    except ValueError:
        return None
    return marker if isinstance(marker, dict) and marker.get("kind") == MARKER_KIND else None


def _tag_of(protocol: CommitProtocol, step: int) -> Any:
    return read_manifest(protocol, step).metadata.get(TAG_KEY)


def tag_step(save_dir: str | os.PathLike, tag: str) -> int | None:
    """The committed step of ``SAVE_DIR/gdswriter`` that holds ``tag`` (the newest), or None.
    Reads the manifests, newest first: for when a marker file does not say."""
    protocol = CommitProtocol([Path(os.fspath(save_dir)).absolute() / ROOT_NAME])
    for step in reversed(protocol.committed_steps()):
        try:
            if _tag_of(protocol, step) == tag:
                return step
        except (CheckpointNotFoundError, CorruptCheckpointError):
            continue  # deleted meanwhile, or damaged: not this tag's
    return None


def load_file(path: str | os.PathLike, *, verify: bool = True, options: CheckpointOptions | None = None) -> Any:
    """The state dict DeepSpeed saved as ``path`` (``SAVE_DIR/TAG/NAME``), read from the tag's
    committed gdswriter step in ``SAVE_DIR/gdswriter`` into fresh CPU tensors, whichever rank
    saved it; never unpickles. The marker file at ``path`` names the step; without one (or
    when it names no committed step of this tag) the newest committed step of the tag is used."""
    p = Path(os.fspath(path)).absolute()
    tag, save_dir = p.parent.name, p.parent.parent
    root = save_dir / ROOT_NAME
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{p}: no gdswriter checkpoint in {save_dir} ({root} does not exist): was the "
                                      f"tag saved through gdswriter.integrations.deepspeed?")
    protocol = CommitProtocol([root])
    marker = _read_marker(p) or {}
    step = marker.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and protocol.is_committed(step)
            and marker.get("tag") == tag and _tag_of(protocol, step) == tag):
        step = tag_step(save_dir, tag)
    if step is None:
        raise CheckpointNotFoundError(f"{p}: the tag {tag!r} was never committed (a save that crashed or was "
                                      f"killed?): load the tag `latest` names, or another one")
    m = read_manifest(protocol, step)
    name = p.name
    engine_options = (options or CheckpointOptions()).engine
    for _, tree in _rank_trees(m):
        sub = _entry(_entry(_entry(tree, "extra"), FILES_KEY), name)
        if sub is None:
            continue
        types = _entry(_entry(_entry(tree, "extra"), TYPES_KEY), name)
        tensors = read_tensors(protocol, m, tensor_refs(sub, len(m.tensors)), verify=verify, engine_options=engine_options)
        obj = decode_state(sub, tensors)  # type: ignore[arg-type]
        return from_plain(obj, decode_state(types, []) if types is not None else [])
    held = sorted({n for _, tree in _rank_trees(m) for n in _file_names(tree)})
    raise CheckpointNotFoundError(f"{p}: step {step} (tag {tag!r}) holds no file {name!r}; it holds {held}")


# ----------------------------------------------------------------------------- the engine
class _Tag:
    """One tag being collected (between create and the end of save_checkpoint), then saved."""

    def __init__(self, info: CheckpointCommitInfo, started: float):
        self.info = info
        self.tag = str(info.tag)
        self.save_dir = Path(os.fspath(info.save_dir)).absolute()
        self.dir = self.save_dir / self.tag
        self.files: dict[str, Any] = {}
        self.types: dict[str, list] = {}
        self.handle: SaveHandle | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.started = started      # perf_counter() when save_checkpoint began
        self.blocked_s = 0.0        # save_checkpoint's time
        self.async_s = 0.0          # of which in GDSCheckpointer.save_async
        self.durable_s: float | None = None   # seconds from then until durable and `latest` written


class _SaveDir:
    """The checkpointer of one SAVE_DIR (root SAVE_DIR/gdswriter), kept for every tag saved
    there so that its host pool and I/O engines are made once; ``files``/``types`` are the state
    it saves, refilled for each tag."""

    def __init__(self, ckpt: GDSCheckpointer, files: dict, types: dict):
        self.ckpt, self.files, self.types = ckpt, files, types


class GDSCheckpointEngine(CheckpointEngine):
    """DeepSpeed's CheckpointEngine through gdswriter (see the module doc). Attach it with
    ``use_gdswriter(engine)``, which also wraps ``engine.save_checkpoint``/``load_checkpoint``:
    the end of ``save_checkpoint`` is when a tag's step starts, and DeepSpeed has no hook there.

    async_save: return from save_checkpoint once the state is snapshotted (default); False: once
        durable. options: CheckpointOptions of the checkpointers (engine, verify, snapshot pool...;
        keep_last/keep_every are not used: a step lives while its tag does). guard: the optimizers
        that update the saved tensors (use_gdswriter passes engine_guard(engine)). dist_options:
        DistOptions (the timeout); the ranks' state is always rank-local. read_torch_files: load
        paths that are torch.save files (unpickles; off by default). make_engines: a callable
        returning the I/O engines of a SAVE_DIR's checkpointer (GDSCheckpointer's ``engines=``)."""

    def __init__(self, config_params: Any = None, *, async_save: bool = True,
                 options: CheckpointOptions | None = None, guard: Sequence[Any] = (),
                 dist_options: DistOptions | None = None, read_torch_files: bool = False,
                 make_engines: Callable[[], Sequence[IOEngine]] | None = None):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        if not isinstance(async_save, bool):
            raise InvalidOptionError(f"async_save={async_save!r} must be True or False")
        if options is not None and not isinstance(options, CheckpointOptions):
            raise InvalidOptionError(f"options must be a CheckpointOptions, got {type(options).__name__}")
        if dist_options is not None and not isinstance(dist_options, DistOptions):
            raise InvalidOptionError(f"dist_options must be a DistOptions, got {type(dist_options).__name__}")
        self.async_save = async_save
        opts = options or CheckpointOptions()
        if opts.keep_last is not None or opts.keep_every is not None:
            opts = dataclasses.replace(opts, keep_last=None, keep_every=None)
        self.options = opts
        self.guard = tuple(g for g in guard if g is not None)
        base = dist_options or DistOptions.from_env()
        self.dist_options = DistOptions(collective=base.collective, timeout_s=base.timeout_s, replicated=())
        self.read_torch_files = read_torch_files
        self.make_engines = make_engines
        self.attached = False
        self._in_save = False       # inside a wrapped save_checkpoint
        self._save_started = 0.0
        self._open: _Tag | None = None
        self._inflight: _Tag | None = None
        self._last: _Tag | None = None
        self._failed: _Tag | None = None
        self._dirs: dict[Path, _SaveDir] = {}
        self._mutex = threading.Lock()
        self._group: Any = None     # a gloo group of its own, for the end of each tag (several ranks)

    # -- DeepSpeed's interface -------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        if not self.attached:
            raise InvalidOptionError("GDSCheckpointEngine must be attached to its DeepSpeed engine: call "
                                     "use_gdswriter(engine) instead of setting engine.checkpoint_engine")
        if not self._in_save:
            self._open = None   # save_16bit_model: its files are torch.save exports
            return
        tag = str(info.tag)
        if not tag or tag in (".", "..") or "/" in tag or tag == ROOT_NAME:
            raise InvalidOptionError(f"checkpoint tag {tag!r}: gdswriter keeps each tag in a directory of its own "
                                     f"under save_dir: use a tag without '/' other than {ROOT_NAME!r}")
        self._open = _Tag(info, self._save_started)

    def save(self, state_dict: Any, path: str) -> None:
        tag = self._open
        if tag is None:  # not a save_checkpoint tag (save_16bit_model): a torch file, as DeepSpeed's own
            torch.save(state_dict, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            fsync_dir(Path(path).absolute().parent)
            return
        p = Path(os.fspath(path)).absolute()
        if p.parent != tag.dir:
            raise InvalidOptionError(f"DeepSpeed saved {p} for tag {tag.tag!r}, outside the tag's directory "
                                     f"{tag.dir}: gdswriter keeps a tag's files in one directory")
        tags: list = []
        tag.files[p.name] = to_plain(state_dict, p.name, tags)
        tag.types[p.name] = tags
        if not p.exists():  # DeepSpeed's loader globs for it; rewritten, durable, with the step once committed
            p.write_bytes(_marker(tag.tag, p.name, _rank(), None))

    def load(self, path: str, map_location: Any = None) -> Any:
        self.wait()
        p = Path(os.fspath(path))
        if p.is_file() and _read_marker(p) is None:
            if not self.read_torch_files:
                raise InvalidOptionError(f"{p} is not a gdswriter checkpoint file (a torch.save file from before "
                                         f"gdswriter?): loading it would unpickle; pass read_torch_files=True to "
                                         f"use_gdswriter to read such files")
            return torch.load(p, map_location=map_location, weights_only=False)
        state = load_file(p, verify=self.options.verify, options=self.options)
        if isinstance(map_location, (str, torch.device)):
            state = to_device(state, torch.device(map_location))
        elif map_location is not None and not callable(map_location):
            raise InvalidOptionError(f"map_location must be None, a device, a device string or a callable, got "
                                     f"{type(map_location).__name__}")
        return state  # a callable map_location (DeepSpeed's `lambda storage, loc: storage`) keeps the CPU tensors

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Called by DeepSpeed only for saves outside save_checkpoint (save_16bit_model): their
        torch files are already durable. A tag commits at the end of save_checkpoint."""
        return True

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def is_decoupled(self) -> bool:
        """True: DeepSpeed then leaves ``latest`` to this engine (see the module doc)."""
        return True

    def get_commit_info(self) -> None:
        """DeepSpeed's decoupled hook, at every optimizer step: nothing for DeepSpeed to commit
        (gdswriter commits and writes ``latest`` itself); raises a failed background save."""
        self._raise_failed()
        return None

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed hands over the live tensors, not clones (gdswriter snapshots them)."""
        return False

    def cleanup(self) -> None:
        """engine.destroy(): wait for the tag in flight, then close the checkpointers."""
        try:
            self.wait()
        finally:
            dirs, self._dirs = self._dirs, {}
            for d in dirs.values():
                d.ckpt.close()

    # -- gdswriter's side -----------------------------------------------------
    def wait(self) -> None:
        """Wait until every tag saved is durable and ``latest`` written; raise a failed save."""
        tag = self._inflight
        if tag is not None and tag.thread is not None:
            tag.thread.join()
        self._raise_failed()

    @property
    def last_save(self) -> dict | None:
        """The last tag's figures: ``tag``, ``step``, ``blocked_s`` (save_checkpoint's time plus
        the optimizer step's wait for the snapshot), ``durable_s`` (from save_checkpoint's start
        until durable and ``latest`` written; None while in flight), ``stats`` (a SaveStats)."""
        tag = self._inflight or self._last
        if tag is None or tag.handle is None:
            return None
        blocked = tag.blocked_s + tag.handle.blocked_s - tag.async_s
        return {"tag": tag.tag, "step": tag.handle.step, "blocked_s": blocked, "durable_s": tag.durable_s,
                "stats": tag.handle.stats}

    def attach(self, engine: Any) -> None:
        """Wrap ``engine.save_checkpoint`` and ``engine.load_checkpoint`` (instance attributes; the
        class is untouched): a tag's step starts when save_checkpoint ends, and loading waits for
        the saves in flight first, so that DeepSpeed reads a current ``latest``. While
        ``engine.checkpoint_engine`` is another engine, save_checkpoint is DeepSpeed's own."""
        if self.attached:
            raise InvalidOptionError("this GDSCheckpointEngine is attached to an engine already: create one per "
                                     "DeepSpeed engine (use_gdswriter does)")
        save, load = engine.save_checkpoint, engine.load_checkpoint

        @functools.wraps(save)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            if engine.checkpoint_engine is not self:  # replaced since: DeepSpeed's own behaviour
                return save(*args, **kwargs)
            self._begin()
            try:
                out = save(*args, **kwargs)
            except BaseException:
                self._in_save, self._open = False, None
                raise
            self._end()
            return out

        @functools.wraps(load)
        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self.wait()
            return load(*args, **kwargs)

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # collective, like use_gdswriter's call on every rank; a channel that the training's own
            # collectives never share, for the tags' completion threads
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.dist_options.timeout_s))
        engine.save_checkpoint = save_checkpoint
        engine.load_checkpoint = load_checkpoint
        self.attached = True

    def _begin(self) -> None:
        self._save_started = time.perf_counter()
        self.wait()  # one tag in flight: `latest` moves in tag order
        self._in_save, self._open = True, None

    def _save_dir(self, save_dir: Path) -> _SaveDir:
        """The checkpointer of ``save_dir``, made on its first tag (collective, as every rank saves);
        the one of another SAVE_DIR is closed then (nothing is in flight: _begin waited)."""
        d = self._dirs.get(save_dir)
        if d is None:
            for other in list(self._dirs):
                self._dirs.pop(other).ckpt.close()
            files: dict = {}
            types: dict = {}
            ckpt = GDSCheckpointer(None, None, root=save_dir / ROOT_NAME, options=self.options,
                                   state={FILES_KEY: files, TYPES_KEY: types}, guard=self.guard,
                                   dist_options=self.dist_options,
                                   engines=list(self.make_engines()) if self.make_engines else None)
            d = self._dirs[save_dir] = _SaveDir(ckpt, files, types)
        return d

    def _end(self) -> None:
        tag, self._in_save, self._open = self._open, False, None
        if tag is None:
            raise GDSWriterError("DeepSpeed's save_checkpoint did not call the checkpoint engine's create(): this "
                                 "DeepSpeed version is not supported by gdswriter.integrations.deepspeed")
        d = self._save_dir(tag.save_dir)
        latest = d.ckpt.latest_step()
        d.files.update(tag.files)
        d.types.update(tag.types)
        try:
            t0 = time.perf_counter()
            tag.handle = d.ckpt.save_async(0 if latest is None else latest + 1, metadata={TAG_KEY: tag.tag})
            tag.async_s = time.perf_counter() - t0  # also counted in handle.blocked_s
        finally:
            d.files.clear()  # the snapshot holds what it saves
            d.types.clear()
            tag.files = tag.types = {}
        tag.thread = threading.Thread(target=self._finish, args=(tag,), name="gdswriter-deepspeed", daemon=False)
        self._inflight = tag
        tag.thread.start()
        if not self.async_save:
            self.wait()
        tag.blocked_s = time.perf_counter() - tag.started

    def _finish(self, tag: _Tag) -> None:
        """In a thread of its own: wait until the tag's step is committed; then, on global rank 0,
        make the marker files (naming the step) durable and write ``latest``. With several ranks,
        every rank's thread then waits for rank 0's (an all_reduce of their failures), so that
        wait() returns on every rank with ``latest`` written, as DeepSpeed's own save_checkpoint
        does with its barrier. Last, rank 0 deletes the steps no tag needs any more (this tag's
        older one; those of tag directories removed). Records the failure, if any: the next
        save_checkpoint, engine step, load or wait raises it."""
        try:
            self._complete(tag)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread, once
            tag.error = e
        if self._group is not None:
            import torch.distributed as dist

            flag = torch.tensor([0 if tag.error is None else 1])
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
                if flag.item() and tag.error is None:
                    tag.error = GDSWriterError(f"DeepSpeed tag {tag.tag!r}: another rank failed to finish it "
                                               f"(see its log); `latest` may still name the previous tag")
            except BaseException as e:  # noqa: BLE001 - a rank died or hung
                tag.error = tag.error or e
        if tag.error is not None:
            e = tag.error
            log.error("gdswriter: DeepSpeed tag %r was NOT saved (%s: %s); `latest` still names the previous tag",
                      tag.tag, type(e).__name__, e)
            return
        tag.durable_s = time.perf_counter() - tag.started
        if _rank() == 0:
            self._drop_unused(CommitProtocol([tag.save_dir / ROOT_NAME]), tag, tag.handle.step)  # type: ignore[union-attr]

    def _complete(self, tag: _Tag) -> None:
        """The tag's step committed; on global rank 0, its marker files and ``latest`` written."""
        step = tag.handle.result()  # type: ignore[union-attr]
        if _rank() == 0:
            m = read_manifest(CommitProtocol([tag.save_dir / ROOT_NAME]), step)  # type: ignore[arg-type]
            for rank, tree in _rank_trees(m):
                for name in _file_names(tree):
                    atomic_write(tag.dir / name, _marker(tag.tag, name, rank, step))
            if tag.info.save_latest:
                atomic_write(tag.save_dir / "latest", tag.tag.encode())

    @staticmethod
    def _drop_unused(protocol: CommitProtocol, tag: _Tag, newest: int) -> None:
        """Delete the committed steps older than ``newest`` that hold ``tag`` (saved again) or a
        tag whose directory is gone (removed by the user, as DeepSpeed users prune tags). A
        failure is logged: nothing is lost, the next save tries again."""
        for step in protocol.committed_steps():
            if step >= newest:
                continue
            try:
                held = _tag_of(protocol, step)
                if held == tag.tag or not (isinstance(held, str) and (tag.save_dir / held).is_dir()):
                    protocol.delete_step(step)
            except Exception as e:  # noqa: BLE001 - retention is best effort
                log.warning("gdswriter: could not delete the unused step %d under %s (%s: %s); it is retried after "
                            "the next save", step, protocol.primary, type(e).__name__, e)

    def _raise_failed(self) -> None:
        with self._mutex:
            tag = self._inflight
            if tag is not None and not (tag.thread is not None and tag.thread.is_alive()):
                self._inflight, self._last = None, tag
                if tag.error is not None:
                    self._failed = tag
            failed, self._failed = self._failed, None
        if failed is not None and failed.error is not None:
            raise failed.error


class StepGuard:
    """What a ZeRO stage 1/2 optimizer's step changes, for GDSCheckpointer's ``guard=``: the
    parameters and state of the torch optimizer inside it, whose step pre-hook it hooks, and the
    model's weights, which the ZeRO optimizer rewrites only after that inner step (from the
    updated fp32 partition; forward and backward leave them unchanged). So save_checkpoint need
    not copy the weights before it returns: the inner step waits for the snapshot."""

    def __init__(self, inner: Any, weights: Sequence[torch.Tensor]):
        self._inner = inner
        self._optimizer_step_pre_hooks = inner._optimizer_step_pre_hooks
        self.param_groups = [{"params": [p for g in inner.param_groups for p in g["params"]] + list(weights)}]
        self.state = inner.state

    def register_step_pre_hook(self, hook: Callable) -> Any:
        return self._inner.register_step_pre_hook(hook)


def engine_guard(engine: Any) -> list:
    """The optimizers to guard for a DeepSpeed ``engine``: a StepGuard for a ZeRO stage 1/2
    optimizer around a torch optimizer, else the engine's optimizer (gdswriter hooks the torch
    optimizer inside a wrapper; what that one does not hold is copied before save returns)."""
    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return []
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    inner = getattr(opt, "optimizer", None)
    if isinstance(opt, DeepSpeedZeroOptimizer) and isinstance(inner, torch.optim.Optimizer):
        return [StepGuard(inner, list(engine.module.parameters()))]
    return [opt]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def use_gdswriter(engine: Any, *, async_save: bool = True, options: CheckpointOptions | None = None,
                  dist_options: DistOptions | None = None, read_torch_files: bool = False,
                  make_engines: Callable[[], Sequence[IOEngine]] | None = None) -> GDSCheckpointEngine:
    """Make the DeepSpeed ``engine`` checkpoint through gdswriter (on every rank, after
    ``deepspeed.initialize``); returns the GDSCheckpointEngine (``wait()``, ``last_save``).
    ``engine.save_checkpoint``/``load_checkpoint`` keep their signatures and behaviour (tags,
    ``latest``, client_state). The options are GDSCheckpointEngine's."""
    old = getattr(engine, "checkpoint_engine", None)
    if isinstance(old, GDSCheckpointEngine):
        raise InvalidOptionError("this DeepSpeed engine checkpoints through gdswriter already")
    ce = GDSCheckpointEngine(getattr(engine, "_config", None), async_save=async_save, options=options,
                             guard=engine_guard(engine), dist_options=dist_options,
                             read_torch_files=read_torch_files, make_engines=make_engines)
    if old is not None and old.is_decoupled():
        old.cleanup()  # DeepSpeed's decoupled engine runs a writer process: finish and end it
    engine.checkpoint_engine = ce
    ce.attach(engine)
    return ce
