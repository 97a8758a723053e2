"""The drain: committed steps copied, in the background, to a root on shared storage.

With ``CheckpointOptions(drain_root=...)`` every ``drain_every``-th committed step is copied by
a drain thread of its own (never the save thread: a save never waits for a drain) to
``drain_root``, where it becomes a complete gdswriter step on one root, committed with
format/commit.py's protocol: the data files are written and fdatasynced in a temporary
directory, the manifest goes in last, the rename is the commit point, ``latest`` follows. So
the drain root is itself a checkpoint root: ``GDSCheckpointer(root=drain_root).load()``,
``gdswriter.load_state(drain_root)`` and ``gdswriter verify drain_root`` read it.

A drain reads each local data file once, sequentially, through an engine of its own, in
pieces of DRAIN_BUFFER_BYTES; every chunk's crc32c (the engine computes it as the bytes
stream) is checked against the manifest before its last piece is written out, so a damaged
local copy is never committed at the drain root: the drain fails (DrainError, logged and kept
for ``wait_drained``), the temporary directory is removed and the drain root keeps its earlier
steps. A crash mid-drain leaves a ``.tmp-step_...`` directory there and nothing committed; the
next drain (of this or any process) removes it before it writes.

One drain runs at a time; a step committed while one runs waits, and a newer one replaces it
(the newest step is what matters off the node). The steps waiting or draining are pinned:
the local root's retention keeps them until their drain ended (``pinned``). A step that is
gone anyway (deleted by hand) is skipped with a warning. ``close`` (GDSCheckpointer.close, and
interpreter exit) waits for the drain in flight and the one waiting.

Sits beside session.py: it imports load/ (the manifest reader), format/, engines/ and fs.py.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Sequence

import torch

from .crc import crc32c_combine
from .engines.base import IOEngine, ReadSpan
from .engines.select import create_engine
from .errors import (CheckpointNotFoundError, ChecksumMismatchError, DrainError, EngineIOError, GDSWriterError,
                     InvalidOptionError)
from .format.commit import CommitProtocol, RootLock
from .format.manifest import ChunkRecord, Manifest
from .fs import open_regular
from .load.reader import check_data_files, parse_manifest, read_manifest_bytes
from .options import CheckpointOptions

log = logging.getLogger("gdswriter")

DRAIN_BUFFER_BYTES = 32 << 20  # one sequential read (and write) of the drain; two such buffers
DRAIN_IDLE_S = 10.0  # the drain thread ends after this long without a step to drain

__all__ = ["DrainStats", "Drainer", "copy_checked"]


@dataclass(frozen=True)
class DrainStats:
    """One drained step: ``nbytes`` copied, ``seconds`` from the drain's start to its commit at
    the drain root, ``committed_at``/``drained_at``: perf_counter() when the step was committed
    locally (submitted to the drain) and at the drain root."""

    step: int
    nbytes: int
    seconds: float
    committed_at: float
    drained_at: float


def _pieces(chunks: Sequence[ChunkRecord], starts: list[int], lo: int, hi: int,
            buf: torch.Tensor) -> list[tuple[int, ReadSpan]]:
    """File range [lo, hi) as read spans over ``buf`` cut at chunk boundaries, each with the
    index of the chunk it lies in (-1: bytes no chunk records, e.g. alignment padding)."""
    out = []
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    pos = lo
    while pos < hi:
        while i < len(chunks) and chunks[i].file_offset + chunks[i].length <= pos:
            i += 1
        if i < len(chunks) and chunks[i].file_offset <= pos:
            key, end = i, min(hi, chunks[i].file_offset + chunks[i].length)
        else:
            key, end = -1, min(hi, chunks[i].file_offset) if i < len(chunks) else hi
        out.append((key, ReadSpan(pos, buf[pos - lo:end - lo])))
        pos = end
    return out


def _write_all(fd: int, data: memoryview, offset: int, path: Path) -> None:
    while data:
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as e:
            raise EngineIOError(e.errno or errno.EIO, path, offset, "write") from e
        data, offset = data[n:], offset + n


class _Writer:
    """Writes the pieces copy_checked read, in a thread of its own, while the next is read."""

    def __init__(self, fd: int, path: Path, nbufs: int):
        self.fd, self.path = fd, path
        self.free = [threading.Event() for _ in range(nbufs)]
        for e in self.free:
            e.set()
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gdswriter-drain-write", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            i, data, offset = item
            try:
                if self.error is None:
                    _write_all(self.fd, data, offset, self.path)
            except BaseException as e:  # noqa: BLE001 - raised by the reader (take)
                self.error = e
            finally:
                self.free[i].set()

    def take(self, i: int) -> None:
        """Wait until buffer ``i`` is written out; raise the writer's error."""
        self.free[i].wait()
        self.free[i].clear()
        if self.error is not None:
            raise self.error

    def put(self, i: int, data: memoryview, offset: int) -> None:
        self.todo.put((i, data, offset))

    def finish(self) -> None:
        self.todo.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def copy_checked(engine: IOEngine, src: Path, dst: Path, size: int, chunks: Sequence[ChunkRecord],
                 bufs: Sequence[torch.Tensor]) -> None:
    """Copy the ``size`` bytes of data file ``src`` to a new file ``dst`` (fdatasynced), reading
    each byte once through ``engine`` into ``bufs`` in turn, piece by piece, while a writer
    thread writes the previous piece out; each chunk's crc32c is checked as soon as its last
    byte is read, before that piece is handed to the writer: ChecksumMismatchError for a
    damaged chunk."""
    chunks = sorted((c for c in chunks if c.length), key=lambda c: c.file_offset)
    starts = [c.file_offset for c in chunks]
    acc: dict[int, tuple[int, int]] = {}
    step = bufs[0].numel()
    fd, _ = open_regular(str(dst), write=True)
    writer = _Writer(fd, dst, len(bufs))
    try:
        for k, lo in enumerate(range(0, size, step)):
            hi, i = min(size, lo + step), k % len(bufs)
            writer.take(i)
            pieces = _pieces(chunks, starts, lo, hi, bufs[i])
            crcs = engine.read_file(src, [s for _, s in pieces])
            for (key, span), crc in zip(pieces, crcs):
                if key < 0:
                    continue
                n = span.out.numel()
                prev = acc.get(key)
                got, done = (crc, n) if prev is None else (crc32c_combine(prev[0], crc, n), prev[1] + n)
                acc[key] = (got, done)
                c = chunks[key]
                if done == c.length and got != c.crc32c:
                    raise ChecksumMismatchError(str(src), f"bytes of chunk {key} of this file", c.file_offset,
                                                c.length, c.crc32c, got)
            writer.put(i, memoryview(bufs[i][:hi - lo].numpy()), lo)
        writer.finish()
        os.fdatasync(fd)
    finally:
        writer.error = writer.error or GDSWriterError("the copy was abandoned")  # the writer skips the rest
        writer.todo.put(None)
        writer.thread.join()
        os.close(fd)


def _drained_manifest(m: Manifest, raw: bytes) -> bytes:
    """The manifest of the drained step: the same, with every file on root 0 (the drain root
    is one directory; data file names are unique across a step's roots)."""
    if all(f.root == 0 for f in m.files):
        return raw
    return replace(m, files=tuple(replace(f, root=0) for f in m.files)).to_json_bytes()


class Drainer:
    """A checkpointer's drain (see the module docstring): ``submit(step)`` after each commit,
    ``pinned()`` for the local retention, ``wait()``, ``close()``.

    ``source``: the local roots' protocol; ``engine``: the engine the drain reads with (taken
    over, closed by close; default: one made from ``options.engine`` at the first drain)."""

    def __init__(self, source: CommitProtocol, options: CheckpointOptions, engine: IOEngine | None = None):
        assert options.drain_root is not None
        self.source, self.options = source, options
        self.root = Path(os.fspath(options.drain_root))
        self.target = CommitProtocol([self.root])
        self._lock: RootLock | None = None
        self._engine = engine
        self._bufs: list[torch.Tensor] | None = None  # two: one is read into while the other is written
        self._cv = threading.Condition()
        self._waiting: tuple[int, float] | None = None  # (step, committed_at) to drain next
        self._running: int | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last: DrainStats | None = None
        self.error: DrainError | None = None  # the last drain's failure, until wait() raised it

    def wants(self, step: int) -> bool:
        return step % self.options.drain_every == 0

    def submit(self, step: int) -> None:
        """Drain ``step`` (just committed) once the drain in flight ended; replaces a step still
        waiting. Returns at once."""
        with self._cv:
            if self._closed:
                return
            if self._waiting is not None:
                log.info("gdswriter: step %d is not drained to %s: step %d was committed before its drain began",
                         self._waiting[0], self.root, step)
            self._waiting = (step, time.perf_counter())
            self._cv.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="gdswriter-drain", daemon=True)
                self._thread.start()

    def pinned(self) -> set[int]:
        """The steps the local retention must keep: the one draining and the one waiting."""
        with self._cv:
            return {s for s in (self._running, self._waiting and self._waiting[0]) if s is not None}

    def busy(self) -> bool:
        with self._cv:
            return self._running is not None or self._waiting is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no drain runs or waits (False after ``timeout`` s)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._running is None and self._waiting is None, timeout)

    def take_error(self) -> DrainError | None:
        with self._cv:
            e, self.error = self.error, None
        return e

    def drained_step(self) -> int | None:
        """The newest step committed at the drain root (by this or an earlier run)."""
        return self.target.latest()

    def _work(self) -> None:
        while True:
            with self._cv:
                if not self._cv.wait_for(lambda: self._waiting is not None, DRAIN_IDLE_S):
                    self._thread = None
                    return
                (step, committed_at), self._waiting = self._waiting, None  # type: ignore[misc]
                self._running = step
            try:
                stats = self.drain_step(step, committed_at)
                with self._cv:
                    self.last = stats or self.last
            except DrainError as e:
                log.error("gdswriter: %s", e)
                with self._cv:
                    self.error = e
            except BaseException as e:  # noqa: BLE001 - a bug must not leave the drain waiting forever
                log.exception("gdswriter: the drain of step %d failed", step)
                with self._cv:
                    self.error = DrainError(f"the drain of step {step} failed: {type(e).__name__}: {e}", step)
            finally:
                with self._cv:
                    self._running = None
                    self._cv.notify_all()

    def _open_target(self) -> None:
        """Lock the drain root (once) and remove what crashed drains left there."""
        if self._lock is None:
            self._lock, removed = self.target.open_writer()
        else:
            removed = self.target.clean_leftovers()
        if removed:
            log.info("gdswriter: removed %d leftover(s) of interrupted drains under %s", len(removed), self.root)

    def drain_step(self, step: int, committed_at: float) -> DrainStats | None:
        """Copy committed ``step`` to the drain root and commit it there, then apply the drain
        root's retention. None when the step is no longer committed locally (skipped)."""
        t0 = time.perf_counter()
        try:
            raw = read_manifest_bytes(self.source, step)
            m = parse_manifest(self.source, step, raw)
            check_data_files(self.source, m)
        except CheckpointNotFoundError:
            if not self.source.is_committed(step):
                log.warning("gdswriter: step %d was deleted under %s before its drain: not drained", step,
                            self.source.primary)
                return None
            raise
        except GDSWriterError as e:
            raise DrainError(f"step {step} is not drained to {self.root}: its local copy is damaged ({e}); the drain "
                             f"root keeps its earlier steps", step) from e
        if m.dist is not None:
            raise DrainError(f"step {step} under {self.source.primary} was saved by several ranks: a single-process "
                             f"checkpointer cannot drain it", step)
        try:
            self._open_target()
            pending = self.target.begin(step)
        except (GDSWriterError, OSError) as e:
            raise DrainError(f"step {step} is not drained: the drain root {self.root} cannot be written "
                             f"({type(e).__name__}: {e}); fix it (mounted? writable? another checkpointer "
                             f"draining there?), later steps are drained again", step) from e
        try:
            self._copy_files(m, pending.dirs[0], step)
            pending.commit(_drained_manifest(m, raw))
        except BaseException as e:
            pending.abort()
            if isinstance(e, (GDSWriterError, OSError)):
                what = "its local copy is damaged" if isinstance(e, ChecksumMismatchError) else "copying failed"
                raise DrainError(f"step {step} is not drained to {self.root}: {what} ({e}); the drain root keeps "
                                 f"its earlier steps (drained: {self.target.latest()})", step) from e
            raise
        now = time.perf_counter()
        self._retain(step)
        return DrainStats(step, sum(f.size for f in m.files), now - t0, committed_at, now)

    def _copy_files(self, m: Manifest, into: Path, step: int) -> None:
        if self._engine is None:
            self._engine = create_engine(self.options.engine)
        if self._bufs is None:
            self._bufs = [torch.empty(DRAIN_BUFFER_BYTES, dtype=torch.uint8) for _ in range(2)]
        per_file: dict[int, list[ChunkRecord]] = {i: [] for i in range(len(m.files))}
        for s in m.storages:
            for c in s.chunks:
                per_file[c.file].append(c)
        for fid, f in enumerate(m.files):
            copy_checked(self._engine, self.source.step_dir(step, f.root) / f.path, into / f.path, f.size,
                         per_file[fid], self._bufs)

    def _retain(self, newest: int) -> None:
        retain_drained(self.target, self.options, newest)

    def close(self) -> None:
        """Wait for the drains in flight and waiting, then release the engine and the drain
        root's lock. Idempotent."""
        self.wait()
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None:
            thread.join(DRAIN_IDLE_S + 1)
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def retain_drained(target: CommitProtocol, options: CheckpointOptions, newest: int) -> None:
    """The drain root's retention once ``newest`` committed there: the steps
    ``options.drain_retained`` does not keep deleted (``delete_step``: renamed out of the way,
    the root fsynced, then removed, so a crash leaves every other step loadable and only trash
    that the next drain removes). ``newest`` and any newer step are kept; a drain in progress
    is a temporary directory, never a committed step. Shared by GDSCheckpointer's drains and
    the DCP plug-in's (distributed/dcp_drain.py)."""
    steps = target.committed_steps()
    keep = options.drain_retained(steps, newest)
    for s in steps:
        if s not in keep:
            try:
                target.delete_step(s)
            except FileNotFoundError:
                pass  # another rank's retention removed it first
            except OSError as e:
                log.warning("gdswriter: could not delete drained step %d under %s: %s", s, target.primary, e)


def check_drain_root(drain_root: str | os.PathLike, roots: Sequence[Path]) -> None:
    """InvalidOptionError when the drain root is one of the checkpoint's roots, or inside one,
    or holds one: the drain would copy a root onto itself."""
    d = Path(os.path.realpath(drain_root))
    for r in roots:
        r = Path(os.path.realpath(r))
        if d == r or r in d.parents or d in r.parents:
            raise InvalidOptionError(f"drain_root={os.fspath(drain_root)!r} and checkpoint root {r} overlap: give "
                                     f"the drain its own directory on shared storage (not inside a root)")

