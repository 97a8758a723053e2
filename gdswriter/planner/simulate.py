"""A fluid (bottleneck) model of writing a plan on a replayed machine.

Our machines cannot show locality, so we count where the bytes of a plan travel and how
long the busiest resource needs for them: ``time = max over resources of bytes /
bandwidth``. It assumes every resource streams at its full bandwidth for the whole save
and that transfers overlap perfectly; it ignores latency, queueing, file-system overhead
and whatever else shares the links. It ranks plans on one machine; it is not a
prediction of absolute speed.

A byte from GPU g to drive d uses, in order (PCIe is full duplex, so each link
direction is its own resource):

* ``gpu gN``: the GPU's own link, read out of GPU memory;
* unless g and d share a PCIe switch (``Distance.SWITCH``): the uplink of g's switch
  (``up <root port>``), then the root complex of the socket (``root complex sN``, peer
  to peer between root ports) if d is on the same socket, else the root complexes of
  both sockets and the inter-socket link between them (``socket link sA->sB``), then
  the uplink of d's switch (``down <root port>``); devices attached straight to a root
  port have no separate uplink;
* ``ssd <drive>``: the drive's sustained write bandwidth.

Bytes written to an array are spread evenly over its drives (RAID-1: copied to each).
Host-memory writers use only the drive side (their bytes come from DRAM, not a peer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .affinity import RootTarget
from .assign import SavePlan
from .topology import Distance, Drive, Gpu, Topology


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Per-link bandwidths in GB/s (10^9 bytes/s), each per direction."""

    gpu_link: float = 25.0       # GPU <-> its switch or root port (PCIe Gen4 x16, usable)
    switch_uplink: float = 25.0  # switch <-> root port
    root_complex: float = 25.0   # peer-to-peer between root ports of one socket
    socket_link: float = 64.0    # between two sockets (xGMI, UPI)
    ssd_write: float = 3.5       # one drive's sustained sequential write

    def bandwidth(self, resource: str) -> float:
        kind = resource.split(" ", 1)[0]
        return {"gpu": self.gpu_link, "up": self.switch_uplink, "down": self.switch_uplink,
                "root": self.root_complex, "socket": self.socket_link, "ssd": self.ssd_write}[kind]


@dataclass(frozen=True)
class Simulation:
    """Bytes per resource and the time the busiest one needs."""

    load: tuple[tuple[str, float], ...]  # (resource, bytes), sorted by resource
    seconds: float
    bottleneck: str

    def bytes_of(self, kind: str) -> dict[str, float]:
        """{resource: bytes} for one kind: 'ssd', 'gpu', 'up', 'down', 'root', 'socket'."""
        return {r: b for r, b in self.load if r.split(" ", 1)[0] == kind}

    def total(self, kind: str) -> float:
        return sum(self.bytes_of(kind).values())


def simulate(topology: Topology, plan: SavePlan, roots: Sequence[RootTarget], links: LinkModel) -> Simulation:
    """Route every file of ``plan`` through ``topology`` and time it under ``links``."""
    by_index = {r.index: r for r in roots}
    load: dict[str, float] = {}

    def add(resource: str, nbytes: float) -> None:
        load[resource] = load.get(resource, 0.0) + nbytes

    for f in plan.files:
        nbytes = float(sum(c.length for c in f.chunks))
        if not nbytes:
            continue
        root = by_index[f.target.root]
        names = root.drives or (f"{root.path} (unknown drive)",)
        mirrored = bool(root.mount and root.mount.mirrored)
        gpu = topology.gpu(f.gpu) if f.gpu is not None and any(g.index == f.gpu for g in topology.gpus) else None
        for name in names:
            share = nbytes if mirrored else nbytes / len(names)
            drive = topology.drive(name)
            for resource in _route(topology, gpu, drive):
                add(resource, share)
            add(f"ssd {name}", share)
    worst, seconds = "", 0.0
    for resource, nbytes in sorted(load.items()):
        t = nbytes / (links.bandwidth(resource) * 1e9)
        if t > seconds:
            worst, seconds = resource, t
    return Simulation(tuple(sorted(load.items())), seconds, worst)


def _route(topology: Topology, gpu: Gpu | None, drive: Drive | None) -> list[str]:
    """The resources a byte from ``gpu`` (None: host memory) to ``drive`` crosses before the drive."""
    hops = []
    d_switch = topology.switch_of(drive) if drive else None
    if gpu is None:
        return [f"down {d_switch}"] if d_switch else []
    hops.append(f"gpu g{gpu.index}")
    if drive is not None and topology.distance(gpu, drive) == Distance.SWITCH:
        return hops
    g_switch = topology.switch_of(gpu)
    if g_switch:
        hops.append(f"up {g_switch}")
    sg = topology.socket_of(gpu.numa)
    sd = topology.socket_of(drive.numa) if drive else -1
    if sg >= 0 and sd >= 0 and sg != sd:
        hops += [f"root complex s{sg}", f"socket link s{sg}->s{sd}", f"root complex s{sd}"]
    else:
        hops.append(f"root complex s{sg if sg >= 0 else '?'}")
    if d_switch:
        hops.append(f"down {d_switch}")
    return hops
