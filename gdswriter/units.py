"""Byte sizes and rates as people write and read them ('4G', '1.50 GiB', GB/s)."""

from __future__ import annotations

import math
import re

from .errors import InvalidOptionError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def parse_size(text: str) -> int:
    """'4G' -> 4 GiB. Suffixes K, M, G, T (binary; 'KiB'/'KB'/'k' accepted alike); decimals allowed."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise InvalidOptionError(f"size {text!r} is not understood: use a number with an optional K, M, G or T suffix "
                          f"(binary units, e.g. 64M, 4G)")
    mult = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB}[m.group(2).lower()]
    value = int(float(m.group(1)) * mult)
    if value <= 0:
        raise InvalidOptionError(f"size {text!r} must be positive")
    return value


def human(n: float) -> str:
    """Bytes in binary units: '1.50 GiB'."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf
