"""Ephemeral keys: the ``ttl`` property and the expiry heap.

How this works: every ephemeral key has one *absolute* deadline (Unix seconds,
the ``expires`` property).  :class:`ExpiryHeap` keeps ``(deadline, generation,
key)`` tuples in a binary heap and remembers the live generation of each key in
a dict.  Rescheduling or cancelling a key only updates the dict; the stale heap
tuple stays behind and is skipped when it surfaces ("lazy deletion").  So
``schedule``/``cancel`` are O(log n)/O(1) and ``due(now)`` costs O(k log n) for
the k entries that surface, never a scan of every key.  When stale tuples
outnumber live ones the heap is rebuilt, so memory stays bounded.

Sans-IO: ``now`` is always passed in.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Hashable
from typing import Generic, TypeVar

from clone.errors import ProtocolError
from clone.wire.protocol import MAX_TTL_SECONDS, TTL_PROPERTY

__all__ = ["ExpiryHeap", "parse_ttl", "parse_expires", "format_expires"]

# A ttl is a plain decimal number: "30", "1.5", ".5".  float() alone would also
# take "inf", "nan", "1e3" and "1_000", none of which a client means.
_DECIMAL_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
# Compact the heap when it holds this many more stale tuples than live keys.
_COMPACT_SLACK = 1024


def parse_ttl(text: str | None) -> float:
    """The ``ttl`` property in seconds; ``0.0`` means "does not expire".

    Raises :class:`ProtocolError` for anything that is not a decimal number in
    ``0 .. MAX_TTL_SECONDS``, so the caller rejects the whole update rather than
    publishing a value it cannot expire.
    """
    if text is None:
        return 0.0
    if not _DECIMAL_RE.fullmatch(text):
        raise ProtocolError(f"{TTL_PROPERTY}={text[:40]!r} is not a decimal number of seconds")
    ttl = float(text)
    if ttl > MAX_TTL_SECONDS:
        raise ProtocolError(
            f"{TTL_PROPERTY}={text[:40]} is over the {MAX_TTL_SECONDS:.0f}-second limit"
        )
    return ttl


def parse_expires(text: str | None) -> float | None:
    """The ``expires`` property (absolute Unix seconds) or None if absent/invalid.

    Only an active server writes it, so a bad value means a broken peer; the
    caller logs that and keeps the key without an expiry rather than dropping it.
    """
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return value


def format_expires(deadline: float) -> str:
    """``expires`` as written on the wire: millisecond precision is plenty."""
    return f"{deadline:.3f}"


#: The key type: the store uses raw key bytes.
K = TypeVar("K", bound=Hashable)


class ExpiryHeap(Generic[K]):
    """Deadlines of ephemeral keys, cheapest-first, with lazy deletion."""

    __slots__ = ("_counter", "_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._live: dict[K, tuple[float, int]] = {}
        self._counter = 0

    def __len__(self) -> int:
        """The number of keys with a live deadline."""
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def deadline(self, key: K) -> float | None:
        """The live deadline of ``key``, if any."""
        entry = self._live.get(key)
        return entry[0] if entry else None

    def schedule(self, key: K, deadline: float) -> None:
        """Expire ``key`` at ``deadline``, replacing any earlier schedule."""
        self._counter += 1
        gen = self._counter
        self._live[key] = (deadline, gen)
        heapq.heappush(self._heap, (deadline, gen, key))
        if len(self._heap) > 2 * len(self._live) + _COMPACT_SLACK:
            self._compact()

    def cancel(self, key: K) -> None:
        """Forget ``key``'s deadline (its heap tuple goes stale)."""
        self._live.pop(key, None)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def next_deadline(self) -> float | None:
        """The earliest live deadline, for a caller that wants to sleep until it."""
        self._drop_stale_head()
        return self._heap[0][0] if self._heap else None

    def due(self, now: float, limit: int | None = None) -> list[K]:
        """Remove and return keys whose deadline is ``<= now``, earliest first.

        ``limit`` bounds the work of one call so a mass expiry cannot stall a
        reactor; the rest comes out on the next call.
        """
        out: list[K] = []
        heap = self._heap
        live = self._live
        while heap and heap[0][0] <= now:
            if limit is not None and len(out) >= limit:
                break
            deadline, gen, key = heapq.heappop(heap)
            if live.get(key) == (deadline, gen):
                del live[key]
                out.append(key)
        return out

    def rebuild(self, deadlines: dict[K, float]) -> None:
        """Replace everything with ``deadlines`` in O(n) (after a full resync)."""
        self._live = {}
        heap: list[tuple[float, int, K]] = []
        for key, deadline in deadlines.items():
            self._counter += 1
            self._live[key] = (deadline, self._counter)
            heap.append((deadline, self._counter, key))
        heapq.heapify(heap)
        self._heap = heap

    def _drop_stale_head(self) -> None:
        heap = self._heap
        while heap:
            deadline, gen, key = heap[0]
            if self._live.get(key) == (deadline, gen):
                return
            heapq.heappop(heap)

    def _compact(self) -> None:
        self._heap = [(d, g, k) for k, (d, g) in self._live.items()]
        heapq.heapify(self._heap)
