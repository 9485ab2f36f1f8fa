"""The application's side of a Clone client: a thin frontend over the agent thread.

:class:`Clone` owns a ``zmq.Context``, starts the agent (:mod:`clone.client.agent`) in a
thread and talks to it over two inproc PAIR pipes: a command pipe (strict
request/reply, one caller at a time, every wait bounded) and an event pipe the
agent writes to without ever blocking (confirmations, state changes, changes to
keys).  A small dispatcher thread reads the event pipe, so a thread waiting for a
confirmed write never holds the command pipe, and another thread runs the
``on_change`` callbacks, so a slow or re-entrant callback cannot stall the agent
or the confirmations.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import json
import logging
import marshal
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, Literal, overload

import zmq

from clone.argtypes import normalize_endpoint
from clone.client import agent as _agent
from clone.client.agent import Agent, split_endpoint
from clone.client.fsm import AgentConfig, AgentFSM, normalize_subtrees
from clone.client.history import HistoryFeed
from clone.client.leases import Lease
from clone.client.results import STOP, ChangeStream, Entry, Status, Watcher
from clone.errors import (
    CloneError,
    ClosedError,
    ConfirmTimeout,
    Conflict,
    LeaseLost,
    LimitExceeded,
    NotActive,
    NotSynced,
    ProtocolError,
    WriteRefused,
    refusal,
)
from clone.security import KeyPair, load_public, load_secret
from clone.wire.calls import (
    IF_SEQUENCE_PROPERTY,
    LEASE_PROPERTY,
    MIN_LEASE_TTL,
    OP_AHEAD,
    OP_LEASE_GRANT,
    OP_LEASE_REVOKE,
    OP_SET,
    SECRET_PROPERTY,
    Reply,
    decode_reply,
    encode_call,
    lease_id_of,
    lease_key,
    valid_lease_id,
    valid_secret,
)
from clone.wire.codec import (
    KVMsg,
    Properties,
    decode_kvset,
    encode_kv,
    new_uuid,
    validate_subtree,
)
from clone.wire.protocol import (
    DEFAULT_BACKUP_PORT,
    DEFAULT_PRIMARY_PORT,
    MAX_TTL_SECONDS,
    TTL_PROPERTY,
)

__all__ = [
    "ChangeStream",
    "Clone",
    "Entry",
    "Lease",
    "Status",
    "clone_set",
    "clone_get",
    "default_servers",
    "default_curve_files",
    "load_curve_keys",
    "DEFAULT_SERVERS",
]

log = logging.getLogger(__name__)

DEFAULT_SERVERS = (
    f"tcp://127.0.0.1:{DEFAULT_PRIMARY_PORT}",
    f"tcp://127.0.0.1:{DEFAULT_BACKUP_PORT}",
)
_ids = itertools.count(1)
# How often the event dispatcher wakes up at least (to fail overdue writes).
_DISPATCH_POLL_S = 0.1
# Commands queued for the agent at most; a writer that gets ahead waits.
_PIPE_HWM = 10_000
# What close() spends at most revoking the leases still held (best effort: a
# lease not revoked ends by itself within its ttl, as nobody keeps it alive).
_CLOSE_REVOKE_S = 2.0
_SEQ_LIMIT = 2**64


def default_servers() -> list[str]:
    """``$CLONE_SERVERS`` (comma-separated), else the local pair on 5556/5566."""
    env = os.environ.get("CLONE_SERVERS", "")
    servers = [s.strip() for s in env.split(",") if s.strip()]
    return servers or list(DEFAULT_SERVERS)


def default_curve_files() -> tuple[str | None, str | None]:
    """``($CLONE_CURVE_SECRET, $CLONE_SERVER_KEY)``, each None if unset or empty.

    Set both for CURVE (our secret certificate, the server's public one), or
    neither; one alone is refused by :class:`Clone`, as the arguments are.
    """
    secret = os.environ.get("CLONE_CURVE_SECRET", "").strip() or None
    server = os.environ.get("CLONE_SERVER_KEY", "").strip() or None
    return secret, server


def load_curve_keys(
    curve_secret: str | os.PathLike[str] | None,
    server_key: str | os.PathLike[str] | None,
) -> tuple[KeyPair, bytes] | None:
    """Our key pair and the server's public key, read once, here: a bad file
    is the caller's error now, not a handshake that silently never completes."""
    if curve_secret is None and server_key is None:
        return None
    if curve_secret is None or server_key is None:
        given, missing = (
            ("curve_secret", "server_key") if server_key is None else ("server_key", "curve_secret")
        )
        raise ValueError(
            f"{given} was given without {missing}: CURVE needs both this client's secret "
            f"certificate (curve_secret, $CLONE_CURVE_SECRET) and the server's public "
            f"certificate (server_key, $CLONE_SERVER_KEY); pass both, or neither for a "
            f"plain connection"
        )
    return load_secret(curve_secret), load_public(server_key)


def _as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"value must be bytes or str, not {type(value).__name__}")


def _format_ttl(ttl: float) -> str | None:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if ttl == 0:
        return None
    if not 0.001 <= ttl <= MAX_TTL_SECONDS:
        raise ValueError(f"ttl must be 0 (no expiry) or 0.001 .. {MAX_TTL_SECONDS:g} s")
    return f"{ttl:.3f}".rstrip("0").rstrip(".")


def _build(key: str, body: bytes, props: dict[str, str]) -> KVMsg:
    """Validate an application write; a bad key is misuse (ValueError), not wire trouble."""
    try:
        return KVMsg.build(key, body, uuid=new_uuid(), properties=props)
    except LimitExceeded:
        raise
    except ProtocolError as exc:
        raise ValueError(str(exc)) from None


def _format_lease_ttl(ttl: float) -> str:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not MIN_LEASE_TTL <= ttl <= MAX_TTL_SECONDS:  # also false for nan
        raise ValueError(
            f"a lease's ttl must be {MIN_LEASE_TTL:g} .. {MAX_TTL_SECONDS:g} s, not {ttl!r}"
        )
    return repr(float(ttl))


def _lease_props(lease: Lease) -> Properties:
    """A keepalive's or revoke's properties: the lease and its secret, if any."""
    if lease._secret:
        return ((LEASE_PROPERTY, lease.id), (SECRET_PROPERTY, lease._secret))
    return ((LEASE_PROPERTY, lease.id),)


def _check_if_sequence(if_sequence: int | None) -> int | None:
    if if_sequence is None:
        return None
    if isinstance(if_sequence, bool) or not isinstance(if_sequence, int):
        raise TypeError(
            f"if_sequence must be an int sequence (0: only if absent), "
            f"not {type(if_sequence).__name__}"
        )
    if not 0 <= if_sequence < _SEQ_LIMIT:
        raise ValueError(
            f"if_sequence must be a sequence in 0..2**64-1 (0: only if absent), not {if_sequence}"
        )
    return if_sequence


def _history_subtree(prefix: str, subtrees: Sequence[str]) -> str:
    """The subtree to ask the server's history for: ``prefix`` when it is one
    (the delta then holds only its keys), else our only subtree, else all."""
    try:
        validate_subtree(prefix.encode("utf-8"))
    except ProtocolError:
        return subtrees[0] if len(subtrees) == 1 else ""
    return prefix


def _entry(frames: Sequence[bytes]) -> Entry:
    msg = decode_kvset(frames)
    return Entry(msg.key, msg.body or None, msg.sequence, msg.properties)


class Clone:
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

    def __init__(
        self,
        servers: str | Sequence[str] | None = None,
        subtree: str | Iterable[str] | None = None,
        *,
        heartbeat: float = 1.0,
        server_timeout: float | None = None,
        confirm_timeout: float = 10.0,
        command_timeout: float = 5.0,
        curve_secret: str | os.PathLike[str] | None = None,
        server_key: str | os.PathLike[str] | None = None,
    ) -> None:
        curve = load_curve_keys(curve_secret, server_key)
        # An explicit server_timeout is the application's word for every server,
        # whatever heartbeat a server advertises.
        overrides: dict[str, Any] = (
            {}
            if server_timeout is None
            else {"server_timeout": server_timeout, "missed_heartbeats": None}
        )
        config = AgentConfig.from_heartbeat(heartbeat, **overrides)
        try:
            subtrees = normalize_subtrees(subtree)
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        self.confirm_timeout = confirm_timeout
        self.command_timeout = command_timeout
        # For changes(since=N), whose reader has sockets of its own.
        self._curve = curve
        self._subtrees = subtrees
        self._silence = config.server_timeout
        self._feeds: list[HistoryFeed] = []
        self._servers: list[str] = []
        self._closed = False
        self._lock = threading.Lock()  # the command pipe, one caller at a time
        self._rids = itertools.count(1)
        # Confirmed writes in flight: uuid -> future (the sequence), and their
        # deadlines (a heap), both resolved by the dispatcher thread.
        self._waiters: dict[bytes, Future[int]] = {}
        self._deadlines: list[tuple[float, bytes, str, float]] = []
        # Calls in flight, likewise: uuid -> future (the reply); the deadlines
        # say what was asked, for the NotActive message.
        self._call_waiters: dict[bytes, Future[Reply]] = {}
        self._call_deadlines: list[tuple[float, bytes, str, float]] = []
        # Leases granted to us and kept alive by the agent, by id.
        self._leases: dict[str, Lease] = {}
        self._watchers: list[Watcher] = []
        self._callbacks: list[Callable[[Entry], None]] = []
        self._callback_queue: queue.SimpleQueue[Entry | Callable[[], None] | object] | None = None
        self._callback_thread: threading.Thread | None = None
        self._shared = threading.Lock()  # waiters, watchers, callbacks, state
        self._state = "initial"
        self._active = threading.Event()
        self._stopped = threading.Event()
        self._dispatch_stop = False
        self._watching = False

        number = next(_ids)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            # Commands are bounded, so a writer cannot outrun the agent without
            # limit; events are not, so the agent never blocks on a slow reader.
            self._cmd = self._pipe_pair(f"inproc://clone-{number}-commands", _PIPE_HWM)
            self._evt = self._pipe_pair(f"inproc://clone-{number}-events")
            agent_cmd, agent_evt = self._cmd[1], self._evt[1]
            # Events must never block the agent; the dispatcher keeps up.
            fsm = AgentFSM(subtrees, config, now=time.monotonic())
            agent = Agent(self._ctx, agent_cmd, agent_evt, fsm, curve=curve)
            self._agent_thread = threading.Thread(
                target=agent.run, name=f"clone-agent-{number}", daemon=True
            )
            self._agent_thread.start()
            evt = self._evt[0]
            if not evt.poll(int(command_timeout * 1000)) or evt.recv() != _agent.STARTED:
                raise CloneError(f"the client agent did not start within {command_timeout:g} s")
            self._dispatcher = threading.Thread(
                target=self._dispatch, name=f"clone-events-{number}", daemon=True
            )
            self._dispatcher.start()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        if isinstance(servers, str):
            servers = [s.strip() for s in servers.split(",") if s.strip()]
        for endpoint in servers or ():
            self.connect(endpoint)

    def _pipe_pair(self, address: str, hwm: int = 0) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        front = self._ctx.socket(zmq.PAIR)
        back = self._ctx.socket(zmq.PAIR)
        for sock in (front, back):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
        if hwm:
            front.setsockopt(zmq.SNDTIMEO, max(1, int(self.command_timeout * 1000)))
        front.bind(address)
        back.connect(address)
        return front, back

    # ------------------------------------------------------------------
    # Lifecycle

    def __enter__(self) -> Clone:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Clone servers={self._servers!r} state={self._state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Revoke the leases still held (best effort, at most a couple of
        seconds), then stop the agent, join the threads, close every socket and
        the context."""
        if not self._closed:
            self._revoke_all_leases()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._stopped.is_set():
                    raise CloneError("the agent had already stopped")
                self._request_locked(_agent.TERMINATE, [], self.command_timeout)
            except CloneError as exc:
                log.warning("client agent did not acknowledge terminate: %s", exc)
        self._agent_thread.join(self.command_timeout)
        self._dispatch_stop = True
        self._dispatcher.join(self.command_timeout)
        with self._shared:
            waiters = list(self._waiters.values())
            self._waiters.clear()
            calls = list(self._call_waiters.values())
            self._call_waiters.clear()
            for watcher in self._watchers:
                watcher.queue.put(STOP)
            feeds, self._feeds = self._feeds, []
            if self._callback_queue is not None:
                self._callback_queue.put(STOP)
        for feed in feeds:
            feed.close(self.command_timeout)
        for fut in waiters:
            if not fut.done():
                fut.set_exception(
                    ClosedError("the client was closed while a write awaited confirmation")
                )
        for call in calls:
            if not call.done():
                call.set_exception(ClosedError("the client was closed while a call awaited"))
        if (
            self._callback_thread is not None
            and self._callback_thread is not threading.current_thread()
        ):
            self._callback_thread.join(self.command_timeout)
        self._cmd[0].close(linger=0)
        self._evt[0].close(linger=0)
        if self._agent_thread.is_alive() or self._dispatcher.is_alive():
            log.error("client threads did not stop; leaving the zmq context open")
            return
        self._ctx.term()

    # ------------------------------------------------------------------
    # Commands

    def _request(self, verb: bytes, args: list[bytes]) -> list[bytes]:
        with self._lock:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            return self._request_locked(verb, args, self.command_timeout)

    def _request_locked(self, verb: bytes, args: list[bytes], timeout: float) -> list[bytes]:
        pipe = self._cmd[0]
        rid = str(next(self._rids)).encode()
        try:
            pipe.send_multipart([verb, rid, *args])
        except zmq.Again:
            raise CloneError(
                f"the client agent did not take {verb.decode()} within {timeout:g} s"
            ) from None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not pipe.poll(max(1, int(remaining * 1000))):
                if self._stopped.is_set():
                    raise ClosedError("the client agent has stopped")
                raise CloneError(
                    f"the client agent did not answer {verb.decode()} within {timeout:g} s"
                )
            reply = pipe.recv_multipart()
            if len(reply) >= 2 and reply[1] == rid:
                break
            log.debug("dropped a late agent reply %r", reply[:2])
        if reply[0] != _agent.OK:
            text = reply[2].decode("utf-8", "replace") if len(reply) > 2 else "?"
            raise CloneError(f"client agent refused {verb.decode()}: {text}")
        return reply[2:]

    def _send_oneway(self, verb: bytes, args: list[bytes]) -> None:
        """A command the agent does not answer: writes stream without a round trip.

        The pipe is bounded (``_PIPE_HWM``), so an application that writes faster
        than the agent can send waits here, for at most ``command_timeout``.
        """
        with self._lock:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            try:
                self._cmd[0].send_multipart([verb, b"", *args])
            except zmq.Again:
                raise CloneError(
                    f"the client agent did not take {verb.decode()} within "
                    f"{self.command_timeout:g} s"
                ) from None

    def connect(self, endpoint: str) -> None:
        """Add a server by its CHP base endpoint, e.g. ``tcp://127.0.0.1:5556``
        (or ``127.0.0.1:5556``: tcp is the default).

        Servers are tried in the order they were added.
        """
        endpoint = normalize_endpoint(endpoint)
        split_endpoint(endpoint)
        self._request(_agent.CONNECT, [endpoint.encode()])
        self._servers.append(endpoint)

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
        body = _as_bytes(value)
        if not body:
            raise ValueError("an empty value means delete; call delete() instead")
        ttl_text = _format_ttl(ttl)
        props = {TTL_PROPERTY: ttl_text} if ttl_text is not None else {}
        if if_sequence is None and lease is None:
            return self._write(_build(key, body, props), wait, timeout)
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
            return self._write(_build(key, b"", {}), wait, timeout)
        return self._call_write(key, b"", {}, timeout, if_sequence, None)

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
        ttl_text = _format_lease_ttl(ttl)
        key = "" if for_key is None else _build(for_key, b"", {}).key
        uuid = new_uuid()
        # Ours, so that a retry of the grant (same uuid) proves the same owner.
        if secret is None:
            secret = secrets.token_hex(16)
        elif not valid_secret(secret):
            raise ValueError("a lease secret is 32 lowercase hex digits")
        asked = time.monotonic()  # the servers count its ttl from later than this
        reply = self._call(
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
            self, reply.lease or lease_id_of(uuid), reply.ttl or float(ttl), reply.secret or secret
        )
        lease._kept_until(asked + lease.ttl)
        with self._shared:
            self._leases[lease.id] = lease
        self._request(
            _agent.LEASE, [lease.id.encode(), repr(lease.ttl).encode(), lease._secret.encode()]
        )
        return lease

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
        _format_lease_ttl(ttl)  # the same bounds as a grant's
        lease = Lease(self, lease_id, float(ttl), secret)
        with self._shared:
            self._leases[lease.id] = lease
        self._request(
            _agent.LEASE, [lease.id.encode(), repr(lease.ttl).encode(), lease._secret.encode()]
        )
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
        """A set or delete as a call: compare-and-set, a key bound to a lease."""
        expected = _check_if_sequence(if_sequence)
        held, lease_id = self._lease_arg(lease)
        if expected is not None:
            props[IF_SEQUENCE_PROPERTY] = str(expected)
        if lease_id is not None:
            props[LEASE_PROPERTY] = lease_id
            if held is not None and held._secret:
                props[SECRET_PROPERTY] = held._secret
        msg = _build(key, body, props)
        what = f"the {'write' if body else 'delete'} of {key!r}"
        reply = self._call(OP_SET, msg.uuid, key, msg.properties, body, timeout, what)
        if reply.ok:
            return reply.sequence
        if reply.status == "conflict":
            raise Conflict(key, expected or 0, reply.current or 0)
        if reply.reason == "unknown-lease" and lease_id is not None:
            if held is not None:
                self._lease_lost(held, reply.detail or "unknown to the servers")
            raise LeaseLost(lease_id, reply.detail)
        raise refusal(reply.reason, key)

    def _ahead(self, key: str, timeout: float | None = None) -> int | None:
        """For :mod:`clone.recipes`: how many lock contenders the active server
        has ahead of our key ``key`` (None: the key is gone), for a client
        that may not read its lock's prefix (docs/protocol.md, "ahead")."""
        reply = self._call(OP_AHEAD, new_uuid(), key, (), b"", timeout, f"the queue of {key!r}")
        if reply.status == "conflict":
            return None
        if not reply.ok or reply.ahead is None:
            raise refusal(reply.reason or "malformed", key)
        return reply.ahead

    def _lease_arg(self, lease: Lease | str | None) -> tuple[Lease | None, str | None]:
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
        with self._shared:
            return self._leases.get(lease), lease

    def _revoke_lease(self, lease: Lease, timeout: float | None) -> None:
        """For :meth:`Lease.revoke`: stop its keepalives and revoke it."""
        with self._shared:
            self._leases.pop(lease.id, None)
        reply = self._call(
            OP_LEASE_REVOKE,
            new_uuid(),
            "",
            _lease_props(lease),
            b"",
            timeout,
            f"the revoke of lease {lease.id}",
        )
        if not reply.ok and reply.reason != "unknown-lease":  # gone already: done
            raise refusal(reply.reason, lease_key(lease.id))

    def _revoke_all_leases(self) -> None:
        """For :meth:`close`: revoke every lease still held, all at once, for
        at most ``_CLOSE_REVOKE_S``; a lease not revoked ends within its ttl."""
        with self._shared:
            leases = [lease for lease in self._leases.values() if lease.alive]
            self._leases.clear()
        for lease in leases:
            lease._mark_ended()  # not kept alive any more, whatever happens next
        if not leases or self._stopped.is_set():
            return
        budget = min(_CLOSE_REVOKE_S, self.command_timeout)
        pending: list[Future[Reply]] = []
        for lease in leases:
            props = _lease_props(lease)
            try:
                pending.append(
                    self._call_async(
                        OP_LEASE_REVOKE, new_uuid(), "", props, b"", budget, "a revoke"
                    )
                )
            except CloneError as exc:
                log.info("could not revoke lease %s while closing: %s", lease.id, exc)
        done, not_done = futures_wait(pending, budget + 2 * _DISPATCH_POLL_S)
        failed = len(not_done) + sum(1 for f in done if f.exception() is not None)
        if failed:
            log.info(
                "closing: %d of %d leases not revoked in time; they end within their ttl",
                failed,
                len(leases),
            )

    def _lease_lost(self, lease: Lease, why: str) -> None:
        with self._shared:
            self._leases.pop(lease.id, None)
        lease._mark_lost(why)

    def _call(
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
        limit = self.confirm_timeout if timeout is None else timeout
        fut = self._call_async(op, uuid, key, props, body, limit, what)
        # The dispatcher fails the future at its deadline; the margin only
        # guards against a dispatcher that died.
        done, _ = futures_wait([fut], limit + 2 * _DISPATCH_POLL_S + 1.0)
        if not done:
            with self._shared:
                self._call_waiters.pop(uuid, None)
            raise NotActive(self._not_active_text(what, limit))
        return fut.result()  # or NotActive, ClosedError, CloneError

    def _call_async(
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
        fut: Future[Reply] = Future()
        fut.set_running_or_notify_cancel()
        with self._shared:
            self._call_waiters[uuid] = fut
            heapq.heappush(self._call_deadlines, (time.monotonic() + timeout, uuid, what, timeout))
        try:
            self._send_oneway(_agent.CALL, [repr(float(timeout)).encode(), *frames])
        except BaseException:
            with self._shared:
                self._call_waiters.pop(uuid, None)
            raise
        return fut

    def _not_active_text(self, what: str, timeout: float) -> str:
        return (
            f"no active server answered {what} within {timeout:g} s (servers: "
            f"{', '.join(self._servers) or 'none'}): both may be down, passive or "
            f"unreachable; if only the reply was lost the call may have been applied, "
            f"so read the key before trying again"
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
        body = _as_bytes(value)
        if not body:
            raise ValueError("an empty value means delete; call delete_async() instead")
        ttl_text = _format_ttl(ttl)
        props = {TTL_PROPERTY: ttl_text} if ttl_text is not None else {}
        return self._write_async(_build(key, body, props), timeout)

    def delete_async(self, key: str, *, timeout: float | None = None) -> Future[int]:
        """Delete ``key``; the future resolves as for :meth:`set_async`."""
        return self._write_async(_build(key, b"", {}), timeout)

    def _write(self, msg: KVMsg, wait: bool, timeout: float | None) -> int | None:
        if not wait:
            self._send_oneway(_agent.SET, [b"", *encode_kv(msg)])
            return None
        fut = self._write_async(msg, timeout)
        limit = self.confirm_timeout if timeout is None else timeout
        # The dispatcher fails the future at its deadline; the margin only guards
        # against a dispatcher that died.
        done, _ = futures_wait([fut], limit + 2 * _DISPATCH_POLL_S + 1.0)
        if not done:
            with self._shared:
                self._waiters.pop(msg.uuid, None)
            raise ConfirmTimeout(self._timeout_text(msg.key, limit))
        return fut.result()  # or raises ConfirmTimeout, WriteRefused or ClosedError

    def _write_async(self, msg: KVMsg, timeout: float | None) -> Future[int]:
        timeout = self.confirm_timeout if timeout is None else timeout
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        fut: Future[int] = Future()
        fut.set_running_or_notify_cancel()
        with self._shared:
            self._waiters[msg.uuid] = fut
            heapq.heappush(
                self._deadlines, (time.monotonic() + timeout, msg.uuid, msg.key, timeout)
            )
        try:
            self._send_oneway(_agent.SET, [repr(float(timeout)).encode(), *encode_kv(msg)])
        except BaseException:
            with self._shared:
                self._waiters.pop(msg.uuid, None)
            raise
        return fut

    def _write_replied(self, write: Future[int], reply: Reply) -> None:
        """The REPLY to a confirmed write sent as a call (restricted mode)."""
        if reply.ok:
            write.set_result(reply.sequence)
            return
        with self._shared:
            key = next((d[2] for d in self._deadlines if d[1] == reply.uuid), "?")
        write.set_exception(refusal(reply.reason or reply.status, key))

    def _timeout_text(self, key: str, timeout: float) -> str:
        return (
            f"write to {key!r} was not confirmed by the active server within "
            f"{timeout:g} s (servers: {', '.join(self._servers) or 'none'})"
        )

    def _expire_waiters(self) -> float:
        """Fail the confirmed writes and calls past their deadline; return
        seconds to the next."""
        now = time.monotonic()
        expired: list[tuple[Future[int], str, float]] = []
        unanswered: list[tuple[Future[Reply], str, float]] = []
        with self._shared:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, uuid, key, timeout = heapq.heappop(self._deadlines)
                fut = self._waiters.pop(uuid, None)
                if fut is not None:
                    expired.append((fut, key, timeout))
            while self._call_deadlines and self._call_deadlines[0][0] <= now:
                _, uuid, what, timeout = heapq.heappop(self._call_deadlines)
                call = self._call_waiters.pop(uuid, None)
                if call is not None:
                    unanswered.append((call, what, timeout))
            heads = [d[0][0] for d in (self._deadlines, self._call_deadlines) if d]
            nxt = min(heads, default=now + _DISPATCH_POLL_S)
        for fut, key, timeout in expired:
            if not fut.done():
                fut.set_exception(ConfirmTimeout(self._timeout_text(key, timeout)))
        for call, what, timeout in unanswered:
            if not call.done():
                call.set_exception(NotActive(self._not_active_text(what, timeout)))
        return min(nxt - now, _DISPATCH_POLL_S)

    def get(self, key: str, default: bytes | None = None) -> bytes | None:
        """The value of ``key`` in our replica, or ``default``."""
        entry = self.entry(key)
        return default if entry is None else entry.value

    def entry(self, key: str) -> Entry | None:
        """``key`` with its sequence and properties, or None."""
        if not isinstance(key, str):
            raise TypeError(f"key must be str, not {type(key).__name__}")
        reply = self._request(_agent.GET, [key.encode("utf-8")])
        return _entry(reply) if reply else None

    def entries(self, prefix: str = "") -> list[Entry]:
        """Every entry whose key starts with ``prefix``, sorted by key."""
        return [Entry(k, body, seq, props) for k, (seq, _, props, body) in self._rows(prefix)]

    def items(self, prefix: str = "") -> list[tuple[str, bytes]]:
        """``(key, value)`` for every key starting with ``prefix``, sorted by key."""
        return [(k, row[3]) for k, row in self._rows(prefix)]

    def _rows(self, prefix: str) -> list[tuple[str, tuple[int, bytes, Properties, bytes]]]:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, not {type(prefix).__name__}")
        reply = self._request(_agent.ITEMS, [prefix.encode("utf-8")])
        # One marshal frame from our own agent thread, never from the network.
        rows: list[tuple[str, tuple[int, bytes, Properties, bytes]]] = marshal.loads(reply[0])
        return rows

    def status(self) -> Status:
        raw = json.loads(self._request(_agent.STATUS, [])[0])
        return Status(
            state=raw["state"],
            server=raw["server"],
            sequence=raw["sequence"],
            keys=raw["keys"],
            pending_writes=raw["pending_writes"],
            pending_calls=raw["pending_calls"],
            leases=raw["leases"],
            servers=tuple(raw["servers"]),
            subtrees=tuple(raw["subtrees"]),
            counters=raw["counters"],
        )

    def wait_synced(self, timeout: float = 10.0) -> None:
        """Block until the client holds a complete snapshot, or raise NotSynced."""
        if self._active.wait(timeout):
            return
        if self._closed:
            raise ClosedError("this Clone client is closed")
        tried = ", ".join(self._servers) or "no servers configured"
        raise NotSynced(
            f"no server answered a snapshot request within {timeout:g} s: tried {tried}"
        )

    # ------------------------------------------------------------------
    # Changes

    def on_change(self, callback: Callable[[Entry], None]) -> None:
        """Call ``callback(entry)`` for every change to a key in our subtrees.

        Callbacks run one at a time in this client's callback thread (named
        ``clone-callbacks-N``), never in the agent thread, so they may call this
        client, even a confirmed ``set``.  Exceptions are logged and swallowed.
        Only changes after registration are reported; a resync reports the keys
        that differ from what we held.
        """
        if not callable(callback):
            raise TypeError("callback must be callable")
        with self._shared:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            self._callbacks.append(callback)
            self._callbacks_started()
        self._watch()

    def _callbacks_started(self) -> queue.SimpleQueue[Entry | Callable[[], None] | object]:
        """The callback thread's queue, the thread started if need be (hold ``_shared``)."""
        if self._callback_queue is None:
            self._callback_queue = queue.SimpleQueue()
            self._callback_thread = threading.Thread(
                target=self._run_callbacks,
                args=(self._callback_queue,),
                name=self._dispatcher.name.replace("events", "callbacks"),
                daemon=True,
            )
            self._callback_thread.start()
        return self._callback_queue

    def _run_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the callback thread (a lease's ``on_lost`` callbacks)."""
        with self._shared:
            if self._closed:
                log.debug("client closed: callback %r not run", fn)
                return
            self._callbacks_started().put(fn)

    def changes(
        self, timeout: float | None = None, prefix: str = "", *, since: int | None = None
    ) -> ChangeStream:
        """An iterator over changes (deleted keys have ``value`` None) as they happen.

        It is registered when this call returns, so a change that arrives before
        the first ``next()`` is not lost.  It ends ``timeout`` seconds after this
        call (None: when the client closes) or when closed; close it (or use it
        as a context manager) to stop queueing changes for it.

        ``since=N`` first replays every change after sequence N from the active
        server's update history, then goes on with the live ones, with no gap
        and no duplicate (a reader with its own sockets: :mod:`clone.client.history`).
        Iterating raises :class:`~clone.errors.HistoryCompacted` if the history
        no longer reaches back to N.
        """
        if since is None:
            return ChangeStream(self, timeout, prefix)
        if isinstance(since, bool) or not isinstance(since, int):
            raise TypeError(f"since must be an int sequence, not {type(since).__name__}")
        if not 0 <= since < 2**64:
            raise ValueError(f"since must be a sequence in 0..2**64-1, not {since}")
        with self._shared:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            servers = list(self._servers)
        if not servers:
            raise ValueError("changes(since=...) needs a server: connect() one first")
        feed = HistoryFeed(
            servers,
            since,
            subtree=_history_subtree(prefix, self._subtrees),
            prefixes=self._subtrees,
            silence=self._silence,
            curve=self._curve,
        )
        with self._shared:
            self._feeds = [f for f in self._feeds if not f.stopped]
            self._feeds.append(feed)
        return ChangeStream(feed, timeout, prefix)

    def _add_watcher(self, watcher: Watcher) -> None:
        with self._shared:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            self._watchers = [w for w in self._watchers if not w.closed]
            self._watchers.append(watcher)
        self._watch()

    def _remove_watcher(self, watcher: Watcher) -> None:
        watcher.closed = True
        with self._shared:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def _watch(self) -> None:
        if not self._watching:
            self._request(_agent.WATCH, [b"1"])
            self._watching = True

    # ------------------------------------------------------------------
    # Threads

    def _dispatch(self) -> None:
        """Event pipe reader: confirmations, state, changes.  Never runs user code."""
        evt = self._evt[0]
        while not self._dispatch_stop:
            wait = self._expire_waiters()
            try:
                if not evt.poll(max(1, int(wait * 1000))):
                    continue
                frames = evt.recv_multipart()
            except zmq.ZMQError as exc:
                log.error("client event pipe failed: %s", exc)
                break
            kind = frames[0]
            if kind == _agent.CONFIRMED:
                with self._shared:
                    waiter = self._waiters.pop(frames[1], None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(int.from_bytes(frames[2], "big"))
            elif kind == _agent.REPLY:
                with self._shared:
                    call = self._call_waiters.pop(frames[1], None)
                    write = None if call is not None else self._waiters.pop(frames[1], None)
                if call is not None and not call.done():
                    call.set_result(decode_reply(frames[2:]))  # the agent's own encoding
                elif write is not None and not write.done():
                    # A confirmed write of a restricted client, made as a call.
                    self._write_replied(write, decode_reply(frames[2:]))
            elif kind == _agent.LEASEKEPT:
                with self._shared:
                    kept = self._leases.get(frames[1].decode("ascii", "replace"))
                if kept is not None:
                    kept._kept_until(float(frames[2]))
            elif kind == _agent.LEASELOST:
                lease_id, why = (f.decode("utf-8", "replace") for f in frames[1:3])
                with self._shared:
                    lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    lease._mark_lost(why)
            elif kind == _agent.FAILED:
                text = frames[2].decode("utf-8", "replace")
                with self._shared:
                    failed: Future[int] | Future[Reply] | None = self._waiters.pop(frames[1], None)
                    if failed is None:
                        failed = self._call_waiters.pop(frames[1], None)
                if failed is not None and not failed.done():
                    failed.set_exception(CloneError(f"client agent refused the write: {text}"))
                else:
                    log.warning("client agent refused a write: %s", text)
            elif kind == _agent.REFUSED:
                reason, key = (f.decode("utf-8", "replace") for f in frames[2:4])
                with self._shared:
                    waiter = self._waiters.pop(frames[1], None)
                if waiter is not None and not waiter.done():
                    waiter.set_exception(WriteRefused(reason, key))
            elif kind == _agent.CHANGE:
                change = _entry(frames[1:])
                with self._shared:
                    for watcher in self._watchers:
                        if not watcher.closed:
                            watcher.queue.put(change)
                    if self._callback_queue is not None:
                        self._callback_queue.put(change)
            elif kind == _agent.STATE:
                self._state = frames[1].decode()
                if self._state == "active":
                    self._active.set()
                else:
                    self._active.clear()
            elif kind == _agent.STOPPED:
                self._stopped.set()
                break
        self._active.clear()

    def _run_callbacks(self, q: queue.SimpleQueue[Entry | Callable[[], None] | object]) -> None:
        while True:
            item = q.get()
            if item is STOP:
                return
            if not isinstance(item, Entry):
                assert callable(item)
                try:
                    item()
                except Exception:
                    log.exception("callback %r failed", item)
                continue
            with self._shared:
                callbacks = list(self._callbacks)
            for callback in callbacks:
                try:
                    callback(item)
                except Exception:
                    log.exception("on_change callback %r failed for key %r", callback, item.key)


# --------------------------------------------------------------------------
# One default client per process, for scripts.

_default: Clone | None = None
_default_lock = threading.Lock()


def _default_client() -> Clone:
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            secret, server_key = default_curve_files()
            _default = Clone(default_servers(), curve_secret=secret, server_key=server_key)
        return _default


def _close_default() -> None:
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
            _default = None


atexit.register(_close_default)


def clone_set(key: str, value: bytes | str, ttl: float = 0, *, timeout: float = 10.0) -> None:
    """A confirmed write through the default client (``$CLONE_SERVERS``, and
    ``$CLONE_CURVE_SECRET`` / ``$CLONE_SERVER_KEY`` for CURVE)."""
    client = _default_client()
    client.set(key, value, ttl, wait=True, timeout=timeout)


def clone_get(key: str, default: bytes | None = None, *, timeout: float = 10.0) -> bytes | None:
    """Read ``key`` from the default client (configured as for :func:`clone_set`),
    waiting up to ``timeout`` for its first sync."""
    client = _default_client()
    client.wait_synced(timeout)
    return client.get(key, default)
