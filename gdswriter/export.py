"""Export a committed step to files other tools read: torch.save, safetensors, or a Hugging
Face ``from_pretrained`` directory.

Whole state (default): every tensor under its key path ("model/0.weight", "optimizer/state/0/
exp_avg"...). Model only (``model_only``, and always for "hf"): the tensors of the saved model's
state_dict under the model's own keys ("0.weight"), so ``model.load_state_dict(...)`` takes them
as they are; only the model's bytes are read. Tied weights (two keys viewing the same tensor,
e.g. an embedding and an LM head) are stored once in safetensors, under the first key, as
``safetensors.torch.save_model`` and ``save_pretrained`` do; ``safetensors.torch.load_model``
and ``from_pretrained`` re-tie them. A torch.save file keeps both keys on one storage.

A step saved through DCP (GDSStorageWriter) exports under DCP's flattened names ("model.0.weight",
"optim.state.0.exp_avg"), every tensor whole whichever ranks saved its shards; model only, the
items under its state's "model" entry, under the model's own keys.

The safetensors writer is implemented here (no dependency on the ``safetensors``
package). The format is::

    8 bytes   N, unsigned little-endian: length of the JSON header
    N bytes   JSON header, padded with spaces so that 8 + N is a multiple of 8:
              {"__metadata__": {str: str, ...},
               name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}
    ...       the tensors' raw little-endian bytes, C-contiguous, packed back to back;
              data_offsets are relative to the first byte after the header

Readers check that the data_offsets tile the byte buffer exactly (no gaps, no
overlap), so every tensor is written as its own contiguous copy: tied/shared
tensors become independent copies and non-contiguous views become contiguous.

Every output is written to a temporary file in the destination directory,
fsynced, and then renamed into place (the directory is fsynced too), so a crash
never leaves a half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from .fs import atomic_file, replace_dir
from .errors import GDSWriterError, InvalidOptionError, OutputExistsError, UnsupportedDtypeError

# torch dtype -> safetensors dtype name. float4_e2m1fn_x2 is stored as "F4" with the last
# dimension counted in 4-bit elements (twice the torch size), as the safetensors package does.
_SAFETENSORS_NAMES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4",
}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, n): s for n, s in _SAFETENSORS_NAMES.items() if isinstance(getattr(torch, n, None), torch.dtype)}
_PACKED_X2 = {"F4"}  # two elements per byte: shape's last dimension is doubled in the header

MAX_HEADER_BYTES = 100_000_000  # the safetensors reader refuses larger headers


def safetensors_dtype(dtype: torch.dtype, name: str = "") -> str:
    """The safetensors name of ``dtype``; UnsupportedDtypeError for dtypes safetensors cannot hold."""
    try:
        return SAFETENSORS_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(sorted({str(d).removeprefix("torch.") for d in SAFETENSORS_DTYPES}))
        raise UnsupportedDtypeError(
            f"cannot export tensor {name or '<unnamed>'!r} to safetensors: safetensors has no dtype for "
            f"{str(dtype).removeprefix('torch.')} (it holds {supported}); export with --to torch instead") from None


# ----------------------------------------------------------------------------- atomic output
@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes ``path`` when the block succeeds (fs.atomic_file: fsync,
    rename, fsync of the directory). Without ``overwrite`` an existing ``path`` is refused, before
    and at the final step (no-clobber link), so a concurrent creator is never replaced."""
    path = Path(os.fspath(path))
    if path.is_dir():
        raise InvalidOptionError(f"{path} is a directory: give the output file's name")
    exists = f"{path} exists: pass --force (overwrite=True) to replace it"
    if not overwrite and (path.exists() or path.is_symlink()):
        raise OutputExistsError(errno.EEXIST, exists)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise InvalidOptionError(f"directory {parent} does not exist: create it first")
    written = False
    try:
        with atomic_file(path, overwrite=overwrite) as f:
            yield f
            written = True
    except FileExistsError as e:
        if not written:  # the block's own error
            raise
        raise OutputExistsError(errno.EEXIST, exists) from e


# ----------------------------------------------------------------------------- safetensors
def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order as a memoryview (a contiguous CPU copy where needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        return memoryview(b"")
    # Reinterpret as a same-size integer first: a same-size view works for any strides, and
    # the copy kernel for plain integers exists even where the dtype's own (e.g. float4) does not.
    same = _SAME_SIZE_INT.get(t.element_size())
    if same is not None and t.dtype != same:
        t = t.view(same)
    flat = t.contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def safetensors_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                       ) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The padded header (without the 8-byte length) and the data layout [(name, begin, end)].

    Tensors are laid out by item size (largest first), then name, so that every tensor
    starts at a multiple of its item size (the data section starts 8-byte aligned)."""
    if sys.byteorder != "little":
        raise InvalidOptionError("safetensors stores little-endian bytes; exporting from a big-endian host is not supported")
    header: dict[str, Any] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InvalidOptionError(f"safetensors metadata must map str to str, got {k!r}: {type(v).__name__}")
        header["__metadata__"] = dict(metadata)
    entries = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise InvalidOptionError(f"safetensors tensor names must be non-empty strings, got {name!r}")
        if name == "__metadata__":
            raise InvalidOptionError("a tensor cannot be named __metadata__ in safetensors")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
            raise UnsupportedDtypeError(f"cannot export {name!r} to safetensors: it holds dense (strided, "
                                        f"non-quantized) tensors only, got {type(t).__name__}")
        st = safetensors_dtype(t.dtype, name)
        entries.append((t.element_size(), name, st, t))
    entries.sort(key=lambda e: (-e[0], e[1]))
    layout = []
    pos = 0
    for item, name, st, t in entries:
        nbytes = t.numel() * item
        shape = list(t.shape)
        if st in _PACKED_X2:
            if not shape:
                raise UnsupportedDtypeError(f"cannot export {name!r} to safetensors: a 0-d {t.dtype} (two packed "
                                            f"4-bit values) has no safetensors shape; reshape it to [1] first")
            shape = shape[:-1] + [shape[-1] * 2]
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        layout.append((name, pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise InvalidOptionError(f"the safetensors header would be {len(text)} bytes, above the "
                                 f"{MAX_HEADER_BYTES}-byte limit readers accept: too many tensors for one file")
    return text, layout


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None, *, overwrite: bool = False,
                      on_written: Callable[[int], None] | None = None) -> int:
    """Write ``tensors`` ({name: tensor}) as a safetensors file; returns the file size.

    Each tensor is stored as its own contiguous copy (views and shared storage are
    not representable in safetensors). Refuses dtypes safetensors cannot hold before
    writing anything. Durable (fsync) and atomic (temporary file + rename). ``on_written(n)``
    is called after each tensor's ``n`` bytes (progress)."""
    header, layout = safetensors_header(tensors, metadata)
    with atomic_output(path, overwrite=overwrite) as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, begin, end in layout:
            data = _raw_bytes(tensors[name])
            if len(data) != end - begin:  # cannot happen for strided tensors; guard the format anyway
                raise GDSWriterError(f"{name}: expected {end - begin} bytes, got {len(data)}")
            f.write(data)
            if on_written is not None:
                on_written(len(data))
        size = f.tell()
    return size


# ----------------------------------------------------------------------------- torch
def write_torch(path: str | os.PathLike, obj: Any, *, overwrite: bool = False, check_weights_only: bool = False) -> int:
    """torch.save ``obj`` durably and atomically; returns the file size. With
    ``check_weights_only`` the written file is loaded with ``torch.load(weights_only=True)``
    before it is renamed into place, and refused (InvalidOptionError) if that fails."""
    with atomic_output(path, overwrite=overwrite) as f:
        torch.save(obj, f)
        f.flush()
        size = f.tell()
        if check_weights_only:
            try:
                torch.load(f.name, weights_only=True, mmap=True, map_location="cpu")
            except Exception as e:  # noqa: BLE001 - any refusal means "not loadable with weights_only"
                raise InvalidOptionError(
                    f"the nested state cannot be read back with torch.load(weights_only=True) ({_why(e)}); "
                    f"export the flat {{name: tensor}} dict instead (drop --nested)") from None
    return size


def _why(e: BaseException) -> str:
    """The informative line of torch.load's (long, multi-line) weights_only refusal."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", x).strip() for x in str(e).splitlines()]
    lines = [x for x in lines if x]
    for x in lines:
        if "WeightsUnpickler error" in x or "Unsupported" in x:
            return x
    return lines[0] if lines else type(e).__name__


# ----------------------------------------------------------------------------- checkpoint -> file
FORMATS = ("torch", "safetensors", "hf")
HF_WEIGHTS = "model.safetensors"
HF_CONFIG_KEY = "hf_config"
"""Checkpoint metadata key holding a transformers config (as JSON) that ``--to hf`` writes as
config.json; gdswriter.integrations.transformers records it at every save."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    step: int
    format: str
    tensors: int
    bytes: int
    renamed: dict  # {stored name: exported name} where names collided
    tied: dict = dataclasses.field(default_factory=dict)  # {key left out: key stored} (safetensors, model only)
    skipped: tuple = ()  # model keys that hold no tensor (e.g. "_extra_state"), not exported


def flat_tensors(manifest, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """{name: tensor} from the manifest's tensor names (their key paths in the saved state).

    Names that collide (e.g. a key containing "/") get a "#<index>" suffix; the second
    result maps each renamed original to its new name."""
    out: dict[str, torch.Tensor] = {}
    renamed: dict[str, str] = {}
    for i, (rec, t) in enumerate(zip(manifest.tensors, tensors)):
        name = rec.name
        if name in out:
            new = f"{name}#{i}"
            while new in out:
                new += "_"
            renamed[name] = new
            name = new
        out[name] = t
    return out, renamed


def model_indices(manifest) -> tuple[dict[str, int], list[str]]:
    """The saved model's state_dict as {key: tensor index}, and the keys holding no tensor.
    InvalidOptionError when the step holds no model (saved without ``model=``)."""
    from .format.state_codec import decode_state

    markers = [torch.empty(0) for _ in manifest.tensors]
    state = decode_state(manifest.state, markers)
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise InvalidOptionError(f"step {manifest.step} holds no model state_dict (it was saved without model=...): "
                                 f"export the whole state instead (drop --model-only)")
    position = {id(t): i for i, t in enumerate(markers)}
    keys, skipped = {}, []
    for k, v in model.items():
        if isinstance(v, torch.Tensor) and id(v) in position:
            keys[str(k)] = position[id(v)]
        else:
            skipped.append(str(k))
    return keys, skipped


def untie(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one key per distinct tensor view (same storage, offset, shape, strides and dtype):
    ({key: tensor} without the repeats, {repeated key: the key kept}). The first key wins."""
    kept: dict[str, torch.Tensor] = {}
    first: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for k, t in tensors.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) \
            if t.numel() else None
        if ident is not None and ident in first:
            tied[k] = first[ident]
        else:
            kept[k] = t
            if ident is not None:
                first[ident] = k
    return kept, tied


def export_step(roots: Sequence[str | os.PathLike], step: int | None, fmt: str, out: str | os.PathLike, *,
                overwrite: bool = False, verify: bool = True, nested: bool = False, model_only: bool = False,
                config: str | os.PathLike | None = None, engine_options=None, progress: bool = True) -> ExportResult:
    """Read ``step`` (None: latest) of the checkpoint under ``roots`` and write it to ``out``.

    fmt "torch": a torch.save file of a flat {name: tensor} dict (shared storage and views
    are kept as torch.save keeps them), or with ``nested`` the whole saved state tree
    (checked to load with weights_only=True). fmt "safetensors": a flat {name: tensor}
    safetensors file of contiguous copies; non-tensor state goes nowhere except the
    step number and the checkpoint's metadata, stored in ``__metadata__``. With
    ``model_only`` both hold the model's state_dict under its own keys (see the module doc).
    fmt "hf": directory ``out`` with model.safetensors (model only) and config.json, from
    ``config`` (a config.json, or a directory whose non-weight files are all copied) or else
    from the checkpoint's metadata (see HF_CONFIG_KEY). ``progress`` draws a bar on a terminal."""
    from .format.commit import CommitProtocol
    from .format.dtypes import dtype_from_name
    from .format.state_codec import decode_state
    from .progress import Progress
    from .load.reader import read_manifest, read_tensors

    if fmt not in FORMATS:
        raise InvalidOptionError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if nested and (fmt != "torch" or model_only):
        raise InvalidOptionError("nested export is only possible with --to torch, without --model-only")
    if config is not None and fmt != "hf":
        raise InvalidOptionError("--config is only used with --to hf")
    model_only = model_only or fmt == "hf"
    protocol = CommitProtocol([Path(os.fspath(r)) for r in roots])
    step = protocol.require(step)
    manifest = read_manifest(protocol, step)
    dcp = manifest.dist is not None and manifest.dist.layout == "dcp"
    if dcp and not nested:  # DCP's flattened items, each tensor whole (its ranks' chunks assembled)
        return _export_dcp_step(protocol.roots, manifest, fmt, out, overwrite=overwrite, verify=verify,
                                model_only=model_only, config=config, engine_options=engine_options,
                                progress=progress)
    keys, skipped = model_indices(manifest) if model_only else ({}, [])
    chosen = sorted(set(keys.values())) if model_only else range(len(manifest.tensors))
    if fmt != "torch":  # refuse before reading gigabytes
        for i in chosen:
            rec = manifest.tensors[i]
            safetensors_dtype(dtype_from_name(rec.dtype), rec.name)
    out = Path(os.fspath(out))
    if not overwrite and (out.exists() or out.is_symlink()):
        raise OutputExistsError(errno.EEXIST, f"{out} exists: pass --force to replace it")
    hf_config = _hf_config(manifest, config) if fmt == "hf" else None
    needed = {manifest.tensors[i].storage for i in chosen}
    with Progress(f"export step {step}: read", total=sum(manifest.storages[s].nbytes for s in needed),
                  quiet=not progress) as bar:
        tensors = read_tensors(protocol, manifest, chosen if model_only else None, verify=verify,
                               engine_options=engine_options, progress=bar)
    renamed: dict[str, str] = {}
    tied: dict[str, str] = {}
    if model_only:
        flat = {k: tensors[i] for k, i in keys.items()}
    else:
        flat, renamed = flat_tensors(manifest, tensors)
    meta = {"format": "pt", "gdswriter_step": str(step),
            "gdswriter_format_version": f"{manifest.version[0]}.{manifest.version[1]}"}
    if manifest.metadata:
        meta["gdswriter_metadata"] = json.dumps(manifest.metadata, sort_keys=True)
    if fmt == "torch":
        obj = decode_state(manifest.state, tensors) if nested else flat
        size = write_torch(out, obj, overwrite=overwrite, check_weights_only=nested)
        return ExportResult(out, step, fmt, len(flat), size, renamed, tied, tuple(skipped))
    return _write_flat(out, step, fmt, flat, meta, hf_config, overwrite=overwrite, model_only=model_only,
                       renamed=renamed, skipped=skipped, progress=progress)


def _write_flat(out: Path, step: int, fmt: str, flat: dict[str, torch.Tensor], meta: dict, hf_config: Any, *,
                overwrite: bool, model_only: bool, renamed: dict, skipped: Sequence[str], progress: bool
                ) -> ExportResult:
    """Write {name: tensor} as a safetensors file or a Hugging Face directory (ties stored once
    for a model)."""
    from .progress import Progress

    tied: dict[str, str] = {}
    if model_only:
        flat, tied = untie(flat)
        if tied:
            meta["gdswriter_tied"] = json.dumps(tied, sort_keys=True)
    total = sum(t.numel() * t.element_size() for t in flat.values())
    with Progress(f"export step {step}: write", total=total,
                  quiet=not progress) as bar:
        if fmt == "safetensors":
            size = write_safetensors(out, flat, meta, overwrite=overwrite, on_written=bar.advance)
        else:
            size = _write_hf_dir(out, flat, meta, hf_config, overwrite=overwrite, on_written=bar.advance)
    return ExportResult(out, step, fmt, len(flat), size, renamed, tied, tuple(skipped))


def _export_dcp_step(roots: Sequence[Path], manifest, fmt: str, out: str | os.PathLike, *, overwrite: bool,
                     verify: bool, model_only: bool, config: Any, engine_options: Any, progress: bool) -> ExportResult:
    """export_step of a step saved through DCP (GDSStorageWriter): its items under DCP's
    flattened names ("model.0.weight", "optim.state.0.exp_avg"), each tensor whole, however
    many ranks saved its shards. Model only: the items under the state's "model" entry, under the
    model's own keys (``dcp.save({"model": model.state_dict(), ...})``), only their bytes read."""
    from .distributed.dcp import dcp_items, dcp_model_keys, read_dcp_items
    from .format.dtypes import dtype_from_name

    step, out = manifest.step, Path(os.fspath(out))
    items = dcp_items(manifest)
    if model_only:
        keys = dcp_model_keys(manifest)
        if not keys:
            shown = sorted({k.split(".")[0] for k in items})[:8]
            raise InvalidOptionError(f"step {step} (saved through DCP) holds no \"model\" entry (its top-level keys: "
                                     f"{', '.join(shown)}): save dcp.save({{\"model\": model.state_dict(), ...}}), "
                                     f"or export the whole state instead (drop --model-only)")
    else:
        keys = {f: f for f in items}
    fqns = list(keys)
    if fmt != "torch":  # refuse before reading gigabytes
        for f in fqns:
            safetensors_dtype(dtype_from_name(manifest.tensors[items[f]].dtype), f)
    if not overwrite and (out.exists() or out.is_symlink()):
        raise OutputExistsError(errno.EEXIST, f"{out} exists: pass --force to replace it")
    hf_config = _hf_config(manifest, config) if fmt == "hf" else None
    got = read_dcp_items(roots, manifest, fqns, verify=verify, engine_options=engine_options)
    flat = {keys[f]: got[f] for f in fqns}
    meta = {"format": "pt", "gdswriter_step": str(step),
            "gdswriter_format_version": f"{manifest.version[0]}.{manifest.version[1]}"}
    if fmt == "torch":
        size = write_torch(out, flat, overwrite=overwrite)
        return ExportResult(out, step, fmt, len(flat), size, {})
    return _write_flat(out, step, fmt, flat, meta, hf_config, overwrite=overwrite, model_only=model_only,
                       renamed={}, skipped=(), progress=progress)


# ----------------------------------------------------------------------------- Hugging Face directory
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|.*\.index\.json$")


def _hf_config(manifest, config: str | os.PathLike | None) -> Path | dict:
    """Where config.json comes from: a file or a directory given by the user, else the
    checkpoint's metadata. InvalidOptionError saying what to pass when there is none."""
    if config is not None:
        p = Path(os.fspath(config))
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise InvalidOptionError(f"--config {p}: the directory has no config.json")
            return p
        if p.is_file():
            return p
        raise InvalidOptionError(f"--config {p} does not exist: give a config.json or the model's directory")
    saved = manifest.metadata.get(HF_CONFIG_KEY) if isinstance(manifest.metadata, dict) else None
    if isinstance(saved, dict):
        return saved
    raise InvalidOptionError(
        f"step {manifest.step} records no Hugging Face config: pass --config with the model's config.json (or its "
        f"directory, e.g. the one save_pretrained wrote), or save through gdswriter.integrations.transformers, "
        f"which records it")


def _write_hf_dir(out: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], config: Path | dict, *,
                  overwrite: bool, on_written) -> int:
    """Write the directory in a temporary sibling (every file fsynced, every name durable), then
    give it the name ``out``; returns the bytes of model.safetensors. An existing ``out`` is
    replaced only with ``overwrite``: swapped atomically (renameat2 RENAME_EXCHANGE) where the
    file system can, else moved aside first and put back if the new one cannot take its place."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InvalidOptionError(f"directory {parent} does not exist: create it first")
    tmp = parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        if isinstance(config, dict):
            with atomic_output(tmp / "config.json") as f:
                f.write((json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        elif config.is_dir():
            for item in sorted(config.iterdir()):
                if item.is_file() and not _WEIGHT_FILE.fullmatch(item.name):
                    with atomic_output(tmp / item.name) as f, open(item, "rb") as src:
                        shutil.copyfileobj(src, f)
        else:
            with atomic_output(tmp / "config.json") as f, open(config, "rb") as src:
                shutil.copyfileobj(src, f)
        # Each file was fsynced and its name made durable in tmp (atomic_output fsyncs tmp).
        size = write_safetensors(tmp / HF_WEIGHTS, tensors, meta, on_written=on_written)
        if not overwrite and (out.exists() or out.is_symlink()):
            raise OutputExistsError(errno.EEXIST, f"{out} exists: pass --force to replace it")
        old = replace_dir(tmp, out, parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        tmp = old or tmp  # the replaced one, removed below once the new one is durable
        return size
    finally:
        _remove_entry(tmp)  # what is left under the temporary name: the failed new one, or the old one


def _remove_entry(path: Path) -> None:
    """Remove a directory tree, file or link if there is one (best effort: a leftover temporary)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.is_symlink() or path.exists():
        with contextlib.suppress(OSError):
            path.unlink()
