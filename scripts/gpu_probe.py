"""What a GPU node offers gdswriter, and how fast its raw paths move bytes.

Prints the facts the GDS engine and `auto` engine choice depend on (CUDA, cuFile,
nvidia-fs, KvikIO's mode, torch's GdsFile, the file system under --dir, NVML
topology) and times durable writes and cold reads of one GPU buffer through each
raw path: KvikIO (its default mode and forced compat), torch.cuda.gds, pinned host
memory + O_DIRECT pwrite threads (a ceiling that is not gdswriter's engine), and
gdswriter's own engines. Each section is independent: a failure is printed and
the next one runs.

    python3 scripts/gpu_probe.py --dir /some/nvme/dir --size 4G
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback

RESULTS: dict = {}


def section(name):
    def deco(fn):
        def run(*a, **k):
            print(f"\n== {name}", flush=True)
            t = time.perf_counter()
            try:
                fn(*a, **k)
            except Exception:  # noqa: BLE001 - a probe reports and goes on
                traceback.print_exc(limit=3, file=sys.stdout)
            print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)
        return run
    return deco


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"<{e}>"


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@section("environment")
def environment(args):
    print(sh("nvidia-smi --query-gpu=name,pci.bus_id,memory.total,driver_version --format=csv,noheader"))
    print("kernel:", os.uname().release, "| cpus:", os.cpu_count())
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
    print("dir:", args.dir, "|", sh(f"df -hT {args.dir} | tail -1"))
    print("mount:", sh(f"findmnt -no SOURCE,FSTYPE,OPTIONS --target {args.dir}"))
    print("block devices:", sh("lsblk -o NAME,TYPE,SIZE,ROTA,TRAN,MODEL 2>/dev/null | head -20"))
    print("nvme in sysfs:", sh("ls /sys/class/nvme 2>&1; ls /sys/block"))
    print("nvidia-fs:", sh("ls -l /dev/nvidia-fs* 2>&1 | head -3; grep -i nvidia_fs /proc/modules; cat /proc/driver/nvidia-fs/version 2>&1 | head -3"))
    print("cufile.json:", sh("ls -l /etc/cufile.json 2>&1; echo CUFILE_ENV_PATH_JSON=$CUFILE_ENV_PATH_JSON"))
    print("libcufile:", sh("ldconfig -p | grep -i cufile; python3 -c 'import nvidia.cufile, os; print(os.listdir(os.path.dirname(nvidia.cufile.__file__)))' 2>&1 | tail -1"))
    print("io_uring_disabled:", sh("cat /proc/sys/kernel/io_uring_disabled 2>&1"), "| memlock:", sh("ulimit -l"))
    print("THP:", sh("cat /sys/kernel/mm/transparent_hugepage/enabled"))
    print("tools:", sh("which gdsio fio nvme numactl lspci 2>&1; ls /usr/local/cuda/gds/tools 2>&1 | head"))
    print("drop_caches works:", drop_caches())
    print("numa nodes:", sh("ls /sys/devices/system/node | grep node"))


@section("NVML and PCI topology")
def topology(args):
    import pynvml
    pynvml.nvmlInit()
    print("driver", pynvml.nvmlSystemGetDriverVersion(), "nvml", pynvml.nvmlSystemGetNVMLVersion())
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        bus = pynvml.nvmlDeviceGetPciInfo(h).busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        try:
            numa = pynvml.nvmlDeviceGetNumaNodeId(h)
        except Exception as e:  # noqa: BLE001
            numa = f"<{type(e).__name__}>"
        sysfs = bus.lower()[4:] if len(bus) > 12 else bus.lower()
        print(f"gpu{i} bus={bus} numa={numa} name={pynvml.nvmlDeviceGetName(h)}")
        print("   sysfs:", sh(f"readlink -f /sys/bus/pci/devices/{sysfs} 2>&1; cat /sys/bus/pci/devices/{sysfs}/numa_node 2>&1"))


@section("KvikIO")
def kvikio_info(args):
    import kvikio
    import kvikio.cufile_driver as drv
    import kvikio.defaults as d
    print("kvikio", kvikio.__version__, "libcufile", drv.libcufile_version())
    for k in ("compat_mode", "num_threads", "task_size", "gds_threshold", "bounce_buffer_size",
              "auto_direct_io_read", "auto_direct_io_write"):
        print(f"   defaults.{k} =", d.get(k))
    print("   is_compat_mode_preferred =", d.is_compat_mode_preferred())
    for k in ("is_gds_available", "major_version", "minor_version", "allow_compat_mode", "poll_mode",
              "max_device_cache_size", "max_pinned_memory_size"):
        try:
            print(f"   cufile_driver.{k} =", drv.get(k))
        except Exception as e:  # noqa: BLE001
            print(f"   cufile_driver.{k}: <{type(e).__name__}: {e}>")


def _gbps(nbytes, dt):
    return f"{nbytes / dt / 1e9:6.2f} GB/s"


def _timed(label, nbytes, write, read, path, check):
    t = time.perf_counter()
    write()
    dt_w = time.perf_counter() - t
    cold = drop_caches()
    t = time.perf_counter()
    read()
    dt_r = time.perf_counter() - t
    ok = check()
    RESULTS[label] = {"write_gbps": nbytes / dt_w / 1e9, "read_gbps": nbytes / dt_r / 1e9, "ok": ok}
    print(f"   {label:<34} write {_gbps(nbytes, dt_w)}  read{' (cold)' if cold else ''} {_gbps(nbytes, dt_r)}  ok={ok}", flush=True)
    try:
        os.unlink(path)
    except OSError:
        pass


class _Buffers:
    """What every raw path moves: ``n`` random bytes on the GPU (``src``), read back into ``dst``
    (``check``: they are equal) through the file ``path``."""

    def __init__(self, args):
        import torch

        self.n = args.size
        self.src = torch.randint(0, 256, (self.n,), dtype=torch.uint8, device="cuda")
        self.dst = torch.empty_like(self.src)
        torch.cuda.synchronize()
        self.path = os.path.join(args.dir, "probe.bin")

    def check(self) -> bool:
        import torch

        return bool(torch.equal(self.src, self.dst))

    def fsync_path(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


@section("raw GPU<->file paths (durable writes, cold reads)")
def bandwidth(args):
    b = _Buffers(args)
    for probe in (_kvikio_paths, _torch_gds, _pinned_odirect, _gdswriter_engines, _torch_save):
        try:  # each path on its own: a failure is printed and the next one runs
            probe(b)
        except Exception:  # noqa: BLE001
            traceback.print_exc(limit=3, file=sys.stdout)


def _kvikio_paths(b: _Buffers) -> None:
    """KvikIO, in its default mode and in forced compat mode, with its default task size and 16 MiB."""
    import kvikio
    import kvikio.defaults as d
    import torch

    def kv_write(task=None):
        with kvikio.CuFile(b.path, "w") as f:
            assert f.pwrite(b.src, task_size=task).get() == b.n
        b.fsync_path()

    def kv_read(task=None):
        with kvikio.CuFile(b.path, "r") as f:
            assert f.pread(b.dst, task_size=task).get() == b.n
        torch.cuda.synchronize()

    for mode in ("default", "on"):
        ctx = d.set("compat_mode", kvikio.CompatMode.ON) if mode == "on" else d.set({})
        with ctx:
            for task in (None, 16 << 20):
                b.dst.zero_()
                _timed(f"kvikio compat={mode} task={task or 'dflt'}", b.n, lambda: kv_write(task),
                       lambda: kv_read(task), b.path, b.check)


def _torch_gds(b: _Buffers) -> None:
    """torch.cuda.gds.GdsFile."""
    import torch
    from torch.cuda import gds

    def g_write():
        f = gds.GdsFile(b.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC)
        f.save_storage(b.src.untyped_storage(), 0)
        del f
        b.fsync_path()

    def g_read():
        f = gds.GdsFile(b.path, os.O_RDWR)
        f.load_storage(b.dst.untyped_storage(), 0)
        del f
        torch.cuda.synchronize()

    b.dst.zero_()
    _timed("torch.cuda.gds.GdsFile", b.n, g_write, g_read, b.path, b.check)


def _pinned_odirect(b: _Buffers) -> None:
    """Ceiling without gdswriter: D2H into pinned memory in 64 MiB pieces, O_DIRECT pwrite from 4 threads."""
    import torch

    n, chunk = b.n, 64 << 20
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()

    def pw_write():
        t = time.perf_counter()
        pinned.copy_(b.src)
        torch.cuda.synchronize()
        RESULTS["d2h_pinned_gbps"] = n / (time.perf_counter() - t) / 1e9
        fd = os.open(b.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        mv = memoryview(pinned.numpy())
        offs = list(range(0, n, chunk))

        def worker(k):
            for o in offs[k::4]:
                assert os.pwrite(fd, mv[o:o + chunk], o) == min(chunk, n - o)
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        os.fsync(fd)
        os.close(fd)

    def pw_read():
        fd = os.open(b.path, os.O_RDONLY | os.O_DIRECT)
        mv = memoryview(pinned.numpy())
        offs = list(range(0, n, chunk))

        def worker(k):
            for o in offs[k::4]:
                assert os.preadv(fd, [mv[o:o + chunk]], o) == min(chunk, n - o)
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        os.close(fd)
        t = time.perf_counter()
        b.dst.copy_(pinned)
        torch.cuda.synchronize()
        RESULTS["h2d_pinned_gbps"] = n / (time.perf_counter() - t) / 1e9

    b.dst.zero_()
    _timed("pinned + O_DIRECT pwrite x4", n, pw_write, pw_read, b.path, b.check)
    print(f"   D2H {RESULTS.get('d2h_pinned_gbps', 0):.1f} GB/s, H2D {RESULTS.get('h2d_pinned_gbps', 0):.1f} GB/s (pinned)")


def _gdswriter_engines(b: _Buffers) -> None:
    """gdswriter's own engines (io_uring, posix), staging through pinned memory."""
    import torch

    from gdswriter import EngineOptions, ReadSpan, WriteSpan, create_engine
    for name in ("io_uring", "posix"):
        with create_engine(EngineOptions.from_env(engine=name)) as eng:
            b.dst.zero_()
            _timed(f"gdswriter {eng.info.name} (pinned staging)", b.n,
                   lambda: eng.write_file(b.path, [WriteSpan(0, b.src)]),
                   lambda: (eng.read_file(b.path, [ReadSpan(0, b.dst)]), torch.cuda.synchronize()),
                   b.path, b.check)


def _torch_save(b: _Buffers) -> None:
    """torch.save with an fsync, and torch.load onto the GPU."""
    import torch

    def ts_write():
        with open(b.path, "wb") as f:
            torch.save(b.src, f)
            f.flush()
            os.fsync(f.fileno())

    out = {}

    def ts_read():
        out["t"] = torch.load(b.path, map_location="cuda")
        torch.cuda.synchronize()
    _timed("torch.save + fsync / torch.load", b.n, ts_write, ts_read, b.path,
           lambda: bool(torch.equal(out["t"], b.src)))


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.getcwd())
    ap.add_argument("--size", default="4G", type=parse_size)
    ap.add_argument("--json", help="write the measured figures here")
    ap.add_argument("--skip-bandwidth", action="store_true")
    args = ap.parse_args()
    environment(args)
    topology(args)
    kvikio_info(args)
    if not args.skip_bandwidth:
        bandwidth(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
