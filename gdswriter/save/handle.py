"""A save in progress: its SaveHandle, its SaveStats, and the Release that says when it no
longer needs the saved tensors' own memory (the moment training may change them again)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, wait as futures_wait
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from ..cuda import streams


class Release:
    """Set once a save no longer needs the saved tensors' own memory: in live mode when every
    file is written, in host mode when every byte is copied (from a GPU: when every copy is
    queued on the side streams, complete once ``events`` are). A failed save sets it too,
    with ``error``, so that nothing waits for it forever. ``mode``: the snapshot mode the
    save really used ("live" where the engines cannot write from the host pool)."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self.events: Mapping[int, Any] = {}
        self.error: BaseException | None = None
        self.at: float | None = None  # perf_counter() when set
        self.mode: str | None = None  # set by write_snapshot_files

    def set(self, events: Mapping[int, Any] | None = None, *, error: BaseException | None = None) -> None:
        if self.error is None:
            self.error = error
        if not self._flag.is_set():
            self.events = dict(events or {})
            self.at = perf_counter()
            self._flag.set()

    def is_set(self) -> bool:
        return self._flag.is_set() and streams.events_done(self.events)

    def wait(self, timeout: float | None = None) -> bool:
        """Block the host until released (copies complete); False after ``timeout`` s."""
        if not self._flag.wait(timeout):
            return False
        streams.host_wait(self.events)
        return True

    def wait_stream_ordered(self) -> None:
        """Block the host only until released on the host; GPU copies still running are waited
        for by the calling thread's current streams (no host synchronize)."""
        self._flag.wait()
        streams.stream_wait(self.events)


@dataclass(frozen=True)
class SaveStats:
    """How one save went. ``blocked_s``: time training was blocked by it (save_async itself,
    plus optimizer steps that waited for it); ``snapshot_s``: from the start of the save until
    it released the live tensors; ``write_s``: from its start until the step was committed.
    ``state_dict_s``: of blocked_s, the time the saved objects' own ``state_dict()`` calls took
    (the model's, the optimizer's, the ``state=`` objects': their cost, not gdswriter's)."""

    step: int
    mode: str
    nbytes: int
    blocked_s: float
    snapshot_s: float
    write_s: float
    state_dict_s: float = 0.0

    @property
    def gbps(self) -> float:
        """Bytes written per second of write_s, in GB/s (1e9)."""
        return self.nbytes / self.write_s / 1e9 if self.write_s > 0 else 0.0


class SaveHandle:
    """A save in progress. ``result(timeout)`` returns the step once it is durable and committed
    (None if the save was ``skipped``, see CheckpointOptions.on_busy); ``snapshotted()`` says
    whether the save still needs the live tensors; ``stats`` is set once it is done (None for
    a skipped save); ``mode`` is, once it is done, the snapshot mode the save really used
    ("live" where the engines cannot write from the host pool).

    What the checkpointer records on it while the save runs: ``release`` (the save's Release),
    ``nbytes``, ``started`` (perf_counter() when the save thread began it), ``blocked_s``
    (training blocked so far), ``state_dict_s`` (the state_dict() calls' share of it),
    ``blocking`` (a ``save()``: its caller waits for the whole save); ``finish(error)``
    completes it."""

    def __init__(self, step: int, mode: str, *, skipped: bool = False):
        self.step, self.mode, self.skipped = step, mode, skipped
        self._future: Future = Future()
        self.release = Release()
        self.blocked_s = 0.0
        self.state_dict_s = 0.0
        self.blocking = False
        self.nbytes = 0
        self.started: float | None = None
        self.reported = False
        self.stats: SaveStats | None = None
        if skipped:
            self.release.set()
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

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save ended (False after ``timeout`` s), without raising its error or
        counting it as reported: the next save_async or wait() still raises it."""
        done, _ = futures_wait([self._future], timeout)
        return bool(done)

    def snapshotted(self) -> bool:
        """True once the save no longer reads the live tensors (copied, or written, or failed):
        from then on they may be changed in any way."""
        return self.release.is_set()

    def wait_snapshotted(self, timeout: float | None = None) -> bool:
        """Block until ``snapshotted()`` (False after ``timeout`` s)."""
        return self.release.wait(timeout)

    def finish(self, error: BaseException | None) -> None:
        """Complete the save (its stats, then its result or ``error``)."""
        now = time.perf_counter()
        started = self.started if self.started is not None else now
        released = self.release.at if self.release.at is not None else now
        self.mode = self.release.mode or self.mode
        self.stats = SaveStats(self.step, self.mode, self.nbytes, self.blocked_s, released - started, now - started,
                               self.state_dict_s)
        if error is None:
            self._future.set_result(self.step)
        else:
            self._future.set_exception(error)
