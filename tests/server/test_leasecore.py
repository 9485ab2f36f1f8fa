"""The lease calls driven alone: LeaseCore with its state objects, decoded
calls and explicit times, no CallCore, no ServerCore and no sockets."""

from __future__ import annotations

from collections import defaultdict

from clone.server.leasecore import LeaseCore
from clone.server.leases import LeaseTable
from clone.server.pending import UuidWindow
from clone.server.store import Store
from clone.wire.calls import (
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_KEEPALIVES,
    OP_LEASE_REVOKE,
    Call,
    encode_keepalives,
    lease_key,
)
from clone.wire.codec import KVMsg, decode_update


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Leases:
    """A LeaseCore with what it touches, and every update it recorded."""

    def __init__(self, *, quota: int = 10) -> None:
        self.store = Store()
        self.table = LeaseTable(10)
        self.window = UuidWindow(1000)
        self.counters: defaultdict[str, int] = defaultdict(int)
        self.recorded: list[str] = []
        self.core = LeaseCore(store=self.store, leases=self.table, window=self.window,
                              counters=self.counters, record=self._record,
                              max_leases_per_client=quota)  # fmt: skip

    def _record(self, frames: list[bytes]) -> None:
        msg = decode_update(frames)
        assert isinstance(msg, KVMsg)
        self.recorded.append(msg.key)

    def grant(self, n: int, who: str, mono: float = 0.0, ttl: str = "2") -> str:
        reply, changed = self.core.grant(Call(OP_LEASE_GRANT, _uuid(n), "", (("ttl", ttl),)),
                                         mono, mono, who)  # fmt: skip
        assert reply.ok and changed, reply
        return reply.lease


def test_a_grant_is_written_once_and_a_retry_answered_only_to_its_owner() -> None:
    s = Leases()
    lease = s.grant(1, "name:me")
    assert s.recorded == [lease_key(lease)] and s.counters["leases_granted"] == 1
    again = Call(OP_LEASE_GRANT, _uuid(1), "", (("ttl", "2"),))
    retry, changed = s.core.grant(again, 0.5, 0.5, "name:me")
    assert retry.ok and retry.lease == lease and not changed
    stranger, _ = s.core.grant(again, 0.5, 0.5, "name:you")
    assert stranger.reason == "not-owner"
    assert s.recorded == [lease_key(lease)] and s.counters["calls_duplicate"] == 1


def test_keepalives_judge_each_lease_and_the_call_is_ok() -> None:
    s = Leases()
    mine, theirs = s.grant(1, "name:me"), s.grant(2, "name:you")
    gone = "f" * 32
    body = encode_keepalives([(mine, ""), (theirs, ""), (gone, "")])
    reply = s.core.keepalives(Call(OP_LEASE_KEEPALIVES, _uuid(3), "", (), body), 1.5, "name:me")
    assert reply.ok and reply.kept == 1
    assert reply.gone == ((theirs, "not-owner"), (gone, "unknown-lease"))
    s.core.expire_leases(3.4, 100)  # mine, kept alive at 1.5, lives to 3.5
    assert s.recorded[-1] == lease_key(theirs) and mine in s.table
    s.core.expire_leases(3.5, 100)
    assert mine not in s.table and s.counters["leases_expired"] == 2


def test_keepalive_and_revoke_need_the_owner() -> None:
    s = Leases()
    lease = s.grant(1, "name:me")
    keep = Call(OP_LEASE_KEEPALIVE, _uuid(2), "", (("lease", lease),))
    assert s.core.keepalive_or_revoke(keep, 1.0, "name:you")[0].reason == "not-owner"
    kept, changed = s.core.keepalive_or_revoke(keep, 1.0, "name:me")
    assert kept.ok and kept.ttl == 2.0 and not changed
    revoke = Call(OP_LEASE_REVOKE, _uuid(3), "", (("lease", lease),))
    revoked, changed = s.core.keepalive_or_revoke(revoke, 1.0, "name:me")
    assert revoked.ok and changed and lease not in s.table
    unknown, _ = s.core.keepalive_or_revoke(revoke, 1.0, "name:me")
    assert unknown.reason == "unknown-lease" and s.counters["calls_unknown_lease"] == 1


def test_the_quota_counts_per_client() -> None:
    s = Leases(quota=1)
    s.grant(1, "name:me")
    over, changed = s.core.grant(Call(OP_LEASE_GRANT, _uuid(2), "", (("ttl", "2"),)),
                                 0.0, 0.0, "name:me")  # fmt: skip
    assert over.reason == "lease-quota" and not changed
    s.grant(3, "name:other")
