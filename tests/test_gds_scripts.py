"""The GPU verification script (scripts/gpu_check.sh) and its benchmark (scripts/gds_bench.py)
on a machine without CUDA: the script skips its GPU sections, still runs the doctor and exits
0; the benchmark's harness runs every method that needs no GPU on host tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


@pytest.mark.slow  # about 14 s: the whole GPU check script, doctor included
def test_gpu_check_without_cuda_skips_gpu_sections_and_exits_0(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GDS_DOCTOR_TEST_SIZE": "2M",
           "GDS_BENCH_DIR": str(tmp_path / "bench")}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "no CUDA device" in r.stdout
    summary = (out / "summary.txt").read_text()
    assert "gpu-tests    skipped: no CUDA device" in summary and "bench        skipped: no CUDA device" in summary
    assert "doctor       exit 0" in summary
    report = json.loads((out / "doctor.json").read_text())
    assert report["status"] in ("OK", "WARN")
    assert "gdswriter" in (out / "doctor.log").read_text() and (out / "environment.txt").exists()
    assert not (tmp_path / "bench").exists(), "the scratch directory was left behind"


def test_bench_harness_on_host_tensors(tmp_path):
    js = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gds_bench.py"), "--device", "cpu", "--size", "6M",
                        "--rounds", "1", "--no-references", "--dir", str(tmp_path / "d"), "--json", str(js)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = {row["method"]: row for row in json.loads(js.read_text())["results"]}
    for name in ("ceiling (D2H + O_DIRECT x4)", "gdswriter io_uring", "safetensors", "DCP", "torch.save / torch.load"):
        assert rows[name]["ok"] is True and rows[name]["write_gbps"] > 0 and rows[name]["read_gbps"] > 0, rows[name]
    assert rows["gdswriter kvikio"]["note"] == "skipped: needs CUDA"
    assert "engine io_uring" in rows["gdswriter io_uring"]["note"]
    assert "== summary" in r.stdout
    assert not any((tmp_path / "d").iterdir()), "a method left files behind"


def test_bench_without_cuda_says_so():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gds_bench.py"), "--size", "1M"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "no CUDA device" in r.stdout
