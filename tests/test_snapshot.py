"""The chunked, fuzzy snapshot streamer, without sockets."""

from __future__ import annotations

from clone.codec import KVMsg, decode_snapshot_reply
from clone.codec import SnapshotEnd as End
from clone.snapshot import SCAN_BUDGET, SnapshotStream
from clone.store import Store


def _store(keys: list[str]) -> Store:
    store = Store()
    for key in keys:
        store.apply(KVMsg(key, 0, b"", (), key.encode()), now=0.0)
    return store


def _drain(stream: SnapshotStream) -> list[KVMsg | End]:
    out: list[KVMsg | End] = []
    while not stream.done:
        frames = stream.peek()
        if frames is None:
            continue
        assert frames[0] == stream.identity
        out.append(decode_snapshot_reply(frames[1:]))
        stream.advance()
    return out


def test_full_snapshot_then_kthxbai_with_the_starting_sequence() -> None:
    store = _store(["/a/1", "/b/2", "/a/3"])
    replies = _drain(SnapshotStream(b"id", "", store))
    assert [m.key for m in replies if isinstance(m, KVMsg)] == ["/a/1", "/b/2", "/a/3"]
    assert replies[-1] == End(3, "")


def test_subtree_selects_by_prefix() -> None:
    store = _store(["/a/1", "/b/2", "/a/3", "/ab/4"])
    replies = _drain(SnapshotStream(b"id", "/a/", store))
    assert [m.key for m in replies if isinstance(m, KVMsg)] == ["/a/1", "/a/3"]
    assert replies[-1] == End(4, "/a/")


def test_peek_repeats_until_advance_so_a_full_socket_drops_nothing() -> None:
    stream = SnapshotStream(b"id", "", _store(["k"]))
    first = stream.peek()
    assert stream.peek() is first  # EAGAIN: same frames again
    stream.advance()
    assert stream.sent == 1
    assert stream.peek() is not None and not stream.done
    stream.advance()
    assert stream.done and stream.peek() is None


def test_fuzzy_changes_during_streaming() -> None:
    store = _store(["a", "b", "c"])
    stream = SnapshotStream(b"id", "", store)
    stream.peek()
    stream.advance()  # a sent
    store.apply(KVMsg("b", 0, b"", (), b""), now=0.0)  # deleted: skipped
    store.apply(KVMsg("c", 0, b"", (), b"new"), now=0.0)  # newer: current value sent
    store.apply(KVMsg("d", 0, b"", (), b"x"), now=0.0)  # added later: not in this snapshot
    rest = _drain(stream)
    assert rest[0] == KVMsg("c", 5, b"", (), b"new")
    assert rest[1] == End(3, "")
    assert stream.total_keys == 3


def test_a_sparse_subtree_yields_after_the_scan_budget() -> None:
    keys = [f"/x/{i}" for i in range(SCAN_BUDGET + 5)] + ["/a/1"]
    stream = SnapshotStream(b"id", "/a/", _store(keys))
    assert stream.peek() is None and not stream.done  # gave the reactor back
    frames = stream.peek()
    assert frames is not None and frames[1] == b"/a/1"


def test_empty_store_is_just_kthxbai() -> None:
    assert _drain(SnapshotStream(b"id", "/a/", Store())) == [End(0, "/a/")]
