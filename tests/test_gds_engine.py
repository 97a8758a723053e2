"""The KvikIO (GDS) engine, gdswriter/engines/kvikio.py.

The engine contract suite (test_engine_contract.py) runs its cases against this engine too
(support/engines.py's KVIKIO_KINDS): everywhere against the engine's device path with a
stand-in for KvikIO (tests/support/fake_kvikio.py: KvikIO cannot even import without an
NVIDIA driver) and host tensors taken for device memory; on a GPU machine with KvikIO
against the real engine with every span in CUDA memory, and with CUDA and host spans mixed
in one file. Here, the adapter's own logic is tested: the I/O plan, which path really runs,
error mapping, durability, mixed files, engine selection.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys

import crc32c
import pytest
import torch
from support.engines import (HOSTILE, disk, image, install_fake_kvikio, isolate_from_host, kvikio_importable, plant,
                             pretend_cuda, rand)
from support.fake_kvikio import CompatMode, FakeKvikio
from support.timeouts import deadline

import gdswriter.engines.kvikio as gds
from gdswriter.engines.base import ReadSpan, WriteSpan
from gdswriter.engines.select import create_engine
from gdswriter.errors import (CorruptCheckpointError, DataFileNotRegularError, EngineIOError, EngineUnavailableError,
                              NotRegularFileError, TruncatedFileError)
from gdswriter.engines.staged import IoUringEngine, PosixEngine
from gdswriter.options import ALIGN, EngineOptions, KiB, MiB

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """KvikIO in compat mode (no nvidia-fs, cuFile says no GDS), host tensors taken for device memory."""
    return install_fake_kvikio(monkeypatch, tmp_path)


def fake_gds(monkeypatch, tmp_path, **kw) -> FakeKvikio:
    """KvikIO in GDS mode: nvidia-fs loaded, cuFile says GDS works."""
    return install_fake_kvikio(monkeypatch, tmp_path, gds_available=True, **kw)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


def write_and_check(eng, path, spans, size=None):
    crcs = eng.write_file(path, spans, size=size)
    assert crcs == [crc32c.crc32c(s.data.numpy().tobytes()) for s in spans]
    want = size if size is not None else (spans[-1].end if spans else 0)
    assert disk(path) == image(spans, want)
    return crcs


def read_back(eng, path, spans):
    outs = [ReadSpan(s.offset, torch.full_like(s.data, 0x5A)) for s in spans]
    crcs = eng.read_file(path, outs)
    for s, o in zip(spans, outs):
        assert torch.equal(s.data, o.out), s.offset
    assert crcs == [crc32c.crc32c(s.data.numpy().tobytes()) for s in spans]


def small_options(**kw) -> EngineOptions:
    base = dict(buffer_bytes=256 * KiB, request_bytes=64 * KiB, num_buffers=3, queue_depth=16)
    return EngineOptions(**{**base, **kw})


# ---------------------------------------------------------------------------
# Which path really runs
# ---------------------------------------------------------------------------
def test_compat_mode_is_reported_as_such(fake):
    status = gds.gds_status()
    assert not status.gpu_direct and status.mode == "kvikio-compat"
    assert "nvidia-fs" in status.reason and "is_gds_available=False" in status.reason
    with gds.GdsEngine(small_options()) as eng:
        info = eng.info
        assert (info.name, info.cuda_path, info.gpu_direct, info.direct_io) == ("kvikio-compat", "kvikio-compat",
                                                                                False, False)
        assert "nvidia-fs" in info.reason


def test_true_gds_needs_driver_cufile_and_kvikio_to_agree(monkeypatch, tmp_path):
    f = fake_gds(monkeypatch, tmp_path)
    assert gds.gds_status().gpu_direct
    f.settings["compat_mode"] = CompatMode.ON  # KVIKIO_COMPAT_MODE=ON forces POSIX
    s = gds.gds_status()
    assert not s.gpu_direct and "compat_mode=ON" in s.reason
    f.settings["compat_mode"] = CompatMode.AUTO
    f.driver["is_gds_available"] = False
    assert not gds.gds_status().gpu_direct
    f.driver["is_gds_available"] = True
    elsewhere = tmp_path / "no-driver"
    elsewhere.mkdir()
    isolate_from_host(monkeypatch, elsewhere)  # nvidia-fs not loaded
    assert not gds.gds_status().gpu_direct
    # The kernel's P2PDMA, set up in cufile.json, stands in for nvidia-fs.
    cf = tmp_path / "p2p.json"
    cf.write_text('{ // comment\n "properties": {"use_pci_p2pdma": true, /* x */ "allow_compat_mode": false,},\n}')
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(cf))
    assert gds.gds_status().gpu_direct


def test_gds_mode_names_each_file_by_the_path_its_bytes_took(monkeypatch, tmp_path, gen):
    f = fake_gds(monkeypatch, tmp_path)
    spans = [WriteSpan(0, rand(MiB, gen)), WriteSpan(MiB, rand(5000, gen))]
    with gds.GdsEngine(small_options(), require_gpu_direct=True) as eng:
        assert (eng.info.name, eng.info.cuda_path, eng.info.gpu_direct) == ("gds", "gds", True)
        write_and_check(eng, tmp_path / "a.bin", spans)
        assert eng.info.name == "gds"
        f.gds_fs_supported = False  # e.g. a file system cuFile does not support: per-file POSIX fallback
        write_and_check(eng, tmp_path / "b.bin", spans)
        assert eng.info.name == "kvikio-compat" and eng.info.cuda_path == "gds"
        f.gds_fs_supported = True
        read_back(eng, tmp_path / "a.bin", spans)
        # Staging buffers are registered with cuFile under GDS only where device memory is real.
        assert not f.registered


def test_gds_requested_but_unavailable_says_why(fake):
    with pytest.raises(EngineUnavailableError, match="nvidia-fs") as ei:
        gds.GdsEngine(small_options(), require_gpu_direct=True)
    assert ei.value.errno == errno.ENOTSUP and "engine='kvikio'" in str(ei.value)


def test_kvikio_missing_or_unloadable(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)
    with pytest.raises(EngineUnavailableError, match=r"gdswriter\[gds-cu13\]"):
        gds.import_kvikio()
    with pytest.raises(EngineUnavailableError):
        create_engine(small_options(engine="kvikio"))

    class Unloadable:
        def find_spec(self, name, path=None, target=None):
            if name == "kvikio":
                raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.delitem(sys.modules, "kvikio")
    monkeypatch.setattr(sys, "meta_path", [Unloadable(), *sys.meta_path])
    with pytest.raises(EngineUnavailableError, match="libcuda") as ei:
        gds.import_kvikio()
    assert ei.value.errno == errno.ENOTSUP


def test_cufile_json_tolerant_parse(tmp_path, monkeypatch):
    p = tmp_path / "cufile.json"
    p.write_text('{\n  // comment with "quotes"\n  "logging": {"dir": "/tmp//x"}, /* block\n comment */\n'
                 '  "properties": {"max_direct_io_size_kb": 16384, "allow_compat_mode": true,\n'
                 '                 "use_poll_mode": false,},\n}\n')
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(p))
    cfg = gds.read_cufile_json()
    assert cfg.path == str(p) and not cfg.error
    assert cfg.data["logging"]["dir"] == "/tmp//x"
    assert (cfg.prop("max_direct_io_size_kb"), cfg.prop("allow_compat_mode"), cfg.prop("use_poll_mode")) == (
        16384, True, False)
    p.write_text("{ not json")
    assert gds.read_cufile_json().data is None and "JSON" in gds.read_cufile_json().error
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(tmp_path / "missing.json"))
    assert "cannot read" in gds.read_cufile_json().error


def test_kvikio_threads_tuned_unless_user_chose(fake, monkeypatch):
    with gds.GdsEngine(small_options(queue_depth=32)):
        assert fake.settings["num_threads"] == gds.MAX_THREADS
    fake.settings["num_threads"] = 1
    monkeypatch.setenv("KVIKIO_NTHREADS", "1")
    with gds.GdsEngine(small_options(queue_depth=32)):
        assert fake.settings["num_threads"] == 1


# ---------------------------------------------------------------------------
# Layout, errors, durability
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["aligned", "packed"])
def test_small_spans_coalesce_into_aligned_requests(fake, tmp_path, gen, layout):
    rnd = random.Random(11)
    spans, off = [], (0 if layout == "aligned" else 7)
    for _ in range(2000):
        n = rnd.randint(1, 300)
        spans.append(WriteSpan(off, rand(n, gen)))
        off = off + ALIGN if layout == "aligned" else off + n + rnd.randint(0, 5)
    with gds.GdsEngine(small_options()) as eng:
        write_and_check(eng, tmp_path / "s.bin", spans)
        read_back(eng, tmp_path / "s.bin", spans)
    for op in ("write", "read"):
        calls = [(o, n) for k, o, n in fake.calls if k == op]
        assert len(calls) <= -(-spans[-1].end // (256 * KiB)) + 1, (op, len(calls))
        assert all(o % ALIGN == 0 for o, _ in calls)
        ends = sorted(calls)
        assert all(a + n <= b for (a, n), (b, _) in zip(ends, ends[1:])), "requests overlap"


def test_write_error_is_typed_leaves_no_file_and_engine_recovers(fake, tmp_path, gen):
    spans = [WriteSpan(0, rand(3 * MiB, gen)), WriteSpan(3 * MiB + 5, rand(7000, gen))]
    path = tmp_path / "fail.bin"
    with gds.GdsEngine(small_options()) as eng:
        fake.fail = {"op": "write", "at": 3, "errno": errno.ENOSPC}
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, spans)
        assert ei.value.errno == errno.ENOSPC and str(path) in str(ei.value)
        assert "free space" in str(ei.value) and "KvikIO" in str(ei.value)
        assert not path.exists(), "a failed write must not leave a partial file"
        assert fake.tasks_in_flight == 0 and fake.open_files == 0
        fake.fail = None
        write_and_check(eng, path, spans)
        fake.fail = {"op": "read", "at": 0, "errno": errno.EIO}
        with pytest.raises(EngineIOError) as ei:
            eng.read_file(path, [ReadSpan(0, torch.empty(3 * MiB, dtype=torch.uint8))])
        assert ei.value.errno == errno.EIO and "doctor" in str(ei.value)
        assert fake.tasks_in_flight == 0 and fake.open_files == 0
        fake.fail = None
        read_back(eng, path, spans)


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_failed_request_waits_out_the_others(fake, tmp_path, gen, op):
    """The first request fails at once while later ones still run: the error is raised only
    after every request is over (KvikIO's threads would otherwise still touch the memory,
    and the file, after the engine returned)."""
    spans = [WriteSpan(0, rand(100, gen))] + [WriteSpan(k * MiB, rand(MiB, gen)) for k in range(1, 5)]
    path = tmp_path / "slow.bin"
    with gds.GdsEngine(small_options(buffer_bytes=64 * KiB, request_bytes=64 * KiB)) as eng:
        if op == "read":
            write_and_check(eng, path, spans)
        fake.fail = {"op": op, "at": 0, "errno": errno.EIO}
        fake.task_delay = 0.3
        with pytest.raises(EngineIOError):
            if op == "write":
                eng.write_file(path, spans)
            else:
                eng.read_file(path, [ReadSpan(s.offset, torch.empty_like(s.data)) for s in spans])
        assert fake.tasks_in_flight == 0


class _ShortFuture:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


@pytest.mark.parametrize("write", [True, False])
def test_short_transfers_are_typed_errors(write):
    """KvikIO loops until a request is complete, but a future reporting fewer bytes must
    never pass for success."""
    from gdswriter.errors import ShortIOError

    reqs = gds.Requests("/x/f.bin", write=write)
    key = reqs.issue(gds.Piece(8192, 4096, 0), lambda: _ShortFuture(1000))
    with pytest.raises(EngineIOError) as ei:
        reqs.wait(key)
    assert ei.value.offset == 8192 + 1000 and isinstance(ei.value, ShortIOError) != write
    reqs.wait(key)  # waited once only: a KvikIO future cannot be asked twice


def test_open_errors_are_typed(fake, tmp_path, gen):
    with gds.GdsEngine(small_options()) as eng:
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(tmp_path / "no" / "dir.bin", [WriteSpan(0, rand(10, gen))])
        assert ei.value.errno == errno.ENOENT
        with pytest.raises(EngineIOError) as ei:
            eng.read_file(tmp_path / "missing.bin", [ReadSpan(0, torch.empty(10, dtype=torch.uint8))])
        assert ei.value.errno == errno.ENOENT


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_paths_are_refused_before_kvikio_opens_them(fake, tmp_path, gen, kind):
    """KvikIO opens by name and follows links: the engine checks the path first, as the host
    engines do (tests/test_engine_faults.py), so a planted link or special file is refused
    with the same typed errors, nothing is truncated through it, and a FIFO never blocks."""
    innocent = tmp_path / "innocent.bin"
    innocent.write_bytes(b"precious" * 1000)
    path = tmp_path / "data.bin"
    keep = plant(kind, path, innocent)
    try:
        with gds.GdsEngine(small_options()) as eng, deadline(30):
            with pytest.raises(NotRegularFileError) as ei:
                eng.write_file(path, [WriteSpan(0, rand(50_000, gen))])
            assert not isinstance(ei.value, CorruptCheckpointError) and ei.value.path == str(path)
            if kind not in ("dangling symlink", "FIFO with a reader"):
                out = torch.zeros(5000, dtype=torch.uint8)
                with pytest.raises(DataFileNotRegularError):
                    eng.read_file(path, [ReadSpan(0, out)])
                assert not out.any()
        assert innocent.read_bytes() == b"precious" * 1000
        assert not [c for c in fake.calls if c[0] in ("write", "read")], "KvikIO was given the path"
    finally:
        if isinstance(keep, int):
            os.close(keep)
        elif keep is not None:
            keep.close()


def test_an_interrupted_drain_still_waits_for_every_request():
    """A second Ctrl-C while the engine waits out its requests after an error: every request
    is still waited for before the interruption goes on (the file is closed next, and KvikIO's
    threads must be done with its descriptor and the memory)."""
    class Fut:
        def __init__(self, interrupts: int):
            self.interrupts, self.done = interrupts, False

        def get(self):
            if self.interrupts:
                self.interrupts -= 1
                raise KeyboardInterrupt
            self.done = True
            return 0

    reqs = gds.Requests("f.bin", write=True)
    futs = [Fut(2), Fut(0), Fut(1)]
    reqs.pending = {i: (None, f) for i, f in enumerate(futs)}
    with pytest.raises(KeyboardInterrupt):
        reqs.drain()
    assert all(f.done for f in futs) and not reqs.pending


def test_truncated_file_is_refused_before_reading(fake, tmp_path, gen):
    with gds.GdsEngine(small_options()) as eng:
        path = tmp_path / "t.bin"
        write_and_check(eng, path, [WriteSpan(0, rand(10_000, gen))])
        with pytest.raises(TruncatedFileError):
            eng.read_file(path, [ReadSpan(5000, torch.empty(6000, dtype=torch.uint8))])
        assert all(op != "read" for op, _, _ in fake.calls)


@pytest.mark.parametrize("durable", [True, False])
def test_durable_write_syncs_the_file(fake, tmp_path, gen, monkeypatch, durable):
    """fdatasync on the file's own descriptor before returning, exactly when durable."""
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    path = tmp_path / "d.bin"
    with gds.GdsEngine(small_options()) as eng:
        eng.write_file(path, [WriteSpan(0, rand(50_000, gen))], durable=durable)
    assert synced == ([str(path)] if durable else [])


def test_files_without_device_memory_go_to_the_host_engine(monkeypatch, tmp_path, gen):
    f = FakeKvikio()
    f.install(monkeypatch)
    isolate_from_host(monkeypatch, tmp_path)
    spans = [WriteSpan(0, rand(200_000, gen))]
    with gds.GdsEngine(small_options(), host_engine=lambda: IoUringEngine(small_options())) as eng:
        write_and_check(eng, tmp_path / "h.bin", spans)
        assert eng.info.name == "io_uring" and eng.info.cuda_path == "kvikio-compat"
        read_back(eng, tmp_path / "h.bin", spans)
    assert f.calls == []


def test_mixed_file_device_and_host_spans(monkeypatch, tmp_path, gen):
    """A file holding device and host tensors goes through KvikIO whole, host spans included."""
    f = FakeKvikio()
    f.install(monkeypatch)
    isolate_from_host(monkeypatch, tmp_path)
    sizes = [100, 70_000, 3 * MiB + 17, 4096, 1, 200_000, MiB]
    spans, off = [], 0
    for n in sizes:
        spans.append(WriteSpan(off, rand(n, gen)))
        off += n + 13
    device = {s.data.data_ptr() for s in spans[::2]}
    outs = [ReadSpan(s.offset, torch.zeros_like(s.data)) for s in spans]
    device |= {o.out.data_ptr() for o in outs[::2]}
    # Which spans count as device memory (no CUDA here): decided by on_gpu alone, the engine's seam.
    monkeypatch.setattr(gds, "on_gpu", lambda t: t.data_ptr() in device)
    with gds.GdsEngine(small_options(), host_engine=lambda: pytest.fail("a mixed file went to the host engine")) as eng:
        write_and_check(eng, tmp_path / "m.bin", spans)
        assert eng.info.name == "kvikio-compat"
        assert eng.read_file(tmp_path / "m.bin", outs) == [crc32c.crc32c(s.data.numpy().tobytes()) for s in spans]
    assert all(torch.equal(s.data, o.out) for s, o in zip(spans, outs))


# ---------------------------------------------------------------------------
# Engine selection
# ---------------------------------------------------------------------------
def test_auto_without_cuda_is_gdswriters_own_engine(fake, monkeypatch):
    pretend_cuda(monkeypatch, False)
    with create_engine(small_options(engine="auto")) as eng:
        assert eng.info.name in ("io_uring", "posix") and eng.info.cuda_path == "staged"
        assert "GPUDirect" not in eng.info.reason


def test_auto_without_cuda_never_imports_the_kvikio_engine(tmp_path):
    """Where torch sees no CUDA device and nobody imported the KvikIO engine (to patch its
    cuda_available), ``auto`` asks torch itself: a CPU-only job's first save and load never
    import engines/kvikio.py (7-20 ms on the first save's critical path)."""
    child = (f"import sys, torch\n"
             f"from gdswriter import GDSCheckpointer, create_engine\n"
             f"assert not torch.cuda.is_available()\n"
             f"create_engine().close()\n"
             f"with GDSCheckpointer({{'w': torch.ones(1000)}}, None, {str(tmp_path)!r}) as ck:\n"
             f"    ck.save(1); ck.load(1)\n"
             f"print('KVIKIO', 'gdswriter.engines.kvikio' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "KVIKIO False" in r.stdout


def test_auto_on_a_gpu_without_gds_takes_the_pinned_path_and_says_why(fake, monkeypatch):
    pretend_cuda(monkeypatch, True)
    with create_engine(small_options(engine="auto")) as eng:
        assert isinstance(eng, (IoUringEngine, PosixEngine))
        assert "GPUDirect Storage unavailable" in eng.info.reason and "nvidia-fs" in eng.info.reason


def test_auto_takes_gds_where_it_truly_works(monkeypatch, tmp_path, gen):
    fake_gds(monkeypatch, tmp_path)
    pretend_cuda(monkeypatch, True)
    with create_engine(small_options(engine="auto")) as eng:
        assert isinstance(eng, gds.GdsEngine) and eng.info.name == "gds" and eng.info.gpu_direct
    monkeypatch.setenv("GDSWRITER_ENGINE", "io_uring")  # the user's override wins
    with create_engine() as eng:
        assert isinstance(eng, IoUringEngine)


@pytest.mark.parametrize("engine", ["auto", "gds", "kvikio"])
def test_gds_status_is_collected_once_per_engine(monkeypatch, tmp_path, engine):
    """auto's probe hands the status it collected to the engine rather than both asking KvikIO."""
    fake_gds(monkeypatch, tmp_path)
    pretend_cuda(monkeypatch, True)
    calls = []
    real = gds.gds_status
    monkeypatch.setattr(gds, "gds_status", lambda *a: calls.append(a) or real(*a))
    with create_engine(small_options(engine=engine)) as eng:
        assert isinstance(eng, gds.GdsEngine) and eng.info.gpu_direct
    assert len(calls) == 1
    assert gds.gpu_direct_unavailable() is None and len(calls) == 2  # the public probe still answers


def test_explicit_choices(fake, tmp_path, gen):
    with create_engine(small_options(engine="kvikio")) as eng:
        assert isinstance(eng, gds.GdsEngine) and eng.info.name == "kvikio-compat"
        assert "requested (engine='kvikio')" in eng.info.reason
        spans = [WriteSpan(0, rand(9000, gen))]
        write_and_check(eng, tmp_path / "k.bin", spans)
    with pytest.raises(EngineUnavailableError, match="GPUDirect Storage is unavailable"):
        create_engine(small_options(engine="gds"))


def test_checkpoint_written_through_kvikio_verifies_on_the_cpu(fake, tmp_path, monkeypatch):
    """Checksums computed by the GPU algorithm are plain crc32c: `gdswriter verify` accepts
    the checkpoint, the manifest names the engine that wrote each file, and it loads back."""
    from gdswriter import CheckpointOptions, GDSCheckpointer
    from gdswriter.cli import main
    from gdswriter.format.commit import CommitProtocol
    from gdswriter.load.reader import read_manifest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200), torch.nn.Linear(200, 7))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    opts = CheckpointOptions(engine=small_options(engine="kvikio"), files_per_root=1)
    with GDSCheckpointer(model, None, root=tmp_path / "ck", options=opts) as ck:
        ck.save(3)
        assert ck.engine_info.name == "kvikio-compat"
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        ck.load(3)
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    m = read_manifest(CommitProtocol([tmp_path / "ck"]), 3)
    assert {f.info.get("engine") for f in m.files} == {"kvikio-compat"}
    assert main(["verify", str(tmp_path / "ck"), "--step", "3"]) == 0


# ---------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_writes_wait_for_the_producing_stream(tmp_path):
    """Bytes produced late on a side stream, handed over at once from another thread (as the
    checkpointer's worker gets them): the file holds the final bytes, not the earlier zeros."""
    import threading

    if not kvikio_importable():
        pytest.skip("KvikIO is not installed")
    n = 64 << 20
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    out = {}
    with create_engine(EngineOptions(engine="kvikio")) as eng:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the bytes exist
            t.fill_(7)

        def save():
            out["crc"] = eng.write_file(tmp_path / "s.bin", [WriteSpan(0, t)])
            out["name"] = eng.info.name

        th = threading.Thread(target=save)
        th.start()
        th.join()
    assert out["crc"] == [crc32c.crc32c(bytes([7]) * n)]
    with open(tmp_path / "s.bin", "rb") as f:
        assert f.read() == bytes([7]) * n
    assert out["name"] in ("gds", "kvikio-compat")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_real_kvikio_reports_the_path_it_takes():
    if not kvikio_importable():
        pytest.skip("KvikIO is not installed")
    status = gds.gds_status()
    with create_engine(EngineOptions(engine="kvikio")) as eng:
        assert eng.info.cuda_path == status.mode and eng.info.gpu_direct == status.gpu_direct
        if not status.gpu_direct:
            assert eng.info.name == "kvikio-compat" and status.reason
    print(f"\nGDS status: {status}\nmode: {status.mode}; why not GPU-direct: {status.reason or '-'}")
