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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from bstar.fsm import State as BStarState
from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import Role, ServerCore
from clone.server.durability import Durability
from clone.server.healing import Healer
from clone.server.monitoring import Monitor
from clone.server.publishing import Publisher
from clone.server.security import Security
from clone.server.shared import CLOCK_EVERY, TURN_BUDGET, Shared, peer_endpoint
from clone.server.status import StatusLimiter
from clone.server.subscribers import (
    InboundWatch,
    SubscriptionGate,
    SubscriptionReader,
    drop_connection,
)
from clone.server.subscriptions import SubscriptionLedger, SubscriptionLimits
from clone.server.turns import TurnBudget
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
    from clone.server.serving import SnapshotPort
    from clone.server.streaming import SnapshotStreams
    from clone.server.voting import HeldVotes
    from clone.wire.calls import Reply

__all__ = ["CLOCK_EVERY", "TURN_BUDGET", "ServerBase", "peer_endpoint"]

# STATUS? answers per second, and at once: enough for every monitor of a pair,
# too few for a flood to take the loop from clients and the peer.
_STATUS_RATE = 20.0
_STATUS_BURST = 40

# One logger for the whole reactor, whichever module a line comes from: operators
# filter on it, and the tests read its lines.
log = logging.getLogger("clone.server.reactor")

_F = TypeVar("_F", bytes, zmq.Frame)


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
        #: The PUB socket's output, in order (a part of its own: clone.server.publishing).
        self.publisher = Publisher(self._next_turn, config.snapshot_chunk)
        # The parts built once the sockets are bound (clone.server.reactor).
        # The snapshot port (P): its reader, its streams, its held votes.
        self.snapshot_port: SnapshotPort | None = None
        self.streams: SnapshotStreams | None = None
        self.votes: HeldVotes | None = None
        self.caller: Caller | None = None
        self.collector: Collector | None = None
        self.follower: Follower | None = None  # a pair member's or a relay's
        self.conflicts_desk: ConflictsDesk | None = None
        self._pub_stream: SubscriptionReader | None = None  # the XPUB's subscriptions
        self._inbound_watch: InboundWatch | None = None  # floods of them (its own thread)
        # A relay's link to its upstream (clone.server.relaying), once bound.
        self.relay: RelayLink | None = None
        self._hugz_timer: object | None = None
        self._house_timer: object | None = None
        self._stats_timer: object | None = None
        self._next_hugz = 0.0
        # STATUS? and CONFLICTS? answers, one rate limit (clone.server.status).
        self._status_limiter = StatusLimiter(_STATUS_RATE, _STATUS_BURST, clock())
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
        #: The data directory (a part: clone.server.durability), open while serving.
        self.durability = Durability(
            config,
            self.core,
            self.shared,
            publish=self.publisher.publish,
            ha_term=self._ha_term,
            committed=self._committed,
            stop=self.request_stop,
        )
        #: Health, readiness, STATUS, the status page; the HTTP port (a part:
        #: clone.server.monitoring).
        self.monitor = Monitor(
            config,
            self.core,
            self.shared,
            ha=lambda: self._ha,
            curve=lambda: self._keypair is not None,
            stats=lambda: self.stats(),
            serving=lambda: not self._stopping and self.durability.error is None,
        )
        #: After a split brain (a part: clone.server.healing): the loser's
        #: writes to the winner; the winner's hold while it heals.
        self.healer = Healer(
            config,
            self.core,
            self.shared,
            PartSockets(self),
            next_turn=self._next_turn,
            followed=lambda: self._followed,
            commit_and_publish=self.durability.commit_and_publish,
            publish=self.publisher.publish,
            won_split=self._bstar_active,
            serve=self._serve_held,
            stopping=lambda: self._stopping,
        )
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
            drop_connection,
        )

    def _ha_term(self) -> int | None:
        """The term new writes are recorded under while paired: our epoch
        while active, the active peer's while we follow it (None unpaired)."""
        ha = self._ha
        if ha is None:
            return None
        return ha.epoch if self.core.role is Role.ACTIVE else ha.peer_epoch

    def _serve_held(self, identity: bytes, subtree: str, options: dict[str, Any]) -> None:
        """A snapshot request the healer held: served now."""
        if self.streams is not None:
            self.streams.serve(identity, subtree, **options)

    def _bstar_active(self) -> bool:
        """Binary Star says we are active (a split brain we see is one we win)."""
        ha = self._ha
        return ha is not None and ha.state is BStarState.ACTIVE

    def _committed(self, updates: list[list[bytes]]) -> None:
        """A commit's updates: counted per view, their keys remembered."""
        if self._view_prefixes:
            self._count_views(updates)
        self.monitor.note_changes(updates)

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

        def request_stop(self) -> None: ...

        def stats(self) -> dict[str, int | float | str]: ...

        def _bind_publisher(self, *, rebind: bool = False) -> None: ...

        def _on_became_active(self) -> None: ...
