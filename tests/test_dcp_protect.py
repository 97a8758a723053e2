"""The DCP plug-in and the protection of issue 39: GDSStorageWriter refuses parity
(GDSCheckpointer provides it; a DCP step is one format 1.2 manifest that it does not handle
yet) and copies in one process rather than ignore them, and GDSStorageReader never loads wrong
bytes from a lost node's root or a damaged file of a step without copies: it raises a typed error
on every rank (with copies: tests/test_dcp_replicas.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

NUMEL = 1 << 20  # 4 MiB of float32: above the small-copy thresholds


def _engine():
    from support.models import small_engine

    return small_engine()


@pytest.mark.parametrize("kind", ["single_process_replicas", "parity", "env_parity"])
def test_the_writer_refuses_protection_it_cannot_give(tmp_path, monkeypatch, kind):
    """In one process (single_process=True) copies and parity have no peer node: each raises
    InvalidOptionError at construction, naming the option, its source (the environment) and the
    fix; no file is made. Without the refusal the writer took the option and saved unprotected
    steps."""
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import DistOptions, GDSStorageWriter
    from gdswriter.errors import InvalidOptionError

    for var in ("GDSWRITER_REPLICAS", "GDSWRITER_PARITY_GROUP"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "ckpt"
    options = CheckpointOptions(engine=_engine())
    dist_options = None
    if kind == "single_process_replicas":
        dist_options = DistOptions(replicas=2)
    elif kind == "parity":
        dist_options = DistOptions(parity_group=3)
    else:
        monkeypatch.setenv("GDSWRITER_PARITY_GROUP", "2")
    with pytest.raises(InvalidOptionError) as got:
        GDSStorageWriter(root, options=options, dist_options=dist_options,
                         single_process=True)
    msg = str(got.value)
    assert "no peer nodes" in msg, msg
    expected = {"single_process_replicas": "replicas=2", "parity": "parity_group=3",
                "env_parity": "GDSWRITER_PARITY_GROUP"}[kind]
    assert expected in msg, msg
    assert not root.exists() and not (tmp_path / "shared").exists()


def test_the_writer_saves_with_the_default_protection_options(tmp_path, monkeypatch):
    """The control: replicas=1, no parity, no drain root save and load back bit-exact."""
    import torch.distributed.checkpoint as dcp

    from gdswriter import CheckpointOptions
    from gdswriter.distributed import DistOptions, GDSStorageReader, GDSStorageWriter

    for var in ("GDSWRITER_REPLICAS", "GDSWRITER_PARITY_GROUP"):
        monkeypatch.delenv(var, raising=False)
    sd = {"w": torch.randn(NUMEL)}
    w = GDSStorageWriter(tmp_path / "ckpt", options=CheckpointOptions(engine=_engine()),
                         dist_options=DistOptions(replicas=1))
    dcp.save(sd, storage_writer=w, no_dist=True)
    w.close()
    back = {"w": torch.zeros(NUMEL)}
    dcp.load(back, storage_reader=GDSStorageReader(tmp_path / "ckpt", engine_options=_engine()), no_dist=True)
    assert torch.equal(back["w"], sd["w"])


def _damage_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter, dcp_errors
    from support.ranks import caught

    root = Path(tmp, f"node{rank}")  # node-local roots: each rank a node of its own
    gen = torch.Generator().manual_seed(7)
    saved = [{"rep": torch.randn(NUMEL, generator=gen)} for _ in range(2)]  # the same on every rank: split
    w = GDSStorageWriter(root, options=CheckpointOptions(engine=_engine()))
    for step, sd in enumerate(saved):
        w.reset(step)
        dcp.save(sd, storage_writer=w)
    w.close()
    torch.distributed.barrier()

    def load(step: int) -> tuple[list[str] | None, bool]:
        back = {"rep": torch.zeros(NUMEL)}

        def run() -> None:
            with dcp_errors():
                dcp.load(back, storage_reader=GDSStorageReader(root, step, engine_options=_engine()))
        got = caught(run)
        return got, torch.equal(back["rep"], saved[step]["rep"])

    out: dict = {"intact": load(1)}
    torch.distributed.barrier()
    if rank == 1:  # one byte flipped in a data file of step 1 that rank 1's node holds
        data = sorted(p for p in (root / "step_000000000001").iterdir() if p.suffix == ".bin")[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    torch.distributed.barrier()
    out["flipped"] = load(1)
    out["older"] = load(0)
    torch.distributed.barrier()
    if rank == 1:  # rank 1's node replaced: its root is an empty directory
        shutil.rmtree(root)
        root.mkdir()
    torch.distributed.barrier()
    out["wiped"] = load(0)
    return out


def test_the_reader_never_loads_wrong_bytes_from_a_damaged_or_lost_node(tmp_path):
    """Two ranks on node-local roots save two steps of a 4 MiB tensor (split between them). A
    byte flipped in rank 1's data file of step 1: the load of step 1 raises a checksum error on
    every rank, and step 0 still loads bit-exact; rank 1's root wiped (a replaced node): the load
    raises StepFilesLostError on every rank, naming the lost root (not a step deleted while read).
    Saved without copies on peer nodes, so these are errors, never a fallback."""
    res = run_ranks(2, _damage_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, x in enumerate(res):
        assert x["intact"] == [None, True], (rank, x)
        err, _ = x["flipped"]
        assert err is not None and ("ChecksumMismatch" in err[0] or "crc32c" in err[1]), (rank, err)
        assert x["older"] == [None, True], (rank, x)
        err, _ = x["wiped"]
        assert err is not None and err[0] == "StepFilesLostError" and "replaced node" in err[1], (rank, err)
