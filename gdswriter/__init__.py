"""gdswriter: fast, crash-safe PyTorch checkpoints, GPU/CPU memory to NVMe.

    ckpt = GDSCheckpointer(model, optimizer, root="ckpts")
    ckpt.save(step)            # durable and committed when it returns
    ckpt.load()                # latest committed step, in place

The public API. ``import gdswriter`` loads only the version and the error types (no torch):
every other name loads its module on first use (PEP 562), so a CLI call, an ``except
gdswriter.CheckpointError`` or a tool that only inspects checkpoints pays for what it uses.
"""

from __future__ import annotations

import importlib
import warnings

from ._version import __version__
from .errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError, ChecksumMismatchError,
                     CollectiveFailedError, CollectiveMismatchError, CorruptCheckpointError, DataFileNotRegularError, DrainError,
                     EngineIOError, EngineUnavailableError, GDSWriterError, InvalidOptionError, NothingToLoadError,
                     NotRegularFileError, RankFailedError, ReadOnlyRootError, ReplicationError, RootUnavailableError, ShortIOError,
                     SnapshotChangedError, StateMismatchError, TruncatedFileError, UnreachableDataError, UnsafePathError,
                     UnsupportedFormatVersionError, UnsupportedObjectError)

# name -> the module that defines it, imported on first use
_LAZY = {
    "GDSCheckpointer": ".checkpointer", "LoadResult": ".checkpointer",
    "SaveHandle": ".save.handle", "SaveStats": ".save.handle",
    "CheckpointOptions": ".options", "EngineOptions": ".options",
    "load_state": ".load.reader",
    "EngineInfo": ".engines.base", "IOEngine": ".engines.base", "ReadSpan": ".engines.base",
    "WriteSpan": ".engines.base", "create_engine": ".engines.select",
    "DistOptions": ".distributed.options", "DrainStats": ".drain",
    "GDSStorageWriter": ".distributed.dcp", "GDSStorageReader": ".distributed.dcp",  # imports torch's DCP
}
# names that left the public face: still served, with a DeprecationWarning
_MOVED = {"BenchOptions": "gdswriter.tools.bench", "BenchResult": "gdswriter.tools.bench",
          "run_bench": "gdswriter.tools.bench"}

__all__ = [
    "GDSCheckpointer", "CheckpointOptions", "LoadResult", "SaveHandle", "SaveStats", "load_state",
    "DrainStats", "EngineOptions", "EngineInfo", "IOEngine", "ReadSpan", "WriteSpan", "create_engine",
    "GDSWriterError", "CheckpointError", "CheckpointLockedError", "CheckpointNotFoundError",
    "ChecksumMismatchError", "CorruptCheckpointError", "EngineIOError", "EngineUnavailableError",
    "InvalidOptionError", "NothingToLoadError", "ReadOnlyRootError", "RootUnavailableError", "ShortIOError",
    "SnapshotChangedError", "StateMismatchError", "TruncatedFileError", "UnsafePathError", "UnsupportedFormatVersionError",
    "UnsupportedObjectError", "NotRegularFileError", "DataFileNotRegularError", "DrainError",
    "DistOptions", "GDSStorageWriter", "GDSStorageReader", "CollectiveFailedError", "CollectiveMismatchError",
    "RankFailedError", "UnreachableDataError", "ReplicationError",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    if name in _MOVED:
        warnings.warn(f"gdswriter.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
