"""Format 1.4's replicas, the reading side: where the copies of a rank's files lie, and a step's
global manifest with some ranks' files taken from a copy instead of their own roots.

The global manifest's optional ``"replicas": [[g, ...], ...]`` lists, for each rank r, the
table roots that hold a copy of r's shard and of every data file it names, in the order a
reader tries them (r's own root is never listed). On root g the copy lies in
``step_S/copies/rank<RRRRR>/`` under the original names, byte for byte, so the crc32c values
the global manifest (shard refs) and the shard (chunks) record check it. docs/format.md 10.

A copy is read by pointing rank r's ShardRef at it (``copy_ref``: the shard's name is then
``copies/rank<RRRRR>/manifest-rank<RRRRR>.json`` on root g): sharded.parse_shard puts the
files such a shard names beside it, on its root, so every reader downstream (the own-shard
load, the reshard plan, the merge, the fetch) reads the copy without knowing it is one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import crc32c as _crc32c

from ..errors import (CheckpointLockedError, CheckpointNotFoundError, CorruptCheckpointError, GDSWriterError,
                      UnreachableDataError)
from ..fs import (TMP_PREFIX, atomic_write, fsync_dir, link_no_clobber, read_regular_file, unlink_durably,
                  write_durable)
from .commit import TRASH_PREFIX, step_dir_name, step_dirs
from .parity import PARITY_DIR, REFILLING_NAME
from .replicas import COPIES_DIR, PROTECTED_NAME, copy_dir_name
from .manifest import MANIFEST_MAX_BYTES, MANIFEST_NAME, Manifest
from .sharded import (GlobalManifest, ShardRef, match_roots, merge, parse_global, parse_shard, parse_step, read_shard,
                      shard_name)

log = logging.getLogger("gdswriter")


def copy_dir(rank: int) -> str:
    """The folder, relative to a step directory, holding the copy of rank ``rank``'s files."""
    return f"{COPIES_DIR}/{copy_dir_name(rank)}"


def copy_ref(ref: ShardRef, root: int) -> ShardRef:
    """``ref`` (rank r's shard) moved to its copy on table root ``root``: the same bytes."""
    return ShardRef(ref.rank, root, f"{copy_dir(ref.rank)}/{shard_name(ref.rank)}", ref.size, ref.crc32c)


def replicas_of(g: GlobalManifest, where: str) -> tuple[tuple[int, ...], ...] | None:
    """The ``replicas`` of the global manifest ``g`` (parsed and checked as untrusted input with
    it: one entry per rank, table roots in range, none repeated, at most MAX_COPY_ROOTS), with the
    one rule the parse leaves to the reader: no entry names its rank's own shard root. None: a
    step saved without replicas (format 1.3)."""
    if g.replicas is None:
        return None
    for r, row in enumerate(g.replicas):
        if g.shards[r].root in row:
            raise CorruptCheckpointError(f"{where}: its replicas of rank {r} name its own root "
                                         f"({g.shards[r].root}); the checkpoint is damaged: load an earlier step")
    return g.replicas


class CopiedShards(Sequence[ShardRef]):
    """A step's shard refs with some ranks' moved to a copy (rank -> copy ref); the others are
    the manifest's own, looked up when asked (nothing per rank is built)."""

    def __init__(self, shards: Sequence[ShardRef], moved: Mapping[int, ShardRef]):
        self.shards, self.moved = shards, dict(moved)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        hit = self.moved.get(i)
        return hit if hit is not None else self.shards[i]


def with_copies(g: GlobalManifest, choice: Mapping[int, int]) -> GlobalManifest:
    """``g`` with rank r's shard, and so its files, read from the copy on root ``choice[r]``."""
    if not choice:
        return g
    moved = {r: copy_ref(g.shards[r], root) for r, root in choice.items()}
    return GlobalManifest(g.step, g.world_size, g.roots, CopiedShards(g.shards, moved), g.metadata, g.created_unix,
                          g.totals, g.layout_index, g.replicas)


def describe_root(g: GlobalManifest, root: int) -> str:
    info = g.roots[root]
    return f"root #{root} ({info.path}, id {info.id})"


def merged_with_copies(g: GlobalManifest, copies: Sequence[Sequence[int]], roots: Sequence[Path]) -> Manifest:
    """sharded.load_merged in one process, taking each rank's shard from its own root, else from
    the first of its copies among ``roots`` whose bytes match the manifest: the whole step; a
    rank with no good shard anywhere is an error naming every place tried."""
    where = match_roots(g.roots, roots)
    shards, choice = [], {}
    for ref in g.shards:
        tried = []
        for k, root in enumerate((ref.root, *copies[ref.rank])):
            at = ref if k == 0 else copy_ref(ref, root)
            if where[root] is None:
                tried.append(f"{describe_root(g, root)}: not among the roots given")
                continue
            d = where[root] / step_dir_name(g.step)
            try:
                shards.append(parse_shard(read_shard(d, g, at, where[0]), g, at, str(d / at.name)))
            except CheckpointNotFoundError:
                raise
            except CorruptCheckpointError as e:
                tried.append(f"{describe_root(g, root)}: {' '.join(str(e).split())}")
                continue
            if k:
                choice[ref.rank] = root
            break
        else:
            text = f"step {g.step}: no readable copy of rank {ref.rank}'s manifest shard: " + "; ".join(tried)
            if all(t.endswith("not among the roots given") for t in tried):
                raise UnreachableDataError(errno.ENOENT, f"{text}: pass every node's roots, the primary first")
            raise CorruptCheckpointError(f"{text}; the checkpoint is damaged: load an earlier step")
    return merge(with_copies(g, choice), shards)


def copied_steps(root: Path) -> list[int]:
    """Steps of which ``root`` holds a secondary step directory (no manifest.json) with a copy
    of the global manifest (``copies/manifest.json``): what it can take over when the primary
    root is gone (distributed/roots.py choose_primary). Reads only."""
    return [s for s, d in step_dirs(root)
            if not (d / MANIFEST_NAME).exists() and (d / COPIES_DIR / MANIFEST_NAME).is_file()]


def adopt_copy(step_dir: Path) -> bool:
    """Make the copy of the step's manifest in ``step_dir`` (a secondary step directory on the
    root that becomes the primary) that step's commit point: checked (its crc32c, its step, a
    1.3 global manifest or a DCP step's one 1.2 manifest, format.md 9.5), then linked in as
    ``manifest.json`` without clobbering, the directory fsynced (fs.py). False: the copy is
    damaged, names another step or is neither kind (the step is left uncommitted)."""
    copy = step_dir / COPIES_DIR / MANIFEST_NAME
    try:
        raw = read_regular_file(copy, MANIFEST_MAX_BYTES)
        m = parse_step(raw, str(copy))
    except (OSError, CorruptCheckpointError):
        return False
    dcp = isinstance(m, Manifest) and m.dist is not None and m.dist.layout == "dcp"
    if not (isinstance(m, GlobalManifest) or dcp) or step_dir_name(m.step) != step_dir.name:
        return False
    tmp = step_dir / f"{TMP_PREFIX}{MANIFEST_NAME}"
    tmp.unlink(missing_ok=True)
    write_durable(tmp, raw)
    link_no_clobber(tmp, step_dir / MANIFEST_NAME)
    fsync_dir(step_dir)
    return True


def relocate_roots(raw: bytes, moved: Mapping[int, tuple[str, str]], where: str) -> bytes:
    """The global manifest ``raw`` with table roots ``moved`` (index -> (id, path)) replaced: a
    node's root replaced by a new one holding the same files (distributed/refill.py), every
    other byte of the body kept, its manifest_crc32c recomputed, parsed back (format.md 11.2)."""
    body = json.loads(raw)
    for j, (rid, path) in moved.items():
        body["dist"]["roots"][j]["id"], body["dist"]["roots"][j]["path"] = rid, path
    body.pop("manifest_crc32c", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    out = (json.dumps({**body, "manifest_crc32c": _crc32c.crc32c(canonical)}, separators=(",", ":"),
                      allow_nan=False) + "\n").encode()
    if parse_global(out, where) is None:
        raise CorruptCheckpointError(f"{where}: not a global manifest")
    return out


DAMAGED_PREFIX = ".damaged-"  # a copy or parity block the scrub found damaged, set aside (never read again)


def set_aside(path: Path) -> Path:
    """``path`` (a copy's folder, a parity block or its description) renamed to
    ``.damaged-<name>-<hex>`` beside it, its directory fsynced: no reader looks at it any more,
    so the next load finds it missing and its refill re-creates it; nothing is deleted (it is
    removed with its step, or by hand). The new path."""
    gone = path.with_name(f"{DAMAGED_PREFIX}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, gone)
    fsync_dir(path.parent)
    return gone


def refilling_marker(step_dir: Path) -> bytes | None:
    """The ``protected`` marker a refilling note in the primary step directory ``step_dir`` keeps
    (``parity/refilling`` or ``copies/refilling``: the step lacks a copy or block a refill is to
    re-create), or None."""
    for d in (PARITY_DIR, COPIES_DIR):
        try:
            raw = read_regular_file(step_dir / d / REFILLING_NAME, 4096)
            body = json.loads(raw)
        except (OSError, GDSWriterError, ValueError):
            continue
        if isinstance(body, dict) and isinstance(body.get("copies"), int):
            return raw
    return None


def repairable(step_dir: Path) -> bool:
    """Whether ``verify --repair`` may mend the step whose primary step directory is ``step_dir``:
    it is protected (``protected``, written last by its replication, once every copy or block
    is durable) or noted (a refilling note: a repair or a parity refill already withdrew its
    protection). Else its replication is still running (publishing copies and blocks, then
    writing ``protected``) or failed: a repair then would set aside what the replication
    counts, and the replication would write ``protected`` over the repair's withdrawal."""
    return (step_dir / PROTECTED_NAME).is_file() or refilling_marker(step_dir) is not None


def withdraw_protection(step_dir: Path, marker: bytes, parity: bool) -> None:
    """The primary step directory ``step_dir`` stops claiming protection (house rule 10): the
    note ``parity/refilling`` (``parity``) or ``copies/refilling`` holding ``marker`` written
    durably first (a later load's refill knows from it what to re-create and which marker to
    write back), then ``protected`` removed and the directory fsynced."""
    write_note(step_dir, marker, parity)
    unlink_durably(step_dir / PROTECTED_NAME)


def manifest_copy_holders(step_dirs: Iterable[Path]) -> list[Path]:
    """Those of ``step_dirs`` (secondary step directories of one step) holding the global
    manifest's copy or its marker (``copies/manifest.json``, ``copies/protected``, or a note
    beside them): the roots a lost primary's open would adopt, so the ones whose claim of
    protection a repair withdraws and a refill restores. Reads only."""
    return [d for d in step_dirs if not (d / MANIFEST_NAME).exists() and any(
        (d / COPIES_DIR / n).exists() for n in (MANIFEST_NAME, PROTECTED_NAME, REFILLING_NAME))]


def withdraw_everywhere(primary: Path, holders: Iterable[Path], marker: bytes, parity: bool) -> None:
    """The step stops claiming protection wherever it claims it (house rule 10), before a repair
    sets anything aside (format.md 11.2, *The scrub*); each write durable:

    1. the primary step directory ``primary``: its note (``parity/refilling`` for ``parity``,
       else ``copies/refilling``) holding ``marker``, then ``protected`` removed
       (``withdraw_protection``). A crash here leaves the copies all in place and the step
       noted: the next load's refill finds nothing missing and writes ``protected`` back
       (``restore_holders``, then ``restore_protection``), or a repair run again goes on;
    2. each of ``holders`` (``manifest_copy_holders``: the roots holding the global manifest's
       copy, which an open adopts when the primary's node is lost, roots.py ``adopt_copies``):
       the same note, then ``copies/protected`` removed. A crash between two holders leaves
       some holder still marked, its copy and every other still in place (nothing is set aside
       yet): true, and a repair run again withdraws it;
    3. only then (the caller) is the damage set aside. So a root that adopts the manifest's copy
       later holds the note, and its refill (refill.py ``with_repairs``) re-creates what the
       repair set aside before it writes ``protected``.

    The primary first: what a crash leaves is the note the next load reads on the primary (and
    so its refill's end restores every holder), never a primary still claiming protection
    beside a withdrawn holder, where no load would ever clear the holder's note."""
    withdraw_protection(primary, marker, parity)
    for d in holders:
        write_note(d, marker, parity)
        unlink_durably(d / COPIES_DIR / PROTECTED_NAME)


def restore_holders(holders: Iterable[Path], marker: bytes) -> None:
    """The end of a refill that re-created what a repair set aside, the reverse of
    ``withdraw_everywhere``, step 1: each of ``holders`` (secondary step directories) holding the
    manifest's copy gets ``copies/protected`` (``marker``) back durably, then its notes removed.
    Step 2, last, is the primary's (``restore_protection``), once every holder is done: a crash
    between leaves the primary noted, so the next load refills again (nothing missing) and ends
    here; a holder restored before the primary claims only what the refill already re-created."""
    for d in holders:
        if (d / COPIES_DIR / MANIFEST_NAME).is_file():
            atomic_write(d / COPIES_DIR / PROTECTED_NAME, marker)
        remove_notes(d)


def restore_protection(step_dir: Path, marker: bytes) -> None:
    """``protected`` written back durably (``marker``), then the refilling note removed: the
    end of a refill that re-created what the note's step lacked."""
    atomic_write(step_dir / PROTECTED_NAME, marker)
    remove_notes(step_dir)


def write_note(step_dir: Path, marker: bytes, parity: bool) -> None:
    """The refilling note ``parity/refilling`` (``parity``) or ``copies/refilling`` holding
    ``marker`` in the step directory ``step_dir``, durably: its folder made (and ``step_dir``
    fsynced) where missing, the note replaced atomically (temporary, fsync, rename, fsync)."""
    d = step_dir / (PARITY_DIR if parity else COPIES_DIR)
    if not d.is_dir():
        d.mkdir()
        fsync_dir(step_dir)
    atomic_write(d / REFILLING_NAME, marker)


def remove_notes(step_dir: Path) -> None:
    """The refilling notes (``parity/refilling``, ``copies/refilling``) in ``step_dir`` removed,
    each folder fsynced: the step lacks nothing a refill is to re-create any more."""
    for d in (PARITY_DIR, COPIES_DIR):
        unlink_durably(step_dir / d / REFILLING_NAME)


def damaged_entries(step_dir: Path) -> list[Path]:
    """The ``.damaged-`` entries (copies and parity blocks ``verify --repair`` set aside) in the
    step directory ``step_dir``'s ``copies/`` and ``parity/``, sorted. Reads only."""
    out: list[Path] = []
    for d in (COPIES_DIR, PARITY_DIR):
        try:
            out += [step_dir / d / n for n in os.listdir(step_dir / d) if n.startswith(DAMAGED_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            continue
    return sorted(out)


def drop_damaged(step_dir: Path) -> list[Path]:
    """The ``.damaged-`` entries in ``step_dir`` removed, once what they held is re-created,
    verified and the step marked protected again (format.md 11.2, *The scrub*): each renamed
    to a ``.trash-`` name first (its directory fsynced: a crash mid-way leaves trash, which a
    later load's clean-up of ``copies/`` or the step's deletion removes, never half of the
    evidence under its own name), then deleted. What was removed."""
    gone = []
    for path in damaged_entries(step_dir):
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
        os.rename(path, trash)
        fsync_dir(path.parent)
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash)
        else:
            trash.unlink()
        gone.append(path)
    return gone


def drop_damage_in(step_dirs: Iterable[Path], what: str) -> None:
    """``drop_damaged`` in each of ``step_dirs`` (the step directories a rank looks at, once its
    refill re-created what they held and the step is protected again), each entry removed
    logged; a failure logged, never raised (the entries cost disk space, never a load: they go
    with the step). ``what`` names the step in the lines ("step 7", "DCP step 7")."""
    for d in step_dirs:
        try:
            for gone in drop_damaged(d):
                log.info("gdswriter: %s: %s removed (re-created and protected again)", what, gone)
        except OSError as e:
            log.warning("gdswriter: %s: what verify --repair set aside in %s stays (%s); it goes with the step",
                        what, d, e)


STEP_LOCK_NAME = ".step-lock"  # in a step directory: an empty file, step_lock's; never data, never listed


def step_lock(step_dir: Path, exclusive: bool) -> int:
    """The lock that keeps ``verify --repair`` (``exclusive``) and a refill of the same step
    (shared, held by the refill's primary rank from before it looks for what to re-create until
    it ends) apart (a replication is kept apart by ``repairable``): a ``flock`` of the empty file ``.step-lock`` in the primary step directory ``step_dir`` (made
    where missing; a dot name no reader, ``ls``, retention's count or the drain looks at, deleted
    with its step; a step locked before it used the empty ``copies/`` it made, which stays
    harmless), never waited for: held elsewhere, ``CheckpointLockedError`` saying who to wait
    for. A descriptor to ``os.close``."""
    fd = os.open(step_dir / STEP_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        who = ("a refill of this step is running (a multi-rank load re-creates its copies or parity blocks in the "
               "background): run verify --repair again once it ended (wait_protected() / wait_refilled())"
               if exclusive else "gdswriter verify --repair of this step is running: load the step again once it "
               "ended, and its refill re-creates what it set aside")
        raise CheckpointLockedError(errno.EWOULDBLOCK, f"{step_dir}: {who}") from e
    except BaseException:
        os.close(fd)
        raise
    return fd
