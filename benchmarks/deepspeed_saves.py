"""DeepSpeed's save_checkpoint through gdswriter vs DeepSpeed's own TorchCheckpointEngine, interleaved.

One DeepSpeed engine on the CPU (DS_ACCELERATOR=cpu, gloo, one process), an MLP of about SIZE
bytes of fp32 parameters trained with AdamW under ZeRO stage STAGE. Each round, every method in
turn (the order rotates from round to round) trains a step, saves a tag and trains the next step;
reported per method:

* blocked: the time training is held by the save: ``engine.save_checkpoint``'s own time, plus,
  for gdswriter, the next optimizer step's wait for the snapshot (gdswriter's step pre-hook);
* durable: from the call until the tag is on disk (fsynced) and ``latest`` names it. DeepSpeed's
  torch engine does not fsync: its figure adds an fsync of the tag's files, ``latest`` and their
  directories right after ``save_checkpoint`` returns (what a crash-safe save would need).

gdswriter runs asynchronously (``use_gdswriter(engine)``) and blocking (``async_save=False``).

    .venv/bin/python benchmarks/deepspeed_saves.py [--size 256M] [--stage 1] [--rounds 5] [--dir D]
"""

from __future__ import annotations

import argparse
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

METHODS = ("torch", "gdswriter async", "gdswriter blocking")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M", help="fp32 parameter bytes (the optimizer state adds 2-3x)")
    ap.add_argument("--stage", type=int, default=1, choices=(0, 1, 2, 3))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=str(HERE))
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)

    import deepspeed
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from gdswriter.integrations.deepspeed import use_gdswriter

    deepspeed.init_distributed(dist_backend="gloo")
    width = 1024
    layers = max(1, _util.parse_size(a.size) // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": a.stage}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    nparams = sum(p.numel() for p in model.parameters())

    def train_step() -> float:
        t = time.perf_counter()
        loss = engine(torch.randn(4, width)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t

    torch_engine = TorchCheckpointEngine(engine._config)
    gds = use_gdswriter(engine)
    blocked: dict[str, list[float]] = {m: [] for m in METHODS}
    durable: dict[str, list[float]] = {m: [] for m in METHODS}
    step_s = [train_step() for _ in range(3)][1:]
    work = Path(tempfile.mkdtemp(prefix="ds-saves-", dir=a.dir))
    try:
        for r in range(a.rounds):
            for m in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
                train_step()
                save_dir, tag = work / m.replace(" ", "-"), f"round{r}"
                engine.checkpoint_engine = torch_engine if m == "torch" else gds  # the wrapper follows it
                gds.async_save = m == "gdswriter async"
                t0 = time.perf_counter()
                engine.save_checkpoint(str(save_dir), tag=tag)
                t1 = time.perf_counter()
                if m == "torch":
                    for p in [*sorted((save_dir / tag).iterdir()), save_dir / "latest", save_dir / tag, save_dir]:
                        _fsync(p)
                    blocked[m].append(t1 - t0)
                    durable[m].append(time.perf_counter() - t0)
                    train_step()
                else:
                    train_step()  # its optimizer step waits for gdswriter's snapshot, if that still runs
                    gds.wait()
                    blocked[m].append(gds.last_save["blocked_s"])
                    durable[m].append(gds.last_save["durable_s"])
                shutil.rmtree(save_dir / tag)
    finally:
        engine.checkpoint_engine = gds
        shutil.rmtree(work, ignore_errors=True)

    saved = nparams * 4 * (3 if a.stage == 0 else 4)  # weights + 2 Adam moments (+ ZeRO's fp32 partition)
    print(f"DeepSpeed {deepspeed.__version__}, ZeRO stage {a.stage}, one CPU process (gloo), {layers} x "
          f"Linear({width}, {width}): {nparams * 4 / 2**20:.0f} MiB of fp32 parameters, about {saved / 2**20:.0f} "
          f"MiB per tag; {a.rounds} interleaved rounds; a training step takes {statistics.median(step_s) * 1e3:.0f} ms")

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.1f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"

    print(f"  {'method':20s} {'blocked ms, median (min-max)':>30s} {'durable ms, median (min-max)':>30s}")
    for m in METHODS:
        print(f"  {m:20s} {cell(blocked[m]):>30s} {cell(durable[m]):>30s}")
    for m in METHODS[1:]:
        rb = statistics.median(t / g for t, g in zip(blocked["torch"], blocked[m]))
        rd = statistics.median(t / g for t, g in zip(durable["torch"], durable[m]))
        print(f"  {m} vs torch: blocked {rb:.2f}x shorter, durable {rd:.2f}x sooner (medians of per-round ratios)")


if __name__ == "__main__":
    main()
