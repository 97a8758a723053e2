"""Reference measurements of a directory's disk, shared by the demo, `gdswriter bench` and
the benchmarks: fio's bandwidth (when installed), a plain O_DIRECT loop, memory available,
and what file system lies under a path."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import subprocess
import time
from pathlib import Path

from .pagecache import drop_caches, evict
from .units import KiB, MiB


def cold(path: str | os.PathLike, state: dict) -> None:
    """Evict ``path`` from the page cache (and drop the whole cache where allowed; ``state``
    remembers whether that worked)."""
    evict(path)
    state["dropped"] = drop_caches() and state.get("dropped", True)


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


def raw_reference(path: Path, size: int, pattern: memoryview, cache: dict) -> tuple[float, float, bool]:
    """A plain single-threaded, queue-depth-1 loop of 8 MiB O_DIRECT pwrite/preadv from an
    mmap'd (page-aligned) buffer: (write s incl. fdatasync, cold read s, direct?)."""
    bufsize = 8 * MiB
    mm = mmap.mmap(-1, bufsize)
    mv = memoryview(mm)
    try:
        for o in range(0, bufsize, len(pattern)):
            n = min(len(pattern), bufsize - o)
            mv[o:o + n] = pattern[:n]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        direct = True
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fd, direct = os.open(path, flags, 0o644), False
        try:
            t0 = time.perf_counter()
            off = 0
            while off < size:
                n = min(bufsize, size - off)
                w = os.pwrite(fd, mv[:n], off)
                if w <= 0:
                    raise OSError(errno.EIO, f"pwrite wrote nothing at {off}")
                off += w
            os.fdatasync(fd)
            tw = time.perf_counter() - t0
        finally:
            os.close(fd)
        cold(path, cache)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            t0 = time.perf_counter()
            off = 0
            while off < size:
                n = os.preadv(fd, [mv[:min(bufsize, size - off)]], off)
                if n <= 0:
                    raise OSError(errno.EIO, f"preadv read nothing at {off}")
                off += n
            tr = time.perf_counter() - t0
        finally:
            os.close(fd)
        return tw, tr, direct
    finally:
        mv.release()
        mm.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


class FioError(RuntimeError):
    """fio ran but gave no bandwidth (it failed, or its job reported an error)."""


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


def fio_write_read(path: Path, size: int, cache: dict) -> tuple[float, float]:
    """fio's durable write, then its cold read, of ``size`` bytes: (write B/s, read B/s)."""
    timeout = max(120.0, size / 20e6)
    try:
        w = fio_bandwidth("write", path, size, timeout=timeout)
        cold(path, cache)
        return w, fio_bandwidth("read", path, size, timeout=timeout)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return None
