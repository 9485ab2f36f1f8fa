"""The pair link's sockets: a PUB that announces our state, a SUB on the peer's.

Why a module of its own: :class:`bstar.reactor.BinaryStar` decides, logs and
calls back; :class:`PairLink` only owns the four sockets of the link and
their options, so that the reactor reads as timers and decisions.  Both
sockets carry ZMTP heartbeats and ``LINK_MAX_MESSAGE``; the PUB's monitor
reports closed connections (counted and logged here), and the SUB's
monitor reports the connection to the peer's publisher made or lost: with
fast failover the reactor hands that to the state machine, and in either mode
the link connects again itself when libzmq would not (see
:meth:`PairLink._repair`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream
from zmq.utils.monitor import parse_monitor_message

from bstar.report import RateLimitedLog
from bstar.wire import MAX_STATE_FRAME

__all__ = ["LINK_MAX_MESSAGE", "PairLink", "check_link_arguments", "keep_alive"]

log = logging.getLogger("bstar.reactor")

#: ZMQ_MAXMSGSIZE of both sockets of the pair link, in bytes: libzmq drops a
#: connection whose frame header claims more, before it allocates anything.
#: Room for the CURVE handshake's commands, which count too, and about 60
#: times the longest state message (:data:`bstar.wire.MAX_STATE_FRAME`).
LINK_MAX_MESSAGE = max(4096, MAX_STATE_FRAME)

#: Socket monitor events of the SUB: fast failover, and the repair of a
#: connection libzmq gave up on.
_MONITORED_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED

Handler = Callable[[list[bytes]], None]

#: Bad input from the network is logged at most once per this many seconds.
_LOG_INTERVAL = 10.0

#: The least wait, in seconds, before the link connects again itself after
#: a lost connection: libzmq's own retry comes within twice its 100 ms
#: reconnect interval, and should come first.
_MIN_REPAIR_DELAY = 0.25


def check_link_arguments(
    ctx: object, loop: object, local_endpoint: object, peer_endpoint: object, fast_failover: object
) -> None:
    """API misuse of a link's settings: ``TypeError`` or ``ValueError`` saying which."""
    if not isinstance(ctx, zmq.Context):
        raise TypeError(f"ctx must be a zmq.Context, got {type(ctx).__name__}")
    if not isinstance(loop, IOLoop):
        raise TypeError(f"loop must be a tornado IOLoop, got {type(loop).__name__}")
    endpoints = {"local_endpoint": local_endpoint, "peer_endpoint": peer_endpoint}
    for name, endpoint in endpoints.items():
        if not isinstance(endpoint, str) or not endpoint:
            raise ValueError(f"{name} must be a non-empty endpoint string, got {endpoint!r}")
    if local_endpoint == peer_endpoint:
        raise ValueError(f"local and peer endpoints are both {local_endpoint!r}")
    if not isinstance(fast_failover, bool):
        raise TypeError(f"fast_failover must be a bool, got {type(fast_failover).__name__}")



def keep_alive(sock: zmq.Socket[Any], heartbeat: float, missed: int) -> None:
    """ZMTP heartbeats on the link: a connection silent for ``missed``
    heartbeats is closed and made again.

    Without them a connection cut by a partition stays open through it,
    and once healed waits for TCP's retransmission back-off (seconds, up
    to two minutes) before anything flows: both servers stayed active
    for about 6 s after a 7.5 s cut in the partition drill.  A fresh
    connection carries the next state message at once.
    """
    interval = max(1, round(heartbeat * 1000))
    # No receive limit on a socket with ZMTP heartbeats (libzmq issue
    # 3937): when a stalled loop lets the pipe fill, libzmq stops reading
    # the connection, so it cannot see the peer's PINGs either; the
    # heartbeat then kills a healthy connection, and on the reconnection a
    # stale "pipe has room again" from the old one aborts the process
    # (``Assertion failed: _input_stopped (src/stream_engine_base.cpp:396)``,
    # seen killing a backup under a bulk load).  An unbounded pipe never
    # stops the input; the link carries a few small state messages per
    # heartbeat, so what a stall queues stays small.
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, interval * missed)
    sock.setsockopt(zmq.HEARTBEAT_TTL, interval * missed)

class PairLink:
    """The link's sockets: open, publish, read what is queued, close."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        loop: IOLoop,
        local_endpoint: str,
        peer_endpoint: str,
        *,
        heartbeat: float,
        missed: int,
        fast_failover: bool,
        secure_socket: Callable[[zmq.Socket[Any], bool], object] | None,
        clock: Callable[[], float],
    ) -> None:
        self._ctx = ctx
        self._loop = loop
        self._local = local_endpoint
        self._peer = peer_endpoint
        self._heartbeat = heartbeat
        self._missed = missed
        self._fast_failover = fast_failover
        self._secure_socket = secure_socket
        self._pub: zmq.Socket[Any] | None = None
        self._sub: ZMQStream | None = None
        self._monitor: ZMQStream | None = None
        self._pub_monitor: ZMQStream | None = None
        self._on_connected: Callable[[], None] = _nothing
        self._on_disconnected: Callable[[], None] = _nothing
        #: Connections the SUB made to the peer's publisher (monitor events);
        #: a repair scheduled at a disconnect acts only if none came since.
        self._sub_connects = 0
        self._repair_timer: object | None = None
        #: Times the link connected the SUB again itself (:meth:`_repair`).
        self.reconnects = 0
        self._repair_log = RateLimitedLog(log, _LOG_INTERVAL, clock)
        #: Connections to our state publisher that closed (the peer's, when it
        #: reconnects; any sender's that libzmq cut off for an oversized frame).
        self.subscriber_disconnects = 0
        self._publisher_log = RateLimitedLog(log, _LOG_INTERVAL, clock)
        self._event_log = RateLimitedLog(log, _LOG_INTERVAL, clock)

    def open(
        self,
        on_state: Handler,
        on_connected: Callable[[], None],
        on_disconnected: Callable[[], None],
    ) -> None:
        """Bind the PUB, connect the SUB, and hand what they hear on:
        ``on_state`` gets the peer's state messages; ``on_connected`` and
        ``on_disconnected`` are told of the connection to the peer's
        publisher (fast failover only).  Whatever fails closes what was
        opened, and raises."""
        self._on_connected, self._on_disconnected = on_connected, on_disconnected
        try:
            pub = self._ctx.socket(zmq.PUB)
            self._pub = pub
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.MAXMSGSIZE, LINK_MAX_MESSAGE)
            self._keep_alive(pub)
            if self._secure_socket is not None:
                self._secure_socket(pub, True)
            # Counts the connections libzmq closes, oversized frames included.
            self._pub_monitor = ZMQStream(
                pub.get_monitor_socket(zmq.EVENT_DISCONNECTED), self._loop
            )
            self._pub_monitor.setsockopt(zmq.LINGER, 0)
            pub.bind(self._local)
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, LINK_MAX_MESSAGE)
            self._keep_alive(sub)
            if self._secure_socket is not None:
                self._secure_socket(sub, False)
            self._sub = ZMQStream(sub, self._loop)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            # Before connect(), so that no event is missed. The monitor is a
            # PAIR socket on an inproc endpoint, made in the SUB's context.
            # Wrapped at once, so that close() closes it whatever fails next.
            self._monitor = ZMQStream(sub.get_monitor_socket(_MONITORED_EVENTS), self._loop)
            self._monitor.setsockopt(zmq.LINGER, 0)
            sub.connect(self._peer)
        except Exception:
            self.close()
            raise
        self._sub.on_recv(on_state)
        if self._monitor is not None:
            self._monitor.on_recv(self._on_peer_event)
        self._pub_monitor.on_recv(self._on_publisher_event)

    def _on_peer_event(self, frames: list[bytes]) -> None:
        """A socket monitor event about our connection to the peer's publisher."""
        try:
            event = parse_monitor_message(frames)["event"]
        except (RuntimeError, ValueError) as exc:  # a libzmq we do not understand
            self._event_log.log(logging.WARNING, "dropped monitor event: %s", exc)
            return
        if event == zmq.EVENT_CONNECTED:
            self._sub_connects += 1
            if self._fast_failover:
                self._on_connected()
        elif event == zmq.EVENT_DISCONNECTED:
            self._schedule_repair()
            if self._fast_failover:
                self._on_disconnected()

    def _schedule_repair(self) -> None:
        """After a lost connection, check one heartbeat later that libzmq made
        a new one (:meth:`_repair`)."""
        if self._repair_timer is None and self._sub is not None:
            connects = self._sub_connects
            self._repair_timer = self._loop.call_later(
                max(self._heartbeat, _MIN_REPAIR_DELAY), self._repair, connects
            )

    def _repair(self, connects: int) -> None:
        """Connect the SUB to the peer's publisher again if libzmq made no new
        connection since the last one closed.

        libzmq reconnects after a connection error or a heartbeat timeout, but
        after a protocol error (a handshake with a socket of another type, a
        frame over ``LINK_MAX_MESSAGE``) it drops the endpoint for good: a
        primary whose peer's publishing port still answered for another
        program when it first connected (a CHP ROUTER of another server, on a
        shared test machine) never heard the backup that bound the port a
        moment later, and stayed starting for a minute.  Disconnecting and
        connecting again makes a fresh attempt; when libzmq was retrying
        anyway (the peer is down) this only restarts its retries, once per
        lost connection."""
        self._repair_timer = None
        if self._monitor is not None:
            # Events libzmq queued but the loop has not handed us yet: a new
            # connection must be seen, or cutting it would look like the
            # peer's death to fast failover.
            self._monitor.flush(zmq.POLLIN)
        if self._sub is None or self._sub.closed() or connects != self._sub_connects:
            return
        sock = self._sub.socket
        try:
            sock.disconnect(self._peer)
        except zmq.ZMQError:
            pass  # libzmq dropped the endpoint already: the protocol-error case
        sock.connect(self._peer)
        self.reconnects += 1
        self._repair_log.log(
            logging.DEBUG,
            "no connection to the peer's publisher at %s since the last one closed:"
            " connecting again (%d so far; libzmq gives up after a protocol error,"
            " e.g. another program answering on that port)",
            self._peer,
            self.reconnects,
        )

    def _on_publisher_event(self, frames: list[bytes]) -> None:
        """A connection to our state publisher closed: the peer reconnecting, or
        libzmq cutting off a sender of a frame above ``LINK_MAX_MESSAGE`` (it
        reports no more than that)."""
        if self._pub is None:
            return
        self.subscriber_disconnects += 1
        self._publisher_log.log(
            logging.INFO,
            "a connection to our state publisher at %s closed (%d so far): the peer"
            " reconnecting, or an oversized or malformed frame cut off",
            self._local,
            self.subscriber_disconnects,
        )

    def counts(self) -> tuple[int, int]:
        """``(subscriber_disconnects, reconnects)``, for the reactor's counters."""
        return self.subscriber_disconnects, self.reconnects

    def _keep_alive(self, sock: zmq.Socket[Any]) -> None:
        keep_alive(sock, self._heartbeat, self._missed)

    def publish(self, frames: Sequence[bytes]) -> bool:
        """Announce a state message; False if not sent (closed, or the PUB's
        queue is full: a PUB drops rather than blocks, the next tick retries)."""
        if self._pub is None:
            return False
        try:
            # A PUB reads nothing: no incoming message for a send to hide.
            self._pub.send_multipart(list(frames), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def take_queued(self) -> None:
        """Hand the state handler what the SUB already holds (libzmq queues a
        peer's last messages before it reports the connection closed)."""
        if self._sub is not None:
            self._sub.flush(zmq.POLLIN)

    def close(self) -> None:
        """Close every socket (monitors first, detached). Safe to call twice."""
        if self._repair_timer is not None:
            self._loop.remove_timeout(self._repair_timer)
            self._repair_timer = None
        if self._monitor is not None:
            # Detach the monitor from the SUB first, so that libzmq stops writing
            # events to it, then close our end; both before the SUB goes.
            if self._sub is not None and not self._sub.closed():
                try:
                    self._sub.socket.disable_monitor()
                except zmq.ZMQError as exc:
                    log.debug("disable_monitor failed: %s", exc)
            self._monitor.close(linger=0)
            self._monitor = None
        if self._pub_monitor is not None:
            if self._pub is not None and not self._pub.closed:
                try:
                    self._pub.disable_monitor()
                except zmq.ZMQError as exc:
                    log.debug("disable_monitor failed: %s", exc)
            self._pub_monitor.close(linger=0)
            self._pub_monitor = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None


def _nothing() -> None:
    pass
