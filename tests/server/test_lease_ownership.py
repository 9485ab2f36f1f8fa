"""Lease ownership and the per-client quota, in the server
core with explicit times, and the rule itself (clone.server.ownership).

Only the client that took a lease may keep it alive, revoke it or bind keys to
it: under CURVE the same certificate name, without it whoever sends the grant's
secret.  A lease from before ownership existed is nobody's.
"""

from __future__ import annotations

import hashlib

import pytest

from clone.server.core import CoreSettings, Role, ServerCore
from clone.server.leases import lease_owner
from clone.server.ownership import (
    PEER_PRINCIPAL,
    grant_owner,
    may_use,
    name_principal,
    secret_owner,
)
from clone.wire.calls import (
    LEASE_PREFIX,
    OP_AHEAD,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_REVOKE,
    OP_SET,
    Reply,
    encode_call,
)
from clone.wire.codec import KVMsg, decode_update, encode_kv
from tests.server.test_server_core import _snapshot_of

ALICE = name_principal("alice")
MALLORY = name_principal("mallory")
SECRET = "5e" * 16
OTHER_SECRET = "77" * 16


# -- the rule -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "principal", "secret", "allowed"),
    [
        (ALICE, ALICE, None, True),
        (ALICE, MALLORY, None, False),
        (ALICE, MALLORY, SECRET, False),  # a name owner is proven by the name only
        (ALICE, "addr:127.0.0.1", None, False),
        (secret_owner(SECRET), "addr:10.0.0.1", SECRET, True),
        (secret_owner(SECRET), "addr:127.0.0.1", SECRET, True),  # any address
        (secret_owner(SECRET), "addr:127.0.0.1", OTHER_SECRET, False),
        (secret_owner(SECRET), "addr:127.0.0.1", None, False),
        (secret_owner(SECRET), ALICE, None, False),
        (None, ALICE, None, False),  # from before ownership: nobody
        (None, "addr:127.0.0.1", SECRET, False),
        (None, PEER_PRINCIPAL, None, True),  # the pair itself (split-brain writes)
        (ALICE, PEER_PRINCIPAL, None, True),
    ],
)
def test_may_use(owner: str | None, principal: str, secret: str | None, allowed: bool) -> None:
    assert may_use(owner, principal, secret) is allowed


def test_grant_owner_keeps_only_a_hash_of_the_secret() -> None:
    assert grant_owner(ALICE, SECRET) == (ALICE, "")
    owner, secret = grant_owner("addr:127.0.0.1", SECRET)
    assert secret == SECRET and SECRET not in owner
    assert owner == "secret:" + hashlib.sha256(SECRET.encode()).hexdigest()
    owner, picked = grant_owner("addr:127.0.0.1", None, lambda: OTHER_SECRET)
    assert picked == OTHER_SECRET and owner == secret_owner(OTHER_SECRET)


# -- the core -----------------------------------------------------------------


class Caller:
    """One client of a core: its principal, and the call uuids it makes."""

    counter = 0

    def __init__(self, core: ServerCore, principal: str, *, relayed: bool = False) -> None:
        self.core = core
        self.principal = principal
        self.relayed = relayed

    def call(
        self, op: str, now: float = 0.0, key: str = "", body: bytes = b"", **props: str
    ) -> Reply:
        Caller.counter += 1
        uuid = (10_000 + Caller.counter).to_bytes(16, "big")
        reply, _ = self.core.on_call(
            encode_call(op, uuid, key, tuple(props.items()), body),
            now,
            caller=self.principal,
            relayed=self.relayed,
        )
        assert reply is not None
        return reply

    def grant(self, ttl: float = 2.0, now: float = 0.0, **props: str) -> Reply:
        reply = self.call(OP_LEASE_GRANT, now, ttl=repr(ttl), **props)
        assert reply.ok, reply
        return reply


@pytest.fixture
def core() -> ServerCore:
    return ServerCore(standalone=True)


def _stored_props(core: ServerCore, key: str) -> bytes:
    entry = core.store.entry(key.encode())
    assert entry is not None
    return entry[2]


def test_a_named_owner_alone_may_use_its_lease(core: ServerCore) -> None:
    alice, mallory = Caller(core, ALICE), Caller(core, MALLORY)
    lease = alice.grant().lease
    assert lease_owner(_stored_props(core, LEASE_PREFIX + lease)) == ALICE
    for op, props in (
        (OP_LEASE_KEEPALIVE, {"lease": lease}),
        (OP_LEASE_REVOKE, {"lease": lease}),
    ):
        refused = mallory.call(op, 0.5, **props)
        assert (refused.status, refused.reason) == ("refused", "not-owner")
    bind = mallory.call(OP_SET, 0.5, "/t1/x", b"v", lease=lease)
    assert bind.reason == "not-owner" and "/t1/x" not in core.store
    assert core.counters["calls_not_owner"] == 3
    assert lease in core.leases
    # The owner still can, all three.
    assert alice.call(OP_LEASE_KEEPALIVE, 1.0, lease=lease).ok
    assert alice.call(OP_SET, 1.0, "/secret/bound", b"v", lease=lease).ok
    assert alice.call(OP_LEASE_REVOKE, 1.5, lease=lease).ok
    assert "/secret/bound" not in core.store and lease not in core.leases


def test_without_curve_the_secret_is_the_proof_and_is_never_stored(core: ServerCore) -> None:
    owner, thief = Caller(core, "addr:10.0.0.1"), Caller(core, "addr:10.0.0.2")
    reply = owner.grant(secret=SECRET)
    lease = reply.lease
    assert reply.secret == SECRET and lease != SECRET
    assert thief.call(OP_LEASE_KEEPALIVE, lease=lease).reason == "not-owner"
    assert thief.call(OP_LEASE_REVOKE, lease=lease, secret=OTHER_SECRET).reason == "not-owner"
    assert owner.call(OP_LEASE_REVOKE, lease=lease).reason == "not-owner"  # no secret, no use
    # The secret works from anywhere (a client that reconnected, or a relay).
    assert thief.call(OP_SET, 0.0, "/svc/a", b"up", lease=lease, secret=SECRET).ok
    published = [decode_update(frames) for op in core.journal.take() for frames in op.updates]
    assert all(isinstance(m, KVMsg) for m in published)
    # Neither the lease key nor the bound key nor anything published holds it.
    for msg in published:
        assert isinstance(msg, KVMsg)
        assert SECRET not in repr(msg.properties) and SECRET.encode() not in msg.body
    assert SECRET.encode() not in _stored_props(core, LEASE_PREFIX + lease)
    assert _stored_props(core, "/svc/a") == f"lease={lease}\n".encode()
    assert owner.call(OP_LEASE_REVOKE, lease=lease, secret=SECRET).ok


def test_the_server_picks_a_secret_when_the_grant_has_none(core: ServerCore) -> None:
    caller = Caller(core, "addr:10.0.0.1")
    reply = caller.grant()
    assert len(reply.secret) == 32 and reply.secret != reply.lease
    assert caller.call(OP_LEASE_KEEPALIVE, lease=reply.lease, secret=reply.secret).ok


def test_only_a_trusted_relay_may_name_the_caller(core: ServerCore) -> None:
    relay = Caller(core, name_principal("relay1"), relayed=True)
    tenant = Caller(core, MALLORY)
    forged = tenant.call(OP_LEASE_GRANT, ttl="2", caller=ALICE)
    assert (forged.reason, core.counters["calls_refused_acl"]) == ("acl", 1)
    # A write bound to no lease is the same whoever asked: the claim is ignored.
    assert tenant.call(OP_SET, 0.0, "/k", b"v", caller=ALICE).ok
    # Through the trusted relay, alice's lease is alice's, not the relay's.
    lease = relay.call(OP_LEASE_GRANT, ttl="2", caller=ALICE).lease
    assert lease_owner(_stored_props(core, LEASE_PREFIX + lease)) == ALICE
    assert Caller(core, ALICE).call(OP_LEASE_KEEPALIVE, lease=lease).ok
    assert relay.call(OP_LEASE_REVOKE, lease=lease, caller=MALLORY).reason == "not-owner"
    assert relay.call(OP_LEASE_REVOKE, lease=lease).reason == "not-owner"  # the relay's own name
    assert relay.call(OP_LEASE_REVOKE, lease=lease, caller=ALICE).ok


def test_the_per_client_quota(core: ServerCore) -> None:
    core = ServerCore(CoreSettings(max_leases_per_client=2), standalone=True)
    alice, mallory = Caller(core, ALICE), Caller(core, MALLORY)
    first = mallory.grant().lease
    mallory.grant()
    refused = mallory.call(OP_LEASE_GRANT, ttl="2")
    assert (refused.reason, core.counters["calls_refused_lease_quota"]) == ("lease-quota", 1)
    assert alice.grant().ok  # another client is not held back
    assert mallory.call(OP_LEASE_REVOKE, lease=first).ok
    assert mallory.grant().ok  # a revoke frees a place
    # An expiry frees one too.
    core.tick(10.0)
    assert core.leases.held_by(MALLORY) == 0
    assert mallory.grant(now=10.0).ok


def test_a_kvset_may_not_bind_a_key_to_a_lease(core: ServerCore) -> None:
    lease = Caller(core, ALICE).grant().lease
    frames = encode_kv(KVMsg("/k", 0, b"\x01" * 16, (("lease", lease),), b"v"))
    with pytest.raises(Exception, match="bind keys to a lease with a CALL"):
        core.on_kvset(frames, 0.0)
    assert "/k" not in core.store and core.counters["kvset_lease_refused"] == 1


def test_the_pair_itself_may_bind_a_split_brain_write(core: ServerCore) -> None:
    lease = Caller(core, ALICE).grant().lease
    assert Caller(core, PEER_PRINCIPAL).call(OP_SET, 0.0, "/k", b"v", lease=lease).ok


def test_ownership_survives_a_failover_and_old_leases_are_nobodys() -> None:
    old = ServerCore(standalone=True)
    owned = Caller(old, ALICE).grant().lease
    # A lease key as a server before ownership wrote it: no owner= property.
    legacy = "ab" * 16
    old.store.apply(KVMsg(LEASE_PREFIX + legacy, 0, b"\x02" * 16, (), b"ttl=2.0"), 0.0)
    new = ServerCore()
    new.become_passive()
    new.start_sync()
    for frames in _snapshot_of(old):
        new.on_snapshot_reply(frames, 0.0)
    new.become_active(3.0)
    assert new.role is Role.ACTIVE and {owned, legacy} <= set(new.leases._leases)
    alice = Caller(new, ALICE)
    assert alice.call(OP_LEASE_KEEPALIVE, 3.5, lease=owned).ok
    assert Caller(new, MALLORY).call(OP_LEASE_KEEPALIVE, 3.5, lease=owned).reason == "not-owner"
    assert new.leases.held_by(ALICE) == 1  # a name's leases count again
    # Fail closed: nobody may keep the old lease alive; it ends a ttl later.
    refused = alice.call(OP_LEASE_KEEPALIVE, 3.5, lease=legacy)
    assert refused.reason == "not-owner" and "predates" in refused.detail
    new.tick(5.1)
    assert legacy not in new.leases and owned in new.leases


# -- a lock's queue, told to a contender that may not read it ----------------------


def test_ahead_counts_the_lease_bound_contenders_before_a_key(core: ServerCore) -> None:
    a, b = Caller(core, ALICE), Caller(core, MALLORY)
    la, lb = a.grant().lease, b.grant().lease
    assert a.call(OP_SET, 0.0, "/lk/a", b"1", lease=la, if_sequence="0").ok
    assert b.call(OP_SET, 0.0, "/lk/b", b"1", lease=lb, if_sequence="0").ok
    assert a.call(OP_SET, 0.0, "/lkother/x", b"1", lease=la).ok  # another name
    assert a.call(OP_SET, 0.0, "/lk/plain", b"1").ok  # bound to no lease: not a contender
    first, second = a.call(OP_AHEAD, key="/lk/a"), b.call(OP_AHEAD, key="/lk/b")
    assert (first.ok, first.ahead) == (True, 0)
    assert (second.ok, second.ahead) == (True, 1)
    assert second.sequence == core.store.get("/lk/b").sequence  # type: ignore[union-attr]
    assert a.call(OP_LEASE_REVOKE, lease=la).ok
    assert b.call(OP_AHEAD, key="/lk/b").ahead == 0
    gone = a.call(OP_AHEAD, key="/lk/a")
    assert (gone.status, gone.current) == ("conflict", 0)
    # It needs write access to the key, as a write would.
    reply, _ = core.on_call(
        encode_call(OP_AHEAD, b"\x09" * 16, "/lk/b"), 0.0, can_write=lambda key: False
    )
    assert reply is not None and reply.reason == "acl"
