"""The bounded history of recent updates: contiguity, eviction, covers/since."""

from __future__ import annotations

import pytest

from clone.server.history import History


def upd(seq: int, body: bytes = b"v", key: bytes = b"/k") -> list[bytes]:
    """A KVPUB's five frames at ``seq``."""
    return [key, seq.to_bytes(8, "big"), b"", b"", body]


def size(frames: list[bytes]) -> int:
    return sum(map(len, frames))


def filled(first: int, last: int, **limits: int) -> History:
    h = History(limits.get("max_updates", 1000), limits.get("max_bytes", 1 << 20))
    for seq in range(first, last + 1):
        h.append(upd(seq), term=1)
    return h


@pytest.mark.parametrize(("updates", "nbytes"), [(0, 10), (10, 0), (-1, 10), (10, -5)])
def test_limits_must_be_positive(updates: int, nbytes: int) -> None:
    with pytest.raises(ValueError):
        History(updates, nbytes)


def test_new_history_is_empty_and_accepts_any_first_update() -> None:
    h = History(10, 1000)
    assert (len(h), h.first, h.last, h.base, h.bytes, h.keep_from) == (0, None, None, 0, 0, 1)
    h.append(upd(500), term=3)
    assert (h.first, h.last, h.base, h.restarts) == (500, 500, 499, 0)
    assert h.entry(500) == (upd(500), 3)


def test_contiguous_appends_are_held_in_order() -> None:
    h = filled(1, 5)
    assert (len(h), h.first, h.last, h.base, h.keep_from) == (5, 1, 5, 0, 1)
    assert h.bytes == 5 * size(upd(1))
    assert [f[1] for f in h.since(0)] == [upd(s)[1] for s in range(1, 6)]


def test_eviction_by_count_drops_the_oldest() -> None:
    h = filled(1, 10, max_updates=3)
    assert (len(h), h.first, h.last, h.base, h.keep_from) == (3, 8, 10, 7, 8)
    assert h.bytes == 3 * size(upd(1))
    assert h.entry(7) is None and h.entry(8) is not None


def test_eviction_by_bytes_drops_the_oldest_and_tracks_bytes() -> None:
    one = size(upd(1))
    h = filled(1, 10, max_bytes=4 * one + 1)
    assert (len(h), h.first, h.last) == (4, 7, 10)
    assert h.bytes == 4 * one
    h.append(upd(11, body=b"x" * (2 * one)), term=1)  # 3*one bytes: pushes two out
    assert (h.first, h.last) == (10, 11)
    assert h.bytes == one + size(upd(11, body=b"x" * (2 * one)))


def test_an_update_larger_than_the_byte_limit_is_still_kept() -> None:
    h = filled(1, 3, max_bytes=100)
    h.append(upd(4, body=b"x" * 500), term=1)
    assert (len(h), h.first, h.last) == (1, 4, 4)
    assert h.bytes == size(upd(4, body=b"x" * 500))
    h.append(upd(5), term=1)  # the big one goes once there is a newer one
    assert (len(h), h.first, h.last) == (1, 5, 5)
    assert h.bytes == size(upd(5))


@pytest.mark.parametrize("seq", [7, 5, 3, 1, 100])
def test_a_non_contiguous_update_restarts_the_history(seq: int) -> None:
    h = filled(1, 5)
    h.append(upd(seq, body=b"new"), term=2)
    assert (len(h), h.first, h.last, h.base, h.restarts) == (1, seq, seq, seq - 1, 1)
    assert h.bytes == size(upd(seq, body=b"new"))
    assert h.entry(seq) == (upd(seq, body=b"new"), 2)
    h.append(upd(seq + 1), term=2)
    assert (h.last, h.restarts) == (seq + 1, 1)


def test_reset_empties_and_anchors_the_next_sequence() -> None:
    h = filled(1, 5)
    h.reset(40)
    assert (len(h), h.first, h.last, h.base, h.bytes, h.keep_from) == (0, None, None, 40, 0, 41)
    assert h.covers(40) and not h.covers(39) and not h.covers(41)
    assert h.since(40) == []
    h.append(upd(41), term=1)
    assert (h.first, h.last, h.restarts) == (41, 41, 0)


def test_an_update_that_does_not_follow_a_reset_is_a_restart() -> None:
    h = History(10, 1000)
    h.reset(40)
    h.append(upd(45), term=1)
    assert (h.first, h.last, h.base, h.restarts) == (45, 45, 44, 1)


def test_reset_rejects_a_negative_sequence() -> None:
    with pytest.raises(ValueError):
        History(1, 1).reset(-1)


@pytest.mark.parametrize(
    "frames",
    [
        [b"/k", b"\0" * 8, b"", b""],
        [b"/k", b"\0" * 7 + b"\1", b"", b"", b"", b""],
        upd(0),
        [b"/k", b"1", b"", b"", b""],
    ],
)
def test_append_rejects_what_is_not_an_update(frames: list[bytes]) -> None:
    with pytest.raises(ValueError):
        History(10, 1000).append(frames, term=1)


@pytest.mark.parametrize(
    ("since", "covered"),
    [(3, False), (4, True), (5, True), (9, True), (10, True), (11, False), (-1, False)],
)
def test_covers_from_base_to_last(since: int, covered: bool) -> None:
    h = filled(1, 10, max_updates=6)  # holds 5..10, base 4
    assert h.covers(since) is covered


def test_covers_when_empty_is_only_the_base() -> None:
    h = History(10, 1000)
    assert h.covers(0) and not h.covers(1)


def test_since_returns_the_suffix_oldest_first() -> None:
    h = filled(1, 10, max_updates=6)
    assert h.since(10) == []
    assert h.since(9) == [upd(10)]
    assert h.since(7) == [upd(8), upd(9), upd(10)]
    assert h.since(4) == [upd(s) for s in range(5, 11)]


@pytest.mark.parametrize("since", [3, 11])
def test_since_outside_the_history_is_misuse(since: int) -> None:
    with pytest.raises(ValueError):
        filled(1, 10, max_updates=6).since(since)


def test_entry_is_held_updates_only() -> None:
    h = filled(3, 6)
    assert h.entry(2) is None and h.entry(7) is None and h.entry(0) is None
    assert h.entry(3) == (upd(3), 1) and h.entry(6) == (upd(6), 1)


def test_load_is_appending_each_row() -> None:
    rows = [(upd(s, body=b"%d" % s), s // 3, 1000.0 + s) for s in range(20, 30)]
    h = History(4, 1 << 20)
    h.load(rows)
    assert (h.first, h.last, h.restarts) == (26, 29, 0)
    assert h.entry(27) == (upd(27, body=b"27"), 9)
    h2 = History(100, 1 << 20)
    h2.load(iter(rows[:3] + rows[5:]))
    assert (h2.first, h2.last, h2.restarts) == (25, 29, 1)
