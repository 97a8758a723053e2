"""Checkpoint save/load vs torch.save, DCP (4 threads) and safetensors, interleaved round by round.

Same cases and state as bench_checkpoint.py (its Formats class does the work), but each round
runs every format's durable save and then its cold load before the next format, so every
ratio compares runs minutes apart at most, not a whole suite apart.

When fio is installed, each round also measures the device itself: a durable fio write and
a cold fio read of the same number of bytes (io_uring, O_DIRECT, 4 MiB, QD 16). Every
format is bounded by those figures, so they say how much room any writer has left.

Before each cold load the script syncs and waits ``--settle`` seconds. On a virtual disk
the host may still be flushing the save that just finished; without the pause, the format
that saved fastest pays for it in its load.

    .venv/bin/python benchmarks/interleaved_checkpoint.py [--size 2G] [--rounds 3] [--settle 5] [--dir D]
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
from gdswriter.units import parse_size  # noqa: E402

CASES = {"torch": ("torch.save", "torch.load"), "dcp4": ("dcp.save t4", "dcp.load"),
         "safetensors": ("safetensors.save_file", "safetensors.load_file"), "gdswriter": ("gdswriter.save", "gdswriter.load")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=_util.bench_settle(),
                    help="seconds to wait (after sync) before each cold load; 0 disables "
                         "(default: GDSWRITER_BENCH_SETTLE_S or 5)")
    ap.add_argument("--dir", default=str(HERE))
    a = ap.parse_args()
    if a.settle < 0:
        raise SystemExit("--settle must be >= 0")
    with_fio = _util.fio_path() is not None
    if not with_fio:
        print("fio is not installed: no device reference row (apt-get install fio)", file=sys.stderr)
    model, opt = build_state(parse_size(a.size))
    nbytes = state_bytes(model, opt)
    work = Path(tempfile.mkdtemp(prefix=".interleaved-ckpt-", dir=a.dir))
    cases = dict(CASES, **({"fio": ("fio (device)", "fio (device)")} if with_fio else {}))
    save: dict[str, list[float]] = {c: [] for c in cases}
    load: dict[str, list[float]] = {c: [] for c in cases}
    try:
        with GDSCheckpointer(model, opt, root=work / "gdswriter", options=CheckpointOptions()) as gds:
            gds.engine_info  # create the engines outside the timed region
            formats = Formats(work, model, opt, gds)
            for _ in range(a.rounds):
                for case in cases:
                    if case == "fio":
                        run_fio(work, nbytes, a.settle, save[case], load[case])
                        continue
                    formats.clear(case)
                    _util.quiesce()
                    t = time.perf_counter()
                    formats.save(case)
                    save[case].append(nbytes / (time.perf_counter() - t) / 1e9)
                    _util.settle(a.settle)
                    _util.evict(*formats.files(case))
                    t = time.perf_counter()
                    formats.load("dcp" if case == "dcp4" else case)
                    load[case].append(nbytes / (time.perf_counter() - t) / 1e9)
                    formats.clear(case)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {c: (statistics.median(save[c]), statistics.median(load[c])) for c in cases}
    print(f"{nbytes / 1e9:.2f} GB of model + AdamW state, {a.rounds} interleaved rounds, settle {a.settle:g} s, "
          f"GB/s (median)")
    print(f"  {_util.torch_cpu_placement(Path(a.dir))}")
    print(f"  {'case':24s} {'save':>6s} {'load':>6s}   rounds save | load")
    for c, (s, l) in med.items():
        print(f"  {cases[c][0]:24s} {s:6.2f} {l:6.2f}   {' '.join(f'{x:.2f}' for x in save[c])} | "
              f"{' '.join(f'{x:.2f}' for x in load[c])}")

    def per_round(mine: list[float], ref: list[float]) -> str:
        return f"{statistics.median(m / r for m, r in zip(mine, ref)):.2f}x"

    g = "gdswriter"
    print(f"  gdswriter.save vs torch.save {per_round(save[g], save['torch'])}, vs dcp.save t4 "
          f"{per_round(save[g], save['dcp4'])}; gdswriter.load vs torch.load {per_round(load[g], load['torch'])}, "
          f"vs dcp.load {per_round(load[g], load['dcp4'])}, vs safetensors {per_round(load[g], load['safetensors'])} "
          f"(medians of per-round ratios)")
    if with_fio:
        print(f"  vs the device (fio): gdswriter.save {per_round(save[g], save['fio'])}, dcp.save t4 "
              f"{per_round(save['dcp4'], save['fio'])}, gdswriter.load {per_round(load[g], load['fio'])}, "
              f"safetensors.load_file {per_round(load['safetensors'], load['fio'])}")


def run_fio(work: Path, nbytes: int, settle_s: float, save: list[float], load: list[float]) -> None:
    """The device's own durable write and cold read bandwidth for ``nbytes``, in GB/s."""
    path = work / "fio.bin"
    _util.quiesce()
    save.append(_util.fio_run("write", path, nbytes) / 1e9)
    _util.settle(settle_s)
    _util.evict(path)
    load.append(_util.fio_run("read", path, nbytes) / 1e9)
    _util.remove(path)


if __name__ == "__main__":
    main()
