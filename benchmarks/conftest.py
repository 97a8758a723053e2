"""pytest plumbing of the benchmark suites (see README.md).

* Collects ``bench_*.py`` in this directory with plain ``pytest benchmarks/`` (pytest's
  default ``python_files`` would skip them, and ``python_files`` cannot be set from a
  conftest): ``pytest_collect_file`` below turns them into test modules.
* Parametrizes every test that takes ``size`` over GDSWRITER_BENCH_SIZES at module scope,
  so that all cases of one size run together and share their per-size fixtures (source
  data, model, files), which are freed before the next size starts.
* Orders the run: bench_engine.py first (its raw engine bandwidth is a reference for
  bench_checkpoint.py), then by size, then by each module's ``bench_sort_key``
  (references before gdswriter, so that in-test ratios can be computed).
* ``bench_root``: one fresh directory for the whole session under GDSWRITER_BENCH_DIR
  (default benchmarks/.bench-tmp/), removed at the end.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _util  # noqa: E402

_MODULE_ORDER = ["bench_engine.py", "bench_checkpoint.py"]


def _sizes() -> list[_util.BenchSize]:
    try:
        return _util.bench_sizes()
    except ValueError as e:
        raise pytest.UsageError(f"GDSWRITER_BENCH_SIZES: {e}") from None


def pytest_collect_file(file_path: Path, parent):
    if file_path.suffix != ".py" or not fnmatch.fnmatch(file_path.name, "bench_*.py"):
        return None
    if parent.session.isinitpath(file_path):
        return None  # named on the command line: pytest's python plugin collects it already
    if any(fnmatch.fnmatch(file_path.name, p) for p in parent.config.getini("python_files")):
        return None  # e.g. run with -o python_files=bench_*.py: already collected
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_generate_tests(metafunc):
    if "size" in metafunc.fixturenames:
        sizes = _sizes()
        metafunc.parametrize("size", sizes, ids=[s.label for s in sizes], scope="module")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    labels = [s.label for s in _sizes()]

    def key(pair):
        index, item = pair
        mod = item.module if hasattr(item, "module") else None
        name = os.path.basename(str(getattr(item, "path", "")))
        if name not in _MODULE_ORDER or mod is None:
            return (len(_MODULE_ORDER), 0, (), index)
        spec = getattr(item, "callspec", None)
        size = spec.params.get("size") if spec else None
        srank = labels.index(size.label) if size is not None and size.label in labels else 0
        sub = mod.bench_sort_key(item) if hasattr(mod, "bench_sort_key") else ()
        return (_MODULE_ORDER.index(name), srank, sub, index)

    items[:] = [it for _, it in sorted(enumerate(items), key=key)]


@pytest.fixture(scope="session")
def bench_root() -> Path:
    base = _util.bench_base_dir()
    kind = _util.fs_type(base if base.exists() else base.parent)
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"GDSWRITER_BENCH_DIR={base} is on {kind} (memory, no O_DIRECT): point it at a directory "
                    f"on the disk under test")
    created_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if created_base:
            try:
                base.rmdir()
            except OSError:
                pass


@pytest.fixture(scope="module")
def workdir(bench_root, size, request):
    """The suite's directory for one size (the module's SUITE names it), removed after the size."""
    with _util.size_workdir(bench_root, size, request.module.SUITE) as d:
        yield d


@pytest.fixture(scope="session")
def rounds() -> int:
    try:
        return _util.bench_rounds()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config):
    try:
        sizes = ",".join(s.label for s in _util.bench_sizes())
        base = _util.bench_base_dir()
        probe = base if base.exists() else base.parent
        return (f"gdswriter benchmarks: sizes={sizes} rounds={_util.bench_rounds()} dir={base} "
                f"({_util.fs_type(probe) or '?'}), fio={_util.fio_path() or 'not installed'}; "
                f"{_util.torch_cpu_placement(probe)}")
    except Exception as e:  # a bad environment variable is reported by the tests themselves
        return f"gdswriter benchmarks: {e}"
