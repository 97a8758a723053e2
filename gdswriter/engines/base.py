"""The engine contract: what every I/O engine (io_uring, POSIX, GDS) does.

An engine writes a whole file from an ordered list of spans (byte offset ->
source bytes) and reads spans back into destination memory, computing the
crc32c of every span while its bytes stream through the engine's buffers (a span
whose ``checksum`` is False may be skipped: its caller sums those bytes itself).
Sources and destinations are flat uint8 tensors on the CPU or a GPU.

When write_file or read_file returns or raises, nothing the engine started can
still act on the file, its descriptor number, or the spans' memory: a failed or
interrupted transfer is stopped and waited for (or, where the kernel does not
allow that, its descriptor and memory are kept for good) before the call ends.
Data files are regular files: engines never follow a symbolic link at the
path and never open a FIFO, socket, device or directory there.
"""

from __future__ import annotations

import abc
import bisect
import os
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Sequence

import torch

from ..errors import InvalidOptionError


class SpanGuard(Protocol):
    """Says when a span's bytes may be read, and hears when they no longer are (see WriteSpan)."""

    def is_ready(self) -> bool:
        """True once the bytes are valid; raises the producer's error if they never will be."""

    def wait_ready(self) -> None:
        """Block until the bytes are valid; raises the producer's error if they never will be."""

    def release(self) -> None:
        """The engine will not read the bytes again (called once per span)."""


@dataclass(frozen=True)
class WriteSpan:
    """Write ``data`` (flat uint8 tensor) at byte ``offset`` of the file.

    ``guard`` (optional) lets a producer fill ``data`` while the file is being written (the
    host snapshot's pipelined copy): an engine whose ``honours_span_guards`` is True reads
    ``data`` only after ``guard`` says it is ready and calls ``guard.release()`` once it will
    not read it again, at the latest before ``write_file`` returns or raises (SpanGuards
    does the bookkeeping).

    ``checksum`` False: the caller needs no crc32c of these bytes (their producer keeps its
    own, e.g. the host snapshot's copier, per tensor chunk): an engine may skip computing it
    and then returns 0 for the span.
    """

    offset: int
    data: torch.Tensor
    guard: SpanGuard | None = field(default=None, compare=False)
    checksum: bool = True

    @property
    def end(self) -> int:
        return self.offset + self.data.numel()


class SpanGuards:
    """An engine's bookkeeping of its spans' guards during one ``write_file``.

    The engine asks ``ready(lo, hi)`` (or ``wait(lo, hi)``) before it reads file range
    [lo, hi) from the spans, tells ``read(j)`` when it has read (copied or queued) span j's
    last byte, ``hold(j)``/``unhold(j)`` around each request that writes straight from span
    j's memory, and ``release_all()`` when the file is done or failed. A span is released
    when it is read and no request holds it, so a producer streaming through a bounded
    buffer can reuse that memory while the file is still being written. While it waits for a
    span, an engine holds at most the span it is in and what its next staging buffer covers
    (and reaps its requests, releasing what they held): a producer must let that much be
    ready and unreleased at once."""

    def __init__(self, spans: Sequence[WriteSpan]):
        self._spans = spans
        self._starts = [s.offset for s in spans]
        self._holds = [0] * len(spans)
        self._read = [False] * len(spans)
        self._released = [s.guard is None for s in spans]

    @classmethod
    def of(cls, spans: Sequence[WriteSpan]) -> SpanGuards | None:
        """None when no span has a guard (the engine then skips all of this)."""
        return cls(spans) if any(s.guard is not None for s in spans) else None

    def _overlapping(self, lo: int, hi: int):
        j = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        while j < len(self._spans) and self._spans[j].offset < hi:
            s = self._spans[j]
            if s.guard is not None and s.end > lo and not self._released[j]:
                yield s.guard
            j += 1

    def ready(self, lo: int, hi: int) -> bool:
        return all(g.is_ready() for g in self._overlapping(lo, hi))

    def wait(self, lo: int, hi: int) -> None:
        for g in self._overlapping(lo, hi):
            g.wait_ready()

    def _maybe_release(self, j: int) -> None:
        if self._read[j] and not self._holds[j] and not self._released[j]:
            self._released[j] = True
            self._spans[j].guard.release()  # type: ignore[union-attr]

    def read(self, j: int) -> None:
        self._read[j] = True
        self._maybe_release(j)

    def hold(self, j: int) -> None:
        self._holds[j] += 1

    def unhold(self, j: int) -> None:
        self._holds[j] -= 1
        self._maybe_release(j)

    def release_all(self) -> None:
        for j, s in enumerate(self._spans):
            if not self._released[j]:
                self._released[j] = True
                s.guard.release()  # type: ignore[union-attr]


@dataclass(frozen=True)
class ReadSpan:
    """Read ``out.numel()`` bytes at byte ``offset`` into ``out`` (flat uint8 tensor).

    ``checksum`` False: the caller needs no crc32c of these bytes (it sums the pieces it
    holds itself, e.g. a load's run of many small storages, chunk by chunk): an engine may
    skip computing it and then returns 0 for the span.
    """

    offset: int
    out: torch.Tensor
    checksum: bool = True

    @property
    def end(self) -> int:
        return self.offset + self.out.numel()


def check_spans(spans: Sequence[WriteSpan] | Sequence[ReadSpan]) -> None:
    """Spans must be sorted, non-overlapping, flat contiguous uint8."""
    prev_end = 0
    for i, s in enumerate(spans):
        t = s.data if isinstance(s, WriteSpan) else s.out
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise InvalidOptionError(f"span {i}: expected a flat contiguous uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        if s.offset < prev_end:
            raise InvalidOptionError(f"span {i} at offset {s.offset} overlaps or precedes the previous span (ends at {prev_end}); sort spans by offset")
        prev_end = s.end


def checked_write_size(spans: Sequence[WriteSpan], size: int | None) -> int:
    """The size a write_file call leaves the file at (``size``, default: the end of the last
    span), after checking the spans; InvalidOptionError if ``size`` would cut a span off."""
    check_spans(spans)
    end = spans[-1].end if spans else 0
    size = end if size is None else size
    if size < end:
        raise InvalidOptionError(f"size={size} is smaller than the end of the last span ({end})")
    return size


@dataclass(frozen=True)
class EngineInfo:
    """What the user can see about the engine that moves their bytes."""

    name: str
    direct_io: bool
    registered_buffers: bool
    page_locked: bool
    reason: str = ""  # why this engine was chosen over a faster one, if so
    # Host-memory alignment that direct I/O needed on the last file (statx; 4096 when the
    # kernel does not say; 0 without direct I/O). Tensors this aligned skip the staging copy.
    direct_memory_alignment: int = 0
    # The staging buffers asked the kernel for transparent huge pages (it may still use 4 KiB
    # pages, e.g. where THP is off).
    huge_page_buffers: bool = False
    # How CUDA tensors' bytes move: "staged" (copied through gdswriter's page-locked host
    # buffers), "gds" (GPUDirect Storage: DMA between GPU memory and storage) or
    # "kvikio-compat" (KvikIO/cuFile's POSIX path through host bounce buffers).
    cuda_path: str = "staged"
    gpu_direct: bool = False  # True only where bytes skip host memory (cuda_path == "gds")


class IOEngine(abc.ABC):
    """Moves bytes between memory and files. Not thread-safe: one caller at a time."""

    name: str = "abstract"
    # True when write_file follows WriteSpan.guard (reads a guarded span only once it is ready,
    # releases it when done). Writers give guarded spans only to engines that do.
    honours_span_guards: bool = False

    @abc.abstractmethod
    def write_file(self, path: str | os.PathLike, spans: Sequence[WriteSpan], *, size: int | None = None,
                   durable: bool = True) -> list[int]:
        """Create (or replace) ``path`` holding ``spans``; gaps read as zeros; the file is
        exactly ``size`` bytes (default: the end of the last span). With ``durable`` the
        data and size are on stable storage when this returns (fdatasync). Returns the
        crc32c of each span. On failure the partial file is removed and a typed error raised
        (EngineIOError, with the path, offset and errno; NotRegularFileError where a symbolic
        link or special file sits at ``path``, which is left untouched); KeyboardInterrupt
        propagates as itself, after the same cleanup."""

    @abc.abstractmethod
    def read_file(self, path: str | os.PathLike, spans: Sequence[ReadSpan]) -> list[int]:
        """Fill each span's ``out`` from ``path``; returns the crc32c of each span's bytes.
        A path holding a symbolic link or special file raises DataFileNotRegularError (a
        CorruptCheckpointError: the checkpoint was damaged or tampered with)."""

    @property
    @abc.abstractmethod
    def info(self) -> EngineInfo:
        ...

    def close(self) -> None:
        """Release buffers and rings. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
