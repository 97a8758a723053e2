"""A replication's bytes with direct I/O (distributed/replicastream.py): every file takes whole
4 KiB blocks of the stream, read and written with O_DIRECT, the padding never checksummed nor
left in a copy; the step's files and their copies bypass the page cache; a short or damaged
source still stops the copy."""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from pathlib import Path

import crc32c
import pytest
import torch

from gdswriter.engines.buffers import AlignedBufferPool
from gdswriter.errors import ChecksumMismatchError, EngineIOError
from gdswriter.format.manifest import ChunkRecord
from gdswriter.distributed.replicastream import Incoming, Outgoing, Source

from support.ranks import run_ranks

SIZES = (0, 1, 4095, 4097, (5 << 20) + 3)  # empty, under a block, around one, across a piece of 4 MiB
PIECE = 4 << 20


def _files(tmp_path: Path) -> list[Source]:
    """A shard in memory, then data files of SIZES on disk, each one chunk per MiB."""
    out = [Source("shard", "manifest-rank00000.json", 5, data=b"shard")]
    for i, n in enumerate(SIZES):
        data = secrets.token_bytes(n)
        path = tmp_path / f"data-rank0-{i}.bin"
        path.write_bytes(data)
        chunks = tuple(ChunkRecord(i, o, o, min(1 << 20, n - o), crc32c.crc32c(data[o:o + (1 << 20)]))
                       for o in range(0, n, 1 << 20))
        out.append(Source("data", path.name, n, path=path, chunks=chunks))
    return out


def _stream(sources: list[Source], copies: Path) -> Incoming:
    """``sources`` through Outgoing into an Incoming, in PIECE pieces of an aligned buffer, as the
    pipeline moves them; published from the sender's trailer."""
    import json

    out = Outgoing(sources, None)
    copies.mkdir(exist_ok=True)
    inc = Incoming(copies, 0, out.header)
    with AlignedBufferPool(PIECE, 1) as pool:
        view = pool.buffers[0].view
        sent = 0
        while sent < out.total:
            n = out.fill(view[:min(PIECE, out.total - sent)])
            inc.write(view[:n])
            sent += n
    out.close()
    inc.publish(json.loads(out.trailer()))
    return inc


def test_odd_sizes_round_trip_byte_identical(tmp_path):
    """Files of 0, 1, 4095, 4097 and 5 MiB + 3 bytes: the stream pads each to whole blocks
    (its total a multiple of 4 KiB), and each copy is its source byte for byte, padding cut off."""
    sources = _files(tmp_path)
    assert Outgoing(sources, None).total % 4096 == 0
    _stream(sources, tmp_path / "copies")
    got = tmp_path / "copies" / "rank00000"
    assert (got / "manifest-rank00000.json").read_bytes() == b"shard"
    for s in sources[1:]:
        assert (got / s.name).read_bytes() == s.path.read_bytes(), s.name
        assert (got / s.name).stat().st_size == s.size


def test_a_truncated_source_is_not_copied(tmp_path):
    """A data file shorter than its shard says (cut inside its last block): the sender's trailer
    carries the error, and the copy is refused, never published."""
    sources = _files(tmp_path)
    big = sources[-1]
    os.truncate(big.path, big.size - 2)
    with pytest.raises(Exception) as e:
        _stream(sources, tmp_path / "copies")
    assert "could not send its files" in str(e.value) and "shorter" in str(e.value), e.value
    assert not (tmp_path / "copies" / "rank00000").exists()


def test_a_flipped_byte_in_the_padding_block_is_caught(tmp_path):
    """A flipped byte in the last, partly filled block of a source: its chunk's crc32c stops the
    copy (the padding read with it is never what is checked)."""
    sources = _files(tmp_path)
    big = sources[-1]
    data = bytearray(big.path.read_bytes())
    data[-1] ^= 1
    big.path.write_bytes(bytes(data))
    out = Outgoing(sources, None)
    with AlignedBufferPool(PIECE, 1) as pool:
        while out.fill(pool.buffers[0].view) and out.error is None:
            pass
    out.close()
    assert isinstance(out.error, ChecksumMismatchError), out.error


def _resident(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore over a read-only mapping of it)."""
    size = path.stat().st_size
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def _save_and_look(rank: int, world: int, base: str) -> dict:
    """A replicas=2 step of 2 x 4 MiB tensors, protected: how many pages of this rank's data files
    and of the copy it holds are in the page cache."""
    from gdswriter import DistOptions, GDSCheckpointer

    os.environ["GDSWRITER_HOSTNAME"] = f"node{rank}"
    state = {f"t{i}": torch.randn(1 << 20, generator=torch.Generator().manual_seed(i)) for i in range(2)}
    root = Path(base, f"n{rank}")
    with GDSCheckpointer(state, root=root, dist_options=DistOptions(replicas=2, timeout_s=60)) as ck:
        ck.save(1)
        assert ck.wait_protected() == 1
    step = root / "step_000000000001"
    own = [p for p in step.glob("data-*") if p.is_file()]
    copies = [p for p in (step / "copies").rglob("data-*") if p.is_file()]
    assert own and copies
    return {"own": sum(_resident(p) for p in own), "copies": sum(_resident(p) for p in copies),
            "bytes": sum(p.stat().st_size for p in copies)}


def test_the_step_and_its_copies_bypass_the_page_cache(tmp_path):
    """On a file system taking O_DIRECT: once the step is protected, neither a rank's own data
    files (read cold by the replication) nor the copies it wrote are in the page cache."""
    probe = tmp_path / "probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT)
        os.close(fd)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    out = run_ranks(2, _save_and_look, str(tmp_path), out=tmp_path / "out")
    for r in out:
        assert r["bytes"] >= 4 << 20, out
        assert r["own"] == 0 and r["copies"] == 0, out


def test_an_error_names_the_file(tmp_path):
    """A source that vanished before its read: a typed EngineIOError in the trailer, naming it."""
    sources = _files(tmp_path)
    sources[-1].path.unlink()
    out = Outgoing(sources, None)
    with AlignedBufferPool(PIECE, 1) as pool:
        while out.fill(pool.buffers[0].view) and out.error is None:
            pass
    out.close()
    assert isinstance(out.error, EngineIOError) and sources[-1].name in str(out.error), out.error
