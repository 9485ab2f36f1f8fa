"""The split writes' queue: what a healing server sends, resends, applies or
gives up per loop turn (clone.server.pacing), with explicit times."""

from __future__ import annotations

import pytest

from clone.server.core import ServerCore
from clone.server.pacing import SplitQueue, send_allowance


def call(n: int) -> list[bytes]:
    """A ``set`` call's frames; only the uuid (frame 2) matters here."""
    return [b"CALL?", b"set", n.to_bytes(16, "big"), b"/k", b"", b"v"]


def uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def ids(frames: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(f[2], "big") for f in frames]


@pytest.mark.parametrize(
    "kwargs", [{"max_in_flight": 0}, {"resend": 0.0}, {"give_up": -1.0}]
)
def test_limits_must_be_positive(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SplitQueue(**kwargs)  # type: ignore[arg-type]


def test_no_more_than_max_in_flight_are_unanswered_and_an_answer_frees_a_slot() -> None:
    q = SplitQueue(max_in_flight=3, resend=1.0, give_up=60.0)
    assert q.add((call(n) for n in range(10)), 0.0) == 10
    assert ids(q.sends(0.0, 100)) == [0, 1, 2]
    assert ids(q.sends(0.1, 100)) == []  # all slots taken, none due again
    assert (q.in_flight, q.unsent, len(q)) == (3, 7, 10)
    assert q.answered(uuid(1), 0.2) == tuple(call(1))
    assert ids(q.sends(0.2, 100)) == [3]
    assert q.answered(uuid(1), 0.3) is None  # answered twice: not ours any more


def test_a_turn_sends_at_most_its_limit() -> None:
    q = SplitQueue(max_in_flight=100)
    q.add((call(n) for n in range(10)), 0.0)
    assert ids(q.sends(0.0, 4)) == [0, 1, 2, 3]
    assert ids(q.sends(0.0, 4)) == [4, 5, 6, 7]


def test_unanswered_calls_are_resent_after_the_resend_time_oldest_first() -> None:
    q = SplitQueue(max_in_flight=2, resend=1.0)
    q.add((call(n) for n in range(3)), 0.0)
    assert ids(q.sends(0.0, 1)) == [0]
    assert ids(q.sends(0.5, 10)) == [1]
    assert ids(q.sends(0.9, 10)) == []
    assert ids(q.sends(1.0, 10)) == [0]  # due; 1 is not yet
    assert ids(q.sends(1.5, 10)) == [1]
    assert q.resent == 2
    q.answered(uuid(0), 1.6)
    assert ids(q.sends(1.6, 10)) == [2]


def test_a_call_queued_twice_is_one_call() -> None:
    q = SplitQueue()
    assert q.add([call(1), call(2)], 0.0) == 2
    q.sends(0.0, 1)
    assert q.add([call(1), call(2), call(3)], 0.0) == 1
    assert len(q) == 3


def test_take_hands_out_in_flight_then_unsent_in_order() -> None:
    q = SplitQueue(max_in_flight=2)
    q.add((call(n) for n in range(5)), 0.0)
    q.sends(0.0, 10)
    assert ids(q.take(3)) == [0, 1, 2]
    assert ids(q.take(10)) == [3, 4]
    assert len(q) == 0 and q.take(10) == []


def test_it_is_stalled_only_after_give_up_seconds_without_an_answer() -> None:
    q = SplitQueue(max_in_flight=1, resend=1.0, give_up=10.0)
    assert not q.stalled(100.0)  # empty
    q.add([call(1), call(2)], 5.0)
    assert not q.stalled(100.0)  # nothing sent yet: nothing to wait for
    q.sends(5.0, 10)
    assert not q.stalled(14.9)
    q.answered(uuid(1), 14.5)  # progress: a big backlog answered steadily is no stall
    assert not q.stalled(40.0)  # held back (nothing in flight): no stall either
    q.sends(40.0, 10)  # waiting starts again now
    assert not q.stalled(49.75)
    assert q.stalled(50.0)


def test_answers_say_how_far_the_winner_got() -> None:
    q = SplitQueue()
    q.add([call(1), call(2)], 0.0)
    q.sends(0.0, 10)
    q.answered(uuid(2), 0.1, sequence=907)
    q.answered(uuid(1), 0.1, sequence=906)
    assert q.answered_up_to == 907
    q.restart(1.0)
    assert q.answered_up_to == 0


@pytest.mark.parametrize(
    ("answered_up_to", "following_at", "allowed"),
    [(0, 0, 256), (100, 100, 256), (100, 40, 196), (1000, 40, 0), (10, 500, 256)],
)
def test_the_loser_sends_no_further_ahead_of_its_following_than_the_bound(
    answered_up_to: int, following_at: int, allowed: int
) -> None:
    assert send_allowance(answered_up_to, following_at, max_ahead=256) == allowed


def test_restart_makes_every_call_in_flight_due_and_restarts_the_give_up() -> None:
    q = SplitQueue(max_in_flight=2, resend=1.0, give_up=10.0)
    q.add((call(n) for n in range(3)), 0.0)
    q.sends(0.0, 10)
    q.restart(20.0)
    assert not q.stalled(29.0)
    assert ids(q.sends(20.0, 10)) == [0, 1]


def test_clear_returns_everything_oldest_first() -> None:
    q = SplitQueue(max_in_flight=1)
    q.add((call(n) for n in range(3)), 0.0)
    q.sends(0.0, 10)
    assert ids(q.clear()) == [0, 1, 2]
    assert len(q) == 0


def test_a_long_backlog_drains_in_bounded_slices() -> None:
    """100,000 calls: every turn touches at most its limit, whatever the backlog."""
    q = SplitQueue(max_in_flight=256)
    q.add((call(n) for n in range(100_000)), 0.0)
    now, turns, answered = 0.0, 0, 0
    while q:
        sent = q.sends(now, 256)
        assert len(sent) <= 256 and q.in_flight <= 256
        for frames in sent:
            assert q.answered(frames[2], now) is not None
            answered += 1
        now += 0.001
        turns += 1
    assert answered == 100_000 and turns == 100_000 // 256 + 1


# -- the core's kept writes, converted to calls a slice at a time ---------------


def _written_in_split(n: int) -> tuple[ServerCore, ServerCore]:
    """A at term 1 with B following; B elected at term 2 (fork: nothing yet);
    A writes ``n`` keys meanwhile, then steps down and resyncs from B."""
    a, b = ServerCore(), ServerCore()
    a.term = 1
    a.become_active(0.0)
    b.become_passive()
    b.start_sync()
    b.term = 2
    b.become_active(1.0)
    for i in range(n):
        a.on_kvset([f"/k/{i}".encode(), bytes(8), uuid(i + 1), b"", b"v"], 2.0)
    a.become_passive()
    a.start_sync()
    stream = b.open_snapshot(b"peer", "", applied=True, now=3.0)
    while not stream.done:
        frames = stream.peek()
        if frames is not None:
            a.on_snapshot_reply(list(frames[1:]), 3.0)
            stream.advance()
    return a, b


def test_the_kept_writes_become_the_same_calls_whatever_the_slices() -> None:
    whole, _ = _written_in_split(50)
    everything = list(whole.split_calls)
    sliced, _ = _written_in_split(50)
    assert sliced.split_left == 50
    got: list[list[bytes]] = []
    while sliced.split_left:
        part = sliced.take_split_calls(7)
        assert len(part) <= 7
        got += part
    assert got == everything and ids(got) == list(range(1, 51))
    assert sliced.counters["split_writes_found"] == whole.counters["split_writes_found"] == 50


def test_dropping_the_kept_writes_says_how_many() -> None:
    a, _ = _written_in_split(20)
    a.take_split_calls(5)
    assert (a.drop_split_calls(), a.split_left, a.take_split_calls(10)) == (15, 0, [])
