"""Parity instead of full copies (DistOptions(parity_group=G)): bytes on the drives and time.

N ranks on this machine, each its own "node" (GDSWRITER_HOSTNAME) and root, each holding a
rank-local state of --size (DistOptions(replicated=()): no state written once for all); two checkpointers, saved in turn (--rounds, interleaved):

  no parity        save(): time to committed, nothing protected
  parity_group=G   save(): time to committed; then wait_protected(): time to protected

"drive bytes / state byte" counts, in the last parity step, every rank's data files and shard
plus every parity block, over the same files without the blocks ("files") and over the state's
tensor bytes ("state"), beside the plan's figure (ParityPlan.drive_factor): n / (n - 1) for
groups of n hosts, i.e. (k + 1) / k for k data chunks per parity block (--group 0: one group of
all N hosts). Every simulated node shares this
machine's disks and cores: the parity rounds cost disk time here that a cluster spreads.

    .venv/bin/python benchmarks/parity.py [--size 256M] [--ranks 3,4] [--group 0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from gdswriter import DistOptions, GDSCheckpointer
from gdswriter.format.commit import step_dir_name
from gdswriter.planner.replicas import parity_groups
from gdswriter.units import human, parse_size
from replicas import make_state, run_worlds, spawn_ranks, timed_save  # this directory: run as a script

def drive_bytes(root: Path, world: int, step: int) -> dict:
    """The own files (data and shard) and the parity blocks of ``step`` on every rank's root."""
    own = parity = 0
    for r in range(world):
        d = root / f"n{r}" / step_dir_name(step)
        own += sum(p.stat().st_size for p in d.iterdir() if p.is_file() and p.name.startswith(("data-", "manifest-rank")))
        parity += sum(p.stat().st_size for p in (d / "parity").glob("*.xor"))
    return {"own": own, "parity": parity}


def worker(rank: int, world: int, port: int, base: str, a: dict) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        state = make_state(a["size"], rank)
        group = a["group"] or world
        cases = {"no parity": None, f"parity_group={group}": group}
        cks = {c: GDSCheckpointer(state, root=Path(base, c.replace(" ", "-").replace("=", ""), f"n{rank}"),
                                  keep_last=1, dist_options=DistOptions(parity_group=g, replicated=()))
               for c, g in cases.items()}
        for c, g in cases.items():  # engines, pools, plans
            cks[c].save(0)
            if g:
                cks[c].wait_protected()
        rows: dict = {c: [] for c in cases}
        for r in range(1, a["rounds"] + 1):
            for c, g in cases.items():
                rows[c].append(timed_save(cks[c], r, g is not None))
        out = {"rows": rows, "group": group, "state_bytes": sum(v.nbytes for v in state.values()) * world}
        if rank == 0:
            out.update(drive_bytes(Path(base, f"parity_group{group}"), world, a["rounds"]))
        for ck in cks.values():
            ck.close()
        if rank == 0:
            Path(base, "result.json").write_text(json.dumps(out))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - the parent reports it
        Path(base, f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run(world: int, base: Path, a: dict) -> dict:
    return spawn_ranks(worker, world, base, a)


def table(world: int, res: dict) -> list[str]:
    rows, g = res["rows"], res["group"]
    med = {(c, k): statistics.median(x[k] for x in v) for c, v in rows.items() for k in v[0]}
    p = f"parity_group={g}"
    lines = [f"{world} ranks (1 per simulated node), state {human(res['state_bytes'])} in all, parity_group={g}",
             f"  {'case':<16} {'committed s':>12} {'protected s':>12}"]
    for c in rows:
        prot = med.get((c, "protected"))
        lines.append(f"  {c:<16} {med[(c, 'committed')]:>12.3f} {'' if prot is None else f'{prot:.3f}':>12}")
    ratio = statistics.median(x["protected"] / y["committed"] for x, y in zip(rows[p], rows["no parity"]))
    plan = parity_groups([f"node{r}" for r in range(world)], g)
    lines += [f"  time to protected, parity / no parity (committed):    {ratio:.2f}",
              f"  drive bytes / state byte, files: {(res['own'] + res['parity']) / res['own']:.4f}, state: "
              f"{(res['own'] + res['parity']) / res['state_bytes']:.4f}  (the plan's, groups of "
              f"{[grp.size for grp in plan.groups]}: {plan.drive_factor():.4f})"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M", help="each rank's state")
    ap.add_argument("--ranks", default="3,4")
    ap.add_argument("--group", type=int, default=0, help="DistOptions(parity_group=G); 0: all ranks in one group")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    a = {"size": parse_size(ns.size), "rounds": ns.rounds, "group": ns.group}
    run_worlds(run, table, "gdswriter-parity", ns.ranks, a, ns.dir, ns.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
