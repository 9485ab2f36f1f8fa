"""The client agent's state, and the vocabulary its state machine speaks.

How this works: :class:`AgentState` holds everything the agent knows (the
servers, the current one, the map, the snapshot being built, pending writes,
deadlines) and the small helpers every part of the machine shares.  The
machine's rules live in :mod:`clone.client.fsm` (the table and the events it
dispatches), with the rules of a sync in :mod:`clone.client.sync`, of failing
over in :mod:`clone.client.failover` and of writes in :mod:`clone.client.writes`,
each a mixin over this state.  Like them, this module is sans-IO: no zmq, no
``time``; ``now`` is always an argument.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from clone.client.actions import (
    Action,
    CallReplied,
    Changed,
    Confirmed,
    Malformed,
    RequestSnapshot,
    SendUpdate,
    State,
    StateChanged,
)
from clone.client.agentconfig import AgentConfig, AgentCounters
from clone.client.args import normalize_subtrees
from clone.client.backoff import reask_delay, round_window
from clone.errors import ProtocolError
from clone.wire.calls import Reply
from clone.wire.codec import (
    Hugz,
    KVMsg,
    Properties,
    encode_kv,
    key_in_subtree,
)
from clone.wire.control import ViewHeartbeat
from clone.wire.delta import update_digest

__all__ = ["CONFIRMED_REMEMBERED", "SPLIT_HOLD_MAX", "STALL_HEARTBEATS", "AgentState"]

log = logging.getLogger(__name__)


# What the maps hold per key: (sequence, uuid, properties, body), body never empty.
# A tuple, not a KVMsg: building a frozen dataclass per snapshot entry cost as
# much as receiving it.
_Stored = tuple[int, bytes, Properties, bytes]
_PROPS, _BODY = 2, 3  # where a _Stored holds them


def _stored(msg: KVMsg) -> _Stored:
    return (msg.sequence, msg.uuid, msg.properties, msg.body)


def _differs(old: _Stored | None, new: _Stored | None) -> bool:
    if old is None or new is None:
        return old is not new
    return old[_BODY] != new[_BODY] or old[_PROPS] != new[_PROPS]


def _message(key: str, stored: _Stored) -> KVMsg:
    return KVMsg(key, *stored)


@dataclass(slots=True)
class _Pending:
    msg: KVMsg
    expires_at: float
    next_send: float
    published: bool = False  # seen on the current server's stream, map not yet swapped
    sequence: int = 0  # the sequence it was seen with, once published
    # Restricted mode: sent as a call (never resent as a KVSET; the call is),
    # and the sequence its REPLY said, 0 until then (clone.client.fsm).
    by_call: bool = False
    replied: int = 0


@dataclass(slots=True)
class _PendingCall:
    """A call waiting for its reply (:mod:`clone.client.calls`)."""

    frames: tuple[bytes, ...]
    expires_at: float  # the caller's deadline; never for a keepalive (replaced instead)
    next_send: float  # _NEVER: not sent yet, no server to send it to
    lease: str | None = None  # a keepalive of this kept lease: nobody waits on it
    sends: int = 0
    #: A lease-keepalives call: the kept leases it names (nobody waits on it),
    #: and when it was made (each lease is then valid until then + its ttl).
    leases: tuple[str, ...] = ()
    made: float = 0.0


@dataclass(slots=True)
class _KeptLease:
    """A lease the agent keeps alive with a keepalive every ``ttl / 3``."""

    ttl: float
    next_keepalive: float
    inflight: bytes | None = None  # the uuid of the unanswered keepalive
    inflight_at: float = 0.0  # when that keepalive was made
    secret: str = ""  # the lease's proof of ownership, sent with each keepalive


_NEVER = float("inf")
#: The longest a client holds its writes while two servers show themselves
#: active (a split brain resolves on the servers' first contact; one that
#: lasts, with this client seeing both sides, must not stop its writes).
SPLIT_HOLD_MAX = 5.0
#: How many confirmed writes' ids a client remembers for split-brain conflict
#: notices (16 bytes and a key each: about 10 MiB at most with long keys).
CONFIRMED_REMEMBERED = 65_536
#: HUGZ of the current server, with no data for our request since its last,
#: after which an answer that began counts as stopped (with the round's
#: window passed too): the server ran that long and sent us nothing.
STALL_HEARTBEATS = 10


class AgentState:
    """What the agent knows, and the helpers every part of its machine shares.

    Not thread-safe: the agent thread owns it.
    """

    def __init__(
        self,
        subtrees: str | Iterable[str] | None = None,
        config: AgentConfig | None = None,
        *,
        now: float = 0.0,
        draw: Callable[[], float] | None = None,
    ) -> None:
        self.config = config or AgentConfig()
        # Uniform numbers in [0, 1) for the re-asks' jitter (clone.client.backoff).
        self._draw = draw if draw is not None else random.Random().random
        # Sync rounds in a row that got no snapshot data: the next wait longer.
        self._unanswered_rounds = 0
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
        # The raw frames of buffered updates, by sequence, where the loop gave them.
        self._buffer_frames: dict[int, list[bytes]] = {}
        self._ends: dict[str, int] = {}
        self._requests = 0  # snapshot requests sent to the current server this round
        self._request_id = 0  # every request, ever: a batch stops when it changes
        self._silence_at: float | None = None
        self._reask_at: float | None = None  # when to repeat an unanswered request
        self._answered = False  # snapshot data arrived for the current request
        # When it last did, and the HUGZ heard since (_answer_stalled).
        self._data_at = 0.0
        self._hugz_without_data = 0
        # The current server showed itself active this round (see ACTIVE_ELSEWHERE).
        self._shown_active = False
        # A server whose last round ended with no snapshot data although it
        # showed itself active (broken or hostile): its hints do not move us
        # until its next ordinary round (clone.client.failover).
        self._unserving: int | None = None
        self._heard_at: float | None = None  # last message from the current server
        self._ticked_at: float | None = None  # the last tick: a long gap is our own freeze
        self._left_at: float | None = None  # last heard from the server we failed over from
        self._pending: dict[bytes, _Pending] = {}
        # Writes (and set calls) confirmed lately, uuid -> key: a split brain's
        # loser may tell us one became a conflict after it was confirmed.
        self._confirmed_lately: dict[bytes, str] = {}
        self._held: list[KVMsg] = []  # writes made before the first snapshot
        # The server whose collector our PUB is known to reach (it republished
        # a write we sent it), the next probe, and when probing began (writes.py).
        self._collector_proven: int | None = None
        self._probe_at = 0.0
        self._probing_since: float | None = None
        # When a server other than ours last showed itself active while we were
        # active on ours: two actives, a split brain healing (clone.client.writes).
        self.other_active_at: float | None = None
        self.other_active_since = 0.0  # when this episode of two actives began
        # Calls awaiting a reply, by uuid; leases kept alive, by id; where the
        # calls were last sent (server, completed syncs): a change sends them
        # again at once (clone.client.calls).
        self._calls: dict[bytes, _PendingCall] = {}
        # Replies to set calls whose update our replica has not applied yet:
        # (sequence, release at, reply), told once it has (or at "release
        # at", half the caller's time left: the server did write it).
        self._replies_behind: list[tuple[int, float, Reply]] = []
        self._leases: dict[str, _KeptLease] = {}
        # Whether the servers take lease-keepalives (batched keepalives); False from the
        # first refusal of one (an older server or relay): one call per lease.
        self._batch_keepalives = True
        self._call_route: tuple[int | None, int] = (None, 0)
        # Silence allowed while active, per server that said its heartbeat.
        self._advertised_timeout: dict[int, float] = {}
        # Restricted mode (docs/protocol.md, "Detecting lost updates in a filtered
        # stream"): our view's id, how many updates it had up to the snapshot's
        # sequence, and how many we applied since.  ``view`` None: unrestricted.
        self.view: str | None = None
        self.view_count = 0
        self.view_applied = 0
        # The sequence of the last view heartbeat of our view: every update in
        # our view up to it has reached us (the server publishes in order).
        self.view_seen = 0
        self._end_views: dict[str, tuple[str, int]] = {}  # per subtree's KTHXBAI
        # Catch-up (KVDELTA): the last update applied in sequence order, as
        # its raw frames when the loop gave them (else the message, encoded
        # when asking), for the digest a request names; None when we do not
        # know it (after a snapshot that no live update followed).
        self._last_update: list[bytes] | KVMsg | None = None
        self._frames_in: list[bytes] | None = None  # of the update being handled
        self._full_next = False  # a catch-up failed: next sync is a full one
        self._asked_since: int | None = None  # the current request's catch-up
        self._delta = False  # the current reply is a catch-up (KVDELTA seen)
        self._reply_seen = False  # a reply to the current request arrived

    # ----------------------------------------------------------------------
    # Reading

    def get(self, key: str) -> KVMsg | None:
        stored = self._map.get(key)
        return None if stored is None else _message(key, stored)

    def peek(self, key: str) -> _Stored | None:
        """``key``'s row, for the frontend's threads: the one read that is safe
        outside the agent thread.  One ``dict.get`` on whichever map is current
        (a sync swaps maps whole, an update changes one key), atomic under the
        GIL, so a reader sees a key before or after an update, never half of
        one.  The agent applies an update before it confirms it, so a read
        after a confirmed write sees that write (or a later one)."""
        return self._map.get(key)

    @property
    def heard_at(self) -> float | None:
        """When the current server was last heard from (the agent's clock)."""
        return self._heard_at

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
    def held_writes(self) -> int:
        """Writes made before any server answered us, not sent yet."""
        return len(self._held)

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` has something to do next, or None."""
        times = [p.next_send for p in self._pending.values() if p.next_send != _NEVER]
        times.extend(p.expires_at for p in self._pending.values())
        if self._calls or self._leases:
            times.extend(c.next_send for c in self._calls.values() if c.next_send != _NEVER)
            times.extend(c.expires_at for c in self._calls.values() if c.expires_at != _NEVER)
            times.extend(k.next_keepalive for k in self._leases.values())
        times.extend(at for _, at, _ in self._replies_behind)
        if self._silence_at is not None:
            times.append(self._silence_at)
        if self._reask_at is not None:
            times.append(self._reask_at)
        if self._held and self.state is State.ACTIVE and self.other_active_at is None:
            times.append(self._probe_at)  # the next probe, or at once once proven
        if self._held and self.other_active_at is not None:
            times.append(
                min(
                    self.other_active_at + self._split_window(),
                    self.other_active_since + SPLIT_HOLD_MAX,
                )
            )
        return min(times) if times else None

    def note_other_active(self, now: float) -> None:
        """A server other than ours showed itself active while we are active."""
        seen = self.other_active_at
        if seen is None or now - seen >= self._split_window():
            self.other_active_since = now
        self.other_active_at = now

    def _split_window(self) -> float:
        """How long after another server last showed itself active our writes
        stay held: two of its heartbeats (it stops at once when it steps down)."""
        return max(0.5, 2 * self.config.heartbeat)

    def protocol_error(self, server: int) -> None:
        """Count a malformed message (the I/O loop logs it and drops it)."""
        self.counters.protocol_errors += 1

    def _malformed(self, server: int, what: str, exc: ProtocolError) -> Malformed:
        """Count a malformed message and ask the I/O loop to log it."""
        self.protocol_error(server)
        return Malformed(server, what, str(exc))

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
        if self.state is State.SYNCING:
            return round_window(self.config.server_timeout, self._unanswered_rounds)
        return self.config.server_timeout

    def _note_heartbeat(self, server: int, hugz: Hugz | ViewHeartbeat) -> None:
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
        self._data_at = now
        self._hugz_without_data = 0
        self._alive(now)

    def _answer_stalled(self, now: float) -> bool:
        """A HUGZ came while our request is being answered: whether the answer
        has stopped, so that we ask the same (live) server again.

        Why: HUGZ and updates prove the server alive (they move the silence
        deadline), not that our stream still flows.  A server that dropped it
        -- a late copy of one of our re-asks, read after the newest, replaced
        it on a loaded machine -- kept a resyncing client waiting for good,
        held by the HUGZ.  Judged by the server's own heartbeats, at least
        :data:`STALL_HEARTBEATS` of them with no data for us, as well as by
        the round's window: on a starved machine a live stream's data comes
        late, but no later than the HUGZ sent after it.
        """
        self._hugz_without_data += 1
        return (
            self._hugz_without_data >= STALL_HEARTBEATS
            and now - self._data_at >= self._silence_allowed()
        )

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
        if server == self._unserving:
            self._unserving = None  # its turn: judged again by this round
        actions = self._set_state(State.SYNCING)
        self._alive(now)  # the round's deadline; re-asks do not move it
        return actions + self._request(now)

    def _request(self, now: float) -> list[Action]:
        """Ask the current server for a snapshot, on a fresh DEALER (see the action)."""
        assert self.current is not None
        self._side = {}
        self._buffer = []
        self._buffer_frames = {}
        self._ends = {}
        self._end_views = {}
        self._requests += 1
        self._request_id += 1
        self._answered = False
        self._delta = False
        self._reply_seen = False
        more = self._requests < self.config.requests_per_server
        delay = reask_delay(self.config.reask_interval, self._unanswered_rounds, self._draw)
        self._reask_at = now + delay if more else None
        since = self._catch_up_point()
        self._asked_since = None if since is None else since[0]
        return [RequestSnapshot(self.current, self.subtrees, since)]

    def _catch_up_point(self) -> tuple[int, bytes] | None:
        """The sequence and digest to ask a catch-up from, or None for a full snapshot.

        Only for the whole map (a server never sends a subtree a delta, and
        with several subtrees there is no single state to extend), unrestricted
        (a restricted client's count comes from a filtered snapshot's KTHXBAI),
        holding a state whose last update we know, and not right after a
        catch-up that failed.

        After a full snapshot and no live update since, the last update is
        the snapshot's entry at its sequence, when the map holds it (the
        update at a sequence is the entry with that sequence: none other
        has it); not when it was a delete.  Found once, by a scan, at the
        resync that needs it.  Without it, a client that missed the first
        KVPUB after a full sync (its subscriber joined late) had only a full
        snapshot to resync by, and its write in that KVPUB, a delete, could
        never be confirmed: a snapshot does not show a delete's uuid, and the
        server drops the resent write as a duplicate (a loaded run's
        ``clone del --prefix`` waited out its 5 s).
        """
        if (
            self._full_next
            or self.last_sequence <= 0
            or self.subtrees != ("",)
            or self.view is not None
        ):
            return None
        last = self._last_update
        if last is None:
            last = self._last_update = self._entry_at(self.last_sequence)
        if last is None:
            return None
        frames = last if isinstance(last, list) else encode_kv(last)
        if len(frames) != 5 or int.from_bytes(frames[1], "big") != self.last_sequence:
            return None
        return self.last_sequence, update_digest(frames)

    def _entry_at(self, sequence: int) -> KVMsg | None:
        """The map's entry written at ``sequence``, or None."""
        for key, stored in self._map.items():
            if stored[0] == sequence:
                return _message(key, stored)
        return None

    def _apply_live(self, server: int, msg: KVMsg, now: float) -> list[Action]:
        """A KVPUB newer than the last applied, to the map in place (the "+1"
        rule, or restricted mode's count); a hole resyncs.  Raw frames, if the
        loop gave them, are in ``_frames_in``."""
        if self.view is not None:
            # Restricted: a filtered stream has holes by design; the view
            # heartbeat checks that none of ours was lost.
            self.view_applied += 1
        elif msg.sequence != self.last_sequence + 1:
            self.counters.gaps += 1
            log.warning(
                "sequence gap from %s: got %d after %d; resyncing",
                self.servers[server],
                msg.sequence,
                self.last_sequence,
            )
            self._mark_published(msg.uuid, msg.sequence)
            return self._start_sync(server, now)
        return self._apply_in_place(msg, self._frames_in)

    def _apply_in_place(self, msg: KVMsg, frames: list[bytes] | None) -> list[Action]:
        """Apply one update, whose sequence the caller checked, to the map:
        a change event if the application's view changed, and the
        confirmation of our write if it is one."""
        self.last_sequence = msg.sequence
        self._last_update = msg if frames is None else frames
        actions: list[Action] = []
        if self._subtree_of(msg.key) is not None:
            old = self._map.get(msg.key)
            if old is not None and old[0] >= msg.sequence:
                # The fuzzy snapshot already gave us a newer value: an update
                # its stream carried after KTHXBAI (our subscription lagged
                # the snapshot, as a connection that TCP backed off does
                # after a partition) must not take the key back.
                return self._confirm_if_pending(msg.uuid, msg.sequence)
            new = _stored(msg) if msg.body else None
            if new is not None:
                self._map[msg.key] = new
            elif old is not None:
                del self._map[msg.key]
            if self.emit_changes and (old is not None or new is not None):
                # Every write is a change, even one that leaves the value as it
                # was (as etcd's and the history feed's watchers see it: a
                # rewrite is news to a watcher waiting for a write); a delete
                # keeps its message, so watchers learn its sequence.
                actions.append(Changed(msg.key, msg))
        actions.extend(self._confirm_if_pending(msg.uuid, msg.sequence))
        if self._replies_behind:
            actions.extend(self._replies_caught_up())
        return actions

    def _replies_caught_up(self, now: float | None = None) -> list[Action]:
        """The held replies our replica has caught up with (and, given
        ``now``, those whose wait ran out), in the order they were held."""
        done = [r for r in self._replies_behind
                if r[0] <= self.last_sequence or (now is not None and now >= r[1])]
        if not done:
            return []
        self._replies_behind = [r for r in self._replies_behind if r not in done]
        if now is not None:
            self.counters.replies_unseen += sum(
                1 for r in done if r[0] > self.last_sequence
            )
        return [CallReplied(reply) for _, _, reply in done]

    def _probe(self, now: float) -> list[Action]:
        """Send the first held write alone, again every ``resend_interval``
        (same uuid: servers deduplicate), until the current server
        republishes it (:meth:`_note_republished`): then our PUB is known to
        reach its collector, and the rest follow in order.

        A snapshot proves nothing about our PUB: it is another connection,
        and a PUB drops every message until the collector's subscription has
        reached it, which on a busy machine can come after the snapshot; the
        fire-and-forget writes sent meanwhile were lost without a trace.
        """
        if self._probing_since is None:
            self._probing_since = now
        if now < self._probe_at:
            return []
        self._probe_at = now + self.config.resend_interval
        self.counters.collector_probes += 1
        return [SendUpdate(self._held[0])]

    def _collector_unproven(self) -> bool:
        """Whether our writes wait for a probe's proof (clone.client.writes);
        restricted writes are calls, which need none."""
        return self.view is None and self._collector_proven != self.current

    def _note_republished(self, uuid: bytes) -> None:
        """An update from the current server carried ``uuid``: if it is our probe's, our
        PUB reaches that server's collector; the held writes go at the next
        tick (at once: :meth:`next_deadline`)."""
        if uuid and self._collector_unproven() and self._held and self._held[0].uuid == uuid:
            self._collector_proven = self.current
            del self._held[0]  # applied already: no need to send it again
            self._probe_at = 0.0
            self._probing_since = None

    def _mark_published(self, uuid: bytes, sequence: int) -> None:
        self._note_republished(uuid)
        pending = self._pending.get(uuid) if uuid else None
        if pending is not None:
            pending.published = True
            pending.sequence = sequence

    def _confirm_if_pending(self, uuid: bytes, sequence: int) -> list[Action]:
        self._note_republished(uuid)
        pending = self._pending.pop(uuid, None) if uuid else None
        if pending is not None:
            self._remember_confirmed(uuid, pending.msg.key)
            return [Confirmed(uuid, sequence)]
        return []

    def _remember_confirmed(self, uuid: bytes, key: str) -> None:
        """Bounded (:data:`CONFIRMED_REMEMBERED`): a split brain's conflicts
        come within a heal, seconds after their writes were confirmed."""
        lately = self._confirmed_lately
        lately[uuid] = key
        if len(lately) > CONFIRMED_REMEMBERED:
            del lately[next(iter(lately))]


def _shows_active(msg: KVMsg | Hugz | ViewHeartbeat) -> bool:
    """Only an active server publishes updates, and only ours (active) say
    their heartbeat in HUGZ and view heartbeats; the Guide's passive servers
    send bare HUGZ too."""
    return not isinstance(msg, Hugz | ViewHeartbeat) or msg.heartbeat is not None
