"""Stable on-disk names for torch dtypes.

A dtype's name is what ``str(dtype)`` gives minus ``"torch."`` (``"float32"``,
``"bfloat16"``, ``"float8_e4m3fn"``): one canonical name per dtype, never an
alias such as ``"float"`` or ``"half"``. The table is built from the dtypes the
installed torch exposes, so new dtypes are covered without code changes.
"""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError


def _build_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    # vars() rather than dir()+getattr: never triggers torch's lazy submodule imports.
    for value in list(vars(torch).values()):
        if isinstance(value, torch.dtype):
            name = str(value).removeprefix("torch.")
            table[name] = value
    return dict(sorted(table.items()))


_BY_NAME: dict[str, torch.dtype] = _build_table()
_BY_DTYPE: dict[torch.dtype, str] = {d: n for n, d in _BY_NAME.items()}


def dtype_to_name(dtype: torch.dtype) -> str:
    """Canonical name of ``dtype`` (e.g. ``torch.half`` -> ``"float16"``)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {type(dtype).__qualname__}")
    try:
        return _BY_DTYPE[dtype]
    except KeyError:  # not exposed on the torch module; should not happen
        raise ValueError(f"{dtype} is not a dtype exposed by the torch module") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_name`; unknown names mean a damaged (or too new) checkpoint."""
    if not isinstance(name, str):
        raise CorruptCheckpointError(f"dtype name must be a string, got {type(name).__qualname__}")
    try:
        return _BY_NAME[name]
    except KeyError:
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise CorruptCheckpointError(
            f"unknown dtype name {shown!r} in checkpoint: it is damaged, or was written by a torch "
            f"with dtypes this torch {torch.__version__} lacks") from None


def all_dtypes() -> list[torch.dtype]:
    """Every distinct dtype torch exposes, sorted by name."""
    return list(_BY_NAME.values())
