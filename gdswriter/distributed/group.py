"""The coordination channel of a multi-rank checkpoint.

Every checkpoint collective (who holds what, votes, the commit decision, chunks sent to a
rank that cannot read them) runs over a dedicated gloo group with an explicit timeout: a rank
that dies or hangs turns into CollectiveFailedError on the others within the timeout instead
of a hang, and the training's own (NCCL) group is never touched. Messages are JSON, sent as
byte tensors: nothing is pickled.

Each GDSCheckpointer has a channel of its own (``Coordinator.create``, from its constructor:
one gloo group per checkpointer, not per save; its close() hands the group back to a pool that
the next checkpointer on the same process group takes it from). Its save thread and
its loads then never share a group with another checkpointer's save thread: two threads
issuing collectives on one group would pair them up differently on each rank (a hang until
the timeout, or gloo aborting the process). Within a channel, collectives run one thread at a
time (a lock), and a checkpointer runs them in program order (its saves one after another in
its save thread; load waits for them first). The DCP plug-in shares one channel per process
group and timeout (``Coordinator.for_group``), made at its first save or load: DCP's own
collectives over the process group already need its saves and loads to run one at a time
(an async_save's future waited for before the next one).

Creating a gloo group is a collective over the group's ranks, matched by creation order (as
any ``torch.distributed.new_group``): every rank must construct (and close) its checkpointers
in the same order. The first collective of a new channel compares what each rank creates it
for (its number among this process group's channels and a label: the state names of the
checkpointer, or the DCP plug-in); a mismatch raises CollectiveMismatchError on every rank at
once, before anything is written. (Two checkpointers of the same state names swapped cannot
be told apart this way.)

After a failed collective the channel is marked broken: a rank may have left it half way, so
any later use fails at once with the same typed error (restart the job).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar
from collections.abc import Callable, Sequence

import torch

from ..errors import CollectiveFailedError, CollectiveMismatchError, GDSWriterError, RankFailedError


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


@dataclass
class TrafficStats:
    """What this rank's checkpoint collectives moved: payload bytes it sent and received (the
    messages' own bytes as each collective defines them: an all_gather receives every other
    rank's message, a gather's root receives every message, a broadcast delivers the root's
    message to each rank; size headers included) and how many collectives it joined. Tests and
    benchmarks read it to show what a save costs a rank as the world grows."""

    sent: int = 0
    received: int = 0
    collectives: int = 0

    def add(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.collectives += 1

    def snapshot(self) -> tuple[int, int, int]:
        return self.sent, self.received, self.collectives


MAX_SHOWN_FAILURES = 8
"""A decision broadcast to every rank names at most this many failed ranks (and counts the
rest), so that what a rank receives does not grow with the number of ranks that failed."""


def bounded(failures: dict[int, str]) -> dict:
    """A failure set as a fixed-size message: the first MAX_SHOWN_FAILURES (rank order) and the count."""
    shown = sorted(failures.items())[:MAX_SHOWN_FAILURES]
    return {"failed": len(failures), "shown": [[r, m] for r, m in shown]}


def unbound(msg: dict) -> tuple[dict[int, str], int]:
    """The (shown failures, total count) of a ``bounded`` message."""
    return {int(r): m for r, m in msg["shown"]}, int(msg["failed"])


class Coordinator:
    """Object collectives among the ranks of one process group (``rank`` and ``world_size`` are
    in that group). ``solo()`` is the one-process case: every collective is trivial."""

    _shared: ClassVar[dict[tuple[int, float], Coordinator]] = {}  # for_group's channels (the DCP plug-in)
    _created: ClassVar[dict[int, list]] = {}  # id(process group) -> [the group, channels created on it]
    # (id(process group), timeout) -> (the process group, gloo groups closed, the first closed first)
    _free: ClassVar[dict[tuple[int, float], tuple[Any, list]]] = {}
    _cache_lock: ClassVar[threading.RLock] = threading.RLock()  # channels are created one at a time

    def __init__(self, group: Any, ranks: Sequence[int], rank: int, timeout_s: float, source: Any = None,
                 *, owned: bool = False):
        self.group, self.global_ranks, self.rank = group, list(ranks), rank
        self.world_size = len(self.global_ranks)
        self.timeout_s = timeout_s
        self._source = source  # the process group this one coordinates (kept alive for the cache)
        self._owned = owned  # the gloo group is this channel's alone: close() hands it back to the pool
        self._broken: str | None = None
        self._closed = False
        self._serial = threading.RLock()  # one thread at a time in this channel's collectives
        self.stats = TrafficStats()

    @classmethod
    def solo(cls) -> Coordinator:
        return cls(None, [0], 0, 1.0)

    @classmethod
    def create(cls, process_group: Any = None, *, timeout_s: float, label: str) -> Coordinator:
        """A new channel of its own over ``process_group`` (default: the default group), for one
        GDSCheckpointer (``label`` says which, e.g. "GDSCheckpointer(model, optimizer)"); close()
        releases it. Collective: every rank of the group creates (and closes) its channels in the
        same order (CollectiveMismatchError on every rank otherwise). Without an initialised
        torch.distributed, or with one rank, the solo coordinator."""
        return cls._new(process_group, timeout_s, label, owned=True)

    @classmethod
    def for_group(cls, process_group: Any = None, *, timeout_s: float) -> Coordinator:
        """The shared channel of ``process_group`` (default: the default group) and ``timeout_s``,
        which the DCP plug-in uses, created on first use; every rank of the group must call this
        at the same point the first time (see create). Never closed. Without an initialised
        torch.distributed, the solo coordinator."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls.solo()
        pg = process_group if process_group is not None else dist.group.WORLD
        key = (id(pg), float(timeout_s))
        with cls._cache_lock:
            hit = cls._shared.get(key)
            if hit is not None and hit._source is pg:
                return hit
            coord = cls._new(process_group, timeout_s, "the DCP plug-in (GDSStorageWriter/GDSStorageReader)",
                             owned=False)
            cls._shared[key] = coord
            return coord

    @classmethod
    def shared_channels(cls) -> int:
        """How many shared channels (for_group) this process made: each costs a process group."""
        with cls._cache_lock:
            return len(cls._shared)

    @classmethod
    def _new(cls, process_group: Any, timeout_s: float, label: str, *, owned: bool) -> Coordinator:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls.solo()
        pg = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        if len(ranks) == 1:
            return cls.solo()
        what = f"creating the checkpoint coordination group of {label}"
        with cls._cache_lock:
            entry = cls._created.get(id(pg))
            if entry is None or entry[0] is not pg:
                entry = cls._created[id(pg)] = [pg, 0]
            entry[1] += 1
            number = entry[1]
            source, free = cls._free.get((id(pg), float(timeout_s)), (None, []))
            if source is pg and free:
                group = free.pop(0)  # every rank closed the same channels in the same order
            else:
                try:
                    group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                                           use_local_synchronization=True)
                except Exception as e:  # noqa: BLE001 - a rank that never creates its group: a store timeout
                    raise CollectiveFailedError(what, timeout_s, describe(e)) from e
        coord = cls(group, ranks, dist.get_rank(pg), timeout_s, source=pg, owned=owned)
        try:
            mine = {"number": number, "label": label}
            everyone = coord.gather(mine, what, dst=0)  # rank 0 compares; every rank gets its verdict
            shown = None
            if everyone is not None and any(x != everyone[0] for x in everyone):
                odd = [r for r, x in enumerate(everyone) if x != everyone[0]][:3]
                shown = "; ".join(f"rank {r}: its channel #{everyone[r]['number']}, for {everyone[r]['label']}"
                                  for r in [0, *odd])
            shown = coord.broadcast(shown, f"{what} (verdict)", src=0)
            if shown is not None:
                raise CollectiveMismatchError(
                    f"{what}: the ranks are creating different checkpoint coordination channels ({shown}). "
                    f"Construct (and close) every GDSCheckpointer, and make the first save or load with "
                    f"gdswriter's DCP plug-in, in the same order on every rank of the process group, as with "
                    f"any torch.distributed process group; nothing was written")
        except BaseException:
            coord.close()
            raise
        return coord

    def close(self) -> None:
        """Give up this channel (local, not a collective: after its last collective). Its own gloo
        group, unless broken (a collective may still be in flight there), goes back to a pool the
        next ``create`` on the same process group and timeout takes it from, instead of creating
        one. Not destroyed: torch names a group made with ``use_local_synchronization`` after the
        number of live groups, so destroying one makes the next one reuse its name and its stale
        rendezvous keys (gloo's connectFullMesh then times out). A shared channel stays open.
        Idempotent; a closed channel's collectives raise."""
        with self._serial:
            if self.group is None or not self._owned or self._closed:
                return
            self._closed = True
            if self._broken is not None:
                return
            key = (id(self._source), float(self.timeout_s))
            with Coordinator._cache_lock:
                if Coordinator._free.get(key, (None,))[0] is not self._source:
                    Coordinator._free[key] = (self._source, [])
                Coordinator._free[key][1].append(self.group)

    @property
    def solo_mode(self) -> bool:
        return self.group is None

    # -- plumbing ------------------------------------------------------------
    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        with self._serial:
            if self._closed:
                raise GDSWriterError(f"{what}: this checkpointer's coordination channel is closed (the "
                                     f"GDSCheckpointer was closed): create a new one")
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
            width = max(max(sizes), 1)
            self.stats.add(8 + width, (self.world_size - 1) * (8 + width))
            return [self._decode(o, s) for o, s in zip(outs, sizes)]

        return self._run(what, run)

    def gather(self, obj: Any, what: str, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``dst`` (None elsewhere). Only ``dst`` receives anything
        that grows with the world: the sizes go to it, it broadcasts the largest (8 bytes), and
        every rank sends its message padded to that."""
        if self.solo_mode:
            return [json.loads(json.dumps(obj))]
        import torch.distributed as dist

        def run() -> list[Any] | None:
            data = self._encode(obj)
            n = torch.tensor([data.numel()], dtype=torch.int64)
            root = self.rank == dst
            sizes_t = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)] if root else None
            dist.gather(n, sizes_t, group=self.group, group_dst=dst)
            sizes = [int(s) for s in sizes_t] if sizes_t is not None else []
            width = torch.tensor([max(max(sizes), 1) if root else 0], dtype=torch.int64)
            dist.broadcast(width, group=self.group, group_src=dst)
            buf = torch.zeros(int(width), dtype=torch.uint8)
            buf[:data.numel()] = data
            outs = [torch.empty_like(buf) for _ in range(self.world_size)] if root else None
            dist.gather(buf, outs, group=self.group, group_dst=dst)
            if root:
                self.stats.add(8 + 8 + int(width), (self.world_size - 1) * (8 + int(width)))
            else:
                self.stats.add(8 + int(width), 8)
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
            if self.rank == src:
                self.stats.add((self.world_size - 1) * (8 + buf.numel()), 0)
            else:
                self.stats.add(0, 8 + buf.numel())
            return self._decode(buf, int(n))

        return self._run(what, run)

    def scatter(self, objs: Sequence[Any] | None, what: str, src: int = 0) -> Any:
        """Rank ``src``'s ``objs[r]`` on each rank ``r`` (``objs`` is read on ``src`` only): an
        answer of its own for every rank. A rank receives its message padded to the largest one
        (whose size ``src`` broadcasts, 8 bytes): constant in the world size when every message is."""
        if self.solo_mode:
            assert objs is not None
            return json.loads(json.dumps(objs[0]))
        import torch.distributed as dist

        def run() -> Any:
            root = self.rank == src
            datas = [self._encode(o) for o in objs] if root and objs is not None else []
            if root and len(datas) != self.world_size:
                raise ValueError(f"internal: scatter of {len(datas)} messages to {self.world_size} ranks")
            width = torch.tensor([8 + max((d.numel() for d in datas), default=0)], dtype=torch.int64)
            dist.broadcast(width, group=self.group, group_src=src)
            n = int(width)
            bufs = None
            if root:
                bufs = []
                for d in datas:
                    b = torch.zeros(n, dtype=torch.uint8)
                    b[:8] = torch.tensor([d.numel()], dtype=torch.int64).view(torch.uint8)
                    b[8:8 + d.numel()] = d
                    bufs.append(b)
            out = torch.empty(n, dtype=torch.uint8)
            dist.scatter(out, bufs, group=self.group, group_src=src)
            if root:
                self.stats.add((self.world_size - 1) * (8 + n), 0)
            else:
                self.stats.add(0, 8 + n)
            return self._decode(out[8:], int(out[:8].view(torch.int64)))

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
            self.stats.add(sum(t.tensor.numel() for t in mine if t.src == self.rank),
                           sum(t.tensor.numel() for t in mine if t.dst == self.rank))

        self._run(what, run)

    # -- agreeing on an outcome ------------------------------------------------
    def agree(self, error: BaseException | None, what: str, *, hint: str | None = None, root: int = 0) -> None:
        """Collective: raise on every rank if any rank failed (its own error where it failed,
        RankFailedError naming the failed ranks elsewhere). The outcomes are gathered to ``root``,
        which broadcasts a fixed-size decision (``bounded``): a rank receives the same few bytes
        whatever the world size: ``decide`` with nothing to decide."""
        self.decide(error, None, what, lambda _: None, hint=hint, root=root)

    def decide(self, error: BaseException | None, mine: Any, what: str, rule: Callable[[list[Any]], Any], *,
               hint: str | None = None, root: int = 0) -> Any:
        """Collective: ``agree`` and a decision in the same two messages. Every rank's ``mine``
        (or its error) goes to ``root``, which broadcasts ``rule(every rank's mine)`` when no
        rank failed, else the failures, bounded. Raises as agree does (so does ``rule`` raising
        on ``root``); otherwise returns the decision on every rank."""
        return self._decide(error, mine, what, rule, hint=hint, root=root, each=False)

    def decide_each(self, error: BaseException | None, mine: Any, what: str,
                    rule: Callable[[list[Any]], Sequence[Any]], *, hint: str | None = None, root: int = 0) -> Any:
        """Collective: ``decide`` where each rank gets a decision of its own: ``rule(every rank's
        mine)`` returns one per rank, in rank order, and each rank receives only its own
        (scattered, padded to the largest): constant in the world size when every rank's
        decision is, where a broadcast list of W answers would grow with it."""
        return self._decide(error, mine, what, rule, hint=hint, root=root, each=True)

    def _decide(self, error: BaseException | None, mine: Any, what: str, rule: Callable[[list[Any]], Any], *,
                hint: str | None, root: int, each: bool) -> Any:
        got = self.gather({"error": describe(error)} if error is not None else {"mine": mine}, what, dst=root)
        msgs: list[dict] | None = None
        if got is not None:
            failures = {r: x["error"] for r, x in enumerate(got) if "error" in x}
            if not failures:
                try:
                    decided = rule([x["mine"] for x in got])
                    if each and len(decided) != self.world_size:
                        raise ValueError(f"internal: {len(decided)} decisions for {self.world_size} ranks")
                    msgs = [{"decision": d} for d in decided] if each else [{"decision": decided}]
                except Exception as e:  # noqa: BLE001 - every rank learns of it
                    error, failures = e, {self.rank: describe(e)}
            if failures:
                msgs = [bounded(failures)] * (self.world_size if each else 1)
        if each:
            msg = self.scatter(msgs, f"{what} (decision)", src=root)
        else:
            msg = self.broadcast(msgs[0] if msgs is not None else None, f"{what} (decision)", src=root)
        if "decision" in msg:
            return msg["decision"]
        shown, total = unbound(msg)
        if error is not None:
            raise error
        raise RankFailedError(what, shown, *([hint] if hint else []), total=total)

    def all_true(self, flag: bool, what: str, root: int = 0) -> bool:
        """Collective: whether ``flag`` holds on every rank (gathered to ``root``, decided there,
        broadcast: a fixed-size answer)."""
        flags = self.gather(bool(flag), what, dst=root)
        return bool(self.broadcast(all(flags) if flags is not None else None, f"{what} (decision)", src=root))


def raise_failures(outcomes: Sequence[Any], error: BaseException | None, what: str, *,
                   hint: str | None = None) -> None:
    """Given each rank's outcome (None or a description), raise as :meth:`Coordinator.agree` says."""
    failed = {r: o for r, o in enumerate(outcomes) if o is not None}
    if not failed:
        return
    if error is not None:
        raise error
    raise RankFailedError(what, failed, *([hint] if hint else []))
