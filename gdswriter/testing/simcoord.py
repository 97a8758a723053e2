"""One rank of a simulated world, in one process: the coordinator interface of
distributed/group.py with the other ranks' side of each collective played by a ``Peers``.

The save and load code runs unchanged on it (it is a Coordinator), so a benchmark can drive
the real planning, shard, vote and commit code of rank 0 or of a typical rank at a world size
no machine here can start (benchmarks/dist_scale_sim.py). What the other ranks send is what a
rank like this one sends: their vote reports are this rank's report with their rank, shard
and root put in (``Peers.report_of``), their outcomes are successes. The traffic is counted as
Coordinator counts it (TrafficStats), from the JSON messages' sizes.
"""

from __future__ import annotations

import json
import time
from typing import Any
from collections.abc import Callable, Sequence

from ..distributed.group import Coordinator, Transfer


def _size(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":"), allow_nan=False).encode())


class Peers:
    """The other ranks of a simulated world. ``hello``: the primary's step and token;
    ``report_of(rank, template)``: rank ``rank``'s vote report given this rank's;
    ``manifest``: the global manifest text a load broadcasts. Records this rank's last vote
    report (``last_report``) for the next simulated rank to use as its template."""

    def __init__(self, step: int, token: str = "sim00000",
                 report_of: Callable[[int, dict], dict] | None = None, template: dict | None = None,
                 message_of: Callable[[int, str, Any], Any] | None = None):
        self.step, self.token = step, token
        self.report_of = report_of
        self.template = template
        self.message_of = message_of  # (rank, what, this rank's message) -> rank's message, where it differs
        self.manifest: str | None = None
        self.last_report: dict | None = None
        self._made: dict[int, dict] = {}  # the other ranks' reports, made once (their cost is theirs)
        # what a root sent when this process played it (rank 0 simulated first): a typical rank then
        # receives what rank 0's real code sent it
        self.sent: dict[str, Any] = {}
        self.scattered: dict[str, list] = {}

    def scatter(self, rank: int, what: str) -> Any:
        """Rank ``rank``'s part of the scatter at ``what``, as the simulated root sent it."""
        return self.scattered[what][rank]

    def broadcast(self, what: str) -> Any:
        """What the root (another rank) broadcasts at ``what``, when every rank succeeded."""
        if what in self.sent:
            return self.sent[what]
        if what.endswith("(step)"):
            return {"step": self.step, "token": self.token}
        if "(loading from its own shard) (decision)" in what:
            return {"own": True, "failed": 0, "shown": []}
        if what.endswith("(manifest)"):
            return {"step": self.step, "manifest": self.manifest}
        return {"failed": 0, "shown": [], "hint": None, "keep": False}

    def message(self, rank: int, what: str, mine: Any) -> Any:
        """What rank ``rank`` sends in a gather at ``what``, given this rank's message."""
        if what.endswith("(vote)") and isinstance(mine, dict) and "report" in mine:
            self.last_report = mine["report"]
            report = self._made.get(rank)
            if report is None:
                template = self.template or mine["report"]
                report = self._made[rank] = dict(self.report_of(rank, template) if self.report_of else template)
            report["step"] = self.step
            return {"report": report}
        if self.message_of is not None:
            return self.message_of(rank, what, mine)
        return mine


class SimCoordinator(Coordinator):
    """Rank ``rank`` of ``world_size`` simulated ranks (the module docstring)."""

    def __init__(self, rank: int, world_size: int, peers: Peers, timeout_s: float = 60.0):
        super().__init__(object(), range(world_size), rank, timeout_s)
        self.peers = peers
        self.peer_cpu_s = 0.0  # time spent making the other ranks' messages (not this rank's work)

    @property
    def solo_mode(self) -> bool:
        return False

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        everyone = [obj if r == self.rank else self.peers.message(r, what, obj) for r in range(self.world_size)]
        width = max(_size(x) for x in everyone)
        self.stats.add(8 + width, (self.world_size - 1) * (8 + width))
        return json.loads(json.dumps(everyone))

    def gather(self, obj: Any, what: str, dst: int = 0) -> list[Any] | None:
        if self.rank != dst:
            width = max(_size(obj), 1)  # the peers' messages are like this rank's
            self.stats.add(8 + width, 8)
            self.peers.message(self.rank, what, obj)
            return None
        everyone = [obj if r == self.rank else self.peers.message(r, what, obj) for r in range(self.world_size)]
        # what arrives: each rank's message as bytes (made here, outside what this rank would pay:
        # the peers encode their own), then decoded by this rank as Coordinator decodes them
        start = time.process_time()
        texts = [json.dumps(x, separators=(",", ":"), allow_nan=False) for x in everyone]
        self.peer_cpu_s += time.process_time() - start
        width = max(len(t) for t in texts)
        self.stats.add(16 + width, (self.world_size - 1) * (8 + width))
        return [json.loads(t) for t in texts]

    def broadcast(self, obj: Any, what: str, src: int = 0) -> Any:
        if self.rank == src:
            self.stats.add((self.world_size - 1) * (8 + _size(obj)), 0)
            self.peers.sent[what] = json.loads(json.dumps(obj))
            return json.loads(json.dumps(obj))
        msg = self.peers.broadcast(what)
        self.stats.add(0, 8 + _size(msg))
        return json.loads(json.dumps(msg))

    def scatter(self, objs: Sequence[Any] | None, what: str, src: int = 0) -> Any:
        if self.rank == src:
            assert objs is not None
            width = 8 + max(_size(x) for x in objs)
            self.stats.add((self.world_size - 1) * (8 + width), 0)
            self.peers.scattered[what] = json.loads(json.dumps(list(objs)))
            return json.loads(json.dumps(objs[self.rank]))
        msg = self.peers.scatter(self.rank, what)
        self.stats.add(0, 8 + 8 + _size(msg))  # padded to the largest part, in the real scatter
        return json.loads(json.dumps(msg))

    def exchange(self, transfers: Sequence[Transfer], what: str) -> None:
        mine = [t for t in transfers if self.rank in (t.src, t.dst) and t.src != t.dst]
        self.stats.add(sum(t.tensor.numel() for t in mine if t.src == self.rank),
                       sum(t.tensor.numel() for t in mine if t.dst == self.rank))

    def close(self) -> None:
        pass
