"""Leases, compare-and-set, locks and elections across real processes.

Each contender is a separate process (``tests/support/coord_worker.py``) with
its own client, so a test can ``kill -9`` it the way a node dies: nobody says
goodbye, and only the server's lease expiry cleans up.  Servers are a real
pair with 100 ms heartbeats; every wait has a deadline and every process is
stopped at the end.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clone import Clone
from clone.client.cli import EXIT_CONFLICT, main
from clone.errors import Conflict, LeaseLost, LimitExceeded, WriteRefused
from clone.recipes import Election, Lock
from clone.wire.protocol import MAX_VALUE_BYTES
from tests.support.clients import endpoint, synced_client
from tests.support.curve import CurveKeys, wait_serving_curve
from tests.support.servers import ROOT, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HEARTBEAT = 0.1  # the servers' (tests.support.servers)


class Worker:
    """One coord_worker process; its stdout lines, timestamped, on a queue."""

    def __init__(self, mode: str, endpoints: str, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.coord_worker", mode, endpoints, *args],
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put((time.monotonic(), raw.decode().strip()))

    def wait_for(self, prefix: str, timeout: float = 20.0) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                at, line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return at, line
        pytest.fail(f"worker {self.proc.args[3:5]} did not say {prefix!r}; said {self.seen}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def _endpoints(servers: Servers) -> tuple[str, Clone]:
    primary, backup = servers.pair()
    return f"{endpoint(primary)},{endpoint(backup)}", Clone(
        [endpoint(primary), endpoint(backup)], heartbeat=HEARTBEAT, server_timeout=0.5
    )


def test_a_killed_lease_holder_loses_its_key_within_ttl_and_a_heartbeat(
    servers: Servers, workers: list[Worker]
) -> None:
    ttl = 1.0
    eps, observer = _endpoints(servers)
    with observer:
        observer.wait_synced(10)
        worker = Worker("lease", eps, "/nodes/w1", str(ttl))
        workers.append(worker)
        _, ready = worker.wait_for("ready")
        lease_id = ready.split()[1]
        eventually(lambda: observer.get("/nodes/w1") is not None, 5, "the registration")
        entry = observer.entry("/nodes/w1")
        assert entry is not None and entry.prop("lease") == lease_id
        # Alive, it keeps its key well past the ttl (keepalives every ttl/3).
        time.sleep(2.5 * ttl)
        assert observer.get("/nodes/w1") is not None
        worker.kill9()
        killed = time.monotonic()
        eventually(lambda: observer.get("/nodes/w1") is None, 5, "the key deleted")
        gone_after = time.monotonic() - killed
        # The lease's record goes in an update of its own, after its keys: on
        # a loaded machine the observer had applied the one and not yet the other.
        eventually(
            lambda: observer.get(f"/_clone/lease/{lease_id}") is None, 5, "the lease record deleted"
        )
    # The last keepalive came at most ttl/3 before the kill, so the key goes
    # at most ttl + a housekeeping turn (a heartbeat) after it, plus delivery.
    assert gone_after <= ttl + HEARTBEAT + 0.25, gone_after


def test_two_processes_doing_100_cas_increments_each_end_at_200(
    servers: Servers, workers: list[Worker]
) -> None:
    eps, reader = _endpoints(servers)
    with reader:
        reader.wait_synced(10)
        reader.set("/counter", "0", wait=True)
        pair = [Worker("cas", eps, "/counter", "100") for _ in range(2)]
        workers.extend(pair)
        for worker in pair:
            worker.wait_for("done", timeout=60)
        eventually(lambda: reader.get("/counter") == b"200", 5, "the counter at 200")


def test_a_lock_never_overlaps_and_a_killed_holder_frees_it(
    servers: Servers, workers: list[Worker], tmp_path: Path
) -> None:
    eps, observer = _endpoints(servers)
    marker = tmp_path / "holder"
    marker.write_text("")
    pair = [Worker("lock", eps, "/locks/x", "2", "5", "0.05", str(marker)) for _ in range(2)]
    workers.extend(pair)
    for worker in pair:
        worker.wait_for("done", timeout=60)
        assert "overlap" not in worker.seen
    # A holder dies with the lock: the waiter gets it within ttl + 1 s.
    ttl = 1.0
    holder = Worker("lock", eps, "/locks/y", str(ttl), "0", "0", str(marker))
    workers.append(holder)
    holder.wait_for("held")
    waiter = Worker("lock", eps, "/locks/y", str(ttl), "1", "0.01", str(marker))
    workers.append(waiter)
    waiter.wait_for("ready")
    with observer:
        observer.wait_synced(10)
        # The waiter is queued behind the holder: two keys in the lock's queue.
        eventually(lambda: len(observer.entries("/locks/y/")) == 2, 30, "the waiter queued")
    holder.kill9()
    killed = time.monotonic()
    at, _ = waiter.wait_for("done", timeout=10)
    assert at - killed <= ttl + 1.0, at - killed
    assert "overlap" not in waiter.seen


def test_an_election_survives_the_leaders_kill9(servers: Servers, workers: list[Worker]) -> None:
    ttl = 1.0
    eps, observer = _endpoints(servers)
    with observer:
        observer.wait_synced(10)
        changes: list[str | None] = []
        watcher = Election(observer, "/elections/a", "observer", on_change=changes.append)
        watcher.watch()
        first = Worker("elect", eps, "/elections/a", "alpha", str(ttl))
        workers.append(first)
        first.wait_for("leader alpha")
        second = Worker("elect", eps, "/elections/a", "beta", str(ttl))
        workers.append(second)
        second.wait_for("leader alpha")
        eventually(lambda: watcher.leader == "alpha", 5, "the observer sees alpha lead")
        first.kill9()
        killed = time.monotonic()
        at, _ = second.wait_for("leader beta", timeout=10)
        assert at - killed <= ttl + 1.0, at - killed
        eventually(lambda: changes[-1:] == ["beta"], 5, "the callback told of beta")
        watcher.close()


def test_recipes_in_process(servers: Servers) -> None:
    primary, backup = servers.pair()
    with synced_client(primary, backup) as a, synced_client(primary, backup) as b:
        lock = Lock(a, "/locks/in-process", ttl=2)
        assert lock.acquire(timeout=5) and lock.held
        other = Lock(b, "/locks/in-process", ttl=2)
        assert not other.acquire(timeout=0.3)  # held: times out and leaves the queue
        lock.release()
        assert other.acquire(timeout=5)
        other.release()
        with Election(a, "/elections/b", "a") as ea, Election(b, "/elections/b", "b") as eb:
            assert ea.wait_leader(5)
            assert not eb.is_leader and eb.leader == "a"
            ea.resign()
            assert eb.wait_leader(5)
        assert a.entries("/locks/in-process/") == []


def test_cas_and_leases_refuse_bad_input_and_count_it(servers: Servers) -> None:
    """Through the client library: what it can judge (a bad if_sequence, an
    oversized value) it refuses before sending, so the server never counts
    it; the rest the server refuses, each under its own counter, changing
    nothing.  tests/server/test_calls_e2e.py sends the same bad input raw."""
    server = servers.standalone()
    with synced_client(server) as client:
        seq = client.set("/k", "1", wait=True)
        assert isinstance(seq, int) and seq > 0
        before = read_stats(server)
        for bad, error in ((-1, ValueError), ("one", TypeError), ("3", TypeError)):
            with pytest.raises(error, match="if_sequence"):
                client.set("/k", "2", if_sequence=bad)  # type: ignore[arg-type]
        with pytest.raises(LimitExceeded):
            client.set("/k", b"x" * (MAX_VALUE_BYTES + 1), if_sequence=seq)
        locally = read_stats(server)
        assert locally["calls_received"] == before["calls_received"]  # nothing was sent
        with pytest.raises(Conflict) as conflict:
            client.set("/k", "2", if_sequence=seq + 5)
        assert conflict.value.current == seq
        lease = client.lease(2.0)
        lease.revoke()
        revoked = read_stats(server)
        with pytest.raises(LeaseLost):
            client.set("/k", "3", lease=lease.id)
        with pytest.raises(LeaseLost):
            client.set("/k", "3", lease="ab" * 16)
        after = read_stats(server)
        assert after["calls_unknown_lease"] == revoked["calls_unknown_lease"] + 2
        assert after["calls_received"] == revoked["calls_received"] + 2
        assert after["sequence"] == revoked["sequence"]  # no write applied
        assert after["leases"] == 0
        assert client.get("/k") == b"1"
        assert client.get(f"/_clone/lease/{lease.id}") is None
    assert after["calls_conflict"] == 1
    assert after["calls_invalid"] == after["calls_bad_if_sequence"] == 0
    assert after["calls_refused_size"] == 0


def test_a_lock_name_outside_the_write_acl_is_refused(servers: Servers, tmp_path: Path) -> None:
    keys = CurveKeys.make(tmp_path / "keys", admitted=("admin", "worker"))
    keys.write_acl({"admin": ([""], [""]), "worker": ([""], ["/jobs/"])})
    server = servers.standalone(*keys.server_args(), wait=False)
    wait_serving_curve(server, keys)
    with Clone([endpoint(server)], heartbeat=HEARTBEAT, **keys.client("worker")) as client:
        client.wait_synced(10)
        before = read_stats(server)
        with pytest.raises(WriteRefused) as refused:
            Lock(client, "/locks/not-mine", ttl=2).acquire(timeout=5)
        assert refused.value.reason == "acl"
        assert refused.value.key.startswith("/locks/not-mine/")
        after = read_stats(server)
        # Refused at the grant, which named the lock's key: nothing was written
        # (no lease key published, then deleted by a revoke).
        assert after["sequence"] == before["sequence"]
        assert after["leases"] == 0 and after["leases_granted"] == before["leases_granted"] == 0
        assert after["leases_revoked"] == 0
        assert after["calls_refused_acl"] == before["calls_refused_acl"] + 1
        assert after["calls_ok"] == before["calls_ok"]
        assert client.entries("/_clone/lease/") == [] and client.entries("/locks/") == []
        with Lock(client, "/jobs/locks/mine", ttl=2) as lock:
            assert lock.held
    assert read_stats(server)["calls_refused_acl"] == after["calls_refused_acl"]


def test_cli_if_seq_and_lock(servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    server = servers.standalone()
    base = ["--servers", endpoint(server), "--heartbeat", "0.1"]
    assert main([*base, "set", "/c", "1", "--if-seq", "0"]) == 0
    written = int(capsys.readouterr().out.strip())  # set prints the new sequence
    assert main([*base, "set", "/c", "2", "--if-seq", "0"]) == EXIT_CONFLICT
    current = int(capsys.readouterr().out.strip())  # and the current one when it lost
    assert current == written
    assert main([*base, "set", "/c", "2", "--if-seq", str(current)]) == 0
    code = main([*base, "lock", "/locks/cli", "--", sys.executable, "-c", "raise SystemExit(7)"])
    assert code == 7
    with synced_client(server) as client:
        assert client.get("/c") == b"2"
        assert client.entries("/locks/cli/") == []


def test_a_holder_cut_off_from_both_servers_stops_holding_after_the_ttl(
    servers: Servers,
) -> None:
    """Frozen servers answer no keepalive: after the ttl the holder must assume
    its lease may have expired there, so the lock is no longer held."""
    primary, backup = servers.pair()
    with synced_client(primary, backup) as client:
        lock = Lock(client, "/locks/cut", ttl=1.0)
        assert lock.acquire(timeout=5)
        primary.sigstop()
        backup.sigstop()
        try:
            frozen = time.monotonic()
            eventually(lambda: not lock.held, 3, "the lock no longer held")
            assert time.monotonic() - frozen <= 1.0 + 0.2
            with pytest.raises(LeaseLost):
                lock.check()
        finally:
            primary.sigcont()
            backup.sigcont()
        lock.release()
