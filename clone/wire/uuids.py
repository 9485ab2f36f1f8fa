"""UUIDv7s whose time is the time they were made, at a bulk load's rate.

How this works (RFC 9562, UUIDv7 with a fixed-length dedicated counter,
"method 1"): 48 bits of Unix milliseconds, the version, a 12-bit counter, the
variant, 62 random bits.  The first id of a millisecond starts its counter at
a random value below 2,048; each further id in the same millisecond adds one,
so ids stay strictly ordered; only past 4,096 ids in one millisecond (4M ids
a second) is the next millisecond borrowed.

Why not ``uuid6.uuid7``: it orders ids made in the same millisecond by adding
a millisecond to the last one's time, so a writer making 10,000 ids a second
runs ahead of the clock by 9 seconds every second (100,000 ids in 1.7 s ended
98.5 s in the future).  A split-brain heal takes a write's time from its uuid
(:func:`clone.wire.split.uuid_time`), so a bulk load's writes claimed to be
minutes newer than they were.  It also drew its randomness with a syscall per
id; here random bytes are drawn 4 KiB at a time, and the pool is dropped in a
forked child (Spark's Python workers are forks): two processes never share it.

The clock (nanoseconds) and the randomness are injected, for the tests.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["Uuid7Source"]

_POOL_BYTES = 4096
_RANDOM_BYTES = 8  # 62 bits used, after the variant
_COUNTER_MAX = 0xFFF
_COUNTER_START_MAX = 0x7FF  # the first id of a millisecond: room for 2,048 more

_sources: weakref.WeakSet[Uuid7Source] = weakref.WeakSet()


class Uuid7Source:
    """Makes UUIDv7s (16 bytes), strictly increasing within one process;
    thread-safe.  ``clock_ns`` gives Unix nanoseconds, ``random`` n bytes."""

    def __init__(
        self,
        clock_ns: Callable[[], int] = time.time_ns,
        random: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._clock_ns = clock_ns
        self._random = random
        self._lock = threading.Lock()
        self._ms = -1
        self._counter = 0
        self._pool = b""
        self._at = 0
        _sources.add(self)

    def forget(self) -> None:
        """Drop the random pool and the last time (in a forked child, whose
        copy of the pool is its parent's)."""
        self._pool, self._at, self._ms = b"", 0, -1

    def _take(self, n: int) -> bytes:
        if self._at + n > len(self._pool):
            self._pool, self._at = self._random(_POOL_BYTES), 0
        out = self._pool[self._at : self._at + n]
        self._at += n
        return out

    def __call__(self) -> bytes:
        with self._lock:
            ms = self._clock_ns() // 1_000_000
            if ms > self._ms:
                self._ms = ms
                self._counter = int.from_bytes(self._take(2), "big") & _COUNTER_START_MAX
            else:  # the same millisecond (or the clock stepped back): count on
                self._counter += 1
                if self._counter > _COUNTER_MAX:
                    self._ms += 1
                    self._counter = 0
            ms, counter = self._ms, self._counter
            tail = int.from_bytes(self._take(_RANDOM_BYTES), "big")
        value = (
            (ms & 0xFFFF_FFFF_FFFF) << 80
            | 0x7 << 76
            | counter << 64
            | 0b10 << 62
            | tail & 0x3FFF_FFFF_FFFF_FFFF
        )
        return value.to_bytes(16, "big")


def _after_fork() -> None:
    for source in list(_sources):
        source.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
