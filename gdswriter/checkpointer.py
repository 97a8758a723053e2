"""GDSCheckpointer: save, load and resume training state, crash-safe.

The facade over the pipeline: collect state -> snapshot (snapshot.py) -> plan, write and
commit (writer.py) -> retention; load reads a committed step back (restore.py).
``save(step)`` is ``save_async(step).result()``.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Mapping

from .engine import IOEngine
from .engine_select import create_engine
from .errors import GDSWriterError, InvalidOptionError, ReadOnlyRootError, UnsupportedObjectError
from .format.commit import CommitProtocol, RootLock, normalize_roots, normalize_step
from .options import CheckpointOptions
from .restore import LiveState, LoadResult, load_state, restore_into, restore_newest_intact
from .rng import rng_state
from .snapshot import Snapshot, hint_unaligned, take_snapshot
from .dist import DistOptions, is_multi_rank, session_for as dist_session_for  # [dist hook]
from .dist import load_into as dist_load_into  # [dist hook]
from .writer import file_targets, write_and_commit

log = logging.getLogger("gdswriter")

__all__ = ["CheckpointOptions", "GDSCheckpointer", "LoadResult", "SaveHandle", "load_state"]


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


# ----------------------------------------------------------------------------- checkpointer
class GDSCheckpointer:
    """Save and load a model, an optimizer and any extra state under ``root``.

    ``root`` is a directory or a list of directories (one per SSD; the first
    holds manifests and ``latest``). ``model`` may be an nn.Module, a dict of
    tensors or None; ``optimizer`` any object with state_dict()/load_state_dict()
    or None; ``state`` maps extra names to such objects or to plain dicts of
    tensors and values (LR scheduler, GradScaler, a data loader's position...).
    One checkpointer owns its roots (a lock); leftovers of crashed saves are
    removed when it opens them. Roots it cannot write (a read-only file system) are
    opened for loading only: no lock, nothing removed, and saving raises
    ReadOnlyRootError. It refuses to open roots whose primary is missing or unmarked
    while secondary roots hold its data (RootUnavailableError: is the disk mounted?).

    Under torch.distributed (an initialised process group of several ranks, or
    ``process_group=``) every rank creates one, with its own ``root`` (shared or
    node-local), and save/load are collective: replicated state is written once,
    split across the ranks, DTensor shards once per replica group, one commit for
    all (gdswriter/dist/; ``dist_options``: DistOptions, e.g. the timeout). Pass
    ``dist_options=DistOptions(collective=False)`` for a checkpointer of one process
    only (e.g. created on rank 0 alone).
    """

    def __init__(self, model: Any = None, optimizer: Any = None, root: Any = "ckpts", *,
                 state: Mapping[str, Any] | None = None, options: CheckpointOptions | None = None,
                 keep_last: int | None = None, keep_every: int | None = None, save_rng: bool | None = None,
                 process_group: Any = None, dist_options: DistOptions | None = None):
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
        roots = normalize_roots(root)
        # [dist hook] under torch.distributed (or with process_group=) the ranks agree on the roots, each
        # locks and cleans the ones it leads (gdswriter/dist/session.py); else one process owns them all.
        self._dist = dist_session_for(roots, process_group, dist_options)
        # A writer locks the roots and cleans leftovers; roots it cannot write (read-only file
        # system, no permission) are opened for loading only: no lock, nothing cleaned.
        self._lock: RootLock | None = None
        self._read_only: ReadOnlyRootError | None = None
        removed: list = []
        if self._dist is not None:
            self.protocol, self._lock = self._dist.protocol, self._dist.lock
        else:
            self.protocol = CommitProtocol(roots)
            try:
                self._lock, removed = self.protocol.open_writer()
            except ReadOnlyRootError as e:
                self._read_only = e
                log.info("gdswriter: %s", e)
        if removed:
            log.info("gdswriter: removed %d leftover(s) of interrupted saves under %s", len(removed), roots[0])
        self._engines: list[IOEngine] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdswriter-save")
        self.last_load: LoadResult | None = None
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
            state["rng"] = rng_state()
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
        step = self._save_step(step)
        self._raise_unreported()
        if metadata is not None:
            try:
                json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise UnsupportedObjectError("metadata", metadata, f"metadata must be plain JSON: {e}") from e
        state = self._collect()
        if self._dist is not None:  # [dist hook] DTensors -> their local shards (and where they lie)
            state = self._dist.prepare(state, step)
        snap = take_snapshot(state, step, copy=copy, metadata=metadata)
        handle = SaveHandle(step, self._executor.submit(self._write_and_commit, snap), self)
        with self._mutex:
            # Keep only handles whose outcome someone may still need: running, or failed unreported.
            self._handles = [h for h in self._handles
                             if not h.done() or (not h.reported and h.exception() is not None)] + [handle]
        return handle

    def _save_step(self, step: Any) -> int:
        """The step to save as a plain int (InvalidOptionError if it is not one); ReadOnlyRootError
        when the roots were opened for loading only."""
        step = normalize_step(step)
        if self._read_only is not None:
            raise ReadOnlyRootError(self._read_only.errno, f"cannot save step {step}: "
                                                           f"{self._read_only.strerror}") from self._read_only
        return step

    def _write_and_commit(self, snap: Snapshot) -> int:
        engines = self._engine_list()
        if self._dist is not None:  # [dist hook] every rank writes its share; one commit (dist/save.py)
            self._dist.write_and_commit(snap, engines, self.options.files_per_root)
        else:
            write_and_commit(snap, self.protocol, engines, file_targets(len(self.protocol.roots),
                                                                       self.options.files_per_root))
        hint_unaligned([e.flat for e in snap.extents], self.options.engine, engines[0].info)
        # Deleting old steps can take long (unlink of large files, discard): it runs as the
        # worker's next task, so the save is done at its commit; wait()/steps() wait for it.
        self._retention = self._executor.submit(self._apply_retention, snap.step)
        return snap.step

    def _apply_retention(self, newest: int) -> None:
        """Delete committed steps the policy no longer keeps (never ``newest``). A failure
        here loses nothing: it is logged and the step is retried after the next save."""
        if self._dist is not None:  # [dist hook] rank 0 decides, each root's leader deletes (collective)
            return self._dist.apply_retention(newest, self.options.retained)
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
    def load(self, step: int | None = None, *, strict: bool = True, verify: bool | None = None,
             fallback: bool = False, atomic: bool | None = None) -> int:
        """Restore model, optimizer and extra state in place from ``step`` (None: the latest
        committed step); returns the step loaded. ``last_load`` then says what was loaded and
        what was skipped (a LoadResult).

        Everything is checked before the first byte moves: every key, shape and dtype of the
        model and of dict state, the optimizer's structure (parameter groups, parameters per
        group, state of a resumed optimizer). Checkpoints of a ``torch.compile``d model load into
        the plain one and back (the ``_orig_mod.`` prefix is normalised). With ``strict`` any
        mismatch raises StateMismatchError naming the keys (and the likely cause, e.g. a
        ``module.`` prefix); without it mismatched keys are skipped with a warning, the optimizer
        is skipped when a parameter it updates is not loaded, and NothingToLoadError is raised
        if no model tensor (or nothing at all) would be loaded.

        ``atomic`` (default: for states up to restore.ATOMIC_LOAD_MAX_BYTES): read into fresh
        buffers and verify every checksum before copying into the live tensors, so a damaged
        step leaves them untouched. Otherwise tensors are read straight into the live parameters
        (zero-copy) and a ChecksumMismatchError can leave those read in place (model tensors, a
        resumed optimizer's state) partly overwritten; the error's note names them, and no
        load_state_dict has run: load an intact step afterwards.

        ``fallback=True`` (with ``step=None``): if the latest step is damaged (manifest, files,
        checksums), warn naming the problem and load the newest intact older step instead.
        """
        self._quiesce()
        if self._dist is not None or is_multi_rank(self.protocol, step):  # [dist hook] collective / resharding load
            return dist_load_into(self, step, strict=strict, verify=self.options.verify if verify is None else verify)
        verify = self.options.verify if verify is None else verify
        live = LiveState(self.model, self.optimizer, self.extra, restore_rng=self.options.save_rng)
        kw = dict(strict=strict, verify=verify, engine_options=self.options.engine, atomic=atomic)
        if fallback:
            if step is not None:
                raise InvalidOptionError("load(fallback=True) chooses the step itself (the newest intact one): "
                                         "pass step=None, or load a given step without fallback")
            result = restore_newest_intact(live, self.protocol, self._engine_list(), **kw)
        else:
            result = restore_into(live, self.protocol, self.protocol.require(step), self._engine_list(), **kw)
        self.last_load = result
        return result.step

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
            if self._lock is not None:
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
