"""A client's resync against real servers: a catch-up (KVDELTA) when the
server's history still holds what it missed, a full snapshot otherwise; its
counters say which (tests/support/servers.py, 100 ms heartbeats)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from clone import Clone
from clone.client.status import query_status
from tests.support.clients import endpoint, synced_client
from tests.support.ports import free_base_port
from tests.support.servers import ServerProcess, Servers, read_stats, set_arg
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


def counters(client: Clone) -> dict[str, int]:
    return client.status().counters


def same_map(client: Clone, server: ServerProcess) -> None:
    """``client`` holds what a fresh full snapshot of ``server`` holds."""
    with synced_client(server) as fresh:
        eventually(lambda: client.items() == fresh.items(), what="the same map")


def test_a_client_catches_up_on_the_new_active_after_a_failover(servers: Servers) -> None:
    primary, backup = servers.pair()
    with synced_client(primary, backup) as client:
        for i in range(20):
            client.set(f"/k/{i:02d}", str(i), wait=True)
        client.delete("/k/03", wait=True)
        last = client.status().sequence
        # The backup followed every update: its history holds the client's last one.
        eventually(
            lambda: query_status([endpoint(backup)])[0]["sequence"] == last,
            what="the backup at the client's sequence",
        )
        primary.kill9()
        # The client's request is the vote that makes the backup take over.
        client.set("/after", "failover", wait=True, timeout=10)
        # Confirmed once the map holds it: during the catch-up, which may
        # not have ended yet.
        eventually(lambda: client.status().state == "active", what="the client active")
        assert client.status().server == endpoint(backup)
        c = counters(client)
        assert (c["syncs_full"], c["syncs_catchup"], c["catchups_abandoned"]) == (1, 1, 0), c
        assert c["failovers"] >= 1
        same_map(client, backup)
    stats = read_stats(backup)
    assert stats["client_catchups_served"] >= 1
    assert stats["catchups_served"] == 0  # the peer's alone


@contextmanager
def moved(server: ServerProcess, history: str | None) -> Iterator[Clone]:
    """``server`` on another port, where our client cannot see it: a client
    there writes while ours waits.  Then back on its port, ``--history``
    set if given."""
    server.terminate()
    set_arg(server, "--port", str(free_base_port()))
    server.start()
    port = server.args[server.args.index("--port") + 1]
    with Clone(f"tcp://127.0.0.1:{port}", heartbeat=0.1, server_timeout=0.5) as other:
        other.wait_synced(10)
        yield other
    server.terminate()
    set_arg(server, "--port", str(server.port))
    if history is not None:
        set_arg(server, "--history", history)
    server.start()
    server.wait_serving()


@pytest.mark.parametrize(
    ("history", "catch_up"), [(None, True), ("1", False)], ids=["history", "history-1"]
)
def test_a_client_back_from_a_short_outage(
    servers: Servers, history: str | None, catch_up: bool
) -> None:
    """The server gone for a while, updates made meanwhile: the client gets
    only those if the server's history still holds them (here the default
    100,000), a full snapshot with ``--history 1``."""
    server = servers.standalone()
    with synced_client(server) as client:
        for i in range(10):
            client.set(f"/k/{i}", "before", wait=True)
        last = client.status().sequence
        # Counted from here: a first KVPUB published before the client's
        # subscription reached the server is healed by a resync of its own
        # (the next HUGZ shows the gap), which is not what this test is about.
        before = counters(client)
        with moved(server, history) as other:
            for i in range(5):
                other.set(f"/k/{i}", "meanwhile", wait=True)
            other.delete("/k/9", wait=True)
        eventually(
            lambda: client.status().state == "active" and client.status().sequence == last + 6,
            what="the client back in sync",
        )
        after = counters(client)
        c = {name: after[name] - before.get(name, 0) for name in after}
        if catch_up:
            assert (c["syncs_full"], c["syncs_catchup"], c["catchup_updates"]) == (0, 1, 6), c
        else:
            assert (c["syncs_full"], c["syncs_catchup"]) == (1, 0), c
        assert after["catchups_abandoned"] == 0
        assert client.get("/k/0") == b"meanwhile" and client.get("/k/9") is None
        same_map(client, server)
