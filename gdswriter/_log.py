"""gdswriter's logger and its one-time messages (a note that would repeat every save is said once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("gdswriter")
_said: set[str] = set()


def log_once(key: str, message: str | Callable[[], str], level: int = logging.WARNING) -> None:
    """Log ``message`` the first time ``key`` is seen in this process (a callable: made then only)."""
    if key not in _said:
        _said.add(key)
        log.log(level, message if isinstance(message, str) else message())


@contextmanager
def log_once_forgotten() -> Iterator[None]:
    """Within the block, every one-time message is said again, once (tests that check one use
    this, whichever test said it before); the messages said before count again afterwards."""
    global _said
    saved, _said = _said, set()
    try:
        yield
    finally:
        _said = saved
