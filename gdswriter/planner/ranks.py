"""Rank slice planning: which rank writes which bytes of state that several ranks hold.

FastPersist's parallel write: a storage held identically by several ranks (replicated DDP
state, a DTensor shard replicated over a mesh dimension) is written once, cut into byte
ranges spread over its holders, so that every rank writes about the same number of bytes.
A pure function of sizes and holder sets, tested without processes or disks.

Items held by one rank go to that rank. Items held by several ranks are grouped by holder
set; groups are placed most constrained first (fewest holders), and each group's items are
laid end to end in a stream that is cut into one share per holder. The shares fill the
holders up to a common level (water filling over what they already write), and cuts inside
an item fall on ``align``-byte offsets, so each rank's load is within two alignment units of
that level and every piece starts aligned (direct I/O can take it straight from memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

from ..errors import InvalidOptionError
from .assign import DEFAULT_ALIGN


@dataclass(frozen=True)
class RankItem:
    """A storage of ``nbytes`` bytes that the ranks in ``holders`` hold identical copies of."""

    nbytes: int
    holders: tuple[int, ...]


@dataclass(frozen=True)
class RankPiece:
    """Rank ``rank`` writes bytes [offset, offset + length) of item ``item``."""

    item: int
    rank: int
    offset: int
    length: int


@dataclass(frozen=True)
class RankPlan:
    pieces: tuple[RankPiece, ...]  # sorted by (item, offset); a zero-byte item has one empty piece
    loads: tuple[int, ...]          # bytes each rank writes

    def of_rank(self, rank: int) -> list[RankPiece]:
        return [p for p in self.pieces if p.rank == rank]


def _water_fill(loads: Sequence[int], holders: Sequence[int], total: int) -> dict[int, int]:
    """Shares of ``total`` bytes for ``holders`` that raise the least-loaded ones to a common level."""
    order = sorted(holders, key=lambda h: (loads[h], h))
    base = [loads[h] for h in order]
    m = 1  # how many of the least-loaded holders the level reaches
    while m < len(order) and m * base[m] - sum(base[:m]) <= total:
        m += 1
    below = sum(base[:m])
    level, extra = divmod(total + below, m)
    shares = {h: 0 for h in holders}
    for i, h in enumerate(order[:m]):
        shares[h] = level - base[i] + (1 if i < extra else 0)
    return shares


def plan_rank_slices(items: Sequence[RankItem], world_size: int, *, align: int = DEFAULT_ALIGN) -> RankPlan:
    """Assign every byte of every item to exactly one of its holders, balancing bytes per rank."""
    if world_size < 1:
        raise InvalidOptionError(f"world_size={world_size} must be >= 1")
    if align < 1 or align & (align - 1):
        raise InvalidOptionError(f"align={align} must be a power of two")
    for i, it in enumerate(items):
        if it.nbytes < 0 or not it.holders or any(not 0 <= h < world_size for h in it.holders):
            raise InvalidOptionError(f"item {i}: {it} needs nbytes >= 0 and holders among ranks 0..{world_size - 1}")
    loads = [0] * world_size
    pieces: list[RankPiece] = []
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, it in enumerate(items):
        holders = tuple(sorted(set(it.holders)))
        if len(holders) == 1:
            pieces.append(RankPiece(i, holders[0], 0, it.nbytes))
            loads[holders[0]] += it.nbytes
        else:
            groups.setdefault(holders, []).append(i)
    for holders in sorted(groups, key=lambda h: (len(h), h)):
        members = groups[holders]
        shares = _water_fill(loads, holders, sum(items[i].nbytes for i in members))
        # Stream positions where each holder's share ends, in rank order.
        ends, pos = [], 0
        for h in holders:
            pos += shares[h]
            ends.append(pos)
        k, start = 0, 0  # current holder index; stream position of the current item
        for i in members:
            n = items[i].nbytes
            if n == 0:
                pieces.append(RankPiece(i, holders[k], 0, 0))
                continue
            done = 0
            while done < n:
                while k < len(holders) - 1 and ends[k] <= start + done:
                    k += 1
                cut = n if k == len(holders) - 1 else min(n, ends[k] - start)
                if cut < n:
                    cut = cut // align * align  # cuts inside an item fall on aligned offsets
                if cut > done:
                    pieces.append(RankPiece(i, holders[k], done, cut - done))
                    loads[holders[k]] += cut - done
                    done = cut
                else:
                    k += 1  # the share ends within this alignment unit: the next holder takes it
            start += n
    pieces.sort(key=lambda p: (p.item, p.offset))
    return RankPlan(tuple(pieces), tuple(loads))


SPLIT_MIN_SHARE = 256 << 10
"""Items held by several ranks are cut into shares of at least this many bytes (fewer holders
write, when the items are small): smaller pieces cost more in per-request overhead than the
parallel write saves."""


def split_stream(sizes: Sequence[int], holders: int, seed: int, *, align: int = DEFAULT_ALIGN,
                 min_share: int = SPLIT_MIN_SHARE) -> list[list[tuple[int, int, int]]]:
    """Which of ``holders`` ranks (numbered 0..holders-1 in the holders' rank order) writes which
    bytes of items of ``sizes`` that all of them hold identically: per item, [(holder, offset,
    length)] in offset order, covering it once. A pure function of its arguments, so every
    holder computes the same split from what it holds, with no message. The items are laid end
    to end (in the order given) in a stream cut into equal shares of at least ``min_share``
    bytes, cuts inside an item on ``align`` boundaries (so each piece starts aligned), the shares
    given out from holder ``seed % holders`` on (seed: a hash of the holder set, so that sets
    with few shares do not all land on their first holder)."""
    if holders < 1 or any(n < 0 for n in sizes):
        raise InvalidOptionError(f"split_stream: needs sizes >= 0 and at least one holder (got {holders})")
    if align < 1 or align & (align - 1):
        raise InvalidOptionError(f"align={align} must be a power of two")
    total = sum(sizes)
    share = max(-(-total // holders), min_share, 1)
    share = -(-share // align) * align
    out: list[list[tuple[int, int, int]]] = []
    start = 0  # stream position of the current item
    for n in sizes:
        cuts = [0]
        for boundary in range((start // share + 1) * share, start + n, share):
            off = (boundary - start) // align * align  # a cut too near the item's start moves on
            if off > cuts[-1]:
                cuts.append(off)
        cuts.append(n)
        # each piece goes to the share that holds its last byte
        pieces = [((seed + (start + max(b, a + 1) - 1) // share) % holders, a, b - a) for a, b in zip(cuts, cuts[1:])]
        out.append(pieces)
        start += n
    return out
