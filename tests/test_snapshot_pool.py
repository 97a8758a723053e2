"""The host snapshot pool's ring: a piece may reuse a range of the pool only once every earlier
piece that wrote a byte of that range is freed (the engine will not read it again).

The allocation alone is checked property-based over unequal files, pool sizes and orders in
which one root's pieces come late; a save through the real pool and real engines checks the
same where the ring wraps short of a lagging root's last piece for laps on end.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from support import models as M
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gdswriter import GDSCheckpointer, load_state
from gdswriter.save import pool as snapshot_pool
from gdswriter.options import ALIGN, KiB, MiB
from gdswriter.planner.assign import FilePlan, FileTarget, SavePlan, cut_stream


# ----------------------------------------------------------------------------- the allocation
def pieces_of(files: list[tuple[int, list[int]]], piece: int, lag: int, lagging: int) -> list[snapshot_pool.Piece]:
    """The pieces of ``files`` ((root, sizes in bytes) per root) cut as _layout cuts them (at
    multiples of ``piece``, the last piece of a file shorter), in _layout's round-robin order
    over roots, except that root ``lagging``'s pieces come ``lag`` places late."""
    ring = snapshot_pool.Ring()
    queues = []
    for root, sizes in files:
        q = []
        for size in sizes:
            for lo in range(0, size, piece):
                p = snapshot_pool.Piece(ring, root, lo)
                p.hi = min(size, lo + piece)
                q.append(p)
        queues.append(q)
    order = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    place = {id(p): k + (lag if p.root == lagging else 0) for k, p in enumerate(order)}
    return sorted(order, key=lambda p: (place[id(p)], p.root == lagging))  # stable: each root's order kept


def check_no_range_reused_early(order: list[snapshot_pool.Piece], capacity: int) -> None:
    """Every piece lies in the pool, and for every byte (4 KiB unit: pieces are whole units) of
    its range, the last earlier piece that held that byte is freed before it is filled: it is
    among its blockers or among theirs, transitively (the copier fills a piece once its
    blockers are freed, and an engine frees a piece only after it was filled)."""
    last: dict[int, int] = {}  # pool unit -> index in order of the last piece that held it
    index = {id(p): k for k, p in enumerate(order)}
    before: list[set[int]] = []  # per piece: the pieces freed before it is filled
    for k, p in enumerate(order):
        assert p.ring % ALIGN == 0 and 0 <= p.ring and p.ring + p.length <= capacity, (k, p.ring, p.length, capacity)
        closure: set[int] = set()
        for b in p.blockers:
            j = index[id(b)]
            assert j < k, f"piece {k} waits for a later piece {j}"
            closure.add(j)
            closure |= before[j]
        before.append(closure)
        for u in range(p.ring // ALIGN, (p.ring + p.length) // ALIGN):
            j = last.get(u)
            assert j is None or j in closure, (
                f"piece {k} (root {p.root}, pool [{p.ring}, {p.ring + p.length})) reuses pool byte {u * ALIGN}, "
                f"last held by piece {j} (root {order[j].root}, pool [{order[j].ring}, "
                f"{order[j].ring + order[j].length})), without waiting until that piece is written")
            last[u] = k


U = ALIGN


@st.composite
def layouts(draw):
    """Unequal files on 1-3 roots, a piece size and a pool of 4 x roots pieces or more (as
    HostSnapshotPool.stream makes them), one root's pieces late by some places."""
    n_roots = draw(st.integers(1, 3))
    piece = draw(st.integers(1, 8)) * U
    capacity = draw(st.integers(4 * n_roots * piece // U, 4 * n_roots * piece // U + 40)) * U
    size = st.tuples(st.integers(1, 24 * piece // U), st.sampled_from([0, 0, 1, U - 1])).map(lambda t: t[0] * U - t[1])
    files = [(r, draw(st.lists(size, min_size=1, max_size=6))) for r in range(n_roots)]
    lagging = draw(st.integers(0, n_roots - 1))
    lag = draw(st.integers(0, 60))
    return files, piece, capacity, lag, lagging


# The case (hypothesis finds others against the old scan, 2 x capacity bytes back):
# a lagging root's last piece at the ring's tail; the other root's files of 7 pieces and a
# little make the ring wrap just short of it for two laps, until a longer file reaches it.
# The save below writes this layout.
TAIL = ([(0, [8 * U, 8 * U, 3 * 64 * U, 7 * 64 * U + 8 * U, 7 * 64 * U + 8 * U, 8 * 64 * U]),
         (1, [4 * 64 * U + 16 * U])], 64 * U, 8 * 64 * U, 0, 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
@example(TAIL)
def test_no_pool_range_is_reused_before_its_last_writer_is_freed(layout):
    files, piece, capacity, lag, lagging = layout
    order = pieces_of(files, piece, lag, lagging)
    snapshot_pool.allocate(order, capacity)
    check_no_range_reused_early(order, capacity)


def test_blockers_are_the_last_writers_only():
    """A piece waits for the last writer of each of its bytes and for nothing older: what those
    waited for is freed already (the interval map keeps the waits short)."""
    order = pieces_of([(0, [5 * 64 * U])], 64 * U, 0, 0)  # five full pieces, a pool of two
    snapshot_pool.allocate(order, 2 * 64 * U)
    assert [p.ring for p in order] == [0, 64 * U, 0, 64 * U, 0]
    assert [p.blockers for p in order] == [[], [], [order[0]], [order[1]], [order[2]]]
    order = pieces_of([(0, [2 * 64 * U, 32 * U, 64 * U])], 64 * U, 0, 0)
    snapshot_pool.allocate(order, 2 * 64 * U)  # the third piece (32 units) wraps; the fourth spans two
    assert [p.ring for p in order] == [0, 64 * U, 0, 32 * U]
    assert order[3].blockers == [order[0], order[1]]


# ----------------------------------------------------------------------------- a real save
P = 256 * KiB  # the piece size of a 2 MiB pool with 2 roots (2 MiB // (4 x 2))


SHARES = [32 * KiB, 32 * KiB, 3 * P, 7 * P + 32 * KiB, 7 * P + 32 * KiB, 8 * P, 4 * P + 64 * KiB]


def lagging_root_plan(n_bytes: int) -> SavePlan:
    """One storage of ``n_bytes`` cut into unequal files (as the GPU-local plan makes them):
    on root 0 two small files, one of 3 pieces, two of 7 pieces and a little, one of 8 pieces;
    on root 1 one file of 4 pieces and a little. Through a pool of 8 pieces, round-robin, root
    1's last piece lies at the ring's tail; the ring then wraps just short of it for two laps
    (root 0's 7-and-a-little files) before root 0's last file reaches it again."""
    assert sum(SHARES) == n_bytes
    targets = [FileTarget(0, f"data-r0-f{k}.bin") for k in range(6)] + [FileTarget(1, "data-r1-f0.bin")]
    per_file = cut_stream([n_bytes], SHARES)
    return SavePlan(tuple(FilePlan(t, sum(c.length for c in chunks), tuple(chunks))
                          for t, chunks in zip(targets, per_file)))


class _Watch:
    """Where root 1 lags: its last piece (``lagging``) is read by its engine only once root 0's
    engine wrote all its files (``go``) or once the copier waits for that piece (``go`` too:
    then the lag would hold the save forever)."""

    def __init__(self) -> None:
        self.lagging: snapshot_pool.Piece | None = None
        self.go = threading.Event()
        self.copier_waited = False
        self.order: list[snapshot_pool.Piece] = []
        self.capacity = 0


class _LaggingGuard:
    """The span guard of root 1's last piece as root 1's engine sees it: not ready until ``go``."""

    def __init__(self, piece, watch: _Watch):
        self.piece, self.watch = piece, watch

    def is_ready(self) -> bool:
        return self.watch.go.is_set() and self.piece.is_ready()

    def wait_ready(self) -> None:
        assert self.watch.go.wait(120), "neither root 0 finished nor the copier waited for root 1"
        self.piece.wait_ready()

    def release(self) -> None:
        self.piece.release()


def test_lagging_root_piece_is_not_overwritten_before_it_is_written(tmp_path: Path, monkeypatch):
    """A real save (2 roots, real engines, a 2 MiB pool for a 7.6 MiB state, files of unequal size) whose root 1 lags
    on its last piece; the step must load with every checksum right and bit-exact bytes."""
    watch = _Watch()
    slot = snapshot_pool.Piece.__dict__["freed"]  # the slot the pool sets and reads

    class WatchedPiece(snapshot_pool.Piece):
        """Tells ``watch`` when the copier finds the lagging piece not freed: it waits for it."""

        __slots__ = ()

        @property
        def freed(self) -> bool:
            v = slot.__get__(self)
            if not v and self is watch.lagging and threading.current_thread().name == "gdswriter-snapshot":
                watch.copier_waited = True
                watch.go.set()
            return v

        @freed.setter
        def freed(self, v: bool) -> None:
            slot.__set__(self, v)

    real_allocate = snapshot_pool.allocate

    def allocate(order, capacity):
        real_allocate(order, capacity)
        watch.order, watch.capacity = list(order), capacity
        watch.lagging = [p for p in order if p.root == 1][-1]

    # Watching the pool's pieces and their allocation: internal to save/pool.py, no public seam.
    monkeypatch.setattr(snapshot_pool, "Piece", WatchedPiece)
    monkeypatch.setattr(snapshot_pool, "allocate", allocate)

    n_bytes = sum(SHARES)
    g = torch.Generator().manual_seed(22)
    state = {"w": torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=g)}
    plan = lagging_root_plan(n_bytes)
    roots = [tmp_path / "a", tmp_path / "b"]
    with GDSCheckpointer(state, None, roots, options=M.small_options(snapshot="host",
                                                                      snapshot_pool_bytes=2 * MiB)) as ck:
        # A plan that makes one root lag: the session takes no plan from outside (an argument for tests only).
        monkeypatch.setattr(ck.session, "new_plan", lambda sizes, devices, targets: plan)
        e0, e1 = ck.engines
        root0_files = sum(1 for f in plan.files if f.target.root == 0)
        written = []

        def write0(path, spans, _real=e0.write_file, **kw):
            try:
                got = _real(path, spans, **kw)
            except BaseException:  # the save fails: root 1 need not lag any more
                watch.go.set()
                raise
            written.append(path)
            if len(written) == root0_files:
                watch.go.set()
            return got

        def write1(path, spans, _real=e1.write_file, **kw):
            assert spans[-1].guard is watch.lagging
            return _real(path, [*spans[:-1], replace(spans[-1], guard=_LaggingGuard(spans[-1].guard, watch))], **kw)

        monkeypatch.setattr(e0, "write_file", write0)
        monkeypatch.setattr(e1, "write_file", write1)
        try:
            ck.save(1)
        finally:
            watch.go.set()

    # The premise: the pool is 8 pieces; root 1's last piece lies at its tail, and the next
    # piece to reuse any of its bytes comes more than 2 x capacity bytes of pieces later.
    order, q = watch.order, watch.lagging
    assert watch.capacity == 8 * P and max(p.length for p in order) == P
    k = order.index(q)
    later = [j for j in range(k + 1, len(order))
             if order[j].ring < q.ring + q.length and q.ring < order[j].ring + order[j].length]
    assert later and q.ring > 7 * P
    assert sum(p.length for p in order[k + 1:later[0]]) > 2 * watch.capacity

    _, got = load_state(roots, 1)  # every chunk's checksum verified
    assert torch.equal(got["model"]["w"], state["w"])
    assert watch.copier_waited, "the piece that reuses root 1's last range did not wait for it"


def test_a_later_save_copies_from_where_the_tensors_are_now(tmp_path):
    """A training loop's saves reuse the pool's layout of the files (the copies' addresses)
    while the state's layout is the same; a tensor replaced by one of the same size at another
    address (the old one still alive, other values) is copied from its new memory."""
    state = {f"t{i}": torch.full((3000,), float(i)) for i in range(200)}
    old = state["t7"]
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options(snapshot="host")) as ck:
        ck.save(1)
        for t in state.values():
            t.add_(1.0)
        ck.save(2)  # the same layout: the pool's layout of the files again
        state["t7"] = torch.full((3000,), -5.0)
        ck.save(3)
    assert torch.equal(old, torch.full((3000,), 8.0))
    for step in (1, 2, 3):
        got = load_state(tmp_path, step)[1]["model"]
        for i in range(200):
            want = -5.0 if (step, i) == (3, 7) else float(i + min(step, 2) - 1)
            assert torch.equal(got[f"t{i}"], torch.full((3000,), want)), (step, i)


def test_host_addresses_are_each_extents_host_address(tmp_path):
    """The pool's column of extent addresses (snapshot.host_addresses, C-level passes where every
    extent views a CPU storage) is what host_address gives each extent: views at offsets,
    a copy taken at the call, an empty extent."""
    from gdswriter.save.snapshot import LayoutCache, host_addresses, take_snapshot

    base = torch.arange(64, dtype=torch.float32)
    alone = {f"t{i}": torch.full((i + 3,), float(i)) for i in range(20)}
    mixed = {"view": base[5:40], "tie": base[7:9], "odd": torch.ones(9, dtype=torch.float16)[3:],
             "small": torch.ones(4)}
    for state in (alone, mixed):  # protected: every extent a view of its live storage
        snap = take_snapshot(state, 1, protected=list(state.values()), layout=LayoutCache())
        assert not any(e.captured for e in snap.extents)
        want = [e.host_address() for e in snap.extents]
        assert host_addresses(snap.extents) == want
        assert sorted(want) == sorted({e.host_address() for e in snap.extents})  # one address each
    snap = take_snapshot(alone, 1, layout=LayoutCache())  # nothing protected: the small ones are copies
    assert any(e.captured for e in snap.extents)
    assert host_addresses(snap.extents) == [e.host_address() for e in snap.extents]


# ----------------------------------------------------------------------------- the files it lays out
def _varied_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of the sizes a state holds (zero-byte, packed, a few KiB, larger than a piece),
    random values, some of other dtypes."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 3, 17, 100, 700, 1023, 1024, 5000, 70_000, 300_000, 90_000]
    picks = torch.randint(0, len(sizes), (60,), generator=g).tolist()
    state = {}
    for i, k in enumerate(picks):
        dtype = (torch.float32, torch.bfloat16, torch.int8, torch.float64)[i % 4]
        state[f"t{i}"] = torch.randn(sizes[k], generator=g).to(dtype)
    return state


def _data_files(root: Path, step: int) -> dict[str, bytes]:
    folder = next(p for p in root.iterdir() if p.name.startswith("step_") and int(p.name[5:]) == step)
    files = {p.name: p.read_bytes() for p in sorted(folder.glob("data-*.bin"))}
    assert len(files) == 2, files.keys()  # 2 files per root
    return files


@pytest.mark.parametrize("seed", range(3))
def test_the_pools_files_are_the_live_saves_byte_for_byte(tmp_path: Path, seed: int):
    """The pool lays its files out in columns (pieces, chunks cut where pieces end, the gaps the
    copier zeroes): the files must hold exactly what a live save (the engines read the tensors
    themselves) writes, on 2 roots of 2 files each through a pool of 8 pieces, for a first save
    and for a later one whose sizes changed (the pool then holds the earlier save's bytes,
    which no gap may let through); the step loads back bit-exact."""
    state = _varied_state(seed)
    dirs = {mode: [tmp_path / mode / "a", tmp_path / mode / "b"] for mode in ("host", "live")}
    cks = {mode: GDSCheckpointer(state, None, dirs[mode], options=M.small_options(
        snapshot=mode, snapshot_pool_bytes=2 * MiB, files_per_root=2)) for mode in dirs}
    try:
        for step in (1, 2):
            for ck in cks.values():
                ck.save(step)
            for a, b in zip(dirs["host"], dirs["live"]):
                got, want = _data_files(a, step), _data_files(b, step)
                assert got.keys() == want.keys() and got == want, (step, [k for k in got if got[k] != want.get(k)])
            loaded = load_state(dirs["host"], step)[1]["model"]
            assert all(torch.equal(loaded[k], t) for k, t in state.items())
            for k in list(state)[::3]:  # other sizes: another layout, through the same pool
                state[k] = torch.randn(state[k].numel() + 777)
    finally:
        for ck in cks.values():
            ck.close()
