"""The CHP server's decisions, without sockets or clocks.

How this works: :class:`ServerCore` takes events -- a client's KVSET, a KVPUB
or HUGZ from the active peer, a KVSYNC/KTHXBAI of the snapshot we asked the
peer for, a snapshot request, a role change, a timer tick -- each as raw frames
plus an explicit wall-clock ``now`` (and, where a TTL or a lease is involved,
the monotonic ``mono``: their deadlines never read the wall clock, see
:mod:`clone.server.ttl`; a caller with one clock, a test, may leave it out),
and answers with frames to publish or an outcome for the I/O layer to act on.
``clone.server.reactor`` owns the sockets and the reactor; this module owns
the rules:

* **Active**: a KVSET gets the next sequence and is republished (at most once
  per uuid within the dedup window); due ephemeral keys are deleted and the
  deletes published.
* **Passive**: follows the active server.  A full sync (snapshot into a staging
  map while buffering the live KVPUBs, then swap and replay) and afterwards
  every KVPUB in strict sequence order; a gap, or a HUGZ announcing a sequence
  we do not have, means "resync".  Client KVSETs wait in the pending list until
  the active server republishes them.  When a sync completes, the pending list
  keeps only updates the active server had provably *not* applied by the
  snapshot's sequence (it sends the ids it applied, :mod:`clone.wire.applied`): a
  snapshot holds only the last update of each key, so an update applied and
  superseded before it would otherwise stay pending and be applied again, over
  newer values, at a promotion (docs/failover.md, "Pending updates").
* **Promotion** (passive -> active): apply the pending list in arrival order,
  each with a fresh sequence, and publish every one of them.  Sequences carry on
  from the highest the server has seen anywhere, so they never go backwards.

The follower's sync state is a small table (:data:`SYNC_TRANSITIONS`), checked
on every change.  Bad input raises :class:`~clone.errors.ProtocolError` after
it has been counted; the caller logs it and carries on.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from clone.errors import IllegalTransitionError, LimitExceeded, ProtocolError, StoreFull
from clone.server.conflicts import ConflictBook, ConflictRecord
from clone.server.delta import DeltaStream, open_catch_up, open_history
from clone.server.history import History
from clone.server.journal import Journal
from clone.server.leases import (
    OWNER_PROPERTY,
    LeaseTable,
    bound_lease,
    format_lease_value,
    lease_owner,
    parse_lease_value,
)
from clone.server.ownership import grant_owner, may_use
from clone.server.pending import PendingList, PendingUpdate, UuidWindow, update_id
from clone.server.snapshot import SnapshotStream
from clone.server.split import split_writes
from clone.server.splitrule import Verdict, judge_split_write
from clone.server.store import Entry, Served, Store
from clone.server.ttl import parse_ttl, split_ttl_left
from clone.wire.applied import decode_kvapplied, encode_kvapplied, is_kvapplied, uuid_ids
from clone.wire.batch import decode_kvbatch, is_kvbatch
from clone.wire.calls import (
    CONFLICT_OPS,
    CONFLICT_PROPERTY,
    IF_SEQUENCE_PROPERTY,
    LEASE_PREFIX,
    LEASE_PROPERTY,
    OP_AHEAD,
    OP_CONFLICT_APPLY,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_SET,
    Call,
    Reply,
    acl_refusal,
    call_uuid,
    check_call,
    decode_call,
    lease_id_of,
    lease_key,
    parse_lease_ttl,
)
from clone.wire.codec import (
    Hugz,
    KVMsg,
    Properties,
    SnapshotEnd,
    decode_icanhaz,
    decode_kvset,
    decode_properties,
    decode_snapshot_reply,
    decode_update,
    encode_hugz,
    encode_kv,
    encode_properties,
)
from clone.wire.delta import SinceRequest, decode_kvdelta, is_kvdelta, update_digest
from clone.wire.protocol import TTL_PROPERTY
from clone.wire.split import SPLIT_PROPERTIES, SplitOrigin, parse_split_origin, uuid_time

__all__ = [
    "COUNTERS",
    "SYNC_TRANSITIONS",
    "CoreSettings",
    "FollowOutcome",
    "IllegalTransitionError",
    "Role",
    "ServerCore",
    "SyncEvent",
    "SyncState",
]


class Role(enum.Enum):
    """What the server does with client updates."""

    STARTING = "starting"  # Binary Star has not decided yet: park updates
    ACTIVE = "active"  # serve snapshots, sequence and publish updates
    PASSIVE = "passive"  # follow the active peer, park client updates
    RELAY = "relay"  # follow the pair like a client, serve and republish its copy


#: The roles that keep a copy of another server's state, in its sequences.
_FOLLOWERS = frozenset((Role.PASSIVE, Role.RELAY))


class SyncState(enum.Enum):
    """How far a passive server's copy of the state is."""

    IDLE = "idle"  # not following anybody (starting or active)
    SYNCING = "syncing"  # snapshot requested, staging entries, buffering KVPUBs
    SYNCED = "synced"  # applying the peer's KVPUBs in order


class SyncEvent(enum.Enum):
    FOLLOW = "follow"  # became passive, or a gap was found: (re)start a sync
    SNAPSHOT_DONE = "snapshot_done"  # KTHXBAI received and the buffer replayed
    STOP = "stop"  # promoted to active (or shutting down)


#: (state, event) -> next state.  Anything missing is a bug in the caller.
SYNC_TRANSITIONS: dict[tuple[SyncState, SyncEvent], SyncState] = {
    (SyncState.IDLE, SyncEvent.FOLLOW): SyncState.SYNCING,
    (SyncState.IDLE, SyncEvent.STOP): SyncState.IDLE,
    (SyncState.SYNCING, SyncEvent.FOLLOW): SyncState.SYNCING,
    (SyncState.SYNCING, SyncEvent.SNAPSHOT_DONE): SyncState.SYNCED,
    (SyncState.SYNCING, SyncEvent.STOP): SyncState.IDLE,
    (SyncState.SYNCED, SyncEvent.FOLLOW): SyncState.SYNCING,
    (SyncState.SYNCED, SyncEvent.STOP): SyncState.IDLE,
}


class FollowOutcome(enum.Enum):
    """What the I/O layer must do after a message from the peer."""

    OK = "ok"  # nothing
    SYNCED = "synced"  # the snapshot completed; stop the sync timer
    RESYNC = "resync"  # ask the active peer for a new snapshot


#: How much earlier than the applied list reaches a pending update must have
#: arrived to count as possibly covered by the snapshot: the passive may read a
#: client's copy of an update later than the active applied it (a busy loop, a
#: queue in its collector socket), so the list's reach is shortened by this.
APPLIED_SPAN_MARGIN = 1.0

#: Every counter :attr:`ServerCore.counters` holds, all starting at zero.
COUNTERS = (
    "kvset_received",
    "kvset_invalid",
    "kvset_duplicate",
    "kvset_pending",
    "kvset_held",
    "kvset_already_applied",
    "kvset_refused_full",
    "kvpub_published",
    "expired",
    "snapshot_requests",
    "snapshot_invalid",
    "peer_updates",
    "peer_stale",
    "peer_gaps",
    "peer_invalid",
    "peer_ignored",
    "sync_buffer_overflow",
    "syncs_started",
    "syncs_completed",
    "syncs_full",
    "syncs_catchup",
    "catchup_updates_received",
    "snapshot_entries_received",
    "pending_applied",
    "pending_skipped",
    "pending_failed",
    "applied_ids_received",
    "pending_already_applied",
    "pending_unverifiable",
    "promotions",
    "demotions",
    "split_writes_found",
    "split_writes_expired",
    "split_writes_unverified",
    "split_writes_held",
    # The winner's side of a heal (clone.server.splitrule, clone.server.conflicts).
    "split_calls_received",
    "split_calls_applied",
    "split_conflicts",
    "split_calls_refused_not_peer",
    "conflicts_applied",
    "conflicts_discarded",
    # Calls (CALL?/REPLY) and leases: docs/protocol.md, "CALL? / REPLY".
    "calls_received",
    "calls_ok",
    "calls_duplicate",
    "calls_conflict",
    "calls_invalid",
    "calls_not_active",
    "calls_unknown_lease",
    "calls_refused_full",
    "calls_refused_size",
    "calls_refused_busy",
    "calls_refused_acl",
    "calls_reserved",
    "calls_bad_if_sequence",
    "calls_bad_lease",
    "calls_bad_ttl",
    "calls_not_owner",
    "calls_refused_lease_quota",
    "calls_unknown_conflict",
    "kvset_conflict",
    "kvset_unknown_lease",
    "kvset_lease_refused",
    "kvset_reserved",
    "leases_granted",
    "leases_revoked",
    "leases_expired",
    "lease_keepalives",
    "lease_keys_deleted",
    "lease_orphans_deleted",
)


@dataclass(slots=True)
class _Kept:
    """A demoted active's writes kept for the winner, with what its rule needs."""

    written: Sequence[Sequence[bytes]]
    fork: int
    at: float
    term: int
    conditions: dict[bytes, int]
    #: Each key's last update converted so far (clone.server.split, ``last``).
    last: dict[bytes, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """The limits of a server core (see docs/operations.md for the defaults' reasons)."""

    dedup_window: int = 65_536
    pending_max: int = 100_000
    pending_max_age: float = 30.0
    #: ... and its bytes (keys and values; 0: no byte bound), issue 26.
    pending_max_bytes: int = 64 * 1024 * 1024
    sync_buffer_max: int = 200_000
    expiry_batch: int = 10_000
    #: The update history kept for catch-up (docs/operations.md, "Durability").
    history_max: int = 100_000
    history_bytes: int = 64 * 1024 * 1024
    #: The most keys and bytes (keys, values, properties) the store holds; a
    #: write beyond them is refused (docs/operations.md, "Limits").  0: no limit.
    max_keys: int = 10_000_000
    max_bytes: int = 4 * 1024**3
    #: The most leases the active server holds; a grant beyond is refused (busy).
    max_leases: int = 100_000
    #: The most leases one client (principal: docs/operations.md, "Leases")
    #: holds; a grant beyond is refused (lease-quota).
    max_leases_per_client: int = 1_000

    def __post_init__(self) -> None:
        for name in (
            "dedup_window",
            "pending_max",
            "sync_buffer_max",
            "expiry_batch",
            "history_max",
            "history_bytes",
            "max_leases",
            "max_leases_per_client",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.pending_max_age <= 0:
            raise ValueError(f"pending_max_age must be positive, not {self.pending_max_age}")


_LEASE_PREFIX_RAW = LEASE_PREFIX.encode()


def _mono(mono: float | None, now: float) -> float:
    """The monotonic time given, or ``now`` for a caller with one clock (a test)."""
    return now if mono is None else mono


def _check_condition_syntax(msg: KVMsg) -> None:
    """A KVSET's ``if_sequence``/``lease`` must be well-formed (as a call's)."""
    if msg.prop(IF_SEQUENCE_PROPERTY) is None and msg.prop(LEASE_PROPERTY) is None:
        return
    problem = check_call(Call(OP_SET, b"", msg.key, msg.properties, msg.body))
    if problem is not None:
        raise ProtocolError(problem[1])


def _refused(uuid: bytes, reason: str, detail: str) -> Reply:
    return Reply(uuid, "refused", reason=reason, detail=detail)


def _split_conflict_reply(rec: ConflictRecord) -> Reply:
    """The answer to a split write kept as conflict ``rec``: status conflict,
    reason ``split``, the record's id in the detail (docs/protocol.md)."""
    return Reply(
        rec.loser_uuid,
        "conflict",
        current=rec.winner_seq,
        reason="split",
        detail=f"conflict {rec.id}: {rec.reason}",
    )


def _without_split(call: Call) -> Call:
    """A split write as the plain ``set`` it is, without the peer-only properties."""
    props = tuple((n, v) for n, v in call.properties if n not in SPLIT_PROPERTIES)
    return Call(call.op, call.uuid, call.key, props, call.body)


def _conflict(
    call: Call, origin: SplitOrigin, verdict: Verdict, entry: Entry | None, now: float
) -> ConflictRecord:
    """The record of a split write not applied, with the winner's value of its key."""
    winner_uuid = None if entry is None else bytes(entry[1])
    return ConflictRecord(
        id=0,
        key=call.key.encode("utf-8"),
        reason=verdict.value,
        loser_uuid=call.uuid,
        loser_props=encode_properties(call.properties),
        loser_body=call.body,
        loser_at=origin.at,
        loser_term=origin.term,
        winner_seq=0 if entry is None else int.from_bytes(entry[0], "big"),
        winner_uuid=winner_uuid,
        winner_props=None if entry is None else bytes(entry[2]),
        winner_body=None if entry is None else bytes(entry[3]),
        winner_at=None if not winner_uuid else uuid_time(winner_uuid),
        recorded=now,
    )


def _any_key(key: bytes) -> bool:
    """No ACL: every key may be written."""
    return True


#: The counter of each problem :func:`~clone.wire.calls.check_call` finds.
_PROBLEM_COUNTERS: dict[str, str] = {
    "reserved": "calls_reserved",
    "bad-if-sequence": "calls_bad_if_sequence",
    "bad-lease": "calls_bad_lease",
    "bad-ttl": "calls_bad_ttl",
    "bad-secret": "calls_bad_lease",
}


class ServerCore:
    """One server's state and rules.  Not thread-safe: one reactor drives it."""

    def __init__(
        self,
        settings: CoreSettings | None = None,
        *,
        standalone: bool = False,
        durable: bool = False,
        relay: bool = False,
    ) -> None:
        self.settings = settings or CoreSettings()
        self.store = Store(max_keys=self.settings.max_keys, max_bytes=self.settings.max_bytes)
        #: Every change to the state since the reactor last committed it, in
        #: order (snapshot staging only when ``durable``: there is a database).
        self.journal = Journal(stage=durable)
        #: The most recent updates, for a peer's catch-up (clone.server.delta).
        self.history = History(self.settings.history_max, self.settings.history_bytes)
        #: The term (Binary Star epoch) updates are recorded under; the reactor
        #: sets it on every role change.
        self.term = 0
        self.window = UuidWindow(self.settings.dedup_window)
        self.pending = PendingList(
            self.settings.pending_max,
            self.settings.pending_max_age,
            self.settings.pending_max_bytes,
        )
        #: The leases, their deadlines and keys: meaningful on the active
        #: server only, rebuilt from the store when it becomes active.
        self.leases = LeaseTable(self.settings.max_leases)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.role = Role.ACTIVE if standalone else Role.RELAY if relay else Role.STARTING
        #: The sequence we had applied when we last became active (KVAPPLIED's
        #: ``fork``): a peer active at the same time forwards its writes after it.
        self.promoted_at: int | None = None
        # Demoted from active: the updates we wrote in our term, until the
        # winner's fork says which it lacks (clone.server.split).
        self._written_as_active: Sequence[Sequence[bytes]] = []
        self._peer_fork: int | None = None
        # After a split brain, the writes kept for the winner and its fork (and
        # the time they were kept), turned into SET calls a slice at a time
        # (take_split_calls: 100k at once blocked the loop); how far into the
        # first the conversion is; and the calls converted but not yet taken.
        self._split_kept: deque[_Kept] = deque()
        self._split_kept_at = 0
        self._split_converted: list[list[bytes]] = []
        # The ids the winner said it applied, at the resync that kept them:
        # elected again, we must not apply those a second time.
        self._split_peer_applied: set[bytes] | frozenset[bytes] = frozenset()
        #: Writes of ours after a split brain that no fork let us sort (logged once).
        self.split_unverified = 0
        # The if_sequence of each conditional write we applied as active in
        # this term, by uuid (a stored update no longer says it), and at a
        # demotion the term we wrote under: what a split write carries.
        self._conditions: dict[bytes, int] = {}
        self._written_conditions: dict[bytes, int] = {}
        self._written_term = 0
        # Judging split writes: the fork, the sequence the history was read up
        # to, and every key updated after the fork (None: the history does
        # not reach back to it).
        self._fork_keys: tuple[int, int, set[bytes] | None] | None = None
        #: Split-brain writes of a loser this server did not apply (the winner's side).
        self.conflicts = ConflictBook()
        #: Winning a split brain: client updates are parked until the loser's
        #: forwarded writes are in (hold_writes); when the last of those came.
        self.holding = False
        self.split_call_at = 0.0
        self.sync_state = SyncState.IDLE
        #: The highest sequence seen anywhere (own store, peer KVPUB/HUGZ/KTHXBAI).
        self.highest_seen = 0
        self._staging: dict[bytes, Entry] = {}
        # Staged entries that came with a ttl-left: when they expire (monotonic).
        self._staged_deadlines: dict[bytes, float] = {}
        self._buffer: list[tuple[KVMsg, Sequence[bytes], float]] = []
        self._buffer_overflowed = False
        # This sync: a catch-up (KVDELTA came first) rather than a full
        # snapshot; and whether the database's staging area was emptied yet.
        self._delta = False
        self._staging_begun = False
        # The peer answered our last catch-up request wrongly: ask plainly once.
        self._plain_sync_next = False
        #: What the last completed sync was: "full" (a snapshot) or "catch-up".
        self.last_sync = ""
        # The ids the active said it applied up to this sync's snapshot, and the
        # arrival time before which a pending update may predate that list;
        # None until a KVAPPLIED of the current sync arrives.
        self._peer_applied: set[bytes] | None = None
        self._peer_applied_order: list[bytes] = []
        self._peer_applied_since = 0.0

    # -- client side ---------------------------------------------------------

    def on_kvset(
        self, frames: Sequence[bytes], now: float, mono: float | None = None
    ) -> list[bytes] | None:
        """A KVSET at the collector; returns the KVPUB frames to publish, if any.

        Raises ProtocolError (counted) for a malformed or invalid update.
        """
        c = self.counters
        c["kvset_received"] += 1
        try:
            msg = decode_kvset(frames)
        except ProtocolError:
            c["kvset_invalid"] += 1
            raise
        if self.role is Role.ACTIVE and not self.holding:
            uuid = msg.uuid
            if uuid and uuid in self.window:
                c["kvset_duplicate"] += 1
                return None
            reuse: Sequence[bytes] | None = frames
            if frames[0].startswith(_LEASE_PREFIX_RAW) or msg.properties:
                plain = self._check_kvset(msg, frames[0])
                if plain is not msg:
                    msg, reuse = plain, None
            try:
                # The received frames are reused: stored and published as they
                # are, with the new sequence (and expires, if any).
                out = self.store.apply(msg, _mono(mono, now), reuse, wall=now)
            except StoreFull:
                c["kvset_refused_full"] += 1
                raise
            except ProtocolError:
                c["kvset_invalid"] += 1
                raise
            if uuid:
                self.window.add(uuid, now)
            if msg.properties:
                self._bind_if_leased(msg, frames[0])
            c["kvpub_published"] += 1
            self._record(out)
            return out
        # Passive or starting, or holding client updates while a split brain
        # heals: validate now, so that applying them later cannot fail on it.
        if self.holding:
            c["kvset_held"] += 1
        if frames[0].startswith(_LEASE_PREFIX_RAW):
            c["kvset_reserved"] += 1
            raise ProtocolError(f"key {msg.key[:80]!r}: keys under {LEASE_PREFIX} are the server's")
        if msg.properties:
            try:
                parse_ttl(msg.prop(TTL_PROPERTY))
                _check_condition_syntax(msg)
            except ProtocolError:
                c["kvset_invalid"] += 1
                raise
        if msg.uuid and msg.uuid in self.window:
            c["kvset_already_applied"] += 1
            return None
        if self.pending.add(msg, now, _mono(mono, now)):
            c["kvset_pending"] += 1
        else:
            c["kvset_duplicate"] += 1
        return None

    def snapshot_request(self, frames: Sequence[bytes]) -> str:
        """Decode an ICANHAZ? (without its identity frame); return the subtree.

        Raises ProtocolError (counted).  The caller then checks the Binary Star
        vote and only if it may serve calls :meth:`open_snapshot`, so that a
        promotion triggered by the vote is already in the snapshot.
        """
        self.counters["snapshot_requests"] += 1
        try:
            return decode_icanhaz(frames).subtree
        except ProtocolError:
            self.counters["snapshot_invalid"] += 1
            raise

    def open_snapshot(
        self,
        identity: bytes,
        subtree: str,
        *,
        batch: bool = False,
        applied: bool = False,
        now: float = 0.0,
        since: SinceRequest | None = None,
        allowed: Sequence[bytes] | None = None,
        end_properties: Properties = (),
        clock: Callable[[], float] | None = None,
    ) -> SnapshotStream | DeltaStream:
        """Start streaming the current state under ``subtree`` to ``identity``.

        ``batch``: the requester negotiated KVBATCH (:mod:`clone.wire.batch`).
        ``applied``: it asked for the applied-update list (:mod:`clone.wire.applied`),
        which then goes first, as of ``now``.  ``since``: it holds our state
        up to a sequence and asks only for what followed (:mod:`clone.wire.delta`);
        it gets that if the history still reaches back to it, else the whole state.
        A history request (``since`` without a digest, a client's) always gets
        a delta, filtered by ``subtree`` and ``allowed``, or a compacted reply.
        ``allowed``: the requester may read only keys under these prefixes
        (clone.server.security); ``end_properties`` go into its KTHXBAI.
        ``clock`` (monotonic; given for a peer server that asked for it) is read
        as entries go out, so that an ephemeral key carries the time it has
        left (:meth:`Store.served`); without it entries go out as stored.
        """
        served = self._served(clock)
        preamble: list[list[bytes]] = []
        if applied:
            window = self.window
            fork = self.promoted_at if self.role is Role.ACTIVE else None
            preamble = encode_kvapplied(
                self.store.sequence, uuid_ids(window.ids()), window.span(now), fork
            )
        if since is not None and since.history:
            # A client's history request: the updates it asked for, or why not;
            # never a snapshot.
            return open_history(
                self.history,
                since,
                identity,
                self.store.sequence,
                preamble,
                subtree=subtree,
                allowed=allowed,
                end_properties=end_properties,
            )
        if since is not None and not subtree and allowed is None:
            delta = open_catch_up(
                self.history,
                since,
                identity,
                self.store.sequence,
                preamble,
                served=served,
            )
            if delta is not None:
                return delta
        return SnapshotStream(
            identity,
            subtree,
            self.store,
            batch=batch,
            preamble=preamble,
            allowed=allowed,
            end_properties=end_properties,
            served=served,
        )

    def _served(self, clock: Callable[[], float] | None) -> Served | None:
        """How entries go out to a peer: an ephemeral one with the time it has left."""
        if clock is None:
            return None
        store = self.store

        def served(raw_key: bytes, entry: Entry) -> Entry:
            return store.served(raw_key, entry, clock())

        return served

    def hugz(self, heartbeat_ms: int | None = None) -> list[bytes]:
        """A heartbeat carrying the current highest sequence and, given
        ``heartbeat_ms``, the interval clients should expect (our extensions)."""
        return encode_hugz(self.store.sequence, heartbeat_ms)

    # -- roles ---------------------------------------------------------------

    def become_active(self, now: float, mono: float | None = None) -> list[list[bytes]]:
        """Promotion: apply the pending list, return the KVPUBs to publish.

        Every lease gets its whole ttl from ``mono``; a parked write's ttl
        counts from when it arrived.

        Idempotent: a second call while active returns nothing.
        """
        if self.role is Role.ACTIVE:
            return []
        c = self.counters
        c["promotions"] += 1
        if self.sync_state is SyncState.SYNCING:
            # The snapshot will never complete; keep the last whole state and
            # whatever of the buffered updates follows it without a gap.
            self._staging = {}
            self._staged_deadlines = {}
            self._replay_buffer(self.store.sequence, now, _mono(mono, now))
        self._forget_peer_applied()
        self._sync(SyncEvent.STOP)
        self.role = Role.ACTIVE
        store = self.store
        self.promoted_at = store.sequence
        self._written_as_active = []
        self._conditions = {}
        self._fork_keys = None
        store.sequence = max(store.sequence, self.highest_seen)
        out = self._rebuild_leases(_mono(mono, now))
        out += self._apply_pending(now)
        self.highest_seen = store.sequence
        return out

    def hold_writes(self) -> None:
        """A split brain this active server wins: park client updates (KVSETs)
        as a passive does, until :meth:`release_held`, so that the writes the
        stepped-down peer forwards are judged first and those of its clients
        that reach us directly, late (queued in TCP through the partition), are
        not applied ahead of them (docs/failover.md, "Writes of a split brain")."""
        if self.role is Role.ACTIVE:
            self.holding = True

    def release_held(self, now: float) -> list[list[bytes]]:
        """End :meth:`hold_writes`: apply what was parked, in arrival order (a
        write the peer forwarded meanwhile is in the uuid window: skipped)."""
        if not self.holding:
            return []
        self.holding = False
        return self._apply_pending(now)

    def _apply_pending(self, now: float) -> list[list[bytes]]:
        """Apply the pending list as active, in arrival order."""
        c = self.counters
        store = self.store
        out: list[list[bytes]] = []
        applied = 0
        for parked in self.pending.drain():
            msg = parked.msg
            if msg.uuid and msg.uuid in self.window:
                c["pending_skipped"] += 1
                continue
            raw_key = msg.key.encode("utf-8")
            try:
                if msg.properties:
                    msg = self._check_kvset(msg, raw_key)
                # ttl counts from when the client sent it, not from now.
                pub = store.apply(msg, parked.mono, wall=parked.arrived)
            except ProtocolError:
                c["pending_failed"] += 1
                continue
            if msg.uuid:
                self.window.add(msg.uuid, now)
            self._bind_if_leased(msg, raw_key)
            self._record(pub)
            out.append(pub)
            applied += 1
        c["pending_applied"] += applied
        c["kvpub_published"] += applied
        return out

    def become_passive(self) -> None:
        """Demotion or first decision: the caller must now start a sync."""
        self.holding = False
        if self.role is Role.ACTIVE:
            self.counters["demotions"] += 1
            # What we wrote as active: the winner of a split brain may lack some.
            self._written_as_active = self.history.written_under(self.term)
            self._written_term = self.term
            self._written_conditions, self._conditions = self._conditions, {}
        self.promoted_at = None
        self.role = Role.PASSIVE
        # Only the active server keeps time for leases; a new one rebuilds them.
        self.leases.clear()

    # -- following the active peer -------------------------------------------

    def start_sync(self) -> None:
        """(Re)start a full sync: the caller sends ICANHAZ? on a fresh socket."""
        self._sync(SyncEvent.FOLLOW)
        self.counters["syncs_started"] += 1
        self._staging = {}
        self._staged_deadlines = {}
        self._buffer = []
        self._buffer_overflowed = False
        self._delta = False
        self._staging_begun = False
        self._peer_fork = None
        self._forget_peer_applied()

    def catch_up_request(self) -> SinceRequest | None:
        """What to ask the active for instead of a full snapshot, if anything.

        Our state up to our sequence, named by the digest of its last update
        (:mod:`clone.wire.delta`): the active sends only what follows, if its
        history reaches back to it and holds the same update there.  After a
        full snapshot that no update followed, the history holds nothing, but
        the store may: the key written at our sequence holds that update's
        frames (a relay that synced and then saw its upstream fail over would
        otherwise always resync in full).  None (a full snapshot) when we hold
        nothing, or not the last update itself (it was a delete).
        """
        seq = self.store.sequence
        if self._plain_sync_next:
            self._plain_sync_next = False
            return None
        if seq == 0:
            return None
        held = self.history.entry(seq)
        last = held[0] if held is not None else self.store.last_update()
        if last is None:
            return None
        return SinceRequest(seq, update_digest(last))

    def on_peer_update(
        self, frames: Sequence[bytes], now: float, mono: float | None = None
    ) -> FollowOutcome:
        """A KVPUB or HUGZ from the active peer's publisher, received at ``now``
        (``mono``: the same moment on the monotonic clock)."""
        c = self.counters
        if self.role not in _FOLLOWERS:
            c["peer_ignored"] += 1
            return FollowOutcome.OK
        try:
            msg = decode_update(frames)
        except ProtocolError:
            c["peer_invalid"] += 1
            raise
        state = self.sync_state
        if isinstance(msg, Hugz):
            seq = msg.sequence
            if seq > self.highest_seen:
                self.highest_seen = seq
            if state is SyncState.SYNCED and seq != self.store.sequence:
                # Higher: we missed its tail.  Lower: it is not the state we
                # follow (a restarted peer).  Either way, start over.
                c["peer_gaps"] += 1
                return FollowOutcome.RESYNC
            return FollowOutcome.OK
        c["peer_updates"] += 1
        if msg.sequence > self.highest_seen:
            self.highest_seen = msg.sequence
        if state is SyncState.SYNCED:
            return self._follow(msg, now, frames, _mono(mono, now))
        if state is SyncState.SYNCING:
            if len(self._buffer) < self.settings.sync_buffer_max:
                # With when it came: a replayed ttl counts from then.
                self._buffer.append((msg, frames, _mono(mono, now)))
            elif not self._buffer_overflowed:
                # The replay will hit a gap and resync; better than unbounded memory.
                self._buffer_overflowed = True
                c["sync_buffer_overflow"] += 1
        return FollowOutcome.OK

    def on_snapshot_reply(
        self, frames: Sequence[bytes], now: float, mono: float | None = None
    ) -> FollowOutcome:
        """A KVSYNC, KVBATCH, KVAPPLIED or KTHXBAI of the snapshot we asked the
        peer for, received at ``now`` (``mono``: the same moment, monotonic)."""
        c = self.counters
        if self.sync_state is not SyncState.SYNCING or self.role not in _FOLLOWERS:
            c["peer_ignored"] += 1
            return FollowOutcome.OK
        if is_kvbatch(frames):
            if self._written_as_active and self._peer_fork is not None:
                self._settle_split_writes(now, self._peer_applied)
            if self._delta:
                c["peer_invalid"] += 1
                raise ProtocolError("KVBATCH in a catch-up (KVDELTA) reply")
            self._stage_batch(frames, _mono(mono, now))
            return FollowOutcome.OK
        if is_kvapplied(frames):
            self._note_peer_applied(frames, now)
            return FollowOutcome.OK
        if self._written_as_active and self._peer_fork is not None:
            # The applied lists came first and are complete: the winner's fork
            # is known, so our split writes can go now, not after the whole
            # snapshot (seconds for a large store), while our clients' direct
            # copies race them to the winner (docs/failover.md).
            self._settle_split_writes(now, self._peer_applied)
        if is_kvdelta(frames):
            return self._begin_delta(frames)
        left: float | None = None
        if len(frames) == 5 and frames[3]:
            # A peer's entry may end with ttl-left: cut off, so we store what it stores.
            props, left = split_ttl_left(frames[3])
            if props is not frames[3]:
                frames = [frames[0], frames[1], frames[2], props, frames[4]]
        try:
            msg = decode_snapshot_reply(frames)
        except ProtocolError:
            c["peer_invalid"] += 1
            raise
        if isinstance(msg, SnapshotEnd):
            if msg.subtree:
                c["peer_invalid"] += 1
                raise ProtocolError(f"KTHXBAI for subtree {msg.subtree!r}, we asked for all")
            return self._end_sync(msg.sequence, now, _mono(mono, now))
        if self._delta:
            return self._catch_up(msg, frames, now, _mono(mono, now), left)
        c["snapshot_entries_received"] += 1
        if msg.body:
            # Stored as received (decoded once, to validate): see clone.server.store.
            entry = (frames[1], frames[2], frames[3], frames[4])
            self._staging[frames[0]] = entry
            if left is not None:
                # The time it had left when sent counts from now, when it came.
                self._staged_deadlines[frames[0]] = _mono(mono, now) + left
            if self.journal.stages:
                self._begin_staging()
                self.journal.stage(((frames[0], entry),))
        if msg.uuid:
            # The active applied it: the client's direct copy is no longer pending.
            self.pending.confirm(msg.uuid)
        return FollowOutcome.OK

    def _begin_staging(self) -> None:
        """The first entry of a full snapshot: the database empties its staging area."""
        if not self._staging_begun:
            self._staging_begun = True
            self.journal.begin_replace()

    def _begin_delta(self, frames: Sequence[bytes]) -> FollowOutcome:
        """KVDELTA: the active sends only what follows our sequence (a catch-up)."""
        c = self.counters
        try:
            after: int | None = decode_kvdelta(frames)
        except ProtocolError:
            after = None
        if (
            after != self.store.sequence
            or self._delta
            or self._staging
            or self._staging_begun
        ):
            # Malformed, not what we asked for, or not first: what follows
            # cannot be trusted either way (read as a snapshot it would replace
            # our state with a few updates).  Start over with a plain request.
            c["peer_invalid"] += 1
            self._plain_sync_next = True
            return FollowOutcome.RESYNC
        self._delta = True
        return FollowOutcome.OK

    def _catch_up(
        self, msg: KVMsg, frames: Sequence[bytes], now: float, mono: float, left: float | None
    ) -> FollowOutcome:
        """One update of a catch-up: applied in place, in strict order, like a KVPUB.

        Our state stays a prefix of the active's history after every one, so a
        catch-up cut short leaves a whole (older) state, not a mix.
        """
        self.counters["catchup_updates_received"] += 1
        if msg.sequence > self.highest_seen:
            self.highest_seen = msg.sequence
        return self._follow(msg, now, frames, mono, left)

    def _end_sync(self, sequence: int, now: float, mono: float) -> FollowOutcome:
        """KTHXBAI: swap in the snapshot (or finish the catch-up), replay the buffer."""
        c = self.counters
        if self._delta:
            if self.store.sequence != sequence:
                c["peer_gaps"] += 1
                return FollowOutcome.RESYNC
            c["syncs_catchup"] += 1
            self.last_sync = "catch-up"
        else:
            self.store.replace(self._staging, sequence, mono, self._staged_deadlines)
            self._staging = {}
            self._staged_deadlines = {}
            self.history.reset(sequence)
            if self.journal.stages:
                self._begin_staging()  # an empty snapshot stages nothing
            self.journal.replace(sequence)
            c["syncs_full"] += 1
            self.last_sync = "full"
        self._delta = False
        if sequence > self.highest_seen:
            self.highest_seen = sequence
        if not self._replay_buffer(sequence, now, mono):
            c["peer_gaps"] += 1
            return FollowOutcome.RESYNC
        peer_applied = self._peer_applied
        self._reconcile_pending(now)
        self._sync(SyncEvent.SNAPSHOT_DONE)
        c["syncs_completed"] += 1
        self._settle_split_writes(now, peer_applied)
        return FollowOutcome.SYNCED

    def _settle_split_writes(self, now: float, peer_applied: set[bytes] | None) -> None:
        """Synced after a demotion: keep, as calls, what we wrote that the
        active (elected while we were active too) cannot hold."""
        written, self._written_as_active = self._written_as_active, []
        if not written:
            return
        self._split_peer_applied = peer_applied or frozenset()
        c = self.counters
        if self._peer_fork is None:
            # A Guide peer, or ours from before forks: we cannot tell which of
            # our writes it lacks, and resending all would undo newer ones.
            c["split_writes_unverified"] += len(written)
            self.split_unverified += len(written)
            return
        # Converted to calls later, a slice per loop turn (take_split_calls),
        # with what the winner's rule needs of each (clone.wire.split).
        conditions, self._written_conditions = self._written_conditions, {}
        self._split_kept.append(
            _Kept(written, self._peer_fork, now, self._written_term, conditions)
        )

    @property
    def split_left(self) -> int:
        """Kept split-brain writes not yet taken as calls (an upper bound on
        the calls to come: some will be left out)."""
        kept = sum(len(k.written) for k in self._split_kept)
        return len(self._split_converted) + kept - self._split_kept_at

    def take_split_calls(self, limit: int) -> list[list[bytes]]:
        """The next SET calls for the active peer after a split brain: the
        converted ones, then :func:`split_writes` of at most ``limit`` more
        kept writes (the ttl left is counted from when they were kept)."""
        out, self._split_converted = self._split_converted, []
        kept = self._split_kept
        c = self.counters
        while kept and limit > 0:
            first = kept[0]
            start = self._split_kept_at
            part = first.written[start : start + limit]
            limit -= len(part)
            self._split_kept_at = start + len(part)
            if self._split_kept_at >= len(first.written):
                kept.popleft()
                self._split_kept_at = 0
            # The previous write of a key may be in an earlier slice:
            # first.last carries it from slice to slice (clone.server.split).
            split = split_writes(
                part,
                first.fork,
                first.at,
                term=first.term,
                conditions=first.conditions,
                last=first.last,
            )
            out += split.calls
            c["split_writes_found"] += len(split.calls)
            c["split_writes_expired"] += split.expired
        return out

    @property
    def split_calls(self) -> list[list[bytes]]:
        """Every SET call still to send the active peer after a split brain,
        all converted at once (tests; the reactor takes slices instead).
        The list itself: clearing it drops them."""
        calls = self.take_split_calls(self.split_left)
        self._split_converted = calls
        return calls

    def drop_split_calls(self) -> int:
        """Forget the kept writes not yet taken; returns how many there were."""
        left = self.split_left
        self._split_kept.clear()
        self._split_kept_at = 0
        self._split_converted = []
        self._split_peer_applied = frozenset()
        return left

    def _stage_batch(self, frames: Sequence[bytes], mono: float) -> None:
        """A KVBATCH of the snapshot we asked for: stage its entries as KVSYNCs."""
        try:
            batch = decode_kvbatch(frames)
        except ProtocolError:
            self.counters["peer_invalid"] += 1
            raise
        self.counters["snapshot_entries_received"] += len(batch)
        # Stored as received, like a KVSYNC's frames (see clone.server.store),
        # less a trailing ttl-left: the time left when sent counts from now.
        raw_properties = batch.raw_properties
        if any(raw_properties):
            raw_properties = self._cut_ttl_left(batch.raw_keys, raw_properties, mono)
        values = zip(
            batch.sequence_frames(), batch.uuids, raw_properties, batch.bodies, strict=True
        )
        entries = zip(batch.raw_keys, values, strict=True)
        if self.journal.stages:
            # The database stages the same entries (an in-memory server skips this list).
            kept = [kv for kv in entries if kv[1][3]]
            self._staging.update(kept)
            self._begin_staging()
            self.journal.stage(kept)
        elif all(batch.bodies):
            self._staging.update(entries)
        else:
            self._staging.update(kv for kv in entries if kv[1][3])
        if self.pending:
            # The active applied them: their direct copies are no longer pending.
            confirm = self.pending.confirm
            for uuid in batch.uuids:
                if uuid:
                    confirm(uuid)

    def _cut_ttl_left(
        self, raw_keys: Sequence[bytes], raw_properties: Sequence[bytes], mono: float
    ) -> list[bytes]:
        """A batch's properties without their ttl-left; each one's deadline staged."""
        out: list[bytes] = []
        deadlines = self._staged_deadlines
        for key, props in zip(raw_keys, raw_properties, strict=True):
            if props:
                props, left = split_ttl_left(props)
                if left is not None:
                    deadlines[key] = mono + left
            out.append(props)
        return out

    def _note_peer_applied(self, frames: Sequence[bytes], now: float) -> None:
        """A KVAPPLIED of the snapshot we asked for: remember its ids."""
        try:
            applied = decode_kvapplied(frames)
        except ProtocolError:
            self.counters["peer_invalid"] += 1
            raise
        if self._peer_applied is None:
            self._peer_applied = set()
            # A list that reaches back a finite time is trusted a margin less.
            self._peer_applied_since = now - applied.span + APPLIED_SPAN_MARGIN
        if applied.fork is not None:
            self._peer_fork = applied.fork
        self._peer_applied.update(applied.ids)
        self._peer_applied_order += applied.ids
        self.counters["applied_ids_received"] += len(applied.ids)

    def _forget_peer_applied(self) -> None:
        self._peer_applied = None
        self._peer_applied_order = []

    def _reconcile_pending(self, now: float) -> None:
        """A sync completed: keep only pending updates the active had not applied.

        The rule of docs/failover.md, "Pending updates".  A pending update the
        active applied by the snapshot's sequence is in the snapshot, or was
        superseded by what is: it goes, and its id joins the window, so a late
        copy from its client is not parked again.  One the list cannot vouch for
        (no list from this peer, no uuid, or it arrived before the list reaches)
        goes too: if the active applied it, the snapshot covers it; if not, it
        was never confirmed, and its writer resends it until it is.  The rest
        were not applied by the snapshot's sequence: they stay, to be confirmed
        by a later KVPUB or applied at a promotion.
        """
        applied = self._peer_applied
        since = self._peer_applied_since
        window = self.window
        if applied is not None:
            add = window.add
            for uid in self._peer_applied_order:
                add(uid, now)
        window.limit_history(since if applied is not None else now)
        self._forget_peer_applied()
        c = self.counters
        if not self.pending:
            return
        gone_applied = 0

        def keep(parked: PendingUpdate) -> bool:
            nonlocal gone_applied
            uuid = parked.msg.uuid
            if applied is not None and uuid in applied:
                gone_applied += 1
                return False
            return applied is not None and bool(uuid) and parked.arrived >= since

        gone = self.pending.retain(keep)
        c["pending_already_applied"] += gone_applied
        c["pending_unverifiable"] += gone - gone_applied

    # -- calls and leases (docs/protocol.md, "CALL? / REPLY") ------------------

    def on_call(
        self,
        frames: Sequence[bytes],
        now: float,
        mono: float | None = None,
        *,
        can_write: Callable[[bytes], bool] | None = None,
        may_lease: bool = True,
        caller: str = "",
        relayed: bool = False,
        peer: bool = False,
    ) -> tuple[Reply | None, bool]:
        """A CALL? (without its identity frame); returns the reply and whether
        it must wait for this turn's commit (it changed the state).

        The reply is None only for a call too broken to answer (no uuid).
        Leases and a ``set``'s ttl count on the monotonic ``mono``.
        ``can_write``: the caller's write ACL (CURVE), None for no ACL; it
        judges a call's :func:`~clone.wire.calls.acl_key` (a ``set``'s key, a
        grant's named key).  ``may_lease``: whether the caller may write
        somewhere at all, which is what a call without such a key needs (an
        unnamed grant, a keepalive, a revoke).  The rule itself is
        :func:`~clone.wire.calls.acl_refusal`, shared with the relays.

        ``caller``: the caller's principal (:mod:`clone.server.ownership`);
        ``relayed``: it is a relay the pair trusts, so the call's ``caller=``
        names who asked it and stands for the caller; from anyone else a
        ``caller=`` is refused.  Only a lease's owner may keep it alive,
        revoke it or bind a key to it (``not-owner``).

        Each refusal has its own counter (``_PROBLEM_COUNTERS``, ``size``,
        ``malformed``), so an operator can tell a client sending nonsense
        from one sending too much.

        ``peer``: the caller is the peer server (or there is no way to tell:
        no CURVE).  Only a peer's ``set`` may carry the split-brain properties
        (:mod:`clone.wire.split`); it is then judged by the heal's rule.
        """
        c = self.counters
        c["calls_received"] += 1
        try:
            call = decode_call(frames)
        except ProtocolError as exc:
            oversized = isinstance(exc, LimitExceeded)
            c["calls_refused_size" if oversized else "calls_invalid"] += 1
            uuid = call_uuid(frames)
            if uuid is None:
                return None, False
            return _refused(uuid, "size" if oversized else "malformed", str(exc)), False
        problem = check_call(call)
        if problem is not None:
            c[_PROBLEM_COUNTERS.get(problem[0], "calls_invalid")] += 1
            return _refused(call.uuid, *problem), False
        why = acl_refusal(call, can_write or _any_key, may_lease)
        if why is not None:
            c["calls_refused_acl"] += 1
            return _refused(call.uuid, "acl", why), False
        claimed = call.caller
        if claimed is not None:
            if relayed:
                caller = claimed
            elif call.op != OP_SET or call.lease is not None:
                # Whose lease it is would rest on an unchecked word: fail closed.
                # (A write with no lease is the same whoever asked: let it be.)
                c["calls_refused_acl"] += 1
                why = "only a relay the pair trusts (--trusted-relay) may name a caller"
                return _refused(call.uuid, "acl", why), False
        if self.role is not Role.ACTIVE:
            c["calls_not_active"] += 1
            return _refused(call.uuid, "not-active", f"this server is {self.role.value}"), False
        mono = _mono(mono, now)
        if call.op == OP_SET:
            if any(name in SPLIT_PROPERTIES for name, _ in call.properties):
                return self._call_split(call, now, mono, peer, caller)
            return self._call_set(call, now, mono, caller)
        if call.op == OP_LEASE_GRANT:
            return self._call_grant(call, now, mono, caller)
        if call.op == OP_AHEAD:
            return self._call_ahead(call), False
        if call.op in CONFLICT_OPS:
            return self._call_conflict(call, now, mono)
        lease_id = call.lease
        assert lease_id is not None  # check_call
        held = self.leases.get(lease_id)
        if held is None:
            c["calls_unknown_lease"] += 1
            return _refused(call.uuid, "unknown-lease", f"no lease {lease_id}"), False
        if not may_use(held.owner, caller, call.secret):
            return self._not_owner(call.uuid, lease_id, held.owner), False
        if call.op == OP_LEASE_KEEPALIVE:
            lease = self.leases.keepalive(lease_id, mono)
            assert lease is not None  # held
            c["lease_keepalives"] += 1
            c["calls_ok"] += 1
            return Reply(call.uuid, "ok", lease=lease_id, ttl=lease.ttl), False
        # lease-revoke
        self._end_lease(lease_id, mono)
        c["leases_revoked"] += 1
        c["calls_ok"] += 1
        return Reply(call.uuid, "ok", self.store.sequence, lease=lease_id, ttl=held.ttl), True

    def _call_ahead(self, call: Call) -> Reply:
        """How many contenders are ahead of ``call.key`` in its lock's queue.

        The recipe's rule (clone.recipes), told by the server to a contender
        that may not read the queue: lease-bound keys under the key's parent
        with a lower sequence.  A scan of the live leases' keys, not of the
        store: a contender's key is always bound to a lease.
        """
        c = self.counters
        raw = call.key.encode("utf-8")
        entry = self.store.entry(raw)
        if entry is None:
            c["calls_conflict"] += 1
            return Reply(call.uuid, "conflict", current=0)
        mine = int.from_bytes(entry[0], "big")
        prefix = raw[: raw.rfind(b"/") + 1]
        store = self.store
        ahead = 0
        for lease in self.leases.live():
            for key in lease.keys:
                if key == raw or not key.startswith(prefix):
                    continue
                other = store.entry(key)
                if (
                    other is not None
                    and int.from_bytes(other[0], "big") < mine
                    and bound_lease(other[2]) == lease.id
                ):
                    ahead += 1
        c["calls_ok"] += 1
        return Reply(call.uuid, "ok", mine, ahead=ahead)

    def _not_owner(self, uuid: bytes, lease_id: str, owner: str | None) -> Reply:
        self.counters["calls_not_owner"] += 1
        if owner is None:
            why = f"lease {lease_id} predates lease ownership: nobody may use it"
        else:
            why = f"lease {lease_id} is another client's"
        return _refused(uuid, "not-owner", why)

    def apply_own_split_call(
        self, frames: Sequence[bytes], now: float, mono: float | None = None
    ) -> Reply | None:
        """Elected again before the winner answered it: apply one of our own
        split-brain calls here (None if the frames are not a call).

        Not through :meth:`on_call`: our uuid window holds its id (we applied
        the write once, before the resync replaced our state with the
        winner's), so it would be answered as a duplicate and applied nowhere.
        It is applied unless the state we hold now has it: the winner said it
        had applied it (its KVAPPLIED at that resync), or we followed the
        winner's update with that id since, or it is its key's current value.
        """
        assert self.role is Role.ACTIVE
        try:
            call = decode_call(frames)
        except ProtocolError:
            self.counters["calls_invalid"] += 1
            return None
        raw_key = call.key.encode("utf-8")
        held = self._applied_sequence(call.uuid, raw_key)
        if held or call.uuid in self._split_peer_applied:
            self.counters["split_writes_held"] += 1
            return Reply(call.uuid, "ok", held)
        try:
            origin = parse_split_origin(call.properties)
        except ValueError:
            origin = None  # ours: cannot happen; applied as before the rule
        if origin is None:
            return self._call_set(call, now, _mono(mono, now), ours=True)[0]
        # The state we hold is the winner's since the resync: its rule, here.
        known = self.conflicts.of_uuid(call.uuid)
        if known is not None:
            return _split_conflict_reply(known)
        return self._judge_split(call, origin, now, _mono(mono, now), ours=True)[0]

    def _call_set(
        self, call: Call, now: float, mono: float, caller: str = "", *, ours: bool = False
    ) -> tuple[Reply, bool]:
        """A ``set`` call; ``ours``: one of our own split-brain writes applied
        here (apply_own_split_call), neither a retry nor a stranger's use of
        its lease (its client proved that when it wrote)."""
        c = self.counters
        raw_key = call.key.encode("utf-8")
        uuid = call.uuid
        if uuid in self.window and not ours:
            # A retry of a write we applied: say what the first one got.
            c["calls_duplicate"] += 1
            c["calls_ok"] += 1
            return Reply(uuid, "ok", self._applied_sequence(uuid, raw_key)), False
        lease_id = call.lease
        if lease_id is not None:
            held = self.leases.get(lease_id)
            if held is None:
                c["calls_unknown_lease"] += 1
                return _refused(uuid, "unknown-lease", f"no lease {lease_id}"), False
            if not ours and not may_use(held.owner, caller, call.secret):
                return self._not_owner(uuid, lease_id, held.owner), False
        expected = call.if_sequence
        if expected is not None:
            current = self._key_sequence(raw_key)
            if current != expected:
                c["calls_conflict"] += 1
                return Reply(uuid, "conflict", current=current), False
        try:
            out = self.store.apply(call.as_kvmsg(), mono, wall=now)
        except StoreFull as exc:
            c["calls_refused_full"] += 1
            return _refused(uuid, "full", str(exc)), False
        except LimitExceeded as exc:
            c["calls_refused_size"] += 1
            return _refused(uuid, "size", str(exc)), False
        except ProtocolError as exc:
            c["calls_invalid"] += 1
            return _refused(uuid, "malformed", str(exc)), False
        self.window.add(uuid, now)
        if lease_id is not None:
            self.leases.bind(lease_id, raw_key)
        if expected is not None:
            self._note_condition(uuid, expected)
        c["kvpub_published"] += 1
        c["calls_ok"] += 1
        self._record(out)
        return Reply(uuid, "ok", self.store.sequence), True

    def _call_split(
        self, call: Call, now: float, mono: float, peer: bool, caller: str = ""
    ) -> tuple[Reply, bool]:
        """A write the loser of a split brain forwards: applied by the rule of
        :mod:`clone.server.splitrule`, or kept as a conflict and answered so."""
        c = self.counters
        uuid = call.uuid
        if not peer:
            c["split_calls_refused_not_peer"] += 1
            return _refused(uuid, "acl", "split_* properties are the peer server's"), False
        try:
            origin = parse_split_origin(call.properties)
        except ValueError as exc:
            c["calls_invalid"] += 1
            return _refused(uuid, "malformed", str(exc)), False
        assert origin is not None
        c["split_calls_received"] += 1
        self.split_call_at = now
        known = self.conflicts.of_uuid(uuid)
        if known is not None:
            # A resend of a write already judged: the same answer.
            return _split_conflict_reply(known), False
        if uuid in self.window:
            return self._call_set(_without_split(call), now, mono, caller)
        return self._judge_split(call, origin, now, mono, caller)

    def _judge_split(
        self,
        call: Call,
        origin: SplitOrigin,
        now: float,
        mono: float,
        caller: str = "",
        *,
        ours: bool = False,
    ) -> tuple[Reply, bool]:
        """Apply a split write by the rule, or keep it as a conflict."""
        c = self.counters
        uuid = call.uuid
        plain = _without_split(call)
        raw_key = call.key.encode("utf-8")
        entry = self.store.entry(raw_key)
        lease_id = call.lease
        verdict = judge_split_write(
            origin,
            lease=lease_id,
            lease_alive=lease_id is not None and lease_id in self.leases,
            changed_since_fork=self._changed_since(raw_key, origin.fork, entry),
            current_uuid=None if entry is None else bytes(entry[1]),
        )
        if verdict is Verdict.APPLY:
            reply, changed = self._call_set(plain, now, mono, caller, ours=ours)
            if reply.ok:
                c["split_calls_applied"] += 1
            if reply.ok or reply.reason != "not-owner":
                return reply, changed
            # Nothing is dropped silently: kept for an operator, as any conflict.
            verdict = Verdict.LEASE_OWNER
        rec = self.conflicts.record(_conflict(plain, origin, verdict, entry, now))
        # A late direct copy of the write (its client reached us at last) must
        # not apply what the rule refused: its uuid counts as seen.
        self.window.add(uuid, now)
        c["split_conflicts"] += 1
        return _split_conflict_reply(rec), True

    def _changed_since(self, raw_key: bytes, fork: int, entry: Entry | None) -> bool:
        """Whether we updated ``raw_key`` after sequence ``fork`` (True when
        the history no longer reaches back that far and the key is absent)."""
        if entry is not None:
            return int.from_bytes(entry[0], "big") > fork
        cached = self._fork_keys
        history = self.history
        if cached is None or cached[0] != fork:
            keys: set[bytes] | None = None
            if history.covers(fork):
                keys = {frames[0] for frames in history.since(fork)}
            cached = (fork, self.store.sequence, keys)
        else:
            seen, keys = cached[1], cached[2]
            if keys is not None and seen < self.store.sequence:
                if history.covers(seen):
                    keys.update(frames[0] for frames in history.since(seen))
                else:
                    keys = None
            cached = (fork, self.store.sequence, keys)
        self._fork_keys = cached
        keys = cached[2]
        return keys is None or raw_key in keys

    def resolve_conflict(
        self, cid: int, action: str, now: float, mono: float | None = None
    ) -> ConflictRecord:
        """An operator's word on conflict ``cid``: ``apply`` writes the loser's
        value now (a new update, published), ``discard`` only marks it.
        ValueError saying why not (unknown, resolved, not active)."""
        rec = self.conflicts.get(cid)
        if rec is None:
            raise ValueError(f"no conflict {cid}")
        if rec.resolution is not None:
            raise ValueError(f"conflict {cid} was {rec.resolution} already")
        if action == "apply":
            if self.role is not Role.ACTIVE:
                raise ValueError(f"this server is {self.role.value}")
            props = tuple(
                (n, v) for n, v in decode_properties(rec.loser_props) if n != LEASE_PROPERTY
            )
            msg = KVMsg(rec.key.decode("utf-8"), 0, rec.loser_uuid, props, rec.loser_body)
            self._record(self.store.apply(msg, _mono(mono, now), wall=now))
            self.counters["kvpub_published"] += 1
            self.counters["conflicts_applied"] += 1
            done = self.conflicts.resolve(cid, "applied")
        elif action == "discard":
            self.counters["conflicts_discarded"] += 1
            done = self.conflicts.resolve(cid, "discarded")
        else:
            raise ValueError(f"a conflict is applied or discarded, not {action!r}")
        return done

    def _call_conflict(self, call: Call, now: float, mono: float) -> tuple[Reply, bool]:
        """An operator applies or discards a conflict; the ACL has judged its key."""
        c = self.counters
        cid = int(call.prop(CONFLICT_PROPERTY) or 0)  # check_call: a whole number
        rec = self.conflicts.get(cid)
        if rec is None or rec.key != call.key.encode("utf-8") or rec.resolution is not None:
            c["calls_unknown_conflict"] += 1
            why = (
                f"no conflict {cid}"
                if rec is None
                else f"conflict {cid} is for another key"
                if rec.key != call.key.encode("utf-8")
                else f"conflict {cid} was {rec.resolution} already"
            )
            return _refused(call.uuid, "unknown-conflict", why), False
        action = "apply" if call.op == OP_CONFLICT_APPLY else "discard"
        self.resolve_conflict(cid, action, now, mono)
        c["calls_ok"] += 1
        seq = self.store.sequence if action == "apply" else 0
        return Reply(call.uuid, "ok", seq), True

    def _call_grant(
        self, call: Call, now: float, mono: float, caller: str = ""
    ) -> tuple[Reply, bool]:
        c = self.counters
        uuid = call.uuid
        lease_id = lease_id_of(uuid)
        held = self.leases.get(lease_id)
        if held is not None:
            # A retry: answered only to the owner (the id is public, and the
            # reply hands the secret back).
            if not may_use(held.owner, caller, call.secret):
                return self._not_owner(uuid, lease_id, held.owner), False
            c["calls_duplicate"] += 1
            c["calls_ok"] += 1
            seq = self._key_sequence(lease_key(lease_id).encode())
            return Reply(
                uuid, "ok", seq, lease=lease_id, ttl=held.ttl, secret=call.secret or ""
            ), False
        if uuid in self.window:
            # Granted once, and gone since (expired or revoked).
            c["calls_unknown_lease"] += 1
            why = f"lease {lease_id} expired or was revoked"
            return _refused(uuid, "unknown-lease", why), False
        if self.leases.full:
            c["calls_refused_busy"] += 1
            return _refused(
                uuid, "busy", f"the server holds {len(self.leases)} leases, its --max-leases"
            ), False
        quota = self.settings.max_leases_per_client
        if caller and self.leases.held_by(caller) >= quota:
            c["calls_refused_lease_quota"] += 1
            why = f"this client holds {quota} leases, its --max-leases-per-client"
            return _refused(uuid, "lease-quota", why), False
        ttl = parse_lease_ttl(call.prop(TTL_PROPERTY))
        owner, secret = grant_owner(caller, call.secret)
        msg = KVMsg(
            lease_key(lease_id), 0, uuid, ((OWNER_PROPERTY, owner),), format_lease_value(ttl)
        )
        try:
            out = self.store.apply(msg, mono, wall=now)
        except StoreFull as exc:
            c["calls_refused_full"] += 1
            return _refused(uuid, "full", str(exc)), False
        self.window.add(uuid, now)
        self.leases.grant(lease_id, ttl, mono)
        self.leases.adopt(lease_id, owner, caller)
        c["leases_granted"] += 1
        c["kvpub_published"] += 1
        c["calls_ok"] += 1
        self._record(out)
        return Reply(uuid, "ok", self.store.sequence, lease=lease_id, ttl=ttl, secret=secret), True

    def _note_condition(self, uuid: bytes, expected: int) -> None:
        """A conditional write applied as active: what its split write says.
        Bounded like the history it would be forwarded from."""
        conditions = self._conditions
        conditions[uuid] = expected
        if len(conditions) > self.settings.history_max:
            del conditions[next(iter(conditions))]

    def _check_kvset(self, msg: KVMsg, raw_key: bytes) -> KVMsg:
        """The call rules for a KVSET applied as active (or at a promotion).

        Returns the message to store: ``msg``, or a copy without its
        ``if_sequence`` (a condition is never stored).  Raises ProtocolError
        (counted) when it may not be applied.
        """
        c = self.counters
        if raw_key.startswith(_LEASE_PREFIX_RAW):
            c["kvset_reserved"] += 1
            raise ProtocolError(f"key {msg.key[:80]!r}: keys under {LEASE_PREFIX} are the server's")
        expected_text = msg.prop(IF_SEQUENCE_PROPERTY)
        lease_id = msg.prop(LEASE_PROPERTY)
        if expected_text is None and lease_id is None:
            return msg
        try:
            _check_condition_syntax(msg)
        except ProtocolError:
            c["kvset_invalid"] += 1
            raise
        if lease_id is not None and lease_id not in self.leases:
            c["kvset_unknown_lease"] += 1
            raise ProtocolError(f"write to {msg.key[:80]!r} names lease {lease_id}, which is gone")
        if lease_id is not None:
            # A KVSET proves no ownership (no secret, no reply): binding a key
            # to a lease is a call's job (docs/protocol.md, "Lease ownership").
            c["kvset_lease_refused"] += 1
            raise ProtocolError(
                f"write to {msg.key[:80]!r} names lease {lease_id}: bind keys to a lease"
                " with a CALL? set, which proves its owner"
            )
        if expected_text is None:
            return msg
        current = self._key_sequence(raw_key)
        if current != int(expected_text):
            c["kvset_conflict"] += 1
            raise ProtocolError(
                f"write to {msg.key[:80]!r} expected sequence {expected_text},"
                f" the key is at {current}"
            )
        if msg.uuid:
            self._note_condition(msg.uuid, current)
        return KVMsg(msg.key, 0, msg.uuid, msg.with_props(**{IF_SEQUENCE_PROPERTY: None}), msg.body)

    def _bind_if_leased(self, msg: KVMsg, raw_key: bytes) -> None:
        lease_id = msg.prop(LEASE_PROPERTY)
        if lease_id is not None:
            self.leases.bind(lease_id, raw_key)

    def _key_sequence(self, raw_key: bytes) -> int:
        """A key's sequence as a compare-and-set sees it: 0 when absent."""
        entry = self.store.entry(raw_key)
        return 0 if entry is None else int.from_bytes(entry[0], "big")

    def _applied_sequence(self, uuid: bytes, raw_key: bytes) -> int:
        """The sequence the update with ``uuid`` got (0 if no longer known)."""
        entry = self.store.entry(raw_key)
        if entry is not None and entry[1] == uuid:
            return int.from_bytes(entry[0], "big")
        return self.history.sequence_of(uuid) or 0

    def _end_lease(self, lease_id: str, now: float) -> list[list[bytes]]:
        """Revoke or expire a lease: delete its keys, then its own key (published)."""
        lease = self.leases.pop(lease_id)
        if lease is None:
            return []
        store = self.store
        out: list[list[bytes]] = []
        for raw_key in sorted(lease.keys):
            entry = store.entry(raw_key)
            if entry is not None and bound_lease(entry[2]) == lease_id:
                out.append(self._delete(raw_key, now))
        self.counters["lease_keys_deleted"] += len(out)
        own = lease_key(lease_id).encode()
        if store.entry(own) is not None:
            out.append(self._delete(own, now))
        return out

    def _delete(self, raw_key: bytes, now: float) -> list[bytes]:
        """A server-made delete (no uuid), recorded for commit and publication."""
        frames = self.store.apply(KVMsg(raw_key.decode("utf-8"), 0), now)
        self.counters["kvpub_published"] += 1
        self._record(frames)
        return frames

    def _rebuild_leases(self, now: float) -> list[list[bytes]]:
        """Becoming active: every stored lease gets a full ttl from ``now``;
        keys bound to a lease that no longer exists are deleted (returned)."""
        leases: list[tuple[str, float]] = []
        owners: list[tuple[str, str | None]] = []
        bindings: list[tuple[str, bytes]] = []
        broken: list[bytes] = []
        for raw_key, entry in self.store.entries_with_properties_or_prefix(_LEASE_PREFIX_RAW):
            if raw_key.startswith(_LEASE_PREFIX_RAW):
                ttl = parse_lease_value(entry[3])
                lease_id = raw_key[len(_LEASE_PREFIX_RAW) :].decode("utf-8", "replace")
                if ttl is None:
                    broken.append(raw_key)
                else:
                    leases.append((lease_id, ttl))
                    owners.append((lease_id, lease_owner(entry[2])))
                continue
            bound = bound_lease(entry[2])
            if bound is not None:
                bindings.append((bound, raw_key))
        orphans = self.leases.rebuild(leases, bindings, now)
        for lease_id, owner in owners:
            # A certificate name counts against its quota again; a secret's
            # holder is not known here; no owner (an older data directory):
            # nobody may use it, and it runs out one ttl from now.
            client = owner if owner is not None and owner.startswith("name:") else ""
            self.leases.adopt(lease_id, owner, client)
        out = [self._delete(raw_key, now) for raw_key in broken + orphans]
        self.counters["lease_orphans_deleted"] += len(out)
        return out

    # -- time ----------------------------------------------------------------

    def tick(self, now: float, mono: float | None = None) -> list[list[bytes]]:
        """Periodic work: age the pending list; expire keys and leases if
        active (on the monotonic ``mono``: a wall-clock step ends nothing).

        Returns the delete KVPUBs to publish (at most ``expiry_batch``; call
        again soon if :meth:`expiry_due` is still true).
        """
        self.pending.expire(now)
        if self.role is not Role.ACTIVE:
            return []
        out: list[list[bytes]] = []
        mono = _mono(mono, now)
        for lease_id in self.leases.due(mono, self.settings.expiry_batch):
            self.counters["leases_expired"] += 1
            out += self._end_lease(lease_id, mono)
        deletes = self.store.expire(mono, self.settings.expiry_batch)
        if deletes:
            self.counters["expired"] += len(deletes)
            self.counters["kvpub_published"] += len(deletes)
            for m in deletes:
                frames = encode_kv(m)
                self._record(frames)
                out.append(frames)
        self.highest_seen = max(self.highest_seen, self.store.sequence)
        return out

    def expiry_due(self, now: float) -> bool:
        """Whether a key or a lease is due at ``now`` (monotonic, as :meth:`tick`'s ``mono``)."""
        deadline = self.store.next_deadline()
        if deadline is not None and deadline <= now:
            return True
        lease_deadline = self.leases.next_deadline()
        return self.role is Role.ACTIVE and lease_deadline is not None and lease_deadline <= now

    # -- introspection -------------------------------------------------------

    def stats(self) -> dict[str, int | str]:
        """Counters plus gauges, for logs and ``CloneServer.stats()``."""
        out: dict[str, int | str] = dict(self.counters)
        out.update(
            role=self.role.value,
            sync_state=self.sync_state.value,
            sequence=self.store.sequence,
            highest_seen=self.highest_seen,
            keys=len(self.store),
            store_bytes=self.store.nbytes,
            ephemeral_keys=self.store.ephemeral_count,
            pending=len(self.pending),
            pending_dropped=self.pending.dropped,
            dedup_window_used=len(self.window),
            bad_expires=self.store.bad_expires,
            leases=len(self.leases),
            split_conflicts_kept=len(self.conflicts),
            split_conflicts_unresolved=self.conflicts.unresolved,
        )
        return out

    # -- internals -----------------------------------------------------------

    def _sync(self, event: SyncEvent) -> None:
        try:
            self.sync_state = SYNC_TRANSITIONS[(self.sync_state, event)]
        except KeyError:
            raise IllegalTransitionError(
                f"sync event {event.name} is not allowed in state {self.sync_state.name}"
            ) from None

    def _follow(
        self,
        msg: KVMsg,
        now: float,
        frames: Sequence[bytes],
        mono: float,
        left: float | None = None,
    ) -> FollowOutcome:
        store = self.store
        expected = store.sequence + 1
        if msg.sequence < expected:
            self.counters["peer_stale"] += 1
            return FollowOutcome.OK
        if msg.sequence > expected:
            self.counters["peer_gaps"] += 1
            return FollowOutcome.RESYNC
        store.apply_published(msg, frames, now=mono, left=left)
        self._record(list(frames))
        uid = update_id(msg)
        self.pending.confirm(uid)
        if msg.uuid:
            self.window.add(msg.uuid, now)
        return FollowOutcome.OK

    def _replay_buffer(self, after: int, now: float, mono: float) -> bool:
        """Apply buffered KVPUBs newer than ``after``; False on a gap."""
        buffered, self._buffer = self._buffer, []
        overflowed, self._buffer_overflowed = self._buffer_overflowed, False
        store = self.store
        for msg, frames, received in buffered:
            if msg.sequence <= after:
                # Already in the snapshot, but it still confirms a pending update.
                self.pending.confirm(update_id(msg))
                if msg.uuid:
                    self.window.add(msg.uuid, now)
                continue
            if msg.sequence != store.sequence + 1:
                return False
            # Its ttl counts from when it came, not from the replay (never later than the truth).
            self._follow(msg, now, frames, received)
        return not overflowed

    def _record(self, frames: list[bytes]) -> None:
        """An update was applied: into the history and the journal."""
        self.history.append(frames, self.term)
        self.journal.update(frames)

    # -- a restart -----------------------------------------------------------

    def load(
        self,
        entries: dict[bytes, Entry],
        sequence: int,
        history: Sequence[tuple[list[bytes], int, float]],
        now: float = 0.0,
        mono: float | None = None,
    ) -> None:
        """Start from the state a data directory held (before serving anything).

        The update log becomes the history (what a peer's catch-up is served
        from) and its ids the deduplication window, so a client's resend of
        a write confirmed before the restart is still recognised.

        Monotonic time does not survive a restart, and the wall clock may have
        stepped while we were down, so neither says how long a key has left:
        every ephemeral key gets its stored ``ttl`` again from ``mono`` (at
        least what it had left when it was written; never less), and every
        lease its whole ttl.
        """
        mono = _mono(mono, now)
        self.store.replace(entries, sequence, mono)
        if history:
            self.history.reset(int.from_bytes(history[0][0][1], "big") - 1)
            self.history.load(history)
        if self.history.last != sequence:
            # A log that does not end at the state's sequence describes some
            # other state: serve no catch-up from it.
            self.history.reset(sequence)
        window = self.window
        for frames, _term, at in history:
            if frames[2]:
                window.add(frames[2], at)
        self.highest_seen = max(self.highest_seen, sequence)
        if self.role is Role.ACTIVE:
            # A standalone server serves at once: its leases start a full ttl now.
            self._rebuild_leases(mono)
