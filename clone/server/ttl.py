"""Ephemeral keys: the ``ttl`` property and the expiry heap.

How this works: every ephemeral key has one deadline on *this server's
monotonic clock*, never on the wall clock, so a step of the wall clock (NTP,
an operator, a VM resume) ends nothing early or late.  The deadline itself is
not replicated, because one server's monotonic clock means nothing to another:
what travels is the time *left*, counted by the receiver from when *it* got
it.  The active server counts a client's ``ttl`` from when it applied the write
and publishes the write at once, ``ttl`` as sent (nothing has elapsed yet);
a snapshot or catch-up entry sent to a peer server carries the time left as
it goes out in one more property, ``ttl-left``, appended last
(:func:`with_ttl_left`), which the receiver cuts off again before storing
(:func:`split_ttl_left`), so both servers store the same bytes.  A receiver's
deadline is therefore never earlier than the sender's, and later only by the
time in transit.  The ``expires`` property (absolute Unix seconds, the wall
clock of the server that applied the write plus the ttl) is for display; no
server reads it back.

:class:`ExpiryHeap` keeps ``(deadline, generation,
key)`` tuples in a binary heap and remembers the live generation of each key in
a dict.  Rescheduling or cancelling a key only updates the dict; the stale heap
tuple stays behind and is skipped when it surfaces ("lazy deletion").  So
``schedule``/``cancel`` are O(log n)/O(1) and ``due(now)`` costs O(k log n) for
the k entries that surface, never a scan of every key.  When stale tuples
outnumber live ones the heap is rebuilt, so memory stays bounded.

Sans-IO: ``now`` is always passed in, on the monotonic clock.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Hashable
from typing import Generic, TypeVar

from clone.errors import ProtocolError
from clone.wire.protocol import (
    MAX_PROPERTIES_BYTES,
    MAX_TTL_SECONDS,
    TTL_LEFT_PROPERTY,
    TTL_PROPERTY,
)

__all__ = [
    "ExpiryHeap",
    "format_expires",
    "format_ttl_left",
    "parse_expires",
    "parse_ttl",
    "split_ttl_left",
    "with_ttl_left",
]

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

    Display only: no server expires a key by it (see the module doc).
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


#: The least ``ttl-left`` sent: a key due but not yet deleted still has a deadline.
_MIN_LEFT = 0.001
_LEFT_TOKEN = f"{TTL_LEFT_PROPERTY}=".encode()


def format_ttl_left(left: float) -> str:
    """The time left as sent: rounded *up* to the millisecond (a receiver must
    never count less than is left) and at least 1 ms."""
    return f"{max(_MIN_LEFT, math.ceil(left * 1000.0) / 1000.0):.3f}"


def with_ttl_left(props: bytes, left: float) -> bytes | None:
    """Stored properties ``props`` with ``ttl-left`` appended as the last one;
    None if that would pass the properties limit (the caller then sends them
    as stored: the receiver counts the whole ``ttl``, so its deadline is only
    later)."""
    out = props + _LEFT_TOKEN + format_ttl_left(left).encode() + b"\n"
    return out if len(out) <= MAX_PROPERTIES_BYTES else None


def split_ttl_left(props: bytes) -> tuple[bytes, float | None]:
    """Received properties without a trailing ``ttl-left``, and its value
    (None when there is none, or it is not a positive number: then the
    receiver counts ``ttl``)."""
    if not props.endswith(b"\n"):
        return props, None
    start = props.rfind(b"\n", 0, len(props) - 1) + 1
    if not props.startswith(_LEFT_TOKEN, start):
        return props, None
    try:
        left = float(props[start + len(_LEFT_TOKEN) : -1])
    except ValueError:
        return props[:start], None
    if not math.isfinite(left) or left <= 0:
        return props[:start], None
    return props[:start], min(left, MAX_TTL_SECONDS)


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
