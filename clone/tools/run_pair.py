"""``scripts/run``: keep a local primary+backup pair serving, in the foreground.

How this works: the supervisor starts both ``clone-server`` processes and then
sleeps on a self-pipe that the signal module writes to (``signal.set_wakeup_fd``)
for SIGCHLD, SIGINT, SIGTERM and SIGHUP.  It wakes only when a child changed
state, when a stop was asked for, or when a restart is due, so it never polls.

* A server that dies (a crash, ``kill -9``, an OOM kill, even a clean exit) is
  restarted after a back-off: 0.5 s, doubling up to 10 s for a server that keeps
  dying, back to 0.5 s once a run lasted 30 s.  The other one is left alone:
  Binary Star is built for exactly this, the survivor takes over on the next
  client vote and the restarted server comes back as the passive one.
* SIGINT (Ctrl-C), SIGTERM or SIGHUP to the supervisor stops both (the signal is
  forwarded; SIGHUP is forwarded as SIGTERM), waits up to 10 s, SIGKILLs what is
  left, and exits 0.  A second stop signal while stopping kills at once.
* A server that exits with status 2 was given flags it refuses; restarting it
  cannot help, so the supervisor stops the other one and exits 2 too.  The
  flags are checked before anything starts, so this is only a safety net.

Ports: without ``--port``, the ZeroMQ Guide's pair (primary CHP 5556-5558 and
Binary Star 5003, backup 5566-5568 and 5004), which the Guide's clients and
``clone``'s defaults expect.  With ``--port P``: primary CHP P..P+2 and Binary
Star P+3, backup CHP P+10..P+12 and Binary Star P+13 (docs/operations.md).

The pure parts (the port plan, the server command lines, the back-off) are
separate from :class:`PairSupervisor`, which does the process work.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from clone.wire.protocol import (
    DEFAULT_BACKUP_HA_PORT,
    DEFAULT_BACKUP_PORT,
    DEFAULT_PRIMARY_HA_PORT,
    DEFAULT_PRIMARY_PORT,
)

__all__ = [
    "BACKUP_OFFSET",
    "HA_OFFSET",
    "Backoff",
    "PairPorts",
    "PairSupervisor",
    "RestartPolicy",
    "main",
    "server_argvs",
]

log = logging.getLogger("clone.tools.run_pair")  # not __main__ under -m

#: The backup's CHP base port is the primary's plus this (5556 -> 5566, as in the Guide).
BACKUP_OFFSET = 10
#: With ``--port``, each server's Binary Star port is its CHP base port plus this.
HA_OFFSET = 3
#: Exit status of ``clone-server`` (argparse) for flags it refuses.
_EXIT_USAGE = 2

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
# Flags the supervisor sets itself for each server; passing them through would
# give both servers the same role or the same ports.
# --data-dir too: two servers must not share one (--data-root moves both).
_OWN_FLAGS = (
    "--primary",
    "--backup",
    "--standalone",
    "--peer",
    "--peer-ha",
    "--ha-port",
    "--data-dir",
)

_LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True, slots=True)
class PairPorts:
    """The four ports of a local pair: each server's CHP base and Binary Star port."""

    primary: int
    primary_ha: int
    backup: int
    backup_ha: int

    @classmethod
    def for_base(cls, port: int | None) -> PairPorts:
        """The Guide's pair for ``None``; else the ``--port P`` scheme (module docstring)."""
        if port is None:
            return cls(
                DEFAULT_PRIMARY_PORT,
                DEFAULT_PRIMARY_HA_PORT,
                DEFAULT_BACKUP_PORT,
                DEFAULT_BACKUP_HA_PORT,
            )
        top = port + BACKUP_OFFSET + HA_OFFSET
        if not 0 < port or top > 65535:
            raise ValueError(
                f"--port {port}: the pair uses {port}..{top}, which must fit in 1..65535"
            )
        backup = port + BACKUP_OFFSET
        return cls(port, port + HA_OFFSET, backup, backup + HA_OFFSET)

    def describe(self, bind: str) -> dict[str, str]:
        """Where each server listens, as the banner says it."""
        return {
            "primary": f"tcp://{bind}:{self.primary}-{self.primary + 2}, "
            f"Binary Star {self.primary_ha}",
            "backup": f"tcp://{bind}:{self.backup}-{self.backup + 2}, Binary Star {self.backup_ha}",
        }


def server_argvs(
    ports: PairPorts, bind: str, extra: Sequence[str] = (), data_root: Path | None = None
) -> dict[str, list[str]]:
    """The ``clone-server`` arguments (without the program) of each server.

    Each names its peer on ``localhost``: both run on this host.  With
    ``data_root`` (and without ``--in-memory`` in ``extra``) each keeps its
    state in ``data_root/<role>-<port>``: a pair moved with ``--port`` gets its
    own directories, and a restart of the same pair finds its keys again.
    """

    def one(role: str, port: int, ha: int, peer: int, peer_ha: int) -> list[str]:
        durable = (
            ["--data-dir", str(data_root / f"{role}-{port}")]
            if data_root is not None and "--in-memory" not in extra
            else []
        )
        return [
            f"--{role}",
            "--port", str(port),
            "--ha-port", str(ha),
            "--peer", f"localhost:{peer}",
            "--peer-ha", f"localhost:{peer_ha}",
            "--bind", bind,
            *durable,
            *extra,
        ]  # fmt: skip

    return {
        "primary": one("primary", ports.primary, ports.primary_ha, ports.backup, ports.backup_ha),
        "backup": one("backup", ports.backup, ports.backup_ha, ports.primary, ports.primary_ha),
    }


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How long to wait before restarting a server that died.

    Doubling keeps a server that dies at once (a port held by something else, a
    broken install) from filling the terminal; the cap keeps a server that died
    of something passing from waiting long; ``stable_after`` forgets old deaths.
    """

    initial: float = 0.5
    factor: float = 2.0
    cap: float = 10.0
    stable_after: float = 30.0

    def __post_init__(self) -> None:
        if not (0 < self.initial <= self.cap and self.factor >= 1 and self.stable_after > 0):
            raise ValueError(f"nonsensical restart policy {self}")


class Backoff:
    """The restart delays of one server under a :class:`RestartPolicy`."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._next = policy.initial

    def delay_after(self, uptime: float) -> float:
        """The delay before restarting a server that died after ``uptime`` seconds."""
        if uptime >= self.policy.stable_after:
            self._next = self.policy.initial
        delay = self._next
        self._next = min(self.policy.cap, self._next * self.policy.factor)
        return delay


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _child_setup() -> None:  # runs in the child between fork and exec
    # A supervisor killed with -9 cannot stop its servers; the kernel does it.
    # SIGTERM, not SIGKILL: the server then closes its sockets cleanly.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class _Member:
    """One supervised server."""

    name: str
    argv: list[str]
    backoff: Backoff
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    restarts: int = 0


@dataclass
class PairSupervisor:
    """Runs the servers, restarts the ones that die, stops all on a signal.

    ``commands`` maps a name to a full command line.  :meth:`run` must be called
    from the main thread (signal handlers); it returns the exit status.
    ``on_started`` is called once, with each name's pid, after the first start
    (the banner).
    """

    commands: dict[str, list[str]]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    stop_timeout: float = 10.0
    on_started: Callable[[dict[str, int]], None] | None = None
    clock: Callable[[], float] = time.monotonic
    _members: list[_Member] = field(init=False, default_factory=list)
    _wake: socket.socket | None = field(init=False, default=None)

    def run(self) -> int:
        self._members = [
            _Member(n, list(a), Backoff(self.policy)) for n, a in self.commands.items()
        ]
        with self._signals_wake_us():
            try:
                for member in self._members:
                    self._start(member, restart=False)
                if self.on_started is not None:
                    self.on_started({m.name: m.popen.pid for m in self._members if m.popen})
                stop = self._supervise()
                if stop is None:  # a server refused its flags
                    self._stop_all(signal.SIGTERM)
                    return _EXIT_USAGE
                log.info("%s received: stopping both servers", stop.name)
                self._stop_all(signal.SIGTERM if stop == signal.SIGHUP else stop)
                return 0
            finally:
                self._kill_leftovers()

    # -- signals ---------------------------------------------------------------

    @contextlib.contextmanager
    def _signals_wake_us(self) -> Iterator[None]:
        """Every watched signal writes its number to a socket we can select on."""
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        watched = (signal.SIGCHLD, *_STOP_SIGNALS)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        previous = {sig: signal.signal(sig, _note_signal) for sig in watched}
        self._wake = reader
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            self._wake = None
            reader.close()
            writer.close()

    def _wait(self, timeout: float | None) -> list[signal.Signals]:
        """Sleep until a signal arrives or ``timeout`` passes; the signals seen."""
        assert self._wake is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake, selectors.EVENT_READ)
            if not sel.select(None if timeout is None else max(0.0, timeout)):
                return []
        try:
            data = self._wake.recv(4096)
        except BlockingIOError:
            return []
        return [signal.Signals(n) for n in data]

    # -- the loop --------------------------------------------------------------

    def _supervise(self) -> signal.Signals | None:
        """Restart whatever dies until a stop signal (returned); None to give up."""
        while True:
            now = self.clock()
            for member in self._members:
                popen = member.popen  # None only before the first start
                if member.restart_at is None and popen is not None and popen.poll() is not None:
                    if popen.returncode == _EXIT_USAGE:
                        log.error(
                            "%s refused its flags (exit status 2, its usage message is "
                            "above): not restarting it; stopping the pair",
                            member.name,
                        )
                        return None
                    self._schedule_restart(member, now)
                if member.restart_at is not None and now >= member.restart_at:
                    self._start(member, restart=True)
            due = [m.restart_at for m in self._members if m.restart_at is not None]
            timeout = min(due) - self.clock() if due else None
            for sig in self._wait(timeout):
                if sig in _STOP_SIGNALS:
                    return sig

    def _schedule_restart(self, member: _Member, now: float) -> None:
        assert member.popen is not None
        uptime = now - member.started_at
        delay = member.backoff.delay_after(uptime)
        member.restart_at = now + delay
        log.warning(
            "%s (pid %d) died (%s) after %.1f s; restarting it in %g s",
            member.name,
            member.popen.pid,
            _describe_exit(member.popen.returncode),
            uptime,
            delay,
        )

    def _start(self, member: _Member, *, restart: bool) -> None:
        member.restart_at = None
        member.started_at = self.clock()
        member.popen = subprocess.Popen(
            member.argv,
            stdin=subprocess.DEVNULL,
            preexec_fn=_child_setup if sys.platform.startswith("linux") else None,
        )
        if restart:
            member.restarts += 1
            log.info("%s restarted: pid %d (restart %d)", member.name, member.popen.pid,
                     member.restarts)  # fmt: skip

    # -- stopping --------------------------------------------------------------

    def _stop_all(self, sig: signal.Signals) -> None:
        """Forward ``sig``, wait up to ``stop_timeout``, then SIGKILL the rest."""
        for member in self._members:
            member.restart_at = None
            if member.popen is not None and member.popen.poll() is None:
                member.popen.send_signal(sig)
        deadline = self.clock() + self.stop_timeout
        while self._alive():
            remaining = deadline - self.clock()
            if remaining <= 0:
                log.warning("servers still running %g s after %s: killing them",
                            self.stop_timeout, sig.name)  # fmt: skip
                break
            if any(s in _STOP_SIGNALS for s in self._wait(remaining)):
                log.warning("second stop signal: killing the servers")
                break
        self._kill_leftovers()

    def _alive(self) -> list[_Member]:
        return [m for m in self._members if m.popen is not None and m.popen.poll() is None]

    def _kill_leftovers(self) -> None:
        for member in self._alive():
            assert member.popen is not None
            member.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                member.popen.wait(5)


def _note_signal(signum: int, frame: FrameType | None) -> None:
    """Nothing to do here: the wakeup socket carries the signal to the loop."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/run",
        allow_abbrev=False,  # never swallow a server flag by its prefix
        description="Run a local Clone primary+backup pair in the foreground; restart "
        "a server that dies; Ctrl-C or SIGTERM stops both.",
        epilog="Every other argument is passed to both servers (see clone-server --help), "
        "except the role and peer flags, which this script sets.",
    )
    p.add_argument(
        "--port",
        type=int,
        metavar="P",
        help="move the pair: primary CHP P..P+2 and Binary Star P+3, backup CHP "
        "P+10..P+12 and Binary Star P+13 (default: the Guide's 5556/5003 and 5566/5004)",
    )
    p.add_argument("--bind", default="*", help="interface both servers bind (default '*')")
    p.add_argument(
        "--data-root",
        type=Path,
        default=Path("clone-data"),
        metavar="DIR",
        help="each server keeps its state in DIR/<role>-<port> (default ./clone-data;"
        " scripts/run uses the checkout's git-ignored clone-data/); --in-memory keeps none",
    )
    return p


def _check_server_flags(parser: argparse.ArgumentParser, argvs: dict[str, list[str]]) -> None:
    """Refuse flags here, once, rather than restart servers that refuse them."""
    from clone.server.cli import build_parser, config_from_args

    server_parser = build_parser()
    for argv in argvs.values():
        args = server_parser.parse_args(argv)  # exits 2 with clone-server's usage
        try:
            config_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    for flag in extra:
        if flag.split("=", 1)[0] in _OWN_FLAGS:
            parser.error(
                f"{flag.split('=', 1)[0]} is set by this script for each server; use --port "
                "to move the pair, or run clone-server yourself for another layout"
            )
    try:
        ports = PairPorts.for_base(args.port)
    except ValueError as exc:
        parser.error(str(exc))
    argvs = server_argvs(ports, args.bind, extra, args.data_root.resolve())
    _check_server_flags(parser, argvs)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT, datefmt=_DATE_FORMAT)

    where = ports.describe(args.bind)
    host = "127.0.0.1" if args.bind in ("*", "0.0.0.0") else args.bind

    def banner(pids: dict[str, int]) -> None:
        log.info(
            "primary (pid %d) on %s; backup (pid %d) on %s; "
            "a server that dies is restarted; Ctrl-C or SIGTERM stops both",
            pids["primary"], where["primary"], pids["backup"], where["backup"],
        )  # fmt: skip
        log.info("clients: --servers tcp://%s:%d,tcp://%s:%d",
                 host, ports.primary, host, ports.backup)  # fmt: skip

    server = [sys.executable, "-m", "clone.server.cli"]
    supervisor = PairSupervisor(
        {name: [*server, *a] for name, a in argvs.items()}, on_started=banner
    )
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
