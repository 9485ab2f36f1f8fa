"""A split brain's writes: the server that steps down forwards, as calls with
their original uuids, the client writes it confirmed that the winner cannot hold.

Two cores, explicit times, no sockets: the active's KVPUBs are fed to the
passive, a snapshot of the winner answers the loser's resync (docs/failover.md,
"Writes of a split brain").
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from clone.errors import ProtocolError
from clone.server.core import FollowOutcome, ServerCore
from clone.server.ownership import PEER_PRINCIPAL
from clone.server.split import split_writes
from clone.wire.applied import decode_kvapplied, encode_kvapplied
from clone.wire.calls import OP_LEASE_GRANT, decode_call, encode_call
from clone.wire.split import parse_split_origin
from tests.support.published import kvset, tick
from tests.support.split_cores import resync


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def _kvset(key: str, n: int, body: bytes = b"v", props: str = "") -> list[bytes]:
    return [key.encode(), bytes(8), _uuid(n), props.encode(), body]


def _value(core: ServerCore, key: str) -> bytes | None:
    entry = core.store.entry(key.encode())
    return None if entry is None else entry[3]


def _split(*, fork_known: bool = True) -> tuple[ServerCore, ServerCore, list[bytes]]:
    """A (primary) active at term 1 and B following it; B is elected at term 2
    while A still serves; both take writes; A steps down and resyncs from B.
    Returns (A, B, the uuids of the island client's writes that B also got)."""
    a, b = ServerCore(), ServerCore()
    a.term = 1
    a.become_active(0.0)
    b.become_passive()
    assert resync(b, a, 0.0) is FollowOutcome.SYNCED
    b.term = 1
    for n in (1, 2, 3):  # replicated before the split
        pub = kvset(a, _kvset(f"/k/{n}", n, b"before"), 1.0)
        assert pub is not None
        b.on_peer_update(pub, 1.0)
    a.on_kvset(_kvset("/k/4", 4, b"lost in flight"), 2.0)  # published as the link broke
    # The split: B is elected (it followed up to 3) and both serve.
    b.term = 2
    b.become_active(3.0)
    if not fork_known:
        b.promoted_at = None  # as a peer that does not send fork= would
    b.on_kvset(_kvset("/k/1", 10, b"written on B"), 4.0)
    a.on_kvset(_kvset("/k/2", 11, b"written on A"), 4.0)
    a.on_kvset(_kvset("/ttl/long", 12, b"t", "ttl=100\n"), 4.0)
    a.on_kvset(_kvset("/ttl/short", 13, b"t", "ttl=1\n"), 4.0)
    both = _kvset("/k/both", 14, b"sent to both")
    a.on_kvset(both, 4.0)
    b.on_kvset(both, 4.0)  # the island client's copy reached B too
    grant = encode_call(OP_LEASE_GRANT, _uuid(15), "", (("ttl", "5"),))
    assert a.on_call(grant, 4.0)[0] is not None  # a lease key: server-made
    assert tick(a, 5.5)  # /ttl/short expires on A: a delete without uuid
    a.on_kvset(_kvset("/k/3", 16, b""), 6.0)  # a client's delete
    # The heal: A (lower epoch) steps down and resyncs from B.
    a.become_passive()
    a.term = 2
    assert resync(a, b, 10.0) is FollowOutcome.SYNCED
    return a, b, [_uuid(14)]


def test_the_loser_keeps_as_calls_exactly_the_client_writes_the_winner_lacks() -> None:
    a, _winner, _ = _split()
    calls = [decode_call(frames) for frames in a.split_calls]
    assert [(c.key, c.body) for c in calls] == [
        ("/k/4", b"lost in flight"),
        ("/k/2", b"written on A"),
        ("/ttl/long", b"t"),
        ("/k/both", b"sent to both"),
        ("/k/3", b""),
    ]
    assert [c.uuid for c in calls] == [_uuid(n) for n in (4, 11, 12, 14, 16)]
    # What is left of the ttl (100 s written at 4.0, now 10.0), never expires=,
    # then what the winner's rule needs (clone.wire.split): A's term, B's fork.
    assert calls[2].properties[0] == ("ttl", "94.000")
    origin = parse_split_origin(calls[2].properties)
    assert origin is not None and (origin.term, origin.fork) == (1, 3)
    assert origin.prev is None and origin.condition is None
    assert a.counters["split_writes_found"] == 5
    assert a.counters["split_writes_expired"] == 1  # /ttl/short
    # The loser's state is now the winner's: nothing of A's split survives there.
    assert _value(a, "/k/2") == b"before" and _value(a, "/k/1") == b"written on B"


def test_the_winner_applies_each_forwarded_write_once() -> None:
    a, b, both = _split()
    before = b.store.sequence
    replies = [b.on_call(frames, 11.0, peer=True)[0] for frames in a.split_calls]
    assert all(r is not None and r.ok for r in replies)
    # Four new updates; the write B already had is answered, not applied again.
    assert b.store.sequence == before + 4
    assert b.counters["calls_duplicate"] == 1
    assert _value(b, "/k/4") == b"lost in flight"
    assert _value(b, "/k/2") == b"written on A"
    assert _value(b, "/k/1") == b"written on B"  # B's own split write stays
    assert _value(b, "/k/3") is None
    assert b.store.entry(b"/ttl/long") is not None and b.store.entry(b"/ttl/short") is None
    # Sent again (a retry after a lost reply): nothing more is applied.
    again = [b.on_call(frames, 12.0, peer=True)[0] for frames in a.split_calls]
    assert all(r is not None and r.ok for r in again)
    assert b.store.sequence == before + 4
    assert b.counters["calls_duplicate"] == 1 + len(a.split_calls)
    assert both == [_uuid(14)]


def test_without_a_fork_nothing_is_resent_and_it_is_counted() -> None:
    a, _, _ = _split(fork_known=False)
    assert a.split_calls == []
    # Everything A wrote in its term: 3 before the split, 1 in flight, 7 after.
    assert a.split_unverified == a.counters["split_writes_unverified"] == 11


def test_a_server_that_was_never_active_forwards_nothing() -> None:
    a, b, _ = _split()
    assert b.split_calls == [] and b.counters["split_writes_found"] == 0
    # And a later, ordinary resync of the same loser finds nothing more.
    a.split_calls.clear()
    assert resync(a, b, 20.0) is FollowOutcome.SYNCED
    assert a.split_calls == []


def test_the_fork_is_said_only_by_an_active_server() -> None:
    a, b, _ = _split()

    def forks(core: ServerCore) -> set[int | None]:
        stream = core.open_snapshot(b"peer", "", applied=True, now=0.0)
        frames = stream.peek()
        assert frames is not None
        return {decode_kvapplied(list(frames[1:])).fork}

    assert forks(b) == {3}  # elected having applied 3
    assert forks(a) == {None}  # passive now


@pytest.mark.parametrize("fork", [None, 0, 7, 2**63])
def test_kvapplied_fork_round_trip(fork: int | None) -> None:
    (frames,) = encode_kvapplied(9, [_uuid(1)], 1.5, fork)
    applied = decode_kvapplied(frames)
    got = (applied.sequence, applied.span, applied.ids, applied.fork)
    assert got == (9, 1.5, (_uuid(1),), fork)


@pytest.mark.parametrize("props", [b"span_ms=1\nfork=x\n", b"span_ms=1\nfork=1\nfork=2\n"])
def test_a_bad_fork_is_a_protocol_error(props: bytes) -> None:
    with pytest.raises(ProtocolError, match="fork"):
        decode_kvapplied([b"KVAPPLIED", bytes(8), props, b""])


def test_split_writes_skips_what_the_winner_makes_itself() -> None:
    def pub(seq: int, key: bytes, uuid: bytes, props: bytes = b"") -> Sequence[bytes]:
        return [key, seq.to_bytes(8, "big"), uuid, props, b"v"]

    written = [
        pub(3, b"/a", _uuid(1)),  # at the fork: shared
        pub(4, b"/b", b""),  # server-made delete
        pub(5, b"/_clone/lease/" + b"0" * 32, _uuid(2)),  # our lease
        pub(6, b"/c", _uuid(3), b"lease=" + b"1" * 32 + b"\n"),
    ]
    out = split_writes(written, 3, 0.0)
    assert (out.shared, out.server_made, out.expired) == (1, 2, 0)
    (call,) = (decode_call(frames) for frames in out.calls)
    assert call.key == "/c" and call.lease == "1" * 32  # the winner judges the lease
    winner = ServerCore(standalone=True)
    reply = winner.on_call(out.calls[0], 0.0, peer=True)[0]
    # The lease ended with the loser's term: a conflict, kept, not applied.
    assert reply is not None and reply.status == "conflict" and reply.reason == "split"
    (kept,) = winner.conflicts.records()
    assert (kept.key, kept.reason, kept.loser_uuid) == (b"/c", "lease-gone", _uuid(3))
    assert winner.store.entry(b"/c") is None


@pytest.mark.parametrize("caller", ["", PEER_PRINCIPAL])
def test_a_split_write_bound_to_a_lease_the_winner_holds_needs_its_owner(caller: str) -> None:
    """A plain pair's peer cannot prove it may use a lease (only a hash of its
    secret travels): the write is kept as a conflict, never dropped; the pair's
    own certificate (CURVE) may use any lease, so there it is applied."""
    winner = ServerCore(standalone=True)
    grant = encode_call(OP_LEASE_GRANT, _uuid(40), "", (("ttl", "30"),))
    granted = winner.on_call(grant, 0.0)[0]
    assert granted is not None and granted.ok and granted.lease
    lease = granted.lease.encode()
    written = [[b"/c", (9).to_bytes(8, "big"), _uuid(3), b"lease=" + lease + b"\n", b"v"]]
    out = split_writes(written, winner.store.sequence, 0.0)  # forked after the grant
    reply = winner.on_call(out.calls[0], 1.0, peer=True, caller=caller)[0]
    assert reply is not None
    if caller == PEER_PRINCIPAL:
        assert reply.ok and winner.store.entry(b"/c") is not None
        assert not winner.conflicts.records()
    else:
        assert reply.status == "conflict" and reply.reason == "split"
        (kept,) = winner.conflicts.records()
        assert (kept.key, kept.reason, kept.loser_uuid) == (b"/c", "lease-owner", _uuid(3))
        assert winner.store.entry(b"/c") is None


def test_the_loser_drops_the_client_updates_that_reached_it_after_it_stepped_down() -> None:
    """Its clients still follow it for a moment: a copy the winner also got
    is confirmed by the winner's KVPUB; one that reached only the loser is
    dropped (counted), never applied at a later promotion over the winner's
    writes (the drill's island client, whose link to the winner was reset)."""
    a, b, _ = _split()  # A stepped down at 10.0 and resynced from B
    for frames in (_kvset("/k/1", 30, b"island, late"), _kvset("/k/both2", 31, b"to both")):
        assert kvset(a, frames, 10.5) is None  # parked: a passive publishes nothing
    pub = kvset(b, _kvset("/k/both2", 31, b"to both"), 10.6)
    assert pub is not None
    a.on_peer_update(pub, 10.7)  # the winner's KVPUB confirms that copy
    assert len(a.pending) == 1
    assert a.drop_pending_since(10.0) == 1
    assert len(a.pending) == 0 and a.counters["pending_stepped_down"] == 1
    a.become_active(20.0)  # elected again later: nothing of the island's comes back
    assert _value(a, "/k/1") == b"written on B"


def test_updates_parked_before_the_step_down_are_not_the_losers_to_drop() -> None:
    core = ServerCore()
    core.become_passive()
    core.on_kvset(_kvset("/k/early", 40), 5.0)
    core.on_kvset(_kvset("/k/late", 41), 12.0)
    assert core.drop_pending_since(10.0) == 1
    assert [p.msg.key for p in core.pending.drain()] == ["/k/early"]


def test_a_promotion_that_jumped_past_the_fork_still_applies_a_loser_write_to_a_new_key() -> None:
    """The winner's promotion carries on from the highest sequence it has
    seen anywhere, so its own updates start past its fork and its history
    does not reach back to the fork.  A key it never wrote is unchanged
    since the fork all the same: the loser's write to it is applied, not
    kept as a conflict (a chaos run: confirmed writes to keys only their
    writer used ended as conflicts, missing from the final state)."""
    winner = ServerCore()
    winner.become_passive()
    winner.highest_seen = 50  # heard from the peer, never applied here
    winner.become_active(0.0)
    fork = winner.promoted_at
    assert fork == 0 and winner.store.sequence == 50
    assert kvset(winner, _kvset("/winner/own", 1, b"w"), 1.0) is not None  # sequence 51
    assert not winner.history.covers(fork)
    written = [[b"/loser/new", (7).to_bytes(8, "big"), _uuid(2), b"", b"from the loser"]]
    out = split_writes(written, fork, 2.0)
    reply = winner.on_call(out.calls[0], 2.0, peer=True, caller=PEER_PRINCIPAL)[0]
    assert reply is not None and reply.ok, reply
    assert _value(winner, "/loser/new") == b"from the loser"
    assert not winner.conflicts.records()
    # A key the winner did write after the fork is still the winner's.
    written = [[b"/winner/own", (8).to_bytes(8, "big"), _uuid(3), b"", b"older"]]
    reply = winner.on_call(split_writes(written, fork, 3.0).calls[0], 3.0, peer=True,
                           caller=PEER_PRINCIPAL)[0]  # fmt: skip
    assert reply is not None and reply.status == "conflict"
    assert _value(winner, "/winner/own") == b"w"
