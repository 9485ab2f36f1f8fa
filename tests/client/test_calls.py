"""Calls and lease keepalives in the client agent's state machine: no sockets,
a fake clock (``now`` is an argument), replies made with the wire codec.

Times: heartbeat 1 s, resend every 0.5 s (``CFG``); a lease of 3 s is kept
alive every 1 s.
"""

from __future__ import annotations

import itertools

import pytest

from clone.client.fsm import (
    AgentFSM,
    CallReplied,
    Confirmed,
    LeaseGone,
    LeaseKept,
    SendCall,
    State,
)
from clone.wire.calls import (
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_KEEPALIVES,
    OP_LEASE_REVOKE,
    OP_SET,
    Call,
    Reply,
    decode_call,
    parse_keepalives,
)
from clone.wire.codec import Hugz, KVMsg, new_uuid
from clone.wire.control import ViewHeartbeat
from tests.client.test_agent_fsm import CFG, feed_snapshot, synced

LEASE = "0123456789abcdef0123456789abcdef"


def cas(key: str = "/k", if_sequence: int = 0) -> Call:
    return Call(OP_SET, new_uuid(), key, (("if_sequence", str(if_sequence)),), b"v")


def sent(actions: list) -> list[SendCall]:
    return [a for a in actions if isinstance(a, SendCall)]


def sent_calls(actions: list) -> list[tuple[int, Call]]:
    """(server, decoded call) for each SendCall."""
    return [(a.server, decode_call(list(a.frames))) for a in sent(actions)]


def ok(uuid: bytes, sequence: int = 0, **kw: object) -> Reply:
    # Sequence 0: at or behind any replica, so told at once (the read-your-
    # writes hold of a set call's reply is tested on its own, below).
    return Reply(uuid, "ok", sequence, **kw)  # type: ignore[arg-type]


def refused(uuid: bytes, reason: str) -> Reply:
    return Reply(uuid, "refused", reason=reason, detail=f"because {reason}")


def keeping(ttl: float = 3.0) -> AgentFSM:
    """Synced on server 0 of two, keeping ``LEASE`` from time 0; keepalive
    uuids are 1, 2, 3... (16 bytes each)."""
    fsm, _ = synced()
    ids = itertools.count(1)
    fsm.new_call_id = lambda: next(ids).to_bytes(16, "big")
    assert fsm.keep_lease(LEASE, ttl, 0.0) == []
    return fsm


def uid(n: int) -> bytes:
    return n.to_bytes(16, "big")


# --------------------------------------------------------------------------
# Calls


def test_a_call_goes_to_the_current_server_at_once_and_its_reply_ends_it() -> None:
    fsm, _ = synced()
    call = cas()
    [(server, wire)] = sent_calls(fsm.call(call, 1.0, within=5.0))
    assert server == 0 and wire == call
    assert fsm.pending_calls == 1
    assert fsm.replied(0, ok(call.uuid), 1.1) == [CallReplied(ok(call.uuid))]
    assert fsm.pending_calls == 0 and fsm.next_deadline() == fsm._silence_at


def test_an_unanswered_call_is_resent_every_resend_interval_same_uuid() -> None:
    fsm, _ = synced()
    call = cas()
    fsm.call(call, 1.0, within=5.0)
    assert fsm.next_deadline() == 1.5
    assert sent(fsm.tick(1.4)) == []
    again = sent_calls(fsm.tick(1.5))
    assert again == [(0, call)]
    assert sent_calls(fsm.tick(2.0)) == [(0, call)]
    assert fsm.counters.calls_resent == 2


def test_conflicts_and_refusals_end_a_call_and_a_late_reply_is_dropped() -> None:
    fsm, _ = synced()
    first, second = cas(), cas()
    fsm.call(first, 1.0, within=5.0)
    fsm.call(second, 1.0, within=5.0)
    conflict = Reply(first.uuid, "conflict", current=4)
    assert fsm.replied(0, conflict, 1.1) == [CallReplied(conflict)]
    refusal = refused(second.uuid, "acl")
    assert fsm.replied(0, refusal, 1.1) == [CallReplied(refusal)]
    # The answer to a resend of the first, arriving after: nobody waits.
    assert fsm.replied(0, ok(first.uuid), 1.2) == []
    assert fsm.counters.late_replies == 1 and fsm.pending_calls == 0


def test_not_active_keeps_the_call_and_asks_again_a_resend_interval_later() -> None:
    fsm, _ = synced()
    call = cas()
    fsm.call(call, 1.0, within=5.0)
    assert fsm.replied(0, refused(call.uuid, "not-active"), 1.2) == []
    assert fsm.pending_calls == 1 and fsm.counters.calls_not_active == 1
    assert sent(fsm.tick(1.5)) == []  # not at the old resend time: 0.5 s after the answer
    assert sent_calls(fsm.tick(1.7)) == [(0, call)]
    assert fsm.replied(0, ok(call.uuid), 1.8) == [CallReplied(ok(call.uuid))]


def test_a_reply_from_another_server_ends_the_call_too() -> None:
    fsm, _ = synced()
    call = cas()
    fsm.call(call, 1.0, within=5.0)
    assert fsm.replied(1, ok(call.uuid), 1.1) == [CallReplied(ok(call.uuid))]


def test_a_failover_sends_waiting_calls_to_the_new_server_at_once() -> None:
    fsm, (_, backup) = synced()
    call = cas()
    fsm.call(call, 1.0, within=10.0)
    fsm.server_disconnected(0, 1.1)
    assert fsm.current == 1 and fsm.state is State.SYNCING
    assert sent_calls(fsm.tick(1.1)) == [(1, call)]  # not waiting for 1.5
    # The backup, not yet active, says so; its sync completes: at once again.
    fsm.replied(1, refused(call.uuid, "not-active"), 1.15)
    actions = feed_snapshot(fsm, backup, 1.2)
    assert fsm.state is State.ACTIVE and sent(actions) == []
    assert sent_calls(fsm.tick(1.2)) == [(1, call)]
    assert fsm.replied(1, ok(call.uuid), 1.3) == [CallReplied(ok(call.uuid))]


def test_a_resync_on_the_same_server_sends_waiting_calls_again() -> None:
    fsm, (srv, _) = synced()
    call = cas()
    fsm.call(call, 1.0, within=10.0)
    srv.apply("x", b"1")
    fsm.update(0, srv.apply("y", b"2"), 1.1)  # a hole: resync
    assert fsm.state is State.SYNCING
    assert sent(fsm.tick(1.1)) == []  # same server, no sync completed yet
    feed_snapshot(fsm, srv, 1.2)
    assert sent_calls(fsm.tick(1.2)) == [(0, call)]


def test_a_call_past_its_deadline_is_dropped_silently() -> None:
    fsm, _ = synced()
    fsm.call(cas(), 1.0, within=0.7)
    fsm.update(0, _hugz(), 1.6)
    assert fsm.tick(1.7) == []
    assert fsm.pending_calls == 0 and fsm.counters.calls_expired == 1


def test_a_call_made_before_any_server_waits_for_one_without_spinning() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    call = cas()
    assert fsm.call(call, 0.0, within=5.0) == []
    # Nothing to send until a server is added: only the deadline is pending.
    assert fsm.next_deadline() == 5.0
    assert fsm.tick(1.0) == []
    fsm.connect("tcp://a:1", 1.0)
    assert sent_calls(fsm.tick(1.0)) == [(0, call)]


def test_a_call_is_sent_while_syncing() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    assert fsm.state is State.SYNCING
    call = Call(OP_LEASE_GRANT, new_uuid(), properties=(("ttl", "2.0"),))
    assert sent_calls(fsm.call(call, 0.1, within=5.0)) == [(0, call)]


def test_bad_call_arguments_are_misuse() -> None:
    fsm, _ = synced()
    call = cas()
    with pytest.raises(ValueError, match="> 0"):
        fsm.call(call, 1.0, within=0)
    fsm.call(call, 1.0, within=1.0)
    with pytest.raises(ValueError, match="already waiting"):
        fsm.call(call, 1.0, within=1.0)
    with pytest.raises(ValueError, match="hex"):
        fsm.keep_lease("nope", 2.0, 1.0)
    with pytest.raises(ValueError, match="ttl"):
        fsm.keep_lease(LEASE, 0, 1.0)


# --------------------------------------------------------------------------
# Lease keepalives


def _hugz() -> Hugz:
    """A HUGZ saying a 1 s heartbeat: keeps the server alive for 4 s."""
    return Hugz(0, 1.0)


def keepalives(actions: list) -> list[tuple[int, Call]]:
    out = sent_calls(actions)
    assert all(c.op == OP_LEASE_KEEPALIVE and c.lease == LEASE for _, c in out)
    return out


def test_keepalives_every_third_of_the_ttl_each_with_a_fresh_uuid() -> None:
    fsm = keeping(3.0)
    assert fsm.next_deadline() == 1.0
    assert fsm.tick(0.9) == []
    for n, t in enumerate((1.0, 2.0, 3.0), start=1):
        [(server, call)] = keepalives(fsm.tick(t))
        assert server == 0 and call.uuid == uid(n)
        # Answered: the lease is known held until the keepalive was made + ttl.
        kept = fsm.replied(0, ok(call.uuid, 0, lease=LEASE, ttl=3.0), t + 0.01)
        assert kept == [LeaseKept(LEASE, t + 3.0)]
        fsm.update(0, _hugz(), t + 0.01)  # the server stays alive
    assert fsm.counters.keepalives == 3 and fsm.pending_calls == 0
    assert fsm.kept_leases == (LEASE,)


def test_an_unanswered_keepalive_is_resent_then_replaced_by_the_next() -> None:
    fsm = keeping(3.0)
    keepalives(fsm.tick(1.0))
    fsm.update(0, _hugz(), 1.4)
    assert keepalives(fsm.tick(1.5)) == [
        (0, Call(OP_LEASE_KEEPALIVE, uid(1), "", (("lease", LEASE),)))
    ]
    fsm.update(0, _hugz(), 1.9)
    [(_, second)] = keepalives(fsm.tick(2.0))  # the next one, not a third resend
    assert second.uuid == uid(2) and fsm.pending_calls == 1
    # The old one's answer, late, changes nothing.
    assert fsm.replied(0, refused(uid(1), "unknown-lease"), 2.1) == []
    assert fsm.kept_leases == (LEASE,) and fsm.counters.late_replies == 1


def test_keepalives_follow_a_failover_and_retry_a_passive_sooner() -> None:
    fsm = keeping(3.0)
    keepalives(fsm.tick(1.0))  # unanswered: the active dies
    fsm.server_disconnected(0, 1.1)
    [(server, call)] = keepalives(fsm.tick(1.1))
    assert server == 1 and call.uuid == uid(1)  # the same keepalive, to the backup at once
    assert fsm.replied(1, refused(uid(1), "not-active"), 1.15) == []
    assert keepalives(fsm.tick(1.6)) == []
    assert [c.uuid for _, c in keepalives(fsm.tick(1.65))] == [uid(1)]  # a resend later
    # Made at 1.0 (resent since): held until at least 1.0 + ttl.
    assert fsm.replied(1, ok(uid(1), 0, lease=LEASE, ttl=3.0), 1.7) == [LeaseKept(LEASE, 4.0)]
    assert fsm.kept_leases == (LEASE,)


def test_a_refused_keepalive_means_the_lease_is_lost() -> None:
    fsm = keeping(3.0)
    [(_, call)] = keepalives(fsm.tick(1.0))
    actions = fsm.replied(0, refused(call.uuid, "unknown-lease"), 1.1)
    assert actions == [LeaseGone(LEASE, "unknown-lease (because unknown-lease)")]
    assert fsm.kept_leases == () and fsm.counters.leases_lost == 1
    fsm.update(0, _hugz(), 2.0)
    assert fsm.tick(2.0) == [] and fsm.next_deadline() == fsm._silence_at


def test_revoking_a_lease_stops_its_keepalives() -> None:
    fsm = keeping(3.0)
    keepalives(fsm.tick(1.0))  # one in flight
    revoke = Call(OP_LEASE_REVOKE, new_uuid(), properties=(("lease", LEASE),))
    [(_, wire)] = sent_calls(fsm.call(revoke, 1.2, within=5.0))
    assert wire == revoke
    assert fsm.kept_leases == () and fsm.pending_calls == 1  # the revoke only
    fsm.update(0, _hugz(), 1.9)
    assert [c.op for _, c in sent_calls(fsm.tick(2.0))] == [OP_LEASE_REVOKE]  # its resend
    assert fsm.replied(0, ok(revoke.uuid, 9), 2.1) == [CallReplied(ok(revoke.uuid, 9))]
    fsm.update(0, _hugz(), 3.9)
    assert fsm.tick(4.0) == []


def test_the_server_ttl_sets_the_cadence() -> None:
    fsm = keeping(3.0)
    [(_, call)] = keepalives(fsm.tick(1.0))
    fsm.replied(0, ok(call.uuid, 0, lease=LEASE, ttl=6.0), 1.1)
    fsm.update(0, _hugz(), 2.0)
    [(_, call)] = keepalives(fsm.tick(2.0))  # planned when the last one went
    assert call.uuid == uid(2)
    fsm.replied(0, ok(call.uuid, 0, lease=LEASE, ttl=6.0), 2.1)
    fsm.update(0, _hugz(), 3.9)
    assert keepalives(fsm.tick(3.9)) == []  # now every 2 s: at 4.0
    assert len(keepalives(fsm.tick(4.0))) == 1


def test_keepalives_without_a_server_wait_for_one() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.keep_lease(LEASE, 0.9, 0.0)
    assert fsm.tick(0.3) == [] and fsm.pending_calls == 1
    assert fsm.next_deadline() == pytest.approx(0.6)
    fsm.connect("tcp://a:1", 0.4)
    assert len(keepalives(fsm.tick(0.4))) == 1


# -- write-only prefixes --------------------------------------------------------


def _restricted_write() -> tuple[AgentFSM, KVMsg]:
    fsm, _ = synced()
    fsm.view, fsm.view_count = VIEW, 0
    msg = KVMsg("/nodes/web1", 0, new_uuid(), (("ttl", "5"),), b"10.0.0.5")
    ((server, call),) = sent_calls(fsm.write_confirmed(msg, 1.0, within=5.0))
    assert (server, call.op, call.uuid, call.key, call.body) == (
        0,
        "set",
        msg.uuid,
        msg.key,
        msg.body,
    )
    assert call.properties == msg.properties and fsm.pending_writes == 1
    assert fsm.counters.writes_as_calls == 1
    return fsm, msg


VIEW = "0123456789ab"


def test_a_restricted_write_of_a_key_it_cannot_read_is_confirmed_by_reply_and_heartbeat() -> None:
    """In restricted mode the KVPUB of a key we may write but not read never
    comes: a confirmed write is a ``set`` call with the same uuid, confirmed
    once its REPLY came and a view heartbeat at or past its sequence showed
    that its update is not in our view."""
    fsm, msg = _restricted_write()
    assert fsm.replied(0, ok(msg.uuid, 12), 1.1) == []  # not yet: is it in our view?
    assert fsm.update(0, ViewHeartbeat(VIEW, 11, 0.1, 0), 1.2) == []
    assert fsm.update(0, ViewHeartbeat(VIEW, 12, 0.1, 0), 1.3) == [Confirmed(msg.uuid, 12)]
    assert fsm.pending_writes == 0 and fsm.items("/nodes/") == []
    # A heartbeat first, then the REPLY: confirmed at once.
    fsm2, msg2 = _restricted_write()
    fsm2.update(0, ViewHeartbeat(VIEW, 20, 0.1, 0), 1.2)
    assert fsm2.replied(0, ok(msg2.uuid, 20), 1.3) == [Confirmed(msg2.uuid, 20)]


def test_a_restricted_write_of_a_key_it_can_read_is_confirmed_by_its_update() -> None:
    fsm, msg = _restricted_write()
    published = KVMsg(msg.key, 12, msg.uuid, msg.properties, msg.body)
    assert Confirmed(msg.uuid, 12) in fsm.update(0, published, 1.1)
    assert fsm.get(msg.key) is not None  # read your own write, as unrestricted
    (late,) = fsm.replied(0, ok(msg.uuid, 12), 1.2)  # nobody waits on it any more
    assert isinstance(late, CallReplied) and fsm.pending_writes == 0


def test_a_refused_restricted_write_fails_at_once() -> None:
    fsm, msg = _restricted_write()
    (answer,) = fsm.replied(0, refused(msg.uuid, "acl"), 1.1)
    assert isinstance(answer, CallReplied) and answer.reply.reason == "acl"
    assert fsm.pending_writes == 0
    # not-active keeps it waiting (the call is sent again later).
    fsm2, msg2 = _restricted_write()
    assert fsm2.replied(0, refused(msg2.uuid, "not-active"), 1.1) == []
    assert fsm2.pending_writes == 1


def test_an_unrestricted_clients_confirmed_write_is_published() -> None:
    fsm, _ = synced()
    msg = KVMsg("/k", 0, new_uuid(), (), b"v")
    actions = fsm.write_confirmed(msg, 1.0, within=5.0)
    assert sent_calls(actions) == [] and fsm.pending_writes == 1
    assert fsm.counters.writes_as_calls == 0


def test_a_kept_leases_keepalives_carry_its_secret() -> None:
    fsm, _ = synced()
    ids = itertools.count(1)
    fsm.new_call_id = lambda: next(ids).to_bytes(16, "big")
    secret = "5e" * 16
    fsm.keep_lease(LEASE, 3.0, 0.0, secret)
    ((_, keepalive),) = sent_calls(fsm.tick(1.0))
    assert keepalive.op == "lease-keepalive" and keepalive.secret == secret
    with pytest.raises(ValueError):
        fsm.keep_lease(LEASE, 3.0, 0.0, "not-hex")


# --------------------------------------------------------------------------
# Batched keepalives: one lease-keepalives call for a client's leases

LEASES = [f"{n:032x}" for n in range(1, 5)]


def keeping_many(starts: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)) -> AgentFSM:
    fsm, _ = synced()
    ids = itertools.count(1)
    fsm.new_call_id = lambda: next(ids).to_bytes(16, "big")
    for lease, start in zip(LEASES, starts, strict=True):
        fsm.keep_lease(lease, 3.0, start, "5e" * 16 if lease == LEASES[0] else "")
    return fsm


def test_a_client_keeps_all_its_leases_alive_with_one_call() -> None:
    fsm = keeping_many()
    [(server, call)] = sent_calls(fsm.tick(1.0))
    assert server == 0 and call.op == OP_LEASE_KEEPALIVES and call.uuid == uid(1)
    assert parse_keepalives(call.body) == [
        (LEASES[0], "5e" * 16), *((lease, None) for lease in LEASES[1:])]
    assert fsm.counters.keepalives == 4 and fsm.counters.keepalive_batches == 1
    gone = ((LEASES[3], "unknown-lease"),)
    actions = fsm.replied(0, Reply(uid(1), "ok", kept=3, gone=gone), 1.1)
    assert actions == [*(LeaseKept(lease, 4.0) for lease in LEASES[:3]),
                       LeaseGone(LEASES[3], "unknown-lease")]
    assert fsm.kept_leases == tuple(LEASES[:3]) and fsm.pending_calls == 0


def test_leases_due_soon_join_the_call_so_they_fall_into_step() -> None:
    # Due at 1.0, 1.4, 1.9 and 2.0: the first call also takes the one due
    # within half an interval (0.5 s); at 1.9 all four are within it, and from
    # then on they travel together, one call per interval.
    fsm = keeping_many((0.0, 0.4, 0.9, 1.0))
    [(_, first)] = sent_calls(fsm.tick(1.0))
    assert [lid for lid, _ in parse_keepalives(first.body)] == LEASES[:2]
    fsm.replied(0, Reply(first.uuid, "ok", kept=2), 1.05)
    for t in (1.9, 2.9, 3.9):
        fsm.update(0, _hugz(), t)
        assert fsm.tick(t - 0.05) == []
        [(_, together)] = sent_calls(fsm.tick(t))
        assert sorted(lid for lid, _ in parse_keepalives(together.body)) == LEASES
        fsm.replied(0, Reply(together.uuid, "ok", kept=4), t + 0.05)
    assert fsm.counters.keepalive_batches == 4


def test_a_server_that_refuses_batches_gets_one_call_per_lease() -> None:
    fsm = keeping_many()
    [(_, call)] = sent_calls(fsm.tick(1.0))
    # An older server does not know the operation.
    assert fsm.replied(0, refused(call.uuid, "malformed"), 1.05) == []
    assert fsm.kept_leases == tuple(LEASES) and fsm.counters.leases_lost == 0
    singles = sent_calls(fsm.tick(1.1))
    assert sorted(c.lease for _, c in singles) == LEASES
    assert all(c.op == OP_LEASE_KEEPALIVE for _, c in singles)


def test_a_batch_is_resent_to_the_new_active_after_a_failover() -> None:
    fsm = keeping_many()
    [(_, call)] = sent_calls(fsm.tick(1.0))
    fsm.server_disconnected(0, 1.1)
    [(server, again)] = sent_calls(fsm.tick(1.1))
    assert server == 1 and again == call
    actions = fsm.replied(1, Reply(call.uuid, "ok", kept=4), 1.2)
    assert actions == [LeaseKept(lease, 4.0) for lease in LEASES]


def test_revoking_one_lease_keeps_the_batch_for_the_others() -> None:
    fsm = keeping_many()
    [(_, call)] = sent_calls(fsm.tick(1.0))
    revoke = Call(OP_LEASE_REVOKE, new_uuid(), properties=(("lease", LEASES[0]),))
    fsm.call(revoke, 1.05, within=5.0)
    assert fsm.pending_calls == 2  # the batch still keeps the three others
    actions = fsm.replied(0, Reply(call.uuid, "ok", kept=4), 1.1)
    assert actions == [LeaseKept(lease, 4.0) for lease in LEASES[1:]]


# ---------------------------------------------------------------------------
# Read your writes: a set call's reply waits for the replica


def test_a_set_calls_reply_waits_until_the_replica_applied_its_update() -> None:
    """The REPLY comes on the call socket, its KVPUB on the subscriber: told
    first, a get() right after the call returned could still miss the write."""
    fsm, [srv, _] = synced()
    call = cas("/k")
    fsm.call(call, 1.0, within=4.0)
    update = srv.apply("/k", b"v", call.uuid)
    assert fsm.replied(0, ok(call.uuid, update.sequence), 1.1) == []
    assert fsm.next_deadline() is not None and fsm.next_deadline() <= 1.1 + (5.0 - 1.1) / 2
    actions = fsm.update(0, update, 1.2)
    assert CallReplied(ok(call.uuid, update.sequence)) in actions
    assert actions.index(CallReplied(ok(call.uuid, update.sequence))) > 0  # after the change
    assert fsm.get("/k") is not None and fsm.get("/k").body == b"v"
    assert fsm.counters.replies_unseen == 0


def test_a_held_reply_is_told_anyway_when_half_the_callers_time_is_left() -> None:
    """The server wrote it: the caller hears so, not a timeout, even if the
    update never reaches this replica (a failover's new server lost it)."""
    fsm, [srv, _] = synced()
    call = cas("/k")
    fsm.call(call, 1.0, within=2.0)
    reply = ok(call.uuid, srv.seq + 1)
    assert fsm.replied(0, reply, 1.0) == []
    assert CallReplied(reply) not in fsm.tick(1.9)
    assert CallReplied(reply) in fsm.tick(2.0)  # 1.0 + (3.0 - 1.0) / 2
    assert fsm.counters.replies_unseen == 1
    assert CallReplied(reply) not in fsm.tick(2.1)  # told once


def test_a_reply_for_a_key_outside_our_subtrees_is_told_at_once() -> None:
    fsm, _ = synced(subtrees="/mine/")
    call = cas("/other/k")
    fsm.call(call, 1.0, within=4.0)
    reply = ok(call.uuid, 99)
    assert fsm.replied(0, reply, 1.1) == [CallReplied(reply)]


def test_a_resync_past_the_replys_sequence_tells_it() -> None:
    fsm, [srv, _] = synced()
    call = cas("/k")
    fsm.call(call, 1.0, within=4.0)
    srv.apply("/k", b"v", call.uuid)
    reply = ok(call.uuid, srv.seq)
    assert fsm.replied(0, reply, 1.1) == []
    fsm.update(0, srv.apply("/x", b"1"), 1.2)  # a gap: resync
    assert CallReplied(reply) in feed_snapshot(fsm, srv, 1.3)
