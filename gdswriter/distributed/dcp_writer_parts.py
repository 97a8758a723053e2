"""The DCP writer's helpers: naming and flattening its items, FileSystemWriter's options, and
checking the ranks' reports and building the manifest in finish() (its roots open through
opening.py)."""

from __future__ import annotations

import io
import json
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, NamedTuple
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._log import log_once
from ..errors import GDSWriterError, InvalidOptionError
from ..format.assembly import build_manifest
from ..format.dtypes import dtype_to_name
from ..format.manifest import Manifest, RootInfo, ShardInfo, TensorRecord
from ..format.sharded import parse_step
from ..load.reader import read_manifest_bytes
from .commit import OrderedCommit
from .dcp_codec import metadata_to_json
from .dcp_messages import KeepBeside, LocalPlanData, Piece, PlanItem, RankReport
from .rankfiles import group_held
from .session import DistSession

log = logging.getLogger("gdswriter")

REPORT_FQN = "gdswriter.rank-report"  # the WriteResult carrying a rank's report to finish()


def chunk_key(fqn: str, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype) -> str:
    return json.dumps([fqn, list(offsets), list(sizes), dtype_to_name(dtype)])


def flat_bytes(data: Any) -> torch.Tensor:
    """The bytes of a resolved DCP item as a flat uint8 tensor (tensors on any device)."""
    if isinstance(data, io.BytesIO):
        raw = data.getvalue()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = data.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_fs_options(*, sync_files: Any, thread_count: Any, per_thread_copy_ahead: Any, single_file_per_rank: Any,
                      cache_staged_state_dict: Any, extensions: Any, serialization_format: Any) -> None:
    """FileSystemWriter's options: refuse those gdswriter cannot honour, with the reason; log
    once what it does instead of the others when they differ from FileSystemWriter's defaults."""
    if cache_staged_state_dict:
        raise InvalidOptionError("cache_staged_state_dict=True: GDSStorageWriter is no AsyncStager and keeps no "
                                 "staged copy; for a reused pinned staging copy pass dcp.async_save(..., async_stager="
                                 "DefaultStager(StagingOptions(...)))")
    if extensions:
        raise InvalidOptionError("_extensions: gdswriter stores each tensor's raw bytes with a crc32c and applies no "
                                 "stream transforms (compression, encryption); drop _extensions or use "
                                 "FileSystemWriter for them")
    if serialization_format != SerializationFormat.TORCH_SAVE:
        raise InvalidOptionError(f"serialization_format={serialization_format}: gdswriter writes its own format (raw "
                                 f"bytes, a JSON manifest); `gdswriter export --to safetensors` converts a step")
    notes = []
    if sync_files is not True:
        notes.append("sync_files=False is not honoured: every file is fdatasynced before the commit, which is what "
                     "makes the checkpoint crash-safe")
    if thread_count != 1:
        notes.append(f"thread_count={thread_count} is not used: each root is written from one thread through "
                     f"io_uring (EngineOptions.queue_depth requests in flight)")
    if per_thread_copy_ahead != 10_000_000:
        notes.append("per_thread_copy_ahead is not used: bytes are staged through EngineOptions.buffer_bytes x "
                     "num_buffers page-locked buffers")
    if single_file_per_rank is not True:
        notes.append("single_file_per_rank=False is not used: each rank writes CheckpointOptions.files_per_root "
                     "files per root")
    if notes:
        text = "; ".join(notes)
        log_once(f"dcp-fs-options:{text}", f"gdswriter: GDSStorageWriter takes FileSystemWriter's options; {text}")


class Place:
    """A rank's place in the writer's group (``rank``, ``world_size``), standing for its
    Coordinator where no collective is made (OrderedCommit, the session it keeps)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


@dataclass
class SaveInProgress:
    """The coordinator's save between prepare_global_plan and finish: its commit, the root table,
    the token, and (from write_data) the items of the plan."""
    commit: OrderedCommit
    table: tuple[RootInfo, ...]
    token: str
    items: tuple[PlanItem, ...] | None = None


class Source(NamedTuple):
    """A piece a rank writes: its item, its offset in the item, DCP's WriteItem, its bytes."""
    item: int
    offset: int
    write_item: Any
    data: torch.Tensor


def plan_items(local: list[LocalPlanData], plans: list[Any]) -> tuple[tuple[PlanItem, ...], list[tuple[Piece, ...]]]:
    """Coordinator: every item of the save, numbered (tensor chunks first, grouped by key over the
    ranks holding them and split over them by planner/ranks.py; then BytesIO items, written whole
    by the rank DCP's deduplication gave them to), and each rank's pieces."""
    held = group_held([h.to_wire() for h in lp.held] for lp in local)
    items: list[PlanItem] = []
    for key, n in zip(held.index, held.sizes):
        fqn, offsets, _, _ = json.loads(key)
        items.append(PlanItem(key, n, fqn, tuple(offsets)))
    split = held.split(len(plans))
    pieces = [[Piece(p.item, p.offset, p.length) for p in split.of_rank(r)] for r in range(len(plans))]
    for r, plan in enumerate(plans):
        for wi in plan.items:
            if wi.type == WriteItemType.BYTE_IO:
                pieces[r].append(Piece(len(items), 0, None))
                items.append(PlanItem(f"bytes:{wi.index.fqn}", None, wi.index.fqn, None))
    return tuple(items), [tuple(p) for p in pieces]


def _step_manifest(session: DistSession, step: int) -> Manifest | None:
    """Step ``step``'s manifest when it is a multi-rank one; None (logged) when it cannot be read."""
    try:
        m = parse_step(read_manifest_bytes(session.protocol, step), f"step {step}'s manifest")
    except (OSError, GDSWriterError) as e:
        log.warning("gdswriter: step %d's manifest could not be read (%s): the files of earlier saves "
                    "beside it stay", step, e)
        return None
    return m if isinstance(m, Manifest) and m.dist is not None else None


def live_beside(session: DistSession, beside: set[tuple[str, int]]) -> dict[int, list[KeepBeside]]:
    """Coordinator: for each (root id, step) a rank reported files of several saves in (its own
    beside a committed step, OrderedCommit), the names of the data files the committed manifest
    of that step lists on that root, for the root's leader to keep (commit.clean_resaved):
    {leader: [KeepBeside, ...]}. Nothing for a step no longer committed (cleaning
    removes its directory whole), a root its manifest does not name, or a manifest it cannot
    read (logged: those files stay)."""
    if not beside:
        return {}
    leaders = {info.id: min(info.ranks) for info in session.layout.table}
    committed = set(session.protocol.committed_steps())
    manifests: dict[int, Manifest | None] = {}
    out: dict[int, list[KeepBeside]] = {}
    for rid, step in sorted(beside):
        if step not in committed or rid not in leaders:
            continue
        if step not in manifests:
            manifests[step] = _step_manifest(session, step)
        m = manifests[step]
        g = None if m is None else next((g for g, info in enumerate(m.dist.roots) if info.id == rid), None)
        if g is not None:
            names = tuple(sorted(f.path for f in m.files if f.root == g))
            out.setdefault(leaders[rid], []).append(KeepBeside(rid, step, names))
    return out


def _report_of(got: list[WriteResult], r: int, step: int, token: str) -> RankReport | None:
    """Rank ``r``'s report (its last WriteResult) when it is one of this save's."""
    if not got or got[-1].index.fqn != REPORT_FQN or not isinstance(got[-1].storage_data, dict):
        return None
    try:
        rep = RankReport.from_wire(got[-1].storage_data)
    except GDSWriterError:
        return None
    return rep if (rep.rank, rep.step, rep.token) == (r, step, token) else None


def _unknown(named: set, count: int) -> list:
    """The item numbers in ``named`` that are not items of a plan of ``count``."""
    return [i for i in named if not (isinstance(i, int) and 0 <= i < count)]


def _recording_problems(reports: list[RankReport], items: tuple[PlanItem, ...]) -> list[str]:
    """What is wrong with how the reports record the plan's items: an item it does not hold, an
    item not recorded exactly once, or a BytesIO item not sized."""
    recorded = Counter(item for rep in reports for item, _ in rep.records)
    sized = {item for rep in reports for item, _ in rep.sizes}
    bad = _unknown(set(recorded) | sized | {c.item for rep in reports for c in rep.chunks}, len(items))
    if bad:
        return [f"the reports name items {sorted(map(str, bad))[:5]} that the plan does not hold"]
    missing = [i for i in range(len(items)) if recorded[i] != 1 or (items[i].is_bytes and i not in sized)]
    if missing:
        return [f"{len(missing)} item(s) not recorded exactly once (first: {items[missing[0]].fqn!r})"]
    return []


def checked_reports(results: list[list[WriteResult]], step: int, token: str,
                    items: tuple[PlanItem, ...]) -> list[RankReport]:
    """Every rank's report (the last WriteResult of each), in rank order, checked against this
    save: one per rank, of this step and token, naming only items of the plan, and every item
    recorded exactly once (a BytesIO item also sized). GDSWriterError naming what is wrong."""
    reports, problems = [], []
    for r, got in enumerate(results):
        rep = _report_of(got, r, step, token)
        if rep is None:
            problems.append(f"rank {r} sent no report of this save (step {step})")
            continue
        reports.append(rep)
    problems += _recording_problems(reports, items)
    if problems:
        raise GDSWriterError(f"dcp.save of step {step}: {'; '.join(problems)}; nothing was committed (internal: "
                             f"report it)")
    return reports


def item_record(wi: Any, item: int, nbytes: int) -> TensorRecord:
    """The tensor record of a DCP item: its chunk, with its block when it is not the whole
    tensor; a BytesIO item's bytes as a uint8 tensor."""
    if wi.type == WriteItemType.BYTE_IO:
        return TensorRecord(wi.index.fqn, item, 0, "uint8", (nbytes,), (1,))
    td = wi.tensor_data
    shape = tuple(int(n) for n in td.chunk.sizes)
    offsets = tuple(int(o) for o in td.chunk.offsets)
    whole = not any(offsets) and shape == tuple(td.size)
    return TensorRecord(wi.index.fqn, item, 0, dtype_to_name(td.properties.dtype), shape, contiguous_stride(shape),
                        "cpu", "tensor", None if whole else ShardInfo(tuple(int(n) for n in td.size), offsets))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def dcp_manifest(step: int, save: SaveInProgress, reports: list[RankReport], metadata: Metadata) -> Manifest:
    """Items in plan order, one tensor record each (so record i is item i); the state maps each
    fqn to its first record; DCP's Metadata goes in with storage_data = {MetadataIndex: record}."""
    items = save.items or ()
    sizes = [it.nbytes for it in items]
    for rep in reports:
        for item, n in rep.sizes:
            sizes[item] = n
    manifest = build_manifest(step, sizes, [rep.manifest_report() for rep in reports], save.table, layout="dcp",
                              metadata={}, state={}, dcp={})
    md = replace(metadata, version=CURRENT_DCP_VERSION,
                 storage_data={MetadataIndex(it.fqn, None if it.offsets is None else list(it.offsets)): i
                               for i, it in enumerate(items)})
    first: dict[str, int] = {}
    for i, it in enumerate(items):
        first.setdefault(it.fqn, i)
    state = {"$dict": [[fqn, {"$tensor": i}] for fqn, i in first.items()]}
    return replace(manifest, state=state, dist=replace(manifest.dist, dcp=metadata_to_json(md)))
