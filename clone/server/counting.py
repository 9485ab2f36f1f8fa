"""What the server counts without Prometheus: snapshot durations and the
publisher's connections.

These are kept whether or not ``--http-port`` is given (the snapshot port
observes every stream's duration; the inbound watch reads the publisher's
monitor), so they live apart from :mod:`clone.server.metrics` and
:mod:`clone.server.http`, whose imports (prometheus_client, tornado.web,
the HTTP server) a server without an HTTP port never pays at start-up.
:class:`SubscriberCount` says how the connections are counted
(docs/operations.md, "Monitoring").
"""

from __future__ import annotations

import bisect

import zmq

__all__ = [
    "SNAPSHOT_BUCKETS",
    "DurationHistogram",
    "PublisherWatch",
    "SubscriberCount",
    "publisher_events",
]

#: Upper bounds (seconds) of the snapshot-duration buckets: a small subtree in a
#: millisecond up to a million keys in tens of seconds.
SNAPSHOT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)


class DurationHistogram:
    """Cumulative bucket counts, a sum and a count: a Prometheus histogram's state."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = SNAPSHOT_BUCKETS) -> None:
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError("bucket bounds must be increasing and not empty")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs, ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class SubscriberCount:
    """Connections to the publisher, from its socket monitor's events.

    A plain PUB never hears from its subscribers, but its monitor reports each
    TCP connection accepted and each one closed: ``ACCEPTED - DISCONNECTED``.
    With CURVE a connection counts only once its handshake succeeded, and
    every connection ends in ``DISCONNECTED`` whether or not it got that far
    (a failed one is reported as failed first), so the count is ``succeeded -
    (disconnected - failed)``.
    """

    __slots__ = ("_failed", "_secure", "_succeeded", "accepted", "disconnected")

    _FAILURES = frozenset(
        getattr(zmq, name)
        for name in (
            "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
            "EVENT_HANDSHAKE_FAILED_PROTOCOL",
            "EVENT_HANDSHAKE_FAILED_AUTH",
        )
        if hasattr(zmq, name)
    )

    def __init__(self, *, secure: bool) -> None:
        self._secure = secure
        self.accepted = 0
        self.disconnected = 0
        self._succeeded = 0
        self._failed = 0

    def on_event(self, event: int) -> None:
        if event == zmq.EVENT_ACCEPTED:
            self.accepted += 1
        elif event == zmq.EVENT_DISCONNECTED:
            self.disconnected += 1
        elif event == getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", None):
            self._succeeded += 1
        elif event in self._FAILURES:
            self._failed += 1

    @property
    def value(self) -> int:
        if self._secure:
            return max(0, self._succeeded - (self.disconnected - self._failed))
        return max(0, self.accepted - self.disconnected)


class PublisherWatch:
    """Count the publisher's connections (with ``--http-port`` only): what
    ``subscribers`` reports.  Fed the events of the publisher's monitor, which
    the inbound watch (clone.server.subscribers) reads on its own thread and
    hands to the loop: one monitor, two readers of its events."""

    def __init__(self) -> None:
        self.count: SubscriberCount | None = None

    def watch(self, secure: bool) -> None:
        """A new publisher socket: a new count."""
        self.count = SubscriberCount(secure=secure)

    def on_event(self, event: int) -> None:
        count = self.count
        if count is not None:
            count.on_event(event)

    def close(self) -> None:
        self.count = None


def publisher_events(secure: bool) -> int:
    """The monitor events of the publisher that the inbound watch and the
    connection count need (the handshakes only under CURVE)."""
    events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
    if secure:
        for name in (
            "EVENT_HANDSHAKE_SUCCEEDED",
            "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
            "EVENT_HANDSHAKE_FAILED_PROTOCOL",
            "EVENT_HANDSHAKE_FAILED_AUTH",
        ):
            events |= getattr(zmq, name, 0)
    return events
