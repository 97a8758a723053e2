"""The compiled copier and checksums (gdswriter/_gather.c through gdswriter.crc): every span's
bytes and crc32c the same as the crc32c package and the pure-Python path give, for empty,
one-byte, unaligned, 8 KiB and 1 MiB spans; bad inputs refused with a typed error before a byte
is copied or read; a save of many tensors through the host snapshot writes the same files with
it as with GDSWRITER_NATIVE=0, and loads back bit-exact; a load checksums its read runs through
crc32c_spans (tests/test_load_views.py: damage found either way)."""

from __future__ import annotations

import random
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from gdswriter import GDSCheckpointer, load_state
from gdswriter import crc as C
from gdswriter.save import pool

BUILT = not C.native_status().startswith("pure Python (the compiled")
needs_build = pytest.mark.skipif(not BUILT, reason="gdswriter._gather was not built (no C compiler at install)")

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 63, 64, 65, 4095, 4097, 8 << 10, (8 << 10) + 5, 1 << 20, (1 << 20) + 3,
         (3 << 20) + 11]


def _spans(rng: random.Random, src_len: int):
    """Spans of every size in SIZES at unaligned source offsets, laid out at unaligned offsets."""
    offs, srcs, lens, at = [], [], [], 0
    for n in SIZES + [rng.randrange(0, 50_000) for _ in range(40)]:
        at += rng.randrange(0, 13)  # a gap of 0-12 bytes: unaligned destinations
        offs.append(at)
        srcs.append(rng.randrange(0, src_len - n + 1))
        lens.append(n)
        at += n
    return offs, srcs, lens, at


def test_span_crcs_equal_the_crc32c_package(crc_path):
    rng = random.Random(5)
    data = np.frombuffer(rng.randbytes(8 << 20), dtype=np.uint8)[3:]  # an odd address
    _, starts, lens, _ = _spans(rng, len(data))
    starts += [len(data), len(data) - 1]  # an empty span at the very end, the last byte
    lens += [0, 1]
    crcs = np.zeros(len(lens) + 1, dtype=np.uint32)
    C.crc32c_spans(data, np.array(starts, np.int64), np.array(lens, np.int64), crcs[:-1])
    for i, (s, n) in enumerate(zip(starts, lens)):
        assert int(crcs[i]) == crc32c.crc32c(data[s:s + n].tobytes()), (i, n)
    assert crcs[-1] == 0  # nothing written past crcs_out
    C.crc32c_spans(b"", np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint32))  # nothing to sum


@needs_build
@pytest.mark.parametrize("portable", [False, True])
def test_compiled_crc32c_equals_the_package_instruction_and_table(portable):
    rng = random.Random(9)
    data = rng.randbytes((1 << 20) + 77)
    for n in SIZES[:-1] + [rng.randrange(1, 1 << 20) for _ in range(30)]:
        at = rng.randrange(0, 8)
        piece = data[at:at + n]
        assert C.compiled_crc32c(piece, portable=portable) == crc32c.crc32c(piece), n
        assert C.compiled_crc32c(piece, 0xDEADBEEF, portable=portable) == crc32c.crc32c(piece, 0xDEADBEEF), n


@pytest.mark.parametrize("bad", ["lengths differ", "negative length", "negative offset", "past the end",
                                 "wrong dtype", "crcs read-only", "two-dimensional", "not a buffer"])
def test_bad_spans_raise_a_typed_error_and_write_nothing(crc_path, bad):
    data = np.arange(64, dtype=np.uint8)
    off, lens, crcs = np.zeros(2, np.int64), np.ones(2, np.int64), np.full(2, 7, np.uint32)
    error: type[Exception] = ValueError
    if bad == "lengths differ":
        crcs = np.full(3, 7, np.uint32)
    elif bad == "negative length":
        lens[1] = -1
    elif bad == "negative offset":
        off[1] = -1
    elif bad == "past the end":
        off[1], lens[1] = 60, 5  # 60 + 5 > 64
    elif bad == "wrong dtype":
        lens, error = lens.astype(np.int32), TypeError
    elif bad == "crcs read-only":
        crcs.flags.writeable = False
        error = (TypeError, ValueError)  # type: ignore[assignment]
    elif bad == "two-dimensional":
        off, error = np.zeros((2, 1), dtype=np.int64), TypeError
    else:
        data, error = 64, TypeError  # type: ignore[assignment]
    with pytest.raises(error, match="crc32c_spans" if bad != "not a buffer" else None):
        C.crc32c_spans(data, off, lens, crcs)
    assert (crcs == 7).all()  # checked before the first span is summed


def test_the_pool_copies_through_the_compiled_gather_where_built(tmp_path, monkeypatch):
    """The save below does go through the compiled call (else its comparison would prove nothing)."""
    if not BUILT:
        pytest.skip("gdswriter._gather was not built (no C compiler at install)")
    monkeypatch.delenv(C.NATIVE_ENV, raising=False)
    calls = []
    real = pool.native_gather_copies

    def counting():
        fn = real()

        def gather(*a):
            done = fn(*a)
            calls.append(len(a[2]) if done else 0)
            return done

        return None if fn is None else gather

    monkeypatch.setattr(pool, "native_gather_copies", counting)
    _save(tmp_path, _state())
    assert sum(calls) >= 2 * 3000  # both later saves' copies (the first save's too)


@needs_build
def test_a_pieces_copies_gathered_in_one_call_equal_the_package(monkeypatch):
    """gather_copies (what the pool calls): a piece's (offset, length, (address, length)) list,
    each crc32c to its slot of the save's list; a tensor among the sources: False, nothing done."""
    monkeypatch.delenv(C.NATIVE_ENV, raising=False)
    gather = C.native_gather_copies()
    rng = random.Random(11)
    src = np.frombuffer(rng.randbytes(4 << 20), dtype=np.uint8)
    offs, starts, lens, size = _spans(rng, len(src))
    copies = [(o, n, (src.ctypes.data + s, n)) for o, s, n in zip(offs, starts, lens)]
    dst = np.zeros(size, dtype=np.uint8)
    crcs = [0] * (len(copies) + 5)
    assert gather(dst.ctypes.data, size, copies, crcs, 2) is True
    for i, (o, s, n) in enumerate(zip(offs, starts, lens)):
        assert dst[o:o + n].tobytes() == src[s:s + n].tobytes()
        assert crcs[2 + i] == crc32c.crc32c(src[s:s + n].tobytes()), (i, n)
    assert crcs[:2] == [0, 0] and crcs[-3:] == [0, 0, 0]
    dst[:] = 0
    with_tensor = copies[:3] + [(size - 4, 4, torch.zeros(4, dtype=torch.uint8))]
    assert gather(dst.ctypes.data, size, with_tensor, [0] * 4, 0) is False
    assert not dst.any()


@needs_build
@pytest.mark.parametrize("bad", ["past the end", "negative length", "not a tuple", "not an int", "slots outside",
                                 "not a list"])
def test_bad_copies_raise_a_typed_error_and_copy_nothing(monkeypatch, bad):
    monkeypatch.delenv(C.NATIVE_ENV, raising=False)
    gather = C.native_gather_copies()
    dst = np.full(64, 7, dtype=np.uint8)
    src = np.arange(64, dtype=np.uint8)
    copies: list = [(0, 8, (src.ctypes.data, 8)), (8, 8, (src.ctypes.data, 8))]
    crcs, base, error = [0, 0], 0, ValueError
    if bad == "past the end":
        copies[1] = (60, 8, (src.ctypes.data, 8))
    elif bad == "negative length":
        copies[1] = (8, -1, (src.ctypes.data, -1))
    elif bad == "not a tuple":
        copies[1], error = [8, 8, (src.ctypes.data, 8)], TypeError
    elif bad == "not an int":
        copies[1], error = (8, 8.0, (src.ctypes.data, 8)), TypeError
    elif bad == "slots outside":
        base = 1
    else:
        copies, error = tuple(copies), TypeError
    with pytest.raises(error):
        gather(dst.ctypes.data, len(dst), copies, crcs, base)
    assert (dst == 7).all() and crcs == [0, 0]


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.float16, torch.int64, torch.uint8, torch.bfloat16)
    state = {f"t{i}": torch.randint(0, 250, (1 + i % 301,), generator=g).to(dtypes[i % 5]) for i in range(3000)}
    state["big"] = torch.randn(700_001, generator=g)  # 2.8 MiB: cut where pieces end, copied in parts
    return state


def _save(root: Path, state: dict) -> Path:
    with GDSCheckpointer(state, None, root) as ck:
        ck.save(1)
        ck.save(2)  # the second save reuses the layout (_LayoutTemplate): the same copies again
    return root


def _data_files(root: Path) -> dict[str, bytes]:
    """The steps' data files (the manifests' crc32c columns are checked by the load below)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.glob("step_*/*.bin")}


@needs_build
def test_a_save_writes_the_same_files_natively_and_in_python_and_loads_bit_exact(tmp_path, monkeypatch):
    state = _state()
    monkeypatch.delenv(C.NATIVE_ENV, raising=False)
    native = _save(tmp_path / "native", state)
    monkeypatch.setenv(C.NATIVE_ENV, "0")
    python = _save(tmp_path / "python", state)
    a, b = _data_files(native), _data_files(python)
    assert len(a) == 2 and a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    monkeypatch.delenv(C.NATIVE_ENV, raising=False)
    for root in (native, python):
        step, got = load_state(root, step=2)
        loaded = got["model"]
        assert step == 2 and loaded.keys() == state.keys()
        for k, t in state.items():
            assert torch.equal(loaded[k], t), k


def test_a_native_knob_that_is_not_a_boolean_word_is_a_typed_error(monkeypatch):
    """GDSWRITER_NATIVE is read as every GDSWRITER_ boolean is: a value that is none of the
    words is refused with the words, not taken for "on"."""
    from gdswriter.errors import InvalidOptionError

    monkeypatch.setenv(C.NATIVE_ENV, "maybe")
    with pytest.raises(InvalidOptionError, match="GDSWRITER_NATIVE='maybe' is not a boolean"):
        C.native_gather_copies()
