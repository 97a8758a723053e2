"""The drain of DCP steps to a shared root (GDSStorageWriter with CheckpointOptions(drain_root=...);
format.md 9.5), with no collective: the protocol of distributed/drain.py, for one format 1.2
manifest instead of per-rank shards.

Every ``drain_every``-th step, on a thread of each rank's writer (never the save's), in
``DRAIN/.tmp-step_S-<token>/`` (the save's token: every rank names the same directory):

1. each rank copies its data files in (drain.py ``copy_checked``: every chunk's crc32c checked
   as it streams, each file fdatasynced): rank 0 after the commit, the others once their
   write_data is done, waiting (at most DistOptions.timeout_s) for a file on a root that the
   commit publishes (rank 0's, or a joint root another rank publishes);
2. rank 0, once the step committed locally (finish), writes the draft: the committed manifest
   with every file on root 0 and a root table of one entry (the drain root's identity, every
   rank), fsynced. A save that did not commit has no draft, so it never commits at the drain
   root (its directory is removed by a later drain);
3. each rank writes its mark ``.drained-rank-R`` durably and lists the directory (drain.py
   ``put_mark``, as GDSCheckpointer's drain; rank 0 lists it after its draft, with no mark, and
   finds it committed already where another rank marked just then): the rank that finds every
   rank's mark and the draft writes ``manifest.json``, fsyncs the directory, renames
   it to ``step_S`` (the commit point), fsyncs the drain root, moves ``latest`` and writes the
   DCP ``.metadata`` marker. Two ranks may both find the set complete: one rename wins.

Each rank's drain removes what other saves left (temporary directories of other tokens, for
steps up to its own) that it did not mark, as drain.py's: the others drain as soon as their
write_data is done, so a rank may be in a newer step's directory than rank 0, or, slower by a
whole save, still copying into an older one that the cleaning rank marked (kept); one it never
marked can never commit; one every rank marked, with the draft, is committed where its step is
not at the drain root yet (its publish failed), then removed (drain.py enter_drain_dir).

4. The rank that committed step S applies the drain root's retention (drain.py
   ``retain_drained``, as GDSCheckpointer's drain: ``drain_keep_last``, default ``keep_last``,
   and ``keep_every``): S and any newer step stay, a drain in progress is a temporary directory
   (never counted nor removed), and each step deleted is renamed out of the way and the root
   fsynced before its files are removed: a crash mid-delete leaves every other step loadable
   and trash that the next drain removes."""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import torch

from ..drain import DRAIN_BUFFER_BYTES, copy_checked, retain_drained
from ..engines.base import IOEngine
from ..engines.select import create_engine
from ..errors import DrainError, GDSWriterError
from ..format.commit import LATEST_NAME, TMP_PREFIX, CommitProtocol, root_identity, step_dir_name
from ..format.manifest import MANIFEST_NAME, Manifest, RootInfo
from ..format.sharded import parse_step
from ..fs import atomic_write, fsync_dir, write_durable
from ..options import CheckpointOptions
from .dcp_messages import RankReport
from .dcp_paths import MARKER_NAME, is_gdswriter_marker, marker_bytes
from .drain import DRAFT_NAME, enter_drain_dir, put_mark
from .roots import RootLayout

log = logging.getLogger("gdswriter")


def drained_manifest(raw: bytes, root_id: str, root: Path, world: int) -> bytes:
    """The committed manifest ``raw`` as the drain root holds it: every file on root 0, one root."""
    m = parse_step(raw, "the committed manifest")
    if not isinstance(m, Manifest) or m.dist is None:
        raise DrainError("the committed step is not a DCP step's manifest (internal: report it)", m.step)
    return replace(m, files=tuple(replace(f, root=0) for f in m.files),
                   dist=replace(m.dist, roots=(RootInfo(root_id, str(root), tuple(range(world))),))).to_json_bytes()


class DcpDrain:
    """A GDSStorageWriter's drain (the module docstring): ``submit`` per save, ``wait``,
    ``take_error``, ``close``."""

    def __init__(self, options: CheckpointOptions, wait_s: float):
        self.options, self.wait_s = options, wait_s  # wait_s: for a file the commit publishes
        self.root = Path(str(options.drain_root))
        self._cv = threading.Condition()
        self._todo: deque[tuple] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._engine: IOEngine | None = None
        self._bufs: list[torch.Tensor] | None = None
        self.error: DrainError | None = None
        self.drained: list[int] = []  # steps this rank committed at the drain root

    def wanted(self, step: int) -> bool:
        return step % self.options.drain_every == 0

    def submit(self, layout: RootLayout, step: int, token: str, report: RankReport | None, manifest: bytes | None,
               world: int) -> None:
        """This rank's part of a drained step: its files (``report``) or, on rank 0 after the
        commit, the committed manifest (``manifest``: the draft)."""
        with self._cv:
            self._todo.append((layout, step, token, report, manifest, world))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="gdswriter-dcp-drain", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._todo and not self._busy, timeout)

    def take_error(self) -> DrainError | None:
        with self._cv:
            e, self.error = self.error, None
        return e

    def close(self) -> None:
        self.wait()
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _work(self) -> None:
        while True:
            with self._cv:
                if not self._todo:
                    self._thread = None
                    return
                job = self._todo.popleft()
                self._busy = True
            try:
                self._drain(*job)
            except DrainError as e:
                log.warning("gdswriter: %s", e)
                with self._cv:
                    self.error = e
            except BaseException as e:  # noqa: BLE001 - a bug must not leave wait() waiting forever
                log.exception("gdswriter: the drain failed")
                with self._cv:
                    self.error = DrainError(f"the drain to {self.root} failed: {type(e).__name__}: {e}", -1)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _drain(self, layout: RootLayout, step: int, token: str, report: RankReport | None, manifest: bytes | None,
               world: int) -> None:
        try:
            ident = self._ident()
            d = self._enter(step, token, report.rank if report is not None else layout.rank, world)
            if report is not None:
                self._copy(layout, report, d)
            else:
                write_durable(d / DRAFT_NAME, drained_manifest(manifest or b"", ident, self.root, world))
            marks = put_mark(d, report.rank if report is not None else None, {})  # None: committed by another
            if marks is not None and marks.complete(world) and self._publish(step, d):
                self.drained.append(step)
                retain_drained(CommitProtocol([self.root]), self.options, step)
        except (GDSWriterError, OSError) as e:
            raise DrainError(f"step {step} is not drained to {self.root} (save {token}): {e}; the drain root keeps "
                             f"its earlier steps", step) from e

    def _ident(self) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        ident = root_identity(self.root, create=True)
        assert ident is not None
        return ident.id

    def _enter(self, step: int, token: str, rank: int, world: int) -> Path:
        """The step's temporary directory (made by whichever rank comes first), after removing
        what other saves' drains left for steps up to ``step`` and not marked by ``rank``: the
        other ranks drain as soon as their write_data is done, so they may be in a newer step's
        directory (never removed here), or, slower, still in an older one this rank marked (until
        every rank marked it: then committed, if its step is not at the drain root, and removed)."""
        return enter_drain_dir(self.root, step, token, clean=True, marked=rank, world=world, finish=self._finish)

    def _finish(self, step: int, d: Path, found: dict) -> bool:
        """Commit an earlier step's finished drain directory ``d`` that no rank committed
        (drain.enter_drain_dir); whether this rank's rename did."""
        done = self._publish(step, d)
        if done:
            self.drained.append(step)
        return done

    def _copy(self, layout: RootLayout, report: RankReport, into: Path) -> None:
        if self._engine is None:
            self._engine = create_engine(self.options.engine)
        if self._bufs is None:
            self._bufs = [torch.empty(DRAIN_BUFFER_BYTES, dtype=torch.uint8) for _ in range(2)]
        d = step_dir_name(report.step)
        for fid, (g, name, size, *_) in enumerate(report.files):
            local = layout.local_of(g)
            if local is None:
                raise DrainError(f"this rank's data file {name} is on a root it does not see", report.step)
            chunks = report.file_chunks(fid)
            src = layout.local_paths[local] / d / name
            deadline = time.monotonic() + self.wait_s
            while not src.exists() and time.monotonic() < deadline:  # a root the commit publishes (rank 0's, joint)
                time.sleep(0.05)
            copy_checked(self._engine, src, into / name, size, chunks, self._bufs)

    def _publish(self, step: int, d: Path) -> bool:
        """Commit ``d`` as ``step_S``; False when another rank did first."""
        final = self.root / step_dir_name(step)
        try:
            data: bytes | None = (d / DRAFT_NAME).read_bytes()
        except FileNotFoundError:  # d renamed by another rank's commit (or removed): checked below
            data = None
        try:
            tmp = d / f"{TMP_PREFIX}{MANIFEST_NAME}-{secrets.token_hex(4)}"
            write_durable(tmp, data or b"")
            os.replace(tmp, d / MANIFEST_NAME)
            fsync_dir(d)
            if final.exists():
                raise FileExistsError(errno.EEXIST, "already drained", str(final))
            os.rename(d, final)  # the commit point
        except OSError as e:
            if data is None or (final / MANIFEST_NAME).exists():
                return False  # another rank committed it (or it was drained before)
            raise DrainError(f"its temporary directory vanished before it was committed ({e})", step) from e
        fsync_dir(self.root)
        try:
            named = int((self.root / LATEST_NAME).read_text().strip())
        except (OSError, ValueError):
            named = None
        if named is None or named <= step or not (self.root / step_dir_name(named)).is_dir():
            atomic_write(self.root / LATEST_NAME, f"{step}\n".encode())
        marker = self.root / MARKER_NAME
        if not is_gdswriter_marker(marker):
            atomic_write(marker, marker_bytes())
        return True

