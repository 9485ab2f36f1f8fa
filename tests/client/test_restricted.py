"""Restricted mode and refusal notices in the agent's state machine.

No sockets, a fake clock.  ``FilteredServer`` plays one of our servers for a
client with limited read rights, as docs/protocol.md ("Security: CURVE, ACLs
and filtered streams") says it behaves: global sequences, a snapshot and a
stream holding only the view's keys, a KTHXBAI with the view's id and count,
and view heartbeats with the count so far.  It can lose publications, as a
full high-water mark does.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.client.fsm import (
    AgentConfig,
    AgentFSM,
    Changed,
    Confirmed,
    Refused,
    RequestSnapshot,
    SendUpdate,
    State,
)
from clone.client.sync import restricted_view
from clone.wire.codec import Hugz, KVMsg, encode_kthxbai, encode_kv, new_uuid
from clone.wire.control import Refusal, ViewHeartbeat, view_id

CFG = AgentConfig(heartbeat=1.0, server_timeout=2.5, resend_interval=0.5)


class FilteredServer:
    """One server's map and sequence, and what a client restricted to
    ``prefixes`` receives of it."""

    def __init__(self, prefixes: tuple[str, ...], index: int = 0) -> None:
        self.index = index
        self.prefixes = prefixes
        self.view = view_id([p.encode() for p in prefixes])
        self.seq = 0
        self.view_count = 0  # updates published under the prefixes
        self.map: dict[str, KVMsg] = {}

    def in_view(self, key: str) -> bool:
        return key.startswith(self.prefixes)

    def apply(self, key: str, body: bytes, uuid: bytes = b"") -> KVMsg | None:
        """Apply a write; return the KVPUB the restricted client receives, if any."""
        self.seq += 1
        msg = KVMsg(key, self.seq, uuid, (), body)
        if body:
            self.map[key] = msg
        else:
            self.map.pop(key, None)
        if not self.in_view(key):
            return None
        self.view_count += 1
        return msg

    def snapshot(self, subtree: str = "") -> list[list[bytes]]:
        frames = [
            encode_kv(m)
            for k, m in sorted(self.map.items())
            if self.in_view(k) and k.startswith(subtree)
        ]
        props = {"view": self.view, "view_count": str(self.view_count)}
        frames.append(encode_kthxbai(self.seq, subtree, props))
        return frames

    def beat(self, heartbeat: float | None = 0.25) -> ViewHeartbeat:
        return ViewHeartbeat(self.view, self.seq, heartbeat, self.view_count)


def restricted(
    prefixes: tuple[str, ...] = ("/public/",), subtrees: list[str] | None = None
) -> tuple[AgentFSM, FilteredServer]:
    fsm = AgentFSM(subtrees, CFG, now=0.0)
    srv = FilteredServer(prefixes)
    fsm.connect("tcp://127.0.0.1:5556", 0.0)
    fsm.connect("tcp://127.0.0.1:5566", 0.0)
    for subtree in fsm.subtrees:
        fsm.snapshot_batch(0, srv.snapshot(subtree), 0.0)
    assert fsm.state is State.ACTIVE
    return fsm, srv


def publish(fsm: AgentFSM, srv: FilteredServer, key: str, body: bytes, now: float) -> list:
    msg = srv.apply(key, body)
    return [] if msg is None else fsm.update(srv.index, msg, now)


def _requests(actions: list) -> list[int]:
    return [a.server for a in actions if isinstance(a, RequestSnapshot)]


def test_a_snapshot_with_a_view_makes_the_client_restricted() -> None:
    srv = FilteredServer(("/public/",))
    srv.apply("/public/a", b"1")
    srv.apply("/secret/x", b"s")
    srv.apply("/public/b", b"2")
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    fsm.snapshot_batch(0, srv.snapshot(), 0.0)
    assert fsm.state is State.ACTIVE
    assert (fsm.view, fsm.view_count, fsm.view_applied) == (srv.view, 2, 0)
    assert fsm.last_sequence == 3
    assert [m.key for m in fsm.items()] == ["/public/a", "/public/b"]


def test_an_unrestricted_snapshot_stays_unrestricted() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    fsm.snapshot_batch(0, [encode_kthxbai(0)], 0.0)
    assert fsm.view is None


def test_holes_in_the_sequence_are_accepted_and_counted() -> None:
    fsm, srv = restricted()
    for i in range(5):
        srv.apply(f"/secret/{i}", b"x")  # never sent to this client
        actions = publish(fsm, srv, f"/public/{i}", b"v", 1.0)
        assert _requests(actions) == []
        assert actions == [Changed(f"/public/{i}", srv.map[f"/public/{i}"])]
    assert fsm.last_sequence == srv.seq == 10
    assert fsm.view_applied == 5
    assert fsm.counters.gaps == 0
    assert fsm.update(0, srv.beat(), 1.5) == []
    assert fsm.state is State.ACTIVE


def test_stale_updates_are_still_discarded() -> None:
    fsm, srv = restricted()
    msg = srv.apply("/public/a", b"v")
    assert msg is not None
    fsm.update(0, msg, 1.0)
    assert fsm.update(0, msg, 1.1) == []
    assert fsm.counters.stale == 1 and fsm.view_applied == 1


def test_a_lost_update_is_found_by_the_next_view_heartbeat() -> None:
    fsm, srv = restricted()
    publish(fsm, srv, "/public/a", b"1", 1.0)
    srv.apply("/public/lost", b"2")  # the high-water mark dropped it
    srv.apply("/secret/x", b"s")
    publish(fsm, srv, "/public/c", b"3", 1.1)  # a hole, as any other
    assert fsm.state is State.ACTIVE
    actions = fsm.update(0, srv.beat(), 1.25)
    assert _requests(actions) == [0]  # resync from the same server
    assert fsm.state is State.SYNCING
    assert fsm.counters.view_gaps == 1 and fsm.counters.gaps == 1
    fsm.snapshot_batch(0, srv.snapshot(), 1.3)
    assert fsm.get("/public/lost") is not None
    assert fsm.update(0, srv.beat(), 1.5) == []


def test_a_view_heartbeat_for_another_view_resyncs() -> None:
    fsm, srv = restricted()
    other = ViewHeartbeat(view_id([b"/other/"]), srv.seq, 0.25, 0)
    assert _requests(fsm.update(0, other, 1.0)) == [0]
    assert fsm.counters.view_changes == 1


def test_updates_buffered_while_syncing_are_counted_with_their_holes() -> None:
    srv = FilteredServer(("/public/",))
    srv.apply("/public/a", b"1")
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    snapshot = srv.snapshot()  # taken at sequence 1, count 1
    early = srv.apply("/public/early", b"0")  # published before the KTHXBAI arrives
    srv.apply("/secret/x", b"s")
    later = srv.apply("/public/b", b"2")
    assert early is not None and later is not None
    fsm.update(0, early, 0.1)
    fsm.update(0, later, 0.2)
    fsm.snapshot_batch(0, snapshot, 0.3)
    assert fsm.state is State.ACTIVE
    assert (fsm.view_count, fsm.view_applied, fsm.last_sequence) == (1, 2, 4)
    assert {m.key for m in fsm.items()} == {"/public/a", "/public/early", "/public/b"}
    assert fsm.update(0, srv.beat(), 0.5) == []


def test_a_view_heartbeat_is_the_servers_heartbeat() -> None:
    fsm, srv = restricted()
    assert fsm.silence_timeout() == pytest.approx(2.5)
    assert fsm.update(0, srv.beat(0.25), 1.0) == []
    assert fsm.silence_timeout() == pytest.approx(4 * 0.25)
    assert fsm.tick(1.99) == []
    assert _requests(fsm.tick(2.0)) == [1]  # silent: fail over to the next server


def test_a_view_heartbeat_from_another_server_shows_it_active() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    fsm.connect("tcp://b:2", 0.0)
    beat = ViewHeartbeat(view_id([b"/p/"]), 5, 0.25, 1)
    assert _requests(fsm.update(1, beat, 0.1)) == [1]
    assert fsm.counters.hint_failovers == 1


def test_hugz_sequence_does_not_make_a_restricted_client_resync() -> None:
    fsm, srv = restricted()
    srv.apply("/secret/x", b"s")
    assert fsm.update(0, Hugz(srv.seq, 0.25), 1.0) == []
    assert fsm.state is State.ACTIVE


def test_an_unrestricted_client_keeps_the_plus_one_rule() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    fsm.snapshot_batch(0, [encode_kthxbai(0)], 0.0)
    fsm.update(0, KVMsg("/a", 1, b"", (), b"v"), 0.1)
    assert _requests(fsm.update(0, KVMsg("/a", 3, b"", (), b"v"), 0.2)) == [0]
    assert fsm.counters.gaps == 1


def test_a_resync_onto_an_unrestricted_snapshot_leaves_restricted_mode() -> None:
    fsm, srv = restricted()
    fsm.update(0, ViewHeartbeat(view_id([b"/x/"]), srv.seq, 0.25, 0), 1.0)  # rights changed
    fsm.snapshot_batch(0, [encode_kthxbai(srv.seq)], 1.1)
    assert fsm.state is State.ACTIVE and fsm.view is None


def test_several_subtrees_count_from_the_lowest_kthxbai() -> None:
    srv = FilteredServer(("/a/", "/b/"))
    srv.apply("/a/1", b"1")
    fsm = AgentFSM(["/a/", "/b/"], CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    first = srv.snapshot("/a/")  # sequence 1, count 1
    srv.apply("/b/1", b"2")
    second = srv.snapshot("/b/")  # sequence 2, count 2
    moved = srv.map["/b/1"]
    fsm.update(0, moved, 0.05)  # published between the two snapshots
    fsm.snapshot_batch(0, first, 0.1)
    fsm.snapshot_batch(0, second, 0.1)
    assert fsm.state is State.ACTIVE
    assert (fsm.view_count, fsm.view_applied) == (1, 1)
    assert fsm.update(0, srv.beat(), 0.5) == []


def test_restricted_view_rule() -> None:
    assert restricted_view({"": 5}, {}) is None
    assert restricted_view({"/a/": 5, "/b/": 3}, {"/a/": ("v", 9), "/b/": ("v", 7)}) == ("v", 7)
    assert restricted_view({"/a/": 5, "/b/": 3}, {"/a/": ("v", 9)}) == ("v", -1)


def test_control_messages_never_reach_the_map_or_the_changes() -> None:
    fsm, srv = restricted()
    uuid = new_uuid()
    actions = fsm.update(0, srv.beat(), 1.0) + fsm.update(0, Refusal("me", uuid, "acl"), 1.0)
    assert not any(isinstance(a, Changed) for a in actions)
    assert len(fsm) == 0


# --------------------------------------------------------------------------
# Refusal notices


def test_a_refusal_fails_the_confirmed_write_at_once() -> None:
    fsm, _ = restricted()
    msg = KVMsg.build("/secret/x", b"v", uuid=new_uuid())
    assert fsm.write(msg, 1.0, confirm_within=5.0) == [SendUpdate(msg)]
    actions = fsm.update(0, Refusal("reader", msg.uuid, "acl"), 1.1)
    assert actions == [Refused(msg.uuid, "acl", "/secret/x")]
    assert fsm.pending_writes == 0
    assert fsm.counters.refusals == 1 and fsm.counters.refused_writes == 1
    # Neither resent nor expired later (a silence failover resends pending writes).
    assert not any(isinstance(a, SendUpdate) for a in fsm.tick(10.0))
    assert fsm.counters.expired_writes == 0


def test_a_refusal_of_a_write_nobody_waits_on_is_counted_only() -> None:
    fsm, _ = restricted()
    msg = KVMsg.build("/secret/x", b"v", uuid=new_uuid())
    fsm.write(msg, 1.0, confirm_within=None)
    assert fsm.update(0, Refusal("reader", msg.uuid, "full"), 1.1) == []
    assert fsm.update(0, Refusal("reader", b"", "size"), 1.1) == []
    assert fsm.counters.refusals == 2 and fsm.counters.refused_writes == 0


def test_a_refusal_from_another_server_is_foreign() -> None:
    fsm, _ = restricted()
    msg = KVMsg.build("/secret/x", b"v", uuid=new_uuid())
    fsm.write(msg, 1.0, confirm_within=5.0)
    assert fsm.update(1, Refusal("reader", msg.uuid, "acl"), 1.1) == []
    assert fsm.pending_writes == 1 and fsm.counters.foreign == 1


def test_an_allowed_write_is_still_confirmed() -> None:
    fsm, srv = restricted()
    msg = KVMsg.build("/public/x", b"v", uuid=new_uuid())
    fsm.write(msg, 1.0, confirm_within=5.0)
    echoed = srv.apply("/public/x", b"v", msg.uuid)
    assert echoed is not None
    assert fsm.update(0, echoed, 1.1)[-1] == Confirmed(msg.uuid, echoed.sequence)


# --------------------------------------------------------------------------
# Any history: losses are found at the next view heartbeat, never otherwise


ops = st.lists(
    st.tuples(
        st.sampled_from(["/public/a", "/public/b", "/secret/x", "/public/c/d"]),
        st.sampled_from([b"", b"1", b"2"]),
        st.booleans(),  # lost on the way
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, min_size=1, max_size=5))
def test_restricted_client_converges_and_resyncs_exactly_on_loss(
    rounds: list[list[tuple[str, bytes, bool]]],
) -> None:
    fsm, srv = restricted()
    now = 1.0
    for round_ in rounds:
        lost = False
        for key, body, drop in round_:
            msg = srv.apply(key, body)
            if msg is None:
                continue
            if drop:
                lost = True
                continue
            now += 0.01
            assert _requests(fsm.update(0, msg, now)) == []
        now += 0.01
        actions = fsm.update(0, srv.beat(), now)
        assert bool(_requests(actions)) == lost
        if lost:
            fsm.snapshot_batch(0, srv.snapshot(), now)
        assert fsm.state is State.ACTIVE
        held = {m.key: m.body for m in fsm.items()}
        assert held == {k: m.body for k, m in srv.map.items() if srv.in_view(k)}
