"""Review (eleventh session): a file name in a sharded (format 1.3) manifest that JSON can
carry but no file system can name: a lone surrogate ("\\ud800"). The shard table's checks
(format/sharded.py: _shards_ok, _plain_name) let it through, and the first open of it raised
a bare UnicodeEncodeError from load_state, GDSCheckpointer.load and `gdswriter verify`: not the
typed error a damaged or hostile manifest gets. 2 real gloo ranks save; the load is local."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gdswriter import CorruptCheckpointError, load_state
from gdswriter.cli import main as cli_main
from support.ranks import run_ranks

sys.path.insert(0, str(Path(__file__).parent / "fuzz"))
import harness  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save(rank: int, world: int, root: str) -> bool:
    from gdswriter import GDSCheckpointer

    with GDSCheckpointer({"a": torch.full((1000,), float(rank))}, root=root) as ck:
        ck.save(1)
    return True


def test_a_shard_name_with_a_lone_surrogate_is_a_typed_error_everywhere(tmp_path, capsys):
    root = tmp_path / "shared"
    run_ranks(2, _save, str(root), out=tmp_path / "r")
    path = root / "step_000000000001" / "manifest.json"
    body = json.loads(path.read_bytes())
    body["shards"][1][1] = "\ud800manifest-rank00001.json"
    path.write_bytes(harness.reseal(json.dumps(body).encode()))
    with pytest.raises(CorruptCheckpointError, match="not a file name"):
        load_state(root, 1)
    capsys.readouterr()
    assert cli_main(["verify", str(root), "--all"]) == 1
    assert "step 1: CORRUPT" in capsys.readouterr().out
    assert (root / "step_000000000001" / "manifest-rank00001.json").is_file()  # nothing on disk touched
