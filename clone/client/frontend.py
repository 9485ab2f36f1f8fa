"""The application's side of a Clone client: a thin frontend over the agent thread.

:class:`Clone` is three layers, one module each, so that each duty can be read
on its own: :class:`~clone.client.handle.ClientHandle` starts and stops the
agent, its pipes and the dispatcher and callback threads; :class:`~clone.client.reads.Reads`
adds the reads from the replica and the streams of changes; :class:`Clone`
here adds the writes (fire-and-forget, confirmed, asynchronous) and the calls
(compare-and-set, leases), which :mod:`clone.client.calling` makes.  The waiters
with deadlines and the event dispatcher are :mod:`clone.client.events`; CURVE
keys are loaded by :mod:`clone.security.keys` (re-exported here, as is the
default client of :mod:`clone.client.default`).
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, Literal, overload

from clone.client import verbs
from clone.client.args import as_bytes, build, format_lease_ttl, format_ttl, to_json
from clone.client.events import DISPATCH_POLL_S, Subscription
from clone.client.handle import _close_live as _close_live
from clone.client.handle import _live as _live
from clone.client.leases import Lease
from clone.client.reads import Reads
from clone.client.results import ChangeStream, CloseReport, Entry, Freshness, Status
from clone.errors import ConfirmTimeout
from clone.security.keys import default_curve_files, load_curve_keys
from clone.wire.calls import valid_lease_id
from clone.wire.codec import KVMsg, encode_kv
from clone.wire.protocol import TTL_PROPERTY

__all__ = [
    "ChangeStream",
    "Clone",
    "CloseReport",
    "Entry",
    "Freshness",
    "Lease",
    "Status",
    "Subscription",
    "clone_set",
    "clone_get",
    "default_servers",
    "default_curve_files",
    "load_curve_keys",
    "DEFAULT_SERVERS",
]


class Clone(Reads):
    """A client of one Clone server pair, holding a replica of (part of) the map.

    ``servers`` are the CHP base endpoints in failover order (a list, or one
    comma-separated string); ``subtree`` one subtree or several (``/a/``, ``/b/``),
    or None for the whole map.  ``heartbeat`` is the heartbeat to assume of a
    server that does not advertise its own in its HUGZ (the Guide's); the server
    timeout defaults to 2.5 of those.  A server that advertises (ours do) is
    declared dead after 4 of its own heartbeats of silence, unless
    ``server_timeout`` is given: then that applies to every server.  Use it as a context
    manager, or call :meth:`close`.  Methods may be called from any thread.

    ``curve_secret`` (this client's ``NAME.key_secret``) and ``server_key`` (the
    server pair's public certificate) make every connection CURVE-encrypted and
    authenticated; both or neither.  They are read here, once: a missing or bad
    file raises :class:`~clone.errors.SecurityError` from the constructor.  A
    server that limits what this client may read sends it a filtered stream
    (restricted mode, docs/client.md); one that refuses a confirmed write makes
    it raise :class:`~clone.errors.WriteRefused`.
    """

    # How the result is typed: None for a fire-and-forget write, the sequence
    # (an int) for a confirmed one and for every call (if_sequence, lease).
    @overload
    def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = ...,
        *,
        wait: Literal[False] = ...,
        timeout: float | None = ...,
        if_sequence: None = ...,
        lease: None = ...,
    ) -> None: ...

    @overload
    def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = ...,
        *,
        wait: Literal[True],
        timeout: float | None = ...,
        if_sequence: int | None = ...,
        lease: Lease | str | None = ...,
    ) -> int: ...

    @overload
    def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = ...,
        *,
        wait: bool = ...,
        timeout: float | None = ...,
        if_sequence: int,
        lease: Lease | str | None = ...,
    ) -> int: ...

    @overload
    def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = ...,
        *,
        wait: bool = ...,
        timeout: float | None = ...,
        if_sequence: int | None = ...,
        lease: Lease | str,
    ) -> int: ...

    @overload
    def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = ...,
        *,
        wait: bool = ...,
        timeout: float | None = ...,
        if_sequence: int | None = ...,
        lease: Lease | str | None = ...,
    ) -> int | None: ...

    def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = 0,
        *,
        wait: bool = False,
        timeout: float | None = None,
        if_sequence: int | None = None,
        lease: Lease | str | None = None,
    ) -> int | None:
        """Publish ``key = value`` to every server; ``ttl`` seconds, 0 = forever.

        With ``wait=True`` return the sequence the active server gave the
        write, once it has republished this very update (so a following
        :meth:`get` sees it), or raise :class:`~clone.errors.ConfirmTimeout`
        after ``timeout`` (default ``confirm_timeout``), or
        :class:`~clone.errors.WriteRefused` as soon as the server says it
        refused the write (its ACL, a full store).  Without it, the write is
        fire-and-forget (None) and shows up in :meth:`get` when the server's
        update arrives.

        ``if_sequence=N`` writes only if the key is still at sequence ``N``
        (an :attr:`Entry.sequence <clone.Entry.sequence>` you read; 0: only if
        the key is absent), else raises :class:`~clone.errors.Conflict`.
        ``lease`` (a :class:`Lease` or a lease id) binds the key to a lease:
        it is deleted when the lease ends; :class:`~clone.errors.LeaseLost` if
        the lease is gone.  Either makes the write a call answered by the
        active server: it always waits (``wait`` is implied) and returns the
        sequence, or raises :class:`~clone.errors.NotActive` if no active
        server answered within ``timeout``.
        """
        body = as_bytes(value)
        if not body:
            raise ValueError("an empty value means delete; call delete() instead")
        ttl_text = format_ttl(ttl)
        props = {TTL_PROPERTY: ttl_text} if ttl_text is not None else {}
        if if_sequence is None and lease is None:
            return self._write(build(key, body, props), wait, timeout)
        return self._call_write(key, body, props, timeout, if_sequence, lease)

    @overload
    def delete(
        self,
        key: str,
        *,
        wait: Literal[False] = ...,
        timeout: float | None = ...,
        if_sequence: None = ...,
    ) -> None: ...

    @overload
    def delete(
        self,
        key: str,
        *,
        wait: Literal[True],
        timeout: float | None = ...,
        if_sequence: int | None = ...,
    ) -> int: ...

    @overload
    def delete(
        self, key: str, *, wait: bool = ..., timeout: float | None = ..., if_sequence: int
    ) -> int: ...

    @overload
    def delete(
        self,
        key: str,
        *,
        wait: bool = ...,
        timeout: float | None = ...,
        if_sequence: int | None = ...,
    ) -> int | None: ...

    def delete(
        self,
        key: str,
        *,
        wait: bool = False,
        timeout: float | None = None,
        if_sequence: int | None = None,
    ) -> int | None:
        """Delete ``key`` on the servers (``wait``, ``if_sequence`` and the
        result as for :meth:`set`; deleting an absent key is a write too)."""
        if if_sequence is None:
            return self._write(build(key, b"", {}), wait, timeout)
        return self._call_write(key, b"", {}, timeout, if_sequence, None)

    def set_json(
        self,
        key: str,
        value: Any,
        ttl: float = 0,
        *,
        wait: bool = False,
        timeout: float | None = None,
        if_sequence: int | None = None,
        lease: Lease | str | None = None,
    ) -> int | None:
        """:meth:`set` with ``value`` as a JSON document (compact, UTF-8);
        :class:`~clone.errors.NotJSON` for a value that JSON cannot hold."""
        body = to_json(value)
        return self.set(
            key, body, ttl, wait=wait, timeout=timeout, if_sequence=if_sequence, lease=lease
        )

    def set_async(
        self, key: str, value: bytes | str, ttl: float = 0, *, timeout: float | None = None
    ) -> Future[int]:
        """A confirmed write that does not block: the future resolves to its
        sequence when the active server has republished it, or fails with
        ConfirmTimeout after ``timeout`` (WriteRefused at once if the server
        refuses it).

        This is how a bulk loader keeps many writes in flight from one thread.
        """
        body = as_bytes(value)
        if not body:
            raise ValueError("an empty value means delete; call delete_async() instead")
        ttl_text = format_ttl(ttl)
        props = {TTL_PROPERTY: ttl_text} if ttl_text is not None else {}
        return self._write_async(build(key, body, props), timeout)

    def delete_async(self, key: str, *, timeout: float | None = None) -> Future[int]:
        """Delete ``key``; the future resolves as for :meth:`set_async`."""
        return self._write_async(build(key, b"", {}), timeout)

    def _write(self, msg: KVMsg, wait: bool, timeout: float | None) -> int | None:
        if not wait:
            self._send_oneway(verbs.SET, [b"", *encode_kv(msg)])
            return None
        fut = self._write_async(msg, timeout)
        limit = self.confirm_timeout if timeout is None else timeout
        # The dispatcher fails the future at its deadline; the margin only guards
        # against a dispatcher that died.
        done, _ = futures_wait([fut], limit + 2 * DISPATCH_POLL_S + 1.0)
        if not done:
            self._waiters.discard(msg.uuid)
            raise ConfirmTimeout(self._timeout_text(msg.key, limit))
        return fut.result()  # or raises ConfirmTimeout, WriteRefused or ClosedError

    def _write_async(self, msg: KVMsg, timeout: float | None) -> Future[int]:
        timeout = self.confirm_timeout if timeout is None else timeout
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        fut = self._waiters.add_write(msg.uuid, msg.key, timeout)
        try:
            self._send_oneway(verbs.SET, [repr(float(timeout)).encode(), *encode_kv(msg)])
        except BaseException:
            self._waiters.discard(msg.uuid)
            raise
        return fut

    def lease(
        self,
        ttl: float = 2.0,
        *,
        timeout: float | None = None,
        for_key: str | None = None,
        secret: str | None = None,
    ) -> Lease:
        """A new lease of ``ttl`` seconds (0.3 s to one year), kept alive by
        this client until revoked, lost or the client closes.

        Keys written with ``set(..., lease=lease)`` are deleted when it ends.
        The agent sends a keepalive every ``ttl / 3`` to the active server,
        also across a failover; if the servers say the lease is gone, the
        lease is marked lost (:attr:`Lease.alive`, :meth:`Lease.on_lost`).

        ``for_key``: the key the lease is for, when the caller knows it (a
        lock's contender key).  The grant carries it, so that a server with
        an ACL grants the lease only if this client may write that key, and
        a refusal comes before anything was written: without it, the grant
        needs only the right to write *some* key, the lease key is
        published, and the refusal comes with the write that follows.  It
        does not bind the key to the lease: ``set(..., lease=lease)`` does.

        Raises :class:`~clone.errors.NotActive` if no active server answered
        within ``timeout`` (default ``confirm_timeout``), and
        :class:`~clone.errors.WriteRefused` if the server refused (``busy``:
        it holds ``--max-leases`` leases; ``acl``: this client may not write
        ``for_key``, or without it, may write nothing; ``reserved``:
        ``for_key`` is under ``/_clone/lease/``), and :class:`ValueError` for
        a ``for_key`` that is not a key.

        ``secret``: the proof of ownership to use (32 lowercase hex digits)
        instead of a fresh random one, for a caller that hands the lease to
        other processes (``clone lease grant``; :meth:`adopt_lease`).
        """
        return self._caller.grant(ttl, timeout, for_key, secret)

    def adopt_lease(self, lease_id: str, ttl: float, *, secret: str = "") -> Lease:
        """Keep alive a lease granted elsewhere (another process: ``clone lease
        keep-alive``), proving ownership with its ``secret`` ("" under CURVE,
        where the certificate is the proof).

        The lease is then this client's like one it was granted: kept alive
        every ``ttl / 3``, reported lost if a server says it is gone
        (``not-owner`` for a wrong secret), revoked by :meth:`close` unless
        revoked or lost before.  Raises ValueError for a malformed id.
        """
        if not valid_lease_id(lease_id):
            raise ValueError(f"lease id {lease_id[:40]!r} is not 32 lowercase hex digits")
        format_lease_ttl(ttl)  # the same bounds as a grant's
        lease = Lease(self, lease_id, float(ttl), secret)
        self._caller.keep(lease)
        return lease

    def _call_write(
        self,
        key: str,
        body: bytes,
        props: dict[str, str],
        timeout: float | None,
        if_sequence: int | None,
        lease: Lease | str | None,
    ) -> int:
        return self._caller.call_write(key, body, props, timeout, if_sequence, lease)

    def _ahead(self, key: str, timeout: float | None = None) -> int | None:
        """For :mod:`clone.recipes`: how many lock contenders are ahead of ``key``."""
        return self._caller.ahead(key, timeout)



# The default client (clone_set, clone_get) lives in clone.client.default;
# imported last, as it builds a Clone.
from clone.client.default import (  # noqa: E402
    DEFAULT_SERVERS,
    clone_get,
    clone_set,
    default_servers,
)
