"""How long a sync round waits, and when it asks again, after rounds that got nothing (pure).

Why: a client that gets no snapshot data within ``server_timeout`` moves on to
the next server, and asks every ``reask_interval`` on a fresh DEALER.  On a
server just promoted under load, holding 50,000 keys, the first data took
longer than the round: every client asked 10 times in 0.625 s, moved to the
other (cut off) server, came back at its next HUGZ, and asked 10 times more,
for about 9 s; the server spent itself on streams whose requesters had gone
(703 requests, 10 snapshots served).  So rounds that end without snapshot data
lengthen the next ones: each such round in a row doubles the next round's
window (up to :data:`ROUND_GROWTH_MAX` times ``server_timeout``) and its
re-ask interval (up to :data:`REASK_GROWTH_MAX` times ``reask_interval``),
the re-asks spread by a random factor in ``[1 - REASK_JITTER, 1 + REASK_JITTER)``
so that clients that failed over together do not ask together.  A completed
sync resets it.  A first round is as before: a failover is not slowed.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["REASK_GROWTH_MAX", "REASK_JITTER", "ROUND_GROWTH_MAX", "reask_delay", "round_window"]

#: The longest round, in ``server_timeout``s.
ROUND_GROWTH_MAX = 4
#: The longest re-ask interval, in ``reask_interval``s.
REASK_GROWTH_MAX = 8
#: The spread of a backed-off re-ask, as a fraction of its interval.
REASK_JITTER = 0.25


def round_window(server_timeout: float, unanswered: int) -> float:
    """Seconds a sync round waits for snapshot data after ``unanswered``
    rounds in a row got none."""
    return server_timeout * min(1 << min(max(unanswered, 0), 16), ROUND_GROWTH_MAX)


def reask_delay(reask_interval: float, unanswered: int, draw: Callable[[], float]) -> float:
    """Seconds until an unanswered request is repeated, after ``unanswered``
    rounds in a row got no data; ``draw`` gives a uniform number in [0, 1)."""
    if unanswered <= 0:
        return reask_interval
    base = reask_interval * min(1 << min(unanswered, 16), REASK_GROWTH_MAX)
    return base * (1.0 - REASK_JITTER + 2 * REASK_JITTER * draw())
