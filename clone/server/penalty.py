"""A host that floods the publisher is kept out for a while: the flood penalty.

Why: cutting a flooding connection is not enough.  A raw XSUB reconnects 100 ms
after each cut and replays every topic it ever sent; libzmq takes each
connection's subscriptions in (one trie node per topic byte) and, when it
closes, walks the socket's whole trie to take its topics out, all inside
whatever call the loop makes on the publisher.  16 such sockets, cut ~90 times
a second, kept the loop inside one ``recv`` for the whole flood (heartbeat 20 s
late, SIGTERM ignored; docs/drills.md, "Hostile clients").  The cost is per
admitted connection, so the cure is to admit fewer: the address of a connection
cut for flooding (the inbound watch) or for subscribing past its caps (the
gate) is refused at the handshake, by the ZAP handler, before libzmq gives the
socket a pipe for it, for ``first`` seconds, doubled at each cut that follows
within ``forget_after`` of the last, up to ``longest``.  A refused handshake
costs the I/O thread and the ZAP thread a few messages and the loop nothing.

A penalty is per address, so it also keeps out an honest client behind the
same address (a NAT, the same host) while it lasts: the first one is short,
and only a host that floods again is kept out longer.

Thread-safe: the inbound watch's thread punishes, the ZAP thread asks, the
loop reads the counts.  Every method takes ``now`` (monotonic seconds).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["FloodPenalty"]


@dataclass(slots=True)
class _Record:
    until: float  # refused before this
    length: float  # the last penalty's length
    last: float  # when it was last punished


class FloodPenalty:
    """Which addresses the publisher refuses, and until when."""

    def __init__(
        self,
        *,
        first: float = 1.0,
        longest: float = 60.0,
        forget_after: float = 300.0,
        max_addresses: int = 4096,
    ) -> None:
        if first <= 0 or longest < first or forget_after <= 0 or max_addresses < 1:
            raise ValueError("flood penalty: need 0 < first <= longest, forget_after > 0,"
                             " max_addresses >= 1")
        self.first = first
        self.longest = longest
        self.forget_after = forget_after
        self.max_addresses = max_addresses
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        #: Cuts punished, and handshakes refused for a penalty (since start).
        self.punished = 0
        self.refused = 0

    def punish(self, address: str, now: float) -> float:
        """``address`` was cut off for flooding: refuse it from ``now`` on; the
        penalty's length (doubled if it was punished within ``forget_after``)."""
        with self._lock:
            record = self._records.get(address)
            if record is not None and now - record.last <= self.forget_after:
                length = min(self.longest, record.length * 2)
                # A connection admitted before the penalty began, cut while it
                # runs, does not make it longer: the host has not come back.
                if now < record.until:
                    length = record.length
            else:
                length = self.first
                if record is None and len(self._records) >= self.max_addresses:
                    self._evict(now)
            self._records[address] = _Record(now + length, length, now)
            self.punished += 1
            return length

    def admits(self, address: str, now: float) -> bool:
        """Whether a handshake from ``address`` may go on; a refusal is counted."""
        with self._lock:
            record = self._records.get(address)
            if record is None or now >= record.until:
                return True
            self.refused += 1
            return False

    def penalized(self, now: float) -> int:
        """Addresses refused at ``now``."""
        with self._lock:
            return sum(1 for r in self._records.values() if now < r.until)

    def _evict(self, now: float) -> None:
        """Make room: forget the records past their penalty and ``forget_after``,
        else the one whose penalty ends first."""
        stale = [a for a, r in self._records.items() if now - r.last > self.forget_after]
        for address in stale:
            del self._records[address]
        if len(self._records) >= self.max_addresses:
            oldest = min(self._records, key=lambda a: self._records[a].until)
            del self._records[oldest]
