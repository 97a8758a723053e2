"""Failures are typed, name the file and offset, clean up, and leave the engine usable.

Real-file-system cases (read-only mount, full tmpfs, full loop-mounted ext4,
ramfs which refuses O_DIRECT) run in a child process inside a private mount
namespace (``unshare -m``), so nothing is mounted where anything else can see it;
they skip where mounting is not permitted. The same failures are always also
injected through FaultInjectingEngine, so they are covered without root.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import crc32c
import pytest
import torch

import gdswriter.engines.staged as engine_mod
import gdswriter.engines.uring as uring_mod
from gdswriter.engines.base import ReadSpan, WriteSpan
from gdswriter.engines.select import create_engine
from gdswriter.errors import (CorruptCheckpointError, DataFileNotRegularError, EngineIOError,
                              EngineUnavailableError, InvalidOptionError, NotRegularFileError, ShortIOError,
                              TruncatedFileError)
from gdswriter.engines.staged import IoUringEngine, PosixEngine
from gdswriter.testing.faults import FaultEvent, FaultInjectingEngine, FaultPlan
from gdswriter.options import EngineOptions, KiB, MiB
from support.engines import HOSTILE, host_tensor, plant
from support.timeouts import deadline

REPO = Path(__file__).resolve().parent.parent
REQUEST = 64 * KiB
BACKENDS = ["io_uring", "posix"]


def rand(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def crc(t: torch.Tensor) -> int:
    return crc32c.crc32c(t.numpy().tobytes())


def roundtrip(eng, path, data: torch.Tensor, offset: int = 0) -> None:
    """A write and a read that must succeed, with the right bytes (the engine is healthy)."""
    assert eng.write_file(path, [WriteSpan(offset, data)]) == [crc(data)]
    out = torch.empty_like(data)
    assert eng.read_file(path, [ReadSpan(offset, out)]) == [crc(data)]
    assert torch.equal(out, data)
    with open(path, "rb") as f:
        assert f.read() == bytes(offset) + data.numpy().tobytes()


def assert_drained(eng) -> None:
    """Nothing left in flight or queued after an error."""
    assert eng._backend.in_flight == 0
    assert not eng.backlog


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def plain_engine(kind: str, options):
    return IoUringEngine(options) if kind == "io_uring" else PosixEngine(options)


# ---------------------------------------------------------------------------
# Missing directory, permissions
# ---------------------------------------------------------------------------
def test_missing_directory(backend, tmp_path, io_small_options):
    path = tmp_path / "no" / "such" / "dir" / "x.bin"
    with plain_engine(backend, io_small_options()) as eng:
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, [WriteSpan(0, rand(10))])
        e = ei.value
        assert e.errno == errno.ENOENT and isinstance(e, OSError)
        assert e.path == str(path) and str(path) in str(e)
        assert e.offset == 0
        with pytest.raises(EngineIOError) as ei:
            eng.read_file(tmp_path / "missing.bin", [ReadSpan(0, torch.empty(10, dtype=torch.uint8))])
        assert ei.value.errno == errno.ENOENT and "missing.bin" in str(ei.value)
        roundtrip(eng, tmp_path / "ok.bin", rand(5000))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; the read-only "
                                               "case is covered by the read-only mount test")
def test_unwritable_directory_non_root(tmp_path, io_small_options):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        with IoUringEngine(io_small_options()) as eng:
            with pytest.raises(EngineIOError) as ei:
                eng.write_file(d / "x.bin", [WriteSpan(0, rand(10))])
            assert ei.value.errno == errno.EACCES
            assert "writable" in str(ei.value) and str(d / "x.bin") in str(ei.value)
    finally:
        d.chmod(0o755)


# ---------------------------------------------------------------------------
# Real file systems in a private mount namespace (root only)
# ---------------------------------------------------------------------------
_CHILD = textwrap.dedent(r'''
    import errno, json, os, shutil, subprocess, sys, traceback
    import torch
    from gdswriter.engines.base import ReadSpan, WriteSpan
    from gdswriter.errors import EngineIOError
    from gdswriter.engines.staged import IoUringEngine, PosixEngine
    from gdswriter.options import EngineOptions, KiB, MiB

    base = sys.argv[1]
    results = {}

    def sh(*cmd):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip()}")

    def opts(**kw):
        return EngineOptions(**{**dict(buffer_bytes=256 * KiB, request_bytes=64 * KiB, num_buffers=3), **kw})

    def data(n, seed=0):
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))

    def expect_error(eng, path, n):
        """Write n bytes where it must fail; report the error and what is left on disk."""
        try:
            eng.write_file(path, [WriteSpan(0, data(n))])
        except EngineIOError as e:
            return {"type": type(e).__name__, "errno": e.errno, "path": e.path, "offset": e.offset,
                    "message": str(e), "exists": os.path.exists(path), "direct": eng.info.direct_io,
                    "in_flight": eng._backend.in_flight}
        return {"type": None, "exists": os.path.exists(path), "size": os.path.getsize(path)}

    def roundtrip(eng, path, n):
        d = data(n, 1)
        eng.write_file(path, [WriteSpan(0, d)])
        direct_w = eng.info.direct_io
        out = torch.empty_like(d)
        eng.read_file(path, [ReadSpan(0, out)])
        with open(path, "rb") as f:
            disk = f.read()
        return {"ok": bool(torch.equal(out, d)) and disk == d.numpy().tobytes(),
                "direct_write": direct_w, "direct_read": eng.info.direct_io}

    def scenario(name, mount, body):
        d = os.path.join(base, name)
        os.makedirs(d)
        try:
            mount(d)
        except Exception as e:
            results[name] = {"skip": f"cannot mount for {name}: {e}"}
            return
        try:
            results[name] = body(d)
        except Exception:
            results[name] = {"crash": traceback.format_exc()}

    # -- read-only: a tmpfs remounted read-only ------------------------------
    def ro_mount(d):
        sh("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", d)
        with open(os.path.join(d, "old.bin"), "wb") as f:
            f.write(b"x" * 5000)
        sh("mount", "-o", "remount,ro", d)

    def ro_body(d):
        out = {}
        for kind, cls in (("io_uring", IoUringEngine), ("posix", PosixEngine)):
            with cls(opts()) as eng:
                out[kind] = {"new": expect_error(eng, os.path.join(d, "new.bin"), 10_000),
                             "over": expect_error(eng, os.path.join(d, "old.bin"), 10)}
                buf = torch.empty(5000, dtype=torch.uint8)
                eng.read_file(os.path.join(d, "old.bin"), [ReadSpan(0, buf)])
                out[kind]["read_ok"] = bool((buf == ord("x")).all())
        return out

    scenario("readonly", ro_mount, ro_body)

    # -- a full file system: each engine, with and without fallocate, writes more than fits
    def fill_up(big_bytes):
        def body(d):
            out = {}
            for kind, cls in (("io_uring", IoUringEngine), ("posix", PosixEngine)):
                for prealloc in (True, False):
                    with cls(opts(preallocate=prealloc)) as eng:
                        r = expect_error(eng, os.path.join(d, "big.bin"), big_bytes)
                        r["after"] = roundtrip(eng, os.path.join(d, "small.bin"), 100_000)
                        out[f"{kind}-prealloc={prealloc}"] = r
                    os.unlink(os.path.join(d, "small.bin"))  # room for the next engine's attempt
            return out
        return body

    # -- full tmpfs (1 MiB) ---------------------------------------------------
    scenario("tmpfs_full", lambda d: sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d), fill_up(3 * MiB + 5))

    # -- full ext4 on a loop device (O_DIRECT path) -----------------------------
    def ext4_mount(d):
        if not shutil.which("mkfs.ext4"):
            raise RuntimeError("mkfs.ext4 not installed")
        img = os.path.join(base, "ext4.img")
        with open(img, "wb") as f:
            f.truncate(16 * MiB)
        sh("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", img)
        sh("mount", "-o", "loop", img, d)

    scenario("ext4_full", ext4_mount, fill_up(24 * MiB + 5))

    # -- ramfs: no O_DIRECT at all ---------------------------------------------
    def ramfs_body(d):
        out = {}
        for kind, cls in (("io_uring", IoUringEngine), ("posix", PosixEngine)):
            with cls(opts()) as eng:
                out[kind] = roundtrip(eng, os.path.join(d, kind + ".bin"), 3 * MiB + 123)
        return out

    scenario("ramfs", lambda d: sh("mount", "-t", "ramfs", "ramfs", d), ramfs_body)

    print("RESULTS=" + json.dumps(results))
''')


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    """Run every real-file-system scenario once, in one child in a private mount namespace."""
    if os.geteuid() != 0:
        pytest.skip("mounting file systems needs root")
    unshare = shutil.which("unshare")
    if not unshare:
        pytest.skip("util-linux `unshare` is not installed")
    base = tmp_path_factory.mktemp("mounts")
    script = base / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        p = subprocess.run([unshare, "-m", "--propagation", "private", sys.executable, str(script), str(base)],
                           capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the mount scenarios child hung")
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULTS=")), None)
    if line is None:
        if p.returncode and ("Operation not permitted" in p.stderr or "unshare failed" in p.stderr):
            pytest.skip(f"cannot create a private mount namespace: {p.stderr.strip()[-300:]}")
        pytest.fail(f"mount scenarios child failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULTS="):])


def scenario(mounted, name):
    r = mounted[name]
    if "skip" in r:
        pytest.skip(r["skip"])
    assert "crash" not in r, r.get("crash")
    return r


def test_read_only_file_system(mounted):
    r = scenario(mounted, "readonly")
    for kind in BACKENDS:
        for case in ("new", "over"):
            e = r[kind][case]
            assert e["type"] == "EngineIOError", e
            assert e["errno"] == errno.EROFS
            assert e["path"].endswith(f"{case if case == 'new' else 'old'}.bin") and e["path"] in e["message"]
            assert "read-only" in e["message"] and "writable root" in e["message"]
        assert r[kind]["over"]["exists"], "a failed open must not delete the existing file"
        assert r[kind]["read_ok"]


@pytest.mark.parametrize("fs", ["tmpfs_full", "ext4_full"])
def test_full_file_system(mounted, fs):
    r = scenario(mounted, fs)
    for key, e in r.items():
        assert e["type"] == "EngineIOError", (key, e)
        assert e["errno"] == errno.ENOSPC, (key, e)
        assert "free space" in e["message"] and e["path"] in e["message"], e["message"]
        assert not e["exists"], f"{key}: the partial file was left behind"
        assert e["in_flight"] == 0
        assert e["after"]["ok"], f"{key}: engine unusable after ENOSPC"
        if "prealloc=True" in key:
            assert e["offset"] == 0  # fallocate refuses up front
    if fs == "ext4_full":  # ext4 takes O_DIRECT: the direct path hit ENOSPC
        assert all(e["direct"] and e["after"]["direct_write"] for e in r.values()), r


def test_ramfs_refuses_o_direct_falls_back_to_buffered(mounted):
    r = scenario(mounted, "ramfs")
    for kind in BACKENDS:
        assert r[kind]["ok"], r
        assert r[kind]["direct_write"] is False and r[kind]["direct_read"] is False


# ---------------------------------------------------------------------------
# O_DIRECT refused, without root
# ---------------------------------------------------------------------------
def test_o_direct_refused_falls_back_to_buffered(backend, tmp_path, monkeypatch, io_small_options,
                                                 io_fresh_log_once, caplog):
    """As on file systems without O_DIRECT (ramfs, some FUSE, older tmpfs): open() says EINVAL."""
    real_open = os.open

    def no_direct_open(path, flags, *args, **kw):
        if flags & os.O_DIRECT and str(path).startswith(str(tmp_path)):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(engine_mod.os, "open", no_direct_open)
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        with plain_engine(backend, io_small_options()) as eng:
            assert eng.info.direct_io is True  # asked for; not yet refused
            roundtrip(eng, tmp_path / "b.bin", rand(3 * MiB + 123), offset=17)
            assert eng.info.direct_io is False
    assert any("O_DIRECT" in rec.getMessage() for rec in caplog.records)


def test_statx_direct_io_alignment_agrees_with_the_kernel(tmp_path):
    """What direct_io_alignment reads from statx is what O_DIRECT really accepts: memory and
    offsets at the reported alignment pass, at half of it EINVAL."""
    from gdswriter.engines.dio import direct_io_alignment
    from support.engines import direct_pwrite_errno

    path = tmp_path / "dio.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        need = direct_io_alignment(fd)
    finally:
        os.close(fd)
    if need is None:
        pytest.skip("this kernel or file system does not report STATX_DIOALIGN")
    for a in (need.memory, need.offset):
        assert a & (a - 1) == 0 and a <= 4096, need
    assert direct_pwrite_errno(path, need.memory % 4096, need.offset) == 0
    if need.memory > 1:
        assert direct_pwrite_errno(path, need.memory // 2, 0) == errno.EINVAL
    if need.offset > 1:
        assert direct_pwrite_errno(path, 0, need.offset // 2) == errno.EINVAL


@pytest.mark.parametrize("reported", ["none", "8K offsets", "8K memory", "512 memory"])
def test_statx_report_decides_direct_io_and_zero_copy(backend, tmp_path, monkeypatch, io_small_options,
                                                      io_fresh_log_once, caplog, reported):
    """The file system's report (faked here: no local file system needs more than 4 KiB) decides:
    nothing said -> O_DIRECT with 4 KiB-aligned zero-copy; more than 4 KiB needed -> buffered I/O
    with a warning (gdswriter aligns to 4 KiB); less -> zero-copy from memory that aligned."""
    from gdswriter.engines.dio import DirectIOAlignment

    fake = {"none": None, "8K offsets": DirectIOAlignment(512, 8192), "8K memory": DirectIOAlignment(8192, 512),
            "512 memory": DirectIOAlignment(512, 512)}[reported]
    monkeypatch.setattr(engine_mod, "direct_io_alignment", lambda fd: fake)
    copied = []
    real_copy = engine_mod.copy_bytes
    # Counting the bytes staged: the staging copy is internal to the engine, no public seam.
    monkeypatch.setattr(engine_mod, "copy_bytes", lambda d, do, s, so, k: (copied.append(k), real_copy(d, do, s, so, k)))
    def at_512(t):  # 512 bytes into a page
        return t[512 + (-t.data_ptr()) % 4096:][:3 * MiB + 5]

    data, out = at_512(rand(3 * MiB + 2 * 4096)), at_512(torch.zeros(3 * MiB + 2 * 4096, dtype=torch.uint8))
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        with plain_engine(backend, io_small_options()) as eng:
            assert eng.write_file(tmp_path / "r.bin", [WriteSpan(0, data)]) == [crc(data)]
            assert eng.read_file(tmp_path / "r.bin", [ReadSpan(0, out)]) == [crc(data)]
            info = eng.info
    assert torch.equal(out, data)
    buffered = reported.startswith("8K")
    assert info.direct_io is not buffered
    assert info.direct_memory_alignment == {"none": 4096, "512 memory": 512}.get(reported, 0)
    assert any("more than the 4 KiB" in r.getMessage() for r in caplog.records) is buffered
    # the write and the read each stage everything, or only the 5-byte tail
    assert sum(copied) == (2 * 5 if reported == "512 memory" else 2 * data.numel())


def test_dev_shm_round_trips(backend, io_small_options):
    """tmpfs: refuses O_DIRECT before Linux 6.6, accepts it since; either way the data round-trips."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = f"/dev/shm/gdswriter-test-{os.getpid()}-{backend}.bin"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.close(fd)
        accepts_direct = True
    except OSError as e:
        assert e.errno == errno.EINVAL
        accepts_direct = False
    try:
        with plain_engine(backend, io_small_options()) as eng:
            roundtrip(eng, path, rand(MiB + 3))
            assert eng.info.direct_io is accepts_direct
    finally:
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------------------
# Injected faults (always run)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("at", [1, 2, 9, 40])
def test_injected_enospc_removes_partial_file(backend, tmp_path, io_small_options, at):
    path = tmp_path / "full.bin"
    path.write_bytes(b"old complete file")  # replaced: must not survive as a "complete" file either
    plan = FaultPlan(fail_at_request=at, errno=errno.ENOSPC, op="write")
    with FaultInjectingEngine(io_small_options(), plan, backend=backend) as eng:
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, [WriteSpan(0, rand(3 * MiB + 5))])
        e = ei.value
        assert e.errno == errno.ENOSPC and isinstance(e, OSError)
        assert e.path == str(path) and str(path) in str(e)
        assert "free space" in str(e)
        assert eng.events == [FaultEvent("fail", True, at, (at - 1) * REQUEST, REQUEST, 0)]
        assert e.offset == (at - 1) * REQUEST
        assert not path.exists(), "the partial file was left behind"
        assert_drained(eng)
        roundtrip(eng, path, rand(3 * MiB + 5, seed=2))


@pytest.mark.parametrize("err", [errno.EIO, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_injected_write_error_is_typed_with_hint(tmp_path, io_small_options, err):
    path = tmp_path / "x.bin"
    with FaultInjectingEngine(io_small_options(), FaultPlan(fail_at_request=3, errno=err, op="write")) as eng:
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, [WriteSpan(0, rand(MiB))])
    e = ei.value
    assert e.errno == err and e.offset == 2 * REQUEST
    assert f"errno {errno.errorcode[err]}" in str(e)
    assert str(e).startswith(f"write failed on {path} at byte offset {2 * REQUEST}")
    hint = {errno.EIO: "check the drive", errno.EDQUOT: "quota", errno.EROFS: "read-only",
            errno.EACCES: "Permission denied"}[err]
    assert hint in str(e)
    assert not path.exists()


@pytest.mark.parametrize("depth", [1, 16])
def test_injected_eio_mid_write_then_engine_usable(backend, tmp_path, io_small_options, depth):
    plan = FaultPlan(fail_at_request=7, op="write")
    with FaultInjectingEngine(io_small_options(queue_depth=depth), plan, backend=backend) as eng:
        path = tmp_path / "w.bin"
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, [WriteSpan(0, rand(2 * MiB))])
        assert ei.value.errno == errno.EIO and ei.value.offset == 6 * REQUEST
        assert "write failed" in str(ei.value)
        assert not path.exists()
        assert_drained(eng)
        # The fault fired once; the same engine now writes and reads correctly.
        roundtrip(eng, path, rand(2 * MiB + 1, seed=3))
        roundtrip(eng, tmp_path / "w2.bin", rand(777, seed=4))


@pytest.mark.parametrize("depth", [1, 16])
def test_injected_eio_mid_read_then_engine_usable(backend, tmp_path, io_small_options, depth):
    plan = FaultPlan(fail_at_request=5, op="read")
    data = rand(2 * MiB + 99)
    path = tmp_path / "r.bin"
    with FaultInjectingEngine(io_small_options(queue_depth=depth), plan, backend=backend) as eng:
        assert eng.write_file(path, [WriteSpan(0, data)]) == [crc(data)]  # writes are not counted
        out = torch.empty_like(data)
        with pytest.raises(EngineIOError) as ei:
            eng.read_file(path, [ReadSpan(0, out)])
        assert ei.value.errno == errno.EIO and ei.value.offset == 4 * REQUEST
        assert "read failed" in str(ei.value) and str(path) in str(ei.value)
        assert_drained(eng)
        assert path.exists()  # a failed read never touches the file
        assert eng.read_file(path, [ReadSpan(0, out)]) == [crc(data)]
        assert torch.equal(out, data)


def test_injected_failure_after_short_transfers(backend, tmp_path, io_small_options):
    """A fault that lands on a resubmitted remainder of a short transfer reports that remainder's offset."""
    # One request: it moves 4 KiB (short), its remainder is request 2, which fails.
    plan = FaultPlan(fail_at_request=2, short_every=1, errno=errno.EIO, op="write")
    with FaultInjectingEngine(io_small_options(), plan, backend=backend) as eng:
        path = tmp_path / "s.bin"
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, [WriteSpan(0, rand(REQUEST))])
        assert eng.events == [FaultEvent("short", True, 1, 0, REQUEST, 4096),
                              FaultEvent("fail", True, 2, 4096, REQUEST - 4096, 0)]
        assert ei.value.offset == 4096
        assert_drained(eng)
        assert not path.exists()
        eng.reset(FaultPlan(short_every=1, short_bytes=8192))  # every request short: still correct
        roundtrip(eng, path, rand(MiB + 4097, seed=5))
        assert eng.faults["short"] > 10 and eng.faults["fail"] == 0


def test_short_transfers_in_buffered_mode_with_unaligned_lengths(backend, tmp_path, io_small_options):
    plan = FaultPlan(short_every=1, short_bytes=777)
    with FaultInjectingEngine(io_small_options(direct_io=False), plan, backend=backend) as eng:
        roundtrip(eng, tmp_path / "u.bin", rand(300_001), offset=5)
        assert eng.info.direct_io is False
        assert eng.events and all(0 < e.submitted <= 777 and e.submitted < e.length for e in eng.events)
        assert any(e.submitted % 4096 for e in eng.events)


def test_fault_plan_validation(io_small_options):
    for bad in (dict(op="both"), dict(fail_at_request=0), dict(short_every=-1), dict(short_bytes=0),
                dict(errno=0), dict(fail_at_request=True), dict(enter_errno=-1), dict(enter_fail_at=0),
                dict(enter_fail_times=0), dict(raise_at_call=0), dict(raise_times=0), dict(raise_type=ValueError()),
                dict(raise_type=int)):
        with pytest.raises(InvalidOptionError):
            FaultPlan(**bad)
    with pytest.raises(InvalidOptionError):
        FaultInjectingEngine(io_small_options(), FaultPlan(), backend="gds")
    with pytest.raises(InvalidOptionError, match="io_uring"):
        FaultInjectingEngine(io_small_options(), FaultPlan(enter_errno=errno.EAGAIN), backend="posix")
    with FaultInjectingEngine(io_small_options(), backend="posix") as eng, pytest.raises(InvalidOptionError):
        eng.reset(FaultPlan(enter_errno=0))
    with pytest.raises(Exception):
        FaultPlan().op = "read"  # frozen


# ---------------------------------------------------------------------------
# Failures between the pipeline and the kernel: io_uring_enter errors, Ctrl-C, exceptions.
# After each: a typed error (or the KeyboardInterrupt itself), the failed file removed, and
# nothing the failed transfer queued or had in flight reaches anything else: neither the next
# file of the same engine nor a file opened meanwhile on the descriptor number it used.
# ---------------------------------------------------------------------------
FAILED = 2 * MiB + 4097  # 33 requests of 64 KiB: many enter calls, requests queued and in flight


def lowest_free_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


def fail_then_prove_isolation(eng, tmp_path, op: str, expect: type[BaseException], errno_: int | None = None):
    """Run one transfer that must fail with ``expect``; then open an innocent file (on the fd
    number the failed transfer used, where the engine closed it) and write it; then use the
    same engine again. Every byte of both files must be their own. Returns whether the engine
    closed the failed transfer's fd (False: it kept it open for good) and the faults injected."""
    path = tmp_path / "failed.bin"
    data = rand(FAILED, seed=11)
    if op == "read":
        plan, eng.plan = eng.plan, FaultPlan()
        assert eng.write_file(path, [WriteSpan(0, data)]) == [crc(data)]
        eng.reset(plan)
    out = torch.zeros(FAILED, dtype=torch.uint8)
    free = lowest_free_fd()
    with deadline(60), pytest.raises(expect) as ei:
        eng.write_file(path, [WriteSpan(0, data)]) if op == "write" else eng.read_file(path, [ReadSpan(0, out)])
    e = ei.value
    if isinstance(e, EngineIOError):
        assert e.path == str(path) and 0 <= e.offset < FAILED and str(path) in str(e)
        if errno_ is not None:
            assert e.errno == errno_
    assert not isinstance(e, KeyError) and type(e) not in (OSError, BlockingIOError, InterruptedError)
    assert path.exists() == (op == "read"), "a failed write must remove its file; a failed read keeps it"
    if not eng.broken:  # (else everything the old requests may touch is kept for good)
        assert_drained(eng)  # nothing left that could still write into ``out`` or the staging buffers
    faults = eng.faults

    innocent = tmp_path / "innocent.bin"
    ifd = os.open(innocent, os.O_RDWR | os.O_CREAT, 0o644)
    closed = ifd == free
    if not closed:  # kept open for good: the fd still names the failed file, nothing else
        assert os.fstat(free).st_ino == os.stat(path).st_ino if op == "read" else os.fstat(free).st_nlink == 0
    theirs = os.urandom(FAILED + 5000)
    try:
        assert os.pwrite(ifd, theirs, 0) == len(theirs)
        eng.reset(FaultPlan())
        with deadline(60):
            roundtrip(eng, tmp_path / "next.bin", rand(FAILED, seed=12))
            roundtrip(eng, tmp_path / "small.bin", rand(5000, seed=13))
        assert_drained(eng)
        assert os.pread(ifd, len(theirs) + 1, 0) == theirs, "another file received the failed transfer's bytes"
    finally:
        os.close(ifd)
    return closed, faults


@pytest.fixture
def fast_ring_retries(monkeypatch):
    # Short ring backoff: module constants, not options (an option would widen EngineOptions for tests only).
    monkeypatch.setattr(uring_mod, "BACKOFF_S", 1e-4)
    monkeypatch.setattr(uring_mod, "BACKOFF_MAX_S", 1e-3)


@contextlib.contextmanager
def stuck_request(eng):
    """The first io_uring_enter under a plan that fails enter calls queues, besides the
    pipeline's requests, a read from an empty pipe (the next call submits it): a request the
    kernel does not complete, as on a hung device, until the pipe is closed."""
    ring = eng._backend.real.ring
    rpipe, wpipe = os.pipe()
    buf = ctypes.create_string_buffer(16)
    real, fired = ring.enter_syscall, []

    def enter(*args):
        if not fired and eng.plan.enter_errno is not None:
            fired.append(ring.prep(uring_mod.OP_READ, rpipe, ctypes.addressof(buf), 16, 0, user_data=1 << 62))
        return real(*args)

    ring.enter_syscall = enter
    try:
        yield
    finally:
        os.close(wpipe)  # the read completes (end of file) in the ring that keeps it
        os.close(rpipe)


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("err", [errno.EAGAIN, errno.EBUSY, 0, errno.EFAULT])
@pytest.mark.parametrize("stuck", [False, True], ids=["completing", "stuck"])
def test_enter_failing_for_good_mid_transfer(tmp_path, io_small_options, fast_ring_retries, op, err, stuck):
    """io_uring_enter fails from the 3rd call on, also while the engine cleans up (the kernel
    cannot allocate requests and never recovers, returns 0 forever, or a hard error): a typed
    EngineIOError after bounded retries. Requests the kernel completes anyway are reaped; when
    one is stuck, nothing proves the ring idle: the fd stays open for good, the old buffers and
    tensors are kept, and the engine goes on with a fresh ring."""
    plan = FaultPlan(enter_errno=err, enter_fail_at=3, enter_fail_times=10**9)
    # queue_depth 12 on a 16-entry ring: room for the stuck request at any time
    with FaultInjectingEngine(io_small_options(queue_depth=12), plan) as eng:
        kept_before = len(engine_mod.kept_for_good())
        old_backend = eng._backend
        with stuck_request(eng) if stuck else contextlib.nullcontext():
            closed, faults = fail_then_prove_isolation(eng, tmp_path, op, EngineIOError, err or errno.EAGAIN)
            assert faults["enter"] >= (1 if err == errno.EFAULT else uring_mod.STALL_RETRIES)
            if stuck:
                assert not closed
                backend, pool, fd, spans = engine_mod.kept_for_good()[-1]
                assert len(engine_mod.kept_for_good()) == kept_before + 1
                assert backend == old_backend and pool is not None and eng._pool is not pool
                assert not pool.closed and pool.buffers, "buffers the kernel may still use were released"
                assert spans and os.fstat(fd)  # the tensors are referenced, the fd open
        if stuck:  # closing the engine does not release what is kept either
            eng.close()
            assert not pool.closed and os.fstat(fd)


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("err,times", [(errno.EAGAIN, 3), (errno.EBUSY, 3), (errno.EINTR, 300), (0, 5)])
def test_enter_failing_for_a_while_is_absorbed(tmp_path, io_small_options, fast_ring_retries, op, err, times):
    """Transient EAGAIN/EBUSY (reap, wait, retry), an EINTR storm, a few calls taking nothing:
    the transfer succeeds with the right bytes."""
    plan = FaultPlan(enter_errno=err, enter_fail_at=4, enter_fail_times=times)
    data = rand(FAILED, seed=5)
    path = tmp_path / "transient.bin"
    with FaultInjectingEngine(io_small_options(), plan) as eng:
        if op == "read":
            eng.reset(FaultPlan())
            eng.write_file(path, [WriteSpan(0, data)])
            eng.reset(plan)
        with deadline(60):
            if op == "write":
                assert eng.write_file(path, [WriteSpan(0, data)]) == [crc(data)]
            out = torch.zeros_like(data)
            assert eng.read_file(path, [ReadSpan(0, out)]) == [crc(data)]
        assert torch.equal(out, data) and path.read_bytes() == data.numpy().tobytes()
        assert eng.faults["enter"] == times
        assert_drained(eng)


INTERRUPT_POINTS = [1, 2, 3, 4, 5, 6]  # a read here takes 6 enter calls, a write 11 to 13


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("after", [True, False], ids=["after-syscall", "before-syscall"])
@pytest.mark.parametrize("at", INTERRUPT_POINTS)
def test_ctrl_c_between_io_uring_syscalls(tmp_path, io_small_options, op, after, at):
    """KeyboardInterrupt at the at-th io_uring_enter (just after it returned, its result lost,
    or just before it, requests queued), and once more during the cleanup: it propagates as
    itself; the engine waited for everything it had submitted and withdrew the rest."""
    plan = FaultPlan(raise_at_call=at, raise_times=2, raise_after=after)
    with FaultInjectingEngine(io_small_options(), plan) as eng:
        closed, faults = fail_then_prove_isolation(eng, tmp_path, op, KeyboardInterrupt)
        assert closed and faults["raise"] in (1, 2)  # 1: the cleanup needed no call


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("at", [1, 2, 4, 9, 20, 35])  # of about 40 calls
def test_ctrl_c_in_the_posix_pipeline(tmp_path, io_small_options, op, at):
    """KeyboardInterrupt at a POSIX backend call (submit, wait), and again during the cleanup:
    no worker thread writes into the fd after write_file returns, even on a reused number."""
    plan = FaultPlan(raise_at_call=at, raise_times=2)
    with FaultInjectingEngine(io_small_options(), plan, backend="posix") as eng:
        closed, faults = fail_then_prove_isolation(eng, tmp_path, op, KeyboardInterrupt)
        assert closed and faults["raise"] in (1, 2)  # 1: the cleanup needed no call


class _InterruptedQueue:
    """The POSIX backend's completion queue, with Ctrl-C landing inside wait() right after it
    took the at-th completion: the backend's count of requests in flight is then one too high."""

    def __init__(self, real, at: int):
        self.real, self.at, self.taken = real, at, 0

    def get(self):
        item = self.real.get()
        self.taken += 1
        if self.taken == self.at:
            raise KeyboardInterrupt("injected inside wait()")
        return item

    def get_nowait(self):
        return self.real.get_nowait()

    def put(self, item):
        self.real.put(item)


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("at", [1, 3])
def test_posix_cleanup_does_not_trust_its_counts(tmp_path, io_small_options, op, at):
    """Cleanup proves the workers idle by cancelling what they did not start and joining them,
    not by counting completions (a count an interruption left wrong would wait forever)."""
    with FaultInjectingEngine(io_small_options(), FaultPlan(), backend="posix") as eng:
        real = eng._backend.real
        if op == "read":
            eng.write_file(tmp_path / "failed.bin", [WriteSpan(0, rand(FAILED, seed=11))])
        real._done = _InterruptedQueue(real._done, at)
        with deadline(20), pytest.raises(KeyboardInterrupt):
            (eng.write_file(tmp_path / "failed.bin", [WriteSpan(0, rand(FAILED, seed=11))]) if op == "write" else
             eng.read_file(tmp_path / "failed.bin", [ReadSpan(0, torch.zeros(FAILED, dtype=torch.uint8))]))
        assert not eng.broken
        assert_drained(eng)
        roundtrip(eng, tmp_path / "next.bin", rand(FAILED, seed=12))


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("backend_kind", BACKENDS)
def test_exception_in_the_pipeline(tmp_path, io_small_options, monkeypatch, op, backend_kind):
    """Any exception while requests are in flight (here a failing copy of the 5th staged piece;
    memory 64 bytes into a page is staged whole) propagates as itself, after the same cleanup."""
    real, calls = engine_mod.copy_bytes, []

    def copy(*args):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("copy failed (injected)")
        real(*args)

    with FaultInjectingEngine(io_small_options(), FaultPlan(), backend=backend_kind) as eng:
        if op == "read":  # the file first, with the real copy
            eng.write_file(tmp_path / "failed.bin", [WriteSpan(0, rand(FAILED, seed=11))])
        # Fault injection at the staging copy (undone below), through its seam.
        monkeypatch.setattr(engine_mod, "copy_bytes", copy)
        data = host_tensor(FAILED, "aligned+64", gen=torch.Generator().manual_seed(11))
        with pytest.raises(RuntimeError, match="injected"):
            (eng.write_file(tmp_path / "failed.bin", [WriteSpan(0, data)]) if op == "write" else
             eng.read_file(tmp_path / "failed.bin", [ReadSpan(0, host_tensor(FAILED, "aligned+64", fill=0))]))
        monkeypatch.setattr(engine_mod, "copy_bytes", real)
        assert_drained(eng)
        assert (tmp_path / "failed.bin").exists() == (op == "read")
        roundtrip(eng, tmp_path / "next.bin", rand(FAILED, seed=12))


def test_an_interruption_that_skipped_the_cleanup_is_caught_at_the_next_call(tmp_path, io_small_options):
    """Should Ctrl-C land where no cleanup runs (between a syscall and the handler), the next
    call finds requests still in the ring and waits them out before it starts."""
    with FaultInjectingEngine(io_small_options()) as eng:
        ring = eng._backend.real.ring
        fd = os.open(tmp_path / "orphan.bin", os.O_RDWR | os.O_CREAT, 0o644)
        src = rand(256 * KiB)
        try:
            for i in range(4):
                ring.prep(uring_mod.OP_WRITE, fd, src.data_ptr() + i * 64 * KiB, 64 * KiB, i * 64 * KiB, 10**6 + i)
            ring.submit()
            assert ring.in_flight == 4
            roundtrip(eng, tmp_path / "next.bin", rand(FAILED, seed=3))  # no KeyError: stale completions reaped
            assert ring.in_flight == 0
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------
# Hostile paths: symbolic links and special files where a data file should be
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", HOSTILE)
def test_write_refuses_what_is_not_a_regular_file_and_touches_nothing(backend, tmp_path, io_small_options, kind):
    """A planted link or special file is refused with a typed error before any I/O or
    truncation; an innocent file it points at keeps its bytes; what was planted stays."""
    innocent = tmp_path / "innocent.bin"
    innocent.write_bytes(b"precious" * 1000)
    before = os.stat(innocent)
    path = tmp_path / "data.bin"
    keep = plant(kind, path, innocent)
    try:
        with plain_engine(backend, io_small_options()) as eng, deadline(30):
            with pytest.raises(NotRegularFileError) as ei:
                eng.write_file(path, [WriteSpan(0, rand(MiB + 5))])
            e = ei.value
            assert isinstance(e, EngineIOError) and not isinstance(e, CorruptCheckpointError)
            assert e.path == str(path) and e.kind == kind.replace("dangling ", "").replace(" with a reader", "") \
                .replace("symlink", "symbolic link")
            assert e.errno == {"symlink": errno.ELOOP, "dangling symlink": errno.ELOOP,
                               "directory": errno.EISDIR}.get(kind, errno.EINVAL)
            assert "not a regular file" in str(e) and "untouched" in str(e)
            roundtrip(eng, tmp_path / "fine.bin", rand(5000))  # the engine is unaffected
        assert innocent.read_bytes() == b"precious" * 1000
        after = os.stat(innocent)
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        assert os.path.lexists(path) and stat.S_IFMT(os.lstat(path).st_mode) != stat.S_IFREG
        assert not (tmp_path / "nothing-here").exists(), "created a file through a dangling link"
        if kind == "FIFO with a reader":
            try:
                got = os.read(keep, 100)  # b"": the writer end was opened and closed, nothing written
            except BlockingIOError:
                got = b""
            assert got == b"", "bytes were written into the FIFO"
    finally:
        if isinstance(keep, int):
            os.close(keep)
        elif keep is not None:
            keep.close()


@pytest.mark.parametrize("kind", ["symlink", "directory", "FIFO", "socket", "character device"])
def test_read_refuses_a_data_file_that_is_not_a_regular_file(backend, tmp_path, io_small_options, kind):
    """Reading, a link or special file where a data file should be is a damaged checkpoint:
    DataFileNotRegularError is both an EngineIOError and a CorruptCheckpointError (the caller's
    action is the same as for any corrupt checkpoint: load an earlier step). Even a link to a
    file holding exactly the right bytes is refused, and a FIFO never blocks the read."""
    data = rand(MiB + 5)
    with plain_engine(backend, io_small_options()) as eng, deadline(30):
        eng.write_file(tmp_path / "real.bin", [WriteSpan(0, data)])
        path = tmp_path / "data.bin"
        keep = plant(kind, path, tmp_path / "real.bin")
        out = torch.zeros_like(data)
        try:
            with pytest.raises(DataFileNotRegularError) as ei:
                eng.read_file(path, [ReadSpan(0, out)])
        finally:
            if keep is not None:
                keep.close()
        e = ei.value
        assert isinstance(e, CorruptCheckpointError) and isinstance(e, EngineIOError) and e.path == str(path)
        assert "tampered" in str(e) and "earlier step" in str(e)
        assert not out.any(), "bytes were read through it"
        assert eng.read_file(tmp_path / "real.bin", [ReadSpan(0, out)]) == [crc(data)]


def test_load_refuses_a_symlinked_data_file(tmp_path):
    """End to end: a checkpoint whose data file was swapped for a link to an identical copy
    does not load; the error is a CorruptCheckpointError."""
    from gdswriter import GDSCheckpointer

    model = torch.nn.Linear(64, 64)
    with GDSCheckpointer(model, None, root=tmp_path / "ck") as ck:
        ck.save(1)
    data_files = [p for p in (tmp_path / "ck").rglob("*") if p.is_file() and p.suffix not in (".json", ".lock")
                  and p.stat().st_size >= 64 * 64 * 4]
    assert data_files, list((tmp_path / "ck").rglob("*"))
    victim = data_files[0]
    copy = tmp_path / "copy.bin"
    shutil.copyfile(victim, copy)
    victim.unlink()
    victim.symlink_to(copy)
    with GDSCheckpointer(torch.nn.Linear(64, 64), None, root=tmp_path / "ck") as ck, \
            pytest.raises(CorruptCheckpointError):
        ck.load(1)


# ---------------------------------------------------------------------------
# Truncated files on read
# ---------------------------------------------------------------------------
def test_truncated_file_on_read(backend, tmp_path, io_small_options):
    data = rand(MiB)
    path = tmp_path / "t.bin"
    with plain_engine(backend, io_small_options()) as eng:
        eng.write_file(path, [WriteSpan(0, data)])
        os.truncate(path, 500_000)
        with pytest.raises(TruncatedFileError) as ei:
            eng.read_file(path, [ReadSpan(0, torch.empty(10, dtype=torch.uint8)),
                                 ReadSpan(600_000, torch.empty(MiB - 600_000, dtype=torch.uint8))])
        e = ei.value
        assert isinstance(e, CorruptCheckpointError)
        assert e.needed == MiB and e.actual == 500_000 and str(path) in str(e)
        # What is still there reads fine, up to the very last byte.
        out = torch.empty(500_000, dtype=torch.uint8)
        assert eng.read_file(path, [ReadSpan(0, out)]) == [crc(data[:500_000])]
        assert torch.equal(out, data[:500_000])


def test_file_shrinking_during_read_is_short_io(backend, tmp_path, io_small_options, monkeypatch):
    """The file ends before the size seen at open (truncated meanwhile): ShortIOError, engine usable."""
    data = rand(300_000)
    path = tmp_path / "shrunk.bin"
    with plain_engine(backend, io_small_options()) as eng:
        eng.write_file(path, [WriteSpan(0, data)])
        real_fstat = os.fstat

        class _Stat:
            def __init__(self, st):
                self.st_size = st.st_size + 200_000
                self.st_mode = st.st_mode

        monkeypatch.setattr(engine_mod.os, "fstat", lambda fd: _Stat(real_fstat(fd)))
        with pytest.raises(ShortIOError) as ei:
            eng.read_file(path, [ReadSpan(0, torch.empty(500_000, dtype=torch.uint8))])
        assert ei.value.errno == errno.EIO and "truncated" in str(ei.value)
        assert_drained(eng)
        monkeypatch.undo()
        roundtrip(eng, path, data)


# ---------------------------------------------------------------------------
# Engine selection
# ---------------------------------------------------------------------------
def test_auto_picks_io_uring_here(io_small_options):
    why = uring_mod.probe()
    if why is not None:
        pytest.skip(f"io_uring unavailable on this machine: {why}")
    with create_engine(io_small_options(engine="auto")) as eng:
        assert isinstance(eng, IoUringEngine)
        assert eng.info.name == "io_uring" and eng.info.reason == ""
    with create_engine(io_small_options(engine="posix")) as eng:
        assert isinstance(eng, PosixEngine) and "requested" in eng.info.reason


def test_auto_falls_back_to_posix_when_io_uring_unavailable(monkeypatch, io_small_options, io_fresh_log_once,
                                                             caplog, tmp_path):
    reason = "io_uring is forbidden here (EPERM: simulated by the test)"
    monkeypatch.setattr(uring_mod, "probe", lambda: reason)
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        with create_engine(io_small_options(engine="auto")) as eng:
            assert isinstance(eng, PosixEngine)
            assert eng.info.name == "posix" and eng.info.reason == reason
            roundtrip(eng, tmp_path / "p.bin", rand(100_000))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "gdswriter"]
    assert any(reason in r.getMessage() and "POSIX" in r.getMessage() for r in warnings), caplog.text

    # Asking for io_uring explicitly is an error that says what to do instead.
    with pytest.raises(EngineUnavailableError) as ei:
        IoUringEngine(io_small_options(engine="io_uring"))
    assert isinstance(ei.value, OSError) and "GDSWRITER_ENGINE=posix" in str(ei.value)
    with pytest.raises(EngineUnavailableError):
        create_engine(io_small_options(engine="io_uring"))
    with pytest.raises(EngineUnavailableError):
        FaultInjectingEngine(io_small_options())


# ---------------------------------------------------------------------------
# EngineOptions validation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(engine="gds-turbo"), dict(request_bytes=5000), dict(request_bytes=0), dict(num_buffers=1),
    dict(buffer_bytes=100 * KiB, request_bytes=64 * KiB), dict(queue_depth=0), dict(queue_depth=5000),
    dict(queue_depth=True), dict(queue_depth=2.0),
])
def test_engine_options_rejects(bad):
    with pytest.raises(InvalidOptionError) as ei:
        EngineOptions(**bad)
    assert isinstance(ei.value, ValueError)
    assert next(iter(bad)) in str(ei.value)


def test_engine_options_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        EngineOptions("posix")  # type: ignore[misc]
    o = EngineOptions()
    with pytest.raises(Exception):
        o.queue_depth = 3  # type: ignore[misc]


def test_engine_options_from_env():
    assert EngineOptions.from_env({}) == EngineOptions()
    o = EngineOptions.from_env({"GDSWRITER_BUFFER_BYTES": "8M", "GDSWRITER_REQUEST_BYTES": "1MiB",
                                "GDSWRITER_QUEUE_DEPTH": " 32 ", "GDSWRITER_DIRECT_IO": "0",
                                "GDSWRITER_ENGINE": "posix", "GDSWRITER_NUM_BUFFERS": "2",
                                "GDSWRITER_LOCK_MEMORY": "off", "GDSWRITER_HUGE_PAGES": "no"})
    assert (o.buffer_bytes, o.request_bytes, o.queue_depth) == (8 * MiB, MiB, 32)
    assert (o.direct_io, o.engine, o.num_buffers, o.lock_memory, o.huge_pages) == (False, "posix", 2, False, False)
    assert EngineOptions.from_env({"GDSWRITER_BUFFER_BYTES": "1g", "GDSWRITER_REQUEST_BYTES": "4k"}).buffer_bytes == 1 << 30
    # explicit overrides beat the environment
    assert EngineOptions.from_env({"GDSWRITER_QUEUE_DEPTH": "8"}, queue_depth=4).queue_depth == 4


@pytest.mark.parametrize("var,value", [("GDSWRITER_QUEUE_DEPTH", "abc"), ("GDSWRITER_BUFFER_BYTES", "8X"),
                                       ("GDSWRITER_DIRECT_IO", "maybe"), ("GDSWRITER_ENGINE", "warp-drive"),
                                       ("GDSWRITER_REQUEST_BYTES", "5000")])
def test_engine_options_from_env_rejects(var, value):
    with pytest.raises(InvalidOptionError) as ei:
        EngineOptions.from_env({var: value})
    if var != "GDSWRITER_REQUEST_BYTES":
        assert var in str(ei.value) or value in str(ei.value)


def test_engine_options_from_process_environment(monkeypatch):
    monkeypatch.setenv("GDSWRITER_QUEUE_DEPTH", "abc")
    with pytest.raises(InvalidOptionError):
        EngineOptions.from_env()
    monkeypatch.setenv("GDSWRITER_QUEUE_DEPTH", "2")
    monkeypatch.setenv("GDSWRITER_BUFFER_BYTES", "8M")
    o = EngineOptions.from_env()
    assert o.queue_depth == 2 and o.buffer_bytes == 8 * MiB
