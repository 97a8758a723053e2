"""A received copy's writes (distributed/replicastream.py, Incoming.write) at replication's
sizes: pieces of 32 MiB spanning files land at their offsets, and a write the kernel cuts short
goes on where it stopped, its refusal failing the copy with the write's errno (never ignored)."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
from pathlib import Path

import crc32c
import pytest

from gdswriter.distributed.replicastream import Incoming, Outgoing, Source
from gdswriter.engines.buffers import AlignedBufferPool
from gdswriter.errors import EngineIOError
from gdswriter.format.manifest import ChunkRecord
from gdswriter.format.replicas import copy_dir_name

PIECE = 32 << 20  # as the replication's pieces (replicastream.PIECE_BYTES)
MIB = 1 << 20


def _file(tmp_path: Path, name: str, size: int) -> Source:
    data = os.urandom(size)
    path = tmp_path / name
    path.write_bytes(data)
    return Source("data", name, size, path=path, chunks=(ChunkRecord(0, 0, 0, size, crc32c.crc32c(data)),))


def _stream(sources: list[Source], copies: Path) -> Incoming:
    """``sources`` through Outgoing into an Incoming in PIECE pieces, published from the trailer."""
    out = Outgoing(sources, None)
    copies.mkdir(exist_ok=True)
    inc = Incoming(copies, 0, out.header)
    try:
        with AlignedBufferPool(PIECE, 1) as pool:
            view, sent = pool.buffers[0].view, 0
            while sent < out.total:
                n = out.fill(view[:min(PIECE, out.total - sent)])
                inc.write(view[:n])
                sent += n
        out.close()
        inc.publish(json.loads(out.trailer()))
    except BaseException:
        out.close()
        inc.discard()
        raise
    return inc


def test_pieces_spanning_files_land_at_their_offsets(tmp_path):
    """Files spanning pieces and ending inside one: each copy is its file byte for byte (every
    write at its own offset, the padding cut off)."""
    sources = [Source("shard", "manifest-rank00000.json", 5, data=b"shard"),
               _file(tmp_path, "data-a.bin", 2 * PIECE + 12 * MIB + 123),
               _file(tmp_path, "data-b.bin", 8 * MIB + 4096)]
    _stream(sources, tmp_path / "copies")
    for s in sources[1:]:
        assert (tmp_path / "copies" / copy_dir_name(0) / s.name).read_bytes() == s.path.read_bytes(), s.name


def test_a_write_cut_short_goes_on_and_its_refusal_fails_the_copy(tmp_path):
    """A 20 MiB copy under a 12 MiB file size limit: the kernel writes 12 MiB of the piece (a
    short write), the write goes on from there and is refused (EFBIG): the copy fails with that
    write's errno and offset (not later, at the ftruncate), no copy published."""
    src = [_file(tmp_path, "data-a.bin", 20 * MIB)]
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 * MIB, old_limit[1]))
    try:
        with pytest.raises(EngineIOError) as e:
            _stream(src, tmp_path / "copies")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert e.value.errno == errno.EFBIG and str(e.value).startswith("write failed"), e.value  # not the ftruncate
    assert e.value.offset == 12 * MIB, e.value
    assert not (tmp_path / "copies" / copy_dir_name(0)).exists()
