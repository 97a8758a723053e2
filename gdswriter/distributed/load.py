"""A GDSCheckpointer load across ranks, on any world size: the short path and the orchestration.

The primary rank reads the step's manifest and sends it to every rank (loadmanifest.py). A
1.3 step (format/sharded.py) loaded by the ranks that saved it, with the same placements and
roots, takes the short path (``load_own``): each rank reads only its own manifest shard and
the pieces it wrote, and the holders of shared items (replicated state, replicated DTensor
blocks) pass each other their pieces, so replicated bytes are read from disk once in total.
Its plan is pure (ownplan.py: who reads which piece, the arena, the relay rounds); how the
ranks of a host share is one Transport (transport.py: each other's memory, crossmem.py; a
tmpfs, hostshare.py; or the process group), chosen by one agreement; ``carry_out_own``
executes the plan through it. Otherwise a 1.3 step with a layout index is loaded from the
shards each rank needs alone (reshard.py ``plan_indexed``). Failing that (a rank that does
not see a shard it needs, a step without an index, a 1.0-1.2 step, a step saved by a single
process), every rank works from the whole step (loadmanifest.py ``gather_merged``) and
rebuilds the state it needs (rebuild.py ``rebuild_state``).

Either way the state is rebuilt and handed to the live objects as a single-process load
does, and nothing live changes before every rank has read and verified its part into fresh
buffers and every rank agrees the plan fits (an atomic load, the default). ``load(atomic=False)``
reads and receives each storage that is one live tensor straight into it instead (no fresh
buffer, no copy; every chunk still checked where it lands), and a failure then leaves those
tensors partly written (``collective_restore``). The agreements carry typed messages
(load_messages.py).

``load(fallback=True)``: rank 0's fallback order (the latest step, then older ones) is every
rank's. After a failed step each rank says how it saw the failure (damage, another error, or
only that a peer failed), and every rank decides from the same gathered answers: the next
step when some rank found damage and none failed otherwise, else all raise. So every rank
ends on the same step, or raises, and none waits for a collective the others skipped.
"""
from __future__ import annotations

import errno
import logging
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from ..engines.base import IOEngine
from ..errors import (CheckpointNotFoundError, CollectiveFailedError, CorruptCheckpointError, EngineIOError, InvalidOptionError,
                      RankFailedError, UnreachableDataError)
from ..format.commit import CommitProtocol, step_dir_name
from ..format.dtypes import dtype_from_name
from ..format.manifest import MANIFEST_NAME, Manifest, StorageRecord
from ..format.copies import replicas_of
from ..format.sharded import GlobalManifest, RankShard, parse_shard, parse_step, read_shard
from ..format.state_codec import decode_state
from ..load.apply import LiveState, LoadResult, apply_state, match_live, plan_restore
from ..load.policy import DAMAGE
from ..load.reader import check_step_files, parse_manifest, tensors_from_storages, vanished_instead
from . import crossmem, hostshare
from .fetch import fetch_storages
from .group import Coordinator, bounded, describe, unbound
from .load_messages import FallbackDecision, OwnVerdict, ShardReport, TransportOffer, choose_transport
from .loadcopies import newest_complete, reached_copies, use_copies, verified_copies
from .loadmanifest import (broadcast_manifest, broadcast_manifest_bytes, gather_merged, json_text,  # noqa: F401
                           received_manifest)
from .loadplan import reach_of, relay, relay_between_hosts, template_of  # noqa: F401 - relay*: importable here
from .ownplan import Move, OwnLoadPlan, blocks_fit, host_blocks, per_host, plan_own, relay_rounds
from .rankfiles import disagreeing_holders, holder_set_digests
from .rebuild import live_templates, plain_blocks, rebuild_state
from .reshard import plan_indexed, read_replicated_once
from .roots import RootLayout
from .shards import assemble, is_dtensor, leaves, target_block
from .readexec import ReadPlan, chunk_range, execute, send_rounds
from .transport import CrossMemoryTransport, HostTmpfsTransport, ProcessGroupTransport, Transport

_plain_blocks = plain_blocks  # importable here under its former name (tests)
log = logging.getLogger("gdswriter")
UNCHANGED = "the live state was not changed"
IN_PLACE = ("live tensors read in place (load(atomic=False)) may hold part of the step's bytes; load an intact step "
            "(or load(atomic=True)) before training on")


def in_place_targets(live_state: dict, strict: bool) -> dict[str, torch.Tensor]:
    """Key path -> live tensor a non-atomic load reads into (load(atomic=False)): the plain CPU
    tensors of the state as saving collects it (parameters, buffers, dict and extra tensors, a
    resumed optimizer's state; no DTensor, nothing on a GPU). Without ``strict`` the optimizer's
    are left out: a non-strict plan may skip the optimizer, whose state must then stay as it is."""
    return {k: v.detach() for k, v in leaves(live_state)
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.device.type == "cpu"
            and (strict or not str(k).startswith("optimizer/"))}


def in_place(m: Manifest, targets: Mapping[str, torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """Storage -> the flat bytes of the live tensor it is read into (load.apply.match_live: the
    storage's one tensor, alike in dtype, shape and strides, contiguous, the whole storage; never
    a DTensor's block), for a non-atomic load's ``targets``; {} for an atomic load."""
    if not targets:
        return {}
    blocks = {t.storage for t in m.tensors if t.shard is not None}
    return {s: flat for s, (_, flat) in match_live(m, targets).items() if s not in blocks}


def _own_verdict(coord: Coordinator, layout: RootLayout, g: GlobalManifest, templates: dict[str, Any], *,
                 what: str, src: int, share_dir: str | None, cross_memory: bool
                 ) -> tuple[RankShard | None, list[Path | None], OwnVerdict]:
    """Collective: this rank's own shard (read where it can), where it finds the roots, and the
    ranks' verdict (one decide_each): whether every rank loads from its own shard, and how the
    ranks of each host may share (a tmpfs token and block, a cross-memory block and peers)."""
    unchanged = "the live state was not changed"
    rank, world = coord.rank, coord.world_size
    shard: RankShard | None = None
    reach: list[Path | None] = []
    ok, error = False, None
    try:
        if g.world_size == world:
            reach = reach_of(g, layout)
            ref = g.shards[rank]
            if reach[ref.root] is not None:
                d = reach[ref.root] / step_dir_name(g.step)  # type: ignore[operator]
                shard = parse_shard(read_shard(d, g, ref, reach[0]), g, ref, str(d / ref.name))
                ok = all(reach[f.root] is not None for f in shard.files) and blocks_fit(shard, templates)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    # every rank can load from its own shard, and the holders of each set of shared items agree
    # on what it holds (else the pieces they would pass each other would not match)
    sets = holder_set_digests(shard.items, rank, world) if shard is not None else ()

    def judge(outs: list[Any]) -> list[dict]:
        reports = [ShardReport.from_wire(x) for x in outs]
        own = all(x.ok for x in reports)
        bad = disagreeing_holders([x.sets for x in reports]) if own else {}
        block = host_blocks([x.host for x in reports])
        cblock = host_blocks([x.proc for x in reports]) if own else None
        share = hostshare.token() if own and block else None
        shown, total = unbound(bounded(bad))
        # each rank gets the (pid, marker) of its own host's ranks only
        peers = per_host([x.pid for x in reports], cblock) if cblock else [None] * len(outs)
        return [OwnVerdict(own, share, block, cblock, total, tuple(sorted(shown.items())),
                           tuple(p) if p is not None else None).to_wire() for p in peers]

    proc = crossmem.domain() if cross_memory and world > 1 else None
    report = ShardReport(ok, sets, hostshare.domain(share_dir), proc, crossmem.marker() if proc else None)
    verdict = OwnVerdict.from_wire(coord.decide_each(error, report.to_wire(), f"{what} (reading its manifest shard)",
                                                     judge, hint=unchanged, root=src))
    if verdict.failed:
        shown, total = verdict.shown_failures, verdict.failed
        raise CorruptCheckpointError(f"{what}: the ranks' manifest shards disagree about the state they share "
                                     f"({'; '.join(f'rank {r} {m}' for r, m in sorted(shown.items()))}"
                                     f"{f' and {total - len(shown)} more' if total > len(shown) else ''}): the "
                                     f"checkpoint is damaged; load an earlier step")
    return shard, reach, verdict


def load_own(coord: Coordinator, layout: RootLayout, g: GlobalManifest, templates: dict[str, Any],
             engine: IOEngine, *, verify: bool, what: str, src: int, share_dir: str | None = None,
             cross_memory: bool = False, check: Callable[[Any], Any] = lambda state: None,
             targets: Mapping[str, torch.Tensor] | None = None) -> tuple[Any, Any] | None:
    """Collective: this rank's saved state from its own shard alone, when every rank can do so
    (the same world size, its shard and data files on roots it sees, its DTensor blocks the
    ones its live tensors hold), else None on every rank (then ``gather_merged``). Items
    several ranks hold are read once: each holder reads the pieces it wrote and sends them to
    the other holders (split_stream gives every holder the same pieces with no message; each
    piece spreads down a binomial tree, ``relay``), so N ranks loading replicated state read its
    bytes from disk once in total. How the ranks of a host share (transport.py) is agreed once
    (``_agree_transport``): with ``cross_memory``, where the ranks of each host may read each
    other's memory (crossmem.py: probed before any byte is read), the state every rank holds,
    and a replica group's whose holders are all on one host, is read into one buffer per rank
    laid out alike (ownplan.py ``Arena``), and each rank copies the pieces it lacks from the
    rank of its host that holds them: on one host nothing travels, and across hosts each piece
    of the state every rank holds crosses to each other host once (``relay_between_hosts``)
    before the ranks there copy it. Else, where the ranks of each host see one tmpfs
    ``share_dir`` (hostshare.py), the holders on a host read their pieces into one shared file
    per item instead, with the same relay between hosts; else the process group. The plan
    (ownplan.py ``plan_own``) is pure; ``carry_out_own`` executes it. Returns (the state,
    ``check(state)``), ``check`` agreed on with the rebuilding (plan_restore: one collective).
    ``targets`` (load(atomic=False), ``in_place_targets``): over the process group, the items
    that are one live tensor each are read and received into it (``carry_out_own``)."""
    shard, reach, verdict = _own_verdict(coord, layout, g, templates, what=what, src=src, share_dir=share_dir,
                                         cross_memory=cross_memory)
    if not verdict.own:
        return None
    assert shard is not None
    plan: OwnLoadPlan | None = None
    error = None
    try:
        plan = plan_own(shard, coord.rank, coord.world_size, what=what,
                        pull_block=verdict.cblock if verdict.peers else None,
                        share_block=verdict.block if verdict.share else None)
        check_step_files(g.step, g.created_unix, reach, shard.files)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    transport = _agree_transport(coord, shard, plan, verdict, error, share_dir=share_dir, what=what, src=src)
    assert plan is not None
    return carry_out_own(coord, g, shard, reach, plan, transport, templates, engine, verify=verify, what=what, src=src,
                         check=check, targets=targets)


def _agree_transport(coord: Coordinator, shard: RankShard, plan: OwnLoadPlan | None, verdict: OwnVerdict,
                     error: BaseException | None, *, share_dir: str | None, what: str, src: int) -> Transport:
    """Collective: one agreement that the data files are right on every rank (``error``), and
    how the ranks of a host share what they read: pulling from each other's memory where every
    rank can, else the tmpfs where every rank mapped its files, else the process group."""
    unchanged = "the live state was not changed"
    world = coord.world_size
    pulling = plan is not None and bool(plan.arena.items)
    cma: CrossMemoryTransport | None = None
    share: HostTmpfsTransport | None = None
    cma_error = share_error = None
    if pulling and error is None:  # may this rank read the memory of every other rank of its host?
        cma, cma_error = CrossMemoryTransport.probe(world, verdict.cblock, plan, verdict.peers)  # type: ignore[arg-type]
    if verdict.share and error is None and not pulling:
        share, share_error = _open_shared(shard, share_dir, verdict.share, plan.sharable, world,  # type: ignore[union-attr]
                                          verdict.block)
    try:
        mode = coord.decide(error, TransportOffer(cma is not None, share is not None).to_wire(),
                            f"{what} (checking the data files)", choose_transport, hint=unchanged, root=src)
    finally:
        if share is not None:  # every rank has mapped the files, gave up or raises: no name outlives the load
            share.unlink()
    if pulling and mode != "cma" and verdict.share:  # some rank may not pull: the tmpfs, as without
        share, share_error = _open_shared(shard, share_dir, verdict.share, plan.sharable, world,  # type: ignore[union-attr]
                                          verdict.block)
        try:
            mode = "tmpfs" if coord.decide(None, share is not None, f"{what} (sharing through {share_dir})", all,
                                           hint=unchanged, root=src) else None
        finally:
            if share is not None:
                share.unlink()
    if mode != "cma" and cma_error is not None:
        log.warning("gdswriter: %s: the ranks cannot read each other's memory (%s); they share the read %s",
                    what, describe(cma_error), "through " + str(share_dir) if mode == "tmpfs" else
                    "over the process group")
    if mode is None and share_error is not None:
        log.warning("gdswriter: %s: not sharing the read through %s (%s); the ranks pass the pieces to "
                    "each other instead", what, share_dir, describe(share_error))
    if mode == "cma":
        return cma  # type: ignore[return-value]
    if mode == "tmpfs":
        return share  # type: ignore[return-value]
    return ProcessGroupTransport(world)


def carry_out_own(coord: Coordinator, g: GlobalManifest, shard: RankShard, reach: list[Path | None], plan: OwnLoadPlan,
               transport: Transport, templates: dict[str, Any], engine: IOEngine, *, verify: bool, what: str,
               src: int, check: Callable[[Any], Any], targets: Mapping[str, torch.Tensor] | None = None
               ) -> tuple[Any, Any]:
    """Collective: ``plan`` carried out through ``transport``: each rank reads its pieces, the
    relay rounds run over the process group, the ranks of a host pull from each other where the
    transport does, and the state is rebuilt and checked (one agreement, which with cross
    memory also tells that every rank has pulled: only after it may a rank free or change the
    buffer its peers copy from). ``targets`` (a non-atomic load) with the process group or
    cross memory as the transport: an item that is one live tensor is read, received and
    pulled into that tensor itself (``in_place``), no fresh buffer and no copy (its host's
    ranks pull their pieces from it); each piece read is checked as it is read, and a failure
    leaves those tensors partly written (the errors' hints say so)."""
    rank, world = coord.rank, coord.world_size
    rounds: list[list[Move]] = []
    buffers: list[torch.Tensor] = []
    into: list[torch.Tensor] = []
    error = None
    direct: dict[int, torch.Tensor] = {}
    try:
        rounds = relay_rounds(shard, plan.pieces, rank, world, transport.block, transport.shared)
        if targets and transport.kind in (ProcessGroupTransport.kind, CrossMemoryTransport.kind):
            direct = in_place(_views(g, shard), targets)
            if transport.kind == CrossMemoryTransport.kind:
                direct = transport.addressable(direct)  # type: ignore[attr-defined]
        # with the tmpfs, shared on this host: read into the shared file, viewed through this rank's private mapping
        buffers, into = transport.buffers(shard.items, direct)
        _read_pieces(g, shard, reach, into, engine, verify=verify)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = vanished_instead(g.step, g.created_unix, reach, [f.root for f in shard.files], e) or e
    unchanged = IN_PLACE if direct else UNCHANGED
    # once every rank has read (this agreement), the shared files hold every piece read on their
    # host; pulling ranks learn where the buffers of their host's ranks are
    bases = coord.decide_each(error, transport.address(), f"{what} (reading)", transport.route, hint=unchanged,
                              root=src)
    tags: dict[tuple[int, int], int] = {}  # numbered across rounds: a pair's messages never match another's
    send_rounds(coord, rounds, into, tags, what)
    if not transport.keeps_into():  # (with cross memory the fallback after a failed copy still sends from and into them)
        into = []
    transport.release()
    if transport.block < world and transport.within_host:  # the pieces from other hosts are on this host now
        coord.agree(None, f"{what} (pieces from other hosts)", hint=unchanged, root=src)
    pull_error = transport.pull(plan, bases)
    state, checked, error = _rebuild_own(g, shard, buffers, templates, check)
    pulled = coord.decide(error, pull_error is None, f"{what} (rebuilding the state and checking it against the live "
                                                     f"state)", all, hint=unchanged, root=src)
    if not pulled:  # some rank could not copy from its peers: those items over the process group
        if pull_error is not None:
            log.warning("gdswriter: %s: reading a peer rank's memory failed (%s); the ranks pass the pieces to "
                        "each other instead", what, describe(pull_error))
        pieces_only = [plan.pieces[sid] if sid in plan.arena.offsets else () for sid in range(len(shard.items))]
        send_rounds(coord, relay_rounds(shard, pieces_only, rank, world, world, set()), into, tags,
                    f"{what} (after a failed copy from a peer's memory)")
        state, checked, error = _rebuild_own(g, shard, buffers, templates, check)  # on the bytes received
        coord.agree(error, f"{what} (rebuilding the state)", hint=unchanged, root=src)
    return state, checked


def _read_pieces(g: GlobalManifest, shard: RankShard, reach: list[Path | None], into: Sequence[torch.Tensor],
                 engine: IOEngine, *, verify: bool) -> None:
    """Read the pieces this rank wrote (its shard's chunks) into ``into``, each checked: one
    plan (``own_read_plan``) carried out by readexec.py's executor."""
    out = execute(own_read_plan(g, shard), reach, engine, verify=verify, given=dict(enumerate(into)))
    if out.error is not None:
        raise out.error


def own_read_plan(g: GlobalManifest, shard: RankShard) -> ReadPlan:
    """The reads of the own-shard short path: each chunk of ``shard`` with bytes into its item's
    buffer (key: the item's index), checked as it is read."""
    name = f"<piece of {shard.items[0].key[:16]}>" if shard.items else ""
    reads = tuple(chunk_range(c, sid, c.storage_offset, name) for sid, cs in enumerate(shard.chunks) for c in cs
                  if c.length)
    return ReadPlan(g.step, g.created_unix, shard.files, reads)


def _rebuild_own(g: GlobalManifest, shard: RankShard, buffers: Sequence[torch.Tensor], templates: dict[str, Any],
                 check: Callable[[Any], Any]) -> tuple[Any, Any, BaseException | None]:
    """(the state, ``check(state)``, None) rebuilt from ``buffers``, or (None, None, the failure)."""
    try:
        tensors = tensors_from_storages(_views(g, shard), buffers)  # type: ignore[arg-type]
        for i, rec in enumerate(shard.tensors):
            if rec.shard is not None:
                offsets, shape, wrap = target_block(template_of(templates, rec.name), rec.shard.global_shape)
                tensors[i] = wrap(assemble(rec.name, offsets, shape, dtype_from_name(rec.dtype),
                                           [(rec.shard, tensors[i])]))
        state = decode_state(shard.tree, tensors)
        return state, check(state), None
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        return None, None, e


def _views(g: GlobalManifest, shard: RankShard) -> Manifest:
    """The tensors of ``shard`` as views of its items (a storage per item; no file, no chunk)."""
    return Manifest(step=g.step, files=(), storages=tuple(StorageRecord(it.nbytes, ()) for it in shard.items),
                    tensors=shard.tensors, state=shard.tree)


def _open_shared(shard: RankShard, share_dir: str | None, token: str, sids: Sequence[int], world: int,
                 block: int | None) -> tuple[HostTmpfsTransport | None, BaseException | None]:
    """This rank's shared files for the items ``sids`` (HostTmpfsTransport.open), or the error
    that prevented them (then no rank shares)."""
    try:
        return HostTmpfsTransport.open(world, block, share_dir, token, shard, sids), None
    except Exception as e:  # noqa: BLE001 - reported by the caller
        return None, e


def _prepare(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState, live_state: dict,
             step: int | None, engine: IOEngine, *, strict: bool, verify: bool,
             share_dir: str | None = None, cross_memory: bool = False,
             targets: Mapping[str, torch.Tensor] | None = None) -> tuple[int, Any, Any]:
    """Collective: (step, state, plan) of ``step`` (None: the latest), read, verified and checked
    against the live state on every rank; nothing live has changed yet (with ``targets``, a
    non-atomic load: the live tensors read in place hold the step's bytes). A step saved with
    replicas reads each rank's files from its own root, else from the first copy a rank sees,
    and after damage from the places loadcopies.verified_copies found good (loadcopies.py)."""
    src = layout.primary_rank
    step, raw = broadcast_manifest_bytes(coord, protocol, step, "loading" if step is None else f"loading step {step}",
                                         src=src)
    what = f"loading step {step}"
    where = str(protocol.step_dir(step) / MANIFEST_NAME)
    parsed = parse_step(raw, where)
    copies = replicas_of(parsed, where) if isinstance(parsed, GlobalManifest) else None
    args = (coord, layout, protocol, live, live_state, step, engine)
    kw: dict[str, Any] = {"strict": strict, "verify": verify, "share_dir": share_dir, "cross_memory": cross_memory,
                          "targets": targets}
    if copies is None:
        return _prepare_parsed(*args, parsed, **kw)
    g: GlobalManifest = parsed  # type: ignore[assignment]
    try:
        return _prepare_parsed(*args, use_copies(layout, g, reached_copies(layout, g, copies, what), what), **kw)
    except CollectiveFailedError:
        raise
    except Exception as e:  # noqa: BLE001 - decided together below
        failure = e
    verdicts = {"damage", "unreached"}
    mine = "unreached" if isinstance(failure, UnreachableDataError) else _verdict(failure)
    retry = coord.decide(None, mine, f"{what} (whether to check the copies)",
                         lambda vs: bool(verdicts & set(vs)) and not ({"other", "gone"} & set(vs)), root=src)
    if not retry:
        raise failure
    del failure
    log.warning("gdswriter: %s failed on damaged or unreachable files; checking every rank's files and their copies",
                what)
    with verified_copies(coord, layout, g, copies, engine, what=what, src=src) as v:  # v.layout: copies held in memory
        return _prepare_parsed(coord, v.layout, *args[2:], use_copies(v.layout, v.g, v.choice, what), **kw)


def _prepare_parsed(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                    live_state: dict, step: int, engine: IOEngine, parsed: GlobalManifest | Manifest, *, strict: bool,
                    verify: bool, share_dir: str | None = None, cross_memory: bool = False,
                    targets: Mapping[str, torch.Tensor] | None = None) -> tuple[int, Any, Any]:
    """_prepare of the step whose manifest is ``parsed``; ``targets``: the live tensors a
    non-atomic load reads into (the own-shard path and the merged path's fetch)."""
    src = layout.primary_rank
    what = f"loading step {step}"
    templates = live_templates(live_state, live.optimizer)
    g = parsed if isinstance(parsed, GlobalManifest) else None

    def check(state: Any) -> Any:  # every key, shape and dtype, on every rank, before any live byte changes
        return plan_restore(state, live, strict)

    own = None if g is None else load_own(coord, layout, g, templates, engine, verify=verify, what=what, src=src,
                                          share_dir=share_dir, cross_memory=cross_memory, check=check,
                                          targets=targets)
    if own is not None:
        return (step, *own)
    state = None
    if g is not None:  # another layout: the shards this rank needs (the layout index)
        indexed = plan_indexed(coord, layout, g, templates, what=what, src=src)
        if indexed is not None:
            state = rebuild_state(coord, layout, indexed[0], templates, live.optimizer, engine, verify=verify,
                                  what=what, fetch=indexed[1])
    if state is None:
        m = parse_manifest(protocol, step, parsed) if g is None else gather_merged(coord, layout, g, what, src)
        error = None
        if m.dist is not None and m.dist.layout != "gdswriter":
            error = InvalidOptionError(f"step {step} was saved through torch.distributed.checkpoint: load it with "
                                       f"dcp.load(state_dict, storage_reader=GDSStorageReader(root, step={step}))")
        coord.agree(error, what, hint="the live state was not changed")
        # a non-atomic load of a multi-rank step: each storage that is one live tensor is read and received into it
        into = in_place(m, targets) if g is not None else {}
        state = rebuild_state(coord, layout, m, templates, live.optimizer, engine, verify=verify, what=what,
                              single=g is None and m.dist is None, read_once=read_replicated_once,
                              fetch=partial(fetch_storages, into=into) if into else fetch_storages)
    plan, error = None, None
    try:
        plan = check(state)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (checking the live state)", hint=IN_PLACE if targets else UNCHANGED)
    return step, state, plan


def _verdict(e: BaseException) -> str | None:
    """How this rank saw a failed attempt at loading a step: "gone" (deleted while it was read:
    CheckpointNotFoundError), "damage" (the step's manifest, files, checksums or an EIO reading
    them: load.policy.restore_newest_intact's test), "other" (a failure of its own that is no
    damage), None (it only learnt that another rank failed)."""
    if isinstance(e, RankFailedError):
        return None
    if isinstance(e, CheckpointNotFoundError):
        return "gone"
    if isinstance(e, DAMAGE) and not (isinstance(e, EngineIOError) and not isinstance(e, CorruptCheckpointError)
                                       and e.errno != errno.EIO):
        return "damage"
    return "other"


def _fallback_steps(coord: Coordinator, protocol: CommitProtocol, src: int) -> list[int]:
    """Collective: the primary rank's fallback order (the latest step, then older ones), on every rank."""
    order: dict = {}
    error = None
    if coord.rank == src:
        try:
            order = {"steps": protocol.fallback_order()}
        except Exception as e:  # noqa: BLE001 - every rank raises below
            error, order = e, {"error": describe(e)}
    order = coord.broadcast(order, "loading the newest intact step (steps)", src=src)
    if "error" in order:
        coord.agree(error or RuntimeError(order["error"]) if coord.rank == src else None,
                    "loading the newest intact step (steps)", hint="the live state was not changed")
    return list(order["steps"])


def _newest_intact(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                   live_state: dict, engine: IOEngine, *, strict: bool, verify: bool, share_dir: str | None = None,
                   cross_memory: bool = False) -> tuple[int, Any, Any, tuple[int, ...]]:
    """Collective _prepare of the newest intact step (load(fallback=True)). The primary rank's
    fallback order is every rank's; after a failed step every rank tells it how it saw the failure,
    and it decides for all (a broadcast naming at most MAX_SHOWN_FAILURES damaged ranks: a rank
    receives the same few bytes whatever the world size): the next step when some rank found
    damage, or the step gone (deleted while it was read: then the order is read again, once),
    and none failed otherwise, else every rank raises."""
    src = layout.primary_rank  # the rank that reads the primary root (rank 0 unless a restart moved it)
    steps = _fallback_steps(coord, protocol, src)
    if not steps:  # no committed step: the usual CheckpointNotFoundError, on every rank
        return (*_prepare(coord, layout, protocol, live, live_state, None, engine, strict=strict, verify=verify,
                                   share_dir=share_dir, cross_memory=cross_memory), ())
    damaged: list[int] = []
    problems: list[str] = []
    tried: set[int] = set()
    again = True
    while steps:
        step = steps.pop(0)
        tried.add(step)
        try:
            return (*_prepare(coord, layout, protocol, live, live_state, step, engine, strict=strict, verify=verify,
                              share_dir=share_dir, cross_memory=cross_memory), tuple(damaged))
        except CollectiveFailedError:
            raise  # the group is broken: no further collective can agree on anything
        except Exception as e:  # noqa: BLE001 - decided together below
            failure = e
        what = f"loading step {step} (deciding whether to fall back)"
        verdicts = coord.gather(_verdict(failure), what, dst=src)  # decided on src: every rank gets a bounded answer
        decision = None
        if verdicts is not None:
            shown, total = unbound(bounded({r: "damage" for r, v in enumerate(verdicts) if v == "damage"}))
            decision = FallbackDecision("other" in verdicts, "gone" in verdicts, total,
                                        tuple(sorted(shown.items()))).to_wire()
        decided = FallbackDecision.from_wire(coord.broadcast(decision, f"{what} (decision)", src=src))
        shown, total = dict(decided.shown), decided.failed
        if decided.other or not (total or decided.gone):
            raise failure
        if not total:  # deleted while it was read: gone, not damaged
            log.info("gdswriter: step %d under %s was deleted while it was being read; trying the newest step left",
                     step, protocol.primary)
            if again:
                steps, again = [s for s in _fallback_steps(coord, protocol, src) if s not in tried], False
            del failure
            continue
        more = f" and {total - len(shown)} more" if total > len(shown) else ""
        found = " ".join(str(failure).split()) if _verdict(failure) == "damage" else \
            f"rank(s) {sorted(shown)}{more} found it damaged"
        log.warning("gdswriter: step %d under %s is damaged, trying an older step: %s", step, protocol.primary, found)
        damaged.append(step)
        problems.append(f"step {step}: {found}")
        del failure
    if not problems:
        raise CheckpointNotFoundError(errno.ENOENT, f"every step tried under {protocol.primary} ({sorted(tried)}) was "
                                                    f"deleted while it was being read: load again")
    raise CorruptCheckpointError(f"no intact step under {protocol.primary}: " + "; ".join(problems))


def collective_restore(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                       live_state: dict, step: int | None, engine: IOEngine, *, strict: bool, verify: bool,
                       fallback: bool = False, share_dir: str | None = None, cross_memory: bool = False,
                       atomic: bool = True) -> LoadResult:
    """Collective: restore ``live`` on every rank from ``step`` (None: the latest; with
    ``fallback`` the newest intact step, see GDSCheckpointer.load). ``live_state`` is what saving
    ``live`` would collect (its tensors say what each rank needs).

    ``atomic`` (the default): every rank reads into fresh buffers and verifies every chunk, and
    all ranks agree that every rank did, before any live tensor changes, so a damaged step
    leaves the live state untouched on every rank. Without it (load(atomic=False); not with
    ``fallback``, which stays atomic: a damaged step is passed over untouched), the storages
    that are one plain CPU live tensor each (``in_place_targets``) are read and received
    straight into those tensors, with no fresh buffer and no copy: every chunk is still checked
    against its crc32c where it lands (read or received; a bad copy still moves to the next
    one), but a load that fails leaves those tensors partly written (its error's hint says so;
    no load_state_dict has run): load an intact step before training on. ``share_dir``: the
    tmpfs through which ranks on one host share what they read (DistOptions.load_share_dir);
    ``cross_memory``: they pull it from each other's memory instead where they can
    (DistOptions.load_cross_memory)."""
    damaged: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    targets = in_place_targets(live_state, strict) if not atomic and not fallback else None
    if fallback:
        step, state, plan, damaged = _newest_intact(coord, layout, protocol, live, live_state, engine, strict=strict,
                                                    verify=verify, share_dir=share_dir,
                                                    cross_memory=cross_memory)
        if damaged:
            log.warning("gdswriter: loaded step %d, the newest intact step (passed over damaged step(s) %s)",
                        step, list(damaged))
    else:  # a plain load() passes over the newest steps whose files were lost with a node (loadcopies.py)
        (step, state, plan), lost = _noted(targets, lambda: newest_complete(
            step, lambda s: _prepare(coord, layout, protocol, live, live_state, s, engine, strict=strict,
                                     verify=verify, share_dir=share_dir, cross_memory=cross_memory,
                                     targets=targets),
            lambda: _fallback_steps(coord, protocol, layout.primary_rank), protocol.primary))
    error = None
    try:
        apply_state(live, state, plan)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"loading step {step} (applying)", hint="ranks that did not fail loaded the step; fix the "
                                                               "problem and load again")
    return LoadResult(step, tuple(plan.loaded), tuple(plan.skipped), tuple(plan.missing), tuple(plan.unexpected),
                      atomic=verify and not targets, damaged=damaged, lost=lost)


def _noted(targets: Mapping[str, torch.Tensor] | None, prepare: Callable[[], Any]) -> Any:
    """``prepare()``; its failure, in a non-atomic load (``targets``), noted as leaving the live
    tensors read in place partly written (as the single-process in-place load notes it)."""
    try:
        return prepare()
    except Exception as e:
        if targets:
            e.add_note(f"gdswriter: {IN_PLACE}")
        raise


def collective_load(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                    live_state: dict, step: int | None, engine: IOEngine, *, strict: bool, verify: bool) -> int:
    """collective_restore of ``step`` (None: the latest); returns the step."""
    return collective_restore(coord, layout, protocol, live, live_state, step, engine, strict=strict,
                              verify=verify).step
