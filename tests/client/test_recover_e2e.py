"""Recipes that recover: a frozen worker rejoins its election and its
registration after SIGCONT (real processes: a server and a worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clone import Clone
from clone.recipes import Election, Lock, Registration
from tests.support.clients import endpoint, synced_client
from tests.support.servers import Servers
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _candidates(client: Clone) -> list[bytes]:
    return [
        e.value or b""
        for e in sorted(client.entries("/elections/workers/"), key=lambda e: e.sequence)
    ]


class _Lines:
    """A child's output, read as it comes (so a test waits for a line the
    child printed instead of guessing when it has printed it)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        assert proc.stdout is not None
        self._out = proc.stdout
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in iter(self._out.readline, b""):
            with self._lock:
                self._chunks.append(line)

    @property
    def text(self) -> str:
        with self._lock:
            return b"".join(self._chunks).decode("utf-8", "replace")

    def finish(self, timeout: float) -> str:
        self._thread.join(timeout)
        return self.text


def test_a_frozen_worker_rejoins_its_election_and_registration(servers: Servers) -> None:
    server = servers.standalone("--in-memory")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/examples/worker.py"), endpoint(server), "w1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    lines = _Lines(worker)
    try:
        with synced_client(server) as watcher:
            eventually(lambda: watcher.get("/services/workers/w1") is not None, 20, "registered")
            eventually(lambda: _candidates(watcher) == [b"w1"], 20, "campaigning")
            # The worker's own watcher prints its leadership from its replica,
            # a poll after the server has the candidate: freeze it only after.
            eventually(lambda: "leader: w1" in lines.text, 20, "the worker knows it leads")
            first = watcher.entry("/services/workers/w1")
            assert first is not None
            worker.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            # Its lease runs out: the key and the candidate go.
            eventually(lambda: watcher.get("/services/workers/w1") is None, 20, "key gone")
            eventually(lambda: _candidates(watcher) == [], 20, "candidate gone")
            # The scenario is a freeze longer than the client's freeze_gap
            # (1.5 s): its length is the input here, not a wait for a result.
            time.sleep(max(0.0, 2.5 - (time.monotonic() - frozen_at)))
            worker.send_signal(signal.SIGCONT)
            eventually(lambda: watcher.get("/services/workers/w1") is not None, 20, "re-registered")
            eventually(lambda: _candidates(watcher) == [b"w1"], 20, "standing again")
            again = watcher.entry("/services/workers/w1")
            assert again is not None and again.sequence > first.sequence
            assert again.lease != first.lease  # a fresh lease
            eventually(lambda: "lost: unknown-lease" in lines.text, 20, "on_lost ran")
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.terminate()
        worker.wait(timeout=30)
    text = lines.finish(30)
    assert "lost: unknown-lease" in text, text  # on_lost ran
    assert "leader: w1" in text, text
    # It knew its own process had been frozen, and did not blame the server.
    assert "did not run for" in text and "failing over" not in text, text


def test_election_lock_and_registration_rejoin_after_a_server_forgets_their_leases(
    servers: Servers,
) -> None:
    """An in-memory server restarted knows no leases: each recipe hears its
    lease is gone, runs on_lost, and joins again with a fresh token."""
    server = servers.standalone("--in-memory")
    lost: list[str] = []
    with synced_client(server) as client:
        election = Election(client, "/el/x", "me", ttl=1.0, on_lost=lambda why: lost.append("e"))
        election.campaign()
        eventually(lambda: election.is_leader, 10, "leading")
        token, key = election.token, election._me.key
        lock = Lock(client, "/locks/x", ttl=1.0, on_lost=lambda why: lost.append("l"))
        assert lock.acquire(10)
        lock_key = lock._me.key
        reg = Registration(client, "/svc/x", b"here", ttl=1.0, on_lost=lambda w: lost.append("r"))
        server.restart()
        client.wait_synced(20)
        eventually(lambda: sorted(lost) == ["e", "l", "r"], 20, "every on_lost ran")
        # A fresh key each (an in-memory server restarts its sequences, so the
        # tokens are compared only against that restart's: see the first test).
        eventually(lambda: election.is_leader and election._me.key != key, 20, "leading again")
        eventually(lambda: lock.held and lock._me.key != lock_key, 20, "holding again")
        eventually(lambda: reg.alive and client.get("/svc/x") == b"here", 20, "registered again")
        assert token is not None and election.token is not None
        reg.close()
        lock.release()
        election.close()
        eventually(lambda: client.get("/svc/x") is None, 10, "registration revoked")


def test_a_process_that_exits_without_close_takes_its_leased_keys_along(
    servers: Servers,
) -> None:
    """The atexit hook closes the clients still open, so their leases are
    revoked at exit: the key goes at once, not a ttl (60 s here) later."""
    server = servers.standalone("--in-memory")
    code = (
        "import sys\n"
        "from clone import Clone\n"
        "c = Clone(sys.argv[1], heartbeat=0.1)\n"
        "c.wait_synced(10)\n"
        "c.set('/svc/exiting', b'here', lease=c.lease(60.0))\n"
        "print('set', flush=True)\n"  # and exit, never calling close()
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with synced_client(server) as watcher, watcher.changes(30, "/svc/") as changes:
        out = subprocess.run(
            [sys.executable, "-c", code, endpoint(server)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        assert out.stdout == "set\n", out.stderr
        made, gone = next(changes), next(changes)  # each within the stream's 30 s
        assert (made.key, made.value) == ("/svc/exiting", b"here")
        assert (gone.key, gone.deleted) == ("/svc/exiting", True)
        assert watcher.get("/svc/exiting") is None
