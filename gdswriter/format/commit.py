"""The commit protocol: how a step becomes visible, atomically, on one or more roots.

Layout of a root (one directory per SSD; the first is the primary)::

    ROOT/step_000000000042/manifest.json   (primary only: the commit record)
    ROOT/step_000000000042/data-*.bin      (the bytes this root holds)
    ROOT/latest                            (primary only: "42\n")
    ROOT/.gdswriter.lock                   (held by the one writer of the root)
    ROOT/.gdswriter-root                   (the root's identity: a random id, written once)
    ROOT/.tmp-step_...                     (a save in progress; removed on the next open)
    ROOT/.trash-step_...                   (a step being deleted; removed on the next open)

Protocol for step S:
 1. every root gets ``.tmp-step_S-<token>``; the engine writes and fdatasyncs the data files there;
 2. each temporary directory is fsynced (secondary ones also name their primary root, by path
    and by identity, so that cleaning never touches directories another primary wrote);
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

Root identity. Each root holds ``.gdswriter-root``, a marker with a random id written durably
the first time a writer opens it (:func:`root_identity`). Secondary step directories record the
primary's id (``primary-id``) next to its path (``primary-root``). A writer deletes a secondary
``step_S`` only when it names the id of the primary it sees and that primary has no step S; and
it refuses to open the roots (:class:`RootUnavailableError`) when the primary is missing, or has
no marker, while secondary roots hold steps written for it: that is what an unmounted primary
disk looks like, and cleaning then would destroy the data of every committed step.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import operator
import os
import re
import secrets
import shutil
import socket
import stat
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from ..fs import (TMP_PREFIX, atomic_write, exchange_paths, fsync_dir, fsync_parents, link_no_clobber,
                  read_regular_file, write_durable)
from ..errors import (CheckpointLockedError, CheckpointNotFoundError, CorruptCheckpointError, EngineIOError,
                      InvalidOptionError, ReadOnlyRootError, RootUnavailableError, UnsafePathError)
from .manifest import MANIFEST_MAX_BYTES, MANIFEST_NAME, Manifest

log = logging.getLogger("gdswriter")

STEP_RE = re.compile(r"^step_(\d{12,})$")
LATEST_NAME = "latest"
LOCK_NAME = ".gdswriter.lock"
TRASH_PREFIX = ".trash-"
OWNER_NAME = "primary-root"  # in secondary step directories: which primary root they belong to (path)
OWNER_ID_NAME = "primary-id"  # ... and its identity (the id in its ROOT_MARKER_NAME)
ROOT_MARKER_NAME = ".gdswriter-root"
ROOT_MARKER_FORMAT = "gdswriter-root"
_ROOT_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_SMALL_FILE_MAX = 4096  # markers, owner files, `latest`
_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def normalize_step(step: Any) -> int:
    """``step`` as a plain int: any integral number (int, numpy or 0-d torch integer, anything
    with ``__index__``) that is >= 0; bool, str, float and negative numbers are refused."""
    if not isinstance(step, bool):
        try:
            value = operator.index(step)
        except TypeError:
            value = None
        if value is not None and value >= 0:
            return value
    hint = "; convert it with int(...)" if isinstance(step, (str, bytes)) else ""
    raise InvalidOptionError(f"step must be an integer >= 0 (int or numpy/torch integer), got {step!r} "
                             f"({type(step).__name__}){hint}")


def step_dir_name(step: int) -> str:
    return f"step_{normalize_step(step):012d}"


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


def _read_small_text(path: Path) -> str | None:
    """A small gdswriter-written text file (owner, marker, `latest`) stripped; None when it is
    missing, unreadable, not a regular file or not UTF-8 (the callers treat all those as absent)."""
    try:
        return read_regular_file(path, _SMALL_FILE_MAX).decode().strip()
    except (OSError, CorruptCheckpointError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class RootIdentity:
    """What a root's marker ``.gdswriter-root`` says: ``id`` (32 random hex digits, fixed for the
    life of the root, whatever path it is mounted at), and, for people, when, on which host and
    at which path it was first used."""

    id: str
    created_unix: float
    host: str
    path: str

    def to_json_bytes(self) -> bytes:
        return (json.dumps({"format": ROOT_MARKER_FORMAT, "version": 1, "id": self.id,
                            "created_unix": self.created_unix, "host": self.host, "path": self.path},
                           separators=(",", ":")) + "\n").encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes, where: str) -> RootIdentity:
        try:
            body = json.loads(raw)
            ok = (isinstance(body, dict) and body.get("format") == ROOT_MARKER_FORMAT
                  and isinstance(body.get("id"), str) and _ROOT_ID_RE.match(body["id"]))
        except (ValueError, UnicodeDecodeError, RecursionError):
            ok = False
        if not ok:
            raise CorruptCheckpointError(f"{where} is not a gdswriter root marker (damaged?): move it away only if "
                                         f"you know which checkpoint this directory holds")
        created = body.get("created_unix")
        return cls(body["id"], float(created) if isinstance(created, (int, float)) and not isinstance(created, bool)
                   and abs(created) < 1e18 else 0.0, str(body.get("host", "")), str(body.get("path", "")))


def root_identity(path: str | os.PathLike, create: bool = False) -> RootIdentity | None:
    """The identity of checkpoint root ``path`` (an existing directory), from its marker.

    Without a marker: None, or with ``create`` a new identity written durably (temporary file,
    fsync, no-clobber link into place, fsync of the root), so concurrent creators (ranks sharing
    a root) all get the one that won. Raises CorruptCheckpointError / UnsafePathError for a
    damaged or linked marker, OSError when it cannot be written (e.g. EROFS)."""
    root = Path(os.fspath(path))
    marker = root / ROOT_MARKER_NAME
    for _ in range(2):
        try:
            return RootIdentity.from_json_bytes(read_regular_file(marker, _SMALL_FILE_MAX), str(marker))
        except FileNotFoundError:
            if not create:
                return None
        ident = RootIdentity(secrets.token_hex(16), time.time(), socket.gethostname(), str(root.resolve()))
        tmp = root / f"{TMP_PREFIX}{ROOT_MARKER_NAME}-{secrets.token_hex(4)}"
        write_durable(tmp, ident.to_json_bytes())
        if link_no_clobber(tmp, marker):
            fsync_dir(root)
            return ident
    raise CorruptCheckpointError(f"{marker} appeared and vanished while it was being created: try again")


def _open_lock_file(path: Path) -> int:
    """Open (create) a lock file without following a planted link: a symbolic link, a special
    file or a file with other hard links is refused (it is written to, and could be anything)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise UnsafePathError(f"{path} is a symbolic link: remove it (gdswriter creates its lock file "
                              f"itself)") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise UnsafePathError(f"{path} is {'not a regular file' if not stat.S_ISREG(st.st_mode) else 'hard-linked'}"
                              f": remove it (gdswriter creates its lock file itself)")
    return fd


class RootLock:
    """An exclusive flock on every root, so two writers cannot interleave commits. Taking it
    also makes each root's own name durable (its parents are fsynced).

    A flock belongs to the open file description, which a forked child shares (O_CLOEXEC only
    acts at exec): while any process keeps a descriptor of it, closing ours would not drop the
    lock. So ``release`` unlocks explicitly (LOCK_UN, for every holder) before closing, and a
    forked child (a DataLoader worker, a persistent one outliving the checkpointer) closes its
    inherited descriptors at once (at fork), without unlocking: it never holds the root, also
    not after its parent died."""

    def __init__(self, roots: Sequence[Path]):
        self._fds: list[int] = []
        self._paths: list[Path] = []
        self._pid = os.getpid()  # the process that took the lock: the only one that unlocks it
        _live_locks.add(self)
        try:
            for root in roots:
                path = root / LOCK_NAME
                fd = _open_lock_file(path)
                self._fds.append(fd)
                self._paths.append(path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError as e:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    raise CheckpointLockedError(
                        errno.EWOULDBLOCK,
                        f"checkpoint root {root} is in use by another GDSCheckpointer (pid {holder}); "
                        f"close that one first or give this one a different root") from e
                # A root just made by mkdir -p must outlive a power cut: its name and its parents'
                # are fsynced, unless an earlier holder did so (it writes its pid only after).
                if not os.pread(fd, 1, 0):
                    fsync_parents(root)
                os.ftruncate(fd, 0)
                holder, done = f"{os.getpid()}\n".encode(), 0
                while done < len(holder):  # a short write is continued, never left half-written
                    done += os.pwrite(fd, holder[done:], done)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Unlock every root (in the process that locked them; see the class docstring) and close
        the descriptors. Idempotent."""
        fds, paths, self._fds, self._paths = self._fds, self._paths, [], []
        for fd, path in zip(fds, paths):
            if os.getpid() == self._pid:
                try:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError as e:  # closing still drops it once no other process holds the descriptor
                    log.warning("gdswriter: could not unlock %s (%s); it stays locked while a process forked "
                                "from this one keeps it open", path, e)
            os.close(fd)

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptors, leaving the parent's lock alone."""
        fds, self._fds, self._paths = self._fds, [], []
        for fd in fds:
            try:
                os.close(fd)
            except OSError as e:  # the child's copy is gone either way (EBADF: it was closed already)
                log.debug("gdswriter: closing an inherited root lock descriptor in a forked child: %s", e)


_live_locks: weakref.WeakSet[RootLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    for lock in list(_live_locks):
        lock._forget_in_child()
    _live_locks.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


class PendingCommit:
    """A step being written: temporary directories to fill, then commit() or abort()."""

    def __init__(self, protocol: CommitProtocol, step: int):
        self.protocol, self.step = protocol, step
        token = f"{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
        self.dirs: list[Path] = []
        if len(protocol.roots) > 1 and protocol.primary_id is None:
            protocol.claim_roots()  # secondary directories record the primary's identity
        try:
            for root in protocol.roots:
                d = root / f"{TMP_PREFIX}{token}"
                d.mkdir()
                self.dirs.append(d)
                if root != protocol.primary:
                    write_owner(d, protocol.identity, protocol.primary_id)
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
            atomic_write(self.dirs[0] / MANIFEST_NAME, manifest_bytes)
            if (p.roots[0] / final / MANIFEST_NAME).exists() and self.step not in p.overwritten:
                p.overwritten.add(self.step)
                log.warning("gdswriter: step %d is already committed under %s: replacing it with the new save "
                            "(atomically; the old step %d is deleted)", self.step, p.primary, self.step)
            if len(p.roots) == 1 and (p.roots[0] / final).exists() and exchange_paths(self.dirs[0], p.roots[0] / final):
                # Re-saving a committed step on one root: the swap is the commit point, and the
                # temporary name now holds the old step (a leftover, if the next line is cut short).
                fsync_dir(p.roots[0])
                shutil.rmtree(self.dirs[0], ignore_errors=True)
            else:
                # A new step, or a re-save on several roots (or without exchange): un-commit an old
                # step S (primary first, as delete_step does) before its secondary bytes are
                # replaced, so that a crash cannot pair the old manifest with the new data files.
                retire(p.roots[0] / final)
                for root, d in list(zip(p.roots, self.dirs))[1:]:
                    retire(root / final)
                    os.rename(d, root / final)
                    fsync_dir(root)
                os.rename(self.dirs[0], p.roots[0] / final)
                fsync_dir(p.roots[0])
        except OSError as e:
            if isinstance(e, EngineIOError):
                raise
            raise EngineIOError(e.errno or errno.EIO, e.filename or p.roots[0], 0, "commit") from e
        self.finished = True
        atomic_write(p.roots[0] / LATEST_NAME, f"{self.step}\n".encode())

    def abort(self) -> None:
        """Remove the temporary directories (best effort; leftovers are cleaned on the next open)."""
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.finished = True


def _is_regular(path: Path) -> bool:
    """True when ``path`` is a regular file (a symbolic link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def step_owner(step_dir: Path) -> tuple[str | None, str | None]:
    """(path, id) of the primary root a secondary step directory was written for. The id is
    None for directories written before root identities existed, and "" when the id file is
    there but unreadable (it then matches no primary, so nothing deletes the directory)."""
    id_path = step_dir / OWNER_ID_NAME
    owner_id = (_read_small_text(id_path) or "") if os.path.lexists(id_path) else None
    return _read_small_text(step_dir / OWNER_NAME), owner_id


def write_owner(step_dir: Path, primary_path: str, primary_id: str) -> None:
    """Record, durably, which primary root a secondary step directory is written for."""
    write_durable(step_dir / OWNER_NAME, (primary_path + "\n").encode())
    write_durable(step_dir / OWNER_ID_NAME, (primary_id + "\n").encode())


def owned_by(step_dir: Path, primary_path: str, primary_id: str | None) -> bool:
    """True when a secondary step directory was written for this primary root: it names the
    primary's identity, or (written before identities existed) the primary's path."""
    path, owner_id = step_owner(step_dir)
    if owner_id is not None:
        return owner_id == primary_id
    return path == primary_path


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step directory in ``root``, ascending; none if it does not exist."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((s, root / n) for n in names if (s := parse_step_dir(n)) is not None)


def retire(path: Path) -> None:
    """Move an existing directory out of the way (atomic, durable), then delete it: a step
    un-committed this way is never seen half-deleted, even after a crash."""
    if not path.exists():
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


class CommitProtocol:
    """Reads and changes which steps exist under a list of roots (the first is the primary)."""

    def __init__(self, roots: Sequence[str | os.PathLike]):
        self.roots = [Path(r) for r in roots]
        self.identity = str(self.roots[0].resolve())  # the primary's path, as secondary steps record it
        self.primary_id: str | None = None  # the primary's RootIdentity.id, once claim_roots() ran
        self.overwritten: set[int] = set()  # steps whose replacement was already logged

    @property
    def primary(self) -> Path:
        return self.roots[0]

    def step_dir(self, step: int, root: int = 0) -> Path:
        return self.roots[root] / step_dir_name(step)

    def begin(self, step: int) -> PendingCommit:
        return PendingCommit(self, normalize_step(step))

    def is_committed(self, step: int) -> bool:
        """True when the primary holds the step's commit record (a regular file, not a link)."""
        return _is_regular(self.step_dir(step) / MANIFEST_NAME)

    def committed_steps(self) -> list[int]:
        """Steps whose primary directory holds a manifest, ascending."""
        return [s for s, d in step_dirs(self.primary) if _is_regular(d / MANIFEST_NAME)]

    def latest_named(self) -> int | None:
        """The step the ``latest`` file names, committed or not (None: absent or unreadable; it
        is read like every small file here: no link followed, size bounded, never blocking)."""
        text = _read_small_text(self.primary / LATEST_NAME)
        return int(text) if text is not None and re.fullmatch(r"[0-9]+", text) else None

    def latest(self) -> int | None:
        """The step ``latest`` names if it is committed, else the newest committed step."""
        named = self.latest_named()
        if named is not None and self.is_committed(named):
            return named
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def require(self, step: int | None) -> int:
        resolved = self.latest() if step is None else normalize_step(step)
        if resolved is None or not self.is_committed(resolved):
            have = self.committed_steps()
            what = "no committed checkpoint" if step is None else f"no committed checkpoint for step {resolved}"
            raise CheckpointNotFoundError(
                errno.ENOENT, f"{what} under {self.primary}" + (f" (committed steps: {have})" if have else
                                                                 " (save one first, or check the root path)"))
        return resolved

    def fallback_order(self) -> list[int]:
        """The steps a load that skips damaged steps tries: the latest, then the older committed
        steps, newest first (steps above the latest, abandoned by a rollback, are not tried)."""
        latest = self.latest()
        if latest is None:
            return []
        return [latest] + [s for s in reversed(self.committed_steps()) if s < latest]

    def delete_step(self, step: int) -> None:
        """Un-commit (primary first), then remove the step's bytes from every root."""
        for i in range(len(self.roots)):
            retire(self.step_dir(step, i))

    # -- identity -----------------------------------------------------------------
    def _owned(self, step_dir: Path) -> bool:
        return owned_by(step_dir, self.identity, self.primary_id)

    def _latest_file_roots(self) -> set[int]:
        """Root indices that hold data files of the latest committed step (empty if unreadable)."""
        latest = self.latest()
        if latest is None:
            return set()
        try:
            raw = read_regular_file(self.step_dir(latest) / MANIFEST_NAME, MANIFEST_MAX_BYTES)
            body = json.loads(raw)
            if isinstance(body, dict) and "shards" in body:  # format 1.3: every root of its table holds data
                return set(range(len(body["dist"]["roots"])))
            m = Manifest.from_json_bytes(raw)
        except (OSError, CorruptCheckpointError, ValueError, KeyError, TypeError):
            return set()
        return {f.root for f in m.files}

    def check_roots(self) -> None:
        """Refuse to write roots whose primary is not the one their data was saved with.

        Raises RootUnavailableError when the primary is missing or has no identity marker while
        a secondary root holds steps written for it (by a marked primary, or by an unmarked one
        that has no committed step): its disk is probably not mounted, and cleaning would delete
        every committed step's secondary data. Likewise when a secondary root is missing, or is an
        empty directory without marker, although the latest committed step keeps files on it.
        Reads only; creates nothing."""
        primary = self.primary
        if len(self.roots) == 1:
            return
        if not primary.is_dir() or root_identity(primary) is None:
            committed = self.committed_steps()
            for root in self.roots[1:]:
                refs = [(s, owner_id) for s, d in step_dirs(root) for path, owner_id in [step_owner(d)]
                        if path == self.identity]
                held = [s for s, owner_id in refs if owner_id is not None or not committed]
                if held:
                    state = "does not exist" if not primary.is_dir() else (
                        f"has no identity marker ({ROOT_MARKER_NAME})" + ("" if committed else " and no committed step"))
                    raise RootUnavailableError(
                        errno.ENOENT,
                        f"primary checkpoint root {primary} {state}, but secondary root {root} holds "
                        f"{len(held)} step director{'y' if len(held) == 1 else 'ies'} written for it (steps "
                        f"{held[:5]}{' ...' if len(held) > 5 else ''}): is the primary's disk mounted? Mount it and "
                        f"open the checkpoint again. gdswriter refuses to write (and never cleans) these roots until "
                        f"then; if the primary's data is really lost, move those directories out of {root} yourself")
        need = None
        for i, root in enumerate(self.roots[1:], 1):
            if root.is_dir() and (root_identity(root) is not None or step_dirs(root)):
                continue
            need = self._latest_file_roots() if need is None else need
            if i in need:
                state = "does not exist" if not root.is_dir() else "holds no step directory and no identity marker"
                raise RootUnavailableError(
                    errno.ENOENT,
                    f"secondary checkpoint root #{i} {root} {state}, but the latest committed step under "
                    f"{primary} keeps data files there: is its disk mounted? Mount it and open the checkpoint again "
                    f"(pass the roots in the order they were saved with)")

    def claim_roots(self) -> list[RootIdentity]:
        """Make the roots this protocol's to write: :meth:`check_roots`, then create missing roots and
        give each its identity marker (roots written before markers existed get theirs now).
        Sets ``primary_id``. Writers call it while holding the RootLock; it is idempotent."""
        self.check_roots()
        ids = []
        for root in self.roots:
            root.mkdir(parents=True, exist_ok=True)
            ident = root_identity(root, create=True)
            assert ident is not None
            ids.append(ident)
        if self.primary_id is None:
            self.primary_id = ids[0].id
            for root in self.roots[1:]:
                foreign = [s for s, d in step_dirs(root) for path, owner_id in [step_owner(d)]
                           if path == self.identity and owner_id and owner_id != self.primary_id]
                if foreign:
                    log.warning("gdswriter: secondary root %s holds %d step directories (steps %s) written for "
                                "another primary root that was at %s (identity differs): they are left alone. If the "
                                "disk now at %s is not the one those steps were saved with, mount the right one",
                                root, len(foreign), foreign[:5], self.identity, self.primary)
        return ids

    def open_writer(self) -> tuple[RootLock, list[Path]]:
        """Open the roots for writing: check them (before creating anything), create missing ones,
        take the RootLock, write missing identity markers and remove leftovers of interrupted saves.
        Returns the lock and what was removed. ReadOnlyRootError when a root cannot be written
        (read-only file system, no permission): the roots can still be read, without a lock."""
        self.check_roots()
        lock = None
        try:
            for root in self.roots:
                try:
                    root.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    if e.errno in _READ_ONLY_ERRNOS:
                        raise
                    raise InvalidOptionError(f"cannot create checkpoint root {root}: {e.strerror}; choose a "
                                             f"writable directory") from e
            lock = RootLock(self.roots)
            self.claim_roots()
            return lock, self.clean_leftovers()
        except BaseException as e:
            if lock is not None:
                lock.release()
            if isinstance(e, OSError) and not isinstance(e, CheckpointLockedError) and e.errno in _READ_ONLY_ERRNOS:
                where = e.filename or self.primary
                raise ReadOnlyRootError(e.errno, f"checkpoint root {where} cannot be written ({e.strerror}): opened "
                                                 f"for loading only; to save, remount it read-write, make it writable "
                                                 f"for this user, or choose another root") from e
            raise

    def clean_leftovers(self, keep: str | None = None) -> list[Path]:
        """Remove what crashed saves and deletions left behind: temporaries, trash, and secondary step
        directories of this primary (by identity) whose step it has not committed. Call only while
        holding the RootLock; it claims the roots first (which refuses a primary it cannot see).
        ``keep``: entries whose name holds it stay (the current save's token: on a root several
        ranks share, another rank may have made the save's temporary directory already)."""
        if self.primary_id is None:
            self.claim_roots()
        removed = []
        committed = set(self.committed_steps())
        for i, root in enumerate(self.roots):
            try:
                names = os.listdir(root)
            except FileNotFoundError:
                continue
            for name in names:
                if keep is not None and keep in name:
                    continue
                path = root / name
                step = parse_step_dir(name)
                stale = name.startswith((TMP_PREFIX, TRASH_PREFIX)) or (
                    i > 0 and step is not None and step not in committed and self._owned(path))
                if stale:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path)
            if removed:
                fsync_dir(root)
        return removed
