"""The drain to shared storage (CheckpointOptions.drain_root, issue 39 item 4): committed steps
copied in the background into a root of their own, committed there crash-atomically, loadable
with the local roots gone; a damaged local copy is never drained; a crash mid-drain leaves the
drain root at its last drained step; a save never waits for a drain."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import gdswriter
from gdswriter import CheckpointOptions, DrainError, GDSCheckpointer, InvalidOptionError
from gdswriter.cli import main as cli_main
from support.drain import GatedEngine, state

TESTS = Path(__file__).resolve().parent


def _set(holder: dict, step: int) -> dict:
    for k, v in state(step).items():
        holder[k].copy_(v)
    return holder


def _equal(got: dict, step: int) -> bool:
    """``got`` (the live dict, or load_state's tree holding it as "model") holds step's values."""
    got, want = got.get("model", got), state(step)
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _checkpointer(tmp_path: Path, holder: dict, engine=None, roots=("a",), **opts) -> GDSCheckpointer:
    return GDSCheckpointer(holder, root=[tmp_path / r for r in roots],
                           options=CheckpointOptions(drain_root=tmp_path / "shared", **opts), drain_engine=engine)


def _leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-")))


@pytest.mark.parametrize("roots", [("a",), ("a", "b")])
def test_drained_step_loads_bit_exact_with_local_roots_gone(tmp_path, roots):
    holder = state(1)
    with _checkpointer(tmp_path, holder, roots=roots) as ck:
        for step in (1, 2, 3):
            ck.save(_set(holder, step) and step)
        assert ck.wait_drained() == 3 and ck.drained_step() == 3
        assert ck.last_drain.step == 3 and ck.last_drain.nbytes >= 8 << 20
    for r in roots:
        shutil.rmtree(tmp_path / r)
    shared = tmp_path / "shared"
    names = sorted(os.listdir(shared))
    assert [n for n in names if not n.startswith("step_")] == [".gdswriter-root", ".gdswriter.lock", "latest"]
    # one drain at a time, and a newer step replaces one still waiting: step 2 is skipped when step 3
    # committed while step 1 was draining (a loaded machine); the first and the last are always drained
    assert [n for n in names if n.startswith("step_")] in (
        ["step_000000000001", "step_000000000002", "step_000000000003"], ["step_000000000001", "step_000000000003"])
    step, got = gdswriter.load_state(shared)
    assert step == 3 and _equal(got, 3)
    fresh = {k: torch.zeros_like(v) for k, v in state(0).items()}
    with GDSCheckpointer(fresh, root=shared) as ck:
        assert ck.load() == 3 and _equal(fresh, 3)
        assert ck.load(1) == 1 and _equal(fresh, 1)
    assert cli_main(["verify", str(shared)]) == 0


def test_drain_every_second_step_and_drain_retention(tmp_path):
    holder = state(1)
    with _checkpointer(tmp_path, holder, drain_every=2, keep_last=1, drain_keep_last=2) as ck:
        for step in range(1, 8):
            ck.save(_set(holder, step) and step)
            ck.wait_drained()
        assert ck.drained_step() == 6
        assert ck.steps() == [7]
    assert gdswriter.CheckpointOptions(drain_root="x", drain_every=2).drain_every == 2
    committed = sorted(int(n[5:]) for n in os.listdir(tmp_path / "shared") if n.startswith("step_"))
    assert committed == [4, 6]
    for step in committed:
        assert _equal(gdswriter.load_state(tmp_path / "shared", step)[1], step)


def test_damaged_local_copy_is_not_drained(tmp_path):
    """A flipped byte in step 2's local data file: its drain fails (DrainError, from the chunk's
    crc32c), nothing of it is committed at the drain root, which keeps step 1."""
    holder, eng = state(1), GatedEngine()
    with _checkpointer(tmp_path, holder, eng) as ck:
        ck.save(1)
        assert ck.wait_drained() == 1
        eng.gate.clear()
        ck.save(_set(holder, 2) and 2)
        assert eng.waiting.wait(60)  # the drain of step 2 waits at its first read
        data = next((tmp_path / "a" / "step_000000000002").glob("data-*.bin"))
        with open(data, "r+b") as f:
            f.seek(5 << 20)
            b = f.read(1)
            f.seek(5 << 20)
            f.write(bytes([b[0] ^ 0x40]))
        eng.gate.set()
        with pytest.raises(DrainError) as ei:
            ck.wait_drained()
        assert ei.value.step == 2 and isinstance(ei.value.__cause__, gdswriter.ChecksumMismatchError)
        assert "damaged" in str(ei.value)
        assert ck.drained_step() == 1 and ck.wait_drained() == 1  # raised once
    shared = tmp_path / "shared"
    assert not (shared / "step_000000000002").exists() and _leftovers(shared) == []
    step, got = gdswriter.load_state(shared)
    assert step == 1 and _equal(got, 1)


def test_save_never_waits_for_a_drain(tmp_path):
    """While step 1's drain is held at its first read, steps 2 and 3 are saved and committed;
    step 1 stays on the local root (keep_last=1) until its drain ended, then is drained; step 2,
    replaced by step 3 before its drain began, is not drained."""
    holder, eng = state(1), GatedEngine()
    eng.gate.clear()
    with _checkpointer(tmp_path, holder, eng, keep_last=1, drain_keep_last=5) as ck:
        def save(step: int) -> None:  # in a thread: a save held by the drain must fail the test, not hang it
            done: list = []
            saver = threading.Thread(target=lambda: done.append(ck.save_async(step).result()), daemon=True)
            saver.start()
            saver.join(120)
            assert done == [step], f"step {step}'s save waited for the drain"

        try:
            save(1)
            assert eng.waiting.wait(60)
            for step in (2, 3):
                save(_set(holder, step) and step)
            assert eng.waiting.is_set() and ck.drained_step() is None
            assert ck.steps() == [1, 3]  # 1 is pinned by its drain, 2 was dropped by the retention
        finally:
            eng.gate.set()
        assert ck.wait_drained() == 3
    assert sorted(n for n in os.listdir(tmp_path / "shared") if n.startswith("step_")) == [
        "step_000000000001", "step_000000000003"]
    assert _equal(gdswriter.load_state(tmp_path / "shared", 1)[1], 1)


def test_crash_mid_drain_leaves_the_drain_root_at_its_last_drained_step(tmp_path):
    """SIGKILL once step 2's first data file is in the drain root's temporary directory: the
    drain root loads step 1, bit-exact; the next drain removes the temporary directory."""
    shared, mark = tmp_path / "shared", tmp_path / "mark"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-m", "support.drain", str(tmp_path / "a"), str(tmp_path / "b"),
                              str(shared), str(mark)], cwd=TESTS, env=env)
    try:
        deadline = time.monotonic() + 240
        while not mark.exists():
            assert child.poll() is None, f"the child exited ({child.returncode}) before its drain stopped"
            assert time.monotonic() < deadline, "the child never reached step 2's drain"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    step, got = gdswriter.load_state(shared)
    assert step == 1 and _equal(got, 1)
    assert cli_main(["verify", str(shared)]) == 0
    tmp = [shared / n for n in _leftovers(shared)]
    assert len(tmp) == 1 and tmp[0].name.startswith(".tmp-step_000000000002")
    sizes = sorted(f.stat().st_size for f in tmp[0].glob("data-*.bin"))
    assert sizes[0] == 0 and sizes[-1] > 0  # one file copied, the other created and never written
    holder = _set(state(0), 3)
    with _checkpointer(tmp_path, holder, roots=("a", "b")) as ck:
        assert ck.latest_step() == 2
        ck.save(3)
        assert ck.wait_drained() == 3
    assert _leftovers(shared) == []
    assert _equal(gdswriter.load_state(shared)[1], 3) and _equal(gdswriter.load_state(shared, 1)[1], 1)


def test_drain_options_are_checked(tmp_path):
    with pytest.raises(InvalidOptionError, match="drain_every"):
        CheckpointOptions(drain_root="x", drain_every=0)
    with pytest.raises(InvalidOptionError, match="drain_root"):
        CheckpointOptions(drain_root="")
    with pytest.raises(InvalidOptionError, match="drain_keep_last"):
        CheckpointOptions(drain_root="x", drain_keep_last=0)
    with pytest.raises(InvalidOptionError, match="overlap"):
        GDSCheckpointer({}, root=tmp_path / "a", options=CheckpointOptions(drain_root=tmp_path / "a" / "d"))
    with pytest.raises(InvalidOptionError, match="drain_root"):
        GDSCheckpointer({}, root=tmp_path / "a", drain_engine=GatedEngine())

