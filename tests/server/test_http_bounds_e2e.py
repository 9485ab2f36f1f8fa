"""The HTTP port's bounds against a real server: idle and half-sent
requests are closed, a viewer that does not read loses its slot to one that
does, and the connection cap refuses beyond it while CHP clients still sync."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import urllib.request

import pytest
from tornado.websocket import websocket_connect

from clone import Clone
from tests.support.ports import free_port
from tests.support.servers import Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` (reading what it sent)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def test_idle_and_half_sent_requests_are_closed(servers: Servers) -> None:
    http = free_port()
    servers.standalone("--in-memory", "--http-port", str(http), "--http-idle-timeout", "1")
    headers = socket.create_connection(("127.0.0.1", http))
    headers.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
    body = socket.create_connection(("127.0.0.1", http))
    body.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc")
    idle = socket.create_connection(("127.0.0.1", http))  # sends nothing at all
    try:
        for sock in (headers, body, idle):
            assert _closed_by_server(sock, 30), "a stalled HTTP connection was held open"
    finally:
        for sock in (headers, body, idle):
            sock.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/healthz", timeout=10) as reply:
        assert reply.status == 200


def _silent_viewer(port: int) -> socket.socket:
    """A WebSocket client that completes the handshake, then never reads."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(1)  # byte by byte: nothing past the headers is read
        assert chunk, "the server closed the upgrade"
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 101"), reply
    return sock


async def _view_once(port: int) -> dict[str, object] | None:
    """A reading viewer: its first status push, or None if it was turned away."""
    conn = await websocket_connect(f"ws://127.0.0.1:{port}/ws")
    try:
        message = await asyncio.wait_for(conn.read_message(), 10)
    finally:
        conn.close()
    return None if message is None else json.loads(message)


def test_a_viewer_that_does_not_read_loses_its_slot(servers: Servers) -> None:
    http = free_port()
    server = servers.standalone("--in-memory", "--http-port", str(http), "--http-viewers", "2")
    silent = [_silent_viewer(http), _silent_viewer(http)]
    try:
        admitted: list[dict[str, object]] = []

        def a_reader_gets_in() -> bool:
            status = asyncio.run(_view_once(http))
            if status is not None:
                admitted.append(status)
            return status is not None

        # At first both slots are fresh; once the silent ones miss their pings,
        # a reading viewer takes a slot.
        eventually(a_reader_gets_in, 60, "a reading viewer admitted")
        assert "role" in admitted[0]
        stats = read_stats(server)
        assert int(stats["http_viewers_evicted"]) >= 1  # type: ignore[call-overload]
        assert any(_closed_by_server(s, 10) for s in silent)
    finally:
        for sock in silent:
            sock.close()


def test_the_connection_cap_refuses_beyond_it_while_chp_still_syncs(servers: Servers) -> None:
    http = free_port()
    server = servers.standalone(
        "--in-memory", "--http-port", str(http), "--http-max-connections", "4",
        "--http-idle-timeout", "60",
    )  # fmt: skip
    held = [socket.create_connection(("127.0.0.1", http)) for _ in range(4)]
    try:
        # The fifth and later are closed as soon as they are accepted.
        extra = [socket.create_connection(("127.0.0.1", http)) for _ in range(6)]
        for sock in extra:
            assert _closed_by_server(sock, 30), "a connection beyond the cap was kept"
            sock.close()
        eventually(lambda: int(read_stats(server)["http_connections_refused"]) >= 6,  # type: ignore[call-overload]
                   30, "refusals counted")
        with Clone(f"tcp://127.0.0.1:{server.port}") as client:
            client.wait_synced(10)
            assert client.set("/cap/k", b"v", wait=True, timeout=10)
    finally:
        for sock in held:
            sock.close()

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/healthz", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    eventually(healthy, 30, "the HTTP port serves again once the held connections close")
