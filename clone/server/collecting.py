"""The collector (P+2): client updates, drained in batches per readiness event.

How this works: one :class:`Collector` reads the collector SUB for every kind
of server.  What it does with each KVSET is composed from two settings, given
when it is built, instead of four handlers chosen by the reactor:

* the **security** settings: with CURVE (``judge`` given) each message is read
  with its first frame as an object, whose ZAP User-Id names the writer, and
  the judge (the ACL's write check, :mod:`.security`) lets it through or
  refuses it; without, every write goes through, nameless;
* the **role**: a :class:`Sink` takes what passed.  :class:`Applier` applies
  it to the core (a pair member, a standalone server), and the reactor commits
  and publishes the turn's updates at its end; a relay's sink forwards it to
  the pair instead (:mod:`.relaying`).

A turn reads at most ``batch`` messages and
:data:`~clone.server.budget.COLLECTOR_TURN_BYTES` bytes, and stops early after
:data:`~clone.server.shared.TURN_BUDGET` seconds (or, given a
:class:`~clone.server.turns.TurnBudget`, early enough that the turn's commit
fits in it too), deciding to yield *before* taking the next message, so that
nothing received is left unhandled.  Bad
input is counted and logged rate-limited by the sink; it never stops the loop.
``tests/server/test_collector.py`` drives it alone on a real PUB and SUB.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from clone.errors import LimitExceeded, ProtocolError, StoreFull
from clone.server.budget import COLLECTOR_TURN_BYTES
from clone.server.core import Role, ServerCore
from clone.server.shared import CLOCK_EVERY, TURN_BUDGET, Shared
from clone.server.turns import TurnBudget
from clone.wire.frames import recv_frames, recv_frames_and_first

__all__ = ["Applier", "Collector", "Judge", "Refuse", "Sink"]


#: Whether the sender of a KVSET (its first frame, the frames) may write it,
#: and its name; a refusal is the judge's to count, log and tell.
Judge = Callable[[zmq.Frame, list[bytes]], tuple[bool, "str | None"]]

#: Tell a writer (by name) that its write (by uuid) was refused, and why.
Refuse = Callable[["str | None", bytes, str], None]


class Sink(Protocol):
    """What the collector hands the KVSETs that passed to, one turn at a time."""

    def begin(self) -> None:
        """A turn starts (read once per turn what holds for all of it)."""

    def take(self, frames: list[bytes], writer: str | None) -> None:
        """One KVSET; ``writer`` is its sender's name under CURVE, else None."""

    def end(self) -> None:
        """The turn is over (also when it ends by an exception)."""


class Collector:
    """Drain the collector SUB into a :class:`Sink`, judged if secure."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        shared: Shared,
        sink: Sink,
        *,
        batch: int,
        judge: Judge | None = None,
        turns: TurnBudget | None = None,
    ) -> None:
        self._sock = sock
        self._clock = shared.clock
        self._counters = shared.counters
        self._sink = sink
        self._batch = batch
        self._judge = judge
        self._turns = turns

    @property
    def secure(self) -> bool:
        """Whether messages must be read as frames (for their User-Id): use
        :meth:`on_frames` then, else :meth:`on_message`."""
        return self._judge is not None

    def on_message(self, frames: list[bytes]) -> None:
        """The socket is readable and this is its first message (no CURVE)."""
        sink = self._sink
        sink.begin()
        started = self._clock()
        try:
            sock, stop_at, budget = self._sock, self._stop_at(started), self._batch
            room = COLLECTOR_TURN_BYTES
            while True:
                sink.take(frames, None)
                budget -= 1
                room -= sum(map(len, frames))
                if self._turn_over(budget, stop_at) or self._bytes_over(room):
                    return
                try:
                    frames = recv_frames(sock)
                except zmq.Again:
                    return
        finally:
            self._end(started)

    def on_frames(self, parts: list[zmq.Frame]) -> None:
        """As :meth:`on_message`, under CURVE: each message judged first."""
        judge = self._judge
        assert judge is not None, "a collector without a judge reads bytes"
        sink = self._sink
        sink.begin()
        started = self._clock()
        try:
            sock, stop_at, budget = self._sock, self._stop_at(started), self._batch
            room = COLLECTOR_TURN_BYTES
            first = parts[0]
            frames = [part.bytes for part in parts]
            while True:
                allowed, writer = judge(first, frames)
                if allowed:
                    sink.take(frames, writer)
                budget -= 1
                room -= sum(map(len, frames))
                if self._turn_over(budget, stop_at) or self._bytes_over(room):
                    return
                try:
                    # The fast receive, keeping only the first frame as an object.
                    first, frames = recv_frames_and_first(sock)
                except zmq.Again:
                    return
        finally:
            self._end(started)

    def _stop_at(self, started: float) -> float:
        """When this turn stops reading: with a turn budget, early enough
        that its commit fits in the turn too (clone.server.turns)."""
        turns = self._turns
        return started + TURN_BUDGET if turns is None else turns.drain_until(started)

    def _end(self, started: float) -> None:
        """The sink's end of the turn (a server's commit and publish), timed
        for the turn budget."""
        clock = self._clock
        drained = clock()
        self._sink.end()
        if self._turns is not None:
            self._turns.observe(drained - started, clock() - drained)

    def _bytes_over(self, room: int) -> bool:
        """This turn took its :data:`COLLECTOR_TURN_BYTES` of updates: the rest
        wait for the next turn, after the commit and the heartbeat."""
        if room > 0:
            return False
        self._counters["collector_turns_cut"] += 1
        return True

    def _turn_over(self, budget: int, stop_at: float) -> bool:
        """Out of messages for this turn, or (checked every CLOCK_EVERY
        messages, since a clock read is not free) out of time."""
        return budget <= 0 or (budget % CLOCK_EVERY == 0 and self._clock() > stop_at)


class Applier:
    """A server's sink: apply each KVSET to the core; ``end_turn`` (the
    reactor's commit and publish) after every turn.

    ``refuse`` tells a named writer why its write was refused (only an
    active server does: a passive one parks writes, it does not judge
    them); None when nobody can be named (no CURVE).
    """

    def __init__(
        self,
        core: ServerCore,
        shared: Shared,
        *,
        end_turn: Callable[[], None],
        refuse: Refuse | None = None,
    ) -> None:
        self._core = core
        self._shared = shared
        self._end_turn = end_turn
        self._refuse = refuse

    def begin(self) -> None:
        pass

    def take(self, frames: list[bytes], writer: str | None) -> None:
        shared = self._shared
        try:
            self._core.on_kvset(frames, shared.wallclock(), shared.clock())
        except ProtocolError as exc:
            refuse = self._refuse
            if refuse is None:
                shared.throttle.log("kvset", logging.WARNING, "dropped a client update: %s", exc)
                return
            active = self._core.role is Role.ACTIVE
            if isinstance(exc, StoreFull):
                shared.throttle.log(
                    "kvset_full", logging.WARNING, "refused a write by %s: %s", writer, exc
                )
                if active:
                    refuse(writer, frames[2], "full")
                return
            shared.throttle.log("kvset", logging.WARNING, "dropped a client update: %s", exc)
            if isinstance(exc, LimitExceeded) and active and len(frames) == 5:
                refuse(writer, frames[2], "size")

    def end(self) -> None:
        self._end_turn()
