"""Server processes forked from one that has already imported the server.

Why: a ``clone-server`` started with ``python -m clone.server.cli`` spends
most of a short life importing: about 0.25 CPU-seconds on the 2-core machine
(121 modules of ours, pyzmq, tornado, sqlite3), against 0.04 for a server
forked from a process that holds them already and serves for a second.  The
suite starts some 600 servers, so the imports were a sixth of its CPU, and on
two cores its length is its CPU (docs/testing.md, "Tenth pass").

How: each pytest process starts, at its first server, one *zygote*
(``python -m tests.support.zygote``).  It imports the server (and what the
server imports only on demand: the HTTP port, prometheus, uuid6, tomllib),
then waits on a pipe.  For each request it forks; the child makes itself the
process the test asked for (its log file on stdout and stderr, the working
directory, the environment, default signals, ``PR_SET_PDEATHSIG``) and runs
``clone.server.cli.main`` as the console script would.  The zygote reaps its
children and writes each exit code back.  The test holds a
:class:`ForkedChild`: a ``Popen`` for what the suite asks of one (``pid``,
``poll``, ``wait``, ``returncode``, signals), so a forked server is stopped,
frozen, killed and waited for like any other.

The drills' processes are forked too: the drill client
(``clone.tools.drill.client``, 0.6 CPU-s of imports) is the other module a
child may run (:data:`MODULES`), and tests/support/servers.py makes every
:class:`~clone.tools.procs.ManagedProcess` the suite starts in-process (a
drill's servers and clients, a bench's servers) ask here first.

It is still a real server process, on real sockets, with its own pid and
signals, running the same ``main``; what it does not exercise is the
interpreter's start and the imports, which every test that runs a console
script (and scripts/drill and scripts/bench) still does.  A server with an environment of its
own (``env=``: libfaketime's ``LD_PRELOAD``, which only an ``exec`` applies)
is started the ordinary way, and so is one asked for from a thread other
than the main one before the zygote exists (``PR_SET_PDEATHSIG`` on the
zygote follows the thread that started it).

Test support, not product code: nothing in ``clone/`` knows of it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["ForkedChild", "Zygote"]

#: What the zygote imports before its first fork: the server, and the modules
#: it imports only when a flag asks (--http-port, a split heal, --config).
PRELOAD = (
    "clone.server.cli",
    "clone.tools.drill.client",
    "clone.server.http",
    "clone.server.metrics",
    "uuid6",
    "tomllib",
)
_PR_SET_PDEATHSIG = 1
#: The server's module; the drill's client is the other one the zygote forks
#: (a drill starts several per run, and restarts them).
SERVER = "clone.server.cli"
#: The modules a child may run: each has ``main()``, reading ``sys.argv``,
#: and is in :data:`PRELOAD`.
MODULES = (SERVER, "clone.tools.drill.client")


class ForkedChild(subprocess.Popen):  # type: ignore[type-arg]
    """A child of the zygote, as much of a ``Popen`` as the suite uses.

    ``Popen.__init__`` is not called (it would start a process): the exit
    code comes from the zygote, which is the parent and reaps it.
    """

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None  # type: ignore[assignment]
        self.stdin = self.stdout = self.stderr = None
        self._child_created = False  # Popen.__del__: nothing of ours to reap
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:  # as Popen: set once known
            self.returncode = self._zygote.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        pass


class Zygote:
    """The pytest side: starts the zygote on first use, asks it for children,
    and reads their exit codes (a reader thread; ``exit_code`` waits on it)."""

    def __init__(self, root: Path, env: Mapping[str, str]) -> None:
        self._root = root
        self._env = dict(env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._broken = False
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._codes: dict[int, int] = {}
        self._spawned: dict[int, int] = {}  # request number -> pid
        self._requests = 0
        self._eof = False

    @property
    def env(self) -> dict[str, str]:
        """The environment the zygote was started with (its children's
        interpreter was started with it)."""
        return dict(self._env)

    def usable(self) -> bool:
        """Whether a server may be forked now (else it is started as usual)."""
        if self._broken or not sys.platform.startswith("linux"):
            return False
        return self._proc is not None or threading.current_thread() is threading.main_thread()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None:
            return self._proc
        argv = [sys.executable, "-m", "tests.support.zygote"]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # dies with this process (the servers die with it)
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        env = {**self._env, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(self._root), self._env.get("PYTHONPATH")]))}
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=None, env=env, cwd=self._root)  # fmt: skip
        assert proc.stdout is not None
        threading.Thread(target=self._read, args=(proc.stdout,), name="zygote-reader",
                         daemon=True).start()  # fmt: skip
        self._proc = proc
        return proc

    def spawn(self, args: Sequence[str], log_path: Path, env: Mapping[str, str],
              cwd: Path | None, module: str = SERVER) -> ForkedChild:  # fmt: skip
        """A forked ``python -m module *args`` (one of :data:`MODULES`; by
        default ``clone-server``) writing to ``log_path`` (appended)."""
        if module not in MODULES:
            raise ValueError(f"the zygote forks only {MODULES}, not {module!r}")
        from tests.support.markers import refuse_in_fast_test

        refuse_in_fast_test("a fork of the zygote", f" {module!r}")
        request = {"args": list(args), "log": str(log_path), "env": dict(env),
                   "cwd": str(cwd or os.getcwd()), "module": module}  # fmt: skip
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None
            self._requests += 1
            number = self._requests
            try:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
            except OSError as exc:
                self._broken = True
                raise RuntimeError(f"the server zygote is gone: {exc}") from exc
        with self._cond:
            if not self._cond.wait_for(lambda: number in self._spawned or self._eof, 30.0):
                self._broken = True
                raise RuntimeError("the server zygote did not fork within 30 s")
            if number not in self._spawned:
                self._broken = True
                raise RuntimeError("the server zygote exited")
            pid = self._spawned.pop(number)
        return ForkedChild(self, pid, [module, *args])

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            kind, first, second = line.decode().split()
            with self._cond:
                if kind == "spawned":
                    self._spawned[int(first)] = int(second)
                else:
                    self._codes[int(first)] = int(second)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code once the zygote reaped it (a negative signal
        number for a kill, as ``Popen`` gives), waiting up to ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or self._eof, timeout)
            if pid in self._codes:
                return self._codes[pid]
            if self._eof:  # the zygote died: so did its children (pdeathsig)
                return -signal.SIGKILL
            return None

    def close(self) -> None:
        """End the zygote (its children were stopped by the tests' teardowns;
        any left die with it)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------
# The zygote process


def _child(request: dict[str, Any], keep: tuple[int, ...]) -> None:
    """In the forked child: become the server the request describes."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except OSError:
        pass
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for fd in keep:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module = request.get("module", SERVER)
    sys.argv = ["clone-server" if module == SERVER else module, *request["args"]]
    code = 1
    try:
        import importlib

        # The server's main exits itself (os._exit) once it has served; the
        # drill client's returns its exit code, as its ``__main__`` block does.
        code = importlib.import_module(module).main()
    except SystemExit as exc:  # argparse's errors, as the console script
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The zygote's loop: a request per line on stdin, ``spawned N PID`` and
    ``exit PID CODE`` lines on stdout; ends at stdin's end (the pytest
    process closed it, or died), and any child still running then dies with
    it (``PR_SET_PDEATHSIG``): every server a test left is stopped."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    requests = os.dup(0)
    replies = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pytest process decides
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    keep = (requests, replies, wake_r, wake_w)
    buffered = b""
    number = 0
    open_input = True
    children = 0
    while open_input:
        ready, _, _ = select.select([requests, wake_r], [], [], 1.0)
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if requests in ready:
            chunk = os.read(requests, 65536)
            if not chunk:
                open_input = False
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                number += 1
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), keep)
                children += 1
                os.write(replies, f"spawned {number} {pid}\n".encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children = 0
                break
            if pid == 0:
                break
            children -= 1
            os.write(replies, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    serve()
