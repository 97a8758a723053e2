"""Loads on another layout read only the manifest shards they need (format 1.3's layout index,
docs/format.md 10): FSDP2 state saved on 4 ranks, loaded on 2 ranks and in one process, bit for
bit, each rank reading the shards that hold its blocks and receiving no other rank's records;
a step without an index still loads by merging; a hostile or contradicted index is refused."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies

from support.models import full_state as _full
from support.ranks import run_ranks

STEP = 10


# ----------------------------------------------------------------------------- helpers (run in ranks too)
def _model(world: int, seed: int):
    """support.models.fsdp_mlp after one Adam step (its moments exist)."""
    from support.models import fsdp_mlp

    model, opt, _ = fsdp_mlp(world, seed)
    torch.manual_seed(seed + 1)
    model(torch.randn(4, 96)).sum().backward()
    opt.step()
    return model, opt


def _count_shard_reads() -> list[list]:
    """Record [file name, bytes] of every manifest shard this process reads from now on."""
    import gdswriter.format.sharded as sharded

    reads: list[list] = []
    original = sharded.read_regular_file

    def counting(path, limit):
        raw = original(path, limit)
        if Path(path).name.startswith("manifest-rank"):
            reads.append([Path(path).name, len(raw)])
        return raw

    sharded.read_regular_file = counting
    return reads


def _node_root(root: str | list[str], rank: int, world: int) -> str:
    """``root`` itself, or of a list (one root per node, standing for node-local disks) this rank's node's."""
    return root if isinstance(root, str) else root[rank * len(root) // world]


def _save_worker(rank: int, world: int, root: str | list[str], out: str) -> dict:
    from support.models import small_options

    from gdswriter import GDSCheckpointer

    root = _node_root(root, rank, world)
    model, opt = _model(world, seed=0)
    with GDSCheckpointer(model, opt, root=root, options=small_options()) as ck:
        ck.save(STEP)
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, Path(out, "expected.pt"))
    return {}


def _load_worker(rank: int, world: int, root: str | list[str], out: str) -> dict:
    from support.models import small_options

    from gdswriter import GDSCheckpointer

    root = _node_root(root, rank, world)
    model, opt = _model(world, seed=7)  # other values
    with GDSCheckpointer(model, opt, root=root, options=small_options()) as ck:
        reads = _count_shard_reads()
        before = ck.session.coord.stats.snapshot()
        ck.load(STEP)
        after = ck.session.coord.stats.snapshot()
    expected = torch.load(Path(out, "expected.pt"))
    got = _full(model, opt)
    diff = sorted(k for k in expected.keys() | got.keys()
                  if k not in got or k not in expected or not torch.equal(got[k], expected[k]))
    return {"diff": diff, "reads": reads, "received": after[1] - before[1]}


def _strip_index(root: Path) -> None:
    """Rewrite the step's manifest.json as a 1.3 step saved before the layout index existed."""
    path = root / f"step_{STEP:012d}" / "manifest.json"
    body = json.loads(path.read_bytes())
    del body["manifest_crc32c"], body["layout_index"]
    _write_body(path, body)


def _write_body(path: Path, body: dict) -> None:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    path.write_text(json.dumps({**body, "manifest_crc32c": crc32c.crc32c(canonical)}) + "\n")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Step 10 of 4-rank FSDP2 state under one shared root (read-only to the tests: copy to change)."""
    base = tmp_path_factory.mktemp("reshard")
    run_ranks(4, _save_worker, str(base / "root"), str(base), out=base / "r4")
    return base


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(saved / "root", tmp_path / "root")
    shutil.copy(saved / "expected.pt", tmp_path / "expected.pt")
    return tmp_path / "root"


def _shard_sizes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / f"step_{STEP:012d}").glob("manifest-rank*.json")}


# ----------------------------------------------------------------------------- the tests
def test_the_global_manifest_describes_each_dtensor_once(saved):
    """The index has one entry per DTensor name (its mesh as two numbers), none per block or rank."""
    from gdswriter.format.sharded import parse_global

    raw = (saved / "root" / f"step_{STEP:012d}" / "manifest.json").read_bytes()
    g = parse_global(raw, "manifest.json")
    assert g is not None and g.layout_index is not None
    body = json.loads(raw)["layout_index"]
    assert body["meshes"] == [{"shape": [4], "first": 0, "step": 1}]
    names = sorted(e[0] for e in body["tensors"])
    assert names == sorted({f"{p}{k}" for p in ("model/", ) for k in ("0.weight", "0.bias", "2.weight", "2.bias")}
                           | {f"optimizer/state/{i}/{m}" for i in range(4) for m in ("exp_avg", "exp_avg_sq")})
    assert all(e[4] == [0] for e in body["tensors"])  # Shard(0) over the one mesh dimension


def test_4_to_2_ranks_read_only_the_shards_holding_their_blocks(saved, tmp_path):
    """Rank 0 of 2 needs rows [0, n/2) of every tensor: the blocks ranks 0 and 1 saved; rank 1
    needs ranks 2's and 3's blocks and its own saved tree (rank 1's shard). Neither receives any
    other rank's records: what arrives over the group is the global manifest and a few
    fixed-size decisions."""
    root = _copy(saved, tmp_path)
    res = run_ranks(2, _load_worker, str(root), str(tmp_path), out=tmp_path / "r2")
    assert [x["diff"] for x in res] == [[], []], res
    sizes = _shard_sizes(root)
    read = [sorted(n for n, _ in x["reads"]) for x in res]
    assert read == [["manifest-rank00000.json", "manifest-rank00001.json"],
                    ["manifest-rank00001.json", "manifest-rank00002.json", "manifest-rank00003.json"]], read
    assert all(n == sizes[name] for x in res for name, n in x["reads"])
    # the step's manifest.json (broadcast by the primary as a JSON string: its quotes escaped) and
    # a few fixed-size decisions; the merging path sent every rank all four shards' records
    manifest = (root / f"step_{STEP:012d}" / "manifest.json").stat().st_size
    assert all(x["received"] < 2 * manifest + 512 < sum(sizes.values()) for x in res), \
        ([x["received"] for x in res], manifest, sizes)


def test_a_step_without_the_index_still_loads_by_merging(saved, tmp_path):
    """A 1.3 step written before the layout index: the load merges every shard, as it did."""
    root = _copy(saved, tmp_path)
    _strip_index(root)
    res = run_ranks(2, _load_worker, str(root), str(tmp_path), out=tmp_path / "r2")
    assert [x["diff"] for x in res] == [[], []], res
    assert sorted(n for x in res for n, _ in x["reads"]) == sorted(_shard_sizes(root))
    assert all(x["received"] > sum(_shard_sizes(root).values()) // 2 for x in res)  # the merged manifest


def test_node_local_roots_where_a_rank_lacks_a_shard_it_needs_load_by_merging(tmp_path):
    """Saved on 2 nodes of 2 ranks (node-local roots), loaded on 2 ranks, one per node: rank 1
    takes saved rank 1's tree, whose shard is on node 0's disk, which it does not see. Every
    rank then takes the merging path (node 0's rank reads that shard and sends what rank 1
    needs), bit for bit."""
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_ranks(4, _save_worker, nodes, str(tmp_path), out=tmp_path / "r4")
    res = run_ranks(2, _load_worker, nodes, str(tmp_path), out=tmp_path / "r2")
    assert [x["diff"] for x in res] == [[], []], res
    read = [sorted(n for n, _ in x["reads"]) for x in res]
    # rank 0 read its plan's shards (0, 1) before the ranks chose to merge, then read them for the merge
    assert read == [["manifest-rank00000.json"] * 2 + ["manifest-rank00001.json"] * 2,
                    ["manifest-rank00002.json", "manifest-rank00003.json"]], read


def _one_process_load(root: Path, expected: dict) -> list:
    from support.models import small_options

    from gdswriter import GDSCheckpointer

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.ReLU(), torch.nn.Linear(256, 70))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    import gdswriter.format.sharded as sharded

    original = sharded.read_regular_file
    reads = _count_shard_reads()
    try:
        with GDSCheckpointer(model, opt, root=root, options=small_options()) as ck:
            assert ck.load() == STEP
    finally:
        sharded.read_regular_file = original
    got = _full(model, opt)
    assert sorted(k for k in expected if not torch.equal(got[k], expected[k])) == []
    return reads


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "without-index"])
def test_one_process_reads_every_shard_once(saved, tmp_path, indexed):
    """One process loading the 4-rank step whole reads each shard once: choosing its path reads
    the global manifest alone (it used to merge every shard there, then again to load)."""
    root = _copy(saved, tmp_path)
    if not indexed:
        _strip_index(root)
    reads = _one_process_load(root, torch.load(tmp_path / "expected.pt"))
    assert sorted(n for n, _ in reads) == sorted(_shard_sizes(root)), reads


# ----------------------------------------------------------------------------- hostile indexes
def _tamper(root: Path, change) -> None:
    path = root / f"step_{STEP:012d}" / "manifest.json"
    body = json.loads(path.read_bytes())
    del body["manifest_crc32c"]
    change(body["layout_index"])
    _write_body(path, body)


def _first(index: dict, name: str) -> list:
    return next(e for e in index["tensors"] if e[0] == name)


HOSTILE = {
    "mesh-larger-than-world": lambda ix: ix["meshes"][0].update(shape=[5]),
    "mesh-of-2**40-ranks": lambda ix: ix["meshes"][0].update(shape=[1 << 20, 1 << 20]),
    "mesh-runs-past-world": lambda ix: ix["meshes"][0].update(first=1),
    "mesh-step-zero": lambda ix: ix["meshes"][0].update(step=0),
    "mesh-ranks-repeat": lambda ix: ix["meshes"][0].update(ranks=[0, 0, 1, 2]),
    "mesh-rank-out-of-world": lambda ix: ix["meshes"][0].update(ranks=[0, 1, 2, 4]),
    "mesh-index-out-of-range": lambda ix: ix["tensors"][0].__setitem__(3, 1),
    "placement-dim-out-of-range": lambda ix: ix["tensors"][0].__setitem__(4, [7]),
    "placements-per-mesh-dim": lambda ix: ix["tensors"][0].__setitem__(4, [0, 0]),
    "placement-bool": lambda ix: ix["tensors"][0].__setitem__(4, [True]),
    "unknown-dtype": lambda ix: ix["tensors"][0].__setitem__(1, "float1024"),
    "negative-dimension": lambda ix: ix["tensors"][0].__setitem__(2, [-1, 96]),
    "name-twice": lambda ix: ix["tensors"].append(list(ix["tensors"][0])),
    "not-a-list": lambda ix: ix.update(tensors={"a": 1}),
}


@pytest.mark.parametrize("change", sorted(HOSTILE))
def test_a_hostile_layout_index_is_refused_when_the_manifest_is_read(saved, tmp_path, change):
    from gdswriter.errors import CorruptCheckpointError
    from gdswriter.format.sharded import parse_global

    root = _copy(saved, tmp_path)
    _tamper(root, HOSTILE[change])
    raw = (root / f"step_{STEP:012d}" / "manifest.json").read_bytes()
    with pytest.raises(CorruptCheckpointError, match="layout index is malformed|unknown dtype"):
        parse_global(raw, "manifest.json")


CONTRADICTED = {
    # the index claims another rank order: rank 3 would hold rows [0, 18) of every tensor
    "ranks-reversed": lambda ix: ix["meshes"][0].update(ranks=[3, 2, 1, 0], first=None, step=None),
    # another global shape than the shards record
    "global-shape": lambda ix: _first(ix, "model/2.weight").__setitem__(2, [72, 256]),
    # replicated, where every rank saved a block of its own
    "replicated": lambda ix: [e.__setitem__(4, ["R"]) for e in ix["tensors"]],
    # a DTensor of the shards the index does not list
    "missing-name": lambda ix: ix["tensors"].remove(_first(ix, "model/0.bias")),
}


@pytest.mark.parametrize("change", sorted(CONTRADICTED))
def test_a_shard_contradicting_the_index_is_refused(saved, tmp_path, change):
    """The index is what a load plans from; a shard that does not hold what it says is damage,
    found before any data buffer is allocated (the live state is unchanged)."""
    from gdswriter.errors import CorruptCheckpointError

    root = _copy(saved, tmp_path)

    def change_it(ix):
        CONTRADICTED[change](ix)
        for m in ix["meshes"]:
            for k in [k for k, v in m.items() if v is None]:
                del m[k]

    _tamper(root, change_it)
    with pytest.raises(CorruptCheckpointError, match="layout index|block"):
        _one_process_load(root, torch.load(tmp_path / "expected.pt"))


# ----------------------------------------------------------------------------- the block math
@pytest.mark.parametrize("mesh_shape,placements,gshape", [
    ((4,), [0], (70, 256)), ((4,), [1], (3, 10)), ((2, 2), [None, 1], (8, 6)), ((2, 3), [0, 0], (29, 5)),
    ((3, 2), [0, 1], (7, 5)), ((2, 2, 2), [1, None, 0], (9, 4, 3)), ((5,), [0], (3,)), ((4,), [None], (6, 2)),
])
def test_overlapping_blocks_are_torch_dtensor_blocks(mesh_shape, placements, gshape):
    """LayoutEntry.overlapping gives torch's own DTensor blocks (uneven and nested splits too),
    and for any target block exactly the saved blocks that intersect it."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from gdswriter.distributed.shards import overlap
    from gdswriter.format.sharded import DTensorLayout, LayoutEntry, MeshInfo

    size = 1
    for n in mesh_shape:
        size *= n
    ranks = list(range(size))[::-1]  # any order of ranks
    entry = LayoutEntry("t", "float32", gshape, DTensorLayout(MeshInfo.of(mesh_shape, ranks), tuple(placements)))
    torch_placements = [Replicate() if d is None else Shard(d) for d in placements]
    blocks = {}
    for coord in itertools.product(*(range(k) for k in mesh_shape)):
        shape, off = _compute_local_shape_and_global_offset(gshape, mesh_shape, list(coord), torch_placements)
        if all(n > 0 for n in shape):
            blocks.setdefault((tuple(off), tuple(shape)), set()).add(entry.layout.mesh.rank_at(coord))
    whole = entry.overlapping((0,) * len(gshape), gshape)
    assert sorted((o, s) for _, o, s in whole) == sorted(blocks)
    assert all(r in blocks[(o, s)] for r, o, s in whole)
    for target in [((1,) * len(gshape), tuple(max(1, n // 3) for n in gshape)), ((0,) * len(gshape), (1,) * len(gshape))]:
        got = sorted((o, s) for _, o, s in entry.overlapping(*target))
        assert got == sorted(b for b in blocks if overlap(*target, *b) is not None), target
    assert entry.overlapping((0,) * len(gshape), (0,) * len(gshape)) == []


def test_the_index_does_not_grow_with_the_world():
    """A mesh in rank order is two numbers: an index of 1,000 DTensors over 16,384 ranks is the
    same size as over 4 (it grows with the names only)."""
    from gdswriter.format.sharded import DTensorLayout, LayoutEntry, LayoutIndex, MeshInfo

    def size(world: int) -> int:
        mesh = MeshInfo.of((world,), range(world))
        ix = LayoutIndex({f"model/layers.{i}.weight": LayoutEntry(f"model/layers.{i}.weight", "bfloat16",
                                                                  (4096, 4096), DTensorLayout(mesh, (0,)))
                          for i in range(1000)})
        return len(json.dumps(ix.to_json()))

    assert size(16384) - size(4) <= 4


def test_the_index_is_left_out_when_a_rank_holds_dtensors_the_primary_does_not_know():
    """The primary writes the index from its own DTensors; a rank whose reported layout digest
    is not what the index implies for its meshes (another pipeline stage's mesh, here ranks 2
    and 3) makes the primary leave the index out (save.layout_index), and a rank on none of the
    index's meshes must report that it holds no DTensor."""
    from gdswriter.distributed.save import layout_index
    from gdswriter.format.sharded import DTensorLayout, LayoutEntry, LayoutIndex, MeshInfo, layout_digest

    stage0 = [LayoutEntry("layers.0.w", "float32", (8, 4), DTensorLayout(MeshInfo.of((2,), [0, 1]), (0,)))]
    stage1 = [LayoutEntry("layers.1.w", "float32", (8, 4), DTensorLayout(MeshInfo.of((2,), [2, 3]), (0,)))]
    index = LayoutIndex({e.name: e for e in stage0})
    pp = [layout_digest(stage0)] * 2 + [layout_digest(stage1)] * 2
    assert index.mismatched(pp) == [2, 3]
    assert index.mismatched([layout_digest(stage0)] * 2 + [layout_digest([])] * 2) == []

    plan = types.SimpleNamespace(layouts=tuple(stage0), layout_digest=layout_digest(stage0), index=[])
    assert layout_index(plan, [{"layout": d} for d in pp]) is None  # type: ignore[arg-type]
    whole = LayoutIndex({e.name: e for e in stage0 + stage1})  # a rank is checked on its meshes only
    assert whole.mismatched(pp) == []
    assert whole.mismatched(pp[:3] + [layout_digest(stage0)]) == [3]


# ----------------------------------------------------------------------------- replicated state, pipeline stages
def _ddp_worker(rank: int, world: int, root: str, out: str, saving: bool, refused: bool = False) -> dict:
    """DDP-like state (the same model and optimizer on every rank, DistOptions.replicated) and a
    rank-local tensor; saved on 4 ranks, loaded on 2 (its replicated items split over 4 writers)."""
    from support.models import small_options

    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    torch.manual_seed(0 if saving else 5)
    model = torch.nn.Sequential(torch.nn.Linear(96, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 160))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 96)).sum().backward()
    opt.step()
    mine = {"count": torch.full((5,), float(rank) if saving else -1.0)}
    with GDSCheckpointer(model, opt, root=root, state={"mine": mine}, options=small_options(),
                         dist_options=DistOptions(replicated=("model", "optimizer"))) as ck:
        if saving:
            ck.save(STEP)
            if rank == 0:
                torch.save(_full(model, opt), Path(out, "expected.pt"))
            return {}
        import gdswriter.distributed.reshard as reshard

        reads = _count_shard_reads()
        data: list[int] = []
        plain = reshard.execute

        def counting(plan, reach, engine, **kw):
            data.extend(r.length for r in plan.reads)
            return plain(plan, reach, engine, **kw)

        reshard.execute = counting  # counts the data bytes this rank reads (the executor's plan)
        if refused:
            before = _full(model, opt)
            allocated: list[int] = []
            reshard.host_buffer = lambda n: allocated.append(n) or torch.empty(n, dtype=torch.uint8)
            try:
                ck.load(STEP)
            except Exception as e:  # noqa: BLE001 - what the test checks
                error = f"{type(e).__name__}: {e}"
            else:
                error = None
            got = _full(model, opt)
            return {"error": error, "allocated": allocated,
                    "unchanged": all(torch.equal(got[k], before[k]) for k in before)}
        ck.load(STEP)
    expected = torch.load(Path(out, "expected.pt"))
    got = _full(model, opt)
    return {"diff": sorted(k for k in expected if not torch.equal(got[k], expected[k])), "reads": reads,
            "count": mine["count"].tolist(), "data": sum(data),
            "replicated": sum(v.numel() * v.element_size() for v in expected.values())}


def test_replicated_state_4_to_2_each_rank_reads_the_shards_of_its_writers_and_half_the_bytes(tmp_path):
    """Replicated items are split over their 4 writers (10.2); loaded on 2 ranks, rank j reads
    the pieces of writers j and j + 2 (reshard.reader_of) and passes them to the other: it opens
    its own tree's shard and writer j + 2's (2 of the 4 shards; before: all 4) and reads about
    half the replicated bytes (the two ranks together read them once; before: each all of them).
    Its rank-local state is the one its rank saved."""
    root = str(tmp_path / "root")
    run_ranks(4, _ddp_worker, root, str(tmp_path), True, out=tmp_path / "r4")
    res = run_ranks(2, _ddp_worker, root, str(tmp_path), False, out=tmp_path / "r2")
    assert [x["diff"] for x in res] == [[], []], res
    assert [x["count"] for x in res] == [[0.0] * 5, [1.0] * 5]
    read = [sorted(n for n, _ in x["reads"]) for x in res]
    assert read == [["manifest-rank00000.json", "manifest-rank00002.json"],
                    ["manifest-rank00001.json", "manifest-rank00003.json"]], read
    replicated, local = res[0]["replicated"], 5 * 4
    assert sum(x["data"] for x in res) == replicated + 2 * local, res
    assert all(x["data"] < 0.75 * replicated for x in res), [x["data"] for x in res]


def _tamper_shard(root: Path, rank: int, change) -> None:
    """Rewrite saved rank ``rank``'s manifest shard through ``change(body)``, its size and crc32c
    in the global manifest with it (damage that the checksums do not catch)."""
    step = root / f"step_{STEP:012d}"
    shard = step / f"manifest-rank{rank:05d}.json"
    body = json.loads(shard.read_bytes())
    change(body)
    raw = (json.dumps(body, separators=(",", ":")) + "\n").encode()
    shard.write_bytes(raw)
    g = json.loads((step / "manifest.json").read_bytes())
    del g["manifest_crc32c"]
    g["shards"][rank][2:4] = [len(raw), crc32c.crc32c(raw)]
    _write_body(step / "manifest.json", g)


def _replicated_items(body: dict) -> list[int]:
    return [i for i, (key, _, _) in enumerate(body["items"]) if key.startswith("R")]


def _drop_a_chunk(body: dict) -> None:
    written = {c[0] for c in body["chunks"] if c[4]} & set(_replicated_items(body))
    i = min(written)
    body["chunks"] = [c for c in body["chunks"] if c[0] != i]


def _grow_an_item(body: dict) -> None:
    body["items"][_replicated_items(body)[0]][1] = 1 << 40


SHARD_DAMAGE = {
    # writer 2 (read by rank 0 of 2) does not record the pieces its holders' split gives it
    "writer-lacks-its-pieces": (2, _drop_a_chunk, "does not record exactly the pieces"),
    # rank 1's shard (its tree's) says a replicated item is 1 TiB: the split no writer matches
    "item-of-1-TiB": (1, _grow_an_item, "split|disagree"),
}


@pytest.mark.parametrize("damage", sorted(SHARD_DAMAGE))
def test_replicated_state_4_to_2_damaged_shards_are_refused_before_any_buffer(tmp_path, damage):
    """A shard that does not record what the save's split says it wrote, or that disagrees with
    the other ranks' about the replicated state, is CorruptCheckpointError on the rank that finds
    it (RankFailedError on the other), before any data buffer is allocated; nothing live changes."""
    root = tmp_path / "root"
    run_ranks(4, _ddp_worker, str(root), str(tmp_path), True, out=tmp_path / "r4")
    rank, change, match = SHARD_DAMAGE[damage]
    _tamper_shard(root, rank, change)
    res = run_ranks(2, _ddp_worker, str(root), str(tmp_path), False, True, out=tmp_path / "r2")
    assert all(x["error"] and x["unchanged"] and x["allocated"] == [] for x in res), res
    found = [x["error"] for x in res if x["error"].startswith("CorruptCheckpointError")]
    assert found and all(re.search(match, e) for e in found), res
    assert all(x["error"].startswith(("CorruptCheckpointError", "RankFailedError")) for x in res), res


def _cut_chunk(root: Path) -> tuple[Path, int]:
    """A data file of the 2-rank replicated step and a file offset inside one of its chunks
    that two ranks of 4 read parts of (reshard.read_split): the first byte the second of them
    reads."""
    from gdswriter.distributed.rankfiles import item_pieces
    from gdswriter.distributed.reshard import read_split
    from gdswriter.format.sharded import parse_global, parse_shard, read_shard

    step = root / f"step_{STEP:012d}"
    g = parse_global((step / "manifest.json").read_bytes(), "manifest.json")
    shards = [parse_shard(read_shard(step, g, ref), g, ref, ref.name) for ref in g.shards]
    keys = [k for _, k in sorted((it.key, k) for k, it in enumerate(shards[0].items)
                                 if it.key.startswith("R") and it.holders is None)]  # in key order
    saved = item_pieces(shards[0].items, g.world_size)
    split = read_split([saved[k] for k in keys], [shards[0].items[k].nbytes for k in keys], g.world_size, 4)
    for k, pieces in zip(keys, split):
        for a, b in zip(pieces, pieces[1:]):
            if a[0] != b[0]:  # a cut between two readers at offset b[1]: the chunk holding it
                for sh in shards:
                    kw = next(i for i, it in enumerate(sh.items) if it.key == shards[0].items[k].key)
                    for c in sh.chunks[kw]:
                        if c.storage_offset < b[1] < c.storage_offset + c.length:
                            return step / sh.files[c.file].path, c.file_offset + b[1] - c.storage_offset
    raise AssertionError("no chunk of the replicated state is read in parts")


def test_replicated_state_2_to_4_every_rank_reads_a_quarter_of_the_bytes(tmp_path):
    """Replicated items saved on 2 ranks (each writing half), loaded on 4: the items end to end
    are cut into 4 equal shares (reshard.read_split), and rank j reads the share that lies in
    writer j mod 2's half: ranks 0 and 1 open only their own shard (their tree's), ranks 2 and
    3 rank 0's (their tree's) and the one writer's, each reads about a quarter of the
    replicated bytes, and the four read them once (before: ranks 0 and 1 read half each, 2 and
    3 nothing, receiving everything). Bit for bit on every rank; a new rank takes rank 0's
    rank-local state."""
    root = str(tmp_path / "root")
    run_ranks(2, _ddp_worker, root, str(tmp_path), True, out=tmp_path / "r2")
    res = run_ranks(4, _ddp_worker, root, str(tmp_path), False, out=tmp_path / "r4")
    assert [x["diff"] for x in res] == [[]] * 4, res
    assert [x["count"] for x in res] == [[0.0] * 5, [1.0] * 5, [0.0] * 5, [0.0] * 5]
    replicated, local = res[0]["replicated"], 5 * 4
    assert replicated > 4 * (256 << 10)  # every share above split_stream's minimum
    assert sum(x["data"] for x in res) == replicated + 4 * local, res
    assert all(abs(x["data"] - local - replicated / 4) < 0.02 * replicated for x in res), \
        ([x["data"] for x in res], replicated)
    read = [sorted({n[-10:-5] for n, _ in x["reads"]}) for x in res]
    assert read == [["00000"], ["00001"], ["00000"], ["00000", "00001"]], read


def test_replicated_state_2_to_4_a_damaged_chunk_read_in_parts_is_refused(tmp_path):
    """A chunk two loading ranks read parts of has no crc32c for either part: it is checked whole
    once the pieces have spread, by the rank that read its first byte. A byte flipped in the
    part the other rank reads is ChecksumMismatchError there (CorruptCheckpointError naming that
    rank elsewhere: the damage is typed on every rank) and no rank changes its live state."""
    from gdswriter.errors import ChecksumMismatchError

    root = tmp_path / "root"
    run_ranks(2, _ddp_worker, str(root), str(tmp_path), True, out=tmp_path / "r2")
    path, offset = _cut_chunk(root)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    res = run_ranks(4, _ddp_worker, str(root), str(tmp_path), False, True, out=tmp_path / "r4")
    assert all(x["error"] and x["unchanged"] for x in res), res
    found = [x["error"] for x in res if x["error"].startswith(ChecksumMismatchError.__name__)]
    assert len(found) == 1 and path.name in found[0], res
    assert all(x["error"].startswith((ChecksumMismatchError.__name__, "CorruptCheckpointError")) for x in res), res


@settings(max_examples=200, deadline=None)
@given(sizes=strategies.lists(strategies.integers(0, 3 << 20), min_size=1, max_size=6),
       saved_world=strategies.integers(1, 6),
       world=strategies.integers(1, 16), seed=strategies.integers(0, 1 << 16))
def test_read_split_covers_every_item_once_and_balances_the_readers(sizes, saved_world, world, seed):
    """read_split: each item covered once, in offset order; on at most the saved world, writer
    w's pieces read by w mod N; on more ranks, each reader's bytes within a share's slack of
    1 / N of the whole (or of split_stream's minimum share), and each reader meeting at most three
    writers' pieces in all (a share is no longer than a writer's part, to within the alignment)."""
    from gdswriter.distributed.reshard import read_split
    from gdswriter.planner.ranks import SPLIT_MIN_SHARE, split_stream

    saved = split_stream(sizes, saved_world, seed)
    split = read_split(saved, sizes, saved_world, world)
    per = [0] * world
    writers: list[set] = [set() for _ in range(world)]
    for size, pieces, mine in zip(sizes, saved, split):
        assert [off for _, off, _ in mine] == [sum(n for _, _, n in mine[:i]) for i in range(len(mine))]
        assert sum(n for _, _, n in mine) == size and all(n > 0 for _, _, n in mine)
        for j, off, n in mine:
            per[j] += n
            writers[j] |= {w for w, o, m in pieces if o < off + n and off < o + m}
        if world <= saved_world:
            assert {(j, off) for j, off, _ in mine} == {(w % world, off) for w, off, n in pieces if n}
    if world > saved_world:
        total = sum(sizes)
        share = max(-(-total // world), SPLIT_MIN_SHARE)
        assert max(per) <= share + 4096 * len(sizes), (per, share)
        assert all(len(w) <= 3 for w in writers), writers


def _pp_worker(rank: int, world: int, root: str) -> dict:
    from support.models import small_options
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gdswriter import GDSCheckpointer
    from gdswriter.format.sharded import parse_global

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    w = DTensor.from_local(torch.full((4, 8), float(rank + 1)), mesh["dp"], [Shard(0)], run_check=False)
    with GDSCheckpointer(root=root, state={"pp": {"w": w}}, options=small_options()) as ck:
        ck.save(STEP)
    g = parse_global((Path(root) / f"step_{STEP:012d}" / "manifest.json").read_bytes(), "manifest.json")
    return {"indexed": g.layout_index is not None}


def test_a_step_with_dtensors_on_a_mesh_without_the_primary_has_no_index(tmp_path):
    """Two pipeline stages, each on a mesh of its own: the primary cannot describe the other
    stage's DTensors, the other rank's vote says so (its layout digest), and the step is
    written without an index (its loads on another layout merge)."""
    assert run_ranks(2, _pp_worker, str(tmp_path / "root"), out=tmp_path / "r2") == [{"indexed": False}] * 2


def test_2_to_4_ranks_the_new_ranks_take_rank_0s_tree(tmp_path):
    """Loading on more ranks than saved: ranks 2 and 3 take rank 0's tree (its shard), and each
    rank reads the shards of the saved blocks its rows lie in (70 rows saved as 35 + 35, loaded
    as 18 + 18 + 18 + 16) and of the writers of the replicated step counters (one of the two)."""
    root = str(tmp_path / "root")
    run_ranks(2, _save_worker, root, str(tmp_path), out=tmp_path / "r2")
    res = run_ranks(4, _load_worker, root, str(tmp_path), out=tmp_path / "r4")
    assert [x["diff"] for x in res] == [[]] * 4, res
    read = [sorted(n[-10:-5] for n, _ in x["reads"]) for x in res]
    assert read == [["00000"]] + [["00000", "00001"]] * 3, read  # rank 0's rows and counters are rank 0's


# ----------------------------------------------------------------------------- the merging path's fetch
FETCHED = 64 * 1024


def _fetch_worker(rank: int, world: int, base: str, pattern: str) -> dict:
    """Every rank on a disk of its own: rank r needs the storage rank r + 1 wrote ("next") or
    rank 0 wrote ("from-0"), which it cannot read, through fetch_storages; returns what it
    received besides the chunk's bytes."""
    import torch.distributed as dist
    from support.models import small_engine

    from gdswriter.distributed.fetch import Reach, fetch_storages
    from gdswriter.distributed.group import Coordinator
    from gdswriter.engines.select import create_engine
    from gdswriter.format.commit import step_dir_name
    from gdswriter.format.manifest import ChunkRecord, DistInfo, FileRecord, Manifest, RootInfo, StorageRecord, \
        TensorRecord

    def data(r: int) -> bytes:
        return bytes((r * 31 + i) % 251 for i in range(FETCHED))

    roots = [Path(base, f"rank{r}") for r in range(world)]
    (roots[rank] / step_dir_name(STEP)).mkdir(parents=True)
    (roots[rank] / step_dir_name(STEP) / "data.bin").write_bytes(data(rank))
    m = Manifest(step=STEP, files=tuple(FileRecord(r, "data.bin", FETCHED) for r in range(world)),
                 storages=tuple(StorageRecord(FETCHED, (ChunkRecord(r, 0, 0, FETCHED, crc32c.crc32c(data(r))),))
                                for r in range(world)),
                 tensors=tuple(TensorRecord(f"t{r}", r, 0, "uint8", (FETCHED,), (1,)) for r in range(world)),
                 state=None, dist=DistInfo(world, "gdswriter", tuple(RootInfo(f"id{r}", str(roots[r]), (r,))
                                                                     for r in range(world))))
    reach = Reach(tuple(p if r == rank else None for r, p in enumerate(roots)))
    dist.barrier()
    engine = create_engine(small_engine())
    coord = Coordinator.create(timeout_s=60, label="the fetch test")
    try:
        before = coord.stats.snapshot()
        wanted = (rank + 1) % world if pattern == "next" else 0
        got = fetch_storages(coord, reach, m, [wanted], engine, verify=True, what="fetching")
        after = coord.stats.snapshot()
    finally:
        coord.close()
        engine.close()
    assert bytes(got[wanted].numpy()) == data(wanted)
    return {"received": after[1] - before[1] - FETCHED, "collectives": after[2] - before[2]}


@pytest.mark.parametrize("pattern", ["next", "from-0"])
def test_what_a_rank_receives_fetching_chunks_is_flat_from_2_to_8_ranks(tmp_path, pattern):
    """The merging path's fetch: rank 0 gathers what each rank needs and cannot read and sends
    each rank its own moves alone, so a rank other than 0 receives the same bytes at 2, 4 and 8
    ranks (before: every rank's needs and roots were all-gathered to every rank), also when one
    rank reads for all the others ("from-0": its list of moves grows with them, and a scatter
    padded to the longest message would hand every rank that length)."""
    received = {}
    for world in (2, 4, 8):
        res = run_ranks(world, _fetch_worker, str(tmp_path / f"w{world}"), pattern, out=tmp_path / f"r{world}")
        received[world] = {x["received"] for x in res[1:]}
    assert received[2] == received[4] == received[8] and len(received[2]) == 1, received
