"""gdswriter: fast, crash-safe PyTorch checkpoints, GPU/CPU memory to NVMe.

    ckpt = GDSCheckpointer(model, optimizer, root="ckpts")
    ckpt.save(step)            # durable and committed when it returns
    ckpt.load()                # latest committed step, in place
"""

from .checkpointer import GDSCheckpointer, SaveHandle, SaveStats
from .engine import EngineInfo, IOEngine, ReadSpan, WriteSpan
from .engine_select import create_engine
from .errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError, ChecksumMismatchError,
                     CorruptCheckpointError, EngineIOError, EngineUnavailableError, GDSWriterError,
                     InvalidOptionError, ShortIOError, StateMismatchError, TruncatedFileError,
                     UnsupportedFormatVersionError, UnsupportedObjectError)
from .options import CheckpointOptions, EngineOptions
from .restore import load_state

__version__ = "0.1.0"

__all__ = [
    "GDSCheckpointer", "CheckpointOptions", "SaveHandle", "SaveStats", "load_state",
    "EngineOptions", "EngineInfo", "IOEngine", "ReadSpan", "WriteSpan", "create_engine",
    "GDSWriterError", "CheckpointError", "CheckpointLockedError", "CheckpointNotFoundError",
    "ChecksumMismatchError", "CorruptCheckpointError", "EngineIOError", "EngineUnavailableError",
    "InvalidOptionError", "ShortIOError", "StateMismatchError", "TruncatedFileError",
    "UnsupportedFormatVersionError", "UnsupportedObjectError",
    "__version__",
]
