"""The WriteSpan.guard contract, for every engine of the contract suite: a guarded span is read
only once its guard says it is ready, released once read (before write_file returns, also on
failure), and early enough that a producer streaming through a bounded buffer never stalls
the engine (the host snapshot pool relies on this)."""

from __future__ import annotations

import errno
import threading

import crc32c
import pytest
import torch

from gdswriter.engines.base import WriteSpan
from gdswriter.errors import EngineIOError
from gdswriter.engines import staged as staged_module
from gdswriter.testing.faults import FaultInjectingEngine, FaultPlan
from gdswriter.options import ALIGN, KiB, MiB
from support.engines import BUFFER, ENGINES, build_engine

WAIT_S = 30


class Guard:
    def __init__(self, producer: Producer, k: int):
        self.producer, self.k = producer, k
        self.ready = threading.Event()
        self.released = 0

    def is_ready(self) -> bool:
        self.producer.check()
        return self.ready.is_set()

    def wait_ready(self) -> None:
        if not self.ready.wait(WAIT_S):
            self.producer.check()
            raise AssertionError(f"span {self.k} never became ready")
        self.producer.check()

    def release(self) -> None:
        with self.producer.cv:
            if not self.ready.is_set() and self.producer.error is None:
                self.producer.problems.append(f"span {self.k} released before it was ready")
            self.released += 1
            self.producer.cv.notify_all()


class Producer:
    """Fills span k's memory (zeros until then) and marks it ready only while the bytes of
    spans that are ready and not yet released stay below ``limit``: a bounded buffer. The
    contract lets an engine hold two spans and a staging buffer's worth (SpanGuards)."""

    def __init__(self, sources: list[torch.Tensor], limit: int, fail_at: int | None = None):
        self.sources, self.limit, self.fail_at = sources, limit, fail_at
        self.targets = [torch.zeros_like(s) for s in sources]
        self.cv = threading.Condition()
        self.guards = [Guard(self, k) for k in range(len(sources))]
        self.problems: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def outstanding(self) -> int:
        return sum(s.numel() for s, g in zip(self.sources, self.guards) if g.ready.is_set() and not g.released)

    def run(self) -> None:
        for k, (src, dst, g) in enumerate(zip(self.sources, self.targets, self.guards)):
            with self.cv:
                if not self.cv.wait_for(lambda: self.outstanding() == 0 or self.outstanding() + src.numel() <= self.limit,
                                        WAIT_S):
                    self.problems.append(f"the engine kept {self.outstanding()} bytes unreleased: span {k} starved")
                    return
                if k == self.fail_at:
                    self.error = RuntimeError("the producer failed")
                    self.cv.notify_all()
                    return
            dst.copy_(src)
            g.ready.set()


def layout(gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Offsets and sizes: small spans, odd ones, several past 1 MiB (zero-copy under O_DIRECT)."""
    sizes = [3, 4096, 5000, (1 << 20) + 4096, 70_000, 2 * MiB, 1, 300 * KiB + 7, (1 << 20) + 123, 9000] * 3
    offsets, pos = [], 0
    for n in sizes:
        pos = -(-pos // ALIGN) * ALIGN if torch.randint(0, 2, (1,), generator=gen).item() else pos
        offsets.append(pos)
        pos += n
    return offsets, sizes


def guarded_spans(gen, limit_extra: int, fail_at=None):
    offsets, sizes = layout(gen)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    # page-aligned memory (as the host pool gives), so that large spans go zero-copy
    raw = torch.empty(sum(-(-n // ALIGN) * ALIGN for n in sizes) + ALIGN, dtype=torch.uint8)
    base = -raw.data_ptr() % ALIGN
    prod = Producer(sources, 2 * max(sizes) + limit_extra, fail_at)
    views, at = [], base
    for t in prod.targets:
        v = raw[at:at + t.numel()]
        v.zero_()
        views.append(v)
        at += -(-t.numel() // ALIGN) * ALIGN
    prod.targets = views
    spans = [WriteSpan(o, v, guard=g) for o, v, g in zip(offsets, views, prod.guards)]
    return prod, spans, offsets, sources


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_guarded_spans_are_read_only_when_ready_and_released_in_time(tmp_path, io_small_options, engine_kind):
    gen = torch.Generator().manual_seed(7)
    eng = build_engine(engine_kind, io_small_options)
    try:
        assert eng.honours_span_guards
        prod, spans, offsets, sources = guarded_spans(gen, 2 * BUFFER)
        prod.thread.start()
        crcs = eng.write_file(tmp_path / "f", spans)
        prod.thread.join(WAIT_S)
    finally:
        eng.close()
    assert prod.problems == []
    assert [g.released for g in prod.guards] == [1] * len(spans)
    data = (tmp_path / "f").read_bytes()
    for o, s in zip(offsets, sources):
        assert data[o:o + s.numel()] == s.numpy().tobytes(), f"span at {o} was read before it was ready"
    import crc32c
    assert crcs == [crc32c.crc32c(s.numpy().tobytes()) for s in sources]


@pytest.mark.parametrize("fail", ["producer", "engine"])
def test_failures_release_every_guard(tmp_path, io_small_options, fail):
    gen = torch.Generator().manual_seed(8)
    if fail == "engine":
        eng = FaultInjectingEngine(io_small_options(), FaultPlan(fail_at_request=5, errno=errno.EIO, op="write"))
        prod, spans, _, _ = guarded_spans(gen, 2 * BUFFER)
        expect = EngineIOError
    else:
        eng = build_engine("io_uring", io_small_options)
        prod, spans, _, _ = guarded_spans(gen, 2 * BUFFER, fail_at=4)
        expect = RuntimeError
    try:
        prod.thread.start()
        with pytest.raises(expect):
            eng.write_file(tmp_path / "f", spans)
        prod.thread.join(WAIT_S)
        assert not (tmp_path / "f").exists()  # the partial file is removed
        assert [g.released for g in prod.guards] == [1] * len(spans)
        # the engine stays usable
        plain = [WriteSpan(0, torch.arange(100, dtype=torch.uint8))]
        eng.write_file(tmp_path / "g", plain)
    finally:
        eng.close()


@pytest.mark.parametrize("engine_kind", ENGINES)
def test_spans_whose_checksum_the_producer_keeps_are_written_but_not_checksummed(tmp_path, io_small_options,
                                                                                   engine_kind, monkeypatch):
    """WriteSpan.checksum False (the host pool's pieces: the pool keeps its chunks' crc32c):
    the bytes are written all the same, the span's crc32c is 0 or its true value, and the
    io_uring/POSIX engines spend no checksum on it, whether written zero-copy or staged."""
    summed = []
    real = staged_module.crc_extend
    # Counting the bytes checksummed: the engines' crc32c is internal to them, no public seam.
    monkeypatch.setattr(staged_module, "crc_extend", lambda view, crc: (summed.append(len(view)), real(view, crc))[1])
    gen = torch.Generator().manual_seed(9)
    eng = build_engine(engine_kind, io_small_options)
    try:
        prod, spans, offsets, sources = guarded_spans(gen, 2 * BUFFER)
        keep = [k % 3 != 0 for k in range(len(spans))]  # the producer keeps two spans' checksums in three
        spans = [WriteSpan(s.offset, s.data, guard=s.guard, checksum=not kept) for s, kept in zip(spans, keep)]
        prod.thread.start()
        crcs = eng.write_file(tmp_path / "f", spans)
        prod.thread.join(WAIT_S)
        staged_engine = isinstance(eng, staged_module.StagedEngine)
    finally:
        eng.close()
    assert prod.problems == []
    data = (tmp_path / "f").read_bytes()
    for o, s in zip(offsets, sources):
        assert data[o:o + s.numel()] == s.numpy().tobytes()
    true = [crc32c.crc32c(s.numpy().tobytes()) for s in sources]
    assert all(crcs[k] == true[k] for k in range(len(spans)) if not keep[k])
    assert all(crcs[k] in (0, true[k]) for k in range(len(spans)) if keep[k])
    if staged_engine:
        assert sum(summed) == sum(s.numel() for s, kept in zip(sources, keep) if not kept)
        assert all(crcs[k] == 0 for k in range(len(spans)) if keep[k])
