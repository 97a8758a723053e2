"""Replicas on peer nodes (DistOptions(replicas=C), issue 39; format.md section 11).

**At open** (``plan_peers``, collective, only with C > 1): every rank sends rank 0 its host
(``host_name``: GDSWRITER_HOSTNAME, else socket.gethostname()), its failure domains and its
first root's id; rank 0 places the copies (planner/replicas.py ``place_replicas``: distinct
hosts always, distinct racks or switches where named and possible) and sends each rank its
part alone: the C - 1 ranks holding its copies (with their first roots' ids, which its save
votes carry into the manifest's ``replicas`` entry) and the C - 1 ranks whose copies it holds.

**After step S commits** (``Replicator``, a thread of the session's; the save handle completes
at the commit), every rank, in the order the steps committed, over a gloo group of its own
(never the session's coordination channel, so a save's collectives and replication never
interleave):

1. reads its committed shard and data files once, checking the shard's size and crc32c
   against what it voted and every chunk's crc32c as the bytes stream (a damaged local file is
   never copied); the primary rank also sends the global manifest;
2. streams them, in pieces of PIECE_BYTES, to its C - 1 peers, while receiving the files of
   the C - 1 ranks it holds copies of, pipelined (``Pipeline``): a reader thread reads and
   checks the next pieces while up to DEPTH pieces travel each way (isend/irecv) and a writer
   thread writes what arrived (memory: (1 + senders) x DEPTH pieces, whatever the state's
   size); each peer writes them into ``step_S/copies/.tmp-rank<R>-<hex>/`` on its first root, fdatasyncs each
   file, checks every file's crc32c from the sender's trailer, fsyncs the directory, renames it
   to ``step_S/copies/rank<R>`` and fsyncs ``copies``: nothing half-written is ever seen under
   the final name; the global manifest goes to ``step_S/copies/manifest.json`` the same way;
3. reports its outcome to the primary rank (a gather on the replication group). Where every
   rank succeeded, the primary rank writes ``step_S/protected`` ({"copies": C}, durably) and
   says so; the ranks holding the primary's copy then write ``step_S/copies/protected``.

**After a load** (``RefillJob``, refill.py), in the same queue: the loaded step's files that
lived on a replaced node are re-created there from the surviving copies, and the step is
protected again (format.md 11.2).

A failure (a peer dead or hung, a short or damaged copy, a root that cannot be written)
leaves the step committed and not protected: logged, and raised once by ``wait_protected`` as
ReplicationError. It never touches the next save (another channel). A short or damaged copy,
or a root that cannot be written, fails that step alone: the next steps are replicated again.
A peer dead or hung (every wait for it bounded by DistOptions.timeout_s) breaks the
replication group, whose ranks no longer agree on where its collectives stand: the Replicator
stops (``stopped``), every later step stays committed and reports ReplicationError at once,
saying the job must restart to protect steps again, and close() does not wait for the peer.
Retention keeps the newest protected step all along. A crash or power cut mid-copy leaves a
``.tmp-rank...`` directory inside ``step_S/copies``, removed with the step.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import crc32c as _crc32c
import torch

from ..errors import (ChecksumMismatchError, CollectiveFailedError, GDSWriterError,
                      InvalidOptionError, ReplicationError)
from ..format.commit import step_dir_name
from ..format.manifest import MANIFEST_NAME
from ..format.replicas import COPIES_DIR, PROTECTED_NAME, protected_marker
from ..format.sharded import RankShard, parse_global
from ..fs import atomic_write, fsync_dir, read_regular_file
from ..planner.replicas import ReplicaPart, failure_domains, place_replicas
from .group import Coordinator, Transfer, bounded, describe, unbound
from .refill import RefillJob, run_refill
from .replicastream import Incoming, Outgoing, Pipeline, Source, clock_for, profiling
from .roots import RootLayout, decide_at_rank0, raise_decided

log = logging.getLogger("gdswriter")

HOST_ENV = "GDSWRITER_HOSTNAME"
TRAILER_BYTES = 64 << 10  # the last piece of a stream: its files' crc32c and whether the sender succeeded
SMALL_LIMIT = 1 << 30  # a shard or global manifest read back


def host_name() -> str:
    """This rank's host, as replicas are placed: GDSWRITER_HOSTNAME where set (ranks of one
    machine that stand for several nodes, or hosts whose names are not unique), else
    socket.gethostname()."""
    return os.environ.get(HOST_ENV, "").strip() or socket.gethostname()


@dataclass(frozen=True)
class ReplicaPeers:
    """This rank's part of the placement: ``part`` (planner/replicas.py), ``roots``: the ids of
    the first roots of ``part.sends_to`` (in copy order), ``copies``: C."""

    copies: int
    part: ReplicaPart
    roots: tuple[str, ...]


def plan_peers(coord: Coordinator, layout: RootLayout, replicas: int, domains: Any) -> ReplicaPeers:
    """Collective (the module docstring): this rank's part of the copies' placement. Every rank
    raises alike: InvalidOptionError when the placement is refused (fewer hosts than copies,
    ranks asking for different copies), or the failing ranks' errors."""
    part = placement_round(coord, layout, domains, "placing the replicas", {"copies": replicas},
                           lambda got: _parts(got, replicas))
    return ReplicaPeers(replicas, ReplicaPart.from_message(coord.rank, part["part"]), tuple(part["roots"]))


def placement_round(coord: Coordinator, layout: RootLayout, domains: Any, what: str, asked: dict,
                    decide: Callable[[list[dict]], list[dict]]) -> dict:
    """Collective, the round both placements make at open (copies here, parity lanes in
    parity.py): every rank sends rank 0 its host, failure domains, first root's id and
    ``asked``; rank 0 ``decide``s every rank's part (InvalidOptionError: a refusal) and sends
    each rank its own. Every rank raises alike: the refusal, or the failing ranks' errors."""
    mine: dict = {}
    error: BaseException | None = None
    try:
        host = host_name()
        mine = {"host": host, "domain": list(failure_domains(coord.rank, host, domains)), **asked,
                "root": layout.local_ids[0]}
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error, mine = e, {"error": describe(e)}
    part, refused = decide_at_rank0(coord, mine, what, decide)
    raise_decided(part, error or refused, what, "no root was changed; fix the failing rank's options and open again")
    return part


def _parts(got: Sequence[dict], replicas: int) -> list[dict]:
    """Rank 0: every rank's part of the placement of ``got`` (every rank's plan_peers message)."""
    asked = sorted({x["copies"] for x in got})
    if len(asked) > 1:
        raise InvalidOptionError(f"the ranks ask for different replicas ({asked}): give every rank the same "
                                 f"DistOptions(replicas=...) (or GDSWRITER_REPLICAS)")
    domains = [x["domain"] for x in got]
    try:
        plan = place_replicas([x["host"] for x in got], replicas, domains if any(domains) else None)
    except InvalidOptionError as e:
        raise InvalidOptionError(f"DistOptions(replicas={replicas}) (GDSWRITER_REPLICAS): {e}. Ranks of one "
                                 f"machine that stand for several nodes name their host in GDSWRITER_HOSTNAME"
                                 ) from e
    if not plan.balanced:
        log.warning("gdswriter: the replicas cannot be spread evenly over these hosts (one host has more than 1/%d "
                    "of the ranks): some ranks hold more copies than others", replicas)
    if plan.domain_levels < plan.ring.levels:
        log.warning("gdswriter: the copies are on distinct hosts, but the named failure domains are too uneven to "
                    "keep them in distinct racks or switches at every level (%d of %d levels)", plan.domain_levels,
                    plan.ring.levels)
    return [{"part": plan.part(r).to_message(), "roots": [got[p]["root"] for p in plan.who_holds(r)]}
            for r in range(len(got))]


# ---------------------------------------------------------------------------------------------
# the thread (its stream: replicastream.py)


@dataclass(frozen=True)
class ReplicationJob:
    """A committed step to replicate: this rank's shard ref ([root, name, size, crc32c] as it
    voted) and whether this rank is the primary (it sends the global manifest too)."""

    step: int
    shard: tuple
    primary: bool


@dataclass(frozen=True)
class SourcedJob:
    """A committed step whose files the submitter names (the DCP plug-in: dcp_replicas.py):
    ``sources(channel)`` runs on the replication thread, may make collectives on the channel,
    and returns what ``Replicator._sources`` does, or (None, a ReplicationError) where every
    rank agreed on the channel that there is nothing to stream: then no round follows."""

    step: int
    primary: bool
    sources: Callable[[Coordinator], tuple[list[Source], BaseException | None]]


class Replicator:
    """A session's replication (the module docstring): ``submit`` after each commit, in commit
    order on every rank; ``pinned`` for retention; ``wait``, ``take_error``, ``close``."""

    def __init__(self, coord: Coordinator, layout: RootLayout, peers: ReplicaPeers):
        self.coord, self.layout, self.peers = coord, layout, peers
        self._cv = threading.Condition()
        self._todo: deque[ReplicationJob | SourcedJob | RefillJob] = deque()
        self._running: int | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: ReplicationError | None = None
        self.protected: int | None = None  # the newest step this session saw protected
        self._pipe: Pipeline | None = None  # the last step's pieces (a failed one's buffers stay alive)
        self._phases: dict[str, float] = {}  # seconds per phase of the step being replicated (debug log)
        self._clock: Callable[[], float] = clock_for(False)  # the step's (replicastream.profiling)
        self.stopped: str | None = None  # why the replication group broke: every later step fails at once

    def submit(self, job: ReplicationJob | SourcedJob | RefillJob) -> None:
        with self._cv:
            if self._closed:
                return
            self._todo.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="gdswriter-replicate", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def pinned(self) -> set[int]:
        """The steps waiting for or in their replication (retention keeps them)."""
        with self._cv:
            return {j.step for j in self._todo} | ({self._running} if self._running is not None else set())

    def wait(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._todo and self._running is None, timeout)

    def take_error(self) -> ReplicationError | None:
        with self._cv:
            e, self.error = self.error, None
        return e

    def close(self) -> None:
        """Wait for the replications submitted (each wait for a peer bounded by the channel's
        timeout; once stopped, the rest fail at once), then end the thread and give the channel
        back, unless it broke: a peer may still be half way through one of its collectives."""
        self.wait()
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None:
            thread.join(5.0)
        if self.stopped is None:
            self.coord.close()

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo or self._closed)
                if not self._todo:
                    self._thread = None
                    return
                job = self._todo.popleft()
                self._running = job.step
            try:
                if self.stopped is not None:
                    raise self._refused(job.step)
                if self._run(job):
                    with self._cv:
                        self.protected = max(self.protected or job.step, job.step)
            except ReplicationError as e:
                log.warning("gdswriter: %s", e)
                with self._cv:
                    self.error = e
            except BaseException as e:  # noqa: BLE001 - a bug must not leave wait() waiting forever
                log.exception("gdswriter: the replication of step %d failed", job.step)
                with self._cv:
                    self.error = ReplicationError(f"the replication of step {job.step} failed: "
                                                  f"{type(e).__name__}: {e}", job.step)
            finally:
                with self._cv:
                    self._running = None
                    self._cv.notify_all()

    def _run(self, job: ReplicationJob | SourcedJob | RefillJob) -> bool:
        """A committed step's replication, or a loaded step's refill (refill.py)."""
        if not isinstance(job, RefillJob):
            return self.replicate(job)
        try:
            return run_refill(self.coord, job, self.peers.copies)
        except CollectiveFailedError as e:
            self._stop(job.step, e)
            raise ReplicationError(f"step {job.step} was restored but not refilled: a peer failed or left during "
                                   f"the refill ({e}); replication stops: restart the job to protect steps again",
                                   job.step) from e

    def _refused(self, step: int) -> ReplicationError:
        """A later step's error once the replication group broke (``stopped``): nothing is tried."""
        kept = "no step was protected yet" if self.protected is None else \
            f"the newest protected step this job saw, {self.protected}, is kept by retention"
        return ReplicationError(f"step {step} is committed but not protected: replication to peer nodes stopped "
                                f"after {self.stopped}; restart the job to protect steps again ({kept})", step)

    def _stop(self, step: int, e: CollectiveFailedError) -> None:
        """The replication group is broken (a peer died, hung or left mid-collective): no later
        step is tried, since the ranks no longer agree on where the group's collectives stand."""
        with self._cv:
            self.stopped = f"a peer failed or left during the replication of step {step} ({describe(e)})"

    def replicate(self, job: ReplicationJob | SourcedJob) -> bool:
        """This rank's part of replicating ``job.step``; True when the step is protected.
        ReplicationError when not (this rank's or another's failure)."""
        step, rank, part = job.step, self.coord.rank, self.peers.part
        log.debug("gdswriter: rank %d replicates step %d to ranks %s, holds copies of ranks %s", rank, step,
                  list(part.sends_to), list(part.receives_from))
        what = f"replicating step {step}"
        profile = profiling()  # the phase timings: measured, and logged, only at debug
        self._clock = clock_for(profile)
        t0 = self._clock()
        self._phases = {}
        try:
            sources, error = self._sources(job)
            self._lap("sources", t0)
            if sources is None:  # every rank agreed: nothing to stream (SourcedJob), no round follows
                raise error if isinstance(error, ReplicationError) else ReplicationError(str(error), step)
            out = Outgoing(sources, error)
            problems = self._stream(step, out)
        except CollectiveFailedError as e:
            self._stop(step, e)
            raise ReplicationError(f"step {step} is committed but not protected: a peer of rank {rank} failed or "
                                   f"left during its replication ({e}); replication stops: restart the job to "
                                   f"protect steps again; the newest protected step is kept", step) from e
        if out.error is not None:
            problems.insert(0, f"its own files: {describe(out.error)}")
        mine = {"ok": not problems, "error": "; ".join(problems)[:2000]}
        t1 = self._clock()
        try:
            return self._settle(job, mine, what)
        finally:
            self._lap("settle", t1)
            if profile and self._pipe is not None:
                log.debug("gdswriter: rank %d replicated step %d in %.3f s (%s; pipeline: %s)", rank, step,
                          self._clock() - t0, ", ".join(f"{k} {v:.3f} s" for k, v in self._phases.items()),
                          self._pipe.timings())

    def _lap(self, phase: str, since: float) -> float:
        """Add the seconds since ``since`` to ``phase`` of this step's timings (logged at debug;
        with the profile off, the clock reads nothing and every phase stays 0.0)."""
        now = self._clock()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - since
        return now

    def _settle(self, job: ReplicationJob | SourcedJob, mine: dict, what: str) -> bool:
        """Every rank's outcome to the primary rank, which marks the step protected where all
        succeeded, then tells every rank; the holders of the primary's copy mark theirs."""
        step, p = job.step, self.layout.primary_rank
        try:
            got = self.coord.gather(mine, f"{what} (outcomes)", dst=p)
            verdict: dict = {}
            if got is not None:
                failures = {r: x["error"] for r, x in enumerate(got) if not x["ok"]}
                if not failures:
                    failures = self._mark(self.layout.local_paths[self.layout.local_of(0) or 0] / step_dir_name(step))
                verdict = bounded(failures) if failures else {"protected": True}
            verdict = self.coord.broadcast(verdict, f"{what} (verdict)", src=p)
        except CollectiveFailedError as e:
            self._stop(step, e)
            raise ReplicationError(f"step {step} is committed but not protected: a rank failed or left before it "
                                   f"reported its copies ({e}); replication stops: restart the job to protect "
                                   f"steps again; the newest protected step is kept", step) from e
        if not verdict.get("protected"):
            shown, total = unbound(verdict)
            listed = "; ".join(f"rank {r}: {m}" for r, m in sorted(shown.items()))
            raise ReplicationError(f"step {step} is committed but not protected: {total} rank(s) failed to copy "
                                   f"({listed}); it loads where its own nodes are; the newest protected step is kept; "
                                   f"fix what the message names (a full or failing disk?), the next steps are "
                                   f"replicated again", step)
        if p in self.peers.part.receives_from:
            copies = self.layout.local_paths[0] / step_dir_name(step) / COPIES_DIR
            failed = self._mark(copies)
            if failed:
                log.warning("gdswriter: step %d is protected, but %s could not be marked: %s", step, copies,
                            failed[self.coord.rank])
        return True

    def _mark(self, d: Path) -> dict[int, str]:
        """Write ``d/protected`` durably; {this rank: why} if it could not."""
        try:
            atomic_write(d / PROTECTED_NAME, protected_marker(self.peers.copies))
            return {}
        except OSError as e:
            return {self.coord.rank: f"writing {d / PROTECTED_NAME}: {describe(e)}"}

    def _sources(self, job: ReplicationJob | SourcedJob) -> tuple[list[Source] | None, BaseException | None]:
        """This rank's files of ``job.step``: its shard (checked against its vote), its data files
        (their chunks checked as they stream) and, on the primary rank, the global manifest.
        A failure is sent to the peers as the stream's trailer, not raised."""
        if isinstance(job, SourcedJob):
            return job.sources(self.coord)
        step, layout = job.step, self.layout
        g, name, size, crc = job.shard
        try:
            step_dir = layout.local_paths[layout.local_of(g) or 0] / step_dir_name(step)
            raw = read_regular_file(step_dir / name, size + 1)
            if len(raw) != size or _crc32c.crc32c(raw) != crc:
                raise ChecksumMismatchError(str(step_dir / name), "its manifest shard", 0, size, crc,
                                            _crc32c.crc32c(raw))
            shard = RankShard.from_json_bytes(raw, where=str(step_dir / name), step=step, rank=layout.rank,
                                              world_size=layout.world_size, n_roots=layout.root_count)
            out = [Source("shard", name, size, data=raw)]
            per_file = shard.chunks_by_file()
            for fid, f in enumerate(shard.files):
                local = layout.local_of(f.root)
                if local is None:
                    raise GDSWriterError(f"step {step}: this rank's data file {f.path} is on a root it does not see")
                out.append(Source("data", f.path, f.size, path=layout.local_paths[local] / step_dir_name(step) /
                                   f.path, chunks=tuple(per_file[fid])))
            if job.primary:
                path = layout.local_paths[layout.local_of(0) or 0] / step_dir_name(step) / MANIFEST_NAME
                data = read_regular_file(path, SMALL_LIMIT)
                gm = parse_global(data, str(path))
                if gm is None or gm.shards[layout.rank].crc32c != crc:
                    raise GDSWriterError(f"{path} is not the manifest of the save being replicated")
                out.append(Source("global", MANIFEST_NAME, len(data), data=data))
            return out, None
        except Exception as e:  # noqa: BLE001 - sent to the peers in the trailer
            return [], e

    def _stream(self, step: int, out: Outgoing) -> list[str]:
        """Send ``out`` to this rank's peers and receive the streams of the ranks it holds copies
        of, in rounds (sizes, headers, PIECE_BYTES pieces, trailers); returns what failed here."""
        me, part, what = self.coord.rank, self.peers.part, f"replicating step {step}"
        senders, dests = list(part.receives_from), list(part.sends_to)
        t = self._clock()
        sizes = {s: torch.zeros(2, dtype=torch.int64) for s in senders}
        head = torch.tensor([len(out.header), out.total], dtype=torch.int64)
        self.coord.exchange([Transfer(me, d, 0, head) for d in dests] +
                            [Transfer(s, me, 0, sizes[s]) for s in senders], f"{what} (sizes)")
        heads = {s: torch.zeros(max(int(sizes[s][0]), 1), dtype=torch.uint8) for s in senders}
        mine = torch.frombuffer(bytearray(out.header), dtype=torch.uint8)
        self.coord.exchange([Transfer(me, d, 1, mine) for d in dests] +
                            [Transfer(s, me, 1, heads[s][:int(sizes[s][0])]) for s in senders], f"{what} (headers)")
        t = self._lap("sizes+headers", t)
        problems: list[str] = []
        incoming: dict[int, Incoming | None] = {}
        copies = self.layout.local_paths[0] / step_dir_name(step) / COPIES_DIR
        for s in senders:
            try:
                if not copies.parent.is_dir():
                    raise FileNotFoundError(f"{copies.parent} does not exist (the step was deleted?)")
                copies.mkdir(exist_ok=True)
                fsync_dir(copies.parent)  # ``copies`` itself durable in the step: else a cut loses every copy
                incoming[s] = Incoming(copies, s, bytes(heads[s][:int(sizes[s][0])].numpy()))
            except Exception as e:  # noqa: BLE001 - reported to the primary rank
                incoming[s] = None
                problems.append(f"the copy of rank {s}: {describe(e)}")
        t = self._lap("copies dir", t)
        try:
            self._pipe = Pipeline(self.coord, step, out, dests, {s: int(sizes[s][1]) for s in senders}, incoming,
                                   problems)
            t = self._lap("pipeline setup", t)
            self._pipe.run()
            t = self._lap("pipeline", t)
            trailers = self._trailers(step, out, senders, dests)
            t = self._lap("trailers", t)
        except BaseException:
            for inc in incoming.values():  # a peer lost mid-stream: nothing of its copy is left behind
                if inc is not None:
                    inc.discard()
            raise
        finally:
            out.close()
        for s in senders:
            inc = incoming[s]
            if inc is None:
                continue
            try:
                inc.publish(trailers[s])
            except Exception as e:  # noqa: BLE001 - reported to the primary rank
                inc.discard()
                problems.append(f"the copy of rank {s}: {describe(e)}")
        self._lap("publish", t)
        return problems

    def _trailers(self, step: int, out: Outgoing, senders: list[int], dests: list[int]) -> dict[int, dict]:
        me = self.coord.rank
        data = out.trailer()
        if len(data) + 8 > TRAILER_BYTES:
            out.error = out.error or GDSWriterError(f"{len(out.sources)} files are too many to replicate at once")
            data = out.trailer()[:TRAILER_BYTES - 8]
        mine = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        mine[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        got = {s: torch.zeros(TRAILER_BYTES, dtype=torch.uint8) for s in senders}
        self.coord.exchange([Transfer(me, d, 1001, mine) for d in dests] +
                            [Transfer(s, me, 1001, got[s]) for s in senders], f"replicating step {step} (trailers)")
        trailers = {}
        for s, t in got.items():
            n = int(t[:8].view(torch.int64))
            try:
                trailers[s] = json.loads(bytes(t[8:8 + n].numpy()))
            except ValueError:
                trailers[s] = {"ok": False, "error": "its trailer is not readable"}
        return trailers
