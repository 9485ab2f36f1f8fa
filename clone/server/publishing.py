"""The publisher: what goes out on the PUB socket (P+1), in sequence order.

How this works: a single KVPUB or HUGZ is sent at once.  Bulk output (a
promotion's pending list, a mass expiry) goes through an in-order queue drained
a chunk per loop turn, so it never blocks the loop; while that queue is not
empty every other publication joins its tail, so sequence order on the wire is
kept.  While the socket is bound again (security: a reload that shrinks
rights) everything is queued (:meth:`Publisher.hold`) and drained once the new
socket is in (:meth:`Publisher.install`).

A part that ``CloneServer`` owns: it is given the chunk size and a way to run
a callback on the next loop turn, and holds the socket and its queue; a test
drives it alone (tests/server/test_publisher.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from clone.server.sending import send

__all__ = ["Publisher"]

#: Runs a callback on the next loop turn; False if there is no loop (yet, or any more).
Schedule = Callable[[Callable[[], None]], bool]


class Publisher:
    """Publish now, or behind the bulk queue."""

    def __init__(self, schedule: Schedule, chunk: int) -> None:
        self._schedule = schedule
        self._chunk = chunk
        self.socket: zmq.Socket[Any] | None = None
        self._queue: deque[list[bytes]] = deque()
        self._scheduled = False
        self._held = False  # the socket is being bound again: queue everything
        #: Bytes handed to the socket so far (the inbound watch measures a
        #: stalled subscriber's queue by it: clone.server.subscribers).
        self.sent_bytes = 0

    def __len__(self) -> int:
        """Publications queued (the ``outq`` gauge)."""
        return len(self._queue)

    def publish(self, frames: list[bytes]) -> None:
        """Publish in order: behind the bulk queue if it is not empty."""
        if self._queue or self._held:
            self._queue.append(frames)
            return
        assert self.socket is not None
        # The XPUB's subscriptions are read by their own handler and looked
        # at by the heartbeat (security._take_subscriptions): the hot path
        # pays nothing for them.
        send(self.socket, frames, backlog=None, flags=0)
        self.sent_bytes += sum(map(len, frames))

    def publish_bulk(self, batch: list[list[bytes]]) -> None:
        """Many publications, sent a chunk per loop turn after what is queued."""
        if not batch:
            return
        self._queue.extend(batch)
        self._schedule_drain()

    def hold(self) -> None:
        """The socket is going away to be bound again: queue everything."""
        self._held = True

    def install(self, sock: zmq.Socket[Any]) -> None:
        """A (new) socket to publish on; what was held goes out from the next turn."""
        self.socket = sock
        if self._held:
            self._held = False
            if self._queue:
                self._schedule_drain()

    def drop(self) -> int:
        """Forget what is queued (demoted: it is no longer ours to publish); how much."""
        n = len(self._queue)
        self._queue.clear()
        return n

    def _schedule_drain(self) -> None:
        if not self._scheduled and self._schedule(self._drain):
            self._scheduled = True

    def _drain(self) -> None:
        self._scheduled = False
        pub = self.socket
        if pub is None or pub.closed or self._held:
            return
        q = self._queue
        for _ in range(self._chunk):
            if not q:
                return
            frames = q.popleft()
            send(pub, frames, backlog=None, flags=0)
            self.sent_bytes += sum(map(len, frames))
        if q:
            self._schedule_drain()
