"""The save thread of a GDSCheckpointer: saves queued in order, and the process's exit and fork.

``SaveQueue`` runs one checkpointer's saves one after the other in a thread of its own
(started by the first save, ended when no save came for WORKER_IDLE_S, or by ``close``).
Saves still in flight when the interpreter exits are finished first (and their failures
logged: nobody is left to raise them to); a forked child has none of its parent's save
threads, so it never waits for their saves.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours, so ours runs first
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable

from ..errors import GDSWriterError
from .handle import SaveHandle
from .snapshot import PendingSnapshot

log = logging.getLogger("gdswriter")

QUEUED_MAX = 1  # saves waiting behind the running one (on_busy="wait"); save_async blocks beyond
WORKER_IDLE_S = 10.0  # the save thread ends after this long without a save


class SaveQueue:
    """One checkpointer's saves, run in order by its save thread. ``jobs``: the running save
    first, then those waiting; ``worker``: the save thread, while it runs.

    ``run(handle, snap)`` performs one save (and finishes its handle); ``quiesce()`` waits for
    everything the owner started and ``report()`` logs its failures nobody was told about:
    both run at interpreter exit. The queue keeps only weak references to them (its owner's
    bound methods), so it does not keep its owner alive; a running save thread does."""

    def __init__(self, run: Callable[[SaveHandle, PendingSnapshot], None], *, quiesce: Callable[[], None],
                 report: Callable[[], None]):
        self._run, self._quiesce, self._report = (weakref.WeakMethod(f) for f in (run, quiesce, report))  # type: ignore[arg-type]
        self.jobs: deque[tuple[SaveHandle, PendingSnapshot]] = deque()  # the first runs, the others wait
        self.cv = threading.Condition()
        self.worker: threading.Thread | None = None
        self._stopping = False
        _open_queues.add(self)

    def handles(self) -> list[SaveHandle]:
        """The saves running or queued."""
        with self.cv:
            return [h for h, _ in self.jobs]

    def wait_for_room(self, *, skip_if_busy: bool = False) -> int | None:
        """Block while QUEUED_MAX saves wait behind the running one. ``skip_if_busy``: wait for
        nothing and return the step still being saved, if any (None: room was made)."""
        with self.cv:
            running = [h.step for h, _ in self.jobs if not h.done()]
            if running and skip_if_busy:
                return running[-1]
            while len(self.jobs) > QUEUED_MAX:
                self.cv.wait()
        return None

    def submit(self, handle: SaveHandle, snap: PendingSnapshot) -> None:
        """Queue the save, starting the save thread if none runs. A thread that cannot start
        fails the save (GDSWriterError, raised here and marked reported)."""
        with self.cv:
            self.jobs.append((handle, snap))
            self.cv.notify_all()
            if self.worker is not None:
                return
            # Published only once started: a job no thread runs, or a worker that does not
            # exist, would make the optimizer step, close() and later saves wait forever.
            run = self._run()
            worker = threading.Thread(target=self._work, args=(run,), name="gdswriter-save", daemon=True)
            try:
                if run is None:
                    raise RuntimeError("the checkpointer is gone")
                worker.start()
            except BaseException as e:  # RuntimeError "can't start new thread"
                self.jobs.pop()
                self.cv.notify_all()
                err = GDSWriterError(
                    f"step {handle.step} not saved: the save thread could not start ({type(e).__name__}: {e}). "
                    f"The process is likely at its thread limit (ulimit -u, the cgroup's pids.max): end "
                    f"threads it no longer needs or raise the limit, then save again")
                handle.reported = True  # raised here, not again later
                handle.release.set(error=err)
                handle.finish(err)
                raise err from e
            self.worker = worker

    def _work(self, run: Callable[[SaveHandle, PendingSnapshot], None]) -> None:
        """The save thread: run queued saves in order. It stays for the next save (starting a
        thread would cost save_async milliseconds), and ends when no save came for
        WORKER_IDLE_S or when ``stop`` asks (close, interpreter exit: a daemon thread still
        alive when the interpreter finalizes can abort the process)."""
        while True:
            with self.cv:
                if not self.cv.wait_for(lambda: self.jobs or self._stopping, WORKER_IDLE_S) or not self.jobs:
                    self.worker = None
                    return
                handle, snap = self.jobs[0]
            try:
                run(handle, snap)
            except BaseException:  # run finishes the handle; never leave the queue behind a bug
                log.exception("gdswriter: the save thread failed after step %d", handle.step)
            with self.cv:
                self.jobs.popleft()
                # Let go of the snapshot (its captured copies, the storages it keeps alive) now,
                # not when the next save or the idle timeout ends this frame.
                del handle, snap
                self.cv.notify_all()

    def drain(self) -> None:
        """Wait until no save is running or queued."""
        with self.cv:
            while self.jobs:
                self.cv.wait()

    def stop(self) -> None:
        """Make the save thread end once no save is queued, and wait for it."""
        with self.cv:
            self._stopping = True
            self.cv.notify_all()
            worker = self.worker
        if worker is not None:
            worker.join()

    def close(self) -> None:
        """``stop``, and nothing is left to finish at exit."""
        self.stop()
        _open_queues.discard(self)

    def finish_at_exit(self) -> None:
        quiesce, report = self._quiesce(), self._report()
        try:
            if quiesce is not None:
                quiesce()
        except BaseException:
            log.exception("gdswriter: a save failed while the interpreter exited")
        finally:
            self.stop()
        if report is not None:
            report()


# Saves in flight when the interpreter exits are finished first: this runs before
# concurrent.futures shuts its thread pools down (which a multi-root save uses), as
# threading's exit hooks run in reverse order of registration.
_open_queues: weakref.WeakSet[SaveQueue] = weakref.WeakSet()
# A forked child has none of the parent's save threads: it must not wait for their saves.
os.register_at_fork(after_in_child=_open_queues.clear)


def _finish_saves_at_exit() -> None:
    for q in list(_open_queues):
        q.finish_at_exit()


try:
    threading._register_atexit(_finish_saves_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # no such hook in this Python: atexit also runs before daemon threads stop
    atexit.register(_finish_saves_at_exit)
