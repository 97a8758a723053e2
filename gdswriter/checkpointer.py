"""GDSCheckpointer: save, load and resume training state, crash-safe.

Pipeline: collect state -> encode (no pickle) -> group tensors by storage ->
plan (planner/assign.py) -> engines write the files -> commit protocol
(format/commit.py). ``save(step)`` is ``save_async(step).result()``.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .engine import EngineInfo, IOEngine, ReadSpan, WriteSpan, create_engine
from .errors import (ChecksumMismatchError, CorruptCheckpointError, GDSWriterError, InvalidOptionError,
                     StateMismatchError, UnsupportedObjectError)
from .fallback.engine import ZERO_COPY_MIN
from .format.commit import CommitProtocol, PendingCommit, RootLock
from .format.dtypes import dtype_from_name, dtype_to_name
from .format.manifest import MANIFEST_NAME, ChunkRecord, FileRecord, Manifest, StorageRecord, TensorRecord
from .format.state_codec import decode_state, encode_state
from .options import ALIGN, EngineOptions, log_once
from .planner.assign import FileTarget, PlannedChunk, SavePlan, plan_save

log = logging.getLogger("gdswriter")

_STORAGE_ALIGN = 16  # extents start at a multiple of the largest item size, so every view stays valid


# ----------------------------------------------------------------------------- options
@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """What a GDSCheckpointer keeps and checks.

    keep_last: keep only the newest N committed steps (None: keep all). Steps above the one
        just saved (left by a rolled-back run) are never deleted by retention.
    keep_every: additionally keep every step divisible by K (e.g. 1000).
    save_rng: save torch (CPU and CUDA), Python and numpy RNG state; load restores it.
    verify: check every chunk's crc32c on load (cheap: computed while bytes stream).
    files_per_root: data files (writers) per root directory.
    engine: how bytes move (EngineOptions; default from GDSWRITER_* variables).
    """

    keep_last: int | None = None
    keep_every: int | None = None
    save_rng: bool = False
    verify: bool = True
    files_per_root: int = 1
    engine: EngineOptions = field(default_factory=EngineOptions.from_env)

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidOptionError(f"{name}={v!r} must be None or an integer >= 1")
        if not isinstance(self.files_per_root, int) or self.files_per_root < 1:
            raise InvalidOptionError(f"files_per_root={self.files_per_root!r} must be an integer >= 1")
        if not isinstance(self.engine, EngineOptions):
            raise InvalidOptionError("engine must be an EngineOptions instance")

    def retained(self, steps: Sequence[int], newest: int) -> set[int]:
        """Which of the committed ``steps`` the retention policy keeps, ``newest`` having just
        been committed. Steps above ``newest`` are left by a run that was rolled back (resumed
        from an older step): they are kept, and not counted, so that the rolled-back run's
        own steps are not deleted to make room for them."""
        if self.keep_last is None:
            return set(steps)
        ordered = sorted(s for s in steps if s <= newest)
        keep = set(ordered[-self.keep_last:]) | {newest} | {s for s in steps if s > newest}
        if self.keep_every:
            keep.update(s for s in ordered if s % self.keep_every == 0)
        return keep


# ----------------------------------------------------------------------------- snapshot
@dataclass
class _Extent:
    """The byte range of one storage that the saved tensors view, as a flat uint8 tensor."""

    flat: torch.Tensor
    first_tensor: str


@dataclass
class _Snapshot:
    step: int
    tree: Any
    extents: list[_Extent]
    records: list[TensorRecord]
    metadata: dict


def _flat_bytes(storage: torch.UntypedStorage, device: torch.device, start: int, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _tensor_names(tree: Any, n: int) -> tuple[list[str], list[str]]:
    """Key path and kind ("tensor"/"ndarray") of each tensor index's first appearance in ``tree``."""
    names, kinds = [""] * n, ["tensor"] * n

    def walk(v: Any, path: str, depth: int) -> None:
        if depth > 400:
            return
        if isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{path}/{i}" if path else str(i), depth + 1)
        elif isinstance(v, dict):
            if len(v) == 1 and ("$tensor" in v or "$ndarray" in v):
                kind = "tensor" if "$tensor" in v else "ndarray"
                i = v["$" + kind]
                if isinstance(i, int) and 0 <= i < n and not names[i]:
                    names[i], kinds[i] = path or "<root>", kind
                return
            entries = v.get("$dict", v.get("$odict"))
            if isinstance(entries, list):
                for kv in entries:
                    if isinstance(kv, list) and len(kv) == 2:
                        k = kv[0] if isinstance(kv[0], (str, int, float, bool)) or kv[0] is None else repr(kv[0])
                        walk(kv[1], f"{path}/{k}" if path else str(k), depth + 1)
                return
            for k, x in v.items():
                walk(x, path, depth + 1)

    walk(tree, "", 0)
    return names, kinds


def _host_copy(flat: torch.Tensor) -> torch.Tensor:
    """A page-aligned host copy of flat uint8 ``flat`` (pinned when it lives on a GPU; the
    caller synchronizes). Aligned, the engine writes it with no staging copy (zero-copy).
    torch's copy_ splits the copy and its page faults across threads: 2.6-3.0 GB/s here
    against 1.3 GB/s for a single-threaded memmove into freshly mapped pages."""
    raw = torch.empty(flat.numel() + ALIGN, dtype=torch.uint8, pin_memory=flat.is_cuda)
    start = (-raw.data_ptr()) % ALIGN
    host = raw[start:start + flat.numel()]
    host.copy_(flat, non_blocking=flat.is_cuda)
    return host


_ALIGN_HINT_MIN = 64 << 20


def hint_unaligned(flats: Sequence[torch.Tensor], options: EngineOptions, info: EngineInfo) -> None:
    """Count the bytes of large host tensors in ``flats`` that missed zero-copy only because their
    memory is less aligned than O_DIRECT needs on this file system (``info``: the engine after the
    I/O); from 64 MiB on, say once per process (at INFO level) how to align them. torch's CPU
    allocator puts large tensors 64 bytes into a page unless THP_MEM_ALLOC_ENABLE=1 is set: enough
    for NVMe (4-byte DMA alignment), not for a disk that needs 512 bytes, where the staging copy then
    costs CPU (half the work of a transfer; with the huge-page staging pool, not bandwidth here)."""
    align = info.direct_memory_alignment
    if not (options.zero_copy and info.direct_io and align):
        return
    staged = sum(f.numel() for f in flats
                 if f.device.type == "cpu" and f.numel() >= ZERO_COPY_MIN and f.data_ptr() % align)
    if staged >= _ALIGN_HINT_MIN:
        log_once("unaligned-live-tensors",
                 f"gdswriter: {staged / 2**20:.0f} MiB of live CPU tensors are not {align}-byte aligned, as "
                 f"O_DIRECT needs on this file system, so they are copied through the staging buffers. Start "
                 f"the process with THP_MEM_ALLOC_ENABLE=1 (torch then page-aligns large CPU tensors) to move "
                 f"them straight between memory and file, with half the CPU work", logging.INFO)


def take_snapshot(state: Any, step: int, *, copy: bool, metadata: dict | None = None) -> _Snapshot:
    """Encode ``state`` and group its tensors by storage. With ``copy`` the bytes are
    cloned to host memory so the caller may mutate its tensors once this returns."""
    tree, tensors = encode_state(state)
    names, kinds = _tensor_names(tree, len(tensors))
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.is_quantized:
            raise UnsupportedObjectError(names[i], t, "quantized tensors are not supported: save t.dequantize() "
                                                      "and the quantization parameters instead")
        if t.is_conj() or t.is_neg():  # lazy conj/neg bits are not in the bytes: materialise
            t = t.resolve_conj().resolve_neg()
        tensors[i] = t
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr()) if st.nbytes() and st.data_ptr() else ("empty", i)
        groups.setdefault(key, []).append(i)
    extents: list[_Extent] = []
    records: list[TensorRecord | None] = [None] * len(tensors)
    for members in groups.values():
        spans = [_byte_span(tensors[i]) for i in members]
        live = [s for s, i in zip(spans, members) if tensors[i].numel()]
        lo = min(s[0] for s in live) // _STORAGE_ALIGN * _STORAGE_ALIGN if live else 0
        hi = max(s[1] for s in live) if live else 0
        first = tensors[members[0]]
        flat = _flat_bytes(first.untyped_storage(), first.device, lo, hi - lo) if hi > lo else \
            torch.empty(0, dtype=torch.uint8)
        if copy and flat.numel():
            flat = _host_copy(flat)
        sid = len(extents)
        extents.append(_Extent(flat, names[members[0]]))
        for i, (start, _) in zip(members, spans):
            t = tensors[i]
            off = start - lo if t.numel() else 0
            records[i] = TensorRecord(names[i] or f"<tensor {i}>", sid, off, dtype_to_name(t.dtype), tuple(t.shape),
                                      tuple(t.stride()), str(t.device), kinds[i])
    if copy and torch.cuda.is_available():
        torch.cuda.synchronize()
    return _Snapshot(step, tree, extents, records, dict(metadata or {}))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- handle
class SaveHandle:
    """A save in progress. ``result(timeout)`` returns the step once it is durable and committed."""

    def __init__(self, step: int, future: Future, owner: "GDSCheckpointer"):
        self.step = step
        self._future = future
        self._owner = owner
        self.reported = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> int:
        """Wait (concurrent.futures.TimeoutError after ``timeout`` s); re-raises the save's own error."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise
        except BaseException:
            self.reported = True
            raise

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


# ----------------------------------------------------------------------------- reading
_POPULATE_MIN = 1 << 20


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh flat uint8 CPU tensor to read a storage into. Large ones come from an anonymous
    mmap with MAP_POPULATE: the kernel maps all pages in one go, several times faster than
    taking one page fault per 4 KiB during the copy (measured 2.7 vs 1.5 GB/s here)."""
    if nbytes < _POPULATE_MIN or not hasattr(mmap, "MAP_POPULATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive


def read_manifest(protocol: CommitProtocol, step: int) -> Manifest:
    path = protocol.step_dir(step) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path} is missing: step {step} is not committed") from e
    m = Manifest.from_json_bytes(raw, where=str(path))
    for f in m.files:
        if f.root >= len(protocol.roots):
            raise CorruptCheckpointError(
                f"{path} names data file {f.path} on root #{f.root}, but only {len(protocol.roots)} root(s) "
                f"were given: pass the same list of roots that saved it")
    return m


def read_storages(protocol: CommitProtocol, manifest: Manifest, dests: list[torch.Tensor],
                  engines: Sequence[IOEngine], *, verify: bool) -> None:
    """Fill ``dests[i]`` (flat uint8, nbytes of storage i) from the data files; check crc32c."""
    per_file: dict[int, list[tuple[ChunkRecord, int]]] = {}
    for sid, s in enumerate(manifest.storages):
        for c in s.chunks:
            per_file.setdefault(c.file, []).append((c, sid))
    names = {}
    for t in manifest.tensors:
        names.setdefault(t.storage, t.name)
    step_dir = {i: protocol.step_dir(manifest.step, i) for i in range(len(protocol.roots))}

    def read_one(fid: int) -> None:
        rec = manifest.files[fid]
        path = step_dir[rec.root] / rec.path
        chunks = sorted(per_file[fid], key=lambda x: x[0].file_offset)
        spans = [ReadSpan(c.file_offset, dests[sid][c.storage_offset:c.storage_offset + c.length]) for c, sid in chunks]
        try:
            if os.path.getsize(path) != rec.size:
                raise CorruptCheckpointError(f"{path} is {os.path.getsize(path)} bytes, the manifest says {rec.size}: "
                                             f"the file was truncated or replaced; load an earlier step")
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"data file {path} is missing: the checkpoint is incomplete; "
                                         f"load an earlier step") from e
        crcs = engines[rec.root % len(engines)].read_file(path, spans)
        if verify:
            for (c, sid), got in zip(chunks, crcs):
                if got != c.crc32c:
                    raise ChecksumMismatchError(path, names.get(sid, f"<storage {sid}>"), c.file_offset, c.length,
                                                c.crc32c, got)

    _run_per_file(read_one, sorted(per_file), len(engines))


def _run_per_file(fn, file_ids: Sequence[int], parallel: int) -> list:
    """Run ``fn`` for each file; files on different engines run in parallel threads."""
    if parallel <= 1 or len(file_ids) <= 1:
        return [fn(f) for f in file_ids]
    with ThreadPoolExecutor(max_workers=min(parallel, len(file_ids)), thread_name_prefix="gdswriter-file") as ex:
        return list(ex.map(fn, file_ids))


def tensors_from_storages(manifest: Manifest, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Build each saved tensor as a typed strided view of its storage buffer (sharing restored)."""
    out = []
    for t in manifest.tensors:
        dtype = dtype_from_name(t.dtype)
        buf = buffers[t.storage]
        out.append(torch.empty(0, dtype=dtype, device=buf.device).set_(
            buf.untyped_storage(), (buf.storage_offset() + t.byte_offset) // dtype.itemsize, t.shape, t.stride))
    return out


def load_state(root: str | os.PathLike | Sequence[str | os.PathLike], step: int | None = None, *,
               verify: bool = True, engine_options: EngineOptions | None = None) -> tuple[int, Any]:
    """Read a checkpoint into fresh CPU tensors: returns (step, state) where state is the saved
    tree (``{"model": ..., "optimizer": ..., ...}``). Never unpickles; takes no lock."""
    protocol = CommitProtocol(_roots(root))
    step = protocol.require(step)
    manifest = read_manifest(protocol, step)
    return step, decode_state(manifest.state, read_tensors(protocol, manifest, verify=verify,
                                                           engine_options=engine_options))


def read_tensors(protocol: CommitProtocol, manifest: Manifest, *, verify: bool = True,
                 engine_options: EngineOptions | None = None) -> list[torch.Tensor]:
    """Every tensor of ``manifest`` as a fresh CPU tensor (views of shared storages stay shared)."""
    buffers = [host_buffer(s.nbytes) for s in manifest.storages]
    with create_engine(engine_options) as engine:
        read_storages(protocol, manifest, buffers, [engine], verify=verify)
    return tensors_from_storages(manifest, buffers)


def _roots(root: Any) -> list[Path]:
    roots = [root] if isinstance(root, (str, os.PathLike)) else list(root)
    if not roots:
        raise InvalidOptionError("root must be a directory or a non-empty list of directories (one per SSD)")
    paths = [Path(os.fspath(r)) for r in roots]
    if len({p.resolve() for p in paths}) != len(paths):
        raise InvalidOptionError(f"roots {roots} name the same directory twice: give each SSD's directory once")
    return paths


# ----------------------------------------------------------------------------- rng
def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: Mapping) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- checkpointer
class GDSCheckpointer:
    """Save and load a model, an optimizer and any extra state under ``root``.

    ``root`` is a directory or a list of directories (one per SSD; the first
    holds manifests and ``latest``). ``model`` may be an nn.Module, a dict of
    tensors or None; ``optimizer`` any object with state_dict()/load_state_dict()
    or None; ``state`` maps extra names to such objects or to plain dicts of
    tensors and values (LR scheduler, GradScaler, a data loader's position...).
    One checkpointer owns its roots (a lock); leftovers of crashed saves are
    removed when it opens them.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, root: Any = "ckpts", *,
                 state: Mapping[str, Any] | None = None, options: CheckpointOptions | None = None,
                 keep_last: int | None = None, keep_every: int | None = None, save_rng: bool | None = None):
        opts = options or CheckpointOptions()
        overrides = {k: v for k, v in (("keep_last", keep_last), ("keep_every", keep_every),
                                       ("save_rng", save_rng)) if v is not None}
        if overrides:
            opts = CheckpointOptions(**{**{f: getattr(opts, f) for f in opts.__dataclass_fields__}, **overrides})
        self.options = opts
        self.model, self.optimizer = model, optimizer
        self.extra = dict(state or {})
        for name, obj in [("model", model), ("optimizer", optimizer), *self.extra.items()]:
            if obj is not None and not (hasattr(obj, "state_dict") or isinstance(obj, dict)):
                raise InvalidOptionError(f"{name}: expected an object with state_dict()/load_state_dict() or a dict, "
                                         f"got {type(obj).__name__}")
        roots = _roots(root)
        for r in roots:
            try:
                r.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InvalidOptionError(f"cannot create checkpoint root {r}: {e.strerror}; choose a writable "
                                         f"directory") from e
        self.protocol = CommitProtocol(roots)
        self._lock = RootLock(roots)
        try:
            removed = self.protocol.clean_leftovers()
            if removed:
                log.info("gdswriter: removed %d leftover(s) of interrupted saves under %s", len(removed), roots[0])
            self._engines: list[IOEngine] = []
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdswriter-save")
        except BaseException:
            self._lock.release()
            raise
        self._handles: list[SaveHandle] = []
        self._retention: Future | None = None
        self._mutex = threading.Lock()
        self._closed = False

    # -- info ----------------------------------------------------------------
    @property
    def roots(self) -> list[Path]:
        return list(self.protocol.roots)

    @property
    def engine_info(self):
        return self._engine_list()[0].info

    def steps(self) -> list[int]:
        """Committed steps, ascending (after any pending retention deletes)."""
        self._wait_retention()
        return self.protocol.committed_steps()

    def latest_step(self) -> int | None:
        return self.protocol.latest()

    def _engine_list(self) -> list[IOEngine]:
        with self._mutex:
            if not self._engines:
                self._engines = [create_engine(self.options.engine) for _ in self.protocol.roots]
            return self._engines

    # -- save ----------------------------------------------------------------
    def _collect(self) -> dict:
        state: dict[str, Any] = {}
        for name, obj in (("model", self.model), ("optimizer", self.optimizer)):
            if obj is not None:
                state[name] = obj.state_dict() if hasattr(obj, "state_dict") else obj
        if self.extra:
            state["extra"] = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in self.extra.items()}
        if self.options.save_rng:
            state["rng"] = _rng_state()
        return state

    def save(self, step: int, *, metadata: dict | None = None) -> int:
        """Write step ``step``; returns once it is durable and committed."""
        return self._submit(step, metadata, copy=False).result()

    def save_async(self, step: int, *, metadata: dict | None = None) -> SaveHandle:
        """Start saving ``step``; returns a handle (``result(timeout)``, ``done()``).

        Contract: the state is snapshotted before this returns (tensor bytes are
        copied to host memory), so the caller may mutate parameters and optimizer
        state, e.g. run the next optimizer step, as soon as it returns. The write
        and the commit run in the background, in submission order. A background
        failure is raised once: by ``handle.result()``, or else by the next
        ``save``/``save_async``/``wait``/``close``.
        """
        return self._submit(step, metadata, copy=True)

    def _submit(self, step: int, metadata: dict | None, *, copy: bool) -> SaveHandle:
        if self._closed:
            raise GDSWriterError("this GDSCheckpointer is closed: create a new one")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidOptionError(f"step must be an integer >= 0, got {step!r}")
        self._raise_unreported()
        if metadata is not None:
            try:
                json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise UnsupportedObjectError("metadata", metadata, f"metadata must be plain JSON: {e}") from e
        snap = take_snapshot(self._collect(), step, copy=copy, metadata=metadata)
        handle = SaveHandle(step, self._executor.submit(self._write_and_commit, snap), self)
        with self._mutex:
            # Keep only handles whose outcome someone may still need: running, or failed unreported.
            self._handles = [h for h in self._handles
                             if not h.done() or (not h.reported and h.exception() is not None)] + [handle]
        return handle

    def _targets(self) -> list[FileTarget]:
        n = self.options.files_per_root
        return [FileTarget(r, f"data-r{r}-f{k}.bin") for r in range(len(self.protocol.roots)) for k in range(n)]

    def _write_and_commit(self, snap: _Snapshot) -> int:
        engines = self._engine_list()
        plan: SavePlan = plan_save([e.flat.numel() for e in snap.extents], self._targets())
        pending: PendingCommit = self.protocol.begin(snap.step)
        try:
            crcs = self._write_files(plan, snap, pending, engines)
            by_storage: dict[int, list[ChunkRecord]] = {}
            for c in sorted((c for f in plan.files for c in f.chunks), key=lambda c: (c.storage, c.storage_offset)):
                by_storage.setdefault(c.storage, []).append(
                    ChunkRecord(c.file, c.file_offset, c.storage_offset, c.length, crcs[c]))
            storages = [StorageRecord(ext.flat.numel(), tuple(by_storage[sid])) for sid, ext in enumerate(snap.extents)]
            files = tuple(FileRecord(f.target.root, f.target.name, f.size) for f in plan.files)
            manifest = Manifest(step=snap.step, files=files, storages=tuple(storages), tensors=tuple(snap.records),
                                state=snap.tree, created_unix=time.time(), metadata=snap.metadata)
            pending.commit(manifest.to_json_bytes())
        except BaseException:
            if not pending.finished:
                pending.abort()
            raise
        hint_unaligned([e.flat for e in snap.extents], self.options.engine, engines[0].info)
        # Deleting old steps can take long (unlink of large files, discard): it runs as the
        # worker's next task, so the save is done at its commit; wait()/steps() wait for it.
        self._retention = self._executor.submit(self._apply_retention, snap.step)
        return snap.step

    def _write_files(self, plan: SavePlan, snap: _Snapshot, pending: PendingCommit,
                     engines: list[IOEngine]) -> dict[PlannedChunk, int]:
        # Keyed by the chunk itself: a zero-byte storage's empty chunk shares its file_offset
        # with the next chunk, so (file, file_offset) is not unique.
        crcs: dict[PlannedChunk, int] = {}

        def write_one(fid: int) -> None:
            fp = plan.files[fid]
            spans = [WriteSpan(c.file_offset, snap.extents[c.storage].flat[c.storage_offset:c.storage_offset + c.length])
                     for c in fp.chunks]
            got = engines[fp.target.root].write_file(pending.dirs[fp.target.root] / fp.target.name, spans, size=fp.size)
            for c, crc in zip(fp.chunks, got):
                crcs[c] = crc

        # Files on different roots (SSDs) are written in parallel; files sharing a root take turns.
        by_root: dict[int, list[int]] = {}
        for fid, f in enumerate(plan.files):
            by_root.setdefault(f.target.root, []).append(fid)
        _run_per_file(lambda r: [write_one(fid) for fid in by_root[r]], sorted(by_root), len(by_root))
        return crcs

    def _apply_retention(self, newest: int) -> None:
        """Delete committed steps the policy no longer keeps (never ``newest``). A failure
        here loses nothing: it is logged and the step is retried after the next save."""
        steps = self.protocol.committed_steps()
        keep = self.options.retained(steps, newest)
        for s in steps:
            if s not in keep:
                try:
                    self.protocol.delete_step(s)
                except OSError as e:
                    log.warning("gdswriter: could not delete old step %d under %s: %s", s, self.protocol.primary, e)

    def _wait_retention(self) -> None:
        pending = self._retention
        if pending is not None:
            pending.result()

    # -- waiting ---------------------------------------------------------------
    def _raise_unreported(self) -> None:
        with self._mutex:
            failed = [h for h in self._handles if h.done() and not h.reported and h.exception() is not None]
            for h in failed:
                h.reported = True
        if failed:
            raise failed[0].exception()  # type: ignore[misc]

    def _quiesce(self) -> None:
        for h in list(self._handles):
            try:
                h._future.result()
            except BaseException:
                pass
        self._wait_retention()

    def wait(self) -> None:
        """Wait for every outstanding save; re-raise a background error not yet reported."""
        self._quiesce()
        self._raise_unreported()

    # -- load ----------------------------------------------------------------
    def load(self, step: int | None = None, *, strict: bool = True, verify: bool | None = None) -> int:
        """Restore model, optimizer and extra state in place from ``step`` (None: the latest
        committed step); returns the step loaded.

        Model tensors are read straight into the live parameters where dtype, shape and
        layout match (no intermediate copy). With ``strict`` a missing or unexpected key, or
        a shape/dtype mismatch, raises StateMismatchError naming the key; without it those
        keys are skipped with a warning. A ChecksumMismatchError can leave the live tensors
        partly overwritten: load an intact step afterwards.
        """
        self._quiesce()
        step = self.protocol.require(step)
        manifest = read_manifest(self.protocol, step)
        verify = self.options.verify if verify is None else verify
        live = self._live_tensors()
        optimizer_state = self._live_optimizer_state()
        direct = self._match_live(manifest, live, strict, optimizer_state)
        live.update(optimizer_state)
        buffers: list[torch.Tensor] = []
        for sid, s in enumerate(manifest.storages):
            buffers.append(direct[sid][1] if sid in direct else host_buffer(s.nbytes))
        read_storages(self.protocol, manifest, buffers, self._engine_list(), verify=verify)
        hint_unaligned([flat for _, flat in direct.values()], self.options.engine, self.engine_info)
        tensors = tensors_from_storages(manifest, buffers)
        for sid, (rec_index, _) in direct.items():
            tensors[rec_index] = live[manifest.tensors[rec_index].name]
        state = decode_state(manifest.state, tensors)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(f"step {step}: the saved state is not a dict; it was not written by GDSCheckpointer")
        self._apply(state, strict)
        return step

    def _live_tensors(self) -> dict[str, torch.Tensor]:
        """Name (as in the manifest) -> live tensor, for the state that can be filled in place."""
        live: dict[str, torch.Tensor] = {}
        sources = [("model", self.model)] + [(f"extra/{k}", v) for k, v in self.extra.items() if isinstance(v, dict)]
        for prefix, obj in sources:
            if obj is None:
                continue
            sd = obj.state_dict() if hasattr(obj, "state_dict") else obj
            for k, v in sd.items():
                if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_meta:
                    live[f"{prefix}/{k}"] = v.detach()
        return live

    def _live_optimizer_state(self) -> dict[str, torch.Tensor]:
        """The live optimizer's state tensors (exp_avg, ...), named as in the manifest. Filled in
        place when they match (a resumed optimizer that already stepped), else left alone:
        load_state_dict replaces them, so a mismatch here is no error."""
        if self.optimizer is None or not hasattr(self.optimizer, "state_dict"):
            return {}
        state = self.optimizer.state_dict().get("state")
        if not isinstance(state, dict):
            return {}
        return {f"optimizer/state/{pid}/{k}": v for pid, st in state.items() if isinstance(st, dict)
                for k, v in st.items() if isinstance(v, torch.Tensor) and v.layout == torch.strided}

    @staticmethod
    def _match_live(manifest: Manifest, live: dict[str, torch.Tensor], strict: bool,
                    optional: Mapping[str, torch.Tensor] = {}) -> dict[int, tuple[int, torch.Tensor]]:
        """Storages that can be read straight into a live tensor: {storage: (tensor record, flat view)}.
        ``live`` tensors must match the checkpoint (strict); ``optional`` ones are used when they do."""
        users: dict[int, int] = {}
        seen: dict[str, int] = {}
        for t in manifest.tensors:
            users[t.storage] = users.get(t.storage, 0) + 1
            seen[t.name] = seen.get(t.name, 0) + 1
        direct = {}
        for i, rec in enumerate(manifest.tensors):
            lt = live.get(rec.name)
            if lt is None and rec.name in optional:
                lt = optional[rec.name]
                if dtype_to_name(lt.dtype) != rec.dtype or tuple(lt.shape) != rec.shape:
                    continue
            if lt is None or seen[rec.name] > 1:  # an ambiguous name is never read in place
                continue
            if dtype_to_name(lt.dtype) != rec.dtype or tuple(lt.shape) != rec.shape:
                msg = (f"{rec.name}: checkpoint has {rec.dtype}{list(rec.shape)}, the live tensor is "
                       f"{dtype_to_name(lt.dtype)}{list(lt.shape)}")
                if strict:
                    raise StateMismatchError(msg + "; pass strict=False to skip mismatched keys")
                continue
            nbytes = lt.numel() * lt.element_size()
            if (users[rec.storage] == 1 and lt.is_contiguous() and rec.byte_offset == 0
                    and manifest.storages[rec.storage].nbytes == nbytes and nbytes
                    and rec.stride == tuple(lt.stride()) and not lt.is_conj() and not lt.is_neg()):
                direct[rec.storage] = (i, _flat_bytes(lt.untyped_storage(), lt.device,
                                                      lt.storage_offset() * lt.element_size(), nbytes))
        return direct

    def _apply(self, state: dict, strict: bool) -> None:
        if self.model is not None:
            self._apply_one("model", self.model, state.get("model"), strict)
        if self.optimizer is not None:
            self._apply_one("optimizer", self.optimizer, state.get("optimizer"), strict)
        saved_extra = state.get("extra") or {}
        for name, obj in self.extra.items():
            self._apply_one(f"extra/{name}", obj, saved_extra.get(name), strict)
        if self.options.save_rng and "rng" in state:
            _set_rng_state(state["rng"])

    @staticmethod
    def _apply_one(name: str, obj: Any, saved: Any, strict: bool) -> None:
        if saved is None:
            if strict:
                raise StateMismatchError(f"{name}: the checkpoint holds no state for it; pass strict=False to "
                                         f"load the rest")
            log.warning("gdswriter: %s is not in the checkpoint; left as is", name)
            return
        if isinstance(obj, torch.nn.Module):
            GDSCheckpointer._load_module(name, obj, saved, strict)
        elif hasattr(obj, "load_state_dict"):
            try:
                obj.load_state_dict(saved)
            except (ValueError, KeyError, RuntimeError, TypeError) as e:
                raise StateMismatchError(f"{name}: load_state_dict refused the saved state: {e}") from e
        else:
            GDSCheckpointer._load_dict(name, obj, saved, strict)

    @staticmethod
    def _load_module(name: str, module: torch.nn.Module, saved: Mapping, strict: bool) -> None:
        current = module.state_dict()
        missing = [k for k in current if k not in saved]
        unexpected = [k for k in saved if k not in current]
        if strict and (missing or unexpected):
            raise StateMismatchError(f"{name}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; "
                                     f"pass strict=False to load the matching keys")
        usable = type(saved)() if isinstance(saved, dict) else {}
        for k, v in saved.items():
            cur = current.get(k)
            if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and (v.shape != cur.shape or v.dtype != cur.dtype):
                log.warning("gdswriter: %s/%s skipped: saved %s%s, live %s%s", name, k, v.dtype, list(v.shape),
                            cur.dtype, list(cur.shape))
                continue
            usable[k] = v
        if hasattr(saved, "_metadata"):
            usable._metadata = saved._metadata  # type: ignore[attr-defined]
        if missing or unexpected:
            log.warning("gdswriter: %s: missing keys %s, unexpected keys %s", name, missing[:10], unexpected[:10])
        try:
            module.load_state_dict(usable, strict=False)
        except RuntimeError as e:
            raise StateMismatchError(f"{name}: {e}") from e

    @staticmethod
    def _load_dict(name: str, target: dict, saved: Any, strict: bool) -> None:
        if not isinstance(saved, dict):
            raise StateMismatchError(f"{name}: saved state is a {type(saved).__name__}, expected a dict")
        missing = [k for k in target if k not in saved]
        if strict and missing:
            raise StateMismatchError(f"{name}: keys {missing[:10]} are missing from the checkpoint; pass strict=False")
        for k, v in saved.items():
            cur = target.get(k)
            if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                if cur.shape != v.shape or cur.dtype != v.dtype:  # strict already raised in _match_live
                    log.warning("gdswriter: %s/%s skipped: saved %s%s, live %s%s", name, k, v.dtype, list(v.shape),
                                cur.dtype, list(cur.shape))
                    continue
                # An expanded tensor (stride 0) cannot be written in place: take the restored view.
                if not any(s == 0 and n > 1 for n, s in zip(cur.shape, cur.stride())):
                    with torch.no_grad():
                        cur.copy_(v)
                    continue
            target[k] = v

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Wait for outstanding saves, release engines and the root lock. Raises an
        unreported background error after releasing everything."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            for e in self._engines:
                e.close()
            self._engines = []
            self._lock.release()

    def __enter__(self) -> "GDSCheckpointer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:
                log.exception("gdswriter: a background save also failed while handling another error")
