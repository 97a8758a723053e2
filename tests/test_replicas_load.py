"""Loading from replicas (issue 39 item 3): a step whose ranks' files also lie, byte for byte,
in ``step_S/copies/rank<R>/`` on other roots (the global manifest's ``replicas``, format 1.4)
loads from the first good copy when a rank's own root is gone (a node replaced: an empty root
with a new id) or its files are damaged, bit exact, on the same world size or resharded, and
says so; when no good copy is left, a typed error names every copy tried, never a wrong tensor.

Until the save side writes copies, the tests make the copy layout by hand from a real 2-rank
1.3 save (tests/test_replicas_load.py ``_add_copies``)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import crc32c
import pytest
import torch

from support.models import small_options
from support.nodes import NVME, Cluster, unavailable
from support.ranks import WarningLines, caught, run_ranks
from support.roots import copy_nodes

STEP = 3
NUMEL = 1 << 20  # 4 MiB float32 tensors: above the small-copy thresholds
TENSORS = 2


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {f"t{i}": torch.randn(NUMEL, generator=g) for i in range(TENSORS)}


def _own_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(2000 + 10 * step + rank)
    return {"own": torch.randn(NUMEL, generator=g)}


def _root(base: str, rank: int) -> Path:
    """Rank ``rank``'s root: ``base``/n<rank> (one machine), or ``base`` itself on the simulated
    nodes (the node-local /local_nvme/ckpt, one path on every node)."""
    return Path(base) if base.startswith(NVME) else Path(base, f"n{rank}")


def _checkpointer(root: Path, live: dict, own: dict):
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    return GDSCheckpointer(state={"s": live, "own": own}, root=root, options=small_options(),
                           dist_options=DistOptions(timeout_s=60))


def _save(rank: int, world: int, base: str) -> None:
    """Steps STEP - 1 and STEP (the tests add copies to STEP only)."""
    live, own = {}, {}
    with _checkpointer(_root(base, rank), live, own) as ck:
        for step in (STEP - 1, STEP):
            live.update(_state(step))
            own.update(_own_state(rank, step))
            ck.save(step)


def _load(rank: int, world: int, base: str, fallback: bool = False) -> dict:
    """Load the latest step into zeroed tensors: {"got": [step, bit exact] or the error, "untouched":
    whether the live tensors are still zeros, "warnings": the gdswriter warnings}. A 1-rank load
    (a reshard) checks the shared state only."""
    live = {f"t{i}": torch.zeros(NUMEL) for i in range(TENSORS)}
    own = {"own": torch.zeros(NUMEL)}
    seen = WarningLines()
    logging.getLogger("gdswriter").addHandler(seen)
    got: list = []

    def load() -> None:
        with _checkpointer(_root(base, rank), live, own) as ck:
            got.append(ck.load(strict=False, fallback=fallback))

    err = caught(load)
    untouched = all(not t.any() for t in [*live.values(), *own.values()])
    if err:
        return {"got": err, "untouched": untouched, "warnings": seen.lines}
    want = _state(got[0])
    exact = all(torch.equal(live[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
    if world == 2:
        exact = exact and torch.equal(own["own"].view(torch.int32), _own_state(rank, got[0])["own"].view(torch.int32))
    return {"got": [got[0], exact], "untouched": untouched, "warnings": seen.lines}


# ----------------------------------------------------------------------------- the copy layout, by hand
def _step_dir(root: Path) -> Path:
    return root / f"step_{STEP:012d}"


def _add_copies(roots: list[Path]) -> None:
    """What the save side of replicas=2 leaves (format 1.4), made from a 2-rank 1.3 step on
    ``roots`` (rank 0's, rank 1's): rank r's shard and data files copied into
    ``step_S/copies/rank<R>/`` on the other rank's root, the global manifest into
    ``step_S/copies/manifest.json`` on the root holding rank 0's copy, and ``"replicas": [[1],
    [0]]`` in the global manifest (its manifest_crc32c recomputed; parsed back with the
    project's parser, which checks it)."""
    from gdswriter.distributed.roots import root_identity
    from gdswriter.format.copies import copy_dir, replicas_of
    from gdswriter.format.sharded import parse_global

    manifest = _step_dir(roots[0]) / "manifest.json"
    body = json.loads(manifest.read_bytes())
    assert [r["id"] for r in body["dist"]["roots"]] == [root_identity(r, create=False) for r in roots]
    for r, (root, name, _, _) in enumerate(body["shards"]):
        dest = _step_dir(roots[1 - root]) / copy_dir(r)
        dest.mkdir(parents=True)
        shard = _step_dir(roots[root]) / name
        shutil.copyfile(shard, dest / name)
        for f in json.loads(shard.read_bytes())["files"]:
            shutil.copyfile(_step_dir(roots[f[0]]) / f[1], dest / f[1])
    body.pop("manifest_crc32c")
    body["replicas"] = [[1], [0]]
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    raw = (json.dumps({**body, "manifest_crc32c": crc32c.crc32c(canonical)}, separators=(",", ":")) + "\n").encode()
    g = parse_global(raw, str(manifest))
    assert replicas_of(g, str(manifest)) == ((1,), (0,))
    manifest.write_bytes(raw)
    shutil.copyfile(manifest, _step_dir(roots[1]) / "copies" / "manifest.json")


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _data_file(root: Path, rank: int, copy: bool = False) -> Path:
    d = _step_dir(root) / (f"copies/rank{rank:05d}" if copy else "")
    return next(d.glob(f"data-rank{rank}-*.bin"))


def _replace_node(root: Path) -> None:
    """A new machine: the root is an empty directory (it gets a new id)."""
    shutil.rmtree(root)
    root.mkdir()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One real 2-rank save (each rank its own root, like node-local disks), with copies added."""
    base = tmp_path_factory.mktemp("saved")
    run_ranks(2, _save, str(base), out=base / "out")
    _add_copies([base / "n0", base / "n1"])
    return base


@pytest.fixture()
def job(saved, tmp_path) -> Path:
    """A fresh copy of the saved roots (their ids travel with them) for one test to damage."""
    return copy_nodes(saved, tmp_path / "job", 2)


def _restored(out: dict, rank: int) -> bool:
    return any(f"restored rank {rank}'s files from the copy" in w for w in out["warnings"])


def _checked(out: dict) -> bool:
    return any("checking every rank's files and their copies" in w for w in out["warnings"])


# ----------------------------------------------------------------------------- the tests
def test_node_replaced_loads_bit_exact_from_the_copy(job):
    """Rank 1's root replaced by an empty one: both ranks load bit exact, rank 1's files read from
    its copy on rank 0's root (and sent on), which rank 0 says; one rank alone (a reshard) too."""
    _replace_node(job / "n1")
    out = run_ranks(2, _load, str(job), out=job / "out")
    assert [x["got"] for x in out] == [[STEP, True]] * 2, out
    assert _restored(out[0], 1) and "n0" in next(w for w in out[0]["warnings"] if "restored" in w), out
    assert not any(_checked(x) for x in out), "an unreached root moves to its copy before the plans, no retry"
    one = run_ranks(1, _load, str(job), out=job / "out1")
    assert one[0]["got"] == [STEP, True] and _restored(one[0], 1), one


def test_flipped_byte_in_a_data_file_loads_from_the_copy(job):
    """A flipped byte in rank 1's own data file: the load finds it, checks every rank's files,
    reads rank 1's from the copy, bit exact, and says so."""
    _flip(_data_file(job / "n1", 1))
    out = run_ranks(2, _load, str(job), out=job / "out")
    assert [x["got"] for x in out] == [[STEP, True]] * 2, out
    assert any(_restored(x, 1) for x in out) and not any(_restored(x, 0) for x in out), out
    assert all(_checked(x) for x in out), out


def test_every_copy_damaged_is_a_typed_error_and_nothing_changes(job):
    """Rank 1's data file damaged on its own root and in its copy: CorruptCheckpointError naming
    both places, on every rank, and no live tensor changed; load(fallback=True) loads the older
    step instead."""
    _flip(_data_file(job / "n1", 1))
    _flip(_data_file(job / "n0", 1, copy=True), at=100)
    out = run_ranks(2, _load, str(job), out=job / "out")
    for x in out:
        assert x["untouched"], x
        kind, msg = x["got"]
        assert kind in ("CorruptCheckpointError", "RankFailedError"), x
    kind, msg = out[0]["got"]
    assert kind == "CorruptCheckpointError" and "no good copy of rank 1's files" in msg, out
    assert "own root #1" in msg and "copy on root #0" in msg, msg
    older = run_ranks(2, _load, str(job), True, out=job / "out2")
    assert [x["got"] for x in older] == [[STEP - 1, True]] * 2, older


def test_damaged_shard_uses_the_copy_and_truncated_copy_is_an_error(job):
    """Rank 1's own manifest shard damaged: the copy serves; with its node replaced and the copy
    of its shard truncated, no copy is left: a typed error naming it, nothing changed."""
    shard = _step_dir(job / "n1") / "manifest-rank00001.json"
    _flip(shard)
    out = run_ranks(2, _load, str(job), out=job / "out")
    assert [x["got"] for x in out] == [[STEP, True]] * 2 and any(_restored(x, 1) for x in out), out
    _replace_node(job / "n1")
    copy = _step_dir(job / "n0") / "copies/rank00001/manifest-rank00001.json"
    copy.write_bytes(copy.read_bytes()[:-10])
    out = run_ranks(2, _load, str(job), out=job / "out2")
    assert all(x["untouched"] for x in out), out
    kind, msg = out[0]["got"]
    assert kind == "CorruptCheckpointError" and "no good copy of rank 1's files" in msg and "rank00001" in msg, out


def test_offline_readers_use_the_copy(job, capsys):
    """load_state and ``gdswriter verify`` given the roots in one process: with rank 1's root
    replaced, rank 1's files come from its copy on rank 0's root, bit exact; with rank 1's own
    shard damaged too, the copy still serves."""
    from gdswriter import load_state
    from gdswriter.cli import main

    _flip(_step_dir(job / "n1") / "manifest-rank00001.json")
    roots = [str(job / "n0"), str(job / "n1")]
    step, state = load_state(roots)
    assert step == STEP and all(torch.equal(state["extra"]["s"][k], v) for k, v in _state(STEP).items())
    _replace_node(job / "n1")
    step, state = load_state(roots)
    assert step == STEP and all(torch.equal(state["extra"]["s"][k], v) for k, v in _state(STEP).items())
    assert main(["verify", roots[0], "--secondary", roots[1]]) == 0, capsys.readouterr()


def _load_then_save(rank: int, world: int, base: str) -> dict:
    """_load, then save step STEP + 1 and load it back (the job goes on after a restore)."""
    out = _load(rank, world, base)
    live, own = _state(STEP + 1), _own_state(rank, STEP + 1)
    with _checkpointer(_root(base, rank), live, own) as ck:
        ck.save(STEP + 1)
    back = {f"t{i}": torch.zeros(NUMEL) for i in range(TENSORS)}
    mine = {"own": torch.zeros(NUMEL)}
    with _checkpointer(_root(base, rank), back, mine) as ck:
        step = ck.load(strict=False)
        out["next"] = [step, all(torch.equal(back[k], v) for k, v in _state(STEP + 1).items())
                       and torch.equal(mine["own"], own["own"]), ck.steps()]
    return out


def test_primary_node_replaced_adopts_the_copy_of_the_manifest(job):
    """Rank 0's root (the primary, with the step's manifest.json) replaced by an empty one: the
    root holding the copy of the global manifest becomes the primary, both ranks load the step
    bit exact (rank 0's files from its copy), and the next save commits and loads back."""
    _replace_node(job / "n0")
    out = run_ranks(2, _load_then_save, str(job), out=job / "out")
    assert [x["got"] for x in out] == [[STEP, True]] * 2, out
    assert any(_restored(x, 0) for x in out), out
    assert [x["next"] for x in out] == [[STEP + 1, True, [STEP, STEP + 1]]] * 2, out
    assert (_step_dir(job / "n1") / "manifest.json").read_bytes() == \
        (_step_dir(job / "n1") / "copies" / "manifest.json").read_bytes()


def test_a_damaged_copy_of_the_manifest_is_not_adopted(job):
    """Rank 0's root replaced and the copy of the global manifest damaged: no step is committed
    from it, and opening the roots refuses (RootUnavailableError on every rank: the secondary
    step directories are kept), never a load of a manifest its crc32c refutes."""
    _replace_node(job / "n0")
    _flip(_step_dir(job / "n1") / "copies" / "manifest.json")
    out = run_ranks(2, _load, str(job), out=job / "out")
    assert all(x["untouched"] for x in out) and [x["got"][0] for x in out] == ["RankFailedError",
                                                                             "RootUnavailableError"], out
    assert "holds no committed step" in out[1]["got"][1] and "RootUnavailableError" in out[0]["got"][1], out
    assert not (_step_dir(job / "n1") / "manifest.json").exists() and _data_file(job / "n1", 1).exists()


@pytest.mark.parametrize("rows, problem", [
    ([[1]], "replicas table is malformed"),
    ([[1], 0], "replicas table is malformed"),
    ([[2], [0]], "replicas table is malformed"),
    ([[1], [True]], "replicas table is malformed"),
    ([[1, 1], [0]], "replicas table is malformed"),
    ([[0], [0]], "replicas of rank 0 name its own root"),
    ([[1] * 17, [0]], "replicas table is malformed"),
])
def test_hostile_replicas_are_refused(saved, rows, problem):
    """The replicas key is untrusted input: a wrong length, a root out of range or repeated or
    the rank's own, too many: CorruptCheckpointError saying which (its manifest_crc32c right, so
    the parse of the key itself is what refuses)."""
    from gdswriter.errors import CorruptCheckpointError
    from gdswriter.format.copies import replicas_of
    from gdswriter.format.sharded import parse_global

    body = json.loads((_step_dir(saved / "n0") / "manifest.json").read_bytes())
    body.pop("manifest_crc32c")
    body["replicas"] = rows
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    raw = json.dumps({**body, "manifest_crc32c": crc32c.crc32c(canonical)}).encode()
    with pytest.raises(CorruptCheckpointError, match=problem):
        replicas_of(parse_global(raw, "m"), "m")


@pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")
def test_simulated_nodes_replaced_restore_from_the_copies(tmp_path):
    """On the kill-a-node harness (tests/support/nodes.py: each node its own namespaces, hostname
    and /local_nvme): node 1 replaced (an empty disk), both ranks load bit exact from the copy,
    and node0 says it served it; in a second cluster node 0, the primary, replaced: the copy of
    the manifest on node 1 is adopted, the step loads bit exact and the job saves on."""
    root = f"{NVME}/ckpt"
    for lost in (1, 0):
        c = Cluster(tmp_path / f"lost{lost}", nodes=2)
        try:
            c.run(_save, root)
            _add_copies([c.nvme_dir(k) / "ckpt" for k in range(2)])
            c.replace_node(lost)
            out = c.run(_load if lost else _load_then_save, root)
        finally:
            c.close()
        assert [x["got"] for x in out] == [[STEP, True]] * 2, out
        said = [w for x in out for w in x["warnings"] if f"restored rank {lost}'s files" in w]
        assert said and f"(node{1 - lost})" in said[0], out
        if not lost:
            assert [x["next"] for x in out] == [[STEP + 1, True, [STEP, STEP + 1]]] * 2, out


# ----------------------------------------------------------------------------- fewer ranks, real copies
def _replicated(rank: int, base: str, holder: dict):
    """Rank ``rank`` on host node<rank> (GDSWRITER_HOSTNAME), its root ``base``/n<rank>, replicas=2,
    ``holder`` its model (replicated state: written once, split over the ranks)."""
    import os

    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    return GDSCheckpointer(holder, root=Path(base, f"n{rank}"), options=small_options(),
                           dist_options=DistOptions(timeout_s=60, replicas=2))


def _save_replicated(rank: int, world: int, base: str) -> int | None:
    with _replicated(rank, base, _state(STEP)) as ck:
        ck.save(STEP)
        return ck.wait_protected(120)


def _load_replicated(rank: int, world: int, base: str) -> list:
    holder = {k: torch.zeros(NUMEL) for k in _state(STEP)}
    with _replicated(rank, base, holder) as ck:
        got = ck.load()
    return [got, all(torch.equal(holder[k].view(torch.int32), v.view(torch.int32)) for k, v in _state(STEP).items())]


def test_fewer_ranks_after_a_node_lost_reshard_from_the_copy(tmp_path):
    """3 ranks on 3 hosts save with replicas=2 (real copies); node 2's root is lost, and the job
    restarts on 2 ranks: the reshard reads rank 2's files from their copy (in its copies folder)
    and loads bit exact (it once refused the copy's path as "not a plain file name")."""
    assert run_ranks(3, _save_replicated, str(tmp_path), out=tmp_path / "out") == [STEP] * 3
    shutil.rmtree(tmp_path / "n2")
    (tmp_path / "n2").mkdir()
    assert run_ranks(2, _load_replicated, str(tmp_path), out=tmp_path / "out2") == [[STEP, True]] * 2
