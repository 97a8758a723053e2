"""The save's record path is columnar (the snapshot's SavedTensors, the writer's storage columns,
the state tree's text kept while the tree is the same): the manifests it writes are byte for
byte those the record-per-tensor path wrote (tests/data/manifest_records.json: their crc32c as
main wrote them, 2026-12-07, before the change; format 3.0's are compared re-written as 2.1), on the first save, on later saves that reuse
the layout, and after each change that must lay the state out anew.

Regenerate the goldens only from a checkout whose manifests are known right:
``PYTHONPATH=<that checkout> python tests/test_manifest_records.py``.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import types
from dataclasses import replace
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # support/, when run as a script

from support import models as M  # noqa: E402
from gdswriter import GDSCheckpointer, load_state  # noqa: E402
from gdswriter.format.manifest import MANIFEST_NAME, Manifest, TensorRecord  # noqa: E402
from gdswriter.save import writer as writer_mod  # noqa: E402
from gdswriter.planner.assign import plan_save  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "data" / "manifest_records.json"
NOW = 1700000000.25


def _ar(n: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Exact values (integers), whatever the CPU: the data files' checksums are the same everywhere."""
    t = (torch.arange(n, dtype=torch.int64) % 97).to(dtype)
    return t.reshape(shape) if shape is not None else t


def mixed() -> dict:
    """Every common dtype, 0-d tensors, zero-byte ones, and one larger than a small pool's piece."""
    return {"f32": _ar(12, torch.float32, (3, 4)), "f16": _ar(5, torch.float16), "bf16": _ar(7, torch.bfloat16),
            "f64": _ar(9, torch.float64), "i8": _ar(33, torch.int8), "i16": _ar(5, torch.int16),
            "i32": _ar(6, torch.int32), "i64": torch.tensor(7), "u8": _ar(300, torch.uint8),
            "bool": torch.tensor([True, False, True]), "c64": torch.complex(_ar(4, torch.float32), _ar(4, torch.float32)),
            "scalar": torch.tensor(2.5), "empty": torch.empty(0), "empty2d": torch.zeros(3, 0, dtype=torch.int16),
            "big": _ar(1 << 20, torch.float32), "wide": _ar(2000, torch.float64)}


def views() -> dict:
    """Views, ties and shared storages; non-contiguous and expanded views; lazy conj/neg bits."""
    w = _ar(64, torch.float32, (8, 8))
    big = _ar(3000, torch.int16)
    z = torch.complex(_ar(6, torch.float32), -_ar(6, torch.float32))
    return {"w": w, "tied": w, "row": w[2], "col": w[:, 3], "t": w.t(), "strided": w[::2, ::3],
            "big": big, "tail": big[10:20], "head": big[:2048], "exp": _ar(4, torch.float32).expand(3, 4),
            "nothing": w[:, :0], "conj": z.conj(), "neg": z.conj().imag, "alone": _ar(5000, torch.float32)}


def arrays() -> dict:
    """numpy arrays ("ndarray" kind): alone, sharing memory with each other (one extent of a
    storage, and raw memory no array covers), 0-d, non-contiguous (copied), and torch views of them."""
    a = np.arange(100, dtype=np.float64)
    b = np.arange(64, dtype=np.float64)
    return {"a": a, "a_head": a[:60], "a_tail_t": torch.from_numpy(a[50:]), "x": b[:5], "y": b[3:9],
            "bytes": b.view(np.uint8)[20:30], "zero_d": np.array(3.5), "nc": np.arange(12).reshape(3, 4)[:, ::2],
            "i32": np.arange(2000, dtype=np.int32), "t": _ar(10, torch.int64)}


def tree() -> dict:
    """A state tree of every kind the codec encodes (state_text's tree), beside a few tensors."""
    od = collections.OrderedDict([("w", _ar(6, torch.float32)), ("b", _ar(2, torch.float32))])
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {"od": od, "cfg": {"lr": 0.5, "one": 1, "yes": True, "float_one": 1.0, "neg0": -0.0, "nan": float("nan"),
                              "inf": float("-inf"), "big": 2**70, "bytes": b"\x00\xff", "tup": (1, (2.5, "x")),
                              "none": None, "np": np.float32(1.5), "dtype": torch.bfloat16,
                              "device": torch.device("cpu"), "size": torch.Size([3, 4]), 3: "int key",
                              (1, 2): "tuple key", "s\u00e9": "\u2603"},
            "steps": list(range(50)), "t": _ar(30, torch.int32)}


def model() -> dict:
    """A module's state_dict and an AdamW's state (tied weights, buffers, per-parameter state), values exact."""
    mod = M.TinyLM()
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    for p in mod.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        for i, t in enumerate([*mod.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]):
            t.copy_(_ar(t.numel(), t.dtype, tuple(t.shape)) + (i % 5 if t.dtype.is_floating_point else 0))
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "amsgrad": False, "params": list(range(len(opt.state)))}]
    return {"model": mod.state_dict(), "optim": {"state": opt.state_dict()["state"], "param_groups": groups}}


def many() -> dict:
    """3,000 tensors, packed (under 4 KiB) and not, in nested groups, with plain values among them."""
    out: dict = {}
    for i in range(3000):
        n = 1 + (i * 37) % 1500
        out.setdefault(f"g{i // 100}", {})[f"t{i % 100}"] = _ar(n, torch.float32 if i % 3 else torch.int16)
        if i % 250 == 0:
            out[f"g{i // 100}"][f"n{i}"] = i
    return out


STATES = {"mixed": mixed, "views": views, "arrays": arrays, "tree": tree, "model": model, "many": many}
# (roots, files per root, host pool bytes or None for live): two roots write at once, so the
# chunks reach the manifest out of storage order; a small pool cuts the large storages' chunks
CONFIGS = {"one root": (1, 1, None, "host"), "two roots, small pool": (2, 2, 1 << 20, "host"),
           "live": (1, 3, None, "live")}


def _options(config: str):
    _, files, pool, mode = CONFIGS[config]
    return M.small_options(files_per_root=files, snapshot=mode,
                           **({"snapshot_pool_bytes": pool} if pool is not None else {}))


def _roots(base: Path, config: str) -> list[Path]:
    return [base / f"root{r}" for r in range(CONFIGS[config][0])]


def _normalised(raw: bytes) -> bytes:
    """The manifest with its engine names replaced (io_uring or posix, by machine) and its checksum trailer again."""
    head = re.sub(rb'\{"engine":"[a-z_\-]+"\}', b'{"engine":"E"}', raw[:raw.rindex(b',"manifest_crc32c":')])
    return head + b',"manifest_crc32c":%d}\n' % crc32c.crc32c(head)


def saved_manifests(base: Path, state_name: str, config: str) -> list[bytes]:
    """The manifests of steps 1-3 of a state (steps 2 and 3 reuse the layout; step 3 after new
    values only), each normalised."""
    state = STATES[state_name]()
    got = []
    with GDSCheckpointer(state, None, _roots(base, config), options=_options(config)) as ck:
        # the layout the goldens were written with (PACK_BELOW was 4096 then): the manifest writer
        # is what this compares, not the packing threshold (the session's new_plan seam)
        ck.session.new_plan = lambda sizes, devices, targets: plan_save(sizes, targets, pack_below=4096)
        for step in (1, 2, 3):
            if step == 3:
                for t in _tensors(state):
                    t.add_(1) if t.dtype != torch.bool else t.logical_not_()
            ck.save(step, metadata={"step": step, "note": "records"})
            got.append(_normalised((_roots(base, config)[0] / f"step_{step:012d}" / MANIFEST_NAME).read_bytes()))
    return got


def _tensors(state: object) -> list[torch.Tensor]:
    """The distinct, writable, non-empty base tensors of a state (to change their values in place)."""
    seen, out, stack = set(), [], [state]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, torch.Tensor) and v.numel() and v.is_contiguous() and not v.is_conj() and not v.is_neg():
            base = v.untyped_storage().data_ptr()
            if base not in seen and v.storage_offset() == 0 and v.untyped_storage().nbytes() == v.nbytes:
                seen.add(base)
                out.append(v)
    return out


def _reference(raw: bytes) -> bytes:
    """The manifest as json.dumps writes its body, in docs/format.md 3's order, with the checksum of that text."""
    body = json.loads(raw)
    del body["manifest_crc32c"]
    head = json.dumps(body, separators=(",", ":"), ensure_ascii=True)[:-1].encode()
    return head + b',"manifest_crc32c":%d}\n' % crc32c.crc32c(head)


@pytest.fixture
def fixed_time(monkeypatch):
    monkeypatch.setattr(writer_mod, "time", types.SimpleNamespace(time=lambda: NOW))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("state_name", STATES)
def test_the_manifests_are_the_bytes_main_wrote(tmp_path, fixed_time, state_name, config):
    """First, second and third save of each state: the bytes main's record-per-tensor path wrote
    (their crc32c), the text json.dumps gives of the same body, and the state loads back."""
    golden = json.loads(GOLDEN.read_text())[f"{state_name} / {config}"]
    got = saved_manifests(tmp_path, state_name, config)
    for step, raw in enumerate(got, 1):
        assert raw == _reference(raw), (state_name, config, step)
    # format 3.0 (base64 integer columns) holds what 2.1 held: re-written as 2.1, main's bytes
    as_2_1 = [replace(Manifest.from_json_bytes(raw), version=(2, 1)).to_json_bytes() for raw in got]
    assert [crc32c.crc32c(raw) for raw in as_2_1] == golden, (state_name, config)
    assert all(b'"version":[3,0]' in raw and b'"nbytes":"' in raw for raw in got)
    step, loaded = load_state(_roots(tmp_path, config))
    assert step == 3 and loaded["model"].keys() == STATES[state_name]().keys()


def test_the_snapshots_records_are_columns_that_read_as_each_tensors_view():
    """Snapshot.records is columns (SavedTensors: no record made by the save) that read as one
    TensorRecord per tensor (what distributed/save.py and the other readers of records use),
    each the view its tensor is of its extent's bytes; a reused layout gives the same table."""
    from gdswriter.format.manifest import SavedTensors  # (not in the checkouts the goldens came from)
    from gdswriter.format.dtypes import dtype_from_name
    from gdswriter.save.snapshot import LayoutCache, take_snapshot

    state = {"m": views(), "a": arrays()}
    layout = LayoutCache()
    snap = take_snapshot(state, 1, layout=layout)
    records = snap.records
    assert isinstance(records, SavedTensors) and not records.made and len(records) == 23  # m/tied is m/w
    plain, again = mixed(), LayoutCache()
    first = take_snapshot(plain, 1, layout=again).records
    assert take_snapshot(plain, 2, layout=again).records is first  # the layout reused, its table too
    named = {r.name: r for r in records}
    assert len(named) == len(records) and records[3] == list(records)[3] == tuple(records)[3]
    for group, values in state.items():
        for name, v in values.items():
            rec = named[f"{group}/{'w' if name == 'tied' else name}"]
            assert isinstance(rec, TensorRecord) and rec.kind == ("ndarray" if isinstance(v, np.ndarray) else "tensor")
            t = torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v.resolve_conj().resolve_neg()
            flat = snap.extents[rec.storage].flat
            seen = flat[rec.byte_offset:].view(dtype_from_name(rec.dtype)) if flat.numel() else flat.view(t.dtype)
            got = seen.as_strided(rec.shape, rec.stride) if t.numel() else seen[:0].reshape(rec.shape)
            assert (rec.shape, rec.device) == (tuple(t.shape), "cpu") and torch.equal(got, t), rec.name


# Each changes what a reused layout, tensor table, storage table or state text stands for
# (applied in turn, each save after one; "values" changes only the bytes: everything is reused).
CHANGES = {
    "values": lambda s: s["w"].add_(1),
    "shape": lambda s: s.update(w=s["w"].view(4, 20)),
    "dtype": lambda s: s.update(w=s["w"].view(torch.int32)),
    "new storage": lambda s: s.update(w=s["w"].clone()),
    "storage size": lambda s: s.update(w=_ar(96, torch.float32)),
    "packed becomes large": lambda s: s.update(small=_ar(2048, torch.float32)),
    "stride": lambda s: s.update(col=s["w"].view(-1)[1::5]),
    "offset": lambda s: s.update(tail=s["big"][11:21]),
    "untied": lambda s: s.update(tied=s["big"].clone()),
    "name": lambda s: s.update(renamed=s.pop("alone")),
    "kind": lambda s: s.update(arr=s["arr"].numpy() if isinstance(s["arr"], torch.Tensor) else torch.from_numpy(s["arr"])),
    "added": lambda s: s.update(more=_ar(3000, torch.int64)),
    "removed": lambda s: s.pop("more"),
    "int to bool": lambda s: s.update(n=True),
    "bool to float": lambda s: s.update(n=1.0),
    "0.0 to -0.0": lambda s: s.update(n=-0.0),
    "-0.0 to 0.0": lambda s: s.update(n=0.0),
}


def _changing_state() -> dict:
    big = _ar(5000, torch.float32)
    w = _ar(80, torch.float32)
    return {"w": w, "col": w.view(8, 10)[:, 2], "big": big, "tail": big[10:20], "tied": big, "small": _ar(7, torch.int16),
            "alone": _ar(9000, torch.float64), "arr": torch.from_numpy(np.arange(50, dtype=np.int32)), "n": 1}


@pytest.mark.parametrize("config", ["one root", "two roots, small pool"])
def test_a_reused_layout_writes_what_a_fresh_save_writes_after_every_change(tmp_path, fixed_time, config):
    """One checkpointer saves after each change (reusing what still applies: the snapshot's
    layout and table, the storage template, the state's text); a fresh checkpointer saves the
    same state: the manifests are the same bytes, the text json.dumps gives, and load back."""
    state = _changing_state()
    with GDSCheckpointer(state, None, _roots(tmp_path / "kept", config), options=_options(config)) as ck:
        for step, (change, apply) in enumerate(CHANGES.items(), 1):
            apply(state)
            ck.save(step)
            kept = (_roots(tmp_path / "kept", config)[0] / f"step_{step:012d}" / MANIFEST_NAME).read_bytes()
            fresh_roots = _roots(tmp_path / f"fresh{step}", config)
            with GDSCheckpointer(state, None, fresh_roots, options=_options(config)) as fresh:
                fresh.save(step)
            assert kept == (fresh_roots[0] / f"step_{step:012d}" / MANIFEST_NAME).read_bytes(), change
            assert kept == _reference(kept), change
            got = load_state(_roots(tmp_path / "kept", config), step=step)[1]["model"]
            assert got.keys() == state.keys() and got["n"] == state["n"] and type(got["n"]) is type(state["n"]), change
            assert str(got["n"]) == str(state["n"]), change  # -0.0 stays -0.0
            for k, v in state.items():
                if k != "n":
                    want = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                    seen = torch.from_numpy(got[k]) if isinstance(got[k], np.ndarray) else got[k]
                    assert type(got[k]) is type(v) and seen.dtype == want.dtype and torch.equal(seen, want), (change, k)


def test_a_plan_that_does_not_tile_every_storage_commits_nothing(tmp_path):
    """The writer checks that the chunks it records cover each storage exactly, from its byte 0
    (what every reader checks): a plan that leaves a storage out, or part of one, is a
    CheckpointError and no step is committed, rather than a manifest no reader accepts."""
    from gdswriter.engines.select import create_engine
    from gdswriter.errors import CheckpointError
    from gdswriter.format.commit import CommitProtocol
    from gdswriter.planner.assign import PACK_BELOW
    from gdswriter.save.handle import Release
    from gdswriter.save.snapshot import take_snapshot

    state = {"a": _ar(3000, torch.float32), "b": _ar(10, torch.int64), "c": _ar(100, torch.float32)}
    snap = take_snapshot(state, 1)
    sizes = [e.nbytes for e in snap.extents]
    protocol, engine = CommitProtocol([tmp_path]), create_engine(M.small_engine())
    try:
        for bad in (sizes[:-1], [*sizes[:-1], sizes[-1] - 16], sizes):
            plan = plan_save(bad, writer_mod.file_targets(1, 1), pack_below=PACK_BELOW)
            if bad is sizes:  # the right plan commits (what the two before would have, unchecked)
                writer_mod.write_and_commit(snap, protocol, [engine], plan=plan, release=Release())
                assert protocol.is_committed(1)
                break
            with pytest.raises(CheckpointError, match="do not cover each storage"):
                writer_mod.write_and_commit(snap, protocol, [engine], plan=plan, release=Release())
            assert not protocol.is_committed(1) and protocol.committed_steps() == []
    finally:
        engine.close()


def test_a_template_made_from_columns_is_the_one_made_from_records():
    """StorageTableTemplate.of_columns (the writer's: numpy columns, no record) fills in, for any
    checksums, the text the records' template gives: format 2's columns and 1.x's two texts."""
    import random

    from gdswriter.format import manifest as manifest_mod

    rng = random.Random(3)
    shapes = [[(0, 0, 0, 40)], [(0, 64, 0, 16), (1, 0, 16, 8)], [(1, 8, 0, 0)], [(1, 64, 0, 5)],
              [(0, 128, 0, 3), (1, 128, 3, 9), (0, 192, 12, 1)], [(0, 256, 0, 7)]]
    crcs = [rng.randrange(1 << 32) for _ in range(sum(map(len, shapes)))]
    it = iter(crcs)
    storages = tuple(manifest_mod.StorageRecord(sum(c[3] for c in s),
                                                tuple(manifest_mod.ChunkRecord(*c, next(it)) for c in s)) for s in shapes)
    every = [c for s in storages for c in s.chunks]
    cols = [np.array([getattr(c, k) for c in every], dtype=np.int64)
            for k in ("file", "file_offset", "storage_offset", "length")]
    counts = np.array([len(s.chunks) for s in storages], dtype=np.int64)
    made = manifest_mod.StorageTableTemplate.of_columns([s.nbytes for s in storages], counts, *cols).fill(crcs)
    want = manifest_mod.StorageTableTemplate(storages).fill(tuple(crcs))
    assert (made.columns, made.canonical, made.plain, made.sizes) == (want.columns, want.canonical, want.plain,
                                                                        want.sizes)
    assert made.columns == manifest_mod.storage_columns(storages)[0]
    assert made.binary == want.binary == manifest_mod.storage_columns(storages, binary=True)[0]  # format 3.0's


if __name__ == "__main__":  # regenerate the goldens (see the module docstring)
    import tempfile

    writer_mod.time = types.SimpleNamespace(time=lambda: NOW)
    out = {}
    for s in STATES:
        for c in CONFIGS:
            with tempfile.TemporaryDirectory() as d:
                out[f"{s} / {c}"] = [crc32c.crc32c(replace(Manifest.from_json_bytes(raw), version=(2, 1)).to_json_bytes())
                                     for raw in saved_manifests(Path(d), s, c)]
            print(s, "/", c, out[f"{s} / {c}"], flush=True)
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
