"""GDSStorageReader: DCP's load from a gdswriter checkpoint, with its one-shared-root path (see dcp.py)."""

from __future__ import annotations

import io
import os
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engines.base import IOEngine
from ..engines.select import create_engine
from ..errors import CorruptCheckpointError, GDSWriterError, InvalidOptionError, StepFilesLostError
from ..format.commit import ROOT_MARKER_NAME, step_dir_name
from ..format.dtypes import dtype_from_name, dtype_to_name
from ..format.manifest import Manifest, RootInfo, TensorRecord
from ..load.reader import host_buffer, read_manifest_bytes
from ..options import EngineOptions
from .dcp_codec import metadata_from_json
from .dcp_failures import CarriedError
from .dcp_fsreader import fs_metadata_for_load, is_fs_checkpoint, read_fs_items
from .dcp_messages import SharedRootOffer
from .dcp_paths import Collective, local_path_ok
from .dcp_refill import DcpRefill, DcpRefillJob, start_refill
from .dcp_replicas import Placed, fetch_placed, held_paths, place_files
from .dcp_writer_parts import contiguous_stride
from .fetch import Reach, fetch_storages, manifest_reach
from .group import Coordinator
from .loadmanifest import broadcast_manifest, received_manifest
from .options import DistOptions
from .roots import (
    RootLayout,
    discover_layout,
    identify_roots,
    layout_of_part,
    layout_parts,
    probe_led,
    probe_root,
    settle_primary,
)
from .session import RankProtocol


class GDSStorageReader(Collective, StorageReader):
    """A DCP StorageReader of step ``step`` (None: the latest) under ``root`` (this rank's root
    or roots; rank 0's first is the primary), or of the checkpoint a checkpoint_id names (a
    path: the latest step in that directory; a step number: that step under ``root``). Each rank
    reads the chunks it needs from the roots it reaches; chunks on other nodes' disks come from a
    rank that reaches them. Items DCP asks for whole are read straight into its target tensors;
    ``atomic=True`` reads everything into fresh buffers and verifies it on every rank first (see
    the module docstring). ``verify=False`` skips the crc32c checks. The reader keeps its engine
    from load to load (``engine_options``; default: reader_engine_options()); ``close()``
    releases it. ``_extension_registry`` (FileSystemReader's) must
    be None: gdswriter applies no stream transforms. A directory that DCP's own FileSystemWriter
    wrote is read too, without unpickling anything outside an allowlist (dcp_fsreader.py). A
    load that read a replaced node's files from their copies re-creates them, and the copies
    that node held, on its new disk in the background (dcp_refill.py): ``wait_refilled()``."""

    def __init__(self, root: Any = None, step: int | None = None, *, verify: bool = True, atomic: bool = False,
                 engine_options: EngineOptions | None = None, dist_options: DistOptions | None = None,
                 process_group: Any = None, single_process: bool = False, _extension_registry: Any = None):
        if _extension_registry is not None:
            raise InvalidOptionError("_extension_registry: gdswriter stores raw bytes and applies no stream "
                                     "transforms; drop it (or read a FileSystemWriter checkpoint with FileSystemReader)")
        if not isinstance(atomic, bool) or not isinstance(verify, bool):
            raise InvalidOptionError(f"atomic={atomic!r}, verify={verify!r}: expected True or False")
        Collective.__init__(self, root, step, process_group, single_process, dist_options)
        self.verify = verify
        self.atomic = atomic
        self.engine_options = engine_options
        self.load_id = uuid.uuid4().hex
        self._loaded: tuple | None = None  # (manifest, root layout, DCP's storage_data, reaches every root)
        self._engines: list[IOEngine] | None = None  # [the engine], kept from load to load
        self._engine_made: EngineOptions | None = None  # the options it was built with
        self._fs: tuple[Path, Metadata] | None = None  # a FileSystemWriter checkpoint's directory, its metadata
        self._refill: DcpRefill | None = None  # the last load's refill of a replaced node's files (dcp_refill.py)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for what reset() takes and can read: a directory holding a gdswriter checkpoint
        (its ``.metadata`` marker or a step), or a step number; False for URLs and the rest."""
        return local_path_ok(checkpoint_id, must_exist=True)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the next load at ``checkpoint_id`` (a path or a step; None: the same as before)."""
        self._target(checkpoint_id)
        self._loaded = self._fs = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any) -> Metadata:
        """Collective: the primary rank reads the manifest and sends it to every rank. The primary
        is the root holding the manifests (roots.choose_primary, as GDSCheckpointer finds it):
        rank 0's first root, unless a restart put rank 0 on another node. A failure leaves as a
        CarriedError (see there)."""
        try:
            return self._read_metadata()
        except Exception as e:  # noqa: BLE001 - handed through DCP's retry as it is (CarriedError)
            raise CarriedError(e) from e

    def _read_metadata(self) -> Metadata:
        roots = self.current_roots()
        if len(roots) == 1 and self._override is None and (self._path_roots or self.step is None) and (
                is_fs_checkpoint(roots[0])):
            # a checkpoint DCP's FileSystemWriter wrote: every rank reads it alone (dcp_fsreader.py)
            md = fs_metadata_for_load(roots[0], self.load_id)
            self._loaded, self._fs = None, (roots[0], md)
            return md
        self._fs = None
        coord = self.coordinator()
        step = self._override if self._override is not None else (None if self._path_roots else self.step)
        opened = open_one_shared_root(coord, roots, step)
        if opened is not None:
            layout, step, m = opened
            # every rank reaches every root of the step: the same on every rank (one root, one manifest)
            reaches_all = all(p is not None for p in manifest_reach(m, layout).paths)
        else:
            reaches_all = False
            layout = discover_layout(coord, roots, create=False)
            probes, error = None, None
            try:
                probes = probe_led(layout)
            except Exception as e:  # noqa: BLE001 - every rank learns of it
                error = e
            hint = "nothing was loaded; fix the failing rank's roots and load again"
            # rank 0's node gone: settle_primary adopts the copies of its manifests (format/copies.py adopt_copy)
            layout, _ = settle_primary(coord, layout, probes, error, "dcp.load (finding the primary root)", hint)
            step, m = broadcast_manifest(coord, RankProtocol(layout), step, "dcp.load", src=layout.primary_rank)
        if m.dist is None or m.dist.layout != "dcp" or m.dist.dcp is None:
            raise CorruptCheckpointError(f"step {step} under {roots[0]} was not saved through DCP: load it with "
                                         f"GDSCheckpointer.load or gdswriter.load_state")
        md = metadata_from_json(m.dist.dcp)
        if md.storage_data is None or any(not 0 <= i < len(m.tensors) for i in md.storage_data.values()):
            raise CorruptCheckpointError(f"step {step}: the DCP metadata does not map its items to tensor records")
        check_dcp_records(m, md)  # before any buffer is allocated or byte read (read_data)
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._loaded = (m, layout, md.storage_data, reaches_all)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._loaded is None and self._fs is None:
            raise InvalidOptionError("set_up_storage_reader before read_metadata: use this reader through dcp.load")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Collective: fetch the storages of this rank's items (those DCP wants whole straight
        into its targets), then hand DCP each item. A FileSystemWriter checkpoint: this rank's
        items from its data files, alone (dcp_fsreader.read_fs_items)."""
        if self._fs is not None:
            read_fs_items(self._fs[0], self._fs[1], plan, planner)
            done: Future = Future()
            done.set_result(None)
            return done
        if self._loaded is None:
            raise InvalidOptionError("read_data before read_metadata: use this reader through dcp.load")
        m, layout, where, reaches_all = self._loaded
        # every rank reaches every root of the step (one shared root): without atomic, each rank
        # reads what it needs alone, and DCP's gather of read_data's outcomes tells every rank of a failure
        alone = reaches_all and not self.atomic
        coord = self.coordinator()
        reach = manifest_reach(m, layout)
        placed, saved = None, m
        if not alone:  # a file lost or damaged on its own root: read from a copy, verified (dcp_replicas.py)
            reach = Reach(held_paths(m, reach.paths))
            placed = place_files(coord, m, reach.paths, f"dcp.load of step {m.step}",
                                 clean=self._refill is None or not self._refill.running())
            m = placed.m
        records, error, engine = [], None, None
        in_place: dict[int, torch.Tensor] = {}  # item -> DCP's target, read into directly
        try:  # this rank's part before the first collective: a failure here reaches every rank
            records = records_of(plan, m, where)
            if alone:
                check_lost_roots(m, reach.paths)
            if not self.atomic:
                in_place = in_place_targets(plan, records, m, planner)
            engine = self._engine(sum(m.storages[s].nbytes for s in {rec.storage for rec in records}))
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
        if not alone:
            try:
                coord.agree(error, f"dcp.load of step {m.step} (planning)", hint="nothing was loaded")
            except BaseException:
                if placed is not None and placed.held is not None:  # a rebuilt copy held in memory
                    placed.held.close()
                raise
        elif error is not None:
            raise error
        assert engine is not None
        # the buffers are allocated once every rank has checked the files it reads against the manifest
        into = {records[i].storage: bytes_of(t) for i, t in in_place.items()}
        try:
            def fetch(at: Placed) -> dict[int, torch.Tensor]:
                return fetch_storages(coord, Reach(at.reach), at.m, {r.storage for r in records}, engine,
                                      verify=self.verify, what=f"dcp.load of step {m.step}", alloc=host_buffer,
                                      into=into, alone=alone)
            if placed is None:
                buffers = fetch(Placed(m, False, reach=reach.paths))
            else:
                buffers, placed = fetch_placed(coord, placed, fetch, f"dcp.load of step {m.step}")
        except BaseException:
            self._close_engines()  # the next load starts from a fresh one
            raise
        if placed is not None and (placed.lost or placed.unfit or placed.stripes or placed.noted) and placed.held is None:  # the same on every rank
            # read from copies (or rebuilt from parity) because a node was replaced, or because files were missing,
            # short or damaged on a root a rank reaches (a refill killed midway): re-created there in the
            # background; not a copy held in memory for this load alone (parityload.py: gone after it)
            self._end_refill()  # the last load's, first: its channel given back here, alike on every rank
            self._refill = start_refill(self.process_group, self.dist_options.timeout_s,
                                        DcpRefillJob(saved, placed, layout))
        hand_over(plan, records, in_place, buffers, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _engine(self, nbytes: int | None = None) -> IOEngine:
        """The reader's engine, for a load reading ``nbytes``: kept from load to load, and built
        anew (with reader_engine_options(nbytes)) only when a load needs a larger staging pool
        than the kept one has."""
        options = self.engine_options or reader_engine_options(nbytes)
        if self._engines and self.engine_options is None and pool_bytes(options) > pool_bytes(self._engine_made):
            self._close_engines()
        if not self._engines:
            self._engines = [create_engine(options)]
            self._engine_made = options
        return self._engines[0]

    def _close_engines(self) -> None:
        engines, self._engines = self._engines or [], None
        for e in engines:
            e.close()

    def wait_refilled(self, timeout: float | None = None) -> int | None:
        """Wait for the refill that the last load started (a load that read a replaced node's
        files from their copies re-creates them on its new disk in the background: dcp_refill.py):
        the step refilled, or None (nothing to refill); ReplicationError where it failed (the step
        then loads as before, with one copy fewer of the replaced node's files)."""
        return None if self._refill is None else self._refill.wait(timeout)

    def close(self) -> None:
        """Release the engine kept between loads (the next load builds a new one); waits for a
        refill still running (its failure is logged, not raised: wait_refilled raises it)."""
        self._close_engines()
        self._end_refill()

    def _end_refill(self) -> None:
        """Wait for the last load's refill, if any, and give its channel back (its failure is
        not raised here: wait_refilled raises it)."""
        if self._refill is not None:
            try:
                self._refill.wait()
            except GDSWriterError:
                pass

    def __del__(self) -> None:
        # the engines only: a refill's channel is given back by a call every rank makes at the same
        # point (close, wait_refilled, the next load), never at a collection (dcp_refill.DcpRefill)
        if getattr(self, "_engines", None):
            self._close_engines()


def check_lost_roots(m: Manifest, reach: Sequence[Path | None]) -> None:
    """StepFilesLostError when a root of step ``m`` this rank reaches holds none of it any more:
    matched by its path alone (it has no ``.gdswriter-root`` while the manifest recorded one) and
    without the step's directory: a wiped or replaced node's disk. Said plainly, on every rank
    (read_data agrees on it), rather than as a step deleted while it was read. For one shared
    root (read alone); with node-local roots dcp_replicas.place_files says it, or reads a copy."""
    for g, (info, path) in enumerate(zip(m.dist.roots if m.dist is not None else (), reach)):
        if path is None or info.id.startswith("path:") or not any(f.root == g for f in m.files):
            continue
        if not (path / ROOT_MARKER_NAME).exists() and not (path / step_dir_name(m.step)).exists():
            raise StepFilesLostError(f"step {m.step}: root {path} (table root {g}, id {info.id}, ranks "
                                     f"{list(info.ranks)}) holds none of it any more: no {ROOT_MARKER_NAME}, no "
                                     f"{step_dir_name(m.step)} (a wiped or replaced node's disk?); its data files are "
                                     f"lost and no copy of them is on a peer node. Restore that disk, or load a "
                                     f"step saved elsewhere (for DCP steps that survive a lost node, save with "
                                     f"GDSStorageWriter(..., dist_options=DistOptions(replicas=2)))")


def records_of(plan: LoadPlan, m: Manifest, where: dict) -> list[TensorRecord]:
    """The tensor record of each item DCP asks for (``where``: DCP's storage_data, checked by
    check_dcp_records); CorruptCheckpointError for an item it does not map."""
    records = []
    for req in plan.items:
        if req.storage_index not in where:
            raise CorruptCheckpointError(f"step {m.step}: DCP asks for {req.storage_index}, which the "
                                         f"checkpoint's DCP metadata does not map to a record")
        records.append(m.tensors[where[req.storage_index]])
    return records


def in_place_targets(plan: LoadPlan, records: list[TensorRecord], m: Manifest,
                     planner: LoadPlanner) -> dict[int, torch.Tensor]:
    """{request index: DCP's target} for the items read straight into their targets: the only
    request of its storage, for the whole record, into a target that takes its bytes (whole_target)."""
    uses = Counter(rec.storage for rec in records)
    out: dict[int, torch.Tensor] = {}
    for i, (req, rec) in enumerate(zip(plan.items, records)):
        if uses[rec.storage] == 1:
            target = whole_target(req, rec, m, planner)
            if target is not None:
                out[i] = target
    return out


def hand_over(plan: LoadPlan, records: list[TensorRecord], in_place: dict[int, torch.Tensor],
              buffers: dict[int, torch.Tensor], planner: LoadPlanner) -> None:
    """Hand DCP each item: those read in place as they are, the others from their buffers."""
    for i, (req, rec) in enumerate(zip(plan.items, records)):
        if i in in_place:
            planner.commit_tensor(req, in_place[i])
        elif req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(buffers[rec.storage].numpy().tobytes()))
        else:
            copy_chunk(req, rec, buffers[rec.storage], planner)


def copy_chunk(req: Any, rec: TensorRecord, buf: torch.Tensor, planner: LoadPlanner) -> None:
    """Copy the part of record ``rec`` (its storage's bytes in ``buf``) that ``req`` asks for into
    DCP's target, and commit it."""
    src = chunk_view(req, rec, buf)
    target = planner.resolve_tensor(req).detach()
    if target.shape != src.shape:
        raise CorruptCheckpointError(f"{req.storage_index.fqn}: DCP asked for {list(target.shape)} elements, "
                                     f"the saved chunk gives {list(src.shape)}")
    target.copy_(src)
    planner.commit_tensor(req, target)


def chunk_view(req: Any, rec: TensorRecord, buf: torch.Tensor) -> torch.Tensor:
    """The part of saved record ``rec`` (its storage read into ``buf``) that DCP's read item
    ``req`` asks for: the record's strided view (validated with the manifest), narrowed. A
    request that does not fit the record (DCP plans it from the metadata, the record is the
    manifest's: a damaged step) is CorruptCheckpointError."""
    dtype = dtype_from_name(rec.dtype)
    src = torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), (buf.storage_offset() + rec.byte_offset)
                                           // dtype.itemsize, rec.shape, rec.stride)
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    if len(offsets) != src.dim() or len(lengths) != src.dim() or any(
            o + n > k for o, n, k in zip(offsets, lengths, src.shape)):
        raise CorruptCheckpointError(f"{req.storage_index.fqn}: DCP asks for the block {offsets} + {lengths} of a "
                                     f"saved chunk of shape {list(src.shape)}: the checkpoint's DCP metadata does not "
                                     f"match its tensor records; it is damaged: load an earlier step")
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        src = src.narrow(d, o, n)
    return src


def open_one_shared_root(coord: Coordinator, roots: Sequence[Path], step: int | None
                          ) -> tuple[RootLayout, int, Manifest] | None:
    """Collective, one decision round: the layout, step and manifest a load reads where every
    rank names one root, the same one (by id: a shared file system), and it holds committed
    steps; else None on every rank, and the reader opens its roots as GDSCheckpointer does
    (discover_layout, settle_primary, broadcast_manifest: four more rounds, which also report
    any error; node-local roots pay this round on top). Rank 0, that root's leader, reads the
    step's manifest before the round, from its root alone, and sends it with the decision.
    Where the layout holds, that is what the full protocol gives: choose_primary keeps rank
    0's first root when it holds committed steps, and the primary rank reads the manifest.
    Why: a DCP load makes a new reader each time, and the four rounds of the full protocol
    were most of what a 2-rank load of 96 MiB spent beyond FileSystemReader's (which reads
    DCP's metadata file on each rank, with no round of its own)."""
    ids: list[str] | None = None
    offer: SharedRootOffer | None = None
    table: tuple[RootInfo, ...] = ()
    try:
        if len(roots) == 1:
            ids = identify_roots(roots, create=False)
        if coord.rank == 0 and ids is not None and probe_root(roots[0])["committed"]:
            path = str(roots[0].resolve())
            table = (RootInfo(ids[0], path, tuple(range(coord.world_size))),)
            protocol = RankProtocol(RootLayout(0, coord.world_size, table, tuple(roots), tuple(ids), (0,), path))
            found = protocol.require(step)
            offer = SharedRootOffer(layout_parts(table, [[0]])[0], found, read_manifest_bytes(protocol, found).decode())
    except Exception:  # noqa: BLE001 - not this path: the full protocol reports it
        ids = offer = None

    def rule(outs: list) -> dict | None:
        return offer.to_wire() if offer is not None and all(o == ids for o in outs) else None

    decided = coord.decide(None, ids, "dcp.load (opening the checkpoint's root)", rule)
    if decided is None:
        return None
    assert ids is not None
    got = SharedRootOffer.from_wire(decided)
    layout = (RootLayout(0, coord.world_size, table, tuple(roots), tuple(ids), (0,), table[0].path) if table
              else layout_of_part(coord.rank, coord.world_size, roots, ids, got.part))
    m = received_manifest(coord, RankProtocol(layout), got.step, got.manifest.encode(), "dcp.load")
    return layout, got.step, m


def reader_engine_options(nbytes: int | None = None) -> EngineOptions:
    """The reader's engine options when none are given, for a load reading ``nbytes`` (None: a
    large one): GDSWRITER_* knobs, with 8 MiB staging buffers, as many as hold twice the bytes
    the queue keeps in flight (queue_depth x request_bytes: 8 by default), or the load's bytes
    when fewer (at least 2), unless the knobs set them.

    Why that many: an item read in place skips the staging buffers only where its target's
    address meets the device's O_DIRECT memory alignment (512 bytes on a virtio disk; torch
    puts large CPU tensors 64 bytes into a page); elsewhere every byte is staged, and a
    buffer that has been read stays out of the queue until it is copied into its target
    (and checksummed) in file order. With the pool only as large as the queue (4 x 8 MiB
    before) the queue ran short during every copy: 512 MiB cold on this VM waited 120-135 ms
    on the disk against 40-48 ms with 8 x 8 MiB, which GDSCheckpointer.load's 8 x 16 MiB pool
    also reaches. The cap (64 MiB by default) keeps the cost of building it small (7-21 ms
    here; the 128 MiB default pool took 44 ms to 1.5 s on a busy host, on every rank) and
    bounds it whatever a manifest claims; a small load gets a pool no larger than itself."""
    pool = {"buffer_bytes": ("GDSWRITER_BUFFER_BYTES", 8 << 20)}
    if "GDSWRITER_REQUEST_BYTES" in os.environ:
        del pool["buffer_bytes"]  # a buffer must hold whole requests of the size asked for
    options = EngineOptions.from_env(**{k: v for k, (var, v) in pool.items() if var not in os.environ})
    if "GDSWRITER_NUM_BUFFERS" in os.environ:
        return options
    per = options.buffer_bytes
    most = max(2, 2 * -(-options.queue_depth * options.request_bytes // per))
    count = most if nbytes is None else max(2, min(most, -(-nbytes // per)))
    return replace(options, num_buffers=count)


def pool_bytes(options: EngineOptions | None) -> int:
    return 0 if options is None else options.num_buffers * options.buffer_bytes


def check_dcp_records(m: Manifest, md: Metadata) -> None:
    """CorruptCheckpointError unless every record DCP's metadata maps an item to is what
    GDSStorageWriter writes for it: the item's chunk (its dtype, its sizes; the chunk inside the
    item's size), contiguous, at byte 0 of a storage of exactly its bytes (a BytesIO item: uint8,
    one dimension). The reader hands DCP a record's storage as that chunk (read_data,
    whole_target), so a stride, a byte offset or a size the writer never writes (a hand-made or
    damaged manifest) is refused here, before a buffer is allocated, not read as something else."""
    chunks: dict[str, dict[tuple[int, ...], Any]] = {}
    for index, i in md.storage_data.items():
        rec, entry = m.tensors[i], md.state_dict_metadata.get(index.fqn)
        nbytes = m.storages[rec.storage].nbytes
        if entry is None:
            why = "names no item of the DCP metadata"
        elif not hasattr(entry, "chunks"):  # BytesStorageMetadata
            why = _bytes_problem(rec, nbytes)
        else:
            if index.fqn not in chunks:
                chunks[index.fqn] = {tuple(c.offsets): c for c in entry.chunks}
            why = _chunk_problem(rec, nbytes, entry, chunks[index.fqn].get(tuple(index.offset or ())),
                                 list(index.offset or ()))
        if why:
            raise CorruptCheckpointError(f"step {m.step}: the record of DCP item {index.fqn!r} (record {i}) {why}: "
                                         f"GDSStorageWriter never writes that, so the manifest is damaged or was "
                                         f"not written by it; load an earlier step")


def _bytes_problem(rec: TensorRecord, nbytes: int) -> str:
    """What is wrong with the record of a BytesIO item (""): not its storage's bytes as uint8."""
    if rec.dtype != "uint8" or rec.shape != (nbytes,) or rec.stride != (1,) or rec.byte_offset:
        return f"is not the {nbytes} bytes of its storage (dtype {rec.dtype}, shape {list(rec.shape)})"
    return ""


def _chunk_problem(rec: TensorRecord, nbytes: int, entry: Any, chunk: Any, offsets: list[int]) -> str:
    """What is wrong with the record of a tensor chunk (""): no such chunk, a chunk outside the
    item, another shape or dtype, or not contiguous at byte 0 of a storage of its bytes."""
    size = tuple(entry.size)
    dtype = dtype_from_name(rec.dtype)
    numel = 1
    for n in rec.shape:
        numel *= n
    if chunk is None:
        return f"is at offsets {offsets}, where the item has no chunk"
    if any(o + n > g for o, n, g in zip(chunk.offsets, chunk.sizes, size)):
        return f"is the chunk {list(chunk.offsets)} + {list(chunk.sizes)}, outside the item's size {list(size)}"
    if rec.shape != tuple(chunk.sizes) or dtype != entry.properties.dtype:
        return (f"has shape {list(rec.shape)} and dtype {rec.dtype}, its chunk {list(chunk.sizes)} and "
                f"{dtype_to_name(entry.properties.dtype)}")
    if rec.stride != contiguous_stride(rec.shape) or rec.byte_offset or nbytes != numel * dtype.itemsize:
        return (f"is not contiguous at byte 0 of a storage of its {numel * dtype.itemsize} bytes (stride "
                f"{list(rec.stride)}, byte offset {rec.byte_offset}, storage {nbytes} bytes)")
    return ""


def whole_target(req: Any, rec: TensorRecord, m: Manifest, planner: LoadPlanner) -> torch.Tensor | None:
    """DCP's target for ``req`` when the request is the whole saved record and the target can
    take its bytes as they are (a contiguous CPU tensor of the saved dtype and shape): it is
    then read straight into. None otherwise (a resharded or cast item goes through a buffer)."""
    if req.type == LoadItemType.BYTE_IO or any(req.storage_offsets) or tuple(req.lengths) != tuple(rec.shape):
        return None
    dtype = dtype_from_name(rec.dtype)
    nbytes = dtype.itemsize
    for n in rec.shape:
        nbytes *= n
    if (rec.byte_offset != 0 or m.storages[rec.storage].nbytes != nbytes or nbytes == 0
            or tuple(rec.stride) != contiguous_stride(rec.shape)):
        return None
    target = planner.resolve_tensor(req).detach()
    if (target.device.type != "cpu" or target.dtype != dtype or tuple(target.shape) != tuple(rec.shape)
            or not target.is_contiguous() or target.is_conj() or target.is_neg()):
        return None
    return target


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
