"""The state and socket helpers that the remaining mixins of a :class:`CloneServer` share.

How this works: the server owns parts, objects built with only what they
need (the caller, the collector, the follower, a relay's link, the
conflicts desk, the publisher: docs/architecture.md, "Parts"), and is still
assembled from mixins for the duties that are not parts yet
(:mod:`.serving`, :mod:`.roles`, :mod:`.healing`, :mod:`.durability`,
:mod:`.security`, :mod:`.http`, and :mod:`.reactor` for the life cycle and
timers).  The mixins share the attributes set up here and call each other's
methods directly on ``self``; the methods one calls on another are declared
here for the type checker only.  Thin methods (``_on_call``,
``_answer_conflicts``, ``_follow``...) let a mixin reach a part without
knowing it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import ServerCore
from clone.server.delta import DeltaStream
from clone.server.door import PublisherDoor
from clone.server.metrics import DurationHistogram
from clone.server.pacing import SplitQueue
from clone.server.penalty import FloodPenalty
from clone.server.publishing import Publisher
from clone.server.rolelog import load_role_changes, save_role_changes
from clone.server.security import Security
from clone.server.shared import CLOCK_EVERY, TURN_BUDGET, Shared, peer_endpoint
from clone.server.snapshot import SnapshotStream
from clone.server.snapwindow import SendWindow, SnapshotBudget
from clone.server.status import StatusLimiter, clone_version
from clone.server.subscribers import (
    InboundWatch,
    SubscriptionGate,
    SubscriptionReader,
    drop_connection_from,
)
from clone.server.subscriptions import SubscriptionLedger, SubscriptionLimits
from clone.server.turns import TurnBudget
from clone.server.votes import DeferredVotes
from clone.wire.frames import cap_message_size
from clone.wire.protocol import MAX_HEARTBEAT_MS

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar
    from clone.security import KeyPair, Rights
    from clone.server.admin import ConflictsDesk
    from clone.server.calling import Caller
    from clone.server.collecting import Collector
    from clone.server.following import Follower
    from clone.server.relaying import RelayLink
    from clone.server.sending import Backlog, Burst
    from clone.storage import Storage
    from clone.wire.calls import Reply
    from clone.wire.delta import SinceRequest

__all__ = ["CLOCK_EVERY", "TURN_BUDGET", "AnyStream", "ServerBase", "peer_endpoint"]

# STATUS? answers per second, and at once: enough for every monitor of a pair,
# too few for a flood to take the loop from clients and the peer.
_STATUS_RATE = 20.0
_STATUS_BURST = 40
#: Client snapshot requests a server healing a split brain holds at most.
HEAL_REQUESTS = 8

#: A reply being streamed from the snapshot port: the state, or a catch-up.
AnyStream = SnapshotStream | DeltaStream

# One logger for the whole reactor, whichever module a line comes from: operators
# filter on it, and the tests read its lines.
log = logging.getLogger("clone.server.reactor")

_F = TypeVar("_F", bytes, zmq.Frame)

# The monitoring rings (clone.server.http): the last changed keys (never
# values) and the last role changes, for the status page.
RECENT_CHANGES = 50
ROLE_CHANGES = 20


def who(identity: bytes) -> str:
    return identity.hex() if identity else "?"


class PartSockets:
    """The server's sockets as its parts open them (:class:`.shared.Sockets`):
    our defaults, CURVE as the security settings say, streams on our loop."""

    def __init__(self, server: ServerBase) -> None:
        self._server = server

    def socket(self, kind: int) -> zmq.Socket[Any]:
        return self._server._socket(kind)

    def stream(self, sock: zmq.Socket[Any], handler: Callable[[list[bytes]], None]) -> ZMQStream:
        return self._server._stream(sock, handler)

    def forget(self, stream: ZMQStream) -> None:
        self._server._forget(stream)


class ServerBase:
    """The shared state of one server; see :class:`clone.server.reactor.CloneServer`."""

    # The snapshot port's handler wrapped by _guard, set when the sockets are bound.
    _on_router_guarded: Callable[[list[zmq.Frame]], None]

    def __init__(
        self,
        config: ServerConfig,
        ctx: zmq.Context[Any] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        # What every HUGZ tells clients to expect (the codec's range).
        self._heartbeat_ms = min(max(1, round(config.heartbeat * 1000)), MAX_HEARTBEAT_MS)
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[Any] = ctx if ctx is not None else zmq.Context[Any]()
        self._clock = clock
        self._wallclock = wallclock
        self.core = ServerCore(
            config.core,
            standalone=config.mode is ServerMode.STANDALONE,
            durable=config.data_dir is not None,
            relay=config.mode is ServerMode.RELAY,
        )
        # The data directory (clone.server.durability), open while serving.
        self._storage: Storage | None = None
        self._data_term = 0  # the term our stored data was last written under
        self._storage_error: BaseException | None = None  # set once: fail-stop
        # How long a collector turn drains, leaving room for its commit (clone.server.turns).
        self._turns = TurnBudget(TURN_BUDGET)
        # Who is admitted and their rights (clone.server.access): what the
        # parts read; the security part installs them.
        self.access = Access()
        self._loop: IOLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False
        self._throttle = Throttle(log, clock)
        self._streams: list[ZMQStream] = []
        self._router: zmq.Socket[Any] | None = None
        self._collector: zmq.Socket[Any] | None = None
        self._ha: BinaryStar | None = None  # when paired
        self._snapshots: dict[AnyStream, float] = {}  # stream -> last progress
        # Each stream's bytes handed to libzmq and not yet written out, within
        # its share of --snapshot-bytes (clone.server.snapwindow).
        self._snapshot_budget = SnapshotBudget(config.snapshot_bytes, config.max_snapshots)
        self._in_flight: dict[AnyStream, SendWindow] = {}
        # The same windows by requester, kept after a stream ends until what
        # libzmq holds for that requester is written (or its connection dropped).
        self._peer_windows: dict[bytes, SendWindow] = {}
        # Streams waiting for their turn of the loop's snapshot slice, in order
        # (clone.server.serving: _wake, _pump_turn), and whether a turn is due.
        self._pump_queue: dict[AnyStream, None] = {}
        self._pump_scheduled = False
        # The end of this loop turn's slice for the first messages of newly
        # served streams (None: not opened this turn).
        self._serve_slice_end: float | None = None
        # Requests that found every snapshot slot taken: requester -> (when,
        # how to serve it), oldest first; served as slots free, bounded.
        self._waiting: dict[bytes, tuple[float, dict[str, Any]]] = {}
        # Streams whose last send said EHOSTUNREACH, and since when (see
        # _UNREACHABLE_GRACE): gone, or only a pipe libzmq has not reactivated.
        self._unreachable: dict[AnyStream, float] = {}
        # Snapshot requests held for a later vote (the policy: clone.server.votes).
        self._deferred = DeferredVotes(
            config.max_deferred_votes, config.effective_deferred_vote_max_age
        )
        self._deferred_timer: object | None = None
        self._deferred_streams: set[AnyStream] = set()  # served from _deferred
        #: The PUB socket's output, in order (a part of its own: clone.server.publishing).
        self.publisher = Publisher(self._next_turn, config.snapshot_chunk)
        self._taking_backlog = False  # inside _take_router_backlog (no re-entry)
        # The parts built once the sockets are bound (clone.server.reactor).
        self.caller: Caller | None = None
        self.collector: Collector | None = None
        self.follower: Follower | None = None  # a pair member's or a relay's
        self.conflicts_desk: ConflictsDesk | None = None
        self._pub_stream: SubscriptionReader | None = None  # the XPUB's subscriptions
        self._inbound_watch: InboundWatch | None = None  # floods of them (its own thread)
        #: Hosts cut off for flooding the publisher, refused at its handshake
        #: for a while (clone.server.penalty); asked by the door (plain mode,
        #: its own thread) or the Gatekeeper (CURVE).
        self.flood_penalty = FloodPenalty()
        self._door: PublisherDoor | None = None
        # A relay's link to its upstream (clone.server.relaying), once bound.
        self.relay: RelayLink | None = None
        # After a split brain (clone.server.healing): our writes the winner has
        # not answered yet, paced (clone.server.pacing), the DEALER they go on,
        # and whether a slice of them is already scheduled for the next turn.
        self._split_queue = SplitQueue()
        self._split_dealer: ZMQStream | None = None
        self._split_scheduled = False
        # Of this heal's writes, how many the winner kept as conflicts (logged once).
        self._split_conflicts_this_heal = 0
        # Winning a split brain (clone.server.healing): since when client updates
        # are held (wall clock), and when the peer's sync finished streaming.
        self._hold_started: float | None = None
        self._hold_sync_done: float | None = None
        # Binary Star showed us the split brain this hold is for.
        self._hold_split_seen = False
        # The peer's sync said it stepped down from active (a split brain's
        # loser, STEPPED_DOWN_PROPERTY): this hold is a heal's.
        self._peer_stepped_down = False
        # Client snapshot requests held while we heal one (identity, subtree,
        # the _serve options), answered when the hold ends; the newest
        # HEAL_REQUESTS: a client asks again on a fresh socket every quarter
        # heartbeat, and only its last request can still be routed.
        self._heal_requests: deque[tuple[bytes, str, dict[str, Any]]] = deque(
            maxlen=HEAL_REQUESTS
        )
        # Losing one: when we stepped down (wall clock), until the client
        # updates parked since are dropped (HealingMixin._check_stepped_down).
        self._stepped_down_at: float | None = None
        self._peer_syncs: set[AnyStream] = set()
        # Took over by a failover, and the peer has not synced from us since.
        self._await_peer_sync = False
        self._hugz_timer: object | None = None
        self._house_timer: object | None = None
        self._stats_timer: object | None = None
        self._next_hugz = 0.0
        # Monitoring (clone.server.http, clone.server.metrics): cheap records
        # of what the counters do not hold.
        self.snapshot_seconds = DurationHistogram()
        self._snapshot_started: dict[AnyStream, float] = {}
        self.recent_changes: deque[tuple[int, bytes]] = deque(maxlen=RECENT_CHANGES)
        # (Unix time, from role, to role), oldest first.
        # A durable server keeps them across restarts (clone.server.rolelog).
        self.role_changes: deque[tuple[float, str, str]] = deque(
            load_role_changes(config.data_dir, ROLE_CHANGES) if config.data_dir else (),
            maxlen=ROLE_CHANGES,
        )
        # For STATUS? (clone.server.status): uptime, its rate limit, the last
        # takeover (Unix time; counted in counters["failovers"]) and our version.
        self._started_at = clock()
        self._status_limiter = StatusLimiter(_STATUS_RATE, _STATUS_BURST, self._started_at)
        self._last_failover: float | None = None
        self._version = clone_version()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "snapshots_served",
                "snapshots_aborted",
                "snapshots_refused",
                "snapshots_held_heal",
                "votes_deferred",
                "votes_deferred_served",
                "votes_deferred_expired",
                "votes_deferred_overflow",
                "votes_deferred_gone",
                "snapshot_stalls",
                "snapshot_unroutable_retries",
                "snapshots_idle_aborted",
                "snapshots_evicted",
                "snapshots_replaced",
                "snapshots_queued",
                "collector_turns_cut",
                "split_writes_applied",
                "split_writes_refused",
                "split_writes_conflicts",
                "conflicts_requests",
                "conflicts_dropped",
                "split_writes_resent",
                "split_writes_abandoned",
                "snapshot_entries_sent",
                "snapshots_batched",
                "snapshot_batches_sent",
                "hugz_sent",
                "heartbeat_max_late_ms",
                "outq_dropped",
                "sync_timeouts",
                "internal_errors",
                "storage_errors",
                "catchups_served",
                "client_catchups_served",
                "kvset_refused_acl",
                "subscriptions",
                "subscriptions_refused",
                "subscriptions_over_limit",
                "subscribers_dropped",
                "subscribers_flooding",
                "subscribers_slow",
                "subscribers_over_budget",
                "subscriptions_at_heartbeat",
                "security_reloads",
                "security_reload_errors",
                "publisher_rebinds",
                "failovers",
                "upstream_switches",
                "kvset_forwarded",
                "kvset_forward_dropped",
                "kvset_refused_stale",
                "status_requests",
                "status_dropped",
                "call_replies_dropped",
                "calls_forwarded",
                "calls_forward_dropped",
                "calls_forward_not_synced",
                "calls_forward_refused_acl",
                "call_replies_forwarded",
                "call_replies_unmatched",
                "kvset_refused_upstream",
                "upstream_handshake_failures",
            ),
            0,
        )
        #: What every part is handed: the clocks, these counters, the throttle.
        self.shared = Shared(self._throttle, clock, wallclock, self.counters)
        #: Keys, the ZAP handler, the ACL and the views (clone.server.security):
        #: all None / empty without --curve-secret.
        self.security = Security(
            config, self._ctx, self.shared, self.access, publish=self.publisher.publish
        )
        # The publisher's subscriptions, judged per connection (a part of its
        # own: clone.server.subscribers); the topics come from security.
        self.subscription_gate = SubscriptionGate(
            SubscriptionLedger(
                SubscriptionLimits(config.max_subscriptions, config.max_subscription_bytes)
            ),
            self.security.subscription_topics,
            self.counters,
            self._throttle,
            clock,
            TURN_BUDGET,
            self._drop_flooder,
        )

    def _drop_flooder(self, fd: int, ino: int) -> bool:
        """Cut a publisher connection that kept subscribing past its caps, and
        put its address under a flood penalty; whether it was cut."""
        peer = drop_connection_from(fd, ino)
        if peer is None:
            return False
        self.flood_penalty.punish(peer, self._clock())
        return True

    @property
    def _followed(self) -> str | None:
        """The server we follow: the peer while passive; a relay's current
        upstream (its link's), which changes at a failover."""
        if self.relay is not None:
            return self.relay.followed
        return self.config.upstream[0] if self.config.upstream else self.config.peer

    @property
    def _admitted(self) -> set[str]:
        return self.access.admitted

    @property
    def _keypair(self) -> KeyPair | None:
        """Our CURVE key pair (the security part's); None: in clear text."""
        return self.security.keypair

    @property
    def _view_counts(self) -> dict[str, int]:
        return self.security.view_counts

    @property
    def _view_prefixes(self) -> list[tuple[str, tuple[bytes, ...]]]:
        return self.security.view_prefixes

    def _rights_of(self, name: str | None) -> Rights:
        """A connection's rights: nothing for an unknown or removed name."""
        return self.access.rights_of(name)

    def _count_views(self, updates: list[list[bytes]]) -> None:
        self.security.count_views(updates)

    def _secure(self, sock: zmq.Socket[Any], *, bound: bool) -> None:
        self.security.secure(sock, bound=bound)

    @property
    def _write_all(self) -> set[str]:
        return self.access.write_all


    def _socket(self, kind: int, *, bound: bool = False) -> zmq.Socket[Any]:
        """A socket with our defaults; with CURVE on, set up as a server if
        ``bound``, else as a client of the peer (clone.server.security)."""
        sock: zmq.Socket[Any] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind not in (zmq.PUB, zmq.XPUB):
            cap_message_size(sock)
        self._secure(sock, bound=bound)
        return sock

    def _stream(
        self, sock: zmq.Socket[Any], handler: Callable[[list[_F]], None], *, copy: bool = True
    ) -> ZMQStream:
        """``handler`` gets bytes, or ``zmq.Frame``s with ``copy=False``."""
        assert self._loop is not None
        stream = ZMQStream(sock, self._loop)
        stream.on_recv(self._guard(handler), copy=copy)
        self._streams.append(stream)
        return stream

    def _guard(self, handler: Callable[[list[_F]], None]) -> Callable[[list[_F]], None]:
        """Wrap a socket handler so that a bug is logged, never fatal."""

        def guarded(frames: list[_F]) -> None:
            try:
                handler(frames)
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("internal error in %s", handler.__name__)

        return guarded

    def _forget(self, stream: ZMQStream) -> None:
        if stream in self._streams:
            self._streams.remove(stream)
        stream.close(linger=0)

    def _note_changes(self, updates: list[list[bytes]]) -> None:
        """Remember the keys (never the values) of the last updates of a commit."""
        if not updates:
            return
        ring = self.recent_changes
        for frames in updates[-RECENT_CHANGES:]:
            seq = frames[1]
            ring.append((int.from_bytes(seq, "big") if len(seq) == 8 else 0, frames[0]))

    def _note_role(self, was: str, now: str) -> None:
        """A promotion or demotion, for the failover history."""
        self.role_changes.append((self._wallclock(), was, now))
        if self.config.data_dir is not None:
            save_role_changes(self.config.data_dir, self.role_changes)

    def _turn_over(self, budget: int, stop_at: float) -> bool:
        """Whether a draining handler should give the loop back now.

        Out of messages for this turn, or (checked every 64 messages, since a
        clock read is not free) out of time.  Handlers ask this before they
        receive the next message, so nothing received is ever left unhandled.
        """
        return budget <= 0 or (budget % CLOCK_EVERY == 0 and self._clock() > stop_at)

    @property
    def _pub(self) -> zmq.Socket[Any] | None:
        """The publisher's socket (P+1): the publisher part holds it."""
        return self.publisher.socket

    @_pub.setter
    def _pub(self, sock: zmq.Socket[Any] | None) -> None:
        self.publisher.socket = sock

    def _next_turn(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` on the loop's next turn; False without a loop."""
        if self._loop is None:
            return False
        self._loop.add_callback(callback)
        return True

    # -- the parts, as the mixins still call them -------------------------------

    def _on_call(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        """A CALL? from the ROUTER's reader: the caller part's."""
        if self.caller is not None:
            self.caller.on_call(identity, parts)

    def _send_reply(
        self, identity: bytes, reply: Reply, *, backlog: Backlog = None, burst: Burst | None = None
    ) -> None:
        if self.caller is not None:
            self.caller.send_reply(identity, reply, backlog=backlog, burst=burst)

    def _answer_conflicts(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        """A CONFLICTS? from the ROUTER's reader: the conflicts desk's."""
        if self.conflicts_desk is not None:
            self.conflicts_desk.on_request(identity, parts)

    def _follow(self) -> None:
        """Follow the followed server (the follower part's)."""
        if self.follower is not None:
            self.follower.follow()

    def _close_peer(self) -> None:
        """Stop following it: its SUB and sync DEALER closed."""
        if self.follower is not None:
            self.follower.close()

    if TYPE_CHECKING:
        # Provided by the other parts of CloneServer.

        def _commit(self) -> list[list[bytes]]: ...

        def _commit_and_publish(self) -> None: ...

        def _record_term(self) -> None: ...

        def request_stop(self) -> None: ...

        def _bind_publisher(self, *, rebind: bool = False) -> None: ...

        def _on_pub_monitor(self, event: int, value: int) -> None: ...

        def _on_became_active(self) -> None: ...

        def _abort_snapshot(self, stream: AnyStream, why: str, *, gone: bool = False) -> None: ...

        def _recheck_deferred_soon(self) -> None: ...

        def _take_router_backlog(self) -> None: ...

        def _forward_split_writes(self) -> None: ...

        def _apply_split_writes_here(self) -> None: ...

        def _check_split_writes(self) -> None: ...

        def _on_split_brain(self) -> None: ...

        def _start_hold(self, why: str) -> None: ...

        def _check_hold(self) -> None: ...

        def _heal_defers_clients(self) -> bool: ...

        def _check_stepped_down(self) -> None: ...

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
        ) -> None: ...

        def _peer_sync_done(self) -> None: ...

        def _close_split(self) -> None: ...
