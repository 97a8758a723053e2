"""Threads that saving and loading share: ``run_per_file`` runs one piece of I/O work per
file (or per root), in parallel threads where the files are on different engines.

Below save/ and load/, which both use it: it imports nothing from gdswriter.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor


def run_per_file(fn, file_ids: Sequence[int], parallel: int) -> list:
    """Run ``fn`` for each file; files on different engines run in parallel threads."""
    if parallel <= 1 or len(file_ids) <= 1:
        return [fn(f) for f in file_ids]
    with ThreadPoolExecutor(max_workers=min(parallel, len(file_ids)), thread_name_prefix="gdswriter-file") as ex:
        return list(ex.map(fn, file_ids))
