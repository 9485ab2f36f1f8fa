"""The server's stats from its parts that keep counters of their own.

:meth:`clone.server.reactor.CloneServer.stats` is one flat JSON object (what
SIGUSR1 logs, what ``/metrics`` reads); these functions turn the storage's
timing, the publisher's flood penalty and Binary Star's counters into its
fields, so the reactor only gathers them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clone.server.diskgate import committed_through

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar
    from clone.security.zap import Gatekeeper
    from clone.server.core import ServerCore
    from clone.server.durability import Durability
    from clone.server.penalty import FloodPenalty
    from clone.storage import Storage

__all__ = ["access_stats", "ha_stats", "storage_stats"]


def storage_stats(storage: Storage, durability: Durability, core: ServerCore) -> dict[str, int]:
    """Where the durable commit's time goes (docs/benchmarks.md, durable
    writes); commits that waited for the checkpointer's lock; TRUNCATEs done
    and given up; and ``committed_sequence``, the sequence up to which every
    applied update is on disk (``sequence`` is what the map holds): a process
    killed now restarts at it, so a drill or bench that kills a server waits
    for it instead of guessing how long a commit takes."""
    timing = storage.timing
    done, busy, longest = storage.wal_truncations()
    return {
        "committed_sequence": committed_through(durability, core),
        "commits": timing.commits,
        "commit_write_us": round(timing.write_s * 1e6),
        "commit_sync_us": round(timing.sync_s * 1e6),
        "commit_max_us": round(timing.max_s * 1e6),
        "commit_busy_waits": storage.busy_waits,
        "wal_truncations": done,
        "wal_truncations_busy": busy,
        "wal_truncate_max_us": round(longest * 1e6),
    }


def access_stats(penalty: FloodPenalty, gatekeeper: Gatekeeper | None) -> dict[str, int]:
    """The publisher's flood penalty, and under CURVE the ZAP handler's verdicts."""
    out = {"flood_penalties": penalty.punished, "flood_penalty_refused": penalty.refused}
    if gatekeeper is not None:
        out["zap_admitted"] = gatekeeper.admitted
        out["zap_refused"] = gatekeeper.refused
    return out


def ha_stats(ha: BinaryStar) -> dict[str, int | str]:
    """Binary Star's state and what its link to the peer counted."""
    counters = ha.counters
    return {
        "ha_state": ha.state.name.lower(),
        "ha_state_messages_received": counters.state_messages_received,
        "ha_malformed_messages": counters.malformed_peer_messages,
        "ha_out_of_range_messages": counters.out_of_range_peer_messages,
        "ha_handler_errors": counters.handler_errors,
        "ha_subscriber_disconnects": counters.subscriber_disconnects,
    }
