"""The passive server's pending list and the uuid window, sans-IO."""

from __future__ import annotations

import sys
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.server.pending import PendingList, UuidWindow, update_id
from clone.wire.codec import KVMsg


def _msg(n: int, key: str = "k", body: bytes = b"v") -> KVMsg:
    return KVMsg(key, 0, n.to_bytes(16, "big"), (), body)


def test_window_remembers_the_last_n_ids() -> None:
    window = UuidWindow(3)
    for uid in (b"a", b"b", b"c"):
        assert window.add(uid, 0.0)
    assert not window.add(b"a", 0.0)
    window.add(b"d", 0.0)  # evicts a
    assert b"a" not in window
    assert all(u in window for u in (b"b", b"c", b"d"))
    assert len(window) == 3


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 5), ids=st.lists(st.sampled_from([b"a", b"b", b"c", b"d",
       b"e", b"f", b"g", ("k", b"v")]), max_size=40))
def test_window_answers_as_a_list_of_the_last_ids(capacity: int, ids: list[object]) -> None:
    """The newest id is held beside the set, not in it: membership, order,
    length and the horizon are those of a plain list of the last ids."""
    window = UuidWindow(capacity)
    model: deque[tuple[object, float]] = deque()
    horizon = float("-inf")
    for now, uid in enumerate(ids):
        fresh = all(uid != u for u, _ in model)
        assert window.add(uid, float(now)) is fresh  # type: ignore[arg-type]
        if fresh:
            model.append((uid, float(now)))
            if len(model) > capacity:
                horizon = max(horizon, model.popleft()[1])
        assert window.ids() == [u for u, _ in model] and len(window) == len(model)
        for probe in {*ids, b"z"}:
            assert (probe in window) == any(probe == u for u, _ in model)
        assert window.span(100.0) == max(0.0, 100.0 - horizon)


def test_a_full_default_window_keeps_its_set_at_half_the_slots() -> None:
    """65,536 ids in a set take 4 MiB of slots, 65,535 take 2 MiB: the newest
    is kept beside it (the memory per key at fleet scale)."""
    window = UuidWindow(65_536)
    for n in range(100_000):
        window.add(n.to_bytes(16, "big"), 0.0)
    assert len(window) == 65_536 and sys.getsizeof(window._set) < 2_200_000
    assert (99_999).to_bytes(16, "big") in window and (34_463).to_bytes(16, "big") not in window


def test_window_rejects_a_zero_capacity() -> None:
    with pytest.raises(ValueError):
        UuidWindow(0)


def test_update_id_is_the_uuid_or_the_content() -> None:
    assert update_id(_msg(1)) == (1).to_bytes(16, "big")
    assert update_id(KVMsg("k", 0, b"", (), b"v")) == ("k", b"v")


def test_pending_keeps_arrival_order_and_confirms_in_o1() -> None:
    pending = PendingList(max_items=10, max_age=60)
    for i in range(5):
        assert pending.add(_msg(i), now=float(i))
    assert not pending.add(_msg(2), now=9.0)  # same uuid: already parked
    assert pending.confirm(update_id(_msg(1)))
    assert not pending.confirm(update_id(_msg(1)))
    drained = pending.drain()
    assert [p.msg.uuid[-1] for p in drained] == [0, 2, 3, 4]
    assert [p.arrived for p in drained] == [0.0, 2.0, 3.0, 4.0]
    assert len(pending) == 0


def test_pending_is_bounded_by_count_dropping_the_oldest() -> None:
    pending = PendingList(max_items=3, max_age=60)
    for i in range(5):
        pending.add(_msg(i), now=0.0)
    assert [p.msg.uuid[-1] for p in pending] == [2, 3, 4]
    assert pending.dropped == 2


def test_pending_is_bounded_by_bytes_dropping_the_oldest() -> None:
    # Keys of 1 byte, values of 512 KB: 4 fit in 2 MiB + 4 bytes, the 5th pushes one out.
    kb512 = b"v" * (512 * 1024)
    pending = PendingList(max_items=100_000, max_age=60, max_bytes=4 * (1 + len(kb512)))
    for i in range(6):
        pending.add(_msg(i, body=kb512), now=0.0)
    assert [p.msg.uuid[-1] for p in pending] == [2, 3, 4, 5]
    assert pending.dropped == 2 and pending.nbytes == 4 * (1 + len(kb512))
    assert pending.confirm(_msg(3).uuid)
    assert pending.nbytes == 3 * (1 + len(kb512))
    pending.expire(now=61.0)
    assert pending.nbytes == 0 and len(pending) == 0
    # One update larger than the bound is still parked (alone).
    pending.add(_msg(9, body=kb512 * 5), now=0.0)
    assert len(pending) == 1


def test_pending_bytes_follow_retain_and_drain() -> None:
    pending = PendingList(max_items=10, max_age=60, max_bytes=0)  # 0: no byte bound
    for i in range(4):
        pending.add(_msg(i, body=b"x" * 10), now=0.0)
    assert pending.nbytes == 4 * 11
    pending.retain(lambda p: p.msg.uuid[-1] % 2 == 0)
    assert pending.nbytes == 2 * 11
    pending.drain()
    assert pending.nbytes == 0


def test_pending_is_bounded_by_age() -> None:
    pending = PendingList(max_items=100, max_age=10)
    for i in range(5):
        pending.add(_msg(i), now=float(i * 5))  # 0, 5, 10, 15, 20
    assert pending.expire(now=21.0) == 3  # arrived at or before 11
    assert [p.arrived for p in pending] == [15.0, 20.0]
    assert pending.dropped == 3


@pytest.mark.parametrize(("max_items", "max_age"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_pending_rejects_bad_bounds(max_items: int, max_age: float) -> None:
    with pytest.raises(ValueError):
        PendingList(max_items, max_age)
