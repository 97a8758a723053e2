"""Each GDSCheckpointer of a multi-rank job has its own coordination channel (gdswriter/distributed/group.py):
two checkpointers (training state and an EMA) saving concurrently on 2 real ranks, and checkpointers
constructed in a different order on the ranks (a clear error, not a hang)."""

from __future__ import annotations

import torch

from support.ranks import run_ranks

TIMEOUT_S = 20.0  # a collective that pairs up wrongly fails within this, not after the default 600 s


def _model():
    """The same model and optimizer on every rank (as DDP keeps them); every tensor > 1 MiB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.ReLU(), torch.nn.Linear(768, 384))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model, opt, seed: int) -> None:
    torch.manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 512)).sum().backward()
    opt.step()


def _snap(model, opt, ema) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        out.update({f"opt/{pid}/{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    out.update({f"ema/{k}": v.clone() for k, v in ema.items()})
    return out


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _two_checkpointers_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from support.models import small_options
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    created = []
    new_group = dist.new_group
    dist.new_group = lambda *a, **k: created.append(1) or new_group(*a, **k)  # gdswriter's calls, counted
    dist_options = DistOptions(timeout_s=TIMEOUT_S)
    model, opt = _model()
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(v.nbytes > 2**20 for k, v in ema.items() if k.endswith("weight"))
    # Constructed in the same order on every rank, as any process group.
    ck = GDSCheckpointer(model, opt, root=f"{root}/train", options=small_options(keep_last=3),
                         dist_options=dist_options)
    ema_ck = GDSCheckpointer(ema, None, root=f"{root}/ema", options=small_options(keep_last=3),
                             dist_options=dist_options)
    groups = [len(created)]
    expected = {}
    ema_handle = None
    for step in range(1, 6):
        _train(model, opt, step)  # waits for the previous training-state save to release the tensors
        if ema_handle is not None:
            ema_handle.wait_snapshotted()  # the EMA is updated outside optimizer.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].lerp_(v, 0.1)
        # Both save threads now run their collectives (votes, exchanges, commit, retention) at once.
        ck.save_async(step)
        ema_handle = ema_ck.save_async(step)
        expected[step] = _snap(model, opt, ema)
    ck.wait()
    ema_ck.wait()
    steps = [ck.steps(), ema_ck.steps()]
    groups.append(len(created))
    diffs = {}
    for step in (3, 5):
        _train(model, opt, 100 + step)
        for v in ema.values():
            v.zero_()
        loaded = [ck.load(step), ema_ck.load(step)]
        diffs[step] = [loaded, _diff(_snap(model, opt, ema), expected[step])]
    ck.close()
    ema_ck.close()
    # Another checkpointer after both closed: it takes a closed one's group, and works.
    with GDSCheckpointer(model, opt, root=f"{root}/train", options=small_options(),
                         dist_options=dist_options) as again:
        again.load(4)
    groups.append(len(created))
    diffs[4] = [4, _diff({k: v for k, v in _snap(model, opt, ema).items() if not k.startswith("ema/")},
                         {k: v for k, v in expected[4].items() if not k.startswith("ema/")})]
    return {"steps": steps, "groups": groups, "diffs": {str(k): v for k, v in diffs.items()}}


def test_two_checkpointers_save_async_concurrently_two_ranks(tmp_path):
    res = run_ranks(2, _two_checkpointers_worker, str(tmp_path), out=tmp_path / "ranks")
    for r in res:
        assert r["steps"] == [[3, 4, 5], [3, 4, 5]], r
        # one gloo group per checkpointer, made by its constructor (none per save); a closed
        # checkpointer's group is taken again by the next one
        assert r["groups"] == [2, 2, 2], r
        assert r["diffs"] == {"3": [[3, 3], []], "5": [[5, 5], []], "4": [4, []]}, r


def _swapped_worker(rank: int, world: int, root: str) -> dict:
    from support.models import small_options
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions
    from gdswriter import CollectiveMismatchError

    model, opt = _model()
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    order = [("train", model, opt), ("ema", ema, None)]
    if rank == 1:
        order.reverse()  # a program bug: the ranks construct their checkpointers in different orders
    name, m, o = order[0]
    try:
        GDSCheckpointer(m, o, root=f"{root}/{name}", options=small_options(),
                        dist_options=DistOptions(timeout_s=TIMEOUT_S))
    except CollectiveMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


def test_checkpointers_constructed_in_different_orders_fail_clearly(tmp_path):
    res = run_ranks(2, _swapped_worker, str(tmp_path), out=tmp_path / "ranks")
    for r in res:
        assert r["error"] is not None, "the mismatch must be detected"
        assert "same order on every rank" in r["error"], r
        assert "model, optimizer" in r["error"] and "model)" in r["error"], r
    assert not (tmp_path / "train").exists() and not (tmp_path / "ema").exists(), "nothing was created"


def _scatter_worker(rank: int, world: int) -> dict:
    from gdswriter.distributed.group import Coordinator

    coord = Coordinator.create(timeout_s=TIMEOUT_S, label="scatter")
    before = coord.stats.snapshot()
    parts = [{"rank": r, "pad": "x" * (10 * r)} for r in range(world)] if rank == 1 else None
    got = coord.scatter(parts, "scattering", src=1)
    after = coord.stats.snapshot()
    coord.close()
    return {"got": got, "received": after[1] - before[1]}


def test_scatter_gives_each_rank_its_own_message_padded_to_the_largest(tmp_path):
    res = run_ranks(3, _scatter_worker, out=tmp_path / "ranks")
    assert [x["got"] for x in res] == [{"rank": r, "pad": "x" * (10 * r)} for r in range(3)], res
    widest = len('{"rank":2,"pad":""}') + 20
    assert [x["received"] for x in res] == [8 + 8 + widest, 0, 8 + 8 + widest], res  # the width, a header, the part


def _decide_each_worker(rank: int, world: int) -> dict:
    from gdswriter.distributed.group import Coordinator
    from gdswriter.errors import RankFailedError

    coord = Coordinator.create(timeout_s=TIMEOUT_S, label="decide-each")
    got = coord.decide_each(None, rank * 10, "deciding", lambda outs: [sum(outs) + r for r in range(len(outs))],
                            root=1)
    failures = []
    for failing in (2, None):  # rank 2 fails; then the rule answers the wrong number of ranks
        try:
            coord.decide_each(RuntimeError("disk gone") if rank == failing else None, rank, "failing",
                              (lambda outs: [0] * len(outs)) if failing is not None else lambda outs: [0])
        except RankFailedError as e:
            failures.append(["RankFailedError", sorted(int(r) for r in e.failures)])
        except (RuntimeError, ValueError) as e:
            failures.append([type(e).__name__, str(e)])
    coord.close()
    return {"got": got, "failures": failures}


def test_decide_each_gives_each_rank_its_own_decision_and_raises_everywhere_on_a_failure(tmp_path):
    res = run_ranks(3, _decide_each_worker, out=tmp_path / "ranks")
    assert [x["got"] for x in res] == [30, 31, 32], res
    assert res[2]["failures"][0] == ["RuntimeError", "disk gone"], res
    assert all(x["failures"][0] == ["RankFailedError", [2]] for x in res[:2]), res
    assert res[0]["failures"][1][0] == "ValueError" and "1 decisions for 3 ranks" in res[0]["failures"][1][1], res
    assert all(x["failures"][1] == ["RankFailedError", [0]] for x in res[1:]), res
