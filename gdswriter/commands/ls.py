"""`gdswriter ls`: the committed steps of each root."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatVersionError
from ..format.commit import LATEST_NAME, TMP_PREFIX, TRASH_PREFIX, CommitProtocol, step_dirs
from ..format.copies import damaged_entries, refilling_marker
from ..format.manifest import MANIFEST_NAME
from ..format.parity import protected_parity
from ..format.replicas import protected_copies
from ..format.sharded import parse_global
from ..load.reader import read_manifest_bytes
from ..units import human
from ._common import EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, load_manifest, out, secondary_owner, table, when


def register(sub) -> None:
    sp = sub.add_parser("ls", help="list committed steps", description="List the committed steps of each ROOT "
                        "with their size on disk (the bytes each save wrote: data files, shards, manifest), number of "
                        "tensors and creation time, their state (committed, or protected: every copy on peer nodes "
                        "durable) and copies; mark the latest.")
    sp.add_argument("roots", metavar="ROOT", nargs="+")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=run)


def _summary(protocol: CommitProtocol, step: int) -> tuple[int, int, float, str, int]:
    """(bytes on disk, tensors, created, format version, copies planned) of a committed step. A
    1.3 step's are in its global manifest (its shards may be on other nodes' roots: ls reads
    only this root)."""
    raw = read_manifest_bytes(protocol, step)
    g = parse_global(raw, str(protocol.step_dir(step) / MANIFEST_NAME))
    if g is not None:
        v = g.version
        copies = 1 + max(map(len, g.replicas), default=0) if g.replicas is not None else 1
        return int(g.totals.get("on_disk", 0)) + len(raw), int(g.totals.get("tensors", 0)), g.created_unix, \
            f"{v[0]}.{v[1]}", copies
    _, m, mbytes = load_manifest(protocol, step)
    return (sum(f.size for f in m.files) + mbytes, len(m.tensors), m.created_unix, f"{m.version[0]}.{m.version[1]}",
            1)


def _state(protocol: CommitProtocol, step: int, copies: int) -> tuple[str, str]:
    """(state, what the STATE column shows): "protected" once its ``protected`` marker is in (every
    copy durable), else "committed" (with the copies it waits for where it was saved with replicas,
    or, noted, the refill it waits for)."""
    done = protected_copies(protocol.step_dir(step))
    parity = protected_parity(protocol.step_dir(step)) if done is not None else None
    if parity is not None:
        return "protected", f"protected (parity, groups of {parity})"
    if done is not None:
        return "protected", f"protected ({done} copies)"
    if refilling_marker(protocol.step_dir(step)) is not None:  # verify --repair (or a parity refill) withdrew it
        return "committed", "committed (refill pending: the next multi-rank load re-creates a copy or block)"
    return "committed", "committed" if copies == 1 else f"committed (0/{copies - 1} copies)"


def _written(items: list[dict]) -> None:
    """The bytes the listed steps wrote (SIZE: each step's data files, shards and manifest, all
    ranks'), for the drives' endurance (gdswriter doctor reports what they have left)."""
    sizes = [i["bytes"] for i in items if "bytes" in i]
    if len(sizes) > 1:
        out(f"  written: {human(sum(sizes))} by the {len(sizes)} steps listed, {human(sum(sizes) / len(sizes))} "
            f"per step on average")


def run(args) -> int:
    rc = EXIT_OK
    report = []
    for i, root in enumerate(args.roots):
        p = Path(root)
        entry: dict[str, Any] = {"root": str(p), "steps": [], "latest": None}
        report.append(entry)
        if not args.json and len(args.roots) > 1:
            out(("" if i == 0 else "\n") + f"{p}:")
        if not p.is_dir():
            what = "does not exist" if not p.exists() else "is not a directory"
            print(f"gdswriter: error: checkpoint root {p} {what}", file=sys.stderr)
            entry["error"] = what
            rc = max(rc, EXIT_USAGE)
            continue
        protocol = CommitProtocol([p])
        steps = protocol.committed_steps()
        latest = protocol.latest()
        entry["latest"] = latest
        rows = [["STEP", "SIZE", "TENSORS", "CREATED", "STATE", ""]]
        for s in steps:
            item: dict[str, Any] = {"step": s, "latest": s == latest}
            try:
                nbytes, tensors, created, version, copies = _summary(protocol, s)
                state, shown = _state(protocol, s, copies)
                item.update(bytes=nbytes, tensors=tensors, created_unix=created, created=when(created), version=version,
                            state=state, copies=copies)
                rows.append([s, human(nbytes), tensors, when(created), shown, "latest" if s == latest else ""])
            except CheckpointNotFoundError:
                continue  # deleted while listing
            except (CorruptCheckpointError, UnsupportedFormatVersionError) as e:
                item["error"] = str(e)
                what = "NEWER FORMAT" if isinstance(e, UnsupportedFormatVersionError) else "DAMAGED"
                rows.append([s, "-", "-", "-", "-", f"{what}: {e}"])
                rc = max(rc, EXIT_CORRUPT)
            entry["steps"].append(item)
        leftovers = sorted(n for n in os.listdir(p) if n.startswith((TMP_PREFIX, TRASH_PREFIX)))
        entry["leftovers"] = leftovers
        entry["damaged"] = damaged = [str(x) for _, d in step_dirs(p) for x in damaged_entries(d)]
        if args.json:
            continue
        if steps:
            for line in table(rows, right={0, 1, 2}):
                out(line)
            _written(entry["steps"])
        else:
            owner = secondary_owner(p)
            if owner:
                out(f"  no committed steps: {p} is a secondary root of {owner}; list that root instead")
            else:
                out("  no committed steps")
        named = protocol.latest_named()
        if named is not None and named != latest:
            out(f"  note: '{LATEST_NAME}' names step {named}, which is not committed; the newest committed "
                f"step counts as latest")
        if leftovers:
            out(f"  note: {len(leftovers)} leftover(s) of interrupted saves or deletions "
                 f"({', '.join(leftovers[:3])}{', ...' if len(leftovers) > 3 else ''}); the next "
                 f"GDSCheckpointer opening this root removes them")
        if damaged:
            out(f"  note: {len(damaged)} damaged cop{'ies or parity blocks' if len(damaged) != 1 else 'y or parity block'}"
                f" set aside by gdswriter verify --repair ({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}"
                f"); the next multi-rank load's refill re-creates them and then removes these; else they go with "
                f"their step")
    if args.json:
        out(json.dumps(report, indent=2))
    return rc
