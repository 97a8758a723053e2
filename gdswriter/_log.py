"""gdswriter's logger and its one-time messages (a note that would repeat every save is said once)."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("gdswriter")
_said: set[str] = set()


def log_once(key: str, message: str | Callable[[], str], level: int = logging.WARNING) -> None:
    """Log ``message`` the first time ``key`` is seen in this process (a callable: made then only)."""
    if key not in _said:
        _said.add(key)
        log.log(level, message if isinstance(message, str) else message())
