"""Checkpoints that cost a rank the same whatever the world size (issue: scale to 16,384 ranks).

On real gloo ranks: what each rank receives in a save's collectives is flat from 2 to 8
ranks; 4 ranks loading replicated state read its bytes from disk once in total. In one
process: the pure parts (split_stream, the holder-set pieces, the shard and global manifest
formats with their hostile variants, the vote's checks, the plan cache).
"""

from __future__ import annotations

import collections
import json
import random

import pytest
import torch

from gdswriter.distributed import crossmem, hostshare
from gdswriter.errors import CorruptCheckpointError, RankFailedError
from gdswriter.format.manifest import ChunkRecord, FileRecord, RootInfo, TensorRecord
from gdswriter.format.sharded import (GlobalManifest, ItemRecord, RankShard, ShardRef, check_shard_bytes, merge,
                                      parse_global)
from gdswriter.planner.ranks import split_stream
from support.ranks import run_ranks

MiB = 1 << 20


def _options():
    from support.models import small_options

    return small_options()


def _dist_options():
    from gdswriter.distributed import DistOptions

    return DistOptions(replicated=("model", "optimizer"), timeout_s=60)


def _replicated_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))  # ~4 MiB of fp32


# ----------------------------------------------------------------------------- bytes received per rank
def _count_received(coord) -> collections.Counter:
    """Wrap ``coord``'s collectives (private: the instance's methods) to count the bytes this
    rank receives in each, by the collective's name."""
    received: collections.Counter = collections.Counter()

    def counted(name):
        plain = getattr(coord, name)

        def run(*args, **kwargs):
            before = coord.stats.received
            try:
                return plain(*args, **kwargs)
            finally:
                received[args[1]] += coord.stats.received - before
        return run

    for name in ("all_gather", "gather", "broadcast", "scatter"):
        setattr(coord, name, counted(name))
    return received


def _traffic_worker(rank: int, world: int, root: str) -> dict:
    from gdswriter import GDSCheckpointer

    model = _replicated_model()
    mine = {"count": torch.full((3 * MiB // 4,), float(rank))}  # rank-local, above the small-copy threshold
    with GDSCheckpointer(model, root=root, state={"mine": mine}, options=_options(),
                         dist_options=_dist_options()) as ck:
        coord = ck.session.coord
        stats = coord.stats
        ck.save(1)  # the first save plans; the next ones reuse the plan
        before = stats.snapshot()
        ck.save(2)
        after = stats.snapshot()
        received = _count_received(coord)
        plain_domain = crossmem.domain  # hosts of two ranks each, pulling from each other's memory
        crossmem.domain = lambda: f"{plain_domain()}:host{rank // 2}"  # private: the process domain
        ck.load(2)
        loaded = stats.snapshot()
        hits = ck.session.plans.hits
    return {"save": [a - b for a, b in zip(after, before)], "load": [a - b for a, b in zip(loaded, after)],
            "hits": hits, "load_by_name": dict(received)}


@pytest.mark.slow
def test_what_a_rank_receives_in_a_save_is_flat_from_two_to_eight_ranks(tmp_path):
    """A typical rank's save receives the same bytes in the same number of collectives at 2, 4
    and 8 ranks (the old plan all-gathered every rank's item list: it grew with the world);
    rank 0 receives a small entry per rank. A load receives the replicated pieces other ranks
    read, and the global manifest: a short entry per rank, no records."""
    got = {w: run_ranks(w, _traffic_worker, str(tmp_path / f"w{w}"), out=tmp_path / f"r{w}") for w in (2, 4, 8)}
    typical = {w: res[1]["save"] for w, res in got.items()}  # [sent, received, collectives] of rank 1
    assert all(x["hits"] == 1 for res in got.values() for x in res), "the second save reused the first's plan"
    assert len({t[2] for t in typical.values()}) == 1, typical  # the same collectives
    received = [t[1] for t in typical.values()]
    assert max(received) - min(received) <= 64, typical  # flat: digits in the messages aside
    assert max(received) <= 4096, typical
    sent = [t[0] for t in typical.values()]
    assert max(sent) <= 4096, typical
    for w, res in got.items():  # the primary receives O(W) small entries, nothing per tensor
        assert res[0]["save"][1] <= 1024 * w, (w, res[0]["save"])
        assert len({tuple(x["save"]) for x in res[1:]}) <= 2, res  # ranks 1..W-1 alike
    model = sum(v.numel() * v.element_size() for v in _replicated_model().state_dict().values())
    for w, res in got.items():  # a load: the replicated pieces it did not read itself, the global manifest
        assert res[1]["load"][1] <= model + 8192 + 200 * w, (w, res[1]["load"], model)
    # the load's decisions, the global manifest (a short entry per rank) aside: flat, on every typical
    # rank (the ranks of each two-rank host pull from each other's memory: a rank learns its own
    # host's addresses only, where it received every rank's)
    deciding = {w: [sum(n for what, n in x["load_by_name"].items() if not what.endswith("(manifest)"))
                    for x in res[1:]] for w, res in got.items()}
    flat = [n for ns in deciding.values() for n in ns]
    assert max(flat) - min(flat) <= 96 and max(flat) <= 4096, deciding  # digits in the messages aside


def _open_traffic_worker(rank: int, world: int, base: str) -> dict:
    from pathlib import Path

    import torch.distributed as dist

    from gdswriter import GDSCheckpointer

    model = _replicated_model()
    mine = {"count": torch.full((3 * MiB // 4,), float(rank))}
    root = Path(base, f"rank{rank}")  # every rank its own disk: the table holds W roots
    with GDSCheckpointer(model, root=root, state={"mine": mine}, options=_options(),
                         dist_options=_dist_options()) as ck:
        coord = ck.session.coord
        opened = coord.stats.snapshot()  # creating the channel and opening the roots
        received = _count_received(coord)
        ck.save(1)
        ck.save(2)
        dist.barrier()
        if rank == 1:  # damage rank 1's data of step 2 (only rank 1 reads its own disk)
            for f in (root / "step_000000000002").glob("data-*.bin"):
                data = bytearray(f.read_bytes())
                for k in range(0, len(data), 64 * 1024):
                    data[k] ^= 0xFF
                f.write_bytes(data)
        dist.barrier()
        step = ck.load(fallback=True)
        damaged = list(ck.last_load.damaged)
    deciding = sum(n for what, n in received.items() if "fall back" in what)
    return {"open": list(opened), "deciding": deciding, "step": step, "damaged": damaged}


@pytest.mark.slow
def test_what_a_rank_receives_opening_the_roots_and_falling_back_is_flat_from_two_to_eight_ranks(tmp_path):
    """Every rank on its own disk (W roots): opening a GDSCheckpointer (the channel, the root
    table, the primary's choice) and a load(fallback=True)'s decision to pass over a damaged
    step cost a typical rank the same bytes at 2, 4 and 8 ranks (before: the roots, the probes
    and the verdicts were all-gathered, W entries to every rank). Rank 0 receives a small entry
    per rank."""
    got = {w: run_ranks(w, _open_traffic_worker, str(tmp_path / f"w{w}"), out=tmp_path / f"r{w}")
           for w in (2, 4, 8)}
    for w, res in got.items():
        assert all(x["step"] == 1 and x["damaged"] == [2] for x in res), (w, res)
    for key in ("open", "deciding"):
        typical = {w: [x[key][1] if key == "open" else x[key] for x in res[1:]] for w, res in got.items()}
        flat = [n for ns in typical.values() for n in ns]
        assert max(flat) - min(flat) <= 64 and max(flat) <= 4096, (key, typical)  # digits aside
    opened = {w: res[1]["open"] for w, res in got.items()}
    assert len({o[2] for o in opened.values()}) == 1, opened  # the same collectives
    for w, res in got.items():
        assert res[0]["open"][1] <= 1024 * w, (w, res[0]["open"])


# ----------------------------------------------------------------------------- replicated state read once
def _read_once_worker(rank: int, world: int, root: str, share: str | list | None, cma: bool = False,
                      refuse: tuple[int, str] | None = None, slow: bool = False) -> dict:
    """``share``: the tmpfs to share the load through, or one per host (a list: hosts of
    consecutive ranks; with ``cma`` each also its own process domain). ``cma``: pull from the
    peers' memory (DistOptions.load_cross_memory). ``refuse``: (rank, "probe" or "pull"): that
    rank's process_vm_readv fails with EPERM (every call, or only the pieces' copies). ``slow``:
    rank 1 starts copying its pieces a second late, while rank 0, once its load returns, frees
    its buffers and fills fresh ones with 0xFF."""
    import ctypes
    import errno
    import time
    from dataclasses import replace

    from gdswriter.distributed import crossmem
    from gdswriter.distributed import load as dist_load

    hosts = isinstance(share, list)
    if hosts:
        share = share[rank * len(share) // world]
        plain_domain = crossmem.domain
        crossmem.domain = lambda: f"{plain_domain()}:{share}"  # private: one process domain per "host"
    if refuse is not None and refuse[0] == rank:
        plain_readv = crossmem.process_vm_readv

        def refusing(pid, local, nlocal, remote, nremote, flags):
            if refuse[1] == "probe" or sum(remote[i].iov_len for i in range(nremote)) > len(crossmem.MAGIC):
                ctypes.set_errno(errno.EPERM)
                return -1
            return plain_readv(pid, local, nlocal, remote, nremote, flags)

        crossmem.process_vm_readv = refusing
    pulled = [0]
    plain_pull = crossmem.pull

    def counting_pull(pid, moves, what="copying a peer rank's pieces"):
        if slow and rank == 1 and what.startswith("copying"):
            time.sleep(1.0)
        n = plain_pull(pid, moves, what)
        if what.startswith("copying"):
            pulled[0] += n
        return n

    crossmem.pull = counting_pull  # private: counts the bytes pulled from peers
    opened = [0]
    plain_open = dist_load._open_shared

    def counting_open(*args):
        opened[0] += 1
        return plain_open(*args)

    dist_load._open_shared = counting_open  # private: counts tmpfs set-ups

    from gdswriter import GDSCheckpointer

    model = _replicated_model(seed=1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with GDSCheckpointer(model, root=root, options=_options(),
                         dist_options=replace(_dist_options(), load_share_dir=share, load_cross_memory=cma)) as ck:
        ck.save(1)
        for p in model.parameters():
            p.data.zero_()
        engine = ck.engines[0]
        read = [0]
        plain = engine.read_file

        def counting(path, spans):  # counts what this rank reads from disk
            read[0] += sum(s.out.numel() for s in spans)
            return plain(path, spans)

        engine.read_file = counting  # private: wraps the engine instance's method
        stats = ck.session.coord.stats
        before = stats.snapshot()
        ck.load(1)
        received = stats.snapshot()[1] - before[1]
        if slow and rank == 0:  # its read buffers are gone: their addresses may now hold other bytes
            from gdswriter.load.reader import host_buffer

            junk = [host_buffer(sum(v.numel() * v.element_size() for v in want.values())).fill_(0xFF)
                    for _ in range(4)]
            del junk
    diff = [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])]
    return {"read": read[0], "diff": diff, "nbytes": sum(v.numel() * v.element_size() for v in want.values()),
            "received": received, "pulled": pulled[0], "opened": opened[0]}


@pytest.mark.parametrize("share,cma", [("/dev/shm", True), ("/dev/shm", False), (None, False)],
                         ids=["cross-memory", "shared-on-the-host", "over-the-process-group"])
def test_four_ranks_loading_replicated_state_read_its_bytes_once(tmp_path, share, cma):
    """Each rank reads the pieces it wrote; on one host each pulls the rest from its peers'
    memory (distributed/crossmem.py: nothing travels, no tmpfs file), or they meet in a tmpfs
    file (distributed/hostshare.py), else they travel over gloo: 3/4 of the model to each."""
    if share is not None and hostshare.domain(share) is None:
        pytest.skip(f"{share} is not a writable tmpfs here")
    if cma and crossmem.domain() is None:
        pytest.skip("no process_vm_readv here")
    before = _shared_files(share)
    res = run_ranks(4, _read_once_worker, str(tmp_path / "shared"), share, cma, out=tmp_path / "ranks")
    assert all(x["diff"] == [] for x in res), res
    total = sum(x["read"] for x in res)
    nbytes = res[0]["nbytes"]
    assert nbytes <= total <= nbytes + 4 * 64 * 1024, (total, nbytes)  # once (alignment aside), not 4 times
    assert sum(1 for x in res if x["read"]) >= 3, res  # and by several ranks
    received = [x["received"] for x in res]
    if share is None:
        assert all(r >= nbytes // 2 for r in received), (received, nbytes)
    else:
        assert all(r < 64 * 1024 for r in received), (received, nbytes)  # only the coordination's messages
        assert _shared_files(share) == before  # every name was unlinked
    if cma:  # each rank copied from its peers what it did not read, and made no tmpfs file
        assert all(x["read"] + x["pulled"] == nbytes and x["opened"] == 0 for x in res), (res, nbytes)
    else:
        assert all(x["pulled"] == 0 for x in res), res


def test_a_rank_pulling_late_gets_every_byte_though_its_peer_returns_at_once(tmp_path):
    """Rank 1 copies its pieces from rank 0's memory a second late; rank 0's load returns only
    once every rank has pulled (then it frees its buffers and reuses the memory): rank 1's
    load is still bit-exact."""
    if crossmem.domain() is None:
        pytest.skip("no process_vm_readv here")
    res = run_ranks(2, _read_once_worker, str(tmp_path / "shared"), hostshare.DEFAULT_DIR, True, None, True,
                    out=tmp_path / "ranks")
    assert all(x["diff"] == [] and x["pulled"] > 0 and x["received"] < 64 * 1024 for x in res), res


@pytest.mark.parametrize("refused", ["probe", "pull"])
def test_a_rank_refused_reading_its_peers_memory_makes_every_rank_share_another_way(tmp_path, refused):
    """Rank 1's process_vm_readv fails with EPERM (as under a seccomp profile that forbids it):
    refused at the probe, before any byte is read, every rank shares through the tmpfs as it
    would without cross memory; refused only when copying the pieces, every rank sends them
    over the process group instead. Either way no rank raises, and the load is bit-exact."""
    if hostshare.domain(hostshare.DEFAULT_DIR) is None or crossmem.domain() is None:
        pytest.skip("needs a writable tmpfs and process_vm_readv")
    before = _shared_files(hostshare.DEFAULT_DIR)
    res = run_ranks(2, _read_once_worker, str(tmp_path / "shared"), hostshare.DEFAULT_DIR, True, (1, refused),
                    out=tmp_path / "ranks")
    assert all(x["diff"] == [] for x in res), res
    nbytes = res[0]["nbytes"]
    if refused == "probe":  # today's tmpfs path on every rank: nothing over the process group
        assert all(x["opened"] == 1 and x["pulled"] == 0 and x["received"] < 64 * 1024 for x in res), res
    else:  # rank 0 pulled, rank 1 could not: both ranks' pieces went over gloo
        assert all(x["opened"] == 0 and x["received"] >= nbytes // 4 for x in res), res
    assert _shared_files(hostshare.DEFAULT_DIR) == before


def _replica_group_worker(rank: int, world: int, root: str, hosts: int, within: bool, refuse: bool = False) -> dict:
    """A 2-D mesh DTensor, Shard over tp and Replicate over dp: each 2 MiB block is held by the
    replica group of its tp index (ranks r and r + world / 2, or with ``within`` ranks 2k and
    2k + 1), and 1 MiB every rank holds; on one host, or on ``hosts`` (consecutive ranks; no
    tmpfs). ``refuse``: rank 1's copies from its peers' memory fail with EPERM (its probe
    passes)."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gdswriter import GDSCheckpointer

    pulled = [0]
    plain_pull = crossmem.pull

    def counting_pull(pid, moves, what="copying a peer rank's pieces"):
        n = plain_pull(pid, moves, what)
        pulled[0] += n if what.startswith("copying") else 0
        return n

    crossmem.pull = counting_pull  # private: counts the bytes pulled from peers
    if refuse and rank == 1:
        import ctypes
        import errno

        plain_readv = crossmem.process_vm_readv

        def refusing(pid, local, nlocal, remote, nremote, flags):
            if sum(remote[i].iov_len for i in range(nremote)) > len(crossmem.MAGIC):
                ctypes.set_errno(errno.EPERM)
                return -1
            return plain_readv(pid, local, nlocal, remote, nremote, flags)

        crossmem.process_vm_readv = refusing
    if hosts > 1:
        plain_domain = crossmem.domain
        crossmem.domain = lambda: f"{plain_domain()}:host{rank * hosts // world}"  # private: the process domain
    full = torch.arange(512 * 1024 * world // 2, dtype=torch.float32).reshape(512, -1)
    if within:  # rank = 2 tp + dp: a block's replicas are neighbours
        w = distribute_tensor(full, init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("tp", "dp")),
                              [Shard(1), Replicate()])
    else:  # rank = (world / 2) dp + tp
        w = distribute_tensor(full, init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")),
                              [Replicate(), Shard(1)])
    every = torch.arange(MiB // 4, dtype=torch.float32)
    want, want_every = w.to_local().clone(), every.clone()
    options = replace(_dist_options(), replicated=("extra",), load_share_dir="/dev/shm" if hosts == 1 else None)
    with GDSCheckpointer(root=root, state={"tp": {"w": w}, "every": {"t": every}}, options=_options(),
                         dist_options=options) as ck:
        ck.save(1)
        w.to_local().zero_()
        every.zero_()
        stats = ck.session.coord.stats
        before = stats.snapshot()
        ck.load(1)
        received = stats.snapshot()[1] - before[1]
    return {"same": torch.equal(w.to_local(), want) and torch.equal(every, want_every),
            "nbytes": want.numel() * want.element_size(), "received": received, "pulled": pulled[0]}


@pytest.mark.parametrize("hosts,within", [(1, False), (2, True), (2, False)],
                         ids=["one-host", "replicas-on-one-host", "replicas-on-two-hosts"])
def test_a_replica_group_on_one_host_pulls_its_blocks_from_each_others_memory(tmp_path, hosts, within):
    """HSDP-like state (4 ranks, each DTensor block held by two, and state every rank holds).
    Where a block's replicas are on one host, each reads the half of the block it wrote and
    copies the other half from its replica's memory: none of it travels over the process group
    (before, replica groups' blocks travelled over gloo whenever cross memory was on). On two
    hosts (ranks 0-1 and 2-3) with a block's replicas on different hosts, its halves cross over
    the process group. The state every rank holds is copied within each host, a piece crossing
    to the other host once."""
    if crossmem.domain() is None:
        pytest.skip("no process_vm_readv here")
    res = run_ranks(4, _replica_group_worker, str(tmp_path / "shared"), hosts, within, out=tmp_path / "ranks")
    nbytes, every, coordination = res[0]["nbytes"], MiB, 64 * 1024
    assert all(x["same"] for x in res), res
    if hosts == 1:  # each pulls half its block and 3/4 of the state every rank holds
        assert all(x["received"] < coordination for x in res), (res, nbytes)
        assert sum(x["pulled"] for x in res) == 2 * nbytes + 3 * every, (res, nbytes)
    elif within:  # half its block pulled; of the state every rank holds 1/4 from the other host, 1/2 pulled
        assert all(every // 4 <= x["received"] < every // 4 + coordination for x in res), (res, nbytes)
        assert sum(x["pulled"] for x in res) == 2 * nbytes + 2 * every, (res, nbytes)
    else:  # half its block over gloo
        assert all(nbytes // 2 <= x["received"] < nbytes // 2 + every // 4 + coordination for x in res), res
        assert sum(x["pulled"] for x in res) == 2 * every, (res, nbytes)



def test_a_replica_group_whose_copy_from_memory_fails_gets_its_blocks_over_the_process_group(tmp_path):
    """Rank 1 may probe its peers' memory but not copy from it: every rank sends the pieces of
    the items it would have pulled (its replica group's blocks, the state every rank holds)
    over the process group instead, and the load is still bit-exact."""
    if crossmem.domain() is None:
        pytest.skip("no process_vm_readv here")
    res = run_ranks(4, _replica_group_worker, str(tmp_path / "shared"), 1, False, True, out=tmp_path / "ranks")
    nbytes = res[0]["nbytes"]
    assert all(x["same"] for x in res), res
    assert res[1]["pulled"] == 0 and all(x["received"] >= nbytes // 2 for x in res), (res, nbytes)

def _mount_tmpfs(path, size: str) -> bool:
    import subprocess

    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _umount(*paths) -> None:
    import subprocess

    for p in paths:
        subprocess.run(["umount", str(p)], check=False)


@pytest.mark.parametrize("cma", [False, True], ids=["tmpfs", "cross-memory"])
def test_two_hosts_sharing_a_load_send_each_piece_across_once(tmp_path, cma):
    """Two "hosts" of two ranks each (two tmpfs instances, so two sharing domains; with cross
    memory, two process domains): the ranks of a host share what they read, and each piece
    crosses to the other host once, so a rank receives about a quarter of the model instead of
    three quarters."""
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    if not (_mount_tmpfs(hosts[0], "64m") and _mount_tmpfs(hosts[1], "64m")):
        _umount(*hosts)
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        res = run_ranks(4, _read_once_worker, str(tmp_path / "shared"), [str(h) for h in hosts], cma,
                        out=tmp_path / "ranks")
        left = [p.name for h in hosts for p in h.iterdir()]
    finally:
        _umount(*hosts)
    assert all(x["diff"] == [] for x in res), res
    nbytes = res[0]["nbytes"]
    assert nbytes <= sum(x["read"] for x in res) <= nbytes + 4 * 64 * 1024, res
    received = [x["received"] for x in res]
    assert all(nbytes // 8 <= r <= nbytes // 4 + 256 * 1024 for r in received), (received, nbytes)
    assert left == []
    if cma:  # within a host, the rest came from the peer's memory
        assert all(x["read"] + x["received"] + x["pulled"] >= nbytes and x["pulled"] >= nbytes // 4
                   and x["opened"] == 0 for x in res), res


def test_ranks_on_hosts_of_equal_consecutive_blocks_share_else_none():
    from gdswriter.distributed.load import host_blocks, relay_between_hosts

    assert host_blocks(["a"] * 4) == 4
    assert host_blocks(["a", "a", "b", "b", "c", "c"]) == 2
    assert host_blocks(["a", "b", "a", "b"]) is None  # not consecutive
    assert host_blocks(["a", "a", "b"]) is None  # unequal
    assert host_blocks(["a", "a", "b", "b", "a", "a"]) is None  # a host twice
    assert host_blocks(["a", "b"]) is None  # one rank per host: nothing to share
    assert host_blocks(["a", None]) is None
    # every other host receives each piece exactly once, from one sender per round
    world, block = 24, 4
    for writer in range(world):
        got: dict[int, int] = {}
        for rank in range(world):
            for _k, a, b in relay_between_hosts(writer, rank, world, block):
                if b == rank:
                    got[b] = got.get(b, 0) + 1
                    assert a % block == b % block == writer % block
        assert sorted(r // block for r in got) == [h for h in range(world // block) if h != writer // block]
        assert set(got.values()) == {1}


def _shared_files(share: str | None) -> set[str]:
    from pathlib import Path

    return set() if share is None else {p.name for p in Path(share).glob(f"{hostshare.PREFIX}*")}


def _damaged_worker(rank: int, world: int, root: str) -> dict:
    from dataclasses import replace
    from pathlib import Path

    from gdswriter import GDSCheckpointer
    from support.ranks import caught

    model = _replicated_model(seed=4)
    dist_options = replace(_dist_options(), load_cross_memory=False)  # the tmpfs path, which makes files
    with GDSCheckpointer(model, root=root, options=_options(), dist_options=dist_options) as ck:
        ck.save(1)
        torch.distributed.barrier()
        if rank == 1:  # rank 1's data file loses its tail: only rank 1's check fails
            data = sorted((Path(root) / ck.protocol.step_dir(1).name).glob("data-rank1-*"))[0]
            with open(data, "r+b") as f:
                f.truncate(data.stat().st_size // 2)
        torch.distributed.barrier()
        raised = caught(lambda: ck.load(1))
    return {"raised": raised}


def test_a_load_refused_on_one_rank_leaves_no_shared_files(tmp_path):
    """Rank 0 reserves the shared files before the agreement that rank 1's truncated data file
    fails: it must still unlink them."""
    if hostshare.domain(hostshare.DEFAULT_DIR) is None:
        pytest.skip("/dev/shm is not a writable tmpfs here")
    before = _shared_files(hostshare.DEFAULT_DIR)
    res = run_ranks(2, _damaged_worker, str(tmp_path / "shared"), out=tmp_path / "ranks")
    assert all(x["raised"] is not None for x in res), res
    assert _shared_files(hostshare.DEFAULT_DIR) == before


# ----------------------------------------------------------------------------- what shared memory must not do
def _alias_worker(rank: int, world: int, root: str, cma: bool) -> dict:
    from dataclasses import replace

    from gdswriter import GDSCheckpointer

    model = _replicated_model(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    with GDSCheckpointer(model, opt, root=root, options=_options(), dist_options=_dist_options()) as ck:
        ck.save(1)
        want = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)  # no state yet: the loaded tensors become its state
    with GDSCheckpointer(model, fresh, root=root, options=_options(),
                         dist_options=replace(_dist_options(), load_cross_memory=cma)) as ck:
        ck.load(1)
        torch.distributed.barrier()
        state = fresh.state[next(iter(model.parameters()))]
        if rank == 0:  # rank 0 trains on: its state changes in place
            state["exp_avg"].add_(1.0)
            state["exp_avg_sq"].mul_(3.0)
        torch.distributed.barrier()
        same = {k: bool(torch.equal(v, want[k])) for k, v in state.items()}
    return {"same": same}


@pytest.mark.parametrize("cma", [False, True], ids=["tmpfs", "cross-memory"])
def test_a_rank_writing_into_a_loaded_state_changes_no_other_ranks(tmp_path, cma):
    """Ranks on one host read replicated state into shared memory, or pull it from each other's;
    the tensors each rank gets must still be its own (torch's optimizer adopts loaded tensors
    without a copy)."""
    if hostshare.domain(hostshare.DEFAULT_DIR) is None:
        pytest.skip("/dev/shm is not a writable tmpfs here")
    res = run_ranks(2, _alias_worker, str(tmp_path / "shared"), cma, out=tmp_path / "ranks")
    assert res[0]["same"]["exp_avg"] is False and res[0]["same"]["exp_avg_sq"] is False, res
    assert all(res[1]["same"].values()), res  # rank 1 still holds what was saved


def test_a_tmpfs_too_small_to_share_a_load_falls_back_to_the_process_group(tmp_path):
    """posix_fallocate refuses the reservation (ENOSPC) before any byte is read: every rank then
    passes the pieces over gloo, and the load is still bit-exact."""
    small = tmp_path / "small-shm"
    if not _mount_tmpfs(small, "256k"):
        _umount(small)
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        res = run_ranks(2, _read_once_worker, str(tmp_path / "shared"), str(small), out=tmp_path / "ranks")
    finally:
        _umount(small)
    assert all(x["diff"] == [] for x in res), res
    assert all(x["received"] >= res[0]["nbytes"] // 4 for x in res), res  # the pieces went over gloo


def test_shared_load_files_are_named_per_host_and_stale_ones_are_cleaned(tmp_path):
    import time

    assert hostshare.domain(None) is None
    assert hostshare.domain(str(tmp_path)) is None  # ext4 (or whatever tmp is), not a tmpfs: no sharing
    shm = hostshare.domain(hostshare.DEFAULT_DIR)
    if shm is not None:
        assert shm == hostshare.domain(hostshare.DEFAULT_DIR + "/")
    old = tmp_path / f"{hostshare.PREFIX}{int(time.time()) - 2 * 86400:x}-abcd-x"
    new = tmp_path / f"{hostshare.PREFIX}{int(time.time()):x}-abcd-x"
    other = tmp_path / "not-ours"
    for p in (old, new, other):
        p.write_bytes(b"x")
    assert hostshare.clean_stale(str(tmp_path)) == 1
    assert not old.exists() and new.exists() and other.exists()


# ----------------------------------------------------------------------------- replicated state that is not
def _mismatch_worker(rank: int, world: int, root: str) -> dict:
    from gdswriter import GDSCheckpointer
    from support.ranks import caught

    model = _replicated_model()
    with GDSCheckpointer(model, root=root, options=_options(), dist_options=_dist_options()) as ck:
        ck.save(1)
        if rank == 1:  # rank 1's "replicated" model grows a layer: the ranks no longer hold the same state
            model.append(torch.nn.Linear(512, 8))
        raised = caught(lambda: ck.save(2))
        return {"raised": raised, "steps": ck.steps()}


def test_ranks_holding_different_replicated_state_commit_nothing(tmp_path):
    """Each rank plans its share of the replicated state from its own copy: if the copies differ
    in structure, the pieces would not add up. The vote compares a digest per holder set, and
    every rank refuses the step."""
    res = run_ranks(2, _mismatch_worker, str(tmp_path / "shared"), out=tmp_path / "ranks")
    for x in res:
        assert x["raised"] is not None and x["raised"][0] == "RankFailedError", x
        assert "replicated" in x["raised"][1] and "nothing was committed" in x["raised"][1], x
        assert x["steps"] == [1], x


# ----------------------------------------------------------------------------- the format's recipe
def _recipe_worker(rank: int, world: int, root: str) -> dict:
    from gdswriter import GDSCheckpointer

    model = _replicated_model(seed=2)
    mine = {"count": torch.full((300_000,), float(rank))}
    with GDSCheckpointer(model, root=root, state={"mine": mine}, options=_options(),
                         dist_options=_dist_options()) as ck:
        ck.save(4)
    return {}


def test_the_format_docs_recipe_reads_a_sharded_two_rank_step(tmp_path):
    """docs/format.md section 8's recipe (without gdswriter) reads rank 0's part of a 1.3 step,
    the replicated model's pieces coming from both ranks' files, equal to what load_state reads."""
    import re
    from pathlib import Path

    import numpy as np

    from gdswriter.distributed import load_state

    root = tmp_path / "shared"
    run_ranks(2, _recipe_worker, str(root), out=tmp_path / "ranks")
    text = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    section = text[text.index("## 8. Reading a checkpoint without gdswriter"):text.index("## 9.")]
    ns: dict = {}
    for code in re.findall(r"```python\n(.*?)```", section, re.S):
        exec(compile(code, "docs/format.md", "exec"), ns)
    step, state, manifest = ns["read_checkpoint"]([str(root)])
    assert step == 4 and manifest["version"] == [1, 3]
    _, ref = load_state(root)

    def arrays(tree, path=""):
        if isinstance(tree, dict):
            for k, v in tree.items():
                yield from arrays(v, f"{path}/{k}")
        elif isinstance(tree, (torch.Tensor, np.ndarray)):
            yield path, np.asarray(tree)

    got, want = dict(arrays(state)), dict(arrays(ref))
    assert sorted(got) == sorted(want) and len(want) >= 5, (sorted(got), sorted(want))
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    assert any(k.endswith("count") and (got[k] == 0.0).all() and got[k].size == 300_000 for k in got), "rank 0's own"
    m = json.loads((root / "step_000000000004" / "manifest.json").read_text())
    rank1 = json.loads((root / "step_000000000004" / m["shards"][1][1]).read_text())
    assert any(c[4] for c in rank1["chunks"] if rank1["items"][c[0]][0].startswith("R")), \
        "rank 1 wrote part of the replicated model: the recipe took pieces from both ranks' shards"


# ----------------------------------------------------------------------------- the pure parts
def test_split_stream_covers_every_item_once_on_aligned_cuts_and_balances():
    rng = random.Random(7)
    for _ in range(500):
        sizes = [rng.choice([0, 1, 4095, 4096, 5000, MiB, 3 * MiB, rng.randrange(8 * MiB)])
                 for _ in range(rng.randrange(1, 12))]
        holders = rng.randrange(1, 9)
        split = split_stream(sizes, holders, rng.randrange(1000))
        load = [0] * holders
        for n, pieces in zip(sizes, split):
            pos = 0
            for h, off, length in pieces:
                assert off == pos and off % 4096 == 0 and 0 <= h < holders
                pos += length
                load[h] += length
            assert pos == n
        share = max(-(-sum(sizes) // holders), 256 << 10)
        assert max(load) <= -(-share // 4096) * 4096 + 4096, (sizes, holders, load)


def _shard(rank: int = 0, world: int = 2, chunks=None, items=None, tensors=None) -> RankShard:
    items = items or (ItemRecord("R" + "a" * 32, 8192, None),)
    chunks = chunks if chunks is not None else ((ChunkRecord(0, 0, 4096 * rank, 4096, 0),),)
    tensors = tensors or (TensorRecord("model/w", 0, 0, "float32", (2048,), (1,)),)
    files = (FileRecord(0, f"data-rank{rank}-r0-f0.bin", 8192, {"rank": rank}),)
    tree = {"$dict": [["model", {"$dict": [["w", {"$tensor": 0}]]}]]}
    return RankShard(1, rank, world, files, items, chunks, tensors, tree)


def _global(shards) -> GlobalManifest:
    refs = [ShardRef(s.rank, 0, f"manifest-rank{s.rank:05d}.json", len(s.to_json_bytes()), 0) for s in shards]
    return GlobalManifest.new(1, len(shards), [RootInfo("x" * 32, "/r", tuple(range(len(shards))))], refs, {}, {})


def test_shards_round_trip_and_merge_into_the_whole_step():
    shards = [_shard(0), _shard(1)]
    for s in shards:
        back = RankShard.from_json_bytes(s.to_json_bytes(), where="t", step=1, rank=s.rank, world_size=2, n_roots=1)
        assert back == s
    g = _global(shards)
    assert parse_global(g.to_json_bytes(), "t") == g
    m = merge(g, shards)
    assert [len(s.chunks) for s in m.storages] == [2] and [t.name for t in m.tensors] == ["model/w"]
    assert m.version == (1, 3) and m.dist.world_size == 2


HOSTILE_TABLES = {
    # the shard table: [root, file name, size, crc32c] per rank
    "shard-root-past-table": lambda b: b["shards"][1].__setitem__(0, 1),
    "shard-size-bool": lambda b: b["shards"][1].__setitem__(2, True),
    "shard-size-negative": lambda b: b["shards"][1].__setitem__(2, -1),
    "shard-size-float": lambda b: b["shards"][1].__setitem__(2, 1.0),
    "shard-crc-past-32-bits": lambda b: b["shards"][1].__setitem__(3, 1 << 32),
    "shard-name-in-a-directory": lambda b: b["shards"][1].__setitem__(1, "../manifest-rank00001.json"),
    "shard-name-backslash": lambda b: b["shards"][1].__setitem__(1, "a\\b.json"),
    "shard-name-nul": lambda b: b["shards"][1].__setitem__(1, "a\0b.json"),
    "shard-name-not-json": lambda b: b["shards"][1].__setitem__(1, "manifest-rank00001.bin"),
    "shard-name-too-long": lambda b: b["shards"][1].__setitem__(1, "a" * 300 + ".json"),
    "shard-name-not-text": lambda b: b["shards"][1].__setitem__(1, 7),
    "shard-entry-short": lambda b: b["shards"][1].pop(),
    "shard-entry-not-a-list": lambda b: b["shards"].__setitem__(1, {"root": 0}),
    "shards-not-a-list": lambda b: b.update(shards={"0": 1}),
    "shards-one-missing": lambda b: b["shards"].pop(),
    # the root table: {"id", "path", "ranks": "all" or [ranks]} per root
    "root-rank-past-world": lambda b: b["dist"]["roots"][0].update(ranks=[0, 2]),
    "root-rank-negative": lambda b: b["dist"]["roots"][0].update(ranks=[-1]),
    "root-rank-bool": lambda b: b["dist"]["roots"][0].update(ranks=[False]),
    "root-ranks-other-text": lambda b: b["dist"]["roots"][0].update(ranks="some"),
    "root-ranks-nested": lambda b: b["dist"]["roots"][0].update(ranks=[[0]]),
    "root-id-too-long": lambda b: b["dist"]["roots"][0].update(id="x" * 300),
    "root-path-not-text": lambda b: b["dist"]["roots"][0].update(path=["/r"]),
    "root-id-missing": lambda b: b["dist"]["roots"][0].pop("id"),
    "root-not-an-object": lambda b: b["dist"]["roots"].__setitem__(0, ["x" * 32, "/r", [0, 1]]),
    "roots-none": lambda b: b["dist"].update(roots=[]),
}


@pytest.mark.parametrize("change", sorted(HOSTILE_TABLES))
def test_a_hostile_root_or_shard_table_is_refused_when_the_global_manifest_is_read(change):
    """The global manifest's W-entry tables are checked in bulk (format/sharded.py _shards_ok,
    _roots_ok) before any entry is used: every hostile entry, checksum fixed, is refused."""
    import crc32c

    body = json.loads(_global([_shard(0), _shard(1)]).to_json_bytes())
    body.pop("manifest_crc32c")
    HOSTILE_TABLES[change](body)
    body["manifest_crc32c"] = crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match="manifest.json.*(malformed|shard|root)"):
        parse_global(json.dumps(body).encode(), "manifest.json")


def test_a_parsed_global_manifest_reads_its_tables_as_written():
    """The tables of a parsed global manifest (RootTable, ShardTable: entries made when read)
    give the roots and shards written, by index (negative too), slice and iteration; a root of
    every rank ("all") lists them all."""
    shards = [_shard(0), _shard(1)]
    g = _global(shards)
    back = parse_global(g.to_json_bytes(), "t")
    assert back == g and list(back.shards) == list(g.shards) and back.shards[-1] == g.shards[1]
    assert back.shards[:1] == (g.shards[0],) and back.roots[0] == g.roots[0] and back.roots[0].ranks == (0, 1)
    with pytest.raises(IndexError):
        back.shards[2]
    two = GlobalManifest.new(1, 2, [RootInfo("a" * 32, "/a", (0,)), RootInfo("b" * 32, "/b", (1,))],
                             [ShardRef(r, r, f"manifest-rank{r:05d}.json", 10, 0) for r in range(2)], {}, {})
    back = parse_global(two.to_json_bytes(), "t")
    assert [r.ranks for r in back.roots] == [(0,), (1,)] and back.roots.ids == ["a" * 32, "b" * 32]
    assert [s.root for s in back.shards] == [0, 1] and back == two


@pytest.mark.parametrize("damage", ["gap", "size", "wrong rank", "chunk past file", "overlap", "view past item",
                                    "holders"])
def test_damaged_shards_are_typed_errors(damage):
    shards = [_shard(0), _shard(1)]
    raw = json.loads(shards[1].to_json_bytes())
    if damage == "gap":  # rank 1's piece missing: the item is not covered
        raw["chunks"] = []
    elif damage == "size":
        raw["items"][0][1] = 4096 * 3
    elif damage == "wrong rank":
        raw["rank"] = 0
    elif damage == "chunk past file":
        raw["chunks"][0][2] = 8000
    elif damage == "overlap":
        raw["chunks"].append(list(raw["chunks"][0]))
    elif damage == "view past item":
        raw["tensors"][0][4] = [4096]
    elif damage == "holders":
        raw["groups"] = [[0]]
        raw["items"][0][2] = 0
    with pytest.raises(CorruptCheckpointError):
        bad = RankShard.from_json_bytes(json.dumps(raw).encode(), where="t", step=1, rank=1, world_size=2,
                                        n_roots=1)
        merge(_global(shards), [shards[0], bad])


def test_a_shard_whose_bytes_differ_from_the_recorded_ones_is_refused():
    data = _shard(0).to_json_bytes()
    ref = ShardRef(0, 0, "manifest-rank00000.json", len(data), __import__("crc32c").crc32c(data))
    check_shard_bytes(ref, data, "t")
    with pytest.raises(CorruptCheckpointError, match="recorded"):
        check_shard_bytes(ref, data[:-2] + b" \n", "t")


def test_the_vote_refuses_ranks_out_of_step_and_holders_that_disagree():
    from gdswriter.distributed.save import check_reports

    ok = [{"step": 3, "sets": [["all", 2, "d1"]]}, {"step": 3, "sets": [["all", 2, "d1"]]}]
    assert check_reports(ok, 3, "saving step 3") is None
    failures, hint = check_reports([ok[0], {**ok[1], "step": 4}], 3, "saving step 3")
    assert failures == {1: "saving step 4"} and "[3, 4]" in hint
    failures, hint = check_reports([ok[0], {"step": 3, "sets": [["all", 2, "d2"]]}], 3, "saving step 3")
    assert list(failures) == [1] and "replicated" in hint
    failures, _ = check_reports([ok[0], {"step": 3, "sets": []}], 3, "saving step 3")
    assert list(failures) == [0], "a holder set that one of its holders does not report"


def test_a_decision_names_a_bounded_number_of_failed_ranks():
    from gdswriter.distributed.group import bounded, unbound

    msg = bounded({r: "EngineIOError: disk full" for r in range(5000)})
    assert len(json.dumps(msg)) < 1024
    shown, total = unbound(msg)
    assert total == 5000 and len(shown) == 8
    text = str(RankFailedError("saving step 1", shown, total=total))
    assert "5000 rank(s)" in text and "and 4996 more ranks" in text


# ----------------------------------------------------------------------------- a rank's load planning, by W
def _sim():
    """benchmarks/dist_scale_sim.py, whose simulated ranks write real steps of any world size."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "dist_scale_sim.py"
    spec = importlib.util.spec_from_file_location("dist_scale_sim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hottest_lines(fn) -> list[tuple[int, str]]:
    """Run ``fn`` and count the Python lines it executes (sys.settrace: a line event per line
    started, and per turn of a loop, comprehensions too; work in C is no event): the most run
    ones, [(count, file:line)]."""
    import sys
    from collections import Counter

    counts: Counter = Counter()

    def trace(frame, event, arg):
        if event == "line":
            counts[frame.f_code.co_filename, frame.f_lineno] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return [(n, f"{f}:{line}") for (f, line), n in counts.most_common(3)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_ranks_load_planning_runs_no_python_per_rank_of_the_world(tmp_path, monkeypatch, kind):
    """A typical rank of 4,096 planning a load of the step they saved (load_own's planning: the
    global manifest, its shard, its pieces), and, of the ddp state, loading rank 0 of 2,048
    planning a load on half the ranks (reshard.plan_from_shards), run no line of Python once per
    rank of the world: the global manifest's W shard and root entries are checked in C, and
    made into objects only where read; the rank's own roots are found among W by list.index;
    the part of the step it loads carries only the roots its files are on. Its own state is
    20 tensors (a line per tensor and round of a relay tree runs 20 x 12 times), so a line that
    runs W / 4 = 1,024 times runs per rank. The real save code
    writes the step, as simulated ranks 0 and W / 2 (benchmarks/dist_scale_sim.py)."""
    from gdswriter.engines.select import create_engine
    from gdswriter.options import EngineOptions, KiB

    sim = _sim()
    monkeypatch.setattr(sim, "TENSORS", 20)
    monkeypatch.setattr(sim, "REPLICATED", 4)
    world, typical = 4096, 2048
    roots = {0: tmp_path / "rank0", typical: tmp_path / f"rank{typical}"}
    for p in roots.values():
        p.mkdir()
    engine = create_engine(EngineOptions(buffer_bytes=256 * KiB, request_bytes=64 * KiB, num_buffers=2))
    try:
        peers = sim.Peers(1)
        sim.run_rank(kind, typical, world, roots, peers, engine)
        sim.run_rank(kind, 0, world, roots, sim.Peers(1, report_of=sim.report_of(world), template=peers.last_report),
                     engine)
    finally:
        engine.close()
    layout = sim.layout_of(typical, world, roots)  # a checkpointer holds it from its opening
    hottest = _hottest_lines(lambda: sim.plan_load(layout, roots, 2))
    assert hottest[0][0] < world // 4, hottest
    if kind == "ddp":
        layout = sim.reshard_layout(world, roots)
        out: list = []
        hottest = _hottest_lines(lambda: out.append(sim.plan_reshard_load(layout, roots, 2)))
        assert out[0]["shards"] >= 1 and hottest[0][0] < world // 4, hottest
