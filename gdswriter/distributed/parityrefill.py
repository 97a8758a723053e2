"""The parity block of a replaced lane member, re-created after a load (format.md 11.1, 11.2).

A load that found a lane member's root lost rebuilt that member's files from its lane into a copy
(parityload.py); the lane still lacks the member's own files on its node and the parity block the
member stored (its stripe), so a second member lost would be fatal. The refill (refill.py) copies
the member's files from the rebuilt copy onto its replacement root, and this module re-creates
the stripe there, collectively on the replication group:

1. each rank reads the stripe descriptions (``step_S/parity/rank<K>.json``) on the roots it leads
   and reports, for each lane holding a lost rank, the description of its lowest surviving
   member; the primary rank decides, per lost rank R, the rank reading each surviving member k
   (the lowest rank seeing k's own root);
2. each reader streams, in pieces, chunk (i_R - i_k - 1) mod n of member k's stream (zero padded
   to the longest): the chunk that stripe R covers. The leader of R's new root checks every chunk
   against the crc32c recorded at save, XORs them (torch.bitwise_xor), writes the block under a
   temporary name, fsyncs it, reads it back against the crc32c of what it computed, renames it to
   ``parity/rank<R>.xor`` and fsyncs the directory, and then writes
   ``parity/rank<R>.json`` (fs.atomic_write): a description follows a durable block, as at save.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from collections.abc import Callable, Sequence

import crc32c as _crc32c
import torch

from ..errors import ChecksumMismatchError, CollectiveFailedError, GDSWriterError
from ..format.commit import TMP_PREFIX, step_dir_name
from ..format.parity import PARITY_DIR, chunk_lengths, parity_name, read_stripe, stripe_name
from ..format.sharded import GlobalManifest
from ..fs import atomic_write, fsync_dir, fsync_file
from .group import Coordinator, Transfer, describe
from .loadplan import reach_of
from .parityload import StepRoots, read_stream
from .replicastream import PIECE_BYTES
from .roots import RootLayout

READ_BYTES = 8 << 20  # the piece a written block is read back in


def refill_stripes(coord: Coordinator, layout: RootLayout, g: GlobalManifest, targets: dict[int, tuple[int, str]],
                   what: str, src: int) -> list[str]:
    """Collective (the module docstring): the stripe of each lost rank R of ``targets`` (R ->
    (the rank writing it, its new root's id)) re-created; what failed on this rank."""
    seen = {info.id: tuple(info.ranks) for info in layout.table}

    def step_dir(r: int) -> Path:
        return layout.local_paths[layout.local_ids.index(targets[r][1])] / step_dir_name(g.step)
    return refill_lane_stripes(coord, StepRoots(g.step, tuple(g.roots)), reach_of(g, layout), seen,
                               lambda k: g.shards[k].root, {r: w for r, (w, _) in targets.items()}, step_dir, what,
                               src)


def refill_lane_stripes(coord: Coordinator, g: StepRoots, reach: Sequence[Path | None],
                        seen: dict[str, tuple[int, ...]], own_root: Callable[[int], int], writers: dict[int, int],
                        step_dir: Callable[[int], Path], what: str, src: int) -> list[str]:
    """``refill_stripes`` over a step's table of roots (a 1.3 global manifest's, or a DCP step's
    1.2 ``dist.roots``: dcp_refill.py): ``reach`` this rank's path of each root, ``seen`` root id
    -> the ranks seeing it, ``own_root(k)`` the root rank k's files are on, ``writers`` lost rank
    R -> the rank writing its stripe, ``step_dir(R)`` (on that rank) the step's directory on R's
    new root."""
    mine: list = []
    error: BaseException | None = None
    try:
        mine = _lanes_held(coord, g, reach, seen, set(writers))
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    plan = coord.decide(error, mine, f"{what} (finding the lanes of the lost ranks)",
                        lambda outs: _plan(g, seen, own_root, writers, outs), root=src)
    problems: list[str] = []
    for entry in plan:
        try:
            _stripe(coord, g, reach, entry, step_dir, what)
        except CollectiveFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the primary rank
            problems.append(f"rank {entry['rank']}'s parity block: {describe(e)}")
    return problems


def _lanes_held(coord: Coordinator, g: StepRoots, reach: Sequence[Path | None], seen: dict,
                lost: set[int]) -> list[dict]:
    """The descriptions, on the roots this rank leads, of the lowest surviving member of each lane
    holding a lost rank."""
    out = []
    for info, p in zip(g.roots, reach):
        ranks = seen.get(info.id)
        d = None if p is None else p / step_dir_name(g.step) / PARITY_DIR
        if d is None or not ranks or min(ranks) != coord.rank or not d.is_dir():
            continue
        for f in sorted(d.glob("rank*.json")):
            body = read_stripe(f)
            alive = [r for r in body["lane"] if r not in lost]
            if lost & set(body["lane"]) and alive and body["parity"]["rank"] == min(alive):
                out.append(body)
    return out


def _plan(g: StepRoots, seen: dict, own_root: Callable[[int], int], writers: dict[int, int],
          outs: list) -> list[dict]:
    """The primary rank: per lost rank, its lane's description and who reads each member."""
    plan = []
    for r in sorted(writers):
        body = next((b for out in outs for b in out if r in b["lane"]), None)
        if body is None:
            raise GDSWriterError(f"no stripe description of rank {r}'s parity lane is left on its surviving members")
        readers = []
        for k in body["lane"]:
            ranks = seen.get(g.roots[own_root(k)].id) if k != r else None
            if k != r and not ranks:
                raise GDSWriterError(f"rank {k}, a member of rank {r}'s parity lane, is lost too")
            if k != r:
                readers.append([k, min(ranks)])  # type: ignore[type-var]
        plan.append({"rank": r, "writer": writers[r], "body": body, "readers": readers})
    return plan


def _stripe(coord: Coordinator, g: StepRoots, reach: Sequence[Path | None], entry: dict,
            step_dir: Callable[[int], Path], what: str) -> None:
    """One lost rank's stripe (step 2 of the module docstring): every reader and the writer run
    every piece's exchange, a local failure sending zeros and raising at the end."""
    r, me, body, writer = entry["rank"], coord.rank, entry["body"], entry["writer"]
    lane = body["lane"]
    parts = _parts(body, r, {k for k, reader in entry["readers"] if reader == me}, reach, g.step)
    length = max(p[2] for p in parts.values())
    problem: BaseException | None = None
    crcs = {k: 0 for k in parts}
    sink = None
    if me == writer:
        try:
            sink = _Block(step_dir(r), r)
        except Exception as e:  # noqa: BLE001 - the exchange goes on; raised below
            problem = e
    try:
        for x in range(0, length, PIECE_BYTES):
            size = min(PIECE_BYTES, length - x)
            bufs = {k: torch.zeros(size, dtype=torch.uint8) for k, reader in entry["readers"]
                    if reader == me or me == writer}
            for k, reader in entry["readers"]:
                if reader == me and problem is None:
                    files, start, n_k, _ = parts[k]
                    try:
                        read_stream(files, start + x, memoryview(bufs[k].numpy())[:max(0, min(size, n_k - x))])
                    except Exception as e:  # noqa: BLE001 - the exchange goes on; raised below
                        problem = e
            coord.exchange([Transfer(reader, writer, 2000 + lane.index(k), bufs.get(k, torch.empty(0)))
                            for k, reader in entry["readers"]], f"{what} (rank {r}'s parity block)")
            if sink is None or problem is not None:
                continue
            block = torch.zeros(size, dtype=torch.uint8)
            for k in parts:
                crcs[k] = _crc32c.crc32c(memoryview(bufs[k].numpy())[:max(0, min(size, parts[k][2] - x))], crcs[k])
                torch.bitwise_xor(block, bufs[k], out=block)
            sink.write(memoryview(block.numpy()))
        if problem is not None:
            raise problem
        if sink is not None:
            bad = [k for k in parts if crcs[k] != parts[k][3]]
            if bad:
                raise GDSWriterError(f"the chunk of rank {bad[0]} read for rank {r}'s parity block does not match "
                                     f"the crc32c recorded at save ({crcs[bad[0]]:#010x}, recorded "
                                     f"{parts[bad[0]][3]:#010x}): that member's files are damaged")
            length, crc = sink.publish()
            stripe = {**body, "parity": {"rank": r, "stripe": lane.index(r), "length": length, "crc32c": crc,
                                         "file": parity_name(r)}}
            atomic_write(sink.final.parent / stripe_name(r), json.dumps(stripe).encode())
    finally:
        if sink is not None:
            sink.discard()


def _parts(body: dict, r: int, reading: set[int], reach: Sequence[Path | None], step: int) -> dict:
    """Per surviving member k of ``body``'s lane: (its files where this rank reads them, else
    none; where its chunk of stripe r starts in its stream; the chunk's length; its crc32c)."""
    lane = body["lane"]
    n, i_r = len(lane), lane.index(r)
    parts = {}
    for i_k, k in enumerate(lane):
        if k == r:
            continue
        m = body["members"][i_k]
        lens, c = chunk_lengths(int(m["total"]), n), (i_r - i_k - 1) % n
        files = [(reach[int(root)] / step_dir_name(step) / name, int(size))  # type: ignore[operator]
                 for (_, name, size), root in zip(m["files"], m["roots"])] if k in reading else []
        parts[k] = (files, c * lens[0], lens[c], int(m["chunk_crcs"][c]))
    return parts


def blocks_held(parity_dir: Path) -> tuple[set[int], set[int]]:
    """(the lane members the stripe descriptions in ``parity_dir`` name, the ranks whose block
    is there with the length its description records): what a refill re-creates is the
    difference (a description unreadable counts as its block missing; its lane is named by the
    other members')."""
    lanes: set[int] = set()
    have: set[int] = set()
    for f in sorted(parity_dir.glob("rank*.json")) if parity_dir.is_dir() else ():
        try:
            body = read_stripe(f)
            lanes.update(int(k) for k in body["lane"])
            if os.stat(parity_dir / parity_name(int(body["parity"]["rank"]))).st_size == int(body["parity"]["length"]):
                have.add(int(body["parity"]["rank"]))
        except (OSError, GDSWriterError, KeyError, TypeError, ValueError):
            continue
    return lanes, have


class _Block:
    """Rank ``rank``'s parity block being re-created in ``step_dir/parity``, under a temporary
    name until ``publish``: fsynced, read back against the crc32c of what was written, renamed."""

    def __init__(self, step_dir: Path, rank: int):
        d = step_dir / PARITY_DIR
        if not d.is_dir():
            d.mkdir()
            fsync_dir(step_dir)
        self.final = d / parity_name(rank)
        self.tmp = d / f"{TMP_PREFIX}{parity_name(rank)}-{secrets.token_hex(4)}"
        self.f = open(self.tmp, "xb")  # noqa: SIM115 - closed by publish or discard
        self.crc, self.length = 0, 0

    def write(self, data: memoryview) -> None:
        self.f.write(data)
        self.crc, self.length = _crc32c.crc32c(data, self.crc), self.length + len(data)

    def publish(self) -> tuple[int, int]:
        self.f.close()
        fsync_file(self.tmp)
        got = 0
        with open(self.tmp, "rb", buffering=0) as back:
            while piece := back.read(READ_BYTES):
                got = _crc32c.crc32c(piece, got)
        if got != self.crc:
            raise ChecksumMismatchError(str(self.tmp), "the re-created parity block read back", 0, self.length,
                                        self.crc, got)
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return self.length, self.crc

    def discard(self) -> None:
        """After publish: nothing; else the temporary file removed."""
        self.f.close()
        self.tmp.unlink(missing_ok=True)
