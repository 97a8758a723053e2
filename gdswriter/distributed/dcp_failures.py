"""Errors across DCP's collectives: CarriedError through DCP's load retry, dcp_errors() to raise
the gdswriter error a CheckpointException carries."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import GDSWriterError, RankFailedError
from .group import describe


class CarriedError(BaseException):
    """An error (gdswriter's, typically) on its way out of GDSStorageReader.read_metadata. DCP's load (torch
    2.13) catches an Exception raised there, retries, and raises an AssertionError holding only
    its message; a BaseException goes on into DCP's CheckpointException as it is, so the
    checkpoint's own error (CheckpointNotFoundError, CorruptCheckpointError...) stays typed and
    dcp_errors() can raise it. Never raised outside DCP's load."""

    def __init__(self, error: BaseException):
        super().__init__(describe(error))
        self.error = error

    def __reduce__(self) -> tuple:  # DCP gathers the ranks' failures with pickle
        return type(self), (self.error,)


@contextlib.contextmanager
def dcp_errors() -> Iterator[None]:
    """Re-raise the gdswriter error a CheckpointException carries, from it.

        with dcp_errors():
            dcp.save(state_dict, checkpoint_id=path, storage_writer=GDSStorageWriter(overwrite=False))

    DCP wraps what a storage layer raises inside its collectives in CheckpointException (a
    BaseException), with every failed rank's error. This raises the first rank's own gdswriter
    error (a RankFailedError, which only says that another rank failed, only when no rank has a
    more precise one); a CheckpointException without a gdswriter error goes on unchanged."""
    try:
        yield
    except CheckpointException as ce:
        failures = [exc.error if isinstance(exc, CarriedError) else exc for _, (exc, _) in sorted(ce.failures.items())]
        errors = [exc for exc in failures if isinstance(exc, GDSWriterError)]
        precise = [e for e in errors if not isinstance(e, RankFailedError)] or errors
        if not precise:
            raise
        raise precise[0] from ce
