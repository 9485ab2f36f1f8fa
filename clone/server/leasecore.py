"""The active server's leases: grants, keepalives (one or many), revokes,
the lock queue's ``ahead``, expiry, and the rebuild at a promotion.

How this works: :class:`~clone.server.callcore.CallCore` admits every call
and runs the ``set``s; the lease operations it hands to :class:`LeaseCore`,
built with the same store, lease table, dedup window, counters and
``record`` callback.  Leases live in :class:`~clone.server.leases.LeaseTable`
with their monotonic deadlines; only the active server keeps time for them,
so a promotion rebuilds them from the store (:meth:`LeaseCore.rebuild_leases`)
and a lease that runs out deletes its keys, then its own key
(:meth:`LeaseCore.expire_leases`).  Who may use a lease is
:mod:`clone.server.ownership`'s rule.

Sans-IO, as CallCore: ``now`` (wall clock, the dedup window) and ``mono``
(monotonic, the leases' deadlines) in, replies out; every update applied (a
grant, a lease's deletes) goes to ``record`` and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from clone.errors import StoreFull
from clone.server.leases import (
    OWNER_PROPERTY,
    LeaseTable,
    bound_lease,
    format_lease_value,
    lease_owner,
    parse_lease_value,
)
from clone.server.ownership import grant_owner, may_use
from clone.server.pending import UuidWindow
from clone.server.store import Store
from clone.wire.calls import (
    LEASE_PREFIX,
    OP_LEASE_KEEPALIVE,
    Call,
    Reply,
    lease_id_of,
    lease_key,
    parse_keepalives,
    parse_lease_ttl,
)
from clone.wire.codec import KVMsg
from clone.wire.protocol import TTL_PROPERTY

__all__ = ["LEASE_PREFIX_RAW", "LeaseCore", "key_sequence", "refused"]

LEASE_PREFIX_RAW = LEASE_PREFIX.encode()


def refused(uuid: bytes, reason: str, detail: str) -> Reply:
    return Reply(uuid, "refused", reason=reason, detail=detail)


def key_sequence(store: Store, raw_key: bytes) -> int:
    """A key's sequence as a compare-and-set sees it: 0 when absent."""
    entry = store.entry(raw_key)
    return 0 if entry is None else int.from_bytes(entry[0], "big")


class LeaseCore:
    """Leases on the active server.  One reactor drives it (through CallCore)."""

    def __init__(
        self,
        *,
        store: Store,
        leases: LeaseTable,
        window: UuidWindow,
        counters: dict[str, int],
        record: Callable[[list[bytes]], None],
        max_leases_per_client: int,
    ) -> None:
        self.store = store
        self.leases = leases
        self.window = window
        self.counters = counters
        self._record = record
        self._quota = max_leases_per_client

    # -- the lease calls -----------------------------------------------------

    def grant(
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
                return self.not_owner(uuid, lease_id, held.owner), False
            c["calls_duplicate"] += 1
            c["calls_ok"] += 1
            seq = key_sequence(self.store, lease_key(lease_id).encode())
            return Reply(
                uuid, "ok", seq, lease=lease_id, ttl=held.ttl, secret=call.secret or ""
            ), False
        if uuid in self.window:
            # Granted once, and gone since (expired or revoked).
            c["calls_unknown_lease"] += 1
            why = f"lease {lease_id} expired or was revoked"
            return refused(uuid, "unknown-lease", why), False
        if self.leases.full:
            c["calls_refused_busy"] += 1
            return refused(
                uuid, "busy", f"the server holds {len(self.leases)} leases, its --max-leases"
            ), False
        quota = self._quota
        if caller and self.leases.held_by(caller) >= quota:
            c["calls_refused_lease_quota"] += 1
            why = f"this client holds {quota} leases, its --max-leases-per-client"
            return refused(uuid, "lease-quota", why), False
        ttl = parse_lease_ttl(call.prop(TTL_PROPERTY))
        owner, secret = grant_owner(caller, call.secret)
        msg = KVMsg(
            lease_key(lease_id), 0, uuid, ((OWNER_PROPERTY, owner),), format_lease_value(ttl)
        )
        try:
            out = self.store.apply(msg, mono, wall=now)
        except StoreFull as exc:
            c["calls_refused_full"] += 1
            return refused(uuid, "full", str(exc)), False
        self.window.add(uuid, now)
        self.leases.grant(lease_id, ttl, mono)
        self.leases.adopt(lease_id, owner, caller)
        c["leases_granted"] += 1
        c["kvpub_published"] += 1
        c["calls_ok"] += 1
        self._record(out)
        return Reply(uuid, "ok", self.store.sequence, lease=lease_id, ttl=ttl, secret=secret), True

    def keepalive_or_revoke(self, call: Call, mono: float, caller: str) -> tuple[Reply, bool]:
        """A ``lease-keepalive`` or a ``lease-revoke``: its reply and whether
        it changed the state (a revoke deletes the lease's keys)."""
        c = self.counters
        lease_id = call.lease
        assert lease_id is not None  # check_call
        held = self.leases.get(lease_id)
        if held is None:
            c["calls_unknown_lease"] += 1
            return refused(call.uuid, "unknown-lease", f"no lease {lease_id}"), False
        if not may_use(held.owner, caller, call.secret):
            return self.not_owner(call.uuid, lease_id, held.owner), False
        if call.op == OP_LEASE_KEEPALIVE:
            lease = self.leases.keepalive(lease_id, mono)
            assert lease is not None  # held
            c["lease_keepalives"] += 1
            c["calls_ok"] += 1
            return Reply(call.uuid, "ok", lease=lease_id, ttl=lease.ttl), False
        # lease-revoke
        self.end_lease(lease_id, mono)
        c["leases_revoked"] += 1
        c["calls_ok"] += 1
        return Reply(call.uuid, "ok", self.store.sequence, lease=lease_id, ttl=held.ttl), True

    def keepalives(self, call: Call, mono: float, caller: str) -> Reply:
        """Many leases kept alive by one call (a client holding 10,000 leases
        sent 10,000 keepalives a ttl/3).  Each lease is judged as its own
        ``lease-keepalive`` would be; the ones not kept are listed with their
        reason, and the call itself is ``ok``."""
        c = self.counters
        leases = self.leases
        gone: list[tuple[str, str]] = []
        kept = 0
        # A client's leases share an owner and a secret: judge each pair once
        # (a SHA-256 per lease was most of a 10,000-lease call's time).
        verdicts: dict[tuple[str | None, str | None], bool] = {}
        for lease_id, secret in parse_keepalives(call.body):
            held = leases.get(lease_id)
            if held is None:
                c["calls_unknown_lease"] += 1
                gone.append((lease_id, "unknown-lease"))
                continue
            pair = (held.owner, secret)
            allowed = verdicts.get(pair)
            if allowed is None:
                allowed = verdicts[pair] = may_use(held.owner, caller, secret)
            if not allowed:
                c["calls_not_owner"] += 1
                gone.append((lease_id, "not-owner"))
            else:
                leases.keepalive(lease_id, mono)
                kept += 1
        c["lease_keepalives"] += kept
        c["lease_keepalive_batches"] += 1
        c["calls_ok"] += 1
        return Reply(call.uuid, "ok", kept=kept, gone=tuple(gone))

    def ahead(self, call: Call) -> Reply:
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

    def not_owner(self, uuid: bytes, lease_id: str, owner: str | None) -> Reply:
        self.counters["calls_not_owner"] += 1
        if owner is None:
            why = f"lease {lease_id} predates lease ownership: nobody may use it"
        else:
            why = f"lease {lease_id} is another client's"
        return refused(uuid, "not-owner", why)

    # -- lease lifetimes -----------------------------------------------------

    def expire_leases(self, mono: float, limit: int) -> None:
        """End the leases due at ``mono`` (at most ``limit``), with their keys."""
        for lease_id in self.leases.due(mono, limit):
            self.counters["leases_expired"] += 1
            self.end_lease(lease_id, mono)

    def end_lease(self, lease_id: str, now: float) -> None:
        """Revoke or expire a lease: delete its keys, then its own key."""
        lease = self.leases.pop(lease_id)
        if lease is None:
            return
        store = self.store
        deleted = 0
        for raw_key in sorted(lease.keys):
            entry = store.entry(raw_key)
            if entry is not None and bound_lease(entry[2]) == lease_id:
                self._delete(raw_key, now)
                deleted += 1
        self.counters["lease_keys_deleted"] += deleted
        own = lease_key(lease_id).encode()
        if store.entry(own) is not None:
            self._delete(own, now)

    def _delete(self, raw_key: bytes, now: float) -> None:
        """A server-made delete (no uuid), recorded for commit and publication."""
        frames = self.store.apply(KVMsg(raw_key.decode("utf-8"), 0), now)
        self.counters["kvpub_published"] += 1
        self._record(frames)

    def leases_usable_from(self, mono: float, lease_ids: Iterable[str] | None = None) -> None:
        """The leases ``lease_ids`` (None: all) became usable only at ``mono``
        (a grant confirmed after its commit, a promotion's writes done):
        their ttl counts from then, so a slow disk never ends a lease its
        holder could not yet keep alive."""
        self.leases.restart(lease_ids, mono)

    def rebuild_leases(self, now: float) -> None:
        """Becoming active: every stored lease gets a full ttl from ``now``;
        keys bound to a lease that no longer exists are deleted."""
        leases: list[tuple[str, float]] = []
        owners: list[tuple[str, str | None]] = []
        bindings: list[tuple[str, bytes]] = []
        broken: list[bytes] = []
        for raw_key, entry in self.store.entries_with_properties_or_prefix(LEASE_PREFIX_RAW):
            if raw_key.startswith(LEASE_PREFIX_RAW):
                ttl = parse_lease_value(entry[3])
                lease_id = raw_key[len(LEASE_PREFIX_RAW) :].decode("utf-8", "replace")
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
        gone = broken + orphans
        for raw_key in gone:
            self._delete(raw_key, now)
        self.counters["lease_orphans_deleted"] += len(gone)
