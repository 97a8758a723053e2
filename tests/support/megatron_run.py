"""What the Megatron-Core tests share (tests/test_integrations_megatron*.py): Megatron's async
caller without its CUDA calls, and an engine that dies after its first file."""

from __future__ import annotations

import os
import signal
import time

from tests.support.engines import HookedWrites


class ForkedCaller:
    """What Megatron's TemporalAsyncCaller does with an AsyncRequest (fork a process running its
    async_fn; once it is done on every rank, run the finalize functions), without its CUDA
    calls (torch.cuda.synchronize, a CUDA tensor for the all-reduce), which fail on a CPU torch."""

    def __init__(self, request):
        import multiprocessing as mp

        self.request = request
        self.process = mp.get_context("fork").Process(target=request.async_fn, args=request.async_fn_args)
        self.process.start()

    def finalize(self) -> None:
        import torch.distributed as dist

        self.process.join(60)
        assert self.process.exitcode == 0, f"the async worker: exit code {self.process.exitcode}"
        dist.barrier()
        for fn in self.request.finalize_fns:
            fn()


class KillAfterFirstFile(HookedWrites):
    """support/engines.py's HookedWrites around an engine already made: the first file is
    written, then the process holds ``hold_s`` (so that a commit not waiting for the writes
    would land) and dies of SIGKILL."""

    def __init__(self, inner, hold_s: float = 2.0):
        super().__init__(inner=inner)
        self.hold_s = hold_s

    def after(self, path) -> None:
        time.sleep(self.hold_s)
        os.kill(os.getpid(), signal.SIGKILL)
