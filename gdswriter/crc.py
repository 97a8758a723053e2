"""crc32c helpers beyond the crc32c package: combining the checksums of adjacent pieces; the
checksums of many spans of one buffer (crc32c_spans: a load's read run, its chunks) and the
gather the host snapshot's copier runs per pool piece (native_gather_copies), compiled
(gdswriter/_gather.c, built where a C compiler was found) or in Python."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from .options import env_flag

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def gf2_times(mat, vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat) -> list[int]:
    return [gf2_times(mat, mat[n]) for n in range(32)]


@functools.cache
def zeros_operator(log2_bytes: int) -> tuple[int, ...]:
    """The GF(2) operator (image of each of the 32 register bits) that feeds 2**log2_bytes
    zero bytes through a crc32c register. Cached: crc32c_combine used to rebuild the chain
    of squarings on every call (~3 ms); applying cached operators takes microseconds."""
    if log2_bytes == 0:
        op = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):  # 2, 4, 8 zero bits
            op = _gf2_square(op)
        return tuple(op)
    return tuple(_gf2_square(zeros_operator(log2_bytes - 1)))


def crc32c_shift(crc: int, nbytes: int) -> int:
    """``crc`` (a register value) after ``nbytes`` zero bytes; linear in ``crc``."""
    p = 0
    while nbytes > 0:
        if nbytes & 1:
            crc = gf2_times(zeros_operator(p), crc)
        nbytes >>= 1
        p += 1
    return crc


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) and len(B) (zlib's crc32_combine, Castagnoli polynomial)."""
    if len2 <= 0:
        return crc1
    return crc32c_shift(crc1, len2) ^ crc2


NATIVE_ENV = "GDSWRITER_NATIVE"  # "0": the pure-Python gather even where the compiled one is built


@functools.cache
def _compiled():
    """What the compiled module gdswriter._gather offers (crc32c_spans, gather_copies, crc32c,
    CRC_IMPL: the CPU's crc32c instruction it found, or "table"), or None where the build left
    it out."""
    try:
        from ._gather import CRC_IMPL, crc32c, crc32c_spans, gather_copies
    except ImportError:
        return None
    return SimpleNamespace(crc32c_spans=crc32c_spans, gather_copies=gather_copies, crc32c=crc32c, CRC_IMPL=CRC_IMPL)


def _native():
    """The compiled module, or None where it is not built or GDSWRITER_NATIVE=0 turns it off
    (read at each call: a test or a user may flip it; a value not a boolean word is an
    InvalidOptionError, as for every GDSWRITER_ boolean)."""
    return _compiled() if env_flag(NATIVE_ENV, True) else None


def native_gather_copies():
    """The compiled gather_copies(dst_address, dst_size, copies, crcs, base), or None (as
    crc32c_spans' choice): a pool piece's (offset, length, (address, length)) copies gathered in one
    call, each crc32c to the list ``crcs`` at ``base`` + its index; it returns False, having
    copied nothing, where a copy's source is not an (address, length) tuple. The columns are
    read from the tuples in C (a few ns a copy): the host snapshot's copier (save/pool.py)."""
    mod = _native()
    return mod.gather_copies if mod is not None else None


def native_status() -> str:
    """What copies the host snapshot and checksums a load's read runs, in words (gdswriter doctor)."""
    mod = _compiled()
    if mod is None:
        return "pure Python (the compiled gdswriter._gather was not built: reinstall with a C compiler)"
    if _native() is None:
        return f"pure Python ({NATIVE_ENV}=0; compiled gdswriter._gather available, crc32c by {mod.CRC_IMPL})"
    return f"compiled gdswriter._gather (crc32c by {mod.CRC_IMPL})"


def compiled_crc32c(data, crc: int = 0, *, portable: bool = False) -> int:
    """crc32c(data, crc) by the compiled module (``portable``: by its table, not the CPU's
    instruction), for tests that check both against the crc32c package; ImportError where the
    module was not built."""
    mod = _compiled()
    if mod is None:
        raise ImportError("gdswriter._gather was not built: reinstall gdswriter where a C compiler and the Python "
                          "headers are found (pip install -e . or pip install gdswriter)")
    return mod.crc32c(data, crc, portable)


def crc32c_spans(data, offsets, lengths, crcs_out) -> None:
    """``crcs_out[i]`` = the crc32c of ``data[offsets[i]:offsets[i] + lengths[i]]`` for every i:
    one compiled call with the GIL released where gdswriter._gather is built (and
    GDSWRITER_NATIVE is not 0), else a crc32c call per span; the same values either way.
    ``data``: a C-contiguous buffer (a numpy array); ``offsets`` and ``lengths``: one-dimensional
    int64 arrays, ``crcs_out`` a writable uint32 one, of one length. Both check every span lies
    inside ``data`` first (ValueError; TypeError for the wrong kinds of arrays)."""
    native = _native()
    if native is not None:
        native.crc32c_spans(data, offsets, lengths, crcs_out)
        return
    _python_spans(data, offsets, lengths, crcs_out)


def _python_spans(data, offsets, lengths, crcs_out) -> None:
    """crc32c_spans in Python, with the compiled one's checks and errors."""
    import numpy as np
    from crc32c import crc32c

    cols = [np.asarray(c) for c in (offsets, lengths, crcs_out)]
    if any(c.ndim != 1 for c in cols) or any(c.dtype != np.int64 for c in cols[:2]) or cols[2].dtype != np.uint32:
        raise TypeError("crc32c_spans: offsets and lengths must be one-dimensional int64, crcs_out uint32: pass "
                        "numpy arrays of those dtypes")
    if not cols[2].flags.writeable:
        raise TypeError("crc32c_spans: crcs_out must be a writable buffer of uint32 integers (a numpy array)")
    if len({len(c) for c in cols}) != 1:
        raise ValueError(f"crc32c_spans: the arrays differ in length ({', '.join(str(len(c)) for c in cols)}): "
                         "pass one entry per span in each")
    view = memoryview(data).cast("B")
    off, n = cols[0].tolist(), cols[1].tolist()
    for i, (o, k) in enumerate(zip(off, n)):
        if k < 0 or o < 0 or o + k > len(view):
            raise ValueError(f"crc32c_spans: span {i} (offset {o}, length {k}) is not inside the data's "
                             f"{len(view)} bytes: offsets and lengths must be non-negative and end within it")
    cols[2][:] = [crc32c(view[o:o + k]) for o, k in zip(off, n)]
