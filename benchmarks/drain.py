"""The drain to shared storage (CheckpointOptions.drain_root): time to drained against time to
committed, and what a drain in flight does to the next save's time, interleaved round by round.

Each round, with one checkpointer draining every step:

* quiet save: no drain in flight; the time to committed (``save()``), then to drained
  (``wait_drained()``), both from the save's start;
* busy save: a step is saved, and while its drain runs the next step is saved at once; its
  time to committed, against the quiet save's of the same round.

Ratios are taken within a round and their medians reported. The drain root is a directory
beside the local root (``--drain-dir`` puts it elsewhere, e.g. on a network file system): on one
disk the drain's reads and writes compete with the save's own, which a node-local NVMe and a
shared file system would not.

    .venv/bin/python benchmarks/drain.py [--size 256M] [--rounds 5] [--dir D] [--drain-dir D2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from gdswriter import CheckpointOptions, GDSCheckpointer  # noqa: E402
from gdswriter.units import human, parse_size  # noqa: E402

TENSORS = 8


def make_state(nbytes: int) -> dict:
    n = max(nbytes // TENSORS // 4, 1)
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(TENSORS)}


def one_round(ck: GDSCheckpointer, step: int) -> dict:
    """A quiet save (steps ``step``), then a busy one (``step + 2`` while ``step + 1`` drains)."""
    ck.wait_drained()
    t0 = time.perf_counter()
    ck.save(step)
    committed = time.perf_counter() - t0
    ck.wait_drained()
    drained = time.perf_counter() - t0
    ck.save(step + 1)  # its drain starts now
    t1 = time.perf_counter()
    ck.save(step + 2)
    busy = time.perf_counter() - t1
    ck.wait_drained()
    return {"committed": committed, "drained": drained, "busy": busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=str(HERE))
    ap.add_argument("--drain-dir", default=None, help="the drain root's parent (default: beside the local root)")
    a = ap.parse_args()
    size = parse_size(a.size)
    work = Path(tempfile.mkdtemp(prefix="gdswriter-drain-", dir=a.dir))
    shared = Path(tempfile.mkdtemp(prefix="gdswriter-drain-shared-", dir=a.drain_dir or a.dir))
    try:
        state = make_state(size)
        opts = CheckpointOptions(keep_last=2, drain_root=shared / "root", drain_keep_last=2)
        rows = []
        with GDSCheckpointer(state, root=work / "local", options=opts) as ck:
            ck.save(0)  # warm-up: engines, pool, first drain
            ck.wait_drained()
            for r in range(a.rounds):
                rows.append(one_round(ck, 10 * (r + 1)))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        print(f"drain: {human(nbytes)} state, {a.rounds} round(s), local {work}, drain root {shared}")
        for i, row in enumerate(rows):
            print(f"  round {i + 1}: committed {row['committed']:.3f} s, drained {row['drained']:.3f} s, "
                  f"save with a drain in flight {row['busy']:.3f} s")
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        drained_ratio = statistics.median(r["drained"] / r["committed"] for r in rows)
        busy_ratio = statistics.median(r["busy"] / r["committed"] for r in rows)
        print(f"  median: committed {med['committed']:.3f} s ({nbytes / med['committed'] / 1e9:.2f} GB/s), "
              f"drained {med['drained']:.3f} s")
        print(f"  time to drained / time to committed: {drained_ratio:.2f}x (median of per-round ratios)")
        print(f"  save time with a drain in flight / without: {busy_ratio:.2f}x (median of per-round ratios)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


if __name__ == "__main__":
    main()
