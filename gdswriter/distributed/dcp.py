"""torch.distributed.checkpoint (DCP) on gdswriter's engine, format and commit protocol.

    dcp.save(state_dict, checkpoint_id="ckpts/step-100", storage_writer=GDSStorageWriter())
    dcp.load(state_dict, checkpoint_id="ckpts/step-100", storage_reader=GDSStorageReader())
    dcp.save(state_dict, storage_writer=GDSStorageWriter(root, step=100))   # steps under one root
    dcp.load(state_dict, storage_reader=GDSStorageReader(root))             # its latest step
    dcp.async_save(state_dict, checkpoint_id=path, storage_writer=GDSStorageWriter(), ...)

What a checkpoint_id names (``reset``, which DCP calls with it before anything else):

* a path (a str that is not all digits, or any os.PathLike), as for FileSystemWriter: the path
  names one checkpoint. The directory becomes a gdswriter root holding that checkpoint as one
  step, numbered by the number its name ends with after "step" (``step-100``, ``step_100``:
  100; else 0), so ``gdswriter ls/inspect/verify/export PATH`` work on it and removing the
  directory removes the checkpoint. After the step commits, the coordinator writes PATH/.metadata,
  a small JSON marker (not DCP's pickle), so tools that look for DCP checkpoints by that file
  (torchtitan's resume) find complete ones only; FileSystemReader cannot read it (pickle
  reports "invalid load key"): load with GDSStorageReader. A writer made with several roots
  (SSDs) maps a path under its first root to the same relative path under each root.
* a step number (an int, or a str of digits): that step under the roots given at construction.

``overwrite=False`` refuses (CheckpointExistsError, raised on every rank) a save whose target
already holds a checkpoint: the step it names, or, for a path or a root given without a step,
any committed step there (or a DCP ``.metadata``), as FileSystemWriter refuses a directory
holding one. With ``overwrite=True`` (the default, as FileSystemWriter's) a re-saved step
replaces the old one in one atomic exchange, with a warning.

DCP plans (which rank saves which chunk of which tensor; resharding on load); gdswriter
stores. A checkpoint is a step under its root like any other: every DCP item is a storage with
one tensor record named by its fully qualified name (a chunk of a sharded tensor records its
block as ``shard``; a BytesIO item is a uint8 tensor of its bytes), and DCP's Metadata is
stored as JSON in the manifest's ``dist.dcp`` (dcp_codec.py; no pickle). Tensor items that
several ranks hold (replicated state, which DCP would give whole to one rank) are split across
their holders by planner/ranks.py, as GDSCheckpointer does. The commit is dist/commit.py's,
carried by DCP's own protocol (commit.py OrderedCommit): the coordinator decides the step and
the temporary directories' token in ``prepare_global_plan`` (DCP scatters them in the plans),
every rank writes and makes its files durable (and publishes the secondary roots it alone
sees) in ``write_data``, whose WriteResults carry its report (files, chunks, crc32c, records)
to the coordinator in DCP's gather, and ``finish`` checks the reports and commits. DCP runs
``finish`` only when every rank's ``write_data`` succeeded, and raises on every rank otherwise
(and when ``finish`` raises): nothing is then committed. The storage side adds no collective to
a save's, also where the writer opens its roots (at its first save, for a new checkpoint_id
directory, after a save that failed before writing): each rank's ``set_up_storage_writer``
makes its roots and their identities and probes them (rank 0, which leads every root it sees,
under their lock), its local plan carries that to the coordinator, which builds the table of
distinct roots (by identity), chooses the primary (refused unless it is rank 0's) and sends
each rank its part of the table in its global plan (roots.py's discover_layout and
settle_primary, carried by DCP's gather and scatter); the other ranks lock the roots they lead
in ``write_data``, check that they did not change since they probed them, and clean them. A
root that several ranks see but another rank than rank 0 leads (one SSD per node shared by
that node's ranks: a joint root) is published by its own ranks inside ``write_data``: each
marks in the step's temporary directory there that its files are durable, and the one that
finds every sharing rank's mark renames it (commit.py OrderedCommit: "the last one
publishes"); the reports say who published what, and ``finish`` refuses to commit a step with a
joint root that nobody published (a copied root). Re-saving a committed step, a rank leading a
secondary root writes beside the committed files, in the committed step directory, under names
of its own (OrderedCommit), so nothing of the old step changes before the coordinator's commit;
the files no committed manifest names are removed at the writer's next save, whichever
checkpoint_id it targets (the ranks say where they wrote beside a step in their local plans, the
coordinator sends each root's leader the names the committed manifest lists there in its global
plan; the roots of an earlier checkpoint_id are kept for that: _lock_formers, _formers_live).
The writer never makes a coordination channel of its own.

Loading reads each item DCP asks for whole straight into DCP's target tensor (its checksum
computed as it is read) and only resharded or cast items through a buffer, as FileSystemReader
copies each item into its target as it goes: a damaged file raises ChecksumMismatchError on
every rank, and the targets read so far are overwritten. Where every rank names one root, the
same one, a load adds one round of collectives to DCP's (rank 0 sends the manifest with the
decision, ``_open_one_shared_root``) and each rank reads alone, DCP's gather of read_data's
outcomes carrying a failure to every rank; other layouts open and read as GDSCheckpointer
does. ``GDSStorageReader(atomic=True)`` reads everything into fresh buffers, verifies it on
every rank, and only then changes a target.

Errors. DCP runs the storage layer's calls inside its collectives and wraps what they raise in
``CheckpointException`` (a BaseException: ``except Exception`` misses it), whose message ends
with gdswriter's. What DCP calls outside them raises gdswriter's typed error itself: the
constructors' option checks and ``reset``'s check of the checkpoint_id (a URL, a negative step).
``dcp_errors()`` re-raises the gdswriter error inside a CheckpointException (the failing rank's
own, before the other ranks' RankFailedError), from it, so ``except CheckpointExistsError`` works.

Between saves the writer keeps its engines (io_uring rings and page-locked staging buffers,
which take 25-150 ms to build per root) and its opened roots (their table and identities, not
their locks: each save takes those again, locally); ``close()`` releases both. A reader keeps
its one engine. The writer and reader pickle as their arguments, so DCP's process-based async_save
can ship them to its checkpoint process; engines, locks and the coordination group open there
on first use.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import re
import secrets
import socket
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..engines.base import IOEngine
from ..engines.select import create_engine
from ..errors import (CheckpointExistsError, CorruptCheckpointError, EngineIOError, GDSWriterError,
                      InvalidOptionError, RankFailedError, RootUnavailableError)
from ..format.commit import ROOT_MARKER_NAME, TMP_PREFIX, RootIdentity, RootLock, normalize_roots
from ..format.dtypes import dtype_from_name, dtype_to_name
from ..format.manifest import Manifest, RootInfo, ShardInfo, TensorRecord
from ..format.sharded import parse_step
from ..format.state_codec import key_text
from .._log import log_once
from ..fs import atomic_write, fsync_dir, link_no_clobber, read_regular_file, write_durable
from ..options import CheckpointOptions, EngineOptions
from ..planner.assign import plan_save
from ..load.reader import host_buffer, read_manifest_bytes
from ..save.snapshot import Extent, Snapshot
from ..save.writer import live_spans, write_files
from ..format.assembly import build_manifest, record_json
from .commit import OrderedCommit, clean_resaved, saves_beside
from .dcp_codec import metadata_from_json, metadata_to_json
from .fetch import fetch_storages, manifest_reach
from .group import Coordinator, describe
from .load import broadcast_manifest, rebuild_state, received_manifest
from .options import DistOptions
from .rankfiles import file_entries, group_held, rank_targets
from .roots import (RootLayout, build_table, clean_led, discover_layout, identify_roots, layout_of_part,
                    layout_parts, lock_led, primary_of, probe_led, probe_root, root_identity, settle_primary)
from .session import DistSession, RankProtocol, primary_not_on_rank_0

log = logging.getLogger("gdswriter")

MARKER_NAME = ".metadata"  # DCP's metadata file name: gdswriter writes a JSON marker there
MARKER_FORMAT = "gdswriter-dcp"
REPORT_FQN = "gdswriter.rank-report"  # the WriteResult carrying a rank's report to finish()
_STEP_IN_NAME = re.compile(r"step[-_=]?(\d+)$", re.IGNORECASE)


def _is_step(checkpoint_id: Any) -> bool:
    return isinstance(checkpoint_id, int) or (isinstance(checkpoint_id, str) and checkpoint_id.isdigit())


def _step_of(checkpoint_id: Any) -> int | None:
    """A step number given as a step= argument: an int >= 0 or a str of digits (None: the writer's choice)."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, bool) or not _is_step(checkpoint_id) or int(checkpoint_id) < 0:
        raise InvalidOptionError(f"step={checkpoint_id!r}: expected a step number (an int >= 0 or a string of "
                                 f"digits), or None")
    return int(checkpoint_id)


def step_in_name(path: str | os.PathLike) -> int:
    """The step a checkpoint_id path's checkpoint is stored as: the number its last component
    ends with after "step" (``step-100``, ``step_100``, ``step100``), else 0."""
    found = _STEP_IN_NAME.search(Path(os.fspath(path)).name)
    return int(found.group(1)) if found else 0


def parse_checkpoint_id(checkpoint_id: Any) -> tuple[Path | None, int | None]:
    """(path, None) for a path, (None, step) for a step number; InvalidOptionError otherwise.
    Called in reset(), outside DCP's collectives, so its error reaches the caller unwrapped
    (every rank passes the same checkpoint_id, so every rank raises it)."""
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, (int, str, os.PathLike)):
        raise InvalidOptionError(f"checkpoint_id={checkpoint_id!r} ({type(checkpoint_id).__name__}): gdswriter's DCP "
                                 f"plug-in takes a directory path (str or os.PathLike) naming one checkpoint, or a "
                                 f"step number under the writer's/reader's root")
    if _is_step(checkpoint_id):
        if int(checkpoint_id) < 0:
            raise InvalidOptionError(f"checkpoint_id={checkpoint_id!r}: a step number must be >= 0")
        return None, int(checkpoint_id)
    text = os.fspath(checkpoint_id)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text or "://" in text:
        raise InvalidOptionError(f"checkpoint_id={checkpoint_id!r}: gdswriter writes to local directories (O_DIRECT, "
                                 f"fsync); for object stores use DCP's FsspecWriter/FsspecReader, or give a local path")
    return Path(text), None


def _local_path_ok(checkpoint_id: Any, *, must_exist: bool) -> bool:
    try:
        path, step = parse_checkpoint_id(checkpoint_id)
    except InvalidOptionError:
        return False
    if path is None:
        return True  # a step number under the root the plug-in was made with
    if must_exist:
        return path.is_dir() and ((path / MARKER_NAME).is_file() or any(path.glob("step_*")))
    for p in (path, *path.parents):
        if p.exists():
            return p.is_dir() and os.access(p, os.W_OK)
    return False


def _marker_bytes() -> bytes:
    return (json.dumps({"format": MARKER_FORMAT, "version": 1,
                        "note": "a gdswriter checkpoint (not DCP's pickled metadata): load it with dcp.load(..., "
                                "storage_reader=gdswriter.distributed.GDSStorageReader(), checkpoint_id=this "
                                "directory), or use the gdswriter command (ls, verify, export)"}) + "\n").encode()


def is_gdswriter_marker(path: Path) -> bool:
    """``path`` (a .metadata file) is the marker gdswriter writes, not a DCP pickle."""
    try:
        return json.loads(read_regular_file(path, 4096)).get("format") == MARKER_FORMAT
    except (OSError, CorruptCheckpointError, ValueError, AttributeError):
        return False


class CarriedError(BaseException):
    """An error (gdswriter's, typically) on its way out of GDSStorageReader.read_metadata. DCP's load (torch
    2.13) catches an Exception raised there, retries, and raises an AssertionError holding only
    its message; a BaseException goes on into DCP's CheckpointException as it is, so the
    checkpoint's own error (CheckpointNotFoundError, CorruptCheckpointError...) stays typed and
    dcp_errors() can raise it. Never raised outside DCP's load."""

    def __init__(self, error: BaseException):
        super().__init__(describe(error))
        self.error = error

    def __reduce__(self) -> tuple:  # DCP gathers the ranks' failures with pickle
        return type(self), (self.error,)


@contextlib.contextmanager
def dcp_errors() -> Iterator[None]:
    """Re-raise the gdswriter error a CheckpointException carries, from it.

        with dcp_errors():
            dcp.save(state_dict, checkpoint_id=path, storage_writer=GDSStorageWriter(overwrite=False))

    DCP wraps what a storage layer raises inside its collectives in CheckpointException (a
    BaseException), with every failed rank's error. This raises the first rank's own gdswriter
    error (a RankFailedError, which only says that another rank failed, only when no rank has a
    more precise one); a CheckpointException without a gdswriter error goes on unchanged."""
    try:
        yield
    except CheckpointException as ce:
        failures = [exc.error if isinstance(exc, CarriedError) else exc for _, (exc, _) in sorted(ce.failures.items())]
        errors = [exc for exc in failures if isinstance(exc, GDSWriterError)]
        precise = [e for e in errors if not isinstance(e, RankFailedError)] or errors
        if not precise:
            raise
        raise precise[0] from ce


class _Collective:
    """What the writer and reader share: roots, options, and a coordinator opened on first use."""

    _OPEN = ("_coord", "_session", "_items", "_save", "_loaded", "_engines", "_engine_made", "_opening",
             "_open_lock", "_formers", "_former_lock", "_former_paths")  # resources, per-save state: not pickled

    def __init__(self, root: Any, step: int | None, process_group: Any, single_process: bool,
                 dist_options: DistOptions | None):
        self.roots = normalize_roots(root) if root is not None else None
        self.step = _step_of(step)
        self.process_group = process_group
        self.single_process = single_process
        self.dist_options = dist_options or DistOptions.from_env()
        self._coord: Coordinator | None = None
        self._path_roots: list[Path] | None = None  # the roots a checkpoint_id path names (reset)
        self._override: int | None = None  # the step a checkpoint_id names

    def place(self) -> tuple[int, int]:
        """This rank's rank and the world size in the plug-in's group, without its coordination
        channel (whose creation is a collective: only a reader makes it, for a load that needs it)."""
        if self._coord is not None:
            return self._coord.rank, self._coord.world_size
        import torch.distributed as dist

        if self.single_process or not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        pg = self.process_group if self.process_group is not None else dist.group.WORLD
        return dist.get_rank(pg), dist.get_world_size(pg)

    def coordinator(self) -> Coordinator:
        if self._coord is None:
            self._coord = Coordinator.solo() if self.single_process else Coordinator.for_group(
                self.process_group, timeout_s=self.dist_options.timeout_s)
        return self._coord

    def _target(self, checkpoint_id: Any) -> None:
        """Point at what ``checkpoint_id`` names (see the module docstring); None: no change."""
        if checkpoint_id is None:
            return
        path, step = parse_checkpoint_id(checkpoint_id)
        if path is None:
            self._path_roots, self._override = None, step
            return
        roots = [path]
        if self.roots is not None and len(self.roots) > 1:
            try:
                rel = path.resolve().relative_to(self.roots[0].resolve())
            except ValueError:
                raise InvalidOptionError(
                    f"checkpoint_id={os.fspath(checkpoint_id)!r} is not under this plug-in's first root "
                    f"{self.roots[0]}: with several roots (SSDs) a checkpoint_id path names a directory under "
                    f"the first, stored at the same relative path under each") from None
            roots = [r / rel for r in self.roots]
        self._path_roots, self._override = normalize_roots(roots), None

    def current_roots(self) -> list[Path]:
        roots = self._path_roots or self.roots
        if roots is None:
            raise InvalidOptionError(f"{type(self).__name__} has no directory: pass checkpoint_id=PATH to "
                                     f"dcp.save/dcp.load, or give the root to {type(self).__name__}(root)")
        return roots

    @property
    def checkpoint_id(self) -> str:
        """The directory this plug-in reads or writes (DCP logs it)."""
        roots = self._path_roots or self.roots
        return "" if roots is None else os.fspath(roots[0])

    def __getstate__(self) -> dict:
        """What DCP's process-based async_save sends to its checkpoint process: the arguments.
        A process group cannot travel; there the plug-in coordinates over that process's default
        group, which DCP builds over the ranks of the process_group given to async_save (pass
        the same group to both)."""
        state = dict(self.__dict__)
        for k in self._OPEN:
            state[k] = None  # reopened (or rebuilt) where they are used
        state["process_group"] = None
        return state


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


def _check_fs_options(*, sync_files: Any, thread_count: Any, per_thread_copy_ahead: Any, single_file_per_rank: Any,
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


class GDSStorageWriter(_Collective, StorageWriter):
    """A DCP StorageWriter. ``root``: this rank's root or list of roots (the first the primary on
    rank 0, as for GDSCheckpointer), or None when every save passes checkpoint_id=PATH (see the
    module docstring for what a checkpoint_id names). ``step``: the step to store under ``root``
    (None: the step after the latest). ``overwrite``: whether a save may replace a checkpoint
    already there (False: CheckpointExistsError). ``process_group``: the group DCP saves with
    (default: the default group; torchtitan passes its own gloo group to async_save: pass it here
    too); ``single_process=True`` for dcp.save(no_dist=True) in a distributed job.

    FileSystemWriter's other options are taken so that code written for it runs unchanged, and
    each says here what gdswriter does instead (a value other than FileSystemWriter's default is
    logged once, as a warning): ``sync_files`` (gdswriter always fdatasyncs every file before the commit: that
    is its crash safety, so False is not honoured), ``thread_count`` (gdswriter writes each root
    from one thread through io_uring with ``EngineOptions.queue_depth`` requests in flight),
    ``per_thread_copy_ahead`` (staging goes through ``EngineOptions.buffer_bytes`` x ``num_buffers``
    page-locked buffers), ``single_file_per_rank`` (each rank writes ``CheckpointOptions.
    files_per_root`` files per root). Refused, with the reason: ``cache_staged_state_dict=True``
    (this writer is no AsyncStager: give dcp.async_save an ``async_stager``), ``_extensions``
    (gdswriter stores raw bytes with crc32c, no stream transforms such as compression) and a
    ``serialization_format`` other than TORCH_SAVE (gdswriter has its own format; ``gdswriter
    export --to safetensors`` converts a step)."""

    def __init__(self, root: Any = None, step: int | None = None, *, options: CheckpointOptions | None = None,
                 dist_options: DistOptions | None = None, process_group: Any = None, single_process: bool = False,
                 overwrite: bool = True, sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, single_file_per_rank: bool = True,
                 cache_staged_state_dict: bool = False, _extensions: Sequence[Any] | None = None,
                 serialization_format: Any = SerializationFormat.TORCH_SAVE):
        _check_fs_options(sync_files=sync_files, thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
                          single_file_per_rank=single_file_per_rank, cache_staged_state_dict=cache_staged_state_dict,
                          extensions=_extensions, serialization_format=serialization_format)
        if not isinstance(overwrite, bool):
            raise InvalidOptionError(f"overwrite={overwrite!r}: expected True or False")
        _Collective.__init__(self, root, step, process_group, single_process, dist_options)
        self.options = options or CheckpointOptions()
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex
        self._session: DistSession | None = None  # the opened roots, kept from save to save (their locks are not)
        self._session_roots: list[Path] | None = None  # the roots it was opened for
        self._wrote = False  # this save reached write_data (DCP's plans went out): its session may be kept
        self._opening: dict | None = None  # this save opens the roots: what set_up found on them (_open_local)
        self._open_lock: RootLock | None = None  # rank 0's lock on its roots, taken by set_up while opening
        self._items: dict[str, Any] = {}   # chunk key -> this rank's WriteItem
        self._save: dict | None = None     # step, commit and reports of the save in progress
        self._engines: list[IOEngine] | None = None  # one per local root, kept from save to save
        self._beside: set[tuple[str, int]] = set()  # (root id, step): files of several saves in a step (OrderedCommit)
        self._formers: list[DistSession] | None = []  # sessions of roots left for others, owed a cleaning (_lock_formers)
        self._former_lock: RootLock | None = None  # another rank than 0: its former roots it cleans this save
        self._former_paths: set[Path] | None = set()  # those roots

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for what reset() takes: a local path whose nearest existing ancestor is a writable
        directory (as FileSystemWriter answers), or a step number; False for URLs and the rest."""
        return _local_path_ok(checkpoint_id, must_exist=False)

    # -- DCP calls, in order -----------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the next save at ``checkpoint_id`` (a path or a step; None: the same as before)."""
        self._end_save()
        self._target(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Local: take the roots the last save opened (their locks, their identities checked), or
        prepare to open them (_open_local: what the coordinator needs travels in this rank's local
        plan, the table and the primary come back in its global plan: DCP's own gather and
        scatter). A session is kept only from a save that reached write_data: DCP's plans reached
        every rank then, so every rank decides the same."""
        kept = self._wrote
        self._end_save()
        self._wrote = False
        if kwargs.get("use_collectives", True) is False:
            raise InvalidOptionError("GDSStorageWriter commits one step for all ranks: dcp.save(use_collectives=False) "
                                     "(a metadata file per rank) is not supported; use FileSystemWriter for that")
        roots = self.current_roots()
        rank, _ = self.place()
        if "rank" in kwargs and kwargs["rank"] != rank:
            raise InvalidOptionError(f"DCP saves as rank {kwargs['rank']} but this writer's group has it as rank "
                                     f"{rank}: pass the same process_group (single_process=True for no_dist)")
        if bool(is_coordinator) != (rank == 0):
            raise InvalidOptionError(f"DCP's coordinator is {'' if is_coordinator else 'not '}rank {rank} of this "
                                     f"writer's group: GDSStorageWriter commits on rank 0; pass dcp.save the "
                                     f"writer's process_group")
        if self._session is not None and kept and self._session_roots == roots:
            self._relock(self._session)
            self._lock_formers(rank, set(self._session.layout.local_ids))
            return
        if self._session is not None:  # roots left for others: a re-save's leftovers there go at this save
            self._formers = (self._formers or []) + [self._session]
        self._session = self._session_roots = None
        self._opening = self._open_local(roots, rank)
        self._lock_formers(rank, set(self._opening["ids"]))

    def _lock_formers(self, rank: int, current: set[str]) -> None:
        """Another rank than 0: lock the roots of earlier sessions (another checkpoint_id) where
        it wrote beside a committed step (``_beside``) and which this save's roots are not, so
        that it can remove there, in write_data, what the committed manifest no longer names
        (the coordinator sends the names: ``_formers_live``). Held until the save ends; a root
        it cannot lock now (another job's) is left for the next save. The coordinator never
        writes beside a step: it keeps its former sessions to read their manifests."""
        if rank == 0:
            return
        owed = {rid for rid, _ in self._beside} - current
        formers = [f for f in self._formers or [] if owed & set(f.layout.local_ids)]
        self._formers = formers
        paths = {f.layout.local_paths[i] for f in formers for i in f.layout.led
                 if f.layout.local_ids[i] in owed and not f.layout.is_primary(i)}
        if paths:
            try:
                self._former_lock, self._former_paths = RootLock(sorted(paths)), paths
            except (OSError, GDSWriterError) as e:
                log.info("gdswriter: the files an earlier re-save left beside a step under %s stay until a later "
                         "save (%s)", sorted(paths)[0], e)

    def _open_local(self, roots: list[Path], rank: int) -> dict:
        """What this rank can learn of its roots alone before DCP's plans: each made if missing,
        its identity (created once), and what it holds (roots.probe_root). Rank 0, the lowest
        rank, leads every root it sees: it locks them all here, before probing them, and reports
        their committed steps in full; another rank does not know yet which roots it leads, so
        it probes them unlocked, reports only the last committed steps (choose_primary needs no
        more of a root that cannot be the primary of a DCP save), and once its global plan says
        which it leads, locks them and probes them again in write_data (_open_from_plan)."""
        ids = identify_roots(roots)
        lock = RootLock(roots) if rank == 0 else None
        try:
            probes = [_probe(r, whole=rank == 0) for r in roots]
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self._open_lock = lock
        self._beside |= {(rid, step) for rid, r in zip(ids, roots) for step in saves_beside(r)}
        return {"paths": list(roots), "ids": ids,
                "plan": {"roots": [[i, str(r.resolve())] for i, r in zip(ids, roots)], "probes": probes}}

    def _relock(self, session: DistSession) -> None:
        """Lock the roots this rank leads again, after checking that each of its roots is still
        the one the session opened (one deleted since gets its directory and id back; one
        replaced by another root raises: the next save opens the roots afresh)."""
        layout = session.layout
        for path, ident in zip(layout.local_paths, layout.local_ids):
            found = root_identity(path, create=False) if path.is_dir() else None
            if found is None and not ident.startswith("path:"):
                _restore_identity(path, ident)
                found = root_identity(path, create=False)
            if found != ident:
                raise RootUnavailableError(
                    errno.ESTALE, f"checkpoint root {path} is not the root this writer's previous save wrote to (its "
                                  f"{ROOT_MARKER_NAME} says {found}, not {ident}): it was replaced by another "
                                  f"directory; nothing was written, and the next save opens the roots afresh")
        session.lock = lock_led(layout)

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
        opening = self._opening["plan"] if self._opening is not None else None
        beside = [list(x) for x in sorted(self._beside)]
        return replace(plan, storage_data={"held": held, "open": opening, "beside": beside})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the roots if this save opens them (_open_shared), decide the step and
        the token (checking ``overwrite`` under the root lock) and make the temporary directories
        it leads, then number every item: tensor chunks, split over the ranks holding them
        (planner/ranks.py), then BytesIO items, written whole by the rank DCP's deduplication
        gave them to. The decision (and each rank's part of the root table, and for a root's
        leader the names of the files to keep beside committed steps: _live_beside) travels in
        each plan."""
        opening = [plan.storage_data["open"] for plan in plans]
        parts: list[dict | None] = [None] * len(plans)
        if all(o is None for o in opening):
            session = self._session
        elif any(o is None for o in opening):
            raise GDSWriterError(f"dcp.save: ranks {[r for r, o in enumerate(opening) if o is not None][:8]} open "
                                 f"their roots afresh while the others keep theirs from an earlier save (a save "
                                 f"that failed on some ranks before write_data); nothing was written: save again, "
                                 f"and every rank opens them")
        else:
            session, parts = self._open_shared(opening)
        if session is None:
            raise InvalidOptionError("prepare_global_plan before set_up_storage_writer: use this writer through "
                                     "dcp.save")
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
        decided = self._decide(session)
        beside = {(rid, step) for plan in plans for rid, step in plan.storage_data["beside"]}
        live = _live_beside(session, beside)
        clean_resaved(session.layout, live.pop(session.rank, []), keep=decided["token"])  # roots once led by others
        self._beside = set()  # the coordinator never writes beside a step
        former = self._formers_live(session, beside)
        return [replace(plan, storage_data={"items": items, "pieces": pieces[r], "layout": parts[r],
                                            "live": live.get(r, []), "former": former.get(r, []), **decided})
                for r, plan in enumerate(plans)]

    def _formers_live(self, session: DistSession, beside: set[tuple[str, int]]) -> dict[int, list]:
        """Coordinator: _live_beside for the steps the ranks report files of several saves in on
        roots of this writer's earlier sessions (another checkpoint_id) that ``session`` does not
        have: the names their committed manifests list there, {leader: [[root id, step, names]]}.
        An earlier session is kept while some rank reports such a step of its roots. Its primary
        is rank 0's: read here; the leaders hold their roots' locks since set_up (_lock_formers),
        so no save there can commit another manifest before they have cleaned."""
        current = {info.id for info in session.layout.table}
        out: dict[int, list] = {}
        kept = []
        done: set[str] = set()
        for former in self._formers or []:
            ids = {info.id for info in former.layout.table} - current - done
            mine = {(rid, step) for rid, step in beside if rid in ids}
            if not mine:
                continue
            kept.append(former)
            done |= ids
            try:
                for r, entries in _live_beside(former, mine).items():
                    out.setdefault(r, []).extend(entries)
            except (OSError, GDSWriterError) as e:
                log.warning("gdswriter: the committed steps under %s could not be read (%s): the files of earlier "
                            "saves beside them stay", former.protocol.primary, e)
        self._formers = kept
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's pieces and make them durable (and publish the secondary roots only
        this rank sees); the last WriteResult carries its report to finish() (module docstring).
        When this save opens the roots, another rank than the coordinator first takes its layout
        from its plan and locks the roots it leads (_open_from_plan)."""
        decided = plan.storage_data
        self._wrote = True  # every rank that gets here holds the coordinator's layout for the next save
        if self._opening is not None and decided.get("layout") is not None:
            self._open_from_plan(decided)
        session = self._session
        if session is None:
            raise InvalidOptionError("write_data before set_up_storage_writer: use this writer through dcp.save")
        report = self._write_ordered(session, plan, planner)
        results = [WriteResult(index=wi.index, size_in_bytes=0, storage_data=None) for wi in plan.items]
        results.append(WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=sum(c[4] for c in report["chunks"]),
                                   storage_data=report))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: check every rank's report, build the manifest (DCP's metadata as JSON in
        it), commit the step, then write the ``.metadata`` marker (so its presence means a
        committed checkpoint). Raises, committing nothing, if a report is missing or wrong."""
        if self._save is None:
            raise InvalidOptionError("finish before write_data: use this writer through dcp.save")
        try:
            rc = self._save["commit"]
            try:
                reports = _reports(results, rc.step, self._save["token"], self._save["items"])
                if isinstance(rc, OrderedCommit):
                    rc.check_published(reports)  # every joint root published with all its ranks' files
                for rep in reports:
                    rep.pop("published", None)
                manifest = _dcp_manifest(rc.step, {**self._save, "reports": reports}, metadata)
            except BaseException:
                rc.abort()  # nothing was renamed on this rank's roots yet (OrderedCommit) or only secondaries
                raise
            if isinstance(rc, OrderedCommit):
                rc.commit_ordered(manifest)
            else:
                rc.commit_manifest(manifest)
            rc.move_latest()
            marker = rc.layout.local_paths[0] / MARKER_NAME
            if not is_gdswriter_marker(marker):
                try:
                    atomic_write(marker, _marker_bytes())
                except OSError as e:
                    raise EngineIOError(e.errno or errno.EIO, str(marker), 0, f"writing the {MARKER_NAME} marker",
                                        f"step {rc.step} is committed, but tools that look for that file "
                                        f"(torchtitan's resume) will not see it; gdswriter's reader will") from e
        finally:
            self._end_save()

    # -- internals -----------------------------------------------------------
    def _open_shared(self, opening: list[dict]) -> tuple[DistSession, list[dict | None]]:
        """Coordinator: what discover_layout and settle_primary decide, from what every rank's
        local plan carries (_open_local) instead of collectives of their own: the table of
        distinct roots (by identity), the primary (choose_primary, from each root's leader's
        probe), refused unless it is rank 0's; rank 0's session (its roots locked since
        set_up), and each other rank's part of the table (roots.layout_parts: what its own roots
        take), which DCP scatters in the plans. Cleaning comes with the step (_decide)."""
        assert self._opening is not None
        table, where = build_table(opening)
        probes = {}
        for g, info in enumerate(table):
            leader = min(info.ranks)
            probes[str(g)] = opening[leader]["probes"][where[leader].index(g)]
        world = len(opening)
        found = RootLayout(0, world, table, tuple(self._opening["paths"]), tuple(self._opening["ids"]),
                           tuple(where[0]), table[0].path)
        layout = found.with_primary(primary_of(found, probes))
        if layout.primary_rank != 0:
            raise primary_not_on_rank_0(layout)
        index = {info.id: g for g, info in enumerate(layout.table)}
        parts: list[dict | None] = list(layout_parts(layout.table, [[index[rid] for rid, _ in o["roots"]]
                                                                    for o in opening]))
        parts[0] = None  # rank 0 holds the whole table
        session = DistSession(_Place(0, world), layout, self._open_lock, self.dist_options)
        self._open_lock = None  # the session's now
        self._session, self._session_roots, self._opening = session, list(self._opening["paths"]), None
        return session, parts

    def _open_from_plan(self, decided: dict) -> None:
        """Another rank than the coordinator, in write_data: its layout from its part of the table
        (kept as its session from now on, whatever follows), then the roots it leads locked and
        probed again: one that changed since set_up probed it (another job wrote there before
        this rank held its lock) is refused, as the coordinator decided on what it saw before."""
        opening = self._opening
        assert opening is not None
        self._opening = None
        rank, world = self.place()
        layout = layout_of_part(rank, world, opening["paths"], opening["ids"], decided["layout"])
        session = DistSession(_Place(rank, world), layout, None, self.dist_options)
        session._learn(decided["clean"], decided["latest"])
        self._session, self._session_roots = session, list(opening["paths"])
        session.lock = lock_led(layout)
        for i in layout.led:
            root = layout.local_paths[i]
            if _probe(root, whole=False) != opening["plan"]["probes"][i]:
                raise RootUnavailableError(
                    errno.EAGAIN, f"checkpoint root {root} changed while this save opened it (another writer "
                                  f"saved there before rank {rank} held its lock); nothing was written to it: save "
                                  f"again")

    def _decide(self, session: DistSession) -> dict:
        """Coordinator: the step, the token and the committed steps each root's leader cleans
        with (the coordinator its own here); the temporary directories it leads are made here,
        before DCP scatters the plans."""
        path_mode = self._path_roots is not None
        named = self._override if self._override is not None else self.step
        steps = session.protocol.committed_steps()
        if path_mode:
            step = step_in_name(self._path_roots[0])
        else:
            step = named if named is not None else (steps[-1] + 1 if steps else 0)
        marker = session.layout.local_paths[0] / MARKER_NAME
        if named is not None and not path_mode:
            there = f"step {step} under {session.layout.local_paths[0]}" if step in steps else None
        elif steps or marker.exists():
            there = (f"{session.layout.local_paths[0]} (steps {steps})" if steps else
                     f"{session.layout.local_paths[0]} (its {MARKER_NAME})")
        else:
            there = None
        if there is not None and not self.overwrite:
            raise CheckpointExistsError(f"Checkpoint already exists and overwrite=False: {there}. Save to another "
                                        f"checkpoint_id/step, delete the old one, or pass "
                                        f"GDSStorageWriter(overwrite=True) to replace it")
        if there is not None and step in steps:
            log.warning("gdswriter: replacing the checkpoint in %s (overwrite=True; "
                        "GDSStorageWriter(overwrite=False) refuses instead)", there)
        token = secrets.token_hex(4)
        clean_led(session.layout, steps)
        rc = OrderedCommit(session.coord, session.layout, step, token)
        rc.make_dirs()
        self._save = {"commit": rc, "table": session.layout.table, "token": token}
        return {"step": step, "token": token, "clean": steps, "latest": session.protocol.latest()}

    def _write_ordered(self, session: DistSession, plan: SavePlan, planner: SavePlanner) -> dict:
        decided = plan.storage_data
        owed: set[tuple[str, int]] = set()  # files beside steps of earlier sessions' roots, not cleaned yet
        if session.rank == session.layout.primary_rank:
            assert self._save is not None and self._save["token"] == decided["token"]
            rc = self._save["commit"]
        else:
            # another rank sharing a joint root may have made this save's directory there already
            # (or written beside a committed step): kept
            clean_led(session.layout, decided["clean"], keep=decided["token"])
            clean_resaved(session.layout, decided["live"], keep=decided["token"])
            owed = self._clean_formers(decided["former"], decided["token"], set(session.layout.local_ids))
            rc = OrderedCommit(session.coord, session.layout, decided["step"], decided["token"],
                               resaving=decided["step"] in decided["clean"])
            mine = {(session.layout.local_ids[i], rc.step) for i in rc.in_place}
            self._beside |= mine  # until this save is through: what it may leave beside the step
            rc.make_dirs()
        try:
            rc.check_shared()
            report = self._write(plan, planner, rc)
            if not rc.coordinates:  # the secondary roots it alone sees, and its joint roots (the last one publishes)
                report["published"] = rc.publish_led()
        except BaseException:
            rc.abort()
            if not rc.coordinates:
                self._end_save()
            raise
        if rc.coordinates:
            self._save["items"] = decided["items"]
        else:
            self._beside = mine | owed  # the earlier ones were cleaned by their leaders in this save
            self._end_save()
        return report

    def _clean_formers(self, live: list, keep: str, current: set[str]) -> set[tuple[str, int]]:
        """Another rank than 0, in write_data: on the roots of earlier sessions it locked in
        set_up (_lock_formers), remove what the committed manifests no longer name (``live``,
        from the coordinator: commit.clean_resaved). Returns the (root id, step) still owed a
        cleaning (a root it could not lock, or a failure there: logged; this save goes on)."""
        locked = self._former_paths if self._former_lock is not None else set()
        owed: set[tuple[str, int]] = set()
        for former in self._formers or []:
            ids = {ident for ident, path in zip(former.layout.local_ids, former.layout.local_paths) if path in locked}
            left = set(former.layout.local_ids) - ids - current
            owed |= {(rid, step) for rid, step in self._beside if rid in left}
            try:
                clean_resaved(former.layout, [e for e in live if e[0] in ids], keep=keep)
            except OSError as e:
                owed |= {(rid, step) for rid, step in self._beside if rid in ids}
                log.warning("gdswriter: removing the files an earlier re-save left beside a step under %s failed "
                            "(%s); the next save tries again", former.layout.local_paths[0], e)
        return owed

    def _write(self, plan: SavePlan, planner: SavePlanner, rc: OrderedCommit) -> dict:
        if rc.setup_error is not None:
            raise rc.setup_error
        layout, rank = rc.layout, rc.coord.rank
        decided = plan.storage_data
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
            targets = rank_targets(layout, rank, self.options.files_per_root, tagged=rc.in_place, tag=rc.token)
            fplan = plan_save([s[3].numel() for s in sources], targets)
            pieces = Snapshot(rc.step, None, [Extent("", flat=s[3]) for s in sources], [], {})
            written_by: dict[int, str] = {}
            crcs = write_files(fplan, live_spans(pieces, fplan), rc, engines, written_by=written_by)
        except BaseException:
            self._close_engines()  # the next save starts from fresh ones
            raise
        return {
            "rank": rank, "step": decided["step"], "token": decided["token"],
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
        """Release what a save holds (its locks; the session stays for the next save). DCP calls
        nothing after a failed save, so the next save's set_up, reset() and garbage collection
        also do."""
        if self._session is not None and self._session.lock is not None:
            self._session.lock.release()
            self._session.lock = None
        if self._open_lock is not None:
            self._open_lock.release()
            self._open_lock = None
        if self._former_lock is not None:
            self._former_lock.release()
            self._former_lock, self._former_paths = None, set()
        self._opening = None
        self._save = None

    def close(self) -> None:
        """Release everything the writer holds: a save's locks, its opened roots and the engines
        kept between saves (the next save opens and builds new ones)."""
        self._end_save()
        self._session = self._session_roots = None
        self._formers = []
        self._close_engines()

    def __del__(self) -> None:
        session = getattr(self, "_session", None)
        if ((session is not None and session.lock is not None) or getattr(self, "_engines", None)
                or getattr(self, "_open_lock", None) is not None or getattr(self, "_former_lock", None) is not None):
            self.close()


class _Place:
    """A rank's place in the writer's group (``rank``, ``world_size``), standing for its
    Coordinator where no collective is made (OrderedCommit, the session it keeps)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def _probe(root: Path, *, whole: bool) -> dict:
    """roots.probe_root of ``root``; not ``whole``: only its last three committed steps (all that
    choose_primary and its refusals read of a root that is not rank 0's)."""
    probe = probe_root(root)
    if not whole:
        probe["committed"] = probe["committed"][-3:]
    return probe


def _restore_identity(path: Path, ident: str) -> None:
    """Give root ``path`` (deleted since the session opened it) its directory and id back, as
    format/commit.py creates a marker (durable, no-clobber: ranks sharing the root may race)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        marker = path / ROOT_MARKER_NAME
        tmp = path / f"{TMP_PREFIX}{ROOT_MARKER_NAME}-{secrets.token_hex(4)}"
        write_durable(tmp, RootIdentity(ident, time.time(), socket.gethostname(), str(path.resolve())).to_json_bytes())
        if link_no_clobber(tmp, marker):
            fsync_dir(path)
            fsync_dir(path.parent)
    except OSError as e:
        raise EngineIOError(e.errno or errno.EIO, path / ROOT_MARKER_NAME, 0, "restore root identity") from e


def _live_beside(session: DistSession, beside: set[tuple[str, int]]) -> dict[int, list]:
    """Coordinator: for each (root id, step) a rank reported files of several saves in (its own
    beside a committed step, OrderedCommit), the names of the data files the committed manifest
    of that step lists on that root, for the root's leader to keep (commit.clean_resaved):
    {leader: [[root id, step, names], ...]}. Nothing for a step no longer committed (cleaning
    removes its directory whole), a root its manifest does not name, or a manifest it cannot
    read (logged: those files stay)."""
    if not beside:
        return {}
    leaders = {info.id: min(info.ranks) for info in session.layout.table}
    committed = set(session.protocol.committed_steps())
    manifests: dict[int, Manifest | None] = {}
    out: dict[int, list] = {}
    for rid, step in sorted(beside):
        if step not in committed or rid not in leaders:
            continue
        if step not in manifests:
            manifests[step] = None
            try:
                m = parse_step(read_manifest_bytes(session.protocol, step), f"step {step}'s manifest")
            except (OSError, GDSWriterError) as e:
                log.warning("gdswriter: step %d's manifest could not be read (%s): the files of earlier saves "
                            "beside it stay", step, e)
            else:
                manifests[step] = m if isinstance(m, Manifest) and m.dist is not None else None
        m = manifests[step]
        g = None if m is None else next((g for g, info in enumerate(m.dist.roots) if info.id == rid), None)
        if g is not None:
            out.setdefault(leaders[rid], []).append([rid, step, sorted(f.path for f in m.files if f.root == g)])
    return out


def _reports(results: list[list[WriteResult]], step: int, token: str, items: list[list]) -> list[dict]:
    """Every rank's report (the last WriteResult of each), in rank order, checked against this
    save: one per rank, of this step and token, naming only items of the plan, and every item
    recorded exactly once (a BytesIO item also sized). GDSWriterError naming what is wrong."""
    reports, problems = [], []
    for r, got in enumerate(results):
        rep = got[-1].storage_data if got and got[-1].index.fqn == REPORT_FQN else None
        if not isinstance(rep, dict) or rep.get("rank") != r or rep.get("step") != step or rep.get("token") != token:
            problems.append(f"rank {r} sent no report of this save (step {step})")
            continue
        reports.append(rep)
    recorded = Counter(item for rep in reports for item, _ in rep["records"])
    sized = {item for rep in reports for item, _ in rep["sizes"]}
    bad = [i for i in set(recorded) | sized | {c[0] for rep in reports for c in rep["chunks"]}
           if not (isinstance(i, int) and 0 <= i < len(items))]
    if bad:
        problems.append(f"the reports name items {sorted(map(str, bad))[:5]} that the plan does not hold")
    missing = [i for i in range(len(items)) if recorded[i] != 1 or (items[i][1] is None and i not in sized)]
    if missing and not bad:
        problems.append(f"{len(missing)} item(s) not recorded exactly once (first: {items[missing[0]][2]!r})")
    if problems:
        raise GDSWriterError(f"dcp.save of step {step}: {'; '.join(problems)}; nothing was committed (internal: "
                             f"report it)")
    return reports


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
    or roots; rank 0's first is the primary), or of the checkpoint a checkpoint_id names (a
    path: the latest step in that directory; a step number: that step under ``root``). Each rank
    reads the chunks it needs from the roots it reaches; chunks on other nodes' disks come from a
    rank that reaches them. Items DCP asks for whole are read straight into its target tensors;
    ``atomic=True`` reads everything into fresh buffers and verifies it on every rank first (see
    the module docstring). ``verify=False`` skips the crc32c checks. The reader keeps its engine
    from load to load (``engine_options``; default: reader_engine_options()); ``close()``
    releases it. ``_extension_registry`` (FileSystemReader's) must
    be None: gdswriter applies no stream transforms."""

    def __init__(self, root: Any = None, step: int | None = None, *, verify: bool = True, atomic: bool = False,
                 engine_options: EngineOptions | None = None, dist_options: DistOptions | None = None,
                 process_group: Any = None, single_process: bool = False, _extension_registry: Any = None):
        if _extension_registry is not None:
            raise InvalidOptionError("_extension_registry: gdswriter stores raw bytes and applies no stream "
                                     "transforms; drop it (or read a FileSystemWriter checkpoint with FileSystemReader)")
        if not isinstance(atomic, bool) or not isinstance(verify, bool):
            raise InvalidOptionError(f"atomic={atomic!r}, verify={verify!r}: expected True or False")
        _Collective.__init__(self, root, step, process_group, single_process, dist_options)
        self.verify = verify
        self.atomic = atomic
        self.engine_options = engine_options
        self.load_id = uuid.uuid4().hex
        self._loaded: tuple | None = None  # (manifest, root layout, DCP's storage_data, reaches every root)
        self._engines: list[IOEngine] | None = None  # [the engine], kept from load to load
        self._engine_made: EngineOptions | None = None  # the options it was built with

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for what reset() takes and can read: a directory holding a gdswriter checkpoint
        (its ``.metadata`` marker or a step), or a step number; False for URLs and the rest."""
        return _local_path_ok(checkpoint_id, must_exist=True)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the next load at ``checkpoint_id`` (a path or a step; None: the same as before)."""
        self._target(checkpoint_id)
        self._loaded = None
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
        coord = self.coordinator()
        step = self._override if self._override is not None else (None if self._path_roots else self.step)
        opened = _open_one_shared_root(coord, roots, step)
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
            layout, _ = settle_primary(coord, layout, probes, error, "dcp.load (finding the primary root)",
                                       "nothing was loaded; fix the failing rank's roots and load again")
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
        if self._loaded is None:
            raise InvalidOptionError("set_up_storage_reader before read_metadata: use this reader through dcp.load")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Collective: fetch the storages of this rank's items (those DCP wants whole straight
        into its targets), then hand DCP each item."""
        if self._loaded is None:
            raise InvalidOptionError("read_data before read_metadata: use this reader through dcp.load")
        m, layout, where, reaches_all = self._loaded
        # every rank reaches every root of the step (one shared root): without atomic, each rank
        # reads what it needs alone, and DCP's gather of read_data's outcomes tells every rank of a failure
        alone = reaches_all and not self.atomic
        coord = self.coordinator()
        records, error, engine = [], None, None
        in_place: dict[int, torch.Tensor] = {}  # item -> DCP's target, read into directly
        try:  # this rank's part before the first collective: a failure here reaches every rank
            for req in plan.items:
                if req.storage_index not in where:
                    raise CorruptCheckpointError(f"step {m.step}: DCP asks for {req.storage_index}, which the "
                                                 f"checkpoint's DCP metadata does not map to a record")
                records.append(m.tensors[where[req.storage_index]])
            if not self.atomic:
                uses = Counter(rec.storage for rec in records)
                for i, (req, rec) in enumerate(zip(plan.items, records)):
                    if uses[rec.storage] == 1:
                        target = _whole_target(req, rec, m, planner)
                        if target is not None:
                            in_place[i] = target
            engine = self._engine(sum(m.storages[s].nbytes for s in {rec.storage for rec in records}))
        except Exception as e:  # noqa: BLE001 - every rank learns of it
            error = e
        if not alone:
            coord.agree(error, f"dcp.load of step {m.step} (planning)", hint="nothing was loaded")
        elif error is not None:
            raise error
        assert engine is not None
        # the buffers are allocated once every rank has checked the files it reads against the manifest
        into = {records[i].storage: _bytes_of(t) for i, t in in_place.items()}
        try:
            buffers = fetch_storages(coord, manifest_reach(m, layout), m, {r.storage for r in records}, engine,
                                     verify=self.verify, what=f"dcp.load of step {m.step}", alloc=host_buffer,
                                     into=into, alone=alone)
        except BaseException:
            self._close_engines()  # the next load starts from a fresh one
            raise
        for i, (req, rec) in enumerate(zip(plan.items, records)):
            if i in in_place:
                planner.commit_tensor(req, in_place[i])
                continue
            buf = buffers[rec.storage]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(buf.numpy().tobytes()))
                continue
            src = _chunk_view(req, rec, buf)
            target = planner.resolve_tensor(req).detach()
            if target.shape != src.shape:
                raise CorruptCheckpointError(f"{req.storage_index.fqn}: DCP asked for {list(target.shape)} elements, "
                                             f"the saved chunk gives {list(src.shape)}")
            target.copy_(src)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _engine(self, nbytes: int | None = None) -> IOEngine:
        """The reader's engine, for a load reading ``nbytes``: kept from load to load, and built
        anew (with reader_engine_options(nbytes)) only when a load needs a larger staging pool
        than the kept one has."""
        options = self.engine_options or reader_engine_options(nbytes)
        if self._engines and self.engine_options is None and _pool_bytes(options) > _pool_bytes(self._engine_made):
            self._close_engines()
        if not self._engines:
            self._engines = [create_engine(options)]
            self._engine_made = options
        return self._engines[0]

    def _close_engines(self) -> None:
        engines, self._engines = self._engines or [], None
        for e in engines:
            e.close()

    def close(self) -> None:
        """Release the engine kept between loads (the next load builds a new one)."""
        self._close_engines()

    def __del__(self) -> None:
        if getattr(self, "_engines", None):
            self.close()


def _open_one_shared_root(coord: Coordinator, roots: Sequence[Path], step: int | None
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
    offer: dict | None = None
    table: tuple[RootInfo, ...] = ()
    try:
        if len(roots) == 1:
            ids = identify_roots(roots, create=False)
        if coord.rank == 0 and ids is not None and probe_root(roots[0])["committed"]:
            path = str(roots[0].resolve())
            table = (RootInfo(ids[0], path, tuple(range(coord.world_size))),)
            protocol = RankProtocol(RootLayout(0, coord.world_size, table, tuple(roots), tuple(ids), (0,), path))
            found = protocol.require(step)
            offer = {"part": layout_parts(table, [[0]])[0], "step": found,
                     "manifest": read_manifest_bytes(protocol, found).decode()}
    except Exception:  # noqa: BLE001 - not this path: the full protocol reports it
        ids = offer = None

    def rule(outs: list) -> dict | None:
        return offer if offer is not None and all(o == ids for o in outs) else None

    got = coord.decide(None, ids, "dcp.load (opening the checkpoint's root)", rule)
    if got is None:
        return None
    assert ids is not None
    layout = (RootLayout(0, coord.world_size, table, tuple(roots), tuple(ids), (0,), table[0].path) if table
              else layout_of_part(coord.rank, coord.world_size, roots, ids, got["part"]))
    found = int(got["step"])
    m = received_manifest(coord, RankProtocol(layout), found, got["manifest"].encode(), "dcp.load")
    return layout, found, m


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


def _pool_bytes(options: EngineOptions | None) -> int:
    return 0 if options is None else options.num_buffers * options.buffer_bytes


def check_dcp_records(m: Manifest, md: Metadata) -> None:
    """CorruptCheckpointError unless every record DCP's metadata maps an item to is what
    GDSStorageWriter writes for it: the item's chunk (its dtype, its sizes; the chunk inside the
    item's size), contiguous, at byte 0 of a storage of exactly its bytes (a BytesIO item: uint8,
    one dimension). The reader hands DCP a record's storage as that chunk (read_data,
    _whole_target), so a stride, a byte offset or a size the writer never writes (a hand-made or
    damaged manifest) is refused here, before a buffer is allocated, not read as something else."""
    chunks: dict[str, dict[tuple[int, ...], Any]] = {}
    for index, i in md.storage_data.items():
        rec, entry = m.tensors[i], md.state_dict_metadata.get(index.fqn)
        nbytes = m.storages[rec.storage].nbytes
        why = ""
        if entry is None:
            why = "names no item of the DCP metadata"
        elif not hasattr(entry, "chunks"):  # BytesStorageMetadata
            if rec.dtype != "uint8" or rec.shape != (nbytes,) or rec.stride != (1,) or rec.byte_offset:
                why = f"is not the {nbytes} bytes of its storage (dtype {rec.dtype}, shape {list(rec.shape)})"
        else:
            if index.fqn not in chunks:
                chunks[index.fqn] = {tuple(c.offsets): c for c in entry.chunks}
            chunk = chunks[index.fqn].get(tuple(index.offset or ()))
            size = tuple(entry.size)
            dtype = dtype_from_name(rec.dtype)
            numel = 1
            for n in rec.shape:
                numel *= n
            if chunk is None:
                why = f"is at offsets {list(index.offset or ())}, where the item has no chunk"
            elif any(o + n > g for o, n, g in zip(chunk.offsets, chunk.sizes, size)):
                why = f"is the chunk {list(chunk.offsets)} + {list(chunk.sizes)}, outside the item's size {list(size)}"
            elif rec.shape != tuple(chunk.sizes) or dtype != entry.properties.dtype:
                why = (f"has shape {list(rec.shape)} and dtype {rec.dtype}, its chunk {list(chunk.sizes)} and "
                       f"{dtype_to_name(entry.properties.dtype)}")
            elif rec.stride != _contiguous(rec.shape) or rec.byte_offset or nbytes != numel * dtype.itemsize:
                why = (f"is not contiguous at byte 0 of a storage of its {numel * dtype.itemsize} bytes (stride "
                       f"{list(rec.stride)}, byte offset {rec.byte_offset}, storage {nbytes} bytes)")
        if why:
            raise CorruptCheckpointError(f"step {m.step}: the record of DCP item {index.fqn!r} (record {i}) {why}: "
                                         f"GDSStorageWriter never writes that, so the manifest is damaged or was "
                                         f"not written by it; load an earlier step")


def _whole_target(req: Any, rec: TensorRecord, m: Manifest, planner: LoadPlanner) -> torch.Tensor | None:
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
            or tuple(rec.stride) != _contiguous(rec.shape)):
        return None
    target = planner.resolve_tensor(req).detach()
    if (target.device.type != "cpu" or target.dtype != dtype or tuple(target.shape) != tuple(rec.shape)
            or not target.is_contiguous() or target.is_conj() or target.is_neg()):
        return None
    return target


def _chunk_view(req: Any, rec: TensorRecord, buf: torch.Tensor) -> torch.Tensor:
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


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------- a DCP step read in one process
def is_dcp_step(m: Manifest) -> bool:
    """``m`` was saved through GDSStorageWriter."""
    return m.dist is not None and m.dist.layout == "dcp" and m.dist.dcp is not None


def dcp_items(m: Manifest) -> dict[str, int]:
    """{fqn: the index of its first tensor record} of a DCP step (DCP's flattened keys)."""
    pairs = m.state.get("$dict") if isinstance(m.state, dict) else None
    if not isinstance(pairs, list):
        raise CorruptCheckpointError(f"step {m.step}: the state of this DCP step is not the map of its items")
    out = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], dict)
                and type(pair[1].get("$tensor")) is int and 0 <= pair[1]["$tensor"] < len(m.tensors)):
            raise CorruptCheckpointError(f"step {m.step}: a damaged item entry in the state of this DCP step")
        out[pair[0]] = pair[1]["$tensor"]
    return out


def dcp_model_keys(m: Manifest, name: str = "model") -> dict[str, str]:
    """{fqn: key in the model's state_dict} of the items a DCP step holds under its state's
    ``name`` entry (``dcp.save({"model": model.state_dict(), ...})``): from DCP's planner_data
    (the key path of each flattened item), else from the "model." prefix of the fqns."""
    md = metadata_from_json(m.dist.dcp)
    items = dcp_items(m)
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    out = {}
    for fqn in items:
        path = paths.get(fqn)
        if isinstance(path, (tuple, list)) and len(path) >= 2 and path[0] == name:
            out[fqn] = ".".join(key_text(p) for p in path[1:])
        elif not isinstance(path, (tuple, list)) and fqn.startswith(name + "."):
            out[fqn] = fqn[len(name) + 1:]
    return out


def read_dcp_items(roots: Sequence[Path], m: Manifest, fqns: Sequence[str], *, verify: bool = True,
                   engine_options: EngineOptions | None = None) -> dict[str, torch.Tensor]:
    """{fqn: whole tensor} of the named items of DCP step ``m`` under ``roots`` (all roots of the
    checkpoint, the primary first), in one process: only their bytes are read, each tensor's
    chunks (the ranks' shards) assembled; BytesIO items come back as uint8 tensors."""
    items = dcp_items(m)
    missing = [f for f in fqns if f not in items]
    if missing:
        raise InvalidOptionError(f"step {m.step} holds no item {missing[0]!r}")
    coord = Coordinator.solo()
    layout = discover_layout(coord, list(roots), create=False)
    wanted = replace(m, state={"$dict": [[f, {"$tensor": items[f]}] for f in fqns]})
    with create_engine(engine_options) as engine:
        state = rebuild_state(coord, layout, wanted, {}, None, engine, verify=verify, what=f"reading step {m.step}")
    return dict(state)
