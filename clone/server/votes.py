"""Which refused snapshot requests to hold, for how long, and when to vote again.

How this works: Binary Star refuses a vote while the peer still looks alive.
If the peer is in fact dead, the client that noticed first would wait for its
own retry; so a request refused only for that reason is *held* here, bounded
in number (the oldest is dropped first) and in age (all have the same maximum
age, so insertion order is expiry order).  The reactor asks :meth:`wake_at`
when to look again, :meth:`age_out` drops requests past their age,
:meth:`drop_contradicted` those held before the active peer was heard again,
and once :meth:`may_vote` says a vote could be accepted it takes them with :meth:`pop`,
oldest first, and votes for each.

Sans-IO: ``now`` is passed in (the server's monotonic clock), and the reactor
keeps the timer, the vote and the socket work.
"""

from __future__ import annotations

from dataclasses import dataclass

from clone.wire.delta import SinceRequest

__all__ = ["DeferredVote", "DeferredVotes", "Hold"]


@dataclass(frozen=True, slots=True)
class DeferredVote:
    """A snapshot request held until Binary Star may accept it (or it ages out)."""

    identity: bytes
    subtree: str
    expires_at: float  # on the server's monotonic clock
    batch: bool  # the requester negotiated KVBATCH
    applied: bool  # the requester (a peer server) asked for KVAPPLIED
    user: str | None = None  # its ZAP User-Id (CURVE): its rights are read when served
    since: SinceRequest | None = None  # a peer server's catch-up request
    ttl_left: bool = False  # the requester (a peer server) asked for ttl-left


@dataclass(frozen=True, slots=True)
class Hold:
    """What :meth:`DeferredVotes.hold` did: the reactor counts and logs it."""

    new: bool  # False: the same request was already held (a Guide client re-asks)
    dropped: DeferredVote | None = None  # the oldest, dropped to make room


class DeferredVotes:
    """The held requests, oldest first, keyed by (identity, subtree)."""

    def __init__(self, limit: int, max_age: float) -> None:
        if limit < 0 or max_age < 0:
            raise ValueError(f"need limit >= 0 and max_age >= 0, not {limit}, {max_age}")
        self.limit = limit  # 0: never hold
        self.max_age = max_age
        self._held: dict[tuple[bytes, str], DeferredVote] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __bool__(self) -> bool:
        return bool(self._held)

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def hold(
        self,
        identity: bytes,
        subtree: str,
        now: float,
        *,
        batch: bool,
        applied: bool,
        user: str | None = None,
        since: SinceRequest | None = None,
        ttl_left: bool = False,
    ) -> Hold:
        """Hold a refused request until ``now + max_age``; drop the oldest if full."""
        key = (identity, subtree)
        if key in self._held:
            return Hold(new=False)
        dropped = None
        if len(self._held) >= self.limit:
            oldest = next(iter(self._held))
            dropped = self._held.pop(oldest)
        self._held[key] = DeferredVote(
            identity, subtree, now + self.max_age, batch, applied, user, since, ttl_left
        )
        return Hold(new=True, dropped=dropped)

    def discard(self, identity: bytes, subtree: str) -> None:
        """The request was served at once: a held copy must not be served again."""
        self._held.pop((identity, subtree), None)

    def age_out(self, now: float) -> list[DeferredVote]:
        """Drop and return the requests whose age is up at ``now``, oldest first."""
        held = self._held
        out = []
        while held:
            key, vote = next(iter(held.items()))
            if vote.expires_at > now:
                break
            del held[key]
            out.append(vote)
        return out

    def drop_contradicted(self, peer_active_at: float | None) -> list[DeferredVote]:
        """Drop and return the requests held before ``peer_active_at``, oldest first.

        ``peer_active_at`` is when the peer was last heard, if what it said
        then was that it is active (None otherwise). A request is held on the
        guess that its client asked us because it had lost the active; once
        the active has been heard since, the guess is contradicted, and a
        vote for it at the active's later expiry would be a vote nobody cast:
        after a cut of the Binary Star link alone (chaos run seed 11), such a
        replay made the passive active 4 ms after its peer expired, while
        every client could still reach the active. A peer heard as anything
        else (passive, or a primary at start-up that yielded to our newer
        data and asks us for a snapshot) contradicts nothing.
        """
        held = self._held
        out: list[DeferredVote] = []
        if peer_active_at is None:
            return out
        while held:
            key, vote = next(iter(held.items()))
            if vote.expires_at - self.max_age >= peer_active_at:
                break
            del held[key]
            out.append(vote)
        return out

    def may_vote(self, now: float, *, active: bool, peer_expiry: float) -> bool:
        """Whether voting again could be accepted: we are active or the peer expired.

        Before that a vote would only be refused (and counted) again.
        """
        return bool(self._held) and (active or now >= peer_expiry)

    def pop(self) -> DeferredVote:
        """Take the oldest held request, to vote for it now."""
        key = next(iter(self._held))
        return self._held.pop(key)

    def wake_at(self, peer_expiry: float) -> float | None:
        """When to look again: the peer's expiry or the oldest request's, if any."""
        if not self._held:
            return None
        oldest = next(iter(self._held.values()))
        return min(peer_expiry, oldest.expires_at)

    def clear(self) -> None:
        self._held.clear()
