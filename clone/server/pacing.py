"""The split writes a server still has to deliver, and how many to touch per loop turn.

How this works: after a split brain the server that stepped down may hold tens
of thousands of writes for the winner (docs/failover.md, "Writes of a split
brain").  Handled at once they block its loop: no heartbeat, no signal, more
split brains (a drill saw 50 s).  So they go through a :class:`SplitQueue`,
oldest first, and the reactor (:mod:`clone.server.healing`) asks it for a
bounded slice per loop turn:

* while passive, :meth:`SplitQueue.sends` says which calls to send to the
  winner now: at most ``max_in_flight`` unanswered at once (a reply frees a
  slot), plus the unanswered ones last sent ``resend`` seconds ago or more (a
  call is deduplicated by its uuid, so a resend is harmless); and
  :func:`send_allowance` keeps the loser from running ahead of its own
  following of the winner: every write the winner applies comes back to the
  loser as a KVPUB, and a loser that sends faster than it follows overflows
  its subscription, misses updates and resyncs again and again;
* elected again, :meth:`SplitQueue.take` hands the next ones to apply here;
* :meth:`SplitQueue.stalled` says when calls in flight got no answer for
  ``give_up`` seconds: the rest is then given up (a big backlog that is
  answered steadily is never given up for being big, nor one held back while
  the loser resyncs).

Sans-IO: frames, uuids and ``now`` in; frames (as tuples) out.  The frames are
a ``set`` call's (:mod:`clone.wire.calls`): the uuid is ``frames[2]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = [
    "SPLIT_APPLY_SLICE",
    "SPLIT_CONVERT_SLICE",
    "SPLIT_CONVERT_STEP",
    "SPLIT_GIVE_UP",
    "SPLIT_IN_FLIGHT",
    "SPLIT_RESEND",
    "SPLIT_SEND_STEP",
    "SplitQueue",
    "send_allowance",
]

#: Calls sent to the winner and not yet answered, at most: the winner answers
#: about one per loop turn, so more in flight would only queue in its socket.
SPLIT_IN_FLIGHT = 256
#: Seconds before an unanswered call is sent again.
SPLIT_RESEND = 1.0
#: Seconds without any answer before what is left is given up.
SPLIT_GIVE_UP = 60.0
#: Calls converted ahead of sending or applying, at most (the queue's unsent).
SPLIT_CONVERT_SLICE = 2_000
#: Kept writes turned into calls per step of a turn (about 3 µs each on an idle
#: machine); the turn ends at its time budget.
SPLIT_CONVERT_STEP = 128
#: Calls applied here per step of a turn; the turn ends at its time budget.
SPLIT_APPLY_SLICE = 64
#: Calls sent per step of a turn (each is a ZMQStream send and a callback of
#: its own); the turn ends at its time budget.
SPLIT_SEND_STEP = 32

# Held as tuples: a tuple of bytes is untracked by the garbage collector, and
# 100,000 lists would make each full collection a loop stall of its own.
_Frames = tuple[bytes, ...]


class SplitQueue:
    """Calls not yet answered: unsent ones in order, in-flight ones with when sent."""

    __slots__ = (
        "_give_up",
        "_heard",
        "_in_flight",
        "_max_in_flight",
        "_resend",
        "_unsent",
        "answered_up_to",
        "resent",
    )

    def __init__(
        self,
        max_in_flight: int = SPLIT_IN_FLIGHT,
        resend: float = SPLIT_RESEND,
        give_up: float = SPLIT_GIVE_UP,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        if resend <= 0 or give_up <= 0:
            raise ValueError("resend and give_up must be positive")
        self._max_in_flight = max_in_flight
        self._resend = resend
        self._give_up = give_up
        # uuid -> frames, oldest first; a dict: a call queued twice is one call.
        self._unsent: dict[bytes, _Frames] = {}
        # uuid -> (frames, last sent); oldest send first (a resend moves it last).
        self._in_flight: dict[bytes, tuple[_Frames, float]] = {}
        # Since when calls in flight have waited without any answer (the last
        # answer, or the send that put calls in flight when none were).
        self._heard = 0.0
        #: Calls sent again because no answer came within ``resend`` seconds.
        self.resent = 0
        #: The highest sequence an answer said a call got (since the last restart).
        self.answered_up_to = 0

    def __len__(self) -> int:
        return len(self._unsent) + len(self._in_flight)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def unsent(self) -> int:
        return len(self._unsent)

    def add(self, calls: Iterable[Sequence[bytes]], now: float) -> int:
        """Queue ``calls`` after those already queued; returns how many were new."""
        unsent, in_flight = self._unsent, self._in_flight
        added = 0
        for frames in calls:
            uuid = frames[2]
            if uuid not in unsent and uuid not in in_flight:
                unsent[uuid] = tuple(frames)
                added += 1
        return added

    def sends(self, now: float, limit: int) -> list[_Frames]:
        """The calls to send now, at most ``limit``: due resends first, then
        new ones while fewer than ``max_in_flight`` are unanswered."""
        out: list[_Frames] = []
        in_flight = self._in_flight
        if not in_flight:
            self._heard = now  # waiting starts now, if anything is sent
        due = now - self._resend
        while in_flight and len(out) < limit:
            uuid = next(iter(in_flight))
            frames, sent = in_flight[uuid]
            if sent > due:
                break  # the rest were sent later still
            del in_flight[uuid]
            in_flight[uuid] = (frames, now)
            out.append(frames)
        self.resent += len(out)
        unsent = self._unsent
        while unsent and len(out) < limit and len(in_flight) < self._max_in_flight:
            uuid = next(iter(unsent))
            frames = unsent.pop(uuid)
            in_flight[uuid] = (frames, now)
            out.append(frames)
        return out

    def restart(self, now: float) -> None:
        """Sending starts again (a new connection to a winner): the give-up
        counts from ``now``, and every call in flight is due for a resend."""
        self._heard = now
        self.answered_up_to = 0
        held = self._in_flight
        self._in_flight = {uuid: (frames, -math.inf) for uuid, (frames, _) in held.items()}

    def answered(self, uuid: bytes, now: float, sequence: int = 0) -> _Frames | None:
        """An answer for ``uuid`` (saying the write got ``sequence``): its call
        (now done), or None if not ours (answered already, or never queued)."""
        held = self._in_flight.pop(uuid, None)
        if held is None:
            frames = self._unsent.pop(uuid, None)
            if frames is None:
                return None
        else:
            frames = held[0]
        self._heard = now
        if sequence > self.answered_up_to:
            self.answered_up_to = sequence
        return frames

    def take(self, limit: int) -> list[_Frames]:
        """Up to ``limit`` calls to apply here, oldest first (in flight, then
        unsent): they leave the queue."""
        out: list[_Frames] = []
        in_flight, unsent = self._in_flight, self._unsent
        while in_flight and len(out) < limit:
            out.append(in_flight.pop(next(iter(in_flight)))[0])
        while unsent and len(out) < limit:
            out.append(unsent.pop(next(iter(unsent))))
        return out

    def stalled(self, now: float) -> bool:
        """Whether calls in flight got no answer for ``give_up`` seconds."""
        return bool(self._in_flight) and now - self._heard >= self._give_up

    def clear(self) -> list[_Frames]:
        """Empty the queue; returns what it held, oldest first."""
        out = [frames for frames, _ in self._in_flight.values()]
        out += self._unsent.values()
        self._in_flight.clear()
        self._unsent.clear()
        return out


def send_allowance(
    answered_up_to: int, following_at: int, max_ahead: int = SPLIT_IN_FLIGHT
) -> int:
    """How many calls a passive loser may send now: ``max_ahead`` less how far
    the winner's answers (``answered_up_to``, a sequence) are ahead of the
    sequence the loser has followed to (``following_at``)."""
    return max(0, max_ahead - max(0, answered_up_to - following_at))
