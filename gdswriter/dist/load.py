"""A GDSCheckpointer load across ranks, on any world size.

Rank 0 reads the manifest and sends it to every rank. Each rank takes the state tree it
saved (rank 0's, with its own top-level entries; a rank the save did not have takes rank
0's), and works out what it needs: every plain tensor its tree references, and of each
sharded tensor the block its live tensor holds now (a DTensor's shard on the current mesh, or
the whole tensor for a plain one), assembled from the saved blocks that intersect it. The
storages are fetched (dist/fetch.py: read where reachable, sent by another rank where not),
the state is rebuilt and handed to the live objects as a single-process load does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..engine import IOEngine
from ..errors import InvalidOptionError
from ..format.commit import CommitProtocol
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..format.state_codec import decode_state
from ..restore import (LiveState, apply_state, host_buffer, parse_manifest, plan_restore, read_manifest_bytes,
                       tensors_from_storages)
from .assemble import tree_for_rank
from .fetch import fetch_storages, manifest_reach
from .group import Coordinator, describe
from .roots import RootLayout
from .shards import assemble, join, leaves, overlap, target_block


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
    buffers: dict[int, torch.Tensor] = {}
    jobs: dict[str, tuple] = {}
    refs: list[int] = []
    tree = None
    error = None
    try:
        tree = tree_for_rank(m, coord.rank)
        refs = tensor_refs(tree)
        needed: set[int] = set()
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
        buffers = {s: host_buffer(m.storages[s].nbytes) for s in sorted(needed)}
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (planning)", hint=unchanged)
    fetch_storages(coord, manifest_reach(m, layout), m, buffers, engine, verify=verify, what=what)
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


def collective_load(coord: Coordinator, layout: RootLayout, protocol: CommitProtocol, live: LiveState,
                    live_state: dict, step: int | None, engine: IOEngine, *, strict: bool, verify: bool) -> int:
    """Collective: restore ``live`` on every rank from ``step`` (None: the latest); returns the
    step. ``live_state`` is what saving ``live`` would collect (its tensors say what each rank needs)."""
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
    try:
        apply_state(live, state, plan)
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error = e
    coord.agree(error, f"{what} (applying)", hint="ranks that did not fail loaded the step; fix the problem and "
                                                  "load again")
    return step
