"""The coordination channel of a multi-rank checkpoint.

Every checkpoint collective (who holds what, votes, the commit decision, chunks sent to a
rank that cannot read them) runs over one dedicated gloo group per process group, created
once, with an explicit timeout: a rank that dies or hangs turns into CollectiveFailedError
on the others within the timeout instead of a hang, and the training's own (NCCL) group is
never touched. Messages are JSON, sent as byte tensors: nothing is pickled.

After a failed collective the group is marked broken: a rank may have left it half way, so
any later use fails at once with the same typed error (restart the job).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar, Sequence

import torch

from ..errors import CollectiveFailedError, RankFailedError


def describe(e: BaseException) -> str:
    """ "Type: first line of the message", as failures are reported to the other ranks."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:2000]


@dataclass(frozen=True)
class Transfer:
    """``tensor``'s bytes go from rank ``src`` to rank ``dst``; ``tag`` tells transfers between
    the same two ranks apart (every rank derives the same list)."""

    src: int
    dst: int
    tag: int
    tensor: torch.Tensor  # flat uint8: what src sends, or where dst receives


class Coordinator:
    """Object collectives among the ranks of one process group (``rank`` and ``world_size`` are
    in that group). ``solo()`` is the one-process case: every collective is trivial."""

    _cache: ClassVar[dict[tuple[int, float], Coordinator]] = {}
    _cache_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, group: Any, ranks: Sequence[int], rank: int, timeout_s: float, source: Any = None):
        self.group, self.global_ranks, self.rank = group, list(ranks), rank
        self.world_size = len(self.global_ranks)
        self.timeout_s = timeout_s
        self._source = source  # the process group this one coordinates (kept alive for the cache)
        self._broken: str | None = None

    @classmethod
    def solo(cls) -> "Coordinator":
        return cls(None, [0], 0, 1.0)

    @classmethod
    def for_group(cls, process_group: Any = None, *, timeout_s: float) -> "Coordinator":
        """The coordinator of ``process_group`` (default: the default group), creating its gloo
        group on first use; every rank of the group must call this at the same point the first time.
        Without an initialised torch.distributed, the solo coordinator."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls.solo()
        pg = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        if len(ranks) == 1:
            return cls.solo()
        key = (id(pg), float(timeout_s))
        with cls._cache_lock:
            hit = cls._cache.get(key)
            if hit is not None and hit._source is pg:
                return hit
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                                   use_local_synchronization=True)
            coord = cls(group, ranks, dist.get_rank(pg), timeout_s, source=pg)
            cls._cache[key] = coord
            return coord

    @property
    def solo_mode(self) -> bool:
        return self.group is None

    # -- plumbing ------------------------------------------------------------
    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._broken is not None:
            raise CollectiveFailedError(what, self.timeout_s, f"an earlier checkpoint collective failed: "
                                                               f"{self._broken}")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - gloo reports a lost peer as RuntimeError/DistError
            self._broken = describe(e)
            raise CollectiveFailedError(what, self.timeout_s, self._broken) from e

    @staticmethod
    def _encode(obj: Any) -> torch.Tensor:
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _decode(t: torch.Tensor, n: int) -> Any:
        return json.loads(bytes(t[:n].numpy()))

    def _padded(self, obj: Any, sizes: list[int]) -> torch.Tensor:
        data = self._encode(obj)
        buf = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
        buf[:data.numel()] = data
        return buf

    # -- collectives ---------------------------------------------------------
    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` (JSON), in rank order, on every rank."""
        if self.solo_mode:
            return [json.loads(json.dumps(obj))]
        import torch.distributed as dist

        def run() -> list[Any]:
            n = torch.tensor([self._encode(obj).numel()], dtype=torch.int64)
            sizes_t = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes_t, n, group=self.group)
            sizes = [int(s) for s in sizes_t]
            outs = [torch.empty(max(max(sizes), 1), dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(outs, self._padded(obj, sizes), group=self.group)
            return [self._decode(o, s) for o, s in zip(outs, sizes)]

        return self._run(what, run)

    def gather(self, obj: Any, what: str, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``dst`` (None elsewhere)."""
        if self.solo_mode:
            return [json.loads(json.dumps(obj))]
        import torch.distributed as dist

        def run() -> list[Any] | None:
            n = torch.tensor([self._encode(obj).numel()], dtype=torch.int64)
            sizes_t = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes_t, n, group=self.group)  # every rank pads to the largest message
            sizes = [int(s) for s in sizes_t]
            buf = self._padded(obj, sizes)
            outs = [torch.empty_like(buf) for _ in range(self.world_size)] if self.rank == dst else None
            dist.gather(buf, outs, group=self.group, group_dst=dst)
            return [self._decode(o, s) for o, s in zip(outs, sizes)] if outs is not None else None

        return self._run(what, run)

    def broadcast(self, obj: Any, what: str, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.solo_mode:
            return json.loads(json.dumps(obj))
        import torch.distributed as dist

        def run() -> Any:
            data = self._encode(obj) if self.rank == src else None
            n = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
            dist.broadcast(n, group=self.group, group_src=src)
            buf = torch.zeros(max(int(n), 1), dtype=torch.uint8)
            if data is not None:
                buf[:data.numel()] = data
            dist.broadcast(buf, group=self.group, group_src=src)
            return self._decode(buf, int(n))

        return self._run(what, run)

    def exchange(self, transfers: Sequence[Transfer], what: str) -> None:
        """Move bytes point to point: this rank posts every receive addressed to it, then every
        send it owes, then waits for all of them (so no order of ranks can deadlock)."""
        mine = [t for t in transfers if self.rank in (t.src, t.dst) and t.src != t.dst]
        if not mine:
            return
        import torch.distributed as dist

        def run() -> None:
            works = [dist.irecv(t.tensor, group=self.group, group_src=t.src, tag=t.tag)
                     for t in mine if t.dst == self.rank]
            works += [dist.isend(t.tensor, group=self.group, group_dst=t.dst, tag=t.tag)
                      for t in mine if t.src == self.rank]
            for w in works:
                w.wait(timedelta(seconds=self.timeout_s))

        self._run(what, run)

    # -- agreeing on an outcome ------------------------------------------------
    def agree(self, error: BaseException | None, what: str, *, hint: str | None = None) -> None:
        """Collective: raise on every rank if any rank failed (its own error where it failed,
        RankFailedError naming the failed ranks elsewhere)."""
        outcomes = self.all_gather(None if error is None else describe(error), what)
        raise_failures(outcomes, error, what, hint=hint)


def raise_failures(outcomes: Sequence[Any], error: BaseException | None, what: str, *,
                   hint: str | None = None) -> None:
    """Given each rank's outcome (None or a description), raise as :meth:`Coordinator.agree` says."""
    failed = {r: o for r, o in enumerate(outcomes) if o is not None}
    if not failed:
        return
    if error is not None:
        raise error
    raise RankFailedError(what, failed, *([hint] if hint else []))
