"""The server's queues bounded in bytes, against real servers with raw
zmq sockets as the attackers: snapshot requesters that never read, and a writer
that floods the collector with 512 KB updates.  Each checks the server's memory
(psutil RSS) against what the same attack took before the bounds, the counters
of the rule at the edge, and that a healthy client is still served."""

from __future__ import annotations

import os
import struct
import threading
import time
from typing import Any

import psutil
import pytest
import zmq

from clone import Clone
from clone.wire.protocol import COLLECTOR_OFFSET, ICANHAZ
from tests.support.bulk import fill_store
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

MB = 1024 * 1024


def _rss(server: ServerProcess) -> int:
    assert server.pid is not None
    return int(psutil.Process(server.pid).memory_info().rss)


class _PeakRss:
    """The server's largest RSS while the ``with`` block runs (sampled every 50 ms)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.peak = server, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss(self.server))

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _non_readers(ctx: zmq.Context[Any], port: int, n: int) -> list[zmq.Socket[Any]]:
    """``n`` DEALERs that ask for a snapshot and never read (1-message queue, 4 KB buffer)."""
    out = []
    for _ in range(n):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 1)
        d.setsockopt(zmq.RCVBUF, 4096)
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send_multipart([ICANHAZ, b""])
        out.append(d)
    return out


def test_snapshot_requesters_that_never_read_pin_a_bounded_number_of_bytes(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    # 16 slots sharing 4 MiB: 256 KiB each.  Before the byte windows each of
    # these requesters pinned up to --snapshot-hwm (10,000) messages: the
    # whole 18 MB store, 288 MB for the 16.
    solo = servers.standalone(
        "--snapshot-bytes", str(4 * MB), "--max-snapshots", "16",
        "--snapshot-stall-timeout", "3",
    )  # fmt: skip
    fill_store(solo.port, 300, value_bytes=60 * 1024)
    before = _rss(solo)
    with _PeakRss(solo) as rss:
        dealers = _non_readers(ctx, solo.port, 16)
        eventually(lambda: read_stats(solo)["snapshots_in_flight"] == 16, 60, "16 streams")
        # Every slot is taken by one that reads nothing: a healthy client gets
        # one of theirs and its whole snapshot.
        started = time.monotonic()
        with Clone([f"tcp://127.0.0.1:{solo.port}"], heartbeat=0.1) as client:
            client.wait_synced(60)
            assert len(client.items("/fleet/node-")) == 300
        took = time.monotonic() - started
        stats = read_stats(solo)
        assert stats["snapshots_evicted"] >= 1, stats
        # And after --snapshot-stall-timeout each of the rest loses its stream
        # (its connection too: TCP_MAXRT, so its queued bytes are freed).
        eventually(lambda: read_stats(solo)["snapshots_in_flight"] == 0, 60,
                   "the non-readers' streams gone")  # fmt: skip
        assert read_stats(solo)["snapshots_aborted"] >= 15
    assert rss.peak - before < 60 * MB, (before >> 20, rss.peak >> 20)
    assert took < 30, took
    assert "aborted after" in solo.log_text()
    for d in dealers:
        d.close()


def test_a_requester_that_asks_again_on_its_socket_has_one_stream(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    solo = servers.standalone("--snapshot-stall-timeout", "30")
    fill_store(solo.port, 200, value_bytes=60 * 1024)
    (dealer,) = _non_readers(ctx, solo.port, 1)
    eventually(lambda: read_stats(solo)["snapshots_in_flight"] == 1, 60, "its stream")
    for _ in range(3):
        dealer.send_multipart([ICANHAZ, b""])
    eventually(lambda: read_stats(solo)["snapshots_replaced"] == 3, 60, "replaced 3 times")
    # One stream left, the newest.  Waited for, not read once: the start-up
    # probe's second request (tests/support/servers.py) leaves a stream whose
    # socket closed, aborted after the 0.5 s unroutable grace; an idle machine
    # got here in 0.3 s.  A second stream of the dealer's would stay for the
    # 30 s stall timeout, past this ceiling.
    eventually(lambda: read_stats(solo)["snapshots_in_flight"] == 1, 20, "one stream in flight")
    dealer.close()


def test_a_flood_of_512_kb_writes_is_queued_in_bytes_not_messages(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    # 40 keys overwritten: the store stays at 20 MB while 300 MB go by.  At
    # the old collector high-water mark (100,000 messages) the server queued
    # what it had not applied yet: hundreds of MB (748 MB at half this rate).
    solo = servers.standalone("--history-bytes", str(8 * MB))
    before = _rss(solo)
    flood = ctx.socket(zmq.PUB)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)  # the attacker's own queue: its memory, not ours
    flood.connect(f"tcp://127.0.0.1:{solo.port + COLLECTOR_OFFSET}")
    body = os.urandom(512 * 1024)
    with _PeakRss(solo) as rss, Clone([f"tcp://127.0.0.1:{solo.port}"], heartbeat=0.1) as client:
        client.wait_synced(60)
        for i in range(600):
            uuid = struct.pack(">QQ", time.time_ns(), i)
            flood.send_multipart([b"/flood/%d" % (i % 40), bytes(8), uuid, b"", body])
        # A healthy writer on its own connection is still applied.
        client.set("/healthy", b"yes", wait=True, timeout=60)
        eventually(lambda: read_stats(solo)["kvset_received"] >= 600, 120, "the flood applied")
    assert rss.peak - before < 150 * MB, (before >> 20, rss.peak >> 20)
    stats = read_stats(solo)
    assert stats["collector_turns_cut"] > 0, stats  # 2 MiB per turn at most
    flood.close()
