"""Simulated: the GPU-local plan against a locality-blind round robin on replayed DGXs.

    .venv/bin/python benchmarks/topology_sim.py [--size-per-gpu 10G] [--machine dgx_a100 ...]

Our machines have no NVMe switches or second socket, so this replays the DGX A100 and
DGX H100 topologies (tests/data/topologies/) and counts, for each plan, the bytes on
every drive, PCIe switch uplink, root complex and inter-socket link, then times the
plan with a fluid bottleneck model (gdswriter/planner/simulate.py): time = max over
resources of bytes / bandwidth. That model assumes perfect overlap and full-speed
streaming; it ranks plans, it does not predict absolute speed.

The DGXs ship with one RAID-0 over all data drives (/raid), where locality cannot be
chosen (shown first). The comparison uses the what-if machine where each data drive is
mounted on its own. Link bandwidths are parameters; the presets below are
PCIe-generation figures for GPU and switch links, spec-sheet-class figures for the
drives, and assumptions (marked) for the root complex and inter-socket link, which
vendors do not publish for peer-to-peer traffic. Two variations show when locality
decides the time: faster (Gen5) drives, and a narrow peer-to-peer path through the CPU.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run against the checkout this script is in

from gdswriter.commands._common import table  # noqa: E402 - after the sys.path line above
from gdswriter.planner.affinity import (  # noqa: E402 - after the sys.path line above
    Writer, distance_label, place_roots, plan_affinity, plan_round_robin, root_distances)
from gdswriter.planner.simulate import LinkModel, simulate  # noqa: E402 - after the sys.path line above
from gdswriter.planner.topology import Topology  # noqa: E402 - after the sys.path line above
from gdswriter.units import human, parse_size  # noqa: E402 - after the sys.path line above

FIXTURES = REPO / "tests" / "data" / "topologies"

# Bandwidths in GB/s per direction. gpu_link/switch_uplink: PCIe Gen4 x16 (31.5 GB/s raw,
# ~25 usable) on the A100, Gen5 x16 (63 raw, ~50 usable) on the H100. ssd_write: sustained
# sequential write of a 3.84 TB Gen4 U.2 data drive (spec-sheet class: 3.5-4 GB/s).
# root_complex and socket_link: ASSUMED (no public peer-to-peer figures).
PRESETS = {
    "dgx_a100": LinkModel(gpu_link=25, switch_uplink=25, root_complex=50, socket_link=64, ssd_write=3.5),
    "dgx_h100": LinkModel(gpu_link=50, switch_uplink=50, root_complex=100, socket_link=64, ssd_write=4.0),
}
TITLES = {"dgx_a100": "DGX A100", "dgx_h100": "DGX H100"}


def scenarios(base: LinkModel) -> list[tuple[str, LinkModel]]:
    return [
        ("as built", base),
        ("Gen5 drives (10 GB/s write)", replace(base, ssd_write=10.0)),
        ("narrow P2P via CPU (10 GB/s)", replace(base, root_complex=10.0, socket_link=10.0)),
    ]


def links_text(m: LinkModel) -> str:
    return (f"gpu {m.gpu_link:g}, uplink {m.switch_uplink:g}, root cx {m.root_complex:g}, "
            f"socket {m.socket_link:g}, ssd {m.ssd_write:g}")


def print_plan(topo: Topology, roots, plan) -> None:
    rows = [["ROOT", "PATH", "FILE", "GPU", "BYTES", "DISTANCE"]]
    for f in plan.files:
        r = roots[f.target.root]
        rows.append([f.target.root, r.path, f.target.name, f.gpu, human(sum(c.length for c in f.chunks)),
                     distance_label(root_distances(topo, f.gpu, r), detail=True)])
    for line in table(rows, right={4}):
        print(line)
    for note in plan.notes:
        print(f"  note: {note}")


def run_machine(name: str, per_gpu: int) -> None:
    base = Topology.load(FIXTURES / f"{name}.json")
    title = TITLES.get(name, base.source)
    owners = [Writer(f"cuda:{g.index}", g.index) for g in base.gpus]
    sizes = [per_gpu] * len(owners)
    links = PRESETS.get(name, LinkModel())

    raid = next((m for m in base.mounts if m.mountpoint == "/raid"), None)
    if raid is not None:
        print(f"== {title} as shipped: /raid ({raid.layout}), {len(owners)} GPUs x {human(per_gpu)} ==")
        roots = place_roots(base, ["/raid/ckpt"])
        plan = plan_affinity(base, sizes, owners, roots)
        print_plan(base, roots, plan)
        same = simulate(base, plan, roots, links) == simulate(base, plan_round_robin(sizes, owners, roots),
                                                                roots, links)
        print(f"  simulated: GPU-local and round robin move the same bytes over the same links: {same}\n")
        topo = base.one_mount_per_drive(raid.drives)
        paths = [f"/mnt/{d}/ckpt" for d in raid.drives]
        what = "each data drive mounted on its own (what-if)"
    else:
        topo = base
        paths = [m.mountpoint + "/ckpt" for m in base.mounts if m.mountpoint != "/"]
        what = "its data drives"
    roots = place_roots(topo, paths)
    print(f"== {title}: {what}, {len(owners)} GPUs x {human(per_gpu)} ==")
    local = plan_affinity(topo, sizes, owners, roots)
    blind = plan_round_robin(sizes, owners, roots)
    print("GPU-local plan:")
    print_plan(topo, roots, local)
    print(f"Round robin: {len(blind.files)} files, every GPU writing {human(per_gpu // len(roots))} to each root.")

    sims = {label: (simulate(topo, local, roots, m), simulate(topo, blind, roots, m)) for label, m in scenarios(links)}
    a, b = sims["as built"]
    print("Bytes per resource (GB), GPU-local vs round robin:")
    rows = [["RESOURCE", "GPU-LOCAL", "ROUND ROBIN"]]
    la, lb = dict(a.load), dict(b.load)
    for res in sorted(set(la) | set(lb), key=_resource_order):
        if res.startswith("gpu "):
            continue  # every GPU reads out its own bytes either way
        rows.append([res, f"{la.get(res, 0) / 1e9:.2f}", f"{lb.get(res, 0) / 1e9:.2f}"])
    for line in table(rows, right={1, 2}):
        print(line)
    print("Simulated write time (fluid model: max over resources of bytes / bandwidth, GB/s):")
    rows = [["SCENARIO", "LINKS (GB/s)", "GPU-LOCAL", "ROUND ROBIN", "RR / LOCAL"]]
    for (label, m), (x, y) in zip(scenarios(links), sims.values()):
        rows.append([label, links_text(m), f"{x.seconds:.2f} s ({x.bottleneck})",
                     f"{y.seconds:.2f} s ({y.bottleneck})", f"{y.seconds / x.seconds:.2f}x"])
    for line in table(rows, right={4}):
        print(line)
    print()


def _resource_order(res: str) -> tuple[int, str]:
    kinds = ["ssd", "up", "down", "root", "socket", "gpu"]
    return kinds.index(res.split(" ", 1)[0]), res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-per-gpu", default="10G", help="bytes each GPU holds (default 10G)")
    ap.add_argument("--machine", action="append", choices=sorted(p.stem for p in FIXTURES.glob("*.json")),
                    help="replayed machine(s) (default: dgx_a100 and dgx_h100)")
    args = ap.parse_args()
    per_gpu = parse_size(args.size_per_gpu)
    for name in args.machine or ["dgx_a100", "dgx_h100"]:
        run_machine(name, per_gpu)


if __name__ == "__main__":
    main()
