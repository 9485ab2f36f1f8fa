"""The winner's side of a heal: its writes win, the loser's conflicting ones are kept.

Two cores, explicit times, no sockets (as tests/server/test_split_writes.py):
A is active at term 1, B follows it, B is elected at term 2 while A still
serves, both take writes, A steps down and resyncs from B, and B judges what
A forwards (docs/failover.md, "Writes of a split brain").
"""

from __future__ import annotations

from clone.server.core import FollowOutcome, ServerCore
from clone.wire.calls import OP_LEASE_GRANT, OP_SET, Call, decode_call, encode_call
from clone.wire.split import GONE, SplitOrigin, parse_split_origin, split_properties
from tests.support.published import kvset, release
from tests.support.split_cores import resync


def _uuid(n: int) -> bytes:
    # A UUIDv7 layout (version nibble 7) whose time is n seconds after the epoch.
    return (n * 1000).to_bytes(6, "big") + bytes([0x70, 0, 0x80]) + n.to_bytes(7, "big")


def _kvset(key: str, n: int, body: bytes = b"v") -> list[bytes]:
    return [key.encode(), bytes(8), _uuid(n), b"", body]


def _value(core: ServerCore, key: str) -> bytes | None:
    entry = core.store.entry(key.encode())
    return None if entry is None else entry[3]


def _pair() -> tuple[ServerCore, ServerCore]:
    """A active at term 1 with /k/1../k/3 replicated to B; B elected at term 2."""
    a, b = ServerCore(), ServerCore()
    a.term = 1
    a.become_active(0.0)
    b.become_passive()
    assert resync(b, a, 0.0) is FollowOutcome.SYNCED
    b.term = 1
    for n in (1, 2, 3):
        pub = kvset(a, _kvset(f"/k/{n}", n, b"before"), 1.0)
        assert pub is not None
        b.on_peer_update(pub, 1.0)
    b.term = 2
    b.become_active(3.0)
    return a, b


def _heal(a: ServerCore, b: ServerCore, now: float = 10.0) -> list[Call]:
    a.become_passive()
    a.term = 2
    assert resync(a, b, now) is FollowOutcome.SYNCED
    return [decode_call(f) for f in a.split_calls]


def _forward(a: ServerCore, b: ServerCore, now: float = 11.0) -> list[str]:
    """B answers every forwarded call: the statuses, in order."""
    out = []
    for frames in a.split_calls:
        reply, _ = b.on_call(frames, now, peer=True)
        assert reply is not None
        out.append(reply.status if reply.ok else f"{reply.status}:{reply.reason}")
    return out


def test_a_key_the_winner_changed_after_the_fork_keeps_the_winners_value() -> None:
    a, b = _pair()
    b.on_kvset(_kvset("/k/1", 20, b"winner"), 4.0)  # confirmed on B during the split
    a.on_kvset(_kvset("/k/1", 21, b"loser"), 5.0)  # and on A, later by the clock
    a.on_kvset(_kvset("/k/2", 22, b"only A"), 5.0)  # a key only A touched
    _heal(a, b)
    assert _forward(a, b) == ["conflict:split", "ok"]
    assert _value(b, "/k/1") == b"winner"
    assert _value(b, "/k/2") == b"only A"
    (rec,) = b.conflicts.records()
    assert (rec.key, rec.reason, rec.loser_body, rec.winner_body) == (
        b"/k/1",
        "winner-wrote",
        b"loser",
        b"winner",
    )
    assert (rec.loser_uuid, rec.winner_uuid, rec.loser_term) == (_uuid(21), _uuid(20), 1)
    assert (rec.loser_at, rec.winner_at, rec.resolution) == (21.0, 20.0, None)
    assert b.counters["split_conflicts"] == 1 and b.conflicts.unresolved == 1


def test_a_resent_conflict_gets_the_same_answer_and_one_record() -> None:
    a, b = _pair()
    b.on_kvset(_kvset("/k/1", 20, b"winner"), 4.0)
    a.on_kvset(_kvset("/k/1", 21, b"loser"), 5.0)
    _heal(a, b)
    first = b.on_call(a.split_calls[0], 11.0, peer=True)[0]
    again = b.on_call(a.split_calls[0], 12.0, peer=True)[0]
    assert first == again and first is not None and first.detail.startswith("conflict 1:")
    assert len(b.conflicts) == 1


def test_a_late_direct_copy_of_a_conflict_is_not_applied() -> None:
    a, b = _pair()
    b.on_kvset(_kvset("/k/1", 20, b"winner"), 4.0)
    a.on_kvset(_kvset("/k/1", 21, b"loser"), 5.0)
    _heal(a, b)
    _forward(a, b)
    # The island client's own copy, stuck in TCP during the cut, arrives now.
    assert kvset(b, _kvset("/k/1", 21, b"loser"), 13.0) is None
    assert _value(b, "/k/1") == b"winner"


def test_the_losers_later_writes_of_a_key_follow_its_earlier_ones() -> None:
    a, b = _pair()
    for n, body in ((21, b"one"), (22, b"two"), (23, b"")):
        a.on_kvset(_kvset("/k/1", n, body), 5.0)
    a.on_kvset(_kvset("/k/1", 24, b"three"), 5.0)
    calls = _heal(a, b)
    prevs = [parse_split_origin(c.properties) for c in calls]
    assert [p.prev if p else "?" for p in prevs] == [None, _uuid(21), _uuid(22), GONE]
    assert _forward(a, b) == ["ok", "ok", "ok", "ok"]
    assert _value(b, "/k/1") == b"three"


def test_a_chain_broken_by_the_winner_stays_broken() -> None:
    a, b = _pair()
    b.on_kvset(_kvset("/k/1", 20, b"winner"), 4.0)
    a.on_kvset(_kvset("/k/1", 21, b"one"), 5.0)
    a.on_kvset(_kvset("/k/1", 22, b"two"), 5.0)
    _heal(a, b)
    assert _forward(a, b) == ["conflict:split", "conflict:split"]
    assert _value(b, "/k/1") == b"winner"


def test_a_write_both_sides_applied_is_continued() -> None:
    a, b = _pair()
    both = _kvset("/k/1", 20, b"both")
    a.on_kvset(both, 4.0)
    b.on_kvset(both, 4.0)  # a client that reached both
    a.on_kvset(_kvset("/k/1", 21, b"after, on A"), 5.0)
    _heal(a, b)
    assert _forward(a, b) == ["ok", "ok"]  # the first is B's own already
    assert _value(b, "/k/1") == b"after, on A"


def _cas(
    key: str,
    n: int,
    body: bytes,
    if_sequence: int,
    lease: str | None = None,
    secret: str | None = None,
) -> list[bytes]:
    props: list[tuple[str, str]] = [("if_sequence", str(if_sequence))]
    if lease is not None:
        props.append(("lease", lease))
    if secret is not None:
        props.append(("secret", secret))  # the lease's owner (a bound write needs it)
    return encode_call(OP_SET, _uuid(n), key, tuple(props), body)


def test_a_compare_and_set_holds_only_against_an_unchanged_key() -> None:
    a, b = _pair()
    # A and B each take /lock with if_sequence=0 (absent) during the split.
    reply_b = b.on_call(_cas("/lock", 30, b"holder on B", 0), 4.0)[0]
    reply_a = a.on_call(_cas("/lock", 31, b"holder on A", 0), 5.0)[0]
    assert reply_a is not None and reply_a.ok and reply_b is not None and reply_b.ok
    # A CAS on a key B never touched: it held on A, and holds on B.
    seq2 = a.store.entry(b"/k/2")
    assert seq2 is not None
    assert a.on_call(_cas("/k/2", 32, b"cas on A", int.from_bytes(seq2[0], "big")), 5.0)[0]
    calls = _heal(a, b)
    assert [parse_split_origin(c.properties).condition for c in calls] == [0, 2]  # type: ignore[union-attr]
    assert all(c.if_sequence is None for c in calls)  # never judged by B's sequences
    assert _forward(a, b) == ["conflict:split", "ok"]
    assert _value(b, "/lock") == b"holder on B"
    assert _value(b, "/k/2") == b"cas on A"
    assert b.conflicts.records()[0].reason == "condition"


def test_a_write_bound_to_the_losers_lease_is_a_conflict() -> None:
    a, b = _pair()
    grant = encode_call(OP_LEASE_GRANT, _uuid(40), "/lock", (("ttl", "5"),))
    reply = a.on_call(grant, 4.0)[0]
    assert reply is not None and reply.ok
    bound = a.on_call(_cas("/lock", 41, b"me", 0, lease=reply.lease, secret=reply.secret), 4.0)[0]
    assert bound is not None and bound.ok, bound
    _heal(a, b)
    assert _forward(a, b) == ["conflict:split"]
    assert b.store.entry(b"/lock") is None
    assert b.conflicts.records()[0].reason == "lease-gone"


def test_only_the_peer_may_send_split_properties() -> None:
    b = ServerCore(standalone=True)
    origin = SplitOrigin(term=1, fork=0, at=1.0)
    frames = encode_call(OP_SET, _uuid(50), "/x", split_properties(origin), b"v")
    reply = b.on_call(frames, 1.0)[0]  # peer=False: a client, under CURVE
    assert reply is not None and reply.reason == "acl" and b.store.entry(b"/x") is None
    assert b.counters["split_calls_refused_not_peer"] == 1


def test_an_operator_applies_or_discards_a_conflict() -> None:
    a, b = _pair()
    b.on_kvset(_kvset("/k/1", 20, b"winner"), 4.0)
    b.on_kvset(_kvset("/k/2", 21, b"winner"), 4.0)
    a.on_kvset(_kvset("/k/1", 22, b"loser 1"), 5.0)
    a.on_kvset(_kvset("/k/2", 23, b"loser 2"), 5.0)
    _heal(a, b)
    assert _forward(a, b) == ["conflict:split", "conflict:split"]
    one, two = b.conflicts.records()
    seq = b.store.sequence
    assert b.resolve_conflict(one.id, "apply", 20.0).resolution == "applied"
    assert _value(b, "/k/1") == b"loser 1" and b.store.sequence == seq + 1
    assert b.resolve_conflict(two.id, "discard", 20.0).resolution == "discarded"
    assert _value(b, "/k/2") == b"winner"
    assert b.conflicts.unresolved == 0
    for cid in (one.id, two.id, 99):
        try:
            b.resolve_conflict(cid, "apply", 21.0)
        except ValueError:
            continue
        raise AssertionError(f"conflict {cid} resolved twice")


def test_the_winner_holds_late_direct_copies_until_the_forwarded_writes_are_judged() -> None:
    a, b = _pair()
    b.on_kvset(_kvset("/k/1", 20, b"winner"), 4.0)
    island = [_kvset("/k/1", 21, b"island"), _kvset("/k/9", 22, b"island only")]
    for frames in island:
        a.on_kvset(frames, 5.0)
    b.hold_writes()  # the split brain is detected: b keeps serving
    # The island client's own copies, stuck in TCP through the cut, arrive first,
    # and a winner-side client's write comes while b holds.
    assert all(kvset(b, frames, 10.5) is None for frames in island)
    assert kvset(b, _kvset("/k/2", 23, b"winner, later"), 10.6) is None
    assert b.counters["kvset_held"] == 3 and _value(b, "/k/9") is None
    _heal(a, b)
    assert _forward(a, b) == ["conflict:split", "ok"]
    released = release(b, 12.0)
    # The island's copies were judged through the forwarded calls; only the
    # winner-side write is applied now, after them.
    assert [frames[0] for frames in released] == [b"/k/2"]
    assert _value(b, "/k/1") == b"winner"
    assert _value(b, "/k/9") == b"island only"
    assert not b.holding and release(b, 13.0) == []
