"""Saves through the Hugging Face and Lightning integrations vs the frameworks' own checkpointing.

Per save, two figures: how long training is blocked (the save call: ``Trainer._save_checkpoint``,
the method the Trainer runs at each ``save_steps``; ``L.Trainer.save_checkpoint``) and how long
until the checkpoint is durable. The frameworks' own savers do not fsync: their time to durable
is the call plus fsyncing what it wrote. gdswriter's blocking saves return durable; its
asynchronous ones are durable once ``gds_wait()`` / the plug-in's ``teardown()`` return (HF: the
checkpoint-N directory is renamed into place). Both Trainers rotate (``save_total_limit=1``): the
plain one deletes the previous checkpoint inside ``_save_checkpoint``; GDSTrainer renames it out
of sight there and deletes it on a helper thread, and the next save waits until it is gone, so
either way the deletion is counted where it holds training up (here: only what the optimizer
step between two saves does not cover). The cases are interleaved round by round, in an
order rotated each round, so the ratios compare runs seconds apart on a disk that drifts. The
first save of each case in a round is reported apart (the first gdswriter save of the process
builds the engines of the shelf every later save reuses).

The state: one Linear of ``--size`` bytes of float32 weights and its AdamW moments (the
checkpoint is about three times ``--size``), on the CPU.

``--ceiling`` also measures, in each round before its cases, the disk's durable O_DIRECT write
ceiling for the checkpoint's bytes (fio when installed, else the built-in loop, as ``gdswriter
bench``), and prints each case's first and later saves as GB/s until durable and as a ratio to
the ceiling of the same round (2 GiB checkpoints: ``--size 683M``).

    .venv/bin/python benchmarks/integration_saves.py [--size 64M] [--saves 5] [--rounds 2] [--dir D] [--ceiling]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from gdswriter.units import parse_size  # noqa: E402


def _fsync_tree(path: Path) -> None:
    """What the frameworks' own savers leave undone: fsync each file, each directory."""
    paths = [path] if path.is_file() else [Path(d) / n for d, _, fs in os.walk(path) for n in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in ([path] if path.is_dir() else []) + [path.parent]:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Net(torch.nn.Module):
    def __init__(self, nbytes: int):
        super().__init__()
        cols = 1024
        self.w = torch.nn.Linear(cols, max(1, nbytes // 4 // cols), bias=False)

    def forward(self, x):
        return self.w(x)


def _step(model: torch.nn.Module, opt) -> None:
    """One AdamW step (moments exist, weights change between saves)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()


def _ceiling(work: Path, nbytes: int) -> float:
    """The disk's durable O_DIRECT write ceiling for ``nbytes`` here (bytes/s), as gdswriter bench
    measures it."""
    from gdswriter.tools.bench import quiesce
    from gdswriter.tools.measure import disk_reference

    pattern = memoryview(torch.randint(0, 256, (4 << 20,), dtype=torch.uint8).numpy())
    quiesce()
    ref, _ = disk_reference(work / "ceiling.bin", nbytes, pattern, {})
    (work / "ceiling.bin").unlink(missing_ok=True)
    return ref.write_bps


# ----------------------------------------------------------------------------- Hugging Face
def hf_case(kind: str, root: Path, nbytes: int):
    import transformers

    from gdswriter.integrations.transformers import GDSTrainer

    args = transformers.TrainingArguments(output_dir=str(root), save_total_limit=1, report_to=[], use_cpu=True,
                                          disable_tqdm=True, max_steps=10**6)
    model = Net(nbytes)
    if kind == "Trainer":
        t = transformers.Trainer(model=model, args=args)
    else:
        t = GDSTrainer(model=model, args=args, gds_async_save=kind == "GDSTrainer async")
    t.create_optimizer_and_scheduler(num_training_steps=10**6)

    def save(i: int) -> tuple[float, float]:
        _step(model, t.optimizer)
        t.state.global_step = i
        t0 = time.perf_counter()
        t._save_checkpoint(model, None)  # what the Trainer runs at each save_steps
        blocked = time.perf_counter() - t0
        if kind == "Trainer":
            _fsync_tree(root / f"checkpoint-{i}")
        elif kind == "GDSTrainer async":
            t.gds_wait()
        return blocked, time.perf_counter() - t0

    return save


# ----------------------------------------------------------------------------- Lightning
def lightning_case(kind: str, root: Path, nbytes: int):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from gdswriter.integrations.lightning import GDSCheckpointIO

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(nbytes)

        def training_step(self, batch, _):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    plugins = [] if kind == "TorchCheckpointIO" else [GDSCheckpointIO(async_save=kind == "GDSCheckpointIO async")]
    module = Module()
    t = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, plugins=plugins)
    t.fit(module, DataLoader(TensorDataset(torch.randn(2, 1024)), batch_size=2))
    io = t.strategy.checkpoint_io
    prev: list[Path] = []

    def save(i: int) -> tuple[float, float]:
        _step(module, t.optimizers[0])
        path = root / f"step={i}.ckpt"
        t0 = time.perf_counter()
        t.save_checkpoint(path)
        blocked = time.perf_counter() - t0
        if kind == "TorchCheckpointIO":
            _fsync_tree(path)
        elif kind == "GDSCheckpointIO async":
            io.teardown()  # waits for the pending saves
        durable = time.perf_counter() - t0
        for p in prev:
            io.remove_checkpoint(p)
        prev[:] = [path]
        return blocked, durable

    return save


CASES = {"hf": (hf_case, ["Trainer", "GDSTrainer", "GDSTrainer async"]),
         "lightning": (lightning_case, ["TorchCheckpointIO", "GDSCheckpointIO", "GDSCheckpointIO async"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64M", help="weight bytes (the checkpoint is about 3x: AdamW moments)")
    ap.add_argument("--saves", type=int, default=5, help="saves per case and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=sorted(CASES), help="one integration only")
    ap.add_argument("--dir", default=str(HERE))
    ap.add_argument("--ceiling", action="store_true", help="also the disk's ceiling each round, and ratios to it")
    a = ap.parse_args()
    if a.saves < 2 or a.rounds < 1:
        raise SystemExit("--saves must be >= 2 and --rounds >= 1")
    nbytes = parse_size(a.size)
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="integration-saves-", dir=a.dir))
    results: dict[str, dict[str, list]] = {}
    ceiling: list[float] = []  # bytes/s, one per round of each group
    ckpt_bytes = 3 * (nbytes // 4 // 1024) * 4 * 1024  # the weights and two AdamW moments
    try:
        for group, (make, kinds) in CASES.items():
            if a.only and group != a.only:
                continue
            for r in range(a.rounds):
                if a.ceiling:
                    ceiling.append(_ceiling(work, ckpt_bytes))
                order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
                for kind in order:
                    root = work / f"{group}-{kind.replace(' ', '_')}-{r}"
                    save = make(kind, root, nbytes)
                    times = [save(i) for i in range(1, a.saves + 1)]
                    res = results.setdefault(kind, {"first": [], "first_durable": [], "blocked": [], "durable": [],
                                                    "ceiling": []})
                    res["first"].append(times[0][0])
                    res["first_durable"].append(times[0][1])
                    res["blocked"] += [b for b, _ in times[1:]]
                    res["durable"] += [d for _, d in times[1:]]
                    if a.ceiling:
                        res["ceiling"] += [ceiling[-1]] * (len(times) - 1)
                        res.setdefault("first_ceiling", []).append(ceiling[-1])
                    shutil.rmtree(root, ignore_errors=True)
                    del save
                    gc.collect()  # a finished case's trainer and model sit in reference cycles: free them now
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ckpt_mib = 3 * nbytes / 2**20
    print(f"integration saves: {a.size} of weights (checkpoint about {ckpt_mib:.0f} MiB with AdamW), "
          f"{a.saves} saves x {a.rounds} rounds per case, interleaved; medians (first save apart)")
    print(f"  {'case':24s} {'first blocks':>12s} {'then blocks':>12s} {'durable after':>14s}")
    for kind, res in results.items():
        print(f"  {kind:24s} {statistics.median(res['first']) * 1e3:10.1f}ms "
              f"{statistics.median(res['blocked']) * 1e3:10.1f}ms {statistics.median(res['durable']) * 1e3:12.1f}ms")
    if a.ceiling:
        med = statistics.median
        print(f"  durable GB/s against the disk's ceiling ({ckpt_bytes / 2**30:.2f} GiB checkpoints; ceiling median "
              f"{med(ceiling) / 1e9:.2f} GB/s, {min(ceiling) / 1e9:.2f}-{max(ceiling) / 1e9:.2f}), ratios per round:")
        for kind, res in results.items():
            first = [ckpt_bytes / t / c for t, c in zip(res["first_durable"], res["first_ceiling"])]
            later = [ckpt_bytes / t / c for t, c in zip(res["durable"], res["ceiling"])]
            print(f"  {kind:24s} first {ckpt_bytes / med(res['first_durable']) / 1e9:5.2f} GB/s "
                  f"({med(first):.2f}x ceiling), then {ckpt_bytes / med(res['durable']) / 1e9:5.2f} GB/s "
                  f"({med(later):.2f}x, min {min(later):.2f}x)")
    for _, kinds in CASES.values():
        base, *others = kinds
        for o in (o for o in others if base in results):
            b, d = results[o], results[base]
            print(f"  {o} vs {base}: blocks {statistics.median(b['blocked']) / statistics.median(d['blocked']):.2f}x, "
                  f"durable after {statistics.median(b['durable']) / statistics.median(d['durable']):.2f}x")


if __name__ == "__main__":
    main()
