"""Rate-limited logging for bad input.

A peer that sends garbage in a tight loop must not flood the operator's log or
slow the reactor down with formatting: one line per kind of problem per
interval, and the next line says how many were held back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["LOG_INTERVAL", "Throttle"]

LOG_INTERVAL = 10.0  # seconds between two log lines of the same kind


class Throttle:
    """One log line per kind per interval, with a count of what was held back."""

    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float],
        interval: float = LOG_INTERVAL,
    ) -> None:
        self._logger = logger
        self._clock = clock
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, kind: str, level: int, msg: str, *args: object) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        if held:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, held, self._interval)
        self._last[kind] = now
        self._logger.log(level, msg, *args)
