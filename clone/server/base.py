"""The state and socket helpers that every part of a :class:`CloneServer` shares.

How this works: the server is one object assembled from mixins that each do
one job (:mod:`.serving`, :mod:`.following`, :mod:`.publishing`, and
:mod:`.reactor` for the life cycle and timers).  They share the attributes set
up here and call each other's methods directly on ``self``: a mixin adds no
indirection per message, where collaborator objects would add an attribute
load and a bound call on the collector and publish paths.  The methods one
part calls on another are declared here for the type checker only.
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
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import ServerCore
from clone.server.delta import DeltaStream
from clone.server.inflight import InFlight
from clone.server.metrics import DurationHistogram, SubscriberCount
from clone.server.pacing import SplitQueue
from clone.server.publishing import Publisher
from clone.server.rolelog import load_role_changes, save_role_changes
from clone.server.snapshot import SnapshotStream
from clone.server.status import StatusLimiter, clone_version
from clone.server.subscribers import (
    InboundWatch,
    SubscriptionGate,
    SubscriptionReader,
    drop_connection,
)
from clone.server.subscriptions import SubscriptionLedger, SubscriptionLimits
from clone.server.votes import DeferredVotes
from clone.wire.frames import cap_message_size
from clone.wire.protocol import MAX_HEARTBEAT_MS

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar
    from clone.security import Acl, Gatekeeper, KeyPair, Rights
    from clone.server.sending import Backlog, Burst
    from clone.storage import Storage
    from clone.wire.calls import Reply

__all__ = ["AnyStream", "ServerBase", "peer_endpoint"]

# STATUS? answers per second, and at once: enough for every monitor of a pair,
# too few for a flood to take the loop from clients and the peer.
_STATUS_RATE = 20.0
_STATUS_BURST = 40

#: A reply being streamed from the snapshot port: the state, or a catch-up.
AnyStream = SnapshotStream | DeltaStream

# One logger for the whole reactor, whichever module a line comes from: operators
# filter on it, and the tests read its lines.
log = logging.getLogger("clone.server.reactor")

_F = TypeVar("_F", bytes, zmq.Frame)

# Wall-time budget of one handler call that drains a socket or streams a
# snapshot chunk.  The count limits alone are not enough: on a loaded host a
# batch of 1000 took up to 190 ms of wall time, and timers (HUGZ) waited for it.
TURN_BUDGET = 0.01
CLOCK_EVERY = 64  # a draining handler reads the clock once per this many messages
# The monitoring rings (clone.server.http): the last changed keys (never
# values) and the last role changes, for the status page.
RECENT_CHANGES = 50
ROLE_CHANGES = 20


# What a relay remembers of what it forwarded (clone.server.inflight): calls
# until their REPLY (a client's call times out well before), writes until a
# refusal notice could still come back (the pair answers within a turn).
RELAY_CALLS_MAX = 10_000
RELAY_CALL_TTL = 30.0
RELAY_WRITES_MAX = 65_536
RELAY_WRITE_TTL = 10.0


def peer_endpoint(host_port: str, offset: int) -> str:
    """The endpoint of a peer's or upstream's socket: its base port ``host:port``
    plus ``offset`` (SNAPSHOT_OFFSET, PUBLISHER_OFFSET, COLLECTOR_OFFSET)."""
    host, _, port = host_port.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


def who(identity: bytes) -> str:
    return identity.hex() if identity else "?"


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
        # Security (clone.server.security): all None / empty without --curve-secret.
        self._keypair: KeyPair | None = None
        self._gatekeeper: Gatekeeper | None = None
        # A relay's CURVE towards its upstream (its own client key pair, the
        # upstream's public key); None: it follows in clear text.
        self._upstream_keypair: KeyPair | None = None
        self._upstream_server_key: bytes | None = None
        self._acl: Acl | None = None
        self._admitted: set[str] = set()  # names whose connections count
        self._rights: dict[str, Rights] = {}
        self._write_all: set[str] = set()  # names whose write prefixes include b""
        self._views: dict[str, tuple[bytes, ...]] = {}  # view id -> read prefixes
        self._view_counts: dict[str, int] = {}  # view id -> updates published in it
        self._view_prefixes: list[tuple[str, tuple[bytes, ...]]] = []
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
        # Batched streams: a tracker per KVBATCH that libzmq has not yet written
        # to the connection, oldest first (see _BATCHES_IN_FLIGHT).
        self._in_flight: dict[AnyStream, deque[zmq.MessageTracker]] = {}
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
        # Call replies that wait for this turn's commit (clone.server.calling).
        self._replies: list[tuple[bytes, Reply]] = []
        self._replies_scheduled = False
        self._pub_stream: SubscriptionReader | None = None  # the XPUB's subscriptions
        self._inbound_watch: InboundWatch | None = None  # floods of them (its own thread)
        self._peer_sub: ZMQStream | None = None
        # The server we follow: the peer while passive; a relay's current
        # upstream (clone.server.relaying), which changes at a failover.
        self._followed: str | None = config.upstream[0] if config.upstream else config.peer
        self._upstream_index = 0
        self._upstream_heard = 0.0  # the clock when the followed server last spoke
        self._upstream_heartbeat = config.heartbeat  # its HUGZ interval, as it says
        self._upstream_stale = False  # it is a relay that lost its own upstream
        self._relay_synced_once = False
        self._upstream_pub: zmq.Socket[Any] | None = None  # to every upstream collector
        # A relay's upstream SUB's socket monitor: says why a handshake failed.
        self._upstream_monitor: ZMQStream | None = None
        # A relay's calls (clone.server.relaying): a DEALER on the snapshot port
        # of the upstream it synced from, and who asked each call it forwarded.
        self._call_dealer: ZMQStream | None = None
        self._call_upstream: str | None = None
        self._relay_calls: InFlight[bytes] = InFlight(RELAY_CALLS_MAX, RELAY_CALL_TTL)
        # ... and, serving over CURVE, who wrote each KVSET it forwarded, so that
        # the pair's refusal notice (to the relay's key) reaches the writer.
        self._relay_writers: InFlight[str] = InFlight(RELAY_WRITES_MAX, RELAY_WRITE_TTL)
        self._peer_dealer: ZMQStream | None = None
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
        self._peer_syncs: set[AnyStream] = set()
        # Took over by a failover, and the peer has not synced from us since.
        self._await_peer_sync = False
        self._sync_progress = 0.0
        self._sync_started = 0.0
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
        self._subscriber_count: SubscriberCount | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "snapshots_served",
                "snapshots_aborted",
                "snapshots_refused",
                "votes_deferred",
                "votes_deferred_served",
                "votes_deferred_expired",
                "votes_deferred_overflow",
                "votes_deferred_gone",
                "snapshot_stalls",
                "snapshot_unroutable_retries",
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

        # The publisher's subscriptions, judged per connection (a part of its
        # own: clone.server.subscribers); the topics come from security.
        self.subscription_gate = SubscriptionGate(
            SubscriptionLedger(
                SubscriptionLimits(config.max_subscriptions, config.max_subscription_bytes)
            ),
            self._subscription_topics,
            self.counters,
            self._throttle,
            clock,
            TURN_BUDGET,
            drop_connection,
        )

    def _subscription_topics(self, frame: zmq.Frame, topic: bytes) -> list[bytes] | None:
        """What a connection asking for ``topic`` gets (security overrides it)."""
        return [topic]

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

    if TYPE_CHECKING:
        # Provided by the other parts of CloneServer.

        def _commit(self) -> list[list[bytes]]: ...

        def _commit_and_publish(self) -> None: ...

        def _record_term(self) -> None: ...

        def request_stop(self) -> None: ...

        def _secure(self, sock: zmq.Socket[Any], *, bound: bool) -> None: ...

        def _rights_of(self, name: str | None) -> Rights: ...

        def _count_views(self, updates: list[list[bytes]]) -> None: ...

        def _bind_publisher(self, *, rebind: bool = False) -> None: ...

        def _on_pub_monitor(self, event: int, value: int) -> None: ...

        def _on_became_active(self) -> None: ...

        def _abort_snapshot(
            self, stream: AnyStream, why: str, *, gone: bool = False
        ) -> None: ...

        def _recheck_deferred_soon(self) -> None: ...

        def _request_snapshot(self) -> None: ...

        def _follow(self) -> None: ...

        def _close_peer(self) -> None: ...

        def _heard_upstream(self, frames: list[bytes]) -> None: ...

        def _relay_synced(self) -> None: ...

        def _relay_stale(self) -> bool: ...

        def _on_upstream_control(self, frames: list[bytes]) -> None: ...

        def _refusal(self, name: str | None, uuid: bytes, reason: str) -> None: ...

        def _acl_writer(
            self, first: zmq.Frame, frames: list[bytes], *, notify: bool
        ) -> tuple[bool, str | None]: ...

        def _view_heartbeats(self) -> list[list[bytes]]: ...

        def _on_call(self, identity: bytes, parts: list[zmq.Frame]) -> None: ...

        def _answer_conflicts(self, identity: bytes, parts: list[zmq.Frame]) -> None: ...

        def _forward_call(
            self, identity: bytes, frames: list[bytes], user: str | None = None, caller: str = ""
        ) -> None: ...

        def _send_reply(
            self,
            identity: bytes,
            reply: Reply,
            *,
            backlog: Backlog = None,
            burst: Burst | None = None,
        ) -> None: ...

        def _take_router_backlog(self) -> None: ...

        def _forward_split_writes(self) -> None: ...

        def _apply_split_writes_here(self) -> None: ...

        def _check_split_writes(self) -> None: ...

        def _on_split_brain(self) -> None: ...

        def _start_hold(self, why: str) -> None: ...

        def _check_hold(self) -> None: ...

        def _peer_sync_done(self) -> None: ...

        def _close_split(self) -> None: ...
