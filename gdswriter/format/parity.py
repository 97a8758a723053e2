"""Names on disk and the stripe arithmetic of steps protected by parity (DistOptions(parity_group=G),
format.md section 11), without torch: distributed/parity.py writes them, distributed/parityload.py
reads them.

A member rank R of a parity lane (planner/replicas.py parity groups, one rank per host of the
group at each position) keeps ``step_S/parity/rank<R>.xor``, the XOR of stripe R's chunks of the
other members (zero padded to the longest), and ``step_S/parity/rank<R>.json``, written after it:
the lane, every member's files ([kind, name, size], table root of each, crc32c of each file and of
each of its n - 1 chunks) and the parity block's length and crc32c. A member's bytes are its shard
then its data files, concatenated in that order, cut into n - 1 chunks of ``chunk_lengths``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CorruptCheckpointError, GDSWriterError
from ..fs import name_problem, read_regular_file
from ..options import ALIGN

PARITY_DIR = "parity"
REFILLING_NAME = "refilling"  # step_S/parity/refilling: the group's marker while the step lacks a member's block
STRIPE_VERSION = 1
STRIPE_MAX_BYTES = 64 << 20


def parity_name(rank: int) -> str:
    """The parity block rank ``rank`` stores (5 digits, as shard names)."""
    return f"rank{rank:05d}.xor"


def stripe_name(rank: int) -> str:
    """The description of that block and of its lane."""
    return f"rank{rank:05d}.json"


def chunk_lengths(total: int, n: int) -> list[int]:
    """The lengths of the n - 1 chunks a member of ``total`` bytes is cut into (the last ones
    shorter or empty): planner/replicas.py chunk_bytes, unaligned."""
    per = -(-total // (n - 1)) if n > 1 else total
    return [max(0, min(per, total - c * per)) for c in range(max(n - 1, 1))]


def protected_parity(step_dir: Path, name: str = "protected") -> int | None:
    """The group size a ``protected`` marker written by parity records (None: no marker, or
    one of full copies); ``name``: another file of the marker's body (``refilling_parity``)."""
    try:
        body = json.loads(read_regular_file(step_dir / name, 4096))
    except (OSError, GDSWriterError, ValueError):
        return None
    n = body.get("parity_group") if isinstance(body, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None


def refilling_parity(step_dir: Path) -> int | None:
    """The group size ``step_dir/parity/refilling`` records: the note a parity refill (or the
    scrub, load/verify.py ``set_aside``) writes before it withdraws ``protected``, so the step
    keeps its group while it lacks a member's files or block (None: no note, or not one
    gdswriter wrote)."""
    return protected_parity(step_dir / PARITY_DIR, REFILLING_NAME)


def stream_size(size: int) -> int:
    """The bytes a member's file of ``size`` bytes takes in its striped stream: whole ALIGN
    blocks, zero padded (the replication stream's layout, distributed/replicastream.py)."""
    return -(-size // ALIGN) * ALIGN


def read_stripe(path: Path) -> dict:
    """A ``rank<R>.json``, parsed and checked for the keys a rebuild reads (untrusted input:
    CorruptCheckpointError when it is not one gdswriter wrote)."""
    try:
        body = json.loads(read_regular_file(path, STRIPE_MAX_BYTES))
        lane = [int(r) for r in body["lane"]]
        members = body["members"]
        if body.get("version") != STRIPE_VERSION or len(members) != len(lane) or len(lane) < 2:
            raise ValueError("its lane and members do not match")
        for m in members:
            n_files = len(m["files"])
            if any(name_problem(f[1]) is not None for f in m["files"]):  # each is opened in its step's directory
                raise ValueError("a member's file name is not a plain name")
            if len(m["roots"]) != n_files or len(m["file_crcs"]) != n_files or \
                    len(m["chunk_crcs"]) != len(lane) - 1 or sum(stream_size(int(f[2])) for f in m["files"]) != int(m["total"]):
                raise ValueError("a member's entry is inconsistent")
        int(body["parity"]["length"]), int(body["parity"]["crc32c"])
        if body["parity"]["file"] != parity_name(int(body["parity"]["rank"])):  # a path a rebuild opens
            raise ValueError("its parity block's file name is not the one its rank writes")
        return body
    except (ValueError, KeyError, TypeError, IndexError, GDSWriterError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{path} is not a parity description gdswriter wrote ({e}): the step's parity "
                                     f"is damaged; load an earlier step (load(fallback=True))") from e
