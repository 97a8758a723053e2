"""The root lock and processes that share its descriptor (gdswriter/format/commit.py RootLock):
a persistent DataLoader worker forked while a checkpointer holds the root, and a process that
inherited the lock's descriptor without Python's fork hooks, must not keep the root locked
after the checkpointer closed."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from support.models import small_options
from gdswriter import GDSCheckpointer, load_state
from gdswriter.format.commit import LOCK_NAME


def _lock_fds(lock_path: str) -> list[int]:
    """This process's descriptors open on ``lock_path``."""
    held = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == lock_path:
                held.append(int(name))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return held


class _Probe(Dataset):
    """Each item: the worker's pid and how many descriptors of the root's lock it holds."""

    def __init__(self, lock_path: str):
        self.lock_path = lock_path

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([os.getpid(), len(_lock_fds(self.lock_path))])


def test_reopen_while_a_persistent_forked_dataloader_worker_lives(tmp_path):
    lock_path = os.path.realpath(tmp_path / LOCK_NAME)
    state = {"w": torch.arange(2**19, dtype=torch.float32)}  # 2 MiB
    ck = GDSCheckpointer(state, None, tmp_path, options=small_options())
    ck.save(1)
    assert _lock_fds(lock_path), "the checkpointer holds the lock"
    loader = DataLoader(_Probe(lock_path), batch_size=None, num_workers=1, persistent_workers=True,
                        multiprocessing_context="fork")
    try:
        first = [b.tolist() for b in loader]  # the worker is forked now, while the root is locked
        worker = first[0][0]
        assert worker != os.getpid()
        ck.close()
        os.kill(worker, 0)  # the persistent worker is still alive
        state["w"].add_(1)
        with GDSCheckpointer(state, None, tmp_path, options=small_options()) as again:  # no CheckpointLockedError
            again.save(2)
            assert again.steps() == [1, 2]
        second = [b.tolist() for b in loader]
        assert {pid for pid, _ in second} == {worker}, "the same worker served both epochs"
        assert [n for _, n in first + second] == [0] * 6, "the forked worker holds no descriptor of the lock"
    finally:
        del loader  # ends the worker
    assert torch.equal(load_state(tmp_path, 2)[1]["model"]["w"], state["w"])


def test_release_unlocks_while_another_process_holds_the_descriptor(tmp_path):
    """A process that got the lock's descriptor without Python's fork hooks (a C-level fork, a
    subprocess handed the descriptor) shares its flock: release unlocks it for every holder."""
    lock_path = os.path.realpath(tmp_path / LOCK_NAME)
    state = {"w": torch.ones(2**19)}
    ck = GDSCheckpointer(state, None, tmp_path, options=small_options())
    ck.save(1)
    (fd,) = _lock_fds(lock_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=(fd,))
    try:
        assert os.readlink(f"/proc/{holder.pid}/fd/{fd}") == lock_path, "the other process holds it too"
        ck.close()
        assert holder.poll() is None, "the other holder is still alive"
        with GDSCheckpointer(state, None, tmp_path, options=small_options()) as again:  # no CheckpointLockedError
            assert again.load() == 1
    finally:
        holder.communicate(b"", timeout=60)
    assert holder.returncode == 0
