"""The Spark progress poller with a fake status tracker: tasks over every stage seen."""

from __future__ import annotations

import io
from dataclasses import dataclass

from rich.console import Console

from clone.pipeline.progress import StageTasks
from clone.progress import Progress


@dataclass
class _Info:
    numTasks: int  # Spark's names
    numCompletedTasks: int
    numActiveTasks: int


class _Tracker:
    def __init__(self) -> None:
        self.stages: dict[int, _Info] = {}

    def getActiveStageIds(self) -> list[int]:
        return list(self.stages)

    def getStageInfo(self, stage_id: int) -> _Info | None:
        return self.stages.get(stage_id)


def test_tasks_add_up_over_stages_and_finished_stages_count_as_done() -> None:
    tracker = _Tracker()
    poll = StageTasks(tracker)
    with Progress("load", console=Console(file=io.StringIO())) as p:
        poll(p)  # nothing running yet
        assert p.total is None and p.completed == 0
        tracker.stages[0] = _Info(8, 3, 2)
        poll(p)
        assert (p.completed, p.total) == (3, 8)
        assert p.line().endswith("; stage 0 3/8 (2 running)")
        del tracker.stages[0]  # stage 0 finished between two polls
        tracker.stages[1] = _Info(4, 1, 3)
        poll(p)
        assert (p.completed, p.total) == (9, 12)
        assert p.line().endswith("; stage 1 1/4 (3 running)")
