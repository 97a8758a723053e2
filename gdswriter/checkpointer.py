"""GDSCheckpointer: save, load and resume training state, crash-safe, while training goes on.

The facade over the pipeline: collect state -> snapshot (snapshot.py) -> plan, write and
commit (writer.py; through the host snapshot pool, snapshot_pool.py, in "host" mode) ->
retention; load reads a committed step back (load/). ``save(step)`` is
``save_async(step).result()``.

Saving while training goes on. ``save_async(step)`` records what to save (tensor
references, their layout, the state's other values by value, an event per GPU on the
current stream) and returns; the bytes move in the background. Until the save has
*released* the tensors (``handle.snapshotted()``: in "host" mode once they are copied into
the host pool, in "live" mode once they are written), their memory must keep the saved
values. The checkpointer enforces this for the optimizers it guards (the one it was given,
every optimizer among the ``state=`` objects, and those an integration adds, e.g.
Lightning's): a step pre-hook makes their ``step()`` (also through GradScaler.step) wait
for the release (on a GPU, in "host" mode, the training stream waits on the copies' events;
the host does not). Everything else cannot be guarded, so save_async holds it itself:

* forward, backward, ``zero_grad``, data loading, LR scheduler and GradScaler updates may
  run right after save_async (their values were captured at the call);
* module buffers and extra-state tensors no guarded optimizer updates (BatchNorm running
  statistics, counters) are copied at the call when they are small (up to 1 MiB each, and
  64 MiB per save in all);
* every other saved tensor no guarded optimizer holds (large buffers, frozen parameters, a
  state dict of tensors, the tensors of a checkpointer without a hookable optimizer)
  stays live, and save_async returns only once the save has released it (in "host" mode:
  once it is copied into the host pool; the files are still written in the background; in
  "live" mode: once it is written). So no save is ever torn, whatever changes these tensors
  after save_async returned. Giving the checkpointer the optimizer that updates them lets
  save_async return at once again;
* what a guarded optimizer holds may change only through its ``step()``: anything that
  edits those tensors in place otherwise (parameters changed by hand) must call
  ``handle.wait_snapshotted()`` first.

A save that fails in the background raises its error once (see ``save_async``); one that
nobody asked about before the interpreter exits is logged as an error then.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .engines.base import IOEngine
from .engines.select import create_engine
from .errors import GDSWriterError, InvalidOptionError, ReadOnlyRootError
from .format.commit import CommitProtocol, RootLock, normalize_roots, normalize_step
from .options import CheckpointOptions
from ._log import log_once
from .planner.affinity import plan_for_save
from .planner.assign import SavePlan, plan_save
from .planner.discover import discover
from .planner.topology import Topology
from .load.apply import LiveState, LoadResult
from .load.policy import restore_into, restore_newest_intact
from .load.reader import load_state
from .rng import rng_state
from .save.snapshot import LayoutCache, Snapshot, plain_json, take_snapshot, tensors_of
from .save.pool import HostSnapshotPool
from .distributed import DistOptions, peek_manifest, session_for as dist_session_for  # [dist hook]
from .distributed import load_into as dist_load_into  # [dist hook]
from .save.writer import Release, file_targets, write_and_commit
from .tensors import hint_unaligned

log = logging.getLogger("gdswriter")

__all__ = ["CheckpointOptions", "GDSCheckpointer", "LoadResult", "SaveHandle", "SaveStats", "load_state"]

QUEUED_MAX = 1  # saves waiting behind the running one (on_busy="wait"); save_async blocks beyond
WORKER_IDLE_S = 10.0  # the save thread ends after this long without a save


# ----------------------------------------------------------------------------- handle
@dataclass(frozen=True)
class SaveStats:
    """How one save went. ``blocked_s``: time training was blocked by it (save_async itself,
    plus optimizer steps that waited for it); ``snapshot_s``: from the start of the save until
    it released the live tensors; ``write_s``: from its start until the step was committed."""

    step: int
    mode: str
    nbytes: int
    blocked_s: float
    snapshot_s: float
    write_s: float

    @property
    def gbps(self) -> float:
        """Bytes written per second of write_s, in GB/s (1e9)."""
        return self.nbytes / self.write_s / 1e9 if self.write_s > 0 else 0.0


class SaveHandle:
    """A save in progress. ``result(timeout)`` returns the step once it is durable and committed
    (None if the save was ``skipped``, see CheckpointOptions.on_busy); ``snapshotted()`` says
    whether the save still needs the live tensors; ``stats`` is set once it is done (None for
    a skipped save); ``mode`` is, once it is done, the snapshot mode the save really used
    ("live" where the engines cannot write from the host pool)."""

    def __init__(self, step: int, mode: str, *, skipped: bool = False):
        self.step, self.mode, self.skipped = step, mode, skipped
        self._future: Future = Future()
        self._release = Release()
        self._blocked = 0.0
        self._nbytes = 0
        self._started: float | None = None
        self.reported = False
        self.stats: SaveStats | None = None
        if skipped:
            self._release.set()
            self._future.set_result(None)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> int | None:
        """Wait (concurrent.futures.TimeoutError after ``timeout`` s); re-raises the save's own error."""
        try:
            return self._future.result(timeout)
        except BaseException as e:
            # By identity, not by type: since Python 3.11 the wait's TimeoutError is also the
            # type of the save's own OSError(ETIMEDOUT).
            if e is self.exception():
                self.reported = True
            raise

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def snapshotted(self) -> bool:
        """True once the save no longer reads the live tensors (copied, or written, or failed):
        from then on they may be changed in any way."""
        return self._release.is_set()

    def wait_snapshotted(self, timeout: float | None = None) -> bool:
        """Block until ``snapshotted()`` (False after ``timeout`` s)."""
        return self._release.wait(timeout)

    def _finish(self, error: BaseException | None) -> None:
        now = time.perf_counter()
        started = self._started if self._started is not None else now
        released = self._release.at if self._release.at is not None else now
        self.mode = self._release.mode or self.mode
        self.stats = SaveStats(self.step, self.mode, self._nbytes, self._blocked, released - started, now - started)
        if error is None:
            self._future.set_result(self.step)
        else:
            self._future.set_exception(error)


# ----------------------------------------------------------------------------- checkpointer
def _skip_across_ranks() -> InvalidOptionError:
    return InvalidOptionError(
        "on_busy='skip' cannot be used by a checkpointer of several ranks: each rank would decide alone "
        "whether its previous save is still running, so the ranks would save different steps and their "
        "collective saves would no longer match. Use on_busy='wait' (the default)")


def _guard_targets(objects: Any) -> list:
    """The distinct optimizers to hang the pre-hook on for ``objects`` (see _hookable)."""
    out: list = []
    for obj in objects:
        target = _hookable(obj)
        if target is not None and all(target is not t for t in out):
            out.append(target)
    return out


def _hookable(opt: Any) -> Any:
    """The torch.optim.Optimizer whose step ``opt.step()`` runs, to hang the pre-hook on: ``opt``
    itself, or the optimizer a wrapper holds (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer subclass torch's Optimizer without initialising its hooks and step the
    wrapped one). None when there is none (a custom object: nothing enforces the wait)."""
    for _ in range(4):
        if opt is None:
            return None
        if hasattr(opt, "register_step_pre_hook") and hasattr(opt, "_optimizer_step_pre_hooks"):
            return opt
        opt = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
    return None


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
    all (gdswriter/distributed/; ``dist_options``: DistOptions, e.g. the timeout). Pass
    ``dist_options=DistOptions(collective=False)`` for a checkpointer of one process
    only (e.g. created on rank 0 alone).

    ``guard``: optimizers that update saved tensors but are not saved by this checkpointer
    (an integration's trainer's, say): their ``step()`` waits for a save's snapshot, as the
    optimizer given does (see the module docstring), so save_async need not copy first.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, root: Any = "ckpts", *,
                 state: Mapping[str, Any] | None = None, options: CheckpointOptions | None = None,
                 keep_last: int | None = None, keep_every: int | None = None, save_rng: bool | None = None,
                 process_group: Any = None, dist_options: DistOptions | None = None, guard: Sequence[Any] = ()):
        opts = options or CheckpointOptions()
        overrides = {k: v for k, v in (("keep_last", keep_last), ("keep_every", keep_every),
                                       ("save_rng", save_rng)) if v is not None}
        if overrides:
            opts = CheckpointOptions(**{**{f: getattr(opts, f) for f in opts.__dataclass_fields__}, **overrides})
        self.options = opts
        self.model, self.optimizer = model, optimizer
        self.extra = dict(state or {})
        self._also_guard = tuple(guard)  # optimizers to guard that are not saved here (Lightning's trainer's)
        for name, obj in [("model", model), ("optimizer", optimizer), *self.extra.items()]:
            if obj is not None and not (hasattr(obj, "state_dict") or isinstance(obj, dict)):
                raise InvalidOptionError(f"{name}: expected an object with state_dict()/load_state_dict() or a dict, "
                                         f"got {type(obj).__name__}")
        roots = normalize_roots(root)
        # [dist hook] under torch.distributed (or with process_group=) the ranks agree on the roots, each
        # locks and cleans the ones it leads (gdswriter/distributed/session.py); else one process owns them all.
        # Each checkpointer has a coordination channel of its own (a gloo group, created here: construct
        # checkpointers in the same order on every rank, as any process group; released by close()).
        held = [n for n, o in (("model", model), ("optimizer", optimizer)) if o is not None]
        label = f"GDSCheckpointer({', '.join(held + [f'state[{k!r}]' for k in self.extra])})"
        self._dist = dist_session_for(roots, process_group, dist_options, label=label)
        if self._dist is not None and opts.on_busy == "skip":
            self._dist.close()
            raise _skip_across_ranks()
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
        self._engines_closed = False
        self.last_load: LoadResult | None = None
        self._handles: list[SaveHandle] = []
        self._retention: Future | None = None
        self._mutex = threading.Lock()
        self._closed = False
        self._init_saving()

    # -- info ----------------------------------------------------------------
    @property
    def roots(self) -> list[Path]:
        return list(self.protocol.roots)

    @property
    def engine_info(self):
        self._check_open()
        return self._engine_list()[0].info

    def steps(self) -> list[int]:
        """Committed steps, ascending (after any pending retention deletes)."""
        self._wait_retention()
        return self.protocol.committed_steps()

    def latest_step(self) -> int | None:
        return self.protocol.latest()

    def _check_open(self) -> None:
        if self._closed:
            raise GDSWriterError("this GDSCheckpointer is closed: create a new one")

    def _engine_list(self) -> list[IOEngine]:
        with self._mutex:
            if self._engines_closed:  # engines made now would never be closed
                raise GDSWriterError("this GDSCheckpointer is closed: create a new one")
            if not self._engines:
                self._engines = [create_engine(self.options.engine) for _ in self.protocol.roots]
            return self._engines

    # -- save ----------------------------------------------------------------
    def _init_saving(self) -> None:
        o = self.options
        self._snapshot_pool = HostSnapshotPool(o.snapshot_pool_bytes, window=o.engine.buffer_bytes,
                                               lock_memory=o.engine.lock_memory)
        self._jobs: deque[tuple[SaveHandle, Snapshot]] = deque()  # the first runs, the others wait
        self._jobs_cv = threading.Condition()
        self._worker: threading.Thread | None = None  # the save thread, while it runs (see _work)
        self._stopping = False
        self._submit_lock = threading.Lock()
        self._hooks: list[tuple[Any, Any]] = []  # (optimizer, its step pre-hook's handle)
        self._topology: Topology | None = None  # discovered at the first save of GPU state
        self._layout = LayoutCache()  # the last save's layout, reused while the tensors stay put
        self._last_plan: tuple[tuple, SavePlan] | None = None  # (what it was planned from, the plan)
        _open_checkpointers.add(self)

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

    def save(self, step: int, *, metadata: dict | None = None) -> int | None:
        """Write step ``step``; returns it once it is durable and committed. Exactly
        ``save_async(step, metadata=metadata).result()`` (so None if skipped, on_busy="skip")."""
        return self.save_async(step, metadata=metadata).result()

    def save_async(self, step: int, *, metadata: dict | None = None) -> SaveHandle:
        """Start saving ``step``; returns a SaveHandle within milliseconds, whatever the state's
        size, when an optimizer hook guards every large tensor saved: only references, the
        layout and the state's other values are taken now (else it also waits for the copy,
        or in "live" mode the write, of the tensors nothing guards).

        The live tensors must keep their values until ``handle.snapshotted()``: the next
        step of a guarded optimizer waits for that by itself, and saved tensors that no
        guarded optimizer holds are released before save_async returns (see the module
        docstring). ``metadata`` (plain JSON) is copied now. While an
        earlier save runs, CheckpointOptions.on_busy decides: "wait" queues this one behind
        it (save_async blocks only if another one is already queued), "skip" saves nothing
        and says so. A background failure is raised once: by ``handle.result()``, or else by
        the next ``save``/``save_async``/``wait``/``close`` or optimizer step.
        """
        t0 = time.perf_counter()
        self._check_open()
        if self._dist is not None and self.options.on_busy == "skip":  # options replaced after __init__
            raise _skip_across_ranks()
        step = self._save_step(step)
        self._raise_unreported()
        metadata = plain_json(metadata)  # now: later changes to the caller's objects do not reach the step
        mode = self.options.snapshot
        with self._submit_lock:
            with self._jobs_cv:
                running = [h.step for h, _ in self._jobs if not h.done()]
                if running and self.options.on_busy == "skip":
                    log.warning("gdswriter: step %d not saved: step %d is still being saved (on_busy='skip')",
                                step, running[-1])
                    return SaveHandle(step, mode, skipped=True)
                while len(self._jobs) > QUEUED_MAX:
                    self._jobs_cv.wait()
            protected = [t for opt in self._hook_optimizers() for t in tensors_of(opt)]
            state = self._collect()
            if self._dist is not None:  # [dist hook] DTensors -> their local shards (and where they lie)
                state = self._dist.prepare(state, step)
            snap = take_snapshot(state, step, metadata=metadata, protected=protected, layout=self._layout)
            handle = SaveHandle(step, mode)
            handle._nbytes = snap.nbytes
            with self._mutex:
                # Keep only handles whose outcome someone may still need: running, or failed unreported.
                self._handles = [h for h in self._handles
                                 if not h.done() or (not h.reported and h.exception() is not None)] + [handle]
            with self._jobs_cv:
                self._jobs.append((handle, snap))
                self._jobs_cv.notify_all()
                if self._worker is None:
                    # Published only once started: a job no thread runs, or a worker that does not
                    # exist, would make the optimizer step, close() and later saves wait forever.
                    worker = threading.Thread(target=self._work, name="gdswriter-save", daemon=True)
                    try:
                        worker.start()
                    except BaseException as e:  # RuntimeError "can't start new thread"
                        self._jobs.pop()
                        self._jobs_cv.notify_all()
                        err = GDSWriterError(
                            f"step {step} not saved: the save thread could not start ({type(e).__name__}: {e}). "
                            f"The process is likely at its thread limit (ulimit -u, the cgroup's pids.max): end "
                            f"threads it no longer needs or raise the limit, then save again")
                        handle.reported = True  # raised here, not again later
                        handle._release.set(error=err)
                        handle._finish(err)
                        raise err from e
                    self._worker = worker
        if snap.unguarded:
            self._hold_unguarded(handle, snap)
        handle._blocked += time.perf_counter() - t0
        return handle

    def _hold_unguarded(self, handle: SaveHandle, snap: Snapshot) -> None:
        """Wait until the save has released the live tensors that no optimizer hook guards:
        nothing else would keep them unchanged while the save reads them (stream-ordered on
        a GPU, as the hook waits). A failure sets the release too; it is reported as usual."""
        names = snap.unguarded
        log_once("save-async-unguarded",
                 f"gdswriter: save_async waits until the save has {'written' if handle.mode == 'live' else 'copied'} "
                 f"{len(names)} live tensor(s) that no optimizer step hook guards (e.g. {names[0]}): they could "
                 f"change before the save read them. Give the checkpointer the optimizer that updates them "
                 f"(optimizer=, or in state=) to make save_async return at once", logging.INFO)
        handle._release.wait_stream_ordered()

    def _work(self) -> None:
        """The save thread: run queued saves in order. It stays for the next save (starting a
        thread would cost save_async milliseconds), and ends when no save came for
        WORKER_IDLE_S or when _stop_worker asks (close, interpreter exit: a daemon thread still
        alive when the interpreter finalizes can abort the process)."""
        while True:
            with self._jobs_cv:
                if not self._jobs_cv.wait_for(lambda: self._jobs or self._stopping, WORKER_IDLE_S) or not self._jobs:
                    self._worker = None
                    return
                handle, snap = self._jobs[0]
            try:
                self._run(handle, snap)
            except BaseException:  # _run finishes the handle; never leave the queue behind a bug
                log.exception("gdswriter: the save thread failed after step %d", handle.step)
            with self._jobs_cv:
                self._jobs.popleft()
                # Let go of the snapshot (its captured copies, the storages it keeps alive) now,
                # not when the next save or the idle timeout ends this frame.
                del handle, snap
                self._jobs_cv.notify_all()

    def _run(self, handle: SaveHandle, snap: Snapshot) -> None:
        """One save, then its retention. The handle is finished whatever happens."""
        handle._started = time.perf_counter()
        retention: Future = Future()
        try:
            engines = self._engine_list()
            pool = self._snapshot_pool if handle.mode == "host" else None
            if self._dist is not None:  # [dist hook] every rank writes its share; one commit (dist/save.py)
                self._dist.write_and_commit(snap, engines, self.options.files_per_root, pool=pool,
                                            release=handle._release)
            else:
                targets = file_targets(len(self.protocol.roots), self.options.files_per_root)
                write_and_commit(snap, self.protocol, engines, pool=pool, release=handle._release,
                                 plan=self._plan(snap, targets))
            if pool is None:
                hint_unaligned([e.flat for e in snap.extents if not e.captured], self.options.engine, engines[0].info)
            # Deleting old steps can take long (unlink of large files, discard): the save is done at
            # its commit; wait()/steps() wait for the deletions.
            self._retention = retention
        except BaseException as e:
            handle._release.set(error=e)
            handle._finish(e)
            return
        handle._finish(None)
        st = handle.stats
        log.log(self.options.stats_log_level, "gdswriter: step %d saved (%s snapshot): training blocked %.1f ms, "
                "snapshot %.3f s, write %.3f s, %.1f MiB, %.2f GB/s", st.step, st.mode, st.blocked_s * 1e3,
                st.snapshot_s, st.write_s, st.nbytes / 2**20, st.gbps)
        try:
            self._apply_retention(snap.step)
        except Exception as e:  # noqa: BLE001 - nothing is lost: the step is retried after the next save
            log.warning("gdswriter: deleting the steps that retention drops after step %d under %s failed "
                        "(%s: %s); nothing is lost, they are deleted after the next save", snap.step,
                        self.protocol.primary, type(e).__name__, e)
        finally:
            retention.set_result(None)  # steps()/wait() wait for it; its failure is not theirs

    def _plan(self, snap: Snapshot, targets: list) -> SavePlan:
        """Which bytes go to which file: the topology planner's GPU-local plan when storages live
        on GPUs (each GPU writes to its nearest root; the topology is discovered once), else the
        balanced plan. A planner failure falls back to the balanced plan, with a warning: where
        bytes go is an optimisation, never a reason not to save."""
        sizes, devices = [e.nbytes for e in snap.extents], [str(e.device) for e in snap.extents]
        # A plan is a function of these (the topology is discovered once): in a training loop
        # every save after the first reuses the last one.
        key = (sizes, devices, targets)
        if self._last_plan is not None and self._last_plan[0] == key:
            return self._last_plan[1]
        plan = self._new_plan(sizes, devices, targets)
        self._last_plan = (key, plan)
        return plan

    def _new_plan(self, sizes: list[int], devices: list[str], targets: list) -> SavePlan:
        if not any(d.startswith("cuda") for d in devices):
            return plan_save(sizes, targets)
        try:
            if self._topology is None:
                self._topology = discover(roots=self.protocol.roots)
            return plan_for_save(sizes, devices, self.protocol.roots, targets, self._topology)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log_once("topology-plan", f"gdswriter: the topology planner failed ({type(e).__name__}: {e}); "
                                      f"balancing bytes across the roots without GPU locality")
            return plan_save(sizes, targets)

    def _hook_optimizers(self) -> list:
        """Keep the step pre-hook on every optimizer this checkpointer guards: ``optimizer``,
        the optimizers among the ``state=`` objects (those with param_groups) and
        ``guard=``; a replaced one loses it, a new one gets it. Returns the optimizers
        hooked; objects that are no torch.optim.Optimizer (nor wrap one) have no step hooks,
        so their tensors stay unguarded (save_async then waits for them, see _hold_unguarded)."""
        targets = _guard_targets([self.optimizer, *(v for v in self.extra.values() if hasattr(v, "param_groups")),
                                  *self._also_guard])
        kept = []
        for opt, hook in self._hooks:
            if any(opt is t for t in targets):
                kept.append((opt, hook))
            else:
                hook.remove()
        ref = weakref.ref(self)

        def before_step(optimizer, args, kwargs) -> None:
            ck = ref()
            if ck is not None:
                ck._before_optimizer_step()

        for t in targets:
            if all(t is not opt for opt, _ in kept):
                kept.append((t, t.register_step_pre_hook(before_step)))
        self._hooks = kept
        return targets

    def _before_optimizer_step(self) -> None:
        """The step pre-hook: the step may change the tensors once every save in flight has
        released them; a background failure not yet reported is raised here."""
        with self._jobs_cv:
            pending = [h for h, _ in self._jobs]
        for h in pending:
            t0 = time.perf_counter()
            h._release.wait_stream_ordered()
            h._blocked += time.perf_counter() - t0
        self._raise_unreported()

    def _save_step(self, step: Any) -> int:
        """The step to save as a plain int (InvalidOptionError if it is not one); ReadOnlyRootError
        when the roots were opened for loading only."""
        step = normalize_step(step)
        if self._read_only is not None:
            raise ReadOnlyRootError(self._read_only.errno, f"cannot save step {step}: "
                                                           f"{self._read_only.strerror}") from self._read_only
        return step

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
    def _take_unreported(self) -> list[SaveHandle]:
        """The failed saves nobody was told about yet, now marked told."""
        with self._mutex:
            failed = [h for h in self._handles
                      if not h.reported and (h._release.error is not None or h.exception() is not None)]
            for h in failed:
                h.reported = True
        return failed

    def _raise_unreported(self) -> None:
        """Raise the first unreported failure with its own type (the handle's own error once it is
        done; its release's while it finishes); the others found with it are logged."""
        failed = self._take_unreported()
        if not failed:
            return
        for h in failed[1:]:
            e = h.exception() or h._release.error
            log.error("gdswriter: step %d was not saved either: %s: %s", h.step, type(e).__name__, e)
        first = failed[0]
        raise (first.exception() if first.done() else first._release.error)  # type: ignore[misc]

    def _log_unreported(self) -> None:
        """At interpreter exit: nobody is left to raise a failure to, so log each one."""
        failed = self._take_unreported()
        if not failed:
            return
        try:
            latest = self.protocol.latest()
        except Exception:  # noqa: BLE001 - only for the message
            latest = "unknown"
        for h in failed:
            e = h.exception() or h._release.error
            log.error("gdswriter: step %d was NOT saved (%s: %s); the newest committed step is %s. The error was "
                      "not reported before the interpreter exited: call save(), handle.result(), wait() or "
                      "close() to get such errors raised", h.step, type(e).__name__, e, latest, exc_info=e)

    def _drain(self) -> None:
        """Wait until no save is running or queued."""
        with self._jobs_cv:
            while self._jobs:
                self._jobs_cv.wait()

    def _stop_worker(self) -> None:
        """Make the save thread end once no save is queued, and wait for it."""
        with self._jobs_cv:
            self._stopping = True
            self._jobs_cv.notify_all()
            worker = self._worker
        if worker is not None:
            worker.join()

    def _quiesce(self) -> None:
        self._drain()
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

        ``atomic`` (default: for states up to load.policy.ATOMIC_LOAD_MAX_BYTES): read into fresh
        buffers and verify every checksum before copying into the live tensors, so a damaged
        step leaves them untouched. Otherwise tensors are read straight into the live parameters
        (zero-copy) and a ChecksumMismatchError can leave those read in place (model tensors, a
        resumed optimizer's state) partly overwritten; the error's note names them, and no
        load_state_dict has run: load an intact step afterwards.

        ``fallback=True`` (with ``step=None``): if the latest step is damaged (manifest, files,
        checksums), warn naming the problem and load the newest intact older step instead.

        A multi-rank checkpoint (on its ranks, or in one process) always loads atomically: every
        rank reads into fresh buffers and verifies them, and all agree, before any live tensor
        changes; with ``fallback`` every rank lands on the same step.
        """
        self._check_open()
        self._quiesce()
        verify = self.options.verify if verify is None else verify
        peeked = None if self._dist is not None else peek_manifest(self.protocol, step)
        multi_rank = peeked is not None and peeked.dist is not None
        if peeked is None and fallback and self._dist is None:  # the latest manifest is damaged: ask an older one
            older = (peek_manifest(self.protocol, s) for s in self.protocol.fallback_order()[1:])
            multi_rank = next((m.dist is not None for m in older if m is not None), False)
        if self._dist is not None or multi_rank:  # [dist hook] collective load
            self.last_load = dist_load_into(self, step, strict=strict, verify=verify, fallback=fallback, atomic=atomic)
            return self.last_load.step
        live = LiveState(self.model, self.optimizer, self.extra, restore_rng=self.options.save_rng)
        kw = dict(strict=strict, verify=verify, engine_options=self.options.engine, atomic=atomic, manifest=peeked)
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
        """Wait for outstanding saves, remove the optimizer hooks, release the snapshot pool,
        engines and the root lock. Raises an unreported background error after releasing
        everything."""
        if self._closed:
            return
        self._closed = True
        for _, hook in self._hooks:
            hook.remove()
        self._hooks = []
        try:
            self.wait()
        finally:
            self._drain()
            self._stop_worker()
            self._snapshot_pool.close()
            with self._mutex:
                engines, self._engines, self._engines_closed = self._engines, [], True
            for e in engines:
                e.close()
            if self._lock is not None:
                self._lock.release()
            if self._dist is not None:  # [dist hook] its locks and its coordination channel
                self._dist.close()
            _open_checkpointers.discard(self)

    def __enter__(self) -> GDSCheckpointer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:
                log.exception("gdswriter: a background save also failed while handling another error")


# Saves in flight when the interpreter exits are finished first: this runs before
# concurrent.futures shuts its thread pools down (which a multi-root save uses), as
# threading's exit hooks run in reverse order of registration.
_open_checkpointers: weakref.WeakSet[GDSCheckpointer] = weakref.WeakSet()
# A forked child has none of the parent's save threads: it must not wait for their saves.
os.register_at_fork(after_in_child=_open_checkpointers.clear)


def _finish_saves_at_exit() -> None:
    for ck in list(_open_checkpointers):
        try:
            ck._quiesce()
        except BaseException:
            log.exception("gdswriter: a save failed while the interpreter exited")
        finally:
            ck._stop_worker()
        ck._log_unreported()


try:
    threading._register_atexit(_finish_saves_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # no such hook in this Python: atexit also runs before daemon threads stop
    atexit.register(_finish_saves_at_exit)
