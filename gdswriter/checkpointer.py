"""GDSCheckpointer: save, load and resume training state, crash-safe, while training goes on.

The facade over the pipeline: collect state -> snapshot (save/snapshot.py) -> plan, write and
commit (save/writer.py; through the host snapshot pool, save/pool.py, in "host" mode) ->
retention; load reads a committed step back (load/: reader, verify, apply, policy). Where and how a step is
written, committed, retained and loaded is the checkpointer's Session (session.py: one
process, or every rank of a process group, gdswriter/distributed/); the saves run in order in
a save thread (save/queue.py). ``save(step)`` is ``save_async(step).result()``.

Saving while training goes on. ``save_async(step)`` records what to save (tensor
references, the state's containers and other values copied, an event per GPU on the
current stream) and returns; the encoding, the layout and the bytes follow in the background
(save/snapshot.py: PendingSnapshot). Until the save has
*released* the tensors (``handle.snapshotted()``: in "host" mode once they are copied into
the host pool, in "live" mode once they are written), their memory must keep the saved
values. The checkpointer enforces this for the optimizers it guards (the one it was given,
every optimizer among the ``state=`` objects, and those an integration adds, e.g.
Lightning's): a step pre-hook makes their ``step()`` (also through GradScaler.step) wait
for the release (on a GPU, in "host" mode, the training stream waits on the copies' events;
the host does not). Everything else cannot be guarded, so save_async holds it itself:

* forward, backward, ``zero_grad``, data loading, LR scheduler and GradScaler updates may
  run right after save_async (their values were captured at the call), and so may changes
  to the state's dicts and lists and the plain values in them (copied at the call);
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

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout
from itertools import chain, islice
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

import torch

from .drain import DrainStats, check_drain_root
from .endurance import WearWatch
from .engines.base import IOEngine
from .engines.select import create_engine, for_pool_writes, sized_for
from .errors import GDSWriterError, InvalidOptionError
from .format.commit import normalize_roots, normalize_step
from .load.apply import LiveState, LoadResult
from .load.reader import load_state
from ._log import log_once
from .options import CheckpointOptions
from .rng import rng_state
from .save.handle import SaveHandle, SaveStats
from .save.pool import HostSnapshotPool
from .save.queue import SaveQueue
from .save.snapshot import GuardedMemory, LayoutCache, PendingSnapshot, held_by, plain_json, record_snapshot
from .tensors import hint_unaligned
from .session import Session, open_session
from .threads import gc_paused

if TYPE_CHECKING:
    from .distributed.options import DistOptions

log = logging.getLogger("gdswriter")

GC_PAUSE_MIN_TENSORS = 8192
"""From this many tensors a save or a load runs with automatic garbage collection held off
(threads.gc_paused): its objects per tensor would set off full collections of the heap (5 per save
at 100,000 tensors; 7 per load, a third of its time)."""


def _holds_many_tensors(objects: Sequence[Any]) -> bool:
    """Whether ``objects`` (the live model, optimizer, extra state) hold about GC_PAUSE_MIN_TENSORS
    tensors or more, counted as a save counts them, without making their state dicts: a
    module's parameters and buffers, an optimizer's per-parameter states (its parameters are
    the module's), a mapping's values; stops counting at the bound."""
    def each(obj: Any) -> Iterator[Any]:
        if isinstance(obj, torch.nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif hasattr(obj, "param_groups"):
            yield from getattr(obj, "state", {}).values()
        elif isinstance(obj, Mapping):
            yield from obj.values()

    counted = islice(chain.from_iterable(map(each, objects)), GC_PAUSE_MIN_TENSORS)
    return sum(1 for _ in counted) >= GC_PAUSE_MIN_TENSORS

__all__ = ["CheckpointOptions", "GDSCheckpointer", "LoadResult", "SaveHandle", "SaveStats", "load_state"]



# ----------------------------------------------------------------------------- checkpointer
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

    ``engines``: the I/O engines to use (e.g. ``create_engine(...)``'s, or a testing engine),
    one per root in root order (on each rank: one per root of its own); the checkpointer
    takes them over once constructed and closes them in close(), as the ones it makes itself
    (by default, from ``options.engine`` when first needed). ``engines`` (the property) gives
    the engines in use.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, root: Any = "ckpts", *,
                 state: Mapping[str, Any] | None = None, options: CheckpointOptions | None = None,
                 keep_last: int | None = None, keep_every: int | None = None, save_rng: bool | None = None,
                 process_group: Any = None, dist_options: DistOptions | None = None, guard: Sequence[Any] = (),
                 engines: Sequence[IOEngine] | None = None, drain_engine: IOEngine | None = None):
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
        if engines is not None:
            engines = list(engines)
            if len(engines) != len(roots) or not all(isinstance(e, IOEngine) for e in engines):
                raise InvalidOptionError(
                    f"engines: expected one IOEngine per root ({len(roots)}, in root order), got "
                    f"{len(engines)} ({', '.join(type(e).__name__ for e in engines) or 'none'}): pass one engine per "
                    f"root, e.g. [create_engine(options.engine) for _ in roots], or leave engines=None")
        # Under torch.distributed (or with process_group=) the ranks agree on the roots, each locks
        # and cleans the ones it leads (gdswriter/distributed/session.py); else one process owns
        # them all (session.py). A multi-rank session has a coordination channel of its own (a gloo
        # group, created here: construct checkpointers in the same order on every rank, as any
        # process group; released by close()).
        held = [n for n, o in (("model", model), ("optimizer", optimizer)) if o is not None]
        label = f"GDSCheckpointer({', '.join(held + [f'state[{k!r}]' for k in self.extra])})"
        if opts.drain_root is not None:
            check_drain_root(opts.drain_root, roots)
        elif drain_engine is not None:
            raise InvalidOptionError("drain_engine is the engine of the drain: set CheckpointOptions(drain_root=...) "
                                     "too, or leave drain_engine=None")
        self._session: Session = open_session(roots, process_group, dist_options, label=label)
        try:
            self._session.check_options(opts)
        except BaseException:
            self._session.close()
            raise
        self.protocol = self._session.protocol
        # Committed steps copied to shared storage in the background (drain.py)
        # (several ranks: each rank drains its part, the last to finish commits: distributed/drain.py)
        self._drainer = None if opts.drain_root is None else self._session.drainer(opts, drain_engine)
        self._engines: list[IOEngine] = engines or []
        # Engines with fewer staging buffers, per their options, while the engines are not built:
        # for host-mode saves (for_pool_writes) and small loads (sized_for)
        self._small_engines: dict[Any, list[IOEngine]] = {}
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

    @property
    def engines(self) -> tuple[IOEngine, ...]:
        """The I/O engines, one per root in root order (made on first use unless given as
        ``engines=``; closed by close())."""
        self._check_open()
        return tuple(self._engine_list())

    @property
    def session(self) -> Session:
        """The Session this checkpointer saves and loads through (LocalSession in one process,
        DistSession under a process group; gdswriter/session.py): its plan cache and its
        coordination channel's counters, for diagnosis."""
        return self._session

    @property
    def snapshot_pool(self) -> HostSnapshotPool:
        """The host snapshot pool the saves copy into (save/pool.py): its capacity and whether its
        page-locked memory is still being reserved, for diagnosis."""
        return self._snapshot_pool

    @property
    def engines_made(self) -> dict[Any, tuple[IOEngine, ...]]:
        """The engines made so far, by the options they were made with: the full-size ones
        (``options.engine``) and the smaller ones that saves and loads of a small state use
        (engines/select.py); for diagnosis. Makes none (unlike ``engines``)."""
        with self._mutex:
            made = {k: tuple(v) for k, v in self._small_engines.items()}
            if self._engines:
                made[self.options.engine] = tuple(self._engines)
            return made

    @property
    def save_queue(self) -> SaveQueue:
        """The queue of asynchronous saves (save/queue.py): its jobs and its worker thread, for
        diagnosis."""
        return self._queue

    def steps(self) -> list[int]:
        """Committed steps, ascending (after any pending retention deletes)."""
        self._wait_retention()
        return self.protocol.committed_steps()

    def latest_step(self) -> int | None:
        return self.protocol.latest()

    def drained_step(self) -> int | None:
        """The newest step committed at the drain root (CheckpointOptions.drain_root), by this
        checkpointer or an earlier run; None without a drain root or before any drain."""
        return None if self._drainer is None else self._drainer.drained_step()

    @property
    def last_drain(self) -> DrainStats | None:
        """How the last successful drain went (None before one, or without a drain root)."""
        return None if self._drainer is None else self._drainer.last

    def wait_drained(self, timeout: float | None = None) -> int | None:
        """Wait for the saves in flight, then for the drain running and the one waiting; returns
        drained_step(). Raises the DrainError of a failed drain not yet raised (each once);
        concurrent.futures.TimeoutError after ``timeout`` s. Several ranks: this rank's part of
        the drain is done; the step is at the drain root once every rank's part is (the last
        rank commits it; e.g. wait_drained() on every rank, then a barrier)."""
        self._quiesce()
        if self._drainer is None:
            return None
        if not self._drainer.wait(timeout):
            raise FutureTimeout(f"the drain to {self._drainer.root} did not end within {timeout} s")
        error = self._drainer.take_error()
        if error is not None:
            raise error
        return self._drainer.drained_step()

    def protected_step(self) -> int | None:
        """The newest protected step (DistOptions(replicas=C) with C > 1: every copy on its peer
        nodes durable, format.md 11); None without replicas or before one."""
        return self._session.protected_step()

    def wait_protected(self, timeout: float | None = None) -> int | None:
        """Wait for the saves in flight, then for their replication to peer nodes and for the
        refill of a loaded step whose replaced node's files came from copies (docs/format.md
        11.2); returns protected_step(). Raises the ReplicationError of a step left unprotected
        (or not refilled) not yet raised
        (each once: the step stays committed); concurrent.futures.TimeoutError after
        ``timeout`` s. None without replicas."""
        self._quiesce()
        rep = self._session.replicator
        if rep is None:
            return None
        if not rep.wait(timeout):
            raise FutureTimeout(f"the replication to peer nodes did not end within {timeout} s")
        error = rep.take_error()
        if error is not None:
            raise error
        return self._session.protected_step()

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

    def _load_engines(self, nbytes: int | None = None) -> list[IOEngine]:
        """The engines a load of ``nbytes`` uses: the checkpointer's when they are built (or the
        load is large), else small ones (see _small_engine_list)."""
        if self._engines_ready() or nbytes is None or sized_for(self.options.engine, nbytes) is self.options.engine:
            return self._engine_list()
        return self._small_engine_list(sized_for(self.options.engine, nbytes))

    def _save_engines(self, mode: str) -> list[IOEngine]:
        """The engines a save uses: the checkpointer's once they are built (by a live-mode save,
        a large load, or ``engines``), else, for a host-mode save, small ones: a save through the
        host pool writes its pieces zero-copy and stages only their tails, so it runs at the same
        speed with two staging buffers instead of 8 x 16 MiB per root to map and lock first
        (0.03-0.45 s here, on the first save's critical path)."""
        if mode != "host" or self._engines_ready():
            return self._engine_list()
        small = self._small_engine_list(for_pool_writes(self.options.engine))
        return small if all(e.honours_span_guards for e in small) else self._engine_list()

    def _engines_ready(self) -> bool:
        with self._mutex:
            return bool(self._engines)

    def _small_engine_list(self, options) -> list[IOEngine]:
        """One engine per root made with ``options`` (fewer staging buffers: engines/select.py),
        made once, kept for the next time, closed by close()."""
        with self._mutex:
            if self._engines_closed:
                raise GDSWriterError("this GDSCheckpointer is closed: create a new one")
            made = self._small_engines.get(options)
            if made is None:
                made = self._small_engines[options] = [create_engine(options) for _ in self.protocol.roots]
            return made

    # -- save ----------------------------------------------------------------
    def _init_saving(self) -> None:
        o = self.options
        self._snapshot_pool = HostSnapshotPool(o.snapshot_pool_bytes, window=o.engine.buffer_bytes,
                                               lock_memory=o.engine.lock_memory)
        self._queue = SaveQueue(self._run, quiesce=self._quiesce_at_exit, report=self._log_unreported)
        self._submit_lock = threading.Lock()
        self._hooks: list[tuple[Any, Any]] = []  # (optimizer, its step pre-hook's handle)
        self._layout = LayoutCache()  # the last save's layout, reused while the tensors stay put
        self._guarded = GuardedMemory()  # where the hooked optimizers' tensors lie (save_async)
        self._wear = WearWatch(self.protocol.roots)  # the saves' pace against the drives' endurance

    def _collect(self) -> dict:
        """The state to save: the objects' state_dict()s (timed apart in save_async: SaveStats.state_dict_s)."""
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
        ``save_async(step, metadata=metadata).result()`` (so None if skipped, on_busy="skip"),
        except that a blocking save never has the host pool of the state's size reserved: its
        caller waits for the whole write anyway, so it streams through the pool's small ring
        when no full pool is there (save/pool.py), at the same speed, with no memory set aside;
        and it copies no small tensor at the call (save/snapshot.py record_snapshot's ``blocking``):
        nothing can change them before the save has read them."""
        return self._submit(step, metadata, blocking=True).result()

    def save_async(self, step: int, *, metadata: dict | None = None) -> SaveHandle:
        """Start saving ``step``; returns a SaveHandle within milliseconds, whatever the state's
        size, when an optimizer hook guards every large tensor saved: only references, copies
        of the state's containers and other values, and copies of the small tensors nothing
        guards are taken now, under 1 µs per tensor besides the objects' ``state_dict()``
        calls (SaveStats.state_dict_s); the encoding and layout follow in the save thread (else
        it also waits for the copy, or in "live" mode the write, of the large tensors nothing
        guards). An unsupported object is reported now (UnsupportedObjectError); a quantized
        tensor that a guarded optimizer holds, or a tensor copied now and resized in place
        before the save thread laid it out (SnapshotChangedError), by the handle.

        The live tensors must keep their values until ``handle.snapshotted()``: the next
        step of a guarded optimizer waits for that by itself, and saved tensors that no
        guarded optimizer holds are released before save_async returns (see the module
        docstring). ``metadata`` (plain JSON) is copied now. While an
        earlier save runs, CheckpointOptions.on_busy decides: "wait" queues this one behind
        it (save_async blocks only if another one is already queued), "skip" saves nothing
        and says so. A background failure is raised once: by ``handle.result()``, or else by
        the next ``save``/``save_async``/``wait``/``close`` or optimizer step.
        """
        return self._submit(step, metadata, blocking=False)

    def _submit(self, step: int, metadata: dict | None, *, blocking: bool) -> SaveHandle:
        """save_async; ``blocking``: for save(), whose caller waits for the result."""
        t0 = time.perf_counter()
        self._check_open()
        self._session.check_options(self.options)  # options may be replaced after __init__
        step = self._save_step(step)
        self._raise_unreported()
        metadata = plain_json(metadata)  # now: later changes to the caller's objects do not reach the step
        mode = self.options.snapshot
        with self._submit_lock:
            running = self._queue.wait_for_room(skip_if_busy=self.options.on_busy == "skip")
            if running is not None:
                log.warning("gdswriter: step %d not saved: step %d is still being saved (on_busy='skip')",
                            step, running)
                return SaveHandle(step, mode, skipped=True)
            hooked = self._hook_optimizers()
            guarded = self._guarded.update(held_by(hooked[0]) if len(hooked) == 1
                                           else [t for opt in hooked for t in held_by(opt)])
            # No garbage collection while the state is collected and recorded: the objects made per
            # tensor (state_dict's aliases, copied containers, weak references) would set off full
            # collections of the heap (at 100,000 tensors about 40% of the call); see GC_PAUSE_MIN_TENSORS
            with gc_paused():
                t1 = time.perf_counter()
                collected = self._collect()
                state_dict_s = time.perf_counter() - t1
                # DTensors -> their local shards (and where they lie) under torch.distributed
                state, prepared = self._session.prepare(collected, step)
                # References, copied containers, and the unguarded tensors' copies: the rest in the save thread (_run)
                snap = record_snapshot(state, step, metadata=metadata, guarded=guarded, layout=self._layout,
                                       prepared=prepared, blocking=blocking)
            handle = SaveHandle(step, mode)
            handle.state_dict_s, handle.blocking = state_dict_s, blocking
            with self._mutex:
                # Keep only handles whose outcome someone may still need: running, or failed unreported.
                self._handles = [h for h in self._handles
                                 if not h.done() or (not h.reported and h.exception() is not None)] + [handle]
            self._queue.submit(handle, snap)
        if snap.unguarded:
            self._hold_unguarded(handle, snap)
        handle.blocked_s += time.perf_counter() - t0
        return handle

    def _hold_unguarded(self, handle: SaveHandle, snap: PendingSnapshot) -> None:
        """Wait until the save has released the live tensors that no optimizer hook guards:
        nothing else would keep them unchanged while the save reads them (stream-ordered on
        a GPU, as the hook waits). A failure sets the release too; it is reported as usual."""
        log_once("save-async-unguarded", lambda: (
            f"gdswriter: save_async waits until the save has {'written' if handle.mode == 'live' else 'copied'} "
            f"{len(snap.unguarded)} live tensor(s) that no optimizer step hook guards (e.g. {snap.unguarded_name()}): "
            f"they could change before the save read them. Give the checkpointer the optimizer that updates them "
            f"(optimizer=, or in state=) to make save_async return at once"), logging.INFO)
        handle.release.wait_stream_ordered()

    def _run(self, handle: SaveHandle, pending: PendingSnapshot) -> None:
        """One save, then its retention (in the save thread, save/queue.py). The handle is
        finished whatever happens."""
        handle.started = time.perf_counter()
        retention: Future = Future()
        try:
            # A save of many tensors makes objects per tensor that live until its end and hold no
            # cycles: no garbage collection runs while it does (they are freed before it resumes)
            many = pending.tensor_count >= GC_PAUSE_MIN_TENSORS
            with gc_paused() if many else nullcontext():
                # The encoding, layout and records save_async left here: before any byte is read,
                # so while the step pre-hook still holds the guarded tensors
                snap = pending.complete(self._layout)
                del pending
                step = snap.step
                handle.nbytes = snap.nbytes
                engines = self._save_engines(handle.mode)
                pool = self._snapshot_pool if handle.mode == "host" else None
                if pool is not None:  # saves run one at a time here: the flag is this save's
                    pool.grow = not handle.blocking
                self._session.write_and_commit(snap, engines, self.options.files_per_root, pool=pool,
                                               release=handle.release)
                if pool is None:
                    hint_unaligned([e.flat for e in snap.extents if not e.captured], self.options.engine,
                                   engines[0].info)
                del snap
            # Deleting old steps can take long (unlink of large files, discard): the save is done at
            # its commit; wait()/steps() wait for the deletions.
            self._retention = retention
        except BaseException as e:
            handle.release.set(error=e)
            handle.finish(e)
            return
        if pool is not None:  # committed, streamed through the small ring: the full pool, off the critical path
            pool.reserve_ahead()
        handle.finish(None)
        if self._drainer is not None and self._drainer.wants(step):
            self._drainer.submit(step)  # returns at once: the drain has a thread of its own
        st = handle.stats
        self._watch_wear(st)
        log.log(self.options.stats_log_level, "gdswriter: step %d saved (%s snapshot): training blocked %.1f ms, "
                "snapshot %.3f s, write %.3f s, %.1f MiB, %.2f GB/s", st.step, st.mode, st.blocked_s * 1e3,
                st.snapshot_s, st.write_s, st.nbytes / 2**20, st.gbps)
        try:
            self._apply_retention(step)
        except Exception as e:  # noqa: BLE001 - nothing is lost: the step is retried after the next save
            log.warning("gdswriter: deleting the steps that retention drops after step %d under %s failed "
                        "(%s: %s); nothing is lost, they are deleted after the next save", step,
                        self.protocol.primary, type(e).__name__, e)
        finally:
            retention.set_result(None)  # steps()/wait() wait for it; its failure is not theirs

    def _watch_wear(self, st: SaveStats) -> None:
        """Count a committed save against the drives' endurance (endurance.py: warns once per drive
        when the schedule would wear one out before CheckpointOptions.endurance_horizon_days). A
        failure here costs the check, never the save."""
        o = self.options
        if o.endurance_horizon_days is None:
            return
        try:
            self._wear.saved(time.monotonic(), st.nbytes, o.endurance_horizon_days, o.drive_tbw)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the step is committed
            log_once("endurance-failed", f"gdswriter: the drive endurance check failed ({type(e).__name__}: {e}) "
                                         f"and is skipped; set endurance_horizon_days=None to turn it off")

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
        for h in self._queue.handles():
            t0 = time.perf_counter()
            h.release.wait_stream_ordered()
            h.blocked_s += time.perf_counter() - t0
        self._raise_unreported()

    def _save_step(self, step: Any) -> int:
        """The step to save as a plain int (InvalidOptionError if it is not one); ReadOnlyRootError
        when the roots were opened for loading only."""
        step = normalize_step(step)
        self._session.check_writable(step)
        return step

    def _apply_retention(self, newest: int) -> None:
        """Delete committed steps the policy no longer keeps (never ``newest``). A failure
        here loses nothing: it is logged and the step is retried after the next save (multi-rank:
        the primary rank decides, each root's leader deletes: collective)."""
        if self._drainer is None:
            self._session.apply_retention(newest, self.options.retained)
            return
        pinned = self._drainer.pinned()  # steps waiting or draining stay until their drain ended
        self._session.apply_retention(newest, lambda steps, new: self.options.retained(steps, new) | pinned)

    def _wait_retention(self) -> None:
        pending = self._retention
        if pending is not None:
            pending.result()

    # -- waiting ---------------------------------------------------------------
    def _take_unreported(self) -> list[SaveHandle]:
        """The failed saves nobody was told about yet, now marked told."""
        with self._mutex:
            failed = [h for h in self._handles
                      if not h.reported and (h.release.error is not None or h.exception() is not None)]
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
            e = h.exception() or h.release.error
            log.error("gdswriter: step %d was not saved either: %s: %s", h.step, type(e).__name__, e)
        first = failed[0]
        raise (first.exception() if first.done() else first.release.error)  # type: ignore[misc]

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
            e = h.exception() or h.release.error
            log.error("gdswriter: step %d was NOT saved (%s: %s); the newest committed step is %s. The error was "
                      "not reported before the interpreter exited: call save(), handle.result(), wait() or "
                      "close() to get such errors raised", h.step, type(e).__name__, e, latest, exc_info=e)

    def _quiesce(self) -> None:
        self._queue.drain()
        self._wait_retention()

    def _quiesce_at_exit(self) -> None:
        """At interpreter exit: the saves, then their replication to peer nodes (every rank waits
        for it, so the last step gets protected), then the drains they started (drain.py)."""
        self._quiesce()
        if self._session.replicator is not None:
            self._session.replicator.wait()
        if self._drainer is not None:
            self._drainer.close()

    def wait(self) -> None:
        """Wait for every outstanding save (and its replication to peer nodes, whose failures
        wait_protected raises); re-raise a background save error not yet reported."""
        self._quiesce()
        if self._session.replicator is not None:
            self._session.replicator.wait()
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
        checksums), warn naming the problem and load the newest intact older step instead. A
        step deleted while it is read (another process's retention) is gone, not damaged: it is
        passed over without a warning (not in ``last_load.damaged``), and the steps committed by
        then are tried (once).

        A multi-rank checkpoint loads atomically by default (``atomic`` None or True; in one
        process, always): every rank reads into fresh buffers and verifies them, and all agree,
        before any live tensor changes; with ``fallback`` every rank lands on the same step.
        On its ranks, ``atomic=False`` reads (and receives from peers) each plain CPU tensor
        straight into the live one, every chunk still checked against its crc32c where it lands
        (a bad copy still moves to the next copy): no fresh buffers and no copy, but a load that
        fails leaves those tensors partly written (the error's hint says so): load an intact
        step before training on. ``fallback=True`` stays atomic.
        """
        self._check_open()
        self._quiesce()
        verify = self.options.verify if verify is None else verify
        if fallback and step is not None:
            raise InvalidOptionError("load(fallback=True) chooses the step itself (the newest intact one): "
                                     "pass step=None, or load a given step without fallback")
        live = LiveState(self.model, self.optimizer, self.extra, restore_rng=self.options.save_rng)
        # A state of many tensors: the manifest's records, the plan and the rebuilt tree are objects
        # per tensor, without cycles, freed when the load ends (see GC_PAUSE_MIN_TENSORS)
        many = _holds_many_tensors([self.model, self.optimizer, *self.extra.values()])
        with gc_paused() if many else nullcontext():
            self.last_load = self._session.load(live, self._collect, step, self._load_engines, strict=strict,
                                                verify=verify, fallback=fallback, atomic=atomic,
                                                engine_options=self.options.engine)
        return self.last_load.step

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Wait for outstanding saves, remove the optimizer hooks, hand the snapshot pool to the
        process (kept for the next checkpointer: save/pool.py; release_kept_pool() frees it), release the
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
            self._queue.drain()
            self._queue.close()
            self._snapshot_pool.close()
            with self._mutex:
                engines, self._engines, self._engines_closed = self._engines, [], True
                engines += [e for made in self._small_engines.values() for e in made]
                self._small_engines = {}
            for e in engines:
                e.close()
            if self._drainer is not None:
                self._drainer.close()  # waits for the drains in flight and waiting
            self._session.close()  # its locks (multi-rank: and its coordination channel)

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
