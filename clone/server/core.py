"""The CHP server's decisions, without sockets or clocks: a role switch.

How this works: :class:`ServerCore` takes events -- a client's KVSET or
CALL?, a KVPUB or HUGZ from the active peer, a KVSYNC/KTHXBAI of the snapshot
we asked the peer for, a snapshot request, a role change, a timer tick -- each
as raw frames plus an explicit wall-clock ``now`` (and, where a TTL or a lease
is involved, the monotonic ``mono``: their deadlines never read the wall
clock, see :mod:`clone.server.ttl`; a caller with one clock, a test, may leave
it out).  It decides by the server's role what an event means and routes it:

* **Active**: a KVSET gets the next sequence and is republished (at most once
  per uuid within the dedup window); due ephemeral keys and leases end.
  Calls, compare-and-set and leases are :class:`~clone.server.callcore.CallCore`'s.
* **Passive** (and a relay): follows the active server, which is
  :class:`~clone.server.synccore.SyncCore`'s job: full syncs and catch-ups,
  KVPUBs in strict order, the pending list reconciled at each sync's end.
  Client KVSETs wait in the pending list until the active server republishes
  them.
* **Promotion** (passive -> active): stop following, rebuild the leases, apply
  the pending list in arrival order, each with a fresh sequence.  Sequences
  carry on from the highest the server has seen anywhere, so they never go
  backwards.
* **A split brain's heal** (docs/failover.md, "Writes of a split brain"): the
  demoted side keeps what it wrote as active and sends it to the winner as
  calls; the winner judges them (:mod:`clone.server.splitrule`).  That part
  stays here, fed by the sync's two hooks.

One output channel: every update applied, in any role, is recorded in
:attr:`ServerCore.journal` (and the history), and that record is what the
reactor commits and then publishes (:mod:`clone.server.durability`); the
event methods return only what the I/O layer must decide on (a reply, a
:class:`FollowOutcome`).  Bad input raises
:class:`~clone.errors.ProtocolError` after it has been counted; the caller logs
it and carries on.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from clone.errors import IllegalTransitionError, ProtocolError, StoreFull
from clone.server.callcore import Admitted, CallCore, check_condition_syntax
from clone.server.callcore import refused as _refused
from clone.server.conflicts import DEFAULT_MAX_CONFLICT_BYTES, ConflictBook, ConflictRecord
from clone.server.delta import DeltaStream, open_catch_up, open_history
from clone.server.history import History
from clone.server.journal import Journal
from clone.server.leases import LeaseTable
from clone.server.pending import PendingList, UuidWindow
from clone.server.snapshot import SnapshotStream
from clone.server.split import split_writes
from clone.server.splitrule import Verdict, judge_split_write
from clone.server.store import Entry, Served, Store
from clone.server.synccore import (
    APPLIED_SPAN_MARGIN,
    SYNC_TRANSITIONS,
    FollowOutcome,
    SyncCore,
    SyncEvent,
    SyncState,
)
from clone.server.ttl import parse_ttl
from clone.wire.applied import encode_kvapplied, uuid_ids
from clone.wire.calls import (
    CONFLICT_OPS,
    CONFLICT_PROPERTY,
    LEASE_PREFIX,
    LEASE_PROPERTY,
    OP_CONFLICT_APPLY,
    OP_SET,
    Call,
    Reply,
    decode_call,
)
from clone.wire.codec import (
    KVMsg,
    Properties,
    decode_icanhaz,
    decode_kvset,
    decode_properties,
    encode_hugz,
    encode_kv,
    encode_properties,
)
from clone.wire.delta import SinceRequest
from clone.wire.protocol import TTL_PROPERTY
from clone.wire.split import SPLIT_PROPERTIES, SplitOrigin, parse_split_origin, uuid_time

__all__ = [
    "APPLIED_SPAN_MARGIN",
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
    "pending_stepped_down",
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
    "lease_keepalive_batches",
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
    #: The bytes of split-brain conflicts kept (clone.server.conflicts); 0: no bound.
    max_conflict_bytes: int = DEFAULT_MAX_CONFLICT_BYTES

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


_check_condition_syntax = check_condition_syntax


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


class ServerCore:
    """One server's state, and which rules apply to it now.  Not
    thread-safe: one reactor drives it."""

    def __init__(
        self,
        settings: CoreSettings | None = None,
        *,
        standalone: bool = False,
        durable: bool = False,
        relay: bool = False,
    ) -> None:
        self.settings = settings = settings or CoreSettings()
        self.store = Store(max_keys=settings.max_keys, max_bytes=settings.max_bytes)
        #: Every change to the state since the reactor last committed it, in
        #: order (snapshot staging only when ``durable``: there is a database).
        #: The one output channel: what the reactor commits, then publishes.
        self.journal = Journal(stage=durable)
        #: The most recent updates, for a peer's catch-up (clone.server.delta).
        self.history = History(settings.history_max, settings.history_bytes)
        #: The term (Binary Star epoch) updates are recorded under; the reactor
        #: sets it on every role change.
        self.term = 0
        self.window = UuidWindow(settings.dedup_window)
        self.pending = PendingList(
            settings.pending_max, settings.pending_max_age, settings.pending_max_bytes
        )
        #: The leases, their deadlines and keys: meaningful on the active
        #: server only, rebuilt from the store when it becomes active.
        self.leases = LeaseTable(settings.max_leases)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.role = Role.ACTIVE if standalone else Role.RELAY if relay else Role.STARTING
        #: Calls, compare-and-set and leases (the active's).
        self.calls = CallCore(
            store=self.store,
            leases=self.leases,
            window=self.window,
            history=self.history,
            counters=self.counters,
            record=self._record,
            max_leases_per_client=settings.max_leases_per_client,
            conditions_max=settings.history_max,
        )
        #: Following the active: syncs, ordered KVPUBs, pending reconciliation.
        self.sync = SyncCore(
            store=self.store,
            history=self.history,
            journal=self.journal,
            window=self.window,
            pending=self.pending,
            counters=self.counters,
            record=self._record,
            sync_buffer_max=settings.sync_buffer_max,
            fork_known=self._split_fork_known,
            synced=self._settle_split_writes,
        )
        #: The sequence we had applied when we last became active (KVAPPLIED's
        #: ``fork``): a peer active at the same time forwards its writes after it.
        self.promoted_at: int | None = None
        # Demoted from active: the updates we wrote in our term, until the
        # winner's fork says which it lacks (clone.server.split).
        self._written_as_active: Sequence[Sequence[bytes]] = []
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
        # At a demotion, the if_sequence of each conditional write we applied
        # as active in that term, by uuid, and the term we wrote under: what a
        # split write carries.
        self._written_conditions: dict[bytes, int] = {}
        self._written_term = 0
        # Judging split writes: the fork, the sequence the history was read up
        # to, and every key updated after the fork (None: the history does
        # not reach back to it).
        self._fork_keys: tuple[int, int, set[bytes] | None] | None = None
        #: Split-brain writes of a loser this server did not apply (the winner's side).
        self.conflicts = ConflictBook(settings.max_conflict_bytes)
        #: Winning a split brain: client updates are parked until the loser's
        #: forwarded writes are in (hold_writes); when the last of those came.
        self.holding = False
        self.split_call_at = 0.0

    # -- what the sync knows -------------------------------------------------

    @property
    def sync_state(self) -> SyncState:
        """How far a follower's copy is (IDLE when not following)."""
        return self.sync.state

    @property
    def highest_seen(self) -> int:
        """The highest sequence seen anywhere (own store, peer KVPUB/HUGZ/KTHXBAI)."""
        return self.sync.highest_seen

    @highest_seen.setter
    def highest_seen(self, value: int) -> None:
        self.sync.highest_seen = value

    @property
    def last_sync(self) -> str:
        """What the last completed sync was: "full" (a snapshot) or "catch-up"."""
        return self.sync.last_sync

    # -- client side ---------------------------------------------------------

    def on_kvset(self, frames: Sequence[bytes], now: float, mono: float | None = None) -> None:
        """A KVSET at the collector: applied (as active; its KVPUB goes into
        the journal, to be committed and published) or parked.

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
                return
            reuse: Sequence[bytes] | None = frames
            if frames[0].startswith(_LEASE_PREFIX_RAW) or msg.properties:
                plain = self.calls.check_kvset(msg, frames[0])
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
                self.calls.bind_if_leased(msg, frames[0])
            c["kvpub_published"] += 1
            self._record(out)
            return
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
            return
        if self.pending.add(msg, now, _mono(mono, now)):
            c["kvset_pending"] += 1
        else:
            c["kvset_duplicate"] += 1

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

    def become_active(self, now: float, mono: float | None = None) -> None:
        """Promotion: apply the pending list (its KVPUBs, and the deletes of
        orphaned lease keys, go into the journal).

        Every lease gets its whole ttl from ``mono``; a parked write's ttl
        counts from when it arrived.

        Idempotent: a second call while active does nothing.
        """
        if self.role is Role.ACTIVE:
            return
        self.counters["promotions"] += 1
        self.sync.stop(now, _mono(mono, now))
        self.role = Role.ACTIVE
        store = self.store
        self.promoted_at = store.sequence
        self._written_as_active = []
        self.calls.take_conditions()  # a new term: its own conditions
        self._fork_keys = None
        store.sequence = max(store.sequence, self.highest_seen)
        self.calls.rebuild_leases(_mono(mono, now))
        self._apply_pending(now)
        self.highest_seen = store.sequence

    def hold_writes(self) -> None:
        """A split brain this active server wins: park client updates (KVSETs)
        as a passive does, until :meth:`release_held`, so that the writes the
        stepped-down peer forwards are judged first and those of its clients
        that reach us directly, late (queued in TCP through the partition), are
        not applied ahead of them (docs/failover.md, "Writes of a split brain")."""
        if self.role is Role.ACTIVE:
            self.holding = True

    def drop_pending_since(self, since: float) -> int:
        """Stepped down after a split brain: drop the parked client updates
        that arrived at or after ``since`` (the demotion) and that the active
        has not published by now; how many.

        Their writers still followed us when they sent them.  A confirmed one
        is resent to the winner by its client after its failover; any other
        reached only us, and applied at a promotion of ours it would land
        after what the winner confirmed since (docs/failover.md, "Writes of a
        split brain")."""
        gone = self.pending.retain(lambda parked: parked.arrived < since)
        self.counters["pending_stepped_down"] += gone
        return gone

    def release_held(self, now: float) -> None:
        """End :meth:`hold_writes`: apply what was parked, in arrival order (a
        write the peer forwarded meanwhile is in the uuid window: skipped)."""
        if not self.holding:
            return
        self.holding = False
        self._apply_pending(now)

    def _apply_pending(self, now: float) -> None:
        """Apply the pending list as active, in arrival order."""
        c = self.counters
        store = self.store
        calls = self.calls
        applied = 0
        for parked in self.pending.drain():
            msg = parked.msg
            if msg.uuid and msg.uuid in self.window:
                c["pending_skipped"] += 1
                continue
            raw_key = msg.key.encode("utf-8")
            try:
                if msg.properties:
                    msg = calls.check_kvset(msg, raw_key)
                # ttl counts from when the client sent it, not from now.
                pub = store.apply(msg, parked.mono, wall=parked.arrived)
            except ProtocolError:
                c["pending_failed"] += 1
                continue
            if msg.uuid:
                self.window.add(msg.uuid, now)
            calls.bind_if_leased(msg, raw_key)
            self._record(pub)
            applied += 1
        c["pending_applied"] += applied
        c["kvpub_published"] += applied

    def become_passive(self) -> None:
        """Demotion or first decision: the caller must now start a sync."""
        self.holding = False
        if self.role is Role.ACTIVE:
            self.counters["demotions"] += 1
            # What we wrote as active: the winner of a split brain may lack some.
            self._written_as_active = self.history.written_under(self.term)
            self._written_term = self.term
            self._written_conditions = self.calls.take_conditions()
        self.promoted_at = None
        self.role = Role.PASSIVE
        # Only the active server keeps time for leases; a new one rebuilds them.
        self.leases.clear()

    # -- following the active peer (clone.server.synccore) -------------------

    def start_sync(self) -> None:
        """(Re)start a full sync: the caller sends ICANHAZ? on a fresh socket."""
        self.sync.start()

    def catch_up_request(self) -> SinceRequest | None:
        """What to ask the active for instead of a full snapshot, if anything
        (:meth:`SyncCore.catch_up_request`)."""
        return self.sync.catch_up_request()

    def on_peer_update(
        self, frames: Sequence[bytes], now: float, mono: float | None = None
    ) -> FollowOutcome:
        """A KVPUB or HUGZ from the active peer's publisher, received at ``now``
        (``mono``: the same moment on the monotonic clock)."""
        if self.role not in _FOLLOWERS:
            self.counters["peer_ignored"] += 1
            return FollowOutcome.OK
        # The hot path of a follower: _mono inlined.
        return self.sync.on_peer_update(frames, now, now if mono is None else mono)

    def on_snapshot_reply(
        self, frames: Sequence[bytes], now: float, mono: float | None = None
    ) -> FollowOutcome:
        """A KVSYNC, KVBATCH, KVAPPLIED or KTHXBAI of the snapshot we asked the
        peer for, received at ``now`` (``mono``: the same moment, monotonic)."""
        if self.role not in _FOLLOWERS:
            self.counters["peer_ignored"] += 1
            return FollowOutcome.OK
        return self.sync.on_snapshot_reply(frames, now, _mono(mono, now))

    def _split_fork_known(self, now: float, peer_applied: set[bytes] | None) -> None:
        """The sync's hook: the winner's fork is known before its snapshot."""
        if self._written_as_active and self._peer_fork is not None:
            self._settle_split_writes(now, peer_applied)

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

    @property
    def _peer_fork(self) -> int | None:
        """The fork the peer's KVAPPLIED named in this sync (the split-brain heal's)."""
        return self.sync.peer_fork

    # -- calls and leases (clone.server.callcore) -----------------------------

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

        Each refusal has its own counter (``size``, ``malformed``, ...), so an
        operator can tell a client sending nonsense from one sending too much.

        ``peer``: the caller is the peer server (or there is no way to tell:
        no CURVE).  Only a peer's ``set`` may carry the split-brain properties
        (:mod:`clone.wire.split`); it is then judged by the heal's rule.
        """
        admitted = self.calls.admit(
            frames, can_write=can_write, may_lease=may_lease, caller=caller, relayed=relayed
        )
        if not isinstance(admitted, Admitted):
            return admitted, False
        call, caller = admitted.call, admitted.caller
        if self.role is not Role.ACTIVE:
            self.counters["calls_not_active"] += 1
            return _refused(call.uuid, "not-active", f"this server is {self.role.value}"), False
        mono = _mono(mono, now)
        if call.op == OP_SET and any(name in SPLIT_PROPERTIES for name, _ in call.properties):
            return self._call_split(call, now, mono, peer, caller)
        if call.op in CONFLICT_OPS:
            return self._call_conflict(call, now, mono)
        return self.calls.run(call, now, mono, caller)

    def _applied_sequence(self, uuid: bytes, raw_key: bytes) -> int:
        """The sequence the update with ``uuid`` got (0 if no longer known)."""
        return self.calls.applied_sequence(uuid, raw_key)

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
        """A ``set`` call (:meth:`CallCore.call_set`)."""
        return self.calls.call_set(call, now, mono, caller, ours=ours)

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

    # -- time ----------------------------------------------------------------

    def tick(self, now: float, mono: float | None = None) -> None:
        """Periodic work: age the pending list; expire keys and leases if
        active (on the monotonic ``mono``: a wall-clock step ends nothing).

        The deletes go into the journal (at most ``expiry_batch``; call again
        soon if :meth:`expiry_due` is still true).
        """
        self.pending.expire(now)
        if self.role is not Role.ACTIVE:
            return
        mono = _mono(mono, now)
        batch = self.settings.expiry_batch
        self.calls.expire_leases(mono, batch)
        deletes = self.store.expire(mono, batch)
        if deletes:
            self.counters["expired"] += len(deletes)
            self.counters["kvpub_published"] += len(deletes)
            for m in deletes:
                self._record(encode_kv(m))
        self.highest_seen = max(self.highest_seen, self.store.sequence)

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
            self.calls.rebuild_leases(mono)
