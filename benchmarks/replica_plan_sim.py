"""What placing replicas and parity groups costs one rank as the world grows (issue 39), simulated.

For each world size W (8 ranks per host, 2 at W = 8; racks of 4 hosts, 16 racks per switch),
rank 0 and a typical rank (W // 2) run the placement's collective on the in-process coordinator
of benchmarks/dist_scale_sim.py (gdswriter/testing/simcoord.py, which plays the other ranks):
every rank sends rank 0 its host and failure domains (a gather, as the roots' opening already
does), rank 0 builds the plans (planner/replicas.py place_replicas, parity_groups) and sends
each rank its part (a scatter: the ranks it sends its copies to and receives copies from; its
parity group's hosts' first ranks). Reported: rank 0's CPU time, what it receives and its
planning alone (both plans, without the messages); what the typical rank sends and receives
and its CPU time; where the ranks of each host are consecutive (torchrun's numbering), the time
a rank takes to compute its part alone, with no message (rotation_peers). Layouts:
``torchrun`` (consecutive), ``shuffled`` (a host's ranks spread over the rank order),
``uneven`` (the last host has 5 ranks). Bytes on the drives per byte of state: ``copies`` for
full copies, n / (n - 1) for parity groups of n hosts ((G + 1) / G with G data chunks per
parity block; --group 5 asks for G = 4, and 1.25).

    python benchmarks/replica_plan_sim.py                      # W = 8 ... 16384
    python benchmarks/replica_plan_sim.py --worlds 8,64 --markdown
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from gdswriter.planner.replicas import ReplicaPart, parity_groups, place_replicas, rotation_peers
from gdswriter.testing.simcoord import Peers, SimCoordinator

PER_HOST = 8
HOSTS_PER_RACK = 4
RACKS_PER_SWITCH = 16


def layout(world: int, kind: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Each rank's host and (switch, rack)."""
    per_host = min(PER_HOST, world // 4)  # at least 4 hosts
    hosts = [f"node{r // per_host:05d}" for r in range(world)]
    if kind == "uneven" and per_host > 3:
        hosts = hosts[:world - 3]  # the last host has 5 ranks
    if kind == "shuffled":
        random.Random(world).shuffle(hosts)
    domains = []
    for h in hosts:
        rack = int(h[4:]) // HOSTS_PER_RACK
        domains.append((f"sw{rack // RACKS_PER_SWITCH}", f"rack{rack}"))
    return hosts, domains


def collective(coord: SimCoordinator, host: str, domain: tuple[str, ...], copies: int, group: int) -> dict:
    """The placement's two collectives on this rank: a gather of hosts and domains to rank 0,
    which plans, and a scatter of each rank's part."""
    got = coord.gather([host, list(domain)], "replicas (hosts)", dst=0)
    parts = None
    if got is not None:
        hosts, domains = [h for h, _ in got], [tuple(d) for _, d in got]
        plan = place_replicas(hosts, copies, domains)
        parity = parity_groups(hosts, group, domains)
        parts = []
        for r in range(len(hosts)):
            gi, mi = parity.group_of(r)
            grp = parity.groups[gi]
            parts.append({"copies": plan.part(r).to_message(), "parity": [gi, mi, [rs[0] for rs in grp.ranks]]})
        coord.peers.plan = (plan, parity)  # type: ignore[attr-defined]
    mine = coord.scatter(parts, "replicas (parts)", src=0)
    return {"part": ReplicaPart.from_message(coord.rank, mine["copies"]), "parity": mine["parity"]}


def least(fn, n: int = 1000, runs: int = 5) -> float:
    """Seconds per call of ``fn``, the least of ``runs`` batches of ``n`` (the machine is shared)."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def simulate(world: int, kind: str, copies: int, group: int) -> dict:
    hosts, domains = layout(world, kind)
    w = len(hosts)
    typical = w // 2

    def message_of(rank: int, what: str, mine):
        return [hosts[rank], list(domains[rank])]

    peers = Peers(1, message_of=message_of)
    out: dict = {"world": w, "layout": kind}
    for rank in (0, typical):
        coord = SimCoordinator(rank, w, peers)
        t0 = time.process_time()
        got = collective(coord, hosts[rank], domains[rank], copies, group)
        cpu = time.process_time() - t0 - coord.peer_cpu_s
        sent, received, rounds = coord.stats.snapshot()
        out["rank0" if rank == 0 else "typical"] = {"cpu_s": cpu, "sent": sent, "received": received,
                                                    "rounds": rounds}
        if rank == typical:
            plan, parity = peers.plan  # type: ignore[attr-defined]
            assert got["part"] == plan.part(rank)
    plan, parity = peers.plan  # type: ignore[attr-defined]
    out["compact"] = plan.compact
    if plan.compact:
        out["alone_us"] = least(lambda: rotation_peers(typical, w, copies)) * 1e6
    t0 = time.process_time()
    place_replicas(hosts, copies, domains)
    parity_groups(hosts, group, domains)
    out["plan_s"] = time.process_time() - t0
    out["domain_levels"] = plan.domain_levels
    out["parity_levels"] = parity.domain_levels
    out["copies_factor"] = plan.drive_factor()
    out["parity_factor"] = parity.drive_factor()
    out["parity_groups"] = sorted({g.size for g in parity.groups})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="8,64,512,4096,16384")
    ap.add_argument("--layouts", default="torchrun,shuffled,uneven")
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--group", type=int, default=5, help="hosts per parity group (G + 1: G data chunks per parity)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for kind in args.layouts.split(","):
        for w in (int(x) for x in args.worlds.split(",")):
            r = simulate(w, kind, args.copies, args.group)
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    head = ["layout", "W", "rank 0: CPU (ms) / receives (KiB)", "rank 0: planning alone (ms)", "typical: CPU (ms)", "typical sends / receives (B)",
            "rounds", "alone, no message (us)", "domain levels apart: copies / parity", "drives: copies / parity",
            "parity group sizes"]
    table = [head]
    for r in rows:
        z, t = r["rank0"], r["typical"]
        table.append([r["layout"], r["world"], f"{z['cpu_s'] * 1e3:.1f} / {z['received'] / 1024:.0f}",
                      f"{r['plan_s'] * 1e3:.1f}",
                      f"{t['cpu_s'] * 1e3:.2f}", f"{t['sent']} / {t['received']}", t["rounds"],
                      f"{r['alone_us']:.1f}" if "alone_us" in r else "n/a (not consecutive)",
                      f"{r['domain_levels']} / {r['parity_levels']}",
                      f"{r['copies_factor']:.3f} / {r['parity_factor']:.3f}",
                      ",".join(str(x) for x in r["parity_groups"])])
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in table[1:]:
            print("| " + " | ".join(str(x) for x in row) + " |")
    else:
        widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
        for row in table:
            print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
