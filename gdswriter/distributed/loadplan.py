"""The pure parts of a multi-rank load's plan that load.py and reshard.py both use: which
live tensor stands for a saved one, where this rank
finds each root of a step, whether chunks cover exactly the pieces a split gives, and the
binomial-tree schedule that spreads a piece to every rank holding it. No collective, no I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

from ..format.manifest import ChunkRecord
from ..format.sharded import GlobalManifest, ItemRecord, root_columns
from .roots import RootLayout


def template_of(templates: dict[str, Any], name: str) -> Any:
    """The live tensor standing for saved tensor ``name``: its own, or for an optimizer moment not
    created yet, its parameter's."""
    hit = templates.get(name)
    if hit is None and name.startswith("optimizer/state/"):
        hit = templates.get(name.rsplit("/", 1)[0])  # the parameter whose moments these are
    return hit


def reach_of(g: GlobalManifest, layout: RootLayout) -> list[Path | None]:
    """Where this rank finds each root of ``g`` (fetch.manifest_reach's rule: by id, else by path
    for a root of its own that has no id). The table has a root per rank or more: each of this
    rank's few roots is looked up in its ids and paths by list.index (in C), so no Python runs
    per entry of the table."""
    ids, paths = root_columns(g.roots)
    out: list[Path | None] = [None] * len(ids)

    def at(column: list[str], value: str) -> Iterator[int]:
        i = -1
        while True:
            try:
                i = column.index(value, i + 1)
            except ValueError:
                return
            yield i

    for p, i in reversed(list(zip(layout.local_paths, layout.local_ids))):  # the first of a repeated id wins
        for k in at(ids, i):
            out[k] = p
    local = set(layout.local_ids)
    unmarked = {str(p.resolve()): p for p, i in zip(layout.local_paths, layout.local_ids) if i.startswith("path:")}
    for path, p in unmarked.items():
        for k in at(paths, path):
            if ids[k] not in local:
                out[k] = p
    return out


def tiles(chunks: Sequence[ChunkRecord], pieces: Sequence[tuple[int, int]]) -> bool:
    """Whether ``chunks`` cover exactly the byte ranges ``pieces`` of their item (once each)."""
    def runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for off, n in sorted(spans):
            if n and out and out[-1][1] == off:
                out[-1] = (out[-1][0], off + n)
            elif n:
                out.append((off, off + n))
        return out

    spans = [(c.storage_offset, c.length) for c in chunks]
    return runs(spans) == runs(list(pieces)) and sum(n for _, n in spans) == sum(n for _, n in pieces)


def _tree(n: int, p: int) -> list[tuple[int, int, int]]:
    """(round, from, to) tree positions of the transfers position ``p`` takes part in to spread
    a piece from position 0 to all ``n``: a binomial tree, in round k the positions below 2**k
    send to those 2**k further on, so each sends at most log2(n) times."""
    out = []
    k = 0
    while (1 << k) < n:
        step = 1 << k
        if p < step and p + step < n:
            out.append((k, p, p + step))
        elif step <= p < 2 * step:
            out.append((k, p - step, p))
        k += 1
    return out


def relay(item: ItemRecord, writer: int, rank: int, world: int) -> list[tuple[int, int, int]]:
    """(round, src, dst) of the transfers ``rank`` takes part in to spread a piece of ``item``
    from its ``writer`` to every other holder: a binomial tree (``_tree``) over the holders in
    rank order starting at the writer, so every rank computes its part of the same schedule in
    O(log holders), with no message."""
    n = item.holder_count(world)
    holders = item.holder_ranks(world)
    origin = writer if item.holders is None else item.holders.index(writer)
    index = rank if item.holders is None else item.holders.index(rank)

    def at(q: int) -> int:
        return holders[(origin + q) % n]

    return [(k, at(a), at(b)) for k, a, b in _tree(n, (index - origin) % n)]


def relay_between_hosts(writer: int, rank: int, world: int, block: int) -> list[tuple[int, int, int]]:
    """``relay`` of a piece every rank holds when the ranks of each host (``block`` consecutive
    ranks) share what they read (hostshare.py): the piece crosses to each other host once, to
    the rank with the writer's local index there, down a binomial tree over the hosts."""
    local = writer % block
    if rank % block != local:
        return []
    n, origin = world // block, writer // block

    def at(q: int) -> int:
        return ((origin + q) % n) * block + local

    return [(k, at(a), at(b)) for k, a, b in _tree(n, (rank // block - origin) % n)]
