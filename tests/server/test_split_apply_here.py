"""The loser of a split brain elected again before the winner answered its
forwarded writes: it applies them itself (docs/failover.md, "Writes of a split
brain"), once each, and not those the state it now holds already has.

Two cores, explicit times, no sockets (the split of tests/server/test_split_writes.py).
"""

from __future__ import annotations

from clone.server.core import ServerCore
from clone.wire.calls import decode_call
from tests.server.test_split_writes import _split, _uuid, _value
from tests.support.published import kvset


def _elected_again(a: ServerCore) -> None:
    """The winner is gone; the loser is voted active at a later term."""
    a.term = 3
    a.become_active(20.0)


def test_the_loser_elected_again_applies_its_unanswered_split_writes() -> None:
    a, _winner, _ = _split()
    calls = list(a.split_calls)
    _elected_again(a)
    replies = [a.apply_own_split_call(frames, 20.0) for frames in calls]
    # Its own uuid window knew every one of them (it applied them during the
    # split): through on_call they would all have been "duplicates", and lost.
    assert _value(a, "/k/2") == b"written on A"
    assert _value(a, "/k/3") is None
    # Two keys are absent from the state it took by a full snapshot, whose
    # history does not reach back to the winner's fork: it cannot tell that
    # the winner did not delete them since, so (clone.server.splitrule) they
    # are kept as conflicts, not applied over a possible delete, nor lost.
    applied = {decode_call(f).key for r, f in zip(replies, calls, strict=True) if r and r.ok}
    assert applied == {"/k/2", "/k/3", "/k/both"}
    kept = {(r.key, r.reason) for r in a.conflicts.records()}
    assert kept == {(b"/k/4", "winner-wrote"), (b"/ttl/long", "winner-wrote")}
    # /k/both was applied by the winner (its KVAPPLIED said so): not again.
    assert a.counters["split_writes_held"] == 1
    assert _value(a, "/k/both") == b"sent to both"
    both = next(r for r, f in zip(replies, calls, strict=True) if decode_call(f).key == "/k/both")
    assert both is not None and both.ok


def test_a_write_the_loser_followed_from_the_winner_since_is_not_applied_again() -> None:
    a, b, _ = _split()
    calls = list(a.split_calls)
    k4 = next(f for f in calls if decode_call(f).key == "/k/4")
    # The winner answered /k/4 (the reply was lost), then wrote the key again;
    # the loser followed both updates.
    reply, _ = b.on_call(k4, 11.0, peer=True)
    assert reply is not None and reply.ok
    first = b.history.since(b.store.sequence - 1)[0]
    newer = kvset(b, [b"/k/4", bytes(8), _uuid(99), b"", b"newer"], 12.0)
    assert newer is not None
    a.on_peer_update(first, 11.0)
    a.on_peer_update(newer, 12.0)
    _elected_again(a)
    again = a.apply_own_split_call(k4, 20.0)
    assert again is not None and again.ok
    assert _value(a, "/k/4") == b"newer"  # not reverted to our older value
    assert a.counters["split_writes_held"] == 1
