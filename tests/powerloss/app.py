"""The application under test: real gdswriter saves on the power-loss mount, run in a child process.

``python -m powerloss.app`` is a fork server: it imports torch and gdswriter once, then for
each job (a JSON line on stdin) forks a child that runs the job's actions against the mount
and exits; the server answers ``{"pid": N}`` when the child starts and ``{"exit": CODE}``
when it ends. A child whose file system lost power fails with EIO and exits non-zero.

The child writes what it has finished to the job's progress file (outside the mount), one
line each, flushed: ``opened``, ``saved STEP GEN``, ``waited``, ``exported STEP``,
``closed``. A finished action was acknowledged to the application, so what it made durable
must survive any later power cut: the test holds the file system to that.

The saved state is a small model (an nn.Module of ~1.5 MiB) and extra state, every byte a
function of a generation number ``gen``; ``expected(gen)`` rebuilds it for the checks.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections import OrderedDict

import torch
from torch import nn

EXPORT_DIR = "exports"


def export_name(step: int) -> str:
    return f"step{step}.safetensors"


def make_net() -> nn.Module:
    return nn.Sequential(OrderedDict(emb=nn.Embedding(2048, 160), proj=nn.Linear(160, 160), norm=nn.LayerNorm(160)))


def _pattern(gen: int, index: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(gen * 1009 + index)
    return torch.randn(shape, generator=g).to(dtype)


def fill(net: nn.Module, extra: dict, gen: int) -> None:
    """Make ``net`` and ``extra`` hold generation ``gen``."""
    with torch.no_grad():
        for i, (_, t) in enumerate(sorted(net.state_dict().items())):
            t.copy_(_pattern(gen, i, t.shape, t.dtype))
    extra["gen"] = gen
    extra["ema"] = _pattern(gen, 999, torch.Size([24_000]), torch.bfloat16)


def expected(gen: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state_dict, extra state) of generation ``gen``."""
    net, extra = make_net(), {}
    fill(net, extra, gen)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, extra


def run_actions(roots: list[str], actions: list[list], options: dict, progress) -> None:
    import _models as M

    from gdswriter import GDSCheckpointer
    from gdswriter.export import export_step

    net, extra = make_net(), {}
    engine = M.small_engine(**options.pop("engine", {}))
    ck = GDSCheckpointer(net, None, roots, state={"progress": extra}, options=M.small_options(engine=engine,
                                                                                              **options))
    progress("opened")
    for action in actions:
        if action[0] == "save":
            _, step, gen = action
            fill(net, extra, gen)
            ck.save(step, metadata={"gen": gen})
            progress(f"saved {step} {gen}")
        elif action[0] == "wait":  # retention done: deterministic order for what follows
            ck.wait()
            progress("waited")
        elif action[0] == "export":
            step = action[1]
            export_step(roots, step, "safetensors", os.path.join(os.path.dirname(roots[0]), EXPORT_DIR,
                                                                 export_name(step)))
            progress(f"exported {step}")
        else:
            raise ValueError(f"unknown action {action!r}")
    ck.close()
    progress("closed")


def _child(job: dict) -> int:
    with open(job["progress"], "a", buffering=1) as out:
        os.dup2(out.fileno(), 2)  # gdswriter's warnings and tracebacks go to the progress file too

        def progress(line: str) -> None:
            out.write(line + "\n")
            out.flush()

        try:
            run_actions(job["roots"], job["actions"], dict(job.get("options", {})), progress)
            return 0
        except BaseException as e:
            progress(f"error {type(e).__name__}: {e}".replace("\n", " "))
            traceback.print_exc()
            return 1


def serve() -> int:
    import ctypes
    import signal

    import gdswriter

    torch.set_num_threads(1)  # no thread pool before fork
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the test
    print(json.dumps({"ready": True, "gdswriter": gdswriter.__file__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
            code = 1
            try:
                code = _child(job)
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
