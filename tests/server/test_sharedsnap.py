"""The shared snapshot (clone.server.sharedsnap) and who gets one (clone.server.opening):
encoded once, the same bytes for each reader as a private stream's, joined
only at the store version it started at, bounded in bytes, freed by its last
reader, and never shared between requesters whose views differ."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from clone.security.acl import Rights
from clone.server import opening
from clone.server.access import Access
from clone.server.config import ServerConfig
from clone.server.core import ServerCore
from clone.server.delta import DeltaStream
from clone.server.opening import Opener
from clone.server.sharedsnap import SharedSnapshots, SharedStream, ShareKey
from clone.server.snapshot import SnapshotStream
from clone.server.store import Store
from clone.wire.batch import decode_kvbatch
from clone.wire.delta import SinceRequest, update_digest
from clone.wire.protocol import KTHXBAI

KEYS = 9000  # a KVBATCH holds up to 4096 entries: three batches


def _store(keys: int = KEYS) -> Store:
    store = Store()
    for n in range(keys):
        store._put(b"/k/%05d" % n, ((n + 1).to_bytes(8, "big"), n.to_bytes(16, "big"), b"",
                                    b"v%d" % n), None)  # fmt: skip
    store.sequence = keys
    return store


def _key(store: Store, subtree: str = "/k/", *, batch: bool = True,
         allowed: tuple[bytes, ...] | None = None,
         props: tuple[tuple[str, str], ...] = ()) -> ShareKey:  # fmt: skip
    return ShareKey(subtree, batch, allowed, props, store.sequence, store.version)


def _drain(stream: Any, limit: int = 100_000) -> list[list[Any]]:
    """Every message of ``stream`` (routing id included), as bytes."""
    out: list[list[Any]] = []
    for _ in range(limit):
        if stream.done:
            return out
        frames = stream.peek()
        if frames is None:
            continue
        out.append([bytes(f) for f in frames])
        stream.advance()
    raise AssertionError("the stream did not end")


class _Counting:
    """A private stream that counts the messages it encodes."""

    def __init__(self, stream: SnapshotStream) -> None:
        self._stream = stream
        self.encoded = 0
        self.total_keys = stream.total_keys

    @property
    def done(self) -> bool:
        return self._stream.done

    @property
    def sent(self) -> int:
        return self._stream.sent

    def peek(self) -> Sequence[Any] | None:
        return self._stream.peek()

    def advance(self) -> None:
        self.encoded += 1
        self._stream.advance()


@pytest.mark.parametrize("batch", [True, False])
def test_readers_get_a_private_streams_bytes_and_it_is_encoded_once(batch: bool) -> None:
    store = _store()
    private = _drain(SnapshotStream(b"A", "/k/0", store, batch=batch))
    shares = SharedSnapshots(1 << 30)
    source = _Counting(SnapshotStream(b"", "/k/0", store, batch=batch))
    first = shares.start(b"A", _key(store, "/k/0", batch=batch), source, 1000)
    assert first is not None
    # B joins before anything is encoded, C after A has read it all.
    second = shares.join(b"B", _key(store, "/k/0", batch=batch))
    assert second is not None
    got_a = _drain(first)
    third = shares.join(b"C", _key(store, "/k/0", batch=batch))
    assert third is not None
    got_b, got_c = _drain(second), _drain(third)
    assert got_a == private
    assert [m[1:] for m in got_b] == [m[1:] for m in private] == [m[1:] for m in got_c]
    assert {m[0] for m in got_b} == {b"B"} and {m[0] for m in got_c} == {b"C"}
    assert source.encoded == len(private)  # once, not once per reader
    assert got_a[-1][1] == KTHXBAI
    # Each reader counts what a private stream counts.
    reference = SnapshotStream(b"A", "/k/0", store, batch=batch)
    _drain(reference)
    for reader in (first, second, third):
        assert (reader.sent, reader.batches_sent) == (reference.sent, reference.batches_sent)
    assert (shares.started, shares.joined) == (1, 2)
    assert len(shares) == 0 and shares.held == 0  # the last reader freed it


def test_a_reader_that_joins_midway_gets_the_whole_snapshot_from_its_start() -> None:
    store = _store()
    shares = SharedSnapshots(1 << 30)
    first = shares.start(b"A", _key(store), SnapshotStream(b"", "/k/", store, batch=True), 1000)
    assert first is not None
    frames = first.peek()
    assert frames is not None
    first.advance()  # one batch sent to A
    late = shares.join(b"B", _key(store))
    assert late is not None
    got_late = _drain(late)
    assert [m[1:] for m in got_late] == [m[1:] for m in _drain(SnapshotStream(b"", "/k/", store,
                                                                             batch=True))]
    assert late.sent == KEYS


def test_no_reader_joins_once_the_store_changed_and_the_old_one_lives_for_its_readers() -> None:
    store = _store()
    shares = SharedSnapshots(1 << 30)
    old_key = _key(store)
    first = shares.start(b"A", old_key, SnapshotStream(b"", "/k/", store, batch=True), 1000)
    assert first is not None
    # A write the requester below subscribed after: it must not get entries
    # encoded before it.  Even with the same sequence (a follower's swap).
    store._put(b"/k/00000", (bytes(8), bytes(16), b"", b"changed"), None)
    new_key = _key(store)
    assert new_key != old_key and new_key.sequence == old_key.sequence
    assert shares.join(b"B", new_key) is None  # not the old one
    second = shares.start(b"B", new_key, SnapshotStream(b"", "/k/", store, batch=True), 1000)
    assert second is not None
    assert len(shares) == 2  # the old one still has its reader
    got_b = _drain(second)
    assert b"changed" in got_b[0][-1]  # the bodies column of the first batch
    _drain(first)
    assert len(shares) == 0


def test_an_aborted_reader_leaves_and_the_last_one_frees_the_snapshot() -> None:
    store = _store()
    shares = SharedSnapshots(1 << 30)
    key = _key(store)
    a = shares.start(b"A", key, SnapshotStream(b"", "/k/", store, batch=True), 1000)
    b = shares.join(b"B", key)
    assert a is not None and b is not None
    a.peek()
    a.close()
    a.close()  # idempotent
    assert len(shares) == 1 and shares.held > 0
    b.close()
    assert len(shares) == 0 and shares.held == 0
    assert shares.join(b"C", key) is None  # gone: a new request starts over


def test_the_budget_bounds_the_shared_bytes() -> None:
    store = _store()
    shares = SharedSnapshots(10_000)
    assert shares.start(b"A", _key(store), SnapshotStream(b"", "/k/", store), 20_000) is None
    assert shares.over_budget == 1
    a = shares.start(b"A", _key(store, "/k/0"), SnapshotStream(b"", "/k/0", store), 6_000)
    assert a is not None and shares.held == 6_000
    # A second snapshot (another subtree) would pass the limit with the first.
    assert shares.start(b"B", _key(store, "/k/1"), SnapshotStream(b"", "/k/1", store),
                        6_000) is None  # fmt: skip
    _drain(a)
    # Its real size counts once it is larger than its estimate (writes during
    # the encode); freed with its last reader either way.
    assert shares.held == 0
    assert shares.start(b"B", _key(store, "/k/1"), SnapshotStream(b"", "/k/1", store),
                        6_000) is not None  # fmt: skip


def test_a_snapshot_counts_its_real_size_once_over_its_estimate() -> None:
    store = _store()
    shares = SharedSnapshots(1 << 30)
    a = shares.start(b"A", _key(store), SnapshotStream(b"", "/k/", store, batch=True), 1)
    b = shares.join(b"B", _key(store))
    assert a is not None and b is not None
    real = sum(len(f) for m in _drain(a) for f in m[1:])
    assert real > 1 and shares.held == real  # b still reads it
    _drain(b)
    assert shares.held == 0


def test_large_frames_are_wrapped_once_for_every_reader() -> None:
    store = _store()
    wrapped: list[int] = []

    def wrap(frame: bytes) -> bytes:
        wrapped.append(len(frame))
        return frame

    shares = SharedSnapshots(1 << 30, wrap)
    readers = [shares.start(b"A", _key(store), SnapshotStream(b"", "/k/", store, batch=True), 1)]
    readers += [shares.join(bytes([65 + n]), _key(store)) for n in range(1, 5)]
    for reader in readers:
        assert reader is not None
        _drain(reader)
    private = _drain(SnapshotStream(b"", "/k/", store, batch=True))
    assert len(private) > 3
    assert sorted(wrapped) == sorted(len(f) for m in private for f in m[1:])  # each frame once


def test_the_store_version_counts_every_change() -> None:
    store = Store()
    seen = [store.version]
    store._put(b"/a", (bytes(8), bytes(16), b"", b"1"), None)
    seen.append(store.version)
    store._put(b"/a", (bytes(8), bytes(16), b"", b""), None)  # a delete
    seen.append(store.version)
    store._put(b"/e", (bytes(8), bytes(16), b"ttl=1\n", b"x"), 1.0)
    seen.append(store.version)
    assert store.expire(5.0)
    seen.append(store.version)
    store.replace({b"/b": (bytes(8), bytes(16), b"", b"2")}, store.sequence)  # same sequence
    seen.append(store.version)
    assert seen == sorted(set(seen)), seen


# -- who shares: the opener ---------------------------------------------------------


def _core(keys: int = 200) -> ServerCore:
    core = ServerCore(ServerConfig(port=5556).core, standalone=True)
    core.become_active(0.0)
    for n in range(keys):
        where = b"/public/" if n % 2 else b"/secret/"
        core.on_kvset([where + b"%d" % n, bytes(8), (n + 1).to_bytes(16, "big"), b"", b"v"],
                      0.0, 0.0)  # fmt: skip
    core.journal.take()
    return core


def _opener(core: ServerCore, access: Access | None = None) -> tuple[Opener, dict[str, int]]:
    counters: dict[str, int] = dict.fromkeys(
        ("snapshots_shared", "snapshot_encodings_shared", "snapshot_shares_over_budget",
         "catchups_served", "client_catchups_served"), 0)  # fmt: skip
    opener = Opener(core, access or Access(), SharedSnapshots(1 << 30), counters,
                    secure=access is not None, view_count=lambda vid: 7,
                    wallclock=lambda: 0.0, clock=lambda: 0.0)  # fmt: skip
    return opener, counters


def _open(opener: Opener, identity: bytes, *, user: str | None = None, applied: bool = False,
          ttl_left: bool = False, subtree: str = "", since: Any = None) -> Any:  # fmt: skip
    stream, _ = opener.open(identity, subtree, batch=True, applied=applied, since=since,
                            user=user, ttl_left=ttl_left)  # fmt: skip
    return stream


def test_requesters_of_the_same_view_share_and_other_views_do_not() -> None:
    core = _core()
    access = Access()
    access.install({"admin": Rights((b"",), (b"",)), "reader": Rights((b"/public/",), ()),
                    "other": Rights((b"/public/",), ()), "nobody": Rights((), ())})  # fmt: skip
    opener, counters = _opener(core, access)
    admin = [_open(opener, b"a%d" % n, user="admin") for n in range(3)]
    readers = [_open(opener, b"r%d" % n, user=u) for n, u in enumerate(("reader", "other"))]
    stranger = _open(opener, b"s", user="mallory")  # not admitted: sees nothing
    nobody = _open(opener, b"n", user="nobody")
    assert all(isinstance(s, SharedStream) for s in (*admin, *readers, stranger, nobody))
    assert counters["snapshot_encodings_shared"] == 3  # everything; /public/; nothing
    # Two admins; "other" with the reader's prefixes; "nobody" with the empty
    # view an unknown name gets too (both see nothing, the same bytes).
    assert counters["snapshots_shared"] == 4
    keys_of = [{k for m in _drain(s) for k in _keys(m)} for s in (*admin, *readers, stranger)]
    everything = {k for k in keys_of[0]}
    assert len(everything) == 200 and keys_of[1] == keys_of[2] == everything
    assert keys_of[3] == keys_of[4] == {k for k in everything if k.startswith(b"/public/")}
    assert keys_of[5] == set()
    assert _drain(nobody)[-1][1] == KTHXBAI


def _keys(message: list[bytes]) -> list[bytes]:
    """The keys of one KVBATCH (routing id first), or none for another message."""
    if message[1] != b"KVBATCH":
        return []
    return decode_kvbatch(message[1:]).raw_keys


def test_a_peer_sync_and_a_catch_up_are_never_shared() -> None:
    core = _core()
    opener, counters = _opener(core)
    peer = [_open(opener, b"p%d" % n, applied=True, ttl_left=True) for n in range(2)]
    assert all(isinstance(s, SnapshotStream) for s in peer)
    last = core.store.last_update()
    assert last is not None
    since = _since(last)
    catch_ups = [_open(opener, b"c%d" % n, since=since) for n in range(2)]
    assert all(isinstance(s, DeltaStream) for s in catch_ups)
    assert counters["client_catchups_served"] == 2
    assert counters["snapshot_encodings_shared"] == counters["snapshots_shared"] == 0
    # A catch-up the history cannot answer (another server's history: its
    # digest differs) falls back to the whole state, which is shared.
    stranger = SinceRequest(since.sequence, bytes(8))
    fallbacks = [_open(opener, b"f%d" % n, since=stranger) for n in range(2)]
    assert all(isinstance(s, SharedStream) for s in fallbacks)
    assert (counters["snapshot_encodings_shared"], counters["snapshots_shared"]) == (1, 1)
    assert [m[1:] for m in _drain(fallbacks[0])] == [m[1:] for m in _drain(fallbacks[1])]


def _since(last: list[bytes]) -> SinceRequest:
    return SinceRequest(int.from_bytes(last[1], "big"), update_digest(last))


def test_a_snapshot_of_freeze_keys_or_more_freezes_the_heap_and_a_smaller_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The opener (not the sans-IO stream) moves what is alive to the
    collector's permanent generation once a snapshot's key list is that long
    (clone.server.heap); here with the threshold at the core's 200 keys."""
    frozen: list[int] = []
    monkeypatch.setattr(opening, "freeze_state", lambda: frozen.append(1))
    opener, _ = _opener(_core())
    monkeypatch.setattr(opening, "FREEZE_KEYS", 201)
    _open(opener, b"small")
    assert frozen == []
    monkeypatch.setattr(opening, "FREEZE_KEYS", 200)
    _open(opener, b"at-the-threshold", applied=True)  # a peer's: a private stream
    assert frozen == [1]

