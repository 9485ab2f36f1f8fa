"""``lease-keepalives``: many leases kept alive by one call, in the
server core with explicit times, and its wire form (clone.wire.calls)."""

from __future__ import annotations

import pytest

from clone.errors import ProtocolError
from clone.server.core import ServerCore
from clone.server.ownership import name_principal
from clone.wire.calls import (
    MAX_KEEPALIVES_PER_CALL,
    OP_LEASE_KEEPALIVES,
    OP_LEASE_REVOKE,
    Reply,
    check_call,
    decode_call,
    decode_reply,
    encode_call,
    encode_keepalives,
    encode_reply,
    parse_keepalives,
)
from tests.server.test_lease_ownership import Caller

ALICE = name_principal("alice")
MALLORY = name_principal("mallory")
SECRET = "5e" * 16


def batch(caller: Caller, leases: list[tuple[str, str]], now: float) -> Reply:
    return caller.call(OP_LEASE_KEEPALIVES, now, body=encode_keepalives(leases))


def test_one_call_keeps_every_lease_alive_and_names_the_ones_it_could_not() -> None:
    core = ServerCore(standalone=True)
    alice, mallory = Caller(core, ALICE), Caller(core, MALLORY)
    mine = [alice.grant(ttl=3.0, now=0.0).lease for _ in range(3)]
    theirs = mallory.grant(ttl=3.0, now=0.0).lease
    revoked = alice.grant(ttl=3.0, now=0.0).lease
    assert alice.call(OP_LEASE_REVOKE, 0.5, lease=revoked).ok
    asked = [(lid, "") for lid in mine] + [(theirs, ""), (revoked, "")]
    reply = batch(alice, asked, now=2.5)
    assert reply.ok and reply.kept == 3
    assert dict(reply.gone) == {theirs: "not-owner", revoked: "unknown-lease"}
    c = core.counters
    assert c["lease_keepalives"] == 3 and c["lease_keepalive_batches"] == 1
    # Kept: from 2.5 each has its full 3 s again; the other client's was not renewed.
    core.tick(5.0, 5.0)
    assert all(core.leases.get(lid) is not None for lid in mine)
    assert core.leases.get(theirs) is None
    core.tick(5.6, 5.6)
    assert all(core.leases.get(lid) is None for lid in mine)


def test_secrets_prove_ownership_line_by_line() -> None:
    core = ServerCore(standalone=True)
    anon = Caller(core, "addr:127.0.0.1")
    lease = anon.grant(ttl=3.0, secret=SECRET).lease
    reply = batch(anon, [(lease, SECRET)], now=1.0)
    assert reply.kept == 1 and reply.gone == ()
    reply = batch(anon, [(lease, "77" * 16)], now=1.0)
    assert reply.kept == 0 and reply.gone == ((lease, "not-owner"),)


def test_a_passive_refuses_a_batch_as_not_active() -> None:
    core = ServerCore()  # not active
    reply = batch(Caller(core, ALICE), [("ab" * 16, "")], now=0.0)
    assert (reply.status, reply.reason) == ("refused", "not-active")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"nothex\n", "bad-lease"),
        (b"ab" * 16 + b"\n" + b"AB" * 16 + b"\n", "bad-lease"),  # upper case
        (b"ab" * 16, "bad-lease"),  # no newline
        (b"ab" * 16 + b" short\n", "bad-lease"),
        (("ab" * 16 + "\n").encode() * (MAX_KEEPALIVES_PER_CALL + 1), "size"),
    ],
)
def test_a_bad_body_is_refused_with_a_reason(body: bytes, reason: str) -> None:
    core = ServerCore(standalone=True)
    reply = Caller(core, ALICE).call(OP_LEASE_KEEPALIVES, 0.0, body=body)
    assert (reply.status, reply.reason) == ("refused", reason)


def test_the_call_takes_no_key_and_needs_a_body() -> None:
    uuid = bytes(16)
    with pytest.raises(ProtocolError, match="no key and a body"):
        decode_call(encode_call(OP_LEASE_KEEPALIVES, uuid, key="/k", body=b"x"))
    with pytest.raises(ProtocolError, match="no key and a body"):
        decode_call(encode_call(OP_LEASE_KEEPALIVES, uuid))


def test_the_body_and_the_reply_round_trip() -> None:
    leases = [("ab" * 16, ""), ("cd" * 16, SECRET)]
    body = encode_keepalives(leases)
    call = decode_call(encode_call(OP_LEASE_KEEPALIVES, bytes(16), body=body))
    assert check_call(call) is None
    assert parse_keepalives(call.body) == [("ab" * 16, None), ("cd" * 16, SECRET)]
    reply = Reply(bytes(16), "ok", kept=1, gone=(("cd" * 16, "unknown-lease"),))
    frames = encode_reply(reply)
    assert len(frames) == 5
    assert decode_reply(frames) == reply
    # An ordinary reply keeps its four frames.
    assert len(encode_reply(Reply(bytes(16), "ok"))) == 4


def test_a_reply_with_a_half_of_the_batch_answer_is_malformed() -> None:
    frames = encode_reply(Reply(bytes(16), "ok", kept=1))
    with pytest.raises(ProtocolError, match="fifth frame"):
        decode_reply(frames[:4])
    with pytest.raises(ProtocolError, match="fifth frame"):
        decode_reply([*encode_reply(Reply(bytes(16), "ok")), b""])
    with pytest.raises(ProtocolError, match="not kept"):
        decode_reply([*frames[:4], b"zz gone\n"])
