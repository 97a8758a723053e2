"""``deadline``: a test body that hangs fails instead of blocking the run."""

from __future__ import annotations

import contextlib
import signal


class Hung(BaseException):
    """Raised by ``deadline`` (a BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging when the body runs longer than ``seconds`` (a spin, a lost wakeup).
    A limit on the test, not a timed assert: the body is expected to take a fraction of it.
    Raised again every second after that: cleanup code that outlasts a few interruptions
    gives up too."""
    def on_alarm(signum, frame):
        raise Hung(f"still running after {seconds} s: a spin or a hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
