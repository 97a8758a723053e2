"""planner/replicas.py: where replicas go and which hosts share a parity block (issue 39).
Pure: no processes, no disks but one small rules file."""

from __future__ import annotations

import random
from collections import Counter
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdswriter.errors import InvalidOptionError
from gdswriter.planner.replicas import (ENV_DOMAINS, ReplicaPart, chunk_bytes, chunk_in, failure_domains,
                                        parity_groups, parse_failure_domains, place_replicas, ring_of,
                                        rotation_peers, stripe_of)


@st.composite
def layouts(draw, max_hosts: int = 12):
    """Each rank's host and outer domains (switch/rack, or rack, or none): hosts of 1 to 6 ranks,
    the ranks of a host consecutive or shuffled, racks and switches of uneven sizes."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=max_hosts))
    depth = draw(st.integers(0, 2))
    racks = [draw(st.integers(0, 3)) for _ in sizes]
    switch_of_rack = [draw(st.integers(0, 1)) for _ in range(4)]
    hosts, domains = [], []
    for h, n in enumerate(sizes):
        path = (f"sw{switch_of_rack[racks[h]]}", f"rack{racks[h]}")[2 - depth:]
        hosts += [f"node{h:02d}"] * n
        domains += [path] * n
    order = list(range(len(hosts)))
    if draw(st.booleans()):
        random.Random(draw(st.integers(0, 2**16))).shuffle(order)
    return [hosts[i] for i in order], [domains[i] for i in order]


def domain_keys(domains, level):
    """Each rank's domain at outer ``level`` (0 = outermost), as the plan identifies it."""
    return [d[:level + 1] for d in domains]


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(1, 4))
def test_copies_on_distinct_hosts_balanced_and_inverse(layout, copies):
    hosts, domains = layout
    w, n_hosts = len(hosts), len(set(hosts))
    if copies > n_hosts:
        with pytest.raises(InvalidOptionError, match="distinct hosts"):
            place_replicas(hosts, copies, domains)
        return
    plan = place_replicas(hosts, copies, domains)
    assert plan == place_replicas(list(hosts), copies, [tuple(d) for d in domains])  # deterministic
    received = Counter()
    for r in range(w):
        holders = plan.who_holds(r)
        assert len(holders) == copies - 1
        assert len({hosts[r], *(hosts[h] for h in holders)}) == copies  # every copy on its own host
        for h in holders:
            assert r in plan.replicas_of(h)
            received[h] += 1
        for s in plan.replicas_of(r):
            assert r in plan.who_holds(s)
        part = plan.part(r)
        assert ReplicaPart.from_message(r, part.to_message()) == part
    assert sum(received.values()) == w * (copies - 1)
    most = max(Counter(hosts).values())
    if copies * most <= w:  # a rotation: each rank receives exactly copies - 1, whatever W and the hosts
        assert plan.balanced and plan.shift == w // copies
        assert all(received[r] == copies - 1 for r in range(w))
        per_host = Counter()
        for r in range(w):
            per_host[hosts[r]] += received[r]
        assert per_host == Counter({h: (copies - 1) * n for h, n in Counter(hosts).items()}) or copies == 1
    assert plan.balanced == all(received[r] == copies - 1 for r in range(w))


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(2, 4))
def test_copies_in_distinct_domains_where_possible(layout, copies):
    hosts, domains = layout
    if copies > len(set(hosts)):
        return
    plan = place_replicas(hosts, copies, domains)
    depth = len(domains[0])
    w = len(hosts)
    for level in range(depth):
        keys = domain_keys(domains, level)
        biggest = max(Counter(keys).values())
        separated = level >= depth - plan.domain_levels
        assert separated == (copies * biggest <= w)  # separated exactly where the rotation can
        if separated:
            for r in range(w):
                assert len({keys[r], *(keys[h] for h in plan.who_holds(r))}) == copies
    if plan.domain_levels < depth:
        with pytest.raises(InvalidOptionError, match="require_domains"):
            place_replicas(hosts, copies, domains, require_domains=True)
    else:
        assert place_replicas(hosts, copies, domains, require_domains=True) == plan


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 300), st.integers(1, 8), st.integers(2, 4))
def test_consecutive_ranks_need_no_message(w, per_host, copies):
    """torchrun's numbering (a host's ranks consecutive): every rank computes its part from W
    alone, in O(copies), and it is the plan's."""
    hosts = [f"n{r // per_host}" for r in range(w)]
    if copies * per_host > w:
        return
    plan = place_replicas(hosts, copies)
    assert plan.compact
    for r in range(w):
        assert rotation_peers(r, w, copies) == plan.part(r)


def test_uneven_hosts_any_world_size():
    """No divisibility rule: 3 hosts of 8, 8 and 5 ranks, 2 copies: every rank sends one copy and
    receives one, all on other hosts."""
    hosts = ["a"] * 8 + ["b"] * 8 + ["c"] * 5
    plan = place_replicas(hosts, 2)
    assert plan.balanced and plan.compact and plan.shift == 10
    assert sorted(h for r in range(21) for h in plan.who_holds(r)) == list(range(21))
    assert plan.drive_factor() == 2.0


def test_one_big_host_is_placed_greedily_on_distinct_hosts():
    """A host with more than W / copies ranks: no rotation keeps the copies apart; the greedy
    plan still does, as evenly as the layout allows (b's 4 ranks take 2 copies each)."""
    hosts = ["a"] * 8 + ["b"] * 4
    plan = place_replicas(hosts, 2)
    assert plan.shift == 0 and not plan.balanced and not plan.compact
    assert all(hosts[plan.who_holds(r)[0]] != hosts[r] for r in range(12))
    got = Counter(h for r in range(12) for h in plan.who_holds(r))
    assert [got[r] for r in range(8, 12)] == [2, 2, 2, 2]
    assert sorted(got[r] for r in range(8)) == [0] * 4 + [1] * 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=2, max_size=6), st.randoms(use_true_random=False))
def test_two_copies_with_a_big_host_are_as_even_as_the_hosts_allow(sizes, rnd):
    """Two copies where one host has more than half the ranks: its m copies must land on the
    W - m ranks of the other hosts, so some rank takes ceil(m / (W - m)); the plan takes no more."""
    hosts = [f"h{i}" for i, n in enumerate(sizes) for _ in range(n)]
    rnd.shuffle(hosts)
    w, m = len(hosts), max(sizes)
    plan = place_replicas(hosts, 2)
    received = Counter(h for r in range(w) for h in plan.who_holds(r))
    assert max(received.values()) == max(1, -(-m // (w - m)))


def test_ring_orders_domains_by_first_rank():
    hosts = ["x", "y", "x", "z", "y"]
    ring = ring_of(hosts, [("r1",), ("r0",), ("r1",), ("r0",), ("r0",)])
    assert ring.order == (0, 2, 1, 4, 3) and ring.hosts == ("x", "y", "z")
    assert ring.most_ranks == (3, 2) and ring.most_hosts == (2, 1)


@pytest.mark.parametrize("hosts, copies, domains, message", [
    (["a", "a", "b"], 3, None, "needs 3 distinct hosts, and this job runs on 2"),
    (["a", "b"], 0, None, "copies=0"),
    (["a", ""], 2, None, "rank 1's host"),
    (["a", "b"], 2, [("r0",), ("sw0", "r1")], "rank 0 names 1 failure domain level"),
    (["a", "a", "b"], 2, [("r0",), ("r1",), ("r1",)], "host 'a' is given two failure domains"),
    (["a", "b"], 2, [("r0",)], "1 failure domains for 2 ranks"),
    (["a", "b"], 2, [("r0",), ("",)], "not a list of names"),
])
def test_refusals_say_how_to_fix(hosts, copies, domains, message):
    with pytest.raises(InvalidOptionError, match=message):
        place_replicas(hosts, copies, domains)


def test_required_domains_refused_when_impossible():
    hosts = ["a", "b", "c", "d"]
    with pytest.raises(InvalidOptionError, match=r"holds 3 ranks of the 4, more than 4 // 2 = 2"):
        place_replicas(hosts, 2, [("r0",), ("r0",), ("r0",), ("r1",)], require_domains=True)
    plan = place_replicas(hosts, 2, [("r0",), ("r0",), ("r1",), ("r1",)], require_domains=True)
    assert plan.domain_levels == 1


# ---------------------------------------------------------------------------------------------
# parity


@settings(max_examples=300, deadline=None)
@given(layouts(max_hosts=20), st.integers(2, 6))
def test_parity_groups(layout, size):
    hosts, domains = layout
    n = len(set(hosts))
    if n < 2:
        with pytest.raises(InvalidOptionError, match="at least 2 hosts"):
            parity_groups(hosts, size, domains)
        return
    plan = parity_groups(hosts, size, domains)
    members = [h for g in plan.groups for h in g.hosts]
    assert sorted(members) == sorted(set(hosts))  # every host in exactly one group
    sizes = [g.size for g in plan.groups]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= min(size, n)  # never a small last group
    assert len(plan.groups) == max(1, n // size)
    for r, h in enumerate(hosts):
        gi, mi = plan.group_of(r)
        assert plan.groups[gi].hosts[mi] == h and r in plan.groups[gi].ranks[mi]
    depth = len(domains[0])
    dom = {h: d for h, d in zip(hosts, domains)}
    for level in range(depth):
        per = Counter(d[:level + 1] for d in dom.values())
        separated = level >= depth - plan.domain_levels
        assert separated == (max(per.values()) <= len(plan.groups))
        if separated:
            for g in plan.groups:
                assert len({dom[h][:level + 1] for h in g.hosts}) == g.size
    if plan.domain_levels < depth:
        with pytest.raises(InvalidOptionError, match="require_domains"):
            parity_groups(hosts, size, domains, require_domains=True)


@pytest.mark.parametrize("n", [2, 3, 5, 9])
def test_raid5_rotation(n):
    for i in range(n):
        stripes = [stripe_of(i, c, n) for c in range(n - 1)]
        assert sorted(stripes + [i]) == list(range(n))  # one chunk in every stripe but its own
        for c, s in enumerate(stripes):
            assert chunk_in(i, s, n) == c
        assert chunk_in(i, i, n) is None


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_parity_rebuilds_any_one_lost_member(n):
    """XOR of each stripe, stored on its member: any one member's bytes come back from the rest."""
    rng = random.Random(n)
    data = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(n)]
    clen = [chunk_bytes(len(d), n) for d in data]

    def chunk(i, c):
        return data[i][c * clen[i]:(c + 1) * clen[i]]

    def xor(blocks):
        width = max(len(b) for b in blocks)
        return reduce(lambda a, b: bytes(x ^ y for x, y in zip(a, b.ljust(width, b"\0"))), blocks, bytes(width))

    parity = [xor([chunk(i, chunk_in(i, s, n)) for i in range(n) if i != s]) for s in range(n)]
    for lost in range(n):
        rebuilt = b""
        for c in range(n - 1):
            s = stripe_of(lost, c, n)
            others = [chunk(i, chunk_in(i, s, n)) for i in range(n) if i not in (s, lost)]
            rebuilt += xor([parity[s], *others])[:len(chunk(lost, c))]
        assert rebuilt == data[lost]


def test_parity_bytes_on_drives():
    """(G + 1) / G for G data chunks per parity block (groups of G + 1 hosts), parity spread
    evenly; 10 hosts in groups of 4: two groups of 5, never a group of 2."""
    plan = parity_groups([f"n{r // 8}" for r in range(64)], 4)
    assert [g.size for g in plan.groups] == [4, 4] and plan.drive_factor() == pytest.approx(4 / 3)
    assert plan.parity_bytes([3 << 30] * 8) == [1 << 30] * 8
    plan = parity_groups([f"n{r}" for r in range(10)], 4)
    assert [g.size for g in plan.groups] == [5, 5] and plan.drive_factor() == pytest.approx(5 / 4)
    assert parity_groups(["a", "b", "c"], 8).groups[0].hosts == ("a", "b", "c")


@pytest.mark.parametrize("hosts, size, message", [
    (["a", "a"], 4, "at least 2 hosts, and this job runs on 1"),
    (["a", "b"], 1, "group_size=1"),
])
def test_parity_refusals(hosts, size, message):
    with pytest.raises(InvalidOptionError, match=message):
        parity_groups(hosts, size)


# ---------------------------------------------------------------------------------------------
# where the domains come from


def test_domains_from_the_environment(tmp_path):
    env = {ENV_DOMAINS: "node0[0-3]=sw0/rack0; node0[4-7] = sw0/rack1 # comment\n*=sw1/rack9"}
    assert failure_domains(0, "node02", environ=env) == ("sw0", "rack0")
    assert failure_domains(5, "node05", environ=env) == ("sw0", "rack1")
    assert failure_domains(9, "other", environ=env) == ("sw1", "rack9")
    assert failure_domains(0, "node02", environ={}) == ()
    rules = tmp_path / "domains.txt"
    rules.write_text("# racks\ngpu-a-*=rackA\ngpu-b-*=rackB\n")
    assert failure_domains(3, "gpu-b-7", environ={ENV_DOMAINS: f"@{rules}"}) == ("rackB",)
    with pytest.raises(InvalidOptionError, match="matches no entry"):
        failure_domains(3, "gpu-c-1", environ={ENV_DOMAINS: f"@{rules}"})
    with pytest.raises(InvalidOptionError, match="cannot read that file"):
        failure_domains(3, "gpu-c-1", environ={ENV_DOMAINS: f"@{tmp_path / 'missing'}"})


def test_domains_from_a_callable_or_mapping():
    assert failure_domains(3, "h", lambda rank, host: f"sw{rank % 2}/rack{rank}") == ("sw1", "rack3")
    assert failure_domains(3, "h", lambda rank, host: ["sw0", "r1"]) == ("sw0", "r1")
    assert failure_domains(3, "h", {"h": "rack2"}) == ("rack2",)
    with pytest.raises(InvalidOptionError, match="no entry for host 'g'"):
        failure_domains(3, "g", {"h": "rack2"})
    with pytest.raises(InvalidOptionError, match="not a list of names"):
        failure_domains(3, "h", lambda rank, host: "sw0//r1")


@pytest.mark.parametrize("text, message", [
    ("rack0", "is not HOST_PATTERN=DOMAIN"),
    ("=rack0", "is not HOST_PATTERN=DOMAIN"),
    ("n*=", "not a list of names"),
    ("  ;  # nothing", "names no domain"),
])
def test_domain_rules_refused(text, message):
    with pytest.raises(InvalidOptionError, match=message):
        parse_failure_domains(text)


def test_the_planner_loads_no_torch():
    """Placement is pure: a launcher or a CLI can plan without torch."""
    import subprocess
    import sys

    code = "import sys, gdswriter.planner.replicas; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
