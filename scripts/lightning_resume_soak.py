"""Soak test for issue 37: run the Lightning kill-and-resume case
``test_sigkill_then_resume_matches_an_uninterrupted_run[in-resave-of-last-async]`` many times
(beside CPU hogs), logging a digest of every parameter, gradient and AdamW state tensor, the lr
and the RNG state at every step of the uninterrupted run, the killed child and the resumed
run, so that a mismatch shows at which step and in which tensor the runs part.

    PYTHONPATH=$PWD python scripts/lightning_resume_soak.py --runs 100 --hogs 1 --work /tmp/soak [--threads untouched]

``--threads untouched`` trains as the test did before issue 37's fix (torch's default threads:
two here), ``test`` (the default) as it does now (lightning_run.one_thread: one), N with N.

The killed child is forked from a "zygote" process that has imported torch and Lightning and
run nothing (no thread pool yet), as a fresh ``python -m support.lightning_run`` would be but
without its few seconds of imports: the same code trains and dies the same way (``--fresh``
starts a new interpreter per child instead, as the test does).

One line of JSON per run on stdout (and in WORK/results.jsonl); a failed run keeps its
directory (the three step logs, the final tensors of both runs). ``--rereference N`` also
reruns the uninterrupted run every N runs and checks it against the first one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path[:0] = [str(TESTS), str(ROOT)]
from support import lightning_run as R  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
CASE = ["in-save", "1", "12", "last", "all"]  # the in-resave-of-last-async parameters
PHASES = {"restored": 0, "start": 1, "grads": 2, "end": 3}


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def step_log(path: Path):
    """A Lightning callback appending one JSON line per step phase to ``path``: the batch and
    RNG at the step's start, the gradients before the optimizer step, the weights and AdamW
    state after it (flushed at once: the child dies of SIGKILL)."""
    import lightning as L

    class StepLog(L.Callback):
        def __init__(self):
            self.f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the run: the child dies of SIGKILL

        def put(self, phase, t, rec):
            rec.update(phase=phase, step=t.global_step, threads=torch.get_num_threads())
            self.f.write(json.dumps(rec) + "\n")

        def state(self, t, module):
            opt = t.optimizers[0]
            rec = {f"w/{k}": digest(v) for k, v in module.state_dict().items()}
            for i, p in enumerate(opt.param_groups[0]["params"]):
                for k, v in opt.state.get(p, {}).items():
                    rec[f"o/{i}/{k}"] = digest(v) if isinstance(v, torch.Tensor) else repr(v)
            rec["lr"] = repr(opt.param_groups[0]["lr"])
            return rec

        def on_train_start(self, t, module):
            self.put("restored", t, self.state(t, module))

        def on_train_batch_start(self, t, module, batch, batch_idx):
            self.put("start", t, {"batch": digest(batch[0]), "rng": digest(torch.get_rng_state()),
                                  "lr": repr(t.optimizers[0].param_groups[0]["lr"])})

        def on_before_optimizer_step(self, t, module, optimizer):
            self.put("grads", t, {f"g/{n}": digest(p.grad) for n, p in module.named_parameters()})

        def on_train_batch_end(self, t, module, outputs, batch, batch_idx):
            self.put("end", t, self.state(t, module))

    return StepLog()


def pinning(mode: str):
    """The ``one_thread`` every run trains under: lightning_run's ("test", as the test does),
    none ("untouched": torch's default threads, as before issue 37's fix), or N threads."""
    if mode == "test":
        return R.one_thread
    if mode == "untouched":
        return contextlib.nullcontext
    n = int(mode)

    @contextlib.contextmanager
    def n_threads():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return n_threads


def quiet() -> None:
    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def child(log: str, out: str, *case: str) -> None:
    """lightning_run's child, with the step log added to its trainer's callbacks."""
    quiet()
    R.one_thread = pinning(os.environ.get("SOAK_THREADS", "test"))  # main() trains inside it
    plain = R.trainer
    R.trainer = lambda root, *, callbacks=(), **kw: plain(root, callbacks=[step_log(Path(log)), *callbacks], **kw)
    R.main(out, case[0], case[1] == "1", int(case[2]), *case[3:])


def zygote() -> None:
    """Import what the child needs, then for each request line (JSON: log, out, case) fork a
    child (stdout and stderr to OUT/child.out) and answer its wait status."""
    quiet()
    import lightning  # noqa: F401
    import gdswriter.integrations.lightning  # noqa: F401

    for line in sys.stdin:
        log, out, case = json.loads(line)
        pid = os.fork()
        if pid == 0:
            fd = os.open(os.path.join(out, "child.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            try:
                child(log, out, *case)
            except BaseException:  # noqa: BLE001 - reported by the exit status and child.out
                import traceback

                traceback.print_exc()
                sys.stdout.flush()
                os._exit(1)
            sys.stdout.flush()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)


class Children:
    """The killed children: forked from a zygote (default) or fresh interpreters (``fresh``)."""

    def __init__(self, fresh: bool):
        self.zygote = None if fresh else subprocess.Popen(
            [sys.executable, __file__, "--zygote"], env=ENV, cwd=TESTS, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)

    def run(self, d: Path) -> tuple[int, str]:
        if self.zygote is None:
            c = subprocess.run([sys.executable, __file__, "--child", str(d / "child.jsonl"), str(d), *CASE],
                               env=ENV, capture_output=True, text=True, timeout=600, cwd=TESTS)
            return c.returncode, c.stdout + c.stderr
        self.zygote.stdin.write(json.dumps([str(d / "child.jsonl"), str(d), CASE]) + "\n")
        self.zygote.stdin.flush()
        rc = json.loads(self.zygote.stdout.readline())
        return rc, (d / "child.out").read_text()

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.stdin.close()
            self.zygote.wait()


def reference(work: Path, log: Path) -> dict:
    """The uninterrupted run (as the test's module fixture), step-logged to ``log``."""
    m = R.model(R.SEED)
    t = R.trainer(work / "straight", callbacks=[step_log(log)], enable_checkpointing=False)
    with R.one_thread():
        t.fit(m, R.data())
    return R.final_state(t, m)


def read_log(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[(rec.pop("step"), rec.pop("phase"))] = rec
    return out


def divergences(ref: dict, got: dict, role: str) -> list:
    """(step, phase, keys that differ) where ``got`` disagrees with the reference, in order."""
    found = []
    for (step, phase), rec in sorted(got.items(), key=lambda kv: (kv[0][0], PHASES[kv[0][1]])):
        resumed = phase == "restored" and step > 0  # the checkpoint's state: the reference's at that step's end
        want = ref.get((step, "end") if resumed else (step, phase), {})
        keys = [k for k in rec if k not in ("threads", "lr" if resumed else "") and rec[k] != want.get(k)]
        if keys:
            found.append({"role": role, "step": step, "phase": phase, "keys": keys})
    return found


def tree_diffs(a, b, where="") -> list:
    """Key paths where two final states differ, with the largest absolute difference."""
    if isinstance(a, torch.Tensor):
        if torch.equal(a, b):
            return []
        d = (a.double() - b.double()).abs()
        return [{"where": where, "max_abs": d.max().item(), "n": int((d > 0).sum())}]
    if isinstance(a, dict):
        return [x for k in a for x in tree_diffs(a[k], b.get(k), f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        return [x for i, (p, q) in enumerate(zip(a, b)) for x in tree_diffs(p, q, f"{where}/{i}")]
    return [] if a == b else [{"where": where, "a": repr(a), "b": repr(b)}]


def one_run(i: int, work: Path, expected: dict, ref_log: dict, children: Children) -> dict:
    """The test case once: the child killed in last.ckpt's re-save of step 12, then a fresh
    trainer resumed from ``last`` in this process, compared with the uninterrupted run."""
    d = work / f"run{i:04d}"
    d.mkdir()
    t0 = time.monotonic()
    rc, said = children.run(d)
    res = {"run": i, "child_rc": rc, "child_s": round(time.monotonic() - t0, 1)}
    if rc != -signal.SIGKILL or "KILLED" not in said:
        return dict(res, ok=False, error="child " + said[-1500:])
    m = R.model(99)
    t = R.trainer(d / "resumed", callbacks=[step_log(d / "resumed.jsonl"), R.checkpoints(d / "ckpts", "all")],
                  plugins=[R.plugin(True)])
    with R.one_thread():
        t.fit(m, R.data(), ckpt_path="last")
    got = R.final_state(t, m)
    diffs = tree_diffs(expected, got)
    div = (divergences(ref_log, read_log(d / "child.jsonl"), "child")
           + divergences(ref_log, read_log(d / "resumed.jsonl"), "resumed"))
    res.update(ok=not diffs and not div, total_s=round(time.monotonic() - t0, 1), load=os.getloadavg()[0],
               final_diffs=diffs, first_divergence=div[:3], threads=torch.get_num_threads())
    if res["ok"]:
        shutil.rmtree(d)
    else:
        torch.save({"expected": expected, "got": got}, d / "final_states.pt")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--hogs", type=int, default=1, help="busy-loop processes beside the runs")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--fresh", action="store_true", help="a new interpreter per child (as the test), no zygote")
    p.add_argument("--threads", default="test", help="test (lightning_run.one_thread), untouched, or a number")
    p.add_argument("--rereference", type=int, default=0, help="rerun the uninterrupted run every N runs")
    a = p.parse_args()
    quiet()
    a.work.mkdir(parents=True, exist_ok=True)
    ENV["SOAK_THREADS"] = a.threads  # for the children
    R.one_thread = pinning(a.threads)
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.hogs)]
    children = Children(a.fresh)
    try:
        expected = reference(a.work, a.work / "reference.jsonl")
        ref_log = read_log(a.work / "reference.jsonl")
        with open(a.work / "results.jsonl", "a", buffering=1) as out:
            for i in range(a.runs):
                if a.rereference and i and i % a.rereference == 0:
                    log = a.work / f"reference-{i}.jsonl"
                    again = tree_diffs(expected, reference(a.work, log)) or divergences(ref_log, read_log(log), "ref")
                    out.write(json.dumps({"rereference": i, "ok": not again, "diffs": again[:3]}) + "\n")
                res = one_run(i, a.work, expected, ref_log, children)
                out.write(json.dumps(res) + "\n")
                print(json.dumps(res), flush=True)
    finally:
        children.close()
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:])
    elif sys.argv[1:2] == ["--zygote"]:
        zygote()
    else:
        main()
