"""Review (tenth session): defects found in files other helpers own this session, each a
reproducer marked xfail(strict=True) with its reason (the owner fixes it and drops the mark)."""

from __future__ import annotations

import json

import pytest

from support.ranks import run_ranks
from test_parity_scrub import STEP, _dcp_save, verify

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.xfail(strict=True, raises=KeyError, reason=(
    "load/verify.py _scrub_parity reads par['file'] of a parity description that format/parity.py read_stripe "
    "never checked: a description without it (damaged, hostile) crashes `gdswriter verify` with a KeyError "
    "instead of reporting the block's protection damaged (exit 3). Owner: load/verify.py or format/parity.py"))
def test_a_parity_description_without_its_file_name_is_reported_not_a_crash(tmp_path, capsys):
    run_ranks(3, _dcp_save, str(tmp_path), out=tmp_path / "save")
    roots = [tmp_path / f"node{k}" for k in range(3)]
    desc = roots[2] / STEP / "parity" / "rank00002.json"
    body = json.loads(desc.read_bytes())
    del body["parity"]["file"]
    desc.write_text(json.dumps(body))
    code, said = verify(capsys, roots)
    assert code == 3 and "rank 2's parity block" in said, said
