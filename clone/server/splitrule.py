"""Which split-brain writes the winner applies: the winner's writes win.

How this works: two servers active at once (a partition, a frozen server) both
confirm writes; when they hear each other again the one elected earlier, the
*loser*, steps down and forwards the winner the client writes it confirmed
after the winner's election, the *fork* (:mod:`clone.server.split`).  A pair
cannot order two writes made on two sides of a partition; what it can do is
not let the heal undo what the winning side confirmed.  So a forwarded write
is applied only where the winner's key still holds what the loser's writer
saw when the loser applied it:

* **unchanged**: the winner has not changed the key since the fork (the loser
  had not either, before this write): the write simply follows the shared
  history, as if the split had not been;
* **continued**: the winner's key holds the loser's own previous update of it
  (``split_prev``): a write the loser forwarded earlier in this heal, or one
  both sides applied (a client that reached both);
* a **plain** write is applied if either holds; a **conditional** one
  (``if_sequence``, 0 being "only if absent", which is also how a lock's
  contender key is taken) only if the key is exactly what the loser judged its
  condition against: unchanged with no earlier loser write, or continued;
* a write bound to a **lease** the winner does not hold is never applied: the
  loser's leases ended with its term.

Every write not applied is a *conflict*, kept and reported by the caller
(docs/failover.md, "Writes of a split brain").  Pure: no store, no clock.
"""

from __future__ import annotations

import enum

from clone.wire.split import GONE, SplitOrigin

__all__ = ["Verdict", "judge_split_write"]


class Verdict(enum.Enum):
    """What becomes of one forwarded write; the value is the conflict's reason."""

    APPLY = "apply"
    #: The winner changed the key after the fork, with a write the loser lacked.
    WINNER_WROTE = "winner-wrote"
    #: A conditional write whose key is no longer what its condition was judged on.
    CONDITION = "condition"
    #: Bound to a lease the winner does not hold (the loser's ended with its term).
    LEASE_GONE = "lease-gone"
    #: Bound to a lease the winner holds, but the forwarding peer could not
    #: prove it may use it (a plain pair: the lease's secret never travels).
    LEASE_OWNER = "lease-owner"


def judge_split_write(
    origin: SplitOrigin,
    *,
    lease: str | None,
    lease_alive: bool,
    changed_since_fork: bool,
    current_uuid: bytes | None,
) -> Verdict:
    """The verdict on one forwarded write (its ``origin``, as the loser sent it).

    ``lease``: the lease the write binds its key to, if any; ``lease_alive``:
    whether the winner holds it.  ``changed_since_fork``: whether the winner
    updated the key after the fork (by anyone, the loser's forwarded writes
    included; a winner that cannot tell says True).  ``current_uuid``: the
    uuid of the update the winner's key holds now (``b""`` for a server-made
    one), None when the key is absent.
    """
    if lease is not None and not lease_alive:
        return Verdict.LEASE_GONE
    prev = origin.prev
    if prev is None:
        matches = not changed_since_fork
    elif prev == GONE:
        matches = current_uuid is None
    else:
        matches = current_uuid == prev
    if matches:
        return Verdict.APPLY
    if origin.condition is not None:
        return Verdict.CONDITION
    # A plain write whose earlier loser write never reached the winner (its
    # ttl ran out): the winner's key is still the fork's, nothing to undo.
    return Verdict.WINNER_WROTE if changed_since_fork else Verdict.APPLY
