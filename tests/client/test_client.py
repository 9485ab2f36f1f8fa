"""The Clone client against a raw-pyzmq fake CHP server (tests/support/fake_server.py).

Real sockets on 127.0.0.1, short heartbeats, a deadline on every wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import pytest

import clone
import clone.client.default as default_mod
import clone.client.frontend as client_mod
from clone import Clone, Entry
from clone.errors import CloneError, ClosedError, ConfirmTimeout, NotSynced
from clone.wire.batch import encode_kvbatch
from clone.wire.codec import KVMsg, encode_hugz, encode_kthxbai, encode_kv, new_uuid
from tests.support.fake_server import FakeServer
from tests.support.ports import free_base_port
from tests.support.waiting import eventually as wait_until

HB = 0.1  # fake server heartbeat


def eventually(check: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    """The shared helper with this file's shorter deadline (a fake server is fast)."""
    wait_until(check, timeout, what)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer(heartbeat=HB) as srv:
        yield srv


@pytest.fixture
def pair() -> Iterator[tuple[FakeServer, FakeServer]]:
    with FakeServer(heartbeat=HB) as primary, FakeServer(heartbeat=HB) as backup:
        backup.silent = True  # passive: no HUGZ, no snapshots, no updates
        yield primary, backup


def make_client(*servers: FakeServer, **kw: object) -> Clone:
    kw.setdefault("heartbeat", HB)
    return Clone([s.endpoint for s in servers], **kw)  # type: ignore[arg-type]


def client_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("clone-")]


def test_sync_get_and_missing_keys(server: FakeServer) -> None:
    server.publish("a", b"1")
    with make_client(server) as c:
        c.wait_synced(5)
        assert c.get("a") == b"1"
        assert c.get("missing") is None
        assert c.get("missing", b"dflt") == b"dflt"
        assert c.get("missing") is None  # the agent is still alive
        st = c.status()
        assert st.state == "active" and st.server == server.endpoint
        assert st.sequence == 1 and st.keys == 1


def test_confirmed_write_is_visible_to_the_next_read(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        for i in range(50):
            c.set(f"k{i}", f"value {i}", wait=True, timeout=5)
            assert c.get(f"k{i}") == f"value {i}".encode()
        c.delete("k0", wait=True, timeout=5)
        assert c.get("k0") is None
        assert [k for k, _ in c.items("k1")][:2] == ["k1", "k10"]


def test_fire_and_forget_write_shows_up(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        c.set("k", b"v", ttl=30)
        eventually(lambda: c.get("k") == b"v", what="the write to come back")
        entry = c.entry("k")
        assert entry is not None and entry.prop("ttl") == "30"


def test_unconfirmed_write_times_out_and_is_resent(server: FakeServer) -> None:
    server.ignore_kvsets = True
    with make_client(server) as c:
        c.wait_synced(5)
        t0 = time.monotonic()
        with pytest.raises(ConfirmTimeout, match="not confirmed"):
            c.set("k", b"v", wait=True, timeout=0.5)
        assert 0.45 < time.monotonic() - t0 < 2.0
        assert server.kvsets >= 2  # the agent resent it
        eventually(lambda: c.status().pending_writes == 0, what="the agent to give up")


def test_api_misuse_raises_value_or_type_errors(server: FakeServer) -> None:
    with make_client(server) as c:
        with pytest.raises(TypeError):
            c.set("k", 12)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="delete"):
            c.set("k", b"")
        with pytest.raises(ValueError):
            c.set("k", b"v", ttl=-1)
        with pytest.raises(ValueError):
            c.set("HUGZ", b"v")
        with pytest.raises(ValueError):
            c.connect("udp://localhost:5556")  # host:port alone is tcp
        with pytest.raises(ValueError):
            c.connect("localhost")
        with pytest.raises(TypeError):
            c.get(b"k")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Clone(subtree="not-a-subtree")


def test_unknown_command_gets_an_error(server: FakeServer) -> None:
    with make_client(server) as c:
        with pytest.raises(CloneError, match="unknown command"):
            c._request(b"BOGUS", [])
        assert c.get("x") is None


def test_async_writes_time_out_each_with_its_own_deadline(server: FakeServer) -> None:
    server.ignore_kvsets = True
    with make_client(server) as c:
        c.wait_synced(5)
        short = c.set_async("a", b"1", timeout=0.3)
        long = c.delete_async("b", timeout=30)
        with pytest.raises(ConfirmTimeout, match=r"'a' was not confirmed .* within 0.3 s"):
            short.result(5)
        assert not long.done(), "a later deadline must not fail with the earlier one"
    # Closing the client fails what is still in flight, rather than leaving it hanging.
    with pytest.raises(ClosedError):
        long.result(5)


def test_a_write_the_agent_refuses_fails_its_future(server: FakeServer) -> None:
    """One-way writes get no reply; a refusal comes back on the event pipe."""
    with make_client(server) as c:
        c.wait_synced(5)
        # Built without validation, so only the agent's decoder can catch it.
        bad = KVMsg("HUGZ", 0, new_uuid(), (), b"v")
        fut = c._write_async(bad, 5)
        with pytest.raises(CloneError, match=r"refused the write: .*reserved"):
            fut.result(5)
        c.set("still/works", b"1", wait=True, timeout=5)


def test_async_writes_are_confirmed(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        futures = [c.set_async(f"k{i}", f"v{i}", timeout=5) for i in range(50)]
        for fut in futures:
            assert fut.result(10) > 0  # the sequence the server gave it
        assert [c.get(f"k{i}") for i in range(50)] == [f"v{i}".encode() for i in range(50)]
        with pytest.raises(ValueError, match="delete"):
            c.set_async("k", b"")


def test_close_is_clean_and_idempotent(server: FakeServer) -> None:
    before = set(client_threads())
    c = make_client(server)
    c.wait_synced(5)
    c.close()
    c.close()
    assert set(client_threads()) <= before
    with pytest.raises(ClosedError):
        c.get("a")
    with pytest.raises(ClosedError):
        c.set("a", b"b")


def test_several_clients_in_one_process(server: FakeServer) -> None:
    clients = [make_client(server) for _ in range(4)]
    try:
        for c in clients:
            c.wait_synced(5)
        for i, c in enumerate(clients):
            c.set(f"from{i}", str(i), wait=True, timeout=5)
        clients[0].close()  # closing one leaves the others working
        for c in clients[1:]:
            eventually(partial(lambda c: len(c.items()) == 4, c), what="every write everywhere")
            assert c.items() == clients[1].items()
    finally:
        for c in clients:
            c.close()


def test_wait_synced_names_the_servers_it_tried() -> None:
    dead = f"tcp://127.0.0.1:{free_base_port()}"
    with Clone([dead], heartbeat=0.05) as c:
        with pytest.raises(NotSynced, match=r"no server answered a snapshot request within 0\.3 s"):
            c.wait_synced(0.3)
        assert c.status().counters["retries"] >= 1


def test_garbage_from_the_server_is_counted_and_dropped(server: FakeServer) -> None:
    server.publish("a", b"1")
    with make_client(server) as c:
        c.wait_synced(5)
        garbage: list[list[bytes]] = [
            [b"only one frame"],
            [b"k", b"short", b"", b"", b"v"],
            [b"k", bytes(8), b"bad uuid", b"", b"v"],
            [b"\xff\xfe", bytes(8), b"", b"", b"v"],
            [b"k", bytes(8), b"", b"no-equals-sign\n", b"v"],
            [b"HUGZ", b"x"],
            [b"KTHXBAI", bytes(8), b"", b"", b"/"],
        ]
        for frames in garbage:
            server.inject("pub", frames)
        eventually(
            lambda: c.status().protocol_errors >= len(garbage) - 1,
            what="protocol errors to be counted",
        )
        c.set("b", b"2", wait=True, timeout=5)
        assert c.items() == [("a", b"1"), ("b", b"2")]
        assert c.status().state == "active"


def test_garbage_in_a_snapshot_does_not_stop_the_sync(server: FakeServer) -> None:
    server.publish("a", b"1")
    with make_client(server) as c:
        c.wait_synced(5)
        server.inject("snapshot", [b"\x00garbage"])
        server.inject("snapshot", [b"KTHXBAI", b"\x01"])
        eventually(lambda: c.status().protocol_errors >= 2, what="errors to be counted")
        assert c.get("a") == b"1"


def test_sequence_hole_forces_a_resync(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        server.drop_next_publications = 1
        server.publish("lost", b"1")
        server.publish("seen", b"2")
        eventually(lambda: c.get("lost") == b"1", what="the resync to recover the key")
        st = c.status()
        assert st.gaps >= 1 and st.resyncs >= 1 and st.sequence == 2


def test_missed_tail_is_noticed_through_hugz(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        server.drop_next_publications = 1
        server.publish("tail", b"1")  # nothing follows it but HUGZ
        eventually(lambda: c.get("tail") == b"1", what="HUGZ to reveal the hole")
        assert c.status().gaps == 1


def test_failover_resyncs_with_a_fresh_map(pair: tuple[FakeServer, FakeServer]) -> None:
    primary, backup = pair
    for srv in pair:
        srv.publish("keep", b"1")
        srv.publish("gone", b"1")
    with make_client(primary, backup) as c:
        c.wait_synced(5)
        changes: list[Entry] = []
        c.on_change(changes.append)
        assert c.get("gone") == b"1"
        # The primary dies; meanwhile on the backup "gone" is deleted.
        backup.call(lambda: backup.map.pop("gone"))
        primary.silent = True
        backup.silent = False
        t0 = time.monotonic()
        eventually(lambda: c.status().server == backup.endpoint, what="failover")
        eventually(lambda: c.status().state == "active", what="resync")
        elapsed = time.monotonic() - t0
        assert elapsed < 2.5 * HB + 1.0
        assert c.get("gone") is None
        assert c.get("keep") == b"1"
        assert c.status().failovers == 1
        eventually(lambda: any(ch.key == "gone" and ch.deleted for ch in changes))


def test_lost_connection_fails_over_without_waiting_for_the_timeout() -> None:
    """The active server's process goes away: failover on the lost connection.

    The server timeout is set to 60 s, so only the disconnect can explain a
    failover within the test's deadline.
    """
    primary = FakeServer(heartbeat=HB)
    primary.start()
    try:
        with FakeServer(heartbeat=HB) as backup:
            for srv in (primary, backup):
                srv.publish("k", b"1")
            backup.publish("only-on-backup", b"2")
            with make_client(primary, backup, server_timeout=60.0) as c:
                c.wait_synced(5)
                assert c.status().server == primary.endpoint
                primary.stop()  # its sockets close, as a killed process's would
                eventually(
                    lambda: c.status().server == backup.endpoint and c.status().state == "active",
                    timeout=10,
                    what="failover on the lost connection",
                )
                counters = c.status().counters
                assert counters["disconnect_failovers"] == 1
                assert counters["failovers"] == 1
                assert counters["disconnects"] >= 1
                assert counters["last_failover_gap_ms"] > 0
                assert c.get("only-on-backup") == b"2"
    finally:
        primary.stop()


def test_frozen_server_keeps_its_connection_and_is_found_by_silence(
    pair: tuple[FakeServer, FakeServer],
) -> None:
    primary, backup = pair
    with make_client(primary, backup) as c:
        c.wait_synced(5)
        primary.silent = True  # alive, connected, saying nothing
        backup.silent = False
        eventually(
            lambda: c.status().server == backup.endpoint and c.status().state == "active",
            what="failover on silence",
        )
        counters = c.status().counters
        assert counters["failovers"] == 1 and counters["disconnect_failovers"] == 0


def test_refused_snapshot_requests_are_repeated_on_the_same_server(
    pair: tuple[FakeServer, FakeServer],
) -> None:
    """A server that ignores the first requests (a passive server refusing the
    vote until it notices its peer's death) is asked again, not left."""
    primary, backup = pair
    primary.ignore_next_snapshots = 3
    primary.publish("k", b"1")
    with make_client(primary, backup, server_timeout=5.0) as c:
        c.wait_synced(5)
        st = c.status()
        assert st.server == primary.endpoint
        assert st.failovers == 0
        assert st.counters["retries"] >= 3
        assert primary.snapshot_requests >= 4
        assert c.get("k") == b"1"


def test_failover_to_a_backup_that_has_not_yet_noticed(
    pair: tuple[FakeServer, FakeServer],
) -> None:
    """The client sees the primary die before the backup does: the backup
    refuses the first requests, then answers one of the re-asks."""
    primary, backup = pair
    backup.silent = False
    backup.ignore_next_snapshots = 4
    for srv in pair:
        srv.publish("k", b"1")
    with make_client(primary, backup, server_timeout=60.0) as c:
        c.wait_synced(5)
        primary.stop()
        eventually(
            lambda: c.status().server == backup.endpoint and c.status().state == "active",
            timeout=10,
            what="sync with the backup",
        )
        counters = c.status().counters
        assert counters["failovers"] == 1 and counters["disconnect_failovers"] == 1
        assert counters["retries"] >= 4
        assert backup.snapshot_requests >= 5
        assert c.get("k") == b"1"


def test_a_kvpub_from_the_other_server_ends_the_wait_on_a_guide_style_passive(
    pair: tuple[FakeServer, FakeServer],
) -> None:
    """Listed first, a passive server of the Guide's kind sends bare HUGZ and
    drops our requests.  The active one's KVPUBs show where to go, long before
    the (here 5 s) server timeout."""
    active, passive = pair
    passive.silent = False  # bare HUGZ, like the Guide's passive servers
    passive.answer_snapshots = False
    active.publish("k", b"1")
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.wait(0.05):
            active.publish(f"t{i % 10}", b"x")
            i += 1

    writer = threading.Thread(target=traffic, name="test-traffic")
    writer.start()
    try:
        t0 = time.monotonic()
        with make_client(passive, active, server_timeout=5.0) as c:
            c.wait_synced(5)
            elapsed = time.monotonic() - t0
            assert c.get("k") == b"1"
            st = c.status()
            assert st.server == active.endpoint
            assert st.counters["hint_failovers"] == 1 and st.failovers == 1
    finally:
        stop.set()
        writer.join(5)
    assert elapsed < 1.0, elapsed
    assert passive.snapshot_requests >= 1


def test_confirmed_write_is_resent_to_the_new_server(pair: tuple[FakeServer, FakeServer]) -> None:
    primary, backup = pair
    primary.ignore_kvsets = True  # it dies before republishing the write
    with make_client(primary, backup) as c:
        c.wait_synced(5)
        result: list[BaseException | None] = []

        def write() -> None:
            try:
                c.set("precious", b"1", wait=True, timeout=5)
                result.append(None)
            except BaseException as exc:
                result.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        eventually(
            lambda: primary.kvsets >= 1 and c.status().pending_writes == 1,
            what="the write to reach the primary and stay unconfirmed",
        )
        primary.silent = True
        backup.silent = False  # a passive server would have ignored the write too
        writer.join(6)
        assert result == [None]
        assert c.get("precious") == b"1"
        assert backup.map["precious"].body == b"1"


def test_on_change_runs_in_the_callback_thread_and_may_reenter(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        seen: list[tuple[str, bytes | None, str]] = []

        def callback(entry: Entry) -> None:
            # re-entrant: a read from inside a callback must not deadlock
            seen.append((entry.key, c.get(entry.key), threading.current_thread().name))
            if entry.key == "boom":
                raise RuntimeError("callback errors are logged, not fatal")

        c.on_change(callback)
        c.set("boom", b"x", wait=True, timeout=5)
        c.set("a", b"1", wait=True, timeout=5)
        c.delete("a", wait=True, timeout=5)
        eventually(lambda: len(seen) == 3, what="three callbacks")
        assert [s[0] for s in seen] == ["boom", "a", "a"]
        assert all(name.startswith("clone-callbacks-") for *_, name in seen)


def test_changes_iterator_with_prefix_and_timeout(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        stream = c.changes(timeout=1.0, prefix="/x/")
        got: list[Entry] = []

        def consume() -> None:
            got.extend(stream)

        t = threading.Thread(target=consume)
        t.start()  # no wait needed: the stream is registered since changes()
        c.set("/x/1", b"a", wait=True)
        c.set("/y/1", b"b", wait=True)
        c.delete("/x/1", wait=True)
        t.join(3)
        assert not t.is_alive()
        assert [(e.key, e.value) for e in got] == [("/x/1", b"a"), ("/x/1", None)]
        # A delete is an update with its own sequence, which watchers see.
        assert 0 < got[0].sequence < got[1].sequence


def test_changes_are_registered_before_the_first_next(server: FakeServer) -> None:
    """A change between the call and the first next() is not lost."""
    with make_client(server) as c:
        c.wait_synced(5)
        stream = c.changes(timeout=5.0)
        server.publish("early", b"1")
        eventually(lambda: c.get("early") == b"1", what="the update to be applied")
        entry = next(stream)
        assert (entry.key, entry.value) == ("early", b"1")
        stream.close()


def test_changes_unregister_on_close_exit_and_release(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        stream = c.changes()
        assert len(c._callbacks._watchers) == 1
        stream.close()
        assert c._callbacks._watchers == []
        assert list(stream) == []  # a closed stream is exhausted, not blocked

        with c.changes() as scoped:
            assert len(c._callbacks._watchers) == 1
        assert c._callbacks._watchers == []
        assert list(scoped) == []

        # Dropped without closing: skipped at once, pruned at the next registration.
        dropped = c.changes()
        watcher = c._callbacks._watchers[0]
        del dropped
        assert watcher.closed
        c.set("k", b"v", wait=True, timeout=5)
        assert watcher.queue.empty()
        with c.changes():
            assert watcher not in c._callbacks._watchers


def test_changes_on_a_closed_client_raise_at_once(server: FakeServer) -> None:
    c = make_client(server)
    c.close()
    with pytest.raises(ClosedError):
        c.changes()


def test_closing_the_client_ends_a_blocked_iteration(server: FakeServer) -> None:
    with make_client(server) as c:
        c.wait_synced(5)
        stream = c.changes()
    assert list(stream) == []


def test_subtrees_isolate_keys(server: FakeServer) -> None:
    for key in ("/a/1", "/b/1", "/c/1"):
        server.publish(key, b"v")
    with make_client(server, subtree=["/a/", "/b/"]) as c:
        c.wait_synced(5)
        assert [k for k, _ in c.items()] == ["/a/1", "/b/1"]
        c.set("/c/2", b"outside", wait=True, timeout=5)  # confirmed, but not held
        c.set("/a/2", b"inside", wait=True, timeout=5)
        assert c.get("/c/2") is None
        assert [k for k, _ in c.items()] == ["/a/1", "/a/2", "/b/1"]
        assert c.status().gaps == 0


def test_foreign_snapshot_reply_and_fake_hugz(server: FakeServer) -> None:
    """A KTHXBAI while active and a HUGZ behind our sequence change nothing."""
    server.publish("a", b"1")
    with make_client(server) as c:
        c.wait_synced(5)
        server.inject("snapshot", encode_kthxbai(99))
        server.inject("pub", encode_hugz(0))
        server.inject("pub", encode_kv(KVMsg("a", 1, b"", (), b"stale")))
        c.set("b", b"2", wait=True, timeout=5)
        assert c.get("a") == b"1"
        assert c.status().counters["stale"] == 1


def test_module_level_default_client(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLONE_SERVERS", server.endpoint)
    default_mod._close_default()
    try:
        clone.clone_set("/default/k", "v", timeout=5)
        assert clone.clone_get("/default/k") == b"v"
        assert clone.clone_get("/default/missing") is None
    finally:
        default_mod._close_default()


def test_default_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLONE_SERVERS", raising=False)
    assert client_mod.default_servers() == ["tcp://127.0.0.1:5556", "tcp://127.0.0.1:5566"]
    monkeypatch.setenv("CLONE_SERVERS", " tcp://h:1 ,tcp://h:11,")
    assert client_mod.default_servers() == ["tcp://h:1", "tcp://h:11"]


def test_public_api() -> None:
    """The public API is exactly this: a change to it is a decision, not an accident."""
    assert sorted(clone.__all__) == [
        "AgentTimeout",
        "Clone",
        "CloneError",
        "CloseReport",
        "ClosedError",
        "ConfirmTimeout",
        "Conflict",
        "Entry",
        "Freshness",
        "HistoryCompacted",
        "Lease",
        "LeaseLost",
        "LeaseQuotaExceeded",
        "NotActive",
        "NotJSON",
        "NotOwner",
        "NotSynced",
        "SplitConflict",
        "Status",
        "Subscription",
        "WriteRefused",
        "clone_get",
        "clone_set",
        "errors",
    ]
    namespace: dict[str, object] = {}
    exec("from clone import *", namespace)  # every listed name is importable
    assert set(namespace) - {"__builtins__"} == set(clone.__all__)
    assert clone.ClosedError is ClosedError and issubclass(ClosedError, CloneError)
    assert sorted(client_mod.__all__) == [
        "ChangeStream",
        "Clone",
        "CloseReport",
        "DEFAULT_SERVERS",
        "Entry",
        "Freshness",
        "Lease",
        "Status",
        "Subscription",
        "clone_get",
        "clone_set",
        "default_curve_files",
        "default_servers",
        "load_curve_keys",
    ]
    for name in client_mod.__all__:
        assert hasattr(client_mod, name), name


def test_large_map_reads_in_one_command(server: FakeServer) -> None:
    """A large map is synced and listed within the default command timeout (the
    reply used to be five frames per entry)."""
    n = 50_000

    def fill() -> None:
        for i in range(n):
            props = (("expires", "9.5"),) if i % 1000 == 0 else ()
            server.map[f"/big/{i:06d}"] = KVMsg(
                f"/big/{i:06d}", i + 1, new_uuid(), props, b"v%d" % i
            )
        server.map["/other"] = KVMsg("/other", n + 1, b"", (), b"o")
        server.sequence = n + 1

    server.call(fill)
    with make_client(server) as c:
        # The sync is 50,001 KVSYNCs, sent and read by threads of this one
        # process: about 1 s here on an idle machine; the ceiling only bounds
        # a hang.  The commands below are what must fit the command timeout.
        c.wait_synced(60)
        assert c.status().keys == n + 1
        items = c.items("/big/")
        assert len(items) == n
        assert items[0] == ("/big/000000", b"v0") and items[-1] == (
            f"/big/{n - 1:06d}",
            b"v%d" % (n - 1),
        )
        entries = c.entries()
        assert len(entries) == n + 1 and entries[-1] == Entry("/other", b"o", n + 1)
        assert entries[1000] == Entry("/big/001000", b"v1000", 1001, (("expires", "9.5"),))
        assert c.entry("/big/001000") == entries[1000]
        assert c.items("/nothing/") == []


def test_client_asks_for_batches_and_takes_kvsyncs_from_a_guide_style_server(
    server: FakeServer,
) -> None:
    """The request carries our KVBATCH metadata; a server that ignores it (as the
    fake one and the Guide's do) answers with KVSYNCs, which sync as ever."""
    for i in range(20):
        server.publish(f"/k/{i:02d}", b"v%d" % i)
    with make_client(server) as c:
        c.wait_synced(5)
        assert server.batch_requests >= 1
        assert server.batch_requests == server.snapshot_requests
        assert c.items()[3] == ("/k/03", b"v3") and len(c.items()) == 20


def test_a_malformed_kvbatch_in_the_snapshot_is_dropped_and_counted(server: FakeServer) -> None:
    server.publish("a", b"1")
    good = encode_kvbatch([b"x", b"y"], [(bytes(8), b"", b"", b"1"), (bytes(8), b"", b"", b"2")])
    bad = list(good)
    bad[2] = b"x\xff"  # entry 1's key is not UTF-8
    server.snapshot_prefix = [bad, [b"KVBATCH", *[b"\x00"] * 9]]
    with make_client(server) as c:
        c.wait_synced(5)
        assert c.items() == [("a", b"1")]  # nothing of the bad batches
        eventually(lambda: c.status().protocol_errors == 2, what="both batches counted")
        c.set("b", b"2", wait=True, timeout=5)  # the agent carries on
        assert c.get("b") == b"2" and c.status().state == "active"
