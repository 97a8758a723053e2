"""A rank that never reaches write_data (it failed before, in DCP's own planner) while the others
wrote their part (issue 39 item 6; dcp_replicas.py ``missed``): its next save answers the first
round of that save's replication, so the others' replication ends with ReplicationError (not
when the channel times out, which stopped every later step's copies), and the replication's
rounds stay in step: the next step written on every rank is protected on every rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.dcp import dcp_state, node_writer
from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from gdswriter.errors import ReplicationError

    class Failing(DefaultSavePlanner):  # rank 1's planner fails after the plans, before write_data
        def finish_plan(self, new_plan):
            raise RuntimeError("the planner failed")

    w = node_writer(rank, Path(tmp, f"node{rank}"), replicas=2, timeout_s=20.0)
    out: dict = {"failed": False, "errors": [], "protected": []}
    for step in range(4):
        w.reset(step)
        try:
            dcp.save(dcp_state(500, step), storage_writer=w,
                     planner=Failing() if rank == 1 and step == 1 else None)
        except CheckpointException as e:
            out["failed"] = True
            out[f"error{step}"] = str(e)[-1500:]
        t0 = time.monotonic()
        for _ in range(3):  # each ReplicationError raised once
            try:
                out["protected"].append(w.wait_protected(60))
                break
            except ReplicationError as e:
                out["errors"].append(str(e))
        out[f"waited{step}"] = time.monotonic() - t0
    w.close()
    return out


def test_a_rank_failing_before_write_data_does_not_stop_the_replication(tmp_path):
    """Step 1's save fails on rank 1 in DCP's planner (it never reaches write_data), rank 0 wrote
    its part: rank 0's replication of step 1 ends at rank 1's next save with 'not written on
    every rank'; step 2 fails on every rank before write_data (by design: the ranks disagree on
    keeping their roots, dcp_writer.py ``_session_for``); step 3 is protected on both ranks, at
    once. Without rank 1's answer the ranks' rounds fell out of step: rank 1 took step 3's round
    for step 1's ('internal'), rank 0 waited for the channel's timeout, replication stopped."""
    got = run_ranks(2, _worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(got):
        assert x["failed"] and "error1" in x and "error2" in x and "error3" not in x, (rank, x)
        assert x["protected"][0] == 0 and x["protected"][-1] == 3, (rank, x)
        assert not [e for e in x["errors"] if "stops" in e or "stopped" in e or "internal" in e], (rank, x)
        assert x["waited3"] < 15, (rank, x)
    assert any("not written on every rank" in e for e in got[0]["errors"]), got
