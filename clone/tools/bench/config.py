"""What a benchmark run measures and how big: the sections, the targets, the presets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_SECTIONS", "SECTIONS", "TARGETS", "BenchConfig", "Say"]

SECTIONS: tuple[str, ...] = (
    "throughput", "latency", "snapshot", "memory", "durability", "security", "subscribers",
    "calls",
)
#: What runs without naming sections: durability takes minutes (1M-key data
#: directories), security about two (three servers, repeated, interleaved),
#: calls about five (CAS and leases).
DEFAULT_SECTIONS: tuple[str, ...] = ("throughput", "latency", "snapshot", "memory")
TARGETS: tuple[str, ...] = ("clone", "c-proxy", "py-forwarder")

Say = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    """What to run and how big: the defaults are the full run, :meth:`quick` the small preset."""

    sections: tuple[str, ...] = DEFAULT_SECTIONS
    value_size: int = 100
    throughput_messages: int = 100_000
    subscriber_counts: tuple[int, ...] = (1, 10)
    throughput_targets: tuple[str, ...] = TARGETS
    rates: tuple[int, ...] = (1_000, 2_000, 5_000, 10_000)
    rate_seconds: float = 5.0
    multi_sub_rate: int = 10_000
    multi_subs: int = 10
    latency_targets: tuple[str, ...] = ("clone", "c-proxy")
    snapshot_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    snapshot_repeats: int = 3
    snapshot_heartbeat_ms: int = 200
    memory_keys: int = 100_000
    # Sizes of the memory section (100k and 1M keys in one run); () = memory_keys alone.
    memory_sizes: tuple[int, ...] = ()
    # A durable server (--fsync batch) measured beside the in-memory one.
    memory_durable: bool = True
    # durability: in memory against --fsync modes, restart and catch-up.
    durability_fsyncs: tuple[str, ...] = ("batch", "always", "off")
    # Fewer than throughput_messages: --fsync always commits ~1.5k updates/s here.
    durability_messages: int = 20_000
    durability_rate: int = 2_000
    durability_latency_fsyncs: tuple[str, ...] = ("batch", "always", "off")
    # Which parts of the durability section run (all by default).
    durability_parts: tuple[str, ...] = ("throughput", "latency", "restart", "catch_up",
                                         "engines")
    # A Redis appendfsync-always row next to the clone rows, when redis-server is installed.
    durability_redis: bool = True
    # Forwarders with no store at all (the latency section's targets) measured
    # beside the latency rows: the floor any pyzmq server has on this machine.
    durability_floors: tuple[str, ...] = ("py-forwarder", "c-proxy")
    durability_keys: int = 1_000_000
    durability_missed: int = 1_000
    durability_restarts: int = 2
    engine_groups: int = 1_000
    # Where durable servers keep their data (a real disk, not tmpfs); removed after.
    durability_dir: Path | None = None
    # security: plain against CURVE and CURVE + ACL, in memory.
    security_messages: int = 50_000
    security_rate: int = 2_000
    # subscribers: thousands of subscribers, direct and through relays.
    sub_counts: tuple[int, ...] = (1_000, 5_000)
    sub_rate: int = 1_000
    sub_relays: int = 4
    sub_processes: int = 4
    sub_probes: int = 4  # measuring Python subscribers per sink process; the rest are C sinks
    sub_per_socket: int = 50  # subscribers (TCP connections) per C sink socket
    resync_keys: int = 10_000
    resync_clients: int = 1_000
    # Where the resync's clients are: behind the relays, and/or on the pair itself.
    resync_topologies: tuple[str, ...] = ("relays", "direct")
    # How they ask after the failover: a full snapshot each, and/or a catch-up
    # from the last update they held (clone.tools.bench.catchup).
    resync_modes: tuple[str, ...] = ("full", "catchup")
    # calls: compare-and-set and leases.
    calls_rtt: int = 5_000  # sequential CAS calls (and as many confirmed KVSETs) per run
    calls_concurrency: tuple[int, ...] = (1, 8, 32)  # callers, one call in flight each
    calls_seconds: float = 5.0  # per concurrency run
    calls_leases: tuple[int, ...] = (1_000, 10_000)  # kept alive, against 0
    calls_lease_ttl: float = 3.0  # kept alive every ttl/3
    calls_write_rate: int = 2_000  # plain writes/s next to the leases (latency)
    calls_messages: int = 20_000  # plain writes next to the leases (throughput)
    calls_parts: tuple[str, ...] = ("rtt", "concurrency", "leases")  # which parts run
    # Subscribers measured by a Python watcher process each; the others are C sinks.
    probes: int = 1
    # Throughput and latency runs are repeated, interleaved; the median is reported.
    repeats: int = 3
    server_heartbeat_ms: int | None = None
    profile_dir: Path | None = None
    log_dir: Path = Path("results/bench-logs")

    @classmethod
    def quick(cls, **changes: Any) -> BenchConfig:
        base = cls(
            throughput_messages=5_000,
            subscriber_counts=(1, 3),
            rates=(1_000, 2_000),
            rate_seconds=1.0,
            multi_sub_rate=2_000,
            multi_subs=3,
            latency_targets=("clone",),
            snapshot_sizes=(2_000,),
            snapshot_repeats=1,
            memory_keys=5_000,
            durability_messages=3_000,
            durability_keys=10_000,
            durability_missed=100,
            durability_restarts=1,
            engine_groups=50,
            security_messages=3_000,
            sub_counts=(20,),
            sub_relays=2,
            sub_processes=2,
            sub_probes=2,
            sub_per_socket=5,
            resync_keys=500,
            resync_clients=20,
            calls_rtt=500,
            calls_concurrency=(1, 4),
            calls_seconds=1.0,
            calls_leases=(200,),
            calls_lease_ttl=1.5,
            calls_write_rate=1_000,
            calls_messages=2_000,
            repeats=1,
        )
        return replace(base, **changes)
