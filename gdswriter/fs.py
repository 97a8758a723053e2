"""Durability primitives: the few system calls every crash-safe step of gdswriter is built on.

* ``open_regular``: open a data file only if it is a regular file (never through a symbolic
  link, never a FIFO or device), emptied only after that check, failures typed.
* ``read_regular_file``: read a small file gdswriter wrote (a manifest, a marker), refusing
  links and special files, bounded in size before anything is allocated.
* ``write_durable``/``atomic_write``: a new file fsynced; a file replaced by a fsynced
  temporary file and a rename, then its directory fsynced.
* ``atomic_file``: the same for a file written through a file object, optionally never
  replacing one that exists (``link_no_clobber``: a fsynced file put in place unless its name
  is taken).
* ``fsync_file``/``fsync_dir``/``fsync_parents``: make a file another library wrote, directory
  entries, and a root made by ``mkdir -p`` durable.
* ``exchange_paths``: swap two directory entries atomically (renameat2 RENAME_EXCHANGE);
  ``replace_dir``: a complete directory put in place of another by that exchange, else by
  two renames.

The commit protocols (format/commit.py, distributed/commit.py) say which of these each step
uses and what a crash between them leaves. This module imports nothing of gdswriter but its
errors, so every layer (engines, format, save, load, export) may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO
from collections.abc import Iterator

from .errors import (CorruptCheckpointError, DataFileNotRegularError, EngineIOError, GDSWriterError,
                     NotRegularFileError, UnsafePathError)

TMP_PREFIX = ".tmp-"  # temporary entries (the on-disk format's: docs/format.md); never listed as steps


def name_problem(name: object) -> str | None:
    """Why ``name``, read from a checkpoint (untrusted), is not a plain file name that stays in
    the directory it is joined to and that the file system can name at all; None if it is one.
    JSON may carry a lone surrogate, which has no bytes: every open of it would raise a bare
    UnicodeEncodeError, so it is refused here with the rest."""
    if type(name) is not str:
        return f"{type(name).__name__} is not a file name"
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        return f"{name!r} is not a plain file name"
    if not name.isascii():
        try:
            os.fsencode(name)
        except UnicodeError as e:
            return f"{name!r} is not a file name (it has no bytes: {e.reason})"
    return None


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that entries created/renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync the regular file ``path`` (written by another library, or through a file object
    closed since), never through a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_durably(path: Path) -> None:
    """Remove the file ``path`` where it exists, then fsync its directory: the removal survives
    a power cut (a marker withdrawn stays withdrawn)."""
    if path.exists():
        os.unlink(path)
        fsync_dir(path.parent)


def fsync_parents(path: str | os.PathLike) -> None:
    """fsync every directory above ``path`` up to its file system's mount point, so that a
    directory created with ``mkdir -p`` (and what gets committed in it) survives a power cut.
    Directories this process may not read (EACCES) cannot have been created by it: skipped."""
    child = os.path.realpath(path)
    dev = os.stat(child).st_dev
    while True:
        parent = os.path.dirname(child)
        if parent == child or os.stat(parent).st_dev != dev:
            return
        try:
            fsync_dir(parent)
        except PermissionError:
            pass
        child = parent


_FILE_KINDS = ((stat.S_ISLNK, "symbolic link", errno.ELOOP), (stat.S_ISDIR, "directory", errno.EISDIR),
               (stat.S_ISFIFO, "FIFO", errno.EINVAL), (stat.S_ISSOCK, "socket", errno.EINVAL),
               (stat.S_ISCHR, "character device", errno.EINVAL), (stat.S_ISBLK, "block device", errno.EINVAL))


def _not_regular(path: str, mode: int, write: bool) -> NotRegularFileError:
    """The typed refusal of a path holding something other than a regular file. Reading, it is a
    damaged checkpoint (DataFileNotRegularError, a CorruptCheckpointError: load an earlier step)."""
    kind, err = next(((k, e) for test, k, e in _FILE_KINDS if test(mode)), ("special file", errno.EINVAL))
    return NotRegularFileError(path, kind, err) if write else DataFileNotRegularError(path, kind, err)


def _open_error(e: OSError, path: str, write: bool) -> EngineIOError:
    """The typed error for a failed open. A symbolic link (ELOOP under O_NOFOLLOW), a socket or
    a FIFO without reader (ENXIO), a directory (EISDIR) are named as such."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        return _not_regular(path, mode, write)
    return EngineIOError(e.errno, path, 0, "open")


@contextlib.contextmanager
def closed_on_failure(fd: int, path: str):
    """Close ``fd`` when the block fails (it never reaches the caller); an OSError that is not
    already typed becomes the failed open's EngineIOError."""
    try:
        yield
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError) and not isinstance(e, GDSWriterError):
            raise EngineIOError(e.errno, path, 0, "open") from e
        raise


def open_regular(path: str, write: bool, *, direct: bool = False) -> tuple[int, bool]:
    """Open ``path`` for writing (created, or emptied) or reading, only if it is a regular file;
    returns the fd (still O_NONBLOCK) and whether O_DIRECT (asked for with ``direct``) took:
    a file system refusing it (EINVAL) gets the file opened again without it.

    The open never follows a symbolic link (O_NOFOLLOW), and anything else found at ``path``
    (directory, FIFO, socket, device) is refused by fstat before any I/O; O_NONBLOCK keeps a
    planted FIFO or device from blocking the open. The file is emptied only after that check
    (no O_TRUNC), so nothing else is ever truncated. Failures are typed (_open_error,
    _not_regular), and the fd is closed."""
    flags = ((os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY) | (
        os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
    except OSError as e:
        if not (direct and e.errno == errno.EINVAL):
            raise _open_error(e, path, write) from e
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e2:
            raise _open_error(e2, path, write) from e2
        direct = False
    with closed_on_failure(fd, path):
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode, write)
        if write:
            os.ftruncate(fd, 0)
    return fd, direct


def read_regular_file(path: str | os.PathLike, limit: int | None = None, *, dir_fd: int | None = None) -> bytes:
    """The bytes of ``path`` (relative to ``dir_fd`` where given), which must be a regular file
    reached without following a symbolic link in its last component (FileNotFoundError if it
    does not exist). UnsafePathError for a link or special file (a FIFO would block, a device
    never ends); CorruptCheckpointError when it holds more than ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link: gdswriter does not follow links it did not "
                                  f"create; remove it (or replace it with the file it points to)") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file: the checkpoint is damaged or was tampered "
                                  f"with; remove it")
        if limit is not None and st.st_size > limit:
            raise CorruptCheckpointError(f"{path} is {st.st_size} bytes, more than the {limit} it can hold: "
                                         f"it is damaged")
        chunks, size = [], 0
        while True:
            b = os.read(fd, min(max(st.st_size - size, 0) + 65536, 16 << 20))  # bounded: it may grow
            if not b:
                break
            chunks.append(b)
            size += len(b)
            if limit is not None and size > limit:
                raise CorruptCheckpointError(f"{path} holds more than {limit} bytes: it is damaged")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_durable(path: Path | str, data: bytes, *, dir_fd: int | None = None) -> None:
    """Create ``path`` (relative to ``dir_fd`` where given) holding ``data`` and fsync it (its
    directory is fsynced by the caller)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsynced temporary file and rename, then fsync the directory."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise EngineIOError(e.errno or errno.EIO, path, 0, "write") from e


def link_no_clobber(tmp: Path, final: Path) -> bool:
    """Give the fsynced file ``tmp`` the name ``final`` unless ``final`` exists (then False);
    ``tmp`` is removed either way. A hard link where the file system has them, else a rename
    (the callers then keep concurrent creators out: a root lock, or a check just before)."""
    try:
        try:
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV):
                raise
        if final.exists() or final.is_symlink():
            return False
        os.rename(tmp, final)
        return True
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path: Path, *, overwrite: bool) -> Iterator[BinaryIO]:
    """A new binary file that becomes ``path`` when the block succeeds: written under a hidden
    temporary name beside it, fsynced, renamed into place (``overwrite``) or else put there by
    ``link_no_clobber`` (FileExistsError when ``path`` exists by then), and the directory
    fsynced. A crash or a failed block never leaves a partial file under ``path``."""
    parent = path.parent if str(path.parent) else Path(".")
    tmp = parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    f = open(tmp, "xb")  # noqa: SIM115 (the block writes it; closed below, before the rename)
    ok = False
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        if overwrite:
            os.replace(tmp, path)
        elif not link_no_clobber(tmp, path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        fsync_dir(parent)
        ok = True
    finally:
        if not f.closed:
            f.close()
        if not ok:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing directory entries (renameat2 RENAME_EXCHANGE). False when
    the C library or the file system cannot; any other failure raises OSError."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(e, os.strerror(e), str(a), None, str(b))


def replace_dir(new: Path, final: Path, aside: Path) -> Path | None:
    """Give the complete directory ``new`` the name ``final``, durably (the parent fsynced). An
    existing ``final`` is swapped out in one atomic exchange where the file system can; else it
    is renamed to ``aside`` first (put back if ``new`` cannot take its place; a crash between
    the two renames leaves it there, and no ``final``). Returns where the replaced entry is now
    (``new`` or ``aside``), for the caller to remove, or None when there was none."""
    if not (final.exists() or final.is_symlink()):
        os.rename(new, final)
        old = None
    elif exchange_paths(new, final):
        old = new
    else:
        os.rename(final, aside)
        try:
            os.rename(new, final)
        except OSError:
            os.rename(aside, final)
            raise
        old = aside
    fsync_dir(final.parent)
    return old
