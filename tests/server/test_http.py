"""The monitoring pieces without processes: the histogram and subscriber count
behind /metrics, the status hub's lag rule, --http-port and --log-format, and an
in-process server's HTTP port (metrics parsed, health, a plain PUB's
connections counted from its monitor)."""

from __future__ import annotations

import json
import logging
import sys
import urllib.request
from collections.abc import Iterator

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from clone.logformat import JsonFormatter, formatter
from clone.release import RELEASE
from clone.server.cli import build_parser, config_from_args
from clone.server.config import ServerConfig
from clone.server.fdlimit import HTTP_CAP_MAX, HTTP_CAP_MIN, http_connection_cap
from clone.server.http import StatusHub
from clone.server.metrics import DurationHistogram, SubscriberCount
from clone.server.reactor import CloneServer
from clone.storage import FORMAT_VERSION
from tests.support.ports import free_base_port, free_port
from tests.support.waiting import eventually


def test_histogram_buckets_are_cumulative() -> None:
    h = DurationHistogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        h.observe(seconds)
    assert h.buckets() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.total == pytest.approx(3.65)
    with pytest.raises(ValueError):
        DurationHistogram((1.0, 0.5))


@pytest.mark.parametrize(
    ("secure", "events", "expected"),
    [
        (False, [zmq.EVENT_ACCEPTED, zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED], 1),
        (False, [zmq.EVENT_DISCONNECTED], 0),  # never below zero
        # CURVE: one admitted, one refused by ZAP; both end disconnected later.
        (
            True,
            [
                zmq.EVENT_ACCEPTED,
                zmq.EVENT_HANDSHAKE_SUCCEEDED,
                zmq.EVENT_ACCEPTED,
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                zmq.EVENT_DISCONNECTED,
            ],
            1,
        ),
        (True, [zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED], 0),
    ],
)
def test_subscriber_count(secure: bool, events: list[int], expected: int) -> None:
    count = SubscriberCount(secure=secure)
    for event in events:
        count.on_event(event)
    assert count.value == expected


class _Future:
    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


class _FakeSocket:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.last = _Future()

    def write_message(self, text: str) -> _Future:
        self.sent.append(text)
        self.last = _Future()
        return self.last

    def ping(self) -> None:
        self.pings += 1

    def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    pings = 0
    closed: tuple[int, str] | None = None


def test_status_hub_skips_a_lagging_client_and_is_bounded() -> None:
    hub = StatusHub(limit=2, stale_after=2.0)
    fast, slow, extra = _FakeSocket(), _FakeSocket(), _FakeSocket()
    assert hub.admit(fast, 0.0) and hub.admit(slow, 0.0)  # type: ignore[arg-type]
    assert not hub.admit(extra, 1.0)  # type: ignore[arg-type]  # nobody stale yet
    for n in range(3):
        hub.broadcast(str(n), 0.2 * n)
        fast.last.finished = True  # the fast one keeps up; the slow one never does
    assert fast.sent == ["0", "1", "2"]
    assert slow.sent == ["0"]
    assert fast.pings == slow.pings == 3
    assert hub.skipped == 2 and hub.refused == 1


def test_a_viewer_that_does_not_read_loses_its_slot_to_one_that_does() -> None:
    hub = StatusHub(limit=2, stale_after=2.0)
    reader, silent, newcomer = _FakeSocket(), _FakeSocket(), _FakeSocket()
    assert hub.admit(reader, 0.0) and hub.admit(silent, 0.0)  # type: ignore[arg-type]
    for t in (1.0, 2.0, 3.0):
        hub.broadcast("s", t)
        hub.heard(reader, t + 0.01)  # type: ignore[arg-type]  # its pong
    assert hub.admit(newcomer, 3.5)  # type: ignore[arg-type]
    assert silent.closed is not None and silent.closed[0] == 1008
    assert reader.closed is None and hub.evicted == 1 and len(hub) == 2
    # The newcomer is fresh: a fourth viewer finds nobody stale and is refused.
    assert not hub.admit(_FakeSocket(), 3.6)  # type: ignore[arg-type]


def test_a_viewer_silent_past_the_idle_timeout_is_closed() -> None:
    hub = StatusHub(limit=4, stale_after=2.0, idle_timeout=10.0)
    silent = _FakeSocket()
    assert hub.admit(silent, 0.0)  # type: ignore[arg-type]
    hub.broadcast("s", 9.0)
    assert silent.closed is None
    hub.broadcast("s", 10.5)
    assert silent.closed is not None and hub.timed_out == 1 and len(hub) == 0


def test_http_connection_cap_from_the_descriptor_limit() -> None:
    assert http_connection_cap(1500) == 375  # the 1,500-descriptor limit
    assert http_connection_cap(20000) == HTTP_CAP_MAX
    assert http_connection_cap(32) == HTTP_CAP_MIN


def test_http_bound_flags() -> None:
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["--standalone", "--in-memory"]))
    assert (cfg.http_idle_timeout, cfg.http_max_connections, cfg.http_viewers) == (30.0, 0, 32)
    cfg = config_from_args(parser.parse_args([
        "--standalone", "--in-memory", "--http-idle-timeout", "2.5",
        "--http-max-connections", "10", "--http-viewers", "3",
    ]))  # fmt: skip
    assert (cfg.http_idle_timeout, cfg.http_max_connections, cfg.http_viewers) == (2.5, 10, 3)
    for bad in (["--http-idle-timeout", "0"], ["--http-viewers", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--standalone", *bad])


def test_http_port_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(["--standalone", "--in-memory", "--http-port", "9100"])
    assert config_from_args(args).http_port == 9100
    assert config_from_args(parser.parse_args(["--standalone", "--in-memory"])).http_port is None
    for bad in ("0", "70000", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--standalone", "--http-port", bad])
    with pytest.raises(ValueError):
        ServerConfig(port=5556, http_port=0)


def _record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.LogRecord("clone.x", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_json_log_format_is_one_object_per_line() -> None:
    fmt = JsonFormatter()
    line = fmt.format(_record("hello %s, %d", "you", 3))
    obj = json.loads(line)
    assert obj["level"] == "WARNING" and obj["logger"] == "clone.x"
    assert obj["message"] == "hello you, 3"
    assert "T" in obj["time"] and obj["time"][-6] in "+-"  # ISO 8601 with the offset
    line = fmt.format(_record("failed", exc=True))
    assert "\n" not in line
    obj = json.loads(line)
    assert "RuntimeError: boom" in obj["exc_info"] and "Traceback" in obj["exc_info"]
    assert isinstance(formatter("json"), JsonFormatter)
    assert not isinstance(formatter("text"), JsonFormatter)
    with pytest.raises(ValueError):
        formatter("xml")
    assert build_parser().parse_args(["--standalone", "--log-format", "json"]).log_format == "json"


@pytest.fixture
def server() -> Iterator[tuple[CloneServer, int]]:
    http = free_port()
    srv = CloneServer(ServerConfig(port=free_base_port(), bind="127.0.0.1", http_port=http))
    srv.start()
    yield srv, http
    srv.stop()


def _get(port: int, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        return reply.status, reply.read()


def test_in_process_http_port(server: tuple[CloneServer, int]) -> None:
    srv, http = server
    code, body = _get(http, "/metrics")
    assert code == 200
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"clone_sequence", "clone_role", "clone_subscribers", "clone_snapshot_seconds"} <= names
    assert "clone_peer_up" not in names  # standalone: no peer
    (build,) = [f for f in text_string_to_metric_families(body.decode())
                if f.name == "clone_build_info"]
    assert [(s.labels, s.value) for s in build.samples] == [
        ({"version": RELEASE, "format": str(FORMAT_VERSION)}, 1.0)
    ]
    assert json.loads(_get(http, "/healthz")[1]) == {"role": "active", "sequence": 0}
    assert _get(http, "/")[1].startswith(b"<!doctype html>")
    assert b"WebSocket" in _get(http, "/status.js")[1]

    # A plain PUB: its connections are counted from the socket monitor.
    ctx = zmq.Context()
    try:
        subs = []
        for _ in range(2):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(f"tcp://127.0.0.1:{srv.config.port + 1}")
            subs.append(sub)
        eventually(lambda: srv.monitor.subscribers == 2, 5, "two subscribers")
        subs.pop().close()
        eventually(lambda: srv.monitor.subscribers == 1, 5, "one subscriber left")
    finally:
        ctx.destroy(linger=0)


def test_writes_made_before_the_first_push_are_in_the_rate(
    server: tuple[CloneServer, int],
) -> None:
    """The rate's baseline is taken when the HTTP port starts, not at the first
    tick: writes made before that tick (a loaded machine) still count."""
    srv, _ = server
    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(f"tcp://127.0.0.1:{srv.config.port + 2}")
        assert pub.poll(5000)  # the collector subscribed
        pub.recv()
        for i in range(5):
            uuid = (i + 1).to_bytes(16, "big")
            pub.send_multipart([f"/r/{i}".encode(), bytes(8), uuid, b"", b"v"])
        eventually(lambda: srv.core.store.sequence == 5, 5, "the writes applied")

        def rates() -> list[float]:
            return [r for _, r in srv.monitor.page_status()["rate_history"]]

        eventually(lambda: len(rates()) >= 2, 5, "two rate samples")
        assert any(r > 0 for r in rates()), rates()
    finally:
        ctx.destroy(linger=0)


def test_http_port_in_use_stops_the_start() -> None:
    http = free_port()
    first = CloneServer(ServerConfig(port=free_base_port(), bind="127.0.0.1", http_port=http))
    first.start()
    try:
        second = CloneServer(ServerConfig(port=free_base_port(), bind="127.0.0.1", http_port=http))
        with pytest.raises(Exception, match="HTTP port"):
            second.start()
    finally:
        first.stop()
