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
import subprocess
import sys
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import zmq

from clone.client.cli import EXIT_ERROR, _lock_command, _parser
from clone.wire.calls import OP_LEASE_REVOKE, decode_reply, encode_call
from clone.wire.codec import new_uuid
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


def _raw_revoke(server: ServerProcess, lease_id: str) -> None:
    """Revoke a lease behind its holder's back, as any other process may."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint(server))
        call = encode_call(OP_LEASE_REVOKE, new_uuid(), properties=(("lease", lease_id),))
        sock.send_multipart(call)
        assert sock.poll(5000), "no reply to the revoke"
        assert decode_reply(sock.recv_multipart()).ok
    finally:
        ctx.destroy(linger=0)


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
def test_a_lease_revoked_elsewhere_sigterms_the_command_and_clone_lock_exits_4(
    servers: Servers, runs: list[LockRun], tmp_path: Path
) -> None:
    ttl = 1.0
    server = servers.standalone()
    run = LockRun(tmp_path, endpoint(server), "holder", 0, 60.0, ttl)
    runs.append(run)
    eventually(lambda: "start" in run.noted(), 15, "the command started")
    with synced_client(server) as observer:
        eventually(lambda: len(observer.entries(NAME + "/")) == 1, 5, "the lock's key")
        (entry,) = observer.entries(NAME + "/")
        lease_id = entry.prop("lease")
        assert lease_id is not None
        revoked = time.monotonic_ns()
        _raw_revoke(server, lease_id)
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
