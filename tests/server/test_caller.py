"""The caller part (clone.server.calling.Caller) driven alone: a real ROUTER and
DEALER on loopback, a real ServerCore, fake clocks, and the commit, backlog
and next-turn callbacks recorded.  No server, no loop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.calling import Caller
from clone.server.core import ServerCore
from clone.server.shared import Shared
from clone.wire.calls import (
    IF_SEQUENCE_PROPERTY,
    OP_LEASE_GRANT,
    OP_SET,
    SECRET_PROPERTY,
    Reply,
    decode_reply,
    encode_call,
)
from clone.wire.protocol import TTL_PROPERTY

UUID = bytes(range(16))


class _Rig:
    """One Caller over a ROUTER, with what it calls recorded."""

    def __init__(self, router: zmq.Socket[Any], dealer: zmq.Socket[Any], core: ServerCore) -> None:
        self.router, self.dealer, self.core = router, dealer, core
        self.now = 1000.0
        self.shared = Shared(
            Throttle(logging.getLogger("test.caller"), lambda: self.now),
            clock=lambda: self.now,
            wallclock=lambda: 1.7e9 + self.now,
            counters={"call_replies_dropped": 0},
        )
        self.commits = 0
        self.on_disk = True
        self.hold = False
        self.landings: list[Callable[[], None]] = []
        self.looks = 0
        self.turns: list[Callable[[], None]] = []
        self.forwarded: list[tuple[bytes, list[bytes], str | None, str]] = []
        # Whether everything applied is published (the durability part's
        # ``settled``): False while a commit is in flight and the loop reads on.
        self.settled = True

    def caller(self, *, relay: bool = False) -> Caller:
        return Caller(
            self.core,
            self.shared,
            Access(),
            self.router,
            commit=self._commit,
            router_backlog=self._look,
            next_turn=self._next_turn,
            forward=self._forward if relay else None,
            settled=lambda: self.settled,
        )

    def _commit(self, then: Callable[[], None]) -> None:
        self.commits += 1
        self.core.journal.take()
        if not self.on_disk:
            return  # the commit failed (or the server is stopping): never confirmed
        if self.hold:
            self.landings.append(then)  # written on the commit writer's thread, landed later
        else:
            then()

    def _next_turn(self, callback: Callable[[], None]) -> bool:
        self.turns.append(callback)
        return True

    def _look(self) -> None:
        self.looks += 1

    def _forward(self, identity: bytes, frames: list[bytes], user: str | None, who: str) -> None:
        self.forwarded.append((identity, frames, user, who))

    def call(self, caller: Caller, frames: list[bytes]) -> None:
        """The DEALER sends; the ROUTER's reader hands the call to the part."""
        self.dealer.send_multipart(frames)
        assert self.router.poll(10_000)
        parts = self.router.recv_multipart(copy=False)
        caller.on_call(parts[0].bytes, parts)

    def reply(self, timeout_ms: int = 10_000) -> Reply | None:
        if not self.dealer.poll(timeout_ms):
            return None
        return decode_reply(self.dealer.recv_multipart())


@pytest.fixture
def rig(ctx: zmq.Context[Any]) -> Iterator[_Rig]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield _Rig(router, dealer, ServerCore(standalone=True))
    finally:
        dealer.close(0)
        router.close(0)


def test_a_change_is_confirmed_only_after_the_turns_commit(rig: _Rig) -> None:
    caller = rig.caller()
    rig.call(caller, encode_call(OP_SET, UUID, "/k", (), b"v"))
    rig.call(caller, encode_call(OP_SET, bytes(range(1, 17)), "/j", (), b"w"))
    # Applied, held, one flush scheduled for both; nothing sent yet.
    assert rig.core.store.sequence == 2
    assert caller.waiting == 2 and len(rig.turns) == 1 and rig.commits == 0
    assert rig.reply(timeout_ms=100) is None
    rig.turns.pop()()
    assert rig.commits == 1 and caller.waiting == 0
    first, second = rig.reply(), rig.reply()
    assert first is not None and (first.uuid, first.status, first.sequence) == (UUID, "ok", 1)
    assert second is not None and second.sequence == 2
    # Sent from outside the ROUTER's callback: one look at its backlog for the burst.
    assert rig.looks == 1


def test_replies_wait_for_a_commit_that_lands_on_a_later_turn(rig: _Rig) -> None:
    """The commit writer's thread writes the turn; the replies go when it lands."""
    caller = rig.caller()
    rig.hold = True
    rig.call(caller, encode_call(OP_SET, UUID, "/k", (), b"v"))
    rig.turns.pop()()
    assert rig.commits == 1 and caller.waiting == 0 and len(rig.landings) == 1
    assert rig.reply(timeout_ms=100) is None  # written, not yet landed: not confirmed
    rig.landings.pop()()
    reply = rig.reply()
    assert reply is not None and (reply.uuid, reply.status, reply.sequence) == (UUID, "ok", 1)


def test_nothing_unwritten_is_confirmed(rig: _Rig) -> None:
    caller = rig.caller()
    rig.on_disk = False  # the commit failed (or the server is stopping)
    rig.call(caller, encode_call(OP_SET, UUID, "/k", (), b"v"))
    rig.turns.pop()()
    assert rig.commits == 1
    assert rig.reply(timeout_ms=200) is None
    assert rig.looks == 0  # no send tried: no look


def test_a_refusal_is_answered_at_once_from_the_readers_turn(rig: _Rig) -> None:
    passive = ServerCore()  # not active: every call is refused, nothing to commit
    rig.core = passive
    caller = rig.caller()
    rig.call(caller, encode_call(OP_SET, UUID, "/k", (), b"v"))
    reply = rig.reply()
    assert reply is not None and (reply.status, reply.reason) == ("refused", "not-active")
    assert not rig.turns and rig.commits == 0
    assert rig.looks == 0  # the ROUTER's own reader looks again after us


def test_a_retry_of_an_unpublished_write_is_answered_after_its_commit(rig: _Rig) -> None:
    """While a commit is in flight the loop reads on (clone.server.gathering):
    a retry of a write still in it must not be told ``ok`` before it lands,
    nor a conditional write its key's unpublished sequence; a refusal names
    no sequence and goes at once."""
    caller = rig.caller()
    rig.hold = True
    rig.call(caller, encode_call(OP_SET, UUID, "/k", (), b"v"))
    rig.turns.pop()()  # its commit is in flight
    assert len(rig.landings) == 1
    rig.settled = False
    rig.call(caller, encode_call(OP_SET, UUID, "/k", (), b"v"))  # the client's retry
    conditional = bytes(range(2, 18))
    rig.call(caller, encode_call(OP_SET, conditional, "/k", ((IF_SEQUENCE_PROPERTY, "7"),), b"w"))
    assert caller.waiting == 2 and rig.reply(timeout_ms=100) is None
    bad = ((IF_SEQUENCE_PROPERTY, "x"),)
    rig.call(caller, encode_call(OP_SET, bytes(range(3, 19)), "/k", bad, b"w"))
    refusal = rig.reply()
    assert refusal is not None and refusal.reason == "bad-if-sequence"
    rig.landings.pop()()  # the write lands: its own reply goes
    rig.settled = True
    first = rig.reply()
    assert first is not None and (first.uuid, first.status, first.sequence) == (UUID, "ok", 1)
    rig.turns.pop()()  # the held two, after a commit of their own turn (nothing new)
    rig.landings.pop()()
    retry, conflict = rig.reply(), rig.reply()
    assert retry is not None and (retry.uuid, retry.status, retry.sequence) == (UUID, "ok", 1)
    assert conflict is not None and (conflict.status, conflict.current) == ("conflict", 1)


def test_a_reply_to_a_caller_gone_is_counted(rig: _Rig) -> None:
    caller = rig.caller()
    caller.send_reply(b"nobody", Reply(UUID, "ok", sequence=1), backlog=None)
    assert rig.shared.counters["call_replies_dropped"] == 1


def test_a_relays_caller_forwards_every_call_with_its_principal(rig: _Rig) -> None:
    caller = rig.caller(relay=True)
    frames = encode_call(OP_SET, UUID, "/k", (), b"v")
    rig.call(caller, frames)
    ((identity, forwarded, user, who),) = rig.forwarded
    assert forwarded == frames and user is None  # no CURVE: no name
    assert who.startswith("addr:127.0.0.1")
    assert identity and rig.core.store.sequence == 0 and not rig.turns


def test_a_set_many_is_confirmed_after_the_commit_and_its_refused_entries_logged(
    rig: _Rig, caplog: pytest.LogCaptureFixture
) -> None:
    from clone.wire.calls import OP_SET_MANY, encode_set_many

    caller = rig.caller()
    body = encode_set_many([(bytes(range(1, 17)), b"/a", b"", b"1"),
                            (bytes(range(2, 18)), b"/_clone/lease/" + b"ab" * 16, b"", b"x"),
                            (bytes(range(3, 19)), b"/b", b"", b"2")])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="test.caller"):
        rig.call(caller, encode_call(OP_SET_MANY, UUID, "", (), body))
    assert caller.waiting == 1 and rig.reply(timeout_ms=100) is None  # held for the commit
    assert "refused 1 of the 3 entries of a set-many" in caplog.text and "reserved" in caplog.text
    rig.turns.pop()()
    reply = rig.reply()
    assert reply is not None and reply.ok and reply.sequences == (1, 0, 2)
    assert [(i, why) for i, why, _ in reply.failures] == [(1, "reserved")]


def test_a_grant_confirmed_after_its_ttl_counts_from_its_confirmation(rig: _Rig) -> None:
    """A commit slower than the lease's ttl (a slow disk) must not end the
    lease before its holder hears of it: its clock starts at the reply."""
    caller = rig.caller()
    rig.hold = True
    props = ((TTL_PROPERTY, "2"), (SECRET_PROPERTY, "5e" * 16))
    rig.call(caller, encode_call(OP_LEASE_GRANT, UUID, "", props))
    rig.turns.pop()()  # the turn's flush: the commit is on the writer's thread
    rig.now += 5.0  # the disk took 5 s, past the 2 s ttl
    rig.landings.pop()()
    reply = rig.reply()
    assert reply is not None and reply.ok and reply.lease
    leases = rig.core.calls.lease_calls.leases
    rig.core.calls.expire_leases(rig.now + 1.99, 100)
    assert leases.get(reply.lease) is not None  # a whole ttl from the reply
    rig.core.calls.expire_leases(rig.now + 2.0, 100)
    assert leases.get(reply.lease) is None
