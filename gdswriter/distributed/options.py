"""DistOptions: how a checkpoint is coordinated across the ranks of a process group."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from ..errors import InvalidOptionError

TIMEOUT_ENV = "GDSWRITER_DIST_TIMEOUT"
REPLICAS_ENV = "GDSWRITER_REPLICAS"
PARITY_ENV = "GDSWRITER_PARITY_GROUP"
MAX_PARITY_GROUP = 64  # hosts one parity block may protect (a rebuild reads the other G members)
MAX_REPLICAS = 16  # copies of every byte a step may ask for (a manifest entry's bound, format.md 11)


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
    replicas: how many distinct hosts hold every file a load needs (env GDSWRITER_REPLICAS;
        1: the rank's own roots only, as before). With C > 1, after each step commits, every
        rank sends its files in the background to C - 1 peer ranks on other hosts (chosen by
        planner/replicas.py), which write them durably under ``step_S/copies/``; the step is
        *protected* once every copy is durable (``GDSCheckpointer.wait_protected``), and
        retention never deletes the newest protected step. Hosts are told apart by
        ``socket.gethostname()``, or GDSWRITER_HOSTNAME where set (format.md section 11).
        InvalidOptionError at open when the job runs on fewer than C hosts.
    parity_group: instead of full copies, protect each group of G hosts with one rotating parity
        block (XOR of the group's chunks, RAID-5 style; env GDSWRITER_PARITY_GROUP; None: off):
        any one host of a group may be lost at G / (G - 1) times the bytes on the drives (each
        block covers G - 1 hosts' chunks), not 2x. After each commit every rank streams its files in chunks to the other members of
        its lane (the same rank position on each host of the group), which keep the XOR under
        ``step_S/parity/`` (distributed/parity.py); a load whose rank's node is lost rebuilds
        its files from the others and the parity, every chunk checked by crc32c
        (distributed/parityload.py). Two hosts of one group lost: CorruptCheckpointError
        (``load(fallback=True)`` loads an older step that survives). G from 2 to
        MAX_PARITY_GROUP, at least 2 hosts, the same number of ranks on every host of a group;
        not with replicas > 1.
    failure_domains: each rank's failure domains beyond its host, outermost first, so that the
        copies also land in distinct racks or switches where the layout allows: a callable
        ``(rank, host) -> "switch0/rack3"`` or a mapping host -> domain; None: the
        GDSWRITER_FAILURE_DOMAINS rules (planner/replicas.py), else hosts only.
    """

    collective: bool | None = None
    timeout_s: float = 600.0
    replicated: tuple[str, ...] = ("model", "optimizer")
    load_share_dir: str | None = "/dev/shm"
    load_cross_memory: bool = True
    replicas: int = 1
    failure_domains: Any = None
    parity_group: int | None = None

    def __post_init__(self) -> None:
        self._check_replicas()
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

    def _check_replicas(self) -> None:
        c = self.replicas
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_REPLICAS:
            raise InvalidOptionError(f"replicas={c!r} must be a whole number of copies from 1 (no replicas, the "
                                     f"default) to {MAX_REPLICAS}; 2 survives losing any one node")
        g = self.parity_group
        if g is not None:
            if isinstance(g, bool) or not isinstance(g, int) or not 2 <= g <= MAX_PARITY_GROUP:
                raise InvalidOptionError(f"parity_group={g!r} must be None (off, the default) or the hosts one parity "
                                         f"block protects, from 2 to {MAX_PARITY_GROUP} (bytes on the drives: "
                                         f"G / (G - 1) of the state)")
            if c > 1:
                raise InvalidOptionError(f"parity_group={g} and replicas={c} cannot be combined: choose full copies "
                                         f"(replicas={c}) or parity (parity_group={g}), and leave the other at its "
                                         f"default (check GDSWRITER_REPLICAS and GDSWRITER_PARITY_GROUP)")
        d = self.failure_domains
        if d is not None and not callable(d) and not isinstance(d, Mapping):
            raise InvalidOptionError(f"failure_domains={d!r} must be None (GDSWRITER_FAILURE_DOMAINS, else hosts "
                                     f"only), a callable (rank, host) -> 'switch/rack', or a mapping host -> domain")

    @classmethod
    def from_env(cls, **overrides) -> DistOptions:
        """Defaults, then GDSWRITER_DIST_TIMEOUT, GDSWRITER_REPLICAS and GDSWRITER_PARITY_GROUP,
        then ``overrides``."""
        values: dict = {}
        for var, field, kind, what in ((TIMEOUT_ENV, "timeout_s", float, "a number of seconds"),
                                       (REPLICAS_ENV, "replicas", int, "a whole number of copies (1, 2, ...)"),
                                       (PARITY_ENV, "parity_group", int,
                                        "a whole number of hosts per parity group (2, 3, ...)")):
            raw = os.environ.get(var)
            if raw is None or not raw.strip():
                continue
            try:
                values[field] = kind(raw)
            except ValueError as e:
                raise InvalidOptionError(f"environment variable {var}={raw!r} is not {what}") from e
        values.update(overrides)
        return cls(**values)
