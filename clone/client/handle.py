"""A client's threads, pipe and lifecycle: what every verb of :class:`~clone.Clone` stands on.

:class:`ClientHandle` owns a ``zmq.Context``, starts the agent (:mod:`clone.client.agent`) in a
thread and talks to it over two inproc PAIR pipes: a command pipe (strict
request/reply, one caller at a time, every wait bounded) and an event pipe the
agent writes to without ever blocking (confirmations, state changes, changes to
keys).  A small dispatcher thread reads the event pipe, so a thread waiting for a
confirmed write never holds the command pipe, and another thread runs the
``on_change`` callbacks, so a slow or re-entrant callback cannot stall the agent
or the confirmations.  The verbs an application calls are built on it:
the reads and change streams (:mod:`.reads`), then the writes and calls
(:class:`~clone.client.frontend.Clone`).

Clients still open at exit are closed (:func:`_close_live`), so their leases,
and the keys bound to them, end now and not a ttl later.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

import zmq

from clone.argtypes import normalize_endpoint
from clone.client import agent as _agent
from clone.client import verbs
from clone.client.agent import Agent, split_endpoint
from clone.client.calling import Caller
from clone.client.events import Callbacks, Dispatcher, Waiters
from clone.client.fsm import AgentConfig, AgentFSM, normalize_subtrees
from clone.client.history import HistoryFeed
from clone.client.leases import Lease
from clone.client.pipe import CommandPipe
from clone.client.results import CloseReport
from clone.errors import AgentTimeout, CloneError, ProtocolError
from clone.security.keys import load_curve_keys

__all__ = ["ClientHandle"]

log = logging.getLogger(__name__)


_ids = itertools.count(1)


class ClientHandle:
    """The agent thread, the pipes, the dispatcher and callback threads of one
    client, and closing them; the constructor's arguments are
    :class:`~clone.Clone`'s (see there)."""

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

    def __enter__(self) -> Self:
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

    def _timeout_text(self, key: str, timeout: float) -> str:
        return (
            f"write to {key!r} was not confirmed by the active server within "
            f"{timeout:g} s (servers: {', '.join(self._servers) or 'none'})"
        )

    def _not_active_text(self, what: str, timeout: float) -> str:
        return self._caller.not_active_text(what, timeout)

    def _revoke_lease(self, lease: Lease, timeout: float | None) -> None:
        """For :meth:`Lease.revoke`: stop its keepalives and revoke it."""
        self._caller.revoke_lease(lease, timeout)

    def _run_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the callback thread (a lease's ``on_lost`` callbacks)."""
        if self._closed:
            log.debug("client closed: callback %r not run", fn)
            return
        self._callbacks.run_soon(fn)



_live: weakref.WeakSet[ClientHandle] = weakref.WeakSet()


def _close_live() -> None:
    for client in list(_live):
        try:
            client.close()
        except Exception as exc:  # exiting anyway: say it, never raise
            log.info("closing a client at exit failed: %s", exc)


atexit.register(_close_live)
