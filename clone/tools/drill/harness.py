"""Failover drills: a real server pair, N client processes, injected faults.

How this works: :func:`run_drill` starts a primary and a backup ``clone-server``
on free loopback ports, a thread that listens to the HUGZ of both (only the
active server sends HUGZ, so it always knows which one is active, and when both
are: :mod:`clone.tools.drill.watch`), and N :mod:`clone.tools.drill.client`
processes.  The clients sync, start writing together at ``start_at`` and stop
after ``duration`` seconds; the fault is injected at 35% of the run
(``rolling-restart``: rounds of restarts from then on, the scenario's own
timeline).  Each client logs its events to its own file (``clients/<id>.jsonl``)
and its final state to ``clients/<id>.state.json``.  Once everyone has settled,
the drill takes a snapshot of ``/drill/`` from the active server, asks both
servers for a stats line (SIGUSR1), stops everything, merges all events into
``events.jsonl`` (sorted by time) and decides (:mod:`clone.tools.drill.analysis`):

* every confirmed write is in the final state (keys are unique per write, so a
  write is lost exactly when its key is missing or holds another value);
* every key that all clients overwrite is at its last confirmed value or a
  later write, in the server's final state and in every client's, and no
  client saw one go back;
* every client ended with the same state as the server (hash of the items);
* no client applied the same write twice or a writer's writes out of order;
* the passive ends in step with the active: same sequence and key count, and
  nothing left in its pending list;
* the scenario's own checks: a restarted server came back passive, a thawed
  server did not go on as a second active, no ephemeral key outlived its ttl.

The result is ``summary.json``; :func:`main` prints a table and exits 1 when a
guarantee is broken.  ``docs/drills.md`` describes the scenarios and the schema.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import zmq

from clone.tools.drill.analysis import analyse, percentile, revert_detail, seen_revert_detail
from clone.tools.drill.client import DEFAULT_SHARED_KEYS, DRILL_PREFIX
from clone.tools.drill.watch import HugzMonitor, raw_snapshot, server_stats
from clone.tools.procs import (
    ManagedProcess,
    ProcessGroup,
    ServerAddress,
    free_base_port,
    free_port,
    python_module_argv,
    server_argv,
    wait_listening,
)
from clone.wire.protocol import DEFAULT_HEARTBEAT_MS, DEFAULT_MISSED_HEARTBEATS, PUBLISHER_OFFSET

__all__ = [
    "SCENARIOS",
    "DrillConfig",
    "analyse",
    "main",
    "percentile",
    "run_drill",
]

log = logging.getLogger(__name__)

SCENARIOS: tuple[str, ...] = (
    "kill-active",
    "kill-passive",
    "freeze-active",
    "client-restart",
    "ttl-storm",
    "rolling-restart",
)
Say = Callable[[str], None]


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

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; one of {', '.join(SCENARIOS)}")
        if self.clients < 1 or (self.scenario == "client-restart" and self.clients < 2):
            raise ValueError("need at least 1 client (2 for client-restart)")
        if self.duration <= 0 or self.rate <= 0:
            raise ValueError("duration and rate must be > 0")
        if self.shared_keys < 0:
            raise ValueError("shared_keys must be >= 0")

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
        if self.scenario == "ttl-storm":
            extra = self.ttl_max + DEFAULT_MISSED_HEARTBEATS * self.heartbeat + 1.0
        elif self.scenario == "rolling-restart":
            # The last takeover comes after the writes, and a passive takes over
            # only when a client asks it to: the clients must still be there.
            extra = 2 * self.failover_budget
        return max(3.0, 3 * self.heartbeat) + extra


# --------------------------------------------------------------------------
# Following the clients' event files


class _Tail:
    """Reads new complete lines from the clients' event files and counts events."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.counts: Counter[str] = Counter()

    def poll(self) -> None:
        for path in sorted(self.directory.glob("*.jsonl")):
            off = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(off)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = off + end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.counts[json.loads(line)["event"]] += 1


def _read_events(path: Path) -> list[dict[str, Any]]:
    """A client's events; a line cut short by kill -9 is skipped."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


# --------------------------------------------------------------------------
# The run


class _Drill:
    """One drill run: the processes, the timeline and the harness's own events."""

    def __init__(self, cfg: DrillConfig, say: Say) -> None:
        self.cfg, self.say = cfg, say
        self.out = Path(cfg.out)
        self.clients_dir = self.out / "clients"
        self.group = ProcessGroup(self.out / "logs")
        p1, p2 = free_base_port(3), free_base_port(3)
        self.servers = {
            "primary": ServerAddress("primary", p1, free_port()),
            "backup": ServerAddress("backup", p2, free_port()),
        }
        self.monitor = HugzMonitor(
            {n: f"tcp://127.0.0.1:{a.port + PUBLISHER_OFFSET}" for n, a in self.servers.items()},
            cfg.heartbeat,
        )
        self.harness_events: list[dict[str, Any]] = []
        self.generations: dict[str, int] = {}
        self.notes: dict[str, Any] = {}
        self.fault_text = ""
        # rolling-restart: one record per round and per server restart.
        self.rounds: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.in_progress = False  # a multi-step action is under way: do not end yet
        self.t0 = 0.0  # when the clients start writing

    # -- events and processes ---------------------------------------------

    def event(self, event: str, **fields: Any) -> None:
        record = {"ts": time.time(), "client": "drill", "event": event}
        record.update(fields)
        self.harness_events.append(record)

    def start_server(self, name: str) -> ManagedProcess:
        other = "backup" if name == "primary" else "primary"
        argv = server_argv(
            name, self.servers[name], self.servers[other], heartbeat_ms=self.cfg.heartbeat_ms
        )
        if name in self.group.procs:
            proc = self.group[name]
            proc.start()
        else:
            proc = self.group.add(name, argv)
        return proc

    def start_client(self, cid: str, start_at: float, final_at: float) -> ManagedProcess:
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
            "--value-size", str(cfg.value_size),
            "--start-at", repr(start_at),
            "--write-seconds", repr(max(0.0, self.write_end - start_at)),
            "--final-at", repr(final_at),
            "--events", str(self.clients_dir / f"{stem}.jsonl"),
            "--state", str(self.clients_dir / f"{stem}.state.json"),
            "--seed", str(cfg.seed),
        )  # fmt: skip
        return self.group.add(stem, argv)

    def active_server(self) -> str | None:
        active = self.monitor.active()
        return active[0] if len(active) == 1 else None

    # -- the timeline -------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.clients_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.clients_dir.glob("*"), self.out / "events.jsonl"]:
            stale.unlink(missing_ok=True)
        with self.group:
            try:
                return self._run()
            finally:
                self.monitor.stop()

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.say(
            f"drill {cfg.scenario}: {cfg.clients} clients x {cfg.rate:g} writes/s for "
            f"{cfg.duration:g} s, heartbeat {cfg.heartbeat_ms} ms, out {self.out}"
        )
        for name in self.servers:
            self.start_server(name)
        deadline = time.monotonic() + 15
        for name, addr in self.servers.items():
            for port in (addr.port, addr.port + 1, addr.port + 2):
                if not wait_listening(port, deadline):
                    raise RuntimeError(f"{name} not listening:\n{self.group[name].log_tail()}")
        self.monitor.start()
        deadline = time.monotonic() + 10 + 5 * cfg.heartbeat
        while self.active_server() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.active_server() is None:
            raise RuntimeError("no server became active:\n" + self._log_tails())
        self.say(f"pair up: {self.active_server()} is active")
        if cfg.preload:
            self._preload(cfg.preload)

        start_at = self.t0 = time.time() + 2.5
        self.write_end = start_at + cfg.duration
        final_at = self.write_end + cfg.settle
        client_ids = [f"c{i}" for i in range(cfg.clients)]
        for cid in client_ids:
            self.start_client(cid, start_at, final_at)

        actions = self._plan(start_at)
        tail = _Tail(self.clients_dir)
        next_report = start_at
        while (time.time() < final_at or self.in_progress
               or any(p.alive for p in self.group if p.name not in self.servers)):
            now = time.time()
            while actions and actions[0][0] <= now:
                _, action = actions.pop(0)
                again = action()  # a step of a longer action says when to go on
                if again is not None:
                    bisect.insort(actions, (again, action), key=lambda a: a[0])
            if now >= next_report:
                tail.poll()
                self._progress(now - start_at, tail.counts)
                next_report += 1.0
            if now > final_at + 30:
                self.say("clients or faults did not finish in time; stopping them")
                break
            time.sleep(0.05)
        return self._finish(start_at, client_ids)

    def _preload(self, n: int) -> None:
        from clone.tools.bench.targets import Target, load_keys

        name = self.active_server() or "primary"
        addr = self.servers[name]
        target = Target(name, f"tcp://127.0.0.1:{addr.port + 2}",
                        f"tcp://127.0.0.1:{addr.port + PUBLISHER_OFFSET}", self.group[name].pid)
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            seconds = load_keys(ctx, target, n, self.cfg.value_size)
        finally:
            ctx.term()
        self.say(f"preloaded {n} keys (outside {DRILL_PREFIX}) in {seconds:.1f} s")

    def _plan(self, start_at: float) -> list[tuple[float, Callable[[], float | None]]]:
        cfg = self.cfg
        t_fault = start_at + cfg.fault_at * cfg.duration
        recover = max(0.25 * cfg.duration, cfg.failover_budget)
        sc = cfg.scenario
        if sc == "rolling-restart":
            steps = self._rolling_restart(t_fault)
            return [(t_fault, lambda: next(steps, None))]
        if sc in ("kill-active", "ttl-storm"):
            return [(t_fault, lambda: self._kill("active")),
                    (t_fault + recover, self._restart_killed)]
        if sc == "kill-passive":
            return [(t_fault, lambda: self._kill("passive")),
                    (t_fault + recover, self._restart_killed)]
        if sc == "freeze-active":
            return [(t_fault, self._freeze), (t_fault + recover, self._thaw)]
        victim = f"c{cfg.clients - 1}"
        back = t_fault + max(1.0, 0.15 * cfg.duration)
        return [(t_fault, lambda: self._kill_client(victim)),
                (back, lambda: self._restart_client(victim))]

    def _pick(self, which: str) -> str:
        active = self.active_server() or "primary"
        return active if which == "active" else ("backup" if active == "primary" else "primary")

    def _kill(self, which: str) -> None:
        name = self._pick(which)
        self.group[name].kill9()
        self.notes["killed"], self.notes["fault_ts"] = name, time.time()
        self.event("fault", kind="kill-9", target=name)
        self.fault_text = f"kill -9 {name} ({which})"
        self.say(f"FAULT: kill -9 the {which} server ({name})")

    def _restart_killed(self) -> None:
        name = self.notes["killed"]
        self.start_server(name)
        self.notes["restart_ts"] = time.time()
        self.event("restart", target=name)
        self.say(f"restarted {name}; it must come back passive")

    def _freeze(self) -> None:
        name = self._pick("active")
        self.group[name].freeze()
        self.notes["frozen"], self.notes["fault_ts"] = name, time.time()
        self.event("fault", kind="sigstop", target=name)
        self.fault_text = f"SIGSTOP {name}"
        self.say(f"FAULT: SIGSTOP the active server ({name})")

    def _thaw(self) -> None:
        name = self.notes["frozen"]
        self.group[name].thaw()
        self.notes["thaw_ts"] = time.time()
        self.event("fault", kind="sigcont", target=name)
        self.say(f"SIGCONT {name}: it must not go on as a second active")

    def _kill_client(self, cid: str) -> None:
        stem = cid if self.generations[cid] == 0 else f"{cid}.g{self.generations[cid]}"
        self.group[stem].kill9()
        self.event("fault", kind="kill-9", target=cid)
        self.fault_text = f"kill -9 client {cid}"
        self.say(f"FAULT: kill -9 client {cid}")

    def _restart_client(self, cid: str) -> None:
        self.start_client(cid, time.time(), self.write_end + self.cfg.settle)
        self.event("restart", target=cid)
        self.say(f"restarted client {cid} (late joiner)")

    # -- rolling-restart -----------------------------------------------------

    def _rolling_restart(self, first: float) -> Iterator[float]:
        """Rounds of an operator's rolling restart, under load: restart the passive,
        wait until it has synced, stop the active so that the restarted one takes
        over, restart the stopped one.  The last round stops the active only once
        the writes are over, so that the final state is what the takeover left:
        a revert at takeover that later writes would hide stays visible.  A
        generator: it yields when to go on, so the main loop keeps reporting
        progress while it waits."""
        period = self.cfg.round_period
        rounds = max(2, int((self.write_end - first) // period))
        self.in_progress = True
        try:
            for i in range(rounds):
                yield first + i * period  # or at once, if the last round ran late
                yield from self._round(i, rounds)
        finally:
            self.in_progress = False

    def _round(self, i: int, rounds: int) -> Iterator[float]:
        budget = 2 * self.cfg.failover_budget
        # Alternate the signals, so that both servers see both kinds of stop.
        how_passive, how_active = ("kill-9", "sigterm") if i % 2 == 0 else ("sigterm", "kill-9")
        record: dict[str, Any] = {"round": i + 1, "ts": time.time()}
        self.rounds.append(record)
        deadline = time.time() + budget
        while self.active_server() is None and time.time() < deadline:
            yield time.time() + 0.05
        active = self.active_server()
        if active is None:
            record["error"] = f"no single active server: {self.monitor.active()}"
            self.say(f"round {i + 1}: {record['error']}; skipping it")
            return
        passive = "backup" if active == "primary" else "primary"
        record.update(active=active, passive=passive, passive_stop=how_passive,
                      active_stop=how_active)
        tag = f"round {i + 1}/{rounds}"
        self._stop_server(passive, how_passive, f"{tag}: restart the passive")
        # A real restart leaves the server down for a moment while writes go on
        # (and queue up in the clients' sockets for it).
        down_until = time.time() + max(0.5, 2 * self.cfg.heartbeat)
        while time.time() < down_until:
            yield down_until
        restarted = self._restart_server(passive, tag)
        yield from self._wait_synced(restarted)
        if i == rounds - 1:
            while time.time() < self.write_end + 0.5:
                yield time.time() + 0.05
        # What it holds in its pending list, it would apply again when it takes over.
        record["pending_at_takeover"] = server_stats(self.group[passive]).get("pending")
        self._stop_server(active, how_active, f"{tag}: stop the active")
        stopped_at = time.time()
        while self.monitor.active() != [passive] and time.time() < stopped_at + budget:
            yield time.time() + 0.05
        took_over = self.monitor.active() == [passive]
        record["takeover_s"] = round(time.time() - stopped_at, 3) if took_over else None
        self.say(f"{tag}: {passive} took over in {record['takeover_s']} s" if took_over
                 else f"{tag}: {passive} did NOT take over; active: {self.monitor.active()}")
        back = self._restart_server(active, tag)
        yield from self._wait_synced(back)
        record["seconds"] = round(time.time() - record["ts"], 3)

    def _stop_server(self, name: str, how: str, why: str) -> None:
        # A restarted server must stay passive until it is stopped or meant to
        # take over, and every stop is one or the other (a SIGTERM'd active may
        # hand over before it has exited).
        now = time.time()
        for rec in self.restarts:
            if rec["until"] is None:
                rec["until"] = now
        self.event("fault", kind=how, target=name)
        proc = self.group[name]
        if how == "kill-9":
            proc.kill9()
        else:
            proc.stop(timeout=5)
        self.fault_text = f"{why}: {how} {name}"
        self.say(f"FAULT ({why}): {how} {name}")

    def _restart_server(self, name: str, tag: str) -> dict[str, Any]:
        path = self.group[name].log_path
        offset = path.stat().st_size if path.exists() else 0
        self.start_server(name)
        rec: dict[str, Any] = {"server": name, "ts": time.time(), "log_offset": offset,
                               "until": None, "synced_s": None, "stats": {}}
        self.restarts.append(rec)
        self.event("restart", target=name)
        self.say(f"{tag}: restarted {name}; it must come back passive and sync")
        return rec

    def _wait_synced(self, rec: dict[str, Any]) -> Iterator[float]:
        """Until the restarted server's log says ``synced from`` (or a deadline);
        then its stats line, taken while it should be a passive in step."""
        proc = self.group[rec["server"]]
        deadline = rec["ts"] + max(10.0, 2 * self.cfg.failover_budget)
        while proc.alive:
            with open(proc.log_path, "rb") as f:
                f.seek(rec["log_offset"])
                if b"synced from" in f.read():
                    rec["synced_s"] = round(time.time() - rec["ts"], 3)
                    break
            if time.time() >= deadline:
                self.say(f"{rec['server']} did not sync in time")
                break
            yield time.time() + 0.05
        rec["stats"] = server_stats(proc)

    def _progress(self, t: float, counts: Counter[str]) -> None:
        active = self.monitor.active()
        shown = "+".join(active) if active else "none"
        if len(active) > 1:
            shown += " (BOTH ACTIVE)"
        self.say(
            f"t={t:+6.1f}s writes={counts['write_sent']} confirmed={counts['write_confirmed']} "
            f"timeouts={counts['write_timeout']} updates={counts['update']} "
            f"failovers={counts['failover_done']} active={shown}"
            + (f"  [{self.fault_text}]" if self.fault_text else "")
        )

    # -- the end --------------------------------------------------------------

    def _finish(self, start_at: float, client_ids: list[str]) -> dict[str, Any]:
        cfg = self.cfg
        for proc in self.group:
            if proc.name not in self.servers and proc.alive:
                proc.stop(timeout=2)
        end_active = self.monitor.active()
        for rec in self.restarts:
            if rec["until"] is None:
                rec["until"] = time.time()
        server_state: dict[str, bytes] | None = None
        answered = None
        for name in [*end_active, *(n for n in self.servers if n not in end_active)]:
            if self.group[name].alive:
                server_state = raw_snapshot(self.servers[name].endpoint, DRILL_PREFIX, 5.0)
                if server_state is not None:
                    answered = name
                    break
        stats = {name: server_stats(self.group[name]) for name in self.servers}
        self.group.stop_all()
        self.monitor.stop()

        streams: dict[str, list[dict[str, Any]]] = {}
        for path in sorted(self.clients_dir.glob("*.jsonl")):
            streams[path.stem] = _read_events(path)
        final_clients: dict[str, str | None] = {}
        client_items: dict[str, dict[str, str | None]] = {}
        for cid in client_ids:
            gen = self.generations.get(cid, 0)
            stem = cid if gen == 0 else f"{cid}.g{gen}"
            state_path = self.clients_dir / f"{stem}.state.json"
            final = json.loads(state_path.read_text()) if state_path.exists() else None
            final_clients[cid] = None if final is None else final["hash"]
            if final is not None:
                client_items[cid] = final["items"]
        everything = [e for evs in streams.values() for e in evs] + self.harness_events
        everything.sort(key=lambda e: e["ts"])
        with open(self.out / "events.jsonl", "w") as f:
            for e in everything:
                f.write(json.dumps(e, separators=(",", ":")) + "\n")

        summary: dict[str, Any] = {
            "scenario": cfg.scenario,
            "clients": cfg.clients,
            "duration_s": cfg.duration,
            "rate_per_client": cfg.rate,
            "heartbeat_ms": cfg.heartbeat_ms,
            "seed": cfg.seed,
            "out": str(self.out),
        }
        summary.update(analyse(streams, server_state, final_clients, client_items))
        summary["final_server"] = answered
        summary["final_client_hashes"] = final_clients
        summary["active_at_end"] = end_active
        summary["servers"] = stats
        if cfg.scenario == "rolling-restart":
            summary["rounds"] = self.rounds
            summary["restarts"] = self._judge_restarts()
        summary["checks"] = self._checks(summary, end_active)
        summary["ok"] = all(c["ok"] for c in summary["checks"].values())
        summary["config"] = {k: str(v) if isinstance(v, Path) else v
                             for k, v in asdict(cfg).items()}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    def _judge_restarts(self) -> list[dict[str, Any]]:
        """Each restart, with whether it came back passive: it synced, its stats
        said passive, and it sent no HUGZ until it was stopped or meant to take over."""
        out = []
        for rec in self.restarts:
            hugz = self.monitor.hugz_after(rec["server"], rec["ts"], rec["until"])
            ok = rec["synced_s"] is not None and rec["stats"].get("role") == "passive" and not hugz
            out.append({**rec, "hugz_before_takeover": len(hugz), "came_back_passive": ok})
        return out

    def _checks(self, s: dict[str, Any], end_active: list[str]) -> dict[str, dict[str, Any]]:
        checks: dict[str, dict[str, Any]] = {}

        def check(name: str, ok: bool, detail: str = "") -> None:
            checks[name] = {"ok": bool(ok), "detail": detail}

        check("no confirmed write lost", s["confirmed_lost"] == 0,
              f"{s['confirmed_lost']} of {s['confirmed_writes']}")
        check("clients converged", s["converged"],
              f"server {s['final_server'] or 'none answered'}, "
              f"{len(set(s['final_client_hashes'].values()))} distinct client hash(es)")
        check("no duplicate applied", s["duplicates"] == 0, str(s["duplicates"]))
        check("per-writer order kept", s["out_of_order"] == 0, str(s["out_of_order"]))
        check("one active server at the end", len(end_active) == 1, ",".join(end_active) or "none")
        sc = self.cfg.scenario
        st = s["servers"]
        if sc in ("kill-active", "kill-passive", "ttl-storm") and "restart_ts" in self.notes:
            name = self.notes["killed"]
            hugz = self.monitor.hugz_after(name, self.notes["restart_ts"])
            role = st.get(name, {}).get("role", "?")
            check(f"restarted {name} came back passive", not hugz and role == "passive",
                  f"{len(hugz)} HUGZ after restart; stats role {role}")
        if sc == "freeze-active" and "thaw_ts" in self.notes:
            dual = self.monitor.dual_active_seconds(self.notes["thaw_ts"])
            s["dual_active_s"] = round(dual, 3)
            detected = any("split brain" in self.group[n].log_path.read_text(errors="replace")
                           for n in self.servers)
            s["split_brain_detected"] = detected
            check("split brain detected and resolved", detected and len(end_active) == 1,
                  f"logged={detected}, both active for {dual:.2f} s after SIGCONT, "
                  f"active at end: {','.join(end_active) or 'none'}")
        if sc == "ttl-storm":
            check("no ephemeral key outlived its ttl", s["ttl_leftover"] == 0,
                  f"{s['ttl_leftover']} of {s['ttl_writes']} left")
        roles = {n: v.get("role") for n, v in st.items()}
        seqs = {n: v.get("seq") for n, v in st.items()}
        if all(v.get("alive") and "seq" in v for v in st.values()):
            # A passive's pending list holds client writes the active has not (yet)
            # republished; at the end there are none, and any it still holds would
            # be applied again when it takes over.
            pending = {n: v.get("pending") for n, v in st.items()}
            check("passive in step with active", len(set(seqs.values())) == 1
                  and len({v.get("keys") for v in st.values()}) == 1
                  and all(pending[n] == 0 for n, role in roles.items() if role != "active"),
                  f"roles {roles}, seq {seqs}, keys { {n: v.get('keys') for n, v in st.items()} }, "
                  f"pending {pending}")
        if self.cfg.shared_keys > 0:
            check("every key at its last confirmed value or later", s["reverted_keys"] == 0,
                  revert_detail(s))
            check("no client saw a key go back", s["reverts_seen"] == 0, seen_revert_detail(s))
        if sc == "rolling-restart":
            restarts = s["restarts"]
            bad = [r for r in restarts if not r["came_back_passive"]]
            check("every restarted server came back passive", bool(restarts) and not bad,
                  f"{len(restarts)} restarts, {len(bad)} not passive"
                  + "".join(f"; {r['server']} at t={r['ts'] - self.t0:.1f} s: synced "
                            f"{r['synced_s']} s, role {r['stats'].get('role')}, "
                            f"{'running' if r['stats'].get('alive') else 'exited'}, "
                            f"{r['hugz_before_takeover']} HUGZ" for r in bad[:3]))
            rounds = s["rounds"]
            took = [r for r in rounds if r.get("takeover_s") is not None]
            check("the restarted passive took over every round",
                  len(rounds) >= 2 and len(took) == len(rounds),
                  f"{len(took)} of {len(rounds)} rounds, takeover in "
                  f"{[r.get('takeover_s') for r in rounds]} s, pending at takeover "
                  f"{[r.get('pending_at_takeover') for r in rounds]}")
        if sc == "client-restart":
            check("every client has a final state",
                  None not in s["final_client_hashes"].values(), "")
        return checks

    def _log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(20)}" for p in self.group)


def run_drill(cfg: DrillConfig, say: Say | None = None) -> dict[str, Any]:
    """Run one drill; the summary (also written to ``cfg.out/summary.json``)."""
    return _Drill(cfg, say or log.info).run()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/drill",
        description="Failover drill: a server pair, N writing clients, injected faults.",
    )
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of writing")
    p.add_argument("--out", type=Path, default=None, help="output directory")
    p.add_argument("--rate", type=float, default=20.0, help="writes per second per client")
    p.add_argument("--confirm-every", type=int, default=4,
                   help="every k-th write is confirmed (0: none)")
    p.add_argument("--heartbeat", type=int, default=DEFAULT_HEARTBEAT_MS, metavar="MS",
                   help=f"servers' heartbeat (default {DEFAULT_HEARTBEAT_MS}, as the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-at", type=float, default=0.35, help="fraction of the duration")
    p.add_argument("--ttl-per-tick", type=int, default=3, help="ttl-storm: ephemeral writes/tick")
    p.add_argument("--ttl-min", type=float, default=0.5)
    p.add_argument("--ttl-max", type=float, default=2.0)
    p.add_argument("--confirm-timeout", type=float, default=10.0)
    p.add_argument("--preload", type=int, default=0,
                   help="keys loaded before the clients start (outside /drill/), so a "
                   "restarted server syncs a real snapshot")
    p.add_argument("--shared-keys", type=int, default=DEFAULT_SHARED_KEYS,
                   help="keys every client also overwrites, one write per tick, so that a "
                   f"revert to an older value shows (default {DEFAULT_SHARED_KEYS}; 0: none)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from clone.tools import report

    out = args.out or Path("results") / f"drill-{args.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        cfg = DrillConfig(
            scenario=args.scenario, clients=args.clients, duration=args.duration, out=out,
            rate=args.rate, confirm_every=args.confirm_every, heartbeat_ms=args.heartbeat,
            seed=args.seed, fault_at=args.fault_at, ttl_per_tick=args.ttl_per_tick,
            ttl_min=args.ttl_min, ttl_max=args.ttl_max, confirm_timeout=args.confirm_timeout,
            preload=args.preload, shared_keys=args.shared_keys,
        )
    except ValueError as exc:
        print(f"drill: {exc}", file=sys.stderr)
        return 2
    summary = run_drill(cfg, say=lambda line: print(line, flush=True))
    print()
    print(report.drill_text(summary))
    print(f"\nevents: {out / 'events.jsonl'}\nsummary: {out / 'summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
