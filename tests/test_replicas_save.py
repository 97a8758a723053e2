"""Replicas on peer nodes, the save side (issue 39 items 1-2, format.md 11), on real gloo ranks,
each with its own node-local root and its own host name (GDSWRITER_HOSTNAME: ranks of this one
machine stand for distinct nodes): after save + wait_protected every copy exists, byte-identical
to the original, and the step is marked protected; a peer killed during the replication leaves
the step committed, not protected, and the newest protected step kept by retention."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import gdswriter
from gdswriter import DistOptions, GDSCheckpointer, InvalidOptionError
from gdswriter.cli import main as cli_main
from gdswriter.format.commit import step_dir_name
from gdswriter.format.sharded import shard_name
from support.ranks import caught, run_ranks

MiB = 1 << 20


def state(step: int) -> dict:
    """Two 4 MiB tensors (above every small-copy threshold), the same on every rank (each rank
    writes its share of the bytes)."""
    g = torch.Generator().manual_seed(500 + step)
    return {"a": torch.randn(MiB, generator=g), "b": torch.randint(0, 1 << 30, (MiB,), generator=g)}


def _open(tmp: str, rank: int, holder: dict, replicas: int, keep_last: int | None = None,
          per_host: int = 1) -> GDSCheckpointer:
    """Rank ``rank`` on host node<K> (K = rank // per_host), whose ranks share root n<K>."""
    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank // per_host}"
    return GDSCheckpointer(holder, root=f"{tmp}/n{rank // per_host}", keep_last=keep_last,
                           dist_options=DistOptions(replicas=replicas))


def _save_protected(rank: int, world: int, tmp: str, replicas: int, per_host: int) -> dict:
    holder = state(1)
    ck = _open(tmp, rank, holder, replicas, per_host=per_host)
    ck.save(1)
    first = ck.wait_protected()
    for k, v in state(2).items():
        holder[k].copy_(v)
    ck.save(2)
    second = ck.wait_protected()
    ck.close()
    return {"first": first, "second": second}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def _check_copies(tmp: Path, world: int, step: int, replicas: int, per_host: int) -> None:
    """Every rank's shard and data files lie, byte-identical, in copies/rank<R> on the first root
    of each rank the manifest names; the global manifest's copy and the markers too."""
    sd = step_dir_name(step)
    raw = (tmp / "n0" / sd / "manifest.json").read_bytes()
    body = json.loads(raw)
    assert body["version"] == [1, 4]
    assert json.loads((tmp / "n0" / sd / "protected").read_bytes()) == {"copies": replicas}
    roots = body["dist"]["roots"]
    where = {r["path"]: Path(r["path"]) for r in roots}
    table = [where[r["path"]] for r in roots]
    assert len(body["replicas"]) == world and all(len(e) == replicas - 1 for e in body["replicas"])
    for r in range(world):
        own = tmp / f"n{r // per_host}" / sd
        names = [shard_name(r)] + [f[1] for f in json.loads((own / shard_name(r)).read_bytes())["files"]]
        assert own.parent not in [table[g] for g in body["replicas"][r]]
        for g in body["replicas"][r]:
            copy = table[g] / sd / "copies" / f"rank{r:05d}"
            got = _files(copy)
            assert sorted(got) == sorted(names), (r, g, sorted(got))
            for n in names:
                assert got[n] == (own / n).read_bytes(), (r, g, n)
            if r == 0:
                assert (table[g] / sd / "copies" / "manifest.json").read_bytes() == raw
                assert json.loads((table[g] / sd / "copies" / "protected").read_bytes()) == {"copies": replicas}
            assert not [p for p in (table[g] / sd / "copies").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("world,replicas,per_host", [(2, 2, 1), (3, 3, 1), (4, 2, 2)])
def test_every_copy_is_durable_and_byte_identical_once_protected(tmp_path, capsys, world, replicas, per_host):
    """2 ranks x 2 copies, 3 x 3, and 4 ranks on 2 hosts of 2 ranks sharing a root (each host's
    root then holds the copies of both ranks of the other host)."""
    got = run_ranks(world, _save_protected, str(tmp_path), replicas, per_host, out=tmp_path / "out")
    assert got == [{"first": 1, "second": 2}] * world
    for step in (1, 2):
        _check_copies(tmp_path, world, step, replicas, per_host)
    step, whole = gdswriter.load_state([tmp_path / f"n{h}" for h in range(world // per_host)])  # copies: unread
    assert step == 2 and all(torch.equal(whole["model"][k], v) for k, v in state(2).items())
    others = [a for h in range(1, world // per_host) for a in ("--secondary", str(tmp_path / f"n{h}"))]
    assert cli_main(["verify", str(tmp_path / "n0"), *others, "--all"]) == 0
    capsys.readouterr()
    assert cli_main(["ls", str(tmp_path / "n0")]) == 0
    listed = capsys.readouterr().out
    assert listed.count(f"protected ({replicas} copies)") == 2, listed
    assert cli_main(["ls", "--json", str(tmp_path / "n0")]) == 0
    steps = json.loads(capsys.readouterr().out)[0]["steps"]
    assert [(s["state"], s["copies"], s["version"]) for s in steps] == [("protected", replicas, "1.4")] * 2


def _no_replicas(rank: int, world: int, tmp: str) -> int | None:
    holder = state(1)
    ck = _open(tmp, rank, holder, 1)
    ck.save(1)
    protected = ck.wait_protected()
    ck.close()
    return protected


def test_one_copy_stays_format_1_3_without_copies(tmp_path):
    assert run_ranks(2, _no_replicas, str(tmp_path), out=tmp_path / "out") == [None, None]
    sd = tmp_path / "n0" / step_dir_name(1)
    body = json.loads((sd / "manifest.json").read_bytes())
    assert body["version"] == [1, 3] and "replicas" not in body
    assert not (sd / "protected").exists()
    assert not any((tmp_path / f"n{r}" / step_dir_name(1) / "copies").exists() for r in range(2))


def _too_many(rank: int, world: int, tmp: str) -> list | None:
    return caught(lambda: _open(tmp, rank, state(1), 3))


def test_more_copies_than_hosts_is_refused_on_every_rank(tmp_path):
    got = run_ranks(2, _too_many, str(tmp_path), out=tmp_path / "out")
    assert all(g is not None and g[0] == "InvalidOptionError" and "lower the copies to 2" in g[1] for g in got), got
    with pytest.raises(InvalidOptionError, match="replicas=0"):
        DistOptions(replicas=0)
    with pytest.raises(InvalidOptionError, match="GDSWRITER_REPLICAS"):
        os.environ["GDSWRITER_REPLICAS"] = "two"
        try:
            DistOptions.from_env()
        finally:
            del os.environ["GDSWRITER_REPLICAS"]


class _DieAtReplication(logging.Handler):
    """SIGKILLs this process as its replication of ``step`` begins (the step is committed)."""

    def __init__(self, step: int):
        super().__init__(logging.DEBUG)
        self.step = step

    def emit(self, record: logging.LogRecord) -> None:
        if f"replicates step {self.step} " in record.getMessage():
            os.kill(os.getpid(), signal.SIGKILL)


def _peer_killed(rank: int, world: int, tmp: str) -> dict:
    holder = state(1)
    ck = _open(tmp, rank, holder, 2, keep_last=1)
    ck.save(1)
    first = ck.wait_protected()
    if rank == 1:
        log = logging.getLogger("gdswriter")
        log.setLevel(logging.DEBUG)
        log.addHandler(_DieAtReplication(2))
    for k, v in state(2).items():
        holder[k].copy_(v)
    ck.save(2)  # committed on both ranks; rank 1 dies as its replication begins
    if rank == 1:
        time.sleep(600)
    error = caught(ck.wait_protected)
    return {"first": first, "error": error, "steps": ck.steps(), "latest": ck.latest_step(),
            "protected": ck.protected_step()}


def test_a_peer_killed_during_replication_leaves_the_step_committed_not_protected(tmp_path, capsys):
    got = run_ranks(2, _peer_killed, str(tmp_path), out=tmp_path / "out", killed=(1,))
    mine = got[0]
    assert mine["first"] == 1
    assert mine["error"] is not None and mine["error"][0] == "ReplicationError", mine
    assert "step 2 is committed but not protected" in mine["error"][1]
    # keep_last=1 would drop step 1: it is the newest protected step, so retention keeps it
    assert mine["steps"] == [1, 2] and mine["latest"] == 2 and mine["protected"] == 1, mine
    n0 = tmp_path / "n0"
    assert (n0 / step_dir_name(1) / "protected").exists() and not (n0 / step_dir_name(2) / "protected").exists()
    step, whole = gdswriter.load_state([n0, tmp_path / "n1"], 1)
    assert step == 1 and all(torch.equal(whole["model"][k], v) for k, v in state(1).items())
    capsys.readouterr()
    assert cli_main(["ls", str(n0)]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert any(r[0] == "1" and "protected" in r for r in rows), rows
    assert any(r[0] == "2" and "committed" in r and "latest" in r for r in rows), rows


class _DamageAtReplication(logging.Handler):
    """Flips a byte of this rank's data files of ``step`` as its replication begins (after the
    commit: a disk returning bad bytes)."""

    def __init__(self, step_dir: Path, step: int):
        super().__init__(logging.DEBUG)
        self.step_dir, self.step = step_dir, step

    def emit(self, record: logging.LogRecord) -> None:
        if f"replicates step {self.step} " in record.getMessage():
            for p in self.step_dir.glob("data-*"):
                with open(p, "r+b") as f:
                    f.seek(100)
                    b = f.read(1)
                    f.seek(100)
                    f.write(bytes([b[0] ^ 0xFF]))


def _damaged_source(rank: int, world: int, tmp: str) -> dict:
    holder = state(1)
    ck = _open(tmp, rank, holder, 2)
    if rank == 1:
        log = logging.getLogger("gdswriter")
        log.setLevel(logging.DEBUG)
        log.addHandler(_DamageAtReplication(Path(tmp, "n1", step_dir_name(1)), 1))
    ck.save(1)
    error = caught(ck.wait_protected)
    ck.close()
    return {"error": error, "protected": ck.protected_step()}


def test_a_damaged_local_file_is_never_copied(tmp_path):
    got = run_ranks(2, _damaged_source, str(tmp_path), out=tmp_path / "out")
    for g in got:
        assert g["error"] is not None and g["error"][0] == "ReplicationError", g
        assert g["protected"] is None, g
    assert "rank 1" in got[0]["error"][1] and "checksum" in got[0]["error"][1].lower(), got[0]
    copies = tmp_path / "n0" / step_dir_name(1) / "copies"
    assert not (copies / "rank00001").exists() and not [p for p in copies.iterdir() if p.name.startswith(".tmp")]
    assert not (tmp_path / "n0" / step_dir_name(1) / "protected").exists()
    assert (tmp_path / "n1" / step_dir_name(1) / "copies" / "rank00000").is_dir()  # rank 0's copy is good


# ----------------------------------------------------------------------------- simulated nodes
def _save_on_node(rank: int, world: int) -> dict:
    from support.nodes import NVME

    holder = state(1)
    ck = GDSCheckpointer(holder, root=f"{NVME}/ckpt", dist_options=DistOptions(replicas=2, timeout_s=60))
    ck.save(1)
    protected = ck.wait_protected()
    ck.close()
    return {"protected": protected}


def test_two_nodes_each_hold_the_other_nodes_files(tmp_path):
    """2 simulated nodes (own hostname, own /local_nvme: tests/support/nodes.py), replicas=2: once
    step 1 is protected, each node's /local_nvme holds the other node's shard and data files
    byte for byte, and node 1 the global manifest's copy."""
    from support.nodes import Cluster, unavailable

    if unavailable() is not None:
        pytest.skip(unavailable())
    with Cluster(tmp_path / "cluster", nodes=2, ranks_per_node=1) as c:
        assert c.run(_save_on_node) == [{"protected": 1}] * 2
        sd = step_dir_name(1)
        own = [c.nvme_dir(n) / "ckpt" / sd for n in range(2)]
        assert json.loads((own[0] / "protected").read_bytes()) == {"copies": 2}
        for r in range(2):
            copy = own[1 - r] / "copies" / f"rank{r:05d}"
            got = _files(copy)
            assert got and all(got[n] == (own[r] / n).read_bytes() for n in got), sorted(got)
            assert shard_name(r) in got and any(n.startswith("data-") for n in got)
        assert (own[1] / "copies" / "manifest.json").read_bytes() == (own[0] / "manifest.json").read_bytes()


@pytest.mark.parametrize("bad", [((1,), (2,)), ((1,),), ((1, 1), (0,)), ((1,) * 17, (0,)), ((-1,), (0,))])
def test_a_malformed_replicas_table_is_damage(bad):
    """The manifest's "replicas" key is untrusted input: an index out of the root table, a wrong
    length, a duplicate or too long an entry is refused as damage, never used."""
    from gdswriter.errors import CorruptCheckpointError
    from gdswriter.format.manifest import RootInfo
    from gdswriter.format.sharded import GlobalManifest, ShardRef, parse_global

    roots = (RootInfo("a" * 32, "/n0", (0,)), RootInfo("b" * 32, "/n1", (1,)))
    shards = (ShardRef(0, 0, shard_name(0), 10, 1), ShardRef(1, 1, shard_name(1), 10, 2))
    good = GlobalManifest.new(3, 2, roots, shards, {}, {}, None, [[1], [0]])
    parsed = parse_global(good.to_json_bytes(), "good")
    assert parsed is not None and parsed.replicas == ((1,), (0,)) and parsed.version == (1, 4)
    plain = parse_global(GlobalManifest.new(3, 2, roots, shards, {}, {}).to_json_bytes(), "plain")
    assert plain is not None and plain.replicas is None and plain.version == (1, 3)
    with pytest.raises(CorruptCheckpointError, match="replicas table is malformed"):
        parse_global(GlobalManifest.new(3, 2, roots, shards, {}, {}, None, bad).to_json_bytes(), "bad")


class _Records(logging.Handler):
    """Keeps the messages of the "gdswriter" logger's records that reach it."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _profiled(rank: int, world: int, tmp: str) -> dict:
    holder = state(1)
    ck = _open(tmp, rank, holder, 2)
    log = logging.getLogger("gdswriter")
    records = _Records()
    log.addHandler(records)
    ck.save(1)  # the logger at its default level: no timings
    ck.wait_protected()
    log.setLevel(logging.DEBUG)  # as benchmarks/replicas.py --profile does
    for k, v in state(2).items():
        holder[k].copy_(v)
    ck.save(2)
    protected = ck.wait_protected()
    ck.close()
    return {"protected": protected, "timings": [m for m in records.messages if " replicated step " in m]}


def test_the_replication_timings_are_logged_at_debug_only(tmp_path):
    """A step replicated with the gdswriter logger at debug logs its phases and its pipeline's
    stages, measured; one replicated at the default level logs none (and measures none: the
    pipeline's own test in test_replicas_stream.py)."""
    got = run_ranks(2, _profiled, str(tmp_path), out=tmp_path / "out")
    for rank, x in enumerate(got):
        assert x["protected"] == 2, x
        assert len(x["timings"]) == 1 and f"rank {rank} replicated step 2 in " in x["timings"][0], x
        stages = dict(kv.rsplit(" ", 2)[:2] for kv in x["timings"][0].split("pipeline: ", 1)[1].split(", "))
        assert set(stages) == {"pipeline", "read", "wait read", "wire", "write"}, x
        assert float(stages["pipeline"]) > 0, x


class _LateEnd(logging.Handler):
    """Holds this rank's replication thread ``seconds`` once step ``step``'s replication is over
    (its last collective done, the debug line logged): the thread ends that much later here."""

    def __init__(self, step: int, seconds: float):
        super().__init__(logging.DEBUG)
        self.step, self.seconds = step, seconds

    def emit(self, record: logging.LogRecord) -> None:
        if f" replicated step {self.step} in " in record.getMessage():
            time.sleep(self.seconds)


def _late_thread(rank: int, world: int, tmp: str) -> dict:
    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    opts = DistOptions(replicas=2, timeout_s=20)
    holder = state(1)
    a = GDSCheckpointer(holder, root=f"{tmp}/n{rank}", dist_options=opts)
    a.save(1)
    a.wait_protected()
    if rank == 1:
        log = logging.getLogger("gdswriter")
        log.setLevel(logging.DEBUG)
        log.addHandler(_LateEnd(2, 3.0))
    a.save(2)  # rank 1's replication thread ends 3 s after rank 0's
    if rank == 0:
        a.wait_protected()  # rank 0's thread is idle, rank 1's still runs
    # now: another checkpointer's channels (a collective creation), while the threads differ
    b = GDSCheckpointer(state(3), root=f"{tmp}/b{rank}", dist_options=opts)
    b.save(3)
    loaded = a.load(2)  # its refill (refill.py: nothing lost) on the same thread and channel
    protected = [a.wait_protected(), b.wait_protected()]
    b.close()
    a.close()
    c = GDSCheckpointer(state(4), root=f"{tmp}/c{rank}", dist_options=opts)  # channels from the pool
    c.save(4)
    protected.append(c.wait_protected())
    c.close()
    return {"loaded": loaded, "protected": protected}


def test_a_replication_thread_ending_later_on_one_rank_never_splits_the_channels(tmp_path):
    """The Replicator's channel (its saves' replications and its loads' refills, refill.py) is
    given back to group.py's pool by close() alone, which every rank calls at the same point,
    never by its thread: with rank 1's thread ending 3 s after rank 0's, a checkpointer made
    meanwhile creates its channels alike on both ranks, and one made after the closes takes the
    pooled ones alike (a thread giving its channel back as it ended would have rank 0 take a
    pooled group where rank 1 creates one: a CollectiveFailedError after the timeout)."""
    got = run_ranks(2, _late_thread, str(tmp_path), out=tmp_path / "out")
    assert [x["loaded"] for x in got] == [2, 2], got
    assert [x["protected"] for x in got] == [[2, 3, 4], [2, 3, 4]], got
