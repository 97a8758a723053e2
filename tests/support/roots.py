"""Jobs whose ranks are nodes with roots of their own (``n0``, ``n1``, ...): copy_nodes, a
fresh copy of a saved job's roots (their root ids travel with them) for one test to damage,
some replaced by empty roots; a two-step replicas=2 job (replica_state, open_replica_node,
save_protected_steps)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from support.models import small_options


def copy_nodes(saved: Path, base: Path, count: int, *, replaced: tuple[int, ...] = ()) -> Path:
    """``base/n<k>`` for k < ``count``: ``saved/n<k>`` copied, or an empty directory where k is in
    ``replaced`` (a node replaced by one with an empty disk). Returns ``base``."""
    for k in range(count):
        if k in replaced:
            (base / f"n{k}").mkdir(parents=True)
        else:
            shutil.copytree(saved / f"n{k}", base / f"n{k}")
    return base


MiB = 1 << 20


def replica_state(step: int) -> dict:
    """Three 4 MiB tensors, the same on every rank (each rank writes its share)."""
    g = torch.Generator().manual_seed(700 + step)
    return {f"t{i}": torch.randn(MiB, generator=g) for i in range(3)}


def open_replica_node(base: str, rank: int, live: dict, share: bool = True):
    """Rank ``rank``'s checkpointer on ``base/n<rank>`` with replicas=2, each rank a node of its
    own; without ``share`` its ranks pass every piece over the process group (no cross memory,
    no tmpfs)."""
    from gdswriter import GDSCheckpointer
    from gdswriter.distributed import DistOptions

    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    extra = {} if share else {"load_cross_memory": False, "load_share_dir": None}
    return GDSCheckpointer(live, root=Path(base, f"n{rank}"), options=small_options(),
                           dist_options=DistOptions(replicas=2, timeout_s=60, **extra))


def save_protected_steps(rank: int, world: int, base: str) -> None:
    """A run_ranks worker: steps 1 and 2 of replica_state, each protected (its copies on the peer)."""
    live = replica_state(1)
    with open_replica_node(base, rank, live) as ck:
        ck.save(1)
        assert ck.wait_protected() == 1
        for k, v in replica_state(2).items():
            live[k].copy_(v)
        ck.save(2)
        assert ck.wait_protected() == 2
