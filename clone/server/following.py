"""Following a server (the active peer while passive, a relay's upstream): a part.

How this works: a :class:`Follower` subscribes to the followed server's
publisher and asks its snapshot port for a full copy on a fresh DEALER per
attempt (so stale replies cannot mix in), with a timeout; the core
(:mod:`.core`) stages the snapshot, buffers the KVPUBs that arrive meanwhile
and says when to resync.  Each turn of updates or of a sync reply ends with
``after_turn``: a passive server commits what it followed, a relay commits
and publishes it (the journal holds exactly what the core applied).

The part is built with the config and core, the shared clocks and counters,
the server's sockets, and callbacks: ``followed`` (which server, ``host:port``:
the peer, or the relay link's current upstream), ``term`` (the followed
server's term, from Binary Star; None unpaired), ``after_turn``,
``next_turn``, and the healer's two hooks (``fork_known``: the split writes
can go as soon as the winner's fork is known; ``synced``: a passive's sync
finished).  A relay's follower also tells its :class:`Upstream` (the relay
link) what it heard.  ``tests/server/test_follower.py`` drives it alone
against a fake active on loopback.

The role callbacks that promote or demote the server (and take what the
old active already sent, :meth:`Follower.take_backlog`) are the role
switch's (:mod:`.roles`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from clone.errors import ProtocolError
from clone.ratelimit import Throttle
from clone.server.budget import COLLECTOR_TURN_BYTES
from clone.server.config import ServerConfig
from clone.server.core import FollowOutcome, Role, ServerCore, SyncState
from clone.server.heap import freeze_state
from clone.server.sending import send
from clone.server.shared import CLOCK_EVERY, TURN_BUDGET, Shared, Sockets, peer_endpoint
from clone.wire.batch import is_kvbatch
from clone.wire.codec import encode_icanhaz
from clone.wire.control import is_control
from clone.wire.delta import since_metadata, since_term_metadata
from clone.wire.frames import MAX_SYNC_FRAME_BYTES, cap_message_size, recv_frames
from clone.wire.protocol import (
    APPLIED_METADATA,
    BATCH_METADATA,
    HUGZ,
    PUBLISHER_OFFSET,
    SNAPSHOT_OFFSET,
    STEPPED_DOWN_METADATA,
    TTL_LEFT_METADATA,
)

__all__ = ["Follower", "Upstream", "take_backlog"]

log = logging.getLogger("clone.server.reactor")


class Upstream(Protocol):
    """What a relay's follower tells the relay link (clone.server.relaying)."""

    def heard(self, frames: list[bytes]) -> None:
        """A message from the followed server's publisher."""

    def on_control(self, frames: list[bytes]) -> None:
        """A control message (NUL-led topic) on that stream: not an update."""

    def heard_now(self) -> None:
        """A turn of the sync reply: the followed server's snapshot port answers."""

    def synced(self) -> None:
        """A sync finished."""


def take_backlog(
    sock: zmq.Socket[Any],
    handle: Callable[[list[bytes], float, float], object],
    shared: Shared,
    kind: str,
    what: str,
) -> int:
    """Hand every message queued on ``sock`` to ``handle`` now; how many.

    Bounded by the socket's high-water mark, and done once per promotion;
    bad input is logged (rate-limited by ``kind``) and skipped.
    """
    now = shared.wallclock()
    taken = 0
    while True:
        try:
            frames = recv_frames(sock)
        except zmq.Again:
            return taken
        taken += 1
        try:
            handle(frames, now, shared.clock())
        except ProtocolError as exc:
            shared.throttle.log(kind, logging.WARNING, "dropped %s: %s", what, exc)


class Follower:
    """Keep a copy of the followed server's state: a SUB and a sync DEALER."""

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        sockets: Sockets,
        *,
        followed: Callable[[], str | None],
        term: Callable[[], int | None],
        after_turn: Callable[[], None],
        next_turn: Callable[[Callable[[], None]], bool],
        fork_known: Callable[[], None],
        synced: Callable[[], None],
        upstream: Upstream | None = None,
        stepped_down: Callable[[], bool] = lambda: False,
        resyncing: Callable[[], None] = lambda: None,
        heard_hugz: Callable[[], None] = lambda: None,
    ) -> None:
        self._config = config
        self._core = core
        self._shared = shared
        self._counters = shared.counters
        self._throttle: Throttle = shared.throttle
        self._clock = shared.clock
        self._sockets = sockets
        self._followed = followed
        self._term = term
        self._after_turn = after_turn
        self._next_turn = next_turn
        self._stepped_down = stepped_down
        self._fork_known = fork_known
        self._synced = synced
        # A gap: what we hold lags the followed server by more than replication
        # until the resync completes (the role switch refuses votes meanwhile).
        self._resyncing = resyncing
        # A turn that read a HUGZ ends by telling the pair's link (the passive
        # announces its sequence at once: clone.server.handover).
        self._heard_hugz = heard_hugz
        self._hugz_in_turn = False
        self.upstream = upstream
        self._sub: ZMQStream | None = None
        self._dealer: ZMQStream | None = None
        #: When the current sync last moved (a reply turn), on the clock.
        self.sync_progress = 0.0
        self._sync_started = 0.0

    @property
    def following(self) -> bool:
        """Whether the SUB on the followed server's publisher is open."""
        return self._sub is not None

    # -- start, stop -----------------------------------------------------------

    def follow(self) -> zmq.Socket[Any] | None:
        """Follow :attr:`followed`: its publisher (kept while we follow), and
        a sync.  Returns the SUB if this opened a fresh one."""
        fresh: zmq.Socket[Any] | None = None
        if self._sub is None:
            followed = self._followed()
            assert followed is not None
            sub = self._sockets.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self._config.collector_hwm)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(peer_endpoint(followed, PUBLISHER_OFFSET))
            self._sub = self._sockets.stream(sub, self.on_update)
            fresh = sub
        self._sync_started = self._clock()
        self.request_snapshot()
        return fresh

    def close(self) -> None:
        """Stop following: close the sync DEALER and the SUB."""
        self._close_dealer()
        sub, self._sub = self._sub, None
        if sub is not None:
            self._sockets.forget(sub)

    def take_backlog(self) -> int:
        """Before a promotion, take every message the old active already sent.

        A busy passive may hold thousands of the old active's KVPUBs unread in
        its SUB queue; clients may have seen them (confirmed writes), and once
        the socket is closed they are gone.  So they are applied first, in
        order, like any followed update (a gap stops that, and the pending list
        covers the rest).  Returns how many messages were taken.
        """
        sub = self._sub
        if sub is None or sub.closed():
            return 0
        return take_backlog(
            sub.socket, self._core.on_peer_update, self._shared, "peer_update",
            "a message from the peer",
        )  # fmt: skip

    # -- the sync ---------------------------------------------------------------

    def request_snapshot(self) -> None:
        """(Re)start a sync on a fresh DEALER, so stale replies cannot mix in."""
        followed = self._followed()
        assert followed is not None
        core = self._core
        self._close_dealer()
        # The sync's own start: a passive may follow a peer for minutes (it
        # restarts, we wait) before this request, which the log must not count.
        self._sync_started = self._clock()
        dealer = self._sockets.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, self._config.snapshot_hwm)
        # Ask for KVBATCHes (our peer is one of us): a restart resyncs faster.
        try:
            dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
            # ... and for the ids it applied, to reconcile our pending list
            # (a relay has none: it asks as a client does).
            if core.role is not Role.RELAY:
                dealer.setsockopt(zmq.METADATA, APPLIED_METADATA)
            # ... and, a split brain's loser, that we have writes to forward
            # (the winner holds client snapshots until they are in).
            if self._stepped_down():
                dealer.setsockopt(zmq.METADATA, STEPPED_DOWN_METADATA)
            # ... and for the time each ephemeral key has left (clone.server.ttl).
            dealer.setsockopt(zmq.METADATA, TTL_LEFT_METADATA)
            # ... and, holding a state, only for what followed it (a catch-up).
            since = core.catch_up_request(with_term=core.role is not Role.RELAY)
            if since is not None:
                dealer.setsockopt(zmq.METADATA, since_metadata(since.sequence, since.digest))
                if since.term is not None:
                    dealer.setsockopt(zmq.METADATA, since_term_metadata(since.term))
            cap_message_size(dealer, MAX_SYNC_FRAME_BYTES)
        except zmq.ZMQError:  # a libzmq older than 4.3: the standard stream
            log.debug("this libzmq cannot send ZMTP metadata; syncing without KVBATCH")
        dealer.connect(peer_endpoint(followed, SNAPSHOT_OFFSET))
        self._dealer = self._sockets.stream(dealer, self.on_sync_reply)
        core.start_sync()
        self.sync_progress = self._clock()
        # The first message on a fresh socket: no reply can be hidden by it.
        # If the pipe is full, the sync timeout retries.
        send(dealer, encode_icanhaz(""), backlog=None)
        log.debug("asked %s for a snapshot", followed)

    def check_timeout(self) -> None:
        """Housekeeping: a passive's sync that has not moved for the sync
        timeout is asked again (a relay's link decides for a relay: it may
        move to another upstream)."""
        core = self._core
        if core.role is not Role.PASSIVE or core.sync_state is not SyncState.SYNCING:
            return
        now = self._clock()
        if now - self.sync_progress < self._config.effective_sync_timeout:
            return
        self._counters["sync_timeouts"] += 1
        self._throttle.log(
            "sync_timeout",
            logging.WARNING,
            "no snapshot from the active server at %s for %.1f s; asking again",
            self._config.peer,
            now - self.sync_progress,
        )
        self.request_snapshot()

    # -- the streams ------------------------------------------------------------

    def on_update(self, frames: list[bytes]) -> None:
        """KVPUBs from the followed server: apply in order, then the turn's end."""
        try:
            self._follow_updates(frames)
        finally:
            self._after_turn()
            if self._hugz_in_turn:
                self._hugz_in_turn = False
                self._heard_hugz()

    def _follow_updates(self, frames: list[bytes]) -> None:
        sub = self._sub
        core = self._core
        term = self._term()
        if term is not None:
            core.term = term
        clock = self._clock
        stop_at = clock() + TURN_BUDGET
        now = self._shared.wallclock()
        budget = self._config.collector_batch
        room = COLLECTOR_TURN_BYTES  # and bytes: 512 KB updates made 32 MB commits
        upstream = self.upstream if core.role is Role.RELAY else None
        while True:
            outcome = FollowOutcome.OK
            if frames[0] == HUGZ:
                self._hugz_in_turn = True
            if upstream is not None:
                upstream.heard(frames)
            if upstream is not None and is_control(frames):
                # The upstream's notices to our own key (CURVE): not updates.
                upstream.on_control(frames)
            else:
                try:
                    # Read after the message: a ttl in it counts from no earlier than its arrival.
                    outcome = core.on_peer_update(frames, now, clock())
                except ProtocolError as exc:
                    self._throttle.log(
                        "peer_update", logging.WARNING, "dropped a message from the peer: %s", exc
                    )
                if outcome is FollowOutcome.RESYNC:
                    self._throttle.log(
                        "gap",
                        logging.INFO,
                        "missed updates from %s (have %d, it is at %d); resyncing",
                        self._followed(),
                        core.store.sequence,
                        core.highest_seen,
                    )
                    self._resyncing()
                    self.request_snapshot()
            # Decide to yield *before* taking the next message, never after:
            # a message received and then abandoned is lost for good.
            budget -= 1
            room -= sum(map(len, frames))
            if self._turn_over(budget, stop_at) or room <= 0:
                return
            if sub is None or sub is not self._sub or sub.closed():
                return
            try:
                frames = recv_frames(sub.socket)
            except zmq.Again:
                return

    def on_sync_reply(self, frames: list[bytes]) -> None:
        """A turn of the snapshot (or catch-up) we asked for, then the turn's end."""
        try:
            self._take_sync_reply(frames)
        finally:
            self._after_turn()

    def _take_sync_reply(self, frames: list[bytes]) -> None:
        dealer = self._dealer
        core = self._core
        term = self._term()
        if term is not None:
            core.term = term
        clock = self._clock
        self.sync_progress = stop_at = clock()
        upstream = self.upstream if core.role is Role.RELAY else None
        if upstream is not None:
            upstream.heard_now()
        stop_at += TURN_BUDGET
        now = self._shared.wallclock()
        budget = self._config.collector_batch
        while True:
            try:
                # Read after the message: a ttl in it counts from no earlier than its arrival.
                outcome = core.on_snapshot_reply(frames, now, clock())
                if core.split_left and core.role is Role.PASSIVE:
                    self._fork_known()  # the fork is known: the healer sends them now
            except ProtocolError as exc:
                self._throttle.log(
                    "sync_reply", logging.WARNING, "dropped a snapshot entry from the peer: %s", exc
                )
                outcome = FollowOutcome.OK
            if outcome is FollowOutcome.SYNCED:
                if upstream is not None:
                    upstream.synced()
                log.info(
                    "synced from %s (%s): %d keys at sequence %d in %.2f s",
                    self._followed(),
                    core.last_sync,
                    len(core.store),
                    core.store.sequence,
                    clock() - self._sync_started,
                )
                if core.role is Role.PASSIVE:
                    self._synced()
                freeze_state()  # the new store, out of the collector's walks (clone.server.heap)
                self._next_turn(lambda: self._close_dealer_if(dealer))
                return
            if outcome is FollowOutcome.RESYNC:
                self._throttle.log("gap", logging.INFO, "updates missed during the sync; resyncing")
                self._resyncing()
                self.request_snapshot()
                return
            budget -= 1
            if self._turn_over(budget, stop_at):
                return
            if is_kvbatch(frames) and clock() > stop_at:
                return  # a KVBATCH is thousands of entries: check after each one
            if dealer is None or dealer is not self._dealer or dealer.closed():
                return
            try:
                frames = recv_frames(dealer.socket)
            except zmq.Again:
                return

    def _turn_over(self, budget: int, stop_at: float) -> bool:
        """Out of messages for this turn, or (checked every CLOCK_EVERY
        messages, since a clock read is not free) out of time."""
        return budget <= 0 or (budget % CLOCK_EVERY == 0 and self._clock() > stop_at)

    def _close_dealer_if(self, dealer: ZMQStream | None) -> None:
        if dealer is not None and dealer is self._dealer:
            self._close_dealer()

    def _close_dealer(self) -> None:
        dealer, self._dealer = self._dealer, None
        if dealer is not None:
            self._sockets.forget(dealer)
