"""A storm of snapshot requests, as after a failover: every one is answered and
the server's loop is never blocked (once, each queued request served from
the backlog loop went one stack level deeper, up to Python's recursion limit)."""

from __future__ import annotations

import time
from typing import Any

import psutil
import zmq

from tests.support.servers import ServerProcess, Servers
from tests.support.waiting import eventually


def _accepted(server: ServerProcess) -> int:
    """The TCP connections ``server`` holds open on its ROUTER port."""
    conns = psutil.Process(server.pid).net_connections(kind="tcp")
    return sum(
        1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == server.port
    )


def test_hundreds_of_simultaneous_snapshot_requests_are_all_answered(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    solo = servers.standalone()
    dealers = []
    try:
        for _ in range(400):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{solo.port}")
            dealers.append(d)
        # Every connection up, so the requests arrive together.
        eventually(lambda: _accepted(solo) >= len(dealers), 60, "400 connections accepted")
        for d in dealers:
            d.send_multipart([b"ICANHAZ?", b""])
        poller = zmq.Poller()
        for d in dealers:
            poller.register(d, zmq.POLLIN)
        answered: set[int] = set()
        deadline = time.monotonic() + 120  # bounds a hang only
        while len(answered) < len(dealers) and time.monotonic() < deadline:
            for sock, _ in poller.poll(200):
                while sock.poll(0):
                    if sock.recv_multipart()[0] == b"KTHXBAI":
                        answered.add(id(sock))
        assert len(answered) == len(dealers), f"{len(answered)} of {len(dealers)} answered"
    finally:
        for d in dealers:
            d.close(linger=0)
    text = solo.log_text()
    assert "RecursionError" not in text and "internal error" not in text, text[-3000:]
