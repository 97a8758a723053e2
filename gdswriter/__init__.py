"""gdswriter: fast, crash-safe PyTorch checkpoints, GPU/CPU memory to NVMe.

    ckpt = GDSCheckpointer(model, optimizer, root="ckpts")
    ckpt.save(step)            # durable and committed when it returns
    ckpt.load()                # latest committed step, in place
"""

from .checkpointer import GDSCheckpointer, LoadResult, SaveHandle
from .engine import EngineInfo, IOEngine, ReadSpan, WriteSpan
from .engine_select import create_engine
from .errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError, ChecksumMismatchError,
                     CorruptCheckpointError, EngineIOError, EngineUnavailableError, GDSWriterError,
                     InvalidOptionError, NothingToLoadError, ReadOnlyRootError, RootUnavailableError, ShortIOError,
                     StateMismatchError, TruncatedFileError, UnsafePathError, UnsupportedFormatVersionError,
                     UnsupportedObjectError)
from .options import CheckpointOptions, EngineOptions
from .restore import load_state

__version__ = "0.1.0"

__all__ = [
    "GDSCheckpointer", "CheckpointOptions", "LoadResult", "SaveHandle", "load_state",
    "EngineOptions", "EngineInfo", "IOEngine", "ReadSpan", "WriteSpan", "create_engine",
    "GDSWriterError", "CheckpointError", "CheckpointLockedError", "CheckpointNotFoundError",
    "ChecksumMismatchError", "CorruptCheckpointError", "EngineIOError", "EngineUnavailableError",
    "InvalidOptionError", "NothingToLoadError", "ReadOnlyRootError", "RootUnavailableError", "ShortIOError",
    "StateMismatchError", "TruncatedFileError", "UnsafePathError", "UnsupportedFormatVersionError",
    "UnsupportedObjectError",
    "__version__",
]
