"""DeepSpeed checkpoints through gdswriter: ``use_gdswriter(engine)``, then DeepSpeed as usual.

    import deepspeed
    from gdswriter.integrations.deepspeed import use_gdswriter
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ckpt = use_gdswriter(engine)                      # engine.checkpoint_engine is now gdswriter's
    engine.save_checkpoint("ckpts", tag="step100")    # returns once the state is snapshotted
    engine.load_checkpoint("ckpts")                   # the tag `latest` names, as DeepSpeed does
    ckpt.wait()                                       # everything durable (also done by load and destroy)

One tag, one step. Everything DeepSpeed saves for a tag (the model states, every rank's ZeRO
optimizer partition, expert and pipeline layer files) becomes ONE gdswriter step in the root
``SAVE_DIR/TAG/gdswriter`` (checksummed, never pickled; ``gdswriter ls/verify/inspect`` read it),
committed once for all ranks (under torch.distributed the ranks vote, as any multi-rank
gdswriter save). ``SAVE_DIR/TAG/`` keeps DeepSpeed's file names as small JSON marker files (what
DeepSpeed's loader globs for, and what a person sees); the data is in the step. Re-saving a tag
commits a new step and then drops the older one, so a crash leaves one of them complete.

``latest``. DeepSpeed writes ``SAVE_DIR/latest`` itself (truncate, write, no fsync), right after
its checkpoint engine says "committed". Here the engine tells DeepSpeed it is decoupled and has
nothing for it to commit, so DeepSpeed never writes it: gdswriter writes ``latest`` (global rank
0, temporary file, fsync, rename) once the tag's step is committed and the marker files are
durable. So after a kill -9 or a power cut during a save, ``latest`` names the previous tag, which
loads; the tag being saved is invisible (its directory may hold marker files of a step that was
never committed: loading that tag explicitly raises CheckpointNotFoundError).

Asynchronous saves (``async_save=True``, the default). ``save_checkpoint`` collects the state
dicts DeepSpeed hands to ``save()`` (references to the live tensors: the engine asks DeepSpeed
not to clone them) and starts the step (``GDSCheckpointer.save_async``); the files are written
in the background. The engine's optimizer (the torch optimizer inside a ZeRO or mixed-precision
wrapper) gets gdswriter's step pre-hook: its next ``step()`` waits until the save has copied the
tensors it updates into gdswriter's host pool; the other saved tensors (a ZeRO model's 16-bit
weights, buffers) are copied before ``save_checkpoint`` returns. Only one tag is in flight: the
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
from typing import Any, Callable, Sequence

import numpy as np
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ..checkpointer import GDSCheckpointer, SaveHandle
from ..distributed.assemble import tree_for_rank
from ..distributed.load import tensor_refs
from ..distributed.options import DistOptions
from ..engines.base import IOEngine
from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, GDSWriterError, InvalidOptionError,
                      UnsupportedObjectError)
from ..format.commit import CommitProtocol
from ..format.state_codec import decode_state
from ..fs import atomic_write, fsync_dir
from ..load.reader import read_manifest, read_tensors
from ..options import CheckpointOptions

log = logging.getLogger("gdswriter")

__all__ = ["GDSCheckpointEngine", "use_gdswriter", "to_plain", "from_plain", "ROOT_NAME"]

ENGINE_NAME = "GDSCheckpointEngine"
ROOT_NAME = "gdswriter"            # SAVE_DIR/TAG/gdswriter: the tag's gdswriter root
FILES_KEY = "deepspeed"            # state["extra"][FILES_KEY][file name] = that file's state dict
TYPES_KEY = "deepspeed_types"      # state["extra"][TYPES_KEY][file name] = to_plain's tags
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
    if not isinstance(tags, list):
        raise CorruptCheckpointError(f"{TYPES_KEY} must be a list, got {type(tags).__name__}")
    todo: dict[tuple, tuple[str, Any]] = {}
    for entry in tags:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list) and entry[1] in _TAGS
                and (entry[2] is None or isinstance(entry[2], str))):
            raise CorruptCheckpointError(f"bad {TYPES_KEY} entry {entry!r:.80}")
        todo[tuple(entry[0])] = (entry[1], entry[2])
    found: set[tuple] = set()

    def walk(o: Any, key_path: tuple) -> Any:
        if type(o) in (dict, collections.OrderedDict):
            items = {k: walk(v, (*key_path, k)) for k, v in o.items()}
            if type(o) is collections.OrderedDict:
                meta = getattr(o, "_metadata", None)
                items = collections.OrderedDict(items)
                if meta is not None:
                    items._metadata = meta
            o = items
        elif type(o) in (list, tuple):
            o = type(o)(walk(v, (*key_path, i)) for i, v in enumerate(o))
        hit = todo.get(key_path)
        if hit is None:
            return o
        found.add(key_path)
        tag, name = hit
        fields = type(o) is dict and all(type(k) is str for k in o)
        try:
            if tag == "path" and type(o) is str:
                return Path(o)
            if tag == "namespace" and fields:
                return argparse.Namespace(**o)
            if tag in ("set", "frozenset") and type(o) is list:
                return (set if tag == "set" else frozenset)(o)
            if tag in ("enum", "object", "dataclass"):
                cls = _safe_class(str(name))
                if SAFE_CLASSES[str(name)] != tag:
                    raise CorruptCheckpointError(f"{TYPES_KEY} records {name} as {tag!r}")
                if tag == "enum":
                    return cls(o)
                if tag == "dataclass" and fields:
                    return cls(**o)
                if tag == "object" and fields:
                    out = cls.__new__(cls)
                    out.__dict__.update(o)
                    return out
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{'/'.join(map(str, key_path))}: cannot rebuild the {name or tag} "
                                         f"recorded there: {e}") from e
        raise CorruptCheckpointError(f"{'/'.join(map(str, key_path))}: recorded as {name or tag}, holds a "
                                     f"{type(o).__name__}")

    out = walk(obj, ())
    if len(found) != len(todo):
        missing = sorted(set(todo) - found, key=str)[:3]
        raise CorruptCheckpointError(f"{TYPES_KEY} names key paths the checkpoint does not hold: {missing}")
    return out


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


def _marker(name: str, rank: int) -> bytes:
    return (json.dumps({"kind": MARKER_KIND, "root": ROOT_NAME, "file": name, "rank": rank,
                        "note": "DeepSpeed checkpoint file stored in the gdswriter step under ./" + ROOT_NAME +
                        " (gdswriter ls/verify/inspect read it; DeepSpeed loads it through "
                        "gdswriter.integrations.deepspeed)"}, indent=1) + "\n").encode()


def _is_marker(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(MARKER_MAX_BYTES + 1)
    except OSError:
        return False
    if len(head) > MARKER_MAX_BYTES:
        return False
    try:
        return json.loads(head).get("kind") == MARKER_KIND
    except (ValueError, AttributeError):
        return False


def load_file(path: str | os.PathLike, *, verify: bool = True, options: CheckpointOptions | None = None) -> Any:
    """The state dict DeepSpeed saved as ``path`` (``SAVE_DIR/TAG/NAME``), read from the tag's
    committed gdswriter step into fresh CPU tensors; never unpickles. Whichever rank saved it."""
    p = Path(os.fspath(path)).absolute()
    root = p.parent / ROOT_NAME
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{p}: no gdswriter checkpoint for this tag ({root} does not exist): was the "
                                      f"tag saved through gdswriter.integrations.deepspeed?")
    protocol = CommitProtocol([root])
    try:
        step = protocol.require(None)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(f"{p}: the tag {p.parent.name!r} was never committed (a save that crashed or "
                                      f"was killed?): load the tag `latest` names, or another one") from e
    m = read_manifest(protocol, step)
    name = p.name
    for rank, tree in _rank_trees(m):
        sub = _entry(_entry(_entry(tree, "extra"), FILES_KEY), name)
        if sub is None:
            continue
        types = _entry(_entry(_entry(tree, "extra"), TYPES_KEY), name)
        engine_options = (options or CheckpointOptions()).engine
        tensors = read_tensors(protocol, m, tensor_refs(sub), verify=verify, engine_options=engine_options)
        obj = decode_state(sub, tensors)  # type: ignore[arg-type]
        return from_plain(obj, decode_state(types, []) if types is not None else [])
    held = sorted({n for _, tree in _rank_trees(m) for n in _file_names(tree)})
    raise CheckpointNotFoundError(f"{p}: the tag's step {step} holds no file {name!r} (it holds {held})")


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if type(obj) in (dict, collections.OrderedDict):
        out = type(obj)((k, _to_device(v, device)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


# ----------------------------------------------------------------------------- the engine
class _Tag:
    """One tag being collected (between create and the end of save_checkpoint), then saved."""

    def __init__(self, info: CheckpointCommitInfo):
        self.info = info
        self.dir = Path(os.fspath(info.save_dir)).absolute() / str(info.tag)
        self.files: dict[str, Any] = {}
        self.types: dict[str, list] = {}
        self.ckpt: GDSCheckpointer | None = None
        self.handle: SaveHandle | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.started = 0.0          # perf_counter() when save_checkpoint began
        self.blocked_s = 0.0        # save_checkpoint's time
        self.async_s = 0.0          # of which in GDSCheckpointer.save_async
        self.durable_s: float | None = None   # seconds from then until durable and `latest` written


class GDSCheckpointEngine(CheckpointEngine):
    """DeepSpeed's CheckpointEngine through gdswriter (see the module doc). Attach it with
    ``use_gdswriter(engine)``, which also wraps ``engine.save_checkpoint``/``load_checkpoint``:
    the end of ``save_checkpoint`` is when a tag's step starts, and DeepSpeed has no hook there.

    async_save: return from save_checkpoint once the state is snapshotted (default); False: once
        durable. options: CheckpointOptions of every tag's checkpointer (engine, verify, snapshot
        pool...; keep_last is 1: a tag is one step). guard: the optimizers that update the saved
        tensors (use_gdswriter passes the engine's). dist_options: DistOptions (the timeout); the
        ranks' state is always rank-local. read_torch_files: load paths that are torch.save files
        (unpickles; off by default). make_engines: a callable returning the I/O engines of one
        tag's checkpointer (GDSCheckpointer's ``engines=``; for tests)."""

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
        self.options = options or CheckpointOptions()
        self.guard = tuple(g for g in guard if g is not None)
        base = dist_options or DistOptions.from_env()
        self.dist_options = DistOptions(collective=base.collective, timeout_s=base.timeout_s, replicated=())
        self.read_torch_files = read_torch_files
        self.make_engines = make_engines
        self.attached = False
        self._in_save = False       # inside a wrapped save_checkpoint
        self._open: _Tag | None = None
        self._inflight: _Tag | None = None
        self._last: _Tag | None = None
        self._mutex = threading.Lock()
        self._save_started = 0.0

    # -- DeepSpeed's interface -------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        if not self._in_save:
            self._open = None   # save_16bit_model: its files are torch.save exports
            return
        self._open = _Tag(info)
        self._open.started = self._save_started

    def save(self, state_dict: Any, path: str) -> None:
        tag = self._open
        if tag is None:  # not a save_checkpoint tag (save_16bit_model, a pipeline save by hand): a torch file
            torch.save(state_dict, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            fsync_dir(Path(path).absolute().parent)
            return
        p = Path(os.fspath(path)).absolute()
        if p.parent != tag.dir:
            raise InvalidOptionError(f"DeepSpeed saved {p} for tag {tag.info.tag!r}, outside the tag's directory "
                                     f"{tag.dir}: gdswriter keeps a tag's files in one directory")
        tags: list = []
        tag.files[p.name] = to_plain(state_dict, p.name, tags)
        tag.types[p.name] = tags
        if not p.exists() or _is_marker(p):
            p.write_bytes(_marker(p.name, _rank()))  # DeepSpeed's loader globs for it; made durable on commit

    def load(self, path: str, map_location: Any = None) -> Any:
        self.wait()
        p = Path(os.fspath(path))
        if p.is_file() and not _is_marker(p):
            if not self.read_torch_files:
                raise InvalidOptionError(f"{p} is not a gdswriter checkpoint file (a torch.save file from before "
                                         f"gdswriter?): loading it would unpickle; pass read_torch_files=True to "
                                         f"use_gdswriter to read such files")
            return torch.load(p, map_location=map_location, weights_only=False)
        state = load_file(p, verify=self.options.verify, options=self.options)
        if isinstance(map_location, (str, torch.device)):
            state = _to_device(state, torch.device(map_location))
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
        """engine.destroy(): wait for the tag in flight."""
        self.wait()

    # -- gdswriter's side -----------------------------------------------------
    def wait(self) -> None:
        """Wait until every tag saved is durable and ``latest`` written; raise a failed save."""
        tag = self._inflight
        if tag is not None and tag.thread is not None:
            tag.thread.join()
        self._retire()
        self._raise_failed()

    @property
    def last_save(self) -> dict | None:
        """The last tag's figures: ``tag``, ``blocked_s`` (save_checkpoint's time plus the optimizer
        step's wait for the snapshot), ``durable_s`` (from save_checkpoint's start until durable
        and ``latest`` written; None while in flight), ``stats`` (gdswriter's SaveStats)."""
        tag = self._inflight or self._last
        if tag is None or tag.handle is None:
            return None
        blocked = tag.blocked_s + tag.handle.blocked_s - tag.async_s
        return {"tag": tag.info.tag, "blocked_s": blocked, "durable_s": tag.durable_s,
                "stats": tag.handle.stats}

    def attach(self, engine: Any) -> None:
        """Wrap ``engine.save_checkpoint`` and ``engine.load_checkpoint`` (instance attributes; the
        class is untouched): a tag's step starts when save_checkpoint ends, and loading waits for
        the saves in flight first, so that DeepSpeed reads a current ``latest``."""
        if self.attached:
            raise InvalidOptionError("this GDSCheckpointEngine is attached to an engine already: create one per "
                                     "DeepSpeed engine (use_gdswriter does)")
        save, load = engine.save_checkpoint, engine.load_checkpoint

        @functools.wraps(save)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
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

        engine.save_checkpoint = save_checkpoint
        engine.load_checkpoint = load_checkpoint
        self.attached = True

    def _begin(self) -> None:
        self._save_started = time.perf_counter()
        self.wait()  # one tag in flight: `latest` moves in tag order
        self._in_save, self._open = True, None

    def _end(self) -> None:
        tag, self._in_save, self._open = self._open, False, None
        if tag is None:
            raise GDSWriterError("DeepSpeed's save_checkpoint did not call the checkpoint engine's create(): this "
                                 "DeepSpeed version is not supported by gdswriter.integrations.deepspeed")
        root = tag.dir / ROOT_NAME
        ckpt = GDSCheckpointer(None, None, root=root, options=self.options, keep_last=1,
                               state={FILES_KEY: tag.files, TYPES_KEY: tag.types}, guard=self.guard,
                               dist_options=self.dist_options,
                               engines=list(self.make_engines()) if self.make_engines else None)
        tag.ckpt = ckpt
        try:
            latest = ckpt.latest_step()
            step = 0 if latest is None else latest + 1
            t0 = time.perf_counter()
            tag.handle = ckpt.save_async(step, metadata={"deepspeed_tag": str(tag.info.tag)})
            tag.async_s = time.perf_counter() - t0  # also counted in handle.blocked_s
        except BaseException:
            ckpt.close()
            raise
        tag.files = tag.types = {}  # the checkpointer holds what it needs
        tag.thread = threading.Thread(target=self._finish, args=(tag,), name="gdswriter-deepspeed", daemon=False)
        self._inflight = tag
        tag.thread.start()
        if not self.async_save:
            self.wait()
        tag.blocked_s = time.perf_counter() - tag.started

    def _finish(self, tag: _Tag) -> None:
        """In a thread of its own: wait until the tag's step is committed; then, on global rank 0,
        make the marker files durable and write ``latest``. Records the failure, if any."""
        try:
            step = tag.handle.result()  # type: ignore[union-attr]
            if _rank() == 0:
                protocol = CommitProtocol([tag.dir / ROOT_NAME])
                m = read_manifest(protocol, step)  # type: ignore[arg-type]
                for rank, tree in _rank_trees(m):
                    for name in _file_names(tree):
                        atomic_write(tag.dir / name, _marker(name, rank))
                if tag.info.save_latest:
                    atomic_write(Path(os.fspath(tag.info.save_dir)).absolute() / "latest", str(tag.info.tag).encode())
            tag.durable_s = time.perf_counter() - tag.started
        except BaseException as e:  # noqa: BLE001 - raised in the training thread, once
            tag.error = e
            log.error("gdswriter: DeepSpeed tag %r was NOT saved (%s: %s); `latest` still names the previous tag",
                      tag.info.tag, type(e).__name__, e)

    def _retire(self) -> None:
        """Close the checkpointer of a finished tag (in the training thread: it removes its
        optimizer hook)."""
        with self._mutex:
            tag = self._inflight
            if tag is None or (tag.thread is not None and tag.thread.is_alive()):
                return
            self._inflight, self._last = None, tag
        if tag.ckpt is not None:
            try:
                tag.ckpt.close()
            except BaseException as e:  # noqa: BLE001 - the same failure the thread recorded, or a new one
                tag.error = tag.error or e
            tag.ckpt = None
        if tag.error is not None:
            self._failed = tag

    _failed: _Tag | None = None

    def _raise_failed(self) -> None:
        self._retire()
        tag, self._failed = self._failed, None
        if tag is not None and tag.error is not None:
            raise tag.error


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
    optimizer = getattr(engine, "optimizer", None)
    ce = GDSCheckpointEngine(getattr(engine, "_config", None), async_save=async_save, options=options,
                             guard=[optimizer] if optimizer is not None else [], dist_options=dist_options,
                             read_torch_files=read_torch_files, make_engines=make_engines)
    if old is not None and old.is_decoupled():
        old.cleanup()  # DeepSpeed's decoupled engine runs a writer process: finish and end it
    engine.checkpoint_engine = ce
    ce.attach(engine)
    return ce
