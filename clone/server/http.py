"""The HTTP port (``--http-port``): metrics, health, readiness and a live status page.

How this works: a :class:`tornado.web.Application` served by an
:class:`~tornado.httpserver.HTTPServer` on the server's own loop, next to the
ZeroMQ sockets; nothing here runs in another thread.  The listening socket is
bound in ``_setup`` (so a port in use stops the start with a clear message) and
handed to the loop's accept handler once the loop runs; ``_close_all`` stops it.

* ``/metrics``: Prometheus text from this server's own registry
  (:mod:`.metrics`), built from its state at each scrape.
* ``/healthz``: 200 while the process serves, with its role and sequence.
* ``/readyz``: 200 for the active server, or a passive one in step with it
  (synced, nothing pending); 503 with the reason otherwise.
* ``/status.json``: the page's data once; ``/ws``: the same pushed at every
  heartbeat (at most 5 a second, at least 1) to a bounded number of WebSocket
  clients (``--http-viewers``).  A client still writing the previous push skips
  this one: a slow browser never makes the loop wait or the server's memory
  grow.  Every push also sends a WebSocket ping; a viewer that does not read
  cannot answer it, so one silent for 3 pushes (at least 2 s) is *stale*: a new
  viewer takes its slot when all are taken, and one silent for
  ``--http-idle-timeout`` is closed.

Bounds (issue 26): the HTTP server closes a connection idle, or sending a
request's headers or body, for ``--http-idle-timeout`` seconds (tornado's
``idle_connection_timeout``, which is also its header timeout, and
``body_timeout``), and accepts at most ``--http-max-connections`` at once (by
default a quarter of the descriptor limit, :mod:`.fdlimit`): one beyond it is
closed as soon as it is accepted, and counted.
* ``/``: the page itself, plain files from ``clone/server/web/``.

The publisher's connections are counted here too, from a socket monitor
(:class:`~clone.server.metrics.SubscriberCount`).
"""

from __future__ import annotations

import json
import logging
import resource
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream
from tornado.netutil import bind_sockets
from tornado.web import Application, RequestHandler, StaticFileHandler
from tornado.websocket import WebSocketClosedError, WebSocketHandler

from clone.errors import ServerStartError
from clone.server.base import ServerBase, log
from clone.server.core import Role, SyncState
from clone.server.fdlimit import http_connection_cap
from clone.server.metrics import SubscriberCount, build_registry

if TYPE_CHECKING:
    import socket
    from collections.abc import Awaitable

__all__ = ["MAX_STATUS_SOCKETS", "WEB_DIR", "HttpMixin", "StatusHub"]

#: Where the status page's files are (shipped as package data).
WEB_DIR = Path(__file__).resolve().parent / "web"
#: WebSocket clients of the status page at once (``--http-viewers``); a new one
#: beyond takes a stale viewer's slot, else is closed with 1013.
MAX_STATUS_SOCKETS = 32
#: The HTTP port's connection cap before the descriptor limit is known.
HTTP_CAP_DEFAULT = 1024
_RATE_SAMPLES = 120  # points of the page's update-rate chart
_PUSH_MIN = 0.2  # seconds between pushes, at least ...
_PUSH_MAX = 1.0  # ... and at most


#: A viewer not heard (a pong, a message) for this long is stale: its slot can go
#: to a new viewer.  At least this many seconds ...
_STALE_MIN = 2.0
#: ... and at least this many pushes (each push sends a ping).
_STALE_PUSHES = 3


class StatusHub:
    """The status page's WebSocket clients: admit (bounded), push, drop laggards.

    Times are passed in (``now``, monotonic seconds): a viewer is *heard* when
    admitted and at each pong or message (:meth:`heard`); :meth:`broadcast`
    pings every viewer and closes those silent for ``idle_timeout``; when every
    slot is taken, :meth:`admit` closes the viewer silent longest, if it is
    stale, to make room.
    """

    def __init__(
        self, limit: int = MAX_STATUS_SOCKETS, *, stale_after: float = _STALE_MIN,
        idle_timeout: float = 30.0,
    ) -> None:  # fmt: skip
        self.limit = limit
        self.stale_after = stale_after
        self.idle_timeout = idle_timeout
        # socket -> its last write (None once done or never started)
        self._sockets: dict[WebSocketHandler, Awaitable[None] | None] = {}
        self._heard: dict[WebSocketHandler, float] = {}
        self.pushed = 0
        self.skipped = 0  # pushes not sent to a client still writing the previous one
        self.refused = 0
        self.evicted = 0  # stale viewers closed to make room for a new one
        self.timed_out = 0  # viewers closed after idle_timeout of silence

    def __len__(self) -> int:
        return len(self._sockets)

    def admit(self, ws: WebSocketHandler, now: float) -> bool:
        if len(self._sockets) >= self.limit:
            oldest = min(self._heard, key=self._heard.__getitem__, default=None)
            if oldest is None or now - self._heard[oldest] < self.stale_after:
                self.refused += 1
                return False
            self.evicted += 1
            self._drop(oldest, 1008, "not reading: the slot went to another viewer")
        self._sockets[ws] = None
        self._heard[ws] = now
        return True

    def heard(self, ws: WebSocketHandler, now: float) -> None:
        """``ws`` answered a ping (or sent something): it reads."""
        if ws in self._heard:
            self._heard[ws] = now

    def remove(self, ws: WebSocketHandler) -> None:
        self._sockets.pop(ws, None)
        self._heard.pop(ws, None)

    def _drop(self, ws: WebSocketHandler, code: int, reason: str) -> None:
        self.remove(ws)
        try:
            ws.close(code, reason)
        except Exception:  # already gone
            log.debug("closing a status socket failed", exc_info=True)

    def send(self, ws: WebSocketHandler, text: str) -> None:
        """Send unless the previous message to ``ws`` is still being written."""
        last = self._sockets.get(ws, None)
        if last is not None and not _done(last):
            self.skipped += 1
            return
        try:
            self._sockets[ws] = ws.write_message(text)
        except WebSocketClosedError:
            self.remove(ws)
            return
        self.pushed += 1

    def broadcast(self, text: str, now: float) -> None:
        """Push ``text`` and a ping to every viewer; close those silent past ``idle_timeout``."""
        for ws in list(self._sockets):
            if now - self._heard.get(ws, now) > self.idle_timeout:
                self.timed_out += 1
                self._drop(ws, 1001, "idle: no pong")
                continue
            self.send(ws, text)
            try:
                ws.ping()
            except WebSocketClosedError:
                self.remove(ws)

    def close_all(self) -> None:
        sockets, self._sockets = self._sockets, {}
        self._heard = {}
        for ws in sockets:
            try:
                ws.close(1001, "server stopping")
            except Exception:  # already gone
                log.debug("closing a status socket failed", exc_info=True)


def _done(fut: Awaitable[None]) -> bool:
    done = getattr(fut, "done", None)
    return bool(done()) if callable(done) else True


class _Handler(RequestHandler):
    def initialize(self, server: HttpMixin) -> None:
        self.server = server

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")

    def _json(self, code: int, body: dict[str, Any]) -> None:
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


class _MetricsHandler(_Handler):
    def get(self) -> None:
        registry = self.server._registry
        assert registry is not None
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(registry))


class _HealthHandler(_Handler):
    def get(self) -> None:
        server = self.server
        core = server.core
        body: dict[str, Any] = {"role": core.role.value, "sequence": core.store.sequence}
        if server._stopping or server._storage_error is not None:
            body["reason"] = "stopping"
            self._json(503, body)
        else:
            self._json(200, body)


class _ReadyHandler(_Handler):
    def get(self) -> None:
        server = self.server
        ready, reason = server.readiness()
        core = server.core
        body = {
            "ready": ready,
            "role": core.role.value,
            "sequence": core.store.sequence,
            "reason": reason,
        }
        self._json(200 if ready else 503, body)


class _StatusJsonHandler(_Handler):
    def get(self) -> None:
        self._json(200, self.server.page_status())


class _StatusSocket(WebSocketHandler):
    def initialize(self, server: HttpMixin) -> None:
        self.server = server

    def open(self, *args: str, **kwargs: str) -> None:
        hub = self.server._status_hub
        if not hub.admit(self, self.server._clock()):
            self.close(1013, "too many status pages open; try again later")
            return
        hub.send(self, json.dumps(self.server.page_status()))

    def on_message(self, message: str | bytes) -> None:
        self.server._status_hub.heard(self, self.server._clock())  # the page only listens

    def on_pong(self, data: bytes) -> None:
        self.server._status_hub.heard(self, self.server._clock())

    def on_close(self) -> None:
        self.server._status_hub.remove(self)


def make_app(server: HttpMixin) -> Application:
    """The routes of the HTTP port."""
    args = {"server": server}
    return Application(
        [
            (r"/metrics", _MetricsHandler, args),
            (r"/healthz", _HealthHandler, args),
            (r"/readyz", _ReadyHandler, args),
            (r"/status\.json", _StatusJsonHandler, args),
            (r"/ws", _StatusSocket, args),
            (r"/(.*)", StaticFileHandler, {"path": str(WEB_DIR), "default_filename": "index.html"}),
        ],
        websocket_max_message_size=4096,
        log_function=_log_request,
    )


def _log_request(handler: RequestHandler) -> None:
    """Requests at DEBUG (a scrape every few seconds is no news); errors louder."""
    status = handler.get_status()
    level = logging.DEBUG if status < 500 else logging.WARNING
    request = handler.request
    log.log(
        level,
        "HTTP %d %s %s (%s) %.1f ms",
        status,
        request.method,
        request.uri,
        request.remote_ip,
        1000.0 * request.request_time(),
    )


class CappedHTTPServer(HTTPServer):
    """An HTTPServer that closes a connection beyond ``cap`` as soon as it is accepted."""

    cap = HTTP_CAP_DEFAULT
    refused = 0

    def handle_stream(self, stream: IOStream, address: tuple[Any, ...]) -> None:
        if len(self._connections) >= self.cap:
            self.refused += 1
            stream.close()
            return
        super().handle_stream(stream, address)


class HttpMixin(ServerBase):
    """The HTTP port and the publisher's connection count."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._registry: CollectorRegistry | None = None
        self._http_server: CappedHTTPServer | None = None
        self._http_sockets: list[socket.socket] = []
        self._http_timer: object | None = None
        cfg = self.config
        self._status_hub = StatusHub(
            cfg.http_viewers,
            stale_after=max(_STALE_MIN, _STALE_PUSHES * self._push_interval()),
            idle_timeout=cfg.http_idle_timeout,
        )
        self._rate_samples: deque[tuple[float, float]] = deque(maxlen=_RATE_SAMPLES)
        self._rate_last: tuple[float, int] | None = None

    if TYPE_CHECKING:

        def _status(self) -> dict[str, Any]: ...

        def stats(self) -> dict[str, int | float | str]: ...

    # -- what the endpoints report -------------------------------------------

    @property
    def subscribers(self) -> int | None:
        """Connections to the publisher, when counted (with --http-port)."""
        count = self._subscriber_count
        return None if count is None else count.value

    @property
    def peer_alive(self) -> bool:
        ha = self._ha
        return ha is not None and ha.peer_alive

    def readiness(self) -> tuple[bool, str]:
        """Whether a failover to (or a read from) this server now loses nothing, and why."""
        core = self.core
        if self._stopping or self._storage_error is not None:
            return False, "stopping"
        role = core.role
        if role is Role.ACTIVE:
            return True, "active"
        if role is Role.STARTING:
            return False, "starting: Binary Star has not decided the role yet"
        if core.sync_state is not SyncState.SYNCED:
            return False, f"passive and {core.sync_state.value}: not in step with the active"
        pending = len(core.pending)
        if pending:
            return False, f"passive with {pending} client updates pending"
        return True, "passive, in step with the active"

    def page_status(self) -> dict[str, Any]:
        """What the status page shows: the status, plus rings, rate, limits and counters."""
        out = dict(self._status())
        out["subscribers"] = self.subscribers
        ready, reason = self.readiness()
        cfg = self.config
        core = cfg.core
        stats = self.stats()
        hist = self.snapshot_seconds
        out.update(
            time=self._wallclock(),
            ready=ready,
            ready_reason=reason,
            heartbeat=cfg.heartbeat,
            rate=self._rate_samples[-1][1] if self._rate_samples else 0.0,
            rate_history=[[round(t, 3), round(r, 2)] for t, r in self._rate_samples],
            recent=[
                {"sequence": seq, "key": key.decode("utf-8", "replace")}
                for seq, key in reversed(self.recent_changes)
            ],
            role_changes=[
                {"time": t, "from": was, "to": now} for t, was, now in reversed(self.role_changes)
            ],
            limits={
                "max_keys": core.max_keys,
                "max_bytes": core.max_bytes,
                "max_snapshots": cfg.max_snapshots,
                "pending_max": core.pending_max,
                "pending_max_age": core.pending_max_age,
                "dedup_window": core.dedup_window,
                "history_max": core.history_max,
                "pub_hwm": cfg.pub_hwm,
            },
            snapshots={"count": hist.count, "seconds_total": round(hist.total, 6)},
            counters={k: v for k, v in sorted(stats.items()) if isinstance(v, int | float)},
        )
        return out

    # -- life cycle -----------------------------------------------------------

    def _open_http(self) -> None:
        """Bind the HTTP port (if configured); serving starts with the loop."""
        port = self.config.http_port
        if port is None:
            return
        loop = self._loop
        assert loop is not None
        host = "" if self.config.bind in ("*", "") else self.config.bind
        try:
            self._http_sockets = bind_sockets(port, host or None)
        except OSError as exc:
            raise ServerStartError(
                f"cannot bind the HTTP port {host or '*'}:{port}: {exc}"
            ) from exc
        self._registry = build_registry(self)
        timeout = self.config.http_idle_timeout
        server = CappedHTTPServer(
            make_app(self), idle_connection_timeout=timeout, body_timeout=timeout
        )
        server.cap = self.config.http_max_connections or http_connection_cap(
            resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        )
        self._http_server = server
        # add_sockets registers with the current loop: run it on ours.
        loop.add_callback(self._start_http)
        # The rate's baseline: the first tick then measures a real interval.
        # Taken at the first tick instead, writes made before it were never
        # counted (seen on a loaded machine, where that tick came late).
        self._rate_last = (self._clock(), self.core.store.sequence)
        self._http_timer = loop.call_later(self._push_interval(), self._on_http_tick)
        log.info(
            "HTTP port %s:%d: /metrics /healthz /readyz and the status page (at most %d"
            " connections, %d viewers, idle timeout %g s)",
            host or "*", port, server.cap, self.config.http_viewers, timeout,
        )  # fmt: skip

    def _start_http(self) -> None:
        server = self._http_server
        if server is not None and self._http_sockets and not self._stopping:
            sockets, self._http_sockets = self._http_sockets, []
            server.add_sockets(sockets)

    def _close_http(self) -> None:
        if self._http_timer is not None and self._loop is not None:
            self._loop.remove_timeout(self._http_timer)
        self._http_timer = None
        self._status_hub.close_all()
        server, self._http_server = self._http_server, None
        if server is not None:
            server.stop()
        for sock in self._http_sockets:  # bound but never served
            sock.close()
        self._http_sockets = []

    def _push_interval(self) -> float:
        return min(max(self.config.heartbeat, _PUSH_MIN), _PUSH_MAX)

    def _on_http_tick(self) -> None:
        loop = self._loop
        if loop is None or self._stopping:
            return
        try:
            self._sample_rate()
            if len(self._status_hub):
                self._status_hub.broadcast(json.dumps(self.page_status()), self._clock())
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in the status push")
        self._http_timer = loop.call_later(self._push_interval(), self._on_http_tick)

    def _sample_rate(self) -> None:
        """Updates a second since the last sample, from the sequence (either role)."""
        now = self._clock()
        seq = self.core.store.sequence
        last = self._rate_last
        self._rate_last = (now, seq)
        if last is None or now <= last[0]:
            return
        rate = max(0, seq - last[1]) / (now - last[0])
        self._rate_samples.append((self._wallclock(), rate))

    def http_counters(self) -> dict[str, int]:
        """The HTTP port's bounds at work, for :meth:`stats` (empty without --http-port)."""
        if self.config.http_port is None:
            return {}
        hub = self._status_hub
        server = self._http_server
        return {
            "http_connections_refused": 0 if server is None else server.refused,
            "http_viewers_refused": hub.refused,
            "http_viewers_evicted": hub.evicted,
            "http_viewers_timed_out": hub.timed_out,
        }

    # -- counting the publisher's connections ---------------------------------

    def _watch_subscribers(self, pub: zmq.Socket[Any]) -> zmq.Socket[Any]:
        """``pub``'s monitor socket, for the inbound watch (clone.server.subscribers),
        which passes its events to :meth:`_on_pub_monitor`; with --http-port they
        count the connections."""
        secure = self._keypair is not None
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        if secure:
            for name in (
                "EVENT_HANDSHAKE_SUCCEEDED",
                "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
                "EVENT_HANDSHAKE_FAILED_PROTOCOL",
                "EVENT_HANDSHAKE_FAILED_AUTH",
            ):
                events |= getattr(zmq, name, 0)
        if self.config.http_port is not None:
            self._subscriber_count = SubscriberCount(secure=secure)
        monitor = pub.get_monitor_socket(events)
        monitor.setsockopt(zmq.LINGER, 0)
        return monitor

    def _on_pub_monitor(self, event: int, value: int) -> None:
        self.subscription_gate.on_event(event, value)
        count = self._subscriber_count
        if count is not None:
            count.on_event(event)
