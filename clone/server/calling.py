"""CALL? on the snapshot port: answer writes and lease operations (I/O side).

How this works: :meth:`ServerCore.on_call` decides (sans-IO); this part reads
the caller's rights from its connection (CURVE), sends the reply, and holds back
a reply that reports a change until that change is on disk: such replies wait
in a list that one callback per loop turn flushes after a single commit, the
same group commit the collector's updates get (docs/protocol.md, "CALL? /
REPLY").  A reply never blocks the reactor: it is sent without waiting, and
dropped if the caller has gone or its pipe is full (the caller retries with the
same uuid, which the server deduplicates).  A relay does not decide calls: it
forwards them to the pair (:mod:`.relaying`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from clone.security import PEER_USER
from clone.server.base import ServerBase, who
from clone.server.core import Role
from clone.server.ownership import name_principal
from clone.server.sending import Backlog, Burst, Sent, send
from clone.wire.calls import Reply, encode_reply

__all__ = ["CallingMixin"]

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


class CallingMixin(ServerBase):
    """Answer CALL?s; commit before confirming."""

    def _on_call(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        frames = [part.bytes for part in parts[1:]]
        user: str | None = None
        if self._keypair is not None:
            try:
                user = str(parts[1].get("User-Id"))
            except zmq.ZMQError:
                user = None
        if self.core.role is Role.RELAY:
            # The relay checks its own client's rights; the pair, the relay's.
            self._forward_call(identity, frames, user, _principal(parts[1], user))
            return
        can_write: Callable[[bytes], bool] | None = None
        may_lease = True
        if self._keypair is not None:
            if user != PEER_USER and user not in self._write_all:
                if user in self._admitted:
                    rights = self._rights_of(user)
                    can_write, may_lease = rights.can_write, bool(rights.write)
                else:
                    can_write, may_lease = _nothing, False
        reply, after_commit = self.core.on_call(
            frames,
            self._wallclock(),
            self._clock(),
            can_write=can_write,
            may_lease=may_lease,
            caller=_principal(parts[1], user),
            relayed=user is not None and user in self.config.trusted_relays,
            # Without CURVE nobody can be told from the peer: the split
            # properties are accepted from anyone, as every write is.
            peer=self._keypair is None or user == PEER_USER,
        )
        if reply is None:
            self._throttle.log(
                "call", logging.WARNING, "dropped a CALL? from %s: no uuid", who(identity)
            )
            return
        if reply.reason in _LOGGED_REASONS:
            self._throttle.log(
                "call_" + reply.reason,
                logging.WARNING,
                "refused a call from %s (%s): %s",
                who(identity),
                reply.reason,
                reply.detail,
            )
        if not after_commit:
            # From the ROUTER's reader, which looks at the socket again after us.
            self._send_reply(identity, reply, backlog=None)
            return
        self._replies.append((identity, reply))
        if not self._replies_scheduled and self._loop is not None:
            self._replies_scheduled = True
            self._loop.add_callback(self._flush_replies)

    def _flush_replies(self) -> None:
        """Once per turn: commit what the calls changed, then confirm them."""
        self._replies_scheduled = False
        replies, self._replies = self._replies, []
        if self._stopping:
            return
        self._commit_and_publish()
        if self._storage_error is not None:
            return  # fail-stop: nothing unwritten is confirmed
        # Sent from a callback of ours, not the ROUTER stream's: the burst
        # looks at the requests our sends may have hidden (sending.py).
        with Burst(self._take_router_backlog) as burst:
            for identity, reply in replies:
                self._send_reply(identity, reply, burst=burst)

    def _send_reply(
        self, identity: bytes, reply: Reply, *, backlog: Backlog = None, burst: Burst | None = None
    ) -> None:
        """Answer a call on the ROUTER: in ``burst``, or alone, then ``backlog``."""
        sock = self._router
        if sock is None or sock.closed:
            return
        frames = [identity, *encode_reply(reply)]
        if burst is not None:
            sent = burst.send(sock, frames)
        else:
            sent = send(sock, frames, backlog=backlog)
        if sent is not Sent.OK:
            self.counters["call_replies_dropped"] += 1  # its pipe is full, or it is gone


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
