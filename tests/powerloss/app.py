"""The application under test: real gdswriter saves on the power-loss mount, run in a child process.

``python -m powerloss.app`` is a fork server: it imports torch and gdswriter once, then for
each job (a JSON line on stdin) forks a child that runs the job's actions against the mount
and exits; the server answers ``{"pid": N}`` when the child starts and ``{"exit": CODE}``
when it ends. A child whose file system lost power fails with EIO and exits non-zero. In a job
of several ranks (``options["ranks"]``) the child forks the other ranks, joins them in a gloo
process group, and ends when they all have.

The child (rank 0) writes what it has finished to the job's progress file (outside the
mount), one line each, flushed: ``opened``, ``saved STEP GEN``, ``waited``, ``exported STEP``,
``exported-hf STEP``, ``closed``. A finished action was acknowledged to the application, so
what it made durable must survive any later power cut: the test holds the file system to that.

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


def hf_export_name(step: int) -> str:
    return f"step{step}-hf"


HF_CONFIG = {"model_type": "powerloss-test", "note": "any config.json: the export copies it"}


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


def run_actions(roots: list[str], actions: list[list], options: dict, progress, workdir: str,
                rank: int = 0) -> None:
    """Run the job's actions; ``workdir`` (outside the mount) holds the job's own files. In a
    job of several ranks (a process group is up) every rank saves, rank 0 alone exports."""
    from support import models as M

    from gdswriter import GDSCheckpointer
    from gdswriter.export import export_step

    net, extra = make_net(), {}
    engine = M.small_engine(**options.pop("engine", {}))
    if options.pop("dcp", False):
        _run_dcp(roots, actions, options, engine, progress, rank)
        return
    dist_options = None
    if options.pop("ranks", 1) > 1:
        from gdswriter.distributed import DistOptions
        dist_options = DistOptions(timeout_s=RANK_TIMEOUT_S)
    ck = GDSCheckpointer(net, None, roots, state={"progress": extra}, dist_options=dist_options,
                         options=M.small_options(engine=engine, **options))
    progress("opened")
    for action in actions:
        if rank and action[0].startswith("export"):
            continue
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
        elif action[0] == "export-hf":  # a from_pretrained directory (config.json + model.safetensors)
            step = action[1]
            config = os.path.join(workdir, "config.json")
            with open(config, "w") as f:
                json.dump(HF_CONFIG, f)
            export_step(roots, step, "hf", os.path.join(os.path.dirname(roots[0]), EXPORT_DIR, hf_export_name(step)),
                        config=config)
            progress(f"exported-hf {step}")
        else:
            raise ValueError(f"unknown action {action!r}")
    ck.close()
    progress("closed")


def dcp_state(net: nn.Module, extra: dict) -> dict:
    """What a DCP job saves: the model, and the extra state with its generation as a tensor."""
    return {"model": net.state_dict(), "progress": {"gen": torch.tensor(extra["gen"]), "ema": extra["ema"]}}


def _run_dcp(roots: list[str], actions: list[list], options: dict, engine, progress, rank: int) -> None:
    """The saves through torch.distributed.checkpoint and one GDSStorageWriter, ``checkpoint_id``
    the step: rank r's root is ``roots[r]`` (node-local roots: rank 1 leads its own secondary
    root, and re-saving a committed step writes beside it there)."""
    import torch.distributed.checkpoint as dcp
    from support import models as M

    from gdswriter.distributed import DistOptions, GDSStorageWriter, dcp_errors

    net, extra = make_net(), {}
    options.pop("ranks", None)
    w = GDSStorageWriter([roots[rank]], options=M.small_options(engine=engine, **options),
                         dist_options=DistOptions(timeout_s=RANK_TIMEOUT_S))
    progress("opened")
    for action in actions:
        if action[0] != "save":
            raise ValueError(f"unknown DCP action {action!r}")
        _, step, gen = action
        fill(net, extra, gen)
        with dcp_errors():
            dcp.save(dcp_state(net, extra), checkpoint_id=step, storage_writer=w)
        progress(f"saved {step} {gen}")
    w.close()
    progress("closed")


RANK_TIMEOUT_S = 20  # a collective whose peer is stuck fails after this (a dead peer fails it at once)


def _join_group(job: dict) -> tuple[int, list[int] | None]:
    """For a job of ``options["ranks"]`` ranks: fork the other ranks and join them in a gloo
    process group (its store is a file next to the progress file, outside the mount). Returns
    (this process's rank, None) in the forked ranks, (0, pids of the others) in rank 0."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    world = job.get("options", {}).get("ranks", 1)
    if world == 1:
        return 0, None
    rank, peers = 0, []
    for r in range(1, world):
        pid = os.fork()
        if pid == 0:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # die with rank 0
            rank, peers = r, []
            break
        peers.append(pid)
    store = dist.FileStore(job["progress"] + ".store", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=RANK_TIMEOUT_S))
    return rank, peers if rank == 0 else None


def _child(job: dict) -> int:
    rank, peers = _join_group(job)
    path = job["progress"] + (f".rank{rank}" if rank else "")
    with open(path, "a", buffering=1) as out:
        os.dup2(out.fileno(), 2)  # gdswriter's warnings and tracebacks go to the progress file too

        def progress(line: str) -> None:
            out.write(line + "\n")
            out.flush()

        code = 1
        try:
            run_actions(job["roots"], job["actions"], dict(job.get("options", {})), progress,
                        os.path.dirname(job["progress"]), rank)
            code = 0
        except BaseException as e:
            progress(f"error {type(e).__name__}: {e}".replace("\n", " "))
            traceback.print_exc()
        if rank == 0:  # a job ends when its every rank has: none may touch the next run's mount
            for pid in peers or ():
                if code:
                    os.kill(pid, 9)
                _, status = os.waitpid(pid, 0)
                if os.waitstatus_to_exitcode(status) != 0 and code == 0:
                    progress(f"error rank {peers.index(pid) + 1} exited with {os.waitstatus_to_exitcode(status)}")
                    code = 1
        return code


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
