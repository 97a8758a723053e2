"""What a DCP checkpoint_id names (a path: a root and the step its name gives; a step number),
the ``.metadata`` marker, and what the writer and reader share (Collective)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, InvalidOptionError
from ..format.commit import normalize_roots
from ..fs import read_regular_file
from .group import Coordinator
from .options import DistOptions

MARKER_NAME = ".metadata"  # DCP's metadata file name: gdswriter writes a JSON marker there
MARKER_FORMAT = "gdswriter-dcp"
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


def local_path_ok(checkpoint_id: Any, *, must_exist: bool) -> bool:
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


def marker_bytes() -> bytes:
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


class Collective:
    """What the writer and reader share: roots, options, and a coordinator opened on first use."""

    _OPEN = ("_coord", "_session", "_items", "_save", "_loaded", "_engines", "_engine_made", "_opening",
             "_open_lock", "_formers", "_former_lock", "_former_paths", "_fs", "_replication",
             "_pending", "_drain", "_refill")  # resources, per-save state: not pickled

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
