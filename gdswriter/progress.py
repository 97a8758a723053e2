"""Progress of long operations (``export``, ``verify``, ``bench``) as one line on a terminal.

Drawn on stderr, and only when stderr is a terminal: piped or redirected output stays
exactly as it was, so scripts parsing stdout or stderr see no control characters.

    with Progress("export", total=nbytes) as bar:
        engine = bar.reads(engine)          # counts the bytes each read_file moves
        ...
        bar.advance(n, note="writing")

``total=None`` shows the bytes done and the rate without a percentage.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import TextIO
from collections.abc import Sequence

from .crc import crc32c_combine
from .engines.base import ReadSpan
from .units import human

PIECE_BYTES = 256 << 20
"""Reads are handed to the engine in batches of at most this many bytes so the bar moves
while one large file is read (one call per batch: the cost is a drained queue per batch)."""


def on_terminal(stream: TextIO | None = None) -> bool:
    """Whether progress should be drawn on ``stream`` (default stderr): a terminal that is not
    'dumb'."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # closed or not a real file
        return False


class Progress:
    """A one-line progress bar for ``total`` units (bytes by default; ``unit="steps"`` counts
    steps). Does nothing unless ``stream`` (default stderr) is a terminal, or when ``quiet``."""

    def __init__(self, label: str, total: float | None = None, *, unit: str = "bytes",
                 stream: TextIO | None = None, quiet: bool = False, interval: float = 0.1):
        self.label, self.total, self.unit = label, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = not quiet and on_terminal(self.stream)
        self.done = 0.0
        self.note = ""
        self.interval = interval
        self._start = time.monotonic()
        self._drawn = 0.0
        self._shown = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def advance(self, n: float = 1, *, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self.note = note
        self._draw()

    def set_note(self, note: str) -> None:
        self.note = note
        self._draw(force=True)

    def close(self) -> None:
        """Erase the line, so that what is printed next starts on a clean line."""
        if self.enabled and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def line(self) -> str:
        """The text drawn for the current state (without control characters)."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        parts = [self.label]
        if self.total:
            frac = min(max(self.done / self.total, 0.0), 1.0)
            filled = int(frac * 24)
            parts.append(f"[{'#' * filled}{'.' * (24 - filled)}] {100 * frac:3.0f}%")
        if self.unit == "bytes":
            parts.append(human(self.done) + (f" / {human(self.total)}" if self.total else ""))
            if self.done:
                parts.append(f"{self.done / elapsed / 1e9:.2f} GB/s")
        else:
            parts.append(f"{self.done:g}" + (f"/{self.total:g}" if self.total else "") + f" {self.unit}")
        if self.total and 0 < self.done < self.total:
            parts.append(f"ETA {_seconds(elapsed * (self.total - self.done) / self.done)}")
        if self.note:
            parts.append(self.note)
        return "  ".join(parts)

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn < self.interval:
            return
        self._drawn = now
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r" + self.line()[:width] + "\x1b[K")
        self.stream.flush()
        self._shown = True

    def reads(self, engine):
        """``engine`` with its ``read_file`` counted on this bar (itself when not drawing)."""
        return _CountedReads(engine, self) if self.enabled else engine


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


class _CountedReads:
    """An engine whose ``read_file`` advances a Progress, in batches of at most PIECE_BYTES:
    spans larger than that are read in pieces and their crc32c combined, so callers get the
    same per-span checksums as from the engine itself. Everything else is the engine's."""

    def __init__(self, engine, progress: Progress):
        self._engine, self._progress = engine, progress

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def read_file(self, path, spans: Sequence[ReadSpan]) -> list[int]:
        pieces: list[tuple[int, ReadSpan]] = []  # (index of the caller's span, piece); spans are flat uint8
        for i, s in enumerate(spans):
            n = s.out.numel()
            pieces += [(i, ReadSpan(s.offset + o, s.out[o:o + PIECE_BYTES])) for o in range(0, n, PIECE_BYTES)] \
                if n > PIECE_BYTES else [(i, s)]
        crcs: list[tuple[int, int] | None] = [None] * len(spans)  # (crc, bytes) so far
        batch: list[tuple[int, ReadSpan]] = []
        size = 0

        def flush() -> None:
            nonlocal size
            if not batch:
                return
            got = self._engine.read_file(path, [p for _, p in batch])
            for (i, p), crc in zip(batch, got):
                n = p.out.numel()
                prev = crcs[i]
                crcs[i] = (crc, n) if prev is None else (crc32c_combine(prev[0], crc, n), prev[1] + n)
            self._progress.advance(size)
            batch.clear()
            size = 0

        for i, p in pieces:
            n = p.out.numel()
            if batch and size + n > PIECE_BYTES:
                flush()
            batch.append((i, p))
            size += n
        flush()
        return [c[0] if c else 0 for c in crcs]
