"""The engine shelf the integrations share (gdswriter/integrations/engines.py), with real engines:
engines handed back are lent again, at most ``max_idle`` of a kind stay idle (the others are
closed), a handed-back lease refuses to work, and a forked child starts with an empty shelf."""

from __future__ import annotations

import os

import pytest
import torch

from gdswriter.engines.base import WriteSpan
from gdswriter.errors import GDSWriterError
from gdswriter.integrations.engines import EngineShelf


def test_engines_handed_back_are_lent_again_and_idle_ones_are_bounded(tmp_path, io_small_options):
    opts = io_small_options()
    closed: list = []

    def factory(o):
        from gdswriter.engines.select import create_engine

        e = create_engine(o)
        real_close = e.close
        e.close = lambda: (closed.append(e), real_close())  # to see which ones the shelf closes
        return e

    shelf = EngineShelf(max_idle=2)
    first = shelf.lease(opts, 3, factory)
    assert shelf.made == 3
    data = torch.arange(8192, dtype=torch.int32).view(torch.uint8)
    first[0].write_file(tmp_path / "f", [WriteSpan(0, data)])
    assert (tmp_path / "f").read_bytes() == data.numpy().tobytes()
    inner = [e.engine for e in first]
    for e in first:
        e.close()
        e.close()  # idempotent: handed back once
    assert shelf.idle() == 2 and closed == [inner[2]]  # the third did not fit: closed
    with pytest.raises(GDSWriterError, match="handed back"):
        first[0].write_file(tmp_path / "g", [WriteSpan(0, data)])
    again = shelf.lease(opts, 2, factory)
    assert shelf.made == 3 and {id(e.engine) for e in again} == {id(inner[0]), id(inner[1])}
    other = shelf.lease(io_small_options(num_buffers=4), 1, factory)  # another kind: a new engine
    assert shelf.made == 4
    for e in again + other:
        e.close()
    shelf.clear()
    assert shelf.idle() == 0 and len(closed) == 4


def test_a_forked_child_starts_with_an_empty_shelf(io_small_options):
    from gdswriter.integrations.engines import ENGINES

    for e in ENGINES.lease(io_small_options(), 1):
        e.close()
    assert ENGINES.idle() >= 1
    pid = os.fork()
    if pid == 0:
        os._exit(0 if ENGINES.idle() == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    ENGINES.clear()
