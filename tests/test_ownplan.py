"""distributed/ownplan.py: the pure plan of a load from each rank's own manifest shard, checked
without ranks (as planner/ is): who reads which piece, the cross-memory arena's layout, the
items a host's tmpfs holds, and the relay rounds (each holder receives each piece once)."""

from __future__ import annotations

import pytest

from gdswriter.distributed.ownplan import (ARENA_ALIGN, NO_ARENA, Move, OwnLoadPlan, arena_layout, plan_own,
                                           pull_moves, relay_rounds, sharable)
from gdswriter.distributed.rankfiles import item_pieces
from gdswriter.errors import CorruptCheckpointError
from gdswriter.format.manifest import ChunkRecord, FileRecord
from gdswriter.format.sharded import ItemRecord, RankShard

MIB = 1 << 20


def _items() -> tuple[ItemRecord, ...]:
    """Two items every rank holds, a replica group's (ranks 0 and 1), and rank 0's own."""
    return (ItemRecord("b-every", 3 * MIB + 100, None), ItemRecord("a-every", 5 * MIB, None),
            ItemRecord("c-group", 2 * MIB + 5, (0, 1)), ItemRecord("d-own", 4 * MIB, (0,)))


def _shard(rank: int, world: int, items: tuple[ItemRecord, ...] = (), *, drop: int | None = None) -> RankShard:
    """Rank ``rank``'s shard of the items it holds, recording exactly the pieces it wrote
    (item_pieces), less the pieces of item ``drop``."""
    items = tuple(it for it in (items or _items()) if it.holders is None or rank in it.holders)
    pieces = item_pieces(items, world)
    chunks = tuple(tuple(ChunkRecord(0, off, off, n, 0) for w, off, n in pieces[sid] if w == rank and sid != drop)
                   for sid in range(len(items)))
    return RankShard(1, rank, world, (FileRecord(0, "data.bin", 64 * MIB),), items, chunks, (), None)


def test_the_pieces_tile_each_item_and_a_shard_missing_one_is_refused():
    world = 4
    for rank in range(world):
        plan = plan_own(_shard(rank, world), rank, world, pull_block=None, share_block=None, what="t")
        assert plan.arena == NO_ARENA and plan.sharable == ()
        for sid, it in enumerate(_shard(rank, world).items):
            covered = sorted((off, n) for _, off, n in plan.pieces[sid])
            assert sum(n for _, n in covered) == it.nbytes
            assert all(a[0] + a[1] == b[0] for a, b in zip(covered, covered[1:]))
    with pytest.raises(CorruptCheckpointError, match="does not record exactly the pieces"):
        plan_own(_shard(0, world, drop=0), 0, world, pull_block=None, share_block=None, what="t")


def test_the_arena_lays_out_each_holder_set_alike_on_page_boundaries():
    world = 4
    arenas = [arena_layout(_shard(r, world), r, 2) for r in range(world)]
    a0, a1, a2 = arenas[0], arenas[1], arenas[2]
    assert list(a0.sets) == sorted(a0.sets)  # holder sets in name order
    # ranks 0 and 1 (one host of 2): the state every rank holds and their replica group's
    assert len(a0.sets) == 2 and a0.sets == a1.sets and a0.offsets == a1.offsets and a0.regions == a1.regions
    assert a0.items == frozenset({0, 1, 2})  # not rank 0's own item
    assert len(a2.sets) == 1 and a2.items == frozenset({0, 1})  # rank 2 is not in the group
    for a, shard in ((a0, _shard(0, world)), (a2, _shard(2, world))):
        assert all(off % ARENA_ALIGN == 0 for off in a.offsets.values())
        spans = sorted((a.offsets[sid], shard.items[sid].nbytes) for sid in a.offsets)
        assert all(o + n <= p for (o, n), (p, _) in zip(spans, spans[1:])) and spans[-1][0] + spans[-1][1] <= a.size
        for name, sids in a.sets.items():  # a set's items in key order, from its region on
            assert [shard.items[s].key for s in sids] == sorted(shard.items[s].key for s in sids)
            assert a.offsets[sids[0]] == a.regions[name]
    # a replica group split over two hosts is not in the arena: it goes rank to rank
    assert arena_layout(_shard(1, world), 1, 1).items == frozenset({0, 1})


def test_a_hosts_tmpfs_holds_the_shared_items_across_hosts_only_every_ranks():
    world = 4
    shard = _shard(0, world)
    assert sharable(shard, world, world) == (0, 1, 2)  # one host: every item several ranks hold
    assert sharable(shard, world, 2) == (0, 1)  # across hosts: those every rank holds


def _received(world: int, block: int, shared_of) -> dict[tuple[str, int, int], int]:
    """(item key, offset, receiving rank) -> how many times it receives that piece, over every
    rank's rounds (each transfer planned by both its ranks, counted on the receiver)."""
    got: dict[tuple[str, int, int], int] = {}
    seen: dict[tuple, set[int]] = {}
    for rank in range(world):
        shard = _shard(rank, world)
        pieces = item_pieces(shard.items, world)
        for k, moves in enumerate(relay_rounds(shard, pieces, rank, world, block, shared_of(rank, shard))):
            for m in moves:
                assert isinstance(m, Move) and rank in (m.src, m.dst)
                key = shard.items[m.sid].key
                seen.setdefault((k, m.src, m.dst, key, m.offset, m.length), set()).add(rank)
                if m.dst == rank:
                    got[(key, m.offset, rank)] = got.get((key, m.offset, rank), 0) + 1
    assert all(ranks == {k[1], k[2]} for k, ranks in seen.items())  # both ends plan each transfer
    return got


def test_over_the_process_group_each_holder_receives_each_piece_it_did_not_write_once():
    world = 4
    got = _received(world, world, lambda rank, shard: set())
    want = {}
    for rank in range(world):
        shard = _shard(rank, world)
        for sid, it in enumerate(shard.items):
            if it.holder_count(world) > 1:
                for w, off, n in item_pieces(shard.items, world)[sid]:
                    if n and w != rank:
                        want[(it.key, off, rank)] = 1
    assert got == want


def test_shared_within_a_host_the_state_every_rank_holds_crosses_hosts_once_and_nothing_else_travels():
    world, block = 4, 2

    def shared(rank: int, shard: RankShard) -> set[int]:
        return set(arena_layout(shard, rank, block).items)

    got = _received(world, block, shared)
    assert set(got.values()) == {1}
    every = {it.key for it in _items() if it.holders is None}
    assert {k[0] for k in got} == every  # the replica group's pieces stay on their host
    # one host: nothing travels
    assert _received(world, world, lambda rank, shard: set(range(len(shard.items)))) == {}


def test_pulls_copy_each_missing_piece_from_its_holder_at_the_same_place_in_its_buffer():
    world, block, rank = 2, 2, 1
    shard = _shard(rank, world)
    plan = plan_own(shard, rank, world, pull_block=block, share_block=None, what="t")
    assert isinstance(plan, OwnLoadPlan)
    peer_base = 1 << 40
    bases = [{name: peer_base + at for name, at in plan.arena.regions.items()}, {}]
    mine = {sid: (1 << 30) + at for sid, at in plan.arena.offsets.items()}
    moves = pull_moves(plan, block, bases, mine)
    assert list(moves) == [0]  # only from rank 0
    want = sum(n for sid in plan.arena.offsets for w, _, n in plan.pieces[sid] if w == 0)
    assert sum(n for *_, n in moves[0]) == want
    for src, dst, _ in moves[0]:
        assert src - peer_base == dst - (1 << 30)  # laid out alike: the same offset in both buffers


def test_pulls_between_live_tensors_copy_each_missing_piece_between_its_items_own_addresses():
    """load(atomic=False) through cross memory: a holder gives each item's own address (its live
    tensor), and this rank pulls into its own items' addresses; each piece lands at its offset
    in the item, from the same offset in the holder's item."""
    world, block, rank = 2, 2, 1
    shard = _shard(rank, world)
    plan = plan_own(shard, rank, world, pull_block=block, share_block=None, what="t")
    theirs = {sid: (1 << 40) + (sid << 32) for sid in plan.arena.offsets}  # scattered, unlike the arena
    mine = {sid: (1 << 30) + (sid << 28) for sid in plan.arena.offsets}
    bases = [{name: [theirs[sid] for sid in sids] for name, sids in plan.arena.sets.items()}, {}]
    moves = pull_moves(plan, block, bases, mine)
    want = sorted((theirs[sid] + off, mine[sid] + off, n) for sid in plan.arena.offsets
                  for w, off, n in plan.pieces[sid] if w == 0 and n)
    assert want and list(moves) == [0] and sorted(moves[0]) == want


def test_a_holder_set_of_many_live_tensors_goes_through_the_arena_so_its_address_stays_one_int():
    """load(atomic=False) through cross memory sends one address per item of a holder set held
    in live tensors, which rank 0 gathers from every rank: a set of more than
    LIVE_ITEMS_PER_SET items stays in the arena (one address for the set), a small one is
    pulled into its live tensors, so what each rank sends is bounded by its sets, not its state."""
    import torch

    from gdswriter.distributed import transport as tr

    world, block, rank = 2, 2, 0
    many = tuple(ItemRecord(f"every-{i:03d}", 4096, None) for i in range(tr.LIVE_ITEMS_PER_SET + 1))
    few = (ItemRecord("group-a", 4096, (0, 1)), ItemRecord("group-b", 4096, (0, 1)))
    shard = _shard(rank, world, many + few)
    plan = plan_own(shard, rank, world, pull_block=block, share_block=None, what="t")
    assert len(plan.arena.sets) == 2
    cma = tr.CrossMemoryTransport(world, block, plan, [(0, 0), (0, 0)])
    live = {sid: torch.zeros(it.nbytes, dtype=torch.uint8) for sid, it in enumerate(shard.items)}
    direct = cma.addressable(live)
    assert sorted(shard.items[sid].key for sid in direct) == ["group-a", "group-b"]
    cma.buffers(shard.items, direct)
    sizes = sorted(len(a) if isinstance(a, list) else 1 for a in cma.address().values())
    assert sizes == [1, 2]


# ----------------------------------------------------------------------------- a transport of the test's own
def _fake_transport_worker(rank: int, world: int, root: str) -> dict:
    """Save replicated state on 2 ranks, then carry out each rank's own-shard plan through a
    Transport of the test's own (the seam the peer-replica work sends shards through): it
    records what the executor asks of it, and routes each rank every rank's address."""
    from pathlib import Path

    import torch

    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions
    from gdswriter.distributed.group import Coordinator
    from gdswriter.distributed.load import carry_out_own
    from gdswriter.distributed.loadplan import reach_of
    from gdswriter.distributed.roots import discover_layout
    from gdswriter.distributed.transport import Transport
    from gdswriter.format.commit import step_dir_name
    from gdswriter.format.manifest import MANIFEST_NAME
    from gdswriter.format.sharded import parse_shard, parse_step, read_shard
    from gdswriter.load.reader import host_buffer
    from support.models import small_options

    class Recording(Transport):
        kind = "recording"

        def __init__(self, world: int):
            super().__init__(world)
            self.calls: list[str] = []
            self.bases = None

        def buffers(self, items, direct):
            self.calls.append("buffers")
            out = [host_buffer(it.nbytes) for it in items]
            return out, out

        def address(self):
            self.calls.append("address")
            return f"rank {rank}"

        def route(self, outs):
            return [list(outs)] * len(outs)

        def release(self):
            self.calls.append("release")

        def pull(self, plan, bases):
            self.calls.append("pull")
            self.bases = bases
            return None

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))  # ~4 MiB of fp32
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with GDSCheckpointer(model, root=root, options=small_options(),
                         dist_options=DistOptions(replicated=("model",), timeout_s=60)) as ck:
        ck.save(1)
        engine = ck.engines[0]
        step_dir = ck.protocol.step_dir(1)
        coord = Coordinator.create(timeout_s=60, label="test_ownplan")
        try:
            layout = discover_layout(coord, [Path(root)], create=False)
            g = parse_step((step_dir / MANIFEST_NAME).read_bytes(), str(step_dir / MANIFEST_NAME))
            reach = reach_of(g, layout)
            ref = g.shards[rank]
            d = reach[ref.root] / step_dir_name(g.step)
            shard = parse_shard(read_shard(d, g, ref, reach[0]), g, ref, str(d / ref.name))
            plan = plan_own(shard, rank, world, pull_block=None, share_block=None, what="t")
            transport = Recording(world)
            before = coord.stats.snapshot()
            state, checked = carry_out_own(coord, g, shard, reach, plan, transport, {}, engine, verify=True,
                                           what="t", src=0, check=lambda s: "checked")
            received = coord.stats.snapshot()[1] - before[1]
        finally:
            coord.close()
    got = state["model"]
    diff = [k for k, v in want.items() if not torch.equal(got[k], v)]
    nbytes = sum(v.numel() * v.element_size() for v in want.values())
    return {"calls": transport.calls, "bases": transport.bases, "diff": diff, "checked": checked,
            "received": received, "nbytes": nbytes}


def test_a_transport_of_its_own_carries_the_plan_out(tmp_path):
    """The executor asks the transport for its buffers, tells the ranks its address (routed by
    the transport's own rule), releases it after the exchange and lets it pull; the pieces a
    rank lacks came over the process group (about half the state each, on 2 ranks)."""
    from support.ranks import run_ranks

    res = run_ranks(2, _fake_transport_worker, str(tmp_path / "root"), out=tmp_path / "ranks")
    for x in res:
        assert x["diff"] == [] and x["checked"] == "checked", x
        assert x["calls"] == ["buffers", "address", "release", "pull"], x
        assert x["bases"] == ["rank 0", "rank 1"], x
        assert x["nbytes"] // 4 <= x["received"], x


# ----------------------------------------------------------------------------- the load's messages
def test_the_loads_messages_travel_as_the_plain_dicts_they_were_and_are_checked_on_decoding():
    import json

    from gdswriter.distributed.load_messages import (FallbackDecision, OwnVerdict, ShardReport, TransportOffer,
                                                     choose_transport)
    from gdswriter.errors import GDSWriterError

    report = ShardReport(True, (("all", 4, "ab12"),), "h", None, (12, 345))
    assert report.to_wire() == {"ok": True, "sets": [["all", 4, "ab12"]], "host": "h", "proc": None, "pid": [12, 345]}
    assert ShardReport.from_wire(json.loads(json.dumps(report.to_wire()))) == report
    verdict = OwnVerdict(True, "tok", 2, 2, 1, ((1, "holds other replicated state than rank 0"),), ((7, 8), (9, 10)))
    wire = verdict.to_wire()
    assert list(wire) == ["own", "share", "block", "cblock", "failed", "shown", "peers"]
    assert OwnVerdict.from_wire(json.loads(json.dumps(wire))) == verdict
    assert [TransportOffer(True, False).to_wire(), TransportOffer(False, True).to_wire()] == [[True, False],
                                                                                                [False, True]]
    assert choose_transport([[True, True], [True, False]]) == "cma"
    assert choose_transport([[True, True], [False, True]]) == "tmpfs"
    assert choose_transport([[True, False], [False, True]]) is None
    decision = FallbackDecision(False, True, 0, ())
    assert FallbackDecision.from_wire(decision.to_wire()) == decision
    for bad, cls in (({"ok": "yes", "sets": [], "host": None, "proc": None, "pid": None}, ShardReport),
                     ({"own": True}, OwnVerdict), ([1, 0], TransportOffer), ({"other": 0}, FallbackDecision)):
        with pytest.raises(GDSWriterError, match="malformed"):
            cls.from_wire(bad)
