"""What every part of one server shares: its clocks, its counters, its log throttle.

Why a module of its own: the server's parts (the caller, the collector, the
relay link, the conflicts desk, ...) are objects built with only what they
need.  Almost all of them count, log rate-limited and read the clocks; those
four things are handed to each part as this one small object instead of as
attributes on the server that every part could reach.  Anything else a part
needs (a socket, the core, the access settings, a callback) is a constructor
argument of its own, so that its signature says what it touches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from clone.ratelimit import Throttle

__all__ = ["CLOCK_EVERY", "IO_COUNTERS", "TURN_BUDGET", "Shared", "Sockets", "peer_endpoint"]

# Wall-time budget of one handler call that drains a socket or streams a
# snapshot chunk.  The count limits alone are not enough: on a loaded host a
# batch of 1000 took up to 190 ms of wall time, and timers (HUGZ) waited for it.
TURN_BUDGET = 0.01
CLOCK_EVERY = 64  # a draining handler reads the clock once per this many messages


#: The name of every counter of the server's I/O layer (its parts'), all
#: starting at zero; the core's own are clone.server.coresettings.COUNTERS.
#: ``CloneServer.stats`` reports both.  A table, one name a line.
IO_COUNTERS: tuple[str, ...] = (
    "snapshots_served",
    "snapshots_aborted",
    "snapshots_refused",
    "snapshots_held_heal",
    "votes_deferred",
    "votes_deferred_served",
    "votes_deferred_expired",
    "votes_deferred_overflow",
    "votes_deferred_gone",
    "snapshot_stalls",
    "snapshot_ends_held",
    "snapshot_unroutable_retries",
    "snapshots_idle_aborted",
    "snapshots_evicted",
    "snapshots_yielded",
    "snapshot_turns_paced",
    "snapshots_replaced",
    "snapshot_requester_invalid",
    "snapshots_queued",
    "snapshots_shared",
    "snapshot_encodings_shared",
    "snapshot_shares_over_budget",
    "collector_turns_cut",
    "commit_gather_pauses",
    "split_writes_applied",
    "split_writes_refused",
    "split_writes_conflicts",
    "conflicts_requests",
    "conflicts_dropped",
    "split_writes_resent",
    "split_writes_abandoned",
    "snapshot_entries_sent",
    "snapshots_batched",
    "snapshot_batches_sent",
    "hugz_sent",
    "heartbeat_max_late_ms",
    "heartbeat_max_blocked_ms",
    "heartbeat_max_late_ran_ms",
    "heartbeat_max_late_waited_ms",
    "outq_dropped",
    "sync_timeouts",
    "internal_errors",
    "storage_errors",
    "catchups_served",
    "client_catchups_served",
    "kvset_refused_acl",
    "subscriptions",
    "subscriptions_refused",
    "subscriptions_over_limit",
    "subscribers_dropped",
    "subscribers_flooding",
    "subscribers_slow",
    "subscribers_over_budget",
    "subscriptions_at_heartbeat",
    "security_reloads",
    "security_reload_errors",
    "publisher_rebinds",
    "failovers",
    "upstream_switches",
    "kvset_forwarded",
    "kvset_forward_dropped",
    "kvset_refused_stale",
    "status_requests",
    "status_dropped",
    "call_replies_dropped",
    "calls_forwarded",
    "calls_forward_dropped",
    "calls_forward_not_synced",
    "calls_forward_refused_acl",
    "call_replies_forwarded",
    "call_replies_unmatched",
    "kvset_refused_upstream",
    "upstream_handshake_failures",
)


def peer_endpoint(host_port: str, offset: int) -> str:
    """The endpoint of a peer's or upstream's socket: its base port ``host:port``
    plus ``offset`` (SNAPSHOT_OFFSET, PUBLISHER_OFFSET, COLLECTOR_OFFSET)."""
    host, _, port = host_port.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


@dataclass(slots=True, eq=False)
class Shared:
    """The clocks, counters and throttle of one server.

    ``clock`` (monotonic seconds) times every deadline; ``wallclock`` (Unix
    seconds) only stamps what is shown or stored as a date.  ``counters`` is
    the server's one dict of counters (``CloneServer.stats`` reports it); a
    part only adds to the keys it owns.
    """

    throttle: Throttle
    clock: Callable[[], float] = time.monotonic
    wallclock: Callable[[], float] = time.time
    counters: dict[str, int] = field(default_factory=dict)


class Sockets(Protocol):
    """How a part opens the sockets it owns: the server's defaults (linger 0,
    the size caps, CURVE as the security settings say) and the server's loop.

    A part closes what it opened with :meth:`forget` (a stream) or
    ``close(linger=0)`` (a bare socket); the server closes every stream that
    is left at its stop.
    """

    def socket(self, kind: int) -> zmq.Socket[Any]:
        """A socket that connects out (to the peer or an upstream)."""

    def stream(self, sock: zmq.Socket[Any], handler: Callable[[list[bytes]], None]) -> ZMQStream:
        """``sock`` read on the loop: ``handler`` gets each message (guarded:
        a bug is logged and counted, never fatal)."""

    def forget(self, stream: ZMQStream) -> None:
        """Stop reading ``stream`` and close its socket."""
