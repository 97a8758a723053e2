"""Review (eleventh session): data file names with a lone surrogate (valid JSON, no bytes as a
file name) in a single-process manifest and a parity description: typed errors and verify's
reports, not a bare UnicodeEncodeError (fs.name_problem)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gdswriter import CorruptCheckpointError, GDSCheckpointer, load_state
from gdswriter.cli import main as cli_main

sys.path.insert(0, str(Path(__file__).parent / "fuzz"))
import harness  # noqa: E402

LONE = "\ud800data.bin"  # valid JSON ("\\ud800..."), no file name: a lone surrogate has no bytes


def _named(tmp_path: Path) -> Path:
    """A committed single-process step whose manifest names its data file LONE (resealed)."""
    with GDSCheckpointer({"a": torch.randn(1000)}, root=tmp_path) as ck:
        ck.save(1)
    path = tmp_path / "step_000000000001" / "manifest.json"
    body = json.loads(path.read_bytes())
    body["files"][0][1] = LONE
    path.write_bytes(harness.reseal(json.dumps(body).encode()))
    return tmp_path


def test_a_data_file_name_with_a_lone_surrogate_is_a_typed_error_on_load(tmp_path):
    root = _named(tmp_path)
    with pytest.raises(CorruptCheckpointError):
        load_state(root, 1)
    with pytest.raises(CorruptCheckpointError):
        with GDSCheckpointer({"a": torch.zeros(1000)}, root=root) as ck:
            ck.load(1)


def test_a_data_file_name_with_a_lone_surrogate_is_reported_by_verify(tmp_path, capsys):
    assert cli_main(["verify", str(_named(tmp_path)), "--all"]) == 1
    assert "step 1: CORRUPT" in capsys.readouterr().out


def test_a_parity_description_naming_a_file_with_a_lone_surrogate_is_reported(tmp_path, capsys):
    from support.ranks import run_ranks
    from test_parity_scrub import STEP, _dcp_save, verify

    run_ranks(3, _dcp_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"node{k}" for k in range(3)]
    desc = roots[2] / STEP / "parity" / "rank00002.json"
    body = json.loads(desc.read_bytes())
    body["members"][0]["files"][0][1] = "\ud800" + body["members"][0]["files"][0][1]
    desc.write_text(json.dumps(body))
    code, said = verify(capsys, roots)
    assert code == 3 and "rank 2's parity block" in said, said
