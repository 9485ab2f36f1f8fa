"""Compare-and-set and leases through the client library, against real
``clone-server`` processes (tests/support/servers.py: 100 ms heartbeats).

The wire contract itself is held by tests/server/test_calls_e2e.py with a raw
DEALER; these check what an application sees: the sequences, the errors, the
keys of a lease going away, and a lease kept alive across a failover.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from clone import Clone, Conflict, LeaseLost, NotActive
from clone.wire.calls import OP_LEASE_REVOKE, decode_reply, encode_call
from clone.wire.codec import new_uuid
from tests.support.servers import ServerProcess, Servers
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HB = 0.1


def endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


@contextmanager
def client(*srv: ServerProcess, **kw: object) -> Iterator[Clone]:
    kw.setdefault("heartbeat", HB)
    kw.setdefault("server_timeout", 5 * HB)
    c = Clone([endpoint(s) for s in srv], **kw)  # type: ignore[arg-type]
    try:
        c.wait_synced(10)
        yield c
    finally:
        c.close()


def raw_revoke(server: ServerProcess, lease_id: str, secret: str) -> None:
    """Revoke a lease behind its holder's back, as another process that was
    given its secret would (only the owner's secret can: docs/client.md)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint(server))
        sock.send_multipart(
            encode_call(
                OP_LEASE_REVOKE, new_uuid(), properties=(("lease", lease_id), ("secret", secret))
            )
        )
        assert sock.poll(5000), "no reply to the revoke"
        assert decode_reply(sock.recv_multipart()).ok
    finally:
        ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def shared(module_servers: Servers) -> ServerProcess:
    """One server for the lease tests, each under keys of its own (a server
    start is about 0.2 CPU-s).  The compare-and-set test keeps one of its own:
    it checks that each write's sequence is the one before plus one, which a
    lease of another test expiring meanwhile would break."""
    return module_servers.standalone()


#: The tests of ``shared``, on one xdist worker so that it starts once.
SHARED = pytest.mark.xdist_group("test_calls_client_shared")


def test_compare_and_set_and_the_sequences_writes_return(servers: Servers) -> None:
    server = servers.standalone()
    with client(server) as c:
        plain = c.set("/plain", "1", wait=True)
        entry = c.entry("/plain")
        assert entry is not None and plain == entry.sequence
        created = c.set("/cas", "1", if_sequence=0)
        assert created == plain + 1
        with pytest.raises(Conflict) as info:
            c.set("/cas", "again", if_sequence=0)
        assert info.value.current == created and info.value.expected == 0
        updated = c.set("/cas", "2", if_sequence=created)
        with pytest.raises(Conflict):
            c.set("/cas", "3", if_sequence=created)  # stale: someone (we) wrote since
        eventually(lambda: c.get("/cas") == b"2", 5)
        held = c.entry("/cas")
        assert held is not None and held.sequence == updated
        assert "if_sequence" not in dict(held.properties)  # a condition, never stored
        with pytest.raises(Conflict) as info:
            c.delete("/absent", if_sequence=5)
        assert info.value.current == 0
        deleted = c.delete("/cas", if_sequence=updated)
        assert deleted == updated + 1
        eventually(lambda: c.get("/cas") is None, 5)
        assert c.delete("/plain", wait=True) == deleted + 1


@SHARED
def test_lease_keys_go_on_revoke_and_on_leaving_the_with_block(shared: ServerProcess) -> None:
    server = shared
    with client(server) as holder, client(server) as reader:
        lease = holder.lease(1.0)
        holder.set("/svc/a", "up", lease=lease)
        eventually(lambda: reader.get("/svc/a") == b"up", 5)
        entry = reader.entry("/svc/a")
        assert entry is not None and entry.lease == lease.id
        time.sleep(2.0)  # twice the ttl: kept alive
        assert reader.get("/svc/a") == b"up" and lease.alive
        lease.revoke()
        eventually(lambda: reader.get("/svc/a") is None, 5, "the revoked lease's key gone")
        with holder.lease(1.0) as scoped:
            holder.set("/svc/b", "up", lease=scoped)
            eventually(lambda: reader.get("/svc/b") == b"up", 5)
        eventually(lambda: reader.get("/svc/b") is None, 5, "the key gone at the with's end")
        with pytest.raises(LeaseLost):
            holder.set("/svc/c", "up", lease=scoped)


@SHARED
def test_close_revokes_and_its_keys_go_at_once(shared: ServerProcess) -> None:
    server = shared
    with client(server) as reader:
        holder = Clone([endpoint(server)], heartbeat=HB)
        lease = holder.lease(30.0)
        holder.set("/held", "1", lease=lease)
        eventually(lambda: reader.get("/held") == b"1", 5)
        holder.close()
        eventually(lambda: reader.get("/held") is None, 3, "deleted well before the 30 s ttl")


@SHARED
def test_a_lease_revoked_elsewhere_is_lost_and_told(shared: ServerProcess) -> None:
    server = shared
    with client(server) as holder, client(server) as other:
        lease = holder.lease(0.9)
        holder.set("/lock", "holder", lease=lease)
        lost: list[str] = []
        lease.on_lost(lambda gone: lost.append(gone.why))
        raw_revoke(server, lease.id, lease._secret)
        assert lease.wait_lost(0.9 + 1.0), "told within a keepalive period or so"
        assert lease.lost and "unknown-lease" in lease.why
        eventually(lambda: len(lost) == 1, 3, "the on_lost callback")
        with pytest.raises(LeaseLost):
            holder.set("/lock", "again", lease=lease)
        with pytest.raises(LeaseLost) as info:
            other.set("/lock", "other", lease=lease.id)  # the server says so
        assert info.value.lease_id == lease.id
        assert holder.status().counters["leases_lost"] == 1


def test_a_lease_outlives_a_failover_of_the_pair(servers: Servers) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as holder:
        lease = holder.lease(1.0)
        holder.set("/svc/x", "up", lease=lease)
        sequence = holder.set("/svc/cas", "1", if_sequence=0)
        primary.kill9()
        eventually(
            lambda: (
                holder.status().server == endpoint(backup) and holder.status().state == "active"
            ),
            10,
            "failover to the backup",
        )
        # The new active gave the lease a full ttl, and our keepalives reach it.
        time.sleep(3.0)
        assert lease.alive
        assert holder.get("/svc/x") == b"up"
        with client(backup) as fresh:
            assert fresh.get("/svc/x") == b"up"
            # Compare-and-set on the new active, against what the old one wrote.
            with pytest.raises(Conflict):
                fresh.set("/svc/cas", "2", if_sequence=0)
            assert fresh.set("/svc/cas", "2", if_sequence=sequence) > sequence
            lease.revoke()
            eventually(lambda: fresh.get("/svc/x") is None, 5)


def test_calls_to_a_pair_with_no_active_server_raise_not_active(servers: Servers) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as c:
        primary.kill9()
        backup.kill9()
        start = time.monotonic()
        with pytest.raises(NotActive, match="within 1 s"):
            c.set("/k", "v", if_sequence=0, timeout=1.0)
        assert time.monotonic() - start < 3.0


def _many_leases(holder: Clone, n: int, ttl: float) -> list:  # list[Lease]
    leases = [holder.lease(ttl) for _ in range(n)]
    for i, lease in enumerate(leases):
        holder.set(f"/many/{i}", "up", lease=lease)
    return leases


@SHARED
def test_many_leases_are_kept_alive_by_batched_keepalives(shared: ServerProcess) -> None:
    """A client's leases fall into step and one lease-keepalives call
    keeps them all alive; none is lost, every key stays."""
    server = shared
    with client(server) as holder, client(server) as reader:
        # 2 s, not 1: at a loaded run's start a commit of this shared server
        # took 1.27 s, and 1 s leases were gone before their keys were written
        # (docs/testing.md, "Tenth pass").
        leases = _many_leases(holder, 200, 2.0)
        start = holder.status().counters["keepalive_batches"]
        # Several ttls' worth of batches (a batch per ttl/3 once in step).
        eventually(lambda: holder.status().counters["keepalive_batches"] - start >= 9, 30,
                   "nine batched keepalives")
        counters = holder.status().counters
        assert all(lease.alive for lease in leases)
        assert counters["leases_lost"] == 0
        # One call per batch, not per lease.
        assert counters["keepalives"] >= 20 * counters["keepalive_batches"]
        eventually(lambda: all(reader.get(f"/many/{i}") == b"up" for i in range(200)), 5)


def test_batched_keepalives_follow_a_failover(servers: Servers) -> None:
    primary, backup = servers.pair()
    with client(primary, backup) as holder:
        leases = _many_leases(holder, 50, 1.0)
        primary.kill9()
        eventually(
            lambda: (
                holder.status().server == endpoint(backup) and holder.status().state == "active"
            ),
            10,
            "failover to the backup",
        )
        start = holder.status().counters["keepalive_batches"]
        eventually(lambda: holder.status().counters["keepalive_batches"] - start >= 6, 15,
                   "batched keepalives reach the new active")
        assert all(lease.alive for lease in leases)
        with client(backup) as fresh:
            assert all(fresh.get(f"/many/{i}") == b"up" for i in range(50))
