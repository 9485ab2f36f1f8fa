"""Progress of long Spark jobs, in tasks, through :mod:`clone.progress`.

Spark's own console bar is off (``spark.ui.showConsoleProgress``): it redraws a
line even in a log file.  :func:`stage_progress` instead polls the driver's
status tracker from the progress thread and counts tasks over every stage the
job has run so far (a stage that left the active list counts as done), so the
bar or the log line shows done/total tasks, rate and ETA, and the running
stages as the status.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clone.progress import Progress

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["StageTasks", "stage_progress"]


class StageTasks:
    """Tasks done and to do over the stages seen by successive polls."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self._stages: dict[int, tuple[int, int]] = {}  # stage id -> (done, total)

    def __call__(self, progress: Progress) -> None:
        active = sorted(self._tracker.getActiveStageIds())
        for stage_id, (_, total) in list(self._stages.items()):
            if stage_id not in active:
                self._stages[stage_id] = (total, total)
        running = []
        for stage_id in active:
            info = self._tracker.getStageInfo(stage_id)
            if info is None:
                continue
            self._stages[stage_id] = (info.numCompletedTasks, info.numTasks)
            running.append(
                f"stage {stage_id} {info.numCompletedTasks}/{info.numTasks}"
                f" ({info.numActiveTasks} running)"
            )
        if self._stages:
            progress.update(
                sum(d for d, _ in self._stages.values()),
                total=sum(t for _, t in self._stages.values()),
                status=", ".join(running),
            )


def stage_progress(spark: SparkSession, what: str, **kwargs: Any) -> Progress:
    """A :class:`~clone.progress.Progress` of ``what`` fed by Spark's status tracker."""
    return Progress(
        what, unit="tasks", poll=StageTasks(spark.sparkContext.statusTracker()), **kwargs
    )
