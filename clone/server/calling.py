"""CALL? on the snapshot port: answer writes and lease operations (I/O side).

How this works: :meth:`ServerCore.on_call` decides (sans-IO); the
:class:`Caller` part reads the caller's rights from its connection (CURVE),
sends the reply, and holds back a reply that reports a change until that
change is on disk: such replies wait in a list that one callback per loop
turn flushes after a single commit, the same group commit the collector's
updates get (docs/protocol.md, "CALL? / REPLY").  A reply never blocks the
reactor: it is sent without waiting, and dropped if the caller has gone or
its pipe is full (the caller retries with the same uuid, which the server
deduplicates).  A relay does not decide calls: its caller forwards them to the
pair (the relay link, :mod:`.relaying`).

The part is built with what it touches and nothing else: the core, the
access settings, the ROUTER socket and the callbacks for the commit, the
ROUTER's backlog and the next loop turn; ``tests/server/test_caller.py``
drives it alone on a real ROUTER.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import zmq

from clone.security import PEER_USER
from clone.server.access import Access
from clone.server.core import ServerCore
from clone.server.ownership import name_principal
from clone.server.sending import Backlog, Burst, Sent, send
from clone.server.shared import Shared
from clone.wire.calls import Reply, encode_reply

__all__ = ["Caller", "Forward"]

#: How a relay's caller hands a call on: (identity, frames from b"CALL?" on,
#: the caller's CURVE name or None, its principal).
Forward = Callable[[bytes, list[bytes], "str | None", str], None]

#: Refusals that say something about the caller, worth a (rate-limited) line.
_LOGGED_REASONS = frozenset(
    {
        "malformed",
        "bad-if-sequence",
        "bad-lease",
        "bad-ttl",
        "bad-secret",
        "reserved",
        "acl",
        "size",
        "busy",
        "not-owner",
        "lease-quota",
    }
)


def _who(identity: bytes) -> str:
    return identity.hex() if identity else "?"


class Caller:
    """Answer CALL?s on the ROUTER; commit before confirming.

    ``commit`` commits this turn's changes and calls back once they are on
    disk and published (perhaps on a later loop turn: the commit writer's,
    clone.server.committing), never if the server is stopping or failed to
    write, so nothing unwritten is confirmed.  ``router_backlog`` reads the requests a send from
    outside the ROUTER's own callback may have hidden (:mod:`.sending`).
    ``next_turn`` runs a callback on the loop's next turn (False: no loop).
    ``forward`` is given to a relay's caller only: every call goes there.
    ``settled`` says whether every change applied so far is published: while
    it is not (the loop applies the next writes while a commit is in flight,
    clone.server.gathering), a reply that changed nothing but names a
    sequence (a retry's ``ok``, a ``conflict``) waits for the commit too.
    """

    def __init__(
        self,
        core: ServerCore,
        shared: Shared,
        access: Access,
        router: zmq.Socket[Any],
        *,
        commit: Callable[[Callable[[], None]], None],
        router_backlog: Backlog,
        next_turn: Callable[[Callable[[], None]], bool],
        trusted_relays: Collection[str] = (),
        forward: Forward | None = None,
        settled: Callable[[], bool] = lambda: True,
    ) -> None:
        self._core = core
        self._shared = shared
        self._counters = shared.counters
        self._access = access
        self._router = router
        self._commit = commit
        self._router_backlog = router_backlog
        self._next_turn = next_turn
        self._trusted = trusted_relays
        self._forward = forward
        self._settled = settled
        # Replies that wait for this turn's commit, and whether a flush is due.
        self._replies: list[tuple[bytes, Reply]] = []
        self._scheduled = False

    @property
    def waiting(self) -> int:
        """Replies held for the next commit."""
        return len(self._replies)

    def on_call(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        """A CALL? read from the ROUTER: ``parts`` from the empty delimiter on."""
        frames = [part.bytes for part in parts[1:]]
        access = self._access
        user: str | None = None
        if access.secure:
            try:
                user = str(parts[1].get("User-Id"))
            except zmq.ZMQError:
                user = None
        if self._forward is not None:
            # The relay checks its own client's rights; the pair, the relay's.
            self._forward(identity, frames, user, _principal(parts[1], user))
            return
        can_write: Callable[[bytes], bool] | None = None
        may_lease = True
        if access.secure:
            if user != PEER_USER and user not in access.write_all:
                if user in access.admitted:
                    rights = access.rights_of(user)
                    can_write, may_lease = rights.can_write, bool(rights.write)
                else:
                    can_write, may_lease = _nothing, False
        shared = self._shared
        reply, after_commit = self._core.on_call(
            frames,
            shared.wallclock(),
            shared.clock(),
            can_write=can_write,
            may_lease=may_lease,
            caller=_principal(parts[1], user),
            relayed=user is not None and user in self._trusted,
            # Without CURVE nobody can be told from the peer: the split
            # properties are accepted from anyone, as every write is.
            peer=not access.secure or user == PEER_USER,
        )
        if reply is None:
            shared.throttle.log(
                "call", logging.WARNING, "dropped a CALL? from %s: no uuid", _who(identity)
            )
            return
        if reply.reason in _LOGGED_REASONS:
            shared.throttle.log(
                "call_" + reply.reason,
                logging.WARNING,
                "refused a call from %s (%s): %s",
                _who(identity),
                reply.reason,
                reply.detail,
            )
        if reply.failures and reply.failures[0][1] in _LOGGED_REASONS:
            index, reason, detail = reply.failures[0]
            shared.throttle.log(
                "call_set_many",
                logging.WARNING,
                "refused %d of the %d entries of a set-many from %s, the first (%d, %s): %s",
                len(reply.failures),
                len(reply.sequences or ()),
                _who(identity),
                index,
                reason,
                detail,
            )
        if not after_commit and (self._settled() or not _names_sequence(reply)):
            # From the ROUTER's reader, which looks at the socket again after us.
            self.send_reply(identity, reply, backlog=None)
            return
        self._replies.append((identity, reply))
        if not self._scheduled:
            self._scheduled = self._next_turn(self.flush)

    def flush(self) -> None:
        """Once per turn: commit what the calls changed, then confirm them."""
        self._scheduled = False
        replies, self._replies = self._replies, []

        def confirm() -> None:
            # A grant's lease counts from its confirmation, not its apply: a
            # commit slower than its ttl must not end it before its holder
            # hears of it.
            granted = [reply.lease for _, reply in replies if reply.ok and reply.lease]
            if granted:
                self._core.calls.leases_usable_from(self._shared.clock(), granted)
            # Sent from a callback of ours, not the ROUTER stream's: the burst
            # looks at the requests our sends may have hidden (sending.py).
            with Burst(self._router_backlog) as burst:
                for identity, reply in replies:
                    self.send_reply(identity, reply, burst=burst)

        self._commit(confirm)

    def send_reply(
        self, identity: bytes, reply: Reply, *, backlog: Backlog = None, burst: Burst | None = None
    ) -> None:
        """Answer a call on the ROUTER: in ``burst``, or alone, then ``backlog``."""
        sock = self._router
        if sock.closed:
            return
        frames = [identity, *encode_reply(reply)]
        if burst is not None:
            sent = burst.send(sock, frames)
        else:
            sent = send(sock, frames, backlog=backlog)
        if sent is not Sent.OK:
            self._counters["call_replies_dropped"] += 1  # its pipe is full, or it is gone


def _names_sequence(reply: Reply) -> bool:
    """Whether a reply tells a sequence of the state, which may not be
    published yet (a retry's ``ok``, a ``conflict``'s current sequence)."""
    return bool(reply.sequence or reply.current or any(reply.sequences or ()))


def _nothing(key: bytes) -> bool:
    return False


def _principal(frame: zmq.Frame, user: str | None) -> str:
    """Who made a call (clone.server.ownership): its certificate name under
    CURVE, else the address it connected from (what a quota can count)."""
    if user is not None:
        return name_principal(user)
    try:
        return "addr:" + str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "addr:?"
