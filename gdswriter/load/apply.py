"""Applying: match a saved state tree to the live objects and hand it to them.

``plan_restore`` decides everything a restore does from the saved structure and the live
objects (every key, shape, dtype and the optimizer's structure), before any byte is read;
``live_tensors``, ``live_optimizer_state`` and ``match_live`` find the storages that can be
read straight into live tensors; ``apply_state`` hands each planned object its state. Also
the types a restore takes and gives: ``LiveState``, ``LoadResult``.

No I/O: it imports format/, rng and tensors.py, never reader, verify, policy, gdswriter.save
or anything above them.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import torch

from ..errors import CorruptCheckpointError, GDSWriterError, NothingToLoadError, StateMismatchError
from ..format.dtypes import dtype_to_name
from ..format.manifest import Manifest, tensor_table_columns
from ..rng import set_rng_state
from ..tensors import flat_bytes

log = logging.getLogger("gdswriter")


@dataclass(frozen=True)
class LiveState:
    """What a checkpointer restores into: the model, the optimizer, extra named objects."""

    model: Any
    optimizer: Any
    extra: Mapping[str, Any]
    restore_rng: bool = False


@dataclass(frozen=True)
class LoadResult:
    """What ``GDSCheckpointer.load`` did (``checkpointer.last_load``). Names are "/"-joined
    paths as in the manifest: ``model/<key>`` (the live model's key), ``optimizer``,
    ``extra/<name>`` (``extra/<name>/<key>`` inside a dict or module), ``rng``.

    loaded: restored. skipped: in the checkpoint and live, but not restored (shape/dtype
    mismatch; an optimizer whose parameters were not all loaded). missing: live, not in the
    checkpoint. unexpected: in the checkpoint, not live (a dict target receives them as new keys,
    so for dicts they are in ``loaded`` too).
    atomic: every byte was verified before the first live tensor changed. damaged: steps
    ``load(fallback=True)`` passed over, newest first. lost: newer steps a plain ``load()``
    passed over because every copy of some rank's files was lost with its nodes (replicas:
    StepFilesLostError; docs/format.md 11.3), newest first."""

    step: int
    loaded: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    atomic: bool = False
    damaged: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()


_COMPILED = re.compile(r"(^|\.)_orig_mod\.")


def _uncompiled(key: Any) -> Any:
    """``key`` without torch.compile's ``_orig_mod.`` components (compiled module state_dict keys)."""
    return _COMPILED.sub(r"\1", key) if isinstance(key, str) else key


def match_keys(saved: Iterable, live: Iterable) -> dict:
    """{saved key: live key}: equal keys, then keys equal once torch.compile's ``_orig_mod.``
    components are dropped, so a compiled model's checkpoint loads into the plain model and back."""
    live = list(live)
    live_set, out, used = set(live), {}, set()
    rest = []
    for k in saved:
        if k in live_set:
            out[k] = k
            used.add(k)
        else:
            rest.append(k)
    plain: dict[Any, list] = {}
    for k in live:
        if k not in used:
            plain.setdefault(_uncompiled(k), []).append(k)
    for k in rest:
        cands = plain.get(_uncompiled(k), [])
        if len(cands) == 1 and cands[0] not in used:
            out[k] = cands[0]
            used.add(cands[0])
    return out


def prefix_hint(missing: Sequence, unexpected: Sequence) -> str:
    """Why keys may differ, when every unexpected key is a missing key with one prefix added
    (or the other way round): a wrapped model (DistributedDataParallel's ``module.``...)."""
    miss = [k for k in missing if isinstance(k, str)]
    unexp = [k for k in unexpected if isinstance(k, str)]
    if not miss or not unexp:
        return ""
    for longer, shorter, whose in ((unexp, miss, "checkpoint's"), (miss, unexp, "live model's")):
        short = set(shorter)
        for k in shorter:
            if not longer[0].endswith(k):
                continue
            prefix = longer[0][:len(longer[0]) - len(k)]
            if prefix.endswith(".") and all(x.startswith(prefix) and x[len(prefix):] in short for x in longer):
                cause = " (DistributedDataParallel/DataParallel wraps models in .module)" if prefix == "module." else ""
                return f"; the keys differ by a prefix {prefix!r}: the {whose} keys carry it{cause}"
    return ""


@dataclass
class _Plan:
    """What restore_into will do, decided before any byte moves."""

    keys: dict[str, dict] = field(default_factory=dict)  # target name -> {saved key: live key} to load
    dropped: dict[str, set] = field(default_factory=dict)  # target name -> saved keys skipped (mismatch)
    apply: set[str] = field(default_factory=set)           # target names whose saved state gets applied
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    live_sd: dict[str, Mapping] = field(default_factory=dict)  # target name -> its state_dict() as planned


def _short(keys: Sequence) -> str:
    return f"{list(keys[:10])}" + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


def _desc(v: Any) -> str:
    return f"{dtype_to_name(v.dtype)}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def _plan_tensor_dict(plan: _Plan, name: str, live_sd: Mapping, saved: Any, strict: bool, *,
                      module: bool) -> None:
    """Match a module's state_dict (``module``) or a plain dict target with its saved dict."""
    if not isinstance(saved, Mapping):
        raise StateMismatchError(f"{name}: the checkpoint holds a {type(saved).__name__} for it, expected a dict")
    pairs = match_keys(saved.keys(), live_sd.keys())
    matched = set(pairs.values())
    missing = [k for k in live_sd if k not in matched]
    unexpected = [k for k in saved if k not in pairs]
    mismatched = [(s, lk) for s, lk in pairs.items()
                  if (isinstance(saved[s], torch.Tensor) or isinstance(live_sd[lk], torch.Tensor)) and not (
                      isinstance(saved[s], torch.Tensor) and isinstance(live_sd[lk], torch.Tensor)
                      and saved[s].shape == live_sd[lk].shape and saved[s].dtype == live_sd[lk].dtype)]
    hint = prefix_hint(missing, unexpected)
    if strict and (missing or (unexpected and module) or mismatched):
        parts = []
        if mismatched:
            s, lk = mismatched[0]
            parts.append(f"{name}/{lk}: checkpoint has {_desc(saved[s])}, the live tensor is {_desc(live_sd[lk])}"
                         + (f" (and {len(mismatched) - 1} more mismatched)" if len(mismatched) > 1 else ""))
        if module and (missing or unexpected):
            parts.append(f"{name}: missing keys {_short(missing)}, unexpected keys {_short(unexpected)}")
        elif missing:
            parts.append(f"{name}: keys {_short(missing)} are missing from the checkpoint")
        raise StateMismatchError("; ".join(parts) + hint + "; pass strict=False to load the keys that match")
    bad = {s for s, _ in mismatched}
    good = {s: lk for s, lk in pairs.items() if s not in bad}
    live_tensors = [k for k, v in live_sd.items() if isinstance(v, torch.Tensor)]
    if live_tensors and not any(isinstance(live_sd[lk], torch.Tensor) for lk in good.values()):
        raise NothingToLoadError(f"{name}: none of its {len(live_tensors)} tensors is in the checkpoint "
                                 f"(saved keys e.g. {_short(list(saved)[:3])}, live keys e.g. "
                                 f"{_short(live_tensors[:3])}){hint}; refusing to load nothing into it")
    for s, lk in mismatched:
        log.warning("gdswriter: %s/%s skipped: saved %s, live %s", name, lk, _desc(saved[s]), _desc(live_sd[lk]))
    if missing or unexpected:
        log.warning("gdswriter: %s: missing keys %s, unexpected keys %s%s", name, _short(missing),
                    _short(unexpected), hint)
    plan.keys[name] = good
    plan.dropped[name] = bad
    plan.live_sd[name] = live_sd  # a module's state_dict() is made once (25,000 parameters: 0.2 s each)
    plan.apply.add(name)
    plan.loaded += [f"{name}/{lk}" for lk in good.values()]
    if not module:  # a dict target receives the keys it lacks
        plan.loaded += [f"{name}/{k}" for k in unexpected]
    plan.skipped += [f"{name}/{lk}" for _, lk in mismatched]
    plan.missing += [f"{name}/{k}" for k in missing]
    plan.unexpected += [f"{name}/{k}" for k in unexpected]


def _plan_optimizer(plan: _Plan, live: LiveState, saved: Any, strict: bool) -> None:
    """Check a torch optimizer's saved structure against the live one: parameter groups, parameters
    per group, and the state of a resumed optimizer (keys, shapes); and that every model parameter
    it updates is loaded. Other optimizer types are left to their load_state_dict."""
    opt = live.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        plan.apply.add("optimizer")
        plan.loaded.append("optimizer")
        return
    problem = ""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping) or not isinstance(groups, list) \
            or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        problem = "the saved state is not a torch optimizer state_dict"
    elif len(groups) != len(opt.param_groups):
        problem = f"the checkpoint has {len(groups)} parameter group(s), the live optimizer {len(opt.param_groups)}"
    elif [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        problem = (f"parameters per group differ: checkpoint {[len(g['params']) for g in groups]}, live "
                   f"{[len(g['params']) for g in opt.param_groups]}")
    else:
        params = [p for g in opt.param_groups for p in g["params"]]
        saved_ids = [i for g in groups for i in g["params"]]
        names = {}
        if isinstance(live.model, torch.nn.Module):
            names = {id(p): f"model/{k}" for k, p in live.model.named_parameters(remove_duplicate=False)}
        loaded = set(plan.loaded)
        for sid, p in zip(saved_ids, params):
            pname = names.get(id(p))
            if pname is not None and pname not in loaded:
                problem = (f"it updates {pname}, which is not loaded: its state would not fit; load the optimizer "
                           f"only with a model that loads completely")
                break
            have, want = opt.state.get(p), saved["state"].get(sid)
            if have and isinstance(want, Mapping):
                ht = {k: tuple(v.shape) for k, v in have.items() if isinstance(v, torch.Tensor)}
                wt = {k: tuple(v.shape) for k, v in want.items() if isinstance(v, torch.Tensor)}
                if ht != wt:
                    problem = (f"the state of parameter {pname or sid} differs: checkpoint {wt}, live {ht} (another "
                               f"model or optimizer?)")
                    break
    if problem:
        if strict:
            raise StateMismatchError(f"optimizer: {problem}; pass strict=False to skip the optimizer")
        log.warning("gdswriter: optimizer skipped: %s", problem)
        plan.skipped.append("optimizer")
        return
    plan.apply.add("optimizer")
    plan.loaded.append("optimizer")


def plan_restore(skeleton: Any, live: LiveState, strict: bool) -> _Plan:
    """Decide everything a restore does, from the saved structure (``skeleton``: the state tree
    decoded over placeholder tensors) and the live objects, before any byte is read. Raises
    StateMismatchError (strict) or NothingToLoadError."""
    if not isinstance(skeleton, dict):
        raise CorruptCheckpointError("the saved state is not a dict; it was not written by GDSCheckpointer")
    plan = _Plan()
    saved_extra = skeleton.get("extra") if isinstance(skeleton.get("extra"), dict) else {}
    targets = [("model", live.model, skeleton.get("model"))]
    targets += [(f"extra/{k}", v, saved_extra.get(k)) for k, v in live.extra.items()]
    for name, obj, saved in targets:
        if obj is None:
            continue
        if saved is None:
            if strict:
                raise StateMismatchError(f"{name}: the checkpoint holds no state for it; pass strict=False to "
                                         f"load the rest")
            log.warning("gdswriter: %s is not in the checkpoint; left as is", name)
            plan.missing.append(name)
        elif isinstance(obj, torch.nn.Module):
            _plan_tensor_dict(plan, name, obj.state_dict(), saved, strict, module=True)
        elif isinstance(obj, dict):
            _plan_tensor_dict(plan, name, obj, saved, strict, module=False)
        else:
            plan.apply.add(name)
            plan.loaded.append(name)
    if live.optimizer is not None:
        saved = skeleton.get("optimizer")
        if saved is None:
            if strict:
                raise StateMismatchError("optimizer: the checkpoint holds no state for it; pass strict=False to "
                                         "load the rest")
            log.warning("gdswriter: optimizer is not in the checkpoint; left as is")
            plan.missing.append("optimizer")
        elif isinstance(live.optimizer, dict):
            _plan_tensor_dict(plan, "optimizer", live.optimizer, saved, strict, module=False)
        else:
            _plan_optimizer(plan, live, saved, strict)
    if live.restore_rng and "rng" in skeleton:
        plan.apply.add("rng")
        plan.loaded.append("rng")
    if not plan.loaded and (plan.skipped or plan.missing):
        raise NothingToLoadError(f"nothing in the checkpoint fits the live state (saved: {sorted(map(str, skeleton))}; "
                                 f"missing: {_short(plan.missing)}, skipped: {_short(plan.skipped)}); refusing to load "
                                 f"nothing")
    return plan


def live_tensors(live: LiveState, plan: _Plan) -> dict[str, torch.Tensor]:
    """Manifest name ("model/<saved key>") -> live tensor, for the planned tensors that can be
    filled in place (model, dict and module extras)."""
    out: dict[str, torch.Tensor] = {}
    sources = [("model", live.model)] + [(f"extra/{k}", v) for k, v in live.extra.items()]
    for name, obj in sources:
        if name not in plan.keys:
            continue
        sd = plan.live_sd.get(name)
        if sd is None:
            sd = obj.state_dict() if isinstance(obj, torch.nn.Module) else obj
        for saved_key, live_key in plan.keys[name].items():
            v = sd[live_key]
            if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_meta:
                out[f"{name}/{saved_key}"] = v.detach()
    return out


def live_optimizer_state(optimizer: Any) -> dict[str, torch.Tensor]:
    """The live optimizer's state tensors (exp_avg, ...), named as in the manifest. Filled in
    place when they match (a resumed optimizer that already stepped), else left alone:
    load_state_dict replaces them, so a mismatch here is no error."""
    if optimizer is None or not hasattr(optimizer, "state_dict"):
        return {}
    state = optimizer.state_dict().get("state")
    if not isinstance(state, dict):
        return {}
    return {f"optimizer/state/{pid}/{k}": v for pid, st in state.items() if isinstance(st, dict)
            for k, v in st.items() if isinstance(v, torch.Tensor) and v.layout == torch.strided}


def match_live(manifest: Manifest, live: Mapping[str, torch.Tensor]) -> dict[int, tuple[int, torch.Tensor]]:
    """Storages that can be read straight into a live tensor: {storage: (tensor record, flat view)}:
    the storage's only tensor, same dtype, shape and strides, contiguous, the whole storage.
    Read off the manifest's columns where it has them (format 2: no records made)."""
    return {sid: (i, flat_of(lt)) for sid, (i, lt) in match_live_tensors(manifest, live).items()}


def flat_of(lt: torch.Tensor) -> torch.Tensor:
    """The flat uint8 view of contiguous ``lt``'s bytes (what an engine reads into)."""
    return flat_bytes(lt.untyped_storage(), lt.device, lt.storage_offset() * lt.element_size(),
                      lt.numel() * lt.element_size())


def match_live_tensors(manifest: Manifest, live: Mapping[str, torch.Tensor]) -> dict[int, tuple[int, torch.Tensor]]:
    """match_live's storages with the live tensor itself: {storage: (tensor record, live tensor)}.
    Walks the live tensors (not every record), each looked up by name in one dict; a format 2
    manifest's views are read off its columns as lists, made once (100,000 tensors: tens of
    milliseconds, where a view per record took a second)."""
    if not live:
        return {}
    names = manifest.tensor_names()
    index = dict(zip(names, range(len(names))))
    if len(index) != len(names):  # an ambiguous name is never read in place
        for name, n in Counter(names).items():
            if n > 1:
                del index[name]
    view = _view_reader(manifest)
    names_of = _DtypeNames()
    users = sizes = None
    direct = {}
    for name, lt in live.items():
        i = index.get(name)
        if i is None:
            continue
        sid, byte_offset, dtype, shape, stride = view(i)
        if names_of[lt.dtype] != dtype or lt.shape != shape:
            continue
        if users is None:
            users, sizes = Counter(manifest.tensor_storages()), manifest.storage_sizes()
        nbytes = lt.nbytes
        if (users[sid] == 1 and byte_offset == 0 and sizes[sid] == nbytes and nbytes and lt.is_contiguous()
                and lt.stride() == stride and not lt.is_conj() and not lt.is_neg()):
            direct[sid] = (i, lt)
    return dict(sorted(direct.items()))


class _DtypeNames(dict):
    """dtype_to_name, remembered per dtype (a dict lookup per live tensor); None for a dtype
    no checkpoint stores."""

    def __missing__(self, dtype: torch.dtype) -> str | None:
        try:
            name = self[dtype] = dtype_to_name(dtype)
        except (KeyError, ValueError, TypeError, GDSWriterError):
            name = self[dtype] = None
        return name


def _view_reader(manifest: Manifest) -> Any:
    """A function of a tensor's index giving manifest.tensor_view's tuple; over a format 2
    manifest's columns turned into lists once (tensor_view reads numpy scalars per call)."""
    cols = tensor_table_columns(manifest.tensors)
    if cols is None:
        return manifest.tensor_view
    storage, offset, dtype = cols.storage.tolist(), cols.byte_offset.tolist(), cols.dtype.tolist()
    starts, ndim, shape, stride = cols.starts.tolist(), cols.ndim.tolist(), cols.shape.tolist(), cols.stride.tolist()
    names = cols.dtype_names

    def view(i: int) -> tuple[int, int, str, tuple[int, ...], tuple[int, ...]]:
        at = starts[i]
        end = at + ndim[i]
        return storage[i], offset[i], names[dtype[i]], tuple(shape[at:end]), tuple(stride[at:end])
    return view


def copy_into_live(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (source, live tensor) pair's bytes into the live tensor (same dtype, shape and
    nbytes; both contiguous), bit for bit (bool and NaN payloads too). CPU to CPU: one memmove
    each (a copy_ costs about 5 us of dispatch, ten times the copy of a 3 KB tensor); to
    another device: a copy_ of their flat bytes, as an atomic load always did."""
    memmove = ctypes.memmove
    for src, dst in pairs:
        if dst.is_cpu and src.is_cpu:
            memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
        else:
            flat_of(dst).copy_(flat_of(src))


def apply_state(live: LiveState, state: dict, plan: _Plan) -> None:
    """Hand each planned object its saved state (load_state_dict, or in-place copies for dicts)."""
    saved_extra = state.get("extra") or {}
    targets = [("model", live.model, state.get("model"))]
    targets += [(f"extra/{k}", v, saved_extra.get(k)) for k, v in live.extra.items()]
    targets.insert(1, ("optimizer", live.optimizer, state.get("optimizer")))  # after the model, as planned
    for name, obj, saved in targets:
        if name not in plan.apply:
            continue
        if isinstance(obj, torch.nn.Module):
            _load_module(name, obj, saved, plan.keys[name], plan.live_sd.get(name))
        elif isinstance(obj, dict):
            _load_dict(obj, saved, plan.keys[name], plan.dropped[name])
        else:
            try:
                obj.load_state_dict(_with_id_sets(saved) if hasattr(obj, "param_groups") else saved)
            except (ValueError, KeyError, RuntimeError, TypeError) as e:
                raise StateMismatchError(f"{name}: load_state_dict refused the saved state: {e}") from e
    if "rng" in plan.apply:
        set_rng_state(state["rng"])


class ParamIds(list):
    """A parameter group's "params" (saved parameter ids) whose ``in`` is a set lookup.
    torch's Optimizer.load_state_dict asks, for every parameter with state, which group holds
    its id (``param_id in group["params"]``): with plain lists that is quadratic in the number
    of parameters (100,000 parameters: minutes). Otherwise a list, equal to the plain one."""

    __slots__ = ("_ids",)

    def __contains__(self, x: object) -> bool:
        ids = getattr(self, "_ids", None)
        if ids is None or ids[1] != len(self):  # built once (and again if the list changed)
            try:
                ids = self._ids = (set(self), len(self))
            except TypeError:  # unhashable ids: as a list would answer
                return list.__contains__(self, x)
        try:
            return x in ids[0]
        except TypeError:
            return list.__contains__(self, x)


def _with_id_sets(saved: Any) -> Any:
    """An optimizer's saved state dict whose param groups' "params" are ParamIds (the same
    values); anything of another shape is returned as it is."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and type(g.get("params")) is list for g in groups):
        return saved
    return {**saved, "param_groups": [{**g, "params": ParamIds(g["params"])} for g in groups]}


def _load_module(name: str, module: torch.nn.Module, saved: Mapping, keys: Mapping, live_sd: Mapping | None) -> None:
    """load_state_dict with the planned keys, renamed to the live module's (``_orig_mod.``);
    ``live_sd``: the module's state_dict() as planned (None: made here if needed)."""
    usable: Any = type(saved)() if isinstance(saved, dict) else {}
    for saved_key, live_key in keys.items():
        usable[live_key] = saved[saved_key]
    meta = getattr(saved, "_metadata", None)
    if isinstance(meta, Mapping):  # module versions, keyed by module prefix: rename them the same way
        live_meta = getattr(module.state_dict() if live_sd is None else live_sd, "_metadata", {}) or {}
        prefixes = match_keys([f"{k}." for k in meta], [f"{k}." for k in live_meta])
        usable._metadata = type(meta)((prefixes.get(f"{k}.", f"{k}.")[:-1], v) for k, v in meta.items())
    try:
        module.load_state_dict(usable, strict=False)
    except RuntimeError as e:
        raise StateMismatchError(f"{name}: {e}") from e


def _load_dict(target: dict, saved: Mapping, keys: Mapping, dropped: set) -> None:
    """Fill a plain dict target: planned tensors are copied in place, other planned values and
    keys the target lacks are set; ``dropped`` (mismatched) saved keys are left out."""
    for saved_key, v in saved.items():
        if saved_key in dropped:
            continue
        live_key = keys.get(saved_key, saved_key)
        cur = target.get(live_key)
        if cur is v:  # the live tensor itself, its bytes already read (in place, or copied in)
            continue
        # An expanded tensor (stride 0) cannot be written in place: take the restored view.
        if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) \
                and not any(s == 0 and n > 1 for n, s in zip(cur.shape, cur.stride())):
            with torch.no_grad():
                cur.copy_(v)
            continue
        target[live_key] = v
