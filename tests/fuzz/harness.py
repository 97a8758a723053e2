"""The fuzz targets: every parser of checkpoint bytes, each fed untrusted bytes.

An input is one selector byte and a payload. The selector's low bits pick the target
(``TARGETS``); its high bit clear means "reseal": where the payload is a JSON object carrying a
checksum (a manifest), the harness recomputes it first, so that a mutation reaches the checks
behind the checksum instead of stopping at it. Every input must end in a correct parse or in a
typed gdswriter error (GDSWriterError); anything else escapes ``run_one`` and is a finding.

Memory: ``limit_memory`` caps the address space (RLIMIT_AS) a little above what the process holds
once the targets ran their seeds, so an allocation that a claimed size drives (a few bytes of
manifest becoming gigabytes) fails, and its MemoryError / RuntimeError / ENOMEM is a finding;
``run_one`` also fails an input that raised the peak resident size by more than ``RSS_BUDGET``.
The fixtures beside which fuzzed manifests are loaded are under 200 KB of real data files.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

import crc32c

from gdswriter.errors import GDSWriterError

HERE = Path(__file__).resolve().parent
SEEDS = HERE / "seeds"
HEADROOM = 768 << 20  # address space beyond the warmed-up process: far above what the fixtures justify
RSS_BUDGET = 256 << 20  # growth of the peak resident size one input may cause

SINGLE_STEP, RANKS_STEP, DCP_STEP = 3, 5, 2


def engine_options() -> Any:
    """Small staging buffers: a fixture's files are a few KiB (the default's 128 MiB of pinned
    buffers would cost more than the load)."""
    from gdswriter.options import EngineOptions

    return EngineOptions(engine="posix", buffer_bytes=64 << 10, request_bytes=64 << 10, num_buffers=2,
                         direct_io=False)


def each(*calls: Callable[[], Any]) -> None:
    """Run every call, each reached whatever the others raised; then raise the first typed error
    (an untyped one leaves at once: it is a finding)."""
    from gdswriter.errors import GDSWriterError

    first = None
    for call in calls:
        try:
            call()
        except GDSWriterError as e:
            first = first or e
    if first is not None:
        raise first


DCP_PLANNER = "torch/distributed/checkpoint/default_planner.py"


class DCPRefused(GDSWriterError):
    """DCP's own load planner refused the live state (a size that differs from the metadata's, a
    key the metadata lacks): the answer DCP gives with any reader, not one of gdswriter's parsers."""


class Finding(AssertionError):
    """An input broke the contract (an untyped error, or memory beyond the budget)."""


def modules() -> None:
    """Import every module the targets reach (called inside atheris.instrument_imports)."""
    import gdswriter.distributed  # noqa: F401
    import gdswriter.distributed.dcp  # noqa: F401
    import gdswriter.distributed.dcp_codec  # noqa: F401
    import gdswriter.distributed.fetch  # noqa: F401
    import gdswriter.distributed.load  # noqa: F401
    import gdswriter.distributed.roots  # noqa: F401
    import gdswriter.distributed.shards  # noqa: F401
    import gdswriter.format.assembly  # noqa: F401
    import gdswriter.format.commit  # noqa: F401
    import gdswriter.format.manifest  # noqa: F401
    import gdswriter.format.sharded  # noqa: F401
    import gdswriter.format.state_codec  # noqa: F401
    import gdswriter.fs  # noqa: F401
    import gdswriter.load.reader  # noqa: F401
    import gdswriter.load.verify  # noqa: F401


# ----------------------------------------------------------------------------- helpers
def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def reseal(raw: bytes) -> bytes:
    """``raw`` with its manifest_crc32c recomputed (unchanged when it is no JSON object carrying
    one, or holds NaN)."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict) or "manifest_crc32c" not in body:
            return raw
        body.pop("manifest_crc32c", None)
        if _major(body) >= 2:  # format 2: the crc32c of the bytes before the trailer (docs/format.md 3.0)
            head = json.dumps(body, separators=(",", ":")).encode()[:-1]
            return head + b',"manifest_crc32c":%d}\n' % crc32c.crc32c(head)
        crc = crc32c.crc32c(canonical(body))
    except (ValueError, RecursionError, UnicodeDecodeError):
        return raw
    return json.dumps({**body, "manifest_crc32c": crc}, separators=(",", ":")).encode()


def _major(body: dict) -> int:
    v = body.get("version")
    return v[0] if isinstance(v, list) and v and type(v[0]) is int else 0


def loads(raw: bytes) -> Any:
    """The JSON value of a payload, or a sentinel when it is not JSON (the state and DCP targets
    take decoded trees: bytes that are not JSON never reach them)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return NOT_JSON


NOT_JSON = object()


class Fixtures:
    """A writable copy of the seed checkpoints (tmpfs where there is one) and their parsed parts."""

    def __init__(self, seeds: Path = SEEDS):
        from gdswriter.format.manifest import Manifest
        from gdswriter.format.sharded import RankShard, parse_step

        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self.dir = Path(tempfile.mkdtemp(prefix="gdswriter-fuzz-", dir=base))
        shutil.copytree(seeds, self.dir / "seeds", symlinks=True)
        self.root = self.dir / "seeds"
        self.single = [self.root / "single" / "a", self.root / "single" / "b"]
        self.ranks = self.root / "ranks"
        self.dcp = self.root / "dcp"
        self.single_manifest = self.step_file(self.single[0], SINGLE_STEP)
        self.ranks_manifest = self.step_file(self.ranks, RANKS_STEP)
        self.ranks_shard = self.step_file(self.ranks, RANKS_STEP, "manifest-rank00001.json")
        self.dcp_manifest = self.step_file(self.dcp, DCP_STEP)
        self.original = {p: p.read_bytes() for p in (self.single_manifest, self.ranks_manifest, self.ranks_shard,
                                                      self.dcp_manifest)}
        self.manifest = Manifest.from_json_bytes(self.original[self.single_manifest])
        self.dcp_m = Manifest.from_json_bytes(self.original[self.dcp_manifest])
        self.glob = parse_step(self.original[self.ranks_manifest], "fixture")
        self.shard0 = RankShard.from_json_bytes(
            self.step_file(self.ranks, RANKS_STEP, "manifest-rank00000.json").read_bytes(), where="fixture",
            step=RANKS_STEP, rank=0, world_size=2, n_roots=1)
        self.scratch = self.dir / "scratch"
        (self.scratch / "step_000000000001").mkdir(parents=True)

    @staticmethod
    def step_file(root: Path, step: int, name: str = "manifest.json") -> Path:
        return root / f"step_{step:012d}" / name

    def restore(self) -> None:
        for p, raw in self.original.items():
            p.write_bytes(raw)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ----------------------------------------------------------------------------- the targets
def t_manifest(fx: Fixtures, raw: bytes) -> None:
    """A 1.0-1.2 manifest.json (Manifest.from_json_bytes), then what readers derive from it."""
    from gdswriter.distributed.dcp import dcp_items, dcp_model_keys, is_dcp_step
    from gdswriter.load.reader import placeholder_tensors, state_keys
    from gdswriter.format.state_codec import decode_state
    from gdswriter.format.manifest import Manifest

    m = Manifest.from_json_bytes(raw)
    each(lambda: state_keys(m), lambda: decode_state(m.state, placeholder_tensors(m)),
         *((lambda: dcp_items(m), lambda: dcp_model_keys(m)) if is_dcp_step(m) else ()))


def t_step(fx: Fixtures, raw: bytes) -> None:
    """A step's manifest.json of any version (parse_step): a 1.3 global manifest with its root and
    shard tables and layout index, read entry by entry as loads read them."""
    from gdswriter.format.sharded import GlobalManifest, parse_global, parse_step

    g = parse_step(raw, "manifest.json")
    parse_global(raw, "manifest.json")
    if isinstance(g, GlobalManifest):
        list(g.roots), list(g.shards), g.roots.ids, g.roots.paths  # type: ignore[union-attr]
        if g.layout_index is not None:
            for e in list(g.layout_index.entries.values())[:64]:
                e.overlapping((0,) * len(e.global_shape), e.global_shape)
            g.layout_index.mismatched([None] * min(g.world_size, 4096))


def t_shard(fx: Fixtures, raw: bytes) -> None:
    """Rank 1's manifest shard (RankShard.from_json_bytes), merged with the real rank 0's."""
    from gdswriter.format.sharded import RankShard, merge

    sh = RankShard.from_json_bytes(raw, where="manifest-rank00001.json", step=RANKS_STEP, rank=1, world_size=2,
                                   n_roots=1)
    merge(fx.glob, [fx.shard0, sh])  # type: ignore[arg-type]


def t_state(fx: Fixtures, raw: bytes) -> None:
    """A state tree (decode_state) with three real tensors, and the keys readers list from it."""
    import torch

    from gdswriter.format.state_codec import decode_state
    from gdswriter.load.reader import state_keys

    tree = loads(raw)
    if tree is NOT_JSON:
        return
    tensors = [torch.arange(6, dtype=torch.float32), torch.zeros(2, 3, dtype=torch.int64), torch.ones(())] * 16
    each(lambda: decode_state(tree, tensors), lambda: state_keys(replace(fx.manifest, state=tree)))


def t_dcp_metadata(fx: Fixtures, raw: bytes) -> None:
    """DCP's Metadata as the manifest carries it (metadata_from_json), storage_data included, and
    the DCP helpers that read it with the state."""
    import torch

    from gdswriter.distributed.dcp import dcp_model_keys
    from gdswriter.distributed.dcp_codec import metadata_from_json

    tree = loads(raw)
    if tree is NOT_JSON:
        return
    def parsed() -> None:
        md = metadata_from_json(tree)
        # every size and offset used once (torch.Size takes ints past int64, and fails later); not
        # planner_data: a planner may put any int there, and Python prints none over 4300 digits
        repr(md.state_dict_metadata), repr(md.storage_data)
        for e in md.state_dict_metadata.values():
            for c in getattr(e, "chunks", ()):
                torch.Size(c.offsets).numel(), torch.Size(c.sizes).numel()

    m = fx.dcp_m
    each(parsed, lambda: dcp_model_keys(replace(m, dist=replace(m.dist, dcp=tree))))


def t_markers(fx: Fixtures, raw: bytes) -> None:
    """The small files: a root's identity marker, DCP's .metadata marker, ``latest``, and a
    secondary step directory's owner files (each written, then read back as the readers do)."""
    from gdswriter.distributed.dcp import is_gdswriter_marker
    from gdswriter.distributed.roots import root_identity as dist_root_identity
    from gdswriter.format.commit import (CommitProtocol, RootIdentity, owned_by, root_identity, step_owner)

    d = fx.scratch
    for name in (".gdswriter-root", ".metadata", "latest"):
        (d / name).write_bytes(raw)
    for name in ("primary-id", "primary-root"):
        (d / "step_000000000001" / name).write_bytes(raw)

    def marker() -> None:
        if is_gdswriter_marker(d / ".metadata") not in (True, False):
            raise Finding("is_gdswriter_marker answered neither True nor False")

    each(lambda: RootIdentity.from_json_bytes(raw, "marker"), marker, CommitProtocol([d]).latest_named,
         lambda: step_owner(d / "step_000000000001"), lambda: owned_by(d / "step_000000000001", str(d), "0" * 32),
         lambda: root_identity(d), lambda: dist_root_identity(d, create=False))


def load_both(roots: Any, step: int) -> None:
    """The single-process reader (gdswriter.load_state) and the one that assembles a multi-rank
    step's sharded tensors whole (gdswriter.distributed.load_state)."""
    import gdswriter
    from gdswriter.distributed import load_state as dist_load_state

    each(lambda: gdswriter.load_state(roots, step, engine_options=engine_options()),
         lambda: dist_load_state(roots, step, engine_options=engine_options()))


def t_load_single(fx: Fixtures, raw: bytes) -> None:
    """A fuzzed manifest.json beside the real data files of a 1.1 step on two roots: load_state
    (single-process and multi-rank readers) must refuse it or read it within the files' bytes."""
    fx.single_manifest.write_bytes(raw)
    load_both(fx.single, SINGLE_STEP)


def t_load_ranks(fx: Fixtures, raw: bytes) -> None:
    """A fuzzed global manifest beside the real shards and data files of a 2-rank 1.3 step."""
    fx.ranks_manifest.write_bytes(raw)
    load_both(fx.ranks, RANKS_STEP)


def t_load_shard(fx: Fixtures, raw: bytes) -> None:
    """A fuzzed rank-1 manifest shard beside the real data files of a 2-rank 1.3 step, the
    global manifest recording its size and crc32c (so the shard's own checks are reached)."""
    body = json.loads(fx.original[fx.ranks_manifest])
    body["shards"][1][2:4] = [len(raw), crc32c.crc32c(raw)]
    fx.ranks_manifest.write_bytes(reseal(json.dumps(body).encode()))
    fx.ranks_shard.write_bytes(raw)
    load_both(fx.ranks, RANKS_STEP)


def t_load_dcp(fx: Fixtures, raw: bytes) -> None:
    """A fuzzed manifest.json beside the real data files of a step saved through DCP: the
    one-process reader (items assembled whole) and read_dcp_items."""
    from gdswriter.distributed import load_state as dist_load_state
    from gdswriter.distributed.dcp import dcp_items, read_dcp_items
    from gdswriter.format.manifest import Manifest

    fx.dcp_manifest.write_bytes(raw)

    def items() -> None:
        m = Manifest.from_json_bytes(raw)
        read_dcp_items([fx.dcp], m, list(dcp_items(m))[:16], engine_options=engine_options())

    each(lambda: dist_load_state(fx.dcp, DCP_STEP, engine_options=engine_options()), items)


def t_dcp_load(fx: Fixtures, raw: bytes) -> None:
    """A fuzzed manifest.json beside the real data files of a DCP step, loaded by DCP itself
    through GDSStorageReader (read_metadata, then read_data into the live tensors), its errors
    unwrapped from DCP's CheckpointException as users do (dcp_errors)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gdswriter.distributed import GDSStorageReader
    from gdswriter.distributed.dcp import dcp_errors

    fx.dcp_manifest.write_bytes(raw)
    state = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)},
             "extra": {"t": torch.zeros(4, dtype=torch.int32)}}
    try:
        with dcp_errors():
            dcp.load(state, storage_reader=GDSStorageReader(fx.dcp, DCP_STEP, engine_options=engine_options()),
                     no_dist=True)
    except (ValueError, RuntimeError) as e:  # DCP's planner judging the live state against the metadata
        if not traceback.extract_tb(e.__traceback__)[-1].filename.endswith(DCP_PLANNER):
            raise
        raise DCPRefused(str(e)) from e
    except CheckpointException as e:  # the same, raised inside DCP's collective step
        if not all(isinstance(exc, (ValueError, RuntimeError)) and stack and stack[-1].filename.endswith(DCP_PLANNER)
                   for exc, stack in e.failures.values()):
            raise
        raise DCPRefused(str(e)) from e


TARGETS: list[tuple[str, Callable[[Fixtures, bytes], None]]] = [
    ("manifest", t_manifest), ("step", t_step), ("shard", t_shard), ("state", t_state),
    ("dcp_metadata", t_dcp_metadata), ("markers", t_markers), ("load_single", t_load_single),
    ("load_ranks", t_load_ranks), ("load_shard", t_load_shard), ("load_dcp", t_load_dcp), ("dcp_load", t_dcp_load),
]
RAW = 0x80  # selector bit: feed the payload as it is (no resealing)


def selector(name: str, raw: bool = False) -> int:
    return [n for n, _ in TARGETS].index(name) | (RAW if raw else 0)


def seed_inputs(fx: Fixtures) -> dict[str, bytes]:
    """The initial corpus: each target fed the real files of its format (every version)."""
    def step_bytes(root: Path, step: int, name: str = "manifest.json") -> bytes:
        return Fixtures.step_file(root, step, name).read_bytes()

    single = fx.original[fx.single_manifest]
    v10 = step_bytes(fx.root / "v10" / "a", SINGLE_STEP)
    v20 = replace(fx.manifest, version=(2, 0)).to_json_bytes()  # the 1.1 seed's step as format 2.0 writes it
    v21 = replace(fx.manifest, version=(2, 1)).to_json_bytes()  # and as 2.1 (its 4 KiB layout is a 2.1 one too)
    v30 = replace(fx.manifest, version=(3, 0)).to_json_bytes()  # and as 3.0 (base64 integer columns)
    ranks, shard1 = fx.original[fx.ranks_manifest], fx.original[fx.ranks_shard]
    dcp = fx.original[fx.dcp_manifest]
    shard0 = step_bytes(fx.ranks, RANKS_STEP, "manifest-rank00000.json")
    states = [json.dumps(json.loads(m)["state"]).encode() for m in (single, dcp)] + [
        json.dumps(json.loads(shard1)["tree"]).encode()]
    out = {}
    for name, payloads in {
        "manifest": [single, v10, dcp, v20, v21, v30], "step": [single, ranks, dcp, v20, v21, v30],
        "shard": [shard1, shard0],
        "state": states, "dcp_metadata": [json.dumps(json.loads(dcp)["dist"]["dcp"]).encode()],
        "markers": [(fx.single[0] / ".gdswriter-root").read_bytes(), (fx.dcp / ".metadata").read_bytes(),
                    (fx.single[0] / "latest").read_bytes(),
                    step_bytes(fx.single[1], SINGLE_STEP, "primary-id")],
        "load_single": [single, v10, v20, v21, v30], "load_ranks": [ranks], "load_shard": [shard1], "load_dcp": [dcp],
        "dcp_load": [dcp],
    }.items():
        for i, p in enumerate(payloads):
            out[f"{name}-{i}"] = bytes([selector(name)]) + p
    return out


# ----------------------------------------------------------------------------- the contract
def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def limit_memory(headroom: int = HEADROOM) -> int:
    """Cap the address space at what the process maps now plus ``headroom``; returns the cap."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + headroom
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    return cap


def run_one(fx: Fixtures, data: bytes) -> str:
    """Run one input; returns "ok" or the name of the typed error it ended in. Raises Finding (or
    lets the untyped error through) when the input breaks the contract."""
    from gdswriter.errors import GDSWriterError, RankFailedError

    if not data:
        return "empty"
    name, fn = TARGETS[(data[0] & ~RAW) % len(TARGETS)]
    payload = data[1:] if data[0] & RAW else reseal(data[1:])
    before = peak_rss()
    try:
        fn(fx, payload)
        outcome = "ok"
    except RankFailedError as e:
        raise Finding(f"{name}: one process reported another rank's failure: {e}") from e
    except GDSWriterError as e:
        outcome = type(e).__name__
    finally:
        if name.startswith("load") or name == "markers":
            fx.restore()
    grown = peak_rss() - before
    if grown > RSS_BUDGET:
        raise Finding(f"{name}: one input of {len(data)} bytes raised the peak resident size by {grown >> 20} MiB")
    return outcome
