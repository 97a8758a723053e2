"""Engines and spans for the engine tests.

The staged engines of the contract suite (``ENGINES``, ``build_engine``), the KvikIO (GDS)
engine's kinds (``KVIKIO_KINDS``, ``make_kvikio_engine``: its device path with the fake KvikIO
and host tensors taken for device memory; on a GPU the real engine with CUDA spans), span
data and on-disk images, host memory of a chosen alignment, planted non-regular files, and
which memory the kernel holds page-locked (``is_locked``).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from pathlib import Path

import crc32c
import pytest
import torch

from gdswriter.engines.base import IOEngine, ReadSpan, WriteSpan, check_spans
from gdswriter.errors import EngineUnavailableError
from gdswriter.options import ALIGN, KiB
from gdswriter.testing.faults import FaultInjectingEngine, FaultPlan
from support.fake_kvikio import FakeKvikio

REQUEST = 64 * KiB
BUFFER = 256 * KiB
POOL = 3 * BUFFER

HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]


# --------------------------------------------------------------------------- staged engines
ENGINES = ["io_uring", "posix", "faulty-short", "faulty-short-posix-buffered", "io_uring-buffered"]


def build_engine(kind: str, options):
    """The staged engine named ``kind`` (one of ``ENGINES``); ``options(**kw)`` makes its EngineOptions."""
    from gdswriter.engines.staged import IoUringEngine, PosixEngine

    if kind == "io_uring":
        return IoUringEngine(options(engine="io_uring"))
    if kind == "posix":
        return PosixEngine(options(engine="posix"))
    if kind == "faulty-short":  # every 2nd request moves only 4 KiB (aligned for O_DIRECT)
        return FaultInjectingEngine(options(), FaultPlan(short_every=2, short_bytes=4096))
    if kind == "faulty-short-posix-buffered":  # every 3rd request moves only 1000 bytes (unaligned)
        return FaultInjectingEngine(options(direct_io=False), FaultPlan(short_every=3, short_bytes=1000),
                                    backend="posix")
    if kind == "io_uring-buffered":
        return IoUringEngine(options(engine="io_uring", direct_io=False))
    raise AssertionError(kind)


# --------------------------------------------------------------------------- the KvikIO engine
# fake-device: the KvikIO engine's device path with the stand-in, host tensors taken for device
# memory. On a GPU: the KvikIO engine with CUDA spans, and mixed CUDA + host spans; and
# gdswriter's own engines with CUDA spans (pinned staging, D2H/H2D copies).
KVIKIO_KINDS = ["fake-device", pytest.param("cuda", marks=GPU), pytest.param("cuda-mixed", marks=GPU),
                pytest.param("cuda-io_uring", marks=GPU), pytest.param("cuda-posix", marks=GPU)]


def kvikio_importable() -> bool:
    import gdswriter.engines.kvikio as gds

    try:
        gds.import_kvikio()
        return True
    except EngineUnavailableError:
        return False


def isolate_from_host(monkeypatch, tmp_path, *, nvidia_fs: bool = False, cufile: dict | None = None) -> None:
    """Point the engine's probes at test files instead of this machine's /proc, /dev and /etc."""
    import gdswriter.engines.kvikio as gds

    proc = tmp_path / "nvidia-fs-version"
    if nvidia_fs:
        proc.write_text("version: 2.26.6\n")
    monkeypatch.setattr(gds, "NVIDIA_FS_PROC", str(proc))
    monkeypatch.setattr(gds, "NVIDIA_FS_DEV", str(tmp_path / "no-such-dev-nvidia-fs*"))
    cf = tmp_path / "cufile.json"
    if cufile is not None:
        cf.write_text(json.dumps(cufile))
    monkeypatch.setattr(gds, "CUFILE_JSON_DEFAULT", str(cf))
    monkeypatch.delenv("CUFILE_ENV_PATH_JSON", raising=False)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    monkeypatch.delenv("KVIKIO_TASK_SIZE", raising=False)


def take_host_tensors_for_device_memory(monkeypatch) -> None:
    """The KvikIO engine's device path for host tensors (no CUDA here)."""
    import gdswriter.engines.kvikio as gds

    # The engine's own test of where a tensor lives, through its seam: host tensors pass for device memory.
    monkeypatch.setattr(gds, "on_gpu", lambda t: True)


def pretend_cuda(monkeypatch, available: bool) -> None:
    """Whether gdswriter (the KvikIO engine, engine selection, the doctor) sees a CUDA device."""
    import gdswriter.engines.kvikio as gds

    # The one place gdswriter asks (engines/kvikio.cuda_available): patching torch.cuda.is_available
    # instead would reach torch's own code as well.
    monkeypatch.setattr(gds, "cuda_available", lambda: available)


def install_fake_kvikio(monkeypatch, tmp_path, **kw) -> FakeKvikio:
    """The fake KvikIO in place of the real one, the probes isolated from this machine, host
    tensors taken for device memory. Compat mode (no nvidia-fs, cuFile says no GDS) unless
    ``gds_available=True`` is given, which also loads a fake nvidia-fs."""
    f = FakeKvikio(**kw)
    f.install(monkeypatch)
    isolate_from_host(monkeypatch, tmp_path, nvidia_fs=kw.get("gds_available", False))
    take_host_tensors_for_device_memory(monkeypatch)
    return f


class CudaMemory:
    """The engine seen through host tensors: each span is copied to CUDA memory (with
    ``mixed``, every other span stays in host memory) before the engine sees it, and read
    spans are copied back. Runs the contract's host-tensor cases on the device path."""

    def __init__(self, engine, *, mixed: bool):
        self.engine, self.mixed = engine, mixed

    def _device(self, i: int) -> str:
        return "cpu" if self.mixed and i % 2 else "cuda"

    def write_file(self, path, spans, *, size=None, durable=True):
        check_spans(spans)
        moved = [WriteSpan(s.offset, s.data.to(self._device(i))) for i, s in enumerate(spans)]
        return self.engine.write_file(path, moved, size=size, durable=durable)

    def read_file(self, path, spans):
        check_spans(spans)
        moved = [ReadSpan(s.offset, s.out.to(self._device(i))) for i, s in enumerate(spans)]
        crcs = self.engine.read_file(path, moved)
        for s, m in zip(spans, moved):
            s.out.copy_(m.out)
        return crcs

    @property
    def info(self):
        return self.engine.info

    def close(self):
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def kvikio_engine_factory(kind: str, options, monkeypatch, tmp_path):
    """``make(**option_overrides)``: an engine of ``kind`` (one of ``KVIKIO_KINDS``), and the
    list of what it made (to close). ``options(**overrides)`` makes the EngineOptions. The
    ``fake-device`` kind installs the fake KvikIO; the ``cuda`` kinds skip where KvikIO is missing."""
    import gdswriter.engines.kvikio as gds
    from gdswriter.engines.staged import IoUringEngine, PosixEngine

    if kind == "fake-device":
        install_fake_kvikio(monkeypatch, tmp_path)
    elif kind in ("cuda", "cuda-mixed") and not kvikio_importable():
        pytest.skip("KvikIO is not installed (pip install 'gdswriter[gds-cu13]')")
    made = []

    def make(**overrides):
        opts = options(**overrides)
        if kind == "cuda-io_uring":
            eng = IoUringEngine(opts)
        elif kind == "cuda-posix":
            eng = PosixEngine(opts)
        else:
            eng = gds.GdsEngine(opts, host_engine=lambda: PosixEngine(opts))
        wrapped = eng if kind == "fake-device" else CudaMemory(eng, mixed=kind == "cuda-mixed")
        made.append(wrapped)
        return wrapped

    # The contract's cases expect O_DIRECT exactly from kinds named like gdswriter's engines.
    make.kind = kind.removeprefix("cuda-") if kind in ("cuda-io_uring", "cuda-posix") else kind
    return make, made


# --------------------------------------------------------------------------- spans and files
def rand(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def crc(t: torch.Tensor) -> int:
    return crc32c.crc32c(t.numpy().tobytes())


def image(spans, size: int) -> bytes:
    """What the file must hold: the spans' bytes, zeros everywhere else."""
    out = bytearray(size)
    for s in spans:
        out[s.offset:s.end] = s.data.numpy().tobytes()
    return bytes(out)


def disk(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def host_tensor(n: int, kind: str, fill=None, gen=None) -> torch.Tensor:
    """A flat uint8 tensor of n bytes: page-aligned, page-aligned + 512 or + 64 (what torch's
    allocator gives large tensors), or wherever torch puts it."""
    if kind == "default":
        t = torch.empty(n, dtype=torch.uint8)
    else:
        raw = torch.empty(n + 2 * ALIGN, dtype=torch.uint8)
        start = (-raw.data_ptr()) % ALIGN + {"aligned": 0, "aligned+512": 512, "aligned+64": 64}[kind]
        t = raw[start:start + n]
    if fill is not None:
        t.fill_(fill)
    else:
        t.copy_(rand(n, gen))
    return t


def direct_pwrite_errno(path, memory_misalign: int, file_off: int = 0) -> int:
    """Ask the kernel itself, not statx: O_DIRECT pwrite of 4 KiB from memory ``memory_misalign``
    bytes into a page, at ``file_off`` of ``path``. 0 when it is taken, else the errno."""
    raw = torch.zeros(3 * ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN + memory_misalign
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert os.pwrite(fd, memoryview(raw[start:start + ALIGN].numpy()), file_off) == ALIGN
        return 0
    except OSError as e:
        return e.errno
    finally:
        os.close(fd)


def kernel_takes_direct_io_from(t: torch.Tensor, directory) -> bool:
    """Does O_DIRECT take memory that sits where ``t`` does within its page, in ``directory``?"""
    err = direct_pwrite_errno(directory / "probe.bin", t.data_ptr() % ALIGN)
    assert err in (0, errno.EINVAL), os.strerror(err)
    return err == 0


# --------------------------------------------------------------------------- hostile paths
HOSTILE = ["symlink", "dangling symlink", "directory", "FIFO", "FIFO with a reader", "socket", "character device"]


def plant(kind: str, path: Path, target: Path) -> object:
    """Put a ``kind`` (one of ``HOSTILE``) at ``path`` (``target``: an innocent regular file).
    Returns what must stay alive while the test runs (a listening socket)."""
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "dangling symlink":
        path.symlink_to(target.with_name("nothing-here"))
    elif kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "FIFO with a reader":
        os.mkfifo(path)
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.listen()
        return sock
    elif kind == "character device":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD")
    return None


# --------------------------------------------------------------------------- engines with a hook
class HookedWrites(IOEngine):
    """The engine ``create_engine(options)`` makes, with ``before(path)`` called before each of
    its file writes and ``after(path)`` once the file is written (no-ops here: a test overrides
    them to fail a write, hold it, or SIGKILL the process at a chosen file). Its class is what
    the integrations' engine seams take (``gds_engine_factory``, the engine shelf)."""

    def __init__(self, options=None, *, inner: IOEngine | None = None):
        from gdswriter.engines.select import create_engine

        self.inner = inner if inner is not None else create_engine(options)
        self.name, self.honours_span_guards = self.inner.name, self.inner.honours_span_guards

    def before(self, path) -> None:
        pass

    def after(self, path) -> None:
        pass

    def write_file(self, path, spans, **kw):
        self.before(path)
        out = self.inner.write_file(path, spans, **kw)
        self.after(path)
        return out

    def read_file(self, path, spans):
        return self.inner.read_file(path, spans)

    @property
    def info(self):
        return self.inner.info

    def close(self):
        self.inner.close()


def count_staged_engines(monkeypatch) -> list:
    """The names of every staged engine built from now on (io_uring or POSIX on this machine),
    whoever builds it: an engine shelf or a checkpointer."""
    from gdswriter.engines.staged import StagedEngine

    built: list = []
    real = StagedEngine.__init__

    def counting(self, *a, **k):
        built.append(type(self).__name__)
        real(self, *a, **k)

    monkeypatch.setattr(StagedEngine, "__init__", counting)
    return built


def locked_ranges() -> list[tuple[int, int]]:
    """This process's page-locked mappings ([start, end), VmFlags "lo"), from /proc/self/smaps:
    mlock splits a mapping where a locked range ends, so a mapping is locked whole or not."""
    out, span = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                span = tuple(int(x, 16) for x in head.split("-"))
            elif line.startswith("VmFlags:") and "lo" in line.split()[1:]:
                out.append(span)
    return out


def is_locked(lo: int, hi: int) -> bool:
    """Whether every byte of [lo, hi) lies in a page-locked mapping."""
    pos = lo
    for start, end in sorted(locked_ranges()):
        if start <= pos < end:
            pos = end
    return pos >= hi
