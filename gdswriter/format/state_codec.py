"""Encode nested training state to a JSON tree without pickle.

``encode_state`` turns model/optimizer/scheduler/scaler/RNG state into a tree
of JSON-native values and a separate list of tensors (stored elsewhere, by
index). Everything that is not a plain JSON value is a single-key dict whose
key starts with ``"$"``:

==========================================  ====================================
``{"$dict": [[k, v], ...]}``                dict (every dict; keeps order, non-str keys)
``{"$odict": [[k, v], ...], "meta": m}``    OrderedDict; ``"meta"`` only if it has ``_metadata``
``{"$tuple": [...]}``                       tuple
``{"$size": [...]}``                        torch.Size
``{"$float": "nan"|"-nan"|"inf"|"-inf"}``   non-finite float (other NaN payloads: ``"bits:<16 hex>"``)
``{"$int": "0x..."}``                       int with ``abs(i) >= 2**63``
``{"$bytes": "<base64>"}``                  bytes
``{"$tensor": i}``                          ``tensors[i]`` (same object -> same ``i``)
``{"$ndarray": i}``                         numpy array stored as ``tensors[i]``
``{"$npscalar": [name, value]}``            numpy scalar (``np.float32(1.5)``...)
``{"$dtype": "bfloat16"}``                  torch.dtype
``{"$device": "cuda:0"}``                   torch.device
==========================================  ====================================

Lists, str, bool, None, finite floats and ints below 2**63 are stored as
themselves. ``decode_state`` is the inverse and treats its input as untrusted:
for any JSON value it returns a value or raises ``CorruptCheckpointError``.
"""

from __future__ import annotations

import base64
import binascii
import collections
import math
import operator
import re
import struct
import types
from collections.abc import Iterator, Mapping
from itertools import chain, compress, islice
from operator import attrgetter
from typing import Any
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import CorruptCheckpointError, UnsupportedObjectError
from .dtypes import dtype_from_name, dtype_to_name

MAX_DEPTH = 200
"""Deepest container nesting accepted, on both sides (guards the Python stack)."""

_BIG_INT = 2 ** 63
_INT_RE = re.compile(r"-?0x[0-9a-f]+")
_NAN_BITS = struct.unpack("<Q", struct.pack("<d", math.nan))[0] & ~(1 << 63)
_NP_SCALARS: dict[str, type] = {
    **{np.dtype(t).name: t for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                     np.uint32, np.uint64, np.float16, np.float32, np.float64,
                                     np.complex64, np.complex128)},
    "str": np.str_, "bytes": np.bytes_,
}
_NP_NAMES = {t: n for n, t in _NP_SCALARS.items()}
_BULK_PAIRS = 16  # a $dict of this many pairs or more is first tried as tensors alone (tensor_pairs)
_BULK_KEYS = frozenset({str, int})
_TENSOR_INDEX = operator.itemgetter("$tensor")
_TAGS = frozenset({"$dict", "$odict", "$tuple", "$size", "$float", "$int", "$bytes", "$tensor", "$ndarray",
                   "$npscalar", "$dtype", "$device"})


# ----------------------------------------------------------------------------- encode

def encode_state(obj: object, *, key_path: str = "") -> tuple[object, list[torch.Tensor]]:
    """Return ``(tree, tensors)``: a JSON-serialisable tree and the tensors it references.

    numpy arrays appear in ``tensors`` as CPU tensors sharing their memory.
    Raises :class:`UnsupportedObjectError` naming the "/"-joined key path of
    the first object that cannot be stored without pickle.
    """
    enc = _Encoder()
    return enc.enc(obj, key_path, 0), enc.tensors


def encode_state_named(obj: object, *, arrays: Mapping[int, torch.Tensor] | None = None, plain: bool = False
                       ) -> tuple[object, list[torch.Tensor], list[str], list[str]]:
    """encode_state, plus each tensor's name and kind ("tensor" or "ndarray"), from its first
    place in the tree: its key path, "/"-joined, where a key that the tree stores as an
    object (a tuple, an int beyond 2**53, a non-finite float) appears as that object's repr;
    "<root>" for the state itself. ``arrays``: the tensors freeze_state made of the numpy
    arrays (by id), used instead of converting them again. ``plain``: the caller found every
    tensor of ``obj`` of a plain type and strided, not nested, not meta, so the encoder's own
    look at those properties, tensor by tensor, is skipped (the same tree, names and kinds)."""
    enc = _Encoder(arrays)
    enc.plain = plain
    tree = enc.enc(obj, "", 0, "")
    return tree, enc.tensors, enc.names, enc.kinds


class Unfreezable(Exception):
    """freeze_state met a value only the encoder can judge and name (it rejects it): encode the
    state itself to get the UnsupportedObjectError with its key path."""


_IMMUTABLE_LEAVES = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size})
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_PLAIN_VALUES = _IMMUTABLE_LEAVES | _TENSOR_TYPES | frozenset(_NP_NAMES)  # kept as they are by freeze_state


class FrozenOrderedDict:
    """An OrderedDict as freeze_state copied it: its keys, its values and its ``_metadata``; it
    encodes as the OrderedDict did. (Copying an OrderedDict of 50,000 entries takes tens of
    milliseconds, listing its keys and values a fraction of that, and makes no object per entry.)"""

    __slots__ = ("_metadata", "keys", "values")

    def __init__(self, keys: list, values: list, metadata: object = None) -> None:
        self.keys, self.values, self._metadata = keys, values, metadata

    def items(self) -> Iterator[tuple[object, object]]:
        return zip(self.keys, self.values)


class FrozenDictOfDicts:
    """A dict of dicts of plain values (an optimizer's per-parameter state) as freeze_state copied
    it: flat lists of the outer keys, the inner dicts' sizes, keys and values (a few objects
    whatever the number of dicts, where a copy of each would make one per dict, and work for the
    garbage collector); it encodes as the dict did, the inner dicts made again as it does."""

    __slots__ = ("inner_keys", "inner_values", "keys", "sizes")

    def __init__(self, keys: list, dicts: list[dict]) -> None:
        self.keys = keys
        self.sizes = list(map(len, dicts))
        self.inner_keys = list(chain.from_iterable(dicts))  # a dict iterates its keys
        self.inner_values = list(chain.from_iterable(map(dict.values, dicts)))

    def items(self) -> Iterator[tuple[object, dict]]:
        keys, values = iter(self.inner_keys), iter(self.inner_values)
        for k, n in zip(self.keys, self.sizes):
            yield k, dict(zip(islice(keys, n), islice(values, n)))


_CONTAINERS = frozenset({list, tuple, torch.Size, dict, collections.OrderedDict, FrozenOrderedDict, FrozenDictOfDicts})


def freeze_state(obj: object) -> tuple[object, list[torch.Tensor], dict[int, torch.Tensor]]:
    """``(frozen, tensors, arrays)``: the state with every container copied (dict, list, tuple;
    an OrderedDict, with its ``_metadata``, as a FrozenOrderedDict; a dict of dicts of plain
    values as a FrozenDictOfDicts) around the same leaves, so that
    encoding ``frozen`` later gives what encoding ``obj`` gives now, whatever then happens to
    the caller's containers; ``tensors``: the tensors met (repeats kept, in no given order),
    with each numpy array's tensor; ``arrays``: those tensors by id(array) (for
    encode_state_named: a non-contiguous array is copied now). The leaves are kept by
    reference: immutable ones and tensors (whose memory the snapshot captures or guards).
    Raises Unfreezable where the encoder would raise UnsupportedObjectError.

    What save_async does at the call (the encoding, with names, runs in the save thread), in a
    few C-level passes per container, not a Python step per value: a copy, the values' types,
    and their tensors; and it makes a few objects per container, not one per entry (none for
    the garbage collector to walk: 50,000 small dict copies set off its full collections)."""
    tensors: list[torch.Tensor] = []
    arrays: dict[int, torch.Tensor] = {}
    return _freeze(obj, tensors, arrays, 0), tensors, arrays


def _freeze(obj: Any, tensors: list, arrays: dict, depth: int) -> object:
    t = type(obj)
    if t in _TENSOR_TYPES:
        tensors.append(obj)
        return obj
    if t in _PLAIN_VALUES:
        return obj
    if t is np.ndarray:
        try:
            at = arrays[id(obj)] = _Encoder.array_tensor(obj, "")
        except UnsupportedObjectError:
            raise Unfreezable from None
        tensors.append(at)
        return obj
    if depth >= MAX_DEPTH or t not in (dict, collections.OrderedDict, list, tuple):
        raise Unfreezable  # also a cycle, which nests without end
    if t is dict:
        values = list(obj.values())
        if set(map(type, values)) == {dict} and depth + 1 < MAX_DEPTH:  # dicts of plain values
            frozen = FrozenDictOfDicts(list(obj), values)
            types = set(map(type, frozen.inner_values))
            if types <= _PLAIN_VALUES:
                inner = frozen.inner_values
                _add_tensors(tensors, inner, types)
                return frozen
        frozen_values = _freeze_values(values, tensors, arrays, depth + 1)
        return obj.copy() if frozen_values is None else dict(zip(obj, frozen_values))
    if t is collections.OrderedDict:
        keys, values = list(obj), list(obj.values())
        values = _freeze_values(values, tensors, arrays, depth + 1) or values
        meta = getattr(obj, "_metadata", None)
        return FrozenOrderedDict(keys, values, None if meta is None else _freeze(meta, tensors, arrays, depth + 1))
    items = list(obj)
    items = _freeze_values(items, tensors, arrays, depth + 1) or items
    return items if t is list else tuple(items)


def _freeze_values(values: list, tensors: list, arrays: dict, depth: int) -> list | None:
    """``values`` (of one container; ``depth``: theirs) frozen in place, or None when they are
    all kept as they are; their tensors are added to ``tensors``."""
    types = set(map(type, values))
    if types <= _PLAIN_VALUES:
        _add_tensors(tensors, values, types)
        return None
    for i, v in enumerate(values):
        tv = type(v)
        if tv in _TENSOR_TYPES:
            tensors.append(v)
        elif tv not in _PLAIN_VALUES:
            values[i] = _freeze(v, tensors, arrays, depth)
    return values


def _add_tensors(tensors: list, values: list, types: set) -> None:
    """The tensors among ``values`` (plain values of the given ``types``) added to ``tensors``,
    in C-level passes (a parameter group's 50,000 indices need no look at each)."""
    if types <= _TENSOR_TYPES:
        tensors += values
    elif not types.isdisjoint(_TENSOR_TYPES):
        tensors += compress(values, map(_TENSOR_TYPES.__contains__, map(type, values)))


_BULK_MIN = 8  # mappings of fewer entries are encoded by the loop (the C-level passes cost more)
_IS_NESTED, _IS_META, _LAYOUT = (attrgetter(a) for a in ("is_nested", "is_meta", "layout"))


def _join(path: str, part: object) -> str:
    return f"{path}/{part}" if path else str(part)


def _enc_float(x: float) -> object:
    if math.isfinite(x):
        return x
    if math.isinf(x):
        return {"$float": "inf" if x > 0 else "-inf"}
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    if bits & ~(1 << 63) == _NAN_BITS:
        return {"$float": "-nan" if bits >> 63 else "nan"}
    return {"$float": f"bits:{bits:016x}"}


def _enc_int(i: int) -> object:
    return i if -_BIG_INT < i < _BIG_INT else {"$int": hex(i)}


def _is_key(k: object) -> bool:
    """Allowed dict keys: str, int, float, bool, None and (nested) tuples of those."""
    stack = [k]
    while stack:  # iterative: a key cannot blow the stack however deep its tuples go
        k = stack.pop()
        if type(k) is tuple:
            stack.extend(k)
        elif not (k is None or type(k) in (str, int, float, bool)):
            return False
    return True


class _Encoder:
    def __init__(self, arrays: Mapping[int, torch.Tensor] | None = None) -> None:
        self.arrays = arrays or {}  # id(numpy array) -> its tensor, made already (freeze_state)
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []  # per tensor: see encode_state_named ("" when not asked for)
        self.kinds: list[str] = []
        self.index: dict[int, int] = {}      # id(tensor or ndarray) -> index in self.tensors
        self.active: set[int] = set()       # ids of containers on the current path (cycle guard)
        self.plain = False  # every tensor is known plain strided (encode_state_named's ``plain``)

    def add(self, key: object, tensor: torch.Tensor, name: str | None, kind: str) -> int:
        i = self.index.get(id(key))
        if i is None:
            i = self.index[id(key)] = len(self.tensors)
            self.tensors.append(tensor)
            self.names.append("" if name is None else name or "<root>")
            self.kinds.append(kind)
        elif name is not None and not self.names[i]:  # first met where nothing is named (_metadata)
            self.names[i] = name or "<root>"
        return i

    def enc(self, obj: Any, path: str, depth: int, name: str | None = None) -> object:
        """``path``: the key path for error messages; ``name``: the one tensors are named by
        (None: names not asked for; while they agree, ``name`` is ``path``, one string).

        Per-element cost decides a state of 100,000 tensors: the common leaves (str, None,
        bool, ints within 2**63, finite floats, plain tensors) are handled inline in the
        container loops, without a call and without building their key path (which only an
        error message or a tensor's name needs)."""
        t = type(obj)
        if obj is None or t is bool or t is str:
            return obj
        if t is int:
            return _enc_int(obj)
        if t is torch.Tensor or t is torch.nn.Parameter:
            return {"$tensor": self.add(obj, self.check_tensor(obj, path), name, "tensor")}
        if t is float:
            return _enc_float(obj)
        if t in _CONTAINERS:
            return self.enc_container(obj, t, path, depth, name)
        return self.enc_rare_leaf(obj, t, path, name)

    def enc_rare_leaf(self, obj: Any, t: type, path: str, name: str | None) -> object:
        """The leaves enc does not handle inline: bytes, tensor subclasses (rejected by check_tensor),
        numpy arrays and scalars, dtypes and devices; anything else is UnsupportedObjectError."""
        if t is bytes:
            return {"$bytes": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, torch.Tensor):
            return {"$tensor": self.add(obj, self.check_tensor(obj, path), name, "tensor")}
        if t is np.ndarray:
            made = self.arrays.get(id(obj))
            return {"$ndarray": self.add(obj, self.array_tensor(obj, path) if made is None else made, name, "ndarray")}
        if isinstance(obj, np.generic):
            return {"$npscalar": self.np_scalar(obj, path)}
        if t is torch.dtype:
            return {"$dtype": dtype_to_name(obj)}
        if t is torch.device:
            return {"$device": str(obj)}
        raise UnsupportedObjectError(path, obj, _why(obj))

    def enc_container(self, obj: Any, t: type, path: str, depth: int, name: str | None) -> object:
        """A list, tuple, torch.Size or mapping (``t``: its type), guarded against nesting deeper than
        MAX_DEPTH and against cycles (a container on the current path met again)."""
        if depth >= MAX_DEPTH:
            raise UnsupportedObjectError(path, obj, f"nesting deeper than {MAX_DEPTH} levels")
        if id(obj) in self.active:
            raise UnsupportedObjectError(path, obj, "cyclic reference: the container contains itself")
        self.active.add(id(obj))
        try:
            if t is list or t is tuple:
                return self.enc_items(obj, t, path, depth, name)
            if t is torch.Size:
                return {"$size": [_enc_int(int(v)) for v in obj]}
            return self.enc_mapping(obj, t, path, depth, name)
        finally:
            self.active.discard(id(obj))

    def enc_items(self, obj: list | tuple, t: type, path: str, depth: int, name: str | None) -> object:
        """A list (as a list) or a tuple (as ``$tuple``); plain leaves are kept inline (see enc)."""
        items = []
        for i, v in enumerate(obj):
            tv = type(v)
            if (v is None or tv is str or tv is bool or (tv is int and -_BIG_INT < v < _BIG_INT)
                    or (tv is float and math.isfinite(v))):
                items.append(v)  # a plain leaf: as enc would give it
                continue
            at = _join(path, i)
            items.append(self.enc(v, at, depth + 1,
                                  at if name is path else None if name is None else _join(name, i)))
        return items if t is list else {"$tuple": items}

    def enc_mapping(self, obj: Any, t: type, path: str, depth: int, name: str | None) -> object:
        """A dict (``$dict``) or an OrderedDict (``$odict``, with its ``_metadata``) as [key, value]
        pairs; plain leaves, plain keys and plain tensors are handled inline (see enc)."""
        pairs = self.tensor_pairs(obj, t, name)
        if pairs is None:
            pairs = self.pairs(obj, path, depth, name)
        if t is dict or t is FrozenDictOfDicts:
            return {"$dict": pairs}
        out: dict[str, object] = {"$odict": pairs}
        meta = getattr(obj, "_metadata", None)
        if meta is not None:  # nn.Module.state_dict() keeps per-module versions here
            out["meta"] = self.enc(meta, _join(path, "_metadata"), depth + 1)
        return out

    def tensor_pairs(self, obj: Any, t: type, name: str | None) -> list | None:
        """enc_mapping's pairs of the usual mapping of a state of many tensors (a module's
        state_dict, a group of a nested dict): str keys, each value a plain strided tensor met
        for the first time, none named "<root>". Encoded in C-level passes and one list
        comprehension, with exactly the pairs, names and indices the loop gives; None where
        the mapping is any other (the loop then encodes it)."""
        if t is FrozenDictOfDicts:
            return None
        if t is FrozenOrderedDict:
            keys, values = obj.keys, obj.values
        else:
            keys, values = list(obj), list(obj.values())
        if (len(keys) < _BULK_MIN or set(map(type, keys)) != {str} or not set(map(type, values)) <= _TENSOR_TYPES
                or (name == "" and "" in keys)):
            return None
        if not self.plain and (any(map(_IS_NESTED, values)) or any(map(_IS_META, values))
                               or set(map(_LAYOUT, values)) != {torch.strided}):
            return None
        ids = list(map(id, values))
        index = self.index
        if len(set(ids)) != len(ids) or not index.keys().isdisjoint(ids):  # a tensor met twice: the loop
            return None
        start = len(self.tensors)
        numbers = range(start, start + len(values))
        index.update(zip(ids, numbers))
        self.tensors += values
        self.names += [""] * len(keys) if name is None else [f"{name}/{k}" for k in keys] if name else keys
        self.kinds += ["tensor"] * len(keys)
        return [[k, {"$tensor": i}] for k, i in zip(keys, numbers)]

    def pairs(self, obj: Any, path: str, depth: int, name: str | None) -> list:
        """enc_mapping's pairs, one entry at a time."""
        pairs = []
        for k, v in obj.items():
            tk = type(k)
            ek = k if tk is str or (tk is int and -_BIG_INT < k < _BIG_INT) else self.enc_key(k, path, depth)
            tv = type(v)
            if (v is None or tv is str or tv is bool or (tv is int and -_BIG_INT < v < _BIG_INT)
                    or (tv is float and math.isfinite(v))):
                pairs.append([ek, v])  # a plain leaf: as enc would give it
                continue
            at = _join(path, k)
            if name is None:
                child = None
            elif name is path and type(ek) is not dict:  # the name is the path (the same string)
                child = at
            else:  # a key stored as an object is named by its repr in the tree
                child = _join(name, k if type(ek) is not dict else repr(ek))
            if tv is torch.Tensor or tv is torch.nn.Parameter:
                pairs.append([ek, {"$tensor": self.add(v, self.check_tensor(v, at), child, "tensor")}])
            else:
                pairs.append([ek, self.enc(v, at, depth + 1, child)])
        return pairs

    def enc_key(self, k: object, path: str, depth: int) -> object:
        """A dict key other than a str or an int within 2**63 (those are kept inline): a float, bool,
        None, big int or tuple of those, encoded as a value; any other type is UnsupportedObjectError."""
        if not _is_key(k):
            raise UnsupportedObjectError(_join(path, repr(k)), k, "dict keys must be str, int, float, "
                                         "bool, None or tuples of those")
        return self.enc(k, path, depth + 1)

    @staticmethod
    def check_tensor(t: torch.Tensor, path: str) -> torch.Tensor:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            why = (f"tensor subclass {type(t).__qualname__} is not supported: save a plain tensor, "
                   "e.g. x.detach().as_subclass(torch.Tensor) or the subclass's own state")
        elif t.is_nested:
            why = "nested tensors are not supported: save t.unbind() as a list of tensors"
        elif t.layout != torch.strided:
            why = f"sparse tensors ({t.layout}) are not supported: call .to_dense() first"
        elif t.is_meta:
            why = "meta tensors have no data: materialise them (e.g. to_empty() and init) before saving"
        else:
            return t
        raise UnsupportedObjectError(path, t, why)

    @staticmethod
    def array_tensor(a: np.ndarray, path: str) -> torch.Tensor:
        try:
            return torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))  # keeps 0-d as 0-d
        except (TypeError, ValueError, RuntimeError) as e:
            raise UnsupportedObjectError(path, a, f"numpy arrays of dtype {a.dtype} cannot be stored "
                                         f"as tensors ({e})") from None

    @staticmethod
    def np_scalar(x: np.generic, path: str) -> list:
        name = _NP_NAMES.get(type(x))
        if name is None:
            raise UnsupportedObjectError(path, x, f"numpy scalars of dtype {x.dtype} are not supported: "
                                         "convert with .item() or to a numpy array")
        kind = x.dtype.kind
        if kind == "b":
            value: object = bool(x)
        elif kind in "iu":
            value = _enc_int(int(x))
        elif kind == "f":
            value = _enc_float(float(x))
        elif kind == "c":
            value = [_enc_float(float(x.real)), _enc_float(float(x.imag))]
        elif kind == "U":
            value = str(x)
        else:  # "S"
            value = base64.b64encode(bytes(x)).decode("ascii")
        return [name, value]


check_tensor = _Encoder.check_tensor  # the tensor kinds the format cannot store (with why), for save_async's checks


def _why(obj: object) -> str:
    if isinstance(obj, (set, frozenset)):
        return "sets are not supported: convert to a (sorted) list"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "named tuples are not supported: convert with tuple(x) or x._asdict()"
    if isinstance(obj, dict):
        return "dict subclasses are not supported: convert with dict(x)"
    if isinstance(obj, list):
        return "list subclasses are not supported: convert with list(x)"
    if isinstance(obj, (bool, int, float, str, bytes)):
        base = next(b for b in (int, float, str, bytes) if isinstance(obj, b)).__name__
        return f"subclasses of {base} are not supported: convert with {base}(x)"
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.LambdaType)):
        return "functions cannot be stored without pickle: drop them from the state_dict"
    if isinstance(obj, torch.Generator):
        return "save generator.get_state() instead of the generator"
    return ""


# ----------------------------------------------------------------------------- decode

def decode_state(tree: object, tensors: Sequence[torch.Tensor]) -> object:
    """Inverse of :func:`encode_state`: rebuild the state, with ``tensors[i]`` for index ``i``.

    ``tree`` is untrusted: anything malformed raises :class:`CorruptCheckpointError`.
    """
    return _Decoder(tensors).dec(tree, 0)


Slots = list
"""Where a decoded tree's tensor leaves went: ``(container, keys, tensor indices)`` entries, a
dict's or a list's keys (indices) and the tensors put there; a dict of tensors alone is one
entry (filled by one dict.update)."""


def decode_state_slots(tree: object, tensors: Sequence[torch.Tensor]) -> tuple[object, Slots | None]:
    """decode_state, also returning where each tensor leaf went (a dict's key or a list's
    index), so that ``fill_slots`` can put other tensors there without decoding the tree again
    (a load decodes it over placeholders to plan, then needs it over the tensors read: 100,000
    tensors, 0.2-0.3 s each time). The slots are None when some tensor sits where it cannot be
    replaced in place (in a tuple, as a numpy array, as the tree itself): decode again then."""
    decoder = _Decoder(tensors, slots=True)
    out = decoder.dec(tree, 0)
    return out, decoder.slots if decoder.slotted == decoder.used else None


def fill_slots(slots: Slots, tensors: Sequence[torch.Tensor]) -> None:
    """Put ``tensors[i]`` at each slot decode_state_slots found (in place)."""
    get = tensors.__getitem__
    for container, keys, indices in slots:
        if type(container) is list:
            for j, i in zip(keys, indices):
                container[j] = tensors[i]
        else:
            container.update(zip(keys, map(get, indices)))


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint state is damaged: {msg}")


def _dec_float(v: object) -> float:
    if type(v) is float:
        return v
    if type(v) is dict and len(v) == 1 and type(s := v.get("$float")) is str:
        if s in ("nan", "-nan", "inf", "-inf"):
            return float(s)  # a fresh object each time: distinct NaN dict keys stay distinct
        if re.fullmatch(r"bits:[0-9a-f]{16}", s):
            return struct.unpack("<d", struct.pack("<Q", int(s[5:], 16)))[0]
    raise _bad(f"expected a float, got {_show(v)}")


def _dec_int(v: object) -> int:
    if type(v) is int:
        return v
    if type(v) is dict and len(v) == 1 and type(s := v.get("$int")) is str and _INT_RE.fullmatch(s):
        return int(s, 16)
    raise _bad(f"expected an int, got {_show(v)}")


def _dec_b64(s: object) -> bytes:
    if type(s) is str:
        try:
            return base64.b64decode(s, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise _bad(f"expected base64 text, got {_show(s)}")


def _dec_size(x: object) -> torch.Size:
    if type(x) is not list:
        raise _bad("$size must hold a list")
    dims = [_dec_int(e) for e in x]
    if any(not 0 <= d < _BIG_INT for d in dims):
        raise _bad(f"bad torch.Size {_show(dims)}")
    return torch.Size(dims)


def _dec_device(x: object) -> torch.device:
    if type(x) is str and len(x) <= 64:
        try:
            return torch.device(x)
        except (RuntimeError, ValueError, TypeError):
            pass
    raise _bad(f"bad device {_show(x)}")


def _show(v: object) -> str:
    return shown(v, 80)


def shown(v: object, limit: int) -> str:
    """``repr(v)`` cut to ``limit`` characters, for messages about untrusted values: an int of
    more than 4300 digits ($int holds any) has no repr (ValueError), so it is described instead."""
    try:
        text = repr(v)
    except ValueError:
        text = f"<{type(v).__name__} too large to print>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def key_text(k: object) -> str:
    """A decoded dict key as text (``str(k)``, an int of any size included)."""
    try:
        return str(k)
    except ValueError:
        return shown(k, 80)


class _Decoder:
    def __init__(self, tensors: Sequence[torch.Tensor], *, slots: bool = False) -> None:
        self.tensors = tensors
        self.arrays: dict[int, np.ndarray] = {}
        self.slots: Slots | None = [] if slots else None  # where the tensor leaves of dicts and lists went
        self.used = 0  # tensor leaves decoded (all have slots when as many were recorded)
        self.slotted = 0  # tensor leaves in self.slots

    def tensor(self, i: object) -> torch.Tensor:
        if type(i) is not int or not 0 <= i < len(self.tensors):
            raise _bad(f"tensor index {_show(i)} out of range (checkpoint holds {len(self.tensors)} tensors)")
        self.used += 1
        return self.tensors[i]

    def dec(self, v: object, depth: int) -> object:
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if depth >= MAX_DEPTH:
            raise _bad(f"nesting deeper than {MAX_DEPTH} levels")
        if t is list:
            out = [self.dec(x, depth + 1) for x in v]
            if self.slots is not None:
                at = [j for j, x in enumerate(v) if type(x) is dict and len(x) == 1 and "$tensor" in x]
                if at:
                    self.slots.append((out, at, [v[j]["$tensor"] for j in at]))
                    self.slotted += len(at)
            return out
        if t is not dict:
            raise _bad(f"unexpected {t.__qualname__} in state tree")
        if len(v) == 1 and "$tensor" in v:  # the most common tagged value: no tag search
            return self.tensor(v["$tensor"])
        return self.dec_tagged(v, depth)  # type: ignore[arg-type]

    def dec_tagged(self, v: dict, depth: int) -> object:
        """A single-tag dict (``$odict`` may add ``meta``): a container decoded here, a scalar by
        dec_scalar; any other key set is damage."""
        keys = set(v)
        tag = next((k for k in keys if k in _TAGS), None)
        if tag is None or keys != ({tag, "meta"} if tag == "$odict" and "meta" in keys else {tag}):
            raise _bad(f"unknown or malformed tagged value with keys {_show(sorted(map(str, keys)))}")
        x = v[tag]
        if tag in ("$dict", "$odict"):
            out = self.dec_pairs(tag, x, depth)
            if "meta" in v:
                out._metadata = self.dec(v["meta"], depth + 1)  # type: ignore[attr-defined]
            return out
        if tag == "$tuple":
            if type(x) is not list:
                raise _bad("$tuple must hold a list")
            return tuple(self.dec(e, depth + 1) for e in x)
        return self.dec_scalar(tag, v, x)

    def dec_pairs(self, tag: str, x: object, depth: int) -> dict:
        """The [key, value] pairs of a ``$dict`` (a dict) or ``$odict`` (an OrderedDict); keys must be
        of a key type and distinct."""
        if type(x) is not list:
            raise _bad(f"{tag} must hold a list of [key, value] pairs")
        leaf = depth + 1 < MAX_DEPTH
        if len(x) >= _BULK_PAIRS and leaf:
            bulk = self.tensor_pairs(tag, x)
            if bulk is not None:
                return bulk
        out = {} if tag == "$dict" else collections.OrderedDict()
        tensors, count, keys, indices = self.tensors, len(self.tensors), [], []  # (the tensor leaves' slots)
        for pair in x:
            if type(pair) is not list or len(pair) != 2:
                raise _bad(f"{tag} entry {_show(pair)} is not a [key, value] pair")
            key, val = pair
            if type(key) is not str:  # a str key is itself (dec and _is_key need not ask)
                key = self.dec(key, depth + 1)
                if not _is_key(key):
                    raise _bad(f"dict key {_show(key)} has a type keys cannot have")
            if key in out:
                raise _bad(f"duplicate dict key {_show(key)}")
            if type(val) is dict and len(val) == 1 and "$tensor" in val and leaf:  # a tensor leaf, inline
                i = val["$tensor"]
                out[key] = tensors[i] if type(i) is int and 0 <= i < count else self.tensor(i)  # (raises)
                self.used += 1
                keys.append(key)
                indices.append(i)
                continue
            out[key] = self.dec(val, depth + 1)
        if self.slots is not None and keys:
            self.slots.append((out, keys, indices))
            self.slotted += len(keys)
        return out

    def tensor_pairs(self, tag: str, x: list) -> dict | None:
        """dec_pairs of ``x`` without a Python step per pair, where every pair is [a str or int
        key, {"$tensor": i}] (a state_dict's tensors), the keys distinct and every i in range:
        whole-list checks and constructors (dict, map, set), all in C. None where any pair is
        otherwise (dec_pairs' loop decides then, and names what is wrong)."""
        if set(map(type, x)) != {list}:
            return None
        try:
            pairs = dict(x)  # ValueError: a pair not of two; TypeError: a key that cannot be one
        except (TypeError, ValueError):
            return None
        values = pairs.values()
        if (len(pairs) != len(x) or not set(map(type, pairs)) <= _BULK_KEYS or set(map(type, values)) != {dict}
                or set(map(len, values)) != {1}):
            return None
        try:
            indices = list(map(_TENSOR_INDEX, values))
        except KeyError:
            return None
        if set(map(type, indices)) != {int} or min(indices) < 0 or max(indices) >= len(self.tensors):
            return None
        out = (dict if tag == "$dict" else collections.OrderedDict)(zip(pairs, map(self.tensors.__getitem__, indices)))
        self.used += len(indices)
        if self.slots is not None:
            self.slots.append((out, list(pairs), indices))
            self.slotted += len(indices)
        return out

    def dec_scalar(self, tag: str, v: dict, x: object) -> object:
        """The value of a tag that holds no nested tree (``x``: what it holds, ``v``: the tagged dict)."""
        if tag == "$size":
            return _dec_size(x)
        if tag == "$float":
            return _dec_float(v)
        if tag == "$int":
            return _dec_int(v)
        if tag == "$bytes":
            return _dec_b64(x)
        if tag == "$tensor":
            return self.tensor(x)
        if tag == "$ndarray":
            return self.array(x)
        if tag == "$npscalar":
            return self.np_scalar(x)
        if tag == "$dtype":
            return dtype_from_name(x)
        return _dec_device(x)  # "$device"

    def array(self, i: object) -> np.ndarray:
        t = self.tensor(i)
        if i not in self.arrays:
            try:
                self.arrays[i] = t.detach().cpu().numpy()  # type: ignore[index]
            except (TypeError, RuntimeError) as e:
                raise _bad(f"tensor {i} ({t.dtype}) cannot be a numpy array: {e}") from None
        return self.arrays[i]  # type: ignore[index]

    @staticmethod
    def np_scalar(x: object) -> np.generic:
        if type(x) is not list or len(x) != 2 or type(x[0]) is not str or x[0] not in _NP_SCALARS:
            raise _bad(f"bad numpy scalar {_show(x)}")
        cls, value = _NP_SCALARS[x[0]], x[1]
        kind = np.dtype(cls).kind
        if kind == "b" and type(value) is bool:
            return cls(value)
        if kind in "iu":
            i = _dec_int(value)
            info = np.iinfo(cls)
            if info.min <= i <= info.max:
                return cls(i)
        elif kind in "fc":
            with np.errstate(all="ignore"):  # a too-large value for float16/32 becomes inf, as numpy does
                if kind == "f":
                    return cls(_dec_float(value))
                if type(value) is list and len(value) == 2:
                    return cls(complex(_dec_float(value[0]), _dec_float(value[1])))
        elif kind == "U" and type(value) is str:
            return cls(value)
        elif kind == "S":
            return cls(_dec_b64(value))
        raise _bad(f"bad numpy scalar {_show(x)}")


def tensor_refs(tree: Any, count: int) -> list[int]:
    """The tensor indices a state tree references, in order, once each. The tree is untrusted: a
    reference that is not one of the ``count`` tensor records, or nesting deeper than MAX_DEPTH,
    is CorruptCheckpointError (before anything is read for it)."""
    out: dict[int, None] = {}

    def walk(v: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _bad(f"nesting deeper than {MAX_DEPTH} levels")
        if isinstance(v, list):
            for x in v:
                walk(x, depth + 1)
        elif isinstance(v, dict):
            if len(v) == 1 and ("$tensor" in v or "$ndarray" in v):
                i = next(iter(v.values()))
                if type(i) is not int or not 0 <= i < count:
                    raise _bad(f"tensor index {_show(i)} out of range (checkpoint holds {count} tensors)")
                out[i] = None
                return
            for x in v.values():
                walk(x, depth + 1)

    walk(tree, 0)
    return list(out)
