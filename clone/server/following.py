"""Roles, and following the active peer while passive.

How this works: Binary Star's callbacks promote or demote the server.  A
passive server subscribes to the active peer's publisher and asks its snapshot
port for a full copy on a fresh DEALER per attempt (so stale replies cannot
mix in), with a timeout; the core (:mod:`.core`) stages the snapshot, buffers
the KVPUBs that arrive meanwhile and says when to resync.  At promotion,
whatever the old active had already sent and whatever clients sent us is taken
from the sockets first, so that no confirmed write is lost or reordered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from clone.errors import ProtocolError
from clone.server.base import TURN_BUDGET, ServerBase, log, peer_endpoint
from clone.server.core import FollowOutcome, Role, SyncState
from clone.server.sending import send
from clone.wire.batch import is_kvbatch
from clone.wire.codec import encode_icanhaz
from clone.wire.control import is_control
from clone.wire.delta import since_metadata
from clone.wire.frames import MAX_SYNC_FRAME_BYTES, cap_message_size, recv_frames
from clone.wire.protocol import (
    APPLIED_METADATA,
    BATCH_METADATA,
    PUBLISHER_OFFSET,
    SNAPSHOT_OFFSET,
    TTL_LEFT_METADATA,
)

__all__ = ["FollowingMixin"]


class FollowingMixin(ServerBase):
    """Take a role; while passive, keep a copy of the active peer's state."""

    # -- roles ---------------------------------------------------------------

    def _on_became_active(self) -> None:
        core = self.core
        if core.role is Role.ACTIVE:
            return
        was = core.role
        taken = self._take_peer_backlog()
        self._take_collector_backlog()
        # What the old active sent is written under its term, before ours starts.
        self._commit()
        pending = len(core.pending)
        assert self._ha is not None
        heard = self._ha.heard_peer
        core.term = self._ha.epoch
        core.become_active(self._wallclock(), self._clock())
        self._apply_split_writes_here()
        self._note_role(was.value, core.role.value)
        if was is Role.PASSIVE:
            self.counters["failovers"] += 1
            self._last_failover = self._wallclock()
            # Took over from a peer presumed dead: if it was active meanwhile
            # (a split brain), its first sync from us is its step-down, and its
            # clients' writes race its forwarded ones (clone.server.healing).
            self._await_peer_sync = True
        self._record_term()
        batch = self._commit()
        self._close_peer()
        self.publisher.publish_bulk(batch)
        if not heard:
            log.warning(
                "serving without having heard the peer since we started (%.1f s of"
                " --peer-wait): our state (term %d, sequence %d) may be older than the peer's",
                self.config.effective_peer_wait,
                self._data_term,
                core.store.sequence,
            )
        log.warning(
            "now ACTIVE (was %s): serving at sequence %d, %d keys; published %d of %d "
            "pending updates; took %d updates the old active had sent",
            was.value,
            core.store.sequence,
            len(core.store),
            len(batch),
            pending,
            taken,
        )
        # Tell subscribers at once that this server is alive and where it stands.
        self.publisher.publish(core.hugz(self._heartbeat_ms))
        if self._deferred:
            self._recheck_deferred_soon()  # not from here: we may be inside accept_vote()

    def _take_peer_backlog(self) -> int:
        """Before a promotion, take every message the old active already sent.

        A busy passive may hold thousands of the old active's KVPUBs unread in
        its SUB queue; clients may have seen them (confirmed writes), and once
        the socket is closed they are gone.  So they are applied first, in
        order, like any followed update (a gap stops that, and the pending list
        covers the rest).  Returns how many messages were taken.
        """
        sub = self._peer_sub
        if sub is None or sub.closed():
            return 0
        return self._take_backlog(
            sub.socket, self.core.on_peer_update, "peer_update", "a message from the peer"
        )

    def _take_collector_backlog(self) -> None:
        """Before a promotion, park every client update already received.

        A client's copy of a write the old active confirmed may still sit
        unread in our collector queue (we were busy, say with a sync).  Read
        after the promotion it would be applied only after we had served
        snapshots without it: clients would see the key go back, then forward.
        Parked now, it is applied with the pending list, before any snapshot.
        """
        sock = self._collector
        if sock is None or self.core.role is Role.ACTIVE:
            return
        self._take_backlog(sock, self.core.on_kvset, "kvset", "a client update")

    def _take_backlog(
        self,
        sock: zmq.Socket[Any],
        handle: Callable[[list[bytes], float, float], object],
        kind: str,
        what: str,
    ) -> int:
        """Hand every message queued on ``sock`` to ``handle`` now; how many.

        Bounded by the socket's high-water mark, and done once per promotion;
        bad input is logged (rate-limited by ``kind``) and skipped.
        """
        now = self._wallclock()
        taken = 0
        while True:
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return taken
            taken += 1
            try:
                handle(frames, now, self._clock())
            except ProtocolError as exc:
                self._throttle.log(kind, logging.WARNING, "dropped %s: %s", what, exc)

    def _on_became_passive(self) -> None:
        core = self.core
        was = core.role
        core.become_passive()
        if was is not Role.PASSIVE:
            self._note_role(was.value, core.role.value)
        if self._ha is not None:
            core.term = self._ha.peer_epoch
        for stream in list(self._snapshots):
            self._abort_snapshot(stream, "server became passive")
        dropped = self.publisher.drop()
        if dropped:
            self.counters["outq_dropped"] += dropped
        log.warning(
            "now PASSIVE (was %s): following the active server at %s", was.value, self.config.peer
        )
        self._follow()

    # -- following the active peer -------------------------------------------

    def _follow(self) -> None:
        cfg = self.config
        followed = self._followed
        assert followed is not None
        if self._peer_sub is None:
            sub = self._socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, cfg.collector_hwm)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(peer_endpoint(followed, PUBLISHER_OFFSET))
            self._peer_sub = self._stream(sub, self._on_peer_update)
        self._sync_started = self._clock()
        self._request_snapshot()

    def _request_snapshot(self) -> None:
        """(Re)start a sync on a fresh DEALER, so stale replies cannot mix in."""
        cfg = self.config
        followed = self._followed
        assert followed is not None
        self._close_dealer()
        # The sync's own start: a passive may follow a peer for minutes (it
        # restarts, we wait) before this request, which the log must not count.
        self._sync_started = self._clock()
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, cfg.snapshot_hwm)
        # Ask for KVBATCHes (our peer is one of us): a restart resyncs faster.
        try:
            dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
            # ... and for the ids it applied, to reconcile our pending list
            # (a relay has none: it asks as a client does).
            if self.core.role is not Role.RELAY:
                dealer.setsockopt(zmq.METADATA, APPLIED_METADATA)
            # ... and for the time each ephemeral key has left (clone.server.ttl).
            dealer.setsockopt(zmq.METADATA, TTL_LEFT_METADATA)
            # ... and, holding a state, only for what followed it (a catch-up).
            since = self.core.catch_up_request()
            if since is not None:
                dealer.setsockopt(zmq.METADATA, since_metadata(since.sequence, since.digest))
            cap_message_size(dealer, MAX_SYNC_FRAME_BYTES)
        except zmq.ZMQError:  # a libzmq older than 4.3: the standard stream
            log.debug("this libzmq cannot send ZMTP metadata; syncing without KVBATCH")
        dealer.connect(peer_endpoint(followed, SNAPSHOT_OFFSET))
        self._peer_dealer = self._stream(dealer, self._on_sync_reply)
        self.core.start_sync()
        self._sync_progress = self._clock()
        # The first message on a fresh socket: no reply can be hidden by it.
        # If the pipe is full, the sync timeout retries.
        send(dealer, encode_icanhaz(""), backlog=None)
        log.debug("asked %s for a snapshot", followed)

    def _check_sync_timeout(self) -> None:
        core = self.core
        if core.role is Role.RELAY:
            return  # clone.server.relaying decides: it may fail over upstream
        if core.role is not Role.PASSIVE or core.sync_state is not SyncState.SYNCING:
            return
        now = self._clock()
        if now - self._sync_progress < self.config.effective_sync_timeout:
            return
        self.counters["sync_timeouts"] += 1
        self._throttle.log(
            "sync_timeout",
            logging.WARNING,
            "no snapshot from the active server at %s for %.1f s; asking again",
            self.config.peer,
            now - self._sync_progress,
        )
        self._request_snapshot()

    def _on_peer_update(self, frames: list[bytes]) -> None:
        """KVPUBs from the active: apply in order, then journal them in one commit
        (a relay publishes them instead: it has no journal)."""
        try:
            self._follow_updates(frames)
        finally:
            self._commit_followed()

    def _commit_followed(self) -> None:
        if self.core.role is Role.RELAY:
            self._commit_and_publish()
        else:
            self._commit()

    def _follow_updates(self, frames: list[bytes]) -> None:
        sub = self._peer_sub
        if self._ha is not None:
            self.core.term = self._ha.peer_epoch
        core = self.core
        stop_at = self._clock() + TURN_BUDGET
        now = self._wallclock()
        budget = self.config.collector_batch
        link = self.relay if core.role is Role.RELAY else None
        clock = self._clock
        while True:
            outcome = FollowOutcome.OK
            if link is not None:
                link.heard(frames)
            if link is not None and is_control(frames):
                # The upstream's notices to our own key (CURVE): not updates.
                link.on_control(frames)
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
                        self._followed,
                        core.store.sequence,
                        core.highest_seen,
                    )
                    self._request_snapshot()
            # Decide to yield *before* taking the next message, never after:
            # a message received and then abandoned is lost for good.
            budget -= 1
            if self._turn_over(budget, stop_at):
                return
            if sub is None or sub is not self._peer_sub or sub.closed():
                return
            try:
                frames = recv_frames(sub.socket)
            except zmq.Again:
                return

    def _on_sync_reply(self, frames: list[bytes]) -> None:
        """A turn of the snapshot (or catch-up) we asked for, then its commit."""
        try:
            self._take_sync_reply(frames)
        finally:
            self._commit_followed()

    def _take_sync_reply(self, frames: list[bytes]) -> None:
        dealer = self._peer_dealer
        if self._ha is not None:
            self.core.term = self._ha.peer_epoch
        core = self.core
        self._sync_progress = stop_at = self._clock()
        link = self.relay if core.role is Role.RELAY else None
        if link is not None:
            link.heard_now()
        stop_at += TURN_BUDGET
        clock = self._clock
        now = self._wallclock()
        budget = self.config.collector_batch
        while True:
            try:
                # Read after the message: a ttl in it counts from no earlier than its arrival.
                outcome = core.on_snapshot_reply(frames, now, clock())
                if (
                    core.split_left
                    and not self._split_queue
                    and not self._split_scheduled
                    and core.role is Role.PASSIVE
                ):
                    self._forward_split_writes()  # the fork is known: send them now
            except ProtocolError as exc:
                self._throttle.log(
                    "sync_reply", logging.WARNING, "dropped a snapshot entry from the peer: %s", exc
                )
                outcome = FollowOutcome.OK
            if outcome is FollowOutcome.SYNCED:
                if link is not None:
                    link.synced()
                    if core.last_sync == "full":
                        self._views_replaced()
                log.info(
                    "synced from %s (%s): %d keys at sequence %d in %.2f s",
                    self._followed,
                    core.last_sync,
                    len(core.store),
                    core.store.sequence,
                    self._clock() - self._sync_started,
                )
                if core.role is Role.PASSIVE:
                    self._forward_split_writes()
                assert self._loop is not None
                self._loop.add_callback(self._close_dealer_if, dealer)
                return
            if outcome is FollowOutcome.RESYNC:
                self._throttle.log("gap", logging.INFO, "updates missed during the sync; resyncing")
                self._request_snapshot()
                return
            budget -= 1
            if self._turn_over(budget, stop_at):
                return
            if is_kvbatch(frames) and self._clock() > stop_at:
                return  # a KVBATCH is thousands of entries: check after each one
            if dealer is None or dealer is not self._peer_dealer or dealer.closed():
                return
            try:
                frames = recv_frames(dealer.socket)
            except zmq.Again:
                return

    def _close_dealer_if(self, dealer: ZMQStream | None) -> None:
        if dealer is not None and dealer is self._peer_dealer:
            self._close_dealer()

    def _close_dealer(self) -> None:
        dealer, self._peer_dealer = self._peer_dealer, None
        if dealer is not None:
            self._forget(dealer)

    def _close_peer(self) -> None:
        self._close_dealer()
        sub, self._peer_sub = self._peer_sub, None
        if sub is not None:
            self._forget(sub)
