"""CONFLICTS? on the snapshot port: list this server's split-brain conflicts (a part).

How this works: the records live in the core's
:class:`~clone.server.conflicts.ConflictBook`; the :class:`ConflictsDesk`
answers a ``CONFLICTS?`` (:mod:`clone.wire.conflicts`) at once, whatever the
role, rate limited with STATUS? (the same token bucket: both are an
operator's look, not a client's work), and, under CURVE, lists only the
conflicts whose key the requester may read.  Resolving one is a call
(``conflict-apply``, ``conflict-discard``: :mod:`.calling`), judged by the ACL
on the conflict's key like any write.  ``tests/server/test_conflicts_desk.py``
drives it alone on a real ROUTER.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from clone.errors import ProtocolError
from clone.security import PEER_USER
from clone.server.access import Access
from clone.server.core import ServerCore
from clone.server.sending import Sent, send
from clone.server.shared import Shared
from clone.server.status import StatusLimiter
from clone.wire.conflicts import decode_conflicts_request, encode_conflicts

__all__ = ["ConflictsDesk"]


class ConflictsDesk:
    """Answer CONFLICTS? on the ROUTER, from the core's conflict book.

    ``limiter`` is the STATUS? token bucket, shared with the snapshot port's
    status answers.  The answer is sent from the ROUTER's reader, which looks
    at the socket again after us (no backlog look here).
    """

    def __init__(
        self,
        core: ServerCore,
        shared: Shared,
        access: Access,
        router: zmq.Socket[Any],
        limiter: StatusLimiter,
    ) -> None:
        self._core = core
        self._shared = shared
        self._counters = shared.counters
        self._access = access
        self._router = router
        self._limiter = limiter

    def on_request(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        """A CONFLICTS? read from the ROUTER: ``parts`` from the delimiter on."""
        c = self._counters
        c["conflicts_requests"] += 1
        try:
            everything = decode_conflicts_request([p.bytes for p in parts[1:]])
        except ProtocolError as exc:
            self._shared.throttle.log(
                "conflicts?",
                logging.WARNING,
                "dropped a request from %s: %s",
                identity.hex() if identity else "?",
                exc,
            )
            return
        readable = None
        access = self._access
        if access.secure:
            try:
                user: str | None = str(parts[1].get("User-Id"))
            except zmq.ZMQError:
                user = None
            if user not in access.admitted:
                c["conflicts_dropped"] += 1
                return
            if user != PEER_USER:
                readable = access.rights_of(user).can_read
        if not self._limiter.allow(self._shared.clock()):
            c["conflicts_dropped"] += 1
            return
        book = self._core.conflicts
        records = [
            r.as_json()
            for r in book.records(unresolved_only=not everything)
            if readable is None or readable(r.key)
        ]
        reply = encode_conflicts(records, total=len(book), unresolved=book.unresolved)
        # From the ROUTER's reader (its stream's callback, or the backlog loop):
        # it looks at the socket again after us.
        if send(self._router, [identity, *reply], backlog=None) is not Sent.OK:
            c["conflicts_dropped"] += 1  # its pipe is full, or it is gone
