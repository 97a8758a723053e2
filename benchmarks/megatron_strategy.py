"""Megatron-Core dist_checkpointing: gdswriter's strategy vs Megatron's torch_dist, interleaved.

RANKS gloo processes on the CPU, each holding a TP=RANKS shard of SIZE bytes (fp32, in tensors
of 4 MiB and more). Each round, both strategies in turn (the order alternates from round to
round) save the same sharded state dict to a fresh iteration directory through
``dist_checkpointing.save(..., async_sharded_save=True)`` scheduled on Megatron's own
``AsyncCallsQueue`` (its TemporalAsyncCaller forks the async worker), as Megatron-LM's
``--async-save`` does. Reported per strategy, the slowest rank's:

* blocked: ``save()`` plus ``schedule_async_request``: what training waits for;
* durable: from the call until ``maybe_finalize_async_calls(blocking=True)`` returns, the
  checkpoint committed with its metadata.json (both strategies fsync their data files).

Megatron's async caller and torch_dist's finalize call CUDA (``torch.cuda.synchronize``, a CUDA
tensor for the ranks' all-reduce), which a CPU torch refuses: on a machine without CUDA this
script (only) makes ``torch.cuda.synchronize`` a no-op and ``torch.cuda.current_device`` return
"cpu", so those tensors live on the CPU and gloo carries them.

    .venv/bin/python benchmarks/megatron_strategy.py [--ranks 2] [--size 256M] [--rounds 3] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _util  # noqa: E402
import torch  # noqa: E402

STRATEGIES = ("torch_dist", "gdswriter")
TENSOR_BYTES = 4 << 20


def _cpu_shim() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


def _state(rank: int, world: int, nbytes: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    rows = TENSOR_BYTES // 4 // 1024
    n = max(1, nbytes // TENSOR_BYTES)
    g = torch.Generator().manual_seed(rank)
    return {f"layer{i}": ShardedTensor.from_rank_offsets(f"layer{i}", torch.randn(rows, 1024, generator=g),
                                                         (0, rank, world)) for i in range(n)}


def _strategy(name: str):
    if name == "gdswriter":
        from gdswriter.integrations.megatron import GDSSaveShardedStrategy

        return GDSSaveShardedStrategy()
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1)


def _rank(rank: int, world: int, port: str, nbytes: int, rounds: int, folder: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _cpu_shim()
    sd = _state(rank, world, nbytes)
    strategies = {name: _strategy(name) for name in STRATEGIES}
    queue = AsyncCallsQueue()
    times: dict[str, dict[str, list[float]]] = {n: {"blocked": [], "durable": []} for n in STRATEGIES}
    for r in range(rounds):
        for name in (STRATEGIES if r % 2 == 0 else STRATEGIES[::-1]):
            ckpt = os.path.join(folder, f"{name}-{r}")
            os.makedirs(ckpt, exist_ok=True)
            dist.barrier()
            t0 = time.perf_counter()
            req = dist_checkpointing.save(sd, ckpt, sharded_strategy=strategies[name], async_sharded_save=True)
            queue.schedule_async_request(req)
            blocked = time.perf_counter() - t0
            queue.maybe_finalize_async_calls(blocking=True)
            durable = time.perf_counter() - t0
            both = [None] * world
            dist.all_gather_object(both, (blocked, durable))
            times[name]["blocked"].append(max(b for b, _ in both))
            times[name]["durable"].append(max(d for _, d in both))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt)
    strategies["gdswriter"].close()
    queue.close()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", default="256M", help="bytes per rank (K/M/G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    nbytes = _util.parse_size(args.size)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix="megatron-bench-", dir=base)
    out = os.path.join(folder, "times.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    try:
        torch.multiprocessing.spawn(_rank, args=(args.ranks, port, nbytes, args.rounds, folder, out),
                                    nprocs=args.ranks)
        times = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"Megatron dist_checkpointing, {args.ranks} ranks x {args.size} (TP={args.ranks}), {args.rounds} "
          f"interleaved rounds, median (min-max) of the slowest rank, seconds")
    for name in STRATEGIES:
        cells = []
        for kind in ("blocked", "durable"):
            v = times[name][kind]
            cells.append(f"{kind} {statistics.median(v):7.3f} ({min(v):.3f}-{max(v):.3f})")
        print(f"  {name:<11} " + "   ".join(cells))
    for kind in ("blocked", "durable"):
        ratio = statistics.median(times["torch_dist"][kind]) / statistics.median(times["gdswriter"][kind])
        print(f"  {kind}: torch_dist / gdswriter = {ratio:.2f}x")


if __name__ == "__main__":
    main()
