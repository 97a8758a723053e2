"""Review (tenth session): automatic garbage collection in a process forked while another
thread of its parent held it off (threads.gc_paused: the save thread's manifest and pool
layout, a load). The pausing thread does not exist in the child, so its pause never ends
there: a DataLoader worker forked while a background save built its manifest ran with
collection off for its whole life (cyclic garbage never freed). A real fork, checked in the
child: collection is on again, and a pause of the child's own ends as usual."""

from __future__ import annotations

import gc
import json
import os
import threading

from gdswriter.threads import gc_paused


def _fork_and_report() -> dict:
    """Fork; the child reports whether collection is on, and again after a pause of its own."""
    r, w = os.pipe()
    pid = os.fork()

    def report() -> dict:  # in the child: no other thread exists there
        first = gc.isenabled()
        with gc_paused():
            inside = gc.isenabled()
        return {"on": first, "inside": inside, "after": gc.isenabled()}

    return _child_says(pid, r, w, report)


def _child_says(pid: int, r: int, w: int, report) -> dict:
    """After os.fork over pipe (r, w): the child (pid 0) writes ``report()`` and exits; the
    parent returns what it wrote, once it exited cleanly."""
    if pid == 0:
        try:
            os.write(w, json.dumps(report()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0
    return json.loads(data)


def test_a_child_forked_while_another_thread_paused_collection_collects_again():
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def save_thread() -> None:
        with gc_paused():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=save_thread)
    t.start()
    try:
        assert entered.wait(30)
        assert not gc.isenabled()  # the parent's pause holds
        got = _fork_and_report()
    finally:
        leave.set()
        t.join()
    assert gc.isenabled()  # the parent's pause ended as before
    assert got == {"on": True, "inside": False, "after": True}, got


def test_a_child_forked_inside_its_own_threads_pause_resumes_when_that_pause_ends():
    """The forking thread's own pause goes on in the child (it is that thread there), and ends."""
    assert gc.isenabled()
    with gc_paused():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                paused = not gc.isenabled()
            finally:
                pass
    got = _child_says(pid, r, w, lambda: {"paused": paused, "after": gc.isenabled()})
    assert got == {"paused": True, "after": True}, got
    assert gc.isenabled()


def test_a_child_forked_with_no_pause_held_keeps_collection_as_the_user_set_it():
    """No pause held at the fork: the child's collection is what the parent's was (off here)."""
    with gc_paused():
        pass
    gc.disable()
    try:
        r, w = os.pipe()
        pid = os.fork()
        got = _child_says(pid, r, w, lambda: {"on": gc.isenabled()})
    finally:
        gc.enable()
    assert got == {"on": False}
