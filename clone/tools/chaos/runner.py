"""The chaos run (``scripts/drill --scenario chaos``): a server pair, recording
client processes, a seeded plan of random faults, then the checker.

How this works: :func:`run_chaos` starts a primary and a backup (in network
namespaces of their own when the partition faults can run, each under
libfaketime when the clock can be stepped, each on a small tmpfs data
directory when the disk can be filled), the client processes of
:mod:`.worker` (writers, compare-and-set incrementers, lock holders,
watchers, and a short-lived lease owner every couple of seconds), and carries
out :func:`.schedule.plan`'s faults (:mod:`.faults`) while the clients run.
Every fault ends some seconds before the traffic does; after it, the run
reads the active server's final state with a fresh client, merges every
process's records into ``history.jsonl`` (sorted by invoke time) and judges
that file (:mod:`.checker`), so that ``python -m clone.tools.chaos.check DIR``
judges the same history again.  :mod:`.report` writes the verdict and the
timeline picture.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clone.errors import CloneError
from clone.tools.chaos.faults import (
    FakeClock,
    Nemesis,
    find_libfaketime,
    sweep_faketime_segments,
)
from clone.tools.chaos.schedule import FAULT_KINDS, NEEDS_ROOT, plan
from clone.tools.chaos.worker import CHAOS_PREFIX, Recorder
from clone.tools.drill.netns import NetnsUnavailable, Topology, preflight
from clone.tools.drill.watch import HugzMonitor
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
from clone.wire.protocol import DEFAULT_MISSED_HEARTBEATS, PUBLISHER_OFFSET

__all__ = ["ChaosConfig", "run_chaos"]

log = logging.getLogger(__name__)
Say = Callable[[str], None]
#: Seconds every fault ends before the traffic does, and the clients' settle after.
QUIET_END = 6.0
#: How long the run waits, after the traffic, for one server alone to be active.
SETTLE_LIMIT = 60.0
#: How long the run waits for its clients to sync before it starts.
READY_LIMIT = 90.0


@dataclass(frozen=True)
class ChaosConfig:
    duration: float = 60.0
    seed: int = 0
    out: Path = Path("results/chaos")
    heartbeat_ms: int = 250
    kinds: tuple[str, ...] = FAULT_KINDS
    writers: int = 2
    cas: int = 2
    lockers: int = 2
    watchers: int = 2
    rate: float = 8.0  # operations per second per writer / incrementer
    lease_every: float = 2.0  # a new lease owner this often
    lease_ttl: float = 1.0
    lock_ttl: float = 2.0
    timeout: float = 5.0  # a confirmed write or call: unknown after this
    gap: tuple[float, float] = (3.0, 8.0)  # seconds between fault starts
    length: tuple[float, float] = (1.0, 6.0)  # how long a fault lasts
    tmpfs_mb: int = 48
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_ms / 1000.0

    @property
    def failover_budget(self) -> float:
        """As the drills': client silence, the backup's peer expiry, a snapshot, slack."""
        return 2 * DEFAULT_MISSED_HEARTBEATS * self.heartbeat + 1.5

    @property
    def lease_bound(self) -> float:
        """What the lease check allows past a dead owner's ttl: a whole ttl from a
        promotion plus the failover (docs/failover.md) and a second of delivery."""
        return self.lease_ttl + self.failover_budget + 1.0


def usable_kinds(kinds: tuple[str, ...], say: Say) -> tuple[tuple[str, ...], list[str]]:
    """The kinds this machine can carry out, and a line for each one left out."""
    skipped: list[str] = []
    keep = list(kinds)
    if any(k.startswith("partition") for k in keep):
        try:
            preflight()
        except NetnsUnavailable as exc:
            skipped.append(f"partition faults skipped: {exc}")
            keep = [k for k in keep if not k.startswith("partition")]
    if "disk-full" in keep and os.geteuid() != 0:
        skipped.append("disk-full skipped: mounting a small tmpfs needs root")
    if os.geteuid() != 0:
        keep = [k for k in keep if k not in NEEDS_ROOT]
    if "clock-step" in keep and find_libfaketime() is None:
        skipped.append("clock-step skipped: libfaketime is not installed "
                       "(Debian: apt-get install faketime)")
        keep.remove("clock-step")
    for line in skipped:
        say(line)
    return tuple(keep), skipped


class ChaosRun:
    def __init__(self, cfg: ChaosConfig, say: Say) -> None:
        self.cfg, self.say = cfg, say
        self.out = Path(cfg.out)
        self.group = ProcessGroup(self.out / "logs")
        self.hist_dir = self.out / "records"
        self.start_file = self.hist_dir / "start"
        self.topology: Topology | None = None
        self.mounts: list[Path] = []
        self.clocks: dict[str, FakeClock] = {}
        self.workers: dict[str, ManagedProcess] = {}
        self.lease_n = 0
        self.nemesis: Nemesis | None = None

    # -- setup ----------------------------------------------------------------

    def _prepare(self, kinds: tuple[str, ...]) -> None:
        shutil.rmtree(self.hist_dir, ignore_errors=True)
        shutil.rmtree(self.out / "data", ignore_errors=True)
        for f in ("history.jsonl", "fence.state"):
            (self.out / f).unlink(missing_ok=True)
        self.hist_dir.mkdir(parents=True, exist_ok=True)
        ports = {"primary": (free_base_port(3), free_port()),
                 "backup": (free_base_port(3), free_port())}
        if any(k.startswith("partition") for k in kinds):
            self.topology = Topology()
            self.topology.create()
        host = self.topology.address if self.topology else (lambda n: "127.0.0.1")
        self.addr = {n: ServerAddress(n, p, ha, host(n)) for n, (p, ha) in ports.items()}
        self.data = {n: self.out / "data" / n for n in self.addr}
        for d in self.data.values():
            d.mkdir(parents=True, exist_ok=True)
            if "disk-full" in kinds:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.cfg.tmpfs_mb}m",
                                "tmpfs", str(d)], check=True, capture_output=True, timeout=30)
                self.mounts.append(d)

    def _start_servers(self) -> dict[str, ManagedProcess]:
        procs = {}
        for name, me in self.addr.items():
            peer = self.addr["backup" if name == "primary" else "primary"]
            argv = server_argv(name, me, peer, heartbeat_ms=self.cfg.heartbeat_ms,
                               data_dir=self.data[name])
            if self.topology is not None:
                argv = self.topology.prefix(name) + argv
            clock = self.clocks.get(name)
            procs[name] = self.group.add(name, argv, env=None if clock is None else clock.env)
        deadline = time.monotonic() + 20
        for name, a in self.addr.items():
            if not wait_listening(a.port, deadline, a.host):
                raise RuntimeError(f"{name} not listening:\n{procs[name].log_tail()}")
        return procs

    def _worker(self, role: str, wid: str, until: float | None, **extra: Any) -> ManagedProcess:
        """A client process; ``until`` None: it waits for the start file (:meth:`_start`)."""
        cfg = self.cfg
        when = ["--start-file", str(self.start_file)] if until is None else ["--until", repr(until)]
        args = ["--role", role, "--id", wid,
                "--servers", ",".join(a.endpoint for a in self.addr.values()),
                "--history", str(self.hist_dir / f"{wid}.jsonl"),
                *when, "--seed", str(cfg.seed),
                "--heartbeat", str(cfg.heartbeat), "--rate", str(cfg.rate),
                "--timeout", str(cfg.timeout), "--fence", str(self.out / "fence.state"),
                "--lock-ttl", str(cfg.lock_ttl), "--lease-ttl", str(cfg.lease_ttl)]
        for k, v in extra.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        return self.group.add(wid, python_module_argv("clone.tools.chaos.worker", *args))

    # -- the run --------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        kinds, skipped = usable_kinds(cfg.kinds, self.say)
        try:
            self._prepare(kinds)
            with self.group:
                monitor = HugzMonitor({n: f"tcp://{a.host}:{a.port + PUBLISHER_OFFSET}"
                                       for n, a in self.addr.items()}, cfg.heartbeat)
                try:
                    return self._run(kinds, skipped, monitor)
                finally:
                    monitor.stop()
        finally:
            if self.topology is not None:
                self.topology.destroy()
            for d in self.mounts:
                subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)
            if self.clocks:  # the group has stopped every faketime'd server by now
                sweep_faketime_segments()

    def _run(self, kinds: tuple[str, ...], skipped: list[str],
             monitor: HugzMonitor) -> dict[str, Any]:
        cfg = self.cfg
        names = ([f"w{i}" for i in range(cfg.writers)] + [f"cas{i}" for i in range(cfg.cas)]
                 + [f"lock{i}" for i in range(cfg.lockers)]
                 + [f"watch{i}" for i in range(cfg.watchers)])
        faults = plan(cfg.seed, cfg.duration, kinds, names, gap=cfg.gap, length=cfg.length,
                      quiet_end=QUIET_END)
        # libfaketime only where the plan steps a clock: under it a server took
        # 2.5-2.7 times the CPU for the same traffic (docs/drills.md).  The
        # plan has clock steps only where the library is (usable_kinds).
        stepped = sorted({f.target for f in faults if f.kind == "clock-step"})
        lib = find_libfaketime()
        if stepped and lib is not None:
            (self.out / "faketime").mkdir(exist_ok=True)
            self.clocks = {n: FakeClock(lib, self.out / "faketime" / n) for n in stepped}
        servers = self._start_servers()
        monitor.start()
        deadline = time.monotonic() + 15
        while not monitor.active() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not monitor.active():
            raise RuntimeError("no server became active")
        (self.out / "plan.json").write_text(json.dumps(
            {"seed": cfg.seed, "duration": cfg.duration, "kinds": list(kinds),
             "skipped": skipped, "faults": [f.as_dict() for f in faults],
             "faketime": sorted(self.clocks)}, indent=1))
        self.say(f"chaos: seed {cfg.seed}, {cfg.duration:g} s, {len(faults)} faults of "
                 f"{', '.join(kinds) or 'no kind'}; out {self.out}")
        # Everyone starts at t0, once every client has synced (the watchers
        # then see every write); a fixed 3 s was 2 s of waiting when idle.
        roles = {"w": "writer", "cas": "cas", "lock": "lock", "watch": "watcher"}
        for wid in sorted(names, key=lambda n: not n.startswith("watch")):
            role = roles[wid.rstrip("0123456789")]
            self.workers[wid] = self._worker(role, wid, None)
        t0 = self._start(names)
        wall_minus_mono = time.time() - time.monotonic()
        until = t0 + cfg.duration
        rec = Recorder(self.hist_dir / "nemesis.jsonl", "nemesis")
        rec.emit("run", t0=t0, t1=until, seed=cfg.seed, duration=cfg.duration,
                 kinds=list(kinds), lease_bound=cfg.lease_bound, wall_minus_mono=wall_minus_mono)
        nemesis = Nemesis(servers, self.workers.get, rec, topology=self.topology,
                          ha_ports={n: a.ha_port for n, a in self.addr.items()},
                          clocks=self.clocks, data_dirs=self.data)
        self.nemesis = nemesis
        steps = sorted((s for f in faults for s in nemesis.steps(f, t0)), key=lambda s: s[0])
        next_lease = t0 + 1.0
        next_say = t0
        shown = ""
        while time.monotonic() < until:
            now = time.monotonic()
            # Who sent HUGZ in the last two heartbeats (the monitor's own window,
            # `missed` of them, would show a killed active beside its successor).
            wall = time.time() - 2 * cfg.heartbeat
            active = "+".join(n for n in self.addr
                              if servers[n].alive and monitor.hugz_after(n, wall)) or "none"
            if active != shown:  # who sends HUGZ: one server, both (split brain), none
                rec.emit("active", t0=now, server=active)
                shown = active
            nemesis.supervise(now)
            while steps and steps[0][0] <= now:
                _, action = steps.pop(0)
                try:
                    action()
                except Exception:
                    log.exception("a fault's action failed")
            if now >= next_lease and now < until - QUIET_END:
                self.lease_n += 1
                lid = f"lease{self.lease_n}"
                self._worker("lease", lid, until)
                next_lease = now + cfg.lease_every
            if now >= next_say:
                active = "+".join(monitor.active()) or "none"
                self.say(f"t={now - t0:5.1f}s active={active} "
                         f"faults=[{'; '.join(nemesis.current)}]")
                next_say = now + 5.0
            time.sleep(0.02)
        for _, action in steps:  # anything left ends now (plans end before; be sure)
            action()
        for p in self.group:
            if p.name not in servers and p.alive:
                p.wait(cfg.timeout + 10)
        settled = self._settle(monitor)
        rec.emit("settled", t0=time.monotonic(), active=settled)
        if settled is None:
            self.say("the pair did not settle on one active server in "
                     f"{SETTLE_LIMIT:g} s; reading the final state anyway")
        try:
            final = self._final()
        except CloneError as exc:  # no verdict on lost writes; the run fails (report.py)
            self.say(f"could not read the final state: {exc}")
            rec.emit("final_error", t0=time.monotonic(), what=str(exc))
        else:
            rec.emit("final", t0=time.monotonic(), state=final)
        rec.close()
        self.say("stopping the pair")
        self.group.stop_all()
        merged = merge(self.hist_dir, self.out / "history.jsonl")
        from clone.tools.chaos.report import judge_dir

        self.say(f"history: {merged} records in {self.out / 'history.jsonl'}")
        return judge_dir(self.out)

    def _start(self, names: list[str]) -> float:
        """Wait until every client has synced (its ``.ready`` file; at most
        :data:`READY_LIMIT` s, then without the late ones), then give them
        the run's start, half a second from now, and end: the start file."""
        deadline = time.monotonic() + READY_LIMIT

        def waiting() -> list[str]:  # not ready yet, and still running
            return [w for w in names if not (self.hist_dir / f"{w}.ready").exists()
                    and self.workers[w].alive]

        while waiting() and time.monotonic() < deadline:
            time.sleep(0.02)
        late = [w for w in names if not (self.hist_dir / f"{w}.ready").exists()]
        if late:
            self.say(f"clients not synced after {READY_LIMIT:g} s: {', '.join(late)}; "
                     "starting without them")
        t0 = time.monotonic() + 0.5
        tmp = self.start_file.with_suffix(".tmp")
        tmp.write_text(f"{t0!r} {t0 + self.cfg.duration!r}\n")
        tmp.replace(self.start_file)
        return t0

    def _settle(self, monitor: HugzMonitor) -> str | None:
        """Wait until one server alone has been active for a few heartbeats (a
        split brain's heal waits for TCP's backed-off retransmits, up to about
        the cut's length), so that the final state is the settled pair's."""
        alone = 8 * self.cfg.heartbeat
        # The monitor keeps every HUGZ it heard: a pair settled during the
        # quiet end of the traffic (no fault in its last QUIET_END seconds)
        # needs no more waiting, where the loop below waited 8 more heartbeats.
        if self.nemesis is not None:
            self.nemesis.supervise(time.monotonic())
        settled = _alone_throughout(monitor, alone)
        if settled is not None:
            return settled
        deadline = time.monotonic() + SETTLE_LIMIT
        alone_since, who = None, None
        while time.monotonic() < deadline:
            if self.nemesis is not None:
                self.nemesis.supervise(time.monotonic())
            active = monitor.active()
            if len(active) == 1 and active[0] == who and alone_since is not None:
                if time.monotonic() - alone_since >= alone:
                    return who
            elif len(active) == 1:
                alone_since, who = time.monotonic(), active[0]
            else:
                alone_since, who = None, None
            time.sleep(0.05)
        return None

    def _final(self) -> dict[str, list[Any]]:
        """The active server's ``/chaos/`` state: key -> [sequence, value]."""
        from clone import Clone

        with Clone([a.endpoint for a in self.addr.values()], subtree=CHAOS_PREFIX,
                   heartbeat=self.cfg.heartbeat) as c:
            c.wait_synced(timeout=30)
            return {e.key: [e.sequence, (e.value or b"").decode()]
                    for e in c.entries(CHAOS_PREFIX)}


def _alone_throughout(monitor: HugzMonitor, seconds: float, step: float = 0.05) -> str | None:
    """The server that the monitor's record shows alone active at every moment
    (``step`` apart) of the last ``seconds``, or None."""
    now = time.time()
    seen = {tuple(monitor.active(now - i * step)) for i in range(int(seconds / step) + 1)}
    if len(seen) == 1:
        (names,) = seen
        if len(names) == 1:
            return names[0]
    return None


def merge(records: Path, into: Path) -> int:
    """Every process's records, one history sorted by invoke time."""
    rows = []
    for path in sorted(records.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: a torn line (a process killed while writing): %r", path, line)
    rows.sort(key=lambda r: (r.get("t0", 0.0), r.get("t1", 0.0)))
    with open(into, "w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return len(rows)


def run_chaos(cfg: ChaosConfig, say: Say) -> dict[str, Any]:
    """One chaos run; returns the verdict (``verdict.json``)."""
    return ChaosRun(cfg, say).run()
