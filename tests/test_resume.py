"""Bit-exact resume: train, save, resume in a fresh process (or fresh objects), and
get exactly the parameters and losses of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch

from support import models as M
from gdswriter import GDSCheckpointer, load_state

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _uninterrupted(n: int = 6):
    model, opt, sched, scaler = M.build(0)
    losses = M.train_steps(model, opt, sched, n, scaler)
    return model, opt, sched, scaler, losses


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    return env


RESUME_CHILD = textwrap.dedent("""
    import sys, random
    import numpy as np
    import torch
    from support import models as M
    from gdswriter import GDSCheckpointer

    root, out = sys.argv[1], sys.argv[2]
    model, opt, sched, scaler = M.build(seed=12345)          # different init and RNG position
    random.seed(7); np.random.seed(7)
    ck = GDSCheckpointer(model, opt, root, state={"sched": sched, "scaler": scaler},
                         options=M.small_options(save_rng=True))
    step = ck.load()
    losses = M.train_steps(model, opt, sched, 3, scaler)
    ck.close()
    torch.save({"step": step, "losses": losses, "params": M.params_of(model),
                "opt": opt.state_dict(), "sched": sched.state_dict(), "scaler": scaler.state_dict()}, out)
""")


def test_resume_in_fresh_process_is_bit_exact(tmp_path):
    model_a, opt_a, sched_a, scaler_a, losses_a = _uninterrupted()

    model, opt, sched, scaler = M.build(0)
    losses_b = M.train_steps(model, opt, sched, 3, scaler)
    with GDSCheckpointer(model, opt, tmp_path / "ck", state={"sched": sched, "scaler": scaler},
                         options=M.small_options(save_rng=True)) as ck:
        ck.save(3)
    assert losses_b == losses_a[:3]

    out = tmp_path / "child.pt"
    proc = subprocess.run([sys.executable, "-c", RESUME_CHILD, str(tmp_path / "ck"), str(out)],
                          env=_child_env(), cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = torch.load(out, weights_only=True)
    assert res["step"] == 3
    assert losses_b + res["losses"] == losses_a  # exact float equality
    M.assert_same_tensors(res["params"], M.params_of(model_a))
    # optimizer, scheduler and scaler continue exactly as well
    sa = opt_a.state_dict()
    for pid, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(res["opt"]["state"][pid][k], v), (pid, k)
    assert res["sched"] == sched_a.state_dict()
    assert res["scaler"] == scaler_a.state_dict()


def test_resume_in_process_into_fresh_objects(tmp_path):
    model_a, opt_a, sched_a, scaler_a, losses_a = _uninterrupted()

    model, opt, sched, scaler = M.build(0)
    losses_b = M.train_steps(model, opt, sched, 3, scaler)
    extra = {"sched": sched, "scaler": scaler}
    with GDSCheckpointer(model, opt, tmp_path, state=extra, options=M.small_options(save_rng=True)) as ck:
        ck.save(3)
    saved_sched, saved_scaler = sched.state_dict(), scaler.state_dict()
    del model, opt, sched, scaler

    model2, opt2, sched2, scaler2 = M.build(seed=999)
    torch.rand(17)  # move the RNG somewhere else entirely
    with GDSCheckpointer(model2, opt2, tmp_path, state={"sched": sched2, "scaler": scaler2},
                         options=M.small_options(save_rng=True)) as ck:
        assert ck.load() == 3
    assert model2.head.weight is model2.emb.weight  # still tied after loading in place
    assert sched2.state_dict() == saved_sched and scaler2.state_dict() == saved_scaler
    losses_c = M.train_steps(model2, opt2, sched2, 3, scaler2)
    assert losses_b + losses_c == losses_a
    M.assert_same_tensors(M.params_of(model2), M.params_of(model_a))
    assert scaler2.state_dict() == scaler_a.state_dict()


def test_resume_without_rng_diverges(tmp_path):
    """Guard for the test above: without save_rng the fresh RNG changes the data and the
    dropout masks, so the bit-exact comparison really depends on the RNG being restored."""
    _, _, _, _, losses_a = _uninterrupted()
    model, opt, sched, scaler = M.build(0)
    losses_b = M.train_steps(model, opt, sched, 3, scaler)
    with GDSCheckpointer(model, opt, tmp_path, state={"sched": sched, "scaler": scaler},
                         options=M.small_options(save_rng=False)) as ck:
        ck.save(3)
    model2, opt2, sched2, scaler2 = M.build(seed=999)
    with GDSCheckpointer(model2, opt2, tmp_path, state={"sched": sched2, "scaler": scaler2},
                         options=M.small_options()) as ck:
        ck.load()
    assert losses_b + M.train_steps(model2, opt2, sched2, 3, scaler2) != losses_a


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    snap = {f"model/{k}": v for k, v in M.params_of(model).items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            snap[f"optimizer/{pid}/{k}"] = v.clone()
    return snap


def _saved(state) -> dict[str, torch.Tensor]:
    snap = {f"model/{k}": v for k, v in state["model"].items()}
    for pid, st in state["optimizer"]["state"].items():
        for k, v in st.items():
            snap[f"optimizer/{pid}/{k}"] = v
    return snap


def test_save_async_snapshot_is_taken_before_return(tmp_path):
    model, opt, sched, scaler = M.build(0)
    M.train_steps(model, opt, sched, 2, scaler)
    before = _snapshot(model, opt)
    with GDSCheckpointer(model, opt, tmp_path, state={"sched": sched},
                         options=M.small_options(snapshot="host")) as ck:
        # Hold the engines so that the write of the snapshot certainly happens after the
        # mutation below: if the snapshot were not copied before the optimizer step, the
        # mutated bytes would be written.
        gate = threading.Event()
        for e in ck.engines:
            e.write_file = lambda *a, _real=e.write_file, **kw: (gate.wait(30), _real(*a, **kw))[1]
        handle = ck.save_async(2)
        assert not handle.done()
        M.train_steps(model, opt, sched, 1, scaler)  # optimizer.step() mutates params and moments in place
        after = _snapshot(model, opt)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        gate.set()
        assert handle.result(timeout=60) == 2
        assert handle.done()
    step, state = load_state(tmp_path)
    assert step == 2
    M.assert_same_tensors(_saved(state), before)
    assert state["extra"]["sched"]["last_epoch"] == 2


def test_save_async_resume_is_bit_exact(tmp_path):
    """save_async every step while training goes on; resuming from each gives the uninterrupted run."""
    model_a, _, _, _, losses_a = _uninterrupted()
    model, opt, sched, scaler = M.build(0)
    extra = {"sched": sched, "scaler": scaler}
    with GDSCheckpointer(model, opt, tmp_path, state=extra, options=M.small_options(save_rng=True)) as ck:
        losses = []
        for step in range(1, 7):
            losses += M.train_steps(model, opt, sched, 1, scaler)
            ck.save_async(step)
        ck.wait()
        assert ck.steps() == [1, 2, 3, 4, 5, 6]
    assert losses == losses_a
    for step in (2, 4):
        m2, o2, s2, g2 = M.build(seed=step + 100)
        with GDSCheckpointer(m2, o2, tmp_path, state={"sched": s2, "scaler": g2},
                             options=M.small_options(save_rng=True)) as ck:
            assert ck.load(step) == step
        assert losses_a[:step] + M.train_steps(m2, o2, s2, 6 - step, g2) == losses_a
        M.assert_same_tensors(M.params_of(m2), M.params_of(model_a))
