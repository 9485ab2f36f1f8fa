"""The deferred-vote policy, with a fake clock: no sockets, no Binary Star."""

from __future__ import annotations

import pytest

from clone.server.votes import DeferredVote, DeferredVotes, Hold


def _hold(votes: DeferredVotes, who: bytes, now: float, subtree: str = "") -> Hold:
    return votes.hold(who, subtree, now, batch=False, applied=False)


def test_holds_until_max_age_and_keeps_the_negotiated_options() -> None:
    votes = DeferredVotes(limit=10, max_age=2.0)
    assert votes.hold(b"a", "/x/", 1.0, batch=True, applied=True) == Hold(new=True)
    assert len(votes) == 1
    assert votes.pop() == DeferredVote(b"a", "/x/", 3.0, True, True)
    assert not votes


def test_the_same_request_again_is_held_once() -> None:
    votes = DeferredVotes(limit=10, max_age=2.0)
    _hold(votes, b"a", 0.0)
    assert _hold(votes, b"a", 0.5) == Hold(new=False)
    assert _hold(votes, b"a", 0.5, subtree="/other/").new  # another subtree: another request
    assert len(votes) == 2


def test_when_full_the_oldest_is_dropped() -> None:
    votes = DeferredVotes(limit=2, max_age=2.0)
    _hold(votes, b"a", 0.0)
    _hold(votes, b"b", 0.1)
    hold = _hold(votes, b"c", 0.2)
    assert hold.new and hold.dropped is not None and hold.dropped.identity == b"a"
    assert [votes.pop().identity for _ in range(len(votes))] == [b"b", b"c"]


def test_disabled_when_the_limit_is_zero() -> None:
    assert not DeferredVotes(limit=0, max_age=2.0).enabled
    assert DeferredVotes(limit=1, max_age=2.0).enabled


@pytest.mark.parametrize(("limit", "max_age"), [(-1, 1.0), (1, -0.5)])
def test_bad_limits_are_refused(limit: int, max_age: float) -> None:
    with pytest.raises(ValueError):
        DeferredVotes(limit, max_age)


def test_discard_forgets_a_request_served_at_once() -> None:
    votes = DeferredVotes(limit=10, max_age=2.0)
    _hold(votes, b"a", 0.0)
    votes.discard(b"a", "")
    votes.discard(b"never held", "")
    assert not votes


@pytest.mark.parametrize(
    ("now", "aged_out", "left"),
    [
        (0.5, [], [b"a", b"b", b"c"]),
        (2.0, [b"a"], [b"b", b"c"]),  # an age exactly up counts as up
        (2.6, [b"a", b"b"], [b"c"]),
        (9.0, [b"a", b"b", b"c"], []),
    ],
)
def test_age_out_drops_the_oldest_first(
    now: float, aged_out: list[bytes], left: list[bytes]
) -> None:
    votes = DeferredVotes(limit=10, max_age=2.0)
    for at, who in ((0.0, b"a"), (0.5, b"b"), (1.0, b"c")):
        _hold(votes, who, at)
    assert [v.identity for v in votes.age_out(now)] == aged_out
    assert [votes.pop().identity for _ in range(len(votes))] == left


@pytest.mark.parametrize(
    ("held", "now", "active", "peer_expiry", "expected"),
    [
        (True, 1.0, False, 2.0, False),  # the peer still looks alive: it would be refused
        (True, 2.0, False, 2.0, True),  # the peer has just expired
        (True, 3.0, False, 2.0, True),
        (True, 1.0, True, 2.0, True),  # already active: votes are accepted
        (False, 3.0, True, 2.0, False),  # nothing held
    ],
)
def test_may_vote(held: bool, now: float, active: bool, peer_expiry: float, expected: bool) -> None:
    votes = DeferredVotes(limit=10, max_age=5.0)
    if held:
        _hold(votes, b"a", 0.0)
    assert votes.may_vote(now, active=active, peer_expiry=peer_expiry) is expected


@pytest.mark.parametrize(
    ("peer_expiry", "expected"),
    [(1.0, 1.0), (2.5, 2.0), (2.0, 2.0)],  # whichever comes first
)
def test_wake_at_the_peer_expiry_or_the_oldest_age(peer_expiry: float, expected: float) -> None:
    votes = DeferredVotes(limit=10, max_age=2.0)
    assert votes.wake_at(peer_expiry) is None
    _hold(votes, b"a", 0.0)
    _hold(votes, b"b", 1.0)
    assert votes.wake_at(peer_expiry) == expected


def test_clear() -> None:
    votes = DeferredVotes(limit=10, max_age=2.0)
    _hold(votes, b"a", 0.0)
    votes.clear()
    assert not votes and votes.wake_at(0.0) is None


def test_requests_held_before_the_active_peer_spoke_again_are_dropped() -> None:
    """Chaos run seed 11: requests held while the active was alive, replayed at
    its expiry after a cut of the link alone, made the passive active."""
    votes = DeferredVotes(limit=10, max_age=2.0)
    _hold(votes, b"a", 10.0)
    _hold(votes, b"b", 10.2)
    _hold(votes, b"c", 10.5)
    # The active's last heartbeat before the cut, at 10.3: a and b asked before it.
    dropped = votes.drop_contradicted(10.3)
    assert [vote.identity for vote in dropped] == [b"a", b"b"]
    assert [votes.pop().identity for _ in range(len(votes))] == [b"c"]


def test_a_request_held_after_the_active_was_last_heard_stays() -> None:
    """The failover it exists for: the active died (or froze, or was cut off
    from everyone) before its client asked us."""
    votes = DeferredVotes(limit=10, max_age=2.0)
    _hold(votes, b"a", 10.0)
    assert votes.drop_contradicted(9.75) == []
    assert votes.drop_contradicted(10.0) == [], "heard at the same moment: no contradiction"
    assert len(votes) == 1


def test_a_peer_not_heard_as_active_contradicts_nothing() -> None:
    """A primary that yielded at start-up to our newer data is heard PASSIVE
    while its snapshot request waits here (failover.md, "Cold start and ranks")."""
    votes = DeferredVotes(limit=10, max_age=2.0)
    _hold(votes, b"a", 10.0)
    assert votes.drop_contradicted(None) == []
    assert len(votes) == 1
