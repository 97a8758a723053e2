"""Small storages read in runs are made in their tensor's dtype (one torch.frombuffer per tensor,
load/reader.py ``_kinds``): every dtype, shape and view still loads bit-exact, each lone
tensor's storage is exactly its bytes, two tensors viewing one storage stay two views of
one storage, and a flipped byte in a typed run is still the named tensor's checksum error."""

from __future__ import annotations

import pytest
import torch

from gdswriter import GDSCheckpointer, load_state
from gdswriter.errors import ChecksumMismatchError

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn)


def mixed_state() -> dict:
    """Small tensors of many dtypes and sizes (odd byte counts included), 2-D ones, a
    transposed lone view, a slice alone on a larger storage, two whole views of one storage (and one of them again), two views of one
    base, and a float32 view of a uint8 storage whose length is no whole number of floats."""
    g = torch.Generator().manual_seed(11)
    small = {}
    for i in range(600):
        dt, n = DTYPES[i % len(DTYPES)], 1 + (i * 7) % 53
        raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dt).element_size(),), dtype=torch.uint8, generator=g)
        t = raw.view(dt) if dt not in (torch.bool,) else raw % 2 == 1
        small[f"t{i}"] = t.reshape(n, 1) if i % 5 == 0 else t
    base = torch.randn(30, generator=g)
    tied = torch.randn(40, generator=g)
    odd = torch.arange(10, dtype=torch.uint8)
    return {"small": small, "mat_t": torch.randn(6, 5, generator=g).t(), "slice": torch.randn(100, generator=g)[10:20],
            "tied_a": tied, "tied_b": tied[:], "tied_c": tied, "head": base[:10], "tail": base[10:], "odd": odd[:8].view(torch.float32)}


def check_loaded(got: dict, want: dict) -> None:
    """Bit-exact, same dtype and shape; lone tensors of whole storages own exactly their bytes."""
    for k, t in want["small"].items():
        x = got["small"][k]
        assert x.dtype == t.dtype and x.shape == t.shape, k
        assert torch.equal(x.view(torch.uint8) if t.dtype != torch.bool else x, t.view(torch.uint8)
                           if t.dtype != torch.bool else t), k
        assert x.storage_offset() == 0 and x.untyped_storage().nbytes() == t.nbytes, k
    for k in ("mat_t", "slice", "tied_a", "tied_b", "tied_c", "head", "tail", "odd"):
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) if k == "odd" else \
            torch.equal(got[k], want[k]), k
    assert got["tied_a"] is not got["tied_b"] and got["tied_a"].data_ptr() == got["tied_b"].data_ptr()
    assert got["tied_c"] is got["tied_a"]  # one object saved twice: one tensor, as before


def test_runs_of_many_dtypes_load_bit_exact_as_storages_of_their_own(tmp_path):
    state = mixed_state()
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
    got = load_state(tmp_path, 1)[1]["model"]
    check_loaded(got, state)
    torch.save(got["small"], tmp_path / "again.pt")  # a tensor's whole storage: exactly its bytes
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert all(torch.equal(again[k].view(torch.uint8), got["small"][k].view(torch.uint8))
               for k in got["small"] if got["small"][k].dtype != torch.bool)


@pytest.mark.parametrize("atomic", [True, False])
def test_a_live_load_of_many_dtypes_restores_every_tensor(tmp_path, atomic):
    want = mixed_state()
    live = mixed_state()
    for t in live["small"].values():
        t.zero_()
    with GDSCheckpointer(want, None, tmp_path) as ck:
        ck.save(1)
    with GDSCheckpointer(live, None, tmp_path) as ck:
        ck.load(1, atomic=atomic)
    for k, t in want["small"].items():
        assert torch.equal(live["small"][k].view(torch.uint8) if t.dtype != torch.bool else live["small"][k],
                           t.view(torch.uint8) if t.dtype != torch.bool else t), k


def test_a_flipped_byte_in_a_typed_run_names_its_tensor(tmp_path):
    state = {"w": {f"p{i}": torch.full((300,), float(i), dtype=torch.float64) for i in range(400)}}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        data = sorted(ck.protocol.step_dir(1).glob("data-*.bin"))[0]
    raw = bytearray(data.read_bytes())
    at = 2432 * 200 + 100  # inside p200 (2,400 bytes each, 64-byte aligned: 2,432 apart)
    raw[at] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="w/p200"):
        load_state(tmp_path, 1)


def test_two_views_of_one_storage_in_a_run_stay_two_tensors_of_one_storage(tmp_path):
    """A storage two tensors view is read as bytes (not made in either's dtype) and each gets
    a view of its own: one tensor object for both would tie two names a model keeps apart."""
    shared = torch.arange(100, dtype=torch.float32)
    w = {f"t{i}": torch.full((100,), float(i)) for i in range(100)}
    state = {"w": {**{k: w[k] for k in list(w)[:50]}, "a": shared, "b": shared[:], **{k: w[k] for k in list(w)[50:]}}}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
    got = load_state(tmp_path, 1)[1]["model"]["w"]
    assert got["a"] is not got["b"] and got["a"].data_ptr() == got["b"].data_ptr()
    assert torch.equal(got["a"], shared) and torch.equal(got["b"], shared)
    assert all(torch.equal(got[k], v) and got[k].untyped_storage().nbytes() == 400 for k, v in w.items())


def test_some_tensors_read_alone_are_their_bytes_in_their_dtypes(tmp_path):
    """read_tensors of some indices (an export's or DeepSpeed's partial read: the views built
    from records, over buffers made in their tensors' dtypes) gives each its own bytes."""
    from gdswriter.format.commit import CommitProtocol
    from gdswriter.load.reader import read_manifest, read_tensors

    state = mixed_state()
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
    protocol = CommitProtocol([tmp_path])
    manifest = read_manifest(protocol, 1)
    names = manifest.tensor_names()
    wanted = [i for i, name in enumerate(names) if name.startswith("model/small/")][::7]
    got = read_tensors(protocol, manifest, wanted)
    for i in wanted:
        want = state["small"][names[i].rsplit("/", 1)[1]]
        t = got[i]
        assert t.dtype == want.dtype and t.shape == want.shape, names[i]
        assert torch.equal(t, want) if want.dtype == torch.bool else torch.equal(t.view(torch.uint8),
                                                                                 want.view(torch.uint8)), names[i]
    assert sum(t is not None for t in got) == len(wanted)
