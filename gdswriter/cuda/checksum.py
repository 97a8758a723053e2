"""crc32c of tensors computed where they live (on the GPU for CUDA tensors), with torch ops only.

Why: the GDS engine moves bytes from GPU memory to the file without a host copy; a CPU
checksum would pull every byte through host memory anyway. The value equals the crc32c
package's, so checkpoints written this way verify anywhere (``gdswriter verify`` on a
CPU-only machine); the format does not change.

How. The "raw" CRC (register starting at 0, no final xor) is linear over GF(2), and leading
zero bytes do not change it. So a message is padded at the front to whole rows of
``ROW`` bytes; each row's raw CRC is the XOR over its positions i of ``T[ROW-1-i][byte]``
(``T[k][b]``: raw CRC of byte b followed by k zero bytes; one gather per byte, then an XOR
reduction by halving: torch has no XOR reduction); each row's value is then moved past the
rows that follow it in its message (``advance`` by d*ROW zero bytes, one base-16 digit of d
at a time, each digit four byte-wise table lookups); a per-message XOR (bit planes summed
with index_add_, parity kept) gives the message's raw CRC. Only those 4-byte results reach
the host, where the affine part is added: crc32c(M) = raw(M) ^ crc32c(zeros(len M)).

The same code runs on CPU tensors, which is how it is tested here against the crc32c
package; the engine checksums host memory with the crc32c package itself (faster there).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import numpy as np
import torch

from ..crc import gf2_times, crc32c_shift, zeros_operator
from ..errors import InvalidOptionError

ROW = 4096  # bytes per row: the position table is ROW x 256 x 4 bytes = 4 MiB (fits a GPU's L2)
_LOG2_ROW = ROW.bit_length() - 1
_DIGIT = 4  # bits of a row distance handled per advance step (16 tables of 4 x 256 per step)
_MAX_DIGITS = 16  # distances below 2**64 rows
BLOCK_BYTES = 16 << 20  # bytes per batch of rows: peak scratch memory is about 10x this
SMALL_BYTES = 1 << 20  # tensors up to this size are packed together (copied) into shared batches

_lock = threading.Lock()


def _byte_table() -> np.ndarray:
    """The classic table: raw crc32c of each single byte."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(0x82F63B78), t >> 1).astype(np.uint32)
    return t


@functools.lru_cache(maxsize=1)
def _position_table() -> np.ndarray:
    """T[k][b] (k < ROW) flattened as T[k * 256 + b]: raw CRC of byte b followed by k zero bytes."""
    t0 = _byte_table()
    tab = np.empty((ROW, 256), dtype=np.uint32)
    tab[0] = t0
    for k in range(1, ROW):
        prev = tab[k - 1]
        tab[k] = t0[prev & 0xFF] ^ (prev >> 8)
    return tab.reshape(-1)


def _operator_table(op: Sequence[int]) -> np.ndarray:
    """A linear map on 32-bit registers (column images ``op``) as 4 x 256 lookups, one per byte lane."""
    out = np.empty((4, 256), dtype=np.uint32)
    for lane in range(4):
        t = np.zeros(1, dtype=np.uint32)
        for bit in range(8):  # the table of the first 2**(bit+1) byte values, by doubling
            t = np.concatenate([t, t ^ np.uint32(op[8 * lane + bit])])
        out[lane] = t
    return out


def _compose(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The operator "b, then a"."""
    return [gf2_times(a, b[n]) for n in range(32)]


@functools.lru_cache(maxsize=_MAX_DIGITS)
def _digit_tables(m: int) -> np.ndarray:
    """For digit position m: 16 operators "advance by d * 16**m rows" (d = 0..15), each as
    4 x 256 lookups; flattened as [(d * 4 + lane) * 256 + byte]."""
    step = zeros_operator(_LOG2_ROW + _DIGIT * m)  # 16**m rows of zero bytes
    op = [1 << n for n in range(32)]  # identity: advance by 0
    tables = []
    for _ in range(16):
        tables.append(_operator_table(op))
        op = _compose(step, op)
    return np.stack(tables).reshape(-1)


class _DeviceTables:
    """The lookup tables as int32 tensors on one device (built once per device)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.position = torch.from_numpy(_position_table().view(np.int32)).to(device)
        self.row_offsets = torch.arange(ROW - 1, -1, -1, dtype=torch.int32, device=device) * 256
        self.lane_shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=device)
        self.lane_offsets = torch.arange(4, dtype=torch.int64, device=device) * 256
        self.bit_shifts = torch.arange(32, dtype=torch.int64, device=device)
        self.zeros = torch.zeros(ROW, dtype=torch.uint8, device=device)
        self._digits: list[torch.Tensor] = []
        self._settle()

    def _settle(self) -> None:
        """Tables are shared by every stream: finish their uploads before any stream reads them."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def digits(self, n: int) -> list[torch.Tensor]:
        if len(self._digits) < n:
            with _lock:  # engines on several roots checksum from several threads
                while len(self._digits) < n:
                    self._digits.append(torch.from_numpy(_digit_tables(len(self._digits)).view(np.int32))
                                        .to(self.device))
                self._settle()
        return self._digits[:n]


_tables: dict[torch.device, _DeviceTables] = {}


def _tables_for(device: torch.device) -> _DeviceTables:
    with _lock:
        t = _tables.get(device)
        if t is None:
            t = _tables[device] = _DeviceTables(device)
        return t


def _row_crcs(tab: _DeviceTables, rows: torch.Tensor) -> torch.Tensor:
    """Raw CRC (int32) of each row of ``rows`` ([R, ROW] uint8)."""
    idx = rows + tab.row_offsets  # uint8 + int32 -> int32: T's row for each position, plus the byte
    vals = tab.position.index_select(0, idx.view(-1)).view(rows.shape[0], ROW)
    del idx
    width = ROW
    while width > 1:
        width //= 2
        vals = vals[:, :width] ^ vals[:, width:]
    return vals[:, 0]


def _advance(tab: _DeviceTables, crcs: torch.Tensor, rows_after: torch.Tensor, max_rows_after: int) -> torch.Tensor:
    """Each raw CRC moved past ``rows_after`` rows of zero bytes (one base-16 digit at a time)."""
    n_digits = -(-max_rows_after.bit_length() // _DIGIT)
    for m, table in enumerate(tab.digits(n_digits)):
        digit = (rows_after >> (_DIGIT * m)) & 0xF
        lanes = (crcs.unsqueeze(1) >> tab.lane_shifts) & 0xFF  # [R, 4] int32
        idx = (digit * 1024).unsqueeze(1) + tab.lane_offsets + lanes  # int64
        v = table.index_select(0, idx.view(-1)).view(-1, 4)
        crcs = v[:, 0] ^ v[:, 1] ^ v[:, 2] ^ v[:, 3]
    return crcs


def _xor_by_message(tab: _DeviceTables, crcs: torch.Tensor, message: torch.Tensor, n_messages: int) -> torch.Tensor:
    """XOR of ``crcs`` grouped by ``message`` (int64 [n_messages], values < 2**32): per bit,
    the parity of a sum, as torch has no (segmented) XOR reduction."""
    bits = ((crcs.long() & 0xFFFFFFFF).unsqueeze(1) >> tab.bit_shifts) & 1
    sums = torch.zeros(n_messages, 32, dtype=torch.int64, device=crcs.device).index_add_(0, message, bits)
    return ((sums & 1) << tab.bit_shifts).sum(1)


class _Batch:
    """Rows from several messages, and for each row its message and how many rows follow it there."""

    def __init__(self):
        self.pieces: list[torch.Tensor] = []
        self.message: list[int] = []
        self.rows_after: list[int] = []

    def __len__(self) -> int:
        return len(self.message)

    def add(self, tab: _DeviceTables, data: torch.Tensor, message: int, rows_after_last: int) -> None:
        """``data`` padded at the front to whole rows; its last row has ``rows_after_last`` after it."""
        pad = -data.numel() % ROW
        if pad:
            self.pieces.append(tab.zeros[:pad])
        self.pieces.append(data)
        n = (data.numel() + pad) // ROW
        self.message.extend([message] * n)
        self.rows_after.extend(range(rows_after_last + n - 1, rows_after_last - 1, -1))


def _raw_crcs(tab: _DeviceTables, flats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Raw CRC of each flat uint8 tensor (all on ``tab.device``), as int64 [len(flats)]."""
    dev = tab.device
    acc = torch.zeros(len(flats), dtype=torch.int64, device=dev)
    block_rows = max(1, BLOCK_BYTES // ROW)

    def run(rows: torch.Tensor, message: torch.Tensor, rows_after: torch.Tensor, max_after: int) -> None:
        nonlocal acc
        crcs = _advance(tab, _row_crcs(tab, rows), rows_after, max_after)
        acc ^= _xor_by_message(tab, crcs, message, len(flats))

    batch = _Batch()

    def flush() -> None:
        nonlocal batch
        if len(batch):
            rows = torch.cat(batch.pieces).view(-1, ROW)
            run(rows, torch.tensor(batch.message, dtype=torch.int64, device=dev),
                torch.tensor(batch.rows_after, dtype=torch.int64, device=dev), max(batch.rows_after))
        batch = _Batch()

    for i, t in enumerate(flats):
        n = t.numel()
        if n == 0:
            continue
        if n <= SMALL_BYTES:
            batch.add(tab, t, i, 0)
        else:  # the head (n % ROW bytes) joins the batch; whole rows are read in place, in blocks
            head, body_rows = n % ROW, n // ROW
            if head:
                batch.add(tab, t[:head], i, body_rows)
            body = t[head:].view(body_rows, ROW)
            for lo in range(0, body_rows, block_rows):
                hi = min(lo + block_rows, body_rows)
                after = torch.arange(body_rows - 1 - lo, body_rows - 1 - hi, -1, dtype=torch.int64, device=dev)
                run(body[lo:hi], torch.full((hi - lo,), i, dtype=torch.int64, device=dev), after, body_rows - 1 - lo)
        if len(batch) >= block_rows:
            flush()
    flush()
    return acc


@functools.lru_cache(maxsize=4096)
def zeros_crc32c(n: int) -> int:
    """crc32c of n zero bytes: the affine part of crc32c (initial register 0xFFFFFFFF moved
    past n bytes, then the final xor)."""
    return crc32c_shift(0xFFFFFFFF, n) ^ 0xFFFFFFFF


def _flat_bytes(t: torch.Tensor, i: int) -> torch.Tensor:
    if not t.is_contiguous():
        raise InvalidOptionError(f"tensor {i}: crc32c needs contiguous memory (got strides {t.stride()}); "
                                 f"pass .contiguous() or checksum its storage's bytes")
    return t.detach().reshape(-1).view(torch.uint8)


def crc32c_tensors(tensors: Sequence[torch.Tensor]) -> list[int]:
    """crc32c of each tensor's bytes (contiguous, any dtype), computed on the tensor's device
    on the current stream. One host synchronisation per device; only 8 bytes per tensor
    travel to the host."""
    flats = [_flat_bytes(t, i) for i, t in enumerate(tensors)]
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flats):
        by_device.setdefault(f.device, []).append(i)
    out = [0] * len(flats)
    for dev, idxs in by_device.items():
        raw = _raw_crcs(_tables_for(dev), [flats[i] for i in idxs]).cpu().tolist()
        for i, r in zip(idxs, raw):
            out[i] = (r ^ zeros_crc32c(flats[i].numel())) & 0xFFFFFFFF
    return out


def crc32c_tensor(t: torch.Tensor) -> int:
    """crc32c of one tensor's bytes; see crc32c_tensors."""
    return crc32c_tensors([t])[0]
