"""Format 1.4's names on disk for the copies of a step on peer nodes (format.md section 11):
``step_S/copies/rank<R>/`` (a rank's copied shard and data files), ``step_S/copies/manifest.json``
(the global manifest's copy) and the ``protected`` markers, read here without torch (ls reads
them); distributed/replicate.py writes them."""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Sequence

from ..errors import GDSWriterError
from ..fs import read_regular_file
from .commit import step_dir_name

COPIES_DIR = "copies"
PROTECTED_NAME = "protected"


def copy_dir_name(rank: int) -> str:
    """The directory of rank ``rank``'s copy in ``step_S/copies`` (5 digits, as shard names)."""
    return f"rank{rank:05d}"


def protected_marker(copies: int) -> bytes:
    """The bytes of a ``protected`` marker."""
    return json.dumps({"copies": copies}).encode() + b"\n"


def parity_marker(group: int) -> bytes:
    """The bytes of a ``protected`` marker of a step protected by parity groups of ``group``."""
    return json.dumps({"copies": 1, "parity_group": group}).encode() + b"\n"


def protected_copies(step_dir: Path) -> int | None:
    """The copies ``step_dir/protected`` records (None: no marker, or not one gdswriter wrote)."""
    try:
        body = json.loads(read_regular_file(step_dir / PROTECTED_NAME, 4096))
    except (OSError, GDSWriterError, ValueError):
        return None
    c = body.get("copies") if isinstance(body, dict) else None
    return c if isinstance(c, int) and not isinstance(c, bool) and c > 0 else None


def newest_protected(primary: Path, steps: Sequence[int]) -> int | None:
    """The newest of the committed ``steps`` whose primary step directory under ``primary``
    holds a ``protected`` marker."""
    for s in sorted(steps, reverse=True):
        if protected_copies(primary / step_dir_name(s)) is not None:
            return s
    return None
