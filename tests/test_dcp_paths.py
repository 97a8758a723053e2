"""DCP's path idiom through gdswriter (issue 26 items 1, 4, 5 and torchtitan; issue 25's reader):
``dcp.save/async_save/load(checkpoint_id=PATH, storage_writer/reader=...)`` with real files,
``overwrite=False`` as DCP's own e2e test_overwrite expects, FileSystemWriter's options, errors
raised where DCP does not wrap them, the reader reading in place or atomically, and torchtitan's
CheckpointManager calls mimicked on 2 gloo ranks with an FSDP2 model. Tensors are above every
small-copy threshold (> 1 MiB) and every load is compared bit for bit."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MIB = 1 << 20


def _engine():
    from support.models import small_engine

    return small_engine()


def writer(root=None, step=None, **kw):
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageWriter

    return GDSStorageWriter(root, step, options=CheckpointOptions(engine=_engine()), **kw)


def reader(root=None, step=None, **kw):
    from gdswriter.distributed import GDSStorageReader

    return GDSStorageReader(root, step, engine_options=_engine(), **kw)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(768, 1024, generator=g), "b": torch.randn(3 * MIB // 4, generator=g),
            "i": torch.randint(0, 1 << 30, (MIB,), generator=g, dtype=torch.int64)}


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cli(*args) -> int:
    from gdswriter.cli import main

    return main([str(a) for a in args])


# ----------------------------------------------------------------------------- one process
def test_a_path_checkpoint_id_names_one_checkpoint_that_the_command_sees(tmp_path, capsys):
    """checkpoint_id=PATH (torchtitan's .../step-N) is a directory holding one gdswriter step,
    numbered from its name, with a .metadata marker written after the commit; one writer and
    one reader serve several paths (reset), keeping their engines; gdswriter ls/verify/export
    work on the directory; validate_checkpoint_id answers as FileSystemWriter's does."""
    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter

    folder = tmp_path / "checkpoint"
    w = writer()
    saved = {}
    for step in (10, 20):
        saved[step] = _state(step)
        dcp.save(saved[step], checkpoint_id=folder / f"step-{step}", storage_writer=w, no_dist=True)
    engines = w._engines
    w.close()
    assert engines is not None and len(engines) == 1
    for step in (10, 20):
        d = folder / f"step-{step}"
        assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".gdswriter")) == [
            ".metadata", "latest", f"step_{step:012d}"]
        marker = json.loads((d / ".metadata").read_text())
        assert marker["format"] == "gdswriter-dcp" and "GDSStorageReader" in marker["note"]
    r = reader()
    for step in (20, 10):
        got = _zeros(saved[step])
        dcp.load(got, checkpoint_id=str(folder / f"step-{step}"), storage_reader=r, no_dist=True)
        assert _equal(got, saved[step]), step
    r.close()
    capsys.readouterr()
    assert _cli("ls", folder / "step-20") == 0 and "20" in capsys.readouterr().out
    assert _cli("verify", folder / "step-10") == 0 and "OK" in capsys.readouterr().out
    assert _cli("export", folder / "step-10", "--to", "torch", tmp_path / "x.pt") == 0
    assert _equal(torch.load(tmp_path / "x.pt", weights_only=True), saved[10])

    assert GDSStorageWriter.validate_checkpoint_id(tmp_path / "new" / "step-1")
    assert GDSStorageWriter.validate_checkpoint_id(str(tmp_path / "new"))
    assert GDSStorageWriter.validate_checkpoint_id(7)
    assert not GDSStorageWriter.validate_checkpoint_id("s3://bucket/ckpt")
    assert not GDSStorageWriter.validate_checkpoint_id(True)
    assert GDSStorageReader.validate_checkpoint_id(folder / "step-10")
    assert not GDSStorageReader.validate_checkpoint_id(tmp_path / "new")  # nothing to read there
    assert not GDSStorageReader.validate_checkpoint_id("gs://bucket/ckpt")


def test_a_path_under_the_first_of_several_roots_is_stored_under_each(tmp_path):
    """A writer striping over two SSDs takes a path under its first root and stores the
    checkpoint at the same relative path under both (data files on each, the manifest and the
    marker on the first); a path elsewhere is refused by reset(), before DCP's collectives."""
    import torch.distributed.checkpoint as dcp

    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageWriter
    from gdswriter.errors import InvalidOptionError

    roots = [tmp_path / "nvme0", tmp_path / "nvme1"]
    sd = _state(6)
    w = GDSStorageWriter(roots, options=CheckpointOptions(engine=_engine(), files_per_root=1))
    dcp.save(sd, checkpoint_id=roots[0] / "job" / "step-4", storage_writer=w, no_dist=True)
    for i, r in enumerate(roots):
        step_dir = r / "job" / "step-4" / "step_000000000004"
        assert any(step_dir.glob("data-*")), i
        assert (step_dir / "manifest.json").exists() == (i == 0)
    assert (roots[0] / "job" / "step-4" / ".metadata").exists() and not (roots[1] / "job" / "step-4" /
                                                                        ".metadata").exists()
    with pytest.raises(InvalidOptionError, match="not under this plug-in's first root"):
        dcp.save(sd, checkpoint_id=tmp_path / "elsewhere", storage_writer=w, no_dist=True)
    w.close()
    got = _zeros(sd)
    dcp.load(got, checkpoint_id=roots[0] / "job" / "step-4", storage_reader=reader(roots), no_dist=True)
    assert _equal(got, sd)


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path, caplog):
    """DCP's test_overwrite (test/distributed/checkpoint/e2e/test_e2e_save_and_load.py) with
    GDSStorageWriter: overwrite=True replaces (with a warning), overwrite=False raises "Checkpoint
    already exists" and leaves the old checkpoint as it was; for a path, a step number, and a
    root given without a step. dcp_errors() raises gdswriter's own CheckpointExistsError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gdswriter.distributed import dcp_errors
    from gdswriter.errors import CheckpointExistsError

    t1, t2 = _state(1), _state(2)
    # as DCP's test: a directory given to the writer
    dcp.save(t1, storage_writer=writer(tmp_path / "a", overwrite=False), no_dist=True)
    dcp.save(t2, storage_writer=writer(tmp_path / "a", overwrite=True), no_dist=True)
    got = _zeros(t2)
    dcp.load(got, storage_reader=reader(tmp_path / "a"), no_dist=True)
    assert _equal(got, t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(t1, storage_writer=writer(tmp_path / "a", overwrite=False), no_dist=True)

    # a path checkpoint_id
    path = tmp_path / "ck" / "step-3"
    dcp.save(t1, checkpoint_id=path, storage_writer=writer(overwrite=False), no_dist=True)
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        dcp.save(t2, checkpoint_id=path, storage_writer=writer(), no_dist=True)  # overwrite=True by default
    assert any("replacing the checkpoint" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointExistsError, match="overwrite=False"), dcp_errors():
        dcp.save(t1, checkpoint_id=path, storage_writer=writer(overwrite=False), no_dist=True)
    got = _zeros(t2)
    dcp.load(got, checkpoint_id=path, storage_reader=reader(), no_dist=True)
    assert _equal(got, t2)  # the refused save changed nothing

    # a step number under a root
    w = writer(tmp_path / "steps", overwrite=False)
    dcp.save(t1, checkpoint_id=5, storage_writer=w, no_dist=True)
    dcp.save(t2, checkpoint_id=6, storage_writer=w, no_dist=True)
    with pytest.raises(CheckpointExistsError, match="step 5"), dcp_errors():
        dcp.save(t2, checkpoint_id=5, storage_writer=w, no_dist=True)
    w.close()
    got = _zeros(t1)
    dcp.load(got, checkpoint_id=5, storage_reader=reader(tmp_path / "steps"), no_dist=True)
    assert _equal(got, t1)


def test_filesystemwriter_options_are_taken_or_refused_with_the_reason(tmp_path, caplog):
    """FileSystemWriter's keyword options: those gdswriter does otherwise are taken and a warning
    says what it does instead; those it cannot honour are refused at construction, outside DCP's
    wrapping, with the reason."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    from gdswriter.errors import InvalidOptionError

    sd = _state(3)
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        w = writer(tmp_path / "a", sync_files=False, thread_count=8, per_thread_copy_ahead=0,
                   single_file_per_rank=False)
    text = " ".join(r.getMessage() for r in caplog.records)
    for word in ("sync_files=False is not honoured", "thread_count=8", "per_thread_copy_ahead",
                 "single_file_per_rank=False"):
        assert word in text, text
    dcp.save(sd, storage_writer=w, no_dist=True)
    w.close()
    got = _zeros(sd)
    dcp.load(got, storage_reader=reader(tmp_path / "a"), no_dist=True)
    assert _equal(got, sd)
    for kw, why in ((dict(cache_staged_state_dict=True), "async_stager"), (dict(_extensions=[object()]), "compression"),
                    (dict(serialization_format=SerializationFormat.SAFETENSORS), "gdswriter export")):
        with pytest.raises(InvalidOptionError, match=why):
            writer(tmp_path / "b", **kw)
    with pytest.raises(InvalidOptionError, match="stream"):
        reader(tmp_path / "a", _extension_registry=object())


def test_errors_dcp_does_not_wrap_reach_the_caller_as_they_are(tmp_path):
    """reset() runs before DCP's collectives: a URL or a negative step is gdswriter's own
    InvalidOptionError, not a CheckpointException; a writer without any directory says how to
    give one. Inside DCP's steps errors are CheckpointException (a BaseException), and
    dcp_errors() hands back the gdswriter error inside."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gdswriter.distributed import dcp_errors
    from gdswriter.errors import CheckpointNotFoundError, InvalidOptionError

    sd = _state(4)
    with pytest.raises(InvalidOptionError, match="FsspecWriter"):
        dcp.save(sd, checkpoint_id="s3://bucket/step-1", storage_writer=writer(), no_dist=True)
    with pytest.raises(InvalidOptionError, match=">= 0"):
        dcp.load(sd, checkpoint_id=-1, storage_reader=reader(tmp_path), no_dist=True)
    with pytest.raises(CheckpointException) as ei:
        dcp.save(sd, storage_writer=writer(), no_dist=True)
    assert not isinstance(ei.value, Exception) and "checkpoint_id=PATH" in str(ei.value)
    with pytest.raises(InvalidOptionError, match="checkpoint_id=PATH"), dcp_errors():
        dcp.save(sd, storage_writer=writer(), no_dist=True)
    with pytest.raises(CheckpointNotFoundError), dcp_errors():
        dcp.load(sd, checkpoint_id=tmp_path / "nothing", storage_reader=reader(), no_dist=True)


def _damage(root: Path, name: str) -> None:
    """Flip one byte in the middle of tensor ``name``'s bytes."""
    from gdswriter.format.manifest import MANIFEST_NAME, Manifest

    step_dir = next(root.glob("step_*"))
    m = Manifest.from_json_bytes((step_dir / MANIFEST_NAME).read_bytes())
    rec = next(t for t in m.tensors if t.name == name)
    c = m.storages[rec.storage].chunks[0]
    with open(step_dir / m.files[c.file].path, "r+b") as f:
        f.seek(c.file_offset + c.length // 2)
        b = f.read(1)
        f.seek(c.file_offset + c.length // 2)
        f.write(bytes([b[0] ^ 0x5A]))


def _edit_manifest(step_dir: Path, raw: bytes, edit) -> None:
    """Write the manifest ``raw`` as ``edit(manifest)`` changes it (its checksum recomputed): a
    hand-made manifest that parses."""
    from gdswriter.format.manifest import MANIFEST_NAME, Manifest

    (step_dir / MANIFEST_NAME).write_bytes(edit(Manifest.from_json_bytes(raw)).to_json_bytes())


def _with_record(name: str, **changes):
    from dataclasses import replace

    def edit(m):
        return replace(m, tensors=[replace(t, **changes) if t.name == name else t for t in m.tensors])

    return edit


def _shorter_b(m):
    """b's record and its DCP chunk 4 elements shorter, starting 16 bytes into its storage."""
    m = _with_record("b", byte_offset=16, shape=(3 * MIB // 4 - 4,))(m)
    for fqn, e in m.dist.dcp["state_dict_metadata"]:
        if fqn == "b":
            e["tensor"]["size"], e["tensor"]["chunks"] = [3 * MIB // 4 - 4], [[[0], [3 * MIB // 4 - 4]]]
    return m


@pytest.mark.parametrize("case, edit, says", [
    ("stride", _with_record("w", stride=(1, 768)), "stride [1, 768]"),
    ("byte offset", _shorter_b, "byte offset 16"),
    ("shape", _with_record("b", shape=(3 * MIB // 4 - 4,)), "its chunk [786432]"),
    ("dtype", _with_record("i", dtype="float64"), "dtype float64, its chunk [1048576] and int64"),
])
def test_reader_refuses_records_the_writer_never_writes(tmp_path, case, edit, says):
    """A DCP step's record is the item's chunk, contiguous at byte 0 of its storage: a hand-made
    manifest whose record has another stride, a byte offset, another shape or dtype was read as
    contiguous bytes (a transposed view loaded untransposed, int64 bytes cast as float64) or
    failed in read_data with an untyped RuntimeError after its buffers were allocated and read.
    It is refused with CorruptCheckpointError before any read: no target changes, atomic or not."""
    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import dcp_errors
    from gdswriter.errors import CorruptCheckpointError
    from gdswriter.format.manifest import MANIFEST_NAME

    sd = _state(6)
    dcp.save(sd, checkpoint_id=tmp_path / "ck", storage_writer=writer(), no_dist=True)
    step_dir = next((tmp_path / "ck").glob("step_*"))
    _edit_manifest(step_dir, (step_dir / MANIFEST_NAME).read_bytes(), edit)
    for atomic in (False, True):
        got = _zeros(sd)
        if case == "byte offset":
            got["b"] = got["b"][4:].clone()
        with pytest.raises(CorruptCheckpointError, match=re.escape(says)), dcp_errors():
            dcp.load(got, checkpoint_id=tmp_path / "ck", storage_reader=reader(atomic=atomic), no_dist=True)
        assert not any(v.any() for v in got.values()), case


def test_reader_in_place_by_default_atomic_on_request(tmp_path, monkeypatch):
    """The reader reads whole items straight into DCP's targets (no buffer: the fetch gets the
    targets as its buffers) and keeps its engine from load to load; items DCP asks for in part
    or in another dtype go through a buffer. A damaged file raises either way; with
    atomic=True no target has changed when it does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import gdswriter.distributed.dcp_reader as dcp_mod
    from gdswriter.distributed import dcp_errors
    from gdswriter.errors import ChecksumMismatchError

    sd = _state(5)
    dcp.save(sd, checkpoint_id=tmp_path / "ck", storage_writer=writer(), no_dist=True)
    seen = []
    real_fetch = dcp_mod.fetch_storages
    monkeypatch.setattr(dcp_mod, "fetch_storages", lambda *a, **k: seen.append(dict(k["into"])) or real_fetch(*a, **k))
    built = []
    real_engine = dcp_mod.create_engine
    monkeypatch.setattr(dcp_mod, "create_engine", lambda *a, **k: built.append(real_engine(*a, **k)) or built[-1])
    r = reader()
    got = _zeros(sd)
    dcp.load(got, checkpoint_id=tmp_path / "ck", storage_reader=r, no_dist=True)
    assert _equal(got, sd)
    ptrs = {t.data_ptr() for t in seen[-1].values()}
    assert ptrs == {v.data_ptr() for v in got.values()}, "every item read into its target"
    cast = {"w": torch.zeros(768, 1024, dtype=torch.float64), "b": torch.zeros_like(sd["b"]),
            "i": torch.zeros_like(sd["i"])}
    dcp.load(cast, checkpoint_id=tmp_path / "ck", storage_reader=r, no_dist=True)
    assert torch.equal(cast["w"], sd["w"].double()) and torch.equal(cast["i"], sd["i"])
    assert len(seen[-1]) == 2 and len(built) == 1  # "w" through a buffer; one engine for both loads
    r.close()
    assert built[0]._backend is None

    _damage(tmp_path / "ck", "w")
    for atomic in (True, False):
        got = _zeros(sd)
        with pytest.raises(CheckpointException, match="checksum mismatch"):
            dcp.load(got, checkpoint_id=tmp_path / "ck", storage_reader=reader(atomic=atomic), no_dist=True)
        changed = [k for k in got if got[k].any()]
        if atomic:
            assert changed == [], changed
        else:
            assert "w" in changed  # read in place, as FileSystemReader copies each item as it goes
    with pytest.raises(ChecksumMismatchError), dcp_errors():
        dcp.load(_zeros(sd), checkpoint_id=tmp_path / "ck", storage_reader=reader(), no_dist=True)


def test_default_reader_pool_keeps_the_queue_full_while_staged_chunks_are_copied(tmp_path, monkeypatch):
    """Without engine_options the reader's staging pool holds twice the bytes the queue keeps
    in flight (the queue stays full while a read chunk waits to be copied into its target),
    or the load's bytes when fewer, built once and rebuilt only for a load needing more; the
    GDSWRITER_NUM_BUFFERS knob still wins. (Counted, not timed: with a pool only as large as
    the queue, 512 MiB cold waited 120-135 ms on the disk here against 40-48 ms.)"""
    import torch.distributed.checkpoint as dcp

    import gdswriter.distributed.dcp_reader as dcp_mod
    from gdswriter.distributed import GDSStorageReader

    for var in ("GDSWRITER_NUM_BUFFERS", "GDSWRITER_BUFFER_BYTES", "GDSWRITER_REQUEST_BYTES", "GDSWRITER_QUEUE_DEPTH"):
        monkeypatch.delenv(var, raising=False)
    big = dcp_mod.reader_engine_options()
    assert big.buffer_bytes == 8 * MIB
    assert big.num_buffers * big.buffer_bytes == 2 * big.queue_depth * big.request_bytes  # 8 x 8 MiB
    assert dcp_mod.reader_engine_options(512 * MIB) == big
    assert dcp_mod.reader_engine_options(20 * MIB).num_buffers == 3  # no larger than the load
    assert dcp_mod.reader_engine_options(1).num_buffers == 2
    monkeypatch.setenv("GDSWRITER_NUM_BUFFERS", "5")
    assert dcp_mod.reader_engine_options(512 * MIB).num_buffers == 5

    # scaled down: a queue of 8 x 256 KiB, 1 MiB buffers, so at most 4 of them
    monkeypatch.delenv("GDSWRITER_NUM_BUFFERS")
    monkeypatch.setenv("GDSWRITER_QUEUE_DEPTH", "8")
    monkeypatch.setenv("GDSWRITER_REQUEST_BYTES", str(256 << 10))
    monkeypatch.setenv("GDSWRITER_BUFFER_BYTES", str(MIB))
    sd = _state(7)
    dcp.save(sd, checkpoint_id=tmp_path / "ck", storage_writer=writer(), no_dist=True)
    built = []
    real_engine = dcp_mod.create_engine
    monkeypatch.setattr(dcp_mod, "create_engine", lambda o: built.append((o, real_engine(o))) or built[-1][1])
    r = GDSStorageReader()
    part = {"b": torch.zeros_like(sd["b"])}  # 3 MiB
    for got in (part, _zeros(sd), _zeros(sd)):
        dcp.load(got, checkpoint_id=tmp_path / "ck", storage_reader=r, no_dist=True)
        assert _equal(got, {k: sd[k] for k in got})
    assert [(o.num_buffers, o.buffer_bytes, o.queue_depth) for o, _ in built] == [(3, MIB, 8), (4, MIB, 8)]
    assert built[0][1]._backend is None  # the smaller engine was closed when the larger one was built
    r.close()
    assert built[1][1]._backend is None


# ----------------------------------------------------------------------------- torchtitan, 2 ranks
def _fsdp(world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 768), torch.nn.ReLU(), torch.nn.Linear(768, 512))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model, opt, step: int) -> None:
    torch.manual_seed(100 + step)
    model(torch.randn(8, 1024)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full(model, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {f"model.{k}": v.full_tensor() for k, v in get_model_state_dict(model).items()}
    for fqn, st in get_optimizer_state_dict(model, opt)["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def _find_load_step(folder: str) -> int:
    """torchtitan 0.3.0's CheckpointManager._find_load_step, as it is (local paths)."""
    import os

    if not os.path.isdir(folder):
        return -1
    valid = []
    for filename in os.listdir(folder):
        match = re.search(r"step-(\d+)", filename)
        if match and os.path.isfile(os.path.join(folder, filename, ".metadata")):
            valid.append(int(match.group(1)))
    return max(valid) if valid else -1


def _torchtitan_ranks(rank: int, world: int, tmp: str) -> dict:
    """torchtitan's CheckpointManager calls, with its one change: a GDSStorageWriter kept for
    the job (on its async gloo group) and a GDSStorageReader passed to dcp.load."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import gdswriter.distributed.dcp_writer as dcp_mod
    from gdswriter import CheckpointOptions
    from gdswriter.distributed import GDSStorageReader, GDSStorageWriter, dcp_errors
    from gdswriter.errors import CheckpointExistsError

    folder = os.path.join(tmp, "checkpoint")
    pg = dist.new_group(backend="gloo")  # CheckpointManager.__init__ for async_mode="async"
    storage_writer = GDSStorageWriter(process_group=pg, options=CheckpointOptions(engine=_engine()))

    def states(model, opt, step):  # _flattened_model_states_sd: the model's keys at the top level
        sd = {"optimizer": get_optimizer_state_dict(model, opt), "train_state": {"step": step}}
        sd.update(get_model_state_dict(model))
        return sd

    model, opt = _fsdp(world, seed=0)
    _train(model, opt, 1)
    dcp.save(states(model, opt, 1), storage_writer=storage_writer, checkpoint_id=os.path.join(folder, "step-1"))
    _train(model, opt, 2)
    expected = _full(model, opt)
    fut = dcp.async_save(states(model, opt, 2), storage_writer=storage_writer,
                         checkpoint_id=os.path.join(folder, "step-2"), process_group=pg)
    _train(model, opt, 3)  # training goes on while the save runs
    fut.result()  # maybe_wait_for_saving
    # step 3's save fails on rank 1 half way (the disk is full): no .metadata in step-3, which
    # the lookup must skip (a crash before the commit leaves the same)
    real = dcp_mod.write_files
    if rank == 1:
        dcp_mod.write_files = lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    failed = False
    try:
        dcp.save(states(model, opt, 3), storage_writer=storage_writer, checkpoint_id=os.path.join(folder, "step-3"))
    except CheckpointException:
        failed = True
    dcp_mod.write_files = real
    # async_mode="async_with_pinned_mem": DCP's checkpoint process (the writer, pickled, coordinates
    # there over that process's default group, which DCP builds over pg's ranks)
    _train(model, opt, 4)
    expected4 = _full(model, opt)
    fut = dcp.async_save(states(model, opt, 4), storage_writer=storage_writer,
                         checkpoint_id=os.path.join(folder, "step-4"), process_group=pg,
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    fut.result()
    # overwrite=False: every rank raises gdswriter's CheckpointExistsError, step-2 stays as it was
    refused = ""
    try:
        with dcp_errors():
            dcp.save(states(model, opt, 4), checkpoint_id=os.path.join(folder, "step-2"),
                     storage_writer=GDSStorageWriter(process_group=pg, overwrite=False,
                                                     options=CheckpointOptions(engine=_engine())))
    except CheckpointExistsError as e:
        refused = str(e)
    # a model-only checkpoint with a "model" entry, for `gdswriter export --model-only`
    dcp.save({"model": get_model_state_dict(model)}, storage_writer=storage_writer,
             checkpoint_id=os.path.join(tmp, "final", "step-3"))
    final = _full(model, opt)
    if rank == 0:
        torch.save({k: v for k, v in final.items() if k.startswith("model.")}, os.path.join(tmp, "final.pt"))
    storage_writer.close()

    # the restart: find the last complete step as torchtitan does, then _load (and step 2 too)
    load_step = _find_load_step(folder)
    model, opt = _fsdp(world, seed=9)
    _train(model, opt, 1)  # an optimizer with state to load into (torchtitan: init_optim_state)
    same, steps = [], []
    reader = GDSStorageReader()
    for step, want in ((load_step, expected4), (2, expected)):
        sd = states(model, opt, 0)
        dcp.load(sd, checkpoint_id=os.path.join(folder, f"step-{step}"), storage_reader=reader)
        set_model_state_dict(model, {k: v for k, v in sd.items() if k not in ("optimizer", "train_state")})
        set_optimizer_state_dict(model, opt, sd["optimizer"])
        got = _full(model, opt)
        same.append(got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got))
        steps.append(sd["train_state"]["step"])
    reader.close()
    return {"failed": failed, "refused": refused, "load_step": load_step, "same": same, "train_steps": steps,
            "shard_bytes": model[0].weight.to_local().numel() * 4}


@pytest.mark.slow  # about 28 s here: two spawned ranks, FSDP2, four saves and a load
def test_torchtitan_checkpoint_manager_calls_on_2_ranks(tmp_path, capsys):
    """torchtitan's calls (dcp.save, and dcp.async_save in thread and process modes, with
    checkpoint_id=folder/step-N on its gloo group; the .metadata lookup of the last step;
    dcp.load) with an FSDP2 model on 2 gloo ranks: a save that fails on one rank leaves no
    .metadata, so the lookup skips it; overwrite=False refuses a step again on both ranks; the
    resumed model and optimizer equal the state of the step loaded, bit for bit. The "model" checkpoint exports with --model-only into whole tensors
    that equal the trained model's."""
    from safetensors.torch import load_file

    res = run_ranks(2, _torchtitan_ranks, str(tmp_path), out=tmp_path / "r")
    assert all(r["failed"] for r in res), res
    assert all("Checkpoint already exists" in r["refused"] for r in res), res
    assert [r["load_step"] for r in res] == [4, 4] and all(r["same"] == [True, True] for r in res), res
    assert res[0]["train_steps"] == [4, 2] and res[0]["shard_bytes"] > MIB
    assert (tmp_path / "checkpoint" / "step-3").is_dir() and not (tmp_path / "checkpoint" / "step-3" /
                                                                  ".metadata").exists()
    out = tmp_path / "model.safetensors"
    capsys.readouterr()
    assert _cli("export", tmp_path / "final" / "step-3", "--to", "safetensors", "--model-only", out) == 0, \
        capsys.readouterr()
    want = torch.load(tmp_path / "final.pt", weights_only=True)
    got = load_file(out)
    assert got.keys() == {k.removeprefix("model.") for k in want}
    assert all(torch.equal(got[k.removeprefix("model.")], v) for k, v in want.items())


# ----------------------------------------------------------------------------- kill -9, torchtitan's resume
KILL_STEPS = 6


def _grad(step: int) -> torch.Tensor:
    return torch.randn(768, 1024, generator=torch.Generator().manual_seed(1000 + step))


def _train_step(state: dict, step: int) -> None:
    """SGD with momentum, by hand: every step changes the weights and the momentum."""
    state["m"].mul_(0.9).add_(_grad(step))
    state["w"].sub_(0.01 * state["m"])
    state["step"].fill_(step)


def _fresh(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(768, 1024, generator=g), "m": torch.zeros(768, 1024), "step": torch.zeros((), dtype=torch.int64)}


def _killed_dcp_run(rank: int, world: int, folder: str, mode: str) -> None:
    """Train KILL_STEPS steps saving torchtitan-style (dcp.save to FOLDER/step-N every 2 steps)
    and die of SIGKILL: while step 4's data file is written ("in-save", before its commit), or
    at the end of step 5 ("between")."""
    import os
    import signal

    import torch.distributed.checkpoint as dcp

    import gdswriter.distributed.dcp_writer as plugin

    state = _fresh(0)
    w = writer()
    for step in range(1, KILL_STEPS + 1):
        _train_step(state, step)
        if mode == "between" and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % 2 == 0:
            if mode == "in-save" and step == 4:
                written = plugin.write_files

                def write_then_die(*args, **kwargs):  # the data is on disk, the step not committed
                    out = written(*args, **kwargs)
                    os.kill(os.getpid(), signal.SIGKILL)
                    return out

                plugin.write_files = write_then_die  # private: the plug-in's own name for its writes
            dcp.save(state, checkpoint_id=os.path.join(folder, f"step-{step}"), storage_writer=w)
    raise AssertionError("not killed")


@pytest.mark.parametrize("mode", ["in-save", "between"])
def test_a_killed_dcp_run_resumes_as_torchtitan_would_bit_for_bit(tmp_path, mode):
    """kill -9 during a save through the path idiom (or between saves): torchtitan's lookup
    (the newest step-N with a .metadata) finds the last committed step, which loads, and the run
    resumed from it ends bit for bit like an uninterrupted one; the torn step is refused."""
    import os

    import torch.distributed.checkpoint as dcp

    from gdswriter.distributed import dcp_errors
    from gdswriter.errors import CheckpointNotFoundError

    folder = tmp_path / "checkpoints"
    run_ranks(1, _killed_dcp_run, str(folder), mode, out=tmp_path / "out", killed=(0,))
    want = {"in-save": 2, "between": 4}[mode]
    assert _find_load_step(str(folder)) == want
    if mode == "in-save":
        assert (folder / "step-4").is_dir() and not (folder / "step-4" / ".metadata").exists()
        with pytest.raises(CheckpointNotFoundError), dcp_errors():
            dcp.load(_zeros(_fresh(0)), checkpoint_id=str(folder / "step-4"), storage_reader=reader(), no_dist=True)
    state = _zeros(_fresh(0))
    dcp.load(state, checkpoint_id=os.path.join(folder, f"step-{want}"), storage_reader=reader(), no_dist=True)
    assert int(state["step"]) == want
    for step in range(want + 1, KILL_STEPS + 1):
        _train_step(state, step)
    straight = _fresh(0)
    for step in range(1, KILL_STEPS + 1):
        _train_step(straight, step)
    assert _equal(state, straight)
