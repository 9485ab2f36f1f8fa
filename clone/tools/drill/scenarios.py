"""The scenarios' fault plans: what is done to the pair or a client, and when.

How this works: :meth:`Scenarios._plan` turns the scenario into a list of
(time, action); the harness's loop runs each action when its time comes.  An
action that takes several steps (a rolling-restart round) is a generator: it
yields when to go on, so that the loop keeps reporting progress meanwhile.
The actions note what they did (``notes``, ``rounds``, ``restarts``) for
:mod:`.checks`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from clone.server.config import PEER_WAIT_DEFAULT
from clone.tools.drill.pair import PairRun
from clone.tools.drill.watch import served_sequence, server_stats

# What a server with a data directory says it loaded when it starts.
_LOADED_RE = re.compile(rb"data directory .*?: (\d+) keys at sequence (\d+) \(term (\d+)\)")

__all__ = ["Scenarios"]


class Scenarios(PairRun):
    """The fault plan of each scenario, and its actions."""

    def _plan(self, start_at: float) -> list[tuple[float, Callable[[], float | None]]]:
        cfg = self.cfg
        t_fault = start_at + cfg.fault_at * cfg.duration
        recover = max(0.25 * cfg.duration, cfg.failover_budget)
        sc = cfg.scenario
        if sc == "rolling-restart":
            steps = self._rolling_restart(t_fault)
            return [(t_fault, lambda: next(steps, None))]
        if sc == "both-crash":
            crash = self._both_crash()
            return [(t_fault, lambda: next(crash, None))]
        if sc in ("kill-active", "ttl-storm"):
            return [(t_fault, lambda: self._kill("active")),
                    (t_fault + recover, self._restart_killed)]
        if sc == "kill-passive":
            return [(t_fault, lambda: self._kill("passive")),
                    (t_fault + recover, self._restart_killed)]
        if sc in ("partition-pair", "partition-active", "partition-split"):
            return [(t_fault, self._partition), (t_fault + cfg.partition_seconds, self._heal)]
        if sc == "freeze-active":
            return [(t_fault, self._freeze), (t_fault + recover, self._thaw)]
        victim = f"c{cfg.clients - 1}"
        back = t_fault + max(1.0, 0.15 * cfg.duration)
        return [(t_fault, lambda: self._kill_client(victim)),
                (back, lambda: self._restart_client(victim))]

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

    # -- partition-pair, partition-active, partition-split -------------------

    def _log_offsets(self) -> dict[str, int]:
        return {n: self.group[n].log_size() for n in self.servers}

    def _partition(self) -> None:
        """Cut the Binary Star link (partition-pair), the active server from
        everyone (partition-active), or the active server from everyone but the
        island client, and that client from the passive (partition-split), with
        DROP rules in the namespaces."""
        topo = self.topology
        assert topo is not None
        active = self._pick("active")
        passive = self._pick("passive")
        if self.cfg.scenario == "partition-pair":
            topo.cut_pair_link({n: a.ha_port for n, a in self.servers.items()})
            target, what = "pair-link", "cut the Binary Star link between the servers"
        elif self.cfg.scenario == "partition-split":
            topo.split(active, passive, reset=self.cfg.island_reset)
            target = active
            what = (f"cut the active server ({active}) from everyone but client "
                    f"{self.cfg.island_client}, and {self.cfg.island_client} from {passive}"
                    + (" (TCP reset)," if self.cfg.island_reset else ","))
        else:
            topo.isolate(active)
            target, what = active, f"cut the active server ({active}) from everyone"
        self.notes["partition"] = {
            "kind": self.cfg.scenario, "active": active, "passive": passive,
            "ts": time.time(), "seconds": self.cfg.partition_seconds,
            "rules": list(topo.cuts), "log_offsets": self._log_offsets(),
        }
        self.notes["fault_ts"] = self.notes["partition"]["ts"]
        # Each server's worst loop stall so far (its running maximum), so that
        # a larger one at the end is known to have come after the cut.
        self.notes["partition"]["max_late_ms_at_cut"] = {
            n: server_stats(self.group[n]).get("heartbeat_max_late_ms") for n in self.servers}
        self.event("fault", kind="partition", target=target)
        self.fault_text = f"partition: {target}"
        drops = sum(rule.endswith(" DROP") for rule in topo.cuts)
        self.say(f"FAULT: {what} for {self.cfg.partition_seconds:g} s "
                 f"({drops} iptables DROP rules)")

    def _heal(self) -> None:
        topo = self.topology
        assert topo is not None
        topo.heal()
        part = self.notes["partition"]
        part["heal_ts"] = time.time()
        part["heal_offsets"] = self._log_offsets()
        part["active_before_heal"] = self.monitor.active()
        self.event("fault", kind="heal", target=self.notes["partition"]["active"]
                   if self.cfg.scenario != "partition-pair" else "pair-link")
        self.fault_text = ""
        self.say(f"healed; active before the heal: {part['active_before_heal'] or 'none'}")

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
        if restarted["upgraded"] and self.release is not None:
            # A mixed pair: the old release active, the new one following it.
            self.notes.setdefault("upgrade_mixed", self.versions())
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
        upgrade = self.runs_old(name)
        if upgrade:
            self.upgraded.add(name)  # --upgrade-from: every restart runs this code
        self.start_server(name)
        rec: dict[str, Any] = {"server": name, "ts": time.time(), "log_offset": offset,
                               "until": None, "synced_s": None, "stats": {},
                               "upgraded": upgrade}
        self.restarts.append(rec)
        self.event("restart", target=name, upgraded=upgrade)
        self.say(f"{tag}: restarted {name}"
                 + (f" onto the new code (from {self.release.version})"
                    if upgrade and self.release is not None else "")
                 + "; it must come back passive and sync")
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

    # -- both-crash ----------------------------------------------------------

    def _both_crash(self) -> Iterator[float]:
        """kill -9 both servers under load, in the configured order and gap; after
        the down time restart both (the stagger apart), then wait until one of
        them serves and ask it which sequence it serves.  Notes everything in
        ``notes["crash"]`` for :mod:`.checks`."""
        cfg = self.cfg
        first, second = cfg.crash_sequence
        crash: dict[str, Any] = {
            "order": cfg.crash_order, "gap_s": cfg.crash_interval, "down_s": cfg.down_time,
            "stagger_s": cfg.restart_stagger, "in_memory": cfg.in_memory,
            "active_before": self.monitor.active(), "kills": [], "restarts": [],
        }  # fmt: skip
        self.notes["crash"] = crash
        self.in_progress = True
        try:
            self._crash(first, crash)
            if cfg.crash_interval > 0:
                until = time.time() + cfg.crash_interval
                while time.time() < until:
                    yield until
            crash["active_between"] = self.monitor.active()
            self._crash(second, crash)
            self.notes["fault_ts"] = crash["down_ts"] = time.time()
            until = crash["down_ts"] + cfg.down_time
            while time.time() < until:
                yield until
            offsets = {}
            for i, name in enumerate((first, second)):
                if i and cfg.restart_stagger > 0:
                    until = time.time() + cfg.restart_stagger
                    while time.time() < until:
                        yield until
                path = self.group[name].log_path
                offsets[name] = path.stat().st_size if path.exists() else 0
                self.start_server(name)
                crash["restarts"].append({"server": name, "ts": time.time()})
                self.event("restart", target=name)
                self.say(f"restarted {name}")
            restarted = crash["restart_ts"] = time.time()
            yield from self._wait_serving(crash, restarted)
            crash["loaded"] = {n: self._loaded(n, off) for n, off in offsets.items()}
        finally:
            self.in_progress = False

    def _crash(self, name: str, crash: dict[str, Any]) -> None:
        role = "active" if name in self.monitor.active() else "passive"
        self.group[name].kill9()
        crash["kills"].append({"server": name, "role": role, "ts": time.time()})
        self.event("fault", kind="kill-9", target=name)
        self.fault_text = "kill -9 " + " then ".join(k["server"] for k in crash["kills"])
        self.say(f"FAULT: kill -9 {name} ({role})")

    def _wait_serving(self, crash: dict[str, Any], since: float) -> Iterator[float]:
        """Until a restarted server sends HUGZ (it serves) and answers a snapshot
        request with the sequence it serves; a lone server may wait its whole
        --peer-wait, so the deadline allows for that."""
        deadline = since + PEER_WAIT_DEFAULT + 2 * self.cfg.failover_budget
        crash.update(served_by=None, served_seq=None, recovery_s=None)
        while time.time() < deadline:
            serving = [n for n in self.servers if self.monitor.hugz_after(n, since)]
            if len(serving) == 1:
                name = serving[0]
                if crash["recovery_s"] is None:
                    crash["recovery_s"] = round(time.time() - since, 3)
                seq = served_sequence(self.servers[name].endpoint, 1.0)
                if seq is not None:
                    crash.update(served_by=name, served_seq=seq)
                    self.say(f"{name} serves again after {crash['recovery_s']} s, "
                             f"at sequence {seq}")
                    return
            yield time.time() + 0.05
        self.say(f"no single server serves after the restart: {self.monitor.active()}")

    def _loaded(self, name: str, offset: int) -> dict[str, int] | None:
        """What ``name`` loaded from its data directory at this start, from its log."""
        with open(self.group[name].log_path, "rb") as f:
            f.seek(offset)
            m = _LOADED_RE.search(f.read())
        if m is None:
            return None
        return {"keys": int(m[1]), "sequence": int(m[2]), "term": int(m[3])}
