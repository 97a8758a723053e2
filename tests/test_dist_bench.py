"""benchmarks/dist_scaling.py still runs (2 ranks, a tiny state; speed is not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "dist_scaling.py"


def test_dist_scaling_runs(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--size", "2M", "--ranks", "2", "--roots", "1,2",
                           "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = json.loads(out.read_text())["runs"]["2"]["cases"]
    assert sorted(cases) == ["dcp-fs|1", "dcp-kept|1", "dcp-kept|2", "dcp-node-local|1", "dcp-node-local|2",
                             "dcp-resave|1", "dcp-resave|2", "gdswriter-dcp|1", "gdswriter-dcp|2",
                             "gdswriter-relay|1", "gdswriter-relay|2", "gdswriter-tmpfs|1", "gdswriter-tmpfs|2",
                             "gdswriter|1", "gdswriter|2"]
    for key, c in cases.items():
        assert len(c["rank_bytes"]) == 2 and min(c["rank_bytes"]) > 0, (key, c)
    split = cases["gdswriter|1"]["rank_bytes"]
    assert max(split) / (sum(split) / 2) <= 1.05, "the replicated state is split evenly"
    assert "gdswriter-dcp" in proc.stdout and [p.name for p in tmp_path.iterdir()] == ["r.json"]
