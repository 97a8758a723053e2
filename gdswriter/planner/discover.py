"""Read the live machine's topology: GPUs from NVML, drives, NUMA nodes and mounts from sysfs.

``discover()`` never fails and never needs root: whatever it cannot read becomes a note
in the returned Topology (no NVML, no NVMe, one NUMA node, a root on tmpfs...), and the
planner then has no affinity to use. Every path is a parameter (``sysfs``, ``proc``,
``nvml``) so that tests replay fake sysfs trees and a fake NVML.

What it reads (all world-readable):

* ``<sysfs>/devices/system/node/node*/cpulist`` and
  ``<sysfs>/devices/system/cpu/cpu*/topology/physical_package_id``: NUMA node -> socket;
* NVML (nvidia-ml-py, optional): GPU index, PCI bus id, name, NUMA node (where NVML does
  not report it: ``<sysfs>/bus/pci/devices/<bdf>/numa_node``); the realpath of that sysfs
  entry gives the chain of bridges above the GPU;
* ``<sysfs>/class/nvme/nvme*``: NVMe controllers, their PCI function and model;
* ``<proc>/self/mountinfo`` and ``<sysfs>/dev/block/MAJ:MIN``: which block device holds
  each file system, down through partitions, device mapper (LVM, crypt) and md RAID
  (``slaves/``) to the member drives.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket as _socket
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from .topology import Drive, Gpu, Mount, NumaNode, Topology, normalize_bdf, pci_path_of

# File systems that never hold a checkpoint root; left out of the mount table.
_PSEUDO_FS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "securityfs", "debugfs", "tracefs", "pstore",
    "bpf", "configfs", "fusectl", "hugetlbfs", "autofs", "binfmt_misc", "rpc_pipefs", "nsfs", "efivarfs",
    "devtmpfs", "selinuxfs", "nfsd", "ramfs", "squashfs",
})
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "wekafs", "9p",
               "virtiofs", "fuse")
_VIRTUAL_DISKS = ("loop", "zram", "ram", "nbd")


def discover(*, sysfs: str | os.PathLike = "/sys", proc: str | os.PathLike = "/proc",
             nvml: ModuleType | Any | None = None, roots: Iterable[str | os.PathLike] = ()) -> Topology:
    """The topology of this machine (see the module docstring).

    ``nvml``: an NVML binding to use (tests pass a fake); None imports ``pynvml``.
    ``roots``: directories whose mounts must appear even if they have no block device
    (tmpfs, network, overlay); other such mounts are left out to keep the table short.
    """
    sysfs, proc = Path(sysfs), Path(proc)
    notes: list[str] = []
    numa = _numa_nodes(sysfs)
    single_node = numa[0].node if len(numa) == 1 else None
    if len(numa) <= 1:
        notes.append("one NUMA node: every device is local to it" if numa else "no NUMA information in sysfs")
    gpus = _gpus(sysfs, nvml, single_node, notes)
    nvme = _nvme_drives(sysfs, single_node)
    if not nvme:
        notes.append(f"no NVMe controllers in {sysfs}/class/nvme")
    mounts, disks = _mounts(sysfs, proc, nvme, single_node, [Path(r) for r in roots], notes)
    drives = tuple(nvme.values()) + tuple(d for name, d in disks.items() if name not in nvme)
    topo = Topology("live", _hostname(), gpus, drives, numa, mounts, (), live=True)
    problems = topo.affinity_problems()
    if problems:
        notes.append("no affinity: " + "; ".join(problems) + ". GPU-local placement has nothing to choose; "
                     "plans only balance bytes")
    return replace(topo, notes=tuple(notes))


def cuda_gpu_indices(topology: Topology) -> dict[int, int]:
    """{CUDA ordinal: topology GPU index} for the GPUs this process sees, matched by PCI address.

    CUDA ordinals differ from NVML indices under CUDA_VISIBLE_DEVICES and with the default
    CUDA_DEVICE_ORDER=FASTEST_FIRST; the PCI address is the common key. Empty without CUDA.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        by_pci = {g.pci: g.index for g in topology.gpus}
        out = {}
        for ordinal in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(ordinal)
            pci = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            if pci in by_pci:
                out[ordinal] = by_pci[pci]
        return out
    except (ImportError, RuntimeError, AttributeError):
        return {}


# -- NUMA ---------------------------------------------------------------------------------

def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return default


def _read_int(path: Path, default: int = -1) -> int:
    try:
        return int(_read(path, str(default)))
    except ValueError:
        return default


def _first_cpu(cpulist: str) -> int | None:
    m = re.match(r"\s*(\d+)", cpulist)
    return int(m.group(1)) if m else None


def _numa_nodes(sysfs: Path) -> tuple[NumaNode, ...]:
    base = sysfs / "devices/system/node"
    nodes = []
    with contextlib.suppress(OSError):
        for entry in sorted(base.iterdir(), key=lambda p: p.name):
            m = re.fullmatch(r"node(\d+)", entry.name)
            if not m:
                continue
            cpus = _read(entry / "cpulist")
            cpu = _first_cpu(cpus)
            sock = -1 if cpu is None else _read_int(sysfs / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id")
            nodes.append(NumaNode(int(m.group(1)), sock, cpus))
    return tuple(sorted(nodes, key=lambda n: n.node))


def _numa_of(sysfs_device: Path, single_node: int | None) -> int:
    """The NUMA node of a device: its own numa_node, else the nearest ancestor's (devices
    behind VMD or virtio report -1); on a one-node machine that node."""
    for p in (sysfs_device, *sysfs_device.parents):
        if p == p.parent or p.name in ("devices", "sys"):
            break
        n = _read_int(p / "numa_node")
        if n >= 0:
            return n
    return single_node if single_node is not None else -1


# -- GPUs ---------------------------------------------------------------------------------

def _import_nvml() -> ModuleType | None:
    try:
        import pynvml

        return pynvml
    except ImportError:
        return None


def _gpus(sysfs: Path, nvml: Any, single_node: int | None, notes: list[str]) -> tuple[Gpu, ...]:
    if nvml is None:
        nvml = _import_nvml()
        if nvml is None:
            notes.append("NVML: nvidia-ml-py is not installed (pip install 'gdswriter[nvml]'), so no GPUs are "
                         "listed")
            return ()
    nvml_error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (nvml_error, OSError) as e:
        notes.append(f"NVML: cannot initialise ({e}); no GPUs listed (no NVIDIA driver on this machine?)")
        return ()
    gpus = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            pci = normalize_bdf(nvml.nvmlDeviceGetPciInfo(h).busId)
            name = nvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            dev = Path(os.path.realpath(sysfs / "bus/pci/devices" / pci))
            numa = -1
            with contextlib.suppress(nvml_error, AttributeError):
                numa = int(nvml.nvmlDeviceGetNumaNodeId(h))  # NotSupported on many systems
            if numa < 0:
                numa = _numa_of(dev, single_node)
            path = pci_path_of(dev) if dev.exists() else ()
            if not path:
                notes.append(f"GPU {i} ({pci}): not found under {sysfs}/bus/pci/devices; its PCIe switch is "
                             f"unknown")
            gpus.append(Gpu(i, pci, name, numa, path))
    except nvml_error as e:
        notes.append(f"NVML: listing GPUs failed ({e}); GPUs after {len(gpus)} are missing")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return tuple(gpus)


# -- drives and block devices ---------------------------------------------------------------

def _nvme_drives(sysfs: Path, single_node: int | None) -> dict[str, Drive]:
    base = sysfs / "class/nvme"
    out: dict[str, Drive] = {}
    with contextlib.suppress(OSError):
        for entry in sorted(base.iterdir(), key=lambda p: _natural(p.name)):
            if not re.fullmatch(r"nvme\d+", entry.name):
                continue
            dev = Path(os.path.realpath(entry / "device"))
            path = pci_path_of(dev)
            transport = _read(entry / "transport", "pcie")
            model = " ".join(_read(entry / "model").split())
            if not path:  # NVMe over fabrics: no PCI function of ours
                out[entry.name] = Drive(entry.name, f"nvme-{transport}", "", -1, (), model)
                continue
            out[entry.name] = Drive(entry.name, "nvme", path[-1], _numa_of(dev, single_node), path, model)
    return out


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class _Resolver:
    """Follows a block device down to the drives holding its bytes."""

    def __init__(self, sysfs: Path, nvme: Mapping[str, Drive], single_node: int | None):
        self.sysfs, self.nvme, self.single_node = sysfs, nvme, single_node
        self.disks: dict[str, Drive] = {}

    def resolve(self, block: Path) -> tuple[str, tuple[str, ...], str]:
        """(kind, drive names, layout) of the block device whose sysfs entry is ``block``."""
        real = Path(os.path.realpath(block))
        name = real.name
        if (real / "partition").exists():
            kind, drives, layout = self.resolve(real.parent)
            return kind, drives, f"{name} on {layout}"
        slaves = sorted((p for p in (real / "slaves").iterdir()), key=lambda p: _natural(p.name)) \
            if (real / "slaves").is_dir() else []
        if slaves:
            parts = [self.resolve(s) for s in slaves]
            drives = tuple(dict.fromkeys(d for _, ds, _ in parts for d in ds))
            inner = ", ".join(layout for _, _, layout in parts)
            level = _read(real / "md/level")
            if level:
                return level, drives, f"{name} {level} over {inner}"
            uuid = _read(real / "dm/uuid")
            what = uuid.split("-", 1)[0].lower() if "-" in uuid else "dm"
            label = _read(real / "dm/name") or name
            return "dm", drives, f"{label} ({what}) over {inner}"
        drives = self._drives_of_leaf(real)
        if not drives:
            return "virtual", (), name
        return "disk", drives, name

    def _drives_of_leaf(self, real: Path) -> tuple[str, ...]:
        parts = real.parts
        if "nvme-subsystem" in parts:  # native NVMe multipath head: every controller of the subsystem
            subsys = real.parent
            ctrls = sorted((p.name for p in subsys.iterdir() if re.fullmatch(r"nvme\d+", p.name)), key=_natural) \
                if subsys.is_dir() else []
            return tuple(c for c in ctrls if c in self.nvme) or tuple(ctrls)
        if "nvme" in parts:
            ctrl = parts[parts.index("nvme") + 1]
            return (ctrl,)
        name = real.name
        if name.startswith(_VIRTUAL_DISKS) or "virtual" in parts:
            return ()
        if name not in self.disks:
            path = pci_path_of(real)
            kind = "virtio" if name.startswith("vd") else "scsi" if name.startswith("sd") else "disk"
            model = " ".join(_read(real / "device/model").split())
            self.disks[name] = Drive(name, kind, path[-1] if path else "",
                                     _numa_of(real, self.single_node) if path else -1, path, model)
        return (name,)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(sysfs: Path, proc: Path, nvme: Mapping[str, Drive], single_node: int | None, roots: list[Path],
            notes: list[str]) -> tuple[tuple[Mount, ...], dict[str, Drive]]:
    resolver = _Resolver(sysfs, nvme, single_node)
    root_devs = {root_dev(r) for r in roots} - {None}
    try:
        lines = (proc / "self/mountinfo").read_text().splitlines()
    except OSError as e:
        notes.append(f"cannot read {proc}/self/mountinfo ({e.strerror}); roots cannot be matched to drives")
        return (), {}
    by_point: dict[str, Mount] = {}
    for line in lines:
        left, sep, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if not sep or len(f) < 5 or len(r) < 2:
            continue
        dev, point, fstype, source = f[2], _unescape(f[4]), r[0], _unescape(r[1])
        if fstype in _PSEUDO_FS and dev not in root_devs:
            continue
        kind, drives, layout = _describe(sysfs, resolver, dev, fstype, source)
        if not drives and dev not in root_devs:
            continue  # tmpfs, overlay, network, loop mounts matter only when a root lies on them
        by_point[point] = Mount(point, fstype, source, dev, kind, drives, layout)
    return tuple(by_point.values()), resolver.disks


def _describe(sysfs: Path, resolver: _Resolver, dev: str, fstype: str, source: str) -> tuple[str, tuple, str]:
    block = sysfs / "dev/block" / dev
    if not dev.startswith("0:") and block.exists():
        with contextlib.suppress(OSError):
            return resolver.resolve(block)
    if source.startswith("/dev/"):  # btrfs and friends report an anonymous device number
        with contextlib.suppress(OSError):
            st = os.stat(source)
            alt = sysfs / "dev/block" / f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            if alt.exists():
                return resolver.resolve(alt)
    if fstype in ("tmpfs", "ramfs"):
        return "memory", (), f"{fstype} (memory)"
    if fstype.startswith(_NETWORK_FS):
        return "network", (), f"{fstype} {source}"
    if fstype == "overlay":
        return "overlay", (), "overlay (its upper directory's device is not followed)"
    return "unknown", (), f"{fstype} {source}"


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (a root may not exist yet)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def root_dev(path: str | os.PathLike) -> str | None:
    """'major:minor' of the file system holding ``path`` (or its nearest existing ancestor)."""
    try:
        st = os.stat(_existing(Path(path)))
    except OSError:
        return None
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _hostname() -> str:
    with contextlib.suppress(OSError):
        return _socket.gethostname()
    return ""
