"""The GPUDirect Storage engine: CUDA tensors to and from files through KvikIO (cuFile).

What runs, truthfully. KvikIO, and cuFile under it, quietly fall back to POSIX I/O through
host bounce buffers ("compat mode") when the nvidia-fs driver is missing, cuFile says GDS
is unavailable, or KvikIO prefers compat mode. ``gds_status`` collects those facts; this
engine calls itself "gds" only when bytes go GPU <-> NVMe by DMA, else "kvikio-compat";
``info.cuda_path`` and ``info.gpu_direct`` say the same for the whole engine and
``info.name`` for the last file (the manifest records it per file). Where KvikIO's I/O
statistics exist (26.10+), a file whose device bytes did not all go through GDS is
reported as "kvikio-compat" even in GDS mode.

Layout. ``plan_io`` (a pure function) cuts a file's spans into requests that never share
a 4 KiB block: the whole aligned blocks of large spans move straight between the tensor
and the file; heads, tails and small spans are packed, gaps zeroed, into device staging
buffers of ``buffer_bytes`` that are written (or read) as aligned extents. Every request
starts on a 4 KiB boundary, as GDS needs for DMA, and no two requests touch the same
block, so concurrent requests never read-modify-write each other's bytes.

Streams. KvikIO synchronises only the legacy default stream, and the checkpointer calls
engines from its worker thread, not from the thread that produced the tensors. The
engine therefore synchronises every device it is about to read or write (the producer
may be any stream), then does its own work (staging copies, checksums) on a stream of
its own.

Host memory. A file holding no CUDA tensor is handed whole to the host engine
(gdswriter's io_uring or POSIX engine: faster from host memory than KvikIO's host path,
and it checksums while it copies). In a file holding CUDA tensors, CPU tensors go
through KvikIO too (their aligned bodies by KvikIO's host path, their heads and tails
staged through the device buffer), so one engine writes each file.

Checksums: the crc32c of device spans is computed on the GPU (checksum.py) while the
writes are in flight, and after the reads land; only 8 bytes per span reach the host.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import threading
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import crc32c as _crc32c
import torch

from .base import EngineInfo, IOEngine, ReadSpan, WriteSpan, check_spans, checked_write_size
from ..errors import (ERRNO_HINTS, EngineIOError, EngineUnavailableError, GDSWriterError, ShortIOError,
                      TruncatedFileError)
from ..fs import open_regular
from ..options import ALIGN, EngineOptions
from .._log import log_once
from ..cuda.checksum import crc32c_tensors

DIRECT_MIN = 64 << 10  # a span's aligned body at least this large moves in place; smaller is staged
MERGE_GAP = 1 << 20  # staged pieces closer than this share one request (gap zeroed / read through)
MAX_THREADS = 8  # KvikIO threads (unless KVIKIO_NTHREADS says otherwise): enough for NVMe RAIDs

NVIDIA_FS_PROC = "/proc/driver/nvidia-fs/version"
NVIDIA_FS_DEV = "/dev/nvidia-fs*"
CUFILE_JSON_DEFAULT = "/etc/cufile.json"

GDS = "gds"
COMPAT = "kvikio-compat"


# ---------------------------------------------------------------------------
# What this machine offers
# ---------------------------------------------------------------------------
def import_kvikio():
    """KvikIO, imported on first use; EngineUnavailableError saying why it cannot be."""
    try:
        import kvikio
        import kvikio.cufile_driver  # noqa: F401
        import kvikio.defaults  # noqa: F401
    except ImportError as e:
        raise EngineUnavailableError(
            errno.ENOENT, f"KvikIO is not installed ({e}): pip install 'gdswriter[gds-cu13]' for CUDA 13 or "
                          f"'gdswriter[gds]' for CUDA 12, or use engine='auto'") from e
    except Exception as e:  # noqa: BLE001 - e.g. OSError: libcuda.so.1 missing on a machine without a driver
        raise EngineUnavailableError(
            errno.ENOTSUP, f"KvikIO cannot load here ({type(e).__name__}: {e}); it needs an NVIDIA driver "
                           f"(libcuda.so.1). Use engine='auto'") from e
    return kvikio


def nvidia_fs_driver() -> str | None:
    """The nvidia-fs kernel driver's version line (or its device node) when loaded, else None."""
    try:
        with open(NVIDIA_FS_PROC) as f:
            return f.readline().strip() or NVIDIA_FS_PROC
    except OSError:
        pass
    nodes = sorted(glob.glob(NVIDIA_FS_DEV))
    return nodes[0] if nodes else None


def _strip_json_comments(text: str) -> str:
    """cufile.json allows // and /* */ comments and trailing commas; plain JSON does not."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            i = text.find("*/", i + 2)
            i = n if i < 0 else i + 2
        else:
            out.append(c)
            i += 1
    return re.sub(r",(\s*[}\]])", r"\1", "".join(out))


@dataclass(frozen=True)
class CufileConfig:
    """The cufile.json in effect: where, its parsed content (None if absent or unreadable) and why not."""

    path: str
    data: dict | None
    error: str = ""

    def prop(self, name: str, default=None):
        props = (self.data or {}).get("properties", {})
        return props.get(name, default) if isinstance(props, dict) else default


def read_cufile_json(environ: dict[str, str] | None = None) -> CufileConfig:
    """cuFile reads CUFILE_ENV_PATH_JSON if set, else /etc/cufile.json."""
    env = os.environ if environ is None else environ
    path = env.get("CUFILE_ENV_PATH_JSON") or CUFILE_JSON_DEFAULT
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        return CufileConfig(path, None, f"cannot read it: {e.strerror}")
    try:
        data = json.loads(_strip_json_comments(text))
    except ValueError as e:
        return CufileConfig(path, None, f"not valid JSON even without comments: {e}")
    if not isinstance(data, dict):
        return CufileConfig(path, None, "not a JSON object")
    return CufileConfig(path, data)


@dataclass(frozen=True)
class GdsStatus:
    """What KvikIO and the system say about GPUDirect Storage here."""

    kvikio_version: str
    libcufile_version: tuple[int, int] | None
    nvidia_fs: str | None  # driver version line or device node; None: not loaded
    pci_p2pdma: bool  # cufile.json asks for the upstream kernel's P2PDMA (no nvidia-fs needed)
    gds_available: bool | None  # cuFile's own verdict (None: could not ask)
    allow_compat_mode: bool | None
    compat_mode: str  # KvikIO's setting: ON, OFF or AUTO
    compat_preferred: bool  # KvikIO will use its POSIX path
    notes: tuple[str, ...] = field(default=())

    @property
    def gpu_direct(self) -> bool:
        """Bytes move GPU <-> storage by DMA, without host bounce buffers."""
        return bool(self.gds_available) and not self.compat_preferred and (self.nvidia_fs is not None or self.pci_p2pdma)

    @property
    def mode(self) -> str:
        return GDS if self.gpu_direct else COMPAT

    @property
    def reason(self) -> str:
        """Why not GPU-direct ("" when it is)."""
        why = []
        if self.nvidia_fs is None and not self.pci_p2pdma:
            why.append("the nvidia-fs driver is not loaded (no /proc/driver/nvidia-fs, no /dev/nvidia-fs*)")
        if not self.gds_available:
            why.append("cuFile reports GDS unavailable (is_gds_available=False)")
        if self.compat_preferred:
            why.append(f"KvikIO prefers its POSIX compat path (compat_mode={self.compat_mode})")
        return "; ".join(why + list(self.notes)) if not self.gpu_direct else ""


def gds_status(kvikio=None) -> GdsStatus:
    """Ask KvikIO (imported if not given) and the system what GDS can do here."""
    kvikio = kvikio or import_kvikio()
    drv, defaults = kvikio.cufile_driver, kvikio.defaults
    notes = []

    def ask(name):
        try:
            return drv.get(name)
        except Exception as e:  # noqa: BLE001 - a property missing in this KvikIO/cuFile version
            notes.append(f"cuFile property {name} unavailable ({type(e).__name__}: {e})")
            return None

    try:
        version = tuple(drv.libcufile_version())
    except Exception:  # noqa: BLE001
        version = None
    mode = defaults.get("compat_mode")
    return GdsStatus(
        kvikio_version=str(getattr(kvikio, "__version__", "?")),
        libcufile_version=version if version and version != (0, 0) else None,
        nvidia_fs=nvidia_fs_driver(),
        pci_p2pdma=bool(read_cufile_json().prop("use_pci_p2pdma", False)),
        gds_available=ask("is_gds_available"),
        allow_compat_mode=ask("allow_compat_mode"),
        compat_mode=str(getattr(mode, "name", mode)),
        compat_preferred=bool(defaults.is_compat_mode_preferred()),
        notes=tuple(notes))


def gpu_direct_probe() -> GdsStatus | str:
    """The GdsStatus when true GDS can run here (for GdsEngine's ``status``: collected once),
    else why not. Cheap where it obviously cannot (no CUDA, or neither nvidia-fs nor P2PDMA):
    KvikIO is imported only when it might."""
    if not cuda_available():
        return "no CUDA device"
    if nvidia_fs_driver() is None and not read_cufile_json().prop("use_pci_p2pdma", False):
        return "the nvidia-fs driver is not loaded (no /proc/driver/nvidia-fs, no /dev/nvidia-fs*)"
    try:
        status = gds_status()
    except EngineUnavailableError as e:
        return e.strerror
    return status if status.gpu_direct else status.reason


def gpu_direct_unavailable() -> str | None:
    """None when true GDS can run here, else why not (gpu_direct_probe without the status)."""
    probe = gpu_direct_probe()
    return probe if isinstance(probe, str) else None


# ---------------------------------------------------------------------------
# The I/O plan (pure)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """``length`` bytes of span ``span`` (from byte ``span_off`` of it) at ``buf_off`` of a staging buffer."""

    span: int
    span_off: int
    buf_off: int
    length: int


@dataclass(frozen=True)
class Piece:
    """One request: ``length`` bytes at ``file_off``. Direct (``span`` >= 0): straight from or into
    that span's memory at ``span_off``. Staged (``span`` == -1): through a staging buffer
    holding ``parts`` (zeros elsewhere)."""

    file_off: int
    length: int
    span: int = -1
    span_off: int = 0
    parts: tuple[Part, ...] = ()


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _down(n: int) -> int:
    return n // ALIGN * ALIGN


def plan_io(extents: Sequence[tuple[int, int]], *, buffer_bytes: int, file_size: int | None = None,
            direct_min: int = DIRECT_MIN, merge_gap: int = MERGE_GAP) -> list[Piece]:
    """Cut spans (``(offset, length)``, sorted, not overlapping) into requests in file order.

    Every request starts on a 4 KiB boundary and covers whole 4 KiB blocks (a read's last
    request stops at ``file_size``), no two requests share a block, staged requests are at
    most ``buffer_bytes`` long, and every span byte is in exactly one request."""
    cap = max(ALIGN, _down(buffer_bytes))
    pieces: list[Piece] = []
    cur_lo = cur_hi = -1
    parts: list[Part] = []

    def close() -> None:
        nonlocal cur_lo, cur_hi, parts
        if parts:
            hi = cur_hi if file_size is None else min(cur_hi, file_size)
            pieces.append(Piece(cur_lo, hi - cur_lo, parts=tuple(parts)))
        cur_lo = cur_hi = -1
        parts = []

    def stage(span: int, lo: int, hi: int, span_lo: int) -> None:
        """Bytes [lo, hi) of the file, from byte span_lo of span ``span``."""
        nonlocal cur_lo, cur_hi
        while lo < hi:
            if parts and (_down(lo) - cur_hi >= merge_gap or lo >= cur_lo + cap):
                close()  # too far from the open request, or it is full
            if not parts:
                cur_lo = _down(lo)
            n = min(hi, cur_lo + cap) - lo
            parts.append(Part(span, span_lo, lo - cur_lo, n))
            cur_hi = max(cur_hi, _up(lo + n))
            lo, span_lo = lo + n, span_lo + n

    for j, (off, n) in enumerate(extents):
        if n <= 0:
            continue
        a, b = _up(off), _down(off + n)
        if b - a >= max(direct_min, ALIGN):
            stage(j, off, a, 0)
            close()
            pieces.append(Piece(a, b - a, j, a - off))
            stage(j, b, off + n, b - off)
        else:
            stage(j, off, off + n, 0)
    close()
    return pieces


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------
_ERRNOS_IN_MESSAGES = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                       errno.EISDIR, errno.EFBIG, errno.EBADF, errno.EINVAL, errno.EIO)


def _errno_of(e: BaseException) -> int:
    """KvikIO raises RuntimeError carrying strerror text; find the errno it names (EIO if none)."""
    if isinstance(e, OSError) and e.errno:
        return e.errno
    text = str(e)
    for code in _ERRNOS_IN_MESSAGES:
        if os.strerror(code) in text or errno.errorcode[code] in text:
            return code
    return errno.EIO


def _regular_file(path: str, write: bool) -> int:
    """Check, before KvikIO opens ``path`` by name, that it is a regular file (created empty
    when writing; returns its size): as the host engines do (open_regular), never follow a
    symbolic link and refuse a FIFO, device or directory. KvikIO's own open then finds the
    file this call checked, barring a concurrent swap."""
    fd, _ = open_regular(path, write)
    try:
        return 0 if write else os.fstat(fd).st_size
    except OSError as e:
        raise EngineIOError(e.errno, path, 0, "open") from e
    finally:
        os.close(fd)

def _io_error(e: BaseException, path: str, offset: int, what: str) -> EngineIOError:
    code = _errno_of(e)
    hint = " ".join(x for x in (ERRNO_HINTS.get(code, ""), f"(KvikIO: {' '.join(str(e).split())})") if x)
    if code == errno.EIO and not isinstance(e, OSError):
        hint += ". If cuFile is misconfigured here, `gdswriter doctor` says how; GDSWRITER_ENGINE=io_uring bypasses it"
    return EngineIOError(code, path, offset, f"KvikIO {what}", hint)


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (tests without a GPU redirect it)."""
    return torch.cuda.is_available()


def on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is device memory: the one place that decides it, a seam that tests without a
    GPU replace (monkeypatch) so that host tensors take the device path."""
    return t.device.type == "cuda"


def _kvikio_buffer(t: torch.Tensor):
    """What KvikIO takes: a CUDA tensor itself (``__cuda_array_interface__``), host memory as numpy."""
    return t if t.device.type == "cuda" else t.numpy()


class GdsEngine(IOEngine):
    """CUDA tensors to and from files through KvikIO; files without CUDA tensors go to ``host_engine``."""

    name = GDS

    def __init__(self, options: EngineOptions | None = None, *, require_gpu_direct: bool = False,
                 host_engine: Callable[[], IOEngine] | None = None, reason: str = "", status: GdsStatus | None = None):
        """``status``: gds_status() already collected (by gpu_direct_probe), else collected here."""
        self.options = options or EngineOptions.from_env()
        self._kvikio = import_kvikio()
        self.status = status if status is not None else gds_status(self._kvikio)
        if require_gpu_direct and not self.status.gpu_direct:
            raise EngineUnavailableError(
                errno.ENOTSUP, f"GPUDirect Storage is unavailable: {self.status.reason}. `gdswriter doctor` says "
                               f"how to enable it; engine='kvikio' runs KvikIO in compat mode, engine='auto' "
                               f"picks the fastest path")
        self.mode = self.status.mode
        self._reason = "; ".join(x for x in (reason, self.status.reason) if x)
        self._host_factory = host_engine
        self._host: IOEngine | None = None
        self._last_name = self.mode
        # KvikIO splits each request into tasks for its threads (KVIKIO_TASK_SIZE, if set, wins).
        self._task_size = None if "KVIKIO_TASK_SIZE" in os.environ else self.options.buffer_bytes
        self._configure_threads()
        self._monitor = self._statistics() if self.mode == GDS else None
        self._staging: dict[torch.device, list[torch.Tensor]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._registered: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._closed = False
        if not self.status.gpu_direct:
            log_once("kvikio-compat", f"gdswriter: KvikIO runs in compat mode (POSIX through host bounce buffers): "
                                      f"{self.status.reason}")

    def _statistics(self):
        """KvikIO's I/O statistics (26.10+; process-wide, so only kept where they decide
        something: in GDS mode, which path each file's bytes took). None without them."""
        try:
            return self._kvikio.SummaryMonitor()
        except Exception:  # noqa: BLE001 - an older KvikIO: the engine's mode is all there is
            return None

    def _configure_threads(self) -> None:
        """KvikIO's pool has 1 thread by default; give it up to MAX_THREADS unless the user
        chose (KVIKIO_NTHREADS). The pool is process-wide."""
        if "KVIKIO_NTHREADS" in os.environ:
            return
        want = min(self.options.queue_depth, MAX_THREADS)
        if self._kvikio.defaults.get("num_threads") < want:
            self._kvikio.defaults.set("num_threads", want)

    # -- info ----------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        gpu_direct = self.status.gpu_direct
        return EngineInfo(self._last_name, gpu_direct, bool(self._registered), not gpu_direct, self._reason,
                          cuda_path=self.mode, gpu_direct=gpu_direct)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for buf in self._registered:
                with contextlib.suppress(Exception):
                    self._kvikio.memory_deregister(buf)
            self._registered.clear()
            self._staging.clear()
            if self._host is not None:
                self._host.close()
                self._host = None

    def _check_open(self) -> None:
        if self._closed:
            raise GDSWriterError("this GDS engine is closed: create a new one")

    def _host_engine(self) -> IOEngine:
        if self._host is None:
            if self._host_factory is None:
                raise GDSWriterError("this GDS engine has no host engine for files without CUDA tensors")
            self._host = self._host_factory()
        return self._host

    # -- devices, streams, staging ---------------------------------------------
    def _stream(self, device: torch.device):
        """Context running torch work on this engine's own stream of ``device``."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return torch.cuda.stream(s)

    @staticmethod
    def _synchronize(devices: set[torch.device]) -> None:
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def _staging_buffers(self, device: torch.device) -> list[torch.Tensor]:
        """Two staging buffers per device (one fills while the other is in flight), made on
        first use and kept; registered with cuFile under GDS, where reuse makes it pay."""
        bufs = self._staging.get(device)
        if bufs is None:
            n = max(ALIGN, self.options.buffer_bytes // ALIGN * ALIGN)
            bufs = self._staging[device] = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2)]
            if self.status.gpu_direct and device.type == "cuda":
                for b in bufs:
                    try:
                        self._kvikio.memory_register(b)
                        self._registered.append(b)
                    except Exception as e:  # noqa: BLE001 - registration only speeds things up
                        log_once("gds-register", f"gdswriter: cuFile buffer registration failed ({e}); "
                                                 f"using unregistered staging buffers")
        return bufs

    def _crcs(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """crc32c of each tensor: on its GPU for device memory, with the crc32c package for host memory."""
        out = [0] * len(tensors)
        dev = [i for i, t in enumerate(tensors) if on_gpu(t) and t.numel()]
        for i, t in enumerate(tensors):
            if not on_gpu(t) and t.numel():
                out[i] = _crc32c.crc32c(t.numpy())
        if dev:
            with self._stream(tensors[dev[0]].device):
                for i, c in zip(dev, crc32c_tensors([tensors[i] for i in dev])):
                    out[i] = c
        return out

    def _file_mode(self, pieces: list[Piece], datas: list[torch.Tensor], before) -> str:
        """What moved this file's device bytes. In GDS mode KvikIO still sends requests below
        its gds_threshold (16 KiB) through POSIX, and cuFile falls back per file (file system
        it does not support, O_DIRECT refused): the file counts as "gds" only if GDS carried
        at least the bytes of its device requests at or above the threshold, as KvikIO's
        statistics (26.10+) show. Without statistics, the engine's mode is all there is."""
        if self.mode != GDS or self._monitor is None:
            return self.mode
        threshold = self._kvikio.defaults.get("gds_threshold")
        expected = sum(p.length for p in pieces if p.length >= threshold and (p.span < 0 or on_gpu(datas[p.span])))
        by_backend = self._monitor.since(before).by_backend
        carried = sum(v.get("bytes_transferred", 0) for k, v in by_backend.items() if k.upper() == "GDS")
        if expected and carried >= expected:
            return GDS
        log_once("gds-file-compat", "gdswriter: in GDS mode, cuFile moved a file's device bytes through its POSIX "
                                    "compat path (a file system GDS does not support, O_DIRECT refused, or only "
                                    "requests below KvikIO's gds_threshold); such files are recorded as kvikio-compat")
        return COMPAT

    # -- write -------------------------------------------------------------
    def write_file(self, path, spans: Sequence[WriteSpan], *, size: int | None = None, durable: bool = True) -> list[int]:
        size = checked_write_size(spans, size)
        path = os.fspath(path)
        with self._lock:
            self._check_open()
            if not any(on_gpu(s.data) for s in spans):
                host = self._host_engine()
                crcs = host.write_file(path, spans, size=size, durable=durable)
                self._last_name = host.info.name
                return crcs
            datas = [s.data.detach() for s in spans]
            self._synchronize({t.device for t in datas})
            before = self._monitor.get() if self._monitor is not None else None
            pieces = plan_io([(s.offset, s.data.numel()) for s in spans], buffer_bytes=self.options.buffer_bytes)
            ok = False
            _regular_file(path, write=True)
            try:
                f = self._kvikio.CuFile(path, "w")
            except Exception as e:
                raise _io_error(e, path, 0, "open") from e
            try:
                crcs = self._write_pieces(f, path, datas, pieces)
                try:
                    os.ftruncate(f.fileno(), size)
                    if durable:
                        os.fdatasync(f.fileno())
                except OSError as e:
                    raise EngineIOError(e.errno, path, size, "fsync/ftruncate") from e
                ok = True
            finally:
                with contextlib.suppress(Exception):
                    f.close()
                if not ok:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            self._last_name = self._file_mode(pieces, datas, before)
            return crcs

    def _write_pieces(self, f, path: str, datas: list[torch.Tensor], pieces: list[Piece]) -> list[int]:
        staging_device = next(t.device for t in datas if on_gpu(t))
        bufs = self._staging_buffers(staging_device) if any(p.span < 0 for p in pieces) else []
        requests = Requests(path, write=True)
        slot_request = [-1] * len(bufs)  # the request last issued from each staging buffer
        slot = 0
        try:
            for p in pieces:
                if p.span >= 0:
                    src = datas[p.span][p.span_off:p.span_off + p.length]
                else:
                    requests.wait(slot_request[slot])  # the buffer's previous write must be done
                    src = bufs[slot][:p.length]
                    with self._stream(staging_device):
                        src.zero_()
                        for part in p.parts:
                            src[part.buf_off:part.buf_off + part.length].copy_(
                                datas[part.span][part.span_off:part.span_off + part.length], non_blocking=True)
                    self._stream_synchronize(staging_device)
                key = requests.issue(p, f.pwrite, _kvikio_buffer(src), p.length, p.file_off, self._task_size)
                if p.span < 0:
                    slot_request[slot] = key
                    slot = (slot + 1) % len(bufs)
            crcs = self._crcs(datas)  # on the GPU while the writes are in flight
            requests.wait_all()
            return crcs
        finally:
            requests.drain()

    # -- read --------------------------------------------------------------
    def read_file(self, path, spans: Sequence[ReadSpan]) -> list[int]:
        check_spans(spans)
        path = os.fspath(path)
        with self._lock:
            self._check_open()
            if not any(on_gpu(s.out) for s in spans):
                host = self._host_engine()
                crcs = host.read_file(path, spans)
                self._last_name = host.info.name
                return crcs
            file_size = _regular_file(path, write=False)
            need = max((s.end for s in spans), default=0)
            if file_size < need:
                raise TruncatedFileError(path, need, file_size)
            outs = [s.out for s in spans]
            self._synchronize({t.device for t in outs})  # nothing may still be using the destinations
            pieces = plan_io([(s.offset, s.out.numel()) for s in spans], buffer_bytes=self.options.buffer_bytes,
                             file_size=file_size)
            before = self._monitor.get() if self._monitor is not None else None
            try:
                f = self._kvikio.CuFile(path, "r")
            except Exception as e:
                raise _io_error(e, path, 0, "open") from e
            try:
                self._read_pieces(f, path, outs, pieces)
            finally:
                with contextlib.suppress(Exception):
                    f.close()
            self._last_name = self._file_mode(pieces, outs, before)
            return self._crcs(outs)

    def _read_pieces(self, f, path: str, outs: list[torch.Tensor], pieces: list[Piece]) -> None:
        staging_device = next(t.device for t in outs if on_gpu(t))
        bufs = self._staging_buffers(staging_device) if any(p.span < 0 for p in pieces) else []
        requests = Requests(path, write=False)
        staged: list[tuple[int, Piece] | None] = [None] * len(bufs)  # (request, piece) reading into each buffer
        slot = 0

        def unstage(i: int) -> None:
            """Wait for buffer i's read, then copy its parts out to their spans."""
            key, p = staged[i]
            staged[i] = None
            requests.wait(key)
            with self._stream(staging_device):
                for part in p.parts:
                    outs[part.span][part.span_off:part.span_off + part.length].copy_(
                        bufs[i][part.buf_off:part.buf_off + part.length], non_blocking=True)
            self._stream_synchronize(staging_device)  # the buffer is reused next: the copies must be done

        try:
            for p in pieces:
                if p.span >= 0:
                    dst = outs[p.span][p.span_off:p.span_off + p.length]
                else:
                    if staged[slot] is not None:
                        unstage(slot)
                    dst = bufs[slot][:p.length]
                key = requests.issue(p, f.pread, _kvikio_buffer(dst), p.length, p.file_off, self._task_size)
                if p.span < 0:
                    staged[slot] = (key, p)
                    slot = (slot + 1) % len(bufs)
            for i in range(len(staged)):  # oldest first
                if staged[(slot + i) % len(staged)] is not None:
                    unstage((slot + i) % len(staged))
            requests.wait_all()
        finally:
            requests.drain()

    def _stream_synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._streams[device].synchronize()


class Requests:
    """KvikIO futures in flight for one file. Each future is waited for exactly once (a
    KvikIO future cannot be asked twice); failures and short transfers raise typed errors."""

    def __init__(self, path: str, *, write: bool):
        self.path, self.write = path, write
        self.what = "write" if write else "read"
        self.pending: dict[int, tuple[Piece, object]] = {}
        self._next = 0

    def issue(self, piece: Piece, start: Callable, *args) -> int:
        """Start ``start(*args)`` (KvikIO's pread/pwrite) for ``piece``; returns its key."""
        try:
            fut = start(*args)
        except Exception as e:
            raise _io_error(e, self.path, piece.file_off, self.what) from e
        self._next += 1
        self.pending[self._next] = (piece, fut)
        return self._next

    def wait(self, key: int) -> None:
        if key not in self.pending:
            return
        p, fut = self.pending.pop(key)
        try:
            n = fut.get()
        except Exception as e:
            raise _io_error(e, self.path, p.file_off, self.what) from e
        if n != p.length:
            if self.write:
                raise EngineIOError(errno.EIO, self.path, p.file_off + n, "KvikIO write",
                                    f"only {n} of {p.length} bytes were written; the device may be failing")
            raise ShortIOError(self.path, p.file_off + n, p.length - n)

    def wait_all(self) -> None:
        for key in sorted(self.pending):
            self.wait(key)

    def drain(self) -> None:
        """After an error: wait out every request, since KvikIO's threads may still use the file
        and the memory. An interruption (a second Ctrl-C) is held until all have returned, then
        re-raised: the caller closes the file next, and its descriptor must be idle by then."""
        interrupted: BaseException | None = None
        for _, fut in self.pending.values():
            for _attempt in range(1000):  # each interruption re-waits; a finished future returns at once
                try:
                    fut.get()
                except Exception:  # noqa: BLE001 - the first error is already being raised
                    pass
                except BaseException as e:  # noqa: BLE001 - re-raised below, once nothing is in flight
                    interrupted = interrupted or e
                    continue
                break
        self.pending.clear()
        if interrupted is not None:
            raise interrupted
