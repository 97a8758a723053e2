"""The drain's tests (issue 39 item 4): an engine whose reads wait at a gate, and a child
(``python -m support.drain ROOT_A ROOT_B DRAIN MARK``) that drains step 1, then dies of SIGKILL
in the middle of step 2's drain, once one of its two data files is copied into the drain
root's temporary directory (the parent kills it when MARK appears)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

from gdswriter import CheckpointOptions, EngineOptions, GDSCheckpointer, IOEngine, create_engine

MiB = 1 << 20


def state(step: int) -> dict:
    """Two 4 MiB tensors (above every small-copy threshold) whose values depend on ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"a": torch.randn(1 << 20, generator=g), "b": torch.randint(0, 1 << 30, (1 << 20,), generator=g)}


class GatedEngine(IOEngine):
    """A real engine whose ``read_file`` first calls ``before_read(n)`` (n: the reads so far,
    from 1) and waits at ``gate`` (an Event, open by default). Writes go straight through."""

    def __init__(self, before_read=None):
        self.inner = create_engine(EngineOptions(buffer_bytes=4 * MiB, num_buffers=2))
        self.gate = threading.Event()
        self.gate.set()
        self.reads = 0
        self.waiting = threading.Event()  # set while a read waits at the gate
        self.before_read = before_read

    @property
    def info(self):
        return self.inner.info

    def write_file(self, path, spans, *, size=None, durable=True):
        return self.inner.write_file(path, spans, size=size, durable=durable)

    def read_file(self, path, spans):
        self.reads += 1
        if self.before_read is not None:
            self.before_read(self.reads)
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait()
            self.waiting.clear()
        return self.inner.read_file(path, spans)

    def close(self):
        self.inner.close()



def drain_errors(wait_drained, *, signal_after_two: Path | None = None) -> list[str]:
    """The DrainErrors (as text) of a rank's waits for its drains: one wait; with
    ``signal_after_two``, two waits, then that file written (the other rank's held drain goes
    on), then the third."""
    from gdswriter.errors import DrainError

    errors: list[str] = []
    for k in range(3 if signal_after_two is not None else 1):
        if k == 2:
            signal_after_two.write_text("1")
        try:
            wait_drained()
        except DrainError as e:
            errors.append(str(e))
    return errors

def main(root_a: str, root_b: str, drain: str, mark: str) -> None:
    """Step 1 drained; step 2's drain stops for good after its first file (two roots: two files)."""
    crash = {"armed": False}

    def before_read(n: int) -> None:
        if crash["armed"] and crash.setdefault("first", n) != n:
            Path(mark).write_text("in drain\n")
            time.sleep(600)  # the parent kills this process now

    eng = GatedEngine(before_read)
    holder = dict(state(1))
    ck = GDSCheckpointer(holder, root=[root_a, root_b], options=CheckpointOptions(drain_root=drain),
                         drain_engine=eng)
    ck.save(1)
    assert ck.wait_drained() == 1
    crash["armed"] = True
    for k, v in state(2).items():
        holder[k].copy_(v)
    ck.save(2)
    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:5])
