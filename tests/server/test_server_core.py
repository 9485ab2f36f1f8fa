"""The server's decisions, driven by raw frames and explicit times (no sockets).

An in-memory pair links two cores the way the sockets would: the active core's
publications are fed to the passive one, and a snapshot of the active core
answers the passive's sync.
"""

from __future__ import annotations

import pytest

from clone.errors import CloneError, IllegalTransitionError, ProtocolError
from clone.server.core import (
    SYNC_TRANSITIONS,
    CoreSettings,
    FollowOutcome,
    Role,
    ServerCore,
    SyncEvent,
    SyncState,
)
from clone.wire.codec import (
    KVMsg,
    decode_update,
    encode_hugz,
    encode_icanhaz,
    encode_kthxbai,
    encode_kv,
)
from tests.support.published import kvset, promote, tick


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def _kvset(key: str, body: bytes = b"v", n: int = 1, props: str = "") -> list[bytes]:
    return [key.encode(), bytes(8), _uuid(n) if n else b"", props.encode(), body]


def _decode(frames: list[bytes]) -> KVMsg:
    msg = decode_update(frames)
    assert isinstance(msg, KVMsg)
    return msg


def _snapshot_of(
    core: ServerCore, *, batch: bool = False, applied: bool = True, now: float = 0.0
) -> list[list[bytes]]:
    """What the active core sends a peer server that asks for a snapshot (with
    the applied-update list first, as our servers ask)."""
    stream = core.open_snapshot(b"peer", "", batch=batch, applied=applied, now=now)
    out = []
    while not stream.done:
        frames = stream.peek()
        if frames is not None:
            out.append(frames[1:])
            stream.advance()
    return out


class Pair:
    """An active core and a passive core wired in memory."""

    def __init__(self, settings: CoreSettings | None = None) -> None:
        self.active = ServerCore(settings, standalone=True)
        self.passive = ServerCore(settings)
        self.passive.become_passive()
        self.passive.start_sync()

    def sync(self, *, batch: bool = False, now: float = 0.0) -> FollowOutcome:
        """The active's snapshot, received by the passive at ``now``."""
        outcome = FollowOutcome.OK
        for frames in _snapshot_of(self.active, batch=batch):
            outcome = self.passive.on_snapshot_reply(frames, now)
        return outcome

    def client_set(self, frames: list[bytes], now: float = 0.0, *, to_passive: bool = True) -> None:
        """A client writes to both collectors; the active's KVPUB reaches the passive."""
        pub = kvset(self.active, frames, now)
        if to_passive:
            self.passive.on_kvset(frames, now)
        if pub is not None:
            assert self.passive.on_peer_update(pub, now) is FollowOutcome.OK


# -- the sync table ------------------------------------------------------------


def _syncing(core: ServerCore) -> None:
    core.become_passive()
    core.start_sync()


def _synced(core: ServerCore) -> None:
    _syncing(core)
    assert core.on_snapshot_reply(encode_kthxbai(0), 0.0) is FollowOutcome.SYNCED


def _stop(core: ServerCore) -> None:
    core.become_active(0.0)


#: Each rule of the sync table, driven through the public API only: how to put a
#: fresh (paired) core in the rule's state, and the call that is the rule's event.
_SYNC_DRIVERS = {
    (SyncState.IDLE, SyncEvent.FOLLOW): (lambda core: core.become_passive(), ServerCore.start_sync),
    (SyncState.IDLE, SyncEvent.STOP): (lambda core: None, _stop),
    (SyncState.SYNCING, SyncEvent.FOLLOW): (_syncing, ServerCore.start_sync),
    (SyncState.SYNCING, SyncEvent.SNAPSHOT_DONE): (
        _syncing,
        lambda core: core.on_snapshot_reply(encode_kthxbai(0), 0.0),
    ),
    (SyncState.SYNCING, SyncEvent.STOP): (_syncing, _stop),
    (SyncState.SYNCED, SyncEvent.FOLLOW): (_synced, ServerCore.start_sync),
    (SyncState.SYNCED, SyncEvent.STOP): (_synced, _stop),
}


def test_every_sync_rule_has_a_public_driver() -> None:
    assert set(_SYNC_DRIVERS) == set(SYNC_TRANSITIONS)


@pytest.mark.parametrize(("start", "event"), list(SYNC_TRANSITIONS))
def test_every_sync_rule_is_reachable(start: SyncState, event: SyncEvent) -> None:
    prepare, act = _SYNC_DRIVERS[(start, event)]
    core = ServerCore()
    prepare(core)
    assert core.sync_state is start
    act(core)
    assert core.sync_state is SYNC_TRANSITIONS[(start, event)]


def test_illegal_sync_transition_raises() -> None:
    core = ServerCore()
    with pytest.raises(IllegalTransitionError) as raised:
        core.sync.transition(SyncEvent.SNAPSHOT_DONE)
    assert isinstance(raised.value, CloneError) and isinstance(raised.value, RuntimeError)


# -- active --------------------------------------------------------------------


def test_active_sequences_and_echoes_uuid_and_properties() -> None:
    core = ServerCore(standalone=True)
    outs = [kvset(core, _kvset(f"k{i}", n=i + 1, props="a=b\n"), now=0.0) for i in range(3)]
    msgs = [_decode(o) for o in outs if o is not None]
    assert [m.sequence for m in msgs] == [1, 2, 3]
    assert [m.uuid for m in msgs] == [_uuid(1), _uuid(2), _uuid(3)]
    assert all(m.properties == (("a", "b"),) for m in msgs)


def test_active_publishes_a_uuid_at_most_once_in_the_window() -> None:
    core = ServerCore(CoreSettings(dedup_window=2), standalone=True)
    assert kvset(core, _kvset("k", n=1), 0.0) is not None
    assert kvset(core, _kvset("k", n=1), 0.0) is None
    core.on_kvset(_kvset("k", n=2), 0.0)
    core.on_kvset(_kvset("k", n=3), 0.0)  # evicts 1
    assert kvset(core, _kvset("k", n=1), 0.0) is not None
    assert core.counters["kvset_duplicate"] == 1


def test_uuidless_updates_are_never_deduplicated() -> None:
    core = ServerCore(standalone=True)
    assert kvset(core, _kvset("k", b"1", n=0), 0.0) is not None
    assert kvset(core, _kvset("k", b"1", n=0), 0.0) is not None


@pytest.mark.parametrize(
    "frames",
    [
        [b"k", bytes(8), b"", b""],  # four frames
        [b"k", b"\x01", b"", b"", b"v"],  # short sequence
        [b"k", bytes(8), b"x", b"", b"v"],  # bad uuid
        [b"HUGZ", bytes(8), b"", b"", b"v"],  # reserved key
        [b"k", bytes(8), b"", b"ttl=abc\n", b"v"],
        [b"k", bytes(8), b"", b"ttl=-1\n", b"v"],
        [b"k", bytes(8), b"", b"", b"x" * (1024 * 1024 + 1)],
    ],
)
@pytest.mark.parametrize("standalone", [True, False])
def test_bad_kvsets_are_counted_and_raise(frames: list[bytes], standalone: bool) -> None:
    core = ServerCore(standalone=standalone)
    with pytest.raises(ProtocolError):
        core.on_kvset(frames, 0.0)
    assert core.counters["kvset_invalid"] == 1
    assert core.store.sequence == 0 and len(core.pending) == 0


def test_expiry_publishes_a_bare_delete() -> None:
    core = ServerCore(standalone=True)
    core.on_kvset(_kvset("k", props="ttl=2\n"), now=100.0)
    assert tick(core, 101.0) == []
    assert core.expiry_due(102.0)
    (frames,) = tick(core, 102.0)
    assert _decode(frames) == KVMsg("k", 2, b"", (), b"")
    assert core.counters["expired"] == 1


def test_hugz_carries_the_highest_sequence() -> None:
    core = ServerCore(standalone=True)
    core.on_kvset(_kvset("k"), 0.0)
    assert core.hugz() == encode_hugz(1)


def test_snapshot_request_decoding() -> None:
    core = ServerCore(standalone=True)
    assert core.snapshot_request(encode_icanhaz("/a/")) == "/a/"
    for bad in ([b"ICANHAZ?"], [b"ICANHAZ?", b"", b""], [b"WAT", b""], [b"ICANHAZ?", b"a"]):
        with pytest.raises(ProtocolError):
            core.snapshot_request(bad)
    assert core.counters["snapshot_invalid"] == 4


# -- passive -------------------------------------------------------------------


def test_passive_syncs_then_follows() -> None:
    pair = Pair()
    pair.client_set(_kvset("a", n=1), to_passive=False)
    pair.client_set(_kvset("b", props="ttl=5\n", n=2), now=10.0, to_passive=False)
    assert pair.sync(now=10.0) is FollowOutcome.SYNCED
    assert pair.passive.sync_state is SyncState.SYNCED
    pair.client_set(_kvset("c", n=3))
    assert pair.passive.store.keys() == pair.active.store.keys()
    assert pair.passive.store.sequence == pair.active.store.sequence == 3
    assert pair.passive.store.deadline("b") == 15.0
    assert len(pair.passive.pending) == 0


def test_passive_syncs_from_kvbatches_into_the_same_state() -> None:
    """Our own peer asks for batches: the staged entries are the KVSYNC frames
    they stand for, expiry deadlines and pending confirmations included."""
    plain, batched = Pair(), Pair()
    for pair in (plain, batched):
        for i in range(5000):
            props = "ttl=5\n" if i % 100 == 0 else ""
            frames = _kvset(f"/k/{i}", b"v%d" % i, n=i + 1, props=props)
            pair.client_set(frames, now=10.0, to_passive=False)
        pair.client_set(_kvset("/k/7", b"", n=9999), now=10.0, to_passive=False)  # a delete
        late = _kvset("late", n=10_000)  # parked on the passive, its KVPUB lost ...
        pair.active.on_kvset(late, 10.0)
        pair.passive.on_kvset(late, 10.0)
    assert len(batched.passive.pending) == 1
    assert plain.sync(now=10.0) is FollowOutcome.SYNCED
    assert batched.sync(batch=True, now=10.0) is FollowOutcome.SYNCED
    # two batches and KTHXBAI (without the applied-update list a peer asks for)
    assert len(_snapshot_of(batched.active, batch=True, applied=False)) == 3
    got, want = batched.passive.store, plain.passive.store
    assert got.keys() == want.keys() and len(got) == 5000  # 4999 and "late"
    assert all(got.entry(k.encode()) == want.entry(k.encode()) for k in want.keys())
    assert got.deadline("/k/100") == want.deadline("/k/100") == 15.0
    assert got.sequence == want.sequence == 5002
    assert len(batched.passive.pending) == 0  # ... and confirmed by the batch
    assert batched.passive.counters["snapshot_entries_received"] == 5000


def test_a_malformed_batch_from_the_peer_raises_and_counts() -> None:
    pair = Pair()
    pair.client_set(_kvset("a", n=1), to_passive=False)
    snapshot = _snapshot_of(pair.active, batch=True, applied=False)
    bad = list(snapshot[0])
    bad[3] = b"\x00" * 7  # sequences of the wrong size
    with pytest.raises(ProtocolError, match="needs 8 bytes of sequences"):
        pair.passive.on_snapshot_reply(bad, 0.0)
    assert pair.passive.counters["peer_invalid"] == 1
    assert pair.passive.on_snapshot_reply(snapshot[0], 0.0) is FollowOutcome.OK
    assert pair.passive.on_snapshot_reply(snapshot[1], 0.0) is FollowOutcome.SYNCED
    assert pair.passive.store.keys() == ["a"]


def test_updates_published_during_the_sync_are_buffered_and_replayed() -> None:
    pair = Pair()
    pair.client_set(_kvset("a", n=1))  # buffered: the passive is SYNCING
    snapshot = _snapshot_of(pair.active)  # sequence 1
    pair.client_set(_kvset("b", n=2))  # buffered, after the snapshot
    for frames in snapshot:
        pair.passive.on_snapshot_reply(frames, 0.0)
    assert pair.passive.store.get("b") is not None
    assert pair.passive.store.sequence == 2
    assert len(pair.passive.pending) == 0


def test_gap_in_the_buffer_asks_for_a_resync() -> None:
    pair = Pair()
    pair.active.on_kvset(_kvset("a", n=1), 0.0)  # never reaches the passive
    snapshot_seq0 = [encode_kthxbai(0)]
    pair.client_set(_kvset("b", n=2))  # sequence 2 buffered
    assert pair.passive.on_snapshot_reply(snapshot_seq0[0], 0.0) is FollowOutcome.RESYNC


def test_sequence_gap_while_following_asks_for_a_resync() -> None:
    pair = Pair()
    pair.sync()
    pair.active.on_kvset(_kvset("a", n=1), 0.0)  # lost
    pub = kvset(pair.active, _kvset("b", n=2), 0.0)
    assert pub is not None
    assert pair.passive.on_peer_update(pub, 0.0) is FollowOutcome.RESYNC
    assert pair.passive.counters["peer_gaps"] == 1


@pytest.mark.parametrize(
    ("hugz_seq", "outcome"), [(0, FollowOutcome.OK), (1, FollowOutcome.RESYNC)]
)
def test_hugz_reveals_a_missed_tail(hugz_seq: int, outcome: FollowOutcome) -> None:
    pair = Pair()
    pair.sync()
    # Ahead once may be updates on their way; the second HUGZ decides.
    pair.passive.on_peer_update(encode_hugz(hugz_seq), 0.0)
    assert pair.passive.on_peer_update(encode_hugz(hugz_seq), 0.0) is outcome


def test_stale_peer_updates_are_ignored() -> None:
    pair = Pair()
    pub = kvset(pair.active, _kvset("a", n=1), 0.0)
    pair.sync()
    assert pub is not None
    assert pair.passive.on_peer_update(pub, 0.0) is FollowOutcome.OK
    assert pair.passive.counters["peer_stale"] == 1


def test_pending_is_confirmed_in_either_order() -> None:
    pair = Pair()
    pair.sync()
    # client copy first, then the active's KVPUB
    pair.client_set(_kvset("a", n=1))
    # KVPUB first, then the late client copy: not parked
    pub = kvset(pair.active, _kvset("b", n=2), 0.0)
    assert pub is not None
    pair.passive.on_peer_update(pub, 0.0)
    pair.passive.on_kvset(_kvset("b", n=2), 0.0)
    assert len(pair.passive.pending) == 0
    assert pair.passive.counters["kvset_already_applied"] == 1


def test_promotion_applies_and_publishes_pending_in_order_with_fresh_sequences() -> None:
    pair = Pair()
    pair.client_set(_kvset("a", n=1))
    pair.sync()
    # the active dies; these reach only the passive
    pair.passive.on_kvset(_kvset("x", b"1", n=10), now=50.0)
    pair.passive.on_kvset(_kvset("y", b"2", n=11, props="ttl=10\n"), now=51.0)
    pair.passive.on_kvset(_kvset("x", b"3", n=12), now=52.0)
    outs = [_decode(f) for f in promote(pair.passive, now=55.0)]
    assert [(m.key, m.body, m.sequence) for m in outs] == [
        ("x", b"1", 2),
        ("y", b"2", 3),
        ("x", b"3", 4),
    ]
    assert outs[1].prop("expires") == "61.000"  # counted from arrival, not promotion
    assert pair.passive.role is Role.ACTIVE
    assert promote(pair.passive, now=56.0) == []  # idempotent
    # a client resending after the failover is deduplicated
    assert kvset(pair.passive, _kvset("x", b"1", n=10), 57.0) is None


def test_new_active_continues_from_the_highest_sequence_seen() -> None:
    pair = Pair()
    pair.sync()
    pair.passive.on_peer_update(encode_hugz(0), 0.0)
    # a KVPUB we could not apply (gap) still tells us how far the active got
    pair.passive.on_peer_update(encode_kv(KVMsg("z", 40, _uuid(5), (), b"v")), 0.0)
    pair.passive.become_active(0.0)
    out = kvset(pair.passive, _kvset("k", n=6), 0.0)
    assert out is not None and _decode(out).sequence == 41


def test_promotion_mid_sync_keeps_the_old_state_and_the_pending_list() -> None:
    core = ServerCore()
    core.become_passive()
    core.start_sync()
    core.on_snapshot_reply(encode_kv(KVMsg("half", 3, b"", (), b"v")), 0.0)
    core.on_kvset(_kvset("p", n=9), 1.0)
    outs = promote(core, 2.0)
    assert "half" not in core.store
    assert [_decode(f).key for f in outs] == ["p"]
    assert core.sync_state is SyncState.IDLE


def test_a_starting_server_parks_updates_until_it_is_told_its_role() -> None:
    core = ServerCore()
    assert core.role is Role.STARTING
    assert kvset(core, _kvset("k", n=1), 0.0) is None
    assert [_decode(f).key for f in promote(core, 0.0)] == ["k"]


def test_peer_messages_are_ignored_unless_passive() -> None:
    core = ServerCore(standalone=True)
    assert core.on_peer_update([b"garbage"], 0.0) is FollowOutcome.OK
    assert core.on_snapshot_reply([b"garbage"], 0.0) is FollowOutcome.OK
    assert core.counters["peer_ignored"] == 2


@pytest.mark.parametrize(
    "frames",
    [[b"x"], [b"k", b"\x00", b"", b"", b""], [b"HUGZ", b""], [b"k", bytes(8), b"", b"bad", b"v"]],
)
def test_bad_peer_input_raises_and_counts(frames: list[bytes]) -> None:
    pair = Pair()
    pair.sync()
    with pytest.raises(ProtocolError):
        pair.passive.on_peer_update(frames, 0.0)
    assert pair.passive.counters["peer_invalid"] == 1


def test_kthxbai_for_a_subtree_is_rejected() -> None:
    pair = Pair()
    with pytest.raises(ProtocolError):
        pair.passive.on_snapshot_reply(encode_kthxbai(0, "/a/"), 0.0)


def test_stepping_down_resyncs_into_a_fresh_state() -> None:
    core = ServerCore(standalone=True)
    core.on_kvset(_kvset("mine", n=1), 0.0)
    core.become_passive()
    core.start_sync()
    assert core.counters["demotions"] == 1
    core.on_snapshot_reply(encode_kv(KVMsg("theirs", 5, b"", (), b"v")), 0.0)
    assert core.on_snapshot_reply(encode_kthxbai(5), 0.0) is FollowOutcome.SYNCED
    assert core.store.keys() == ["theirs"] and core.store.sequence == 5


def test_sync_buffer_overflow_forces_a_resync() -> None:
    pair = Pair(CoreSettings(sync_buffer_max=2))
    for i in range(3):
        pair.client_set(_kvset(f"k{i}", n=i + 1), to_passive=False)
    assert pair.passive.counters["sync_buffer_overflow"] == 1
    assert pair.passive.on_snapshot_reply(encode_kthxbai(0), 0.0) is FollowOutcome.RESYNC


def test_stats_has_counters_and_gauges() -> None:
    stats = ServerCore(standalone=True).stats()
    assert stats["role"] == "active" and stats["keys"] == 0 and stats["kvset_received"] == 0


# -- pending updates after a sync (docs/failover.md, "Pending updates") ---------


def _restarted_passive_pair(writes: int, now: float = 100.0) -> Pair:
    """The rolling-restart case in memory: while the passive was (re)starting, a
    client overwrote key ``k`` ``writes`` times.  Both servers got every KVSET;
    the active applied and published them before the passive subscribed, so the
    passive never saw those KVPUBs, only its own copies, which are pending."""
    pair = Pair()
    for n in range(1, writes + 1):
        pair.active.on_kvset(_kvset("k", b"v%d" % n, n=n), now)
        pair.passive.on_kvset(_kvset("k", b"v%d" % n, n=n), now)
    assert len(pair.passive.pending) == writes
    return pair


def test_a_sync_drops_pending_updates_the_active_applied_and_superseded() -> None:
    pair = _restarted_passive_pair(5)
    assert pair.sync() is FollowOutcome.SYNCED
    # v1..v4 were applied and superseded by v5 (the snapshot's entry): none of
    # them may be applied again at a promotion.
    assert len(pair.passive.pending) == 0
    assert pair.passive.counters["pending_already_applied"] == 4
    pair.passive.become_active(101.0)
    assert pair.passive.store.get("k").body == b"v5"  # type: ignore[union-attr]


def test_a_late_copy_of_an_applied_update_is_not_parked_after_the_sync() -> None:
    pair = _restarted_passive_pair(1)
    pair.active.on_kvset(_kvset("k", b"v2", n=2), 100.0)  # superseded before the snapshot
    pair.sync()
    # The passive reads its client's copy of v2 only now (a busy loop).
    pair.passive.on_kvset(_kvset("k", b"v2", n=2), 100.5)
    assert len(pair.passive.pending) == 0
    assert pair.passive.counters["kvset_already_applied"] == 1


def test_a_sync_keeps_pending_updates_the_active_has_not_applied() -> None:
    pair = _restarted_passive_pair(2)
    # In flight: the passive has it, the active has not applied it yet.
    pair.passive.on_kvset(_kvset("k", b"v3", n=3), 100.0)
    pair.sync()
    assert [p.msg.body for p in pair.passive.pending] == [b"v3"]
    # The active dies before it applies it: the promoted passive applies it.
    pair.passive.become_active(101.0)
    assert pair.passive.store.get("k").body == b"v3"  # type: ignore[union-attr]


def test_pending_updates_older_than_the_applied_list_reaches_are_dropped() -> None:
    settings = CoreSettings(dedup_window=2)
    pair = Pair(settings)
    # Arrived at 10.0; by the snapshot the active's window (2 ids) reaches back
    # only to 50.0: whether it applied this one cannot be told, so it goes.
    pair.passive.on_kvset(_kvset("old", n=1), 10.0)
    for n in (2, 3, 4):
        pair.client_set(_kvset("k", b"v%d" % n, n=n), now=50.0, to_passive=False)
    for frames in _snapshot_of(pair.active, now=60.0):
        pair.passive.on_snapshot_reply(frames, 60.0)
    assert len(pair.passive.pending) == 0
    assert pair.passive.counters["pending_unverifiable"] == 1


def test_without_an_applied_list_a_sync_keeps_no_pending_update() -> None:
    """A peer that sends no list (an older version): nothing pending can be
    vouched for, so nothing stays (their writers resend what was unconfirmed)."""
    pair = _restarted_passive_pair(3)
    pair.passive.on_kvset(_kvset("k", b"v4", n=4), 100.0)
    for frames in _snapshot_of(pair.active, applied=False):
        pair.passive.on_snapshot_reply(frames, 100.0)
    assert len(pair.passive.pending) == 0
    # v3 is the snapshot's entry (confirmed by it); v1, v2 and v4 go.
    assert pair.passive.counters["pending_unverifiable"] == 3


def test_a_resync_forgets_the_applied_list_of_the_abandoned_sync() -> None:
    pair = _restarted_passive_pair(2)
    snapshot = _snapshot_of(pair.active)
    pair.passive.on_snapshot_reply(snapshot[0], 100.0)  # the KVAPPLIED
    pair.passive.start_sync()  # abandoned (a gap, a timeout)
    for frames in _snapshot_of(pair.active, applied=False):
        pair.passive.on_snapshot_reply(frames, 100.0)
    assert pair.passive.counters["pending_already_applied"] == 0
    assert pair.passive.counters["pending_unverifiable"] == 1  # v2 is the snapshot's entry


def test_a_malformed_applied_list_raises_and_counts() -> None:
    pair = _restarted_passive_pair(1)
    with pytest.raises(ProtocolError, match="multiple of 16"):
        pair.passive.on_snapshot_reply([b"KVAPPLIED", bytes(8), b"span_ms=1\n", b"x"], 100.0)
    assert pair.passive.counters["peer_invalid"] == 1
