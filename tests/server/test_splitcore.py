"""The split-brain heal driven alone: SplitCore with its state objects, a
loser's and a winner's, explicit times, no ServerCore and no sockets
(docs/failover.md, "Writes of a split brain")."""

from __future__ import annotations

from collections import defaultdict

import pytest

from clone.server.callcore import CallCore
from clone.server.conflicts import ConflictBook
from clone.server.history import History
from clone.server.leases import LeaseTable
from clone.server.pending import PendingList, UuidWindow
from clone.server.splitcore import SplitCore
from clone.server.store import Store
from clone.wire.calls import Reply, decode_call
from clone.wire.codec import KVMsg
from clone.wire.split import parse_split_origin

#: The sequence both sides held when the winner was elected.
FORK = 2


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Side:
    """One server's SplitCore with what it touches, and every update it recorded."""

    def __init__(self) -> None:
        self.store = Store()
        self.history = History(1000, 1 << 20)
        self.window = UuidWindow(1000)
        self.pending = PendingList(100, 30.0)
        self.leases = LeaseTable(10)
        self.counters: defaultdict[str, int] = defaultdict(int)
        self.recorded: list[list[bytes]] = []
        self.term = 0
        #: What the peer's KVAPPLIED said in this sync (None: no fork= in it).
        self.fork: int | None = None
        self.calls = CallCore(
            store=self.store,
            leases=self.leases,
            window=self.window,
            history=self.history,
            counters=self.counters,
            record=self._record,
            max_leases_per_client=10,
            conditions_max=100,
        )
        self.split = SplitCore(
            store=self.store,
            history=self.history,
            window=self.window,
            pending=self.pending,
            leases=self.leases,
            calls=self.calls,
            conflicts=ConflictBook(),
            counters=self.counters,
            record=self._record,
            peer_fork=lambda: self.fork,
        )

    def _record(self, frames: list[bytes]) -> None:
        self.recorded.append(frames)
        self.history.append(frames, self.term)

    def write(self, key: str, n: int, body: bytes, now: float) -> None:
        """A client's write applied as active, as the core records it."""
        self._record(self.store.apply(KVMsg(key, 0, _uuid(n), (), body), now, wall=now))
        self.window.add(_uuid(n), now)

    def value(self, key: str) -> bytes | None:
        entry = self.store.entry(key.encode())
        return None if entry is None else bytes(entry[3])


def _split() -> tuple[Side, Side]:
    """Both share sequences 1-2; the winner is elected at the fork (term 2) and
    rewrites /k/changed; the loser, still active in term 1, writes three keys."""
    loser, winner = Side(), Side()
    for side in (loser, winner):
        side.write("/k/same", 1, b"base", 1.0)
        side.write("/k/changed", 2, b"base", 1.0)
    winner.term = 2
    winner.write("/k/changed", 20, b"winner", 4.0)
    loser.term = 1
    loser.write("/k/same", 10, b"loser", 4.0)
    loser.write("/k/changed", 11, b"loser", 4.0)
    loser.write("/k/new", 12, b"loser", 4.0)
    loser.split.demoted(1)
    return loser, winner


def _kept(loser: Side) -> list[list[bytes]]:
    """The loser synced with the winner, whose KVAPPLIED named the fork."""
    loser.term = 2
    loser.fork = FORK
    loser.split.synced(10.0, None)
    return loser.split.all_calls


def test_the_loser_keeps_its_writes_after_the_fork_and_takes_them_in_slices() -> None:
    loser, _ = _split()
    loser.fork = FORK
    loser.split.synced(10.0, None)
    assert loser.split.left == 3
    first = loser.split.take_calls(2)
    assert len(first) == 2 and loser.split.left == 1
    rest = loser.split.take_calls(5)
    assert loser.split.left == 0 and loser.split.take_calls(5) == []
    calls = [decode_call(frames) for frames in first + rest]
    assert [c.key for c in calls] == ["/k/same", "/k/changed", "/k/new"]
    assert [c.uuid for c in calls] == [_uuid(10), _uuid(11), _uuid(12)]
    origins = [parse_split_origin(c.properties) for c in calls]
    assert all(o is not None and o.fork == FORK and o.term == 1 for o in origins)
    assert loser.counters["split_writes_found"] == 3


def test_without_a_fork_nothing_is_resent_and_the_writes_are_counted() -> None:
    loser, _ = _split()
    loser.split.fork_known(10.0, None)  # no fork yet: nothing settled early
    loser.split.synced(10.0, None)
    assert loser.split.left == 0 and loser.split.all_calls == []
    assert loser.split.unverified == loser.counters["split_writes_unverified"] == 3


def test_a_fork_known_before_the_snapshot_keeps_the_writes_once() -> None:
    loser, _ = _split()
    loser.fork = FORK
    loser.split.fork_known(10.0, None)
    assert loser.split.left == 3
    loser.split.synced(11.0, None)  # the sync's end: already settled
    assert loser.split.left == 3
    loser.split.take_calls(1)
    assert loser.split.drop_calls() == 2
    assert loser.split.left == 0 and loser.split.take_calls(10) == []


def test_the_winner_applies_what_it_did_not_change_and_keeps_the_rest() -> None:
    loser, winner = _split()
    calls = _kept(loser)
    replies = [winner.split.on_call(decode_call(f), 11.0, 11.0, peer=True) for f in calls]
    assert [(r.status, changed) for r, changed in replies] == [
        ("ok", True),
        ("conflict", True),
        ("ok", True),
    ]
    assert winner.value("/k/same") == b"loser" and winner.value("/k/new") == b"loser"
    assert winner.value("/k/changed") == b"winner"  # the winner's write stands
    (rec,) = winner.split.conflicts.records()
    assert (rec.key, rec.reason, rec.loser_uuid) == (b"/k/changed", "winner-wrote", _uuid(11))
    assert replies[1][0].reason == "split" and f"conflict {rec.id}" in str(replies[1][0].detail)
    # A late direct copy of the refused write counts as seen.
    assert _uuid(11) in winner.window
    # A resend gets the same answer and keeps nothing twice.
    again, changed = winner.split.on_call(decode_call(calls[1]), 12.0, 12.0, peer=True)
    assert (again, changed) == (replies[1][0], False)
    assert len(winner.split.conflicts) == 1 and winner.split.call_at == 12.0
    c = winner.counters
    assert (c["split_calls_received"], c["split_calls_applied"], c["split_conflicts"]) == (4, 2, 1)


def test_only_the_peer_may_forward_a_split_write() -> None:
    loser, winner = _split()
    reply, changed = winner.split.on_call(decode_call(_kept(loser)[0]), 11.0, 11.0, peer=False)
    assert (reply.status, reply.reason, changed) == ("refused", "acl", False)
    assert winner.counters["split_calls_refused_not_peer"] == 1
    assert winner.value("/k/same") == b"base" and winner.split.call_at == 0.0


def test_an_operator_applies_or_discards_a_conflict_once() -> None:
    loser, winner = _split()
    for frames in _kept(loser):
        winner.split.on_call(decode_call(frames), 11.0, 11.0, peer=True)
    (rec,) = winner.split.conflicts.records()
    with pytest.raises(ValueError, match="this server is passive"):
        winner.split.resolve(rec.id, "apply", 20.0, 20.0, not_active="this server is passive")
    with pytest.raises(ValueError, match="applied or discarded"):
        winner.split.resolve(rec.id, "keep", 20.0, 20.0)
    published = len(winner.recorded)
    done = winner.split.resolve(rec.id, "apply", 20.0, 20.0)
    assert done.resolution == "applied" and winner.value("/k/changed") == b"loser"
    assert len(winner.recorded) == published + 1  # a new update, recorded
    assert winner.recorded[-1][0] == b"/k/changed"
    with pytest.raises(ValueError, match="already"):
        winner.split.resolve(rec.id, "discard", 21.0, 21.0)
    with pytest.raises(ValueError, match="no conflict 99"):
        winner.split.resolve(99, "discard", 21.0, 21.0)
    assert winner.counters["conflicts_applied"] == 1 and winner.split.conflicts.unresolved == 0


def test_the_loser_elected_again_holds_what_its_state_already_has() -> None:
    loser, _ = _split()
    calls = _kept(loser)
    # Its store still holds its own writes (no snapshot replaced them here):
    # each is answered as held, applied a second time nowhere.
    replies: list[Reply | None] = [loser.split.apply_own(f, 20.0, 20.0) for f in calls]
    assert all(r is not None and r.ok and r.sequence > 0 for r in replies)
    assert loser.counters["split_writes_held"] == 3
    assert loser.split.apply_own([b"not a call"], 20.0, 20.0) is None
    assert loser.counters["calls_invalid"] == 1


def test_stepping_down_drops_the_updates_parked_since_the_demotion() -> None:
    side = Side()
    side.pending.add(KVMsg("/early", 0, _uuid(1), (), b"v"), 5.0)
    side.pending.add(KVMsg("/late", 0, _uuid(2), (), b"v"), 12.0)
    assert side.split.drop_pending_since(10.0) == 1
    assert [p.msg.key for p in side.pending.drain()] == ["/early"]
    assert side.counters["pending_stepped_down"] == 1
