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
