"""A fault-injecting staged engine: a testing tool.

``FaultInjectingEngine`` is the normal staged pipeline (the same code that
``IoUringEngine`` and ``PosixEngine`` run) on top of a real backend, with a thin
layer between the pipeline and the backend that follows a ``FaultPlan``:

* ``fail_at_request=N``: the N-th request (counting only requests of ``op``)
  is not performed at all; its completion reports ``-errno`` instead. The
  pipeline must raise a typed ``EngineIOError`` naming the file, offset and
  errno, wait out every request still in flight, and stay usable.
* ``short_every=K``: every K-th request becomes a *real* short transfer: only
  the first ``short_bytes`` bytes of it (rounded down to 4 KiB when the file is
  open with O_DIRECT, so the kernel accepts it) are handed to the real backend,
  which reports the shorter count, and the pipeline must continue from where
  the transfer stopped. Requests too small to shorten are passed through. The
  remainders the pipeline resubmits are requests too (they are counted and may
  be shortened again), so ``short_every=1`` with a small ``short_bytes`` makes
  every transfer crawl: use it on small files only.

Faults between the pipeline and the kernel, counted over *backend calls*:
io_uring_enter syscalls with io_uring, submit/wait/quiesce calls with POSIX.

* ``enter_errno=E`` (io_uring only): ``enter_fail_times`` calls in a row, from
  call ``enter_fail_at`` on, fail with errno E before the kernel sees them
  (EAGAIN/EBUSY: the kernel cannot allocate requests or its completion queue is
  full; EINTR: a signal; any other: a hard error), or, with E = 0, return 0:
  the kernel took and completed nothing. A large ``enter_fail_times`` is a
  kernel that never recovers.
* ``raise_at_call=N``: ``raise_times`` calls in a row, from call N on, raise
  ``raise_type`` (default KeyboardInterrupt: Ctrl-C between two syscalls; 2 in
  a row: a second Ctrl-C during the cleanup), after the real call took effect
  (``raise_after``, its result is lost) or instead of it.

Everything that is not faulted goes through the real kernel (io_uring by
default, or the POSIX thread pool), so the bytes on disk are real. Counting
runs over the engine's lifetime, so a fault fires once; ``reset()`` starts
counting again (optionally with another plan).

Typical use in a test::

    plan = FaultPlan(fail_at_request=3, errno=errno.ENOSPC, op="write")
    with FaultInjectingEngine(EngineOptions(buffer_bytes=256 * KiB, request_bytes=64 * KiB), plan) as eng:
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, spans)
        assert ei.value.errno == errno.ENOSPC

Do not use it for real checkpoints.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidOptionError
from ..options import ALIGN, EngineOptions
from ..engines.buffers import AlignedBufferPool, StagingBuffer
from ..engines.staged import IoUringEngine, PosixEngine, StagedEngine

__all__ = ["FaultPlan", "FaultEvent", "FaultInjectingEngine"]

_OPS = ("write", "read", "any")
_BACKENDS = ("io_uring", "posix")


@dataclass(frozen=True)
class FaultPlan:
    """Which requests and backend calls to fault (see the module docstring). Requests are counted
    from 1, only those matching ``op``; backend calls from 1, all of them."""

    fail_at_request: int | None = None
    errno: int = _errno.EIO
    short_every: int | None = None
    short_bytes: int = 4096
    op: Literal["write", "read", "any"] = "any"
    enter_errno: int | None = None
    enter_fail_at: int = 1
    enter_fail_times: int = 1
    raise_at_call: int | None = None
    raise_type: type = KeyboardInterrupt
    raise_times: int = 1
    raise_after: bool = True

    def __post_init__(self) -> None:
        for name in ("fail_at_request", "short_every", "raise_at_call"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidOptionError(f"FaultPlan.{name}={v!r} must be None or a positive integer")
        for name in ("enter_fail_at", "enter_fail_times", "raise_times"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidOptionError(f"FaultPlan.{name}={v!r} must be a positive integer")
        e = self.enter_errno
        if e is not None and (not isinstance(e, int) or isinstance(e, bool) or e < 0):
            raise InvalidOptionError(f"FaultPlan.enter_errno={e!r} must be None, 0 or an errno value")
        if not (isinstance(self.raise_type, type) and issubclass(self.raise_type, BaseException)):
            raise InvalidOptionError(f"FaultPlan.raise_type={self.raise_type!r} must be an exception class")
        if not isinstance(self.errno, int) or isinstance(self.errno, bool) or self.errno < 1:
            raise InvalidOptionError(f"FaultPlan.errno={self.errno!r} must be a positive errno value")
        if not isinstance(self.short_bytes, int) or isinstance(self.short_bytes, bool) or self.short_bytes < 1:
            raise InvalidOptionError(f"FaultPlan.short_bytes={self.short_bytes!r} must be a positive integer")
        if self.op not in _OPS:
            raise InvalidOptionError(f"FaultPlan.op={self.op!r} is unknown: choose one of {', '.join(_OPS)}")


@dataclass(frozen=True)
class FaultEvent:
    """One request fault that was injected: ``kind`` is "fail" or "short"."""

    kind: str
    write: bool
    request: int  # the request's number among those matching the plan's op
    file_off: int
    length: int  # bytes the pipeline asked for
    submitted: int  # bytes really handed to the kernel (0 for "fail")


class _FaultBackend:
    """Sits between the pipeline and a real backend; same interface as the backends."""

    def __init__(self, real, owner: FaultInjectingEngine):
        self.real = real
        self._owner = owner
        self._fake: list[tuple[int, int]] = []  # completions of requests that were never performed
        self._uring = hasattr(real, "ring")
        if self._uring:  # io_uring: the backend calls are the ring's syscalls
            real.ring.enter_syscall = self._faulty_enter(real.ring.enter_syscall)

    def _call(self, fn, *args):
        """One backend call (numbered), raising as the plan says."""
        owner, plan = self._owner, self._owner.plan
        owner.calls += 1
        n = owner.calls
        if plan.raise_at_call is not None and plan.raise_at_call <= n < plan.raise_at_call + plan.raise_times:
            owner.call_faults.append(("raise", n))
            if plan.raise_after:
                fn(*args)
            raise plan.raise_type(f"injected by FaultPlan at backend call {n}")
        return fn(*args)

    def _faulty_enter(self, real_enter):
        def enter(to_submit: int, min_complete: int, flags: int) -> int:
            owner, plan = self._owner, self._owner.plan
            n = owner.calls + 1
            if plan.enter_errno is not None and plan.enter_fail_at <= n < plan.enter_fail_at + plan.enter_fail_times:
                owner.calls = n
                owner.call_faults.append(("enter", n))
                return -plan.enter_errno
            return self._call(real_enter, to_submit, min_complete, flags)

        return enter

    @property
    def capacity(self) -> int:
        return self.real.capacity

    @property
    def registered(self) -> bool:
        return self.real.registered

    @property
    def register(self) -> bool:
        return getattr(self.real, "register", False)

    def use_pool(self, pool: AlignedBufferPool) -> None:
        self.real.use_pool(pool)

    @property
    def in_flight(self) -> int:
        return self.real.in_flight + len(self._fake)

    def submit(self, write: bool, fd: int, buf: StagingBuffer, start: int, length: int, file_off: int, tag: int):
        owner, plan = self._owner, self._owner.plan
        owner.requests += 1
        if plan.op == "any" or (plan.op == "write") == write:
            owner.matched += 1
            n = owner.matched
            if plan.fail_at_request is not None and n == plan.fail_at_request:
                owner.events.append(FaultEvent("fail", write, n, file_off, length, 0))
                self._fake.append((tag, -plan.errno))
                return
            if plan.short_every is not None and n % plan.short_every == 0:
                short = self._short_length(fd, length, plan.short_bytes)
                if short:
                    owner.events.append(FaultEvent("short", write, n, file_off, length, short))
                    length = short
        if self._uring:
            self.real.submit(write, fd, buf, start, length, file_off, tag)
        else:
            self._call(self.real.submit, write, fd, buf, start, length, file_off, tag)

    @staticmethod
    def _short_length(fd: int, length: int, short_bytes: int) -> int:
        """Bytes to really transfer: fewer than asked, 4 KiB-aligned under O_DIRECT; 0 = cannot shorten."""
        n = min(short_bytes, length - 1)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            n = n // ALIGN * ALIGN
        return max(n, 0)

    def flush(self) -> None:
        self.real.flush()

    def wait(self, min_n: int = 1) -> list[tuple[int, int]]:
        out, self._fake = self._fake, []
        need = max(0, min_n - len(out))
        if need or self.real.in_flight:
            out.extend(self.real.wait(need) if self._uring else self._call(self.real.wait, need))
        return out

    def quiesce(self) -> bool:
        self._fake = []
        return self.real.quiesce() if self._uring else self._call(self.real.quiesce)

    def close(self) -> bool:
        self._fake = []
        return self.real.close()


class FaultInjectingEngine(StagedEngine):
    """The staged pipeline over a real backend, with faults injected per ``plan`` (testing only).

    ``backend``: "io_uring" (default) or "posix". After use, ``events`` lists the
    faults injected, ``requests`` counts every request the pipeline submitted
    and ``matched`` those that matched ``plan.op``; ``calls`` counts backend calls and
    ``call_faults`` lists (kind, call) for each "enter" and "raise" fault injected.
    """

    name = "fault-injecting"

    def __init__(self, options: EngineOptions | None = None, plan: FaultPlan | None = None, *,
                 backend: str = "io_uring", reason: str = ""):
        if backend not in _BACKENDS:
            raise InvalidOptionError(f"backend={backend!r} is unknown: choose one of {', '.join(_BACKENDS)}")
        self.backend_kind = backend
        self.plan = self._checked(plan if plan is not None else FaultPlan())
        self.name = f"fault-injecting({backend})"
        self.events: list[FaultEvent] = []
        self.requests = 0
        self.matched = 0
        self.calls = 0
        self.call_faults: list[tuple[str, int]] = []
        super().__init__(options, reason=reason or "fault injection (testing)")

    def _make_backend(self):
        real = (IoUringEngine._make_backend(self) if self.backend_kind == "io_uring"
                else PosixEngine._make_backend(self))
        return _FaultBackend(real, self)

    def _checked(self, plan: FaultPlan) -> FaultPlan:
        if not isinstance(plan, FaultPlan):
            raise InvalidOptionError(f"plan must be a FaultPlan, got {type(plan).__name__}")
        if plan.enter_errno is not None and self.backend_kind != "io_uring":
            raise InvalidOptionError("FaultPlan.enter_errno fails io_uring_enter calls: use backend='io_uring'")
        return plan

    def reset(self, plan: FaultPlan | None = None) -> None:
        """Start counting requests from 1 again, optionally following another plan."""
        if plan is not None:
            self.plan = self._checked(plan)
        self.events = []
        self.requests = 0
        self.matched = 0
        self.calls = 0
        self.call_faults = []

    @property
    def faults(self) -> dict[str, int]:
        """How many faults of each kind were injected since the last reset."""
        return {"fail": sum(e.kind == "fail" for e in self.events),
                "short": sum(e.kind == "short" for e in self.events),
                "enter": sum(k == "enter" for k, _ in self.call_faults),
                "raise": sum(k == "raise" for k, _ in self.call_faults)}
