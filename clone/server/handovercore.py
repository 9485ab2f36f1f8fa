"""The handover at a graceful stop, as a table: pure, no clock, no sockets.

Why: an active server used to answer SIGTERM by closing every socket at once.
Whatever it had applied but not yet got to its passive -- a commit still in
flight, KVPUBs still in libzmq's queue, the passive a few messages behind
under load -- stayed on its own disk only.  The passive took over without it
(measured: a rolling-restart drill with 4 clients at 200 writes/s, the
SIGTERM'd active at sequence 9547 and the passive taking over at 9546), and
when the old active came back its writes came back as a split brain's heal:
late, after newer ones, so clients saw a write twice and one writer's writes
out of order (the rolling-restart drill failed CI on exactly that).  An
operator's stop of the active is the everyday way to move the service (an
upgrade, a reboot), so it must lose nothing the passive could have had.

How this works: when asked to stop while active, with a live passive that
reports its sequence (a durable peer's Binary Star rank), the server

1. ``DRAINING``: stops reading client writes (the collector; they reach the
   passive too, which parks them and applies them at its promotion) and waits
   until every update it applied is committed and published;
2. ``CONFIRMING``: sends a HUGZ at once (the passive announces its state on
   every HUGZ, so its sequence comes back in a round trip instead of at its
   next heartbeat) and waits until the passive reports our sequence;
3. ``DONE``: the stop goes on as before (every socket closed, exit).

Any other stop (a standalone server, a passive, a peer that is gone, not
passive, or in memory and so reports no sequence) is done at once.  The peer
lost, or the server no longer active, ends the wait; so does the time limit
(``--handover-timeout``), after which the stop goes on as it always did and
the passive's pending list and the clients' resends cover what it lacks.
A second stop request while handing over ends it at once.

Each event returns the next phase and the one action the I/O layer
(:mod:`.handover`) takes; a pair not in the table changes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "TABLE", "Action", "Event", "HandoverCore", "PeerView", "Phase", "stop_event", "watch_event",
]  # fmt: skip


class Phase(enum.Enum):
    SERVING = "serving"  # no stop asked yet
    DRAINING = "draining"  # client writes held; waiting until all applied is published
    CONFIRMING = "confirming"  # waiting for the passive to report our sequence
    DONE = "done"  # the stop goes on


class Event(enum.Enum):
    STOP_PAIRED = "stop-paired"  # stop asked; active, the passive alive and ranked
    STOP_ALONE = "stop-alone"  # stop asked; nobody to hand over to
    PUBLISHED = "published"  # every update applied so far is committed and published
    CAUGHT_UP = "caught-up"  # the passive reports our sequence
    PEER_LOST = "peer-lost"  # the peer died, is no longer passive, or we are no longer active
    TIMED_OUT = "timed-out"  # --handover-timeout passed
    ASKED_AGAIN = "asked-again"  # a second stop request: stop now


class Action(enum.Enum):
    NONE = "none"
    HOLD_WRITES = "hold-writes"  # stop reading client writes; wait for publication
    ANNOUNCE = "announce"  # send a HUGZ now and watch the peer's sequence
    FINISH = "finish"  # go on with the stop


_P, _E, _A = Phase, Event, Action

#: (phase, event) -> (next phase, action).  Pairs not listed leave the phase
#: as it is and do nothing (a late publication after a timeout, say).
TABLE: dict[tuple[Phase, Event], tuple[Phase, Action]] = {
    (_P.SERVING, _E.STOP_PAIRED): (_P.DRAINING, _A.HOLD_WRITES),
    (_P.SERVING, _E.STOP_ALONE): (_P.DONE, _A.FINISH),
    (_P.DRAINING, _E.PUBLISHED): (_P.CONFIRMING, _A.ANNOUNCE),
    (_P.DRAINING, _E.PEER_LOST): (_P.DONE, _A.FINISH),
    (_P.DRAINING, _E.TIMED_OUT): (_P.DONE, _A.FINISH),
    (_P.DRAINING, _E.ASKED_AGAIN): (_P.DONE, _A.FINISH),
    (_P.CONFIRMING, _E.CAUGHT_UP): (_P.DONE, _A.FINISH),
    (_P.CONFIRMING, _E.PEER_LOST): (_P.DONE, _A.FINISH),
    (_P.CONFIRMING, _E.TIMED_OUT): (_P.DONE, _A.FINISH),
    (_P.CONFIRMING, _E.ASKED_AGAIN): (_P.DONE, _A.FINISH),
}


@dataclass(frozen=True, slots=True)
class PeerView:
    """What the server knows of itself and its peer at one moment."""

    active: bool  # we are the active server
    peer_alive: bool  # Binary Star counts the peer alive
    peer_passive: bool  # its last state message said PASSIVE
    peer_sequence: int | None  # the sequence of its rank (None: it sends none)


def stop_event(view: PeerView | None, timeout: float) -> Event:
    """Whether a stop asked now has a passive to hand over to (``view`` None:
    the server is not paired)."""
    if (
        timeout > 0
        and view is not None
        and view.active
        and view.peer_alive
        and view.peer_passive
        and view.peer_sequence is not None
    ):
        return Event.STOP_PAIRED
    return Event.STOP_ALONE


def watch_event(view: PeerView, ours: int) -> Event | None:
    """While confirming: the passive holds ``ours`` (our sequence), or it is
    lost, or nothing yet (None)."""
    if not (view.active and view.peer_alive and view.peer_passive) or view.peer_sequence is None:
        return Event.PEER_LOST
    if view.peer_sequence >= ours:
        return Event.CAUGHT_UP
    return None


class HandoverCore:
    """The phase, and what each event makes of it."""

    __slots__ = ("last_event", "phase")

    def __init__(self) -> None:
        self.phase = Phase.SERVING
        self.last_event: Event | None = None

    def handle(self, event: Event) -> Action:
        nxt = TABLE.get((self.phase, event))
        if nxt is None:
            return Action.NONE
        self.phase, action = nxt
        self.last_event = event
        return action

    @property
    def running(self) -> bool:
        """A handover is under way: the server is still up but on its way out."""
        return self.phase in (Phase.DRAINING, Phase.CONFIRMING)
