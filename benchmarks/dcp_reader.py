"""dcp.load through GDSStorageReader against FileSystemReader and GDSCheckpointer.load (issue 25).

The same state (``--tensors`` float32 tensors making up each size) is saved three ways: with
``dcp.save`` through FileSystemWriter and through GDSStorageWriter, and with
``GDSCheckpointer.save``. Each round then loads all three from a cold cache (files flushed and
evicted, the device settled), in an order that rotates from round to round, and every load is
checked against the saved state bit for bit. Each load goes into zeroed tensors allocated
before its clock starts: the destination is the caller's, the same for every reader, and
allocating it (zeros_like touching fresh pages) took 0.17-0.55 s per 512 MiB on this shared
host, more than the readers differ by. Medians per size, in GiB/s, and the ratio of
GDSStorageReader to FileSystemReader measured in the same rounds.

    .venv/bin/python benchmarks/dcp_reader.py [--sizes 32M,128M,512M] [--rounds 3] [--dir D]
                                               [--ranks 1] [--settle 1] [--json]

``--ranks 2`` runs the two DCP loads on two gloo ranks (torch.multiprocessing; each rank holds
half of every tensor as a DTensor shard), timing each round from a barrier to the slowest
rank's finish; GDSCheckpointer.load is then left out (the step is a DCP checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402

from gdswriter.units import parse_size  # noqa: E402

GiB = 1 << 30


def _state(nbytes: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = max(1, nbytes // tensors // 4)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _check(got: dict, want: dict) -> None:
    for k, v in want.items():
        if not torch.equal(got[k], v):
            raise AssertionError(f"{k}: the loaded tensor differs from the saved one")


def _cold(path: Path, settle: float) -> None:
    _util.settle(settle)
    _util.evict(path)


def one_process(sizes: list[int], rounds: int, tensors: int, base: Path, settle: float) -> list[dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter

    out = []
    for size in sizes:
        state = _state(size, tensors)
        nbytes = sum(t.numel() * 4 for t in state.values())
        fs_dir, gds_dir, ck_dir = base / f"fs-{size}", base / f"gds-{size}", base / f"ck-{size}"
        dcp.save(state, storage_writer=FileSystemWriter(fs_dir), no_dist=True)
        w = GDSStorageWriter(gds_dir)
        dcp.save(state, storage_writer=w, no_dist=True)
        w.close()
        holder = _zeros(state)
        with GDSCheckpointer(holder, root=ck_dir) as ck:
            holder.update({k: v.clone() for k, v in state.items()})
            ck.save(1)

        def fs(got: dict) -> None:
            dcp.load(got, storage_reader=FileSystemReader(fs_dir), no_dist=True)

        def gds(got: dict) -> None:
            dcp.load(got, storage_reader=GDSStorageReader(gds_dir), no_dist=True)

        def ckpt(got: dict) -> None:
            with GDSCheckpointer(got, root=ck_dir) as c:
                c.load(1)

        cases = {"FileSystemReader": (fs, fs_dir), "GDSStorageReader": (gds, gds_dir),
                 "GDSCheckpointer.load": (ckpt, ck_dir)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        names = list(cases)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, path = cases[name]
                got = _zeros(state)  # the caller's state, allocated before the clock starts (as at 2 ranks)
                _cold(path, settle)
                t0 = time.perf_counter()
                fn(got)
                times[name].append(time.perf_counter() - t0)
                _check(got, state)
        out.append(_row(size, nbytes, 1, times))
        for p in (fs_dir, gds_dir, ck_dir):
            _util.remove(p)
    return out


def _rank_main(rank: int, world: int, port: int, sizes: list[int], rounds: int, tensors: int, base: str,
               settle: float, result: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for size in sizes:
        full = _state(size, tensors)
        nbytes = sum(t.numel() * 4 for t in full.values())
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        fs_dir, gds_dir = Path(base, f"fs-{size}"), Path(base, f"gds-{size}")
        dcp.save(state, storage_writer=FileSystemWriter(fs_dir))
        w = GDSStorageWriter(gds_dir)
        dcp.save(state, storage_writer=w)
        w.close()
        cases = {"FileSystemReader": (lambda: FileSystemReader(fs_dir), fs_dir),
                 "GDSStorageReader": (lambda: GDSStorageReader(gds_dir), gds_dir)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        names = list(cases)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                make, path = cases[name]
                if rank == 0:
                    _cold(path, settle)
                dist.barrier()
                got = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
                t0 = time.perf_counter()
                dcp.load(got, storage_reader=make())
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(float(dt))
                for k, v in state.items():
                    if not torch.equal(got[k].to_local(), v.to_local()):
                        raise AssertionError(f"rank {rank}: {k} differs from the saved shard")
        rows.append(_row(size, nbytes, world, times))
        dist.barrier()
        if rank == 0:
            _util.remove(fs_dir)
            _util.remove(gds_dir)
    if rank == 0:
        Path(result).write_text(json.dumps(rows))
    dist.destroy_process_group()


def ranks(world: int, sizes: list[int], rounds: int, tensors: int, base: Path, settle: float) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = base / "result.json"
    mp.start_processes(_rank_main, args=(world, port, sizes, rounds, tensors, str(base), settle, str(result)),
                       nprocs=world, start_method="spawn")
    return json.loads(result.read_text())


def _row(size: int, nbytes: int, world: int, times: dict[str, list[float]]) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": size, "bytes": nbytes, "ranks": world, "median_s": med,
            "gib_s": {k: nbytes / v / GiB for k, v in med.items()},
            "ratio_gds_to_fs": med["FileSystemReader"] / med["GDSStorageReader"],
            "rounds": {k: v for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32M,128M,512M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=8, help="tensors making up each size (default 8)")
    ap.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds to wait after sync before each load")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="dcp-reader-") as d:
        if args.ranks == 1:
            rows = one_process(sizes, args.rounds, args.tensors, Path(d), args.settle)
        else:
            rows = ranks(args.ranks, sizes, args.rounds, args.tensors, Path(d), args.settle)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"dcp.load from a cold cache, {args.ranks} rank(s), {args.tensors} tensors, median of {args.rounds} "
          f"interleaved rounds (GiB/s):")
    for row in rows:
        cells = "  ".join(f"{k} {v:5.2f}" for k, v in row["gib_s"].items())
        print(f"  {row['bytes'] / (1 << 20):6.0f} MiB  {cells}  GDSStorageReader/FileSystemReader "
              f"{row['ratio_gds_to_fs']:.2f}x")


if __name__ == "__main__":
    main()
