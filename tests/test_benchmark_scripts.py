"""The stand-alone benchmark scripts still run (tiny sizes; speed is not checked here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run_script(name: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow  # about 16 s: the benchmark script end to end
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
    for case in ("torch.save", "dcp.save t4", "safetensors.save_file", "gdswriter.save", "ceiling ("):
        assert case in out, out
    assert "gdswriter.save vs torch.save" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")
def test_interleaved_engine(tmp_path):
    out = run_script("interleaved_engine.py", "--size", "8M", "--rounds", "1", "--dir", str(tmp_path))
    assert "engine/fio write" in out and "engine/fio read" in out, out
    assert list(tmp_path.iterdir()) == []


def _bench_entry(suite: str, kind: str, case: str, size: str, nbytes: int, times: list[float]) -> dict:
    med = sorted(times)[len(times) // 2]
    return {"stats": {"median": med, "min": min(times), "max": max(times), "rounds": len(times)},
            "extra_info": {"suite": suite, "kind": kind, "case": case, "size": size, "bytes": nbytes,
                           "GB/s": nbytes / med / 1e9, "median s": med}}


def test_report_tables_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    n = 2 * 10**9
    entries = [_bench_entry("engine", "write", "gdswriter io_uring", "2G", n, [1.0, 1.1, 0.9]),
               _bench_entry("engine", "write", "dd-loop", "2G", n, [1.2]),
               _bench_entry("engine", "read", "dd-loop", "2G", n, [1.0]),
               _bench_entry("checkpoint", "save", "torch.save", "2G", n, [4.0, 5.0, 4.5]),
               _bench_entry("checkpoint", "save", "gdswriter.save", "2G", n, [1.0, 1.2, 1.1]),
               _bench_entry("checkpoint", "load", "torch.load", "2G", n, [3.0, 3.5, 3.2]),
               _bench_entry("checkpoint", "load", "gdswriter.load", "2G", n, [1.0, 1.1, 1.05])]
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"benchmarks": entries}))
    png = tmp_path / "chart.png"
    out = run_script("report.py", str(src), "--png", str(png))
    assert "### Checkpoint save (durable)" in out and "| gdswriter.save | 2G |" in out
    assert "| 4.09x |" in out  # gdswriter.save 1.1 s against torch.save 4.5 s (medians): 4.5 / 1.1
    assert f"chart: {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_interference(tmp_path):
    out = run_script("write_interference.py", "--size", "8M", "--memory", "8M", "--dim", "64", "--matmuls", "2",
                     "--blocks", "1", "--rounds", "2", "--dir", str(tmp_path))
    rows = [line for line in out.splitlines() if line.startswith("| ") and "%" in line]
    assert len(rows) == 3 and "GB/s" in out and "of a CPU" in out, out
    assert list(tmp_path.iterdir()) == []  # its scratch directory is removed


def test_dist_scale_sim(tmp_path):
    """Two small simulated worlds: the table comes out, a typical rank's save exchanges the same
    few hundred bytes in both, and the global manifest grows with the ranks."""
    out = tmp_path / "sim.json"
    text = run_script("dist_scale_sim.py", "--worlds", "4,32", "--kinds", "fsdp,ddp", "--dcp-max", "4", "--dir",
                str(tmp_path), "--json", str(out))
    assert "global manifest" in text and "DCP global plan" in text, text
    rows = json.loads(out.read_text())
    replication = [r for r in rows if r["kind"] == "replicas=2"]
    rows = [r for r in rows if r["kind"] != "replicas=2"]
    assert "2 copies + parity" in text and [r["world"] for r in replication] == [4, 32], text
    for r in replication:  # what a rank receives of the placement: its peers only, whatever W
        assert r["typical"]["received"] < 256 and r["copies_factor"] == 2.0, r
    assert [(r["kind"], r["world"]) for r in rows] == [("fsdp", 4), ("fsdp", 32), ("ddp", 4), ("ddp", 32)]
    for kind in ("fsdp", "ddp"):
        small, large = (r for r in rows if r["kind"] == kind)
        assert small["typical"]["cached"]["received"] == large["typical"]["cached"]["received"] < 4096, rows
        assert small["manifest"] < large["manifest"], rows
        assert large["load"]["read"] == large["load"]["manifest"] + large["load"]["shard"], rows
    assert "dcp_s" in rows[0] and "dcp_s" not in rows[1]
    for r in rows[2:]:  # a load of the ddp state on half the ranks: its tree's shard and its writers' (W / N)
        assert 1 <= r["reshard"]["shards"] <= 2 and r["reshard"]["read_bytes"] < r["reshard"]["shared_bytes"], r


@pytest.mark.slow  # about 20 s: DeepSpeed's start-up, then three saves
def test_deepspeed_saves(tmp_path):
    pytest.importorskip("deepspeed")
    out = run_script("deepspeed_saves.py", "--size", "4M", "--rounds", "1", "--dir", str(tmp_path))
    for method in ("torch", "gdswriter async", "gdswriter blocking"):
        assert f"  {method} " in out, out
    assert "gdswriter async vs torch: blocked" in out, out
    assert list(tmp_path.iterdir()) == []


def test_dcp_reader(tmp_path):
    """benchmarks/dcp_reader.py: the three readers, each load checked bit for bit by the script."""
    out = run_script("dcp_reader.py", "--sizes", "4M", "--rounds", "2", "--settle", "0", "--json",
                     "--dir", str(tmp_path))
    rows = json.loads(out[out.index("["):])
    assert [r["bytes"] for r in rows] == [4 << 20]
    assert set(rows[0]["gib_s"]) == {"FileSystemReader", "GDSStorageReader", "GDSCheckpointer.load"}
    assert all(len(v) == 2 for v in rows[0]["rounds"].values())
    assert list(tmp_path.iterdir()) == []


def test_first_save(tmp_path):
    out = run_script("first_save.py", "--size", "8M", "--rounds", "1", "--no-fio", "--dir", str(tmp_path))
    for case in ("ceiling", "first save_async", "first save", "steady save"):
        assert any(line.startswith(f"  {case} ") and line.endswith("x") for line in out.splitlines()), (case, out)
    assert "ceiling: built-in" in out
    assert list(tmp_path.iterdir()) == []


def test_many_tensors(tmp_path):
    out = run_script("many_tensors.py", "--counts", "100,1000", "--size", "2M", "--rounds", "1", "--small", "1M",
                     "--settle", "0", "--dir", str(tmp_path))
    rows = [line for line in out.splitlines() if line.startswith("| 1")]
    assert [r.split("|")[1].strip() for r in rows] == ["100", "1,000"], out
    assert all(r.count(" s") >= 3 and "ms (" in r for r in rows), out
    assert "1.00 MiB checkpoint, cold load" in out
    for method in ("gdswriter", "torch", "dcp"):
        assert any(line.split()[:1] == [method] and "x torch.load" in line for line in out.splitlines()), out
    assert list(tmp_path.iterdir()) == []


INTEGRATION_CASES = {"lightning": ("TorchCheckpointIO", "GDSCheckpointIO ", "GDSCheckpointIO async",
                                   "GDSCheckpointIO async vs TorchCheckpointIO: blocks"),
                     "hf": ("Trainer ", "GDSTrainer ", "GDSTrainer async", "GDSTrainer async vs Trainer: blocks")}


@pytest.mark.parametrize("only", [pytest.param("lightning"), pytest.param("hf", marks=pytest.mark.slow)])
def test_integration_saves(tmp_path, only):
    """The Lightning half runs by default (about 20 s here); the Hugging Face half is slow (40 s)."""
    pytest.importorskip("transformers" if only == "hf" else "lightning")
    out = run_script("integration_saves.py", "--size", "2M", "--saves", "2", "--rounds", "1", "--only", only,
                     "--dir", str(tmp_path))
    for case in INTEGRATION_CASES[only]:
        assert case in out, out
    assert list(tmp_path.iterdir()) == []  # its scratch directory is removed


def test_replica_plan_sim():
    out = run_script("replica_plan_sim.py", "--worlds", "8,64", "--markdown")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| torchrun") or
            line.startswith("| shuffled") or line.startswith("| uneven")]
    assert len(rows) == 6, out
    assert all("2.000 / " in " | ".join(r) for r in rows), out


def test_drain_benchmark(tmp_path):
    out = run_script("drain.py", "--size", "8M", "--rounds", "1", "--dir", str(tmp_path))
    assert "time to drained / time to committed" in out and "save time with a drain in flight" in out, out
    assert list(tmp_path.iterdir()) == []


def test_tensor_counts(tmp_path):
    """Two counts (one with its own size), gdswriter beside torch.save and DCP, and gdswriter also
    from a checkout given as --tree (here this one), in a worker process, in the same rounds."""
    root = str(BENCH.parent)
    out = run_script("tensor_counts.py", "--counts", "8@1M,300", "--size", "2M", "--rounds", "2", "--settle", "0",
                     "--compare", "torch,dcp", "--tree", f"a={root}", "--tree", f"b={root}", "--json",
                     "--dir", str(tmp_path))
    lines = out.splitlines()
    heads = [line.split() for line in lines if line.strip().startswith("tensors ")]
    assert heads == [["tensors", "ceiling", "write", "a", "first", "save", "a", "second", "save", "b", "first",
                      "save", "b", "second", "save", "torch.save+fsync", "dcp.save", "t4"],
                     ["tensors", "ceiling", "read", "a", "load", "b", "load", "torch.load", "dcp.load"]], out
    rows = [line.split() for line in lines if line.strip().split(" ")[0] in ("8", "300")]
    assert [r[0] for r in rows] == ["8", "300", "8", "300"], out
    assert [len(r) for r in rows] == [1 + 2 + 1 + 6 * 2, 1 + 1 + 6 * 2, 1 + 2 + 1 + 4 * 2, 1 + 1 + 4 * 2], out
    assert "  a first save / torch.save+fsync: 8 tensors " in out and "  b first save / dcp.save t4: " in out, out
    got = json.loads(lines[-1])
    assert set(got["counts"]) == {"8", "300"} and got["sizes"] == {"8": 1 << 20} and got["labels"] == ["a", "b"]
    assert set(got["counts"]["300"]) == {"ceiling write", "ceiling read", "torch save", "torch load", "dcp save",
                                         "dcp load", *[f"{t} {c}" for t in "ab" for c in ("first save",
                                                                                           "second save", "load")]}
    assert all(len(v["gbps"]) == 2 for c in got["counts"].values() for v in c.values())
    assert list(tmp_path.iterdir()) == []
    prof = run_script("tensor_counts.py", "--profile", "300", "--size", "1M", "--top", "5", "--dir", str(tmp_path))
    for what in ("first save", "second save", "load"):
        assert f"=== {what} of 300 tensors" in prof and f"--- {what}: calling thread" in prof, prof
    assert "--- second save: gdswriter-save" in prof, prof
    calls = run_script("tensor_counts.py", "--async-call", "40", "--size", "1M", "--rounds", "1", "--dir", str(tmp_path))
    assert "save_async at 40 tensors" in calls and "goal < 10 ms" in calls, calls  # a figure, not a timed test


@pytest.mark.slow  # DeepSpeed's start-up, and its async_io op's build on first use (about a minute)
def test_tensor_counts_with_fastpersist(tmp_path):
    """DeepSpeed's own FastPersist writer beside gdswriter, where it can run (CPU: libaio-dev)."""
    from gdswriter.tools.bench import deepspeed_missing

    why = deepspeed_missing()
    if why:
        pytest.skip(why)
    out = run_script("tensor_counts.py", "--counts", "8,300", "--size", "2M", "--rounds", "1", "--settle", "0",
                     "--compare", "deepspeed", "--json", "--dir", str(tmp_path), timeout=900)
    got = json.loads(out.splitlines()[-1])
    assert got["methods"] == ["deepspeed"] and got["skipped"] == {}, out
    assert all(c["deepspeed save"]["gbps"][0] > 0 and c["deepspeed load"]["gbps"][0] > 0
               for c in got["counts"].values())
    assert "  gdswriter first save / FastPersist: 8 tensors " in out, out
    assert list(tmp_path.iterdir()) == []


def test_replicas_benchmark(tmp_path):
    out = run_script("replicas.py", "--size", "8M", "--ranks", "2", "--rounds", "1", "--train-size", "1M", "--iters",
                     "4", "--every", "2", "--train-rounds", "1", "--restore-rounds", "1", "--dir", str(tmp_path),
                     timeout=900)  # two restarts spawn ranks anew (slow on a loaded machine)
    assert "time to protected / local engine, same total bytes" in out, out
    assert "drive bytes / state byte (replicas=2, data files):    2.000" in out, out
    assert "save_async overhead, replicas=2" in out, out
    for line in ("restore from peers / local load", "restore from peers / slower of gloo and cold read",
                 "restart to first training step (spawn, load, one step): intact"):
        assert line in out, out
    assert list(tmp_path.iterdir()) == []


def test_cold_loads(tmp_path):
    """Two trees (here this checkout twice) in the same rounds: a row per tree and count, with
    wall, GB/s and CPU time of a fresh checkpointer's cold load; nothing left behind."""
    root = str(BENCH.parent)
    out = run_script("cold_loads.py", "--tree", f"a={root}", "--tree", f"b={root}", "--counts", "8,300",
                     "--size", str(2 << 20), "--rounds", "1", "--dir", str(tmp_path))
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["a"], ["b"])]
    assert [(r[0], r[1]) for r in rows] == [("a", "8"), ("b", "8"), ("a", "300"), ("b", "300")], out
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows), out
    assert list(tmp_path.iterdir()) == []
