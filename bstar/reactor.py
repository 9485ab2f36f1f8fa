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
from typing import Any

import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from bstar.errors import BinaryStarError, PeerNumberOutOfRange, PeerStateError
from bstar.fsm import BinaryStarFSM, Conflict, Outcome, Rank, State
from bstar.hooks import RankSource, SocketSetup, StateCallback, VoteHandler
from bstar.link import LINK_MAX_MESSAGE, PairLink, check_link_arguments
from bstar.report import (
    AFTER_EXPIRY,
    BinaryStarCounters,
    IoCounts,
    RateLimitedLog,
    behind_refusal,
    connection_lost,
    describe_rank,
    describe_start,
    rank_verdict,
)
from bstar.wire import check_wire_rank, decode_state, encode_state

__all__ = [
    "LINK_MAX_MESSAGE",
    "BinaryStar",
    "BinaryStarCounters",
    "RankSource",
    "SocketSetup",
    "StateCallback",
    "VoteHandler",
]

log = logging.getLogger(__name__)

#: Bad input from the network is logged at most once per this many seconds.
_LOG_INTERVAL = 10.0

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
    ``behind_peer`` (a durable server whose data was last written while it
    followed the peer) refuses votes that would make it active before the peer
    has been heard, however long that takes (:mod:`bstar.fsm`).

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
        behind_peer: bool = False,
        secure_socket: SocketSetup | None = None,
    ) -> None:
        check_link_arguments(ctx, loop, local_endpoint, peer_endpoint, fast_failover)
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
            behind_peer=behind_peer,
        )
        # Whether the refusal of votes while behind the peer was logged.
        self._said_behind = False
        self._on_active: list[StateCallback] = []
        self._on_passive: list[StateCallback] = []
        self._on_split_brain: list[StateCallback] = []
        self._voters: list[ZMQStream] = []
        self._link: PairLink | None = None
        self._timer: object | None = None
        self._next_tick = 0.0
        self._started = False
        self._stopped = False
        self._io = IoCounts()
        self._bad_input_log = RateLimitedLog(log, _LOG_INTERVAL, clock)
        self._rank_error_log = RateLimitedLog(log, _LOG_INTERVAL, clock)
        self._handler_error_log = RateLimitedLog(log, _LOG_INTERVAL, clock)

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
    def peer_announced_epoch(self) -> int:
        """The epoch in the peer's last state message (see the state machine's)."""
        return self._fsm.peer_announced_epoch

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
        link = self._link
        return self._io.snapshot(self._fsm.counters, *(link.counts() if link else (0, 0)))

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
        if not outcome.accepted and self._fsm.waits_for_peer and not self._said_behind:
            self._said_behind = True
            log.warning("%s", behind_refusal(self._fsm.state, self._fsm.rank))
        return outcome.accepted

    def set_behind_peer(self, behind: bool) -> None:
        """Our data may be older than what the peer confirmed (a passive that
        has not caught up yet): votes that would make us active are refused
        until this is cleared (:meth:`bstar.fsm.BinaryStarFSM.set_behind_peer`)."""
        if behind and not self._fsm.behind_peer:
            self._said_behind = False  # a new episode: say it again
        self._fsm.set_behind_peer(behind)

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
            behind_peer=old.behind_peer,
        )
        self._refresh_rank()
        link = PairLink(
            self._ctx,
            self._loop,
            self._local_endpoint,
            self._peer_endpoint,
            heartbeat=self.heartbeat,
            missed=self.missed,
            fast_failover=self._fast_failover,
            secure_socket=self._secure_socket,
            clock=self._clock,
        )
        self._link = link
        try:
            link.open(self._on_peer_message, self._on_peer_connected, self._on_peer_disconnected)
        except Exception:
            self.stop()
            raise
        rank = None if self._rank_source is None else self.rank
        log.info("%s", describe_start(
            primary=self.primary, local=self._local_endpoint, peer=self._peer_endpoint,
            heartbeat=self.heartbeat, missed=self.missed, fast_failover=self._fast_failover,
            epoch=self.epoch, rank=rank, start_wait=self.start_wait,
        ))  # fmt: skip
        self._publish()
        self._next_tick = _monotonic() + self.heartbeat
        self._timer = self._loop.call_later(self.heartbeat, self._on_tick)

    def announce(self) -> None:
        """Send our state (and rank) now instead of at the next tick: a
        passive answers each HUGZ of its active this way, so that an active
        handing over at its stop learns our sequence in a round trip."""
        if self.running:
            self._publish()

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
        if self._link is not None:  # kept: its counts outlive it
            self._link.close()
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
                AFTER_EXPIRY[self.state],
            )

    def _handler_failed(self, what: str) -> None:
        """Count and log (rate-limited, with the traceback) a handler that raised."""
        self._io.handler_errors += 1
        self._handler_error_log.log(logging.ERROR, "%s failed; going on", what, exc_info=True)

    def _on_peer_message(self, frames: list[bytes]) -> None:
        if not self.running:
            return
        try:
            self._peer_message(frames)
        except Exception:
            self._handler_failed("handling a peer state message")

    def _peer_message(self, frames: list[bytes]) -> None:
        self._io.received += 1
        try:
            report = decode_state(frames, self._peer_endpoint)
        except PeerStateError as exc:
            self._io.malformed += 1
            if isinstance(exc, PeerNumberOutOfRange):
                self._io.out_of_range += 1
            self._bad_input_log.log(logging.WARNING, "dropped state message: %s", exc)
            return
        self._refresh_rank()
        now = self._clock()
        was_silent = self._fsm.peer_state is None or not self._fsm.peer_alive(now)
        try:
            outcome = self._fsm.receive_peer_state(report.state, now, report.epoch, report.rank)
        except BinaryStarError as exc:
            self._io.rejected += 1
            self._bad_input_log.log(logging.ERROR, "rejected peer state: %s", exc)
            return
        if was_silent:
            ours = describe_rank(self.rank)
            log.info("peer at %s heard (%s, epoch %d, %s; ours: %s)", self._peer_endpoint,
                     report.state.name, report.epoch, describe_rank(report.rank), ours)
        self._react(outcome)

    def _on_peer_connected(self) -> None:
        """The link's monitor: connected to the peer's publisher (fast failover)."""
        if self.running:
            self._io.connects += 1
            self._fsm.peer_connected(self._clock())
            log.debug("connected to the peer at %s", self._peer_endpoint)

    def _on_peer_disconnected(self) -> None:
        """The link's monitor: our connection to the peer's publisher closed."""
        if not self.running:
            return
        self._io.disconnects += 1
        # What the peer sent before its connection closed is already queued on the
        # SUB socket (libzmq queues it before it reports the disconnect), but the
        # loop may not have handed it to us yet. Read it first, or a last
        # heartbeat processed after the loss would undo it.
        if self._link is not None:
            self._link.take_queued()
        if not self.running:  # a callback run by the flush stopped us
            return
        now = self._clock()
        self._fsm.peer_disconnected(now)
        if self._fsm.peer_alive(now):
            # Never heard and still within the start wait: the peer may be booting.
            left = self._fsm.peer_expiry - now
            log.info("%s", connection_lost(self._peer_endpoint, self.state, left))
            return
        self._fsm.check_expiry(now)  # counted now; the heartbeat must not log it again
        log.info("%s", connection_lost(self._peer_endpoint, self.state, None))

    def _react(self, outcome: Outcome) -> None:
        """Turn a decision of the state machine into log lines, messages and callbacks."""
        if outcome.conflict is Conflict.SPLIT_BRAIN:
            log.warning(
                "split brain: peer at %s is active too (our epoch %d, its epoch %s); %s: %s",
                self._peer_endpoint, outcome.epoch, outcome.peer_epoch,
                "we step down" if outcome.became_passive else "we keep serving", outcome.why,
            )  # fmt: skip
            self._fire(self._on_split_brain, "split-brain")
        elif outcome.conflict is Conflict.DUAL_PASSIVE:
            log.warning(
                "dual passive: peer at %s is passive too; %s", self._peer_endpoint, outcome.why
            )
        if not outcome.changed:
            return
        verdict = rank_verdict(outcome)
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
            self._io.callback_errors += 1
            self._rank_error_log.log(
                logging.ERROR,
                "rank callback %r failed; keeping %s",
                self._rank_source,
                describe_rank(self.rank),
                exc_info=True,
            )

    def _publish(self) -> None:
        link = self._link
        if link is None:
            return
        self._refresh_rank()
        rank = None if self._rank_source is None else self.rank
        if link.publish(encode_state(self.state, self.epoch, rank)):
            self._io.sent += 1

    def _fire(self, callbacks: list[StateCallback], what: str) -> None:
        for callback in list(callbacks):
            self._call(callback, what)

    def _call(self, callback: Callable[..., object], what: str, *args: object) -> None:
        """Run application code; its failure is logged, never allowed to stop the loop."""
        try:
            callback(*args)
        except Exception:
            self._io.callback_errors += 1
            log.exception("%s callback %r failed", what, callback)
