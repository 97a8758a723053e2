"""GPU-local placement: which GPU writes which bytes to which root, file and offset.

Pure functions of a Topology and sizes, tested without GPUs or SSDs (``plan_for_save``, the
writer's entry point, discovers the machine when it is not handed a Topology).

The model: each *writer* (a GPU, or host memory) holds some storages; each *root* is a
directory on some drives. A save is balanced when every drive receives the same number
of bytes, so a root's target is its drive count (less mirror copies and parity; shared
among roots on the same drives) times the bytes per drive. Within that balance, bytes go
to the nearest roots: the assignment of writers' bytes to roots is a min-cost
transportation problem whose cost is the PCIe distance (planner/topology.py: switch 0 <
NUMA node 1 < socket 2 < other socket 3 < unknown 4), averaged over a root's drives when
it is an array. A root may take up to 5% more or less than its balanced share
(``BALANCE_TOLERANCE``) when that keeps bytes nearer their GPU or saves a file; otherwise
shares are exact to one 4 KiB unit. It is solved exactly (successive shortest paths), so
no GPU writes to a farther root while a nearer one has room, unless the farther one would
then fall below its balance floor.

Each (writer, root) pair with bytes becomes one file, written front to back from that
writer's storages (``cut_stream``), every chunk 4 KiB-aligned in storage and file.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from ..errors import InvalidOptionError
from ..units import human
from .assign import DEFAULT_ALIGN, FilePlan, FileTarget, PlannedChunk, SavePlan, align_up, cut_stream, plan_save
from .topology import Distance, Mount, Topology


@dataclass(frozen=True)
class Writer:
    """Whose memory a storage lives in: ``label`` is the device ('cuda:1', 'cpu'); ``gpu``
    the topology (NVML) index of that GPU, or None for host memory or a GPU not found."""

    label: str
    gpu: int | None = None

    @property
    def file_tag(self) -> str:
        """What its file names say: the physical GPU ('gpu3', stable under
        CUDA_VISIBLE_DEVICES) or the device label ('cuda1' for a GPU not found, 'cpu')."""
        if self.gpu is not None:
            return f"gpu{self.gpu}"
        return "".join(ch for ch in self.label if ch.isalnum()) or "host"


HOST = Writer("cpu")
# How far a root's bytes may stray from its balanced share to keep bytes near their GPU.
BALANCE_TOLERANCE = Fraction(1, 20)


@dataclass(frozen=True)
class RootTarget:
    """One root as the planner sees it: index among the checkpointer's roots, its path, the
    mount behind it, and its share of the save in drives (``Mount.width`` / roots on them)."""

    index: int
    path: str
    mount: Mount | None
    weight: Fraction

    @property
    def drives(self) -> tuple[str, ...]:
        return self.mount.drives if self.mount else ()


def place_roots(topology: Topology, roots: Sequence[str | os.PathLike],
                devs: Sequence[str | None] | None = None) -> tuple[RootTarget, ...]:
    """Match each root to its mount (by device number when ``devs`` gives it, else by path)
    and weigh it by the drives behind it; roots on the same drives share them."""
    if not roots:
        raise InvalidOptionError("GPU-local placement needs at least one root")
    mounts = [topology.mount_of(os.path.abspath(r), devs[i] if devs else None) for i, r in enumerate(roots)]

    def group(i: int) -> tuple:
        m = mounts[i]
        if m is None:
            return ("root", i)
        return ("drives", m.drives) if m.drives else ("mount", m.mountpoint)

    sharing = [sum(group(j) == group(i) for j in range(len(roots))) for i in range(len(roots))]
    return tuple(RootTarget(i, os.fspath(r), mounts[i], Fraction(mounts[i].width if mounts[i] else 1, sharing[i]))
                 for i, r in enumerate(roots))


def root_distances(topology: Topology, gpu: int | None, root: RootTarget) -> tuple[Distance, ...]:
    """The distance from a GPU to each drive of a root (an array spreads every write over
    all of them); UNKNOWN where the GPU or a drive is not known; () for host memory, which
    has no place to prefer."""
    if gpu is None:
        return ()
    try:
        g = topology.gpu(gpu)
    except KeyError:
        return (Distance.UNKNOWN,)
    drives = [topology.drive(d) for d in root.drives]
    return tuple(topology.distance(g, d) if d else Distance.UNKNOWN for d in drives) or (Distance.UNKNOWN,)


def distance_label(distances: Sequence[Distance], *, detail: bool = False) -> str:
    """'switch', 'numa', ... or, for an array whose drives lie at several distances, 'mixed'
    ('mixed: 2 switch, 6 remote' with ``detail``)."""
    if not distances:
        return "host memory"
    if len(set(distances)) == 1:
        return distances[0].label
    if not detail:
        return "mixed"
    return "mixed: " + ", ".join(f"{distances.count(d)} {d.label}" for d in sorted(set(distances)))


def balanced_targets(total: int, weights: Sequence[Fraction]) -> list[int]:
    """Split ``total`` units in proportion to ``weights``: each cut is the floor of the exact
    cumulative share, so every target is within one unit of exact and they sum to ``total``."""
    w_sum = sum(weights)
    if w_sum <= 0:
        raise InvalidOptionError("root weights must be positive")
    cum, cuts = Fraction(0), [0]
    for w in weights:
        cum += w
        cuts.append(math.floor(total * cum / w_sum))
    return [cuts[i + 1] - cuts[i] for i in range(len(weights))]


def balance_bounds(target: int, tolerance: Fraction) -> tuple[int, int]:
    """The fewest and most units a root with ``target`` may take: within ``tolerance`` of it."""
    return math.ceil(target * (1 - tolerance)), math.floor(target * (1 + tolerance))


def assign_bytes(supply: Sequence[int], target: Sequence[int], cost: Sequence[Sequence[int]], *,
                 tolerance: Fraction | float = 0) -> list[list[int]]:
    """Min-cost transportation: ``x[w][r] >= 0`` with row ``w`` summing to ``supply[w]`` and
    column ``r`` within ``balance_bounds(target[r], tolerance)``.

    Objective, in strict priority: stay within the bounds; minimise ``sum x*cost``; then
    keep roots as close to their targets as possible (slack is only used where it buys
    nearness). Solved exactly by successive shortest paths (integral; deterministic); then
    a writer's small pieces are merged onto another root at the same cost where the bounds
    allow (fewer files for the same nearness, balance still within ``tolerance``).
    """
    if sum(supply) != sum(target):
        raise InvalidOptionError(f"supply {sum(supply)} != target {sum(target)}")
    if any(v < 0 for v in (*supply, *target)):
        raise InvalidOptionError("supply and target must be >= 0")
    tol = Fraction(tolerance)
    if not 0 <= tol < 1:
        raise InvalidOptionError(f"balance tolerance {float(tol)} must be in [0, 1)")
    n_w, n_r = len(supply), len(target)
    bounds = [balance_bounds(t, tol) for t in target]
    # Scale: one unit of nearness outweighs all the over-target slack together, and filling
    # a root up to its lower bound outweighs any path cost.
    over = sum(hi - t for t, (_, hi) in zip(target, bounds)) + 1
    must = (max((c for row in cost for c in row), default=0) + 1) * over + 1
    src, sink = 0, n_w + n_r + 1
    g = _ResidualGraph(sink + 1)
    total = sum(supply)
    for w in range(n_w):
        g.edge(src, 1 + w, supply[w], 0)
    link = [[g.edge(1 + w, 1 + n_w + r, total, cost[w][r] * over) for r in range(n_r)] for w in range(n_w)]
    for r, (t, (lo, hi)) in enumerate(zip(target, bounds)):
        g.edge(1 + n_w + r, sink, lo, -must)
        g.edge(1 + n_w + r, sink, t - lo, 0)
        g.edge(1 + n_w + r, sink, hi - t, 1)
    sent = 0
    while sent < total:
        via = g.cheapest_paths(src)
        if via[sink] < 0:
            raise AssertionError("no feasible flow")  # cannot happen: complete graph, sum of bounds brackets total
        sent += g.augment(via, src, sink, total - sent)
    flow = [[g.flow(link[w][r]) for r in range(n_r)] for w in range(n_w)]
    _consolidate(flow, cost, bounds)
    return flow


class _ResidualGraph:
    """A flow network for successive shortest paths: each edge ``e`` is stored with its reverse
    (``e ^ 1``), as parallel lists of head node, residual capacity and price per unit."""

    def __init__(self, n_nodes: int) -> None:
        self.adj: list[list[int]] = [[] for _ in range(n_nodes)]
        self.head: list[int] = []
        self.cap: list[int] = []
        self.price: list[int] = []

    def edge(self, u: int, v: int, c: int, p: int) -> int:
        """Add an edge u -> v of capacity ``c`` at price ``p`` per unit; returns its index."""
        for a, b, cc, pp in ((u, v, c, p), (v, u, 0, -p)):
            self.adj[a].append(len(self.head))
            self.head.append(b)
            self.cap.append(cc)
            self.price.append(pp)
        return len(self.head) - 2

    def flow(self, e: int) -> int:
        """The units edge ``e`` carries (its reverse's residual capacity)."""
        return self.cap[e ^ 1]

    def cheapest_paths(self, src: int) -> list[int]:
        """Per node, the edge by which a cheapest residual path from ``src`` reaches it (-1: none).
        Bellman-Ford, queue-based: the residual graph has no negative cycles."""
        adj, head, cap, price = self.adj, self.head, self.cap, self.price
        dist = [math.inf] * len(adj)
        via = [-1] * len(adj)
        dist[src] = 0
        queue, queued = [src], [False] * len(adj)
        while queue:
            u = queue.pop(0)
            queued[u] = False
            for e in adj[u]:
                if cap[e] > 0 and dist[u] + price[e] < dist[head[e]]:
                    dist[head[e]] = dist[u] + price[e]
                    via[head[e]] = e
                    if not queued[head[e]]:
                        queued[head[e]] = True
                        queue.append(head[e])
        return via

    def augment(self, via: list[int], src: int, sink: int, limit: int) -> int:
        """Push as much as the path ``via`` gives from ``src`` to ``sink`` allows, at most ``limit``;
        returns the units pushed."""
        push, v = limit, sink
        while v != src:
            push = min(push, self.cap[via[v]])
            v = self.head[via[v] ^ 1]
        v = sink
        while v != src:
            self.cap[via[v]] -= push
            self.cap[via[v] ^ 1] += push
            v = self.head[via[v] ^ 1]
        return push


def _uncross(flow: list[list[int]]) -> None:
    """Where writers a and b both write to roots r1 and r2, shift bytes around that cycle
    (a: r2 -> r1, b: r1 -> r2) until one of the four pieces is empty. Every root keeps its
    load and, the flow being optimal, the total distance too (were the cycle cheaper one way,
    the optimum would have taken it); one file fewer each time."""
    n_w, n_r = len(flow), len(flow[0]) if flow else 0
    shifted = True
    while shifted:
        shifted = False
        for a, b, r1, r2 in itertools.product(range(n_w), range(n_w), range(n_r), range(n_r)):
            if a < b and r1 != r2 and flow[a][r1] and flow[a][r2] and flow[b][r1] and flow[b][r2]:
                move = min(flow[a][r2], flow[b][r1])
                flow[a][r2] -= move
                flow[b][r1] -= move
                flow[a][r1] += move
                flow[b][r2] += move
                shifted = True


def _consolidate(flow: list[list[int]], cost: Sequence[Sequence[int]], bounds: Sequence[tuple[int, int]]) -> None:
    """Fewer files: cancel criss-crossing pieces (``_uncross``), then move a writer's smaller
    pieces onto another root it already writes to at the same cost while both roots stay
    within their bounds. Neither changes the total distance or leaves the bounds, so the
    flow stays optimal, and an optimal flow has no writer with a nearer root that has room
    (that move would be a cheaper flow within the bounds)."""
    _uncross(flow)
    load = [sum(col) for col in zip(*flow)] if flow else []
    for w, row in enumerate(flow):
        for _, src in sorted((u, r) for r, u in enumerate(row) if u)[:-1]:  # smallest first, never the largest
            units = row[src]  # pieces may have grown by earlier moves
            for dst in sorted((r for r, u in enumerate(row) if u and r != src), key=lambda r: -row[r]):
                if cost[w][dst] != cost[w][src]:
                    continue
                if load[dst] + units <= bounds[dst][1] and load[src] - units >= bounds[src][0]:
                    row[src], row[dst] = 0, row[dst] + units
                    load[src] -= units
                    load[dst] += units
                    break


def plan_affinity(topology: Topology, storage_sizes: Sequence[int], storage_writers: Sequence[Writer],
                  roots: Sequence[RootTarget], *, tolerance: Fraction | float = BALANCE_TOLERANCE,
                  align: int = DEFAULT_ALIGN) -> SavePlan:
    """The GPU-local plan: every byte of every storage written exactly once, by the writer
    holding it, to a root chosen as described in the module docstring; every root's bytes
    within ``tolerance`` of its balanced share (up to one alignment unit). Files are ordered
    by root, then writer; ``FilePlan.writer``/``gpu`` say who writes each one."""
    if not roots:
        raise InvalidOptionError("GPU-local placement needs at least one root")
    writers, mine, supply = _writers(storage_sizes, storage_writers, align)
    demand = balanced_targets(sum(supply), [r.weight for r in roots])
    dists = [[root_distances(topology, w.gpu, r) for r in roots] for w in writers]
    # cost: the mean distance to a root's drives, scaled to integers
    scale = math.lcm(1, *(len(d) for row in dists for d in row if d))
    cost = [[sum(int(x) for x in d) * scale // len(d) if d else 0 for d in row] for row in dists]
    flow = assign_bytes(supply, demand, cost, tolerance=tolerance)
    files = _files(storage_sizes, writers, mine, roots, flow, align)
    return SavePlan(files, tuple(_explain(topology, writers, roots, flow, cost, dists, align)))


def plan_round_robin(storage_sizes: Sequence[int], storage_writers: Sequence[Writer], roots: Sequence[RootTarget],
                     *, align: int = DEFAULT_ALIGN) -> SavePlan:
    """The locality-blind baseline: every writer spreads its own bytes over all roots in
    proportion to their drives, wherever they are (same files and naming as the GPU-local
    plan, so the two can be compared byte for byte)."""
    if not roots:
        raise InvalidOptionError("a plan needs at least one root")
    writers, mine, supply = _writers(storage_sizes, storage_writers, align)
    flow = [balanced_targets(units, [r.weight for r in roots]) for units in supply]
    return SavePlan(_files(storage_sizes, writers, mine, roots, flow, align),
                    ("round robin: every writer's bytes spread over every root, locality ignored",))


def _writers(storage_sizes: Sequence[int], storage_writers: Sequence[Writer],
             align: int) -> tuple[list[Writer], list[list[int]], list[int]]:
    """The distinct writers (GPUs by index, then host/unknown), each one's storages, and
    each one's bytes in alignment units."""
    if len(storage_sizes) != len(storage_writers):
        raise InvalidOptionError(f"{len(storage_sizes)} storage sizes but {len(storage_writers)} writers")
    if any(s < 0 for s in storage_sizes):
        raise InvalidOptionError("storage sizes must be >= 0")
    writers = sorted(set(storage_writers), key=lambda w: (w.gpu is None, w.gpu if w.gpu is not None else 0, w.label))
    mine = [[sid for sid, w in enumerate(storage_writers) if w == wr] for wr in writers]
    supply = [sum(align_up(storage_sizes[s], align) for s in sids) // align for sids in mine]
    return writers, mine, supply


def _files(storage_sizes: Sequence[int], writers: Sequence[Writer], mine: Sequence[Sequence[int]],
           roots: Sequence[RootTarget], flow: Sequence[Sequence[int]], align: int) -> tuple[FilePlan, ...]:
    """One file per (root, writer) pair with bytes, ordered by root then writer, each cut
    front to back from that writer's storages; zero-byte storages of writers without a
    file go into the first file, and a save with no bytes at all gets one empty file."""
    order = sorted((r, w) for w in range(len(writers)) for r in range(len(roots)) if flow[w][r])
    index_of = {rw: i for i, rw in enumerate(order)}
    chunks: dict[tuple[int, int], list[PlannedChunk]] = {rw: [] for rw in order}
    homeless: list[int] = []
    for w, sids in enumerate(mine):
        mine_roots = [r for r in range(len(roots)) if flow[w][r]]
        if not mine_roots:
            homeless.extend(sids)
            continue
        per_file = cut_stream([storage_sizes[s] for s in sids], [flow[w][r] * align for r in mine_roots],
                              align=align)
        for k, r in enumerate(mine_roots):
            fid = index_of[(r, w)]
            chunks[(r, w)] = [PlannedChunk(sids[c.storage], c.storage_offset, c.length, fid, c.file_offset)
                              for c in per_file[k]]
    if not order:
        order = [(0, 0)]
        chunks[(0, 0)] = []
    chunks[order[0]] = [PlannedChunk(s, 0, 0, 0, 0) for s in homeless] + chunks[order[0]]
    files = []
    for r, w in order:
        cs = tuple(sorted(chunks[(r, w)], key=lambda c: (c.file_offset, c.length)))
        wr = writers[w] if writers else HOST
        files.append(FilePlan(FileTarget(roots[r].index, f"data-r{roots[r].index}-{wr.file_tag}.bin"),
                              max((c.file_offset + c.length for c in cs), default=0), cs, wr.label, wr.gpu))
    return tuple(files)


def _explain(topology: Topology, writers: Sequence[Writer], roots: Sequence[RootTarget], flow: list[list[int]],
             cost: list[list[int]], dists: list[list[tuple[Distance, ...]]], align: int) -> list[str]:
    notes = []
    arrays = {r.mount.layout or r.mount.mountpoint for r in roots if r.mount and len(r.drives) > 1}
    for layout in sorted(arrays):
        notes.append(f"{layout}: writes are striped or mirrored over all its drives, so which GPU writes where "
                     f"cannot be chosen for it; its share of the bytes follows its drive count")
    gpu_rows = [i for i, w in enumerate(writers) if w.gpu is not None]
    if len(roots) == 1:
        notes.append("one root: each writer writes its own bytes to its own file there")
    elif gpu_rows and all(len(set(cost[i])) == 1 for i in gpu_rows):
        notes.append("every root is equally near every GPU: locality cannot be chosen; bytes are only "
                     "balanced across roots, each GPU writing its own")
    unknown = [r for r in roots if not r.drives]
    if unknown:
        notes.append(f"no drive known behind {', '.join(r.path for r in unknown)}: counted as one drive, "
                     f"distance unknown")
    lost = [w.label for w in writers if w.gpu is None and w.label.startswith("cuda")]
    if topology.affinity_problems() and (gpu_rows or lost):
        notes.append("topology: " + "; ".join(topology.affinity_problems()))
    if lost:
        notes.append(f"{', '.join(lost)} not found in the topology: no root is preferred for their bytes")
    by_tier: dict[str, int] = {}
    for i, _w in enumerate(writers):
        for r in range(len(roots)):
            if flow[i][r]:
                tier = distance_label(dists[i][r])
                by_tier[tier] = by_tier.get(tier, 0) + flow[i][r] * align
    total = sum(by_tier.values())
    if total:
        notes.append("bytes by distance: " + ", ".join(f"{k} {human(v)} ({100 * v / total:.0f}%)"
                                                       for k, v in sorted(by_tier.items(), key=_tier_order)))
    far = by_tier.get(Distance.REMOTE.label, 0)
    if far:
        notes.append(f"{human(far)} cross sockets: the drives near some GPUs cannot take a balanced share of "
                     f"their bytes")
    return notes


def _tier_order(item: tuple[str, int]) -> tuple[int, str]:
    names = [d.label for d in Distance]
    return (names.index(item[0]) if item[0] in names else len(names), item[0])


def writers_of(storage_devices: Sequence[object], cuda_gpus: Mapping[int, int]) -> list[Writer]:
    """The Writer of each storage from its device ('cuda:0', torch.device, 'cpu'); CUDA
    ordinals are mapped to topology GPUs through ``cuda_gpus`` (discover.cuda_gpu_indices)."""
    out = []
    for dev in storage_devices:
        text = str(dev)
        kind, _, idx = text.partition(":")
        if kind != "cuda":
            out.append(HOST)
            continue
        ordinal = int(idx) if idx else 0
        out.append(Writer(f"cuda:{ordinal}", cuda_gpus.get(ordinal)))
    return out


def plan_for_save(storage_sizes: Sequence[int], storage_devices: Sequence[object],
                  roots: Sequence[str | os.PathLike], targets: Sequence[FileTarget],
                  topology: Topology | None = None, *, cuda_gpus: Mapping[int, int] | None = None,
                  align: int = DEFAULT_ALIGN) -> SavePlan:
    """The writer's entry point: the GPU-local plan when any storage lives on a GPU, else
    exactly ``plan_save(storage_sizes, targets)`` (today's balanced plan).

    ``storage_devices``: each storage's device (``str(tensor.device)``). ``roots``: the
    checkpointer's roots, in order (FileTarget.root indexes them). ``targets``: the files
    the balanced plan would use. ``topology``: discover it once per checkpointer
    (``discover.discover(roots=roots)``) and pass it in; None discovers it now.
    ``cuda_gpus``: CUDA ordinal -> topology GPU index; None asks torch (by PCI address).
    Each file's ``FilePlan.gpu`` is what the manifest records as its ``gpu``.
    """
    if len(storage_devices) != len(storage_sizes):
        raise InvalidOptionError(f"{len(storage_sizes)} storage sizes but {len(storage_devices)} devices")
    if not any(str(d).startswith("cuda") for d in storage_devices):
        plan = plan_save(storage_sizes, targets, align=align)
        return SavePlan(plan.files, ("every storage is in host memory: balanced across roots",))
    from .discover import cuda_gpu_indices, discover, root_dev

    if topology is None:
        topology = discover(roots=roots)
    if cuda_gpus is None:
        cuda_gpus = cuda_gpu_indices(topology)
    devs = [root_dev(r) for r in roots] if topology.live else None
    return plan_affinity(topology, storage_sizes, writers_of(storage_devices, cuda_gpus),
                         place_roots(topology, roots, devs), align=align)
