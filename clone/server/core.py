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
  calls; the winner judges them (:mod:`clone.server.splitrule`) and keeps
  those it does not apply as conflicts.  That is
  :class:`~clone.server.splitcore.SplitCore`'s, fed by the sync's two hooks;
  the core holds client updates while it wins one (:meth:`ServerCore.hold_writes`).

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
from collections.abc import Callable, Sequence

from clone.errors import IllegalTransitionError, ProtocolError, StoreFull
from clone.server.callcore import Admitted, CallCore, check_condition_syntax, refused
from clone.server.conflicts import ConflictBook, ConflictRecord
from clone.server.coresettings import COUNTERS, CoreSettings
from clone.server.delta import DeltaStream, open_stream
from clone.server.history import History
from clone.server.journal import Journal
from clone.server.leases import LeaseTable
from clone.server.pending import PendingList, UuidWindow
from clone.server.snapshot import SnapshotStream
from clone.server.splitcore import SplitCore
from clone.server.store import Entry, Store
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
from clone.wire.calls import CONFLICT_OPS, LEASE_PREFIX, OP_SET, OP_SET_MANY, Reply
from clone.wire.codec import Properties, decode_icanhaz, decode_kvset, encode_hugz, encode_kv
from clone.wire.delta import SinceRequest
from clone.wire.protocol import TTL_PROPERTY
from clone.wire.split import SPLIT_PROPERTIES

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

_LEASE_PREFIX_RAW = LEASE_PREFIX.encode()


def _mono(mono: float | None, now: float) -> float:
    """The monotonic time given, or ``now`` for a caller with one clock (a test)."""
    return now if mono is None else mono


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
        #: Split-brain writes of a loser this server did not apply (the winner's side).
        self.conflicts = ConflictBook(settings.max_conflict_bytes)
        #: The split-brain heal: kept writes as calls, the winner's judging.
        self.split = SplitCore(
            store=self.store,
            history=self.history,
            window=self.window,
            pending=self.pending,
            leases=self.leases,
            calls=self.calls,
            conflicts=self.conflicts,
            counters=self.counters,
            record=self._record,
            peer_fork=lambda: self.sync.peer_fork,
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
            fork_known=self.split.fork_known,
            synced=self.split.synced,
        )
        #: The sequence we had applied when we last became active (KVAPPLIED's
        #: ``fork``): a peer active at the same time forwards its writes after it.
        self.promoted_at: int | None = None
        #: Winning a split brain: client updates are parked until the loser's
        #: forwarded writes are in (hold_writes).
        self.holding = False

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
                check_condition_syntax(msg)
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

        ``applied``: it asked for the applied-update list (:mod:`clone.wire.applied`),
        which then goes first, as of ``now``.  ``since`` (:mod:`clone.wire.delta`)
        decides between a delta and the whole state, ``clock`` how ephemeral
        entries go out (:func:`~clone.server.delta.open_stream`).  ``allowed``:
        the requester may read only keys under these prefixes
        (clone.server.security); ``end_properties`` go into its KTHXBAI.
        """
        preamble: list[list[bytes]] = []
        if applied:
            window = self.window
            fork = self.promoted_at if self.role is Role.ACTIVE else None
            preamble = encode_kvapplied(
                self.store.sequence, uuid_ids(window.ids()), window.span(now), fork
            )
        return open_stream(
            self.store,
            self.history,
            identity,
            subtree,
            preamble,
            batch=batch,
            since=since,
            allowed=allowed,
            end_properties=end_properties,
            clock=clock,
        )

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
        self.calls.take_conditions()  # a new term: its own conditions
        store.sequence = max(store.sequence, self.highest_seen)
        self.split.promoted(self.promoted_at, store.sequence)
        self.calls.rebuild_leases(_mono(mono, now))
        self.calls.apply_parked(self.pending.drain(), now)
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
        that arrived since the demotion (:meth:`SplitCore.drop_pending_since`)."""
        return self.split.drop_pending_since(since)

    def release_held(self, now: float) -> None:
        """End :meth:`hold_writes`: apply what was parked, in arrival order (a
        write the peer forwarded meanwhile is in the uuid window: skipped)."""
        if not self.holding:
            return
        self.holding = False
        self.calls.apply_parked(self.pending.drain(), now)

    def become_passive(self, *, wrote_last: bool = False) -> None:
        """Demotion or first decision: the caller must now start a sync.
        ``wrote_last``: our data was last written as the active."""
        self.holding = False
        if self.role is Role.ACTIVE:
            self.counters["demotions"] += 1
        # What we wrote as active: the winner of a split brain may lack some,
        # and so may a peer that served alone after our last term.
        if self.role is Role.ACTIVE or (wrote_last and self.role is Role.STARTING and self.term):
            self.split.demoted(self.term)
        self.promoted_at = None
        self.role = Role.PASSIVE
        # Only the active server keeps time for leases; a new one rebuilds them.
        self.leases.clear()

    # -- following the active peer (clone.server.synccore) -------------------

    def start_sync(self) -> None:
        """(Re)start a full sync: the caller sends ICANHAZ? on a fresh socket."""
        self.sync.start()

    def catch_up_request(self, with_term: bool = True) -> SinceRequest | None:
        """What to ask the active for instead of a full snapshot, if anything
        (:meth:`SyncCore.catch_up_request`)."""
        return self.sync.catch_up_request(with_term)

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

    # -- the split-brain heal (clone.server.splitcore) ------------------------

    @property
    def split_left(self) -> int:
        """Kept split-brain writes not yet taken as calls (:attr:`SplitCore.left`)."""
        return self.split.left

    def take_split_calls(self, limit: int) -> list[list[bytes]]:
        """The next SET calls for the active peer (:meth:`SplitCore.take_calls`)."""
        return self.split.take_calls(limit)

    @property
    def split_calls(self) -> list[list[bytes]]:
        """Every SET call still to send the active peer (tests; clearing drops them)."""
        return self.split.all_calls

    def drop_split_calls(self) -> int:
        """Forget the kept writes not yet taken; returns how many there were."""
        return self.split.drop_calls()

    @property
    def split_unverified(self) -> int:
        """Writes of ours after a split brain that no fork let us sort (logged once)."""
        return self.split.unverified

    @split_unverified.setter
    def split_unverified(self, value: int) -> None:
        self.split.unverified = value

    @property
    def split_call_at(self) -> float:
        """When the last split write of a loser came (the winner's hold ends after it)."""
        return self.split.call_at

    def apply_own_split_call(
        self, frames: Sequence[bytes], now: float, mono: float | None = None
    ) -> Reply | None:
        """Elected again before the winner answered it: apply one of our own
        split-brain calls here (:meth:`SplitCore.apply_own`; None if the frames
        are not a call)."""
        assert self.role is Role.ACTIVE
        return self.split.apply_own(frames, now, _mono(mono, now))

    def resolve_conflict(
        self, cid: int, action: str, now: float, mono: float | None = None
    ) -> ConflictRecord:
        """An operator's word on conflict ``cid``: ``apply`` or ``discard``
        (:meth:`SplitCore.resolve`).  ValueError saying why not (unknown,
        resolved, not active)."""
        not_active = None if self.role is Role.ACTIVE else f"this server is {self.role.value}"
        return self.split.resolve(cid, action, now, _mono(mono, now), not_active=not_active)

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
        ``can_write``, ``may_lease``, ``caller`` and ``relayed`` (the write ACL
        and the principal) are :meth:`CallCore.admit`'s, judged before any role.
        ``peer``: the caller is the peer server (or there is no way to tell:
        no CURVE).  Only a peer's ``set`` may carry the split-brain properties
        (:mod:`clone.wire.split`); it is then judged by the heal's rule
        (:meth:`SplitCore.on_call`).
        """
        admitted = self.calls.admit(
            frames, can_write=can_write, may_lease=may_lease, caller=caller, relayed=relayed
        )
        if not isinstance(admitted, Admitted):
            return admitted, False
        call, caller = admitted.call, admitted.caller
        if self.role is not Role.ACTIVE:
            self.counters["calls_not_active"] += 1
            return refused(call.uuid, "not-active", f"this server is {self.role.value}"), False
        mono = _mono(mono, now)
        if call.op == OP_SET and any(name in SPLIT_PROPERTIES for name, _ in call.properties):
            return self.split.on_call(call, now, mono, peer, caller)
        if call.op in CONFLICT_OPS:
            return self.split.on_conflict_call(call, now, mono)
        if call.op == OP_SET_MANY:
            return self.calls.run_many(call, now, mono, caller, can_write=can_write,
                                       may_lease=may_lease)  # fmt: skip
        return self.calls.run(call, now, mono, caller)

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
        # The store's packed entry, when it holds this update so: shared, not copied.
        self.history.append(frames, self.term, self.store.packed(frames[0]))
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
        """Start from the state a data directory held, before serving anything
        (:meth:`SyncCore.restore`)."""
        mono = _mono(mono, now)
        self.sync.restore(entries, sequence, history, mono)
        if self.role is Role.ACTIVE:
            # A standalone server serves at once: its leases start a full ttl now.
            self.calls.rebuild_leases(mono)
