"""``gdswriter verify --repair`` and then the primary's node lost (issue 39): the repair withdraws
protection everywhere the step claims it, the primary's step directory and each root holding
the global manifest's copy (``copies/refilling`` written, ``copies/protected`` removed), so a
root that adopts the manifest's copy after the primary's node is lost still knows what the
repair set aside: the load's refill re-creates it before the step is marked protected again,
and removes every note (format.md 11.2, *The scrub*). Without that, the refill after the
adoption knew nothing of the set-aside copy and marked the step protected with that copy gone
(house rule 10). Real gloo ranks (each rank its own node-local root, its own
GDSWRITER_HOSTNAME), real files, ``gdswriter verify --repair`` and ``ls`` in real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.dcp import dcp_state, flip, save_two_steps
from support.ranks import caught, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = "step_000000000001"
NODES = 3


def cli(*args: str) -> tuple[int, str]:
    """``gdswriter *args`` in another process: (exit status, output)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    got = subprocess.run([sys.executable, "-c", "import sys; from gdswriter.cli import main; sys.exit(main(sys.argv[1:]))",
                          *args], capture_output=True, text=True, env=env, timeout=300)
    return got.returncode, got.stdout + got.stderr


def verify(roots: list[Path], *more: str) -> tuple[int, str]:
    """``gdswriter verify`` of step 1 over ``roots`` (the primary first)."""
    return cli("verify", str(roots[0]), *[a for r in roots[1:] for a in ("--secondary", str(r))], "--step", "1", *more)


def state_of(root: Path) -> str:
    """What ``gdswriter ls --json`` says of step 1 on ``root``: its state, or "absent"."""
    code, said = cli("ls", "--json", str(root))
    steps = json.loads(said[said.index("["):])[0]["steps"]
    return next((s["state"] for s in steps if s["step"] == 1), "absent")


def holder(roots: list[Path], what: str) -> int:
    """The node whose step 1 holds ``copies/<what>``."""
    return next(k for k, r in enumerate(roots) if (r / STEP / "copies" / what).exists())


def marks(root: Path) -> list[bool]:
    """[protected, copies/protected, copies/refilling] of step 1 on ``root``."""
    return [(root / STEP / n).exists() for n in ("protected", "copies/protected", "copies/refilling")]


def replace_node(root: Path) -> None:
    """A new machine: the root an empty directory (it gets a new id)."""
    shutil.rmtree(root)
    root.mkdir()


def damage_repair_and_lose_the_primary(roots: list[Path]) -> tuple[int, int]:
    """Step 1 protected on 3 nodes: the copy of a rank other than 0 held on a node other than
    the primary's is damaged (a byte flipped), found and set aside by ``verify --repair``; the
    repair withdraws protection on the primary and on the manifest copy's holder; then the
    primary's node is replaced. (rank whose copy was set aside, the node that held it)."""
    assert verify(roots)[0] == 0
    copy_at = {r: holder(roots, f"rank{r:05d}") for r in range(NODES)}
    rank = next(r for r in range(1, NODES) if copy_at[r] != 0)
    flip(next((roots[copy_at[rank]] / STEP / "copies" / f"rank{rank:05d}").glob(f"data-rank{rank}-*.bin")))
    code, said = verify(roots, "--repair")
    assert code == 3 and "set aside as" in said, said
    keeper = holder(roots, "manifest.json")
    assert keeper != 0 and marks(roots[0]) == [False, False, True], marks(roots[0])
    # every root holding the manifest's copy stops claiming protection, noted as the primary is
    assert marks(roots[keeper]) == [False, False, True], marks(roots[keeper])
    assert (roots[keeper] / STEP / "copies" / "refilling").read_bytes() == \
        (roots[0] / STEP / "copies" / "refilling").read_bytes()
    assert state_of(roots[0]) == "committed" and "refill pending" in cli("ls", str(roots[0]))[1]
    replace_node(roots[0])
    return rank, copy_at[rank]


# ----------------------------------------------------------------------------- GDSCheckpointer
def ck_state(step: int) -> dict:
    g = torch.Generator().manual_seed(900 + step)
    return {"a": torch.randn(1 << 20, generator=g), "b": torch.randint(0, 1 << 30, (1 << 20,), generator=g)}


def _checkpointer(tmp: str, rank: int, holder_: dict):
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    from support.models import small_options

    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    return GDSCheckpointer(holder_, root=f"{tmp}/n{rank}", options=small_options(),
                           dist_options=DistOptions(timeout_s=60, replicas=2))


def _ck_save(rank: int, world: int, tmp: str) -> int | None:
    with _checkpointer(tmp, rank, ck_state(1)) as ck:
        ck.save(1)
        return ck.wait_protected(120)


def _ck_load(rank: int, world: int, tmp: str) -> dict:
    live = {k: torch.zeros_like(v) for k, v in ck_state(1).items()}
    with _checkpointer(tmp, rank, live) as ck:
        got = ck.load(1)
        exact = all(torch.equal(live[k], v) for k, v in ck_state(1).items())
        refilled = caught(lambda: ck.wait_protected(120))
        return {"load": [got, exact], "refilled": refilled, "protected": ck.protected_step()}


def test_a_copy_set_aside_is_re_created_after_the_primarys_node_is_lost(tmp_path):
    """replicas=2 over 3 nodes (GDSCheckpointer): a copy damaged and set aside by ``verify
    --repair``, then the primary's node replaced before any load. The open adopts the manifest's
    copy, whose root holds the refilling note (not ``copies/protected``): ``ls`` says committed
    there; the load (bit-exact) refills the replaced node *and* the copy set aside, and only
    then says protected: ``ls``, ``protected_step()`` and the scrub (exit 0, nothing missing)
    agree; no note is left on any root, nor the ``.damaged-`` evidence."""
    run_ranks(NODES, _ck_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"n{k}" for k in range(NODES)]
    rank, at = damage_repair_and_lose_the_primary(roots)
    keeper = holder(roots, "manifest.json")

    got = run_ranks(NODES, _ck_load, str(tmp_path), out=tmp_path / "load")
    for r, x in enumerate(got):
        assert x["load"] == [1, True] and x["refilled"] is None and x["protected"] == 1, (r, x)
    order = [roots[keeper]] + [p for k, p in enumerate(roots) if k != keeper]  # the adopted primary first
    assert (roots[at] / STEP / "copies" / f"rank{rank:05d}").is_dir()  # the copy set aside: re-created
    code, said = verify(order)
    assert code == 0 and "protection intact" in said, said
    assert state_of(roots[keeper]) == "protected"
    assert marks(roots[keeper]) == [True, True, False], marks(roots[keeper])
    assert not any((p / STEP / "copies" / "refilling").exists() for p in roots)
    assert not any(list((p / STEP / "copies").glob(".damaged-*")) for p in roots)


# ----------------------------------------------------------------------------- the DCP writer (replicas=2)
def dcp_state_of(step: int) -> dict:
    return dcp_state(1100, step)


def _dcp_save(rank: int, world: int, tmp: str) -> list:
    return save_two_steps(rank, Path(tmp, f"n{rank}"), dcp_state_of, replicas=2)


def _dcp_load(rank: int, world: int, tmp: str) -> dict:
    from support.dcp import load_refilled

    return load_refilled(Path(tmp, f"n{rank}"), 1, dcp_state_of(1))


def test_a_dcp_copy_set_aside_is_re_created_after_the_primarys_node_is_lost(tmp_path):
    """The same for a DCP step (GDSStorageWriter, replicas=2 over 3 nodes): the repair notes the
    root holding the manifest's copy; after the primary's node is replaced, the load (bit-exact)
    adopts that copy, its refill re-creates the replaced node's files and the copy set aside,
    then marks the step protected: ``ls`` and the scrub agree, and no note is left anywhere."""
    run_ranks(NODES, _dcp_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"n{k}" for k in range(NODES)]
    rank, at = damage_repair_and_lose_the_primary(roots)
    keeper = holder(roots, "manifest.json")

    got = run_ranks(NODES, _dcp_load, str(tmp_path), out=tmp_path / "load")
    for r, x in enumerate(got):
        assert x["load"] == [None, True] and x["refilled"] == 1, (r, x)
    assert (roots[at] / STEP / "copies" / f"rank{rank:05d}").is_dir()
    code, said = verify([roots[keeper]] + [p for k, p in enumerate(roots) if k != keeper])
    assert code == 0 and "protection intact" in said, said
    assert state_of(roots[keeper]) == "protected"
    assert not any(list((p / STEP / "copies").glob("refilling")) for p in roots)
    assert not any(list((p / STEP / "copies").glob(".damaged-*")) for p in roots)
