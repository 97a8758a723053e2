"""Making the next read of a file cold, for honest read measurements (demo, benchmarks)."""

from __future__ import annotations

import os


def evict(path: str | os.PathLike) -> None:
    """Flush ``path`` and drop its pages from the page cache (POSIX_FADV_DONTNEED)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            os.fdatasync(fd)  # only clean pages can be dropped
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_caches() -> bool:
    """Try to drop the whole page cache (root, outside most containers); False if refused."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False
