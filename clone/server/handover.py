"""The handover at a graceful stop, on the loop: thin I/O around :mod:`.handovercore`.

An active server asked to stop (SIGTERM, SIGINT, ``stop()``) with a live,
durable passive first makes sure the passive holds everything it applied,
for at most ``--handover-timeout`` seconds, then stops as before.  The table
and why it exists are in :mod:`.handovercore`; this part runs its actions:
holding the collector, waiting for publication through the durability part,
sending a HUGZ, watching Binary Star's view of the peer on a short poll, and
the deadline.  Every wait is on the server's one clock (``call_later`` with a
delay computed from it), so a fake clock moves them.

Nothing here blocks the loop: a stop with a passive in step takes one round
trip on the pair's link (a few milliseconds on a LAN), and a stuck one costs
the timeout, after which the stop goes on as it always did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tornado.ioloop import IOLoop

from clone.server.handovercore import Action, Event, HandoverCore, PeerView, stop_event, watch_event

__all__ = ["WATCH_EVERY", "Handover"]

log = logging.getLogger("clone.server.reactor")

#: Seconds between two looks at the passive's reported sequence while
#: confirming: its answer to our HUGZ comes in about a millisecond on loopback.
WATCH_EVERY = 0.002


class Handover:
    """Hand the passive what we applied before a stop (a part of the server).

    Built with callables, so that it sees no more of the server than it uses:
    ``view`` (None unless paired and able to write), ``sequence`` (our
    store's), ``hold_writes`` (stop reading client writes), ``when_published``
    (run a callback once every applied update is committed and published),
    ``announce`` (send a HUGZ now) and ``finish`` (go on with the stop; run
    on the loop's next turn, never from inside :meth:`begin`).
    """

    def __init__(
        self,
        timeout: float,
        clock: Callable[[], float],
        loop: Callable[[], IOLoop | None],
        *,
        view: Callable[[], PeerView | None],
        sequence: Callable[[], int],
        hold_writes: Callable[[], None],
        when_published: Callable[[Callable[[], None]], None],
        announce: Callable[[], None],
        finish: Callable[[], None],
    ) -> None:
        self._timeout = timeout
        self._clock = clock
        self._loop = loop
        self._view = view
        self._sequence = sequence
        self._hold_writes = hold_writes
        self._when_published = when_published
        self._announce = announce
        self._finish = finish
        self._core = HandoverCore()
        self._started = 0.0
        #: Seconds the handover took (0 without one): the stop's later waits
        #: share one budget with it (clone.server.durability.STOP_WAIT).
        self.spent = 0.0
        # The deadline's timeout and the next look at the peer's sequence.
        self._timers: dict[str, object] = {}

    @property
    def running(self) -> bool:
        """The server is handing over: up, but no longer taking client writes."""
        return self._core.running

    def begin(self) -> bool:
        """A stop was asked: True if the server must wait (a handover began,
        and ``finish`` will be called), False if it may stop now."""
        core = self._core
        if core.running:
            core.handle(Event.ASKED_AGAIN)
            self._done(finish=False)  # the caller stops now
            return False
        view = self._view()
        action = core.handle(stop_event(view, self._timeout))
        if action is not Action.HOLD_WRITES:
            return False
        assert view is not None
        self._started = self._clock()
        log.info(
            "stopping: handing over to the passive first (we are at sequence %d, it reports %s;"
            " at most %.3f s)",
            self._sequence(),
            view.peer_sequence,
            self._timeout,
        )
        self._after("deadline", self._timeout, lambda: self._handle(Event.TIMED_OUT))
        self._run(action)
        return True

    # -- events ------------------------------------------------------------------

    def _handle(self, event: Event) -> None:
        self._run(self._core.handle(event))

    def _run(self, action: Action) -> None:
        if action is Action.HOLD_WRITES:
            self._hold_writes()
            self._when_published(lambda: self._handle(Event.PUBLISHED))
        elif action is Action.ANNOUNCE:
            self._announce()
            self._watch()
        elif action is Action.FINISH:
            self._done()

    def _watch(self) -> None:
        """Look at the passive's reported sequence now and every
        :data:`WATCH_EVERY` until it holds ours or the handover ends."""
        if not self._core.running:
            return
        view = self._view()
        event = Event.PEER_LOST if view is None else watch_event(view, self._sequence())
        if event is None:
            self._after("watch", WATCH_EVERY, self._watch)
            return
        self._handle(event)

    def _done(self, *, finish: bool = True) -> None:
        loop = self._loop()
        if loop is not None:
            for timer in self._timers.values():
                loop.remove_timeout(timer)
        self._timers.clear()
        self.spent = max(0.0, self._clock() - self._started)
        took_ms = self.spent * 1000
        view = self._view()
        theirs = None if view is None else view.peer_sequence
        why = self._core.last_event
        if why is Event.CAUGHT_UP:
            log.info("handed over in %.1f ms: the passive holds sequence %s", took_ms, theirs)
        else:
            reason = {
                Event.TIMED_OUT: f"not done within --handover-timeout {self._timeout:.3f} s",
                Event.PEER_LOST: "the peer is gone, or no longer passive",
                Event.ASKED_AGAIN: "a second stop request",
            }.get(why, str(why)) if why is not None else "unknown"
            log.warning(
                "stopping without a complete handover (%s, after %.1f ms): we are at sequence %d,"
                " the passive reported %s; what it lacks comes back from its pending list and"
                " the clients' resends (docs/failover.md, 'Stopping the active')",
                reason,
                took_ms,
                self._sequence(),
                theirs,
            )
        if finish and loop is not None:
            loop.add_callback(self._finish)

    def _after(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is not None:
            self._timers[name] = loop.call_later(delay, callback)
