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
ACL's judgement of a call is :meth:`clone.server.access.Access.call_refusal`.

The I/O is two parts the server owns: a :class:`RelayLink` (which upstream,
its liveness, the call DEALER and who asked each call, the handshake monitor)
and, inside it, a :class:`~.forwarding.Forwarder` (the PUB to the pair's
collectors and who wrote each write), which is the relay's collector sink
(:mod:`.collecting`).  Following itself (the SUB, the syncs) is the
follower's (:mod:`.following`); the link asks it to follow and to stop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream
from zmq.utils.monitor import parse_monitor_message

from clone.errors import ProtocolError
from clone.security import KeyPair, fingerprint
from clone.server.access import Access
from clone.server.config import ServerConfig
from clone.server.core import ServerCore, SyncState
from clone.server.forwarding import ANY_WRITER, Forwarder, Refuse
from clone.server.inflight import InFlight
from clone.server.relayrules import relay_stale, upstream_lost
from clone.server.sending import Backlog, Burst, Sent, send
from clone.server.shared import Shared, Sockets, peer_endpoint
from clone.wire.calls import CALLER_PROPERTY, REPLY, Reply, call_uuid
from clone.wire.codec import Hugz, decode_properties, decode_update, encode_hugz, encode_properties
from clone.wire.control import Refusal, ViewHeartbeat, decode_control, encode_refusal
from clone.wire.frames import recv_frames
from clone.wire.protocol import COLLECTOR_OFFSET, HUGZ, REFUSAL_REASONS, SNAPSHOT_OFFSET

__all__ = ["RelayLink"]

log = logging.getLogger("clone.server.reactor")

# What a relay remembers of the calls it forwarded (clone.server.inflight):
# until their REPLY (a client's call times out well before).
RELAY_CALLS_MAX = 10_000
RELAY_CALL_TTL = 30.0

# REPLYs taken after one forwarded call at most (see _take_call_replies).
_REPLIES_PER_SEND = 100
# Handshake failures on the upstream SUB worth an operator's attention.  The
# value of an AUTH failure is the ZAP status code (400: key not admitted).
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

def _who(identity: bytes) -> str:
    return identity.hex() if identity else "?"


class RelayLink:
    """Follow an upstream with failover; forward calls; heartbeat with staleness.

    Built with the relay's config and core, the access settings of its own
    clients, its key towards the upstream (None: clear text), the ROUTER its
    callers are on (and the look at its backlog), and the callbacks:
    ``follow`` (the follower starts following :attr:`followed`, returning the
    SUB it opened, or None if it had one), ``close_follow`` (it stops),
    ``sync_progress`` (when the follower's sync last moved), ``reply``
    (answer a caller: the caller part's), ``publish``, ``refuse``
    (security's, None without CURVE) and ``views_replaced`` (security's).
    """

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        access: Access,
        sockets: Sockets,
        *,
        router: zmq.Socket[Any],
        router_backlog: Backlog,
        upstream_keypair: KeyPair | None,
        follow: Callable[[], zmq.Socket[Any] | None],
        close_follow: Callable[[], None],
        sync_progress: Callable[[], float],
        reply: Callable[[bytes, Reply], None],
        publish: Callable[[list[bytes]], None],
        refuse: Refuse | None,
        views_replaced: Callable[[], None],
    ) -> None:
        self._config = config
        self._core = core
        self._shared = shared
        self._counters = shared.counters
        self._clock = shared.clock
        self._access = access
        self._sockets = sockets
        self._router = router
        self._router_backlog = router_backlog
        self._upstream_keypair = upstream_keypair
        self._follow = follow
        self._close_follow = close_follow
        self._sync_progress = sync_progress
        self._reply = reply
        self._publish = publish
        self._refuse = refuse
        self._views_replaced = views_replaced
        self._index = 0
        self.followed: str = config.upstream[0]
        self._heard = 0.0  # the clock when the followed server last spoke
        self._heartbeat = config.heartbeat  # its HUGZ interval, as it says
        self._upstream_stale = False  # it is a relay that lost its own upstream
        self._synced_once = False
        self.forwarder: Forwarder | None = None
        # The upstream SUB we watch, and its socket monitor (why a handshake failed).
        self._watched: zmq.Socket[Any] | None = None
        self._monitor: ZMQStream | None = None
        # A DEALER on the snapshot port of the upstream we synced from, and
        # who asked each call we forwarded.
        self._call_dealer: ZMQStream | None = None
        self._call_upstream: str | None = None
        self.calls: InFlight[bytes] = InFlight(RELAY_CALLS_MAX, RELAY_CALL_TTL)

    # -- start, stop -------------------------------------------------------------

    def start(self) -> None:
        """The PUB to every upstream collector, then follow the first upstream."""
        cfg = self._config
        pub = self._sockets.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, cfg.collector_hwm)
        # Queue only for a collector that is there, and say when a queue is
        # full rather than drop: either way the writer is told (module doc).
        pub.setsockopt(zmq.IMMEDIATE, 1)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        for host_port in cfg.upstream:
            pub.connect(peer_endpoint(host_port, COLLECTOR_OFFSET))
        self.forwarder = Forwarder(
            pub, self._shared, stale=self.stale, publish=self._publish, refuse=self._refuse
        )
        self._heard = self._clock()
        log.info("relay of %s: following %s", ", ".join(cfg.upstream), self.followed)
        self._follow_upstream()

    def _follow_upstream(self) -> None:
        """Follow :attr:`followed`, watching its SUB's handshakes."""
        sub = self._follow()
        if sub is not None:
            self._watch(sub)

    def close(self) -> None:
        self._close_monitor()
        self._close_call_dealer()
        self.calls.clear()
        forwarder, self.forwarder = self.forwarder, None
        if forwarder is not None:
            forwarder.close()

    # -- why the upstream does not answer ---------------------------------------

    def _watch(self, sock: zmq.Socket[Any]) -> None:
        """A socket monitor on the upstream SUB: a refused key is otherwise
        only silence.  Diagnosis only: without a monitor the relay works."""
        self._close_monitor()
        try:
            monitor = sock.get_monitor_socket(_MONITORED)
        except zmq.ZMQError as exc:
            log.debug("no socket monitor on the upstream SUB: %s", exc)
            return
        monitor.setsockopt(zmq.LINGER, 0)
        self._watched = sock
        self._monitor = self._sockets.stream(monitor, self._on_monitor)

    def _close_monitor(self) -> None:
        stream, self._monitor = self._monitor, None
        sub, self._watched = self._watched, None
        if stream is None:
            return
        if sub is not None and not sub.closed:
            try:
                sub.disable_monitor()
            except zmq.ZMQError:
                pass
        self._sockets.forget(stream)

    def _on_monitor(self, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)
        except (ValueError, RuntimeError):  # a libzmq we do not understand
            return
        failed = _HANDSHAKE_FAILED.get(int(event["event"]))
        if failed is None:
            return
        self._counters["upstream_handshake_failures"] += 1
        keypair = self._upstream_keypair
        if keypair is None:
            hint = (
                "the upstream may require CURVE: pass --upstream-curve-secret and"
                " --upstream-server-key"
            )
        else:
            hint = (
                f"our key {fingerprint(keypair.public)} (--upstream-curve-secret"
                f" {self._config.upstream_curve_secret}) must be in the upstream's clients"
                " directory (then SIGHUP it), and --upstream-server-key must be its"
                " public certificate"
            )
        self._shared.throttle.log(
            "upstream_handshake",
            logging.WARNING,
            "upstream %s %s (event value %s); we stay stale: %s",
            self.followed,
            failed,
            event.get("value"),
            hint,
        )

    # -- the upstream ----------------------------------------------------------

    def heard(self, frames: list[bytes]) -> None:
        """Any message from the followed server's publisher: it is alive."""
        self._heard = self._clock()
        if frames and frames[0] == HUGZ:
            try:
                hugz = decode_update(frames)
            except ProtocolError:
                return  # the core counts and logs it
            if isinstance(hugz, Hugz):
                if hugz.heartbeat:
                    self._heartbeat = hugz.heartbeat
                stale = hugz.stale
                if stale != self._upstream_stale:
                    self._upstream_stale = stale
                    log.warning(
                        "upstream %s says it is %s", self.followed, "stale" if stale else "fresh"
                    )

    def heard_now(self) -> None:
        """The followed server's snapshot port answered: it is alive."""
        self._heard = self._clock()

    def synced(self) -> None:
        """A sync from the followed server finished: calls can go there.
        A full one replaced our copy without publishing the difference:
        ``views_replaced`` (security's) moves each restricted view on."""
        self._synced_once = True
        self._heard = self._clock()
        if self._core.last_sync == "full":
            self._views_replaced()
        self._open_call_dealer()

    def check(self) -> None:
        """Housekeeping: forget old requests; give up a silent (or
        unanswering) upstream for the next."""
        cfg = self._config
        now = self._clock()
        self.calls.expire(now)
        if self.forwarder is not None:
            self.forwarder.writers.expire(now)
        syncing = self._core.sync_state is SyncState.SYNCING
        if not upstream_lost(
            now=now,
            syncing=syncing,
            sync_started=self._sync_progress(),
            sync_timeout=cfg.effective_sync_timeout,
            heard=self._heard,
            heartbeat=max(self._heartbeat, cfg.heartbeat),
            missed=cfg.ha_missed,
        ):
            return
        was = self.followed
        self._index = (self._index + 1) % len(cfg.upstream)
        self.followed = cfg.upstream[self._index]
        self._upstream_stale = False
        self._counters["upstream_switches"] += 1
        self._shared.throttle.log(
            "upstream_switch",
            logging.WARNING,
            "upstream %s %s; following %s (serving our copy at sequence %d meanwhile)",
            was,
            "did not answer our snapshot request" if syncing else "is silent",
            self.followed,
            self._core.store.sequence,
        )
        self._close_monitor()
        self._close_call_dealer()
        self._close_follow()
        # _heard stays: until the new upstream speaks, we are stale.
        self._follow_upstream()

    def stale(self) -> bool:
        """Whether our HUGZ say ``stale=1`` (:func:`.relayrules.relay_stale`)."""
        cfg = self._config
        return relay_stale(
            now=self._clock(),
            synced_once=self._synced_once,
            heard=self._heard,
            heartbeat=max(self._heartbeat, cfg.heartbeat),
            missed=cfg.ha_missed,
            upstream_stale=self._upstream_stale,
        )

    def hugz(self, heartbeat_ms: int, sequence: int | None = None) -> list[bytes]:
        """Our own HUGZ: our sequence (``sequence``: the one published so far,
        while a commit is in flight), and whether we have lost the pair."""
        if sequence is None:
            sequence = self._core.store.sequence
        return encode_hugz(sequence, heartbeat_ms, stale=self.stale())

    def on_control(self, frames: list[bytes]) -> None:
        """A control message from the upstream's CURVE publisher, to our key.

        A refusal notice answers a write we forwarded: it goes on to the
        client that wrote it.  A view heartbeat means the upstream gives our
        key restricted read rights: a relay's copy must be whole, so say so.
        """
        throttle = self._shared.throttle
        try:
            msg = decode_control(frames)
        except ProtocolError as exc:
            throttle.log("upstream_control", logging.WARNING, "dropped a control message: %s", exc)
            return
        if isinstance(msg, Refusal):
            self._counters["kvset_refused_upstream"] += 1
            forwarder = self.forwarder
            writer = None
            if forwarder is not None:
                writer = forwarder.writers.take(msg.uuid, self._clock())
            throttle.log(
                "kvset_refused_upstream",
                logging.WARNING,
                "upstream %s refused a write we forwarded%s (%s)%s",
                self.followed,
                f" for {writer}" if writer else "",
                msg.reason,
                ": its ACL judges our key's write prefixes" if msg.reason == "acl" else "",
            )
            if msg.reason in REFUSAL_REASONS:
                if writer is not None and self._refuse is not None:
                    self._refuse(writer, msg.uuid, msg.reason)
                elif self._refuse is None and msg.uuid:
                    # A plain relay knows no writers: on to all, as it came.
                    self._publish(encode_refusal(ANY_WRITER, msg.uuid, msg.reason))
        elif isinstance(msg, ViewHeartbeat):
            throttle.log(
                "upstream_view",
                logging.ERROR,
                "upstream %s gives our key restricted read rights (view %s): a relay"
                ' needs read = [""] in its ACL, or its copy has holes and it keeps'
                " resyncing",
                self.followed,
                msg.view,
            )

    # -- client calls ------------------------------------------------------------

    def _open_call_dealer(self) -> None:
        """A DEALER on the snapshot port of the upstream we synced from
        (kept while we follow it: calls are answered by the active server)."""
        followed = self.followed
        if self._call_dealer is not None and self._call_upstream == followed:
            return
        self._close_call_dealer()
        dealer = self._sockets.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, self._config.snapshot_hwm)
        dealer.connect(peer_endpoint(followed, SNAPSHOT_OFFSET))
        self._call_dealer = self._sockets.stream(dealer, self._on_call_reply)
        self._call_upstream = followed

    def _close_call_dealer(self) -> None:
        """Calls in flight on it get no reply; their callers retry (same uuid)."""
        stream, self._call_dealer = self._call_dealer, None
        self._call_upstream = None
        if stream is not None:
            self._sockets.forget(stream)

    def forward_call(
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
        throttle = self._shared.throttle
        uuid = call_uuid(frames)
        if uuid is None:
            throttle.log(
                "call", logging.WARNING, "dropped a CALL? from %s: no uuid", _who(identity)
            )
            return
        if self._access.secure:
            why = self._access.call_refusal(frames, user)
            if why is not None:
                self._counters["calls_forward_refused_acl"] += 1
                throttle.log("call_acl", logging.WARNING, "refused a call from %s: %s", user, why)
                self._reply(identity, Reply(uuid, "refused", reason="acl", detail=why))
                return
        if self._upstream_keypair is not None and caller:
            frames = self._with_caller(frames, user, caller)
        stream = self._call_dealer
        if stream is None or stream.closed() or self.stale():
            # Stale but not yet moved on (up to a housekeeping turn): the
            # upstream is silent, a call sent there would only time out.
            unsynced = stream is None or stream.closed()
            self._counters["calls_forward_not_synced"] += 1
            self._reply(
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
                self._counters["calls_forward_dropped"] += 1
                return
            self._counters["calls_forwarded"] += 1
            if self.calls.add(uuid, identity, self._clock()):
                throttle.log(
                    "calls_in_flight",
                    logging.WARNING,
                    "%d calls in flight upstream: forgot the oldest (its caller retries)",
                    self.calls.limit,
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
        if user is not None and user in self._config.trusted_relays:
            if any(name == CALLER_PROPERTY for name, _ in props):
                return frames
        kept = tuple((n, v) for n, v in props if n != CALLER_PROPERTY)
        out = list(frames)
        out[4] = encode_properties((*kept, (CALLER_PROPERTY, caller)))
        return out

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
            self._shared.throttle.log(
                "call_reply",
                logging.WARNING,
                "dropped a malformed answer to a forwarded call from %s",
                self._call_upstream,
            )
            return
        identity = self.calls.take(frames[1], self._clock())
        if identity is None:
            self._counters["call_replies_unmatched"] += 1  # its caller gave up long ago
            return
        sock = self._router
        if sock.closed:
            return
        # Sent from the DEALER's callback, not the ROUTER stream's: look at
        # the requests our send may have hidden from it.
        if send(sock, [identity, *frames], backlog=self._router_backlog) is not Sent.OK:
            self._counters["call_replies_dropped"] += 1  # its pipe is full, or it went away
            return
        self._counters["call_replies_forwarded"] += 1
