"""The HTTP port (``--http-port``): metrics, health, readiness and a live status page.

How this works: a :class:`tornado.web.Application` served by an
:class:`~tornado.httpserver.HTTPServer` on the server's own loop, next to the
ZeroMQ sockets; nothing here runs in another thread.  The listening socket is
bound in ``_setup`` (so a port in use stops the start with a clear message) and
handed to the loop's accept handler once the loop runs; ``_close_all`` stops it.
The port is a part, :class:`HttpPort`, that reads its server only through a
narrow :class:`StatusSource` (``tests/server/test_http.py`` drives it with a
fake one); the server's side of that is :mod:`.monitoring`.

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

Bounds (no connection may take the loop): the HTTP server closes a connection idle, or sending a
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
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from tornado.httpserver import HTTPServer
from tornado.ioloop import IOLoop
from tornado.iostream import IOStream
from tornado.netutil import bind_sockets
from tornado.web import Application, RequestHandler, StaticFileHandler
from tornado.websocket import WebSocketClosedError, WebSocketHandler

from clone.errors import ServerStartError
from clone.server.config import ServerConfig
from clone.server.fdlimit import http_connection_cap
from clone.server.metrics import MonitoredServer, build_registry
from clone.server.shared import Shared

if TYPE_CHECKING:
    import socket
    from collections.abc import Awaitable

__all__ = [
    "MAX_STATUS_SOCKETS",
    "WEB_DIR",
    "HttpPort",
    "StatusHub",
    "StatusSource",
]

#: Where the status page's files are (shipped as package data).
# The reactor's logger: operators filter on it, and the tests read its lines.
log = logging.getLogger("clone.server.reactor")

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
    def initialize(self, port: HttpPort) -> None:
        self.port = port

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")

    def _json(self, code: int, body: dict[str, Any]) -> None:
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


class _MetricsHandler(_Handler):
    def get(self) -> None:
        registry = self.port.registry
        assert registry is not None
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(registry))


class _HealthHandler(_Handler):
    def get(self) -> None:
        serving, role, sequence = self.port.source.health()
        body: dict[str, Any] = {"role": role, "sequence": sequence}
        if not serving:
            body["reason"] = "stopping"
            self._json(503, body)
        else:
            self._json(200, body)


class _ReadyHandler(_Handler):
    def get(self) -> None:
        source = self.port.source
        ready, reason = source.readiness()
        _, role, sequence = source.health()
        body = {"ready": ready, "role": role, "sequence": sequence, "reason": reason}
        self._json(200 if ready else 503, body)


class _StatusJsonHandler(_Handler):
    def get(self) -> None:
        self._json(200, self.port.page_status())


class _StatusSocket(WebSocketHandler):
    def initialize(self, port: HttpPort) -> None:
        self.port = port

    def open(self, *args: str, **kwargs: str) -> None:
        hub = self.port.hub
        if not hub.admit(self, self.port.clock()):
            self.close(1013, "too many status pages open; try again later")
            return
        hub.send(self, json.dumps(self.port.page_status()))

    def on_message(self, message: str | bytes) -> None:
        self.port.hub.heard(self, self.port.clock())  # the page only listens

    def on_pong(self, data: bytes) -> None:
        self.port.hub.heard(self, self.port.clock())

    def on_close(self) -> None:
        self.port.hub.remove(self)


def make_app(port: HttpPort) -> Application:
    """The routes of the HTTP port."""
    args = {"port": port}
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


class StatusSource(MonitoredServer, Protocol):
    """What the HTTP port reads of its server: the metrics' view
    (:class:`~clone.server.metrics.MonitoredServer`), its health and the
    page's fields.  Narrow on purpose: the port never touches the server's
    sockets or state; a test passes any object with these."""

    def health(self) -> tuple[bool, str, int]:
        """Whether it serves (not stopping, not failed), its role and sequence."""
        ...

    def page_fields(self) -> dict[str, Any]:
        """Everything the status page shows but the update rate (ours)."""
        ...


class HttpPort:
    """The HTTP port: /metrics, /healthz, /readyz, the status page and its pushes.

    Built with the server's config (the ``--http-*`` flags, the bind address
    and the heartbeat), the shared clocks and counters, the loop it serves on
    and a :class:`StatusSource`.  :meth:`open` binds (or raises
    :class:`~clone.errors.ServerStartError`); serving starts with the loop;
    :meth:`close` stops it.  The update rate is sampled here, from the
    source's sequence, once per push.
    """

    def __init__(
        self, config: ServerConfig, shared: Shared, loop: IOLoop, source: StatusSource
    ) -> None:
        self._config = config
        self._shared = shared
        self.clock = shared.clock
        self._loop = loop
        self.source = source
        self.registry: CollectorRegistry | None = None
        self._server: CappedHTTPServer | None = None
        self._sockets: list[socket.socket] = []
        self._timer: object | None = None
        self._closed = False
        self.hub = StatusHub(
            config.http_viewers,
            stale_after=max(_STALE_MIN, _STALE_PUSHES * self._push_interval()),
            idle_timeout=config.http_idle_timeout,
        )
        self._rate_samples: deque[tuple[float, float]] = deque(maxlen=_RATE_SAMPLES)
        self._rate_last: tuple[float, int] | None = None

    def page_status(self) -> dict[str, Any]:
        """What the status page shows: the source's fields and the update rate."""
        out = self.source.page_fields()
        out["rate"] = self._rate_samples[-1][1] if self._rate_samples else 0.0
        out["rate_history"] = [[round(t, 3), round(r, 2)] for t, r in self._rate_samples]
        return out

    def counters(self) -> dict[str, int]:
        """The HTTP port's bounds at work, for the server's stats."""
        hub = self.hub
        server = self._server
        return {
            "http_connections_refused": 0 if server is None else server.refused,
            "http_viewers_refused": hub.refused,
            "http_viewers_evicted": hub.evicted,
            "http_viewers_timed_out": hub.timed_out,
        }

    # -- life cycle -----------------------------------------------------------

    def open(self) -> None:
        """Bind the HTTP port; serving starts with the loop."""
        cfg = self._config
        port = cfg.http_port
        assert port is not None
        host = "" if cfg.bind in ("*", "") else cfg.bind
        try:
            self._sockets = bind_sockets(port, host or None)
        except OSError as exc:
            raise ServerStartError(
                f"cannot bind the HTTP port {host or '*'}:{port}: {exc}"
            ) from exc
        self.registry = build_registry(self.source)
        timeout = cfg.http_idle_timeout
        server = CappedHTTPServer(
            make_app(self), idle_connection_timeout=timeout, body_timeout=timeout
        )
        server.cap = cfg.http_max_connections or http_connection_cap(
            resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        )
        self._server = server
        # add_sockets registers with the current loop: run it on ours.
        self._loop.add_callback(self._start)
        # The rate's baseline: the first tick then measures a real interval.
        # Taken at the first tick instead, writes made before it were never
        # counted (seen on a loaded machine, where that tick came late).
        self._rate_last = (self.clock(), self.source.health()[2])
        self._timer = self._loop.call_later(self._push_interval(), self._on_tick)
        log.info(
            "HTTP port %s:%d: /metrics /healthz /readyz and the status page (at most %d"
            " connections, %d viewers, idle timeout %g s)",
            host or "*", port, server.cap, cfg.http_viewers, timeout,
        )  # fmt: skip

    def _start(self) -> None:
        server = self._server
        if server is not None and self._sockets and not self._closed:
            sockets, self._sockets = self._sockets, []
            server.add_sockets(sockets)

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._loop.remove_timeout(self._timer)
        self._timer = None
        self.hub.close_all()
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        for sock in self._sockets:  # bound but never served
            sock.close()
        self._sockets = []

    def _push_interval(self) -> float:
        return min(max(self._config.heartbeat, _PUSH_MIN), _PUSH_MAX)

    def _on_tick(self) -> None:
        if self._closed:
            return
        try:
            self.sample_rate()
            if len(self.hub):
                self.hub.broadcast(json.dumps(self.page_status()), self.clock())
        except Exception:
            self._shared.counters["internal_errors"] += 1
            log.exception("internal error in the status push")
        self._timer = self._loop.call_later(self._push_interval(), self._on_tick)

    def sample_rate(self) -> None:
        """Updates a second since the last sample, from the sequence (either role)."""
        now = self.clock()
        seq = self.source.health()[2]
        last = self._rate_last
        self._rate_last = (now, seq)
        if last is None or now <= last[0]:
            return
        rate = max(0, seq - last[1]) / (now - last[0])
        self._rate_samples.append((self._shared.wallclock(), rate))
