"""Real ``clone-server`` processes for end-to-end tests.

Usage: declare the fixture in your test module (or list ``"tests.support.servers"`` in
the root conftest's ``pytest_plugins`` to get the ``servers`` fixture below)::

    from tests.support.servers import Servers, server_pool

    @pytest.fixture
    def servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
        with server_pool(tmp_path, request) as pool:
            yield pool

    def test_something(servers: Servers) -> None:
        primary, backup = servers.pair()          # both up; primary active, backup synced
        solo = servers.standalone()               # one server, active at once
        primary.kill9(); primary.restart()        # fault injection
        primary.wait_log("synced from")           # observe what a server did

API
---
:class:`Servers` (the ``servers`` fixture) starts processes on free loopback
ports, each logging (``--verbose``) to a file under the test's tmp dir, and
kills every one of them at teardown.  A server is forked from a process that
has imported the server already (tests/support/zygote.py; a sixth of the
suite's CPU was imports), unless it has an environment of its own or
``CLONE_TEST_FORK_SERVERS=0``.  When the test failed, teardown prints
every server's log (pytest shows it under "Captured stderr teardown").

* ``servers.standalone(*extra_args) -> ServerProcess`` -- waits until it answers
  a raw ICANHAZ?.
* ``servers.pair(*extra_args, wait=True) -> (primary, backup)`` -- waits until
  the primary serves and the backup has synced from it.
* ``env=`` on ``standalone``/``spawn`` (a dict) and ``pair`` (a dict by role,
  ``{"backup": {...}}``) adds variables to a server's environment (e.g.
  libfaketime's, to step its wall clock).
* ``servers.spawn(name, args, port, ha_port) -> ServerProcess`` -- any other
  command line (e.g. a server paired with a fake peer), tracked for teardown.
* ``standalone()`` and ``pair()`` start again on other ports (up to three
  tries) when a server found a port it was given taken by another process
  meanwhile ("Address already in use"; with ``wait`` only).
* ``module_servers`` is the same, shared by the tests of one module (see
  its docstring for when a test may share a server).
* ``servers.heartbeat_ms`` -- the ``--heartbeat`` given to every server (default
  100, so failover tests take a fraction of a second per heartbeat).
* Durable by default, as ``clone-server`` is: each server of ``standalone()`` and
  ``pair()`` keeps its state in ``<tmp>/<name>.data`` (kept across ``restart()``)
  and waits ``--peer-wait 0.5`` for a peer it has never heard; pass
  ``--in-memory`` or your own ``--data-dir``/``--peer-wait`` in ``extra`` to change
  that.  ``servers.data_dir(name)`` is where a server's state lives.

:class:`ServerProcess`:

* ``port`` (CHP base P), ``ha_port``, ``name``, ``log_path``, ``pid``, ``args``,
  ``starts``, ``proc`` (the current ``Popen``), ``process`` (the underlying
  :class:`clone.tools.procs.ManagedProcess`, shared with the drills);
* ``start()``, ``restart()`` (same ports, same args), ``terminate(timeout) ->
  returncode`` (SIGTERM, then SIGKILL), ``kill9()``, ``sigstop()``,
  ``sigcont()``, ``signal(sig)``, ``alive``;
* ``wait_serving(timeout)`` -- a raw ICANHAZ? answered by KTHXBAI;
* ``wait_log(text, timeout, after=0) -> int`` -- wait until ``text`` appears in
  the log (optionally only after byte offset ``after``; returns the offset just
  past the match); ``log_text()``; ``log_size()``.  Each start appends a
  ``=== HH:MM:SS start #N: <command line>`` line to the log.

Durability helpers (module functions):

* ``read_stats(server) -> dict`` -- SIGUSR1, then the parsed ``stats: {json}`` line;
* ``log_line(server, text, after=0) -> str`` -- the first log line with ``text``;
* ``set_arg(server, flag, value)`` -- change a flag for the next ``start()``;
* ``start_both(a, b) -> (active, passive)`` -- start two stopped servers of a
  pair together; back once one is ACTIVE and the other has synced from it.

Roles, as the servers report them (``STATUS?``: read-only, no vote, no signal):

* ``server_role(server) -> str | None`` -- ``"active"``, ``"passive"``,
  ``"starting"``..., None if it did not answer;
* ``wait_role(server, role)`` -- until it reports ``role``;
* ``active_and_passive(a, b) -> (active, passive)`` -- until one reports
  active and the other passive.

Wait for a role rather than for a "now ACTIVE" line after an offset: on a
busy machine both servers of a pair can starve past its expiry (4 x 100 ms
here), one takes a client's vote and wins the split brain, and its line is
written before the offset a test takes for a takeover it expects later, or
the roles a test assumed are swapped (docs/failover.md, "Fast failover on a
lost connection").

Every wait has a deadline and raises ``TimeoutError`` with the log tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import zmq

from clone.client.status import query_status
from clone.tools.procs import ManagedProcess, python_module_argv
from tests.support.ports import free_base_port, free_port
from tests.support.zygote import MODULES, SERVER, Zygote

__all__ = [
    "ROOT",
    "STEADY_MISSED",
    "ServerProcess",
    "Servers",
    "active_and_passive",
    "answers_icanhaz",
    "log_line",
    "module_servers",
    "read_stats",
    "server_pool",
    "server_role",
    "servers",
    "set_arg",
    "start_both",
    "wait_role",
]

ROOT = Path(__file__).resolve().parents[2]
_T = TypeVar("_T")
DEFAULT_HEARTBEAT_MS = 100
#: The default ceiling of every wait here (a log line, serving, stats): it only
#: bounds a hang.  On a machine kept busy, a server took 10 s from exec to its
#: first log line (the load check); an idle one takes well under 1 s.
WAIT = 60.0
#: ``--missed`` for a pair whose roles a test assumes until it kills a server:
#: 5 s of silence at the 100 ms heartbeat before the passive may take a vote.
#: At the default 4 (400 ms) both servers waiting over 500 ms for a CPU under
#: load made the passive take a client's vote and win the split brain, and a
#: metrics test found its counters on the other server.  A killed server is
#: still noticed at once (fast failover on the lost connection).
STEADY_MISSED = ("--missed", "50")
#: ``0`` starts every server with ``python -m clone.server.cli`` (an exec), not
#: forked from the zygote (tests/support/zygote.py): to check that a failure
#: is not the fork's.
FORK_SERVERS_ENV = "CLONE_TEST_FORK_SERVERS"

_zygotes: list[Zygote] = []  # this pytest process's one zygote, once made


def _zygote() -> Zygote | None:
    """The zygote to fork a server from now, or None (start it by exec)."""
    if os.environ.get(FORK_SERVERS_ENV, "1") == "0":
        return None
    if not _zygotes:
        _zygotes.append(Zygote(ROOT, os.environ))
    zygote = _zygotes[0]
    return zygote if zygote.usable() else None


def pytest_unconfigure(config: pytest.Config) -> None:
    """End the zygote with the session (its servers were stopped by then).

    Only the outermost session's end: a session run *inside* this process
    (pytester's ``runpytest_inprocess``, tests/test_markers.py) ends too, and
    used to put every later start of this worker back to exec and close its
    zygote (``test_a_drill_client_is_forked…`` failed after it, ``-n 0``)."""
    if config in _sessions:
        _sessions.remove(config)
    if _sessions:
        return
    ManagedProcess._launch = _exec_launch  # type: ignore[method-assign]
    while _zygotes:
        _zygotes.pop().close()


#: Variables read when an interpreter starts (or by the dynamic loader), which
#: a fork cannot apply: a process asking for other values than the zygote's
#: is exec'd.  ``PYTHONPATH`` is checked apart: a subset of the zygote's is fine.
_START_ONLY = ("LD_", "PYTHON")
_APPLIED_IN_THE_CHILD = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH"})


def _fork_applies(env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a process with ``env`` behaves the same forked from the
    zygote (started with ``zygote_env``) as exec'd."""
    for key in set(env) | set(zygote_env):
        if key.startswith(_START_ONLY) and key not in _APPLIED_IN_THE_CHILD:
            if env.get(key) != zygote_env.get(key):
                return False
    wanted = set(filter(None, env.get("PYTHONPATH", "").split(os.pathsep)))
    held = set(filter(None, zygote_env.get("PYTHONPATH", "").split(os.pathsep)))
    return wanted <= held | {str(ROOT)}


def fork_or_exec(proc: ManagedProcess, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """A child of the zygote for ``proc`` when its command is ``python -m``
    one of the zygote's modules and nothing about it needs an exec (its own
    session, libfaketime, another interpreter or code path); else None.

    The drills, benches and chaos runs the suite runs in-process start their
    servers and drill clients through :class:`ManagedProcess`: this is how
    they are forked too (this module's ``pytest_configure``)."""
    argv = proc.argv
    if argv[:1] == [_CONSOLE_SERVER]:  # the drills' servers: this venv's console script
        module, args = SERVER, argv[1:]
    elif len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in MODULES:
        module, args = argv[2], argv[3:]
    else:
        return None
    if proc.own_session:
        return None
    zygote = _zygote()
    if zygote is None or not _fork_applies(env, zygote.env):
        return None
    return zygote.spawn(args, proc.log_path, env, proc.cwd, module=module)


_exec_launch = ManagedProcess._launch
#: ``clone-server`` beside this interpreter: ``clone.server.cli:main``.
_CONSOLE_SERVER = str(Path(sys.executable).with_name("clone-server"))


def _launch_forked_when_possible(
    self: ManagedProcess, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    forked = fork_or_exec(self, env)
    return forked if forked is not None else _exec_launch(self, env)


def pytest_configure(config: pytest.Config) -> None:
    """Every :class:`ManagedProcess` this pytest process starts (a drill's
    servers and clients, a bench's servers) is forked from the zygote when it
    can be (:func:`fork_or_exec`): a drill client's imports were 0.6 CPU-s of
    a short life, and the drills start hundreds.  The product's tools still
    exec (scripts/drill, scripts/bench); ``CLONE_TEST_FORK_SERVERS=0`` execs
    here too.  For the session, not a fixture: an autouse fixture reaching
    the zygote would make every test look like one that starts processes
    (tests/support/markers.py reads the fixtures' code)."""
    _sessions.append(config)
    ManagedProcess._launch = _launch_forked_when_possible  # type: ignore[method-assign]


#: The sessions configured in this process, outermost first (see pytest_unconfigure).
_sessions: list[pytest.Config] = []


@dataclass(eq=False)
class _ServerManagedProcess(ManagedProcess):
    """A :class:`ManagedProcess` that forks its server from the zygote when
    it can (``fork_args``: the server's arguments; None: always exec).  The
    fork goes through :func:`fork_or_exec`, the one path every forked process
    of the suite takes, so its rules (the command, the session, the
    environment) are checked in one place."""

    fork_args: list[str] | None = None

    def _launch(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        if self.fork_args is None:
            return _exec_launch(self, env)  # ServerProcess decided: not the patched one
        forked = fork_or_exec(self, env)
        return forked if forked is not None else _exec_launch(self, env)


class ServerProcess:
    """One ``clone-server`` process, restartable on the same ports.

    The process work (log file, signals, stop with a timeout, waiting on the
    log) is a :class:`clone.tools.procs.ManagedProcess`, the one the drills and
    benchmarks use; this adds the ports, the test's command line and
    :meth:`wait_serving`.
    """

    def __init__(
        self,
        name: str,
        args: list[str],
        port: int,
        ha_port: int | None,
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.args = args
        self.port = port
        self.ha_port = ha_port
        # A server with an environment of its own is exec'd: only an exec
        # applies libfaketime's LD_PRELOAD (tests/support/zygote.py).
        self._forkable = not env
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        self.process = _ServerManagedProcess(
            name, self._argv(), log_dir / f"{name}.log", env, cwd=ROOT
        )

    def __repr__(self) -> str:
        return f"<ServerProcess {self.name} port {self.port} pid {self.pid}>"

    def _argv(self) -> list[str]:
        return python_module_argv("clone.server.cli", *self.args)

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The current ``Popen`` (None before the first start)."""
        return self.process.popen

    @property
    def pid(self) -> int | None:
        return self.process.popen.pid if self.process.popen else None

    @property
    def starts(self) -> int:
        """How many times it was started (the log's ``start #N`` markers)."""
        return self.process.starts

    @property
    def alive(self) -> bool:
        return self.process.alive

    def start(self) -> None:
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits: a server
        # (re)started from a test's worker thread must outlive that thread.
        self.process.die_with_parent = threading.current_thread() is threading.main_thread()
        self.process.argv = self._argv()  # ``args`` may have been changed
        # Forked only when the command is the server of this checkout (a
        # subclass may run another release's, tests/tools/test_drill_upgrade.py).
        own = self.process.argv == python_module_argv("clone.server.cli", *self.args)
        self.process.fork_args = list(self.args) if self._forkable and own else None
        self.process.start()

    def restart(self) -> None:
        """Stop (if running) and start again with the same ports and flags."""
        if self.alive:
            self.terminate()
        self.start()

    def signal(self, sig: int) -> None:
        self.process.signal(sig)

    def kill9(self) -> None:
        """SIGKILL and reap: the crash case (no goodbye to anybody)."""
        self.process.kill9()

    def sigstop(self) -> None:
        """Freeze the process (a hung server: sockets stay open, nothing answers)."""
        self.process.freeze()

    def sigcont(self) -> None:
        self.process.thaw()

    def terminate(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (after SIGCONT), wait, SIGKILL if needed; the exit code."""
        # SIGCONT even if not frozen through sigstop(): a test may have sent
        # SIGSTOP with signal().
        self.process.thaw()
        return self.process.stop(timeout)

    # -- observing ------------------------------------------------------------

    def log_text(self) -> str:
        return self.process.log_text()

    def log_size(self) -> int:
        return self.process.log_size()

    def wait_log(self, text: str, timeout: float = WAIT, *, after: int = 0) -> int:
        return self.process.wait_log(text, timeout, after=after)

    def wait_serving(self, timeout: float = WAIT) -> None:
        """Until a raw ICANHAZ? is answered (which is also a Binary Star vote)."""

        def still_running() -> None:
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                tail = self.log_text()[-3000:]
                raise RuntimeError(f"{self.name} exited with {code}:\n{tail}")

        if not answers_icanhaz(self.port, timeout, b"/--wait-serving--/", still_running):
            raise TimeoutError(
                f"{self.name} not serving after {timeout} s; log tail:\n{self.log_text()[-3000:]}"
            )


class Servers:
    """Starts servers for one test and stops every one of them afterwards."""

    def __init__(self, log_dir: Path, heartbeat_ms: int = DEFAULT_HEARTBEAT_MS) -> None:
        self.log_dir = log_dir
        self.heartbeat_ms = heartbeat_ms
        self.started: list[ServerProcess] = []

    def spawn(
        self,
        name: str,
        args: list[str],
        port: int,
        ha_port: int | None,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        """Start ``clone-server *args`` (ports as given, ``env`` added to ours),
        tracked for teardown."""
        server = ServerProcess(name, args, port, ha_port, self.log_dir, env)
        self.started.append(server)
        server.start()
        return server

    def _common(self) -> list[str]:
        return ["--bind", "127.0.0.1", "--heartbeat", str(self.heartbeat_ms), "--verbose"]

    def data_dir(self, name: str) -> Path:
        """Where the server called ``name`` keeps its state (durable mode)."""
        return self.log_dir / f"{name}.data"

    def _durable(self, name: str, extra: tuple[str, ...]) -> list[str]:
        """The data directory and start wait, unless ``extra`` says otherwise."""
        out: list[str] = []
        if "--in-memory" not in extra and "--data-dir" not in extra:
            out += ["--data-dir", str(self.data_dir(name))]
        if "--peer-wait" not in extra:
            out += ["--peer-wait", "0.5"]
        return out

    def standalone(
        self,
        *extra: str,
        name: str = "standalone",
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        def start() -> ServerProcess:
            port = free_base_port()
            args = ["--standalone", "--port", str(port), *self._common(),
                    *self._durable(name, extra), *extra]  # fmt: skip
            server = self.spawn(name, args, port, None, env)
            if wait:
                server.wait_serving()
            return server

        return self._on_free_ports(start)

    def _on_free_ports(self, start: Callable[[], _T]) -> _T:
        """``start()``, again on other ports if a server found one of its
        ports taken: a port is free when drawn, but another process on the
        machine (the other xdist worker, a drill) may bind it before the
        server does.  Only with ``wait``: the failure is seen while waiting."""
        for attempt in range(3):
            before = len(self.started)
            try:
                return start()
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
                for server in self.started[before:]:
                    server.terminate(timeout=5.0)
                del self.started[before:]
        raise AssertionError("not reached")

    def relay(self, *upstream: ServerProcess, name: str = "relay") -> ServerProcess:
        """A plain relay (``--relay``) of ``upstream``, synced and serving."""
        port = free_base_port()
        args = [
            "--relay",
            "--port", str(port),
            "--upstream", ",".join(f"127.0.0.1:{s.port}" for s in upstream),
            "--bind", "127.0.0.1",
            "--heartbeat", str(self.heartbeat_ms),
            "--verbose",
        ]  # fmt: skip
        relay = self.spawn(name, args, port, None)
        relay.wait_log("synced from")
        relay.wait_serving()
        return relay

    def pair(
        self,
        *extra: str,
        wait: bool = True,
        env: dict[str, dict[str, str]] | None = None,
    ) -> tuple[ServerProcess, ServerProcess]:
        """A primary and a backup on free ports, each pointed at the other;
        ``env`` adds variables to a server's environment, by role
        (``"primary"``, ``"backup"``)."""
        envs = env or {}

        def args(role: str, port: int, ha: int, peer: int, peer_ha: int) -> list[str]:
            return [
                f"--{role}",
                "--port", str(port),
                "--peer", f"127.0.0.1:{peer}",
                "--ha-port", str(ha),
                "--peer-ha", f"127.0.0.1:{peer_ha}",
                *self._common(),
                *self._durable(role, extra),
                *extra,
            ]  # fmt: skip

        def start() -> tuple[ServerProcess, ServerProcess]:
            p_port, b_port = free_base_port(), free_base_port()
            p_ha, b_ha = free_port(), free_port()
            p_args = args("primary", p_port, p_ha, b_port, b_ha)
            b_args = args("backup", b_port, b_ha, p_port, p_ha)
            primary = self.spawn("primary", p_args, p_port, p_ha, envs.get("primary"))
            backup = self.spawn("backup", b_args, b_port, b_ha, envs.get("backup"))
            if wait:
                # Both bound first: a server that lost a port to another
                # process exits, and the other one would wait for it in vain
                # (seen: the primary's "now ACTIVE" timed out after 60 s).
                primary.wait_log("primary server:")
                backup.wait_log("backup server:")
                primary.wait_log("now ACTIVE")
                backup.wait_log("synced from")
                primary.wait_serving()
            return primary, backup

        return self._on_free_ports(start)

    def stop_all(self, timeout: float = 5.0) -> None:
        """SIGTERM to every server at once, then wait for each (SIGKILL after
        ``timeout`` s): one after the other, a test's pair and relays took the
        sum of their exits at every teardown."""
        running = [server for server in self.started if server.alive]
        for server in running:
            server.process.thaw()  # a frozen process cannot act on SIGTERM
            server.process.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for server in running:
            if server.process.wait(max(0.0, deadline - time.monotonic())) is None:
                server.kill9()

    def dump_logs(self) -> str:
        parts = []
        for server in self.started:
            parts.append(f"===== {server.name} ({server.log_path}) =====\n{server.log_text()}")
        return "\n".join(parts)


@contextmanager
def server_pool(
    tmp_path: Path, request: pytest.FixtureRequest | None = None, **kwargs: int
) -> Iterator[Servers]:
    """A :class:`Servers` whose processes are all stopped on exit.

    With ``request``, the logs are written to stderr if the test failed.
    ``kwargs`` go to :class:`Servers` (e.g. ``heartbeat_ms=50``).
    """
    failed_before = request.session.testsfailed if request is not None else 0
    pool = Servers(tmp_path, **kwargs)
    try:
        yield pool
    finally:
        pool.stop_all()
        if request is not None and request.session.testsfailed > failed_before:
            sys.stderr.write(pool.dump_logs()[-200_000:])


@pytest.fixture
def servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
    """Real server processes; all stopped at teardown, logs dumped on failure."""
    with server_pool(tmp_path, request) as pool:
        yield pool


@pytest.fixture(scope="module")
def module_servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    """Servers shared by the tests of one module, stopped after its last test.

    A server costs about 0.2 CPU-seconds to start and stop (its Python's
    imports, mostly), which on a 2-core machine running four workers is the
    suite's time.  Only for tests that neither stop nor restart it, nor depend
    on an empty store or on sequence numbers, and that each keep to keys (and
    lock or lease names) of their own.  Under xdist a module's tests are handed
    to several workers, each of which would start its own: give them an
    ``xdist_group`` of their own too, so that one worker runs them all.
    """
    with server_pool(tmp_path_factory.mktemp("module-servers"), request) as pool:
        yield pool


def answers_icanhaz(
    port: int, timeout: float, subtree: bytes, between: Callable[[], None] | None = None
) -> bool:
    """Whether a raw ICANHAZ? to ``port`` gets a KTHXBAI within ``timeout`` s.

    Each try is a fresh DEALER, as a failing-over client does; each request is
    also a Binary Star vote for that server.  ``between`` runs before each try
    (to fail early, e.g. when the process died).
    """
    deadline = time.monotonic() + timeout
    ctx = zmq.Context()
    try:
        while time.monotonic() < deadline:
            if between is not None:
                between()
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            # Retry the connection every 10 ms, not libzmq's 100: a server that
            # binds its port just after our first try is seen at once, at
            # every one of the suite's server starts.
            dealer.setsockopt(zmq.RECONNECT_IVL, 10)
            try:
                dealer.connect(f"tcp://127.0.0.1:{port}")
                dealer.send_multipart([b"ICANHAZ?", subtree])
                while dealer.poll(200):
                    if dealer.recv_multipart()[0] == b"KTHXBAI":
                        return True
            finally:
                dealer.close(linger=0)
        return False
    finally:
        ctx.term()


# -- durability helpers ------------------------------------------------------


def read_stats(server: ServerProcess, timeout: float = WAIT) -> dict[str, object]:
    """The server's counters: SIGUSR1 makes it log a ``stats: {json}`` line."""
    offset = server.log_size()
    server.signal(signal.SIGUSR1)
    start = server.wait_log("stats: ", timeout, after=offset)
    deadline = time.monotonic() + timeout
    while True:
        with open(server.log_path, "rb") as f:
            f.seek(start)
            rest = f.read()
        end = rest.find(b"\n")
        if end >= 0:
            stats: dict[str, object] = json.loads(rest[:end])
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.name}: a truncated stats line: {rest[:200]!r}")
        time.sleep(0.01)


#: Between two ``STATUS?`` of a role wait: the servers answer 20 a second
#: (a burst of 40), and a role changes in a heartbeat (100 ms) at the soonest.
_ROLE_POLL = 0.05


def server_role(server: ServerProcess, timeout: float = 2.0) -> str | None:
    """The role ``server`` reports (``STATUS?`` to its snapshot port), None if
    it did not answer within ``timeout`` s; ``RuntimeError`` if it exited."""
    if server.proc is not None and server.proc.poll() is not None:
        raise RuntimeError(
            f"{server.name} exited with {server.proc.returncode}:\n{server.log_text()[-3000:]}"
        )
    [status] = query_status([f"tcp://127.0.0.1:{server.port}"], timeout)
    role = status["role"]
    return None if role is None else str(role)


def wait_role(server: ServerProcess, role: str, timeout: float = WAIT) -> None:
    """Until ``server`` reports ``role``; ``TimeoutError`` with its log tail."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = server_role(server, min(2.0, max(0.1, deadline - time.monotonic())))
        if last == role:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{server.name}: role {last!r}, not {role!r}, after {timeout} s; tail:\n"
                + server.log_text()[-3000:]
            )
        time.sleep(_ROLE_POLL)


def active_and_passive(
    a: ServerProcess, b: ServerProcess, timeout: float = WAIT
) -> tuple[ServerProcess, ServerProcess]:
    """``(active, passive)`` once one of the two reports active and the other
    passive, whichever way round."""
    deadline = time.monotonic() + timeout
    while True:
        roles = {s.name: server_role(s) for s in (a, b)}
        if (roles[a.name], roles[b.name]) == ("active", "passive"):
            return a, b
        if (roles[a.name], roles[b.name]) == ("passive", "active"):
            return b, a
        if time.monotonic() > deadline:
            raise TimeoutError(f"no active and passive after {timeout} s: {roles}")
        time.sleep(_ROLE_POLL)


def log_line(server: ServerProcess, text: str, *, after: int = 0) -> str:
    """The first whole log line at or past ``after`` that contains ``text``."""
    with open(server.log_path, "rb") as f:
        f.seek(after)
        for raw in f:
            line = raw.decode(errors="replace")
            if text in line:
                return line.rstrip("\n")
    raise AssertionError(f"{server.name}: no line with {text!r} past offset {after}")


def set_arg(server: ServerProcess, flag: str, value: str) -> None:
    """Set ``flag value`` in the server's command line for its next start."""
    if flag in server.args:
        server.args[server.args.index(flag) + 1] = value
    else:
        server.args += [flag, value]


def start_both(
    a: ServerProcess, b: ServerProcess, timeout: float = WAIT
) -> tuple[ServerProcess, ServerProcess]:
    """Start two stopped servers of a pair together; ``(active, passive)`` once
    one of them is ACTIVE and the other has synced from it."""
    offsets = {a.name: a.log_size(), b.name: b.log_size()}
    a.start()
    b.start()
    deadline = time.monotonic() + timeout
    while True:
        active = [s for s in (a, b) if b"now ACTIVE" in _log_from(s, offsets[s.name])]
        if len(active) == 1:
            break
        if len(active) == 2:
            raise AssertionError("both servers of the pair became ACTIVE")
        for s in (a, b):
            if not s.alive:
                raise RuntimeError(f"{s.name} exited:\n{s.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no server ACTIVE after {timeout} s")
        time.sleep(0.02)
    passive = b if active[0] is a else a
    passive.wait_log("synced from", timeout, after=offsets[passive.name])
    return active[0], passive


def _log_from(server: ServerProcess, offset: int) -> bytes:
    try:
        with open(server.log_path, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""
