"""A GDSCheckpointer save across ranks: every rank's snapshot -> one committed step.

1. Each rank names its storages: replicated ones (plain tensors under DistOptions.replicated,
   identical on every rank) by their content description, DTensor shards by their block and
   device mesh, everything else by rank; ranks exchange the step, the names and sizes (one
   all_gather) and all refuse the save if they are not saving the same step.
2. The storages become items with holder sets; plan_rank_slices gives each rank its byte
   ranges (replicated state split across ranks, shards written once per replica group).
3. Each rank lays its ranges out in its own data files (plan_save over its roots; names carry
   the rank) and writes them through its engines into the step's temporary directories.
4. The two-phase commit of dist/commit.py; the primary rank (rank 0 unless the primary root
   is another rank's: roots.py) builds the manifest (dist/assemble.py).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import replace
from typing import Sequence

from ..engines.base import IOEngine
from ..errors import RankFailedError, UnsupportedObjectError
from ..format.manifest import Manifest, ShardInfo, TensorRecord
from ..planner.assign import plan_save
from ..save.snapshot import Extent, Snapshot
from ..save.pool import HostSnapshotPool
from ..save.handle import Release
from ..save.writer import write_snapshot_files
from .assemble import build_manifest, record_json
from .commit import RankCommit
from .group import Coordinator, describe, raise_failures
from .rankfiles import file_entries, group_held, rank_targets
from .roots import RootLayout


def storage_keys(snap: Snapshot, shards: dict[str, ShardInfo], replicated: Sequence[str], rank: int,
                 meshes: dict[str, list[int]] | None = None) -> tuple[list[str], dict[int, list[int]]]:
    """A name per storage that equals another rank's exactly when both hold the same bytes, and
    the record indices of each storage. ``meshes``: the global ranks of each DTensor's device
    mesh (a block of one name on another mesh, e.g. another pipeline stage, is other data)."""
    meshes = meshes or {}
    by_storage: dict[int, list[int]] = {}
    for i, rec in enumerate(snap.records):
        by_storage.setdefault(rec.storage, []).append(i)
    missing = set(shards) - {rec.name for rec in snap.records}
    if missing:
        name = min(missing)
        raise UnsupportedObjectError(name, None, "a DTensor whose key path the snapshot names differently (keys "
                                                 "must be str or int)", type_name="DTensor")
    keys = []
    for sid, ext in enumerate(snap.extents):
        recs = [snap.records[i] for i in by_storage.get(sid, [])]
        desc = [[r.name, r.byte_offset, r.dtype, list(r.shape), list(r.stride), r.kind,
                 [list(shards[r.name].global_shape), list(shards[r.name].offsets), meshes.get(r.name)]
                 if r.name in shards else None]
                for r in recs]
        if any(r.name in shards for r in recs):
            kind = "S"  # a block of a DTensor: the same on every replica
        elif recs and all(r.name.split("/", 1)[0] in replicated for r in recs):
            kind = "R"  # replicated state: the same on every rank
        else:
            keys.append(f"L{rank}:{sid}")
            continue
        digest = hashlib.sha256(json.dumps([desc, ext.flat.numel()]).encode()).hexdigest()[:32]
        keys.append(f"{kind}{digest}")
    return keys, by_storage


def collective_save(coord: Coordinator, layout: RootLayout, snap: Snapshot, shards: dict[str, ShardInfo],
                    engines: Sequence[IOEngine], *, files_per_root: int, replicated: Sequence[str],
                    pool: HostSnapshotPool | None = None, release: Release | None = None,
                    meshes: dict[str, list[int]] | None = None) -> Manifest | None:
    """Collective: write ``snap`` as step ``snap.step`` with every rank and commit it once.
    Returns the manifest on the primary rank (None elsewhere); raises on every rank if any rank failed.
    ``pool``/``release`` as in writer.write_and_commit: this rank's pieces go through the host
    snapshot pool (host mode) or straight from the extents (live), and ``release`` is set once
    the live tensors are free (or the save failed). ``meshes``: see storage_keys."""
    release = release if release is not None else Release()
    rank, what = coord.rank, f"saving step {snap.step}"
    mine: dict = {}
    error: BaseException | None = None
    try:
        keys, by_storage = storage_keys(snap, shards, replicated, rank, meshes)
        mine = {"step": snap.step, "token": secrets.token_hex(4),
                "items": [[k, e.flat.numel()] for k, e in zip(keys, snap.extents)]}
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the plan
        error, mine = e, {"step": snap.step, "error": describe(e)}
    everyone = coord.all_gather(mine, f"{what} (plan)")
    try:
        steps = [x["step"] for x in everyone]
        if len(set(steps)) > 1:  # collectives pair by order: a rank that skipped or lost a save is out of step
            raise RankFailedError(what, {r: f"saving step {s}" for r, s in enumerate(steps) if s != snap.step},
                                  f"the ranks are not saving the same step (steps by rank: {steps}), so nothing "
                                  f"was committed: every rank must call save()/save_async() for the same steps in "
                                  f"the same order (no on_busy='skip'; a rank whose save_async raised must not go "
                                  f"on alone); restart the job from the latest committed step")
        raise_failures([x.get("error") for x in everyone], error, what)
    except BaseException as e:
        release.set(error=e)
        raise
    held = group_held(x["items"] for x in everyone)
    plan = held.split(coord.world_size)
    item_of = [held.index[k] for k in keys]
    storage_of = {g: sid for sid, g in enumerate(item_of)}
    pieces = plan.of_rank(rank)
    rc = RankCommit(coord, layout, snap.step, everyone[0]["token"])
    outcome: object
    try:
        if rc.setup_error is not None:
            raise rc.setup_error
        fplan = plan_save([p.length for p in pieces], rank_targets(layout, rank, files_per_root))
        mine = Snapshot(snap.step, None, [Extent("", flat=snap.extents[storage_of[p.item]].flat[p.offset:p.offset + p.length])
                                          for p in pieces], [], {}, ready=snap.ready)
        written_by: dict[int, str] = {}
        crcs = write_snapshot_files(mine, fplan, rc, engines, pool=pool, release=release, written_by=written_by)
        position = {i: pos for members in by_storage.values() for pos, i in enumerate(members)}
        outcome = {
            "files": file_entries(layout, fplan, written_by, rank),
            # the chunks written, which the host pool may have cut where its pieces end
            "chunks": [[pieces[c.storage].item, c.file, c.file_offset, pieces[c.storage].offset + c.storage_offset,
                        c.length, crc] for c, crc in sorted(crcs.items(), key=lambda x: (x[0].file, x[0].file_offset,
                                                                                            x[0].storage_offset))],
            "records": [[g, record_json(_with_shard(snap.records[i], shards))] for sid, g in enumerate(item_of)
                        if min(held.holders[g]) == rank for i in by_storage.get(sid, [])],
            "tree": snap.tree,
            "tensors": [[item_of[rec.storage], position[i]] for i, rec in enumerate(snap.records)],
        }
    except Exception as e:  # noqa: BLE001 - every failure goes to the vote, so all ranks abort together
        outcome = e
        release.set(error=e)
    reports = rc.vote(outcome)
    manifest, error = None, None
    if reports is not None:
        try:
            manifest = build_manifest(snap.step, held.sizes, reports, layout.table, layout="gdswriter",
                                      metadata=snap.metadata)
            rc.commit_manifest(manifest)
        except Exception as e:  # noqa: BLE001 - announced to every rank
            error = e
    rc.announce(error)
    if rc.coordinates:
        rc.move_latest()
    return manifest


def _with_shard(rec: TensorRecord, shards: dict[str, ShardInfo]) -> TensorRecord:
    return replace(rec, shard=shards[rec.name]) if rec.name in shards else rec
