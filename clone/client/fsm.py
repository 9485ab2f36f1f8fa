"""The client agent's decisions, with no sockets and no clock.

How this works: the agent's I/O loop (:mod:`clone.client.agent`) decodes what arrives from
the servers and feeds it here as events, together with the current time ``now``
(seconds, any monotonic origin).  :class:`AgentFSM` answers with a list of
actions for the loop to carry out: ask a server for a snapshot, publish an update,
tell the application that a key changed, that a confirmed write was seen, or that
the state changed.  Nothing here imports zmq or ``time``, so the unit tests drive
it with a fake clock and hand-made messages.

The states are the Guide's client FSM::

    INITIAL --connect--> SYNCING --all KTHXBAIs--> ACTIVE
                          ^   |  no reply yet: ask again every            |
                          |   |  reask_interval (bounded); no snapshot    |
                          |   |  data within server_timeout, or the       |
                          |   |  connection lost: next server; no data    |
                          |   |  yet and another server shows itself      |
                          |   |  active (ACTIVE_ELSEWHERE): that server   |
                          +---+--- silence / gap / connection lost -------+

How a dead server is noticed, two ways:

* Its connection breaks (SERVER_DISCONNECTED): a process that dies, even by
  ``kill -9``, has its TCP connections closed by its kernel at once.  The I/O
  loop watches the SUB socket of every server with a zmq socket monitor and
  reports the loss; if it is the current server we fail over at once, as if
  ``server_timeout`` had expired.  This is what makes a crash cost well under a
  heartbeat on the client's side.
* Silence (SILENCE): a process that is frozen (SIGSTOP, a paused VM) or cut off
  by a partition keeps its connections; only ``server_timeout`` without a message
  tells.

While syncing, a snapshot request may simply be refused: Binary Star drops the
vote of a passive server whose peer still looks alive, which is what a backup
does for a client that noticed the primary's death before the backup did.  So
until snapshot data arrives we ask again (REASK) every ``reask_interval`` on a
fresh DEALER, at most ``requests_per_server`` requests per round; if no snapshot
data has come within ``server_timeout`` of the round's start we move on to the
next server.  HUGZ or updates from a server that does not answer our request do
not keep us there.

Another server that shows itself active does move us, at once (ACTIVE_ELSEWHERE):
a failed-over pair's old primary comes back passive, and a client that lists it
first would otherwise wait out ``server_timeout`` before asking the new active
server.  Only the active server of a pair publishes KVPUBs, and our servers send
HUGZ only while active and say their heartbeat in them (the Guide's passive
servers send bare HUGZ too, so bare ones do not count).  So while syncing, with no
snapshot data yet, such a message from another server makes it the current one
and we ask it for the snapshot: within one of its heartbeats, whatever the order
of the servers.  Two rules keep this from flapping (two actives in a split brain
both heartbeat):

* a current server that itself showed itself active this round is never left
  for another one: it is no less the active one, only slower to answer;
* the server we switched to counts as having shown itself, so at most one such
  switch happens per round, and the server switched to keeps us for a whole
  round (``server_timeout``), as after any failover.

And a server that showed itself active for a whole round without sending any
snapshot data does not take us back by a hint until its next ordinary round,
or one that only heartbeats would hold us forever (``unserving_hints``).

While ACTIVE the event is ignored: we are served (a second active is a split
brain, or a takeover our own silence detection will follow).  Nothing changes on
the wire, and a request left behind at a passive server is only a vote held
there, which Binary Star may still count if its peer really dies.

What we do differently from the Guide's client, on purpose:

* A resync never merges into the old map.  The snapshot is built in a side map and
  swapped in on the last KTHXBAI, so keys deleted while we were away disappear,
  yet the application keeps reading the old map until then.  The swap emits one
  change per key that differs.
* Updates that arrive while we are syncing are buffered and replayed after the
  KTHXBAI: the server's snapshot is fuzzy (see docs/protocol.md), so only updates
  newer than the snapshot's sequence count, and never over a newer snapshot value.
* Sequences are checked: a KVPUB more than one ahead of the last applied, or a HUGZ
  whose sequence is ahead of it, means we lost updates; we count it and resync
  instead of silently diverging.  HUGZ is never an update.
* Restricted mode (CURVE): a client whose read rights are limited gets a
  filtered stream, with holes in the sequence by design, and its KTHXBAI says
  its view (id) and how many updates that view had up to the snapshot.  It
  then takes any higher sequence, counts the updates it applies, and checks
  ``snapshot count + applied`` against each view heartbeat (VIEW_HEARTBEAT,
  which is also its server's heartbeat); a difference, or a heartbeat for
  another view, resyncs, as a gap does.  Refusal notices fail the confirmed
  write they name (``refused``, not a table row: it is about a write).
  Control messages never reach the map or the change stream.
* Only messages from the current server are acted upon; the others are dropped.
* Snapshot replies come in batches of raw frames (SNAPSHOT_BATCH: one event for
  thousands of KVSYNCs), each taken by :func:`clone.wire.codec.fast_kvsync_entry`,
  which accepts exactly what the codec accepts without building a message;
  anything else goes through the codec's strict decoder, so a malformed KVSYNC
  is still counted and dropped with the codec's reason.  Our
  servers pack the entries into KVBATCH messages (:mod:`clone.wire.batch`, asked for
  by the I/O loop), each decoded and stored a column at a time, or dropped
  whole if anything in it is malformed.  The maps
  hold compact tuples ``(sequence, uuid, properties, body)``, not messages: a
  1M-key snapshot is 1M dict entries, and reads build the message.
* Confirmed writes are remembered by uuid until the current server republishes
  them, and are resent (same uuid, the servers deduplicate) after every resync
  and every ``resend_interval``, so a failover does not lose them.

Where things are: this module holds the inputs and :data:`TRANSITIONS`, a
read-only table keyed by (state, event), plus the handlers of the INITIAL and
ACTIVE states; the rules of a sync are in :mod:`clone.client.sync`, of failing
over in :mod:`clone.client.failover`, of writes in :mod:`clone.client.writes`,
of calls and leases in :mod:`clone.client.calls`, and the state they share in
:mod:`clone.client.state`.  Not every decision is a table row: writes
(``write``/``forget``/``refused``: the same in every state), calls
(``call``/``replied``/``keep_lease``), the resends and expiries of confirmed
writes and calls and the lease keepalives in ``tick`` (a timer, the same in
every state), dropping messages from a server that is not the current one
(before the table, in ``handle``/``update``/``snapshot_batch``), counting
malformed messages, and whether changes are emitted (``emit_changes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

from clone.client.actions import (
    Action,
    CallReplied,
    Changed,
    Confirmed,
    Event,
    LeaseGone,
    LeaseKept,
    Malformed,
    Refused,
    RequestSnapshot,
    SendCall,
    SendUpdate,
    SplitConflicted,
    State,
    StateChanged,
)
from clone.client.agentconfig import (
    AgentConfig,
    AgentCounters,
)
from clone.client.args import (
    normalize_subtrees,
)
from clone.client.calls import Calls
from clone.client.failover import Failover
from clone.client.state import (
    _NEVER,
    _Pending,
    _shows_active,
)
from clone.client.sync import SnapshotSync
from clone.client.writes import Writes
from clone.errors import IllegalTransitionError
from clone.wire.calls import OP_SET, Call, Reply
from clone.wire.codec import Hugz, KVMsg
from clone.wire.control import Refusal, ViewHeartbeat

__all__ = [
    "State",
    "Event",
    "TRANSITIONS",
    "AgentConfig",
    "AgentFSM",
    "AgentCounters",
    "IllegalTransitionError",
    "RequestSnapshot",
    "SendUpdate",
    "Changed",
    "Confirmed",
    "StateChanged",
    "Malformed",
    "Refused",
    "SplitConflicted",
    "SendCall",
    "CallReplied",
    "LeaseGone",
    "LeaseKept",
    "Action",
    "normalize_subtrees",
]

log = logging.getLogger(__name__)

_Handler = Callable[["AgentFSM", int, Any, float], list[Action]]

#: How long a restricted client's fire-and-forget write, sent as a call, is
#: resent for at the most (a failover's worth, with room): then dropped
#: without a word, as a published write lost with its server would be.
ONEWAY_CALL_WITHIN = 10.0


class AgentFSM(SnapshotSync, Failover, Writes, Calls):
    """The client agent's state machine.  Not thread-safe: the agent thread owns it.

    Its inputs are the public methods below; each event goes through
    :data:`TRANSITIONS`.  Writes (:meth:`write`, :meth:`forget`), calls and
    leases (:meth:`call`, :meth:`replied`, :meth:`keep_lease`) and the resends,
    keepalives and expiries in :meth:`tick` are not table rows (see
    :mod:`clone.client.writes` and :mod:`clone.client.calls`).
    """

    # ----------------------------------------------------------------------
    # Inputs

    def write_unconfirmed(
        self, msg: KVMsg, now: float, *, frames: list[bytes] | None = None
    ) -> list[Action]:
        """A fire-and-forget write.  Unrestricted, it is published.  In
        restricted mode a confirmed write is a call (:meth:`write_confirmed`),
        and a client's writes must reach the server in the order it made them,
        whichever it waited for: so this one is a call too, on the same
        connection, resent until answered or :data:`ONEWAY_CALL_WITHIN` passes,
        its reply waited for by nobody."""
        if self.view is None:
            return self.write(msg, now, confirm_within=None, frames=frames)
        self.counters.writes_as_calls += 1
        call = Call(OP_SET, msg.uuid, msg.key, msg.properties, msg.body)
        return self.call(call, now, within=ONEWAY_CALL_WITHIN)

    def write_confirmed(
        self, msg: KVMsg, now: float, *, within: float, frames: list[bytes] | None = None
    ) -> list[Action]:
        """A confirmed write.  Unrestricted, it is published and confirmed by
        its KVPUB (so that a read after it sees it).  In restricted mode we
        may be allowed to write keys we may not read, whose KVPUB never
        reaches us: the write is then a ``set`` call (same uuid), and is
        confirmed by its KVPUB if we can read the key, else by its REPLY
        once a view heartbeat at or past the REPLY's sequence has come (the
        server publishes in order: by then its KVPUB would have reached us),
        never by showing us the value (docs/client.md, "Write-only
        prefixes").  A refusal in the REPLY fails it at once."""
        if self.view is None:
            return self.write(msg, now, confirm_within=within, frames=frames)
        self.counters.writes_as_calls += 1
        self._pending[msg.uuid] = _Pending(msg, now + within, _NEVER, by_call=True)
        call = Call(OP_SET, msg.uuid, msg.key, msg.properties, msg.body)
        return self.call(call, now, within=within)

    def replied(self, server: int, reply: Reply, now: float) -> list[Action]:
        """A REPLY (:meth:`Calls.replied`); one to a confirmed write sent as a
        call (restricted mode) confirms it, or waits for the view heartbeat
        that shows we were not sent its update."""
        actions = Calls.replied(self, server, reply, now)
        pending = self._pending.get(reply.uuid)
        if pending is None or not pending.by_call:
            return actions
        if not any(isinstance(a, CallReplied) for a in actions):
            return actions  # not-active: asked again later
        if not reply.ok:
            del self._pending[reply.uuid]
            return actions  # the frontend fails the write with the reason
        pending.replied = reply.sequence
        if self.view_seen >= reply.sequence:
            del self._pending[reply.uuid]
            return [Confirmed(reply.uuid, reply.sequence)]
        return []

    def handle(self, event: Event, server: int, payload: Any, now: float) -> list[Action]:
        """Dispatch one event through the table."""
        if event not in _ANY_SERVER and server != self.current:
            # Late replies from a server we left, or updates from a passive one.
            self.counters.foreign += 1
            return []
        try:
            handler = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise IllegalTransitionError(
                f"no transition for {event.name} in {self.state.name}"
            ) from None
        if event in _MESSAGES:
            self._heard_at = now
        return handler(self, server, payload, now)

    def connect(self, endpoint: str, now: float) -> list[Action]:
        """Add a server (in failover order); the first one starts the sync."""
        self.servers.append(endpoint)
        return self.handle(Event.CONNECT, len(self.servers) - 1, endpoint, now)

    def snapshot_batch(self, server: int, batch: list[list[bytes]], now: float) -> list[Action]:
        """Snapshot replies as received: each item is one message's raw frames."""
        if server != self.current:
            self.counters.foreign += len(batch)
            return []
        return self.handle(Event.SNAPSHOT_BATCH, server, batch, now)

    def update(
        self,
        server: int,
        msg: KVMsg | Hugz | ViewHeartbeat | Refusal,
        now: float,
        frames: list[bytes] | None = None,
    ) -> list[Action]:
        """What arrived on a server's subscription: a KVPUB, a HUGZ, or a control
        message (:mod:`clone.wire.control`), which never reaches the map.

        ``frames``: a KVPUB's raw frames, kept (not copied) as the last update's
        for the digest of a catch-up request; without them the message is
        encoded again when asking.
        """
        self._frames_in = frames
        try:
            return self._dispatch_update(server, msg, now)
        finally:
            self._frames_in = None

    def _dispatch_update(
        self, server: int, msg: KVMsg | Hugz | ViewHeartbeat | Refusal, now: float
    ) -> list[Action]:
        if isinstance(msg, Refusal):  # about a write, not the server: not a table row
            return self.refused(server, msg, now)
        if server != self.current and _shows_active(msg):
            self.counters.foreign += 1  # still not acted upon as an update
            if self.state is State.ACTIVE:
                self.note_other_active(now)  # two actives: a split brain (writes.py)
            return self.handle(Event.ACTIVE_ELSEWHERE, server, msg, now)
        if isinstance(msg, Hugz):
            return self.handle(Event.HEARTBEAT, server, msg, now)
        if isinstance(msg, ViewHeartbeat):
            return self.handle(Event.VIEW_HEARTBEAT, server, msg, now)
        return self.handle(Event.UPDATE, server, msg, now)

    def server_reconnected(self, server: int, now: float) -> list[Action]:
        """The TCP connection to ``server``'s publisher is back after a loss.

        Another server than ours: until its next heartbeat says whether it is
        active, count it as possibly so (writes wait a moment: writes.py)."""
        self._collector_lost(server)
        if server != self.current and self.state is State.ACTIVE:
            self.note_other_active(now)
        return []

    def server_disconnected(self, server: int, now: float) -> list[Action]:
        """The TCP connection to ``server``'s publisher was lost (socket monitor).

        Only the current server matters; losing another one is just counted.
        """
        self.counters.disconnects += 1
        self._collector_lost(server)
        if server != self.current:
            return []
        return self.handle(Event.SERVER_DISCONNECTED, server, None, now)

    def _collector_lost(self, server: int) -> None:
        """The agent disconnects our PUB from a server it lost and connects it
        again when it hears it: a new connection, whose subscription may come
        after our next writes, to be proven again (writes.py)."""
        if self._collector_proven == server:
            self._collector_proven = None

    def tick(self, now: float) -> list[Action]:
        """Let time pass: resends and expired confirmed writes (not table rows:
        the same in every state), then silence and re-asks (table events), then
        calls and keepalives (after those, so that a failover or a sync they
        caused sends the waiting calls at once).  A tick long after the last
        one, or after the end of our own work (:meth:`idle_from`), means
        this process was frozen: see :meth:`_thawed`."""
        gap = 0.0 if self._ticked_at is None else now - self._ticked_at
        self._ticked_at = now
        limit = self.config.freeze_gap
        if limit is not None and gap > limit and self.current is not None:
            return self._thawed(gap, now)
        actions = self._resend_due(now) if self._pending else []
        if self._held and self.counters.snapshots:
            actions.extend(self._release_held(now))
        if self._silence_at is not None and now >= self._silence_at:
            actions.extend(self.handle(Event.SILENCE, self.current or 0, None, now))
        if self._reask_at is not None and now >= self._reask_at:
            actions.extend(self.handle(Event.REASK, self.current or 0, None, now))
        if self._calls or self._leases or self._replies_behind:
            actions.extend(self._calls_due(now))
        return actions

    def idle_from(self, now: float) -> None:
        """Our process ran its own work until ``now``: a freeze (``freeze_gap``)
        is judged from here, never from earlier.

        Why: a freeze is time in which this process did not run, and our own
        work is not that.  Measured from the previous tick, a turn that took
        long -- a large snapshot's batches, the side map's dict growing, a
        collection of our own heap, a large ITEMS -- or the application's
        thread holding the GIL (unpacking the 10M rows of that ITEMS) looked
        like a freeze, which resyncs: a 10M-key ``clone dump`` took a second
        full snapshot while it held the first, and was killed for memory.
        The servers' messages queue in our sockets meanwhile and are read
        before the next tick judges silence.  The I/O loop calls this after
        each poll, with the end of its previous turn plus the CPU time our
        process spent while it waited; ``now`` only ever moves it forward.
        """
        if self._ticked_at is not None and now > self._ticked_at:
            self._ticked_at = now

    # ----------------------------------------------------------------------
    # Handlers (the table below) for the states that are not about a sync or
    # a failover: before the first server, and applying updates while active.

    def _thawed(self, gap: float, now: float) -> list[Action]:
        """Our process did not run for ``gap`` s: the server's silence is ours.

        Its messages may still be on their way in (our I/O thread was frozen
        too) and some may be lost, so we neither fail over nor trust what we
        hold: we resync from the same server (a catch-up when it can), which
        also restarts the silence clock.  Writes and calls wait for the sync
        and are sent again after it, as after any resync.
        """
        assert self.current is not None
        self.counters.self_freezes += 1
        log.warning(
            "this client did not run for %.3g s (its process was frozen or starved); "
            "not blaming server %s: resyncing from it",
            gap,
            self.servers[self.current],
        )
        self._heard_at = now
        if self.state is State.INITIAL:
            return []
        return self._start_sync(self.current, now)

    def _ignore(self, server: int, payload: Any, now: float) -> list[Action]:
        return []

    def _add_server(self, server: int, payload: Any, now: float) -> list[Action]:
        return []

    def _first_server(self, server: int, payload: Any, now: float) -> list[Action]:
        return self._start_sync(server, now)

    def _apply_update(self, server: int, msg: KVMsg, now: float) -> list[Action]:
        self._alive(now)
        if msg.sequence <= self.last_sequence:
            self.counters.stale += 1
            return self._confirm_if_pending(msg.uuid, msg.sequence)
        return self._apply_live(server, msg, now)

    def _check_heartbeat(self, server: int, hugz: Hugz, now: float) -> list[Action]:
        self._note_heartbeat(server, hugz)
        self._alive(now)
        # A restricted client's stream has holes by design: HUGZ (not sent to it
        # by our servers) cannot tell it anything about lost updates.
        if self.view is None and hugz.sequence > self.last_sequence:
            self.counters.gaps += 1
            log.warning(
                "HUGZ from %s at sequence %d but we applied only up to %d; resyncing",
                self.servers[server],
                hugz.sequence,
                self.last_sequence,
            )
            return self._start_sync(server, now)
        return []

    def _check_view_heartbeat(self, server: int, beat: ViewHeartbeat, now: float) -> list[Action]:
        """Restricted mode's gap rule: the updates the server published in our
        view up to now must be those in our snapshot plus those we applied."""
        self._note_heartbeat(server, beat)
        self._alive(now)
        if beat.view != self.view:
            # The server now sees us with other read rights (an ACL reload):
            # only a fresh snapshot says what we may hold, and which count.
            self.counters.view_changes += 1
            log.warning(
                "view heartbeat from %s for view %s, but our snapshot is of view %s; resyncing",
                self.servers[server],
                beat.view,
                self.view or "(unrestricted)",
            )
            return self._start_sync(server, now)
        expected = self.view_count + self.view_applied
        if beat.count != expected:
            self.counters.gaps += 1
            self.counters.view_gaps += 1
            log.warning(
                "view heartbeat from %s counts %d updates in our view, we hold %d; resyncing",
                self.servers[server],
                beat.count,
                expected,
            )
            return self._start_sync(server, now)
        self.view_seen = max(self.view_seen, beat.sequence)
        confirmed: list[Action] = []
        for uuid, p in list(self._pending.items()):
            if p.by_call and 0 < p.replied <= beat.sequence:
                # Its update, were it in our view, would have come before this.
                del self._pending[uuid]
                confirmed.append(Confirmed(uuid, p.replied))
        return confirmed


# Events about a server that need not be the current one.
_ANY_SERVER = frozenset((Event.CONNECT, Event.ACTIVE_ELSEWHERE))
# Events that are messages from the server: they prove it alive.
_MESSAGES = frozenset((Event.SNAPSHOT_BATCH, Event.UPDATE, Event.HEARTBEAT, Event.VIEW_HEARTBEAT))

_S, _E = State, Event
TRANSITIONS: Final[Mapping[tuple[State, Event], _Handler]] = MappingProxyType(
    {
        (_S.INITIAL, _E.CONNECT): AgentFSM._first_server,
        (_S.INITIAL, _E.SNAPSHOT_BATCH): AgentFSM._ignore,
        (_S.INITIAL, _E.UPDATE): AgentFSM._ignore,
        (_S.INITIAL, _E.HEARTBEAT): AgentFSM._ignore,
        (_S.INITIAL, _E.VIEW_HEARTBEAT): AgentFSM._ignore,
        (_S.INITIAL, _E.SILENCE): AgentFSM._ignore,
        (_S.INITIAL, _E.REASK): AgentFSM._ignore,
        (_S.INITIAL, _E.SERVER_DISCONNECTED): AgentFSM._ignore,
        (_S.INITIAL, _E.ACTIVE_ELSEWHERE): AgentFSM._ignore,
        (_S.SYNCING, _E.CONNECT): AgentFSM._add_server,
        (_S.SYNCING, _E.SNAPSHOT_BATCH): AgentFSM._store_batch,
        (_S.SYNCING, _E.UPDATE): AgentFSM._buffer_update,
        (_S.SYNCING, _E.HEARTBEAT): AgentFSM._heartbeat_while_syncing,
        # Checked once the snapshot is in: its count is not known before.
        (_S.SYNCING, _E.VIEW_HEARTBEAT): AgentFSM._heartbeat_while_syncing,
        (_S.SYNCING, _E.SILENCE): AgentFSM._silent_while_syncing,
        (_S.SYNCING, _E.REASK): AgentFSM._reask,
        (_S.SYNCING, _E.SERVER_DISCONNECTED): AgentFSM._lost_server,
        (_S.SYNCING, _E.ACTIVE_ELSEWHERE): AgentFSM._switch_to_active,
        (_S.ACTIVE, _E.CONNECT): AgentFSM._add_server,
        (_S.ACTIVE, _E.SNAPSHOT_BATCH): AgentFSM._late_replies,
        (_S.ACTIVE, _E.UPDATE): AgentFSM._apply_update,
        (_S.ACTIVE, _E.HEARTBEAT): AgentFSM._check_heartbeat,
        (_S.ACTIVE, _E.VIEW_HEARTBEAT): AgentFSM._check_view_heartbeat,
        (_S.ACTIVE, _E.SILENCE): AgentFSM._silent_active,
        (_S.ACTIVE, _E.REASK): AgentFSM._ignore,  # a stale timer: the snapshot completed
        (_S.ACTIVE, _E.SERVER_DISCONNECTED): AgentFSM._lost_server,
        # Served already: a second active is a split brain, or a takeover that our
        # silence detection follows; switching on it could flap between two actives.
        (_S.ACTIVE, _E.ACTIVE_ELSEWHERE): AgentFSM._ignore,
    }
)
