"""The split-brain heal: the loser's kept writes and the winner's judging.

How this works (docs/failover.md, "Writes of a split brain"): a server
demoted from active keeps what it wrote in its term (:meth:`SplitCore.demoted`).
When it has synced with the winner (:class:`~clone.server.synccore.SyncCore`'s
two hooks, :meth:`SplitCore.fork_known` and :meth:`SplitCore.synced`), the
winner's fork (its KVAPPLIED) says which of those writes it cannot hold; they
are kept and turned into SET calls carrying the split properties
(:mod:`clone.wire.split`), a slice at a time (:meth:`SplitCore.take_calls`:
100k at once blocked the loop), for the I/O layer to send the winner.

The winner judges each by :func:`~clone.server.splitrule.judge_split_write`
(:meth:`SplitCore.on_call`): applied as a plain ``set`` (through
:class:`~clone.server.callcore.CallCore`), or kept as a conflict in the
:class:`~clone.server.conflicts.ConflictBook` for an operator to apply or
discard (:meth:`SplitCore.resolve`).  Elected again before the winner
answered, the loser applies its own calls by the same rule
(:meth:`SplitCore.apply_own`).

Sans-IO, as the rest of the core: events and ``now`` (wall clock) and
``mono`` (monotonic, for ttls and leases) in, replies out; every update it
applies goes to ``record`` (the history and the journal).  The role is the
core's (:mod:`clone.server.core`): it routes here only as active, or says why
an apply is refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from clone.errors import ProtocolError
from clone.server.callcore import CallCore, refused
from clone.server.conflicts import ConflictBook, ConflictRecord
from clone.server.history import History
from clone.server.leases import LeaseTable
from clone.server.pending import PendingList, UuidWindow
from clone.server.split import split_writes
from clone.server.splitrule import Verdict, judge_split_write
from clone.server.store import Entry, Store
from clone.wire.calls import (
    CONFLICT_PROPERTY,
    LEASE_PROPERTY,
    OP_CONFLICT_APPLY,
    Call,
    Reply,
    decode_call,
)
from clone.wire.codec import KVMsg, decode_properties, encode_properties
from clone.wire.split import SPLIT_PROPERTIES, SplitOrigin, parse_split_origin, uuid_time

__all__ = ["SplitCore"]


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


def _conflict_reply(rec: ConflictRecord) -> Reply:
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


class SplitCore:
    """Both sides of a split brain's heal.  Not thread-safe: one reactor drives it.

    Built with only what it touches: the store (a key's current entry; a
    resolved conflict's write), the history (what we wrote in a term; the keys
    changed after a fork), the dedup window (a judged write's id counts as
    seen), the pending list (a loser's parked updates dropped), the lease
    table (is a write's lease alive), the call core (a split write applied is
    a ``set``; the conditions a term's writes carried), the conflict book,
    the shared counters, ``record`` (an applied update into the history and
    the journal) and ``peer_fork`` (the fork the peer's KVAPPLIED named in
    the current sync, the sync core's).
    """

    def __init__(
        self,
        *,
        store: Store,
        history: History,
        window: UuidWindow,
        pending: PendingList,
        leases: LeaseTable,
        calls: CallCore,
        conflicts: ConflictBook,
        counters: dict[str, int],
        record: Callable[[list[bytes]], None],
        peer_fork: Callable[[], int | None],
    ) -> None:
        self.store = store
        self.history = history
        self.window = window
        self.pending = pending
        self.leases = leases
        self.calls = calls
        #: Split-brain writes of a loser this server did not apply (the winner's side).
        self.conflicts = conflicts
        self.counters = counters
        self._record = record
        self._peer_fork = peer_fork
        # Demoted from active: the updates we wrote in our term, until the
        # winner's fork says which it lacks (clone.server.split); the term we
        # wrote under; the if_sequence of each conditional write, by uuid.
        self._written: Sequence[Sequence[bytes]] = []
        self._written_term = 0
        self._written_conditions: dict[bytes, int] = {}
        # Our promotion's fork and the sequence our updates follow (promoted).
        self._jump = (0, 0)
        # The writes kept for the winner and its fork (and the time they were
        # kept), turned into SET calls a slice at a time; how far into the
        # first the conversion is; and the calls converted but not yet taken.
        self._kept: deque[_Kept] = deque()
        self._kept_at = 0
        self._converted: list[list[bytes]] = []
        # The ids the winner said it applied, at the resync that kept them:
        # elected again, we must not apply those a second time.
        self._peer_applied: set[bytes] | frozenset[bytes] = frozenset()
        #: Writes of ours after a split brain that no fork let us sort (logged once).
        self.unverified = 0
        # Judging split writes: the fork, the sequence the history was read up
        # to, and every key updated after the fork (None: the history does
        # not reach back to it).
        self._fork_keys: tuple[int, int, set[bytes] | None] | None = None
        #: When the last split write of a loser came (the winner's hold ends after it).
        self.call_at = 0.0

    # -- roles ---------------------------------------------------------------

    def promoted(self, fork: int, own_from: int) -> None:
        """Became active: nothing of an earlier term is kept to settle, and
        the keys changed since a fork are read afresh.  ``fork``: the
        sequence we had applied; ``own_from``: the one our own updates as
        active follow (the promotion carries on from the highest sequence
        seen anywhere, so it may jump past the fork: no update of ours lies
        between the two)."""
        self._written = []
        self._fork_keys = None
        self._jump = (fork, own_from)

    def demoted(self, term: int) -> None:
        """Demoted from active in ``term``: keep what we wrote in it (and the
        conditions those writes carried); the winner may lack some."""
        self._written = self.history.written_under(term)
        self._written_term = term
        self._written_conditions = self.calls.take_conditions()

    # -- the loser's side: kept writes, as calls ------------------------------

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

    def fork_known(self, now: float, peer_applied: set[bytes] | None) -> None:
        """The sync's hook: the winner's fork is known before its snapshot."""
        if self._written and self._peer_fork() is not None:
            self.synced(now, peer_applied)

    def synced(self, now: float, peer_applied: set[bytes] | None) -> None:
        """Synced after a demotion: keep, as calls, what we wrote that the
        active (elected while we were active too) cannot hold."""
        written, self._written = self._written, []
        if not written:
            return
        self._peer_applied = peer_applied or frozenset()
        fork = self._peer_fork()
        if fork is None:
            # A Guide peer, or ours from before forks: we cannot tell which of
            # our writes it lacks, and resending all would undo newer ones.
            self.counters["split_writes_unverified"] += len(written)
            self.unverified += len(written)
            return
        # Converted to calls later, a slice per loop turn (take_calls), with
        # what the winner's rule needs of each (clone.wire.split).
        conditions, self._written_conditions = self._written_conditions, {}
        self._kept.append(_Kept(written, fork, now, self._written_term, conditions))

    @property
    def left(self) -> int:
        """Kept writes not yet taken as calls (an upper bound on the calls to
        come: some will be left out)."""
        kept = sum(len(k.written) for k in self._kept)
        return len(self._converted) + kept - self._kept_at

    def take_calls(self, limit: int) -> list[list[bytes]]:
        """The next SET calls for the active peer: the converted ones, then
        :func:`split_writes` of at most ``limit`` more kept writes (the ttl
        left is counted from when they were kept)."""
        out, self._converted = self._converted, []
        kept = self._kept
        c = self.counters
        while kept and limit > 0:
            first = kept[0]
            start = self._kept_at
            part = first.written[start : start + limit]
            limit -= len(part)
            self._kept_at = start + len(part)
            if self._kept_at >= len(first.written):
                kept.popleft()
                self._kept_at = 0
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
    def all_calls(self) -> list[list[bytes]]:
        """Every SET call still to send, all converted at once (tests; the
        reactor takes slices instead).  The list itself: clearing it drops them."""
        calls = self.take_calls(self.left)
        self._converted = calls
        return calls

    def drop_calls(self) -> int:
        """Forget the kept writes not yet taken; returns how many there were."""
        left = self.left
        self._kept.clear()
        self._kept_at = 0
        self._converted = []
        self._peer_applied = frozenset()
        return left

    def apply_own(self, frames: Sequence[bytes], now: float, mono: float) -> Reply | None:
        """Elected again before the winner answered it: apply one of our own
        split-brain calls here, as active (None if the frames are not a call).

        Not as a call from the peer: our uuid window holds its id (we applied
        the write once, before the resync replaced our state with the
        winner's), so it would be answered as a duplicate and applied nowhere.
        It is applied unless the state we hold now has it: the winner said it
        had applied it (its KVAPPLIED at that resync), or we followed the
        winner's update with that id since, or it is its key's current value.
        """
        try:
            call = decode_call(frames)
        except ProtocolError:
            self.counters["calls_invalid"] += 1
            return None
        raw_key = call.key.encode("utf-8")
        held = self.calls.applied_sequence(call.uuid, raw_key)
        if held or call.uuid in self._peer_applied:
            self.counters["split_writes_held"] += 1
            return Reply(call.uuid, "ok", held)
        try:
            origin = parse_split_origin(call.properties)
        except ValueError:
            origin = None  # ours: cannot happen; applied as before the rule
        if origin is None:
            return self.calls.call_set(call, now, mono, ours=True)[0]
        # The state we hold is the winner's since the resync: its rule, here.
        known = self.conflicts.of_uuid(call.uuid)
        if known is not None:
            return _conflict_reply(known)
        return self._judge(call, origin, now, mono, ours=True)[0]

    # -- the winner's side: judging, conflicts ---------------------------------

    def on_call(
        self, call: Call, now: float, mono: float, peer: bool, caller: str = ""
    ) -> tuple[Reply, bool]:
        """A write the loser of a split brain forwards (a ``set`` with split
        properties, admitted, on the active): applied by the rule of
        :mod:`clone.server.splitrule`, or kept as a conflict and answered so."""
        c = self.counters
        uuid = call.uuid
        if not peer:
            c["split_calls_refused_not_peer"] += 1
            return refused(uuid, "acl", "split_* properties are the peer server's"), False
        try:
            origin = parse_split_origin(call.properties)
        except ValueError as exc:
            c["calls_invalid"] += 1
            return refused(uuid, "malformed", str(exc)), False
        assert origin is not None
        c["split_calls_received"] += 1
        self.call_at = now
        known = self.conflicts.of_uuid(uuid)
        if known is not None:
            # A resend of a write already judged: the same answer.
            return _conflict_reply(known), False
        if uuid in self.window:
            return self.calls.call_set(_without_split(call), now, mono, caller)
        return self._judge(call, origin, now, mono, caller)

    def _judge(
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
            reply, changed = self.calls.call_set(plain, now, mono, caller, ours=ours)
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
        return _conflict_reply(rec), True

    def _changed_since(self, raw_key: bytes, fork: int, entry: Entry | None) -> bool:
        """Whether we updated ``raw_key`` after sequence ``fork`` (True when
        the history no longer reaches back that far and the key is absent)."""
        if entry is not None:
            return int.from_bytes(entry[0], "big") > fork
        history = self.history
        jumped_from, own_from = self._jump
        if jumped_from <= fork <= own_from and not history.covers(fork):
            # Our promotion jumped from the fork to the highest sequence seen
            # anywhere: we wrote nothing in between, and the history starts
            # at the jump.  Read from there, or every absent key would be
            # "changed" and every loser write to a new key a conflict (seen:
            # a chaos run's confirmed writes to keys only their writer used,
            # kept as conflicts after a split brain).
            fork = own_from
        cached = self._fork_keys
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

    def resolve(
        self, cid: int, action: str, now: float, mono: float, *, not_active: str | None = None
    ) -> ConflictRecord:
        """An operator's word on conflict ``cid``: ``apply`` writes the loser's
        value now (a new update, published), ``discard`` only marks it.
        ``not_active``: why this server may not apply (its role), None as
        active.  ValueError saying why not (unknown, resolved, not active)."""
        rec = self.conflicts.get(cid)
        if rec is None:
            raise ValueError(f"no conflict {cid}")
        if rec.resolution is not None:
            raise ValueError(f"conflict {cid} was {rec.resolution} already")
        if action == "apply":
            if not_active is not None:
                raise ValueError(not_active)
            props = tuple(
                (n, v) for n, v in decode_properties(rec.loser_props) if n != LEASE_PROPERTY
            )
            msg = KVMsg(rec.key.decode("utf-8"), 0, rec.loser_uuid, props, rec.loser_body)
            self._record(self.store.apply(msg, mono, wall=now))
            self.counters["kvpub_published"] += 1
            self.counters["conflicts_applied"] += 1
            done = self.conflicts.resolve(cid, "applied")
        elif action == "discard":
            self.counters["conflicts_discarded"] += 1
            done = self.conflicts.resolve(cid, "discarded")
        else:
            raise ValueError(f"a conflict is applied or discarded, not {action!r}")
        return done

    def on_conflict_call(self, call: Call, now: float, mono: float) -> tuple[Reply, bool]:
        """An operator applies or discards a conflict by a call, on the active;
        the ACL has judged its key."""
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
            return refused(call.uuid, "unknown-conflict", why), False
        action = "apply" if call.op == OP_CONFLICT_APPLY else "discard"
        self.resolve(cid, action, now, mono)
        c["calls_ok"] += 1
        seq = self.store.sequence if action == "apply" else 0
        return Reply(call.uuid, "ok", seq), True
