"""The bytes of a replication (distributed/replicate.py; format.md 11): a rank's files read once
and streamed to its peers in PIECE_BYTES pieces, and the streams it receives written into
``step_S/copies/``, pipelined (``Pipeline``): a reader thread reads and checks the next pieces
while up to DEPTH pieces of each stream travel each way (isend/irecv on the replication group)
and a writer thread writes what arrived; memory is (1 + senders) x DEPTH pieces, whatever the
state's size. Every chunk's crc32c is checked as it is read (a damaged local file is never
copied); a received copy is fdatasynced, checked against its sender's trailer, fsynced and
renamed into place whole (``Incoming.publish``).

Direct I/O: each file takes a whole number of ALIGN (4 KiB) blocks of the stream (its last one
padded with zeros, which no crc32c covers), so every file starts on an aligned offset of an
aligned piece, and both ends move the bytes with O_DIRECT between page-aligned, page-locked
buffers (engines/buffers.py) and the files, in whole blocks, as the engines do: the source
reads cold (the step it just wrote is not read through, nor left in, the page cache) and the
copy's writes do not queue behind a page cache flush at its fdatasync. A copy's padding is cut
off (ftruncate) before the fdatasync. A file system refusing O_DIRECT, or needing more than
4 KiB alignment, is read and written buffered (open_aligned)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import queue
import secrets
import shutil
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable, Sequence

import crc32c as _crc32c

from ..crc import crc32c_combine
from ..engines.buffers import AlignedBufferPool
from ..engines.dio import direct_io_alignment
from ..errors import ChecksumMismatchError, CollectiveFailedError, EngineIOError, GDSWriterError, ReplicationError
from ..format.commit import TMP_PREFIX, TRASH_PREFIX
from ..format.manifest import MANIFEST_NAME, ChunkRecord
from ..format.replicas import copy_dir_name
from ..fs import atomic_write, closed_on_failure, fsync_dir, open_regular, replace_dir
from ..options import ALIGN
from .group import Coordinator, describe

log = logging.getLogger("gdswriter")


def profiling() -> bool:
    """The one switch of a replication's phase timings (Pipeline.seconds, the Replicator's
    phases): on where the "gdswriter" logger is enabled for debug, which is where they are
    logged (benchmarks/replicas.py --profile sets it); off, no clock is read per piece."""
    return log.isEnabledFor(logging.DEBUG)


def clock_for(profile: bool) -> Callable[[], float]:
    """``time.perf_counter`` where ``profile``, else a clock that reads nothing (always 0.0)."""
    return time.perf_counter if profile else _no_clock


def _no_clock() -> float:
    return 0.0

PIECE_BYTES = 32 << 20  # one piece of a rank's stream to its peers (and of each stream it receives)
DEPTH = 3  # pieces of each stream in flight or in a buffer at once (read ahead, on the wire, being written)


def padded(size: int) -> int:
    """The stream bytes a file of ``size`` bytes takes: whole ALIGN blocks (module docstring)."""
    return -(-size // ALIGN) * ALIGN


def open_aligned(path: Path, write: bool) -> int:
    """``path`` opened (open_regular: a regular file only; for writing, created or emptied)
    with O_DIRECT where its file system takes it with at most ALIGN-aligned offsets and memory,
    else buffered; blocking. Every transfer on it is whole ALIGN blocks from aligned memory."""
    fd, direct = open_regular(str(path), write, direct=True)
    with closed_on_failure(fd, str(path)):
        flags = fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK
        need = direct_io_alignment(fd) if direct else None
        if need is not None and (need.memory > ALIGN or need.offset > ALIGN):
            flags &= ~os.O_DIRECT
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return fd


_IDLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Coordinator -> its last step's pools
_IDLE_LOCK = threading.Lock()


def take_pools(coord: Coordinator, wanted: list[tuple[int, int]]) -> list[AlignedBufferPool]:
    """Buffer pools of at least (size, count) each: the ones the channel's previous step gave
    back where they are large enough (making a pool faults in and locks its pages: seconds
    for a few hundred MiB on a busy host), else new ones."""
    with _IDLE_LOCK:
        idle = _IDLE.pop(coord, [])
    got = []
    for size, count in wanted:
        fit = next((p for p in idle if p.size >= size and p.count >= count), None)
        if fit is not None:
            idle.remove(fit)
        got.append(fit or AlignedBufferPool(size, count))
    for p in idle:
        p.close()
    return got


def give_back(coord: Coordinator, pools: list[AlignedBufferPool]) -> None:
    """A step's pools, no longer used by any transfer, kept for the channel's next step."""
    with _IDLE_LOCK:
        old, _IDLE[coord] = _IDLE.get(coord, []), list(pools)
    for p in old:
        p.close()


@dataclass
class Source:
    """One file of a rank's stream: in memory (``data``: the shard, the global manifest) or on
    disk (``path``, with the chunks its shard records, checked as the bytes stream)."""

    kind: str  # "shard", "data" or "global"
    name: str
    size: int
    data: bytes | None = None
    path: Path | None = None
    chunks: tuple[ChunkRecord, ...] = ()


class _ChunkCheck:
    """One crc32c pass over one file as its bytes stream in order: every chunk's crc32c checked
    against its shard, and the file's crc32c (the trailer's) built from the chunks' recorded
    crc32c (crc32c_combine) and the bytes between them, so no byte is checksummed twice.
    Chunks that overlap or pass the file's end: ``whole`` is False and the caller checksums the
    file itself."""

    def __init__(self, chunks: Sequence[ChunkRecord], path: Path, size: int):
        self.chunks = sorted((c for c in chunks if c.length), key=lambda c: c.file_offset)
        self.path, self.i, self.crc, self.file_crc, self.done = path, 0, 0, 0, 0
        ends = [0] + [c.file_offset + c.length for c in self.chunks]
        self.whole = all(c.file_offset >= e for c, e in zip(self.chunks, ends)) and ends[-1] <= size

    def feed(self, offset: int, data: memoryview) -> None:
        """The file's bytes [offset, offset + len(data)), right after the ones fed before."""
        end = offset + len(data)
        while self.i < len(self.chunks):
            c = self.chunks[self.i]
            lo, hi = max(offset, c.file_offset), min(end, c.file_offset + c.length)
            if lo >= hi:
                if c.file_offset >= end:
                    break
                self.i += 1
                continue
            self._between(offset, data, lo)
            self.crc = _crc32c.crc32c(data[lo - offset:hi - offset], self.crc)
            self.done = max(self.done, hi)
            if hi < c.file_offset + c.length:
                return
            if self.crc != c.crc32c:
                raise ChecksumMismatchError(str(self.path), f"bytes of a chunk of {self.path.name}", c.file_offset,
                                            c.length, c.crc32c, self.crc)
            self.file_crc = crc32c_combine(self.file_crc, c.crc32c, c.length)
            self.i, self.crc = self.i + 1, 0
        self._between(offset, data, end)

    def _between(self, offset: int, data: memoryview, upto: int) -> None:
        """The file's crc32c over its bytes before ``upto`` that no chunk covers."""
        if self.whole and upto > self.done:
            lo = max(self.done, offset)
            self.file_crc = _crc32c.crc32c(data[lo - offset:upto - offset], self.file_crc)
            self.done = upto


class Outgoing:
    """This rank's stream: a header (its files' kinds, names and sizes), their bytes, and a
    trailer (each file's crc32c, or the error that stopped the sender: the rest is zeros)."""

    def __init__(self, sources: list[Source], error: BaseException | None):
        self.sources, self.error = sources, error
        self.header = json.dumps([[s.kind, s.name, s.size] for s in sources]).encode()
        self.total = sum(padded(s.size) for s in sources)
        self.crcs = [0] * len(sources)
        self._file, self._pos, self._fd, self._check = 0, 0, -1, None

    def fill(self, buf: memoryview) -> int:
        """The next bytes of the stream into ``buf``; returns how many."""
        n = 0
        while n < len(buf) and self._file < len(self.sources):
            src = self.sources[self._file]
            want = min(len(buf) - n, padded(src.size) - self._pos)
            piece = buf[n:n + want]
            real = min(want, src.size - self._pos)  # the rest of the piece is the file's padding
            if self.error is None:
                try:
                    self._read(src, piece, real)
                except Exception as e:  # noqa: BLE001 - the peers are told in the trailer
                    self.error = e
            kept = real if self.error is None else 0  # after an error: zeros (the trailer says why)
            piece[kept:] = bytes(want - kept)
            self._pos, n = self._pos + want, n + want
            if self._pos == padded(src.size):
                self._next()
        return n

    def _read(self, src: Source, piece: memoryview, real: int) -> None:
        """The file's next ``real`` bytes into ``piece`` (aligned, whole blocks: ``len(piece)``
        bytes are asked for, so that O_DIRECT reads the last block too), chunks checked."""
        if src.data is not None:
            piece[:real] = src.data[self._pos:self._pos + real]
        else:
            assert src.path is not None
            if self._fd < 0:
                self._fd = open_aligned(src.path, write=False)
                self._check = _ChunkCheck(src.chunks, src.path, src.size)
            got = 0
            while got < real:  # a regular file reads short only at its end (or at an error)
                try:
                    k = os.preadv(self._fd, [piece[got:]], self._pos + got)
                except OSError as e:
                    raise EngineIOError(e.errno, src.path, self._pos + got, "read") from e
                if k <= 0 or (k < len(piece) - got and got + k < real):
                    raise EngineIOError(errno.EIO, src.path, self._pos + got + max(k, 0),
                                        "read (the file is shorter than its shard says)")
                got += k
            assert self._check is not None
            self._check.feed(self._pos, piece[:real])
            if self._check.whole:
                self.crcs[self._file] = self._check.file_crc
                return
        self.crcs[self._file] = _crc32c.crc32c(piece[:real], self.crcs[self._file])

    def _next(self) -> None:
        self.close()
        self._file, self._pos = self._file + 1, 0
        while self._file < len(self.sources) and self.sources[self._file].size == 0:
            self._file += 1

    def trailer(self) -> bytes:
        body = {"ok": self.error is None, "crcs": self.crcs,
                "error": None if self.error is None else describe(self.error)}
        return json.dumps(body).encode()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ---------------------------------------------------------------------------------------------
# what a peer receives


class Incoming:
    """One sender's files as they arrive, written into a temporary directory of ``copies`` and
    published whole (``publish``) or removed (``discard``)."""

    def __init__(self, copies: Path, src: int, header: bytes):
        self.copies, self.src = copies, src
        self.files = [(str(k), str(n), int(z)) for k, n, z in json.loads(header)]
        self.tmp = copies / f"{TMP_PREFIX}{copy_dir_name(src)}-{secrets.token_hex(4)}"
        self.tmp.mkdir()
        self.crcs = [0] * len(self.files)
        self._file, self._pos, self._fd = 0, 0, -1
        self._skip_empty()

    def _path(self, i: int) -> Path:
        kind, name, _ = self.files[i]
        if "/" in name or name in ("", ".", "..") or name.startswith(TMP_PREFIX):
            raise GDSWriterError(f"rank {self.src} sent a copy named {name!r}, not a plain file name")
        return self.tmp / (f"global-{MANIFEST_NAME}" if kind == "global" else name)

    def _skip_empty(self) -> None:
        while self._file < len(self.files) and self.files[self._file][2] == 0:
            self._path(self._file).touch()
            self._file += 1

    def write(self, data: memoryview) -> None:
        """The stream's next bytes (whole blocks of its files, module docstring) into the files;
        each file's padding cut off, then fdatasynced, when its last block is written."""
        n = 0
        while n < len(data):
            size = self.files[self._file][2]
            path = self._path(self._file)
            if self._fd < 0:
                self._fd = open_aligned(path, write=True)
            want = min(len(data) - n, padded(size) - self._pos)
            piece = data[n:n + want]
            self._write_all(piece, path)
            self.crcs[self._file] = _crc32c.crc32c(piece[:max(0, min(want, size - self._pos))],
                                                   self.crcs[self._file])
            self._pos, n = self._pos + want, n + want
            if self._pos == padded(size):
                try:
                    os.ftruncate(self._fd, size)
                    os.fdatasync(self._fd)
                except OSError as e:
                    raise EngineIOError(e.errno, path, size, "fsync/ftruncate") from e
                os.close(self._fd)
                self._fd, self._pos, self._file = -1, 0, self._file + 1
                self._skip_empty()

    def _write_all(self, piece: memoryview, path: Path) -> None:
        """``piece`` at the file's position; a write the kernel cuts short goes on from where it
        stopped, and one that takes nothing is an error (never ignored)."""
        done = 0
        while done < len(piece):
            try:
                k = os.pwrite(self._fd, piece[done:], self._pos + done)
            except OSError as e:
                raise EngineIOError(e.errno, path, self._pos + done, "write") from e
            if k <= 0:
                raise EngineIOError(errno.EIO, path, self._pos + done, "write",
                                    "the kernel accepted zero bytes; the device may be failing")
            done += k

    def publish(self, trailer: dict) -> None:
        """Check the sender's trailer and every file's crc32c, then put the copy in place durably."""
        if not trailer.get("ok"):
            raise ReplicationError(f"rank {self.src} could not send its files: {trailer.get('error')}", -1)
        if self._file != len(self.files) or trailer.get("crcs") != self.crcs:
            raise ChecksumMismatchError(str(self.tmp), f"the copy of rank {self.src}'s files", 0,
                                        sum(z for _, _, z in self.files), 0, 0)
        glob = [self.tmp / f"global-{MANIFEST_NAME}" for k, _, _ in self.files if k == "global"]
        for g in glob:  # the global manifest's copy lies beside the ranks' (contract: copies/manifest.json)
            atomic_write(self.copies / MANIFEST_NAME, g.read_bytes())
            g.unlink()
        fsync_dir(self.tmp)
        final = self.copies / copy_dir_name(self.src)
        # an older copy there (a second refill of the step, a damaged copy refilled) is swapped out,
        # never removed first: a kill at any point leaves copies/rank<R> whole, old or new (the step's
        # protected counts it); what is swapped out is a .tmp-/.trash- leftover (dcp_leftovers.py)
        old = replace_dir(self.tmp, final, self.copies / f"{TRASH_PREFIX}{final.name}-{secrets.token_hex(4)}")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        shutil.rmtree(self.tmp, ignore_errors=True)


class Pipeline:
    """One step's pieces, pipelined (step 2 of the module docstring): a reader thread reads and
    checks this rank's next pieces while the previous ones travel, up to DEPTH pieces are in
    flight each way (isend/irecv on the replication group), and a writer thread writes (and
    checksums) what arrived while the next pieces arrive. Memory: (1 + senders) x DEPTH pieces."""

    def __init__(self, coord: Coordinator, step: int, out: Outgoing, dests: list[int], totals: dict[int, int],
                 incoming: dict[int, Incoming | None], problems: list[str]):
        self.coord, self.step, self.out, self.dests, self.totals = coord, step, out, dests, totals
        self.incoming, self.problems = incoming, problems
        piece = PIECE_BYTES
        self.send_rounds = -(-out.total // piece) if dests else 0
        self.rounds = max([self.send_rounds] + [-(-t // piece) for t in totals.values()])
        # page-aligned, page-locked (direct I/O); kept with the pipeline after a failure (``works``),
        # given back for the next step after a success (``run``)
        wanted = [(min(piece, t), min(DEPTH, -(-t // piece)))
                  for t in [out.total if self.send_rounds else 0] + list(totals.values()) if t]
        self.pools = take_pools(coord, wanted)
        pools = iter(zip(self.pools, wanted))
        self.send_bufs = self._slots(*next(pools)) if self.send_rounds else []
        self.recv_bufs = {s: self._slots(*next(pools)) for s, t in totals.items() if t}
        self.free_send: queue.Queue = queue.Queue()
        for i in range(len(self.send_bufs)):
            self.free_send.put(i)
        self.free_recv: dict[int, queue.Queue] = {s: queue.Queue() for s in totals}
        for s, bufs in self.recv_bufs.items():
            for i in range(len(bufs)):
                self.free_recv[s].put(i)
        self.filled: queue.Queue = queue.Queue()
        self.to_write: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.works: list = []  # the last works posted: kept alive (with their buffers) after a failure
        # seconds (``timings``): the pieces' whole exchange, and per stage: reading and checking,
        # the exchange waiting for a read, waiting on the wire, writing, checking and syncing;
        # measured only where ``profiling()`` (else every one stays 0.0)
        self.profile = profiling()
        self.clock = clock_for(self.profile)
        self.seconds = {"pipeline": 0.0, "read": 0.0, "wait read": 0.0, "wire": 0.0, "write": 0.0}

    def timings(self) -> str:
        """Where this step's replication spent its time (logged at debug level): a stage near
        the whole is the bottleneck; "wait read" near "read" means nothing hid the reads."""
        if not self.profile:
            return "not measured (the gdswriter logger is not at debug)"
        return ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())

    @staticmethod
    def _slots(pool: AlignedBufferPool, wanted: tuple[int, int]) -> list:
        size, count = wanted
        return [b.tensor[:size] for b in pool.buffers[:count]]

    def run(self) -> None:
        """Every piece sent and received, and the received ones written; CollectiveFailedError
        when a peer failed or left (the groups' works are then abandoned, their buffers kept)."""
        threads = [threading.Thread(target=self._read, name="gdswriter-replicate-read", daemon=True),
                   threading.Thread(target=self._write, name="gdswriter-replicate-write", daemon=True)]
        for t in threads:
            t.start()
        done, t0 = False, self.clock()
        try:
            self._exchange()
            done = True
        except BaseException:
            self.stop.set()
            raise
        finally:
            self.free_send.put(None)
            self.to_write.put(None)
            for t in threads:
                t.join()
            self.seconds["pipeline"] = self.clock() - t0
            if done:  # no transfer and no thread uses the buffers any more
                give_back(self.coord, self.pools)

    def _exchange(self) -> None:
        import torch.distributed as dist

        group, piece, what = self.coord.group, PIECE_BYTES, f"replicating step {self.step}"
        inflight: deque[tuple[int | None, list, list]] = deque()
        sent = received = 0
        try:
            for k in range(self.rounds):
                if len(inflight) == DEPTH:
                    self._complete(*inflight.popleft())
                tag = 2 + k % 1000
                recvs = [(s, self.free_recv[s].get(), min(piece, t - k * piece))
                         for s, t in self.totals.items() if k * piece < t]
                works = [dist.irecv(self.recv_bufs[s][i][:n], group=group, group_src=s, tag=tag) for s, i, n in recvs]
                slot = None
                if k < self.send_rounds:
                    t0 = self.clock()
                    got = self.filled.get()
                    self.seconds["wait read"] += self.clock() - t0
                    if isinstance(got, BaseException):
                        raise got
                    slot, n = got
                    works += [dist.isend(self.send_bufs[slot][:n], group=group, group_dst=d, tag=tag)
                              for d in self.dests]
                    sent += n * len(self.dests)
                received += sum(n for _, _, n in recvs)
                self.works.append(works)
                inflight.append((slot, recvs, works))
            while inflight:
                self._complete(*inflight.popleft())
        except (RuntimeError, ValueError) as e:  # gloo reports a lost or late peer as RuntimeError/DistError
            raise CollectiveFailedError(f"{what} (pieces)", self.coord.timeout_s, describe(e)) from e
        self.coord.stats.add(sent, received)

    def _complete(self, slot: int | None, recvs: list, works: list) -> None:
        t0 = self.clock()
        for w in works:
            w.wait(timedelta(seconds=self.coord.timeout_s))
        self.seconds["wire"] += self.clock() - t0
        for r in recvs:
            self.to_write.put(r)
        if slot is not None:
            self.free_send.put(slot)
        self.works = self.works[-DEPTH:]

    def _read(self) -> None:
        """The reader thread: this rank's pieces, in order, into free send buffers."""
        try:
            for k in range(self.send_rounds):
                slot = self.free_send.get()
                if slot is None or self.stop.is_set():
                    return
                want = min(PIECE_BYTES, self.out.total - k * PIECE_BYTES)
                t0 = self.clock()
                n = self.out.fill(memoryview(self.send_bufs[slot].numpy())[:want])
                self.seconds["read"] += self.clock() - t0
                self.filled.put((slot, n))
        except BaseException as e:  # noqa: BLE001 - a bug must not leave the exchange waiting
            self.filled.put(e)

    def _write(self) -> None:
        """The writer thread: the pieces received, in order, into their copies (a copy that fails
        is discarded and reported; the others go on)."""
        while True:
            item = self.to_write.get()
            if item is None:
                return
            s, slot, n = item
            inc = self.incoming[s]
            if inc is not None and not self.stop.is_set():
                try:
                    t0 = self.clock()
                    inc.write(memoryview(self.recv_bufs[s][slot].numpy())[:n])
                    self.seconds["write"] += self.clock() - t0
                except Exception as e:  # noqa: BLE001 - reported to the primary rank
                    inc.discard()
                    self.incoming[s] = None
                    self.problems.append(f"the copy of rank {s}: {describe(e)}")
            self.free_recv[s].put(slot)
