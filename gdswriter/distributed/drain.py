"""The drain of a checkpointer of several ranks (format.md 6.1): each rank copies its own part
of a committed step to the shared drain root, and the last rank to finish commits it there.

After step S commits, every rank's drain thread (drain.py's Drainer: never the save thread)
works in one temporary directory ``DRAIN/.tmp-step_S-<token>/`` (the token the save's primary
rank broadcast, so every rank names the same directory, with no message):

1. it checks its own shard's local bytes against the size and crc32c it voted at the save,
   copies its data files in (drain.py ``copy_checked``: each chunk's crc32c checked as it
   streams, each file fdatasynced), and writes its shard rewritten with every file on root 0
   (the drain root is one root), fsynced;
2. the primary rank also writes ``.drained-global``: the step's global manifest as committed
   locally (metadata, totals, layout index: what only it reads), fsynced;
3. it writes its mark ``.drained-rank-R`` (its new shard's size and crc32c), durably (a
   fsynced temporary file renamed into place, so a mark is never seen half written), then
   lists the directory (``put_mark``, which DCP's drain shares: all through one descriptor of
   the directory, which another rank may rename as soon as this mark is in); the rank that finds every rank's mark and the draft writes the new
   global manifest (a root table of one entry: the drain root's identity; the new shard refs),
   fsyncs the directory and renames it to ``step_S``: the commit point. Two ranks may both find
   the set complete; one rename wins, the other finds its source gone and checks that
   ``step_S`` holds its very manifest. The winner then moves ``latest`` and applies the drain
   root's retention. No collective: a rank's drain ends with its mark.

A rank that fails (a damaged local file, an I/O error) or dies never marks: the step is not
committed at the drain root, which keeps its earlier steps. What it left is removed by a later
drain of any rank: the temporary directories of *other* tokens for steps up to the one it
drains (never a newer step's: a faster rank may be draining it), where that rank has no mark
(one it marked may be an older step a slower rank still copies into; one it never marked can
never commit: the rank that failed there removes it at its next drain), until every rank
marked it and the draft is in: that rank then commits it where its step is not at the drain
root (its last rank's publish failed or died; any rank finding every mark may commit, one rename
wins), and removes it once the step is there (a step saved again: "not drained again"; a rank
publishing it then finds it gone and the step there: the same, as when it finds ``step_S``).
"Every rank": of the world that saved the step (its draft says), not of the job draining now:
one left by a larger world (restarted on fewer ranks: a node lost) without a lost rank's mark
can never commit, and is removed (_settled, _save_world).
A removal renames the
directory away first (format/commit.py ``retire``), so it and a publishing rename exclude each
other: a directory is either published whole or removed, never committed half deleted.

No flock is taken on the drain root (every rank of the job writes there at once); one job
drains to a drain root (a single-process drain removes every temporary directory it finds).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

import crc32c as _crc32c
import torch

from ..drain import DRAIN_BUFFER_BYTES, Drainer, DrainStats, copy_checked
from ..engines.select import create_engine
from ..errors import ChecksumMismatchError, DrainError, GDSWriterError
from ..format.commit import LATEST_NAME, TMP_PREFIX, TRASH_PREFIX, parse_step_dir, retire, root_identity, step_dir_name
from ..format.manifest import MANIFEST_NAME, RootInfo
from ..format.sharded import RankShard, ShardRef, parse_global, shard_name
from ..fs import atomic_write, fsync_dir, read_regular_file, write_durable
from ..options import CheckpointOptions
from ..engines.base import IOEngine

log = logging.getLogger("gdswriter")

MARK_PREFIX = ".drained-rank-"
DRAFT_NAME = ".drained-global"
SMALL_LIMIT = 1 << 30  # a shard or global manifest read back (the readers' own bounds apply at load)


def drain_dir_name(step: int, token: str) -> str:
    return f"{TMP_PREFIX}{step_dir_name(step)}-{token}"


def parse_drain_dir(name: str) -> tuple[int, str] | None:
    """(step, token) of a drain's temporary directory name, else None."""
    if not name.startswith(TMP_PREFIX):
        return None
    step_part, _, token = name[len(TMP_PREFIX):].rpartition("-")
    step = parse_step_dir(step_part)
    return None if step is None or not token else (step, token)


def enter_drain_dir(root: Path, step: int, token: str, clean: bool, marked: int | None = None,
                    world: int | None = None, finish: Callable[[int, Path, dict[int, dict]], bool] | None = None) -> Path:
    """The drain's temporary directory for ``step`` of save ``token`` at the drain ``root`` (made by
    whichever rank comes first); with ``clean``, after removing what other drains left there for
    steps up to ``step`` (interrupted ones; a newer step's directory is never touched) and the
    removals a crash interrupted. Shared by GDSCheckpointer's drain and DCP's (dcp_drain.py).
    ``marked``: this rank; a directory holding its mark is kept (a slower rank may still be
    copying into it: drains of ranks are not in step; one this rank never marked can never
    commit, so it is removed, also by the rank that failed there), until it is finished
    (``world``, ``finish``: _settled)."""
    for n in os.listdir(root) if clean else ():
        parsed = parse_drain_dir(n)
        if n.startswith(TRASH_PREFIX):
            shutil.rmtree(root / n, ignore_errors=True)  # a removal that a crash interrupted
            continue
        if parsed is None or parsed[1] == token or parsed[0] > step or not (root / n).is_dir():
            continue
        if (marked is not None and (root / n / f"{MARK_PREFIX}{marked}").exists()
                and not _settled(root, n, parsed[0], world, finish)):
            continue  # this rank did its part there; another may still be doing its own
        try:
            retire(root / n)
            log.info("gdswriter: removed %s, left by an interrupted drain", root / n)
        except FileNotFoundError:
            pass  # another rank removed it first (or committed it)
    d = root / drain_dir_name(step, token)
    d.mkdir(exist_ok=True)
    return d


def _settled(root: Path, name: str, step: int, world: int | None,
             finish: Callable[[int, Path, dict[int, dict]], bool] | None) -> bool:
    """Whether drain directory ``name`` of ``step``, which this rank marked, may be removed: once
    every rank of ``world`` marked it and the draft is in (no rank copies into it any more) and
    ``step`` is committed at the drain root (a step saved again after its drain: "not drained
    again"). A finished one whose step is not there (its last rank's publish failed, or it died
    before its rename; or it is renaming it now) is committed by ``finish`` first: any rank that
    finds every mark and the draft may commit it, and one rename wins. Every rank marked it, so
    without this no rank would ever remove it: a whole copy of the step left for good. "Every
    rank": of the world that saved the step (its draft's, _save_world), not of ``world``."""
    if world is None:
        return False
    try:
        marks = put_mark(root / name, None, {})
    except (OSError, GDSWriterError):
        return False  # gone (committed, or removed), or a mark that is not one: the rank writing it says so
    if marks is None or not (marks.complete(world) or max(marks.found, default=-1) >= world):
        return False  # a rank may still copy into it (else, where its save's world was another, kept as before)
    saved = _save_world(root / name)
    if saved is None:
        return False
    if not marks.complete(saved):  # a larger world's (the job restarted on fewer ranks: a node lost)
        return saved != world  # its ranks that did not mark are gone (ranks mark their own save's only): never commits
    final = root / step_dir_name(step) / MANIFEST_NAME
    if not final.is_file() and finish is not None:
        try:
            finish(step, root / name, marks.found)
        except (OSError, GDSWriterError) as e:
            log.warning("gdswriter: %s holds every rank's drain of step %d but could not be committed: %s",
                        root / name, step, e)
            return False
    return final.is_file()


def _save_world(d: Path) -> int | None:
    """The world size of the save that drain directory ``d`` is for: its draft's (GDSCheckpointer's
    global manifest, DCP's manifest: both say ``dist.world_size``). Every rank of *that* world must
    mark ``d`` before it may commit, whatever the world of the job draining now: a directory left by
    a larger world (the job restarted on fewer ranks) holds the marks of the new world's ranks and
    would otherwise be committed without the lost ranks' files. None: no readable draft."""
    try:
        body = json.loads(read_regular_file(d / DRAFT_NAME, SMALL_LIMIT))
        world = body["dist"]["world_size"]
    except (OSError, GDSWriterError, ValueError, KeyError, TypeError):
        return None  # gone (committed or removed), or not whole yet
    return world if type(world) is int and world >= 1 else None


@dataclass(frozen=True)
class DrainMarks:
    """What a rank's listing of a drain directory found just after its mark went in: each
    rank's mark (rank -> its JSON object) and whether the draft is there."""

    found: dict[int, dict]
    draft: bool

    def complete(self, world: int) -> bool:
        """Every rank of ``world`` marked and the draft is in: this rank may commit the step."""
        return self.draft and all(r in self.found for r in range(world))


def put_mark(d: Path, rank: int | None, mark: dict) -> DrainMarks | None:
    """Write rank ``rank``'s mark ``.drained-rank-R`` (``mark``, JSON) in the drain directory
    ``d`` durably (a fsynced temporary file renamed into place, so no mark is seen half written;
    the directory fsynced), then list the marks and the draft there. ``rank`` None: no mark, the
    caller just wrote the draft (DCP's rank 0). Shared by GDSCheckpointer's drain and DCP's.

    All through one descriptor of ``d``: once this mark is in, another rank may find every mark
    and rename ``d`` to ``step_S`` (a path would then fail with FileNotFoundError though the step
    is drained). Where ``rank`` is None, the draft is in before this call, so another rank
    marking then may have committed ``d`` before this rank opens it: None (committed, not by this
    rank). ``d`` gone and not committed stays FileNotFoundError (removed by another drain)."""
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        parsed = parse_drain_dir(d.name)
        if rank is None and parsed is not None and (d.parent / step_dir_name(parsed[0]) / MANIFEST_NAME).is_file():
            return None
        raise
    try:
        if rank is not None:
            tmp = f"{TMP_PREFIX}{MARK_PREFIX}{rank}-{secrets.token_hex(4)}"
            write_durable(tmp, json.dumps(mark).encode(), dir_fd=dfd)
            os.rename(tmp, f"{MARK_PREFIX}{rank}", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
        names = os.listdir(dfd)
        found = {int(n[len(MARK_PREFIX):]): _read_mark(dfd, n, d)
                 for n in names if n.startswith(MARK_PREFIX) and n[len(MARK_PREFIX):].isdigit()}
        return DrainMarks(found, DRAFT_NAME in names)
    finally:
        os.close(dfd)


def _read_mark(dfd: int, name: str, d: Path) -> dict:
    """A mark in the directory ``dfd`` (a small JSON object); DrainError where it is not one."""
    raw = read_regular_file(name, 4096, dir_fd=dfd)
    try:
        mark = json.loads(raw)
    except ValueError:
        mark = None
    if not isinstance(mark, dict):
        parsed = parse_drain_dir(d.name)
        raise DrainError(f"{d / name} is not a drain mark ({raw[:64]!r}): remove {d} (a drain in progress of "
                         f"another job on this drain root?)", parsed[0] if parsed else -1)
    return mark


def _committed_from(final: Path, found: dict[int, dict]) -> bool:
    """Whether ``final`` (step_S at the drain root) is committed and holds the marks ``found``
    (what this rank listed in its drain directory): that directory, renamed by another rank."""
    try:
        return (final / MANIFEST_NAME).is_file() and all(
            json.loads(read_regular_file(final / f"{MARK_PREFIX}{r}", 4096)) == mark for r, mark in found.items())
    except (OSError, ValueError, GDSWriterError):
        return False


class RankDrainer(Drainer):
    """Drainer of one rank of a multi-rank checkpointer (the module docstring). ``session``: the
    DistSession (its layout, and what each save of this rank voted: DistSession.saved)."""

    def __init__(self, session: Any, options: CheckpointOptions, engine: IOEngine | None = None):
        super().__init__(session.protocol, options, engine)
        self.session = session
        self.published: list[int] = []  # steps this rank committed at the drain root

    def drain_step(self, step: int, committed_at: float) -> DrainStats | None:
        """This rank's part of draining committed ``step`` (the module docstring); the step is
        committed at the drain root by whichever rank marks last."""
        t0 = time.perf_counter()
        layout, rank = self.session.layout, self.session.rank
        saved = self.session.saved.get(step)
        if saved is None:
            log.warning("gdswriter: step %d was not saved by this checkpointer: not drained", step)
            return None
        token, (g, name, size, crc) = saved
        local = layout.local_of(g)
        src = layout.local_paths[local] / step_dir_name(step)
        try:
            raw = read_regular_file(src / name, size + 1)
            if len(raw) != size or _crc32c.crc32c(raw) != crc:
                raise ChecksumMismatchError(str(src / name), "its manifest shard", 0, size, crc,
                                            _crc32c.crc32c(raw))
            shard = RankShard.from_json_bytes(raw, where=str(src / name), step=step, rank=rank,
                                              world_size=layout.world_size, n_roots=layout.root_count)
            draft = self._draft(step, crc) if rank == layout.primary_rank else None
        except FileNotFoundError:
            log.warning("gdswriter: step %d was deleted under %s before its drain: not drained", step, src.parent)
            return None
        except (GDSWriterError, OSError) as e:
            raise DrainError(f"step {step} is not drained to {self.root}: this rank's local copy is damaged ({e}); "
                             f"the drain root keeps its earlier steps", step) from e
        try:
            d = self._enter(step, token)
            self._copy_rank(shard, step, d)
            new = replace(shard, files=tuple(replace(f, root=0) for f in shard.files)).to_json_bytes()
            write_durable(d / shard_name(rank), new)
            if draft is not None:
                write_durable(d / DRAFT_NAME, draft)
            marks = put_mark(d, rank, {"size": len(new), "crc32c": _crc32c.crc32c(new)})
            if marks is not None and marks.complete(layout.world_size) and self._publish(step, d, marks.found):
                self.published.append(step)
                self._retain(step)
        except (GDSWriterError, OSError) as e:
            what = "its local copy is damaged" if isinstance(e, ChecksumMismatchError) else "copying failed"
            raise DrainError(f"step {step} is not drained to {self.root}: {what} on rank {rank} ({e}); the drain "
                             f"root keeps its earlier steps (drained: {self.target.latest()})", step) from e
        now = time.perf_counter()
        return DrainStats(step, sum(f.size for f in shard.files), now - t0, committed_at, now)

    def _enter(self, step: int, token: str) -> Path:
        """The drain's temporary directory for ``step`` (made by whichever rank comes first), after
        removing what other drains left for steps up to ``step`` (the module docstring)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.ident = root_identity(self.root, create=True)
        return enter_drain_dir(self.root, step, token, clean=True, marked=self.session.rank,
                               world=self.session.layout.world_size, finish=self._finish)

    def _finish(self, step: int, d: Path, found: dict[int, dict]) -> bool:
        """Commit an earlier step's finished drain directory ``d`` that no rank committed
        (enter_drain_dir: _settled); whether this rank's rename did."""
        done = self._publish(step, d, found)
        if done:
            self.published.append(step)
        return done

    def _copy_rank(self, shard: RankShard, step: int, into: Path) -> None:
        if self._engine is None:
            self._engine = create_engine(self.options.engine)
        if self._bufs is None:
            self._bufs = [torch.empty(DRAIN_BUFFER_BYTES, dtype=torch.uint8) for _ in range(2)]
        layout = self.session.layout
        per_file = shard.chunks_by_file()
        for fid, f in enumerate(shard.files):
            local = layout.local_of(f.root)
            if local is None:
                raise DrainError(f"step {step}: this rank's data file {f.path} is on a root it does not see", step)
            copy_checked(self._engine, layout.local_paths[local] / step_dir_name(step) / f.path, into / f.path,
                         f.size, per_file[fid], self._bufs)

    def _draft(self, step: int, crc: int) -> bytes:
        """The primary rank: the step's global manifest as committed locally, checked to be this
        save's (its entry for this rank is the shard this rank voted)."""
        path = self.session.protocol.step_dir(step) / MANIFEST_NAME
        raw = read_regular_file(path, SMALL_LIMIT)
        g = parse_global(raw, str(path))
        if g is None or g.shards[self.session.rank].crc32c != crc:
            raise DrainError(f"step {step}: {path} is not the manifest of the save this rank drains (the step was "
                             f"saved again?)", step)
        return raw

    def _published(self, final: Path, data: bytes) -> bool:
        try:
            return read_regular_file(final / MANIFEST_NAME, SMALL_LIMIT) == data
        except FileNotFoundError:
            return False

    def _publish(self, step: int, d: Path, found: dict[int, dict]) -> bool:
        """Every rank marked ``d`` and the draft is in it: write the drained global manifest and
        rename ``d`` to ``step_S`` (the commit point), then move ``latest``. Whether this rank's
        rename committed it (False: another rank, finding every mark too, renamed it first)."""
        world = len(found)
        final = self.root / step_dir_name(step)
        try:
            raw = read_regular_file(d / DRAFT_NAME, SMALL_LIMIT)
        except FileNotFoundError:
            if _committed_from(final, found):  # another rank found every mark too and renamed d first
                fsync_dir(self.root)
                return False
            if (final / MANIFEST_NAME).is_file():  # removed once finished (_settled): as FileExistsError below
                log.warning("gdswriter: step %d is already committed at %s: not drained again", step, self.root)
                return False
            raise  # gone, not committed: removed by another drain
        g = parse_global(raw, f"{d / DRAFT_NAME}")
        if g is None:
            raise DrainError(f"step {step}: {d / DRAFT_NAME} is not a global manifest", step)
        shards = tuple(ShardRef(r, 0, shard_name(r), found[r]["size"], found[r]["crc32c"]) for r in range(world))
        on_disk = g.totals.get("on_disk", 0) - sum(s.size for s in g.shards) + sum(s.size for s in shards)
        new = replace(g, roots=(RootInfo(self.ident.id, str(self.root), tuple(range(world))),), shards=shards,
                      totals=dict(g.totals, on_disk=on_disk))
        data = new.to_json_bytes()
        parse_global(data, f"the drained manifest of step {step}")
        try:
            tmp_manifest = d / f"{TMP_PREFIX}{MANIFEST_NAME}-{secrets.token_hex(4)}"
            write_durable(tmp_manifest, data)
            os.replace(tmp_manifest, d / MANIFEST_NAME)
            fsync_dir(d)  # every rank's files, shards and marks, and the manifest: durable before the rename
            if final.exists():
                raise FileExistsError(errno.EEXIST, "already drained", str(final))
            os.rename(d, final)  # the commit point
        except OSError as e:
            if self._published(final, data):  # another rank found every mark too and renamed it first
                fsync_dir(self.root)
                return False
            if isinstance(e, FileExistsError) or (final / MANIFEST_NAME).is_file():  # (d superseded meanwhile)
                log.warning("gdswriter: step %d is already committed at %s: not drained again", step, self.root)
                return False
            raise DrainError(f"step {step} is not drained to {self.root}: its temporary directory vanished before "
                             f"it was committed (removed by another drain?) ({e})", step) from e
        fsync_dir(self.root)
        try:
            named = self.target.latest_named()
            if named is None or named < step or not self.target.is_committed(named):
                atomic_write(self.root / LATEST_NAME, f"{step}\n".encode())
        except OSError as e:
            log.warning("gdswriter: step %d is drained to %s, but latest could not be updated: %s", step,
                        self.root, e)
        return True
