"""`gdswriter topology`: GPUs, drives, NUMA nodes, what lies behind each root, and the GPU-local plan."""

from __future__ import annotations

import json
from typing import Any

from ..planner.affinity import (HOST, RootTarget, Writer, distance_label, place_roots, plan_affinity,
                                root_distances)
from ..planner.discover import discover, root_dev
from ..planner.topology import Topology
from ..units import human, parse_size
from ._common import EXIT_OK, out, table


def register(sub) -> None:
    sp = sub.add_parser("topology", help="show GPUs, drives and where each GPU would write",
                        description="Show the GPUs (NVML), NVMe drives, PCIe switches and NUMA nodes of this "
                                    "machine (or of a saved one), what lies behind each ROOT (partitions, LVM, "
                                    "md RAID down to the drives), how far each GPU is from each root, and the "
                                    "plan a save of --size bytes, spread evenly over the GPUs, would get.")
    sp.add_argument("roots", metavar="ROOT", nargs="*", help="checkpoint root directories to plan for")
    sp.add_argument("--size", default="8G", metavar="S",
                    help="state size to plan for, K/M/G/T suffixes (default 8G); held by the GPUs found in "
                         "equal parts, or by host memory if there are none")
    sp.add_argument("--json", action="store_true", help="machine-readable output (its 'topology' part can be "
                                                        "replayed with --replay)")
    sp.add_argument("--replay", metavar="FILE.json", help="a topology saved with --json, instead of this machine")
    sp.set_defaults(func=run)


def run(args) -> int:
    topo = Topology.load(args.replay) if args.replay else discover(roots=args.roots)
    size = parse_size(args.size)
    roots: tuple[RootTarget, ...] = ()
    if args.roots:
        devs = [root_dev(r) for r in args.roots] if topo.live else None
        roots = place_roots(topo, args.roots, devs)
    writers = [Writer(f"gpu{g.index}", g.index) for g in topo.gpus] or [HOST]
    sizes = [size // len(writers) + (1 if i < size % len(writers) else 0) for i in range(len(writers))]
    plan = plan_affinity(topo, sizes, writers, roots) if roots else None
    report = _report(topo, roots, writers, sizes, plan)
    if args.json:
        out(json.dumps(report, indent=2))
    else:
        _print(topo, report)
    return EXIT_OK


def _switch(topo: Topology, dev) -> str:
    """Where a device hangs: below a switch (named by its root port), on a root port, or
    in the root complex itself (an integrated or virtual device)."""
    port = topo.switch_of(dev)
    if port:
        return f"switch below {port}"
    return {0: "-", 1: "root complex"}.get(len(dev.path), f"root port {dev.path[0]}")


def _report(topo: Topology, roots, writers, sizes, plan) -> dict[str, Any]:
    report: dict[str, Any] = {"topology": topo.to_dict(), "affinity_problems": topo.affinity_problems()}
    report["roots"] = [{"root": r.index, "path": r.path, "mountpoint": r.mount.mountpoint if r.mount else None,
                        "fstype": r.mount.fstype if r.mount else None, "kind": r.mount.kind if r.mount else None,
                        "layout": r.mount.layout if r.mount else None, "drives": list(r.drives),
                        "weight": float(r.weight)} for r in roots]
    report["distances"] = {f"gpu{g.index}": [distance_label(root_distances(topo, g.index, r), detail=True)
                                             for r in roots] for g in topo.gpus}
    if plan is not None:
        by_file = []
        for f in plan.files:
            root = roots[f.target.root]
            by_file.append({"root": f.target.root, "name": f.target.name, "writer": f.writer, "gpu": f.gpu,
                            "bytes": sum(c.length for c in f.chunks), "size": f.size,
                            "distance": distance_label(root_distances(topo, f.gpu, root))})
        report["plan"] = {"size": sum(sizes), "writers": {w.label: s for w, s in zip(writers, sizes)},
                          "files": by_file, "notes": list(plan.notes)}
    return report


def _print(topo: Topology, report: dict[str, Any]) -> None:
    out(f"Topology: {topo.source}{f' (host {topo.host})' if topo.host else ''}")
    out(f"NUMA nodes: {len(topo.numa)}")
    rows = [["NODE", "SOCKET", "CPUS"]] + [[n.node, n.socket if n.socket >= 0 else "?", n.cpus or "-"]
                                           for n in topo.numa]
    for line in table(rows) if topo.numa else []:
        out(line)
    out(f"GPUs: {len(topo.gpus) or 'none'}")
    rows = [["GPU", "PCI", "NAME", "NUMA", "PCIE"]] + [[g.index, g.pci, g.name or "-", _numa(g.numa),
                                                        _switch(topo, g)] for g in topo.gpus]
    for line in table(rows) if topo.gpus else []:
        out(line)
    out(f"Drives: {len(topo.drives) or 'none'}")
    rows = [["DRIVE", "KIND", "PCI", "NUMA", "PCIE", "MODEL"]] + [
        [d.name, d.kind, d.pci or "-", _numa(d.numa), _switch(topo, d), d.model or "-"] for d in topo.drives]
    for line in table(rows) if topo.drives else []:
        out(line)
    if report["roots"]:
        out("Roots:")
        rows = [["ROOT", "PATH", "MOUNT", "FS", "BEHIND IT"]] + [
            [r["root"], r["path"], r["mountpoint"] or "?", r["fstype"] or "?", r["layout"] or r["kind"] or "unknown"]
            for r in report["roots"]]
        for line in table(rows):
            out(line)
        if topo.gpus:
            out("Distance from each GPU to each root:")
            rows = [["GPU"] + [f"root {r['root']}" for r in report["roots"]]] + [
                [g] + labels for g, labels in report["distances"].items()]
            for line in table(rows):
                out(line)
        plan = report["plan"]
        held = "each GPU holding an equal part" if topo.gpus else "in host memory (no GPUs)"
        out(f"Plan for {human(plan['size'])}, {held}:")
        rows = [["ROOT", "FILE", "WRITER", "BYTES", "DISTANCE"]] + [
            [f["root"], f["name"], f["writer"], human(f["bytes"]), f["distance"]] for f in plan["files"]]
        for line in table(rows, right={3}):
            out(line)
        for note in plan["notes"]:
            out(f"  note: {note}")
    else:
        out("Pass ROOT directories to see what lies behind them and the plan a save would get.")
    for note in topo.notes:
        out(f"note: {note}")


def _numa(n: int) -> str:
    return str(n) if n >= 0 else "?"
