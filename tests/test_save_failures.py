"""Failed saves: each is reported once, with its own error, and none leaves training, close()
or the interpreter's exit waiting forever.

Real files, real engines (a fault-injecting one where a write must fail). Scenarios that
would hang without the code under test run in a child process with a generous timeout, so
that a hang is a failure and not a stuck test run.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest
import torch

from support import models as M
from gdswriter import EngineIOError, GDSCheckpointer, load_state
from gdswriter import checkpointer as checkpointer_mod
from gdswriter.save import snapshot as snapshot_mod
from gdswriter.errors import GDSWriterError
from gdswriter.options import KiB

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
CHILD_TIMEOUT_S = 180  # a hang becomes a failure


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def failing_writes(ck, monkeypatch, errnos: list[int], gate: threading.Event | None = None) -> None:
    """Each engine's write_file raises OSError with the next of ``errnos`` (after ``gate``)."""
    def boom(path, spans, **kw):
        if gate is not None:
            assert gate.wait(60), "the test never opened the gate"
        err = errnos.pop(0)
        raise OSError(err, os.strerror(err), str(path)) if err == errno.ETIMEDOUT else \
            EngineIOError(err, path, 0, "write")

    for e in ck.engines:
        monkeypatch.setattr(e, "write_file", boom)


# ----------------------------------------------------------------------------- 1: multi-root ring
RING_CHILD = """
    import errno, os, sys
    from concurrent.futures import TimeoutError as FutureTimeout
    from support import models as M
    from gdswriter import EngineIOError, GDSCheckpointer, create_engine, load_state
    from gdswriter.testing.faults import FaultInjectingEngine, FaultPlan
    from gdswriter.options import KiB, MiB
    roots = sys.argv[1:3]
    base = M.crash_base(16 << 20)
    state = M.crash_state(base)
    # 16 MiB through a 1 MiB pool (ring reuse), 2 roots x 2 files, 64 KiB staging buffers
    opts = M.small_options(snapshot="host", snapshot_pool_bytes=1 * MiB, files_per_root=2,
                           engine=M.small_engine(buffer_bytes=64 * KiB, request_bytes=64 * KiB))
    # root 1's first write fails: ENOSPC
    engines = [create_engine(opts.engine),
               FaultInjectingEngine(opts.engine, FaultPlan(fail_at_request=1, errno=errno.ENOSPC, op="write"))]
    ck = GDSCheckpointer(state, None, roots, options=opts, engines=engines)
    h = ck.save_async(1)
    try:
        h.result(timeout=90)
        sys.exit("the save did not fail")
    except EngineIOError as e:
        assert e.errno == errno.ENOSPC, e
    except FutureTimeout:
        print("HUNG: the failed save never finished", flush=True)
        os._exit(3)  # the save threads would keep the exit waiting too
    assert h.snapshotted()
    M.crash_fill(state, base, 2)
    assert ck.save(2) == 2  # the fault fired once: the checkpointer is still usable
    ck.close()
    assert M.crash_matches(load_state(roots)[1]["model"], base, 2)
    print("OK")
"""


def test_a_root_failing_while_the_others_wait_for_the_pool_fails_the_save(tmp_path):
    """Root 1 fails on its first file while its later files' pieces hold ring room: the copier
    waited for that room, root 0 for the copier, and the save never ended (nor the optimizer
    step, close() or the exit). The failing root now stops the whole save at once."""
    proc = run_child(RING_CHILD, tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- 2: exit
EXIT_CHILD = """
    import errno, sys, torch
    from support import models as M
    from gdswriter import GDSCheckpointer
    from gdswriter.testing.faults import FaultInjectingEngine, FaultPlan
    opts = M.small_options()
    fault = FaultInjectingEngine(opts.engine)
    ck = GDSCheckpointer({"w": torch.randn(100_000)}, None, sys.argv[1], options=opts, engines=[fault])
    ck.save(4)
    fault.reset(FaultPlan(fail_at_request=1, errno=errno.ENOSPC, op="write"))
    ck.save_async(5)
    print("SUBMITTED", flush=True)
    # the script ends: nobody asks how step 5 went
"""


def test_a_failed_save_nobody_asked_about_is_logged_at_exit(tmp_path):
    proc = run_child(EXIT_CHILD, tmp_path)
    assert "SUBMITTED" in proc.stdout, proc.stderr[-3000:]
    err = proc.stderr
    assert "step 5 was NOT saved" in err and "No space left on device" in err, err[-3000:]
    assert "newest committed step is 4" in err, err[-3000:]


# ----------------------------------------------------------------------------- 3: thread start
THREAD_CHILD = """
    import sys, threading
    from support import models as M
    from gdswriter import GDSCheckpointer
    from gdswriter.errors import GDSWriterError
    model, opt, sched, _ = M.build(0, scaler=False)
    M.train_steps(model, opt, sched, 1)
    ck = GDSCheckpointer(model, opt, sys.argv[1], options=M.small_options())
    real = threading.Thread.start
    failed = []

    def start(self):
        if self.name == "gdswriter-save" and not failed:
            failed.append(self)
            raise RuntimeError("can't start new thread")
        return real(self)

    threading.Thread.start = start
    try:
        ck.save_async(1)
        sys.exit("save_async did not raise")
    except GDSWriterError as e:
        assert isinstance(e.__cause__, RuntimeError) and "thread limit" in str(e), repr(e)
    finally:
        threading.Thread.start = real
    M.train_steps(model, opt, sched, 1)  # the step pre-hook does not wait for the save that never ran
    ck.wait()  # nothing queued, nothing raised again
    assert ck.save(2) == 2
    ck.close()
    assert ck.steps() == [2], ck.steps()
    print("OK")
"""


def test_a_save_thread_that_cannot_start_fails_that_save_only(tmp_path):
    proc = run_child(THREAD_CHILD, tmp_path)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- 4: retention
def test_a_retention_failure_is_logged_and_load_still_works(tmp_path, monkeypatch, caplog):
    state = {"w": torch.zeros(1000)}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options(keep_last=1)) as ck:
        ck.save(1)
        real = ck.protocol.delete_step
        calls = []

        def flaky(step):
            calls.append(step)
            if len(calls) == 1:
                raise RuntimeError("injected retention failure")
            real(step)

        monkeypatch.setattr(ck.protocol, "delete_step", flaky)
        state["w"].fill_(2)
        with caplog.at_level(logging.WARNING, logger="gdswriter"):
            assert ck.save(2) == 2
            assert ck.steps() == [1, 2]  # nothing raised: the failure is logged
        assert "after step 2" in caplog.text and str(tmp_path) in caplog.text
        assert "injected retention failure" in caplog.text
        ck.wait()
        state["w"].fill_(0)
        assert ck.load() == 2 and state["w"][0].item() == 2
        ck.save(3)  # retried after the next save
        assert ck.steps() == [3] and calls == [1, 1, 2]


# ----------------------------------------------------------------------------- 5, 6: reporting
def test_several_unreported_failures_raise_the_first_and_log_the_others(tmp_path, monkeypatch, caplog):
    with GDSCheckpointer({"w": torch.ones(1000)}, None, tmp_path, options=M.small_options()) as ck:
        gate = threading.Event()
        failing_writes(ck, monkeypatch, [errno.ENOSPC, errno.EIO], gate)
        h1, h2 = ck.save_async(1), ck.save_async(2)
        gate.set()
        with caplog.at_level(logging.ERROR, logger="gdswriter"):
            with pytest.raises(EngineIOError) as ei:
                ck.wait()
        assert ei.value is h1.exception() and ei.value.errno == errno.ENOSPC
        assert "step 2 was not saved either" in caplog.text and "Input/output error" in caplog.text
        ck.wait()  # each reported once
        with pytest.raises(EngineIOError) as ei2:
            h2.result()  # the handle's own result always says what happened to it
        assert ei2.value.errno == errno.EIO
        monkeypatch.undo()
        assert ck.save(3) == 3


def test_a_save_failing_with_etimedout_is_reported_once(tmp_path, monkeypatch):
    """OSError(ETIMEDOUT) is TimeoutError, as is the wait's timeout since Python 3.11."""
    with GDSCheckpointer({"w": torch.ones(1000)}, None, tmp_path, options=M.small_options()) as ck:
        failing_writes(ck, monkeypatch, [errno.ETIMEDOUT])
        h = ck.save_async(1)
        with pytest.raises(TimeoutError) as ei:
            h.result(timeout=60)
        assert ei.value.errno == errno.ETIMEDOUT
        ck.wait()  # reported by the handle: not again
        monkeypatch.undo()
        assert ck.save(2) == 2


# ----------------------------------------------------------------------------- 7, 8: lifecycle
def test_a_closed_checkpointer_makes_no_engines(tmp_path, monkeypatch):
    ck = GDSCheckpointer({"w": torch.ones(10)}, None, tmp_path, options=M.small_options())
    ck.save(1)
    ck.close()
    made = []
    monkeypatch.setattr(checkpointer_mod, "create_engine", lambda *a, **k: made.append(a) or None)
    for use in (ck.load, lambda: ck.engine_info, lambda: ck.save_async(2), lambda: ck.engines):
        with pytest.raises(GDSWriterError, match="closed: create a new one"):
            use()
    assert made == []
    assert ck.steps() == [1]  # reading what is committed needs no engine


def test_the_save_thread_lets_go_of_the_snapshot(tmp_path, monkeypatch):
    """Once wait() returns, nothing of the checkpointer's keeps the last snapshot alive (its
    captured copies, and on a GPU the storages it views), also while the save thread idles."""
    refs = []
    real = checkpointer_mod.record_snapshot

    def recorded(*a, **kw):  # what save_async records, and the Snapshot the save thread makes of it
        pending = real(*a, **kw)
        refs.append(weakref.ref(pending))
        complete = pending.complete
        pending.complete = lambda layout: (snap := complete(layout), refs.append(weakref.ref(snap)))[0]
        return pending

    monkeypatch.setattr(checkpointer_mod, "record_snapshot", recorded)
    with GDSCheckpointer({"w": torch.ones(1000)}, None, tmp_path, options=M.small_options()) as ck:
        ck.save_async(1).result(timeout=60)
        ck.wait()
        gc.collect()
        assert ck.save_queue.worker is not None and ck.save_queue.worker.is_alive()
        assert len(refs) == 2 and all(r() is None for r in refs), "the idle save thread still holds the snapshot"


# ----------------------------------------------------------------------------- 9: what is reported
def test_a_save_that_falls_back_to_live_mode_says_so(tmp_path, monkeypatch):
    with GDSCheckpointer({"w": torch.ones(1000)}, None, tmp_path, options=M.small_options(snapshot="host")) as ck:
        for e in ck.engines:
            monkeypatch.setattr(e, "honours_span_guards", False)
        h = ck.save_async(1)
        assert h.result(timeout=60) == 1
        assert h.mode == "live" and h.stats.mode == "live"
        monkeypatch.undo()
        h = ck.save_async(2)
        h.result(timeout=60)
        assert h.mode == "host" and h.stats.mode == "host"


def test_small_buffers_past_the_capture_budget_are_copied_before_save_async_returns(tmp_path, monkeypatch, caplog,
                                                                                    io_fresh_log_once):
    """Past the budget they used to stay live with a warning, and a change right after
    save_async reached the step (issue 22 item 3): save_async now returns once the save has
    copied them, and says so once."""
    monkeypatch.setattr(snapshot_mod, "CAPTURE_BUDGET", 8 * KiB)
    state = {f"b{i}": torch.ones(1024) for i in range(4)}  # 4 KiB each: two fit
    with caplog.at_level(logging.INFO, logger="gdswriter"), \
            GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        h = ck.save_async(1)
        assert h.snapshotted()
        for t in state.values():
            t.add_(1.0)
        assert h.result(timeout=60) == 1
    assert "save_async waits until the save has copied 2 live tensor(s) that no optimizer step hook guards" \
        in caplog.text
    assert all(torch.equal(v, torch.ones(1024)) for v in load_state(tmp_path, 1)[1]["model"].values())


def test_on_busy_skip_is_refused_with_several_ranks(tmp_path):
    """Multi-rank (a collective session; one gloo rank is enough to take that path): ranks that
    skip on their own would save different steps."""
    proc = run_child("""
        import sys, torch, torch.distributed as dist
        from support import models as M
        from gdswriter import GDSCheckpointer
        from gdswriter.distributed import DistOptions
        from gdswriter.errors import InvalidOptionError
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
        kw = dict(dist_options=DistOptions(collective=True, timeout_s=60))
        root = sys.argv[1] + "/ck"
        try:
            GDSCheckpointer({"w": torch.ones(4)}, None, root, options=M.small_options(on_busy="skip"), **kw)
            sys.exit("on_busy='skip' was accepted")
        except InvalidOptionError as e:
            assert "on_busy='wait'" in str(e), e
        with GDSCheckpointer({"w": torch.ones(4)}, None, root, options=M.small_options(), **kw) as ck:  # unlocked
            assert ck.save(1) == 1
        dist.destroy_process_group()
        print("OK")
    """, tmp_path)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]

