"""Exceptions raised by the Binary Star package.

Everything derives from :class:`BinaryStarError`, so an application can catch the
whole package's failures in one ``except`` clause. API misuse (a bad heartbeat, a
negative count) raises the built-in ``ValueError``/``TypeError`` instead: those are
bugs in the caller, not conditions to handle at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bstar.fsm import Event, State

__all__ = [
    "BinaryStarError",
    "IllegalTransitionError",
    "PeerNumberOutOfRange",
    "PeerStateError",
    "RoleConflictError",
]


class BinaryStarError(Exception):
    """Root of every error raised by the ``bstar`` package."""


class IllegalTransitionError(BinaryStarError):
    """An event arrived that the transition table has no rule for in this state.

    The state machine is left unchanged, so the caller can log and carry on.
    """

    def __init__(self, state: State, event: Event, reason: str) -> None:
        super().__init__(f"illegal event {event.name} in state {state.name}: {reason}")
        self.state = state
        self.event = event
        self.reason = reason


class RoleConflictError(IllegalTransitionError):
    """The peer announced the same configured role as ours (two primaries or two backups).

    No tie-break is possible, because the tie-breaks rely on the roles being
    different; this is a deployment mistake that an operator has to fix.
    """


class PeerStateError(BinaryStarError):
    """A state message from the peer could not be decoded.

    ``source`` names where the message came from (usually the peer endpoint), so
    that a log line points at the culprit.
    """

    def __init__(self, reason: str, source: str = "peer") -> None:
        super().__init__(f"bad state message from {source}: {reason}")
        self.reason = reason
        self.source = source


class PeerNumberOutOfRange(PeerStateError):
    """A state message's epoch, term or sequence is above :data:`bstar.fsm.MAX_EPOCH`.

    Refused rather than clamped: a peer cannot have counted that far, so it is
    broken or hostile, and obeying it would push our own epoch past what the
    wire and the database carry.
    """
