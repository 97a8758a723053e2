"""The fuzz harness over every parser of checkpoint bytes (tests/fuzz, README there): its seeds
are real checkpoints that load, every input a campaign found stays a typed error (the
regressions), and the short campaign itself (slow: .ci/run runs it, fixed seed, about a minute)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent / "fuzz"
sys.path.insert(0, str(FUZZ))

import harness  # noqa: E402

REGRESSIONS = sorted((FUZZ / "regressions").glob("*"))
CAMPAIGN_RUNS = 20000  # about 60 s at ~300 inputs/s; the time cap below bounds a slower machine
CAMPAIGN_MAX_S = 110


@pytest.fixture(scope="module")
def fx():
    f = harness.Fixtures()
    yield f
    f.close()


def test_every_seed_is_a_real_checkpoint_that_parses_and_loads(fx):
    """The corpus starts from files gdswriter wrote (each format version): each target accepts its
    own format's seed, resealed or not, so a campaign starts from inputs that reach deep."""
    outcomes = {name: (harness.run_one(fx, data), harness.run_one(fx, bytes([data[0] | harness.RAW]) + data[1:]))
                for name, data in harness.seed_inputs(fx).items()}
    expected_refusals = {"shard-1", "markers-1", "markers-2", "markers-3"}  # another rank's shard; not root markers
    assert {k for k, v in outcomes.items() if v != ("ok", "ok")} == expected_refusals, outcomes
    assert all(v == ("CorruptCheckpointError",) * 2 for k, v in outcomes.items() if k in expected_refusals)


# what each regression ends in (run_one raises on an untyped error): the others are refused
PARSED = {"state-keys-huge-int", "dcp-planner-path-huge-int"}  # huge int keys: decoded, and shown


@pytest.fixture(scope="module")
def replayed():
    """{regression input: its outcome}, from one replay in a process of its own: there the
    address space is capped as in a campaign (an allocation a claimed size drives fails fast
    instead of taking this process's memory)."""
    env = {**os.environ, "PYTHONPATH": str(FUZZ.parent.parent)}
    proc = subprocess.run([sys.executable, str(FUZZ / "fuzz.py"), "--replay", *map(str, REGRESSIONS)], env=env,
                          capture_output=True, text=True, timeout=600)
    out = dict(line.rsplit(": ", 1) if "FINDING" not in line else line.split(": ", 1)
               for line in proc.stdout.splitlines() if line.startswith(str(FUZZ)))
    return {Path(k).name: v for k, v in out.items()}


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_a_finding_now_ends_in_a_typed_error_or_a_parse(replayed, path):
    """Each input a campaign found, or that was written for a hole found beside one
    (tests/fuzz/regressions), ends in a typed error or a correct parse."""
    expected = "ok" if path.name in PARSED else "CorruptCheckpointError"
    assert replayed.get(path.name) == expected


def _expanded_blocks(fx, k: int) -> bytes:
    """The single-process fixture's manifest plus ``k`` records of one sharded tensor, each a
    stride-0 view of a 48-byte storage presenting 64 MiB (what the format allows a view), that
    tile a global tensor of k * 64 MiB: a few KB of manifest over ~80 KB of data files."""
    body = json.loads(fx.original[fx.single_manifest])
    n = 16 << 20
    first = len(body["tensors"])
    body["tensors"] += [{"name": "x", "storage": 0, "byte_offset": 0, "dtype": "float32", "shape": [n], "stride": [0],
                         "device": "cpu", "kind": "tensor", "shard": {"global_shape": [n * k], "offsets": [i * n]}}
                        for i in range(k)]
    body["state"]["$dict"].append(["x", {"$tensor": first}])
    return bytes([harness.selector("load_single")]) + harness.reseal(json.dumps(body).encode())


def test_blocks_viewing_the_same_bytes_are_not_assembled_into_a_huge_tensor(fx):
    """gdswriter.distributed.load_state assembles a sharded tensor whole: blocks that view the same
    few bytes must not make it allocate the global shape the manifest claims (512 MiB here)."""
    data = _expanded_blocks(fx, 8)
    before = harness.peak_rss()
    assert harness.run_one(fx, data) == "CorruptCheckpointError"
    assert harness.peak_rss() - before < 64 << 20


@pytest.mark.slow
def test_short_fuzz_campaign_finds_nothing(tmp_path):
    """The CI campaign: a fixed seed and number of inputs over every target; any finding fails
    (libFuzzer writes the input under tmp_path: replay it with tests/fuzz/fuzz.py --replay)."""
    try:
        import atheris  # noqa: F401
    except ImportError:
        pytest.fail("atheris is missing: pip install -e '.[test]' (pyproject's test extra pins it)")
    env = {**os.environ, "PYTHONPATH": str(FUZZ.parent.parent)}
    cmd = [sys.executable, str(FUZZ / "fuzz.py"), "--runs", str(CAMPAIGN_RUNS), "--time", str(CAMPAIGN_MAX_S),
           "--seed", "1", "--corpus", str(tmp_path / "corpus"), "--artifacts", f"{tmp_path}/"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CAMPAIGN_MAX_S + 120)
    tail = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("#") or "DONE" in line)[-6000:]
    print(proc.stdout[-2000:], tail, sep="\n")
    found = sorted(p.name for p in tmp_path.glob("crash-*")) + sorted(p.name for p in tmp_path.glob("oom-*"))
    assert proc.returncode == 0 and not found, f"the campaign found {found} (exit {proc.returncode}):\n{tail}"
    assert "DONE" in proc.stderr and "gdswriter fuzz:" in proc.stdout  # it ran (outcomes every 5000 inputs)
