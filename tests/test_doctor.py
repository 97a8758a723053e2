"""`gdswriter doctor`: real checks against real directories on this (CPU-only) machine; the
failure paths with directories that truly cannot be written; io_uring, mlock and huge-page
problems simulated where the machine has none; the GPU-node checks with a stand-in KvikIO."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_kvikio import FakeKvikio
from support.engines import isolate_from_host, pretend_cuda

import gdswriter.tools.doctor as doctor
from gdswriter.cli import main
from gdswriter.engines import uring


def run_json(capsys, *args) -> tuple[int, dict]:
    rc = main(["doctor", "--json", "--test-size", "1M", *map(str, args)])
    return rc, json.loads(capsys.readouterr().out)


def by_check(report: dict, scope: str) -> dict[str, dict]:
    return {f["check"]: f for f in report["findings"] if f["scope"] == scope}


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    """Whatever machine runs this, the doctor sees no GPU unless a test says otherwise."""
    pretend_cuda(monkeypatch, False)


def test_real_checks_on_a_real_directory(capsys, tmp_path):
    rc, report = run_json(capsys, tmp_path)
    assert rc == 0 and report["status"] in ("OK", "WARN")
    machine = by_check(report, "machine")
    assert set(machine) >= {"gpu", "io_uring", "memlock", "huge pages", "engine"}
    assert machine["gpu"]["status"] == "WARN" and "--gpus all" in machine["gpu"]["fix"]
    target = by_check(report, f"target {tmp_path}")
    assert target["directory"]["status"] == "OK"
    fs = target["file system"]["data"]
    assert fs["fstype"] and fs["free_bytes"] > 0 and "gds_capable" in fs
    assert target["O_DIRECT"]["status"] in ("OK", "WARN")
    tests = {k: v for k, v in target.items() if k.endswith("write/read")}
    assert "posix write/read" in tests and (uring.probe() is not None or "io_uring write/read" in tests)
    for f in tests.values():
        assert f["status"] == "OK" and "verified" in f["summary"], f
        assert f["data"]["write_gbps"] > 0 and f["data"]["read_gbps"] > 0
    assert not [p for p in os.listdir(tmp_path)], "the doctor left files behind"


def test_text_output_groups_findings_and_gives_fixes(capsys, tmp_path):
    assert main(["doctor", str(tmp_path), "--no-io-test"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("gdswriter ") and "\nmachine\n" in text and f"\ntarget {tmp_path}\n" in text
    assert "  WARN  gpu" in text and "fix: run on a GPU node" in text
    assert "write/read" not in text
    assert text.rstrip().splitlines()[-1].startswith(("OK:", "WARN:"))


def test_missing_directory_and_plain_file_fail(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, report = run_json(capsys, tmp_path / "missing", f, "--no-io-test")
    assert rc == 1 and report["status"] == "FAIL"
    missing = by_check(report, f"target {tmp_path / 'missing'}")["directory"]
    assert missing["status"] == "FAIL" and "mkdir -p" in missing["fix"]
    assert by_check(report, f"target {f}")["directory"]["summary"] == "is not a directory"


def test_unwritable_directory_fails_with_the_errno(capsys):
    """sysfs refuses new files even to root: a directory no one can write to."""
    target = Path("/sys/kernel/mm")
    if not target.is_dir() or os.access(target, os.W_OK) and _can_create(target):
        pytest.skip("no unwritable system directory here")
    rc, report = run_json(capsys, target)
    assert rc == 1
    d = by_check(report, f"target {target}")["directory"]
    assert d["status"] == "FAIL" and d["data"]["errno"] in (errno.EACCES, errno.EPERM, errno.EROFS)
    assert "not writable" in d["summary"] and d["fix"]


def _can_create(d: Path) -> bool:
    try:
        (d / ".gdswriter-probe").touch()
    except OSError:
        return False
    (d / ".gdswriter-probe").unlink()
    return True


@pytest.fixture
def read_only_mount(tmp_path):
    """A real read-only file system (tmpfs mounted ro), where this process may mount one."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_read_only_file_system_fails(capsys, read_only_mount):
    rc, report = run_json(capsys, read_only_mount)
    assert rc == 1
    d = by_check(report, f"target {read_only_mount}")["directory"]
    assert d["status"] == "FAIL" and d["data"]["errno"] == errno.EROFS and "read-only" in d["fix"]


def test_io_uring_disabled_warns_with_the_fix_and_tests_posix_only(capsys, tmp_path, monkeypatch, io_fresh_log_once):
    why = "io_uring is forbidden here (EPERM: kernel.io_uring_disabled or a seccomp filter)"
    monkeypatch.setattr(uring, "probe", lambda: why)
    rc, report = run_json(capsys, tmp_path)
    assert rc == 0
    m = by_check(report, "machine")
    assert m["io_uring"]["status"] == "WARN" and why in m["io_uring"]["summary"]
    assert "io_uring_disabled=0" in m["io_uring"]["fix"]
    assert m["engine"]["data"]["name"] == "posix"
    tests = [k for k in by_check(report, f"target {tmp_path}") if k.endswith("write/read")]
    assert tests == ["posix write/read"]


def test_low_mlock_limit_warns(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda r: (64 << 10, 64 << 10))
    # CAP_IPC_LOCK comes from /proc/self/status: the doctor takes no other /proc, so its probe is replaced.
    monkeypatch.setattr(doctor, "can_lock_any", lambda: False)
    (f,) = doctor.check_memlock(doctor.EngineOptions())
    assert f.status == "WARN" and "memlock=-1" in f.fix and f.data["soft_limit"] == 64 << 10
    monkeypatch.setattr(resource, "getrlimit", lambda r: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert doctor.check_memlock(doctor.EngineOptions())[0].status == "OK"


def test_capability_parse_matches_the_kernel():
    """CAP_IPC_LOCK as /proc/self/status reports it; root on this machine has it."""
    status = Path("/proc/self/status").read_text()
    cap = int(next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16)
    assert doctor.can_lock_any() == bool(cap & (1 << 14))


def test_transparent_huge_pages_off_warns(monkeypatch):
    real = doctor.read_system_file
    # The doctor reads sysfs through its seam read_system_file: the one file is redirected.
    monkeypatch.setattr(doctor, "read_system_file", lambda p: "always madvise [never]" if "transparent_hugepage" in p else real(p))
    (f,) = doctor.check_thp()
    assert f.status == "WARN" and f.data["mode"] == "never" and "madvise" in f.fix


def test_o_direct_refused_warns(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    findings = doctor.check_target(tmp_path, test_bytes=0, engines=[], options=doctor.EngineOptions())
    (f,) = [f for f in findings if f.check == "O_DIRECT"]
    assert f.status == "WARN" and "buffered" in f.summary


def test_gpu_node_without_nvidia_fs(monkeypatch, tmp_path):
    """A GPU node like the project's H200: cuFile present, nvidia-fs not loaded, KvikIO in compat mode."""
    FakeKvikio().install(monkeypatch)
    isolate_from_host(monkeypatch, tmp_path, cufile={"properties": {"allow_compat_mode": True,
                                                                    "max_direct_io_size_kb": 16384,
                                                                    "use_poll_mode": False}})
    pretend_cuda(monkeypatch, True)
    monkeypatch.setattr(doctor, "find_cufile", lambda: "/usr/local/cuda/lib64/libcufile.so.0")
    checks = {f.check: f for f in doctor.check_gds()}
    assert checks["cufile library"].status == "OK"
    assert checks["nvidia-fs driver"].status == "WARN" and "modprobe nvidia_fs" in checks["nvidia-fs driver"].fix
    cj = checks["cufile.json"]
    assert cj.status == "OK" and "allow_compat_mode=True" in cj.summary and "max_direct_io_size_kb=16384" in cj.summary
    kv = checks["kvikio"]
    assert kv.status == "WARN" and "compat mode" in kv.summary and kv.data["mode"] == "kvikio-compat"


def test_gpu_node_with_true_gds(monkeypatch, tmp_path):
    FakeKvikio(gds_available=True).install(monkeypatch)
    isolate_from_host(monkeypatch, tmp_path, nvidia_fs=True, cufile={"properties": {"allow_compat_mode": False}})
    pretend_cuda(monkeypatch, True)
    checks = {f.check: f for f in doctor.check_gds()}
    assert checks["nvidia-fs driver"].status == "OK"
    assert checks["kvikio"].status == "OK" and "GPUDirect Storage active" in checks["kvikio"].summary
    assert checks["cufile.json"].status == "OK"


def test_gpu_node_problems(monkeypatch, tmp_path):
    """No KvikIO; cufile.json unparsable; compat mode off without nvidia-fs."""
    monkeypatch.setitem(sys.modules, "kvikio", None)
    isolate_from_host(monkeypatch, tmp_path)
    (tmp_path / "cufile.json").write_text("{ broken")
    pretend_cuda(monkeypatch, True)
    checks = {f.check: f for f in doctor.check_gds()}
    assert checks["kvikio"].status == "WARN" and "pip install 'gdswriter[" in checks["kvikio"].fix
    assert checks["cufile.json"].status == "WARN" and "JSON" in checks["cufile.json"].summary
    (tmp_path / "cufile.json").write_text('{"properties": {"allow_compat_mode": false}}')
    checks = {f.check: f for f in doctor.check_gds()}
    assert checks["cufile.json"].status == "WARN" and "allow_compat_mode" in checks["cufile.json"].fix


def test_engine_that_cannot_run_is_a_failure(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "kvikio", None)
    (f,) = doctor.check_auto_engine(doctor.EngineOptions(engine="gds"))
    assert f.status == "FAIL" and "GDSWRITER_ENGINE" in f.fix


def test_block_device_of_a_real_directory(tmp_path):
    info = doctor.block_device(tmp_path)
    if not info:
        pytest.skip("no block device under the temporary directory (overlay or tmpfs)")
    assert Path(f"/sys/class/block/{info['name']}").exists()
    assert isinstance(info["nvme"], bool) and isinstance(info["rotational"], bool)
