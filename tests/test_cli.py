"""The gdswriter command (gdswriter/cli.py) and the exporters (gdswriter/export.py),
against real checkpoints written by GDSCheckpointer in tmp_path."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from support.timeouts import deadline

from gdswriter import GDSCheckpointer, load_state
from gdswriter.checkpointer import CheckpointOptions
from gdswriter.cli import main
from gdswriter.crc import crc32c_combine
from gdswriter.units import parse_size
from gdswriter.export import SAFETENSORS_DTYPES, UnsupportedDtypeError, write_safetensors

safetensors_torch = pytest.importorskip("safetensors.torch")

REPO = Path(__file__).resolve().parent.parent


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 32, generator=g)
    return {
        "w": w,
        "w_t": w.t(),                                   # shares w's storage, non-contiguous
        "bf": torch.randn(10, 3, generator=g).bfloat16(),
        "half": torch.randn(5, generator=g).half(),
        "ints": torch.arange(-3, 4, dtype=torch.int32),
        "long": torch.arange(7, dtype=torch.int64) * 1000,
        "mask": torch.tensor([True, False, True]),
        "u8": torch.arange(16, dtype=torch.uint8),
        "strided": torch.randn(8, 8, generator=g)[:, ::2],  # non-contiguous view
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
    }


def _expected(state) -> dict[str, torch.Tensor]:
    return {f"model/{k}": v.clone() for k, v in state.items()}


@pytest.fixture
def ckpt(tmp_path):
    """A root with steps 1 and 2; returns (root, expected {name: tensor} of step 2)."""
    root = tmp_path / "ckpts"
    state = _state()
    with GDSCheckpointer(state, root=root, state={"sched": {"epoch": 3, "lr": 0.5}}) as ck:
        ck.save(1, metadata={"epoch": 1})
        with torch.no_grad():
            state["w"].add_(1)  # step 2 differs from step 1 (w_t follows: same storage)
        ck.save(2, metadata={"epoch": 2, "note": "second"})
    return root, _expected(state)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _inspect_json(capsys, root, *extra) -> dict:
    rc, out, _ = _run(capsys, "inspect", root, "--json", *extra)
    assert rc == 0
    return json.loads(out)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


# ----------------------------------------------------------------------------- small pieces
def test_parse_size():
    assert parse_size("64M") == 64 << 20
    assert parse_size("4G") == 4 << 30
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512k") == 512 << 10
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("4096") == 4096
    for bad in ("", "x", "-1M", "0", "4Q"):
        with pytest.raises(Exception):
            parse_size(bad)


@pytest.mark.parametrize("la,lb", [(0, 9), (9, 0), (1, 1), (100, 4097), (5000, 1 << 20), (3, 3_000_001)])
def test_crc32c_combine(la, lb):
    a, b = os.urandom(la), os.urandom(lb)
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b)


def test_help_and_usage_errors(capsys):
    rc, out, _ = _run(capsys, "--help")
    assert rc == 0 and "verify" in out and "export" in out
    rc, _, err = _run(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = _run(capsys, "export", "somewhere", "out.pt")  # --to missing
    assert rc == 2


# ----------------------------------------------------------------------------- ls
def test_ls_lists_steps_sizes_and_latest(capsys, ckpt):
    root, expected = ckpt
    rc, out, err = _run(capsys, "ls", root)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [line.split()[0] for line in lines] == ["1", "2"]
    assert "latest" in lines[1] and "latest" not in lines[0]
    assert all(str(len(expected)) in line.split() for line in lines)  # tensor count
    assert all(re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", line) for line in lines)
    assert all(re.search(r"KiB|MiB", line) for line in lines)


def test_ls_json_and_several_roots(capsys, ckpt, tmp_path):
    root, expected = ckpt
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, _ = _run(capsys, "ls", root, empty, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert [s["step"] for s in doc[0]["steps"]] == [1, 2]
    assert doc[0]["latest"] == 2 and doc[0]["steps"][1]["latest"]
    assert doc[0]["steps"][0]["tensors"] == len(expected)
    step_dir = root / "step_000000000002"
    assert doc[0]["steps"][1]["bytes"] == sum(f.stat().st_size for f in step_dir.iterdir())
    assert doc[1]["steps"] == []
    rc, out, _ = _run(capsys, "ls", root, empty)
    assert f"{root}:" in out and f"{empty}:" in out and "no committed steps" in out


def test_ls_missing_root_and_damaged_manifest(capsys, ckpt, tmp_path):
    root, _ = ckpt
    rc, _, err = _run(capsys, "ls", tmp_path / "nope")
    assert rc == 2 and "does not exist" in err and "Traceback" not in err
    (root / "step_000000000001" / "manifest.json").write_text("{broken")
    rc, out, _ = _run(capsys, "ls", root)
    assert rc == 1 and "DAMAGED" in out
    assert re.search(r"^\s+2\s.*latest", out, re.M)


def test_ls_reads_a_hostile_latest_file_safely(capsys, ckpt):
    """A FIFO, or a link, planted as `latest` must neither hang nor steer `ls`: it is read like
    every small file gdswriter writes (no link followed, never blocking), and ignored."""
    root, _ = ckpt
    os.unlink(root / "latest")
    os.mkfifo(root / "latest")
    with deadline(30):
        rc, out, err = _run(capsys, "ls", root)
    assert rc == 0, err
    assert re.search(r"^\s+2\s.*latest", out, re.M) and "not committed" not in out
    os.unlink(root / "latest")
    (root / "elsewhere").write_text("7\n")
    os.symlink("elsewhere", root / "latest")
    rc, out, err = _run(capsys, "ls", root)
    assert rc == 0 and "names step 7" not in out, out
    os.unlink(root / "latest")
    (root / "latest").write_text("7\n")  # a plain file naming a step that is not committed: noted
    rc, out, _ = _run(capsys, "ls", root)
    assert "'latest' names step 7, which is not committed" in out


# ----------------------------------------------------------------------------- inspect
def test_inspect_text(capsys, ckpt):
    root, expected = ckpt
    rc, out, err = _run(capsys, "inspect", root)
    assert rc == 0, err
    assert "gdswriter 3.0" in out and "step        2 (latest)" in out
    assert '"note": "second"' in out and "data-r0-f0.bin" in out
    for name in expected:
        assert name in out
    assert re.search(r"model/bf\s+bfloat16\s+\[10, 3\]\s+60\s+data-r0-f0\.bin\[\d+, \d+\)", out)
    assert re.search(r"model/w_t .*stride \(1, 32\).*shared with model/w", out)
    rc, out, _ = _run(capsys, "inspect", root, "--step", "1")
    assert rc == 0 and "step        1 (latest is 2)" in out and '"epoch": 1' in out


def test_inspect_json_ranges_match_the_bytes(capsys, ckpt):
    root, expected = ckpt
    doc = _inspect_json(capsys, root)
    assert doc["step"] == 2 and doc["version"] == "3.0" and doc["metadata"]["epoch"] == 2
    assert doc["state_keys"] == ["model", "extra"]
    files = {f["index"]: Path(f["location"]) for f in doc["files"]}
    for t in doc["tensors"]:
        e = expected[t["name"]]
        assert t["dtype"] == str(e.dtype).removeprefix("torch.") and t["shape"] == list(e.shape)
        assert t["bytes"] == e.numel() * e.element_size()
        if t["contiguous"] and e.numel():
            (r,) = t["ranges"]
            raw = files[r["file"]].read_bytes()[r["begin"]:r["end"]]
            assert raw == e.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), t["name"]
    names = {t["name"]: t for t in doc["tensors"]}
    assert names["model/w"]["shared_with"] == ["model/w_t"] and not names["model/w_t"]["contiguous"]


def test_inspect_missing(capsys, ckpt, tmp_path):
    root, _ = ckpt
    assert _run(capsys, "inspect", tmp_path / "nope")[0] == 2
    rc, _, err = _run(capsys, "inspect", root, "--step", "99")
    assert rc == 2 and "step 99" in err and "[1, 2]" in err


# ----------------------------------------------------------------------------- verify
def test_verify_intact(capsys, ckpt):
    root, _ = ckpt
    rc, out, err = _run(capsys, "verify", root)
    assert rc == 0, out + err
    assert re.search(r"step 2: OK", out)
    rc, out, _ = _run(capsys, "verify", root, "--all")
    assert rc == 0 and "step 1: OK" in out and "step 2: OK" in out and "2 of 2 steps intact" in out


def test_verify_detects_a_flipped_byte(capsys, ckpt):
    root, _ = ckpt
    doc = _inspect_json(capsys, root)
    t = next(t for t in doc["tensors"] if t["name"] == "model/half")
    (r,) = t["ranges"]
    path = Path(doc["files"][r["file"]]["location"])
    _flip(path, r["begin"] + 3)
    rc, out, err = _run(capsys, "verify", root)
    assert rc == 1, out + err
    assert str(path) in out and "'model/half'" in out
    assert f"bytes [{r['begin']}, {r['begin'] + 10})" in out
    assert "CORRUPT (1 problem)" in out
    # --all: step 1 is intact, step 2 corrupt -> 1
    rc, out, _ = _run(capsys, "verify", root, "--all")
    assert rc == 1 and "step 1: OK" in out and "1 corrupt" in out
    rc, out, _ = _run(capsys, "verify", root, "--step", "1")
    assert rc == 0


def test_verify_all_reports_every_step_on_one_line(capsys, tmp_path):
    """`verify --all`: one line per step, OK or CORRUPT with the first problem; exit 1 if any is
    corrupt (the way to find the newest intact step when the latest is damaged)."""
    root = tmp_path / "ck"
    state = {"a": torch.randn(2000), "b": torch.randn(3000)}
    with GDSCheckpointer(state, root=root) as ck:
        for step in (1, 2, 3, 4):
            state["a"].add_(1)
            ck.save(step)
    doc = _inspect_json(capsys, root, "--step", "2")
    for t in doc["tensors"]:  # two problems in step 2: both tensors damaged
        (r,) = t["ranges"]
        _flip(Path(doc["files"][r["file"]]["location"]), r["begin"] + 7)
    (root / "step_000000000003" / "manifest.json").write_bytes(b"{not json")
    rc, out, _ = _run(capsys, "verify", root, "--all")
    assert rc == 1, out
    lines = out.splitlines()
    per_step = {s: [x for x in lines if x.startswith(f"step {s}:")] for s in (1, 2, 3, 4)}
    assert all(len(v) == 1 for v in per_step.values()), out
    assert per_step[1][0].startswith("step 1: OK") and per_step[4][0].startswith("step 4: OK")
    assert re.match(r"step 2: CORRUPT: .*data-r0-f0.bin bytes \[.*crc32c expected .*'model/a'.* \(\+1 more problem\)$",
                    per_step[2][0]), per_step[2][0]
    assert "step 3: CORRUPT: " in per_step[3][0] and "not valid JSON" in per_step[3][0]
    assert lines[-1] == "2 of 4 steps intact, 2 corrupt"


def test_verify_names_every_tensor_of_a_shared_storage(capsys, ckpt):
    root, _ = ckpt
    doc = _inspect_json(capsys, root)
    t = next(t for t in doc["tensors"] if t["name"] == "model/w")
    (r,) = t["ranges"]
    _flip(Path(doc["files"][r["file"]]["location"]), r["begin"] + 100)
    rc, out, _ = _run(capsys, "verify", root)
    assert rc == 1 and "'model/w'" in out and "'model/w_t'" in out


def test_verify_missing_root_or_step(capsys, ckpt, tmp_path):
    root, _ = ckpt
    rc, _, err = _run(capsys, "verify", tmp_path / "nope")
    assert rc == 2 and "does not exist" in err
    rc, _, err = _run(capsys, "verify", root, "--step", "5")
    assert rc == 2 and "no committed checkpoint for step 5" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(capsys, "verify", empty, "--all")[0] == 2
    assert _run(capsys, "verify", root, "--step", "1", "--all")[0] == 2  # mutually exclusive


def test_verify_damaged_manifest_truncated_and_missing_files(capsys, ckpt):
    root, _ = ckpt
    m = root / "step_000000000001" / "manifest.json"
    m.write_bytes(m.read_bytes().replace(b'"epoch":1', b'"epoch":7'))
    rc, out, _ = _run(capsys, "verify", root, "--step", "1")
    assert rc == 1 and "checksum does not match" in out
    data = root / "step_000000000002" / "data-r0-f0.bin"
    os.truncate(data, 5000)
    rc, out, _ = _run(capsys, "verify", root)
    assert rc == 1 and "is 5000 bytes" in out and "past the end" in out
    data.unlink()
    rc, out, _ = _run(capsys, "verify", root)
    assert rc == 1 and "missing" in out and str(data) in out


def test_verify_reads_big_chunks_in_pieces_with_bounded_scratch(capsys, tmp_path):
    """A 1 MiB tensor split over 3 files, verified with a 16 KiB scratch buffer: chunks are
    read in pieces and their crc32c combined; a flip deep inside is still found."""
    root = tmp_path / "big"
    big = torch.randn(256, 1024)  # 1 MiB
    opts = CheckpointOptions(files_per_root=3)
    with GDSCheckpointer({"big": big, "small": torch.ones(3)}, root=root, options=opts) as ck:
        ck.save(5)
    rc, out, _ = _run(capsys, "verify", root, "--scratch", "16K")
    assert rc == 0 and "3 files" in out
    doc = _inspect_json(capsys, root)
    t = next(t for t in doc["tensors"] if t["name"] == "model/big")
    assert len(t["ranges"]) == 3  # spread over the three files
    r = t["ranges"][1]
    _flip(Path(doc["files"][r["file"]]["location"]), r["begin"] + 200_000)
    rc, out, _ = _run(capsys, "verify", root, "--scratch", "16K")
    assert rc == 1 and "'model/big'" in out and "data-r0-f1.bin" in out


def test_verify_several_roots(capsys, tmp_path):
    r0, r1 = tmp_path / "ssd0", tmp_path / "ssd1"
    with GDSCheckpointer({"a": torch.randn(1000), "b": torch.randn(3000)}, root=[r0, r1]) as ck:
        ck.save(3)
    rc, _, err = _run(capsys, "verify", r0)
    assert rc == 2 and "--secondary" in err
    rc, out, _ = _run(capsys, "verify", r0, "--secondary", r1)
    assert rc == 0, out
    rc, out, _ = _run(capsys, "ls", r1)
    assert rc == 0 and "secondary root of" in out
    rc, _, err = _run(capsys, "export", r0, "--to", "torch", tmp_path / "m.pt")
    assert rc == 2 and "--secondary" in err
    rc, _, err = _run(capsys, "export", r0, "--secondary", r1, "--to", "torch", tmp_path / "m.pt")
    assert rc == 0, err
    assert set(torch.load(tmp_path / "m.pt", weights_only=True)) == {"model/a", "model/b"}
    _flip(r1 / "step_000000000003" / "data-r1-f0.bin", 10)
    rc, out, _ = _run(capsys, "verify", r0, "--secondary", r1)
    assert rc == 1 and "data-r1-f0.bin" in out


# ----------------------------------------------------------------------------- export
def test_export_torch_weights_only(capsys, ckpt, tmp_path):
    root, expected = ckpt
    out = tmp_path / "model.pt"
    rc, text, err = _run(capsys, "export", root, "--step", "2", "--to", "torch", out)
    assert rc == 0, err
    assert "exported step 2" in text
    loaded = torch.load(out, weights_only=True)
    assert set(loaded) == set(expected)
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    # sharing and strides survive a torch export
    assert loaded["model/w_t"].untyped_storage().data_ptr() == loaded["model/w"].untyped_storage().data_ptr()
    assert loaded["model/w_t"].stride() == (1, 32)
    # step 1 differs
    out1 = tmp_path / "step1.pt"
    assert _run(capsys, "export", root, "--step", "1", "--to", "torch", out1)[0] == 0
    assert torch.allclose(torch.load(out1, weights_only=True)["model/w"], expected["model/w"] - 1, atol=1e-6)


def test_export_safetensors_read_by_the_safetensors_package(capsys, ckpt, tmp_path):
    root, expected = ckpt
    out = tmp_path / "model.safetensors"
    rc, _, err = _run(capsys, "export", root, "--to", "safetensors", out)
    assert rc == 0, err
    loaded = safetensors_torch.load_file(str(out))
    assert set(loaded) == set(expected)
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape and torch.equal(loaded[k], v), k
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["gdswriter_step"] == "2" and json.loads(meta["gdswriter_metadata"])["note"] == "second"
    assert meta["format"] == "pt"
    # the header is 8-byte aligned and the data is packed exactly
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and raw[8 + n - 1:8 + n] in (b" ", b"}")
    header = json.loads(raw[8:8 + n])
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[-1][1] == len(raw) - 8 - n


def test_export_refuses_to_overwrite(capsys, ckpt, tmp_path):
    root, _ = ckpt
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"precious")
    for fmt in ("torch", "safetensors"):
        rc, _, err = _run(capsys, "export", root, "--to", fmt, out)
        assert rc == 2 and "exists" in err and "--force" in err
        assert out.read_bytes() == b"precious"
    rc, _, _ = _run(capsys, "export", root, "--to", "safetensors", out, "--force")
    assert rc == 0 and len(safetensors_torch.load_file(str(out))) > 0
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_export_missing_and_unsupported(capsys, ckpt, tmp_path):
    root, _ = ckpt
    assert _run(capsys, "export", tmp_path / "nope", "--to", "torch", tmp_path / "a.pt")[0] == 2
    assert _run(capsys, "export", root, "--step", "9", "--to", "torch", tmp_path / "a.pt")[0] == 2
    assert not (tmp_path / "a.pt").exists()
    croot = tmp_path / "complex"
    with GDSCheckpointer({"z": torch.randn(4, dtype=torch.complex128)}, root=croot) as ck:
        ck.save(1)
    rc, _, err = _run(capsys, "export", croot, "--to", "safetensors", tmp_path / "z.safetensors")
    assert rc == 2 and "complex128" in err and "--to torch" in err
    assert not (tmp_path / "z.safetensors").exists()
    assert _run(capsys, "export", croot, "--to", "torch", tmp_path / "z.pt")[0] == 0


def test_export_corrupt_checkpoint_fails_with_1(capsys, ckpt, tmp_path):
    root, _ = ckpt
    _flip(root / "step_000000000002" / "data-r0-f0.bin", 7)
    rc, _, err = _run(capsys, "export", root, "--to", "torch", tmp_path / "c.pt")
    assert rc == 1 and "checksum mismatch" in err and not (tmp_path / "c.pt").exists()


def test_export_nested_torch(capsys, ckpt, tmp_path):
    root, expected = ckpt
    out = tmp_path / "nested.pt"
    rc, _, err = _run(capsys, "export", root, "--to", "torch", "--nested", out)
    assert rc == 0, err
    state = torch.load(out, weights_only=True)
    assert state["extra"]["sched"] == {"epoch": 3, "lr": 0.5}
    assert torch.equal(state["model"]["bf"], expected["model/bf"])
    # numpy arrays in the state are not weights_only-loadable: refused, nothing left behind
    nroot = tmp_path / "np"
    with GDSCheckpointer({"a": torch.ones(2)}, root=nroot, state={"x": {"arr": np.arange(3)}}) as ck:
        ck.save(1)
    rc, _, err = _run(capsys, "export", nroot, "--to", "torch", "--nested", tmp_path / "np.pt")
    assert rc == 2 and "weights_only" in err and not (tmp_path / "np.pt").exists()
    assert _run(capsys, "export", nroot, "--to", "safetensors", "--nested", tmp_path / "n.st")[0] == 2


def _bytes(t: torch.Tensor) -> list[int]:
    same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(same).contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype", sorted(SAFETENSORS_DTYPES, key=str), ids=str)
def test_write_safetensors_every_dtype(tmp_path, dtype):
    raw = torch.arange(96, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    t = raw.view(dtype).reshape(4, -1)
    tensors = {"t": t, "t_slice": t[:, 1:], "zero_d": t[1, 1], "empty": t[:0]}
    if dtype == getattr(torch, "float4_e2m1fn_x2", None):  # packed pairs: no 0-d form in safetensors
        with pytest.raises(UnsupportedDtypeError, match="0-d"):
            write_safetensors(tmp_path / "y.safetensors", {"zero_d": tensors.pop("zero_d")})
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"k": "v"})
    got = safetensors_torch.load_file(str(path))
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert _bytes(got[k]) == _bytes(v), k


def test_write_safetensors_shared_and_noncontiguous_are_copies(tmp_path):
    base = torch.randn(6, 4)
    tensors = {"base": base, "t": base.t(), "row": base[2], "every_other": base[::2, ::2]}
    path = tmp_path / "s.safetensors"
    write_safetensors(path, tensors)
    got = safetensors_torch.load_file(str(path))
    for k, v in tensors.items():
        assert torch.equal(got[k], v) and got[k].is_contiguous()
    with pytest.raises(Exception, match="exists"):
        write_safetensors(path, tensors)


# ----------------------------------------------------------------------------- subprocess
def _cli(*argv, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gdswriter.cli", *map(str, argv)], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_subprocess_exit_codes_and_one_line_errors(ckpt, tmp_path):
    root, expected = ckpt
    p = _cli("ls", root)
    assert p.returncode == 0 and "latest" in p.stdout
    p = _cli("verify", root, "--all")
    assert p.returncode == 0 and "step 2: OK" in p.stdout
    p = _cli("verify", tmp_path / "missing")
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = _cli("export", root, "--to", "safetensors", tmp_path / "sub.safetensors")
    assert p.returncode == 0, p.stderr
    got = safetensors_torch.load_file(str(tmp_path / "sub.safetensors"))
    assert torch.equal(got["model/strided"], expected["model/strided"])
    _flip(root / "step_000000000002" / "data-r0-f0.bin", 1)
    p = _cli("verify", root)
    assert p.returncode == 1 and "data-r0-f0.bin" in p.stdout and "Traceback" not in p.stderr


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "gdswriter"
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "gdswriter" in p.stdout


# ----------------------------------------------------------------------------- demo
def test_demo_small(capsys, tmp_path):
    rc, out, err = _run(capsys, "demo", "--size", "64M", "--dir", tmp_path, "--ckpt-size", "8M", "--engine", "auto")
    assert rc == 0, out + err
    assert "engine" in out and "direct I/O" in out
    assert re.search(r"gdswriter engine \(\w+\)\s+\d+\.\d\d\s+\d+\.\d\d", out)
    assert re.search(r"needs\s+\d.* free here .* moves .* through the disk: .* at 1 GB/s", out)
    fio = shutil.which("fio") is not None
    ceiling = "fio io_uring, QD16, 4 MiB" if fio else "built-in: 8 threads x 4 MiB"
    assert re.search(r"ceiling: " + re.escape(ceiling) + r".*\s+\d+\.\d\d\s+\d+\.\d\d", out), out
    assert re.search(r"engine / ceiling\s+\d+%\s+\d+%", out), out
    assert "GB/s" in out and "crc32c" in out and ": ok" in out
    assert re.search(r"save \(durable \+ committed\)\s+\d+\.\d\d", out)
    assert "loaded tensors equal the saved ones: ok" in out
    assert list(tmp_path.iterdir()) == []  # everything removed


def test_demo_subprocess_posix_without_fio(tmp_path):
    p = _cli("demo", "--size", "8M", "--ckpt-size", "1M", "--engine", "posix", "--no-fio", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gdswriter engine (posix)" in p.stdout
    assert "ceiling     built-in: 8 threads x 4 MiB O_DIRECT pwrite/preadv (--no-fio)" in p.stdout, p.stdout
    assert re.search(r"engine / ceiling\s+\d+%\s+\d+%", p.stdout), p.stdout
    assert list(tmp_path.iterdir()) == []  # the default --dir is a temporary directory under the cwd, removed


def test_demo_without_fio_installed_uses_the_builtin_ceiling(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no fio on PATH
    rc, out, err = _run(capsys, "demo", "--size", "16M", "--dir", tmp_path / "d", "--ckpt-size", "1M")
    assert rc == 0, out + err
    assert "fio not installed (optional)" in out
    assert "ceiling     built-in: 8 threads x 4 MiB O_DIRECT pwrite/preadv (fio is not installed; it is optional)" in out


def test_demo_refuses_without_free_space(capsys, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 10 << 20))
    rc, _, err = _run(capsys, "demo", "--size", "64M", "--dir", tmp_path / "d")
    assert rc == 2 and "not enough free space" in err and "--size" in err
    assert not (tmp_path / "d").exists()
    rc, _, err = _run(capsys, "demo", "--size", "lots")
    assert rc == 2 and "not understood" in err


# ----------------------------------------------------------------------------- docs/format.md
def test_format_doc_reading_recipe_matches_load_state(ckpt):
    """The "reading a checkpoint without gdswriter" recipe in docs/format.md works."""
    root, expected = ckpt
    text = (REPO / "docs" / "format.md").read_text()
    section = text[text.index("## 8. Reading a checkpoint without gdswriter"):text.index("## 9.")]
    ns: dict = {}
    for code in re.findall(r"```python\n(.*?)```", section, re.S):
        exec(compile(code, "docs/format.md", "exec"), ns)
    step, state, manifest = ns["read_checkpoint"]([str(root)])
    assert step == 2 and manifest["version"] == [3, 0]
    _, ref = load_state(root)
    assert state["extra"]["sched"] == {"epoch": 3, "lr": 0.5}
    for k, v in ref["model"].items():
        got = state["model"][k]
        want = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
        assert got.shape == want.shape and np.array_equal(got, want), k
    # shared storage stays shared
    assert np.shares_memory(state["model"]["w"], state["model"]["w_t"])


def test_format_doc_manifest_keys_match_the_code(ckpt):
    """Every top-level manifest key and tensor-record key is documented."""
    root, _ = ckpt
    text = (REPO / "docs" / "format.md").read_text()
    m = json.loads((root / "step_000000000002" / "manifest.json").read_text())
    for key in m:
        assert f"`{key}`" in text, key
    for key in (*m["tensors"], *m["storages"]):  # format 2.0's columns
        assert f"`{key}`" in text, key
    from gdswriter.format.state_codec import _TAGS

    for tag in _TAGS:
        assert f'"{tag}"' in text, tag
