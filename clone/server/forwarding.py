"""A relay's client writes forwarded to the pair's collectors, or refused (a part).

How this works: the :class:`Forwarder` is a relay's collector sink
(:class:`clone.server.collecting.Sink`): once per turn it asks whether the
relay is stale (its :class:`~clone.server.relaying.RelayLink` knows), then
sends each KVSET on one PUB connected to every upstream collector, or
refuses it with a notice (:func:`~clone.server.relayrules.forward_refusal`
says why: ``stale``, or ``overloaded`` when the PUB's queue is full).  The
PUB queues only for collectors it is connected to (``ZMQ_IMMEDIATE``) and
says when a queue is full (``XPUB_NODROP``) rather than drop.
``tests/server/test_relay_forwarding.py`` drives it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from clone.security import PEER_USER
from clone.server.inflight import InFlight
from clone.server.relayrules import forward_refusal
from clone.server.sending import Sent, send
from clone.server.shared import Shared
from clone.wire.control import encode_refusal

__all__ = ["ANY_WRITER", "RELAY_WRITES_MAX", "RELAY_WRITE_TTL", "Forwarder", "Refuse"]

#: The name a plain relay addresses its refusal notices to: it knows no names.
ANY_WRITER = "*"

# Serving over CURVE, who wrote each KVSET the relay forwarded, until a
# refusal notice could still come back (the pair answers within a turn).
RELAY_WRITES_MAX = 65_536
RELAY_WRITE_TTL = 10.0

#: Tell a named writer its write (by uuid) was refused, and why (security's).
Refuse = Callable[["str | None", bytes, str], None]


class Forwarder:
    """Client writes on to the pair's collectors, from one PUB, or refused.

    The relay's collector sink (:class:`clone.server.collecting.Sink`): once
    per turn it asks ``stale`` (the link's), then forwards or refuses each
    KVSET.  Serving over CURVE (``refuse`` given) a refusal goes to the
    writer by name and the writer of each forwarded write is remembered in
    ``writers``, so that the pair's refusal can reach it; a plain relay
    ``publish``es its refusals to :data:`ANY_WRITER`.
    """

    def __init__(
        self,
        pub: zmq.Socket[Any],
        shared: Shared,
        *,
        stale: Callable[[], bool],
        publish: Callable[[list[bytes]], None],
        refuse: Refuse | None = None,
        writers: InFlight[str] | None = None,
    ) -> None:
        self.pub = pub
        self._shared = shared
        self._counters = shared.counters
        self._stale = stale
        self._publish = publish
        self._refuse = refuse
        self.writers: InFlight[str] = (
            writers if writers is not None else InFlight(RELAY_WRITES_MAX, RELAY_WRITE_TTL)
        )
        self._turn_stale = False
        self._turn_now = 0.0

    def begin(self) -> None:
        self._turn_stale = self._stale()
        self._turn_now = self._shared.clock()

    def take(self, frames: list[bytes], writer: str | None) -> None:
        if self.forward(frames, stale=self._turn_stale, writer=writer):
            if (
                writer is not None
                and len(frames) == 5
                and len(frames[2]) == 16
                and writer != PEER_USER
            ):
                self.writers.add(frames[2], writer, self._turn_now)

    def end(self) -> None:
        pass

    def forward(self, frames: list[bytes], *, stale: bool, writer: str | None = None) -> bool:
        """One KVSET to the pair's collectors, or refused (counted, logged
        rate-limited, its writer told); whether it was forwarded."""
        queued = False
        if not stale:
            # A PUB reads nothing: no backlog to look at.
            queued = send(self.pub, frames, backlog=None) is Sent.OK
        why = forward_refusal(stale=stale, queued=queued)
        if why is None:
            self._counters["kvset_forwarded"] += 1
            return True
        self._counters["kvset_refused_stale" if stale else "kvset_forward_dropped"] += 1
        self._shared.throttle.log(
            "kvset_" + why,
            logging.WARNING,
            "refused a write%s: %s",
            f" by {writer}" if writer else "",
            "we have lost the pair (stale)" if stale else "our queue to the pair is full",
        )
        uuid = frames[2] if len(frames) == 5 else b""
        if len(uuid) == 16:
            if self._refuse is not None:
                self._refuse(writer, uuid, why)
            else:
                self._publish(encode_refusal(ANY_WRITER, uuid, why))
        return False

    def close(self) -> None:
        self.writers.clear()
        if not self.pub.closed:
            self.pub.close(linger=0)
