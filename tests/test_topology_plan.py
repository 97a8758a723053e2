"""Properties of GPU-local placement (planner/affinity.py) and of the write model
(planner/simulate.py), on random machines (hypothesis) and on the replayed DGXs."""

from __future__ import annotations

import itertools
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from gdswriter.errors import InvalidOptionError
from gdswriter.planner.affinity import (BALANCE_TOLERANCE, HOST, Writer, assign_bytes, balance_bounds, place_roots,
                                        plan_affinity, plan_round_robin)
from gdswriter.planner.assign import DEFAULT_ALIGN
from gdswriter.planner.simulate import LinkModel, simulate
from gdswriter.planner.topology import Distance, Drive, Gpu, Mount, NumaNode, Topology

A = DEFAULT_ALIGN
GiB = 1 << 30
FIXTURES = Path(__file__).parent / "data" / "topologies"


def fixture(name: str) -> Topology:
    return Topology.load(FIXTURES / f"{name}.json")


def per_drive(t: Topology) -> tuple[Topology, list[str]]:
    drives = t.mount_of("/raid").drives
    return t.one_mount_per_drive(drives), [f"/mnt/{d}" for d in drives]


# -- random machines ------------------------------------------------------------------------

@st.composite
def machines(draw):
    """A machine of 1-2 sockets x 1-2 NUMA nodes, with 1-5 GPUs and 1-6 drives, each either
    below one of a few switches (named by root port) or on a root port of its own; roots are
    single drives, arrays over several, roots sharing drives, or a directory on no known drive."""
    sockets = draw(st.integers(1, 2))
    per = draw(st.integers(1, 2))
    numa = tuple(NumaNode(s * per + k, s) for s in range(sockets) for k in range(per))
    n_switches = draw(st.integers(0, 3))
    switches = [(f"{0x10 * (i + 1):02x}", draw(st.sampled_from(numa)).node) for i in range(n_switches)]
    used = itertools.count(1)

    def place():
        bus = next(used)
        if switches and draw(st.booleans()):
            port, node = draw(st.sampled_from(switches))
            path = (f"0000:{port}:01.0", f"0000:{int(port, 16) + 1:02x}:00.0", f"0000:{0x80 + bus:02x}:00.0")
        else:
            node = draw(st.sampled_from(numa)).node
            path = (f"0000:{0x40 + bus:02x}:01.0", f"0000:{0x80 + bus:02x}:00.0")
        known = draw(st.integers(0, 9)) > 0  # now and then a device with no NUMA node
        return (node if known else -1), path

    gpus = []
    for i in range(draw(st.integers(1, 5))):
        node, path = place()
        gpus.append(Gpu(i, path[-1], "", node, path))
    drives = []
    for i in range(draw(st.integers(1, 6))):
        node, path = place()
        drives.append(Drive(f"nvme{i}", "nvme", path[-1], node, path))
    names = [d.name for d in drives]
    mounts, roots = [], []
    for i, name in enumerate(names):
        mounts.append(Mount(f"/d{i}", "ext4", f"/dev/{name}n1", "", "disk", (name,), f"{name}n1"))
    if len(names) > 1:
        members = tuple(draw(st.lists(st.sampled_from(names), min_size=2, max_size=len(names), unique=True)))
        kind = draw(st.sampled_from(["raid0", "raid1", "dm"]))
        mounts.append(Mount("/array", "ext4", "/dev/md0", "", kind, members, f"md0 {kind}"))
    topo = Topology("random", "", tuple(gpus), tuple(drives), numa, tuple(mounts))
    choices = [m.mountpoint for m in mounts] + ["/nowhere"]
    n_roots = draw(st.integers(1, 5))
    roots = [f"{draw(st.sampled_from(choices))}/r{k}" for k in range(n_roots)]
    return topo, roots


@st.composite
def states(draw, topo: Topology):
    writers = [Writer(f"cuda:{g.index}", g.index) for g in topo.gpus] + [HOST]
    n = draw(st.integers(0, 12))
    sizes = draw(st.lists(st.one_of(st.integers(0, 3 * A), st.integers(0, 200 * A),
                                    st.sampled_from([0, 1, A - 1, A, A + 1])), min_size=n, max_size=n))
    owners = draw(st.lists(st.sampled_from(writers), min_size=n, max_size=n))
    return sizes, owners


def mean_distance(topo: Topology, gpu: int | None, drives: tuple[str, ...]) -> Fraction:
    """The test's own reading of 'how far is a root': mean distance to its drives."""
    if gpu is None:
        return Fraction(0)
    if not drives:
        return Fraction(int(Distance.UNKNOWN))
    return Fraction(sum(int(topo.distance(topo.gpu(gpu), topo.drive(d))) for d in drives), len(drives))


def check_affinity_plan(topo: Topology, roots, sizes, owners, plan, tolerance=BALANCE_TOLERANCE):
    targets = place_roots(topo, roots)
    # every byte of every storage exactly once, aligned, in order
    chunks = [c for f in plan.files for c in f.chunks]
    for sid, size in enumerate(sizes):
        mine = sorted((c for c in chunks if c.storage == sid), key=lambda c: c.storage_offset)
        assert mine, f"storage {sid} missing"
        pos = 0
        for c in mine:
            assert c.storage_offset == pos and c.storage_offset % A == 0
            pos += c.length
        assert pos == size
        assert size or [c.length for c in mine] == [0]
    # files: written front to back by the writer holding their storages, names unique per root
    names = set()
    for fid, f in enumerate(plan.files):
        end = 0
        for c in f.chunks:
            assert c.file == fid and c.file_offset % A == 0 and c.file_offset >= end
            end = c.file_offset + c.length
            assert c.length == 0 or owners[c.storage].label == f.writer, "a file holds only its writer's bytes"
        assert f.size == end
        assert (f.target.root, f.target.name) not in names
        names.add((f.target.root, f.target.name))
        assert f.gpu == next((w.gpu for w in owners if w.label == f.writer), f.gpu)
    # balance: every root within the tolerance of its share by drive count (to one unit)
    units = [0] * len(targets)
    for f in plan.files:
        units[f.target.root] += sum(-(-c.length // A) for c in f.chunks)
    total = sum(units)
    weight = sum(t.weight for t in targets)
    for t, u in zip(targets, units):
        exact = total * t.weight / weight
        assert abs(u - exact) <= tolerance * exact + 1, (t, u, exact)
    # no writer writes to a farther root while a nearer one has room (unless the farther one
    # sits at its balance floor); a root's 'room' is its ceiling under the tolerance
    shares = _exact_targets(total, [t.weight for t in targets])
    bounds = [balance_bounds(s, Fraction(tolerance)) for s in shares]
    for f in plan.files:
        if not sum(c.length for c in f.chunks):
            continue
        far = f.target.root
        d_far = mean_distance(topo, f.gpu, targets[far].drives)
        for near, t in enumerate(targets):
            if mean_distance(topo, f.gpu, t.drives) < d_far:
                assert units[near] >= bounds[near][1] or units[far] <= bounds[far][0], \
                    f"{f.writer} writes to root {far} though nearer root {near} has room"
    return units


def _exact_targets(total: int, weights) -> list[int]:
    cum, cuts, w_sum = Fraction(0), [0], sum(weights)
    for w in weights:
        cum += w
        cuts.append(total * cum // w_sum)
    return [cuts[i + 1] - cuts[i] for i in range(len(weights))]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_machines(data):
    topo, roots = data.draw(machines())
    sizes, owners = data.draw(states(topo))
    plan = plan_affinity(topo, sizes, owners, place_roots(topo, roots))
    check_affinity_plan(topo, roots, sizes, owners, plan)
    assert plan == plan_affinity(topo, list(sizes), list(owners), place_roots(topo, roots)), "deterministic"
    strict = plan_affinity(topo, sizes, owners, place_roots(topo, roots), tolerance=0)
    check_affinity_plan(topo, roots, sizes, owners, strict, tolerance=0)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_assign_bytes_is_optimal_on_small_problems(data):
    """Against brute force: no assignment within the bounds is nearer in total."""
    n_w, n_r = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    supply = data.draw(st.lists(st.integers(0, 4), min_size=n_w, max_size=n_w))
    cost = data.draw(st.lists(st.lists(st.integers(0, 4), min_size=n_r, max_size=n_r), min_size=n_w,
                              max_size=n_w))
    target = _exact_targets(sum(supply), [1] * n_r)
    tol = data.draw(st.sampled_from([Fraction(0), Fraction(1, 20), Fraction(1, 3)]))
    bounds = [balance_bounds(t, tol) for t in target]
    x = assign_bytes(supply, target, cost, tolerance=tol)
    assert [sum(row) for row in x] == supply
    assert all(lo <= sum(col) <= hi for col, (lo, hi) in zip(zip(*x), bounds))
    load = [sum(col) for col in zip(*x)]
    for w, r_far, r_near in itertools.product(range(n_w), range(n_r), range(n_r)):
        if x[w][r_far] and cost[w][r_near] < cost[w][r_far]:
            assert load[r_near] >= bounds[r_near][1] or load[r_far] <= bounds[r_far][0], "a nearer root had room"
    best = min(sum(m[w][r] * cost[w][r] for w in range(n_w) for r in range(n_r))
               for m in _assignments(supply, n_r) if all(lo <= sum(c) <= hi for c, (lo, hi) in zip(zip(*m), bounds)))
    assert sum(x[w][r] * cost[w][r] for w in range(n_w) for r in range(n_r)) == best


def _assignments(supply, n_r):
    def splits(total, parts):
        if parts == 1:
            yield (total,)
            return
        for first in range(total + 1):
            for rest in splits(total - first, parts - 1):
                yield (first, *rest)
    yield from itertools.product(*(list(splits(s, n_r)) for s in supply))


def test_assign_bytes_arguments():
    with pytest.raises(InvalidOptionError, match="supply 3 != target 2"):
        assign_bytes([3], [2], [[0]])
    with pytest.raises(InvalidOptionError, match="tolerance"):
        assign_bytes([1], [1], [[0]], tolerance=1)
    assert assign_bytes([], [], []) == []
    assert assign_bytes([0, 0], [0], [[1], [2]]) == [[0], [0]]
    # slack is spent only where it buys nearness: with nothing to gain, shares stay exact
    assert assign_bytes([100], [50, 50], [[0, 0]], tolerance=0.05) == [[50, 50]]
    assert assign_bytes([52, 48], [50, 50], [[0, 1], [1, 0]], tolerance=0.05) == [[52, 0], [0, 48]]


# -- the replayed machines --------------------------------------------------------------------

def test_dgx_a100_every_gpu_writes_behind_its_own_switch():
    t, roots = per_drive(fixture("dgx_a100"))
    owners = [Writer(f"cuda:{g}", g) for g in range(8)]
    plan = plan_affinity(t, [10 * GiB] * 8, owners, place_roots(t, roots))
    check_affinity_plan(t, roots, [10 * GiB] * 8, owners, plan)
    assert len(plan.files) == 8
    for f in plan.files:
        drive = t.drive(place_roots(t, roots)[f.target.root].drives[0])
        assert t.distance(t.gpu(f.gpu), drive) == Distance.SWITCH
    assert "bytes by distance: switch 80.00 GiB (100%)" in plan.notes


def test_dgx_h100_uneven_gpus_stay_on_their_socket():
    t, roots = per_drive(fixture("dgx_h100"))
    sizes = [int(GiB * (10 + 0.3 * g)) for g in range(8)]  # 10 to 12.1 GiB: not balanced by itself
    owners = [Writer(f"cuda:{g}", g) for g in range(8)]
    plan = plan_affinity(t, sizes, owners, place_roots(t, roots))
    units = check_affinity_plan(t, roots, sizes, owners, plan)
    mean = sum(units) / len(units)
    assert max(units) <= 1.05 * mean + 1 and min(units) >= 0.95 * mean - 1
    for f in plan.files:
        drive = t.drive(place_roots(t, roots)[f.target.root].drives[0])
        # socket 1's GPUs hold more than socket 0's: within 5% the excess stays home, beyond it crosses
        assert t.distance(t.gpu(f.gpu), drive) in (Distance.NUMA, Distance.REMOTE)
    far = sum(sum(c.length for c in f.chunks) for f in plan.files
              if t.distance(t.gpu(f.gpu), t.drive(place_roots(t, roots)[f.target.root].drives[0])) == Distance.REMOTE)
    socket1 = sum(sizes[4:])
    assert far == pytest.approx(socket1 - 4 * 1.05 * sum(sizes) / 8, abs=8 * A), "only what socket 1 cannot hold"


def test_two_socket_server_crosses_only_what_it_must():
    t = fixture("two_socket_4gpu")
    roots = ["/data0", "/data1", "/data2"]
    owners = [Writer(f"cuda:{g}", g) for g in range(4)]
    for tol in (BALANCE_TOLERANCE, 0):
        plan = plan_affinity(t, [12 * GiB] * 4, owners, place_roots(t, roots), tolerance=tol)
        check_affinity_plan(t, roots, [12 * GiB] * 4, owners, plan, tolerance=tol)
        far = sum(sum(c.length for c in f.chunks) for f in plan.files if f.target.root < 2 and f.gpu >= 2)
        # socket 1 holds 24 GiB and one of three drives: it keeps (1 + tol)/3 of 48 GiB
        assert far == pytest.approx(24 * GiB - (1 + tol) * 16 * GiB, abs=4 * A)


def test_one_array_behind_one_mount():
    t = fixture("dgx_a100")
    owners = [Writer(f"cuda:{g}", g) for g in range(8)] + [HOST]
    sizes = [GiB] * 8 + [5 * A]
    plan = plan_affinity(t, sizes, owners, place_roots(t, ["/raid/ckpt"]))
    check_affinity_plan(t, ["/raid/ckpt"], sizes, owners, plan)
    assert [f.writer for f in plan.files] == [f"cuda:{g}" for g in range(8)] + ["cpu"], "each writer its own file"
    assert any("cannot be chosen" in n for n in plan.notes) and any("one root" in n for n in plan.notes)
    # two roots on the same array share it: halves (within the tolerance, which buys the host
    # its single file), and the plan says locality is moot
    plan = plan_affinity(t, sizes, owners, place_roots(t, ["/raid/a", "/raid/b"]))
    units = check_affinity_plan(t, ["/raid/a", "/raid/b"], sizes, owners, plan)
    assert abs(units[0] - units[1]) <= 5 and len(plan.files) == 9
    assert any("equally near every GPU" in n for n in plan.notes)


def test_round_robin_is_locality_blind_and_balanced():
    t, roots = per_drive(fixture("dgx_a100"))
    owners = [Writer(f"cuda:{g}", g) for g in range(8)]
    rr = plan_round_robin([8 * GiB] * 8, owners, place_roots(t, roots))
    assert len(rr.files) == 64 and {sum(c.length for c in f.chunks) for f in rr.files} == {GiB}


# -- the write model ---------------------------------------------------------------------------

def test_simulated_dgx_a100_plan_never_leaves_its_switches():
    t, roots = per_drive(fixture("dgx_a100"))
    owners = [Writer(f"cuda:{g}", g) for g in range(8)]
    targets = place_roots(t, roots)
    sizes = [10 * GiB] * 8
    plan, rr = plan_affinity(t, sizes, owners, targets), plan_round_robin(sizes, owners, targets)
    links = LinkModel(ssd_write=3.5)
    local, blind = simulate(t, plan, targets, links), simulate(t, rr, targets, links)
    assert local.bytes_of("ssd") == blind.bytes_of("ssd") == {f"ssd {d}": 10 * GiB for d in targets_drives(targets)}
    assert local.total("up") == local.total("socket") == local.total("root") == 0
    # round robin: 6 of every GPU's 8 slices leave its switch, 4 of 8 cross sockets
    assert blind.total("up") == pytest.approx(8 * 10 * GiB * 6 / 8)
    assert blind.total("socket") == pytest.approx(8 * 10 * GiB * 4 / 8)
    assert local.seconds == pytest.approx(10 * GiB / 3.5e9) and local.bottleneck.startswith("ssd")
    # where the root complex is the narrow part, locality wins outright
    slow = LinkModel(ssd_write=3.5, root_complex=5)
    assert simulate(t, rr, targets, slow).seconds > 2 * simulate(t, plan, targets, slow).seconds


def targets_drives(targets):
    return [d for t in targets for d in t.drives]


def test_simulated_array_and_host_memory():
    t = fixture("dgx_h100")
    targets = place_roots(t, ["/raid/x"])
    owners = [Writer(f"cuda:{g}", g) for g in range(8)]
    plan, rr = plan_affinity(t, [GiB] * 8, owners, targets), plan_round_robin([GiB] * 8, owners, targets)
    assert simulate(t, plan, targets, LinkModel()) == simulate(t, rr, targets, LinkModel()), \
        "one array: nothing to choose"
    host = plan_affinity(t, [GiB], [HOST], targets)
    sim = simulate(t, host, targets, LinkModel())
    assert sim.total("gpu") == 0 and sim.total("ssd") == GiB
    mirror = place_roots(t, ["/home"])  # RAID-1: every byte on both drives
    assert simulate(t, plan_affinity(t, [GiB], [HOST], mirror), mirror, LinkModel()).total("ssd") == 2 * GiB


def test_benchmark_script_prints_the_comparison():
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "benchmarks/topology_sim.py", "--size-per-gpu", "1G"], check=False, cwd=repo,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for text in ("DGX A100", "DGX H100", "Round robin: 64 files", "switch 8.00 GiB (100%)", "RR / LOCAL"):
        assert text in r.stdout
