"""A GDSCheckpointer load across ranks, on any world size.

Rank 0 reads the manifest and sends it to every rank. Each rank takes the state tree it
saved (rank 0's, with its own top-level entries; a rank the save did not have takes rank
0's), and works out what it needs: every plain tensor its tree references, and of each
sharded tensor the block its live tensor holds now (a DTensor's shard on the current mesh, or
the whole tensor for a plain one), assembled from the saved blocks that intersect it. The
storages are fetched (dist/fetch.py: read where reachable, sent by another rank where not),
the state is rebuilt and handed to the live objects as a single-process load does. Nothing
live changes before every rank has read and verified its part into fresh buffers and every
rank agrees the plan fits (a collective load is always atomic).

``load(fallback=True)``: rank 0's fallback order (the latest step, then older ones) is every
rank's. After a failed step each rank says how it saw the failure (damage, another error, or
only that a peer failed), and every rank decides from the same gathered answers: the next
step when some rank found damage and none failed otherwise, else all raise. So every rank
ends on the same step, or raises, and none waits for a collective the others skipped.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import replace
from typing import Any

import torch

from ..engines.base import IOEngine
from ..errors import (CollectiveFailedError, CorruptCheckpointError, EngineIOError, InvalidOptionError,
                      RankFailedError)
from ..format.commit import CommitProtocol
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..format.state_codec import decode_state
from ..load.apply import LiveState, LoadResult, apply_state, plan_restore
from ..load.policy import DAMAGE
from ..load.reader import parse_manifest, read_manifest_bytes, tensors_from_storages
from .assemble import tree_for_rank
from .fetch import fetch_storages, manifest_reach
from .group import Coordinator, describe
from .roots import RootLayout
from .shards import assemble, join, leaves, overlap, target_block

log = logging.getLogger("gdswriter")


def broadcast_manifest(coord: Coordinator, protocol: CommitProtocol, step: int | None, what: str, src: int = 0
                       ) -> tuple[int, Manifest]:
    """Collective: rank ``src`` (the primary rank: it sees the primary root) resolves ``step``
    (None: the latest) and sends its manifest to every rank."""
    msg: dict = {}
    error = None
    if coord.rank == src:
        try:
            step = protocol.require(step)
            msg = {"step": step, "manifest": read_manifest_bytes(protocol, step).decode()}
        except Exception as e:  # noqa: BLE001 - every rank raises below
            error, msg = e, {"error": describe(e)}
    msg = coord.broadcast(msg, f"{what} (manifest)", src=src)
    if "error" in msg:
        coord.agree(error or RuntimeError(msg["error"]) if coord.rank == src else None, what,
                    hint="the live state was not changed")
    return msg["step"], parse_manifest(protocol, msg["step"], msg["manifest"].encode())


def tensor_refs(tree: Any) -> list[int]:
    """The tensor indices a state tree references, in order, once each."""
    out: dict[int, None] = {}

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if len(v) == 1 and ("$tensor" in v or "$ndarray" in v):
                i = next(iter(v.values()))
                if isinstance(i, int):
                    out[i] = None
                return
            for x in v.values():
                walk(x)

    walk(tree)
    return list(out)


def live_templates(state: Any, optimizer: Any) -> dict[str, Any]:
    """Key path -> live tensor (DTensor or plain) of the live ``state`` (as the checkpointer
    collects it), named as the manifest names saved ones; the optimizer's parameters also stand
    for their (not yet created) per-parameter state."""
    out = dict(leaves(state))
    if optimizer is not None and hasattr(optimizer, "param_groups") and isinstance(state.get("optimizer"), dict):
        for saved, group in zip(state["optimizer"].get("param_groups", []), optimizer.param_groups):
            for pid, p in zip(saved.get("params", []), group["params"]):
                out.setdefault(join("optimizer/state", pid), p)
    return out


def _template(templates: dict[str, Any], name: str) -> Any:
    hit = templates.get(name)
    if hit is None and name.startswith("optimizer/state/"):
        hit = templates.get(name.rsplit("/", 1)[0])  # the parameter whose moments these are
    return hit


def rebuild_state(coord: Coordinator, layout: RootLayout, m: Manifest, templates: dict[str, Any],
                  optimizer: Any, engine: IOEngine, *, verify: bool, what: str) -> Any:
    """Collective: the state this rank saved in ``m``, its sharded tensors assembled as the
    ``templates`` (live tensors by key path) hold them now; the whole tensor without one."""
    unchanged = "the live state was not changed"
    needed: set[int] = set()
    jobs: dict[str, tuple] = {}
    refs: list[int] = []
    tree = None
    error = None
    try:
        tree = tree_for_rank(m, coord.rank)
        refs = tensor_refs(tree)
        for i in refs:
            rec = m.tensors[i]
            if rec.shard is None:
                needed.add(rec.storage)
            elif rec.name not in jobs:
                offsets, shape, wrap = target_block(_template(templates, rec.name), rec.shard.global_shape)
                blocks = [j for j, r in enumerate(m.tensors) if r.shard is not None and r.name == rec.name
                          and overlap(offsets, shape, r.shard.offsets, r.shape) is not None]
                needed.update(m.tensors[j].storage for j in blocks)
                jobs[rec.name] = (offsets, shape, wrap, blocks)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (planning)", hint=unchanged)
    # buffers are allocated once every rank has checked the files it reads (fetch_storages)
    buffers = fetch_storages(coord, manifest_reach(m, layout), m, needed, engine, verify=verify, what=what)
    error, state = None, None
    try:
        views = [i for i in refs if m.tensors[i].shard is None]
        views += sorted({j for *_, blocks in jobs.values() for j in blocks})
        built = dict(zip(views, tensors_from_storages(replace(m, tensors=tuple(m.tensors[i] for i in views)),
                                                      buffers)))  # type: ignore[arg-type]
        tensors = [built.get(i, torch.empty(0, dtype=dtype_from_name(r.dtype))) for i, r in enumerate(m.tensors)]
        for i in refs:
            rec = m.tensors[i]
            if rec.shard is not None:
                offsets, shape, wrap, blocks = jobs[rec.name]
                local = assemble(rec.name, offsets, shape, dtype_from_name(rec.dtype),
                                 [(m.tensors[j].shard, built[j]) for j in blocks])
                tensors[i] = wrap(local)
        state = decode_state(tree, tensors)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (rebuilding the state)", hint=unchanged)
    return state


def _prepare(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState, live_state: dict,
             step: int | None, engine: IOEngine, *, strict: bool, verify: bool) -> tuple[int, Any, Any]:
    """Collective: (step, state, plan) of ``step`` (None: the latest), read, verified and checked
    against the live state on every rank; nothing live has changed yet."""
    step, m = broadcast_manifest(coord, protocol, step, "loading" if step is None else f"loading step {step}",
                                 src=layout.primary_rank)
    what = f"loading step {step}"
    error = None
    if m.dist is not None and m.dist.layout != "gdswriter":
        error = InvalidOptionError(f"step {step} was saved through torch.distributed.checkpoint: load it with "
                                   f"dcp.load(state_dict, storage_reader=GDSStorageReader(root, step={step}))")
    coord.agree(error, what, hint="the live state was not changed")
    state = rebuild_state(coord, layout, m, live_templates(live_state, live.optimizer), live.optimizer, engine,
                          verify=verify, what=what)
    plan = None
    try:  # every key, shape and dtype is checked on every rank before any live byte changes
        plan = plan_restore(state, live, strict)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (checking the live state)", hint="the live state was not changed")
    return step, state, plan


def _verdict(e: BaseException) -> str | None:
    """How this rank saw a failed attempt at loading a step: "damage" (the step's manifest, files,
    checksums or an EIO reading them: load.policy.restore_newest_intact's test), "other" (a failure
    of its own that is no damage), None (it only learnt that another rank failed)."""
    if isinstance(e, RankFailedError):
        return None
    if isinstance(e, DAMAGE) and not (isinstance(e, EngineIOError) and not isinstance(e, CorruptCheckpointError)
                                       and e.errno != errno.EIO):
        return "damage"
    return "other"


def _newest_intact(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                   live_state: dict, engine: IOEngine, *, strict: bool, verify: bool
                   ) -> tuple[int, Any, Any, tuple[int, ...]]:
    """Collective _prepare of the newest intact step (load(fallback=True)). The primary rank's
    fallback order is every rank's; after a failed step every rank says how it saw the failure and all
    decide alike from the same answers: the next step when some rank found damage and none
    failed otherwise, else every rank raises."""
    order: dict = {}
    error = None
    src = layout.primary_rank  # the rank that reads the primary root (rank 0 unless a restart moved it)
    if coord.rank == src:
        try:
            order = {"steps": protocol.fallback_order()}
        except Exception as e:  # noqa: BLE001 - every rank raises below
            error, order = e, {"error": describe(e)}
    order = coord.broadcast(order, "loading the newest intact step (steps)", src=src)
    if "error" in order:
        coord.agree(error or RuntimeError(order["error"]) if coord.rank == src else None,
                    "loading the newest intact step (steps)", hint="the live state was not changed")
    if not order["steps"]:  # no committed step: the usual CheckpointNotFoundError, on every rank
        return (*_prepare(coord, layout, protocol, live, live_state, None, engine, strict=strict, verify=verify), ())
    damaged: list[int] = []
    problems: list[str] = []
    for step in order["steps"]:
        try:
            return (*_prepare(coord, layout, protocol, live, live_state, step, engine, strict=strict, verify=verify),
                    tuple(damaged))
        except CollectiveFailedError:
            raise  # the group is broken: no further collective can agree on anything
        except Exception as e:  # noqa: BLE001 - decided together below
            failure = e
        verdicts = coord.all_gather(_verdict(failure), f"loading step {step} (deciding whether to fall back)")
        if "other" in verdicts or "damage" not in verdicts:
            raise failure
        found = " ".join(str(failure).split()) if _verdict(failure) == "damage" else \
            f"rank(s) {[r for r, v in enumerate(verdicts) if v == 'damage']} found it damaged"
        log.warning("gdswriter: step %d under %s is damaged, trying an older step: %s", step, protocol.primary, found)
        damaged.append(step)
        problems.append(f"step {step}: {found}")
        del failure
    raise CorruptCheckpointError(f"no intact step under {protocol.primary}: " + "; ".join(problems))


def collective_restore(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                       live_state: dict, step: int | None, engine: IOEngine, *, strict: bool, verify: bool,
                       fallback: bool = False) -> LoadResult:
    """Collective: restore ``live`` on every rank from ``step`` (None: the latest; with
    ``fallback`` the newest intact step, see GDSCheckpointer.load). ``live_state`` is what saving
    ``live`` would collect (its tensors say what each rank needs).

    Always atomic: every rank reads into fresh buffers and verifies every chunk, and all ranks
    agree that every rank did, before any live tensor changes (load(atomic=...) has nothing to
    add), so a damaged step leaves the live state untouched on every rank."""
    damaged: tuple[int, ...] = ()
    if fallback:
        step, state, plan, damaged = _newest_intact(coord, layout, protocol, live, live_state, engine, strict=strict,
                                                    verify=verify)
        if damaged:
            log.warning("gdswriter: loaded step %d, the newest intact step (passed over damaged step(s) %s)",
                        step, list(damaged))
    else:
        step, state, plan = _prepare(coord, layout, protocol, live, live_state, step, engine, strict=strict,
                                     verify=verify)
    error = None
    try:
        apply_state(live, state, plan)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"loading step {step} (applying)", hint="ranks that did not fail loaded the step; fix the "
                                                               "problem and load again")
    return LoadResult(step, tuple(plan.loaded), tuple(plan.skipped), tuple(plan.missing), tuple(plan.unexpected),
                      atomic=verify, damaged=damaged)


def collective_load(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                    live_state: dict, step: int | None, engine: IOEngine, *, strict: bool, verify: bool) -> int:
    """collective_restore of ``step`` (None: the latest); returns the step."""
    return collective_restore(coord, layout, protocol, live, live_state, step, engine, strict=strict,
                              verify=verify).step
