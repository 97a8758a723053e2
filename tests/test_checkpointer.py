"""GDSCheckpointer end to end: real files, real engine (io_uring where the kernel allows)."""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import pickle
import random
import subprocess
import sys
import textwrap
import threading
import warnings
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from support import models as M
from support.models import fill_random
from support.manifests import rows_of
from gdswriter import (CheckpointLockedError, CheckpointNotFoundError, CorruptCheckpointError, EngineIOError,
                       GDSCheckpointer, GDSWriterError, InvalidOptionError, StateMismatchError,
                       UnsupportedObjectError, load_state)
from gdswriter.checkpointer import CheckpointOptions
from gdswriter.format.commit import step_dir_name
from gdswriter.format.dtypes import all_dtypes
from gdswriter.format.manifest import MANIFEST_NAME
from gdswriter.options import EngineOptions
from gdswriter.planner.assign import PACK_BELOW

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def ckpt(model=None, optimizer=None, root=None, **kw) -> GDSCheckpointer:
    state = kw.pop("state", None)
    return GDSCheckpointer(model, optimizer, root, state=state, options=M.small_options(**kw))


def leftovers(*roots) -> list[str]:
    return [f"{r}/{n}" for r in roots for n in os.listdir(r) if n.startswith((".tmp-", ".trash-"))]


def manifest_of(root, step) -> dict:
    """Step ``step``'s manifest.json, its tables as rows (support/manifests.py)."""
    return rows_of(json.loads((Path(root) / step_dir_name(step) / MANIFEST_NAME).read_bytes()))


def creatable_dtypes() -> list[torch.dtype]:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dt in all_dtypes():
            try:
                t = torch.empty((2, 3), dtype=dt)
            except Exception:
                continue
            if not t.is_quantized:
                out.append(dt)
    return out


DTYPES = creatable_dtypes()


def test_dtype_list_is_broad():
    names = {str(d).removeprefix("torch.") for d in DTYPES}
    assert {"float32", "bfloat16", "float16", "complex64", "bool", "uint64", "float8_e4m3fn", "bits8"} <= names


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_dtype_roundtrips_bit_exactly(tmp_path):
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 5), (7,), (), (0, 4)]
    state = {}
    for dt in DTYPES:
        for i, shape in enumerate(shapes):
            state[f"{str(dt).removeprefix('torch.')}/{i}"] = fill_random(torch.empty(shape, dtype=dt), gen)
    expect = {k: M.raw_bytes(v) for k, v in state.items()}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)

    _, loaded = load_state(tmp_path)
    got = loaded["model"]
    assert list(got) == list(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].stride() == v.stride(), k
        assert torch.equal(M.raw_bytes(got[k]), expect[k]), k

    # in place, into tensors holding other bytes
    live = {k: fill_random(torch.empty(v.shape, dtype=v.dtype), gen) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    with ckpt(live, None, tmp_path) as ck:
        assert ck.load() == 1
    for k in state:
        assert live[k].data_ptr() == ptrs[k], "loaded in place"
        assert torch.equal(M.raw_bytes(live[k]), expect[k]), k


def test_zero_size_and_scalar_tensors(tmp_path):
    state = {"empty": torch.zeros(0, 5), "empty_i": torch.zeros(0, dtype=torch.int64), "s": torch.tensor(3.5),
             "b": torch.tensor(True), "after": torch.arange(10.0), "empty3": torch.empty(2, 0, 3)}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(0)
    _, got = load_state(tmp_path, 0)
    for k, v in state.items():
        g = got["model"][k]
        assert g.shape == v.shape and g.dtype == v.dtype and torch.equal(g, v), k
    assert got["model"]["s"].dim() == 0 and got["model"]["s"].item() == 3.5


def test_views_of_one_buffer_restored_as_views(tmp_path):
    base = torch.arange(200, dtype=torch.float32)
    state = {
        "base": base,
        "slice": base[10:30],
        "t": base[:100].view(10, 10).t(),
        "step": base[5::7],
        "strided2d": base.view(20, 10)[::3, 1::4],
        "expand": torch.randn(3, 1).expand(3, 4),
        "bcast": torch.randn(5).unsqueeze(0).expand(4, 5),
    }
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
    m = manifest_of(tmp_path, 1)
    assert len(m["storages"]) == 3  # base and its views are one storage
    _, got = load_state(tmp_path)
    g = got["model"]
    for k, v in state.items():
        assert g[k].shape == v.shape and g[k].stride() == v.stride(), k
        assert torch.equal(g[k], v), k
    sp = g["base"].untyped_storage().data_ptr()
    for k in ("slice", "t", "step", "strided2d"):
        assert g[k].untyped_storage().data_ptr() == sp, k
        assert g[k].data_ptr() - g["base"].data_ptr() == state[k].data_ptr() - base.data_ptr(), k
    # sharing is real: writing through the base shows in the views
    g["base"][12] = -1.0
    assert g["slice"][2] == -1.0
    assert g["expand"].stride() == (1, 0)
    g["expand"][1, 0] = 42.0
    assert (g["expand"][1] == 42.0).all()


def test_views_load_in_place_into_a_dict(tmp_path):
    base = torch.arange(60, dtype=torch.float32)
    state = {"base": base, "t": base[:36].view(6, 6).t(), "step": base[1::5], "expand": torch.randn(3, 1).expand(3, 4)}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
    saved = {k: v.clone() for k, v in state.items()}
    base2 = torch.zeros(60)
    live = {"base": base2, "t": base2[:36].view(6, 6).t(), "step": base2[1::5], "expand": torch.zeros(3, 1).expand(3, 4)}
    with ckpt(live, None, tmp_path) as ck:
        assert ck.load() == 1
    assert live["base"] is base2
    for k in saved:
        assert torch.equal(live[k], saved[k]), k
    assert live["t"].data_ptr() == base2.data_ptr()


def test_dict_target_shape_mismatch(tmp_path):
    with ckpt({"a": torch.ones(3), "b": torch.arange(4.0)}, None, tmp_path) as ck:
        ck.save(1)
    a = torch.zeros(5)
    live = {"a": a, "b": torch.zeros(4)}
    with ckpt(live, None, tmp_path) as ck:
        with pytest.raises(StateMismatchError, match=r"model/a.*float32\[3\].*float32\[5\]"):
            ck.load()
        ck.load(strict=False)
    assert live["a"] is a and (a == 0).all()  # skipped, not replaced
    assert torch.equal(live["b"], torch.arange(4.0))


def test_noncontiguous_with_offset_into_large_storage(tmp_path):
    # only the viewed bytes are stored, not the whole storage
    big, big2 = torch.randn(1 << 16), torch.randn(1 << 16)
    state = {"tail": big[-8:], "mid": big2[1001:1025].view(4, 6)[:, ::2]}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
    m = manifest_of(tmp_path, 1)
    assert [s["nbytes"] for s in m["storages"]] == [32, 4 + 23 * 4]  # from a 16-byte aligned start
    _, got = load_state(tmp_path)
    for k, v in state.items():
        assert torch.equal(got["model"][k], v)


def test_tied_weights_stay_shared(tmp_path):
    model, opt, sched, scaler = M.build(0)
    M.train_steps(model, opt, sched, 1, scaler)
    with ckpt(model, opt, tmp_path) as ck:
        ck.save(1)
    m = manifest_of(tmp_path, 1)
    rec = {t["name"]: t for t in m["tensors"]}
    assert rec["model/emb.weight"]["storage"] == rec["model/head.weight"]["storage"]
    _, got = load_state(tmp_path)
    sd = got["model"]
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    assert torch.equal(sd["emb.weight"], model.emb.weight.detach())

    model2, opt2, _, _ = M.build(5)
    with ckpt(model2, opt2, tmp_path) as ck:
        ck.load()
    assert model2.head.weight is model2.emb.weight
    assert torch.equal(model2.emb.weight, model.emb.weight)
    M.assert_same_tensors(M.params_of(model2), M.params_of(model))


def test_conj_and_neg_views_are_materialised(tmp_path):
    z = torch.randn(6, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": torch.randn(4, dtype=torch.complex64).conj().imag, "plain": z}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
    _, got = load_state(tmp_path)
    for k, v in state.items():
        g = got["model"][k]
        assert not g.is_conj() and not g.is_neg()
        assert torch.equal(g, v.resolve_conj().resolve_neg()), k
    assert torch.equal(got["model"]["conj"], torch.conj_physical(z))


def _unsupported_tensors():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "sparse": torch.randn(3, 3).to_sparse(),
            "csr": torch.randn(3, 3).to_sparse_csr(),
            "meta": torch.empty(3, device="meta"),
            "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
            "quantized": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
        }


@pytest.mark.parametrize("kind", list(_unsupported_tensors()))
def test_unsupported_tensor_kinds_raise_and_commit_nothing(tmp_path, kind):
    bad = _unsupported_tensors()[kind]
    state = {"ok": torch.ones(3), "layer": {"w": torch.ones(2)}}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(1)
        state["layer"]["bad"] = bad
        with pytest.raises(UnsupportedObjectError) as ei:
            ck.save(2)
        assert ei.value.key_path == "model/layer/bad"
        assert "model/layer/bad" in str(ei.value)
        with pytest.raises(UnsupportedObjectError):
            ck.save_async(3)
        assert ck.steps() == [1] and ck.latest_step() == 1
        assert leftovers(tmp_path) == []
        del state["layer"]["bad"]
        ck.save(4)  # still usable
        assert ck.steps() == [1, 4]


def test_unsupported_object_in_optimizer_names_key_path(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt(model, opt, tmp_path) as ck:
        ck.save(1)
        opt.param_groups[0]["schedule_fn"] = lambda s: s * 2
        with pytest.raises(UnsupportedObjectError) as ei:
            ck.save(2)
        assert ei.value.key_path == "optimizer/param_groups/0/schedule_fn"
        assert "optimizer/param_groups/0/schedule_fn" in str(ei.value)
        assert "function" in str(ei.value)
        del opt.param_groups[0]["schedule_fn"]
        assert ck.steps() == [1]
        assert sorted(os.listdir(tmp_path)) == [".gdswriter-root", ".gdswriter.lock", "latest", step_dir_name(1)]


def test_unsupported_object_in_extra_state(tmp_path):
    extra = {"loader": {"pos": 3, "hook": lambda: None}}
    with ckpt({"w": torch.ones(2)}, None, tmp_path, state={"data": extra}) as ck:
        with pytest.raises(UnsupportedObjectError) as ei:
            ck.save(1)
        assert ei.value.key_path == "extra/data/loader/hook"
        extra["loader"]["hook"] = {1, 2}
        with pytest.raises(UnsupportedObjectError, match="extra/data/loader/hook.*sets are not supported"):
            ck.save(1)
        assert ck.steps() == [] and ck.latest_step() is None
        assert leftovers(tmp_path) == []


def test_non_json_metadata_rejected(tmp_path):
    with ckpt({"w": torch.ones(2)}, None, tmp_path) as ck:
        with pytest.raises(UnsupportedObjectError, match="metadata"):
            ck.save(1, metadata={"x": object()})
        with pytest.raises(UnsupportedObjectError, match="metadata"):
            ck.save(1, metadata={"x": float("nan")})
        assert ck.steps() == []


def test_metadata_in_manifest(tmp_path):
    meta = {"run": "abc", "loss": 1.25, "tags": ["x", "y"], "nested": {"epoch": 3}}
    with ckpt({"w": torch.ones(2)}, None, tmp_path) as ck:
        ck.save(7, metadata=meta)
        ck.save(8)
    assert manifest_of(tmp_path, 7)["metadata"] == meta
    assert manifest_of(tmp_path, 8)["metadata"] == {}
    assert manifest_of(tmp_path, 7)["step"] == 7


def test_optimizer_none_and_plain_dict_state(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    counters = {"epoch": 3, "tokens": torch.tensor([5, 6], dtype=torch.int64), "name": "run-1",
                "arr": np.arange(6, dtype=np.int16).reshape(2, 3)}
    with ckpt(model, None, tmp_path, state={"counters": counters}) as ck:
        ck.save(1)
    _, got = load_state(tmp_path)
    assert set(got) == {"model", "extra"}

    model2 = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    tokens = torch.zeros(2, dtype=torch.int64)
    counters2 = {"epoch": 0, "tokens": tokens, "name": "", "arr": None}
    with ckpt(model2, None, tmp_path, state={"counters": counters2}) as ck:
        ck.load()
    M.assert_same_tensors(M.params_of(model2), M.params_of(model))
    assert counters2["epoch"] == 3 and counters2["name"] == "run-1"
    assert counters2["tokens"] is tokens and tokens.tolist() == [5, 6]  # tensors filled in place
    assert isinstance(counters2["arr"], np.ndarray) and counters2["arr"].dtype == np.int16
    assert np.array_equal(counters2["arr"], counters["arr"])


class Stateful:
    """A user object with state_dict/load_state_dict (like a data loader position)."""

    def __init__(self, pos=0):
        self.pos, self.history = pos, []

    def state_dict(self):
        return {"pos": self.pos, "history": list(self.history), "t": torch.full((3,), float(self.pos))}

    def load_state_dict(self, sd):
        self.pos, self.history = sd["pos"], list(sd["history"])
        assert torch.equal(sd["t"], torch.full((3,), float(self.pos)))


def test_extra_stateful_objects(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    loader = Stateful(17)
    loader.history = [1, 2, 3]
    for _ in range(3):
        opt.step()
        sched.step()
    with ckpt(model, opt, tmp_path, state={"sched": sched, "loader": loader}) as ck:
        ck.save(3)
    m2 = nn.Linear(2, 2)
    o2 = torch.optim.Adam(m2.parameters())
    s2 = torch.optim.lr_scheduler.StepLR(o2, 2, gamma=0.5)
    l2 = Stateful()
    with ckpt(m2, o2, tmp_path, state={"sched": s2, "loader": l2}) as ck:
        ck.load()
    assert s2.state_dict() == sched.state_dict()
    assert o2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert (l2.pos, l2.history) == (17, [1, 2, 3])
    # an extra object the checkpoint does not hold
    with ckpt(m2, o2, tmp_path, state={"sched": s2, "other": Stateful()}) as ck:
        with pytest.raises(StateMismatchError, match="extra/other"):
            ck.load()
        ck.load(strict=False)


def test_rng_state_python_numpy_torch(tmp_path):
    with ckpt({"w": torch.ones(1)}, None, tmp_path, save_rng=True) as ck:
        random.seed(3), np.random.seed(3), torch.manual_seed(3)
        random.random(), np.random.rand(5), torch.rand(5)
        ck.save(1)
        expect = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), np.random.randint(1 << 30))
        random.seed(99), np.random.seed(99), torch.manual_seed(99)
        ck.load()
        got = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), np.random.randint(1 << 30))
    assert got == expect
    _, state = load_state(tmp_path)
    rng = state["rng"]
    assert isinstance(rng["numpy"][1], np.ndarray) and rng["numpy"][1].dtype == np.uint32
    assert isinstance(rng["python"], tuple)
    # without save_rng, load leaves the RNG alone
    with ckpt({"w": torch.ones(1)}, None, tmp_path) as ck:
        expect = torch.rand(1, generator=torch.Generator().manual_seed(5))
        torch.manual_seed(5)
        ck.load()
        assert torch.equal(torch.rand(1), expect)


def test_numpy_arrays_in_state(tmp_path):
    arrays = {"f": np.random.default_rng(0).standard_normal((3, 4)), "i": np.arange(5, dtype=np.uint64),
              "nc": np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2], "b": np.array([True, False]),
              "scalar": np.float32(2.5), "zero_d": np.array(7, dtype=np.int32)}
    with ckpt(None, None, tmp_path, state={"np": arrays}) as ck:
        ck.save(1)
    _, got = load_state(tmp_path)
    g = got["extra"]["np"]
    for k, v in arrays.items():
        assert type(g[k]) is type(v), k
        assert g[k].dtype == v.dtype and np.array_equal(g[k], v), k
    assert g["zero_d"].shape == ()


def test_retention_keep_last_and_keep_every(tmp_path):
    expected_after = {}
    with ckpt({"w": torch.zeros(4)}, None, tmp_path, keep_last=2, keep_every=5) as ck:
        for s in range(13):
            ck.model["w"].fill_(s)
            ck.save(s)
            committed = list(range(s + 1))
            keep = sorted(set(committed[-2:]) | {x for x in committed if x % 5 == 0})
            assert ck.steps() == keep, s
            assert ck.latest_step() == s
            expected_after[s] = keep
        assert ck.steps() == [0, 5, 10, 11, 12]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == [step_dir_name(s) for s in
                                                                                 (0, 5, 10, 11, 12)]
    assert leftovers(tmp_path) == []
    for s in (0, 5, 10, 11, 12):
        assert load_state(tmp_path, s)[1]["model"]["w"][0].item() == s


def test_retention_keep_last_only(tmp_path):
    with ckpt({"w": torch.zeros(4)}, None, tmp_path, keep_last=3) as ck:
        for s in range(0, 20, 3):
            ck.save(s)
        assert ck.steps() == [12, 15, 18]


def test_retention_after_a_rollback_keeps_the_abandoned_steps_and_the_new_ones(tmp_path):
    # Run A saved 0..20 by 5; run B resumed from step 15 and saves 16, 17, 18. Retention
    # must not delete B's steps to make room for A's 15 and 20, nor delete A's steps.
    with ckpt({"w": torch.zeros(4)}, None, tmp_path, keep_last=2) as ck:
        for s in (0, 5, 10, 15, 20):
            ck.save(s)
        assert ck.steps() == [15, 20]
        ck.load(15)
        for s in (16, 17, 18):
            ck.save(s)
            assert ck.latest_step() == s
        assert ck.steps() == [17, 18, 20]
        assert load_state(tmp_path)[0] == 18


def test_retention_deletes_only_after_the_newer_commit(tmp_path, monkeypatch):
    with ckpt({"w": torch.zeros(4)}, None, tmp_path, keep_last=1) as ck:
        ck.save(1)
        seen = []
        real_delete = ck.protocol.delete_step

        def checked_delete(step):
            newest = max(ck.protocol.committed_steps())
            assert newest > step and (tmp_path / "latest").read_text() == f"{newest}\n"
            seen.append(step)
            real_delete(step)

        monkeypatch.setattr(ck.protocol, "delete_step", checked_delete)
        ck.save(2)
        assert ck.steps() == [2] and seen == [1]  # steps() waits for the background retention

        # a failing save deletes nothing
        def boom(path, spans, **kw):
            raise EngineIOError(errno.ENOSPC, path, 0, "write")

        for e in ck.engines:
            monkeypatch.setattr(e, "write_file", boom)
        with pytest.raises(EngineIOError):
            ck.save(3)
        assert ck.steps() == [2] and seen == [1]
        assert leftovers(tmp_path) == []


def test_steps_latest_and_load_specific(tmp_path):
    state = {"w": torch.zeros(3)}
    with ckpt(state, None, tmp_path) as ck:
        assert ck.steps() == [] and ck.latest_step() is None
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            ck.load()
        for s in (5, 10, 7):
            state["w"].fill_(s)
            ck.save(s)
        assert ck.steps() == [5, 7, 10]
        assert ck.latest_step() == 7  # the most recently committed, not the largest
        assert ck.load() == 7 and state["w"][0] == 7
        assert ck.load(step=10) == 10 and state["w"][0] == 10
        assert ck.load(5) == 5 and state["w"][0] == 5
        with pytest.raises(CheckpointNotFoundError) as ei:
            ck.load(6)
        msg = str(ei.value)
        assert "step 6" in msg and "[5, 7, 10]" in msg and str(tmp_path) in msg
        assert isinstance(ei.value, FileNotFoundError)
    with pytest.raises(CheckpointNotFoundError, match="step 6"):
        load_state(tmp_path, 6)
    with pytest.raises(CheckpointNotFoundError):
        load_state(tmp_path / "nowhere")


def test_same_step_saved_twice_replaces(tmp_path):
    state = {"w": torch.full((1000,), 1.0)}
    with ckpt(state, None, tmp_path) as ck:
        ck.save(3)
        state["w"].fill_(2.0)
        state["extra_key"] = torch.ones(2)
        ck.save(3)
        assert ck.steps() == [3]
    _, got = load_state(tmp_path, 3)
    assert (got["model"]["w"] == 2.0).all() and "extra_key" in got["model"]
    assert sorted(os.listdir(tmp_path)) == [".gdswriter-root", ".gdswriter.lock", "latest", step_dir_name(3)]


def test_two_checkpointers_on_one_root_lock(tmp_path):
    a = ckpt({"w": torch.ones(1)}, None, tmp_path)
    with pytest.raises(CheckpointLockedError, match=str(os.getpid())) as ei:
        ckpt({"w": torch.ones(1)}, None, tmp_path)
    assert isinstance(ei.value, BlockingIOError)
    # also when the second one names it as a secondary root
    with pytest.raises(CheckpointLockedError):
        ckpt({"w": torch.ones(1)}, None, [tmp_path / "other", tmp_path])
    a.save(1)
    a.close()
    with ckpt({"w": torch.zeros(1)}, None, tmp_path) as b:  # released on close
        assert b.load() == 1
    a.close()  # idempotent
    with pytest.raises(GDSWriterError, match="closed"):
        a.save(2)


LOCK_CHILD = textwrap.dedent("""
    import sys, torch
    from support import models as M
    from gdswriter import GDSCheckpointer, CheckpointLockedError
    try:
        ck = GDSCheckpointer({"w": torch.ones(1)}, None, sys.argv[1], options=M.small_options())
    except CheckpointLockedError as e:
        print("LOCKED", e)
        sys.exit(3)
    ck.save(9)
    ck.close()
    print("SAVED")
""")


def test_lock_across_processes(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))

    def child():
        return subprocess.run([sys.executable, "-c", LOCK_CHILD, str(tmp_path)], env=env, capture_output=True,
                              text=True, timeout=120)

    a = ckpt({"w": torch.ones(1)}, None, tmp_path)
    p = child()
    assert p.returncode == 3, p.stderr
    assert "LOCKED" in p.stdout and f"pid {os.getpid()}" in p.stdout
    a.close()
    p = child()
    assert p.returncode == 0 and "SAVED" in p.stdout, p.stderr
    with ckpt({"w": torch.ones(1)}, None, tmp_path) as b:
        assert b.steps() == [9]


def test_shape_mismatch_strict_and_non_strict(tmp_path):
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with ckpt(src, None, tmp_path) as ck:
        ck.save(1)
    dst = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    before = M.params_of(dst)
    with ckpt(dst, None, tmp_path) as ck:
        with pytest.raises(StateMismatchError) as ei:
            ck.load()
        assert "model/0.weight" in str(ei.value) and "[3, 4]" in str(ei.value) and "[3, 5]" in str(ei.value)
        assert ck.load(strict=False) == 1
    got = M.params_of(dst)
    assert torch.equal(got["0.weight"], before["0.weight"])  # skipped
    for k in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(got[k], src.state_dict()[k]), k

    # dtype mismatch, too
    dst64 = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    with ckpt(dst64, None, tmp_path) as ck:
        with pytest.raises(StateMismatchError, match="float64"):
            ck.load()


def test_missing_and_unexpected_keys(tmp_path):
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with ckpt(src, None, tmp_path) as ck:
        ck.save(1)
    bigger = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    with ckpt(bigger, None, tmp_path) as ck:
        with pytest.raises(StateMismatchError, match=r"missing keys \['2.weight', '2.bias'\]"):
            ck.load()
        ck.load(strict=False)
    assert torch.equal(bigger[1].weight, src[1].weight)
    smaller = nn.Sequential(nn.Linear(4, 4))
    with ckpt(smaller, None, tmp_path) as ck:
        with pytest.raises(StateMismatchError, match="unexpected keys"):
            ck.load()
        ck.load(strict=False)
    assert torch.equal(smaller[0].weight, src[0].weight)
    # a plain dict target missing from the checkpoint
    target = {"1.weight": torch.zeros(2, 4), "nope": torch.zeros(1)}
    with ckpt(target, None, tmp_path) as ck:
        with pytest.raises(StateMismatchError, match="nope"):
            ck.load()
        ck.load(strict=False)
    assert torch.equal(target["1.weight"], src[1].weight.detach())
    # the optimizer: saved without one, loaded with one
    opt = torch.optim.SGD(src.parameters(), lr=0.1)
    with ckpt(src, opt, tmp_path) as ck:
        with pytest.raises(StateMismatchError, match="optimizer: the checkpoint holds no state"):
            ck.load()
        assert ck.load(strict=False) == 1


def _failing_engines(ck, monkeypatch, err=errno.ENOSPC, gate=None):
    def boom(path, spans, **kw):
        if gate is not None:
            gate.wait(30)
        raise EngineIOError(err, path, 0, "write")

    for e in ck.engines:
        monkeypatch.setattr(e, "write_file", boom)


def gate_engines(ck, monkeypatch) -> threading.Event:
    """Hold every engine's write_file until the returned event is set."""
    gate = threading.Event()
    for e in ck.engines:
        real = e.write_file

        def held(path, spans, *, _real=real, **kw):
            assert gate.wait(60), "the test never opened the gate"
            return _real(path, spans, **kw)

        monkeypatch.setattr(e, "write_file", held)
    return gate


def test_save_async_handle_result_and_done(tmp_path, monkeypatch):
    state = {"w": torch.randn(1 << 16)}
    with ckpt(state, None, tmp_path) as ck:
        gate = gate_engines(ck, monkeypatch)
        h = ck.save_async(4, metadata={"a": 1})
        assert h.step == 4 and not h.done()
        with pytest.raises(FutureTimeout):
            h.result(timeout=0.05)
        assert not h.done()
        gate.set()
        assert h.result(timeout=60) == 4 and h.done()
        assert h.exception() is None
        assert ck.steps() == [4]
        # several in flight commit in submission order
        hs = [ck.save_async(s) for s in (5, 6, 7)]
        ck.wait()
        assert all(x.done() for x in hs) and ck.steps() == [4, 5, 6, 7] and ck.latest_step() == 7


def test_background_error_reported_once_by_handle(tmp_path, monkeypatch):
    with ckpt({"w": torch.ones(10)}, None, tmp_path) as ck:
        ck.save(1)
        _failing_engines(ck, monkeypatch)
        h = ck.save_async(2)
        with pytest.raises(EngineIOError) as ei:
            h.result(timeout=60)
        assert type(ei.value) is EngineIOError and ei.value.errno == errno.ENOSPC
        assert "file system is full" in str(ei.value)
        assert ei.value.__cause__ is not ei.value
        assert isinstance(h.exception(), EngineIOError)
        ck.wait()  # already reported: not again
        ck.wait()
        monkeypatch.undo()
        ck.save(3)
        assert ck.steps() == [1, 3]
        assert leftovers(tmp_path) == []


def test_background_error_reported_once_by_wait(tmp_path, monkeypatch):
    ck = ckpt({"w": torch.ones(10)}, None, tmp_path)
    ck.save(1)
    _failing_engines(ck, monkeypatch, err=errno.EIO)
    h = ck.save_async(2)
    with pytest.raises(EngineIOError) as ei:
        ck.wait()
    assert ei.value.errno == errno.EIO
    ck.wait()  # a second wait() does not raise
    assert h.done()
    assert ck.steps() == [1] and leftovers(tmp_path) == []
    ck.close()


def test_background_error_reported_by_next_save_or_close(tmp_path, monkeypatch):
    ck = ckpt({"w": torch.ones(10)}, None, tmp_path)
    gate = threading.Event()
    _failing_engines(ck, monkeypatch, gate=gate)
    h = ck.save_async(1)
    gate.set()
    while not h.done():
        threading.Event().wait(0.01)
    with pytest.raises(EngineIOError):
        ck.save_async(2)  # the earlier failure surfaces before anything new is started
    ck.wait()
    h2 = ck.save_async(3)
    with pytest.raises(EngineIOError):
        ck.close()  # raised after releasing everything
    assert h2.done()
    with ckpt({"w": torch.ones(10)}, None, tmp_path) as again:  # lock released
        assert again.steps() == []
        assert leftovers(tmp_path) == []


def test_multiple_roots(tmp_path):
    roots = [tmp_path / f"ssd{i}" for i in range(3)]
    model, opt, sched, scaler = M.build(0)
    M.train_steps(model, opt, sched, 2, scaler)
    with GDSCheckpointer(model, opt, roots, state={"sched": sched},
                         options=M.small_options(files_per_root=2)) as ck:
        ck.save(2)
        assert ck.roots == roots
    m = manifest_of(roots[0], 2)
    files = m["files"]
    assert sorted((r, p) for r, p, *_ in files) == sorted((r, f"data-r{r}-f{k}.bin") for r in range(3) for k in range(2))
    sizes = [s for _, _, s, *_ in files]
    n_storages = sum(1 for s in m["storages"] if s["nbytes"])
    assert max(sizes) - min(sizes) <= 4096 * n_storages
    # balanced to within a couple of alignment units and one packed storage (under PACK_BELOW: never
    # split, it moves whole to the next file)
    assert max(sizes) - min(sizes) <= 2 * 4096 + PACK_BELOW
    assert sum(s["nbytes"] for s in m["storages"]) <= sum(sizes)
    for i, r in enumerate(roots):
        names = set(os.listdir(r / step_dir_name(2)))
        assert {f"data-r{i}-f0.bin", f"data-r{i}-f1.bin"} <= names
        assert (MANIFEST_NAME in names) == (i == 0)
        assert ("latest" in os.listdir(r)) == (i == 0)
        for _, p, size, *_ in (f for f in files if f[0] == i):
            assert os.path.getsize(r / step_dir_name(2) / p) == size

    model2, opt2, sched2, _ = M.build(1)
    with GDSCheckpointer(model2, opt2, roots, state={"sched": sched2},
                         options=M.small_options(files_per_root=2)) as ck:
        assert ck.load() == 2
    M.assert_same_tensors(M.params_of(model2), M.params_of(model))
    assert sched2.state_dict() == sched.state_dict()
    # load_state with the same roots, and with another files_per_root (the manifest decides)
    _, st = load_state([str(r) for r in roots])
    assert torch.equal(st["model"]["emb.weight"], model.emb.weight.detach())

    # fewer roots: a clear error, never wrong data
    with pytest.raises(CorruptCheckpointError, match="root #2.*same list of roots"):
        load_state(roots[:2])
    with GDSCheckpointer(M.build(1)[0], None, roots[:1], options=M.small_options()) as ck:
        with pytest.raises(CorruptCheckpointError, match="same list of roots"):
            ck.load()
    # the secondary roots were not cleaned by the single-root checkpointer
    assert os.path.isdir(roots[2] / step_dir_name(2))
    assert load_state(roots)[0] == 2


def test_multiple_roots_retention_removes_every_root(tmp_path):
    roots = [tmp_path / "a", tmp_path / "b"]
    with GDSCheckpointer({"w": torch.randn(50000)}, None, roots, options=M.small_options(keep_last=1)) as ck:
        for s in range(3):
            ck.save(s)
    for r in roots:
        assert sorted(n for n in os.listdir(r) if n.startswith("step_")) == [step_dir_name(2)]
        assert leftovers(r) == []


def test_roots_validation(tmp_path):
    with pytest.raises(InvalidOptionError, match="same directory twice"):
        GDSCheckpointer({"w": torch.ones(1)}, None, [tmp_path, tmp_path / "." ])
    with pytest.raises(InvalidOptionError):
        GDSCheckpointer({"w": torch.ones(1)}, None, [])
    with pytest.raises(InvalidOptionError):
        CheckpointOptions(keep_last=0)
    with pytest.raises(InvalidOptionError):
        CheckpointOptions(files_per_root=0)
    with pytest.raises(InvalidOptionError, match="step"):
        with ckpt({"w": torch.ones(1)}, None, tmp_path) as ck:
            ck.save(-1)
    with pytest.raises(InvalidOptionError):
        GDSCheckpointer(object(), None, tmp_path / "x")


def test_load_state_never_unpickles(tmp_path, monkeypatch):
    model, opt, sched, scaler = M.build(0)
    M.train_steps(model, opt, sched, 1, scaler)
    with GDSCheckpointer(model, opt, tmp_path, state={"sched": sched, "scaler": scaler, "np": {"a": np.ones(3)}},
                         options=M.small_options(save_rng=True)) as ck:
        ck.save(1)

    def forbidden(*a, **k):
        raise AssertionError("unpickling is forbidden")

    class NoUnpickler:
        def __init__(self, *a, **k):
            forbidden()

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(np, "load", forbidden)
    step, state = load_state(tmp_path)
    assert step == 1
    assert torch.equal(state["model"]["pos"], model.pos.detach())
    assert state["extra"]["sched"] == sched.state_dict()
    model2, opt2, sched2, scaler2 = M.build(3)
    with GDSCheckpointer(model2, opt2, tmp_path, state={"sched": sched2, "scaler": scaler2, "np": {}},
                         options=M.small_options(save_rng=True)) as ck:
        ck.load()
    M.assert_same_tensors(M.params_of(model2), M.params_of(model))
    # and the data files hold no pickle stream: the manifest is JSON
    raw = (tmp_path / step_dir_name(1) / MANIFEST_NAME).read_bytes()
    assert raw.startswith(b"{") and raw.endswith(b"}\n")


def test_ordered_dict_metadata_and_module_versions_roundtrip(tmp_path):
    bn = nn.BatchNorm1d(3)
    bn(torch.randn(8, 3))
    with ckpt(bn, None, tmp_path) as ck:
        ck.save(1)
    _, st = load_state(tmp_path)
    sd = st["model"]
    assert isinstance(sd, collections.OrderedDict)
    assert sd._metadata == bn.state_dict()._metadata
    assert sd["num_batches_tracked"].dtype == torch.int64 and sd["num_batches_tracked"].item() == 1


@pytest.mark.parametrize("atomic", [None, False])
def test_load_reads_model_and_optimizer_state_in_place(tmp_path, atomic):
    """A resumed optimizer that already has state is filled in place, like the model:
    same tensors (same memory) afterwards, holding the saved values; atomic=False too (its
    small live tensors are read with the fresh storages, then copied in: load/policy.py)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with ckpt(model, opt, tmp_path) as ck:
        ck.save(1)
        model(torch.randn(4, 64)).sum().backward()
        opt.step()  # both now differ from step 1
        model_ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
        opt_ptrs = {(id(p), k): v.data_ptr() for p, st in opt.state.items() for k, v in st.items()}
        ck.load(1, atomic=atomic)
    for k, v in model.state_dict().items():
        assert v.data_ptr() == model_ptrs[k] and torch.equal(v, saved_model[k]), k
    for p, st in opt.state.items():
        for k, v in st.items():
            assert v.data_ptr() == opt_ptrs[(id(p), k)], k
            assert torch.equal(v, saved_opt[id(p)][k]), k


def test_async_snapshot_and_fresh_buffers_skip_the_staging_copy(tmp_path, monkeypatch):
    """save_async snapshots are page-aligned, so their large storages are written zero-copy,
    and a resume into a fresh optimizer reads its state zero-copy; both bit-exact."""
    import gdswriter.engines.staged as staged

    torch.manual_seed(0)
    model = nn.Linear(1023, 517)  # 2 MiB + odd bytes of weight: zero-copy blocks plus a staged tail
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 1023)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {k: v.clone() for k, v in opt.state[model.weight].items()}
    nbytes = sum(v.numel() * v.element_size() for v in want.values()) + \
        sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    copied = []
    real_copy = staged.copy_bytes
    # Counting the bytes staged: the staging copy is internal to the engine, no public seam.
    monkeypatch.setattr(staged, "copy_bytes", lambda d, do, s, so, k: (copied.append(k), real_copy(d, do, s, so, k)))

    with GDSCheckpointer(model, opt, root=tmp_path / "ck") as ck:
        direct = ck.engine_info.direct_io
        ck.save_async(1).result()
        written = sum(copied)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        copied.clear()
        ck.optimizer = fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert ck.load(1) == 1
    for k, v in want.items():
        assert torch.equal(model.state_dict()[k], v), k
    for k, v in want_opt.items():
        assert torch.equal(fresh.state[model.weight][k], v), k
    if direct:  # exp_avg/exp_avg_sq of the weight (2 x 2 MiB+) were read into fresh aligned buffers
        assert written < nbytes // 4, f"the snapshot went through the staging buffers ({written} of {nbytes} bytes)"
        assert sum(copied) < nbytes * 2 // 3, f"fresh optimizer state was staged ({sum(copied)} of {nbytes} bytes)"


@pytest.mark.parametrize("direct_io", [True, False])
def test_unaligned_live_tensors_get_a_one_time_hint(tmp_path, caplog, io_fresh_log_once, direct_io):
    """torch's default CPU allocator puts a large tensor 64 bytes into a page. Where O_DIRECT
    needs more (512 bytes on this machine's disk; NVMe needs 4) save and in-place load stage it,
    and from 64 MiB on gdswriter says once how to align it. Not without O_DIRECT: there every
    byte is staged anyway."""
    model = nn.Linear(4096, 4096)  # 64 MiB of fp32 weight
    if model.weight.data_ptr() % 4096 == 0:
        pytest.skip("torch placed the weight on a page boundary (THP_MEM_ALLOC_ENABLE set?)")
    options = CheckpointOptions(engine=EngineOptions(direct_io=direct_io))
    with caplog.at_level(logging.INFO, logger="gdswriter"), \
            GDSCheckpointer(model, None, root=tmp_path, options=options) as ck:
        ck.save(1)
        ck.save(2)
        ck.load(2)
        info = ck.engine_info
    hints = [r.getMessage() for r in caplog.records if "THP_MEM_ALLOC_ENABLE=1" in r.getMessage()]
    if info.direct_io and model.weight.data_ptr() % info.direct_memory_alignment:
        assert len(hints) == 1, caplog.text
        assert f"64 MiB of live CPU tensors are not {info.direct_memory_alignment}-byte aligned" in hints[0]
    else:
        assert hints == []


def test_small_unaligned_state_gets_no_hint(tmp_path, caplog, io_fresh_log_once):
    model = nn.Linear(1024, 1024)  # 4 MiB: staging it costs little
    with caplog.at_level(logging.INFO, logger="gdswriter"), GDSCheckpointer(model, None, root=tmp_path) as ck:
        ck.save(1)
        ck.load(1)
    assert "THP_MEM_ALLOC_ENABLE" not in caplog.text


_THP_SCRIPT = r"""
import sys, torch
from torch import nn
import gdswriter.engines.staged as staged
from gdswriter import GDSCheckpointer

model = nn.Linear(1024, 1024)  # 4 MiB weight
assert model.weight.data_ptr() % 4096 == 0, "THP_MEM_ALLOC_ENABLE=1 did not page-align the weight"
want = {k: v.clone() for k, v in model.state_dict().items()}
copied = []
real_copy = staged.copy_bytes
staged.copy_bytes = lambda d, do, s, so, k: (copied.append(k), real_copy(d, do, s, so, k))
with GDSCheckpointer(model, None, root=sys.argv[1]) as ck:
    ck.save(1)
    written = sum(copied)
    with torch.no_grad():
        model.weight.zero_()
    copied.clear()
    ck.load(1)
    direct = ck.engine_info.direct_io
for k, v in want.items():
    assert torch.equal(model.state_dict()[k], v), k
print("direct", direct, "staged", written, sum(copied))
"""


def test_page_aligned_live_tensors_skip_the_staging_copy(tmp_path):
    """What the hint promises: with THP_MEM_ALLOC_ENABLE=1 torch page-aligns the weight and
    save / in-place load move it without the staging copy (only the 4 KiB bias is staged)."""
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
    proc = subprocess.run([sys.executable, "-c", _THP_SCRIPT, str(tmp_path / "ck")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _, direct, _, written, read = proc.stdout.split()
    if direct == "True":
        assert int(written) <= 64 * 1024 and int(read) <= 64 * 1024, proc.stdout
    else:
        assert int(written) >= 4 << 20, proc.stdout  # buffered I/O: everything is staged


def test_gpu_local_plans_are_written_and_recorded(tmp_path, monkeypatch):
    """The save path takes the topology planner's plan as it is (one file per GPU and root,
    several files on one root) and records which GPU wrote each file. CUDA tensors cannot
    exist here: the storages are CPU tensors presented to the planner as cuda:0..3, on the
    replayed two-socket 4-GPU server."""
    from gdswriter.planner.affinity import plan_for_save
    from gdswriter.planner.topology import Topology

    topo = Topology.load(Path(__file__).parent / "data" / "topologies" / "two_socket_4gpu.json")
    roots = [tmp_path / "a", tmp_path / "b"]
    model = {f"w{i}": torch.randn(1000 + 37 * i) for i in range(8)}
    want = {k: v.clone() for k, v in model.items()}
    with ckpt(model, None, roots) as ck:
        def gpu_local(sizes, devices, targets):
            devices = [f"cuda:{i % 4}" for i in range(len(sizes))]
            return plan_for_save(sizes, devices, ck.protocol.roots, targets, topo, cuda_gpus={g: g for g in range(4)})

        # A GPU-local plan on a CPU machine: the session takes no plan from outside (its seam, new_plan).
        monkeypatch.setattr(ck.session, "new_plan", gpu_local)
        ck.save(1)
        for v in model.values():
            v.zero_()
        assert ck.load() == 1
    assert all(torch.equal(model[k], want[k]) for k in want)
    m = manifest_of(roots[0], 1)
    names = sorted(f[1] for f in m["files"])
    assert all("-gpu" in n for n in names) and sorted(f[3]["gpu"] for f in m["files"]) == [0, 1, 2, 3], names


def test_engines_given_are_used_one_per_root_and_closed_by_close(tmp_path):
    """engines=: the checkpointer writes and reads through the engines it is given (one per root,
    in root order) and closes them as its own; a wrong count is refused, saying what to pass."""
    from gdswriter import create_engine

    roots = [tmp_path / "a", tmp_path / "b"]
    opts = M.small_options()
    with pytest.raises(InvalidOptionError, match="one IOEngine per root"):
        GDSCheckpointer({"w": torch.ones(10)}, None, roots, options=opts, engines=[create_engine(opts.engine)])
    engines = [create_engine(opts.engine) for _ in roots]
    closed = []
    for e in engines:
        e.close = lambda _real=e.close, _e=e: (closed.append(_e), _real())[1]
    model = {"w": torch.arange(100_000, dtype=torch.float32)}
    with GDSCheckpointer(model, None, roots, options=opts, engines=engines) as ck:
        assert ck.engines == tuple(engines)
        ck.save(1)
        model["w"].zero_()
        assert ck.load() == 1
    assert torch.equal(model["w"], torch.arange(100_000, dtype=torch.float32))
    assert closed == engines
