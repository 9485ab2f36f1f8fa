"""A broken or hostile server cannot make a client allocate without limit.

The hostile server (:mod:`tests.support.hostile_server`) runs in a process of its
own, so the memory it spends on huge frames is not the client's, and its
messages really cross TCP.  Each test lists it first and a good fake server
second (silent, like a passive one, until the hostile server has done its
worst), then checks that the client counted or dropped what it got, stayed
responsive, did not grow, and goes on working with the good server.

Why 64 MiB and not 2 GiB: the cap (:data:`clone.wire.frames.MAX_FRAME_BYTES`,
a little over 1 MiB; :data:`~clone.wire.frames.MAX_SYNC_FRAME_BYTES` for the
snapshot DEALER) is checked by libzmq on the frame's announced size, before it
allocates anything, so any frame over the cap shows it.  64 MiB is some
twenty times the larger cap and would show plainly in the client's RSS if it
were received (libzmq's buffer plus the ``bytes`` copy: 128 MiB), while a
2 GiB frame would cost the sender 2 GiB and seconds to stream, and prove
nothing more.
"""

from __future__ import annotations

import select
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from clone import Clone
from tests.support.fake_server import FakeServer
from tests.support.hostile_server import HEARTBEAT, HUGE_FRAME_BYTES
from tests.support.ports import free_base_port
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
# Growth allowed while the hostile server does its worst: a client that took a
# single huge frame would grow by at least HUGE_FRAME_BYTES.
MAX_GROWTH = HUGE_FRAME_BYTES // 2


class Hostile:
    """The hostile server's process: ``endpoint`` to connect to, ``kill()``."""

    def __init__(self, proc: subprocess.Popen[str], endpoint: str) -> None:
        self.proc = proc
        self.endpoint = endpoint

    def kill(self) -> None:
        """Kill it: its kernel closes its connections, as for a crashed server."""
        self.proc.kill()
        self.proc.wait(10)


@contextmanager
def hostile_server(mode: str) -> Iterator[Hostile]:
    """Start the hostile server in ``mode``; yield it; always kill it."""
    port = free_base_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.hostile_server", str(port), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], 20.0)
        started = readable and proc.stdout.readline().strip() == "ready"
        assert started, "the hostile server did not start"
        yield Hostile(proc, f"tcp://127.0.0.1:{port}")
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


class PeakRSS:
    """The highest RSS of this process (the client's agent thread is in it),
    sampled every millisecond: a received 64 MiB frame lives far longer."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


@pytest.fixture
def good() -> Iterator[FakeServer]:
    with FakeServer(heartbeat=HEARTBEAT) as srv:
        srv.silent = True  # until the hostile server has had its go
        yield srv


def keeps_working(c: Clone, good: FakeServer, left: Callable[[], None] = lambda: None) -> None:
    """The client answers at once, and works with the good server once it speaks."""
    assert c.status().state in ("syncing", "active")  # a command round trip
    left()
    good.silent = False
    eventually(lambda: c.status().server == good.endpoint, what="the move to the good server")
    c.wait_synced(10)
    c.set("after", b"1", wait=True, timeout=10)
    assert c.get("after") == b"1"


def test_an_overlong_message_is_cut_short_counted_and_dropped(good: FakeServer) -> None:
    with hostile_server("frames") as hostile, PeakRSS() as rss:
        with Clone([hostile.endpoint, good.endpoint], heartbeat=HEARTBEAT) as c:
            c.wait_synced(10)  # the 100-frame snapshot reply did not stop the sync
            # Several 100-frame publications, each dropped as one bad message.
            eventually(lambda: c.status().protocol_errors >= 3, what="overlong messages counted")
            status = c.status()
            assert status.server == hostile.endpoint and status.state == "active"
            assert c.get("k") is None
            assert rss.growth < MAX_GROWTH, rss.growth
            keeps_working(c, good, left=hostile.kill)  # the client fails over


@pytest.mark.parametrize("mode", ["huge-pub", "huge-sync"])
def test_a_frame_over_the_cap_costs_the_server_its_connection(good: FakeServer, mode: str) -> None:
    # Asking the huge-sync server for a whole second: ten requests, ten huge replies.
    timeout = 1.0 if mode == "huge-sync" else None
    with hostile_server(mode) as hostile, PeakRSS() as rss:
        with Clone(
            [hostile.endpoint, good.endpoint], heartbeat=HEARTBEAT, server_timeout=timeout
        ) as c:
            if mode == "huge-pub":
                # Synced, then the huge KVPUB: libzmq drops the connection and
                # the client fails over as for any lost server.
                eventually(lambda: c.status().counters["disconnects"] >= 1, what="the drop")
            else:
                # Only huge KVSYNCs: no snapshot data ever, so the client moves on.
                eventually(lambda: c.status().failovers >= 1, what="the failover")
            assert c.get("huge") is None
            # Dropped by libzmq, unread: the codec never saw a value over its limit.
            assert c.status().protocol_errors == 0
            assert rss.growth < MAX_GROWTH, rss.growth
            keeps_working(c, good)
            assert rss.growth < MAX_GROWTH, rss.growth
