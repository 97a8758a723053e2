"""Format 3.0 (issue 40, docs/format.md 3.0): the manifest's integer columns are strings, a byte
width ("1", "2", "4", "8"), ":", and the base64 of the little-endian values, decoded by one
numpy.frombuffer each. A step written by gdswriter before 3.0 (tests/data/step_2_1: format 2.1,
written by 682cf09) still loads bit-exact; each hostile encoding gets CorruptCheckpointError from
the parse, before anything is allocated for the tensors."""

from __future__ import annotations

import base64
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gdswriter import CorruptCheckpointError, GDSCheckpointer, load_state
from gdswriter.format.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from test_manifest_columns import sealed, small

OLD_STEP = Path(__file__).resolve().parent / "data" / "step_2_1"


def old_state() -> dict:
    """What tests/data/step_2_1 holds (its "model"), made as the before tree made it."""
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    return {"w": w, "w_t": w.t(), "h": torch.linspace(-1, 1, 10, dtype=torch.float16),
            "i": torch.arange(5, dtype=torch.int64) * (1 << 40), "big": (torch.arange(70000) % 251).to(torch.uint8),
            "flags": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3), "s": torch.tensor(3.5)}


def test_a_step_written_before_3_0_loads_bit_exact_and_rewrites_as_read(tmp_path):
    """The 2.1 step main wrote loads (load_state and a live load) bit-exact, views and dtypes
    kept; its manifest re-written by this tree is its own bytes, and as 3.0 the same records."""
    root = tmp_path / "old"
    shutil.copytree(OLD_STEP, root)
    raw = (root / "step_000000000007" / MANIFEST_NAME).read_bytes()
    m = Manifest.from_json_bytes(raw)
    assert m.version == (2, 1) and m.to_json_bytes() == raw
    assert Manifest.from_json_bytes(replace(m, version=FORMAT_VERSION).to_json_bytes()).tensors == m.tensors
    step, state = load_state(root)
    want = old_state()
    assert step == 7 and state["model"].keys() == want.keys()
    for k, v in want.items():
        got = state["model"][k]
        assert got.dtype == v.dtype and got.shape == v.shape and got.stride() == v.stride(), k
        assert torch.equal(got, v), k
    assert state["model"]["w_t"].untyped_storage().data_ptr() == state["model"]["w"].untyped_storage().data_ptr()
    live = {k: torch.zeros_like(v) if k != "w_t" else None for k, v in want.items()}
    live["w_t"] = live["w"].t()
    with GDSCheckpointer(live, None, root) as ck:
        assert ck.load() == 7
    for k, v in want.items():
        assert torch.equal(live[k], v), k


def test_a_save_writes_base64_columns_of_the_narrowest_width(tmp_path):
    """Each integer column is the narrowest width holding its largest value; every value decodes
    back to the records (offsets past 2**32 as 8 bytes)."""
    m = replace(small((3, 0)), step=9)
    raw = m.to_json_bytes()
    body = json.loads(raw)
    assert body["version"] == [3, 0]
    widths = {k: v.split(":")[0] for k, v in body["storages"].items()}
    assert widths == {"nbytes": "2", "chunks": "1", "file": "1", "file_offset": "2", "storage_offset": "2",
                      "length": "2", "crc32c": "1"}
    assert {k: v.split(":")[0] for k, v in body["tensors"].items() if isinstance(v, str)} == {
        "storage": "1", "byte_offset": "1", "dtype": "1", "ndim": "1", "shape": "2", "stride": "1", "device": "1",
        "kind": "1"}
    back, as_2_1 = Manifest.from_json_bytes(raw), Manifest.from_json_bytes(replace(m, version=(2, 1)).to_json_bytes())
    assert (back.storages, back.tensors, back.version) == (as_2_1.storages, as_2_1.tensors, (3, 0))
    huge = replace(m, files=(replace(m.files[0], size=(1 << 40) + 3 * 4096), m.files[1]),
                   storages=(replace(m.storages[0], chunks=(replace(m.storages[0].chunks[0], file_offset=1 << 40),)),
                             *m.storages[1:]))
    col = json.loads(huge.to_json_bytes())["storages"]["file_offset"]
    assert col.startswith("8:")
    assert np.frombuffer(base64.b64decode(col[2:]), "<i8").tolist()[0] == 1 << 40


def _b64(values: list[int], dtype: str) -> str:
    return base64.b64encode(np.array(values, dtype=dtype).tobytes()).decode()


def _hostile_cases() -> dict[str, tuple[str, str, object, str]]:
    """name: (table, column, new value, what the error says)."""
    return {
        "not base64": ("storages", "length", "2:@@@@!!!!AAAAAAAA", "not base64"),
        "no width": ("storages", "nbytes", "AAAA", "width prefix"),
        "odd width": ("tensors", "ndim", "3:AAAA", "width prefix"),
        "a list in 3.0": ("tensors", "storage", [0, 0, 1, 2, 2, 3, 0], "not a base64 string"),
        "a number": ("storages", "chunks", 4, "not a base64 string"),
        "short of the count": ("tensors", "dtype", "1:" + _b64([0, 0, 1], "<u1"), "not 7 values"),
        "chunk columns disagree": ("storages", "crc32c", "1:" + _b64([1, 3, 2], "<u1"), "not 5 values"),
        "a value of 2**63": ("storages", "file_offset", "8:" + _b64([0, 4096, 8192, -1, 64], "<i8"), "2**63"),
        "padding inside": ("tensors", "kind", "1:AA==AAAAAAAA", "base64"),
        "whitespace": ("tensors", "kind", "1:AAAA AAAAAA=", "base64"),
        "bytes not whole values": ("storages", "nbytes", "4:AAAAAAAAAAAA", "whole 4-byte values"),
    }


@pytest.mark.parametrize("case", list(_hostile_cases()))
def test_a_hostile_column_is_refused_with_a_typed_error(tmp_path, case):
    """Each hostile encoding of a column (resealed: the checksum matches) is CorruptCheckpointError
    from the parse, naming the column, and a load of it allocates no tensor."""
    table, key, value, says = _hostile_cases()[case]
    body = json.loads(small((3, 0)).to_json_bytes())
    body[table][key] = value
    with pytest.raises(CorruptCheckpointError, match=re.escape(repr(key)) + ".*" + re.escape(says)):
        Manifest.from_json_bytes(sealed(body))


def test_a_huge_claimed_count_is_refused_before_decoding():
    """Names claiming 2**40 tensors next to columns of 7: the length check refuses it from the
    string's length, before base64 is decoded (nothing sized by the claim is allocated)."""
    body = json.loads(small((3, 0)).to_json_bytes())
    body["tensors"]["storage"] = "8:" + "A" * 64
    with pytest.raises(CorruptCheckpointError, match="not 7 values of 8 bytes"):
        Manifest.from_json_bytes(sealed(body))


def test_a_2_x_manifest_with_a_string_column_is_refused():
    """Base64 columns are 3.0's: a 2.1 manifest holding one is damaged, not half-read."""
    body = json.loads(small((3, 0)).to_json_bytes())
    body["version"] = [2, 1]
    with pytest.raises(CorruptCheckpointError, match="not a list"):
        Manifest.from_json_bytes(sealed(body))
