"""A follower's sync driven alone: SyncCore with its state objects, raw
frames and explicit times, no ServerCore and no sockets."""

from __future__ import annotations

from collections import defaultdict

import pytest

from clone.errors import IllegalTransitionError, ProtocolError
from clone.server.history import History
from clone.server.journal import Journal, OpKind
from clone.server.pending import PendingList, UuidWindow
from clone.server.store import Store
from clone.server.synccore import SYNC_TRANSITIONS, FollowOutcome, SyncCore, SyncEvent, SyncState
from clone.wire.applied import encode_kvapplied
from clone.wire.codec import KVMsg, encode_hugz, encode_kthxbai, encode_kv
from clone.wire.delta import encode_kvdelta


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def _pub(key: str, seq: int, n: int, body: bytes = b"v") -> list[bytes]:
    return encode_kv(KVMsg(key, seq, _uuid(n), (), body))


def _entry(key: str, seq: int, n: int, body: bytes = b"v") -> list[bytes]:
    """A KVSYNC of a snapshot, without the identity frame."""
    return _pub(key, seq, n, body)


class Follower:
    """A SyncCore with what it touches, and what it recorded and was told."""

    def __init__(self, *, buffer_max: int = 100, stage: bool = False) -> None:
        self.store = Store()
        self.history = History(1000, 1 << 20)
        self.journal = Journal(stage=stage)
        self.window = UuidWindow(1000)
        self.pending = PendingList(1000, 30.0)
        self.counters: defaultdict[str, int] = defaultdict(int)
        self.recorded: list[list[bytes]] = []
        self.hooks: list[tuple[str, float, set[bytes] | None]] = []
        self.sync = SyncCore(
            store=self.store,
            history=self.history,
            journal=self.journal,
            window=self.window,
            pending=self.pending,
            counters=self.counters,
            record=self._record,
            sync_buffer_max=buffer_max,
            fork_known=lambda now, ids: self.hooks.append(("fork", now, ids)),
            synced=lambda now, ids: self.hooks.append(("synced", now, ids)),
        )

    def _record(self, frames: list[bytes]) -> None:
        self.recorded.append(frames)
        self.history.append(frames, 1)
        self.journal.update(frames)


def test_every_table_pair_moves_as_written() -> None:
    for (start, event), end in SYNC_TRANSITIONS.items():
        sync = Follower().sync
        sync.state = start
        sync.transition(event)
        assert sync.state is end


def test_a_pair_outside_the_table_raises() -> None:
    sync = Follower().sync
    with pytest.raises(IllegalTransitionError):
        sync.transition(SyncEvent.SNAPSHOT_DONE)
    assert sync.state is SyncState.IDLE


def test_full_sync_stages_buffers_swaps_and_replays() -> None:
    f = Follower()
    f.sync.start()
    assert f.counters["syncs_started"] == 1 and f.sync.state is SyncState.SYNCING
    # Live updates while the snapshot streams: buffered, not applied.
    assert f.sync.on_peer_update(_pub("/b", 3, 3), 1.0, 1.0) is FollowOutcome.OK
    assert f.sync.on_peer_update(_pub("/c", 4, 4), 1.0, 1.0) is FollowOutcome.OK
    assert f.store.sequence == 0 and f.recorded == []
    assert f.sync.on_snapshot_reply(_entry("/a", 1, 1), 1.0, 1.0) is FollowOutcome.OK
    assert f.sync.on_snapshot_reply(_entry("/b", 2, 2, b"old"), 1.0, 1.0) is FollowOutcome.OK
    assert f.store.entry(b"/a") is None  # staged, not yet the state
    assert f.sync.on_snapshot_reply(encode_kthxbai(3), 2.0, 2.0) is FollowOutcome.SYNCED
    # Swapped in at 3, then the buffer: /b (3) was in the snapshot, /c (4) follows.
    assert f.store.sequence == 4 and f.sync.state is SyncState.SYNCED
    assert [r[0] for r in f.recorded] == [b"/c"]
    assert f.sync.last_sync == "full" and f.counters["syncs_full"] == 1
    assert f.sync.highest_seen == 4
    assert [h[0] for h in f.hooks] == ["fork", "fork", "fork", "synced"]
    kinds = [op.kind for op in f.journal.take()]
    assert kinds == [OpKind.REPLACE, OpKind.UPDATES]


def test_synced_follows_in_order_and_asks_again_on_a_gap() -> None:
    f = Follower()
    f.sync.start()
    f.sync.on_snapshot_reply(encode_kthxbai(0), 0.0, 0.0)
    assert f.sync.on_peer_update(_pub("/a", 1, 1), 1.0, 1.0) is FollowOutcome.OK
    assert f.sync.on_peer_update(_pub("/a", 1, 1), 1.0, 1.0) is FollowOutcome.OK  # stale
    assert f.counters["peer_stale"] == 1
    assert f.sync.on_peer_update(_pub("/a", 3, 3), 1.0, 1.0) is FollowOutcome.RESYNC
    assert f.counters["peer_gaps"] == 1 and f.store.sequence == 1
    # A heartbeat that disagrees with our sequence: resync too.
    assert f.sync.on_peer_update(encode_hugz(1), 2.0, 2.0) is FollowOutcome.OK
    assert f.sync.on_peer_update(encode_hugz(5), 2.0, 2.0) is FollowOutcome.OK  # may be coming
    assert f.sync.on_peer_update(encode_hugz(5), 2.1, 2.1) is FollowOutcome.RESYNC
    assert f.sync.highest_seen == 5


def test_a_hugz_ahead_waits_one_heartbeat_for_the_updates_it_announces() -> None:
    """An older active's HUGZ can overtake a KVPUB held by its commit: ahead
    of us once is not a gap; still short at the next HUGZ is."""
    f = Follower()
    f.sync.start()
    f.sync.on_snapshot_reply(encode_kthxbai(0), 0.0, 0.0)
    assert f.sync.on_peer_update(_pub("/a", 1, 1), 1.0, 1.0) is FollowOutcome.OK
    assert f.sync.on_peer_update(encode_hugz(2), 1.1, 1.1) is FollowOutcome.OK
    assert f.sync.on_peer_update(_pub("/a", 2, 2), 1.1, 1.1) is FollowOutcome.OK
    # Caught up with what it announced; ahead again by one in flight: fine.
    assert f.sync.on_peer_update(encode_hugz(3), 1.2, 1.2) is FollowOutcome.OK
    assert f.sync.on_peer_update(_pub("/a", 3, 3), 1.2, 1.2) is FollowOutcome.OK
    assert f.sync.on_peer_update(encode_hugz(3), 1.3, 1.3) is FollowOutcome.OK
    assert f.counters["peer_gaps"] == 0
    # 4 announced and never sent: the next HUGZ calls it a gap.
    assert f.sync.on_peer_update(encode_hugz(4), 1.4, 1.4) is FollowOutcome.OK
    assert f.sync.on_peer_update(encode_hugz(4), 1.5, 1.5) is FollowOutcome.RESYNC
    assert f.counters["peer_gaps"] == 1


def test_a_full_buffer_means_a_resync_not_unbounded_memory() -> None:
    f = Follower(buffer_max=2)
    f.sync.start()
    for seq in (1, 2, 3):
        f.sync.on_peer_update(_pub(f"/k{seq}", seq, seq), 1.0, 1.0)
    assert f.counters["sync_buffer_overflow"] == 1
    assert f.sync.on_snapshot_reply(encode_kthxbai(0), 2.0, 2.0) is FollowOutcome.RESYNC


def test_reconciliation_keeps_only_what_the_active_had_not_applied() -> None:
    f = Follower()
    for n, key in ((1, "/applied"), (2, "/not-yet")):
        f.pending.add(KVMsg(key, 0, _uuid(n), (), b"v"), 10.0, 10.0)
    f.pending.add(KVMsg("/too-old", 0, _uuid(3), (), b"v"), 1.0, 1.0)
    f.sync.start()
    (applied,) = encode_kvapplied(5, [_uuid(1)], span=5.0, fork=4)
    f.sync.on_snapshot_reply(applied, 12.0, 12.0)
    assert f.sync.peer_fork == 4
    assert f.sync.on_snapshot_reply(encode_kthxbai(5), 12.0, 12.0) is FollowOutcome.SYNCED
    # Applied: gone (and its id seen); arrived before the list reaches: gone
    # (unverifiable); not applied: kept for a later KVPUB or a promotion.
    assert [p.msg.key for p in f.pending] == ["/not-yet"]
    assert _uuid(1) in f.window
    assert f.counters["pending_already_applied"] == 1
    assert f.counters["pending_unverifiable"] == 1
    assert f.hooks[-1] == ("synced", 12.0, {_uuid(1)})


def test_catch_up_applies_in_place_and_checks_the_end() -> None:
    f = Follower()
    f.sync.start()
    f.sync.on_snapshot_reply(encode_kthxbai(0), 0.0, 0.0)
    f.sync.on_peer_update(_pub("/a", 1, 1), 1.0, 1.0)
    request = f.sync.catch_up_request()
    assert request is not None and request.sequence == 1
    f.sync.start()
    assert f.sync.on_snapshot_reply(encode_kvdelta(1), 2.0, 2.0) is FollowOutcome.OK
    assert f.sync.on_snapshot_reply(_entry("/b", 2, 2), 2.0, 2.0) is FollowOutcome.OK
    assert f.store.sequence == 2  # applied at once, not staged
    assert f.sync.on_snapshot_reply(encode_kthxbai(2), 2.0, 2.0) is FollowOutcome.SYNCED
    assert f.sync.last_sync == "catch-up" and f.counters["syncs_catchup"] == 1


def test_a_wrong_kvdelta_resyncs_plainly_once() -> None:
    f = Follower()
    f.sync.start()
    assert f.sync.on_snapshot_reply(encode_kvdelta(7), 1.0, 1.0) is FollowOutcome.RESYNC
    assert f.counters["peer_invalid"] == 1
    f.sync.on_snapshot_reply(encode_kthxbai(0), 0.0, 0.0)  # still syncing: a plain one
    assert f.sync.catch_up_request() is None


def test_stopping_mid_sync_keeps_the_whole_state_and_the_gapless_buffer() -> None:
    f = Follower()
    f.sync.start()
    f.sync.on_snapshot_reply(_entry("/a", 1, 1), 1.0, 1.0)
    f.sync.on_peer_update(_pub("/b", 1, 2), 1.0, 1.0)  # follows our (empty) state
    f.sync.on_peer_update(_pub("/c", 5, 3), 1.0, 1.0)  # a gap: not applied
    f.sync.stop(2.0, 2.0)
    assert f.sync.state is SyncState.IDLE
    assert f.store.entry(b"/a") is None and f.store.sequence == 1
    assert [r[0] for r in f.recorded] == [b"/b"]


def test_bad_frames_are_counted_and_raised() -> None:
    f = Follower()
    f.sync.start()
    with pytest.raises(ProtocolError):
        f.sync.on_peer_update([b"nonsense"], 1.0, 1.0)
    with pytest.raises(ProtocolError):
        f.sync.on_snapshot_reply(encode_kthxbai(1, "/sub"), 1.0, 1.0)
    assert f.counters["peer_invalid"] == 2


def test_replies_outside_a_sync_are_ignored() -> None:
    f = Follower()
    assert f.sync.on_snapshot_reply(_entry("/a", 1, 1), 1.0, 1.0) is FollowOutcome.OK
    assert f.counters["peer_ignored"] == 1 and f.store.entry(b"/a") is None


def test_a_durable_follower_stages_into_the_journal() -> None:
    f = Follower(stage=True)
    f.sync.start()
    f.sync.on_snapshot_reply(_entry("/a", 1, 1), 1.0, 1.0)
    f.sync.on_snapshot_reply(encode_kthxbai(1), 1.0, 1.0)
    kinds = [op.kind for op in f.journal.take()]
    assert kinds == [OpKind.BEGIN_REPLACE, OpKind.STAGE, OpKind.REPLACE]
