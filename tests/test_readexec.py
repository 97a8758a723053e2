"""distributed/readexec.py, the one executor of the multi-rank reads, without ranks: a pure read
plan carried out on real files through a real engine; checksums, damage as the outcome, a step
deleted meanwhile, the checks of chunks that arrive whole later."""

from __future__ import annotations

from pathlib import Path

import crc32c
import pytest
import torch

from gdswriter import EngineOptions, create_engine
from gdswriter.errors import CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError
from gdswriter.format.commit import step_dir_name
from gdswriter.format.manifest import ChunkRecord, FileRecord
from gdswriter.distributed.readexec import ChunkCheck, RangeRead, ReadPlan, check_chunks, chunk_range, execute

STEP = 3


def _step(root: Path, blobs: dict[str, bytes]) -> tuple[FileRecord, ...]:
    """Data files of step STEP under ``root`` (no manifest: the step counts as deleted)."""
    d = root / step_dir_name(STEP)
    d.mkdir(parents=True)
    for name, data in blobs.items():
        (d / name).write_bytes(data)
    return tuple(FileRecord(0, name, len(data)) for name, data in blobs.items())


@pytest.fixture()
def engine():
    with create_engine(EngineOptions(buffer_bytes=1 << 20, num_buffers=2)) as e:
        yield e


def _data(n: int, seed: int) -> bytes:
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy())


def _committed(root: Path) -> None:
    """Leave the step committed as read: a step that vanished is judged by its manifest."""
    (root / step_dir_name(STEP) / "manifest.json").write_text('{"created_unix": 0.0}')


def test_a_plan_fills_given_and_allocated_buffers_and_checks_whole_chunks(tmp_path, engine):
    a, b = _data(3 << 20, 1), _data(5000, 2)
    files = _step(tmp_path, {"a.bin": a, "b.bin": b})
    given = torch.zeros(len(b), dtype=torch.uint8)
    reads = (RangeRead(0, 0, 1 << 20, "x", 0, crc32c.crc32c(a[:1 << 20]), "x"),
             RangeRead(0, 2 << 20, 1 << 20, "x", 1 << 20, None, "x"),  # a part: not checked here
             RangeRead(1, 0, len(b), 7, 0, crc32c.crc32c(b), "y"))
    out = execute(ReadPlan(STEP, 0.0, files, reads, (("x", 2 << 20), (7, len(b)))), [tmp_path], engine, verify=True,
                  given={7: given})
    assert out.error is None and not out.damaged
    assert bytes(out.buffers["x"].numpy()) == a[:1 << 20] + a[2 << 20:]
    assert out.buffers[7] is given and bytes(given.numpy()) == b


def test_a_damaged_chunk_is_the_outcome_a_part_is_not_checked(tmp_path, engine):
    """The check that makes damage visible: a flipped byte in a whole chunk is ChecksumMismatchError
    in the outcome (nothing raised); without verify, or in a part, it is read as it is."""
    a = bytearray(_data(1 << 20, 3))
    good = crc32c.crc32c(bytes(a))
    a[12345] ^= 0xFF
    files = _step(tmp_path, {"a.bin": bytes(a)})
    _committed(tmp_path)
    c = ChunkRecord(0, 0, 0, len(a), good)
    plan = ReadPlan(STEP, 0.0, files, (chunk_range(c, 0, 0, "w"),), ((0, len(a)),))
    out = execute(plan, [tmp_path], engine, verify=True)
    assert out.damaged and isinstance(out.error, ChecksumMismatchError), out.error
    assert "w" in str(out.error) and "a.bin" in str(out.error)
    assert execute(plan, [tmp_path], engine, verify=False).error is None
    part = ReadPlan(STEP, 0.0, files, (chunk_range(c, 0, 0, "w", 0, 1 << 19),), ((0, len(a)),))
    assert part.reads[0].crc32c is None and execute(part, [tmp_path], engine, verify=True).error is None


def test_a_missing_file_is_damage_unless_the_step_vanished(tmp_path, engine):
    files = _step(tmp_path, {"a.bin": b"x" * 4096})
    plan = ReadPlan(STEP, 0.0, files + (FileRecord(0, "gone.bin", 4096),), (RangeRead(1, 0, 4096, 0, 0, 0, "w"),),
                    ((0, 4096),))
    _committed(tmp_path)
    out = execute(plan, [tmp_path], engine, verify=True)
    assert out.error is not None and not isinstance(out.error, CheckpointNotFoundError), out.error
    (tmp_path / step_dir_name(STEP) / "manifest.json").unlink()  # the step was deleted meanwhile
    out = execute(plan, [tmp_path], engine, verify=True)
    assert isinstance(out.error, CheckpointNotFoundError) and not out.damaged, out.error


def test_a_failed_allocation_is_the_outcome(tmp_path, engine):
    files = _step(tmp_path, {"a.bin": b"x" * 4096})

    def refuse(n: int) -> torch.Tensor:
        raise MemoryError(f"no {n} bytes")

    out = execute(ReadPlan(STEP, 0.0, files, (RangeRead(0, 0, 4096, 0, 0, None, "w"),), ((0, 4096),)), [tmp_path],
                  engine, verify=True, alloc=refuse)
    assert isinstance(out.error, MemoryError) and out.buffers == {}


def test_check_chunks_names_where_a_chunk_came_from():
    buf = torch.arange(64, dtype=torch.uint8)
    ok = ChunkCheck("b", 8, 16, crc32c.crc32c(bytes(buf[8:24].numpy())), "<chunk received from rank 1>", "n", 100)
    check_chunks([ok], {"b": buf})
    bad = ChunkCheck("b", 8, 16, ok.crc32c ^ 1, "<chunk received from rank 1>", "n", 100)
    with pytest.raises(ChecksumMismatchError, match="rank 1") as e:
        check_chunks([ok, bad], {"b": buf})
    assert isinstance(e.value, CorruptCheckpointError)
