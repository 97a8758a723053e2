"""The commit protocol: how a step becomes visible, atomically, on one or more roots.

Layout of a root (one directory per SSD; the first is the primary)::

    ROOT/step_000000000042/manifest.json   (primary only: the commit record)
    ROOT/step_000000000042/data-*.bin      (the bytes this root holds)
    ROOT/latest                            (primary only: "42\n")
    ROOT/.gdswriter.lock                   (held by the one writer of the root)
    ROOT/.tmp-step_...                     (a save in progress; removed on the next open)
    ROOT/.trash-step_...                   (a step being deleted; removed on the next open)

Protocol for step S:
 1. every root gets ``.tmp-step_S-<token>``; the engine writes and fdatasyncs the data files there;
 2. each temporary directory is fsynced (secondary ones also name their primary root, so that
    cleaning never touches directories another primary wrote);
 3. primary: write manifest.json into the temporary directory (fsync), fsync the directory;
 4. secondary roots: rename the temporary directory to ``step_S``, fsync the root (an older
    ``step_S`` is first un-committed on the primary; one written for another primary is refused);
 5. primary: rename the temporary directory to ``step_S``, fsync the root. This rename is the
    commit point;
 6. rewrite ``latest`` (temp file, fsync, rename, fsync the root).

A crash before 5 leaves the other steps untouched and leftovers that
:meth:`CommitProtocol.clean_leftovers` removes: temporaries, trash, and
secondary ``step_S`` directories whose primary has no manifest. A crash between
5 and 6 leaves ``latest`` at the previous complete step; readers that find
``latest`` stale still see the new step in :meth:`committed_steps`.

Re-saving a committed step S on a single root swaps the new directory with the old one in
one ``renameat2(RENAME_EXCHANGE)`` (the commit point), so a crash leaves either the old or
the new S committed, never neither. With several roots, or where the file system cannot
exchange, the old S is un-committed first (step 4), and a crash in between leaves the steps
before S.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Sequence

from ..engine import fsync_dir, fsync_parents
from ..errors import CheckpointLockedError, CheckpointNotFoundError, EngineIOError, InvalidOptionError
from .manifest import MANIFEST_NAME

STEP_RE = re.compile(r"^step_(\d{12,})$")
LATEST_NAME = "latest"
LOCK_NAME = ".gdswriter.lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
OWNER_NAME = "primary-root"  # in secondary step directories: which primary root they belong to


def step_dir_name(step: int) -> str:
    return f"step_{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def normalize_roots(root: Any) -> list[Path]:
    """A root directory or a list of them (one per SSD, the primary first) as a list of Paths."""
    roots = [root] if isinstance(root, (str, os.PathLike)) else list(root)
    if not roots:
        raise InvalidOptionError("root must be a directory or a non-empty list of directories (one per SSD)")
    paths = [Path(os.fspath(r)) for r in roots]
    if len({p.resolve() for p in paths}) != len(paths):
        raise InvalidOptionError(f"roots {roots} name the same directory twice: give each SSD's directory once")
    return paths


def _write_durable(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data`` and fsync it (its directory is fsynced by the caller)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsynced temporary file and rename, then fsync the directory."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
    try:
        _write_durable(tmp, data)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise EngineIOError(e.errno or errno.EIO, path, 0, "write") from e


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


class RootLock:
    """An exclusive flock on every root, so two writers cannot interleave commits. Taking it
    also makes each root's own name durable (its parents are fsynced)."""

    def __init__(self, roots: Sequence[Path]):
        self._fds: list[int] = []
        try:
            for root in roots:
                path = root / LOCK_NAME
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                self._fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError as e:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    raise CheckpointLockedError(
                        errno.EWOULDBLOCK,
                        f"checkpoint root {root} is in use by another GDSCheckpointer (pid {holder}); "
                        f"close that one first or give this one a different root") from e
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                fsync_parents(root)  # a root just made by mkdir -p must outlive a power cut
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing drops the flock
        self._fds = []


class PendingCommit:
    """A step being written: temporary directories to fill, then commit() or abort()."""

    def __init__(self, protocol: "CommitProtocol", step: int):
        self.protocol, self.step = protocol, step
        token = f"{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
        self.dirs: list[Path] = []
        try:
            for root in protocol.roots:
                d = root / f"{TMP_PREFIX}{token}"
                d.mkdir()
                self.dirs.append(d)
                if root != protocol.primary:
                    _write_durable(d / OWNER_NAME, (protocol.identity + "\n").encode())
        except OSError as e:
            self.abort()
            raise EngineIOError(e.errno or errno.EIO, e.filename or protocol.roots[0], 0, "mkdir") from e
        self.finished = False

    def commit(self, manifest_bytes: bytes) -> None:
        """Make the step visible (see the module docstring); the data files must already be durable."""
        p = self.protocol
        final = step_dir_name(self.step)
        try:
            for d in self.dirs:
                fsync_dir(d)
            for root in p.roots[1:]:
                if (root / final).exists() and not p._owned(root / final):
                    raise EngineIOError(errno.EEXIST, root / final, 0, "commit",
                                        f"it holds step {self.step} of another checkpoint (not written for primary "
                                        f"root {p.identity}); give each checkpoint its own directory on every root")
            # The manifest goes in before anything is renamed: in a temporary directory it commits nothing.
            _atomic_write(self.dirs[0] / MANIFEST_NAME, manifest_bytes)
            if len(p.roots) == 1 and (p.roots[0] / final).exists() and exchange_paths(self.dirs[0], p.roots[0] / final):
                # Re-saving a committed step on one root: the swap is the commit point, and the
                # temporary name now holds the old step (a leftover, if the next line is cut short).
                fsync_dir(p.roots[0])
                shutil.rmtree(self.dirs[0], ignore_errors=True)
            else:
                # A new step, or a re-save on several roots (or without exchange): un-commit an old
                # step S (primary first, as delete_step does) before its secondary bytes are
                # replaced, so that a crash cannot pair the old manifest with the new data files.
                p._retire(p.roots[0] / final)
                for root, d in list(zip(p.roots, self.dirs))[1:]:
                    p._retire(root / final)
                    os.rename(d, root / final)
                    fsync_dir(root)
                os.rename(self.dirs[0], p.roots[0] / final)
                fsync_dir(p.roots[0])
        except OSError as e:
            if isinstance(e, EngineIOError):
                raise
            raise EngineIOError(e.errno or errno.EIO, e.filename or p.roots[0], 0, "commit") from e
        self.finished = True
        _atomic_write(p.roots[0] / LATEST_NAME, f"{self.step}\n".encode())

    def abort(self) -> None:
        """Remove the temporary directories (best effort; leftovers are cleaned on the next open)."""
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.finished = True


class CommitProtocol:
    """Reads and changes which steps exist under a list of roots (the first is the primary)."""

    def __init__(self, roots: Sequence[str | os.PathLike]):
        self.roots = [Path(r) for r in roots]
        self.identity = str(self.roots[0].resolve())

    @property
    def primary(self) -> Path:
        return self.roots[0]

    def step_dir(self, step: int, root: int = 0) -> Path:
        return self.roots[root] / step_dir_name(step)

    def begin(self, step: int) -> PendingCommit:
        return PendingCommit(self, step)

    def committed_steps(self) -> list[int]:
        """Steps whose primary directory holds a manifest, ascending."""
        try:
            names = os.listdir(self.primary)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            s = parse_step_dir(name)
            if s is not None and (self.primary / name / MANIFEST_NAME).is_file():
                steps.append(s)
        return sorted(steps)

    def latest(self) -> int | None:
        """The step ``latest`` names if it is committed, else the newest committed step."""
        try:
            named = int((self.primary / LATEST_NAME).read_text().strip())
            if (self.step_dir(named) / MANIFEST_NAME).is_file():
                return named
        except (OSError, ValueError):
            pass
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def require(self, step: int | None) -> int:
        resolved = self.latest() if step is None else step
        if resolved is None or not (self.step_dir(resolved) / MANIFEST_NAME).is_file():
            have = self.committed_steps()
            what = "no committed checkpoint" if step is None else f"no committed checkpoint for step {step}"
            raise CheckpointNotFoundError(
                errno.ENOENT, f"{what} under {self.primary}" + (f" (committed steps: {have})" if have else
                                                                 " (save one first, or check the root path)"))
        return resolved

    def _retire(self, path: Path) -> None:
        """Move an existing directory out of the way (atomic), then delete it."""
        if not path.exists():
            return
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
        os.rename(path, trash)
        fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def delete_step(self, step: int) -> None:
        """Un-commit (primary first), then remove the step's bytes from every root."""
        for i in range(len(self.roots)):
            self._retire(self.step_dir(step, i))

    def _owned(self, step_dir: Path) -> bool:
        """True when a secondary step directory was written for this primary root."""
        try:
            return (step_dir / OWNER_NAME).read_text().strip() == self.identity
        except OSError:
            return False

    def clean_leftovers(self) -> list[Path]:
        """Remove what crashed saves and deletions left behind. Call only while holding the RootLock."""
        removed = []
        committed = set(self.committed_steps())
        for i, root in enumerate(self.roots):
            try:
                names = os.listdir(root)
            except FileNotFoundError:
                continue
            for name in names:
                path = root / name
                step = parse_step_dir(name)
                stale = name.startswith((TMP_PREFIX, TRASH_PREFIX)) or (
                    i > 0 and step is not None and step not in committed and self._owned(path))
                if stale:
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path)
            if removed:
                fsync_dir(root)
        return removed
