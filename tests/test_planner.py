"""Properties of plan_save (planner/assign.py), a pure function of sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gdswriter.errors import InvalidOptionError
from gdswriter.planner.assign import DEFAULT_ALIGN, FileTarget, plan_save

A = DEFAULT_ALIGN

sizes_st = st.lists(
    st.one_of(st.integers(0, 3 * A), st.integers(0, 64 * A), st.sampled_from([0, 1, A - 1, A, A + 1, 2 * A])),
    max_size=30)
targets_st = st.integers(1, 9).map(lambda n: [FileTarget(i % 3, f"f{i}") for i in range(n)])


def _align_up(n: int, a: int = A) -> int:
    return -(-n // a) * a


def check_plan(sizes, targets, align=A):
    plan = plan_save(sizes, targets, align=align)
    assert [f.target for f in plan.files] == list(targets)

    # every byte of every storage is assigned exactly once, in order, with no gap
    for sid, size in enumerate(sizes):
        chunks = plan.chunks_of(sid)
        assert chunks, f"storage {sid} missing from the plan"
        pos = 0
        for c in chunks:
            assert c.storage == sid
            assert c.storage_offset == pos
            # continuation chunks start at an aligned storage offset (a straddling storage
            # is cut at an aligned point); only the storage's last chunk may be unaligned in length
            assert c.storage_offset % align == 0
            pos += c.length
        assert pos == size
        assert all(c.length > 0 for c in chunks) or size == 0
        if size == 0:
            assert [c.length for c in chunks] == [0]

    total_assigned = 0
    for fid, f in enumerate(plan.files):
        end = 0
        for c in f.chunks:
            assert c.file == fid
            assert c.file_offset % align == 0, "file offsets are aligned for direct I/O"
            assert c.file_offset >= end, "chunks of a file must not overlap and are sorted"
            end = c.file_offset + c.length
            total_assigned += c.length
        assert f.size == end, "a file ends at its last byte"
    assert total_assigned == sum(sizes)

    sizes_on_disk = [f.size for f in plan.files]
    nonzero = sum(1 for s in sizes if s)
    assert max(sizes_on_disk) - min(sizes_on_disk) <= align * max(nonzero, 1)
    # no file is larger than an even share of the aligned stream plus one unit
    stream = sum(_align_up(s, align) for s in sizes)
    assert max(sizes_on_disk) <= _align_up(-(-stream // len(targets)), align) + align
    return plan


@settings(max_examples=400, deadline=None)
@given(sizes_st, targets_st)
def test_plan_properties(sizes, targets):
    plan = check_plan(sizes, targets)
    assert plan == plan_save(list(sizes), list(targets)), "deterministic"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=12), st.integers(1, 6), st.sampled_from([1, 2, 64, 512, 4096]))
def test_plan_properties_other_alignments(sizes, n, align):
    check_plan(sizes, [FileTarget(0, f"f{i}") for i in range(n)], align=align)


def test_single_storage_is_spread_evenly():
    # 20 KiB over 4 files: 4+4+4+8 KiB, never 8+8+4+0 KiB
    plan = check_plan([5 * A], [FileTarget(0, str(i)) for i in range(4)])
    assert sorted(f.size for f in plan.files) == [A, A, A, 2 * A]
    # large and even: exact quarters
    plan = check_plan([64 * A], [FileTarget(0, str(i)) for i in range(4)])
    assert [f.size for f in plan.files] == [16 * A] * 4


def test_many_targets_little_data():
    plan = check_plan([100, 0, 7], [FileTarget(i, "x") for i in range(5)])
    assert sum(f.size > 0 for f in plan.files) <= 2


def test_empty_and_zero_sized():
    plan = check_plan([], [FileTarget(0, "a"), FileTarget(1, "b")])
    assert [f.size for f in plan.files] == [0, 0]
    plan = check_plan([0, 0], [FileTarget(0, "a")])
    assert [len(f.chunks) for f in plan.files] == [2]


def test_invalid_arguments():
    with pytest.raises(InvalidOptionError):
        plan_save([1], [])
    with pytest.raises(InvalidOptionError):
        plan_save([1], [FileTarget(0, "a")], align=3000)
    with pytest.raises(InvalidOptionError):
        plan_save([-1], [FileTarget(0, "a")])
