"""What every part of one server shares: its clocks, its counters, its log throttle.

Why a module of its own: the server's parts (the caller, the collector, the
relay link, the conflicts desk, ...) are objects built with only what they
need.  Almost all of them count, log rate-limited and read the clocks; those
four things are handed to each part as this one small object instead of as
attributes on the server that every part could reach.  Anything else a part
needs (a socket, the core, the access settings, a callback) is a constructor
argument of its own, so that its signature says what it touches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from clone.ratelimit import Throttle

__all__ = ["CLOCK_EVERY", "TURN_BUDGET", "Shared", "Sockets", "peer_endpoint"]

# Wall-time budget of one handler call that drains a socket or streams a
# snapshot chunk.  The count limits alone are not enough: on a loaded host a
# batch of 1000 took up to 190 ms of wall time, and timers (HUGZ) waited for it.
TURN_BUDGET = 0.01
CLOCK_EVERY = 64  # a draining handler reads the clock once per this many messages


def peer_endpoint(host_port: str, offset: int) -> str:
    """The endpoint of a peer's or upstream's socket: its base port ``host:port``
    plus ``offset`` (SNAPSHOT_OFFSET, PUBLISHER_OFFSET, COLLECTOR_OFFSET)."""
    host, _, port = host_port.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


@dataclass(slots=True, eq=False)
class Shared:
    """The clocks, counters and throttle of one server.

    ``clock`` (monotonic seconds) times every deadline; ``wallclock`` (Unix
    seconds) only stamps what is shown or stored as a date.  ``counters`` is
    the server's one dict of counters (``CloneServer.stats`` reports it); a
    part only adds to the keys it owns.
    """

    throttle: Throttle
    clock: Callable[[], float] = time.monotonic
    wallclock: Callable[[], float] = time.time
    counters: dict[str, int] = field(default_factory=dict)


class Sockets(Protocol):
    """How a part opens the sockets it owns: the server's defaults (linger 0,
    the size caps, CURVE as the security settings say) and the server's loop.

    A part closes what it opened with :meth:`forget` (a stream) or
    ``close(linger=0)`` (a bare socket); the server closes every stream that
    is left at its stop.
    """

    def socket(self, kind: int) -> zmq.Socket[Any]:
        """A socket that connects out (to the peer or an upstream)."""

    def stream(self, sock: zmq.Socket[Any], handler: Callable[[list[bytes]], None]) -> ZMQStream:
        """``sock`` read on the loop: ``handler`` gets each message (guarded:
        a bug is logged and counted, never fatal)."""

    def forget(self, stream: ZMQStream) -> None:
        """Stop reading ``stream`` and close its socket."""
