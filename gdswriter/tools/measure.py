"""Reference measurements of a directory's disk, shared by the demo, `gdswriter bench` and
the benchmarks: the disk's ceiling (fio when installed, else a built-in multi-queue
O_DIRECT loop), memory available, and what file system lies under a path."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import mmap
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .pagecache import drop_caches, evict
from ..errors import FioError
from ..units import KiB, MiB


def cold(path: str | os.PathLike, state: dict) -> None:
    """Evict ``path`` from the page cache (and drop the whole cache where allowed; ``state``
    remembers whether that worked)."""
    evict(path)
    state["dropped"] = drop_caches() and state.get("dropped", True)


def evict_paths(*paths: str | os.PathLike) -> None:
    """Make the next read of these files, or of every file under these directories, cold:
    each is flushed and dropped from the page cache, then the whole cache is dropped where
    allowed. Files that vanish meanwhile are skipped."""
    for p in paths:
        p = os.fspath(p)
        files = [os.path.join(d, n) for d, _, names in os.walk(p) for n in names] if os.path.isdir(p) else [p]
        for f in files:
            with contextlib.suppress(OSError):
                evict(f)
    drop_caches()


def mount_entry(path: Path) -> tuple[str, str, str, str] | None:
    """(mount point, source device, file system type, mount options) of the file system
    holding ``path``, from /proc/self/mounts; None where it cannot be read."""
    best = None
    real = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0] if best else ""):
                best = (mnt, parts[0], parts[2], parts[3])
    return best


def mount_of(path: Path) -> str:
    """'ext4 on /dev/vda' for the file system holding ``path`` (best effort)."""
    m = mount_entry(path)
    return f"{m[2]} on {m[1]}" if m else "unknown file system"


@dataclass(frozen=True)
class Reference:
    """One measurement of the disk under a directory: durable write and cold read, bytes/s."""

    name: str           # what ran, e.g. "fio io_uring, QD16, 4 MiB"
    write_bps: float
    read_bps: float
    direct: bool = True  # False: O_DIRECT was refused and the loop ran buffered


BUILTIN_THREADS = 8
BUILTIN_BLOCK = 4 * MiB


def builtin_reference(path: Path, size: int, pattern: memoryview, cache: dict, *,
                      threads: int = BUILTIN_THREADS, block: int = BUILTIN_BLOCK) -> Reference:
    """The disk's ceiling without fio: ``threads`` threads of plain O_DIRECT ``pwrite``/``preadv``
    of ``block``-byte requests on one file (queue depth = threads), each from its own page-aligned
    buffer filled with ``pattern``. Durable write (``fdatasync`` timed), then a cold read.

    This is gdswriter's own plain code, not the engine under test (no io_uring, no staging
    pipeline): Python releases the GIL inside each system call, so the kernel sees ``threads``
    requests in flight, as fio's ``--iodepth`` does."""
    nblocks = -(-size // block)
    padded = -(-size // 4096) * 4096
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]
    views = [memoryview(b) for b in buffers]
    try:
        for v in views:
            for o in range(0, block, len(pattern)):
                n = min(len(pattern), block - o)
                v[o:o + n] = pattern[:n]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        direct = True
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fd, direct = os.open(path, flags, 0o644), False
        try:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, padded)  # as fio and the engine do
            t0 = time.perf_counter()
            _in_threads(threads, nblocks, lambda i, v: _pwrite_all(fd, v[:_block_len(i, block, padded)], i * block),
                        views)
            os.ftruncate(fd, size)
            os.fdatasync(fd)
            tw = time.perf_counter() - t0
        finally:
            os.close(fd)
        cold(path, cache)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            t0 = time.perf_counter()
            _in_threads(threads, nblocks, lambda i, v: _pread_all(fd, v[:_block_len(i, block, padded)], i * block,
                                                                   min(block, size - i * block)), views)
            tr = time.perf_counter() - t0
        finally:
            os.close(fd)
        how = "O_DIRECT" if direct else "buffered (O_DIRECT refused)"
        return Reference(f"built-in: {threads} threads x {block // MiB} MiB {how} pwrite/preadv",
                         size / tw, size / tr, direct)
    finally:
        for v in views:
            v.release()
        for b in buffers:
            with contextlib.suppress(BufferError):  # a raised error's frames still hold a slice:
                b.close()                           # the mapping goes when they do
        with contextlib.suppress(OSError):
            os.unlink(path)


def _block_len(i: int, block: int, padded: int) -> int:
    return min(block, padded - i * block)


def _in_threads(threads: int, nblocks: int, work, views: list[memoryview]) -> None:
    """Run ``work(block index, buffer)`` for every block, ``threads`` at a time; the first
    error (every short transfer and errno is one) is raised once all threads stopped."""
    counter = itertools.count()
    errors: list[BaseException] = []

    def loop(view: memoryview) -> None:
        try:
            while not errors:
                i = next(counter)  # atomic under the GIL
                if i >= nblocks:
                    return
                work(i, view)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append(e)

    pool = [threading.Thread(target=loop, args=(views[t],), daemon=True) for t in range(min(threads, nblocks))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at byte {offset + done}")
        done += n


def _pread_all(fd: int, view: memoryview, offset: int, need: int) -> None:
    got = 0
    while got < need:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(errno.EIO, f"preadv read nothing at byte {offset + got} ({need - got} more expected)")
        got += n


def fio_bandwidth(kind: str, path: str | os.PathLike, nbytes: int, *, timeout: float | None = None) -> float:
    """fio's own bandwidth (bytes/s) for one sequential job on ``path``: io_uring, O_DIRECT,
    4 MiB blocks, queue depth 16. write: a new file, --end_fsync=1 (durable); read: --readonly."""
    cmd = ["fio", "--name=gdswriter-ref", f"--filename={os.fspath(path).replace(':', chr(92) + ':')}",
           f"--rw={kind}", f"--size={nbytes}", "--bs=4M", "--iodepth=16", "--ioengine=io_uring", "--direct=1",
           "--numjobs=1", "--output-format=json", "--end_fsync=1" if kind == "write" else "--readonly"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
        if job.get("error"):
            raise ValueError(f"job error {job['error']}")
        bw = float(job[kind]["bw_bytes"])
        if bw <= 0:
            raise ValueError(f"no {kind} bandwidth reported")
        return bw
    except (ValueError, KeyError, IndexError) as e:
        why = (p.stderr.strip().splitlines() or [str(e)])[-1]
        raise FioError(f"fio {kind} failed (exit {p.returncode}): {why}\ncommand: {' '.join(cmd)}") from None


FIO_NAME = "fio io_uring, QD16, 4 MiB"


def fio_reference(path: Path, size: int, cache: dict) -> Reference:
    """fio's durable write, then its cold read, of ``size`` bytes."""
    timeout = max(120.0, size / 20e6)
    try:
        w = fio_bandwidth("write", path, size, timeout=timeout)
        cold(path, cache)
        return Reference(FIO_NAME, w, fio_bandwidth("read", path, size, timeout=timeout))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def disk_reference(path: Path, size: int, pattern: memoryview, cache: dict, *, use_fio: bool = True
                   ) -> tuple[Reference, str]:
    """The disk's ceiling for ``size`` bytes at ``path``: fio when installed (and ``use_fio``),
    else the built-in multi-queue loop. Returns (reference, why this one): the reason says
    when fio was wanted but absent or failed, so a report can print it."""
    why = "fio is installed"
    if not use_fio:
        why = "--no-fio"
    elif shutil.which("fio") is None:
        why = "fio is not installed; it is optional"
    else:
        try:
            return fio_reference(path, size, cache), why
        except (FioError, OSError, subprocess.SubprocessError) as e:
            why = f"fio failed ({' '.join(str(e).split())[:160]})"
    return builtin_reference(path, size, pattern, cache), why


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return None
