"""The multi-rank harness (tests/support/ranks.py: spawned processes joined by
torch.distributed, gloo on 127.0.0.1) checked on its own."""

from __future__ import annotations

from support.ranks import run_ranks


def _echo(rank: int, world: int, word: str) -> dict:
    from gdswriter.distributed.group import Coordinator

    coord = Coordinator.for_group(timeout_s=30)
    return {"all": coord.all_gather([rank, word], "echo"), "root": coord.gather(rank * 10, "gather"),
            "bcast": coord.broadcast({"from": rank}, "bcast", src=world - 1)}


def test_harness_and_coordinator_collectives(tmp_path):
    res = run_ranks(3, _echo, "hi", out=tmp_path)
    assert [r["all"] for r in res] == [[[0, "hi"], [1, "hi"], [2, "hi"]]] * 3
    assert [r["root"] for r in res] == [[0, 10, 20], None, None]
    assert [r["bcast"] for r in res] == [{"from": 2}] * 3


