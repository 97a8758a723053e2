"""Make the fuzz fixtures: real checkpoints of each format version, saved by gdswriter itself.

    python tests/fuzz/make_seeds.py [OUT]      (default: tests/fuzz/seeds, replaced)

Writes, each a checkpoint root (tiny tensors: the fixtures are committed and stay small):

* ``single/``: a single-process step (format 1.1) on two roots, with every kind of state value
  the state codec encodes (tuples, bytes, big ints, NaN, numpy scalars and arrays, dtypes,
  devices, an OrderedDict with metadata, tied weights, a strided view), its ``latest`` file,
  the roots' ``.gdswriter-root`` markers and the secondary root's owner files;
* ``v10/``: the same step rewritten as format 1.0 (no file info, version [1, 0], checksum resealed);
* ``ranks/``: a 2-rank step (format 1.3: the global manifest with its layout index, one manifest
  shard per rank) holding a DTensor sharded over a mesh of both ranks, replicated and rank-local state;
* ``dcp/``: a step saved through DCP (format 1.2 with the DCP metadata), with its ``.metadata`` marker.

The fuzz harness (tests/fuzz/harness.py) builds its corpus from these files and loads fuzzed
manifests beside their real data files.
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def _options():
    from gdswriter import CheckpointOptions, EngineOptions

    return CheckpointOptions(engine=EngineOptions(buffer_bytes=256 << 10, request_bytes=64 << 10, num_buffers=3,
                                                  queue_depth=16))


def save_single(root: Path) -> None:
    from gdswriter import GDSCheckpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 4, bias=False))
    model[2].weight = torch.nn.Parameter(model[0].weight.t().contiguous())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    od = collections.OrderedDict([("a", 1), (2, "b")])
    od._metadata = {"version": 3}
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    extra = {"misc": {
        "tuple": (1, 2.5, None, True), "bytes": b"\x00\xffgds", "big": 2 ** 70, "neg": -(2 ** 65),
        "nan": math.nan, "inf": -math.inf, "np": np.float32(1.5), "npi": np.int16(-3), "npc": np.complex64(1 + 2j),
        "nps": np.str_("s"), "npb": np.bytes_(b"b"), "arr": np.arange(6, dtype=np.int64).reshape(2, 3),
        "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]), "odict": od,
        "view": base[1:3, ::2], "empty": torch.empty(0, 5), "scalar": torch.tensor(7, dtype=torch.int8),
        "half": torch.ones(3, dtype=torch.float16), "bool": torch.tensor([True, False]), 5: "int key",
    }}
    root.mkdir(parents=True)
    roots = [root / "a", root / "b"]
    with GDSCheckpointer(model, opt, root=roots, state=extra, options=_options()) as ck:
        ck.save(3)


def rewrite_v10(src: Path, dst: Path) -> None:
    """The 1.1 step of ``src`` as format 1.0 wrote it: no file info, version [1, 0]."""
    from gdswriter.format.manifest import Manifest

    shutil.copytree(src, dst, symlinks=True)
    path = dst / "a" / "step_000000000003" / "manifest.json"
    m = Manifest.from_json_bytes(path.read_bytes())
    files = tuple(type(f)(f.root, f.path, f.size) for f in m.files)
    path.write_bytes(type(m)(step=m.step, files=files, storages=m.storages, tensors=m.tensors, state=m.state,
                             created_unix=m.created_unix, metadata=m.metadata, version=(1, 0)).to_json_bytes())


def _ranks_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gdswriter import GDSCheckpointer

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    state = {"tp": {"w": distribute_tensor(full, mesh, [Shard(0)])},
             "misc": {"shared": torch.ones(3), "mine": torch.full((2,), float(rank)), "step": 5}}
    with GDSCheckpointer(state=state, root=root, options=_options()) as ck:
        ck.save(5)


def _rank_entry(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    _ranks_worker(rank, world, root)
    dist.destroy_process_group()


def save_ranks(root: Path) -> None:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(r, 2, port, str(root))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank of the 2-rank seed save failed (exit code {p.exitcode})")


def save_dcp(root: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import GDSStorageWriter

    torch.manual_seed(1)
    state = {"model": torch.nn.Linear(3, 2).state_dict(), "extra": {"t": torch.arange(4, dtype=torch.int32)}}
    root.mkdir(parents=True)
    dcp.save(state, storage_writer=GDSStorageWriter(root, 2, options=_options()), no_dist=True)


def main(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_single(out / "single")
    rewrite_v10(out / "single", out / "v10")
    save_ranks(out / "ranks")
    save_dcp(out / "dcp")
    for lock in out.rglob(".gdswriter.lock"):
        lock.unlink()
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(json.dumps({"out": str(out), "files": sum(1 for p in out.rglob("*") if p.is_file()), "bytes": total}))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    os.environ.setdefault("GDSWRITER_DIRECT_IO", "0")
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "seeds")
