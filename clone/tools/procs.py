"""Child processes for drills and benchmarks: start, signal, stop, and their logs.

Every process a tool starts goes through a :class:`ProcessGroup`, which stops all
of them on exit, on failure too.  Each child writes stdout and stderr to its own
log file (appended across restarts, with a marker line), so a failed drill can
show what the servers said.  On Linux each child also gets ``PR_SET_PDEATHSIG``
so that a harness killed with -9 does not leave servers behind; start children
from the main thread only (the signal fires when the *thread* that forked exits).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = [
    "ManagedProcess",
    "ProcessGroup",
    "ServerAddress",
    "free_base_port",
    "free_port",
    "pid_alive",
    "port_is_free",
    "port_range",
    "python_module_argv",
    "server_argv",
    "wait_listening",
]

log = logging.getLogger(__name__)

_handed_out: set[int] = set()
_PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts: signal 0 is
    refused, not unanswered)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


#: Where free ports are drawn: below the usual ephemeral range (32768+).
PORT_RANGE = (20000, 32000)


def port_range() -> tuple[int, int]:
    """``[low, high)`` to draw ports from: ``$CLONE_PORT_RANGE`` (``LOW-HIGH``)
    if set, else :data:`PORT_RANGE`.  Processes that draw at the same time (a
    parallel test suite's workers, and the servers and drills they start,
    which inherit it) each get a range of their own, so that one cannot take
    a port another found free before its server binds it."""
    text = os.environ.get("CLONE_PORT_RANGE", "")
    low_text, _, high_text = text.partition("-")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        return PORT_RANGE
    if not 1024 <= low < high - 8 <= 65535:
        return PORT_RANGE
    return low, high


def free_port() -> int:
    """A free TCP port on 127.0.0.1, never handed out twice by this process."""
    return free_base_port(1)


def free_base_port(span: int = 3, rng: random.Random | None = None) -> int:
    """A base port P with P .. P+span-1 all free on 127.0.0.1.

    Drawn below the usual ephemeral range (32768+) so that outgoing connections
    cannot take the run between this check and the server's bind.
    """
    rng = rng or random.Random()
    low, high = port_range()
    for _ in range(2000):
        base = rng.randrange(low, high - span)
        run = range(base, base + span)
        if any(p in _handed_out for p in run):
            continue
        if all(port_is_free(p) for p in run):
            _handed_out.update(run)
            return base
    raise RuntimeError("no free run of loopback ports found")


def wait_listening(port: int, deadline: float, host: str = "127.0.0.1") -> bool:
    """Wait until something accepts TCP connections on ``port`` (monotonic deadline)."""
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            try:
                s.connect((host, port))
                return True
            except OSError:
                pass
        time.sleep(0.02)
    return False


_prctl: Callable[..., int] | None = None


def _load_prctl() -> None:
    """Resolve ``prctl`` in the parent, so the child does no ``dlopen`` after fork
    (another thread of a threaded parent may hold the loader's lock)."""
    global _prctl
    if _prctl is None:
        with contextlib.suppress(Exception):
            _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl


def _set_pdeathsig(sig: int) -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(sig))


def with_pdeathsig(
    argv: list[str], sig: signal.Signals = signal.SIGKILL
) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` made to die with us: through util-linux's ``setpriv``, else a
    ``preexec_fn``.

    ``setpriv`` first: a ``preexec_fn`` runs Python in the child between fork
    and exec, which the ``subprocess`` docs call unsafe in a threaded parent
    (the suite's workers run client and zmq threads); a child stuck there
    leaves ``Popen`` waiting for its exec forever (a CI run's test hung past
    its 180 s timeout while starting a server).  ``setpriv`` sets the signal
    and execs, so the pid is the program's own.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", sig.name.removeprefix("SIG"), "--", *argv], None
    _load_prctl()
    return argv, functools.partial(_set_pdeathsig, sig)


def python_module_argv(module: str, *args: str) -> list[str]:
    """``python -m module args`` with the interpreter running this tool."""
    return [sys.executable, "-m", module, *args]


@dataclass(frozen=True, slots=True)
class ServerAddress:
    """Where one server of a pair listens: CHP base port, Binary Star port, and the
    address it binds (the peer reaches it there too; loopback unless the server
    runs in a network namespace of its own)."""

    name: str
    port: int
    ha_port: int = 0
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def _server_command() -> list[str]:
    exe = Path(sys.executable).with_name("clone-server")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("clone-server")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from clone.server.cli import main; sys.exit(main())"]


def server_argv(
    role: str,
    me: ServerAddress,
    peer: ServerAddress | None = None,
    *,
    heartbeat_ms: int | None = None,
    data_dir: Path | None = None,
    extra: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> list[str]:
    """The command line of one ``clone-server`` (role: standalone, primary, backup).

    ``command``: the server executable to run (another release's, say); default
    the one beside this interpreter.

    ``data_dir``: where it keeps its state; None runs it ``--in-memory``.  It binds
    ``me.host`` and reaches its peer at ``peer.host`` (both loopback by default).
    """
    if role not in ("standalone", "primary", "backup"):
        raise ValueError(f"unknown server role {role!r}")
    exe = _server_command() if command is None else list(command)
    argv = [*exe, f"--{role}", "--port", str(me.port), "--bind", me.host]
    if role != "standalone":
        if peer is None:
            raise ValueError(f"a {role} server needs a peer")
        argv += [
            "--peer",
            f"{peer.host}:{peer.port}",
            "--ha-port",
            str(me.ha_port),
            "--peer-ha",
            f"{peer.host}:{peer.ha_port}",
        ]
    if heartbeat_ms is not None:
        argv += ["--heartbeat", str(heartbeat_ms)]
    argv += ["--in-memory"] if data_dir is None else ["--data-dir", str(data_dir)]
    argv += list(extra)
    return argv


@dataclass
class ManagedProcess:
    """One child process with a log file; can be killed, frozen, thawed, restarted.

    ``cwd`` is the child's working directory (default: ours).  ``die_with_parent``
    sets ``PR_SET_PDEATHSIG`` on Linux; turn it off for a child started from a
    thread that may exit before the child should.  ``own_session`` starts it in
    a session of its own: with the kernel's autogroups (``sched_autogroup``)
    that is a CPU share of its own too, as a service or another host has,
    instead of a part of the drill's (whose attack processes would otherwise
    spend the servers' CPU).
    """

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    starts: int = 0
    frozen: bool = False
    cwd: Path | None = None
    die_with_parent: bool = True
    own_session: bool = False

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def start(self) -> None:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.starts += 1
        with open(self.log_path, "ab") as logf:
            stamp = time.strftime("%H:%M:%S")
            logf.write(f"=== {stamp} start #{self.starts}: {' '.join(self.argv)}\n".encode())
        self.popen = self._launch(env)
        self.frozen = False
        log.debug("started %s pid %d: %s", self.name, self.popen.pid, self.argv)

    def _launch(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Make the process, its output appended to the log.

        A hook: the test suite forks its servers from a warm parent instead
        (tests/support/servers.py); the bookkeeping in :meth:`start` is the
        same for both."""
        pdeathsig = self.die_with_parent and sys.platform.startswith("linux")
        argv = self.argv
        preexec: Callable[[], None] | None = None
        if pdeathsig:
            argv, preexec = with_pdeathsig(argv)
        with open(self.log_path, "ab") as logf:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                preexec_fn=preexec,
                start_new_session=self.own_session,
            )

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def kill9(self) -> None:
        """SIGKILL, then reap."""
        if self.popen is None:
            return
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self.frozen = False

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)
        self.frozen = False

    def stop(self, timeout: float = 3.0) -> int | None:
        """SIGTERM (thawing first), then SIGKILL after ``timeout`` seconds."""
        if self.popen is None:
            return None
        if self.alive:
            if self.frozen:
                self.thaw()
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.1fs, killing it", self.name, timeout)
                self.kill9()
        return self.popen.poll()

    def wait(self, timeout: float) -> int | None:
        """Wait for exit up to ``timeout`` seconds; the return code or None."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def restart(self, timeout: float = 3.0) -> None:
        """Stop (if running, see :meth:`stop`) and start again with the same argv."""
        if self.alive:
            self.stop(timeout)
        self.start()

    def log_text(self) -> str:
        """The whole log (every start), or "" before the first start."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_size(self) -> int:
        """The log's size in bytes: an offset for :meth:`wait_log` ``after``."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def wait_log(self, text: str, timeout: float = 10.0, *, after: int = 0) -> int:
        """Wait until ``text`` is in the log at or past byte offset ``after``.

        Returns the offset just past the match.  ``TimeoutError`` after
        ``timeout`` seconds, ``RuntimeError`` if the process exits first; both
        with the log's tail.
        """
        needle = text.encode()
        deadline = time.monotonic() + timeout
        while True:
            # Whether it had exited is read before the log, so that a line
            # written just before exiting is still found.
            exited = self.popen is not None and self.popen.poll() is not None
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(after)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            at = data.find(needle)
            if at >= 0:
                return after + at + len(needle)
            if exited:
                assert self.popen is not None
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode} while waiting for "
                    f"{text!r}; tail:\n{self._log_end()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: {text!r} not in log after {timeout} s; tail:\n" + self._log_end()
                )
            time.sleep(0.02)

    def _log_end(self, size: int = 3000) -> str:
        return self.log_text()[-size:]


class ProcessGroup:
    """Owns child processes; stops every one of them when leaving the ``with``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.procs: dict[str, ManagedProcess] = {}

    def add(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None,
        start: bool = True, own_session: bool = False,
    ) -> ManagedProcess:
        if name in self.procs:
            raise ValueError(f"a process named {name!r} already exists")
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log", env,
                              own_session=own_session)
        self.procs[name] = proc
        if start:
            proc.start()
        return proc

    def __getitem__(self, name: str) -> ManagedProcess:
        return self.procs[name]

    def __iter__(self) -> Iterator[ManagedProcess]:
        return iter(list(self.procs.values()))

    def stop_all(self, timeout: float = 3.0) -> None:
        # Thaw first: a stopped process cannot act on SIGTERM.
        for proc in self:
            if proc.frozen:
                proc.thaw()
        for proc in self:
            if proc.alive:
                proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self:
            if proc.popen is not None and proc.wait(max(0.0, deadline - time.monotonic())) is None:
                log.warning("%s ignored SIGTERM, killing it", proc.name)
                proc.kill9()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()
