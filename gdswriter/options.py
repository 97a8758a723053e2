"""Keyword-only, validated, frozen option sets. Environment knobs use GDSWRITER_*."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Literal, get_args
from collections.abc import Sequence

from .errors import InvalidOptionError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALIGN = 4096  # every direct request is aligned to this (covers 512 B and 4 KiB logical blocks)

EngineKind = Literal["auto", "io_uring", "posix", "gds", "kvikio"]
ENGINES: tuple[str, ...] = get_args(EngineKind)


def _env_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise InvalidOptionError(f"environment variable {name}={raw!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def env_flag(name: str, default: bool) -> bool:
    """The boolean knob ``name`` (1/0, true/false, yes/no, on/off), ``default`` where unset;
    InvalidOptionError naming the accepted words for anything else."""
    raw = os.environ.get(name)
    return default if raw is None else _env_bool(name, raw)


def _env_int(name: str, raw: str) -> int:
    try:
        v = raw.strip().lower()
        for suffix, mult in (("k", KiB), ("m", MiB), ("g", GiB)):
            if v.endswith(suffix) or v.endswith(suffix + "ib"):
                return int(v[: v.index(suffix)]) * mult
        return int(v)
    except ValueError as e:
        raise InvalidOptionError(f"environment variable {name}={raw!r} is not an integer (a size may end in K, M or G)") from e


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How bytes move between memory and files.

    engine: "auto": GPUDirect Storage where it truly works (nvidia-fs loaded, cuFile agrees),
        else io_uring, else POSIX; "io_uring" or "posix" (gdswriter's own engines: CUDA
        tensors go through page-locked host buffers); "gds" (KvikIO, refusing to run unless
        GPUDirect Storage truly works); "kvikio" (KvikIO in whatever mode it runs, compat
        included). See docs/gds.md.
    queue_depth: I/O requests kept in flight at once.
    request_bytes: size of one read/write request (multiple of 4 KiB).
    buffer_bytes: size of one page-locked staging buffer (multiple of request_bytes).
    num_buffers: staging buffers; one fills while the others are in flight.
    direct_io: open files with O_DIRECT (falls back to buffered I/O + fsync where refused).
    preallocate: fallocate() the file before writing.
    register_buffers: register staging buffers with io_uring (READ/WRITE_FIXED).
    lock_memory: mlock() the staging buffers (page-locked; pinned for CUDA when available).
    huge_pages: ask for transparent huge pages for the staging buffers (see engines/buffers.py).
    zero_copy: under O_DIRECT, move large spans in 4 KiB-aligned host memory straight between
        the tensor and the file instead of through the staging buffers (half the CPU work).
    """

    engine: EngineKind = "auto"
    queue_depth: int = 32
    request_bytes: int = 1 * MiB
    buffer_bytes: int = 16 * MiB
    num_buffers: int = 8
    direct_io: bool = True
    preallocate: bool = True
    register_buffers: bool = True
    lock_memory: bool = True
    huge_pages: bool = True
    zero_copy: bool = True

    _ENV = {
        "engine": "GDSWRITER_ENGINE",
        "queue_depth": "GDSWRITER_QUEUE_DEPTH",
        "request_bytes": "GDSWRITER_REQUEST_BYTES",
        "buffer_bytes": "GDSWRITER_BUFFER_BYTES",
        "num_buffers": "GDSWRITER_NUM_BUFFERS",
        "direct_io": "GDSWRITER_DIRECT_IO",
        "preallocate": "GDSWRITER_PREALLOCATE",
        "register_buffers": "GDSWRITER_REGISTER_BUFFERS",
        "lock_memory": "GDSWRITER_LOCK_MEMORY",
        "huge_pages": "GDSWRITER_HUGE_PAGES",
        "zero_copy": "GDSWRITER_ZERO_COPY",
    }

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidOptionError(f"engine={self.engine!r} is unknown: choose one of {', '.join(ENGINES)}")
        for name in ("queue_depth", "request_bytes", "buffer_bytes", "num_buffers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidOptionError(f"{name}={v!r} must be a positive integer")
        if self.request_bytes % ALIGN:
            raise InvalidOptionError(f"request_bytes={self.request_bytes} must be a multiple of {ALIGN} (direct I/O alignment)")
        if self.buffer_bytes % self.request_bytes:
            raise InvalidOptionError(
                f"buffer_bytes={self.buffer_bytes} must be a multiple of request_bytes={self.request_bytes}")
        if self.num_buffers < 2:
            raise InvalidOptionError(f"num_buffers={self.num_buffers} must be >= 2 so that one buffer fills while another is written")
        if self.queue_depth > 4096:
            raise InvalidOptionError(f"queue_depth={self.queue_depth} is above io_uring's 4096-entry limit")

    @property
    def requests_per_buffer(self) -> int:
        return self.buffer_bytes // self.request_bytes

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> EngineOptions:
        """Defaults, then GDSWRITER_* variables, then explicit ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            var = cls._ENV.get(f.name)
            if var and var in env:
                raw = env[var]
                if f.type in ("bool", bool):
                    values[f.name] = _env_bool(var, raw)
                elif f.type in ("int", int):
                    values[f.name] = _env_int(var, raw)
                else:
                    values[f.name] = raw.strip()
        values.update(overrides)
        return cls(**values)


SnapshotMode = Literal["host", "live"]
BusyPolicy = Literal["wait", "skip"]
SNAPSHOT_MODES: tuple[str, ...] = get_args(SnapshotMode)
BUSY_POLICIES: tuple[str, ...] = get_args(BusyPolicy)


def _env_word(name: str, default: str) -> str:
    return os.environ[name].strip().lower() if name in os.environ else default


def _env_size(name: str, default: int) -> int:
    return _env_int(name, os.environ[name]) if name in os.environ else default


DEFAULT_ENDURANCE_HORIZON_DAYS = 3 * 365.0


def _env_days_or_off(name: str, default: float | None) -> float | None:
    """A number of days, or 'off' / 'none' / '0' for None."""
    if name not in os.environ:
        return default
    raw = os.environ[name].strip().lower()
    if raw in ("off", "none", "0", ""):
        return None
    try:
        return float(raw)
    except ValueError as e:
        raise InvalidOptionError(f"environment variable {name}={raw!r} is not a number of days: use e.g. 1095, "
                                 f"or off") from e


def env_drive_tbw() -> float | None:
    """GDSWRITER_DRIVE_TBW: the rated endurance of the checkpoint drives, in terabytes written
    (10^12 bytes), where their model is not in gdswriter's table (endurance.py); None if unset."""
    raw = os.environ.get("GDSWRITER_DRIVE_TBW", "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError as e:
        raise InvalidOptionError(f"environment variable GDSWRITER_DRIVE_TBW={raw!r} is not a number of terabytes "
                                 f"written: use the drive's rated TBW, e.g. 7008 (a 3.84 TB drive at 1 drive "
                                 f"write per day for 5 years)") from e


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """What a GDSCheckpointer keeps and checks, and how a save overlaps training.

    keep_last: keep only the newest N committed steps (None: keep all). Steps above the one
        just saved (left by a rolled-back run) are never deleted by retention.
    keep_every: additionally keep every step divisible by K (e.g. 1000).
    save_rng: save torch (CPU and CUDA), Python and numpy RNG state; load restores it.
    verify: check every chunk's crc32c on load (cheap: computed while bytes stream).
    files_per_root: data files (writers) per root directory.
    engine: how bytes move (EngineOptions; default from GDSWRITER_* variables).
    snapshot: how a save holds the bytes it writes while training goes on
        (GDSWRITER_SNAPSHOT):
        "host" (default): copied into a reusable host pool (pinned where the state is on a
            GPU), chunk by chunk while the files are written; the next optimizer step waits
            only for the copy;
        "live": no copy; the engine writes straight from the live tensors; the next
            optimizer step waits until every byte is written.
    snapshot_pool_bytes: the most host memory the "host" pool takes
        (GDSWRITER_SNAPSHOT_POOL_BYTES, e.g. 8G; default 4 GiB). It is allocated at the first
        host-mode save with the state's size, up to this bound, and reused; a larger state
        streams through it (the optimizer step then also waits for the disk to free room).
        The pool never takes less than the streaming pipeline needs to be deadlock-free,
        4 x roots x engine.buffer_bytes (or the state's size if smaller): a lower bound is
        raised to that, with a one-time note in the log.
    on_busy: what save_async does while an earlier save is still running: "wait" (default;
        the new save is queued behind it, and save_async blocks only if one is already
        queued) or "skip" (no save; the handle says ``skipped`` and a warning is logged).
        A checkpointer of several ranks refuses "skip" (each rank would decide alone, and
        the ranks would save different steps).
    stats_log_level: the logging level of each save's one-line report (time training was
        blocked, snapshot and write time, bytes, GB/s); default DEBUG.
    drain_root: a directory on shared storage (Lustre, NFS, a bucket mount) that committed
        steps are copied to in the background (None: no drain). There each becomes a complete
        gdswriter step with its own crash-atomic commit: ``GDSCheckpointer(root=drain_root)``,
        ``gdswriter.load_state`` and ``gdswriter verify`` read it as any root, so a job whose
        nodes (and node-local roots) are all gone resumes from it. The drain never delays a
        save; one drain runs at a time, and a newer committed step replaces one still waiting.
        A single process only for now (a checkpointer of several ranks refuses it).
    drain_every: drain every N-th step (the steps divisible by N; default 1: every step).
    drain_keep_last: how many drained steps the drain root keeps (None: as ``keep_last``;
        ``keep_every`` applies there too).
    endurance_horizon_days: how long the roots' drives should last at the schedule the saves
        keep (GDSWRITER_ENDURANCE_HORIZON_DAYS; default 3 years; None or "off": no check).
        From the third save on, the bytes per save and the time between saves give the bytes
        written per day; a drive whose remaining rated endurance (its NVMe health log, and its
        rating: gdswriter's table of known models or ``drive_tbw``) would be used up sooner
        gets one warning in the log, with the numbers (gdswriter/endurance.py).
    drive_tbw: the drives' rated endurance in terabytes written (GDSWRITER_DRIVE_TBW), for
        drives gdswriter's table does not know; a drive without a health log counts as new.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    save_rng: bool = False
    verify: bool = True
    files_per_root: int = 1
    engine: EngineOptions = field(default_factory=EngineOptions.from_env)
    snapshot: SnapshotMode = field(default_factory=lambda: _env_word("GDSWRITER_SNAPSHOT", "host"))
    snapshot_pool_bytes: int = field(default_factory=lambda: _env_size("GDSWRITER_SNAPSHOT_POOL_BYTES", 4 * GiB))
    on_busy: BusyPolicy = "wait"
    stats_log_level: int = logging.DEBUG
    drain_root: str | os.PathLike | None = None
    drain_every: int = 1
    drain_keep_last: int | None = None
    endurance_horizon_days: float | None = field(default_factory=lambda: _env_days_or_off(
        "GDSWRITER_ENDURANCE_HORIZON_DAYS", DEFAULT_ENDURANCE_HORIZON_DAYS))
    drive_tbw: float | None = field(default_factory=env_drive_tbw)

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "drain_keep_last"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidOptionError(f"{name}={v!r} must be None or an integer >= 1")
        if not isinstance(self.files_per_root, int) or self.files_per_root < 1:
            raise InvalidOptionError(f"files_per_root={self.files_per_root!r} must be an integer >= 1")
        if not isinstance(self.engine, EngineOptions):
            raise InvalidOptionError("engine must be an EngineOptions instance")
        if self.snapshot not in SNAPSHOT_MODES:
            raise InvalidOptionError(f"snapshot={self.snapshot!r} is unknown (GDSWRITER_SNAPSHOT?): choose "
                                     f"{' or '.join(map(repr, SNAPSHOT_MODES))}")
        v = self.snapshot_pool_bytes
        if not isinstance(v, int) or isinstance(v, bool) or v < ALIGN:
            raise InvalidOptionError(f"snapshot_pool_bytes={v!r} must be an integer >= {ALIGN} "
                                     f"(GDSWRITER_SNAPSHOT_POOL_BYTES takes sizes like 8G)")
        if self.on_busy not in BUSY_POLICIES:
            raise InvalidOptionError(f"on_busy={self.on_busy!r} is unknown: choose 'wait' or 'skip'")
        if not isinstance(self.stats_log_level, int) or isinstance(self.stats_log_level, bool):
            raise InvalidOptionError(f"stats_log_level={self.stats_log_level!r} must be a logging level "
                                     f"such as logging.INFO")
        self._check_drain()
        self._check_endurance()

    def _check_endurance(self) -> None:
        for name, what in (("endurance_horizon_days", "days (None: no endurance check)"),
                           ("drive_tbw", "terabytes written (None: the rating of a known model, if any)")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                raise InvalidOptionError(f"{name}={v!r} must be None or a positive number of {what}")

    def _check_drain(self) -> None:
        root, every = self.drain_root, self.drain_every
        if root is not None and (not isinstance(root, (str, os.PathLike)) or not os.fspath(root)):
            raise InvalidOptionError(f"drain_root={root!r} must be a directory path (str or os.PathLike) on "
                                     f"shared storage, or None for no drain")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidOptionError(f"drain_every={every!r} must be an integer >= 1 (1: drain every step)")

    def retained(self, steps: Sequence[int], newest: int) -> set[int]:
        """Which of the committed ``steps`` the retention policy keeps, ``newest`` having just
        been committed. Steps above ``newest`` are left by a run that was rolled back (resumed
        from an older step): they are kept, and not counted, so that the rolled-back run's
        own steps are not deleted to make room for them."""
        return retained_steps(steps, newest, self.keep_last, self.keep_every)

    def drain_retained(self, steps: Sequence[int], newest: int) -> set[int]:
        """``retained`` at the drain root: ``drain_keep_last`` (default ``keep_last``) and ``keep_every``."""
        keep_last = self.keep_last if self.drain_keep_last is None else self.drain_keep_last
        return retained_steps(steps, newest, keep_last, self.keep_every)


def retained_steps(steps: Sequence[int], newest: int, keep_last: int | None, keep_every: int | None) -> set[int]:
    """CheckpointOptions.retained's rule for given ``keep_last`` and ``keep_every``."""
    if keep_last is None:
        return set(steps)
    ordered = sorted(s for s in steps if s <= newest)
    keep = set(ordered[-keep_last:]) | {newest} | {s for s in steps if s > newest}
    if keep_every:
        keep.update(s for s in ordered if s % keep_every == 0)
    return keep
