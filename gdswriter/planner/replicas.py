"""Where the extra copies of each rank's data go, and which nodes share a parity block (issue 39).

Pure functions of each rank's host and failure domains (frozen plans, no I/O but the one file
GDSWRITER_FAILURE_DOMAINS may name, no torch), so every rank that is given the same inputs
computes the same plan, and the tests check it without processes.

**The order.** Ranks are laid in a ring of W slots, outer domain first: switches in the order of
their first rank, then racks, then hosts, then ranks. Where the ranks of each host (and of each
domain) are consecutive, as torchrun numbers them, the ring is the rank order itself.

**Full copies** (``place_replicas``). Copy j (1 .. copies - 1) of the rank in slot s goes to
slot s + j * (W // copies), mod W: a rotation, so every rank receives exactly copies - 1
copies, whatever W and however many ranks each host has (no divisibility rule; bytes per
node are its ranks' share). The copies of one rank lie at least W // copies slots apart, so
they are on distinct hosts whenever copies x (most ranks on one host) <= W, and on distinct
racks (switches) whenever copies x (most ranks in one rack) <= W, for every level at once.
Where a host holds more than W / copies ranks, no rotation keeps the copies apart: the plan
then places each copy greedily (largest hosts first, on the least-loaded rank of a host not
yet used), still on distinct hosts, and balanced as well as the layout allows (``balanced``
says which). Copies on distinct hosts are a guarantee (InvalidOptionError when copies
exceed the hosts); distinct outer domains are best effort, reported in ``domain_levels``,
unless ``require_domains`` asks for an error.

**What a rank needs.** The rank that builds the plan (rank 0, which gathers the hosts when it
opens the roots) sends each rank its ``part``: the copies - 1 ranks it sends to and the
copies - 1 it receives from, never anything that grows with W. Where the ring is the rank
order (``compact``) a rank needs no message at all: ``rotation_peers(rank, W, copies)``.

**Parity** (``parity_groups``). Hosts (in the same domain-first order) are dealt round robin
into g = H // group_size groups, so a group has group_size or group_size + 1 hosts (never
fewer: the last hosts join groups rather than form a small one) and its members are g
positions apart: in distinct racks whenever no rack has more than g hosts. Within a group of
n hosts, RAID-5 style: each member's bytes are cut into n - 1 chunks; chunk c of member i
goes to stripe (i + 1 + c) mod n, and member s stores the XOR of stripe s (it holds no chunk
of its own data there), so losing any one member loses nothing, parity is spread evenly, and
the drives hold n / (n - 1) times the bytes: (G + 1) / G for G data chunks per parity block.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from collections.abc import Callable, Mapping, Sequence

from ..errors import InvalidOptionError
from ..fs import read_regular_file

ENV_DOMAINS = "GDSWRITER_FAILURE_DOMAINS"

DomainSource = Callable[[int, str], str | Sequence[str]] | Mapping[str, str | Sequence[str]]


# ---------------------------------------------------------------------------------------------
# failure domains


def domain_path(value: str | Sequence[str], where: str) -> tuple[str, ...]:
    """A failure domain as a tuple, outermost first: "sw0/rack3" or ("sw0", "rack3")."""
    parts = value.split("/") if isinstance(value, str) else list(value)
    if not parts or any(not isinstance(p, str) or not p.strip() or "/" in p for p in parts):
        raise InvalidOptionError(f"{where}: failure domain {value!r} is not a list of names, outermost first "
                                 f"(for example 'switch0/rack3' or ('switch0', 'rack3')); give every name non-empty")
    return tuple(p.strip() for p in parts)


def parse_failure_domains(text: str, where: str = ENV_DOMAINS) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The rules of a GDSWRITER_FAILURE_DOMAINS text: entries ``HOST_PATTERN=DOMAIN[/DOMAIN...]``
    (outermost domain first; the pattern is shell-style, "node0[0-7]" or "gpu-a-*"), separated by
    ";" or new lines, "#" starting a comment. A host takes the first entry its name matches."""
    rules = []
    for n, raw in enumerate(text.replace(";", "\n").splitlines(), 1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        pattern, eq, value = entry.partition("=")
        if not eq or not pattern.strip():
            raise InvalidOptionError(f"{where}: entry {n} ({entry!r}) is not HOST_PATTERN=DOMAIN[/DOMAIN...]; write "
                                     f"for example 'node0[0-3]=switch0/rack0;node0[4-7]=switch0/rack1'")
        rules.append((pattern.strip(), domain_path(value, f"{where} entry {n} ({entry!r})")))
    if not rules:
        raise InvalidOptionError(f"{where} is set but names no domain: unset it (hosts alone are then the failure "
                                 f"domains) or write entries like 'node0[0-3]=rack0;node0[4-7]=rack1'")
    return tuple(rules)


def match_domain(host: str, rules: Sequence[tuple[str, tuple[str, ...]]], where: str = ENV_DOMAINS) -> tuple[str, ...]:
    """The domain of the first rule whose pattern ``host`` matches."""
    for pattern, domain in rules:
        if fnmatchcase(host, pattern):
            return domain
    raise InvalidOptionError(f"host {host!r} matches no entry of {where}: add one for it (for example "
                             f"'{host}=rack0'), or a last catch-all entry '*=DOMAIN'")


def failure_domains(rank: int, host: str, source: DomainSource | None = None,
                    environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """This rank's failure domains beyond its host, outermost first (switch, then rack): from
    ``source`` (a callable ``(rank, host) -> "switch0/rack3"`` or a sequence of names, or a
    mapping host -> the same), else from GDSWRITER_FAILURE_DOMAINS (rules as
    parse_failure_domains reads them, or ``@/path/to/file`` holding them), else () (the hosts
    are the only failure domains)."""
    if source is not None:
        if callable(source):
            return domain_path(source(rank, host), f"the failure domain callable for rank {rank} (host {host!r})")
        if host not in source:
            raise InvalidOptionError(f"the failure domain mapping has no entry for host {host!r} (rank {rank}): "
                                     f"give every host of the job its domain")
        return domain_path(source[host], f"the failure domain mapping's entry for host {host!r}")
    env = os.environ if environ is None else environ
    text = env.get(ENV_DOMAINS, "").strip()
    if not text:
        return ()
    where = ENV_DOMAINS
    if text.startswith("@"):
        where = f"{ENV_DOMAINS} file {text[1:]}"
        try:
            text = read_regular_file(text[1:], limit=4 << 20).decode()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidOptionError(f"{ENV_DOMAINS}={text!r}: cannot read that file ({e}); name a readable text "
                                     f"file of HOST_PATTERN=DOMAIN lines, or write the rules in the variable") from e
    return match_domain(host, parse_failure_domains(text, where), where)


# ---------------------------------------------------------------------------------------------
# the ring


@dataclass(frozen=True)
class Ring:
    """The ranks in ring order (module docstring) and, per level (outer domains, then hosts),
    the most ranks one domain of that level holds and the most hosts it holds."""

    order: tuple[int, ...]          # slot -> rank
    slot: tuple[int, ...]           # rank -> slot
    hosts: tuple[str, ...]          # host names in ring order
    host_ranks: tuple[tuple[int, ...], ...]  # each host's ranks (ring order)
    host_domains: tuple[tuple[str, ...], ...]  # each host's outer domains
    most_ranks: tuple[int, ...]     # per level, outermost first, the host level last
    most_hosts: tuple[int, ...]

    @property
    def levels(self) -> int:
        """How many outer domain levels were named (0: hosts only)."""
        return len(self.most_ranks) - 1


def _checked(hosts: Sequence[str], domains: Sequence[Sequence[str]] | None) -> list[tuple[str, ...]]:
    if not hosts:
        raise InvalidOptionError("placing replicas needs at least one rank's host")
    for r, h in enumerate(hosts):
        if not isinstance(h, str) or not h:
            raise InvalidOptionError(f"rank {r}'s host {h!r} is not a name: give each rank its host name")
    if domains is None:
        return [()] * len(hosts)
    if len(domains) != len(hosts):
        raise InvalidOptionError(f"{len(domains)} failure domains for {len(hosts)} ranks: give one per rank")
    paths = [domain_path(d, f"rank {r}") if d else () for r, d in enumerate(domains)]
    depth = {len(p) for p in paths}
    if len(depth) > 1:
        a = next(r for r, p in enumerate(paths) if len(p) == min(depth))
        b = next(r for r, p in enumerate(paths) if len(p) == max(depth))
        raise InvalidOptionError(f"rank {a} names {len(paths[a])} failure domain level(s) {paths[a]} and rank {b} "
                                 f"names {len(paths[b])} {paths[b]}: give every host the same levels (for example "
                                 f"switch/rack for all)")
    seen: dict[str, tuple[int, tuple[str, ...]]] = {}
    for r, (h, p) in enumerate(zip(hosts, paths)):
        first = seen.setdefault(h, (r, p))
        if first[1] != p:
            raise InvalidOptionError(f"host {h!r} is given two failure domains: {'/'.join(first[1])} (rank "
                                     f"{first[0]}) and {'/'.join(p)} (rank {r}): a host lies in one rack; fix the "
                                     f"rules or the callable that give them")
    return paths


def ring_of(hosts: Sequence[str], domains: Sequence[Sequence[str]] | None = None) -> Ring:
    """The ring of ``hosts`` (each rank's host name) and ``domains`` (each rank's outer domains,
    outermost first; None: hosts only). Every domain, and every host, is numbered by its first
    rank, and its ranks lie consecutively in the ring."""
    paths = _checked(hosts, domains)
    depth = len(paths[0])
    keys = [[p[:level + 1] for level in range(depth)] + [(h,)] for h, p in zip(hosts, paths)]
    first: list[dict[tuple, int]] = [{} for _ in range(depth + 1)]
    count: list[dict[tuple, int]] = [{} for _ in range(depth + 1)]
    for r, ks in enumerate(keys):
        for level, k in enumerate(ks):
            first[level].setdefault(k, r)
            count[level][k] = count[level].get(k, 0) + 1
    order = tuple(sorted(range(len(hosts)), key=lambda r: (*(first[lv][k] for lv, k in enumerate(keys[r])), r)))
    slot = [0] * len(order)
    for s, r in enumerate(order):
        slot[r] = s
    names: list[str] = []
    ranks: list[list[int]] = []
    for r in order:
        if not names or names[-1] != hosts[r]:
            names.append(hosts[r])
            ranks.append([])
        ranks[-1].append(r)
    host_paths = tuple(paths[rs[0]] for rs in ranks)
    per_level_hosts = [{} for _ in range(depth + 1)]  # type: list[dict[tuple, int]]
    for h, p in zip(names, host_paths):
        for level, k in enumerate([p[:lv + 1] for lv in range(depth)] + [(h,)]):
            per_level_hosts[level][k] = per_level_hosts[level].get(k, 0) + 1
    return Ring(order, tuple(slot), tuple(names), tuple(tuple(x) for x in ranks), host_paths,
                tuple(max(c.values()) for c in count), tuple(max(c.values()) for c in per_level_hosts))


# ---------------------------------------------------------------------------------------------
# full copies


@dataclass(frozen=True)
class ReplicaPart:
    """What one rank needs of a ReplicaPlan: the ranks holding its copies 2, 3, ... (in copy
    order) and the ranks whose copies it holds. Its size is 2 x (copies - 1) ranks."""

    rank: int
    sends_to: tuple[int, ...]
    receives_from: tuple[int, ...]

    def to_message(self) -> list[list[int]]:
        return [list(self.sends_to), list(self.receives_from)]

    @classmethod
    def from_message(cls, rank: int, msg: Sequence[Sequence[int]]) -> ReplicaPart:
        return cls(rank, tuple(int(r) for r in msg[0]), tuple(int(r) for r in msg[1]))


@dataclass(frozen=True)
class ReplicaPlan:
    """Where every rank's ``copies - 1`` extra copies go (module docstring). ``shift``: the
    rotation's step (0 where the copies were placed greedily, ``table`` then holds them);
    ``domain_levels``: how many of the named outer domain levels (innermost first) hold each
    rank's copies in distinct domains; ``balanced``: every rank receives exactly copies - 1."""

    ring: Ring
    copies: int
    shift: int
    domain_levels: int
    balanced: bool
    table: tuple[tuple[int, ...], ...] = ()  # greedy placements only: rank -> holders of copies 2..
    inverse: tuple[tuple[int, ...], ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ring.order)

    @property
    def compact(self) -> bool:
        """Whether every rank can compute its part alone (rotation_peers), the ring being the rank order."""
        return self.shift > 0 and self.ring.order == tuple(range(self.world_size))

    def who_holds(self, rank: int) -> tuple[int, ...]:
        """The ranks holding rank ``rank``'s copies 2 .. copies, in copy order (all on other hosts)."""
        if not self.shift:
            return self.table[rank]
        w, s = self.world_size, self.ring.slot[rank]
        return tuple(self.ring.order[(s + j * self.shift) % w] for j in range(1, self.copies))

    def replicas_of(self, rank: int) -> tuple[int, ...]:
        """The ranks whose copies rank ``rank`` holds: what it receives from its peers."""
        if not self.shift:
            return self.inverse[rank]
        w, s = self.world_size, self.ring.slot[rank]
        return tuple(self.ring.order[(s - j * self.shift) % w] for j in range(1, self.copies))

    def part(self, rank: int) -> ReplicaPart:
        """What the plan's builder sends rank ``rank`` (O(copies), whatever the world size)."""
        return ReplicaPart(rank, self.who_holds(rank), self.replicas_of(rank))

    def drive_factor(self) -> float:
        """Bytes on the drives per byte of state: every byte is written ``copies`` times."""
        return float(self.copies)


def rotation_peers(rank: int, world_size: int, copies: int) -> ReplicaPart:
    """Rank ``rank``'s part of a compact plan (ReplicaPlan.compact): O(copies), from W alone."""
    d = world_size // copies
    return ReplicaPart(rank, tuple((rank + j * d) % world_size for j in range(1, copies)),
                       tuple((rank - j * d) % world_size for j in range(1, copies)))


def place_replicas(hosts: Sequence[str], copies: int, domains: Sequence[Sequence[str]] | None = None, *,
                   require_domains: bool = False) -> ReplicaPlan:
    """Place ``copies - 1`` extra copies of each rank's data on peer ranks of other hosts (module
    docstring). ``hosts``: each rank's host name; ``domains``: each rank's outer failure domains,
    outermost first (failure_domains). InvalidOptionError when there are fewer hosts than copies,
    or, with ``require_domains``, when some named level cannot hold the copies apart."""
    if not isinstance(copies, int) or copies < 1:
        raise InvalidOptionError(f"copies={copies!r}: give the number of copies of every byte, 1 (no replicas) or more")
    ring = ring_of(hosts, domains)
    w, hosts_n = len(ring.order), len(ring.hosts)
    if copies > hosts_n:
        shown = ", ".join(ring.hosts[:4]) + (" ..." if hosts_n > 4 else "")
        raise InvalidOptionError(f"copies={copies} needs {copies} distinct hosts, and this job runs on {hosts_n} "
                                 f"({shown}): lower the copies to {hosts_n} or fewer, or run on more nodes")
    levels = sum(1 for m in ring.most_ranks[:-1] if copies * m <= w) if copies > 1 else ring.levels
    if require_domains and levels < ring.levels:
        raise InvalidOptionError(_unseparated(ring, levels, ring.most_ranks, f"ranks of the {w}",
                                                 f"{w} // {copies} = {w // copies} (the ranks over the copies)"))
    if copies == 1 or copies * ring.most_ranks[-1] <= w:
        return ReplicaPlan(ring, copies, w // copies if copies > 1 else w, levels, True)
    table = _greedy(ring, copies)
    inverse: list[list[int]] = [[] for _ in range(w)]
    for r, holders in enumerate(table):
        for h in holders:
            inverse[h].append(r)
    balanced = all(len(x) == copies - 1 for x in inverse)
    return ReplicaPlan(ring, copies, 0, levels, balanced, table, tuple(tuple(x) for x in inverse))


def _unseparated(ring: Ring, levels: int, most: Sequence[int], unit: str, limit: str,
                 what: str = "the copies") -> str:
    level = ring.levels - levels - 1  # the innermost level left unseparated, 0 = outermost
    return (f"the named failure domains cannot keep {what} apart: a domain of level {level + 1} of "
            f"{ring.levels} (outermost first) holds {most[level]} {unit}, more than {limit}; name smaller or more "
            f"even domains, or leave require_domains off ({what} are then kept apart at the levels that "
            f"allow it, on distinct hosts always)")


def _greedy(ring: Ring, copies: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's copies on the least-loaded ranks of distinct other hosts, the largest hosts'
    ranks placed first (their copies have the fewest places to go). Deterministic: ties go to
    the host, then the rank, first in the ring."""
    w = len(ring.order)
    host_of = [0] * w
    for h, rs in enumerate(ring.host_ranks):
        for r in rs:
            host_of[r] = h
    per_host = [[(0, ring.slot[r], r) for r in rs] for rs in ring.host_ranks]  # heaps of (load, slot, rank)
    hosts_heap = [(0, h) for h in range(len(per_host))]  # (least load on the host, host); stale entries skipped
    table: list[tuple[int, ...]] = [()] * w
    senders = sorted(range(w), key=lambda r: (-len(ring.host_ranks[host_of[r]]), ring.slot[r]))
    for r in senders:
        used, chosen, aside = {host_of[r]}, [], []
        while len(chosen) < copies - 1:
            load, h = heapq.heappop(hosts_heap)
            if load != per_host[h][0][0]:
                continue  # stale: the host's least load changed since
            if h in used:
                aside.append((load, h))
                continue
            got, s, peer = heapq.heappop(per_host[h])
            heapq.heappush(per_host[h], (got + 1, s, peer))
            heapq.heappush(hosts_heap, (per_host[h][0][0], h))
            used.add(h)
            chosen.append(peer)
        for x in aside:
            heapq.heappush(hosts_heap, x)
        table[r] = tuple(chosen)
    return tuple(table)


# ---------------------------------------------------------------------------------------------
# parity


@dataclass(frozen=True)
class ParityGroup:
    """Hosts whose data one rotating parity protects: member i (``hosts[i]``, ranks
    ``ranks[i]``) stores stripe i's parity."""

    hosts: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.hosts)

    def stripe_of(self, member: int, chunk: int) -> int:
        """The stripe (and the member storing its parity) that chunk ``chunk`` of ``member``'s data goes to."""
        return stripe_of(member, chunk, self.size)

    def chunk_in(self, member: int, stripe: int) -> int | None:
        """Which of ``member``'s chunks stripe ``stripe`` covers (None: the member stores that stripe)."""
        return chunk_in(member, stripe, self.size)


def stripe_of(member: int, chunk: int, n: int) -> int:
    """RAID-5 rotation in a group of ``n``: chunk c (0 .. n - 2) of member i goes to stripe
    (i + 1 + c) mod n, which member i never stores."""
    if not 0 <= chunk < n - 1 or not 0 <= member < n:
        raise InvalidOptionError(f"chunk {chunk} of member {member}: a group of {n} has members 0..{n - 1} "
                                 f"with chunks 0..{n - 2}")
    return (member + 1 + chunk) % n


def chunk_in(member: int, stripe: int, n: int) -> int | None:
    """The inverse of stripe_of: member ``member``'s chunk in ``stripe`` (None for its own stripe)."""
    c = (stripe - member - 1) % n
    return None if c == n - 1 else c


def chunk_bytes(nbytes: int, n: int, align: int = 1) -> int:
    """The length of each of the n - 1 chunks a member of ``nbytes`` bytes is cut into (the
    last may be shorter; the XOR pads it with zeros)."""
    per = -(-nbytes // (n - 1)) if n > 1 else nbytes
    return -(-per // align) * align


@dataclass(frozen=True)
class ParityPlan:
    """Hosts dealt into parity groups (module docstring). ``domain_levels``: how many named
    outer levels (innermost first) have each group's members in distinct domains."""

    ring: Ring
    group_size: int
    groups: tuple[ParityGroup, ...]
    domain_levels: int

    def group_of(self, rank: int) -> tuple[int, int]:
        """(group, member) of rank ``rank``'s host: O(1) from the host's place in the ring."""
        r = self.ring
        pos = _host_position(r, rank)
        g = len(self.groups)
        return pos % g, pos // g

    def parity_bytes(self, sizes: Sequence[int], align: int = 1) -> list[int]:
        """Parity bytes each host stores (ring order), given each host's data bytes (ring order):
        its stripe is as long as the longest chunk of the other members."""
        out = [0] * len(sizes)
        g = len(self.groups)
        for gi, grp in enumerate(self.groups):
            pos = [gi + i * g for i in range(grp.size)]
            chunks = [chunk_bytes(sizes[p], grp.size, align) for p in pos]
            for s, p in enumerate(pos):
                out[p] = max((c for i, c in enumerate(chunks) if i != s), default=0)
        return out

    def drive_factor(self, sizes: Sequence[int] | None = None, align: int = 1) -> float:
        """Bytes on the drives per byte of state (hosts of equal data when ``sizes`` is None):
        n / (n - 1) for groups of n, (G + 1) / G for G data chunks per parity block."""
        sizes = [len(rs) * 1_000_000_000 for rs in self.ring.host_ranks] if sizes is None else list(sizes)
        total = sum(sizes)
        return (total + sum(self.parity_bytes(sizes, align))) / total if total else 1.0


def _host_position(ring: Ring, rank: int) -> int:
    """The host of ``rank``'s place in ring order (binary search over the hosts' first slots)."""
    s = ring.slot[rank]
    lo, hi = 0, len(ring.host_ranks) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ring.slot[ring.host_ranks[mid][0]] <= s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def parity_groups(hosts: Sequence[str], group_size: int, domains: Sequence[Sequence[str]] | None = None, *,
                  require_domains: bool = False) -> ParityPlan:
    """Deal the hosts into groups of ``group_size`` or more hosts, protected each by a rotating
    parity (module docstring). With fewer hosts than ``group_size`` the one group holds them all.
    InvalidOptionError for fewer than 2 hosts or a group size under 2, and, with
    ``require_domains``, when some named level cannot keep each group's members apart."""
    if not isinstance(group_size, int) or group_size < 2:
        raise InvalidOptionError(f"group_size={group_size!r}: a parity group needs at least 2 hosts (the parity "
                                 f"of one host is a full copy: use copies=2)")
    ring = ring_of(hosts, domains)
    n = len(ring.hosts)
    if n < 2:
        raise InvalidOptionError(f"parity needs at least 2 hosts, and this job runs on {n} ({ring.hosts[0]}): run on "
                                 f"more nodes, or drain to shared storage instead")
    g = max(1, n // group_size)
    levels = sum(1 for m in ring.most_hosts[:-1] if m <= g)
    if require_domains and levels < ring.levels:
        raise InvalidOptionError(_unseparated(ring, levels, ring.most_hosts, f"hosts of the {n}",
                                                 f"the {g} group(s): one host per group",
                                                 "each parity group's hosts"))
    groups = tuple(ParityGroup(tuple(ring.hosts[p] for p in range(j, n, g)),
                               tuple(ring.host_ranks[p] for p in range(j, n, g))) for j in range(g))
    return ParityPlan(ring, group_size, groups, levels)
