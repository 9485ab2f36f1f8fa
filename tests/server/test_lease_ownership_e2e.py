"""Lease ownership and the per-client quota on real processes.

A tenant reads another client's lease id from a key's ``lease=`` property (any
reader can) and tries to revoke it, keep it alive and bind a key to it:
directly and through a relay, with and without CURVE.  Every attempt is
refused ``not-owner`` and changes nothing, while the owner still can do all
three.  The tenant's calls go through a raw DEALER (what a hostile client
sends), the owner's through the library (which sends the secret itself).

Every server is stopped by the fixture, every socket closed with linger 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq

from clone import Clone, LeaseQuotaExceeded, NotOwner, WriteRefused
from clone.wire.calls import (
    OP_LEASE_KEEPALIVE,
    OP_LEASE_REVOKE,
    OP_SET,
    Reply,
    decode_reply,
    encode_call,
)
from clone.wire.codec import new_uuid
from tests.support.clients import endpoint, synced_client
from tests.support.curve import CurveKeys, curve_socket, wait_serving_curve
from tests.support.ports import free_base_port
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HB = 0.1


def _call(sock: zmq.Socket[Any], op: str, key: str = "", body: bytes = b"", **props: str) -> Reply:
    uuid = new_uuid()
    sock.send_multipart(encode_call(op, uuid, key, tuple(props.items()), body))
    assert sock.poll(5000), f"no REPLY to {op} within 5 s"
    reply = decode_reply(sock.recv_multipart())
    assert reply.uuid == uuid
    return reply


def _attack(sock: zmq.Socket[Any], lease_id: str, key: str) -> list[str]:
    """What a tenant gets trying to use someone else's lease: the three reasons."""
    wrong = "00" * 16  # a guess at the secret
    return [
        _call(sock, OP_LEASE_REVOKE, lease=lease_id).reason,
        _call(sock, OP_LEASE_KEEPALIVE, lease=lease_id, secret=wrong).reason,
        _call(sock, OP_SET, key, b"mine", lease=lease_id).reason,
    ]


def _plain_dealer(ctx: zmq.Context[Any], server: ServerProcess) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint(server))
    return sock


def _owner_still_can(owner: Clone, watcher: Clone, lease_key: str, bound: str) -> None:
    """The owner binds another key, and its revoke deletes what it bound."""
    lease = owner._leases[lease_key]
    owner.set(bound + "-2", "ok", lease=lease)
    assert lease.alive and lease.valid
    lease.revoke()
    # The revoke's deletions arrive as separate updates: the watcher may show
    # the first before the second.
    eventually(lambda: watcher.get(bound) is None and watcher.get(bound + "-2") is None, 5,
               "the owner's revoke deleted both its keys")


# -- without CURVE: the secret ------------------------------------------------------


@pytest.mark.parametrize("via_relay", [False, True], ids=["direct", "relay"])
def test_a_plain_tenant_cannot_use_another_clients_lease(
    servers: Servers, ctx: zmq.Context[Any], via_relay: bool
) -> None:
    primary, backup = servers.pair("--in-memory")
    entry_point = servers.relay(primary, backup) if via_relay else primary
    with (
        synced_client(entry_point) as owner,
        synced_client(primary, backup) as watcher,
    ):
        lease = owner.lease(1.0)
        owner.set("/t1/bound", "owner", lease=lease)
        eventually(lambda: watcher.entry("/t1/bound") is not None, 5, "the bound key")
        entry = watcher.entry("/t1/bound")
        assert entry is not None and entry.prop("lease") == lease.id  # public
        tenant = _plain_dealer(ctx, entry_point)
        assert _attack(tenant, lease.id, "/t1/stolen") == ["not-owner"] * 3
        # Through the library too: a typed error.
        with synced_client(entry_point) as other, pytest.raises(NotOwner) as refused:
            other.set("/t1/stolen", "x", lease=lease.id)
        assert refused.value.reason == "not-owner"
        # Nothing changed: the key is there, the lease lives on its keepalives
        # for three ttls (the tenant's keepalive did nothing either way).
        eventually(lambda: owner.status().counters.get("keepalives", 0) >= 9, 10, "keepalives")
        assert lease.alive and watcher.get("/t1/bound") == b"owner"
        assert watcher.get("/t1/stolen") is None
        _owner_still_can(owner, watcher, lease.id, "/t1/bound")
    assert read_stats(primary)["calls_not_owner"] == 4


def test_the_per_client_quota_without_curve(servers: Servers) -> None:
    server = servers.standalone("--in-memory", "--max-leases-per-client", "3")
    with synced_client(server) as client:
        leases = [client.lease(5.0) for _ in range(3)]
        with pytest.raises(LeaseQuotaExceeded) as refused:
            client.lease(5.0)
        assert isinstance(refused.value, WriteRefused) and refused.value.reason == "lease-quota"
        leases[0].revoke()
        assert client.lease(5.0).alive  # a revoke frees a place
    assert read_stats(server)["calls_refused_lease_quota"] == 1


# -- CURVE: the certificate name ----------------------------------------------------


@pytest.fixture
def up(tmp_path: Path) -> CurveKeys:
    """The pair's keys: admin writes everything, tenant /t1/ only, and two relays."""
    keys = CurveKeys.make(tmp_path / "up", admitted=("admin", "tenant", "relay", "untrusted"))
    keys.write_acl(
        {
            "admin": ([""], [""]),
            "tenant": (["/t1/"], ["/t1/"]),
            "relay": ([""], [""]),
            "untrusted": ([""], [""]),
        }
    )
    return keys


@pytest.fixture
def down(tmp_path: Path) -> CurveKeys:
    """The relay's own keys, with the same two clients."""
    keys = CurveKeys.make(tmp_path / "down", admitted=("admin", "tenant"))
    keys.write_acl({"admin": ([""], [""]), "tenant": (["/t1/"], ["/t1/"])})
    return keys


def _curve_relay(
    servers: Servers, upstream: ServerProcess, up: CurveKeys, down: CurveKeys, name: str
) -> ServerProcess:
    port = free_base_port()
    args = [
        "--relay", "--port", str(port), "--upstream", f"127.0.0.1:{upstream.port}",
        "--bind", "127.0.0.1", "--heartbeat", str(servers.heartbeat_ms), "--verbose",
        "--upstream-curve-secret", str(up.secret(name)),
        "--upstream-server-key", str(up.pair_public),
        *down.server_args(),
    ]  # fmt: skip
    relay = servers.spawn(f"relay-{name}", args, port, None)
    relay.wait_log("synced from")
    wait_serving_curve(relay, down)
    return relay


def _curve_client(server: ServerProcess, keys: CurveKeys, name: str) -> Clone:
    client = Clone([endpoint(server)], heartbeat=HB, confirm_timeout=5.0, **keys.client(name))
    try:
        client.wait_synced(10)
    except BaseException:
        client.close()
        raise
    return client


def test_a_curve_tenant_cannot_use_the_admins_lease_directly_or_through_a_relay(
    servers: Servers, up: CurveKeys, down: CurveKeys, ctx: zmq.Context[Any]
) -> None:
    server = servers.standalone(
        *up.server_args(), "--in-memory", "--trusted-relay", "relay", wait=False
    )
    wait_serving_curve(server, up)
    relay = _curve_relay(servers, server, up, down, "relay")
    with (
        _curve_client(server, up, "admin") as admin,
        _curve_client(relay, down, "admin") as relayed_admin,
        _curve_client(server, up, "tenant") as watcher,
    ):
        lease = admin.lease(1.0)
        admin.set("/secret/bound", "admin", lease=lease)
        admin.set("/t1/bound", "admin", lease=lease)
        eventually(lambda: watcher.entry("/t1/bound") is not None, 5, "the tenant sees it")
        entry = watcher.entry("/t1/bound")
        assert entry is not None
        lease_id = entry.prop("lease")
        assert lease_id == lease.id
        direct = curve_socket(ctx, zmq.DEALER, up, "tenant")
        direct.connect(endpoint(server))
        assert _attack(direct, lease_id, "/t1/stolen") == ["not-owner"] * 3
        # Even with the admin's secret: under CURVE the name is the proof.
        stolen = _call(direct, OP_LEASE_REVOKE, lease=lease_id, secret=lease._secret)
        assert stolen.reason == "not-owner"
        relayed = curve_socket(ctx, zmq.DEALER, down, "tenant")
        relayed.connect(endpoint(relay))
        assert _attack(relayed, lease_id, "/t1/stolen") == ["not-owner"] * 3
        # A client cannot pass itself off as another through the relay either.
        forged = _call(relayed, OP_LEASE_REVOKE, lease=lease_id, caller="name:admin")
        assert forged.reason == "not-owner"
        eventually(lambda: admin.status().counters.get("keepalives", 0) >= 9, 10, "keepalives")
        assert lease.alive and admin.get("/secret/bound") == b"admin"
        # The relay forwards its client's name: the admin behind the relay is
        # the admin, and owns the lease taken directly.
        with _curve_client(server, up, "admin") as checker:
            relayed_lease = relayed_admin.lease(1.0)
            relayed_admin.set("/t1/via-relay", "ok", lease=relayed_lease)
            admin_sock = curve_socket(ctx, zmq.DEALER, down, "admin")
            admin_sock.connect(endpoint(relay))
            assert _call(admin_sock, OP_LEASE_KEEPALIVE, lease=lease.id).ok
            assert _call(relayed, OP_LEASE_REVOKE, lease=relayed_lease.id).reason == "not-owner"
            relayed_lease.revoke()
            eventually(lambda: checker.get("/t1/via-relay") is None, 5, "revoked via the relay")
        lease.revoke()
        eventually(lambda: admin.get("/secret/bound") is None, 5, "the owner's revoke")
    assert read_stats(server)["calls_not_owner"] == 9


def test_an_untrusted_curve_relay_cannot_take_leases_for_its_clients(
    servers: Servers, up: CurveKeys, down: CurveKeys
) -> None:
    server = servers.standalone(
        *up.server_args(), "--in-memory", "--trusted-relay", "relay", wait=False
    )
    wait_serving_curve(server, up)
    relay = _curve_relay(servers, server, up, down, "untrusted")
    with _curve_client(relay, down, "admin") as admin:
        with pytest.raises(WriteRefused) as refused:
            admin.lease(1.0)
        assert refused.value.reason == "acl"
        # A compare-and-set needs no lease: it goes through.
        assert admin.set("/t1/cas", "1", if_sequence=0) > 0
    server.wait_log("--trusted-relay")


def test_the_per_client_quota_counts_each_certificate(servers: Servers, up: CurveKeys) -> None:
    server = servers.standalone(
        *up.server_args(), "--in-memory", "--max-leases-per-client", "2", wait=False
    )
    wait_serving_curve(server, up)
    with (
        _curve_client(server, up, "tenant") as tenant,
        _curve_client(server, up, "admin") as admin,
    ):
        tenant.lease(5.0)
        tenant.lease(5.0)
        with pytest.raises(LeaseQuotaExceeded):
            tenant.lease(5.0)
        assert admin.lease(5.0).alive  # another client is not held back
