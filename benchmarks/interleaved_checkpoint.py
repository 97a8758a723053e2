"""Checkpoint save/load vs torch.save, DCP (4 threads) and safetensors, interleaved round by round.

Same cases and state as bench_checkpoint.py (its Formats class does the work), but each round
runs every format's durable save and then its cold load before the next format, so every
ratio compares runs minutes apart at most, not a whole suite apart.

    .venv/bin/python benchmarks/interleaved_checkpoint.py [--size 2G] [--rounds 3] [--dir D]
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

import _util  # noqa: E402
from bench_checkpoint import Formats, build_state, state_bytes  # noqa: E402

from gdswriter import CheckpointOptions, GDSCheckpointer  # noqa: E402
from gdswriter.cli import parse_size  # noqa: E402

CASES = {"torch": ("torch.save", "torch.load"), "dcp4": ("dcp.save t4", "dcp.load"),
         "safetensors": ("safetensors.save_file", "safetensors.load_file"), "gdswriter": ("gdswriter.save", "gdswriter.load")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=str(HERE))
    a = ap.parse_args()
    model, opt = build_state(parse_size(a.size))
    nbytes = state_bytes(model, opt)
    work = Path(tempfile.mkdtemp(prefix=".interleaved-ckpt-", dir=a.dir))
    save: dict[str, list[float]] = {c: [] for c in CASES}
    load: dict[str, list[float]] = {c: [] for c in CASES}
    try:
        with GDSCheckpointer(model, opt, root=work / "gdswriter", options=CheckpointOptions()) as gds:
            gds.engine_info  # create the engines outside the timed region
            formats = Formats(work, model, opt, gds)
            for _ in range(a.rounds):
                for case in CASES:
                    formats.clear(case)
                    _util.quiesce()
                    t = time.perf_counter()
                    formats.save(case)
                    save[case].append(nbytes / (time.perf_counter() - t) / 1e9)
                    _util.evict(*formats.files(case))
                    t = time.perf_counter()
                    formats.load("dcp" if case == "dcp4" else case)
                    load[case].append(nbytes / (time.perf_counter() - t) / 1e9)
                    formats.clear(case)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {c: (statistics.median(save[c]), statistics.median(load[c])) for c in CASES}
    print(f"{nbytes / 1e9:.2f} GB of model + AdamW state, {a.rounds} interleaved rounds, GB/s (median)")
    print(f"  {'case':24s} {'save':>6s} {'load':>6s}   rounds save | load")
    for c, (s, l) in med.items():
        print(f"  {CASES[c][0]:24s} {s:6.2f} {l:6.2f}   {' '.join(f'{x:.2f}' for x in save[c])} | "
              f"{' '.join(f'{x:.2f}' for x in load[c])}")

    def per_round(mine: list[float], ref: list[float]) -> str:
        return f"{statistics.median(m / r for m, r in zip(mine, ref)):.2f}x"

    g = "gdswriter"
    print(f"  gdswriter.save vs torch.save {per_round(save[g], save['torch'])}, vs dcp.save t4 "
          f"{per_round(save[g], save['dcp4'])}; gdswriter.load vs torch.load {per_round(load[g], load['torch'])}, "
          f"vs dcp.load {per_round(load[g], load['dcp4'])}, vs safetensors {per_round(load[g], load['safetensors'])} "
          f"(medians of per-round ratios)")


if __name__ == "__main__":
    main()
