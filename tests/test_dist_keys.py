"""Item keys of a multi-rank save are unique by construction, whatever the state tree's names.

A key path is a name, not an identity: a flat key ``"a/b"`` beside a nested ``{"a": {"b": ...}}``,
an int key ``1`` beside a str key ``"1"``, or a top-level key with a slash in it all give two
tensors one name. A 2-rank save once keyed its replicated items by those names and committed
steps whose manifest shards listed one item twice, which every reader refused. Each case here
is saved by 2 real gloo ranks (tensors of 2 MiB, above every small-copy threshold), then loaded
by 2 ranks, by ``load_state`` and checked by ``gdswriter verify`` and ``export``: bit for bit.
A property test draws random nested trees with colliding names and shared storages, saved on 2
ranks and in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support.ranks import run_ranks
from support.trees import assert_same_tree

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MIB_FLOATS = 1 << 18  # floats in 1 MiB


def _t(seed: int, n: int = 2 * MIB_FLOATS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


def named_state(case: str) -> dict:
    """The ``state=`` of one colliding case (every rank builds the same; saved under "extra")."""
    if case == "slash":
        return {"x": {"a/b": _t(1), "a": {"b": _t(2)}}}
    if case == "int-str":
        return {"x": {1: _t(3), "1": _t(4)}}
    if case == "shared":  # two storages, each viewed under the names the other's views have
        one, two = _t(7, 4 * MIB_FLOATS), _t(8, 4 * MIB_FLOATS)
        half = 2 * MIB_FLOATS
        return {"x": {"a/b": one[:half], "c/d": one[half:], "a": {"b": two[:half]}, "c": {"d": two[half:]}}}
    raise AssertionError(case)


def _save_and_load(rank: int, world: int, root: str, state: dict, replicated: list[str]) -> dict:
    from support.models import small_options

    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    opts = DistOptions(replicated=tuple(replicated), timeout_s=60.0)
    with GDSCheckpointer(root=root, state=state, options=small_options(), dist_options=opts) as ck:
        ck.save(1)
    fresh = {k: _zeros_like(v) for k, v in state.items()}
    with GDSCheckpointer(root=root, state=fresh, options=small_options(), dist_options=opts) as ck:
        ck.load(1)
    assert_same_tree(fresh, state, f"rank {rank}")
    return {"ok": True}


def _zeros_like(v):
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: _zeros_like(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_zeros_like(x) for x in v)
    return v


def _named_worker(rank: int, world: int, root: str, case: str, replicated: list[str]) -> dict:
    return _save_and_load(rank, world, root, named_state(case), replicated)


def _check_offline(root: Path, state: dict, tmp_path: Path) -> None:
    """What the readers without live objects make of the step: load_state, verify, export."""
    from gdswriter import load_state
    from gdswriter.cli import main

    step, loaded = load_state(str(root), 1)
    assert step == 1
    assert_same_tree(loaded["extra"], state, "load_state")
    assert main(["verify", str(root), "--step", "1"]) == 0
    out = tmp_path / "export.pt"
    assert main(["export", str(root), str(out), "--step", "1", "--to", "torch"]) == 0
    assert out.stat().st_size > 4 * 2 * MIB_FLOATS


@pytest.mark.parametrize("case", ["slash", "int-str", "shared"])
def test_colliding_names_commit_a_step_every_reader_loads(tmp_path, case):
    root = tmp_path / "root"
    run_ranks(2, _named_worker, str(root), case, ["extra"], out=tmp_path / "out")
    _check_offline(root, named_state(case), tmp_path)


# ----------------------------------------------------------------------------- the property test
def _keys():
    # names built to collide: "a/b" against a nested a.b, ints against their str form
    return st.sampled_from(["a", "b", "a/b", "1", 1])


def _trees(max_leaves: int):
    leaf = st.integers(min_value=0, max_value=7)  # a tensor id: equal ids share one tensor
    return st.recursive(leaf, lambda kids: st.dictionaries(_keys(), kids, min_size=1, max_size=3),
                        max_leaves=max_leaves)


COLLIDING = [{"a/b": 0, "a": {"b": 1}}, {1: 2, "1": 3}, {"a": {"1": 4, 1: 5}, "a/1": 1}, {"b": 6, "a": {"b": 7}}]


LEAF = 3 * MIB_FLOATS // 2  # 1.5 MiB: above the 1 MiB that save_async copies at the call


def pool() -> list[torch.Tensor]:
    """The leaves a tree's ids 0-7 stand for: four tensors of their own storage, then views
    sharing them (a half of 0, a half of 1, 2 itself again, 3 reshaped)."""
    own = [_t(20 + i, LEAF) for i in range(4)]
    return own + [own[0][:LEAF // 2], own[1][LEAF // 2:], own[2], own[3].view(2, -1)]


def build(tree, leaves: list[torch.Tensor]):
    if isinstance(tree, dict):
        return {k: build(v, leaves) for k, v in tree.items()}
    return leaves[tree]


def _property_worker(rank: int, world: int, root: str, trees: str) -> dict:
    leaves = pool()
    for i, tree in enumerate(json.loads(trees)):
        built = {"x": build(_decode_keys(tree), leaves)}
        _save_and_load(rank, world, f"{root}/{i}", built, ["extra"])
    return {"ok": True}


def _encode_keys(tree):
    """JSON keeps only str keys: an int key k travels as "#int:k"."""
    if isinstance(tree, dict):
        return {(f"#int:{k}" if isinstance(k, int) else k): _encode_keys(v) for k, v in tree.items()}
    return tree


def _decode_keys(tree):
    if isinstance(tree, dict):
        return {(int(k[5:]) if k.startswith("#int:") else k): _decode_keys(v) for k, v in tree.items()}
    return tree


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(trees=COLLIDING)
@given(trees=st.lists(st.dictionaries(_keys(), _trees(8), min_size=1, max_size=4), min_size=4, max_size=4))
def test_random_trees_with_colliding_names_load_bit_exact(tmp_path_factory, trees):
    """Each example: 4 random trees saved and loaded on 2 ranks (one spawn for all four: ranks
    are slow to start), then each loaded by load_state, and saved and loaded in one process."""
    from support.models import small_options

    from gdswriter import GDSCheckpointer, load_state

    tmp = tmp_path_factory.mktemp("prop")
    run_ranks(2, _property_worker, str(tmp / "dist"), json.dumps([_encode_keys(t) for t in trees]),
              out=tmp / "out")
    leaves = pool()
    for i, tree in enumerate(trees):
        state = {"x": build(tree, leaves)}
        assert_same_tree(load_state(str(tmp / "dist" / str(i)), 1)[1]["extra"], state, f"load_state {i}")
        one = tmp / "one" / str(i)
        with GDSCheckpointer(root=str(one), state=state, options=small_options()) as ck:
            ck.save(1)
        fresh = {"x": _zeros_like(state["x"])}
        with GDSCheckpointer(root=str(one), state=fresh, options=small_options()) as ck:
            ck.load(1)
        assert_same_tree(fresh, state, f"one process {i}")


# ----------------------------------------------------------------------------- the general hole
def _long_name_worker(rank: int, world: int, root: str) -> dict:
    from support.models import small_options

    from gdswriter import GDSCheckpointer, GDSWriterError
    from gdswriter.distributed import DistOptions

    opts = DistOptions(replicated=("extra",), timeout_s=60.0)
    inner = {"a": _t(1)}
    with GDSCheckpointer(root=root, state={"x": inner}, options=small_options(), dist_options=opts) as ck:
        ck.save(1)
        inner["k" * 5000] = _t(2)  # a key path longer than a shard's reader accepts (4096 characters)
        with pytest.raises(GDSWriterError, match="not committed") as e:
            ck.save(2)
        assert ck.latest_step() == 1
    fresh = {"a": torch.zeros(2 * MIB_FLOATS)}
    with GDSCheckpointer(root=root, state={"x": fresh}, options=small_options(), dist_options=opts) as ck:
        assert ck.load() == 1
    assert torch.equal(fresh["a"], _t(1))
    return {"error": str(e.value)[:300]}


def test_a_shard_a_reader_would_refuse_is_never_committed(tmp_path):
    """Every rank parses its manifest shard with the readers' own code before it votes: a state
    the shard format cannot describe (here a key path over 4096 characters) fails the save on
    every rank, and the step before stays the latest and loads."""
    results = run_ranks(2, _long_name_worker, str(tmp_path / "root"), out=tmp_path / "out")
    assert all("expected a string of at most 4096 characters" in r["error"] or "failed" in r["error"]
               for r in results), results


def _dtensor_clash_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from support.models import small_options

    from gdswriter import GDSCheckpointer, UnsupportedObjectError
    from gdswriter.distributed import DistOptions

    mesh = init_device_mesh("cpu", (world,))
    block = distribute_tensor(_t(1), mesh, [Shard(0)])
    state = {"x": {"a/b": block, "a": {"b": _t(2)}}}
    with GDSCheckpointer(root=root, state=state, options=small_options(),
                         dist_options=DistOptions(replicated=("extra",), timeout_s=60.0)) as ck:
        with pytest.raises(UnsupportedObjectError, match="rename one of them"):
            ck.save(1)
        assert ck.latest_step() is None
    return {"ok": True}


def test_a_dtensor_whose_key_path_another_tensor_has_is_refused(tmp_path):
    """A DTensor is matched by its key path on load (its blocks across shards): one that shares
    it with another tensor cannot be told apart, so the save refuses it, typed, on every rank."""
    run_ranks(2, _dtensor_clash_worker, str(tmp_path / "root"), out=tmp_path / "out")
