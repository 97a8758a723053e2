"""A restore from a copy on a peer whose ranks may read each other's memory pulls the chunks
(distributed/fetch.py ``_pull_round``): the reader of a round tells the rank that needs it
where its chunks are, that rank copies them with process_vm_readv as soon as the round is read
(while the reader reads the next ones), checks each against its crc32c where it lands, and only
then may the reader reuse the buffers. Real gloo ranks (each a node with a root of its own, on
one kernel), real replicas=2 saves, real process_vm_readv; 1 MiB rounds so that a step takes
several. A test changes the pulled bytes (or refuses the call) only through crossmem's seams."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from support.ranks import WarningLines, caught, run_ranks
from support.roots import copy_nodes, open_replica_node, replica_state, save_protected_steps

MiB = 1 << 20
ROUND = 1 * MiB  # fetch.STREAM_BYTES in the ranks: the 12 MiB state rank 1 lacks takes several rounds


def load_pulled(rank: int, world: int, base: str, damage: str) -> dict:
    """Load the latest step into zeroed tensors, node 1 replaced, with fetch.STREAM_BYTES = ROUND.
    ``damage``: "" (none), "every" (a byte of every chunk run pulled flipped once it has landed:
    a bad copy the reader's own check cannot see), "first" (only the first one), "refuse" (the
    pull refused: EPERM). Returns what it got ([step, bit exact] or the error), whether the live
    tensors are still zeros, when each pull ended and each read of the fetch's reader ended
    (time.monotonic: one clock for the two processes), the bytes pulled and the warnings."""
    import ctypes
    import errno
    import logging

    from gdswriter.distributed import crossmem, fetch

    fetch.STREAM_BYTES = ROUND
    pulls: list[tuple[float, int]] = []
    reads: list[float] = []
    pull, execute, readv = crossmem.pull, fetch.execute, crossmem.process_vm_readv

    def pulled(pid, moves, what="copying a peer rank's pieces"):
        n = pull(pid, moves, what)
        if damage == "every" or (damage == "first" and not pulls):
            _, dst, length = moves[len(moves) // 2]
            (ctypes.c_ubyte * length).from_address(dst)[length // 2] ^= 0x10
        pulls.append((time.monotonic(), n))
        return n

    def read(*a, **k):
        try:
            return execute(*a, **k)
        finally:
            reads.append(time.monotonic())

    def refused(*a):
        ctypes.set_errno(errno.EPERM)
        return -1

    crossmem.pull, fetch.execute = pulled, read
    if damage == "refuse":
        crossmem.process_vm_readv = refused
    live = {k: torch.zeros_like(v) for k, v in replica_state(1).items()}
    got: list = []
    warned = WarningLines()
    logging.getLogger().addHandler(warned)

    def load() -> None:
        with open_replica_node(base, rank, live) as ck:
            got.append(ck.load())

    try:
        err = caught(load)
    finally:
        logging.getLogger().removeHandler(warned)
        crossmem.pull, fetch.execute, crossmem.process_vm_readv = pull, execute, readv
    out = {"untouched": all(not t.any() for t in live.values()), "pulls": [t for t, _ in pulls],
           "pulled": sum(n for _, n in pulls), "reads": reads, "warnings": warned.lines}
    if err:
        return {**out, "got": err}
    want = replica_state(got[0])
    return {**out, "got": [got[0], all(torch.equal(live[k].view(torch.int32), want[k].view(torch.int32))
                                       for k in want)]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("saved")
    run_ranks(2, save_protected_steps, str(base), out=base / "out")
    return base


@pytest.fixture()
def job(saved, tmp_path) -> Path:
    """A fresh copy of the saved roots (their ids travel with them), node 1 replaced by an empty root."""
    return copy_nodes(saved, tmp_path / "job", 2, replaced=(1,))


def test_chunks_are_pulled_while_their_reader_still_reads_and_land_bit_exact(job):
    """Rank 0 reads the whole state (its own files and rank 1's copy) and rank 1 pulls every
    byte of it from rank 0's memory, nothing over the process group: its first pull ends
    before rank 0's last read does (the pulls overlap the reads), and both ranks load the
    newest step bit exact."""
    out = run_ranks(2, load_pulled, str(job), "", out=job / "out")
    assert [x["got"] for x in out] == [[2, True]] * 2, out
    state = sum(v.nbytes for v in replica_state(2).values())
    assert out[1]["pulled"] == state and out[0]["pulled"] == 0, out
    assert min(out[1]["pulls"]) < max(out[0]["reads"]), out


def test_a_chunk_damaged_after_its_readers_check_is_caught_where_it_is_pulled(job):
    """Every chunk run pulled arrives with a flipped byte (the reader's own check passed): the
    puller's check of what landed fails the load on every rank with a typed error (the copies
    checked again, they are good, and the second attempt's pulls are damaged too), and no live
    tensor changed: never a silent wrong load."""
    out = run_ranks(2, load_pulled, str(job), "every", out=job / "out")
    for x in out:
        assert x["untouched"], x
        assert x["got"][0] in ("ChecksumMismatchError", "CorruptCheckpointError", "RankFailedError"), x
        assert "CollectiveFailedError" not in x["got"][1], x
    assert out[1]["got"][0] in ("ChecksumMismatchError", "CorruptCheckpointError") and \
        "received from rank 0" in out[1]["got"][1], out


def test_a_chunk_damaged_once_on_its_way_falls_back_to_the_checked_copy(job):
    """The first chunk run pulled arrives damaged: the load falls back (every rank's files and
    copies checked, then read again from the good copy) and both ranks load the newest step
    bit exact."""
    out = run_ranks(2, load_pulled, str(job), "first", out=job / "out")
    assert [x["got"] for x in out] == [[2, True]] * 2, out
    assert any("checking every rank's files and their copies" in w for w in out[1]["warnings"]), out


def test_a_refused_pull_sends_the_chunks_over_the_process_group(job):
    """process_vm_readv refused (EPERM, as a seccomp profile may): a warning, the pair's chunks
    go over the process group from then on, and both ranks load the newest step bit exact."""
    out = run_ranks(2, load_pulled, str(job), "refuse", out=job / "out")
    assert [x["got"] for x in out] == [[2, True]] * 2, out
    assert out[1]["pulled"] == 0 and any("over the process group instead" in w for w in out[1]["warnings"]), out


def test_pull_partners_are_the_ranks_of_a_part_that_share_its_domain():
    """Rank 0's pure rule: a rank pulls from (or is pulled from by) exactly the ranks of its own
    part's moves whose gathered crossmem domain is its own; a rank without one (cross memory
    off, or no process_vm_readv) has none, and neither has its partner for that pair."""
    from gdswriter.distributed.fetch import pull_partners

    asks = [{"cma": ["a", 100]}, {"cma": ["a", 101]}, {"cma": ["b", 102]}, {"cma": None}]
    moves = [[0, 0, 1, 5, 0, 0], [1, 0, 2, 5, 0, 0], [2, 0, 3, 5, 1, 0], [3, 1, 0, 6, 0, 1]]  # rank 0's part
    assert pull_partners(moves, asks, 0) == [[1, 101]]
    assert pull_partners([moves[0], moves[3]], asks, 1) == [[0, 100]]
    assert pull_partners([moves[1]], asks, 2) == []
    assert pull_partners([moves[2]], asks, 3) == []
