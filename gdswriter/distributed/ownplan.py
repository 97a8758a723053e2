"""The pure plan of a load from each rank's own manifest shard (load.py ``load_own``).

Computed from a rank's shard, its rank and the world, and what the ranks agreed of their
hosts: which pieces of each item this rank reads (``pieces``: split_stream's, the same on
every holder, no message), the layout of the one buffer per rank that the ranks of a host
pull from each other's memory (``Arena``), the items the ranks of a host share through a
tmpfs (``sharable``), and the relay rounds each piece spreads down (``relay_rounds``). No
collective, no I/O: tested without ranks (tests/test_ownplan.py), as planner/ is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple
from collections.abc import Mapping, Sequence

from ..errors import CorruptCheckpointError
from ..format.sharded import RankShard
from .loadplan import relay, relay_between_hosts, template_of, tiles
from .rankfiles import item_pieces, set_name
from .shards import target_block

ARENA_ALIGN = 4096  # each item of the pulled buffer starts on a page (O_DIRECT reads into it)


class Move(NamedTuple):
    """One transfer of a relay round: the piece (offset, length) of item ``sid``, ``src`` to ``dst``."""
    src: int
    dst: int
    sid: int
    offset: int
    length: int


@dataclass(frozen=True)
class Arena:
    """The items several ranks of this host hold, in one buffer per rank (cross memory): by
    holder set (name order), each set's items in key order, each at ``offsets[sid]``, a set's
    region starting at ``regions[name]``; every holder of a set lays it out alike (its digest
    is agreed on), so one address per set locates every piece of it in a holder's buffer."""
    sets: dict[str, tuple[int, ...]]
    offsets: dict[int, int]
    regions: dict[str, int]
    size: int

    @property
    def items(self) -> frozenset[int]:
        return frozenset(self.offsets)


NO_ARENA = Arena({}, {}, {}, 0)


@dataclass(frozen=True)
class OwnLoadPlan:
    """Who reads which piece and what the ranks of a host may share, for ``rank`` of ``world``.
    ``pieces[sid]``: (writer, offset, length) of every piece of item ``sid``; ``arena``: the
    cross-memory layout (NO_ARENA where the ranks cannot pull); ``sharable``: the items a host's
    tmpfs would hold."""
    rank: int
    world: int
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    arena: Arena
    sharable: tuple[int, ...]


def host_blocks(hosts: Sequence[str | None]) -> int | None:
    """The size of the blocks of consecutive ranks that each share a host's tmpfs (torchrun
    numbers a node's ranks consecutively), when every host holds one such block of the same
    size, at least 2; else None (then the pieces go over the process group)."""
    if not hosts or None in hosts:
        return None
    block = next((i for i, h in enumerate(hosts) if h != hosts[0]), len(hosts))
    if block < 2 or len(hosts) % block:
        return None
    firsts = hosts[::block]
    if len(set(firsts)) != len(firsts) or any(hosts[i] != hosts[i - i % block] for i in range(len(hosts))):
        return None
    return block


def per_host(values: Sequence[Any], block: int) -> list[list[Any]]:
    """For each rank, the entries of ``values`` (one per rank) of its own host's ``block`` ranks
    (host_blocks): what a rank receives of them then does not grow with the world size."""
    return [list(values[r - r % block:r - r % block + block]) for r in range(len(values))]


def blocks_fit(shard: RankShard, templates: dict[str, Any]) -> bool:
    """Whether every DTensor block this rank saved is exactly the block its live tensor holds
    now (same mesh and placements): then its own shard is all it needs of sharded state."""
    for rec in shard.tensors:
        if rec.shard is not None:
            offsets, shape, _ = target_block(template_of(templates, rec.name), rec.shard.global_shape)
            if tuple(offsets) != tuple(rec.shard.offsets) or tuple(shape) != tuple(rec.shape):
                return False
    return True


def arena_sets(shard: RankShard, rank: int, block: int) -> dict[str, tuple[int, ...]]:
    """The items of ``shard`` the ranks of this host pull from each other's memory in a load, by
    holder set (its name, in name order), each set's items in key order: those every rank holds,
    and those of a replica group all of whose holders are on this host (``block`` consecutive
    ranks). Every holder of a set computes the same list (the set's digest is agreed on)."""
    first = rank - rank % block
    sets: dict[str, list[int]] = {}
    for sid, it in sorted(enumerate(shard.items), key=lambda x: x[1].key):
        if it.nbytes and (it.holders is None or (len(it.holders) > 1 and
                                                 all(first <= h < first + block for h in it.holders))):
            sets.setdefault(set_name(it.holders), []).append(sid)
    return {name: tuple(sids) for name, sids in sorted(sets.items())}


def arena_layout(shard: RankShard, rank: int, block: int) -> Arena:
    """``arena_sets`` laid out in one buffer, each item on an ARENA_ALIGN boundary."""
    sets = arena_sets(shard, rank, block)
    offsets: dict[int, int] = {}
    regions: dict[str, int] = {}
    end = 0
    for name, sids in sets.items():
        regions[name] = end
        for sid in sids:
            offsets[sid] = end
            end += -(-shard.items[sid].nbytes // ARENA_ALIGN) * ARENA_ALIGN
    return Arena(sets, offsets, regions, end)


def sharable(shard: RankShard, world: int, block: int) -> tuple[int, ...]:
    """The items of ``shard`` the ranks of a host share in a load (hostshare.py): those several
    ranks hold, all of them on one host (``block == world``); across hosts those every rank
    holds (a replica group's are passed rank to rank)."""
    return tuple(sid for sid, it in enumerate(shard.items)
                 if it.nbytes and it.holder_count(world) > 1 and (it.holders is None or block == world))


def plan_own(shard: RankShard, rank: int, world: int, *, pull_block: int | None, share_block: int | None,
             what: str) -> OwnLoadPlan:
    """The plan of ``rank``'s load from ``shard``: ``pull_block`` (the ranks per host that may
    pull from each other's memory) and ``share_block`` (per tmpfs), None where they may not.
    Raises CorruptCheckpointError where the shard does not record exactly the pieces the rank
    wrote."""
    pieces = item_pieces(shard.items, world)
    for sid, it in enumerate(shard.items):
        if not tiles(shard.chunks[sid], [(off, n) for w, off, n in pieces[sid] if w == rank]):
            raise CorruptCheckpointError(f"{what}: rank {rank}'s manifest shard does not record exactly the "
                                         f"pieces of item {it.key[:40]} it wrote: the checkpoint is damaged; "
                                         f"load an earlier step")
    return OwnLoadPlan(rank, world, tuple(tuple(p) for p in pieces),
                       arena_layout(shard, rank, pull_block) if pull_block else NO_ARENA,
                       sharable(shard, world, share_block) if share_block else ())


def relay_rounds(shard: RankShard, pieces: Sequence[Sequence[tuple[int, int, int]]], rank: int, world: int,
                 block: int, shared: frozenset[int] | set[int]) -> list[list[Move]]:
    """Per round, the transfers this rank takes part in: the pieces of items several ranks hold
    spread down ``relay``'s tree; those ``shared`` within a host (its tmpfs, or its ranks'
    memory) travel only between hosts when every rank holds them (``relay_between_hosts``),
    else (one host, or a replica group all on one host) not at all. Items in key order, so
    every holder numbers a pair's messages alike."""
    rounds: list[list[Move]] = []
    for sid in sorted(range(len(shard.items)), key=lambda i: shard.items[i].key):
        it = shard.items[sid]
        if it.holder_count(world) < 2 or (sid in shared and (block == world or it.holders is not None)):
            continue
        for w, off, n in pieces[sid]:
            if n:
                moves = relay_between_hosts(w, rank, world, block) if sid in shared else relay(it, w, rank, world)
                for k, a, b in moves:
                    while len(rounds) <= k:
                        rounds.append([])
                    rounds[k].append(Move(a, b, sid, off, n))
    return rounds


def pull_moves(plan: OwnLoadPlan, block: int, bases: Sequence[dict[str, int | Sequence[int]]],
               mine: Mapping[int, int]) -> dict[int, list[tuple[int, int, int]]]:
    """By local index of the holder on this host, the (source address, destination address,
    length) copies that bring this rank the arena's pieces it lacks: ``bases`` say where each
    holder set is in the memory of this host's ``block`` ranks (its region's start, laid out
    alike by every holder, or each of its items' start in set order: CrossMemoryTransport.address),
    ``mine`` where this rank holds each item. The holder is the writer's local index (its
    writer, or for the items every rank holds the rank the piece crossed hosts to)."""
    moves: dict[int, list[tuple[int, int, int]]] = {}
    for name, sids in plan.arena.sets.items():
        region = plan.arena.offsets[sids[0]]
        for i, sid in enumerate(sids):
            for w, off, n in plan.pieces[sid]:
                holder = w % block  # its local index on this host
                if n and holder != plan.rank % block:
                    base = bases[holder][name]
                    start = base[i] if isinstance(base, (list, tuple)) else base + plan.arena.offsets[sid] - region
                    moves.setdefault(holder, []).append((start + off, mine[sid] + off, n))
    return moves
