"""Checkpoint every iteration of a training loop: how much each way of saving slows training.

A small transformer (torch.nn.TransformerEncoder, embedding and head) with AdamW, sized so
that model + optimizer state is about ``--size`` bytes, trains for ``--iters`` iterations and
saves a checkpoint after every optimizer step. The batch is chosen so that one training step
takes about as long as (at least) one durable write of the checkpoint (``--batch auto``),
the case the overlap is for: the write fits within a step. Cases:

  none                 no checkpoint (the reference)
  gdswriter live       GDSCheckpointer(snapshot="live").save_async: the engine writes from the
                       live tensors; the next optimizer step waits until they are written
  gdswriter host       GDSCheckpointer(snapshot="host").save_async: copied chunk by chunk into
                       a reusable host pool while written; the next step waits for the copy
  torch.save thread    state copied to fresh host memory (blocking), then torch.save + fsync in a
                       background thread; the next save first waits for the previous one
  dcp.async_save       torch.distributed.checkpoint.async_save, single process (no_dist), with
                       DefaultStager async staging (pinned memory and non-blocking copies on a
                       GPU), FileSystemWriter(thread_count=4, sync_files=True); the optimizer
                       step waits for the staging, the next save for the previous upload
  copy+crc only        a reference, not a way to save: a background thread copies the state's
                       bytes into a host buffer and checksums them (crc32c), as gdswriter's host
                       snapshot does, but writes nothing; the optimizer step waits for it. What
                       touching the bytes alone costs training on this machine (CPU, memory
                       bandwidth), below which no host snapshot can go
  copy+crc+write       a reference too: the same copy and checksum into a page-aligned buffer,
                       then that buffer written with O_DIRECT (16 MiB pwrites) and fsync, in the
                       same thread; the optimizer step waits for the copy, the next save for the
                       write. What the bytes and a plain durable write of them cost training,
                       with none of gdswriter's work (the floor for any durable host-mode save)

Every checkpoint is durable (fsync) and the last two are kept. For each case: mean and median
step time, the save call's own time (median; for gdswriter, save_async), the time the loop
was blocked per save (in the save call and waiting before the optimizer step; for gdswriter,
SaveHandle.stats.blocked_s, which counts both), the write's own time (median, from its start
to durable; gdswriter and torch.save: a write longer than the step means the write did not fit
within it, and the next save waited for it), and the overhead of the mean step time
against "none". On a GPU the step time is taken after the training stream
(not the whole device) is synchronized, so copies on side streams are not counted unless
the training stream waited for them.

    python benchmarks/training_loop.py --device cpu --size 64M --iters 20
    python benchmarks/training_loop.py --device cuda --size 1G --iters 30 --dir /nvme/bench
"""

from __future__ import annotations

import argparse
import ctypes
import math
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdswriter import CheckpointOptions, EngineOptions, GDSCheckpointer
from gdswriter.engines.staged import FUSED_BYTES
from gdswriter.units import parse_size

# DCP says this on every single-process save (also from its upload thread)
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint")

CASES = ("none", "gdswriter live", "gdswriter host", "torch.save thread", "dcp.async_save", "copy+crc only",
         "copy+crc+write")
VOCAB, SEQ, HEADS = 4096, 128, 8
WARMUP = 2


# ----------------------------------------------------------------------------- model
class Transformer(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, HEADS, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tokens)))


def plan_model(state_bytes: int) -> tuple[int, int]:
    """(dim, layers) so that params x 12 bytes (fp32 weights + AdamW's two moments) ~= state_bytes."""
    params = state_bytes / 12
    dim = max(64, int(math.sqrt(params / 96)) // 64 * 64)  # about 8 layers of 12 dim^2 each
    layers = max(1, round((params - 2 * VOCAB * dim) / (12 * dim * dim)))
    return dim, layers


def build(state_bytes: int, device: str, seed: int = 0):
    torch.manual_seed(seed)
    dim, layers = plan_model(state_bytes)
    model = Transformer(dim, layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def state_nbytes(model, opt) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return n + sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))


def train_step(model, opt, batch: int, device: str, before_step=lambda: 0.0) -> float:
    """One forward/backward/optimizer step; returns the time ``before_step`` blocked."""
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    blocked = before_step()
    opt.step()
    return blocked


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.current_stream().synchronize()  # the training stream only, not the side streams


# ----------------------------------------------------------------------------- savers
class Saver:
    """One way of checkpointing. ``before_step`` and ``save`` return the seconds they blocked."""

    def __init__(self, root: Path, model, opt, device: str):
        self.root, self.model, self.opt, self.device = root, model, opt, device
        self.write_s: list[float] = []  # per save, where the saver can tell: from the write's start to durable

    def before_step(self) -> float:
        return 0.0

    def save(self, it: int) -> float:
        return 0.0

    def drain(self) -> None:
        """Wait (untimed) until no save is outstanding."""

    def close(self) -> list[float] | None:
        """Drain and release; may return the per-save blocked times it measured itself."""
        return None


class GdsSaver(Saver):
    def __init__(self, root, model, opt, device, mode: str):
        super().__init__(root, model, opt, device)
        self.ck = GDSCheckpointer(model, opt, root, options=CheckpointOptions(
            snapshot=mode, keep_last=2, engine=EngineOptions.from_env()))
        self.handles = []

    def save(self, it: int) -> float:
        self.handles.append(self.ck.save_async(it))
        return 0.0  # counted by the handle (save_async and the optimizer step pre-hook)

    def drain(self) -> None:
        self.ck.wait()

    def close(self) -> list[float]:
        self.ck.close()
        self.write_s = [h.stats.write_s for h in self.handles if h.stats is not None]
        return [h.stats.blocked_s for h in self.handles if h.stats is not None]


def _host_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _host_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return obj


class TorchSaveThread(Saver):
    def __init__(self, root, model, opt, device):
        super().__init__(root, model, opt, device)
        root.mkdir(parents=True, exist_ok=True)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="torch-save")
        self.pending: Future | None = None

    def _write(self, state: dict, path: Path) -> None:
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        self.write_s.append(time.perf_counter() - t)

    def save(self, it: int) -> float:
        t = time.perf_counter()
        if self.pending is not None:
            self.pending.result()
        state = _host_copy({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()})
        self.pending = self.pool.submit(self._write, state, self.root / f"state-{it % 2}.pt")
        return time.perf_counter() - t

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()

    def close(self) -> None:
        self.drain()
        self.pool.shutdown()


class DcpSaver(Saver):
    def __init__(self, root, model, opt, device):
        super().__init__(root, model, opt, device)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        gpu = device == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=gpu))
        self.upload: Future | None = None
        self.staging: Future | None = None

    def before_step(self) -> float:
        t = time.perf_counter()
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        return time.perf_counter() - t

    def save(self, it: int) -> float:
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        if self.upload is not None:
            self.upload.result()
        writer = dcp.FileSystemWriter(self.root / f"dcp-{it % 2}", thread_count=4, sync_files=True, overwrite=True)
        resp = dcp.async_save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()},
                                  storage_writer=writer, async_stager=self.stager, no_dist=True)
        if hasattr(resp, "staging_completion"):
            self.staging, self.upload = resp.staging_completion, resp.upload_completion
        else:
            self.upload = resp
        return time.perf_counter() - t

    def drain(self) -> None:
        self.before_step()
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        self.drain()
        self.stager.close()


class CopyAndChecksum(Saver):
    """Copy and checksum the state's bytes in a background thread, into a buffer allocated
    once, in the pieces gdswriter's copier uses (host memory: memmove then crc32c of each
    cache-sized piece; GPU memory: one device-to-host copy per tensor, then crc32c)."""

    def __init__(self, root, model, opt, device):
        super().__init__(root, model, opt, device)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="copy-crc")
        self.pending: Future | None = None
        self.buf: torch.Tensor | None = None

    def _tensors(self) -> list[torch.Tensor]:
        state = [*self.model.state_dict().values()]
        state += [v for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return [t.detach().reshape(-1).view(torch.uint8) for t in state if t.numel()]

    def _run(self, tensors: list[torch.Tensor]) -> None:
        self._copy(tensors)

    def _copy(self, tensors: list[torch.Tensor]) -> None:
        at, view = 0, memoryview(self.buf.numpy())
        for t in tensors:
            n = t.numel()
            if t.is_cpu:
                for k in range(0, n, FUSED_BYTES):
                    m = min(FUSED_BYTES, n - k)
                    ctypes.memmove(self.buf.data_ptr() + at + k, t.data_ptr() + k, m)
                    crc32c.crc32c(view[at + k:at + k + m])
            else:
                self.buf[at:at + n].copy_(t)
                crc32c.crc32c(view[at:at + n])
            at += n

    def before_step(self) -> float:
        t = time.perf_counter()
        self._wait_for_copy()
        return time.perf_counter() - t

    def _wait_for_copy(self) -> None:
        self.drain()

    def _new_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    def _starting(self, it: int) -> None:
        """Called in save before the background work is queued."""

    def save(self, it: int) -> float:
        t = time.perf_counter()
        self.drain()
        tensors = self._tensors()
        if self.buf is None:
            self.buf = self._new_buffer(sum(x.numel() for x in tensors))
        self._starting(it)
        self.pending = self.pool.submit(self._run, tensors)
        return time.perf_counter() - t

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.drain()
        self.pool.shutdown()


class CopyChecksumAndWrite(CopyAndChecksum):
    """CopyAndChecksum, then the buffer written with O_DIRECT and fsync (two files in turn),
    in the same background thread. The optimizer step waits only for the copy."""

    PIECE = 16 << 20

    def __init__(self, root, model, opt, device):
        super().__init__(root, model, opt, device)
        self.copied = threading.Event()
        self.copied.set()
        self.mem: mmap.mmap | None = None
        self.saves = 0
        root.mkdir(parents=True, exist_ok=True)

    def _run(self, tensors: list[torch.Tensor]) -> None:
        try:
            self._copy(tensors)
        finally:
            self.copied.set()
        t = time.perf_counter()
        size = -(-self.buf.numel() // 4096) * 4096
        path, flags = self.root / f"state-{self.saves % 2}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError:  # a file system without O_DIRECT (tmpfs): buffered, then fsync
            fd = os.open(path, flags, 0o644)
        try:
            view = memoryview(self.mem)
            for off in range(0, size, self.PIECE):
                piece = view[off:min(size, off + self.PIECE)]
                if os.pwrite(fd, piece, off) != len(piece):
                    raise OSError(f"short write at {off}")
            os.fsync(fd)
        finally:
            os.close(fd)
        self.write_s.append(time.perf_counter() - t)

    def _wait_for_copy(self) -> None:
        self.copied.wait()

    def _new_buffer(self, n: int) -> torch.Tensor:
        self.mem = mmap.mmap(-1, -(-n // 4096) * 4096)  # page-aligned, as O_DIRECT needs
        return torch.frombuffer(self.mem, dtype=torch.uint8)[:n]

    def _starting(self, it: int) -> None:
        self.saves = it
        self.copied.clear()


def make_saver(case: str, root: Path, model, opt, device: str) -> Saver:
    if case == "none":
        return Saver(root, model, opt, device)
    if case.startswith("gdswriter"):
        return GdsSaver(root, model, opt, device, case.split()[1])
    if case == "torch.save thread":
        return TorchSaveThread(root, model, opt, device)
    if case == "dcp.async_save":
        return DcpSaver(root, model, opt, device)
    if case == "copy+crc only":
        return CopyAndChecksum(root, model, opt, device)
    if case == "copy+crc+write":
        return CopyChecksumAndWrite(root, model, opt, device)
    raise ValueError(f"unknown case {case!r}: choose from {', '.join(CASES)}")


# ----------------------------------------------------------------------------- the loop
@dataclass
class LoopResult:
    case: str
    step_s: list[float]
    blocked_s: list[float] = field(default_factory=list)  # per save: in the save call + before the step
    call_s: list[float] = field(default_factory=list)  # per save: the save call alone
    write_s: list[float] = field(default_factory=list)  # per save: its write, start to durable (where known)

    @property
    def mean_step(self) -> float:
        return statistics.fmean(self.step_s)

    @property
    def blocked_per_save(self) -> float:
        return statistics.fmean(self.blocked_s) if self.blocked_s else 0.0


def run_cases(cases: list[str], base: Path, model, opt, batch: int, iters: int, device: str,
              rounds: int = 1) -> list[LoopResult]:
    """``iters`` timed iterations per case, each saving after its optimizer step. The cases take
    turns in ``rounds`` segments (rotating their order), so that a machine whose speed drifts
    favours none of them; between segments each case's outstanding saves are finished,
    untimed. The first segment of each case starts with WARMUP untimed iterations."""
    savers = {c: make_saver(c, base / c.replace(" ", "-"), model, opt, device) for c in cases}
    results = {c: LoopResult(c, []) for c in cases}
    per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    try:
        for r, n in enumerate(per_round):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                saver, res = savers[case], results[case]
                for it in range(n + (WARMUP if r == 0 else 0)):
                    t = time.perf_counter()
                    b = train_step(model, opt, batch, device, saver.before_step)
                    c = time.perf_counter()
                    b += saver.save(len(res.step_s))
                    c = time.perf_counter() - c
                    sync(device)
                    if r > 0 or it >= WARMUP:
                        res.step_s.append(time.perf_counter() - t)
                        res.blocked_s.append(b)
                        res.call_s.append(c)
                saver.drain()
    finally:
        for case, saver in savers.items():
            measured = saver.close()
            if measured is not None:  # the saver counted its own blocked time, per save (warm-up first)
                results[case].blocked_s = measured[WARMUP:]
            results[case].write_s = saver.write_s[WARMUP:]
    for r in results.values():
        if r.case == "none":
            r.blocked_s, r.call_s = [], []
    return [results[c] for c in cases]


def write_seconds(root: Path, model, opt) -> float:
    """One durable gdswriter save of the state, blocking (the fastest of two)."""
    with GDSCheckpointer(model, opt, root, options=CheckpointOptions(snapshot="live", keep_last=1,
                                                                     engine=EngineOptions.from_env())) as ck:
        times = []
        for s in range(2):
            t = time.perf_counter()
            ck.save(s)
            times.append(time.perf_counter() - t)
    shutil.rmtree(root, ignore_errors=True)
    return min(times)


def calibrate(root: Path, model, opt, device: str, max_batch: int = 1024) -> tuple[int, float, float]:
    """The smallest batch whose training step takes at least one checkpoint write: (batch,
    write s, step s at the largest batch timed). At most ``max_batch`` sequences (GPU memory)."""
    for _ in range(WARMUP):
        train_step(model, opt, 2, device)
    sync(device)
    w = write_seconds(root, model, opt)
    batch, step = 2, 0.0
    while True:  # grow until a step is long enough to time, then scale linearly
        times = []
        for _ in range(3):
            t = time.perf_counter()
            train_step(model, opt, batch, device)
            sync(device)
            times.append(time.perf_counter() - t)
        step = statistics.median(times)
        if step > w / 4 or batch >= max_batch:
            break
        batch = min(max_batch, batch * 4)
    return max(1, min(max_batch, math.ceil(batch * w / step))), w, step  # a step at least as long as a write


def table(results: list[LoopResult]) -> str:
    base = next((r.mean_step for r in results if r.case == "none"), None)
    lines = ["| case | step ms (mean) | step ms (median) | save call ms (median) | blocked ms / save (mean) "
             "| write ms (median) | overhead vs none (mean step) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        saving = r.case != "none"
        over = f"{(r.mean_step / base - 1) * 100:+.1f}%" if base and saving else ""
        call = f"{statistics.median(r.call_s) * 1e3:.1f}" if saving and r.call_s else ""
        blocked = f"{r.blocked_per_save * 1e3:.1f}" if saving else ""
        write = f"{statistics.median(r.write_s) * 1e3:.0f}" if saving and r.write_s else ""
        lines.append(f"| {r.case} | {r.mean_step * 1e3:.1f} | {statistics.median(r.step_s) * 1e3:.1f} | {call} | "
                     f"{blocked} | {write} | {over} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", default="64M", help="model + AdamW state, e.g. 64M, 512M, 1G")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per case")
    ap.add_argument("--rounds", type=int, default=4, help="segments the cases take turns in (drift fairness)")
    ap.add_argument("--batch", default="auto", help="sequences per step, or 'auto': one step ~ one checkpoint write")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    ap.add_argument("--dir", default=None, help="where checkpoints go (a directory on the disk under test)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for training (default: torch's; on a small CPU box leave a core "
                         "for the background saves)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}: choose from {', '.join(CASES)}")
    base = Path(tempfile.mkdtemp(prefix="training-loop-", dir=args.dir))
    try:
        model, opt = build(parse_size(args.size), args.device)
        if args.batch == "auto":
            batch, w, s = calibrate(base / "calibrate", model, opt, args.device)
            print(f"calibration: one durable write {w * 1e3:.0f} ms; batch {batch} (a step at a smaller batch took "
                  f"{s * 1e3:.0f} ms)", flush=True)
        else:
            batch = int(args.batch)
        dim, layers = plan_model(parse_size(args.size))
        print(f"device {args.device}, state {state_nbytes(model, opt) / 2**20:.0f} MiB (dim {dim}, {layers} layers, "
              f"AdamW), batch {batch} x {SEQ} tokens, {args.iters} iterations per case in {args.rounds} rounds, a "
              f"checkpoint after each; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        if args.device == "cpu":
            aligned = next(model.parameters()).data_ptr() % 4096 == 0
            print(f"large CPU tensors page-aligned: {'yes' if aligned else 'no'} (THP_MEM_ALLOC_ENABLE="
                  f"{os.environ.get('THP_MEM_ALLOC_ENABLE', '')!s}; live mode writes page-aligned tensors "
                  f"zero-copy)", flush=True)
        results = run_cases(cases, base, model, opt, batch, args.iters, args.device, max(1, min(args.rounds, args.iters)))
        print(table(results))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
