"""GDSStorageReader reading checkpoints DCP's own FileSystemWriter wrote
(gdswriter/distributed/dcp_fsreader.py): on 1 and 2 real gloo ranks (2 MiB shards, a reshard on
load, a BytesIO item), and what it refuses: a hostile ``.metadata`` pickle, a hostile BytesIO
item, a truncated data file, each with a typed error and nothing run."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support.ranks import run_ranks

from gdswriter.distributed import GDSStorageReader, dcp_errors
from gdswriter.errors import CorruptCheckpointError, UnsafeMetadataError

ROWS = 1024  # 1024 x 1024 fp32: 4 MiB, 2 MiB per rank's shard


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, 1024, generator=torch.Generator().manual_seed(seed))


def _fs_roundtrip(rank: int, world: int, folder: str) -> dict:
    """Save with FileSystemWriter (a sharded DTensor, a plain tensor, a BytesIO item), load with
    GDSStorageReader into the same sharding and into another (Shard(1)), compare bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(_full(1), mesh, [Shard(0)]), "b": _full(2)[:512].clone(),
             "extra": {"lr": 0.25, "names": ["a", "b"], "step": 7}}
    dcp.save(state, checkpoint_id=folder, storage_writer=dcp.FileSystemWriter(folder))
    out = {}
    for name, placement in (("same", Shard(0)), ("resharded", Shard(1))):
        into = {"w": distribute_tensor(torch.zeros(ROWS, 1024), mesh, [placement]), "b": torch.zeros(512, 1024),
                "extra": {"lr": 0.0, "names": [], "step": 0}}
        with dcp_errors():
            dcp.load(into, checkpoint_id=folder, storage_reader=GDSStorageReader())
        out[name] = (torch.equal(into["w"].full_tensor(), _full(1)) and torch.equal(into["b"], _full(2)[:512])
                     and into["extra"] == {"lr": 0.25, "names": ["a", "b"], "step": 7})
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_reads_a_filesystemwriter_checkpoint_on_gloo_ranks(tmp_path, world):
    res = run_ranks(world, _fs_roundtrip, str(tmp_path / "ckpt"), out=tmp_path / "r")
    assert res == [{"same": True, "resharded": True}] * world
    assert (tmp_path / "ckpt" / "__0_0.distcp").is_file()


def _saved(tmp_path: Path, extra=None) -> tuple[Path, dict]:
    folder = tmp_path / "ckpt"
    state = {"w": _full(3), "extra": extra if extra is not None else {"k": 1}}
    dcp.save(state, checkpoint_id=str(folder), storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return folder, {"w": torch.zeros(ROWS, 1024), "extra": {"k": 0}}


class _RunsCommand:
    """What a hostile pickle holds: unpickling it runs a shell command."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_a_hostile_metadata_pickle_is_refused_before_it_runs(tmp_path):
    folder, into = _saved(tmp_path)
    sentinel = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCommand(sentinel)))
    with pytest.raises(UnsafeMetadataError, match="system"), dcp_errors():
        dcp.load(into, checkpoint_id=str(folder), storage_reader=GDSStorageReader(), no_dist=True)
    assert not sentinel.exists()


def test_a_hostile_bytesio_item_is_refused_before_the_planner_unpickles_it(tmp_path):
    """FileSystemWriter torch.saves a BytesIO item, and DCP's planner loads it with
    weights_only=False: the reader restricted-loads it first and refuses it."""
    sentinel = tmp_path / "ran"
    folder, into = _saved(tmp_path, extra=_RunsCommand(sentinel))
    with pytest.raises(UnsafeMetadataError, match="weights_only"), dcp_errors():
        dcp.load(into, checkpoint_id=str(folder), storage_reader=GDSStorageReader(), no_dist=True)
    assert not sentinel.exists()


def test_a_truncated_data_file_is_refused_before_it_is_read(tmp_path):
    folder, into = _saved(tmp_path)
    data = folder / "__0_0.distcp"
    os.truncate(data, data.stat().st_size - 100)
    with pytest.raises(CorruptCheckpointError, match="past the file's"), dcp_errors():
        dcp.load(into, checkpoint_id=str(folder), storage_reader=GDSStorageReader(), no_dist=True)


def test_a_claimed_length_is_checked_before_it_is_allocated(tmp_path):
    """A pickle whose BINBYTES8 claims 512 MiB in a file of a few bytes: refused, with no
    allocation of the claimed size (the C unpickler allocates a counted argument before reading it)."""
    import struct
    import tracemalloc

    folder, into = _saved(tmp_path)
    (folder / ".metadata").write_bytes(b"\x80\x05\x8e" + struct.pack("<Q", 512 << 20) + b"short")
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError), dcp_errors():
            dcp.load(into, checkpoint_id=str(folder), storage_reader=GDSStorageReader(), no_dist=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_metadata_that_is_not_dcps_is_a_typed_error(tmp_path):
    """A garbled pickle, or a pickle of another allowed object (a dict), is CorruptCheckpointError."""
    folder, into = _saved(tmp_path)
    for junk in (b"\x80\x04garbage", pickle.dumps({"not": "metadata"})):
        (folder / ".metadata").write_bytes(junk)
        with pytest.raises(CorruptCheckpointError), dcp_errors():
            dcp.load(into, checkpoint_id=str(folder), storage_reader=GDSStorageReader(), no_dist=True)
