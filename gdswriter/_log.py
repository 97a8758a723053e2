"""gdswriter's logger and its one-time messages (a note that would repeat every save is said once)."""

from __future__ import annotations

import logging

log = logging.getLogger("gdswriter")
_said: set[str] = set()


def log_once(key: str, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    if key not in _said:
        _said.add(key)
        log.log(level, message)
