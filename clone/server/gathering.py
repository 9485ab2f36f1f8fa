"""The commit double buffer: one job in flight, one gathering, bounded in bytes.

Why: a turn's commit runs on the commit writer's thread
(:mod:`.committing`), but the loop used to pause every socket until it
landed, so it did nothing useful during the fsync: on this project's disk a
bulk load was capped by the commit alone (docs/benchmarks.md).  Now the loop
keeps reading while a commit is in flight.  What it applies meanwhile is
*gathered* in the core's journal and becomes the next job as soon as the one
in flight lands: one buffer on the disk, one filling, the classic double
buffer.  Publication does not move: a job's updates are published only
after its commit, in sequence order, and the replies and snapshots that
waited for them only then.

The gathering is bounded: past :data:`GATHER_BYTES` bytes or
:data:`GATHER_ROWS` updates (the journal's count, checked at the end of each
turn, so it may overshoot by one turn's input, itself bounded by
``COLLECTOR_TURN_BYTES`` and the snapshot port's turn) the sockets are paused
until the job in flight lands; the writers' updates wait in their
connections, as they used to during every commit.  Rows matter as well as
bytes because a commit's time grows with its rows: the next job is at most
what the bound lets gather, so a slow disk cannot make one commit ever longer.

How this works: a table.  The states say whether the loop reads
(``READING``), waits for the commit in flight because the gathering is full
(``FULL``), or has stopped for good after a failed commit (``STOPPED``:
fail-stop, nothing is read or written after it).  Each event returns the
next state and what to do with the sockets.  Pure: no clock, no sockets
(``tests/server/test_gathering.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

__all__ = ["GATHER_BYTES", "GATHER_ROWS", "Gate", "GateAction", "GateEvent", "GateState"]

#: Bytes of applied, unpublished updates the loop gathers while a commit is
#: in flight before it stops reading: two collector turns' worth.
GATHER_BYTES = 4 * 1024 * 1024

#: Updates gathered while a commit is in flight before the loop stops
#: reading: about half a second of commit on the slow disk measured in
#: docs/benchmarks.md (55-99 us a row), so the next job stays short too.
GATHER_ROWS = 8192


class GateState(enum.Enum):
    READING = "reading"  # the sockets are read, a commit in flight or not
    FULL = "full"  # a commit is in flight and the next job is full: paused
    STOPPED = "stopped"  # a commit failed: paused until the server stops


class GateEvent(enum.Enum):
    UNDER = "under"  # a turn ended, the gathering within its bounds
    OVER = "over"  # a turn ended with a commit in flight, the gathering past a bound
    LANDED = "landed"  # the commit in flight landed (the gathering, if any, is now in flight)
    FAILED = "failed"  # a commit failed


class GateAction(enum.Enum):
    NONE = "none"
    PAUSE = "pause"  # stop reading the server's sockets
    RESUME = "resume"  # read them again


_S, _E, _A = GateState, GateEvent, GateAction

#: (state, event) -> (next state, what to do with the sockets).  Every pair is
#: legal: a turn may end while paused (a timer's turn), a landing may come
#: while reading.
TABLE: dict[tuple[GateState, GateEvent], tuple[GateState, GateAction]] = {
    (_S.READING, _E.UNDER): (_S.READING, _A.NONE),
    (_S.READING, _E.OVER): (_S.FULL, _A.PAUSE),
    (_S.READING, _E.LANDED): (_S.READING, _A.NONE),
    (_S.READING, _E.FAILED): (_S.STOPPED, _A.PAUSE),
    (_S.FULL, _E.UNDER): (_S.FULL, _A.NONE),
    (_S.FULL, _E.OVER): (_S.FULL, _A.NONE),
    (_S.FULL, _E.LANDED): (_S.READING, _A.RESUME),
    (_S.FULL, _E.FAILED): (_S.STOPPED, _A.NONE),
    (_S.STOPPED, _E.UNDER): (_S.STOPPED, _A.NONE),
    (_S.STOPPED, _E.OVER): (_S.STOPPED, _A.NONE),
    (_S.STOPPED, _E.LANDED): (_S.STOPPED, _A.NONE),
    (_S.STOPPED, _E.FAILED): (_S.STOPPED, _A.NONE),
}


def _nothing() -> None:
    pass


class Gate:
    """Whether the loop may read while a commit is in flight (the table above).

    ``pause`` and ``resume`` are called as the table says (the server's
    sockets'); ``max_bytes`` and ``max_rows`` bound what gathers; ``pauses``
    counts the times the gathering filled (the server's ``commit_gather_pauses``).
    """

    __slots__ = ("_pause", "_resume", "max_bytes", "max_rows", "pauses", "state")

    def __init__(
        self,
        pause: Callable[[], None] = _nothing,
        resume: Callable[[], None] = _nothing,
        *,
        max_bytes: int = GATHER_BYTES,
        max_rows: int = GATHER_ROWS,
    ) -> None:
        if max_bytes < 1 or max_rows < 1:
            raise ValueError(f"gather bounds must be positive, got {max_bytes} B, {max_rows} rows")
        self._pause = pause
        self._resume = resume
        self.max_bytes = max_bytes
        self.max_rows = max_rows
        self.state = GateState.READING
        self.pauses = 0

    def turn_ended(self, *, in_flight: bool, nbytes: int, rows: int) -> GateAction:
        """A turn ended with ``nbytes`` and ``rows`` gathered for the next job."""
        over = in_flight and (nbytes > self.max_bytes or rows > self.max_rows)
        return self.handle(GateEvent.OVER if over else GateEvent.UNDER)

    def handle(self, event: GateEvent) -> GateAction:
        """Move by the table, pause or resume as it says; what it said."""
        state, action = TABLE[(self.state, event)]
        if state is GateState.FULL and self.state is not GateState.FULL:
            self.pauses += 1
        self.state = state
        if action is GateAction.PAUSE:
            self._pause()
        elif action is GateAction.RESUME:
            self._resume()
        return action
