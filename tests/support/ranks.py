"""Running a function on N real ranks: spawned processes joined by torch.distributed (gloo on
127.0.0.1). Used by the test_dist*.py files and tests/test_dist_harness.py checks it.

``fn`` must be importable in the spawned process (a module-level function of a test module or
of this package): spawn pickles it by name, and the children inherit the parent's sys.path."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any
from collections.abc import Callable


RANK_TIMEOUT_S = 240  # a whole multi-rank scenario; a hang fails the test instead of blocking CI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, out: str, args: tuple) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        result = fn(rank, world, *args)
        Path(out, f"result-{rank}.json").write_text(json.dumps(result))
    except BaseException:  # noqa: BLE001 - the parent reports it
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: a peer may be gone on purpose (the SIGKILL tests)


def run_ranks(world: int, fn: Callable, *args: Any, out: Path, killed: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes; returns each rank's (JSON)
    result, None for the ranks in ``killed`` (which must die of SIGKILL)."""
    import multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("result-*.json"):
        p.unlink()
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(out), args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(RANK_TIMEOUT_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {r: (out / f"error-{r}.txt").read_text() for r in range(world) if (out / f"error-{r}.txt").exists()}
    assert not hung, f"ranks {hung} hung; errors: {errors}"
    assert not errors, "\n".join(f"--- rank {r} ---\n{t}" for r, t in errors.items())
    codes = [p.exitcode for p in procs]
    assert codes == [-9 if r in killed else 0 for r in range(world)], codes
    return [None if r in killed else json.loads((out / f"result-{r}.json").read_text()) for r in range(world)]


def caught(fn: Callable[[], Any]) -> list[str] | None:
    """[type name, message] of what ``fn`` raised (DCP raises a BaseException), None if nothing:
    what a rank reports back to the test."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test looks at what each rank got
        return [type(e).__name__, str(e)]
    return None


class WarningLines(logging.Handler):
    """The messages of the warnings logged while it is attached (``logging.getLogger().addHandler``),
    in ``lines``: what a rank said to its user, for the test to check."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
