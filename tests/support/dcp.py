"""What the DCP plug-in's multi-rank tests share (test_dcp_replicas.py, test_dcp_drain.py,
test_dcp_parity.py): the state of a step (two 4 MiB tensors, above the small-copy thresholds,
the same on every rank: DCP splits them), a writer on a rank's own node, a verified load of a
step with the warnings it logged, a flipped byte."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from support.ranks import WarningLines, caught

MiB = 1 << 20


def engine() -> Any:
    from support.models import small_engine

    return small_engine()


def dcp_state(seed: int, step: int) -> dict:
    """Two 4 MiB tensors whose values depend on ``seed`` and ``step``."""
    g = torch.Generator().manual_seed(seed + step)
    return {"a": torch.randn(MiB, generator=g), "b": torch.randint(0, 1 << 30, (MiB,), generator=g)}


def node_writer(rank: int, root: Path, **options: Any) -> Any:
    """A GDSStorageWriter on ``root`` for a rank that stands for node ``node<rank>``
    (GDSWRITER_HOSTNAME: its copies and parity go to other ranks), with ``options`` as
    DistOptions (timeout_s: 120 unless given), or as CheckpointOptions for the drain and its
    retention (``drain_root``, ``drain_every``, ``keep_last``, ``keep_every``, ``drain_keep_last``)
    and ``files_per_root``."""
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import DistOptions, GDSStorageWriter

    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    ck = {k: options.pop(k) for k in ("drain_root", "drain_every", "keep_last", "keep_every", "drain_keep_last",
                                      "files_per_root") if k in options}
    return GDSStorageWriter(root, options=CheckpointOptions(engine=engine(), **ck),
                            dist_options=DistOptions(**{"timeout_s": 120.0, **options}))


def dcp_load(root: Path, step: int, want: dict, reader: Any = None) -> tuple[list[str] | None, bool, list[str]]:
    """(error, bit-exact against ``want``, warnings) of a DCP load of ``step`` on this rank
    (through ``reader``, a GDSStorageReader, where given)."""
    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import GDSStorageReader, dcp_errors

    back = {k: torch.zeros_like(v) for k, v in want.items()}
    lines = WarningLines()
    logging.getLogger().addHandler(lines)

    def run() -> None:
        with dcp_errors():
            dcp.load(back, storage_reader=reader or GDSStorageReader(root, step, engine_options=engine()))
    try:
        got = caught(run)
    finally:
        logging.getLogger().removeHandler(lines)
    return got, all(torch.equal(back[k], v) for k, v in want.items()), lines.lines


def flip(path: Path) -> None:
    """One byte in the middle of ``path`` flipped."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def save_two_steps(rank: int, root: Path, state: Any, **options: Any) -> list:
    """Steps 0 (dcp.save) and 1 (dcp.async_save, which returns at the commit: the protection
    follows) of ``state(step)`` through ``node_writer(rank, root, **options)``; the protected
    step after each."""
    import torch.distributed.checkpoint as dcp

    w = node_writer(rank, root, **options)
    w.reset(0)
    dcp.save(state(0), storage_writer=w)
    first = w.wait_protected()
    w.reset(1)
    dcp.async_save(state(1), storage_writer=w).result()
    second = w.wait_protected()
    w.close()
    return [first, second]


def refilled(reader: Any) -> Any:
    """What ``reader.wait_refilled(120)`` returned (the step refilled, or None), or its error."""
    got: list = []
    err = caught(lambda: got.append(reader.wait_refilled(120)))
    return err if err is not None else got[0]


def load_refilled(root: Path, step: int, want: dict) -> dict:
    """Collective: step ``step`` loaded from ``root`` by a GDSStorageReader (checked against
    ``want``), then its refill waited for: {"load": the load's outcome (errors, ok), "refilled":
    what wait_refilled returned}."""
    from gdswriter.distributed import GDSStorageReader

    reader = GDSStorageReader(root, 1, engine_options=engine())
    out = {"load": dcp_load(root, step, want, reader)[:2], "refilled": refilled(reader)}
    reader.close()
    return out


def load_with_parity_refill_stopped(root: Path, step: int, want: dict, replaced: bool) -> dict:
    """Collective, after a DCP parity step was saved: this rank's root emptied (``replaced``: its
    node replaced), then a load of ``step`` whose refill stops (GDSWriterError) once the lost
    rank's files landed, before its parity block is re-created. {"first": the load's outcome,
    "stopped": the refill's}."""
    import shutil

    import gdswriter.distributed.dcp_refill as dcp_refill
    from gdswriter.distributed import GDSStorageReader
    from gdswriter.errors import GDSWriterError

    torch.distributed.barrier()
    if replaced:
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()
    real = dcp_refill.refill_lane_stripes

    def stopped(*args: Any, **kwargs: Any) -> None:
        raise GDSWriterError("killed")
    dcp_refill.refill_lane_stripes = stopped
    try:
        reader = GDSStorageReader(root, step, engine_options=engine())
        out = {"first": dcp_load(root, step, want, reader)[:2], "stopped": refilled(reader)}
        reader.close()
    finally:
        dcp_refill.refill_lane_stripes = real
    return out
