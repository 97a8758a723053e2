"""The host snapshot: a bounded, reusable pool that a save copies the live tensors into while
the same save writes the copied bytes to the files (snapshot mode "host").

The pool is one page-aligned region (engines/buffers.py: huge-page aligned, mlocked where
allowed; registered with CUDA, portable, when the state holds CUDA tensors) of the space a
save needs, up to ``bound``, reused by every later save; it grows only when a later state
needs more, never past ``bound``.

Reserving it stays off the critical path. Fresh memory is slow to map, touch and lock (on
this project's VM 2 GiB took 4-5 s, more than writing them; pinning for CUDA runs at about
4 GB/s), so a save never waits for a pool larger than STREAM_BYTES: when the pool it needs
is not there yet, the save streams through a small ring of STREAM_BYTES (or the deadlock
floor below, if larger) at the disk's speed, and, once an asynchronous save (``grow``) is
committed, a helper thread reserves the full pool (``reserve_ahead``), which the next save
that starts after it is ready takes over (until then saves keep streaming through the
ring; an optimizer step after such a save_async waits until all but the ring's worth is
written). A blocking save (``grow`` False) never asks for it: its caller waits for the
whole write anyway, and the small ring is as fast. What a process holds between saves:
per open checkpointer, one pool of min(state, bound) bytes once an asynchronous save has
asked for it (else at most the small ring: 64 MiB, or the floor), and the one kept pool
below; while the helper runs, the ring and the pool it reserves.

The ring itself is locked ahead (new_region): mapped at once, locked front to back by a
thread of its own while the save lays out its pieces, the copier waiting before each piece
until its range is page-locked. So a process's first save does not wait for all of it to
be faulted in before it copies a byte (6-260 ms for 64 MiB on this project's VM, which gives
freed memory back to its host); its faulting overlaps the layout, the copy and the writes.

Kept for the process: ``close()`` hands the pool to a single process-wide slot instead of
unmapping it, and the next pool that needs that much takes it (a checkpointer created per
save, as an integration may, then saves through a ready pool from its first save). The slot
holds one pool, the largest handed to it (a smaller one is freed); ``release_kept_pool()``
frees it. A checkpointer closed while its helper still reserves does not wait for it: the
helper hands its pool to the slot when done, and a later helper first waits for such
handovers and takes the kept pool rather than mapping a second one. So a process holds its
open checkpointers' pools plus one (plus, until such a handover lands, the pool it brings).

A save lays its files out in the pool piece by piece: each file is cut at multiples of
the piece size, and a piece is the file's own bytes for its range (the copier zeroes the
alignment gaps between chunks), so it sits in the pool at the same 4 KiB phase as in the
file and the engine writes it as one span, zero-copy (laid out in numpy columns where every
extent is in host memory: Python objects per piece, tuples per copy made by zip; a later
save of the same layout reuses it, _LayoutTemplate). Pieces take the pool in turn, as a
ring: a piece that does not fit waits until the pieces it would overwrite were written
(the engine releases each span once it will not read it again; engine.SpanGuards): for
each of its bytes, the last piece that held it, however many laps back (allocate). One
copier thread fills the pieces in the order the engines write them (round-robin over
roots); the engines start writing a piece as soon as it is filled. The pool keeps each
chunk's crc32c, so the engines checksum nothing (WriteSpan.checksum False): one flat list
per save (Ring.crcs), a slot per copy, and per chunk the slot of its copy (a column the
layout template keeps). On the CPU the
copier uses memmove and checksums each cache-sized piece of the copy right after it (the
GIL is released for both), reading the copy from cache; from a GPU it queues
device-to-host copies on each device's side stream, behind the event save_async recorded;
a piece is ready when its copy events complete, and its chunks are then checksummed from
the pool.

Deadlock freedom: an engine waiting for a piece keeps at most the spans of its current
staging buffer and of the span it is in (it reaps its finished requests while it waits),
so with a pool of at least 4 x roots x max(piece, staging buffer) bytes the piece the
copier needs next never overlaps what a waiting engine holds. An engine that fails holds the
room of the pieces it will never write: the save stops at once (``stream``'s stop), so that
the copier and the other engines do not wait for it.

Test seams: ``Piece``, ``Ring``, ``allocate``, ``copy_all``, ``copy_in`` and ``new_region`` are
public so that tests can build pieces, check the allocation, and wrap a step (monkeypatch the
module attribute: the pool looks each up at call time) to delay it or inject a fault at exactly
that point. They are not part of the checkpoint API; keep them module-level and looked up so.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import chain

import numpy as np
import torch
from crc32c import crc32c as _crc32c

from ..crc import native_gather_copies
from ..cuda import streams
from ..engines.base import WriteSpan
from ..engines.buffers import HUGE_PAGE, AlignedBufferPool, StagingBuffer
from ..engines.staged import FUSED_BYTES
from ..options import ALIGN, MiB
from .._log import log_once
from ..planner.assign import PlannedChunk, SavePlan
from ..threads import gc_paused
from .snapshot import Snapshot

log = logging.getLogger("gdswriter")

PIECE_MAX = 16 * MiB  # a piece is written while the next one is copied
STREAM_BYTES = 64 * MiB  # a save streams through this much while the full pool is not reserved yet
GAP_BYTES = 8 << 10  # a piece with a gap per fewer bytes than this is zeroed whole (_zero_gaps)

_kept_lock = threading.Lock()
_kept: tuple[AlignedBufferPool, bool] | None = None  # the process's kept pool, and whether it was to be locked
_handing: set[threading.Thread] = set()  # reservations of closed pools, each to hand its pool to _kept


def _align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class Ring:
    """What the copier and the engines share: one condition, the first error, and the pool's
    bytes (``view``, set once the pool is reserved; ``locked(end)`` waits until [0, end) of
    them is page-locked, where the region is still being locked: see new_region)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.error: BaseException | None = None
        self.view: memoryview | None = None
        # the crc32c of every copy of the save, at its slot (Piece.base + its index in the
        # piece's copies), and a last 0: an empty chunk's (slot -1)
        self.crcs: list[int] = [0]
        self.locked: Callable[[int], object] = _no_wait

    def fail(self, error: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = error
            self.cv.notify_all()


class _Stopped(Exception):
    """The save failed elsewhere: the copier stops."""


class Piece:
    """A file range [lo, hi) laid out at ``ring`` in the pool, written by the engine as one span
    (so its gaps, the alignment padding between chunks, are zeroed by the copier); the
    SpanGuard of that span. The crc32c of its copy k goes to ``ring_state.crcs[base + k]``:
    computed by the copier as it copies from host memory, or, for a copy from a GPU, from the
    pool once the copy's events completed (the first time the engine finds the piece ready)."""

    __slots__ = ("base", "blockers", "copies", "events", "freed", "gaps", "hi", "lo", "ready", "ring", "ring_state",
                 "root", "unsummed")

    def __init__(self, ring_state: Ring, root: int, lo: int):
        self.ring_state, self.root, self.lo, self.hi = ring_state, root, lo, lo
        # (offset in the piece, length, source): the source's bytes as a flat uint8 tensor, or
        # (address, length) of bytes in host memory (no tensor per chunk, see _layout)
        self.copies: list[tuple[int, int, torch.Tensor | tuple[int, int]]] = []
        self.gaps: list[tuple[int, int]] = []  # (offset in the piece, length) of bytes no copy fills
        self.base = 0  # the slot of its first copy's crc32c in ring_state.crcs (number_copies)
        self.unsummed: list[tuple[int, int, int]] = []  # (slot, offset, length) of copies from a GPU to checksum
        self.ring = 0
        self.blockers: list[Piece] = []  # earlier pieces whose pool range this one reuses
        self.ready = False
        self.events: dict = {}
        self.freed = False

    @property
    def length(self) -> int:
        return _align_up(self.hi - self.lo)

    def add(self, rel: int, n: int, src: torch.Tensor | tuple[int, int]) -> None:
        """Lay the ``n`` bytes of ``src`` (a flat tensor, or (address, n) in host memory) at ``rel``. Every byte
        below ``hi`` that no copy fills lies in a gap (in any order of adding; a gap may also
        hold copies: the copier zeroes gaps first)."""
        end = self.hi - self.lo
        if rel > end:
            self.gaps.append((end, rel - end))
        self.copies.append((rel, n, src))
        self.hi = max(self.hi, self.lo + rel + n)

    def _sum_device_copies(self) -> None:
        """Checksum the copies from a GPU now that their bytes are in the pool."""
        view, at, crcs = self.ring_state.view, self.ring, self.ring_state.crcs
        for j, rel, n in self.unsummed:
            crcs[j] = _crc32c(view[at + rel:at + rel + n])  # type: ignore[index]
        self.unsummed = []

    # -- SpanGuard ----------------------------------------------------------------
    def is_ready(self) -> bool:
        if not self.ready:
            if self.ring_state.error is not None:
                raise self.ring_state.error
            return False
        if not streams.events_done(self.events):
            return False
        if self.unsummed:
            self._sum_device_copies()
        return True

    def wait_ready(self) -> None:
        st = self.ring_state
        with st.cv:
            while not self.ready and st.error is None:
                st.cv.wait()
            if not self.ready:
                raise st.error  # type: ignore[misc]
        streams.host_wait(self.events)
        if self.unsummed:
            self._sum_device_copies()

    def release(self) -> None:
        with self.ring_state.cv:
            self.freed = True
            self.ring_state.cv.notify_all()


def _wait_handovers() -> None:
    """Wait for the reservations that closed pools left running (each hands its pool to the
    kept slot when it finishes: HostSnapshotPool.close)."""
    me = threading.current_thread()
    with _kept_lock:
        helpers = [h for h in _handing if h is not me]  # a helper closed before it got here: not itself
    for helper in helpers:
        helper.join()


def release_kept_pool() -> int:
    """Free the pool kept for the process (see the module docstring), once the reservations
    that closed checkpointers left running have handed theirs over; returns its size in bytes
    (0 if none was kept). Pools of open checkpointers are theirs: close() hands them here."""
    global _kept
    _wait_handovers()
    with _kept_lock:
        kept, _kept = _kept, None
    if kept is None:
        return 0
    kept[0].close()
    return kept[0].size


def kept_pool_bytes() -> int:
    """The size of the pool kept for the process (0: none)."""
    kept = _kept
    return kept[0].size if kept is not None else 0


def _keep(mem: AlignedBufferPool, lock_memory: bool) -> None:
    """Hand ``mem`` to the process's slot; the smaller of it and the one kept there is freed."""
    global _kept
    drop: AlignedBufferPool | None = mem
    with _kept_lock:
        if _kept is None or _kept[0].size < mem.size:
            drop = _kept[0] if _kept is not None else None
            _kept = (mem, lock_memory)
    if drop is not None:
        drop.close()


def _take_kept(size: int, most: int, lock_memory: bool) -> AlignedBufferPool | None:
    """The kept pool, if it holds ``size`` to ``most`` bytes and was locked as asked."""
    global _kept
    with _kept_lock:
        if _kept is None or not size <= _kept[0].size <= most or _kept[1] != lock_memory:
            return None
        mem, _kept = _kept[0], None
        return mem


def _no_wait(end: int) -> bool:
    return True


def new_region(size: int, lock_memory: bool) -> AlignedBufferPool:
    """A pool region, locked ahead (engines/buffers.py): it is returned at once, and a thread
    locks it front to back while the save lays out its pieces and the copier fills the
    first ones; the copier waits before each piece until its range is locked (copy_all), so
    the engines still write from page-locked memory only, and the kernel's zeroing of fresh
    pages overlaps the copy and the writes instead of preceding them."""
    return AlignedBufferPool(size, 1, lock_memory=lock_memory, lock_ahead=True)


class HostSnapshotPool:
    """Host memory for "host" snapshots, at most ``bound`` bytes (see the module docstring).
    ``window``: the engines' staging buffer size (the pool is never smaller than what
    keeps the pipeline deadlock-free: 4 x roots x window, or the state's size if smaller).
    ``grow``: whether the next save, if it has to stream through the small ring, has the
    full pool reserved afterwards on a helper thread (the checkpointer sets it per save:
    False for a blocking save). Saves use the pool one at a time."""

    def __init__(self, bound: int, *, window: int, lock_memory: bool):
        self.bound, self.window, self.lock_memory = bound, window, lock_memory
        self.grow = True
        self._mem: AlignedBufferPool | None = None
        self._lock = threading.Lock()  # guards what the helper thread hands over
        self._grown: AlignedBufferPool | None = None  # reserved by the helper, taken by the next save
        self._growing = 0  # the size the helper is reserving (0: none running)
        self._helper: threading.Thread | None = None
        self._wanted: tuple[int, int | None] | None = None  # (size, CUDA device) the last save lacked
        self._last_layout: _LayoutTemplate | None = None  # the last save's layout of its files (_layout)
        self._closed = False

    @property
    def capacity(self) -> int:
        return self._mem.size if self._mem is not None else 0

    @property
    def address(self) -> int | None:
        """Where the pool's region starts (None: no region yet): the same while saves reuse it."""
        return self._mem.buffers[0].address if self._mem is not None else None

    @property
    def reserving(self) -> bool:
        """Whether the helper thread is reserving the full pool now."""
        return self._growing > 0

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """Wait until no helper thread reserves a pool (False after ``timeout`` s)."""
        helper = self._helper
        if helper is not None:
            helper.join(timeout)
            return not helper.is_alive()
        return True

    def _reserve(self, need: int, n_roots: int, cuda_device: int | None) -> tuple[StagingBuffer, int]:
        """The region this save streams through, and the size the full pool would have."""
        floor = 4 * n_roots * self.window
        want = min(need, max(self.bound, floor))
        if need > want:
            log_once(f"snapshot-streams:{self.bound}",
                     f"gdswriter: the checkpoint ({need / MiB:.0f} MiB) is larger than the snapshot pool "
                     f"({want / MiB:.0f} MiB, snapshot_pool_bytes): it streams through the pool, so the optimizer "
                     f"step after save_async also waits until all but the pool's worth is written", logging.INFO)
        if self.bound < floor < need:
            log_once("snapshot-floor", f"gdswriter: snapshot_pool_bytes={self.bound} is below the {floor / MiB:.0f} "
                                       f"MiB the pipeline needs with {n_roots} root(s) and {self.window >> 20} MiB "
                                       f"staging buffers; using {floor / MiB:.0f} MiB", logging.INFO)
        ring = min(want, max(floor, STREAM_BYTES))  # what a save streams through until the full pool is there
        most = _align_up(max(self.bound, floor), HUGE_PAGE)  # a kept pool larger than the bound is not taken
        self._adopt_grown()
        if self._mem is None or self._mem.size < want:
            for size in (want, ring):
                if self._mem is not None and self._mem.size >= size:
                    break
                kept = _take_kept(_align_up(size, HUGE_PAGE), most, self.lock_memory)
                if kept is not None:
                    self._free_mem()
                    self._mem = kept
                    break
            if self._mem is None or self._mem.size < ring:
                self._free_mem()
                size = _align_up(ring, HUGE_PAGE)
                log.debug("gdswriter: allocating a %d MiB host snapshot pool", size >> 20)
                self._mem = new_region(size, self.lock_memory)
        if cuda_device is not None:  # registered once, portable to every GPU, unregistered by close()
            self._mem.pin_for_cuda(torch.device("cuda", cuda_device))
        return self._mem.buffers[0], _align_up(want, HUGE_PAGE)

    def _adopt_grown(self) -> None:
        """Take the pool the helper reserved, if it is ready and larger (the old one is free:
        saves use the pool one at a time, and this runs at a save's start)."""
        with self._lock:
            grown, self._grown = self._grown, None
        if grown is None:
            return
        if self._mem is not None and self._mem.size >= grown.size:
            grown.close()
            return
        self._free_mem()
        self._mem = grown

    def _free_mem(self) -> None:
        if self._mem is not None:
            self._mem.close()
            self._mem = None

    def reserve_ahead(self) -> None:
        """After a save that streamed through the small ring with ``grow`` set: reserve the full
        pool on a helper thread, for the next save to take (called once the save is committed,
        so that the helper's page faults and mlock do not slow the save itself)."""
        wanted, self._wanted = self._wanted, None
        if wanted is not None:
            self._reserve_ahead(*wanted)

    def _reserve_ahead(self, size: int, cuda_device: int | None) -> None:
        """Reserve a pool of ``size`` bytes on a helper thread, for the next save to take."""
        with self._lock:
            if self._closed or self._growing >= size or (self._grown is not None and self._grown.size >= size):
                return
            if self._growing:  # a smaller one is under way: the next save asks again
                return
            self._growing = size

        most = _align_up(max(self.bound, size), HUGE_PAGE)

        def reserve() -> None:
            mem = None
            try:
                _wait_handovers()  # a closed checkpointer's reservation, to take instead of a second region
                mem = _take_kept(size, most, self.lock_memory)
                if mem is None:
                    log.debug("gdswriter: reserving a %d MiB host snapshot pool ahead", size >> 20)
                    mem = new_region(size, self.lock_memory)
                    mem.finish_locking()  # the next save takes it ready
                if cuda_device is not None:
                    mem.pin_for_cuda(torch.device("cuda", cuda_device))
            except BaseException as e:  # noqa: BLE001 - the saves keep streaming through the ring
                log.warning("gdswriter: reserving a %d MiB host snapshot pool failed (%s: %s); saves stream "
                            "through a %d MiB ring", size >> 20, type(e).__name__, e, self.capacity >> 20)
                if mem is not None:
                    mem.close()
                mem = None
            with self._lock:
                self._growing = 0
                closed = self._closed
                if mem is not None and not closed:
                    old, self._grown = self._grown, mem
                    mem = old
            if mem is not None and closed:  # its checkpointer closed meanwhile: kept for the process
                _keep(mem, self.lock_memory)
            elif mem is not None:  # replaced: nobody takes it
                mem.close()
            with _kept_lock:
                _handing.discard(threading.current_thread())

        helper = threading.Thread(target=reserve, name="gdswriter-pool-reserve", daemon=True)
        self._helper = helper  # wait_reserved joins it; close hands it over
        helper.start()

    def close(self) -> None:
        """Stop using the pool: hand it, or the larger one the helper reserved, to the process's
        kept slot (see the module docstring). A reservation still in progress is not waited for
        (mapping and locking gigabytes takes seconds, and close runs on the caller's thread: an
        integration closes a checkpointer per save): it hands its pool to the slot when it is done."""
        helper = self._helper
        with self._lock:
            self._closed = True
            grown, self._grown = self._grown, None
            if helper is not None and self._growing:
                with _kept_lock:
                    _handing.add(helper)
        for mem in (grown, self._mem):
            if mem is not None:
                _keep(mem, self.lock_memory)
        self._mem = None

    @contextmanager
    def stream(self, snap: Snapshot, plan: SavePlan, release) -> Iterator[PoolStream]:
        """Yields a PoolStream: per file of ``plan``, the spans that write it from the pool
        (one per piece, guarded by the piece), while a copier thread fills them; ``release``
        is set once every byte is copied (on a GPU: queued, with the side streams' events).
        ``stop(error)`` fails the save at once: the copier stops and engines waiting for a
        piece raise ``error``. Call it as soon as one engine fails (its unwritten files hold
        room the copier waits for; the others would wait for the copier forever). Leaving with
        an error stops the copier too. Once every file is written, ``chunk_crcs()`` gives the
        crc32c of every chunk of ``plan``, cut where pieces end."""
        ring = Ring()
        n_roots = len({f.target.root for f in plan.files})
        need = sum(_align_up(f.size) for f in plan.files)
        if not need:  # nothing but empty tensors: nothing to copy
            release.set()
            chunks = [c for f in plan.files for c in f.chunks]
            yield PoolStream([[] for _ in plan.files], ring.fail, chunks, [-1] * len(chunks), ring.crcs)
            return
        devices = sorted(snap.ready)
        device = devices[0] if devices else None
        buf, full = self._reserve(need, n_roots, device)
        mem = self._mem
        ring.view, ring.locked = buf.view, mem.wait_locked  # type: ignore[union-attr]
        piece = max(ALIGN, min(PIECE_MAX, buf.size // (4 * n_roots)) // ALIGN * ALIGN)
        with gc_paused():  # a view and a chunk per tensor, no cycles (see gc_paused)
            order, pieces_per_file, chunks, slots = self._layout(snap, plan, ring, piece)
            ring.crcs = [0] * (order[-1].base + len(order[-1].copies) + 1 if order else 1)
            allocate(order, buf.size)
            spans = [[(p, WriteSpan(p.lo, buf.tensor[p.ring:p.ring + p.hi - p.lo], guard=p, checksum=False))
                      for p in pieces] for pieces in pieces_per_file]
        copier = threading.Thread(target=copy_all, args=(snap, order, ring, buf, release),
                                  name="gdswriter-snapshot", daemon=False)
        copier.start()
        try:
            yield PoolStream(spans, ring.fail, chunks, slots, ring.crcs)
        except BaseException as e:
            ring.fail(e)
            raise
        finally:
            copier.join()
            mem.finish_locking()  # the rest of a region that the pieces did not reach: in this save
        if ring.error is not None:  # the copier failed after the engines had every byte
            raise ring.error
        if self.grow and buf.size < full:  # streamed through the ring: the full pool, for reserve_ahead
            self._wanted = (full, device)

    def _layout(self, snap: Snapshot, plan: SavePlan, ring: Ring, piece: int):
        """_layout, or the last save's layout again (as new pieces) where it is a function of
        the same things: the same plan and piece size over extents of the same layout
        (Snapshot.layout_key: the same memory), all in host memory. In a training loop, every
        save after the first: no Python step per chunk but one to map it to its piece."""
        last = self._last_layout
        if last is not None and snap.layout_key is not None and last.fits(snap, plan, piece):
            return last.rebuild(ring)
        order, per_file, chunks, slots, hosted = _layout(snap, plan, ring, piece)
        self._last_layout = _LayoutTemplate.of(snap, plan, piece, order, per_file, chunks, slots, hosted)
        return order, per_file, chunks, slots


class PoolStream:
    """What a save writes through the pool (see HostSnapshotPool.stream)."""

    def __init__(self, spans: list[list[tuple[Piece, WriteSpan]]], stop: Callable[[BaseException], None],
                 chunks: list[PlannedChunk], slots: list[int], crcs: list[int]):
        # per chunk, the slot of its copy's crc32c in ``crcs`` (-1: empty, the last 0)
        self.spans, self.stop, self._chunks, self._slots, self._crcs = spans, stop, chunks, slots, crcs

    def chunk_crcs(self) -> ChunkCrcs:
        """Every chunk's crc32c, as its bytes were copied into the pool (0 for an empty chunk)."""
        return ChunkCrcs(self._chunks, list(map(self._crcs.__getitem__, self._slots)))


class ChunkCrcs(Mapping):
    """Chunk -> crc32c, as two parallel lists: what the manifest iterates over (in order), with
    no hash of a chunk (a PlannedChunk's dataclass hash runs in Python: tens of ms per 100,000
    chunks); looking a chunk up builds the dict once."""

    __slots__ = ("_by_chunk", "chunks", "crcs")

    def __init__(self, chunks: list[PlannedChunk], crcs: list[int]) -> None:
        self.chunks, self.crcs = chunks, crcs
        self._by_chunk: dict[PlannedChunk, int] | None = None

    def __getitem__(self, chunk: PlannedChunk) -> int:
        if self._by_chunk is None:
            self._by_chunk = dict(zip(self.chunks, self.crcs))
        return self._by_chunk[chunk]

    def __iter__(self) -> Iterator[PlannedChunk]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def values(self):  # type: ignore[override]
        return self.crcs

    def items(self):  # type: ignore[override]
        return list(zip(self.chunks, self.crcs))  # a list, not a one-pass iterator: iterable again, as a view is


def _layout(snap: Snapshot, plan: SavePlan, ring: Ring, piece: int):
    """Cut every file into pieces; returns the pieces in copy order (round-robin over roots,
    each root's files in plan order, their copies numbered: number_copies), each file's
    pieces, every chunk of the plan, cut at piece ends, the slot of each one's crc32c
    (Ring.crcs; -1: an empty chunk), and whether every extent was in host memory (the usual
    state: laid out in columns, _layout_host; else chunk by chunk, _layout_each)."""
    hosts = snap.host_addresses()  # host memory: copied from its address, no tensor per chunk
    laid = _layout_host(plan, hosts, ring, piece) if None not in hosts else None
    if laid is None:
        return (*_layout_each(snap, plan, ring, piece, hosts), False)
    return (*laid, True)


def number_copies(order: Sequence[Piece]) -> None:
    """Give each piece the slot of its first copy's crc32c in the save's Ring.crcs: the copies
    numbered in copy order."""
    at = 0
    for p in order:
        p.base = at
        at += len(p.copies)


def _layout_each(snap: Snapshot, plan: SavePlan, ring: Ring, piece: int, hosts: list[int | None]):
    """_layout chunk by chunk (extents a GPU holds, or a plan whose files are not in order):
    the usual chunk (host memory, inside one piece) inline, the others by _cut."""
    per_root: dict[int, list[Piece]] = {}
    per_file = []
    chunks: list[tuple[PlannedChunk, Piece | None, int]] = []  # (chunk, its piece, its copy's index there)
    for fp in plan.files:
        root = fp.target.root
        queue = per_root.setdefault(root, [])
        pieces: dict[int, Piece] = {}
        for c in fp.chunks:
            n = c.length
            if n == 0:
                chunks.append((c, None, 0))
                continue
            pos, host = c.file_offset, hosts[c.storage]
            k = pos // piece
            if host is None or pos + n > (k + 1) * piece:
                _cut(c, snap.extents[c.storage], host, piece, pieces, queue, chunks, ring, root)
                continue
            p = pieces.get(k)
            if p is None:
                p = pieces[k] = Piece(ring, root, k * piece)
                queue.append(p)
            rel = pos - p.lo
            used = p.hi - p.lo
            if rel > used:  # Piece.add, inline
                p.gaps.append((used, rel - used))
            p.copies.append((rel, n, (host + c.storage_offset, n)))
            if rel + n > used:
                p.hi = p.lo + rel + n
            chunks.append((c, p, len(p.copies) - 1))
        per_file.append(list(pieces.values()))
    queues = [per_root[r] for r in sorted(per_root)]
    order = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    number_copies(order)
    slots = [p.base + k if p is not None else -1 for _, p, k in chunks]
    return order, per_file, [c for c, _, _ in chunks], slots


def _cut(c: PlannedChunk, ext, host: int | None, piece: int, pieces: dict[int, Piece], queue: list[Piece],
         chunks: list, ring: Ring, root: int) -> None:
    """Lay chunk ``c`` of extent ``ext`` out in ``pieces``, cut where pieces end (``host``: the
    extent's address in host memory, None: copied from its flat tensor)."""
    flat = ext.flat if host is None else None
    pos, end = c.file_offset, c.file_offset + c.length
    while pos < end:
        k = pos // piece
        cut = min(end, (k + 1) * piece)
        p = pieces.get(k)
        if p is None:
            p = pieces[k] = Piece(ring, root, k * piece)
            queue.append(p)
        src = c.storage_offset + pos - c.file_offset
        p.add(pos - p.lo, cut - pos, (host + src, cut - pos) if flat is None else flat[src:src + cut - pos])
        part = c if cut - pos == c.length else c._replace(storage_offset=src, length=cut - pos, file_offset=pos)
        chunks.append((part, p, len(p.copies) - 1))
        pos = cut


def _layout_host(plan: SavePlan, hosts: list[int], ring: Ring, piece: int):
    """_layout in numpy columns where every extent is in host memory: per file, its chunks cut
    into parts where pieces end, each part's piece, offset there, length and source address,
    and the gaps before parts; Python objects only per piece, and the per-part tuples made by
    zip. None where a file's chunks are not in file order, disjoint (the plans plan_save makes
    are): _layout_each then."""
    address = np.array(hosts, dtype=np.int64)
    per_root: dict[int, list[Piece]] = {}
    per_file, laid = [], []
    for fp in plan.files:
        parts = _parts(fp.chunks, address, piece)
        if parts is None:
            return None
        pieces = _file_pieces(parts, ring, fp.target.root)
        per_root.setdefault(fp.target.root, []).extend(pieces)
        per_file.append(pieces)
        laid.append(parts)
    queues = [per_root[r] for r in sorted(per_root)]
    order = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    number_copies(order)
    chunks: list = []
    slots: list = []
    for pieces, parts in zip(per_file, laid):
        # part i is copy (i - its piece's first part) of its piece
        bases = np.array([p.base for p in pieces], dtype=np.int64) - parts.first if pieces else parts.first
        slot = bases[parts.piece] + np.arange(len(parts.piece)) if pieces else parts.piece
        chunks += _in_chunk_order(parts, parts.chunks, lambda c: c)
        slots += _in_chunk_order(parts, slot.tolist(), lambda c: -1)
    return order, per_file, chunks, slots


class _Parts:
    """One file's chunks cut where pieces end, as columns (see _parts)."""

    __slots__ = ("address", "chunks", "empty", "empty_chunks", "first", "lo", "n", "of_chunk", "piece", "rel")


def _parts(chunks: Sequence[PlannedChunk], address: np.ndarray, piece: int) -> _Parts | None:
    """The parts of ``chunks`` (one per piece a chunk meets): per part its chunk (the plan's own,
    or a PlannedChunk of the part where a chunk is cut), the index of its chunk in ``chunks``,
    its piece's number in the file (0, 1, ... in file order: ``first`` holds each piece's first
    part), its offset in that piece, length and source address; ``empty``: the indices of
    zero-byte chunks. None where the chunks are not in file order and disjoint."""
    out = _Parts()
    if not chunks:
        storage = offset = length = at = np.zeros(0, dtype=np.int64)
    else:
        # the chunks' five int fields in one C-level pass (np.fromiter over the tuples chained), a
        # column per field: no transposition into Python tuples first (half the time)
        table = np.fromiter(chain.from_iterable(chunks), dtype=np.int64, count=5 * len(chunks)).reshape(-1, 5)
        storage, offset, length, at = table[:, 0], table[:, 1], table[:, 2], table[:, 4]
    some = np.flatnonzero(length > 0)
    pos, ln = at[some], length[some]
    if len(some) > 1 and (pos[1:] < pos[:-1] + ln[:-1]).any():
        return None
    k0 = pos // piece
    count = (pos + ln - 1) // piece - k0 + 1
    of = np.repeat(np.arange(len(some)), count)  # per part, its chunk among ``some``
    k = k0[of] + np.arange(len(of)) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(pos[of], k * piece)
    n = np.minimum(pos[of] + ln[of], (k + 1) * piece) - lo
    out.of_chunk, out.rel, out.n, out.empty = some[of], lo - k * piece, n, np.flatnonzero(length == 0)
    out.address = address[storage[some][of]] + offset[some][of] + lo - pos[of]
    ks, out.first = np.unique(k, return_index=True)  # k grows part by part: each piece's first part
    out.lo = (ks * piece).tolist()
    out.piece = np.repeat(np.arange(len(out.first)), np.diff(np.append(out.first, len(k))))
    out.chunks = list(map(chunks.__getitem__, out.of_chunk.tolist()))
    out.empty_chunks = list(map(chunks.__getitem__, out.empty.tolist()))
    for i in np.flatnonzero(np.repeat(count > 1, count)).tolist():  # a chunk cut where a piece ends
        c = out.chunks[i]
        start = int(lo[i])
        out.chunks[i] = c._replace(storage_offset=c.storage_offset + start - c.file_offset, length=int(n[i]),
                                   file_offset=start)
    return out


def _file_pieces(parts: _Parts, ring: Ring, root: int) -> list[Piece]:
    """The pieces of one file's parts: each with its copies ((offset, length, (address,
    length)) per part) and its gaps (the bytes before a part that no earlier part filled)."""
    rel, n = parts.rel, parts.n
    end = rel + n
    before = np.zeros(len(rel), dtype=np.int64)  # where the piece had been filled up to: the last part's end
    before[1:] = end[:-1]
    before[parts.first] = 0
    gap = np.flatnonzero(rel > before)
    n_list = n.tolist()
    copies = list(zip(rel.tolist(), n_list, zip(parts.address.tolist(), n_list)))
    gaps = list(zip(before[gap].tolist(), (rel - before)[gap].tolist()))
    bounds = np.append(parts.first, len(rel))
    gap_bounds = np.searchsorted(gap, bounds).tolist()
    his = end[bounds[1:] - 1].tolist() if len(rel) else []
    pieces = []
    for i, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):  # a Python step per piece
        lo = parts.lo[i]
        p = Piece(ring, root, lo)
        p.copies, p.gaps, p.hi = copies[a:b], gaps[gap_bounds[i]:gap_bounds[i + 1]], lo + his[i]
        pieces.append(p)
    return pieces


def _in_chunk_order(parts: _Parts, entries: list, empty) -> list:
    """``entries`` (one per part, in part order) with ``empty(chunk)`` for each zero-byte chunk,
    in the order of the file's chunks (a chunk's parts in file order)."""
    if not len(parts.empty):
        return entries
    order = np.argsort(np.concatenate((parts.of_chunk, parts.empty)), kind="stable")
    both = entries + list(map(empty, parts.empty_chunks))
    return list(map(both.__getitem__, order.tolist()))


class _LayoutTemplate:
    """A save's layout of its files in pieces (_layout), kept to be made again for a later save
    of the same layout: every piece's root, range, copies (addresses in host memory), gaps and
    first copy's slot, and the chunks with their slots (both lists shared: nothing changes
    them once laid out)."""

    __slots__ = ("chunks", "key", "per_file", "piece", "pieces", "plan", "slots")

    def __init__(self, key, plan: SavePlan, piece: int, pieces: list[tuple], per_file: list[list[int]],
                 chunks: list[PlannedChunk], slots: list[int]) -> None:
        self.key, self.plan, self.piece = key, plan, piece
        self.pieces, self.per_file, self.chunks, self.slots = pieces, per_file, chunks, slots

    @classmethod
    def of(cls, snap: Snapshot, plan: SavePlan, piece: int, order: list[Piece], per_file: list[list[Piece]],
           chunks: list[PlannedChunk], slots: list[int], hosted: bool = False) -> _LayoutTemplate | None:
        """The template of a layout just made (None: not reusable, as an extent is not in host
        memory or the snapshot has no layout key). ``hosted``: _layout_host made it (its
        copies are all from host memory)."""
        if snap.layout_key is None or (not hosted and any(type(src) is not tuple for p in order
                                                          for _, _, src in p.copies)):
            return None
        index = {id(p): i for i, p in enumerate(order)}
        return cls(snap.layout_key, plan, piece, [(p.root, p.lo, p.hi, p.copies, p.gaps, p.base) for p in order],
                   [[index[id(p)] for p in pieces] for pieces in per_file], chunks, slots)

    def fits(self, snap: Snapshot, plan: SavePlan, piece: int) -> bool:
        return snap.layout_key is self.key and plan is self.plan and piece == self.piece

    def rebuild(self, ring: Ring):
        """The layout as _layout returns it, with new pieces in ``ring`` (the copies', gaps',
        chunks' and slots' lists are shared: nothing changes them once laid out)."""
        order = []
        for root, lo, hi, copies, gaps, base in self.pieces:
            p = Piece(ring, root, lo)
            p.hi, p.copies, p.gaps, p.base = hi, copies, gaps, base
            order.append(p)
        per_file = [[order[i] for i in idx] for idx in self.per_file]
        return order, per_file, self.chunks, self.slots


def allocate(order: Sequence[Piece], capacity: int) -> None:
    """Give each piece its place in the pool, in turn (a ring: a piece that does not fit before
    the end starts again at 0, leaving the tail as it is); a piece waits for the earlier pieces
    whose range it reuses (its blockers).

    The blockers of piece p at [p.ring, p.ring + n) are, for every byte of that range, the
    last earlier piece that wrote it (if any): p is filled only once they are freed, and each
    of them was filled only once the last writer before it was freed, so every earlier
    piece that overlaps p is freed before p is filled (transitively). The last writers are
    kept as an interval map of the pool (sorted, disjoint [start, end) -> piece): p's
    blockers are the pieces of the intervals that meet its range, which p then replaces
    (cutting the intervals it covers partly). The old bytes a range reuses need not be one
    lap old: a ring that wraps early (the next piece did not fit) leaves its tail alone for
    any number of laps, and the piece that finally reaches it again must wait for the
    tail's last writer however far back that is (with unequal pieces, a state larger than
    the pool and a root whose engine lags behind the others, a scan back over a bounded
    number of bytes missed it and overwrote bytes not yet written). Per piece: two binary
    searches, and amortised O(1) intervals added and removed (a piece adds at most three,
    each is removed once); the list slices move at most as many entries as the map holds
    (at most one per 4 KiB of pool)."""
    starts: list[int] = []  # the intervals' starts, sorted
    ends: list[int] = []  # their ends (sorted too: the intervals are disjoint)
    writers: list[Piece] = []  # the last piece that wrote each interval
    cursor = 0
    for p in order:
        n = p.length
        if cursor + n > capacity:
            cursor = 0
        lo, hi = cursor, cursor + n
        p.ring, cursor = lo, hi
        i = bisect.bisect_right(ends, lo)  # the first interval that ends after lo
        j = bisect.bisect_left(starts, hi)  # the first interval that starts at or after hi
        for q in writers[i:j]:
            if all(b is not q for b in p.blockers):  # a piece cut in two by a later one may meet p twice
                p.blockers.append(q)
        s_new, e_new, w_new = [lo], [hi], [p]
        if i < j and starts[i] < lo:  # the first interval met keeps its part below lo
            s_new.insert(0, starts[i])
            e_new.insert(0, lo)
            w_new.insert(0, writers[i])
        if i < j and ends[j - 1] > hi:  # the last one its part from hi
            s_new.append(hi)
            e_new.append(ends[j - 1])
            w_new.append(writers[j - 1])
        starts[i:j], ends[i:j], writers[i:j] = s_new, e_new, w_new


def copy_all(snap: Snapshot, order: Sequence[Piece], ring: Ring, buf: StagingBuffer, release) -> None:
    """The copier thread: fill every piece in order, then set ``release``."""
    try:
        used: set[int] = set()
        with streams.on_side_streams(snap.ready):
            for p in order:
                with ring.cv:
                    while ring.error is None and not all(b.freed for b in p.blockers):
                        ring.cv.wait()
                    if ring.error is not None:
                        raise _Stopped
                ring.locked(p.ring + p.length)  # page-locked before it is filled (new_region)
                devices = {src.device.index for _, _, src in p.copies if type(src) is not tuple and src.is_cuda}
                _zero_gaps(buf, p)
                if copy_in is _copy_in and not devices:
                    _copy_host_piece(buf, p)
                else:  # copies from a GPU, or copy_in wrapped (a test's seam): one call per copy
                    crcs = ring.crcs
                    for j, (rel, n, src) in enumerate(p.copies, p.base):
                        crc = copy_in(buf, p.ring + rel, src)
                        if crc is None:
                            p.unsummed.append((j, rel, n))
                        else:
                            crcs[j] = crc
                events = streams.record_side(sorted(devices)) if devices else {}
                with ring.cv:
                    p.events, p.ready = events, True
                    ring.cv.notify_all()
                used |= devices
            release.set(streams.record_side(sorted(used)) if used else {})
    except _Stopped:
        pass
    except BaseException as e:
        ring.fail(e)


def _zero_gaps(buf: StagingBuffer, p: Piece) -> None:
    """Zero the gaps of ``p`` in the pool (before its copies: a gap may hold copies). Many small
    gaps (a state of many tensors, each chunk padded to the next one's alignment: a gap per
    chunk) are zeroed by one memset of the whole piece, which the copies then overwrite: one
    call instead of thousands (on this project's VM a small memset call costs what zeroing
    about 8 KiB does)."""
    gaps = p.gaps
    if len(gaps) > 1 and p.hi - p.lo < len(gaps) * GAP_BYTES:
        ctypes.memset(buf.address + p.ring, 0, p.hi - p.lo)
        return
    for rel, n in gaps:
        ctypes.memset(buf.address + p.ring + rel, 0, n)


def _copy_host_piece(buf: StagingBuffer, p: Piece) -> None:
    """copy_in for every copy of ``p``, none from a GPU: where the compiled gather is built
    (crc.native_gather_copies) and every copy is from host memory (the usual state), one call
    for the piece, which reads the copies' tuples in C and copies with the GIL released; else in
    one loop, the small copies from host memory (a state of many tensors: most of them) inline, a
    memmove and a crc32c each, without a call and type tests per copy. Both give the same bytes
    and checksums."""
    gather = native_gather_copies()
    if gather is not None and gather(buf.address + p.ring, p.hi - p.lo, p.copies, p.ring_state.crcs, p.base):
        return
    memmove, view, crcs = ctypes.memmove, buf.view, p.ring_state.crcs
    at = p.ring
    dst = buf.address + at
    for j, (rel, n, src) in enumerate(p.copies, p.base):
        if type(src) is tuple and n <= FUSED_BYTES:
            memmove(dst + rel, src[0], n)
            crcs[j] = _crc32c(view[at + rel:at + rel + n])
        else:
            crcs[j] = _copy_in(buf, at + rel, src)  # type: ignore[assignment]


def copy_in(buf: StagingBuffer, at: int, src: torch.Tensor | tuple[int, int]) -> int | None:
    """Copy ``src`` (a flat uint8 tensor, or (address, length) of host memory) into the pool
    at byte ``at``. From host memory: memmove and crc32c by turns, a cache-sized
    piece at a time (the GIL is released meanwhile), so the checksum reads the copy from cache
    and the engine need not read it from memory again; returns the crc32c. The same loop as
    the engines' staging copy (engines.staged._stage_in), kept apart because it is not engine
    staging: what the engines stage is counted through their own copy (tests rely on that).
    From a GPU: an asynchronous copy on the current (side) stream (None: the bytes are not
    there yet)."""
    if type(src) is tuple:
        src, n = src
    else:
        n = src.numel()
        if src.is_cuda:
            buf.tensor[at:at + n].copy_(src, non_blocking=True)
            return None
        src = src.data_ptr()
    dst = buf.address + at
    if n <= FUSED_BYTES:  # most chunks of a state of many tensors: one memmove, one crc32c
        ctypes.memmove(dst, src, n)
        return _crc32c(buf.view[at:at + n])
    crc = 0
    for k in range(0, n, FUSED_BYTES):
        m = min(FUSED_BYTES, n - k)
        ctypes.memmove(dst + k, src + k, m)
        crc = _crc32c(buf.view[at + k:at + k + m], crc)
    return crc


_copy_in = copy_in  # the module's own: copy_all calls copy_in per copy only when it was replaced
