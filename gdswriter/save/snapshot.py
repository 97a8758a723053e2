"""Snapshots: what a save records of the live state, at the call, without moving its bytes.

``take_snapshot`` encodes the state tree (no pickle; every non-tensor value is captured by
value), groups its tensors by the allocation they view (tied weights, views and numpy arrays
sharing memory are written once) and describes each group as one flat byte extent of live
memory. Tensors the optimizer does not update (module buffers such as BatchNorm statistics,
extra state) that are small are copied right away (up to CAPTURE_MAX each, CAPTURE_BUDGET per
save; beyond the budget they stay live), because training changes them before the next
optimizer step; the rest stays live, and the save (writer.py) copies or writes it in the
background. ``Snapshot.unguarded`` names the live extents that no optimizer step pre-hook
guards (nothing holds their memory unchanged while the save reads it): the checkpointer
waits, in save_async, until the save has released those. On a GPU an event on each device's
current stream marks the point the saved values belong to (cuda/streams.py).
"""

from __future__ import annotations

import ctypes
import json
import math
import operator
import weakref
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from typing import Any

import numpy as np
import torch

from ..cuda import streams
from ..errors import SnapshotChangedError, UnsupportedObjectError
from ..format.manifest import SavedTensors, TensorRecord, saved_tensors
from ..format.state_codec import FrozenOrderedDict, Unfreezable, check_tensor, encode_state_named, freeze_state
from ..options import MiB
from .._log import log_once
from ..tensors import flat_bytes

STORAGE_ALIGN = 16  # extents start at a multiple of the largest item size, so every view stays valid
CAPTURE_MAX = 1 * MiB  # unprotected extents up to this size are copied at the call...
CAPTURE_BUDGET = 64 * MiB  # ...up to this many bytes per snapshot


class Extent:
    """The bytes one group of saved tensors views, as a flat uint8 tensor (``flat``): live
    memory, or a copy taken at the call (``captured``). A view of a storage is made when
    first asked for, on the save thread (save_async only notes storage, offset and length).
    ``keepalive`` holds the tensors whose memory a raw view points into."""

    __slots__ = ("_flat", "_view", "captured", "device", "first_tensor", "keepalive", "nbytes")

    def __init__(self, first_tensor: str, flat: torch.Tensor | None = None,
                 view: tuple[torch.UntypedStorage, torch.device, int, int] | None = None, keepalive: tuple = ()):
        self.first_tensor, self.captured, self.keepalive = first_tensor, False, keepalive
        self._flat, self._view = flat, view
        self.nbytes = flat.numel() if flat is not None else view[3]  # type: ignore[index]
        self.device = flat.device if flat is not None else view[1]  # type: ignore[index]

    @property
    def flat(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = flat_bytes(*self._view)  # type: ignore[misc]
        return self._flat

    def host_address(self) -> int | None:
        """The address of the first byte, when the bytes are in host (CPU) memory; else None."""
        if self.device.type != "cpu":
            return None
        if self._view is not None:
            return self._view[0].data_ptr() + self._view[2]
        return self._flat.data_ptr()  # type: ignore[union-attr]

    def replace(self, flat: torch.Tensor) -> None:
        """Hold ``flat`` (a copy taken now) instead of the live bytes."""
        self._flat, self._view, self.captured, self.keepalive = flat, None, True, ()
        self.device = flat.device


class LazyExtents(Sequence):
    """Extents as columns, each viewing a storage (``viewed[i]``, from byte ``starts[i]``,
    ``sizes[i]`` bytes, on ``devices[i]``, named ``names[i]``), the Extent objects made on first
    use, all at once, and kept (``made``; None before): a layout of lone tensors
    (_each_alone) or a reused one (LayoutCache.reuse). A save through the host pool reads only
    the columns (the sizes and devices for the plan and the manifest, ``addresses`` for the
    pool's layout: each extent's first byte in host memory, None where not known), so it makes
    no object per extent. The columns are never changed (the caller must not change them)."""

    __slots__ = ("addresses", "devices", "made", "names", "sizes", "starts", "tensors", "viewed")

    def __init__(self, viewed: Sequence[torch.UntypedStorage] | None, devices: list[torch.device], starts: list[int],
                 sizes: list[int], names: list[str], addresses: list[int] | None = None,
                 tensors: Sequence[torch.Tensor] = ()) -> None:
        # viewed None: extent i views tensors[i]'s storage, asked of it when the extents are made
        # (a reused layout of lone tensors: LayoutCache.reuse_alone reads no storage object)
        self.viewed, self.devices, self.starts, self.sizes, self.names = viewed, devices, starts, sizes, names
        self.addresses, self.tensors = addresses, tensors
        self.made: list[Extent] | None = None

    def _extents(self) -> list[Extent]:
        if self.made is None:  # the views' tuples made by zip and the extents by map: no Python loop
            viewed = self.viewed
            if viewed is None:
                viewed = list(map(torch.Tensor.untyped_storage, self.tensors))
            self.made = list(map(Extent, self.names, repeat(None), zip(viewed, self.devices, self.starts, self.sizes)))
        return self.made

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):
        return self._extents()[i]

    def __iter__(self) -> Iterator[Extent]:
        return iter(self._extents())


_NBYTES = operator.attrgetter("nbytes")


def host_addresses(extents: Sequence[Extent]) -> list[int | None]:
    """Each extent's host_address: in C-level passes where every extent is a view of a CPU
    storage (a first save of many tensors: no Python call per extent), else one by one."""
    views = [e._view for e in extents]
    if None in views or not all(d.type == "cpu" for d in set(map(operator.itemgetter(1), views))):
        return [e.host_address() for e in extents]
    return list(map(operator.add, map(torch.UntypedStorage.data_ptr, map(operator.itemgetter(0), views)),
                    map(operator.itemgetter(2), views)))


@dataclass
class Snapshot:
    """A save's view of the state: the encoded tree, the extents to write, one record per
    tensor, the metadata, and per CUDA device the event the extents' bytes are valid after.
    ``unguarded``: the first tensor of each extent that stays live although no optimizer hook
    guards it (see take_snapshot's ``protected``)."""

    step: int
    tree: Any
    extents: Sequence[Extent]  # a list, or LazyExtents (made on first use)
    # per tensor its TensorRecord: a SavedTensors (columns, each record made on first use) from
    # take_snapshot; any sequence of records where another module makes a Snapshot
    records: Sequence[TensorRecord]
    metadata: dict
    ready: dict[int, Any] = field(default_factory=dict)
    unguarded: list[str] = field(default_factory=list)
    prepared: Any = None  # what Session.prepare returned beside the state, for this save's write_and_commit
    # The LayoutCache key the extents were laid out by (the same object while saves reuse the
    # layout: the extents view the same memory then), None where an extent is a copy or raw
    # memory: what lets the host pool reuse its layout of the files (pool.py)
    layout_key: Any = None

    @property
    def nbytes(self) -> int:
        return sum(self.extent_sizes())

    def extent_sizes(self) -> list[int]:
        """Each extent's nbytes (a reused layout's column where its extents are not made yet:
        no extent made for it). The caller must not change the list."""
        ext = self.extents
        if type(ext) is LazyExtents and ext.made is None:
            return ext.sizes
        return list(map(_NBYTES, ext))

    def extent_devices(self) -> list[torch.device]:
        """Each extent's device (as extent_sizes)."""
        ext = self.extents
        if type(ext) is LazyExtents and ext.made is None:
            return ext.devices
        return list(map(_DEVICE, ext))

    def host_addresses(self) -> list[int | None]:
        """Each extent's first byte in host memory, None where it is not there (host_addresses;
        the layout's column where its extents are not made yet)."""
        ext = self.extents
        if type(ext) is LazyExtents and ext.made is None and ext.addresses is not None:
            return ext.addresses
        return host_addresses(ext)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def held_by(obj: Any) -> list[Any]:
    """What an optimizer holds that its step can change: its parameters and its state's values,
    as they are (DTensors, a step count...; local_tensors makes the tensors of them). Called by
    every save_async: C-level passes over the optimizer's lists and dicts, no Python step per
    tensor."""
    found = list(chain.from_iterable(g.get("params", ()) for g in getattr(obj, "param_groups", ())))
    state = getattr(obj, "state", None)
    if state:
        n = len(found)
        try:
            found += chain.from_iterable(map(dict.values, state.values()))
        except TypeError:  # a parameter's state that is no dict
            del found[n:]
            found += [v for st in state.values() if isinstance(st, dict) for v in st.values()]
    return found


def local_tensors(held: list[Any]) -> list[torch.Tensor]:
    """The tensors among ``held`` (held_by), each as the step changes it in place: a DTensor's
    local shard; no copies."""
    if set(map(type, held)) <= _PLAIN:
        return held
    # values that are no plain tensors: DTensors, subclasses, a step count...
    return [t if type(t) in _PLAIN else _local(t) for t in held if isinstance(t, torch.Tensor)]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2, tensor parallelism)
    return to_local() if callable(to_local) else t


def plain_json(metadata: Any) -> dict:
    """A deep copy of ``metadata`` as the manifest will hold it (plain JSON, so later changes
    to the caller's objects do not reach the saved step)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise UnsupportedObjectError("metadata", metadata, "metadata must be a dict of plain JSON values")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise UnsupportedObjectError("metadata", metadata, f"metadata must be plain JSON: {e}") from e


_DTYPE, _SHAPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("shape"), operator.attrgetter("device")
_IS_QUANTIZED = operator.attrgetter("is_quantized")


class LayoutCache:
    """The layout of a checkpointer's last snapshot (its extents' geometry, the tensor records),
    which ``take_snapshot`` reuses while every tensor has the key path, kind, storage address and
    size, offset, shape, stride, dtype and device it had then: in a training loop, every save
    after the first. The layout is a function of exactly those, so reusing it gives what
    computing it again would, for a fraction of the save call's time (the grouping and the
    records are most of it, for a state of hundreds of tensors). A layout of lone tensors is
    a function of fewer, read without storage objects (reuse_alone)."""

    __slots__ = ("_alone", "_at_call", "_columns", "key", "placed", "recipe", "records")

    def __init__(self) -> None:
        self._at_call: LayoutCache | None = None
        self.key: tuple | None = None
        # A layout of lone tensors (_each_alone) is a function of fewer things than the key, each
        # read with no storage object (see reuse_alone): (names, kinds, each tensor's first-byte
        # address, storage offset, dtype, shape, stride and device; the extents' host addresses)
        self._alone: tuple | None = None
        # per extent: (index of a tensor whose storage it views, -1 if empty; device; start; nbytes;
        # its first tensor's name)
        self.recipe: list[tuple[int, torch.device, int, int, str]] = []
        self.records: Sequence[TensorRecord] = ()  # the tensors' records (_records: columns), never changed
        self.placed: list[tuple[int, int]] = []  # per tensor: (extent index, byte offset in it)
        # the recipe as columns (sources, devices, starts, sizes, names), where no extent is empty;
        # sources None where extent i views tensor i's storage (the usual state)
        self._columns: tuple | None = None

    @property
    def at_call(self) -> LayoutCache:
        """The layout of the tensors the last save_async grouped at the call (see PendingSnapshot)."""
        if self._at_call is None:
            self._at_call = LayoutCache()
        return self._at_call

    @staticmethod
    def key_of(tensors: Sequence[torch.Tensor], names: Sequence[str], kinds: Sequence[str],
               storages: Sequence[torch.UntypedStorage] | None = None,
               dtypes: Sequence[torch.dtype] | None = None) -> tuple:
        """What the layout is a function of, as one list per property (C-level passes, no tuple
        per tensor); ``storages``: each tensor's untyped_storage(), ``dtypes``: each one's dtype,
        if the caller has them already (one call per tensor fewer each)."""
        if storages is None:
            storages = [t.untyped_storage() for t in tensors]
        return (list(names), list(kinds), list(map(torch.UntypedStorage.data_ptr, storages)),
                list(map(torch.UntypedStorage.nbytes, storages)), list(map(torch.Tensor.storage_offset, tensors)),
                list(map(_DTYPE, tensors)) if dtypes is None else list(dtypes), list(map(_SHAPE, tensors)),
                list(map(torch.Tensor.stride, tensors)), list(map(_DEVICE, tensors)))

    @staticmethod
    def columns_of(tensors: Sequence[torch.Tensor], names: Sequence[str], kinds: Sequence[str],
                   dtypes: Sequence[torch.dtype] | None = None) -> tuple:
        """What a layout of lone tensors is a function of, read with no storage object, one list
        per property (C-level passes): (names, kinds, each tensor's first-byte address, storage
        offset, dtype, shape, stride, device). The records are made from them too; the full
        key (key_of: the storages' addresses and sizes) only where the tensors are not lone."""
        return (list(names), list(kinds), list(map(torch.Tensor.data_ptr, tensors)),
                list(map(torch.Tensor.storage_offset, tensors)),
                list(map(_DTYPE, tensors)) if dtypes is None else list(dtypes), list(map(_SHAPE, tensors)),
                list(map(torch.Tensor.stride, tensors)), list(map(_DEVICE, tensors)))

    @staticmethod
    def key_from(columns: tuple, storages: Sequence[torch.UntypedStorage]) -> tuple:
        """key_of from columns_of's ``columns`` and the tensors' storages (no property read twice)."""
        names, kinds, _, offsets, dtypes, shapes, strides, devices = columns
        return (names, kinds, list(map(torch.UntypedStorage.data_ptr, storages)),
                list(map(torch.UntypedStorage.nbytes, storages)), offsets, dtypes, shapes, strides, devices)

    def reuse_alone(self, tensors: Sequence[torch.Tensor], names: Sequence[str], kinds: Sequence[str],
                    dtypes: Sequence[torch.dtype] | None = None) -> tuple[LazyExtents, list[tuple[int, int]],
                                                                         Sequence[TensorRecord]] | None:
        """The cached layout of lone tensors (one extent per tensor, each alone in memory:
        _each_alone), if ``tensors`` still have what it is a function of; else None. Each
        tensor's storage base is its first byte's address (data_ptr) less its storage offset
        times its item size, so those three stand for the storage's address, and a lone
        tensor's extent (its own bytes from the 16-byte boundary at or below the first) needs no
        storage size: the tensors' byte ranges are those the layout found disjoint, and a fresh
        layout of disjoint ranges gives these extents whatever the storages' sizes (one group
        per tensor, viewing its own storage). Six C-level passes of tensor properties, each
        compared before the next is read, no storage object made (two passes fewer than the
        key's): the extents view the storages once made (LazyExtents, from the tensors)."""
        alone = self._alone
        if alone is None or len(tensors) != len(alone[2]) or names != alone[0] or kinds != alone[1]:
            return None
        try:
            if (list(map(_DTYPE, tensors)) if dtypes is None else list(dtypes)) != alone[4]:
                return None
            for i, get in ((2, torch.Tensor.data_ptr), (3, torch.Tensor.storage_offset), (5, _SHAPE),
                           (6, torch.Tensor.stride), (7, _DEVICE)):
                if list(map(get, tensors)) != alone[i]:
                    return None
        except (RuntimeError, NotImplementedError):  # a tensor whose data_ptr cannot be read: laid out anew
            return None
        _, devices, starts, sizes, names = self._columns  # type: ignore[misc]
        return LazyExtents(None, devices, starts, sizes, names, alone[8], tensors), self.placed, self.records

    def reuse(self, key: tuple, tensors: Sequence[torch.Tensor],
              storages: Sequence[torch.UntypedStorage] | None = None) -> tuple[Sequence[Extent], list[tuple[int, int]],
                                                                                Sequence[TensorRecord]] | None:
        """The cached layout with views of ``tensors``' storages (``storages``, if given), if
        ``key`` is the cached one."""
        if key != self.key:
            return None
        if storages is None:
            storages = [t.untyped_storage() for t in tensors]
        if self._columns is not None:  # the extents made on first use (LazyExtents)
            sources, devices, starts, sizes, names = self._columns
            viewed = storages if sources is None else list(map(storages.__getitem__, sources))
            extents = LazyExtents(viewed, devices, starts, sizes, names)
        else:
            empty = torch.empty(0, dtype=torch.uint8)
            extents = [Extent(name, view=(storages[src], device, start, n)) if src >= 0 else Extent(name, flat=empty)
                       for src, device, start, n, name in self.recipe]
        return extents, self.placed, self.records

    def remember_alone(self, columns: tuple, extents: LazyExtents, placed: list[tuple[int, int]],
                       records: Sequence[TensorRecord]) -> None:
        """Keep a layout of lone tensors (_each_alone's, before any extent is captured): the
        columns it is a function of (columns_of, compared by reuse_alone; the tuple is also
        the key the host pool knows the layout by) and its extents' columns (the recipe)."""
        self.key, self.placed, self.records, self.recipe = columns, placed, records, []
        self._columns = (None, extents.devices, extents.starts, extents.sizes, extents.names)
        self._alone = (*columns, extents.addresses)

    def remember(self, key: tuple, extents: Sequence[Extent], placed: list[tuple[int, int]],
                 records: Sequence[TensorRecord], storages: Sequence[torch.UntypedStorage] = ()) -> None:
        """Keep this layout (before any extent is captured), unless an extent views raw memory
        (numpy arrays sharing memory that no single storage covers): those are laid out anew.
        ``storages``: the tensors' untyped storages the extents were made from, if known (the
        usual state, one extent per tensor viewing that tensor's own storage object: its
        recipe in C-level passes)."""
        self.key, self._columns, self._alone = None, None, None
        views = [e._view for e in extents]
        if (len(views) == len(storages) and None not in views
                and all(map(operator.is_, map(_FIRST, views), storages))):
            self.key, self.placed, self.records = key, placed, records
            columns = (list(map(_SECOND, views)), list(map(_THIRD, views)), list(map(_FOURTH, views)),
                       list(map(_FIRST_TENSOR, extents)))
            self.recipe = []  # the columns stand for it (reuse reads them)
            self._columns = (None, *columns)
            return
        source = {}  # a tensor per (storage address, size, device): any of them views the same bytes
        for i, where in enumerate(zip(key[2], key[3], key[8])):
            source.setdefault(where, i)
        recipe = []
        for e in extents:
            if e._view is not None:
                st, device, start, n = e._view
                recipe.append((source[(st.data_ptr(), st.nbytes(), device)], device, start, n, e.first_tensor))
            elif e.nbytes == 0:
                recipe.append((-1, e.device, 0, 0, e.first_tensor))
            else:
                return
        self.key, self.recipe, self.placed, self.records = key, recipe, placed, records
        columns = tuple(map(list, zip(*recipe)))  # sources, devices, starts, sizes, names
        if columns and -1 not in columns[0]:
            self._columns = columns


def _address_of_storage_slow(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# The address of a tensor's storage object (its StorageImpl): every tensor that views that
# storage (itself, a detached alias, a view) gives the same; one C call, without making a
# Python storage object per tensor (torch before 2.4 has no _storage_address: the slow way)
storage_address = getattr(torch._C, "_storage_address", None) or _address_of_storage_slow


def storage_addresses_of(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The storage_address of each of ``tensors`` that has a storage (a sparse one has none)."""
    try:
        return list(map(storage_address, tensors))
    except (RuntimeError, NotImplementedError):
        out = []
        for t in tensors:
            try:
                out.append(storage_address(t))
            except (RuntimeError, NotImplementedError):
                pass
        return out


class GuardedMemory:
    """The tensors the optimizer step pre-hook keeps unchanged until a save releases them
    (the local_tensors of what the hooked optimizers hold), for save_async to tell the saved tensors they guard.
    A saved tensor is guarded when it is one of them (an optimizer's state: by identity, no
    look at its memory), or when it views the storage of one (a module state_dict's detached
    alias of a parameter: by storage_address, of the saved tensor and of the guarded tensors
    not saved as themselves; every call, so a parameter given new memory by ``p.data = x``
    is seen at once). Which saved tensors are guarded tensors themselves is a function of
    the two lists only: kept while both hold the objects they held at the last call (a
    training loop's saves), compared by identity (one C-level pass of ``is`` per list, no
    id list, set or probe per tensor). The last call's guarded tensors, and the saved ones
    among them, are held until the next call compares with them, so an object found there is
    the same object."""

    __slots__ = ("_held", "_split", "_storages", "plain", "plain_strided", "tensors")

    def __init__(self, held: list[Any] = ()) -> None:
        self._held: list[Any] = []  # what the optimizers held at the last call, when all plain tensors
        self.tensors: Sequence[torch.Tensor] = ()
        # (the saved tensors that are guarded ones, where the others are, where those are,
        # which guarded tensors are not saved as themselves)
        self._split: tuple[list[torch.Tensor], list[bool], list[bool], list[bool]] | None = None
        # weak references to the saved tensors a blocking save last found plain (_check_at_call):
        # a tensor's type, layout, device kind and quantization are fixed for the object
        # (``.data =`` refuses others); weak, so that a state the caller dropped is not kept alive
        self.plain: list[weakref.ref] = []
        self.plain_strided = False  # whether each of those was plain strided then (_plain_strided)
        self.update(list(held))

    def update(self, held: list[Any]) -> GuardedMemory:
        """What the hooked optimizers hold now (held_by; every save_async). The same plain tensors
        as at the last call need no look at their types."""
        last = self._held
        if len(held) != len(last) or not all(map(operator.is_, held, last)):
            tensors, last = local_tensors(held), self.tensors
            if len(tensors) != len(last) or not all(map(operator.is_, tensors, last)):
                self._split = None
            self._held = held if tensors is held else []
            self.tensors = tensors
        self._storages = None
        return self

    def split(self, saved: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the saved tensors that are no guarded tensor, the guarded tensors not saved as themselves).
        The positions of the saved tensors that are guarded tensors are kept while those
        positions hold the same objects (the others, a module state_dict's fresh aliases, are
        new objects at every call and are checked by storage anyway). A stale ``others`` only
        makes record_snapshot look at every guarded storage (a guarded tensor no longer saved
        as itself, viewed by a saved one)."""
        cached = self._split
        if cached is not None and len(cached[1]) == len(saved):
            was = cached[0]
            now = list(compress(saved, cached[2]))
            if len(now) != len(was) or not all(map(operator.is_, now, was)):
                cached = None
        else:
            cached = None
        if cached is None:
            ids = set(map(id, self.tensors))
            is_guarded = list(map(ids.__contains__, map(id, saved)))
            saved_guarded = list(compress(saved, is_guarded))
            saved_set = set(map(id, saved_guarded))
            cached = self._split = (saved_guarded, list(map(operator.not_, is_guarded)), is_guarded,
                                    [id(t) not in saved_set for t in self.tensors])
        return list(compress(saved, cached[1])), list(compress(self.tensors, cached[3]))

    def storages(self) -> set[int]:
        """The storage_address of every guarded tensor."""
        if self._storages is None:
            self._storages = set(storage_addresses_of(self.tensors))
        return self._storages


class PendingSnapshot:
    """What save_async records of the state at the call; the save thread makes the Snapshot of
    it (``complete``) before it reads a byte.

    At the call (per tensor: a type test, its first-element address and its device index): the
    state's containers, copied (format/state_codec.freeze_state: later changes to the caller's
    dicts and lists, and to the Python values in them, do not reach the step); the tensors by
    reference; and, for the tensors no optimizer hook guards (and those on devices other than
    the CPU and CUDA), what take_snapshot's docstring says: checked, grouped by allocation and,
    when small, copied now. The encoding, the names, the layout and the records of the rest
    are made in the save thread: the guarded tensors keep their memory, values and layout
    until the save releases them (the step pre-hook, and the rule that nothing else changes
    them in place), and the tensors copied at the call are matched to their copies by the
    memory they view."""

    def __init__(self, step: int, tree: Any, arrays: dict[int, torch.Tensor], metadata: dict,
                 prepared: Any = None) -> None:
        self.step, self.tree, self.arrays, self.metadata = step, tree, arrays, metadata
        self.prepared = prepared  # Snapshot.prepared
        self.ready: dict[int, Any] = {}
        self.tensor_count = 0  # the tensors met (repeats counted)
        self.handled: dict[int, torch.Tensor] = {}  # id -> tensor, of those checked (and grouped) at the call
        self.resolved: dict[int, torch.Tensor] = {}  # id(conj/neg tensor) -> its resolved copy, made at the call
        self.captured: dict[tuple, torch.Tensor] = {}  # extent key (see _extent_key) -> its bytes, copied at the call
        self.left_live: set[tuple] = set()  # keys of the extents left live that no hook guards
        self.unguarded: list[torch.Tensor] = []  # the first tensor of each of those
        # every tensor was found plain strided (_plain_strided: no quantized, conj or neg one) at this
        # very call, so complete need not look again (a blocking save: the caller waits for the save)
        self.checked = False
        # every tensor is of a plain type and strided, not nested, not meta (fixed for a tensor
        # object: see GuardedMemory.plain), found so at this call or at the last blocking one,
        # over the same objects: the encoder need not look again (encode_state_named's plain)
        self.plain = False

    def unguarded_name(self) -> str:
        """The key path of the first tensor left live unguarded (for a message)."""
        return _path_to(self.tree, self.unguarded[0], self.arrays) if self.unguarded else ""

    def complete(self, layout: LayoutCache | None = None) -> Snapshot:
        """The Snapshot (in the save thread, before the save reads the live tensors). Raises
        UnsupportedObjectError for a quantized guarded tensor, SnapshotChangedError where a
        tensor copied at the call was given other memory or shape in place since."""
        tree, tensors, names, kinds = encode_state_named(self.tree, arrays=self.arrays, plain=self.plain)
        dtypes = list(map(_DTYPE, tensors))  # read once: the checks below, the layout key and the records
        if self.resolved or _needs_resolving(tensors, dtypes, checked=self.checked):
            self._resolve(tensors, names)
        extents, placed, records = _lay_out(tensors, names, kinds, layout, dtypes=dtypes)
        unguarded = self._apply_captures(extents, placed, tensors)
        key = layout.key if layout is not None and not self.handled else None
        return Snapshot(self.step, tree, extents, records, self.metadata, self.ready, unguarded, self.prepared, key)

    def _resolve(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        """Each tensor resolved at the call in place of its copy; each other one checked (quantized:
        UnsupportedObjectError) and, with a lazy conj or neg bit, materialised (the bits are not
        in the bytes). In place in ``tensors``; the dtypes stay what they were."""
        resolved = self.resolved
        for i, t in enumerate(tensors):
            done = resolved.get(id(t)) if resolved else None
            if done is not None:
                tensors[i] = done
            else:
                _check_quantized(names[i], t)
                if t.is_conj() or t.is_neg():
                    tensors[i] = t.detach().resolve_conj().resolve_neg()

    def _apply_captures(self, extents: list[Extent], placed: list[tuple[int, int]],
                        tensors: list[torch.Tensor]) -> list[str]:
        """Put the copies taken at the call in place of the live extents they were taken of;
        returns the first tensor of each extent left live unguarded."""
        if not self.handled:
            return []
        handled = self.handled
        guarded = {placed[i][0] for i, t in enumerate(tensors) if id(t) not in handled}
        unguarded = []
        for sid, e in enumerate(extents):
            if e.nbytes == 0:
                continue
            key = _extent_key(e)
            copy = self.captured.get(key)
            if copy is not None:
                e.replace(copy)
            elif key in self.left_live:
                unguarded.append(e.first_tensor)
            elif sid not in guarded:  # every member was handled at the call, but not as this extent
                raise SnapshotChangedError(
                    f"step {self.step} is not saved: {e.first_tensor} was copied when save_async was called, and "
                    f"has been given other memory or another shape in place since (resize_, set_, squeeze_...); "
                    f"call handle.wait_snapshotted() before changing a saved tensor other than by its values")
        return unguarded


def record_snapshot(state: Any, step: int, *, metadata: dict | None = None, guarded: GuardedMemory | None = None,
                    layout: LayoutCache | None = None, prepared: Any = None, blocking: bool = False) -> PendingSnapshot:
    """save_async's part of a snapshot (see PendingSnapshot): ``guarded``, the memory the step
    pre-hook guards; the tensors outside it are checked, grouped (with ``layout.at_call``, the
    last save's grouping, while it applies) and (the small ones) copied now, as take_snapshot
    describes. Raises UnsupportedObjectError, naming the key path, for what the format cannot
    store (a quantized tensor only guarded memory holds: in the save thread, from ``complete``).
    ``prepared``: what Session.prepare returned beside the state, carried to Snapshot.prepared.
    ``blocking``: the caller waits for the whole save (save()), so it cannot change the tensors
    before the save has read them: they are checked now but none is grouped or copied at the
    call (a copy per small tensor, and the bytes copied twice, for nothing), except those on
    devices the background cannot read."""
    guarded = guarded or GuardedMemory()
    try:
        frozen, tensors, arrays = freeze_state(state)
        rest, others = guarded.split(tensors)
        # raises for tensors without a storage (sparse); a blocking save needs none (_check_at_call checks)
        addresses = [] if blocking else list(map(storage_address, rest))
    except (Unfreezable, RuntimeError, NotImplementedError):
        _raise_unsupported(state)
        raise
    pending = PendingSnapshot(step, frozen, arrays, {} if metadata is None else metadata, prepared)
    pending.tensor_count = len(tensors)
    at_call: list[torch.Tensor] = []
    held: set[int] = set()
    # Guarded: each views a guarded tensor's storage. A module's aliases come in its parameters'
    # order, so the two lists are usually equal (one comparison); else by set.
    if blocking:
        last = guarded.plain
        # else checked last time (each weak reference called, then compared, in C-level passes)
        if len(last) != len(rest) or not all(map(operator.is_, map(_CALL, last), rest)):
            guarded.plain = []
            pending.checked = _check_at_call(rest, state) and len(rest) == len(tensors)
            guarded.plain = list(map(weakref.ref, rest))
            guarded.plain_strided = pending.checked
        pending.plain = guarded.plain_strided and len(rest) == len(tensors)
    elif rest and addresses != (others_at := storage_addresses_of(others)) and not set(others_at).issuperset(addresses):
        held = guarded.storages()  # also views of the guarded tensors that are saved themselves
        at_call = [t for t, a in zip(rest, addresses) if a not in held]
    cuda: set[int] = set()
    if _accelerator_tensors_can_exist():
        other = []
        for t in tensors:
            kind = t.device.type
            if kind == "cuda":
                cuda.add(t.device.index)
            elif kind != "cpu":
                other.append(t)
        at_call += other
    if at_call:
        at_call = list({id(t): t for t in at_call}.values())  # each once
        _handle_at_call(pending, at_call, held or guarded.storages(), state, None if layout is None else layout.at_call)
    pending.ready = streams.record_ready(sorted(cuda))
    return pending


_IS_NESTED, _IS_META, _LAYOUT = (operator.attrgetter(a) for a in ("is_nested", "is_meta", "layout"))
_CALL = getattr(operator, "call", None) or weakref.ref.__call__  # operator.call: Python 3.11+


def _needs_resolving(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], *, checked: bool) -> bool:
    """Whether some tensor of ``tensors`` (of the given ``dtypes``) is quantized or has a lazy
    conj or neg bit (PendingSnapshot._resolve then looks at each). A tensor is quantized exactly
    when its dtype is a quantized one, so one tensor per dtype is asked; the conj bit only means
    something for complex dtypes, so the conj pass runs only where there are some; the neg bit
    (``z.conj().imag`` is a float32 view with it) needs a pass, unless ``checked``: every tensor
    was found plain strided at this same call (record_snapshot)."""
    if checked:
        return False
    one_of_each = dict(zip(dtypes, tensors)).values()  # a C-level pass: the last tensor of each dtype
    if any(map(_IS_QUANTIZED, one_of_each)):
        return True
    if any(map(operator.attrgetter("is_complex"), set(dtypes))) and any(map(torch.Tensor.is_conj, tensors)):
        return True
    return any(map(torch.Tensor.is_neg, tensors))


def _plain_strided(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every one of ``tensors`` passes check_tensor and _check_quantized and has no lazy
    conj/neg bit: C-level passes over the list, no Python call per tensor (False: check each).
    As _needs_resolving: quantized asked of one tensor per dtype, the conj bit only where a
    dtype is complex (a dtype pass in place of two)."""
    if not (set(map(type, tensors)) <= _PLAIN and set(map(_LAYOUT, tensors)) <= {torch.strided}
            and not any(map(_IS_NESTED, tensors)) and not any(map(_IS_META, tensors))):
        return False
    one_of_each = dict(zip(map(_DTYPE, tensors), tensors))  # the last tensor of each dtype
    return (not any(map(_IS_QUANTIZED, one_of_each.values()))
            and not (any(map(operator.attrgetter("is_complex"), one_of_each)) and any(map(torch.Tensor.is_conj, tensors)))
            and not any(map(torch.Tensor.is_neg, tensors)))


def _accelerator_tensors_can_exist() -> bool:
    """Whether a tensor may be on a device other than the CPU: an accelerator is there and,
    for CUDA, initialised (a CUDA tensor initialises it). Asks no CUDA call."""
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and (accelerator.type != "cuda" or torch.cuda.is_initialized())


def _check_at_call(tensors: list[torch.Tensor], state: Any) -> bool:
    """Raise UnsupportedObjectError, with its key path, for a tensor of ``tensors`` the format
    cannot store (C-level passes when none is unusual). Returns whether every one is plain
    strided (_plain_strided: none has a lazy conj or neg bit either)."""
    if _plain_strided(tensors):
        return True
    for t in tensors:  # one by one: the first the format cannot store is raised, with its key path
        try:
            check_tensor(t, "")
            _check_quantized("", t)
        except UnsupportedObjectError:
            _raise_unsupported(state)
            raise
    return False


def _handle_at_call(pending: PendingSnapshot, tensors: list[torch.Tensor], guarded: set[int], state: Any,
                    layout: LayoutCache | None) -> None:
    """Check, group and capture (see _capture) the tensors that cannot wait for the save thread."""
    if not _plain_strided(tensors):  # else (the usual state) every check passes: no loop
        _check_at_call(tensors, state)
        for j, t in enumerate(tensors):
            if t.is_conj() or t.is_neg():
                pending.resolved[id(t)] = tensors[j] = t.detach().resolve_conj().resolve_neg()
    pending.handled = {id(t): t for t in tensors}
    extents, placed, _ = _lay_out(tensors, [""] * len(tensors), ["tensor"] * len(tensors), layout, records=False)
    keys = [_extent_key(e) for e in extents]
    live = _capture(extents, placed, list(map(storage_address, tensors)), guarded)
    pending.captured = {keys[sid]: e.flat for sid, e in enumerate(extents) if e.captured}
    pending.left_live = {keys[sid] for sid in live}
    first = {}
    for i, (sid, _) in enumerate(placed):
        first.setdefault(sid, tensors[i])
    pending.unguarded = [first[sid] for sid in live]


def take_snapshot(state: Any, step: int, *, metadata: dict | None = None,
                  protected: Collection[torch.Tensor] = (), layout: LayoutCache | None = None,
                  prepared: Any = None) -> Snapshot:
    """Encode ``state`` and group its tensors by the allocation they view; copies nothing but
    small unprotected tensors. ``metadata``: what plain_json made of the caller's, kept as it
    is (the caller copied it, deep, before it waited for room). ``protected``: tensors that
    something else keeps unchanged until the save releases them (the optimizer's parameters
    and state, held by the checkpointer's step pre-hook); other extents up to CAPTURE_MAX
    bytes are copied now, and those that stay live unguarded are named in
    ``Snapshot.unguarded`` (the caller must keep them unchanged until the save releases
    them: the checkpointer waits for that). Extents on a device that is neither the CPU nor
    CUDA (XPU, MPS...) are copied to the CPU now (synchronously): only CPU and CUDA memory
    can be read in the background. ``layout``: the previous save's layout, reused where it still applies and
    replaced where it does not. record_snapshot and PendingSnapshot.complete in one: what
    save_async does at the call and the save thread then."""
    guarded = GuardedMemory(list(protected))
    return record_snapshot(state, step, metadata=metadata, guarded=guarded, layout=layout,
                           prepared=prepared).complete(layout)


def _lay_out(tensors: list[torch.Tensor], names: list[str], kinds: list[str], layout: LayoutCache | None, *,
             records: bool = True, dtypes: Sequence[torch.dtype] | None = None
             ) -> tuple[Sequence[Extent], list[tuple[int, int]], Sequence[TensorRecord]]:
    """The extents, the (extent, offset) of each tensor and the records: ``layout``'s when it
    still applies, else laid out anew (and kept in ``layout``). ``records`` False: none are
    made (save_async's grouping at the call, which names nothing). ``dtypes``: the tensors'
    dtypes, if the caller read them already. The columns read serve the layout and the
    records too (each tensor property read once); storage objects are made only where the
    tensors are not lone (the general layout, or a cached one of that kind to compare with)."""
    cached = layout.reuse_alone(tensors, names, kinds, dtypes) if layout is not None else None
    if cached is not None:
        return cached
    try:
        columns = LayoutCache.columns_of(tensors, names, kinds, dtypes)
    except (RuntimeError, NotImplementedError):  # a tensor without a storage: the general path says so
        columns = None
    storages = key = None
    # (a cached layout of lone tensors that reuse_alone refused is no longer this one: not compared again)
    if columns is None or (layout is not None and layout._alone is None and layout.key is not None):
        storages = list(map(torch.Tensor.untyped_storage, tensors))
        key = LayoutCache.key_from(columns, storages) if columns is not None else LayoutCache.key_of(
            tensors, names, kinds, storages, dtypes)
        cached = layout.reuse(key, tensors, storages) if layout is not None else None
        if cached is not None:
            return cached
    extents, placed = group_by_allocation(tensors, names, storages, key, columns)
    alone = type(extents) is LazyExtents and extents.viewed is None
    if not alone and key is None and (layout is not None or records):
        storages = list(map(torch.Tensor.untyped_storage, tensors))
        key = LayoutCache.key_from(columns, storages)
    cols = columns if alone else key
    made = _records(cols[0], cols[1], *cols[-4:], placed) if records else []
    if layout is not None:
        if alone:
            layout.remember_alone(columns, extents, placed, made)  # type: ignore[arg-type]
        else:
            layout.remember(key, extents, placed, made, storages)  # type: ignore[arg-type]
    return extents, placed, made


def _records(names: list[str], kinds: list[str], dtypes: list, shapes: list, strides: list, devices: list,
             placed: list[tuple[int, int]]) -> SavedTensors:
    """The tensors' records as columns (SavedTensors: the manifest encodes the columns, and a
    TensorRecord per tensor is made only if some reader of Snapshot.records asks), from the
    columns the layout read (names, kinds, dtypes, shapes, strides, devices) and where each
    was placed: C-level passes, no object per tensor, no tensor property read again."""
    if not all(names):
        names = [name or f"<tensor {i}>" for i, name in enumerate(names)]
    return saved_tensors(names, list(map(_FIRST, placed)), list(map(_SECOND, placed)), dtypes, shapes, strides,
                         devices, kinds)


_FIRST, _SECOND, _THIRD, _FOURTH = (operator.itemgetter(i) for i in range(4))
_FIRST_TENSOR = operator.attrgetter("first_tensor")


def _extent_key(e: Extent) -> tuple:
    """What tells an extent apart: its device, the address of its first byte and its size."""
    if e._view is not None:
        st, device, start, n = e._view
        return device, st.data_ptr() + start, n
    return e.device, e.flat.data_ptr(), e.nbytes


def _check_quantized(name: str, t: torch.Tensor) -> None:
    if t.is_quantized:
        raise UnsupportedObjectError(name, t, "quantized tensors are not supported: save t.dequantize() "
                                              "and the quantization parameters instead")


def _raise_unsupported(state: Any) -> None:
    """Raise the UnsupportedObjectError, with its key path, for what the state holds that the
    format cannot store (returns if there is none)."""
    _, tensors, names, _ = encode_state_named(state)
    for name, t in zip(names, tensors):
        _check_quantized(name, t)


def _path_to(tree: Any, target: torch.Tensor, arrays: dict[int, torch.Tensor]) -> str:
    """The "/"-joined key path of ``target`` in ``tree`` (an array's: of the array)."""
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        obj, path = stack.pop()
        if obj is target or (type(obj) is np.ndarray and arrays.get(id(obj)) is target):
            return path or "<root>"
        items = (obj.items() if isinstance(obj, (dict, FrozenOrderedDict)) else enumerate(obj) if isinstance(obj, (list, tuple))
                 else ())
        stack.extend((v, f"{path}/{k}" if path else str(k)) for k, v in reversed(list(items)))
    return "<tensor>"


def _capture(extents: list[Extent], placed: list[tuple[int, int]], storage_ptrs: list[int],
             guarded: set[int]) -> list[int]:
    """Copy, now, the extents that the caller may change before the save reads them (see
    take_snapshot), and those on devices the background cannot read. ``storage_ptrs``: each
    tensor's storage_address; ``guarded``: those of the storages the step pre-hook guards. Returns the index of each extent left live that no guarded storage covers
    (larger than CAPTURE_MAX, or beyond the budget)."""
    unguarded = set(range(len(extents)))
    for i, ptr in enumerate(storage_ptrs):
        if ptr in guarded:
            unguarded.discard(placed[i][0])
    budget = CAPTURE_BUDGET
    left_live: list[int] = []
    for sid, ext in enumerate(extents):
        n, kind = ext.nbytes, ext.device.type
        if kind not in ("cpu", "cuda"):
            log_once(f"host-copy:{kind}", f"gdswriter: {kind} tensors are copied to host memory when save_async "
                                          f"is called (synchronously)")
            ext.replace(ext.flat.to("cpu"))
        elif sid in unguarded and 0 < n:
            if n <= CAPTURE_MAX and n <= budget:
                ext.replace(ext.flat.clone())
                budget -= n
            else:
                left_live.append(sid)
    return left_live


def group_by_allocation(tensors: list[torch.Tensor], names: list[str],
                        storages: Sequence[torch.UntypedStorage] | None = None,
                        key: tuple | None = None, columns: tuple | None = None
                        ) -> tuple[Sequence[Extent], list[tuple[int, int]]]:
    """Extents of ``tensors`` and, per tensor, (extent index, byte offset in it). Every layout a
    snapshot makes goes through this module-level name: a seam that tests wrap to count layouts.
    ``storages``: each tensor's untyped_storage(), if the caller has them (the usual case's
    extents then view those very objects); ``key``: their LayoutCache.key_of, ``columns``:
    their LayoutCache.columns_of, if made (not read again).

    Tensors whose bytes overlap in memory (views of one storage, or numpy arrays and their
    views wrapped by torch.from_numpy, which give separate torch storages over the same
    memory) share one extent: the byte range [first, last) they view together, taken from a
    storage that covers it. CPU memory that no single storage covers is viewed raw; on other
    devices such a group is split by storage (each piece saved whole, so the bytes are right
    and only the sharing is not restored)."""
    alone = _each_alone(tensors, names, columns)
    if alone is not None:
        return alone
    found: list[tuple[Extent, list[tuple[int, int]]]] = []  # each extent with its (tensor, byte offset)s
    by_device: dict[torch.device, list[_Member]] = {}
    for i, t in enumerate(tensors):
        lo, hi = byte_span(t)
        st = t.untyped_storage()
        base = st.data_ptr()
        if hi == lo or not base:  # no bytes: an empty extent of its own
            found.append((Extent(names[i], flat=torch.empty(0, dtype=torch.uint8)), [(i, 0)]))
        else:
            by_device.setdefault(t.device, []).append((base + lo, base + hi, i, st))
    for device, members in by_device.items():
        members.sort(key=lambda m: (m[0], m[1], m[2]))
        group, end = [members[0]], members[0][1]
        for m in members[1:]:
            if m[0] >= end:
                _add_group(group, tensors, names, device, found)
                group, end = [], 0
            group.append(m)
            end = max(end, m[1])
        _add_group(group, tensors, names, device, found)
    found.sort(key=lambda f: min(i for i, _ in f[1]))  # in the order the state names them
    placed: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    for sid, (_, members) in enumerate(found):
        for i, off in members:
            placed[i] = (sid, off)
    return [e for e, _ in found], placed


_Member = tuple  # (first byte's address, end address, tensor index, its UntypedStorage)
_ITEM_SIZES = frozenset({1, 2, 4, 8, 16})  # divide STORAGE_ALIGN: a lone tensor always fits its extent


def _each_alone(tensors: list[torch.Tensor], names: list[str], columns: tuple | None = None
                ) -> tuple[LazyExtents, list[tuple[int, int]]] | None:
    """group_by_allocation's usual case in C-level passes: every tensor non-empty, contiguous,
    of one device, and alone in memory (the tensors' byte ranges are pairwise disjoint, so no
    two tensors share a byte; the general path then puts each in a group of its own, viewing
    its own storage, which is what this gives): one extent per tensor, viewing its storage
    from the 16-byte boundary at or below its first byte. None where that does not hold (the
    general path). ``columns``: the tensors' LayoutCache.columns_of, if made. No storage object
    is made (the extents view the storages when made: LazyExtents from the tensors)."""
    if columns is None:
        try:
            columns = LayoutCache.columns_of(tensors, names, names)
        except (RuntimeError, NotImplementedError):
            return None
    _, _, firsts, offsets, dtypes, shapes, _, devices = columns
    if not tensors or len(set(devices)) != 1 or not all(map(torch.Tensor.is_contiguous, tensors)):
        return None
    sizes = list(map({d: d.itemsize for d in set(dtypes)}.__getitem__, dtypes))  # a dict look-up per tensor
    numels = list(map(math.prod, shapes))
    if not all(numels) or not set(sizes) <= _ITEM_SIZES:
        return None
    count = len(tensors)
    item = np.fromiter(sizes, dtype=np.int64, count=count)
    bases = np.fromiter(firsts, dtype=np.uint64, count=count)
    ends = bases + (np.fromiter(numels, dtype=np.int64, count=count) * item).astype(np.uint64)
    order = np.argsort(bases, kind="stable")
    if not bases.all() or (count > 1 and (ends[order[:-1]] > bases[order[1:]]).any()):
        return None
    # per tensor, in numpy columns: its first byte in its storage, the 16-byte boundary at or
    # below it (where its extent starts), the extent's length and the tensor's offset in it
    los = np.fromiter(offsets, dtype=np.int64, count=count) * item
    starts = los // STORAGE_ALIGN * STORAGE_ALIGN
    lengths = (ends - bases).astype(np.int64) + los - starts
    device = devices[0]
    addresses = (bases.astype(np.int64) - los + starts).tolist() if device.type == "cpu" else None
    extents = LazyExtents(None, [device] * count, starts.tolist(), lengths.tolist(), names, addresses, tensors)
    return extents, list(zip(range(count), (los - starts).tolist()))


def _add_group(group: list[_Member], tensors: list[torch.Tensor], names: list[str], device: torch.device,
               found: list) -> None:
    if len(group) == 1:  # the usual case: a tensor that shares its memory with no other
        _view_storage(group, group[0][3], tensors, names, device, found)
        return
    lo = min(g[0] for g in group)
    hi = max(g[1] for g in group)
    storages: dict[int, tuple[torch.UntypedStorage, list[_Member]]] = {}
    for g in group:
        storages.setdefault(g[3].data_ptr(), (g[3], []))[1].append(g)
    for st, _ in storages.values():  # a storage that holds the whole range: view it
        if st.data_ptr() <= lo and hi <= st.data_ptr() + st.nbytes() and _view_storage(group, st, tensors, names,
                                                                                      device, found):
            return
    if device.type == "cpu":  # numpy views none of which covers the others: view the memory itself
        start = max(lo // STORAGE_ALIGN * STORAGE_ALIGN, min(storages))
        if _fits(group, tensors, start):
            raw = torch.frombuffer((ctypes.c_char * (hi - start)).from_address(start), dtype=torch.uint8)
            found.append((Extent(names[min(g[2] for g in group)], flat=raw,
                                 keepalive=tuple(tensors[g[2]] for g in group)), [(g[2], g[0] - start) for g in group]))
            return
    for st, part in storages.values():  # each storage covers its own views
        _view_storage(part, st, tensors, names, device, found)


def _view_storage(group: list[_Member], st: torch.UntypedStorage, tensors: list[torch.Tensor], names: list[str],
                  device: torch.device, found: list) -> bool:
    """Place ``group`` as one extent viewing storage ``st`` from the 16-byte boundary at or below
    its first byte; False if a member would not start a whole number of its elements in (the
    members of ``st`` itself always do)."""
    base = st.data_ptr()
    start = (min(g[0] for g in group) - base) // STORAGE_ALIGN * STORAGE_ALIGN
    if not _fits(group, tensors, base + start):
        return False
    view = (st, device, start, max(g[1] for g in group) - base - start)
    found.append((Extent(names[min(g[2] for g in group)], view=view), [(g[2], g[0] - base - start) for g in group]))
    return True


def _fits(group: list[_Member], tensors: list[torch.Tensor], start: int) -> bool:
    """Every member starts a whole number of its elements after ``start`` (so it can be rebuilt)."""
    return all((g[0] - start) % tensors[g[2]].element_size() == 0 for g in group)
