"""Reading a committed step's manifest in a test, whatever its format: a 1.3 multi-rank step's
global manifest and its shards come back merged into one Manifest (format/sharded.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence


def step_manifest(roots: str | os.PathLike | Sequence[str | os.PathLike], step: int):
    """The Manifest of committed ``step`` under ``roots`` (the primary first; every root the step's
    shards and files are on), through the reader every load uses."""
    from gdswriter.format.commit import CommitProtocol, normalize_roots
    from gdswriter.load.reader import parse_manifest, read_manifest_bytes

    protocol = CommitProtocol(normalize_roots(roots))
    return parse_manifest(protocol, step, read_manifest_bytes(protocol, step))
