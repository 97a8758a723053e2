"""Damaged checkpoints: every kind of damage is a typed error naming what is wrong,
and the earlier, intact steps still load."""

from __future__ import annotations

import json
from dataclasses import replace
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import crc32c
import pytest
import torch

from support import models as M
from support.ranks import run_ranks
import gdswriter.load.reader as reader_mod
from gdswriter import (ChecksumMismatchError, CorruptCheckpointError, GDSCheckpointer, TruncatedFileError,
                       UnsupportedFormatVersionError, UnsupportedObjectError, load_state)
from gdswriter.cli import main as cli_main
from gdswriter.export import export_step
from gdswriter.format.commit import step_dir_name
from gdswriter.format.manifest import MANIFEST_NAME, Manifest, canonical_json


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.randn(1000, generator=g),
            "i": torch.randint(0, 1 << 30, (64, 64), generator=g, dtype=torch.int64),
            "s": torch.tensor(float(step))}


@pytest.fixture
def two_steps(tmp_path):
    """A root with committed steps 1 and 2 (different bytes); returns the root."""
    root = tmp_path / "ck"
    state = _state(1)
    with GDSCheckpointer(state, None, root, options=M.small_options()) as ck:
        ck.save(1)
        for k, v in _state(2).items():
            state[k].copy_(v)
        ck.save(2)
    return root


def mpath(root: Path, step: int) -> Path:
    return root / step_dir_name(step) / MANIFEST_NAME


def body(root: Path, step: int) -> dict:
    """The step's manifest as 1.1 rows (a 2.0 manifest's records re-written as 1.1 writes them,
    which a 1.x reader path checks once ``rewrite`` wrote them back): the edits below name rows."""
    raw = mpath(root, step).read_bytes()
    b = json.loads(raw)
    return json.loads(replace(Manifest.from_json_bytes(raw), version=(1, 1)).to_json_bytes()) \
        if b.get("version", [0])[0] >= 2 else b


def rewrite(root: Path, step: int, body: dict) -> None:
    """Write a manifest with a correct self-checksum (as a newer or a malicious writer would)."""
    body = dict(body)
    body.pop("manifest_crc32c", None)
    body["manifest_crc32c"] = crc32c.crc32c(canonical_json(body))
    mpath(root, step).write_bytes((json.dumps(body, separators=(",", ":")) + "\n").encode())


def data_file(root: Path, step: int) -> Path:
    (f,) = body(root, step)["files"]
    return root / step_dir_name(step) / f[1]


def chunk_of(root: Path, step: int, name: str) -> list:
    b = body(root, step)
    (t,) = [t for t in b["tensors"] if t["name"] == name]
    return b["storages"][t["storage"]]["chunks"][0]


def assert_step_intact(root: Path, step: int) -> None:
    got_step, st = load_state(root, step)
    assert got_step == step
    for k, v in _state(step).items():
        assert torch.equal(st["model"][k], v), k
    live = {k: torch.zeros_like(v) for k, v in _state(step).items()}
    with GDSCheckpointer(live, None, root, options=M.small_options()) as ck:
        assert ck.load(step) == step
    for k, v in _state(step).items():
        assert torch.equal(live[k], v), k


def load_latest(root: Path, **kw):
    live = {k: torch.zeros_like(v) for k, v in _state(2).items()}
    with GDSCheckpointer(live, None, root, options=M.small_options(**kw)) as ck:
        ck.load()
    return live


def test_intact(two_steps):
    assert_step_intact(two_steps, 1)
    assert_step_intact(two_steps, 2)


@pytest.mark.parametrize("name", ["model/w", "model/b", "model/i"])
def test_flipped_byte_names_file_tensor_and_range(two_steps, name):
    root = two_steps
    _, file_off, _, length, _ = chunk_of(root, 2, name)
    path = data_file(root, 2)
    pos = file_off + length // 2
    with open(path, "r+b") as f:
        f.seek(pos)
        old = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([old ^ 0x10]))
    for load in (lambda: load_state(root), lambda: load_latest(root)):
        with pytest.raises(ChecksumMismatchError) as ei:
            load()
        e = ei.value
        assert (Path(e.path), e.tensor, e.offset, e.length) == (path, name, file_off, length)
        assert e.expected != e.actual
        msg = str(e)
        assert str(path) in msg and repr(name) in msg and f"bytes [{file_off}, {file_off + length})" in msg
        assert isinstance(e, CorruptCheckpointError)

    # verify=False: loads, and the damage shows
    _, st = load_state(root, verify=False)
    key = name.split("/")[1]
    expect, got = _state(2)[key], st["model"][key]
    raw_got, raw_exp = M.raw_bytes(got), M.raw_bytes(expect)
    diff = (raw_got != raw_exp).nonzero().flatten().tolist()
    assert len(diff) == 1 and raw_got[diff[0]] == raw_exp[diff[0]] ^ 0x10
    live = load_latest(root, verify=False)
    assert not torch.equal(live[key], expect)
    assert_step_intact(root, 1)


def test_flipped_byte_in_padding_is_harmless(two_steps):
    # bytes between chunks belong to no tensor: nothing to detect, nothing damaged
    root = two_steps
    b = body(root, 2)
    ends = sorted(c[1] + c[3] for s in b["storages"] for c in s["chunks"])
    starts = sorted(c[1] for s in b["storages"] for c in s["chunks"])
    gap = next(e for e in ends if e % 4096 and e not in starts and e < b["files"][0][2])
    with open(data_file(root, 2), "r+b") as f:
        f.seek(gap)
        f.write(b"\xff")
    assert_step_intact(root, 2)


def test_truncated_data_file(two_steps):
    root = two_steps
    path = data_file(root, 2)
    size = path.stat().st_size
    os.truncate(path, size - 100)
    with pytest.raises(CorruptCheckpointError, match="truncated") as ei:
        load_state(root)
    assert str(path) in str(ei.value)
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        load_latest(root)
    os.truncate(path, 0)
    with pytest.raises(CorruptCheckpointError):
        load_state(root, 2)
    assert_step_intact(root, 1)


def test_truncated_data_file_with_lying_manifest(two_steps):
    # the manifest agrees with the short file, but the chunks need the missing bytes
    root = two_steps
    path = data_file(root, 2)
    b = body(root, 2)
    os.truncate(path, 4096)
    b["files"][0][2] = 4096
    rewrite(root, 2, b)
    with pytest.raises(CorruptCheckpointError):
        load_state(root)
    assert_step_intact(root, 1)


def test_truncated_file_error_from_the_engine(two_steps, monkeypatch):
    # bypass the size pre-check: the engine itself refuses a short file
    root = two_steps
    path = data_file(root, 2)
    real = os.path.getsize
    size = real(path)
    os.truncate(path, size - 5000)
    monkeypatch.setattr(os.path, "getsize", lambda p: size if Path(p) == path else real(p))
    with pytest.raises(TruncatedFileError) as ei:
        load_state(root)
    assert isinstance(ei.value, CorruptCheckpointError) and str(path) in str(ei.value)


def test_longer_data_file(two_steps):
    root = two_steps
    path = data_file(root, 2)
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CorruptCheckpointError, match="the manifest says"):
        load_state(root)


def test_deleted_data_file(two_steps):
    root = two_steps
    path = data_file(root, 2)
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing") as ei:
        load_state(root)
    assert str(path) in str(ei.value)
    with pytest.raises(CorruptCheckpointError, match=path.name):
        load_latest(root)
    assert_step_intact(root, 1)


@pytest.mark.parametrize("damage", ["garbage", "empty", "binary", "truncated_json", "not_a_dict", "other_format"])
def test_damaged_manifest(two_steps, damage):
    root = two_steps
    p = mpath(root, 2)
    raw = p.read_bytes()
    p.write_bytes({"garbage": b"hello world", "empty": b"", "binary": os.urandom(64) + b"\xff\xfe",
                   "truncated_json": raw[: len(raw) // 2], "not_a_dict": b"[1, 2, 3]",
                   "other_format": b'{"format": "safetensors"}'}[damage])
    with pytest.raises(CorruptCheckpointError) as ei:
        load_state(root)
    assert str(p) in str(ei.value)
    with GDSCheckpointer({"w": torch.zeros(1)}, None, root, options=M.small_options()) as ck:
        with pytest.raises(CorruptCheckpointError, match="load an earlier step"):
            ck.load()
        assert ck.steps() == [1, 2]  # still listed: the damage is reported, not hidden
    assert_step_intact(root, 1)


def test_a_huge_manifest_is_refused_before_it_is_read(two_steps, capsys):
    """A manifest.json of a terabyte (sparse here) is damage: refused by its size with a typed
    error before its bytes are read into memory, by load, by opening the root to save, and by
    the command line."""
    root = two_steps
    with open(mpath(root, 2), "r+b") as f:
        f.truncate(1 << 40)
    with pytest.raises(CorruptCheckpointError, match="more than the"):
        load_state(root)
    with GDSCheckpointer({"w": torch.zeros(1)}, None, root, options=M.small_options()) as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.load()
        assert ck.steps() == [1, 2]
    assert cli_main(["ls", str(root)]) == 1 and "DAMAGED" in capsys.readouterr().out
    assert_step_intact(root, 1)


@pytest.mark.parametrize("edit", ["step", "chunk_crc", "nbytes", "shape", "state", "metadata", "whitespace"])
def test_manifest_self_checksum(two_steps, edit):
    """1.x's checksum over the canonical JSON (the step re-written as 1.1); 2.0's over the bytes:
    tests/test_manifest_columns.py."""
    root = two_steps
    p = mpath(root, 2)
    p.write_bytes((json.dumps(body(root, 2), separators=(",", ":")) + "\n").encode())
    text = p.read_text()
    b = json.loads(text)
    if edit == "step":
        new = text.replace('"step":2,', '"step":3,')
    elif edit == "chunk_crc":
        c = b["storages"][0]["chunks"][0]
        new = text.replace(f",{c[4]}]", f",{c[4] ^ 1}]", 1)
    elif edit == "nbytes":
        n = b["storages"][1]["nbytes"]
        new = text.replace(f'"nbytes":{n},', f'"nbytes":{n - 4},', 1)
    elif edit == "shape":
        new = text.replace('"shape":[300,257]', '"shape":[257,300]')
    elif edit == "state":
        new = text.replace('["w",{"$tensor":0}]', '["w",{"$tensor":1}]')
    elif edit == "metadata":
        new = text.replace('"metadata":{}', '"metadata":{"x":1}')
    else:
        new = text.replace(",", ", ")  # harmless reformatting is fine: the checksum is over canonical JSON
    assert new != text
    p.write_text(new)
    if edit == "whitespace":
        assert_step_intact(root, 2)
        return
    with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
        load_state(root)
    assert_step_intact(root, 1)


def test_newer_major_version(two_steps):
    root = two_steps
    b = body(root, 2)
    b["version"] = [4, 0]
    rewrite(root, 2, b)
    with pytest.raises(UnsupportedFormatVersionError, match="4.0.*upgrade") as ei:
        load_state(root)
    assert not isinstance(ei.value, CorruptCheckpointError)
    with pytest.raises(UnsupportedFormatVersionError):
        load_latest(root)
    assert_step_intact(root, 1)


def test_newer_minor_version_is_read(two_steps):
    root = two_steps
    b = body(root, 2)
    b["version"] = [1, 7]
    b["some_future_field"] = {"x": 1}
    rewrite(root, 2, b)
    assert_step_intact(root, 2)


@pytest.mark.parametrize("bad", ["../x", "../" + step_dir_name(1) + "/data-r0-f0.bin", "/etc/passwd", "", ".", "..",
                                 "sub/x", "a\\b", "a\0b"])
def test_data_file_path_outside_step(two_steps, bad):
    root = two_steps
    b = body(root, 2)
    b["files"][0][1] = bad
    rewrite(root, 2, b)
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        load_state(root)
    assert_step_intact(root, 1)


@pytest.mark.parametrize("edit", ["tensor_past_storage", "unknown_dtype", "tensor_index", "chunk_gap",
                                  "chunk_past_file", "bad_file_index", "negative", "root_index", "chunk_crc"])
def test_semantically_bad_manifest_with_valid_checksum(two_steps, edit):
    root = two_steps
    b = body(root, 2)
    t0 = b["tensors"][0]
    s0 = b["storages"][t0["storage"]]
    if edit == "tensor_past_storage":
        t0["byte_offset"] = 4
    elif edit == "unknown_dtype":
        t0["dtype"] = "float128"
    elif edit == "tensor_index":
        b["state"] = {"$dict": [["model", {"$dict": [["w", {"$tensor": 99}]]}]]}
    elif edit == "chunk_gap":
        s0["chunks"][0][2] = 8
    elif edit == "chunk_past_file":
        s0["chunks"][0][1] = b["files"][0][2]
    elif edit == "bad_file_index":
        s0["chunks"][0][0] = 5
    elif edit == "negative":
        t0["stride"][0] = -1
    elif edit == "root_index":
        b["files"][0][0] = 1
    else:  # consistent manifest, wrong data checksum
        s0["chunks"][0][4] ^= 0xFFFF
    rewrite(root, 2, b)
    with pytest.raises(CorruptCheckpointError):
        load_state(root)
    assert_step_intact(root, 1)


def test_missing_step_dir_contents(two_steps):
    # a step directory without its manifest is not a committed step
    root = two_steps
    mpath(root, 2).unlink()
    with GDSCheckpointer({"w": torch.zeros(1)}, None, root, options=M.small_options()) as ck:
        assert ck.steps() == [1]
        assert ck.latest_step() == 1  # `latest` says 2, which is gone: fall back
    assert load_state(root)[0] == 1
    assert_step_intact(root, 1)


# ----------------------------------------------------------------------------- hostile manifests


TESTS = Path(__file__).resolve().parent


def hostile_checkpoint(root: Path, claim: int, *, shape=None, stride=None, data: bytes = b"\x01" * 16,
                       dtype: str = "uint8") -> Path:
    """A step 1 whose data file holds ``data`` but whose manifest (a few hundred bytes, with a
    valid self-checksum) claims ``claim`` bytes of file and storage, viewed as ``shape``/``stride``."""
    d = root / step_dir_name(1)
    d.mkdir(parents=True)
    (d / "data-r0-f0.bin").write_bytes(data)
    body = {"format": "gdswriter", "version": [1, 1], "step": 1, "created_unix": 0.0, "metadata": {},
            "files": [[0, "data-r0-f0.bin", claim]],
            "storages": [{"nbytes": claim, "chunks": [[0, 0, 0, claim, crc32c.crc32c(data)]]}],
            "tensors": [{"name": "model/w", "storage": 0, "byte_offset": 0, "dtype": dtype,
                         "shape": [claim] if shape is None else shape, "stride": [1] if stride is None else stride,
                         "device": "cpu", "kind": "tensor"}],
            "state": {"$dict": [["model", {"$dict": [["w", {"$tensor": 0}]]}]]}}
    body["manifest_crc32c"] = crc32c.crc32c(canonical_json(body))
    raw = (json.dumps(body, separators=(",", ":")) + "\n").encode()
    (d / MANIFEST_NAME).write_bytes(raw)
    return d / MANIFEST_NAME


HOSTILE_CHILD = textwrap.dedent("""
    import resource, sys, torch
    from gdswriter import CorruptCheckpointError, GDSCheckpointer, load_state
    from gdswriter.cli import main
    from gdswriter.export import export_step
    from support import models as M

    # From here on the process may map at most 1 GiB more than it has: a 3 GiB claim that reached
    # an allocation would fail with MemoryError / ENOMEM instead of CorruptCheckpointError.
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    root = sys.argv[1]
    for what, load in [("load_state", lambda: load_state(root)),
                       ("export", lambda: export_step([root], None, "safetensors", root + "/out.st")),
                       ("load", lambda: GDSCheckpointer({"w": torch.zeros(1)}, None, root,
                                                        options=M.small_options()).load())]:
        try:
            load()
        except CorruptCheckpointError as e:
            print(what, "refused:", " ".join(str(e).split()))
        else:
            print(what, "LOADED")
    print("verify rc", main(["verify", root]))
""")


@pytest.mark.parametrize("claim", [3 << 30, 1 << 40])
def test_manifest_claiming_more_than_its_files_is_refused_before_any_allocation(tmp_path, claim):
    """Issue 10: a 420-byte manifest made load_state commit 3 GiB. Sizes are checked against the
    real files first; run under RLIMIT_AS, any large allocation would fail differently."""
    root = tmp_path / "ck"
    manifest = hostile_checkpoint(root, claim)
    assert manifest.stat().st_size < 700
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]),
               GDSWRITER_BUFFER_BYTES=str(256 << 10), GDSWRITER_REQUEST_BYTES=str(64 << 10),
               GDSWRITER_NUM_BUFFERS="2")
    proc = subprocess.run([sys.executable, "-c", HOSTILE_CHILD, str(root)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for what in ("load_state", "export", "load"):
        assert f"{what} refused:" in out, out
    assert out.count(f"16 bytes on disk, {claim} needed") == 3, out
    assert "verify rc 1" in out, out


def test_hostile_sizes_reach_no_buffer_in_process(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    hostile_checkpoint(root, 3 << 30)
    asked = []
    real = reader_mod.host_buffer
    monkeypatch.setattr(reader_mod, "host_buffer", lambda n: (asked.append(n), real(n))[1])
    with pytest.raises(CorruptCheckpointError, match="16 bytes on disk, 3221225472 needed"):
        load_state(root)
    assert asked == []


@pytest.mark.parametrize("shape, stride, match", [
    ([1 << 26], [0], "expanded view larger"),                 # float32: 256 MiB presented by 16 bytes
    ([1 << 20, 1 << 20], [0, 0], "expanded view larger"),
    ([4], [1 << 63], "outside"),                             # not an int64
    ([1], [1 << 63], "outside"),                             # ... even where it moves nothing
    ([1 << 63], [0], r"2\*\*63"),
    ([1 << 40, 1 << 40, 0], [0, 0, 0], "more than 2\\*\\*63 elements"),  # torch would overflow
    ([2, 2], [1], "do not fit together"),
    ([3], [8], "past the end"),
])
def test_damaged_views_are_typed_errors(tmp_path, shape, stride, match):
    root = tmp_path / "ck"
    hostile_checkpoint(root, 16, shape=shape, stride=stride, dtype="float32")
    with pytest.raises(CorruptCheckpointError, match=match):
        load_state(root)
    with pytest.raises(CorruptCheckpointError, match=match):
        export_step([root], None, "safetensors", tmp_path / "out.st")
    assert not (tmp_path / "out.st").exists()


def test_expanded_views_within_bounds_load_and_oversized_ones_are_never_saved(tmp_path):
    small = {"mask": torch.ones(1, 8, dtype=torch.bool).expand(1024, 8), "row": torch.randn(256).expand(64, 256)}
    with GDSCheckpointer(small, None, tmp_path / "ok", options=M.small_options()) as ck:
        ck.save(1)
    _, st = load_state(tmp_path / "ok")
    for k, v in small.items():
        assert torch.equal(st["model"][k], v) and st["model"][k].stride() == v.stride(), k
    # 128 MiB presented by 4 bytes: refused at save time (a reader would refuse it), nothing committed
    big = {"w": torch.ones(3), "huge": torch.zeros(1).expand(1 << 25)}
    with GDSCheckpointer(big, None, tmp_path / "no", options=M.small_options()) as ck:
        with pytest.raises(UnsupportedObjectError, match="model/huge.*expanded view.*contiguous") as ei:
            ck.save(1)
        assert ei.value.key_path == "model/huge"
        assert ck.steps() == []


def test_manifest_of_another_step_is_refused(tmp_path):
    """A manifest copied into another step's directory must not read that step's files."""
    root = tmp_path / "ck"
    with GDSCheckpointer(_state(1), None, root, options=M.small_options()) as ck:
        ck.save(1)
        ck.save(2)
    (root / step_dir_name(2) / MANIFEST_NAME).write_bytes((root / step_dir_name(1) / MANIFEST_NAME).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="describes step 1, not 2"):
        load_state(root, 2)


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_data_file_that_is_not_a_regular_file(two_steps, tmp_path, kind):
    path = data_file(two_steps, 2)
    real = tmp_path / "elsewhere.bin"
    os.rename(path, real)
    if kind == "symlink":
        path.symlink_to(real)
    else:
        path.mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        load_state(two_steps)
    assert cli_main(["verify", str(two_steps)]) == 1
    assert_step_intact(two_steps, 1)


@pytest.mark.parametrize("how", ["listed twice", "hard link"])
def test_one_data_file_counted_twice_is_refused(two_steps, how):
    """Two file entries over the same bytes would let a manifest claim (and make a load allocate)
    a multiple of what is on disk."""
    root = two_steps
    b = body(root, 2)
    (f0,) = b["files"]
    if how == "listed twice":
        b["files"].append(list(f0))
    else:
        os.link(root / step_dir_name(2) / f0[1], root / step_dir_name(2) / "data-r0-f1.bin")
        b["files"].append([0, "data-r0-f1.bin"] + f0[2:])
    for s in b["storages"]:  # the second entry's chunks re-read the first's bytes
        s["chunks"] = [[1] + c[1:] for c in s["chunks"]] if s is b["storages"][0] else s["chunks"]
    rewrite(root, 2, b)
    match = "listed twice" if how == "listed twice" else "are the same file"
    with pytest.raises(CorruptCheckpointError, match=match):
        load_state(root)
    assert_step_intact(root, 1)


# ----------------------------------------------------------------------------- hostile multi-rank manifests
CLAIM = 256 << 20  # what the hostile manifests claim; the files hold ~1.3 MiB
GROWTH_LIMIT = CLAIM // 4


def _shards(root: Path, step: int) -> tuple[dict, list[dict]]:
    """A 1.3 step's global manifest body and its shards' bodies (one shared root)."""
    g = body(root, step)
    return g, [json.loads((root / step_dir_name(step) / name).read_bytes()) for _, name, _, _ in g["shards"]]


def _rewrite_shards(root: Path, step: int, g: dict, shards: list[dict]) -> None:
    """Write the shards and a global manifest recording their new sizes and crc32c, with a correct
    self-checksum (as a malicious writer would)."""
    for entry, sb in zip(g["shards"], shards):
        raw = (json.dumps(sb, separators=(",", ":")) + "\n").encode()
        (root / step_dir_name(step) / entry[1]).write_bytes(raw)
        entry[2], entry[3] = len(raw), crc32c.crc32c(raw)
    rewrite(root, step, g)


def inflate(root: Path, step: int, claim: int) -> None:
    """Make a multi-rank step (valid checksums) claim ``claim`` bytes for its largest storage: the
    chunk that ends both its storage and its data file grows, and so do the storage and the
    file's recorded size. The files on disk stay as they are. A 1.3 step: in every shard holding
    that item, the writer of its last piece growing its chunk and file."""
    b = body(root, step)
    if "shards" in b:
        g, shards = _shards(root, step)
        key, nbytes = max(((k, n) for sb in shards for k, n, _ in sb["items"]), key=lambda x: x[1])
        extra = claim - nbytes
        for sb in shards:
            for it in sb["items"]:
                if it[0] == key:
                    item = sb["items"].index(it)
                    it[1] += extra
                    last = [c for c in sb["chunks"] if c[0] == item and c[3] + c[4] == nbytes]
                    if last:
                        c = last[0]
                        assert c[2] + c[4] == max(x[2] + x[4] for x in sb["chunks"] if x[1] == c[1]), "ends its file"
                        c[4] += extra
                        sb["files"][c[1]][2] += extra
        _rewrite_shards(root, step, g, shards)
        return
    ends: dict[int, int] = {}
    for s in b["storages"]:
        for f, off, _, n, _ in s["chunks"]:
            ends[f] = max(ends.get(f, 0), off + n)
    s = max(b["storages"], key=lambda s: s["nbytes"])
    c = max(s["chunks"], key=lambda c: c[2])
    assert c[1] + c[3] == ends[c[0]], "the storage's last chunk ends its file"
    extra = claim - s["nbytes"]
    c[3] += extra
    s["nbytes"] += extra
    b["files"][c[0]][2] += extra
    rewrite(root, step, b)


def huge_shard(root: Path, step: int) -> None:
    """Record the largest tensor as a block of a 4 TiB global tensor (the block fits in it), in
    every shard of a 1.3 step."""
    g, shards = _shards(root, step)
    for sb in shards:
        t = max(sb["tensors"], key=lambda t: sb["items"][t[0]][1])
        t[8] = [[1 << 40] + t[4][1:], [0] * len(t[4])]
    _rewrite_shards(root, step, g, shards)


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, in bytes."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(status.split(k)[1].split()[0]) * 1024 for k in ("VmRSS:", "VmHWM:"))  # type: ignore[return-value]


def measured(fn) -> dict:
    """Run ``fn`` with the peak RSS reset first (clear_refs 5): its error type (and those it wraps:
    RankFailedError's failures, DCP's CheckpointException) and by how much the peak grew."""
    Path("/proc/self/clear_refs").write_text("5")
    before, _ = _rss()
    kind, text = "ok", ""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        inner = [x for x, _ in e.failures.values()] if hasattr(e, "failures") and isinstance(e.failures, dict) \
            and all(isinstance(v, tuple) for v in e.failures.values()) else [e]
        kind = ",".join(sorted({type(x).__name__ for x in inner}))
        text = " ".join("; ".join(str(x) for x in inner).split())[:2000]
    return {"error": kind, "text": text, "growth": _rss()[1] - before}


def _hostile_dist_worker(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: save a GDSCheckpointer step and a DCP step (a replicated 1.25 MiB tensor, split
    across both ranks' files), keep pristine copies, inflate both manifests, then load each on
    both ranks (the collective GDSCheckpointer load, dcp.load through GDSStorageReader)."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gdswriter import CheckpointOptions, GDSCheckpointer
    from gdswriter.distributed import DistOptions, GDSStorageReader, GDSStorageWriter

    tmp_p = Path(tmp)
    torch.manual_seed(0)
    model = {"w": torch.randn(512, 640)}
    with GDSCheckpointer(model, None, tmp_p / "ck", options=M.small_options(),
                         dist_options=DistOptions(timeout_s=60)) as ck:
        ck.save(1)
    dcp.save({"w": model["w"]}, storage_writer=GDSStorageWriter(tmp_p / "dcp", step=1, options=CheckpointOptions(
        engine=M.small_engine()), dist_options=DistOptions(timeout_s=60)))
    dist.barrier()
    if rank == 0:
        for name in ("ck", "dcp"):
            shutil.copytree(tmp_p / name, tmp_p / f"{name}-pristine")
            inflate(tmp_p / name, 1, CLAIM)
        shutil.copytree(tmp_p / "ck-pristine", tmp_p / "ck-shard")
        huge_shard(tmp_p / "ck-shard", 1)
    dist.barrier()
    live = {"w": torch.zeros(512, 640)}
    ck = GDSCheckpointer(live, None, tmp_p / "ck", options=M.small_options(), dist_options=DistOptions(timeout_s=60))
    out = {"ck.load": measured(ck.load)}
    out["untouched"] = not live["w"].any().item()
    ck.close()
    reader = GDSStorageReader(tmp_p / "dcp", engine_options=M.small_engine(), dist_options=DistOptions(timeout_s=60))
    out["dcp.load"] = measured(lambda: dcp.load({"w": torch.zeros(512, 640)}, storage_reader=reader))
    return out


HOSTILE_DIST_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed.checkpoint as dcp
    import gdswriter.distributed, gdswriter.distributed.dcp
    from gdswriter import GDSCheckpointer, load_state
    from gdswriter.cli import main
    from gdswriter.distributed import GDSStorageReader
    from gdswriter.export import export_step
    from support import models as M
    from test_corruption import measured

    tmp = Path(sys.argv[1])

    def readers(name):
        root = str(tmp / name)
        out = tmp / f"{name}.out"
        if name.startswith("dcp"):
            yield "dcp.load", lambda: dcp.load({"w": torch.zeros(512, 640)}, no_dist=True,
                                               storage_reader=GDSStorageReader(root, engine_options=M.small_engine()))
        else:
            ck = GDSCheckpointer({"w": torch.zeros(512, 640)}, None, root, options=M.small_options())
            yield "GDSCheckpointer.load", ck.load
            ck.close()
        yield "load_state", lambda: load_state(root)
        yield "dist.load_state", lambda: gdswriter.distributed.load_state(root)
        yield "export_step", lambda: export_step([root], None, "safetensors", f"{out}.st", overwrite=True)
        for cmd in (["verify", root], ["export", root, "--to", "torch", f"{out}.pt", "--force"], ["inspect", root]):
            yield "gdswriter " + cmd[0], lambda cmd=cmd: sys.exit(main(cmd))

    for name in ("ck-pristine", "dcp-pristine", "ck", "dcp", "ck-shard"):  # pristine first: warms every path up
        for what, fn in readers(name):
            print(json.dumps({"root": name, "reader": what, **measured(fn)}), flush=True)
""")


def test_hostile_multi_rank_manifests_are_refused_by_every_reader_before_allocating(tmp_path):
    """Issue 22, 6: a multi-rank manifest claiming far more than its files made the collective
    load and the DCP reader allocate (and populate) the claim before any check. Every reader,
    on 2 ranks and in one process, refuses the same hostile manifests with a typed error, and
    its peak memory grows by far less than the claim."""
    res = run_ranks(2, _hostile_dist_worker, str(tmp_path), out=tmp_path / "ranks")
    for rank, r in enumerate(res):
        x = r["dcp.load"]  # refused at read_metadata (dcp_reader.check_dcp_records: carried out of DCP's load
        # as CarriedError, which dcp_errors() unwraps) or, failing that, at the size check before the read
        assert x["error"] in ("TruncatedFileError", "RankFailedError", "CarriedError"), (rank, x)
        assert ("TruncatedFileError" in x["text"] or "truncated" in x["text"]
                or x["text"].startswith("CorruptCheckpointError: step 1: the record of DCP item 'w'")), (rank, x)
        x = r["ck.load"]  # a 1.3 step: the grown item no longer splits into the pieces each shard records
        assert x["error"] in ("CorruptCheckpointError", "RankFailedError"), (rank, x)
        assert "does not record exactly the pieces" in x["text"], (rank, x)
        for what in ("ck.load", "dcp.load"):
            assert r[what]["growth"] < GROWTH_LIMIT, (rank, what, r[what])
        assert r["untouched"], "the live tensor was not changed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]),
               GDSWRITER_BUFFER_BYTES=str(256 << 10), GDSWRITER_REQUEST_BYTES=str(64 << 10),
               GDSWRITER_NUM_BUFFERS="2")
    proc = subprocess.run([sys.executable, "-c", HOSTILE_DIST_CHILD, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"root"')]
    got = {(x["root"], x["reader"]): x for x in rows}
    assert len(got) == 5 * 7, proc.stdout
    for (root, what), x in got.items():
        assert x["growth"] < GROWTH_LIMIT, x  # whatever the reader and the manifest
        cli = what.startswith("gdswriter ")
        if root.endswith("pristine"):  # the readers work
            assert (x["error"], x["text"]) == ("SystemExit", "0") if cli else x["error"] == "ok", x
        elif root in ("ck", "dcp"):  # the claim is refused, before any allocation
            if cli:  # exit status 1 (corrupt); inspect shows the manifest and reads no data file
                assert (x["error"], x["text"]) == ("SystemExit", "0" if what == "gdswriter inspect" else "1"), x
            elif (root, what) == ("ck", "GDSCheckpointer.load"):  # a 2 -> 1 load reads the replicated split
                # together (distributed/reshard.py): the grown item no longer splits into the pieces
                # each shard records, refused as on 2 ranks above, before any buffer
                assert x["error"] == "CorruptCheckpointError" and "does not record exactly the pieces" in x["text"], x
            elif (root, what) == ("dcp", "dcp.load"):  # refused at read_metadata: the grown record is not the
                # chunk DCP's metadata names (dcp_reader.check_dcp_records), carried out of DCP's load as CarriedError
                assert x["error"] == "CarriedError" and x["text"].startswith(
                    "CorruptCheckpointError: step 1: the record of DCP item 'w'"), x
            else:
                assert x["error"] == "TruncatedFileError" and "655360 bytes on disk" in x["text"], x
    for what in ("GDSCheckpointer.load", "dist.load_state"):  # the readers that assemble a sharded tensor
        x = got[("ck-shard", what)]
        # load_state merges the shards and finds the block cannot fill its claim; the load plans
        # from the step's layout index, which lists no DTensor of that name (format/sharded.py)
        why = "cover 327680 of the" if what == "dist.load_state" else "the layout index does not list"
        assert x["error"] == "CorruptCheckpointError" and why in x["text"], x
