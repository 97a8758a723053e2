"""load(atomic=False) on real gloo ranks (distributed/load.py ``in_place_targets``): the bytes of
each plain CPU tensor are read, or received from the peer reading a lost node's copy, straight
into the live tensor, every chunk still checked against its crc32c where it lands; a bad copy
moves to the next one, and a copy damaged on every holder is the typed error (the live tensors
then partly written, as the error's hint says). Each rank its own host and node-local root,
replicas=2 saves of three 4 MiB tensors; and a holder set of more than LIVE_ITEMS_PER_SET small
tensors, which a non-atomic load pulls through the arena (transport.py ``addressable``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from support.ranks import caught, run_ranks
from support.roots import copy_nodes, open_replica_node, replica_state, save_protected_steps


def load_live(rank: int, world: int, base: str, atomic: bool, share: bool = True) -> dict:
    """Load the latest step with ``atomic`` into zeroed tensors: {"got": [step, bit exact, the
    storage pointers unchanged, last_load.atomic] or the error, "zeros": whether every live
    tensor is still all zeros}."""
    live = {k: torch.zeros_like(v) for k, v in replica_state(1).items()}
    before = {k: v.untyped_storage().data_ptr() for k, v in live.items()}
    got: list = []

    def load() -> None:
        with open_replica_node(base, rank, live, share) as ck:
            got.append(ck.load(atomic=atomic))
            got.append(ck.last_load.atomic)

    err = caught(load)
    zeros = all(not t.any() for t in live.values())
    if err:
        return {"got": err, "zeros": zeros}
    want = replica_state(got[0])
    exact = all(torch.equal(live[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
    same = all(live[k].untyped_storage().data_ptr() == p for k, p in before.items())
    return {"got": [got[0], exact, same, got[1]], "zeros": zeros}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("saved")
    run_ranks(2, save_protected_steps, str(base), out=base / "out")
    return base


@pytest.fixture()
def job(saved, tmp_path) -> Path:
    """A fresh copy of the saved roots (their ids travel with them) for one test to change."""
    return copy_nodes(saved, tmp_path / "job", 2)


def _replace_node(root: Path) -> None:
    shutil.rmtree(root)
    root.mkdir()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x40
    path.write_bytes(bytes(data))


def _data_file(root: Path, rank: int, copy: bool = False) -> Path:
    d = root / f"step_{2:012d}" / (f"copies/rank{rank:05d}" if copy else "")
    return next(d.glob(f"data-rank{rank}-*.bin"))


def test_non_atomic_load_from_peers_lands_bit_exact_in_the_live_tensors(job):
    """Node 1 replaced by an empty root: with atomic=False both ranks load step 2 bit exact into
    the very tensors they hold (the same storages before and after), rank 1's bytes received
    from rank 0, which reads its copy; last_load says the load was not atomic."""
    _replace_node(job / "n1")
    out = run_ranks(2, load_live, str(job), False, out=job / "out")
    assert [x["got"] for x in out] == [[2, True, True, False]] * 2, out


@pytest.mark.parametrize("share", [True, False], ids=["host-sharing", "process-group"])
def test_non_atomic_load_with_every_root_intact_is_bit_exact(job, share):
    """Every root intact: atomic=False loads bit exact, on both ranks, each piece read and then
    pulled through the ranks' memory, or received over the process group, straight into the
    live tensors."""
    out = run_ranks(2, load_live, str(job), False, share, out=job / "out")
    assert [x["got"] for x in out] == [[2, True, True, False]] * 2, out


def load_live_counting(rank: int, world: int, base: str, atomic: bool) -> dict:
    """load_live, noting the transport's kind and the fresh bytes it asked for (transport.host_buffer)."""
    from gdswriter.distributed import load as dload, transport

    fresh: list[int] = []
    kinds: list[str] = []
    made, carry = transport.host_buffer, dload.carry_out_own

    def counted(nbytes: int) -> torch.Tensor:
        fresh.append(nbytes)
        return made(nbytes)

    def noted(*args, **kw):
        kinds.append(args[5].kind)  # the transport
        return carry(*args, **kw)

    transport.host_buffer, dload.carry_out_own = counted, noted
    try:
        out = load_live(rank, world, base, atomic)
    finally:
        transport.host_buffer, dload.carry_out_own = made, carry
    return {**out, "kinds": kinds, "fresh": sum(fresh)}


def test_non_atomic_load_through_the_ranks_memory_reads_and_pulls_into_the_live_tensors(job):
    """Every root intact, the ranks pulling from each other's memory (cross memory): atomic=False
    reads each rank's pieces into its live tensors and pulls its peer's pieces from the peer's
    live tensors into its own, bit exact, with no fresh buffer (the atomic load reads into one)."""
    out = run_ranks(2, load_live_counting, str(job), False, out=job / "out")
    assert [x["got"] for x in out] == [[2, True, True, False]] * 2, out
    assert [(x["kinds"], x["fresh"]) for x in out] == [(["cma"], 0)] * 2, out
    atomic = run_ranks(2, load_live_counting, str(job), True, out=job / "out2")
    assert [x["got"] for x in atomic] == [[2, True, True, True]] * 2, atomic
    assert all(x["kinds"] == ["cma"] and x["fresh"] >= 3 * 4 * 2**20 for x in atomic), atomic


def test_atomic_load_of_a_copy_damaged_on_every_holder_leaves_the_live_tensors_as_they_were(job):
    """Node 1 replaced and its only copy damaged: the atomic load (the default) fails on every
    rank with a typed error, and every live tensor is still all zeros, on both ranks."""
    _replace_node(job / "n1")
    _flip(_data_file(job / "n0", 1, copy=True))
    out = run_ranks(2, load_live, str(job), True, out=job / "out")
    assert all(x["got"][0] in ("CorruptCheckpointError", "RankFailedError") and x["zeros"] for x in out), out


def test_non_atomic_load_moves_from_a_bad_file_to_its_copy(job):
    """A flipped byte in rank 1's own data file: the non-atomic load finds it, moves to the copy
    on rank 0's root and ends bit exact in the live tensors (the bad bytes it may have placed
    first are all read again from the good copy)."""
    _flip(_data_file(job / "n1", 1))
    out = run_ranks(2, load_live, str(job), False, out=job / "out")
    assert [x["got"] for x in out] == [[2, True, True, False]] * 2, out


def test_non_atomic_load_of_a_copy_damaged_on_every_holder_is_the_typed_error(job):
    """Node 1 replaced, and the only copy of its files (on node 0) has a flipped byte: the
    non-atomic load fails on every rank with a typed error (CorruptCheckpointError naming rank
    1's files), never a load of the bad bytes; an atomic load of the older step then restores them bit exact."""
    _replace_node(job / "n1")
    _flip(_data_file(job / "n0", 1, copy=True))
    out = run_ranks(2, load_live, str(job), False, out=job / "out")
    for x in out:
        assert x["got"][0] in ("CorruptCheckpointError", "RankFailedError"), x
    kind, msg = out[0]["got"]
    assert kind == "CorruptCheckpointError" and "no good copy of rank 1's files" in msg, out
    older = run_ranks(2, load_live_fallback, str(job), out=job / "out2")
    assert [x["got"][:2] for x in older] == [[1, True]] * 2, older


def load_live_fallback(rank: int, world: int, base: str) -> dict:
    """load(fallback=True) (atomic) into zeroed tensors: {"got": [step, bit exact]}."""
    live = {k: torch.zeros_like(v) for k, v in replica_state(1).items()}
    with open_replica_node(base, rank, live) as ck:
        step = ck.load(fallback=True)
    want = replica_state(step)
    return {"got": [step, all(torch.equal(live[k].view(torch.int32), want[k].view(torch.int32)) for k in want)]}


def many_small(step: int) -> dict:
    """LIVE_ITEMS_PER_SET + 16 tensors of 4 KiB, the same on every rank: one holder set larger
    than a live set may be (transport.py ``CrossMemoryTransport.addressable``)."""
    from gdswriter.distributed.transport import LIVE_ITEMS_PER_SET

    g = torch.Generator().manual_seed(900 + step)
    return {f"s{i:03d}": torch.randn(1024, generator=g) for i in range(LIVE_ITEMS_PER_SET + 16)}


def save_many_small(rank: int, world: int, base: str) -> None:
    """A run_ranks worker: step 1 of many_small, protected."""
    live = many_small(1)
    with open_replica_node(base, rank, live) as ck:
        ck.save(1)
        assert ck.wait_protected() == 1


def load_many_small(rank: int, world: int, base: str) -> dict:
    """load(atomic=False) of many_small into zeroed tensors: bit exact, the same storages, the
    transport's kind, the fresh bytes it asked for (transport.host_buffer) and the largest
    number of addresses this rank sent for one holder set (CrossMemoryTransport.address)."""
    from gdswriter.distributed import load as dload, transport

    live = {k: torch.zeros_like(v) for k, v in many_small(1).items()}
    before = {k: v.untyped_storage().data_ptr() for k, v in live.items()}
    fresh: list[int] = []
    kinds: list[str] = []
    sent: list[int] = []
    made, carry = transport.host_buffer, dload.carry_out_own

    def counted(nbytes: int) -> torch.Tensor:
        fresh.append(nbytes)
        return made(nbytes)

    def noted(*args, **kw):
        t = args[5]  # the transport
        kinds.append(t.kind)
        address = t.address

        def told():
            out = address()
            sent.extend(len(v) if isinstance(v, list) else 1 for v in (out or {}).values())
            return out

        t.address = told
        return carry(*args, **kw)

    transport.host_buffer, dload.carry_out_own = counted, noted
    try:
        with open_replica_node(base, rank, live) as ck:
            step = ck.load(atomic=False)
            atomic = ck.last_load.atomic
    finally:
        transport.host_buffer, dload.carry_out_own = made, carry
    want = many_small(step)
    exact = all(torch.equal(live[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
    same = all(live[k].untyped_storage().data_ptr() == p for k, p in before.items())
    return {"got": [step, exact, same, atomic], "kinds": kinds, "fresh": sum(fresh), "sent": max(sent, default=0),
            "set": sum(v.nbytes for v in want.values())}


def test_non_atomic_load_of_a_large_holder_set_pulls_it_through_the_arena(tmp_path):
    """LIVE_ITEMS_PER_SET + 16 small tensors every rank holds, the ranks pulling from each
    other's memory: atomic=False restores them bit exact into the very live tensors, but the
    set is too large to send one address per item (what rank 0 gathers would grow with the
    state), so it is read and pulled through the arena (fresh bytes for the whole set) and each
    rank sends one address for it, then copies into the live tensors."""
    from gdswriter.distributed.transport import LIVE_ITEMS_PER_SET

    run_ranks(2, save_many_small, str(tmp_path), out=tmp_path / "out")
    out = run_ranks(2, load_many_small, str(tmp_path), out=tmp_path / "out2")
    assert [x["got"] for x in out] == [[1, True, True, False]] * 2, out
    assert all(x["kinds"] == ["cma"] for x in out), out
    assert all(x["fresh"] >= x["set"] for x in out), out
    assert all(1 <= x["sent"] <= LIVE_ITEMS_PER_SET for x in out), out
