"""Engine vs fio, interleaved round by round on the same directory.

pytest-benchmark runs all rounds of one case back to back, so on a disk whose
speed drifts (virtual disks: +-40% between minutes) the per-case medians carry
that drift into the ratios. Here each round runs fio write, engine write, fio
read, engine read in turn, so every ratio compares neighbours in time.

    .venv/bin/python benchmarks/interleaved_engine.py [--size 2G] [--rounds 5] [--dir D]

Needs fio (io_uring engine). Writes are durable (fio --end_fsync=1; the engine's
fdatasync); reads are cold (fdatasync + POSIX_FADV_DONTNEED, then drop_caches if
permitted).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gdswriter import ReadSpan, WriteSpan, create_engine
from gdswriter.tools.measure import fio_bandwidth
from gdswriter.units import parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402


def fio(rw: str, path: Path, size: int) -> float:
    return fio_bandwidth(rw, path, size) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent))
    a = ap.parse_args()
    if not shutil.which("fio"):
        raise SystemExit("fio is not installed (apt-get install fio)")
    n = parse_size(a.size)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    out = torch.zeros(n, dtype=torch.uint8)  # touched now, so round 1 does not time page faults
    work = Path(tempfile.mkdtemp(prefix=".interleaved-", dir=a.dir))
    results: dict[str, list[float]] = {"fio write": [], "engine write": [], "fio read": [], "engine read": []}
    try:
        with create_engine() as engine:
            for _ in range(a.rounds):
                for f in work.iterdir():
                    f.unlink()
                results["fio write"].append(fio("write", work / "fio.bin", n))
                t = time.perf_counter()
                engine.write_file(work / "engine.bin", [WriteSpan(0, src)])
                results["engine write"].append(n / (time.perf_counter() - t) / 1e9)
                _util.evict(work / "fio.bin")
                results["fio read"].append(fio("read", work / "fio.bin", n))
                _util.evict(work / "engine.bin")
                t = time.perf_counter()
                engine.read_file(work / "engine.bin", [ReadSpan(0, out)])
                results["engine read"].append(n / (time.perf_counter() - t) / 1e9)
                assert torch.equal(out, src), "engine read back different bytes"
            print(f"engine: {engine.info}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{a.size} x {a.rounds} rounds, GB/s (decimal)")
    for k, v in results.items():
        print(f"  {k:13s} median {statistics.median(v):5.2f}   rounds {' '.join(f'{x:.2f}' for x in v)}")
    for kind in ("write", "read"):
        per = [e / f for e, f in zip(results[f"engine {kind}"], results[f"fio {kind}"])]
        print(f"  engine/fio {kind}: median of per-round ratios {statistics.median(per):.2f}x "
              f"(rounds {' '.join(f'{r:.2f}' for r in per)})")


if __name__ == "__main__":
    main()
