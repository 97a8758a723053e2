"""Format 2.1 (issue 40): a single-process save packs storages under PACK_BELOW (64 KiB) 64 bytes
apart and keeps larger ones on 4 KiB boundaries (docs/format.md 2). Mixed states round-trip bit-exact in
both snapshot modes, first save and second; the padding is zero; a damaged packed chunk is
found by its crc32c; a load reads packed runs zero-copy from 4 KiB boundaries, each file byte
once, even where two runs share a block; the planner's layout keeps its invariants. Packing
thresholds other than PACK_BELOW (up to PACK_MAX, through the session's new_plan seam): the same
round trip, verify, export and live load, with packed storages larger than a block."""

from __future__ import annotations

import random

import pytest
import torch

from support import models as M
from gdswriter import ChecksumMismatchError, GDSCheckpointer, load_state
from gdswriter.cli import main as cli_main
from gdswriter.engines.base import ReadSpan
from gdswriter.engines.select import create_engine
from gdswriter.format.manifest import MANIFEST_NAME, Manifest
from gdswriter.load.reader import read_manifest, read_storages
from gdswriter.planner.assign import PACK_ALIGN, PACK_BELOW, PACK_MAX, FileTarget, plan_save

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def mixed_state(seed: int) -> dict:
    """Small storages of every dtype (odd byte counts among them), views and a tie of one small
    base, zero-byte tensors, storages just over 4 KiB, and a large one (1.2 MB) between them."""
    g = torch.Generator().manual_seed(seed)

    def make(dt, n):
        if dt.is_complex:
            return torch.randn(n, generator=g, dtype=dt)
        if dt.is_floating_point:
            return torch.randn(n, generator=g).to(dt)
        if dt == torch.bool:
            return torch.randint(0, 2, (n,), generator=g).bool()
        return torch.randint(-100 if dt != torch.uint8 else 0, 100, (n,), generator=g).to(dt)

    state: dict = {}
    for i, dt in enumerate(DTYPES):
        state[f"small{i}"] = make(dt, 1 + 7 * i)  # 1 to 78 elements: 1 to 1248 bytes
        state[f"large{i}"] = make(dt, 4096 // dt.itemsize + 3 + i)  # just over 4 KiB: packed (PACK_BELOW 64 KiB)
    base = torch.randn(6, 5, generator=g)
    state.update({"base": base, "base_t": base.t(), "row": base[2], "tied": base, "cols": base[:, 1::2],
                  "empty": torch.zeros(0), "empty2": torch.zeros(3, 0, dtype=torch.int16),
                  "big": torch.randn(300_001, generator=g), "odd": make(torch.uint8, 3)})
    return state


def snapshot(state: dict) -> dict:
    return {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).copy_(v) for k, v in state.items()}


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), k
        assert torch.equal(g.contiguous().view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)), k


def check_layout(step_dir, manifest: Manifest, pack_below: int = PACK_BELOW) -> None:
    """2.1's layout on disk: small storages' chunks 64-byte aligned (some not 4 KiB-aligned), large
    ones' 4 KiB-aligned, each file exactly as long as its chunks, every byte no chunk holds zero.
    Packing above 4 KiB: some packed storage larger than 4 KiB starts off the 4 KiB grid."""
    assert manifest.version >= (2, 1)  # 2.1 and later (3.0: the same layout, base64 columns)
    held: dict[int, list[tuple[int, int]]] = {}
    packed = packed_large = 0
    for s in manifest.storages:
        for c in s.chunks:
            if c.length:
                assert c.file_offset % (PACK_ALIGN if s.nbytes < pack_below else 4096) == 0, (s.nbytes, c)
                packed += c.file_offset % 4096 != 0
                packed_large += c.file_offset % 4096 != 0 and s.nbytes > 4096
            held.setdefault(c.file, []).append((c.file_offset, c.file_offset + c.length))
    assert packed, "no storage was packed"
    assert packed_large or pack_below <= 4096, "no storage over 4 KiB was packed"
    for fid, rec in enumerate(manifest.files):
        data = bytearray((step_dir / rec.path).read_bytes())
        ends = [b for _, b in held.get(fid, [])]
        assert len(data) == rec.size == max(ends, default=0)
        for a, b in held.get(fid, []):
            data[a:b] = bytes(b - a)
        assert not any(data), f"{rec.path}: padding bytes that are not zero"


@pytest.mark.parametrize("mode", ["host", "live"])
def test_mixed_storages_round_trip_packed_first_and_second_save(tmp_path, mode):
    """Both saves (the second reuses the layout and, in host mode, the pool holding the first
    save's bytes) write 2.1's layout with zero padding and load back bit-exact, sharing kept."""
    state = mixed_state(1)
    wants = {}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options(snapshot=mode, files_per_root=2)) as ck:
        for step in (1, 2):
            ck.save(step)
            wants[step] = snapshot(state)
            with torch.no_grad():
                for v in state.values():
                    if v.numel() and v.dtype != torch.bool:
                        v.add_(1 if not v.dtype.is_complex else 1j)
        dirs = {step: ck.protocol.step_dir(step) for step in wants}
    for step, want in wants.items():
        m = Manifest.from_json_bytes((dirs[step] / MANIFEST_NAME).read_bytes())
        check_layout(dirs[step], m)
        _, got = load_state(tmp_path, step)
        model = got["model"]
        assert_same(model, want)
        assert model["tied"].data_ptr() == model["base"].data_ptr()
        assert model["row"].untyped_storage().data_ptr() == model["base"].untyped_storage().data_ptr()


def test_a_damaged_packed_chunk_is_found(tmp_path):
    """One flipped byte inside a storage packed off the 4 KiB grid: ChecksumMismatchError naming it."""
    state = {f"t{i}": torch.full((100 + i,), float(i)) for i in range(200)}  # 400-796 B each
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        ck.save(1)
        step_dir = ck.protocol.step_dir(1)
    m = Manifest.from_json_bytes((step_dir / MANIFEST_NAME).read_bytes())
    names = m.tensor_names()
    sid, c = next((i, s.chunks[0]) for i, s in enumerate(m.storages)
                  if s.chunks[0].file_offset % 4096 and s.chunks[0].file_offset > 8192)
    path = step_dir / m.files[c.file].path
    raw = bytearray(path.read_bytes())
    raw[c.file_offset + c.length // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=names[m.tensor_storages().index(sid)]):
        load_state(tmp_path, 1)


class Recording:
    """An engine that records the spans of every read_file call (and reads through ``inner``)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def read_file(self, path, spans):
        self.calls.append([(s.offset, s.out.numel(), s.out.data_ptr()) for s in spans])
        return self.inner.read_file(path, spans)


@pytest.mark.parametrize("mode", ["live", "host"])
def test_packed_runs_are_read_zero_copy_each_byte_once(tmp_path, mode):
    """5 MB of 1100-byte storages (1152 apart) in one file: the dense runs (2 MiB at most) start
    their buffers on the file's 4 KiB phase, their spans start 4 KiB-aligned at 4 KiB-aligned
    memory, a block shared by two runs is read once (by the later run, then copied into the
    earlier one, or into the chunk before it of a storage the host pool cut at a piece's end),
    and every storage comes back bit-exact with its crc32c checked."""
    state = {f"t{i}": torch.randint(0, 255, (1100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
             for i in range(4500)}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options(snapshot=mode)) as ck:
        ck.save(1)
        protocol = ck.protocol
    m = read_manifest(protocol, 1)
    eng = Recording(create_engine())
    try:
        out = read_storages(protocol, m, [None] * len(m.storages), [eng], verify=True)
    finally:
        eng.inner.close()
    spans = [s for call in eng.calls for s in call]
    assert len(spans) >= 3, spans
    size = m.files[0].size
    assert size - 64 * len(spans) < sum(n for _, n, _ in spans) <= size  # each byte once (padding between runs aside)
    runs = [(o, n, p) for o, n, p in spans if n >= 1 << 20]  # the rest: the chunks of storages the pool cut
    assert len(runs) >= 2 and all(o % 4096 == 0 and p % 4096 == 0 for o, _, p in runs), spans
    if mode == "live":
        assert any((o + n) % 4096 == 0 for o, n, _ in runs[:-1]), "no run ended inside a shared block"
    else:  # the chunk the pool cut at a piece's end, in the block the next run starts at: read by that run
        assert any(n == 0 for _, n, _ in spans), spans
    assert any(c.file_offset % 4096 for s in m.storages for c in s.chunks[:1])
    names = m.tensor_names()
    for sid, buf in enumerate(out):
        assert torch.equal(buf, state[names[m.tensor_storages().index(sid)].split("/", 1)[1]])


@pytest.mark.parametrize("pack_below", [4096, 65536])
@pytest.mark.parametrize("seed", range(40))
def test_the_packed_plan_keeps_the_layout_invariants(seed, pack_below):
    """Random sizes over 1 to 3 files: every byte once; small storages one chunk each at a
    multiple of 64, never split; the others 4 KiB-aligned in file and storage; chunks in file
    order without overlap; file sizes the end of their last chunk; packing never longer than
    the 4 KiB layout; pack_below=0 is that layout (what multi-rank saves keep)."""
    rnd = random.Random(seed)
    sizes = [rnd.choice([0, 1, 3, 17, 100, 2700, 4095, 4096, 4097, 10_000, 27_000, 65_535, 65_536, 70_001])
             for _ in range(rnd.randint(0, 60))]
    targets = [FileTarget(0, f"f{i}") for i in range(rnd.randint(1, 3))]
    dense, aligned = plan_save(sizes, targets, pack_below=pack_below), plan_save(sizes, targets)
    assert all(c.file_offset % 4096 == 0 and c.storage_offset % 4096 == 0 for f in aligned.files for c in f.chunks)
    assert sum(f.size for f in dense.files) <= sum(f.size for f in aligned.files)
    covered: dict[int, list[tuple[int, int]]] = {}
    for fid, f in enumerate(dense.files):
        last = 0
        for c in f.chunks:
            assert c.file == fid and c.file_offset >= last
            if c.length:
                last = c.file_offset + c.length
                assert c.file_offset % (PACK_ALIGN if sizes[c.storage] < pack_below else 4096) == 0
                if sizes[c.storage] >= pack_below:
                    assert c.storage_offset % 4096 == 0
            covered.setdefault(c.storage, []).append((c.storage_offset, c.length))
        assert f.size == max((c.file_offset + c.length for c in f.chunks), default=0)
    for sid, n in enumerate(sizes):
        parts = sorted(covered[sid])
        assert [o for o, _ in parts] == [sum(k for _, k in parts[:i]) for i in range(len(parts))]
        assert sum(k for _, k in parts) == n
        if 0 < n < pack_below:
            assert len(parts) == 1


def test_the_engine_reads_a_packed_file_exactly(tmp_path):
    """A ReadSpan per packed storage, not whole runs (what a partial load does): the bytes."""
    state = {f"t{i}": torch.arange(i % 50 + 1, dtype=torch.int16) * i for i in range(500)}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options()) as ck:
        ck.save(1)
        protocol = ck.protocol
    m = read_manifest(protocol, 1)
    eng = create_engine()
    try:
        for fid, rec in enumerate(m.files):
            chunks = sorted((c.file_offset, c.length, sid) for sid, s in enumerate(m.storages) for c in s.chunks
                            if c.file == fid and c.length)[1::3]
            outs = [ReadSpan(o, torch.empty(n, dtype=torch.uint8)) for o, n, _ in chunks]
            eng.read_file(protocol.step_dir(1) / rec.path, outs)
            names = m.tensor_names()
            for (_, _, sid), r in zip(chunks, outs):
                want = state[names[m.tensor_storages().index(sid)].split("/", 1)[1]]
                assert torch.equal(r.out, want.view(torch.uint8))
    finally:
        eng.close()


def packed_above_a_block(ck, pack_below: int) -> None:
    """Make ``ck``'s session plan with ``pack_below`` (its new_plan seam) instead of PACK_BELOW."""
    ck.session.new_plan = lambda sizes, devices, targets: plan_save(sizes, targets, pack_below=pack_below)


def mid_state(seed: int) -> dict:
    """mixed_state plus storages between 4 KiB and 64 KiB (27 KB ones, dense runs of 1-2 MiB
    between them, and a few of 60-70 KB on either side of 64 KiB)."""
    g = torch.Generator().manual_seed(seed)
    state = mixed_state(seed)
    state.update({f"mid{i}": torch.randn(6750 + i % 7, generator=g) for i in range(160)})
    state.update({f"edge{i}": torch.randn(16384 + 500 * (i - 2), generator=g) for i in range(5)})
    return state


@pytest.mark.parametrize("pack_below", [65536, PACK_MAX])
@pytest.mark.parametrize("mode", ["host", "live"])
def test_storages_packed_above_a_block_round_trip_verify_export_and_load_live(tmp_path, capsys, mode, pack_below):
    """pack_below above 4 KiB: storages up to it packed 64 bytes apart (larger than a block,
    cut by the host pool where its pieces end), larger ones 4 KiB-aligned; both saves load back
    bit-exact (fresh and into the live tensors), ``gdswriter verify`` passes, an export holds
    the same bytes, and a flipped byte inside a packed storage over 4 KiB is found."""
    state = mid_state(2)
    wants, dirs = {}, {}
    with GDSCheckpointer(state, None, tmp_path, options=M.small_options(snapshot=mode, files_per_root=2)) as ck:
        packed_above_a_block(ck, pack_below)
        for step in (1, 2):
            ck.save(step)
            wants[step] = snapshot(state)
            dirs[step] = ck.protocol.step_dir(step)
            with torch.no_grad():
                for v in state.values():
                    if v.numel() and v.dtype != torch.bool:
                        v.add_(1 if not v.dtype.is_complex else 1j)
        ck.load(1)  # into the live tensors
        assert_same(dict(state), wants[1])
    for step, want in wants.items():
        m = Manifest.from_json_bytes((dirs[step] / MANIFEST_NAME).read_bytes())
        check_layout(dirs[step], m, pack_below)
        assert_same(load_state(tmp_path, step)[1]["model"], want)
    assert cli_main(["verify", str(tmp_path), "--all"]) == 0, capsys.readouterr().out
    assert cli_main(["export", str(tmp_path), "--step", "2", "--to", "torch", str(tmp_path / "m.pt")]) == 0
    exported = {k.split("/", 1)[1]: v for k, v in torch.load(tmp_path / "m.pt", weights_only=True).items()}
    assert {f"mid{i}" for i in range(160)} <= set(exported)  # ties are exported once
    assert all(torch.equal(v.contiguous().view(-1).view(torch.uint8),
                           wants[2][k].contiguous().view(-1).view(torch.uint8)) for k, v in exported.items())
    m = Manifest.from_json_bytes((dirs[2] / MANIFEST_NAME).read_bytes())
    c = next(c for s in m.storages if 4096 < s.nbytes < pack_below for c in s.chunks if c.file_offset % 4096)
    path = dirs[2] / m.files[c.file].path
    raw = bytearray(path.read_bytes())
    raw[c.file_offset + c.length - 1] ^= 0x01
    path.write_bytes(bytes(raw))
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path), "--step", "2"]) == 1
    with pytest.raises(ChecksumMismatchError):
        load_state(tmp_path, 2)
