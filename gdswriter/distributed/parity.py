"""Parity instead of full copies (DistOptions(parity_group=G), issue 39 item 5; format.md 11).

**At open** (``plan_parity``, collective): every rank sends rank 0 its host, failure domains and
first root's id; rank 0 deals the hosts into groups of G or more (planner/replicas.py
``parity_groups``) and cuts each group into *lanes*: the i-th rank of every host of the group
(one rank per host, as torchrun numbers them, all hosts alike). Each rank receives its lane
alone (O(G), whatever the world size). A lane of one rank (a host with more ranks than every
other host of its group) is refused: nothing could protect it.

**After step S commits** (``ParityReplicator``: the Replicator's thread, group, pipeline and
outcome; only the stream differs), a lane of n members runs n - 1 rounds. Member i's bytes
(its shard, then its data files, read once and every chunk's crc32c checked as they stream)
are cut into n - 1 chunks; in round c it sends chunk c to member (i + 1 + c) mod n and receives
chunk c of member (i - 1 - c) mod n (a ``Pipeline`` of one peer each way), XORing it as it
arrives (torch.bitwise_xor on uint8) into ``step_S/parity/`` (``XorSink``): after the rounds the
block holds the XOR of stripe i, the other members' chunks that map to it. Each chunk's crc32c
is checked against its sender's trailer. The block is fdatasynced, read back for its crc32c,
renamed into place, then ``rank<R>.json`` (every member's files and crc32c values: what a
rebuild needs, on every surviving member) is written atomically and the directory fsynced.
The primary rank also sends the global manifest, whole, to the members of its lane, which
keep it as ``step_S/copies/manifest.json`` (where a restart adopts it when the primary's node
is lost, as with copies). The shards are striped with the data rather than copied whole: every
byte of a member is then covered once, at (n / (n - 1)) the bytes, and the rebuild restores a
member's shard and data files alike. The outcome settles as with copies: ``protected``.

A restore rebuilds a lost member (parityload.py).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import crc32c as _crc32c
import torch

from ..errors import ChecksumMismatchError, GDSWriterError, InvalidOptionError, ReplicationError
from ..format.commit import TMP_PREFIX, step_dir_name
from ..format.manifest import MANIFEST_NAME
from ..format.parity import PARITY_DIR, STRIPE_VERSION, chunk_lengths, parity_name, stripe_name
from ..format.replicas import COPIES_DIR, PROTECTED_NAME, parity_marker
from ..fs import atomic_write, fsync_dir
from ..planner.replicas import ReplicaPart, parity_groups
from .group import Coordinator, Transfer, describe
from .replicate import ReplicaPeers, ReplicationJob, Replicator, SourcedJob, placement_round
from .replicastream import Outgoing, Pipeline, Source
from .roots import RootLayout

log = logging.getLogger("gdswriter")
READ_BYTES = 8 << 20  # the piece a parity block is read back in, for its crc32c


@dataclass(frozen=True)
class ParityPeers(ReplicaPeers):
    """This rank's lane (``lane``: its ranks in member order, ``member``: this rank's place).
    ``part`` names the other members both ways and ``roots`` their first roots' ids: the
    manifest's ``replicas`` entry then lists, per rank, where a rebuilt copy of it may go."""

    lane: tuple[int, ...]
    member: int


def plan_parity(coord: Coordinator, layout: RootLayout, group: int, domains: Any) -> ParityPeers:
    """Collective (the module docstring): this rank's lane. Every rank raises alike:
    InvalidOptionError when the grouping is refused, or the failing ranks' errors."""
    part = placement_round(coord, layout, domains, "placing the parity groups", {"group": group},
                           lambda got: lanes_of(got, group))
    lane = tuple(int(r) for r in part["lane"])
    others = tuple(r for r in lane if r != coord.rank)
    return ParityPeers(1, ReplicaPart(coord.rank, others, others), tuple(part["roots"]), lane, lane.index(coord.rank))


def lanes_of(got: Sequence[dict], group: int) -> list[dict]:
    """Rank 0: every rank's lane, from every rank's plan_parity message."""
    asked = sorted({x["group"] for x in got})
    if len(asked) > 1:
        raise InvalidOptionError(f"the ranks ask for different parity groups ({asked}): give every rank the same "
                                 f"DistOptions(parity_group=...) (or GDSWRITER_PARITY_GROUP)")
    domains = [x["domain"] for x in got]
    try:
        plan = parity_groups([x["host"] for x in got], group, domains if any(domains) else None)
    except InvalidOptionError as e:
        raise InvalidOptionError(f"DistOptions(parity_group={group}) (GDSWRITER_PARITY_GROUP): {e}. Ranks of one "
                                 f"machine that stand for several nodes name their host in GDSWRITER_HOSTNAME") from e
    parts: list[dict] = [{}] * len(got)
    for grp in plan.groups:
        for pos in range(max(len(rs) for rs in grp.ranks)):
            lane = [rs[pos] for rs in grp.ranks if len(rs) > pos]
            if len(lane) < 2:
                raise InvalidOptionError(f"parity group {list(grp.hosts)}: host {grp.hosts[0]!r}... holds rank "
                                         f"{lane[0]}, which no other host of the group matches (one host has more "
                                         f"ranks than the rest): run as many ranks on every host, or use replicas=2")
            for r in lane:
                parts[r] = {"lane": lane, "roots": [got[p]["root"] for p in lane if p != r]}
    return parts


# ---------------------------------------------------------------------------------------------
# the stream


class Window:
    """The next ``total`` bytes of a rank's stream (``out``, read on in order across the rounds):
    what Pipeline sends in one round, with its crc32c for the trailer."""

    def __init__(self, out: Outgoing, total: int):
        self.out, self.total, self.sources = out, total, out.sources
        self.crcs = [0]

    @property
    def error(self) -> BaseException | None:
        return self.out.error

    @error.setter
    def error(self, e: BaseException | None) -> None:
        self.out.error = e

    def fill(self, buf: memoryview) -> int:
        n = self.out.fill(buf)
        self.crcs[0] = _crc32c.crc32c(buf[:n], self.crcs[0])
        return n

    def trailer(self) -> bytes:
        return json.dumps({"ok": self.out.error is None, "crcs": self.crcs,
                           "error": None if self.out.error is None else describe(self.out.error)}).encode()


class XorSink:
    """The parity block being made in ``parity_dir``: each round's chunk XORed (torch) into it as
    its pieces arrive (Pipeline's writer thread); ``publish`` puts it in place durably."""

    def __init__(self, parity_dir: Path, rank: int):
        self.final = parity_dir / parity_name(rank)
        self.tmp = parity_dir / f"{TMP_PREFIX}{parity_name(rank)}-{secrets.token_hex(4)}"
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)  # read back, XORed
        self.length, self.pos, self.crc, self.failed = 0, 0, 0, False

    def begin(self) -> None:
        self.pos, self.crc = 0, 0

    def write(self, data: memoryview) -> None:
        if self.failed:
            return
        self.crc = _crc32c.crc32c(data, self.crc)
        mine = torch.frombuffer(data, dtype=torch.uint8)
        have = os.pread(self.fd, len(data), self.pos) if self.pos < self.length else b""
        if have:
            torch.bitwise_xor(mine[:len(have)], torch.frombuffer(bytearray(have), dtype=torch.uint8),
                              out=mine[:len(have)])
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self.pos + done)
        self.pos += len(data)
        self.length = max(self.length, self.pos)

    def check(self, src: int, trailer: dict, expected: int) -> None:
        """This round's chunk, from rank ``src``, against its trailer (length and crc32c)."""
        if not trailer.get("ok"):
            raise ReplicationError(f"rank {src} could not send its chunk: {trailer.get('error')}", -1)
        if self.failed or self.pos != expected or trailer.get("crcs") != [self.crc]:
            raise ChecksumMismatchError(str(self.tmp), f"the chunk of rank {src} XORed into the parity", 0, expected,
                                        (trailer.get("crcs") or [0])[0], self.crc)

    def publish(self) -> tuple[int, int]:
        """fdatasync, read back for the crc32c, rename into place; (length, crc32c)."""
        os.fdatasync(self.fd)
        crc, pos = 0, 0
        while pos < self.length:
            piece = os.pread(self.fd, min(READ_BYTES, self.length - pos), pos)
            if not piece:
                raise GDSWriterError(f"{self.tmp} is shorter than the parity written into it")
            crc, pos = _crc32c.crc32c(piece, crc), pos + len(piece)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return self.length, crc

    def discard(self) -> None:
        self.failed = True
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


class ParityReplicator(Replicator):
    """The Replicator (replicate.py: thread, outcome, ``protected``) with the parity stream."""

    peers: ParityPeers

    def _sources(self, job: ReplicationJob | SourcedJob) -> tuple[list[Source] | None, BaseException | None]:
        """The Replicator's sources less the global manifest (kept aside: sent whole), each
        file's table root remembered for the stripe description."""
        out, error = super()._sources(job)
        if out is None:  # nothing to stream, as every rank agreed (a DCP save not written everywhere)
            return out, error
        self._global = b"".join(s.data or b"" for s in out if s.kind == "global")
        out = [s for s in out if s.kind != "global"]
        local = self.layout.local_to_global
        self._roots = [job.shard[0] if s.kind == "shard" else
                       next(local[i] for i, p in enumerate(self.layout.local_paths) if s.path.is_relative_to(p))
                       for s in out]
        return out, error

    def _mark(self, d: Path) -> dict[int, str]:
        try:
            atomic_write(d / PROTECTED_NAME, parity_marker(len(self.peers.lane)))
            return {}
        except OSError as e:
            return {self.coord.rank: f"writing {d / PROTECTED_NAME}: {describe(e)}"}

    def _stream(self, step: int, out: Outgoing) -> list[str]:
        """The rounds of the module docstring; returns what failed here."""
        me, lane, i = self.coord.rank, self.peers.lane, self.peers.member
        n, what = len(lane), f"protecting step {step} with parity"
        head = {"files": json.loads(out.header), "total": out.total, "global": len(self._global)}
        heads = {r: json.loads(b) for r, b in self._swap(step, json.dumps(head).encode(), f"{what} (headers)").items()}
        heads[me] = head
        problems: list[str] = []
        step_dir = self.layout.local_paths[0] / step_dir_name(step)
        sink: XorSink | None = None
        try:
            (step_dir / PARITY_DIR).mkdir(exist_ok=True)
            fsync_dir(step_dir)
            sink = XorSink(step_dir / PARITY_DIR, me)
        except Exception as e:  # noqa: BLE001 - reported to the primary rank; the rounds still run
            problems.append(f"its parity block: {describe(e)}")
        chunk_crcs = []
        try:
            for c in range(n - 1):
                to, frm = lane[(i + 1 + c) % n], lane[(i - 1 - c) % n]
                expected = chunk_lengths(heads[frm]["total"], n)[c]
                win = Window(out, chunk_lengths(out.total, n)[c])
                if sink is not None:
                    sink.begin()
                self._pipe = Pipeline(self.coord, step, win, [to], {frm: expected}, {frm: sink}, problems)  # type: ignore[dict-item]
                self._pipe.run()
                trailer = self._trailers(step, win, [frm], [to])[frm]  # type: ignore[arg-type]
                chunk_crcs.append(win.crcs[0])
                if sink is not None and not sink.failed:
                    try:
                        sink.check(frm, trailer, expected)
                    except Exception as e:  # noqa: BLE001 - reported to the primary rank
                        sink.discard()
                        problems.append(f"the chunk of rank {frm}: {describe(e)}")
            self._describe(step, out, heads, chunk_crcs, sink, problems)
        except BaseException:
            if sink is not None:
                sink.discard()
            raise
        finally:
            out.close()
        return problems

    def _describe(self, step: int, out: Outgoing, heads: dict, chunk_crcs: list[int], sink: XorSink | None,
                  problems: list[str]) -> None:
        """Every member's summary to every other; the block and ``rank<R>.json`` put in place; the
        global manifest from the primary rank to its lane."""
        me, lane = self.coord.rank, self.peers.lane
        what = f"protecting step {step} with parity"
        mine = {"rank": me, "files": heads[me]["files"], "roots": self._roots, "total": out.total,
                "file_crcs": out.crcs, "chunk_crcs": chunk_crcs, "ok": out.error is None}
        got = {r: json.loads(b) for r, b in self._swap(step, json.dumps(mine).encode(), f"{what} (summaries)").items()}
        got[me] = mine
        glob = self._swap_global(step, heads, f"{what} (global manifest)")
        if sink is None or sink.failed:
            return
        step_dir = self.layout.local_paths[0] / step_dir_name(step)
        try:
            bad = [r for r in lane if not got[r]["ok"]]
            if bad:
                raise GDSWriterError(f"ranks {bad} could not read their own files")
            length, crc = sink.publish()
            body = {"version": STRIPE_VERSION, "step": step, "lane": list(lane), "members": [got[r] for r in lane],
                    "parity": {"rank": me, "stripe": self.peers.member, "length": length, "crc32c": crc,
                               "file": parity_name(me)}}
            atomic_write(step_dir / PARITY_DIR / stripe_name(me), json.dumps(body).encode())
            if glob is not None:
                (step_dir / COPIES_DIR).mkdir(exist_ok=True)
                fsync_dir(step_dir)
                atomic_write(step_dir / COPIES_DIR / MANIFEST_NAME, glob)
        except Exception as e:  # noqa: BLE001 - reported to the primary rank
            sink.discard()
            problems.append(f"its parity block: {describe(e)}")

    def _swap(self, step: int, data: bytes, what: str) -> dict[int, bytes]:
        """``data`` to every other member of the lane; theirs back (sizes, then bytes)."""
        me, others = self.coord.rank, [r for r in self.peers.lane if r != self.coord.rank]
        sizes = {r: torch.zeros(1, dtype=torch.int64) for r in others}
        mine = torch.tensor([len(data)], dtype=torch.int64)
        self.coord.exchange([Transfer(me, r, 0, mine) for r in others] +
                            [Transfer(r, me, 0, sizes[r]) for r in others], f"{what} (sizes)")
        bufs = {r: torch.zeros(max(int(sizes[r][0]), 1), dtype=torch.uint8) for r in others}
        body = torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)
        self.coord.exchange([Transfer(me, r, 1, body) for r in others] +
                            [Transfer(r, me, 1, bufs[r]) for r in others], what)
        return {r: bytes(bufs[r][:int(sizes[r][0])].numpy()) for r in others}

    def _swap_global(self, step: int, heads: dict, what: str) -> bytes | None:
        """The global manifest from the member that has it (the primary rank) to the others."""
        me = self.coord.rank
        src = next((r for r in self.peers.lane if heads[r]["global"]), None)
        if src is None:
            return None
        if src == me:
            self.coord.exchange([Transfer(me, r, 2, torch.frombuffer(bytearray(self._global), dtype=torch.uint8))
                                 for r in self.peers.lane if r != me], what)
            return None
        buf = torch.zeros(int(heads[src]["global"]), dtype=torch.uint8)
        self.coord.exchange([Transfer(src, me, 2, buf)], what)
        return bytes(buf.numpy())


def replicator_for(channel: Coordinator, layout: RootLayout, peers: ReplicaPeers) -> Replicator:
    """The Replicator a session's peers call for: parity lanes or full copies."""
    return ParityReplicator(channel, layout, peers) if isinstance(peers, ParityPeers) else Replicator(channel, layout,
                                                                                                       peers)

