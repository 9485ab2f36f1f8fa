"""The client's catch-up rules (KVDELTA) without sockets, with a fake clock.

A client that holds the whole map and knows its last update asks for a
catch-up; a KVDELTA reply's updates are applied in place, like KVPUBs; a bad
one, or a hole, gives the catch-up up for a full snapshot asked without the
metadata.  ``MemoryServer`` (test_agent_fsm) plays the server; ``delta``
builds the reply our server would send.
"""

from __future__ import annotations

from clone.client.fsm import (
    AgentFSM,
    Changed,
    Confirmed,
    Malformed,
    RequestSnapshot,
    SendUpdate,
    State,
)
from clone.wire.codec import Hugz, KVMsg, encode_kthxbai, encode_kv, new_uuid
from clone.wire.delta import encode_kvdelta
from tests.client.test_agent_fsm import (
    CFG,
    MemoryServer,
    catch_up_of,
    feed_batches,
    feed_snapshot,
    synced,
)


def delta(updates: list[KVMsg], from_seq: int, end: int | None = None) -> list[list[bytes]]:
    """Our server's catch-up reply: KVDELTA, the updates as published, KTHXBAI."""
    last = updates[-1].sequence if updates else from_seq
    return [
        encode_kvdelta(from_seq),
        *(encode_kv(m) for m in updates),
        encode_kthxbai(last if end is None else end),
    ]


def requests(actions: list) -> list[RequestSnapshot]:
    return [a for a in actions if isinstance(a, RequestSnapshot)]


def active_with_updates(n: int = 2) -> tuple[AgentFSM, MemoryServer, MemoryServer, KVMsg]:
    """Synced on server 0, ``n`` live updates applied, then server 0 lost:
    syncing on server 1, which holds the same updates."""
    fsm, (primary, backup) = synced()
    last = None
    for i in range(n):
        last = primary.apply(f"k{i}", b"v")
        fsm.update(0, last, 0.1, encode_kv(last))
    assert last is not None
    backup.map, backup.seq = dict(primary.map), primary.seq
    actions = fsm.server_disconnected(0, 0.5)
    assert requests(actions) == [RequestSnapshot(1, ("",), catch_up_of(last))]
    return fsm, primary, backup, last


def test_no_catch_up_on_the_first_sync_nor_without_a_known_update() -> None:
    fsm = AgentFSM(None, CFG)
    assert requests(fsm.connect("tcp://a:1", 0.0)) == [RequestSnapshot(0, ("",))]
    fsm.connect("tcp://b:2", 0.0)
    srv = MemoryServer(0)
    srv.apply("a", b"1")
    srv.apply("b", b"2")
    srv.apply("b", b"")  # the last update, 3, a delete: in no snapshot
    feed_snapshot(fsm, srv, 0.1)
    # Synced at sequence 3 from a snapshot: the frames of update 3 are unknown.
    assert requests(fsm.server_disconnected(0, 0.2)) == [RequestSnapshot(1, ("",))]


def test_after_a_full_sync_the_snapshots_last_entry_is_the_catch_up_point() -> None:
    """A client that missed the first KVPUB after a full sync (its subscriber
    joined late) catches up from the snapshot's last entry, and so confirms
    its delete in that KVPUB, which no snapshot could show (a loaded run's
    ``clone del --prefix`` waited out its 5 s for it)."""
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    fsm.connect("tcp://b:2", 0.0)
    srv = MemoryServer(0)
    srv.apply("gone", b"x")
    last = srv.apply("stays", b"y")
    feed_snapshot(fsm, srv, 0.2)  # a full snapshot ends at ``last``
    assert fsm.state is State.ACTIVE and fsm.last_sequence == last.sequence
    delete = KVMsg.build("gone", b"", uuid=new_uuid())
    fsm.write(delete, 0.3, confirm_within=5.0)
    missed = srv.apply("gone", b"", delete.uuid)  # its KVPUB never arrives
    actions = fsm.update(0, Hugz(srv.seq), 0.4)
    assert requests(actions) == [RequestSnapshot(0, ("",), catch_up_of(last))]
    actions = fsm.snapshot_batch(0, delta([missed], last.sequence), 0.5)
    assert Confirmed(delete.uuid, missed.sequence) in actions
    assert fsm.state is State.ACTIVE and fsm.get("gone") is None


def test_several_subtrees_never_ask_for_a_catch_up() -> None:
    fsm, (primary, _) = synced(subtrees=["/a/", "/b/"])
    fsm.update(0, primary.apply("/a/x", b"1"), 0.1)
    actions = fsm.server_disconnected(0, 0.2)
    assert requests(actions) == [RequestSnapshot(1, ("/a/", "/b/"))]


def test_catch_up_is_applied_in_place_with_change_events() -> None:
    fsm, _, backup, last = active_with_updates()
    before = fsm.get("k0")
    new = [backup.apply("k0", b""), backup.apply("n", b"new"), backup.apply("n", b"newer")]
    actions = fsm.snapshot_batch(1, delta(new, last.sequence), 0.6)
    assert fsm.state is State.ACTIVE and fsm.current == 1
    assert before is not None and fsm.get("k0") is None
    assert fsm.get("n") == backup.map["n"]
    assert fsm.last_sequence == backup.seq
    # One change per update, in order, as for live updates (a delete keeps its message).
    changes = [(a.key, a.entry) for a in actions if isinstance(a, Changed)]
    assert changes == [("k0", new[0]), ("n", new[1]), ("n", new[2])]
    c = fsm.counters
    assert (c.syncs_catchup, c.syncs_full, c.catchup_updates) == (1, 1, 3)
    assert c.snapshots == 1 and c.resyncs == 1 and c.catchups_abandoned == 0
    assert {k: v.body for k, v in backup.map.items()} == {m.key: m.body for m in fsm.items()}


def test_a_later_resync_catches_up_from_the_last_caught_up_update() -> None:
    fsm, _, backup, last = active_with_updates()
    new = [backup.apply("n", b"1")]
    fsm.snapshot_batch(1, delta(new, last.sequence), 0.6)
    actions = fsm.server_disconnected(1, 0.7)
    assert requests(actions) == [RequestSnapshot(0, ("",), catch_up_of(new[0]))]


def test_an_empty_catch_up_completes() -> None:
    fsm, _, _, last = active_with_updates()
    fsm.snapshot_batch(1, delta([], last.sequence), 0.6)
    assert fsm.state is State.ACTIVE and fsm.last_sequence == last.sequence
    assert fsm.counters.syncs_catchup == 1 and fsm.counters.catchup_updates == 0


def test_a_catch_up_split_over_batches() -> None:
    fsm, _, backup, last = active_with_updates()
    reply = delta([backup.apply(f"n{i}", b"v") for i in range(5)], last.sequence)
    for i in range(0, len(reply), 2):
        fsm.snapshot_batch(1, reply[i : i + 2], 0.6)
    assert fsm.state is State.ACTIVE and fsm.last_sequence == backup.seq
    assert fsm.counters.catchup_updates == 5


def test_buffered_updates_are_replayed_after_the_kthxbai() -> None:
    fsm, _, backup, last = active_with_updates()
    caught = [backup.apply("a", b"1"), backup.apply("b", b"1")]
    live = [backup.apply("b", b""), backup.apply("c", b"1")]
    # Published while the catch-up streams: one that it holds, and two after it.
    for m in (caught[1], *live):
        fsm.update(1, m, 0.55, encode_kv(m))
    actions = fsm.snapshot_batch(1, delta(caught, last.sequence), 0.6)
    assert fsm.state is State.ACTIVE and fsm.last_sequence == live[-1].sequence
    assert fsm.get("b") is None and fsm.get("c") is not None
    assert [a.key for a in actions if isinstance(a, Changed)] == ["a", "b", "b", "c"]
    assert fsm.counters.catchup_updates == 2
    # The last update applied is a buffered one: the next catch-up names it.
    actions = fsm.server_disconnected(1, 0.7)
    assert requests(actions) == [RequestSnapshot(0, ("",), catch_up_of(live[-1]))]


def test_a_hole_in_the_buffer_after_a_catch_up_resyncs() -> None:
    fsm, _, backup, last = active_with_updates()
    caught = [backup.apply("a", b"1")]
    backup.apply("lost", b"1")
    after = backup.apply("c", b"1")
    fsm.update(1, after, 0.55, encode_kv(after))
    actions = fsm.snapshot_batch(1, delta(caught, last.sequence), 0.6)
    assert fsm.state is State.SYNCING and fsm.counters.gaps == 1
    # What was caught up stays: the next request is a catch-up from it.
    assert requests(actions) == [RequestSnapshot(1, ("",), catch_up_of(caught[0]))]


def test_a_hole_in_the_catch_up_asks_for_a_full_snapshot() -> None:
    fsm, _, backup, last = active_with_updates()
    first = backup.apply("a", b"1")
    backup.apply("skipped", b"1")
    third = backup.apply("c", b"1")
    actions = fsm.snapshot_batch(1, delta([first, third], last.sequence), 0.6)
    assert fsm.state is State.SYNCING
    assert requests(actions) == [RequestSnapshot(1, ("",))]  # no metadata
    c = fsm.counters
    assert (c.gaps, c.catchups_abandoned, c.syncs_catchup) == (1, 1, 0)
    # The update before the hole was applied: a whole, older state.
    assert fsm.last_sequence == first.sequence and fsm.get("a") is not None
    assert fsm.get("c") is None
    # The full snapshot then replaces the map; later resyncs may catch up again.
    feed_batches(fsm, backup, 0.7)
    assert fsm.state is State.ACTIVE and fsm.counters.syncs_full == 2
    m = backup.apply("d", b"1")
    fsm.update(1, m, 0.8, encode_kv(m))
    assert requests(fsm.server_disconnected(1, 0.9)) == [RequestSnapshot(0, ("",), catch_up_of(m))]


def test_a_kthxbai_beyond_the_updates_is_a_hole() -> None:
    fsm, _, backup, last = active_with_updates()
    new = [backup.apply("a", b"1")]
    actions = fsm.snapshot_batch(1, delta(new, last.sequence, end=new[0].sequence + 1), 0.6)
    assert fsm.state is State.SYNCING and requests(actions) == [RequestSnapshot(1, ("",))]
    assert fsm.counters.catchups_abandoned == 1 and fsm.counters.gaps == 1


def test_a_malformed_kvdelta_asks_for_a_full_snapshot_and_reads_nothing_more() -> None:
    fsm, _, backup, last = active_with_updates()
    keys = dict(fsm.rows())
    reply = delta([backup.apply("a", b"1")], last.sequence)
    reply[0] = [*reply[0][:2], b"\xff=x"]  # properties that do not decode
    actions = fsm.snapshot_batch(1, reply, 0.6)
    assert any(isinstance(a, Malformed) for a in actions)
    assert requests(actions) == [RequestSnapshot(1, ("",))]
    assert fsm.state is State.SYNCING and dict(fsm.rows()) == keys  # nothing applied
    c = fsm.counters
    assert (c.protocol_errors, c.catchups_abandoned, c.syncs_catchup) == (1, 1, 0)


def test_a_kvdelta_from_another_sequence_is_refused() -> None:
    fsm, _, backup, last = active_with_updates()
    reply = delta([backup.apply("a", b"1")], last.sequence)
    reply[0] = encode_kvdelta(last.sequence - 1)
    actions = fsm.snapshot_batch(1, reply, 0.6)
    assert requests(actions) == [RequestSnapshot(1, ("",))]
    assert fsm.get("a") is None and fsm.counters.catchups_abandoned == 1


def test_a_kvdelta_after_snapshot_data_is_refused() -> None:
    fsm, _, backup, last = active_with_updates()
    entry = encode_kv(backup.map["k0"])
    actions = fsm.snapshot_batch(1, [entry, *delta([], last.sequence)], 0.6)
    assert requests(actions) == [RequestSnapshot(1, ("",))]
    assert fsm.state is State.SYNCING and fsm.counters.catchups_abandoned == 1


def test_a_kvdelta_we_did_not_ask_for_is_refused() -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    actions = fsm.snapshot_batch(0, [encode_kvdelta(0), encode_kthxbai(0)], 0.1)
    assert fsm.state is State.SYNCING
    assert requests(actions) == [RequestSnapshot(0, ("",))]
    assert fsm.counters.protocol_errors == 1 and fsm.counters.catchups_abandoned == 1


def test_a_history_reply_is_not_a_catch_up() -> None:
    fsm, _, _, last = active_with_updates()
    compacted = [encode_kvdelta(last.sequence, compacted=9), encode_kthxbai(20)]
    actions = fsm.snapshot_batch(1, compacted, 0.6)
    assert requests(actions) == [RequestSnapshot(1, ("",))]
    assert fsm.last_sequence == last.sequence


def test_a_malformed_update_in_a_catch_up_gives_it_up() -> None:
    fsm, _, backup, last = active_with_updates()
    reply = delta([backup.apply("a", b"1"), backup.apply("b", b"1")], last.sequence)
    reply[2] = reply[2][:3]  # the second update, cut short
    actions = fsm.snapshot_batch(1, reply, 0.6)
    assert requests(actions) == [RequestSnapshot(1, ("",))]
    assert fsm.get("a") is not None and fsm.get("b") is None
    assert fsm.counters.protocol_errors == 1


def test_a_full_snapshot_answer_to_a_catch_up_request_replaces_the_map() -> None:
    """A server whose history no longer reaches back sends a snapshot."""
    fsm, _, backup, _ = active_with_updates()
    backup.apply("k0", b"")
    backup.apply("n", b"1")
    feed_batches(fsm, backup, 0.6)
    assert fsm.state is State.ACTIVE and fsm.get("k0") is None and fsm.get("n") is not None
    c = fsm.counters
    assert (c.syncs_full, c.syncs_catchup, c.catchups_abandoned) == (2, 0, 0)


def test_a_pending_write_is_confirmed_by_the_catch_up() -> None:
    fsm, _, backup, last = active_with_updates()
    uuid = new_uuid()
    fsm.write(KVMsg("w", 0, uuid, (), b"v"), 0.55, confirm_within=10.0)
    other = new_uuid()
    fsm.write(KVMsg("x", 0, other, (), b"v"), 0.55, confirm_within=10.0)
    written = backup.apply("w", b"v", uuid)
    actions = fsm.snapshot_batch(1, delta([written], last.sequence), 0.6)
    assert Confirmed(uuid, written.sequence) in actions
    # The one the new server never published is sent: held behind the first,
    # which, republished, showed our writes reach the new server's collector.
    assert fsm.pending_writes == 1
    assert SendUpdate(KVMsg("x", 0, other, (), b"v")) in actions


def test_a_gap_while_active_asks_for_a_catch_up() -> None:
    """Lost KVPUBs (a HUGZ ahead): the map is still whole at its sequence."""
    fsm, (primary, _) = synced()
    m = primary.apply("a", b"1")
    fsm.update(0, m, 0.1, encode_kv(m))
    primary.apply("lost", b"1")
    actions = fsm.update(0, Hugz(primary.seq), 0.2)
    assert requests(actions) == [RequestSnapshot(0, ("",), catch_up_of(m))]
    fsm.snapshot_batch(0, delta([primary.map["lost"]], m.sequence), 0.3)
    assert fsm.state is State.ACTIVE and fsm.counters.syncs_catchup == 1


def test_restricted_clients_never_ask_for_a_catch_up() -> None:
    fsm, (primary, _) = synced()
    fsm.view, fsm.view_count = "0123456789ab", 0
    m = primary.apply("a", b"1")
    fsm.update(0, m, 0.1, encode_kv(m))
    assert requests(fsm.server_disconnected(0, 0.2)) == [RequestSnapshot(1, ("",))]
