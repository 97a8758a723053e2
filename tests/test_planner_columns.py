"""planner/assign.py's column layout against the per-storage loop it replaced: the same plan,
byte for byte (so the same files on disk), for varied states, shares and alignments."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from gdswriter.planner.assign import PACK_ALIGN, PACK_BELOW, FileTarget, PlannedChunk, cut_stream, plan_save


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


def loop_cut_stream(sizes, shares, *, align, pack_below):
    """cut_stream as main had it (a Python step per storage), as the reference."""
    n = len(shares)
    per_file = [[] for _ in shares]
    fill = [0] * n
    f = 0
    for sid, size in enumerate(sizes):
        if size == 0:
            per_file[0].append(PlannedChunk(sid, 0, 0, 0, fill[0] if pack_below else _up(fill[0], align)))
            continue
        if size < pack_below:
            while f < n - 1 and _up(fill[f], PACK_ALIGN) + size > shares[f]:
                f += 1
            at = _up(fill[f], PACK_ALIGN)
            per_file[f].append(PlannedChunk(sid, 0, size, f, at))
            fill[f] = at + size
            continue
        done = 0
        while done < size:
            while f < n - 1 and _up(fill[f], align) >= shares[f]:
                f += 1
            fill[f] = _up(fill[f], align)
            room = size - done if f == n - 1 else shares[f] - fill[f]
            length = min(size - done, room)
            if length < size - done:
                length = max(align, (done + length) // align * align - done)
                length = min(length, size - done)
            per_file[f].append(PlannedChunk(sid, done, length, f, fill[f]))
            fill[f] += length
            done += length
    return per_file


def loop_stream_bytes(sizes, align, pack_below):
    if not pack_below:
        return sum(_up(s, align) for s in sizes)
    pos = 0
    for s in sizes:
        pos = _up(pos, PACK_ALIGN if s < pack_below else align) + s
    return _up(pos, align)


def loop_plan(sizes, targets, align, pack_below):
    total = loop_stream_bytes(sizes, align, pack_below)
    n = len(targets)
    units = total // align
    cut = [units * f // n * align for f in range(n + 1)]
    per_file = loop_cut_stream(sizes, [cut[f + 1] - cut[f] for f in range(n)], align=align, pack_below=pack_below)
    return [(max((c.file_offset + c.length for c in chunks), default=0), chunks) for chunks in per_file]


def _state(rng: random.Random, n: int) -> list[int]:
    """Sizes as states hold them: runs of small ones (biases, norms), large ones, zero-byte ones, odd sizes."""
    kinds = [lambda: 0, lambda: rng.randrange(1, 64), lambda: rng.randrange(1, PACK_BELOW),
             lambda: rng.choice([4, 8, 2]) * rng.randrange(1, 1024), lambda: rng.randrange(PACK_BELOW, 1 << 20),
             lambda: PACK_BELOW * rng.randrange(1, 64), lambda: rng.randrange(1 << 20, 8 << 20)]
    weights = [1, 3, 6, 6, 4, 2, 1]
    return [rng.choices(kinds, weights)[0]() for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_plan_save_matches_the_loop(seed):
    rng = random.Random(seed)
    sizes = _state(rng, rng.choice([1, 2, 7, 50, 300, 2000]))
    n = rng.choice([1, 1, 2, 3, 4, 8, 16])
    targets = [FileTarget(i % 3, f"f{i}") for i in range(n)]
    for pack_below in (0, PACK_BELOW):
        plan = plan_save(sizes, targets, pack_below=pack_below)
        want = loop_plan(sizes, targets, 4096, pack_below)
        assert [(f.size, list(f.chunks)) for f in plan.files] == want
        assert all(type(c) is PlannedChunk and type(c.length) is int for f in plan.files for c in f.chunks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 20000), max_size=40), st.lists(st.integers(0, 6), min_size=1, max_size=6),
       st.sampled_from([64, 256, 4096]), st.booleans())
def test_cut_stream_matches_the_loop_for_any_shares(sizes, share_units, align, pack):
    """Shares of any (aligned) size, empty ones too, and smaller alignments: every branch of the loop."""
    pack_below = align if pack else 0
    shares = [u * align for u in share_units]
    got = cut_stream(sizes, shares, align=align, pack_below=pack_below)
    assert got == loop_cut_stream(sizes, shares, align=align, pack_below=pack_below)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=30), st.sampled_from([1, 2, 16, 512]),
       st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_cut_stream_without_packing_at_any_alignment(sizes, align, share_units):
    shares = [u * align for u in share_units]
    assert cut_stream(sizes, shares, align=align) == loop_cut_stream(sizes, shares, align=align, pack_below=0)


def test_a_planned_chunk_is_compared_and_hashed_by_value():
    a, b = PlannedChunk(1, 0, 64, 0, 128), PlannedChunk(1, 0, 64, 0, 128)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a._replace(length=32) == PlannedChunk(1, 0, 32, 0, 128) and a.length == 64
