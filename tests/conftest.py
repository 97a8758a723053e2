"""Shared test fixtures. Shared helpers live in tests/support/ (no test module imports another)."""

from __future__ import annotations

import pytest

# Helpers in tests/support assert too: rewrite them, as pytest does for test modules, so that
# their failures show the values compared.
pytest.register_assert_rewrite("support")


# --- the compiled part and its Python twin (test_native_gather.py, test_load_views.py) ---
@pytest.fixture(params=["native", "python"])
def crc_path(request, monkeypatch):
    """Each test twice: through the compiled gdswriter._gather (skipped where the install built
    none), and with GDSWRITER_NATIVE=0 through Python; the status says which runs."""
    from gdswriter import crc

    if request.param == "native":
        if crc.native_status().startswith("pure Python (the compiled"):
            pytest.skip("gdswriter._gather was not built (no C compiler at install)")
        monkeypatch.delenv(crc.NATIVE_ENV, raising=False)
        assert crc.native_status().startswith("compiled")
    else:
        monkeypatch.setenv(crc.NATIVE_ENV, "0")
        assert crc.native_status().startswith("pure Python")
    return request.param


# --- I/O engine tests (test_engine_contract.py, test_engine_faults.py, test_uring.py) ---
@pytest.fixture
def io_small_options():
    """Factory of small EngineOptions (256 KiB buffers, 64 KiB requests, 3 buffers: the
    whole pool is 768 KiB, so "larger than the pool" stays cheap)."""
    from gdswriter.options import EngineOptions, KiB

    def make(**overrides) -> EngineOptions:
        kw = dict(buffer_bytes=256 * KiB, request_bytes=64 * KiB, num_buffers=3, queue_depth=16)
        kw.update(overrides)
        return EngineOptions(**kw)

    return make


@pytest.fixture
def io_fresh_log_once():
    """Forget which one-time warnings were already logged, so caplog sees them again."""
    from gdswriter.testing import log_once_forgotten

    with log_once_forgotten():
        yield


@pytest.fixture(autouse=True)
def _no_kept_snapshot_pool():
    """Each test starts without the host snapshot pool an earlier test's checkpointer left to the
    process (save/pool.py keeps one for the process's life): pool sizes are each test's own."""
    yield
    import sys

    pool = sys.modules.get("gdswriter.save.pool")  # imported only by the tests that save
    if pool is not None:
        pool.release_kept_pool()


# --- simulated nodes (test_nodes_harness.py, test_node_scenarios.py, test_parity.py) ---
@pytest.fixture
def cluster(tmp_path):
    """A factory of namespace Clusters (support/nodes.py) under tmp_path; every node's namespace
    is killed at the end, whatever happened."""
    from support.nodes import Cluster

    made: list = []

    def make(nodes: int, ranks_per_node: int = 1) -> Cluster:
        made.append(Cluster(tmp_path / f"cluster{len(made)}", nodes=nodes, ranks_per_node=ranks_per_node))
        return made[-1]

    yield make
    for c in made:
        c.close()
