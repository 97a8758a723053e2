"""A stand-in for KvikIO on machines where it cannot exist (no NVIDIA driver: KvikIO's import
needs libcuda.so.1). It keeps KvikIO's Python API, as of kvikio 26.10, for what gdswriter
uses: ``CuFile(path, flags)`` with ``pread``/``pwrite(buf, size, file_offset, task_size)``
returning futures whose ``get()`` may be called once, ``close``/``fileno``; ``defaults``
(``get``, ``set``, ``is_compat_mode_preferred``); ``cufile_driver`` (``get``,
``libcufile_version``); ``memory_register``/``memory_deregister``; ``SummaryMonitor`` with
per-backend byte counts. I/O is real: pread/pwrite on the file from a thread pool, in
tasks of ``task_size``, like KvikIO's POSIX path. Errors are RuntimeErrors carrying the
strerror text, as KvikIO's C++ std::system_error arrives in Python.

Host memory only (numpy arrays / buffer protocol): the tests route CPU tensors through the
engine's device path by redirecting its ``_on_gpu`` check.
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor


class CompatMode(enum.IntEnum):
    OFF = 0
    ON = 1
    AUTO = 2


class FakeKvikio:
    """One fake KvikIO installation: its settings, the cuFile driver's answers, fault plans
    and what it was asked to do."""

    def __init__(self, *, gds_available: bool = False, compat_mode: CompatMode = CompatMode.AUTO,
                 gds_fs_supported: bool = True, with_statistics: bool = True):
        self.settings = {"compat_mode": compat_mode, "num_threads": 1, "task_size": 4 << 20,
                         "gds_threshold": 16 << 10, "bounce_buffer_size": 16 << 20,
                         "auto_direct_io_read": False, "auto_direct_io_write": True}
        self.driver = {"is_gds_available": gds_available, "allow_compat_mode": True, "major_version": 0,
                       "minor_version": 0, "poll_mode": False, "poll_thresh_size": 4,
                       "max_device_cache_size": 131072, "max_pinned_memory_size": 33554432,
                       "per_buffer_cache_size": 1024}
        self.gds_fs_supported = gds_fs_supported  # False: cuFile falls back per file (unsupported FS)
        self.fail: dict | None = None  # {"op": "write"|"read"|"open", "at": n (0-based task), "errno": e}
        self.task_delay = 0.0  # seconds each task sleeps first (keeps requests in flight)
        self.calls: list[tuple[str, int, int]] = []  # (op, file_offset, size) per pread/pwrite call
        self.registered: list[int] = []
        self.open_files = 0
        self.tasks_in_flight = 0
        self.backend_bytes = {"POSIX": 0, "GDS": 0}
        self._tasks = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.module = self._build(with_statistics)

    # -- behaviour -------------------------------------------------------------
    def compat_preferred(self) -> bool:
        mode = self.settings["compat_mode"]
        return mode == CompatMode.ON or (mode == CompatMode.AUTO and not self.driver["is_gds_available"])

    def pool(self) -> ThreadPoolExecutor:
        n = self.settings["num_threads"]
        if self._pool is None or self._pool_size != n:
            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fake-kvikio")
            self._pool_size = n
        return self._pool

    def _task(self, op: str, fd: int, view: memoryview, off: int) -> int:
        with self._lock:
            k = self._tasks
            self._tasks += 1
            self.tasks_in_flight += 1
        try:
            f = self.fail
            if f and f["op"] == op and k == f["at"]:
                raise RuntimeError(f"POSIX {op} failed: {os.strerror(f['errno'])}")
            time.sleep(self.task_delay)
            if f and f["op"] == op and k >= f["at"]:
                raise RuntimeError(f"POSIX {op} failed: {os.strerror(f['errno'])}")
            done = 0
            while done < len(view):
                try:
                    n = (os.pwrite(fd, view[done:], off + done) if op == "write"
                         else os.preadv(fd, [view[done:]], off + done))
                except OSError as e:
                    raise RuntimeError(f"POSIX {op} failed: {os.strerror(e.errno)}") from None
                if n == 0:
                    raise RuntimeError(f"POSIX {op}: unexpected end of file")
                done += n
            return done
        finally:
            with self._lock:
                self.tasks_in_flight -= 1

    def _io(self, op: str, fd: int, buf, size, file_offset: int, task_size):
        view = memoryview(buf).cast("B")
        size = len(view) if size is None else size
        task = task_size or self.settings["task_size"]
        self.calls.append((op, file_offset, size))
        gds = (not self.compat_preferred() and self.gds_fs_supported and size >= self.settings["gds_threshold"]
               and file_offset % 4096 == 0)
        futs = [self.pool().submit(self._task, op, fd, view[o:o + min(task, size - o)], file_offset + o)
                for o in range(0, size, task)]
        return _Future(futs, self, "GDS" if gds else "POSIX")

    # -- the module ------------------------------------------------------------
    def _build(self, with_statistics: bool) -> types.ModuleType:
        fake = self
        kv = types.ModuleType("kvikio")
        kv.__version__ = "26.10.00-fake"
        kv.CompatMode = CompatMode
        kv.CuFile = self._cufile_class()
        kv.memory_register = lambda buf: fake.registered.append(id(buf))
        kv.memory_deregister = lambda buf: fake.registered.remove(id(buf))
        kv.defaults = self._defaults_module()
        kv.cufile_driver = self._driver_module()
        if with_statistics:
            kv.SummaryMonitor = self._summary_monitor_class()
        return kv

    def _cufile_class(self) -> type:
        """kvikio.CuFile: a file opened with os.open, whose pread/pwrite go through ``_io``."""
        fake = self

        class CuFile:
            def __init__(self, file, flags: str = "r"):
                if fake.fail and fake.fail["op"] == "open":
                    raise RuntimeError(f"Unable to open file: {os.strerror(fake.fail['errno'])}")
                mode = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                        "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "+": os.O_RDWR | os.O_CREAT}[flags[0]]
                try:
                    self._fd = os.open(os.fspath(file), mode | os.O_CLOEXEC, 0o644)
                except OSError as e:
                    raise RuntimeError(f"Unable to open file: {os.strerror(e.errno)}") from None
                self._closed = False
                fake.open_files += 1

            def close(self) -> None:
                if not self._closed:
                    os.close(self._fd)
                    self._closed = True
                    fake.open_files -= 1

            @property
            def closed(self) -> bool:
                return self._closed

            def fileno(self) -> int:
                return self._fd

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

            def pread(self, buf, size=None, file_offset=0, task_size=None):
                return fake._io("read", self._fd, buf, size, file_offset, task_size)

            def pwrite(self, buf, size=None, file_offset=0, task_size=None):
                return fake._io("write", self._fd, buf, size, file_offset, task_size)

        return CuFile

    def _defaults_module(self) -> types.ModuleType:
        """kvikio.defaults: get and set (one setting, or a dict of them, restorable) over ``settings``."""
        fake = self
        defaults = types.ModuleType("kvikio.defaults")

        def dset(*config):
            items = config[0] if len(config) == 1 else {config[0]: config[1]}
            old = {k: fake.settings[k] for k in items}
            fake.settings.update(items)
            return _Restore(fake.settings, old)

        defaults.get = lambda name: fake.settings[name]
        defaults.set = dset
        defaults.is_compat_mode_preferred = fake.compat_preferred
        return defaults

    def _driver_module(self) -> types.ModuleType:
        """kvikio.cufile_driver: the driver's properties (``driver``) and libcufile's version."""
        fake = self
        driver = types.ModuleType("kvikio.cufile_driver")

        def dget(name):
            if name not in fake.driver:
                raise KeyError(name)
            return fake.driver[name]

        driver.get = dget
        driver.libcufile_version = lambda: (1, 15)
        return driver

    def _summary_monitor_class(self) -> type:
        """kvikio.SummaryMonitor (kvikio 26.x): bytes moved per backend, now and since a summary."""
        fake = self

        class SummaryMonitor:
            def get(self):
                return _Summary(dict(fake.backend_bytes))

            def since(self, previous):
                now = fake.backend_bytes
                return _Summary({k: now[k] - previous.raw.get(k, 0) for k in now})

        return SummaryMonitor

    def install(self, monkeypatch) -> None:
        """Make ``import kvikio`` (and its submodules) find this fake for the test's duration."""
        monkeypatch.setitem(sys.modules, "kvikio", self.module)
        monkeypatch.setitem(sys.modules, "kvikio.defaults", self.module.defaults)
        monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", self.module.cufile_driver)


class _Restore:
    """What kvikio.defaults.set returns: the values are already set; ``with`` restores the old ones."""

    def __init__(self, settings, old):
        self.settings, self.old = settings, old

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        self.settings.update(self.old)


class _Summary:
    def __init__(self, raw: dict[str, int]):
        self.raw = raw
        self.by_backend = {k: {"num_ops": 0, "bytes_transferred": v, "total_duration_ns": 0, "num_errors": 0}
                           for k, v in raw.items() if v}


class _Future:
    """KvikIO's IOFuture: ``get()`` blocks, returns the bytes moved, and works once."""

    def __init__(self, futs, fake: FakeKvikio, backend: str):
        self._futs, self._fake, self._backend = futs, fake, backend
        self._used = False

    def done(self) -> bool:
        return all(f.done() for f in self._futs)

    def get(self) -> int:
        if self._used:
            raise RuntimeError("std::future_error: No associated state")
        self._used = True
        total, error = 0, None
        for f in self._futs:
            try:
                total += f.result()
            except RuntimeError as e:
                error = error or e
        if error:
            raise error
        with self._fake._lock:
            self._fake.backend_bytes[self._backend] += total
        return total

