"""Compare-and-set and leases through the real client, against the raw-pyzmq
fake server (tests/support/fake_server.py), whose calls a :class:`Desk` here
answers the way an active server would (docs/protocol.md, "CALL? / REPLY").

Real sockets on 127.0.0.1, a 100 ms heartbeat, a deadline on every wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from clone import Clone, Conflict, Lease, LeaseLost, NotActive, WriteRefused
from clone.recipes import Lock
from clone.wire.calls import (
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_REVOKE,
    OP_SET,
    REPLY,
    Call,
    Reply,
    lease_id_of,
)
from clone.wire.codec import KVMsg
from tests.support.fake_server import FakeServer
from tests.support.waiting import eventually

HB = 0.1


class Desk:
    """Answers calls in the fake server's thread, as an active server would:
    sets through its map (so they are published), leases by id, retries by uuid."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.leases: dict[str, float] = {}
        self.bound: dict[str, set[str]] = {}  # lease -> keys
        self.answered: dict[bytes, Reply] = {}
        self.not_active = 0  # answer this many calls "not-active" first
        server.on_call = self

    def __call__(self, call: Call) -> Reply:
        if self.not_active > 0:
            self.not_active -= 1
            return Reply(call.uuid, "refused", reason="not-active", detail="passive")
        if call.uuid in self.answered:
            return self.answered[call.uuid]
        reply = self._answer(call)
        if call.op in (OP_SET, OP_LEASE_GRANT):
            self.answered[call.uuid] = reply
        return reply

    def _answer(self, call: Call) -> Reply:
        lease = call.lease
        if call.op == OP_LEASE_GRANT:
            if call.key.startswith("/forbidden/"):  # a grant named for a key not ours
                return Reply(call.uuid, "refused", reason="acl", detail="not yours")
            lease_id, ttl = lease_id_of(call.uuid), float(call.prop("ttl") or 0)
            self.leases[lease_id] = ttl
            return Reply(call.uuid, "ok", lease=lease_id, ttl=ttl)
        if lease is not None and lease not in self.leases:
            return Reply(call.uuid, "refused", reason="unknown-lease", detail="no such lease")
        if call.op == OP_LEASE_KEEPALIVE:
            return Reply(call.uuid, "ok", lease=lease or "", ttl=self.leases[lease or ""])
        if call.op == OP_LEASE_REVOKE:
            assert lease is not None
            self.expire(lease)
            return Reply(call.uuid, "ok", self.server.sequence, lease=lease)
        held = self.server.map.get(call.key)
        current = 0 if held is None else held.sequence
        expected = call.if_sequence
        if expected is not None and expected != current:
            return Reply(call.uuid, "conflict", current=current)
        if call.key.startswith("/forbidden/"):
            return Reply(call.uuid, "refused", reason="acl", detail="not yours")
        if lease is not None:
            self.bound.setdefault(lease, set()).add(call.key)
        self.server._apply(call.as_kvmsg())
        return Reply(call.uuid, "ok", self.server.sequence)

    def expire(self, lease: str) -> None:
        """Revoke ``lease`` as the server would (call in the server thread)."""
        self.leases.pop(lease, None)
        for key in sorted(self.bound.pop(lease, set())):
            self.server._apply(KVMsg(key))

    def sends(self, op: str) -> list[Call]:
        """Every ``op`` received, resends included."""
        return [c for c in list(self.server.calls) if c.op == op]

    def ops(self, op: str) -> list[Call]:
        """The ``op`` calls asked, each once (its first send), in order.

        The client sends a call again, same uuid, every half heartbeat
        (50 ms here) until it is answered: on a busy machine a reply often
        comes later than that, so counting sends would count the machine's
        load, not the calls."""
        return [c for c in self.asked() if c.op == op]

    def asked(self) -> list[Call]:
        """Every call asked, each once, in order."""
        seen: set[bytes] = set()
        first: list[Call] = []
        for c in list(self.server.calls):
            if c.uuid not in seen:
                seen.add(c.uuid)
                first.append(c)
        return first


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer(heartbeat=HB) as srv:
        yield srv


@pytest.fixture
def desk(server: FakeServer) -> Desk:
    return Desk(server)


@pytest.fixture
def client(server: FakeServer) -> Iterator[Clone]:
    with Clone([server.endpoint], heartbeat=HB, confirm_timeout=3.0) as c:
        c.wait_synced(5)
        yield c


def test_a_confirmed_set_and_delete_return_their_sequence(
    server: FakeServer, client: Clone
) -> None:
    first = client.set("/a", "1", wait=True)
    assert first == server.map["/a"].sequence
    assert client.set("/a", "2", wait=True) == first + 1
    assert client.delete("/a", wait=True) == first + 2
    assert client.set("/b", "x") is None  # fire-and-forget: nothing to say
    assert client.set_async("/c", "y").result(5) == first + 4


def test_compare_and_set(desk: Desk, client: Clone) -> None:
    created = client.set("/cas", "1", if_sequence=0)
    assert isinstance(created, int) and created > 0
    assert client.entry("/cas") is not None  # published before the reply: a get sees it
    with pytest.raises(Conflict) as info:
        client.set("/cas", "2", if_sequence=0)
    assert (info.value.key, info.value.expected, info.value.current) == ("/cas", 0, created)
    assert "absent" in str(info.value) and "read it again" in str(info.value)
    updated = client.set("/cas", "2", ttl=30, if_sequence=created)
    assert updated == created + 1
    [*_, last] = desk.ops(OP_SET)
    assert dict(last.properties) == {"ttl": "30", "if_sequence": str(created)}
    with pytest.raises(Conflict):
        client.delete("/cas", if_sequence=created)
    assert client.delete("/cas", if_sequence=updated) == updated + 1
    assert client.get("/cas") is None


def test_bad_if_sequence_is_refused_before_sending(desk: Desk, client: Clone) -> None:
    for bad, error in ((-1, ValueError), (2**64, ValueError), ("3", TypeError), (True, TypeError)):
        with pytest.raises(error, match="if_sequence"):
            client.set("/k", "v", if_sequence=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hex"):
        client.set("/k", "v", lease="not-a-lease")
    with pytest.raises(TypeError, match="lease"):
        client.set("/k", "v", lease=42)  # type: ignore[call-overload]
    assert desk.server.calls == []


def test_a_refused_call_raises_write_refused(desk: Desk, client: Clone) -> None:
    with pytest.raises(WriteRefused) as info:
        client.set("/forbidden/x", "v", if_sequence=0)
    assert info.value.reason == "acl" and info.value.key == "/forbidden/x"


def test_no_answer_raises_not_active_after_the_timeout(server: FakeServer, client: Clone) -> None:
    # No on_call: the server ignores calls, as the Guide's do.
    start = time.monotonic()
    with pytest.raises(
        NotActive, match=r"no active server answered the write of '/k' within 0\.5 s"
    ):
        client.set("/k", "v", if_sequence=0, timeout=0.5)
    assert 0.45 < time.monotonic() - start < 2.0
    assert len(server.calls) >= 2  # sent, then resent every half heartbeat
    eventually(lambda: client.status().pending_calls == 0, 2, "the agent drops the call")


def test_not_active_replies_keep_the_call_until_an_answer(desk: Desk, client: Clone) -> None:
    desk.not_active = 3
    assert client.set("/k", "v", if_sequence=0, timeout=5) > 0
    # One call, sent again after each of the three not-active answers (and
    # perhaps also by the resend timer, when an answer is slow to come).
    calls = desk.sends(OP_SET)
    assert len(calls) >= 4 and len({c.uuid for c in calls}) == 1
    assert client.status().counters["calls_not_active"] == 3


def test_a_malformed_reply_is_counted_and_dropped(server: FakeServer, client: Clone) -> None:
    server.on_call = lambda call: [REPLY, call.uuid, b"\x00", b"status=ok\n"]
    with pytest.raises(NotActive):
        client.set("/k", "v", if_sequence=0, timeout=0.3)
    assert client.status().protocol_errors >= 1


def test_a_lease_keeps_its_keys_and_revoking_deletes_them(desk: Desk, client: Clone) -> None:
    started = time.monotonic()
    lease = client.lease(0.6)
    assert isinstance(lease, Lease) and lease.alive and lease.ttl == 0.6
    assert len(lease.id) == 32
    assert client.set("/nodes/a", "up", lease=lease) > 0
    assert client.set("/nodes/b", "up", lease=lease.id) > 0
    entry = client.entry("/nodes/a")
    assert entry is not None and entry.lease == lease.id
    assert ("lease", lease.id) in entry.properties
    assert client.status().leases == 1
    # Kept alive every ttl / 3 = 0.2 s, each keepalive a new call: three come
    # (however slowly a busy machine runs), and no more than that pace allows.
    # Counted by uuid: a keepalive not answered within 50 ms is sent again.
    eventually(lambda: len(desk.ops(OP_LEASE_KEEPALIVE)) >= 3, 30, "three keepalives")
    keepalives = desk.ops(OP_LEASE_KEEPALIVE)
    assert len(keepalives) <= (time.monotonic() - started) / 0.2 + 2, len(keepalives)
    assert all(c.lease == lease.id for c in desk.sends(OP_LEASE_KEEPALIVE))
    lease.revoke()
    assert not lease.alive and not lease.lost and lease.wait_lost(0)
    eventually(lambda: client.get("/nodes/a") is None and client.get("/nodes/b") is None, 5)
    sent = len(desk.ops(OP_LEASE_KEEPALIVE))
    time.sleep(0.5)
    assert len(desk.ops(OP_LEASE_KEEPALIVE)) == sent  # stopped: no new keepalive
    assert client.status().leases == 0
    lease.revoke()  # again: nothing to do
    assert len(desk.ops(OP_LEASE_REVOKE)) == 1
    with pytest.raises(LeaseLost, match="revoked by this client"):
        client.set("/nodes/c", "up", lease=lease)


def test_leaving_the_with_block_revokes(desk: Desk, client: Clone) -> None:
    with client.lease(1.0) as lease:
        client.set("/w", "1", lease=lease)
        assert client.get("/w") == b"1"
    assert not lease.alive
    assert [c.lease for c in desk.ops(OP_LEASE_REVOKE)] == [lease.id]
    eventually(lambda: client.get("/w") is None, 5)


def test_a_lost_lease_is_told_in_the_callback_thread(desk: Desk, client: Clone) -> None:
    lease = client.lease(0.6)
    client.set("/lock", "me", lease=lease)
    seen: list[tuple[str, str]] = []
    lease.on_lost(lambda gone: seen.append((gone.id, threading.current_thread().name)))
    desk.server.call(lambda: desk.expire(lease.id))  # it expires on the server
    assert lease.wait_lost(3.0)
    assert lease.lost and not lease.alive and "unknown-lease" in lease.why
    eventually(lambda: len(seen) == 1, 3, "the on_lost callback")
    assert seen[0][0] == lease.id and seen[0][1].startswith("clone-callbacks-")
    # Registered late: run at once (in that thread too).
    late: list[str] = []
    lease.on_lost(lambda gone: late.append(threading.current_thread().name))
    eventually(lambda: late != [], 3, "the late on_lost callback")
    with pytest.raises(LeaseLost) as info:
        client.set("/lock", "again", lease=lease)
    assert info.value.lease_id == lease.id
    assert client.status().counters["leases_lost"] == 1
    lease.revoke()  # lost: nothing to revoke
    assert desk.ops(OP_LEASE_REVOKE) == []


def test_unanswered_keepalives_make_a_lease_invalid_before_it_is_lost(
    desk: Desk, client: Clone
) -> None:
    """Cut off from the servers, a client cannot know its lease still holds:
    once no keepalive made within the ttl was answered, ``valid`` is False (and
    a lock on it is no longer held), though nobody said the lease is lost."""
    lease = client.lease(0.6)
    granted = lease.valid_until
    # Kept alive: every answer pushes valid_until on (a wait for the answer,
    # not a sleep: a busy machine may starve the client past the ttl).
    eventually(lambda: lease.valid and lease.valid_until > granted, 5, "a keepalive answered")
    before = lease.valid_until
    eventually(lambda: lease.valid_until > before, 3, "another keepalive answered")
    desk.server.on_call = None  # the server stops answering
    assert lease.valid_until <= time.monotonic() + 0.6 + 0.05
    eventually(lambda: not lease.valid, 2, "the lease no longer known valid")
    assert lease.alive and not lease.lost
    desk.server.on_call = desk  # answering again: valid again, never lost
    eventually(lambda: lease.valid, 3, "the lease valid again")
    lease.revoke()


def test_a_write_with_an_unknown_lease_raises_lease_lost(desk: Desk, client: Clone) -> None:
    stranger = "ab" * 16
    with pytest.raises(LeaseLost) as info:
        client.set("/k", "v", lease=stranger)
    assert info.value.lease_id == stranger


def test_close_revokes_the_leases_still_held(server: FakeServer, desk: Desk) -> None:
    c = Clone([server.endpoint], heartbeat=HB)
    c.wait_synced(5)
    kept, revoked = c.lease(5.0), c.lease(5.0)
    revoked.revoke()
    start = time.monotonic()
    c.close()
    assert time.monotonic() - start < 3.0
    assert sorted(x.lease or "" for x in desk.ops(OP_LEASE_REVOKE)) == sorted([kept.id, revoked.id])
    assert not kept.alive and not kept.lost
    assert desk.leases == {}


def test_close_does_not_wait_long_for_a_server_that_does_not_answer(server: FakeServer) -> None:
    desk = Desk(server)
    c = Clone([server.endpoint], heartbeat=HB)
    c.wait_synced(5)
    c.lease(5.0)
    server.on_call = None  # gone quiet
    start = time.monotonic()
    c.close()
    assert time.monotonic() - start < 4.0
    assert len(desk.ops(OP_LEASE_REVOKE)) >= 1


def test_lease_arguments_are_checked(client: Clone) -> None:
    for bad in (0.1, 0, -1, float("nan"), 10**9):
        with pytest.raises(ValueError, match="ttl"):
            client.lease(bad)
    with pytest.raises(TypeError):
        client.lease("2")  # type: ignore[arg-type]


def test_a_lease_for_a_key_names_it_in_the_grant(desk: Desk, client: Clone) -> None:
    lease = client.lease(1.0, for_key="/jobs/a")
    plain = client.lease(1.0)
    assert [c.key for c in desk.ops(OP_LEASE_GRANT)] == ["/jobs/a", ""]
    with pytest.raises(WriteRefused) as info:
        client.lease(1.0, for_key="/forbidden/a")
    assert info.value.reason == "acl" and info.value.key == "/forbidden/a"
    for bad in ("", "\x00control"):
        with pytest.raises(ValueError, match="key"):
            client.lease(1.0, for_key=bad)
    assert len(desk.ops(OP_LEASE_GRANT)) == 3  # the bad keys were never sent
    lease.revoke()
    plain.revoke()


def test_a_lock_outside_the_acl_asks_for_nothing_but_its_named_grant(
    desk: Desk, client: Clone
) -> None:
    """The contender key is named first and the grant carries it: refused,
    the lock writes nothing and has no lease to revoke."""
    with pytest.raises(WriteRefused) as info:
        Lock(client, "/forbidden/lock", ttl=1.0).acquire(timeout=2)
    assert info.value.reason == "acl"
    [grant] = desk.asked()
    assert grant.op == OP_LEASE_GRANT and grant.key.startswith("/forbidden/lock/")
    assert info.value.key == grant.key
    with Lock(client, "/jobs/lock", ttl=1.0) as lock:
        assert lock.held
    asked = [c for c in desk.asked()[1:] if c.op != OP_LEASE_KEEPALIVE]
    grant, contend, revoke = asked
    assert grant.op == OP_LEASE_GRANT and contend.op == OP_SET and revoke.op == OP_LEASE_REVOKE
    assert grant.key == contend.key and grant.key.startswith("/jobs/lock/")


def test_a_lease_granted_before_the_first_sync(server: FakeServer, desk: Desk) -> None:
    server.answer_snapshots = False  # calls do not wait for a snapshot
    with Clone([server.endpoint], heartbeat=HB) as c:
        lease = c.lease(1.0, timeout=3)
        assert lease.alive


def test_close_stops_the_callback_thread_at_once(server: FakeServer, desk: Desk) -> None:
    """The thread that runs on_lost (and on_change) callbacks ends with the
    client, without close() waiting out its command timeout for it."""
    c = Clone([server.endpoint], heartbeat=HB)
    c.wait_synced(5)
    c.on_change(lambda entry: None)
    c.lease(1.0).on_lost(lambda lease: None)
    start = time.monotonic()
    c.close()
    assert time.monotonic() - start < 3.0
    assert not [t for t in threading.enumerate() if t.name.startswith("clone-callbacks-")]
