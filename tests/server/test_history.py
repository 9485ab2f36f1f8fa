"""The bounded history of recent updates: contiguity, eviction, covers/since."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.server.history import History


def upd(seq: int, body: bytes = b"v", key: bytes = b"/k") -> tuple[bytes, ...]:
    """A KVPUB's five frames at ``seq`` (a tuple, as the history holds them)."""
    return (key, seq.to_bytes(8, "big"), b"", b"", body)


def size(frames: tuple[bytes, ...]) -> int:
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


# -- sequence_of: the uuid index kept in step with the ring --------------------


def _scan(h: History, uuid: bytes) -> int | None:
    """The old lookup, a newest-first scan of the held updates: the reference."""
    last = h.last
    if last is None:
        return None
    for seq in range(last, h.base, -1):
        held = h.entry(seq)
        assert held is not None
        if held[0][2] == uuid:
            return seq
    return None


def test_sequence_of_finds_the_newest_update_with_the_uuid() -> None:
    h = History(10, 1 << 20)
    h.append([b"/a", (1).to_bytes(8, "big"), b"u1", b"", b"x"], term=1)
    h.append([b"/b", (2).to_bytes(8, "big"), b"u2", b"", b"x"], term=1)
    h.append([b"/c", (3).to_bytes(8, "big"), b"u1", b"", b"x"], term=1)
    assert (h.sequence_of(b"u1"), h.sequence_of(b"u2"), h.sequence_of(b"u3")) == (3, 2, None)


def test_sequence_of_forgets_evicted_updates_but_keeps_a_newer_copy() -> None:
    h = History(2, 1 << 20)
    h.append([b"/a", (1).to_bytes(8, "big"), b"u1", b"", b"x"], term=1)
    h.append([b"/b", (2).to_bytes(8, "big"), b"u2", b"", b"x"], term=1)
    h.append([b"/c", (3).to_bytes(8, "big"), b"u2", b"", b"x"], term=1)
    assert (h.sequence_of(b"u1"), h.sequence_of(b"u2")) == (None, 3)
    h.append([b"/d", (4).to_bytes(8, "big"), b"u4", b"", b"x"], term=1)
    assert (h.sequence_of(b"u2"), h.sequence_of(b"u4")) == (3, 4)


def test_sequence_of_is_emptied_by_a_reset_and_a_restart() -> None:
    h = History(10, 1 << 20)
    h.append([b"/a", (1).to_bytes(8, "big"), b"u1", b"", b"x"], term=1)
    h.reset(5)
    assert h.sequence_of(b"u1") is None
    h.append([b"/a", (6).to_bytes(8, "big"), b"u6", b"", b"x"], term=1)
    h.append([b"/a", (9).to_bytes(8, "big"), b"u9", b"", b"x"], term=1)  # a restart
    assert (h.sequence_of(b"u6"), h.sequence_of(b"u9")) == (None, 9)


_uuids = st.sampled_from([b"", b"a", b"b", b"c", b"d"])
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 2), _uuids, st.integers(0, 40)),
        st.tuples(st.just("reset"), st.integers(0, 50), _uuids, st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=_ops,
    max_updates=st.integers(1, 6),
    max_bytes=st.integers(1, 200),
    probes=st.lists(_uuids, min_size=1, max_size=5),
)
def test_sequence_of_matches_a_newest_first_scan(
    ops: list[tuple[str, int, bytes, int]],
    max_updates: int,
    max_bytes: int,
    probes: list[bytes],
) -> None:
    """Whatever appends (contiguous or jumping), evictions (by count and by
    bytes) and resets happen, the index answers as the old linear scan did."""
    h = History(max_updates, max_bytes)
    for op, arg, uuid, size_ in ops:
        if op == "reset":
            h.reset(arg)
        else:
            # arg 0: the next sequence; 1: a jump ahead; 2: a jump back (if possible).
            nxt = h.base + len(h) + 1
            seq = nxt if arg == 0 else nxt + 3 if arg == 1 else max(1, nxt - 2)
            h.append([b"/k", seq.to_bytes(8, "big"), uuid, b"", b"x" * size_], term=1)
        for probe in {*probes, uuid}:
            assert h.sequence_of(probe) == _scan(h, probe)


def test_held_updates_are_not_tracked_by_the_garbage_collector() -> None:
    """100,000 held updates must not be walked by every full collection (a
    list always is; a tuple of bytes is untracked by a collection).  The
    (frames, term) pair of entry() is made when asked: terms are kept as runs."""
    h = History(1000, 1 << 20)
    for seq in range(1, 101):
        h.append([b"/k", seq.to_bytes(8, "big"), b"u%d" % seq, b"", b"v"], term=1)
    gc.collect()
    held = [h.entry(seq) for seq in range(1, 101)]
    assert all(entry is not None for entry in held)
    assert not any(gc.is_tracked(entry[0]) for entry in held if entry)


def test_terms_are_runs_and_follow_eviction_and_restarts() -> None:
    """A term per change, not per update; entry() and written_under()
    read the runs, which shrink as old updates are evicted."""
    h = History(4, 1 << 20)
    terms = [1, 1, 2, 2, 2, 3, 3]
    for seq, term in enumerate(terms, start=1):
        h.append([b"/k", seq.to_bytes(8, "big"), b"u%d" % seq, b"", b"v"], term=term)
    assert (h.first, h.last) == (4, 7)
    assert [h.entry(seq)[1] for seq in range(4, 8)] == [2, 2, 3, 3]  # type: ignore[index]
    assert h.entry(3) is None
    assert [int.from_bytes(f[1], "big") for f in h.written_under(2)] == [4, 5]
    assert [int.from_bytes(f[1], "big") for f in h.written_under(3)] == [6, 7]
    assert h.written_under(1) == []
    assert h._terms == [(3, 2), (6, 3)]  # the run of term 1 went with its updates
    h.append([b"/k", (20).to_bytes(8, "big"), b"u20", b"", b"v"], term=5)  # a restart
    assert h._terms == [(20, 5)] and h.entry(20)[1] == 5  # type: ignore[index]
    h.reset(30)
    assert h._terms == [] and h.written_under(5) == []


def test_an_update_the_store_holds_packed_is_shared_and_read_back_as_frames() -> None:
    """With the store's packed entry, the history holds (key, packed)
    and hands out the same five frames as if it had held them."""
    from clone.server.store import Store
    from clone.wire.codec import KVMsg

    store = Store()
    h = History(3, 1 << 20)
    sent = []
    for i in range(1, 6):
        uuid = bytes([i]) * 16
        frames = store.apply(KVMsg(f"/k{i % 2}", 0, uuid, (), b"v%d" % i), 0.0)
        packed = store.packed(frames[0])
        assert packed is not None
        h.append(frames, term=7, packed=packed)
        sent.append(tuple(frames))
        assert h.bytes == sum(map(size, sent[-3:]))
    assert h._updates[-1] is store.packed(b"/k1")  # the store's object, not a copy
    assert h.since(2) == sent[2:]
    assert h.entry(4) == (sent[3], 7) and h.written_under(7) == sent[2:]
    assert [h.sequence_of(bytes([i]) * 16) for i in range(1, 6)] == [None, None, 3, 4, 5]
    # A packed form that is not this update's (an older write of the key) is not used.
    old = store.packed(b"/k0")
    frames = store.apply(KVMsg("/k0", 0, b"\x09" * 16, (), b"new"), 0.0)
    h.append(frames, term=7, packed=old)
    assert type(h._updates[-1]) is tuple and h.since(5) == [tuple(frames)]
    # With properties: never packed.
    frames = store.apply(KVMsg("/p", 0, b"\x0a" * 16, (("a", "1"),), b"x"), 0.0)
    assert store.packed(b"/p") is None
    h.append(frames, term=8, packed=None)
    assert h.since(6) == [tuple(frames)] and h.sequence_of(b"\x0a" * 16) == 7


def test_load_shares_the_store_packed_entries_when_given_them() -> None:
    """A restart: the log's rows become the history, sharing the store's packed
    entries (of the keys whose stored entry is that very update)."""
    from clone.server.store import Store
    from clone.wire.codec import KVMsg

    store = Store()
    rows = [(store.apply(KVMsg(f"/k{i % 3}", 0, bytes([i]) * 16, (), b"v"), 0.0), 1, 0.0)
            for i in range(1, 7)]
    h = History(100, 1 << 20)
    h.load(rows, store.packed)
    assert h.since(0) == [tuple(frames) for frames, _, _ in rows]
    held_now = zip(h._keys, h._updates, strict=True)
    shared = [(key, held) for key, held in held_now if type(held) is bytes]
    assert [key for key, _ in shared] == [b"/k1", b"/k2", b"/k0"]  # the last write of each
    assert all(held is store.packed(key) for key, held in shared)


def test_the_uuid_index_is_built_when_asked_and_dropped_when_unasked() -> None:
    """The index costs a dict slot and a uuid per held update: it exists only
    while someone asks (a heal, retried calls), and is rebuilt right."""
    h = History(4, 1 << 20)
    for seq in range(1, 4):
        h.append([b"/k", seq.to_bytes(8, "big"), b"u%d" % seq, b"", b"v"], term=1)
    assert not h.indexed
    assert h.sequence_of(b"u2") == 2 and h.indexed
    for seq in range(4, 8):  # kept up while the ring turns over once
        h.append([b"/k", seq.to_bytes(8, "big"), b"u%d" % seq, b"", b"v"], term=1)
    assert h.indexed
    h.append([b"/k", (8).to_bytes(8, "big"), b"u8", b"", b"v"], term=1)
    assert not h.indexed  # five appends, no question, four held: dropped
    assert [h.sequence_of(b"u%d" % seq) for seq in (4, 5, 8)] == [None, 5, 8]
    assert h.indexed


def test_the_uuid_index_is_built_from_packed_updates() -> None:
    from clone.server.store import Store
    from clone.wire.codec import KVMsg

    store = Store()
    h = History(10, 1 << 20)
    for i in range(1, 5):
        frames = store.apply(KVMsg(f"/k{i}", 0, bytes([i]) * 16, (), b"v"), 0.0)
        h.append(frames, term=1, packed=store.packed(frames[0]))
    assert all(type(held) is bytes for held in h._updates)
    assert [h.sequence_of(bytes([i]) * 16) for i in range(1, 6)] == [1, 2, 3, 4, None]


@settings(max_examples=300, deadline=None)
@given(
    ops=_ops,
    max_updates=st.integers(1, 6),
    max_bytes=st.integers(1, 200),
    asks=st.lists(st.booleans(), min_size=60, max_size=60),
    probes=st.lists(_uuids, min_size=1, max_size=5),
)
def test_sequence_of_asked_now_and_then_matches_a_newest_first_scan(
    ops: list[tuple[str, int, bytes, int]],
    max_updates: int,
    max_bytes: int,
    asks: list[bool],
    probes: list[bytes],
) -> None:
    """Asked only after some operations, so the index is built, kept up,
    dropped and rebuilt in every order: it still answers as a scan."""
    h = History(max_updates, max_bytes)
    for (op, arg, uuid, size_), ask in zip(ops, asks, strict=False):
        if op == "reset":
            h.reset(arg)
        else:
            nxt = h.base + len(h) + 1
            seq = nxt if arg == 0 else nxt + 3 if arg == 1 else max(1, nxt - 2)
            h.append([b"/k", seq.to_bytes(8, "big"), uuid, b"", b"x" * size_], term=1)
        if ask:
            for probe in {*probes, uuid}:
                assert h.sequence_of(probe) == _scan(h, probe)
