"""A format 2.0 manifest keeps its validated columns and makes its records only when asked
(format/manifest.py RecordTable); the single-process load reads the columns (load/reader.py,
apply.match_live) and gives what the record path gives, view for view."""

from __future__ import annotations

import copy
import pickle
from dataclasses import replace

import pytest
import torch

from support import models as M
from gdswriter import ChecksumMismatchError, GDSCheckpointer, load_state
from gdswriter.format.commit import CommitProtocol, normalize_roots, step_dir_name
from gdswriter.format.manifest import Manifest, RecordTable, chunk_columns, tensor_table_columns
from gdswriter.load.apply import match_live
from gdswriter.load.reader import placeholder_tensors, read_manifest, read_tensors


def views_state() -> dict:
    """Every kind of view a record can describe: tied, transposed, offset, expanded (stride 0),
    scalar, empty, 1-byte dtypes, several shapes of one dtype, and a tensor large enough to be
    cut into chunks and files of its own."""
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    return {"w": base, "tied": base, "w_t": base.t(), "row": base[3], "col": base[:, 2], "tail": base.view(-1)[40:],
            "expanded": torch.arange(4.0).expand(16, 4), "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 3), "mask": torch.tensor([True, False, True]),
            "bytes": torch.arange(100, dtype=torch.int8), "half": torch.arange(12, dtype=torch.float16).reshape(3, 4),
            "many": [torch.full((n,), float(n)) for n in range(1, 40)],
            "big": torch.arange(3 << 20, dtype=torch.float32)}


def saved(root) -> CommitProtocol:
    with GDSCheckpointer(views_state(), None, root, options=M.small_options(files_per_root=2)) as ck:
        ck.save(1)
    return CommitProtocol(normalize_roots(root))


def records_only(m):
    """The same manifest with its tables as plain tuples of records: the record path."""
    return replace(m, storages=tuple(m.storages), tensors=tuple(m.tensors))


def sharing(tensors) -> list[int]:
    """Which tensors share a storage, as the index of the first tensor on the same memory."""
    first: dict[int, int] = {}
    return [first.setdefault(t.untyped_storage().data_ptr(), i) if t.numel() else -1 for i, t in enumerate(tensors)]


def test_a_2_0_load_reads_the_columns_and_gives_what_the_records_give(tmp_path):
    protocol = saved(tmp_path)
    m = read_manifest(protocol, 1)
    assert m.version[0] >= 2 and chunk_columns(m.storages) is not None and tensor_table_columns(m.tensors) is not None
    assert len(chunk_columns(m.storages).fid) > len(m.storages)  # "big" is cut into several chunks
    fast = read_tensors(protocol, m)
    stand_ins = placeholder_tensors(m)
    assert not m.tensors.made and not m.storages.made  # no record made on the way
    slow_m = records_only(m)
    assert chunk_columns(slow_m.storages) is None and tensor_table_columns(slow_m.tensors) is None
    slow = read_tensors(protocol, slow_m)
    assert len(fast) == len(slow) == len(m.tensors)
    for a, b, p, q in zip(fast, slow, stand_ins, placeholder_tensors(slow_m)):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert torch.equal(a, b)
        assert (p.dtype, p.shape) == (q.dtype, q.shape) == (a.dtype, a.shape)
    assert sharing(fast) == sharing(slow)
    names = m.tensor_names()
    assert fast[names.index("model/w_t")].data_ptr() == fast[names.index("model/w")].data_ptr()
    _, state = load_state(tmp_path)
    got, want = state["model"], views_state()
    for k in ("w", "w_t", "row", "col", "tail", "expanded", "scalar", "empty", "mask", "bytes", "half", "big"):
        assert torch.equal(got[k], want[k]), k
    assert got["tied"] is got["w"] and got["w_t"].data_ptr() == got["w"].data_ptr() and got["scalar"].shape == ()


def test_match_live_reads_the_columns_as_the_records(tmp_path):
    protocol = saved(tmp_path)
    m = read_manifest(protocol, 1)
    live = {"model/big": torch.zeros(3 << 20), "model/bytes": torch.zeros(100, dtype=torch.int8),
            "model/half": torch.zeros(4, 3, dtype=torch.float16), "model/w": torch.zeros(8, 8),
            "model/many/0": torch.zeros(1)}
    fast = match_live(m, live)
    assert not m.tensors.made and not m.storages.made
    slow = match_live(records_only(m), live)
    assert {k: v[0] for k, v in fast.items()} == {k: v[0] for k, v in slow.items()}
    names = m.tensor_names()
    # "w" shares its storage with "w_t"; "half" has another shape
    assert sorted(names[i] for i, _ in fast.values()) == ["model/big", "model/bytes", "model/many/0"]


def test_a_record_table_is_its_records(tmp_path):
    protocol = saved(tmp_path)
    m = read_manifest(protocol, 1)
    n = len(m.tensors)
    assert isinstance(m.tensors, RecordTable) and not m.tensors.made
    as_tuple = tuple(m.tensors)
    assert m.tensors.made and m.tensors == as_tuple and as_tuple == m.tensors and hash(m.tensors) == hash(as_tuple)
    assert len(as_tuple) == n and m.tensors[-1] == as_tuple[-1] and m.tensors[1:3] == as_tuple[1:3]
    assert m.tensors + () == as_tuple and () + m.tensors == as_tuple
    assert pickle.loads(pickle.dumps(m.storages)) == tuple(m.storages)
    assert type(copy.deepcopy(m).storages) is tuple and copy.deepcopy(m) == m
    for i, t in enumerate(as_tuple):
        assert m.tensor_view(i) == (t.storage, t.byte_offset, t.dtype, t.shape, t.stride)
    assert m.storage_sizes() == [s.nbytes for s in m.storages] and m.storage_bytes() == sum(m.storage_sizes())
    assert read_manifest(protocol, 1) == m  # a fresh parse equals one whose records were made


def test_a_damaged_chunk_of_a_run_is_named_from_the_columns(tmp_path):
    """A chunk read inside a run (the small tensors "model/many/*") failing its crc32c: the error names
    its tensor (found by the tensor columns), and nothing is returned."""
    protocol = saved(tmp_path)
    m = read_manifest(protocol, 1)
    i = m.tensor_names().index("model/many/20")
    sid = m.tensor_view(i)[0]
    cols = chunk_columns(m.storages)
    j = int(cols.first[sid])
    path = tmp_path / step_dir_name(1) / m.files[int(cols.fid[j])].path
    with open(path, "r+b") as fh:
        fh.seek(int(cols.fo[j]))
        b = fh.read(1)[0]
        fh.seek(int(cols.fo[j]))
        fh.write(bytes([b ^ 0x55]))
    with pytest.raises(ChecksumMismatchError, match="model/many/20"):
        read_tensors(protocol, read_manifest(protocol, 1))
    with pytest.raises(ChecksumMismatchError, match="model/many/20"):
        read_tensors(protocol, records_only(read_manifest(protocol, 1)))


def test_a_1_x_manifest_keeps_its_records(tmp_path):
    """1.x manifests (multi-rank steps, old ones) are parsed into plain tuples: the record path."""
    m = read_manifest(saved(tmp_path), 1)
    old = Manifest.from_json_bytes(replace(m, version=(1, 1)).to_json_bytes())
    assert type(old.storages) is tuple and type(old.tensors) is tuple
    assert chunk_columns(old.storages) is None and tensor_table_columns(old.tensors) is None
    assert old.tensors == m.tensors and old.storages == m.storages
    assert old.tensor_names() == m.tensor_names() and old.storage_sizes() == m.storage_sizes()
    assert [old.tensor_view(i) for i in range(len(m.tensors))] == [m.tensor_view(i) for i in range(len(m.tensors))]
