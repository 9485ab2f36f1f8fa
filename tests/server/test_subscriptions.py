"""The subscription ledger, the inbound allowance and the subscriber budget's
high-water mark, with literal values; the inbound watch with an explicit clock."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest
import zmq

from clone.server.subscribers import InboundWatch
from clone.server.subscriptions import (
    MAX_PUBLICATION_BYTES,
    InboundAllowance,
    SubscriptionLedger,
    SubscriptionLimits,
    Verdict,
    subscriber_hwm,
)
from clone.wire.protocol import MAX_KEY_BYTES, MAX_PROPERTIES_BYTES, MAX_VALUE_BYTES


def ledger(count: int = 3, nbytes: int = 10, drop_after: int = 2) -> SubscriptionLedger:
    return SubscriptionLedger(SubscriptionLimits(count, nbytes, drop_after))


def test_accepts_up_to_the_count_then_refuses_then_drops() -> None:
    led = ledger(count=3, nbytes=0, drop_after=2)
    assert [led.subscribe(7, t) for t in (b"/a", b"/b", b"/c")] == [Verdict.ACCEPT] * 3
    assert led.held(7) == (3, 6)
    assert led.subscribe(7, b"/d") is Verdict.REFUSE
    assert led.subscribe(7, b"/e") is Verdict.DROP
    # What libzmq had read from it before the drop is ignored, even a topic it held.
    assert led.subscribe(7, b"/a") is Verdict.IGNORE
    assert led.held(7) == (0, 0)


def test_bytes_cap_counts_topic_bytes() -> None:
    led = ledger(count=0, nbytes=10, drop_after=5)
    assert led.subscribe(1, b"0123456789") is Verdict.ACCEPT  # exactly 10: at the cap
    assert led.subscribe(1, b"x") is Verdict.REFUSE
    assert led.held(1) == (1, 10)
    assert led.unsubscribe(1, b"0123456789")
    assert led.subscribe(1, b"x") is Verdict.ACCEPT
    assert led.held(1) == (1, 1)


def test_a_topic_held_again_is_accepted_without_counting_twice() -> None:
    led = ledger(count=1, nbytes=0)
    assert led.subscribe(1, b"") is Verdict.ACCEPT
    assert led.subscribe(1, b"") is Verdict.ACCEPT
    assert led.held(1) == (1, 0)


def test_connections_are_counted_apart() -> None:
    led = ledger(count=1, nbytes=0, drop_after=1)
    assert led.subscribe(1, b"/a") is Verdict.ACCEPT
    assert led.subscribe(2, b"/a") is Verdict.ACCEPT
    assert led.subscribe(1, b"/b") is Verdict.DROP
    assert led.subscribe(2, b"/a") is Verdict.ACCEPT


def test_unsubscribe_of_a_topic_not_held_is_not_applied() -> None:
    led = ledger()
    assert not led.unsubscribe(1, b"/never")
    led.subscribe(1, b"/a")
    assert led.unsubscribe(1, b"/a")
    assert not led.unsubscribe(1, b"/a")


def test_a_new_connection_on_a_reused_descriptor_starts_clean() -> None:
    led = ledger(count=1, nbytes=0, drop_after=1)
    led.subscribe(5, b"/a")
    assert led.subscribe(5, b"/b") is Verdict.DROP
    led.connected(5)  # the monitor's ACCEPTED for a new connection on fd 5
    assert led.subscribe(5, b"/b") is Verdict.ACCEPT
    led.disconnected(5)
    assert len(led) == 0
    assert led.held(5) == (0, 0)


def test_no_limits() -> None:
    led = ledger(count=0, nbytes=0)
    for i in range(1000):
        assert led.subscribe(1, b"/%d" % i) is Verdict.ACCEPT


@pytest.mark.parametrize(
    ("count", "nbytes", "drop_after"), [(-1, 0, 1), (0, -1, 1), (1, 1, 0)]
)
def test_bad_limits(count: int, nbytes: int, drop_after: int) -> None:
    with pytest.raises(ValueError):
        SubscriptionLimits(count, nbytes, drop_after)


def test_largest_publication_covers_the_protocol_limits() -> None:
    assert MAX_PUBLICATION_BYTES >= MAX_KEY_BYTES + MAX_VALUE_BYTES + MAX_PROPERTIES_BYTES + 24


@pytest.mark.parametrize(
    ("budget", "hwm", "largest", "expected"),
    [
        (64 * 2**20, 100_000, 2**20, 64),  # the budget binds
        (64 * 2**20, 10, 2**20, 10),  # --hwm binds when lower
        (100, 100_000, 2**20, 1),  # a budget below one update still lets one through
        (0, 5000, 2**20, 5000),  # no budget: --hwm alone
        (64 * 2**20, 0, 2**20, 64),  # no --hwm: the budget alone
        (0, 0, 2**20, 0),  # neither: libzmq's no limit
    ],
)
def test_subscriber_hwm(budget: int, hwm: int, largest: int, expected: int) -> None:
    assert subscriber_hwm(budget, hwm, largest) == expected


def test_subscriber_hwm_holds_in_bytes_for_any_mix() -> None:
    budget = 256 * 2**20
    hwm = subscriber_hwm(budget, 100_000)
    assert hwm * MAX_PUBLICATION_BYTES <= budget
    assert (hwm + 1) * MAX_PUBLICATION_BYTES > budget


def test_subscriber_hwm_rejects_negative() -> None:
    with pytest.raises(ValueError):
        subscriber_hwm(-1, 0)


def test_inbound_allowance_from_the_caps() -> None:
    allowance = InboundAllowance.for_limits(SubscriptionLimits(16, 1024))
    assert allowance is not None
    assert allowance.burst == 2 * (1024 + 64 * 16) + 2048 == 6144
    assert allowance.allows(6144, 0.0)
    assert not allowance.allows(6145, 0.0)
    assert allowance.allows(6145 + 1023, 1.0)  # 1 KiB/s for ZMTP heartbeats
    assert not allowance.allows(6144 + 2049, 2.0)
    assert InboundAllowance.for_limits(SubscriptionLimits(0, 1024)) is None
    assert InboundAllowance.for_limits(SubscriptionLimits(16, 0)) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_inbound_watch_shuts_down_a_connection_past_its_allowance() -> None:
    """The kernel's byte count, an explicit clock, a real TCP connection (no zmq
    peer): past the allowance the connection is shut down and reported; within
    it, nothing happens; a descriptor that is now another socket is left alone."""
    ctx: zmq.Context[Any] = zmq.Context()
    monitor = ctx.socket(zmq.PAIR)  # never polled here: events are fed by hand
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    clock = _Clock()
    events: list[tuple[int, int]] = []
    drops: list[tuple[str, int]] = []
    watch = InboundWatch(
        monitor,
        InboundAllowance(burst=1000, rate=0.0),
        lambda e, v: events.append((e, v)),
        lambda peer, n: drops.append((peer, n)),
        clock=clock,
    )
    try:
        fd = server_side.fileno()
        watch.event(zmq.EVENT_ACCEPTED, fd)
        assert events == [(zmq.EVENT_ACCEPTED, fd)]
        client.sendall(b"x" * 1000)
        _eventually_received(server_side, 1000)
        assert watch.check(clock.now) == 0 and not drops
        client.sendall(b"x")
        _eventually_received(server_side, 1001)
        clock.now += 0.01  # past the next check (every 2 ms in the first second)
        assert watch.check(clock.now) == 1
        assert drops == [("127.0.0.1", 1001)]
        client.settimeout(10)
        assert client.recv(10) == b""  # the peer sees the end
        assert server_side.fileno() == fd  # our descriptor was not closed under us
    finally:
        watch.stop()
        for s in (client, server_side, listener):
            s.close()
        ctx.term()


def _eventually_received(sock: socket.socket, n: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
        if struct.unpack_from("=Q", info, 128)[0] >= n:
            return
        time.sleep(0.005)
    raise AssertionError(f"the kernel never counted {n} bytes")
