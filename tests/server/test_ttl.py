"""The ttl parser and the expiry heap, with explicit times (no clock)."""

from __future__ import annotations

import random

import pytest

from clone.errors import ProtocolError
from clone.server.ttl import ExpiryHeap, format_expires, parse_expires, parse_ttl
from clone.wire.protocol import MAX_TTL_SECONDS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, 0.0),
        ("0", 0.0),
        ("30", 30.0),
        ("1.5", 1.5),
        (".5", 0.5),
        ("2.", 2.0),
        (str(int(MAX_TTL_SECONDS)), MAX_TTL_SECONDS),
    ],
)
def test_parse_ttl_accepts_decimal_seconds(text: str | None, expected: float) -> None:
    assert parse_ttl(text) == expected


@pytest.mark.parametrize(
    "text",
    ["abc", "", "-1", "1e3", "inf", "nan", " 5", "5 ", "1_000", "0x10", str(MAX_TTL_SECONDS + 1)],
)
def test_parse_ttl_rejects_anything_else(text: str) -> None:
    with pytest.raises(ProtocolError):
        parse_ttl(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, None), ("12.5", 12.5), ("abc", None), ("-3", None), ("inf", None), ("nan", None)],
)
def test_parse_expires(text: str | None, expected: float | None) -> None:
    assert parse_expires(text) == expected


def test_format_expires_round_trips_to_the_millisecond() -> None:
    assert parse_expires(format_expires(1700000000.1234)) == pytest.approx(1700000000.123)


def test_due_returns_keys_in_deadline_order_once() -> None:
    heap = ExpiryHeap()
    heap.schedule("b", 20.0)
    heap.schedule("a", 10.0)
    heap.schedule("c", 30.0)
    assert heap.due(5.0) == []
    assert heap.due(25.0) == ["a", "b"]
    assert heap.due(25.0) == []
    assert len(heap) == 1
    assert heap.next_deadline() == 30.0


def test_reschedule_and_cancel_are_lazy() -> None:
    heap = ExpiryHeap()
    heap.schedule("k", 10.0)
    heap.schedule("k", 50.0)  # the 10.0 tuple goes stale
    assert heap.due(20.0) == []
    assert heap.deadline("k") == 50.0
    heap.cancel("k")
    assert heap.due(100.0) == []
    assert "k" not in heap
    assert heap.next_deadline() is None


def test_due_limit_bounds_one_call() -> None:
    heap = ExpiryHeap()
    for i in range(10):
        heap.schedule(f"k{i}", float(i))
    assert heap.due(100.0, limit=4) == ["k0", "k1", "k2", "k3"]
    assert len(heap.due(100.0)) == 6


def test_stale_tuples_are_compacted() -> None:
    heap = ExpiryHeap()
    for i in range(20_000):
        heap.schedule("same", float(i))
    assert len(heap) == 1
    assert len(heap._heap) < 3_000  # compaction kept the stale tail bounded


def test_rebuild_replaces_everything() -> None:
    heap = ExpiryHeap()
    heap.schedule("old", 1.0)
    heap.rebuild({"x": 5.0, "y": 3.0})
    assert heap.due(10.0) == ["y", "x"]


def test_random_operations_match_a_model() -> None:
    rng = random.Random(7)
    heap = ExpiryHeap()
    model: dict[str, float] = {}
    now = 0.0
    for _ in range(5_000):
        key = f"k{rng.randrange(50)}"
        op = rng.random()
        if op < 0.5:
            deadline = now + rng.uniform(0, 20)
            heap.schedule(key, deadline)
            model[key] = deadline
        elif op < 0.7:
            heap.cancel(key)
            model.pop(key, None)
        else:
            now += rng.uniform(0, 5)
            expected = sorted((d, k) for k, d in model.items() if d <= now)
            got = heap.due(now)
            assert got == [k for _, k in expected]
            for k in got:
                del model[k]
        assert len(heap) == len(model)
