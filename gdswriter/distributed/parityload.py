"""Rebuilding a lost member of a parity lane at load time (DistOptions(parity_group=G), parity.py).

A step protected by parity lists, in its manifest's ``replicas`` entry, the roots of each rank's
lane peers: where a rebuilt copy of its files may go. When a load finds a rank's own root seen
by no rank of the job (its node lost or replaced) and falls back to the copies
(loadcopies.verified_copies), ``rebuild_lost`` first makes that copy, collectively:

1. each rank reads the stripe descriptions (``step_S/parity/rank<R>.json``) on the roots it
   leads, and reports those whose lane holds a lost rank to the primary rank, which decides,
   for each lost rank, the rebuilder (the lowest rank seeing the first of its copy roots that
   some rank sees and its leader can write) and the rank reading each surviving member. Where
   no such root can be written (every one read-only), the copy is held in memory instead
   (``HeldCopies``: a tmpfs directory, /dev/shm, on the lost rank's own host when it is in
   the job, else on the lowest rank seeing its lane; as many bytes as that rank's files),
   for this load only: nothing is written on any root, and the step cannot be refilled (a
   warning says so). A lane missing another member (two nodes of one group lost, or a step
   never protected) is a CorruptCheckpointError naming what is lost, on every rank: never a
   guess;
2. each surviving member streams, in pieces, the XOR contribution it holds for every chunk of
   the lost member: its own chunk in that stripe (zero padded) or, for the stripe it stores,
   its parity block; the rebuilder XORs them (torch.bitwise_xor), checks every rebuilt chunk
   against the crc32c recorded at save, and writes the files into ``step_S/copies/rank<R>/``
   as a received copy is written (replicastream.Incoming: fdatasync, each file's crc32c,
   rename, fsync). A mismatch anywhere is a CorruptCheckpointError on every rank.

The load then reads that copy as any other, checked again against the manifest's crc32c (a
copy held in memory through one more root, seen by its rebuilder alone: ``HeldCopies.apply``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import crc32c as _crc32c
import torch

from ..errors import CollectiveFailedError, CorruptCheckpointError, ReadOnlyRootError
from ..format.commit import step_dir_name
from ..format.manifest import RootInfo
from ..format.parity import PARITY_DIR, chunk_lengths, read_stripe, stream_size
from ..format.replicas import COPIES_DIR
from ..format.sharded import GlobalManifest
from ..fs import fsync_dir
from ..options import ALIGN
from .group import Coordinator, Transfer, describe
from .loadplan import reach_of
from .replicastream import PIECE_BYTES, Incoming
from .roots import RootLayout

log = logging.getLogger("gdswriter")
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)  # a root that cannot be written
MEMORY_DIR = "/dev/shm"  # where a rebuilt copy no root can take is held (tmpfs: memory), if there


@dataclasses.dataclass
class HeldCopies:
    """Rebuilt copies held in memory for one load (the module docstring): ``entries`` (every
    rank alike: each lost rank, its rebuilder, the id of the root standing for its copy, its
    bytes) and ``paths``, on a rebuilder, the tmpfs directory of each copy it holds."""

    entries: list[dict]
    paths: dict[int, Path] = dataclasses.field(default_factory=dict)

    def apply(self, layout: RootLayout, g: GlobalManifest, copies: Sequence[Sequence[int]]
              ) -> tuple[RootLayout, GlobalManifest, tuple[tuple[int, ...], ...]]:
        """``layout``, ``g`` and its ``replicas`` with one more root per held copy, last in its
        rank's entry, seen by its rebuilder alone (the load reads it there, or is sent it)."""
        roots, table, reps = list(g.roots), list(layout.table), [tuple(row) for row in copies]
        paths, ids, where = list(layout.local_paths), list(layout.local_ids), list(layout.local_to_global)
        for e in self.entries:
            info = RootInfo(e["id"], f"(memory of rank {e['rebuilder']})", (e["rebuilder"],))
            reps[e["rank"]] = (*reps[e["rank"]], len(roots))
            roots.append(info)
            table.append(info)
            if e["rank"] in self.paths:
                paths.append(self.paths[e["rank"]])
                ids.append(e["id"])
                where.append(len(table) - 1)
        out = dataclasses.replace(layout, table=tuple(table), local_paths=tuple(paths), local_ids=tuple(ids),
                                  local_to_global=tuple(where), known=None, root_count=None, shares=None)
        return out, dataclasses.replace(g, roots=tuple(roots), replicas=tuple(reps)), tuple(reps)

    def close(self) -> None:
        """The copies this rank holds removed (after the load read them)."""
        for p in self.paths.values():
            shutil.rmtree(p, ignore_errors=True)
        self.paths.clear()


def lost_ranks(layout: RootLayout, g: GlobalManifest) -> list[int]:
    """The ranks of ``g`` whose own shard root no rank of this job sees (pure: every rank alike)."""
    seen = {info.id for info in layout.table}
    return [r for r in range(g.world_size) if g.roots[g.shards[r].root].id not in seen]


@dataclasses.dataclass(frozen=True)
class StepRoots:
    """What a rebuild reads of a step's manifest: its number and its table of roots (a 1.3
    global manifest's, or a DCP step's 1.2 ``dist.roots``)."""

    step: int
    roots: tuple[RootInfo, ...]


def rebuild_lost(coord: Coordinator, layout: RootLayout, g: GlobalManifest, copies: Sequence[Sequence[int]], *,
                 what: str, src: int) -> HeldCopies | None:
    """Collective (the module docstring): every lost rank of a parity lane rebuilt into a copy on
    a surviving member's root, or held in memory where none can be written (returned: the
    caller reads them through ``HeldCopies.apply`` and closes them). Nothing to do (no rank
    lost, no parity): returns at once, with no collective when no rank is lost."""
    lost = lost_ranks(layout, g)
    if not lost:
        return None
    seen = {info.id: tuple(info.ranks) for info in layout.table}
    return rebuild_members(coord, StepRoots(g.step, tuple(g.roots)), reach_of(g, layout), seen,
                           lambda r, _member: r in lost, copies, what=what, src=src)


def rebuild_members(coord: Coordinator, g: StepRoots, reach: Sequence[Path | None], seen: dict[str, tuple[int, ...]],
                    is_lost: Callable[[int, dict], bool], copies: Sequence[Sequence[int]] | None, *, what: str,
                    src: int) -> HeldCopies | None:
    """Collective: the members of parity lanes that ``is_lost(rank, its stripe entry)`` names
    rebuilt into ``step_S/copies/rank<R>/`` on a root that may hold them (``copies[r]``, the
    manifest's ``replicas`` entry; None: the roots where the lane's other members keep their
    parity, as a DCP step has no such entry), or held in memory (returned, as rebuild_lost).
    ``reach``: this rank's path of each table root; ``seen``: root id -> the ranks seeing it.
    CorruptCheckpointError on every rank where a lane cannot rebuild a lost member."""
    held: dict[int, tuple[dict, Path]] = {}
    mine: dict = {"stripes": [], "writable": []}
    error: BaseException | None = None
    try:
        mine = _held(coord, g, reach, seen, is_lost, held)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    plan = coord.decide(error, mine, f"{what} (finding the parity of lost ranks)",
                        lambda outs: _plan(g, copies, seen, outs, what), root=src)
    failed = [x["error"] for x in plan if "error" in x]
    if failed:
        raise CorruptCheckpointError("; ".join(failed))
    kept = HeldCopies([{"rank": x["rank"], "rebuilder": x["rebuilder"], "id": x["memory"], "bytes": x["info"]["total"]}
                       for x in plan if "memory" in x])
    try:
        for entry in plan:
            _rebuild_one(coord, g, entry, held, reach, kept, what, src)
    except BaseException:
        kept.close()
        raise
    return kept if kept.entries else None


def _rebuild_one(coord: Coordinator, g: StepRoots, entry: dict, held: dict, reach: Sequence[Path | None],
                 kept: HeldCopies, what: str, src: int) -> None:
    """One lost rank rebuilt (step 2 of the module docstring), its outcome agreed by every rank."""
    r, memory = entry["rank"], "memory" in entry
    problem = None
    try:
        if memory and coord.rank == entry["rebuilder"]:
            kept.paths[r] = Path(tempfile.mkdtemp(prefix="gdswriter-rebuilt-",
                                                  dir=MEMORY_DIR if os.path.isdir(MEMORY_DIR) else None))
        _rebuild(coord, g, entry, held, reach, what, kept.paths.get(r))
    except CollectiveFailedError:
        raise
    except Exception as e:  # noqa: BLE001 - decided together below
        full = isinstance(e, OSError) and (e.errno in READ_ONLY_ERRNOS or (memory and e.errno == errno.ENOSPC))
        problem = (("no memory: " if memory else "cannot write: ") if full else "") + describe(e)
    bad = coord.decide(None, problem, f"{what} (rebuilding rank {r})", lambda outs: [x for x in outs if x], root=src)
    if any(x.startswith("cannot write: ") for x in bad):
        raise ReadOnlyRootError(errno.EROFS, f"{what}: rank {r}'s files were lost and its rebuilt copy could not be "
                                             f"written on {_copies(reach, g, entry)}: {'; '.join(bad)[:2000]}: make "
                                             f"that root writable and load again")
    if any(x.startswith("no memory: ") for x in bad):
        raise ReadOnlyRootError(errno.EROFS, f"{entry['readonly']}; holding the rebuilt copy in memory instead "
                                             f"({MEMORY_DIR}) failed too: {'; '.join(bad)[:2000]}")
    if bad:
        raise CorruptCheckpointError(f"{what}: rank {r}'s files could not be rebuilt from its parity group (lane "
                                     f"{entry['lane']}): {'; '.join(bad)[:2000]}; the checkpoint's parity or a "
                                     f"member's files are damaged: load an earlier step (load(fallback=True))")
    if coord.rank != entry["rebuilder"]:
        return
    others = [k for k in entry["lane"] if k != r]
    if memory:
        log.warning("gdswriter: %s: rebuilt rank %d's files from its parity group (ranks %s) and holds them in "
                    "memory for this load (%d bytes in %s): %s; so the step cannot be refilled: it is not protected "
                    "against another node's loss until a root is writable again and it is loaded, or a new step is "
                    "saved", what, r, others, int(entry["info"]["total"]), kept.paths.get(r), entry["readonly"])
    else:
        log.warning("gdswriter: %s: rebuilt rank %d's files from its parity group (ranks %s) into %s", what, r,
                    others, _copies(reach, g, entry))


def _held(coord: Coordinator, g: StepRoots, reach: Sequence[Path | None], seen: dict,
          is_lost: Callable[[int, dict], bool], held: dict[int, tuple[dict, Path]]) -> dict:
    """This rank's report: the stripe descriptions, on the roots it leads, of lanes holding a lost
    rank (kept in ``held``; with the table root each lies on), and which of those roots' step
    directories it can write (where a rebuilt copy may go)."""
    out: dict = {"stripes": [], "writable": []}
    for j, p in enumerate(reach):
        ranks = seen.get(g.roots[j].id)
        if p is None or not ranks or min(ranks) != coord.rank:
            continue
        if os.access(p / step_dir_name(g.step), os.W_OK):
            out["writable"].append(j)
        d = p / step_dir_name(g.step) / PARITY_DIR
        for f in sorted(d.glob("rank*.json")) if d.is_dir() else ():
            body = read_stripe(f)
            hits = [r for r, member in zip(body["lane"], body["members"]) if is_lost(r, member)]
            if hits:
                held[body["parity"]["rank"]] = (body, p / step_dir_name(g.step))
                out["stripes"].append({"holder": body["parity"]["rank"], "lane": body["lane"], "root": j,
                                       "lost": [[r, body["members"][body["lane"].index(r)]] for r in hits]})
    return out


def _plan(g: StepRoots, copies: Sequence[Sequence[int]] | None, seen: dict, outs: list, what: str) -> list[dict]:
    """The primary rank: for each lost rank of a parity lane (as the reports name them), who
    rebuilds it and who sends what. A lost rank no parity holds is left to the caller (not a
    parity step, or its whole lane is gone: the copies' error says so)."""
    plan = []
    writable = {j for out in outs for j in out["writable"]}
    for r in sorted({int(r) for out in outs for x in out["stripes"] for r, _ in x["lost"]}):
        reps = [(reader, x) for reader, out in enumerate(outs) for x in out["stripes"] if r in x["lane"]]
        lane = reps[0][1]["lane"]
        have = {x["holder"]: reader for reader, x in reps}
        missing = [k for k in lane if k != r and k not in have]
        targets = copies[r] if copies is not None else sorted({x["root"] for _, x in reps if x["holder"] != r})
        reached = [j for j in targets if g.roots[j].id in seen]
        target = next((j for j in reached if j in writable), None)
        info = next(m for rr, m in reps[0][1]["lost"] if rr == r)
        senders = [[k, have[k]] for k in lane if k != r and k in have]  # every one, where none is missing
        if not missing and reached and target is None:  # held in memory: on rank r's host where it is in the job
            plan.append({"rank": r, "lane": lane, "info": info, "target": None, "senders": senders,
                         "memory": f"memory:{secrets.token_hex(8)}:rank{r}",
                         "rebuilder": r if r < len(outs) else min(seen[g.roots[reached[0]].id]),
                         "readonly": f"no root that may hold rank {r}'s rebuilt copy can be written "
                                     f"({', '.join(g.roots[j].path for j in reached)}: read-only, or no permission)"})
            continue
        if missing or target is None:
            plan.append({"error": f"{what}: rank {r}'s files are lost (no rank of this job sees its root) and its "
                                  f"parity group (ranks {lane}) cannot rebuild them: the files and parity of rank(s) "
                                  f"{missing} are lost too (two nodes of one parity group lost, or a step never "
                                  f"protected): load an earlier step (load(fallback=True))"})
            continue
        plan.append({"rank": r, "lane": lane, "info": info, "target": target,
                     "rebuilder": min(seen[g.roots[target].id]), "senders": senders})
    return plan


def _copies(reach: Sequence[Path | None], g: StepRoots, entry: dict) -> Path:
    return reach[entry["target"]] / step_dir_name(g.step) / COPIES_DIR  # type: ignore[operator]


class Contribution:
    """What surviving member ``k`` (its stripe description ``body``, its step directory) gives to
    the rebuild of lost member ``m``, as a stream as long as m's bytes: per chunk of m, k's own
    chunk in that stripe (zero padded), or k's parity block where k stores that stripe."""

    def __init__(self, body: dict, step_dir: Path, reach: Sequence[Path | None], step: int, m: int):
        lane = body["lane"]
        self.n, self.k, self.m = len(lane), lane.index(body["parity"]["rank"]), lane.index(m)
        self.per_m = chunk_lengths(int(body["members"][self.m]["total"]), self.n)[0]
        mine = body["members"][self.k]
        self.lens_k = chunk_lengths(int(mine["total"]), self.n)
        self.files = [(reach[int(root)] / step_dir_name(step) / name, int(size))  # type: ignore[operator]
                      for (_, name, size), root in zip(mine["files"], mine["roots"])]
        self.parity = step_dir / PARITY_DIR / body["parity"]["file"]
        self.parity_len = int(body["parity"]["length"])

    def read(self, x: int, length: int, buf: torch.Tensor) -> None:
        """Bytes [x, x + length) of the contribution into ``buf`` (zeroed by the caller)."""
        view = memoryview(buf.numpy())
        done = 0
        while done < length:
            c, y = divmod(x + done, self.per_m)
            want = min(length - done, self.per_m - y)
            t = (self.m + 1 + c) % self.n
            if t == self.k:
                read_stream([(self.parity, self.parity_len)], y, view[done:done + want])
            else:
                ck = (t - self.k - 1) % self.n
                have = max(0, min(want, self.lens_k[ck] - y))
                read_stream(self.files, ck * self.lens_k[0] + y, view[done:done + have])
            done += want


def read_stream(files: Sequence[tuple[Path, int]], offset: int, out: memoryview) -> None:
    """``len(out)`` bytes at ``offset`` of ``files`` laid end to end as a member's stream lays
    them (each in whole blocks: stream_size; ``out`` comes zeroed, so the padding is left as is)."""
    got, start = 0, 0
    for path, size in files:
        if got == len(out):
            return
        if offset + got < start + size:
            with open(path, "rb", buffering=0) as f:
                pos = offset + got - start
                while got < len(out) and pos < size:
                    k = os.preadv(f.fileno(), [out[got:got + min(len(out) - got, size - pos)]], pos)
                    if k <= 0:
                        raise CorruptCheckpointError(f"{path} is shorter than its parity description says")
                    got, pos = got + k, pos + k
        end = start + stream_size(size)
        if offset + got < end:  # the file's padding
            got = min(len(out), end - offset)
        start = end
    if got < len(out):
        raise CorruptCheckpointError(f"{files[-1][0]}: a member's files are shorter than recorded")


def _aligned_zeros(n: int) -> torch.Tensor:
    """``n`` zero bytes at an ALIGN-aligned address: the rebuilt stream goes to Incoming, which
    writes whole blocks with O_DIRECT (replicastream.py), and every file starts on a block."""
    raw = torch.zeros(n + ALIGN, dtype=torch.uint8)
    at = -raw.data_ptr() % ALIGN
    return raw[at:at + n]


def _incoming(reach: Sequence[Path | None], g: StepRoots, entry: dict, memory: Path | None
              ) -> tuple[Incoming | None, BaseException | None]:
    """The rebuilder's copy being written (on its root, or in ``memory``: a directory standing
    for a root), or why it cannot be: the exchanges still run (the senders wait on them) and
    the failure is raised after them."""
    try:
        copies = _copies(reach, g, entry) if memory is None else memory / step_dir_name(g.step) / COPIES_DIR
        copies.mkdir(parents=memory is not None, exist_ok=True)
        fsync_dir(copies.parent)
        return Incoming(copies, entry["rank"], json.dumps(entry["info"]["files"]).encode()), None
    except Exception as e:  # noqa: BLE001 - raised after the exchanges
        return None, e


def _rebuild(coord: Coordinator, g: StepRoots, entry: dict, held: dict, reach: Sequence[Path | None],
             what: str, memory: Path | None = None) -> None:
    """One lost rank's files rebuilt (step 2 of the module docstring): every sender and the
    rebuilder run every piece's exchange, a local failure sending zeros and raising at the end."""
    r, me, info = entry["rank"], coord.rank, entry["info"]
    rebuilder, n, total = entry["rebuilder"], len(entry["lane"]), int(info["total"])
    lens = chunk_lengths(total, n)
    mine = {k: Contribution(*held[k], reach, g.step, r) for k, reader in entry["senders"] if reader == me}
    inc, problem = _incoming(reach, g, entry, memory) if me == rebuilder else (None, None)
    crc, c = 0, 0
    try:
        for x in range(0, total, PIECE_BYTES):
            size = min(PIECE_BYTES, total - x)
            bufs = {k: _aligned_zeros(size) for k, reader in entry["senders"]
                    if reader == me or me == rebuilder}
            for k, part in mine.items():
                if problem is None:
                    try:
                        part.read(x, size, bufs[k])
                    except Exception as e:  # noqa: BLE001 - the exchange goes on; raised below
                        problem = e
            coord.exchange([Transfer(reader, rebuilder, entry["lane"].index(k), bufs.get(k, torch.empty(0)))
                            for k, reader in entry["senders"]], f"{what} (rebuilding rank {r})")
            if inc is None or problem is not None:
                continue
            acc = bufs[entry["senders"][0][0]]
            for k, _ in entry["senders"][1:]:
                torch.bitwise_xor(acc, bufs[k], out=acc)
            view = memoryview(acc.numpy())
            done = 0
            while done < size:  # every rebuilt chunk against the crc32c recorded at save
                step_len = min(size - done, (c + 1) * lens[0] - (x + done))
                crc = _crc32c.crc32c(view[done:done + step_len], crc)
                done += step_len
                if x + done == sum(lens[:c + 1]):
                    if crc != int(info["chunk_crcs"][c]):
                        raise CorruptCheckpointError(f"rebuilt chunk {c} of rank {r}'s files does not match its "
                                                     f"crc32c ({crc:#010x}, recorded {int(info['chunk_crcs'][c]):#010x})")
                    crc, c = 0, c + 1
            inc.write(view)
        if problem is not None:
            raise problem
        if inc is not None:
            inc.publish({"ok": True, "crcs": [int(v) for v in info["file_crcs"]]})
    except BaseException:
        if inc is not None:
            inc.discard()
        raise
