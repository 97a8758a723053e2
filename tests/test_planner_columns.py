"""planner/assign.py's column layout against the per-storage loop it replaced: the same plan,
byte for byte (so the same files on disk), for varied states, shares and alignments, packing
storages below 4 KiB (PACK_BELOW) and below larger thresholds up to 1 MiB (PACK_MAX), where a
packed storage is larger than ``align`` and than a file's share."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from gdswriter.errors import InvalidOptionError
from gdswriter.planner.assign import (PACK_ALIGN, PACK_BELOW, PACK_MAX, FileTarget, PlannedChunk, cut_stream,
                                      plan_save)


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


def loop_cut_stream(sizes, shares, *, align, pack_below):
    """cut_stream as main had it (a Python step per storage), as the reference. A packed storage
    (under ``pack_below``, of any size) goes whole to the first file from the current one whose
    share holds it from its fill rounded up to PACK_ALIGN, else to the last file."""
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
    for pack_below in (0, 4096, 32 << 10, 65536, PACK_MAX):
        plan = plan_save(sizes, targets, pack_below=pack_below)
        want = loop_plan(sizes, targets, 4096, pack_below)
        assert [(f.size, list(f.chunks)) for f in plan.files] == want
        assert all(type(c) is PlannedChunk and type(c.length) is int for f in plan.files for c in f.chunks)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 20000), max_size=40), st.lists(st.integers(0, 6), min_size=1, max_size=6),
       st.sampled_from([64, 256, 4096]), st.sampled_from([0, 1, 2, 5, 16, -1]))
def test_cut_stream_matches_the_loop_for_any_shares(sizes, share_units, align, pack):
    """Shares of any (aligned) size, empty ones too, and smaller alignments: every branch of the
    loop. ``pack``: pack_below as a multiple of ``align`` (0: none packed; above 1, packed
    storages larger than ``align``, and than some shares; -1: PACK_MAX)."""
    pack_below = PACK_MAX if pack < 0 else pack * align
    shares = [u * align for u in share_units]
    got = cut_stream(sizes, shares, align=align, pack_below=pack_below)
    assert got == loop_cut_stream(sizes, shares, align=align, pack_below=pack_below)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=30), st.sampled_from([1, 2, 16, 512]),
       st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_cut_stream_without_packing_at_any_alignment(sizes, align, share_units):
    shares = [u * align for u in share_units]
    assert cut_stream(sizes, shares, align=align) == loop_cut_stream(sizes, shares, align=align, pack_below=0)


@pytest.mark.parametrize("pack_below", [-1, PACK_MAX + 1, 1 << 30])
def test_pack_below_out_of_range_is_refused(pack_below):
    with pytest.raises(InvalidOptionError, match="pack_below"):
        plan_save([100, 5000], [FileTarget(0, "f")], pack_below=pack_below)


def test_a_packed_storage_larger_than_a_share_moves_whole_past_it():
    """pack_below above align: a 60 KB storage never splits, even where a file's share is smaller
    than it (file 0 stays empty); larger storages keep 4 KiB; one straddling a cut is split."""
    (f0, f1) = cut_stream([60_000, 100, 70_000], [16384, 1 << 20], pack_below=65536)
    assert f0 == [] and f1 == [PlannedChunk(0, 0, 60_000, 1, 0), PlannedChunk(1, 0, 100, 1, 60_032),
                               PlannedChunk(2, 0, 70_000, 1, 61_440)]
    (g0, g1) = cut_stream([70_000, 30_000], [65536, 65536], pack_below=65536)
    assert g0 == [PlannedChunk(0, 0, 65536, 0, 0)] and g1 == [PlannedChunk(0, 65536, 4464, 1, 0),
                                                               PlannedChunk(1, 0, 30_000, 1, 4480)]


def test_a_planned_chunk_is_compared_and_hashed_by_value():
    a, b = PlannedChunk(1, 0, 64, 0, 128), PlannedChunk(1, 0, 64, 0, 128)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a._replace(length=32) == PlannedChunk(1, 0, 32, 0, 128) and a.length == 64
