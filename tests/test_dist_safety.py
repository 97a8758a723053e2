"""Safety of multi-rank saves and loads on real ranks (gloo on CPU), each test a defect that
lost or corrupted data or left ranks waiting: ranks out of step, node-local roots at one path
(cleaning another job's steps, reading another node's files from one's own disk), DTensors of
one name on different meshes, and a rank failing before a collective (every rank must raise a
typed error at once, not wait out the timeout)."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest
import torch

from support.steps import step_manifest
from support.ranks import caught, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TIMEOUT_S = 60.0  # a rank waiting this long is the defect these tests look for


def _options():
    from support.models import small_options

    return small_options()


def _dist_options():
    from gdswriter.distributed import DistOptions

    return DistOptions(timeout_s=TIMEOUT_S)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))



def _storage_bytes(root: Path, m, rec) -> bytes:
    """A tensor record's bytes, read from the data files as the manifest places them."""
    st = m.storages[rec.storage]
    buf = bytearray(st.nbytes)
    for c in st.chunks:
        f = m.files[c.file]
        with open(Path(m.dist.roots[f.root].path) / f"step_{m.step:012d}" / f.path, "rb") as fh:
            fh.seek(c.file_offset)
            buf[c.storage_offset:c.storage_offset + c.length] = fh.read(c.length)
    n = torch.Size(rec.shape).numel() * torch.empty(0, dtype=torch.float32).element_size()
    return bytes(buf[rec.byte_offset:rec.byte_offset + n])


# ----------------------------------------------------------------------------- 1. ranks out of step
def _out_of_step_worker(rank: int, world: int, roots: list[str]) -> dict:
    from gdswriter import GDSCheckpointer

    model = _model()
    ck = GDSCheckpointer(model, root=roots[rank], options=_options(), dist_options=_dist_options())
    ck.save(1)
    # as after a per-rank on_busy="skip", or a save_async that raised on one rank only
    raised = caught(lambda: ck.save(2 if rank == 0 else 3))
    after = ck.steps()
    ck.save(4)  # ranks that raised together are in step again
    result = {"raised": raised, "after": after, "steps": ck.steps()}
    ck.close()
    return result


def test_ranks_saving_different_steps_commit_nothing(tmp_path):
    """Collectives pair by order: rank 0's save of step 2 met rank 1's save of step 3, and rank 0
    committed a manifest naming files in directories that do not exist. Every rank must refuse."""
    roots = [str(tmp_path / f"node{r}") for r in range(2)]
    res = run_ranks(2, _out_of_step_worker, roots, out=tmp_path / "ranks")
    for x in res:
        assert x["raised"] is not None and x["raised"][0] == "RankFailedError", x
        assert "not saving the same step" in x["raised"][1] and "[2, 3]" in x["raised"][1], x
        assert x["after"] == [1] and x["steps"] == [1, 4], x
    for root in roots:
        names = os.listdir(root)
        assert not [n for n in names if n.startswith((".tmp-", "step_000000000002", "step_000000000003"))], names
    from gdswriter import GDSCheckpointer

    model = _model(seed=5)
    with GDSCheckpointer(model, root=roots, options=_options()) as ck:
        assert ck.load() == 4
    assert torch.equal(model[0].weight, _model()[0].weight)


# ----------------------------------------------------------------------------- 6. DTensors on different meshes
def _pp_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gdswriter import GDSCheckpointer

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    stage = mesh["dp"]  # this rank's pipeline stage: a mesh of its own
    w = DTensor.from_local(torch.full((4, 8), float(rank + 1)), stage, [Shard(0)], run_check=False)
    with GDSCheckpointer(root=root, state={"pp": {"w": w}}, options=_options(), dist_options=_dist_options()) as ck:
        ck.save(1)
    return {"mesh": stage.mesh.flatten().tolist()}


def test_dtensors_of_one_name_on_different_meshes_are_both_saved(tmp_path):
    """Two pipeline stages hold a DTensor of the same name and block on their own meshes: they
    are different data, so both must be written (keyed by name and block only, they merged and
    one stage's values were lost)."""

    root = tmp_path / "shared"
    res = run_ranks(2, _pp_worker, str(root), out=tmp_path / "ranks")
    assert [x["mesh"] for x in res] == [[0], [1]]
    m = step_manifest(root, 1)
    recs = [t for t in m.tensors if t.name == "extra/pp/w"]
    values = sorted(_storage_bytes(root, m, t) for t in recs)
    assert values == sorted(torch.full((4, 8), float(r + 1)).numpy().tobytes() for r in range(2)), len(recs)


# ----------------------------------------------------------------------------- 2. another primary at the same path
def _node_local_worker(rank: int, world: int, roots: list[str], save: bool) -> dict:
    from gdswriter import GDSCheckpointer
    from gdswriter.format.commit import RootLock

    model = _model()
    if save:
        with GDSCheckpointer(model, root=roots[rank], options=_options(), dist_options=_dist_options()) as ck:
            ck.save(1)
            ck.save(2)
        return {}

    def open_roots():
        GDSCheckpointer(model, root=roots[rank], options=_options(), dist_options=_dist_options()).close()

    raised = caught(open_roots)
    RootLock([Path(roots[rank])]).release()  # the failed open released its lock
    return {"raised": raised}


def test_restart_with_another_primary_at_the_same_path_cleans_nothing(tmp_path):
    """Node-local roots at one path: job 1 saved with rank 0 on node A; job 2 starts with rank 0 on
    node B, whose disk at that path has no step. Node C's secondary steps name the primary's path,
    which matches: cleaning them as leftovers deleted job 1's committed data. They name A's id,
    not B's, so every rank must refuse to open instead (and release its locks)."""
    from gdswriter import GDSCheckpointer

    a, c = tmp_path / "nodeA" / "ckpt", tmp_path / "nodeC" / "ckpt"
    roots = [str(a), str(c)]
    run_ranks(2, _node_local_worker, roots, True, out=tmp_path / "job1")
    before = sorted(p.relative_to(c) for p in c.rglob("*") if "step_" in str(p))
    (tmp_path / "nodeA").rename(tmp_path / "diskA")  # rank 0 now runs on node B: another disk at that path
    a.mkdir(parents=True)
    res = run_ranks(2, _node_local_worker, roots, False, out=tmp_path / "job2")
    assert sorted(p.relative_to(c) for p in c.rglob("*") if "step_" in str(p)) == before
    assert res[1]["raised"] and res[1]["raised"][0] == "RootUnavailableError" and "[1, 2]" in res[1]["raised"][1], res
    assert res[0]["raised"][0] == "RankFailedError" and "rank 1: RootUnavailableError" in res[0]["raised"][1], res
    assert sorted(p.relative_to(c) for p in c.rglob("*") if "step_" in str(p)) == before
    shutil.rmtree(tmp_path / "nodeA")
    (tmp_path / "diskA").rename(tmp_path / "nodeA")  # node A's disk back: job 1's steps load whole
    model = _model(seed=3)
    with GDSCheckpointer(model, root=roots, options=_options()) as ck:
        assert ck.steps() == [1, 2] and ck.load() == 2
    assert torch.equal(model[2].weight, _model()[2].weight)


# ----------------------------------------------------------------------------- 3. loading node-local roots at one path
def _dcp_node_worker(rank: int, world: int, tmp: str, roots: list[list[str]], save: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from support.models import small_engine
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(16 * 300.0).reshape(16, 300)
    if save:
        sd = {"dt": distribute_tensor(full, mesh, [Shard(0)]), "rep": torch.arange(3000.0)}
        dcp.save(sd, storage_writer=GDSStorageWriter(roots[rank][0], 5, options=CheckpointOptions(engine=small_engine()),
                                                     dist_options=_dist_options()))
        return {}
    back = {"dt": distribute_tensor(torch.zeros(16, 300), mesh, [Shard(0)]), "rep": torch.zeros(3000)}
    dcp.load(back, storage_reader=GDSStorageReader(roots[rank], 5, engine_options=small_engine(),
                                                   dist_options=_dist_options()))
    return {"ok": torch.equal(back["dt"].full_tensor(), full) and torch.equal(back["rep"], torch.arange(3000.0))}


def test_a_root_at_the_path_of_another_nodes_root_is_not_that_root(tmp_path):
    """Rank 1's root now sits at the path where the save's root #1 was, but it is another disk (its
    own id): rank 1 must not read root #1's files there (they are not there) but get them from
    rank 0, which has that disk under another path."""
    from gdswriter.distributed.roots import root_identity

    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    run_ranks(2, _dcp_node_worker, str(tmp_path), [[str(n0)], [str(n1)]], True, out=tmp_path / "save")
    n1.rename(tmp_path / "moved1")
    n1.mkdir()
    root_identity(n1)  # another disk, mounted where root #1 was
    res = run_ranks(2, _dcp_node_worker, str(tmp_path), [[str(n0), str(tmp_path / "moved1")], [str(n1)]], False,
                    out=tmp_path / "load")
    assert [x["ok"] for x in res] == [True, True]


def test_manifest_roots_match_by_path_only_without_an_id(tmp_path):
    from types import SimpleNamespace

    from gdswriter.distributed.fetch import manifest_reach
    from gdswriter.distributed.roots import RootLayout
    from gdswriter.format.manifest import RootInfo

    mine, unmarked = tmp_path / "mine", tmp_path / "unmarked"
    saved = (RootInfo("a" * 32, str(tmp_path / "p0"), (0,)), RootInfo("b" * 32, str(mine.resolve()), (1,)),
             RootInfo("c" * 32, str(unmarked.resolve()), (2,)), RootInfo("d" * 32, str(tmp_path / "p3"), (3,)))
    layout = RootLayout(0, 1, (), (mine, unmarked, tmp_path / "p3x"), ("e" * 32, f"path:{unmarked}", "d" * 32),
                        (0, 1, 2), str(mine))
    reach = manifest_reach(SimpleNamespace(dist=SimpleNamespace(roots=saved)), layout)
    # by id; by path only for the local root without an id; never by path to a root with another id
    assert reach.paths == (None, None, unmarked, tmp_path / "p3x")


# ----------------------------------------------------------------------------- 5. a rank failing before a collective
def _early_failure_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import gdswriter.distributed.dcp_reader as dcp_mod
    from support.models import small_engine
    from gdswriter import CheckpointOptions, GDSCheckpointer
    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter

    out: dict = {}
    good = str(Path(tmp, "good"))
    # a root that cannot be created, on one rank only (before: the others waited in the group's creation)
    bad = str(Path(tmp, "a-file", "ckpt")) if rank == 1 else good
    out["open"] = caught(lambda: GDSCheckpointer(_model(), root=bad, options=_options(),
                                                  dist_options=_dist_options()))
    # DCP's rank differs from the writer's group on one rank (before: the others waited in open_session);
    # set_up is local (no collective): DCP's plan gather carries rank 1's error to every rank
    from gdswriter.distributed import dcp_errors

    sd = {"rep": torch.arange(5000.0)}
    w = GDSStorageWriter(Path(tmp, "dcp"), options=CheckpointOptions(engine=small_engine()),
                         dist_options=_dist_options(), single_process=rank == 1)

    def mismatched() -> None:
        with dcp_errors():
            dcp.save(sd, storage_writer=w)

    out["set_up"] = caught(mismatched)
    out["set_up_tree"] = sorted(p.name for p in Path(tmp, "dcp").iterdir() if p.name.startswith(("step_", ".tmp")))
    w.close()
    w = GDSStorageWriter(Path(tmp, "dcp"), options=CheckpointOptions(engine=small_engine()),
                         dist_options=_dist_options())
    dcp.save(sd, storage_writer=w)  # the coordination group still works
    # the retention policy raising on rank 0 (before: the others waited for its broadcast)
    ck = GDSCheckpointer(_model(), root=good, options=_options(), dist_options=_dist_options())
    ck.save(1)
    ck.steps()  # waits for the save's own retention (a collective)

    def policy(steps, newest):
        raise ValueError("a broken retention policy")

    out["retention"] = caught(lambda: ck.session.apply_retention(1, policy))
    ck.save(2)
    out["steps"] = ck.steps()
    ck.close()
    # a rank that cannot allocate its read buffers (before: the others waited in fetch_storages)
    if rank == 1:
        def no_memory(nbytes):
            raise MemoryError(f"cannot allocate {nbytes} bytes")

        dcp_mod.host_buffer = no_memory
    back = {"rep": torch.zeros(5000)}
    out["read"] = caught(lambda: dcp.load(back, storage_reader=GDSStorageReader(  # atomic: through buffers
        Path(tmp, "dcp"), engine_options=small_engine(), dist_options=_dist_options(), atomic=True)))
    return out


def test_a_rank_failing_before_a_collective_fails_every_rank_at_once(tmp_path):
    """A rank that fails before a collective sends its error through it: every rank raises a typed
    error at once (RankFailedError naming it), none waits out the timeout (CollectiveFailedError),
    and the coordination group stays usable."""
    (tmp_path / "a-file").write_text("not a directory")
    res = run_ranks(2, _early_failure_worker, str(tmp_path), out=tmp_path / "ranks")
    r0, r1 = res
    assert r1["open"][0] == "InvalidOptionError" and "cannot create checkpoint root" in r1["open"][1], r1
    assert r0["open"][0] == "RankFailedError" and "rank 1: InvalidOptionError" in r0["open"][1], r0
    for x in res:
        assert x["set_up"][0] == "InvalidOptionError" and "DCP saves as rank 1" in x["set_up"][1], x
        assert x["set_up_tree"] == [], x
    assert r0["retention"][0] == "ValueError", r0
    assert r1["retention"][0] == "RankFailedError" and "rank 0: ValueError" in r1["retention"][1], r1
    assert r0["steps"] == r1["steps"] == [1, 2]
    for x in res:
        assert x["read"][0] == "CheckpointException" and "MemoryError" in x["read"][1], x
        assert "CollectiveFailedError" not in x["read"][1], x
    assert "RankFailedError" in r0["read"][1] and "rank 1: MemoryError" in r0["read"][1], r0


# ----------------------------------------------------------------------------- 7. DCP stops before finish
def test_a_dcp_save_that_never_finishes_releases_its_lock(tmp_path):
    """DCP calls nothing after a failure between write_data and finish: the coordinator's writer
    still holds the primary's lock. The next reset() or garbage collection must release it."""
    import torch.distributed.checkpoint as dcp

    from support.models import small_engine
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageWriter

    def writer(step):
        return GDSStorageWriter(tmp_path, step, options=CheckpointOptions(engine=small_engine()))

    def stopped(*a, **k):
        raise RuntimeError("DCP failed before finish")

    sd = {"w": torch.arange(100.0)}
    for release in ("reset", "gc"):
        w = writer(1)
        w.finish = stopped  # what DCP does when a rank fails after write_data: finish never runs
        assert "DCP failed before finish" in caught(lambda: dcp.save(sd, storage_writer=w, no_dist=True))[1]
        assert w._session is not None, "the save still holds the lock"
        if release == "reset":
            w.reset()
        else:
            del w
            gc.collect()
        dcp.save(sd, storage_writer=writer(2), no_dist=True)  # CheckpointLockedError while the lock is held
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_000000000002"]


# ----------------------------------------------------------------------------- 7. a save retried after save_async raised
def _retry_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gdswriter import GDSCheckpointer

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)  # 4 MiB, 2 MiB a rank
    held: dict = {"w": distribute_tensor(full, mesh, [Shard(0)]), "bad": object()}
    with GDSCheckpointer(root=root, state={"s": held}, options=_options(), dist_options=_dist_options()) as ck:
        raised = caught(lambda: ck.save(1))  # prepare() ran, then the snapshot refused "bad"
        held.pop("bad")
        held["w"] = distribute_tensor(full, mesh, [Shard(1)])  # the state the retry saves: other blocks
        ck.save(1)
    back = {"w": distribute_tensor(torch.zeros(1024, 1024), mesh, [Shard(1)])}
    with GDSCheckpointer(root=root, state={"s": back}, options=_options(), dist_options=_dist_options()) as ck:
        loaded = caught(lambda: ck.load(1))
    ok = loaded is None and torch.equal(back["w"].full_tensor(), full)
    return {"raised": raised, "loaded": loaded, "ok": ok}


def test_a_save_retried_after_save_async_raised_saves_the_retrys_shards(tmp_path):
    """save_async ran prepare() (DTensors -> local shards and their blocks), then the snapshot
    raised; the retry of the same step must write its own blocks, not the failed attempt's."""
    res = run_ranks(2, _retry_worker, str(tmp_path / "shared"), out=tmp_path / "ranks")
    for x in res:
        assert x["raised"] is not None and x["raised"][0] == "UnsupportedObjectError", x
        assert x["loaded"] is None and x["ok"], x
