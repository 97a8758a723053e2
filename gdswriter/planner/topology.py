"""Where GPUs and drives sit in the machine: a frozen value, its distances, and its JSON form.

A ``Topology`` is built from the live machine (planner/discover.py) or read back from
JSON (``Topology.from_json``), so that a DGX A100, a DGX H100 or any captured machine
can be replayed on a laptop. It is pure data: nothing here touches the machine.

Every PCI device carries ``path``: the PCI functions from its root port down to the
device itself, as the kernel lays them out in sysfs
(``/sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/.../0000:07:00.0`` gives
``("0000:00:01.1", "0000:01:00.0", ..., "0000:07:00.0")``).

Distance between two devices (``Topology.distance``), nearest first:

* ``SWITCH``: both lie below the same root port, so their lowest common ancestor is a
  PCIe bridge below the host bridge (a root port can only link to one device, so two
  devices below it means a switch): peer-to-peer traffic turns around inside the
  switch and never enters the CPU.
* ``NUMA``: same NUMA node (or, when the node is not reported, the same host bridge),
  different root ports: traffic crosses the socket's root complex.
* ``SOCKET``: different NUMA nodes of one CPU socket (AMD NPS2/NPS4, Intel SNC).
* ``REMOTE``: different sockets: traffic crosses the inter-socket link (xGMI, UPI).
* ``UNKNOWN``: a location is missing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path
from typing import Any

from ..errors import InvalidOptionError

SCHEMA = "gdswriter.topology"
SCHEMA_VERSION = 1

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class Distance(IntEnum):
    SWITCH = 0
    NUMA = 1
    SOCKET = 2
    REMOTE = 3
    UNKNOWN = 4

    @property
    def label(self) -> str:
        return self.name.lower()


def normalize_bdf(bus_id: str) -> str:
    """'00000000:07:00.0' (NVML) or '0000:07:00.0' -> '0000:07:00.0' (sysfs form, lower case)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])\s*", text)
    if not m:
        raise InvalidOptionError(f"{bus_id!r} is not a PCI address (expected domain:bus:device.function)")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def pci_path_of(sysfs_path: str | Path) -> tuple[str, ...]:
    """The PCI functions along a sysfs device path, root port first (``()`` if it is not on PCI)."""
    return tuple(part for part in Path(sysfs_path).parts if _BDF.match(part))


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML numbers it (``index``), where it sits, and its NUMA node (-1: unknown)."""

    index: int
    pci: str
    name: str = ""
    numa: int = -1
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Drive:
    """A physical drive: an NVMe controller (``nvme0``) or another disk (``vda``, ``sda``).

    ``pci`` is empty when it is not on PCI (NVMe over fabrics, loop, zram)."""

    name: str
    kind: str = "nvme"
    pci: str = ""
    numa: int = -1
    path: tuple[str, ...] = ()
    model: str = ""


@dataclass(frozen=True)
class Mount:
    """A mounted file system and what lies behind it.

    ``kind`` says how writes reach ``drives``: ``disk`` (one drive, maybe a partition),
    ``raid0``/``raid1``/``raid5``/... (md), ``dm`` (device mapper: LVM, crypt), or, with
    no drives, ``memory`` (tmpfs), ``network``, ``overlay``, ``virtual`` (loop, zram)
    or ``unknown``. ``layout`` is the chain for people, e.g. ``md1 raid0 over nvme0n1, ...``.
    """

    mountpoint: str
    fstype: str = ""
    source: str = ""
    dev: str = ""  # "major:minor" as stat() reports it
    kind: str = "unknown"
    drives: tuple[str, ...] = ()
    layout: str = ""

    @property
    def mirrored(self) -> bool:
        """Every byte written lands on every member drive (RAID-1)."""
        return self.kind == "raid1"

    @property
    def width(self) -> int:
        """How many drives' worth of writes it absorbs: its drives, less mirror copies and
        parity (RAID-1: 1, RAID-10: half, RAID-5: one less, RAID-6: two less); at least 1."""
        n = len(self.drives)
        less = {"raid1": n - 1, "raid10": n // 2, "raid4": 1, "raid5": 1, "raid6": 2}.get(self.kind, 0)
        return max(1, n - less)


@dataclass(frozen=True)
class NumaNode:
    node: int
    socket: int = -1  # -1: the node has no CPUs (memory-only) or the socket is not reported
    cpus: str = ""


@dataclass(frozen=True)
class Topology:
    """GPUs, drives, NUMA nodes and mounts of one machine, plus what discovery noticed."""

    source: str = "live"
    host: str = ""
    gpus: tuple[Gpu, ...] = ()
    drives: tuple[Drive, ...] = ()
    numa: tuple[NumaNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    notes: tuple[str, ...] = ()
    live: bool = field(default=False, compare=False)

    # -- lookups --------------------------------------------------------------------------

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU {index} in this topology (GPUs: {[g.index for g in self.gpus]})")

    def drive(self, name: str) -> Drive | None:
        for d in self.drives:
            if d.name == name:
                return d
        return None

    def socket_of(self, numa: int) -> int:
        for n in self.numa:
            if n.node == numa:
                return n.socket
        return -1

    @property
    def sockets(self) -> tuple[int, ...]:
        return tuple(sorted({n.socket for n in self.numa if n.socket >= 0}))

    def mount_of(self, path: str | Path, dev: str | None = None) -> Mount | None:
        """The mount holding ``path``: the one whose ``dev`` matches (when given and known),
        else the longest mount point that prefixes ``path``."""
        text = str(path)
        by_prefix = sorted((m for m in self.mounts if _under(text, m.mountpoint)),
                           key=lambda m: len(m.mountpoint), reverse=True)
        if dev:
            for m in by_prefix + [m for m in self.mounts if m not in by_prefix]:
                if m.dev == dev:
                    return m
        return by_prefix[0] if by_prefix else None

    # -- distance -------------------------------------------------------------------------

    def distance(self, a: Gpu | Drive, b: Gpu | Drive) -> Distance:
        """How far apart two devices are (see the module docstring)."""
        if a.path and b.path and a.path[0] == b.path[0] and len(a.path) > 1 and len(b.path) > 1:
            return Distance.SWITCH
        if a.numa >= 0 and b.numa >= 0:
            if a.numa == b.numa:
                return Distance.NUMA
            sa, sb = self.socket_of(a.numa), self.socket_of(b.numa)
            if sa >= 0 and sb >= 0:
                return Distance.SOCKET if sa == sb else Distance.REMOTE
            return Distance.UNKNOWN
        if a.path and b.path and _root_bus(a.path[0]) == _root_bus(b.path[0]):
            return Distance.NUMA  # same host bridge: same root complex, whatever the node
        return Distance.UNKNOWN

    def switch_of(self, dev: Gpu | Drive) -> str | None:
        """The root port a device's PCIe switch hangs from, or None if it is attached
        directly to a root port (or not on PCI). Devices sharing it are ``SWITCH`` apart."""
        return dev.path[0] if len(dev.path) >= 3 else None

    def affinity_problems(self) -> list[str]:
        """Why locality cannot be chosen on this machine (empty if it can)."""
        problems = []
        if not self.gpus:
            problems.append("no GPUs found")
        if not any(d.numa >= 0 or d.path for d in self.drives):
            problems.append("no drives with a known location")
        located = [d for d in (*self.gpus, *self.drives) if d.numa >= 0 or d.path]
        if len(self.numa) <= 1 and not any(self.switch_of(d) for d in located):
            problems.append(f"{len(self.numa) or 'no'} NUMA node{'' if len(self.numa) == 1 else 's'} "
                            f"and no PCIe switches")
        return problems

    # -- derived machines -----------------------------------------------------------------

    def with_mounts(self, mounts: Iterable[Mount], note: str = "") -> Topology:
        return replace(self, mounts=tuple(mounts), notes=self.notes + ((note,) if note else ()))

    def one_mount_per_drive(self, drives: Sequence[str], prefix: str = "/mnt") -> Topology:
        """The same machine with each of ``drives`` formatted and mounted on its own at
        ``prefix/<drive>`` (what GPU-local placement needs), in place of any array over them."""
        taken = set(drives)
        kept = [m for m in self.mounts if not (set(m.drives) & taken)]
        per_drive = [Mount(f"{prefix.rstrip('/')}/{d}", "ext4", f"/dev/{d}n1", "", "disk", (d,), f"{d}n1")
                     for d in drives]
        return self.with_mounts(kept + per_drive, f"what-if: {', '.join(drives)} each mounted on its own "
                                                  f"under {prefix} instead of in an array")

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "source": self.source,
            "host": self.host,
            "notes": list(self.notes),
            "numa": [{"node": n.node, "socket": n.socket, "cpus": n.cpus} for n in self.numa],
            "gpus": [{"index": g.index, "pci": g.pci, "name": g.name, "numa": g.numa, "path": list(g.path)}
                     for g in self.gpus],
            "drives": [{"name": d.name, "kind": d.kind, "pci": d.pci, "numa": d.numa, "path": list(d.path),
                        "model": d.model} for d in self.drives],
            "mounts": [{"mountpoint": m.mountpoint, "fstype": m.fstype, "source": m.source, "dev": m.dev,
                        "kind": m.kind, "drives": list(m.drives), "layout": m.layout} for m in self.mounts],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "topology") -> Topology:
        """Read ``to_dict``'s form back; a bad document gets InvalidOptionError naming the field."""
        if not isinstance(data, Mapping):
            raise InvalidOptionError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise InvalidOptionError(f"{where}: not a gdswriter topology (schema is {data.get('schema')!r}, "
                                     f"expected {SCHEMA!r}); write one with `gdswriter topology --json`")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise InvalidOptionError(f"{where}: topology version {version!r} is not supported (this gdswriter "
                                     f"reads version {SCHEMA_VERSION}); upgrade gdswriter or re-capture it")
        try:
            numa = tuple(NumaNode(int(n["node"]), int(n.get("socket", -1)), str(n.get("cpus", "")))
                         for n in data.get("numa", ()))
            gpus = tuple(Gpu(int(g["index"]), normalize_bdf(g["pci"]), str(g.get("name", "")),
                             int(g.get("numa", -1)), _path(g.get("path", ())))
                         for g in data.get("gpus", ()))
            drives = tuple(Drive(str(d["name"]), str(d.get("kind", "nvme")),
                                 normalize_bdf(d["pci"]) if d.get("pci") else "", int(d.get("numa", -1)),
                                 _path(d.get("path", ())), str(d.get("model", "")))
                           for d in data.get("drives", ()))
            mounts = tuple(Mount(str(m["mountpoint"]), str(m.get("fstype", "")), str(m.get("source", "")),
                                 str(m.get("dev", "")), str(m.get("kind", "unknown")),
                                 tuple(str(x) for x in m.get("drives", ())), str(m.get("layout", "")))
                           for m in data.get("mounts", ()))
            topo = cls(str(data.get("source", where)), str(data.get("host", "")), gpus, drives, numa, mounts,
                       tuple(str(x) for x in data.get("notes", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidOptionError(f"{where}: malformed topology ({type(e).__name__}: {e})") from e
        _check(topo, where)
        return topo

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "topology") -> Topology:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise InvalidOptionError(f"{where}: not JSON ({e})") from e
        if isinstance(data, Mapping) and "topology" in data and "schema" not in data:
            data = data["topology"]  # the whole output of `gdswriter topology --json`
        return cls.from_dict(data, where=where)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise InvalidOptionError(f"cannot read topology file {path}: {e.strerror or e}") from e
        return cls.from_json(text, where=str(path))


def _under(path: str, mountpoint: str) -> bool:
    return path == mountpoint or mountpoint == "/" or path.startswith(mountpoint.rstrip("/") + "/")


def _root_bus(bdf: str) -> str:
    return bdf.rsplit(":", 1)[0]


def _path(items: Iterable[str]) -> tuple[str, ...]:
    if isinstance(items, str):
        raise TypeError("path must be a list of PCI addresses")
    return tuple(normalize_bdf(x) for x in items)


def _check(topo: Topology, where: str) -> None:
    def dupes(values: list) -> set:
        return {v for v in values if values.count(v) > 1}

    for what, values in (("GPU index", [g.index for g in topo.gpus]), ("drive", [d.name for d in topo.drives]),
                         ("NUMA node", [n.node for n in topo.numa]),
                         ("mount point", [m.mountpoint for m in topo.mounts])):
        if dupes(values):
            raise InvalidOptionError(f"{where}: {what} {sorted(dupes(values))} listed twice")
    for dev in (*topo.gpus, *topo.drives):
        if dev.path and dev.pci and dev.path[-1] != dev.pci:
            raise InvalidOptionError(f"{where}: the PCI path of {dev.pci} must end at the device itself, "
                                     f"not at {dev.path[-1]}")
    names = {d.name for d in topo.drives}
    for m in topo.mounts:
        missing = [d for d in m.drives if d not in names]
        if missing:
            raise InvalidOptionError(f"{where}: mount {m.mountpoint} names drives {missing} that are not "
                                     f"listed under 'drives'")
