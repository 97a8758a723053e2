"""gdswriter: fast, crash-safe PyTorch checkpoints, GPU/CPU memory to NVMe.

    ckpt = GDSCheckpointer(model, optimizer, root="ckpts")
    ckpt.save(step)            # durable and committed when it returns
    ckpt.load()                # latest committed step, in place
"""

from .bench import BenchOptions, BenchResult, run_bench
from .checkpointer import GDSCheckpointer, LoadResult, SaveHandle, SaveStats
from .distributed import DistOptions
from .engines.base import EngineInfo, IOEngine, ReadSpan, WriteSpan
from .engines.select import create_engine
from .errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError, ChecksumMismatchError,
                     CollectiveFailedError, CorruptCheckpointError, DataFileNotRegularError, EngineIOError,
                     EngineUnavailableError, GDSWriterError, InvalidOptionError, NothingToLoadError,
                     NotRegularFileError, RankFailedError, ReadOnlyRootError, RootUnavailableError, ShortIOError,
                     StateMismatchError, TruncatedFileError, UnreachableDataError, UnsafePathError,
                     UnsupportedFormatVersionError, UnsupportedObjectError)
from .errors import CollectiveMismatchError
from .options import CheckpointOptions, EngineOptions
from .restore import load_state
from ._version import __version__

__all__ = [
    "GDSCheckpointer", "CheckpointOptions", "LoadResult", "SaveHandle", "SaveStats", "load_state",
    "EngineOptions", "EngineInfo", "IOEngine", "ReadSpan", "WriteSpan", "create_engine",
    "GDSWriterError", "CheckpointError", "CheckpointLockedError", "CheckpointNotFoundError",
    "ChecksumMismatchError", "CorruptCheckpointError", "EngineIOError", "EngineUnavailableError",
    "InvalidOptionError", "NothingToLoadError", "ReadOnlyRootError", "RootUnavailableError", "ShortIOError",
    "StateMismatchError", "TruncatedFileError", "UnsafePathError", "UnsupportedFormatVersionError",
    "UnsupportedObjectError", "NotRegularFileError", "DataFileNotRegularError",
    "DistOptions", "GDSStorageWriter", "GDSStorageReader", "CollectiveFailedError", "CollectiveMismatchError",
    "RankFailedError",
    "UnreachableDataError",
    "BenchOptions", "BenchResult", "run_bench",
    "__version__",
]


def __getattr__(name: str):
    """The DCP plug-in (gdswriter.distributed.dcp) imports torch.distributed.checkpoint: loaded on first use."""
    if name in ("GDSStorageWriter", "GDSStorageReader"):
        from .distributed import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
