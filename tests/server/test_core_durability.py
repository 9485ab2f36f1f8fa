"""The core's side of durability, with explicit times and no sockets or disk:
the journal the reactor commits each turn, a catch-up from a sequence instead
of a full snapshot, and starting from a loaded state."""

from __future__ import annotations

from clone.server.core import CoreSettings, FollowOutcome, ServerCore
from clone.server.delta import DeltaStream
from clone.server.journal import OpKind
from clone.server.snapshot import SnapshotStream
from clone.wire.codec import encode_kthxbai
from clone.wire.delta import SinceRequest, encode_kvdelta, update_digest
from tests.support.published import kvset


def _kvset(key: str, body: bytes = b"v", n: int = 1, props: str = "") -> list[bytes]:
    return [key.encode(), bytes(8), n.to_bytes(16, "big"), props.encode(), body]


def _stream(core: ServerCore, since: SinceRequest | None) -> tuple[type, list[list[bytes]]]:
    stream = core.open_snapshot(b"peer", "", applied=True, since=since)
    out = []
    while not stream.done:
        frames = stream.peek()
        if frames is not None:
            out.append(list(frames[1:]))
            stream.advance()
    return type(stream), out


def _follower(durable: bool = True) -> ServerCore:
    core = ServerCore(durable=durable)
    core.become_passive()
    core.start_sync()
    return core


def test_the_active_journals_what_it_publishes_in_order() -> None:
    core = ServerCore(standalone=True)
    for i in range(3):
        assert core.on_kvset(_kvset(f"k{i}", n=i + 1), 0.0) is None  # no frames returned
    (op,) = core.journal.take()
    assert op.kind is OpKind.UPDATES
    assert [int.from_bytes(f[1], "big") for f in op.updates] == [1, 2, 3]
    assert [f[0] for f in op.updates] == [b"k0", b"k1", b"k2"]
    assert not core.journal  # taken
    assert core.history.last == 3


def test_expiry_deletes_are_journalled_like_updates() -> None:
    core = ServerCore(standalone=True)
    core.on_kvset(_kvset("k", props="ttl=1\n"), 100.0)
    core.journal.take()
    core.tick(101.5)
    (op,) = core.journal.take()
    (delete,) = op.updates
    assert delete[0] == b"k" and delete[4] == b""


def test_a_promotion_journals_the_pending_updates_it_applies() -> None:
    core = ServerCore()
    core.become_passive()
    core.on_kvset(_kvset("x", n=7), 1.0)
    assert not core.journal  # parked, not applied
    core.become_active(2.0)
    (op,) = core.journal.take()
    (applied,) = op.updates
    assert applied[0] == b"x" and applied[2] == (7).to_bytes(16, "big")


def test_a_full_sync_stages_then_replaces_and_the_history_restarts() -> None:
    active = ServerCore(standalone=True)
    for i in range(5):
        active.on_kvset(_kvset(f"k{i}", n=i + 1), 0.0)
    passive = _follower()
    kind, msgs = _stream(active, None)
    assert kind is SnapshotStream
    for frames in msgs:
        passive.on_snapshot_reply(frames, 0.0)
    ops = passive.journal.take()
    assert [op.kind for op in ops] == [OpKind.BEGIN_REPLACE, OpKind.STAGE, OpKind.REPLACE]
    assert len(ops[1].staged) == 5 and ops[2].sequence == 5
    assert passive.counters["syncs_full"] == 1 and passive.last_sync == "full"
    # Nothing followed yet: the history is empty, but the snapshot's key
    # written at its sequence is that update, which a catch-up can name.
    assert passive.history.last is None
    since = passive.catch_up_request()
    assert since == SinceRequest(5, update_digest(active.history.entry(5)[0]))  # type: ignore[index]


def test_after_a_full_snapshot_a_follower_catches_up_with_nothing_to_replay() -> None:
    """A relay that synced in full and saw no update before its upstream
    failed over (docs/benchmarks.md): an empty catch-up, not a snapshot."""
    active = ServerCore(standalone=True)
    for i in range(5):
        active.on_kvset(_kvset(f"k{i}", n=i + 1), 0.0)
    relay = ServerCore(relay=True)
    relay.start_sync()
    for frames in _stream(active, None)[1]:
        relay.on_snapshot_reply(frames, 0.0)
    relay.start_sync()
    kind, msgs = _stream(active, relay.catch_up_request())
    assert kind is DeltaStream
    assert [m[0] for m in msgs] == [b"KVAPPLIED", b"KVDELTA", b"KTHXBAI"]
    for frames in msgs:
        relay.on_snapshot_reply(frames, 0.0)
    assert relay.counters["syncs_catchup"] == 1 and relay.last_sync == "catch-up"
    assert relay.store.sequence == 5 and len(relay.store) == 5


def test_after_a_full_snapshot_ending_in_a_delete_a_follower_asks_for_a_snapshot() -> None:
    active = ServerCore(standalone=True)
    active.on_kvset(_kvset("a", n=1), 0.0)
    active.on_kvset(_kvset("b", n=2), 0.0)
    active.on_kvset(_kvset("a", b"", n=3), 0.0)  # the last update deletes: no key holds it
    passive = _follower(durable=False)
    for frames in _stream(active, None)[1]:
        passive.on_snapshot_reply(frames, 0.0)
    assert passive.store.sequence == 3 and passive.catch_up_request() is None


def test_an_in_memory_follower_stages_nothing() -> None:
    passive = _follower(durable=False)
    passive.on_snapshot_reply(encode_kthxbai(0), 0.0)
    assert [op.kind for op in passive.journal.take()] == [OpKind.REPLACE]


def _pair_in_step(n: int) -> tuple[ServerCore, ServerCore]:
    """An active with ``n`` updates and a passive that followed all of them."""
    active = ServerCore(standalone=True)
    passive = _follower()
    passive.on_snapshot_reply(encode_kthxbai(0), 0.0)
    for i in range(n):
        pub = kvset(active, _kvset(f"k{i % 3}", b"%d" % i, n=i + 1), float(i))
        assert pub is not None
        assert passive.on_peer_update(pub, float(i)) is FollowOutcome.OK
    passive.journal.take()
    return active, passive


def test_a_restarted_passive_catches_up_from_its_sequence() -> None:
    active, passive = _pair_in_step(10)
    since = passive.catch_up_request()
    held = active.history.entry(10)
    assert held is not None
    assert since == SinceRequest(10, update_digest(held[0]), held[1])
    # It misses five updates (down), then asks for what followed its sequence.
    for i in range(10, 15):
        active.on_kvset(_kvset(f"k{i % 3}", b"%d" % i, n=i + 1), float(i))
    passive.start_sync()
    kind, msgs = _stream(active, since)
    assert kind is DeltaStream
    outcomes = [passive.on_snapshot_reply(frames, 20.0) for frames in msgs]
    assert outcomes[-1] is FollowOutcome.SYNCED
    assert passive.counters["syncs_catchup"] == 1
    assert passive.counters["syncs_full"] == 1  # only the first, empty one
    assert passive.counters["catchup_updates_received"] == 5
    assert passive.store.sequence == 15
    assert {k: passive.store.get(k) for k in ("k0", "k1", "k2")} == {
        k: active.store.get(k) for k in ("k0", "k1", "k2")
    }
    # Journalled as ordinary updates: no staging, no replace.
    (op,) = passive.journal.take()
    assert op.kind is OpKind.UPDATES and len(op.updates) == 5


def test_a_catch_up_replays_deletes() -> None:
    active, passive = _pair_in_step(3)
    since = passive.catch_up_request()
    active.on_kvset([b"k0", bytes(8), (99).to_bytes(16, "big"), b"", b""], 5.0)
    passive.start_sync()
    for frames in _stream(active, since)[1]:
        passive.on_snapshot_reply(frames, 6.0)
    assert "k0" not in passive.store and passive.store.sequence == 4


def test_a_diverged_passive_gets_the_whole_state() -> None:
    active, _ = _pair_in_step(4)
    # The passive's update 4 is not the active's (another history, say a split brain).
    other = ServerCore(standalone=True)
    for i in range(4):
        other.on_kvset(_kvset("z", b"%d" % i, n=100 + i), 0.0)
    since = SinceRequest(4, update_digest(other.history.entry(4)[0]))  # type: ignore[index]
    kind, _ = _stream(active, since)
    assert kind is SnapshotStream


def test_history_too_short_means_a_full_snapshot() -> None:
    active = ServerCore(CoreSettings(history_max=5), standalone=True)
    for i in range(20):
        active.on_kvset(_kvset("k", b"%d" % i, n=i + 1), 0.0)
    since = SinceRequest(3, b"\0" * 8)
    assert _stream(active, since)[0] is SnapshotStream


def test_a_kvdelta_for_another_sequence_asks_for_a_resync() -> None:
    _, passive = _pair_in_step(3)
    passive.start_sync()
    assert passive.on_snapshot_reply(encode_kvdelta(2), 0.0) is FollowOutcome.RESYNC
    # ... and the next request is a plain one: a broken catch-up is not asked for again.
    assert passive.catch_up_request() is None
    assert passive.catch_up_request() is not None


def test_a_malformed_or_late_kvdelta_never_passes_for_a_snapshot() -> None:
    _, passive = _pair_in_step(3)
    before = passive.store.sequence
    passive.start_sync()
    assert passive.on_snapshot_reply([b"KVDELTA", b"\x01"], 0.0) is FollowOutcome.RESYNC
    passive.start_sync()
    passive.on_snapshot_reply([b"k9", (9).to_bytes(8, "big"), b"", b"", b"x"], 0.0)
    assert passive.on_snapshot_reply(encode_kvdelta(3), 0.0) is FollowOutcome.RESYNC
    assert passive.store.sequence == before and passive.counters["peer_invalid"] == 2


def test_load_restores_state_history_and_dedup_window() -> None:
    active = ServerCore(standalone=True)
    for i in range(6):
        active.on_kvset(_kvset(f"k{i % 2}", b"%d" % i, n=i + 1), 10.0 + i)
    rows = [(frames, 1, 10.0 + i) for i, frames in enumerate(active.history.since(0))]
    entries = {key.encode(): active.store.entry(key.encode()) for key in active.store.keys()}
    restarted = ServerCore(standalone=True)
    restarted.load(entries, 6, rows)  # type: ignore[arg-type]
    assert restarted.store.sequence == 6 and restarted.store.get("k1") == active.store.get("k1")
    assert restarted.history.last == 6 and restarted.highest_seen == 6
    # A client's resend of update 3 (confirmed before the restart) is not applied again.
    assert kvset(restarted, _kvset("k0", b"2", n=3), 20.0) is None
    assert restarted.counters["kvset_duplicate"] == 1
    # Its next sequence follows on.
    pub = kvset(restarted, _kvset("k0", b"new", n=50), 21.0)
    assert pub is not None and int.from_bytes(pub[1], "big") == 7


def test_a_log_that_does_not_end_at_the_state_is_not_served() -> None:
    active = ServerCore(standalone=True)
    for i in range(4):
        active.on_kvset(_kvset("k", b"%d" % i, n=i + 1), 0.0)
    rows = [(frames, 1, 0.0) for frames in active.history.since(0)][:3]  # ends at 3
    restarted = ServerCore(standalone=True)
    restarted.load({}, 4, rows)
    assert restarted.history.last is None and restarted.history.base == 4


def test_a_fork_at_an_update_both_actives_published_gets_a_full_snapshot() -> None:
    """After a failover the new active publishes its pending list with fresh
    sequences.  Here both actives published the same client write W at
    sequence 6, after different updates at 5 (Y, a call only the old one
    had; Z, a write only the new one had): the digests of 6 agree, the
    histories do not.  The term of W tells them apart, and the restarted old
    active gets the whole state (with Z), not a delta on top of Y
    (docs/drills.md, "A catch-up across a fork")."""
    old = ServerCore(standalone=True)
    old.term = 2
    new = _follower()
    new.term = 2  # a passive writes what it follows under its active's term
    new.on_snapshot_reply(encode_kthxbai(0), 0.0)
    for i in range(4):
        pub = kvset(old, _kvset(f"k{i}", n=i + 1), float(i))
        assert pub is not None and new.on_peer_update(pub, float(i)) is FollowOutcome.OK
    y, z, w = _kvset("y", n=10), _kvset("z", n=11), _kvset("w", n=12)
    new.on_kvset(z, 5.0)  # parked: the old active never got it
    new.on_kvset(w, 5.0)
    assert kvset(old, y, 5.0) is not None and kvset(old, w, 5.0) is not None
    assert old.store.sequence == 6
    # The old active stops; the new one takes over under term 3.
    new.term = 3
    new.become_active(6.0)
    assert new.store.sequence == 6
    ours, theirs = old.history.entry(6), new.history.entry(6)
    assert ours is not None and theirs is not None
    assert update_digest(ours[0]) == update_digest(theirs[0])  # the same W at 6
    assert (ours[1], theirs[1]) == (2, 3)
    since = old.catch_up_request()
    assert since == SinceRequest(6, update_digest(ours[0]), 2)
    kind, msgs = _stream(new, since)
    assert kind is SnapshotStream
    assert b"z" in {m[0] for m in msgs}  # the new active's write comes with it
    # By the digest alone it was a delta: the hole the term closes.
    assert _stream(new, SinceRequest(6, since.digest))[0] is DeltaStream
    # A relay does not send its term (its terms are not its upstream's).
    assert old.catch_up_request(with_term=False) == SinceRequest(6, since.digest)
