"""Snapshot slots shared by host, against a real server: requesters from one
host that hold every slot, reading slowly, give one up to a client on
another host at once; one more of theirs waits."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from clone import Clone
from clone.wire.protocol import ICANHAZ, KTHXBAI
from tests.support.bulk import fill_store
from tests.support.servers import ServerProcess, Servers, read_stats

pytestmark = pytest.mark.slow

SLOTS = 8
KEYS = 600  # of 60 KiB: 36 MB, about 18 s for a reader of one message every 30 ms


def _slow_readers(port: int, n: int, stop: Any) -> None:
    """``n`` requesters from 127.0.0.2, each reading one message every 30 ms:
    they make progress (no idle slot to evict) and hold their slots for longer
    than the test takes."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)  # its libzmq takes no more than it reads
        s.setsockopt(zmq.RCVBUF, 65536)
        s.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")
        s.send_multipart([ICANHAZ, b""])
        socks.append(s)
    done = 0
    while not stop.wait(0.03) and done < n:
        for s in socks:
            if s.poll(0) and s.recv_multipart()[0] == KTHXBAI:
                done += 1
    ctx.destroy(linger=0)


def _stats_until(server: ServerProcess, check: Callable[[dict[str, Any]], bool], what: str) -> None:
    """Until ``check(stats)``; the ceiling only bounds a hang.  Asked every
    0.1 s, not every 10 ms: each answer is a 4 KB log line, and a failed
    test's log dump (its last 200 KB) held nothing else.  A timeout says the
    slot counters (``snapshots_evicted``: a reader evicted as idle, which
    the server's ``--snapshot-slot-idle 10`` rules out here)."""
    deadline = time.monotonic() + 60
    while not check(stats := read_stats(server)):
        if time.monotonic() > deadline:
            slots = {k: v for k, v in stats.items() if k.startswith("snapshots_")}
            raise AssertionError(f"timed out after 60 s waiting for {what}: {slots}")
        time.sleep(0.1)


def test_a_host_holding_every_slot_yields_one_to_a_client_on_another_host(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    # A reader starved of CPU for a quarter second (or a server that was) is
    # not what this test is about: with --snapshot-slot-idle 0.25, the
    # default, a loaded machine had a reading requester evicted as idle and
    # the request that should wait took its slot (docs/testing.md).
    solo = servers.standalone("--max-snapshots", str(SLOTS), "--snapshot-stall-timeout", "60",
                              "--snapshot-slot-idle", "10")
    fill_store(solo.port, KEYS, value_bytes=60 * 1024)
    stop = multiprocessing.Event()
    readers = multiprocessing.Process(target=_slow_readers, args=(solo.port, SLOTS, stop))
    readers.start()
    try:
        _stats_until(solo, lambda st: st["snapshots_in_flight"] == SLOTS,
                     "every slot taken by the slow readers")  # fmt: skip
        started = time.monotonic()
        with Clone([f"tcp://127.0.0.1:{solo.port}"]) as client:
            client.wait_synced(60)
            assert len(client.items("/fleet/node-")) == KEYS
        took = time.monotonic() - started
        stats = read_stats(solo)
        # A slot of theirs, not one that came free: the others still read.
        assert stats["snapshots_yielded"] >= 1 and stats["snapshots_evicted"] == 0, stats
        assert stats["snapshots_in_flight"] == SLOTS - 1, stats
        assert took < 15, took
        # Two more requests from their host: one takes the client's slot, now
        # free, the other waits (its host holds them all).
        more = [ctx.socket(zmq.DEALER) for _ in range(2)]
        for sock in more:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.2:0;127.0.0.1:{solo.port}")
            sock.send_multipart([ICANHAZ, b""])
        _stats_until(solo, lambda st: st["snapshots_queued"] >= 1, "a request waiting")
        assert read_stats(solo)["snapshots_yielded"] == stats["snapshots_yielded"]
        for sock in more:
            sock.close()
    finally:
        stop.set()
        readers.join(30)
        if readers.is_alive():
            readers.kill()
