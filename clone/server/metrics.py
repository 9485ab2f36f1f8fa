"""The Prometheus side of a server: its metrics, read from its own state.

How this works: nothing here counts on the hot paths.  The server already keeps
counters (``CloneServer.stats()``) and gauges (the store, the pending list,
Binary Star); :class:`CloneCollector` turns them into metric families each time
``/metrics`` is scraped, on the server's loop, so a scrape sees one consistent
turn.  Each server has its own :class:`~prometheus_client.CollectorRegistry`
(:func:`build_registry`), never the global one: tests run several servers in
one process.

Two small pure helpers hold what the counters did not, in
:mod:`clone.server.counting` (no Prometheus there, so a server without an
HTTP port never imports this module): :class:`DurationHistogram` (the
snapshot durations, observed where a stream completes) and
:class:`SubscriberCount` (connections to the publisher, from socket-monitor
events; docs/operations.md, "Monitoring", says how it is counted).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from clone.release import RELEASE
from clone.server.config import ServerMode
from clone.server.counting import SNAPSHOT_BUCKETS, DurationHistogram, SubscriberCount
from clone.storage.schema import FORMAT_VERSION

if TYPE_CHECKING:
    from clone.server.config import ServerConfig

__all__ = [
    "CALL_RESULTS",
    "RELAY_CALL_RESULTS",
    "PROTOCOL_ERRORS",
    "REFUSALS",
    "ROLES",
    "SNAPSHOT_BUCKETS",
    "CloneCollector",
    "DurationHistogram",
    "MonitoredServer",
    "SubscriberCount",
    "build_registry",
]

#: ``clone_calls_total{result}``: the stats counter behind each result of a
#: CALL? (docs/protocol.md, "CALL? / REPLY").  ``invalid`` counts only calls
#: that do not decode (``malformed``); each refusal of what a well-formed call
#: asks for has its own result, so a dashboard tells a broken client (invalid)
#: from one passing bad arguments (bad_*) and from one sending too much (size).
CALL_RESULTS: Mapping[str, str] = {
    "ok": "calls_ok",
    "conflict": "calls_conflict",
    "not_active": "calls_not_active",
    "unknown_lease": "calls_unknown_lease",
    "invalid": "calls_invalid",
    "bad_if_sequence": "calls_bad_if_sequence",
    "bad_lease": "calls_bad_lease",
    "bad_ttl": "calls_bad_ttl",
    "reserved": "calls_reserved",
    "acl": "calls_refused_acl",
    "full": "calls_refused_full",
    "size": "calls_refused_size",
    "busy": "calls_refused_busy",
    "not_owner": "calls_not_owner",
    "lease_quota": "calls_refused_lease_quota",
    "unknown_conflict": "calls_unknown_conflict",
}

#: ``clone_relay_calls_total{result}``: what a relay did with its clients'
#: calls (docs/operations.md, "Relays").
RELAY_CALL_RESULTS: Mapping[str, str] = {
    "forwarded": "calls_forwarded",
    "not_synced": "calls_forward_not_synced",
    "refused_acl": "calls_forward_refused_acl",
    "dropped": "calls_forward_dropped",
}

#: Every value of ``clone_role``'s label; the current one is 1, the others 0.
ROLES = ("active", "passive", "starting")

#: ``clone_updates_refused_total{reason}``: the stats counter behind each reason.
#: A write over a size limit is counted as ``invalid`` (the core counts it so).
REFUSALS: Mapping[str, str] = {
    "acl": "kvset_refused_acl",
    "full": "kvset_refused_full",
    "invalid": "kvset_invalid",
    "duplicate": "kvset_duplicate",
    # A relay's: it had lost the pair, or its queue to the pair was full.
    "stale": "kvset_refused_stale",
    "overloaded": "kvset_forward_dropped",
}

#: ``clone_protocol_errors_total{socket}``: the stats counter behind each socket.
PROTOCOL_ERRORS: Mapping[str, str] = {
    "collector": "kvset_invalid",
    "snapshot": "snapshot_invalid",
    "peer": "peer_invalid",
    "binary_star": "ha_malformed_messages",
}


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class MonitoredServer(Protocol):
    """What the collector reads of a server (a :class:`CloneServer`)."""

    config: ServerConfig
    snapshot_seconds: DurationHistogram

    def stats(self) -> dict[str, int | float | str]: ...

    @property
    def subscribers(self) -> int | None: ...

    @property
    def peer_alive(self) -> bool: ...

    def readiness(self) -> tuple[bool, str]: ...


class CloneCollector(Collector):
    """Metric families from one server's state, built at each scrape."""

    def __init__(self, server: MonitoredServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        server = self._server
        stats = server.stats()

        def num(name: str) -> float:
            value = stats.get(name, 0)
            return float(value) if isinstance(value, int | float) else 0.0

        build = GaugeMetricFamily(
            "clone_build_info",
            "Always 1: this server's release and the data-directory format it writes.",
            labels=["version", "format"],
        )
        build.add_metric([RELEASE, str(FORMAT_VERSION)], 1.0)
        yield build
        yield _gauge("clone_sequence", "Highest sequence number applied.", num("sequence"))
        yield _gauge("clone_keys", "Keys in the store.", num("keys"))
        yield _gauge(
            "clone_store_bytes",
            "Bytes of keys, properties and values held in the store.",
            num("store_bytes"),
        )
        if "data_dir_bytes" in stats:
            yield _gauge(
                "clone_data_dir_bytes",
                "Bytes the data directory's files take on disk (database, WAL, kept copies).",
                num("data_dir_bytes"),
            )
        role = GaugeMetricFamily(
            "clone_role", "The server's role: 1 for the current one.", labels=["role"]
        )
        current = str(stats.get("role", ""))
        for name in ROLES:
            role.add_metric([name], 1.0 if name == current else 0.0)
        yield role
        yield _counter(
            "clone_updates",
            "Client updates this server sequenced and published as active.",
            num("kvpub_published"),
        )
        refused = CounterMetricFamily(
            "clone_updates_refused", "Client updates refused, by reason.", labels=["reason"]
        )
        for reason, key in REFUSALS.items():
            refused.add_metric([reason], num(key))
        yield refused
        yield _counter(
            "clone_snapshots", "Snapshots (and catch-ups) served.", num("snapshots_served")
        )
        hist = server.snapshot_seconds
        yield HistogramMetricFamily(
            "clone_snapshot_seconds",
            "Time from accepting a snapshot request to sending its last message.",
            buckets=hist.buckets(),
            sum_value=hist.total,
        )
        subscribers = server.subscribers
        if subscribers is not None:
            yield _gauge(
                "clone_subscribers",
                "Connections to the update publisher (see docs/operations.md, Monitoring).",
                subscribers,
            )
        refused_subs = CounterMetricFamily(
            "clone_subscriptions_refused",
            "Subscription messages on the publisher refused, by reason (docs/operations.md,"
            " Limits).",
            labels=["reason"],
        )
        refused_subs.add_metric(["over-limit"], num("subscriptions_over_limit"))
        refused_subs.add_metric(["not-admitted"], num("subscriptions_refused"))
        yield refused_subs
        cut = CounterMetricFamily(
            "clone_subscribers_cut",
            "Publisher connections dropped for subscribing past their caps, flooding or"
            " reading nothing past --max-subscriber-bytes, and subscribers reported slow.",
            labels=["reason"],
        )
        over_limit = (
            num("subscribers_dropped")
            - num("subscribers_flooding")
            - num("subscribers_over_budget")
        )
        cut.add_metric(["over-limit"], over_limit)
        cut.add_metric(["flooding"], num("subscribers_flooding"))
        cut.add_metric(["over-budget"], num("subscribers_over_budget"))
        cut.add_metric(["slow"], num("subscribers_slow"))
        yield cut
        yield _counter(
            "clone_flood_penalties",
            "Publisher connections cut off for flooding (or subscribing past their caps)"
            " whose address was then put under a flood penalty.",
            num("flood_penalties"),
        )
        yield _counter(
            "clone_flood_penalty_refused",
            "Publisher handshakes refused because their address was under a flood penalty.",
            num("flood_penalty_refused"),
        )
        yield _counter(
            "clone_failovers",
            "Times this server took over as active from a passive role.",
            num("failovers"),
        )
        yield _gauge("clone_pending", "Client updates parked until promotion.", num("pending"))
        errors = CounterMetricFamily(
            "clone_protocol_errors", "Malformed messages dropped, by socket.", labels=["socket"]
        )
        for socket, key in PROTOCOL_ERRORS.items():
            errors.add_metric([socket], num(key))
        yield errors
        if server.config.peer is not None:
            yield _gauge(
                "clone_peer_up",
                "1 while the Binary Star peer is heard within its heartbeat window.",
                1.0 if server.peer_alive else 0.0,
            )
        yield _gauge(
            "clone_in_step",
            "1 on an active server, or a passive one synced with nothing pending.",
            1.0 if server.readiness()[0] else 0.0,
        )
        calls = CounterMetricFamily(
            "clone_calls",
            "CALL?s (compare-and-set writes, lease operations) answered, by result.",
            labels=["result"],
        )
        for result, key in CALL_RESULTS.items():
            calls.add_metric([result], num(key))
        yield calls
        yield _gauge("clone_leases", "Live leases (on the active server).", num("leases"))
        yield _counter(
            "clone_leases_expired",
            "Leases deleted because their keepalives stopped.",
            num("leases_expired"),
        )
        yield _counter(
            "clone_lease_keepalives",
            "Lease keepalives accepted (never published).",
            num("lease_keepalives"),
        )
        yield _counter(
            "clone_lease_keepalive_batches",
            "lease-keepalives calls answered, each keeping many leases alive.",
            num("lease_keepalive_batches"),
        )
        yield _counter(
            "clone_set_many_calls",
            "set-many calls answered, each writing many keys (each entry also counts"
            " as a call in clone_calls_total).",
            num("set_many_calls"),
        )
        yield _counter(
            "clone_set_many_entries",
            "Entries carried by set-many calls.",
            num("set_many_entries"),
        )
        if server.config.mode is ServerMode.RELAY:
            relayed = CounterMetricFamily(
                "clone_relay_calls",
                "Clients' calls a relay forwarded to the pair or answered itself, by result.",
                labels=["result"],
            )
            for result, key in RELAY_CALL_RESULTS.items():
                relayed.add_metric([result], num(key))
            yield relayed
            yield _counter(
                "clone_relay_upstream_switches",
                "Times a relay moved to the next upstream server.",
                num("upstream_switches"),
            )
            yield _counter(
                "clone_relay_upstream_handshake_failures",
                "CURVE handshakes the upstream refused (the relay's key is not admitted there).",
                num("upstream_handshake_failures"),
            )
        yield _counter(
            "clone_split_conflicts",
            "Split-brain writes of a stepped-down peer kept as conflicts, not applied.",
            num("split_conflicts"),
        )
        yield _gauge(
            "clone_split_conflicts_unresolved",
            "Split-brain conflicts neither applied nor discarded yet (clone conflicts).",
            num("split_conflicts_unresolved"),
        )
        yield _counter(
            "clone_split_conflicts_dropped",
            "Unresolved split-brain conflicts dropped, oldest first, over --max-conflict-bytes.",
            num("split_conflicts_dropped"),
        )
        yield _counter(
            "clone_internal_errors",
            "Unexpected exceptions logged by handlers.",
            num("internal_errors"),
        )


def build_registry(server: MonitoredServer, *, process: bool = True) -> CollectorRegistry:
    """A registry of this server's metrics (and the process's, unless ``process`` is false)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CloneCollector(server))
    if process:
        ProcessCollector(registry=registry)
    return registry
