"""Checkpoint save and load methods compared on one node's disk (``gdswriter bench``, and the
scripts in benchmarks/).

Every method saves and loads the same state: a stack of ``nn.Linear`` layers plus AdamW
state after one step (params + exp_avg + exp_avg_sq ~= size). Methods:

=============  ====================================================  ===========================================
method         save (timed; ends durable)                            load (timed; cold: files evicted first)
=============  ====================================================  ===========================================
gdswriter      ``GDSCheckpointer.save`` (durable and committed)       ``GDSCheckpointer.load`` into the live state
torch          ``torch.save`` + flush + fsync                         ``torch.load(weights_only=True)`` + load_state_dict
dcp            ``torch.distributed.checkpoint.save``, FileSystem-     ``dcp.load`` in place + optimizer load_state_dict
               Writer(thread_count=4, sync_files=True)
safetensors    ``save_file`` (optimizer state flattened) + fsync      ``load_file`` + copy into the live tensors
deepspeed      ``torch.save`` into DeepSpeed's FastPersist writer     ``torch.load`` (FastPersist only writes)
               (``deepspeed.io.FastFileWriter``, libaio) + fsync
ceiling        the disk itself, same bytes: fio when installed, else gdswriter's built-in multi-queue O_DIRECT
               loop (gdswriter.tools.measure)
=============  ====================================================  ===========================================

gdswriter's row is its steady state: the bench's checkpointer saves once before the rounds.
The first save of a fresh checkpointer is measured apart, in every round right after the
steady one (``gdswriter (first save)``: a new ``GDSCheckpointer`` constructed and saved at
once, so whatever it sets up on the first save is timed), since that is the save users meet
first.

Rounds are interleaved (each round runs every method's save and then its cold load, in an
order rotated from round to round) so that a disk whose speed drifts treats all alike;
ratios are medians of per-round ratios. Every load is checked: two tensors are spoiled
before it and must be back afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import platform
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import torch

from ..errors import InvalidOptionError, LoadCheckError
from ..fs import fsync_file
from .measure import (FIO_NAME, Reference, builtin_reference, disk_reference, evict_paths, fio_reference,
                      mem_available, mount_of)
from ..units import GiB, KiB, MiB, human

METHODS = ("gdswriter", "torch", "dcp", "safetensors", "deepspeed")
COMPARABLE = METHODS[1:]
CEILING = "ceiling"
SAVE_NAMES = {"torch": "torch.save", "dcp1": "dcp.save t1", "dcp4": "dcp.save t4", "dcp": "dcp.save t4",
              "safetensors": "safetensors.save_file", "gdswriter": "gdswriter.save",
              "deepspeed": "deepspeed FastPersist"}
LOAD_NAMES = {"torch": "torch.load", "dcp": "dcp.load", "dcp4": "dcp.load", "safetensors": "safetensors.load_file",
              "gdswriter": "gdswriter.load", "deepspeed": "torch.load"}
SAVE_CASE = {"dcp": "dcp4"}  # the bench's "dcp" saves with 4 threads


# ----------------------------------------------------------------------------- the state every method stores
def plan_layers(total: int) -> tuple[int, int]:
    """(dim, n_layers) of square Linear layers so that 3 x params (fp32) ~= total bytes."""
    param_bytes = total / 3
    layer_bytes = min(64 * MiB, max(param_bytes / 4, 64 * KiB))
    dim = max(64, int(math.sqrt(layer_bytes / 4)) // 64 * 64)
    n = max(1, round(param_bytes / (dim * dim * 4)))
    return dim, n


def build_state(total: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW optimizer that has stepped once: about ``total`` bytes of tensors."""
    torch.manual_seed(0)
    dim, n = plan_layers(total)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.empty_like(p).uniform_(-1, 1)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model, opt) -> int:
    """Tensor bytes of model.state_dict() + optimizer state: what every method stores."""
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def collect(model, opt) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def safetensors_view(model, opt) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One flat name -> tensor dict for safetensors, param_groups as JSON metadata."""
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optimizer.state.{pid}.{k}"] = v
    return flat, {"param_groups": json.dumps(osd["param_groups"])}


class Canary:
    """Two tensors (the first weight, the last exp_avg_sq) remembered at the start; ``spoil``
    overwrites them before a load and ``check`` asserts the load brought them back."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.saved = [t.clone() for t in self._live()]

    def _live(self) -> list[torch.Tensor]:
        first = next(iter(self.model.parameters()))
        last = list(self.model.parameters())[-2]
        return [first.detach(), self.opt.state[last]["exp_avg_sq"]]

    def spoil(self) -> None:
        with torch.no_grad():
            for t in self._live():
                t.fill_(-1.0)

    def check(self, what: str) -> None:
        for live, want in zip(self._live(), self.saved):
            if not torch.equal(live, want):
                raise LoadCheckError(f"{what} did not restore the saved state (a spoiled tensor stayed spoiled): "
                                     f"its figures would be meaningless")


# ----------------------------------------------------------------------------- file chores
def remove(*paths: str | os.PathLike) -> None:
    """Delete files and directory trees; missing ones are fine."""
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def quiesce() -> None:
    """Flush everyone's dirty pages before a timed write, so foreign writeback does not land in it."""
    os.sync()


def settle(seconds: float) -> None:
    """Sync, then wait ``seconds``: a virtual disk may still be flushing the write that just
    finished on the host side, and a read started at once pays for it."""
    quiesce()
    if seconds:
        time.sleep(seconds)


# ----------------------------------------------------------------------------- methods
def _fastpersist_on_cpu() -> None:
    """What FastPersist needs on a machine without an accelerator (docs/benchmarks: DeepSpeed's
    CPU accelerator has no build of the small "utils" op FastFileWriter loads, so it takes
    DeepSpeed's generic build of the same source; pinned buffers through torch, not the CPU
    accelerator's shared-memory allocator). Nothing else of DeepSpeed's path changes."""
    import deepspeed.io.fast_file_writer as fast_file_writer
    from deepspeed.ops.op_builder.utils import UtilsBuilder

    os.environ.setdefault("DS_PIN_MEMORY_BACKEND", "native")
    fast_file_writer.UtilsBuilder = UtilsBuilder


def deepspeed_missing() -> str | None:
    """Why DeepSpeed's FastPersist writer cannot run here, or None when it can."""
    chatter = io.StringIO()  # DeepSpeed logs to stdout as it imports and probes: not into bench's output
    try:
        with contextlib.redirect_stdout(chatter):
            from deepspeed.io import FastFileWriter, FastFileWriterConfig  # noqa: F401
            from deepspeed.ops.op_builder import AsyncIOBuilder

            compatible = AsyncIOBuilder().is_compatible()
    except ImportError as e:
        return f"DeepSpeed is not installed (pip install deepspeed to compare its FastPersist writer): {e}"
    except Exception as e:  # noqa: BLE001 - DeepSpeed's import probes accelerators and can fail many ways
        return f"DeepSpeed does not import here: {' '.join(str(e).split())[:200]}"
    if not compatible:
        return "DeepSpeed's async_io op cannot build here (it needs libaio: apt-get install libaio-dev)"
    return None


def missing(method: str) -> str | None:
    """Why ``method`` cannot run here (a package is absent), or None."""
    if method == "dcp" and not torch.distributed.is_available():
        return "this torch build has no torch.distributed (DCP needs it)"
    if method == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            return "safetensors is not installed (pip install safetensors)"
    if method == "deepspeed":
        return deepspeed_missing()
    return None


def torch_save_durable(obj: Any, path: Path) -> None:
    """``torch.save`` into a file, then flush and fsync it (the torch method's save)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def dcp_save(obj: Any, path: Path, *, threads: int = 4) -> None:
    """``torch.distributed.checkpoint.save`` of ``obj`` (one process, no process group) with
    FileSystemWriter(thread_count=threads, sync_files=True)."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(obj, storage_writer=writer)


def dcp_load(obj: Any, path: Path) -> None:
    """``torch.distributed.checkpoint.load`` into ``obj`` in place (one process)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(obj, storage_reader=dcp.FileSystemReader(path))


class FastPersist:
    """DeepSpeed's FastPersist writer as its fast checkpoint engine drives it (FastCheckpointEngine:
    ``torch.save`` into a ``FastFileWriter`` over the ``async_io`` op: libaio, O_DIRECT, a pinned
    double buffer), then fsync. The libaio handle and the pinned buffer are made on the first
    save and reused, as the engine's writer factory does. CUDA tensors go through torch.save's
    own device-to-host copies, as in DeepSpeed. Needs DeepSpeed (``deepspeed_missing``)."""

    def __init__(self) -> None:
        self._buffers: tuple[Any, torch.Tensor] | None = None

    def save(self, obj: Any, path: Path) -> None:
        from deepspeed.io import FastFileWriter, FastFileWriterConfig

        handle, pinned = self.buffers()
        config = FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=pinned, double_buffer=True,
                                      num_parallel_writers=1, writer_rank=0)
        writer = FastFileWriter(file_path=str(path), config=config)
        try:
            torch.save(obj, writer)
        finally:
            writer.close()
        fsync_file(path)

    def buffers(self) -> tuple[Any, torch.Tensor]:
        """The libaio handle and the pinned I/O buffer (made once; the first call JIT-builds the
        async_io op if it is not built yet, about a minute here)."""
        if self._buffers is None:
            from deepspeed.accelerator import get_accelerator
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if get_accelerator().device_name() == "cpu":
                _fastpersist_on_cpu()

            # block size, queue depth, single submit, overlap events, intra-op parallelism
            handle = AsyncIOBuilder().load(verbose=False).aio_handle(8 * MiB, 8, False, False, 1)
            pinned = get_accelerator().pin_memory(torch.zeros(64 * MiB, dtype=torch.uint8))
            self._buffers = (handle, pinned)
        return self._buffers


class Methods:
    """How each method saves and loads the state, and where its files are. Case names:
    torch, dcp1 / dcp4 (DCP with 1 / 4 writer threads; loads as "dcp"), safetensors,
    gdswriter, deepspeed."""

    def __init__(self, workdir: Path, model, opt, gds):
        self.dir, self.model, self.opt, self.gds = Path(workdir), model, opt, gds
        self.step = 0
        self.fastpersist = FastPersist()

    def path(self, case: str) -> Path:
        return {"torch": self.dir / "state.pt", "dcp1": self.dir / "dcp", "dcp4": self.dir / "dcp",
                "dcp": self.dir / "dcp", "safetensors": self.dir / "state.safetensors",
                "gdswriter": self.dir / "gdswriter", "deepspeed": self.dir / "fastpersist.pt"}[case]

    def clear(self, case: str) -> None:
        if case == "gdswriter":
            for s in self.gds.steps():
                self.gds.protocol.delete_step(s)
        else:
            remove(self.path(case))

    def exists(self, case: str) -> bool:
        if case == "gdswriter":
            return bool(self.gds.steps())
        return self.path(case).exists()

    def files(self, case: str) -> list[Path]:
        return [self.path(case)]

    def save(self, case: str) -> None:
        m, o, p = self.model, self.opt, self.path(case)
        if case == "torch":
            torch_save_durable(collect(m, o), p)
        elif case in ("dcp1", "dcp4", "dcp"):
            dcp_save(collect(m, o), p, threads=1 if case == "dcp1" else 4)
        elif case == "safetensors":
            from safetensors.torch import save_file

            flat, meta = safetensors_view(m, o)
            save_file(flat, p, metadata=meta)
            fsync_file(p)
        elif case == "gdswriter":
            self.step += 1
            self.gds.save(self.step)
        elif case == "deepspeed":
            self.fastpersist.save(collect(m, o), p)
        else:
            raise ValueError(case)

    def load(self, case: str) -> None:
        m, o, p = self.model, self.opt, self.path(case)
        if case in ("torch", "deepspeed"):
            state = torch.load(p, weights_only=True, mmap=False)
            m.load_state_dict(state["model"])
            o.load_state_dict(state["optimizer"])
        elif case in ("dcp", "dcp4", "dcp1"):
            sd = collect(m, o)
            dcp_load(sd, p)
            o.load_state_dict(sd["optimizer"])  # model tensors were filled in place
        elif case == "safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            flat = load_file(p)
            with safe_open(p, framework="pt") as f:
                groups = json.loads(f.metadata()["param_groups"])
            m.load_state_dict({k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")})
            params = [q for g in o.param_groups for q in g["params"]]
            with torch.no_grad():
                for pid, q in enumerate(params):
                    for k, live in o.state[q].items():
                        live.copy_(flat[f"optimizer.state.{pid}.{k}"])
            for g, saved in zip(o.param_groups, groups):
                g.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
            del flat
        elif case == "gdswriter":
            self.gds.load(self.step)
        else:
            raise ValueError(case)


# ----------------------------------------------------------------------------- options and results
@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What ``run_bench`` measures.

    directory: where the files go (on the disk under test). size: bytes of state (params +
    optimizer). rounds: interleaved rounds. compare: methods besides gdswriter (COMPARABLE).
    settle: seconds to wait (after a sync) before each cold load. use_fio: measure the ceiling
    with fio when installed (else, or when False, the built-in reference)."""

    directory: Path
    size: int = 2 * GiB
    rounds: int = 3
    compare: tuple[str, ...] = ("torch", "dcp", "safetensors", "deepspeed")
    settle: float = 1.0
    use_fio: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 64 * KiB:
            raise InvalidOptionError(f"size={self.size!r} must be at least 64 KiB")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise InvalidOptionError(f"rounds={self.rounds!r} must be an integer >= 1")
        unknown = [m for m in self.compare if m not in COMPARABLE]
        if unknown:
            raise InvalidOptionError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(COMPARABLE)}")
        if not (self.settle >= 0):
            raise InvalidOptionError(f"settle={self.settle!r} must be >= 0 seconds")


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))


@dataclass(frozen=True)
class BenchResult:
    """GB/s per round for each method (and the ceiling), with what was measured where."""

    bytes: int
    rounds: int
    directory: str
    filesystem: str
    ceiling: str              # the reference's name
    ceiling_why: str          # why that reference (fio installed or not)
    save: dict[str, list[float]]  # method -> GB/s per round (CEILING: the disk's durable write)
    load: dict[str, list[float]]  # method -> GB/s per round (CEILING: the disk's cold read)
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it did not run
    host: dict[str, Any] = field(default_factory=dict)
    engine: str = ""
    date: str = ""
    first_save: list[float] = field(default_factory=list)  # GB/s per round of a fresh checkpointer's first save
    written: dict[str, int] = field(default_factory=dict)  # method -> bytes one save left on disk (its files)

    def first_ratio(self, ref: str) -> float | None:
        """Median over rounds of the first save's GB/s over ``ref``'s save GB/s."""
        theirs = self.save.get(ref)
        if not self.first_save or not theirs:
            return None
        return statistics.median(a / b for a, b in zip(self.first_save, theirs))

    @property
    def methods(self) -> list[str]:
        return [m for m in (CEILING, *METHODS) if m in self.save]

    def ratio(self, method: str, kind: str, ref: str) -> float | None:
        """Median over rounds of method/ref GB/s for ``kind`` ("save" or "load")."""
        runs = self.save if kind == "save" else self.load
        mine, theirs = runs.get(method), runs.get(ref)
        if not mine or not theirs:
            return None
        return statistics.median(a / b for a, b in zip(mine, theirs))

    def spread(self, method: str, kind: str) -> Spread:
        return Spread.of((self.save if kind == "save" else self.load)[method])

    def label(self, method: str, kind: str) -> str:
        if method == CEILING:
            return "disk ceiling"
        return (SAVE_NAMES if kind == "save" else LOAD_NAMES)[method]

    def to_json(self) -> dict:
        methods = {}
        for m in self.methods:
            entry: dict[str, Any] = {}
            for kind in ("save", "load"):
                s = self.spread(m, kind)
                entry[kind] = {"name": self.label(m, kind), "gbps": (self.save if kind == "save" else self.load)[m],
                               "median": s.median, "min": s.min, "max": s.max,
                               "x_ceiling": self.ratio(m, kind, CEILING), "x_torch": self.ratio(m, kind, "torch")}
            if m in self.written:
                entry["written_bytes"] = self.written[m]
            methods[m] = entry
        from .._version import __version__

        return {"gdswriter": __version__, "date": self.date, "host": self.host, "directory": self.directory,
                "filesystem": self.filesystem, "bytes": self.bytes, "rounds": self.rounds,
                "ceiling": {"name": self.ceiling, "why": self.ceiling_why}, "engine": self.engine,
                "methods": methods, "skipped": self.skipped, "first_save": self._first_json()}

    def _first_json(self) -> dict | None:
        if not self.first_save:
            return None
        s = Spread.of(self.first_save)
        return {"name": "gdswriter.save, first of a fresh checkpointer", "gbps": self.first_save,
                "median": s.median, "min": s.min, "max": s.max, "x_ceiling": self.first_ratio(CEILING),
                "x_torch": self.first_ratio("torch"), "x_steady": self.first_ratio("gdswriter")}

    def table(self) -> list[str]:
        """The text table: method, save and load GB/s (median, min-max), ratios to the ceiling and torch."""
        x = _times
        rows = [["method", "save GB/s (min-max)", "load GB/s (min-max)", "save/ceiling", "load/ceiling",
                 "save/torch", "load/torch"]]
        for m in self.methods:
            cells = [m if m != CEILING else f"ceiling ({'fio' if self.ceiling == FIO_NAME else 'built-in'})"]
            for kind in ("save", "load"):
                s = self.spread(m, kind)
                cells.append(f"{s.median:.2f} ({s.min:.2f}-{s.max:.2f})")
            cells += [x(self.ratio(m, "save", CEILING)), x(self.ratio(m, "load", CEILING)),
                      x(self.ratio(m, "save", "torch")), x(self.ratio(m, "load", "torch"))]
            rows.append(cells)
            if m == "gdswriter" and self.first_save:
                s = Spread.of(self.first_save)
                rows.append(["gdswriter (first save)", f"{s.median:.2f} ({s.min:.2f}-{s.max:.2f})", "-",
                             x(self.first_ratio(CEILING)), "-", x(self.first_ratio("torch")), "-"])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return ["  " + "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
                for r in rows]

    def markdown(self) -> list[str]:
        """The table as Markdown, for a README: the same columns as ``table``."""
        x = _times
        lines = ["| method | save GB/s (min-max) | load GB/s (min-max) | save / ceiling | load / ceiling | "
                 "save / torch.save | load / torch.load |", "|---|---:|---:|---:|---:|---:|---:|"]
        for m in self.methods:
            name = (f"disk ceiling ({'fio' if self.ceiling == FIO_NAME else 'built-in'})" if m == CEILING
                    else f"{self.label(m, 'save')} / {self.label(m, 'load')}")
            cells = [name] + [f"{s.median:.2f} ({s.min:.2f}-{s.max:.2f})" for s in
                              (self.spread(m, "save"), self.spread(m, "load"))]
            cells += [x(self.ratio(m, k, r)) for r in (CEILING, "torch") for k in ("save", "load")]
            lines.append("| " + " | ".join(cells) + " |")
            if m == "gdswriter" and self.first_save:
                s = Spread.of(self.first_save)
                lines.append(f"| gdswriter.save, first of a fresh checkpointer | {s.median:.2f} ({s.min:.2f}-{s.max:.2f}) "
                             f"| - | {x(self.first_ratio(CEILING))} | - | {x(self.first_ratio('torch'))} | - |")
        return lines

    def header(self) -> list[str]:
        lines = [f"gdswriter bench: {self.bytes / 1e9:.2f} GB of model + AdamW state, {self.rounds} interleaved "
                 f"round{'s' if self.rounds != 1 else ''}, in {self.directory} ({self.filesystem})",
                 f"  host: {describe(self.host)}; engine {self.engine}; {self.date}",
                 f"  ceiling: {self.ceiling} ({self.ceiling_why}), measured in the same rounds",
                 "  GB/s = 1e9 bytes/s; saves end durable (fsync), loads start cold (evicted); ratios are medians "
                 "of per-round ratios"]
        if self.first_save:
            lines.append("  gdswriter: its steady state (a checkpointer that saved before); 'first save': a fresh "
                         "checkpointer's first save, constructed and saved at once")
        if self.written:
            lines.append("  bytes one save writes (its files on disk): " +
                         ", ".join(f"{m} {human(n)}" for m, n in self.written.items()))
        lines += [f"  skipped {m}: {why}" for m, why in self.skipped.items()]
        above = [f"{m} {k} {r:.2f}x" for m in self.methods if m != CEILING for k in ("save", "load")
                 if (r := self.ratio(m, k, CEILING)) is not None and r > 1.1]
        if above:
            lines.append(f"  note: above the ceiling ({', '.join(above)}): the disk drifted between rounds, or at this "
                         f"size the reference's start-up weighs; a larger --size and more --rounds even it out")
        return lines


def _times(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


# ----------------------------------------------------------------------------- the host
def host_info() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, RAM, kernel, GPU (if any), torch."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * KiB
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "ram_bytes": ram,
            "kernel": platform.release(), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version()}


def describe(host: dict) -> str:
    ram = f", {human(host['ram_bytes'])} RAM" if host.get("ram_bytes") else ""
    gpu = f", {host['gpu']}" if host.get("gpu") else ", no GPU"
    return f"{host.get('cpu')} ({host.get('cores')} cores{ram}{gpu}), Linux {host.get('kernel')}, torch {host.get('torch')}"


# ----------------------------------------------------------------------------- the run
Step = Callable[[str], None]


def run_bench(opts: BenchOptions, *, step: Step | None = None) -> BenchResult:
    """Measure every method of ``opts`` and the disk's ceiling, interleaved round by round.
    ``step(note)`` is called after each timed operation (progress). Everything written is
    removed afterwards. InvalidOptionError when disk or memory cannot hold the run."""
    from ..checkpointer import GDSCheckpointer
    from ..options import CheckpointOptions

    directory = Path(opts.directory)
    directory.mkdir(parents=True, exist_ok=True)
    _check_room(directory, opts.size)
    skipped = {m: why for m in opts.compare if (why := missing(m))}
    methods = ["gdswriter", *[m for m in opts.compare if m not in skipped and m != "gdswriter"]]
    model, opt = build_state(opts.size)
    work = Path(tempfile.mkdtemp(prefix=".gdswriter-bench-", dir=directory))
    order = [CEILING, *methods]
    try:
        run = _Rounds(opts, model, opt, work, order, step or (lambda note: None))
        with GDSCheckpointer(model, opt, root=work / "gdswriter", options=CheckpointOptions()) as gds:
            engine = gds.engine_info.name  # creates the engines outside the timed rounds
            cases = Methods(work, model, opt, gds)
            cases.save("gdswriter")  # the steady state: gdswriter's row is not its first save (measured apart)
            cases.clear("gdswriter")
            for r in range(opts.rounds):
                shift = r % len(order)
                for m in order[shift:] + order[:shift]:
                    where = f"round {r + 1}/{opts.rounds}: {m}"
                    if m == CEILING:
                        run.ceiling_round(where)
                    else:
                        run.method_round(cases, m, r, where)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert run.ceiling is not None
    return BenchResult(run.nbytes, opts.rounds, str(directory.resolve()), mount_of(directory), run.ceiling.name,
                       run.why, run.save, run.load, skipped, host_info(), engine,
                       datetime.datetime.now().astimezone().isoformat(timespec="seconds"), run.first_save,
                       run.written)


def _check_room(directory: Path, size: int) -> None:
    """InvalidOptionError when ``directory``'s file system or the memory available cannot hold a
    bench of a ``size``-byte state (two copies on disk; the state and one loaded copy in memory)."""
    need_disk = 2 * size + 256 * MiB
    free = shutil.disk_usage(directory).free
    if free < need_disk:
        raise InvalidOptionError(f"not enough free space in {directory}: the bench needs {human(need_disk)} "
                                 f"(2 x --size), {human(free)} is free; use a smaller --size or another --dir")
    avail = mem_available()
    need_mem = int(2.3 * size)
    if avail is not None and avail < need_mem:
        raise InvalidOptionError(f"not enough memory: the bench holds the state and one loaded copy, about "
                                 f"{human(need_mem)}, and {human(avail)} is available; use a smaller --size")


class _Rounds:
    """run_bench's measurements as they accumulate: GB/s per method (and the ceiling) for saves
    and loads, gdswriter's first saves, the bytes each method left on disk, and the ceiling's
    reference (chosen in the first round, fio or the built-in loop, and kept)."""

    def __init__(self, opts: BenchOptions, model: Any, opt: Any, work: Path, order: list[str], step: Step) -> None:
        self.opts, self.model, self.opt, self.work, self.step = opts, model, opt, work, step
        self.nbytes = state_bytes(model, opt)
        self.canary = Canary(model, opt)
        self.pattern = memoryview(torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8).numpy())
        self.save: dict[str, list[float]] = {m: [] for m in order}
        self.load: dict[str, list[float]] = {m: [] for m in order}
        self.first_save: list[float] = []
        self.written: dict[str, int] = {}
        self.cache: dict = {}
        self.ceiling: Reference | None = None
        self.why = ""

    def ceiling_round(self, where: str) -> None:
        """The disk's ceiling: write and read the state's bytes with the reference."""
        quiesce()
        path = self.work / "ceiling.bin"
        if self.ceiling is None:
            self.ceiling, self.why = disk_reference(path, self.nbytes, self.pattern, self.cache,
                                                    use_fio=self.opts.use_fio)
            ref = self.ceiling
        elif self.ceiling.name == FIO_NAME:
            ref = fio_reference(path, self.nbytes, self.cache)
        else:
            ref = builtin_reference(path, self.nbytes, self.pattern, self.cache)
        self.save[CEILING].append(ref.write_bps / 1e9)
        self.load[CEILING].append(ref.read_bps / 1e9)
        self.step(f"{where} write + read")

    def method_round(self, cases: Methods, m: str, r: int, where: str) -> None:
        """Method ``m`` in round ``r``: a timed save, then a timed cold load (checked by the canary);
        for gdswriter also the first save of a fresh checkpointer."""
        nbytes = self.nbytes
        case = SAVE_CASE.get(m, m)
        cases.clear(case)
        quiesce()
        t = time.perf_counter()
        cases.save(case)
        self.save[m].append(nbytes / (time.perf_counter() - t) / 1e9)
        self.written.setdefault(m, files_bytes(cases.path(case)))
        self.step(f"{where} save")
        settle(self.opts.settle)
        evict_paths(*cases.files(case))
        self.canary.spoil()
        t = time.perf_counter()
        cases.load(m)
        self.load[m].append(nbytes / (time.perf_counter() - t) / 1e9)
        self.canary.check(LOAD_NAMES[m])
        cases.clear(case)
        self.step(f"{where} load")
        if m == "gdswriter":
            self.first_save.append(nbytes / _first_save(self.model, self.opt, self.work / f"first-{r}") / 1e9)
            self.step(f"{where} (the first save of a fresh checkpointer)")


def files_bytes(path: Path) -> int:
    """The bytes of the regular files at or under ``path``: what a save left on disk."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _first_save(model, opt, root: Path) -> float:
    """Seconds of the first save of a GDSCheckpointer constructed right before it (whatever it
    sets up on its first save is timed); its files are removed afterwards."""
    from ..checkpointer import GDSCheckpointer
    from ..options import CheckpointOptions
    from ..save.pool import release_kept_pool

    release_kept_pool()  # the first save of the process, not one through a pool an earlier checkpointer left
    quiesce()
    try:
        with GDSCheckpointer(model, opt, root=root, options=CheckpointOptions()) as ck:
            t = time.perf_counter()
            ck.save(1)
            return time.perf_counter() - t
    finally:
        remove(root)


def steps_of(opts: BenchOptions) -> int:
    """How many times ``run_bench`` calls ``step``, for a progress bar (skipped methods included:
    an upper bound)."""
    return opts.rounds * (2 + 2 * (1 + len([m for m in opts.compare if m != "gdswriter"])))


# ----------------------------------------------------------------------------- charts
def bar_chart(path: str | os.PathLike, groups: Sequence[str], series: dict[str, Sequence[Spread | None]], *,
              title: str, ylabel: str = "GB/s", lines: dict[str, float] | None = None, note: str = "") -> Path:
    """A grouped bar chart as PNG: one group per entry of ``groups``, one bar per series (its
    median, with min-max whiskers); ``lines`` draws labelled horizontal references. Needs
    matplotlib (the ``plot`` extra): InvalidOptionError saying how to install it otherwise."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InvalidOptionError("charts need matplotlib: pip install 'gdswriter[plot]' (or pip install "
                                 "matplotlib)") from e
    path = Path(os.fspath(path))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 3), 4.2), dpi=120)
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        shown = [(g + (i - (len(series) - 1) / 2) * width, v) for g, v in enumerate(values) if v is not None]
        xs, vs = [x for x, _ in shown], [v for _, v in shown]
        err = [[max(0.0, v.median - v.min) for v in vs], [max(0.0, v.max - v.median) for v in vs]]
        bars = ax.bar(xs, [v.median for v in vs], width * 0.92, yerr=err, capsize=3, label=name, color=f"C{i}")
        ax.bar_label(bars, labels=[f"{v.median:.2f}" for v in vs], fontsize=7, padding=2)
    for i, (name, y) in enumerate((lines or {}).items()):
        ax.axhline(y, linestyle="--", linewidth=1, color=f"C{len(series) + i}", label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    if note:
        fig.text(0.01, 0.01, note, fontsize=6.5, color="0.35")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def plot(result: BenchResult, path: str | os.PathLike) -> Path:
    """The bench's chart: save and load GB/s per method (median, min-max), ceiling as lines."""
    from .._version import __version__

    methods = [m for m in result.methods if m != CEILING]
    ceiling = {f"disk ceiling write ({'fio' if result.ceiling == FIO_NAME else 'built-in'})":
               result.spread(CEILING, "save").median,
               f"disk ceiling read ({'fio' if result.ceiling == FIO_NAME else 'built-in'})":
               result.spread(CEILING, "load").median}
    return bar_chart(path, methods, {"save (durable)": [result.spread(m, "save") for m in methods],
                                     "load (cold)": [result.spread(m, "load") for m in methods]},
                     title=f"Checkpoint save/load, {result.bytes / 1e9:.2f} GB, {result.rounds} interleaved rounds "
                           f"({result.filesystem})", lines=ceiling,
                     note=f"{describe(result.host)}; {result.date}; gdswriter {__version__} bench")


# ----------------------------------------------------------------------------- many tensors
COUNT_CASES = ("first save", "second save", "load")
DEFAULT_COUNTS = (64, 10_000)
COUNT_SIZE = 256 * MiB
COUNT_METHODS = ("deepspeed", "torch", "dcp")  # beside gdswriter in run_counts, in this order
COUNT_NAMES = {"deepspeed": ("FastPersist", "torch.load (FastPersist's file)"),
               "torch": ("torch.save+fsync", "torch.load"), "dcp": ("dcp.save t4", "dcp.load")}
GDSWRITER = "gdswriter"
GdsRound = Callable[[dict, Path], dict[str, float]]  # (state, root) -> GB/s per COUNT_CASES entry


def tensor_state(count: int, size: int, device: str = "cpu") -> dict:
    """A nested dict of ``count`` float32 tensors of about ``size`` bytes in all, each its own
    allocation (groups of 100 under "g<i>"), random values: the many-small-tensors state."""
    per = max(1, size // 4 // count)
    g = torch.Generator().manual_seed(count)
    state: dict = {}
    for i in range(count):
        state.setdefault(f"g{i // 100}", {})[f"t{i % 100}"] = torch.rand(per, generator=g).to(device)
    return state


def state_nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for g in state.values() for t in g.values())


def _check_first(first: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(first, want):
        raise LoadCheckError(f"{what} did not restore the saved state (a spoiled tensor stayed spoiled): "
                             f"its figures would be meaningless")


def gdswriter_counts_round(state: dict, root: Path, *, settle_s: float = 1.0) -> dict[str, float]:
    """GB/s of a fresh checkpointer's first save of ``state`` under ``root``, its second save
    (both durable) and a cold load of step 2 into ``state`` (checked: its first tensor is
    spoiled before). The kept pool is released first (the process's first save); ``root`` is
    removed afterwards."""
    from ..checkpointer import GDSCheckpointer
    from ..save.pool import release_kept_pool

    nbytes = state_nbytes(state)
    want = state["g0"]["t0"].clone()
    got: dict[str, float] = {}
    release_kept_pool()
    quiesce()
    try:
        with GDSCheckpointer(state, None, root) as ck:
            for s, what in ((1, "first save"), (2, "second save")):
                quiesce()
                t = time.perf_counter()
                ck.save(s)
                got[what] = nbytes / (time.perf_counter() - t) / 1e9
            ck.wait()
            settle(settle_s)
            evict_paths(root)
            state["g0"]["t0"].fill_(-1.0)
            t = time.perf_counter()
            ck.load(2)
            got["load"] = nbytes / (time.perf_counter() - t) / 1e9
            _check_first(state["g0"]["t0"], want, "gdswriter.load")  # a dict's tensors are replaced by the loaded ones
    finally:
        remove(root)
    return got


def method_counts_round(method: str, state: dict, path: Path, fastpersist: FastPersist, *,
                        settle_s: float = 1.0) -> dict[str, float]:
    """GB/s of ``method``'s (COUNT_METHODS) durable save of ``state`` to ``path`` and its cold
    load (checked); ``path`` is removed before and after."""
    nbytes = state_nbytes(state)
    want = state["g0"]["t0"].clone()
    remove(path)
    quiesce()
    try:
        t = time.perf_counter()
        if method == "deepspeed":
            fastpersist.save(state, path)
        elif method == "torch":
            torch_save_durable(state, path)
        else:
            dcp_save(state, path)
        saved = nbytes / (time.perf_counter() - t) / 1e9
        settle(settle_s)
        evict_paths(path)
        t = time.perf_counter()
        if method == "dcp":
            state["g0"]["t0"].fill_(-1.0)
            dcp_load(state, path)  # in place
            first = state["g0"]["t0"]
        else:
            first = torch.load(path, weights_only=True, mmap=False)["g0"]["t0"]
        loaded = nbytes / (time.perf_counter() - t) / 1e9
        _check_first(first, want, COUNT_NAMES[method][1])
        state["g0"]["t0"].copy_(want)
    finally:
        remove(path)
    return {"save": saved, "load": loaded}


@dataclass(frozen=True)
class CountResult:
    """GB/s per round of each tensor count: the disk's ceiling ("ceiling write" / "ceiling
    read"), gdswriter's first save (a fresh checkpointer), second save (the same one) and
    cold load under each label (``labels``: "gdswriter", or one per tree compared; keys
    "<label> <case>"), and each other method's save and load ("<method> save" / "<method> load")."""

    size: int
    rounds: int
    ceiling: str
    gbps: dict[tuple[int, str], list[float]]  # (count, case) -> per round
    labels: tuple[str, ...] = (GDSWRITER,)
    methods: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it did not run
    device: str = "cpu"
    sizes: dict[int, int] = field(default_factory=dict)  # count -> bytes, where not ``size``

    @property
    def counts(self) -> list[int]:
        return sorted({c for c, _ in self.gbps})

    def ratio(self, count: int, case: str, ref: str | None = None) -> float:
        """Median over rounds of ``case``'s GB/s over ``ref``'s (default: the ceiling's, read for
        loads, write for saves)."""
        ref = ref or ("ceiling read" if case.endswith("load") else "ceiling write")
        return statistics.median(a / b for a, b in zip(self.gbps[count, case], self.gbps[count, ref]))

    def columns(self, kind: str) -> list[tuple[str, str]]:
        """(heading, case key) of the saves' ("save") or the loads' ("load") table."""
        if kind == "save":
            mine = [(f"{lab} {c}", f"{lab} {c}") for lab in self.labels for c in COUNT_CASES[:2]]
            return [("ceiling write", "ceiling write"), *mine,
                    *[(COUNT_NAMES[m][0], f"{m} save") for m in self.methods]]
        return [("ceiling read", "ceiling read"), *[(f"{lab} load", f"{lab} load") for lab in self.labels],
                *[(COUNT_NAMES[m][1], f"{m} load") for m in self.methods]]

    def table(self) -> list[str]:
        """Two tables (saves, cold loads), one row per tensor count: GB/s median (x ceiling); then
        gdswriter's first save over each other method's save, per count."""
        where = f" from {self.device} tensors" if self.device != "cpu" else ""
        lines = [f"{self._sizes()} as N tensors (a nested dict){where}, GB/s median (x ceiling: median of "
                 f"per-round ratios) of {self.rounds} interleaved round(s) with the ceiling ({self.ceiling}); "
                 f"saves durable, loads cold"]
        med = statistics.median
        for kind in ("save", "load"):
            cols = self.columns(kind)
            rows = [["tensors", *[h for h, _ in cols]]]
            for n in self.counts:
                rows.append([self._row(n), *[_fig(med(self.gbps[n, k])) + ("" if k.startswith("ceiling") else
                                         f" ({_fig(self.ratio(n, k))}x)") for _, k in cols]])
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines += [""] + ["  " + "  ".join(c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
        for lab in self.labels:
            for m in self.methods:
                lines.append(f"  {lab} first save / {COUNT_NAMES[m][0]}: " + ", ".join(
                    f"{n:,} tensors {_fig(self.ratio(n, f'{lab} first save', f'{m} save'))}x" for n in self.counts))
        lines += [f"  skipped {m}: {why}" for m, why in self.skipped.items()]
        return lines

    def _sizes(self) -> str:
        return ", ".join(f"{human(self.sizes.get(n, self.size))} ({n:,})" for n in self.counts) if self.sizes \
            else human(self.size)

    def _row(self, n: int) -> str:
        return f"{n:,} ({human(self.sizes[n])})" if n in self.sizes else f"{n:,}"

    def to_json(self) -> dict:
        return {"bytes": self.size, "sizes": {str(n): b for n, b in self.sizes.items()},
                "rounds": self.rounds, "ceiling": self.ceiling, "device": self.device,
                "labels": list(self.labels), "methods": list(self.methods), "skipped": self.skipped,
                "counts": {str(n): {case: {"gbps": v, **({} if case.startswith("ceiling") else
                                                        {"x_ceiling": self.ratio(n, case)})}
                                    for (c, case), v in self.gbps.items() if c == n}
                           for n in self.counts}}


def _fig(v: float) -> str:
    """Two decimals, three below 0.1 (a CPU-bound case on a loaded machine is not 0.00)."""
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"


def count_steps(counts: Sequence[int], rounds: int, n_cases: int = 2) -> int:
    """How many times ``run_counts`` calls ``step`` (``n_cases``: the ceiling, each gdswriter
    label and each other method)."""
    return len(counts) * rounds * n_cases


def run_counts(directory: Path, *, counts: Sequence[int] = DEFAULT_COUNTS, size: int = COUNT_SIZE,
               rounds: int = 3, settle_s: float = 1.0, step: Step | None = None, compare: Sequence[str] = (),
               device: str = "cpu", trees: dict[str, GdsRound] | None = None,
               sizes: dict[int, int] | None = None) -> CountResult:
    """For each tensor count, in interleaved rounds (order rotated): the disk's ceiling (the
    built-in O_DIRECT loop, same bytes); gdswriter (``gdswriter_counts_round``: a fresh
    checkpointer's first save, its second save, a cold load), or, with ``trees``, each label's
    round function in turn (another tree's gdswriter in a worker process); and each method of
    ``compare`` (COUNT_METHODS, those that cannot run here skipped with the reason). ``sizes``:
    bytes per count where not ``size``. Everything written is removed afterwards."""
    unknown = [m for m in compare if m not in COUNT_METHODS]
    if unknown:
        raise InvalidOptionError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(COUNT_METHODS)}")
    skipped = {m: why for m in compare if (why := missing(m))}
    methods = tuple(m for m in COUNT_METHODS if m in compare and m not in skipped)
    work = Path(tempfile.mkdtemp(prefix=".gdswriter-counts-", dir=directory))
    trees = trees or {GDSWRITER: lambda state, root: gdswriter_counts_round(state, root, settle_s=settle_s)}
    rounder = _CountRounds(work, settle_s, trees, step or (lambda note: None))
    order = ["ceiling", *trees, *methods]
    try:
        for n in counts:
            state = tensor_state(n, (sizes or {}).get(n, size), device)
            for r in range(rounds):
                shift = r % len(order)
                for case in order[shift:] + order[:shift]:
                    rounder.run(case, n, r, state)
            del state
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return CountResult(size, rounds, rounder.ceiling, rounder.gbps, tuple(trees), methods, skipped, device,
                       dict(sizes or {}))


class _CountRounds:
    """run_counts's cases, one at a time, and the GB/s they accumulate."""

    def __init__(self, work: Path, settle_s: float, trees: dict[str, GdsRound], step: Step) -> None:
        self.work, self.settle_s, self.trees, self.step = work, settle_s, trees, step
        self.pattern = memoryview(torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8).numpy())
        self.gbps: dict[tuple[int, str], list[float]] = {}
        self.cache: dict = {}
        self.ceiling = ""
        self.fastpersist = FastPersist()

    def add(self, n: int, case: str, value: float) -> None:
        self.gbps.setdefault((n, case), []).append(value)

    def run(self, case: str, n: int, r: int, state: dict) -> None:
        """Case ``case`` of round ``r``; ``step`` gets "<n> tensors, round <r>: <case> (<GB/s each>)"."""
        if case == "ceiling":
            quiesce()
            ref = builtin_reference(self.work / "ceiling.bin", state_nbytes(state), self.pattern, self.cache)
            self.ceiling = ref.name
            got = {"write": ref.write_bps / 1e9, "read": ref.read_bps / 1e9}
        elif case in self.trees:
            got = self.trees[case](state, self.work / f"gds-{n}-{r}")
        else:
            path = self.work / f"{case}-{n}-{r}"
            got = method_counts_round(case, state, path, self.fastpersist, settle_s=self.settle_s)
        for what, v in got.items():
            self.add(n, f"{case} {what}", v)
        self.step(f"{n} tensors, round {r + 1}: {case} ({', '.join(f'{k} {v:.3f}' for k, v in got.items())} GB/s)")
