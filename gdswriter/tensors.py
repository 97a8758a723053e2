"""Tensor helpers that saving and loading share: ``flat_bytes`` (a flat uint8 view of a
storage's bytes, what the engines read and write), ``hint_unaligned`` (the one-time hint
when large live CPU tensors miss zero-copy O_DIRECT for their alignment) and ``to_device``
(a loaded state moved where a framework asked for it: the integrations' map_location).

Below save/ and load/, which both use it: it imports only the engines, options and torch,
never gdswriter.save, gdswriter.load or anything above them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .engines.base import EngineInfo
from .engines.staged import ZERO_COPY_MIN
from ._log import log_once
from .options import EngineOptions


def flat_bytes(storage: torch.UntypedStorage, device: torch.device, start: int, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))


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


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples moved to ``device``; dict
    subclasses (OrderedDict state dicts, Lightning's AttributeDict) keep their type and a
    state dict's ``_metadata``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if type(obj) is dict:
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, dict):
        out = type(obj)((k, to_device(v, device)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
