"""Snapshot streams on the snapshot port (ROUTER, P): slots, windows, the pump.

How this works: an accepted request becomes a
:class:`~clone.server.snapshot.SnapshotStream` (or a catch-up,
:class:`~clone.server.delta.DeltaStream`) pumped a chunk per loop turn with
``ROUTER_MANDATORY`` and non-blocking sends, all streams together within one
slice of the turn (:data:`SNAPSHOT_SLICE`), shared fairly by the hosts the
requests come from (:mod:`.fairshare`).  EAGAIN pauses that stream and
retries shortly (no entry is dropped); EHOSTUNREACH aborts it after a grace;
a stream that makes no progress for ``snapshot_stall_timeout`` is aborted.
Each requester's bytes in libzmq are bounded by its window
(:mod:`.snapwindow`); when every slot is taken a requester that reads nothing
gives its slot up, or a host holding more than the asker's, or the request
waits for one, bounded (the slot rules: :mod:`.snapslots`).

:class:`SnapshotStreams` is a part of the server: it owns the streams and
their windows, the pump's queue and the requests waiting for a slot.  The
port's reader (:mod:`.serving`) and the held votes (:mod:`.voting`) hand it
requests through :meth:`SnapshotStreams.serve`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
from tornado.ioloop import IOLoop

from clone.server.access import Access
from clone.server.config import ServerConfig
from clone.server.core import Role, ServerCore
from clone.server.counting import DurationHistogram
from clone.server.delta import DeltaStream
from clone.server.fairshare import (
    HostRoundRobin,
    SliceShares,
    SliceWindows,
    host_weights,
    over_share,
)
from clone.server.opening import AnyStream, Opener
from clone.server.requesters import Requester, replaced, replaced_waiting, stale, stale_waiting
from clone.server.sending import Burst, Sent
from clone.server.shared import CLOCK_EVERY, TURN_BUDGET, Shared
from clone.server.sharedsnap import SharedSnapshots, SharedStream
from clone.server.snapslots import SnapshotSlots
from clone.server.snapwindow import SendWindow, SnapshotBudget, retry_delay
from clone.wire.delta import SinceRequest
from clone.wire.frames import shared_frame

__all__ = ["SNAPSHOT_SLICE", "AnyStream", "SnapshotStreams", "who"]

log = logging.getLogger("clone.server.reactor")

# All snapshot streams together send for at most this long per loop turn
# (each stream also at most --snapshot-chunk messages and its byte window).
SNAPSHOT_SLICE = TURN_BUDGET
# How long a requester's identity may stay unroutable (EHOSTUNREACH) before its
# stream is aborted as gone.  With ROUTER_MANDATORY libzmq also says
# EHOSTUNREACH for a live peer whose pipe it marked inactive when the pipe was
# full and has not reactivated yet (zeromq/libzmq#2348): a slow reader, not a
# vanished one.  Aborting at once cost such a client its whole snapshot.
_UNREACHABLE_GRACE = 0.5


def who(identity: bytes) -> str:
    return identity.hex() if identity else "?"


class SnapshotStreams(SnapshotSlots):
    """Stream snapshots for accepted requests: slots, stalls, aborts.

    Built with the ROUTER it sends on and the loop it schedules turns on, and with callbacks:
    ``backlog`` (the port reader's look at the ROUTER's backlog after a send outside its
    callback: :mod:`.sending`), ``promote`` (the role switch: a won vote makes a starting or
    passive server active first), ``peer_sync_opened`` / ``peer_sync_done`` (the healer's: a
    peer's sync began, with a catch-up's first sequence, or finished streaming),
    ``view_count`` (security's count of a restricted view's keys) and ``stopping``.
    ``access`` gives each requester's read rights under CURVE (``secure``); ``durations``
    records how long each stream took (the metrics' histogram).
    ``held``, set by the wiring (:mod:`.diskgate`), says whether a stream's next message waits.
    """

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        access: Access,
        router: zmq.Socket[Any],
        loop: IOLoop,
        *,
        secure: bool,
        backlog: Callable[[], None],
        promote: Callable[[], None],
        peer_sync_opened: Callable[[int | None], None],
        peer_sync_done: Callable[[], None],
        view_count: Callable[[str], int],
        durations: DurationHistogram,
        stopping: Callable[[], bool],
    ) -> None:
        self.config = config
        self.core = core
        self.counters = shared.counters
        self._throttle = shared.throttle
        self._clock = shared.clock
        self._wallclock = shared.wallclock
        self._router: zmq.Socket[Any] | None = router
        self._loop: IOLoop | None = loop  # None once closed: nothing more is scheduled
        self._backlog = backlog
        self._promote = promote
        self._peer_sync_opened = peer_sync_opened
        self._peer_sync_done = peer_sync_done
        self._durations = durations
        self._stopping_of = stopping
        self._snapshots: dict[AnyStream, float] = {}  # stream -> last progress
        self._snapshot_started: dict[AnyStream, float] = {}
        # Each stream's bytes handed to libzmq and not yet written out, within
        # its share of --snapshot-bytes (clone.server.snapwindow).
        self._snapshot_budget = SnapshotBudget(config.snapshot_bytes, config.max_snapshots)
        # Full snapshots encoded once for every requester of the same one.
        self._opener = Opener(core, access, SharedSnapshots(self._snapshot_budget.shared,
                                                            shared_frame), shared.counters,
                              secure=secure, view_count=view_count, wallclock=shared.wallclock,
                              clock=shared.clock)  # fmt: skip
        self._in_flight: dict[AnyStream, SendWindow] = {}
        # The same windows by requester, kept after a stream ends until what
        # libzmq holds for that requester is written (or its connection dropped).
        self._peer_windows: dict[bytes, SendWindow] = {}
        # Streams waiting for their turn of the loop's snapshot slice, one
        # host after another (wake, _pump_turn), and whether a turn is due.
        self._pump_queue: HostRoundRobin[AnyStream] = HostRoundRobin()
        self._pump_scheduled = False
        # The pump's slices, paced in wall time while a reader's host holds a
        # slot, and the timer of a turn that waits for the next one.
        self._slices = SliceWindows(SNAPSHOT_SLICE)
        self._pump_timer: object | None = None
        # This loop turn's slice for the first messages of newly served
        # streams, shared by host (None: not opened this turn).
        self._serve_shares: SliceShares | None = None
        # Requests that found every slot taken: requester -> (when, how to
        # serve it), oldest first; served as slots free, bounded.
        self._waiting: dict[bytes, tuple[float, dict[str, Any]]] = {}
        # Streams whose last send said EHOSTUNREACH, and since when (see
        # _UNREACHABLE_GRACE): gone, or only a pipe libzmq has not reactivated.
        self._unreachable: dict[AnyStream, float] = {}
        self._deferred_streams: set[AnyStream] = set()  # served from a held vote
        # The peer's sync streams: a heal waits for them.
        self._peer_syncs: set[AnyStream] = set()
        # Who asked for each stream: a new request of theirs replaces it.
        self._requesters: dict[AnyStream, Requester] = {}
        self.held: Callable[[AnyStream, Any], bool] = lambda stream, frames: False

    @property
    def _stopping(self) -> bool:
        return self._stopping_of()

    def __len__(self) -> int:
        """Streams in flight."""
        return len(self._snapshots)

    def __contains__(self, stream: object) -> bool:
        return stream in self._snapshots

    def abort_all(self, why: str) -> None:
        """Abort every stream (the server became passive)."""
        for stream in list(self._snapshots):
            self.abort(stream, why)

    def close(self) -> None:
        """The server stops: every stream and waiting request dropped."""
        self._cancel_pump_timer()
        self._loop = None
        self._router = None
        self._snapshots.clear()
        self._in_flight.clear()
        self._peer_windows.clear()
        self._pump_queue.clear()
        self._waiting.clear()
        self._deferred_streams.clear()
        self._peer_syncs.clear()
        self._requesters.clear()
        self._opener.shares.clear()

    def serve(
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
        requester: str | None = None,
        host: str | None = None,
    ) -> None:
        """Stream a snapshot for an accepted vote (in KVBATCHes if ``batch``,
        after the applied-update list if ``applied``), or only the updates
        after ``since`` when the history still holds them (a client's history
        request: those or a compacted reply, never a snapshot).  ``ttl_left``:
        ephemeral entries carry the time they have left (a peer server's sync).
        ``requester``: the client's own id (``X-CHP-Requester``): this request
        replaces that client's older stream or waiting request.  ``host``:
        the address it connects from, its share of slots and turns
        (:mod:`.fairshare`)."""
        if self.core.role in (Role.STARTING, Role.PASSIVE):
            # The vote was accepted; make sure the promotion happened first.
            # (A relay serves its copy at any time: it has no vote to win.)
            self._promote()
        asker = Requester(identity, requester, user, subtree, host)
        if stale(self._requesters.values(), asker) or stale_waiting(self._waiting, asker):
            self.counters["snapshots_replaced"] += 1  # a late copy: the newer one is served
            return
        for old in replaced(self._requesters, asker):
            # The same requester asked again, on this socket or (naming itself)
            # a fresh one: one stream per requester, its slot the new request's.
            self.counters["snapshots_replaced"] += 1
            self.abort(old, "the requester asked again")
        for old_identity in replaced_waiting(self._waiting, asker):
            del self._waiting[old_identity]
            self.counters["snapshots_replaced"] += 1
        if len(self._snapshots) >= self.config.max_snapshots:
            self._evict_unroutable()
        if len(self._snapshots) >= self.config.max_snapshots:
            self._evict_stalest(host)
        if len(self._snapshots) >= self.config.max_snapshots:
            self._evict_for_host(host)
        if len(self._snapshots) >= self.config.max_snapshots:
            # Every slot holds a requester that reads: wait for one to free.
            self._wait_for_slot(identity, subtree=subtree, deferred=deferred, batch=batch,
                                applied=applied, since=since, user=user, ttl_left=ttl_left,
                                requester=requester, host=host)  # fmt: skip
            return
        stream, applied = self._opener.open(identity, subtree, batch=batch, applied=applied,
                                            since=since, user=user, ttl_left=ttl_left)
        self._snapshots[stream] = self._snapshot_started[stream] = self._clock()
        self._requesters[stream] = asker
        if applied:
            self._peer_syncs.add(stream)  # the peer's sync: a heal waits for it
            # A catch-up says from where: the peer holds our state up to there.
            caught_up = stream.from_sequence if isinstance(stream, DeltaStream) else None
            self._peer_sync_opened(caught_up)
        self._in_flight[stream] = self._window_of(identity)
        if deferred:
            self._deferred_streams.add(stream)
        log.debug("snapshot for %s: subtree %r, up to %d keys at sequence %d%s", who(identity),
                  subtree, stream.total_keys, stream.sequence,
                  ", batched" if batch else "")  # fmt: skip
        # Its first messages now while its host's share of this turn's slice
        # for new streams lasts (a small snapshot is done at once, its slot
        # free again), else in the next turn: a storm of requests must not
        # each send a chunk within one turn, nor a flooding host (over its
        # share of the slots) take a second slice every turn.
        shares, now = self._serve_slice(), self._clock()
        hosts = [asker.host for asker in self._requesters.values()]
        stop = None if over_share(hosts, host) else shares.stop_for(host, now)
        if stop is not None:
            self._pump(stream, stop)
            shares.spend(host, self._clock() - now)
        else:
            self.wake(stream)

    def _serve_slice(self) -> SliceShares:
        """This loop turn's slice for newly served streams, shared by host."""
        shares = self._serve_shares
        if shares is None:
            shares = self._serve_shares = SliceShares(self._clock(), SNAPSHOT_SLICE,
                                                      self._weights())  # fmt: skip
            assert self._loop is not None
            self._loop.add_callback(self._end_serve_slice)
        return shares

    def _end_serve_slice(self) -> None:
        self._serve_shares = None

    def _host_of(self, stream: AnyStream) -> str | None:
        asker = self._requesters.get(stream)
        return None if asker is None else asker.host

    def _weights(self) -> dict[str | None, int]:
        """Each host holding a slot -> its weight in a slice: more for one
        whose requester has shown it reads (:func:`.fairshare.host_weights`)."""
        hosts = {stream: asker.host for stream, asker in self._requesters.items()}
        readers = [stream for stream, window in self._in_flight.items() if window.proven]
        return host_weights(hosts, readers)

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

    def wake(self, stream: AnyStream) -> None:
        """Give ``stream`` a turn in the loop's snapshot slice (once, in order)."""
        if stream not in self._snapshots or self._loop is None or self._stopping:
            return
        self._pump_queue.add(stream, self._host_of(stream))
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._loop.add_callback(self._pump_turn)

    def _pump_turn(self) -> None:
        """One loop turn's share of snapshot streaming: the streams that wait,
        one host after another, until :data:`SNAPSHOT_SLICE` or their host's
        share of it (:mod:`.fairshare`) is spent; the rest wait for the next
        turn, after the loop has looked at its sockets and timers.  While a
        reader's host holds a slot, the slice is one of wall time: streams of
        hosts that have not shown they read and spent their share wait for
        its end (a timer), not for the next turn.

        Each stream used to pump from a callback of its own, each with a whole
        turn's budget, so 200 streams took 2.3 s of one loop turn: the HUGZ
        stopped and the backup took over.
        """
        self._pump_scheduled = False
        self._cancel_pump_timer()
        queue = self._pump_queue
        shares = self._slices.open(self._clock(), self._weights(), queue.hosts())
        spent: list[tuple[AnyStream, str | None]] = []  # their host's share was
        for _ in range(len(queue)):
            stream = queue.pop()
            if stream is None:
                break
            host, now = self._host_of(stream), self._clock()
            stop = shares.stop_for(host, now)
            if stop is None:
                spent.append((stream, host))
                continue
            self._pump(stream, stop)
            shares.spend(host, self._clock() - now)
            if self._clock() > shares.end:
                break
        for stream, host in spent:
            queue.add(stream, host)
        if queue and not self._pump_scheduled and self._loop is not None:
            # Only paced hosts that spent their share left: the next turn when
            # the slice ends (a wake meanwhile schedules one at once).
            delay = self._slices.wait(self._clock(), queue.hosts())
            if delay > 0:
                self.counters["snapshot_turns_paced"] += 1
                self._pump_timer = self._loop.call_later(delay, self._pump_turn)
            else:
                self._pump_scheduled = True
                self._loop.add_callback(self._pump_turn)
        self._admit_waiting()

    def _cancel_pump_timer(self) -> None:
        if self._pump_timer is not None and self._loop is not None:
            self._loop.remove_timeout(self._pump_timer)
        self._pump_timer = None

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
        with Burst(self._backlog) as burst:
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
                    if self.held(stream, frames):
                        return  # woken once what it shows is on disk
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
                self.abort(stream, "internal error")
                return
        if stream not in self._snapshots:
            return  # a request the burst took after it replaced or evicted this stream
        if stream.done:  # (a SharedStream has left its snapshot)
            del self._snapshots[stream]
            self._requesters.pop(stream, None)
            started = self._snapshot_started.pop(stream, None)
            if started is not None:
                self._durations.observe(self._clock() - started)
            self._in_flight.pop(stream, None)
            self._unreachable.pop(stream, None)
            self._deferred_streams.discard(stream)
            if stream in self._peer_syncs:
                self._peer_syncs.discard(stream)
                self._peer_sync_done()
            c = self.counters
            c["snapshots_served"] += 1
            c["snapshot_entries_sent"] += stream.sent
            if stream.batch:
                c["snapshots_batched"] += 1
                c["snapshot_batches_sent"] += stream.batches_sent
            log.debug("snapshot for %s done: %d entries in %d messages, sequence %d",
                      who(stream.identity), stream.sent,
                      stream.batches_sent if stream.batch else stream.sent, stream.sequence)
            return
        self.wake(stream)

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
        self._loop.call_later(retry_delay(now - last), self.wake, stream)

    def _unroutable(self, stream: AnyStream, window: SendWindow) -> None:
        """EHOSTUNREACH: the requester went away, or its pipe is only slow to
        reactivate; abort once it has stayed unroutable for the grace."""
        now = self._clock()
        since = self._unreachable.setdefault(stream, now)
        if now - since >= _UNREACHABLE_GRACE:
            # The pump's burst looks at the backlog our failed send may have hidden.
            self.abort(stream, "requester went away", gone=True)
            return
        self.counters["snapshot_unroutable_retries"] += 1
        self._stall(stream, window)

    def abort(self, stream: AnyStream, why: str, *, gone: bool = False) -> None:
        self._peer_syncs.discard(stream)
        self._snapshot_started.pop(stream, None)
        self._unreachable.pop(stream, None)
        self._pump_queue.discard(stream)
        self._requesters.pop(stream, None)
        if isinstance(stream, SharedStream):
            stream.close()  # its snapshot loses a reader
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

    def check_stalled(self) -> None:
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
                self.abort(stream, "requester stopped reading")
        self._admit_waiting()
