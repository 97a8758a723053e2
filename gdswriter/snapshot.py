"""Snapshots: what a save records of the live state, and (optionally) host copies of its bytes.

``take_snapshot`` encodes the state tree (no pickle), groups its tensors by the storage
they view (tied weights and views are written once) and describes each group as one
flat byte extent. The writer (writer.py) then streams those extents to the data files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .engine import EngineInfo
from .errors import UnsupportedObjectError
from .fallback.engine import ZERO_COPY_MIN
from .format.dtypes import dtype_to_name
from .format.manifest import TensorRecord
from .format.state_codec import encode_state
from .options import ALIGN, EngineOptions, log_once

STORAGE_ALIGN = 16  # extents start at a multiple of the largest item size, so every view stays valid


@dataclass
class Extent:
    """The byte range of one storage that the saved tensors view, as a flat uint8 tensor."""

    flat: torch.Tensor
    first_tensor: str


@dataclass
class Snapshot:
    step: int
    tree: Any
    extents: list[Extent]
    records: list[TensorRecord]
    metadata: dict


def flat_bytes(storage: torch.UntypedStorage, device: torch.device, start: int, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _tensor_names(tree: Any, n: int) -> tuple[list[str], list[str]]:
    """Key path and kind ("tensor"/"ndarray") of each tensor index's first appearance in ``tree``."""
    names, kinds = [""] * n, ["tensor"] * n

    def walk(v: Any, path: str, depth: int) -> None:
        if depth > 400:
            return
        if isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{path}/{i}" if path else str(i), depth + 1)
        elif isinstance(v, dict):
            if len(v) == 1 and ("$tensor" in v or "$ndarray" in v):
                kind = "tensor" if "$tensor" in v else "ndarray"
                i = v["$" + kind]
                if isinstance(i, int) and 0 <= i < n and not names[i]:
                    names[i], kinds[i] = path or "<root>", kind
                return
            entries = v.get("$dict", v.get("$odict"))
            if isinstance(entries, list):
                for kv in entries:
                    if isinstance(kv, list) and len(kv) == 2:
                        k = kv[0] if isinstance(kv[0], (str, int, float, bool)) or kv[0] is None else repr(kv[0])
                        walk(kv[1], f"{path}/{k}" if path else str(k), depth + 1)
                return
            for k, x in v.items():
                walk(x, path, depth + 1)

    walk(tree, "", 0)
    return names, kinds


def host_copy(flat: torch.Tensor) -> torch.Tensor:
    """A page-aligned host copy of flat uint8 ``flat`` (pinned when it lives on a GPU; the
    caller synchronizes). Aligned, the engine writes it with no staging copy (zero-copy).
    torch's copy_ splits the copy and its page faults across threads: 2.6-3.0 GB/s here
    against 1.3 GB/s for a single-threaded memmove into freshly mapped pages."""
    raw = torch.empty(flat.numel() + ALIGN, dtype=torch.uint8, pin_memory=flat.is_cuda)
    start = (-raw.data_ptr()) % ALIGN
    host = raw[start:start + flat.numel()]
    host.copy_(flat, non_blocking=flat.is_cuda)
    return host


_ALIGN_HINT_MIN = 64 << 20


def hint_unaligned(flats: Sequence[torch.Tensor], options: EngineOptions, info: EngineInfo) -> None:
    """Count the bytes of large host tensors in ``flats`` that missed zero-copy only because their
    memory is less aligned than O_DIRECT needs on this file system (``info``: the engine after the
    I/O); from 64 MiB on, say once per process (at INFO level) how to align them. torch's CPU
    allocator puts large tensors 64 bytes into a page unless THP_MEM_ALLOC_ENABLE=1 is set: enough
    for NVMe (4-byte DMA alignment), not for a disk that needs 512 bytes, where the staging copy then
    costs CPU (half the work of a transfer; with the huge-page staging pool, not bandwidth here)."""
    align = info.direct_memory_alignment
    if not (options.zero_copy and info.direct_io and align):
        return
    staged = sum(f.numel() for f in flats
                 if f.device.type == "cpu" and f.numel() >= ZERO_COPY_MIN and f.data_ptr() % align)
    if staged >= _ALIGN_HINT_MIN:
        log_once("unaligned-live-tensors",
                 f"gdswriter: {staged / 2**20:.0f} MiB of live CPU tensors are not {align}-byte aligned, as "
                 f"O_DIRECT needs on this file system, so they are copied through the staging buffers. Start "
                 f"the process with THP_MEM_ALLOC_ENABLE=1 (torch then page-aligns large CPU tensors) to move "
                 f"them straight between memory and file, with half the CPU work", logging.INFO)


def take_snapshot(state: Any, step: int, *, copy: bool, metadata: dict | None = None) -> Snapshot:
    """Encode ``state`` and group its tensors by storage. With ``copy`` the bytes are
    cloned to host memory so the caller may mutate its tensors once this returns."""
    tree, tensors = encode_state(state)
    names, kinds = _tensor_names(tree, len(tensors))
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.is_quantized:
            raise UnsupportedObjectError(names[i], t, "quantized tensors are not supported: save t.dequantize() "
                                                      "and the quantization parameters instead")
        if t.is_conj() or t.is_neg():  # lazy conj/neg bits are not in the bytes: materialise
            t = t.resolve_conj().resolve_neg()
        tensors[i] = t
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr()) if st.nbytes() and st.data_ptr() else ("empty", i)
        groups.setdefault(key, []).append(i)
    extents: list[Extent] = []
    records: list[TensorRecord | None] = [None] * len(tensors)
    for members in groups.values():
        spans = [byte_span(tensors[i]) for i in members]
        live = [s for s, i in zip(spans, members) if tensors[i].numel()]
        lo = min(s[0] for s in live) // STORAGE_ALIGN * STORAGE_ALIGN if live else 0
        hi = max(s[1] for s in live) if live else 0
        first = tensors[members[0]]
        flat = flat_bytes(first.untyped_storage(), first.device, lo, hi - lo) if hi > lo else \
            torch.empty(0, dtype=torch.uint8)
        if copy and flat.numel():
            flat = host_copy(flat)
        sid = len(extents)
        extents.append(Extent(flat, names[members[0]]))
        for i, (start, _) in zip(members, spans):
            t = tensors[i]
            off = start - lo if t.numel() else 0
            records[i] = TensorRecord(names[i] or f"<tensor {i}>", sid, off, dtype_to_name(t.dtype), tuple(t.shape),
                                      tuple(t.stride()), str(t.device), kinds[i])
    if copy and torch.cuda.is_available():
        torch.cuda.synchronize()
    return Snapshot(step, tree, extents, records, dict(metadata or {}))  # type: ignore[arg-type]


