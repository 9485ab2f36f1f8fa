"""What the passive server holds back, and which update ids a server has seen.

How this works: clients send every KVSET to both servers.  The passive one
cannot apply it (only the active server assigns sequences), so it parks it in a
:class:`PendingList` until the same update comes back from the active server as
a KVPUB, matched by uuid, or until the passive is promoted and applies what is
left.  The reverse order happens too: the active's KVPUB can overtake the
client's direct copy.  :class:`UuidWindow` remembers the most recently applied
ids so such a late copy is recognised and not parked.  The same window is the
active server's deduplication window: a uuid is published at most once within
it, which lets clients resend unconfirmed writes after a failover.  It also
remembers when each id was applied, so that an active server can tell a syncing
peer which updates its snapshot covers and how far back that list reaches
(:mod:`clone.wire.applied`).

Both structures are bounded, O(1) per operation, and sans-IO (``now`` is passed
in).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from clone.wire.codec import KVMsg

__all__ = ["UuidWindow", "PendingList", "PendingUpdate", "update_id"]


def update_id(msg: KVMsg) -> Hashable:
    """What matches a client's KVSET with the active server's KVPUB.

    The uuid when there is one.  The Guide's clients may send none; then the
    key and value stand in, which matches the republished copy of a set but
    cannot tell two identical sets apart (harmless: applying it twice gives the
    same state).
    """
    return msg.uuid if msg.uuid else (msg.key, msg.body)


class UuidWindow:
    """The last ``capacity`` update ids seen, with O(1) membership and eviction,
    and when each was added.

    The newest id is kept beside the set, not in it, so the set holds at most
    ``capacity - 1``: CPython sizes a set that grows past ``used * 2`` slots
    to the next power of two *above* it, so a set of exactly 65,536 ids (the
    default window) takes 262,144 slots, 4 MiB, and one of 65,535 half that:
    about 20 bytes per key at 100,000 keys (the memory per key at fleet
    scale).  The times are a ring of C doubles, not a deque of ``float``
    objects: the server stamps every update with its own clock reading, and
    65,536 float objects and their slots were another 2 MiB.
    """

    __slots__ = ("_capacity", "_head", "_horizon", "_newest", "_order", "_set", "_times")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"window capacity must be at least 1, not {capacity}")
        self._capacity = capacity
        self._order: deque[Hashable] = deque()
        # When each id was added, oldest at _head once the ring is full.
        self._times = array("d")
        self._head = 0
        # Every id in the window but the newest, which is _newest (None: empty).
        self._set: set[Hashable] = set()
        self._newest: Hashable | None = None
        # Every id applied after this time is in the window.  A server starts
        # with nothing applied, so at first the window holds its whole history.
        self._horizon = -math.inf

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, uid: object) -> bool:
        return uid in self._set or (self._newest is not None and uid == self._newest)

    def add(self, uid: Hashable, now: float) -> bool:
        """Remember ``uid``, applied at ``now``; False if it was already in the window."""
        seen = self._set
        newest = self._newest
        if uid in seen or (newest is not None and uid == newest):
            return False
        order, times = self._order, self._times
        if len(order) >= self._capacity:
            old = order.popleft()
            head = self._head
            evicted = times[head]
            times[head] = now
            self._head = head + 1 if head + 1 < self._capacity else 0
            if evicted > self._horizon:
                self._horizon = evicted
            if order:
                seen.discard(old)
            else:
                newest = None  # a window of one: the newest was the oldest
        else:
            times.append(now)
        if newest is not None:
            seen.add(newest)
        order.append(uid)
        self._newest = uid
        return True

    def ids(self) -> list[Hashable]:
        """Every id in the window, oldest first."""
        return list(self._order)

    def span(self, now: float) -> float:
        """How far back, from ``now``, the window reaches: every id applied
        since ``now - span`` is in it (``math.inf``: every id ever applied)."""
        return max(0.0, now - self._horizon)

    def limit_history(self, since: float) -> None:
        """The state was replaced by a snapshot whose updates are known only as
        far back as ``since`` (the peer's applied list): so is the window."""
        self._horizon = max(self._horizon, since)


@dataclass(frozen=True, slots=True)
class PendingUpdate:
    """A client update parked on the passive server, with when it arrived.

    ``arrived`` is wall-clock time (the pending list's age); ``mono`` is the
    same moment on the monotonic clock: an ephemeral key's expiry is counted
    from it, when the client sent it, not from when a backup got promoted, and
    a step of the wall clock cannot move it.
    """

    msg: KVMsg
    arrived: float
    mono: float


class PendingList:
    """Client updates the active server has not yet republished, oldest first.

    Bounded by count, by bytes (keys and values; 0: no byte bound) and by age
    so a passive whose active never echoes (a client writing only to the
    passive, an active that rejected the update) cannot grow without limit:
    a flood of 512 KB writes to a passive server held 100,000 of them in a
    700 MB cgroup's memory and got it killed.  Drops are counted in
    :attr:`dropped`.
    """

    __slots__ = ("_items", "dropped", "max_age", "max_bytes", "max_items", "nbytes")

    def __init__(self, max_items: int, max_age: float, max_bytes: int = 0) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, not {max_items}")
        if max_age <= 0:
            raise ValueError(f"max_age must be positive, not {max_age}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
        self.max_items = max_items
        self.max_age = max_age
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, PendingUpdate] = OrderedDict()
        self.dropped = 0
        #: The keys' and values' bytes parked.
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, uid: object) -> bool:
        return uid in self._items

    def __iter__(self) -> Iterator[PendingUpdate]:
        return iter(self._items.values())

    def add(self, msg: KVMsg, now: float, mono: float | None = None) -> bool:
        """Park ``msg``, arrived at ``now`` (``mono`` on the monotonic clock,
        ``now`` if not given); False if an update with its id is already parked.

        When full, the oldest update is dropped to make room: the newest ones
        are the most likely to be still missing from the active server.
        """
        uid = update_id(msg)
        items = self._items
        if uid in items:
            return False
        size = _size(msg)
        while items and (
            len(items) >= self.max_items
            or (self.max_bytes and self.nbytes + size > self.max_bytes)
        ):
            _, old = items.popitem(last=False)
            self.nbytes -= _size(old.msg)
            self.dropped += 1
        items[uid] = PendingUpdate(msg, now, now if mono is None else mono)
        self.nbytes += size
        return True

    def confirm(self, uid: Hashable) -> bool:
        """The active server applied ``uid``: forget it.  True if it was parked."""
        old = self._items.pop(uid, None)
        if old is None:
            return False
        self.nbytes -= _size(old.msg)
        return True

    def expire(self, now: float) -> int:
        """Drop updates older than ``max_age``; return how many were dropped."""
        items = self._items
        cutoff = now - self.max_age
        n = 0
        while items:
            first = next(iter(items.values()))
            if first.arrived > cutoff:
                break
            items.popitem(last=False)
            self.nbytes -= _size(first.msg)
            n += 1
        self.dropped += n
        return n

    def retain(self, keep: Callable[[PendingUpdate], bool]) -> int:
        """Keep only the updates ``keep`` accepts, in order; return how many went.

        Not counted in :attr:`dropped` (that counts what the bounds cost); the
        caller counts why it discarded them.
        """
        items = self._items
        before = len(items)
        self._items = OrderedDict((uid, p) for uid, p in items.items() if keep(p))
        self.nbytes = sum(_size(p.msg) for p in self._items.values())
        return before - len(self._items)

    def drain(self) -> list[PendingUpdate]:
        """Everything parked, in arrival order, leaving the list empty."""
        out = list(self._items.values())
        self._items.clear()
        self.nbytes = 0
        return out


def _size(msg: KVMsg) -> int:
    """What a parked update costs, as the byte bound counts it: key and value."""
    return len(msg.key) + len(msg.body)
