"""Failover drills: a real server pair, N client processes, injected faults.

How this works: :func:`run_drill` starts a primary and a backup ``clone-server``
on free loopback ports, a thread that listens to the HUGZ of both (only the
active server sends HUGZ, so it always knows which one is active, and when both
are: :mod:`clone.tools.drill.watch`), and N :mod:`clone.tools.drill.client`
processes.  The clients sync, start writing together at ``start_at`` and stop
after ``duration`` seconds; the fault is injected at 35% of the run
(``rolling-restart``: rounds of restarts from then on, the scenario's own
timeline; ``both-crash``: both servers killed, then restarted together from
their data directories).  Each client logs its events to its own file (``clients/<id>.jsonl``)
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
  server did not go on as a second active, no ephemeral key outlived its ttl,
  a pair restarted after both crashed serves no lower sequence than the
  clients saw before.

The result is ``summary.json``; :func:`.cli.main` prints a table and exits 1 when a
guarantee is broken.  ``docs/drills.md`` describes the scenarios and the schema.

This module holds the timeline; the scenarios' faults are in :mod:`.scenarios`,
the checks in :mod:`.checks`, the processes in :mod:`.pair`.
"""

from __future__ import annotations

import bisect
import json
import logging
import shutil
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq

from clone.progress import Progress
from clone.server.healing import HOLD_MAX
from clone.tools.drill.analysis import analyse, conflict_write_ids, highest_sequence_before
from clone.tools.drill.applied import promotion_sequence, read_applied
from clone.tools.drill.checks import judge_partition, judge_restarts, judge_upgrade, run_checks
from clone.tools.drill.client import DRILL_PREFIX
from clone.tools.drill.config import DrillConfig, Say
from clone.tools.drill.events import EventTail, read_events
from clone.tools.drill.scenarios import Scenarios
from clone.tools.drill.upgrade import default_cache, prepare_release
from clone.tools.drill.watch import raw_snapshot, server_stats
from clone.tools.procs import wait_listening
from clone.wire.protocol import PUBLISHER_OFFSET

__all__ = ["Drill", "run_drill"]

log = logging.getLogger(__name__)


class Drill(Scenarios):
    """One drill run: the timeline, from the pair coming up to ``summary.json``."""

    # -- the timeline -------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.clients_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.clients_dir.glob("*"), self.out / "events.jsonl"]:
            stale.unlink(missing_ok=True)
        # A drill starts from an empty pair, also when --out is reused.
        shutil.rmtree(self.out / "data", ignore_errors=True)
        cfg = self.cfg
        if cfg.upgrade_from is not None:
            # Before any process or thread: a ref that cannot be built stops here.
            self.release = prepare_release(cfg.upgrade_from, cfg.release_cache or default_cache(),
                                           self.say)
            self.notes["upgrade"] = self.release.summary()
        try:
            self.make_network()  # partition drills: the namespaces; else nothing
            with self.group:
                try:
                    return self._run()
                finally:
                    self.monitor.stop()
        finally:
            # After the processes are gone (also on failure or Ctrl-C): the
            # namespaces, links and iptables rules this run made.
            self.remove_network()

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
                if not wait_listening(port, deadline, addr.host):
                    raise RuntimeError(f"{name} not listening:\n{self.group[name].log_tail()}")
        self.monitor.start()
        deadline = time.monotonic() + 10 + 5 * cfg.heartbeat
        while self.active_server() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.active_server() is None:
            raise RuntimeError("no server became active:\n" + self._log_tails())
        self.say(f"pair up: {self.active_server()} is active")
        if self.release is not None:
            self.notes["upgrade_start"] = self.versions()
            self.say("versions: " + _versions_text(self.notes["upgrade_start"]))
        if cfg.preload:
            self._preload(cfg.preload)

        start_at = time.time() + 2.5
        self.write_end = start_at + cfg.duration
        final_at = self.write_end + cfg.settle
        client_ids = [f"c{i}" for i in range(cfg.clients)]
        start_file = self.clients_dir / "start"
        for cid in client_ids:
            self.start_client(cid, start_at, final_at, start_file)
        start_at = self._start_when_ready(client_ids, start_file, start_at)
        self.t0 = start_at
        self.write_end = start_at + cfg.duration
        final_at = self.write_end + cfg.settle

        actions = self._plan(start_at)
        tail = EventTail(self.clients_dir)
        next_report = start_at
        run_s = cfg.duration + cfg.settle
        with Progress(f"drill {cfg.scenario}", run_s, unit="s", rate=False) as bar:
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
                    elapsed = min(max(0.0, now - start_at), run_s)
                    bar.update(elapsed, status=self._status(tail.counts))
                    next_report += 1.0
                if now > final_at + 30:
                    self.say("clients or faults did not finish in time; stopping them")
                    break
                time.sleep(0.05)
        return self._finish(start_at, client_ids)

    def _start_when_ready(self, client_ids: list[str], start_file: Path, planned: float) -> float:
        """Wait until every client has synced (its ``.ready`` file), then give
        them the start time, half a second from now: the plan is measured from
        when they all write.  On a loaded machine clients took seconds more
        than planned to start, and the fault came before some had written
        anything; on an idle one they were ready in about half a second, and
        waiting for the planned time (2.5 s) only made the run longer."""
        deadline = time.monotonic() + 90
        ready = [self.clients_dir / f"{cid}.ready" for cid in client_ids]
        while not all(p.exists() for p in ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        late = [p.stem for p in ready if not p.exists()]
        if late:
            self.say(f"clients not synced after 90 s: {', '.join(late)}; starting anyway")
        start_at = time.time() + 0.5
        if start_at > planned + 0.05:
            self.say(f"clients synced {start_at - planned:.1f} s later than planned; "
                     "the run starts then")
        start_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = start_file.with_suffix(".tmp")
        tmp.write_text(f"{start_at!r}\n")
        tmp.replace(start_file)
        return start_at

    def _preload(self, n: int) -> None:
        from clone.tools.bench.targets import Target, load_keys

        name = self.active_server() or "primary"
        addr = self.servers[name]
        target = Target(name, f"tcp://{addr.host}:{addr.port + 2}",
                        f"tcp://{addr.host}:{addr.port + PUBLISHER_OFFSET}", self.group[name].pid)
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            seconds = load_keys(ctx, target, n, self.cfg.value_size)
        finally:
            ctx.term()
        self.say(f"preloaded {n} keys (outside {DRILL_PREFIX}) in {seconds:.1f} s")

    def _conflicts(self) -> list[dict[str, Any]]:
        """Every split-brain conflict the servers still running keep (resolved
        or not), each with the name of the server that holds it."""
        from clone.client.conflicts import query_conflicts

        names = {self.servers[n].endpoint: n for n in self.servers if self.group[n].alive}
        if not names:
            return []
        found, silent = query_conflicts(list(names), 5.0, everything=True)
        for endpoint in silent:
            self.say(f"{names[endpoint]} did not list its conflicts")
        return [{**rec, "server": names.get(rec["server"], rec["server"])} for rec in found]

    def _read_winner_history(self, end_active: list[str]) -> None:
        """partition-split: what the winner applied since its promotion, from its
        own history (:mod:`.applied`), for the fate of the loser's writes."""
        part = self.notes.get("partition")
        if self.cfg.scenario != "partition-split" or part is None or len(end_active) != 1:
            return
        name = end_active[0]
        if not self.group[name].alive:
            return
        with open(self.group[name].log_path, "rb") as f:
            f.seek(part["log_offsets"][name])
            since = promotion_sequence(f.read().decode(errors="replace"))
        if since is None:
            return
        history = read_applied(name, self.servers[name].endpoint, since)
        self.notes["winner_history"] = history
        if not history.complete:
            self.say(f"the history of {name} after {since} was not read to its end "
                     f"({history.error or 'out of time'}): "
                     "the fates below may miss writes it applied")

    def _status(self, counts: Counter[str]) -> str:
        """The run so far, as the progress bar's status."""
        active = self.monitor.active()
        shown = "+".join(active) if active else "none"
        if len(active) > 1:
            shown += " (BOTH ACTIVE)"
        return (
            f"writes={counts['write_sent']} confirmed={counts['write_confirmed']} "
            f"timeouts={counts['write_timeout']} updates={counts['update']} "
            f"failovers={counts['failover_done']} active={shown}"
            + (f"  [{self.fault_text}]" if self.fault_text else "")
        )

    # -- the end --------------------------------------------------------------

    def _wait_settled(self, timeout: float = HOLD_MAX + 2.0) -> None:
        """Before the end's state and stats: until no server holds client
        updates, or ``timeout``.

        A server restarted late in a drill steps down as after a split brain,
        and the active holds its clients' updates until the peer has synced and
        forwarded its writes (``HOLD_MAX``, clone.server.healing); meanwhile
        both count them as pending.  A CI run read the stats 0.03 s before the
        release and failed "passive in step with active" on a pair that was
        only mid-heal.  A passive's pending entry that never clears (what the
        check is for) still shows: it lasts far longer than this wait."""
        started = time.monotonic()
        while True:
            pending = [server_stats(self.group[n]).get("pending")
                       for n in self.servers if self.group[n].alive]  # fmt: skip
            waited = time.monotonic() - started
            if not any(pending) or waited >= timeout:
                if waited >= 0.2:
                    self.say(f"waited {waited:.1f} s for held client updates to settle"
                             f" (pending {pending})")  # fmt: skip
                return
            time.sleep(0.2)

    def _finish(self, start_at: float, client_ids: list[str]) -> dict[str, Any]:
        cfg = self.cfg
        for proc in self.group:
            if proc.name not in self.servers and proc.alive:
                proc.stop(timeout=2)
        end_active = self.monitor.active()
        for rec in self.restarts:
            if rec["until"] is None:
                rec["until"] = time.time()
        self._wait_settled()
        server_state: dict[str, bytes] | None = None
        answered = None
        for name in [*end_active, *(n for n in self.servers if n not in end_active)]:
            if self.group[name].alive:
                server_state = raw_snapshot(self.servers[name].endpoint, DRILL_PREFIX, 5.0)
                if server_state is not None:
                    answered = name
                    break
        stats = {name: server_stats(self.group[name]) for name in self.servers}
        conflicts = self._conflicts()
        self._read_winner_history(end_active)
        if self.release is not None:
            self.notes["upgrade_end"] = self.versions()
            self.say("versions at the end: " + _versions_text(self.notes["upgrade_end"]))
        self.group.stop_all()
        self.monitor.stop()

        streams: dict[str, list[dict[str, Any]]] = {}
        for path in sorted(self.clients_dir.glob("*.jsonl")):
            streams[path.stem] = read_events(path)
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
        conflicted = conflict_write_ids(conflicts)
        summary.update(analyse(streams, server_state, final_clients, client_items, conflicted))
        summary["conflicts"] = conflicts
        summary["final_server"] = answered
        summary["final_client_hashes"] = final_clients
        summary["active_at_end"] = end_active
        summary["servers"] = stats
        if cfg.scenario == "rolling-restart":
            summary["rounds"] = self.rounds
            summary["restarts"] = judge_restarts(self)
        if cfg.scenario == "both-crash" and "crash" in self.notes:
            crash = summary["crash"] = dict(self.notes["crash"])
            crash["seq_seen_before"] = highest_sequence_before(
                streams, crash.get("down_ts", float("inf")))
        if "partition" in self.notes:
            summary["partition"] = judge_partition(self, streams, server_state, conflicted)
        if self.release is not None:
            summary["upgrade"] = judge_upgrade(self)
        summary["checks"] = run_checks(self, summary, end_active)
        summary["ok"] = all(c["ok"] for c in summary["checks"].values())
        summary["config"] = {k: str(v) if isinstance(v, Path) else v
                             for k, v in asdict(cfg).items()}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary



def _versions_text(versions: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{n} {v['version'] or '?'} (format {v['data_format'] or '?'}, "
                     f"{v['role'] or 'no answer'})" for n, v in versions.items())


def run_drill(cfg: DrillConfig, say: Say | None = None) -> dict[str, Any]:
    """Run one drill; the summary (also written to ``cfg.out/summary.json``)."""
    return Drill(cfg, say or log.info).run()
