"""Held votes: snapshot requests refused only because the peer is not dead *yet*.

How this works: a vote refused only because the peer does not look dead
*yet* (we are passive, or a primary still starting) is *deferred*: held,
bounded in number and age, and voted again at the peer's expiry time, every
housekeeping tick and when we become active; served if accepted then,
dropped when it ages out.  A client that noticed the active server's crash
before we did is then served the moment we notice it too, instead of after
its own retry.  Which requests are held, for how long and when to vote again
is :mod:`.votes` (sans-IO); :class:`HeldVotes`, a part of the server, keeps
the timer and the vote, and hands what is accepted to the snapshot streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tornado.ioloop import IOLoop

from clone.server.config import ServerConfig
from clone.server.shared import TURN_BUDGET, Shared
from clone.server.streaming import who
from clone.server.votes import DeferredVotes
from clone.wire.delta import SinceRequest

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar

__all__ = ["HeldVotes"]

log = logging.getLogger("clone.server.reactor")


class HeldVotes:
    """Hold refused votes that may be accepted once the peer expires.

    Built with the loop (its timer), ``ha`` (Binary Star; None unpaired),
    ``serve`` (the snapshot streams', called with ``deferred=True``) and
    ``stopping``.
    """

    def __init__(
        self,
        config: ServerConfig,
        shared: Shared,
        loop: IOLoop,
        *,
        ha: Callable[[], BinaryStar | None],
        serve: Callable[..., None],
        stopping: Callable[[], bool],
    ) -> None:
        self.counters = shared.counters
        self._throttle = shared.throttle
        self._clock = shared.clock
        self._loop: IOLoop | None = loop  # None once closed
        self._ha_of = ha
        self._serve = serve
        self._stopping_of = stopping
        # Snapshot requests held for a later vote (the policy: clone.server.votes).
        self._deferred = DeferredVotes(
            config.max_deferred_votes, config.effective_deferred_vote_max_age
        )
        self._deferred_timer: object | None = None

    @property
    def _ha(self) -> BinaryStar | None:
        return self._ha_of()

    @property
    def _stopping(self) -> bool:
        return self._stopping_of()

    def __len__(self) -> int:
        """Requests held."""
        return len(self._deferred)

    def discard(self, identity: bytes, subtree: str) -> None:
        """Served now: a held copy of the same request must not be served again."""
        self._deferred.discard(identity, subtree)

    def recheck_if_held(self) -> None:
        """Housekeeping: the peer's expiry may have moved earlier (Binary Star
        saw its connection drop); the timer only knows the old one."""
        if self._deferred:
            self.recheck()

    def recheck_soon_if_held(self) -> None:
        """We became active: vote again with what is held, from a callback
        (not from here: we may be inside Binary Star's accept_vote())."""
        if self._deferred:
            self.recheck_soon()

    def close(self) -> None:
        """The server stops: the timer removed, every held request dropped."""
        loop, self._loop = self._loop, None
        if loop is not None and self._deferred_timer is not None:
            loop.remove_timeout(self._deferred_timer)
        self._deferred_timer = None
        self._deferred.clear()

    def defer(
        self,
        identity: bytes,
        subtree: str,
        batch: bool,
        applied: bool,
        user: str | None = None,
        since: SinceRequest | None = None,
        ttl_left: bool = False,
    ) -> bool:
        """Hold a refused vote if it may be accepted once the peer expires."""
        ha = self._ha
        votes = self._deferred
        if ha is None or not votes.enabled:
            return False
        # Imported here, not at the top: a standalone server never loads bstar.
        from bstar.fsm import State

        # The states in which a refused vote may be accepted later, once the
        # peer expires ("vote if expired" in docs/failover.md).
        # A backup joins them with data ranks: it takes over from a primary
        # whose data is older (failover.md, "Cold start and ranks"), and that
        # primary, now passive, asks it for a snapshot a moment before.
        if ha.state not in (State.PASSIVE, State.PRIMARY, State.BACKUP):
            return False
        now = self._clock()
        hold = votes.hold(
            identity,
            subtree,
            now,
            batch=batch,
            applied=applied,
            user=user,
            since=since,
            ttl_left=ttl_left,
        )
        if not hold.new:
            return True  # the same request again (a Guide client re-asks so)
        if hold.dropped is not None:
            self.counters["votes_deferred_overflow"] += 1
            self.counters["snapshots_refused"] += 1
            self._throttle.log(
                "deferred_overflow",
                logging.WARNING,
                "%d snapshot requests held for a vote; dropped the oldest",
                votes.limit,
            )
        self.counters["votes_deferred"] += 1
        log.debug(
            "snapshot request from %s held (%s, peer expires in %.3f s)",
            who(identity),
            ha.state.name,
            ha.peer_expiry - now,
        )
        self._schedule_deferred_check()
        return True

    def _schedule_deferred_check(self) -> None:
        """A timer at the peer's expiry or the oldest vote's, whichever is first."""
        loop, ha = self._loop, self._ha
        if loop is None or ha is None or self._stopping:
            return
        if self._deferred_timer is not None:
            loop.remove_timeout(self._deferred_timer)
            self._deferred_timer = None
        at = self._deferred.wake_at(ha.peer_expiry)
        if at is None:
            return
        delay = max(0.0, at - self._clock())
        self._deferred_timer = loop.call_later(delay, self._on_deferred_timer)

    def _on_deferred_timer(self) -> None:
        self._deferred_timer = None
        self._recheck_deferred_guarded()

    def recheck_soon(self) -> None:
        if self._loop is not None:
            self._loop.add_callback(self._recheck_deferred_guarded)

    def _recheck_deferred_guarded(self) -> None:
        try:
            self.recheck()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in the deferred-vote check")

    def recheck(self) -> None:
        """Age out held votes; vote again with the rest if they may be accepted now.

        The policy (:class:`~clone.server.votes.DeferredVotes`) decides what is
        due; this votes, serves, counts and keeps each turn short.
        """
        votes = self._deferred
        if self._stopping or not votes:
            return
        now = self._clock()
        for vote in votes.age_out(now):
            self.counters["votes_deferred_expired"] += 1
            self.counters["snapshots_refused"] += 1
            log.debug("snapshot request from %s aged out unanswered", who(vote.identity))
        ha = self._ha
        if ha is None or not ha.running:
            self._schedule_deferred_check()
            return
        from bstar.fsm import State  # paired, so already loaded

        # Heard active since the request came: its client had not lost it.
        active_at = ha.last_peer_contact if ha.peer_state is State.ACTIVE else None
        for vote in votes.drop_contradicted(active_at):
            self.counters["votes_deferred_expired"] += 1
            self.counters["snapshots_refused"] += 1
            log.debug("held request from %s dropped: the active spoke since", who(vote.identity))
        if not votes.may_vote(now, active=ha.state is State.ACTIVE, peer_expiry=ha.peer_expiry):
            # Nothing left, or the peer still alive: voting now would only be
            # refused (and counted).
            self._schedule_deferred_check()
            return
        stop_at = now + TURN_BUDGET
        while votes:
            vote = votes.pop()
            if not ha.accept_vote():
                # Refused although the peer has expired (not a state that votes
                # can change); it will not get better.
                self.counters["votes_deferred_expired"] += 1
                self.counters["snapshots_refused"] += 1
                continue
            self.counters["votes_deferred_served"] += 1
            log.debug("serving the held snapshot request from %s", who(vote.identity))
            self._serve(
                vote.identity,
                vote.subtree,
                deferred=True,
                batch=vote.batch,
                applied=vote.applied,
                user=vote.user,
                since=vote.since,
                ttl_left=vote.ttl_left,
            )
            if votes and self._clock() > stop_at:
                # Each serve sends a first chunk; yield to the loop between turns.
                self.recheck_soon()
                return
        self._schedule_deferred_check()
