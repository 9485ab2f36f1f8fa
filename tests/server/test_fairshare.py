"""Snapshot slots, turns and loop time shared by host (clone.server.fairshare): pure."""

from __future__ import annotations

import pytest

from clone.server.fairshare import (
    READER_WEIGHT,
    HostRoundRobin,
    SliceShares,
    SliceWindows,
    crowded_host,
    host_weights,
    over_share,
    paced,
    sheltered,
    yielder,
)

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


@pytest.mark.parametrize(
    ("slots", "asker", "crowded"),
    [
        ({A: 64}, B, A),  # a flood from A: B's first request takes one of A's
        ({A: 63, B: 1}, B, A),  # B's second (a re-ask on a fresh socket) too
        ({A: 2}, B, A),
        ({A: 1}, B, None),  # one more than B: taking it would only swap the two
        ({A: 32, B: 32}, B, None),  # equal shares stay
        ({A: 33, B: 31}, B, A),
        ({A: 63, B: 1}, A, None),  # the crowded host never takes from a smaller one
        ({A: 64}, A, None),  # one host alone: as before, it waits
        ({}, A, None),
        ({A: 40, B: 20, C: 4}, C, A),  # the host with the most gives
        ({A: 20, B: 20, C: 4}, C, A),  # of equals, the first
        ({None: 10}, A, None),  # streams of an unknown host never give a slot up
        ({None: 10, A: 2}, A, None),
        ({A: 5}, None, None),  # nor does a request of an unknown host take one
    ],
)
def test_crowded_host(slots: dict[str | None, int], asker: str | None,
                      crowded: str | None) -> None:  # fmt: skip
    assert crowded_host(slots, asker) == crowded


@pytest.mark.parametrize(
    ("hosts", "host", "over"),
    [
        ([A] * 64, A, False),  # the only host: its new streams start at once, as before
        ([A] * 63 + [B], A, True),  # a flood's new streams wait for their host's turns
        ([A] * 63 + [B], B, False),  # the other host's start at once
        ([A, A, B, B], A, False),  # equal shares
        ([A, A, A, B, B, C], A, True),  # 3 of 6 slots among 3 hosts: over 2
        ([A, A, B, B, C, C], C, False),
        ([None, None, A], None, True),  # unknown hosts count as one host
        ([], A, False),
    ],
)
def test_over_share(hosts: list[str | None], host: str | None, over: bool) -> None:
    assert over_share(hosts, host) is over


def test_the_yielding_stream_is_the_crowded_hosts_stalest() -> None:
    hosts = {"a1": A, "a2": A, "a3": A, "b1": B}
    progress = {"a1": 5.0, "a2": 2.0, "a3": 9.0, "b1": 1.0}
    assert yielder(hosts, progress, C) == "a2"  # not b1, staler but of a host with one
    assert yielder(hosts, progress, B) == "a2"
    assert yielder(hosts, progress, A) is None
    assert yielder({"a1": A}, {"a1": 0.0}, B) is None
    assert yielder({}, {}, B) is None


def test_a_flooders_request_cannot_take_an_idle_slot_from_a_host_holding_fewer() -> None:
    hosts = {"a1": A, "a2": A, "a3": A, "b1": B, "c1": C, "c2": C, "c3": C, "n1": None}
    assert sheltered(hosts, A) == {"b1", "n1"}  # C holds as many as A: not sheltered
    assert sheltered(hosts, B) == set()  # n1's host (unknown) holds 1, as many as B
    assert sheltered(hosts, C) == {"b1", "n1"}
    assert sheltered(hosts, "10.9.9.9") == set()  # a host holding none takes from anyone
    assert sheltered(hosts, None) == set()


def test_the_round_robin_takes_one_stream_of_each_host_in_turn() -> None:
    q: HostRoundRobin[str] = HostRoundRobin()
    for stream in ("a1", "a2", "a3"):
        q.add(stream, A)
    q.add("b1", B)
    q.add("n1", None)
    q.add("a1", A)  # already queued: keeps its place
    assert len(q) == 5 and "b1" in q and "x" not in q
    assert [q.pop() for _ in range(6)] == ["a1", "b1", "n1", "a2", "a3", None]
    assert len(q) == 0


def test_a_host_woken_again_goes_to_the_back_of_the_round() -> None:
    q: HostRoundRobin[str] = HostRoundRobin()
    q.add("a1", A)
    q.add("a2", A)
    q.add("b1", B)
    assert q.pop() == "a1"
    q.add("a1", A)  # pumped, and wants another turn: behind a2, after B
    assert q.pop() == "b1"
    q.add("b1", B)
    assert [q.pop() for _ in range(3)] == ["a2", "b1", "a1"]


def test_hosts_with_queued_streams_in_round_order() -> None:
    q: HostRoundRobin[str] = HostRoundRobin()
    assert q.hosts() == []
    for stream, host in [("a1", A), ("b1", B), ("a2", A), ("x", None)]:
        q.add(stream, host)
    assert q.hosts() == [A, B, None]
    assert q.pop() == "a1" and q.hosts() == [B, None, A]
    q.discard("b1")
    assert q.hosts() == [None, A]


def test_discard_and_clear() -> None:
    q: HostRoundRobin[str] = HostRoundRobin()
    q.add("a1", A)
    q.add("b1", B)
    q.discard("a1")
    q.discard("a1")  # idempotent
    q.discard("zz")
    assert list(q) == ["b1"] and q.pop() == "b1" and q.pop() is None
    q.add("a1", A)
    q.clear()
    assert len(q) == 0 and q.pop() is None


# A slice of 10 ms from t=100.0 among hosts (host -> weight); each step:
# (host, now, spent before asking) -> the stop it gets (None: its share or
# the slice is spent).
@pytest.mark.parametrize(
    ("weights", "steps"),
    [
        # One host: the whole slice, as before the shares.
        ({A: 1}, [(A, 100.000, 0.0, 100.010), (A, 100.004, 0.004, 100.010),
                  (A, 100.010, 0.006, None)]),
        # Two hosts: 5 ms each; A's spent share does not touch B's.
        ({A: 1, B: 1}, [(A, 100.000, 0.0, 100.005), (A, 100.005, 0.005, None),
                        (B, 100.005, 0.0, 100.010), (B, 100.006, 0.001, 100.010)]),
        # B used less than its share, but the slice ends at 100.010.
        ({A: 1, B: 1}, [(B, 100.008, 0.0, 100.010), (B, 100.011, 0.001, None)]),
        # Four hosts: 2.5 ms each, whatever the others spent.
        ({A: 1, B: 1, C: 1, "d": 1},
         [(A, 100.000, 0.0, 100.0025), (B, 100.0025, 0.0, 100.005),
          (A, 100.005, 0.0025, None), (C, 100.005, 0.0, 100.0075)]),
        # No host holds a slot yet (the first request): one share, the slice.
        ({}, [(A, 100.000, 0.0, 100.010)]),
        # A reader's host (weight 4) against a flooder's: 8 ms and 2 ms.
        ({A: READER_WEIGHT, B: 1}, [(B, 100.000, 0.0, 100.002), (B, 100.002, 0.002, None),
                                    (A, 100.002, 0.0, 100.010)]),
        ({A: READER_WEIGHT, B: 1}, [(A, 100.000, 0.0, 100.008), (A, 100.008, 0.008, None),
                                    (B, 100.008, 0.0, 100.010)]),
        # Two readers and a flooder: 4/9, 4/9 and 1/9 of the slice.
        ({A: READER_WEIGHT, B: 1, C: READER_WEIGHT},
         [(B, 100.000, 0.0, 100.0 + 0.010 / 9), (C, 100.001, 0.0, 100.001 + 0.040 / 9)]),
        # A host not weighed (its first request this turn) weighs 1.
        ({A: 1, B: 1}, [(C, 100.000, 0.0, 100.005)]),
        ({A: READER_WEIGHT}, [(C, 100.000, 0.0, 100.0025)]),
    ],
)
def test_slice_shares(weights: dict[str | None, int],
                      steps: list[tuple[str, float, float, float | None]]) -> None:  # fmt: skip
    shares = SliceShares(100.0, 0.010, weights)
    for host, now, spent, stop in steps:
        shares.spend(host, spent)
        got = shares.stop_for(host, now)
        assert got == (None if stop is None else pytest.approx(stop)), (host, now)


@pytest.mark.parametrize(
    ("hosts", "readers", "weights"),
    [
        # A flood from B, and A's requester that has read past the kernel's buffers.
        ({"a1": A, "b1": B, "b2": B, "b3": B}, {"a1"}, {A: READER_WEIGHT, B: 1}),
        # Neither has shown it reads: equal weights (a healthy client's first windows).
        ({"a1": A, "b1": B, "b2": B}, set(), {A: 1, B: 1}),
        # One reader among a host's streams weighs the host as a reader.
        ({"a1": A, "b1": B, "b2": B}, {"b2"}, {A: 1, B: READER_WEIGHT}),
        ({"b1": B, "b2": B, "b3": B}, {"b1", "b3"}, {B: READER_WEIGHT}),
        # An unknown host's streams count as a host of their own.
        ({"x": None, "a1": A}, {"x"}, {None: READER_WEIGHT, A: 1}),
        # A reader no longer holding a slot counts for nothing.
        ({"a1": A}, {"gone"}, {A: 1}),
        ({}, set(), {}),
    ],
)
def test_host_weights(hosts: dict[str, str | None], readers: set[str],
                      weights: dict[str | None, int]) -> None:  # fmt: skip
    assert host_weights(hosts, readers) == weights


def test_paced_only_with_a_reader_and_a_host_that_has_not_shown_it() -> None:
    assert paced({A: READER_WEIGHT, B: 1})
    assert not paced({A: 1, B: 1})  # nobody has shown it reads: per turn, as before
    assert not paced({A: READER_WEIGHT, B: READER_WEIGHT})  # readers use all the time
    assert not paced({A: 1}) and not paced({})


def test_slices_are_per_turn_without_a_reader() -> None:
    windows = SliceWindows(0.010)
    first = windows.open(100.000, {A: 1, B: 1}, [A, B])
    first.spend(B, 0.005)
    second = windows.open(100.006, {A: 1, B: 1}, [A, B])
    assert second is not first and second.stop_for(B, 100.006) == pytest.approx(100.011)
    assert windows.wait(100.006, [B]) == 0.0


def test_a_flooder_that_spent_its_share_waits_for_the_next_slice() -> None:
    # A (a reader) against B (requesters that have shown nothing): B's 2 ms
    # of each 10 ms of wall time, however often the loop turns.
    weights = {A: READER_WEIGHT, B: 1}
    windows = SliceWindows(0.010)
    first = windows.open(100.000, weights, [B])
    assert first.stop_for(B, 100.000) == pytest.approx(100.002)
    first.spend(B, 0.002)
    # The next turn, 1 ms later: the same slice, B's share spent.
    again = windows.open(100.003, weights, [B])
    assert again is first and again.stop_for(B, 100.003) is None
    assert windows.wait(100.003, [B]) == pytest.approx(0.007)
    # A's stream wakes meanwhile: no wait for it, and its share is whole.
    assert windows.wait(100.003, [A, B]) == 0.0
    assert windows.open(100.003, weights, [A, B]).stop_for(A, 100.003) == pytest.approx(100.010)
    # The slice over: a new one, B's share again.
    later = windows.open(100.010, weights, [B])
    assert later is not first and later.stop_for(B, 100.010) == pytest.approx(100.012)


def test_a_reader_that_spent_its_share_opens_the_next_slice_at_once() -> None:
    weights = {A: READER_WEIGHT, B: 1}
    windows = SliceWindows(0.010)
    first = windows.open(100.000, weights, [A, B])
    first.spend(A, 0.008)
    first.spend(B, 0.001)
    assert windows.wait(100.009, [A]) == 0.0
    second = windows.open(100.009, weights, [A, B])
    assert second is not first and second.stop_for(A, 100.009) == pytest.approx(100.017)


def test_new_weights_open_a_new_slice() -> None:
    windows = SliceWindows(0.010)
    first = windows.open(100.000, {A: 1, B: READER_WEIGHT}, [A])
    first.spend(A, 0.002)
    # A's requester has now shown it reads: both readers, per turn again.
    second = windows.open(100.003, {A: READER_WEIGHT, B: READER_WEIGHT}, [A])
    assert second is not first and second.stop_for(A, 100.003) == pytest.approx(100.008)
    assert windows.wait(100.003, [A]) == 0.0
    assert SliceWindows(0.010).wait(100.0, [A]) == 0.0  # no slice yet
