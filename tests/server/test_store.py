"""The hashmap, its sequence and ephemeral keys, with explicit wall-clock times."""

from __future__ import annotations

import pytest

from clone.errors import LimitExceeded, ProtocolError
from clone.server.store import Store, entry_of
from clone.wire.codec import KVMsg, decode_update, encode_kv

U1 = bytes(range(16))


def _apply(store: Store, msg: KVMsg, now: float) -> KVMsg:
    """Apply and decode the KVPUB frames it returns."""
    pub = decode_update(store.apply(msg, now))
    assert isinstance(pub, KVMsg)
    return pub


def _set(key: str, body: bytes = b"v", props: tuple[tuple[str, str], ...] = ()) -> KVMsg:
    return KVMsg(key, 0, U1, props, body)


def test_apply_assigns_consecutive_sequences_and_keeps_uuid_and_props() -> None:
    store = Store()
    pubs = [_apply(store, _set(f"k{i}", props=(("a", "1"),)), now=0.0) for i in range(3)]
    assert [p.sequence for p in pubs] == [1, 2, 3]
    assert all(p.uuid == U1 and p.properties == (("a", "1"),) for p in pubs)
    assert store.sequence == 3
    assert store.get("k1") == pubs[1]


def test_the_received_frames_are_stored_and_published_as_they_are() -> None:
    msg = _set("k", props=(("a", "1"),))
    frames = encode_kv(msg)
    store = Store()
    pub = store.apply(msg, now=0.0, frames=frames)
    assert pub[1] == (1).to_bytes(8, "big")
    assert all(pub[i] is frames[i] for i in (0, 2, 3, 4))
    assert store.entry(b"k") == tuple(pub[1:])
    assert store.get("k") == KVMsg("k", 1, U1, (("a", "1"),), b"v")


def test_changed_properties_are_re_encoded_even_with_frames() -> None:
    msg = _set("k", props=(("ttl", "10"),))
    pub = Store().apply(msg, now=5.0, frames=encode_kv(msg))
    assert pub[3] == b"ttl=10\nexpires=15.000\n"


def test_empty_value_deletes_and_still_takes_a_sequence() -> None:
    store = Store()
    store.apply(_set("k"), now=0.0)
    pub = _apply(store, _set("k", b""), now=0.0)
    assert pub.sequence == 2 and pub.is_delete
    assert "k" not in store


@pytest.mark.parametrize(
    ("props", "expires"),
    [
        ((("ttl", "10"),), "1010.000"),
        ((("ttl", "0.5"), ("x", "y")), "1000.500"),
        ((("ttl", "0"),), None),
        ((("x", "y"),), None),
        ((("expires", "5"),), None),  # a client's expires is removed
        ((("ttl", "0"), ("expires", "5")), None),
    ],
)
def test_ttl_becomes_an_absolute_expires(
    props: tuple[tuple[str, str], ...], expires: str | None
) -> None:
    store = Store()
    pub = _apply(store, _set("k", props=props), now=1000.0)
    assert pub.prop("expires") == expires
    assert pub.prop("ttl") == dict(props).get("ttl")
    assert store.deadline("k") == (float(expires) if expires else None)


@pytest.mark.parametrize("ttl", ["abc", "-1", "1e9", "nan"])
def test_invalid_ttl_rejects_the_update_without_side_effects(ttl: str) -> None:
    store = Store()
    with pytest.raises(ProtocolError):
        store.apply(_set("k", props=(("ttl", ttl),)), now=0.0)
    assert store.sequence == 0 and "k" not in store


def test_expires_that_would_overflow_the_properties_frame_is_rejected() -> None:
    big = (("ttl", "5"), ("pad", "x" * 4080))
    with pytest.raises(LimitExceeded):
        Store().apply(_set("k", props=big), now=0.0)


def test_expire_deletes_due_keys_with_fresh_sequences() -> None:
    store = Store()
    store.apply(_set("a", props=(("ttl", "1"),)), now=100.0)
    store.apply(_set("b", props=(("ttl", "5"),)), now=100.0)
    store.apply(_set("c"), now=100.0)
    assert store.expire(now=100.5) == []
    deletes = store.expire(now=101.0)
    assert deletes == [KVMsg("a", 4)]
    assert "a" not in store and "b" in store
    assert store.next_deadline() == 105.0


def test_overwriting_or_deleting_an_ephemeral_key_cancels_its_expiry() -> None:
    store = Store()
    store.apply(_set("a", props=(("ttl", "1"),)), now=0.0)
    store.apply(_set("a"), now=0.0)  # now permanent
    store.apply(_set("b", props=(("ttl", "1"),)), now=0.0)
    store.apply(_set("b", b""), now=0.0)
    assert store.expire(now=10.0) == []
    assert "a" in store


def test_apply_published_keeps_the_message_and_counts_its_ttl_from_receipt() -> None:
    """The passive's deadline is its own receive time plus the ttl sent (the
    time left); the sender's wall-clock ``expires`` is shown, never read."""
    store = Store()
    msg = KVMsg("k", 42, U1, (("ttl", "10"), ("expires", "123.000")), b"v")
    store.apply_published(msg, now=500.0)
    assert store.get("k") == msg
    assert store.sequence == 42
    assert store.deadline("k") == 510.0


def test_apply_published_with_expires_but_no_ttl_keeps_the_key_and_counts() -> None:
    store = Store()
    store.apply_published(KVMsg("k", 1, U1, (("expires", "soon"),), b"v"), now=0.0)
    store.apply_published(KVMsg("j", 2, U1, (("ttl", "x"), ("expires", "9")), b"v"), now=0.0)
    assert "k" in store and store.deadline("k") is None and store.deadline("j") is None
    assert store.bad_expires == 2


def test_replace_swaps_state_and_rebuilds_expiry() -> None:
    store = Store()
    store.apply(_set("old", props=(("ttl", "1"),)), now=0.0)
    store.replace(
        {
            b"x": entry_of(KVMsg("x", 7, U1, (("ttl", "50"), ("expires", "9")), b"v")),
            b"y": entry_of(KVMsg("y", 8, U1, (), b"w")),
        },
        sequence=9,
        now=10.0,
    )
    assert store.sequence == 9
    assert store.keys() == ["x", "y"]
    assert store.expire(now=59.9) == []
    assert [m.key for m in store.expire(now=60.0)] == ["x"]
    assert store.sequence == 10


def test_apply_published_with_frames_stores_them_as_they_are() -> None:
    store = Store()
    msg = KVMsg("k", 42, U1, (("x", "1"),), b"v")
    frames = encode_kv(msg)
    store.apply_published(msg, frames, now=0.0)
    entry = store.entry(b"k")
    assert entry is not None and all(a is b for a, b in zip(entry, frames[1:], strict=True))
    assert store.get("k") == msg and store.sequence == 42


def test_stored_entries_are_not_tracked_by_the_garbage_collector() -> None:
    import gc

    store = Store()
    msg = _set("k")
    store.apply(msg, now=0.0, frames=encode_kv(msg))
    store.apply(_set("p", props=(("x", "1"),)), now=0.0)  # held as its tuple
    gc.collect()
    # What the map holds (packed bytes, or an untracked tuple of bytes).
    assert not any(map(gc.is_tracked, store._map.values()))


def _entry(seq: int, uuid: bytes = U1, props: bytes = b"", body: bytes = b"v") -> tuple[bytes, ...]:
    return (seq.to_bytes(8, "big"), uuid, props, body)


def test_entries_read_back_the_same_whether_held_packed_or_not() -> None:
    """Entries without properties and with a 16-byte uuid are held as
    one bytes; every read hands out the same Entry as the tuple form would."""
    plain = _entry(1, body=b"x" * 100)
    with_props = _entry(2, props=b"a=1\n")
    short_uuid = _entry(3, uuid=b"")
    store = Store()
    store.replace({b"/a": plain, b"/b": with_props, b"/c": short_uuid}, 3)  # type: ignore[dict-item]
    assert isinstance(store._map[b"/a"], bytes) and len(store._map[b"/a"]) == 8 + 16 + 100
    assert isinstance(store._map[b"/b"], tuple) and isinstance(store._map[b"/c"], tuple)
    assert store.entry(b"/a") == plain and store.entry(b"/b") == with_props
    assert store.entries([b"/a", b"/a"]) == [plain, plain]  # all packed: the C path
    assert store.entries([b"/a", b"/x", b"/b", b"/c"]) == [plain, None, with_props, short_uuid]
    assert store.entries([]) == []
    assert store.last_update() == [b"/c", *short_uuid]
    assert store.entries_with_properties_or_prefix(b"/a") == [(b"/a", plain), (b"/b", with_props)]
    assert store.nbytes == sum(len(k) + sum(map(len, e)) for k, e in
                               [(b"/a", plain), (b"/b", with_props), (b"/c", short_uuid)])
    # Overwrite packed with a tuple and back: the byte count follows.
    store.apply(_set("/a", props=(("y", "2"),)), now=0.0)
    assert isinstance(store._map[b"/a"], tuple)
    pub = store.apply(_set("/a", body=b"z" * 7), now=0.0)
    assert isinstance(store._map[b"/a"], bytes)
    assert store.entry(b"/a") == tuple(pub[1:]) and store.last_update() == pub
    assert store.nbytes == sum(len(k) + sum(map(len, e)) for k, e in
                               [(b"/a", tuple(pub[1:])), (b"/b", with_props), (b"/c", short_uuid)])
    store.apply(_set("/a", body=b""), now=0.0)  # a delete
    assert store.entry(b"/a") is None
    assert store.nbytes == sum(len(k) + sum(map(len, e)) for k, e in
                               [(b"/b", with_props), (b"/c", short_uuid)])


def test_last_update_is_the_entry_written_at_the_sequence() -> None:
    """What a catch-up request names after a full snapshot (core.catch_up_request)."""
    store = Store()
    assert store.last_update() is None
    a = store.apply(KVMsg("/a", 0, b"u" * 16, (), b"1"), 0.0)
    assert store.last_update() == a
    store.apply(KVMsg("/b", 0, b"v" * 16, (), b""), 0.0)  # a delete: not held
    assert store.last_update() is None
    b = store.apply(KVMsg("/b", 0, b"w" * 16, (), b"2"), 0.0)
    assert store.last_update() == b
    store.sequence += 5  # moved without an update (a promotion's jump)
    assert store.last_update() is None
    # A full snapshot: found in the pass replace() makes anyway.
    entries = {b"/x": ((9).to_bytes(8, "big"), b"x" * 16, b"", b"X"),
               b"/y": ((4).to_bytes(8, "big"), b"y" * 16, b"", b"Y")}
    store.replace(dict(entries), 9)
    assert store.last_update() == [b"/x", *entries[b"/x"]]
    store.replace(dict(entries), 10)  # the last update was a delete
    assert store.last_update() is None


def test_the_key_list_is_copied_again_only_when_a_key_was_added() -> None:
    """Snapshots share one copy of the key list (at 10M keys each copy held the
    loop for about a second, once per re-ask): a changed value or a deleted key
    keeps it (the snapshot reads values when it sends them and skips deleted
    keys); a new key, or a swapped state, makes the next snapshot copy again."""
    store = Store()
    for key in ("a", "b", "c"):
        store.apply(_set(key), now=0.0)
    keys = store.raw_keys()
    assert keys == [b"a", b"b", b"c"]
    store.apply(_set("b", b"changed"), now=0.0)
    store.apply(_set("c", b""), now=0.0)  # a delete
    assert store.raw_keys() is keys and keys == [b"a", b"b", b"c"]
    store.apply(_set("d"), now=0.0)
    assert store.raw_keys() is not keys
    assert store.raw_keys() == [b"a", b"b", b"d"]
    again = store.raw_keys()
    store.replace({b"x": entry_of(KVMsg("x", 7, U1, (), b"v"))}, sequence=7)
    assert store.raw_keys() == [b"x"] and again == [b"a", b"b", b"d"]


def test_a_kept_key_list_never_holds_more_dead_keys_than_live_ones() -> None:
    store = Store()
    for i in range(10):
        store.apply(_set(f"k{i}", props=(("ttl", "1"),) if i < 2 else ()), now=0.0)
    keys = store.raw_keys()
    assert len(store.expire(now=5.0)) == 2  # expiries are deletes too
    for i in range(2, 5):
        store.apply(_set(f"k{i}", b""), now=5.0)
    assert store.raw_keys() is keys  # 5 live keys of the 10 it names
    store.apply(_set("k5", b""), now=5.0)
    assert store._key_list is None  # 4 live of 10: freed at once, not at the next snapshot
    assert store.raw_keys() == [b"k6", b"k7", b"k8", b"k9"]
