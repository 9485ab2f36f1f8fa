"""Binary Star over ZeroMQ on a tornado IOLoop: the I/O around :mod:`bstar.fsm`.

:class:`BinaryStar` owns a PUB socket, bound at the local endpoint, on which it
announces its state and election epoch every heartbeat and right after every
transition, and a SUB
socket connected to the peer's PUB. Everything it hears and every client vote goes
to the state machine; what comes back is turned into callbacks and log lines.

With ``fast_failover`` (the default) the SUB socket is also watched with a zmq
socket monitor: when the TCP connection to the peer's publisher is lost, which
happens at once when the peer's process dies, the state machine is told
(:meth:`~bstar.fsm.BinaryStarFSM.peer_disconnected`) and the next client vote may
fail over without waiting for ``missed`` heartbeats.

A server that keeps its data on disk passes ``rank``, a function returning how
new its data is, ``(term, sequence)``: it is read before every input to the
state machine and every time we publish, and announced with our state, so that
on a cold start of both servers the newer data serves (see :mod:`bstar.fsm`).
``epoch`` (the last saved election epoch) and ``start_wait`` (how long a lone
server waits for its peer before it may serve) go with it.

All methods must be called on the loop's thread (from another thread, go through
``loop.add_callback``). Nothing here blocks, and nothing looks up a global loop or
context: both are passed in, so several instances can share one process, which is
how the tests run a primary and a backup side by side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream
from zmq.utils.monitor import parse_monitor_message

from bstar.errors import BinaryStarError, PeerNumberOutOfRange, PeerStateError
from bstar.fsm import (
    NO_RANK,
    BinaryStarFSM,
    Conflict,
    FsmCounters,
    Outcome,
    Rank,
    State,
    TieBreak,
)
from bstar.wire import MAX_STATE_FRAME, check_wire_rank, decode_state, encode_state

__all__ = [
    "LINK_MAX_MESSAGE",
    "BinaryStar",
    "BinaryStarCounters",
    "RankSource",
    "SocketSetup",
    "StateCallback",
    "VoteHandler",
    "keep_alive",
]

log = logging.getLogger(__name__)

#: Called with no arguments when the server becomes active, passive, or detects
#: split brain.
StateCallback = Callable[[], object]
#: Called with a socket before it binds (True) or connects (False): see BinaryStar.
SocketSetup = Callable[[zmq.Socket[Any], bool], object]
#: Called with the voter stream and the received frames when a vote is accepted;
#: reply on the stream if the protocol needs a reply.
VoteHandler = Callable[[ZMQStream, list[bytes]], object]
#: Returns how new the application's data is now: ``(term, sequence)``.
RankSource = Callable[[], Rank]

#: Bad input from the network is logged at most once per this many seconds.
_LOG_INTERVAL = 10.0

#: What a dead peer means in each state, for the one log line about it.
_AFTER_EXPIRY = {
    State.PRIMARY: "the next client vote makes us active",
    State.BACKUP: "votes stay refused until the primary has been seen",
    State.ACTIVE: "still serving",
    State.PASSIVE: "the next client vote fails over",
}


#: The tie-breaks that compare data ranks, for the log line that explains them.
_RANK_TIE_BREAKS = frozenset(
    {TieBreak.RANK, TieBreak.RANK_NEEDS_NEWER, TieBreak.RANK_YIELDS_TO_NEWER}
)


def _describe_rank(rank: Rank) -> str:
    return "no data" if rank == NO_RANK else f"term {rank[0]}, sequence {rank[1]}"


def _rank_verdict(outcome: Outcome) -> str | None:
    """Why the ranks made us yield or go ahead, for an operator; None if they did not."""
    peer = outcome.peer_rank
    if outcome.tie_break not in _RANK_TIE_BREAKS or peer is None:
        return None
    if outcome.rank == peer == NO_RANK:  # in-memory servers: the Guide's rules, nothing to say
        return None
    ours, theirs = _describe_rank(outcome.rank), _describe_rank(peer)
    if outcome.yielded:
        if outcome.rank < peer:
            return f"yielding: peer's data ({theirs}) is newer than ours ({ours})"
        return f"yielding: peer's data ({theirs}) is as new as ours ({ours})"
    if outcome.rank > peer:
        return f"going ahead: our data ({ours}) is newer than the peer's ({theirs})"
    return f"going ahead: our data ({ours}) is as new as the peer's ({theirs})"


#: ZMQ_MAXMSGSIZE of both sockets of the pair link, in bytes: libzmq drops a
#: connection whose frame header claims more, before it allocates anything.
#: Room for the CURVE handshake's commands, which count too, and about 60
#: times the longest state message (:data:`bstar.wire.MAX_STATE_FRAME`).
LINK_MAX_MESSAGE = max(4096, MAX_STATE_FRAME)

#: The heartbeat's schedule. Not ``IOLoop.time()``: tornado's is the wall
#: clock (``time.time``), so a schedule kept on it and handed to ``call_at``
#: stalls when the clock steps. In chaos run seed 7 the primary's clock
#: stepped 3600 s forward and back (docs/drills.md, "Chaos"); its next tick
#: was then an hour away, it published its state only on transitions, and the
#: backup, the loser of the split brain that followed, never heard it and
#: stayed active. The loop is only asked for a delay (``call_later``), as
#: clone.server.reactor does. Not the injectable ``clock`` either: that one
#: is the state machine's, and a test's fake clock must not stop the timer.
_monotonic = time.monotonic

#: Socket monitor events that matter for fast failover.
_MONITORED_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


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


@dataclass(frozen=True, slots=True)
class BinaryStarCounters:
    """Counters of the state machine plus those of the I/O around it."""

    fsm: FsmCounters
    state_messages_sent: int = 0
    state_messages_received: int = 0
    malformed_peer_messages: int = 0
    #: Of the malformed ones: an epoch, term or sequence above ``MAX_EPOCH``.
    out_of_range_peer_messages: int = 0
    #: Heartbeat ticks or peer messages whose handling raised (logged with the
    #: traceback; the heartbeat goes on).
    handler_errors: int = 0
    #: Connections to our state publisher that closed (the peer's, when it
    #: reconnects; any sender's that libzmq cut off for a frame above
    #: ``LINK_MAX_MESSAGE``).
    subscriber_disconnects: int = 0
    rejected_peer_events: int = 0
    callback_errors: int = 0
    #: Connections to the peer's publisher lost / (re)established, as seen by the
    #: socket monitor (always 0 with ``fast_failover=False``).
    peer_disconnects: int = 0
    peer_connects: int = 0


class _RateLimitedLog:
    """Log at most one message per interval and say how many were held back.

    A peer stuck sending garbage at the heartbeat rate must not flood the log.
    """

    def __init__(self, logger: logging.Logger, interval: float, clock: Callable[[], float]):
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._last: float | None = None
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, self._suppressed)
        self._logger.log(level, msg, *args, exc_info=exc_info)
        self._last = now
        self._suppressed = 0


class BinaryStar:
    """One server of a Binary Star pair.

    ``primary`` is this server's configured role. ``local_endpoint`` is where our
    state is published (bound), ``peer_endpoint`` where the peer publishes its own
    (connected). The peer is declared dead ``missed`` heartbeats after it was last
    heard. ``clock`` returns monotonic seconds; it is injectable so that the rules
    can be exercised with a controlled time source.

    ``fast_failover`` (default True) watches the connection to the peer's
    publisher: when it is lost (the peer process died or closed its sockets) the
    peer counts as expired at once, instead of ``missed * heartbeat`` later. A
    frozen peer or a network partition closes no connection; those are still
    detected by the heartbeat alone. Pass False for the heartbeat-only behaviour.

    ``epoch`` is the election epoch to start from (the last one a durable server
    saved). ``start_wait`` is how long, at least, a server that has not heard its
    peer since it started waits before a vote may make it active. ``rank``, if
    given, returns how new our data is; our state messages then carry it and the
    start-up rules compare it with the peer's. Without it we announce no rank,
    which the peer reads as ``(0, 0)``, and the Guide's rules apply unchanged.

    ``secure_socket``, if given, is called with each socket before it binds
    (``bound=True``: our publisher) or connects (``bound=False``: the SUB on the
    peer's publisher), so that the application can apply its security (CURVE
    keys, a ZAP domain) to the Binary Star link as to its other sockets.

    Create it, register callbacks and voters, then :meth:`start`; :meth:`stop`
    closes everything. An instance is started at most once: a restarted server
    is a new instance, just as it would be a new process.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        loop: IOLoop,
        primary: bool,
        local_endpoint: str,
        peer_endpoint: str,
        *,
        heartbeat: float = 1.0,
        missed: int = 2,
        clock: Callable[[], float] = time.monotonic,
        fast_failover: bool = True,
        epoch: int = 0,
        start_wait: float = 0.0,
        rank: RankSource | None = None,
        secure_socket: SocketSetup | None = None,
    ) -> None:
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
        if rank is not None and not callable(rank):
            raise TypeError(f"rank must be a callable or None, got {type(rank).__name__}")
        self._ctx = ctx
        self._loop = loop
        self._local_endpoint = local_endpoint
        self._peer_endpoint = peer_endpoint
        self._clock = clock
        self._fast_failover = fast_failover
        self._rank_source = rank
        self._secure_socket = secure_socket
        # Validates primary/heartbeat/missed/epoch/start_wait; replaced at start()
        # so that the start-up grace period counts from the moment we begin listening.
        self._fsm = BinaryStarFSM(
            primary,
            clock(),
            heartbeat=heartbeat,
            missed=missed,
            epoch=epoch,
            start_wait=start_wait,
        )
        self._on_active: list[StateCallback] = []
        self._on_passive: list[StateCallback] = []
        self._on_split_brain: list[StateCallback] = []
        self._voters: list[ZMQStream] = []
        self._pub: zmq.Socket[Any] | None = None
        self._sub: ZMQStream | None = None
        self._monitor: ZMQStream | None = None
        self._pub_monitor: ZMQStream | None = None
        self._timer: object | None = None
        self._next_tick = 0.0
        self._started = False
        self._stopped = False
        self._sent = 0
        self._received = 0
        self._malformed = 0
        self._out_of_range = 0
        self._handler_errors = 0
        self._subscriber_disconnects = 0
        self._rejected = 0
        self._callback_errors = 0
        self._disconnects = 0
        self._connects = 0
        self._bad_input_log = _RateLimitedLog(log, _LOG_INTERVAL, clock)
        self._rank_error_log = _RateLimitedLog(log, _LOG_INTERVAL, clock)
        self._handler_error_log = _RateLimitedLog(log, _LOG_INTERVAL, clock)
        self._publisher_log = _RateLimitedLog(log, _LOG_INTERVAL, clock)

    def __repr__(self) -> str:
        role = "primary" if self.primary else "backup"
        return (
            f"<BinaryStar {role} {self.state.name} epoch {self.epoch}"
            f" at {self._local_endpoint} peer {self._peer_endpoint}>"
        )

    # -- read-only views -------------------------------------------------------

    @property
    def primary(self) -> bool:
        return self._fsm.primary

    @property
    def state(self) -> State:
        return self._fsm.state

    @property
    def peer_state(self) -> State | None:
        """The peer's last reported state, or None if never heard."""
        return self._fsm.peer_state

    @property
    def epoch(self) -> int:
        """Our election epoch: 0 until first active, bumped on every election."""
        return self._fsm.epoch

    @property
    def peer_epoch(self) -> int:
        """The highest epoch the peer has announced (0 if never, or a Guide peer)."""
        return self._fsm.peer_epoch

    @property
    def rank(self) -> Rank:
        """Our data rank as last read from the ``rank`` callable (``(0, 0)`` without one)."""
        return self._fsm.rank

    @property
    def peer_rank(self) -> Rank:
        """The rank in the peer's last state message (``(0, 0)`` if none)."""
        return self._fsm.peer_rank

    @property
    def heard_peer(self) -> bool:
        """Whether the peer has been heard since we started. A server that becomes
        active without it served on ``start_wait`` alone: its data may be older."""
        return self._fsm.heard_peer

    @property
    def start_wait(self) -> float:
        return self._fsm.start_wait

    @property
    def last_peer_contact(self) -> float | None:
        """Clock reading of the last state message from the peer, or None."""
        return self._fsm.last_peer_contact

    @property
    def peer_expiry(self) -> float:
        """Clock reading from which a vote may make us active, unless the peer speaks."""
        return self._fsm.peer_expiry

    @property
    def peer_alive(self) -> bool:
        """Whether the peer counts as alive now: heard within ``missed`` heartbeats
        and, with fast failover, its connection not lost since. For status pages;
        a vote decides with its own reading of the clock."""
        return self._fsm.peer_alive(self._clock())

    @property
    def fast_failover(self) -> bool:
        """Whether a lost connection to the peer counts as its death."""
        return self._fast_failover

    @property
    def heartbeat(self) -> float:
        return self._fsm.heartbeat

    @property
    def missed(self) -> int:
        return self._fsm.missed

    @property
    def local_endpoint(self) -> str:
        return self._local_endpoint

    @property
    def peer_endpoint(self) -> str:
        return self._peer_endpoint

    @property
    def running(self) -> bool:
        """True between start() and stop()."""
        return self._started and not self._stopped

    @property
    def counters(self) -> BinaryStarCounters:
        return BinaryStarCounters(
            fsm=self._fsm.counters,
            state_messages_sent=self._sent,
            state_messages_received=self._received,
            malformed_peer_messages=self._malformed,
            out_of_range_peer_messages=self._out_of_range,
            handler_errors=self._handler_errors,
            subscriber_disconnects=self._subscriber_disconnects,
            rejected_peer_events=self._rejected,
            callback_errors=self._callback_errors,
            peer_disconnects=self._disconnects,
            peer_connects=self._connects,
        )

    # -- application hooks -----------------------------------------------------

    def on_active(self, callback: StateCallback) -> None:
        """Call ``callback()`` each time this server becomes active."""
        self._on_active.append(callback)

    def on_passive(self, callback: StateCallback) -> None:
        """Call ``callback()`` each time this server becomes passive.

        After a split brain the side that lost (the lower epoch, or the backup on
        equal epochs) lands here too: what it served during the split may have
        diverged from the winner, so this is the place to resynchronise.
        """
        self._on_passive.append(callback)

    def on_split_brain(self, callback: StateCallback) -> None:
        """Call ``callback()`` once per split-brain episode, on both servers."""
        self._on_split_brain.append(callback)

    def register_voter(self, voter: zmq.Socket[Any] | ZMQStream, handler: VoteHandler) -> ZMQStream:
        """Treat every message on ``voter`` as a client vote.

        A message reaches ``handler(stream, frames)`` only if the vote is accepted;
        a refused vote is dropped (and counted), which is how a passive server stays
        silent while its peer lives. Ownership of the socket passes to us: it is
        closed by :meth:`stop`. Returns the stream, so the handler can reply on it.
        """
        if self._stopped:
            raise RuntimeError("register_voter() on a stopped BinaryStar")
        if isinstance(voter, ZMQStream):
            if voter.io_loop is not self._loop:
                raise ValueError("voter stream runs on another IOLoop")
            stream = voter
        elif isinstance(voter, zmq.Socket):
            stream = ZMQStream(voter, self._loop)
        else:
            raise TypeError(f"voter must be a zmq.Socket or ZMQStream, got {type(voter).__name__}")

        def on_vote(stream: ZMQStream, frames: list[bytes]) -> None:
            if self.accept_vote():
                self._call(handler, "vote handler", stream, frames)
            else:
                log.debug("vote refused in state %s, message dropped", self.state.name)

        stream.on_recv_stream(on_vote)
        self._voters.append(stream)
        return stream

    def accept_vote(self, now: float | None = None) -> bool:
        """Count one client request as a vote; True if the application may serve it.

        For voter sockets the application manages itself: call this for each
        request and serve only on True. Accepting may make this server active; if
        so, the ``on_active`` callbacks run *before* this returns, so the
        application is ready (pending updates applied) when it serves the request.
        A server that is not running never accepts. ``now`` defaults to the clock.
        """
        if not self.running:
            return False
        self._refresh_rank()
        outcome = self._fsm.client_request(self._clock() if now is None else now)
        self._react(outcome)
        return outcome.accepted

    # -- life cycle ------------------------------------------------------------

    def start(self) -> None:
        """Bind, connect, announce our state and start the heartbeat."""
        if self._started:
            if self._stopped:
                raise RuntimeError("a stopped BinaryStar cannot be restarted; create a new one")
            return
        self._started = True
        old = self._fsm
        self._fsm = BinaryStarFSM(
            old.primary,
            self._clock(),
            heartbeat=old.heartbeat,
            missed=old.missed,
            epoch=old.epoch,
            start_wait=old.start_wait,
        )
        self._refresh_rank()
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
            pub.bind(self._local_endpoint)
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, LINK_MAX_MESSAGE)
            self._keep_alive(sub)
            if self._secure_socket is not None:
                self._secure_socket(sub, False)
            self._sub = ZMQStream(sub, self._loop)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            if self._fast_failover:
                # Before connect(), so that no event is missed. The monitor is a
                # PAIR socket on an inproc endpoint, made in the SUB's context.
                # Wrapped at once, so that stop() closes it whatever fails next.
                self._monitor = ZMQStream(sub.get_monitor_socket(_MONITORED_EVENTS), self._loop)
                self._monitor.setsockopt(zmq.LINGER, 0)
            sub.connect(self._peer_endpoint)
        except Exception:
            self.stop()
            raise
        self._sub.on_recv(self._on_peer_message)
        if self._monitor is not None:
            self._monitor.on_recv(self._on_monitor_event)
        if self._pub_monitor is not None:
            self._pub_monitor.on_recv(self._on_publisher_event)
        log.info(
            "binary star %s starting: publishing at %s, peer at %s, heartbeat %.3f s x %d%s,"
            " epoch %d, %s, waiting at least %.3f s for the peer",
            "primary" if self.primary else "backup",
            self._local_endpoint,
            self._peer_endpoint,
            self.heartbeat,
            self.missed,
            ", fast failover on a lost connection" if self._fast_failover else "",
            self.epoch,
            "no data rank" if self._rank_source is None else _describe_rank(self.rank),
            max(self.start_wait, self.heartbeat * self.missed),
        )
        self._publish()
        self._next_tick = _monotonic() + self.heartbeat
        self._timer = self._loop.call_later(self.heartbeat, self._on_tick)

    def _keep_alive(self, sock: zmq.Socket[Any]) -> None:
        keep_alive(sock, self.heartbeat, self.missed)

    def stop(self) -> None:
        """Cancel the heartbeat and close every socket we own. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._started = True
        if self._timer is not None:
            self._loop.remove_timeout(self._timer)
            self._timer = None
        for stream in self._voters:
            stream.close(linger=0)
        self._voters.clear()
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
        log.info("binary star stopped in state %s", self.state.name)

    # -- internals -------------------------------------------------------------

    def _on_tick(self) -> None:
        """Heartbeat: announce our state and note, once, a peer that went silent.

        Rescheduled whatever the work raises: a tick that died once would
        leave the pair without a heartbeat until a restart.
        """
        self._timer = None
        if not self.running:
            return
        try:
            self._beat()
        except Exception:
            self._handler_failed("heartbeat tick")
        finally:
            if self.running:
                # Fixed-rate schedule; if the loop fell behind, skip rather than burst.
                # On the monotonic clock, with a delay (see _monotonic).
                self._next_tick += self.heartbeat
                now = _monotonic()
                if self._next_tick <= now:
                    self._next_tick = now + self.heartbeat
                self._timer = self._loop.call_later(self._next_tick - now, self._on_tick)

    def _beat(self) -> None:
        self._publish()
        now = self._clock()
        if self._fsm.check_expiry(now):
            contact = self._fsm.last_peer_contact
            log.info(
                "peer at %s presumed dead (%s); in state %s, %s",
                self._peer_endpoint,
                "never heard" if contact is None else f"silent for {now - contact:.3f} s",
                self.state.name,
                _AFTER_EXPIRY[self.state],
            )

    def _handler_failed(self, what: str) -> None:
        """Count and log (rate-limited, with the traceback) a handler that raised."""
        self._handler_errors += 1
        self._handler_error_log.log(logging.ERROR, "%s failed; going on", what, exc_info=True)

    def _on_peer_message(self, frames: list[bytes]) -> None:
        if not self.running:
            return
        try:
            self._peer_message(frames)
        except Exception:
            self._handler_failed("handling a peer state message")

    def _peer_message(self, frames: list[bytes]) -> None:
        self._received += 1
        try:
            report = decode_state(frames, self._peer_endpoint)
        except PeerStateError as exc:
            self._malformed += 1
            if isinstance(exc, PeerNumberOutOfRange):
                self._out_of_range += 1
            self._bad_input_log.log(logging.WARNING, "dropped state message: %s", exc)
            return
        self._refresh_rank()
        now = self._clock()
        was_silent = self._fsm.peer_state is None or not self._fsm.peer_alive(now)
        try:
            outcome = self._fsm.receive_peer_state(report.state, now, report.epoch, report.rank)
        except BinaryStarError as exc:
            self._rejected += 1
            self._bad_input_log.log(logging.ERROR, "rejected peer state: %s", exc)
            return
        if was_silent:
            log.info(
                "peer at %s heard (%s, epoch %d, %s; ours: %s)",
                self._peer_endpoint,
                report.state.name,
                report.epoch,
                _describe_rank(report.rank),
                _describe_rank(self.rank),
            )
        self._react(outcome)

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        """A socket monitor event about our connection to the peer's publisher."""
        if not self.running:
            return
        try:
            event = parse_monitor_message(frames)["event"]
        except (RuntimeError, ValueError) as exc:  # a libzmq we do not understand
            self._bad_input_log.log(logging.WARNING, "dropped monitor event: %s", exc)
            return
        if event == zmq.EVENT_CONNECTED:
            self._connects += 1
            self._fsm.peer_connected(self._clock())
            log.debug("connected to the peer at %s", self._peer_endpoint)
        elif event == zmq.EVENT_DISCONNECTED:
            self._disconnects += 1
            self._on_peer_disconnected()

    def _on_publisher_event(self, frames: list[bytes]) -> None:
        """A connection to our state publisher closed: the peer reconnecting, or
        libzmq cutting off a sender of a frame above ``LINK_MAX_MESSAGE`` (it
        reports no more than that)."""
        if not self.running:
            return
        self._subscriber_disconnects += 1
        self._publisher_log.log(
            logging.INFO,
            "a connection to our state publisher at %s closed (%d so far): the peer"
            " reconnecting, or an oversized or malformed frame cut off",
            self._local_endpoint,
            self._subscriber_disconnects,
        )

    def _on_peer_disconnected(self) -> None:
        # What the peer sent before its connection closed is already queued on the
        # SUB socket (libzmq queues it before it reports the disconnect), but the
        # loop may not have handed it to us yet. Read it first, or a last
        # heartbeat processed after the loss would undo it.
        if self._sub is not None:
            self._sub.flush(zmq.POLLIN)
        if not self.running:  # a callback run by the flush stopped us
            return
        now = self._clock()
        self._fsm.peer_disconnected(now)
        if self._fsm.peer_alive(now):
            # Never heard and still within the start wait: the peer may be booting.
            log.info(
                "peer connection lost: %s closed before the peer was heard; waiting for it"
                " until the start wait ends in %.3f s",
                self._peer_endpoint,
                self._fsm.peer_expiry - now,
            )
            return
        self._fsm.check_expiry(now)  # counted now; the heartbeat must not log it again
        log.info(
            "peer connection lost: %s closed; presumed dead; in state %s, %s",
            self._peer_endpoint,
            self.state.name,
            _AFTER_EXPIRY[self.state],
        )

    def _react(self, outcome: Outcome) -> None:
        """Turn a decision of the state machine into log lines, messages and callbacks."""
        if outcome.conflict is Conflict.SPLIT_BRAIN:
            log.warning(
                "split brain: peer at %s is active too (our epoch %d, its epoch %s); %s: %s",
                self._peer_endpoint,
                outcome.epoch,
                outcome.peer_epoch,
                "we step down" if outcome.became_passive else "we keep serving",
                outcome.why,
            )
            self._fire(self._on_split_brain, "split-brain")
        elif outcome.conflict is Conflict.DUAL_PASSIVE:
            log.warning(
                "dual passive: peer at %s is passive too; %s", self._peer_endpoint, outcome.why
            )
        if not outcome.changed:
            return
        verdict = _rank_verdict(outcome)
        log.info(
            "%s -> %s on %s (epoch %d): %s%s",
            outcome.previous.name,
            outcome.state.name,
            outcome.event.name,
            outcome.epoch,
            verdict + "; " if verdict is not None else "",
            outcome.why,
        )
        # Tell the peer now instead of at the next tick: it settles faster.
        self._publish()
        if outcome.became_active:
            self._fire(self._on_active, "on_active")
        elif outcome.became_passive:
            self._fire(self._on_passive, "on_passive")

    def _refresh_rank(self) -> None:
        """Read the application's rank into the state machine, before an input or
        a publication. A failing or bad rank source keeps the last good rank."""
        if self._rank_source is None:
            return
        try:
            self._fsm.set_rank(check_wire_rank(self._rank_source()))
        except Exception:
            self._callback_errors += 1
            self._rank_error_log.log(
                logging.ERROR,
                "rank callback %r failed; keeping %s",
                self._rank_source,
                _describe_rank(self.rank),
                exc_info=True,
            )

    def _publish(self) -> None:
        if self._pub is None:
            return
        self._refresh_rank()
        rank = None if self._rank_source is None else self.rank
        try:
            self._pub.send_multipart(encode_state(self.state, self.epoch, rank), zmq.NOBLOCK)
        except zmq.Again:
            # PUB drops rather than blocks; nothing to do until the next tick.
            return
        self._sent += 1

    def _fire(self, callbacks: list[StateCallback], what: str) -> None:
        for callback in list(callbacks):
            self._call(callback, what)

    def _call(self, callback: Callable[..., object], what: str, *args: object) -> None:
        """Run application code; its failure is logged, never allowed to stop the loop."""
        try:
            callback(*args)
        except Exception:
            self._callback_errors += 1
            log.exception("%s callback %r failed", what, callback)
