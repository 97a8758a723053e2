"""One contract suite for every engine (gdswriter.engines.base.IOEngine).

Each engine writes files from spans and reads spans back; the bytes on disk, the
bytes read back and the crc32c of every span must be right for every layout.
Runs over: io_uring (O_DIRECT), POSIX threads, the fault-injecting engine making
every other request a real short transfer (io_uring + O_DIRECT, and POSIX +
buffered with unaligned short lengths) and io_uring with buffered I/O; and, except
for the cases that count the staged engines' requests and staging copies, the KvikIO
(GDS) engine: its device path with a stand-in for KvikIO and host tensors taken for
device memory everywhere, and on a GPU the real engine with CUDA spans, CUDA and host
spans mixed, and gdswriter's own engines with CUDA spans (tests/support/engines.py).
"""

from __future__ import annotations

import os
import random

import crc32c
import pytest
import torch

from gdswriter.engines.base import ReadSpan, WriteSpan
from gdswriter.errors import InvalidOptionError
from gdswriter.testing.faults import FaultInjectingEngine, FaultPlan
from gdswriter.options import ALIGN, MiB
from gdswriter.planner.assign import PACK_BELOW, FileTarget, plan_save
from support.engines import (BUFFER, ENGINES, KVIKIO_KINDS, POOL, REQUEST, build_engine, crc, disk, host_tensor, image,
                             kernel_takes_direct_io_from, kvikio_engine_factory, rand)


def staged_factory(kind: str, io_small_options):
    made = []

    def make(**overrides):
        eng = build_engine(kind, lambda **kw: io_small_options(**{**overrides, **kw}))
        made.append(eng)
        return eng

    make.kind = kind
    return make, made


@pytest.fixture(params=ENGINES + KVIKIO_KINDS)
def make_engine(request, io_small_options, monkeypatch, tmp_path):
    """make_engine(**option_overrides) -> engine of this parameter's kind (closed after the test):
    a staged engine or one of the KvikIO engine's kinds."""
    if request.param in ENGINES:
        make, made = staged_factory(request.param, io_small_options)
    else:
        make, made = kvikio_engine_factory(request.param, io_small_options, monkeypatch, tmp_path)
    yield make
    for eng in made:
        eng.close()


@pytest.fixture(params=ENGINES)
def make_staged_engine(request, io_small_options):
    """As make_engine, staged engines only: for the cases that count their requests or staging copies."""
    make, made = staged_factory(request.param, io_small_options)
    yield make
    for eng in made:
        eng.close()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def write_and_check(eng, path, spans, size=None):
    """Write, then check crcs, exact size and on-disk bytes with plain Python I/O."""
    crcs = eng.write_file(path, spans, size=size)
    assert crcs == [crc(s.data) for s in spans]
    want_size = size if size is not None else (spans[-1].end if spans else 0)
    assert os.path.getsize(path) == want_size
    assert disk(path) == image(spans, want_size)
    return crcs


def read_and_check(eng, path, wspans):
    """Read every span back into fresh tensors; check bytes and crcs."""
    outs = [ReadSpan(s.offset, torch.full_like(s.data, 0xA5)) for s in wspans]
    crcs = eng.read_file(path, outs)
    for w, r in zip(wspans, outs):
        assert torch.equal(w.data, r.out), f"span at {w.offset} (+{w.data.numel()}) read back wrong"
    assert crcs == [crc(s.data) for s in wspans]
    return crcs


class SubmitCounter:
    """Wraps the engine's backend.submit: counts requests and the most ever in flight."""

    def __init__(self, eng, monkeypatch):
        self.backend = eng._backend
        self.real = self.backend.submit
        self.calls = {True: 0, False: 0}
        self.max_in_flight = 0
        monkeypatch.setattr(self.backend, "submit", self)

    def __call__(self, write, fd, buf, start, length, file_off, tag):
        self.calls[write] += 1
        self.real(write, fd, buf, start, length, file_off, tag)
        self.max_in_flight = max(self.max_in_flight, self.backend.in_flight)

    @property
    def writes(self) -> int:
        return self.calls[True]

    @property
    def reads(self) -> int:
        return self.calls[False]


def uses_direct(kind: str) -> bool:
    return kind in ("io_uring", "posix", "faulty-short")


def requests_needed(kind: str, nbytes: int) -> int:
    """Requests a perfectly coalescing engine issues for ``nbytes`` of file."""
    total = -(-nbytes // ALIGN) * ALIGN if uses_direct(kind) else nbytes
    return -(-total // REQUEST)


# ---------------------------------------------------------------------------
SIZES = [0, 1, 4095, 4096, 4097, REQUEST, BUFFER + 1, 3 * MiB + 123, 2 * POOL + 3 * ALIGN + 17]


@pytest.mark.parametrize("size", SIZES)
def test_single_span_roundtrip(make_engine, tmp_path, gen, size):
    eng = make_engine()
    path = tmp_path / "one.bin"
    spans = [WriteSpan(0, rand(size, gen))]
    crcs = write_and_check(eng, path, spans)
    assert read_and_check(eng, path, spans) == crcs
    assert eng.info.direct_io == uses_direct(make_engine.kind)
    if make_engine.kind.startswith("faulty") and size > 2 * REQUEST:
        assert eng.faults["short"] > 0, "the short-transfer engine never shortened a request"


def test_empty_span_list(make_engine, tmp_path):
    eng = make_engine()
    path = tmp_path / "empty.bin"
    assert eng.write_file(path, []) == []
    assert os.path.getsize(path) == 0
    assert eng.read_file(path, []) == []
    assert eng.write_file(path, [], size=10_000) == []
    assert disk(path) == bytes(10_000)


@pytest.mark.parametrize("layout", ["aligned", "packed"])
def test_many_small_spans_coalesce(make_staged_engine, tmp_path, gen, monkeypatch, layout):
    eng = make_staged_engine()
    rnd = random.Random(7)
    spans, off = [], (0 if layout == "aligned" else 7)
    for _ in range(3000):
        n = rnd.randint(1, 300)
        spans.append(WriteSpan(off, rand(n, gen)))
        off = off + ALIGN if layout == "aligned" else off + n + rnd.randint(0, 5)
    path = tmp_path / f"small-{layout}.bin"
    counter = SubmitCounter(eng, monkeypatch)
    write_and_check(eng, path, spans)
    read_and_check(eng, path, spans)

    end = spans[-1].end
    # Short transfers (fault-injecting engines) each add one resubmission; do not count those.
    events = getattr(eng, "events", [])
    writes = counter.writes - sum(e.kind == "short" and e.write for e in events)
    reads = counter.reads - sum(e.kind == "short" and not e.write for e in events)
    # Coalesced: a handful of large requests, not one per tensor.
    assert writes < len(spans) / 10 and reads < len(spans) / 10, counter.calls
    assert writes == requests_needed(make_staged_engine.kind, end)
    assert reads <= requests_needed(make_staged_engine.kind, end) + 1


def test_gaps_and_explicit_size(make_engine, tmp_path, gen):
    eng = make_engine()
    spans = [WriteSpan(5000, rand(1000, gen)), WriteSpan(70_000, rand(4096, gen)),
             WriteSpan(300_001, rand(BUFFER + 5, gen)), WriteSpan(2 * MiB + 3, rand(10, gen))]
    size = spans[-1].end + POOL + 12_345  # tail of zeros longer than the whole pool
    path = tmp_path / "gaps.bin"
    write_and_check(eng, path, spans, size=size)
    read_and_check(eng, path, spans)

    # Gaps and tail read as zeros, with the crc32c of zeros.
    gaps = [(0, 5000), (6000, 64_000), (74_096, 300_001 - 74_096), (spans[-1].end, size - spans[-1].end)]
    outs = [ReadSpan(o, torch.full((n,), 0xFF, dtype=torch.uint8)) for o, n in gaps]
    crcs = eng.read_file(path, outs)
    for r in outs:
        assert not r.out.any()
    assert crcs == [crc32c.crc32c(bytes(n)) for _, n in gaps]


def test_a_packed_2_1_layout_round_trips(make_engine, tmp_path, gen):
    """Format 2.1's layout (planner/assign.py): storages under 4 KiB packed 64 bytes apart, several
    to a 4 KiB block, between 4 KiB-aligned large ones; written, then read back whole and every
    other storage alone (blocks shared with storages not read)."""
    eng = make_engine()
    rnd = random.Random(40)
    sizes = [rnd.choice([1, 63, 64, 100, 2700, 4095, 4096, 9000, BUFFER + 5]) for _ in range(300)]
    plan = plan_save(sizes, [FileTarget(0, "f")], pack_below=PACK_BELOW)
    spans = [WriteSpan(c.file_offset, rand(c.length, gen)) for c in plan.files[0].chunks if c.length]
    assert any(s.offset % ALIGN for s in spans) and any(s.offset % ALIGN == 0 and s.end - s.offset > ALIGN
                                                       for s in spans)
    path = tmp_path / "packed.bin"
    write_and_check(eng, path, spans, size=plan.files[0].size)
    read_and_check(eng, path, spans)
    read_and_check(eng, path, spans[1::2])


def test_size_smaller_than_spans_is_rejected(make_engine, tmp_path, gen):
    eng = make_engine()
    with pytest.raises(ValueError):
        eng.write_file(tmp_path / "x.bin", [WriteSpan(0, rand(100, gen))], size=99)


@pytest.mark.parametrize("depth", [1, 2, 16])
def test_queue_depths(make_staged_engine, tmp_path, gen, monkeypatch, depth):
    eng = make_staged_engine(queue_depth=depth)
    rnd = random.Random(depth)
    spans, off = [], 0
    while off < 2 * MiB:
        n = rnd.choice([1, 17, 4096, 9000, REQUEST + 1, BUFFER])
        spans.append(WriteSpan(off, rand(n, gen)))
        off += n + rnd.choice([0, 0, 1, 4096, 100_000])
    path = tmp_path / f"qd{depth}.bin"
    counter = SubmitCounter(eng, monkeypatch)
    write_and_check(eng, path, spans)
    read_and_check(eng, path, spans)
    assert 0 < counter.max_in_flight <= depth
    if depth > 1:
        assert counter.max_in_flight > 1, "requests were never overlapped"


def test_read_subset_of_spans(make_engine, tmp_path, gen):
    eng = make_engine()
    rnd = random.Random(3)
    spans, off = [], 123
    for i in range(60):
        n = rnd.randint(1, 40_000)
        spans.append(WriteSpan(off, rand(n, gen)))
        # a few gaps larger than the read-merge distance (1 MiB) split the reads into extents
        off += n + (3 * MiB if i % 20 == 19 else rnd.randint(0, 5000))
    path = tmp_path / "subset.bin"
    write_and_check(eng, path, spans)
    for pick in (spans[::3], spans[1::7], [spans[-1]], [spans[0], spans[-1]], spans[20:40]):
        read_and_check(eng, path, pick)


def test_read_unaligned_ranges(make_engine, tmp_path, gen):
    eng = make_engine()
    size = MiB + 777
    src = rand(size, gen)
    path = tmp_path / "unaligned.bin"
    write_and_check(eng, path, [WriteSpan(0, src)])
    ranges = [(1, 100), (4095, 2), (4097, 70_000), (300_001, 5000), (305_001, BUFFER + 3), (size - 1000, 999),
              (size - 1, 1)]
    outs = [ReadSpan(o, torch.empty(n, dtype=torch.uint8)) for o, n in ranges]
    crcs = eng.read_file(path, outs)
    for (o, n), r, c in zip(ranges, outs, crcs):
        assert torch.equal(r.out, src[o:o + n]), (o, n)
        assert c == crc(src[o:o + n])
    # One byte, nothing else, at an odd place; and a zero-length span.
    out = ReadSpan(size // 2 + 1, torch.empty(1, dtype=torch.uint8))
    empty = ReadSpan(size, torch.empty(0, dtype=torch.uint8))
    assert eng.read_file(path, [out, empty]) == [crc(src[size // 2 + 1:size // 2 + 2]), 0]
    assert out.out.item() == src[size // 2 + 1].item()


def test_rewrite_truncates(make_engine, tmp_path, gen):
    eng = make_engine()
    path = tmp_path / "again.bin"
    write_and_check(eng, path, [WriteSpan(0, rand(MiB + 5, gen))])
    small = [WriteSpan(3, rand(100, gen))]
    write_and_check(eng, path, small)
    assert os.path.getsize(path) == 103
    read_and_check(eng, path, small)
    write_and_check(eng, path, small, size=4097)
    write_and_check(eng, path, [])  # back to empty


def test_not_durable_write(make_engine, tmp_path, gen):
    eng = make_engine()
    path = tmp_path / "fast.bin"
    spans = [WriteSpan(10, rand(99_999, gen))]
    assert eng.write_file(path, spans, durable=False) == [crc(spans[0].data)]
    assert disk(path) == image(spans, spans[-1].end)


def test_engine_reused_across_many_files(make_engine, tmp_path, gen):
    eng = make_engine(queue_depth=2)
    datas = [rand(n, gen) for n in (1, 4096, 70_000, BUFFER * 2 + 1, 5)]
    for i, d in enumerate(datas):
        write_and_check(eng, tmp_path / f"f{i}.bin", [WriteSpan(i, d)])
    for i, d in enumerate(datas):
        read_and_check(eng, tmp_path / f"f{i}.bin", [WriteSpan(i, d)])


def test_bad_spans_rejected(make_engine, tmp_path, gen):
    eng = make_engine()
    path = tmp_path / "bad.bin"
    a = rand(100, gen)
    with pytest.raises(InvalidOptionError):
        eng.write_file(path, [WriteSpan(50, a), WriteSpan(60, a)])  # overlap
    with pytest.raises(InvalidOptionError):
        eng.write_file(path, [WriteSpan(200, a), WriteSpan(0, a)])  # unsorted
    with pytest.raises(InvalidOptionError):
        eng.write_file(path, [WriteSpan(0, a.view(torch.int8))])  # wrong dtype
    with pytest.raises(InvalidOptionError):
        eng.write_file(path, [WriteSpan(0, rand(200, gen)[::2])])  # not contiguous
    with pytest.raises(InvalidOptionError):
        eng.read_file(path, [ReadSpan(0, torch.empty(4, 4, dtype=torch.uint8))])  # not flat
    assert not path.exists()


def test_close_is_idempotent_and_context_manager(make_engine, tmp_path, gen):
    eng = make_engine()
    with eng as e:
        assert e is eng
        write_and_check(e, tmp_path / "cm.bin", [WriteSpan(0, rand(5000, gen))])
    eng.close()
    eng.close()


# --------------------------------------------------------------------------- zero-copy spans
# Large spans at 4 KiB-aligned offsets, in host memory as aligned as O_DIRECT needs on the
# file (statx: 512 bytes on this machine's virtio disk, 4 on NVMe), skip the staging buffers
# under O_DIRECT. Every engine must give the same bytes and crcs for every memory kind.
MEMORY_KINDS = ["aligned", "aligned+512", "aligned+64", "default"]
BIG = [1 * MiB, 1 * MiB + 3 * ALIGN, 2 * MiB + 123, 3 * MiB - 1]


def big_layout(kind: str, gen) -> list[WriteSpan]:
    """Small and large spans mixed, large ones at 4 KiB-aligned offsets, tails unaligned."""
    spans, off = [WriteSpan(0, rand(100, gen))], ALIGN
    for i, n in enumerate(BIG):
        spans.append(WriteSpan(off, host_tensor(n, kind, gen=gen)))
        off = -(-(off + n) // ALIGN) * ALIGN
        if i % 2:  # a small span right after the large one's last block, then a gap
            spans.append(WriteSpan(off, rand(777, gen)))
            off += 3 * ALIGN
    return spans


@pytest.mark.parametrize("memory", MEMORY_KINDS)
def test_large_spans_in_every_memory_kind(make_engine, tmp_path, gen, memory):
    eng = make_engine()
    spans = big_layout(memory, gen)
    path = tmp_path / f"big-{memory}.bin"
    crcs = write_and_check(eng, path, spans, size=spans[-1].end + 5000)
    for out_kind in MEMORY_KINDS:  # read back into every kind of destination memory
        outs = [ReadSpan(s.offset, host_tensor(s.data.numel(), out_kind, fill=0xA5)) for s in spans]
        assert eng.read_file(path, outs) == crcs
        for w, r in zip(spans, outs):
            assert torch.equal(w.data, r.out), f"{out_kind}: span at {w.offset} read back wrong"


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("memory", MEMORY_KINDS)
def test_zero_copy_taken_only_where_it_can_be(make_staged_engine, tmp_path, gen, monkeypatch, memory, zero_copy):
    """Count the bytes that pass through the staging buffers: under O_DIRECT, memory that the
    kernel accepts for direct I/O stages only its last partial block (unless zero_copy=False);
    everything else is staged whole."""
    import gdswriter.engines.staged as staged

    eng = make_staged_engine(zero_copy=zero_copy)
    n = 2 * MiB + 123
    spans = [WriteSpan(0, host_tensor(n, memory, gen=gen))]
    staged_bytes = []
    real_copy = staged.copy_bytes
    # Counting the bytes staged: the staging copy is internal to the engine, no public seam.
    monkeypatch.setattr(staged, "copy_bytes", lambda d, do, s, so, k: (staged_bytes.append(k), real_copy(d, do, s, so, k)))
    path = tmp_path / "zc.bin"
    write_and_check(eng, path, spans)
    written = sum(staged_bytes)
    staged_bytes.clear()
    out = host_tensor(n, memory, fill=0)
    eng.read_file(path, [ReadSpan(0, out)])
    assert torch.equal(out, spans[0].data)

    def staged_expected(t):
        taken = zero_copy and uses_direct(make_staged_engine.kind) and kernel_takes_direct_io_from(t, tmp_path)
        return 123 if taken else n

    assert (written, sum(staged_bytes)) == (staged_expected(spans[0].data), staged_expected(out))
    if memory == "aligned" and zero_copy and uses_direct(make_staged_engine.kind):
        assert (written, sum(staged_bytes)) == (123, 123), "page-aligned memory must go zero-copy"


@pytest.mark.parametrize("op", ["write", "read"])
def test_zero_copy_error_is_typed_and_engine_recovers(tmp_path, gen, io_small_options, op):
    """An errno in the middle of a zero-copy transfer: typed error, nothing left in flight
    (the kernel no longer touches the caller's memory), the engine works afterwards."""
    import errno

    from gdswriter.errors import EngineIOError

    spans = [WriteSpan(0, host_tensor(3 * MiB, "aligned", gen=gen)), WriteSpan(3 * MiB, rand(5000, gen))]
    path = tmp_path / "zc-fail.bin"
    with FaultInjectingEngine(io_small_options(), FaultPlan(fail_at_request=7, errno=errno.EIO, op=op)) as eng:
        if op == "read":
            eng.write_file(path, spans)
        outs = [ReadSpan(s.offset, host_tensor(s.data.numel(), "aligned", fill=0)) for s in spans]
        with pytest.raises(EngineIOError) as ei:
            eng.write_file(path, spans) if op == "write" else eng.read_file(path, outs)
        assert ei.value.errno == errno.EIO and str(path) in str(ei.value)
        assert eng._backend.in_flight == 0
        if op == "write":
            assert not path.exists(), "a failed write must not leave a partial file"
        eng.reset(FaultPlan())
        write_and_check(eng, path, spans)
        assert eng.read_file(path, outs) == [crc(s.data) for s in spans]
        assert all(torch.equal(s.data, o.out) for s, o in zip(spans, outs))
