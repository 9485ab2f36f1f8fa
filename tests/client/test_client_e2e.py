"""The client library against real ``clone-server`` processes (tests/support/servers.py).

Servers run with a 100 ms heartbeat; clients use the same heartbeat and a server
timeout of 5 heartbeats, so a loaded CI machine does not fail over by accident.
The crash test at the production defaults (1 s heartbeat, default client) uses
its own pool; the failback test runs default clients against the 100 ms pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from clone import Clone
from clone.errors import ConfirmTimeout
from clone.wire.codec import KVMsg, encode_kv
from clone.wire.protocol import DEFAULT_HEARTBEAT_MS
from tests.support.servers import (
    ROOT,
    STEADY_MISSED,
    ServerProcess,
    Servers,
    server_pool,
    wait_role,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HB = 0.1
SERVER_TIMEOUT = 0.5


def endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


@contextmanager
def client(*srv: ServerProcess, **kw: object) -> Iterator[Clone]:
    kw.setdefault("heartbeat", HB)
    kw.setdefault("server_timeout", SERVER_TIMEOUT)
    c = Clone([endpoint(s) for s in srv], **kw)  # type: ignore[arg-type]
    try:
        c.wait_synced(10)
        yield c
    finally:
        c.close()


class _ConfirmedWriter:
    """A thread writing keys ``{prefix}{i:06d}`` with confirmed writes until stopped,
    sorting them into confirmed and unconfirmed, so a test can check losses."""

    def __init__(self, c: Clone, prefix: str, timeout: float) -> None:
        self.confirmed: list[str] = []
        self.unconfirmed: list[str] = []
        self._stop = threading.Event()
        self._client, self._prefix, self._timeout = c, prefix, timeout
        self.thread = threading.Thread(target=self._write, name="test-writer")

    def _write(self) -> None:
        i = 0
        while not self._stop.is_set():
            key = f"{self._prefix}{i:06d}"
            try:
                self._client.set(key, str(i), wait=True, timeout=self._timeout)
                self.confirmed.append(key)
            except ConfirmTimeout:
                self.unconfirmed.append(key)
            i += 1

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)


def test_confirmed_writes_are_read_back(servers: Servers) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as c:
        for i in range(100):
            c.set(f"/cw/{i}", f"v{i}", wait=True, timeout=5)
            assert c.get(f"/cw/{i}") == f"v{i}".encode()
        c.delete("/cw/0", wait=True, timeout=5)
        assert c.get("/cw/0") is None
        assert c.status().server == endpoint(primary)


def test_many_async_confirmed_writes_in_flight_from_one_thread(
    servers: Servers,
) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as c, client(primary, backup) as reader:
        futures = [c.set_async(f"/async/{i}", f"v{i}", timeout=10) for i in range(2000)]
        for fut in futures:
            fut.result(20)
        # Confirmed by the active server: a second client converges on all of them.
        expected = [(f"/async/{i}", f"v{i}".encode()) for i in range(2000)]
        eventually(
            lambda: sorted(reader.items("/async/")) == sorted(expected),
            what="the reader to see every confirmed write",
        )


def test_two_clients_converge_and_a_late_joiner_gets_the_snapshot(
    servers: Servers,
) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as a, client(primary, backup) as b:
        for i in range(200):
            (a if i % 2 else b).set(f"/conv/{i % 37}", f"{i}")
        a.set("/conv/last", b"a", wait=True, timeout=5)
        b.set("/conv/last2", b"b", wait=True, timeout=5)
        eventually(lambda: a.items() == b.items(), what="both clients to agree")
        with client(primary, backup) as late:
            assert late.items() == a.items()
            assert len(late.items()) == 39


def test_ttl_keys_vanish_from_clients(servers: Servers) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as c:
        gone = threading.Event()
        c.on_change(lambda e: gone.set() if e.key == "/ttl/k" and e.deleted else None)
        c.set("/ttl/k", b"soon gone", ttl=0.5, wait=True, timeout=5)
        entry = c.entry("/ttl/k")
        assert entry is not None and entry.prop("expires") is not None
        assert gone.wait(5)
        assert c.get("/ttl/k") is None


def test_subtree_isolation(servers: Servers) -> None:
    solo = servers.standalone()
    with client(solo) as writer:
        for key in ("/a/1", "/b/1", "/c/1"):
            writer.set(key, b"x", wait=True, timeout=5)
        with client(solo, subtree="/a/") as a, client(solo, subtree=["/b/", "/c/"]) as bc:
            assert [k for k, _ in a.items()] == ["/a/1"]
            assert [k for k, _ in bc.items()] == ["/b/1", "/c/1"]
            writer.set("/a/2", b"y", wait=True, timeout=5)
            writer.set("/b/2", b"y", wait=True, timeout=5)
            eventually(lambda: a.get("/a/2") == b"y" and bc.get("/b/2") == b"y")
            assert a.get("/b/2") is None and bc.get("/a/2") is None
            assert a.status().gaps == 0 and bc.status().gaps == 0


def test_kill9_of_the_active_server_loses_no_confirmed_write(
    servers: Servers,
) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as c:
        writer = _ConfirmedWriter(c, "/kill/", timeout=5)
        confirmed, unconfirmed = writer.confirmed, writer.unconfirmed
        writer.thread.start()
        try:
            eventually(lambda: len(confirmed) >= 50, what="writes before the crash")
            primary.kill9()
            t_kill = time.monotonic()
            eventually(
                lambda: c.status().server == endpoint(backup) and c.status().state == "active",
                timeout=10,
                what="failover to the backup",
            )
            failover = time.monotonic() - t_kill
            count = len(confirmed)
            eventually(lambda: len(confirmed) >= count + 50, what="writes after the failover")
        finally:
            writer.stop(10)
        # normally the lost connection; at worst silence (0.5 s) and re-asks
        assert failover < SERVER_TIMEOUT * 3 + 1.0, failover
        assert c.status().failovers >= 1
        assert not unconfirmed
        held = dict(c.items("/kill/"))
        missing = [k for k in confirmed if k not in held]
        assert not missing, f"{len(missing)} confirmed writes lost, e.g. {missing[:5]}"
        with client(backup) as fresh:
            on_backup = dict(fresh.items("/kill/"))
        assert all(k in on_backup for k in confirmed)


def test_backup_serves_a_client_that_starts_while_the_primary_is_dead(
    servers: Servers,
) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as c:
        c.set("/boot/k", b"v", wait=True, timeout=5)
    primary.kill9()
    with client(primary, backup) as late:
        assert late.get("/boot/k") == b"v"
        assert late.status().server == endpoint(backup)


def _clone_get(key: str, *srv: ServerProcess, verbose: bool = False
               ) -> tuple[subprocess.CompletedProcess[str], float]:  # fmt: skip
    """``clone get`` at the client's defaults (1 s assumed heartbeat, so a 2.5 s
    snapshot wait), and its wall time, interpreter start included; with
    ``verbose``, what the client did is on its stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    servers_arg = ",".join(endpoint(s) for s in srv)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "clone.client.cli", *(["-v"] if verbose else []),
         "--servers", servers_arg, "get", key],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=ROOT,
    )
    return r, time.monotonic() - t0


def test_failback_a_client_that_lists_the_passive_first_finds_the_active_at_once(
    servers: Servers,
    record_property: Callable[[str, object], None],
) -> None:
    """A rolling restart.  After a failover the old primary comes back passive; a new
    client that lists it first used to wait its whole snapshot timeout (2.5 s
    at the client defaults) before asking the backup.  The backup's HUGZ show
    it is the active one, so the client asks it within one heartbeat (100 ms
    here).  The client runs at its defaults, which is the slow case.
    Measured: 80-100 ms per client (each starts just after the HUGZ that ended
    the previous one's wait, so close to a whole heartbeat), 2.5 s before."""
    # The clients below must find the backup active: no failover but the kill's.
    primary, backup = servers.pair(*STEADY_MISSED)
    with client(primary, backup) as c:
        c.set("/failback/k", b"v", wait=True, timeout=5)
    primary.kill9()
    backup.wait_serving()  # a vote: Binary Star takes over on a client's request
    wait_role(backup, "active")
    mark = primary.log_size()
    primary.restart()
    wait_role(primary, "passive")
    primary.wait_log("synced from", after=mark)

    times = []
    for _ in range(3):
        t0 = time.monotonic()
        c = Clone([endpoint(primary), endpoint(backup)])  # every setting at its default
        try:
            c.wait_synced(10)
            assert c.get("/failback/k") == b"v"
            times.append(time.monotonic() - t0)
            st = c.status()
            assert st.server == endpoint(backup)
            assert st.counters["hint_failovers"] == 1 and st.failovers == 1, st.counters
        finally:
            c.close()
    # Each found the active by the hint (the counters above), not by waiting
    # out its snapshot timeout.  The times are recorded, not asserted: they
    # are the machine's as much as the client's (a loaded run failed a 1 s
    # bound with the hint taken), and targets live in the benchmarks.
    record_property("failback_get_s", max(times))
    print("failback: client with the passive first synced and read in", times)

    # The command line, passive first: the same hint, read from what the
    # client logs with -v, and the value; active first for the record.
    r_active, t_active = _clone_get("/failback/k", backup, primary)
    r_passive, t_passive = _clone_get("/failback/k", primary, backup, verbose=True)
    for r in (r_active, r_passive):
        assert (r.returncode, r.stdout) == (0, "v\n"), r.stderr
    assert f"{endpoint(backup)} is active" in r_passive.stderr, r_passive.stderr
    assert f"has not answered; asking {endpoint(backup)}" in r_passive.stderr, r_passive.stderr
    record_property("cli_get_active_first_s", t_active)
    record_property("cli_get_passive_first_s", t_passive)
    print(f"clone get: active first {t_active:.3f} s, passive first {t_passive:.3f} s")


@pytest.fixture
def default_servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
    """A pool at the production heartbeat (tests.support.servers defaults to 100 ms)."""
    with server_pool(tmp_path, request, heartbeat_ms=DEFAULT_HEARTBEAT_MS) as pool:
        yield pool


@pytest.mark.parametrize("fault", ["kill9", "sigstop"])
def test_failover_at_default_settings_loses_no_confirmed_write(
    default_servers: Servers, fault: str, record_property: Callable[[str, object], None]
) -> None:
    """Default servers and a default client, writing confirmed writes.

    kill -9: the crash is noticed by the lost connection, not by a second of
    silence.  SIGSTOP keeps the connections open, so only silence tells: the
    client has learnt the servers' 250 ms heartbeat from their HUGZ and gives up
    after 4 of them, while the backup gives up on its peer after the same 1 s.
    Either way no confirmed write is lost."""
    primary, backup = default_servers.pair()
    c = Clone([endpoint(primary), endpoint(backup)])  # every setting at its default
    writer = _ConfirmedWriter(c, f"/{fault}/", timeout=10)
    confirmed, unconfirmed = writer.confirmed, writer.unconfirmed
    try:
        c.wait_synced(10)
        eventually(
            lambda: c.status().counters["silence_timeout_ms"] == 4 * DEFAULT_HEARTBEAT_MS,
            what="the client to learn the heartbeat from a HUGZ",
        )
        writer.thread.start()
        eventually(lambda: len(confirmed) >= 50, what="writes before the fault")
        if fault == "kill9":
            primary.kill9()
        else:
            primary.sigstop()
        eventually(
            lambda: c.status().server == endpoint(backup) and c.status().state == "active",
            timeout=15,
            what="failover to the backup",
        )
        count = len(confirmed)
        eventually(lambda: len(confirmed) >= count + 50, what="writes after the failover")
        writer.stop(15)
        st = c.status()
        gap_ms = st.counters["last_failover_gap_ms"]
        record_property("failover_gap_ms", gap_ms)
        print(f"client failover gap after {fault}: {gap_ms} ms")
        assert st.counters["disconnect_failovers"] == (fault == "kill9"), st.counters
        assert st.failovers == 1, st.counters
        assert not unconfirmed
        held = dict(c.items(f"/{fault}/"))
        missing = [k for k in confirmed if k not in held]
        assert not missing, f"{len(missing)} confirmed writes lost, e.g. {missing[:5]}"
        # Recorded; the bounds are loose (a loaded host), the drills measure the
        # distribution.  A crash comes in under the 1 s silence floor (typically
        # tens of ms); a freeze takes at least that floor.
        if fault == "kill9":
            assert 0 < gap_ms < 4 * DEFAULT_HEARTBEAT_MS, gap_ms
        else:
            assert 4 * DEFAULT_HEARTBEAT_MS <= gap_ms < 5000, gap_ms
    finally:
        writer.stop(15)
        primary.sigcont()
        c.close()


def test_the_client_learns_the_servers_heartbeat_unless_told_a_timeout(
    servers: Servers, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    server = servers.standalone()
    learned = 4 * servers.heartbeat_ms
    with client(server, server_timeout=None) as c:
        eventually(lambda: c.status().counters["silence_timeout_ms"] == learned, what="learning")
    with client(server, server_timeout=0.7) as c:
        c.set("/hb/probe", b"1", wait=True)
        # Three HUGZ published after it (a SUB of our own sees them), then a
        # write confirmed by a later KVPUB: the client has read those HUGZ.
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        sub.connect(f"tcp://127.0.0.1:{server.port + 1}")
        for _ in range(3):
            assert sub.poll(30_000), "no HUGZ from the server"
            sub.recv_multipart()
        c.set("/hb/probe", b"2", wait=True)
        assert c.status().counters["silence_timeout_ms"] == 700


@contextmanager
def _raw_collector(
    ctx: zmq.Context[zmq.Socket[bytes]], server: ServerProcess
) -> Iterator[zmq.Socket[bytes]]:
    """A raw PUB on ``server``'s collector, with no high-water mark, for loading
    many keys fast; closed afterwards."""
    pub = ctx.socket(zmq.PUB)
    try:
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(f"tcp://127.0.0.1:{server.port + 2}")
        yield pub
    finally:
        pub.close(linger=0)


def _collector_up(pub: zmq.Socket[bytes], c: Clone, first: list[bytes], key: str) -> None:
    """Send ``first`` (the load's first message, for ``key``) until ``c`` has
    it: a PUB drops what it sends before the server's subscription arrives."""

    def arrived() -> bool:
        pub.send_multipart(first)
        return c.get(key) is not None

    eventually(arrived, timeout=30, what="the raw PUB's connection to the collector")


def test_large_snapshot_is_synced_and_listed(
    servers: Servers, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """200k keys: the client syncs them and lists them within the default
    command timeout (5 s), which a reply of five frames per entry did not meet
    at 1M keys."""
    n = 200_000
    solo = servers.standalone()
    with _raw_collector(ctx, solo) as pub:
        with client(solo) as c:
            body = b"x" * 100
            _collector_up(pub, c, encode_kv(KVMsg("/big/0000000", 0, b"", (), body)),
                          "/big/0000000")
            for i in range(n):
                pub.send_multipart(encode_kv(KVMsg(f"/big/{i:07d}", 0, b"", (), body)))
            eventually(lambda: c.status().keys == n, timeout=60, what="every key applied")
        t0 = time.monotonic()
        with client(solo) as c:
            synced = time.monotonic() - t0
            items = c.items()
            entries = c.entries("/big/")
            assert len(items) == n and len(entries) == n
            assert items[-1] == (f"/big/{n - 1:07d}", body)
            assert entries[5].key == "/big/0000005" and entries[5].sequence > 0
            assert c.status().protocol_errors == 0
        assert synced < 30, synced


def test_batched_sync_of_a_large_map_with_properties(
    servers: Servers, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Our client asks our server for KVBATCHes: tens of thousands of keys with
    ttl, properties and multi-byte keys arrive exactly as a watching client
    applied them from the live KVPUBs."""
    n = 30_000
    solo = servers.standalone()
    def update(i: int) -> list[bytes]:
        if i % 100 == 0:
            props: tuple[tuple[str, str], ...] = (("ttl", "3600"), ("owner", f"w{i}"))
        elif i % 7 == 0:
            props = (("kind", "séven"),)
        else:
            props = ()
        body = b"v%d" % i * (1 + i % 5)
        uuid = (i + 1).to_bytes(16, "big")
        return encode_kv(KVMsg(f"/big/é{i:06d}", 0, uuid, props, body))

    with _raw_collector(ctx, solo) as pub:
        with client(solo) as watcher:
            _collector_up(pub, watcher, update(0), "/big/é000000")
            for i in range(n):
                pub.send_multipart(update(i))
            eventually(lambda: watcher.status().keys == n, timeout=60, what="every key applied")
            expected = watcher.entries()
            mark = solo.log_size()
            with client(solo) as c:
                got = c.entries()
                assert c.status().protocol_errors == 0
        solo.wait_log(", batched", after=mark)
        assert len(got) == n and got == expected
        ttl = got[100]
        assert ttl.key == "/big/é000100" and ttl.prop("ttl") == "3600"
        assert ttl.prop("owner") == "w100" and ttl.prop("expires") is not None
        assert got[7].properties == (("kind", "séven"),)
        assert got[3].value == b"v3" * 4 and got[3].sequence > 0
