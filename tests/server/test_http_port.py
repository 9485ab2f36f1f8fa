"""The HTTP port part (clone.server.http.HttpPort) driven alone: no CloneServer,
a fake StatusSource (what the port may read of a server, and nothing else),
its own IOLoop in a thread, real HTTP requests on loopback."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tornado.ioloop import IOLoop

from clone.ratelimit import Throttle
from clone.server.config import ServerConfig
from clone.server.http import HttpPort
from clone.server.metrics import DurationHistogram
from clone.server.shared import Shared
from tests.support.ports import free_base_port, free_port
from tests.support.waiting import eventually


class _Source:
    """A server as the HTTP port sees it: settable health and readiness."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.snapshot_seconds = DurationHistogram()
        self.serving = True
        self.ready: tuple[bool, str] = (True, "active")
        self.sequence = 0

    def stats(self) -> dict[str, int | float | str]:
        return {"sequence": self.sequence, "role": "active", "keys": 0}

    @property
    def subscribers(self) -> int | None:
        return 3

    @property
    def peer_alive(self) -> bool:
        return False

    def readiness(self) -> tuple[bool, str]:
        return self.ready

    def health(self) -> tuple[bool, str, int]:
        return self.serving, "active", self.sequence

    def page_fields(self) -> dict[str, Any]:
        return {"role": "active", "sequence": self.sequence}


class _Running:
    def __init__(self, port: HttpPort, source: _Source, http: int, loop: IOLoop) -> None:
        self.port, self.source, self.http, self.loop = port, source, http, loop

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}{path}", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


@pytest.fixture
def running() -> Iterator[_Running]:
    http = free_port()
    config = ServerConfig(port=free_base_port(), bind="127.0.0.1", http_port=http, heartbeat=0.2)
    source = _Source(config)
    shared = Shared(Throttle(logging.getLogger("test.http"), time.monotonic))
    shared.counters["internal_errors"] = 0
    loop: IOLoop | None = None
    port: HttpPort | None = None
    opened = threading.Event()
    failed: list[BaseException] = []

    def main() -> None:
        nonlocal loop, port
        loop = IOLoop(make_current=False)
        port = HttpPort(config, shared, loop, source)
        try:
            port.open()
        except BaseException as exc:
            failed.append(exc)
        opened.set()
        if not failed:
            loop.start()
        loop.close(all_fds=False)

    thread = threading.Thread(target=main, name="test-http", daemon=True)
    thread.start()
    assert opened.wait(10) and not failed, failed
    assert loop is not None and port is not None
    try:
        yield _Running(port, source, http, loop)
    finally:
        done = threading.Event()

        def stop() -> None:
            assert port is not None and loop is not None
            port.close()
            loop.stop()
            done.set()

        loop.add_callback(stop)
        assert done.wait(10)
        thread.join(10)


def test_health_and_readiness_come_from_the_source(running: _Running) -> None:
    assert running.get("/healthz") == (200, b'{"role": "active", "sequence": 0}')
    running.source.serving = False
    code, body = running.get("/healthz")
    assert code == 503 and json.loads(body)["reason"] == "stopping"
    running.source.ready = (False, "passive with 2 client updates pending")
    code, body = running.get("/readyz")
    assert code == 503
    assert json.loads(body) == {
        "ready": False,
        "role": "active",
        "sequence": 0,
        "reason": "passive with 2 client updates pending",
    }


def test_metrics_are_read_from_the_source_at_each_scrape(running: _Running) -> None:
    running.source.sequence = 42
    code, body = running.get("/metrics")
    assert code == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["clone_subscribers"].samples[0].value == 3
    assert families["clone_sequence"].samples[0].value == 42


def test_the_page_gets_the_sources_fields_and_the_ports_rate(running: _Running) -> None:
    running.source.sequence = 10  # ten updates since the baseline taken at open
    eventually(
        lambda: json.loads(running.get("/status.json")[1])["rate"] > 0, 10, "a rate sampled"
    )
    page = json.loads(running.get("/status.json")[1])
    assert page["sequence"] == 10 and page["role"] == "active"
    assert page["rate_history"] and page["rate_history"][-1][1] == round(page["rate"], 2)
    assert running.port.counters() == {
        "http_connections_refused": 0,
        "http_viewers_refused": 0,
        "http_viewers_evicted": 0,
        "http_viewers_timed_out": 0,
    }
