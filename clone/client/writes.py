"""How the agent publishes writes, and keeps confirmed ones until they are seen.

How this works: a write before the first snapshot is held (a PUB drops what it
cannot deliver, and until a server has answered us we cannot know that ours
reaches one).  Nor does a snapshot show it: it comes on another connection,
and our PUB drops writes until the collector's subscription reaches it.  So
after each sync (and after our PUB reconnects) the first write goes alone, as
a probe, resent until the current server republishes it, and the writes after
it are held behind it, in order (:meth:`AgentState._probe`).  A confirmed
write is remembered by uuid until the current server republishes it, and sent
again (same uuid: servers deduplicate) every ``resend_interval`` and after
every resync, until it is seen or expires.  These are not table rows: a write
is a command from the application, not an event from a server, and resends
are a timer, the same in every state.  A mixin over
:class:`~clone.client.state.AgentState`; sans-IO.
"""

from __future__ import annotations

import logging

from clone.client.actions import (
    Action,
    Refused,
    SendUpdate,
    SplitConflicted,
    State,
)
from clone.client.state import (
    _NEVER,
    SPLIT_HOLD_MAX,
    AgentState,
    _Pending,
)
from clone.wire.codec import KVMsg
from clone.wire.control import Refusal

__all__ = ["Writes"]

log = logging.getLogger(__name__)


class Writes(AgentState):
    """Publishing, holding, resending and expiring the application's writes."""

    def write(
        self,
        msg: KVMsg,
        now: float,
        *,
        confirm_within: float | None,
        frames: list[bytes] | None = None,
    ) -> list[Action]:
        """Publish a client update; with ``confirm_within``, track it until
        confirmed.  ``frames``: ``msg`` as already encoded, sent as they are.

        Held, not sent: before the first snapshot, and while another server
        than ours shows itself active too (:meth:`split_seen`).
        """
        held = (
            not self.counters.snapshots
            or self.split_seen(now)
            or self._collector_unproven()
            or bool(self._held)  # behind earlier ones: in order
        )
        if confirm_within is not None:
            if not msg.uuid:
                raise ValueError("a confirmed write needs a uuid")
            next_send = _NEVER if held else now + self.config.resend_interval
            self._pending[msg.uuid] = _Pending(msg, now + confirm_within, next_send)
        if held:
            # Until the first snapshot we cannot know that our PUB reaches any
            # collector (a PUB drops what it cannot deliver); hold the writes.
            self._held.append(msg)
            if not self.counters.snapshots:
                return []
            # Out at once if nothing holds it but a proof (as the probe, or
            # released by one): with the frames the frontend built.
            return [
                SendUpdate(msg, frames) if a == SendUpdate(msg) else a
                for a in self._release_held(now)
            ]
        return [SendUpdate(msg, frames)]

    def split_seen(self, now: float) -> bool:
        """Whether two servers show themselves active now (ours, and another
        within the last :meth:`_split_window`): a split brain is healing.  Our
        write would reach both, and the one we do not follow applies it as a
        fresh write, ahead of what its peer forwards (docs/failover.md,
        "Writes of a split brain"); so writes wait until one of them steps down:
        we either fail over (the sync sends them) or stay (:meth:`_release_held`)."""
        seen = self.other_active_at
        return (
            seen is not None
            and now - seen < self._split_window()
            and now - self.other_active_since < SPLIT_HOLD_MAX
        )

    def _release_held(self, now: float) -> list[Action]:
        """Held writes go out once nothing holds them any more (tick)."""
        if self.split_seen(now) or self.state is not State.ACTIVE:
            return []
        if self._collector_unproven() and not self._give_up_proof(now):
            return self._probe(now)
        released, self._held = self._held, []
        for msg in released:
            pending = self._pending.get(msg.uuid)
            if pending is not None:
                pending.next_send = now + self.config.resend_interval
        if self.other_active_at is not None:  # (else held for a proof only)
            self.counters.split_held_writes += len(released)
        self._probing_since = None
        return [SendUpdate(msg) for msg in released]

    def _give_up_proof(self, now: float) -> bool:
        """Whether to stop waiting for a probe's republication: a copy the
        server deduplicated is never republished (its first was, and we missed
        it), so after ``server_timeout`` the writes go out unproven, as they
        did before probes, rather than being held for ever."""
        since = self._probing_since
        if since is None or now - since < self.config.server_timeout:
            return False
        self.counters.collector_unproven += 1
        log.warning(
            "no write of ours republished by %s within %.1f s; sending %d held writes anyway",
            None if self.current is None else self.servers[self.current],
            self.config.server_timeout,
            len(self._held),
        )
        self._collector_proven = self.current
        return True

    def refused(self, server: int, refusal: Refusal, now: float) -> list[Action]:
        """A refusal notice: fail the confirmed write it names at once.

        Only the current server's notices count (the one whose republication
        would have confirmed the write); a fire-and-forget write, or one we
        gave up on, has nobody waiting: the notice is only counted.
        """
        self.counters.refusals += 1
        if refusal.reason == "conflict":
            return self._split_conflict(refusal.uuid)
        if server != self.current:
            self.counters.foreign += 1
            return []
        self._note_republished(refusal.uuid)  # refused, but it reached the collector
        pending = self._pending.pop(refusal.uuid, None) if refusal.uuid else None
        if pending is None:
            log.debug("server refused a write we do not wait on (%s)", refusal.reason)
            return []
        self.counters.refused_writes += 1
        return [Refused(refusal.uuid, refusal.reason, pending.msg.key)]

    def _split_conflict(self, uuid: bytes) -> list[Action]:
        """A split brain's loser says its write ``uuid`` became a conflict.

        From whichever server: it comes from the one that stepped down, no
        longer ours.  Every client hears it (the loser cannot name the
        writer): only a uuid of ours counts.  Still waited on: failed (the
        application's wait raises); confirmed lately: an event.
        """
        pending = self._pending.pop(uuid, None) if uuid else None
        if pending is not None:
            self.counters.split_conflicts += 1
            return [Refused(uuid, "conflict", pending.msg.key)]
        key = self._confirmed_lately.pop(uuid, None) if uuid else None
        if key is None:
            return []
        self.counters.split_conflicts += 1
        return [SplitConflicted(uuid, key)]

    def forget(self, uuid: bytes) -> None:
        """The application gave up waiting for this write."""
        self._pending.pop(uuid, None)

    def _resend_due(self, now: float) -> list[Action]:
        """Expire confirmed writes past their deadline; resend those due."""
        actions: list[Action] = []
        for uuid, p in list(self._pending.items()):
            if now >= p.expires_at:
                del self._pending[uuid]
                self.counters.expired_writes += 1
                # The caller's ConfirmTimeout says so already: not a warning twice.
                log.debug("gave up on confirmed write to %r: not republished", p.msg.key)
            elif now >= p.next_send and not p.published:
                p.next_send = now + self.config.resend_interval
                self.counters.resent += 1
                actions.append(SendUpdate(p.msg))
        return actions
