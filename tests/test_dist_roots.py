"""Which directory is which root, on real ranks (gloo on CPU): node-local roots with rank 0
landing on the other node after a restart (the job must find its checkpoint there, and no
save may touch another primary's data), and a root copied with its identity marker (two
directories with one id must be refused before a step commits that could never load). The
last tests run in one process (solo coordinator): two roots given in another order, and a
primary step directory that is another primary's secondary data."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from support.ranks import caught, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TIMEOUT_S = 60.0


def _options():
    from support.models import small_options

    return small_options()


def _dist_options():
    from gdswriter.distributed import DistOptions

    return DistOptions(timeout_s=TIMEOUT_S)


def _model(seed: int):
    # 512x1024 float32 = 2 MiB: above every small-copy threshold, split over both ranks' files
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))



def _same(model, seed: int) -> bool:
    ref = _model(seed)
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def _tree(root: Path) -> list[str]:
    """Every step entry under ``root`` with its size: what a save must not change."""
    return sorted(f"{p.relative_to(root)}:{p.stat().st_size if p.is_file() else 'd'}" for p in root.rglob("*")
                  if "step_" in str(p.relative_to(root)))


# ----------------------------------------------------------------------------- 1. rank 0 on the other node
def _swap_worker(rank: int, world: int, roots: list[str], job: str) -> dict:
    from gdswriter import GDSCheckpointer

    if job == "save":  # job 1: step 1 (seed 1), step 2 (seed 2)
        model = _model(1)
        with GDSCheckpointer(model, root=roots[rank], options=_options(), dist_options=_dist_options()) as ck:
            ck.save(1)
            model.load_state_dict(_model(2).state_dict())
            ck.save(2)
        return {}
    if job == "refused":
        out = {"open": caught(lambda: GDSCheckpointer(_model(0), root=roots[rank], options=_options(),
                                                       dist_options=_dist_options()).close())}
        return out
    if job == "foreign":  # re-save step 2 where a secondary step_2 is another checkpoint's
        model = _model(3)
        with GDSCheckpointer(model, root=roots[rank], options=_options(), dist_options=_dist_options()) as ck:
            return {"resave": caught(lambda: ck.save(2)), "steps": ck.steps()}
    # job 2: restarted with rank 0 on the node that was rank 1's
    model = _model(0)
    ck = GDSCheckpointer(model, root=roots[rank], options=_options(), dist_options=_dist_options())
    out = {"latest": ck.latest_step(), "steps": ck.steps()}
    out["loaded"] = ck.load()
    out["equal2"] = _same(model, 2)
    model.load_state_dict(_model(3).state_dict())
    out["resave"] = caught(lambda: ck.save(2))  # a step the old run also saved
    model.load_state_dict(_model(4).state_dict())
    out["save4"] = caught(lambda: ck.save(4))
    out["after"] = ck.steps()
    ck.options = replace(ck.options, keep_last=3)  # retention runs on the primary's rank
    model.load_state_dict(_model(5).state_dict())
    out["save5"] = caught(lambda: ck.save(5))
    out["kept"] = ck.steps()
    ck.close()
    return out


def test_restart_with_rank_0_on_the_other_node_finds_the_checkpoint(tmp_path):
    """Node-local roots: job 1 saved with rank 0 on node 0; the restart puts rank 0 on node 1,
    whose root holds only node 0's secondary step directories. Before: no rank saw a checkpoint
    (latest_step() None, the job started from scratch), and re-saving step 2 retired node 1's
    secondary step_2 before failing with EEXIST on node 0, so step 2 never loaded again. Now
    the root holding the manifests is the primary whichever rank has it: the job loads step 2,
    re-saves it, saves steps 4 and 5 there (retention dropping step 1 on both nodes), and the
    roots in their original order load every step."""
    from gdswriter import GDSCheckpointer

    n0, n1 = tmp_path / "node0" / "ckpts", tmp_path / "node1" / "ckpts"
    run_ranks(2, _swap_worker, [str(n0), str(n1)], "save", out=tmp_path / "job1")
    res = run_ranks(2, _swap_worker, [str(n1), str(n0)], "resume", out=tmp_path / "job2")
    for x in res:
        assert x["latest"] == 2 and x["steps"] == [1, 2], x
        assert x["loaded"] == 2 and x["equal2"], x
        assert x["resave"] is None and x["save4"] is None and x["save5"] is None, x
        assert x["after"] == [1, 2, 4] and x["kept"] == [2, 4, 5], x
    for root in (n0, n1):  # step 1 retired on both nodes
        assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == [f"step_{s:012d}" for s in (2, 4, 5)]
        assert not [n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-"))]
    for step, seed in ((2, 3), (4, 4), (5, 5)):  # node 0's root is still the primary, whole
        model = _model(0)
        with GDSCheckpointer(model, root=[n0, n1], options=_options()) as ck:
            assert ck.steps() == [2, 4, 5] and ck.load(step) == step
        assert _same(model, seed), step


def test_rank_0_on_a_node_without_the_primary_refuses_and_changes_nothing(tmp_path):
    """Rank 0 now has node 1's root (node 0's secondary steps only) and node 0 is not in the job:
    before, the job started from scratch and its save of step 2 retired node 0's secondary
    step_2 on that root. Every rank must refuse to open (RootUnavailableError naming the other
    primary's id), before any root is changed."""
    from gdswriter.distributed.roots import root_identity

    n0, n1, n2 = (tmp_path / f"node{r}" / "ckpts" for r in range(3))
    run_ranks(2, _swap_worker, [str(n0), str(n1)], "save", out=tmp_path / "job1")
    before = _tree(n1)
    res = run_ranks(2, _swap_worker, [str(n1), str(n2)], "refused", out=tmp_path / "job2")
    r0, r1 = res[0]["open"], res[1]["open"]
    assert r0 and r0[0] == "RootUnavailableError", res
    assert root_identity(n0, create=False) in r0[1] and "rank 0 is probably on another node" in r0[1], r0
    assert r1 and r1[0] == "RankFailedError" and "rank 0: RootUnavailableError" in r1[1], r1
    assert _tree(n1) == before


def test_resaving_a_step_whose_secondary_is_another_checkpoints_keeps_the_committed_step(tmp_path):
    """Node 1's step_2 is another checkpoint's (it names another primary id). Re-saving step 2
    un-committed node 0's step_2 first and only then met node 1's directory (EEXIST): the
    committed step 2 was gone. The secondary must be checked before the vote un-commits."""
    from gdswriter import GDSCheckpointer

    n0, n1 = tmp_path / "node0" / "ckpts", tmp_path / "node1" / "ckpts"
    run_ranks(2, _swap_worker, [str(n0), str(n1)], "save", out=tmp_path / "job1")
    owner = n1 / "step_000000000002" / "primary-id"
    owner.write_text("f" * 32 + "\n")  # another checkpoint's step 2 on that root
    before = _tree(n0), _tree(n1)
    res = run_ranks(2, _swap_worker, [str(n0), str(n1)], "foreign", out=tmp_path / "job2")
    assert res[0]["steps"] == res[1]["steps"] == [1, 2], res
    assert (_tree(n0), _tree(n1)) == before
    r0, r1 = res[0]["resave"], res[1]["resave"]
    assert r1 and r1[0] == "EngineIOError" and "another checkpoint" in r1[1] and "nothing was changed" in r1[1], res
    assert r0 and r0[0] == "RankFailedError" and "rank 1: EngineIOError" in r0[1], r0
    owner.write_text(Path(n0, ".gdswriter-root").read_text().split('"id":"')[1][:32] + "\n")
    model = _model(0)
    with GDSCheckpointer(model, root=[n0, n1], options=_options()) as ck:
        assert ck.load(2) == 2
    assert _same(model, 2)


def _dcp_worker(rank: int, world: int, roots: list[str], save: bool) -> dict:
    import torch.distributed.checkpoint as dcp

    from support.models import small_engine
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageWriter

    sd = {"rep": torch.arange(300_000.0)}  # 1.2 MB
    writer = GDSStorageWriter(roots[rank], 1 if save else 2, options=CheckpointOptions(engine=small_engine()),
                              dist_options=_dist_options())
    return {"save": caught(lambda: dcp.save(sd, storage_writer=writer))}


def test_dcp_save_with_rank_0_on_the_other_node_is_refused(tmp_path):
    """dcp.save commits on rank 0 (DCP's coordinator): with the primary's root on rank 1 now, it
    must refuse before anything is written (before: it started a new checkpoint on node 1)."""
    n0, n1 = tmp_path / "node0" / "ckpts", tmp_path / "node1" / "ckpts"
    assert run_ranks(2, _dcp_worker, [str(n0), str(n1)], True, out=tmp_path / "job1") == [{"save": None}] * 2
    before = _tree(n0), _tree(n1)
    res = run_ranks(2, _dcp_worker, [str(n1), str(n0)], False, out=tmp_path / "job2")
    for x in res:
        assert x["save"] and "RootUnavailableError" in x["save"][1] and "dcp.save commits on rank 0" in x["save"][1], x
    assert (_tree(n0), _tree(n1)) == before


def _dcp_load_worker(rank: int, world: int, roots: list[str]) -> dict:
    import torch.distributed.checkpoint as dcp

    from support.models import small_engine
    from gdswriter.distributed import GDSStorageReader

    sd = {"rep": torch.zeros(300_000)}
    reader = GDSStorageReader(roots[rank], engine_options=small_engine(), dist_options=_dist_options())
    error = caught(lambda: dcp.load(sd, storage_reader=reader))
    return {"load": error, "same": error is None and torch.equal(sd["rep"], torch.arange(300_000.0))}


def test_dcp_load_with_rank_0_on_the_other_node_finds_the_checkpoint(tmp_path):
    """dcp.load reads the manifest through the rank that holds the primary root, as
    GDSCheckpointer does (before: rank 0 looked only at its own root and found no checkpoint)."""
    n0, n1 = tmp_path / "node0" / "ckpts", tmp_path / "node1" / "ckpts"
    assert run_ranks(2, _dcp_worker, [str(n0), str(n1)], True, out=tmp_path / "job1") == [{"save": None}] * 2
    before = _tree(n0), _tree(n1)
    res = run_ranks(2, _dcp_load_worker, [str(n1), str(n0)], out=tmp_path / "job2")
    assert res == [{"load": None, "same": True}] * 2, res
    assert (_tree(n0), _tree(n1)) == before


# ----------------------------------------------------------------------------- 2. a root copied with its marker
def _copied_worker(rank: int, world: int, roots: list[str]) -> dict:
    from gdswriter import GDSCheckpointer

    model = _model(1)
    ck = GDSCheckpointer(model, root=roots[rank], options=_options(), dist_options=_dist_options())
    out = {"save": caught(lambda: ck.save(1)), "steps": ck.steps()}
    ck.close()
    return out


def test_a_root_copied_with_its_marker_is_refused_before_a_step_commits(tmp_path):
    """Node 1's root is a copy of node 0's (rsync -a, a machine image): one id, two directories.
    Before: the ranks took them for one shared root, rank 1's files stayed in a temporary
    directory nobody renamed, and step 1 committed on every rank but could never load. Now
    every rank refuses the save before writing: rank 1 says the two roots carry one id and how
    to give the copy its own; nothing is committed or left behind."""
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed.roots import root_identity

    n0, n1 = tmp_path / "node0" / "ckpts", tmp_path / "node1" / "ckpts"
    n0.mkdir(parents=True)
    ident = root_identity(n0)
    shutil.copytree(n0, n1)  # keeps .gdswriter-root
    res = run_ranks(2, _copied_worker, [str(n0), str(n1)], out=tmp_path / "ranks")
    r0, r1 = res[0]["save"], res[1]["save"]
    assert r1 and r1[0] == "RootUnavailableError", res
    assert ident in r1[1] and "same identity" in r1[1] and str(n1) in r1[1] and "remove its .gdswriter-root" in r1[1]
    assert r0 and r0[0] == "RankFailedError" and "rank 1: RootUnavailableError" in r0[1], r0
    assert res[0]["steps"] == res[1]["steps"] == []
    for root in (n0, n1):
        assert not [n for n in os.listdir(root) if n.startswith(("step_", ".tmp-"))], os.listdir(root)
    with GDSCheckpointer(_model(0), root=n0, options=_options()) as ck:
        assert ck.steps() == []


# ----------------------------------------------------------------------------- one process, two roots (solo coordinator)
def _session(roots):
    from gdswriter.distributed import DistOptions, open_session
    from gdswriter.distributed.group import Coordinator

    for r in roots:
        Path(r).mkdir(parents=True, exist_ok=True)
    return open_session([Path(r) for r in roots], Coordinator.solo(), DistOptions(), movable_primary=True)


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(600, 500)}}  # 1.2 MB


def _save(session, step: int, seed: int) -> None:
    from gdswriter.engines.select import create_engine
    from gdswriter.save.snapshot import take_snapshot
    from support.models import small_engine

    engines = [create_engine(small_engine()) for _ in range(2)]
    try:
        state, found = session.prepare(_state(seed), step)
        session.write_and_commit(take_snapshot(state, step, prepared=found), engines, 1)
    finally:
        for e in engines:
            e.close()


def test_roots_given_in_another_order_keep_their_primary(tmp_path):
    """One rank, two roots passed the other way round: the root holding the manifests stays the
    primary (before: the first root was taken for it, and no step was found)."""
    from gdswriter.distributed.roots import root_identity
    from gdswriter.engines.select import create_engine
    from gdswriter.load.apply import LiveState
    from support.models import small_engine

    a, b = tmp_path / "a", tmp_path / "b"
    s = _session([a, b])
    _save(s, 1, 1)
    s.lock.release()
    s = _session([b, a])
    assert s.protocol.committed_steps() == [1] and s.protocol.latest() == 1 and s.layout.table[0].path == str(a)
    _save(s, 2, 2)
    assert (a / "step_000000000002" / "manifest.json").is_file() and (a / "latest").read_text() == "2\n"
    assert (b / "step_000000000002" / "primary-id").read_text() == f"{root_identity(a)}\n"
    live = {"w": torch.zeros(600, 500)}
    with create_engine(small_engine()) as engine:
        assert s.load(LiveState(live, None, {}), lambda: {"model": live}, 1, lambda: [engine], strict=False,
                      verify=True).step == 1
    assert torch.equal(live["w"], _state(1)["model"]["w"])
    s.lock.release()


def test_a_primary_step_that_is_another_primarys_secondary_is_never_removed(tmp_path):
    """The primary holds step_5 without a manifest that names another primary (its secondary
    data). Saving step 5 un-committed it, that is deleted it, before: it must be refused."""
    from gdswriter.errors import EngineIOError
    from gdswriter.format.commit import OWNER_ID_NAME, OWNER_NAME

    a, b = tmp_path / "a", tmp_path / "b"
    s = _session([a, b])
    _save(s, 1, 1)
    foreign = a / "step_000000000005"
    foreign.mkdir()
    (foreign / OWNER_NAME).write_text("/elsewhere/ckpts\n")
    (foreign / OWNER_ID_NAME).write_text("f" * 32 + "\n")
    (foreign / "data-rank0-r1-f0.bin").write_bytes(b"x" * 5000)
    before = _tree(a), _tree(b)
    with pytest.raises(EngineIOError, match="secondary data of another primary root"):
        _save(s, 5, 5)
    assert (_tree(a), _tree(b)) == before and s.protocol.committed_steps() == [1]
    s.lock.release()
