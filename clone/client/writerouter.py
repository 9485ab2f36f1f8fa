"""WriteRouter: where a replica-less writer's writes go, and when the pair is dead.

How this works: a write-only client (:mod:`clone.client.writeonly`) hears
each server's HUGZ and probes the servers' ports when none is active; this
module turns those facts into decisions (the current server, forget a silent
one, give up on a dead pair), with ``now`` given.  Pure: no sockets, no clock;
:class:`~clone.client.writelink.WriteLink` moves the frames.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["WriteRouter"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WriteRouter:
    """Where each write goes and when it has failed; pure (``now`` is given).

    ``heard(i, now)``: server ``i`` sent HUGZ.  ``current``: the server writes
    go to (None: none is known active).  A server is active while heard within
    ``server_timeout``; the pair is dead when no server was heard for
    ``dead_after`` (counted from the start, or from the last HUGZ), or sooner,
    after ``server_timeout``, when every server *refused* a connection since
    it was last heard (``probed(i, refused=True)``: no process listens there,
    a certainty that silence is not).  So a Spark partition that starts after
    the pair died gives up in about a second instead of waiting ``dead_after``.
    """

    servers: int
    server_timeout: float
    dead_after: float
    started: float
    current: int | None = None
    last_heard: list[float | None] = field(default_factory=list)
    refused: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.last_heard = [None] * self.servers
        self.refused = [False] * self.servers

    def heard(self, index: int, now: float) -> bool:
        """Record a HUGZ; True when ``index`` becomes the current server."""
        self.last_heard[index] = now
        self.refused[index] = False
        if self.current is None:
            self.current = index
            return True
        return False

    def not_active(self, index: int) -> None:
        """Server ``index`` said it is not active: stop writing to it."""
        self.last_heard[index] = None
        if self.current == index:
            self.current = None

    def tick(self, now: float) -> None:
        """Forget a current server silent for ``server_timeout``."""
        if self.current is not None:
            last = self.last_heard[self.current]
            if last is None or now - last > self.server_timeout:
                log.warning("server %d silent for %.1f s: waiting for an active one",
                            self.current, self.server_timeout)  # fmt: skip
                self.current = None

    def probed(self, index: int, *, refused: bool) -> None:
        """A connection to server ``index`` was refused, or accepted."""
        self.refused[index] = refused

    def dead(self, now: float) -> bool:
        """No server heard for ``dead_after`` seconds, or every server
        refusing connections and none heard for ``server_timeout``."""
        if self.current is not None:
            return False
        heard = [t for t in self.last_heard if t is not None]
        silent = now - (max(heard) if heard else self.started)
        if all(self.refused):
            return silent > min(self.server_timeout, self.dead_after)
        return silent > self.dead_after
