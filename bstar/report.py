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
    "behind_refusal",
    "connection_lost",
    "describe_rank",
    "describe_start",
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


def behind_refusal(state: State, rank: Rank) -> str:
    """Why client votes are refused while our data may be behind the peer's
    (logged once per episode): a passive still syncing, or a server restarted
    from data it wrote while it followed the peer."""
    term, sequence = rank
    ours = f"our data (term {term}, sequence {sequence})"
    why = (
        f"until our sync from the active peer completes: {ours} is older than what it confirmed"
        if state is State.PASSIVE
        else f"until the peer is heard: {ours} was last written while we followed it,"
        " so it may hold newer confirmed writes"
    )
    return f"refusing client votes {why} (docs/failover.md, 'Cold start and ranks')"


def connection_lost(peer: str, state: State, wait_left: float | None) -> str:
    """The line for a lost connection to the peer's publisher: within the start
    wait (``wait_left`` s of it) the peer may be booting; after it, dead."""
    if wait_left is not None:
        return (
            f"peer connection lost: {peer} closed before the peer was heard; waiting for it"
            f" until the start wait ends in {wait_left:.3f} s"
        )
    return f"peer connection lost: {peer} closed; presumed dead; in state {state.name}, " + (
        AFTER_EXPIRY[state]
    )


def describe_start(
    *,
    primary: bool,
    local: str,
    peer: str,
    heartbeat: float,
    missed: int,
    fast_failover: bool,
    epoch: int,
    rank: Rank | None,
    start_wait: float,
) -> str:
    """The one line a starting Binary Star logs: where, how often, what it holds."""
    return (
        f"binary star {'primary' if primary else 'backup'} starting: publishing at {local},"
        f" peer at {peer}, heartbeat {heartbeat:.3f} s x {missed}"
        f"{', fast failover on a lost connection' if fast_failover else ''},"
        f" epoch {epoch}, {'no data rank' if rank is None else describe_rank(rank)},"
        f" waiting at least {max(start_wait, heartbeat * missed):.3f} s for the peer"
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
    #: Times the link connected to the peer's publisher again itself, libzmq
    #: having made no new connection after one closed (it gives up after a
    #: protocol error).
    peer_reconnects: int = 0


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

    def snapshot(
        self, fsm: FsmCounters, subscriber_disconnects: int, peer_reconnects: int
    ) -> BinaryStarCounters:
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
            peer_reconnects=peer_reconnects,
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
