"""The flood penalty (clone.server.penalty) and the publisher's door: pure, explicit times."""

from __future__ import annotations

from typing import Any

import pytest
import zmq

from clone.security.zap import ZAP_ENDPOINT
from clone.server.door import PublisherDoor
from clone.server.penalty import FloodPenalty


def test_an_address_is_refused_for_its_penalty_then_admitted() -> None:
    box = FloodPenalty(first=1.0, longest=60.0)
    assert box.admits("10.0.0.9", 100.0)
    assert box.punish("10.0.0.9", 100.0) == 1.0
    assert not box.admits("10.0.0.9", 100.5)
    assert box.admits("10.0.0.8", 100.5)  # another host is untouched
    assert box.admits("10.0.0.9", 101.0)
    assert (box.punished, box.refused) == (1, 1)


def test_a_host_that_floods_again_is_kept_out_twice_as_long_up_to_the_longest() -> None:
    box = FloodPenalty(first=1.0, longest=8.0, forget_after=300.0)
    now = 0.0
    lengths = []
    for _ in range(6):
        lengths.append(box.punish("h", now))
        now += lengths[-1] + 0.1  # admitted again, floods, is cut at once
    assert lengths == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_cuts_while_a_penalty_runs_do_not_lengthen_it() -> None:
    """16 connections admitted together are cut one after the other: one
    penalty, not 2^16 seconds of one."""
    box = FloodPenalty(first=1.0, longest=60.0)
    for i in range(16):
        assert box.punish("h", 10.0 + i * 0.01) == 1.0
    assert not box.admits("h", 11.0)
    assert box.admits("h", 11.2)
    assert box.punished == 16


def test_a_host_quiet_for_forget_after_starts_again_at_the_first_penalty() -> None:
    box = FloodPenalty(first=1.0, longest=60.0, forget_after=300.0)
    box.punish("h", 0.0)
    box.punish("h", 2.0)  # 2 s
    assert box.punish("h", 2.0 + 2.0 + 301.0) == 1.0


def test_memory_is_bounded_by_max_addresses() -> None:
    box = FloodPenalty(first=10.0, longest=60.0, forget_after=300.0, max_addresses=3)
    for i, host in enumerate(("a", "b", "c")):
        box.punish(host, float(i))
    box.punish("d", 3.0)  # full: the one whose penalty ends first (a) goes
    assert box.penalized(3.5) == 3
    assert box.admits("a", 3.5)
    assert not box.admits("d", 3.5)
    # Records past forget_after go first.
    box2 = FloodPenalty(first=1.0, longest=60.0, forget_after=5.0, max_addresses=2)
    box2.punish("old", 0.0)
    box2.punish("new", 9.0)
    box2.punish("newer", 9.5)
    assert not box2.admits("new", 9.6) and not box2.admits("newer", 9.6)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        FloodPenalty(first=0.0)
    with pytest.raises(ValueError):
        FloodPenalty(first=2.0, longest=1.0)


def _request(address: bytes) -> list[bytes]:
    return [b"1.0", b"7", b"clone-publisher", address, b"", b"NULL"]


def test_the_door_answers_200_or_a_temporary_300_from_the_penalty() -> None:
    box = FloodPenalty()
    now = [50.0]
    door = PublisherDoor(zmq.Context.instance(), box.admits, clock=lambda: now[0])
    assert door.answer(_request(b"10.1.1.1")) == [b"1.0", b"7", b"200", b"OK", b"", b""]
    box.punish("10.1.1.1", 50.0)
    assert door.answer(_request(b"10.1.1.1"))[2:4] == [b"300", b"flood penalty"]
    assert door.answer(_request(b"10.1.1.2"))[2] == b"200"
    now[0] = 51.0
    assert door.answer(_request(b"10.1.1.1"))[2] == b"200"
    assert door.answer([b"1.0", b"8"])[:3] == [b"1.0", b"8", b"500"]  # malformed


def test_a_door_whose_decision_fails_admits() -> None:
    def broken(address: str, now: float) -> bool:
        raise RuntimeError("bug")

    door = PublisherDoor(zmq.Context.instance(), broken)
    assert door.answer(_request(b"10.1.1.1"))[2] == b"200"


def test_stop_wakes_the_door_thread_out_of_its_poll() -> None:
    """stop() ends the door's thread at once, not when its poll times out (a
    minute here; stop joins for at most 2 s), and the door answered before."""
    ctx: zmq.Context[Any] = zmq.Context()
    door = PublisherDoor(ctx, lambda address, now: True)
    door.poll_ms = 60_000
    try:
        door.start()
        thread = door._thread
        assert thread is not None and thread.is_alive()
        zap = ctx.socket(zmq.REQ)
        zap.setsockopt(zmq.LINGER, 0)
        zap.connect(ZAP_ENDPOINT)
        zap.send_multipart(_request(b"10.1.1.1"))
        assert zap.poll(10_000), "the door did not answer"
        assert zap.recv_multipart()[2] == b"200"
        zap.close()
        door.stop()
        assert not thread.is_alive()
    finally:
        ctx.term()
