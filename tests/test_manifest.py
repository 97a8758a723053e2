"""The manifest format: frozen golden bytes, and a parser that only ever returns a
Manifest or raises CorruptCheckpointError / UnsupportedFormatVersionError."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import types
from dataclasses import replace

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

from support import models as M
import gdswriter.format.manifest as manifest_mod
import gdswriter.load.reader as reader_mod
import gdswriter.save.writer as writer_mod
from gdswriter import (CorruptCheckpointError, GDSCheckpointer, UnsupportedFormatVersionError, UnsupportedObjectError,
                       load_state)
from gdswriter.cli import main as cli_main
from gdswriter.format.commit import CommitProtocol, step_dir_name
from gdswriter.format.dtypes import dtype_from_name
from gdswriter.format.manifest import (FORMAT_VERSION, MANIFEST_NAME, ChunkRecord, FileRecord, Manifest,
                                       StorageRecord, TensorRecord, canonical_json)
from gdswriter.format.state_codec import decode_state
from gdswriter.options import EngineOptions
from gdswriter.load.reader import tensors_from_storages


# What gdswriter 0.1 wrote (format 1.0): readers of later versions must keep reading it.
GOLDEN_MANIFEST = (
    b'{"format":"gdswriter","version":[1,0],"step":42,"created_unix":1700000000.25,"metadata":{"note":"golden"},'
    b'"files":[[0,"data-r0-f0.bin",12288]],'
    b'"storages":[{"nbytes":24,"chunks":[[0,0,0,24,2258899752]]},{"nbytes":4,"chunks":[[0,4096,0,4,4092339023]]},'
    b'{"nbytes":8,"chunks":[[0,8192,0,8,1987164046]]},{"nbytes":0,"chunks":[[0,12288,0,0,0]]}],'
    b'"tensors":[{"name":"model/ids","storage":0,"byte_offset":0,"dtype":"int32","shape":[6],"stride":[1],'
    b'"device":"cpu","kind":"tensor"},{"name":"model/ids_t","storage":0,"byte_offset":0,"dtype":"int32",'
    b'"shape":[3,2],"stride":[1,3],"device":"cpu","kind":"tensor"},{"name":"model/half","storage":1,'
    b'"byte_offset":0,"dtype":"float16","shape":[2],"stride":[1],"device":"cpu","kind":"tensor"},'
    b'{"name":"model/step","storage":2,"byte_offset":0,"dtype":"int64","shape":[],"stride":[],"device":"cpu",'
    b'"kind":"tensor"},{"name":"model/empty","storage":3,"byte_offset":0,"dtype":"float32","shape":[0],'
    b'"stride":[1],"device":"cpu","kind":"tensor"}],'
    b'"state":{"$dict":[["model",{"$dict":[["ids",{"$tensor":0}],["ids_t",{"$tensor":1}],["half",{"$tensor":2}],'
    b'["step",{"$tensor":3}],["empty",{"$tensor":4}]]}],["extra",{"$dict":[["cfg",{"$dict":[["lr",0.5],'
    b'["name","tiny"],["betas",{"$tuple":[0.9,0.99]}],["nan",{"$float":"nan"}]]}]]}]]},'
    b'"manifest_crc32c":2413339291}\n')


def _golden_state():
    base = torch.arange(6, dtype=torch.int32)
    model = {"ids": base, "ids_t": base.view(2, 3).t(), "half": torch.tensor([1.5, -2.0], dtype=torch.float16),
             "step": torch.tensor(7), "empty": torch.zeros(0)}
    extra = {"cfg": {"lr": 0.5, "name": "tiny", "betas": (0.9, 0.99), "nan": float("nan")}}
    return model, extra


def golden_1_1(engine: str) -> bytes:
    """GOLDEN_MANIFEST as format 1.1 writes it: the version, and which engine wrote each file."""
    body = json.loads(GOLDEN_MANIFEST)
    del body["manifest_crc32c"]
    body["version"] = [1, 1]
    body["files"][0].append({"engine": engine})
    body["manifest_crc32c"] = crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


# What format 2.0 writes for the same state (docs/format.md 3): column tables, then the checksum
# of every byte before its trailer. {engine}: the engine that wrote the file.
GOLDEN_2_0_HEAD = (
    '{{"format":"gdswriter","version":[2,0],"step":42,"created_unix":1700000000.25,"metadata":{{"note":"golden"}},'
    '"files":[[0,"data-r0-f0.bin",12288,{{"engine":"{engine}"}}]],'
    '"storages":{{"nbytes":[24,4,8,0],"chunks":[1,1,1,1],"file":[0,0,0,0],"file_offset":[0,4096,8192,12288],'
    '"storage_offset":[0,0,0,0],"length":[24,4,8,0],"crc32c":[2258899752,4092339023,1987164046,0]}},'
    '"tensors":{{"name":["model/ids","model/ids_t","model/half","model/step","model/empty"],"storage":[0,0,1,2,3],'
    '"byte_offset":[0,0,0,0,0],"dtype":[0,0,1,2,3],"ndim":[1,2,1,0,1],"shape":[6,3,2,2,0],"stride":[1,1,3,1,1],'
    '"device":[0,0,0,0,0],"kind":[0,0,0,0,0],"dtype_names":["int32","float16","int64","float32"],'
    '"device_names":["cpu"]}},'
    '"state":{{"$dict":[["model",{{"$dict":[["ids",{{"$tensor":0}}],["ids_t",{{"$tensor":1}}],["half",{{"$tensor":2}}],'
    '["step",{{"$tensor":3}}],["empty",{{"$tensor":4}}]]}}],["extra",{{"$dict":[["cfg",{{"$dict":[["lr",0.5],'
    '["name","tiny"],["betas",{{"$tuple":[0.9,0.99]}}],["nan",{{"$float":"nan"}}]]}}]]}}]]}}')


def golden_2_0(engine: str) -> bytes:
    """The 2.0 manifest of the golden state: its head, then the trailer with the crc32c of the head."""
    head = GOLDEN_2_0_HEAD.format(engine=engine).encode()
    return head + b',"manifest_crc32c":%d}\n' % crc32c.crc32c(head)


# What format 2.1 writes for the same state (docs/format.md 2): the storages under 4 KiB packed
# 64 bytes apart, the file exactly as long as its chunks, the zero-byte storage at its end.
GOLDEN_2_1_HEAD = GOLDEN_2_0_HEAD.replace('"version":[2,0]', '"version":[2,1]').replace(
    '12288,{{"engine"', '136,{{"engine"').replace('"file_offset":[0,4096,8192,12288]', '"file_offset":[0,64,128,136]')


def golden_2_1(engine: str) -> bytes:
    """The 2.1 manifest of the golden state, as golden_2_0."""
    head = GOLDEN_2_1_HEAD.format(engine=engine).encode()
    return head + b',"manifest_crc32c":%d}\n' % crc32c.crc32c(head)


# What format 3.0 writes for the same state (docs/format.md 3.0): 2.1's manifest with each integer
# column a string, its width in bytes, ":", and the base64 of its little-endian values.
GOLDEN_3_0_HEAD = GOLDEN_2_1_HEAD.replace('"version":[2,1]', '"version":[3,0]').replace(
    '"storages":{{"nbytes":[24,4,8,0],"chunks":[1,1,1,1],"file":[0,0,0,0],"file_offset":[0,64,128,136],'
    '"storage_offset":[0,0,0,0],"length":[24,4,8,0],"crc32c":[2258899752,4092339023,1987164046,0]}}',
    '"storages":{{"nbytes":"1:GAQIAA==","chunks":"1:AQEBAQ==","file":"1:AAAAAA==","file_offset":"1:AECAiA==",'
    '"storage_offset":"1:AAAAAA==","length":"1:GAQIAA==","crc32c":"4:KBOkhk8j7POOt3F2AAAAAA=="}}').replace(
    '"storage":[0,0,1,2,3],"byte_offset":[0,0,0,0,0],"dtype":[0,0,1,2,3],"ndim":[1,2,1,0,1],"shape":[6,3,2,2,0],'
    '"stride":[1,1,3,1,1],"device":[0,0,0,0,0],"kind":[0,0,0,0,0],',
    '"storage":"1:AAABAgM=","byte_offset":"1:AAAAAAA=","dtype":"1:AAABAgM=","ndim":"1:AQIBAAE=",'
    '"shape":"1:BgMCAgA=","stride":"1:AQEDAQE=","device":"1:AAAAAAA=","kind":"1:AAAAAAA=",')


def golden_3_0(engine: str) -> bytes:
    """The 3.0 manifest of the golden state, as golden_2_0."""
    head = GOLDEN_3_0_HEAD.format(engine=engine).encode()
    return head + b',"manifest_crc32c":%d}\n' % crc32c.crc32c(head)


def test_golden_manifest_bytes_3_0(tmp_path, monkeypatch):
    """A save writes format 3.0, byte for byte; the checksum is the crc32c of the bytes before
    ``,"manifest_crc32c":``; the 2.1, 2.0, 1.0 and 1.1 manifests of the same state still load the
    same records (but the chunks' places in the file), and each is re-written as it was read."""
    assert "[3,0]" in GOLDEN_3_0_HEAD and '"shape":"1:BgMCAgA="' in GOLDEN_3_0_HEAD  # every replace took
    assert '"crc32c":"4:KBOkhk8j7POOt3F2AAAAAA=="' in GOLDEN_3_0_HEAD
    monkeypatch.setattr(writer_mod, "time", types.SimpleNamespace(time=lambda: 1700000000.25))
    model, extra = _golden_state()
    with GDSCheckpointer(model, None, tmp_path, state=extra, options=M.small_options()) as ck:
        ck.save(42, metadata={"note": "golden"})
        engine = ck.engine_info.name
    raw = (tmp_path / "step_000000000042" / MANIFEST_NAME).read_bytes()
    assert raw == golden_3_0(engine)
    m = Manifest.from_json_bytes(raw)
    assert m.version == FORMAT_VERSION == (3, 0)
    v21 = Manifest.from_json_bytes(golden_2_1(engine))
    v20 = Manifest.from_json_bytes(golden_2_0(engine))
    old = Manifest.from_json_bytes(golden_1_1(engine))
    assert v20.version == (2, 0) and old.version == (1, 1) and Manifest.from_json_bytes(GOLDEN_MANIFEST).version == (1, 0)
    assert (v20.files, v20.storages, v20.tensors, v20.metadata) == (old.files, old.storages, old.tensors, old.metadata)
    assert (v21.version, v21.files, v21.storages, v21.tensors, v21.state) == ((2, 1), m.files, m.storages, m.tensors,
                                                                             m.state)
    assert (m.tensors, m.metadata, m.storage_sizes()) == (old.tensors, old.metadata, old.storage_sizes())
    assert [c.crc32c for s in m.storages for c in s.chunks] == [c.crc32c for s in old.storages for c in s.chunks]
    assert m.to_json_bytes() == raw and v20.to_json_bytes() == golden_2_0(engine)  # each re-written as read
    assert v21.to_json_bytes() == golden_2_1(engine) and old.to_json_bytes() == golden_1_1(engine)
    s, state = load_state(tmp_path)
    assert s == 42 and torch.equal(state["model"]["ids_t"], model["ids_t"])


def test_golden_manifest_bytes(tmp_path, monkeypatch):
    """The 1.1 golden manifest (what gdswriter wrote before 2.0), written by the 1.x encoder,
    and the 2.1 data file: the small storages packed 64 bytes apart, zero padding between."""
    monkeypatch.setattr(writer_mod, "time", types.SimpleNamespace(time=lambda: 1700000000.25))
    model, extra = _golden_state()
    with GDSCheckpointer(model, None, tmp_path, state=extra, options=M.small_options()) as ck:
        ck.save(42, metadata={"note": "golden"})
        engine = ck.engine_info.name
    step_dir = tmp_path / "step_000000000042"
    saved = Manifest.from_json_bytes((step_dir / MANIFEST_NAME).read_bytes())
    v20 = Manifest.from_json_bytes(golden_2_0(engine))
    assert replace(saved, version=(1, 1), files=v20.files, storages=v20.storages).to_json_bytes() == golden_1_1(engine)
    m = Manifest.from_json_bytes(golden_1_1(engine))
    assert m.version == (1, 1) and m.files[0].info == {"engine": engine}
    assert (tmp_path / "latest").read_bytes() == b"42\n"

    # the data file: each storage at a 64-byte-aligned offset, zero padding between
    data = (step_dir / "data-r0-f0.bin").read_bytes()
    ids = torch.arange(6, dtype=torch.int32).numpy().tobytes()
    half = torch.tensor([1.5, -2.0], dtype=torch.float16).numpy().tobytes()
    step = torch.tensor(7).numpy().tobytes()
    assert data == ids.ljust(64, b"\0") + half.ljust(64, b"\0") + step
    # the recorded checksums are plain crc32c of those bytes
    assert [crc32c.crc32c(b) for b in (ids, half, step, b"")] == [2258899752, 4092339023, 1987164046, 0]
    body = json.loads(GOLDEN_MANIFEST)
    crc = body.pop("manifest_crc32c")
    assert crc == crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _reference_bytes(m: Manifest) -> bytes:
    """The manifest file as json.dumps writes the whole body at once (what to_json_bytes,
    which encodes the tensor table once per layout, must equal byte for byte)."""
    body = json.loads(m.to_json_bytes())
    del body["manifest_crc32c"]
    body["tensors"] = [{"name": t.name, "storage": t.storage, "byte_offset": t.byte_offset, "dtype": t.dtype,
                        "shape": list(t.shape), "stride": list(t.stride), "device": t.device, "kind": t.kind}
                       for t in m.tensors]
    body["manifest_crc32c"] = crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def test_a_reused_tensor_table_stands_only_for_the_same_records_and_storages():
    """Saves with the same records reuse the encoded, checked tensor table; any other record or
    storage size gets its own, and a view that no longer fits its storage is refused."""
    m = Manifest.from_json_bytes(GOLDEN_MANIFEST)
    tensors, storages = list(m.tensors), list(m.storages)
    renamed = tensors[:1] + [TensorRecord("model/other", 0, 4, "int32", (5,), (1,), "cpu", "tensor")] + tensors[2:]
    cases = [m, m, replace(m, tensors=tuple(renamed)), m, replace(m, step=43, metadata={"x": [1]}),
             replace(m, storages=(StorageRecord(32, (ChunkRecord(0, 0, 0, 32, 0),)), *storages[1:])), m]
    for case in cases:
        got = case.to_json_bytes()
        assert got == _reference_bytes(case)
        assert Manifest.from_json_bytes(got).tensors == case.tensors
    shrunk = replace(m, storages=(StorageRecord(20, storages[0].chunks), *storages[1:]))  # ids needs 24 bytes
    with pytest.raises(UnsupportedObjectError, match="past the end of its storage"):
        shrunk.to_json_bytes()
    assert m.to_json_bytes() == GOLDEN_MANIFEST


_U64 = st.integers(0, 2**64 - 1)


@given(st.lists(st.tuples(_U64, st.lists(st.tuples(_U64, _U64, _U64, _U64, _U64), max_size=3)), max_size=20))
@settings(max_examples=200, deadline=None)
def test_the_storage_table_is_the_text_json_dumps_gives(rows):
    """The manifest's "storages" entry is formatted directly (json.dumps of 100,000 storages'
    dicts took most of a save's manifest encoding): the same text, in both key orders."""
    storages = tuple(StorageRecord(n, tuple(ChunkRecord(*c) for c in chunks)) for n, chunks in rows)
    plain = [{"nbytes": s.nbytes, "chunks": [[c.file, c.file_offset, c.storage_offset, c.length, c.crc32c]
                                             for c in s.chunks]} for s in storages]
    assert manifest_mod.storage_table(storages) == (json.dumps(plain, sort_keys=True, separators=(",", ":")),
                                                     json.dumps(plain, separators=(",", ":")))


def test_golden_manifest_parses_and_loads(tmp_path):
    m = Manifest.from_json_bytes(GOLDEN_MANIFEST)
    assert m.step == 42 and m.version == (1, 0) and m.created_unix == 1700000000.25
    assert m.files == (FileRecord(0, "data-r0-f0.bin", 12288),)
    assert m.storages[0] == StorageRecord(24, (ChunkRecord(0, 0, 0, 24, 2258899752),))
    assert m.tensors[1] == TensorRecord("model/ids_t", 0, 0, "int32", (3, 2), (1, 3), "cpu", "tensor")
    assert m.metadata == {"note": "golden"}
    assert m.to_json_bytes() == GOLDEN_MANIFEST  # serialisation is a fixed point

    # a reader today loads the frozen bytes (as if written by an older gdswriter)
    d = tmp_path / "step_000000000042"
    d.mkdir()
    (d / MANIFEST_NAME).write_bytes(GOLDEN_MANIFEST)
    ids = torch.arange(6, dtype=torch.int32).numpy().tobytes()
    half = torch.tensor([1.5, -2.0], dtype=torch.float16).numpy().tobytes()
    step = torch.tensor(7).numpy().tobytes()
    (d / "data-r0-f0.bin").write_bytes(ids.ljust(4096, b"\0") + half.ljust(4096, b"\0") + step.ljust(4096, b"\0"))
    s, state = load_state(tmp_path)
    model, extra = _golden_state()
    assert s == 42
    for k, v in model.items():
        assert torch.equal(state["model"][k], v) and state["model"][k].stride() == v.stride(), k
    assert state["model"]["ids_t"].data_ptr() == state["model"]["ids"].data_ptr()
    cfg = state["extra"]["cfg"]
    assert cfg["betas"] == (0.9, 0.99) and math.isnan(cfg["nan"]) and cfg["lr"] == 0.5


# ----------------------------------------------------------------------------- fuzz
ALLOWED = (CorruptCheckpointError, UnsupportedFormatVersionError)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12) | st.sampled_from(["gdswriter", "$tensor", "float32", "data-r0-f0.bin", "..", ""]),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(
        st.sampled_from(["format", "version", "step", "files", "storages", "tensors", "state", "nbytes", "chunks",
                         "name", "storage", "byte_offset", "dtype", "shape", "stride", "kind", "metadata",
                         "created_unix", "manifest_crc32c", "$tensor", "$dict"]) | st.text(max_size=5),
        children, max_size=6),
    max_leaves=30)


def parse(raw: bytes):
    """from_json_bytes, then everything a load does with a manifest short of reading files."""
    try:
        m = Manifest.from_json_bytes(raw, where="fuzz")
    except ALLOWED:
        return None
    assert isinstance(m, Manifest)
    # meta buffers: the harness must not allocate what a damaged manifest claims either
    buffers = [torch.empty(s.nbytes, dtype=torch.uint8, device="meta") for s in m.storages]
    try:
        tensors = tensors_from_storages(m, buffers)
        decode_state(m.state, tensors)
    except CorruptCheckpointError:
        pass
    return m


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(raw):
    parse(raw)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_fuzz_arbitrary_json(value):
    parse(json.dumps(value).encode())
    if isinstance(value, dict):  # also with the fields a real manifest has and a valid checksum
        body = {"format": "gdswriter", "version": [1, 0], **value}
        body.pop("manifest_crc32c", None)
        body["manifest_crc32c"] = crc32c.crc32c(canonical_json(body))
        parse(json.dumps(body).encode())


def _paths(v, prefix=()):
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, prefix + (i,))


GOLDEN_BODY = json.loads(GOLDEN_MANIFEST)
GOLDEN_PATHS = [p for p in _paths(GOLDEN_BODY) if p and p[0] != "manifest_crc32c"]

interesting = st.one_of(json_values, st.integers(-3, 20000), st.sampled_from(
    [-1, 0, 1, 3, 4095, 4096, 2 ** 31, 2 ** 63, 2 ** 64, 1e300, -0.0, True, None, "", [], {}, "bfloat16",
     "bits8", "float128", "ndarray", "../x", [1, 0], [2, 0], [0, 9], [[0, 0, 0, 0, 0]]]))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(GOLDEN_PATHS), st.sampled_from(["set", "delete"]), interesting),
                min_size=1, max_size=4),
       st.booleans())
@example([(("tensors", 4, "stride", 0), "set", 2 ** 63)], True)  # an empty view with a stride torch cannot hold
@example([(("tensors", 4, "shape"), "set", [1 << 40, 1 << 40, 0]), (("tensors", 4, "stride"), "set", [0, 0, 0])],
         True)  # no element, but torch's size product overflows
def test_fuzz_mutated_valid_manifest(mutations, fix_checksum):
    body = copy.deepcopy(GOLDEN_BODY)
    body.pop("manifest_crc32c")
    for path, op, value in mutations:
        parent = body
        try:
            for k in path[:-1]:
                parent = parent[k]
            if op == "delete" and isinstance(parent, dict):
                del parent[path[-1]]
            elif op == "delete" and isinstance(parent, list):
                parent.pop(path[-1])
            else:
                parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
    try:
        text = json.dumps(body, sort_keys=False, separators=(",", ":"), allow_nan=False)
        canon = canonical_json(body)
    except (ValueError, TypeError):  # not JSON, or keys of mixed types (a mutation put an int key in a dict)
        assume(False)
    crc = crc32c.crc32c(canon) if fix_checksum else crc32c.crc32c(canon) ^ 1
    raw = (text[:-1] + f',"manifest_crc32c":{crc}}}').encode()
    m = parse(raw)
    if not fix_checksum:
        assert m is None


def test_unchanged_golden_parses_in_fuzz_harness():
    assert parse(GOLDEN_MANIFEST) is not None


def test_nan_and_non_json_values_rejected():
    for bad in (b"NaN", b'{"format":"gdswriter","version":[1,0],"x":NaN}', b"\xff" * 10, b"1" * 5000):
        with pytest.raises(CorruptCheckpointError):
            Manifest.from_json_bytes(bad)
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json_bytes(deep)


def test_version_checks():
    body = json.loads(GOLDEN_MANIFEST)
    body.pop("manifest_crc32c")
    for version, err in (([4, 0], UnsupportedFormatVersionError), ([99, 5], UnsupportedFormatVersionError),
                         ([2, 0], CorruptCheckpointError),  # a 2.0 body without its byte trailer
                         ([1], CorruptCheckpointError), (["1", 0], CorruptCheckpointError),
                         ([-1, 0], CorruptCheckpointError), ([True, 0], CorruptCheckpointError)):
        b = dict(body, version=version)
        b["manifest_crc32c"] = crc32c.crc32c(canonical_json(b))
        with pytest.raises(err):
            Manifest.from_json_bytes(json.dumps(b).encode())
    # a newer major is refused even if its checksum scheme changed (checked first)
    b = dict(body, version=[4, 0], manifest_crc32c="sha256:...")
    with pytest.raises(UnsupportedFormatVersionError):
        Manifest.from_json_bytes(json.dumps(b).encode())


# ----------------------------------------------------------------------------- structured fuzz
# Manifests that pass the JSON parser and the checksum, built the way gdswriter lays a checkpoint
# out (storages of random bytes split into 4 KiB-aligned chunks over several files, tensors as
# views of them), with real data files; then fields and files are damaged. Every outcome must be
# a correct load or a typed error, and nothing may allocate more than the files hold.


FUZZ_DTYPES = ["uint8", "int8", "bool", "int16", "float16", "bfloat16", "int32", "float32", "int64", "float64",
               "complex64"]
SMALL_ENGINE = dict(GDSWRITER_BUFFER_BYTES=str(256 << 10), GDSWRITER_REQUEST_BYTES=str(64 << 10),
                    GDSWRITER_NUM_BUFFERS="2")


@st.composite
def views(draw, nbytes: int):
    """A tensor record viewing a storage of ``nbytes``: flat, 2-d, transposed, strided, offset,
    expanded (stride 0), scalar or empty."""
    dtype = draw(st.sampled_from(FUZZ_DTYPES))
    item = dtype_from_name(dtype).itemsize
    n = nbytes // item
    kind = draw(st.sampled_from(["flat", "2d", "transposed", "strided", "offset", "expanded", "scalar", "empty"]))
    offset = 0
    if n == 0 or kind == "empty":
        shape, stride = [0], [1]
    elif kind == "2d" or kind == "transposed":
        r = draw(st.integers(1, n))
        c = n // r
        shape, stride = ([r, c], [c, 1]) if kind == "2d" else ([c, r], [1, c])
    elif kind == "strided":
        k = draw(st.integers(1, 3))
        shape, stride = [-(-n // k)], [k]
    elif kind == "offset":
        j = draw(st.integers(0, n - 1))
        shape, stride, offset = [n - j], [1], j * item
    elif kind == "expanded":
        shape, stride = [draw(st.integers(1, 4)), n], [0, 1]
    elif kind == "scalar":
        shape, stride = [], []
    else:
        shape, stride = [n], [1]
    return {"dtype": dtype, "shape": shape, "stride": stride, "byte_offset": offset}


@st.composite
def valid_checkpoints(draw):
    """(manifest body without its checksum, {data file name: bytes}) of a consistent step 1."""
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    n_files = draw(st.integers(1, 3))
    files = [bytearray() for _ in range(n_files)]
    storages, tensors = [], []
    for sid in range(draw(st.integers(0, 4))):
        nbytes = draw(st.sampled_from([0, 1, 8, 16, 96, 4096, 6000, 9000]))
        data = rng.randbytes(nbytes)
        chunks = []
        if nbytes == 0:
            chunks.append([0, len(files[0]), 0, 0, 0])  # at the current end of file 0
        cuts = sorted({0, nbytes, draw(st.integers(0, nbytes)) // 4096 * 4096}) if nbytes else []
        for a, b in zip(cuts, cuts[1:]):
            f = draw(st.integers(0, n_files - 1))
            off = -(-len(files[f]) // 4096) * 4096
            files[f] += b"\0" * (off - len(files[f])) + data[a:b]
            chunks.append([f, off, a, b - a, crc32c.crc32c(data[a:b])])
        storages.append({"nbytes": nbytes, "chunks": chunks})
        for _ in range(draw(st.integers(1, 2))):
            v = draw(views(nbytes))
            tensors.append({"name": f"model/t{len(tensors)}", "storage": sid, "byte_offset": v["byte_offset"],
                            "dtype": v["dtype"], "shape": v["shape"], "stride": v["stride"], "device": "cpu",
                            "kind": "tensor"})
    state = {"$dict": [["model", {"$dict": [[f"t{i}", {"$tensor": i}] for i in range(len(tensors))]}]]}
    body = {"format": "gdswriter", "version": [1, 1], "step": 1, "created_unix": 1.5, "metadata": {"k": 1},
            "files": [[0, f"data-r0-f{k}.bin", len(files[k])] for k in range(n_files)],
            "storages": storages, "tensors": tensors, "state": state}
    return body, {f"data-r0-f{k}.bin": bytes(files[k]) for k in range(n_files)}


BOUNDARY = [-1, 0, 1, 2, 3, 8, 4095, 4096, 4097, 2 ** 31, 2 ** 32, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64,
            1.5, 1e300, True, None, "", [], {}, "float32", "bfloat16", "qint8", "float4_e2m1fn_x2", "bits8",
            "../x", "data-r0-f0.bin", [0], [1, 0], [0, 0, 0, 0, 0], [1 << 26], [0, 0], {"$tensor": 0},
            {"$tensor": 99}, {"$ndarray": 0}, "ndarray"]
field_ops = st.tuples(st.integers(0, 10 ** 6), st.sampled_from(["set", "bump", "delete"]),
                      st.one_of(st.sampled_from(BOUNDARY), st.integers(-5, 20000)))
file_ops = st.tuples(st.integers(0, 10 ** 6), st.sampled_from(["truncate", "extend", "flip", "delete", "symlink",
                                                               "directory"]), st.integers(0, 20000))


def _mutate_field(body: dict, pick: int, op: str, value) -> None:
    paths = [p for p in _paths(body) if p]
    path = paths[pick % len(paths)]
    parent = body
    for k in path[:-1]:
        parent = parent[k]
    cur = parent[path[-1]]
    if op == "delete":
        del parent[path[-1]]
    elif op == "bump" and isinstance(cur, int) and not isinstance(cur, bool) and isinstance(value, int) \
            and not isinstance(value, bool):
        parent[path[-1]] = [cur + 1, cur - 1, cur * 2, cur * 4096, cur + 2 ** 40, cur + 2 ** 63, -cur][value % 7]
    else:
        parent[path[-1]] = copy.deepcopy(value)


def _mutate_file(step_dir, names: list[str], pick: int, op: str, n: int) -> None:
    path = step_dir / names[pick % len(names)]
    if path.is_symlink() or not path.is_file():  # an earlier change already replaced it
        return
    if op == "truncate":
        os.truncate(path, n % (path.stat().st_size + 1))
    elif op == "extend":
        with open(path, "ab") as f:
            f.write(b"\0" * (n % 5000 + 1))
    elif op == "flip" and path.stat().st_size:
        with open(path, "r+b") as f:
            f.seek(n % path.stat().st_size)
            b = f.read(1)[0]
            f.seek(n % path.stat().st_size)
            f.write(bytes([b ^ 0x81]))
    elif op in ("delete", "symlink", "directory"):
        real = step_dir.parent / f"moved-{path.name}"
        os.rename(path, real)
        if op == "symlink":
            path.symlink_to(real)
        elif op == "directory":
            path.mkdir()


def _naive_tensor(step_dir, m: dict, t: dict) -> torch.Tensor:
    """What tensor record ``t`` should hold, read with plain file reads (every chunk's crc32c checked)."""
    s = m["storages"][t["storage"]]
    buf = bytearray(s["nbytes"])
    for f, fo, so, ln, crc in s["chunks"]:
        data = (step_dir / m["files"][f][1]).read_bytes()[fo:fo + ln]
        assert len(data) == ln and crc32c.crc32c(data) == crc, "a load succeeded over a damaged chunk"
        buf[so:so + ln] = data
    dtype = dtype_from_name(t["dtype"])
    base = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), t["byte_offset"] // dtype.itemsize,
                                            t["shape"], t["stride"])


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order (a fresh copy with standard strides, so that even a size-1
    dimension with an odd stride views as bytes)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(valid_checkpoints(), st.lists(field_ops, max_size=3), st.lists(file_ops, max_size=2),
       st.booleans(), st.sampled_from([None, "alias file", "alias chunk"]))
def test_fuzz_structured_checkpoints(tmp_path_factory, monkeypatch, ckpt, fields, file_changes, fix_checksum,
                                     alias):
    body, files = copy.deepcopy(ckpt)
    aliased = False
    if alias == "alias file" and len(body["files"]) > 1:  # a second entry naming the first file
        del files[body["files"][-1][1]]
        body["files"][-1][1:3] = body["files"][0][1:3]
        aliased = True
    elif alias == "alias chunk" and len(body["storages"]) > 1 and body["storages"][0]["chunks"]:
        body["storages"][-1]["chunks"] = copy.deepcopy(body["storages"][0]["chunks"])  # two storages, one region
        body["storages"][-1]["nbytes"] = body["storages"][0]["nbytes"]
        aliased = True
    for f in fields:
        with contextlib.suppress(KeyError, IndexError, TypeError):
            _mutate_field(body, *f)
    try:
        canon = canonical_json(body)
    except (ValueError, TypeError):
        assume(False)
    body["manifest_crc32c"] = crc32c.crc32c(canon) ^ (0 if fix_checksum or not fields else 1)
    damaged = bool(fields or file_changes or aliased)
    root = tmp_path_factory.mktemp("fuzz")
    step_dir = root / step_dir_name(1)
    step_dir.mkdir()
    for name, data in files.items():
        (step_dir / name).write_bytes(data)
    (step_dir / MANIFEST_NAME).write_bytes(json.dumps(body).encode())
    for f in file_changes:
        _mutate_file(step_dir, sorted(files), *f)
    on_disk = sum(p.stat().st_size for p in step_dir.iterdir()
                  if p.is_file() and not p.is_symlink() and p.name != MANIFEST_NAME)

    for k, v in SMALL_ENGINE.items():
        monkeypatch.setenv(k, v)
    asked: list[int] = []
    real_buffer = reader_mod.host_buffer
    monkeypatch.setattr(reader_mod, "host_buffer", lambda n: (asked.append(n), real_buffer(n))[1])
    try:
        step, state = load_state(root)
    except ALLOWED:
        loaded = False
    else:
        loaded = True
    assert sum(asked) <= on_disk, f"allocated {sum(asked)} bytes for {on_disk} bytes of files"
    if loaded:
        # the load is correct: every tensor is what the (possibly edited) manifest says over these files
        protocol = CommitProtocol([root])
        m = reader_mod.read_manifest(protocol, step)
        got = reader_mod.read_tensors(protocol, m, engine_options=EngineOptions.from_env())
        raw = json.loads((step_dir / MANIFEST_NAME).read_bytes())
        for t, g in zip(raw["tensors"], got):
            assert torch.equal(_raw(g), _raw(_naive_tensor(step_dir, raw, t))), t["name"]
        if not damaged:
            for i, t in enumerate(ckpt[0]["tensors"]):
                assert torch.equal(_raw(state["model"][f"t{i}"]), _raw(_naive_tensor(step_dir, ckpt[0], t)))
    assert loaded or damaged  # an undamaged checkpoint loads
    # the CLI agrees, and never fails with anything but its exit codes
    assert cli_main(["verify", str(root)]) in ((0,) if loaded else (1, 2))  # 2: names a root not given
    assert cli_main(["inspect", str(root), "--json"]) in (0, 1, 2)


def test_a_filled_storage_template_is_the_table_storage_table_writes():
    """StorageTableTemplate.fill gives, for any checksums, exactly storage_table's text of the
    same records with those checksums (storages of one chunk, of several, and empty ones);
    the manifest made with it parses back to those records."""
    rng = random.Random(7)
    shapes = [[(0, 0, 0, 40)], [(0, 64, 0, 16), (1, 0, 16, 8)], [], [(1, 8, 0, 5)], [(0, 80, 0, 3), (0, 96, 3, 0)]]
    crcs = [rng.randrange(1 << 32) for _ in range(sum(map(len, shapes)))]
    it = iter(crcs)
    storages = tuple(manifest_mod.StorageRecord(sum(c[3] for c in s),
                                                tuple(manifest_mod.ChunkRecord(*c, next(it)) for c in s))
                     for s in shapes)
    template = manifest_mod.StorageTableTemplate(storages)
    filled = template.fill(tuple(crcs))
    assert (filled.canonical, filled.plain) == manifest_mod.storage_table(storages)
    assert filled.sizes == tuple(s.nbytes for s in storages)
    files = (manifest_mod.FileRecord(0, "a.bin", 4096), manifest_mod.FileRecord(0, "b.bin", 4096))
    m = manifest_mod.Manifest(step=3, files=files, storages=(), tensors=(), state={"$dict": []},
                                version=(2, 0))  # a hand-made layout: 2.0 does not hold it to 2.1's rules
    back = manifest_mod.Manifest.from_json_bytes(m.to_json_bytes(storages=filled, encoded_state=True))
    assert back.storages == storages
    with pytest.raises(TypeError):
        template.fill(tuple(crcs[:-1]))  # one checksum short
