"""A relay: follow a pair like a client, serve its copy like a server.

How this works: a relay (``clone-server --relay --upstream A,B``) has no
Binary Star.  Its core is in the RELAY role, which follows another server
exactly as a passive server follows the active one (:mod:`.following`: a SUB
on the upstream's publisher, a snapshot or digest catch-up on a fresh DEALER),
with two differences:

* every update it applies (a KVPUB, a catch-up entry, a buffered update
  replayed after a snapshot) is *published* as received, with the pair's
  sequence, and its snapshot port serves its copy at any time; its own HUGZ
  carry its sequence and ``stale=1`` while it has lost the pair;
* it chooses its upstream like a client: it follows one server at a time and,
  when that one is silent for the missed heartbeats (once synced) or does not
  answer a snapshot request within the sync timeout (a passive server of the
  pair never does, unless the request wins it the vote), it moves on to the
  next one and resyncs from it, by a catch-up from its sequence where the
  new server's history allows, else by a full snapshot.

Client writes (KVSETs on its collector) are forwarded as they are to every
upstream collector, from one PUB, the way a client sends them: the pair
deduplicates them by uuid, and the write's KVPUB comes back through the
relay's stream, which is what confirms it to the writer.  A write the relay
cannot forward is refused, never dropped in silence nor held: while the relay
is stale (it has lost the pair) it forwards nothing and answers each KVSET
with a refusal notice, reason ``stale``; a KVSET its full queue to the pair
cannot take gets one with reason ``overloaded``.  The forwarding PUB queues
only for collectors it is connected to (``ZMQ_IMMEDIATE``): libzmq would
otherwise keep what it sent to a dead server and deliver it when that server
returns, applying writes whose writers gave up long before.  A plain relay
knows no names: it addresses its notices to ``*``, every subscriber gets
them, and only the writer, who holds the uuid, acts on one.

Client calls (CALL? on its snapshot port) are forwarded on a DEALER to the
snapshot port of the upstream it synced from (a new one when it moves to
another upstream); each REPLY goes back to the caller whose uuid it answers
(:class:`~clone.server.inflight.InFlight`), without blocking.  A relay that
has not synced, or is stale, answers ``not-active`` itself.

Over CURVE (:mod:`.security`) the two sides are independent: its clients
connect with the relay's own server key and are judged by its own clients
directory and ACL (a write or call they may not make is refused here, with the
pair's refusal notice or REPLY); upstream it is a client with its own key,
which the pair admits and judges by the pair's ACL like any client's.  A
refusal notice the pair sends the relay for a forwarded write is passed on to
the client that wrote it.  A handshake its upstream refuses is logged
(rate-limited) from a monitor on the upstream SUB; the relay stays stale.

The decisions (when an upstream counts as lost, whether the relay is stale,
why a write is refused) are pure functions in :mod:`.relayrules`, and the
ACL's judgement of a call is :func:`clone.server.access.call_refusal`.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream
from zmq.utils.monitor import parse_monitor_message

from clone.errors import ProtocolError
from clone.security import PEER_USER, fingerprint
from clone.server.access import call_refusal
from clone.server.base import ServerBase, log, peer_endpoint, who
from clone.server.core import SyncState
from clone.server.relayrules import forward_refusal, relay_stale, upstream_lost
from clone.server.sending import Burst, Sent, send
from clone.wire.calls import (
    CALLER_PROPERTY,
    REPLY,
    Reply,
    call_uuid,
)
from clone.wire.codec import Hugz, decode_properties, decode_update, encode_hugz, encode_properties
from clone.wire.control import Refusal, ViewHeartbeat, decode_control, encode_refusal
from clone.wire.frames import recv_frames, recv_frames_and_first
from clone.wire.protocol import COLLECTOR_OFFSET, HUGZ, REFUSAL_REASONS, SNAPSHOT_OFFSET

__all__ = ["ANY_WRITER", "RelayMixin"]

#: The name a plain relay addresses its refusal notices to: it knows no names.
ANY_WRITER = "*"


def _collector(host_port: str) -> str:
    return peer_endpoint(host_port, COLLECTOR_OFFSET)


# Handshake failures on the upstream SUB worth an operator's attention.  The
# value of an AUTH failure is the ZAP status code (400: key not admitted).
# REPLYs taken after one forwarded call at most (see _take_call_replies).
_REPLIES_PER_SEND = 100
_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused our key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed the handshake",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed the handshake",
}
_MONITORED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class RelayMixin(ServerBase):
    """Follow an upstream with failover; forward writes; heartbeat with staleness."""

    def _start_relay(self) -> None:
        cfg = self.config
        pub = self._socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, cfg.collector_hwm)
        # Queue only for a collector that is there, and say when a queue is
        # full rather than drop: either way the writer is told (module doc).
        pub.setsockopt(zmq.IMMEDIATE, 1)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        for host_port in cfg.upstream:
            pub.connect(_collector(host_port))
        self._upstream_pub = pub
        self._upstream_heard = self._clock()
        log.info("relay of %s: following %s", ", ".join(cfg.upstream), self._followed)
        self._sync_started = self._clock()
        self._follow_upstream()

    def _follow_upstream(self) -> None:
        """Follow ``_followed``, watching its SUB's handshakes."""
        fresh = self._peer_sub is None
        self._follow()
        sub = self._peer_sub
        if fresh and sub is not None:
            self._watch_upstream(sub.socket)

    def _close_relay(self) -> None:
        self._close_upstream_monitor()
        self._close_call_dealer()
        self._relay_calls.clear()
        self._relay_writers.clear()
        pub, self._upstream_pub = self._upstream_pub, None
        if pub is not None and not pub.closed:
            pub.close(linger=0)

    # -- why the upstream does not answer ---------------------------------------

    def _watch_upstream(self, sock: zmq.Socket[Any]) -> None:
        """A socket monitor on the upstream SUB: a refused key is otherwise
        only silence.  Diagnosis only: without a monitor the relay works."""
        self._close_upstream_monitor()
        try:
            monitor = sock.get_monitor_socket(_MONITORED)
        except zmq.ZMQError as exc:
            log.debug("no socket monitor on the upstream SUB: %s", exc)
            return
        monitor.setsockopt(zmq.LINGER, 0)
        self._upstream_monitor = self._stream(monitor, self._on_upstream_monitor)

    def _close_upstream_monitor(self) -> None:
        stream, self._upstream_monitor = self._upstream_monitor, None
        if stream is None:
            return
        sub = self._peer_sub
        if sub is not None and not sub.closed():
            try:
                sub.socket.disable_monitor()
            except zmq.ZMQError:
                pass
        self._forget(stream)

    def _on_upstream_monitor(self, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)
        except (ValueError, RuntimeError):  # a libzmq we do not understand
            return
        failed = _HANDSHAKE_FAILED.get(int(event["event"]))
        if failed is None:
            return
        self.counters["upstream_handshake_failures"] += 1
        keypair = self._upstream_keypair
        if keypair is None:
            hint = (
                "the upstream may require CURVE: pass --upstream-curve-secret and"
                " --upstream-server-key"
            )
        else:
            hint = (
                f"our key {fingerprint(keypair.public)} (--upstream-curve-secret"
                f" {self.config.upstream_curve_secret}) must be in the upstream's clients"
                " directory (then SIGHUP it), and --upstream-server-key must be its"
                " public certificate"
            )
        self._throttle.log(
            "upstream_handshake",
            logging.WARNING,
            "upstream %s %s (event value %s); we stay stale: %s",
            self._followed,
            failed,
            event.get("value"),
            hint,
        )

    # -- the upstream ----------------------------------------------------------

    def _heard_upstream(self, frames: list[bytes]) -> None:
        """Any message from the followed server's publisher: it is alive."""
        self._upstream_heard = self._clock()
        if frames and frames[0] == HUGZ:
            try:
                hugz = decode_update(frames)
            except ProtocolError:
                return  # the core counts and logs it
            if isinstance(hugz, Hugz):
                if hugz.heartbeat:
                    self._upstream_heartbeat = hugz.heartbeat
                stale = hugz.stale
                if stale != self._upstream_stale:
                    self._upstream_stale = stale
                    log.warning(
                        "upstream %s says it is %s", self._followed, "stale" if stale else "fresh"
                    )

    def _relay_synced(self) -> None:
        if not self._relay_synced_once:
            self._relay_synced_once = True
        self._upstream_heard = self._clock()
        if self.core.last_sync == "full" and self._view_counts:
            # The copy was replaced without publishing the difference.  Plain
            # clients see our sequence jump; restricted ones only compare
            # counts, so each view's moves on by one: its clients resync.
            for vid in self._view_counts:
                self._view_counts[vid] += 1
        self._open_call_dealer()

    def _check_upstream(self) -> None:
        """Housekeeping: forget old requests; give up a silent (or
        unanswering) upstream for the next."""
        cfg = self.config
        now = self._clock()
        self._relay_calls.expire(now)
        self._relay_writers.expire(now)
        if not upstream_lost(
            now=now,
            syncing=self.core.sync_state is SyncState.SYNCING,
            sync_started=self._sync_progress,
            sync_timeout=cfg.effective_sync_timeout,
            heard=self._upstream_heard,
            heartbeat=max(self._upstream_heartbeat, cfg.heartbeat),
            missed=cfg.ha_missed,
        ):
            return
        was = self._followed
        self._upstream_index = (self._upstream_index + 1) % len(cfg.upstream)
        self._followed = cfg.upstream[self._upstream_index]
        self._upstream_stale = False
        self.counters["upstream_switches"] += 1
        self._throttle.log(
            "upstream_switch",
            logging.WARNING,
            "upstream %s %s; following %s (serving our copy at sequence %d meanwhile)",
            was,
            "did not answer our snapshot request"
            if self.core.sync_state is SyncState.SYNCING
            else "is silent",
            self._followed,
            self.core.store.sequence,
        )
        self._close_upstream_monitor()
        self._close_call_dealer()
        self._close_peer()
        # _upstream_heard stays: until the new upstream speaks, we are stale.
        self._sync_started = now
        self._follow_upstream()

    def _relay_stale(self) -> bool:
        cfg = self.config
        return relay_stale(
            now=self._clock(),
            synced_once=self._relay_synced_once,
            heard=self._upstream_heard,
            heartbeat=max(self._upstream_heartbeat, cfg.heartbeat),
            missed=cfg.ha_missed,
            upstream_stale=self._upstream_stale,
        )

    def _relay_hugz(self) -> list[bytes]:
        return encode_hugz(self.core.store.sequence, self._heartbeat_ms, stale=self._relay_stale())

    def _on_upstream_control(self, frames: list[bytes]) -> None:
        """A control message from the upstream's CURVE publisher, to our key.

        A refusal notice answers a write we forwarded: it goes on to the
        client that wrote it.  A view heartbeat means the upstream gives our
        key restricted read rights: a relay's copy must be whole, so say so.
        """
        try:
            msg = decode_control(frames)
        except ProtocolError as exc:
            self._throttle.log(
                "upstream_control", logging.WARNING, "dropped a control message: %s", exc
            )
            return
        if isinstance(msg, Refusal):
            self.counters["kvset_refused_upstream"] += 1
            writer = self._relay_writers.take(msg.uuid, self._clock())
            self._throttle.log(
                "kvset_refused_upstream",
                logging.WARNING,
                "upstream %s refused a write we forwarded%s (%s)%s",
                self._followed,
                f" for {writer}" if writer else "",
                msg.reason,
                ": its ACL judges our key's write prefixes" if msg.reason == "acl" else "",
            )
            if msg.reason in REFUSAL_REASONS:
                if writer is not None:
                    self._refusal(writer, msg.uuid, msg.reason)
                elif self._keypair is None and msg.uuid:
                    # A plain relay knows no writers: on to all, as it came.
                    self.publisher.publish(encode_refusal(ANY_WRITER, msg.uuid, msg.reason))
        elif isinstance(msg, ViewHeartbeat):
            self._throttle.log(
                "upstream_view",
                logging.ERROR,
                "upstream %s gives our key restricted read rights (view %s): a relay"
                " needs read = [\"\"] in its ACL, or its copy has holes and it keeps"
                " resyncing",
                self._followed,
                msg.view,
            )

    # -- client calls ------------------------------------------------------------

    def _open_call_dealer(self) -> None:
        """A DEALER on the snapshot port of the upstream we synced from
        (kept while we follow it: calls are answered by the active server)."""
        followed = self._followed
        if self._call_dealer is not None and self._call_upstream == followed:
            return
        self._close_call_dealer()
        assert followed is not None
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, self.config.snapshot_hwm)
        dealer.connect(peer_endpoint(followed, SNAPSHOT_OFFSET))
        self._call_dealer = self._stream(dealer, self._on_call_reply)
        self._call_upstream = followed

    def _close_call_dealer(self) -> None:
        """Calls in flight on it get no reply; their callers retry (same uuid)."""
        stream, self._call_dealer = self._call_dealer, None
        self._call_upstream = None
        if stream is not None:
            self._forget(stream)

    def _forward_call(
        self, identity: bytes, frames: list[bytes], user: str | None = None, caller: str = ""
    ) -> None:
        """A client's CALL? (``frames`` from b"CALL?" on): to the upstream.

        ``user`` is the caller's name when we serve over CURVE: our ACL is
        checked first, as the pair checks it.  ``caller`` is the caller's
        principal (clone.server.ownership): over a CURVE upstream we forward it
        as ``caller=``, which the pair believes of a relay it trusts, so that
        the lease a client takes through us is that client's, not ours.  A
        call we cannot forward now is answered ``not-active`` (the caller
        retries) or dropped (it times out and retries); never held.
        """
        uuid = call_uuid(frames)
        if uuid is None:
            self._throttle.log(
                "call", logging.WARNING, "dropped a CALL? from %s: no uuid", who(identity)
            )
            return
        if self._keypair is not None:
            why = self._call_refusal(frames, user)
            if why is not None:
                self.counters["calls_forward_refused_acl"] += 1
                self._throttle.log(
                    "call_acl", logging.WARNING, "refused a call from %s: %s", user, why
                )
                self._send_reply(identity, Reply(uuid, "refused", reason="acl", detail=why))
                return
        if self._upstream_keypair is not None and caller:
            frames = self._with_caller(frames, user, caller)
        stream = self._call_dealer
        if stream is None or stream.closed() or self._relay_stale():
            # Stale but not yet moved on (up to a housekeeping turn): the
            # upstream is silent, a call sent there would only time out.
            unsynced = stream is None or stream.closed()
            self.counters["calls_forward_not_synced"] += 1
            self._send_reply(
                identity,
                Reply(
                    uuid,
                    "refused",
                    reason="not-active",
                    detail="relay has not synced with the pair"
                    if unsynced
                    else "relay has lost the pair",
                ),
            )
            return
        # Sent from the ROUTER's reader, not the DEALER stream's: the burst
        # looks at the replies our send may have hidden from it, on leaving,
        # so only once the caller is known (a reply read then is routed).
        with Burst(lambda: self._take_call_replies(stream)) as burst:
            if burst.send(stream.socket, frames) is not Sent.OK:
                self.counters["calls_forward_dropped"] += 1
                return
            self.counters["calls_forwarded"] += 1
            if self._relay_calls.add(uuid, identity, self._clock()):
                self._throttle.log(
                    "calls_in_flight",
                    logging.WARNING,
                    "%d calls in flight upstream: forgot the oldest (its caller retries)",
                    self._relay_calls.limit,
                )

    def _with_caller(self, frames: list[bytes], user: str | None, caller: str) -> list[bytes]:
        """The call with ``caller=`` saying who asked us; a ``caller=`` the
        client sent is replaced (a client cannot speak for another), but for
        one from a relay we trust ourselves (a chain of relays).  A call whose
        properties do not decode goes as it is: the pair says what is wrong."""
        if len(frames) != 6:
            return frames
        try:
            props = decode_properties(frames[4])
        except ProtocolError:
            return frames
        if user is not None and user in self.config.trusted_relays:
            if any(name == CALLER_PROPERTY for name, _ in props):
                return frames
        kept = tuple((n, v) for n, v in props if n != CALLER_PROPERTY)
        out = list(frames)
        out[4] = encode_properties((*kept, (CALLER_PROPERTY, caller)))
        return out

    def _call_refusal(self, frames: list[bytes], user: str | None) -> str | None:
        """Why our ACL refuses this call to ``user``, or None to forward it
        (:func:`clone.server.access.call_refusal`)."""
        return call_refusal(
            frames,
            user,
            write_all=self._write_all,
            admitted=self._admitted,
            rights_of=self._rights_of,
        )

    def _take_call_replies(self, stream: ZMQStream) -> None:
        """REPLYs our send on the call DEALER may have hidden from its stream.

        A send can consume the edge of the socket's file descriptor that
        announces an incoming message, and while that message sits unread
        libzmq signals no other: every later reply would wait with it (as
        the snapshot port's requests did, clone.server.serving)."""
        sock = stream.socket
        for _ in range(_REPLIES_PER_SEND):
            if sock is None or sock.closed or not sock.poll(0, zmq.POLLIN):
                return
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
            self._on_call_reply(frames)

    def _on_call_reply(self, frames: list[bytes]) -> None:
        """A REPLY from the upstream: to the caller of its uuid, at once or never."""
        # 4 frames, or 5 answering a lease-keepalives (clone.wire.calls).
        if len(frames) not in (4, 5) or frames[0] != REPLY or len(frames[1]) != 16:
            self._throttle.log(
                "call_reply",
                logging.WARNING,
                "dropped a malformed answer to a forwarded call from %s",
                self._call_upstream,
            )
            return
        identity = self._relay_calls.take(frames[1], self._clock())
        if identity is None:
            self.counters["call_replies_unmatched"] += 1  # its caller gave up long ago
            return
        sock = self._router
        if sock is None or sock.closed:
            return
        # Sent from the DEALER's callback, not the ROUTER stream's: look at
        # the requests our send may have hidden from it.
        if send(sock, [identity, *frames], backlog=self._take_router_backlog) is not Sent.OK:
            self.counters["call_replies_dropped"] += 1  # its pipe is full, or it went away
            return
        self.counters["call_replies_forwarded"] += 1

    # -- client writes -----------------------------------------------------------

    def _on_relay_collector(self, frames: list[bytes]) -> None:
        """KVSETs from our clients: forwarded as they are to the pair's
        collectors, or refused with a notice to everyone (we know no names)."""
        pub = self._upstream_pub
        sock = self._collector
        if pub is None or sock is None:
            return
        stale = self._relay_stale()
        for _ in range(self.config.collector_batch):
            self._forward_kvset(pub, frames, stale, None)
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return

    def _forward_kvset(
        self, pub: zmq.Socket[Any], frames: list[bytes], stale: bool, writer: str | None
    ) -> bool:
        """One KVSET to the pair's collectors, or refused (counted, logged
        rate-limited, its writer told); whether it was forwarded."""
        queued = False
        if not stale:
            # A PUB reads nothing: no backlog to look at.
            queued = send(pub, frames, backlog=None) is Sent.OK
        why = forward_refusal(stale=stale, queued=queued)
        if why is None:
            self.counters["kvset_forwarded"] += 1
            return True
        self.counters["kvset_refused_stale" if stale else "kvset_forward_dropped"] += 1
        self._throttle.log(
            "kvset_" + why,
            logging.WARNING,
            "refused a write%s: %s",
            f" by {writer}" if writer else "",
            "we have lost the pair (stale)" if stale else "our queue to the pair is full",
        )
        uuid = frames[2] if len(frames) == 5 else b""
        if len(uuid) == 16:
            if self._keypair is not None:
                self._refusal(writer, uuid, why)
            else:
                self.publisher.publish(encode_refusal(ANY_WRITER, uuid, why))
        return False

    def _on_relay_collector_secure(self, parts: list[zmq.Frame]) -> None:
        """As :meth:`_on_relay_collector`, serving over CURVE: each KVSET is
        checked against its writer's rights in *our* ACL first (refused with a
        notice, as the pair does), and its writer remembered, so that a
        refusal by the pair reaches it too."""
        pub = self._upstream_pub
        sock = self._collector
        if pub is None or sock is None:
            return
        first = parts[0]
        frames = [part.bytes for part in parts]
        now = self._clock()
        stale = self._relay_stale()
        for _ in range(self.config.collector_batch):
            writer = self._relay_write_allowed(first, frames)
            if writer is not None and self._forward_kvset(pub, frames, stale, writer):
                if len(frames) == 5 and len(frames[2]) == 16 and writer != PEER_USER:
                    self._relay_writers.add(frames[2], writer, now)
            try:
                first, frames = recv_frames_and_first(sock)
            except zmq.Again:
                return

    def _relay_write_allowed(self, first: zmq.Frame, frames: list[bytes]) -> str | None:
        """The writer's name if our ACL lets it write this key; else None (refused)."""
        allowed, user = self._acl_writer(first, frames, notify=True)
        return user if allowed else None
