"""Who asked, by uuid: what a relay remembers of what it forwarded upstream.

How this works: a relay forwards a client's CALL? to the pair and must send the
pair's REPLY back to that client; it forwards a client's KVSET and, if the pair
refuses it, must pass the refusal notice on to that client.  Both answers
carry the uuid of the request, so the relay keeps ``uuid -> who`` until the
answer comes, the entry ages out, or newer entries push it out.

Bounded in count and in age, because an answer may never come (the pair
dropped the call, the upstream died, the write was simply applied): an entry
that is forgotten costs its requester a timeout and a retry, never memory.
Every entry lives the same ``ttl``, so insertion order is expiry order and
expiring is popping from the front.  Pure: times are passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["InFlight"]

T = TypeVar("T")


class InFlight(Generic[T]):
    """``uuid -> who`` for at most ``limit`` entries, each for ``ttl`` seconds."""

    def __init__(self, limit: int, ttl: float) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, not {ttl}")
        self.limit = limit
        self.ttl = ttl
        self._entries: OrderedDict[bytes, tuple[T, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, uuid: bytes, who: T, now: float) -> bool:
        """Remember that ``who`` asked ``uuid`` at ``now``; True if the oldest
        entry had to be forgotten to make room.

        The same uuid again (a retry, perhaps from a new socket) replaces the
        entry: the answer goes to whoever asked last.
        """
        entries = self._entries
        if uuid in entries:
            del entries[uuid]
        entries[uuid] = (who, now + self.ttl)
        if len(entries) > self.limit:
            entries.popitem(last=False)
            return True
        return False

    def take(self, uuid: bytes, now: float) -> T | None:
        """Who asked ``uuid`` (forgotten now), or None if nobody or too long ago."""
        entry = self._entries.pop(uuid, None)
        if entry is None or entry[1] <= now:
            return None
        return entry[0]

    def expire(self, now: float) -> int:
        """Forget the entries older than the ttl; how many."""
        entries = self._entries
        n = 0
        while entries:
            uuid, (_, deadline) = next(iter(entries.items()))
            if deadline > now:
                break
            del entries[uuid]
            n += 1
        return n

    def clear(self) -> None:
        self._entries.clear()
