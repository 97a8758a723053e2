"""Crash safety: a saving process killed at any point leaves the root loadable.

Two ways to die:
* SIGKILL after random delays, a real process saving 16-32 MiB steps in a loop;
* os._exit(137) at the k-th rename / fsync / rmtree of the commit protocol, for every k
  (single and multi-root), so that every protocol point is hit deterministically.
After each crash: opening a GDSCheckpointer removes every leftover, ``latest`` and
load() name a committed step, every committed step verifies and holds exactly the
bytes of the save that produced it, and nothing that was committed and not due for
deletion is lost.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import models as M
from gdswriter import GDSCheckpointer, load_state
from gdswriter.format.commit import CommitProtocol, parse_step_dir
from gdswriter.format.manifest import MANIFEST_NAME

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))


def leftovers(roots) -> list[str]:
    return [f"{r}/{n}" for r in roots for n in os.listdir(r) if n.startswith((".tmp-", ".trash-"))]


def manifest_gen(roots, step) -> int:
    return json.loads((Path(roots[0]) / f"step_{step:012d}" / MANIFEST_NAME).read_bytes())["metadata"]["gen"]


def check_root(roots, base, options, *, latest_file_strict=True) -> list[int]:
    """The invariants after a crash; returns the committed steps."""
    roots = [Path(r) for r in roots]
    before = CommitProtocol(roots).committed_steps()
    latest_file = roots[0] / "latest"
    if latest_file.exists() and latest_file_strict:
        assert int(latest_file.read_text()) in before, "`latest` names a step that is not committed"
    live = M.crash_state(base)
    with GDSCheckpointer(live, None, roots, options=options) as ck:
        assert leftovers(roots) == [], "opening the root must remove leftovers of the crash"
        steps = ck.steps()
        assert steps == before, "cleaning must not un-commit anything"
        for _i, r in enumerate(roots[1:], 1):  # no orphaned secondary step directory survives
            assert all(parse_step_dir(n) in steps for n in os.listdir(r) if parse_step_dir(n) is not None), r
        if not steps:
            assert ck.latest_step() is None
            return steps
        latest = ck.latest_step()
        assert latest in steps
        assert ck.load() == latest
        assert M.crash_matches(live, base, manifest_gen(roots, latest)), f"step {latest} holds the wrong bytes"
        for s in steps:  # every committed step verifies (crc32c) and holds its own save's bytes
            if s != latest:
                assert ck.load(s) == s
                assert M.crash_matches(live, base, manifest_gen(roots, s), sample=1 << 16), f"step {s} is wrong"
    got_step, st = load_state(roots)  # the lock-free reader agrees
    assert got_step == latest and M.crash_matches(st["model"], base, manifest_gen(roots, latest))
    return steps


# ----------------------------------------------------------------------------- SIGKILL loop
KILL_CHILD = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    from support import models as M
    from gdswriter import GDSCheckpointer

    roots, mib = sys.argv[1].split(","), int(sys.argv[2])
    base = M.crash_base(mib << 20)
    state = M.crash_state(base)
    print("IMPORTED", flush=True)
    if sys.stdin.readline().strip() != "GO":
        sys.exit(0)
    ck = GDSCheckpointer(state, None, roots, options=M.small_options(keep_last=2, keep_every=4))
    step = max(ck.steps(), default=0) + 1
    print("READY", step, flush=True)
    while True:
        M.crash_fill(state, base, step)
        ck.save(step, metadata={"gen": step})
        print("SAVED", step, flush=True)
        step += 1
""")


def _spawn(roots, mib):
    return subprocess.Popen([sys.executable, "-c", KILL_CHILD, ",".join(map(str, roots)), str(mib)], env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _expect(proc, word):
    line = proc.stdout.readline()
    if not line.startswith(word):
        proc.kill()
        raise AssertionError(f"child said {line!r}, expected {word}: {proc.stderr.read()[-3000:]}")
    return line


@pytest.mark.slow
@pytest.mark.parametrize("n_roots,iterations,mib", [(1, 15, 32), (2, 5, 16)])
def test_sigkill_at_random_points(tmp_path, n_roots, iterations, mib):
    roots = [tmp_path / f"ssd{i}" for i in range(n_roots)]
    options = M.small_options(keep_last=2, keep_every=4)
    base = M.crash_base(mib << 20)
    # measure one save so that the kills spread over the whole save (write, commit, retention)
    probe = [tmp_path / f"probe{i}" for i in range(n_roots)]
    with GDSCheckpointer(M.crash_state(base), None, probe, options=options) as ck:
        ck.save(0, metadata={"gen": 0})
        t0 = time.monotonic()
        ck.save(1, metadata={"gen": 0})
        save_s = time.monotonic() - t0
    rng = random.Random(20240607 + n_roots)
    # Kill after `wait` completed saves (0, 1 or 2) plus a delay spread over [0, 1.5 saves):
    # one random point per stratum, so that the writes, the commit and the retention of the
    # next save are all hit; the first kill lands while the child opens and cleans the root.
    delays = [(i + rng.random()) / iterations * 1.5 * save_s for i in range(iterations)]
    rng.shuffle(delays)
    waits = [rng.choice((0, 1, 1, 2)) for _ in range(iterations)]
    waits[1] = -1  # the second child dies while it opens the root (cleaning the first one's leftovers)

    ever: set[int] = set()
    prev_max = 0
    nxt = _spawn(roots, mib)
    saved_lines = 0
    try:
        for it, (wait, delay) in enumerate(zip(waits, delays)):
            child, nxt = nxt, None
            _expect(child, "IMPORTED")
            child.stdin.write("GO\n")
            child.stdin.flush()
            if wait >= 0:
                _expect(child, "READY")
            for _ in range(wait):
                _expect(child, "SAVED")
            time.sleep(delay)
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
            assert child.returncode == -signal.SIGKILL
            out = child.stdout.read()
            saved_lines += max(wait, 0) + out.count("SAVED")
            if it + 1 < len(delays):
                nxt = _spawn(roots, mib)  # imports while we check
            steps = check_root(roots, base, options)
            ever |= set(steps)
            if steps:
                assert max(steps) >= prev_max
                # the newest step of the previous round is kept until two newer ones exist
                assert prev_max in steps or prev_max == 0 or sum(s > prev_max for s in steps) >= 2
                prev_max = max(steps)
            assert {s for s in ever if s % 4 == 0} <= set(steps), "keep_every steps must never be deleted"
    finally:
        for p in (nxt,):
            if p is not None:
                p.kill()
                p.wait()
    assert saved_lines >= 2, "the kills should let some saves finish"
    assert prev_max >= 2


# ----------------------------------------------------------------------------- exact points
DRIVER_BYTES = 96 * 1024
DRIVER = textwrap.dedent("""
    import json, os, shutil, sys
    import torch
    torch.set_num_threads(1)   # no thread pools before fork
    from support import models as M
    import gdswriter.format.commit as C
    import gdswriter.fs as F  # atomic_write (manifest, latest) fsyncs its directory through gdswriter.fs
    from gdswriter import GDSCheckpointer

    out, n_roots, SIZE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    base = M.crash_base(SIZE)
    opts = dict(keep_last=2, files_per_root=2)
    # (step, gen): a new step (and retention of step 1), the same step again, then another new one
    PLAN = [(3, 3), (3, 4), (4, 5)]

    def make(k):
        roots = [os.path.join(out, str(k), f"ssd{i}") for i in range(n_roots)]
        state = M.crash_state(base)
        ck = GDSCheckpointer(state, None, roots, options=M.small_options(**opts))
        for gen in (1, 2):
            M.crash_fill(state, base, gen)
            ck.save(gen, metadata={"gen": gen})
        ck.close()
        return roots

    def scenario(k, roots):
        calls = [0]

        def hook(real):
            def f(*a, **kw):
                calls[0] += 1
                if calls[0] == k:
                    os._exit(137)
                return real(*a, **kw)
            return f

        os.rename = hook(os.rename)
        os.replace = hook(os.replace)
        C.fsync_dir = hook(C.fsync_dir)
        F.fsync_dir = hook(F.fsync_dir)
        C.shutil.rmtree = hook(shutil.rmtree)
        C.exchange_paths = hook(C.exchange_paths)
        state = M.crash_state(base)
        ck = GDSCheckpointer(state, None, roots, options=M.small_options(**opts))
        for step, gen in PLAN:
            M.crash_fill(state, base, gen)
            ck.save(step, metadata={"gen": gen})
        ck.close()
        with open(os.path.join(out, "count"), "w") as f:
            f.write(str(calls[0]))
        os._exit(0)

    def run(k):
        pid = os.fork()
        if pid == 0:
            try:
                make(k)
                os._exit(0)
            except BaseException:
                import traceback; traceback.print_exc(); os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
        roots = [os.path.join(out, str(k), f"ssd{i}") for i in range(n_roots)]
        pid = os.fork()
        if pid == 0:
            try:
                scenario(k, roots)
            except BaseException:
                import traceback; traceback.print_exc(); os._exit(1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    codes = {0: run(0)}
    n = int(open(os.path.join(out, "count")).read())
    for k in range(1, n + 1):
        codes[k] = run(k)
    print(json.dumps({"n": n, "codes": codes}))
""")

# committed-step sets a crash may leave, in the order the plan passes through them. With one
# root the re-save of step 3 is one atomic swap, so step 3 is never missing ({2}).
VALID = {2: [{1, 2}, {1, 2, 3}, {2, 3}, {2}, {2, 3, 4}, {3, 4}],
         1: [{1, 2}, {1, 2, 3}, {2, 3}, {2, 3, 4}, {3, 4}]}


@pytest.mark.slow
@pytest.mark.parametrize("n_roots", [1, 2])
def test_crash_at_every_protocol_point(tmp_path, n_roots):
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(n_roots), str(DRIVER_BYTES)], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    n, codes = res["n"], {int(k): v for k, v in res["codes"].items()}
    assert n >= 12 * n_roots, f"too few protocol points counted ({n})"
    assert codes[0] == 0 and all(codes[k] == 137 for k in range(1, n + 1)), (codes, proc.stderr[-3000:])

    base = M.crash_base(DRIVER_BYTES)
    options = M.small_options(keep_last=2, files_per_root=2)
    reached = []
    for k in range(0, n + 1):
        roots = [tmp_path / str(k) / f"ssd{i}" for i in range(n_roots)]
        # during the re-save of step 3 `latest` may name the step being replaced; load() falls back
        steps = check_root(roots, base, options, latest_file_strict=False)
        assert set(steps) in VALID[n_roots], (k, steps)
        latest_file = int((roots[0] / "latest").read_text())
        assert latest_file in steps or latest_file == 3, (k, latest_file, steps)
        gens = {s: manifest_gen(roots, s) for s in steps}
        assert gens.get(1, 1) == 1 and gens.get(2, 2) == 2 and gens.get(4, 5) == 5 and gens.get(3) in (None, 3, 4)
        if k == 0:  # ran to the end
            assert steps == [3, 4] and gens == {3: 4, 4: 5}
        reached.append(VALID[n_roots].index(set(steps)))
    assert set(reached) == set(range(len(VALID[n_roots]))), f"every intermediate state is reached: {reached}"
