"""What the CLI's commands share: exit codes, output, opening roots and manifests."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from ..errors import CheckpointNotFoundError, UsageError
from ..format.commit import CommitProtocol, step_dirs, normalize_roots, step_owner
from ..format.manifest import Manifest

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2


def when(unix: float) -> str:
    if not unix:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def table(rows: Sequence[Sequence[Any]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    rows = [[str(c) for c in r] for r in rows]
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    lines = []
    for r in rows:
        cells = [(c.rjust(widths[i]) if i in right else c.ljust(widths[i])) for i, c in enumerate(r)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def out(text: str = "") -> None:
    print(text, flush=False)


def open_roots(primary: str, secondary: Sequence[str] = ()) -> list[Path]:
    paths = normalize_roots([primary, *secondary])
    for p in paths:
        if not p.exists():
            raise CheckpointNotFoundError(errno.ENOENT, f"checkpoint root {p} does not exist")
        if not p.is_dir():
            raise UsageError(f"checkpoint root {p} is not a directory")
    return paths


def load_manifest(protocol: CommitProtocol, step: int | None) -> tuple[int, Manifest, int]:
    """Resolve ``step`` (None: latest) and parse its manifest: (step, manifest, manifest bytes)."""
    from ..load.reader import parse_manifest, read_manifest_bytes

    step = protocol.require(step)
    try:
        raw = read_manifest_bytes(protocol, step)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(errno.ENOENT, f"step {step} under {protocol.primary} disappeared while it "
                                                    f"was being opened (deleted by a running checkpointer?)") from None
    return step, parse_manifest(protocol, step, raw), len(raw)


def check_roots(protocol: CommitProtocol, step: int, m: Manifest) -> None:
    need = 1 + max((f.root for f in m.files), default=0)
    if need > len(protocol.roots):
        raise UsageError(f"step {step} keeps data files on {need} roots (one per SSD), but only "
                          f"{len(protocol.roots)} given: pass the others with --secondary DIR, in the order "
                          f"the checkpointer was given them")


def secondary_owner(root: Path) -> str | None:
    """If ``root`` holds secondary step directories, the primary root they name (None also
    when ``root`` cannot be listed: this only adds a hint to ``ls``)."""
    try:
        found = step_dirs(root)
    except OSError:
        return None
    for _, d in found:
        path, _ = step_owner(d)
        if path:
            return path
    return None


def is_contiguous(rec) -> bool:
    expect = 1
    for n, s in reversed(list(zip(rec.shape, rec.stride))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def tensor_ranges(m: Manifest, rec) -> list[tuple[int, int, int]]:
    """[(file index, begin, end)] of the file bytes holding tensor ``rec``."""
    lo, hi = rec.byte_extent()
    out = []
    for c in m.storages[rec.storage].chunks:
        a, b = max(lo, c.storage_offset), min(hi, c.storage_offset + c.length)
        if b > a:
            out.append((c.file, c.file_offset + a - c.storage_offset, c.file_offset + b - c.storage_offset))
    return out


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def item_size(dtype_name: str) -> int:
    from ..format.dtypes import dtype_from_name

    return dtype_from_name(dtype_name).itemsize




def add_roots_argument(sp) -> None:
    sp.add_argument("root", metavar="ROOT", help="checkpoint root (the primary one if saved to several)")
    sp.add_argument("--secondary", metavar="DIR", action="append", default=[],
                    help="another root of a checkpoint saved to several (one per SSD); repeat, in the "
                         "order the checkpointer was given them")


def yes_no(b: bool) -> str:
    return "yes" if b else "no"
