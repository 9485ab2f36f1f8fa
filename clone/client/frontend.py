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
import itertools
import json
import logging
import marshal
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, Literal, overload

import zmq

from clone.argtypes import normalize_endpoint
from clone.client import agent as _agent
from clone.client import verbs
from clone.client.agent import Agent, split_endpoint
from clone.client.args import (
    as_bytes,
    build,
    format_lease_ttl,
    format_ttl,
    from_json,
    history_subtree,
    to_json,
)
from clone.client.calling import Caller
from clone.client.events import (
    DISPATCH_POLL_S,
    Callbacks,
    Dispatcher,
    Subscription,
    Waiters,
)
from clone.client.fsm import AgentConfig, AgentFSM, normalize_subtrees
from clone.client.history import HistoryFeed
from clone.client.leases import Lease
from clone.client.pipe import CommandPipe
from clone.client.results import ChangeStream, CloseReport, Entry, Freshness, Status, Watcher
from clone.errors import (
    AgentTimeout,
    CloneError,
    ClosedError,
    ConfirmTimeout,
    NotSynced,
    ProtocolError,
    SplitConflict,
)
from clone.security.keys import default_curve_files, load_curve_keys
from clone.wire.calls import valid_lease_id
from clone.wire.codec import (
    KVMsg,
    Properties,
    encode_kv,
)
from clone.wire.protocol import (
    TTL_PROPERTY,
)

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

log = logging.getLogger(__name__)


_ids = itertools.count(1)
# ITEMS: the agent's time per key held, on top of command_timeout.  Sorting and
# packing a million rows is a few seconds; on a 2-core machine shared with other
# work it overran the 5 s default.  20 us per key is +20 s at 1M.
_ITEMS_SECONDS_PER_KEY = 20e-6


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
        config = AgentConfig.from_heartbeat(heartbeat, freeze_gap=_agent.FREEZE_GAP, **overrides)
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
        # Confirmed writes and calls in flight, resolved by the dispatcher thread.
        self._waiters = Waiters(self._timeout_text, self._not_active_text)
        self._caller = Caller(self)
        # Leases granted to us and kept alive by the agent, by id.
        self._leases: dict[str, Lease] = {}
        self._shared = threading.Lock()  # leases, feeds
        self._watching = False
        #: What close() dropped (None until closed).
        self.close_report: CloseReport | None = None

        number = next(_ids)
        self._callbacks = Callbacks(f"clone-callbacks-{number}")
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self._pipe = CommandPipe(self._ctx, number, command_timeout)
            agent_cmd, agent_evt = self._pipe.commands[1], self._pipe.events[1]
            # Events must never block the agent; the dispatcher keeps up.
            fsm = AgentFSM(subtrees, config, now=time.monotonic())
            # Read from the frontend's threads only through peek() and heard_at.
            self._fsm = fsm
            agent = Agent(self._ctx, agent_cmd, agent_evt, fsm, curve=curve)
            self._agent_thread = threading.Thread(
                target=agent.run, name=f"clone-agent-{number}", daemon=True
            )
            self._agent_thread.start()
            evt = self._pipe.events[0]
            if not evt.poll(int(command_timeout * 1000)) or evt.recv() != verbs.STARTED:
                raise AgentTimeout(f"the client agent did not start within {command_timeout:g} s")
            self._events = Dispatcher(
                evt,
                self._waiters,
                self._callbacks,
                self._leases,
                self._shared,
                self._pipe.stopped,
                f"clone-events-{number}",
            )
            self._events.start()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        if isinstance(servers, str):
            servers = [s.strip() for s in servers.split(",") if s.strip()]
        _live.add(self)
        for endpoint in servers or ():
            self.connect(endpoint)

    # ------------------------------------------------------------------
    # Lifecycle

    def __enter__(self) -> Clone:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Clone servers={self._servers!r} state={self._events.state}>"

    @property
    def closed(self) -> bool:
        return self._pipe.closed

    @property
    def _closed(self) -> bool:
        return self._pipe.closed

    def close(self) -> None:
        """Revoke the leases still held (best effort, at most a couple of
        seconds), then stop the agent, join the threads, close every socket and
        the context.  What was dropped (writes never sent, confirmed writes
        and calls still waiting) is logged at WARNING and kept in
        :attr:`close_report`."""
        unrevoked = 0 if self._closed else self._caller.revoke_all_leases()
        dropped: dict[str, int] = {}
        with self._pipe.lock:
            if self._pipe.closed:
                return
            self._pipe.closed = True
            try:
                if self._pipe.stopped.is_set():
                    raise CloneError("the agent had already stopped")
                reply = self._pipe.request_locked(verbs.TERMINATE, [], self.command_timeout)
                dropped = json.loads(reply[0]) if reply else {}
            except CloneError as exc:
                log.warning("client agent did not acknowledge terminate: %s", exc)
        _live.discard(self)
        self._agent_thread.join(self.command_timeout)
        self._events.stop(self.command_timeout)
        with self._shared:
            feeds, self._feeds = self._feeds, []
        self._callbacks.stop()
        for feed in feeds:
            feed.close(self.command_timeout)
        report = CloseReport(
            unsent_writes=dropped.get("unsent", 0),
            unconfirmed_writes=dropped.get("unconfirmed", 0),
            waiting=self._waiters.fail_all(),
            leases_unrevoked=unrevoked,
        )
        self.close_report = report
        if report.dropped:
            log.warning(
                "closing dropped %d unsent write(s) (held: no server had answered, or "
                "republished our first write yet), %d write(s) "
                "not yet confirmed and %d waiting call(s)",
                report.unsent_writes,
                report.unconfirmed_writes,
                report.waiting,
            )
        self._callbacks.join(self.command_timeout)
        self._pipe.close_front()
        if self._agent_thread.is_alive() or self._events.thread.is_alive():
            log.error("client threads did not stop; leaving the zmq context open")
            return
        self._ctx.term()

    # ------------------------------------------------------------------
    # Commands

    def _request(self, verb: bytes, args: list[bytes]) -> list[bytes]:
        return self._pipe.request(verb, args)

    def _send_oneway(self, verb: bytes, args: list[bytes]) -> None:
        self._pipe.send_oneway(verb, args)

    def connect(self, endpoint: str) -> None:
        """Add a server by its CHP base endpoint, e.g. ``tcp://127.0.0.1:5556``
        (or ``127.0.0.1:5556``: tcp is the default).

        Servers are tried in the order they were added.
        """
        endpoint = normalize_endpoint(endpoint)
        split_endpoint(endpoint)
        self._request(verbs.CONNECT, [endpoint.encode()])
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

    def _revoke_lease(self, lease: Lease, timeout: float | None) -> None:
        """For :meth:`Lease.revoke`: stop its keepalives and revoke it."""
        self._caller.revoke_lease(lease, timeout)

    def _not_active_text(self, what: str, timeout: float) -> str:
        return self._caller.not_active_text(what, timeout)

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

    def _timeout_text(self, key: str, timeout: float) -> str:
        return (
            f"write to {key!r} was not confirmed by the active server within "
            f"{timeout:g} s (servers: {', '.join(self._servers) or 'none'})"
        )

    @overload
    def get(
        self,
        key: str,
        default: bytes | None = ...,
        *,
        with_status: Literal[False] = ...,
        require_synced: bool = ...,
    ) -> bytes | None: ...

    @overload
    def get(
        self,
        key: str,
        default: bytes | None = ...,
        *,
        with_status: Literal[True],
        require_synced: bool = ...,
    ) -> tuple[bytes | None, Freshness]: ...

    def get(
        self,
        key: str,
        default: bytes | None = None,
        *,
        with_status: bool = False,
        require_synced: bool = False,
    ) -> bytes | tuple[bytes | None, Freshness] | None:
        """The value of ``key`` in our replica, or ``default``.

        Read in the caller's thread from the replica the agent keeps, with no
        round trip to the agent (a microsecond or two).  A read after a
        confirmed write sees it.  ``with_status=True`` returns ``(value,
        freshness)`` (:class:`Freshness`: synced or not, seconds since the
        server was last heard); ``require_synced=True`` raises
        :class:`~clone.errors.NotSynced` rather than answer from a replica
        that is not live (before the first sync, during an outage).
        """
        row = self._row(key, require_synced)
        value = default if row is None else row[3]
        return (value, self.freshness()) if with_status else value

    def entry(self, key: str, *, require_synced: bool = False) -> Entry | None:
        """``key`` with its sequence and properties, or None; its
        ``freshness`` says how current the read is (see :meth:`get`)."""
        row = self._row(key, require_synced)
        if row is None:
            return None
        return Entry(key, row[3], row[0], row[2], self.freshness())

    def _row(self, key: str, require_synced: bool) -> tuple[int, bytes, Properties, bytes] | None:
        if not isinstance(key, str):
            raise TypeError(f"key must be str, not {type(key).__name__}")
        if self._closed:
            raise ClosedError("this Clone client is closed")
        if require_synced and not self._events.active.is_set():
            raise NotSynced(
                f"not synced (state {self._events.state}): the read of {key!r} would "
                f"come from a replica that is not live; servers: "
                f"{', '.join(self._servers) or 'none'}"
            )
        return self._fsm.peek(key)

    def freshness(self) -> Freshness:
        """How current reads from the replica are right now."""
        heard = self._fsm.heard_at
        return Freshness(
            synced=self._events.active.is_set(),
            state=self._events.state,
            silent_for=None if heard is None else max(0.0, time.monotonic() - heard),
        )

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

    def get_json(self, key: str, default: Any = None, *, require_synced: bool = False) -> Any:
        """The JSON document ``key`` holds, decoded, or ``default`` if absent;
        :class:`~clone.errors.NotJSON` if it holds something else."""
        row = self._row(key, require_synced)
        return default if row is None else from_json(key, row[3])

    def entries(self, prefix: str = "") -> list[Entry]:
        """Every entry whose key starts with ``prefix``, sorted by key."""
        return [Entry(k, body, seq, props) for k, (seq, _, props, body) in self._rows(prefix)]

    def items(self, prefix: str = "") -> list[tuple[str, bytes]]:
        """``(key, value)`` for every key starting with ``prefix``, sorted by key."""
        return [(k, row[3]) for k, row in self._rows(prefix)]

    def _rows(self, prefix: str) -> list[tuple[str, tuple[int, bytes, Properties, bytes]]]:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, not {type(prefix).__name__}")
        # The agent sorts and packs every row in one go: seconds at a million
        # keys on a busy machine.  The wait scales with the keys it holds
        # ("did not answer ITEMS within 5 s" at 1M keys, before).
        keys = int(json.loads(self._request(verbs.STATUS, [])[0])["keys"])
        pipe = self._pipe
        with pipe.lock:
            if pipe.closed:
                raise ClosedError("this Clone client is closed")
            reply = pipe.request_locked(
                verbs.ITEMS,
                [prefix.encode("utf-8")],
                self.command_timeout + keys * _ITEMS_SECONDS_PER_KEY,
            )
        # One marshal frame from our own agent thread, never from the network.
        rows: list[tuple[str, tuple[int, bytes, Properties, bytes]]] = marshal.loads(reply[0])
        return rows

    def status(self) -> Status:
        raw = json.loads(self._request(verbs.STATUS, [])[0])
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
        if self._events.active.wait(timeout):
            return
        if self._closed:
            raise ClosedError("this Clone client is closed")
        tried = ", ".join(self._servers) or "no servers configured"
        raise NotSynced(
            f"no server answered a snapshot request within {timeout:g} s: tried {tried}"
        )

    # ------------------------------------------------------------------
    # Changes

    def on_change(self, callback: Callable[[Entry], None]) -> Subscription:
        """Call ``callback(entry)`` for every change to a key in our subtrees.

        Callbacks run one at a time in this client's callback thread (named
        ``clone-callbacks-N``), never in the agent thread, so they may call this
        client, even a confirmed ``set``.  Exceptions are logged and swallowed.
        Only changes after registration are reported; a resync reports the keys
        that differ from what we held.  Returns a :class:`Subscription`:
        ``cancel()`` it (or use it as a context manager) to unregister.
        """
        if not callable(callback):
            raise TypeError("callback must be callable")
        if self._closed:
            raise ClosedError("this Clone client is closed")
        subscription = self._callbacks.add(callback)
        self._watch()
        return subscription

    def on_conflict(self, callback: Callable[[SplitConflict], None]) -> None:
        """Call ``callback(conflict)`` when a write of ours that a server
        confirmed during a split brain was not kept when the pair healed (the
        other side had changed its key): docs/client.md, "Split-brain conflicts".

        ``conflict`` is a :class:`~clone.errors.SplitConflict` (``key``,
        ``uuid``); a write still waited on also raises it.  Callbacks run in
        the callback thread, like :meth:`on_change`'s; exceptions are logged.
        A conflict is told once, best effort (a notice on the update stream,
        for writes confirmed among this client's last 65,536).
        """
        if not callable(callback):
            raise TypeError("callback must be callable")
        with self._shared:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            self._events.conflict_callbacks.append(callback)

    def _run_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the callback thread (a lease's ``on_lost`` callbacks)."""
        if self._closed:
            log.debug("client closed: callback %r not run", fn)
            return
        self._callbacks.run_soon(fn)

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
            subtree=history_subtree(prefix, self._subtrees),
            prefixes=self._subtrees,
            silence=self._silence,
            curve=self._curve,
        )
        with self._shared:
            self._feeds = [f for f in self._feeds if not f.stopped]
            self._feeds.append(feed)
        return ChangeStream(feed, timeout, prefix)

    def _add_watcher(self, watcher: Watcher) -> None:
        if self._closed:
            raise ClosedError("this Clone client is closed")
        self._callbacks.add_watcher(watcher)
        self._watch()

    def _remove_watcher(self, watcher: Watcher) -> None:
        self._callbacks.remove_watcher(watcher)

    def _watch(self) -> None:
        if not self._watching:
            self._request(verbs.WATCH, [b"1"])
            self._watching = True


# --------------------------------------------------------------------------
# Clients still open at exit are closed, so their leases (and the keys bound
# to them) end now, not a ttl later.

_live: weakref.WeakSet[Clone] = weakref.WeakSet()


def _close_live() -> None:
    for client in list(_live):
        try:
            client.close()
        except Exception as exc:  # exiting anyway: say it, never raise
            log.info("closing a client at exit failed: %s", exc)


atexit.register(_close_live)


# The default client (clone_set, clone_get) lives in clone.client.default;
# imported last, as it builds a Clone.
from clone.client.default import (  # noqa: E402
    DEFAULT_SERVERS,
    clone_get,
    clone_set,
    default_servers,
)
