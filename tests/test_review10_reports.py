"""Review (tenth session): defects found in files other helpers owned that session, each
reproduced here before its fix."""

from __future__ import annotations

import json

import pytest

from support.ranks import run_ranks
from test_parity_scrub import STEP, _dcp_save, verify

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_a_parity_description_without_its_own_file_name_is_reported_not_a_crash(tmp_path, capsys):
    run_ranks(3, _dcp_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"node{k}" for k in range(3)]
    desc = roots[2] / STEP / "parity" / "rank00002.json"
    body = json.loads(desc.read_bytes())
    for damaged in (None, "../../node0/" + STEP + "/manifest.json"):  # missing; a path out of parity/
        if damaged is None:
            del body["parity"]["file"]
        else:
            body["parity"]["file"] = damaged
        desc.write_text(json.dumps(body))
        code, said = verify(capsys, roots)
        assert code == 3 and "rank 2's parity block" in said, said


def test_a_parity_description_naming_a_file_outside_its_step_is_refused(tmp_path, capsys):
    """A member's data file name is joined to its step directory by a rebuild and the scrub: one
    leading out of it (damaged, hostile) makes the description damaged protection, not a read."""
    run_ranks(3, _dcp_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"node{k}" for k in range(3)]
    desc = roots[2] / STEP / "parity" / "rank00002.json"
    body = json.loads(desc.read_bytes())
    body["members"][0]["files"][0][1] = "../" + STEP + "/" + body["members"][0]["files"][0][1]
    desc.write_text(json.dumps(body))
    code, said = verify(capsys, roots)
    assert code == 3 and "rank 2's parity block" in said, said


def test_a_manifest_naming_a_data_file_the_file_system_cannot_name_is_a_typed_error(tmp_path):
    """Found by the fuzz campaign: a data file name longer than the file system allows (or one
    through a file) made the load's size check raise a bare OSError, not a typed error."""
    from gdswriter import CorruptCheckpointError
    from gdswriter.format.manifest import FileRecord
    from gdswriter.load.reader import check_file_sizes

    (tmp_path / "f").write_bytes(b"x")
    for name in ("x" * 300, "f/inside"):
        with pytest.raises(CorruptCheckpointError, match="not one gdswriter writes"):
            check_file_sizes([(tmp_path / name, FileRecord(0, name, 1))])
