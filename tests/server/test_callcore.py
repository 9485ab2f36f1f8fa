"""Calls, compare-and-set and leases driven alone: CallCore with its state
objects, raw CALL? frames and explicit times, no ServerCore and no sockets."""

from __future__ import annotations

from collections import defaultdict

import pytest

from clone.errors import ProtocolError
from clone.server.callcore import Admitted, CallCore
from clone.server.history import History
from clone.server.leases import LeaseTable
from clone.server.pending import UuidWindow
from clone.server.store import Store
from clone.wire.calls import (
    OP_AHEAD,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_REVOKE,
    OP_SET,
    Reply,
    encode_call,
    lease_id_of,
    lease_key,
)
from clone.wire.codec import KVMsg, decode_update


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Active:
    """A CallCore with what it touches, and every update it recorded."""

    def __init__(self, *, quota: int = 10, max_leases: int = 10) -> None:
        self.store = Store()
        self.leases = LeaseTable(max_leases)
        self.window = UuidWindow(1000)
        self.history = History(1000, 1 << 20)
        self.counters: defaultdict[str, int] = defaultdict(int)
        self.recorded: list[list[bytes]] = []
        self.calls = CallCore(
            store=self.store,
            leases=self.leases,
            window=self.window,
            history=self.history,
            counters=self.counters,
            record=self._record,
            max_leases_per_client=quota,
            conditions_max=3,
        )
        self.n = 0

    def _record(self, frames: list[bytes]) -> None:
        self.recorded.append(frames)
        self.history.append(frames, 1)

    def call(
        self,
        op: str,
        now: float,
        key: str = "",
        body: bytes = b"",
        *,
        caller: str = "",
        **props: str,
    ) -> tuple[Reply, bool]:
        self.n += 1
        frames = encode_call(op, _uuid(self.n), key, tuple(props.items()), body)
        admitted = self.calls.admit(frames, caller=caller)
        assert isinstance(admitted, Admitted), admitted
        return self.calls.run(admitted.call, now, now, admitted.caller)

    def keys(self) -> list[str]:
        out = []
        for frames in self.recorded:
            msg = decode_update(frames)
            assert isinstance(msg, KVMsg)
            out.append(msg.key)
        return out


def test_admission_refuses_before_any_role() -> None:
    a = Active()
    assert a.calls.admit([b"garbage"]) is None  # no uuid: nothing to answer
    bad = a.calls.admit(encode_call(OP_SET, _uuid(1), "/k", (("if_sequence", "x"),), b"v"))
    assert isinstance(bad, Reply) and bad.reason == "bad-if-sequence"
    acl = a.calls.admit(encode_call(OP_SET, _uuid(2), "/k", (), b"v"), can_write=lambda k: False)
    assert isinstance(acl, Reply) and acl.reason == "acl"
    named = encode_call(OP_LEASE_GRANT, _uuid(3), "", (("caller", "name:x"), ("ttl", "5")))
    assert isinstance(a.calls.admit(named), Reply)  # only a trusted relay names a caller
    relayed = a.calls.admit(named, caller="relay", relayed=True)
    assert isinstance(relayed, Admitted) and relayed.caller == "name:x"
    assert a.counters["calls_received"] == 5 and a.counters["calls_refused_acl"] == 2
    assert a.recorded == []


def test_compare_and_set_wins_once() -> None:
    a = Active()
    first, changed = a.call(OP_SET, 1.0, "/k", b"one", if_sequence="0")
    assert first.ok and changed and first.sequence == 1
    lost, changed = a.call(OP_SET, 1.0, "/k", b"two", if_sequence="0")
    assert lost.status == "conflict" and lost.current == 1 and not changed
    assert a.keys() == ["/k"] and a.counters["calls_conflict"] == 1


def test_a_retry_gets_what_the_first_got() -> None:
    a = Active()
    frames = encode_call(OP_SET, _uuid(50), "/k", (), b"v")
    for _ in range(2):
        admitted = a.calls.admit(frames)
        assert isinstance(admitted, Admitted)
        reply, _ = a.calls.run(admitted.call, 1.0, 1.0)
        assert reply.ok and reply.sequence == 1
    assert len(a.recorded) == 1 and a.counters["calls_duplicate"] == 1


def test_a_lease_binds_keys_and_its_end_deletes_them() -> None:
    a = Active()
    granted, _ = a.call(OP_LEASE_GRANT, 0.0, ttl="2", caller="name:me")
    lease = granted.lease
    assert lease == lease_id_of(_uuid(1))
    bound, _ = a.call(OP_SET, 0.0, "/lock/a", b"me", lease=lease or "", caller="name:me")
    assert bound.ok
    kept, _ = a.call(OP_LEASE_KEEPALIVE, 1.5, lease=lease, caller="name:me")
    assert kept.ok and a.counters["lease_keepalives"] == 1
    a.recorded.clear()
    a.calls.expire_leases(3.4, 100)  # kept alive at 1.5: due at 3.5
    assert a.recorded == []
    a.calls.expire_leases(3.5, 100)
    assert a.keys() == ["/lock/a", lease_key(lease or "")]
    assert a.counters["leases_expired"] == 1 and a.counters["lease_keys_deleted"] == 1


def test_only_the_owner_uses_a_lease() -> None:
    a = Active()
    granted, _ = a.call(OP_LEASE_GRANT, 0.0, ttl="5", caller="name:me")
    stolen, changed = a.call(OP_LEASE_REVOKE, 1.0, lease=granted.lease or "", caller="name:you")
    assert stolen.reason == "not-owner" and not changed
    revoked, changed = a.call(OP_LEASE_REVOKE, 1.0, lease=granted.lease or "", caller="name:me")
    assert revoked.ok and changed and a.counters["leases_revoked"] == 1


def test_the_per_client_quota_refuses_the_next_grant() -> None:
    a = Active(quota=1)
    assert a.call(OP_LEASE_GRANT, 0.0, ttl="5", caller="name:me")[0].ok
    refused, _ = a.call(OP_LEASE_GRANT, 0.0, ttl="5", caller="name:me")
    assert refused.reason == "lease-quota"
    assert a.call(OP_LEASE_GRANT, 0.0, ttl="5", caller="name:other")[0].ok


def test_ahead_counts_the_older_contenders() -> None:
    a = Active()
    for n, who in enumerate(("a", "b", "c")):
        granted, _ = a.call(OP_LEASE_GRANT, 0.0, ttl="5", caller=f"name:{who}")
        a.call(OP_SET, 0.0, f"/q/{n}", b"x", lease=granted.lease or "", caller=f"name:{who}")
    reply, changed = a.call(OP_AHEAD, 0.0, "/q/2")
    assert reply.ok and reply.ahead == 2 and not changed


def test_a_kvset_naming_a_condition_is_judged_like_a_call() -> None:
    a = Active()
    msg = KVMsg("/k", 0, _uuid(9), (("if_sequence", "0"),), b"v")
    plain = a.calls.check_kvset(msg, b"/k")
    assert plain.prop("if_sequence") is None  # a condition is never stored
    assert a.calls.take_conditions() == {_uuid(9): 0}
    assert a.calls.take_conditions() == {}  # a new term starts empty
    with pytest.raises(ProtocolError):
        a.calls.check_kvset(KVMsg("/k", 0, _uuid(10), (("lease", "0" * 32),), b"v"), b"/k")
    assert a.counters["kvset_unknown_lease"] == 1


def test_conditions_are_bounded() -> None:
    a = Active()
    for n in range(5):
        a.call(OP_SET, 0.0, f"/k{n}", b"v", if_sequence="0")
    assert list(a.calls.take_conditions()) == [_uuid(3), _uuid(4), _uuid(5)]


def test_rebuild_gives_each_stored_lease_a_whole_ttl_and_drops_orphans() -> None:
    a = Active()
    granted, _ = a.call(OP_LEASE_GRANT, 0.0, ttl="2", caller="name:me")
    a.call(OP_SET, 0.0, "/held", b"v", lease=granted.lease or "", caller="name:me")
    other, _ = a.call(OP_LEASE_GRANT, 0.0, ttl="2", caller="name:me")
    a.call(OP_SET, 0.0, "/orphan", b"v", lease=other.lease or "", caller="name:me")
    a.store.apply(KVMsg(lease_key(other.lease or ""), 0), 0.0)  # its lease key gone
    a.leases.clear()  # a promotion starts with no lease table
    a.recorded.clear()
    a.calls.rebuild_leases(100.0)
    assert a.keys() == ["/orphan"]
    assert granted.lease in a.leases and a.counters["lease_orphans_deleted"] == 1
    a.calls.expire_leases(101.9, 100)  # a whole ttl from the rebuild
    assert a.keys() == ["/orphan"]
    a.calls.expire_leases(102.0, 100)
    assert a.keys() == ["/orphan", "/held", lease_key(granted.lease or "")]
