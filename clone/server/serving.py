"""The snapshot port (ROUTER, P): what each request is, and who answers it.

How this works: :class:`SnapshotPort`, a part of the server, reads the
ROUTER and sends each request where it belongs: STATUS?
**[extension: status]** is answered here, at once, by an active or a passive
server alike (it is no vote), rate-limited by a token bucket, with
:func:`~clone.server.status.server_status`; CALL? goes to the caller
(:mod:`.calling`), CONFLICTS? to the conflicts desk (:mod:`.admin`).  An
ICANHAZ? is read with its connection's metadata (batches, the applied list,
a catch-up, the time left of ephemeral entries, a loser's step-down), held
while a split brain heals (:mod:`.healing`), put to Binary Star's vote (a
vote refused only for now is held: :mod:`.voting`), and streamed
(:mod:`.streaming`).  :meth:`SnapshotPort.take_backlog` reads what a send
outside the reader's callback may have hidden (:mod:`.sending`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from tornado.ioloop import IOLoop

from clone.errors import ProtocolError
from clone.server.access import Access
from clone.server.core import ServerCore
from clone.server.healing import Healer
from clone.server.sending import Sent, send
from clone.server.shared import Shared
from clone.server.status import StatusLimiter
from clone.server.streaming import who
from clone.server.voting import HeldVotes
from clone.wire.calls import CALL
from clone.wire.conflicts import CONFLICTS_REQUEST
from clone.wire.delta import SinceRequest, parse_since, parse_since_term
from clone.wire.frames import NOBLOCK, recv_zero_copy
from clone.wire.protocol import (
    APPLIED_PROPERTY,
    APPLIED_VERSION,
    BATCH_PROPERTY,
    BATCH_VERSION,
    REQUESTER_PROPERTY,
    SINCE_PROPERTY,
    SINCE_TERM_PROPERTY,
    STATUS_REQUEST,
    STEPPED_DOWN_PROPERTY,
    TTL_LEFT_NAME,
    TTL_LEFT_VERSION,
)
from clone.wire.requester import parse_requester
from clone.wire.status import encode_status

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar

__all__ = ["SnapshotPort"]

log = logging.getLogger("clone.server.reactor")

# Snapshot requests handled after one pump turn at most (see SnapshotPort.take_backlog).
_ROUTER_BACKLOG_BATCH = 100


def _has_metadata(frame: zmq.Frame, name: str, value: str) -> bool:
    """Whether the requester's connection carries our metadata ``name:value``.

    A peer that did not set it (the Guide's clients, raw tools) makes libzmq
    raise EINVAL: it gets the standard stream.
    """
    try:
        return bool(frame.get(name) == value)
    except zmq.ZMQError:
        return False


def _wants_batches(frame: zmq.Frame) -> bool:
    """KVBATCHes instead of KVSYNCs (:mod:`clone.wire.batch`)."""
    return _has_metadata(frame, BATCH_PROPERTY, BATCH_VERSION)


def _since(frame: zmq.Frame) -> SinceRequest | None:
    """The requester's catch-up or history request (:mod:`clone.wire.delta`), if any.

    Raises ProtocolError for a malformed one (the caller serves the whole state).
    """
    try:
        value = frame.get(SINCE_PROPERTY)
    except zmq.ZMQError:
        return None
    since = parse_since(str(value))
    if since.digest is None:
        return since
    try:
        term = frame.get(SINCE_TERM_PROPERTY)
    except zmq.ZMQError:
        return since  # a relay, or a server from before the term was sent
    return SinceRequest(since.sequence, since.digest, parse_since_term(str(term)))


def _requester(frame: zmq.Frame) -> str | None:
    """The client's own id on its snapshot DEALER (:mod:`clone.wire.requester`),
    if it says one.  Raises ProtocolError for a malformed one (the request is
    then served as anyone's: by its routing id alone)."""
    try:
        value = frame.get(REQUESTER_PROPERTY)
    except zmq.ZMQError:
        return None
    return parse_requester(str(value))


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id of the connection a message came on (CURVE), or None."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return None


def _peer_host(frame: zmq.Frame) -> str | None:
    """The address the requester connects from (its share of snapshot slots
    and turns: :mod:`.fairshare`), or None where libzmq does not say."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return None


def _wants_ttl_left(frame: zmq.Frame) -> bool:
    """Ephemeral entries with the time they have left: a peer server's sync
    (:mod:`clone.server.ttl`)."""
    return _has_metadata(frame, TTL_LEFT_NAME, TTL_LEFT_VERSION)


def _stepped_down(frame: zmq.Frame) -> bool:
    """A peer's sync that says it stepped down from active in this run: a
    split brain's loser, with writes to forward (clone.server.healing)."""
    return _has_metadata(frame, STEPPED_DOWN_PROPERTY, "1")


def _wants_applied(frame: zmq.Frame) -> bool:
    """The applied-update list first: a peer server's sync (:mod:`clone.wire.applied`)."""
    return _has_metadata(frame, APPLIED_PROPERTY, APPLIED_VERSION)


class SnapshotPort:
    """The ROUTER's reader: dispatch each request, vote, hold or serve it.

    Built with the ROUTER, the loop (a full backlog batch looks again next
    turn), the healer (its hold of client snapshots), the held votes, and
    callbacks: ``serve`` (the snapshot streams'), ``on_call`` (the caller's),
    ``on_conflicts`` (the conflicts desk's), ``status`` (the monitor's
    STATUS) and ``ha`` (Binary Star; None unpaired).  ``access`` names who is
    admitted under CURVE (``secure``).
    """

    def __init__(
        self,
        core: ServerCore,
        shared: Shared,
        access: Access,
        router: zmq.Socket[Any],
        loop: IOLoop,
        *,
        secure: bool,
        healer: Healer,
        votes: HeldVotes,
        serve: Callable[..., None],
        on_call: Callable[[bytes, list[zmq.Frame]], None],
        on_conflicts: Callable[[bytes, list[zmq.Frame]], None],
        status: Callable[[], dict[str, Any]],
        status_limiter: StatusLimiter,
        ha: Callable[[], BinaryStar | None],
    ) -> None:
        self.core = core
        self.counters = shared.counters
        self._throttle = shared.throttle
        self._clock = shared.clock
        self._access = access
        self._router: zmq.Socket[Any] | None = router
        self._loop: IOLoop | None = loop  # None once closed
        self._secure = secure
        self.healer = healer
        self._votes = votes
        self._serve = serve
        self._on_call = on_call
        self._answer_conflicts = on_conflicts
        self._status = status
        self._status_limiter = status_limiter
        self._guarded: Callable[[list[zmq.Frame]], None] = self.on_router
        self._ha_of = ha
        self._taking_backlog = False  # inside take_backlog (no re-entry)

    @property
    def _ha(self) -> BinaryStar | None:
        return self._ha_of()

    def set_guarded(self, guarded: Callable[[list[zmq.Frame]], None]) -> None:
        """``on_router`` as the loop's stream calls it (a bug logged, never
        fatal): what :meth:`take_backlog` calls for each request it reads."""
        self._guarded = guarded

    def close(self) -> None:
        """The server stops: nothing more is read or scheduled."""
        self._loop = None
        self._router = None

    def on_router(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        if len(parts) == 2 and parts[1].bytes == STATUS_REQUEST:
            self._answer_status(identity, parts[1])
            return
        if len(parts) > 1 and parts[1].bytes == CALL:
            self._on_call(identity, parts)
            return
        if len(parts) > 1 and parts[1].bytes == CONFLICTS_REQUEST:
            self._answer_conflicts(identity, parts)
            return
        batch = len(parts) > 1 and _wants_batches(parts[1])
        applied = len(parts) > 1 and _wants_applied(parts[1])
        if applied:
            # The peer's sync; a loser's says so (the heal defers client snapshots).
            self.healer.peer_sync_started(stepped_down=_stepped_down(parts[1]))
        ttl_left = len(parts) > 1 and _wants_ttl_left(parts[1])
        since: SinceRequest | None = None
        if len(parts) > 1:
            try:
                since = _since(parts[1])
            except ProtocolError as exc:
                self._throttle.log(
                    "since", logging.WARNING, "ignored a bad catch-up request: %s", exc
                )
        user = _user_id(parts[1]) if len(parts) > 1 and self._secure else None
        requester: str | None = None
        if len(parts) > 1 and not applied:
            try:
                requester = _requester(parts[1])
            except ProtocolError as exc:
                self.counters["snapshot_requester_invalid"] += 1
                self._throttle.log(
                    "requester", logging.WARNING, "ignored a bad requester id: %s", exc
                )
        frames = [part.bytes for part in parts[1:]]
        try:
            subtree = self.core.snapshot_request(frames)
        except ProtocolError as exc:
            self._throttle.log(
                "icanhaz", logging.WARNING, "dropped a request from %s: %s", who(identity), exc
            )
            return
        if not applied and self.healer.defers_clients():
            # Healing a split brain: the loser's writes are still coming in,
            # and a client synced now would lose them from its view until
            # they came (the island's own confirmed writes gone, then back).
            # Held, and answered when the hold ends (a client that asks again
            # meanwhile is answered on its new connection; the old one's
            # stream is dropped as unroutable).
            self.counters["snapshots_held_heal"] += 1
            self.healer.hold_request(identity, subtree, {
                "batch": batch, "since": since, "user": user, "ttl_left": ttl_left,
                "requester": requester})
            log.debug("snapshot request from %s held: healing a split brain", who(identity))
            return
        ha = self._ha
        if ha is not None and not ha.accept_vote():
            # Binary Star: a server that may not serve stays silent.  If only
            # the peer's not-yet-expired heartbeat stands in the way, hold the
            # request and vote again when it expires; otherwise the client
            # times out and fails over to the other server.
            if not self._votes.defer(identity, subtree, batch, applied, user, since, ttl_left):
                self.counters["snapshots_refused"] += 1
                log.debug("snapshot request from %s not served (%s)", who(identity), ha.state.name)
            return
        # Served now: a held copy of the same request must not be served again.
        self._votes.discard(identity, subtree)
        self._serve(
            identity,
            subtree,
            batch=batch,
            applied=applied,
            since=since,
            user=user,
            ttl_left=ttl_left,
            requester=requester,
            host=_peer_host(parts[1]) if len(parts) > 1 else None,
        )

    def take_backlog(self) -> None:
        """Handle snapshot requests that our own sends may have hidden.

        The pump sends on the ROUTER directly, and a send can consume the edge
        of the socket's file descriptor that announces a new request: the
        ZMQStream then never wakes for it, and a request that came in during
        a long snapshot could wait until something else stirred the socket
        (seen: 10 s).  So after sending we ask the socket itself.
        """
        sock = self._router
        if sock is None or sock.closed or self._taking_backlog:
            # Already taking it, further up this very stack: a request served
            # from here pumps its first chunk, which would come back here, one
            # level deeper per request (a failover's storm of requests hit
            # Python's recursion limit).  The outer loop goes on instead.
            return
        self._taking_backlog = True
        try:
            for _ in range(_ROUTER_BACKLOG_BATCH):
                # No poll(0) first: a non-blocking receive asks the socket the
                # same, and pyzmq's poll builds a Poller each time (with the
                # RCVMORE reads recv_multipart makes, a tenth of the server's
                # time under a bulk load of calls, the Spark pipeline's writers).
                try:
                    parts = recv_zero_copy(sock, NOBLOCK)
                except zmq.Again:
                    return
                self._guarded(parts)
            # A full batch: more may be waiting; look again next turn.
            if self._loop is not None:
                self._loop.add_callback(self.take_backlog)
        finally:
            self._taking_backlog = False

    def _answer_status(self, identity: bytes, frame: zmq.Frame) -> None:
        """STATUS?: answer at once, never vote; drop when over the rate or gone."""
        c = self.counters
        c["status_requests"] += 1
        if self._secure and _user_id(frame) not in self._access.admitted:
            c["status_dropped"] += 1  # ZAP let it in, but its name was removed
            return
        if not self._status_limiter.allow(self._clock()):
            c["status_dropped"] += 1
            self._throttle.log(
                "status_rate", logging.INFO, "STATUS? requests over the rate limit dropped"
            )
            return
        sock = self._router
        assert sock is not None
        # From the ROUTER's reader (its stream's callback, or the backlog loop):
        # it looks at the socket again after us.
        sent = send(sock, [identity, *encode_status(self._status())], backlog=None)
        if sent is not Sent.OK:
            c["status_dropped"] += 1  # its pipe is full (it will time out), or it is gone
