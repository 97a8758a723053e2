"""The package's face: one version, typing marker shipped, the old module name of the
multi-rank package still importable (with a DeprecationWarning)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

import gdswriter


def test_the_version_is_written_once():
    from gdswriter._version import __version__

    assert gdswriter.__version__ == __version__ == importlib.metadata.version("gdswriter")


def test_the_package_ships_its_typing_marker():
    assert (Path(gdswriter.__file__).parent / "py.typed").is_file()


def test_the_old_name_of_the_multi_rank_package_still_imports_and_warns():
    sys.modules.pop("gdswriter.dist", None)
    with pytest.warns(DeprecationWarning, match="gdswriter.distributed"):
        from gdswriter.dist import GDSStorageWriter
    assert GDSStorageWriter is gdswriter.GDSStorageWriter
    with pytest.raises(ImportError):
        from gdswriter.dist import nothing_of_that_name  # noqa: F401


def _modules_after(code: str) -> set[str]:
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_import_gdswriter_loads_no_tool_cli_multi_rank_module_nor_torch():
    loaded = _modules_after("import gdswriter")
    ours = {m for m in loaded if m.startswith("gdswriter")}
    assert ours <= {"gdswriter", "gdswriter._version", "gdswriter.errors"}, ours
    assert "torch" not in loaded


def test_the_checkpointer_loads_no_tool_cli_or_integration_module():
    loaded = _modules_after("from gdswriter import GDSCheckpointer, load_state")
    above = [m for m in loaded if m.startswith(("gdswriter.tools", "gdswriter.commands", "gdswriter.cli",
                                                "gdswriter.integrations", "gdswriter.testing"))]
    assert above == []


def test_a_single_process_checkpointer_loads_no_multi_rank_module(tmp_path):
    """Constructing, saving and loading in one process (no torch.distributed init) never imports
    gdswriter.distributed: the session is chosen without it (gdswriter/session.py)."""
    loaded = _modules_after(f"""
import torch
from gdswriter import GDSCheckpointer
ck = GDSCheckpointer({{"w": torch.ones(8)}}, None, {str(tmp_path)!r})
ck.save(1)
assert ck.load() == 1
ck.close()""")
    assert "gdswriter.checkpointer" in loaded and "gdswriter.session" in loaded
    assert [m for m in loaded if m.startswith("gdswriter.distributed") or m == "gdswriter.dist"] == []


def test_both_sessions_have_what_the_checkpointer_asks_of_a_session():
    import inspect

    from gdswriter.distributed.session import DistSession
    from gdswriter.session import LocalSession, Session

    asked = {n: inspect.signature(f) for n, f in vars(Session).items() if inspect.isfunction(f) and n[0] != "_"}
    assert {"prepare", "write_and_commit", "apply_retention", "load", "close"} <= set(asked)
    for impl in (LocalSession, DistSession):
        for name, sig in asked.items():
            assert list(inspect.signature(getattr(impl, name)).parameters) == list(sig.parameters), (impl, name)


def test_the_save_handle_types_keep_their_names():
    from gdswriter import SaveHandle, SaveStats
    from gdswriter.checkpointer import SaveHandle as from_checkpointer

    assert SaveHandle is from_checkpointer and SaveStats.__module__ == "gdswriter.save.handle"


def test_the_benchmark_names_moved_to_tools_and_still_resolve_with_a_warning():
    from gdswriter.tools.bench import run_bench

    with pytest.warns(DeprecationWarning, match="gdswriter.tools.bench"):
        assert gdswriter.run_bench is run_bench
    assert "run_bench" not in gdswriter.__all__
