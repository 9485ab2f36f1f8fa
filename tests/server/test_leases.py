"""Leases and compare-and-set in the server core, with explicit times.

The core is driven by raw CALL? frames; an active core's journal is what would
be published, and a passive core follows it the way the sockets would.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.server.callcore import _PROBLEM_COUNTERS
from clone.server.core import CoreSettings, FollowOutcome, Role, ServerCore
from clone.server.leases import LeaseTable, bound_lease, parse_lease_value
from clone.server.metrics import CALL_RESULTS
from clone.wire.calls import (
    LEASE_PREFIX,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_REVOKE,
    OP_SET,
    Reply,
    encode_call,
    lease_id_of,
)
from clone.wire.codec import KVMsg, decode_update
from clone.wire.protocol import MAX_VALUE_BYTES
from tests.server.test_server_core import _snapshot_of
from tests.support.published import promote, tick


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Calls:
    """A core and a counter of call uuids; like the client library, it keeps
    each lease's secret and sends it with every call naming that lease."""

    def __init__(self, core: ServerCore) -> None:
        self.core = core
        self.n = 0
        self.secrets: dict[str, str] = {}

    def call(
        self,
        op: str,
        now: float,
        key: str = "",
        body: bytes = b"",
        uuid: bytes | None = None,
        **props: str,
    ) -> tuple[Reply, bool]:
        self.n += 1
        uuid = uuid or _uuid(1000 + self.n)
        lease = props.get("lease")
        if lease in self.secrets and "secret" not in props:
            props["secret"] = self.secrets[lease]
        reply, commit = self.core.on_call(
            encode_call(op, uuid, key, tuple(props.items()), body), now
        )
        assert reply is not None
        if reply.lease and reply.secret:
            self.secrets[reply.lease] = reply.secret
        return reply, commit

    def grant(self, ttl: float, now: float) -> str:
        reply, commit = self.call(OP_LEASE_GRANT, now, ttl=repr(ttl))
        assert reply.ok and commit
        return reply.lease

    def set(self, key: str, body: bytes, now: float, **props: str) -> Reply:
        return self.call(OP_SET, now, key, body, **props)[0]


def published(core: ServerCore) -> list[KVMsg]:
    """What the reactor would publish after this turn's commit."""
    out = []
    for op in core.journal.take():
        for frames in op.updates:
            msg = decode_update(frames)
            assert isinstance(msg, KVMsg)
            out.append(msg)
    return out


@pytest.fixture
def active() -> Calls:
    return Calls(ServerCore(standalone=True))


# -- compare-and-set ----------------------------------------------------------


def test_cas_applies_only_at_the_expected_sequence(active: Calls) -> None:
    created = active.set("/k", b"1", 0.0, if_sequence="0")
    assert created.ok and created.sequence == 1
    again = active.set("/k", b"x", 0.0, if_sequence="0")
    assert again.status == "conflict" and again.current == 1
    stale = active.set("/k", b"x", 0.0, if_sequence="7")
    assert stale.status == "conflict" and stale.current == 1
    ok = active.set("/k", b"2", 0.0, if_sequence="1")
    assert ok.ok and ok.sequence == 2
    assert active.core.store.get("/k") == KVMsg("/k", 2, ok_uuid(active), (), b"2")
    # A condition is never stored or published.
    assert [m.properties for m in published(active.core)] == [(), ()]
    c = active.core.counters
    assert c["calls_conflict"] == 2 and c["calls_ok"] == 2


def ok_uuid(calls: Calls) -> bytes:
    return _uuid(1000 + calls.n)


def test_cas_delete_and_absent_key(active: Calls) -> None:
    assert active.set("/k", b"", 0.0, if_sequence="1").current == 0
    assert active.set("/k", b"v", 0.0).ok
    deleted = active.set("/k", b"", 0.0, if_sequence="1")
    assert deleted.ok and "/k" not in active.core.store


def test_a_retried_call_is_not_applied_twice(active: Calls) -> None:
    uuid = _uuid(5)
    first, commit = active.call(OP_SET, 0.0, "/k", b"v", uuid=uuid, if_sequence="0")
    assert first.ok and commit
    # The same call again (its reply was lost): the first one's answer, no change.
    second, commit = active.call(OP_SET, 0.0, "/k", b"v", uuid=uuid, if_sequence="0")
    assert second.ok and second.sequence == first.sequence and not commit
    assert active.core.store.sequence == 1
    assert active.core.counters["calls_duplicate"] == 1


_CALL_COUNTERS = tuple(name for name in ServerCore().counters if name.startswith("calls_"))


@pytest.mark.parametrize(
    ("op", "props", "reason", "counter"),
    [
        (OP_SET, {"if_sequence": "-1"}, "bad-if-sequence", "calls_bad_if_sequence"),
        (OP_SET, {"if_sequence": "one"}, "bad-if-sequence", "calls_bad_if_sequence"),
        (OP_SET, {"lease": "abc"}, "bad-lease", "calls_bad_lease"),
        (OP_SET, {"lease": "0" * 32}, "unknown-lease", "calls_unknown_lease"),
        (OP_LEASE_KEEPALIVE, {"lease": "abc"}, "bad-lease", "calls_bad_lease"),
        (OP_LEASE_REVOKE, {}, "bad-lease", "calls_bad_lease"),
        (OP_LEASE_GRANT, {"ttl": "0.01"}, "bad-ttl", "calls_bad_ttl"),
        (OP_LEASE_GRANT, {"ttl": "nan"}, "bad-ttl", "calls_bad_ttl"),
    ],
)
def test_bad_calls_get_a_specific_reason_and_counter_and_change_nothing(
    active: Calls, op: str, props: dict[str, str], reason: str, counter: str
) -> None:
    key, body = ("/k", b"v") if op == OP_SET else ("", b"")
    reply, commit = active.call(op, 0.0, key, body, **props)
    assert reply.status == "refused" and reply.reason == reason and reply.detail
    assert not commit
    assert active.core.store.sequence == 0 and len(active.core.leases) == 0
    assert not published(active.core)
    counted = {n: v for n in _CALL_COUNTERS if (v := active.core.counters[n])}
    assert counted == {"calls_received": 1, counter: 1}


def test_an_oversized_call_counts_as_size_not_invalid(active: Calls) -> None:
    reply, _ = active.call(OP_SET, 0.0, "/k", b"x" * (MAX_VALUE_BYTES + 1))
    assert (reply.status, reply.reason) == ("refused", "size")
    c = active.core.counters
    assert (c["calls_refused_size"], c["calls_invalid"]) == (1, 0)
    assert active.core.store.sequence == 0


def test_server_keys_and_other_refusals(active: Calls) -> None:
    assert active.set(LEASE_PREFIX + "x", b"v", 0.0).reason == "reserved"
    broken, _ = active.core.on_call([b"CALL?", b"set", _uuid(1), b"", b"", b""], 0.0)
    assert broken is not None and broken.reason == "malformed"
    assert active.core.on_call([b"CALL?", b"set"], 0.0) == (None, False)
    refused, _ = active.core.on_call(
        encode_call(OP_SET, _uuid(2), "/k", (), b"v"), 0.0, can_write=lambda key: False
    )
    assert refused is not None and refused.reason == "acl"
    c = active.core.counters
    assert c["calls_reserved"] == 1 and c["calls_invalid"] == 2 and c["calls_refused_acl"] == 1


def test_a_named_grant_outside_the_write_acl_changes_nothing(active: Calls) -> None:
    """A lock's grant names its contender key: refused by the ACL before any
    lease exists, where an unnamed grant would have been let through."""
    core = active.core

    def jobs_only(key: bytes) -> bool:
        return key.startswith(b"/jobs/")

    ttl = (("ttl", "2.0"),)
    refused, commit = core.on_call(
        encode_call(OP_LEASE_GRANT, _uuid(1), "/locks/x/c1", ttl), 10.0, can_write=jobs_only
    )
    assert refused is not None and (refused.status, refused.reason) == ("refused", "acl")
    assert "/locks/x/c1" in refused.detail and not commit
    assert core.store.sequence == 0 and len(core.leases) == 0 and not published(core)
    assert core.counters["calls_refused_acl"] == 1 and core.counters["leases_granted"] == 0
    # The same client may lease for a key of its own, named or not.
    for n, key in ((2, "/jobs/locks/x/c1"), (3, "")):
        granted, commit = core.on_call(
            encode_call(OP_LEASE_GRANT, _uuid(n), key, ttl), 10.0, can_write=jobs_only
        )
        assert granted is not None and granted.ok and commit
    # A client that may write nothing gets no lease, named or not.
    for n, key in ((4, "/jobs/a"), (5, "")):
        nothing, _ = core.on_call(
            encode_call(OP_LEASE_GRANT, _uuid(n), key, ttl),
            10.0,
            can_write=lambda key: False,
            may_lease=False,
        )
        assert nothing is not None and nothing.reason == "acl"
    assert core.counters["calls_refused_acl"] == 3 and len(core.leases) == 2


def test_a_passive_server_says_it_is_not_active() -> None:
    passive = Calls(ServerCore())
    passive.core.become_passive()
    reply = passive.set("/k", b"v", 0.0, if_sequence="0")
    assert reply.reason == "not-active"
    assert passive.core.counters["calls_not_active"] == 1


def test_kvset_path_keeps_the_same_rules(active: Calls) -> None:
    core = active.core
    core.on_kvset([b"/k", bytes(8), _uuid(1), b"", b"v"], 0.0)
    with pytest.raises(Exception, match="expected sequence 0"):
        core.on_kvset([b"/k", bytes(8), _uuid(2), b"if_sequence=0\n", b"w"], 0.0)
    core.on_kvset([b"/k", bytes(8), _uuid(3), b"if_sequence=1\n", b"w"], 0.0)
    assert core.store.get("/k") == KVMsg("/k", 2, _uuid(3), (), b"w")
    with pytest.raises(Exception, match="lease"):
        core.on_kvset([b"/j", bytes(8), _uuid(4), f"lease={'0' * 32}\n".encode(), b"w"], 0.0)
    with pytest.raises(Exception, match="server's"):
        core.on_kvset([LEASE_PREFIX.encode() + b"x", bytes(8), _uuid(5), b"", b"w"], 0.0)
    c = core.counters
    assert (c["kvset_conflict"], c["kvset_unknown_lease"], c["kvset_reserved"]) == (1, 1, 1)


# -- leases ---------------------------------------------------------------------


def test_grant_bind_and_expire(active: Calls) -> None:
    core = active.core
    lease = active.grant(2.0, now=100.0)
    assert lease == lease_id_of(ok_uuid(active))
    assert parse_lease_value(core.store.get(LEASE_PREFIX + lease).body) == 2.0
    reply = active.set("/svc/a", b"up", 100.0, lease=lease)
    assert reply.ok
    entry = core.store.entry(b"/svc/a")
    assert entry is not None and bound_lease(entry[2]) == lease
    published(core)
    # Keepalives move the deadline and publish nothing.
    for t in (100.6, 101.2, 101.8):
        ka, commit = active.call(OP_LEASE_KEEPALIVE, t, lease=lease)
        assert ka.ok and ka.ttl == 2.0 and not commit
        assert tick(core, t) == []
    assert not published(core)
    assert tick(core, 103.7) == []  # 1.8 + 2.0 = 3.8
    gone = tick(core, 103.8)
    assert [decode_update(f).key for f in gone] == ["/svc/a", LEASE_PREFIX + lease]
    assert "/svc/a" not in core.store and len(core.leases) == 0
    assert core.counters["leases_expired"] == 1 and core.counters["lease_keys_deleted"] == 1
    late, _ = active.call(OP_LEASE_KEEPALIVE, 104.0, lease=lease)
    assert late.reason == "unknown-lease"
    assert active.set("/svc/b", b"x", 104.0, lease=lease).reason == "unknown-lease"


def test_revoke_deletes_only_keys_still_bound(active: Calls) -> None:
    core = active.core
    lease = active.grant(5.0, now=0.0)
    active.set("/a", b"1", 0.0, lease=lease)
    active.set("/b", b"1", 0.0, lease=lease)
    active.set("/b", b"2", 0.0)  # rewritten without the lease: no longer bound
    published(core)
    reply, commit = active.call(OP_LEASE_REVOKE, 1.0, lease=lease)
    assert reply.ok and commit and reply.sequence == core.store.sequence
    assert [m.key for m in published(core)] == ["/a", LEASE_PREFIX + lease]
    assert core.store.get("/b") is not None
    again, _ = active.call(OP_LEASE_REVOKE, 1.0, lease=lease)
    assert again.reason == "unknown-lease"


def test_grant_is_idempotent_and_bounded() -> None:
    calls = Calls(ServerCore(CoreSettings(max_leases=1), standalone=True))
    uuid, secret = _uuid(9), "ab" * 16
    first, _ = calls.call(OP_LEASE_GRANT, 0.0, uuid=uuid, ttl="1", secret=secret)
    second, commit = calls.call(OP_LEASE_GRANT, 0.0, uuid=uuid, ttl="1", secret=secret)
    assert second.lease == first.lease and second.sequence == first.sequence and not commit
    assert first.secret == second.secret == secret
    # The uuid is the public lease id: a retry without the secret learns nothing.
    other, _ = calls.call(OP_LEASE_GRANT, 0.0, uuid=uuid, ttl="1")
    assert other.reason == "not-owner" and not other.secret
    busy, _ = calls.call(OP_LEASE_GRANT, 0.0, ttl="1")
    assert busy.reason == "busy"
    bad, _ = calls.call(OP_LEASE_GRANT, 0.0, ttl="0.01")
    assert bad.reason == "bad-ttl"


def test_leases_survive_a_failover_with_a_fresh_ttl() -> None:
    """The passive follows the lease keys; promoted, it gives each a full ttl,
    keeps the ones kept alive and expires the others."""
    old = Calls(ServerCore(standalone=True))
    kept = old.grant(2.0, now=0.0)
    dead = old.grant(2.0, now=0.0)
    old.set("/kept", b"1", 0.0, lease=kept)
    old.set("/dead", b"1", 0.0, lease=dead)
    new = ServerCore()
    new.become_passive()
    new.start_sync()
    for frames in _snapshot_of(old.core):
        new.on_snapshot_reply(frames, 0.0)
    assert len(new.leases) == 0  # a passive keeps no time
    # The active dies at t=1; the passive takes over at t=3.
    assert promote(new, 3.0) == []
    assert new.role is Role.ACTIVE and len(new.leases) == 2
    calls = Calls(new)
    calls.secrets = old.secrets  # the client keeps its secrets across a failover
    for t in (3.6, 4.2, 4.8):
        assert calls.call(OP_LEASE_KEEPALIVE, t, lease=kept)[0].ok
    assert tick(new, 4.99) == []
    gone = [decode_update(f).key for f in tick(new, 5.0)]
    assert gone == ["/dead", LEASE_PREFIX + dead]
    assert new.store.get("/kept") is not None


def test_promotion_deletes_keys_of_a_lease_that_is_gone() -> None:
    core = ServerCore()
    core.become_passive()
    core.start_sync()
    core.on_snapshot_reply(
        [b"/orphan", (1).to_bytes(8, "big"), b"", f"lease={'a' * 32}\n".encode(), b"v"], 0.0
    )
    core.on_snapshot_reply([b"KTHXBAI", (1).to_bytes(8, "big"), b"", b"", b""], 0.0)
    out = promote(core, 1.0)
    assert [decode_update(f).key for f in out] == ["/orphan"]
    assert core.counters["lease_orphans_deleted"] == 1


def test_lease_table_heap_stays_bounded() -> None:
    table = LeaseTable(10)
    table.grant("a" * 32, 1.0, 0.0)
    for i in range(1000):
        table.keepalive("a" * 32, i * 0.1)
    assert len(table._heap) <= 4 * len(table) + 65
    assert table.due(100.0, 10) == []
    assert table.due(100.9, 10) == ["a" * 32]


def test_a_keepalive_does_not_touch_the_heap() -> None:
    """10,000 leases kept alive every ttl/3 pushed 10,000 heap entries a
    second; now a lease has one entry, pushed again only when it surfaces."""
    table = LeaseTable(10)
    table.grant("a" * 32, 3.0, 0.0)
    for i in range(1, 1000):
        table.keepalive("a" * 32, i * 0.01)
        assert len(table._heap) == 1
    assert table.due(5.0, 10) == [] and table._heap == [(9.99 + 3.0, "a" * 32)]
    assert table.due(12.99, 10) == ["a" * 32]


_ids = st.sampled_from(["a", "b", "c", "d"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("grant"), _ids, st.sampled_from([1.0, 2.0, 5.0])),
    st.tuples(st.just("keep"), _ids, st.just(0.0)),
    st.tuples(st.just("revoke"), _ids, st.just(0.0)),
    st.tuples(st.just("due"), _ids, st.integers(1, 3).map(float)),
    st.tuples(st.just("wait"), _ids, st.sampled_from([0.0, 0.5, 1.0, 3.0])),
), max_size=50))
def test_due_answers_as_a_scan_of_the_deadlines(ops: list[tuple[str, str, float]]) -> None:
    """Whatever grants, keepalives, revokes and waits happen, due() gives the
    leases whose deadline passed, earliest first, at most ``limit`` (the
    caller ends them, as expire_leases does)."""
    table, model, now = LeaseTable(10), {}, 0.0
    for op, lease_id, arg in ops:
        if op == "grant" and lease_id not in model:
            table.grant(lease_id, arg, now)
            model[lease_id] = (now + arg, arg)
        elif op == "keep" and lease_id in model:
            assert table.keepalive(lease_id, now) is not None
            model[lease_id] = (now + model[lease_id][1], model[lease_id][1])
        elif op == "revoke":
            assert (table.pop(lease_id) is None) is (lease_id not in model)
            model.pop(lease_id, None)
        elif op == "wait":
            now += arg
        elif op == "due":
            got = table.due(now, int(arg))
            want = sorted((d, i) for i, (d, _) in model.items() if d <= now)[: int(arg)]
            assert got == [i for _, i in want]
            for i in got:
                table.pop(i)
                del model[i]
        assert len(table._heap) <= 4 * len(table) + 65


def test_a_promotion_applies_parked_conditional_writes_only_if_they_still_hold() -> None:
    """A Guide-path KVSET with if_sequence parked by a passive is checked when
    the passive takes over, against its state then: a failover never turns a
    conflicting write into an applied one."""
    core = ServerCore()
    core.become_passive()
    core.start_sync()
    core.on_snapshot_reply([b"/k", (1).to_bytes(8, "big"), _uuid(1), b"", b"v1"], 0.0)
    core.on_snapshot_reply([b"KTHXBAI", (1).to_bytes(8, "big"), b"", b"", b""], 0.0)
    core.on_kvset([b"/k", bytes(8), _uuid(2), b"if_sequence=0\n", b"lost"], 0.5)
    core.on_kvset([b"/k", bytes(8), _uuid(3), b"if_sequence=1\n", b"won"], 0.5)
    assert len(core.pending) == 2
    out = promote(core, 1.0)
    applied = [decode_update(frames) for frames in out]
    assert [(m.key, m.body, m.properties) for m in applied] == [("/k", b"won", ())]
    assert core.counters["pending_failed"] == 1 and core.counters["kvset_conflict"] == 1
    with pytest.raises(Exception, match="not a whole number"):
        core.on_kvset([b"/j", bytes(8), _uuid(4), b"if_sequence=x\n", b"bad"], 1.0)


def test_every_call_result_in_the_metrics_is_a_core_counter() -> None:
    """/metrics exports clone_calls_total{result} from these counters: one the
    core does not keep would be a result stuck at 0."""
    counters = ServerCore().counters
    assert set(CALL_RESULTS.values()) <= set(counters)
    assert {
        CALL_RESULTS[label] for label in ("bad_if_sequence", "bad_lease", "bad_ttl", "size")
    } == {"calls_bad_if_sequence", "calls_bad_lease", "calls_bad_ttl", "calls_refused_size"}
    # Each problem check_call finds has a counter of its own, not calls_invalid.
    assert set(_PROBLEM_COUNTERS.values()) <= set(CALL_RESULTS.values())


# -- a retried call across a failover ---------------------------------------------


def _kvpubs(core: ServerCore) -> list[list[bytes]]:
    """The frames the reactor would publish after this turn's commit."""
    return [list(frames) for op in core.journal.take() for frames in op.updates]


@pytest.mark.parametrize("overwritten", [False, True])
@pytest.mark.parametrize("props", [{}, {"if_sequence": "0"}])
def test_a_set_retried_after_a_failover_gets_the_first_answer(
    props: dict[str, str], overwritten: bool
) -> None:
    """The active applies a set call, the passive follows its KVPUB, the active
    dies before its reply reaches the caller, the passive takes over, the
    caller resends the same call (same uuid): ok, with the first sequence, and
    applied once.  A plain set must not be applied twice; a conditional one
    must not be told "conflict" (its own first write moved the key).
    ``overwritten``: another writer changed the key in between, so the answer
    comes from the history, not from the key's current uuid."""
    old = Calls(ServerCore(standalone=True))
    new = ServerCore()
    new.become_passive()
    new.start_sync()
    for frames in _snapshot_of(old.core):
        new.on_snapshot_reply(frames, 0.0)
    uuid = _uuid(77)
    first, commit = old.call(OP_SET, 10.0, "/k", b"v", uuid=uuid, **props)
    assert first.ok and commit and first.sequence == 1
    if overwritten:
        assert old.set("/k", b"other", 10.1).ok
    for frames in _kvpubs(old.core):
        assert new.on_peer_update(frames, 10.2) is FollowOutcome.OK
    assert new.store.sequence == old.core.store.sequence
    # The active dies at t=11; the passive takes over at t=13.
    assert promote(new, 13.0) == []
    new.journal.take()  # what it followed, committed as the reactor would
    retry, commit = Calls(new).call(OP_SET, 13.5, "/k", b"v", uuid=uuid, **props)
    assert (retry.status, retry.sequence) == ("ok", first.sequence) and not commit
    assert new.counters["calls_duplicate"] == 1 and new.counters["calls_conflict"] == 0
    assert _kvpubs(new) == []  # nothing applied, nothing to commit or publish
    assert new.store.sequence == old.core.store.sequence
    assert new.history.sequence_of(uuid) == first.sequence  # its one update
    applied = [f for f in new.history.since(0) if f[2] == uuid]
    assert len(applied) == 1
    assert new.store.get("/k") == old.core.store.get("/k")


@pytest.mark.parametrize("overwritten", [False, True])
def test_a_set_retried_after_a_failover_to_a_snapshot_synced_passive(overwritten: bool) -> None:
    """The passive learnt of the call from a snapshot (with the active's list of
    applied ids), not from its KVPUB: the retry is still never applied again.
    Its sequence is known only while the key still holds that update; once
    rewritten, the new active has no history of it and answers sequence 0
    (docs/protocol.md, "CALL? / REPLY")."""
    old = Calls(ServerCore(standalone=True))
    uuid = _uuid(77)
    first, _ = old.call(OP_SET, 10.0, "/k", b"v", uuid=uuid)
    if overwritten:
        assert old.set("/k", b"other", 10.1).ok
    new = ServerCore()
    new.become_passive()
    new.start_sync()
    for frames in _snapshot_of(old.core, now=10.2):
        new.on_snapshot_reply(frames, 10.2)
    assert promote(new, 13.0) == []
    new.journal.take()
    retry, commit = Calls(new).call(OP_SET, 13.5, "/k", b"v", uuid=uuid)
    assert retry.ok and not commit and new.counters["calls_duplicate"] == 1
    assert retry.sequence == (0 if overwritten else first.sequence)
    assert _kvpubs(new) == [] and new.store.sequence == old.core.store.sequence
    assert new.store.get("/k") == old.core.store.get("/k")
