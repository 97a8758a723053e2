"""The save call reuses the previous save's layout (snapshot.LayoutCache) only while it is the
layout a fresh computation would give: every change of a tensor's storage, offset, shape,
stride, dtype, key path or kind lays the state out anew, and a training loop lays it out once.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from support import models as M
from gdswriter import GDSCheckpointer, load_state
from gdswriter.save import snapshot as S


def base_state() -> dict:
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    big = torch.arange(100, dtype=torch.int16)
    a = np.arange(100, dtype=np.float64)
    return {"w": w, "tied": w, "row": w[2], "col": w[:, 3], "big": big, "tail": big[10:20],
            # two storages over one array: "nx"'s covers both views, so the pair is one extent of it
            "nx": torch.from_numpy(a)[:60], "ny": torch.from_numpy(a[50:]),
            "empty": torch.empty(0), "scalar": torch.tensor(5), "n": 3}


def _numpy_sharing(s: dict) -> dict:
    a = np.arange(64, dtype=np.float64)
    return {**s, "x": a[:5], "y": a[3:9], "bytes": a.view(np.uint8)[20:30]}  # no array covers the rest: raw memory


# Each changes one thing the layout depends on (or nothing), so that each part of the cache's key is needed.
CHANGES = {
    "nothing": lambda s: s,
    "a value that is not a tensor": lambda s: {**s, "n": 4},
    "new storage": lambda s: {**s, "w": s["w"].clone()},
    "untied": lambda s: {**s, "tied": s["w"].clone()},
    "storage size": lambda s: {**s, "nx": torch.from_numpy(s["nx"].numpy())},  # same address, 480 bytes not 800
    "offset": lambda s: {**s, "tail": s["big"][11:21]},
    "shape": lambda s: {**s, "tail": s["big"][10:19]},
    "stride": lambda s: {**s, "col": s["w"].as_strided((8,), (7,), 3)},
    "dtype": lambda s: {**s, "big": s["big"].view(torch.float16)},
    "kind": lambda s: {**s, "big": s["big"].numpy()},
    "key path": lambda s: {("W" if k == "w" else k): v for k, v in s.items()},
    "order": lambda s: dict(reversed(list(s.items()))),
    "added": lambda s: {**s, "more": torch.ones(3)},
    "removed": lambda s: {k: v for k, v in s.items() if k != "row"},
    "numpy sharing memory": _numpy_sharing,
    # resize_ moves the storage that "big" and "tail" share (new address and size), with or without new shapes
    "resized in place": lambda s: {**s, "big": s["big"].resize_(300)},
    "storage resized in place": lambda s: (s["big"].untyped_storage().resize_(400), s)[1],
    # same offset, shape, stride, dtype and storage size, in other memory: no longer shares "nx"'s extent
    "other memory": lambda s: {**s, "ny": torch.from_numpy(np.arange(100, dtype=np.float64)[50:])},
    # another storage object over the same memory: same addresses and sizes, so the layout holds
    "another storage at the same address": lambda s: {**s, "big": torch.from_numpy(s["big"].numpy())},
}


def layout(snap: S.Snapshot) -> tuple:
    """What a save writes: every extent's memory (or captured bytes) and every tensor record."""
    extents = [(e.device, e.nbytes, e.first_tensor, e.captured,
                e.flat.numpy().tobytes() if e.captured else e.flat.data_ptr()) for e in snap.extents]
    return extents, snap.records


FIRSTS = {
    "base": base_state,
    "numpy sharing memory": lambda: _numpy_sharing(base_state()),
    # no empty extent: the cache rebuilds the extents from its recipe's columns (LayoutCache._columns)
    "no empty tensor": lambda: {k: v for k, v in base_state().items() if k != "empty"},
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("first", FIRSTS)
def test_the_reused_layout_is_the_fresh_one(change, first):
    state = FIRSTS[first]()
    cache = S.LayoutCache()
    assert layout(S.take_snapshot(state, 1, layout=cache)) == layout(S.take_snapshot(state, 1))
    changed = CHANGES[change](state)
    assert layout(S.take_snapshot(changed, 2, layout=cache)) == layout(S.take_snapshot(changed, 2))
    again = S.take_snapshot(changed, 3, layout=cache)  # the cache now holds the changed layout (or nothing)
    assert layout(again) == layout(S.take_snapshot(changed, 3))


@pytest.mark.parametrize("change", ["nothing", "new storage", "offset", "shape", "dtype"])
def test_a_state_of_lone_tensors_reuses_its_layout_right(change):
    """The usual state (each tensor alone in its storage: extent i views tensor i's storage) is
    rebuilt from the cached columns, each extent over this save's own storages."""
    state = {f"t{i}": torch.arange(10 + i, dtype=torch.float32) for i in range(5)}
    changed = {
        "nothing": lambda s: s,
        "new storage": lambda s: {**s, "t1": s["t1"].clone()},
        "offset": lambda s: {**s, "t2": torch.arange(20, dtype=torch.float32)[1:13]},
        "shape": lambda s: {**s, "t3": s["t3"].reshape(1, -1)},
        "dtype": lambda s: {**s, "t4": s["t4"].view(torch.int32)},
    }[change](state)
    cache = S.LayoutCache()  # protected: guarded, so left live (not copied at the call)
    S.take_snapshot(state, 1, layout=cache, protected=list(state.values()))
    reused = S.take_snapshot(changed, 2, layout=cache, protected=list(changed.values()))
    assert layout(reused) == layout(S.take_snapshot(changed, 2, protected=list(changed.values())))
    assert [reused.extents[r.storage].flat.data_ptr() + r.byte_offset for r in reused.records] == \
        [t.data_ptr() for t in changed.values()]


def test_an_unchanged_state_is_laid_out_once(monkeypatch):
    calls = []
    real = S.group_by_allocation
    # Counting layouts through the snapshot's seam.
    monkeypatch.setattr(S, "group_by_allocation", lambda *a: calls.append(1) or real(*a))
    state, cache = base_state(), S.LayoutCache()
    S.take_snapshot({**state, "n": 0}, 0, layout=cache)
    # Twice per layout: the tensors no optimizer hook guards (here all) are grouped at the call, as
    # save_async does, and the whole state in the save thread (PendingSnapshot.complete)
    assert len(calls) == 2
    for step in range(1, 3):
        S.take_snapshot({**state, "n": step}, step, layout=cache)
    assert len(calls) == 2
    S.take_snapshot(CHANGES["untied"](state), 4, layout=cache)
    assert len(calls) == 4
    S.take_snapshot(_numpy_sharing(state), 5, layout=cache)  # raw memory is never cached
    S.take_snapshot(_numpy_sharing(state), 6, layout=cache)
    assert len(calls) == 8


def test_a_training_loop_lays_out_once_and_a_replaced_tensor_is_saved_right(tmp_path, monkeypatch):
    calls = []
    real = S.group_by_allocation
    # Counting layouts through the snapshot's seam.
    monkeypatch.setattr(S, "group_by_allocation", lambda *a: calls.append(1) or real(*a))
    model, opt, sched, _ = M.build(0, scaler=False)
    with GDSCheckpointer(model, opt, tmp_path, options=M.small_options()) as ck:
        M.train_steps(model, opt, sched, 1)
        for step in range(1, 4):
            ck.save_async(step)
            M.train_steps(model, opt, sched, 1)
            if step == 1:
                ck.wait()
                first = len(calls)  # the buffer no hook guards is grouped at the call, the state in the save thread
        ck.wait()
        assert first == 2 and len(calls) == first
        # Tie the head to the embedding, as language models do, then replace a parameter's
        # storage: both change which bytes the saved tensors are.
        model.head.weight = model.emb.weight
        model.ln_f.weight = nn.Parameter(torch.full_like(model.ln_f.weight, 7.0))
        ck.save_async(4).result(timeout=60)
        assert len(calls) == 4  # the new weight no optimizer holds joins the buffer at the call
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    _, state = load_state(tmp_path, step=4)
    for k, v in expected.items():
        assert torch.equal(state["model"][k], v), k
    assert state["model"]["head.weight"].untyped_storage().data_ptr() == \
        state["model"]["emb.weight"].untyped_storage().data_ptr()


def test_a_blocking_save_groups_and_copies_nothing_at_the_call(tmp_path, monkeypatch):
    """save() waits for the whole save, so its caller cannot change the tensors no optimizer
    guards before the save reads them: they are laid out once (in the save thread), not also
    grouped and copied at the call, and saved right, on every save."""
    calls = []
    real = S.group_by_allocation
    # Counting layouts through the snapshot's seam.
    monkeypatch.setattr(S, "group_by_allocation", lambda *a: calls.append(1) or real(*a))
    state = {f"b{i}": torch.full((1000 + i,), float(i)) for i in range(50)}  # small: save_async copies them at the call
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        ck.save(1)
        assert len(calls) == 1
        for t in state.values():
            t.add_(1.0)
        ck.save(2)
        assert len(calls) == 1  # the same layout: reused
    for step in (1, 2):
        got = load_state(tmp_path, step)[1]["model"]
        assert all(torch.equal(got[f"b{i}"], torch.full((1000 + i,), float(i + step - 1))) for i in range(50))


def test_a_blocking_save_keeps_no_tensor_of_the_state_alive(tmp_path):
    """What a blocking save remembers of the tensors it checked (to skip the checks on the same
    objects next time) does not keep them alive: a tensor the caller replaced is freed at once."""
    state = {f"b{i}": torch.full((1000 + i,), float(i)) for i in range(50)}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        ck.save(1)
        ck.wait()  # the save thread lets go of its job (the frozen state) just after save() returns
        gone = weakref.ref(state["b7"])
        state["b7"] = torch.zeros(3)
        gc.collect()
        assert gone() is None
        ck.save(2)
    assert torch.equal(load_state(tmp_path, 2)[1]["model"]["b7"], torch.zeros(3))


def test_storages_of_new_sizes_are_planned_anew(tmp_path):
    """The save plan is reused only for the same storage sizes, devices and files: a tensor
    replaced by one of another size (as many storages as before) gets a plan of its own."""
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(10, generator=g), "b": torch.randn(300_000, generator=g)}
    saved = {}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        for step, n in enumerate((10, 10, 5000, 3), 1):
            state["a"] = torch.randn(n, generator=g)
            ck.save(step)
            saved[step] = {k: v.clone() for k, v in state.items()}
    for step, want in saved.items():
        got = load_state(tmp_path, step=step)[1]["model"]
        assert all(torch.equal(got[k], v) for k, v in want.items()), step


# Each keeps the number of storages; the first two their sizes too, so the plan is the same object.
TABLE_CHANGES = {
    "values": lambda s: s["big"].add_(1.0),
    "new storage of the same size": lambda s: s.__setitem__("small", s["small"].clone() * 3),
    "dtype, same bytes": lambda s: setattr(s["w"], "data", s["w"].view(torch.int32)),
    "resized in place": lambda s: s["small"].resize_(17),
    "storage replaced": lambda s: s["w"].set_(torch.full((300,), 2.5)),
}


@pytest.mark.parametrize("change", TABLE_CHANGES)
@pytest.mark.parametrize("async_", [False, True], ids=["save", "save_async"])
def test_every_save_of_a_layout_writes_its_own_checksums(tmp_path, change, async_):
    """The manifest's storage table is a template per layout (save/writer.py _StorageLayout):
    every save fills in its own chunks' crc32c, in the table's order (a storage larger than a
    pool piece is cut into several chunks), and a change of the layout makes a new one. A
    checksum of an earlier save, or one in another chunk's place, fails the load."""
    g = torch.Generator().manual_seed(5)
    # "big" (8 MiB) spans several pool pieces of the small ring: one storage, several chunks
    state = {"big": torch.randn(2 << 20, generator=g), "small": torch.randn(40, generator=g),
             "w": torch.randn(300, generator=g), **{f"t{i}": torch.randn(100 + i, generator=g) for i in range(8)}}
    saved = {}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options(snapshot_pool_bytes=4 << 20)) as ck:
        for step in range(1, 5):
            if step == 3:
                TABLE_CHANGES[change](state)
            else:
                state["t0"].add_(step)
                state["big"][::4099].mul_(-1.5)
            ck.save_async(step).result(timeout=120) if async_ else ck.save(step)
            saved[step] = {k: v.clone() for k, v in state.items()}
    for step, want in saved.items():
        got = load_state(tmp_path, step=step)[1]["model"]
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), (step, k)


def test_a_reused_layout_makes_its_extents_only_when_asked():
    """A training loop's snapshot of the same layout makes no extent object (the host pool's
    reused layout and the plan read only their sizes and devices), nor does a first one of lone
    tensors: the sizes, devices and host addresses it gives without them are those of the
    extents it makes when asked, which view this save's storages."""
    state = {f"t{i}": torch.arange(10 + i, dtype=torch.float32) for i in range(12)}
    state["t3"] = torch.arange(40, dtype=torch.float32)[9:]  # alone in its storage, 36 bytes in
    cache = S.LayoutCache()
    first = S.take_snapshot(state, 1, layout=cache, protected=list(state.values()))
    # a first layout of lone tensors is columns too: the pool copies from their host addresses
    assert isinstance(first.extents, S.LazyExtents) and first.extents.made is None
    hosts, sizes = first.host_addresses(), first.extent_sizes()
    assert hosts == S.host_addresses(list(first.extents)) and sizes == [e.nbytes for e in first.extents]
    assert hosts[3] == state["t3"].data_ptr() - 4  # its extent starts at the 16-byte boundary below
    state = {k: v.add_(1.0) for k, v in state.items()}  # new values and a new dict: the layout holds
    snap = S.take_snapshot(state, 2, layout=cache, protected=list(state.values()))
    assert isinstance(snap.extents, S.LazyExtents) and snap.extents.made is None
    sizes, devices, nbytes = snap.extent_sizes(), snap.extent_devices(), snap.nbytes
    assert snap.extents.made is None
    made = list(snap.extents)
    assert made is not None and snap.extents.made is not None and len(snap.extents) == 12
    assert sizes == [e.nbytes for e in made] and devices == [e.device for e in made] and nbytes == sum(sizes)
    assert [made[r.storage].flat.data_ptr() + r.byte_offset for r in snap.records] == \
        [t.data_ptr() for t in state.values()]
    assert snap.extents[4] is made[4]  # made once: a change to an extent (a capture) stays
    assert layout(snap) == layout(S.take_snapshot(state, 2, protected=list(state.values())))


def test_a_blocking_save_resolves_a_conj_bit_given_to_a_tensor_it_saved_before(tmp_path):
    """A blocking save skips the checks of the tensors it found plain at its last call (the same
    objects: their type and layout cannot change), but not the look for lazy conj and neg bits,
    which ``.data =`` can give the same object: the saved values are the resolved ones."""
    state = {f"z{i}": torch.full((20 + i,), complex(i, 1.0), dtype=torch.complex64) for i in range(12)}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        ck.save(1)
        z = state["z5"]
        z.data = torch.full((25,), complex(2.0, 3.0), dtype=torch.complex64).conj()
        assert z.is_conj()
        m = state["z7"]
        m.data = torch.full((27,), 4.0 + 0j, dtype=torch.complex64).imag.neg()._neg_view()
        ck.save(2)
    got = load_state(tmp_path, 2)[1]["model"]
    assert torch.equal(got["z5"], torch.full((25,), complex(2.0, -3.0), dtype=torch.complex64))
    assert torch.equal(got["z7"], m.resolve_neg())
    assert torch.equal(got["z0"], torch.full((20,), complex(0, 1.0), dtype=torch.complex64))


def _lone() -> dict:
    """Lone tensors (each alone in its storage, one device: the layout _each_alone makes), the
    last two from numpy over one array, side by side."""
    a = np.arange(40, dtype=np.float32)
    state = {f"t{i}": torch.arange(12 + i, dtype=torch.float32) for i in range(6)}
    return {**state, "na": torch.from_numpy(a[:16]), "nb": torch.from_numpy(a[16:40]),
            "row": torch.arange(10, dtype=torch.float32).reshape(1, 10)}


def _offset_only(s: dict) -> dict:
    # "nb" keeps its first byte, dtype, shape and stride, 8 items into a storage that starts 8
    # items earlier (inside "na"'s bytes): only its offset (and its storage's address) changed
    earlier = np.frombuffer((ctypes.c_float * 32).from_address(s["nb"].data_ptr() - 32), dtype=np.float32)
    first = s["nb"].data_ptr()
    s["nb"].set_(torch.from_numpy(earlier).untyped_storage(), 8, (24,), (1,))
    assert s["nb"].data_ptr() == first and s["nb"].storage_offset() == 8
    return s


def _realloc_same_size(s: dict) -> dict:
    st = s["t1"].untyped_storage()
    n = st.nbytes()
    st.resize_(0)  # the memory freed, then the same size again: often at the same address
    st.resize_(n)
    return s


def _storage_grown_over_a_neighbour(s: dict) -> dict:
    # "na" keeps its first byte, offset, shape and stride, over a storage that now also covers
    # "nb"'s bytes: the storages overlap, the tensors' bytes do not (a fresh layout takes the
    # general path, which gives one extent per tensor all the same)
    wider = torch.from_numpy(np.frombuffer((ctypes.c_float * 40).from_address(s["na"].data_ptr()), dtype=np.float32))
    s["na"].set_(wider.untyped_storage(), 0, (16,), (1,))  # (the memory "nb" keeps alive)
    assert s["na"].untyped_storage().nbytes() == 160
    return s


def _swap(s: dict) -> dict:
    torch.utils.swap_tensors(s["t2"], s["t4"])
    return s


# In-place changes of the same tensor objects (save_async's state between two saves), each of
# what a layout of lone tensors is a function of: (the layout reused?)
IN_PLACE = {
    "nothing": (lambda s: s, True),
    "values": (lambda s: (s["t0"].add_(1.0), s)[1], True),
    "resize_ larger (new memory)": (lambda s: (s["t1"].resize_(40), s)[1], False),
    "resize_ smaller (same memory)": (lambda s: (s["t1"].resize_(5), s)[1], False),
    "set_ another storage": (lambda s: (s["t2"].set_(torch.zeros(14)), s)[1], False),
    "set_ an offset": (lambda s: (s["t3"].set_(s["t3"].untyped_storage(), 1, (10,), (1,)), s)[1], False),
    "unsqueeze_": (lambda s: (s["t4"].unsqueeze_(0), s)[1], False),
    "as_strided_ (a stride of a size-1 dim)": (lambda s: (s["t4"].unsqueeze_(0).as_strided_((1, 16), (1, 1)), s)[1],
                                               False),
    "as_strided_ (only a size-1 dim's stride)": (lambda s: (s["row"].as_strided_((1, 10), (1, 1)), s)[1], False),
    "set_ (only the offset)": (_offset_only, False),
    ".data = a view as another dtype (only the dtype)": (lambda s: setattr(s["t0"], "data", s["t0"].data.view(
        torch.int32)) or s, False),
    ".data = another dtype": (lambda s: setattr(s["t5"], "data", torch.zeros(17, dtype=torch.float64)) or s, False),
    ".data = a neg view": (lambda s: setattr(s["t5"], "data", torch.zeros(17, dtype=torch.complex64).conj().imag)
                           or s, False),
    "share_memory_ (the storage's memory moved)": (lambda s: (s["t0"].share_memory_(), s)[1], False),
    "storage freed and made again, same size": (_realloc_same_size, None),
    "swap_tensors": (_swap, False),
    "a storage grown over its neighbour's bytes": (_storage_grown_over_a_neighbour, True),
}


@pytest.mark.parametrize("change", IN_PLACE)
def test_lone_tensors_changed_in_place_are_laid_out_anew_where_it_matters(change, monkeypatch):
    """The cache of a layout of lone tensors checks first-byte addresses, offsets, dtypes, shapes,
    strides and devices, no storage (LayoutCache.reuse_alone): every in-place change of one of
    those (resize_, set_, .data =, in-place views, storage moved, tensors swapped) lays the state
    out anew, and what it reuses is what a fresh layout gives, storage sizes included."""
    calls = []
    real = S.group_by_allocation
    monkeypatch.setattr(S, "group_by_allocation", lambda *a: calls.append(1) or real(*a))
    state = _lone()
    cache = S.LayoutCache()
    S.take_snapshot(state, 1, layout=cache, protected=list(state.values()))
    assert len(calls) == 1
    how, reused = IN_PLACE[change]
    changed = how(state)
    snap = S.take_snapshot(changed, 2, layout=cache, protected=list(changed.values()))
    fresh = S.take_snapshot(changed, 2, protected=list(changed.values()))
    # (a neg view is resolved into a copy of its own by each snapshot: compared by its bytes)
    assert [(e.device, e.nbytes, e.first_tensor, e.flat.numpy().tobytes()) for e in snap.extents] == \
        [(e.device, e.nbytes, e.first_tensor, e.flat.numpy().tobytes()) for e in fresh.extents]
    assert snap.records == fresh.records
    assert [snap.extents[r.storage].flat.data_ptr() + r.byte_offset for r, t in zip(snap.records, changed.values())
            if not t.is_neg()] == [t.data_ptr() for t in changed.values() if not t.is_neg()]
    if reused is not None:
        assert (len(calls) == 2) is reused, calls  # the fresh one above is one layout more


def test_disjoint_views_of_one_storage_are_laid_out_as_the_general_path_does(tmp_path):
    """Tensors that view one storage without sharing a byte (a flat buffer cut into parameters,
    one of them starting off a 16-byte boundary) take the lone tensors' layout (one extent per
    tensor, over its own byte range, LayoutCache.columns_of: no storage object); it is the
    layout the general path gives them (forced here by an empty tensor beside them), and a
    view overlapping another still shares its extent. Saved and loaded bit-exact."""
    flat = torch.arange(64, dtype=torch.float32)
    state = {"a": flat[0:5], "b": flat[5:13], "c": flat[13:40].view(3, 9), "d": flat[40:41]}
    cache = S.LayoutCache()
    lone = S.take_snapshot(state, 1, layout=cache, protected=list(state.values()))
    general = S.take_snapshot({**state, "z": torch.empty(0)}, 1, protected=list(state.values()))
    assert type(lone.extents) is S.LazyExtents  # the lone tensors' layout
    assert type(general.extents) is not S.LazyExtents
    assert layout(lone)[0] == layout(general)[0][:4]
    assert list(lone.records) == list(general.records)[:4]
    again = S.take_snapshot(state, 2, layout=cache, protected=list(state.values()))  # reused: the same
    assert layout(again) == layout(lone)
    shared = S.take_snapshot({**state, "e": flat[10:20]}, 1, protected=list(state.values()))
    assert shared.records[1].storage == shared.records[4].storage  # b and e overlap: one extent
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        ck.save(3)
    got = load_state(tmp_path, 3)[1]["model"]
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("bits", ["conj", "conj beside reals", "neg", "both"])
def test_a_blocking_save_resolves_lazy_conj_and_neg_bits(tmp_path, bits):
    """save() checks the tensors at the call in C-level passes (the conj bit asked only where a
    dtype is complex, quantized once per dtype): a lazy conj or neg bit is still found and
    resolved, so the bytes saved are the values the tensor shows."""
    z = torch.full((8,), complex(1.0, 2.0), dtype=torch.complex64)
    state = {"conj": {"zc": z.conj()}, "neg": {"zn": z.conj().imag}, "both": {"zc": z.conj(), "zn": z.conj().imag},
             "conj beside reals": {"w": torch.ones(4), "zc": z.conj(), "d": torch.arange(3, dtype=torch.float64)}}[bits]
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        ck.save(1)
        ck.save(2)  # the tensors found plain last time are not looked at again: the same objects
    for step in (1, 2):
        got = load_state(tmp_path, step)[1]["model"]
        assert all(torch.equal(got[k], v.resolve_conj().resolve_neg()) for k, v in state.items())
