"""CONFLICTS? on the snapshot port: list this server's split-brain conflicts (I/O side).

How this works: the records live in the core's
:class:`~clone.server.conflicts.ConflictBook`; this part answers a
``CONFLICTS?`` (:mod:`clone.wire.conflicts`) at once, whatever the role, rate
limited with STATUS? (the same token bucket: both are an operator's look, not
a client's work), and, under CURVE, lists only the conflicts whose key the
requester may read.  Resolving one is a call (``conflict-apply``,
``conflict-discard``: :mod:`.calling`), judged by the ACL on the conflict's
key like any write.
"""

from __future__ import annotations

import logging

import zmq

from clone.errors import ProtocolError
from clone.security import PEER_USER
from clone.server.base import ServerBase, who
from clone.server.sending import Sent, send
from clone.wire.conflicts import decode_conflicts_request, encode_conflicts

__all__ = ["AdminMixin"]


class AdminMixin(ServerBase):
    """Answer CONFLICTS?."""

    def _answer_conflicts(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        c = self.counters
        c["conflicts_requests"] += 1
        try:
            everything = decode_conflicts_request([p.bytes for p in parts[1:]])
        except ProtocolError as exc:
            self._throttle.log(
                "conflicts?", logging.WARNING, "dropped a request from %s: %s", who(identity), exc
            )
            return
        readable = None
        if self._keypair is not None:
            try:
                user: str | None = str(parts[1].get("User-Id"))
            except zmq.ZMQError:
                user = None
            if user not in self._admitted:
                c["conflicts_dropped"] += 1
                return
            if user != PEER_USER:
                readable = self._rights_of(user).can_read
        if not self._status_limiter.allow(self._clock()):
            c["conflicts_dropped"] += 1
            return
        book = self.core.conflicts
        records = [
            r.as_json()
            for r in book.records(unresolved_only=not everything)
            if readable is None or readable(r.key)
        ]
        reply = encode_conflicts(records, total=len(book), unresolved=book.unresolved)
        sock = self._router
        assert sock is not None
        # From the ROUTER's reader (its stream's callback, or the backlog loop):
        # it looks at the socket again after us.
        if send(sock, [identity, *reply], backlog=None) is not Sent.OK:
            c["conflicts_dropped"] += 1  # its pipe is full, or it is gone
