"""Engine selection: the one place that decides which engine moves a checkpointer's bytes.

``auto`` takes io_uring where the kernel allows it, else the POSIX thread pool, and
says why once. The engines themselves (fallback/) know nothing of each other.
"""

from __future__ import annotations

from .engine import IOEngine
from .fallback import uring
from .fallback.engine import IoUringEngine, PosixEngine
from .options import EngineOptions, log_once


def create_engine(options: EngineOptions | None = None) -> IOEngine:
    """The best engine this machine allows for ``options`` (default: from GDSWRITER_* env)."""
    options = options or EngineOptions.from_env()
    if options.engine == "posix":
        return PosixEngine(options, reason="requested (engine='posix')")
    if options.engine == "io_uring":
        return IoUringEngine(options)
    why = uring.probe()
    if why is None:
        return IoUringEngine(options)
    log_once("posix-fallback", f"gdswriter: {why}; falling back to the POSIX thread-pool engine")
    return PosixEngine(options, reason=why)
