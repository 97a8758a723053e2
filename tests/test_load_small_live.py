"""Small live tensors in a load (load/policy.py SMALL_IN_PLACE_BYTES): read with the fresh
storages, in runs, then copied into the live tensors (apply.copy_into_live) once every byte is
verified. The live tensors keep their memory and get the saved bytes bit for bit (every dtype,
NaN payloads, bool bytes other than 0 and 1); a damaged step leaves them untouched even when
the load is not atomic; beyond STAGED_LIVE_MAX_BYTES they are read in place, as large ones are."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
from torch.testing._internal.common_dtype import all_types_and_complex_and

from support import models as M
from support.models import fill_random
from support.manifests import rows_of
import gdswriter.load.policy as policy_mod
from gdswriter import ChecksumMismatchError, GDSCheckpointer
from gdswriter.format.commit import CommitProtocol, step_dir_name
from gdswriter.format.manifest import MANIFEST_NAME
from gdswriter.load.apply import match_live, match_live_tensors
from gdswriter.load.reader import read_manifest


def ckpt(model=None, optimizer=None, root=None, **kw) -> GDSCheckpointer:
    return GDSCheckpointer(model, optimizer, root, options=M.small_options(**kw))


def dtypes() -> list[torch.dtype]:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dt in all_types_and_complex_and(torch.bool, torch.float16, torch.bfloat16, torch.uint16, torch.uint32,
                                            torch.float8_e4m3fn, torch.float8_e5m2, torch.int1, torch.uint1):
            try:
                torch.empty(2, dtype=dt)
            except Exception:
                continue
            out.append(dt)
    return out


def every_dtype_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {}
    for dt in dtypes():
        for i, shape in enumerate([(3, 5), (7,), (), (0, 4)]):
            state[f"{str(dt).removeprefix('torch.')}/{i}"] = fill_random(torch.empty(shape, dtype=dt), gen)
    base = fill_random(torch.empty(6, 4), gen)
    state["shared"], state["shared_t"] = base, base.t()  # one storage, two views: never filled in place
    state["strided"] = fill_random(torch.empty(8, 6), gen)[:, ::2]  # a view of part of its storage
    return state


@pytest.mark.parametrize("atomic", [False, None, True])
def test_small_live_tensors_get_the_saved_bytes_in_their_own_memory(tmp_path, atomic):
    gen = torch.Generator().manual_seed(3)
    state = every_dtype_state(gen)
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
    expect = {k: M.raw_bytes(v.contiguous()) for k, v in state.items()}
    live = {k: fill_random(torch.empty(v.shape, dtype=v.dtype), gen) for k, v in state.items()}
    live["shared_t"] = live["shared"].t()
    live["strided"] = fill_random(torch.empty(8, 6), gen)[:, ::2]
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    with ckpt(live, None, tmp_path) as ck:
        assert ck.load(atomic=atomic) == 1
    for k in state:
        if k not in ("shared", "shared_t", "strided"):  # those are replaced by the loaded views (a dict target)
            assert live[k].data_ptr() == ptrs[k], k
        assert live[k].dtype == state[k].dtype and live[k].shape == state[k].shape, k
        assert torch.equal(M.raw_bytes(live[k].contiguous()), expect[k]), k
    assert live["shared_t"].data_ptr() == live["shared"].data_ptr()


def _damaged_step(tmp_path, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Step 1 of 40 small tensors in 4 files, a byte of the last file's data flipped."""
    state = {f"t{i}": fill_random(torch.empty(100), gen) for i in range(40)}
    with ckpt(state, None, tmp_path, files_per_root=4) as ck:
        ck.save(1)
    body = rows_of(json.loads((tmp_path / step_dir_name(1) / MANIFEST_NAME).read_bytes()))
    (t,) = [t for t in body["tensors"] if t["name"] == "model/t39"]
    f, file_off, _, length, _ = body["storages"][t["storage"]]["chunks"][0]
    assert f == len(body["files"]) - 1 > 0  # the last file: the others are read before
    path = tmp_path / step_dir_name(1) / body["files"][f][1]
    raw = bytearray(path.read_bytes())
    raw[file_off + length // 2] ^= 0x55
    path.write_bytes(bytes(raw))
    return state


def test_damage_leaves_small_live_tensors_untouched_without_atomic(tmp_path):
    gen = torch.Generator().manual_seed(5)
    state = _damaged_step(tmp_path, gen)
    live = {k: torch.full_like(v, -7.0) for k, v in state.items()}
    with ckpt(live, None, tmp_path) as ck:
        with pytest.raises(ChecksumMismatchError) as ei:
            ck.load(atomic=False)
    assert all(torch.equal(v, torch.full_like(v, -7.0)) for v in live.values())
    assert not getattr(ei.value, "__notes__", [])


def test_small_live_tensors_beyond_the_budget_are_read_in_place(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    state = _damaged_step(tmp_path, gen)
    monkeypatch.setattr(policy_mod, "STAGED_LIVE_MAX_BYTES", 10 * 400)  # ten of the forty tensors
    live = {k: torch.full_like(v, -7.0) for k, v in state.items()}
    with ckpt(live, None, tmp_path) as ck:
        with pytest.raises(ChecksumMismatchError) as ei:
            ck.load(atomic=False)
    notes = " ".join(getattr(ei.value, "__notes__", []))
    assert "30 live tensor(s) read in place" in notes


def test_match_live_looks_up_live_tensors_by_name_in_any_order(tmp_path):
    gen = torch.Generator().manual_seed(7)
    state = {"a": fill_random(torch.empty(5), gen), "b": fill_random(torch.empty(2, 3), gen),
             "c": fill_random(torch.empty(4, dtype=torch.float16), gen)}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
    m = read_manifest(CommitProtocol([tmp_path]), 1)
    names = m.tensor_names()
    live = {"model/c": torch.empty(4, dtype=torch.float16), "model/b": torch.empty(3, 2),  # b: another shape
            "model/a": torch.empty(5), "model/zz": torch.empty(5),
            "model/x": torch.empty(5, dtype=torch.int1) if torch.int1 in dtypes() else torch.empty(1)}
    got = match_live_tensors(m, live)
    assert sorted(names[i] for i, _ in got.values()) == ["model/a", "model/c"]
    assert all(lt is live[names[i]] for i, lt in got.values())
    assert {s: i for s, (i, _) in match_live(m, live).items()} == {s: i for s, (i, _) in got.items()}


def test_an_ambiguous_name_is_never_matched(tmp_path):
    """Two saved tensors with one name ("a/b" as a key, and "b" inside "a"): neither is read
    into a live tensor of that name, by the columns or by the records."""
    state = {"a/b": torch.ones(3), "a": {"b": torch.zeros(3)}, "c": torch.ones(2)}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
    m = read_manifest(CommitProtocol([tmp_path]), 1)
    assert m.tensor_names().count("model/a/b") == 2
    live = {"model/a/b": torch.empty(3), "model/c": torch.empty(2)}
    for manifest in (m, replace(m, storages=tuple(m.storages), tensors=tuple(m.tensors))):  # columns, records
        got = match_live_tensors(manifest, live)
        assert [manifest.tensor_names()[i] for i, _ in got.values()] == ["model/c"]
