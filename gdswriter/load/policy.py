"""Restoring into live objects, and the fallback policy.

``restore_into`` does what ``GDSCheckpointer.load`` promises: it plans the whole load first
(apply.plan_restore: every key, shape, dtype and the optimizer's structure, with no byte
moved), then reads (reader: through fresh buffers, verified before the first live byte
changes, up to ATOMIC_LOAD_MAX_BYTES, else in place), then hands each object its state.
``restore_newest_intact`` (``load(fallback=True)``) passes over damaged steps, newest first,
without changing the live state.

The top of gdswriter.load: it imports reader, verify and apply; nothing in load/ imports it,
and it imports nothing from gdswriter.save or above.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence

import torch

from ..engines.base import IOEngine
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, EngineIOError, UnsupportedFormatVersionError
from ..format.commit import CommitProtocol
from ..format.manifest import Manifest
from ..format.state_codec import decode_state, decode_state_slots, fill_slots
from ..options import EngineOptions
from ..tensors import hint_unaligned
from ..threads import gc_paused
from .apply import (LiveState, LoadResult, apply_state, copy_into_live, flat_of, live_optimizer_state, live_tensors,
                    match_live_tensors, plan_restore)
from .reader import check_data_files, placeholder_tensors, read_manifest, read_storages, \
    tensors_from_storages
from .verify import verify_step

log = logging.getLogger("gdswriter")

ATOMIC_LOAD_MAX_BYTES = 64 << 20
"""``load()`` reads live tensors through fresh buffers, verified before the first live byte
changes, when it would otherwise read at most this many bytes in place. Staging costs a pass
over memory (fresh pages, then the copy) and as much transient memory: measured with
benchmarks/load_atomic.py on this project's VM, cold, 2.3x the in-place time at 16 MiB
(+25 ms), 2.9x at 64 MiB (+105 ms), 3.4x at 256 MiB (+430 ms). So it is the default only
where that is small in absolute terms; larger states keep the zero-copy in-place path
(``load(atomic=True)`` opts in, ``load(fallback=True)`` re-hashes a step before reading it
in place)."""

SMALL_IN_PLACE_BYTES = 1 << 20
"""Live tensors below this size (the engines' ZERO_COPY_MIN: smaller reads are staged, a copy
of every byte either way) are read with the fresh storages, in runs (one span for many), and
then copied into the live tensors (a memmove each: apply.copy_into_live), after every byte is
verified; read in place, each was a span of its own (100,000 live tensors of 2.7 KB: a
cold load of 13 s, where fresh tensors took 2 s)."""

STAGED_LIVE_MAX_BYTES = 256 << 20
"""The most bytes of small live tensors read through fresh buffers in one load (the transient
memory it adds); the small live tensors beyond are read in place."""

SCAN_SCRATCH_BYTES = 64 << 20
"""Read buffer of the checksum pass ``load(fallback=True)`` makes before an in-place load."""


def restore_into(live: LiveState, protocol: CommitProtocol, step: int, engines: Sequence[IOEngine], *,
                 strict: bool, verify: bool, engine_options: EngineOptions, atomic: bool | None = None,
                 scan_first: bool = False, manifest: Manifest | None = None) -> LoadResult:
    """Restore ``live`` in place from committed ``step`` (see GDSCheckpointer.load). Nothing
    live changes before the plan is made; with ``atomic`` nothing changes before every byte
    is verified. ``scan_first``: a non-atomic load first re-hashes the step (bounded memory),
    so that damage found by checksums leaves the live state untouched too. ``manifest``: the
    step's manifest already parsed (parse_manifest), used when it describes ``step``.

    Automatic garbage collection is held off meanwhile (threads.gc_paused): a load makes a few
    objects per tensor and none in cycles, and each full collection walks them all (100,000
    tensors: about a third of the load's CPU time)."""
    with gc_paused():
        return _restore(live, protocol, step, engines, strict=strict, verify=verify, engine_options=engine_options,
                        atomic=atomic, scan_first=scan_first, manifest=manifest)


def _restore(live: LiveState, protocol: CommitProtocol, step: int, engines: Sequence[IOEngine], *,
             strict: bool, verify: bool, engine_options: EngineOptions, atomic: bool | None,
             scan_first: bool, manifest: Manifest | None) -> LoadResult:
    """restore_into's work."""
    if manifest is None or manifest.step != step:
        manifest = read_manifest(protocol, step)
    else:
        check_data_files(protocol, manifest)
    skeleton, slots = decode_state_slots(manifest.state, placeholder_tensors(manifest))
    plan = plan_restore(skeleton, live, strict)
    tensors_live = live_tensors(live, plan)
    optimizer_state = live_optimizer_state(live.optimizer) if "optimizer" in plan.apply else {}
    all_live = {**optimizer_state, **tensors_live}
    matched = match_live_tensors(manifest, all_live)
    if atomic is None:
        atomic = verify and sum(lt.nbytes for _, lt in matched.values()) <= ATOMIC_LOAD_MAX_BYTES
    direct, staged = split_in_place(matched, atomic=atomic)
    if scan_first and verify and direct:
        problems: list[str] = []
        verify_step(protocol, manifest, engines[0], SCAN_SCRATCH_BYTES, problems)
        if problems:
            raise CorruptCheckpointError(f"step {step} is damaged: {problems[0]}" +
                                         (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    buffers = [None] * len(manifest.storages)
    for sid, (_, flat) in direct.items():
        buffers[sid] = flat
    try:
        read_storages(protocol, manifest, buffers, engines, verify=verify)  # fills the Nones
    except (CorruptCheckpointError, EngineIOError) as e:
        if direct:
            every = manifest.tensor_names()
            names = [every[i] for i, _ in direct.values()]
            e.add_note(f"gdswriter: {len(names)} live tensor(s) read in place ({', '.join(names[:8])}"
                       f"{', ...' if len(names) > 8 else ''}) may now hold part of step {step}'s bytes; nothing "
                       f"else changed (load_state_dict was not called). Load an intact step "
                       f"(load(fallback=True)) before training on.")
        raise
    hint_unaligned([flat for _, flat in direct.values()], engine_options, engines[0].info)
    tensors = tensors_from_storages(manifest, buffers)
    copy_into_live((tensors[i], lt) for i, lt in staged.values())  # verified: all was read
    for i, lt in staged.values():
        tensors[i] = lt
    for sid, (i, _) in direct.items():
        tensors[i] = matched[sid][1]
    if slots is None:
        state = decode_state(manifest.state, tensors)
    else:  # the tree decoded to plan, its placeholders replaced by the tensors read: decoded once
        fill_slots(slots, tensors)
        state = skeleton
    apply_state(live, state, plan)  # type: ignore[arg-type]
    return LoadResult(step, tuple(plan.loaded), tuple(plan.skipped), tuple(plan.missing), tuple(plan.unexpected),
                      atomic=bool(atomic and verify))


def split_in_place(matched: dict[int, tuple[int, torch.Tensor]], *, atomic: bool
                   ) -> tuple[dict[int, tuple[int, torch.Tensor]], dict[int, tuple[int, torch.Tensor]]]:
    """match_live_tensors' storages as (read in place: {storage: (record, flat view)}, read fresh
    and then copied into the live tensor: {storage: (record, live tensor)}). Atomic: all of them
    fresh. Else the small CPU ones (below SMALL_IN_PLACE_BYTES), up to STAGED_LIVE_MAX_BYTES in
    all (a GPU's are read in place, as before: its engine may move them straight to the GPU)."""
    if atomic:
        return {}, matched
    direct, staged, budget = {}, {}, STAGED_LIVE_MAX_BYTES
    for sid, (i, lt) in matched.items():
        n = lt.nbytes
        if n < SMALL_IN_PLACE_BYTES and n <= budget and lt.is_cpu:
            staged[sid] = (i, lt)
            budget -= n
        else:
            direct[sid] = (i, flat_of(lt))
    return direct, staged


DAMAGE = (CorruptCheckpointError, UnsupportedFormatVersionError, CheckpointNotFoundError, EngineIOError)


def restore_newest_intact(live: LiveState, protocol: CommitProtocol, engines: Sequence[IOEngine], *,
                          strict: bool, verify: bool, engine_options: EngineOptions,
                          atomic: bool | None = None, manifest: Manifest | None = None) -> LoadResult:
    """Restore the newest intact step: the latest first, then older committed ones; a damaged
    step (manifest, files, checksums, an I/O error reading it) is skipped with a warning naming
    the problem, without changing the live state. A step deleted while it is read (a running
    checkpointer's retention: CheckpointNotFoundError) is gone, not damaged: it is skipped and
    the order is read again once, so the step that retention made room for is tried. A state
    mismatch is no damage: it is raised. ``manifest``: one step's manifest already parsed, as
    restore_into takes it."""
    damaged: list[int] = []
    problems: list[str] = []
    tried: set[int] = set()
    order, again = protocol.fallback_order(), True
    while order:
        step = order.pop(0)
        tried.add(step)
        try:
            result = restore_into(live, protocol, step, engines, strict=strict, verify=verify,
                                  engine_options=engine_options, atomic=atomic, scan_first=True, manifest=manifest)
        except CheckpointNotFoundError as e:
            log.info("gdswriter: step %d under %s was deleted while it was being read; trying the newest step "
                     "left: %s", step, protocol.primary, e)
            if again:
                order, again = [s for s in protocol.fallback_order() if s not in tried], False
            continue
        except DAMAGE as e:
            if isinstance(e, EngineIOError) and not isinstance(e, CorruptCheckpointError) and e.errno != errno.EIO:
                raise
            log.warning("gdswriter: step %d under %s is damaged, trying an older step: %s", step, protocol.primary, e)
            damaged.append(step)
            problems.append(f"step {step}: {e}")
            continue
        if damaged:
            log.warning("gdswriter: loaded step %d, the newest intact step (passed over damaged step(s) %s)",
                        step, damaged)
        return LoadResult(result.step, result.loaded, result.skipped, result.missing, result.unexpected,
                          result.atomic, tuple(damaged))
    if not problems:  # no committed step at all, or every one tried was deleted meanwhile
        protocol.require(None)
        raise CheckpointNotFoundError(errno.ENOENT, f"every step tried under {protocol.primary} ({sorted(tried)}) "
                                                    f"was deleted while it was being read: load again")
    raise CorruptCheckpointError(f"no intact step under {protocol.primary}: " + "; ".join(problems))
