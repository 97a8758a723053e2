"""The messages a multi-rank load's agreements carry (load.py): typed here, plain JSON on the wire.

Each travels as ``to_wire()``, the dict or list of JSON values it always was (so what a rank
sends and receives is unchanged: tests/test_dist_scale.py counts it), and is checked as
``from_wire()`` decodes it (GDSWriterError, an internal error: every rank runs the same code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import GDSWriterError


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise GDSWriterError(f"loading: a malformed {what} between the ranks (internal: report it, with the "
                             f"gdswriter version of every rank); the live state was not changed")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _opt(x: Any, kind: type) -> bool:
    return x is None or (_is_int(x) if kind is int else isinstance(x, kind))


@dataclass(frozen=True)
class ShardReport:
    """What a rank tells the primary rank of its own manifest shard: whether it can load from it
    alone (``ok``), the digests of the holder sets it shares (rankfiles.holder_set_digests), and
    who may share its reads: its tmpfs domain (``host``), its cross-memory domain (``proc``) and
    (pid, marker address) (``pid``). Wire: {"ok", "sets", "host", "proc", "pid"}."""
    ok: bool
    sets: tuple[tuple[str, int, str], ...]
    host: str | None
    proc: str | None
    pid: tuple[int, int] | None

    def to_wire(self) -> dict:
        return {"ok": self.ok, "sets": [list(s) for s in self.sets], "host": self.host, "proc": self.proc,
                "pid": list(self.pid) if self.pid is not None else None}

    @classmethod
    def from_wire(cls, x: Any) -> ShardReport:
        _need(isinstance(x, dict) and isinstance(x.get("ok"), bool) and isinstance(x.get("sets"), (list, tuple))
              and _opt(x.get("host"), str) and _opt(x.get("proc"), str), "shard report")
        sets = tuple(tuple(s) for s in x["sets"])
        _need(all(len(s) == 3 and isinstance(s[0], str) and isinstance(s[2], str) for s in sets), "shard report")
        pid = x.get("pid")
        _need(pid is None or (isinstance(pid, (list, tuple)) and len(pid) == 2 and all(_opt(v, int) for v in pid)),
              "shard report")
        return cls(x["ok"], sets, x["host"], x["proc"], tuple(pid) if pid is not None else None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class OwnVerdict:
    """The primary rank's answer to every rank's ShardReport, each rank's own: whether every
    rank loads from its own shard (``own``); the tmpfs directory token and the ranks per host
    sharing one (``share``, ``block``); the ranks per host that may pull from each other's
    memory (``cblock``) and this rank's host's (pid, marker) (``peers``); and the holders whose
    shared items disagree, bounded (``failed``, ``shown``: group.bounded's). Wire: {"own",
    "share", "block", "cblock", "failed", "shown", "peers"}."""
    own: bool
    share: str | None
    block: int | None
    cblock: int | None
    failed: int
    shown: tuple[tuple[int, str], ...]
    peers: tuple[tuple[int, int], ...] | None

    def to_wire(self) -> dict:
        return {"own": self.own, "share": self.share, "block": self.block, "cblock": self.cblock,
                "failed": self.failed, "shown": [list(s) for s in self.shown],
                "peers": [list(p) for p in self.peers] if self.peers is not None else None}

    @classmethod
    def from_wire(cls, x: Any) -> OwnVerdict:
        _need(isinstance(x, dict) and isinstance(x.get("own"), bool) and _opt(x.get("share"), str)
              and _opt(x.get("block"), int) and _opt(x.get("cblock"), int) and _is_int(x.get("failed"))
              and isinstance(x.get("shown"), (list, tuple)), "load verdict")
        shown = tuple((int(r), str(m)) for r, m in x["shown"])
        peers = x.get("peers")
        _need(peers is None or (isinstance(peers, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in peers)), "load verdict")
        return cls(x["own"], x["share"], x["block"], x["cblock"], x["failed"], shown,
                   tuple(tuple(p) for p in peers) if peers is not None else None)  # type: ignore[misc]

    @property
    def shown_failures(self) -> dict[int, str]:
        return dict(self.shown)


@dataclass(frozen=True)
class TransportOffer:
    """Which ways of sharing a rank can take part in: pulling from its host's ranks' memory
    (``pull``: it probed every peer) and the tmpfs (``tmpfs``: it mapped its shared files).
    Wire: [pull, tmpfs]."""
    pull: bool
    tmpfs: bool

    def to_wire(self) -> list:
        return [self.pull, self.tmpfs]

    @classmethod
    def from_wire(cls, x: Any) -> TransportOffer:
        _need(isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, bool) for v in x), "transport offer")
        return cls(x[0], x[1])


def choose_transport(offers: list[Any]) -> str | None:
    """The primary rank's rule over every rank's TransportOffer (wire): "cma" where every rank
    may pull, else "tmpfs" where every rank mapped its files, else None (the process group)."""
    got = [TransportOffer.from_wire(x) for x in offers]
    return "cma" if all(o.pull for o in got) else "tmpfs" if all(o.tmpfs for o in got) else None


@dataclass(frozen=True)
class FallbackDecision:
    """The primary rank's decision after a failed step of load(fallback=True): whether some rank
    failed otherwise than by damage (``other``), whether some found the step gone (``gone``), and
    the ranks that found damage, bounded (``failed``, ``shown``). Wire: {"other", "gone",
    "failed", "shown"}."""
    other: bool
    gone: bool
    failed: int
    shown: tuple[tuple[int, str], ...]

    def to_wire(self) -> dict:
        return {"other": self.other, "gone": self.gone, "failed": self.failed, "shown": [list(s) for s in self.shown]}

    @classmethod
    def from_wire(cls, x: Any) -> FallbackDecision:
        _need(isinstance(x, dict) and isinstance(x.get("other"), bool) and isinstance(x.get("gone"), bool)
              and _is_int(x.get("failed")) and isinstance(x.get("shown"), (list, tuple)), "fallback decision")
        return cls(x["other"], x["gone"], x["failed"], tuple((int(r), str(m)) for r, m in x["shown"]))
