"""One attack against a fresh server pair, measured from the outside.

For each attack the harness starts a primary and a backup (data directories,
``--http-port``), a HUGZ watcher in a process of its own
(:mod:`clone.tools.hostile.watcher`: the gaps judged) and one in a thread of
the harness (:class:`~clone.tools.drill.watch.HugzMonitor`: shown beside them,
it also counts the harness's own pauses), and a healthy client doing
confirmed writes; it times a healthy sync before the attack (the baseline),
starts the attack process (:mod:`clone.tools.hostile.attacks`), waits until
it says ``ready``, holds it for ``hold`` seconds while sampling both servers'
RSS and timing a second healthy sync, stops it, checks every confirmed
write with a fresh client, and finally sends the active server SIGTERM and
times its exit.

:func:`judge` holds the issue's "done when" as a pure function of the numbers:
RSS peak at most 200 MB over its value before the attack (the store's own budget
is a fixed share of memory, so the attack is what must stay within 200 MB),
no HUGZ gap over 2 heartbeats, no failover, SIGTERM obeyed within 1 s, no
confirmed write lost, a healthy sync within twice the baseline (at least 0.25 s,
below which a busy 2-core machine's noise dominates; each the median of three
syncs, :data:`SYNC_SAMPLES`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clone import Clone
from clone.storage.files import dir_bytes
from clone.storage.lock import LOCK_FILE
from clone.tools.drill.watch import HugzMonitor
from clone.tools.hostile.watcher import WatcherProcess
from clone.tools.procs import (
    ManagedProcess,
    ProcessGroup,
    ServerAddress,
    free_base_port,
    free_port,
    python_module_argv,
    server_argv,
)
from clone.wire.protocol import DEFAULT_HEARTBEAT_MS, PUBLISHER_OFFSET

__all__ = ["HARNESS_ATTACKS", "AttackResult", "final_stats", "judge", "longest_gap", "run_attack"]

log = logging.getLogger(__name__)

#: Attacks the harness runs itself instead of an attack process.
HARNESS_ATTACKS = ("delete-lock", "memory-cgroup")
#: Attacks that leave data in the store: their baseline sync is timed once
#: the attack has stopped, of the data it left (before it, the store was empty).
STORING_ATTACKS = ("disk", "memory-cgroup")
RSS_ALLOWANCE = 200 * 1024 * 1024
SYNC_FLOOR = 0.25
#: Healthy syncs timed for each measure; their median is judged.
SYNC_SAMPLES = 3
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_V1 = _CGROUP_ROOT / "memory"


@dataclass
class AttackResult:
    """What one attack did to the pair (times in seconds, sizes in bytes)."""

    attack: str
    rss_before: dict[str, int] = field(default_factory=dict)
    rss_peak: dict[str, int] = field(default_factory=dict)
    #: The longest gap between HUGZ (from either server) the watcher process
    #: saw, and when it began (seconds after the attack started) ...
    longest_hugz_gap: float = 0.0
    hugz_gap_at: float | None = None
    #: ... and the one a thread of the harness saw (the harness's own pauses
    #: too: a healthy client's sync holds its interpreter lock).
    hugz_gap_in_harness: float = 0.0
    #: The watcher process's latest wake during the attack (seconds past its
    #: timeout): how long the host left a process that asked for no more
    #: than a few ms of CPU without any; and whether it was during the gap.
    host_wake_late: float = 0.0
    host_wake_late_in_gap: float = 0.0
    failover: bool = False
    baseline_sync: float | None = None
    #: A storing attack's sync of the empty store before it (its baseline is
    #: then the sync of the data it left, once it stopped).
    empty_store_sync: float | None = None
    sync_under_attack: float | None = None
    writes_confirmed: int = 0
    write_errors: int = 0
    write_p99: float | None = None
    confirmed_lost: int = 0
    #: The slower server's exit after SIGTERM (None: one did not exit in 5 s) ...
    sigterm_seconds: float | None = None
    #: ... and each server's.
    sigterm: dict[str, float | None] = field(default_factory=dict)
    data_dir_bytes: dict[str, int] = field(default_factory=dict)
    exited: dict[str, int | None] = field(default_factory=dict)
    #: Each server's store at the end (its stats line at SIGTERM): the data an
    #: attack that writes was allowed to keep, on top of the RSS allowance ...
    store_bytes: dict[str, int] = field(default_factory=dict)
    #: ... and the writes it refused ``full`` (``kvset_refused_full``).
    refused_full: dict[str, int] = field(default_factory=dict)
    #: memory-cgroup: each server restarted in its cgroup: None if it loaded
    #: and served, else why not.
    restart: dict[str, str | None] = field(default_factory=dict)
    note: str = ""
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(r: AttackResult, heartbeat: float) -> list[str]:
    """The issue's bar, one failure text per broken point (empty: the attack passes)."""
    out: list[str] = []
    for name, peak in r.rss_peak.items():
        before = r.rss_before.get(name, 0)
        # The store's own growth is under --max-bytes (clone.server.budget);
        # what an attack may add beyond the data it wrote is the allowance.
        if peak > before + RSS_ALLOWANCE + r.store_bytes.get(name, 0):
            out.append(f"{name} RSS {before >> 20} -> {peak >> 20} MB")
    if r.longest_hugz_gap > 2 * heartbeat:
        out.append(f"HUGZ gap {r.longest_hugz_gap:.2f} s > 2 heartbeats")
    if r.failover:
        out.append("failover")
    if r.sigterm_seconds is None or r.sigterm_seconds > 1.0:
        out.append("SIGTERM not obeyed within 1 s")
    if r.confirmed_lost:
        out.append(f"{r.confirmed_lost} confirmed writes lost")
    if r.baseline_sync is not None:
        limit = max(2 * r.baseline_sync, SYNC_FLOOR)
        if r.sync_under_attack is None or r.sync_under_attack > limit:
            got = "none" if r.sync_under_attack is None else f"{r.sync_under_attack:.2f} s"
            out.append(f"healthy sync {got} > {limit:.2f} s")
    for name, code in r.exited.items():
        if code is not None and name != "intruder":
            out.append(f"{name} exited with {code} under attack")
    for name, why in r.restart.items():
        if why is not None:
            out.append(f"{name} restart: {why}")
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _timed_sync(endpoints: list[str], timeout: float) -> float | None:
    """The median of :data:`SYNC_SAMPLES` healthy syncs, or None if one failed.

    One sync each was judged before: a 0.13 s baseline against a 0.26 s sync
    under an idle-HTTP attack failed a loaded run by 5 ms, noise a single
    sample of a fraction of a second cannot avoid on a busy 2-core machine."""
    times: list[float] = []
    for _ in range(SYNC_SAMPLES):
        took = _one_sync(endpoints, timeout)
        if took is None:
            return None
        times.append(took)
    return statistics.median(times)


def _one_sync(endpoints: list[str], timeout: float) -> float | None:
    started = time.monotonic()
    try:
        with Clone(endpoints) as client:
            client.wait_synced(timeout)
    except Exception:  # NotSynced, a refused connection: no sync
        log.debug("healthy sync failed", exc_info=True)
        return None
    return time.monotonic() - started


class _Writer:
    """The healthy client: confirmed writes at ``rate`` a second, latencies recorded."""

    def __init__(self, endpoints: list[str], rate: float) -> None:
        self.endpoints, self.rate = endpoints, rate
        self.confirmed: dict[str, bytes] = {}
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with Clone(self.endpoints, confirm_timeout=10) as client:
            client.wait_synced(30)
            i = 0
            while not self._stop.wait(1.0 / self.rate):
                key, value = f"/healthy/{i % 200}", f"v{i}".encode()
                started = time.monotonic()
                try:
                    client.set(key, value, wait=True, timeout=10)
                except Exception:
                    self.errors += 1
                else:
                    self.latencies.append(time.monotonic() - started)
                    self.confirmed[key] = value
                i += 1


def _v2_root() -> tuple[Path | None, str]:
    """A cgroup v2 hierarchy with the memory controller, or None and why not."""
    for root in (_CGROUP_ROOT, _CGROUP_ROOT / "unified"):
        try:
            controllers = (root / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "memory" in controllers:
            return root, ""
        return None, (f"cgroup v2 at {root} offers no memory controller (cgroup.controllers:"
                      f" {' '.join(controllers) or 'none'}; it is bound to the v1 hierarchy)")
    return None, "no cgroup v2 hierarchy mounted"


def _cgroup(name: str, limit: int) -> tuple[Path | None, str]:
    """A memory cgroup limited to ``limit`` bytes (v2 where it has the memory
    controller, else v1), or None where not allowed; and what was used or why not."""
    root, why_not_v2 = _v2_root()
    if root is not None:
        path = root / name
        try:
            path.mkdir(exist_ok=True)
            (path / "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        except OSError as exc:
            why_not_v2 = f"cgroup v2 at {root}: {exc}"
        else:
            return path, f"cgroup v2 {path}"
    path = _CGROUP_V1 / name
    try:
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(OSError):
            (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
    except OSError as exc:
        log.warning("no memory cgroup here (%s; %s): memory-cgroup runs unconfined",
                    why_not_v2, exc)
        return None, f"no memory cgroup: {why_not_v2}; v1: {exc}"
    return path, f"cgroup v1 {path} ({why_not_v2})"


class _Pair:
    def __init__(self, out: Path, heartbeat_ms: int, extra: list[str],
                 cgroup_limit: int | None, own_sessions: bool) -> None:  # fmt: skip
        self.out = out
        self.own_sessions = own_sessions
        self.group = ProcessGroup(out / "logs")
        self.addr = {
            "primary": ServerAddress("primary", free_base_port(3), free_port()),
            "backup": ServerAddress("backup", free_base_port(3), free_port()),
        }
        self.http = {"primary": free_port(), "backup": free_port()}
        self.heartbeat_ms = heartbeat_ms
        self.extra = extra
        self.cgroups: dict[str, Path] = {}
        self.cgroup_note = ""
        if cgroup_limit is not None:
            for name in self.addr:
                cg, self.cgroup_note = _cgroup(f"clone-hostile-{os.getpid()}-{name}",
                                               cgroup_limit)  # fmt: skip
                if cg is not None:
                    self.cgroups[name] = cg

    def argv(self, name: str) -> list[str]:
        peer = self.addr["backup" if name == "primary" else "primary"]
        argv = server_argv(
            name, self.addr[name], peer, heartbeat_ms=self.heartbeat_ms,
            data_dir=self.out / f"{name}.data",
            extra=["--http-port", str(self.http[name]), *self.extra],
        )  # fmt: skip
        cg = self.cgroups.get(name)
        if cg is not None:  # join the cgroup before exec: the limit is read at start
            argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg), *argv]
        return argv

    def start(self) -> dict[str, ManagedProcess]:
        return {name: self.group.add(name, self.argv(name), own_session=self.own_sessions)
                for name in self.addr}  # fmt: skip

    def endpoints(self) -> list[str]:
        return [self.addr[n].endpoint for n in ("primary", "backup")]

    def close(self) -> None:
        self.group.stop_all()
        for cg in self.cgroups.values():
            with contextlib.suppress(OSError):
                cg.rmdir()


def _wait_line(proc: ManagedProcess, deadline: float, *words: str) -> str | None:
    """The first of ``words`` the attack process printed on a line of its own."""
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            text = proc.log_path.read_bytes()
            for word in words:
                if f"\n{word}\n".encode() in text:
                    return word
        if not proc.alive:
            return None
        time.sleep(0.1)
    return None


def run_attack(
    attack: str, out: Path, *, hold: float, scale: float, rate: float = 20.0,
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS, say: Callable[[str], None] = print,
    own_sessions: bool = True,
) -> AttackResult:  # fmt: skip
    """Run ``attack`` against a fresh pair under ``out``; the numbers and the verdict.

    ``own_sessions``: each server, the attack and the watcher in a session of
    its own, so that (with the kernel's autogroups) each has its own CPU share
    as separate services or hosts would; else all share the drill's, and
    what the attack burns is the servers' CPU."""
    heartbeat = heartbeat_ms / 1000.0
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cgroup_limit = int(700e6) if attack == "memory-cgroup" else None
    pair = _Pair(out, heartbeat_ms, [], cgroup_limit, own_sessions)
    result = AttackResult(attack)
    try:
        procs = pair.start()
        endpoints = pair.endpoints()
        hugz = HugzMonitor(
            {n: f"tcp://127.0.0.1:{a.port + PUBLISHER_OFFSET}" for n, a in pair.addr.items()},
            heartbeat,
        )
        hugz.start()
        watcher = WatcherProcess(pair.group, {
            n: f"tcp://127.0.0.1:{a.port + PUBLISHER_OFFSET}" for n, a in pair.addr.items()},
            own_session=own_sessions)
        # The first sync also waits for the pair to elect; the second is the baseline.
        if _timed_sync(endpoints, 60) is not None:
            result.baseline_sync = _timed_sync(endpoints, 60)
        if result.baseline_sync is None:
            result.note = "the pair never synced a client"
            result.failures = ["no baseline sync"]
            return result
        writer = _Writer(endpoints, rate)
        writer.start()
        samples: dict[str, list[int]] = {n: [] for n in procs}
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.1):
                for n, p in procs.items():
                    if p.alive:
                        samples[n].append(_rss(p.pid))

        time.sleep(1.0)
        result.rss_before = {n: _rss(p.pid) for n, p in procs.items()}
        sampler = threading.Thread(target=sample, name="hostile-rss", daemon=True)
        sampler.start()
        started = time.time()
        say(f"[{attack}] attack starting")
        attacker = _start_attack(attack, pair, result, scale)
        if attacker is not None:
            deadline = time.monotonic() + 300
            if _wait_line(attacker, deadline, "loaded", "ready") == "loaded":
                # The same store without the attack: the baseline to compare with.
                loaded = _timed_sync(endpoints, 60)
                if loaded is not None:
                    result.baseline_sync = loaded
                attacker.signal(signal.SIGUSR1)
                started = time.time()  # the HUGZ gaps of the attack, not of its preload
            if _wait_line(attacker, deadline, "ready") is None:
                result.note += f" the attack never got ready (see {attacker.log_path})"
        hold_end = time.monotonic() + hold
        result.sync_under_attack = _timed_sync(endpoints, max(10.0, hold))
        time.sleep(max(0.0, hold_end - time.monotonic()))
        if attacker is not None:
            attacker.signal(signal.SIGTERM)
            if attacker.wait(5) is None:
                attacker.kill9()
        ended = time.time()
        time.sleep(1.0)
        writer.stop()
        sampling.set()
        sampler.join(5)
        if attack in STORING_ATTACKS:
            # The same data without the attack: what the sync under it is judged against
            # (none: the empty store's stays, the stricter one).
            after = _timed_sync(endpoints, 60)
            if after is not None:
                result.empty_store_sync, result.baseline_sync = result.baseline_sync, after
        result.rss_peak = {n: max(s, default=0) for n, s in samples.items()}
        result.exited = {n: p.returncode for n, p in procs.items()}
        seen = watcher.hugz_after("primary", started - 1, ended) + watcher.hugz_after(
            "backup", started - 1, ended)
        result.longest_hugz_gap, at = longest_gap(seen, started, ended)
        result.hugz_gap_at = round(at - started, 3)
        in_harness = hugz.hugz_after("primary", started - 1, ended) + hugz.hugz_after(
            "backup", started - 1, ended)
        result.hugz_gap_in_harness = longest_gap(in_harness, started, ended)[0]
        wakes = watcher.late_wakes(started, ended)
        result.host_wake_late = max((late for _, late in wakes), default=0.0)
        gap_end = at + result.longest_hugz_gap
        result.host_wake_late_in_gap = max(
            (late for ts, late in wakes if at < ts and ts - late < gap_end), default=0.0)
        result.failover = bool(hugz.hugz_after("backup", started, ended + 1)
                               or watcher.hugz_after("backup", started, ended + 1))
        hugz.stop()
        watcher.stop()
        result.writes_confirmed = len(writer.confirmed)
        result.write_errors = writer.errors
        result.write_p99 = _p99(writer.latencies)
        result.confirmed_lost = _lost(endpoints, writer.confirmed)
        result.data_dir_bytes = {n: dir_bytes(out / f"{n}.data") for n in procs}
        result.sigterm = _sigterm(procs)
        times = list(result.sigterm.values())
        result.sigterm_seconds = None if None in times or not times else max(
            t for t in times if t is not None)
        for n, p in procs.items():
            stats = final_stats(p.log_tail(400))
            result.store_bytes[n] = int(stats.get("store_bytes", 0))
            result.refused_full[n] = int(stats.get("kvset_refused_full", 0))
        if attack == "memory-cgroup":
            result.restart = _restart(procs, endpoints)
            result.note += (
                "; refused full p:{} b:{}; stored MB p:{:.0f} b:{:.0f}; restart: {}".format(
                    result.refused_full.get("primary", 0), result.refused_full.get("backup", 0),
                    result.store_bytes.get("primary", 0) / 2**20,
                    result.store_bytes.get("backup", 0) / 2**20,
                    "both loaded and served" if not any(result.restart.values()) else "FAILED",
                ))
    finally:
        pair.close()
    result.failures = judge(result, heartbeat)
    return result


def final_stats(log_text: str) -> dict[str, Any]:
    """The last ``stats: {json}`` line in a server's log (it logs one at SIGTERM)."""
    for line in reversed(log_text.splitlines()):
        at = line.find("stats: {")
        if at >= 0:
            with contextlib.suppress(ValueError):
                found: dict[str, Any] = json.loads(line[at + len("stats: "):])
                return found
    return {}


def _restart(procs: dict[str, ManagedProcess], endpoints: list[str],
             hold: float = 10.0) -> dict[str, str | None]:  # fmt: skip
    """Start both servers again (in their cgroups: the same command line) on the
    data they kept; each must load, serve a healthy sync and stay up ``hold`` s."""
    why: dict[str, str | None] = dict.fromkeys(procs)
    for p in procs.values():
        p.start()
    if _timed_sync(endpoints, 120) is None:
        for n in procs:
            why[n] = "no healthy sync within 120 s of the restart"
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and all(p.alive for p in procs.values()):
        time.sleep(0.2)
    for n, p in procs.items():
        if not p.alive:
            why[n] = f"exited {p.returncode} after the restart"
    for p in procs.values():
        p.stop(5)
    return why


def _sigterm(procs: dict[str, ManagedProcess]) -> dict[str, float | None]:
    """SIGTERM every live server at once; how long each took to exit (None: > 5 s)."""
    t = time.monotonic()
    live = {n: p for n, p in procs.items() if p.alive}
    for p in live.values():
        p.signal(signal.SIGTERM)
    took: dict[str, float | None] = dict.fromkeys(live)
    while time.monotonic() - t < 5 and any(v is None for v in took.values()):
        for n, p in live.items():
            if took[n] is None and not p.alive:
                took[n] = time.monotonic() - t
        time.sleep(0.01)
    return took


def _start_attack(
    attack: str, pair: _Pair, result: AttackResult, scale: float
) -> ManagedProcess | None:
    if attack == "delete-lock":
        data = pair.out / "primary.data"
        (data / LOCK_FILE).unlink(missing_ok=True)
        me = ServerAddress("intruder", free_base_port(3))
        intruder = pair.group.add("intruder", server_argv("standalone", me, data_dir=data))
        code = intruder.wait(60)
        refused = "in use by another process" in intruder.log_tail(80)
        result.note = (f"a second server on the primary's data directory exited {code}"
                       f"{' refusing: database in use' if refused else ' WITHOUT the refusal'}")
        if not refused:
            result.failures.append("second server not refused")
        return None
    if attack == "memory-cgroup":  # the disk attack's 512 KB writes, inside the cgroups
        result.note = (f"servers in 700 MB cgroups: {pair.cgroup_note}" if pair.cgroups
                       else f"unconfined: {pair.cgroup_note}")
        attack = "disk"
    a = pair.addr["primary"]
    return pair.group.add(f"attack-{attack}", python_module_argv(
        "clone.tools.hostile.attacks", attack, "--port", str(a.port),
        "--http-port", str(pair.http["primary"]), "--scale", str(scale),
    ), own_session=pair.own_sessions)  # fmt: skip


def longest_gap(times: list[float], start: float, end: float) -> tuple[float, float]:
    """The longest silence from ``start`` to ``end`` between the HUGZ arrival
    ``times`` (any order; those before ``start`` count as at ``start``), and
    when it began."""
    inside = sorted(t for t in times if start < t < end)
    edges = [start, *inside, end]
    gap, at = max((b - a, a) for a, b in itertools.pairwise(edges))
    return gap, at


def _lost(endpoints: list[str], confirmed: dict[str, bytes]) -> int:
    """Confirmed writes a fresh client does not see (each key's last confirmed value)."""
    if not confirmed:
        return 0
    try:
        with Clone(endpoints) as client:
            client.wait_synced(60)
            return sum(1 for k, v in confirmed.items() if client.get(k) != v)
    except Exception:
        log.warning("could not read back the confirmed writes", exc_info=True)
        return len(confirmed)
