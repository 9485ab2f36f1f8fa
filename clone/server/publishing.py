"""Publishing on the PUB socket (P+1), in sequence order.

How this works: a single KVPUB or HUGZ is sent at once.  Bulk output (a
promotion's pending list, a mass expiry) goes through an in-order queue drained
a chunk per loop turn, so it never blocks the loop; while that queue is not
empty every other publication joins its tail, so sequence order on the wire is
kept.
"""

from __future__ import annotations

from clone.server.base import ServerBase
from clone.server.sending import send

__all__ = ["PublishingMixin"]


class PublishingMixin(ServerBase):
    """Publish now, or behind the bulk queue."""

    def _publish(self, frames: list[bytes]) -> None:
        """Publish in order: behind the bulk queue if it is not empty."""
        if self._outq or self._outq_hold:
            self._outq.append(frames)
        else:
            assert self._pub is not None
            # A PUB reads nothing; an XPUB's subscriptions are looked at by
            # the heartbeat (security._take_subscriptions): the hot path pays
            # nothing for them.
            send(self._pub, frames, backlog=None, flags=0)

    def _publish_bulk(self, batch: list[list[bytes]]) -> None:
        if not batch:
            return
        self._outq.extend(batch)
        self._schedule_outq()

    def _schedule_outq(self) -> None:
        if not self._outq_scheduled and self._loop is not None:
            self._outq_scheduled = True
            self._loop.add_callback(self._drain_outq)

    def _drain_outq(self) -> None:
        self._outq_scheduled = False
        pub = self._pub
        if pub is None or pub.closed or self._outq_hold:
            return
        q = self._outq
        for _ in range(self.config.snapshot_chunk):
            if not q:
                return
            send(pub, q.popleft(), backlog=None, flags=0)
        if q:
            self._schedule_outq()
