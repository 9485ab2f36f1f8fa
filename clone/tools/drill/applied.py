"""What the winner of a split brain applied: its own update history, read at the end.

Why: the drill judged a write the isolated server confirmed by what its
clients saw.  A write the winner applied at the heal and that a later write of
the same key replaced before any client synced from the winner (they were
still failing over, or waiting for the heal's hold to end) was never seen, and
was counted ``lost`` though the winner had applied it (two runs on a loaded
machine: 8 and 11 such writes, each in the winner's own log of updates at its
term).  The winner's history says what it applied, in order, through the
public ``changes(since=N)`` read (:func:`clone.client.history.read_history`).

``N`` is the sequence the winner's promotion started its own updates
after, from its log (``now ACTIVE ... serving at sequence S ... published P
of ...``: ``N = S - P``).  Not ``S`` itself: a write the loser confirmed just
before the cut can also sit in the winner's pending list (its client sent it
to both servers) and be published at the promotion, within those ``P``; a
later write of the key replaced it, no client synced from the winner saw it,
and with ``N = S`` the drill called it lost though the winner's history held
it (a loaded run: the loser's seq 343, published by the winner from its
pending list as its own 343, one of 3).  Reading a few updates too many is
harmless: every id read was applied.

:func:`promotion_sequence` and :func:`write_ids` are pure; :func:`read_applied`
does the read.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from clone.tools.drill.client import DRILL_PREFIX, parse_value

__all__ = ["WinnerHistory", "promotion_sequence", "read_applied", "write_ids"]

log = logging.getLogger(__name__)

_PROMOTED = re.compile(
    r"now ACTIVE \(was [a-z]+\): serving at sequence (\d+), \d+ keys; published (\d+) of"
)


def promotion_sequence(log_text: str) -> int | None:
    """The sequence the last promotion in ``log_text`` (a server's log since
    the cut) carried on from, before the updates it published (its pending
    list's, the deletes of orphaned lease keys), or None if it was not
    promoted there."""
    found = _PROMOTED.findall(log_text)
    if not found:
        return None
    serving, published = found[-1]
    return max(0, int(serving) - int(published))


def write_ids(values: Iterable[bytes | None]) -> set[str]:
    """The drill write ids carried in ``values`` (deletes and others carry none)."""
    return {uid for value in values if (uid := parse_value(value)) is not None}


@dataclass(slots=True)
class WinnerHistory:
    """The winner's updates after ``since``, as drill write ids.

    ``complete``: every change up to the winner's sequence when it answered
    was read (a read cut short by its deadline, a compacted history or a
    silent server leaves fewer ids, never wrong ones: each id was applied).
    """

    server: str
    since: int
    upto: int | None = None
    complete: bool = False
    error: str | None = None
    ids: set[str] = field(default_factory=set)

    def summary(self) -> dict[str, object]:
        return {"server": self.server, "since": self.since, "upto": self.upto,
                "complete": self.complete, "error": self.error, "write_ids": len(self.ids)}


def read_applied(server: str, endpoint: str, since: int, timeout: float = 20.0) -> WinnerHistory:
    """Read ``server``'s history of drill keys after ``since``, up to its
    sequence when it answers, within ``timeout`` seconds."""
    from clone.client.history import read_history
    from clone.errors import CloneError
    from clone.wire.codec import KVMsg

    out = WinnerHistory(server, since)
    values: list[bytes | None] = []

    def keep(msg: KVMsg) -> None:
        values.append(msg.body)

    deadline = time.monotonic() + timeout
    try:
        out.upto = read_history([endpoint], since, lambda entry: None,
                                lambda: time.monotonic() > deadline,
                                prefixes=(DRILL_PREFIX,), until_live=True, on_message=keep)
        out.complete = time.monotonic() <= deadline
    except CloneError as exc:  # HistoryCompacted among them: the ids so far stand
        out.error = f"{type(exc).__name__}: {exc}"
        log.warning("the history of %s after %d: %s", server, since, out.error)
    out.ids = write_ids(values)
    return out
