"""A power cut on a peer's root during the replication (issue 39; the FUSE power-loss file
system of tests/powerloss/, as tests/test_powerloss.py uses it).

Two gloo ranks on two simulated nodes: rank 0's root is a plain directory (the primary), rank
1's root lies on the power-loss mount. As rank 1 starts replicating step 1 (it receives rank 0's
copy), the mount is armed to cut the power at its k-th durability call from then on, for k =
0, 1, ... until a cut no longer falls before rank 1 reports its copy (the step then becomes
protected). For each cut and each disk state the cut may leave (the durable one, and the ``lag``
and ``drop`` variants where pending changes partly reached the disk): rank 1's root never holds a
copy under its final name (``copies/rank00000``, ``copies/manifest.json``) whose bytes differ
from rank 0's files; the step is committed on the primary and not protected, unless rank 1
reported its copy durable before the cut: then every disk state holds the whole copy.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest
import torch

from gdswriter import DistOptions, GDSCheckpointer
from gdswriter.format.commit import step_dir_name
from powerloss.harness import PowerLossMount, require_fuse
from support.ranks import caught, run_ranks

MiB = 1 << 20
VARIANTS = "lag,drop"
MAX_CUTS = 24


@pytest.fixture(scope="module")
def fuse(tmp_path_factory):
    """Skip where FUSE cannot work at all; fail where only the project's set-up is missing."""
    require_fuse(tmp_path_factory.mktemp("fuse-probe"))


def state() -> dict:
    g = torch.Generator().manual_seed(900)
    return {"a": torch.randn(MiB, generator=g), "b": torch.randint(0, 1 << 30, (MiB,), generator=g)}


class _ArmAtReplication(logging.Handler):
    """Arms the power cut (``arm syncs k``, over the mount's control socket) as this rank begins
    replicating step 1: the cut falls on its k-th durability call from then on."""

    def __init__(self, control: str, k: int):
        super().__init__(logging.DEBUG)
        self.control, self.k = control, k

    def emit(self, record: logging.LogRecord) -> None:
        if "replicates step 1 " in record.getMessage():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.control)
                s.sendall(f"arm syncs {self.k} {VARIANTS}\n".encode())
                assert json.loads(s.makefile().readline())["ok"]


def _save_cut(rank: int, world: int, tmp: str, mnt: str, control: str, k: int) -> dict:
    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    root = f"{tmp}/n0" if rank == 0 else f"{mnt}/n1"
    ck = GDSCheckpointer(state(), root=root, dist_options=DistOptions(replicas=2, timeout_s=60))
    if rank == 1:
        log = logging.getLogger("gdswriter")
        log.setLevel(logging.DEBUG)
        log.addHandler(_ArmAtReplication(control, k))
    ck.save(1)
    error = caught(ck.wait_protected)
    caught(ck.close)  # rank 1's root is gone
    return {"error": error}


def _check_image(n0: Path, n1: Path, where: str) -> str:
    """No copy under its final name differs from the original; returns what the image holds."""
    copies = n1 / step_dir_name(1) / "copies"
    final = copies / "rank00000"
    if final.exists():
        for p in final.iterdir():
            assert p.read_bytes() == (n0 / step_dir_name(1) / p.name).read_bytes(), f"{where}: {p} differs"
        assert sorted(p.name for p in final.iterdir()) == sorted(
            p.name for p in (n0 / step_dir_name(1)).iterdir() if p.name.startswith(("data-", "manifest-rank"))), where
    if (copies / "manifest.json").exists():
        assert (copies / "manifest.json").read_bytes() == (n0 / step_dir_name(1) / "manifest.json").read_bytes(), where
    return "copy" if final.exists() else "no copy"


@pytest.mark.slow  # 2.5-5 minutes: a cut at each of 8 durability calls, 3 disk images each
def test_power_cut_on_a_peer_during_replication_never_leaves_a_bad_copy(fuse, tmp_path):
    seen: dict[str, int] = {}
    for k in range(MAX_CUTS):
        base = tmp_path / f"cut{k}"
        mnt, work = base / "mnt", base / "fs"
        with PowerLossMount(mnt, work, variants=VARIANTS) as fs:
            got = run_ranks(2, _save_cut, str(base), str(mnt), str(fs.socket), k, out=base / "out")
            info = fs.cut_result()
        n0 = base / "n0"
        assert (n0 / step_dir_name(1) / "manifest.json").exists()  # committed on the primary, whatever the cut
        if info is None:  # the k-th call came after the replication: the step is protected
            assert got[0]["error"] is None and (n0 / step_dir_name(1) / "protected").exists(), got
            assert k > 3, f"a cut at every durability call of the copy was expected, but {k} sufficed"
            break
        protected = (n0 / step_dir_name(1) / "protected").exists()
        if protected:  # the cut hit the copies' own marker, after the verdict
            assert got[0]["error"] is None, got
        else:
            assert got[0]["error"] is not None and got[0]["error"][0] == "ReplicationError", got
            assert "step 1 is committed but not protected" in got[0]["error"][1], got
        for digest, names in info["images"].items():
            with PowerLossMount(mnt, base / f"img-{digest}", image=fs.image_path(digest)):
                held = _check_image(n0, mnt / "n1", f"cut {k} ({info['refused']}), image {names}")
            seen[held] = seen.get(held, 0) + 1
            assert held == "copy" or not protected, f"cut {k}, image {names}: step 1 is protected, its copy is lost"
    else:
        pytest.fail(f"{MAX_CUTS} cuts and the replication still had not ended")
    assert seen.get("copy") and seen.get("no copy"), seen  # the sweep saw both sides of the rename
