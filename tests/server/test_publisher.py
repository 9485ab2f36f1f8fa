"""The publisher part (clone.server.publishing.Publisher) driven alone: a real
PUB and SUB on loopback, and loop turns run by hand."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from clone.server.publishing import Publisher


class _Turns:
    """The loop: callbacks scheduled for the next turn, run by :meth:`run`."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []
        self.running = True

    def schedule(self, callback: Callable[[], None]) -> bool:
        if not self.running:
            return False
        self.pending.append(callback)
        return True

    def run(self) -> int:
        """Run one turn; how many callbacks ran."""
        now, self.pending = self.pending, []
        for callback in now:
            callback()
        return len(now)


@pytest.fixture
def wire(ctx: zmq.Context[Any]) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """A PUB and a SUB subscribed to everything, connected (a probe got through)."""
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    deadline = time.monotonic() + 10
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the SUB never connected"
        pub.send(b"probe")
    while sub.poll(50):
        sub.recv_multipart()
    try:
        yield pub, sub
    finally:
        sub.close(0)
        pub.close(0)


def _received(sub: zmq.Socket[Any], n: int) -> list[bytes]:
    got = []
    for _ in range(n):
        assert sub.poll(10_000), f"only {len(got)} of {n} arrived"
        got.append(sub.recv_multipart()[0])
    assert not sub.poll(50)
    return got


def test_a_single_publication_goes_at_once(wire: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    pub, sub = wire
    turns = _Turns()
    publisher = Publisher(turns.schedule, chunk=2)
    publisher.install(pub)
    publisher.publish([b"a", b"1"])
    assert turns.pending == [] and len(publisher) == 0
    assert _received(sub, 1) == [b"a"]


def test_bulk_goes_a_chunk_per_turn_and_later_ones_join_its_tail(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = wire
    turns = _Turns()
    publisher = Publisher(turns.schedule, chunk=2)
    publisher.install(pub)
    publisher.publish_bulk([[b"b1"], [b"b2"], [b"b3"]])
    publisher.publish([b"single"])  # behind the bulk, never ahead of it
    assert len(publisher) == 4
    assert turns.run() == 1
    assert len(publisher) == 2
    assert turns.run() == 1
    assert len(publisher) == 0
    assert turns.run() == 0  # nothing left: no further turn asked for
    assert _received(sub, 4) == [b"b1", b"b2", b"b3", b"single"]


def test_held_while_bound_again_then_drained_on_the_new_socket(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = wire
    turns = _Turns()
    publisher = Publisher(turns.schedule, chunk=10)
    publisher.hold()
    publisher.publish([b"x"])
    publisher.publish_bulk([[b"y"]])
    assert turns.run() == 1  # the drain runs, but sends nothing while held
    assert len(publisher) == 2
    publisher.install(pub)
    assert turns.run() == 1
    assert _received(sub, 2) == [b"x", b"y"]


def test_drop_forgets_the_queue(wire: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    pub, sub = wire
    turns = _Turns()
    publisher = Publisher(turns.schedule, chunk=1)
    publisher.install(pub)
    publisher.publish_bulk([[b"1"], [b"2"], [b"3"]])
    assert publisher.drop() == 3
    assert publisher.drop() == 0
    turns.run()
    assert not sub.poll(100)


def test_without_a_loop_nothing_is_scheduled_until_there_is_one(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = wire
    turns = _Turns()
    turns.running = False
    publisher = Publisher(turns.schedule, chunk=5)
    publisher.install(pub)
    publisher.publish_bulk([[b"1"]])
    assert turns.pending == []
    turns.running = True
    publisher.publish_bulk([[b"2"]])  # asks again: the first ask found no loop
    assert turns.run() == 1
    assert _received(sub, 2) == [b"1", b"2"]
