"""Format 2.0 and 2.1 manifests (docs/format.md 3): the checksum over the bytes as written, and
the column tables checked as whole columns, each rule with a hostile case that only it refuses
(a typed error from the parse, before anything is allocated for the tensors); 2.1's layout rules
(chunks 64-byte aligned, files exactly as long as their chunks) refuse what 2.0 still accepts."""

from __future__ import annotations

import json
from dataclasses import replace

import crc32c
import pytest
import torch

from gdswriter import (CorruptCheckpointError, GDSCheckpointer, UnsupportedFormatVersionError, UnsupportedObjectError,
                       load_state)
from gdswriter.format.manifest import (MANIFEST_NAME, ChunkRecord, FileRecord, Manifest, ShardInfo, StorageRecord,
                                       TensorRecord, check_trailer)
from gdswriter.format.sharded import parse_step

SIZE = 3 * 4096 + 256


def small(version: tuple[int, int] = (2, 0)) -> Manifest:
    """A 2.0 manifest (2.1: its first file exactly as long as its chunks) with what each rule is there for: a storage cut in two chunks (listed out of
    order), a second file, a transposed view, an empty tensor, a scalar, an expanded view (stride
    0), an ndarray, two dtypes and two devices."""
    storages = (StorageRecord(256, (ChunkRecord(0, 0, 0, 256, 1),)),
                StorageRecord(8192, (ChunkRecord(0, 8192, 4096, 4096, 3), ChunkRecord(0, 4096, 0, 4096, 2))),
                StorageRecord(64, (ChunkRecord(1, 0, 0, 64, 4),)),
                StorageRecord(0, (ChunkRecord(1, 64, 0, 0, 0),)))
    tensors = (TensorRecord("w", 0, 0, "float32", (8, 8), (8, 1)),
               TensorRecord("w_t", 0, 0, "float32", (8, 8), (1, 8), device="cuda:0"),
               TensorRecord("big", 1, 0, "float16", (4096,), (1,)),
               TensorRecord("arr", 2, 0, "int64", (8,), (1,), kind="ndarray"),
               TensorRecord("scalar", 2, 8, "int64", (), ()),
               TensorRecord("empty", 3, 0, "float32", (0, 3), (3, 1)),
               TensorRecord("expanded", 0, 4, "float32", (1024, 16), (0, 1)))
    size = SIZE if version < (2, 1) else 3 * 4096
    return Manifest(step=5, files=(FileRecord(0, "data-r0-f0.bin", size), FileRecord(0, "data-r0-f1.bin", 64)),
                    storages=storages, tensors=tensors, state={"$list": [{"$tensor": i} for i in range(7)]},
                    metadata={"note": "x"}, version=version)


def sealed(body: dict) -> bytes:
    """``body`` as a 2.0 manifest file with a matching checksum trailer (what a hostile writer makes)."""
    body = dict(body)
    body.pop("manifest_crc32c", None)
    head = json.dumps(body, separators=(",", ":")).encode()[:-1]
    return head + b',"manifest_crc32c":%d}\n' % crc32c.crc32c(head)


@pytest.mark.parametrize("version", [(2, 0), (2, 1)], ids=["2.0", "2.1"])
def test_a_2_0_manifest_parses_back_to_its_records(version):
    m = small(version)
    raw = m.to_json_bytes()
    assert raw.startswith(b'{"format":"gdswriter","version":[2,%d],' % version[1]) and raw.endswith(b"}\n")
    got = Manifest.from_json_bytes(raw)
    assert got.tensors == m.tensors and got.files == m.files and got.metadata == m.metadata
    assert got.storages[1].chunks == m.storages[1].chunks[::-1]  # written by storage offset
    assert got.storages[:1] + got.storages[2:] == m.storages[:1] + m.storages[2:]
    assert parse_step(raw, "m") == got and got.to_json_bytes() == raw
    # the checksum: crc32c of every byte before the trailer, found from the end
    at = raw.rindex(b',"manifest_crc32c":')
    assert check_trailer(raw, "m") == crc32c.crc32c(raw[:at]) == int(raw[at + 19:-2])


def test_every_flipped_byte_of_a_2_0_manifest_is_refused():
    """Any one byte changed (the checksum's own digits, the trailer and the newline included):
    a typed error, never a manifest that parses."""
    raw = small().to_json_bytes()
    for i in range(len(raw)):
        for flip in (0x01, 0x10):
            bad = raw[:i] + bytes([raw[i] ^ flip]) + raw[i + 1:]
            with pytest.raises((CorruptCheckpointError, UnsupportedFormatVersionError)):
                Manifest.from_json_bytes(bad)


@pytest.mark.parametrize("tail", [b"}\n", b"} \n", b"}", b"}\n\n"])
def test_a_2_0_trailer_is_exact(tail):
    """The file ends with the trailer: nothing after it, no leading zero, the same key earlier
    does not stand for it, and the body's version decides the scheme (no trailer: damaged)."""
    raw = small().to_json_bytes()
    at = raw.rindex(b',"manifest_crc32c":')
    head, crc = raw[:at], crc32c.crc32c(raw[:at])
    Manifest.from_json_bytes(head + b',"manifest_crc32c":%d}\n' % crc)
    if tail != b"}\n":
        with pytest.raises(CorruptCheckpointError):
            Manifest.from_json_bytes(head + b',"manifest_crc32c":%d' % crc + tail)
    for bad in (head + b',"manifest_crc32c":0%d}\n' % crc, head + b',"manifest_crc32c":%d,"x":1}\n' % crc,
                head + b',"manifest_crc32c":%d}\n' % (crc ^ 1),
                b'{"manifest_crc32c":%d,' % crc + head[1:] + b',"x":1}\n'):
        with pytest.raises(CorruptCheckpointError):
            Manifest.from_json_bytes(bad)
    body = json.loads(raw)
    body["manifest_crc32c"] = crc32c.crc32c(json.dumps({k: v for k, v in body.items() if k != "manifest_crc32c"},
                                                       sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError):  # a 1.x checksum on a 2.0 body
        Manifest.from_json_bytes(json.dumps(body).encode())


def _set(table: str, col: str, i: int, v):
    def edit(b):
        b[table][col][i] = v
    return edit


def _ndim_65(b):
    """Tensor 0 with 65 dimensions, its shape and stride lists consistent (the sum rule holds)."""
    t = b["tensors"]
    t["ndim"][0] += 63
    t["shape"][0:0], t["stride"][0:0] = [1] * 63, [1] * 63


def _expanded(b):
    t = b["tensors"]  # tensor 6 ("expanded"): 2**20 x 16 float32 over a 256-byte storage, 64 MiB + 0
    at = sum(t["ndim"][:6])
    t["shape"][at] = 1 << 21


def _huge_shape(b):
    t = b["tensors"]  # past the float64 estimates: checked exactly, 2**80 elements
    at = sum(t["ndim"][:6])
    t["shape"][at:at + 2] = [1 << 40, 1 << 40]
    t["stride"][at:at + 2] = [0, 0]


def _offset_overflow(b):
    b["tensors"]["byte_offset"][0] = (1 << 63) - 4  # offset + extent wraps an int64


def _swap_cut_chunks(b):
    s = b["storages"]
    for col in ("file", "file_offset", "storage_offset", "length", "crc32c"):
        s[col][1], s[col][2] = s[col][2], s[col][1]


def _files_past_int64(b):
    b["files"][0][2] = b["files"][1][2] = 1 << 62


HOSTILE = {
    "tensor columns of different lengths": lambda b: b["tensors"]["storage"].append(0),
    "chunk columns of different lengths": lambda b: b["storages"]["length"].pop(),
    "storage columns of different lengths": lambda b: b["storages"]["chunks"].pop(),
    "chunk counts not adding up": _set("storages", "chunks", 0, 2),
    "a negative byte offset": _set("tensors", "byte_offset", 2, -4),
    "a negative chunk offset": _set("storages", "file_offset", 0, -4096),
    "a stride of 2**63": _set("tensors", "stride", 0, 1 << 63),
    "a bool in a column": _set("tensors", "storage", 1, True),
    "a float in a column": _set("storages", "file_offset", 0, 0.0),
    "ndim summing past the shapes": _set("tensors", "ndim", 0, 3),
    "more than 64 dimensions": _ndim_65,
    "the view bound overflowing int64": _offset_overflow,
    "more than 2**63 elements": _huge_shape,
    "a view past its storage": _set("tensors", "shape", 0, 9),
    "an expanded view above 64 MiB": _expanded,
    "a misaligned byte offset": _set("tensors", "byte_offset", 4, 12),
    "an empty view's offset past its storage": _set("tensors", "byte_offset", 5, 64),
    "a storage index out of range": _set("tensors", "storage", 0, 4),
    "a dtype index out of range": _set("tensors", "dtype", 0, 3),
    "a device index out of range": _set("tensors", "device", 0, 2),
    "a kind index out of range": _set("tensors", "kind", 0, 2),
    "a quantized dtype": _set("tensors", "dtype_names", 0, "qint8"),
    "an unknown dtype": _set("tensors", "dtype_names", 0, "float128"),
    "a name not a string": _set("tensors", "name", 0, 7),
    "a chunk past its file's end": _set("storages", "file_offset", 0, SIZE - 128),
    "a chunk length past int64 offsets": _set("storages", "length", 3, (1 << 63) - 1),
    "a crc32c beyond 32 bits": _set("storages", "crc32c", 0, 1 << 32),
    "a file index out of range": _set("storages", "file", 0, 2),
    "chunks overlapping in a file": _set("storages", "file_offset", 1, 128),
    "a gap in a storage": _set("storages", "storage_offset", 2, 4104),
    "a storage's chunks out of order": _swap_cut_chunks,
    "a storage not covered": _set("storages", "nbytes", 0, 320),
    "files adding up to 2**63 bytes": _files_past_int64,
    "a dist object": lambda b: b.update(dist={"world_size": 1, "layout": "gdswriter", "roots": []}),
    "tensors not an object": lambda b: b.update(tensors=[]),
    "storages not an object": lambda b: b.update(storages=[]),
}


@pytest.mark.parametrize("version", [(2, 0), (2, 1)], ids=["2.0", "2.1"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_2_0_manifest_refuses_each_damage(case, version):
    """Each hostile column, its checksum made to match: CorruptCheckpointError from the parse."""
    body = json.loads(small(version).to_json_bytes())
    Manifest.from_json_bytes(sealed(body))  # sealed as is: parses
    HOSTILE[case](body)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json_bytes(sealed(body))


def _grow_first_file(b: dict) -> None:
    b["files"][0][2] += 4096


DENSE_HOSTILE = {
    "a chunk not 64-byte aligned": _set("storages", "file_offset", 0, 8),
    "a file longer than its chunks": _grow_first_file,
    "a file of no chunk not empty": lambda b: b["files"].append([0, "data-r0-f2.bin", 4096]),
}


@pytest.mark.parametrize("case", sorted(DENSE_HOSTILE))
def test_a_2_1_manifest_refuses_what_its_layout_rules_forbid(case):
    """2.1's own rules (docs/format.md 3.0): each case is refused as 2.1 with a message naming the
    rule, and the same bytes labelled 2.0 still parse (a 2.0 reader refuses nothing it accepted)."""
    body = json.loads(small((2, 1)).to_json_bytes())
    DENSE_HOSTILE[case](body)
    with pytest.raises(CorruptCheckpointError, match="format 2.1"):
        Manifest.from_json_bytes(sealed(body))
    body["version"] = [2, 0]
    assert Manifest.from_json_bytes(sealed(body)).version == (2, 0)


@pytest.mark.parametrize("record", [TensorRecord("x", 0, 0, "float32", (1 << 21, 16), (0, 1)),
                                    TensorRecord("x", 0, 2, "float32", (8,), (1,)),
                                    TensorRecord("x", 0, 0, "float32", (9, 8), (8, 1)),
                                    TensorRecord("x", 0, 0, "float32", (8,), (-1,)),
                                    TensorRecord("x", 0, 0, "float32", (8,), (1,), kind="blob"),
                                    TensorRecord("x", 0, 0, "float32", (8, 8), (1,)),
                                    TensorRecord("x", 0, 0, "float32", (1 << 40, 1 << 40), (0, 0))])
def test_a_save_refuses_what_a_2_0_reader_refuses(record):
    """The writer checks its tensor columns by the reader's rules: nothing is committed that
    cannot be loaded back (UnsupportedObjectError, naming the tensor)."""
    m = small()
    with pytest.raises(UnsupportedObjectError, match="x"):
        replace(m, tensors=m.tensors + (record,)).to_json_bytes()


@pytest.mark.parametrize("record", [TensorRecord("x", 0, 0, "float32", (8,), (1,), shard=ShardInfo((16,), (8,))),
                                    TensorRecord(7, 0, 0, "float32", (8,), (1,)),
                                    TensorRecord("x", 0, 0, "float32", (8,), (True,)),
                                    TensorRecord("x", 0, 0.0, "float32", (8,), (1,))])
def test_a_2_0_save_refuses_records_it_cannot_write(record):
    """A shard (multi-rank manifests are 1.x) or a field that is not a plain str or int: refused
    (ValueError or TypeError, as json.dumps would), nothing written."""
    m = small()
    with pytest.raises((ValueError, TypeError)):
        replace(m, tensors=m.tensors + (record,)).to_json_bytes()


def test_old_versions_still_load(tmp_path):
    """A step written as 1.1 (the rows of 1.x, as gdswriter wrote them before 2.0) next to a 2.0
    step: both load, and a damaged 2.0 step is refused before any tensor is allocated."""
    state = {"w": torch.randn(64, 32), "b": torch.arange(10), "t": torch.randn(8, 8).t()}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        ck.save(2)
    one = tmp_path / "step_000000000001" / MANIFEST_NAME
    m = Manifest.from_json_bytes(one.read_bytes())
    assert m.version == (3, 0)
    one.write_bytes(replace(m, version=(1, 1)).to_json_bytes())
    assert json.loads(one.read_bytes())["version"] == [1, 1]
    for step in (1, 2):
        _, got = load_state(tmp_path, step)
        for k, v in state.items():
            assert torch.equal(got["model"][k], v), (step, k)
    two = tmp_path / "step_000000000002" / MANIFEST_NAME
    two.write_bytes(replace(Manifest.from_json_bytes(two.read_bytes()), version=(2, 1)).to_json_bytes())
    body = json.loads(two.read_bytes())
    body["tensors"]["shape"][0] = 1 << 40
    two.write_bytes(sealed(body))
    with pytest.raises(CorruptCheckpointError, match="tensor 'model/w'"):
        load_state(tmp_path, 2)
