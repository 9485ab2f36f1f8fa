"""One drill's processes: the server pair, the client processes and the HUGZ monitor."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clone.tools.drill.config import PARTITION_SCENARIOS, SPLIT_BURST_DELAY, DrillConfig, Say
from clone.tools.drill.netns import ISLAND, Topology
from clone.tools.drill.upgrade import ReleaseEnv, new_server_env, old_server_env
from clone.tools.drill.watch import HugzMonitor
from clone.tools.procs import (
    ManagedProcess,
    ProcessGroup,
    ServerAddress,
    free_base_port,
    free_port,
    python_module_argv,
    server_argv,
)
from clone.wire.protocol import PUBLISHER_OFFSET

__all__ = ["PairRun"]


class PairRun:
    """One drill's processes -- the server pair, the clients, the HUGZ monitor --
    and the harness's own events; :class:`.scenarios.Scenarios` adds the
    faults and :class:`.harness.Drill` the timeline."""

    def __init__(self, cfg: DrillConfig, say: Say) -> None:
        self.cfg, self.say = cfg, say
        self.out = Path(cfg.out)
        self.clients_dir = self.out / "clients"
        self.group = ProcessGroup(self.out / "logs")
        # The partition drills run each server in a network namespace of its own
        # (made by :meth:`make_network`); the others on loopback.
        # partition-split also runs one client (cfg.island_client) in an island
        # namespace of its own, so that a cut can leave it with the isolated server.
        self.topology = (Topology(island=cfg.island_client is not None)
                         if cfg.scenario in PARTITION_SCENARIOS else None)
        self._ports = {"primary": (free_base_port(3), free_port()),
                       "backup": (free_base_port(3), free_port())}
        self._place_servers(lambda name: "127.0.0.1")
        self.harness_events: list[dict[str, Any]] = []
        self.generations: dict[str, int] = {}
        self.notes: dict[str, Any] = {}
        self.fault_text = ""
        # rolling-restart: one record per round and per server restart.
        self.rounds: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.in_progress = False  # a multi-step action is under way: do not end yet
        # --upgrade-from: the older release's environment (set by the harness
        # before the pair starts), and the servers already brought onto this code.
        self.release: ReleaseEnv | None = None
        self.upgraded: set[str] = set()
        self.t0 = 0.0  # when the clients start writing
        self.write_end = 0.0  # when they stop (set once the run starts)

    def _place_servers(self, host: Callable[[str], str]) -> None:
        self.servers = {n: ServerAddress(n, port, ha, host(n))
                        for n, (port, ha) in self._ports.items()}
        self.monitor = HugzMonitor(
            {n: f"tcp://{a.host}:{a.port + PUBLISHER_OFFSET}" for n, a in self.servers.items()},
            self.cfg.heartbeat,
        )

    def make_network(self) -> None:
        """Partition drills: create the namespaces and put the servers in them
        (before any process starts; :meth:`remove_network` undoes it)."""
        if self.topology is None:
            return
        self.topology.create()
        topo = self.topology
        self._place_servers(topo.address)
        where = ", ".join(f"{n} {topo.address(n)} in {topo.namespace(n)}" for n in self.servers)
        island = self.cfg.island_client
        if island is not None:
            where += (f", client {island} {topo.address(ISLAND)} in {topo.namespace(ISLAND)}, "
                      f"the other clients")
        else:
            where += ", clients"
        self.say(f"network: {where} {topo.host_address} on bridge {topo.bridge}")

    def remove_network(self) -> None:
        if self.topology is not None:
            self.topology.destroy()

    # -- events and processes ---------------------------------------------

    def event(self, event: str, **fields: Any) -> None:
        record = {"ts": time.time(), "client": "drill", "event": event}
        record.update(fields)
        self.harness_events.append(record)

    def runs_old(self, name: str) -> bool:
        """Whether ``name``'s next start runs the older release (--upgrade-from)."""
        return self.release is not None and name not in self.upgraded

    def start_server(self, name: str) -> ManagedProcess:
        other = "backup" if name == "primary" else "primary"
        old = self.release if self.runs_old(name) else None
        argv = server_argv(
            name,
            self.servers[name],
            self.servers[other],
            heartbeat_ms=self.cfg.heartbeat_ms,
            data_dir=None if self.cfg.in_memory else self.out / "data" / name,
            command=None if old is None else [str(old.server)],
        )
        env = new_server_env() if old is None else old_server_env()
        if self.topology is not None:
            argv = self.topology.prefix(name) + argv
        if name in self.group.procs:
            proc = self.group[name]
            # A restart may change the code (an upgrade): same ports, new command.
            proc.argv, proc.env = argv, env
            proc.start()
        else:
            proc = self.group.add(name, argv, env=env)
        return proc

    def start_client(self, cid: str, start_at: float, final_at: float,
                     start_file: Path | None = None) -> ManagedProcess:
        cfg = self.cfg
        gen = self.generations.get(cid, -1) + 1
        self.generations[cid] = gen
        stem = cid if gen == 0 else f"{cid}.g{gen}"
        names = list(self.servers)
        argv = python_module_argv(
            "clone.tools.drill.client",
            "--id", cid,
            "--gen", str(gen),
            "--servers", ",".join(self.servers[n].endpoint for n in names),
            "--names", ",".join(names),
            "--heartbeat", str(cfg.heartbeat),
            "--rate", str(cfg.rate),
            "--confirm-every", str(cfg.confirm_every),
            "--confirm-timeout", str(cfg.confirm_timeout),
            "--ttl-per-tick", str(cfg.ttl_per_tick if cfg.scenario == "ttl-storm" else 0),
            "--ttl-min", str(cfg.ttl_min),
            "--ttl-max", str(cfg.ttl_max),
            "--shared-keys", str(cfg.shared_keys),
            "--locks", str(cfg.lock_keys),
            "--value-size", str(cfg.value_size),
            "--start-at", repr(start_at),
            "--write-seconds", repr(max(0.0, self.write_end - start_at)),
            "--final-at", repr(final_at),
            "--events", str(self.clients_dir / f"{stem}.jsonl"),
            "--state", str(self.clients_dir / f"{stem}.state.json"),
            "--seed", str(cfg.seed),
            "--lock-hold", str(cfg.lock_hold if self._locks(cid) else 0),
        )  # fmt: skip
        if start_file is not None:
            argv += ["--start-file", str(start_file)]
        if self.topology is not None and cid == cfg.island_client:
            argv = self.topology.prefix(ISLAND) + argv
            if cfg.split_writes and gen == 0:
                burst_at = start_at + cfg.fault_at * cfg.duration + SPLIT_BURST_DELAY
                argv += ["--burst", str(cfg.split_writes), "--burst-at", repr(burst_at)]
        return self.group.add(stem, argv)

    def versions(self) -> dict[str, dict[str, Any]]:
        """Each server's release, data format and role, as ``clone status`` reads them
        (a release before 0.2.0 reports no format: it is 1)."""
        from clone.client.status import query_status

        names = list(self.servers)
        got = query_status([self.servers[n].endpoint for n in names], 2.0)
        return {n: {"version": s.get("version"),
                    "data_format": s.get("data_format") or (1 if s.get("version") else None),
                    "role": s.get("role")}
                for n, s in zip(names, got, strict=True)}

    def _locks(self, cid: str) -> bool:
        """Whether client ``cid`` (``c<i>``) is one of the lock workload's."""
        return cid[1:].isdigit() and int(cid[1:]) < self.cfg.lock_clients

    def active_server(self) -> str | None:
        active = self.monitor.active()
        return active[0] if len(active) == 1 else None

    def _pick(self, which: str) -> str:
        active = self.active_server() or "primary"
        return active if which == "active" else ("backup" if active == "primary" else "primary")

    def _log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(20)}" for p in self.group)
