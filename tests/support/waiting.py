"""Waiting on observable state, never on a sleep of a guessed length."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["eventually"]


def eventually(
    check: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Return once ``check()`` is true; AssertionError after ``timeout`` seconds.

    Polls every 10 ms: fast enough for tests that measure nothing with it.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
