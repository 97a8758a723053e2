"""A replication stream's checksums (distributed/replicastream.py): the sender checksums each
byte once (each chunk checked against its shard, each file's crc32c, the trailer's, built from
the chunks' recorded crc32c and the bytes between them), and the receiver still refuses a copy
whose bytes differ from the sender's."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import crc32c
import pytest

from gdswriter.engines.buffers import AlignedBufferPool
from gdswriter.errors import ChecksumMismatchError
from gdswriter.format.manifest import ChunkRecord
from gdswriter.distributed.replicastream import Incoming, Outgoing, Pipeline, Source

PIECE = 12 << 10  # three blocks: chunks span pieces, pieces span files


def _file(tmp_path: Path, name: str, size: int, spans: list[tuple[int, int]]) -> Source:
    """A data file of ``size`` random bytes whose shard records chunks at ``spans`` (offset, length)."""
    data = secrets.token_bytes(size)
    path = tmp_path / name
    path.write_bytes(data)
    chunks = tuple(ChunkRecord(i, o, o, n, crc32c.crc32c(data[o:o + n])) for i, (o, n) in enumerate(spans))
    return Source("data", name, size, path=path, chunks=chunks)


def _sources(tmp_path: Path) -> list[Source]:
    return [Source("shard", "manifest-rank00000.json", 5, data=b"shard"),
            _file(tmp_path, "data-a.bin", 50_001, [(0, 20_000), (20_000, 30_001)]),  # chunks cover it all
            _file(tmp_path, "data-b.bin", 40_000, [(100, 9_000), (13_000, 4), (30_000, 5_000)]),  # bytes between
            _file(tmp_path, "data-c.bin", 30_000, [(0, 12_288), (12_288, 4_096), (16_384, 13_616)]),  # on pieces
            _file(tmp_path, "data-d.bin", 7_000, [])]  # no chunk at all


def _send(sources: list[Source], copies: Path, damage: int | None = None) -> Incoming:
    """``sources`` through Outgoing into an Incoming in PIECE pieces (byte ``damage`` of the
    stream flipped on the way), published from the sender's trailer."""
    out = Outgoing(sources, None)
    copies.mkdir(exist_ok=True)
    inc = Incoming(copies, 0, out.header)
    with AlignedBufferPool(PIECE, 1) as pool:
        view, sent = pool.buffers[0].view, 0
        while sent < out.total:
            n = out.fill(view[:min(PIECE, out.total - sent)])
            if damage is not None and sent <= damage < sent + n:
                view[damage - sent] ^= 1
            inc.write(view[:n])
            sent += n
    out.close()
    assert out.error is None, out.error
    try:
        inc.publish(json.loads(out.trailer()))
    except BaseException:
        inc.discard()
        raise
    return inc


def test_the_trailer_has_each_files_crc32c_with_one_pass(tmp_path):
    """Files whose chunks cover them whole, leave bytes between them, end on pieces, or are absent:
    the trailer's crc32c of each file (built from its chunks' where they tile it) is the
    crc32c of its bytes, and the copy is published byte for byte."""
    sources = _sources(tmp_path)
    out = Outgoing(sources, None)
    with AlignedBufferPool(PIECE, 1) as pool:
        sent = 0
        while sent < out.total:
            sent += out.fill(pool.buffers[0].view[:min(PIECE, out.total - sent)])
    out.close()
    want = [crc32c.crc32c(s.data if s.data is not None else s.path.read_bytes()) for s in sources]
    assert json.loads(out.trailer())["crcs"] == want
    _send(sources, tmp_path / "copies")
    for s in sources[1:]:
        assert (tmp_path / "copies" / "rank00000" / s.name).read_bytes() == s.path.read_bytes(), s.name


@pytest.mark.parametrize("where", ["in a chunk", "between chunks"])
def test_a_byte_damaged_on_the_way_is_refused_by_the_receiver(tmp_path, where):
    """A byte flipped after the sender checked it (on the wire, in a buffer): the receiver's
    crc32c of what it got differs from the trailer's; the copy is refused, never published."""
    sources = _sources(tmp_path)
    stream_offset = 4096 + 53_248  # the shard's block, then data-a.bin's 13 blocks: data-b.bin starts here
    damage = stream_offset + (150 if where == "in a chunk" else 11_000)
    with pytest.raises(ChecksumMismatchError):
        _send(sources, tmp_path / "copies", damage=damage)
    assert not (tmp_path / "copies" / "rank00000").exists()


@pytest.mark.parametrize("debug", [False, True])
def test_the_pipeline_reads_its_clock_only_when_profiling(tmp_path, debug):
    """A pipeline's stage timings are measured only where the gdswriter logger is at debug (the
    one switch, replicastream.profiling: where they are logged): otherwise every stage stays
    0.0 and ``timings()`` says they were not measured."""
    import logging

    from gdswriter.distributed.group import Coordinator

    log = logging.getLogger("gdswriter")
    level = log.level
    log.setLevel(logging.DEBUG if debug else logging.INFO)
    try:
        out = Outgoing([], None)
        pipe = Pipeline(Coordinator.solo(), 1, out, [], {}, {}, [])
        pipe.run()  # its reader and writer threads start and end: the whole is never 0 s, measured
        out.close()
    finally:
        log.setLevel(level)
    assert (pipe.seconds["pipeline"] > 0) is debug, pipe.seconds
    assert all(v == 0.0 for k, v in pipe.seconds.items() if k != "pipeline"), pipe.seconds
    assert ("not measured" in pipe.timings()) is not debug, pipe.timings()
