"""Leases through a relay, end to end: a client that knows only the
relay takes a lease, binds a key to it and keeps it alive through the relay's
forwarded calls, across a kill -9 of the pair's active; its revoke, or its
death, deletes the key on the pair and on the relay.

Real processes on loopback with 100 ms heartbeats; every wait has a deadline;
the fixture stops every server, the ``workers`` fixture every worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from clone import Clone
from tests.client.test_coordination_e2e import Worker
from tests.support.clients import endpoint, synced_client
from tests.support.servers import Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HEARTBEAT = 0.1  # the servers' (tests.support.servers)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def _holds(client: Clone, key: str) -> bool:
    return client.get(key) is not None


def test_a_lease_through_a_relay_outlives_its_ttl_and_a_failover_until_revoked(
    servers: Servers,
) -> None:
    primary, backup = servers.pair("--in-memory")
    relay = servers.relay(primary, backup)
    ttl = 1.0
    with (
        synced_client(relay) as client,
        synced_client(relay) as on_relay,
        synced_client(primary, backup) as on_pair,
    ):
        lease = client.lease(ttl=ttl)
        client.set("/svc/a", "up", lease=lease, wait=True)
        eventually(lambda: _holds(on_pair, "/svc/a"), 5, "the key on the pair")
        eventually(lambda: _holds(on_relay, "/svc/a"), 5, "the key on the relay")
        # What is tested is time passing: keepalives every ttl/3, through the relay.
        time.sleep(3.2 * ttl)
        assert lease.alive, lease.why
        assert on_pair.get("/svc/a") == b"up" and on_relay.get("/svc/a") == b"up"
        assert client.get(f"/_clone/lease/{lease.id}") is not None

        offset = relay.log_size()
        primary.kill9()
        relay.wait_log(f"synced from 127.0.0.1:{backup.port}", timeout=15, after=offset)
        eventually(lambda: on_pair.status().server == endpoint(backup), 10, "pair client moved")
        time.sleep(3.2 * ttl)  # the keepalives go on, to the new active
        assert lease.alive, lease.why
        assert on_pair.get("/svc/a") == b"up" and on_relay.get("/svc/a") == b"up"
        assert client.get("/svc/a") == b"up"

        revoked = time.monotonic()
        lease.revoke()
        for who in (on_pair, on_relay, client):
            eventually(lambda who=who: not _holds(who, "/svc/a"), 2, "the key deleted")
        assert time.monotonic() - revoked < 1.0
        # The lease's own record is deleted a sequence after its keys: wait for it.
        eventually(lambda: on_relay.get(f"/_clone/lease/{lease.id}") is None, 2,
                   "the lease record deleted")
    stats = read_stats(relay)
    assert stats["upstream_switches"] >= 1
    assert stats["calls_forwarded"] >= 6  # grant, set, keepalives, revoke


def test_a_killed_lease_holder_behind_a_relay_loses_its_key_within_ttl_and_a_heartbeat(
    servers: Servers, workers: list[Worker]
) -> None:
    primary, backup = servers.pair("--in-memory")
    relay = servers.relay(primary, backup)
    ttl = 1.0
    with synced_client(relay) as on_relay, synced_client(primary, backup) as on_pair:
        worker = Worker("lease", endpoint(relay), "/nodes/w1", str(ttl))
        workers.append(worker)
        _, ready = worker.wait_for("ready")
        lease_id = ready.split()[1]
        eventually(lambda: _holds(on_pair, "/nodes/w1"), 5, "the registration on the pair")
        eventually(lambda: _holds(on_relay, "/nodes/w1"), 5, "the registration on the relay")
        entry = on_relay.entry("/nodes/w1")
        assert entry is not None and entry.prop("lease") == lease_id
        time.sleep(2.5 * ttl)  # alive, it keeps its key past the ttl
        assert _holds(on_pair, "/nodes/w1") and _holds(on_relay, "/nodes/w1")
        worker.kill9()
        killed = time.monotonic()
        eventually(lambda: not _holds(on_pair, "/nodes/w1"), 5, "the key deleted on the pair")
        on_pair_after = time.monotonic() - killed
        eventually(lambda: not _holds(on_relay, "/nodes/w1"), 5, "the key deleted on the relay")
        on_relay_after = time.monotonic() - killed
        # The lease's own record goes after its keys (the same turn, a later
        # sequence): a reader may see the one without the other for a moment.
        eventually(lambda: on_relay.get(f"/_clone/lease/{lease_id}") is None, 5, "the record")
    # The last keepalive left at most ttl/3 before the kill, and one more hop
    # (the relay) carries it: the key goes at most ttl + a housekeeping turn
    # after it, plus delivery.
    assert on_pair_after <= ttl + HEARTBEAT + 0.25, on_pair_after
    assert on_relay_after <= ttl + HEARTBEAT + 0.35, on_relay_after


def test_batched_keepalives_through_a_relay(servers: Servers) -> None:
    """A client's lease-keepalives call and its five-frame reply pass
    the relay (the reply names the leases not kept); every lease stays."""
    primary, backup = servers.pair("--in-memory")
    relay = servers.relay(primary, backup)
    with synced_client(relay) as client:
        leases = [client.lease(ttl=1.0) for _ in range(30)]
        start = client.status().counters["keepalive_batches"]
        eventually(lambda: client.status().counters["keepalive_batches"] - start >= 6, 15,
                   "batched keepalives through the relay")
        assert all(lease.alive for lease in leases), [x.why for x in leases if not x.alive]
        assert client.status().counters["leases_lost"] == 0
    stats = read_stats(relay)
    assert stats["call_replies_forwarded"] >= 6
