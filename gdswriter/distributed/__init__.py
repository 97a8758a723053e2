"""Multi-rank checkpoints: GDSCheckpointer under torch.distributed, and a DCP storage plug-in.

Every rank writes a disjoint, byte-balanced part of the step into its own files on its own
roots (FastPersist's parallel writes), planned by itself (save.py), and its records into a
manifest shard of its own; the primary rank commits the step once, atomically across ranks
and roots, with a global manifest listing the shards (commit.py, format/sharded.py). What a
rank sends and receives does not grow with the world size. Loading works on any world size
(load.py), also when each rank sees only its node's disks (fetch.py). The on-disk layout is
docs/format.md sections 9 and 10. ``GDSStorageWriter``/``GDSStorageReader`` (dcp.py) put
torch.distributed.checkpoint on the same engine, format and commit protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

from ..errors import InvalidOptionError
from ..options import EngineOptions
from .group import Coordinator
from .options import DistOptions
from .roots import discover_layout, root_identity
from .session import DistSession, open_session

if TYPE_CHECKING:
    from ..engines.base import IOEngine
    from ..format.commit import CommitProtocol
    from ..load.apply import LiveState, LoadResult
    from .dcp import GDSStorageReader, GDSStorageWriter, dcp_errors

__all__ = ["DistOptions", "DistSession", "GDSStorageReader", "GDSStorageWriter", "dcp_errors", "load_state",
           "open_session", "root_identity"]


def session_for(roots: Sequence[Path], process_group: Any = None, options: DistOptions | None = None, *,
                label: str = "GDSCheckpointer") -> DistSession | None:
    """GDSCheckpointer's multi-rank session (collective; asked for by gdswriter.session's
    open_session), or None for a single process (see DistOptions.collective: by default, when
    no ``process_group`` is given and torch.distributed is not initialised or has one rank). The session has a coordination channel of its own
    (group.py; ``label`` names the checkpointer in a CollectiveMismatchError), released by its
    close(): every rank must construct its checkpointers in the same order."""
    import torch.distributed as dist

    options = options or DistOptions.from_env()
    initialised = dist.is_available() and dist.is_initialized()
    if options.collective is False:
        return None
    if options.collective is None and process_group is None and not (initialised and dist.get_world_size() > 1):
        return None
    if not initialised:
        raise InvalidOptionError("DistOptions(collective=True) needs torch.distributed: call "
                                 "torch.distributed.init_process_group first")
    # The roots are made inside the first collective (discover_layout): a rank that cannot create
    # one makes every rank raise at once, rather than leaving the others to wait out the timeout.
    coord = Coordinator.create(process_group, timeout_s=options.timeout_s, label=label)
    try:
        session = open_session(roots, coord, options, movable_primary=True)
    except BaseException:
        coord.close()
        raise
    if session.peers is not None:  # replication's own channel: never interleaved with a save's collectives
        try:
            session.start_replication(Coordinator.create(process_group, timeout_s=options.timeout_s,
                                                         label=f"{label} (replicas)"))
        except BaseException:
            session.close()
            raise
    return session


def load_in_one_process(protocol: CommitProtocol, live: LiveState, live_state: dict, step: int | None,
                        engine: IOEngine, *, strict: bool, verify: bool, fallback: bool = False) -> LoadResult:
    """GDSCheckpointer.load of a multi-rank checkpoint in one process (gdswriter/session.py's
    LocalSession), from ``protocol``'s roots. It reads into fresh buffers and verifies them
    before any live tensor changes: it is atomic. ``fallback``: the newest intact step."""
    from .load import collective_restore

    coord = Coordinator.solo()
    layout = discover_layout(coord, list(protocol.roots), create=False)
    return collective_restore(coord, layout, protocol, live, live_state, step, engine, strict=strict, verify=verify,
                              fallback=fallback)


def load_state(root: Any, step: int | None = None, *, verify: bool = True,
               engine_options: EngineOptions | None = None) -> tuple[int, Any]:
    """Read a checkpoint into fresh CPU tensors in one process, like gdswriter.load_state, with
    a multi-rank step's sharded tensors (DTensor shards, DCP chunks) assembled whole; the state
    is rank 0's (a DCP step's: {fqn: tensor, BytesIO items as uint8 tensors}). ``root``: every
    root of the checkpoint (those of all nodes), the primary first. Never unpickles; no lock.
    A step deleted while it is read (a running job's retention) is CheckpointNotFoundError, and
    with ``step`` None the newest step is tried once more, as gdswriter.load_state does."""
    from ..engines.select import create_engine
    from ..errors import CheckpointNotFoundError, CorruptCheckpointError
    from ..format.commit import CommitProtocol, normalize_roots
    from ..load.reader import deleted_while_reading
    from .loadmanifest import broadcast_manifest
    from .rebuild import rebuild_state

    roots = normalize_roots(root)
    coord = Coordinator.solo()
    layout = discover_layout(coord, roots, create=False)
    protocol = CommitProtocol(roots)

    def read(step: int | None) -> tuple[int, Any]:
        step, m = broadcast_manifest(coord, protocol, step, "load_state", layout=layout)
        try:
            with create_engine(engine_options) as engine:
                return step, rebuild_state(coord, layout, m, {}, None, engine, verify=verify,
                                           what=f"load_state of step {step}")
        except (CorruptCheckpointError, OSError) as e:
            gone = deleted_while_reading(protocol, m, e)
            if gone is None:
                raise
            raise gone from e

    if step is not None:
        return read(step)
    try:
        return read(None)
    except CheckpointNotFoundError:
        return read(None)  # the newest step was deleted while it was read: once more, on the newest


def __getattr__(name: str) -> Any:
    """The DCP plug-in loads torch.distributed.checkpoint, so it is imported on first use."""
    if name in ("GDSStorageWriter", "GDSStorageReader", "dcp_errors"):
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
