"""`gdswriter bench` (gdswriter/tools/bench.py, commands/bench.py) and the disk ceiling references
(gdswriter/tools/measure.py), at tiny sizes on real files. Speed is never checked, only what is
measured and reported."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

import pytest
import torch

from gdswriter.tools import bench, measure
from gdswriter.tools.bench import CEILING, BenchOptions, LoadCheckError, run_bench
from gdswriter.cli import main
from gdswriter.errors import InvalidOptionError
from gdswriter.units import MiB

pytest.importorskip("safetensors")


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- the built-in ceiling
def test_builtin_reference_keeps_several_requests_in_flight_and_writes_the_pattern(tmp_path, monkeypatch):
    """The built-in ceiling is multi-queue (not a QD1 loop) and writes what it claims."""
    in_flight, peak, lock = [0], [0], threading.Lock()
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            time.sleep(0.005)  # long enough for the other threads to get there too
            return real_pwrite(fd, data, offset)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(measure.os, "pwrite", pwrite)
    monkeypatch.setattr(measure.os, "unlink", lambda p: None)  # keep the file to look at it
    pattern = memoryview(bytes(range(256)) * 16)  # 4 KiB
    size = 10 * MiB + 4096 * 3  # not a multiple of the block: a short last block
    ref = measure.builtin_reference(tmp_path / "ref.bin", size, pattern, {}, threads=4, block=1 * MiB)
    assert peak[0] >= 2, "the built-in reference ran one request at a time"
    assert ref.write_bps > 0 and ref.read_bps > 0 and ref.name.startswith("built-in: 4 threads x 1 MiB")
    data = (tmp_path / "ref.bin").read_bytes()
    assert len(data) == size and data == bytes(pattern) * (size // len(pattern))


def test_builtin_reference_raises_the_first_error(tmp_path, monkeypatch):
    monkeypatch.setattr(measure.os, "pwrite", lambda fd, data, offset: 0)  # the kernel wrote nothing
    with pytest.raises(OSError, match="pwrite wrote nothing"):
        measure.builtin_reference(tmp_path / "r.bin", 4 * MiB, memoryview(b"x" * 4096), {}, threads=2, block=MiB)
    assert not (tmp_path / "r.bin").exists()


def test_disk_reference_without_fio_is_the_builtin_one(tmp_path, monkeypatch):
    monkeypatch.setattr(measure.shutil, "which", lambda name: None)
    ref, why = measure.disk_reference(tmp_path / "r.bin", 2 * MiB, memoryview(b"y" * 4096), {})
    assert ref.name.startswith("built-in: 8 threads x 4 MiB") and why == "fio is not installed; it is optional"
    ref, why = measure.disk_reference(tmp_path / "r.bin", 2 * MiB, memoryview(b"y" * 4096), {}, use_fio=False)
    assert ref.name.startswith("built-in") and why == "--no-fio"


# ----------------------------------------------------------------------------- the command
def test_bench_json_and_plot(capsys, tmp_path):
    out_png = tmp_path / "chart.png"
    rc, out, err = _run(capsys, "bench", "--dir", tmp_path / "d", "--size", "1M", "--rounds", "2", "--settle", "0",
                        "--compare", "torch,dcp,safetensors,deepspeed", "--json", "--plot", out_png)
    assert rc == 0, err
    assert err == ""  # no progress bar: stderr is not a terminal
    res = json.loads(out)
    assert res["rounds"] == 2 and res["bytes"] > 900_000 and res["host"]["cores"] == os.cpu_count()
    assert set(res["methods"]) >= {"ceiling", "gdswriter", "torch", "dcp", "safetensors"}
    for name, m in res["methods"].items():
        for kind in ("save", "load"):
            k = m[kind]
            assert len(k["gbps"]) == 2 and k["min"] <= k["median"] <= k["max"], (name, kind)
            ratios = [a / b for a, b in zip(k["gbps"], res["methods"]["torch"][kind]["gbps"])]
            assert k["x_torch"] == pytest.approx(sorted(ratios)[0] / 2 + sorted(ratios)[1] / 2)
    assert res["methods"]["ceiling"]["save"]["x_ceiling"] == pytest.approx(1.0)
    assert res["methods"]["dcp"]["save"]["name"] == "dcp.save t4"
    if "deepspeed" not in res["methods"]:  # not installed, or installed without libaio (.ci/run installs it so)
        assert any(why in res["skipped"]["deepspeed"] for why in ("DeepSpeed is not installed", "async_io op")), res
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "d").exists()  # the directory it made is gone again


def test_bench_table(capsys, tmp_path):
    rc, out, err = _run(capsys, "bench", "--dir", tmp_path, "--size", "512K", "--rounds", "1", "--settle", "0",
                        "--compare", "torch", "--no-fio")
    assert rc == 0, err
    lines = out.splitlines()
    assert any(line.split()[:4] == ["method", "save", "GB/s", "(min-max)"] for line in lines), out
    assert "ceiling: built-in: 8 threads x 4 MiB O_DIRECT pwrite/preadv (--no-fio)" in out
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and "(" in line
            and line.split()[0] in ("ceiling", "gdswriter", "torch")}
    assert set(rows) == {"ceiling", "gdswriter", "torch"}, out
    assert rows["torch"][-2:] == ["1.00x", "1.00x"]  # torch against itself
    first = [line for line in lines if line.strip().startswith("gdswriter (first save)")]
    cells = first[0].split() if len(first) == 1 else []
    assert cells[5::2] == ["-", "-", "-"] and cells[6].endswith("x") and cells[8].endswith("x"), out  # no load
    assert list(tmp_path.iterdir()) == []


def test_bench_usage_errors(capsys, tmp_path, monkeypatch):
    rc, _, err = _run(capsys, "bench", "--dir", tmp_path, "--compare", "torch,pickle")
    assert rc == 2 and "unknown method(s) pickle" in err
    rc, _, err = _run(capsys, "bench", "--dir", tmp_path, "--size", "1K")
    assert rc == 2 and "at least 64 KiB" in err
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(bench.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    rc, _, err = _run(capsys, "bench", "--dir", tmp_path, "--size", "64M")
    assert rc == 2 and "not enough free space" in err and "--size" in err


# ----------------------------------------------------------------------------- the run itself
def test_rounds_are_interleaved_and_rotated(tmp_path):
    notes: list[str] = []
    opts = BenchOptions(directory=tmp_path, size=256 * 1024, rounds=3, compare=("torch",), settle=0, use_fio=False)
    res = run_bench(opts, step=notes.append)
    assert len(notes) == bench.steps_of(opts)
    firsts = [n for n in notes if n.startswith("round")]
    order = [n.split(": ")[1].split()[0] for n in firsts if n.endswith(("save", "write + read"))]
    assert order == ["ceiling", "gdswriter", "torch", "gdswriter", "torch", "ceiling", "torch", "ceiling", "gdswriter"]
    assert all(len(res.save[m]) == 3 and len(res.load[m]) == 3 for m in (CEILING, "gdswriter", "torch"))


def test_a_load_that_does_not_restore_fails_the_run(tmp_path, monkeypatch):
    real = bench.Methods.load
    monkeypatch.setattr(bench.Methods, "load", lambda self, case: None if case == "torch" else real(self, case))
    with pytest.raises(LoadCheckError, match="torch.load did not restore"):
        run_bench(BenchOptions(directory=tmp_path, size=256 * 1024, rounds=1, compare=("torch",), settle=0,
                               use_fio=False))
    assert list(tmp_path.iterdir()) == []


def test_options_validate(tmp_path):
    with pytest.raises(InvalidOptionError):
        BenchOptions(directory=tmp_path, rounds=0)
    with pytest.raises(InvalidOptionError):
        BenchOptions(directory=tmp_path, settle=-1)
    with pytest.raises(TypeError):
        BenchOptions(tmp_path)  # keyword-only


_STAND_IN = '''
"""A stand-in for DeepSpeed's FastPersist API (deepspeed.io.FastFileWriter et al.), as its
FastPersist benchmarks call it, for testing gdswriter's plumbing where DeepSpeed cannot be
installed. It writes through a plain Python file."""
'''


def _stand_in_deepspeed(tmp_path, monkeypatch):
    """Puts the stand-in deepspeed package first on sys.path; returns ``forget``, which drops any
    deepspeed module imported so far (call it before and after)."""
    pkg = tmp_path / "stand_in" / "deepspeed"
    (pkg / "io").mkdir(parents=True)
    (pkg / "ops").mkdir()
    (pkg / "__init__.py").write_text(_STAND_IN)
    (pkg / "io" / "__init__.py").write_text(
        "import dataclasses, io\n"
        "@dataclasses.dataclass\n"
        "class FastFileWriterConfig:\n"
        "    dnvme_handle: object; pinned_tensor: object; double_buffer: bool = True\n"
        "    num_parallel_writers: int = 1; writer_rank: int = 0; global_rank: int = 0\n"
        "class FastFileWriter(io.RawIOBase):\n"
        "    def __init__(self, file_path, config):\n"
        "        assert config.pinned_tensor.numel() > 0 and config.dnvme_handle == 'aio'\n"
        "        self._f = open(file_path, 'wb')\n"
        "    def writable(self): return True\n"
        "    def write(self, b): return self._f.write(b)\n"
        "    def close(self):\n"
        "        if not self._f.closed: self._f.close()\n"
        "        super().close()\n")
    (pkg / "ops" / "op_builder.py").write_text(
        "class _Ops:\n"
        "    def aio_handle(self, block, depth, single, overlap, parallel): return 'aio'\n"
        "class AsyncIOBuilder:\n"
        "    def is_compatible(self): return True\n"
        "    def load(self, verbose=True): return _Ops()\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "accelerator.py").write_text(
        "class _Acc:\n"
        "    def device_name(self): return 'cuda'\n"
        "    def pin_memory(self, t, align_bytes=1): return t\n"
        "def get_accelerator(): return _Acc()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "stand_in"))

    def forget() -> None:
        for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
            del sys.modules[name]

    return forget


def test_deepspeed_plumbing_with_a_stand_in(tmp_path, monkeypatch):
    """DeepSpeed is too heavy to install here: a stand-in module with the calls gdswriter makes
    (AsyncIOBuilder().load().aio_handle, get_accelerator().pin_memory, FastFileWriterConfig,
    FastFileWriter as torch.save's file) checks the plumbing: durable file, torch.load back,
    figures reported. It cannot check DeepSpeed itself."""
    forget = _stand_in_deepspeed(tmp_path, monkeypatch)
    forget()
    try:
        assert bench.deepspeed_missing() is None
        res = run_bench(BenchOptions(directory=tmp_path / "d", size=256 * 1024, rounds=1, compare=("deepspeed",),
                                     settle=0, use_fio=False))
    finally:
        forget()  # no stand-in module outlives this test
    assert res.skipped == {} and len(res.save["deepspeed"]) == 1 and res.load["deepspeed"][0] > 0
    assert res.label("deepspeed", "save") == "deepspeed FastPersist"
    shutil.rmtree(tmp_path / "stand_in")


def test_tensor_counts_beside_fastpersist_and_torch(tmp_path, monkeypatch):
    """run_counts's many-tensor rounds with FastPersist (the stand-in: the plumbing, not DeepSpeed),
    torch.save+fsync and DCP in the same interleaved rounds: each method's save and checked cold
    load per round, the tables' columns and gdswriter's ratio to each."""
    forget = _stand_in_deepspeed(tmp_path, monkeypatch)
    forget()
    notes: list[str] = []
    try:
        (tmp_path / "d").mkdir()
        res = bench.run_counts(tmp_path / "d", counts=(4, 200), size=256 * 1024, rounds=2, settle_s=0,
                               compare=("dcp", "torch", "deepspeed"), sizes={4: 128 * 1024}, step=notes.append)
    finally:
        forget()
    assert res.methods == ("deepspeed", "torch", "dcp") and res.skipped == {} and res.labels == ("gdswriter",)
    assert len(notes) == bench.count_steps((4, 200), 2, n_cases=5)
    cases = [n.split(": ")[1].split(" (")[0] for n in notes]
    assert cases[:10] == ["ceiling", "gdswriter", "deepspeed", "torch", "dcp",
                          "gdswriter", "deepspeed", "torch", "dcp", "ceiling"], notes
    assert notes[0].startswith("4 tensors, round 1: ceiling (write ") and notes[0].endswith(" GB/s)"), notes
    assert "(first save " in notes[1] and ", second save " in notes[1] and ", load " in notes[1], notes
    for n in (4, 200):
        for case in ("gdswriter first save", "gdswriter second save", "gdswriter load", "deepspeed save",
                     "deepspeed load", "torch save", "torch load", "dcp save", "dcp load"):
            assert len(res.gbps[n, case]) == 2 and min(res.gbps[n, case]) > 0, (n, case)
    text = "\n".join(res.table())
    assert "FastPersist" in text and "torch.load (FastPersist's file)" in text and "dcp.load" in text, text
    assert "  gdswriter first save / FastPersist: 4 tensors " in text and "4 (128.00 KiB)" in text, text
    assert res.to_json()["counts"]["200"]["deepspeed save"]["x_ceiling"] > 0
    assert list((tmp_path / "d").iterdir()) == []


def test_tensor_counts_skip_fastpersist_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    res = bench.run_counts(tmp_path, counts=(3,), size=64 * 1024, rounds=1, settle_s=0, compare=("deepspeed",))
    assert res.methods == () and "DeepSpeed is not installed" in res.skipped["deepspeed"]
    assert any(line.startswith("  skipped deepspeed: DeepSpeed is not installed") for line in res.table())
    with pytest.raises(InvalidOptionError, match="unknown method.*safetensors.*choose from deepspeed, torch, dcp"):
        bench.run_counts(tmp_path, counts=(3,), compare=("safetensors",))


def test_a_count_load_that_does_not_restore_fails_the_run(tmp_path, monkeypatch):
    """run_counts checks every method's load: a torch.load that hands back a spoiled tensor stops
    the run (its figures would be meaningless), and the run's files are removed."""
    real = torch.load

    def spoiled(*args, **kwargs):
        sd = real(*args, **kwargs)
        sd["g0"]["t0"].fill_(-1.0)
        return sd

    monkeypatch.setattr(torch, "load", spoiled)
    with pytest.raises(LoadCheckError, match="torch.load did not restore"):
        bench.run_counts(tmp_path, counts=(3,), size=64 * 1024, rounds=1, settle_s=0, compare=("torch",))
    assert list(tmp_path.iterdir()) == []


def test_bench_shows_the_many_tensor_case_beside_the_few_large_tensors_by_default(capsys, tmp_path):
    """Without --tensors, `gdswriter bench` adds the many-tensor table (64 and 10,000 tensors) after
    the methods' table of the model + AdamW state (a few large tensors)."""
    rc, out, err = _run(capsys, "bench", "--dir", tmp_path, "--size", "256K", "--rounds", "1", "--settle", "0",
                        "--compare", "torch", "--no-fio")
    assert rc == 0, err
    lines = out.splitlines()
    methods = next(i for i, line in enumerate(lines) if line.split()[:2] == ["method", "save"])
    counts = next(i for i, line in enumerate(lines) if "as N tensors (a nested dict)" in line)
    assert methods < counts, out
    rows = [line.split()[0] for line in lines[counts:] if line.strip().split(" ")[0] in ("64", "10,000")]
    assert rows == ["64", "10,000", "64", "10,000"], out  # saves, then cold loads
    assert "torch.save+fsync" in "\n".join(lines[counts:]), out  # --compare's methods beside gdswriter there too
    assert list(tmp_path.iterdir()) == []


def test_deepspeed_absent_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    res = run_bench(BenchOptions(directory=tmp_path, size=256 * 1024, rounds=1, compare=("deepspeed",), settle=0,
                                 use_fio=False))
    assert "DeepSpeed is not installed" in res.skipped["deepspeed"] and "deepspeed" not in res.save
    assert any("skipped deepspeed: DeepSpeed is not installed" in line for line in res.header())
    assert torch.isfinite(torch.tensor(res.save["gdswriter"])).all()


def test_result_text_markdown_and_the_above_ceiling_note():
    res = bench.BenchResult(10**9, 2, "/d", "ext4 on /dev/x", measure.FIO_NAME, "fio is installed",
                            save={CEILING: [2.0, 2.0], "gdswriter": [1.8, 2.2], "torch": [0.5, 1.0]},
                            load={CEILING: [1.0, 1.0], "gdswriter": [1.5, 1.5], "torch": [0.5, 0.5]})
    assert res.ratio("gdswriter", "save", "torch") == pytest.approx((3.6 + 2.2) / 2)
    assert any("note: above the ceiling (gdswriter load 1.50x)" in line for line in res.header())
    md = res.markdown()
    assert md[0].startswith("| method |") and len(md) == 2 + 3
    assert md[3].startswith("| gdswriter.save / gdswriter.load | 2.00 (1.80-2.20) | 1.50 (1.50-1.50) | 1.00x | 1.50x |")
