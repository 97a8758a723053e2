"""Properties of plan_rank_slices (planner/ranks.py): which rank writes which bytes of shared state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gdswriter.errors import InvalidOptionError
from gdswriter.planner.assign import DEFAULT_ALIGN
from gdswriter.planner.ranks import RankItem, plan_rank_slices

A = DEFAULT_ALIGN


def check(items, world, align=A):
    plan = plan_rank_slices(items, world, align=align)
    loads = [0] * world
    for i, it in enumerate(items):
        pieces = [p for p in plan.pieces if p.item == i]
        assert pieces, f"item {i} is missing from the plan"
        pos = 0
        for p in pieces:  # every byte exactly once, in order
            assert p.offset == pos and p.offset % align == 0
            assert p.rank in it.holders, "only a holder can write an item"
            assert p.length > 0 or it.nbytes == 0
            pos += p.length
            loads[p.rank] += p.length
        assert pos == it.nbytes
    assert tuple(loads) == plan.loads
    assert plan == plan_rank_slices(list(items), world, align=align), "deterministic"
    return plan


world_st = st.integers(1, 8)


@st.composite
def items_st(draw):
    world = draw(world_st)
    ranks = st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True).map(tuple)
    size = st.one_of(st.integers(0, 3 * A), st.integers(0, 300 * A), st.sampled_from([0, 1, A - 1, A, A + 1]))
    items = draw(st.lists(st.builds(RankItem, size, ranks), max_size=25))
    return items, world


@settings(max_examples=400, deadline=None)
@given(items_st())
def test_every_byte_once_by_a_holder(case):
    check(*case)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 400 * A), max_size=30), world_st)
def test_replicated_state_is_balanced_within_two_units(sizes, world):
    """State every rank holds (DDP): loads differ by less than two alignment units per rank."""
    plan = check([RankItem(n, tuple(range(world))) for n in sizes], world)
    assert max(plan.loads) - min(plan.loads) <= 2 * A


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100 * A), max_size=10), st.lists(st.integers(0, 300 * A), min_size=1, max_size=20),
       world_st)
def test_replicated_bytes_even_out_rank_local_ones(local, shared, world):
    """Rank-local bytes first, then replicated ones fill the least-loaded ranks up to one level."""
    items = [RankItem(n, (i % world,)) for i, n in enumerate(local)]
    items += [RankItem(n, tuple(range(world))) for n in shared]
    plan = check(items, world)
    fixed = [0] * world
    for i, n in enumerate(local):
        fixed[i % world] += n
    level = (sum(local) + sum(shared)) / world
    if max(fixed) <= level:  # the shared bytes can even everything out
        assert max(plan.loads) - min(plan.loads) <= 2 * A * world


def _gpt_sizes(layers: int, dim: int, vocab: int, itemsize: int = 4) -> list[int]:
    per_layer = [dim * 3 * dim, 3 * dim, dim * dim, dim, 4 * dim * dim, 4 * dim, 4 * dim * dim, dim, dim, dim, dim, dim]
    return [vocab * dim, 1024 * dim] + per_layer * layers + [dim, dim]


@pytest.mark.parametrize("world", [2, 4, 8, 16])
@pytest.mark.parametrize("model", [(12, 768, 50257), (24, 1024, 50257), (4, 256, 32000)])
def test_realistic_models_within_five_percent(world, model):
    """GPT-2-like parameter sets plus Adam's two moments, replicated on every rank (DDP)."""
    sizes = _gpt_sizes(*model) * 3
    plan = check([RankItem(n, tuple(range(world))) for n in sizes], world)
    mean = sum(plan.loads) / world
    assert max(plan.loads) / mean <= 1.05


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_one_dominant_tensor_is_split(world):
    """An embedding holding most of the bytes: dealing whole tensors out could not balance this."""
    sizes = [400 << 20, 3 << 20, 1 << 20, 12345]
    plan = check([RankItem(n, tuple(range(world))) for n in sizes], world)
    assert max(plan.loads) / (sum(sizes) / world) <= 1.05
    assert len({p.rank for p in plan.pieces if p.item == 0}) == world


def test_replica_groups_of_a_2d_mesh():
    """DP x TP = 2 x 2: TP shard 0 lives on ranks {0, 2}, shard 1 on {1, 3}; each is written once, split."""
    items = [RankItem(1 << 20, (0, 2)), RankItem(1 << 20, (1, 3)), RankItem(4096, (0, 1, 2, 3))]
    plan = check(items, 4)
    assert plan.loads == (256 * A, 256 * A + A, 256 * A, 256 * A) or max(plan.loads) - min(plan.loads) <= A
    assert {p.rank for p in plan.pieces if p.item == 0} == {0, 2}


def test_single_holder_items_stay_whole():
    plan = check([RankItem(10 * A + 3, (2,)), RankItem(0, (1,))], 3)
    assert [(p.rank, p.offset, p.length) for p in plan.pieces] == [(2, 0, 10 * A + 3), (1, 0, 0)]
    assert plan.loads == (0, 0, 10 * A + 3)


def test_invalid_input():
    with pytest.raises(InvalidOptionError):
        plan_rank_slices([RankItem(1, ())], 2)
    with pytest.raises(InvalidOptionError):
        plan_rank_slices([RankItem(1, (2,))], 2)
    with pytest.raises(InvalidOptionError):
        plan_rank_slices([RankItem(-1, (0,))], 1)
    with pytest.raises(InvalidOptionError):
        plan_rank_slices([], 0)
    with pytest.raises(InvalidOptionError):
        plan_rank_slices([], 1, align=3)
