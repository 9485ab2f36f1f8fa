"""The subscription ledger and the inbound allowance with literal values; the
inbound watch (floods, stalled subscribers) with an explicit clock."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest
import zmq

from clone.server.subscribers import InboundWatch
from clone.server.subscriptions import (
    InboundAllowance,
    SubscriptionLedger,
    SubscriptionLimits,
    Verdict,
)


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


def test_the_watch_polls_until_a_check_is_due_rounded_up_never_spinning() -> None:
    """A check due in under a millisecond waits a whole millisecond: rounded
    down to 0, the watch polled again and again without sleeping until the
    check came (half a CPU-second for every new connection, whose checks come
    every 2 ms in its first second)."""
    ctx: zmq.Context[Any] = zmq.Context()
    monitor = ctx.socket(zmq.PAIR)  # never polled here
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    clock = _Clock()
    watch = InboundWatch(monitor, None, lambda e, v: None, lambda peer, n: None, clock=clock)
    try:
        assert watch.poll_timeout_ms(clock.now) == 50  # nothing to check: the old pace
        watch.event(zmq.EVENT_ACCEPTED, server_side.fileno())
        assert watch.poll_timeout_ms(clock.now) == 0  # a new connection is due at once
        watch.check(clock.now)  # young: the next check 2 ms on
        for ahead_ms, timeout_ms in ((0.3, 2), (1.0, 1), (1.7, 1), (1.9999, 1), (2.0, 0)):
            assert watch.poll_timeout_ms(clock.now + ahead_ms / 1000) == timeout_ms, ahead_ms
        clock.now += 5.0  # old now: checked every 50 ms, and the wait is capped at 100
        watch.check(clock.now)
        assert watch.poll_timeout_ms(clock.now + 0.0495) == 1
        assert watch.poll_timeout_ms(clock.now - 1.0) == 100
    finally:
        watch.stop()
        for s in (client, server_side, listener):
            s.close()
        ctx.term()


def test_stop_wakes_the_watch_thread_out_of_its_poll() -> None:
    """stop() ends the thread at once, not when its poll times out: with a
    poll of a minute, the thread is gone when stop() returns (it joins for at
    most 2 s).  Waiting out the 100 ms poll was most of every server's stop."""
    ctx: zmq.Context[Any] = zmq.Context()
    monitor = ctx.socket(zmq.PAIR)  # nothing arrives on it
    watch = InboundWatch(monitor, None, lambda e, v: None, lambda peer, n: None)
    watch.longest_wait_ms = 60_000
    watch._old_every = 60.0  # nothing due for a minute either
    try:
        watch.start()
        thread = watch._thread
        assert thread is not None and thread.is_alive()
        watch.stop()
        assert not thread.is_alive()
        assert monitor.closed
        watch.stop()  # twice is fine
    finally:
        ctx.term()


def _eventually_received(sock: socket.socket, n: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
        if struct.unpack_from("=Q", info, 128)[0] >= n:
            return
        time.sleep(0.005)
    raise AssertionError(f"the kernel never counted {n} bytes")


def test_inbound_watch_cuts_off_a_subscriber_that_reads_nothing_past_its_budget() -> None:
    """A real TCP connection whose peer never reads, the publisher's byte count
    by hand: reported slow after 1 s, cut off once more than the budget was
    published since it last acknowledged anything."""
    ctx: zmq.Context[Any] = zmq.Context()
    monitor = ctx.socket(zmq.PAIR)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server_side, _ = listener.accept()
    server_side.setblocking(False)
    clock = _Clock()
    published = [0]
    slow: list[tuple[str, int]] = []
    cuts: list[tuple[str, int]] = []
    watch = InboundWatch(
        monitor,
        None,
        lambda e, v: None,
        lambda peer, n: None,
        lambda peer, n: slow.append((peer, n)),
        budget=1_000_000,
        published=lambda: published[0],
        on_cut=lambda peer, n: cuts.append((peer, n)),
        clock=clock,
    )
    try:
        watch.event(zmq.EVENT_ACCEPTED, server_side.fileno())
        chunk = b"u" * 65536
        try:  # fill the kernel both ways: the peer reads nothing
            while True:
                published[0] += server_side.send(chunk)
        except BlockingIOError:
            pass
        watch.check(clock.now)  # the last acknowledgement seen
        clock.now += 2.0
        watch.check(clock.now)
        assert len(slow) == 1 and slow[0][0] == "127.0.0.1" and not cuts
        clock.now += 0.1
        published[0] += 999_999  # queued in the server, not yet past the budget
        watch.check(clock.now)
        assert not cuts
        published[0] += 2
        clock.now += 0.1
        assert watch.check(clock.now) == 1
        assert cuts == [("127.0.0.1", 1_000_001)]
        assert len(slow) == 1  # reported once per stall
    finally:
        watch.stop()
        for s in (client, server_side, listener):
            s.close()
        ctx.term()
