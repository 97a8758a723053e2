"""Engine selection: the one place that decides which engine moves a checkpointer's bytes.

``auto`` takes GPUDirect Storage (the KvikIO engine) only where it truly works: the
nvidia-fs driver is loaded (or cuFile is set up for the kernel's P2PDMA), cuFile reports
GDS available and KvikIO would not use its POSIX compat path. Without it, gdswriter's
pinned-buffer io_uring engine moves CUDA tensors faster than KvikIO's compat mode (H200
without nvidia-fs, 4 GiB, durable write / cold read: 2.29 / 1.91 GB/s against 2.2 / 1.5),
so ``auto`` falls back to io_uring, else POSIX, and says why once. ``gds`` and ``kvikio``
ask for the KvikIO engine explicitly. The KvikIO engine hands files holding no CUDA
tensor to a host engine chosen here too. The engines themselves know nothing of each other.

``sized_for``: an engine for a small transfer needs few staging buffers. Building the default
ones (8 x 16 MiB, page-locked) costs more than reading a small checkpoint (fresh memory is slow
to touch and lock: 0.03-0.45 s measured here), so loads of up to SMALL_IO_BYTES get an engine
with two request-sized buffers; large spans bypass the staging buffers anyway (zero-copy).
``for_pool_writes``: an engine that writes from the host snapshot pool stages only the
pieces' tails, and gets two buffers of the usual size (a quarter of the default staging).
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch

from .base import IOEngine
from . import uring
from .staged import IoUringEngine, PosixEngine
from ..options import EngineOptions
from .._log import log_once


def _host_engine(options: EngineOptions, reason: str = "") -> IOEngine:
    """gdswriter's own engine: io_uring where the kernel allows it, else the POSIX thread pool."""
    if options.engine == "posix":
        return PosixEngine(options, reason="requested (engine='posix')")
    if options.engine == "io_uring":
        return IoUringEngine(options, reason=reason)
    why = uring.probe()
    if why is None:
        return IoUringEngine(options, reason=reason)
    log_once("posix-fallback", f"gdswriter: {why}; falling back to the POSIX thread-pool engine")
    return PosixEngine(options, reason="; ".join(x for x in (reason, why) if x))


SMALL_IO_BYTES = 64 << 20


def sized_for(options: EngineOptions, nbytes: int) -> EngineOptions:
    """``options`` for an engine that moves ``nbytes`` in all: two request-sized staging buffers
    when that is at most SMALL_IO_BYTES, else ``options`` unchanged."""
    if nbytes > SMALL_IO_BYTES or (options.num_buffers <= 2 and options.buffer_bytes <= options.request_bytes):
        return options
    return dataclasses.replace(options, num_buffers=min(2, options.num_buffers),
                               buffer_bytes=options.request_bytes)


def for_pool_writes(options: EngineOptions) -> EngineOptions:
    """``options`` for an engine that writes from the host snapshot pool: two staging buffers
    (the pool's pieces go zero-copy; only their tails are staged) of the usual size, so that as
    many requests stay in flight (the engine keeps at most 2 x num_buffers chunks queued)."""
    if options.num_buffers <= 2:
        return options
    return dataclasses.replace(options, num_buffers=2)


def _cuda_seen() -> bool:
    """Whether this process may see a CUDA device, asked without importing the KvikIO engine
    (about 7 ms, and 20 where Python writes no bytecode cache: on the first save's critical
    path) where it is not imported yet: its ``cuda_available`` is the one answer (tests patch
    it), and it is torch's own until someone imported the module to patch it."""
    kvikio = sys.modules.get(__package__ + ".kvikio")
    return kvikio.cuda_available() if kvikio is not None else torch.cuda.is_available()


def create_engine(options: EngineOptions | None = None) -> IOEngine:
    """The best engine this machine allows for ``options`` (default: from GDSWRITER_* env)."""
    options = options or EngineOptions.from_env()
    if options.engine in ("gds", "kvikio"):
        from .kvikio import GdsEngine

        return GdsEngine(options, require_gpu_direct=options.engine == "gds",
                         host_engine=lambda: _host_engine(dataclasses.replace(options, engine="auto")),
                         reason=f"requested (engine={options.engine!r})")
    if options.engine == "auto" and _cuda_seen():
        from .kvikio import GdsEngine, gpu_direct_probe

        probe = gpu_direct_probe()
        if not isinstance(probe, str):  # GDS works: the engine reuses the status the probe collected
            return GdsEngine(options, require_gpu_direct=True, host_engine=lambda: _host_engine(options),
                             status=probe)
        if probe != "no CUDA device":
            reason = (f"GPUDirect Storage unavailable ({probe}); CUDA tensors go through page-locked host "
                      f"buffers, faster than KvikIO's compat mode")
            log_once("no-gds", f"gdswriter: {reason}", logging.INFO)
            return _host_engine(options, reason)
    return _host_engine(options)
