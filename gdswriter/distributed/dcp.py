"""torch.distributed.checkpoint (DCP) on gdswriter's engine, format and commit protocol.

    dcp.save(state_dict, storage_writer=GDSStorageWriter(root, step=100))
    dcp.load(state_dict, storage_reader=GDSStorageReader(root))      # the latest step
    dcp.async_save(state_dict, storage_writer=GDSStorageWriter(root), async_checkpointer_type=...)

DCP plans (which rank saves which chunk of which tensor; resharding on load); gdswriter
stores. A checkpoint is a step under ``root`` like any other (``gdswriter ls/inspect/verify/
export`` work on it): every DCP item is a storage with one tensor record named by its fully
qualified name (a chunk of a sharded tensor records its block as ``shard``; a BytesIO item is
a uint8 tensor of its bytes), and DCP's Metadata is stored as JSON in the manifest's
``dist.dcp`` (dcp_codec.py; no pickle). Tensor items that several ranks hold (replicated
state, which DCP would give whole to one rank) are split across their holders by
planner/ranks.py, as GDSCheckpointer does. The commit is dist/commit.py's: data files are
made durable and secondary roots published inside ``write_data`` (two votes over the
coordination group), and the coordinator commits in ``finish``.

Between saves the writer keeps only its engines (io_uring rings and page-locked staging
buffers, which take 25-150 ms to build per root; ``close()`` releases them). The writer and
reader pickle as their arguments, so DCP's process-based async_save can ship them to its
checkpoint process; engines, locks and the coordination group open there on first use.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import uuid
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..engines.base import IOEngine
from ..engines.select import create_engine
from ..errors import CorruptCheckpointError, InvalidOptionError, RankFailedError
from ..format.commit import normalize_roots
from ..format.dtypes import dtype_from_name, dtype_to_name
from ..format.manifest import Manifest, ShardInfo, TensorRecord
from ..options import CheckpointOptions, EngineOptions
from ..planner.assign import plan_save
from ..load.reader import host_buffer
from ..save.snapshot import Extent, Snapshot
from ..save.writer import live_spans, write_files
from .assemble import build_manifest, record_json
from .commit import RankCommit
from .dcp_codec import metadata_from_json, metadata_to_json
from .fetch import fetch_storages, manifest_reach
from .group import Coordinator, describe
from .load import broadcast_manifest
from .options import DistOptions
from .rankfiles import file_entries, group_held, rank_targets
from .roots import choose_primary, discover_layout, probe_led
from .session import DistSession, RankProtocol, open_session


def _step_of(checkpoint_id: Any) -> int | None:
    """A DCP checkpoint_id names a step: an int or a string of digits (None: the writer's choice)."""
    if checkpoint_id is None:
        return None
    text = str(checkpoint_id)
    if isinstance(checkpoint_id, bool) or not text.isdigit():
        raise InvalidOptionError(f"checkpoint_id={checkpoint_id!r}: with gdswriter's DCP plug-in the checkpoint_id "
                                 f"is a step number; give the directory as GDSStorageWriter/GDSStorageReader(root)")
    return int(text)


class _Collective:
    """What the writer and reader share: roots, options, and a coordinator opened on first use."""

    _OPEN = ("_coord", "_session", "_items", "_save", "_loaded", "_engines")  # resources, per-save state: not pickled

    def __init__(self, root: Any, step: int | None, process_group: Any, single_process: bool,
                 dist_options: DistOptions | None):
        self.roots = normalize_roots(root)
        self.step = _step_of(step)
        self.process_group = process_group
        self.single_process = single_process
        self.dist_options = dist_options or DistOptions.from_env()
        self._coord: Coordinator | None = None

    def coordinator(self) -> Coordinator:
        if self._coord is None:
            self._coord = Coordinator.solo() if self.single_process else Coordinator.for_group(
                self.process_group, timeout_s=self.dist_options.timeout_s)
        return self._coord

    def __getstate__(self) -> dict:
        if self.process_group is not None:
            raise InvalidOptionError("a GDSStorageWriter/Reader with a process_group cannot be sent to DCP's "
                                     "checkpoint process (async_save with AsyncCheckpointerType.PROCESS): use the "
                                     "default group there, or the thread mode")
        state = dict(self.__dict__)
        for k in self._OPEN:
            state[k] = None  # reopened (or rebuilt) where they are used
        return state

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # a step number is no path: DCP never picks this plug-in by itself


def _chunk_key(fqn: str, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype) -> str:
    return json.dumps([fqn, list(offsets), list(sizes), dtype_to_name(dtype)])


def _flat(data: Any) -> torch.Tensor:
    """The bytes of a resolved DCP item as a flat uint8 tensor (tensors on any device)."""
    if isinstance(data, io.BytesIO):
        raw = data.getvalue()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = data.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


class GDSStorageWriter(_Collective, StorageWriter):
    """A DCP StorageWriter storing step ``step`` under ``root`` (this rank's root or list of
    roots, the first the primary on rank 0, as for GDSCheckpointer). ``step`` None: the step
    after the latest. ``process_group``: the group DCP saves with (default: the default group);
    ``single_process=True`` for dcp.save(no_dist=True) in a distributed job."""

    def __init__(self, root: Any, step: int | None = None, *, options: CheckpointOptions | None = None,
                 dist_options: DistOptions | None = None, process_group: Any = None, single_process: bool = False):
        _Collective.__init__(self, root, step, process_group, single_process, dist_options)
        self.options = options or CheckpointOptions()
        self.save_id = uuid.uuid4().hex
        self._override: int | None = None
        self._session: DistSession | None = None
        self._items: dict[str, Any] = {}   # chunk key -> this rank's WriteItem
        self._save: dict | None = None     # step, commit and reports of the save in progress
        self._engines: list[IOEngine] | None = None  # one per local root, kept from save to save

    # -- DCP calls, in order -----------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._end_save()
        self._override = _step_of(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.roots[0]), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._end_save()
        if kwargs.get("use_collectives", True) is False:
            raise InvalidOptionError("GDSStorageWriter commits one step for all ranks: dcp.save(use_collectives=False) "
                                     "(a metadata file per rank) is not supported; use FileSystemWriter for that")
        coord = self.coordinator()
        failed = None  # reported in open_session's first collective, so every rank raises at once
        if "rank" in kwargs and kwargs["rank"] != coord.rank:
            failed = InvalidOptionError(f"DCP saves as rank {kwargs['rank']} but this writer's group has it as rank "
                                        f"{coord.rank}: pass the same process_group (single_process=True for no_dist)")
        self._session = open_session(self.roots, coord, self.dist_options, failed=failed)  # makes missing roots

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Name this rank's tensor chunks, so that the global plan sees which ranks hold each."""
        self._items = {}
        held = []
        for wi in plan.items:
            if wi.type != WriteItemType.BYTE_IO:
                td = wi.tensor_data
                key = _chunk_key(wi.index.fqn, td.chunk.offsets, td.chunk.sizes, td.properties.dtype)
                self._items[key] = wi
                n = 1
                for d in td.chunk.sizes:
                    n *= d
                held.append([key, n * td.properties.dtype.itemsize])
        return replace(plan, storage_data={"held": held})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Number every item: tensor chunks, split over the ranks holding them (planner/ranks.py),
        then BytesIO items, written whole by the rank DCP's deduplication gave them to."""
        held = group_held(plan.storage_data["held"] for plan in plans)
        items: list[list] = []  # [key, nbytes (None for BytesIO), fqn, offsets (None for BytesIO)]
        for key, n in zip(held.index, held.sizes):
            fqn, offsets, _, _ = json.loads(key)
            items.append([key, n, fqn, offsets])
        split = held.split(len(plans))
        pieces = [[[p.item, p.offset, p.length] for p in split.of_rank(r)] for r in range(len(plans))]
        for r, plan in enumerate(plans):
            for wi in plan.items:
                if wi.type == WriteItemType.BYTE_IO:
                    pieces[r].append([len(items), 0, None])
                    items.append([f"bytes:{wi.index.fqn}", None, wi.index.fqn, None])
        return [replace(plan, storage_data={"items": items, "pieces": pieces[r]}) for r, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's pieces, then vote (collective; see the module docstring)."""
        session = self._session
        if session is None:
            raise InvalidOptionError("write_data before set_up_storage_writer: use this writer through dcp.save")
        try:
            rc = self._begin(session)
            try:
                outcome: Any = self._write(plan, planner, rc)
            except Exception as e:  # noqa: BLE001 - every failure goes to the vote
                outcome = e
            reports = rc.vote(outcome)
            if rc.local_error is not None:
                raise rc.local_error
            if reports is not None:
                rc.check_secondaries()
                self._save = {"commit": rc, "reports": reports, "table": session.layout.table,
                              "items": plan.storage_data["items"]}
        finally:
            if self._save is None:  # rank 0 keeps its lock until finish()
                self._end_save()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=wi.index, size_in_bytes=0, storage_data=None) for wi in plan.items])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: build the manifest (DCP's metadata as JSON in it) and commit the step."""
        if self._save is None:
            raise InvalidOptionError("finish before write_data: use this writer through dcp.save")
        try:
            rc = self._save["commit"]
            manifest = _dcp_manifest(rc.step, self._save, metadata)
            rc.commit_manifest(manifest)
            rc.move_latest()
        finally:
            self._end_save()

    # -- internals -----------------------------------------------------------
    def _begin(self, session: DistSession) -> RankCommit:
        """Agree on the step and the temporary directories' token (rank 0 decides)."""
        decided: dict = {}
        error = None
        if session.rank == 0:
            try:
                step = self._override if self._override is not None else self.step
                if step is None:
                    steps = session.protocol.committed_steps()
                    step = steps[-1] + 1 if steps else 0
                decided = {"step": step, "token": secrets.token_hex(4)}
            except Exception as e:  # noqa: BLE001 - every rank learns of it
                error, decided = e, {"error": describe(e)}
        decided = session.coord.broadcast(decided, "dcp.save (step)")
        if "error" in decided:
            raise error or RankFailedError("dcp.save", {0: decided["error"]})
        return RankCommit(session.coord, session.layout, decided["step"], decided["token"])

    def _write(self, plan: SavePlan, planner: SavePlanner, rc: RankCommit) -> dict:
        if rc.setup_error is not None:
            raise rc.setup_error
        layout, rank = rc.layout, rc.coord.rank
        items = plan.storage_data["items"]
        byte_items = {wi.index.fqn: wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO}
        sources: list[tuple[int, int, Any, torch.Tensor]] = []  # (item, offset, WriteItem, flat bytes)
        resolved: dict[int, torch.Tensor] = {}
        for item, offset, length in plan.storage_data["pieces"]:
            key, _, fqn, _ = items[item]
            wi = self._items[key] if length is not None else byte_items[fqn]
            if item not in resolved:
                resolved[item] = _flat(planner.resolve_data(wi))
            flat = resolved[item]
            sources.append((item, offset, wi, flat[offset:offset + length] if length is not None else flat))
        engines = self._engines_for(len(layout.local_paths))
        try:
            fplan = plan_save([s[3].numel() for s in sources], rank_targets(layout, rank, self.options.files_per_root))
            pieces = Snapshot(rc.step, None, [Extent("", flat=s[3]) for s in sources], [], {})
            written_by: dict[int, str] = {}
            crcs = write_files(fplan, live_spans(pieces, fplan), rc, engines, written_by=written_by)
        except BaseException:
            self._close_engines()  # the next save starts from fresh ones
            raise
        return {
            "files": file_entries(layout, fplan, written_by, rank),
            "chunks": [[sources[c.storage][0], fid, c.file_offset, sources[c.storage][1] + c.storage_offset,
                        c.length, crcs[c]] for fid, f in enumerate(fplan.files) for c in f.chunks],
            "records": [[item, record_json(_record(wi, item, resolved[item].numel()))]
                        for item, offset, wi, _ in sources if offset == 0],
            "sizes": [[item, flat.numel()] for item, flat in resolved.items() if items[item][1] is None],
        }

    def _engines_for(self, roots: int) -> list[IOEngine]:
        """The writer's engines, one per local root, built at the first save and kept for the next
        ones: building an engine (ring, page-locked staging buffers) costs 25-150 ms here."""
        if self._engines is not None and len(self._engines) == roots:
            return self._engines
        self._close_engines()
        engines: list[IOEngine] = []
        try:
            for _ in range(roots):
                engines.append(create_engine(self.options.engine))
        except BaseException:
            for e in engines:
                e.close()
            raise
        self._engines = engines
        return engines

    def _close_engines(self) -> None:
        engines, self._engines = self._engines or [], None
        for e in engines:
            e.close()

    def _end_save(self) -> None:
        """Release what a save holds (its locks). DCP calls nothing after a failed save, so the
        next save's set_up, reset() and garbage collection also do."""
        if self._session is not None:
            self._session.lock.release()
            self._session = None
        self._save = None

    def close(self) -> None:
        """Release everything the writer holds: a save's locks and the engines kept between saves
        (the next save builds new ones)."""
        self._end_save()
        self._close_engines()

    def __del__(self) -> None:
        if getattr(self, "_session", None) is not None or getattr(self, "_engines", None):
            self.close()


def _record(wi: Any, item: int, nbytes: int) -> TensorRecord:
    """The tensor record of a DCP item: its chunk, with its block when it is not the whole
    tensor; a BytesIO item's bytes as a uint8 tensor."""
    if wi.type == WriteItemType.BYTE_IO:
        return TensorRecord(wi.index.fqn, item, 0, "uint8", (nbytes,), (1,))
    td = wi.tensor_data
    shape = tuple(int(n) for n in td.chunk.sizes)
    offsets = tuple(int(o) for o in td.chunk.offsets)
    whole = not any(offsets) and shape == tuple(td.size)
    return TensorRecord(wi.index.fqn, item, 0, dtype_to_name(td.properties.dtype), shape, _contiguous(shape),
                        "cpu", "tensor", None if whole else ShardInfo(tuple(int(n) for n in td.size), offsets))


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _dcp_manifest(step: int, save: dict, metadata: Metadata) -> Manifest:
    """Items in plan order, one tensor record each (so record i is item i); the state maps each
    fqn to its first record; DCP's Metadata goes in with storage_data = {MetadataIndex: record}."""
    items = save["items"]
    sizes = [n for _, n, _, _ in items]
    for rep in save["reports"]:
        for item, n in rep["sizes"]:
            sizes[item] = n
    for rep in save["reports"]:
        rep.update(tree=None, tensors=[])
    manifest = build_manifest(step, sizes, save["reports"], save["table"], layout="dcp", metadata={}, state={},
                              dcp={})
    md = replace(metadata, version=CURRENT_DCP_VERSION, storage_data={MetadataIndex(fqn, offsets): i for i, (_, _, fqn, offsets) in enumerate(items)})
    first: dict[str, int] = {}
    for i, (_, _, fqn, _) in enumerate(items):
        first.setdefault(fqn, i)
    state = {"$dict": [[fqn, {"$tensor": i}] for fqn, i in first.items()]}
    return replace(manifest, state=state, dist=replace(manifest.dist, dcp=metadata_to_json(md)))


class GDSStorageReader(_Collective, StorageReader):
    """A DCP StorageReader of step ``step`` (None: the latest) under ``root`` (this rank's root
    or roots; rank 0's first is the primary). Each rank reads the chunks it needs from the roots
    it reaches; chunks on other nodes' disks come from a rank that reaches them."""

    def __init__(self, root: Any, step: int | None = None, *, verify: bool = True,
                 engine_options: EngineOptions | None = None, dist_options: DistOptions | None = None,
                 process_group: Any = None, single_process: bool = False):
        _Collective.__init__(self, root, step, process_group, single_process, dist_options)
        self.verify = verify
        self.engine_options = engine_options
        self.load_id = uuid.uuid4().hex
        self._override: int | None = None
        self._loaded: tuple | None = None  # (manifest, root layout)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._override = _step_of(checkpoint_id)
        self._loaded = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any) -> Metadata:
        """Collective: the primary rank reads the manifest and sends it to every rank. The primary
        is the root holding the manifests (roots.choose_primary, as GDSCheckpointer finds it):
        rank 0's first root, unless a restart put rank 0 on another node."""
        coord = self.coordinator()
        layout = discover_layout(coord, self.roots, create=False)
        probes = coord.all_gather(probe_led(layout), "dcp.load (finding the primary root)")
        layout = choose_primary(layout, {g: p for x in probes for g, p in x.items()})
        step = self._override if self._override is not None else self.step
        step, m = broadcast_manifest(coord, RankProtocol(layout), step, "dcp.load", src=layout.primary_rank)
        if m.dist is None or m.dist.layout != "dcp" or m.dist.dcp is None:
            raise CorruptCheckpointError(f"step {step} under {self.roots[0]} was not saved through DCP: load it with "
                                         f"GDSCheckpointer.load or gdswriter.load_state")
        md = metadata_from_json(m.dist.dcp)
        if md.storage_data is None or any(not 0 <= i < len(m.tensors) for i in md.storage_data.values()):
            raise CorruptCheckpointError(f"step {step}: the DCP metadata does not map its items to tensor records")
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._loaded = (m, layout, md.storage_data)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._loaded is None:
            raise InvalidOptionError("set_up_storage_reader before read_metadata: use this reader through dcp.load")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Collective: fetch the storages of this rank's items, then hand DCP each item."""
        if self._loaded is None:
            raise InvalidOptionError("read_data before read_metadata: use this reader through dcp.load")
        m, layout, where = self._loaded
        coord = self.coordinator()
        records, error, engine = [], None, None
        try:  # this rank's part before the first collective: a failure here reaches every rank
            for req in plan.items:
                if req.storage_index not in where:
                    raise CorruptCheckpointError(f"step {m.step}: DCP asks for {req.storage_index}, which the "
                                                 f"checkpoint's DCP metadata does not map to a record")
                records.append(m.tensors[where[req.storage_index]])
            engine = create_engine(self.engine_options)
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
        try:
            coord.agree(error, f"dcp.load of step {m.step} (planning)", hint="nothing was loaded")
            assert engine is not None
            # the buffers are allocated once every rank has checked the files it reads against the manifest
            buffers = fetch_storages(coord, manifest_reach(m, layout), m, {r.storage for r in records}, engine,
                                     verify=self.verify, what=f"dcp.load of step {m.step}", alloc=host_buffer)
        finally:
            if engine is not None:
                engine.close()
        for req, rec in zip(plan.items, records):
            buf = buffers[rec.storage]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(buf.numpy().tobytes()))
                continue
            dtype = dtype_from_name(rec.dtype)
            src = buf.view(dtype).view(rec.shape) if rec.shape else buf.view(dtype).reshape(())
            for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(d, o, n)
            target = planner.resolve_tensor(req).detach()
            if target.shape != src.shape:
                raise CorruptCheckpointError(f"{req.storage_index.fqn}: DCP asked for {list(target.shape)} elements, "
                                             f"the saved chunk gives {list(src.shape)}")
            target.copy_(src)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
