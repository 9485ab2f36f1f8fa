"""Two server cores wired by hand for split-brain tests: no sockets, explicit times."""

from __future__ import annotations

from clone.server.core import FollowOutcome, ServerCore

__all__ = ["resync"]


def resync(loser: ServerCore, winner: ServerCore, now: float) -> FollowOutcome:
    """The loser asks the winner for a snapshot (with KVAPPLIED, as our servers
    do) and takes every message of it; the outcome of the last one."""
    loser.start_sync()
    stream = winner.open_snapshot(b"peer", "", applied=True, now=now)
    outcome = FollowOutcome.OK
    while not stream.done:
        frames = stream.peek()
        if frames is not None:
            outcome = loser.on_snapshot_reply(list(frames[1:]), now)
            stream.advance()
    return outcome
