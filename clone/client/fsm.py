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
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from itertools import repeat
from typing import Any

from clone.errors import CloneError, ProtocolError
from clone.wire.batch import KVBatch, decode_kvbatch, is_kvbatch
from clone.wire.codec import (
    Hugz,
    KVMsg,
    Properties,
    SnapshotEnd,
    decode_snapshot_reply,
    fast_kvsync_entry,
    key_in_subtree,
    validate_subtree,
)
from clone.wire.protocol import DEFAULT_MISSED_HEARTBEATS

__all__ = [
    "State",
    "Event",
    "TRANSITIONS",
    "AgentConfig",
    "AgentFSM",
    "AgentCounters",
    "IllegalTransition",
    "RequestSnapshot",
    "SendUpdate",
    "Changed",
    "Confirmed",
    "StateChanged",
    "Malformed",
    "Action",
    "normalize_subtrees",
]

log = logging.getLogger(__name__)


class IllegalTransition(CloneError):
    """The table has no entry for a (state, event) pair: a bug in the agent."""


class State(enum.Enum):
    INITIAL = "initial"  # no server known yet
    SYNCING = "syncing"  # snapshot requested from the current server
    ACTIVE = "active"  # snapshot complete, applying updates


class Event(enum.Enum):
    CONNECT = "connect"  # a server endpoint was added
    SNAPSHOT_ENTRY = "snapshot_entry"  # KVSYNC
    SNAPSHOT_END = "snapshot_end"  # KTHXBAI
    SNAPSHOT_BATCH = "snapshot_batch"  # raw replies (KVSYNCs, KTHXBAIs), undecoded
    UPDATE = "update"  # KVPUB
    HEARTBEAT = "heartbeat"  # HUGZ
    SILENCE = "silence"  # the current server said nothing for server_timeout
    REASK = "reask"  # syncing, no snapshot data yet, reask_interval passed
    SERVER_DISCONNECTED = "server_disconnected"  # TCP connection to its publisher lost
    # Another server published a KVPUB, or a HUGZ that says its heartbeat: it is
    # active.  The only event about a server that is not the current one.
    ACTIVE_ELSEWHERE = "active_elsewhere"


# --------------------------------------------------------------------------
# Actions: what the I/O loop must do.


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """Send ICANHAZ? for each subtree to ``server``, on a fresh DEALER.

    A fresh socket per request means late replies to an earlier request cannot
    be mistaken for this one.
    """

    server: int
    subtrees: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SendUpdate:
    """Publish this KVSET to every server's collector."""

    msg: KVMsg


@dataclass(frozen=True, slots=True)
class Changed:
    """The application's view of ``key`` changed.

    ``entry`` None, or an entry with an empty body, means deleted: a live delete
    carries its KVPUB (so its sequence), a key gone after a resync has none.
    """

    key: str
    entry: KVMsg | None


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The write with this uuid is in the map: the active server republished it."""

    uuid: bytes


@dataclass(frozen=True, slots=True)
class StateChanged:
    state: State
    server: int | None


@dataclass(frozen=True, slots=True)
class Malformed:
    """A reply was dropped as malformed (already counted): log ``error``."""

    server: int
    what: str
    error: str


Action = RequestSnapshot | SendUpdate | Changed | Confirmed | StateChanged | Malformed

# What the maps hold per key: (sequence, uuid, properties, body), body never empty.
# A tuple, not a KVMsg: building a frozen dataclass per snapshot entry cost as
# much as receiving it.
_Stored = tuple[int, bytes, Properties, bytes]
_PROPS, _BODY = 2, 3  # where a _Stored holds them


def _stored(msg: KVMsg) -> _Stored:
    return (msg.sequence, msg.uuid, msg.properties, msg.body)


def _message(key: str, stored: _Stored) -> KVMsg:
    return KVMsg(key, *stored)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Timing of the agent, in seconds.

    ``server_timeout`` is how long the current server may stay silent (no update,
    no HUGZ, no snapshot reply) before we fail over; while syncing, how long we
    wait for the first snapshot data.  The default of 2.5 heartbeats notices a
    frozen server after two missed HUGZ while tolerating one late one.  (A server
    whose process died is noticed at once, by its lost connection.)

    A server that says its heartbeat in its HUGZ (ours do: the ``heartbeat``
    property) is judged by its own rhythm instead, once we are active on it:
    silent for ``missed_heartbeats`` of its heartbeats means gone.  So
    ``heartbeat`` and ``server_timeout`` matter for servers that do not say (the
    Guide's, 1 s), and for the wait on a snapshot, where a passive server that
    has not yet given up on its peer may hold our request for a while.
    ``missed_heartbeats=None`` ignores what servers say: ``server_timeout`` then
    applies to every server (the frontend does this when the application sets
    ``server_timeout`` itself).

    ``reask_interval`` is how often an unanswered snapshot request is repeated on
    a fresh DEALER while syncing (default a quarter heartbeat), and
    ``requests_per_server`` bounds the requests sent to one server per round (the
    Guide's rule of bounded requests): the defaults give at most 10 requests, at
    0, 0.25, ..., 2.25 heartbeats, before we move on at 2.5.
    """

    heartbeat: float = 1.0
    server_timeout: float = 2.5
    missed_heartbeats: int | None = DEFAULT_MISSED_HEARTBEATS  # None: ignore what servers say
    requests_per_server: int = 10
    resend_interval: float = 0.5
    reask_interval: float = 0.25

    @classmethod
    def from_heartbeat(cls, heartbeat: float, **overrides: Any) -> AgentConfig:
        """Scale every timeout to the servers' heartbeat (tests use short ones)."""
        if heartbeat <= 0:
            raise ValueError(f"heartbeat must be > 0, not {heartbeat}")
        values: dict[str, Any] = {
            "heartbeat": heartbeat,
            "server_timeout": 2.5 * heartbeat,
            "resend_interval": 0.5 * heartbeat,
            "reask_interval": 0.25 * heartbeat,
        }
        values.update(overrides)
        return cls(**values)

    def __post_init__(self) -> None:
        if min(self.server_timeout, self.resend_interval, self.heartbeat, self.reask_interval) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.requests_per_server < 1:
            raise ValueError("requests_per_server must be >= 1")
        if self.missed_heartbeats is not None and self.missed_heartbeats < 1:
            raise ValueError("missed_heartbeats must be >= 1 (or None)")


@dataclass(slots=True)
class AgentCounters:
    """What happened so far; shown by ``Clone.status()``."""

    snapshots: int = 0  # completed snapshots
    resyncs: int = 0  # snapshots started after the first one, for any reason
    retries: int = 0  # snapshot requests repeated to the same server (re-asks)
    failovers: int = 0  # switches to another server, for any reason
    disconnects: int = 0  # lost connections to any server's publisher
    disconnect_failovers: int = 0  # failovers caused by losing the current server's
    # failovers while syncing to another server that showed itself active
    hint_failovers: int = 0
    gaps: int = 0  # holes in the sequence that forced a resync
    stale: int = 0  # KVPUBs discarded as not newer than the last applied
    protocol_errors: int = 0  # malformed messages dropped
    foreign: int = 0  # messages from a server that is not the current one
    resent: int = 0  # confirmed writes sent again
    expired_writes: int = 0  # confirmed writes given up on
    # A gauge, not a counter: ms from the last message of the server we left to
    # the end of the first snapshot from the next one, for the last failover.
    last_failover_gap_ms: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Pending:
    msg: KVMsg
    expires_at: float
    next_send: float
    published: bool = False  # seen on the current server's stream, map not yet swapped


_NEVER = float("inf")


def normalize_subtrees(subtrees: str | Iterable[str] | None) -> tuple[str, ...]:
    """Validated, sorted subtrees with none inside another.

    A key must belong to exactly one subtree, so that it has one snapshot sequence
    to compare updates with; ``/a/`` already covers ``/a/b/``, and ``''`` covers
    everything.
    """
    if subtrees is None:
        return ("",)
    items = [subtrees] if isinstance(subtrees, str) else list(subtrees)
    if not items:
        return ("",)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"subtree must be str, not {type(item).__name__}")
        validate_subtree(item.encode("utf-8"))
    kept: list[str] = []
    for item in sorted(set(items), key=len):
        if not any(item.startswith(k) for k in kept):
            kept.append(item)
    return tuple(sorted(kept))


_Handler = Callable[["AgentFSM", int, Any, float], list[Action]]


class AgentFSM:
    """The client agent's state machine.  Not thread-safe: the agent thread owns it."""

    def __init__(
        self,
        subtrees: str | Iterable[str] | None = None,
        config: AgentConfig | None = None,
        *,
        now: float = 0.0,
    ) -> None:
        self.config = config or AgentConfig()
        self.subtrees = normalize_subtrees(subtrees)
        self.servers: list[str] = []
        self.state = State.INITIAL
        self.current: int | None = None
        self.counters = AgentCounters()
        self.emit_changes = True
        self.last_sequence = 0
        self._map: dict[str, _Stored] = {}
        self._side: dict[str, _Stored] = {}
        self._buffer: list[KVMsg] = []
        self._ends: dict[str, int] = {}
        self._requests = 0  # snapshot requests sent to the current server this round
        self._request_id = 0  # every request, ever: a batch stops when it changes
        self._silence_at: float | None = None
        self._reask_at: float | None = None  # when to repeat an unanswered request
        self._answered = False  # snapshot data arrived for the current request
        # The current server showed itself active this round (see ACTIVE_ELSEWHERE).
        self._shown_active = False
        self._heard_at: float | None = None  # last message from the current server
        self._left_at: float | None = None  # last heard from the server we failed over from
        self._pending: dict[bytes, _Pending] = {}
        self._held: list[KVMsg] = []  # writes made before the first snapshot
        # Silence allowed while active, per server that said its heartbeat.
        self._advertised_timeout: dict[int, float] = {}

    # ----------------------------------------------------------------------
    # Reading

    def get(self, key: str) -> KVMsg | None:
        stored = self._map.get(key)
        return None if stored is None else _message(key, stored)

    def items(self, prefix: str = "") -> list[KVMsg]:
        """Entries whose key starts with ``prefix``, sorted by key."""
        return [_message(k, v) for k, v in self.rows(prefix)]

    def rows(self, prefix: str = "") -> list[tuple[str, _Stored]]:
        """``(key, (sequence, uuid, properties, body))`` under ``prefix``, sorted by key.

        The cheap form of :meth:`items` for large reads: no message per entry.
        """
        if not prefix:
            return sorted(self._map.items())  # keys are unique: values never compared
        return sorted(kv for kv in self._map.items() if kv[0].startswith(prefix))

    def __len__(self) -> int:
        return len(self._map)

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` has something to do next, or None."""
        times = [p.next_send for p in self._pending.values() if p.next_send != _NEVER]
        times.extend(p.expires_at for p in self._pending.values())
        if self._silence_at is not None:
            times.append(self._silence_at)
        if self._reask_at is not None:
            times.append(self._reask_at)
        return min(times) if times else None

    # ----------------------------------------------------------------------
    # Inputs

    def handle(self, event: Event, server: int, payload: Any, now: float) -> list[Action]:
        """Dispatch one event through the table."""
        if event not in _ANY_SERVER and server != self.current:
            # Late replies from a server we left, or updates from a passive one.
            self.counters.foreign += 1
            return []
        try:
            handler = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise IllegalTransition(
                f"no transition for {event.name} in {self.state.name}"
            ) from None
        if event in _MESSAGES:
            self._heard_at = now
        return handler(self, server, payload, now)

    def connect(self, endpoint: str, now: float) -> list[Action]:
        """Add a server (in failover order); the first one starts the sync."""
        self.servers.append(endpoint)
        return self.handle(Event.CONNECT, len(self.servers) - 1, endpoint, now)

    def snapshot_reply(self, server: int, msg: KVMsg | SnapshotEnd, now: float) -> list[Action]:
        if isinstance(msg, SnapshotEnd):
            return self.handle(Event.SNAPSHOT_END, server, msg, now)
        return self.handle(Event.SNAPSHOT_ENTRY, server, msg, now)

    def snapshot_batch(self, server: int, batch: list[list[bytes]], now: float) -> list[Action]:
        """Snapshot replies as received: each item is one message's raw frames."""
        if server != self.current:
            self.counters.foreign += len(batch)
            return []
        return self.handle(Event.SNAPSHOT_BATCH, server, batch, now)

    def update(self, server: int, msg: KVMsg | Hugz, now: float) -> list[Action]:
        if server != self.current and _shows_active(msg):
            self.counters.foreign += 1  # still not acted upon as an update
            return self.handle(Event.ACTIVE_ELSEWHERE, server, msg, now)
        if isinstance(msg, Hugz):
            return self.handle(Event.HEARTBEAT, server, msg, now)
        return self.handle(Event.UPDATE, server, msg, now)

    def server_disconnected(self, server: int, now: float) -> list[Action]:
        """The TCP connection to ``server``'s publisher was lost (socket monitor).

        Only the current server matters; losing another one is just counted.
        """
        self.counters.disconnects += 1
        if server != self.current:
            return []
        return self.handle(Event.SERVER_DISCONNECTED, server, None, now)

    def protocol_error(self, server: int) -> None:
        """Count a malformed message (the I/O loop logs it and drops it)."""
        self.counters.protocol_errors += 1

    def write(self, msg: KVMsg, now: float, *, confirm_within: float | None) -> list[Action]:
        """Publish a client update; with ``confirm_within``, track it until confirmed."""
        held = not self.counters.snapshots
        if confirm_within is not None:
            if not msg.uuid:
                raise ValueError("a confirmed write needs a uuid")
            next_send = _NEVER if held else now + self.config.resend_interval
            self._pending[msg.uuid] = _Pending(msg, now + confirm_within, next_send)
        if held:
            # Until the first snapshot we cannot know that our PUB reaches any
            # collector (a PUB drops what it cannot deliver); hold the writes.
            self._held.append(msg)
            return []
        return [SendUpdate(msg)]

    def forget(self, uuid: bytes) -> None:
        """The application gave up waiting for this write."""
        self._pending.pop(uuid, None)

    def tick(self, now: float) -> list[Action]:
        """Let time pass: silence, resends and expired confirmed writes."""
        actions: list[Action] = []
        if self._pending:
            for uuid, p in list(self._pending.items()):
                if now >= p.expires_at:
                    del self._pending[uuid]
                    self.counters.expired_writes += 1
                    log.warning("gave up on confirmed write to %r: not republished", p.msg.key)
                elif now >= p.next_send and not p.published:
                    p.next_send = now + self.config.resend_interval
                    self.counters.resent += 1
                    actions.append(SendUpdate(p.msg))
        if self._silence_at is not None and now >= self._silence_at:
            actions.extend(self.handle(Event.SILENCE, self.current or 0, None, now))
        if self._reask_at is not None and now >= self._reask_at:
            actions.extend(self.handle(Event.REASK, self.current or 0, None, now))
        return actions

    # ----------------------------------------------------------------------
    # Handlers (the table below)

    def _ignore(self, server: int, payload: Any, now: float) -> list[Action]:
        return []

    def _add_server(self, server: int, payload: Any, now: float) -> list[Action]:
        return []

    def _first_server(self, server: int, payload: Any, now: float) -> list[Action]:
        return self._start_sync(server, now)

    def _store_entry(self, server: int, msg: KVMsg, now: float) -> list[Action]:
        self._got_snapshot_data(now)
        if msg.body and self._subtree_of(msg.key) is not None:
            self._side[msg.key] = _stored(msg)
        return []

    def _store_batch(self, server: int, batch: list[list[bytes]], now: float) -> list[Action]:
        """Many replies at once: the hot path of a sync, so it avoids per-entry calls.

        :func:`~clone.wire.codec.fast_kvsync_entry` takes the KVSYNCs (exactly
        those the codec accepts); KVBATCHes are decoded whole; whatever else
        (KTHXBAI, anything odd) goes through the codec, which says what it is.
        """
        actions: list[Action] = []
        side = self._side
        subtrees = self.subtrees
        request = self._request_id
        stored = False  # valid snapshot data for the current request
        for index, frames in enumerate(batch):
            entry = fast_kvsync_entry(frames)
            if entry is not None:
                stored = True
                key, value = entry
                if value[_BODY] and key.startswith(subtrees):  # not a delete, and ours
                    side[key] = value
                continue
            if is_kvbatch(frames):
                try:
                    kvbatch = decode_kvbatch(frames)
                except ProtocolError as exc:
                    # Rejected whole: storing part of a batch would hide the error.
                    actions.append(self._malformed(server, "snapshot batch", exc))
                    continue
                stored = True
                self._store_kvbatch(kvbatch)
                continue
            try:
                msg = decode_snapshot_reply(frames)
            except ProtocolError as exc:
                actions.append(self._malformed(server, "snapshot reply", exc))
                continue
            if isinstance(msg, KVMsg):  # not reached: the fast path takes every KVSYNC
                actions.extend(self._store_entry(server, msg, now))
                continue
            stored = False  # _end_snapshot takes note of the data itself
            actions.extend(self._end_snapshot(server, msg, now))
            if self._request_id != request:
                # Asked again: the rest answer the old request, whose socket
                # the loop will close.
                return actions
            if self.state is State.ACTIVE:  # swapped: the rest are late replies
                actions.extend(self._late_replies(server, batch[index + 1 :], now))
                return actions
        if stored:
            self._got_snapshot_data(now)
        return actions

    def _store_kvbatch(self, batch: KVBatch) -> None:
        """A KVBATCH's entries into the side map, without a Python step per entry
        when nothing needs filtering (the usual case)."""
        values = zip(batch.sequences, batch.uuids, batch.properties, batch.bodies, strict=True)
        entries = zip(batch.keys, values, strict=True)
        subtrees = self.subtrees
        if all(batch.bodies) and (
            "" in subtrees or all(map(str.startswith, batch.keys, repeat(subtrees)))
        ):
            self._side.update(entries)
        else:  # deletes, or keys outside our subtrees
            self._side.update(
                (key, value) for key, value in entries if value[_BODY] and key.startswith(subtrees)
            )

    def _end_snapshot(self, server: int, end: SnapshotEnd, now: float) -> list[Action]:
        self._got_snapshot_data(now)
        waiting = [s for s in self.subtrees if s not in self._ends]
        if end.subtree in waiting:
            subtree = end.subtree
        elif len(waiting) == 1:
            subtree = waiting[0]  # a server that does not echo the subtree
        else:
            self.counters.protocol_errors += 1
            log.warning("KTHXBAI for subtree %r that we are not waiting for", end.subtree)
            return []
        self._ends[subtree] = end.sequence
        if len(self._ends) < len(self.subtrees):
            return []
        return self._swap(now)

    def _late_replies(self, server: int, batch: list[list[bytes]], now: float) -> list[Action]:
        """Replies after the snapshot completed: they prove the server alive, and
        malformed ones are still counted."""
        self._alive(now)
        actions: list[Action] = []
        for frames in batch:
            batched = is_kvbatch(frames)
            try:
                if batched:
                    decode_kvbatch(frames)
                else:
                    decode_snapshot_reply(frames)
            except ProtocolError as exc:
                what = "snapshot batch" if batched else "snapshot reply"
                actions.append(self._malformed(server, what, exc))
        return actions

    def _malformed(self, server: int, what: str, exc: ProtocolError) -> Malformed:
        """Count a malformed message and ask the I/O loop to log it."""
        self.protocol_error(server)
        return Malformed(server, what, str(exc))

    def _buffer_update(self, server: int, msg: KVMsg, now: float) -> list[Action]:
        self._shown_active = True
        self._alive_if_answered(now)
        self._buffer.append(msg)
        return []

    def _heartbeat_while_syncing(self, server: int, hugz: Hugz, now: float) -> list[Action]:
        self._note_heartbeat(server, hugz)
        if _shows_active(hugz):
            self._shown_active = True
        self._alive_if_answered(now)
        return []

    def _switch_to_active(self, server: int, msg: KVMsg | Hugz, now: float) -> list[Action]:
        """Syncing: ``server`` showed itself active; ask it if the current one
        has not answered and has not shown itself active too (no flapping)."""
        if server == self.current or self._answered or self._shown_active:
            return []
        assert self.current is not None
        log.info(
            "%s is active (%s) and %s has not answered; asking %s",
            self.servers[server],
            "HUGZ" if isinstance(msg, Hugz) else "KVPUB",
            self.servers[self.current],
            self.servers[server],
        )
        self.counters.hint_failovers += 1
        actions = self._failover(now, server)
        # It has shown itself: no other server takes us from it this round.
        self._shown_active = True
        self._heard_at = now
        if isinstance(msg, Hugz):
            self._note_heartbeat(server, msg)
        else:  # published before our request: in the snapshot, and harmless here
            self._buffer.append(msg)
        return actions

    def _note_alive(self, server: int, payload: Any, now: float) -> list[Action]:
        self._alive(now)
        return []

    def _reask(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        self.counters.retries += 1
        log.debug(
            "no snapshot from %s yet; asking again (%d of %d)",
            self.servers[self.current],
            self._requests + 1,
            self.config.requests_per_server,
        )
        return self._request(now)

    def _silent_while_syncing(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        log.info(
            "no snapshot from %s within %.3g s (%d requests); trying the next server",
            self.servers[self.current],
            self.config.server_timeout,
            self._requests,
        )
        return self._failover(now)

    def _lost_server(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        log.warning(
            "lost the connection to server %s (%s); failing over",
            self.servers[self.current],
            self.state.value,
        )
        self.counters.disconnect_failovers += 1
        return self._failover(now)

    def _silent_active(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        log.warning(
            "server %s silent for %.3g s; failing over",
            self.servers[self.current],
            self._silence_allowed(),
        )
        return self._failover(now)

    def _apply_update(self, server: int, msg: KVMsg, now: float) -> list[Action]:
        self._alive(now)
        if msg.sequence <= self.last_sequence:
            self.counters.stale += 1
            return self._confirm_if_pending(msg.uuid)
        if msg.sequence != self.last_sequence + 1:
            self.counters.gaps += 1
            log.warning(
                "sequence gap from %s: got %d after %d; resyncing",
                self.servers[server],
                msg.sequence,
                self.last_sequence,
            )
            self._mark_published(msg.uuid)
            return self._start_sync(server, now)
        self.last_sequence = msg.sequence
        actions: list[Action] = []
        if self._subtree_of(msg.key) is not None:
            old = self._map.get(msg.key)
            new = _stored(msg) if msg.body else None
            if new is not None:
                self._map[msg.key] = new
            elif old is not None:
                del self._map[msg.key]
            if self.emit_changes and _differs(old, new):
                # A delete keeps its message, so watchers learn its sequence.
                actions.append(Changed(msg.key, msg))
        actions.extend(self._confirm_if_pending(msg.uuid))
        return actions

    def _check_heartbeat(self, server: int, hugz: Hugz, now: float) -> list[Action]:
        self._note_heartbeat(server, hugz)
        self._alive(now)
        if hugz.sequence > self.last_sequence:
            self.counters.gaps += 1
            log.warning(
                "HUGZ from %s at sequence %d but we applied only up to %d; resyncing",
                self.servers[server],
                hugz.sequence,
                self.last_sequence,
            )
            return self._start_sync(server, now)
        return []

    # ----------------------------------------------------------------------
    # Helpers

    def _alive(self, now: float) -> None:
        self._silence_at = now + self._silence_allowed()

    def silence_timeout(self) -> float:
        """Seconds of silence from the current server that mean it is gone:
        ``missed_heartbeats`` of its advertised heartbeat while active on a
        server that says it, else ``server_timeout``."""
        return self._silence_allowed()

    def _silence_allowed(self) -> float:
        if self.state is State.ACTIVE and self.current is not None:
            return self._advertised_timeout.get(self.current, self.config.server_timeout)
        return self.config.server_timeout

    def _note_heartbeat(self, server: int, hugz: Hugz) -> None:
        missed = self.config.missed_heartbeats
        if hugz.heartbeat is not None and missed is not None:
            self._advertised_timeout[server] = missed * hugz.heartbeat
        else:  # a server that stopped saying (replaced by another kind)
            self._advertised_timeout.pop(server, None)

    def _alive_if_answered(self, now: float) -> None:
        # While syncing, only snapshot data proves the server is serving *us*:
        # a server that sends HUGZ but refuses our request must not hold us.
        if self._answered:
            self._alive(now)

    def _got_snapshot_data(self, now: float) -> None:
        self._answered = True
        self._reask_at = None
        self._alive(now)

    def _subtree_of(self, key: str) -> str | None:
        for subtree in self.subtrees:
            if key_in_subtree(key, subtree):
                return subtree
        return None

    def _set_state(self, state: State) -> list[Action]:
        if state is self.state:
            return []
        self.state = state
        return [StateChanged(state, self.current)]

    def _start_sync(self, server: int, now: float) -> list[Action]:
        """Start a fresh snapshot from ``server``, keeping the map readable."""
        if self.counters.snapshots:
            self.counters.resyncs += 1
        self.current = server
        self._requests = 0
        self._shown_active = False
        actions = self._set_state(State.SYNCING)
        self._alive(now)  # the round's deadline; re-asks do not move it
        return actions + self._request(now)

    def _request(self, now: float) -> list[Action]:
        """Ask the current server for a snapshot, on a fresh DEALER (see the action)."""
        assert self.current is not None
        self._side = {}
        self._buffer = []
        self._ends = {}
        self._requests += 1
        self._request_id += 1
        self._answered = False
        more = self._requests < self.config.requests_per_server
        self._reask_at = now + self.config.reask_interval if more else None
        return [RequestSnapshot(self.current, self.subtrees)]

    def _failover(self, now: float, to: int | None = None) -> list[Action]:
        """Start a round on ``to``, by default the next server (round robin)."""
        assert self.current is not None
        nxt = (self.current + 1) % len(self.servers) if to is None else to
        self.counters.failovers += 1
        if self._left_at is None and self._heard_at is not None:
            # Measured from the server we were last served by, across any
            # number of further failovers until a snapshot completes.
            self._left_at = self._heard_at
        self._heard_at = None
        log.info("failing over from %s to %s", self.servers[self.current], self.servers[nxt])
        return self._start_sync(nxt, now)

    def _mark_published(self, uuid: bytes) -> None:
        pending = self._pending.get(uuid) if uuid else None
        if pending is not None:
            pending.published = True

    def _confirm_if_pending(self, uuid: bytes) -> list[Action]:
        if uuid and self._pending.pop(uuid, None) is not None:
            return [Confirmed(uuid)]
        return []

    def _swap(self, now: float) -> list[Action]:
        """Replay the buffered updates over the side map, then make it the map."""
        side = self._side
        last = min(self._ends.values())
        for msg in self._buffer:
            self._mark_published(msg.uuid)
            if msg.sequence <= last:
                continue
            if msg.sequence != last + 1:
                self.counters.gaps += 1
                assert self.current is not None
                log.warning(
                    "sequence gap while syncing from %s: got %d after %d; resyncing",
                    self.servers[self.current],
                    msg.sequence,
                    last,
                )
                return self._start_sync(self.current, now)
            last = msg.sequence
            subtree = self._subtree_of(msg.key)
            if subtree is None or msg.sequence <= self._ends[subtree]:
                continue
            held = side.get(msg.key)
            if held is not None and held[0] >= msg.sequence:
                continue  # the fuzzy snapshot already holds a newer value
            if msg.body:
                side[msg.key] = _stored(msg)
            else:
                side.pop(msg.key, None)
        old, self._map = self._map, side
        self._side, self._buffer, self._ends = {}, [], {}
        self._reask_at = None
        self.last_sequence = last
        self.counters.snapshots += 1
        if self._left_at is not None:
            self.counters.last_failover_gap_ms = round(1000 * (now - self._left_at))
            self._left_at = None
        actions = self._set_state(State.ACTIVE)
        if self.emit_changes:  # a 1M-key diff costs seconds: only for watchers
            actions.extend(_diff(old, side))
        for uuid, p in self._pending.items():
            # A write is in the new map if its key holds its uuid (uuids are unique).
            entry = side.get(p.msg.key)
            if entry is not None and entry[1] == uuid:
                p.published = True
        flushed, self._held = self._held, []
        actions.extend(SendUpdate(msg) for msg in flushed)
        held_uuids = {msg.uuid for msg in flushed}
        for uuid, p in list(self._pending.items()):
            if p.published:
                del self._pending[uuid]
                actions.append(Confirmed(uuid))
            elif uuid in held_uuids:
                p.next_send = now + self.config.resend_interval
            else:
                # The new server may never have seen it: send again, same uuid.
                p.next_send = now + self.config.resend_interval
                self.counters.resent += 1
                actions.append(SendUpdate(p.msg))
        return actions


def _differs(old: _Stored | None, new: _Stored | None) -> bool:
    if old is None or new is None:
        return old is not new
    return old[_BODY] != new[_BODY] or old[_PROPS] != new[_PROPS]


def _diff(old: dict[str, _Stored], new: dict[str, _Stored]) -> list[Action]:
    """The changes that turn ``old`` into ``new``, by key."""
    out: list[Action] = [Changed(k, None) for k in old if k not in new]
    out.extend(Changed(k, _message(k, v)) for k, v in new.items() if _differs(old.get(k), v))
    return out


def _shows_active(msg: KVMsg | Hugz) -> bool:
    """Only an active server publishes updates, and only ours (active) say
    their heartbeat in HUGZ; the Guide's passive servers send bare HUGZ too."""
    return not isinstance(msg, Hugz) or msg.heartbeat is not None


# Events about a server that need not be the current one.
_ANY_SERVER = frozenset((Event.CONNECT, Event.ACTIVE_ELSEWHERE))
_MESSAGES = frozenset(
    (Event.SNAPSHOT_ENTRY, Event.SNAPSHOT_END, Event.SNAPSHOT_BATCH, Event.UPDATE, Event.HEARTBEAT)
)

_S, _E = State, Event
TRANSITIONS: dict[tuple[State, Event], _Handler] = {
    (_S.INITIAL, _E.CONNECT): AgentFSM._first_server,
    (_S.INITIAL, _E.SNAPSHOT_ENTRY): AgentFSM._ignore,
    (_S.INITIAL, _E.SNAPSHOT_END): AgentFSM._ignore,
    (_S.INITIAL, _E.SNAPSHOT_BATCH): AgentFSM._ignore,
    (_S.INITIAL, _E.UPDATE): AgentFSM._ignore,
    (_S.INITIAL, _E.HEARTBEAT): AgentFSM._ignore,
    (_S.INITIAL, _E.SILENCE): AgentFSM._ignore,
    (_S.INITIAL, _E.REASK): AgentFSM._ignore,
    (_S.INITIAL, _E.SERVER_DISCONNECTED): AgentFSM._ignore,
    (_S.INITIAL, _E.ACTIVE_ELSEWHERE): AgentFSM._ignore,
    (_S.SYNCING, _E.CONNECT): AgentFSM._add_server,
    (_S.SYNCING, _E.SNAPSHOT_ENTRY): AgentFSM._store_entry,
    (_S.SYNCING, _E.SNAPSHOT_END): AgentFSM._end_snapshot,
    (_S.SYNCING, _E.SNAPSHOT_BATCH): AgentFSM._store_batch,
    (_S.SYNCING, _E.UPDATE): AgentFSM._buffer_update,
    (_S.SYNCING, _E.HEARTBEAT): AgentFSM._heartbeat_while_syncing,
    (_S.SYNCING, _E.SILENCE): AgentFSM._silent_while_syncing,
    (_S.SYNCING, _E.REASK): AgentFSM._reask,
    (_S.SYNCING, _E.SERVER_DISCONNECTED): AgentFSM._lost_server,
    (_S.SYNCING, _E.ACTIVE_ELSEWHERE): AgentFSM._switch_to_active,
    (_S.ACTIVE, _E.CONNECT): AgentFSM._add_server,
    (_S.ACTIVE, _E.SNAPSHOT_ENTRY): AgentFSM._note_alive,  # late reply: alive, ignored
    (_S.ACTIVE, _E.SNAPSHOT_END): AgentFSM._note_alive,
    (_S.ACTIVE, _E.SNAPSHOT_BATCH): AgentFSM._late_replies,
    (_S.ACTIVE, _E.UPDATE): AgentFSM._apply_update,
    (_S.ACTIVE, _E.HEARTBEAT): AgentFSM._check_heartbeat,
    (_S.ACTIVE, _E.SILENCE): AgentFSM._silent_active,
    (_S.ACTIVE, _E.REASK): AgentFSM._ignore,  # a stale timer: the snapshot completed
    (_S.ACTIVE, _E.SERVER_DISCONNECTED): AgentFSM._lost_server,
    # Served already: a second active is a split brain, or a takeover that our
    # silence detection follows; switching on it could flap between two actives.
    (_S.ACTIVE, _E.ACTIVE_ELSEWHERE): AgentFSM._ignore,
}
