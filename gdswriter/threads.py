"""Threads that saving and loading share: ``run_per_file`` runs one piece of I/O work per
file (or per root), in parallel threads where the files are on different engines;
``gc_paused`` holds off automatic garbage collection while a save thread builds many objects.

Below save/ and load/, which both use it: it imports nothing from gdswriter.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager


def run_per_file(fn, file_ids: Sequence[int], parallel: int) -> list:
    """Run ``fn`` for each file; files on different engines run in parallel threads."""
    if parallel <= 1 or len(file_ids) <= 1:
        return [fn(f) for f in file_ids]
    with ThreadPoolExecutor(max_workers=min(parallel, len(file_ids)), thread_name_prefix="gdswriter-file") as ex:
        return list(ex.map(fn, file_ids))


_gc_lock = threading.Lock()
_gc_pauses = 0  # gc_paused blocks running now, in any thread
_gc_resume = False  # whether automatic collection was on when the first of them began
_gc_own = threading.local()  # .depth: this thread's gc_paused blocks running now


@contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection held off while the block runs. Process-wide: the other
    threads get none meanwhile either, so only around work that makes many objects without
    cycles and is done in seconds (the checkpointer: a save of 8,192 tensors or more). Why: a
    save of 100,000 tensors makes several objects per tensor (extents, records, the encoded
    tree) that live until it ends, and CPython runs a full collection of the whole heap each
    time the long-lived objects grew by a quarter: 5 per save there, most of the save's time.
    Paused, they are freed by reference counting when the save ends, before any collection
    looks at them. Nested and concurrent pauses (several checkpointers) resume collection
    when the last one ends, and only if it was on when the first began. A forked child keeps
    only the forking thread's pauses (_gc_after_fork_in_child)."""
    global _gc_pauses, _gc_resume
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
        _gc_own.depth = getattr(_gc_own, "depth", 0) + 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_own.depth -= 1
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_resume:
                gc.enable()


def _gc_after_fork_in_child() -> None:
    """In a forked child only the forking thread lives on: the pauses other threads held (a
    background save's manifest, say) would never end there, and collection would stay off
    for the child's life (a DataLoader worker forked meanwhile: cyclic garbage never freed).
    The child keeps the forking thread's own pauses and resumes collection when they end, at
    once if it has none; its lock is new (another thread may have held the parent's)."""
    global _gc_lock, _gc_pauses
    _gc_lock = threading.Lock()
    own = getattr(_gc_own, "depth", 0)
    ended, _gc_pauses = _gc_pauses > own, own  # (none held: collection as the user left it)
    if ended and own == 0 and _gc_resume:
        gc.enable()


os.register_at_fork(after_in_child=_gc_after_fork_in_child)
