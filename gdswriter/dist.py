"""Deprecated name of gdswriter.distributed (the multi-rank package), kept so that code written
as ``from gdswriter.dist import GDSStorageWriter`` goes on working; it warns once. Import from
``gdswriter`` (GDSStorageWriter, GDSStorageReader, DistOptions) or ``gdswriter.distributed``."""

from __future__ import annotations

import importlib
import warnings

_NAMES = ("DistOptions", "GDSStorageReader", "GDSStorageWriter", "load_state")


def __getattr__(name: str):
    if name in _NAMES:
        warnings.warn("gdswriter.dist is now gdswriter.distributed: import from gdswriter or gdswriter.distributed",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("gdswriter.distributed"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
