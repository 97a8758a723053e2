"""The stand-alone benchmark scripts still run (tiny sizes; speed is not checked here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run_script(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_staging_placement(tmp_path):
    out = run_script("staging_placement.py", "--size", "8M", "--ballast", "32M", "--wait", "0",
                     "--rounds", "2", "--dir", str(tmp_path))
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "GB/s" in line]
    assert [r[:2] for r in rows] == [[p, k] for p in "ABC" for k in ("4k", "huge")], out
    assert all(r.count("GB/s") == 2 for r in rows), out
    assert list(tmp_path.iterdir()) == []  # its scratch directory is removed


def test_interleaved_checkpoint(tmp_path):
    out = run_script("interleaved_checkpoint.py", "--size", "8M", "--rounds", "1", "--settle", "0",
                     "--dir", str(tmp_path))
    for case in ("torch.save", "dcp.save t4", "safetensors.save_file", "gdswriter.save"):
        assert case in out, out
    assert "gdswriter.save vs torch.save" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")
def test_interleaved_engine(tmp_path):
    out = run_script("interleaved_engine.py", "--size", "8M", "--rounds", "1", "--dir", str(tmp_path))
    assert "engine/fio write" in out and "engine/fio read" in out, out
    assert list(tmp_path.iterdir()) == []
