"""A storm of snapshot requests, as after a failover: every one is answered and
the server's loop is never blocked (once, each queued request served from
the backlog loop went one stack level deeper, up to Python's recursion limit)."""

from __future__ import annotations

import time

import zmq

from tests.support.servers import Servers


def test_hundreds_of_simultaneous_snapshot_requests_are_all_answered(servers: Servers) -> None:
    solo = servers.standalone()
    ctx = zmq.Context()
    dealers = []
    try:
        for _ in range(400):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{solo.port}")
            dealers.append(d)
        time.sleep(0.5)  # every connection up: the requests arrive together
        for d in dealers:
            d.send_multipart([b"ICANHAZ?", b""])
        poller = zmq.Poller()
        for d in dealers:
            poller.register(d, zmq.POLLIN)
        answered: set[int] = set()
        deadline = time.monotonic() + 20
        while len(answered) < len(dealers) and time.monotonic() < deadline:
            for sock, _ in poller.poll(200):
                while sock.poll(0):
                    if sock.recv_multipart()[0] == b"KTHXBAI":
                        answered.add(id(sock))
        assert len(answered) == len(dealers), f"{len(answered)} of {len(dealers)} answered"
    finally:
        for d in dealers:
            d.close(linger=0)
        ctx.term()
    text = solo.log_text()
    assert "RecursionError" not in text and "internal error" not in text, text[-3000:]
