"""How long the collector may drain so that draining *and* committing fit one turn.

Why: a collector turn receives updates until :data:`~clone.server.shared.TURN_BUDGET`
runs out, then commits them in one transaction and publishes them.  The budget
used to bound the receiving only: the commit came on top, and with
``--fsync always`` (then a transaction and an fsync per update) a turn of 1,000
updates held the loop for seconds, so heartbeats went out 10 s late
(durable writes at fsync latency).  With one commit per turn the commit is shorter, but it still
grows with the turn's updates and is the slower half on a slow disk.

So the drain's deadline leaves room for the commit: it is the budget divided
by ``1 + ratio``, where ``ratio`` is the commit's time over the drain's time,
averaged over recent turns.  The ratio says how much work the commit adds per
unit of draining; it calibrates itself to the disk, the fsync policy and the
machine's load, with no constant to tune.  A turn that holds one update (a
quiet server) has a large ratio, made of the fixed cost of an fsync; as load
grows the turns hold more updates, the fixed cost is shared and the ratio
falls, so the turns lengthen again.  At least one update is always taken, and
the drain reads the clock only every few dozen messages, so a short deadline
never starves the writers.

Pure: the caller passes the times it measured (tests/server/test_turns.py).
"""

from __future__ import annotations

__all__ = ["TurnBudget"]

#: Weight of the newest turn in the average: a few turns follow a change of load.
_WEIGHT = 0.2
#: A ratio above this is treated as this: one pathological commit (a stalled
#: disk) must not pin the drain to a sliver of the budget for long.
_MAX_RATIO = 50.0


class TurnBudget:
    """The collector's drain deadline, from the commit-to-drain time ratio."""

    __slots__ = ("budget", "ratio")

    def __init__(self, budget: float, ratio: float = 0.0) -> None:
        if budget <= 0:
            raise ValueError(f"a turn budget must be positive, got {budget}")
        #: Seconds one turn (drain + commit + publish) should take at most.
        self.budget = budget
        #: Recent turns' commit time over drain time.
        self.ratio = ratio

    def drain_until(self, now: float) -> float:
        """The monotonic time at which a drain starting ``now`` should stop."""
        return now + self.budget / (1.0 + self.ratio)

    def observe(self, drain_s: float, commit_s: float) -> None:
        """A turn drained for ``drain_s`` seconds, then committed and published
        in ``commit_s``."""
        if drain_s <= 0 or commit_s < 0:
            return
        ratio = min(commit_s / drain_s, _MAX_RATIO)
        self.ratio += _WEIGHT * (ratio - self.ratio)
