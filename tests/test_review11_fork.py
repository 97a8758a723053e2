"""Review (eleventh session): a child forked while a pool is locked ahead (engines/buffers.py).
The locker thread takes the pool's condition for every step it claims and every step it ends;
a fork at such a moment gave the child a condition held by a thread that does not exist there,
and the child's first wait_locked (a save through the pool in the child) waited for good. The
tenth session's test forked while the locker was inside a slow mlock (outside the condition),
so it never saw this. Real forks, many, while the locker loops over small steps."""

from __future__ import annotations

import os
import signal
import sys
import time

from gdswriter.engines.buffers import AlignedBufferPool


def test_children_forked_while_the_locker_runs_never_wait_for_its_condition(monkeypatch):
    import gdswriter.engines.buffers as buffers

    monkeypatch.setattr(buffers, "LOCK_AHEAD_STEP", 4096)  # a claim and an end under the condition per 4 KiB
    monkeypatch.setattr(buffers, "mlock", lambda address, n: 0)  # (the seam: the locking itself is not the point)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the locker runs between the forks, at any point of its loop
    pids = []
    try:
        with AlignedBufferPool(4 << 30, 1, lock_ahead=True, huge_pages=False) as pool:  # never touched
            while len(pids) < 16 and not pool.locked:
                pid = os.fork()
                if pid == 0:  # the child: exits 0 once wait_locked returned (unlocked: not inherited)
                    signal.alarm(20)
                    os._exit(0 if pool.wait_locked(4 << 30) is False else 1)
                pids.append(pid)
                time.sleep(0.002)
    finally:
        sys.setswitchinterval(interval)
    codes = []
    deadline = time.monotonic() + 30
    for pid in pids:
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        if done == (0, 0):
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(done[1]))
    assert len(pids) >= 4, "the locker ended before the children were forked: more steps needed"
    assert codes == [0] * len(pids), f"children that waited for good (killed by SIGALRM: -14): {codes}"
