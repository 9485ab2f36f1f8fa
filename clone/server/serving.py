"""The snapshot port (ROUTER, P): requests, Binary Star votes and streams.

How this works: ICANHAZ? -> Binary Star vote -> a
:class:`~clone.server.snapshot.SnapshotStream` pumped a chunk per loop turn
with ``ROUTER_MANDATORY`` and non-blocking sends.  EAGAIN pauses that stream
and retries shortly (no entry is dropped); EHOSTUNREACH aborts it; a stream
that makes no progress for ``snapshot_stall_timeout`` is aborted.

A vote refused only because the peer does not look dead *yet* (we are
passive, or a primary still starting) is *deferred*: held, bounded in number
and age, and voted again at the peer's expiry time, every housekeeping tick
and when we become active; served if accepted then, dropped when it ages out.
A client that noticed the active server's crash before we did is then served
the moment we notice it too, instead of after its own retry.  Which requests
are held, for how long and when to vote again is :mod:`.votes` (sans-IO); this
module keeps the timer, the vote and the sockets.

STATUS? **[extension: status]** is answered here too, before any of that: at
once, by an active or a passive server alike (it is no vote), rate-limited by a
token bucket, with :func:`~clone.server.status.server_status`.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from clone.errors import ProtocolError
from clone.security import PEER_USER
from clone.server.base import CLOCK_EVERY, TURN_BUDGET, AnyStream, ServerBase, log, who
from clone.server.core import Role
from clone.server.delta import DeltaStream
from clone.server.sending import Burst, Sent, send
from clone.server.snapwindow import SendWindow, retry_delay, stalest
from clone.wire.calls import CALL
from clone.wire.conflicts import CONFLICTS_REQUEST
from clone.wire.control import view_id
from clone.wire.delta import SinceRequest, parse_since
from clone.wire.frames import NOBLOCK, recv_zero_copy
from clone.wire.protocol import (
    APPLIED_PROPERTY,
    APPLIED_VERSION,
    BATCH_PROPERTY,
    BATCH_VERSION,
    SINCE_PROPERTY,
    STATUS_REQUEST,
    STEPPED_DOWN_PROPERTY,
    TTL_LEFT_NAME,
    TTL_LEFT_VERSION,
)
from clone.wire.status import encode_status

__all__ = ["ServingMixin"]

# All snapshot streams together send for at most this long per loop turn
# (each stream also at most --snapshot-chunk messages and its byte window).
SNAPSHOT_SLICE = TURN_BUDGET
# When every slot is taken, a stream whose requester has read nothing for this
# long gives its slot to a new request.  Under our client's re-ask interval (a
# quarter heartbeat at the default 250 ms): a reader always reads within it.
_SLOT_IDLE = 0.25
# Requests that wait for a slot at most, and for how long: a client re-asks on
# a fresh socket every quarter heartbeat, so an older request has no reader.
_WAITING_MAX = 1000
_WAITING_MAX_AGE = 2.0
# How long a requester's identity may stay unroutable (EHOSTUNREACH) before its
# stream is aborted as gone.  With ROUTER_MANDATORY libzmq also says
# EHOSTUNREACH for a live peer whose pipe it marked inactive when the pipe was
# full and has not reactivated yet (libzmq issue 2348): a slow reader, not a
# vanished one.  Aborting at once cost such a client its whole snapshot.
_UNREACHABLE_GRACE = 0.5
# Snapshot requests handled after one pump turn at most (see _take_router_backlog).
_ROUTER_BACKLOG_BATCH = 100


def _has_metadata(frame: zmq.Frame, name: str, value: str) -> bool:
    """Whether the requester's connection carries our metadata ``name:value``.

    A peer that did not set it (the Guide's clients, raw tools) makes libzmq
    raise EINVAL: it gets the standard stream.
    """
    try:
        return bool(frame.get(name) == value)
    except zmq.ZMQError:
        return False


def _wants_batches(frame: zmq.Frame) -> bool:
    """KVBATCHes instead of KVSYNCs (:mod:`clone.wire.batch`)."""
    return _has_metadata(frame, BATCH_PROPERTY, BATCH_VERSION)


def _since(frame: zmq.Frame) -> SinceRequest | None:
    """The requester's catch-up or history request (:mod:`clone.wire.delta`), if any.

    Raises ProtocolError for a malformed one (the caller serves the whole state).
    """
    try:
        value = frame.get(SINCE_PROPERTY)
    except zmq.ZMQError:
        return None
    return parse_since(str(value))


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id of the connection a message came on (CURVE), or None."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return None


def _wants_ttl_left(frame: zmq.Frame) -> bool:
    """Ephemeral entries with the time they have left: a peer server's sync
    (:mod:`clone.server.ttl`)."""
    return _has_metadata(frame, TTL_LEFT_NAME, TTL_LEFT_VERSION)


def _stepped_down(frame: zmq.Frame) -> bool:
    """A peer's sync that says it stepped down from active in this run: a
    split brain's loser, with writes to forward (clone.server.healing)."""
    return _has_metadata(frame, STEPPED_DOWN_PROPERTY, "1")


def _wants_applied(frame: zmq.Frame) -> bool:
    """The applied-update list first: a peer server's sync (:mod:`clone.wire.applied`)."""
    return _has_metadata(frame, APPLIED_PROPERTY, APPLIED_VERSION)


class ServingMixin(ServerBase):
    """Answer snapshot requests: vote, hold, stream, stall and abort."""

    # -- the snapshot port ---------------------------------------------------

    def _on_router(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        if len(parts) == 2 and parts[1].bytes == STATUS_REQUEST:
            self._answer_status(identity, parts[1])
            return
        if len(parts) > 1 and parts[1].bytes == CALL:
            self._on_call(identity, parts)
            return
        if len(parts) > 1 and parts[1].bytes == CONFLICTS_REQUEST:
            self._answer_conflicts(identity, parts)
            return
        batch = len(parts) > 1 and _wants_batches(parts[1])
        applied = len(parts) > 1 and _wants_applied(parts[1])
        if applied:
            # The peer's sync; a loser's says so (the heal defers client snapshots).
            self.healer.peer_sync_started(stepped_down=_stepped_down(parts[1]))
        ttl_left = len(parts) > 1 and _wants_ttl_left(parts[1])
        since: SinceRequest | None = None
        if len(parts) > 1:
            try:
                since = _since(parts[1])
            except ProtocolError as exc:
                self._throttle.log(
                    "since", logging.WARNING, "ignored a bad catch-up request: %s", exc
                )
        user = _user_id(parts[1]) if len(parts) > 1 and self._keypair is not None else None
        frames = [part.bytes for part in parts[1:]]
        try:
            subtree = self.core.snapshot_request(frames)
        except ProtocolError as exc:
            self._throttle.log(
                "icanhaz", logging.WARNING, "dropped a request from %s: %s", who(identity), exc
            )
            return
        if not applied and self.healer.defers_clients():
            # Healing a split brain: the loser's writes are still coming in,
            # and a client synced now would lose them from its view until
            # they came (the island's own confirmed writes gone, then back).
            # Held, and answered when the hold ends (a client that asks again
            # meanwhile is answered on its new connection; the old one's
            # stream is dropped as unroutable).
            self.counters["snapshots_held_heal"] += 1
            self.healer.hold_request(identity, subtree, {
                "batch": batch, "since": since, "user": user, "ttl_left": ttl_left})
            log.debug("snapshot request from %s held: healing a split brain", who(identity))
            return
        ha = self._ha
        if ha is not None and not ha.accept_vote():
            # Binary Star: a server that may not serve stays silent.  If only
            # the peer's not-yet-expired heartbeat stands in the way, hold the
            # request and vote again when it expires; otherwise the client
            # times out and fails over to the other server.
            if not self._defer_vote(identity, subtree, batch, applied, user, since, ttl_left):
                self.counters["snapshots_refused"] += 1
                log.debug("snapshot request from %s not served (%s)", who(identity), ha.state.name)
            return
        # Served now: a held copy of the same request must not be served again.
        self._deferred.discard(identity, subtree)
        self._serve(
            identity,
            subtree,
            batch=batch,
            applied=applied,
            since=since,
            user=user,
            ttl_left=ttl_left,
        )

    def _serve(
        self,
        identity: bytes,
        subtree: str,
        *,
        deferred: bool = False,
        batch: bool = False,
        applied: bool = False,
        since: SinceRequest | None = None,
        user: str | None = None,
        ttl_left: bool = False,
    ) -> None:
        """Stream a snapshot for an accepted vote (in KVBATCHes if ``batch``,
        after the applied-update list if ``applied``), or only the updates
        after ``since`` when the history still holds them (a client's history
        request: those or a compacted reply, never a snapshot).  ``ttl_left``:
        ephemeral entries carry the time they have left (a peer server's sync)."""
        if self.core.role in (Role.STARTING, Role.PASSIVE):
            # The vote was accepted; make sure the promotion happened first.
            # (A relay serves its copy at any time: it has no vote to win.)
            self._on_became_active()
        for old in [s for s in self._snapshots if s.identity == identity]:
            # The same requester asked again on the same socket: it gave up on
            # the stream it had (one stream per requester, never two interleaved).
            self.counters["snapshots_replaced"] += 1
            self._abort_snapshot(old, "the requester asked again")
        if len(self._snapshots) >= self.config.max_snapshots:
            self._evict_unroutable()
        if len(self._snapshots) >= self.config.max_snapshots:
            self._evict_stalest()
        if len(self._snapshots) >= self.config.max_snapshots:
            # Every slot holds a requester that reads: wait for one to free.
            self._wait_for_slot(
                identity,
                subtree=subtree,
                deferred=deferred,
                batch=batch,
                applied=applied,
                since=since,
                user=user,
                ttl_left=ttl_left,
            )
            return
        allowed: tuple[bytes, ...] | None = None
        end_properties: tuple[tuple[str, str], ...] = ()
        if self._keypair is not None:
            # CURVE: the requester's rights decide what the snapshot holds;
            # the peer-only extensions are for the pair's own key alone.
            rights = self._rights_of(user if user in self._admitted else None)
            if user != PEER_USER:
                # A client's history request stays, filtered by its read
                # prefixes below.  A digest catch-up extends the requester's
                # whole map, so it is for those who may read everything: a
                # restricted client's view count comes only from the KTHXBAI
                # of a filtered snapshot.
                applied = False
                if since is not None and not since.history and not rights.read_all:
                    since = None
            if not rights.read_all:
                allowed = rights.read
                vid = view_id(rights.read)
                count = self._view_counts.get(vid, 0)
                end_properties = (("view", vid), ("view_count", str(count)))
        stream = self.core.open_snapshot(
            identity,
            subtree,
            batch=batch,
            applied=applied,
            now=self._wallclock(),
            clock=self._clock if ttl_left else None,
            since=since,
            allowed=allowed,
            end_properties=end_properties,
        )
        if isinstance(stream, DeltaStream) and since is not None and not since.history:
            # The peer always asks for the applied list too; a client never does.
            self.counters["catchups_served" if applied else "client_catchups_served"] += 1
        self._snapshots[stream] = self._snapshot_started[stream] = self._clock()
        if applied:
            self._peer_syncs.add(stream)  # the peer's sync: a heal waits for it
            self.healer.peer_sync_served()
        self._in_flight[stream] = self._window_of(identity)
        if deferred:
            self._deferred_streams.add(stream)
        log.debug(
            "snapshot for %s: subtree %r, up to %d keys at sequence %d%s",
            who(identity),
            subtree,
            stream.total_keys,
            stream.sequence,
            ", batched" if batch else "",
        )
        # Its first messages now while this turn's slice for new streams
        # lasts (a small snapshot is done at once, its slot free again), else
        # in the next turn: a storm of requests must not each send a chunk
        # within one turn.
        end = self._serve_slice()
        if self._clock() < end:
            self._pump(stream, end)
        else:
            self._wake(stream)

    def _serve_slice(self) -> float:
        """The end of this loop turn's slice for newly served streams."""
        end = self._serve_slice_end
        if end is None:
            end = self._serve_slice_end = self._clock() + SNAPSHOT_SLICE
            assert self._loop is not None
            self._loop.add_callback(self._end_serve_slice)
        return end

    def _end_serve_slice(self) -> None:
        self._serve_slice_end = None

    def _wait_for_slot(self, identity: bytes, **how: Any) -> None:
        """Hold a request that found every slot taken by a reader, bounded in
        number and age (:data:`_WAITING_MAX`, :data:`_WAITING_MAX_AGE`)."""
        waiting = self._waiting
        waiting.pop(identity, None)  # asked again: keep the newest, last
        if len(waiting) >= _WAITING_MAX:
            oldest = next(iter(waiting))
            del waiting[oldest]
            self.counters["snapshots_refused"] += 1
        waiting[identity] = (self._clock(), how)
        self.counters["snapshots_queued"] += 1
        self._throttle.log(
            "snapshots_full",
            logging.INFO,
            "%d snapshots in flight: requests wait for a slot (%d waiting)",
            len(self._snapshots),
            len(waiting),
        )

    def _admit_waiting(self) -> None:
        """Serve waiting requests while slots are free or a requester that
        reads nothing gives one up; drop those too old (their requester has
        asked again on a fresh socket by then)."""
        waiting = self._waiting
        if not waiting:
            return
        if self.core.role in (Role.STARTING, Role.PASSIVE) or self._stopping:
            # Their vote was won by the active server we no longer are.
            self.counters["snapshots_refused"] += len(waiting)
            waiting.clear()
            return
        cutoff = self._clock() - _WAITING_MAX_AGE
        while waiting:
            if len(self._snapshots) >= self.config.max_snapshots and not self._evict_stalest():
                break
            # Newest first: an older request's client has likely asked again
            # on a fresh socket, and a burst of requesters that read nothing
            # must not stand between a reader and the next slot.
            identity = next(reversed(waiting))
            at, how = waiting.pop(identity)
            if at < cutoff:
                self.counters["snapshots_refused"] += 1
                continue
            self._serve(identity, **how)
        for identity in [i for i, (at, _) in waiting.items() if at < cutoff]:
            del waiting[identity]
            self.counters["snapshots_refused"] += 1

    def _window_of(self, identity: bytes) -> SendWindow:
        """The requester's byte window: the one it still has, with what its
        earlier streams left in its pipe, or a new one."""
        window = self._peer_windows.get(identity)
        if window is None:
            window = self._peer_windows[identity] = SendWindow(self._snapshot_budget.window)
        return window

    def _forget_settled_windows(self) -> None:
        """Drop the windows of requesters without a stream whose bytes are
        written (or freed with their dropped connection)."""
        busy = {stream.identity for stream in self._snapshots}
        windows = self._peer_windows
        for identity in [i for i in windows if i not in busy]:
            window = windows[identity]
            window.update()
            if window.settled:
                del windows[identity]

    def _wake(self, stream: AnyStream) -> None:
        """Give ``stream`` a turn in the loop's snapshot slice (once, in order)."""
        if stream not in self._snapshots or self._loop is None or self._stopping:
            return
        self._pump_queue[stream] = None
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._loop.add_callback(self._pump_turn)

    def _pump_turn(self) -> None:
        """One loop turn's share of snapshot streaming: the streams that wait,
        round robin, until :data:`SNAPSHOT_SLICE` is spent; the rest wait for
        the next turn, after the loop has looked at its sockets and timers.

        Each stream used to pump from a callback of its own, each with a whole
        turn's budget, so 200 streams took 2.3 s of one loop turn: the HUGZ
        stopped and the backup took over.
        """
        self._pump_scheduled = False
        queue = self._pump_queue
        stop_at = self._clock() + SNAPSHOT_SLICE
        for _ in range(len(queue)):
            if not queue:
                break
            stream = next(iter(queue))
            del queue[stream]
            self._pump(stream, stop_at)
            if self._clock() > stop_at:
                break
        if queue and not self._pump_scheduled and self._loop is not None:
            self._pump_scheduled = True
            self._loop.add_callback(self._pump_turn)
        self._admit_waiting()

    def _pump(self, stream: AnyStream, stop_at: float) -> None:
        """Send ``stream``'s next messages until ``stop_at``, its chunk, or its
        byte window (:mod:`.snapwindow`) is full; then yield to the loop."""
        if stream not in self._snapshots or self._loop is None:
            return  # aborted meanwhile
        sock = self._router
        assert sock is not None
        window = self._in_flight.get(stream)
        if window is None:
            window = self._in_flight[stream] = self._window_of(stream.identity)
        self._note_progress(stream, window)
        # A KVBATCH is thousands of entries: check the clock after each one.
        clock_every = 1 if stream.batch else CLOCK_EVERY
        trackers: list[zmq.MessageTracker] = []
        # The pump runs from loop callbacks, not the ROUTER stream's: the
        # burst looks at the requests its sends may have hidden (sending.py),
        # after the turn, whichever way the turn ends.
        with Burst(self._take_router_backlog) as burst:
            try:
                for n in range(self.config.snapshot_chunk):
                    if (n + 1) % clock_every == 0 and self._clock() > stop_at:
                        break
                    if not window.may_send():
                        self._stall(stream, window)
                        return
                    frames = stream.peek()
                    if frames is None:
                        # Done, or a long run of keys outside the subtree was
                        # skipped: either way, give the loop back.
                        break
                    nbytes = sum(map(len, frames))
                    if window.track_next(nbytes):
                        sent = burst.send(sock, frames, trackers=trackers)
                        tracker = trackers.pop() if sent is Sent.OK else None
                    else:
                        sent = burst.send(sock, frames)
                        tracker = None
                    if sent is Sent.FULL:
                        # The requester's pipe is full: wait for it, drop
                        # nothing, and track the next message (its progress).
                        window.blocked()
                        self._stall(stream, window)
                        return
                    if sent is Sent.GONE:
                        self._unroutable(stream, window)
                        return
                    window.sent(nbytes, tracker)
                    self._unreachable.pop(stream, None)
                    stream.advance()
                    if stream.done:
                        break
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("internal error while streaming a snapshot")
                self._abort_snapshot(stream, "internal error")
                return
        if stream not in self._snapshots:
            return  # a request the burst took after it replaced or evicted this stream
        if stream.done:
            del self._snapshots[stream]
            started = self._snapshot_started.pop(stream, None)
            if started is not None:
                self.monitor.snapshot_seconds.observe(self._clock() - started)
            self._in_flight.pop(stream, None)
            self._unreachable.pop(stream, None)
            self._deferred_streams.discard(stream)
            if stream in self._peer_syncs:
                self._peer_syncs.discard(stream)
                self.healer.peer_sync_done()
            c = self.counters
            c["snapshots_served"] += 1
            c["snapshot_entries_sent"] += stream.sent
            if stream.batch:
                c["snapshots_batched"] += 1
                c["snapshot_batches_sent"] += stream.batches_sent
            log.debug(
                "snapshot for %s done: %d entries in %d messages, sequence %d",
                who(stream.identity),
                stream.sent,
                stream.batches_sent if stream.batch else stream.sent,
                stream.sequence,
            )
            return
        self._wake(stream)

    def _take_router_backlog(self) -> None:
        """Handle snapshot requests that our own sends may have hidden.

        The pump sends on the ROUTER directly, and a send can consume the edge
        of the socket's file descriptor that announces a new request: the
        ZMQStream then never wakes for it, and a request that came in during
        a long snapshot could wait until something else stirred the socket
        (seen: 10 s).  So after sending we ask the socket itself.
        """
        sock = self._router
        if sock is None or sock.closed or self._taking_backlog:
            # Already taking it, further up this very stack: a request served
            # from here pumps its first chunk, which would come back here, one
            # level deeper per request (a failover's storm of requests hit
            # Python's recursion limit).  The outer loop goes on instead.
            return
        self._taking_backlog = True
        try:
            for _ in range(_ROUTER_BACKLOG_BATCH):
                # No poll(0) first: a non-blocking receive asks the socket the
                # same, and pyzmq's poll builds a Poller each time (with the
                # RCVMORE reads recv_multipart makes, a tenth of the server's
                # time under a bulk load of calls, issue 29).
                try:
                    parts = recv_zero_copy(sock, NOBLOCK)
                except zmq.Again:
                    return
                self._on_router_guarded(parts)
            # A full batch: more may be waiting; look again next turn.
            if self._loop is not None:
                self._loop.add_callback(self._take_router_backlog)
        finally:
            self._taking_backlog = False

    def _stall(self, stream: AnyStream, window: SendWindow) -> None:
        """The requester is not keeping up (its byte window or its pipe is
        full): look again shortly, drop nothing.

        Soon after progress, seldom once it has read nothing for a while
        (:func:`~clone.server.snapwindow.retry_delay`).  The pump's burst then
        looks at the ROUTER's backlog if this turn tried a send (even one that
        found the pipe full or the requester unroutable), or a request hidden
        by it would wait until something else stirred the socket (seen: 10 s,
        with a stream retrying for its unroutable grace).
        """
        assert self._loop is not None
        self.counters["snapshot_stalls"] += 1
        now = self._clock()
        last = self._note_progress(stream, window)
        self._loop.call_later(retry_delay(now - last), self._wake, stream)

    def _unroutable(self, stream: AnyStream, window: SendWindow) -> None:
        """EHOSTUNREACH: the requester went away, or its pipe is only slow to
        reactivate; abort once it has stayed unroutable for the grace."""
        now = self._clock()
        since = self._unreachable.setdefault(stream, now)
        if now - since >= _UNREACHABLE_GRACE:
            # The pump's burst looks at the backlog our failed send may have hidden.
            self._abort_snapshot(stream, "requester went away", gone=True)
            return
        self.counters["snapshot_unroutable_retries"] += 1
        self._stall(stream, window)

    def _evict_unroutable(self) -> None:
        """A request needs a slot: streams whose requester is unroutable now
        give theirs up at once, as gone, instead of after the grace.

        The grace protects a live reader libzmq briefly calls unroutable; a
        client that asks again on a fresh socket leaves its old stream
        unroutable for good, and holding its slot for the grace turned away
        other requests (the relay resync bench: a third more retries).
        """
        for stream in list(self._unreachable):
            self._abort_snapshot(stream, "requester went away", gone=True)

    def _evict_stalest(self) -> bool:
        """A request needs a slot and none is free: the stream whose requester
        has read nothing for longest gives up its own, if for at least
        :data:`_SLOT_IDLE` (a requester that reads nothing must not keep
        one that reads from being served).  True if one was freed.

        A stream waiting for its turn in the pump (``_pump_queue``) waits for
        us, not for its requester: in a storm of requests on a busy machine
        new streams waited that long before their first send, and were
        evicted, their requesters never answered."""
        for stream, window in self._in_flight.items():
            self._note_progress(stream, window)
        now = self._clock()
        busy = [*self._peer_syncs, *self._pump_queue]
        victim = stalest(self._snapshots, now, _SLOT_IDLE, exclude=busy)
        if victim is None:
            return False
        idle = now - self._snapshots[victim]
        self.counters["snapshots_evicted"] += 1
        self._abort_snapshot(victim, f"its slot went to a new request ({idle:.1f} s unread)")
        return True

    def _note_progress(self, stream: AnyStream, window: SendWindow) -> float:
        """Whether the requester read since we last looked (its checkpoints);
        the time of its last progress."""
        if window.update() and stream in self._snapshots:
            self._snapshots[stream] = self._clock()
        return self._snapshots.get(stream, self._clock())

    def _abort_snapshot(self, stream: AnyStream, why: str, *, gone: bool = False) -> None:
        self._peer_syncs.discard(stream)
        self._snapshot_started.pop(stream, None)
        self._unreachable.pop(stream, None)
        self._pump_queue.pop(stream, None)
        if self._snapshots.pop(stream, None) is None:
            return
        self._in_flight.pop(stream, None)
        if stream in self._deferred_streams:
            self._deferred_streams.discard(stream)
            if gone and stream.sent == 0:
                # Expected: the client asked again on a fresh DEALER (or moved
                # on) while its request was held; its old socket is closed.
                self.counters["votes_deferred_gone"] += 1
                log.debug("deferred snapshot request from %s: requester gone", who(stream.identity))
                return
        self.counters["snapshots_aborted"] += 1
        self._throttle.log(
            "snapshot_abort",
            logging.INFO,
            "snapshot for %s aborted after %d entries: %s",
            who(stream.identity),
            stream.sent,
            why,
        )

    def _check_stalled_snapshots(self) -> None:
        """Abort the streams whose requester read nothing for
        ``snapshot_stall_timeout``: their slot goes back (their bytes when the
        kernel drops the connection: ``TCP_MAXRT``, set in the reactor)."""
        if self._peer_windows:
            self._forget_settled_windows()
        if not self._snapshots:
            self._admit_waiting()
            return
        for stream, window in self._in_flight.items():
            self._note_progress(stream, window)
        cutoff = self._clock() - self.config.snapshot_stall_timeout
        for stream, last in list(self._snapshots.items()):
            if last < cutoff:
                self.counters["snapshots_idle_aborted"] += 1
                self._abort_snapshot(stream, "requester stopped reading")
        self._admit_waiting()

    # -- status [extension] ----------------------------------------------------

    def _answer_status(self, identity: bytes, frame: zmq.Frame) -> None:
        """STATUS?: answer at once, never vote; drop when over the rate or gone."""
        c = self.counters
        c["status_requests"] += 1
        if self._keypair is not None and _user_id(frame) not in self._admitted:
            c["status_dropped"] += 1  # ZAP let it in, but its name was removed
            return
        if not self._status_limiter.allow(self._clock()):
            c["status_dropped"] += 1
            self._throttle.log(
                "status_rate", logging.INFO, "STATUS? requests over the rate limit dropped"
            )
            return
        sock = self._router
        assert sock is not None
        # From the ROUTER's reader (its stream's callback, or the backlog loop):
        # it looks at the socket again after us.
        sent = send(sock, [identity, *encode_status(self.monitor.status())], backlog=None)
        if sent is not Sent.OK:
            c["status_dropped"] += 1  # its pipe is full (it will time out), or it is gone

    # -- deferred votes --------------------------------------------------------

    def _defer_vote(
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

    def _recheck_deferred_soon(self) -> None:
        if self._loop is not None:
            self._loop.add_callback(self._recheck_deferred_guarded)

    def _recheck_deferred_guarded(self) -> None:
        try:
            self._recheck_deferred()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in the deferred-vote check")

    def _recheck_deferred(self) -> None:
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
                self._recheck_deferred_soon()
                return
        self._schedule_deferred_check()
