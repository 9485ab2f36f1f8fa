"""The publisher's port (XPUB, P+1): its binding, its subscriptions, its watch.

How this works: the publisher (:mod:`.publishing`) owns the ordered output
queue and sends on whichever socket is installed; this part binds that socket
(an XPUB in manual mode), reads its subscription messages through the
subscription gate (:mod:`.subscribers`, per connection, a bounded number per
turn; the heartbeat looks again after its own sends), and runs the inbound
watch, the thread that cuts off floods and subscribers that read nothing.  On
SIGHUP, if rights shrank, it binds a new socket (``bind(rebind=True)``): the
publications wait in the queue until the port is free again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
from tornado.ioloop import IOLoop

from clone.security.zap import PUBLISHER_DOMAIN, Gatekeeper
from clone.server.config import ServerConfig
from clone.server.door import PublisherDoor
from clone.server.penalty import FloodPenalty
from clone.server.publishing import Publisher
from clone.server.shared import Shared
from clone.server.sockets import ServerSockets
from clone.server.subscribers import (
    PER_TURN,
    SLOW_AFTER,
    SUBSCRIPTION_RCVBUF,
    SUBSCRIPTION_RCVHWM,
    InboundWatch,
    SubscriptionGate,
    SubscriptionReader,
)
from clone.server.subscriptions import MAX_TOPIC_BYTES, InboundAllowance
from clone.wire.protocol import PUBLISHER_OFFSET

__all__ = ["PublisherPort"]

log = logging.getLogger("clone.server.reactor")


class PublisherPort:
    """Bind the publisher's XPUB, read its subscriptions, watch its connections.

    A part of the server, built once its loop runs, with the publisher, the
    subscription gate, the server's sockets, and callbacks:
    ``watch_subscribers`` (the monitor's: the XPUB's monitor socket, which
    also counts the connections with --http-port), ``on_pub_event`` (the
    monitor's count of them) and ``stop`` (the server's, when the port
    cannot be bound again); ``penalty``, the hosts cut off for flooding, which
    its door (plain mode, a thread of its own) or the server's Gatekeeper
    (CURVE) refuses at the handshake, before libzmq attaches them.
    """

    def __init__(
        self,
        config: ServerConfig,
        shared: Shared,
        publisher: Publisher,
        gate: SubscriptionGate,
        sockets: ServerSockets,
        loop: IOLoop,
        *,
        watch_subscribers: Callable[[zmq.Socket[Any]], zmq.Socket[Any]],
        on_pub_event: Callable[[int], None],
        stop: Callable[[], None],
        penalty: FloodPenalty,
        gatekeeper: Callable[[], Gatekeeper | None],
        ctx: zmq.Context[Any],
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.counters = shared.counters
        self._throttle = shared.throttle
        self.publisher = publisher
        self.subscription_gate = gate
        self._sockets = sockets
        self._loop: IOLoop | None = loop  # None once closed
        self._watch_subscribers = watch_subscribers
        self._on_pub_event = on_pub_event
        self.request_stop = stop
        self._pub_stream: SubscriptionReader | None = None  # the XPUB's subscriptions
        self._inbound_watch: InboundWatch | None = None  # floods of them (its own thread)
        self.flood_penalty = penalty
        self._gatekeeper = gatekeeper
        self._ctx = ctx
        self._clock = clock
        self._door: PublisherDoor | None = None

    @property
    def _pub(self) -> zmq.Socket[Any] | None:
        """The publisher's socket (P+1): the publisher part holds it."""
        return self.publisher.socket

    @_pub.setter
    def _pub(self, sock: zmq.Socket[Any] | None) -> None:
        self.publisher.socket = sock

    def close(self) -> None:
        """The server stops: the watch thread stopped, the reader and the
        socket closed."""
        self._loop = None
        watch, self._inbound_watch = self._inbound_watch, None
        if watch is not None:
            watch.stop()
        if self._pub_stream is not None:
            self._pub_stream.close()
        self._pub_stream = None
        sock = self._pub
        if sock is not None and not sock.closed:
            sock.close(linger=0)
        door, self._door = self._door, None
        if door is not None:
            door.stop()

    def bind(self, *, rebind: bool = False) -> None:
        """Bind the publisher (P+1): an XPUB in manual mode, whose
        subscriptions the subscription gate (clone.server.subscribers) judges
        per connection and clone.server.security maps to what each may read.

        ``rebind`` closes the current one first (SIGHUP took rights away);
        until the port is free again, publications wait in the ordered output
        queue, so none is lost for the subscribers that come back.
        """
        cfg = self.config
        old_stream, self._pub_stream = self._pub_stream, None
        old, self._pub = self._pub, None
        endpoint = f"tcp://{cfg.bind}:{cfg.port + PUBLISHER_OFFSET}"
        if old_stream is not None:
            old_stream.close()
        if old is not None and not old.closed:
            old.close(linger=0)
        pub = self._sockets.socket(zmq.XPUB, bound=True)
        # A subscriber's queue: --hwm messages; in bytes, the inbound watch
        # cuts one off that reads nothing past --max-subscriber-bytes.
        pub.setsockopt(zmq.SNDHWM, cfg.pub_hwm)
        # Subscriptions: none applied but by us, none longer than a subtree,
        # and few taken in from one connection ahead of the gate.
        pub.setsockopt(zmq.XPUB_MANUAL, 1)
        pub.setsockopt(zmq.MAXMSGSIZE, 1 + MAX_TOPIC_BYTES)
        pub.setsockopt(zmq.RCVHWM, SUBSCRIPTION_RCVHWM)
        pub.setsockopt(zmq.RCVBUF, SUBSCRIPTION_RCVBUF)
        self._guard_door(pub)
        if not rebind:
            pub.bind(endpoint)
            self._install_publisher(pub)
            return
        self.publisher.hold()  # publications queue until the new socket is bound
        self._retry_bind(pub, endpoint, 0)

    def _guard_door(self, pub: zmq.Socket[Any]) -> None:
        """Refuse penalized hosts at the publisher's handshake (clone.server.penalty):
        its own ZAP domain, asked of the Gatekeeper under CURVE, else of the
        publisher's door, started here once."""
        gatekeeper = self._gatekeeper()
        if gatekeeper is not None:
            gatekeeper.penalty = self.flood_penalty.admits
        elif self._door is None:
            door = PublisherDoor(self._ctx, self.flood_penalty.admits, self._clock)
            try:
                door.start()
            except zmq.ZMQError as exc:
                log.warning("no flood penalty at the publisher's door: %s", exc)
                return
            self._door = door
        pub.zap_domain = PUBLISHER_DOMAIN

    def _retry_bind(self, pub: zmq.Socket[Any], endpoint: str, attempt: int) -> None:
        try:
            pub.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt >= 200 or self._loop is None:
                pub.close(linger=0)
                log.critical("cannot bind the publisher again at %s: %s; stopping", endpoint, exc)
                self.request_stop()
                return
            # The old socket's port is released by libzmq's I/O thread shortly.
            self._loop.call_later(0.01, self._retry_bind, pub, endpoint, attempt + 1)
            return
        self._install_publisher(pub)
        log.info("publisher bound again at %s: subscribers reconnect under the new rules", endpoint)

    def _install_publisher(self, pub: zmq.Socket[Any]) -> None:
        self.publisher.install(pub)  # what was held goes out from the next turn
        self.subscription_gate.reset()  # a new socket: no connection yet
        assert self._loop is not None
        self._pub_stream = SubscriptionReader(pub, self._loop, self._on_subscription)
        self._start_inbound_watch(self._watch_subscribers(pub))

    def _start_inbound_watch(self, monitor: zmq.Socket[Any]) -> None:
        """The thread that reads ``monitor`` and stops the floods the loop
        cannot see (clone.server.subscribers)."""
        old, self._inbound_watch = self._inbound_watch, None
        if old is not None:
            old.stop()
        loop = self._loop
        assert loop is not None
        watch = InboundWatch(
            monitor,
            InboundAllowance.for_limits(self.subscription_gate.ledger.limits),
            lambda event, value: loop.add_callback(self._on_pub_monitor, event, value),
            lambda peer, received: self._flood_cut(loop, peer, received),
            lambda peer, waiting: loop.add_callback(self._on_slow_subscriber, peer, waiting),
            budget=self.config.max_subscriber_bytes,
            published=lambda: self.publisher.sent_bytes,
            on_cut=lambda peer, queued: loop.add_callback(self._on_subscriber_cut, peer, queued),
        )
        watch.start()
        self._inbound_watch = watch

    def _flood_cut(self, loop: IOLoop, peer: str, received: int) -> None:
        """From the inbound watch's thread: the penalty at once (the loop may be
        inside libzmq), the counting on the loop."""
        self.flood_penalty.punish(peer, self._clock())
        loop.add_callback(self._on_inbound_drop, peer, received)

    def _on_pub_monitor(self, event: int, value: int) -> None:
        """An event of the publisher's monitor: the subscription gate's, and
        the monitor's count of connections."""
        self.subscription_gate.on_event(event, value)
        self._on_pub_event(event)

    def _on_inbound_drop(self, peer: str, received: int) -> None:
        """The inbound watch shut a publisher connection down: it sent more than
        subscribing within the caps takes."""
        self.counters["subscribers_dropped"] += 1
        self.counters["subscribers_flooding"] += 1
        self._throttle.log(
            "subscriber_flood",
            logging.WARNING,
            "subscriber %s sent %d bytes to the publisher, more than subscribing within"
            " --max-subscriptions and --max-subscription-bytes takes: connection dropped",
            peer,
            received,
        )

    def _on_slow_subscriber(self, peer: str, waiting: int) -> None:
        """The inbound watch saw a subscriber read nothing for a while."""
        self.counters["subscribers_slow"] += 1
        self._throttle.log(
            "subscriber_slow",
            logging.WARNING,
            "subscriber %s has read nothing for %.0f s (%d bytes wait in the kernel); it is"
            " cut off once %d more bytes are published (--max-subscriber-bytes)",
            peer,
            SLOW_AFTER,
            waiting,
            self.config.max_subscriber_bytes,
        )

    def _on_subscriber_cut(self, peer: str, queued: int) -> None:
        """The inbound watch cut off a subscriber that read nothing past its budget."""
        self.counters["subscribers_dropped"] += 1
        self.counters["subscribers_over_budget"] += 1
        self._throttle.log(
            "subscriber_over_budget",
            logging.WARNING,
            "subscriber %s read nothing while %d bytes were published for it, past"
            " --max-subscriber-bytes %d: connection dropped (its queue goes with it; it"
            " resyncs when it reads again)",
            peer,
            queued,
            self.config.max_subscriber_bytes,
        )

    def _on_subscription(self) -> bool:
        """The publisher's subscription messages: the gate judges them per
        connection (clone.server.subscribers), a bounded number per turn;
        True if it stopped at its budget."""
        sock = self._pub
        if sock is None or sock.closed:
            return False
        return self.subscription_gate.take(sock) >= PER_TURN

    def take_subscriptions(self) -> None:
        """Handle subscription messages our own sends on the XPUB may have hidden.

        Every send on a socket may consume the edge of its file descriptor
        that announces an incoming message, so the reader would not wake for
        a subscription that arrived meanwhile, and its client would hear
        nothing, not even HUGZ, until something else stirred the socket (seen
        in CI: 25 snapshots served to a client, 1 subscription handled).  The
        heartbeat calls this after its own sends: a subscription waits at most
        one heartbeat, and the hot path pays nothing.  Bounded like a turn of
        the socket's own reader.
        """
        sock = self._pub
        if self._pub_stream is None or sock is None or sock.closed:
            return
        if not sock.poll(0, zmq.POLLIN):
            return
        self.counters["subscriptions_at_heartbeat"] += self.subscription_gate.take(sock)
