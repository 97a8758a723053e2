"""What a crashed refill of a DCP step leaves in ``step_S/copies`` removed (format.md 9.5).

A refill (dcp_refill.py) killed midway leaves, on the replacement root, a ``.tmp-rank<R>-<hex>``
folder (replicastream.Incoming: files still arriving, never renamed to ``copies/rank<R>``), a
``.tmp-`` file of ``fs.atomic_write`` (the manifest's copy, ``protected``) or, where its removal
was interrupted, a ``.trash-`` folder. No load reads them, and nothing names them: the next load
of the step removes them (dcp_replicas.place_files, on the roots each rank looks at, once the
step is protected: no replication of it writes there, and no refill of the loading reader's),
durably, unless a live refill owns them:

0. a refill holds a shared ``flock`` on each ``copies`` directory it writes into (``RefillLocks``,
   from before its first ``.tmp-`` entry there until it ends); the clean-up takes an exclusive one
   without waiting and, refused, removes nothing there: the ``.tmp-`` entries are then a live
   refill's (another reader's, another job's, in this process or another), and its end or death
   (the kernel drops a dead process's locks) lets the next load remove what it left;
1. each ``.tmp-`` folder is renamed to ``.trash-<name>-<hex>`` and ``copies`` fsynced
   (format.commit.retire): after a crash there it is trash, never half a temporary;
2. the trash is deleted (a ``.tmp-`` file at once). A crash there leaves ``.trash-`` entries,
   deleted by the next pass.

Committed entries (``copies/rank<R>``, ``manifest.json``, ``protected``) are never touched."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from ..format.commit import TMP_PREFIX, TRASH_PREFIX, retire

log = logging.getLogger("gdswriter")


def _lock(copies: Path, mode: int) -> int:
    """A descriptor of the directory ``copies`` holding ``flock`` ``mode``; BlockingIOError where
    ``mode`` has LOCK_NB and another descriptor holds a conflicting lock."""
    fd = os.open(copies, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


class RefillLocks:
    """The shared locks a running refill holds on the ``copies`` directories it writes into
    (module docstring, 0): ``hold`` before the first ``.tmp-`` entry there, ``release`` at its end."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def hold(self, copies: Path) -> Path:
        """``copies``, locked shared (waits for a clean-up running there: it is brief)."""
        key = str(copies)
        if key not in self._fds:
            self._fds[key] = _lock(copies, fcntl.LOCK_SH)
        return copies

    def release(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def drop_leftovers(copies: Path, step: int) -> int:
    """The crash leftovers in ``copies`` (a step's ``copies`` directory) removed (module
    docstring); how many. A failure is logged: the leftovers cost disk space, never a load."""
    try:
        fd = _lock(copies, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return 0
    except BlockingIOError:
        log.info("gdswriter: step %d: a refill still running writes into %s: its temporaries are left to it", step,
                 copies)
        return 0
    except OSError as e:
        log.warning("gdswriter: step %d: %s cannot be locked (%s): what a crashed refill left there stays", step,
                    copies, e)
        return 0
    try:
        return _drop(copies, step)
    finally:
        os.close(fd)


def _drop(copies: Path, step: int) -> int:
    """``drop_leftovers`` under the exclusive lock."""
    try:
        names = sorted(n for n in os.listdir(copies) if n.startswith((TMP_PREFIX, TRASH_PREFIX)))
    except FileNotFoundError:
        return 0
    except OSError as e:
        log.warning("gdswriter: step %d: %s cannot be listed (%s): what a crashed refill left there stays", step,
                    copies, e)
        return 0
    removed = 0
    for name in names:
        path = copies / name
        try:
            folder = path.is_dir() and not path.is_symlink()
            if folder and name.startswith(TMP_PREFIX):
                retire(path)
            elif folder:
                shutil.rmtree(path)
            else:
                path.unlink()  # a file goes at once
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("gdswriter: step %d: %s, left by a crashed refill, could not be removed (%s): remove it by "
                        "hand", step, path, e)
    if removed:
        log.info("gdswriter: step %d: removed %d leftover(s) of a crashed refill in %s", step, removed, copies)
    return removed
