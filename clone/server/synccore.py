"""A follower's sync with the active server and its pending reconciliation.

How this works: a passive server (or a relay) holds a copy of another
server's state, in that server's sequences.  :class:`SyncCore` keeps it
current.  A full sync asks for a snapshot: its entries go into a staging map
while the live KVPUBs that arrive meanwhile are buffered; at KTHXBAI the
staging map becomes the state and the buffer is replayed (what the snapshot
already holds is skipped).  A catch-up (the active answers KVDELTA first) sends
only the updates after our sequence, applied in place like KVPUBs.  Once
synced, every KVPUB is applied in strict sequence order; a gap, or a HUGZ
announcing a sequence we do not have, means "resync" (:class:`FollowOutcome`).

When a sync completes, the pending list keeps only client updates the active
had provably *not* applied by the snapshot's sequence, by the ids it sent in
KVAPPLIED (docs/failover.md, "Pending updates"): a snapshot holds only the
last update of each key, so an update applied and superseded before it would
otherwise stay pending and be applied again, over newer values, at a promotion.

The sync state is a small table (:data:`SYNC_TRANSITIONS`), checked on every
change.  Sans-IO: frames and ``now`` (wall clock, for the dedup window and
the pending list) and ``mono`` (monotonic, for ttls) in, outcomes out; every
update applied goes to ``record`` (the history and the journal), snapshot
staging to the journal directly.  The core (:mod:`clone.server.core`) decides
when this runs (only in a follower role) and gives it two hooks for the
split-brain heal (:mod:`clone.server.splitcore`).  A restart's state, read
from the data directory, also comes in here (:meth:`SyncCore.restore`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from clone.errors import IllegalTransitionError, ProtocolError
from clone.server.history import History
from clone.server.journal import Journal
from clone.server.pending import PendingList, PendingUpdate, UuidWindow, update_id
from clone.server.store import Entry, Store
from clone.server.ttl import split_ttl_left
from clone.wire.applied import decode_kvapplied, is_kvapplied
from clone.wire.batch import decode_kvbatch, is_kvbatch
from clone.wire.codec import Hugz, KVMsg, SnapshotEnd, decode_snapshot_reply, decode_update
from clone.wire.delta import SinceRequest, decode_kvdelta, is_kvdelta, update_digest

__all__ = [
    "APPLIED_SPAN_MARGIN",
    "SYNC_TRANSITIONS",
    "FollowOutcome",
    "SplitHook",
    "SyncCore",
    "SyncEvent",
    "SyncState",
]


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

#: ``(now, ids the peer applied or None)``: the split-brain heal, told
#: when the peer's fork is known (before the snapshot's first entry) and when
#: the sync completed.
SplitHook = Callable[[float, "set[bytes] | None"], None]


def _no_hook(now: float, peer_applied: set[bytes] | None) -> None:
    """No split-brain heal (a test driving the sync alone)."""


class SyncCore:
    """A follower's copy of the active's state: syncs and ordered KVPUBs.

    Built with only what it touches: the store, the history (reset by a full
    snapshot; a catch-up asks from its last update), the journal (snapshot
    staging), the dedup window and the pending list (both reconciled), the
    shared counters, the sync buffer's bound and ``record`` (an applied update
    into the history and the journal, under the core's current term).
    """

    def __init__(
        self,
        *,
        store: Store,
        history: History,
        journal: Journal,
        window: UuidWindow,
        pending: PendingList,
        counters: dict[str, int],
        record: Callable[[list[bytes]], None],
        sync_buffer_max: int,
        fork_known: SplitHook = _no_hook,
        synced: SplitHook = _no_hook,
    ) -> None:
        self.store = store
        self.history = history
        self.journal = journal
        self.window = window
        self.pending = pending
        self.counters = counters
        self._record = record
        self._buffer_max = sync_buffer_max
        self._fork_known = fork_known
        self._synced = synced
        self.state = SyncState.IDLE
        #: The highest sequence seen anywhere (own store, peer KVPUB/HUGZ/KTHXBAI).
        self.highest_seen = 0
        #: What a HUGZ ahead of our sequence announced, while we wait one
        #: heartbeat for its updates (see :meth:`on_peer_update`).
        self._hugz_ahead: int | None = None
        #: What the last completed sync was: "full" (a snapshot) or "catch-up".
        self.last_sync = ""
        #: The fork the peer's KVAPPLIED named in this sync (the sequence it
        #: had when it became active), None if it named none.
        self.peer_fork: int | None = None
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
        # The ids the active said it applied up to this sync's snapshot, and the
        # arrival time before which a pending update may predate that list;
        # None until a KVAPPLIED of the current sync arrives.
        self.peer_applied: set[bytes] | None = None
        self._peer_applied_order: list[bytes] = []
        self._peer_applied_since = 0.0

    # -- the table -----------------------------------------------------------

    def transition(self, event: SyncEvent) -> None:
        """Move by the table; IllegalTransitionError for a pair it lacks."""
        try:
            self.state = SYNC_TRANSITIONS[(self.state, event)]
        except KeyError:
            raise IllegalTransitionError(
                f"sync event {event.name} is not allowed in state {self.state.name}"
            ) from None

    # -- starting and stopping -----------------------------------------------

    def start(self) -> None:
        """(Re)start a full sync: the caller sends ICANHAZ? on a fresh socket."""
        self.transition(SyncEvent.FOLLOW)
        self.counters["syncs_started"] += 1
        self._staging = {}
        self._staged_deadlines = {}
        self._buffer = []
        self._buffer_overflowed = False
        self._hugz_ahead = None
        self._delta = False
        self._staging_begun = False
        self.peer_fork = None
        self._forget_peer_applied()

    def stop(self, now: float, mono: float) -> None:
        """No longer following (a promotion).  A snapshot still arriving will
        never complete: keep the last whole state and whatever of the buffered
        updates follows it without a gap."""
        if self.state is SyncState.SYNCING:
            self._staging = {}
            self._staged_deadlines = {}
            self._replay_buffer(self.store.sequence, now, mono)
        self._forget_peer_applied()
        self.transition(SyncEvent.STOP)

    def catch_up_request(self, with_term: bool = True) -> SinceRequest | None:
        """What to ask the active for instead of a full snapshot, if anything.

        Our state up to our sequence, named by the digest of its last update
        (:mod:`clone.wire.delta`): the active sends only what follows, if its
        history reaches back to it and holds the same update there.  After a
        full snapshot that no update followed, the history holds nothing, but
        the store may: the key written at our sequence holds that update's
        frames (a relay that synced and then saw its upstream fail over would
        otherwise always resync in full).  None (a full snapshot) when we hold
        nothing, or not the last update itself (it was a delete).

        ``with_term`` (a pair server; a relay's terms are not its upstream's):
        the request also names the term our last update was written under,
        when the history holds it, so that a fork at an update both servers
        hold alike is told apart (:func:`clone.server.delta.open_catch_up`).
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
        term = held[1] if held is not None and with_term else None
        return SinceRequest(seq, update_digest(last), term)

    def restore(
        self,
        entries: dict[bytes, Entry],
        sequence: int,
        history: Sequence[tuple[list[bytes], int, float]],
        mono: float,
    ) -> None:
        """A restart: the state starts from what a data directory held (before
        serving or following anything), as a sync would start it from a snapshot.

        The update log becomes the history (what a peer's catch-up is served
        from) and its ids the deduplication window, so a client's resend of
        a write confirmed before the restart is still recognised.

        Monotonic time does not survive a restart, and the wall clock may have
        stepped while we were down, so neither says how long a key has left:
        every ephemeral key gets its stored ``ttl`` again from ``mono`` (at
        least what it had left when it was written; never less).  (Leases are
        the core's: each gets its whole ttl when it is rebuilt.)
        """
        self.store.replace(entries, sequence, mono)
        if history:
            self.history.reset(int.from_bytes(history[0][0][1], "big") - 1)
            self.history.load(history, self.store.packed)
        if self.history.last != sequence:
            # A log that does not end at the state's sequence describes some
            # other state: serve no catch-up from it.
            self.history.reset(sequence)
        window = self.window
        for frames, _term, at in history:
            if frames[2]:
                window.add(frames[2], at)
        self.highest_seen = max(self.highest_seen, sequence)

    # -- the peer's publisher ------------------------------------------------

    def on_peer_update(self, frames: Sequence[bytes], now: float, mono: float) -> FollowOutcome:
        """A KVPUB or HUGZ from the active peer's publisher."""
        c = self.counters
        try:
            msg = decode_update(frames)
        except ProtocolError:
            c["peer_invalid"] += 1
            raise
        state = self.state
        if isinstance(msg, Hugz):
            seq = msg.sequence
            if seq > self.highest_seen:
                self.highest_seen = seq
            if state is not SyncState.SYNCED:
                return FollowOutcome.OK
            have = self.store.sequence
            ahead, self._hugz_ahead = self._hugz_ahead, None
            if seq > have and (ahead is None or have >= ahead):
                # Ahead of us: the updates it announces may still be on their
                # way.  A release before 0.2.0 announces what it applied, not
                # what it published, so its HUGZ can overtake a KVPUB held by a
                # commit in flight; the upgrade drill saw a passive resync on
                # that, refuse votes, and miss its takeover.  A gap only if the
                # next HUGZ finds us still short of what this one announced.
                self._hugz_ahead = seq
                return FollowOutcome.OK
            if seq != have:
                # Still short of what the last HUGZ announced: we missed its
                # tail.  Lower: it is not the state we follow (a restarted
                # peer).  Either way, start over.
                c["peer_gaps"] += 1
                return FollowOutcome.RESYNC
            return FollowOutcome.OK
        c["peer_updates"] += 1
        if msg.sequence > self.highest_seen:
            self.highest_seen = msg.sequence
        if state is SyncState.SYNCED:
            return self._follow(msg, now, frames, mono)
        if state is SyncState.SYNCING:
            if len(self._buffer) < self._buffer_max:
                # With when it came: a replayed ttl counts from then.
                self._buffer.append((msg, frames, mono))
            elif not self._buffer_overflowed:
                # The replay will hit a gap and resync; better than unbounded memory.
                self._buffer_overflowed = True
                c["sync_buffer_overflow"] += 1
        return FollowOutcome.OK

    # -- the snapshot we asked for -------------------------------------------

    def on_snapshot_reply(self, frames: Sequence[bytes], now: float, mono: float) -> FollowOutcome:
        """A KVSYNC, KVBATCH, KVAPPLIED, KVDELTA or KTHXBAI of our sync."""
        c = self.counters
        if self.state is not SyncState.SYNCING:
            c["peer_ignored"] += 1
            return FollowOutcome.OK
        if is_kvbatch(frames):
            self._fork_known(now, self.peer_applied)
            if self._delta:
                c["peer_invalid"] += 1
                raise ProtocolError("KVBATCH in a catch-up (KVDELTA) reply")
            self._stage_batch(frames, mono)
            return FollowOutcome.OK
        if is_kvapplied(frames):
            self._note_peer_applied(frames, now)
            return FollowOutcome.OK
        # The applied lists came first and are complete: the winner's fork
        # is known, so a split brain's writes can go now, not after the whole
        # snapshot (seconds for a large store), while their clients' direct
        # copies race them to the winner (docs/failover.md).
        self._fork_known(now, self.peer_applied)
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
            return self._end_sync(msg.sequence, now, mono)
        if self._delta:
            return self._catch_up(msg, frames, now, mono, left)
        c["snapshot_entries_received"] += 1
        if msg.body:
            # Stored as received (decoded once, to validate): see clone.server.store.
            entry = (frames[1], frames[2], frames[3], frames[4])
            self._staging[frames[0]] = entry
            if left is not None:
                # The time it had left when sent counts from now, when it came.
                self._staged_deadlines[frames[0]] = mono + left
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
        try:
            after: int | None = decode_kvdelta(frames)
        except ProtocolError:
            after = None
        if after != self.store.sequence or self._delta or self._staging or self._staging_begun:
            # Malformed, not what we asked for, or not first: what follows
            # cannot be trusted either way (read as a snapshot it would replace
            # our state with a few updates).  Start over with a plain request.
            self.counters["peer_invalid"] += 1
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
        peer_applied = self.peer_applied
        self._reconcile_pending(now)
        self.transition(SyncEvent.SNAPSHOT_DONE)
        c["syncs_completed"] += 1
        self._synced(now, peer_applied)
        return FollowOutcome.SYNCED

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

    # -- pending reconciliation ----------------------------------------------

    def _note_peer_applied(self, frames: Sequence[bytes], now: float) -> None:
        """A KVAPPLIED of the snapshot we asked for: remember its ids."""
        try:
            applied = decode_kvapplied(frames)
        except ProtocolError:
            self.counters["peer_invalid"] += 1
            raise
        if self.peer_applied is None:
            self.peer_applied = set()
            # A list that reaches back a finite time is trusted a margin less.
            self._peer_applied_since = now - applied.span + APPLIED_SPAN_MARGIN
        if applied.fork is not None:
            self.peer_fork = applied.fork
        self.peer_applied.update(applied.ids)
        self._peer_applied_order += applied.ids
        self.counters["applied_ids_received"] += len(applied.ids)

    def _forget_peer_applied(self) -> None:
        self.peer_applied = None
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
        applied = self.peer_applied
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

    # -- in order ------------------------------------------------------------

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
