"""The command ``clone lock NAME -- COMMAND`` runs: it must never outlive the lock.

How this works: the command is started in its own process group, with a
parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``), from the
main thread (the kernel sends that signal when the *thread* that forked the
child ends, not the process).  So:

* ``clone lock`` killed, even by ``kill -9``: the kernel kills the command at
  once; its lease runs out after the ttl and only then does the next waiter get
  the lock.  SIGKILL, not SIGTERM, because nobody is left to escalate if the
  command ignores SIGTERM.
* SIGTERM, SIGINT and SIGHUP sent to ``clone lock`` are forwarded to the
  command's whole group, and ``clone lock`` keeps the lock until the command
  has exited (releasing it before would make two holders).
* The lock lost while the command runs: the group gets SIGTERM, then SIGKILL
  ``kill_grace`` seconds later if anything of it still runs.
* The command exits: whatever it left running in its group is killed
  (SIGKILL) before the lock is released.  The exit is observed without
  reaping (``waitid(WNOWAIT)``), so the group id cannot have been reused yet.

* ``clone lock`` killed, the command's children too: the parent-death signal
  reaches only the command itself, so a small guard process (in a session of
  its own, ignoring SIGTERM/SIGINT/SIGHUP) holds the read end of a pipe whose
  write end only ``clone lock`` has.  When that end closes without a "done"
  (``clone lock`` died, however), the guard SIGKILLs the command's process group.

What it cannot do: a process the command started in another process group or
session (a daemon) is out of reach; a SIGKILL of the guard as well as of
``clone lock`` leaves the command's children to run.  Outside Linux there is no
parent-death signal (the guard still works).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "DEFAULT_KILL_GRACE",
    "FORWARDED_SIGNALS",
    "LOCK_TOKEN_ENV",
    "LockedCommand",
    "exit_status",
]

log = logging.getLogger(__name__)

#: Seconds between the SIGTERM sent when the lock is lost and the SIGKILL.
DEFAULT_KILL_GRACE = 2.0
#: The environment variable that hands the command its lock's fencing token.
LOCK_TOKEN_ENV = "CLONE_LOCK_TOKEN"
#: Signals ``clone lock`` passes on to the command's process group.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_PR_SET_PDEATHSIG = 1
#: How often the runner looks at the command and the lock.
_POLL = 0.05

#: The guard (see the module docstring): reads the process group id, then waits
#: for end of file; no "done" before it means ``clone lock`` died.  Self-contained
#: and run with ``-I -S``: it starts in a few ms and imports nothing of ours.
_GUARD = """
import os, signal, sys
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
line = sys.stdin.buffer.readline().strip()
if line.isdigit():
    rest = sys.stdin.buffer.read()
    if b"done" not in rest:
        try:
            os.killpg(int(line), signal.SIGKILL)
        except OSError:
            pass
"""


def exit_status(returncode: int) -> int:
    """A :class:`subprocess.Popen` return code as a shell reports it: a command
    killed by signal N (``-N``) gives ``128 + N``, any other its own code."""
    return 128 - returncode if returncode < 0 else returncode


def _child_setup() -> Callable[[], None]:
    """The function run in the forked child before ``exec``: own process group,
    and (on Linux) SIGKILL when the thread that forked it ends.

    Everything is looked up before the fork: after a fork in a threaded
    process the child should call as little as possible.
    """
    parent = os.getpid()
    prctl: Callable[..., int] | None = None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl = libc.prctl
    pdeathsig = int(signal.SIGKILL)

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, pdeathsig, 0, 0, 0)
            # The parent may have died between fork and prctl: then no signal
            # comes, and we were re-parented already.
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    return setup


class LockedCommand:
    """One command run under a lock: started, signalled as a group, stopped.

    Use from the main thread only (the parent-death signal and Python's
    signal handlers both need it).
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        kill_grace: float = DEFAULT_KILL_GRACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if kill_grace < 0:
            raise ValueError(f"kill_grace must be >= 0, got {kill_grace}")
        self._argv = list(argv)
        self._env = dict(env)
        self._kill_grace = kill_grace
        self._clock = clock
        self._proc: subprocess.Popen[bytes] | None = None
        self._guard: subprocess.Popen[bytes] | None = None
        self._exited: int | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Run it (raises OSError if it cannot be run).

        From the main thread only: the parent-death signal fires when the
        thread that forked the child ends, which for another thread could be
        long before the process does."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("LockedCommand.start() must be called from the main thread")
        try:
            self._guard = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("cannot start the guard of the command's process group: %s", exc)
        try:
            self._proc = subprocess.Popen(self._argv, env=self._env, preexec_fn=_child_setup())
        except BaseException:
            self.close()  # no group id told: the guard just exits
            raise
        self._tell_guard(b"%d\n" % self._proc.pid)

    def close(self) -> None:
        """Tell the guard all is done (the command and its group are gone)."""
        guard, self._guard = self._guard, None
        if guard is None:
            return
        if self._exited is not None:
            self._tell_guard(b"done\n", guard)
        try:
            if guard.stdin is not None:
                guard.stdin.close()
        except OSError:
            pass
        try:
            guard.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait()

    def _tell_guard(self, data: bytes, guard: subprocess.Popen[bytes] | None = None) -> None:
        guard = guard or self._guard
        if guard is None or guard.stdin is None:
            return
        try:
            guard.stdin.write(data)
            guard.stdin.flush()
        except OSError as exc:  # the guard died: the parent-death signal is left
            log.warning("the guard of the command's process group is gone: %s", exc)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the command's process group (nothing if it is gone)."""
        if self._proc is None or self._exited is not None:
            return
        try:
            os.killpg(self._proc.pid, signum)
        except ProcessLookupError:
            pass

    def poll(self) -> int | None:
        """The command's shell exit status once it has exited, else None.

        Seen without reaping first, so that what it left in its group can be
        killed while the group id still belongs to it; then reaped.
        """
        proc = self._proc
        if proc is None:
            raise RuntimeError("start() first")
        if self._exited is not None:
            return self._exited
        try:
            seen = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere: Popen knows its code
            proc.poll()
            seen = None
        if seen is None and proc.returncode is None:
            return None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the command left behind
        except (ProcessLookupError, PermissionError):
            pass
        self._exited = exit_status(proc.wait())
        return self._exited

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the exit (at most ``timeout`` s); its status, or None."""
        deadline = None if timeout is None else self._clock() + timeout
        while (status := self.poll()) is None:
            if deadline is not None and self._clock() >= deadline:
                return None
            time.sleep(_POLL)
        return status

    def stop(self) -> int:
        """SIGTERM to the group, SIGKILL ``kill_grace`` s later; its exit status."""
        self.signal_group(signal.SIGTERM)
        status = self.wait(self._kill_grace)
        if status is not None:
            return status
        log.warning("command still running %.3g s after SIGTERM; sending SIGKILL", self._kill_grace)
        self.signal_group(signal.SIGKILL)
        status = self.wait()
        assert status is not None
        return status
