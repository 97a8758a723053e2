"""Does the placement of the staging buffers in memory change I/O bandwidth? (diagnostic)

Creates io_uring engines whose staging pools differ only in when they were allocated:

  A  right after the process freed ``--ballast`` bytes (the pool reuses those pages),
  B  while ``--ballast`` bytes are held,
  C  ``--wait`` seconds after that,

each in two kinds: "4k" (4 KiB pages, 4 MiB requests: the defaults before huge-page pools)
and "huge" (the defaults: transparent huge pages, 1 MiB requests). Round after round, each
engine writes one file durably from unaligned memory (so every byte goes through its
staging buffers) and reads it back cold; the script prints the bandwidths and the block
device's mean time per request (from /sys/dev/block/*/stat). The requests are the same
for every pool of a kind, so on bare metal A, B and C agree. On this project's VM
(Firecracker, nested KVM, virtio-balloon free page reporting), "4k" A wrote 15-30% and read
33-41% slower than B and C, while the "huge" rows agreed: see README "Benchmarks". A
training job builds its model (and frees its gradients) just before it creates its
checkpointer, which is case A.

    .venv/bin/python benchmarks/staging_placement.py [--size 1G] [--rounds 4] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util  # noqa: E402

from gdswriter import EngineOptions, ReadSpan, WriteSpan, create_engine  # noqa: E402
from gdswriter.units import parse_size  # noqa: E402


def device_stat(path: Path) -> Path | None:
    """The sysfs stat file of the block device that holds ``path`` (None if there is none)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def counters(stat: Path | None, write: bool) -> tuple[int, int]:
    """(completed requests, milliseconds spent on them) of the device, for writes or reads, or zeros."""
    if stat is None:
        return 0, 0
    fields = stat.read_text().split()
    return (int(fields[4]), int(fields[7])) if write else (int(fields[0]), int(fields[3]))


KINDS = {"4k": EngineOptions.from_env(huge_pages=False, request_bytes=4 * _util.MiB, buffer_bytes=16 * _util.MiB),
         "huge": EngineOptions.from_env()}


def pools(tag: str) -> dict:
    return {f"{tag} {kind}": create_engine(opts) for kind, opts in KINDS.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="file size (default 1G)")
    ap.add_argument("--ballast", default="2G", help="bytes allocated before the pools (default 2G)")
    ap.add_argument("--wait", type=float, default=3.0, help="seconds between pools B and C (default 3)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=str(HERE))
    a = ap.parse_args()
    n, ballast_bytes = parse_size(a.size), parse_size(a.ballast)
    need, avail = 2 * n + ballast_bytes + 512 * _util.MiB, _util.mem_available()
    if avail is not None and avail < need:
        raise SystemExit(f"needs about {_util.human(need)} of RAM, {_util.human(avail)} available: "
                         f"use a smaller --size or --ballast")

    touched = torch.empty(ballast_bytes, dtype=torch.uint8)
    touched.fill_(1)
    del touched
    engines = pools("A")
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8)
    ballast.fill_(1)
    engines.update(pools("B"))
    time.sleep(a.wait)
    engines.update(pools("C"))

    # Unaligned source and destination (like live parameters), so every byte goes through staging.
    src = torch.zeros(n + 4096, dtype=torch.uint8)[64:64 + n]
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    dst = torch.zeros(n + 4096, dtype=torch.uint8)[64:64 + n]
    work = Path(tempfile.mkdtemp(prefix=".placement-", dir=a.dir))
    path = work / "data.bin"
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        path.touch()
        stat = device_stat(path)
        for r in range(a.rounds):
            order = list(engines.items())
            for name, engine in order if r % 2 == 0 else order[::-1]:
                path.unlink()
                _util.quiesce()
                results.setdefault((name, "write"), []).append(
                    timed(stat, True, n, lambda: engine.write_file(path, [WriteSpan(0, src)])))
                _util.settle(1.0)
                _util.evict(path)
                results.setdefault((name, "read"), []).append(
                    timed(stat, False, n, lambda: engine.read_file(path, [ReadSpan(0, dst)])))
                if not torch.equal(dst, src):
                    raise SystemExit(f"{name}: read-back differs from what was written")
        print(f"durable writes and cold reads of {_util.human(n)} through the staging buffers, {a.rounds} "
              f"rounds, alternating order (medians); 4k = 4 KiB pages + 4 MiB requests, huge = the defaults")
        for name in engines:
            cells = []
            for op in ("write", "read"):
                gbs = [x for x, _ in results[(name, op)]]
                lat = f"{statistics.median(ms for _, ms in results[(name, op)]):5.1f} ms/req" if stat else "n/a"
                cells.append(f"{op} {statistics.median(gbs):5.2f} GB/s {lat} ({' '.join(f'{x:.2f}' for x in gbs)})")
            print(f"  {name:7s} " + "   ".join(cells))
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
        del ballast


def timed(stat: Path | None, write: bool, n: int, fn) -> tuple[float, float]:
    """(GB/s, the device's mean milliseconds per request) of one call of ``fn`` moving ``n`` bytes."""
    reqs0, ms0 = counters(stat, write)
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    reqs1, ms1 = counters(stat, write)
    return n / seconds / 1e9, (ms1 - ms0) / max(1, reqs1 - reqs0)


if __name__ == "__main__":
    main()
