"""A restore from a copy on a peer streams (distributed/fetch.py ``stream_chunks``): the chunks
read for other ranks go in rounds of fetch.STREAM_BYTES per pair of ranks, a round sent while
the next is read. Real gloo ranks (each its own host and node-local root), real replicas=2
saves; small rounds here so that a step takes several."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.models import small_options
from support.ranks import caught, run_ranks
from support.roots import copy_nodes, open_replica_node, replica_state, save_protected_steps

MiB = 1 << 20
ROUND = 1 * MiB  # fetch.STREAM_BYTES in the ranks: rank 1's copy (6 MiB of data) takes several rounds


def load_streamed(rank: int, world: int, base: str, fallback: bool) -> dict:
    """Load the latest step into zeroed tensors with fetch.STREAM_BYTES = ROUND: {"got": [step,
    bit exact] or the error, "untouched": whether the live tensors are still zeros}."""
    from gdswriter.distributed import fetch

    fetch.STREAM_BYTES = ROUND
    live = {k: torch.zeros_like(v) for k, v in replica_state(1).items()}
    got: list = []

    def load() -> None:
        with open_replica_node(base, rank, live) as ck:
            got.append(ck.load(fallback=fallback))

    err = caught(load)
    untouched = all(not t.any() for t in live.values())
    if err:
        return {"got": err, "untouched": untouched}
    want = replica_state(got[0])
    return {"got": [got[0], all(torch.equal(live[k].view(torch.int32), want[k].view(torch.int32)) for k in want)],
            "untouched": untouched}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("saved")
    run_ranks(2, save_protected_steps, str(base), out=base / "out")
    return base


@pytest.fixture()
def job(saved, tmp_path) -> Path:
    """A fresh copy of the saved roots (their ids travel with them), node 1 replaced by an empty root."""
    return copy_nodes(saved, tmp_path / "job", 2, replaced=(1,))


def copy_of_rank1(job: Path, step: int) -> Path:
    return next((job / "n0" / f"step_{step:012d}" / "copies" / "rank00001").glob("data-rank1-*.bin"))


def test_node_replaced_restores_in_rounds_bit_exact(job):
    """Rank 1's files read from their copy on node 0 and streamed to rank 1 in 1 MiB rounds: both
    ranks load the newest step bit exact."""
    out = run_ranks(2, load_streamed, str(job), False, out=job / "out")
    assert [x["got"] for x in out] == [[2, True]] * 2, out


def test_damage_late_in_the_stream_fails_every_rank_at_once_and_changes_nothing(job):
    """A flipped byte three quarters into the copy of rank 1's data file (a late round: the rounds
    before it already sent): every rank raises a typed error (the copy named; no rank waits out
    the timeout for rounds the reader never read), no live tensor changed; load(fallback=True)
    loads step 1 from its intact copy, bit exact."""
    path = copy_of_rank1(job, 2)
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x40
    path.write_bytes(bytes(data))
    out = run_ranks(2, load_streamed, str(job), False, out=job / "out")
    for x in out:
        assert x["untouched"], x
        assert x["got"][0] in ("CorruptCheckpointError", "RankFailedError"), x
        assert "CollectiveFailedError" not in x["got"][1], x
    kind, msg = out[0]["got"]
    assert kind == "CorruptCheckpointError" and "no good copy of rank 1's files" in msg, out
    older = run_ranks(2, load_streamed, str(job), True, out=job / "out2")
    assert [x["got"] for x in older] == [[1, True]] * 2, older


def test_a_fetch_reads_everything_however_late_its_reader_thread_starts(tmp_path):
    """The fetch's reader thread also reads what no round sends (a rank's own chunks: all of
    them in one process). It was told to stop as soon as the last round was passed, so a
    reader thread that started late skipped those reads: the load failed with a KeyError, or
    left buffers given to it unread. Here the reader thread is held back at its first call
    (a profile hook, the standard threading seam), so it starts after the rounds, always."""
    import sys
    import threading
    import time

    import gdswriter.distributed
    from gdswriter import GDSCheckpointer

    state = {"w": torch.arange(600_000, dtype=torch.float32), "b": torch.full((1000,), 7.0)}
    with GDSCheckpointer(state, None, tmp_path, options=small_options()) as ck:
        ck.save(1)
    held = []

    def hold_the_reader(frame, event, arg):
        if threading.current_thread().name == "gdswriter-fetch":
            held.append(1)
            time.sleep(0.3)
        sys.setprofile(None)  # once per thread

    threading.setprofile(hold_the_reader)
    try:
        got, st = gdswriter.distributed.load_state(tmp_path, 1)
    finally:
        threading.setprofile(None)
    assert held, "the fetch's reader thread was not seen"
    assert got == 1 and torch.equal(st["model"]["w"], state["w"]) and torch.equal(st["model"]["b"], state["b"])


# ----------------------------------------------------------------------------- the relay (4+ ranks)
RELAYED = 4 * MiB  # one chunk every other rank needs: at least fetch.RELAY_MIN


def _relay_worker(rank: int, world: int, base: str, flip: bool) -> dict:
    """Every rank on a disk of its own; rank 0 wrote a RELAYED-byte chunk (storage 0) that every
    rank needs, and each rank r a small one of its own (storage r) that no one else needs:
    fetch_storages, in 1 MiB rounds. Returns what this rank sent and whether it got the bytes
    (or the error: ``flip`` corrupts rank 0's file before the fetch)."""
    import crc32c
    import torch.distributed as dist
    from support.models import small_engine

    from gdswriter.distributed import fetch
    from gdswriter.distributed.group import Coordinator
    from gdswriter.engines.select import create_engine
    from gdswriter.format.commit import step_dir_name
    from gdswriter.format.manifest import ChunkRecord, DistInfo, FileRecord, Manifest, RootInfo, StorageRecord, \
        TensorRecord

    fetch.STREAM_BYTES = ROUND
    data = bytes(torch.randint(0, 256, (RELAYED,), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
                 .numpy())
    roots = [Path(base, f"rank{r}") for r in range(world)]
    d = roots[rank] / step_dir_name(1)
    d.mkdir(parents=True)
    (d / "data.bin").write_bytes(data if rank == 0 else data[:4096])
    if flip and rank == 0:
        with open(d / "data.bin", "r+b") as f:
            f.seek(RELAYED // 2)
            f.write(bytes([data[RELAYED // 2] ^ 1]))
    sizes = [RELAYED] + [4096] * (world - 1)
    m = Manifest(step=1, files=tuple(FileRecord(r, "data.bin", n) for r, n in enumerate(sizes)),
                 storages=tuple(StorageRecord(n, (ChunkRecord(r, 0, 0, n, crc32c.crc32c(data[:n])),))
                                for r, n in enumerate(sizes)),
                 tensors=tuple(TensorRecord(f"t{r}", r, 0, "uint8", (n,), (1,)) for r, n in enumerate(sizes)),
                 state=None, dist=DistInfo(world, "gdswriter", tuple(RootInfo(f"id{r}", str(roots[r]), (r,))
                                                                     for r in range(world))))
    reach = fetch.Reach(tuple(p if r == rank else None for r, p in enumerate(roots)))
    dist.barrier()
    engine = create_engine(small_engine())
    coord = Coordinator.create(timeout_s=60, label="the relay test")
    got: list = []
    try:
        before = coord.stats.snapshot()
        err = caught(lambda: got.append(fetch.fetch_storages(coord, reach, m, [0, rank], engine, verify=True,
                                                             what="fetching")))
        sent = coord.stats.snapshot()[0] - before[0]
    finally:
        coord.close()
        engine.close()
    return {"sent": sent, "got": err or [bytes(got[0][0].numpy()) == data, bytes(got[0][rank].numpy()) ==
                                          data[:sizes[rank]]]}


@pytest.mark.parametrize("world", [4, 5])
def test_a_chunk_every_rank_needs_is_relayed_not_sent_by_its_reader_to_each(tmp_path, world):
    """A chunk only rank 0 reads and every other rank needs (a lost node's copy on one peer):
    the ranks that received it send it on, so rank 0 sends it at most twice (not world - 1
    times), no rank sends it more than twice, and every rank gets it bit exact, each round it
    received checked against its crc32c."""
    out = run_ranks(world, _relay_worker, str(tmp_path), False, out=tmp_path / "out")
    assert [x["got"] for x in out] == [[True, True]] * world, out
    sent = [x["sent"] for x in out]
    assert sent[0] < 2.1 * RELAYED and max(sent) < 2.1 * RELAYED, sent
    assert sum(sent) >= (world - 1) * RELAYED, sent


def test_a_relayed_chunk_that_fails_its_check_fails_every_rank(tmp_path):
    """A flipped byte in the chunk rank 0 reads for every other rank: no rank takes the bytes,
    every rank raises a typed error (rank 0 its own, naming the damage), none waits out the
    timeout for a round (the relayed rounds run to their end)."""
    out = run_ranks(4, _relay_worker, str(tmp_path), True, out=tmp_path / "out")
    # this bare step has no manifest.json, so rank 0 reports its checksum failure as a step gone
    assert out[0]["got"][0] in ("ChecksumMismatchError", "CheckpointNotFoundError") and "corrupt" in out[0]["got"][1], out
    assert all(x["got"][0] == "RankFailedError" for x in out[1:]), out
    assert all("CollectiveFailedError" not in x["got"][1] for x in out), out


# ----------------------------------------------------------------------------- reused round buffers
def _reader_worker(rank: int, world: int, base: str) -> dict:
    """Rank 0 reads, for rank 1 alone, a file of 8 chunks of 1 MiB (storage 1, 1 MiB rounds),
    each into a buffer from the ``alloc`` it is given (counted); rank 1 receives them. Returns
    how many 1 MiB buffers rank 0 allocated, and whether rank 1 got the bytes."""
    import crc32c
    import torch.distributed as dist
    from support.models import small_engine

    from gdswriter.distributed import fetch
    from gdswriter.distributed.group import Coordinator
    from gdswriter.engines.select import create_engine
    from gdswriter.format.commit import step_dir_name
    from gdswriter.format.manifest import ChunkRecord, DistInfo, FileRecord, Manifest, RootInfo, StorageRecord, \
        TensorRecord
    from gdswriter.load.reader import host_buffer

    fetch.STREAM_BYTES = ROUND
    n = 8
    data = bytes(torch.randint(0, 256, (n * MiB,), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
                 .numpy())
    roots = [Path(base, f"rank{r}") for r in range(world)]
    d = roots[rank] / step_dir_name(1)
    d.mkdir(parents=True)
    (d / "data.bin").write_bytes(data if rank == 0 else data[:4096])
    chunks = tuple(ChunkRecord(0, k * MiB, k * MiB, MiB, crc32c.crc32c(data[k * MiB:(k + 1) * MiB])) for k in range(n))
    m = Manifest(step=1, files=(FileRecord(0, "data.bin", n * MiB), FileRecord(1, "data.bin", 4096)),
                 storages=(StorageRecord(4096, (ChunkRecord(1, 0, 0, 4096, crc32c.crc32c(data[:4096])),)),
                           StorageRecord(n * MiB, chunks)),
                 tensors=(TensorRecord("own", 0, 0, "uint8", (4096,), (1,)),
                          TensorRecord("copy", 1, 0, "uint8", (n * MiB,), (1,))),
                 state=None, dist=DistInfo(world, "gdswriter", tuple(RootInfo(f"id{r}", str(roots[r]), (r,))
                                                                     for r in range(world))))
    reach = fetch.Reach(tuple(p if r == rank else None for r, p in enumerate(roots)))
    sizes: list[int] = []

    def alloc(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return host_buffer(nbytes)

    dist.barrier()
    engine = create_engine(small_engine())
    coord = Coordinator.create(timeout_s=60, label="the round buffers test")
    try:
        got = fetch.fetch_storages(coord, reach, m, [0] if rank == 0 else [1], engine, verify=True, what="fetching",
                                   alloc=alloc)
    finally:
        coord.close()
        engine.close()
    return {"chunk buffers": sizes.count(MiB), "got": rank == 0 or bytes(got[1].numpy()) == data}


def test_a_rank_reading_a_copy_for_another_reuses_a_few_round_buffers(tmp_path):
    """Rank 0 reads 8 MiB for rank 1 alone, in 1 MiB rounds: it reads at most
    fetch.AHEAD_ROUNDS rounds ahead of the rounds sent and reads each chunk into a buffer a
    passed round freed, so it allocates a few 1 MiB buffers, not one per chunk; rank 1 gets
    the bytes bit exact."""
    from gdswriter.distributed import fetch

    out = run_ranks(2, _reader_worker, str(tmp_path), out=tmp_path / "out")
    assert [x["got"] for x in out] == [True, True], out
    assert 1 <= out[0]["chunk buffers"] <= fetch.AHEAD_ROUNDS + 2, out
