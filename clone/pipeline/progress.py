"""Progress lines for long Spark jobs.

Spark's own console progress bar redraws one terminal line, which turns into
noise in a log file.  :class:`ProgressLog` instead polls the driver's status
tracker from a daemon thread and logs one line whenever the running stages
have moved on, at most every ``interval`` seconds, plus whatever the job adds
(rows written so far, from an accumulator).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["ProgressLog"]

log = logging.getLogger(__name__)


class ProgressLog:
    """Log the progress of running stages while the ``with`` block runs."""

    def __init__(
        self,
        spark: SparkSession,
        what: str,
        *,
        interval: float = 5.0,
        extra: Callable[[], str] | None = None,
    ) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._what = what
        self._interval = interval
        self._extra = extra
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{what}", daemon=True)
        self._last = ""

    def __enter__(self) -> ProgressLog:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval + 1.0)

    def line(self) -> str:
        """The current progress as one line ('' when no stage is running)."""
        parts = []
        for stage_id in sorted(self._tracker.getActiveStageIds()):
            info = self._tracker.getStageInfo(stage_id)
            if info is None:
                continue
            parts.append(
                f"stage {stage_id}: {info.numCompletedTasks}/{info.numTasks} tasks done, "
                f"{info.numActiveTasks} running"
            )
        if not parts:
            return ""
        if self._extra is not None:
            parts.append(self._extra())
        return "; ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                line = self.line()
            except Exception:  # the JVM may be shutting down under us
                log.debug("progress poll failed", exc_info=True)
                return
            if line and line != self._last:
                log.info("%s: %s", self._what, line)
                self._last = line
