"""The publisher's subscription messages: read a bounded number per turn, decide, apply.

How this works: the publisher (P+1) is an XPUB in manual mode in every mode,
so libzmq applies no subscription by itself.  :class:`SubscriptionGate` reads
the subscription messages, at most :data:`PER_TURN` messages or
``TURN_BUDGET`` of time per loop turn (a flood waits for the next turn; the
heartbeat and everything else run in between), names each one's connection
by the descriptor libzmq read it from (``zmq.SRCFD`` on the message), asks the
:class:`~clone.server.subscriptions.SubscriptionLedger` for a verdict and
applies what is accepted with ``setsockopt(SUBSCRIBE)``, which libzmq applies
to the connection of the message just read.  What topics a connection
actually gets for what it asked is the ``topics`` callback's (security: its
ACL; plain mode: what it asked).

A connection that keeps asking beyond its caps is dropped with
:func:`drop_connection`: ``shutdown(2)`` on a duplicate of libzmq's descriptor.
The duplicate shares libzmq's open socket, so the TCP connection ends for
both; libzmq's engine reads the end, closes its own descriptor and drops the
connection's pipe, subscriptions and queue (docs/operations.md, "Limits").
Connections are told apart by the socket's inode, not the descriptor number,
which the next connection reuses.

libzmq takes a connection's subscriptions in (and stores each in its trie)
inside whatever call our thread makes on the socket, and keeps taking them in
for as long as they arrive faster than it stores them: a flood can hold the
loop inside one ``recv``.  :class:`InboundWatch`, a thread of its own, stops
that: it counts each connection's received bytes in the kernel and shuts a
connection down once it has sent more than its caps could take.

A part that ``CloneServer`` owns; tests/server/test_subscriptions_e2e.py
floods a real server with raw sockets.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from tornado.ioloop import IOLoop
from zmq.utils.monitor import parse_monitor_message

from clone.ratelimit import Throttle
from clone.server.subscriptions import InboundAllowance, SubscriptionLedger, Verdict
from clone.server.wakeup import WakePipe

__all__ = [
    "PER_TURN",
    "SLOW_AFTER",
    "SUBSCRIPTION_RCVBUF",
    "SUBSCRIPTION_RCVHWM",
    "InboundWatch",
    "SubscriptionGate",
    "SubscriptionReader",
    "drop_connection",
    "drop_connection_from",
]

log = logging.getLogger(__name__)

#: Subscription messages handled at most per loop turn.
PER_TURN = 1000
#: The XPUB's receive high-water mark: how many subscription messages libzmq
#: takes in from one connection ahead of us.  libzmq stores each in its own
#: trie as it takes it in (in our thread, during any call on the socket), so
#: this bounds the work and memory a flood costs before the gate sees it.
SUBSCRIPTION_RCVHWM = 32
#: The kernel's receive buffer of each publisher connection (``SO_RCVBUF``;
#: Linux doubles it): a subscriber sends only its handshake and a few topics,
#: and what a flooder got into the buffer before the inbound watch cut it off
#: is still read and stored by libzmq after the cut.
SUBSCRIPTION_RCVBUF = 4096

#: The topics a connection gets for a topic it asked for (``frame`` carries its
#: identity); None: none, refused (the callback counts why).
Topics = Callable[[zmq.Frame, bytes], "list[bytes] | None"]
#: Ends one connection of the publisher given its descriptor and inode.
Dropper = Callable[[int, int], bool]

_SRCFD = int(zmq.SRCFD)
_NOBLOCK = int(zmq.NOBLOCK)


# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received
# (u64s, Linux 4.1), tcpi_notsent_bytes (a u32, Linux 4.6).
_ACKED_RECEIVED = struct.Struct("=QQ")
_ACKED_AT = 120
_NOTSENT = struct.Struct("=I")
_NOTSENT_AT = 144
_TCP_INFO_LEN = _NOTSENT_AT + _NOTSENT.size
#: A subscriber with updates waiting that acknowledged nothing for this long is
#: reported slow (once per stall): its queue in the server is filling.
SLOW_AFTER = 1.0


def drop_connection_from(fd: int, ino: int) -> str | None:
    """:func:`drop_connection`, returning the address of the peer cut off (None:
    nothing was)."""
    return _shut_down(fd, ino)


def drop_connection(fd: int, ino: int) -> bool:
    """End the TCP connection on libzmq's descriptor ``fd`` if it is still the
    socket ``ino``; True if it was shut down.

    Only a duplicate is touched: ``shutdown`` ends the connection for every
    descriptor of it, and closing the duplicate leaves libzmq's open.  The
    inode check keeps a descriptor that libzmq closed and the process reused
    meanwhile from being shut down.
    """
    return _shut_down(fd, ino) is not None


class SubscriptionReader:
    """Runs ``handler`` on the loop when the publisher may have subscriptions.

    Not a ZMQStream: that asks the socket for ``EVENTS``, and pyzmq holds the
    interpreter lock through that call, inside which libzmq takes in what
    its connections sent (every topic into its trie).  Under a flood that
    call does not return until the flood stops, and no other thread runs, so
    not even :class:`InboundWatch` could end it.  ``recv`` and ``poll`` let go
    of the lock; the handler uses only those.
    """

    def __init__(self, sock: zmq.Socket[Any], loop: IOLoop, handler: Callable[[], bool]) -> None:
        self.socket = sock
        self._loop = loop
        self._handler = handler
        self._fd: int | None = int(sock.getsockopt(zmq.FD))
        self._scheduled = False
        loop.add_handler(self._fd, self._ready, IOLoop.READ)
        self._again()  # what arrived before we watched

    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Stop watching (the socket is closed by its owner)."""
        if self._fd is not None:
            self._loop.remove_handler(self._fd)
            self._fd = None

    def _ready(self, fd: int, events: int) -> None:
        self._run()

    def _run(self) -> None:
        self._scheduled = False
        if self._fd is None or self.socket.closed:
            return
        if self._handler():  # stopped at its turn's budget: more may wait
            self._again()

    def _again(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.add_callback(self._run)


class InboundWatch:
    """A thread that ends publisher connections that sent more than subscribing takes.

    It owns the publisher's socket monitor: each ACCEPTED event names a new
    connection's descriptor (its inode tells it from a later connection on the
    same number).  It reads each connection's received-byte count from the
    kernel (``TCP_INFO``), every ``young_every`` in its first second (when a
    flooding XSUB replays every topic it ever sent) and every ``old_every``
    after; one past its :class:`InboundAllowance` is shut down and ``on_drop``
    is called with its peer and byte count.  The same counts tell a subscriber
    that reads nothing (data waits in the kernel, none acknowledged): it is
    reported once per stall (``on_slow``) and, once more than ``budget``
    bytes were published (``published``, the publisher's running count) since
    it last acknowledged anything, cut off (``on_cut``): its connection, and
    with it its queue in libzmq, goes; its client sees the loss and resyncs.
    Every monitor event is passed on to ``on_event`` (the loop's connection
    count).  It needs nothing from the
    loop, so it works while a flood keeps the loop inside libzmq (which lets
    go of the interpreter lock there).  ``allowance`` None: events only.
    """

    #: The longest one poll waits (a bound, not a pace: :meth:`stop` wakes it).
    longest_wait_ms = 100

    def __init__(
        self,
        monitor: zmq.Socket[Any],
        allowance: InboundAllowance | None,
        on_event: Callable[[int, int], None],
        on_drop: Callable[[str, int], None],
        on_slow: Callable[[str, int], None] | None = None,
        *,
        budget: int = 0,
        published: Callable[[], int] | None = None,
        on_cut: Callable[[str, int], None] | None = None,
        young_every: float = 0.002,
        old_every: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monitor = monitor
        self._allowance = allowance
        self._on_event = on_event
        self._on_drop = on_drop
        self._on_slow = on_slow
        self._budget = budget
        self._published = published
        self._on_cut = on_cut
        self._young_every = young_every
        self._old_every = old_every
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The thread polls the monitor and a pipe that stop() writes to.
        self._wake: WakePipe | None = None
        self._poller = zmq.Poller()
        self._poller.register(monitor, zmq.POLLIN)
        # descriptor -> its connection's state
        self._conns: dict[int, _Conn] = {}

    def start(self) -> None:
        self._wake = WakePipe()
        self._poller.register(self._wake.fd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name="clone-inbound-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (woken at once, not at its poll's timeout) and
        close the monitor socket."""
        self._stop.set()
        thread, self._thread = self._thread, None
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        if wake is not None:
            wake.close()
        if not self._monitor.closed:
            self._monitor.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except zmq.ZMQError:
                return  # the monitor was closed under us: stopping
            except Exception:
                log.exception("internal error in the publisher's inbound watch")
                self._stop.wait(self._old_every)

    def poll_timeout_ms(self, now: float) -> int:
        """How long the next poll may wait: until the first connection is due
        (at most 100 ms), rounded *up* to whole milliseconds.  Rounded down, a
        check due in under a millisecond polled with 0 again and again until
        it came: a spin that cost 0.5 CPU-seconds for every new connection
        (checked every 2 ms in its first second) and 2% of a core for every
        older one (docs/benchmarks.md, "Idle CPU")."""
        due = min((c.due for c in self._conns.values()), default=now + self._old_every)
        return min(max(0, math.ceil((due - now) * 1000)), self.longest_wait_ms)

    def _turn(self) -> None:
        ready = dict(self._poller.poll(self.poll_timeout_ms(self._clock())))
        if self._stop.is_set():
            return
        if ready.get(self._monitor):
            for _ in range(1000):
                try:
                    frames = self._monitor.recv_multipart(_NOBLOCK)
                except zmq.Again:
                    break
                event = parse_monitor_message(frames)
                self.event(int(event["event"]), int(event["value"]))
        self.check(self._clock())

    def event(self, event: int, value: int) -> None:
        """One monitor event: track the connection, and pass the event on."""
        if event == zmq.EVENT_ACCEPTED:
            try:
                ino = os.fstat(value).st_ino
            except OSError:
                ino = -1
            now = self._clock()
            self._conns[value] = _Conn(ino, now, now, 0, now, self._sent())
        elif event == zmq.EVENT_DISCONNECTED:
            self._conns.pop(value, None)
        self._on_event(event, value)

    def check(self, now: float) -> int:
        """Check the connections that are due; how many were shut down."""
        allowance = self._allowance
        dropped = 0
        for fd, conn in list(self._conns.items()):
            if conn.due > now:
                continue
            age = now - conn.since
            conn.due = now + (self._young_every if age < 1.0 else self._old_every)
            info = _tcp_info(fd, conn.ino)
            if info is None:
                self._conns.pop(fd, None)  # gone, or another socket now
                continue
            acked, received, notsent = info
            if allowance is not None and not allowance.allows(received, age):
                peer = _shut_down(fd, conn.ino)
                if peer is not None:
                    self._conns.pop(fd, None)
                    dropped += 1
                    self._on_drop(peer, received)
                continue
            if self._check_slow(fd, conn, now, acked, notsent):
                dropped += 1
        return dropped

    def _sent(self) -> int:
        return 0 if self._published is None else self._published()

    def _check_slow(self, fd: int, conn: _Conn, now: float, acked: int, notsent: int) -> bool:
        """Report a subscriber that stopped reading; cut it off (True) once more
        than the budget was published since it last acknowledged anything."""
        sent = self._sent()
        if acked != conn.acked or not notsent:
            conn.acked, conn.acked_at, conn.slow, conn.sent_at = acked, now, False, sent
            return False
        # Everything published since it stopped is queued for it, at most
        # (less if it subscribes to part of the stream).
        queued = sent - conn.sent_at
        if self._budget and queued > self._budget:
            peer = _shut_down(fd, conn.ino)
            if peer is not None:
                self._conns.pop(fd, None)
                if self._on_cut is not None:
                    self._on_cut(peer, queued)
                return True
        if conn.slow or now - conn.acked_at < SLOW_AFTER or self._on_slow is None:
            return False
        conn.slow = True  # once per stall
        peer = _peer_of(fd, conn.ino)
        if peer is not None:
            self._on_slow(peer, notsent)
        return False


class _Conn:
    """What the watch knows of one connection."""

    __slots__ = ("acked", "acked_at", "due", "ino", "sent_at", "since", "slow")

    def __init__(
        self, ino: int, since: float, due: float, acked: int, acked_at: float, sent_at: int
    ) -> None:
        self.ino = ino
        self.since = since
        self.due = due
        self.acked = acked  # bytes the subscriber acknowledged, at the last change
        self.acked_at = acked_at
        self.sent_at = sent_at  # bytes the server had published then
        self.slow = False  # reported slow since it last acknowledged anything


def _tcp_info(fd: int, ino: int) -> tuple[int, int, int] | None:
    """(bytes acknowledged, bytes received, bytes not sent yet) of the socket
    ``ino`` on ``fd``; None if ``fd`` is not that socket any more.  Zeros on a
    kernel without these counts (the gate then decides alone)."""
    sock = _dup_socket(fd, ino)
    if sock is None:
        return None
    with sock:
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            return None
    if len(info) < _TCP_INFO_LEN:
        return (0, 0, 0)
    acked, received = _ACKED_RECEIVED.unpack_from(info, _ACKED_AT)
    (notsent,) = _NOTSENT.unpack_from(info, _NOTSENT_AT)
    return int(acked), int(received), int(notsent)


def _peer_of(fd: int, ino: int) -> str | None:
    sock = _dup_socket(fd, ino)
    if sock is None:
        return None
    with sock:
        try:
            return str(sock.getpeername()[0])
        except (OSError, IndexError):
            return None


def _shut_down(fd: int, ino: int) -> str | None:
    """Shut the socket ``ino`` on ``fd`` down; its peer's address, or None."""
    sock = _dup_socket(fd, ino)
    if sock is None:
        return None
    with sock:
        try:
            peer = str(sock.getpeername()[0])
            sock.shutdown(socket.SHUT_RDWR)
        except (OSError, IndexError):
            return None
    return peer


def _dup_socket(fd: int, ino: int) -> socket.socket | None:
    """A duplicate of ``fd`` as a socket object, if it is still the socket ``ino``."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != ino:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


class SubscriptionGate:
    """Reads, judges and applies the publisher's subscription messages."""

    def __init__(
        self,
        ledger: SubscriptionLedger,
        topics: Topics,
        counters: dict[str, int],
        throttle: Throttle,
        clock: Callable[[], float],
        turn_budget: float,
        drop: Dropper,
    ) -> None:
        self.ledger = ledger
        self._topics = topics
        self._counters = counters
        self._throttle = throttle
        self._clock = clock
        self._turn_budget = turn_budget
        self._drop = drop
        self._in_message = False  # skipping the later frames of a multipart message
        self._inodes: dict[int, int] = {}  # descriptor -> inode of its connection

    def reset(self) -> None:
        """A new socket (bound again): no connection is known."""
        self.ledger = SubscriptionLedger(self.ledger.limits)
        self._in_message = False
        self._inodes.clear()

    def on_event(self, event: int, value: int) -> None:
        """A socket monitor event of the publisher (the value is the descriptor):
        a closed connection's account goes.  (A new connection needs no event:
        its inode is new.)"""
        if event == zmq.EVENT_DISCONNECTED:
            ino = self._inodes.pop(value, None)
            if ino is not None:
                self.ledger.disconnected(ino)

    def take(self, sock: zmq.Socket[Any]) -> int:
        """Handle what waits, within a turn's budget; how many messages were
        handled (:data:`PER_TURN`: it stopped at its budget, more may wait)."""
        n = 0
        stop_at = self._clock() + self._turn_budget
        while n < PER_TURN:
            try:
                frame = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return n
            self._frame(sock, frame)
            n += 1
            if n % 64 == 0 and self._clock() >= stop_at:
                return PER_TURN
        return n

    def _frame(self, sock: zmq.Socket[Any], frame: zmq.Frame) -> None:
        # Only a message's first frame can be a subscription (an XSUB may send
        # multipart messages; their other frames mean nothing to us).
        first = not self._in_message
        self._in_message = frame.more
        if not first:
            return
        raw = frame.bytes
        if not raw or raw[0] not in (0, 1):
            return
        try:
            fd = int(frame.get(_SRCFD))
        except zmq.ZMQError:
            # No source: libzmq's own unsubscription for a connection that
            # closed (its topics went with it).
            return
        try:
            # The connection is the socket's inode: a descriptor number is
            # reused by the next connection once libzmq closes it.
            conn = os.fstat(fd).st_ino
        except OSError:
            return  # closed since: its topics went with it
        before = self._inodes.get(fd)
        if before != conn:
            if before is not None:  # a closed connection's DISCONNECTED is still on its way
                self.ledger.disconnected(before)
            self._inodes[fd] = conn
        topic = raw[1:]
        if raw[0] == 0:
            if self.ledger.unsubscribe(conn, topic):
                for t in self._topics(frame, topic) or ():
                    sock.setsockopt(zmq.UNSUBSCRIBE, t)
            return
        verdict = self.ledger.subscribe(conn, topic)
        if verdict is Verdict.ACCEPT:
            topics = self._topics(frame, topic)
            if topics is None:  # not admitted (security): it gets nothing
                self._counters["subscriptions_refused"] += 1
                return
            for t in topics:
                sock.setsockopt(zmq.SUBSCRIBE, t)
            self._counters["subscriptions"] += 1
        elif verdict is Verdict.REFUSE:
            self._counters["subscriptions_over_limit"] += 1
        elif verdict is Verdict.DROP:
            self._counters["subscriptions_over_limit"] += 1
            dropped = self._drop(fd, conn)
            if dropped:
                self._counters["subscribers_dropped"] += 1
            lim = self.ledger.limits
            self._throttle.log(
                "subscriptions_over_limit",
                logging.WARNING,
                "subscriber %s (descriptor %d) kept subscribing beyond %d topics or %d bytes"
                " (--max-subscriptions, --max-subscription-bytes): %s",
                _peer(frame),
                fd,
                lim.max_count,
                lim.max_bytes,
                "connection dropped" if dropped else "could not drop it, ignoring it",
            )


def _peer(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "?"
