"""Drive endurance: the NVMe health log (SMART / Health Information, log page 0x02) and the
write budget a drive has left.

Checkpointing every few minutes to node-local NVMe can use up a drive's rated endurance
within months, so the checkpointer compares the bytes its saves write per day with that
budget (``WearWatch``, CheckpointOptions.endurance_horizon_days) and ``gdswriter doctor``
reports it. Here: the parsers (nvme-cli's ``nvme smart-log -o json``, and the raw 512-byte
page), a small table of rated endurance by model, the budget arithmetic (pure), and reading
a drive's log: ``nvme smart-log`` when nvme-cli is installed, else the admin passthrough
ioctl (NVME_IOCTL_ADMIN_CMD, Get Log Page 0x02, which needs CAP_SYS_ADMIN). Each drive's
log is read once per process (cached). sysfs exposes no wear counters; virtual disks
(virtio, Xen) and SATA/SAS drives have no NVMe health log: their wear is reported unknown.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._log import log_once
from .errors import HealthLogError

DATA_UNIT = 1000 * 512  # the log counts data units of 1000 512-byte blocks (NVMe base spec, log page 02h)
LOG_PAGE_BYTES = 512
TB = 10**12
DAY = 86400.0
NVME_IOCTL_ADMIN_CMD = 0xC0484E41  # _IOWR('N', 0x41, struct nvme_admin_cmd), 72 bytes
GET_LOG_PAGE, SMART_LOG_ID, ALL_NAMESPACES = 0x02, 0x02, 0xFFFFFFFF
MIN_SAVES = 3  # saves (two intervals) before the cadence is trusted
CADENCE_WINDOW = 32  # the newest save intervals the estimate uses

def human_si(n: float) -> str:
    """Bytes in decimal units, as drives are rated: '7.30 PB'."""
    for unit, scale in (("PB", 10**15), ("TB", TB), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class HealthLog:
    """The fields of the SMART / Health Information log that a write budget needs."""

    percentage_used: int  # the vendor's estimate of life used, 0-255 (may pass 100)
    data_units_written: int  # units of DATA_UNIT bytes written by the host
    data_units_read: int = 0
    critical_warning: int = 0  # bit 0 spare low, 2 reliability degraded, 3 read-only, ...
    available_spare: int | None = None  # percent
    power_on_hours: int | None = None

    @property
    def bytes_written(self) -> int:
        return self.data_units_written * DATA_UNIT


def _number(value, name: str) -> int:
    """nvme-cli writes its 128-bit counters as numbers, floats (1.x) or strings (some 2.x builds)."""
    if isinstance(value, bool) or value is None:
        raise HealthLogError(f"nvme smart-log JSON: {name}={value!r} is not a number")
    if isinstance(value, (int, float)):
        return int(value)
    try:
        return int(str(value).replace(",", "").strip())
    except ValueError as e:
        raise HealthLogError(f"nvme smart-log JSON: {name}={value!r} is not a number") from e


def parse_smart_log_json(doc: str | bytes | Mapping) -> HealthLog:
    """``nvme smart-log DEV -o json``'s output (or an object holding it under "smart_log")."""
    if isinstance(doc, (str, bytes)):
        try:
            doc = json.loads(doc)
        except ValueError as e:
            raise HealthLogError(f"nvme smart-log output is not JSON ({e}): was it run with -o json?") from e
    if isinstance(doc, Mapping) and isinstance(doc.get("smart_log"), Mapping):
        doc = doc["smart_log"]
    if not isinstance(doc, Mapping) or "data_units_written" not in doc or "percent_used" not in doc:
        raise HealthLogError("nvme smart-log JSON has no data_units_written / percent_used: not a smart-log")
    warning = doc.get("critical_warning", 0)
    if isinstance(warning, Mapping):  # nvme-cli 2.x, verbose: the bits spelled out, the byte as "value"
        warning = warning.get("value", 0)
    spare, hours = doc.get("avail_spare"), doc.get("power_on_hours")
    return HealthLog(percentage_used=_number(doc["percent_used"], "percent_used"),
                     data_units_written=_number(doc["data_units_written"], "data_units_written"),
                     data_units_read=_number(doc.get("data_units_read", 0), "data_units_read"),
                     critical_warning=_number(warning, "critical_warning"),
                     available_spare=None if spare is None else _number(spare, "avail_spare"),
                     power_on_hours=None if hours is None else _number(hours, "power_on_hours"))


def parse_log_page(raw: bytes) -> HealthLog:
    """The raw 512-byte log page 02h (NVMe base specification, "SMART / Health Information"):
    byte 0 critical warning, 3 available spare, 5 percentage used, 32-47 data units read,
    48-63 data units written, 128-143 power-on hours; counters are 128-bit little-endian."""
    if len(raw) < LOG_PAGE_BYTES:
        raise HealthLogError(f"an NVMe health log page is {LOG_PAGE_BYTES} bytes, got {len(raw)}: truncated read")

    def u128(offset: int) -> int:
        return int.from_bytes(raw[offset:offset + 16], "little")

    return HealthLog(percentage_used=raw[5], data_units_written=u128(48), data_units_read=u128(32),
                     critical_warning=raw[0], available_spare=raw[3], power_on_hours=u128(128))


# ---------------------------------------------------------------------------------- ratings
RATED_MODELS: tuple[tuple[str, str, float, int], ...] = (
    # (model number prefix, product, drive writes per day, warranty years), from the vendors'
    # data sheets; capacity x DWPD x 365 x years is the rating. GDSWRITER_DRIVE_TBW overrides.
    ("INTEL SSDPEDMD", "Intel SSD DC P3700", 10, 5),
    ("INTEL SSDPE2MD", "Intel SSD DC P3700", 10, 5),
    ("INTEL SSDPEDME", "Intel SSD DC P3600", 3, 5),
    ("INTEL SSDPE2ME", "Intel SSD DC P3600", 3, 5),
    ("SAMSUNG MZWLJ", "Samsung PM1733", 1, 5),
    ("SAMSUNG MZQL2", "Samsung PM9A3", 1, 5),
    ("KCM61R", "KIOXIA CM6-R", 1, 5),
    ("KCM61V", "KIOXIA CM6-V", 3, 5),
)


@dataclass(frozen=True)
class Rating:
    """A drive's rated endurance in bytes, and where the number comes from."""

    total_bytes: int
    source: str


def rating_for(model: str | None, capacity_bytes: int | None, tbw: float | None) -> Rating | None:
    """The rating: ``tbw`` (terabytes written, GDSWRITER_DRIVE_TBW) if given, else the table's
    DWPD x capacity x warranty for a known model; None when neither is known."""
    if tbw is not None:
        return Rating(int(tbw * TB), f"GDSWRITER_DRIVE_TBW / drive_tbw={tbw:g} TB")
    for prefix, product, dwpd, years in RATED_MODELS:
        if model and capacity_bytes and model.strip().upper().startswith(prefix):
            return Rating(int(capacity_bytes * dwpd * 365 * years),
                          f"{product}: {dwpd:g} drive writes/day x {years} years x {human_si(capacity_bytes)}")
    return None


def remaining_bytes(health: HealthLog | None, rating: Rating | None) -> int | None:
    """What is left of the rating: the lesser of (rating - bytes written) and (rating x the
    life not yet used, which counts the drive's own write amplification); the whole rating when
    the wear is unknown (no health log: counted as new). None without a rating."""
    if rating is None:
        return None
    if health is None:
        return rating.total_bytes
    by_writes = rating.total_bytes - health.bytes_written
    by_wear = rating.total_bytes * (100 - health.percentage_used) // 100
    return max(0, min(by_writes, by_wear))


def days_left(remaining: int, bytes_per_day: float) -> float:
    return float("inf") if bytes_per_day <= 0 else remaining / bytes_per_day


# ---------------------------------------------------------------------------------- drives
@dataclass(frozen=True)
class Drive:
    """A whole disk under a directory: its kernel name, NVMe controller (None: not NVMe),
    model number and capacity, and its share of what is written to the directory (1.0, or
    1/N for a member of an N-disk stripe)."""

    name: str
    controller: str | None
    model: str | None
    capacity_bytes: int | None
    share: float = 1.0

    def kind(self) -> str:
        """What it is, for a message: 'NVMe', 'virtio disk', ..."""
        if self.controller:
            return "NVMe"
        for prefix, what in (("vd", "virtio disk"), ("xvd", "Xen virtual disk"), ("sd", "SCSI/SATA disk"),
                             ("loop", "loop device"), ("zram", "compressed RAM disk"), ("nbd", "network block device")):
            if self.name.startswith(prefix):
                return what
        return "not NVMe"


def _sys(path: Path) -> str | None:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return path.read_text().strip()
    return None


def _disk(name: str, share: float) -> Drive:
    base = Path("/sys/class/block") / name
    ctrl = None
    m = re.match(r"(nvme\d+)(?:c\d+)?n\d+$", name)
    if m:
        ctrl = m.group(1)
        with contextlib.suppress(OSError):
            found = (base / "device").resolve().name  # nvme0n1/device -> .../nvme/nvme0
            ctrl = found if re.fullmatch(r"nvme\d+", found) else ctrl
    size = _sys(base / "size")
    return Drive(name, ctrl, _sys(base / "device" / "model") or None,
                 int(size) * 512 if size and size.isdigit() else None, share)


def drives_of(path: str | os.PathLike) -> list[Drive]:
    """The whole disks holding ``path``: a partition's disk; an md or dm device's members
    (striped: each takes an equal share; raid1 mirrors: each takes all). [] for a file system
    without a block device (tmpfs, NFS, overlay on no disk)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return []
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not node.exists():
        return []
    return _members(node.resolve(), 1.0, depth=0)


def _members(node: Path, share: float, depth: int) -> list[Drive]:
    if (node / "partition").exists():
        node = node.parent
    slaves = sorted((node / "slaves").iterdir()) if (node / "slaves").is_dir() else []
    if not slaves or depth > 3:
        return [_disk(node.name, share)]
    mirrored = (_sys(node / "md" / "level") or "") in ("raid1",)
    each = share if mirrored else share / len(slaves)
    return [d for s in slaves for d in _members(s.resolve(), each, depth + 1)]


def _controller_name(drive: Drive) -> str:
    return drive.controller or drive.name


# ---------------------------------------------------------------------------------- reading
_cache: dict[str, tuple[HealthLog | None, str]] = {}
_cache_lock = threading.Lock()


def health_of(drive: Drive) -> tuple[HealthLog | None, str]:
    """(the drive's health log or None, how it was read or why not), read once per process."""
    with _cache_lock:
        key = _controller_name(drive)
        if key not in _cache:
            _cache[key] = read_health(drive)
        return _cache[key]


def read_health(drive: Drive) -> tuple[HealthLog | None, str]:
    """Read the health log now: nvme-cli, else the admin ioctl."""
    if drive.controller is None:
        return None, f"{drive.name} is a {drive.kind()}, not an NVMe drive"
    why = []
    nvme = shutil.which("nvme")
    if nvme:
        try:
            done = subprocess.run([nvme, "smart-log", f"/dev/{drive.controller}", "-o", "json"], capture_output=True,
                                  text=True, timeout=20, check=False)
            if done.returncode == 0:
                return parse_smart_log_json(done.stdout), f"nvme smart-log /dev/{drive.controller}"
            why.append(f"nvme smart-log: {(done.stderr or done.stdout).strip()[:200] or f'exit {done.returncode}'}")
        except (OSError, subprocess.SubprocessError, HealthLogError) as e:
            why.append(f"nvme smart-log: {e}")
    else:
        why.append("nvme-cli is not installed")
    try:
        return parse_log_page(admin_get_log_page(f"/dev/{drive.controller}")), \
            f"NVMe admin ioctl on /dev/{drive.controller}"
    except OSError as e:
        why.append(f"admin ioctl on /dev/{drive.controller}: {e.strerror or e}")
    except HealthLogError as e:
        why.append(str(e))
    return None, "; ".join(why)


def admin_get_log_page(device: str, log_id: int = SMART_LOG_ID, nbytes: int = LOG_PAGE_BYTES) -> bytes:
    """Get Log Page through NVME_IOCTL_ADMIN_CMD on a controller (/dev/nvme0): needs read access
    to it and CAP_SYS_ADMIN. OSError as the kernel says."""
    buf = ctypes.create_string_buffer(nbytes)
    numd = nbytes // 4 - 1
    cmd = bytearray(72)  # struct nvme_admin_cmd (linux/nvme_ioctl.h)
    cmd[0] = GET_LOG_PAGE
    cmd[4:8] = ALL_NAMESPACES.to_bytes(4, "little")
    cmd[24:32] = ctypes.addressof(buf).to_bytes(8, "little")  # addr
    cmd[36:40] = nbytes.to_bytes(4, "little")  # data_len
    cmd[40:44] = ((numd & 0xFFFF) << 16 | log_id).to_bytes(4, "little")  # cdw10: NUMDL, LID
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd)
    finally:
        os.close(fd)
    return buf.raw


# ---------------------------------------------------------------------------------- the watch
@dataclass(frozen=True)
class Cadence:
    """The schedule measured from the saves: the median interval and the mean bytes per save."""

    interval_s: float
    bytes_per_save: float
    saves: int

    @property
    def bytes_per_day(self) -> float:
        return self.bytes_per_save * DAY / self.interval_s if self.interval_s > 0 else 0.0


def cadence(times: Sequence[float], sizes: Sequence[int]) -> Cadence | None:
    """From the saves' end times and sizes (oldest first); None before MIN_SAVES."""
    if len(times) < MIN_SAVES:
        return None
    times = list(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return Cadence(statistics.median(gaps), statistics.fmean(sizes), len(times))


def wear_message(where: str, drive: Drive, health: HealthLog | None, how: str, rating: Rating, pace: Cadence,
                 horizon_days: float) -> str | None:
    """The warning when ``pace`` uses up ``drive``'s remaining budget within ``horizon_days``
    (None otherwise), with the numbers; ``drive.share``: its part of each save's bytes."""
    left = remaining_bytes(health, rating)
    assert left is not None
    per_day = pace.bytes_per_day * drive.share
    days = days_left(left, per_day)
    if days >= horizon_days:
        return None
    model = f" ({drive.model})" if drive.model else ""
    wear = (f"{health.percentage_used}% used, {human_si(health.bytes_written)} written so far, read by {how}"
            if health else f"wear unknown, counted as new: {how}")
    share = f" ({drive.share:.0%} of each save)" if drive.share < 0.995 else ""
    return (f"gdswriter: at this checkpoint schedule (a save every {pace.interval_s:.3g} s, "
            f"{human_si(pace.bytes_per_save)} each, measured over {pace.saves} saves) drive {drive.name}{model} "
            f"under {where} takes {human_si(per_day)}/day{share}: its remaining endurance, {human_si(left)} of "
            f"{human_si(rating.total_bytes)} rated ({rating.source}; {wear}), lasts {days:.3g} days, less than the "
            f"horizon of {horizon_days:g} days (CheckpointOptions.endurance_horizon_days, "
            f"GDSWRITER_ENDURANCE_HORIZON_DAYS). Save less often or fewer bytes (retention does not reduce writes), "
            f"or put the roots on drives rated for more writes; endurance_horizon_days=None turns this check off")


class WearWatch:
    """Measures a checkpointer's schedule from its own saves and warns once per drive (the log)
    when it would use up the drive's rated endurance before the horizon. Each save's bytes are
    counted evenly over the roots (the planner balances them) and, within a root, over its
    drives (see drives_of). The roots' drives and their health logs are looked up once, at the
    first estimate (in the save thread, after a commit); nothing else is read."""

    def __init__(self, roots: Sequence[str | os.PathLike]):
        self.roots = [str(r) for r in roots]
        self.times: deque[float] = deque(maxlen=CADENCE_WINDOW + 1)
        self.sizes: deque[int] = deque(maxlen=CADENCE_WINDOW + 1)
        self.warned: list[str] = []
        self._drives: list[tuple[str, Drive]] | None = None

    def drives(self) -> list[tuple[str, Drive]]:
        """(the roots on it, the drive with its share of each save), one entry per drive."""
        if self._drives is None:
            found: dict[str, tuple[list[str], Drive, float]] = {}
            for root in self.roots:
                for d in drives_of(root):
                    where, _, share = found.get(d.name, ([], d, 0.0))
                    found[d.name] = ([*where, root], d, share + d.share / len(self.roots))
            self._drives = [(", ".join(w), Drive(d.name, d.controller, d.model, d.capacity_bytes, s))
                            for w, d, s in found.values()]
        return self._drives

    def saved(self, when: float, nbytes: int, horizon_days: float | None, tbw: float | None) -> None:
        """Record a committed save (its end, monotonic seconds, and its bytes) and check the pace."""
        self.times.append(when)
        self.sizes.append(nbytes)
        pace = cadence(self.times, self.sizes)
        if horizon_days is None or pace is None:
            return
        for where, d in self.drives():
            if d.name in self.warned:
                continue
            rating = rating_for(d.model, d.capacity_bytes, tbw)
            if rating is None:
                log_once(f"endurance-unknown:{d.name}", f"gdswriter: no endurance rating for drive {d.name} under "
                         f"{where} ({d.model or d.kind()}): set GDSWRITER_DRIVE_TBW (terabytes written) to check "
                         f"the checkpoint schedule against it", logging.DEBUG)
                continue
            health, how = health_of(d)
            msg = wear_message(where, d, health, how, rating, pace, horizon_days)
            if msg is not None:
                self.warned.append(d.name)
                log_once(f"endurance:{d.name}", msg)
