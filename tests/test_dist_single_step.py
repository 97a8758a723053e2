"""A step saved by one process (no torch.distributed: a pretrained model fine-tuned on N ranks),
loaded by N ranks: the bytes they all need are read from disk once across them, each rank about
1 / N (reshard.read_replicated_once), bit for bit, into DDP's replicated state and into FSDP2's
shards; a byte flipped in a chunk two ranks read parts of is CorruptCheckpointError on every
rank and no live tensor changes; with node-local roots the rank that sees the step reads it for
the others."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.models import full_state as _full
from support.ranks import run_ranks

STEP = 3


# ----------------------------------------------------------------------------- helpers (run in ranks too)
def _model(seed: int, fsdp_world: int | None = None):
    """An MLP of about 4 MiB of fp32 (12 MiB with Adam's moments) after one Adam step, plain or
    sharded by FSDP2 over ``fsdp_world`` ranks."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    if fsdp_world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (fsdp_world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(seed + 1)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return model, opt


def _save_single(tmp_path: Path) -> tuple[Path, int]:
    """Step 3 saved by this (single) process; returns the root and the bytes of its storages."""
    from support.models import small_options

    from gdswriter import GDSCheckpointer
    from gdswriter.format.manifest import Manifest

    root = tmp_path / "root"
    model, opt = _model(seed=0)
    with GDSCheckpointer(model, opt, root=str(root), options=small_options()) as ck:
        ck.save(STEP)
    torch.save(_full(model, opt), tmp_path / "expected.pt")
    m = Manifest.from_json_bytes((root / f"step_{STEP:012d}" / "manifest.json").read_bytes())
    assert m.dist is None and len(m.files) == 1  # a single-process step
    return root, sum(s.nbytes for s in m.storages)


def _load_worker(rank: int, world: int, roots: list[str], out: str, fsdp: bool, apart: bool = False) -> dict:
    from support.models import small_options

    from gdswriter import GDSCheckpointer

    if apart:  # as when the ranks need different storages: each reads its own
        import gdswriter.distributed.load as dist_load

        dist_load.read_replicated_once = lambda *a, **k: (None, True)  # private: on every rank alike

    root = roots[rank * len(roots) // world]  # one root, or one per rank (node-local disks)
    model, opt = _model(seed=7, fsdp_world=world if fsdp else None)  # other values
    before = _full(model, opt)
    with GDSCheckpointer(model, opt, root=root, options=small_options()) as ck:
        engine = ck.engines[0]
        read = [0]
        plain = engine.read_file

        def counting(path, spans):  # what this rank reads from the data files
            read[0] += sum(s.out.numel() for s in spans)
            return plain(path, spans)

        engine.read_file = counting  # private: wraps the engine instance's method
        error = None
        stats = ck.session.coord.stats
        before_load = stats.snapshot()
        try:
            ck.load(STEP)
        except Exception as e:  # noqa: BLE001 - what the test checks
            error = [[c.__name__ for c in type(e).__mro__], str(e)]
        received = stats.snapshot()[1] - before_load[1]
    got = _full(model, opt)
    expected = torch.load(Path(out, "expected.pt"))
    return {"read": read[0], "error": error, "received": received,
            "diff": sorted(k for k in expected if k not in got or not torch.equal(got[k], expected[k])),
            "unchanged": all(torch.equal(got[k], before[k]) for k in before)}


def _cut_between_ranks(root: Path, world: int) -> tuple[Path, int]:
    """A data file of the single-process step and a file offset inside a chunk that two of
    ``world`` loading ranks read parts of (read_split of the storages end to end, as
    read_replicated_once cuts them): the first byte the second of them reads."""
    from gdswriter.distributed.reshard import read_split
    from gdswriter.format.manifest import Manifest

    step = root / f"step_{STEP:012d}"
    m = Manifest.from_json_bytes((step / "manifest.json").read_bytes())
    together = [s for s, rec in enumerate(m.storages) if rec.nbytes]
    sizes = [m.storages[s].nbytes for s in together]
    for s, pieces in zip(together, read_split([[(0, 0, n)] for n in sizes], sizes, 1, world)):
        for a, b in zip(pieces, pieces[1:]):
            if a[0] != b[0]:  # a cut between two readers at offset b[1]: the chunk holding it
                for c in m.storages[s].chunks:
                    if c.storage_offset < b[1] < c.storage_offset + c.length:
                        return step / m.files[c.file].path, c.file_offset + b[1] - c.storage_offset
    raise AssertionError("no chunk is read in parts")


# ----------------------------------------------------------------------------- the tests
def test_ddp_on_2_and_4_ranks_reads_a_single_process_step_once(tmp_path):
    """Every rank needs the whole state (DDP): each reads about 1 / N of the step's bytes and the
    N ranks read them once in all (before: every rank read all of them), bit for bit; besides
    the pieces the others read, a rank receives only a few small messages."""
    root, total = _save_single(tmp_path)
    assert total > 8 << 20
    for world in (2, 4):
        res = run_ranks(world, _load_worker, [str(root)], str(tmp_path), False, out=tmp_path / f"r{world}")
        assert [x["error"] for x in res] == [None] * world, res
        assert [x["diff"] for x in res] == [[]] * world, res
        reads = [x["read"] for x in res]
        assert sum(reads) == total, (world, reads, total)  # once, not N times
        assert all(abs(r - total / world) < 0.01 * total for r in reads), (world, reads, total)
        # each rank receives the bytes the others read, once, and a few fixed-size messages
        assert all(0 <= x["received"] - (total - x["read"]) < 64 << 10 for x in res), (world, res, total)


def test_fsdp_on_2_ranks_each_rank_reads_about_its_half(tmp_path):
    """Each rank's live tensors are FSDP2 shards of the single process's plain tensors: it gets
    its block of each (bit for bit), and the two ranks read the step once, about half each
    (before: the load failed, a plain tensor handed to a DTensor)."""
    root, total = _save_single(tmp_path)
    res = run_ranks(2, _load_worker, [str(root)], str(tmp_path), True, out=tmp_path / "r2")
    assert [x["error"] for x in res] == [None, None], res
    assert [x["diff"] for x in res] == [[], []], res
    reads = [x["read"] for x in res]
    assert sum(reads) == total and all(abs(r - total / 2) < 0.01 * total for r in reads), (reads, total)


def test_a_damaged_chunk_two_ranks_read_parts_of_is_refused_on_every_rank(tmp_path):
    """A chunk cut between two ranks' shares is checked against its crc32c whole once the pieces
    have spread, by the rank that read its first byte. A byte flipped in the part the other rank
    reads: ChecksumMismatchError naming the file on the checking rank, CorruptCheckpointError on
    every other, and no rank changes a live tensor."""
    root, _ = _save_single(tmp_path)
    path, offset = _cut_between_ranks(root, 2)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    res = run_ranks(2, _load_worker, [str(root)], str(tmp_path), False, out=tmp_path / "r2")
    assert all(x["error"] and "CorruptCheckpointError" in x["error"][0] and x["unchanged"] for x in res), res
    found = [x["error"][1] for x in res if x["error"][0][0] == "ChecksumMismatchError"]
    assert len(found) == 1 and path.name in found[0], res


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_node_local_roots_the_rank_that_sees_the_step_reads_it_for_the_other(tmp_path, fsdp):
    """Rank 1's root is another disk, without the step: the ranks do not read it together (rank
    1 reaches none of its files); rank 0 reads it once and sends rank 1 every chunk it needs
    (an FSDP rank's: those of the storages its blocks are in, named alike on both ranks), bit
    for bit."""
    root, total = _save_single(tmp_path)
    other = tmp_path / "node1"
    other.mkdir()
    res = run_ranks(2, _load_worker, [str(root), str(other)], str(tmp_path), fsdp, out=tmp_path / "r2")
    assert [x["error"] for x in res] == [None, None], res
    assert [x["diff"] for x in res] == [[], []], res
    assert [x["read"] for x in res] == [total, 0], res


def test_fsdp_ranks_reading_apart_read_the_chunks_of_their_blocks(tmp_path):
    """Where the ranks do not read together (they need different storages), an FSDP rank reads
    the saved chunks that hold its blocks, bit for bit: here most tensors are one chunk, so each
    rank reads most of the step, but not the chunks of the halves it does not hold."""
    root, total = _save_single(tmp_path)
    res = run_ranks(2, _load_worker, [str(root)], str(tmp_path), True, True, out=tmp_path / "r2")
    assert [x["error"] for x in res] == [None, None], res
    assert [x["diff"] for x in res] == [[], []], res
    assert all(total / 2 < x["read"] < total for x in res), (res, total)


def test_a_plain_tensors_block_is_read_from_the_chunks_holding_it():
    """plain_blocks: rows 4..7 of a saved 16 x 1024 fp32 tensor in four chunks of 4 rows (16
    KiB) become a block record in a storage of its own made of the second chunk alone; a block
    of rows 3..8 takes the three chunks it meets; an empty block takes none."""
    from gdswriter.distributed.rebuild import plain_blocks
    from gdswriter.format.manifest import ChunkRecord, FileRecord, Manifest, StorageRecord, TensorRecord

    chunks = tuple(ChunkRecord(0, 8192 + k * 16384, k * 16384, 16384, k) for k in range(4))
    m = Manifest(step=1, files=(FileRecord(0, "data.bin", 1 << 20),), storages=(StorageRecord(1 << 16, chunks),),
                 tensors=(TensorRecord("model/w", 0, 0, "float32", (16, 1024), (1024, 1)),), state=None)
    read, at, added = plain_blocks(m, {0: ((4, 0), (4, 1024), None)}, set())
    assert added == {1} and read.storages[1] == StorageRecord(16384, (ChunkRecord(0, 8192 + 16384, 0, 16384, 1),))
    assert read.tensors[at[0]] == TensorRecord("model/w", 1, 0, "float32", (4, 1024), (1024, 1))
    read, at, added = plain_blocks(m, {0: ((3, 0), (6, 1024), None)}, set())
    assert [c.crc32c for c in read.storages[1].chunks] == [0, 1, 2] and read.tensors[at[0]].byte_offset == 3 * 4096
    read, at, added = plain_blocks(m, {0: ((16, 0), (0, 1024), None)}, set())
    assert at == {} and added == set()
    read, at, added = plain_blocks(m, {0: ((4, 0), (4, 1024), None)}, {0})  # its storage read whole anyway
    assert added == set() and read.tensors[at[0]] == TensorRecord("model/w", 0, 16384, "float32", (4, 1024), (1024, 1))
