"""What a server core is built with: its limits and its counters.

How this works: :class:`CoreSettings` holds the limits of one
:class:`~clone.server.core.ServerCore` (the reactor builds it from the
command line, :mod:`clone.server.config`); :data:`COUNTERS` names every counter
the core and its parts (:mod:`clone.server.callcore`,
:mod:`clone.server.synccore`, :mod:`clone.server.splitcore`) count into one
shared dict, all starting at zero, so ``stats()`` always shows each of them.
Mostly a table: both are re-exported by :mod:`clone.server.core`.
"""

from __future__ import annotations

from dataclasses import dataclass

from clone.server.conflicts import DEFAULT_MAX_CONFLICT_BYTES

__all__ = ["COUNTERS", "CoreSettings"]

#: Every counter :attr:`~clone.server.core.ServerCore.counters` holds, all starting at zero.
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
    "set_many_calls",
    "set_many_entries",
    "lease_keys_deleted",
    "lease_orphans_deleted",
)


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """The limits of a server core (see docs/operations.md for the defaults' reasons)."""

    dedup_window: int = 65_536
    pending_max: int = 100_000
    pending_max_age: float = 30.0
    #: ... and its bytes (keys and values; 0: no byte bound): no client
    #: may take the server's memory.
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
