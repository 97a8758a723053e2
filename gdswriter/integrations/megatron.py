"""Megatron-Core dist_checkpointing through gdswriter: a save and a load strategy.

    from megatron.core import dist_checkpointing
    from gdswriter.integrations.megatron import GDSLoadShardedStrategy, GDSSaveShardedStrategy
    save_strategy = GDSSaveShardedStrategy()          # keep one: its I/O engines are built once
    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=save_strategy)
    dist_checkpointing.load(sharded_sd, ckpt_dir, sharded_strategy=GDSLoadShardedStrategy())

or, with the common state in the step too (no common.pt):

    from gdswriter.integrations import megatron as gds_megatron
    gds_megatron.register()                            # once: load finds the strategies by metadata.json
    gds_megatron.save(sharded_sd, ckpt_dir, save_strategy)   # dist_checkpointing.save's arguments
    dist_checkpointing.load(sharded_sd, ckpt_dir)

``register()`` makes them Megatron's default strategies for the backend ``"gdswriter"``, so that
``sharded_strategy=("gdswriter", 1)`` works and ``dist_checkpointing.load`` picks the load
strategy by itself from the checkpoint's ``metadata.json``.

What lands where. Megatron's ShardedTensors go through DCP's planner (Megatron's own
MCoreSavePlanner/MCoreLoadPlanner, so resharding to another tensor- or data-parallel size works
as with ``torch_dist``) into gdswriter's DCP plug-in: ``ckpt_dir`` becomes a gdswriter root
holding one step (crc32c on every chunk, one atomic commit for all ranks, no pickle; ``gdswriter
verify ckpt_dir`` checks it). ShardedObjects (RNG states, ...) are stored in the same step,
encoded with gdswriter's state codec (JSON and raw tensor bytes, never pickle); an object the
codec cannot encode is refused with its path (UnsupportedObjectError). The common state: Megatron's
``dist_checkpointing.save`` writes it itself (``torch.save`` into ``common.pt``) and takes no other
common strategy; this module's ``save`` (the same arguments) stores it in the step instead, with
the same codec, and ``GDSCommonLoadStrategy`` reads it back, so nothing is pickled (docs/megatron.md).

Asynchronous saves (``async_sharded_save=True``) follow Megatron's AsyncRequest protocol as its
``torch_dist`` strategy does. ``async_save`` plans (DCP's collectives), copies this rank's
tensors to host memory and starts a thread in the training process that writes and fdatasyncs
them; it returns the AsyncRequest. Its ``async_fn`` (run by Megatron's async caller in its
forked or persistent worker) waits on a FIFO until those writes are durable. The writes stay in
the training process because the writer keeps state from ``write_data`` to the commit; the
engine's threads release the GIL while they wait on the disk. Its finalize function gathers the
ranks' reports and commits the step on rank 0 (then Megatron's own writes ``metadata.json``),
raising on every rank if any rank failed. So a checkpoint directory without ``metadata.json``
was never committed, and a kill at any point leaves the previous checkpoints loadable.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError, InvalidOptionError, RankFailedError, UnsupportedObjectError

BACKEND = "gdswriter"
VERSION = 1
COMMON_KEY = "__megatron_common__"  # the step's item holding the common state (this module's save)
_MAGIC = b"GDSMOBJ1"  # a ShardedObject's bytes: magic, header length, JSON header, then the tensors' bytes


def _megatron():
    """Megatron-Core's pieces this module uses, imported on first use (with a typed error)."""
    try:
        from megatron.core.dist_checkpointing import mapping, strategies  # noqa: F401
        from megatron.core.dist_checkpointing.strategies import base, torch as mtorch  # noqa: F401
    except ImportError as e:
        raise InvalidOptionError(f"gdswriter.integrations.megatron needs megatron-core ({e}): pip install "
                                 f"--no-deps megatron-core==0.16.1 (it needs only torch, numpy and packaging)") from e
    return base, mtorch, mapping


def _base_classes():
    try:
        from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy
    except ImportError:  # the module imports without Megatron; the classes need it
        return object, object
    return AsyncSaveShardedStrategy, LoadShardedStrategy


_SaveBase, _LoadBase = _base_classes()


# --------------------------------------------------------------------------- ShardedObjects, pickle-free
def encode_object(obj: Any, key: str) -> bytes:
    """A ShardedObject's data as bytes without pickle: the state codec's JSON tree, then the raw
    bytes of the tensors and arrays it holds. UnsupportedObjectError names what cannot be stored."""
    from ..format.state_codec import encode_state

    tree, tensors = encode_state(obj, key_path=key)
    metas, blobs = [], []
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        metas.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "nbytes": raw.numel()})
        blobs.append(raw.numpy().tobytes())
    header = json.dumps({"tree": tree, "tensors": metas}).encode()
    return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *blobs])


def decode_object(data: bytes, key: str) -> Any:
    """The inverse of encode_object; sizes are checked before anything is allocated."""
    from ..format.state_codec import decode_state

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"ShardedObject {key}: {why}; the step is damaged: run `gdswriter verify` on "
                                      f"its directory and load an earlier checkpoint")

    if len(data) < 16 or data[:8] != _MAGIC:
        raise bad("not an object stored by gdswriter's Megatron strategy")
    (hlen,) = struct.unpack("<Q", data[8:16])
    if 16 + hlen > len(data):
        raise bad(f"its header claims {hlen} bytes, {len(data) - 16} are there")
    try:
        header = json.loads(data[16:16 + hlen])
        metas, pos, tensors = header["tensors"], 16 + hlen, []
        for m in metas:
            dtype = getattr(torch, str(m["dtype"]))
            shape, nbytes = [int(s) for s in m["shape"]], int(m["nbytes"])
            if not isinstance(dtype, torch.dtype) or nbytes < 0 or pos + nbytes > len(data):
                raise bad(f"a tensor of {nbytes} bytes ({m['dtype']}) does not fit the {len(data)} bytes stored")
            raw = torch.frombuffer(bytearray(data[pos:pos + nbytes]), dtype=torch.uint8) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(shape))
            pos += nbytes
        return decode_state(header["tree"], tensors)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise bad(f"{type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------- flat views of a sharded state dict
def _grouped(sharded_state_dict: Any, main_only: bool) -> tuple[dict[str, list], list]:
    """{DCP key: [ShardedTensor...]} and the ShardedObjects, as Megatron's torch_dist groups them
    (a tensor by its key, an object by its unique key); ``main_only`` drops the replicas."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

    tensors: dict[str, list] = {}
    objects = []
    for v in nested_values(sharded_state_dict):
        if main_only and not is_main_replica(v.replica_id):
            continue
        if isinstance(v, ShardedTensor):
            tensors.setdefault(v.key, []).append(v)
        elif isinstance(v, ShardedObject):
            objects.append(v)
        else:
            raise UnsupportedObjectError(f"{type(v).__name__} in the sharded state dict: the gdswriter strategies "
                                         f"store ShardedTensors and ShardedObjects (apply the factories first, as "
                                         f"dist_checkpointing.save/load do)")
    return tensors, objects


def _staged(tensors: dict[str, list]) -> dict[str, list]:
    """Copies of the ShardedTensors holding host copies of their data: what the background write
    reads while training goes on changing the live tensors."""
    out: dict[str, list] = {}
    for key, shards in tensors.items():
        staged = []
        for sh in shards:
            c = copy.copy(sh)
            data = sh.data.detach()
            if data.device.type == "cpu":
                c.data = data.clone()
            else:
                c.data = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                c.data.copy_(data, non_blocking=True)
            staged.append(c)
        out[key] = staged
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


# --------------------------------------------------------------------------- the async protocol
def wait_until_written(fifo: str, inherited_fd: int = -1, owner_pid: int = -1) -> None:
    """The AsyncRequest's ``async_fn``: returns once this rank's writes (in the training process)
    are durable or failed (the finalize function tells which), or once the training process is
    gone: it reads the FIFO until every writer closed it, and only the training process holds
    its write end (a worker forked from process ``owner_pid`` closes the copy it inherited,
    ``inherited_fd``; run in that process itself, it closes nothing). Picklable for Megatron's
    persistent worker."""
    if inherited_fd >= 0 and os.getpid() != owner_pid:  # before opening: the number may be free here
        try:
            st, fifo_st = os.fstat(inherited_fd), os.stat(fifo)
            if (st.st_dev, st.st_ino) == (fifo_st.st_dev, fifo_st.st_ino):
                os.close(inherited_fd)
        except OSError:  # not inherited (a spawned worker, or closed before the fork)
            pass
    # O_NONBLOCK: a blocking open would wait for ever for a writer where the write ended before
    # this worker got here (the write end closed: EOF at once, which is the answer)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    try:
        while os.read(fd, 64):
            pass
    finally:
        os.close(fd)


class _PlanCapture:
    """The writer as Megatron's save_state_dict_async_plan sees it: every call goes to the
    GDSStorageWriter, and prepare_write_data (FileSystemWriterAsync's last planning call) keeps
    the planner for the background write."""

    def __init__(self, writer: Any):
        self.writer, self.planner = writer, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        self.planner = planner


class _Background:
    """One save's write on a thread of the training process, its outcome, and the write end of
    the FIFO the AsyncRequest's async_fn waits on (closed when the write is done, or by the
    kernel when the process dies)."""

    def __init__(self, writer: Any, plan: Any, planner: Any):
        self.dir = tempfile.mkdtemp(prefix="gdswriter-megatron-")
        self.fifo = os.path.join(self.dir, "written")
        os.mkfifo(self.fifo, 0o600)
        self.fd = os.open(self.fifo, os.O_RDWR)  # does not wait for a reader (Linux)
        os.set_inheritable(self.fd, False)
        self.results: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(writer, plan, planner), daemon=True,
                                       name="gdswriter-megatron-save")
        self.thread.start()

    def _run(self, writer: Any, plan: Any, planner: Any) -> None:
        try:
            self.results = writer.write_data(plan, planner).wait()
        except BaseException as e:  # noqa: BLE001 - handed to the finalize function, raised there
            self.error = e
        finally:
            os.close(self.fd)  # the async_fn's read ends

    def join(self) -> None:
        self.thread.join()
        shutil.rmtree(self.dir, ignore_errors=True)


class GDSSaveShardedStrategy(_SaveBase):  # type: ignore[misc,valid-type]
    """Megatron's AsyncSaveShardedStrategy writing gdswriter steps (module docstring).
    ``options``/``dist_options``: the writer's (CheckpointOptions, DistOptions);
    ``keep_only_main_replica``: as torch_dist's (only the main replica of each shard is saved);
    ``process_group``: the group Megatron saves with (None: the default group)."""

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, options: Any = None,
                 dist_options: Any = None, keep_only_main_replica: bool = True, process_group: Any = None):
        _megatron()
        super().__init__(backend, version)
        from ..distributed import GDSStorageWriter

        self.keep_only_main_replica = keep_only_main_replica
        self.process_group = process_group
        self.writer = GDSStorageWriter(options=options, dist_options=dist_options, process_group=process_group)
        self._inflight: _Background | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path, common: bytes | None = None) -> Any:
        """Plan, copy this rank's shards to host memory and start writing them; the returned
        AsyncRequest waits for the writes and its finalize function commits (module docstring).
        ``common``: the common state, encoded (encode_object), stored in the step by the rank
        passing it (this module's ``save`` does, on rank 0)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
        from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
        from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner, mcore_to_pyt_state_dict

        if self._inflight is not None:  # Megatron finalizes a save before it starts the next
            self._inflight.join()
            self._inflight = None
        tensors, objects = _grouped(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict: dict[str, Any] = mcore_to_pyt_state_dict(_staged(tensors), False)
        for obj in objects:
            pyt_state_dict[obj.unique_key] = io.BytesIO(encode_object(obj.data, obj.unique_key))
        if common is not None:
            pyt_state_dict[COMMON_KEY] = io.BytesIO(common)
        self.writer.reset(os.fspath(checkpoint_dir))
        capture = _PlanCapture(self.writer)
        (_, metadata, dist_wrapper), central_plan, *_ = save_state_dict_async_plan(
            pyt_state_dict, capture, self.process_group, 0,
            planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                     flatten_state_dict=False))
        bg = _Background(self.writer, central_plan, capture.planner)
        self._inflight = bg

        def finalize() -> None:
            bg.join()
            self._inflight = None
            _commit(self.writer, metadata, dist_wrapper, bg)

        return AsyncRequest(wait_until_written, (bg.fifo, bg.fd, os.getpid()), [finalize])

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """The blocking save: the async request, run at once (Megatron's own definition)."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()

    def close(self) -> None:
        """Wait for a save in flight's writes and release the writer's roots and engines."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
        self.writer.close()


def _commit(writer: Any, metadata: Any, dist_wrapper: Any, bg: _Background) -> None:
    """Every rank: its outcome to the coordinator, which commits only when every rank wrote;
    then the verdict to every rank. Raises the rank's own error, or RankFailedError."""
    mine = None if bg.error is None else f"{type(bg.error).__name__}: {bg.error}"
    gathered = dist_wrapper.gather_object((mine, bg.results if bg.error is None else None))
    verdict: dict[int, str] = {}
    if dist_wrapper.is_coordinator:
        verdict = {r: m for r, (m, _) in enumerate(gathered) if m is not None}
        if not verdict:
            try:
                writer.finish(metadata, [res for _, res in gathered])
            except Exception as e:  # noqa: BLE001 - every rank learns it below
                verdict = {dist_wrapper.rank: f"{type(e).__name__}: {e}"}
                bg.error = e
    verdict = dist_wrapper.broadcast_object(verdict)
    if bg.error is not None:
        raise bg.error
    if verdict:
        raise RankFailedError("gdswriter's Megatron save", verdict)


class GDSLoadShardedStrategy(_LoadBase):  # type: ignore[misc,valid-type]
    """Megatron's LoadShardedStrategy reading gdswriter steps, resharding through DCP's planner as
    torch_dist does. ``atomic=True``: nothing is changed before every byte was verified;
    ``verify``, ``engine_options``, ``dist_options``, ``process_group``: GDSStorageReader's.
    One reader is kept from load to load (its engine is built once); ``close()`` releases it."""

    def __init__(self, *, atomic: bool = False, verify: bool = True, engine_options: Any = None,
                 dist_options: Any = None, process_group: Any = None):
        _megatron()
        super().__init__()
        from ..distributed import GDSStorageReader

        self.reader = GDSStorageReader(atomic=atomic, verify=verify, engine_options=engine_options,
                                       dist_options=dist_options, process_group=process_group)

    def close(self) -> None:
        """Release the reader's engine."""
        self.reader.close()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Each ShardedTensor's data read in place (its ``data``, or a new tensor where it has none)
        and each ShardedObject decoded; returns the state dict with them in place of the shards."""
        import torch.distributed.checkpoint as dcp
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        from megatron.core.dist_checkpointing.strategies.torch import mcore_to_pyt_state_dict

        tensors, objects = _grouped(sharded_state_dict, main_only=False)
        flexible = [s for shards in tensors.values() for s in shards if not s.allow_shape_mismatch]
        mismatch = {s.key: s for shards in tensors.values() for s in shards if s.allow_shape_mismatch}
        pyt_state_dict: dict[str, Any] = mcore_to_pyt_state_dict(tensors, True)
        for obj in objects:
            pyt_state_dict[obj.unique_key] = io.BytesIO()
        planner = _raw_bytes_planner()(shapes_validation_sharded_tensors=flexible,
                                       allow_shape_mismatch_sharded_tensors=mismatch, flatten_state_dict=False)
        dcp.load(pyt_state_dict, checkpoint_id=os.fspath(checkpoint_dir), storage_reader=self.reader, planner=planner)
        decoded = {id(o): decode_object(planner.raw.get(o.unique_key, b""), o.unique_key) for o in objects}

        def value(v: Any) -> Any:
            if isinstance(v, ShardedTensor):
                return v.data
            if isinstance(v, ShardedObject):
                return decoded[id(v)]
            return v

        return dict_list_map_inplace(value, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> Any:
        """{key: ShardedTensor without data}: each stored tensor's global shape and dtype, as
        torch_dist's strategy returns them (Megatron's strict loads compare keys with these). Read
        by this rank alone (a single-process reader): not a collective, as torch_dist's is not."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = metadata if metadata is not None else _metadata_of(checkpoint_dir)
        return {k: ShardedTensor.from_rank_offsets(k, torch.empty(tp.size, **tp.properties.__dict__,
                                                                  device="meta")).without_data()
                for k, tp in md.state_dict_metadata.items() if isinstance(tp, TensorStorageMetadata)}

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> Any:
        """load_tensors_metadata's tensors and the ShardedObjects (empty, by their unique keys), as
        torch_dist's strategy returns them; the common state this module's save stores is left out."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = _metadata_of(checkpoint_dir)
        out: dict[str, Any] = {}
        for k, meta in md.state_dict_metadata.items():
            if isinstance(meta, BytesStorageMetadata) and k != COMMON_KEY:
                obj = ShardedObject.empty_from_unique_key(k)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, md))
        return out

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise InvalidOptionError(f"{loaded_backend!r} checkpoint: GDSLoadShardedStrategy reads the checkpoints "
                                     f"GDSSaveShardedStrategy wrote (backend {BACKEND!r}); load this one with "
                                     f"Megatron's default strategy (sharded_strategy=None)")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise InvalidOptionError(f"gdswriter strategy version {loaded_version} is not one this gdswriter reads "
                                     f"({VERSION}): load it with the gdswriter release that wrote it")


def _metadata_of(checkpoint_dir: str | Path) -> Any:
    """The DCP Metadata of the step in ``checkpoint_dir``, read by this process alone."""
    from ..distributed import GDSStorageReader
    from ..distributed.dcp import CarriedError

    reader = GDSStorageReader(single_process=True)
    try:
        reader.reset(os.fspath(checkpoint_dir))
        return reader.read_metadata()
    except CarriedError as e:  # read_metadata's wrapper for DCP's load: the checkpoint's own error
        raise e.error from e
    finally:
        reader.close()


def _raw_bytes_planner() -> type:
    """Megatron's MCoreLoadPlanner keeping a BytesIO item's bytes as they are: DCP's default
    would torch.load (unpickle) them. ``raw``: {key: bytes} of the items read."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    class RawBytesLoadPlanner(MCoreLoadPlanner):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.raw: dict[str, bytes] = {}

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.raw[read_item.dest_index.fqn] = value.getvalue() if isinstance(value, io.BytesIO) else value.read()

    return RawBytesLoadPlanner


def save(sharded_state_dict: Any, checkpoint_dir: str, sharded_strategy: Any = None, common_strategy: Any = None,
         validate_access_integrity: bool = True, async_sharded_save: bool = False,
         preprocess_common_before_consistancy_check: Any = None, content_metadata: dict | None = None) -> Any:
    """Megatron's ``dist_checkpointing.save`` (same arguments) storing the common state in the
    step too, encoded with gdswriter's state codec instead of ``torch.save`` into common.pt:
    nothing of the checkpoint is pickled. A common state the codec cannot store (an
    ``argparse.Namespace``, say) is refused on every rank, before anything is written, with its
    path (UnsupportedObjectError). metadata.json names the common backend "gdswriter", so
    ``dist_checkpointing.load`` after ``register()`` reads it back (GDSCommonLoadStrategy)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    if common_strategy is not None:
        raise InvalidOptionError("common_strategy: gdswriter's save stores the common state in the step; pass None")
    strategy = sharded_strategy if sharded_strategy is not None else GDSSaveShardedStrategy()
    if not isinstance(strategy, GDSSaveShardedStrategy):
        raise InvalidOptionError(f"sharded_strategy={strategy}: gdswriter's save takes a GDSSaveShardedStrategy "
                                 f"(or None); use dist_checkpointing.save for Megatron's own strategies")
    if content_metadata is not None:
        sharded_state_dict["content_metadata"] = content_metadata
    sharded_part, common_state_dict = save_preprocess(sharded_state_dict, validate_access_integrity,
                                                      preprocess_common_before_consistancy_check)
    common = encode_object(common_state_dict, "common")  # every rank: the same state, refused everywhere alike
    request = strategy.async_save(sharded_part, checkpoint_dir, common if dist.get_rank() == 0 else None)

    def metadata_finalize_fn() -> None:
        if dist.get_rank() == 0:
            save_config(CheckpointingConfig(strategy.backend, strategy.version, BACKEND, VERSION), checkpoint_dir)
        dist.barrier()

    request.finalize_fns.append(metadata_finalize_fn)
    if async_sharded_save:
        return request
    request.execute_sync()
    return None


def _common_base() -> type:
    try:
        from megatron.core.dist_checkpointing.strategies.base import LoadCommonStrategy
    except ImportError:
        return object
    return LoadCommonStrategy


class GDSCommonLoadStrategy(_common_base()):  # type: ignore[misc]
    """Megatron's LoadCommonStrategy for the checkpoints this module's ``save`` wrote: the common
    state read from the step (one item, on every rank: DCP's load is collective) and decoded,
    never unpickled. ``reader``: a GDSStorageReader to use (default: a new one per load)."""

    def __init__(self, reader: Any = None):
        _megatron()
        super().__init__()
        self.reader = reader

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        import torch.distributed.checkpoint as dcp

        from ..distributed import GDSStorageReader

        reader = self.reader if self.reader is not None else GDSStorageReader()
        planner = _raw_bytes_planner()(shapes_validation_sharded_tensors=[], allow_shape_mismatch_sharded_tensors={},
                                       flatten_state_dict=False)
        try:
            dcp.load({COMMON_KEY: io.BytesIO()}, checkpoint_id=os.fspath(checkpoint_dir), storage_reader=reader,
                     planner=planner)
        finally:
            if self.reader is None:
                reader.close()
        return decode_object(planner.raw.get(COMMON_KEY, b""), "common")

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        raise NotImplementedError("GDSLoadShardedStrategy loads the ShardedObjects of a gdswriter checkpoint: pass "
                                  "it as the sharded strategy (register() makes it the default)")

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise InvalidOptionError(f"common backend {loaded_backend!r}: GDSCommonLoadStrategy reads the common "
                                     f"state gdswriter's save stored in the step; this checkpoint has Megatron's "
                                     f"common.pt: load it with common_strategy=None")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise InvalidOptionError(f"gdswriter common state version {loaded_version} is not one this gdswriter "
                                     f"reads ({VERSION}): load it with the gdswriter release that wrote it")


def register() -> None:
    """Make the gdswriter strategies Megatron's defaults for the backend "gdswriter": then
    ``sharded_strategy=("gdswriter", 1)`` saves with them and ``dist_checkpointing.load`` picks the
    load strategies (sharded, and common where this module's ``save`` stored it) from the
    checkpoint's metadata.json."""
    base, _, _ = _megatron()
    base.register_default_strategy(base.StrategyAction.SAVE_SHARDED, BACKEND, VERSION, GDSSaveShardedStrategy())
    base.register_default_strategy(base.StrategyAction.LOAD_SHARDED, BACKEND, VERSION, GDSLoadShardedStrategy())
    base.register_default_strategy(base.StrategyAction.LOAD_COMMON, BACKEND, VERSION, GDSCommonLoadStrategy())
