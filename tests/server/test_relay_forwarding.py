"""How a relay forwards one KVSET, on real zmq sockets but no server process:
the relay's :class:`~clone.server.forwarding.Forwarder` part, driven alone, with
a PUB set up as the relay's upstream PUB (``ZMQ_IMMEDIATE``, ``XPUB_NODROP``)
and a collector SUB on loopback.

What a full queue does cannot be shown reliably with whole processes (the
relay would go stale first); here the collector simply stops reading.  The
part is built with what it needs: the PUB, the shared counters and throttle,
and a ``publish`` that records.  Every socket is closed with linger 0.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from clone.ratelimit import Throttle
from clone.server.forwarding import ANY_WRITER, Forwarder
from clone.server.shared import Shared
from clone.wire.control import Refusal, decode_control
from tests.support.ports import free_port

UUID = bytes(range(16))


class _Harness:
    """A plain relay's forwarder, with what it publishes recorded."""

    def __init__(self, pub: zmq.Socket[Any], *, named: bool = False) -> None:
        self.counters: Counter[str] = Counter()
        throttle = Throttle(logging.getLogger("test.relay"), time.monotonic)
        self.shared = Shared(throttle, counters=self.counters)
        self.published: list[list[bytes]] = []
        self.told: list[tuple[str | None, bytes, str]] = []
        self.stale = False
        self.part = Forwarder(
            pub,
            self.shared,
            stale=lambda: self.stale,
            publish=self.published.append,
            refuse=self._refuse if named else None,
        )

    def _refuse(self, name: str | None, uuid: bytes, reason: str) -> None:
        self.told.append((name, uuid, reason))

    def forward(self, frames: list[bytes], *, stale: bool) -> bool:
        return self.part.forward(frames, stale=stale)

    def refusals(self) -> list[Refusal]:
        out = [decode_control(frames) for frames in self.published]
        assert all(isinstance(r, Refusal) for r in out)
        return out  # type: ignore[return-value]


@pytest.fixture
def link(ctx: zmq.Context[Any]) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """An upstream PUB, as the relay sets it up, connected to a collector SUB.

    On the tracked ``ctx``: a setup that fails leaves no open socket behind.
    One left in a context of the fixture's own once hung the worker's next
    test for its whole timeout, when the garbage collector ended the context
    before its sockets (``term()`` waits for every socket)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{free_port()}")
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 1)
    pub.setsockopt(zmq.SNDBUF, 4096)
    pub.setsockopt(zmq.IMMEDIATE, 1)
    pub.setsockopt(zmq.XPUB_NODROP, 1)
    pub.connect(sub.getsockopt(zmq.LAST_ENDPOINT).decode())
    # Connected and subscribed once a probe gets through (the ceiling bounds a hang).
    deadline = time.monotonic() + 30
    while not sub.poll(10):
        assert time.monotonic() < deadline, "the PUB never reached the SUB"
        try:
            pub.send(b"probe", zmq.NOBLOCK)
        except zmq.Again:
            pass  # the pipe (one message) holds a probe still on its way: wait for it
    while sub.poll(50):
        sub.recv_multipart()
    try:
        yield pub, sub
    finally:
        pub.close(linger=0)
        sub.close(linger=0)


def _kvset(n: int, size: int = 0) -> list[bytes]:
    return [b"/k", bytes(8), n.to_bytes(16, "big"), b"", b"v" * max(size, 1)]


def test_a_fresh_relay_forwards_and_tells_nobody(
    link: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = link
    relay = _Harness(pub)
    assert relay.forward(_kvset(1), stale=False)
    assert sub.poll(2000) and sub.recv_multipart() == _kvset(1)
    assert relay.counters["kvset_forwarded"] == 1 and not relay.published


def test_a_stale_relay_sends_nothing_and_refuses_to_everyone(
    link: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = link
    relay = _Harness(pub)
    frames = [b"/k", bytes(8), UUID, b"", b"v"]
    assert not relay.forward(frames, stale=True)
    assert not sub.poll(300)
    assert relay.refusals() == [Refusal(ANY_WRITER, UUID, "stale")]
    assert relay.counters["kvset_refused_stale"] == 1 and relay.counters["kvset_forwarded"] == 0
    # A KVSET without a uuid names no write to refuse: counted, no notice.
    assert not relay.forward([b"/k", bytes(8), b"", b"", b"v"], stale=True)
    assert relay.counters["kvset_refused_stale"] == 2 and len(relay.published) == 1


def test_a_full_queue_to_the_pair_refuses_overloaded(
    link: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, _sub = link  # the collector reads no more
    relay = _Harness(pub)
    sent = 0
    for n in range(1, 10_001):
        if not relay.forward(_kvset(n, 64 * 1024), stale=False):
            break
        sent += 1
    else:
        pytest.fail("10,000 KVSETs of 64 KiB went into a queue nobody reads")
    assert relay.counters["kvset_forwarded"] == sent
    assert relay.counters["kvset_forward_dropped"] == 1
    (refusal,) = relay.refusals()
    assert (refusal.reason, refusal.uuid) == ("overloaded", (sent + 1).to_bytes(16, "big"))


def test_as_the_collectors_sink_it_asks_stale_once_a_turn_and_remembers_writers(
    link: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    """Serving over CURVE: a forwarded write's writer is remembered (so the
    pair's refusal reaches it), a refusal goes to the writer by name.  (One
    write per link: its pipes hold one message and reopen lazily.)"""
    pub, sub = link
    relay = _Harness(pub, named=True)
    relay.part.begin()
    relay.part.take([b"/k", bytes(8), UUID, b"", b"v"], "alice")
    relay.stale = True  # read at a turn's start only: this turn still forwards
    relay.part.end()
    assert sub.poll(2000) and sub.recv_multipart()[2] == UUID
    assert relay.counters["kvset_forwarded"] == 1
    assert relay.part.writers.take(UUID, time.monotonic()) == "alice"
    relay.part.begin()  # now stale: refused, told by name, nothing published
    relay.part.take([b"/k", bytes(8), UUID, b"", b"v"], "alice")
    relay.part.end()
    assert relay.told == [("alice", UUID, "stale")] and not relay.published
    assert relay.counters["kvset_refused_stale"] == 1
