"""What a drill runs: the scenarios, and one drill's configuration with its derived timings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clone.server.config import PEER_WAIT_DEFAULT
from clone.server.healing import HOLD_FIRST_CALL
from clone.tools.drill.client import DEFAULT_SHARED_KEYS
from clone.wire.protocol import DEFAULT_HEARTBEAT_MS, DEFAULT_MISSED_HEARTBEATS

__all__ = [
    "CRASH_ORDERS",
    "PARTITION_SCENARIOS",
    "SCENARIOS",
    "SPLIT_BURST_DELAY",
    "DrillConfig",
    "Say",
]

SCENARIOS: tuple[str, ...] = (
    "kill-active",
    "kill-passive",
    "freeze-active",
    "client-restart",
    "ttl-storm",
    "rolling-restart",
    "both-crash",
    "partition-pair",
    "partition-active",
    "partition-split",
    "chaos",
)
#: The scenarios that run each server in a network namespace of its own and cut
#: links with iptables (root only: :mod:`.netns`).
PARTITION_SCENARIOS: tuple[str, ...] = ("partition-pair", "partition-active", "partition-split")
#: The scenarios that kill a server and start it again before the end.
RESTART_SCENARIOS: tuple[str, ...] = ("kill-active", "kill-passive", "ttl-storm")
#: both-crash: which server is killed first (by name; the primary is normally the
#: active one), or both at once.
CRASH_ORDERS: tuple[str, ...] = ("primary-first", "backup-first", "together")
Say = Callable[[str], None]
#: partition-split with split_writes: seconds after the cut the island's burst starts.
SPLIT_BURST_DELAY = 1.0


@dataclass(frozen=True)
class DrillConfig:
    scenario: str
    clients: int = 3
    duration: float = 30.0
    out: Path = Path("results/drill")
    rate: float = 20.0  # writes per second per client
    confirm_every: int = 4
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS  # the servers' default
    seed: int = 0
    fault_at: float = 0.35  # fraction of the duration
    ttl_per_tick: int = 3  # ttl-storm: ephemeral writes per regular write
    ttl_min: float = 0.5
    ttl_max: float = 2.0
    confirm_timeout: float = 10.0
    value_size: int = 64
    # Keys (outside /drill/) loaded into the pair before the clients start, so that
    # a restarted server has a real snapshot to sync.
    preload: int = 0
    # Keys every client overwrites (one write per tick): what can show a revert.
    shared_keys: int = DEFAULT_SHARED_KEYS
    # How many clients also contend for one lock (holding it lock_hold s each
    # time), so that the drill can check its fencing tokens; 0: none.
    lock_clients: int = 3
    lock_hold: float = 0.05
    # both-crash: the order of the two kills, the time between them (None: 3
    # heartbeats, time enough for the survivor to act on the first death, which
    # the clients notice at once by its closed connections: so the order
    # matters), how long both stay down, and the time between the two restarts.
    crash_order: str = "primary-first"
    crash_gap: float | None = None
    down_time: float = 1.0
    restart_stagger: float = 0.0
    # Diagnostic: run the servers --in-memory instead of with a data directory,
    # to show that the drill sees the state lost when both crash.
    in_memory: bool = False
    # partition-*: how long the cut lasts (None: as long
    # as kill-active's server stays down, max(25% of the duration, one failover
    # budget), so that the clients can fail over in partition-active).
    partition_time: float | None = None
    # partition-split: reset (TCP RST) the island's connections to the passive
    # instead of dropping their packets, as a restarted peer or an expired NAT
    # entry would: what the island's client queued for the passive is then gone.
    island_reset: bool = False
    # Lock keys every client takes and releases with compare-and-set (None: 2
    # for partition-split, where both sides of the split take them, else 0).
    locks: int | None = None
    # rolling-restart --upgrade-from REF: the pair starts on REF's code (a git ref
    # of this checkout or a wheel file, built into a virtual environment under
    # release_cache) and every restart brings a server onto this code.
    upgrade_from: str | None = None
    release_cache: Path | None = None
    # partition-split: writes the island client makes, as fast as it can,
    # starting a second after the cut (unconfirmed, keys /drill/<id>/burst/...):
    # the split brain's backlog the isolated server must heal without stalling.
    split_writes: int = 0

    def __post_init__(self) -> None:
        if self.scenario == "chaos":
            raise ValueError("chaos runs with clone.tools.chaos (scripts/drill --scenario chaos)")
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; one of {', '.join(SCENARIOS)}")
        if self.clients < 1 or (self.scenario in ("client-restart", "partition-split")
                                and self.clients < 2):
            raise ValueError("need at least 1 client (2 for client-restart and partition-split)")
        if self.duration <= 0 or self.rate <= 0:
            raise ValueError("duration and rate must be > 0")
        if self.shared_keys < 0:
            raise ValueError("shared_keys must be >= 0")
        if self.lock_clients < 0 or self.lock_hold <= 0:
            raise ValueError("lock_clients must be >= 0 and lock_hold > 0")
        if self.crash_order not in CRASH_ORDERS:
            raise ValueError(f"unknown crash order {self.crash_order!r}; "
                             f"one of {', '.join(CRASH_ORDERS)}")
        if (self.crash_gap is not None and self.crash_gap < 0) or self.down_time < 0:
            raise ValueError("crash_gap and down_time must be >= 0")
        # A server restarted alone waits --peer-wait for its peer; a stagger that
        # long would make the first one serve alone, which is another scenario.
        if self.partition_time is not None and self.partition_time <= 0:
            raise ValueError("partition_time must be > 0")
        if self.upgrade_from is not None and self.scenario != "rolling-restart":
            raise ValueError("upgrade_from is for rolling-restart only")
        if self.upgrade_from is not None and self.in_memory:
            raise ValueError("upgrade_from needs data directories (not in_memory): "
                             "their migration is part of the upgrade")
        if self.locks is not None and self.locks < 0:
            raise ValueError("locks must be >= 0")
        if self.island_reset and self.scenario != "partition-split":
            raise ValueError("island_reset is for partition-split only")
        if self.split_writes < 0:
            raise ValueError("split_writes must be >= 0")
        if self.split_writes and self.scenario != "partition-split":
            raise ValueError("split_writes is for partition-split only")
        if not 0 <= self.restart_stagger < PEER_WAIT_DEFAULT:
            raise ValueError(f"restart_stagger must be in [0, {PEER_WAIT_DEFAULT:g}) s "
                             "(under the servers' --peer-wait)")

    @property
    def partition_seconds(self) -> float:
        """partition-*: seconds from the cut to the heal."""
        if self.partition_time is not None:
            return self.partition_time
        # Long enough for the island's writes (a Clone client sends about
        # 10,000 a second; the isolated server takes fewer on a busy machine)
        # to be made while both sides are active.
        burst = SPLIT_BURST_DELAY + 2.0 + self.split_writes / 5000 if self.split_writes else 0.0
        return max(0.25 * self.duration, self.failover_budget, burst)

    @property
    def lock_keys(self) -> int:
        """How many lock keys the clients contend for (:attr:`locks`, or its default)."""
        if self.locks is not None:
            return self.locks
        return 2 if self.scenario == "partition-split" else 0

    @property
    def island_client(self) -> str | None:
        """partition-split: the client that runs in the island namespace and keeps
        reaching the isolated active (the last one); None in other scenarios."""
        return f"c{self.clients - 1}" if self.scenario == "partition-split" else None

    @property
    def crash_sequence(self) -> tuple[str, str]:
        """both-crash: the server killed (and restarted) first, then the other."""
        return ("backup", "primary") if self.crash_order == "backup-first" else (
            "primary", "backup")

    @property
    def crash_interval(self) -> float:
        """both-crash: seconds between the two kills."""
        if self.crash_order == "together":
            return 0.0
        return 3 * self.heartbeat if self.crash_gap is None else self.crash_gap

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_ms / 1000.0

    @property
    def failover_budget(self) -> float:
        """A generous bound on one failover: client silence timeout, the backup's
        peer expiry (both ``missed`` heartbeats), a snapshot, and slack for a
        loaded 2-core machine."""
        return 2 * DEFAULT_MISSED_HEARTBEATS * self.heartbeat + 1.5

    @property
    def round_period(self) -> float:
        """rolling-restart: one round starts this often (a round takes about one
        failover budget: two syncs and a takeover)."""
        return max(self.failover_budget, 0.1 * self.duration)

    @property
    def settle(self) -> float:
        extra = 0.0
        if self.scenario in (*RESTART_SCENARIOS, "freeze-active"):
            # The killed server comes back near the end of the writes and steps
            # down as after a split brain (it cannot know it was not active
            # meanwhile): the active holds client updates until it has
            # forwarded its writes, up to HOLD_FIRST_CALL when it has none
            # (clone.server.healing). The clients' final state comes after.
            # A thawed active is a split brain's loser too: a loaded run's
            # thaw came 0.4 s before the writes ended, the hold outlasted the
            # plain settle by 0.1 s, and the clients missed 4 held writes.
            extra += HOLD_FIRST_CALL + 1.0
        if self.scenario == "ttl-storm":
            extra += self.ttl_max + DEFAULT_MISSED_HEARTBEATS * self.heartbeat + 1.0
        elif self.scenario == "rolling-restart":
            # The last takeover comes after the writes, and a passive takes over
            # only when a client asks it to: the clients must still be there.
            extra = 2 * self.failover_budget
        elif self.scenario == "both-crash":
            # The pair may come back late in the run; the clients then resync.
            extra = self.failover_budget
        elif self.scenario in PARTITION_SCENARIOS:
            # After the heal, TCP retransmits on its backed-off timers (up to about
            # the cut's length), then the pair settles its split brain and the loser
            # resyncs; the clients must see all that.
            extra = self.failover_budget + min(self.partition_seconds, 10.0)
            # The heal of the island's writes: the loser sends them to the winner.
            extra += self.split_writes / 2000
        return max(3.0, 3 * self.heartbeat) + extra
