"""What GDSCheckpointer's multi-rank save (save.py) and the DCP plug-in (dcp.py) do alike per rank.

Both split the items several ranks hold over their holders (planner/ranks.py: the DCP plug-in
from every rank's report of (key, nbytes), ``group_held``; GDSCheckpointer from each rank's own
items, ``item_pieces``), lay each rank's pieces out in that rank's own data files, and record
those files for the manifest (format/assembly.py, format/sharded.py). The file names and the
entries are part of the on-disk format (docs/format.md sections 9 and 10), so they are written
in one place.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Sequence

from ..planner.assign import FileTarget, SavePlan
from ..format.sharded import ItemRecord
from ..planner.ranks import RankItem, RankPlan, plan_rank_slices, split_stream
from .roots import RootLayout


@dataclass(frozen=True)
class HeldItems:
    """The items of every rank's report, numbered in the order first reported."""

    index: dict[str, int]     # key -> item number
    sizes: list[int]          # bytes of each item, as its first holder reported them
    holders: list[list[int]]  # the ranks holding each item, in rank order

    def split(self, world_size: int) -> RankPlan:
        """Which rank writes which bytes of each item: every byte once, bytes balanced over the ranks."""
        return plan_rank_slices([RankItem(n, tuple(h)) for n, h in zip(self.sizes, self.holders)], world_size)


def group_held(held: Iterable[Iterable[Sequence[Any]]]) -> HeldItems:
    """Group the ``[key, nbytes]`` items each rank reports (rank order) into one global list, so
    that an item held by several ranks (same key) is one item with several holders."""
    index: dict[str, int] = {}
    sizes: list[int] = []
    holders: list[list[int]] = []
    for r, items in enumerate(held):
        for k, n in items:
            g = index.setdefault(k, len(sizes))
            if g == len(sizes):
                sizes.append(n)
                holders.append([])
            holders[g].append(r)
    return HeldItems(index, sizes, holders)


def rank_targets(layout: RootLayout, rank: int, files_per_root: int, *, tagged: Iterable[int] = (),
                 tag: str = "") -> list[FileTarget]:
    """This rank's data files: ``files_per_root`` on each of its roots, named by rank, global root
    and number, so that ranks sharing a root never write the same file. On the local roots in
    ``tagged`` the names also carry ``tag`` (the save's token): files written beside a committed
    step's own (dcp.py, a re-saved step on a secondary root another rank than 0 leads)."""
    tagged = set(tagged)
    return [FileTarget(i, f"data-rank{rank}-r{g}-f{k}{f'.{tag}' if i in tagged else ''}.bin")
            for i, g in enumerate(layout.local_to_global) for k in range(files_per_root)]


_RANK_FILE_RE = re.compile(r"^data-rank\d+-r\d+-f\d+(?:\.([0-9a-f]{8}))?\.bin$")


def save_tag(name: str) -> str | None:
    """The tag of a multi-rank data file name (rank_targets): the token of the save that wrote it
    beside a committed step's files, "" for an untagged name, None for any other name."""
    m = _RANK_FILE_RE.match(name)
    return None if m is None else (m.group(1) or "")


def file_entries(layout: RootLayout, fplan: SavePlan, written_by: dict[int, str], rank: int) -> list[list[Any]]:
    """The "files" entry of this rank's report to rank 0: each file of ``fplan`` as its global
    root, name, size and who wrote it (engine, rank, host), as the manifest records it."""
    host = socket.gethostname()
    return [[layout.local_to_global[f.target.root], f.target.name, f.size,
             {"engine": written_by[fid], "rank": rank, "host": host}] for fid, f in enumerate(fplan.files)]


def item_pieces(items: Sequence[ItemRecord], world_size: int) -> list[list[tuple[int, int, int]]]:
    """Per item, (rank, offset, length) of each piece as its holders write it: all of it by its
    one holder; items several ranks hold are grouped by holder set, and each set (in key order)
    is split over its holders by split_stream, seeded by the set. Every holder of a set holds
    the same items (the vote checks a digest of them), so save and load compute the same pieces
    on every holder, and no rank needs another's records to know who wrote which bytes."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in items]
    sets: dict[tuple[int, ...] | None, list[int]] = {}
    for i, it in enumerate(items):
        if it.holder_count(world_size) == 1:
            out[i] = [(it.first_holder, 0, it.nbytes)]
        else:
            sets.setdefault(it.holders, []).append(i)
    for key, members in sets.items():  # key None: every rank (never listed: the world may be large)
        members.sort(key=lambda i: items[i].key)
        seed = int(hashlib.sha256(repr(key).encode()).hexdigest()[:8], 16)
        split = split_stream([items[i].nbytes for i in members], items[members[0]].holder_count(world_size), seed)
        for i, pieces in zip(members, split):
            out[i] = [(h if key is None else key[h], off, n) for h, off, n in pieces]
    return out


def holder_set_digests(items: Sequence[ItemRecord], rank: int, world_size: int) -> tuple[tuple[str, int, str], ...]:
    """Per holder set of the items ``rank`` shares with other ranks: (its name, its size, a digest
    of its items' keys and sizes). The holders of a set must report the same digest, each holder
    of the set reporting it: that is what lets each of them compute item_pieces alone."""
    by_set: dict[tuple[int, ...] | None, list] = {}
    for it in items:
        if it.holders != (rank,):
            by_set.setdefault(it.holders, []).append([it.key, it.nbytes])
    return tuple(sorted((set_name(h), world_size if h is None else len(h),
                         hashlib.sha256(json.dumps(sorted(v)).encode()).hexdigest()[:32]) for h, v in by_set.items()))


def set_name(holders: tuple[int, ...] | None) -> str:
    """A holder set's name: "all" for the items every rank holds, else a digest of its ranks."""
    return "all" if holders is None else hashlib.sha256(json.dumps(holders).encode()).hexdigest()[:16]


def disagreeing_holders(reports: Sequence[Sequence[Sequence[Any]]]) -> dict[int, str]:
    """Given each rank's holder_set_digests (rank order), {rank: why} for ranks whose digest of a
    set differs from the set's first reporter's, and for sets that fewer ranks report than the
    set has holders (named by its first reporter)."""
    seen: dict[str, tuple[str, int, int]] = {}  # set -> (digest, size, first rank)
    members: dict[str, int] = {}
    bad: dict[int, str] = {}
    for r, sets in enumerate(reports):
        for name, size, digest in sets:
            members[name] = members.get(name, 0) + 1
            first = seen.setdefault(name, (digest, size, r))
            if first[0] != digest:
                bad[r] = f"holds other {'replicated state' if name == 'all' else 'replicas of DTensor blocks'} " \
                         f"than rank {first[2]}"
    for name, (_, size, r) in seen.items():
        if members[name] != size and r not in bad:
            bad[r] = f"holds {'replicated state' if name == 'all' else 'DTensor blocks'} that only {members[name]} " \
                     f"of its {size} holders report"
    return bad
