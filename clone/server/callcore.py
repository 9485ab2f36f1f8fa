"""The active server's calls, compare-and-set and leases.

How this works: a client's CALL? (docs/protocol.md, "CALL? / REPLY") is a
write or a lease operation that gets an answer.  :class:`CallCore` takes one
in two steps.  :meth:`CallCore.admit` decodes and judges it whatever the
server's role (malformed, too big, a reserved key, the ACL, who may name a
caller) and returns the call with the principal it runs for, or the refusal.
The core (:mod:`clone.server.core`) then checks the role, routes the
split-brain heal's calls to :mod:`clone.server.splitcore` and hands the rest to
:meth:`CallCore.run`:
``set`` (with ``if_sequence``, a compare-and-set, and ``lease``, a key bound
to a lease), ``lease-grant``, ``lease-keepalive``, ``lease-revoke`` and
``ahead`` (the lock queue's count).  The same rules judge a plain KVSET that
names a condition (:meth:`CallCore.check_kvset`).

The lease operations, their expiry and their rebuild at a promotion are
:class:`~clone.server.leasecore.LeaseCore`'s, which CallCore builds over the
same state and calls (:meth:`CallCore.rebuild_leases`,
:meth:`CallCore.expire_leases` stay the core's entry points).  The
``if_sequence`` of each conditional write applied in this term is kept by uuid
(:meth:`CallCore.take_conditions`): a split brain's forwarded write carries it.

Sans-IO: frames and ``now`` (wall clock, for the dedup window and a value's
``expires``) and ``mono`` (monotonic, for ttls and leases) in, replies out;
every update applied (a write, a grant, a lease's deletes) goes to ``record``
(the history and the journal, the core's one output channel) and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from clone.errors import LimitExceeded, ProtocolError, StoreFull
from clone.server.history import History
from clone.server.leasecore import LEASE_PREFIX_RAW, LeaseCore, key_sequence, refused
from clone.server.leases import LeaseTable
from clone.server.ownership import may_use
from clone.server.pending import PendingUpdate, UuidWindow
from clone.server.store import Store
from clone.wire.calls import (
    IF_SEQUENCE_PROPERTY,
    LEASE_PREFIX,
    LEASE_PROPERTY,
    OP_AHEAD,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVES,
    OP_SET,
    Call,
    Reply,
    acl_refusal,
    call_uuid,
    check_call,
    decode_call,
)
from clone.wire.codec import KVMsg
from clone.wire.split import SPLIT_PROPERTIES

__all__ = ["Admitted", "CallCore", "check_condition_syntax", "refused"]

#: The counter of each problem :func:`~clone.wire.calls.check_call` finds.
_PROBLEM_COUNTERS: dict[str, str] = {
    "reserved": "calls_reserved",
    "bad-if-sequence": "calls_bad_if_sequence",
    "bad-lease": "calls_bad_lease",
    "bad-ttl": "calls_bad_ttl",
    "bad-secret": "calls_bad_lease",
}


def check_condition_syntax(msg: KVMsg) -> None:
    """A KVSET's ``if_sequence``/``lease`` must be well-formed (as a call's)."""
    if msg.prop(IF_SEQUENCE_PROPERTY) is None and msg.prop(LEASE_PROPERTY) is None:
        return
    problem = check_call(Call(OP_SET, b"", msg.key, msg.properties, msg.body))
    if problem is not None:
        raise ProtocolError(problem[1])


def _any_key(key: bytes) -> bool:
    """No ACL: every key may be written."""
    return True


class Admitted(NamedTuple):
    """A call that passed :meth:`CallCore.admit`, and whom it runs for (a
    tuple: one is built per call, and a frozen dataclass costs more)."""

    call: Call
    caller: str


class CallCore:
    """Calls, CAS and leases on the active server.  One reactor drives it."""

    def __init__(
        self,
        *,
        store: Store,
        leases: LeaseTable,
        window: UuidWindow,
        history: History,
        counters: dict[str, int],
        record: Callable[[list[bytes]], None],
        max_leases_per_client: int,
        conditions_max: int,
    ) -> None:
        self.store = store
        self.leases = leases
        self.window = window
        self.history = history
        self.counters = counters
        self._record = record
        self._conditions_max = conditions_max
        # The if_sequence of each conditional write applied as active in this
        # term, by uuid (a stored update no longer says it).
        self._conditions: dict[bytes, int] = {}
        #: The lease operations, expiry and rebuild (clone.server.leasecore).
        self.lease_calls = LeaseCore(store=store, leases=leases, window=window, counters=counters,
                                     record=record, max_leases_per_client=max_leases_per_client)

    # -- admission -----------------------------------------------------------

    def admit(
        self,
        frames: Sequence[bytes],
        *,
        can_write: Callable[[bytes], bool] | None = None,
        may_lease: bool = True,
        caller: str = "",
        relayed: bool = False,
    ) -> Admitted | Reply | None:
        """Judge a CALL? (without its identity frame) before any role or state:
        the call and its principal, or the refusal (None: no uuid to answer).

        ``can_write``: the caller's write ACL (CURVE; None: no ACL), judging a
        call's :func:`~clone.wire.calls.acl_key` (a ``set``'s key, a grant's
        named key); ``may_lease``: whether it may write anywhere, what a call
        without such a key needs (an unnamed grant, a keepalive, a revoke).
        The rule itself is :func:`~clone.wire.calls.acl_refusal`, shared with
        the relays.  ``caller``: the caller's principal
        (:mod:`clone.server.ownership`); only a lease's owner may keep it
        alive, revoke it or bind a key to it (``not-owner``).  ``relayed``: a
        relay the pair trusts, whose call's ``caller=`` stands for the caller;
        from anyone else a ``caller=`` on a lease operation is refused.

        Each refusal has its own counter (``size``, ``malformed``, ...), so an
        operator can tell a client sending nonsense from one sending too much.
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
                return None
            return refused(uuid, "size" if oversized else "malformed", str(exc))
        return self.judge(call, can_write=can_write, may_lease=may_lease, caller=caller,
                          relayed=relayed)  # fmt: skip

    def judge(
        self,
        call: Call,
        *,
        can_write: Callable[[bytes], bool] | None = None,
        may_lease: bool = True,
        caller: str = "",
        relayed: bool = False,
    ) -> Admitted | Reply:
        """:meth:`admit`'s rules for a decoded call: what it asks for
        (:func:`~clone.wire.calls.check_call`), the ACL, who may name a
        caller.  Also each entry of a ``set-many``, as its own ``set``."""
        c = self.counters
        problem = check_call(call)
        if problem is not None:
            c[_PROBLEM_COUNTERS.get(problem[0], "calls_invalid")] += 1
            return refused(call.uuid, *problem)
        why = acl_refusal(call, can_write or _any_key, may_lease)
        if why is not None:
            c["calls_refused_acl"] += 1
            return refused(call.uuid, "acl", why)
        claimed = call.caller
        if claimed is not None:
            if relayed:
                caller = claimed
            elif call.op != OP_SET or call.lease is not None:
                # Whose lease it is would rest on an unchecked word: fail closed.
                # (A write with no lease is the same whoever asked: let it be.)
                c["calls_refused_acl"] += 1
                why = "only a relay the pair trusts (--trusted-relay) may name a caller"
                return refused(call.uuid, "acl", why)
        return Admitted(call, caller)

    # -- running -------------------------------------------------------------

    def run(self, call: Call, now: float, mono: float, caller: str = "") -> tuple[Reply, bool]:
        """An admitted call on the active server (not a split write, not a
        conflict's): its reply and whether it changed the state (and must
        wait for this turn's commit)."""
        if call.op == OP_SET:
            return self.call_set(call, now, mono, caller)
        if call.op == OP_LEASE_GRANT:
            return self.lease_calls.grant(call, now, mono, caller)
        if call.op == OP_AHEAD:
            return self.lease_calls.ahead(call), False
        if call.op == OP_LEASE_KEEPALIVES:
            return self.lease_calls.keepalives(call, mono, caller), False
        return self.lease_calls.keepalive_or_revoke(call, mono, caller)

    def run_many(
        self,
        call: Call,
        now: float,
        mono: float,
        caller: str = "",
        *,
        can_write: Callable[[bytes], bool] | None = None,
        may_lease: bool = True,
    ) -> tuple[Reply, bool]:
        """A ``set-many`` on the active server, within this one turn: each
        entry judged by the rules of a ``set`` call (:meth:`judge`: what it
        asks for, the ACL key by key; a split write's properties are a peer's
        single ``set`` only) and applied by :meth:`call_set` as an ordinary
        update with its own sequence and KVPUB, deduplicated by its own uuid.
        One reply: ``ok`` with each entry's sequence (0 and a reason for an
        entry not applied); it waits for the turn's commit if any entry did."""
        c = self.counters
        c["set_many_calls"] += 1
        c["set_many_entries"] += len(call.entries)
        sequences: list[int] = []
        failures: list[tuple[int, str, str]] = []
        changed = False
        for index, entry in enumerate(call.entries):
            judged = self.judge(entry, can_write=can_write, may_lease=may_lease, caller=caller)
            if isinstance(judged, Reply):
                reply = judged
            elif any(name in SPLIT_PROPERTIES for name, _ in entry.properties):
                c["calls_invalid"] += 1
                reply = refused(entry.uuid, "malformed", "a split write is a single set call")
            else:
                reply, applied = self.call_set(entry, now, mono, caller)
                changed = changed or applied
            if reply.ok:
                sequences.append(reply.sequence)
                continue
            sequences.append(0)
            if reply.status == "conflict":
                failures.append((index, "conflict", str(reply.current)))
            else:
                failures.append((index, reply.reason, reply.detail))
        reply = Reply(call.uuid, "ok", self.store.sequence, sequences=tuple(sequences),
                      failures=tuple(failures))  # fmt: skip
        return reply, changed

    def call_set(
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
            return Reply(uuid, "ok", self.applied_sequence(uuid, raw_key)), False
        lease_id = call.lease
        if lease_id is not None:
            held = self.leases.get(lease_id)
            if held is None:
                c["calls_unknown_lease"] += 1
                return refused(uuid, "unknown-lease", f"no lease {lease_id}"), False
            if not ours and not may_use(held.owner, caller, call.secret):
                return self.not_owner(uuid, lease_id, held.owner), False
        expected = call.if_sequence
        if expected is not None:
            current = self.key_sequence(raw_key)
            if current != expected:
                c["calls_conflict"] += 1
                return Reply(uuid, "conflict", current=current), False
        try:
            out = self.store.apply(call.as_kvmsg(), mono, wall=now)
        except StoreFull as exc:
            c["calls_refused_full"] += 1
            return refused(uuid, "full", str(exc)), False
        except LimitExceeded as exc:
            c["calls_refused_size"] += 1
            return refused(uuid, "size", str(exc)), False
        except ProtocolError as exc:
            c["calls_invalid"] += 1
            return refused(uuid, "malformed", str(exc)), False
        self.window.add(uuid, now)
        if lease_id is not None:
            self.leases.bind(lease_id, raw_key)
        if expected is not None:
            self._note_condition(uuid, expected)
        c["kvpub_published"] += 1
        c["calls_ok"] += 1
        self._record(out)
        return Reply(uuid, "ok", self.store.sequence), True

    # -- conditions (what a split write carries) -----------------------------

    def _note_condition(self, uuid: bytes, expected: int) -> None:
        """A conditional write applied as active: what its split write says.
        Bounded like the history it would be forwarded from."""
        conditions = self._conditions
        conditions[uuid] = expected
        if len(conditions) > self._conditions_max:
            del conditions[next(iter(conditions))]

    def take_conditions(self) -> dict[bytes, int]:
        """The conditions noted in this term, by uuid; a new term starts empty."""
        conditions, self._conditions = self._conditions, {}
        return conditions

    # -- a KVSET that names a condition --------------------------------------

    def check_kvset(self, msg: KVMsg, raw_key: bytes) -> KVMsg:
        """The call rules for a KVSET applied as active (or at a promotion).

        Returns the message to store: ``msg``, or a copy without its
        ``if_sequence`` (a condition is never stored).  Raises ProtocolError
        (counted) when it may not be applied.
        """
        c = self.counters
        if raw_key.startswith(LEASE_PREFIX_RAW):
            c["kvset_reserved"] += 1
            raise ProtocolError(f"key {msg.key[:80]!r}: keys under {LEASE_PREFIX} are the server's")
        expected_text = msg.prop(IF_SEQUENCE_PROPERTY)
        lease_id = msg.prop(LEASE_PROPERTY)
        if expected_text is None and lease_id is None:
            return msg
        try:
            check_condition_syntax(msg)
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
        current = self.key_sequence(raw_key)
        if current != int(expected_text):
            c["kvset_conflict"] += 1
            raise ProtocolError(
                f"write to {msg.key[:80]!r} expected sequence {expected_text},"
                f" the key is at {current}"
            )
        if msg.uuid:
            self._note_condition(msg.uuid, current)
        return KVMsg(msg.key, 0, msg.uuid, msg.with_props(**{IF_SEQUENCE_PROPERTY: None}), msg.body)

    def apply_parked(self, parked_updates: Iterable[PendingUpdate], now: float) -> None:
        """Apply parked client updates as active, in the order given (a
        promotion's pending list, a hold's end): each by :meth:`check_kvset`'s
        rules, with its ttl counted from when it arrived; one already applied
        (its uuid in the window) is skipped, one now refused is dropped."""
        c = self.counters
        store = self.store
        applied = 0
        for parked in parked_updates:
            msg = parked.msg
            if msg.uuid and msg.uuid in self.window:
                c["pending_skipped"] += 1
                continue
            raw_key = msg.key.encode("utf-8")
            try:
                if msg.properties:
                    msg = self.check_kvset(msg, raw_key)
                # ttl counts from when the client sent it, not from now.
                pub = store.apply(msg, parked.mono, wall=parked.arrived)
            except ProtocolError:
                c["pending_failed"] += 1
                continue
            if msg.uuid:
                self.window.add(msg.uuid, now)
            self.bind_if_leased(msg, raw_key)
            self._record(pub)
            applied += 1
        c["pending_applied"] += applied
        c["kvpub_published"] += applied

    def bind_if_leased(self, msg: KVMsg, raw_key: bytes) -> None:
        lease_id = msg.prop(LEASE_PROPERTY)
        if lease_id is not None:
            self.leases.bind(lease_id, raw_key)

    # -- sequences -----------------------------------------------------------

    def key_sequence(self, raw_key: bytes) -> int:
        """A key's sequence as a compare-and-set sees it: 0 when absent."""
        return key_sequence(self.store, raw_key)

    def applied_sequence(self, uuid: bytes, raw_key: bytes) -> int:
        """The sequence the update with ``uuid`` got (0 if no longer known)."""
        entry = self.store.entry(raw_key)
        if entry is not None and entry[1] == uuid:
            return int.from_bytes(entry[0], "big")
        return self.history.sequence_of(uuid) or 0

    # -- lease lifetimes (clone.server.leasecore) ----------------------------

    def not_owner(self, uuid: bytes, lease_id: str, owner: str | None) -> Reply:
        return self.lease_calls.not_owner(uuid, lease_id, owner)

    def expire_leases(self, mono: float, limit: int) -> None:
        self.lease_calls.expire_leases(mono, limit)

    def end_lease(self, lease_id: str, now: float) -> None:
        self.lease_calls.end_lease(lease_id, now)

    def rebuild_leases(self, now: float) -> None:
        self.lease_calls.rebuild_leases(now)

    def leases_usable_from(self, mono: float, lease_ids: Iterable[str] | None = None) -> None:
        self.lease_calls.leases_usable_from(mono, lease_ids)
