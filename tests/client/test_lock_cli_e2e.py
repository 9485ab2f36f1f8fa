"""``clone lock NAME -- COMMAND`` as a shell user runs it: real ``clone``
processes against real servers, each running a small command that records,
in its own file, when it started and ended (``time.monotonic_ns``, one clock
for every process of the machine) and whether it got SIGTERM.

Promised (docs/client.md, "The `clone` command"): the command runs only while
the lock is held, ``clone lock`` exits with the command's exit code, and when
the lock is lost while the command runs (its lease no longer valid) the
command gets SIGTERM and ``clone lock`` exits 4 with a message.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

from clone.client.cli import EXIT_ERROR, _lock_command, _parser
from clone.client.locked import exit_status
from tests.support.clients import endpoint, synced_client
from tests.support.servers import ROOT, ServerProcess, Servers
from tests.support.waiting import eventually

NAME = "/locks/cli"

# The command run under the lock: note the start, hold, note the end, exit
# with the code given; on SIGTERM note that and exit 0 (so an exit 4 can only
# be clone's own).
_COMMAND = """\
import signal, sys, time
path, code, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

def note(word):
    with open(path, "a") as f:
        f.write(f"{word} {time.monotonic_ns()}\\n")

def on_term(signum, frame):
    note("sigterm")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
note("start")
time.sleep(hold)
note("end")
sys.exit(code)
"""


class LockRun:
    """One ``clone lock NAME --ttl TTL -- python COMMAND FILE CODE HOLD`` process."""

    def __init__(self, tmp: Path, eps: str, tag: str, code: int, hold: float, ttl: float) -> None:
        script = tmp / "command.py"
        if not script.exists():
            script.write_text(_COMMAND)
        self.notes = tmp / f"{tag}.notes"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clone.client.cli", "--heartbeat", "0.1", "--servers", eps,
             "lock", NAME, "--ttl", str(ttl), "--",
             sys.executable, str(script), str(self.notes), str(code), str(hold)],
            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip

    def noted(self) -> dict[str, int]:
        """What the command wrote: {"start": ns, "end": ns, "sigterm": ns}, as far as it got."""
        if not self.notes.exists():
            return {}
        words = (line.split() for line in self.notes.read_text().splitlines())
        return {word: int(ns) for word, ns in words}

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        """Its exit code and stderr, once it exits (within ``timeout``)."""
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err


@pytest.fixture
def runs() -> Iterator[list[LockRun]]:
    started: list[LockRun] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.communicate(timeout=10)


def test_options_after_the_name_are_the_locks_not_the_commands() -> None:
    """The documented order, ``clone lock NAME --ttl S --wait S -- COMMAND``."""
    cases = {
        ("/l", "--ttl", "1", "--wait", "2", "--", "cmd", "-x"): (1.0, 2.0, ["cmd", "-x"]),
        ("--ttl", "1", "/l", "--", "cmd", "--", "y"): (1.0, None, ["cmd", "--", "y"]),
        ("/l", "--", "cmd", "--ttl", "3"): (5.0, None, ["cmd", "--ttl", "3"]),
        ("/l", "cmd", "-x", "--", "y"): (5.0, None, ["cmd", "-x", "--", "y"]),
    }
    for argv, (ttl, wait, command) in cases.items():
        args = _parser().parse_args(["lock", *argv])
        assert _lock_command(args) == command  # first: it reads the lock's options
        assert (args.name, args.ttl, args.wait) == ("/l", ttl, wait)
    for bad in (("/l", "--ttl", "1", "cmd"), ("/l", "--bogus", "--", "cmd")):
        with pytest.raises(SystemExit) as usage:
            _lock_command(_parser().parse_args(["lock", *bad]))
        assert usage.value.code == 2


@pytest.mark.slow
def test_clone_locks_on_one_name_never_overlap_and_exit_with_their_commands_code(
    servers: Servers, runs: list[LockRun], tmp_path: Path
) -> None:
    primary, backup = servers.pair()
    eps = f"{endpoint(primary)},{endpoint(backup)}"
    codes = {"a": 0, "b": 7, "c": 9}
    # A long ttl: nobody dies here, and a busy machine delays keepalives.
    runs.extend(LockRun(tmp_path, eps, tag, code, 0.3, 10.0) for tag, code in codes.items())
    for run, code in zip(runs, codes.values(), strict=True):
        returncode, err = run.finish()
        assert (returncode, err) == (code, ""), err
    assert all(set(r.noted()) == {"start", "end"} for r in runs), [r.noted() for r in runs]
    intervals = sorted((r.noted()["start"], r.noted()["end"]) for r in runs)
    for (_, end), (start, _) in pairwise(intervals):
        assert end < start, f"two commands ran at once: {intervals}"
    with synced_client(primary, backup) as client:
        eventually(lambda: client.entries(NAME + "/") == [], 5, "the lock's keys gone")


@pytest.mark.slow
def test_a_lost_lease_sigterms_the_command_and_clone_lock_exits_4(
    servers: Servers, runs: list[LockRun], tmp_path: Path
) -> None:
    """The lease runs out while ``clone lock`` is frozen (nobody else may revoke
    it: only its owner can, docs/client.md); resumed, it stops the command."""
    ttl = 1.0
    server = servers.standalone()
    run = LockRun(tmp_path, endpoint(server), "holder", 0, 60.0, ttl)
    runs.append(run)
    eventually(lambda: "start" in run.noted(), 15, "the command started")
    with synced_client(server) as observer:
        eventually(lambda: len(observer.entries(NAME + "/")) == 1, 5, "the lock's key")
        run.proc.send_signal(signal.SIGSTOP)
        try:
            eventually(lambda: observer.entries(NAME + "/") == [], 10, "the lease to run out")
        finally:
            run.proc.send_signal(signal.SIGCONT)
        revoked = time.monotonic_ns()
        returncode, err = run.finish(timeout=10)
        assert returncode == EXIT_ERROR
        assert f"lost the lock {NAME!r}" in err
        noted = run.noted()
        assert set(noted) == {"start", "sigterm"}, noted
        # Told by its next keepalive (every ttl/3), then one 0.1 s look.
        assert (noted["sigterm"] - revoked) / 1e9 <= ttl / 3 + 0.5
        assert observer.entries(NAME + "/") == []


@pytest.mark.slow
def test_a_holder_cut_off_for_the_ttl_sigterms_the_command_and_exits_4(
    servers: Servers, runs: list[LockRun], tmp_path: Path
) -> None:
    """The server frozen (SIGSTOP): no keepalive is answered, so after the ttl
    the lease may have expired there and the command must stop."""
    ttl = 1.0
    server = servers.standalone()
    run = LockRun(tmp_path, endpoint(server), "holder", 0, 60.0, ttl)
    runs.append(run)
    eventually(lambda: "start" in run.noted(), 15, "the command started")
    server.sigstop()
    try:
        frozen = time.monotonic_ns()
        eventually(lambda: "sigterm" in run.noted(), ttl + 2, "the command told to stop")
    finally:
        server.sigcont()
    cut_for = (run.noted()["sigterm"] - frozen) / 1e9
    # Held until a ttl after the last answered keepalive: keepalives go every
    # ttl/3, so that one was sent between 2 ttl/3 (one sent just before the
    # freeze went unanswered) and 0 before the freeze; then one 0.1 s look.
    assert ttl / 3 - 0.05 <= cut_for <= ttl + 0.5, cut_for
    returncode, err = run.finish(timeout=15)
    assert returncode == EXIT_ERROR
    assert f"lost the lock {NAME!r}" in err
    assert set(run.noted()) == {"start", "sigterm"}


# A command that notes its pid and token at start, then a tick every 20 ms
# while it holds (so its last tick says when it stopped, even after a
# SIGKILL), and on SIGTERM/SIGINT/SIGHUP notes the signal and dies of it (the
# default action), so clone lock must report 128+N.  CODE: an exit code, or
# "sigN" to kill itself with signal N at the end.
_TICKER = """\
import os, signal, sys, time
path, code, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])

def note(line):
    with open(path, "a") as f:
        f.write(line + "\\n")

def on_signal(signum, frame):
    note(f"signal {signum} {time.monotonic_ns()}")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, on_signal)
if os.environ.get("TICKER_IGNORES_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
note(f"start {time.monotonic_ns()} {os.getpid()} {os.environ.get('CLONE_LOCK_TOKEN')}")
until = time.monotonic() + hold
while time.monotonic() < until:
    note(f"tick {time.monotonic_ns()}")
    time.sleep(0.02)
note(f"end {time.monotonic_ns()}")
if code.startswith("sig"):
    os.kill(os.getpid(), int(code[3:]))
sys.exit(int(code))
"""


class TickerRun:
    """``clone lock NAME --ttl TTL [EXTRA] -- python TICKER FILE CODE HOLD``."""

    def __init__(
        self,
        tmp: Path,
        eps: str,
        tag: str,
        code: str,
        hold: float,
        ttl: float,
        *extra: str,
        ignore_sigterm: bool = False,
        in_shell: bool = False,
        name: str = NAME,
    ) -> None:
        script = tmp / "ticker.py"
        if not script.exists():
            script.write_text(_TICKER)
        self.notes = tmp / f"{tag}.ticks"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.pop("CLONE_LOCK_TOKEN", None)
        if ignore_sigterm:
            env["TICKER_IGNORES_SIGTERM"] = "1"
        command = [sys.executable, str(script), str(self.notes), code, str(hold)]
        if in_shell:  # the ticker is then the shell's child, the command's only
            command = ["sh", "-c", " ".join(command) + " & wait"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clone.client.cli", "--heartbeat", "0.1", "--servers", eps,
             "lock", name, "--ttl", str(ttl), *extra, "--", *command],
            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip

    def lines(self) -> list[list[str]]:
        if not self.notes.exists():
            return []
        return [line.split() for line in self.notes.read_text().splitlines() if line.strip()]

    def started(self) -> bool:
        return any(words[0] == "start" for words in self.lines())

    def start(self) -> tuple[int, int, int]:
        """(start ns, the command's pid, its CLONE_LOCK_TOKEN)."""
        (words,) = [w for w in self.lines() if w[0] == "start"]
        return int(words[1]), int(words[2]), int(words[3])

    def last(self) -> int:
        """When it last noted anything (ns): its stop, to within one tick."""
        return max(int(w[1]) for w in self.lines())

    def signals(self) -> list[int]:
        return [int(w[1]) for w in self.lines() if w[0] == "signal"]

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err


@pytest.fixture
def tickers() -> Iterator[list[TickerRun]]:
    started: list[TickerRun] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
        if run.started():  # first: it holds clone lock's stderr open
            _, pid, _ = run.start()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.proc.communicate(timeout=10)


@pytest.fixture(scope="module")
def shared(module_servers: Servers) -> ServerProcess:
    """One server for the ticker tests (a server start is about 0.2 CPU-s):
    none stops or freezes it, and each locks a name of its own (``lock``)."""
    return module_servers.standalone()


@pytest.fixture
def lock(request: pytest.FixtureRequest) -> str:
    """The test's own lock name on the shared server."""
    return f"/locks/{re.sub(r'[^A-Za-z0-9_-]', '-', request.node.name)}"


#: The tests of ``shared``, on one xdist worker so that it starts once.
SHARED = pytest.mark.xdist_group("test_lock_cli_shared")


def _gone(pid: int) -> bool:
    """The process has exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_exit_status_is_what_a_shell_reports() -> None:
    assert [exit_status(c) for c in (0, 3, 255, -9, -15, -1)] == [0, 3, 255, 137, 143, 129]


@pytest.mark.slow
@SHARED
def test_kill9_of_clone_lock_stops_its_command_at_once_and_the_next_starts_after(
    shared: ServerProcess, lock: str, tickers: list[TickerRun], tmp_path: Path
) -> None:
    ttl = 1.0
    server = shared
    first = TickerRun(tmp_path, endpoint(server), "first", "0", 60.0, ttl, name=lock)
    tickers.append(first)
    eventually(first.started, 15, "the first command started")
    second = TickerRun(tmp_path, endpoint(server), "second", "0", 0.2, ttl, name=lock)
    tickers.append(second)
    with synced_client(server) as observer:
        eventually(lambda: len(observer.entries(lock + "/")) == 2, 15, "the second one waits")
    _, first_pid, first_token = first.start()
    killed = time.monotonic_ns()
    first.proc.kill()
    eventually(lambda: _gone(first_pid), 1.0, "the first command stopped within 1 s")
    assert (first.last() - killed) / 1e9 < 1.0
    returncode, err = second.finish()
    assert (returncode, err) == (0, ""), err
    second_start, _, second_token = second.start()
    assert second_start > first.last(), "the second command started while the first ran"
    assert second_token > first_token > 0


@pytest.mark.slow
@SHARED
def test_kill9_of_clone_lock_also_stops_what_its_command_started(
    shared: ServerProcess, lock: str, tickers: list[TickerRun], tmp_path: Path
) -> None:
    """The parent-death signal reaches only the command (here a shell); its
    guard kills the rest of the command's process group (here the ticker)."""
    server = shared
    run = TickerRun(tmp_path, endpoint(server), "shell", "0", 60.0, 2.0, in_shell=True, name=lock)
    tickers.append(run)
    eventually(run.started, 30, "the shell's child started")
    _, ticker_pid, token = run.start()
    assert token > 0
    assert os.getpgid(ticker_pid) != os.getpgid(run.proc.pid), "a group of its own"
    killed = time.monotonic_ns()
    run.proc.kill()
    eventually(lambda: _gone(ticker_pid), 1.0, "the shell's child stopped within 1 s")
    assert (run.last() - killed) / 1e9 < 1.0


@pytest.mark.slow
@SHARED
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_clone_lock_goes_to_its_command_and_the_exit_is_128_plus_n(
    shared: ServerProcess, lock: str, tickers: list[TickerRun], tmp_path: Path, signum: int
) -> None:
    server = shared
    run = TickerRun(tmp_path, endpoint(server), "holder", "0", 60.0, 2.0, name=lock)
    tickers.append(run)
    eventually(run.started, 15, "the command started")
    run.proc.send_signal(signum)
    returncode, err = run.finish(timeout=10)
    assert (returncode, err) == (128 + signum, ""), err
    assert run.signals() == [signum]
    assert _gone(run.start()[1])
    with synced_client(server) as observer:
        eventually(lambda: observer.entries(lock + "/") == [], 5, "the lock released")


@pytest.mark.slow
@SHARED
def test_clone_lock_exits_with_the_commands_code_or_128_plus_its_signal(
    shared: ServerProcess, lock: str, tickers: list[TickerRun], tmp_path: Path
) -> None:
    server = shared
    tokens = []
    for code, expected in (("0", 0), ("3", 3), ("sig9", 137), ("sig15", 143)):
        run = TickerRun(tmp_path, endpoint(server), f"code-{code}", code, 0.0, 2.0, name=lock)
        tickers.append(run)
        returncode, err = run.finish()
        assert (returncode, err) == (expected, ""), (code, err)
        tokens.append(run.start()[2])
    assert tokens == sorted(set(tokens)), f"tokens must grow: {tokens}"


@pytest.mark.slow
@SHARED
def test_a_lost_lock_sigkills_a_command_that_ignores_sigterm_after_the_grace(
    shared: ServerProcess, lock: str, tickers: list[TickerRun], tmp_path: Path
) -> None:
    server = shared
    grace = 0.5
    # A 2 s lease, not 1: at a loaded run's start one commit of this shared
    # server took 1.27 s, and a lease whose grant takes longer than its ttl to
    # commit is gone before clone lock can use it (docs/testing.md, "Tenth pass").
    ttl = 2.0
    run = TickerRun(tmp_path, endpoint(server), "stubborn", "0", 60.0, ttl,
                    "--kill-grace", str(grace), ignore_sigterm=True, name=lock)  # fmt: skip
    tickers.append(run)
    eventually(run.started, 30, "the command started")
    _, pid, _ = run.start()
    with synced_client(server) as observer:
        eventually(lambda: len(observer.entries(lock + "/")) == 1, 5, "the lock's key")
        # Lose the lease as a frozen holder does (only its owner may revoke it):
        # clone lock stopped until the lease runs out, the command ticking on.
        run.proc.send_signal(signal.SIGSTOP)
        try:
            eventually(lambda: observer.entries(lock + "/") == [], 10, "the lease to run out")
        finally:
            run.proc.send_signal(signal.SIGCONT)
        revoked = time.monotonic_ns()
    returncode, err = run.finish(timeout=10)
    assert returncode == EXIT_ERROR
    assert f"SIGKILL after {grace:g} s" in err
    assert _gone(pid)
    # It ticked on through the SIGTERM, for the grace, and no longer.
    assert run.signals() == []
    # (The last tick comes up to one tick, 20 ms, before the SIGKILL; the lost
    # lease may be noticed at once when clone lock resumes.)
    assert grace - 0.05 <= (run.last() - revoked) / 1e9 <= ttl / 3 + 0.2 + grace + 0.5
