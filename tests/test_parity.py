"""Parity instead of full copies (DistOptions(parity_group=G), issue 39 item 5), on the kill-a-node
harness (tests/support/nodes.py: each node its own namespaces, hostname and /local_nvme, 1 rank
each, gloo on loopback): a step is protected by parity blocks at G / (G - 1) times the bytes; a
node of a group lost (an empty root) is rebuilt from the others and loads bit exact; two lost in
one group is a typed error (fallback=True loads an older step that survives); a damaged data
chunk or parity block is detected, never loaded."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import crc32c
import pytest
import torch

from gdswriter.format.commit import step_dir_name
from gdswriter.format.parity import chunk_lengths, stream_size
from powerloss.harness import PowerLossMount, require_fuse
from support.models import small_options
from support.nodes import NVME, Cluster, unavailable
from support.ranks import caught, run_ranks

needs_nodes = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

ROOT = f"{NVME}/ckpt"
NUMEL = 3 * 256 * 1024 + 777  # 3 MiB (and a bit) float32 per tensor: chunks end mid-file, mid-chunk


def _state(rank: int, step: int) -> dict:
    """Rank-local state of different sizes per rank (members of unequal length)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"a": torch.randn(NUMEL + 1000 * rank, generator=g), "b": torch.randn(NUMEL // 2, generator=g)}


def _checkpointer(live: dict, group: int):
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    return GDSCheckpointer(state={"own": live}, root=ROOT, options=small_options(),
                           dist_options=DistOptions(timeout_s=60, parity_group=group, replicated=()))


def _save(rank: int, world: int, steps: list[int], group: int) -> dict:
    live: dict = {}
    out: dict = {"host": socket.gethostname()}
    with _checkpointer(live, group) as ck:
        for step in steps:
            live.clear()
            live.update(_state(rank, step))
            ck.save(step)
            out[f"protected{step}"] = caught(lambda: ck.wait_protected(120))
        out["protected"] = ck.protected_step()
    return out


def _load(rank: int, world: int, steps: list, group: int) -> dict:
    """Each of ``steps`` (None: the latest, "fallback": the latest with fallback=True) into zeroed
    tensors: [step, bit exact] or the error and whether the tensors were left untouched."""
    out: dict = {}
    for step in steps:
        live = {k: torch.zeros_like(v) for k, v in _state(rank, 0).items()}
        got: list = []
        with _checkpointer(live, group) as ck:
            err = caught(lambda: got.append(ck.load(None if step == "fallback" else step,
                                                    fallback=step == "fallback", strict=False)))
        if err:
            out[str(step)] = err
            out[f"{step}-untouched"] = all(not t.any() for t in live.values())
        else:
            want = _state(rank, got[0])
            out[str(step)] = [got[0], all(torch.equal(live[k].view(torch.int32), v.view(torch.int32))
                                          for k, v in want.items())]
    return out


def _step_dir(c: Cluster, node: int, step: int) -> Path:
    return c.nvme_dir(node) / "ckpt" / f"step_{step:012d}"


def _bytes(d: Path, parity: bool) -> int:
    """The bytes of a step directory's own files (not parity, not copies), or of its parity blocks."""
    if parity:
        return sum(p.stat().st_size for p in (d / "parity").glob("*.xor"))
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file() and (p.name.startswith("data-") or
                                                                         p.name.startswith("manifest-rank")))


def _read_for_rebuild(step_dir: Path) -> tuple[Path, int]:
    """A byte of rank 0's files (lane [0, 1, 2]) that rank 1's rebuild reads: in rank 0's chunk 1
    (stripe 2, rank 1's chunk 0 too), within rank 1's chunk 0's length, and a byte of a file
    (not the stream's padding), found from the parity description (format.md 11.1)."""
    body = json.loads((step_dir / "parity" / "rank00000.json").read_bytes())
    m0, m1 = body["members"][0], body["members"][1]
    per0, len1 = chunk_lengths(m0["total"], 3)[0], chunk_lengths(m1["total"], 3)[0]
    at, start = per0 + min(len1, chunk_lengths(m0["total"], 3)[1]) // 2, 0
    for _, name, size in m0["files"]:
        end = start + stream_size(size)
        if at < end:
            assert at - start < size, "the byte chosen is padding"
            return step_dir / name, at - start
        start = end
    raise AssertionError("rank 0's stream is shorter than its description")


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@needs_nodes
def test_parity_save_is_protected_at_g_plus_1_over_g(cluster, capsys):
    """3 nodes, parity_group=3 (one lane of 3): each step is protected, every node holds a parity
    block and its stripe description, and the parity bytes are 1/2 of the members' bytes (the
    longest chunk of the others: within a few bytes of the shares), G / (G - 1) = 1.5 in all;
    ``gdswriter ls`` says so."""
    c = cluster(3)
    got = c.run(_save, [1, 2], 3)
    assert [(x["protected1"], x["protected2"], x["protected"]) for x in got] == [(None, None, 2)] * 3, got
    data = sum(_bytes(_step_dir(c, k, 2), False) for k in range(3))
    parity = sum(_bytes(_step_dir(c, k, 2), True) for k in range(3))
    assert 1.49 < (data + parity) / data < 1.51, (data, parity)
    for k in range(3):
        body = json.loads((_step_dir(c, k, 2) / "parity" / f"rank{k:05d}.json").read_bytes())
        assert body["lane"] == [0, 1, 2] and body["parity"]["rank"] == k, body
        assert (_step_dir(c, k, 2) / "protected").exists() == (k == 0)
    assert (_step_dir(c, 1, 2) / "copies" / "manifest.json").is_file()
    from gdswriter.cli import main

    capsys.readouterr()
    assert main(["ls", str(c.nvme_dir(0) / "ckpt")]) == 0
    assert capsys.readouterr().out.count("protected (parity, groups of 3)") == 2


@needs_nodes
def test_parity_lose_one_node_rebuilds_bit_exact_and_two_is_an_error(cluster):
    """3 nodes, parity_group=3: steps 1 and 2 protected. Node 1 replaced by an empty disk: the
    latest step loads bit exact on every rank (rank 1's files rebuilt from nodes 0 and 2 and the
    parity, into a copy on a surviving node, and the log says so), and loads again; the refill
    then puts rank 1's files back on node 1 and removes the rebuilt copy. Then nodes
    1 and 2 are replaced at once (node 1's files, refilled after the loads above, lost again
    before any load): two nodes of one group lost, every load is a typed CorruptCheckpointError
    naming the lost ranks, the tensors untouched; never a wrong load (one after the other, with
    the refill between, is survived: tests/test_parity_refill.py)."""
    c = cluster(3)
    got = c.run(_save, [1, 2], 3)
    assert [x["protected"] for x in got] == [2] * 3, got
    c.replace_node(1)
    out = c.run(_load, [None, 1, None], 3)
    assert [(x["None"], x["1"]) for x in out] == [([2, True], [1, True])] * 3, out
    assert (_step_dir(c, 1, 2) / "manifest-rank00001.json").is_file()  # refilled on node 1 at each load's end,
    assert not (_step_dir(c, 0, 2) / "copies" / "rank00001").exists()  # and the copy rebuilt on node 0 removed

    c.replace_node(1)
    c.replace_node(2)
    for x in c.run(_load, [None, "fallback"], 3):
        for step in ("None", "fallback"):
            assert x[step][0] == "CorruptCheckpointError", x
            assert x[f"{step}-untouched"], x
        assert "rank 2's files are lost" in x["None"][1] and "its parity group (ranks [0, 1, 2])" in x["None"][1], x


@needs_nodes
def test_parity_damaged_block_or_chunk_is_detected_and_fallback_loads_older(cluster):
    """3 nodes, parity_group=3, steps 1 and 2 protected, node 1 replaced. A flipped byte in the
    parity block node 2 holds for step 2: the rebuild of rank 1's files finds its rebuilt chunk
    0 does not match the crc32c recorded at save (a CorruptCheckpointError naming it, on every
    rank, the tensors untouched), and fallback=True loads step 1, rebuilt bit exact. A flipped
    byte in rank 0's step-1 data (the part rank 1's rebuild reads) is detected the same way."""
    c = cluster(3)
    assert [x["protected"] for x in c.run(_save, [1, 2], 3)] == [2] * 3
    block = _step_dir(c, 2, 2) / "parity" / "rank00002.xor"
    _flip(block, block.stat().st_size // 2)
    c.replace_node(1)
    for x in c.run(_load, [None, "fallback"], 3):
        err = x["None"]
        assert err[0] == "CorruptCheckpointError" and x["None-untouched"], x
        assert "rank 1's files could not be rebuilt from its parity group" in err[1], x
        assert "rebuilt chunk 0 of rank 1's files does not match its crc32c" in err[1], x
        assert x["fallback"] == [1, True], x
    _flip(*_read_for_rebuild(_step_dir(c, 0, 1)))  # rank 0's chunk 1: XORed into stripe 2, read for rank 1's chunk 0
    shutil.rmtree(_step_dir(c, 0, 1) / "copies")  # the copy step 1's load rebuilt: rebuilt again
    for x in c.run(_load, [1], 3):
        assert x["1"][0] == "CorruptCheckpointError" and x["1-untouched"], x


def test_parity_option_is_validated_and_exclusive_with_replicas(monkeypatch):
    """DistOptions(parity_group=G): 2..64 hosts, typed errors saying how to fix; never with
    replicas > 1; GDSWRITER_PARITY_GROUP read by from_env."""
    from gdswriter.distributed import DistOptions
    from gdswriter.errors import InvalidOptionError

    assert DistOptions(parity_group=4).parity_group == 4 and DistOptions().parity_group is None
    for bad in (1, 0, 65, True, "3", 2.0):
        with pytest.raises(InvalidOptionError, match="parity_group="):
            DistOptions(parity_group=bad)
    with pytest.raises(InvalidOptionError, match="cannot be combined: choose full copies"):
        DistOptions(parity_group=3, replicas=2)
    monkeypatch.setenv("GDSWRITER_PARITY_GROUP", "3")
    assert DistOptions.from_env().parity_group == 3
    monkeypatch.setenv("GDSWRITER_PARITY_GROUP", "three")
    with pytest.raises(InvalidOptionError, match="GDSWRITER_PARITY_GROUP='three' is not a whole number"):
        DistOptions.from_env()


def test_parity_lanes_one_rank_per_host_of_each_group():
    """lanes_of (rank 0's plan, pure): 4 hosts x 2 ranks, groups of 2 -> groups {h0, h2}, {h1, h3},
    each cut into 2 lanes of one rank per host; a rank receives only its lane (O(G)). A host
    with more ranks than the rest of its group leaves a lane of one: refused, saying how to fix."""
    from gdswriter.distributed.parity import lanes_of
    from gdswriter.errors import InvalidOptionError

    got = [{"host": f"h{r // 2}", "domain": [], "group": 2, "root": f"id{r}"} for r in range(8)]
    parts = lanes_of(got, 2)
    assert [p["lane"] for p in parts] == [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    assert parts[0]["roots"] == ["id4"] and parts[4]["roots"] == ["id0"]
    uneven = [{"host": h, "domain": [], "group": 2, "root": f"id{r}"} for r, h in enumerate(["a", "a", "b"])]
    with pytest.raises(InvalidOptionError, match="run as many ranks on every host"):
        lanes_of(uneven, 2)
    with pytest.raises(InvalidOptionError, match="parity needs at least 2 hosts"):
        lanes_of(got[:2], 2)


def _save_on_mount(rank: int, world: int, tmp: str, mnt: str) -> dict:
    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    live = _state(rank, 1)
    with GDSCheckpointer(state={"own": live}, root=f"{tmp}/n0" if rank == 0 else f"{mnt}/n1",
                         options=small_options(),
                         dist_options=DistOptions(timeout_s=60, parity_group=2, replicated=())) as ck:
        ck.save(1)
        return {"protected": caught(lambda: ck.wait_protected(120))}


def test_parity_protected_survives_a_power_cut(tmp_path):
    """2 ranks (2 hosts by GDSWRITER_HOSTNAME), parity_group=2; rank 1's root on the FUSE
    power-loss file system (tests/powerloss). Once step 1 is protected the power is cut: in every
    disk state the cut may leave (durable, ``lag``, ``drop``), rank 1's parity block and its
    description are there and the block's bytes match the crc32c the description records: a
    protected step's parity is durable."""
    require_fuse(tmp_path / "probe")
    mnt, work = tmp_path / "mnt", tmp_path / "fs"
    with PowerLossMount(mnt, work, variants="lag,drop") as fs:
        got = run_ranks(2, _save_on_mount, str(tmp_path), str(mnt), out=tmp_path / "out")
        assert [x["protected"] for x in got] == [None, None], got
        fs.cut("lag,drop")
        info = fs.cut_result()
    assert info is not None and info["images"], info
    for digest, names in info["images"].items():
        with PowerLossMount(mnt, tmp_path / f"img-{digest}", image=fs.image_path(digest)):
            d = mnt / "n1" / step_dir_name(1) / "parity"
            body = json.loads((d / "rank00001.json").read_bytes())
            block = (d / "rank00001.xor").read_bytes()
            assert len(block) == body["parity"]["length"] and crc32c.crc32c(block) == body["parity"]["crc32c"], names


@needs_nodes
def test_parity_two_groups_lose_one_node_each_the_primary_included(cluster):
    """4 nodes, parity_group=2: groups {node0, node2} and {node1, node3} (hosts dealt round
    robin), G / (G - 1) = 2 here. Nodes 0 (the primary, with the step's manifest) and 1 replaced
    by empty disks: one node of each group. The restart adopts the manifest's copy node 2 keeps,
    both lost ranks are rebuilt from their groups, and every rank loads bit exact."""
    c = cluster(4)
    got = c.run(_save, [1], 2)
    assert [x["protected"] for x in got] == [1] * 4, got
    for k in range(4):
        lane = json.loads((_step_dir(c, k, 1) / "parity" / f"rank{k:05d}.json").read_bytes())["lane"]
        assert lane == [k % 2, k % 2 + 2], lane
    c.replace_node(0)
    c.replace_node(1)
    out = c.run(_load, [None], 2)
    assert [x["None"] for x in out] == [[1, True]] * 4, out


@needs_nodes
def test_parity_two_ranks_per_node_lanes(cluster):
    """2 nodes x 2 ranks, parity_group=2: lanes [0, 2] and [1, 3] (the i-th rank of each host).
    Node 1 (ranks 2 and 3) replaced by an empty disk: each lane lost one member, both are
    rebuilt (from node 0's files and parity), every rank loads bit exact."""
    c = cluster(2, 2)
    assert [x["protected"] for x in c.run(_save, [1], 2)] == [1] * 4
    lanes = json.loads((_step_dir(c, 0, 1) / "parity" / "rank00001.json").read_bytes())["lane"]
    assert lanes == [1, 3], lanes
    c.replace_node(1)
    assert [x["None"] for x in c.run(_load, [None], 2)] == [[1, True]] * 4


def test_parity_benchmark_measures_the_bytes_on_the_drives(tmp_path):
    """benchmarks/parity.py, small: 3 ranks (3 simulated hosts), one group; its measured drive
    bytes per state byte, from the files, are n / (n - 1) = 1.5 within the shards' bytes."""
    import subprocess
    import sys

    here = Path(__file__).resolve().parent.parent
    out = tmp_path / "parity.json"
    text = subprocess.run([sys.executable, str(here / "benchmarks" / "parity.py"), "--size", "4M", "--ranks", "3",
                           "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)], check=True, timeout=600,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(here)}).stdout
    assert "drive bytes / state byte" in text, text
    r = json.loads(out.read_text())["3"]
    assert 1.49 < (r["own"] + r["parity"]) / r["own"] < 1.51, r
