"""DistOptions: how a checkpoint is coordinated across the ranks of a process group."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InvalidOptionError

TIMEOUT_ENV = "GDSWRITER_DIST_TIMEOUT"


@dataclass(frozen=True, kw_only=True)
class DistOptions:
    """Options of multi-rank checkpoints (keyword-only, validated).

    timeout_s: how long a rank waits for the others in a checkpoint collective before it
        raises CollectiveFailedError (env GDSWRITER_DIST_TIMEOUT). A rank that dies is
        usually noticed at once (its connections close); the timeout bounds the wait for a
        rank that hangs or a node that vanishes. It must exceed the longest time one rank
        spends writing its share of a save.
    replicated: top-level state names (GDSCheckpointer's "model", "optimizer", "extra",
        "rng") whose plain tensors are identical on every rank of the process group, as
        with DDP. They are written once, split across the ranks. Every rank MUST hold
        bit-identical values there: gdswriter does not compare them (each rank writes a
        different byte range), so differing values are saved as a silent mix of the ranks'
        tensors. Tensors elsewhere are rank-local (each rank writes and loads its own).
        DTensors are always written once per replica group of their mesh, wherever they
        are. Pass ``replicated=()`` when ranks hold different plain tensors under the same
        names (e.g. pipeline stages, or DDP with per-rank buffers).
    load_share_dir: a tmpfs through which the ranks of a host share what they read in a load
        of state several ranks hold: each reads its part of an item into one shared file, so
        on one host nothing travels over the process group, and across hosts (each a block
        of consecutive ranks, as torchrun numbers them) each piece of state every rank holds
        crosses to each other host once. Default ``/dev/shm``; where it is too small for the
        reservation, or hosts are not such blocks, the pieces travel rank to rank over the
        process group, as with None. Each load's files live in a directory private to it
        (mode 0700); the tmpfs directory must be root's or this user's, and sticky where
        others may write (as /dev/shm is), else the pieces travel over the process group.
    load_cross_memory: in such a load, the ranks of a host that may read each other's memory
        (one kernel, one PID namespace, one user, ptrace allowed: distributed/crossmem.py)
        each read their part of the state every rank holds (and of the DTensor blocks of a
        replica group all on that host) into their own buffers and copy the rest from their
        peers' with process_vm_readv: one copy, nothing on the tmpfs.
        Default True; where the call is refused on any rank, every rank uses
        ``load_share_dir`` as if False. Memory: during the load each rank holds its own copy
        of that state (as over the process group), where the tmpfs holds one per host, shared
        copy-on-write; set False where host memory is tight.
    """

    collective: bool | None = None
    timeout_s: float = 600.0
    replicated: tuple[str, ...] = ("model", "optimizer")
    load_share_dir: str | None = "/dev/shm"
    load_cross_memory: bool = True

    def __post_init__(self) -> None:
        if self.collective not in (None, True, False):
            raise InvalidOptionError(f"collective={self.collective!r} must be None (detect), True or False")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e7:
            raise InvalidOptionError(f"timeout_s={t!r} must be a number of seconds > 0")
        if isinstance(self.replicated, str) or not all(isinstance(n, str) for n in self.replicated):
            raise InvalidOptionError(f"replicated={self.replicated!r} must be a tuple of top-level state names, "
                                     f"e.g. (\"model\", \"optimizer\")")
        object.__setattr__(self, "replicated", tuple(self.replicated))
        if self.load_cross_memory not in (True, False):
            raise InvalidOptionError(f"load_cross_memory={self.load_cross_memory!r} must be True or False")
        if self.load_share_dir is not None and (not isinstance(self.load_share_dir, str) or
                                                not self.load_share_dir.startswith("/")):
            raise InvalidOptionError(f"load_share_dir={self.load_share_dir!r} must be an absolute path of a tmpfs "
                                     f"(\"/dev/shm\") or None")

    @classmethod
    def from_env(cls, **overrides) -> DistOptions:
        """Defaults, then GDSWRITER_DIST_TIMEOUT, then ``overrides``."""
        raw = os.environ.get(TIMEOUT_ENV)
        values: dict = {}
        if raw is not None and raw.strip():
            try:
                values["timeout_s"] = float(raw)
            except ValueError as e:
                raise InvalidOptionError(f"environment variable {TIMEOUT_ENV}={raw!r} is not a number of "
                                         f"seconds") from e
        values.update(overrides)
        return cls(**values)
