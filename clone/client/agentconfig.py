"""The client agent's configuration and counters.

Why a module of its own: :class:`AgentConfig` (timing, bounds, checked at
construction) and :class:`AgentCounters` (what ``Clone.status()`` shows) are
what the application sets and reads of the agent; the agent's state
(:mod:`clone.client.state`) and its rules only use them.  Pure: no zmq, no
``time``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from clone.wire.protocol import DEFAULT_MISSED_HEARTBEATS

__all__ = ["AgentConfig", "AgentCounters"]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Timing of the agent, in seconds.

    ``server_timeout`` is how long the current server may stay silent (no update,
    no HUGZ, no snapshot reply) before we fail over; while syncing, how long we
    wait for the first snapshot data.  The default of 2.5 heartbeats notices a
    frozen server after two missed HUGZ while tolerating one late one.  (A server
    whose process died is noticed at once, by its lost connection.)

    A server that says its heartbeat in its HUGZ (ours do: the ``heartbeat``
    property) is judged by its own rhythm instead, once we are active on it:
    silent for ``missed_heartbeats`` of its heartbeats means gone.  So
    ``heartbeat`` and ``server_timeout`` matter for servers that do not say (the
    Guide's, 1 s), and for the wait on a snapshot, where a passive server that
    has not yet given up on its peer may hold our request for a while.
    ``missed_heartbeats=None`` ignores what servers say: ``server_timeout`` then
    applies to every server (the frontend does this when the application sets
    ``server_timeout`` itself).

    ``reask_interval`` is how often an unanswered snapshot request is repeated on
    a fresh DEALER while syncing (default a quarter heartbeat), and
    ``requests_per_server`` bounds the requests sent to one server per round (the
    Guide's rule of bounded requests): the defaults give at most 10 requests, at
    0, 0.25, ..., 2.25 heartbeats, before we move on at 2.5.
    """

    heartbeat: float = 1.0
    server_timeout: float = 2.5
    missed_heartbeats: int | None = DEFAULT_MISSED_HEARTBEATS  # None: ignore what servers say
    requests_per_server: int = 10
    resend_interval: float = 0.5
    reask_interval: float = 0.25
    # A gap between two ticks longer than this means our own process did not
    # run (SIGSTOP, a VM pause, a starved machine), not that a server went
    # quiet; None: never judged (the agent sets it: it ticks at least every
    # second, and its clock is real; a fake clock may jump).
    freeze_gap: float | None = None

    @classmethod
    def from_heartbeat(cls, heartbeat: float, **overrides: Any) -> AgentConfig:
        """Scale every timeout to the servers' heartbeat (tests use short ones)."""
        if heartbeat <= 0:
            raise ValueError(f"heartbeat must be > 0, not {heartbeat}")
        values: dict[str, Any] = {
            "heartbeat": heartbeat,
            "server_timeout": 2.5 * heartbeat,
            "resend_interval": 0.5 * heartbeat,
            "reask_interval": 0.25 * heartbeat,
        }
        values.update(overrides)
        return cls(**values)

    def __post_init__(self) -> None:
        if min(self.server_timeout, self.resend_interval, self.heartbeat, self.reask_interval) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.requests_per_server < 1:
            raise ValueError("requests_per_server must be >= 1")
        if self.missed_heartbeats is not None and self.missed_heartbeats < 1:
            raise ValueError("missed_heartbeats must be >= 1 (or None)")


@dataclass(slots=True)
class AgentCounters:
    """What happened so far; shown by ``Clone.status()``."""

    snapshots: int = 0  # completed snapshots
    # Completed syncs by kind: full snapshots (the first one included) and
    # catch-ups (KVDELTA: only the updates after our sequence), the updates
    # those catch-ups applied, and catch-ups given up (a malformed or
    # unexpected KVDELTA, a hole in its updates: a full snapshot follows).
    syncs_full: int = 0
    syncs_catchup: int = 0
    catchup_updates: int = 0
    catchups_abandoned: int = 0
    resyncs: int = 0  # snapshots started after the first one, for any reason
    retries: int = 0  # snapshot requests repeated to the same server (re-asks)
    # of those, re-asks after an answer stopped before its end (10 HUGZ without data)
    stalled_syncs: int = 0
    failovers: int = 0  # switches to another server, for any reason
    disconnects: int = 0  # lost connections to any server's publisher
    disconnect_failovers: int = 0  # failovers caused by losing the current server's
    # failovers while syncing to another server that showed itself active
    hint_failovers: int = 0
    # hints ignored from a server that showed itself active for a whole round
    # and served nothing (clone.client.failover)
    unserving_hints: int = 0
    gaps: int = 0  # holes in the sequence that forced a resync
    stale: int = 0  # KVPUBs discarded as not newer than the last applied
    protocol_errors: int = 0  # malformed messages dropped
    foreign: int = 0  # messages from a server that is not the current one
    resent: int = 0  # confirmed writes sent again
    expired_writes: int = 0  # confirmed writes given up on
    refusals: int = 0  # refusal notices received (for any write of ours)
    refused_writes: int = 0  # confirmed writes failed by a refusal notice
    split_conflicts: int = 0  # our writes a split brain's heal kept as conflicts
    split_held_writes: int = 0  # writes held while two servers showed themselves active
    # Writes sent to prove that our PUB reaches the current server's collector
    # (resent until it republishes one), and the proofs given up on (writes.py).
    collector_probes: int = 0
    collector_unproven: int = 0
    # Calls (CALL?/REPLY: compare-and-set, leases): made by the application,
    # sent again (resend_interval, a failover, a completed sync), given up at
    # the caller's deadline, answered "not-active" (kept, sent again later),
    # answered after we stopped waiting (dropped).
    calls: int = 0
    calls_resent: int = 0
    calls_expired: int = 0
    calls_not_active: int = 0
    late_replies: int = 0
    # Set calls whose update our replica had not applied when their wait for
    # it ran out (told anyway: the server wrote it; a failover's new server
    # may not have).
    replies_unseen: int = 0
    keepalives: int = 0  # lease keepalives sent (each a fresh call)
    keepalive_batches: int = 0  # lease-keepalives calls sent, each for many leases
    writes_as_calls: int = 0  # writes sent as calls (restricted mode: every write)
    leases_lost: int = 0  # kept leases a server said are gone
    # Restricted mode: view heartbeats whose count differed from ours (a resync),
    # and those for a view that is not ours (our rights changed: a resync).
    view_gaps: int = 0
    view_changes: int = 0
    # Ticks that came after a freeze of our own process (freeze_gap): a resync
    # from the same server, not a failover.
    self_freezes: int = 0
    # A gauge, not a counter: ms from the last message of the server we left to
    # the end of the first snapshot from the next one, for the last failover.
    last_failover_gap_ms: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
