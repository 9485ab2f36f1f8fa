"""The frontend's calls: compare-and-set, leases, the lock queue.

A call is a CALL? the agent sends to the active server and a REPLY the event
dispatcher routes back to a future by uuid (:class:`~clone.client.events.Waiters`);
no reply within the timeout is :class:`~clone.errors.NotActive`.  :class:`Caller`
makes the calls for a :class:`~clone.client.frontend.Clone` and keeps its
leases: the grant, the keepalives handed to the agent, the revoke, and the
revokes at close.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, TypeVar

from clone.client import verbs
from clone.client.args import build, check_if_sequence, format_lease_ttl, lease_props
from clone.client.events import DISPATCH_POLL_S
from clone.client.leases import Lease
from clone.errors import CloneError, Conflict, LeaseLost, NotActive, refusal
from clone.wire.calls import (
    IF_SEQUENCE_PROPERTY,
    LEASE_PROPERTY,
    OP_AHEAD,
    OP_LEASE_GRANT,
    OP_LEASE_REVOKE,
    OP_SET,
    SECRET_PROPERTY,
    Reply,
    encode_call,
    lease_id_of,
    lease_key,
    valid_lease_id,
    valid_secret,
)
from clone.wire.codec import KVMsg, Properties, new_uuid
from clone.wire.protocol import TTL_PROPERTY

if TYPE_CHECKING:
    from clone.client.handle import ClientHandle

__all__ = ["Caller"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# What close() spends at most revoking the leases still held (best effort: a
# lease not revoked ends by itself within its ttl, as nobody keeps it alive).
CLOSE_REVOKE_S = 2.0


class Caller:
    """Calls and leases for one client (its pipe, waiters and lease table)."""

    def __init__(self, client: ClientHandle) -> None:
        self._client = client

    def grant(
        self,
        ttl: float,
        timeout: float | None,
        for_key: str | None,
        secret: str | None = None,
    ) -> Lease:
        """See :meth:`Clone.lease`."""
        ttl_text = format_lease_ttl(ttl)
        key = "" if for_key is None else build(for_key, b"", {}).key
        uuid = new_uuid()
        # Ours, so that a retry of the grant (same uuid) proves the same owner.
        if secret is None:
            secret = secrets.token_hex(16)
        elif not valid_secret(secret):
            raise ValueError("a lease secret is 32 lowercase hex digits")
        asked = time.monotonic()  # the servers count its ttl from later than this
        reply = self.call(
            OP_LEASE_GRANT,
            uuid,
            key,
            ((TTL_PROPERTY, ttl_text), (SECRET_PROPERTY, secret)),
            b"",
            timeout,
            "a lease grant",
        )
        if not reply.ok:
            raise refusal(reply.reason, key or lease_key(lease_id_of(uuid)))
        lease = Lease(
            self._client,
            reply.lease or lease_id_of(uuid),
            reply.ttl or float(ttl),
            reply.secret or secret,
        )
        lease._kept_until(asked + lease.ttl)
        self.keep(lease)
        return lease

    def keep(self, lease: Lease, *, oneway: bool = False) -> None:
        """The client holds ``lease`` from now: listed for close() and its
        events, and kept alive by the agent every ttl/3.  ``oneway``: handed
        to the agent without waiting for it (from the event thread, which must
        not block on the command pipe)."""
        client = self._client
        with client._shared:
            client._leases[lease.id] = lease
        args = [lease.id.encode(), repr(lease.ttl).encode(), lease._secret.encode()]
        if oneway:
            client._send_oneway(verbs.LEASE, args)
        else:
            client._request(verbs.LEASE, args)

    def call_write(
        self,
        key: str,
        body: bytes,
        props: dict[str, str],
        timeout: float | None,
        if_sequence: int | None,
        lease: Lease | str | None,
    ) -> int:
        """A set or delete as a call: compare-and-set, a key bound to a lease."""
        msg, what, finish = self._write_call(key, body, props, if_sequence, lease)
        return finish(self.call(OP_SET, msg.uuid, key, msg.properties, body, timeout, what))

    def call_write_async(
        self,
        key: str,
        body: bytes,
        props: dict[str, str],
        timeout: float | None,
        if_sequence: int | None,
        lease: Lease | str | None,
    ) -> Future[int]:
        """:meth:`call_write` without blocking (for :mod:`clone.aio`)."""
        msg, what, finish = self._write_call(key, body, props, if_sequence, lease)
        limit = self._client.confirm_timeout if timeout is None else timeout
        reply = self.call_async(OP_SET, msg.uuid, key, msg.properties, body, limit, what)
        return _then(reply, finish)

    def _write_call(
        self,
        key: str,
        body: bytes,
        props: dict[str, str],
        if_sequence: int | None,
        lease: Lease | str | None,
    ) -> tuple[KVMsg, str, Callable[[Reply], int]]:
        """A write call's message, its description, and what makes its reply a
        sequence or an exception; ``props`` completed in place."""
        expected = check_if_sequence(if_sequence)
        held, lease_id = self.lease_arg(lease)
        if expected is not None:
            props[IF_SEQUENCE_PROPERTY] = str(expected)
        if lease_id is not None:
            props[LEASE_PROPERTY] = lease_id
            if held is not None and held._secret:
                props[SECRET_PROPERTY] = held._secret
        msg = build(key, body, props)

        def finish(reply: Reply) -> int:
            if reply.ok:
                return reply.sequence
            if reply.status == "conflict":
                raise Conflict(key, expected or 0, reply.current or 0)
            if reply.reason == "unknown-lease" and lease_id is not None:
                if held is not None:
                    self.lease_lost(held, reply.detail or "unknown to the servers")
                raise LeaseLost(lease_id, reply.detail)
            raise refusal(reply.reason, key)

        return msg, f"the {'write' if body else 'delete'} of {key!r}", finish

    def grant_async(self, ttl: float, timeout: float | None, for_key: str | None) -> Future[Lease]:
        """:meth:`grant` without blocking (for :mod:`clone.aio`): the
        keepalives are handed to the agent one-way when the grant is answered."""
        ttl_text = format_lease_ttl(ttl)
        key = "" if for_key is None else build(for_key, b"", {}).key
        uuid = new_uuid()
        secret = secrets.token_hex(16)
        asked = time.monotonic()
        limit = self._client.confirm_timeout if timeout is None else timeout
        props = ((TTL_PROPERTY, ttl_text), (SECRET_PROPERTY, secret))
        reply = self.call_async(OP_LEASE_GRANT, uuid, key, props, b"", limit, "a lease grant")

        def finish(reply: Reply) -> Lease:
            if not reply.ok:
                raise refusal(reply.reason, key or lease_key(lease_id_of(uuid)))
            lease_id = reply.lease or lease_id_of(uuid)
            lease = Lease(self._client, lease_id, reply.ttl or float(ttl), reply.secret or secret)
            lease._kept_until(asked + lease.ttl)
            self.keep(lease, oneway=True)
            return lease

        return _then(reply, finish)

    def ahead(self, key: str, timeout: float | None = None) -> int | None:
        """For :mod:`clone.recipes`: how many lock contenders the active server
        has ahead of our key ``key`` (None: the key is gone), for a client
        that may not read its lock's prefix (docs/protocol.md, "ahead")."""
        reply = self.call(OP_AHEAD, new_uuid(), key, (), b"", timeout, f"the queue of {key!r}")
        if reply.status == "conflict":
            return None
        if not reply.ok or reply.ahead is None:
            raise refusal(reply.reason or "malformed", key)
        return reply.ahead

    def lease_arg(self, lease: Lease | str | None) -> tuple[Lease | None, str | None]:
        """The lease a write binds its key to (ours, if we hold it) and its id."""
        if lease is None:
            return None, None
        if isinstance(lease, Lease):
            if not lease.alive:
                raise LeaseLost(lease.id, lease.why or "revoked by this client")
            return lease, lease.id
        if not isinstance(lease, str):
            raise TypeError(f"lease must be a Lease or a lease id, not {type(lease).__name__}")
        if not valid_lease_id(lease):
            raise ValueError(f"lease id {lease[:40]!r} is not 32 lowercase hex digits")
        with self._client._shared:
            return self._client._leases.get(lease), lease

    def revoke_lease(self, lease: Lease, timeout: float | None) -> None:
        """For :meth:`Lease.revoke`: stop its keepalives and revoke it."""
        with self._client._shared:
            self._client._leases.pop(lease.id, None)
        reply = self.call(
            OP_LEASE_REVOKE,
            new_uuid(),
            "",
            lease_props(lease),
            b"",
            timeout,
            f"the revoke of lease {lease.id}",
        )
        if not reply.ok and reply.reason != "unknown-lease":  # gone already: done
            raise refusal(reply.reason, lease_key(lease.id))

    def revoke_all_leases(self) -> int:
        """For :meth:`close`: revoke every lease still held, all at once, for
        at most ``CLOSE_REVOKE_S``; a lease not revoked ends within its ttl.
        Returns how many were not revoked."""
        with self._client._shared:
            leases = [lease for lease in self._client._leases.values() if lease.alive]
            self._client._leases.clear()
        for lease in leases:
            lease._mark_ended()  # not kept alive any more, whatever happens next
        if not leases:
            return 0
        if self._client._pipe.stopped.is_set():
            return len(leases)
        budget = min(CLOSE_REVOKE_S, self._client.command_timeout)
        pending: list[Future[Reply]] = []
        for lease in leases:
            props = lease_props(lease)
            try:
                pending.append(
                    self.call_async(OP_LEASE_REVOKE, new_uuid(), "", props, b"", budget, "a revoke")
                )
            except CloneError as exc:
                log.info("could not revoke lease %s while closing: %s", lease.id, exc)
        done, not_done = futures_wait(pending, budget + 2 * DISPATCH_POLL_S)
        failed = len(not_done) + sum(1 for f in done if f.exception() is not None)
        if failed:
            log.info(
                "closing: %d of %d leases not revoked in time; they end within their ttl",
                failed,
                len(leases),
            )
        return failed

    def lease_lost(self, lease: Lease, why: str) -> None:
        with self._client._shared:
            self._client._leases.pop(lease.id, None)
        lease._mark_lost(why)

    def call(
        self,
        op: str,
        uuid: bytes,
        key: str,
        props: Properties,
        body: bytes,
        timeout: float | None,
        what: str,
    ) -> Reply:
        """Make a call and wait for its reply; NotActive if none in ``timeout``."""
        limit = self._client.confirm_timeout if timeout is None else timeout
        fut = self.call_async(op, uuid, key, props, body, limit, what)
        # The dispatcher fails the future at its deadline; the margin only
        # guards against a dispatcher that died.
        done, _ = futures_wait([fut], limit + 2 * DISPATCH_POLL_S + 1.0)
        if not done:
            self._client._waiters.discard(uuid)
            raise NotActive(self.not_active_text(what, limit))
        return fut.result()  # or NotActive, ClosedError, CloneError

    def call_async(
        self,
        op: str,
        uuid: bytes,
        key: str,
        props: Properties,
        body: bytes,
        timeout: float,
        what: str,
    ) -> Future[Reply]:
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        frames = encode_call(op, uuid, key, props, body)
        fut = self._client._waiters.add_call(uuid, what, timeout)
        try:
            self._client._send_oneway(verbs.CALL, [repr(float(timeout)).encode(), *frames])
        except BaseException:
            self._client._waiters.discard(uuid)
            raise
        return fut

    def not_active_text(self, what: str, timeout: float) -> str:
        return (
            f"no active server answered {what} within {timeout:g} s (servers: "
            f"{', '.join(self._client._servers) or 'none'}): both may be down, passive or "
            f"unreachable; if only the reply was lost the call may have been applied, "
            f"so read the key before trying again"
        )


def _then(fut: Future[Reply], finish: Callable[[Reply], T]) -> Future[T]:
    """A future for ``finish(reply)``, resolved in whichever thread resolves
    ``fut`` (the dispatcher's): no thread waits for it."""
    out: Future[T] = Future()
    out.set_running_or_notify_cancel()

    def done(inner: Future[Reply]) -> None:
        try:
            out.set_result(finish(inner.result()))
        except BaseException as exc:
            out.set_exception(exc)

    fut.add_done_callback(done)
    return out
