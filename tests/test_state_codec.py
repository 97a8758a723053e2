"""Tests for gdswriter.format.state_codec and gdswriter.format.dtypes."""

from __future__ import annotations

import collections
import json
import math
import random
import struct
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from gdswriter.errors import CorruptCheckpointError, UnsupportedObjectError
from gdswriter.format.dtypes import all_dtypes, dtype_from_name, dtype_to_name
from gdswriter.format.state_codec import (MAX_DEPTH, Unfreezable, decode_state, decode_state_slots, encode_state,
                                         encode_state_named, fill_slots, freeze_state)

JSON_SETTINGS = settings(max_examples=200, deadline=None)


def roundtrip(obj):
    """encode -> JSON text -> decode, checking the tree is strict JSON (no NaN literals)."""
    tree, tensors = encode_state(obj)
    text = json.dumps(tree, allow_nan=False)
    return decode_state(json.loads(text), tensors), tree, tensors


def same(a, b) -> bool:
    """Deep equality with exact types, nan == nan, -0.0 != 0.0, tensors by identity."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (len(a) == len(b) and all(same(ka, kb) and same(va, vb)
                                         for (ka, va), (kb, vb) in zip(a.items(), b.items()))
                and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None)))
    return a == b


# ----------------------------------------------------------------------------- dtypes

def test_dtype_names_cover_every_torch_dtype():
    exposed = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert set(all_dtypes()) == exposed
    assert len(all_dtypes()) == len(exposed)
    for d in exposed:
        name = dtype_to_name(d)
        assert name == str(d).removeprefix("torch.")
        assert getattr(torch, name) is d
        assert dtype_from_name(name) is d
    assert dtype_to_name(torch.half) == "float16" and dtype_to_name(torch.long) == "int64"
    assert dtype_to_name(torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize("bad", ["float", "half", "torch.float32", "nope", "", 3, None, ["float32"]])
def test_dtype_from_name_rejects(bad):
    with pytest.raises(CorruptCheckpointError):
        dtype_from_name(bad)


# ----------------------------------------------------------------------------- real state

def _train_two_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_optimizer_scheduler_model_roundtrip():
    model, opt, sched = _train_two_steps()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "step": 2}
    try:
        state["scaler"] = torch.amp.GradScaler("cpu").state_dict()
    except Exception:  # pragma: no cover - GradScaler on CPU depends on the torch build
        pass
    back, tree, tensors = roundtrip(state)
    assert same(back, state)
    assert isinstance(back["model"], collections.OrderedDict)
    assert back["model"]._metadata == model.state_dict()._metadata
    assert list(back["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys survive
    # It loads back into fresh objects.
    model2, opt2, sched2 = _train_two_steps()
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optimizer"])
    sched2.load_state_dict(back["scheduler"])
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_module_metadata_preserved():
    sd = torch.nn.BatchNorm1d(3).state_dict()
    assert sd._metadata
    back, tree, _ = roundtrip(sd)
    assert type(back) is collections.OrderedDict and back._metadata == sd._metadata
    assert "meta" in tree and "$odict" in tree
    plain = collections.OrderedDict(a=1)
    back, tree, _ = roundtrip(plain)
    assert tree == {"$odict": [["a", 1]]} and not hasattr(back, "_metadata")


def test_torch_rng_roundtrip():
    state = torch.get_rng_state()
    back, tree, tensors = roundtrip(state)
    assert tree == {"$tensor": 0} and back is state
    torch.set_rng_state(back)


def test_python_random_roundtrip():
    state = random.getstate()
    back, _, _ = roundtrip(state)
    assert back == state and type(back[1]) is tuple
    expected = [random.random() for _ in range(5)]
    random.setstate(back)
    assert [random.random() for _ in range(5)] == expected


def test_numpy_random_roundtrip():
    np.random.seed(1234)
    np.random.standard_normal()  # sets a cached gaussian
    state = np.random.get_state()
    back, _, tensors = roundtrip(state)
    assert back[0] == "MT19937" and back[1].dtype == np.uint32 and back[1].shape == (624,)
    assert same(back, state)
    expected = np.random.random(5)
    np.random.set_state(back)
    assert np.array_equal(np.random.random(5), expected)


@pytest.mark.parametrize("dtype", all_dtypes(), ids=str)
def test_every_dtype_tensor_is_mapped_by_index(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        a, b = torch.empty((), dtype=dtype), torch.empty(3, dtype=dtype)
    back, tree, tensors = roundtrip({"a": a, "b": [b, a], "dt": dtype})
    assert tensors[0] is a and tensors[1] is b and len(tensors) == 2
    assert back["a"] is a and back["b"][0] is b and back["b"][1] is a and back["dt"] is dtype
    assert tree == {"$dict": [["a", {"$tensor": 0}], ["b", [{"$tensor": 1}, {"$tensor": 0}]],
                              ["dt", {"$dtype": dtype_to_name(dtype)}]]}


def test_parameter_and_sharing():
    p = torch.nn.Parameter(torch.ones(2))
    t = torch.zeros(3)
    back, tree, tensors = roundtrip([p, t, p, t, (t,)])
    assert len(tensors) == 2 and tensors[0] is p and tensors[1] is t
    assert back[0] is back[2] is p and back[1] is back[3] is back[4][0] is t
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    back, tree, tensors = roundtrip({"x": arr, "y": arr})
    assert len(tensors) == 1 and back["x"] is back["y"] and same(back["x"], arr)


def test_numpy_arrays_and_scalars():
    arrays = [np.arange(5).astype(dt) for dt in (np.uint8, np.uint16, np.uint32, np.uint64, np.int64,
                                               np.float16, np.float32, np.float64, np.complex64, np.bool_)]
    arrays.append(np.arange(12.0).reshape(3, 4)[:, ::2])  # non-contiguous
    arrays.append(np.array(3.5))  # 0-d
    arrays.append(np.arange(4, dtype=np.int32)[::-1])  # negative stride
    arrays.append(np.zeros((0, 3), dtype=np.float32))
    back, _, _ = roundtrip(arrays)
    assert same(back, arrays)
    scalars = [np.float32(1.5), np.float64(-0.0), np.float16(np.inf), np.float32(np.nan), np.int64(-2 ** 63),
               np.uint64(2 ** 64 - 1), np.int8(-128), np.bool_(True), np.complex64(1 - 2j),
               np.complex128(complex(np.nan, -np.inf)), np.str_("héllo"), np.bytes_(b"ab\x00c"),
               np.float32(3.4028235e38)]
    back, tree, _ = roundtrip(scalars)
    assert same(back, scalars)
    assert tree[0] == {"$npscalar": ["float32", 1.5]}


def test_tuple_list_size_dtype_device_bytes():
    obj = [(1, 2), [1, 2], (), [], ((),), torch.Size([2, 3]), torch.Size([]), torch.float8_e4m3fn,
           torch.device("cuda:0"), torch.device("cpu"), b"\x00\xff", b"", "$tuple", None, True, False]
    back, tree, _ = roundtrip(obj)
    assert same(back, obj)
    assert type(back[0]) is tuple and type(back[1]) is list and type(back[5]) is torch.Size
    assert tree[0] == {"$tuple": [1, 2]} and tree[1] == [1, 2]
    assert tree[8] == {"$device": "cuda:0"} and tree[10] == {"$bytes": "AP8="}


def test_dict_keys_and_order():
    obj = {3: "a", 1: "b", "x": 1, 2.5: None, None: 0, False: 1, (1, "a", (None,)): 2, float("nan"): 3,
           2 ** 70: 4, "$dict": 5, "$tensor": {"$float": "nan"}}
    back, tree, _ = roundtrip(obj)
    assert list(tree) == ["$dict"]
    assert same(back, obj)
    assert [type(k) for k in back] == [type(k) for k in obj]


def test_dollar_keys_inside_plain_dict():
    obj = {"$tensor": 0, "$float": "nan", "meta": 1, "$odict": []}
    back, _, tensors = roundtrip(obj)
    assert back == obj and not tensors


def test_float_exactness():
    values = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1.7976931348623157e308, 0.1,
              struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0],   # signalling-NaN payload
              struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000123))[0]]
    back, tree, _ = roundtrip(values)
    assert [struct.pack("<d", x) for x in back] == [struct.pack("<d", x) for x in values]
    assert math.copysign(1.0, back[5]) == -1.0 and math.copysign(1.0, back[1]) == -1.0
    assert tree[:4] == [{"$float": "nan"}, {"$float": "-nan"}, {"$float": "inf"}, {"$float": "-inf"}]


def test_big_ints():
    values = [0, -1, 2 ** 63 - 1, -(2 ** 63) + 1, 2 ** 63, -(2 ** 63), 10 ** 5000, -(3 ** 9000)]
    back, tree, _ = roundtrip(values)
    assert back == values and all(type(x) is int for x in back)
    assert tree[2] == 2 ** 63 - 1 and tree[4] == {"$int": "0x8000000000000000"}


# ----------------------------------------------------------------------------- rejection

class _Point(NamedTuple):
    x: int


@pytest.mark.parametrize("bad, fragment", [
    (lambda: 0, "functions"),
    ({1, 2}, "sets"),
    (frozenset(), "sets"),
    (_Point(1), "named tuples"),
    (collections.defaultdict(list), "dict("),
    (object(), "not supported"),
    (1 + 2j, "not supported"),
    (np.array([object()], dtype=object), "numpy arrays of dtype object"),
    (np.array(["a"]), "numpy arrays of dtype <U1"),
    (np.arange(3, dtype=">i4"), "numpy arrays of dtype >i4"),
    (np.longdouble(1) if np.dtype(np.longdouble).itemsize > 8 else np.datetime64(1, "s"), "numpy scalars"),
    (torch.Generator(), "get_state"),
])
def test_rejects_with_key_path(bad, fragment):
    state = {"optimizer": {"param_groups": [{"lr": 0.1, "foo": bad}]}}
    with pytest.raises(UnsupportedObjectError) as info:
        encode_state(state)
    assert info.value.key_path == "optimizer/param_groups/0/foo"
    assert "optimizer/param_groups/0/foo" in str(info.value) and fragment in str(info.value)
    assert isinstance(info.value, TypeError)


def test_key_path_prefix_and_bad_keys():
    with pytest.raises(UnsupportedObjectError) as info:
        encode_state([{"a": set()}], key_path="root")
    assert info.value.key_path == "root/0/a"
    with pytest.raises(UnsupportedObjectError, match="dict keys must be"):
        encode_state({"a": {object(): 1}})
    with pytest.raises(UnsupportedObjectError, match="dict keys must be"):
        encode_state({(1, (2, object())): 1})


@pytest.mark.parametrize("make, fragment", [
    (lambda: torch.eye(3).to_sparse(), "to_dense"),
    (lambda: torch.eye(3).to_sparse_csr(), "to_dense"),
    (lambda: torch.empty(3, device="meta"), "meta"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    (lambda: torch.nn.parameter.UninitializedParameter(), "subclass"),
])
def test_rejects_tensors(make, fragment):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = make()
    with pytest.raises(UnsupportedObjectError) as info:
        encode_state({"w": t})
    assert info.value.key_path == "w" and fragment in str(info.value)


def test_rejects_cycles_but_allows_shared_containers():
    a: list = [1]
    a.append(a)
    with pytest.raises(UnsupportedObjectError, match="cyclic"):
        encode_state({"a": a})
    d: dict = {}
    d["self"] = {"x": d}
    with pytest.raises(UnsupportedObjectError, match="cyclic") as info:
        encode_state(d)
    assert info.value.key_path == "self/x"
    shared = [1, 2]
    back, _, _ = roundtrip([shared, shared, {"s": shared}])
    assert back == [[1, 2], [1, 2], {"s": [1, 2]}]


def test_depth_limit_both_ways():
    ok: object = 0
    for _ in range(MAX_DEPTH):  # MAX_DEPTH nested containers are fine, one more is not
        ok = [ok]
    roundtrip(ok)
    deep = [ok]
    with pytest.raises(UnsupportedObjectError, match="nesting"):
        encode_state(deep)
    tree: object = 0
    for _ in range(100_000):
        tree = {"$tuple": [tree]}
    with pytest.raises(CorruptCheckpointError, match="nesting"):
        decode_state(tree, [])


# ----------------------------------------------------------------------------- decode robustness

@pytest.mark.parametrize("tree", [
    {"$tensor": 1}, {"$tensor": -1}, {"$tensor": True}, {"$tensor": "0"}, {"$ndarray": 5},
    {"$unknown": 1}, {}, {"a": 1}, {"$dict": 1}, {"$dict": [[1]]}, {"$dict": [[[1], 2]]},
    {"$dict": [["a", 1], ["a", 2]]}, {"$dict": [], "meta": 1}, {"$tuple": 1, "$dict": []},
    {"$float": "NaN"}, {"$float": 1.0}, {"$int": "12"}, {"$int": "0x"}, {"$bytes": "!!"}, {"$bytes": 1},
    {"$npscalar": ["int8", 300]}, {"$npscalar": ["object", 1]}, {"$npscalar": ["float32", "x"]},
    {"$npscalar": ["bool", 1]}, {"$npscalar": []}, {"$dtype": "float"}, {"$dtype": None},
    {"$device": "gpu:0"}, {"$device": 1}, {"$size": [-1]}, {"$size": [True]}, {"$size": 3},
    (1, 2), {1: 2}, object(),
])
def test_decode_rejects_malformed(tree):
    with pytest.raises(CorruptCheckpointError):
        decode_state(tree, [torch.zeros(1)])


def test_decode_ndarray_of_non_numpy_dtype():
    with pytest.raises(CorruptCheckpointError):
        decode_state({"$ndarray": 0}, [torch.zeros(2, dtype=torch.bfloat16)])


_TAG_KEYS = ["$dict", "$tuple", "$tensor", "$float", "$bytes", "$odict", "$ndarray", "$npscalar", "$dtype",
             "$device", "$size", "$int", "meta"]
_json_leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.integers() | st.floats() | st.text(max_size=8) \
    | st.sampled_from(["nan", "-nan", "inf", "float32", "int8", "cuda:0", "0x10", "AA==", "str", "bytes"])
_json = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.sampled_from(_TAG_KEYS), inner, max_size=3)
    | st.builds(lambda k, v: {k: v}, st.sampled_from(_TAG_KEYS), inner)
    | st.builds(lambda a, b: [a, b], inner, inner),
    max_leaves=30,
)


@JSON_SETTINGS
@given(_json)
def test_decode_arbitrary_json_only_raises_corrupt(tree):
    try:
        decode_state(tree, [torch.zeros(2), torch.arange(3, dtype=torch.uint8)])
    except CorruptCheckpointError:
        pass


_key = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=4)
_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu"), torch.Size([2, 3])]),
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(_key, inner, max_size=4)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4).map(collections.OrderedDict),
    max_leaves=25,
)


@JSON_SETTINGS
@given(_plain)
def test_roundtrip_plain_values(obj):
    back, _, tensors = roundtrip(obj)
    assert not tensors
    assert same(back, obj)


def test_tensors_are_named_by_their_first_key_path():
    """Each tensor's manifest name is the key path of its first place in the state; a key
    the tree stores as an object (tuple, huge int, non-finite float) appears as that
    object's repr; an OrderedDict's _metadata names nothing (e is named where it is met
    next, at the key "" of the root: "<root>")."""
    a, b, c, d, e, f, g = (torch.full((2,), float(i)) for i in range(7))
    odict = collections.OrderedDict([("w", d)])
    odict._metadata = {"": {"x": e}}  # type: ignore[attr-defined]
    arr = np.arange(3)
    state = {"model": {"a": a, "tied": a, "list": [b, (c,)]}, (1, "x"): f, 2**70: g, float("inf"): d,
             None: {"z": arr}, True: [1.5, b], 3: odict, "": e}
    tree, tensors, names, kinds = encode_state_named(state)
    assert len(tensors) == 8 and all(x is y for x, y in zip(tensors[:6] + tensors[7:], [a, b, c, f, g, d, e]))
    assert tensors[6].data_ptr() == arr.ctypes.data
    assert names == ["model/a", "model/list/0", "model/list/1/0", "{'$tuple': [1, 'x']}",
                     "{'$int': '0x400000000000000000'}", "{'$float': 'inf'}", "None/z", "<root>"]
    assert kinds == ["tensor"] * 6 + ["ndarray", "tensor"]
    assert encode_state_named(a)[2] == ["<root>"]
    assert encode_state_named(odict)[2] == ["w", ""]  # the manifest then says "<tensor 1>"
    assert encode_state(state)[0] == tree


# ----------------------------------------------------------------------------- freeze_state (save_async's copy)

def _rich_state() -> dict:
    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    model = collections.OrderedDict([("w", a), ("tied", a), ("b", b)])
    model._metadata = collections.OrderedDict([("", {"version": 1}), ("sub", {"version": 2})])  # type: ignore
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    return {"model": model,
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": c}, 1: {"momentum_buffer": None, "n": 2}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
            "extra": {"loader": {"epoch": 3, "order": [1, [2, {"x": b}]], "arr": arr, "strided": arr[:, 1],
                                 "np": np.float32(1.5), "dev": torch.device("cpu"), "dt": torch.bfloat16},
                      (1, "k"): [c, (a, 2**70, float("nan"))], "empty": {}, "none": []}}


def _encoded(state, arrays=None):
    tree, tensors, names, kinds = encode_state_named(state, arrays=arrays)
    return json.dumps(tree, sort_keys=False), tensors, names, kinds


def _freeze_and_check(state) -> None:
    frozen, tensors, arrays = freeze_state(state)
    want_tree, want_tensors, want_names, want_kinds = _encoded(state)
    got_tree, got_tensors, got_names, got_kinds = _encoded(frozen, arrays)
    assert got_tree == want_tree and got_names == want_names and got_kinds == want_kinds
    assert len(got_tensors) == len(want_tensors)
    for got, want, kind in zip(got_tensors, want_tensors, got_kinds):  # the same tensors (an array's: its memory)
        assert got is want if kind == "tensor" else torch.equal(got, want)
    assert {id(t) for t in got_tensors} <= {id(t) for t in tensors}


def test_a_frozen_state_encodes_as_the_state_did_whatever_happens_to_its_containers():
    state = _rich_state()
    _freeze_and_check(state)
    frozen, _, arrays = freeze_state(state)
    before = _encoded(frozen, arrays)[0]
    state["model"]["new"] = torch.ones(1)
    state["model"]._metadata["sub"]["version"] = 9
    state["optimizer"]["state"][0]["step"] = torch.tensor(9.0)
    state["optimizer"]["state"][1]["n"] = 7
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    state["extra"]["loader"]["order"][1][1]["x"] = None
    state["extra"]["loader"]["epoch"] += 1
    state["extra"]["empty"]["k"] = 1
    del state["extra"]["none"]
    assert _encoded(frozen, arrays)[0] == before


def test_a_strided_arrays_copy_is_taken_when_frozen():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    frozen, _, arrays = freeze_state({"col": arr[:, 1]})
    arr[:, 1] = -1
    _, tensors, _, _ = encode_state_named(frozen, arrays=arrays)
    assert tensors[0].tolist() == [1.0, 5.0, 9.0]


@JSON_SETTINGS
@given(_plain)
def test_frozen_plain_values_encode_the_same(obj):
    _freeze_and_check(obj)


@pytest.mark.parametrize("bad", [lambda: 0, {1, 2}, _Point(1), collections.defaultdict(list), object(), 1 + 2j,
                                 np.array([object()], dtype=object), torch.Generator(), np.datetime64(1, "s"),
                                 torch.nn.parameter.UninitializedParameter()], ids=repr)
def test_freeze_refuses_what_the_encoder_refuses(bad):
    for state in ({"a": [1, {"b": bad}]}, {0: {"x": bad}}, collections.OrderedDict(w=bad), (bad,)):
        with pytest.raises(Unfreezable):
            freeze_state(state)
        with pytest.raises(UnsupportedObjectError):
            encode_state(state)


def test_freeze_refuses_cycles_and_depth_as_the_encoder_does():
    a: list = [1]
    a.append(a)
    d: dict = {}
    d["self"] = {"x": d}
    for bad in (a, d):
        with pytest.raises(Unfreezable):
            freeze_state(bad)
    for wrap in (lambda x: [x], lambda x: {"k": x}, lambda x: {0: {"k": x}}):
        ok: object = 0
        while True:  # as deep as the encoder allows, then one level more
            deeper = wrap(ok)
            try:
                encode_state(deeper)
            except UnsupportedObjectError:
                break
            ok = deeper
        _freeze_and_check(ok)
        with pytest.raises(Unfreezable):
            freeze_state(deeper)


# ----------------------------------------------------------------------------- decoded once

def test_a_tree_decoded_over_placeholders_takes_the_real_tensors_in_place():
    """decode_state_slots + fill_slots (a load decodes its tree once: over placeholders to plan,
    then the tensors read go where the placeholders were) give what decode_state gives, in
    dicts, OrderedDicts (their metadata too) and lists; a tensor in a tuple, a numpy array or the
    tree itself cannot be replaced in place: no slots, and the caller decodes again."""
    real = [torch.full((2,), float(i)) for i in range(6)]
    od = collections.OrderedDict(w=real[3])
    od._metadata = {"v": [real[4]]}
    obj = {"model": {"a": real[0], "b": [real[1], 7, {"c": real[2]}]}, "od": od, "n": None, "z": [real[5]]}
    tree, tensors = encode_state(obj)
    tree = json.loads(json.dumps(tree))
    stand_ins = [torch.empty(0)] * len(tensors)
    skeleton, slots = decode_state_slots(tree, stand_ins)
    assert slots is not None and len(slots) == len(tensors)
    fill_slots(slots, tensors)
    assert same(skeleton, decode_state(tree, tensors))
    for other in ({"t": (real[0], 1)}, {"a": np.arange(3)}, real[0]):
        tree, tensors = encode_state(other)
        assert decode_state_slots(json.loads(json.dumps(tree)), [torch.empty(0)] * len(tensors))[1] is None
