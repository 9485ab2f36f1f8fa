"""Carrying out a chaos plan's faults on real processes.

Each :class:`~.schedule.Fault` has a start and an end action here: kill -9 and
restart (:class:`~clone.tools.procs.ManagedProcess`), SIGSTOP and SIGCONT, cuts
and heals with the partition drills' network (:class:`~clone.tools.drill.netns.Topology`:
servers in namespaces of their own, iptables ``DROP`` rules), a wall-clock step
through each server's libfaketime timestamp file, a full disk (a filler file in
the server's tmpfs data directory), a restart storm (SIGTERM and start, several
times).  Every fault is recorded with its times (monotonic) in the history.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from clone.tools.chaos.schedule import SERVER_FAULTS, Fault
from clone.tools.chaos.worker import Recorder
from clone.tools.drill.netns import Topology
from clone.tools.procs import ManagedProcess, pid_alive

__all__ = ["FakeClock", "Nemesis", "find_libfaketime", "sweep_faketime_segments"]

log = logging.getLogger(__name__)

_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
         "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
         "/usr/local/lib/faketime/libfaketimeMT.so.1")


def find_libfaketime() -> str | None:
    for path in (*_LIBS, *glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")):
        if os.path.exists(path):
            return path
    return None


#: What libfaketime (0.9.10, Debian 12) creates in ``/dev/shm`` for each process
#: it is preloaded into, named after that process's pid, and removes only in
#: its destructor: a server exits with ``os._exit`` and a fault kills it, so
#: neither runs it.  Seen: 2,575 pairs (21 MB of tmpfs) after a day of runs.
_SEGMENT = re.compile(r"^(?:faketime_shm|sem\.faketime_sem)_(\d+)$")


def sweep_faketime_segments(shm: Path = Path("/dev/shm")) -> int:
    """Remove libfaketime's segments whose process no longer exists (a pid in
    use again keeps its segment: a stale pair is cheaper than another's lost);
    how many files were removed.  Call it once the faketime'd processes ended."""
    try:
        names = os.listdir(shm)
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = _SEGMENT.match(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            (shm / name).unlink()
            removed += 1
    return removed


class FakeClock:
    """One server's wall-clock offset, in the libfaketime timestamp file its
    process reads (every second: ``FAKETIME_CACHE_DURATION``); monotonic time is
    left alone, as a real NTP step would."""

    def __init__(self, lib: str, path: Path) -> None:
        self.lib, self.path = lib, path
        self.set(0)

    def set(self, offset: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{offset:+.0f}\n")
        os.replace(tmp, self.path)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "LD_PRELOAD": self.lib, "FAKETIME_TIMESTAMP_FILE": str(self.path),
                "FAKETIME_CACHE_DURATION": "1", "DONT_FAKE_MONOTONIC": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


Action = Callable[[], None]
#: A server that exited on its own is restarted this long after (deploy/systemd).
RESTART_SEC = 2.0


class Nemesis:
    """Turns faults into (monotonic time, action) steps, and records them."""

    def __init__(self, servers: dict[str, ManagedProcess],
                 clients: Callable[[str], ManagedProcess | None], rec: Recorder, *,
                 topology: Topology | None, ha_ports: dict[str, int],
                 clocks: dict[str, FakeClock], data_dirs: dict[str, Path]) -> None:
        self.servers, self.clients, self.rec = servers, clients, rec
        self.topology, self.ha_ports = topology, ha_ports
        self.clocks, self.data_dirs = clocks, data_dirs
        self.current: list[str] = []  # what is in force, for the progress line
        # Servers a fault keeps down (killed, in a restart storm): the supervisor
        # leaves them alone.
        self.held_down: set[str] = set()
        self._died_at: dict[str, float] = {}

    def supervise(self, now: float) -> None:
        """Restart a server that exited on its own (a full disk stops it by design,
        docs/operations.md) ``RESTART_SEC`` after it did, as the systemd unit
        does (``Restart=on-failure``, ``RestartSec=2s``), and record it."""
        for name, proc in self.servers.items():
            if name in self.held_down or proc.alive or proc.popen is None:
                self._died_at.pop(name, None)
                continue
            died = self._died_at.setdefault(name, now)
            if now - died >= RESTART_SEC:
                self.rec.emit("supervisor", target=name, t0=now, exit=proc.returncode)
                log.info("supervisor: %s exited with %s; restarting it", name, proc.returncode)
                proc.start()
                self._died_at.pop(name, None)

    def steps(self, fault: Fault, t0: float) -> list[tuple[float, Action]]:
        """The actions of ``fault`` (its ``at`` counted from monotonic ``t0``)."""
        start, end = t0 + fault.at, t0 + fault.end
        began: dict[str, float] = {}

        def begin() -> None:
            began["t"] = time.monotonic()
            self.current.append(f"{fault.kind} {fault.target}")
            log.info("fault %s %s for %.1f s", fault.kind, fault.target, fault.duration)
            self._begin(fault)

        def finish() -> None:
            self._end(fault)
            with contextlib.suppress(ValueError):
                self.current.remove(f"{fault.kind} {fault.target}")
            self.rec.emit("fault", kind=fault.kind, target=fault.target,
                          t0=began.get("t", start), t1=time.monotonic(), params=fault.params,
                          server_fault=fault.kind in SERVER_FAULTS)

        out: list[tuple[float, Action]] = [(start, begin)]
        if fault.kind == "restart-storm":
            n = int(fault.params.get("restarts", 3))
            proc = self.servers[fault.target]
            for k in range(1, n):
                out.append((start + k * fault.duration / n, _restarter(proc)))
        out.append((end, finish))
        return out

    def _pair(self, fault: Fault) -> list[ManagedProcess]:
        if fault.target == "both":
            return list(self.servers.values())
        return [self.servers[fault.target]]

    def _begin(self, fault: Fault) -> None:
        kind = fault.kind
        if kind in ("kill", "kill-both", "restart-storm"):
            self.held_down.update(p.name for p in self._pair(fault))
        if kind in ("kill", "kill-both"):
            for p in self._pair(fault):
                p.kill9()
        elif kind == "pause-server":
            self.servers[fault.target].freeze()
        elif kind == "pause-client":
            proc = self.clients(fault.target)
            if proc is not None and proc.alive:
                proc.freeze()
        elif kind == "restart-storm":
            self.servers[fault.target].restart(3.0)
        elif kind == "clock-step":
            self.clocks[fault.target].set(float(fault.params["step_s"]))
        elif kind == "disk-full":
            fill_disk(self.data_dirs[fault.target] / "chaos-filler")
        else:
            topo = self._topology()
            if kind == "partition-pair":
                topo.cut_pair_link(self.ha_ports)
            elif kind == "partition-all":
                for name in self.servers:
                    topo.isolate(name)
            elif kind == "partition-clients":
                # The clients (and the run) are in the root namespace: drop what
                # comes from or goes to it, and nothing else (the peer still talks).
                host = topo.host_address
                topo._drop(fault.target, "INPUT", "-s", host)
                topo._drop(fault.target, "OUTPUT", "-d", host)

    def _end(self, fault: Fault) -> None:
        kind = fault.kind
        if kind in ("kill", "kill-both", "restart-storm"):
            for p in self._pair(fault):
                self.held_down.discard(p.name)
                if not p.alive:
                    p.start()
        elif kind == "pause-server":
            self.servers[fault.target].thaw()
        elif kind == "pause-client":
            proc = self.clients(fault.target)
            if proc is not None and proc.alive:
                proc.thaw()
        elif kind == "clock-step":
            self.clocks[fault.target].set(0)
        elif kind == "disk-full":
            (self.data_dirs[fault.target] / "chaos-filler").unlink(missing_ok=True)
        else:
            self._topology().heal()

    def _topology(self) -> Topology:
        if self.topology is None:
            raise RuntimeError("a partition fault needs the network namespaces")
        return self.topology


def _restarter(proc: ManagedProcess) -> Action:
    def restart() -> None:
        proc.restart(3.0)

    return restart


def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full (the disk-full
    fault; tests/storage/test_full_disk_reopen.py fills the same way)."""
    block = b"\0" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, block)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
