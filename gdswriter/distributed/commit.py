"""The commit protocol of a multi-rank step: format/commit.py's protocol, spread over ranks.

Step S, with roots in the table every rank agrees on (roots.py; the primary first). P is the
*primary rank*, the leader of the primary root: rank 0, unless the roots were opened with
rank 0 on another node than the primary's disk (roots.py ``choose_primary``):

1. each root's leader makes ``.tmp-step_S-<token>`` on it (a fresh token: the name never
   existed before) and, on a secondary root, writes ``primary-root`` and ``primary-id`` into
   it. Where ranks share a root, the others do not create that directory: after one
   collective they must find it in their own root (a root copied with its ``.gdswriter-root``
   marker is another directory with the same id, and would not have it), and every rank
   learns in a second collective whether all did, before any data is written. A crash here
   leaves empty temporary directories (removed at the next open). Then every rank writes its
   own data files there, each fdatasynced, and (a GDSCheckpointer save, format 1.3) its
   manifest shard, fsynced: it is published with the directory, like the data;
2. vote: P gathers every rank's outcome (a GDSCheckpointer save: its shard's name, size and
   crc32c and digests of what it holds, a few hundred bytes; save.py checks them); each
   secondary root's leader first checks that a ``step_S`` already there was written for this
   primary (one of another checkpoint is refused: nothing is un-committed). On any failure P
   tells every rank, each root's leader removes the temporary directory, and every rank
   raises. When step S is already committed, P un-commits it here (primary first, as
   commit.py does); a primary ``step_S`` without a manifest that another primary wrote (its
   secondary data) is refused, never removed;
3. each root's leader fsyncs its temporary directory (every rank's files are in it now); on a
   secondary root it renames it to ``step_S`` and fsyncs the root. P gathers the outcome;
4. P writes manifest.json (a 1.3 step's global manifest: the shard list) into the primary's
   temporary directory (fsync) and renames it to ``step_S``: the commit point. If the root's
   fsync then fails, P un-commits the step (retires the primary ``step_S``) before reporting
   the failure, so that no visible step loses its secondary data; if it cannot, the step stays
   committed (with a warning);
5. announce: P tells every rank whether the step committed; then ``latest`` moves (a
   failure there is logged: the step is committed, readers fall back to the newest step).

Only P receives what grows with the world (the gathered outcomes); every decision it sends
is of fixed size (group.py ``bounded``: at most a few failed ranks named, the rest counted).

A rank that dies or hangs makes a collective fail (CollectiveFailedError on the others,
within the timeout) before step 4, so nothing is committed and the previous step stays the
latest; what the failed save left (temporary directories, secondary ``step_S`` without a
primary manifest) is removed when the roots are next opened.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Callable

from ..errors import EngineIOError, GDSWriterError, RankFailedError, RootUnavailableError
from ..format.commit import LATEST_NAME, ROOT_MARKER_NAME, TMP_PREFIX, retire, step_dir_name, step_dirs, step_owner
from ..fs import atomic_write, fsync_dir
from ..format.manifest import MANIFEST_NAME, Manifest
from .group import Coordinator, bounded, describe, unbound
from .rankfiles import save_tag
from .roots import RootLayout, owned, write_owner_files

log = logging.getLogger("gdswriter")


def _io_error(e: OSError, path: Path, what: str) -> EngineIOError:
    """``e`` as an EngineIOError (kept if it is one), its cause kept for when it is raised later."""
    if isinstance(e, EngineIOError):
        return e
    err = EngineIOError(e.errno or errno.EIO, e.filename or path, 0, what)
    err.__cause__ = e
    return err


def _raise_io(e: OSError, path: Path, what: str) -> None:
    """Raise ``e`` as an EngineIOError (as it is if it is one)."""
    err = _io_error(e, path, what)
    if err is e:
        raise e
    raise err from e


class RankCommit:
    """This rank's part of committing step ``step``: ``dirs`` (one temporary directory per local
    root) to write into, then vote(), commit() on the primary rank (``coordinates``), announce().
    Collective from the start: with shared roots, construction runs step 1's two collectives.
    ``failed``: an error this rank hit before (its roots' lock, their cleaning): it makes no
    directory and reports the error in the vote."""

    def __init__(self, coord: Coordinator, layout: RootLayout, step: int, token: str,
                 failed: BaseException | None = None):
        self.coord, self.layout, self.step = coord, layout, step
        self.what = f"saving step {step}"
        self.p = layout.primary_rank
        self.coordinates = coord.rank == self.p
        self.primary_index = layout.local_of(0)  # where this rank sees the primary (the primary rank does)
        name = f"{TMP_PREFIX}{step_dir_name(step)}-{token}"
        self.dirs = [root / name for root in layout.local_paths]
        self.setup_error: BaseException | None = failed  # reported in the vote, never raised alone
        self.local_error: BaseException | None = None  # a failure of this rank's step 3
        self.renamed: list[Path] = []
        self.secondary_failures: dict[int, str] = {}
        self.committed = False
        self.keep_secondaries = False  # primary rank: a failure after the commit rename keeps secondary step_S
        d = self.dirs[0]
        try:
            for i, d in enumerate(self.dirs if failed is None else []):
                if layout.leads(i):  # only the leader creates it: the others must find it (step 1)
                    d.mkdir()
                    if not layout.is_primary(i):
                        write_owner_files(layout, d)
        except OSError as e:
            self.setup_error = _io_error(e, d, "mkdir")
        if layout.shares_roots:
            self._check_shared()

    def _check_shared(self) -> None:
        """Step 1 where ranks share roots: after the leaders made the temporary directories, every
        rank finds each one it does not lead in its own root, and all learn whether every rank did
        (a failure becomes this rank's setup_error: the rank writes nothing and reports it in the
        vote). Two rounds of Coordinator.agree: a fixed-size answer for every rank."""
        try:
            self.coord.agree(self.setup_error, f"{self.what} (temporary directories)", root=self.p)
            problem = next((self._not_shared(i) for i, d in enumerate(self.dirs)
                            if not self.layout.leads(i) and not d.is_dir()), None)
            self.coord.agree(problem, f"{self.what} (shared roots)", root=self.p)
        except Exception as e:  # noqa: BLE001 - its own error, another rank's, or a failed collective
            self.setup_error = self.setup_error or e

    def _not_shared(self, i: int, outcome: str = "nothing was written for step {step}") -> RootUnavailableError:
        g = self.layout.local_to_global[i]
        info, mine = self.layout.root(g), self.layout.local_paths[i]
        return RootUnavailableError(
            errno.EEXIST,
            f"checkpoint root {mine} (rank {self.coord.rank}) and root {info.path} (rank {self.layout.leader(g)}) "
            f"carry the same identity (id {info.id} in {ROOT_MARKER_NAME}), so gdswriter took them for one shared root, but "
            f"they are two directories: the temporary directory rank {self.layout.leader(g)} just made there "
            f"({self.dirs[i].name}) is not in {mine}. One is probably a copy (rsync -a, cp -a, a machine image). Give "
            f"the copy its own identity: empty it, or remove its {ROOT_MARKER_NAME} (a new id is written when it is "
            f"next opened; move its step directories away first if you keep them); "
            f"{outcome.format(step=self.step)}")

    # -- 2 and 3 -----------------------------------------------------------------
    def vote(self, outcome: Any, check: Callable[[list[Any]], tuple[dict[int, str], str] | None] | None = None
             ) -> list[Any] | None:
        """Collective. ``outcome`` is what this rank reports to the primary rank (JSON), or the
        exception that stopped it. Returns every rank's report there, None elsewhere; raises on every
        rank if any rank failed. Then the secondary roots are renamed (step 3). ``check`` (the
        primary rank, when every rank succeeded): (failures, hint) that refuse the reports together.
        Only the primary receives the reports; the decision every rank receives is bounded."""
        error = self.setup_error or (outcome if isinstance(outcome, BaseException) else None)
        if error is None:
            error = self._secondary_final_error()
        try:
            gathered = self.coord.gather({"error": describe(error)} if error else {"report": outcome},
                                         f"{self.what} (vote)", dst=self.p)
            failures: dict[int, str] = {}
            hint = None
            if self.coordinates:
                assert gathered is not None
                failures, hint, error = self._decide(gathered, check, error)
            decision = self.coord.broadcast({**bounded(failures), "hint": hint}, f"{self.what} (decision)",
                                            src=self.p)
        except BaseException:
            self.abort()
            raise
        self._raise_if_refused(decision, error)
        self._rename_secondaries()
        return [x["report"] for x in gathered] if gathered is not None else None

    def _secondary_final_error(self) -> BaseException | None:
        """This rank's refusal of a secondary ``step_S`` of another checkpoint (_check_secondary_final),
        found before the primary un-commits anything; None when there is none."""
        try:
            for i in self.layout.led:
                if not self.layout.is_primary(i):
                    self._check_secondary_final(i)
        except OSError as e:
            return _io_error(e, self.dirs[i], "commit")
        return None

    def _decide(self, gathered: list[Any], check: Callable[[list[Any]], tuple[dict[int, str], str] | None] | None,
                error: BaseException | None) -> tuple[dict[int, str], str | None, BaseException | None]:
        """The primary rank: (failures by rank, hint, this rank's error) from every rank's vote and
        ``check``. When nothing fails, an old committed ``step_S`` is un-committed first; a failure to
        do so is this rank's error."""
        assert self.primary_index is not None
        failures = {r: x["error"] for r, x in enumerate(gathered) if "error" in x}
        hint = None
        if not failures and check is not None:
            refused = check([x["report"] for x in gathered])
            if refused is not None:
                failures, hint = refused
        final = self.layout.local_paths[self.primary_index] / step_dir_name(self.step)
        if not failures and final.exists():
            try:
                self._check_primary_final(final)
                retire(final)  # re-saving step S: un-commit the old one first
            except OSError as e:
                error = _io_error(e, final, "un-commit the old step")
                failures = {self.coord.rank: describe(error)}
        return failures, hint, error

    def _raise_if_refused(self, decision: dict, error: BaseException | None) -> None:
        """Every rank, when the decision names failures: abort, and raise the check's refusal (with
        its hint), this rank's own error, or a RankFailedError naming the ranks that failed."""
        shown, total = unbound(decision)
        if not total:
            return
        self.abort()
        if decision["hint"] is not None:
            raise RankFailedError(self.what, shown, decision["hint"], total=total)
        if error is not None:
            raise error
        raise RankFailedError(self.what, shown, total=total)

    def _rename_secondaries(self) -> None:
        """Step 3: the temporary directories this rank leads are synced and its secondary roots'
        renamed into place; the primary rank receives each rank's failure (secondary_failures)."""
        try:
            for i in self.layout.led:
                fsync_dir(self.dirs[i])
            for i in self.layout.led:
                if not self.layout.is_primary(i):
                    self._publish_secondary(i)
        except OSError as e:
            self.local_error = _io_error(e, self.dirs[0], "commit")
        statuses = self.coord.gather(describe(self.local_error) if self.local_error else None,
                                     f"{self.what} (secondary roots)", dst=self.p)  # only the primary receives
        if statuses is not None:
            self.secondary_failures = {r: s for r, s in enumerate(statuses) if s is not None}

    def _check_secondary_final(self, i: int) -> None:
        """Refuse (EngineIOError EEXIST) a secondary ``step_S`` that was not written for this
        checkpoint's primary: it is another checkpoint's data (or a primary's committed step)."""
        final = self.layout.local_paths[i] / step_dir_name(self.step)
        if final.exists() and not owned(self.layout, final):
            raise EngineIOError(errno.EEXIST, final, 0, "commit",
                                f"it holds step {self.step} of another checkpoint (not written for primary "
                                f"root {self.layout.primary_identity}, id {self.layout.primary_id}); nothing was "
                                f"changed: give each checkpoint its own directory on every root")

    def _check_primary_final(self, final: Path) -> None:
        """Refuse (EngineIOError EEXIST) to un-commit a primary ``step_S`` that holds no manifest
        but names another primary root: it is that primary's secondary data, not a step of ours."""
        if (final / MANIFEST_NAME).exists():
            return
        path, owner_id = step_owner(final)
        if (path, owner_id) != (None, None) and not owned(self.layout, final):
            raise EngineIOError(errno.EEXIST, final, 0, "commit",
                                f"it is not a step of this checkpoint but step {self.step}'s secondary data of "
                                f"another primary root (id {owner_id or 'not recorded'}, at {path}); nothing was "
                                f"changed: is rank 0 on another node than when it was saved? Open the checkpoint "
                                f"with that primary's node in the job, or move the directory away yourself")

    def _publish_secondary(self, i: int) -> None:
        final = self.layout.local_paths[i] / step_dir_name(self.step)
        if final.exists():
            self._check_secondary_final(i)
            retire(final)
        os.rename(self.dirs[i], final)
        fsync_dir(self.layout.local_paths[i])
        self.renamed.append(final)

    def check_secondaries(self) -> None:
        """The primary rank: raise if a secondary root could not be published (nothing is committed)."""
        if self.secondary_failures:
            self.abort()
            if self.local_error is not None:
                raise self.local_error
            raise RankFailedError(f"{self.what} (secondary roots)", self.secondary_failures)

    # -- 4 and 5 -----------------------------------------------------------------
    def commit_manifest(self, manifest: Manifest) -> None:
        """The primary rank: commit the step with ``manifest``, once its JSON has been read back: a step is never
        committed with a manifest that cannot load."""
        data = manifest.to_json_bytes()
        Manifest.from_json_bytes(data, where=f"the manifest of step {self.step}")
        self.commit(data)

    def commit(self, manifest_bytes: bytes) -> None:
        """The primary rank: write the manifest and make the step visible (the commit point)."""
        if not self.coordinates or self.primary_index is None:
            raise GDSWriterError(f"internal: rank {self.coord.rank} cannot commit step {self.step}: the primary "
                                 f"root is rank {self.p}'s")
        self.check_secondaries()
        primary = self.layout.local_paths[self.primary_index]
        final = primary / step_dir_name(self.step)
        try:
            atomic_write(self.dirs[self.primary_index] / MANIFEST_NAME, manifest_bytes)
            os.rename(self.dirs[self.primary_index], final)
        except OSError as e:
            self.abort()
            if isinstance(e, EngineIOError):
                raise
            raise EngineIOError(e.errno or errno.EIO, e.filename or primary, 0, "commit") from e
        try:
            fsync_dir(primary)
        except OSError as e:
            # The step is visible, but whether the rename is durable is unknown: un-commit it, and keep
            # the secondary step_S directories (announce() leaves them; the next open removes them
            # unless the rename turns out to have survived), so no step can be visible without its data.
            self.keep_secondaries = True
            try:
                retire(final)
            except OSError as e2:
                if final.exists():  # still visible: it stays committed, with all its data
                    self.committed = True
                    log.warning("gdswriter: step %d is committed under %s, but fsync of the root failed (%s) and "
                                "it could not be un-committed (%s): it may not survive a power cut; check the "
                                "drive", self.step, primary, e, e2)
                    return
            raise EngineIOError(e.errno or errno.EIO, e.filename or primary, 0, "commit (fsync of the root)",
                                "the step was un-committed; check the drive (dmesg) and save again") from e
        self.committed = True

    def move_latest(self) -> None:
        """The primary rank, after the commit: point ``latest`` at the step. A failure is logged, not raised:
        the step is committed (``latest`` only names the default step to load, as after a crash
        between the commit and ``latest``: docs/format.md section 6)."""
        assert self.primary_index is not None
        latest = self.layout.local_paths[self.primary_index] / LATEST_NAME
        try:
            atomic_write(latest, f"{self.step}\n".encode())
        except OSError as e:
            log.warning("gdswriter: step %d is committed, but %s could not be updated (%s): a load without a step "
                        "picks the step it still names until a later save moves it; check the drive", self.step,
                        latest, e)

    def announce(self, error: BaseException | None) -> None:
        """Collective: the primary rank's outcome (``error`` there) reaches every rank; all raise if the step
        was not committed (secondary directories renamed in step 3 are removed again, unless the
        failure came after the commit rename: then the next open decides, see commit())."""
        failures = None
        if self.coordinates and error is not None:
            failures = self.secondary_failures or {self.coord.rank: describe(error)}
        msg = self.coord.broadcast({**bounded(failures or {}), "keep": self.keep_secondaries},
                                   f"{self.what} (commit)", src=self.p)
        shown, total = unbound(msg)
        if not total:
            return
        if not msg["keep"]:
            for path in self.renamed:
                shutil.rmtree(path, ignore_errors=True)
        self.abort()
        if error is not None:
            raise error
        if self.local_error is not None:
            raise self.local_error
        raise RankFailedError(self.what, shown, total=total)

    def abort(self) -> None:
        """Remove the temporary directories this rank leads (best effort; the next open cleans the rest)."""
        for i in self.layout.led:
            shutil.rmtree(self.dirs[i], ignore_errors=True)


JOINED_PREFIX = ".written-rank-"  # in a joint root's step directory: rank r's files there are durable


class OrderedCommit(RankCommit):
    """The same steps inside a caller's own ordered protocol (DCP's), with no collective of its
    own: P (the coordinator) decides step and token and makes its temporary directories
    (``make_dirs``) before any other rank starts (DCP scatters the plans after that); every
    other rank makes those it leads, checks that it finds P's (``check_shared``, step 1's check
    for a copied root), writes, and publishes the secondary roots it leads (``publish_led``:
    fsync, rename, fsync of the root) before it reports (DCP gathers the reports before P's
    ``commit_ordered``).

    A *joint* root (several ranks see it and another rank than P leads it: one SSD per node
    shared by that node's ranks) has no rank that runs after all the others' writes, so every
    rank sharing it does steps 1 and 3 there itself ("the last one publishes"):

    1. whichever rank comes first makes the temporary directory: each makes
       ``<tmp>.join-<rank>`` with the owner files and renames it to ``<tmp>``; a rank that finds
       ``<tmp>`` made already removes its own and uses that one (its leader cleans the root
       before, keeping the entries of this save's token). A crash here leaves temporary
       directories (removed by the next cleaning);
    2. after its files there are durable, each rank creates ``.written-rank-<r>`` in ``<tmp>``
       (O_EXCL) and fsyncs ``<tmp>``, then lists it; a rank that finds the markers of all the
       ranks sharing the root (their count travels in its part of the root table) checks that a
       ``step_S`` there is not another checkpoint's, renames ``<tmp>`` to ``step_S`` and fsyncs
       the root. Two ranks may both see every marker: the second rename finds its source gone;
       that rank checks that ``step_S`` holds every marker and fsyncs the root itself. A crash
       before the rename leaves a temporary directory (removed by the next cleaning); after it,
       a secondary ``step_S`` without a committed manifest (removed by the next cleaning, as a
       secondary step directory of a failed vote is);
    3. each rank's report names the joint roots it published (``publish_led``'s result); P's
       ``check_published`` refuses to commit unless some rank published every joint root of
       the table. A root copied with its ``.gdswriter-root`` marker (the same id in two
       directories) splits its ranks: no directory gets every marker, nobody publishes it, and
       the save is refused (RootUnavailableError naming the root), nothing committed.

    The markers stay in the committed step directory (tiny, empty files no manifest lists:
    loading, ``gdswriter verify`` and cleaning read only what the manifest names, or whole
    step directories).

    **Re-saving a committed step S** (``resaving``) on a secondary root that another rank than
    P leads (its own, or a joint root): that rank may not replace the committed ``step_S``
    there, since a re-save that fails must leave the old step whole, and no rank runs after P's
    commit to do it later. So it writes *beside* the old files, in the committed ``step_S``
    itself (``in_place``): its data files' names carry the save's token
    (``data-rank<r>-r<g>-f<k>.<token>.bin``, rankfiles.rank_targets), so none is an old one;
    it fdatasyncs them and fsyncs the directory, and on a joint root marks
    ``.written-rank-<r>.<token>`` as in step 2, the rank finding every rank's mark publishing
    it without a rename. The old manifest names only the old files, the new one only the new:
    until P's commit the old step loads as it was; after it, the new one. A crash or a failure
    anywhere leaves files no committed manifest names in a committed step directory: the ranks
    say where they wrote beside a step (and, opening their roots, where they find files of two
    saves in one), P sends each root's leader the names the committed manifest lists there, and
    the leader removes the others (``clean_resaved``) at the next save, before it writes.

    Only for a layout where P leads the primary root (dcp.py refuses any other when it opens
    the roots: rank 0 commits); every other root is P's, a joint root, or one rank's own (step
    1 is then ordered by the plans' scatter or by the rank itself, step 3 by the reports'
    gather). A failure on any rank makes DCP skip
    ``commit_ordered`` and raise on every rank: nothing is committed; what the save left
    (temporary directories, secondary ``step_S`` without a primary manifest, files beside a
    committed step) is removed when the roots are next cleaned."""

    def __init__(self, coord: Coordinator, layout: RootLayout, step: int, token: str, *,  # noqa: D107 - no collective
                 resaving: bool = False):
        self.coord, self.layout, self.step, self.token = coord, layout, step, token
        self.what = f"saving step {step}"
        self.p = layout.primary_rank
        self.coordinates = coord.rank == self.p
        self.primary_index = layout.local_of(0)
        name = f"{TMP_PREFIX}{step_dir_name(step)}-{token}"
        self.dirs = [root / name for root in layout.local_paths]
        self.setup_error = self.local_error = None
        self.renamed: list[Path] = []
        self.secondary_failures: dict[int, str] = {}
        self.committed = False
        self.keep_secondaries = False
        self.in_place: set[int] = set()  # local roots written beside a committed step_S (class docstring)
        if resaving and not self.coordinates:
            for i, root in enumerate(layout.local_paths):
                final = root / step_dir_name(step)
                if ((layout.leads(i) or self.joint(i)) and not layout.is_primary(i) and not final.is_symlink()
                        and final.is_dir() and owned(layout, final)):
                    self.in_place.add(i)
                    self.dirs[i] = final

    def joint(self, i: int) -> bool:
        """Whether local root ``i`` is a joint root: several ranks see it, and P does not lead it."""
        return self.layout.sharers(i) > 1 and self.layout.leader(self.layout.local_to_global[i]) != self.p

    def make_dirs(self) -> None:
        """Step 1 on the roots this rank leads (secondary ones get their owner files) and on its
        joint roots (class docstring)."""
        d = self.dirs[0]
        try:
            for i, d in enumerate(self.dirs):
                if i in self.in_place:
                    continue  # the committed step_S itself
                if self.joint(i):
                    self._join(i)
                elif self.layout.leads(i):
                    d.mkdir()
                    if not self.layout.is_primary(i):
                        write_owner_files(self.layout, d)
        except OSError as e:
            self.abort()
            _raise_io(e, d, "mkdir")

    def _join(self, i: int) -> None:
        """Make joint root ``i``'s temporary directory, with its owner files, unless another rank
        sharing the root made it first (then use that one)."""
        d = self.dirs[i]
        mine = d.with_name(f"{d.name}.join-{self.coord.rank}")
        mine.mkdir()
        write_owner_files(self.layout, mine)
        try:
            os.rename(mine, d)  # fails when d exists: it holds owner files, it is never empty
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not d.is_dir():
                raise
            shutil.rmtree(mine, ignore_errors=True)

    def check_shared(self) -> None:
        """Step 1's check on the roots P leads and this rank shares: P's directory is in each."""
        for i, d in enumerate(self.dirs):
            if not self.layout.leads(i) and not self.joint(i) and not d.is_dir():
                raise self._not_shared(i, "this rank wrote nothing, and step {step} is not committed")

    def publish_led(self) -> list[int]:
        """Step 3 on the secondary roots this rank leads, once its own files are durable: refuse
        a ``step_S`` of another checkpoint there, fsync, rename to ``step_S``, fsync the root;
        then on its joint roots (class docstring). Returns the table indices of the joint roots
        this rank published. On a failure the directories this rank made or renamed are removed
        and it raises."""
        i = 0
        published: list[int] = []
        try:
            led = [i for i in self.layout.led if not self.layout.is_primary(i) and not self.joint(i)]
            for i in led:
                self._check_secondary_final(i)
            for i in led:
                fsync_dir(self.dirs[i])
            for i in led:
                if i not in self.in_place:  # in place: the files' names are durable in step_S now
                    self._publish_secondary(i)
            for i in range(len(self.dirs)):
                if self.joint(i) and self._publish_joint(i):
                    published.append(self.layout.local_to_global[i])
        except OSError as e:
            self._undo()
            _raise_io(e, self.dirs[i], "commit")
        return published

    @staticmethod
    def _markers(d: Path | int, tag: str = "") -> int:
        """The ranks' marks in ``d``: untagged ones (a fresh temporary directory), or those of the
        save whose token is ``tag`` (beside a committed step)."""
        suffix = f".{tag}" if tag else ""
        return sum(1 for n in os.listdir(d) if n.startswith(JOINED_PREFIX) and n.endswith(suffix)
                   and n[len(JOINED_PREFIX):len(n) - len(suffix)].isdigit())

    def _publish_joint(self, i: int) -> bool:
        """Joint root ``i``: record that this rank's files are durable; publish the directory if
        every rank sharing the root has (class docstring, step 2). Whether this rank published it.
        The marker, the fsync and the count go through one descriptor of the directory: another
        rank may rename it as soon as this rank's marker is in it, and this rank's fsync must
        still reach it (before this rank reports, so before any commit)."""
        d, root = self.dirs[i], self.layout.local_paths[i]
        final = root / step_dir_name(self.step)
        n = self.layout.sharers(i)
        tag = self.token if i in self.in_place else ""
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.close(os.open(f"{JOINED_PREFIX}{self.coord.rank}{f'.{tag}' if tag else ''}",
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644, dir_fd=dfd))
            os.fsync(dfd)  # this rank's files and its marker: their entries are durable now
            if self._markers(dfd, tag) < n:
                return False  # a rank sharing the root has not marked yet: the last one publishes
        finally:
            os.close(dfd)
        if tag:
            return True  # beside a committed step: every rank's files are durable in it, nothing to rename
        try:
            self._check_secondary_final(i)
            os.rename(d, final)
            self.renamed.append(final)
        except FileNotFoundError:
            pass  # another rank sharing the root saw every marker too, and renamed it first
        if not final.is_dir() or self._markers(final) < n:
            raise EngineIOError(errno.ENOENT, d, 0, "commit",
                                f"the temporary directory of step {self.step} on a root {n} ranks share vanished "
                                f"before every rank's files were in it")
        fsync_dir(root)
        return True

    def check_published(self, reports: list[dict]) -> None:
        """P, before committing: every joint root of the table was published by a rank that saw
        every marker in it (reports' ``published``). RootUnavailableError otherwise (nothing is
        committed): a root copied with its identity marker splits its ranks so that none does."""
        done = {g for rep in reports for g in rep.get("published", ())}
        for g, info in enumerate(self.layout.table):
            if len(info.ranks) > 1 and min(info.ranks) != self.p and g not in done:
                self.abort()
                raise RootUnavailableError(
                    errno.EEXIST,
                    f"checkpoint root {info.path} (id {info.id}), which ranks {list(info.ranks)[:8]} take for one "
                    f"root they share, was not published: no rank found in it the files of all "
                    f"{len(info.ranks)} ranks. Its ranks see two (or more) directories with the same identity "
                    f"(id {info.id} in {ROOT_MARKER_NAME}): one is probably a copy (rsync -a, cp -a, a machine "
                    f"image). Give the copy its own identity: empty it, or remove its {ROOT_MARKER_NAME} (a new "
                    f"id is written when it is next opened; move its step directories away first if you keep "
                    f"them); step {self.step} is not committed")

    def commit_ordered(self, manifest: Manifest) -> None:
        """P, after every rank's publish_led (the caller orders it): steps 2-4 on P's roots: its
        secondary roots checked, a committed step S un-committed (primary first), P's temporary
        directories fsynced (every rank's files are in them now), its secondary roots renamed,
        then the manifest written and the step made visible. Raises, having undone what it can,
        when the step could not be committed."""
        final = self.layout.local_paths[self.primary_index] / step_dir_name(self.step)
        try:
            for i in self.layout.led:
                if not self.layout.is_primary(i):
                    self._check_secondary_final(i)
            if final.exists():
                self._check_primary_final(final)
                retire(final)  # re-saving step S: un-commit the old one first
            self.publish_led()
            fsync_dir(self.dirs[self.primary_index])
        except OSError as e:
            self._undo()
            _raise_io(e, final, "commit")
        try:
            self.commit_manifest(manifest)
        except BaseException:
            if not self.keep_secondaries and not self.committed:
                self._undo()
            raise

    def _undo(self) -> None:
        for path in self.renamed:
            shutil.rmtree(path, ignore_errors=True)
        self.renamed = []
        self.abort()

    def abort(self) -> None:
        """Remove the temporary directories this rank leads, and what it wrote beside a committed
        step (its files and marks of this save: never the committed ones; best effort, as
        clean_resaved removes what is left at the next save)."""
        for i in self.layout.led:
            if i not in self.in_place:
                shutil.rmtree(self.dirs[i], ignore_errors=True)
        mine = f"data-rank{self.coord.rank}-"
        for i in self.in_place:
            try:
                for name in os.listdir(self.dirs[i]):
                    if (name.startswith(mine) and save_tag(name) == self.token
                            or name == f"{JOINED_PREFIX}{self.coord.rank}.{self.token}"):
                        os.unlink(self.dirs[i] / name)
            except OSError:
                pass


def saves_beside(root: Path) -> list[int]:
    """The steps on ``root`` whose directory holds the multi-rank data files of more than one save
    (OrderedCommit, re-saving beside a committed step): those of a failed re-save, or the old
    ones a re-save replaced. Reads only."""
    out = []
    for step, d in step_dirs(root):
        try:
            tags = {t for n in os.listdir(d) for t in [save_tag(n)] if t is not None}
        except (FileNotFoundError, NotADirectoryError):
            continue
        if len(tags) > 1:
            out.append(step)
    return out


def clean_resaved(layout: RootLayout, live: list, keep: str) -> list[Path]:
    """On the secondary roots this rank leads, remove from each committed step directory of
    ``live`` ([root id, step, the names of the data files the committed manifest lists there])
    every other multi-rank data file and every rank's mark, except those of the current save
    (token ``keep``: its ranks may be writing beside that step already). Only names of the forms
    rank_targets and OrderedCommit make are touched; a directory not of this checkpoint is left
    alone. Call while holding the root's lock. Returns what it removed."""
    where = {ident: i for i, ident in enumerate(layout.local_ids)}
    removed: list[Path] = []
    for rid, step, names in live:
        i = where.get(rid)
        if i is None or not layout.leads(i) or layout.is_primary(i):
            continue
        d = layout.local_paths[i] / step_dir_name(step)
        if d.is_symlink() or not d.is_dir() or not owned(layout, d):
            continue
        listed = set(names)
        gone = []
        for name in os.listdir(d):
            tag = save_tag(name)
            if (tag is not None and tag != keep and name not in listed
                    or name.startswith(JOINED_PREFIX) and not name.endswith(f".{keep}")):
                (d / name).unlink(missing_ok=True)
                gone.append(d / name)
        if gone:
            fsync_dir(d)
            removed += gone
    if removed:
        log.info("gdswriter: rank %d removed %d file(s) of earlier saves beside committed steps", layout.rank,
                 len(removed))
    return removed
