"""The GDS engine's I/O plan (gdswriter/engines/kvikio.py plan_io), a pure function: every span
byte in exactly one request, requests 4 KiB-aligned and never sharing a block, staged
requests within the staging buffer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import gdswriter.engines.kvikio as gds
from gdswriter.options import ALIGN, KiB, MiB


def check_plan(extents, pieces, cap, file_size=None):
    """Every span byte in exactly one request; requests start on 4 KiB boundaries, cover whole
    blocks (a read's last one may stop at EOF), share no block, staged ones fit the buffer."""
    covered = {}
    blocks = set()
    for p in pieces:
        assert p.file_off % ALIGN == 0, p
        end = p.file_off + p.length
        assert end % ALIGN == 0 or (file_size is not None and end == file_size), p
        own = set(range(p.file_off // ALIGN, -(-end // ALIGN)))
        assert not own & blocks, f"{p} shares a 4 KiB block with another request"
        blocks |= own
        if p.span >= 0:
            assert not p.parts
            covered.setdefault(p.span, []).append((p.span_off, p.length))
            assert extents[p.span][0] + p.span_off == p.file_off
        else:
            assert 0 < p.length <= cap
            for part in p.parts:
                assert 0 <= part.buf_off and part.buf_off + part.length <= p.length
                assert extents[part.span][0] + part.span_off == p.file_off + part.buf_off
                covered.setdefault(part.span, []).append((part.span_off, part.length))
    for j, (_off, n) in enumerate(extents):
        got = sorted(covered.get(j, []))
        pos = 0
        for a, m in got:
            assert a == pos, f"span {j}: bytes [{pos}, {a}) missing or duplicated"
            pos += m
        assert pos == n, f"span {j}: {pos} of {n} bytes covered"


@st.composite
def layouts(draw):
    extents, off = [], draw(st.integers(0, 3 * ALIGN))
    for _ in range(draw(st.integers(0, 12))):
        n = draw(st.sampled_from([0, 1, 7, 4095, 4096, 4097, 70_000, 300_000, 1 << 20]) | st.integers(0, 200_000))
        extents.append((off, n))
        off += n + draw(st.sampled_from([0, 0, 1, 100, 4096, 2 << 20]) | st.integers(0, 9000))
    return extents


@settings(max_examples=300, deadline=None)
@given(layouts(), st.sampled_from([ALIGN, 8 * KiB, 64 * KiB, 256 * KiB]), st.sampled_from([0, 4096, 1 << 20]),
       st.booleans())
def test_plan_properties(extents, cap, merge_gap, for_read):
    end = max((o + n for o, n in extents), default=0)
    file_size = end + 3 if for_read else None
    pieces = gds.plan_io(extents, buffer_bytes=cap, file_size=file_size, merge_gap=merge_gap)
    check_plan(extents, pieces, cap, file_size)
    assert [p.file_off for p in pieces] == sorted(p.file_off for p in pieces)


def test_plan_moves_large_aligned_bodies_in_place_and_packs_small_spans():
    extents = [(0, 100), (4096, 5000), (12_288, MiB + 10), (12_288 + MiB + 10, 3)]
    pieces = gds.plan_io(extents, buffer_bytes=256 * KiB)
    direct = [p for p in pieces if p.span >= 0]
    assert [(p.file_off, p.length, p.span, p.span_off) for p in direct] == [(12_288, MiB, 2, 0)]
    staged = [p for p in pieces if p.span < 0]
    assert [(p.file_off, p.length) for p in staged] == [(0, 12_288), (12_288 + MiB, 4096)]
    assert [(q.span, q.span_off, q.buf_off, q.length) for q in staged[1].parts] == [(2, MiB, 0, 10), (3, 0, 10, 3)]
