"""How the ranks of a load pass each other the pieces of the items several of them hold.

One seam, three ways (chosen by one agreement in load.py, in this order where every rank can):
``CrossMemoryTransport`` (the ranks of a host copy the pieces from each other's buffer:
crossmem.py), ``HostTmpfsTransport`` (they read into one shared tmpfs file per item:
hostshare.py), ``ProcessGroupTransport`` (every piece over the process group). Each gives the
buffers a rank reads its pieces into (``buffers``), says which items stay within a host
(``shared``: they cross hosts only, ``relay_between_hosts``) and what a rank tells its host's
ranks once it has read (``address``); the relay rounds between hosts go over the process group
on every transport (readexec.py ``send_rounds``); ``release`` drops what only the exchange needed, ``pull``
copies from the host's peers. A test passes its own Transport.
"""

from __future__ import annotations

import hashlib
from typing import Any
from collections.abc import Mapping, Sequence

import torch

from ..format.sharded import ItemRecord, RankShard
from ..load.reader import host_buffer
from . import crossmem, hostshare
from .ownplan import OwnLoadPlan, per_host, pull_moves


class Transport:
    """The seam; its defaults share nothing on a host (ProcessGroupTransport). ``kind`` names it
    in logs; ``block``: the ranks of a host that share (the world where none do)."""
    kind = "group"

    def __init__(self, world: int, block: int | None = None):
        self.world = world
        self.block = block or world

    @property
    def shared(self) -> frozenset[int]:
        """The items the ranks of a host share (read once per host)."""
        return frozenset()

    @property
    def within_host(self) -> bool:
        """Whether the ranks of a host share what they read (then pieces from other hosts are
        there once every rank has them: one agreement)."""
        return False

    def buffers(self, items: Sequence[ItemRecord], direct: Mapping[int, torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(this rank's private view of each item, which the state is built on; where its pieces
        are read into and sent from and into). ``direct`` (load(atomic=False)): item -> the flat
        bytes of the live tensor it is read, received and pulled into, instead of a fresh buffer."""
        out = [direct[sid] if sid in direct else host_buffer(it.nbytes) for sid, it in enumerate(items)]
        return out, out

    def address(self) -> Any:
        """What this rank tells the ranks of its host once it has read (None: nothing)."""
        return None

    def route(self, outs: list[Any]) -> list[Any]:
        """Root's rule for ``address``: each rank's answer (none by default)."""
        return [None] * len(outs)

    def release(self) -> None:
        """The exchange over the process group is over: drop what only it needed (the shared
        mappings; the state is built on the private views)."""

    def pull(self, plan: OwnLoadPlan, bases: Any) -> BaseException | None:
        """Copy from this host's peers the pieces this rank lacks; the failure, if any (agreed by
        the caller, which then sends those items over the process group)."""
        return None

    def keeps_into(self) -> bool:
        """Whether the read-into buffers must outlive the exchange (a fallback may send from them)."""
        return False


class ProcessGroupTransport(Transport):
    """Every piece over the process group: a private buffer per item, nothing shared on a host
    (the base's behaviour, named)."""


class HostTmpfsTransport(Transport):
    """The ranks of each host read the items they share (``sharable``) into one tmpfs file per
    item (hostshare.SharedItems), each rank viewing it through a private mapping."""
    kind = "tmpfs"

    def __init__(self, world: int, block: int | None, share: hostshare.SharedItems):
        super().__init__(world, block)
        self.share = share

    @property
    def shared(self) -> frozenset[int]:
        return frozenset(self.share.private)

    @property
    def within_host(self) -> bool:
        return True

    def buffers(self, items: Sequence[ItemRecord], direct: Mapping[int, torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The shared items through the tmpfs; ``direct`` is not used (load.py gives none here)."""
        views = [self.share.private[sid] if sid in self.share.private else host_buffer(it.nbytes)
                 for sid, it in enumerate(items)]
        return views, [self.share.shared.get(sid, b) for sid, b in enumerate(views)]

    @classmethod
    def open(cls, world: int, block: int | None, share_dir: str | None, token: str, shard: RankShard,
             sids: Sequence[int]) -> HostTmpfsTransport:
        """This rank's shared files for the items ``sids`` of ``shard`` (named by item key, the
        same on every holder) in ``share_dir``'s directory ``token``."""
        hostshare.clean_stale(share_dir)
        items = [(hashlib.sha1(shard.items[sid].key.encode()).hexdigest()[:20], sid, shard.items[sid].nbytes)
                 for sid in sids]
        return cls(world, block, hostshare.SharedItems(share_dir, token, items))  # type: ignore[arg-type]

    def unlink(self) -> None:
        """Remove the shared files' names (once every rank has mapped them, given up or raises:
        no name outlives the agreement)."""
        self.share.unlink()

    def release(self) -> None:
        self.share.release_shared()


LIVE_ITEMS_PER_SET = 64  # CrossMemoryTransport.address: at most this many addresses per holder set


class CrossMemoryTransport(Transport):
    """The items several ranks of a host hold, in one buffer per rank laid out alike
    (``plan.arena``); each rank copies the pieces it lacks from its host's ranks' buffers
    (crossmem.pull), whose (pid, marker) are ``peers``."""
    kind = "cma"

    def __init__(self, world: int, block: int, plan: OwnLoadPlan, peers: Sequence[Sequence[int]]):
        super().__init__(world, block)
        self.plan = plan
        self.peers = peers
        self.arena: torch.Tensor | None = None
        self.starts: dict[int, int] = {}  # arena item -> where this rank holds it (buffers)
        self.live: set[int] = set()  # the arena items held in live tensors instead

    @classmethod
    def probe(cls, world: int, block: int, plan: OwnLoadPlan, peers: Sequence[Sequence[int]]
              ) -> tuple[CrossMemoryTransport | None, BaseException | None]:
        """The transport where this rank may read the memory of every other rank of its host,
        else the error that said it may not."""
        try:
            for q, peer in enumerate(peers):
                if q != plan.rank % block:
                    crossmem.probe(*peer)
        except Exception as e:  # noqa: BLE001 - agreed by the caller: then the tmpfs or the process group
            return None, e
        return cls(world, block, plan, peers), None

    @property
    def shared(self) -> frozenset[int]:
        return self.plan.arena.items

    @property
    def within_host(self) -> bool:
        return True

    def buffers(self, items: Sequence[ItemRecord], direct: Mapping[int, torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The arena's items at their place in one fresh buffer, or, those in ``direct``
        (load(atomic=False)), in their live tensors: then read, pulled from and pulled into there,
        with no arena byte and no copy out of it (the buffer is made only for the items left)."""
        at = self.plan.arena.offsets
        if any(sid not in direct for sid in at):
            self.arena = host_buffer(self.plan.arena.size)
        out = [direct[sid] if sid in direct else self.arena[at[sid]:at[sid] + it.nbytes] if sid in at  # type: ignore[index]
               else host_buffer(it.nbytes) for sid, it in enumerate(items)]
        self.starts = {sid: out[sid].data_ptr() for sid in at}
        self.live = set(direct) & set(at)
        return out, out

    def addressable(self, direct: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``direct`` less the items of holder sets of more than LIVE_ITEMS_PER_SET items: a set
        held in live tensors sends one address per item (``address``), which rank 0 gathers from
        every rank, so what it gathers stays (holder sets x a constant) per rank, flat in the
        state's size, as with the arena's one address per set. Those items go through the arena
        and are copied into the live tensors as an atomic load's are."""
        big = {sid for sids in self.plan.arena.sets.values() if len(sids) > LIVE_ITEMS_PER_SET for sid in sids}
        return {sid: t for sid, t in direct.items() if sid not in big}

    def address(self) -> Any:
        """Where each holder set's pieces are in this rank's memory: its region's start in the
        arena (an int: the set laid out alike by every holder), or, for a set with an item in a
        live tensor, each of its items' start in set order (a list)."""
        if not self.starts:
            return None
        return {name: [self.starts[sid] for sid in sids] if self.live & set(sids) else self.starts[sids[0]]
                for name, sids in self.plan.arena.sets.items()}

    def route(self, outs: list[Any]) -> list[Any]:
        return per_host(outs, self.block)

    def keeps_into(self) -> bool:
        return True

    def pull(self, plan: OwnLoadPlan, bases: Any) -> BaseException | None:
        try:
            moves = pull_moves(plan, self.block, bases, self.starts)
            for holder, todo in sorted(moves.items()):
                crossmem.pull(self.peers[holder][0], todo)
        except Exception as e:  # noqa: BLE001 - agreed by the caller: then the process group
            return e
        return None
