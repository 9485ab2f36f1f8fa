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
* A server that exits with status 3 could not start (a port in use, a locked
  data directory): after ``start_attempts`` (3) such exits in a row the
  supervisor stops the other one and exits 1, repeating the server's last
  line (its error).  Each server's stderr passes through the supervisor, which
  keeps that line; a server that crashes while serving is restarted as ever.

``--http-port P`` gives the primary P and the backup P+1 (both in the banner):
the same port for both would keep one of them from starting.

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
import logging
import os
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

from clone.tools.procs import with_pdeathsig
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
#: Exit status of ``clone-server`` when it could not start (clone.server.cli).
_EXIT_START_FAILED = 3
#: Our exit status when a server could not start ``start_attempts`` times in a row.
_EXIT_GAVE_UP = 1

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
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
# The backup's HTTP port is the primary's plus this (--http-port).
HTTP_BACKUP_OFFSET = 1

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
    ports: PairPorts,
    bind: str,
    extra: Sequence[str] = (),
    data_root: Path | None = None,
    http_port: int | None = None,
) -> dict[str, list[str]]:
    """The ``clone-server`` arguments (without the program) of each server.

    Each names its peer on ``localhost``: both run on this host.  With
    ``data_root`` (and without ``--in-memory`` in ``extra``) each keeps its
    state in ``data_root/<role>-<port>``: a pair moved with ``--port`` gets its
    own directories, and a restart of the same pair finds its keys again.
    """

    def one(role: str, port: int, ha: int, peer: int, peer_ha: int) -> list[str]:
        http: list[str] = []
        if http_port is not None:
            own = http_port + (HTTP_BACKUP_OFFSET if role == "backup" else 0)
            http = ["--http-port", str(own)]
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
            *http,
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
    #: Exits with _EXIT_START_FAILED in a row (reset by any other end).
    start_failures: int = 0
    #: The last line the server wrote to stderr (its error, when it could not start).
    last_line: str = ""
    _partial: bytes = b""


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
    start_attempts: int = 3
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
                if not isinstance(stop, signal.Signals):  # refused flags, cannot start
                    self._stop_all(signal.SIGTERM)
                    return stop
                log.info("%s received: stopping both servers", stop.name)
                self._stop_all(signal.SIGTERM if stop == signal.SIGHUP else stop)
                return 0
            finally:
                self._kill_leftovers()
                for member in self._members:
                    _drain(member)

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
        """Sleep until a signal arrives or ``timeout`` passes, passing on what
        the servers write to stderr meanwhile; the signals seen."""
        assert self._wake is not None
        deadline = None if timeout is None else self.clock() + max(0.0, timeout)
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake, selectors.EVENT_READ)
            for member in self._members:
                stderr = None if member.popen is None else member.popen.stderr
                if stderr is not None and not stderr.closed:
                    sel.register(stderr, selectors.EVENT_READ, member)
            while True:
                left = None if deadline is None else max(0.0, deadline - self.clock())
                ready = sel.select(left)
                if not ready:
                    return []
                woken = False
                for key, _ in ready:
                    if key.data is None:
                        woken = True
                    elif not _relay(key.data):
                        sel.unregister(key.fileobj)
                if woken:
                    break
        try:
            data = self._wake.recv(4096)
        except BlockingIOError:
            return []
        return [signal.Signals(n) for n in data]

    # -- the loop --------------------------------------------------------------

    def _supervise(self) -> signal.Signals | int:
        """Restart whatever dies until a stop signal (returned); an exit status
        to give up with."""
        while True:
            now = self.clock()
            for member in self._members:
                popen = member.popen  # None only before the first start
                if member.restart_at is None and popen is not None and popen.poll() is not None:
                    _drain(member)
                    if popen.returncode == _EXIT_USAGE:
                        log.error(
                            "%s refused its flags (exit status 2, its usage message is "
                            "above): not restarting it; stopping the pair",
                            member.name,
                        )
                        return _EXIT_USAGE
                    if popen.returncode == _EXIT_START_FAILED:
                        member.start_failures += 1
                        if member.start_failures >= self.start_attempts:
                            log.error(
                                "%s could not start, %d times in a row: %s; stopping the pair",
                                member.name, member.start_failures,
                                member.last_line or "(it said nothing)",
                            )  # fmt: skip
                            return _EXIT_GAVE_UP
                    else:
                        member.start_failures = 0
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
        argv, preexec = member.argv, None
        if sys.platform.startswith("linux"):
            # A supervisor killed with -9 cannot stop its servers; the kernel
            # does it.  SIGTERM, not SIGKILL: the server then closes its
            # sockets cleanly.
            argv, preexec = with_pdeathsig(member.argv, signal.SIGTERM)
        member.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,  # passed on by _wait, which keeps the last line
            preexec_fn=preexec,
        )
        assert member.popen.stderr is not None
        os.set_blocking(member.popen.stderr.fileno(), False)
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


def _relay(member: _Member) -> bool:
    """Pass on what a server wrote to stderr; False at its end (closed)."""
    popen = member.popen
    assert popen is not None and popen.stderr is not None
    try:
        chunk = os.read(popen.stderr.fileno(), 65536)
    except BlockingIOError:
        return True
    except OSError:
        chunk = b""
    if not chunk:
        return False
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
    lines = (member._partial + chunk).split(b"\n")
    member._partial = lines.pop()[-65536:]
    said = [line for line in lines if line.strip()]
    if said:
        member.last_line = said[-1].decode("utf-8", "replace").strip()
    return True


def _drain(member: _Member) -> None:
    """What an exited server still had in its pipe, then close it."""
    popen = member.popen
    if popen is None or popen.stderr is None or popen.stderr.closed:
        return
    while _relay(member):
        pass
    if member._partial.strip():
        member.last_line = member._partial.decode("utf-8", "replace").strip()
        member._partial = b""
    popen.stderr.close()


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
        "--http-port",
        type=int,
        metavar="P",
        help="serve /metrics, /healthz and the status page: the primary on P, the backup "
        "on P+1 (default: none)",
    )
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
    if args.http_port is not None and not 0 < args.http_port < 65535:
        parser.error(f"--http-port {args.http_port}: the pair uses P and P+1, in 1..65535")
    argvs = server_argvs(
        ports, args.bind, extra, args.data_root.resolve(), http_port=args.http_port
    )
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
        if args.http_port is not None:
            log.info("HTTP (/metrics, /healthz, status page): primary http://%s:%d/, "
                     "backup http://%s:%d/", host, args.http_port,
                     host, args.http_port + HTTP_BACKUP_OFFSET)  # fmt: skip

    server = [sys.executable, "-m", "clone.server.cli"]
    supervisor = PairSupervisor(
        {name: [*server, *a] for name, a in argvs.items()}, on_started=banner
    )
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
