"""The I/O engines the integrations keep across saves, so that a save does not build its own.

Lightning names a new path per checkpoint and the Hugging Face Trainer a new ``checkpoint-N``
directory, so each save gets a GDSCheckpointer of its own (one root per checkpoint). What
costs there is not the checkpointer but its engines: each one maps, page-locks and registers
its staging buffers (``num_buffers x buffer_bytes``, 128 MiB by default) and sets up an
io_uring ring, 25-150 ms per engine measured. ``ENGINES.lease(options, n)`` hands a save ``n``
engines (one per root) through the checkpointer's ``engines=`` seam: idle ones made earlier
for the same EngineOptions (and factory), else new ones. The checkpointer closes them as its
own when it closes; that returns them to the shelf instead.

Memory stays bounded: the shelf keeps at most ``max_idle`` idle engines per kind (2: an
asynchronous save in flight and the next one), closes the extras, and closes everything at
interpreter exit (``clear()`` does it earlier); a forked child starts with an empty shelf.
Between saves a process holds those idle engines (their staging buffers) and nothing else of
gdswriter's.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Hashable, Sequence

from ..engines.base import EngineInfo, IOEngine, ReadSpan, WriteSpan
from ..engines.select import create_engine
from ..errors import GDSWriterError
from ..options import EngineOptions

__all__ = ["ENGINES", "EngineShelf", "LeasedEngine"]

EngineFactory = Callable[[EngineOptions], IOEngine]


class LeasedEngine(IOEngine):
    """An engine of the shelf, lent to one checkpointer: every call goes to the real engine;
    ``close()`` hands it back to the shelf (once) instead of closing it."""

    def __init__(self, shelf: EngineShelf, key: Hashable, engine: IOEngine):
        self._shelf, self._key, self._engine = shelf, key, engine
        self.name = engine.name
        self.honours_span_guards = engine.honours_span_guards
        self._lock = threading.Lock()

    @property
    def engine(self) -> IOEngine | None:
        """The real engine lent (None once handed back)."""
        return self._engine

    def _inner(self) -> IOEngine:
        engine = self._engine
        if engine is None:
            raise GDSWriterError("this leased engine was handed back (its checkpointer is closed): lease another")
        return engine

    def write_file(self, path: str | os.PathLike, spans: Sequence[WriteSpan], *, size: int | None = None,
                   durable: bool = True) -> list[int]:
        return self._inner().write_file(path, spans, size=size, durable=durable)

    def read_file(self, path: str | os.PathLike, spans: Sequence[ReadSpan]) -> list[int]:
        return self._inner().read_file(path, spans)

    @property
    def info(self) -> EngineInfo:
        return self._inner().info

    def close(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            self._shelf.give_back(self._key, engine)


class EngineShelf:
    """Idle engines by kind (EngineOptions, factory), at most ``max_idle`` of each kind."""

    def __init__(self, max_idle: int = 2):
        self.max_idle = max_idle
        self._idle: dict[Hashable, list[IOEngine]] = {}
        self._mutex = threading.Lock()
        self.made = 0  # engines constructed over the shelf's life (tests and benchmarks read it)

    def lease(self, options: EngineOptions | None, n: int, factory: EngineFactory | None = None) -> list[IOEngine]:
        """``n`` engines for ``options`` (default: from GDSWRITER_* env), made by ``factory``
        (default: create_engine) when no idle one of that kind is left."""
        options = options or EngineOptions.from_env()
        key = (options, factory)
        out: list[IOEngine] = []
        try:
            for _ in range(n):
                with self._mutex:
                    idle = self._idle.get(key)
                    engine = idle.pop() if idle else None
                if engine is None:
                    engine = (factory or create_engine)(options)
                    with self._mutex:
                        self.made += 1
                out.append(LeasedEngine(self, key, engine))
        except BaseException:
            for e in out:
                e.close()
            raise
        return out

    def give_back(self, key: Hashable, engine: IOEngine) -> None:
        with self._mutex:
            idle = self._idle.setdefault(key, [])
            keep = len(idle) < self.max_idle
            if keep:
                idle.append(engine)
        if not keep:
            engine.close()

    def idle(self) -> int:
        """How many idle engines the shelf holds."""
        with self._mutex:
            return sum(len(v) for v in self._idle.values())

    def clear(self) -> None:
        """Close every idle engine (leased ones are closed when handed back)."""
        with self._mutex:
            engines = [e for v in self._idle.values() for e in v]
            self._idle.clear()
        for e in engines:
            e.close()


    def forget(self) -> None:
        """Drop the idle engines without closing them: in a forked child (a DataLoader worker,
        say), whose copies of the parent's rings and buffers are the parent's to close."""
        self._mutex = threading.Lock()
        self._idle = {}


ENGINES = EngineShelf()
"""The process's shelf, shared by GDSCheckpointIO and GDSCheckpointing."""
atexit.register(ENGINES.clear)
os.register_at_fork(after_in_child=ENGINES.forget)
