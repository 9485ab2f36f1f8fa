"""After a split brain: send the active peer the writes we confirmed that it lacks.

How this works: :mod:`clone.server.split` decides, at the end of the resync
that follows a demotion, which of our writes the winner cannot hold; this part
sends them as ``set`` calls on a DEALER to the winner's snapshot port (the
port that answers calls), takes each REPLY, resends the unanswered ones every
second (a call is deduplicated by its uuid, so a resend is harmless) and gives
up after a minute, loudly: those writes are then lost unless their clients
resend them.  A ``not-active`` answer is kept for the next resend.  If we are
elected again before the last answer, we apply what is left ourselves.

Everything here is counted (``split_writes_*``) and logged at WARNING: a split
brain is an incident an operator wants to read about.
"""

from __future__ import annotations

import logging

import zmq

from clone.errors import ProtocolError
from clone.server.base import ServerBase, log, peer_endpoint
from clone.server.core import Role
from clone.wire.calls import Reply, decode_call, decode_reply
from clone.wire.control import encode_refusal
from clone.wire.protocol import SNAPSHOT_OFFSET

#: The topic of notices for whichever client wrote the uuid (a relay's too).
ANY_WRITER = "*"

__all__ = ["HealingMixin"]

_RESEND = 1.0  # seconds between resends of unanswered writes
_GIVE_UP = 60.0  # seconds before the unanswered ones are given up


class HealingMixin(ServerBase):
    """Forward a demoted active's split-brain writes to the winner."""

    def _forward_split_writes(self) -> None:
        """Synced after a demotion: start sending what the core kept."""
        core = self.core
        if core.split_unverified:
            log.warning(
                "stepped down after a split brain, but the active at %s did not say"
                " where it was elected (a peer without KVAPPLIED fork=): %d updates of"
                " our term may be missing there and were not resent",
                self._followed,
                core.split_unverified,
            )
            core.split_unverified = 0
        calls, core.split_calls = core.split_calls, []
        if not calls:
            return
        for frames in calls:
            self._split_pending[frames[2]] = frames
        self._split_conflicts_this_heal = 0
        self._split_give_up = self._clock() + _GIVE_UP
        log.warning(
            "stepped down after a split brain: sending the active at %s the %d writes"
            " we confirmed that it does not hold",
            self._followed,
            len(calls),
        )
        self._send_split_writes()

    def _send_split_writes(self) -> None:
        followed = self._followed
        if followed is None:
            return
        if self._split_dealer is None:
            dealer = self._socket(zmq.DEALER)
            dealer.connect(peer_endpoint(followed, SNAPSHOT_OFFSET))
            self._split_dealer = self._stream(dealer, self._on_split_reply)
        # Through the stream, not the raw socket: the stream looks at the
        # socket's events after it sends, so a REPLY that arrives during a
        # send is still read (a raw send can consume the edge announcing it,
        # and an unread message stops libzmq signalling the ones after it).
        stream = self._split_dealer
        self._split_sent = self._clock()
        for frames in list(self._split_pending.values()):
            stream.send_multipart(frames)

    def _check_split_writes(self) -> None:
        """Housekeeping: resend what is unanswered, or give it up."""
        if not self._split_pending:
            return
        now = self._clock()
        if now >= self._split_give_up:
            left = len(self._split_pending)
            keys = [decode_call(f).key for f in list(self._split_pending.values())[:5]]
            self.counters["split_writes_abandoned"] += left
            log.error(
                "gave up sending %d writes of the split brain to the active at %s after"
                " %.0f s: they are lost unless their clients write them again (first keys: %s)",
                left,
                self._followed,
                _GIVE_UP,
                ", ".join(keys),
            )
            self._split_pending.clear()
            self._close_split()
        elif now - self._split_sent >= _RESEND:
            self.counters["split_writes_resent"] += len(self._split_pending)
            self._send_split_writes()

    def _on_split_reply(self, frames: list[bytes]) -> None:
        try:
            reply = decode_reply(frames)
        except ProtocolError as exc:
            self._throttle.log(
                "split_reply", logging.WARNING, "dropped a reply from the active peer: %s", exc
            )
            return
        sent = self._split_pending.get(reply.uuid)
        if sent is None or (not reply.ok and reply.reason == "not-active"):
            return  # answered already, or to be resent
        del self._split_pending[reply.uuid]
        self._tally_split_write(reply, sent)
        if not self._split_pending:
            self._heal_done()
            self._close_split()

    def _apply_split_writes_here(self) -> None:
        """Elected again before the winner answered them all: ours to apply."""
        if not self._split_pending:
            return
        now = self._wallclock()
        assert self.core.role is Role.ACTIVE
        for frames in self._split_pending.values():
            reply, _ = self.core.on_call(frames, now, peer=True)
            if reply is not None:
                self._tally_split_write(reply, frames)
        self._split_pending.clear()
        self._close_split()

    def _tally_split_write(self, reply: Reply, frames: list[bytes]) -> None:
        if reply.ok:
            self.counters["split_writes_applied"] += 1
            return
        if reply.status == "conflict" and reply.reason == "split":
            # Kept by the active as a conflict: its writer was told it was
            # applied, so tell it now (best effort; logged once per heal).
            self.counters["split_writes_conflicts"] += 1
            self._split_conflicts_this_heal += 1
            self._publish(encode_refusal(ANY_WRITER, reply.uuid, "conflict"))
            return
        self.counters["split_writes_refused"] += 1
        log.warning(
            "the active refused a write of ours from the split brain (%s: %s): key %r",
            reply.reason,
            reply.detail,
            decode_call(frames).key[:80],
        )

    def _heal_done(self) -> None:
        """Every write answered: one line for the whole heal."""
        if self._split_conflicts_this_heal:
            log.warning(
                "the active at %s kept %d of our split-brain writes as conflicts (not"
                " applied: it had changed their keys); their writers were told, and"
                " `clone conflicts` on it lists them",
                self._followed,
                self._split_conflicts_this_heal,
            )
            self._split_conflicts_this_heal = 0

    def _close_split(self) -> None:
        dealer, self._split_dealer = self._split_dealer, None
        if dealer is not None:
            self._forget(dealer)
