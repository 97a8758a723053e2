"""A state of 10,000 tensors saves and loads bit-exact, first save and later ones, through the
batched paths (one extent per lone tensor laid out in C-level passes, the layout reused across
saves, files read whole into one buffer and checked chunk by chunk), and a changed layout
between saves is never served from the reused one."""

from __future__ import annotations

import json
import warnings

import crc32c
import pytest
import torch

from gdswriter import GDSCheckpointer, load_state
from gdswriter.errors import ChecksumMismatchError, CorruptCheckpointError, UnsupportedObjectError
from gdswriter.format.manifest import ChunkRecord, FileRecord, Manifest, StorageRecord, TensorRecord
from gdswriter.format.state_codec import encode_state_named
from gdswriter.save import snapshot as S

MiB = 1 << 20
N_TINY = 9_989


def many_state(contiguous: bool) -> dict:
    """10,000 tensors: tiny ones of several dtypes (each alone in memory), two above the
    small-copy thresholds (>= 2 MiB), views of one base, a tied pair, a scalar and, unless
    ``contiguous`` (where every tensor is non-empty and contiguous, as the lone-tensor path
    takes them), non-contiguous views and an empty tensor."""
    g = torch.Generator().manual_seed(7)
    dtypes = (torch.float32, torch.float16, torch.int64, torch.uint8, torch.bfloat16, torch.complex64)
    tiny = {}
    for i in range(N_TINY):
        dt = dtypes[i % len(dtypes)]
        n = 1 + i % 37
        t = torch.randint(0, 100, (n,), generator=g).to(dt) if not dt.is_complex else torch.randn(n, generator=g,
                                                                                                 dtype=dt)
        tiny.setdefault(f"block{i // 100}", {})[f"t{i % 100}"] = t
    big = torch.randn(3 * MiB // 4, generator=g)  # 3 MiB
    big2 = torch.randn(1024, 640, generator=g)  # 2.5 MiB
    base = torch.randn(64, 48, generator=g)
    state = {"tiny": tiny, "big": big, "big_tail": big[-1000:], "big2": big2, "big2_t": big2.t(),
             "base": base, "row": base[3], "col": base[:, 5], "every_other": base[::2, 1::3], "tied": base,
             "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    if contiguous:
        for k in ("big2_t", "col", "every_other", "empty"):
            del state[k]
        state.update({"rows": base[5:9], "big2_head": big2[:10], "x": torch.ones(3), "y": torch.ones(2)})
    return state


def flat_tensors(tree) -> dict:
    out = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
    walk(tree, "")
    return out


def snapshot_of(state) -> dict:
    """Copies of every tensor, with their strides."""
    return {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).copy_(v) for k, v in flat_tensors(state).items()}


def assert_bit_exact(loaded, want: dict) -> None:
    got = flat_tensors(loaded)
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), k
        assert torch.equal(g.contiguous().reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "mixed"])
def test_ten_thousand_tensors_round_trip_first_and_second_save(tmp_path, contiguous):
    state = many_state(contiguous)
    assert len(flat_tensors(state)) == 10_000
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        want1 = snapshot_of(state)
        with torch.no_grad():  # new values, same layout: the second save reuses the first one's
            for t in flat_tensors(state).values():
                if t.numel() and not t.dtype.is_complex:
                    t.add_(1)
        ck.save(2)
        want2 = snapshot_of(state)
    for step, want in ((1, want1), (2, want2)):
        _, loaded = load_state(tmp_path, step)
        m = loaded["model"]
        assert_bit_exact(m, want)
        # sharing comes back: the views, the tie and the tail view their bases' memory
        assert m["tied"].data_ptr() == m["base"].data_ptr()
        assert m["row"].untyped_storage().data_ptr() == m["base"].untyped_storage().data_ptr()
        assert m["big_tail"].untyped_storage().data_ptr() == m["big"].untyped_storage().data_ptr()
        other = "big2_head" if contiguous else "big2_t"
        assert m[other].untyped_storage().data_ptr() == m["big2"].untyped_storage().data_ptr()


def flip_a_byte_mid_file(step_dir) -> None:
    """Flip one byte in the middle of the step's first data file, inside a tensor's bytes (each
    starts 4 KiB-aligned)."""
    data = sorted(step_dir.glob("data-*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 // 4096 * 4096 + 100] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_a_damaged_byte_among_many_tensors_is_found(tmp_path):
    """A file read whole is still checked chunk by chunk: one flipped byte is the tensor's."""
    state = {"tiny": {f"t{i}": torch.full((1020,), float(i)) for i in range(2000)}}  # 4080 B: little padding
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        step_dir = ck.protocol.step_dir(1)
    flip_a_byte_mid_file(step_dir)
    try:
        load_state(tmp_path, 1)
    except ChecksumMismatchError as e:
        assert "tiny/t" in str(e)
    else:
        raise AssertionError("a flipped byte was not found")


def test_changed_layout_between_saves_is_laid_out_anew(tmp_path):
    """A tensor added, one reshaped and one given new memory between two saves of 10,000
    tensors: the second save's records and bytes are the new layout's, never the reused one's."""
    state = {f"t{i}": torch.full((8,), float(i)) for i in range(10_000)}
    layout = S.LayoutCache()
    first = S.take_snapshot(state, 1, layout=layout)
    assert len(first.records) == 10_000 and len(first.extents) == 10_000
    changed = dict(state)
    changed["added"] = torch.arange(5.0)
    changed["t3"] = state["t3"].view(2, 4)  # same memory, another shape
    changed["t7"] = torch.full((8,), 70.0)  # another storage
    changed["t9"] = state["t8"].view(8)  # now a view of t8: one extent for both
    second = S.take_snapshot(changed, 2, layout=layout)
    recs = {r.name: r for r in second.records}
    assert len(second.records) == 10_001 and len(second.extents) == 10_000
    assert recs["t3"].shape == (2, 4) and recs["t3"].stride == (4, 1)
    assert recs["t9"].storage == recs["t8"].storage
    for name in ("t7", "added", "t3"):
        r = recs[name]
        flat = second.extents[r.storage].flat
        want = changed[name].contiguous().view(torch.uint8).flatten()
        assert torch.equal(flat[r.byte_offset:r.byte_offset + want.numel()], want), name
    # and through a checkpointer, saved and loaded
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        state["added"] = torch.arange(5.0)
        state["t3"] = state["t3"].view(2, 4)
        state["t7"] = torch.full((8,), 70.0)
        state["t9"] = state["t8"].view(8)
        ck.save(2)
    _, loaded = load_state(tmp_path, 2)
    loaded = loaded["model"]
    assert set(loaded) == set(state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v) and loaded[k].shape == v.shape, k
    assert loaded["t9"].data_ptr() == loaded["t8"].data_ptr()


def test_each_loaded_storage_starts_at_its_own_first_byte(tmp_path):
    """Small storages read together in one span still load as storages of their own: code
    that reads a tensor's storage from its start (torch.set_rng_state) gets its own bytes."""
    torch.manual_seed(3)
    want = torch.get_rng_state()
    state = {"small": {f"t{i}": torch.full((100,), float(i)) for i in range(64)}, "rng": want.clone()}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
    _, loaded = load_state(tmp_path, 1)
    loaded = loaded["model"]
    assert all(t.storage_offset() == 0 for t in [loaded["rng"], *loaded["small"].values()])
    torch.set_rng_state(loaded["rng"])
    assert torch.equal(torch.get_rng_state(), want)
    assert all(torch.equal(t, torch.full((100,), float(i))) for i, t in enumerate(loaded["small"].values()))


def test_small_storages_far_apart_load_as_their_own_and_are_checked(tmp_path):
    """Storages of 2.7 KB laid out 4 KiB apart (too sparse to share one buffer with the gaps)
    are read in runs through a scratch buffer and packed: each loads its own bytes, as a
    storage of its own of exactly its size, and a flipped byte among them is found."""
    state = {"g": {f"t{i}": torch.full((675,), float(i)) for i in range(3000)}}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        step_dir = ck.protocol.step_dir(1)
    _, loaded = load_state(tmp_path, 1)
    got = loaded["model"]["g"]
    for i in range(3000):
        t = got[f"t{i}"]
        assert torch.equal(t, state["g"][f"t{i}"]), i
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == 2700, i
    flip_a_byte_mid_file(step_dir)
    try:
        load_state(tmp_path, 1)
    except ChecksumMismatchError as e:
        assert "g/t" in str(e)
    else:
        raise AssertionError("a flipped byte among sparse storages was not found")


def many_manifest() -> Manifest:
    """A manifest of 3,000 storages and 3,004 tensors, as a save of many tensors writes it
    (one chunk per storage), with what the per-record checks are also there for: a storage cut
    into two chunks listed out of order, a non-contiguous view, an empty tensor, a scalar."""
    storages, tensors, at = [], [], 0
    for i in range(3_000):
        n = 64 if i != 9 else 8192
        if i == 9:  # cut where a pool piece ended: two chunks, the second listed first
            chunks = (ChunkRecord(0, at + 4096, 4096, 4096, 11), ChunkRecord(0, at, 0, 4096, 10))
        else:
            chunks = (ChunkRecord(0, at, 0, n, i),)
        storages.append(StorageRecord(n, chunks))
        tensors.append(TensorRecord(f"g{i // 100}/t{i % 100}", i, 0, "float32", (4, n // 16), (n // 16, 1)))
        at += n
    tensors += [TensorRecord("view_t", 3, 0, "float32", (4, 4), (1, 4)),
                TensorRecord("empty", 4, 64, "float32", (0, 3), (3, 1)),
                TensorRecord("scalar", 5, 8, "int64", (), ()),
                TensorRecord("tail", 9, 4096, "float16", (2048,), (1,))]
    return Manifest(step=3, files=(FileRecord(0, "data-r0-f0.bin", at),), storages=tuple(storages),
                    tensors=tuple(tensors), state={"$list": [{"$tensor": i} for i in range(len(tensors))]},
                    version=(1, 1))  # the rows of 1.x and their bulk checks (2.0: test_manifest_columns.py)


def with_checksum(body: dict) -> bytes:
    """``body`` as a manifest file whose checksum matches it (what damage that kept the checksum right looks like)."""
    body.pop("manifest_crc32c", None)
    body["manifest_crc32c"] = crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(body, separators=(",", ":")).encode()


def test_a_manifest_of_many_records_parses_back_to_the_same_records():
    """The usual tables are checked as a whole (a state of many tensors: one chunk per
    storage); what they hold comes back exactly, the unusual records among them included."""
    m = many_manifest()
    got = Manifest.from_json_bytes(m.to_json_bytes())
    assert got.storages == m.storages[:9] + (StorageRecord(8192, m.storages[9].chunks[::-1]),) + m.storages[10:]
    assert got.tensors == m.tensors and got.files == m.files


SIZE = 3_000 * 64 + 8192 - 64
DAMAGE = {  # (table, record, field): value; every one refused as the per-record checks refuse it
    "chunk past its file's end": (("storages", 5, 1), SIZE - 32),
    "crc32c out of range": (("storages", 5, 4), 1 << 32),
    "file index out of range": (("storages", 5, 0), 1),
    "chunk offset a bool": (("storages", 5, 3), True),
    "chunk offset a float": (("storages", 5, 1), 320.0),
    "negative file offset": (("storages", 5, 1), -64),
    "offset past int64": (("storages", 5, 1), 1 << 63),
    "gap at a storage's start": (("storages", 5, 2), 8),
    "chunks overlapping in the file": (("storages", 6, 1), 5 * 64),
    "cut storage with a gap": (("storages", 9, (0, 2)), 4100),
    "storage index out of range": (("tensors", 7, "storage"), 3_000),
    "storage index a bool": (("tensors", 7, "storage"), True),
    "view past its storage": (("tensors", 7, "shape"), [4, 5]),
    "negative stride": (("tensors", 7, "stride"), [-4, 1]),
    "shape of floats": (("tensors", 7, "shape"), [4.0, 4.0]),
    "misaligned offset": (("tensors", 7, "byte_offset"), 2),
    "quantized dtype": (("tensors", 7, "dtype"), "qint8"),
    "unknown kind": (("tensors", 7, "kind"), "pickle"),
    "name not a string": (("tensors", 7, "name"), 7),
    "expanded view too large": (("tensors", 7, "stride"), [0, 0]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_manifest_of_many_records_refuses_each_damage(damage):
    """One damaged record among thousands, its checksum made to match: a typed error, as a
    record checked alone gets, before anything is allocated for the tensors."""
    (table, index, field), value = DAMAGE[damage]
    body = json.loads(many_manifest().to_json_bytes())
    record = body[table][index]
    if table == "storages":
        chunk, field = (0, field) if isinstance(field, int) else field
        record["chunks"][chunk][field] = value
    else:
        record[field] = value
        if damage == "expanded view too large":
            record["shape"] = [1 << 40, 1 << 40]
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json_bytes(with_checksum(body))


def test_every_loaded_tensor_is_a_storage_of_its_own_bytes(tmp_path):
    """Whatever path reads it (a run of small storages, an aligned buffer of 1-4 MiB, a mapped
    one above), a loaded tensor's storage holds its bytes alone, from its first: torch.save and
    an export write a tensor's whole storage (a larger one made `gdswriter export --to torch`
    write records torch.load refuses), and torch.set_rng_state reads from the storage's start."""
    sizes = [700, 5000, 300_000, (1 << 20) + 123, 3 << 20, (6 << 20) + 1]
    state = {f"t{i}": torch.arange(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    state["small"] = {f"s{i}": torch.full((2000,), float(i)) for i in range(50)}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
    got = load_state(tmp_path, 1)[1]["model"]
    loaded = [got[f"t{i}"] for i in range(len(sizes))] + list(got["small"].values())
    wanted = [state[f"t{i}"] for i in range(len(sizes))] + list(state["small"].values())
    for t, want in zip(loaded, wanted):
        assert torch.equal(t, want)
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == want.nbytes, (want.nbytes, t.untyped_storage().nbytes())
    torch.save(got, tmp_path / "again.pt")
    assert torch.equal(torch.load(tmp_path / "again.pt", weights_only=True)[f"t{len(sizes) - 2}"], state[f"t{len(sizes) - 2}"])


def test_a_damaged_byte_in_a_run_of_small_tensors_fails_the_load_and_leaves_the_live_state(tmp_path):
    """GDSCheckpointer.load reads small storages that lie together as one span (the engine sums
    none of it: ReadSpan.checksum False) and checks each chunk's crc32c itself: one flipped byte
    is the tensor's ChecksumMismatchError, and no live tensor changed."""
    state = {"tiny": {f"t{i}": torch.full((1020,), float(i)) for i in range(2000)}}  # 4080 B: dense runs
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        flip_a_byte_mid_file(ck.protocol.step_dir(1))
        for t in state["tiny"].values():
            t.fill_(-1.0)
        with pytest.raises(ChecksumMismatchError, match="tiny/t"):
            ck.load(1)
    assert all(bool((t == -1.0).all()) for t in state["tiny"].values())


def test_small_storages_of_uneven_sizes_far_apart_load_as_their_own_and_a_damaged_one_changes_nothing(tmp_path):
    """Storages of 1.2-3.6 KB laid out 4 KiB apart: sparse runs whose chunks are not evenly
    spaced (each copied out of the scratch buffer on its own, not in one strided copy). Each
    loads its own bytes as a storage of exactly its size; one flipped byte among them is the
    tensor's ChecksumMismatchError and leaves every live tensor as it was."""
    sizes = [300 + (i * 37) % 600 for i in range(3000)]
    state = {"g": {f"t{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        got = load_state(tmp_path, 1)[1]["model"]["g"]
        for i, n in enumerate(sizes):
            t = got[f"t{i}"]
            assert torch.equal(t, state["g"][f"t{i}"]), i
            assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == 4 * n, i
        flip_a_byte_mid_file(ck.protocol.step_dir(1))
        for t in state["g"].values():
            t.fill_(-1.0)
        with pytest.raises(ChecksumMismatchError, match="g/t"):
            ck.load(1)
    assert all(bool((t == -1.0).all()) for t in state["g"].values())


def test_a_damaged_byte_in_the_last_part_of_a_large_file_of_small_tensors_is_found(tmp_path):
    """A file of small tensors larger than one read call (reader.PIPELINE_BYTES, 32 MiB) is read
    in parts while earlier parts are summed: a flipped byte past the first part is still found,
    and every tensor loaded intact before."""
    state = {"tiny": {f"t{i}": torch.full((1020,), float(i)) for i in range(10_000)}}  # 40 MiB of runs
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
        step_dir = ck.protocol.step_dir(1)
    got = load_state(tmp_path, 1)[1]["model"]["tiny"]
    assert all(torch.equal(got[f"t{i}"], state["tiny"][f"t{i}"]) for i in range(10_000))
    data = sorted(step_dir.glob("data-*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[9_500 * 4096 + 100] ^= 0xFF  # inside tensor 9,500 (each starts 4 KiB-aligned), past the first 32 MiB
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="tiny/t"):
        load_state(tmp_path, 1)


def test_the_encoding_told_every_tensor_is_plain_is_the_same():
    """encode_state_named's ``plain`` (the caller found every tensor plain strided at this call)
    skips only the encoder's own look at each tensor: the tree, tensors, names and kinds are
    the same as without it."""
    state = many_state(contiguous=False)
    tree, tensors, names, kinds = encode_state_named(state)
    told = encode_state_named(state, plain=True)
    assert json.dumps(told[0]) == json.dumps(tree) and told[2] == names and told[3] == kinds
    assert len(told[1]) == len(tensors) and all(a is b for a, b in zip(told[1], tensors))


@pytest.mark.parametrize("kind", ["meta", "nested"])
def test_a_guarded_tensor_the_format_cannot_store_among_many_is_refused_by_the_save_thread(kind):
    """Guarded tensors are not looked at by save_async's call (non-blocking): the encoder's own
    look, in the save thread, refuses one the format cannot store, however many tensors share
    its mapping (the C-level pairs are taken only where the call found every tensor plain)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad = (torch.empty(3, device="meta") if kind == "meta"
               else torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    group = {f"t{i}": torch.ones(3) for i in range(12)}
    group["t5"] = bad
    state = {"group": group}
    pending = S.record_snapshot(state, 1, guarded=S.GuardedMemory(list(group.values())))
    with pytest.raises(UnsupportedObjectError) as ei:
        pending.complete(S.LayoutCache())
    assert ei.value.key_path == "group/t5"
