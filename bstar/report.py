"""What Binary Star's reactor says and counts: log texts, counters, a rate limit.

Why a module of its own: :mod:`bstar.reactor` is the I/O around the state
machine, and these are its words, kept apart so that the reactor reads as
sockets, timers and callbacks: the one line a dead peer gets in each state,
the explanation of a tie-break by data rank, the counters it reports and the
rate-limited log for input from the network.  Pure but for logging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from bstar.fsm import NO_RANK, FsmCounters, Outcome, Rank, State, TieBreak

__all__ = [
    "AFTER_EXPIRY",
    "BinaryStarCounters",
    "IoCounts",
    "RateLimitedLog",
    "describe_rank",
    "rank_verdict",
]


#: What a dead peer means in each state, for the one log line about it.
AFTER_EXPIRY = {
    State.PRIMARY: "the next client vote makes us active",
    State.BACKUP: "votes stay refused until the primary has been seen",
    State.ACTIVE: "still serving",
    State.PASSIVE: "the next client vote fails over",
}


#: The tie-breaks that compare data ranks, for the log line that explains them.
_RANK_TIE_BREAKS = frozenset(
    {TieBreak.RANK, TieBreak.RANK_NEEDS_NEWER, TieBreak.RANK_YIELDS_TO_NEWER}
)


def describe_rank(rank: Rank) -> str:
    return "no data" if rank == NO_RANK else f"term {rank[0]}, sequence {rank[1]}"


def rank_verdict(outcome: Outcome) -> str | None:
    """Why the ranks made us yield or go ahead, for an operator; None if they did not."""
    peer = outcome.peer_rank
    if outcome.tie_break not in _RANK_TIE_BREAKS or peer is None:
        return None
    if outcome.rank == peer == NO_RANK:  # in-memory servers: the Guide's rules, nothing to say
        return None
    ours, theirs = describe_rank(outcome.rank), describe_rank(peer)
    if outcome.yielded:
        if outcome.rank < peer:
            return f"yielding: peer's data ({theirs}) is newer than ours ({ours})"
        return f"yielding: peer's data ({theirs}) is as new as ours ({ours})"
    if outcome.rank > peer:
        return f"going ahead: our data ({ours}) is newer than the peer's ({theirs})"
    return f"going ahead: our data ({ours}) is as new as the peer's ({theirs})"


@dataclass(frozen=True, slots=True)
class BinaryStarCounters:
    """Counters of the state machine plus those of the I/O around it."""

    fsm: FsmCounters
    state_messages_sent: int = 0
    state_messages_received: int = 0
    malformed_peer_messages: int = 0
    #: Of the malformed ones: an epoch, term or sequence above ``MAX_EPOCH``.
    out_of_range_peer_messages: int = 0
    #: Heartbeat ticks or peer messages whose handling raised (logged with the
    #: traceback; the heartbeat goes on).
    handler_errors: int = 0
    #: Connections to our state publisher that closed (the peer's, when it
    #: reconnects; any sender's that libzmq cut off for a frame above
    #: ``LINK_MAX_MESSAGE``).
    subscriber_disconnects: int = 0
    rejected_peer_events: int = 0
    callback_errors: int = 0
    #: Connections to the peer's publisher lost / (re)established, as seen by the
    #: socket monitor (always 0 with ``fast_failover=False``).
    peer_disconnects: int = 0
    peer_connects: int = 0


@dataclass(slots=True)
class IoCounts:
    """The reactor's own counts as they run; :meth:`snapshot` is what it reports."""

    sent: int = 0
    received: int = 0
    malformed: int = 0
    out_of_range: int = 0
    handler_errors: int = 0
    rejected: int = 0
    callback_errors: int = 0
    disconnects: int = 0
    connects: int = 0

    def snapshot(self, fsm: FsmCounters, *, subscriber_disconnects: int) -> BinaryStarCounters:
        return BinaryStarCounters(
            fsm=fsm,
            state_messages_sent=self.sent,
            state_messages_received=self.received,
            malformed_peer_messages=self.malformed,
            out_of_range_peer_messages=self.out_of_range,
            handler_errors=self.handler_errors,
            subscriber_disconnects=subscriber_disconnects,
            rejected_peer_events=self.rejected,
            callback_errors=self.callback_errors,
            peer_disconnects=self.disconnects,
            peer_connects=self.connects,
        )


class RateLimitedLog:
    """Log at most one message per interval and say how many were held back.

    A peer stuck sending garbage at the heartbeat rate must not flood the log.
    """

    def __init__(self, logger: logging.Logger, interval: float, clock: Callable[[], float]):
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._last: float | None = None
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, self._suppressed)
        self._logger.log(level, msg, *args, exc_info=exc_info)
        self._last = now
        self._suppressed = 0
