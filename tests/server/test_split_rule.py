"""The heal's rule (clone.server.splitrule) over generated split-brain histories.

Hypothesis draws what happens during a split: writes only the winner takes,
writes only the loser takes (plain, compare-and-set against the loser's
state, bound to the loser's lease), writes a client sends to both, deletes;
on a few keys so that the sides collide.  Two cores play it (no sockets,
explicit times), the loser steps down and forwards, the winner judges, and
the properties of docs/failover.md, "Writes of a split brain", must hold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from clone.server.core import FollowOutcome, ServerCore
from clone.server.splitrule import Verdict, judge_split_write
from clone.wire.calls import OP_LEASE_GRANT, OP_SET, decode_call, encode_call
from clone.wire.split import GONE, SplitOrigin
from tests.support.published import kvset
from tests.support.split_cores import resync

KEYS = ("/k/a", "/k/b", "/k/c", "/k/d")


@dataclass(frozen=True)
class Op:
    side: str  # "winner", "loser", "both"
    kind: str  # "set", "delete", "cas", "leased"
    key: str


ops_strategy = st.lists(
    st.builds(
        Op,
        st.sampled_from(("winner", "loser", "loser", "both")),
        st.sampled_from(("set", "set", "delete", "cas", "leased")),
        st.sampled_from(KEYS),
    ),
    max_size=25,
)


def _resync(loser: ServerCore, winner: ServerCore, now: float) -> None:
    assert resync(loser, winner, now) is FollowOutcome.SYNCED


def _held(core: ServerCore, key: str) -> bytes | None:
    """The uuid of the update a key holds (None: absent)."""
    entry = core.store.entry(key.encode())
    return None if entry is None else bytes(entry[1])


@settings(max_examples=300, deadline=None)
@given(ops=ops_strategy, preset=st.sets(st.sampled_from(KEYS)))
def test_the_heal_never_undoes_the_winner_and_keeps_every_loser_write(
    ops: list[Op], preset: set[str]
) -> None:
    uuids = (n.to_bytes(16, "big") for n in itertools.count(1))
    a, b = ServerCore(), ServerCore()  # a: the loser, b: the winner
    a.term = 1
    a.become_active(0.0)
    b.become_passive()
    _resync(b, a, 0.0)
    b.term = 1
    for key in sorted(preset):
        pub = kvset(a, [key.encode(), bytes(8), next(uuids), b"", b"fork"], 1.0)
        assert pub is not None
        b.on_peer_update(pub, 1.0)
    b.term = 2
    b.become_active(2.0)
    grant = a.on_call(encode_call(OP_LEASE_GRANT, next(uuids), "", (("ttl", "60"),)), 2.0)[0]
    assert grant is not None and grant.ok
    loser_writes: dict[bytes, tuple[str, bytes | None]] = {}  # uuid -> (key, held before)
    winner_own: set[bytes] = set()  # updates only the winner applied
    winner_both: set[bytes] = set()  # updates both applied
    for op in ops:
        uid = next(uuids)
        raw = [op.key.encode(), bytes(8), uid, b"", b"" if op.kind == "delete" else b"v"]
        sides = {"winner": (b,), "loser": (a,), "both": (a, b)}[op.side]
        for core in sides:
            before = _held(core, op.key)
            if op.kind in ("cas", "leased") and core is a and op.side == "loser":
                entry = a.store.entry(op.key.encode())
                props: list[tuple[str, str]] = [
                    ("if_sequence", "0" if entry is None else str(int.from_bytes(entry[0], "big")))
                ]
                if op.kind == "leased":
                    # The lease's owner proves it with the grant's secret.
                    props += [("lease", grant.lease), ("secret", grant.secret)]
                reply = a.on_call(encode_call(OP_SET, uid, op.key, tuple(props), b"v"), 3.0)[0]
                assert reply is not None and reply.ok
            elif kvset(core, raw, 3.0) is None:
                continue  # a delete of an absent key is still an update; nothing else skips
            if core is a:
                loser_writes[uid] = (op.key, before)
        if op.side == "winner":
            winner_own.add(uid)
        elif op.side == "both":
            winner_both.add(uid)
    at_heal = {key: _held(b, key) for key in KEYS}
    loser_at_heal = {key: _held(a, key) for key in KEYS}
    a.become_passive()
    a.term = 2
    _resync(a, b, 10.0)
    calls = [decode_call(f) for f in a.split_calls]
    assert {c.uuid for c in calls} == set(loser_writes)  # every loser write is forwarded
    applied: list[bytes] = []
    for frames, call in zip(a.split_calls, calls, strict=True):
        before, seq = _held(b, call.key), b.store.sequence
        reply = b.on_call(frames, 11.0, peer=True)[0]
        assert reply is not None
        if reply.ok:
            applied.append(call.uuid)
            if b.store.sequence == seq:
                assert call.uuid in winner_both  # the winner had it: answered, not applied
                continue
            key, loser_before = loser_writes[call.uuid]
            # Applied only over the loser's own view of the key, or over the
            # fork's value the winner never changed (a plain write).
            if call.prop("split_if") is not None:
                assert before == loser_before
            assert before not in winner_own
        else:
            assert (reply.status, reply.reason) == ("conflict", "split")
            assert b.conflicts.of_uuid(call.uuid) is not None
            assert call.lease is None or b.conflicts.of_uuid(call.uuid).reason == "lease-gone"  # type: ignore[union-attr]
    # Nothing dropped silently: applied or kept, never both.
    assert len(applied) + len(b.conflicts) == len(calls)
    for key in KEYS:
        # A value the winner confirmed during the split is never taken back.
        if at_heal[key] in winner_own:
            assert _held(b, key) == at_heal[key]
        touched_by_winner = any(o.key == key and o.side != "loser" for o in ops)
        leased = any(o.key == key and o.kind == "leased" and o.side == "loser" for o in ops)
        # A key only the loser wrote ends as the loser left it.
        if not touched_by_winner and not leased:
            assert _held(b, key) == loser_at_heal[key]


# The rule itself, as a table: (prev, condition, changed, current) -> verdict.
_U1, _U2 = b"\x01" * 16, b"\x02" * 16


def _origin(prev: bytes | None = None, condition: int | None = None) -> SplitOrigin:
    return SplitOrigin(term=1, fork=5, at=0.0, prev=prev, condition=condition)


def test_the_rule_table() -> None:
    cases = [
        # first loser write of a key: applied only if the winner left it alone
        (_origin(), False, _U1, Verdict.APPLY),
        (_origin(), True, _U1, Verdict.WINNER_WROTE),
        (_origin(condition=0), False, None, Verdict.APPLY),
        (_origin(condition=0), True, _U2, Verdict.CONDITION),
        # a later one: over the loser's previous write, wherever it came from
        (_origin(prev=_U1), True, _U1, Verdict.APPLY),
        (_origin(prev=_U1), True, _U2, Verdict.WINNER_WROTE),
        (_origin(prev=_U1, condition=3), True, _U1, Verdict.APPLY),
        (_origin(prev=_U1, condition=3), False, _U2, Verdict.CONDITION),
        # its previous write never reached the winner: a plain one still may go
        (_origin(prev=_U1), False, _U2, Verdict.APPLY),
        (_origin(prev=GONE), True, None, Verdict.APPLY),
        (_origin(prev=GONE), True, _U2, Verdict.WINNER_WROTE),
    ]
    for origin, changed, current, verdict in cases:
        got = judge_split_write(
            origin, lease=None, lease_alive=False, changed_since_fork=changed, current_uuid=current
        )
        assert got is verdict, (origin, changed, current)
    leased = judge_split_write(
        _origin(), lease="a" * 32, lease_alive=False, changed_since_fork=False, current_uuid=None
    )
    assert leased is Verdict.LEASE_GONE
