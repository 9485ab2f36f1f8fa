"""The CHP server's decisions, without sockets or clocks.

How this works: :class:`ServerCore` takes events -- a client's KVSET, a KVPUB
or HUGZ from the active peer, a KVSYNC/KTHXBAI of the snapshot we asked the
peer for, a snapshot request, a role change, a timer tick -- each as raw frames
plus an explicit wall-clock ``now``, and answers with frames to publish or an
outcome for the I/O layer to act on.  ``clone.server.reactor`` owns the sockets and the
reactor; this module owns the rules:

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
from collections.abc import Sequence
from dataclasses import dataclass

from clone.errors import IllegalSyncTransition, ProtocolError, StoreFull
from clone.server.delta import DeltaStream, open_catch_up, open_history
from clone.server.history import History
from clone.server.journal import Journal
from clone.server.pending import PendingList, PendingUpdate, UuidWindow, update_id
from clone.server.snapshot import SnapshotStream
from clone.server.store import Entry, Store
from clone.server.ttl import parse_ttl
from clone.wire.applied import decode_kvapplied, encode_kvapplied, is_kvapplied, uuid_ids
from clone.wire.batch import decode_kvbatch, is_kvbatch
from clone.wire.codec import (
    Hugz,
    KVMsg,
    Properties,
    SnapshotEnd,
    decode_icanhaz,
    decode_kvset,
    decode_snapshot_reply,
    decode_update,
    encode_hugz,
    encode_kv,
)
from clone.wire.delta import SinceRequest, decode_kvdelta, is_kvdelta, update_digest
from clone.wire.protocol import TTL_PROPERTY

__all__ = [
    "COUNTERS",
    "SYNC_TRANSITIONS",
    "CoreSettings",
    "FollowOutcome",
    "IllegalSyncTransition",
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
)


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """The limits of a server core (see docs/operations.md for the defaults' reasons)."""

    dedup_window: int = 65_536
    pending_max: int = 100_000
    pending_max_age: float = 30.0
    sync_buffer_max: int = 200_000
    expiry_batch: int = 10_000
    #: The update history kept for catch-up (docs/operations.md, "Durability").
    history_max: int = 100_000
    history_bytes: int = 64 * 1024 * 1024
    #: The most keys and bytes (keys, values, properties) the store holds; a
    #: write beyond them is refused (docs/operations.md, "Limits").  0: no limit.
    max_keys: int = 10_000_000
    max_bytes: int = 4 * 1024**3

    def __post_init__(self) -> None:
        for name in (
            "dedup_window",
            "pending_max",
            "sync_buffer_max",
            "expiry_batch",
            "history_max",
            "history_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.pending_max_age <= 0:
            raise ValueError(f"pending_max_age must be positive, not {self.pending_max_age}")


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
        self.pending = PendingList(self.settings.pending_max, self.settings.pending_max_age)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.role = Role.ACTIVE if standalone else Role.RELAY if relay else Role.STARTING
        self.sync_state = SyncState.IDLE
        #: The highest sequence seen anywhere (own store, peer KVPUB/HUGZ/KTHXBAI).
        self.highest_seen = 0
        self._staging: dict[bytes, Entry] = {}
        self._buffer: list[tuple[KVMsg, Sequence[bytes]]] = []
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

    def on_kvset(self, frames: Sequence[bytes], now: float) -> list[bytes] | None:
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
        if self.role is Role.ACTIVE:
            uuid = msg.uuid
            if uuid and uuid in self.window:
                c["kvset_duplicate"] += 1
                return None
            try:
                # The received frames are reused: stored and published as they
                # are, with the new sequence (and expires, if any).
                out = self.store.apply(msg, now, frames)
            except StoreFull:
                c["kvset_refused_full"] += 1
                raise
            except ProtocolError:
                c["kvset_invalid"] += 1
                raise
            if uuid:
                self.window.add(uuid, now)
            c["kvpub_published"] += 1
            self._record(out)
            return out
        # Passive or starting: validate now, so promotion cannot fail on it.
        if msg.properties:
            try:
                parse_ttl(msg.prop(TTL_PROPERTY))
            except ProtocolError:
                c["kvset_invalid"] += 1
                raise
        if msg.uuid and msg.uuid in self.window:
            c["kvset_already_applied"] += 1
            return None
        if self.pending.add(msg, now):
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
        """
        preamble: list[list[bytes]] = []
        if applied:
            window = self.window
            preamble = encode_kvapplied(
                self.store.sequence, uuid_ids(window.ids()), window.span(now)
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
            delta = open_catch_up(self.history, since, identity, self.store.sequence, preamble)
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
        )

    def hugz(self, heartbeat_ms: int | None = None) -> list[bytes]:
        """A heartbeat carrying the current highest sequence and, given
        ``heartbeat_ms``, the interval clients should expect (our extensions)."""
        return encode_hugz(self.store.sequence, heartbeat_ms)

    # -- roles ---------------------------------------------------------------

    def become_active(self, now: float) -> list[list[bytes]]:
        """Promotion: apply the pending list, return the KVPUBs to publish.

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
            self._replay_buffer(self.store.sequence, now)
        self._forget_peer_applied()
        self._sync(SyncEvent.STOP)
        self.role = Role.ACTIVE
        store = self.store
        store.sequence = max(store.sequence, self.highest_seen)
        out: list[list[bytes]] = []
        for parked in self.pending.drain():
            msg = parked.msg
            if msg.uuid and msg.uuid in self.window:
                c["pending_skipped"] += 1
                continue
            try:
                # ttl counts from when the client sent it, not from now.
                pub = store.apply(msg, parked.arrived)
            except ProtocolError:
                c["pending_failed"] += 1
                continue
            if msg.uuid:
                self.window.add(msg.uuid, now)
            self._record(pub)
            out.append(pub)
        c["pending_applied"] += len(out)
        c["kvpub_published"] += len(out)
        self.highest_seen = store.sequence
        return out

    def become_passive(self) -> None:
        """Demotion or first decision: the caller must now start a sync."""
        if self.role is Role.ACTIVE:
            self.counters["demotions"] += 1
        self.role = Role.PASSIVE

    # -- following the active peer -------------------------------------------

    def start_sync(self) -> None:
        """(Re)start a full sync: the caller sends ICANHAZ? on a fresh socket."""
        self._sync(SyncEvent.FOLLOW)
        self.counters["syncs_started"] += 1
        self._staging = {}
        self._buffer = []
        self._buffer_overflowed = False
        self._delta = False
        self._staging_begun = False
        self._forget_peer_applied()

    def catch_up_request(self) -> SinceRequest | None:
        """What to ask the active for instead of a full snapshot, if anything.

        Our state up to our sequence, named by the digest of its last update
        (:mod:`clone.wire.delta`): the active sends only what follows, if its
        history reaches back to it and holds the same update there.  None (a
        full snapshot) when we hold nothing, or not the last update itself
        (after a full snapshot, until the next update).
        """
        seq = self.store.sequence
        if self._plain_sync_next:
            self._plain_sync_next = False
            return None
        if seq == 0:
            return None
        held = self.history.entry(seq)
        if held is None:
            return None
        return SinceRequest(seq, update_digest(held[0]))

    def on_peer_update(self, frames: Sequence[bytes], now: float) -> FollowOutcome:
        """A KVPUB or HUGZ from the active peer's publisher, received at ``now``."""
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
            return self._follow(msg, now, frames)
        if state is SyncState.SYNCING:
            if len(self._buffer) < self.settings.sync_buffer_max:
                self._buffer.append((msg, frames))
            elif not self._buffer_overflowed:
                # The replay will hit a gap and resync; better than unbounded memory.
                self._buffer_overflowed = True
                c["sync_buffer_overflow"] += 1
        return FollowOutcome.OK

    def on_snapshot_reply(self, frames: Sequence[bytes], now: float) -> FollowOutcome:
        """A KVSYNC, KVBATCH, KVAPPLIED or KTHXBAI of the snapshot we asked the
        peer for, received at ``now``."""
        c = self.counters
        if self.sync_state is not SyncState.SYNCING or self.role not in _FOLLOWERS:
            c["peer_ignored"] += 1
            return FollowOutcome.OK
        if is_kvbatch(frames):
            if self._delta:
                c["peer_invalid"] += 1
                raise ProtocolError("KVBATCH in a catch-up (KVDELTA) reply")
            self._stage_batch(frames)
            return FollowOutcome.OK
        if is_kvapplied(frames):
            self._note_peer_applied(frames, now)
            return FollowOutcome.OK
        if is_kvdelta(frames):
            return self._begin_delta(frames)
        try:
            msg = decode_snapshot_reply(frames)
        except ProtocolError:
            c["peer_invalid"] += 1
            raise
        if isinstance(msg, SnapshotEnd):
            if msg.subtree:
                c["peer_invalid"] += 1
                raise ProtocolError(f"KTHXBAI for subtree {msg.subtree!r}, we asked for all")
            return self._end_sync(msg.sequence, now)
        if self._delta:
            return self._catch_up(msg, frames, now)
        c["snapshot_entries_received"] += 1
        if msg.body:
            # Stored as received (decoded once, to validate): see clone.server.store.
            entry = (frames[1], frames[2], frames[3], frames[4])
            self._staging[frames[0]] = entry
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

    def _catch_up(self, msg: KVMsg, frames: Sequence[bytes], now: float) -> FollowOutcome:
        """One update of a catch-up: applied in place, in strict order, like a KVPUB.

        Our state stays a prefix of the active's history after every one, so a
        catch-up cut short leaves a whole (older) state, not a mix.
        """
        self.counters["catchup_updates_received"] += 1
        if msg.sequence > self.highest_seen:
            self.highest_seen = msg.sequence
        return self._follow(msg, now, frames)

    def _end_sync(self, sequence: int, now: float) -> FollowOutcome:
        """KTHXBAI: swap in the snapshot (or finish the catch-up), replay the buffer."""
        c = self.counters
        if self._delta:
            if self.store.sequence != sequence:
                c["peer_gaps"] += 1
                return FollowOutcome.RESYNC
            c["syncs_catchup"] += 1
            self.last_sync = "catch-up"
        else:
            self.store.replace(self._staging, sequence)
            self._staging = {}
            self.history.reset(sequence)
            if self.journal.stages:
                self._begin_staging()  # an empty snapshot stages nothing
            self.journal.replace(sequence)
            c["syncs_full"] += 1
            self.last_sync = "full"
        self._delta = False
        if sequence > self.highest_seen:
            self.highest_seen = sequence
        if not self._replay_buffer(sequence, now):
            c["peer_gaps"] += 1
            return FollowOutcome.RESYNC
        self._reconcile_pending(now)
        self._sync(SyncEvent.SNAPSHOT_DONE)
        c["syncs_completed"] += 1
        return FollowOutcome.SYNCED

    def _stage_batch(self, frames: Sequence[bytes]) -> None:
        """A KVBATCH of the snapshot we asked for: stage its entries as KVSYNCs."""
        try:
            batch = decode_kvbatch(frames)
        except ProtocolError:
            self.counters["peer_invalid"] += 1
            raise
        self.counters["snapshot_entries_received"] += len(batch)
        # Stored as received, like a KVSYNC's frames (see clone.server.store).
        values = zip(
            batch.sequence_frames(), batch.uuids, batch.raw_properties, batch.bodies, strict=True
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

    # -- time ----------------------------------------------------------------

    def tick(self, now: float) -> list[list[bytes]]:
        """Periodic work: age the pending list; expire keys if active.

        Returns the delete KVPUBs to publish (at most ``expiry_batch``; call
        again soon if :meth:`expiry_due` is still true).
        """
        self.pending.expire(now)
        if self.role is not Role.ACTIVE:
            return []
        deletes = self.store.expire(now, self.settings.expiry_batch)
        if not deletes:
            return []
        self.counters["expired"] += len(deletes)
        self.counters["kvpub_published"] += len(deletes)
        self.highest_seen = self.store.sequence
        out = [encode_kv(m) for m in deletes]
        for frames in out:
            self._record(frames)
        return out

    def expiry_due(self, now: float) -> bool:
        deadline = self.store.next_deadline()
        return deadline is not None and deadline <= now

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
        )
        return out

    # -- internals -----------------------------------------------------------

    def _sync(self, event: SyncEvent) -> None:
        try:
            self.sync_state = SYNC_TRANSITIONS[(self.sync_state, event)]
        except KeyError:
            raise IllegalSyncTransition(
                f"sync event {event.name} is not allowed in state {self.sync_state.name}"
            ) from None

    def _follow(self, msg: KVMsg, now: float, frames: Sequence[bytes]) -> FollowOutcome:
        store = self.store
        expected = store.sequence + 1
        if msg.sequence < expected:
            self.counters["peer_stale"] += 1
            return FollowOutcome.OK
        if msg.sequence > expected:
            self.counters["peer_gaps"] += 1
            return FollowOutcome.RESYNC
        store.apply_published(msg, frames)
        self._record(list(frames))
        uid = update_id(msg)
        self.pending.confirm(uid)
        if msg.uuid:
            self.window.add(msg.uuid, now)
        return FollowOutcome.OK

    def _replay_buffer(self, after: int, now: float) -> bool:
        """Apply buffered KVPUBs newer than ``after``; False on a gap."""
        buffered, self._buffer = self._buffer, []
        overflowed, self._buffer_overflowed = self._buffer_overflowed, False
        store = self.store
        for msg, frames in buffered:
            if msg.sequence <= after:
                # Already in the snapshot, but it still confirms a pending update.
                self.pending.confirm(update_id(msg))
                if msg.uuid:
                    self.window.add(msg.uuid, now)
                continue
            if msg.sequence != store.sequence + 1:
                return False
            self._follow(msg, now, frames)
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
    ) -> None:
        """Start from the state a data directory held (before serving anything).

        The update log becomes the history (what a peer's catch-up is served
        from) and its ids the deduplication window, so a client's resend of
        a write confirmed before the restart is still recognised.
        """
        self.store.replace(entries, sequence)
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
