"""Shared test fixtures."""

from __future__ import annotations

import pytest


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
def io_fresh_log_once(monkeypatch):
    """Forget which one-time warnings were already logged, so caplog sees them again."""
    import gdswriter._log

    monkeypatch.setattr(gdswriter._log, "_said", set())  # the one-time registry: no public way to reset it
