"""`gdswriter doctor`: what a node can do for checkpoints, each finding OK / WARN / FAIL with its fix.

The machine: GPUs, driver and CUDA versions, the cuFile library, the nvidia-fs driver, the
cufile.json in effect, KvikIO's mode (true GDS or compat), io_uring (and why not), the
mlock limit, transparent huge pages, and which engine ``auto`` picks. Each target
directory: writable, its file system and block device, O_DIRECT and its DMA alignment
(statx), free space, and a short durable write + cold verified read with each engine
available here. Every check is a small function returning Findings, so that tests run
them one by one; ``run_checks`` runs them all. Nothing here needs a GPU or KvikIO.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import errno
import glob
import os
import resource
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Sequence

import crc32c as _crc32c

from ..endurance import Drive, HealthLog, Rating, drives_of, health_of, human_si, rating_for, remaining_bytes
from ..engines import kvikio as gds
from ..errors import GDSWriterError, InvalidOptionError
from ..engines import dio, uring
from .measure import mount_entry
from ..options import EngineOptions, env_drive_tbw
from .pagecache import evict
from ..units import MiB, human

OK, WARN, FAIL = "OK", "WARN", "FAIL"
MACHINE = "machine"
_RANK = {OK: 0, WARN: 1, FAIL: 2}

# File systems GPUDirect Storage can DMA to: ext4 (data=ordered) and xfs on local NVMe (or
# NVMe-oF), and distributed ones over RDMA. Elsewhere cuFile runs in compat mode.
LOCAL_GDS_FILE_SYSTEMS = {"ext4", "xfs"}
REMOTE_GDS_FILE_SYSTEMS = {"lustre", "gpfs", "beegfs", "wekafs", "nfs", "nfs4"}
LOW_FREE_SPACE = 1 << 30


@dataclass(frozen=True)
class Finding:
    scope: str  # "machine", or "target DIR"
    check: str  # what was looked at: "gpu", "io_uring", "O_DIRECT", ...
    status: str  # OK, WARN or FAIL
    summary: str  # what was found, in one line
    fix: str = ""  # how to fix it, in one line (empty when OK)
    data: dict = field(default_factory=dict)  # the facts, for --json


def worst(findings: Sequence[Finding]) -> str:
    return max((f.status for f in findings), key=_RANK.__getitem__, default=OK)


def read_system_file(path: str) -> str | None:
    """The text of a /proc or /sys file (None: unreadable). Every such read of the doctor goes
    through it: a seam that tests redirect (monkeypatch) to show the doctor another machine."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


# ---------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------
def check_gpus() -> list[Finding]:
    import torch

    data = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    driver = read_system_file("/proc/driver/nvidia/version")
    if driver:
        data["driver"] = driver.splitlines()[0]
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        data["driver"] = pynvml.nvmlSystemGetDriverVersion()
        v = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        data["driver_cuda"] = f"{v // 1000}.{v % 1000 // 10}"
    if not gds.cuda_available():
        why = "this torch build has no CUDA" if not torch.version.cuda else "no CUDA device visible to torch"
        path = "io_uring" if uring.probe() is None else "the POSIX thread pool (io_uring unavailable: see below)"
        return [Finding(MACHINE, "gpu", WARN, f"{why} (torch {torch.__version__}); CUDA checks skipped, CPU tensors go "
                                     f"through {path}",
                        "run on a GPU node; in Docker pass --gpus all; check nvidia-smi and CUDA_VISIBLE_DEVICES",
                        data)]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    data["gpus"] = names
    versions = f"driver {data.get('driver', '?')}, CUDA {data.get('driver_cuda', '?')} (driver) / " \
               f"{torch.version.cuda} (torch)"
    return [Finding(MACHINE, "gpu", OK, f"{len(names)} GPU(s): {', '.join(sorted(set(names)))}; {versions}", data=data)]


def find_cufile() -> str | None:
    """Where libcufile lives: the dynamic linker's view, then pip's nvidia-cufile wheel."""
    found = ctypes.util.find_library("cufile")
    if found:
        with contextlib.suppress(OSError):
            ctypes.CDLL(found)
            return found
    with contextlib.suppress(Exception):
        import nvidia.cufile as pkg

        libs = glob.glob(os.path.join(os.path.dirname(pkg.__file__), "lib", "libcufile.so*"))
        if libs:
            return libs[0]
    for path in glob.glob("/usr/local/cuda*/targets/*/lib/libcufile.so*"):
        return path
    return None


def _extra() -> str:
    """The optional extra matching this torch's CUDA."""
    import torch

    return "gds-cu13" if (torch.version.cuda or "").startswith("13") else "gds"


def check_gds() -> list[Finding]:
    """cuFile, nvidia-fs, cufile.json and KvikIO (GPU nodes only)."""
    out = []
    lib = find_cufile()
    out.append(Finding(MACHINE, "cufile library", OK, f"libcufile at {lib}", data={"path": lib}) if lib else
               Finding(MACHINE, "cufile library", WARN, "libcufile not found: GPUDirect Storage cannot run",
                       "install cuFile: the CUDA toolkit's libcufile (apt install libcufile-<cuda version>) or "
                       "pip install nvidia-cufile-cu12 / -cu13"))
    nvfs = gds.nvidia_fs_driver()
    out.append(Finding(MACHINE, "nvidia-fs driver", OK, f"loaded: {nvfs}", data={"driver": nvfs}) if nvfs else
               Finding(MACHINE, "nvidia-fs driver", WARN, "not loaded: GDS can only run in compat mode (POSIX through host "
                                                 "memory), so auto uses gdswriter's pinned io_uring path",
                       "install the GDS packages (nvidia-gds / MLNX_OFED) and `modprobe nvidia_fs`; in Docker pass "
                       "--device /dev/nvidia-fs0 (each /dev/nvidia-fs*)"))
    cfg = gds.read_cufile_json()
    keys = ("allow_compat_mode", "max_direct_io_size_kb", "use_poll_mode", "poll_mode_max_size_kb",
            "use_pci_p2pdma", "max_device_cache_size_kb", "max_device_pinned_mem_size_kb")
    settings = {k: cfg.prop(k) for k in keys if cfg.prop(k) is not None}
    if cfg.data is None:
        out.append(Finding(MACHINE, "cufile.json", WARN, f"{cfg.path}: {cfg.error}; cuFile uses its built-in defaults",
                           "install the GDS packages (they ship /etc/cufile.json) or point CUFILE_ENV_PATH_JSON "
                           "at a valid one", {"path": cfg.path}))
    else:
        shown = ", ".join(f"{k}={v}" for k, v in settings.items()) or "no properties set"
        if settings.get("allow_compat_mode") is False and not nvfs:
            out.append(Finding(MACHINE, "cufile.json", WARN, f"{cfg.path}: {shown}; compat mode is off and nvidia-fs is "
                                                    f"not loaded, so cuFile I/O fails",
                               'set "allow_compat_mode": true in its "properties", or load nvidia-fs',
                               {"path": cfg.path, **settings}))
        else:
            out.append(Finding(MACHINE, "cufile.json", OK, f"{cfg.path}: {shown}", data={"path": cfg.path, **settings}))
    try:
        status = gds.gds_status()
    except GDSWriterError as e:
        out.append(Finding(MACHINE, "kvikio", WARN, str(e.strerror or e).split(":")[0] + ": the GDS engine is unavailable",
                           f"pip install 'gdswriter[{_extra()}]'", {"error": str(e)}))
        return out
    data = {**asdict(status), "mode": status.mode}
    if status.gpu_direct:
        out.append(Finding(MACHINE, "kvikio", OK, f"KvikIO {status.kvikio_version}, cuFile {status.libcufile_version}: "
                                         f"GPUDirect Storage active (engine 'gds')", data=data))
    else:
        out.append(Finding(MACHINE, "kvikio", WARN, f"KvikIO {status.kvikio_version} runs in compat mode: {status.reason}",
                           "load nvidia-fs (see above) for true GDS; until then auto's pinned io_uring path is "
                           "the faster one", data))
    return out


def check_io_uring() -> list[Finding]:
    why = uring.probe()
    data = {"io_uring_disabled": read_system_file("/proc/sys/kernel/io_uring_disabled")}
    status = read_system_file("/proc/self/status") or ""
    data["seccomp"] = next((ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("Seccomp:")),
                           None)
    if why is None:
        return [Finding(MACHINE, "io_uring", OK, "available", data=data)]
    fix = "sysctl kernel.io_uring_disabled=0"
    if data["seccomp"] == "2":
        fix += ("; a seccomp filter is active here: in Docker use --security-opt seccomp=<profile allowing "
                "io_uring_setup/io_uring_enter/io_uring_register>")
    return [Finding(MACHINE, "io_uring", WARN, f"unavailable: {why}; gdswriter uses its POSIX thread pool (slower)", fix,
                    {**data, "reason": why})]


def check_memlock(options: EngineOptions) -> list[Finding]:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = options.buffer_bytes * options.num_buffers
    data = {"soft_limit": None if soft == resource.RLIM_INFINITY else soft, "staging_bytes": need}
    if soft == resource.RLIM_INFINITY:
        return [Finding(MACHINE, "memlock", OK, "ulimit -l unlimited", data=data)]
    if soft >= need or can_lock_any():
        extra = "" if soft >= need else " (CAP_IPC_LOCK lifts the limit)"
        return [Finding(MACHINE, "memlock", OK, f"ulimit -l {human(soft)}, staging pool {human(need)}{extra}", data=data)]
    return [Finding(MACHINE, "memlock", WARN, f"ulimit -l is {human(soft)}, below the {human(need)} staging pool: buffers "
                                     f"stay unlocked and io_uring cannot register them",
                    "ulimit -l unlimited (limits.conf memlock, systemd LimitMEMLOCK=infinity, "
                    "docker --ulimit memlock=-1)", data)]


def can_lock_any() -> bool:
    """CAP_IPC_LOCK (bit 14 of the effective capabilities): mlock and io_uring buffer
    registration ignore RLIMIT_MEMLOCK. Root in a default Docker container lacks it."""
    status = read_system_file("/proc/self/status") or ""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 14 & 1)
    return False


def check_thp() -> list[Finding]:
    text = read_system_file("/sys/kernel/mm/transparent_hugepage/enabled")
    if text is None:
        return [Finding(MACHINE, "huge pages", WARN, "transparent huge pages not reported by this kernel; staging buffers "
                                            "use 4 KiB pages", "use a kernel with CONFIG_TRANSPARENT_HUGEPAGE")]
    mode = text[text.find("[") + 1:text.find("]")] if "[" in text else text
    if mode == "never":
        return [Finding(MACHINE, "huge pages", WARN, "transparent huge pages disabled (never): staged I/O measured 15-40% "
                                            "slower on 4 KiB pages", "echo madvise > "
                                            "/sys/kernel/mm/transparent_hugepage/enabled", {"mode": mode})]
    return [Finding(MACHINE, "huge pages", OK, f"transparent huge pages: {mode}", data={"mode": mode})]


def check_auto_engine(options: EngineOptions) -> list[Finding]:
    from ..engines.select import create_engine

    try:
        with create_engine(options) as eng:
            info = eng.info
    except GDSWriterError as e:
        return [Finding(MACHINE, "engine", FAIL, f"engine={options.engine!r} cannot run here: {e}",
                        "unset GDSWRITER_ENGINE or choose another engine")]
    return [Finding(MACHINE, "engine", OK, f"engine={options.engine!r} picks {info.name} (CUDA tensors: {info.cuda_path})"
                                  + (f"; {info.reason}" if info.reason else ""),
                    data={"name": info.name, "cuda_path": info.cuda_path, "reason": info.reason})]


# ---------------------------------------------------------------------------
# A target directory
# ---------------------------------------------------------------------------
def block_device(path: Path) -> dict:
    """The block device holding ``path``: its name, model, whether it is NVMe or rotational,
    and for stacked devices (RAID, LVM) the devices below it."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return {}
    sys_dir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sys_dir.exists():
        return {}
    node = sys_dir.resolve()
    disk = node.parent if (node / "partition").exists() else node
    info = {"name": node.name, "disk": disk.name,
            "model": (read_system_file(str(disk / "device" / "model")) or "").strip() or None,
            "rotational": read_system_file(str(disk / "queue" / "rotational")) == "1",
            "nvme": disk.name.startswith("nvme")}
    slaves = sorted(p.name for p in (node / "slaves").glob("*")) if (node / "slaves").exists() else []
    if slaves:
        info["slaves"] = slaves
        info["nvme"] = all(s.startswith("nvme") for s in slaves)
    return info


def check_target(target: Path, *, test_bytes: int, engines: Sequence[str], options: EngineOptions) -> list[Finding]:
    name = f"target {target}"
    if not target.exists():
        return [Finding(name, "directory", FAIL, "does not exist", f"mkdir -p {target} (or pass an existing directory)")]
    if not target.is_dir():
        return [Finding(name, "directory", FAIL, "is not a directory", "pass the directory checkpoints will be written to")]
    try:
        fd, probe = tempfile.mkstemp(prefix=".gdswriter-doctor-", dir=target)
    except OSError as e:
        fix = {errno.EROFS: "the file system is mounted read-only: remount it rw or choose another directory",
               errno.EACCES: f"make {target} writable for this user (chown/chmod) or choose another directory",
               errno.EPERM: f"make {target} writable for this user (chown/chmod) or choose another directory",
               errno.ENOSPC: "the file system is full: free space"}.get(e.errno, "choose a writable directory")
        return [Finding(name, "directory", FAIL, f"not writable: {e.strerror} (errno {errno.errorcode.get(e.errno, e.errno)})",
                        fix, {"errno": e.errno})]
    os.close(fd)
    os.unlink(probe)
    out = [Finding(name, "directory", OK, "writable")]
    out += _file_system(target, name, gds.cuda_available())
    out += check_endurance(target, name)
    out += _direct_io(target, name)
    for engine in engines:
        out.append(_io_test(target, name, engine, test_bytes, options))
    return out


def _file_system(target: Path, name: str, gpu: bool) -> list[Finding]:
    m = mount_entry(target)
    mnt, source, fstype, opts = m if m else ("?", "?", "unknown", "")
    dev = block_device(target)
    free = shutil.disk_usage(target).free
    data = {"mount": mnt, "source": source, "fstype": fstype, "options": opts, "device": dev, "free_bytes": free}
    what = f"{fstype} on {source} (mounted at {mnt})"
    if dev:
        what += f"; device {dev['name']}" + (f" ({dev['model']})" if dev.get("model") else "") + \
            (", NVMe" if dev["nvme"] else ", rotational" if dev["rotational"] else "")
    what += f"; {human(free)} free"
    local = fstype in LOCAL_GDS_FILE_SYSTEMS
    gds_ok = (fstype in REMOTE_GDS_FILE_SYSTEMS or local and bool(dev.get("nvme"))) and "data=journal" not in opts
    data["gds_capable"] = gds_ok
    findings = []
    if fstype in ("tmpfs", "ramfs"):
        findings.append(Finding(name, "file system", WARN, f"{what}: memory, not storage (lost at reboot)",
                                "point checkpoints at an NVMe-backed directory", data))
    elif fstype in ("overlay", "aufs"):
        findings.append(Finding(name, "file system", WARN, f"{what}: a container's layered file system (slow, "
                                                             f"no GDS, gone with the container)",
                                "mount a host NVMe directory into the container (docker run -v /nvme/ckpt:/ckpt)",
                                data))
    elif gds_ok:
        findings.append(Finding(name, "file system", OK, what + "; GDS-capable", data=data))
    else:
        why = f"{fstype} is not a file system GDS supports" if not local else "not on NVMe"
        if gpu:
            findings.append(Finding(name, "file system", WARN, f"{what}; no GPUDirect Storage here ({why})",
                                    "for GDS use ext4 (data=ordered) or xfs on local NVMe", data))
        else:
            findings.append(Finding(name, "file system", OK, f"{what}; GDS: no ({why})", data=data))
    if free < LOW_FREE_SPACE:
        findings.append(Finding(name, "free space", WARN, f"only {human(free)} free",
                                "free space or choose a bigger file system", {"free_bytes": free}))
    return findings


def check_endurance(target: Path, name: str) -> list[Finding]:
    """Each drive under ``target``: its NVMe health log (percentage used, bytes written) and the
    rated endurance left (gdswriter/endurance.py). Nothing for a file system without a drive."""
    try:
        tbw = env_drive_tbw()
    except InvalidOptionError as e:
        return [Finding(name, "endurance", WARN, str(e), "unset GDSWRITER_DRIVE_TBW or give the drive's rated TB "
                                                         "written as a number")]
    out = []
    for d in drives_of(target):
        health, how = health_of(d)
        out.append(endurance_finding(name, d, health, how, rating_for(d.model, d.capacity_bytes, tbw)))
    return out


def endurance_finding(scope: str, drive: Drive, health: HealthLog | None, how: str, rating: Rating | None) -> Finding:
    """The finding for one drive: its health log (or why there is none) against its rating."""
    left = remaining_bytes(health, rating)
    label = drive.name + (f" ({drive.model})" if drive.model else "")
    data = {"drive": drive.name, "model": drive.model, "capacity_bytes": drive.capacity_bytes, "read": how,
            "health": asdict(health) if health else None, "remaining_bytes": left,
            "rated_bytes": rating.total_bytes if rating else None, "rating": rating.source if rating else None}
    rated = (f"{human_si(left)} of {human_si(rating.total_bytes)} rated endurance left ({rating.source})"
             if rating and left is not None else
             "rated endurance unknown: set GDSWRITER_DRIVE_TBW=<terabytes written> to budget against it")
    if health is None and drive.controller is None:
        counted = f"; {rated}, counted as new" if rating else ""
        host = " (a virtual disk: the host's drives take the wear)" if "virt" in drive.kind() else ""
        return Finding(scope, "endurance", OK, f"no NVMe health log ({how}): its wear and remaining endurance are "
                                               f"not visible here{host}{counted}", data=data)
    if health is None:
        return Finding(scope, "endurance", WARN, f"{label}: NVMe health log not readable ({how})",
                       "run gdswriter doctor as root (the NVMe admin ioctl needs CAP_SYS_ADMIN), or install "
                       "nvme-cli", data)
    summary = f"{label}: {health.percentage_used}% used, {human_si(health.bytes_written)} written; {rated}; read by {how}"
    if health.critical_warning or health.percentage_used >= 90:
        return Finding(scope, "endurance", WARN, f"{summary}; critical warning 0x{health.critical_warning:02x}",
                       "the drive is near or past its rated life: plan its replacement, and keep checkpoints "
                       "drained to shared storage (CheckpointOptions.drain_root)", data)
    return Finding(scope, "endurance", OK, summary, data=data)


def _direct_io(target: Path, name: str) -> list[Finding]:
    path = target / f".gdswriter-doctor-odirect-{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if e.errno == errno.EINVAL:
            return [Finding(name, "O_DIRECT", WARN, "refused by the file system: gdswriter uses buffered I/O + "
                                                       "fsync there (slower, pollutes the page cache; no GDS)",
                            "use ext4 or xfs on a block device")]
        return [Finding(name, "O_DIRECT", FAIL, f"cannot create a file: {e.strerror}", "choose a writable "
                                                                                            "directory")]
    try:
        align = dio.direct_io_alignment(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    if align is None:
        return [Finding(name, "O_DIRECT", OK, "supported; DMA alignment not reported (statx DIOALIGN needs Linux "
                                                 "6.1+): gdswriter assumes 4 KiB", data={"memory": None})]
    data = {"memory": align.memory, "offset": align.offset}
    if align.offset > 4096 or align.memory > 4096:
        return [Finding(name, "O_DIRECT", WARN, f"needs {align.offset}-byte offsets and {align.memory}-byte "
                                                   f"memory alignment, more than gdswriter's 4 KiB: buffered I/O "
                                                   f"is used there", "use a file system with 4 KiB (or smaller) "
                                                                     "blocks", data)]
    return [Finding(name, "O_DIRECT", OK, f"supported; DMA alignment: memory {align.memory} B, offsets "
                                             f"{align.offset} B", data=data)]


def available_engines() -> list[str]:
    """The engines worth a write/read test here: io_uring (if the kernel allows), POSIX, and
    KvikIO on GPU machines where it imports."""
    names = ["io_uring"] if uring.probe() is None else []
    names.append("posix")
    if gds.cuda_available():
        with contextlib.suppress(GDSWriterError):
            gds.import_kvikio()
            names.append("kvikio")
    return names


def _io_test(target: Path, name: str, engine: str, nbytes: int, options: EngineOptions) -> Finding:
    """Durable write, cold read, bytes and crc32c checked. KvikIO moves a CUDA tensor."""
    import dataclasses

    import torch

    from ..engines.base import ReadSpan, WriteSpan
    from ..engines.select import create_engine

    check = f"{engine} write/read"
    device = "cuda" if engine == "kvikio" else "cpu"
    path = target / f".gdswriter-doctor-{engine}-{os.getpid()}.bin"
    try:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        want = _crc32c.crc32c(src.numpy())
        src = src.to(device)
        dst = torch.zeros_like(src)
        with create_engine(dataclasses.replace(options, engine=engine)) as eng:
            t0 = time.perf_counter()
            wrote = eng.write_file(path, [WriteSpan(0, src)], durable=True)
            t_write = time.perf_counter() - t0
            evict(path)
            t0 = time.perf_counter()
            read = eng.read_file(path, [ReadSpan(0, dst)])
            t_read = time.perf_counter() - t0
            used = eng.info.name
        same = bool(torch.equal(src, dst))
    except (OSError, GDSWriterError, RuntimeError) as e:
        return Finding(name, check, FAIL, f"failed: {e}", "see the error; `gdswriter doctor` above says what this "
                                                    "directory lacks", {"error": str(e)})
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    data = {"engine": used, "bytes": nbytes, "write_gbps": nbytes / t_write / 1e9, "read_gbps": nbytes / t_read / 1e9}
    if wrote != [want] or read != [want] or not same:
        return Finding(name, check, FAIL, f"{used}: data or crc32c mismatch (written {wrote}, read {read}, expected "
                                    f"[{want}])", "the storage corrupts data: check dmesg and the drive", data)
    return Finding(name, check, OK, f"{used}: {human(nbytes)} durable write {data['write_gbps']:.2f} GB/s, cold read "
                              f"{data['read_gbps']:.2f} GB/s, verified", data=data)


# ---------------------------------------------------------------------------
def run_checks(targets: Sequence[str | os.PathLike], *, test_bytes: int = 64 * MiB, io_test: bool = True,
               options: EngineOptions | None = None) -> list[Finding]:
    """Every check, machine first, then each target directory."""
    options = options or EngineOptions.from_env()
    findings = check_gpus()
    if gds.cuda_available():
        findings += check_gds()
    findings += check_io_uring() + check_memlock(options) + check_thp() + check_auto_engine(options)
    engines = available_engines() if io_test else []
    for t in targets:
        findings += check_target(Path(t), test_bytes=test_bytes, engines=engines, options=options)
    return findings
