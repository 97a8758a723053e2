"""Reading a multi-rank step when each rank sees only some of its roots.

Roots may be node-local: a rank cannot open files another node wrote. A manifest's roots are
matched to this rank's roots by identity (``.gdswriter-root``; by path only for a local root
that has none, since one path on every node is a different disk on each).
Each rank reads, through its engine, the chunks it needs that lie on roots it reaches; every
other chunk it needs is read by a rank that reaches it (the least loaded one) and sent over
the coordination group. Rank 0 assigns those readers: each rank sends it the chunks it cannot
read and the roots it sees (a gather), and it sends each rank its own moves alone
(``scatter_own``), so a rank receives what its own needs and its share of the reading take,
whatever the world size. Before any rank allocates a buffer, each rank checks the files it
reads against their recorded sizes and all ranks agree on the outcome, so a manifest claiming
more than its files hold is refused before it costs memory anywhere. Chunks are checked
against their crc32c where they are read, and again where they arrive; the chunks read for
others go in rounds of STREAM_BYTES per pair of ranks, a round sent while the next is read
(``stream_chunks``), so a restore from a copy on a peer reads and sends at once, into a few
rounds of reused buffers (``RoundWindow``). A large chunk several ranks need spreads down a
relay tree (``relay_tree``): ranks that received it send it on, so its reader does not send it
to every rank that needs it, and each rank's sending stays about its share. All ranks agree on
failure: if one fails, all raise. A caller may name storages to read in place (``into``: the
DCP reader hands DCP's own target tensors, saving a buffer and a copy); those are the only
memory a failed fetch can leave partly written.
"""

from __future__ import annotations

import errno
import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import torch

from ..engines.base import IOEngine
from ..errors import ChecksumMismatchError, UnreachableDataError
from ..format.manifest import ChunkRecord, Manifest
from ..load.reader import check_step_files, host_buffer
from .group import Coordinator, Transfer
from .ownplan import Move
from .readexec import ChunkCheck, RangeRead, ReadPlan, check_chunks, chunk_range, execute, send_moves
from .roots import RootLayout

STREAM_BYTES = 32 << 20  # per pair of ranks, the chunk bytes of one round: sent while the next are read
AHEAD_ROUNDS = 2  # how many rounds a fetch's reader thread reads ahead of the rounds sent (RoundWindow)
RELAY_MIN = 1 << 20  # a chunk this large that several ranks need is relayed (assign_readers), a smaller one sent direct


@dataclass(frozen=True)
class Reach:
    """Where this rank finds each root of a manifest (None: it cannot)."""

    paths: tuple[Path | None, ...]


def manifest_reach(m: Manifest, layout: RootLayout) -> Reach:
    """Match the manifest's roots to this rank's: by the ids recorded in a multi-rank manifest;
    by path only where a root has no id (a local root without ``.gdswriter-root``, read as a
    "path:" pseudo-id): node-local disks mounted at one path on every node are different roots.
    A single-process checkpoint's roots are rank 0's, in order."""
    if m.dist is None:
        rank0 = [g for g, info in enumerate(layout.table) if 0 in info.ranks]
        n = 1 + max((f.root for f in m.files), default=0)
        if n > len(rank0):  # no rank reaches it (and its number, from the manifest, must not size anything)
            raise UnreachableDataError(errno.ENOENT, f"step {m.step} has data files on root #{n - 1}, but rank 0 was "
                                                     f"given {len(rank0)} root(s): pass every root that saved it, "
                                                     f"in order")
        return Reach(tuple(layout.local_paths[i] if g < len(rank0) and (i := layout.local_of(rank0[g])) is not None
                           else None for g in range(n)))
    unmarked = {str(p.resolve()): p for p, i in zip(layout.local_paths, layout.local_ids) if i.startswith("path:")}
    paths: list[Path | None] = []
    for info in m.dist.roots:
        if info.id in layout.local_ids:
            paths.append(layout.local_paths[layout.local_ids.index(info.id)])
        else:
            paths.append(unmarked.get(info.path))
    return Reach(tuple(paths))


def check_reached_files(m: Manifest, reach: Reach, files: set[int]) -> None:
    """The data files ``files`` (indices into ``m.files``, on roots this rank reaches) are regular
    files of their recorded sizes (load.reader.check_step_files: CheckpointNotFoundError when the
    step vanished meanwhile)."""
    check_step_files(m.step, m.created_unix, reach.paths, (m.files[f] for f in sorted(files)))


def fetch_storages(coord: Coordinator, reach: Reach, m: Manifest, storages: Iterable[int], engine: IOEngine, *,
                   verify: bool, what: str, alloc: Callable[[int], torch.Tensor] = host_buffer,
                   into: Mapping[int, torch.Tensor] | None = None, alone: bool = False) -> dict[int, torch.Tensor]:
    """Collective: {storage: flat uint8 buffer of its nbytes, filled} for ``storages`` on every rank.

    Nothing is allocated before every rank has checked the files it reads (for itself or for
    others) against the manifest (check_reached_files): what a load allocates is then bounded by
    the real files, on every rank, whatever a damaged manifest claims. ``alloc`` makes a buffer;
    ``into`` gives the buffer of some storages (flat uint8 CPU tensors of their nbytes, e.g. the
    caller's live tensors): those are filled in place, and a failure may leave them partly
    written (the hints of the errors say so). The reads are one plan (``fetch_plan``) carried
    out by readexec.py's executor; the chunks read for other ranks travel in rounds while the next
    are read (``stream_chunks``) and are checked where they arrive.

    ``alone`` (the same on every rank): every rank reaches every root of ``m`` and the caller's
    own protocol tells every rank of a failure (DCP's gather of read_data's outcomes): then
    each rank reads what it needs itself, with no collective, after checking its own files
    (so what it allocates is bounded by them) and raises its own error."""
    into = into or {}
    for s, t in into.items():
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != m.storages[s].nbytes:
            raise ValueError(f"fetch_storages: the buffer given for storage {s} is not a flat uint8 tensor of its "
                             f"{m.storages[s].nbytes} bytes")
    untouched = "the live state was not changed" if not into else \
        "tensors read in place may be partly overwritten: load again"
    needed = sorted(set(storages))
    local, remote = split_reached(m, reach, needed)
    if alone:
        if remote:
            raise ValueError(f"fetch_storages: alone=True, but this rank reaches no root of storage {remote[0][0]}")
        check_reached_files(m, reach, {m.storages[s].chunks[ci].file for s, ci in local})
        out = execute(fetch_plan(m, needed, local, []), reach.paths, engine, verify=verify, alloc=alloc, given=into)
        if out.error is not None:
            raise out.error
        return {s: out.buffers[s] for s in needed}
    moves = locate_chunks(coord, m, reach, remote, what)
    rank = coord.rank
    asked = {(s, ci) for s, ci in remote}  # what this rank receives (and may forward), never reads
    others = [(x[3], x[4]) for x in moves if x[1] == rank and (x[3], x[4]) not in asked]  # read for other ranks
    mine = [(s, ci) for s, ci in local] + others
    error = None
    try:  # every file this rank reads, checked before any rank allocates a byte for it
        check_reached_files(m, reach, {m.storages[s].chunks[ci].file for s, ci in mine})
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (checking the data files)", hint="the live state was not changed")
    plan = fetch_plan(m, needed, local, others)
    buffers: dict = dict(into)
    read_error, check_error = stream_chunks(coord, m, plan, moves, reach, buffers, engine, verify=verify,
                                            alloc=alloc, what=what)
    coord.agree(read_error, f"{what} (reading)", hint=untouched)
    coord.agree(check_error, f"{what} (checking received chunks)", hint=untouched)
    return {s: buffers[s] for s in needed}


def split_reached(m: Manifest, reach: Reach, needed: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """The [storage, chunk] of ``needed``'s chunks with bytes: (on roots this rank reaches, the rest)."""
    local: list[list[int]] = []
    remote: list[list[int]] = []
    for s in needed:
        for ci, c in enumerate(m.storages[s].chunks):
            if c.length:
                (local if reach.paths[m.files[c.file].root] is not None else remote).append([s, ci])
    return local, remote


def fetch_plan(m: Manifest, needed: Sequence[int], local: Sequence[Sequence[int]],
               others: Sequence[tuple[int, int]]) -> ReadPlan:
    """The reads of a fetch (readexec.py): a buffer per ``needed`` storage, each ``local`` chunk
    into its storage's buffer, and each chunk read for other ranks (``others``, not among
    ``local``: a chunk this rank reads for itself is sent from there) into a buffer of its own
    (key ("to", storage, chunk)); every chunk checked as it is read."""
    names: dict[int, str] = {}
    for t in m.tensors:
        names.setdefault(t.storage, t.name)
    buffers: list[tuple[Hashable, int]] = [(s, m.storages[s].nbytes) for s in needed]
    reads = [chunk_range(m.storages[s].chunks[ci], s, m.storages[s].chunks[ci].storage_offset,
                         names.get(s, f"<storage {s}>")) for s, ci in local]
    seen = {(s, ci) for s, ci in local}
    for s, ci in others:
        if (s, ci) not in seen:
            seen.add((s, ci))
            c = m.storages[s].chunks[ci]
            buffers.append((("to", s, ci), c.length))
            reads.append(chunk_range(c, ("to", s, ci), 0, names.get(s, f"<storage {s}>")))
    return ReadPlan(m.step, m.created_unix, m.files, tuple(reads), tuple(buffers))


def locate_chunks(coord: Coordinator, m: Manifest, reach: Reach, remote: list[list[int]],
                  what: str) -> list[tuple[int, int, int, int, int, int]]:
    """Collective: the (tag, src, dst, storage, chunk, round) moves this rank takes part in: rank 0
    gathers what each rank cannot read and the roots it sees, assigns every chunk a reader
    (``assign_readers``) and sends each rank its own part (``scatter_own``)."""
    asks = coord.gather({"need": remote, "reach": [g for g, p in enumerate(reach.paths) if p is not None]},
                        f"{what} (locating chunks)", dst=0)
    parts: list[dict] | None = None
    plan_error = None
    if asks is not None:  # rank 0 assigns every chunk a reader and tells each rank its own part
        try:
            parts = [{"moves": p} for p in assign_readers(m, asks, what)]
        except UnreachableDataError as e:
            plan_error, parts = e, [{"error": str(e)}] * coord.world_size
    part = scatter_own(coord, parts, f"{what} (the chunks each rank sends and receives)")
    if "error" in part:
        raise plan_error or UnreachableDataError(2, part["error"])
    return [tuple(x) for x in part["moves"]]  # type: ignore[misc]


def stream_rounds(moves: Sequence[Sequence[int]]) -> list[list[tuple[int, int, int, int, int]]]:
    """``moves`` (this rank's part of a fetch: [tag, src, dst, storage, chunk, round], as
    ``assign_readers`` made them) by round, each round in tag order, as (tag, src, dst, storage,
    chunk). Both ranks of a pair hold the same moves with the same rounds, so round k's sends
    meet round k's receives whatever the other pairs hold: as every rank runs its rounds in
    order, no order of ranks can deadlock; a forward's round follows its arrival's."""
    rounds: list[list[tuple[int, int, int, int, int]]] = []
    for tag, src, dst, s, ci, k in sorted(moves, key=lambda x: (x[5], x[0])):
        rounds.extend([] for _ in range(k + 1 - len(rounds)))
        rounds[k].append((tag, src, dst, s, ci))
    return rounds


def _work_by_round(m: Manifest, plan: ReadPlan, rounds: Sequence[Sequence[tuple[int, int, int, int, int]]],
                   rank: int) -> list[tuple[list[tuple[Hashable, int]], ReadPlan]]:
    """Per round, then once more for what no round needs: the buffers of ``plan`` first used
    there (sent from, received or read into) and the reads of ``plan`` whose chunks this rank
    sends there first (the others in the last); each round's done before it runs."""
    first: dict[tuple, int] = {}
    use: dict[Hashable, int] = {}
    for k, moves in enumerate(rounds):
        for _, src, _dst, s, ci in moves:
            c = m.storages[s].chunks[ci]
            if src == rank:
                first.setdefault((("to", s, ci), 0), k)
                first.setdefault((s, c.storage_offset), k)
                use.setdefault(("to", s, ci), k)
            use.setdefault(s, k)
    groups: list[list[RangeRead]] = [[] for _ in range(len(rounds) + 1)]
    for r in plan.reads:
        k = first.get((r.dest, r.dest_offset), len(rounds))
        groups[k].append(r)
        use[r.dest] = min(use.get(r.dest, k), k)
    allocs: list[list[tuple[Hashable, int]]] = [[] for _ in groups]
    for key, nbytes in plan.buffers:
        allocs[use.get(key, len(rounds))].append((key, nbytes))
    return [(a, replace(plan, reads=tuple(g), buffers=())) for a, g in zip(allocs, groups)]


def stream_chunks(coord: Coordinator, m: Manifest, plan: ReadPlan, moves: Sequence[tuple[int, int, int, int, int, int]],
                  reach: Reach, buffers: dict, engine: IOEngine, *, verify: bool,
                  alloc: Callable[[int], torch.Tensor], what: str
                  ) -> tuple[BaseException | None, BaseException | None]:
    """Collective: ``plan`` carried out into ``buffers`` while the chunks of ``moves`` go from
    their readers to the ranks that need them. A thread allocates the buffers (``alloc``; those
    ``buffers`` lacks; a chunk read for others alone into a reused one: ``RoundWindow``) and
    reads the chunks of each round (``stream_rounds``) through ``engine``, at most AHEAD_ROUNDS
    ahead, each checked against its crc32c as it is read, while the rounds already there travel
    and each round received is checked against its crc32c (before any rank forwards it). Every round is
    sent and received even after a failed allocation or read (from and into what the buffers
    hold then, or scratch: the rank's failure is agreed on first, and no rank uses those bytes),
    so no rank waits for a message that never comes. Returns (this rank's failure allocating or
    reading, the first received chunk that fails its check)."""
    rank = coord.rank
    rounds = stream_rounds(moves)
    work = _work_by_round(m, plan, rounds, rank)
    ready = [threading.Event() for _ in work]
    failed: list[BaseException] = []
    window = RoundWindow(rounds, rank)

    def run() -> None:
        for k, ((todo, part), event) in enumerate(zip(work, ready)):
            window.wait_turn(k)
            if not failed and not window.stop.is_set():
                try:
                    for key, nbytes in todo:
                        if key not in buffers:
                            buffers[key] = window.take(key, nbytes, alloc)
                except Exception as e:  # noqa: BLE001 - the caller agrees on it
                    failed.append(e)
                    continue
                out = execute(part, reach.paths, engine, verify=verify, given=buffers)
                if out.error is not None:
                    failed.append(out.error)
            event.set()

    worker = threading.Thread(target=run, name="gdswriter-fetch", daemon=True)
    worker.start()
    check_error: BaseException | None = None
    tags: dict[tuple[int, int], int] = {}
    try:
        for k, moves_k in enumerate(rounds):
            ready[k].wait()
            error = _pass_round(coord, m, moves_k, buffers, tags, verify=verify and not failed and check_error is None,
                                what=f"{what} (sending chunks, round {k + 1} of {len(rounds)})")
            check_error = check_error or error
            window.passed(k, buffers)
    except BaseException:
        window.stop.set()  # only when this thread gives up: otherwise the reads no round needs are still to do
        raise
    finally:
        worker.join()
    return (failed[0] if failed else None), check_error


class RoundWindow:
    """How far a fetch's reader thread runs ahead, and the buffers it reads other ranks' chunks
    into, reused. The thread prepares round k once round k - AHEAD_ROUNDS - 1 has been passed
    (``wait_turn``), so what it has read and not yet sent is a few rounds' worth; a buffer of
    a chunk read for other ranks only (key ("to", storage, chunk)) goes back to a spare list
    once the last round that sends it has passed (``passed``) and the next such chunk of its
    size is read into it (``take``): a rank reading a lost node's copy for it allocates and
    touches a few rounds of buffers, not the whole copy."""

    def __init__(self, rounds: Sequence[Sequence[tuple[int, int, int, int, int]]], rank: int) -> None:
        self.done = [threading.Event() for _ in rounds]
        self.stop = threading.Event()
        self.last: dict[int, list[Hashable]] = {}  # round -> the "to" buffers it sends last
        ends = {("to", s, ci): k for k, moves in enumerate(rounds) for _, src, _, s, ci in moves if src == rank}
        for key, k in ends.items():
            self.last.setdefault(k, []).append(key)
        self.spare: dict[int, list[torch.Tensor]] = {}  # appended by the passing thread, popped by the reader

    def wait_turn(self, k: int) -> None:
        """The reader thread, before round ``k``'s work (k = len(rounds): the reads no round needs)."""
        j = k - AHEAD_ROUNDS - 1
        if 0 <= j < len(self.done):
            while not self.done[j].wait(0.05) and not self.stop.is_set():
                pass

    def take(self, key: Hashable, nbytes: int, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
        spare = self.spare.get(nbytes) if isinstance(key, tuple) and key[0] == "to" else None
        return spare.pop() if spare else alloc(nbytes)

    def passed(self, k: int, buffers: dict) -> None:
        """Round ``k`` is sent and received: its last "to" buffers are spare, the reader may go on."""
        for key in self.last.get(k, ()):
            buf = buffers.pop(key, None)
            if buf is not None:
                self.spare.setdefault(buf.numel(), []).append(buf)
        self.done[k].set()


def _pass_round(coord: Coordinator, m: Manifest, moves: Sequence[tuple[int, int, int, int, int]],
                buffers: Mapping[Hashable, torch.Tensor], tags: dict[tuple[int, int], int], *, verify: bool,
                what: str) -> BaseException | None:
    """One round of chunk moves from their readers to the ranks that need them, and those this
    rank received checked against their crc32c: the first mismatch, or None."""
    rank = coord.rank
    views: dict[int, torch.Tensor] = {}  # per move this rank takes part in: what it sends or receives into
    checks = []
    for tag, src, dst, s, ci in moves:
        c = m.storages[s].chunks[ci]
        if rank == src:
            views[tag] = buffers[("to", s, ci)] if ("to", s, ci) in buffers else _slice(buffers.get(s), c)
        elif rank == dst:
            views[tag] = _slice(buffers.get(s), c)
            checks.append(ChunkCheck(s, c.storage_offset, c.length, c.crc32c, f"<chunk received from rank {src}>",
                                     f"<storage {s}>", c.file_offset))
    send_moves(coord, [Move(src, dst, tag, 0, m.storages[s].chunks[ci].length) for tag, src, dst, s, ci in moves],
               views, tags, what)
    try:
        if verify:
            check_chunks(checks, buffers)
    except ChecksumMismatchError as e:
        return e
    return None


def scatter_own(coord: Coordinator, parts: Sequence[dict] | None, what: str) -> dict:
    """Collective: rank 0's ``parts[r]`` (JSON) on each rank r, which receives its own part
    alone: the sizes go out in a fixed-size scatter (fixed-width numbers), then each part point to point. (A plain
    scatter pads every message to the longest: a rank reading for many others has a long part,
    and every rank would receive that length.)"""
    if coord.solo_mode:
        assert parts is not None
        return json.loads(json.dumps(parts[0]))
    datas = [json.dumps(p, separators=(",", ":"), allow_nan=False).encode() for p in parts] \
        if coord.rank == 0 and parts is not None else []
    # fixed width (a scatter pads to its longest message): what a rank receives does not grow
    # with the digits of rank 0's own part, which may grow with the world size
    size = int(coord.scatter([f"{len(d):015d}" for d in datas] if datas else None, f"{what} (sizes)", src=0))
    if coord.rank == 0:
        coord.exchange([Transfer(0, r, 0, torch.frombuffer(bytearray(d), dtype=torch.uint8))
                        for r, d in enumerate(datas) if r], what)
        return json.loads(datas[0])
    buf = torch.empty(size, dtype=torch.uint8)
    coord.exchange([Transfer(0, coord.rank, 0, buf)], what)
    return json.loads(bytes(buf.numpy()))


def assign_readers(m: Manifest, asks: Sequence[dict], what: str) -> list[list[list[int]]]:
    """On rank 0 of a fetch: given each rank's ask (the chunks it needs and cannot read, the roots
    it reaches), per rank the [tag, src, dst, storage, chunk, round] moves it takes part in. Each
    chunk is read by the least loaded rank that reaches its root; a chunk of RELAY_MIN bytes or
    more that several ranks need spreads down a tree (``relay_tree``): a rank that received it
    sends it on, a later round, so the reader sends it once or twice, not once per rank that
    needs it (a lost node's copy on one peer, which every rank needs, would otherwise leave that
    peer sending it W - 1 times). ``round``: the round of the move (``MoveRounds``: STREAM_BYTES
    per pair of ranks, and a forward after the round it arrived in). A rank's part holds its own
    needs and its share of the reading and forwarding, whatever the world size."""
    readers: dict[int, list[int]] = {}
    for r, x in enumerate(asks):
        for root in x["reach"]:
            readers.setdefault(root, []).append(r)
    wanting: dict[tuple[int, int], list[int]] = {}
    for dst, x in enumerate(asks):
        for s, ci in x["need"]:
            wanting.setdefault((s, ci), []).append(dst)
    load = [0] * len(asks)  # bytes each rank sends
    parts: list[list[list[int]]] = [[] for _ in asks]
    slots = MoveRounds(STREAM_BYTES)
    tag = 0
    for (s, ci), dsts in wanting.items():
        c = m.storages[s].chunks[ci]
        src = min(_providers(m, readers, c, what), key=lambda r: (load[r], r))
        edges = relay_tree(src, dsts, load, c.length) if c.length >= RELAY_MIN and len(dsts) > 1 else [(src, d) for d in dsts]
        arrived = {src: -1}
        for a, b in edges:  # each parent before its children
            load[a] += c.length
            arrived[b] = slots.take(a, b, c.length, arrived[a] + 1)
            move = [tag, a, b, s, ci, arrived[b]]
            parts[a].append(move)
            parts[b].append(move)
            tag += 1
    return parts
def relay_tree(src: int, dsts: Sequence[int], load: Sequence[int], nbytes: int) -> list[tuple[int, int]]:
    """The (sender, receiver) edges of one chunk of ``nbytes`` from its reader ``src`` to
    ``dsts``, parents before children: each receiver gets it from the holder (the reader, or a
    rank that already received it) that sends the fewest bytes (``load``, with this tree's own
    sends), among those less than ``relay_depth`` hops from the reader; ties: the nearer, then
    the lower rank."""
    cap = relay_depth(len(dsts))
    depth = {src: 0}
    sends = {src: load[src]}
    edges: list[tuple[int, int]] = []
    for d in dsts:
        parent = min((h for h in depth if depth[h] < cap), key=lambda h: (sends[h], depth[h], h))
        edges.append((parent, d))
        sends[parent] += nbytes
        depth[d], sends[d] = depth[parent] + 1, load[d]
    return edges


def relay_depth(n: int) -> int:
    """The most hops a relayed chunk takes to ``n`` receivers: as a binomial tree's (log2(n + 1)
    rounded up), so a chunk's last receiver waits at most that many rounds after its reader."""
    return max(1, (n).bit_length())


class MoveRounds:
    """Rank 0's rounds of a fetch's moves: each pair of ranks moves ``limit`` bytes to a round
    (a move that starts below the limit stays in its round), in the order the moves are taken;
    a move is never before the round it is given as earliest (a forward: after its arrival)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 1)
        self.at: dict[tuple[int, int], tuple[int, int]] = {}  # pair -> (its current round, bytes in it)

    def take(self, a: int, b: int, nbytes: int, earliest: int) -> int:
        k, used = self.at.get((a, b), (0, 0))
        if earliest > k:
            k, used = earliest, 0
        elif used >= self.limit:
            k, used = k + 1, 0
        self.at[(a, b)] = (k, used + nbytes)
        return k


def _providers(m: Manifest, readers: Mapping[int, list[int]], c: ChunkRecord, what: str) -> list[int]:
    """The ranks that reach chunk ``c``'s root, or UnreachableDataError naming it."""
    root = m.files[c.file].root
    providers = readers.get(root)
    if not providers:
        where = m.dist.roots[root] if m.dist is not None else None
        raise UnreachableDataError(
            2, f"{what}: data file {m.files[c.file].path} is on root #{root}"
               + (f" (id {where.id}, saved at {where.path} by ranks {list(where.ranks)[:16]})" if where else "")
               + ", which no rank of this job can read: give some rank that root (mount it, or copy its "
                 "step directory and .gdswriter-root there)")
    return providers


def _slice(buf: torch.Tensor | None, c: ChunkRecord) -> torch.Tensor:
    """Chunk ``c``'s bytes in its storage's buffer; scratch where the buffer could not be made
    (the rank's failure is agreed on before any rank uses what it sent or received)."""
    if buf is None:
        return torch.empty(c.length, dtype=torch.uint8)
    return buf[c.storage_offset:c.storage_offset + c.length]
