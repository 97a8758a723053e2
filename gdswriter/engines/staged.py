"""Staged fallback engines: aligned page-locked buffers + io_uring or POSIX threads.

One pipeline serves both engines. Writes stream the file front to back: the
next staging buffer is filled (copy + crc32c) while earlier ones are in flight,
so the CPU work and the device work overlap and thousands of small tensors
become a few large requests. Reads run the same way in reverse. The backends
differ only in how a request reaches the kernel.

Zero-copy: a large span at a 4 KiB-aligned file offset whose host memory is as
aligned as O_DIRECT needs on that file skips the staging buffers: the kernel moves
its whole 4 KiB blocks straight between the tensor and the file, and only the
crc32c pass touches them on the CPU. Its last partial block, if any, is staged like
any small span. The memory alignment comes from statx (512 bytes on a virtio disk,
4 on NVMe, where torch's 64-byte-aligned tensors qualify); 4 KiB when unreported.

Device memory: only tensors on device "cpu" are host memory (memmove, zero-copy).
Any other device goes through torch's copy_ into or out of one staging buffer at a
time (memory stays bounded): CUDA, with the buffers registered as page-locked at the
first CUDA tensor (buffers.py), and XPU, MPS or any device torch copies to and from
the host, whose pointers are never read as host memory. Meta tensors hold no data
and are refused (InvalidOptionError).

Failures: see StagedEngine. Data files: see StagedEngine._open and open_regular.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence

import crc32c as _crc32c

from .base import EngineInfo, IOEngine, ReadSpan, SpanGuards, WriteSpan, check_spans, checked_write_size
from ..errors import (EngineIOError, EngineUnavailableError, GDSWriterError,
                      InvalidOptionError, ShortIOError, TruncatedFileError)
from ..options import ALIGN, EngineOptions
from .._log import log, log_once
from . import uring
from .buffers import AlignedBufferPool, StagingBuffer
from .dio import direct_io_alignment
from ..fs import closed_on_failure, open_regular

crc_extend = _crc32c.crc32c  # crc32c(bytes, crc): a seam, like copy_bytes (tests count what it sums)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_MERGE_GAP = 1 << 20  # read through gaps smaller than this rather than issuing another request
_MIN_BUFFER = 64 << 10  # the smallest staging buffer a read sizes its pool to (see StagedEngine._staging)
ZERO_COPY_MIN = 1 << 20  # smaller spans are cheaper to coalesce through the staging buffers
FUSED_BYTES = 1 << 20  # copy and checksum this much at a time, so the checksum reads cache (L2), not DRAM;
# 1 MiB pieces cost the same CPU as 256 KiB ones here, with a quarter of the Python iterations


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def _direct_length(t, file_off: int, memory_alignment: int) -> int:
    """How many leading bytes of span tensor ``t`` at ``file_off`` can move between the tensor
    and an O_DIRECT file without staging: its whole 4 KiB blocks, when the span is large, the
    offset 4 KiB-aligned and the address a multiple of ``memory_alignment``; else 0."""
    if t.device.type != "cpu" or file_off % ALIGN or t.data_ptr() % memory_alignment:
        return 0
    n = _align_down(t.numel())
    return n if n >= ZERO_COPY_MIN else 0


_QUIESCE_TRIES = 5  # interruptions (Ctrl-C) tolerated while quiescing before giving up and keeping everything
_KEPT: list[tuple] = []  # what quiesced-unclean backends may still touch: never released (see StagedEngine)


def kept_for_good() -> tuple[tuple, ...]:
    """What engines kept for the rest of the process (backend, pool, fd, spans) because their
    requests could not be waited for after a failure (see _keep_forever); for diagnosis."""
    return tuple(_KEPT)


def _keep_forever(*things) -> None:
    """Keep ``things`` (a backend, its pool, an fd number, spans) alive and open for the rest of
    the process: requests that could not be waited for may still use them."""
    _KEPT.append(things)
    log.warning("gdswriter: I/O requests could not be waited for after a failure; their file descriptor, "
                "staging buffers and tensors are kept (never freed) so that nothing else can receive their "
                "bytes. The engine continues with fresh buffers. Check the kernel log (dmesg)")


def _ring_failed(e: OSError, path: str, reqs: dict) -> EngineIOError:
    """io_uring_enter failed: the typed error, at the lowest file offset still outstanding."""
    offset = min((r.file_off for r in reqs.values()), default=0)
    hint = ""
    if e.errno in (errno.EAGAIN, errno.EBUSY):
        hint = ("the kernel would not take more io_uring requests (memory pressure, or too many in flight): "
                "lower queue_depth (GDSWRITER_QUEUE_DEPTH), retry, or use engine='posix'")
    return EngineIOError(e.errno, path, offset, "io_uring_enter", hint)


def _direct_buffer(t) -> StagingBuffer:
    """Host tensor ``t`` (flat uint8, aligned) seen as an unregistered buffer the backends can use."""
    return StagingBuffer(-1, t.data_ptr(), t.numel(), memoryview(t.numpy()), t)


def copy_bytes(dst, dst_off: int, src, src_off: int, n: int) -> None:
    """Copy n bytes between flat uint8 tensors. Host to host (both on device "cpu") uses memmove
    (releases the GIL, one thread, ~memory speed); torch's copy_ splits small copies across
    threads and ran 4x slower on a loaded 2-core machine. Any other device (CUDA, and XPU, MPS
    or whatever else torch can copy to and from the host) goes through copy_, which reaches
    its memory through its own runtime; a device pointer is never read as host memory. A seam:
    every staging copy goes through this module-level name, so tests wrap it (monkeypatch) to
    count staged bytes or make the n-th copy fail."""
    if dst.is_cpu and src.is_cpu:
        ctypes.memmove(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n)
    else:
        dst[dst_off:dst_off + n].copy_(src[src_off:src_off + n])


def _stage_in(buf: StagingBuffer, lo: int, src, src_off: int, n: int, crc: int) -> int:
    """Copy n bytes of ``src`` into ``buf`` at ``lo``; return ``crc`` extended over them. Host
    memory goes in cache-sized pieces, each checksummed right after its copy: 25% less CPU
    than one pass of each over DRAM (measured here: 4.1 against 3.3 GiB/s). Device memory
    moves in one copy (at most one staging buffer: memory stays bounded)."""
    step = FUSED_BYTES if src.is_cpu else n
    for k in range(0, n, step):
        m = min(step, n - k)
        copy_bytes(buf.tensor, lo + k, src, src_off + k, m)
        crc = crc_extend(buf.view[lo + k:lo + k + m], crc)
    return crc


def _stage_out(buf: StagingBuffer, lo: int, dst, dst_off: int, n: int, crc: int) -> int:
    """The reverse of _stage_in: checksum each piece of ``buf``, then copy it out of cache."""
    step = FUSED_BYTES if dst.is_cpu else n
    for k in range(0, n, step):
        m = min(step, n - k)
        crc = crc_extend(buf.view[lo + k:lo + k + m], crc)
        copy_bytes(dst, dst_off + k, buf.tensor, lo + k, m)
    return crc


# ---------------------------------------------------------------------------
# Backends: submit (fd, buffer slice, file offset) and report (tag, result).
# ---------------------------------------------------------------------------
class _UringBackend:
    def __init__(self, depth: int, register: bool):
        entries = 1 << max(depth - 1, 0).bit_length()
        self.ring = uring.IoUring(entries)
        self.capacity = depth
        self.register = register
        self.registered = False

    def use_pool(self, pool: AlignedBufferPool) -> None:
        """Register ``pool``'s buffers for READ_FIXED/WRITE_FIXED in place of the previous pool's
        (nothing in flight: the engine swaps pools between transfers only)."""
        if not self.register:
            return
        try:
            if self.ring.registered_buffers:
                self.ring.unregister_buffers()
            self.ring.register_buffers(pool.regions())
            self.registered = True
        except OSError as e:
            self.registered = False
            log_once("uring-register", f"gdswriter: io_uring buffer registration refused ({e.strerror}); "
                                       f"using unregistered buffers (raise `ulimit -l` to allow it)")

    @property
    def in_flight(self) -> int:
        return self.ring.in_flight

    def submit(self, write: bool, fd: int, buf: StagingBuffer, start: int, length: int, file_off: int, tag: int):
        if self.registered and buf.index >= 0:  # index -1: a span's own memory (zero-copy)
            self.ring.prep(uring.OP_WRITE_FIXED if write else uring.OP_READ_FIXED, fd, buf.address + start,
                           length, file_off, tag, buf.index)
        else:
            self.ring.prep(uring.OP_WRITE if write else uring.OP_READ, fd, buf.address + start, length,
                           file_off, tag)

    def flush(self) -> None:
        self.ring.submit()

    def wait(self, min_n: int = 1) -> list[tuple[int, int]]:
        return self.ring.wait(min_n)

    def quiesce(self) -> bool:
        """Withdraw queued requests, wait for submitted ones. False: the kernel would not let us."""
        return self._succeeds(self.ring.drain)

    def close(self) -> bool:
        """Close the ring; False when requests may outlive it (see IoUring.close)."""
        return self._succeeds(self.ring.close)

    @staticmethod
    def _succeeds(step) -> bool:
        try:
            step()
        except uring.RingError:
            return False
        return True


class _PosixBackend:
    """A thread pool of pread/pwrite: works wherever files work.

    ``in_flight`` is raised before a request is handed to the pool and lowered after its
    completion was taken, so an interruption can leave it too high (then the engine
    quiesces), never too low."""

    register = False  # pread/pwrite take any memory: no buffers to register

    def __init__(self, depth: int):
        self.capacity = depth
        self.registered = False
        self._start()

    def use_pool(self, pool: AlignedBufferPool) -> None:
        """Nothing to register."""

    def _start(self) -> None:
        self.in_flight = 0
        self._pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="gdswriter-io")
        self._done: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()

    def _run(self, write: bool, fd: int, view: memoryview, file_off: int, tag: int) -> None:
        try:
            n = os.pwrite(fd, view, file_off) if write else os.preadv(fd, [view], file_off)
        except OSError as e:
            n = -(e.errno or errno.EIO)
        except BaseException:  # never lose a completion
            n = -errno.EIO
        self._done.put((tag, n))

    def submit(self, write: bool, fd: int, buf: StagingBuffer, start: int, length: int, file_off: int, tag: int):
        self.in_flight += 1
        self._pool.submit(self._run, write, fd, buf.view[start:start + length], file_off, tag)

    def flush(self) -> None:
        pass

    def wait(self, min_n: int = 1) -> list[tuple[int, int]]:
        out = [self._done.get() for _ in range(min_n)]
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(out)
        return out

    def quiesce(self) -> bool:
        """Cancel the requests no worker started and wait for the workers to finish the ones
        they run (joining the threads proves it), then start a fresh pool: always True."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._start()
        return True

    def close(self) -> bool:
        self._pool.shutdown(wait=True, cancel_futures=True)
        return True


# ---------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------
class _Request:
    __slots__ = ("chunk", "buf_start", "length", "file_off", "expect")

    def __init__(self, chunk, buf_start, length, file_off, expect):
        self.chunk, self.buf_start, self.length, self.file_off, self.expect = chunk, buf_start, length, file_off, expect


class _Chunk:
    """A file range in one buffer; done when all its requests completed. ``span`` >= 0: the
    buffer is that span's own memory (zero-copy), else a staging buffer of the pool."""

    __slots__ = ("file_off", "length", "buf", "pending", "span")

    def __init__(self, file_off: int, length: int, buf: StagingBuffer, span: int = -1):
        self.file_off, self.length, self.buf, self.pending, self.span = file_off, length, buf, 0, span


class StagedEngine(IOEngine):
    """Shared pipeline; subclasses choose the backend.

    After a failure: when a transfer stops early (an I/O error, a failed io_uring_enter, Ctrl-C,
    any exception), the backend is quiesced before the file is closed, so no request, in the
    kernel or in a worker thread, can act on the fd (or on another file that reuses its number)
    or on memory the caller gets back. Then the engine is clean and usable again. Where the
    backend cannot prove that (io_uring_enter keeps failing), everything the old requests may
    still touch is kept for good: the fd is never closed, the staging buffers and the spans'
    tensors are never freed (a leak, logged, on a path that needs a misbehaving kernel), and
    the next call builds a fresh backend and pool.
    """

    name = "staged"
    honours_span_guards = True

    def __init__(self, options: EngineOptions | None = None, *, reason: str = ""):
        self.options = options or EngineOptions.from_env()
        self._pool: AlignedBufferPool | None = None  # built by the first transfer that stages (_staging)
        self._backend = self._make_backend()
        self._broken = False  # the backend may still have requests in the kernel: see _quiesce
        self._reason = reason
        self._last_memory_alignment = ALIGN if self.options.direct_io else 0  # 0: the last file was buffered
        self._lock = threading.Lock()
        self._tags = 0
        self._backlog: deque = deque()

    @property
    def broken(self) -> bool:
        """Whether the backend may still have requests in the kernel (a failure it could not wait
        out: its buffers are kept for good, and the next transfer starts on fresh ones)."""
        return self._broken

    @property
    def backlog(self) -> int:
        """Requests queued for the backend and not submitted yet (0 once a transfer ended)."""
        return len(self._backlog)

    def _make_backend(self):
        raise NotImplementedError

    def _staging(self, nbytes: int | None = None) -> AlignedBufferPool:
        """The staging pool, built (or grown) for a transfer that stages ``nbytes`` (None: device
        memory, the full options.buffer_bytes per buffer). Built only when a transfer
        stages, and then num_buffers buffers of at most buffer_bytes, each the next power of two
        (>= 64 KiB) of an equal share of ``nbytes``: a load or write that goes zero-copy maps, locks and
        registers nothing, or a few small buffers, instead of 8 x 16 MiB (0.35 s of CPU here).
        Kept for the next transfers; replaced by a larger one only when one needs more (sizes
        double, so growing costs at most the final pool's cost again)."""
        o = self.options
        size = o.buffer_bytes
        if nbytes is not None:
            size = min(size, max(_MIN_BUFFER, 1 << (-(-nbytes // o.num_buffers) - 1).bit_length()))
        old = self._pool
        if old is not None and old.size >= size:
            return old
        pool = AlignedBufferPool(size, o.num_buffers, lock_memory=o.lock_memory, huge_pages=o.huge_pages)
        try:
            self._backend.use_pool(pool)
            if old is not None and old.cuda_device is not None:
                pool.pin_for_cuda(old.cuda_device)
        except BaseException:
            pool.close()
            raise
        self._pool = pool
        if old is not None:
            old.close()
        return pool

    @property
    def info(self) -> EngineInfo:
        """Before any transfer staged (no pool yet), page_locked and huge_page_buffers say what was
        asked for (options.lock_memory, huge_pages); after, what the pool got."""
        pool = self._pool
        locked = pool.locked if pool else self.options.lock_memory
        huge = pool.huge_pages if pool else self.options.huge_pages
        registered = self._backend.registered if pool else self._backend.register
        return EngineInfo(self.name, self._last_memory_alignment > 0, registered, locked,
                          self._reason, self._last_memory_alignment, huge)

    def _check_open(self) -> None:
        if self._backend is None:
            raise GDSWriterError(f"this {self.name} engine is closed: create a new one")
        if not self._broken and (self._backlog or self._backend.in_flight):
            # A transfer was cut short before its cleanup could run (Ctrl-C at the worst moment).
            _, interrupted = self._quiesce(())
            if interrupted is not None:
                raise interrupted
        if self._broken:
            self._pool, self._backend = None, self._make_backend()
            self._broken = False

    def close(self) -> None:
        if self._backend is None:
            return
        backend, self._backend = self._backend, None
        if self._broken:
            return  # backend and pool are kept for good (see _quiesce)
        if backend.close():
            if self._pool is not None:
                self._pool.close()
        else:
            _keep_forever(backend, self._pool)

    # -- after a failure -----------------------------------------------------
    def _quiesce(self, spans: Sequence, fd: int = -1) -> tuple[bool, BaseException | None]:
        """Stop what the failed transfer left queued or in flight and make sure nothing can act
        on ``fd``, the staging buffers or the spans' memory any more. An exception raised while
        waiting (a second Ctrl-C) does not cut this short: it is returned, for the caller to raise
        once the engine is safe. Returns (clean, that exception): not clean means the backend
        could not prove it, and all of it is kept for good (see the class docstring)."""
        self._backlog.clear()
        interrupted = None
        clean = False
        for _ in range(_QUIESCE_TRIES):
            try:
                clean = self._backend.quiesce()
                break
            except BaseException as e:  # noqa: BLE001 - finish tearing down first, raise it after
                interrupted = interrupted or e
        if not clean:
            _keep_forever(self._backend, self._pool, fd, tuple(spans))
            self._broken = True
        return clean, interrupted

    def _release(self, fd: int, ok: bool, spans: Sequence) -> None:
        """Close ``fd`` at the end of a transfer; after a failure, only once nothing can act on
        it (else it stays open, so its number is never reused while a request may name it)."""
        interrupted = None
        if not ok or self._backlog or self._backend.in_flight:
            clean, interrupted = self._quiesce(spans, fd)
            if not clean:
                fd = -1
        if fd >= 0:
            os.close(fd)
        if interrupted is not None:
            raise interrupted

    def prepare_memory(self, tensors) -> None:
        """Refuse span memory the engine cannot move; register the staging buffers with CUDA
        when the first CUDA tensor comes (never before: CPU-only jobs never touch CUDA)."""
        for t in tensors:
            if t.is_cpu:
                continue
            if t.is_meta:
                raise InvalidOptionError("a span's tensor is on the meta device and holds no data: materialize it "
                                         "(e.g. module.to_empty(device=...)) before saving or loading into it")
            if t.is_cuda and not self._staging().cuda_pinned:
                self._pool.pin_for_cuda(t.device)  # type: ignore[union-attr]

    # -- files -------------------------------------------------------------
    def _open(self, path: str, write: bool) -> tuple[int, int]:
        """Open ``path`` for writing (created, or emptied) or reading, with O_DIRECT where asked
        for and possible. Returns the fd and the host-memory alignment its direct I/O needs
        (0: buffered). The engine's requests and the format are aligned to 4 KiB, so a file
        needing more is used buffered. Only a regular file is used: see open_regular."""
        where = os.path.dirname(os.path.abspath(path))
        fd, direct = open_regular(path, write, direct=self.options.direct_io)
        with closed_on_failure(fd, path):
            # Back to blocking: io_uring fails requests on an O_NONBLOCK file with EAGAIN.
            keep = fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK
            memory_alignment = ALIGN if direct else 0
            need = direct_io_alignment(fd) if direct else None
            if need is not None:
                if need.memory <= ALIGN and need.offset <= ALIGN:
                    memory_alignment = need.memory
                else:
                    keep &= ~os.O_DIRECT
                    memory_alignment = 0
                    log_once(f"bigdirect:{where}",
                             f"gdswriter: O_DIRECT under {where} needs {need.offset}-byte aligned offsets and "
                             f"{need.memory}-byte aligned memory, more than the 4 KiB gdswriter aligns to; "
                             f"using buffered I/O followed by fsync there")
            fcntl.fcntl(fd, fcntl.F_SETFL, keep)
        if self.options.direct_io and not direct:
            log_once(f"nodirect:{where}", f"gdswriter: the file system under {where} refuses O_DIRECT; "
                                          f"using buffered I/O followed by fsync there")
        return fd, memory_alignment

    def _opened(self, path: str, write: bool) -> tuple[int, int]:
        """_open, remembering for ``info`` how the file was opened."""
        fd, memory_alignment = self._open(path, write)
        self._last_memory_alignment = memory_alignment
        return fd, memory_alignment

    # -- request bookkeeping ---------------------------------------------------
    def _submit(self, write: bool, fd: int, req: _Request, reqs: dict[int, _Request], *, first: bool = False) -> None:
        """Queue a request (``first``: ahead of the others); it goes to the kernel as soon as
        fewer than queue_depth are in flight."""
        self._tags += 1
        reqs[self._tags] = req
        req.chunk.pending += 1
        (self._backlog.appendleft if first else self._backlog.append)((write, fd, req, self._tags))
        self._pump()

    def _pump(self) -> None:
        backend, backlog = self._backend, self._backlog
        while backlog and backend.in_flight < backend.capacity:
            write, fd, req, tag = backlog.popleft()
            backend.submit(write, fd, req.chunk.buf, req.buf_start, req.length, req.file_off, tag)

    def _complete(self, write: bool, fd: int, path: str, reqs: dict[int, _Request], min_n: int) -> list[_Chunk]:
        """Wait for completions; resubmit short transfers; return chunks that finished."""
        finished = []
        self._backend.flush()
        for tag, res in self._backend.wait(min_n):
            req = reqs.pop(tag)
            req.chunk.pending -= 1
            if res < 0:
                raise EngineIOError(-res, path, req.file_off, "write" if write else "read")
            if res < req.expect:
                if res == 0:
                    if write:
                        raise EngineIOError(errno.EIO, path, req.file_off, "write",
                                            "the kernel accepted zero bytes; the device may be failing")
                    raise ShortIOError(path, req.file_off, req.expect)
                # A short transfer: continue from where it stopped.
                rest = _Request(req.chunk, req.buf_start + res, req.length - res, req.file_off + res, req.expect - res)
                self._submit(write, fd, rest, reqs, first=True)
                continue
            if req.chunk.pending == 0:
                finished.append(req.chunk)
        self._pump()
        self._backend.flush()
        return finished

    def _queue_chunk(self, write: bool, fd: int, chunk: _Chunk, file_size: int | None, reqs) -> None:
        step = self.options.request_bytes
        for start in range(0, chunk.length, step):
            n = min(step, chunk.length - start)
            off = chunk.file_off + start
            expect = n if file_size is None else max(0, min(n, file_size - off))
            if expect == 0:
                continue
            self._submit(write, fd, _Request(chunk, start, n, off, expect), reqs)

    # -- write -------------------------------------------------------------
    def write_file(self, path, spans: Sequence[WriteSpan], *, size: int | None = None, durable: bool = True) -> list[int]:
        size = checked_write_size(spans, size)
        path = os.fspath(path)
        with self._lock:
            self._check_open()
            self.prepare_memory(s.data for s in spans)
            fd, memory_alignment = self._opened(path, write=True)
            direct = memory_alignment > 0
            ok = False
            try:
                crcs = self._write_fd(fd, path, spans, size, memory_alignment)
                try:
                    os.ftruncate(fd, size)
                    if durable:
                        os.fdatasync(fd) if direct else os.fsync(fd)
                except OSError as e:
                    raise EngineIOError(e.errno, path, size, "fsync/ftruncate") from e
                ok = True
                return crcs
            finally:
                try:
                    self._release(fd, ok, spans)
                finally:
                    if not ok:
                        try:
                            os.unlink(path)
                        except OSError:
                            pass

    def _write_fd(self, fd: int, path: str, spans: Sequence[WriteSpan], size: int, memory_alignment: int) -> list[int]:
        total = _align_up(size) if memory_alignment else size
        if self.options.preallocate and total and _libc.fallocate(fd, 0, 0, total) != 0:
            e = ctypes.get_errno()
            if e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise EngineIOError(e, path, 0, "preallocate")
            # EOPNOTSUPP etc.: the file system cannot preallocate; the writes still work.
        crcs = [0] * len(spans)
        reqs: dict[int, _Request] = {}
        plan = self._write_plan(spans, total, memory_alignment)
        free = list(self._pool.buffers) if any(j < 0 for _, _, j in plan) else []  # built by _write_plan
        window = 2 * self.options.num_buffers  # chunks in flight at most (zero-copy ones need no staging buffer)
        outstanding = 0
        si = 0
        guards = SpanGuards.of(spans)  # spans whose bytes a producer is still filling (WriteSpan.guard)
        try:
            for off, n, j in plan:
                while outstanding >= window or (j < 0 and not free) or (guards and not guards.ready(off, off + n)):
                    if not reqs:  # only the producer can make progress
                        guards.wait(off, off + n)  # type: ignore[union-attr]
                        continue
                    finished = self._complete(True, fd, path, reqs, 1)
                    outstanding -= len(finished)
                    free.extend(c.buf for c in finished if c.span < 0)
                    for c in finished if guards else ():
                        if c.span >= 0:
                            guards.unhold(c.span)
                if j >= 0:  # the span's own aligned bytes: checksum them, then write them as they are
                    s = spans[j]
                    buf = _direct_buffer(s.data[off - s.offset:off - s.offset + n])
                    if s.checksum:
                        crcs[j] = crc_extend(buf.view, crcs[j])
                    if guards:
                        guards.hold(j)
                        if off + n == s.end:
                            guards.read(j)
                else:
                    buf = free.pop()
                    si = self._fill(buf, off, n, spans, si, crcs, guards)
                self._queue_chunk(True, fd, _Chunk(off, n, buf, j), None, reqs)
                outstanding += 1
                self._backend.flush()
            while reqs:
                self._complete(True, fd, path, reqs, 1)
        except uring.RingError as e:  # the caller (write_file) quiesces the backend before closing fd
            raise _ring_failed(e, path, reqs) from e
        finally:
            # Written spans are the kernel's to read until quiesced; releasing them early can at worst
            # let a producer change bytes of a file that failed and is being removed.
            if guards:
                guards.release_all()
        return crcs

    def _write_plan(self, spans: Sequence[WriteSpan], total: int, memory_alignment: int) -> list[tuple[int, int, int]]:
        """The file [0, total) cut into pieces in file order: (file_off, length, span), span >= 0
        for a piece written straight from that span's memory, -1 for a staged one. Under O_DIRECT
        (``memory_alignment`` > 0) every piece starts on a 4 KiB boundary. The staging pool is
        sized to the staged bytes (_staging), as for reads: a write that goes almost all
        zero-copy (many tensors copied into one snapshot region) builds a few 64 KiB buffers,
        not num_buffers x buffer_bytes of page-locked memory; staged pieces are cut to its
        buffer size, zero-copy ones to buffer_bytes."""
        extents: list[tuple[int, int, int]] = []  # (lo, hi, span), uncut
        pos = 0
        for j, s in enumerate(spans if memory_alignment and self.options.zero_copy else ()):
            d = _direct_length(s.data, s.offset, memory_alignment)
            if d:
                if s.offset > pos:
                    extents.append((pos, s.offset, -1))
                extents.append((s.offset, s.offset + d, j))
                pos = s.offset + d
        if total > pos:
            extents.append((pos, total, -1))
        staged = sum(hi - lo for lo, hi, j in extents if j < 0)
        stage_size = self._staging(staged).size if staged else 0
        pieces: list[tuple[int, int, int]] = []
        for lo, hi, j in extents:
            step = stage_size if j < 0 else self.options.buffer_bytes
            pieces.extend((o, min(step, hi - o), j) for o in range(lo, hi, step))
        return pieces

    @staticmethod
    def _fill(buf: StagingBuffer, file_off: int, n: int, spans: Sequence[WriteSpan], si: int, crcs: list[int],
              guards: SpanGuards | None = None) -> int:
        """Copy the spans' bytes that fall in [file_off, file_off+n) into ``buf``; zero the gaps.
        ``guards``: told when a span's last byte is copied."""
        pos, end = file_off, file_off + n
        while pos < end:
            while si < len(spans) and spans[si].end <= pos:
                si += 1
            if si == len(spans) or spans[si].offset >= end:
                ctypes.memset(buf.address + pos - file_off, 0, end - pos)
                break
            s = spans[si]
            if s.offset > pos:
                ctypes.memset(buf.address + pos - file_off, 0, s.offset - pos)
                pos = s.offset
            a, b = pos - s.offset, min(s.end, end) - s.offset
            if s.checksum:
                crcs[si] = _stage_in(buf, pos - file_off, s.data, a, b - a, crcs[si])
            else:
                copy_bytes(buf.tensor, pos - file_off, s.data, a, b - a)
            pos = s.offset + b
            if guards and pos == s.end:
                guards.read(si)
        return si

    # -- read --------------------------------------------------------------
    def read_file(self, path, spans: Sequence[ReadSpan]) -> list[int]:
        check_spans(spans)
        path = os.fspath(path)
        with self._lock:
            self._check_open()
            self.prepare_memory(s.out for s in spans)
            fd, memory_alignment = self._opened(path, write=False)
            ok = False
            try:
                size = os.fstat(fd).st_size
                need = max((s.end for s in spans), default=0)
                if size < need:
                    raise TruncatedFileError(path, need, size)
                crcs = self._read_fd(fd, path, spans, size, memory_alignment)
                ok = True
                return crcs
            finally:
                self._release(fd, ok, spans)

    def _read_chunks(self, spans: Sequence[ReadSpan], memory_alignment: int) -> list[tuple[int, int, int]]:
        """Merge the spans into extents (4 KiB-aligned under O_DIRECT, ``memory_alignment`` > 0),
        then cut them into buffer-sized chunks in file order: (file_off, length, span), span >= 0
        for a chunk read straight into that span's memory (zero-copy), -1 for one read through
        a staging buffer."""
        direct = memory_alignment > 0
        extents: list[list[int]] = []  # [lo, hi, span]; only staged extents (span -1) merge
        for j, s in enumerate(spans):
            n = s.out.numel()
            if n == 0:
                continue
            d = _direct_length(s.out, s.offset, memory_alignment) if direct and self.options.zero_copy else 0
            if d:
                extents.append([s.offset, s.offset + d, j])
                if d == n:
                    continue
            lo = s.offset + d if d else (_align_down(s.offset) if direct else s.offset)
            hi = _align_up(s.end) if direct else s.end
            if extents and extents[-1][2] < 0 and lo - extents[-1][1] < _MERGE_GAP:
                extents[-1][1] = max(extents[-1][1], hi)
            else:
                extents.append([lo, hi, -1])
        staged = sum(hi - lo for lo, hi, j in extents if j < 0)
        stage_size = self._staging(staged).size if staged else 0
        out = []
        for lo, hi, j in extents:
            step = stage_size if j < 0 else self.options.buffer_bytes  # zero-copy: cut as ever
            out.extend((o, min(step, hi - o), j) for o in range(lo, hi, step))
        return out

    def _read_fd(self, fd: int, path: str, spans: Sequence[ReadSpan], size: int, memory_alignment: int) -> list[int]:
        chunks = self._read_chunks(spans, memory_alignment)
        crcs = [0] * len(spans)
        reqs: dict[int, _Request] = {}
        free = list(self._pool.buffers) if any(j < 0 for _, _, j in chunks) else []  # built by _read_chunks
        window = 2 * self.options.num_buffers  # chunks read ahead of the one being drained
        done: dict[int, _Chunk] = {}
        by_id: dict[int, int] = {}
        next_submit = next_drain = 0
        si = 0
        try:
            while next_drain < len(chunks):
                while next_submit < len(chunks) and next_submit - next_drain < window:
                    off, n, j = chunks[next_submit]
                    if j >= 0:
                        s = spans[j]
                        c = _Chunk(off, n, _direct_buffer(s.out[off - s.offset:off - s.offset + n]), j)
                    elif free:
                        c = _Chunk(off, n, free.pop())
                    else:
                        break
                    by_id[id(c)] = next_submit
                    self._queue_chunk(False, fd, c, size, reqs)
                    if c.pending == 0:  # wholly past EOF cannot happen (size checked); keep order anyway
                        done[next_submit] = c
                    next_submit += 1
                # Hand the new requests to the kernel now, not at the next wait: the chunks
                # drained below take CPU time that the device should spend reading.
                self._backend.flush()
                if next_drain not in done:
                    for c in self._complete(False, fd, path, reqs, 1):
                        done[by_id.pop(id(c))] = c
                while next_drain in done:
                    c = done.pop(next_drain)
                    if c.span >= 0:  # read in place: only the checksum is left to do
                        if spans[c.span].checksum:
                            crcs[c.span] = crc_extend(c.buf.view, crcs[c.span])
                    else:
                        si = self._drain_chunk(c, spans, si, crcs)
                        free.append(c.buf)
                    next_drain += 1
        except uring.RingError as e:  # the caller (read_file) quiesces the backend before closing fd
            raise _ring_failed(e, path, reqs) from e
        return crcs

    @staticmethod
    def _drain_chunk(c: _Chunk, spans: Sequence[ReadSpan], si: int, crcs: list[int]) -> int:
        """Copy the chunk's bytes out to every span it overlaps, updating their crc32c."""
        lo, hi = c.file_off, c.file_off + c.length
        while si < len(spans) and spans[si].end <= lo:
            si += 1
        j = si
        while j < len(spans) and spans[j].offset < hi:
            s = spans[j]
            a, b = max(lo, s.offset), min(hi, s.end)
            if b > a and s.checksum:
                crcs[j] = _stage_out(c.buf, a - lo, s.out, a - s.offset, b - a, crcs[j])
            elif b > a:
                copy_bytes(s.out, a - s.offset, c.buf.tensor, a - lo, b - a)
            if s.end > hi:
                break
            j += 1
        return si


class IoUringEngine(StagedEngine):
    """io_uring + O_DIRECT from registered, page-locked buffers."""

    name = "io_uring"

    def _make_backend(self):
        why = uring.probe()
        if why:
            raise EngineUnavailableError(errno.ENOTSUP, f"io_uring is unavailable: {why}. Use engine='posix' "
                                                        f"(GDSWRITER_ENGINE=posix)")
        return _UringBackend(self.options.queue_depth, self.options.register_buffers)


class PosixEngine(StagedEngine):
    """pread/pwrite from a thread pool; for kernels or sandboxes without io_uring."""

    name = "posix"

    def _make_backend(self):
        return _PosixBackend(self.options.queue_depth)
