"""Typed errors. Each subclasses the built-in that fits, so ``except OSError``
and friends keep working, and each message says how to fix the problem."""

from __future__ import annotations

import errno as _errno
import functools
import os


class GDSWriterError(Exception):
    """Base class of every error gdswriter raises on purpose."""


class _Rebuildable:
    """Pickles by constructor arguments, so errors keep their fields across processes."""

    def __reduce__(self):
        return type(self), self._init_args  # type: ignore[attr-defined]


class InvalidOptionError(GDSWriterError, ValueError):
    """An option or environment knob has a value gdswriter cannot use."""


class EngineUnavailableError(GDSWriterError, OSError):
    """The requested I/O engine cannot run on this machine (e.g. io_uring disabled)."""


class EngineIOError(_Rebuildable, GDSWriterError, OSError):
    """A read or write failed. Carries the file, the byte offset and the errno."""

    def __init__(self, errno: int, path: str, offset: int, what: str = "I/O", hint: str = ""):
        self._init_args = (errno, path, offset, what, hint)
        self.path = str(path)
        self.offset = offset
        text = f"{what} failed on {self.path} at byte offset {offset}: {os.strerror(errno)} (errno {_errno.errorcode.get(errno, errno)})"
        if not hint:
            hint = ERRNO_HINTS.get(errno, "")
        if hint:
            text += f". {hint}"
        super().__init__(errno, text)
        self.filename = self.path

    def __str__(self) -> str:  # OSError's default str would print "[Errno n] ..." twice
        return self.strerror


ERRNO_HINTS = {  # errno -> what to do about it: the end of EngineIOError's message (and KvikIO's)
    _errno.ENOSPC: "The file system is full: free space or point the checkpointer at another root",
    _errno.EDQUOT: "Disk quota exceeded: free space or raise the quota",
    _errno.EROFS: "The file system is read-only: choose a writable root",
    _errno.EACCES: "Permission denied: make the directory writable for this user or choose another root",
    _errno.EINVAL: "The kernel rejected the request; if this file system does not support O_DIRECT set GDSWRITER_DIRECT_IO=0",
    _errno.EIO: "The device reported an I/O error: check the drive (dmesg, smartctl) before trusting any data on it",
}


class ShortIOError(EngineIOError):
    """The kernel moved zero bytes where more were expected (end of file while reading)."""

    def __init__(self, path: str, offset: int, expected: int):
        super().__init__(_errno.EIO, path, offset, "read",
                         f"the file ended after fewer bytes than expected ({expected} more were needed); it is truncated")
        self._init_args = (path, offset, expected)


class CheckpointError(GDSWriterError):
    """Base for problems with a checkpoint on disk."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint is damaged: truncated or missing file, unparsable manifest."""


class StepFilesLostError(CorruptCheckpointError):
    """Every place that held some rank's files of a step is gone (its own root and each copy:
    no rank sees the root, or the copy's folder is missing), none damaged: a node lost before
    the step was protected (DistOptions(replicas=...)). A plain ``load()`` then loads the newest
    step that is complete (format.md 11); an explicit ``load(step)`` raises it."""


class ChecksumMismatchError(_Rebuildable, CorruptCheckpointError):
    """Bytes read back do not match the checksum recorded at save time."""

    def __init__(self, path: str, tensor: str, offset: int, length: int, expected: int, actual: int):
        self._init_args = (path, tensor, offset, length, expected, actual)
        self.path, self.tensor, self.offset, self.length = str(path), tensor, offset, length
        self.expected, self.actual = expected, actual
        super().__init__(
            f"checksum mismatch in {self.path} bytes [{offset}, {offset + length}) holding tensor {tensor!r}: "
            f"crc32c expected {expected:#010x}, got {actual:#010x}. The file is corrupt: load an earlier step "
            f"(GDSCheckpointer.steps()) or restore it from a copy")


class UnsupportedFormatVersionError(CheckpointError, ValueError):
    """The checkpoint was written by a newer, incompatible gdswriter."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the requested root/step."""


class DrainError(CheckpointError):
    """A committed step could not be copied to the drain root (CheckpointOptions.drain_root):
    its local copy is damaged (a chunk's crc32c differs) or the drain root could not be written.
    The step stays committed locally; the drain root keeps its earlier steps. ``step``: the step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step

    def __reduce__(self):
        return (type(self), (self.args[0], self.step))


class ReplicationError(CheckpointError):
    """A committed step's copies on peer nodes (DistOptions(replicas=...)) were not all made
    durable: a peer died or hung, a copy was short or its crc32c differed, a root could not be
    written. The step stays committed (loadable where its own nodes are), not protected; the
    newest protected step is kept by retention. ``step``: the step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step

    def __reduce__(self):
        return (type(self), (self.args[0], self.step))


class CheckpointLockedError(CheckpointError, BlockingIOError):
    """Another process holds the checkpoint root."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save with overwrite=False met a checkpoint already there (the DCP writer)."""


class UnsupportedObjectError(GDSWriterError, TypeError):
    """State holds an object the format cannot store without pickle."""

    def __init__(self, key_path: str, obj: object, why: str = "", *, type_name: str | None = None):
        self.key_path = key_path
        tname = type_name or f"{type(obj).__module__}.{type(obj).__qualname__}"
        self._reduce = (functools.partial(type(self), type_name=tname), (key_path, None, why))
        msg = f"cannot save {key_path or '<root>'}: objects of type {tname} are not supported"
        msg += f" ({why})" if why else (
            " (gdswriter stores tensors, numpy arrays, None, bool, int, float, str, bytes, list, tuple, dict, "
            "torch.dtype and torch.device without pickle); convert it to one of those in your state_dict")
        super().__init__(msg)

    def __reduce__(self):
        return self._reduce


class SnapshotChangedError(GDSWriterError, RuntimeError):
    """A tensor save_async copied at the call was given other memory or another shape in place
    (``resize_``, ``set_``, ``squeeze_``...) before the save thread laid the step out: the step
    is not saved (its copied bytes no longer match the tensor it would be recorded as)."""


class StateMismatchError(GDSWriterError, KeyError):
    """The checkpoint does not fit the live model (missing/unexpected key, shape or dtype)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""




class TruncatedFileError(_Rebuildable, CorruptCheckpointError):
    """A data file is shorter than the manifest says."""

    def __init__(self, path: str, needed: int, actual: int):
        self._init_args = (path, needed, actual)
        self.path, self.needed, self.actual = str(path), needed, actual
        super().__init__(f"{self.path} is truncated: {actual} bytes on disk, {needed} needed. "
                         f"The checkpoint is incomplete: load an earlier step or restore the file")


# ----------------------------------------------------------------------------- multi-rank checkpoints
class RankFailedError(_Rebuildable, GDSWriterError, RuntimeError):
    """Another rank of a collective save or load failed, so this rank stopped too. Carries
    {rank: "ErrorType: message"} of the ranks that failed."""

    def __init__(self, what: str, failures: dict, hint: str = "nothing was committed; fix the failing "
                                                              "rank's problem and save again", *,
                 total: int | None = None):
        self._init_args = (what, failures, hint)
        self.what, self.failures, self.hint = what, dict(failures), hint
        self.total = max(total or 0, len(self.failures))  # ranks that failed (``failures`` may name only some)
        shown = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items())[:4])
        more = f" (and {self.total - min(4, len(self.failures))} more ranks)" if self.total > 4 else ""
        super().__init__(f"{what} failed on {self.total} rank(s), so every rank stopped: {shown}{more}. "
                         f"{hint[:1].upper()}{hint[1:]}")

    def __reduce__(self):
        return _rank_failed, (*self._init_args, self.total)


def _rank_failed(what: str, failures: dict, hint: str, total: int) -> RankFailedError:
    return RankFailedError(what, failures, hint, total=total)


class CollectiveFailedError(_Rebuildable, GDSWriterError, ConnectionError):
    """A rank did not take part in a checkpoint collective within the timeout, or its connection
    was lost (it died, hung, or the network failed). Nothing was committed by this collective.
    (Not a TimeoutError: concurrent.futures treats those as "the wait timed out".)"""

    def __init__(self, what: str, timeout_s: float, cause: str):
        self._init_args = (what, timeout_s, cause)
        self.what, self.timeout_s = what, timeout_s
        super().__init__(f"{what}: not every rank took part within {timeout_s:g} s or a connection was lost "
                         f"({cause}). A rank died, hung or lost its network; the previous committed step is "
                         f"intact. Restart the job (leftovers are removed when the checkpointer opens the roots); "
                         f"raise DistOptions.timeout_s (GDSWRITER_DIST_TIMEOUT) if ranks are only slow")

    def __str__(self) -> str:  # an OSError: keep its "[Errno ...]" prefix out
        return self.args[0] if self.args else ""


class CollectiveMismatchError(GDSWriterError, RuntimeError):
    """The ranks of a process group are not creating the same checkpoint coordination channel:
    their GDSCheckpointers (or first DCP saves with gdswriter's plug-in) come in different orders."""


class UnreachableDataError(CheckpointError, FileNotFoundError):
    """A data file of a multi-rank checkpoint is on a root that no rank of this job can read."""


class UnsafePathError(CorruptCheckpointError):
    """A checkpoint file is a symbolic link, a hard link or not a regular file: gdswriter only
    follows what it wrote itself, so a planted link cannot redirect a read or a truncation."""


class UnsafeMetadataError(CorruptCheckpointError):
    """A checkpoint's pickled bytes (DCP's ``.metadata``, a torch.save'd item) name something
    outside the allowlist gdswriter loads: refused before it runs (gdswriter never unpickles
    arbitrary objects)."""


class RootUnavailableError(CheckpointError, FileNotFoundError):
    """A checkpoint root is missing, or is not the directory the other roots' data was saved with
    (its disk is probably not mounted). gdswriter refuses to open the roots rather than guess."""


class ReadOnlyRootError(CheckpointError, PermissionError):
    """A checkpoint root cannot be written (read-only file system, no permission): it was opened
    for loading only, and saving there is refused."""


class NothingToLoadError(StateMismatchError):
    """The checkpoint holds no state that fits the live objects (nothing would be loaded)."""


class NotRegularFileError(EngineIOError):
    """Where gdswriter writes a file, the path holds a symbolic link, directory, FIFO, socket or
    device. gdswriter never follows the link and touches nothing there."""

    def __init__(self, path: str, kind: str, errno: int = _errno.EINVAL, hint: str = ""):
        super().__init__(errno, path, 0, "open", hint or (
            f"{path} is a {kind}, not a regular file; gdswriter writes only regular files and never follows "
            f"symbolic links, so it left it untouched: remove it, or choose another root"))
        self._init_args = (path, kind, errno, hint)
        self.kind = kind


class DataFileNotRegularError(NotRegularFileError, CorruptCheckpointError):
    """A checkpoint's data file is a symbolic link or not a regular file. gdswriter writes data
    files only as regular files, so the checkpoint was damaged or tampered with: like any
    corrupt checkpoint, load an earlier step or restore the file."""

    def __init__(self, path: str, kind: str, errno: int = _errno.EINVAL):
        super().__init__(path, kind, errno,
                         f"{path} is a {kind}, not the regular file gdswriter wrote, and gdswriter does not read "
                         f"through it: the checkpoint was damaged or tampered with; load an earlier step or "
                         f"restore the file")
        self._init_args = (path, kind, errno)


# Raised by the exporter, the CLI and the tools (gdswriter/export.py, commands/, tools/).
class OutputExistsError(GDSWriterError, FileExistsError):
    """The export destination exists and overwriting was not allowed."""


class UnsupportedDtypeError(GDSWriterError, TypeError):
    """A tensor's dtype has no equivalent in the export format."""


class LoadCheckError(GDSWriterError, AssertionError):
    """A method's load did not bring back the state its save stored."""


class FioError(RuntimeError):
    """fio ran but gave no bandwidth (it failed, or its job reported an error)."""


class UsageError(GDSWriterError):
    """Bad command-line input that argparse cannot catch (exit status 2)."""


class HealthLogError(GDSWriterError, ValueError):
    """An NVMe health log that cannot be parsed (truncated, or not nvme-cli's smart-log JSON)."""


# Internal: never leaves the io_uring engine (it raises EngineIOError naming the file and offset).
class RingError(OSError):
    """io_uring_enter failed in a way retrying does not cure. Internal: the engine raises it
    as EngineIOError naming the file and offset."""
