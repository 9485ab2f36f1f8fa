"""The server's pure access rules: which topics a connection is subscribed to,
which keys a restricted snapshot holds, and the store's limits."""

from __future__ import annotations

import pytest

from clone.errors import StoreFull
from clone.security import FULL, NOTHING, PEER_USER, Rights
from clone.server.security import subscription_topics
from clone.server.snapshot import SnapshotStream, effective_prefixes
from clone.server.store import Store
from clone.wire.codec import KVMsg, decode_snapshot_reply
from clone.wire.control import refusal_topic, view_id, view_topic

READER = Rights(read=(b"/public/",), write=())
TWO = Rights(read=(b"/a/", b"/b/x/"), write=(b"/a/",))


def test_a_reader_of_everything_gets_every_first_byte_but_nul() -> None:
    topics = subscription_topics(b"", FULL, "admin")
    keys = [t for t in topics if t[:1] != b"\x00"]
    assert len(keys) == 255 and b"\x00" not in keys and b"/" in keys and b"H" in keys
    assert [t for t in topics if t[:1] == b"\x00"] == [refusal_topic("admin")]


def test_the_peer_gets_no_refusal_topic() -> None:
    assert all(t[:1] != b"\x00" for t in subscription_topics(b"", FULL, PEER_USER))


def test_a_restricted_reader_gets_its_prefixes_its_view_and_its_notices() -> None:
    topics = subscription_topics(b"", TWO, "two")
    assert topics == [b"/a/", b"/b/x/", view_topic(view_id(TWO.read)), refusal_topic("two")]


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (b"/a/deep/", [b"/a/deep/"]),  # under an allowed prefix: as asked
        (b"/b/", [b"/b/x/"]),  # above one: narrowed to it
        (b"/", [b"/a/", b"/b/x/"]),
        (b"/c/", []),  # nothing readable there
        (b"\x00Rother\x00", []),  # control topics are handed out, never asked for
    ],
)
def test_a_restricted_subscription_is_narrowed(topic: bytes, expected: list[bytes]) -> None:
    assert subscription_topics(topic, TWO, "two") == expected


def test_nothing_readable_means_only_the_view_and_the_notices() -> None:
    assert subscription_topics(b"", NOTHING, "nobody") == [
        view_topic(view_id(())),
        refusal_topic("nobody"),
    ]


@pytest.mark.parametrize(
    ("subtree", "allowed", "expected"),
    [
        (b"", None, (b"",)),
        (b"/a/", None, (b"/a/",)),
        (b"", (b"/public/",), (b"/public/",)),
        (b"/public/x/", (b"/public/",), (b"/public/x/",)),
        (b"/", (b"/a/", b"/b/"), (b"/a/", b"/b/")),
        (b"/c/", (b"/a/",), ()),
    ],
)
def test_effective_prefixes(
    subtree: bytes, allowed: tuple[bytes, ...] | None, expected: tuple[bytes, ...]
) -> None:
    assert effective_prefixes(subtree, allowed) == expected


def _store(*keys: str) -> Store:
    store = Store()
    for key in keys:
        store.apply(KVMsg.build(key, b"v", uuid=b"\x01" * 16), 0.0)
    return store


@pytest.mark.parametrize("batch", [False, True])
def test_a_restricted_snapshot_holds_only_readable_keys(batch: bool) -> None:
    store = _store("/public/a", "/secret/b", "/public/c", "/other")
    stream = SnapshotStream(
        b"id",
        "",
        store,
        batch=batch,
        allowed=(b"/public/",),
        end_properties=(("view", "0123456789ab"), ("view_count", "7")),
    )
    sent: list[list[bytes]] = []
    while not stream.done:
        frames = stream.peek()
        if frames is not None:
            sent.append(list(frames[1:]))
            stream.advance()
    end = decode_snapshot_reply(sent[-1])
    assert getattr(end, "properties", None) == (("view", "0123456789ab"), ("view_count", "7"))
    if batch:
        from clone.wire.batch import decode_kvbatch

        keys = [k for frames in sent[:-1] for k in decode_kvbatch(frames).keys]
    else:
        keys = [frames[0].decode() for frames in sent[:-1]]
    assert sorted(keys) == ["/public/a", "/public/c"]


def test_the_store_refuses_a_new_key_beyond_max_keys_but_takes_overwrites() -> None:
    store = Store(max_keys=2)
    store.apply(KVMsg.build("a", b"1", uuid=b"\x01" * 16), 0.0)
    store.apply(KVMsg.build("b", b"1", uuid=b"\x02" * 16), 0.0)
    with pytest.raises(StoreFull, match="max-keys"):
        store.apply(KVMsg.build("c", b"1", uuid=b"\x03" * 16), 0.0)
    assert store.sequence == 2 and "c" not in store  # nothing changed
    store.apply(KVMsg.build("a", b"2", uuid=b"\x04" * 16), 0.0)  # an overwrite
    store.apply(KVMsg.build("b", b"", uuid=b"\x05" * 16), 0.0)  # a delete
    store.apply(KVMsg.build("c", b"1", uuid=b"\x06" * 16), 0.0)  # room again
    assert store.keys() == ["a", "c"]


def test_the_store_counts_its_bytes_and_refuses_growth_beyond_max_bytes() -> None:
    store = Store(max_bytes=200)
    store.apply(KVMsg.build("k", b"x" * 100, uuid=b"\x01" * 16), 0.0)
    held = store.nbytes
    assert held == 1 + 8 + 16 + 0 + 100
    with pytest.raises(StoreFull, match="max-bytes"):
        store.apply(KVMsg.build("j", b"y" * 100, uuid=b"\x02" * 16), 0.0)
    store.apply(KVMsg.build("k", b"z" * 50, uuid=b"\x03" * 16), 0.0)  # shrinks: fine
    assert store.nbytes == held - 50
    store.apply(KVMsg.build("k", b"", uuid=b"\x04" * 16), 0.0)
    assert store.nbytes == 0
