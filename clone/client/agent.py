"""The client agent's I/O loop: sockets in, state machine, sockets out.

It runs in the thread the frontend (:mod:`clone.client.frontend`) starts, owns every
network socket of one client, and polls them together with the command pipe from
the frontend.  Every socket that receives from a server is read with
:func:`clone.wire.frames.recv_frames` and capped with
:func:`~clone.wire.frames.cap_message_size`, so a broken or hostile server can
neither make us allocate without limit nor stop the loop: an oversized frame
costs it its connection (libzmq drops it before allocating), an overlong message
is cut short and then rejected by the codec.  Updates are decoded with
:mod:`clone.wire.codec`; snapshot replies go to the state machine raw, thousands
per event, since a sync is where the time goes (it takes KVSYNCs with
:func:`clone.wire.codec.fast_kvsync_entry`, exactly as strict as the codec).
:class:`~clone.client.fsm.AgentFSM` decides; this module only carries out the
actions.  A plain ``zmq.Poller`` loop is enough: the agent has a handful
of sockets and one timer (the state machine's next deadline).

Sockets per server (base port P): a SUB on P+1 subscribed to everything, opened
at connect time so that it is already subscribed when we ask for a snapshot (and
so that sequence holes can be seen even with subtrees: see docs/client.md), a
DEALER on P opened afresh for every snapshot request, and a *call* DEALER on P,
opened at connect time and kept, for CALL?s (compare-and-set, leases:
:mod:`clone.client.calls`), whose REPLYs come back on it.  It is
``ZMQ_IMMEDIATE``: a call for a server we are not connected to is not queued
for a later connection (the state machine resends it where it should go).  One
PUB is connected to every server's collector (P+2), so both servers of a pair
see every update.

With CURVE (``Clone(curve_secret=..., server_key=...)``) every socket that
talks to a server, SUB, DEALERs and PUB alike, is made a CURVE client with
:func:`clone.security.configure_client_socket` before it connects; a server
that refuses our key at the handshake is logged (rate-limited) from the socket
monitor, as nothing else would ever say so.  Control messages on a SUB
(:mod:`clone.wire.control`: view heartbeats, refusal notices) go to the state
machine like updates, and never to the application's map.

Each SUB also has a zmq socket monitor (a PAIR on an inproc endpoint, polled with the rest)
reporting ``EVENT_DISCONNECTED``: a server process that dies has its connections closed by
its kernel at once, and the state machine fails over on that instead of waiting for
``server_timeout`` of silence.  A monitor lives as long as its SUB (one per server, never
re-created on failover): its inproc address is derived from the SUB's descriptor, and
binding it again right after a close could race with libzmq's teardown.

The pipe protocol (commands from the frontend, replies, events) is :mod:`clone.client.verbs`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from clone.argtypes import split_endpoint
from clone.client.agentcommands import Commands
from clone.client.fsm import (
    Action,
    AgentFSM,
    CallReplied,
    Changed,
    Confirmed,
    LeaseGone,
    LeaseKept,
    Malformed,
    Refused,
    RequestSnapshot,
    SendCall,
    SendUpdate,
    SplitConflicted,
    StateChanged,
)
from clone.client.verbs import (
    CALL,
    CHANGE,
    CONFIRMED,
    CONFLICT,
    ERROR,
    FAILED,
    LEASEKEPT,
    LEASELOST,
    OK,
    REFUSED,
    REPLY,
    RESYNC_MARK,
    SET,
    STARTED,
    STATE,
    STOPPED,
)
from clone.errors import ProtocolError
from clone.ratelimit import Throttle
from clone.security import KeyPair, configure_client_socket
from clone.wire.batch import announced_entries, is_kvbatch
from clone.wire.calls import decode_reply, encode_reply
from clone.wire.codec import KVMsg, decode_update, encode_icanhaz, encode_kv
from clone.wire.control import decode_control, is_control
from clone.wire.delta import since_metadata
from clone.wire.frames import (
    MAX_FRAME_BYTES,
    MAX_SYNC_FRAME_BYTES,
    cap_message_size,
    recv_frames,
    recv_monitor_event,
)
from clone.wire.protocol import (
    BATCH_METADATA,
    COLLECTOR_OFFSET,
    PUBLISHER_OFFSET,
    SNAPSHOT_OFFSET,
)
from clone.wire.requester import new_requester_id, requester_metadata

__all__ = ["Agent", "split_endpoint", "SUBSCRIBER_HWM"]

log = logging.getLogger(__name__)

# A large snapshot's worth of updates may pile up while we sync; the default
# 1000 would drop them and force a resync loop.
SUBSCRIBER_HWM = 100_000
# Messages taken from one socket before looking at the others again.
_BATCH = 512
# Snapshot replies per state machine event (and per turn of the loop): large, as
# one event per entry was a third of a sync's time; ~20 ms of work.
_SNAPSHOT_BATCH = 4096
# The same bound in entries for KVBATCHes (clone.wire.batch), which cost about a
# quarter of a KVSYNC's time per entry: ~20 ms of work too.
_SNAPSHOT_BATCH_ENTRIES = 4 * _SNAPSHOT_BATCH
# Upper bound on one poll, so a wrong deadline can never freeze the loop.
_MAX_POLL = 1.0
#: A tick this long after our own work ended means we were frozen (AgentConfig.freeze_gap).
FREEZE_GAP = _MAX_POLL + 0.5
# Socket monitor events we act on: a lost connection, and a handshake the
# server refused (CURVE: our key is not admitted, or one side is not CURVE).
_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused our key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed the handshake",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed the handshake",
}
_MONITORED = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

# Calls queued on one call DEALER at most (the state machine resends).
_CALL_HWM = 1000


@dataclass(slots=True)
class _Server:
    endpoint: str
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes] | None = None
    dealer: zmq.Socket[bytes] | None = None
    caller: zmq.Socket[bytes] | None = None  # CALL? out, REPLY in
    # Whether our PUB is connected to its collector: only while its SUB is.
    collecting: bool = True

    def address(self, offset: int) -> str:
        host, base = split_endpoint(self.endpoint)
        return f"{host}:{base + offset}"


class Agent:
    """One client's sockets and loop; :meth:`run` is the thread's target."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        commands: zmq.Socket[bytes],
        events: zmq.Socket[bytes],
        fsm: AgentFSM,
        *,
        clock: Callable[[], float] = time.monotonic,
        curve: tuple[KeyPair, bytes] | None = None,
    ) -> None:
        """``curve``: our key pair and the servers' public key (both servers of
        a pair share one certificate), or None for plain connections."""
        self._ctx = ctx
        self._curve = curve
        self._commands = commands
        self._events = events
        self._fsm = fsm
        self._clock = clock
        self._servers: list[_Server] = []
        self._poller = zmq.Poller()
        self._pub: zmq.Socket[bytes] | None = None
        self._pub_monitor: zmq.Socket[bytes] | None = None
        self._running = False
        self._bad = Throttle(log, clock)
        self._answers = Commands(fsm, clock, self._execute, self._add_server, self._stop)
        # Named on every snapshot DEALER: a re-ask replaces our older request.
        self._requester = new_requester_id()
        fsm.emit_changes = False  # until somebody watches

    # ------------------------------------------------------------------
    # Loop

    def run(self) -> None:
        """Serve until TERMINATE; always close our sockets and say STOPPED."""
        try:
            self._pub = self._socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, SUBSCRIBER_HWM)
            # A collector connection lost: stop queueing for it (_stop_collecting).
            self._pub_monitor = self._pub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._pub_monitor.setsockopt(zmq.LINGER, 0)
            self._poller.register(self._pub_monitor, zmq.POLLIN)
            self._poller.register(self._commands, zmq.POLLIN)
            self._running = True
            self._events.send(STARTED)
            self._loop()
        except Exception:
            log.exception("clone agent stopped by an unexpected error")
        finally:
            self._close_sockets()
            try:
                self._events.send(STOPPED, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._commands.close(linger=0)
            self._events.close(linger=0)

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        """A socket to talk to servers: linger 0, and CURVE if configured
        (before any connect, as libzmq requires)."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            configure_client_socket(sock, *self._curve)
        return sock

    def _loop(self) -> None:
        while self._running:
            idle_at, cpu_at = self._clock(), time.process_time()  # our work ended
            deadline = self._fsm.next_deadline()
            wait = _MAX_POLL if deadline is None else deadline - self._clock()
            timeout_ms = max(0, min(int(wait * 1000) + 1, int(_MAX_POLL * 1000)))
            ready = dict(self._poller.poll(timeout_ms))
            # Time is judged as of the poll: a long command (a large ITEMS) must
            # not make a server look silent whose HUGZ are waiting to be read.
            now = self._clock()
            self._fsm.idle_from(min(now, idle_at + time.process_time() - cpu_at))
            if self._commands in ready:
                self._drain_commands()
            if self._pub_monitor is not None and self._pub_monitor in ready:
                self._drain_pub_monitor()
            for index, server in enumerate(list(self._servers)):
                if server.sub in ready:
                    self._drain_updates(index, server)
                if server.dealer is not None and server.dealer in ready:
                    self._drain_snapshot(index, server)
                if server.monitor is not None and server.monitor in ready:
                    self._drain_monitor(index, server)
                if server.caller is not None and server.caller in ready:
                    self._drain_replies(index, server)
            self._execute(self._fsm.tick(now))

    def _drain_commands(self) -> None:
        for _ in range(_BATCH):
            if not self._running:
                return
            try:
                frames = self._commands.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._command(frames)

    def _drain_updates(self, index: int, server: _Server, limit: int = _BATCH) -> None:
        sub = server.sub
        for _ in range(limit):
            try:
                frames = recv_frames(sub)
            except zmq.Again:
                return
            control = is_control(frames)
            try:
                msg = decode_control(frames) if control else decode_update(frames)
            except ProtocolError as exc:
                self._malformed(index, "control message" if control else "update", exc)
                continue
            if not server.collecting:
                self._collect_again(index, server)  # heard again: write to it again
            # The raw frames too: the last applied update's name a catch-up.
            raw = None if control else frames
            self._execute(self._fsm.update(index, msg, self._clock(), raw))

    def _drain_snapshot(self, index: int, server: _Server) -> None:
        """Take up to a batch of replies and hand them to the state machine raw."""
        dealer = server.dealer
        assert dealer is not None
        batch: list[list[bytes]] = []
        append = batch.append
        entries = 0
        for _ in range(_SNAPSHOT_BATCH):
            try:
                frames = recv_frames(dealer)
            except zmq.Again:
                break
            append(frames)
            if is_kvbatch(frames):  # or garbage that claims to be one: the FSM drops it
                entries += announced_entries(frames)
                if entries >= _SNAPSHOT_BATCH_ENTRIES:
                    break
        if batch:
            self._execute(self._fsm.snapshot_batch(index, batch, self._clock()))

    def _drain_replies(self, index: int, server: _Server) -> None:
        caller = server.caller
        assert caller is not None
        for _ in range(_BATCH):
            try:
                frames = recv_frames(caller)
            except zmq.Again:
                return
            try:
                reply = decode_reply(frames)
            except ProtocolError as exc:
                self._malformed(index, "reply", exc)
                continue
            self._execute(self._fsm.replied(index, reply, self._clock()))

    def _drain_monitor(self, index: int, server: _Server) -> None:
        monitor = server.monitor
        assert monitor is not None
        for _ in range(_BATCH):
            try:
                event = recv_monitor_event(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (ValueError, RuntimeError) as exc:  # a libzmq we do not understand
                self._bad.log(
                    "monitor",
                    logging.WARNING,
                    "dropped a socket monitor event for %s: %s",
                    server.endpoint,
                    exc,
                )
                continue
            assert isinstance(event, dict)
            failed = _HANDSHAKE_FAILED.get(event["event"])
            if failed is not None:
                self._bad.log(
                    "handshake",
                    logging.WARNING,
                    "server %s %s (event value %s): %s",
                    server.endpoint,
                    failed,
                    event.get("value"),
                    "check --curve-secret and --server-key, and that the server's clients "
                    "directory holds our public key"
                    if self._curve is not None
                    else "the server may require CURVE: pass --curve-secret and --server-key",
                )
                continue
            if event["event"] == zmq.EVENT_CONNECTED:
                self._collect_again(index, server)
                continue
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            # libzmq queues what the server sent before it reports the loss;
            # take it first, or it would arrive as a foreign server's.
            self._drain_updates(index, server, SUBSCRIBER_HWM)
            log.debug("connection to %s lost (%s)", server.endpoint, event["endpoint"])
            self._stop_collecting(server)
            self._execute(self._fsm.server_disconnected(index, self._clock()))

    def _drain_pub_monitor(self) -> None:
        """Our PUB lost a collector: stop queueing writes for that server until
        we hear it again (a reset link; a silent one is seen by its SUB)."""
        monitor = self._pub_monitor
        assert monitor is not None
        while True:
            try:
                event = recv_monitor_event(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.debug("PUB monitor: %s", exc)
                return
            raw = event.get("endpoint")
            lost = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            for server in self._servers:
                if server.address(COLLECTOR_OFFSET) == lost:
                    self._stop_collecting(server)

    def _stop_collecting(self, server: _Server) -> None:
        """We lost a server's publisher: stop queueing our writes for its
        collector.  Queued, they would all arrive when the link comes back,
        and behind a partition that server may have been elected meanwhile:
        applied there as fresh writes, our old copies would undo what it
        confirmed since (docs/failover.md, "Late copies").  A confirmed write
        is resent until it is seen; the current server's copy confirms it."""
        if server.collecting and self._pub is not None:
            server.collecting = False
            self._pub.disconnect(server.address(COLLECTOR_OFFSET))
            log.info("lost %s: not queueing writes for it until we hear it again", server.endpoint)

    def _collect_again(self, index: int, server: _Server) -> None:
        """Its publisher is back: our writes go to its collector again, after
        a moment to hear whether it is active (a split brain healing: the
        state machine holds our writes while two servers are)."""
        if server.collecting or self._pub is None:
            return
        server.collecting = True
        self._pub.connect(server.address(COLLECTOR_OFFSET))
        log.info("heard %s again: writing to it again", server.endpoint)
        self._execute(self._fsm.server_reconnected(index, self._clock()))

    def _malformed(self, index: int, what: str, exc: ProtocolError) -> None:
        self._fsm.protocol_error(index)
        self._bad.log(
            what,
            logging.WARNING,
            "dropped malformed %s from %s: %s",
            what,
            self._servers[index].endpoint,
            exc,
        )

    # ------------------------------------------------------------------
    # Actions

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendUpdate):
                assert self._pub is not None
                frames = action.frames if action.frames is not None else encode_kv(action.msg)
                self._pub.send_multipart(frames)
            elif isinstance(action, Changed):
                entry = action.entry or KVMsg(action.key)
                mark = [RESYNC_MARK] if action.resync else []
                self._events.send_multipart([CHANGE, *encode_kv(entry), *mark])
            elif isinstance(action, SendCall):
                self._send_call(action)
            elif isinstance(action, CallReplied):
                reply = action.reply
                self._events.send_multipart([REPLY, reply.uuid, *encode_reply(reply)])
            elif isinstance(action, LeaseKept):
                self._events.send_multipart(
                    [LEASEKEPT, action.lease_id.encode(), repr(action.valid_until).encode()]
                )
            elif isinstance(action, LeaseGone):
                self._events.send_multipart(
                    [LEASELOST, action.lease_id.encode(), action.why.encode("utf-8", "replace")]
                )
            elif isinstance(action, Confirmed):
                self._events.send_multipart(
                    [CONFIRMED, action.uuid, action.sequence.to_bytes(8, "big")]
                )
            elif isinstance(action, Refused):
                self._events.send_multipart(
                    [REFUSED, action.uuid, action.reason.encode(), action.key.encode()]
                )
            elif isinstance(action, SplitConflicted):
                self._events.send_multipart([CONFLICT, action.uuid, action.key.encode()])
            elif isinstance(action, Malformed):
                self._bad.log(
                    action.what,
                    logging.WARNING,
                    "dropped malformed %s from %s: %s",
                    action.what,
                    self._servers[action.server].endpoint,
                    action.error,
                )
            elif isinstance(action, RequestSnapshot):
                self._request_snapshot(action)
            elif isinstance(action, StateChanged):
                endpoint = "" if action.server is None else self._servers[action.server].endpoint
                log.debug("agent is %s on %s", action.state.value, endpoint or "-")
                self._events.send_multipart([STATE, action.state.value.encode(), endpoint.encode()])

    def _send_call(self, action: SendCall) -> None:
        caller = self._servers[action.server].caller
        assert caller is not None
        try:
            caller.send_multipart(action.frames, zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (ZMQ_IMMEDIATE) or its queue is full: the state
            # machine sends it again, maybe elsewhere.
            log.debug("call to %s not sent now", self._servers[action.server].endpoint)

    def _request_snapshot(self, action: RequestSnapshot) -> None:
        server = self._servers[action.server]
        if server.dealer is not None:
            self._poller.unregister(server.dealer)
            server.dealer.close(linger=0)
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, SUBSCRIBER_HWM)
        # A KVBATCH frame may be far larger than a value (see clone.wire.frames).
        cap_message_size(dealer, MAX_SYNC_FRAME_BYTES)
        try:
            # Our servers then pack the snapshot into KVBATCHes; the Guide's
            # ignore the property and send KVSYNCs, which we take as well.
            dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
            dealer.setsockopt(zmq.METADATA, requester_metadata(self._requester))
            if action.since is not None:
                # Holding the map at a sequence: only what followed, if the
                # server still has it (KVDELTA); else it sends a snapshot.
                dealer.setsockopt(zmq.METADATA, since_metadata(*action.since))
        except zmq.ZMQError:  # a libzmq older than 4.3
            log.debug("this libzmq cannot send ZMTP metadata; asking without KVBATCH")
        dealer.connect(server.address(SNAPSHOT_OFFSET))
        server.dealer = dealer
        self._poller.register(dealer, zmq.POLLIN)
        for subtree in action.subtrees:
            dealer.send_multipart(encode_icanhaz(subtree))
        log.debug(
            "asked %s for a %s of %s",
            server.endpoint,
            "snapshot" if action.since is None else f"catch-up from {action.since[0]}",
            action.subtrees,
        )

    def _add_server(self, endpoint: str) -> None:
        split_endpoint(endpoint)
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, SUBSCRIBER_HWM)
        cap_message_size(sub, MAX_FRAME_BYTES)
        # Everything, not just our subtrees: sequences are global, so only a
        # complete stream lets us see holes.  We filter by subtree ourselves.
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        server = _Server(endpoint, sub)
        # Before connect(), so no event can be missed.
        monitor = sub.get_monitor_socket(_MONITORED)
        monitor.setsockopt(zmq.LINGER, 0)
        server.monitor = monitor
        self._poller.register(monitor, zmq.POLLIN)
        sub.connect(server.address(PUBLISHER_OFFSET))
        caller = self._socket(zmq.DEALER)
        caller.setsockopt(zmq.IMMEDIATE, 1)
        caller.setsockopt(zmq.SNDHWM, _CALL_HWM)
        cap_message_size(caller, MAX_FRAME_BYTES)
        caller.connect(server.address(SNAPSHOT_OFFSET))
        server.caller = caller
        self._poller.register(caller, zmq.POLLIN)
        assert self._pub is not None
        self._pub.connect(server.address(COLLECTOR_OFFSET))
        self._servers.append(server)
        self._poller.register(sub, zmq.POLLIN)
        self._execute(self._fsm.connect(endpoint, self._clock()))

    def _close_sockets(self) -> None:
        for server in self._servers:
            if server.monitor is not None:
                # Detach first so libzmq stops writing to it, then close our end.
                try:
                    server.sub.disable_monitor()
                except zmq.ZMQError as exc:
                    log.debug("disable_monitor on %s failed: %s", server.endpoint, exc)
                server.monitor.close(linger=0)
                server.monitor = None
            server.sub.close(linger=0)
            if server.dealer is not None:
                server.dealer.close(linger=0)
            if server.caller is not None:
                server.caller.close(linger=0)
        self._servers.clear()
        if self._pub_monitor is not None:
            try:
                if self._pub is not None:
                    self._pub.disable_monitor()
            except zmq.ZMQError as exc:
                log.debug("disable_monitor on the PUB failed: %s", exc)
            self._pub_monitor.close(linger=0)
            self._pub_monitor = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None

    # ------------------------------------------------------------------
    # Commands from the frontend

    def _stop(self) -> None:
        """TERMINATE: leave the loop after this turn."""
        self._running = False

    def _command(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            head = frames[0][:32] if frames else b""
            self._commands.send_multipart([ERROR, b"", b"malformed command " + head])
            return
        verb, rid, args = frames[0], frames[1], frames[2:]
        try:
            reply = self._answers.answer(verb, args)
        except (ValueError, TypeError, IndexError, ProtocolError) as exc:
            text = str(exc).encode("utf-8", "replace")
            if rid:
                self._commands.send_multipart([ERROR, rid, text])
            elif verb in (SET, CALL) and len(args) > 3:
                # Both carry the uuid there: SET's KVSET and CALL's CALL? alike.
                self._events.send_multipart([FAILED, args[3], text])
            else:
                log.warning("one-way %r command failed: %s", verb[:32], exc)
            return
        if rid:
            self._commands.send_multipart([OK, rid, *reply])
