"""CALL? / REPLY: frames, round trips, checks, and total decoders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import ProtocolError
from clone.wire.calls import (
    LEASE_PREFIX,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_SET,
    Call,
    Reply,
    acl_key,
    acl_refusal,
    call_uuid,
    check_call,
    decode_call,
    decode_reply,
    encode_call,
    encode_reply,
    is_call,
    lease_id_of,
    lease_key,
)

U = bytes(range(16))
LEASE = U.hex()


def test_set_call_round_trip_and_frames() -> None:
    frames = encode_call(OP_SET, U, "/a", (("if_sequence", "7"), ("lease", LEASE)), b"v")
    assert frames == [b"CALL?", b"set", U, b"/a", f"if_sequence=7\nlease={LEASE}\n".encode(), b"v"]
    assert is_call(frames)
    call = decode_call(frames)
    assert call == Call(OP_SET, U, "/a", (("if_sequence", "7"), ("lease", LEASE)), b"v")
    assert call.if_sequence == 7
    assert call.lease == LEASE
    assert check_call(call) is None
    # The condition is never stored; the lease is.
    assert call.as_kvmsg().properties == (("lease", LEASE),)


def test_lease_calls_take_no_key_or_body() -> None:
    grant = decode_call(encode_call(OP_LEASE_GRANT, U, properties=(("ttl", "2"),)))
    assert check_call(grant) is None
    assert lease_id_of(grant.uuid) == LEASE
    assert lease_key(LEASE) == LEASE_PREFIX + LEASE
    with pytest.raises(ProtocolError, match="no key"):
        decode_call([b"CALL?", b"lease-keepalive", U, b"/k", b"", b""])


def test_a_lease_grant_may_name_the_key_it_is_for() -> None:
    """The key a grant names is what an ACL judges it by (a lock's contender key)."""
    plain = decode_call(encode_call(OP_LEASE_GRANT, U, properties=(("ttl", "2"),)))
    named = decode_call(encode_call(OP_LEASE_GRANT, U, "/locks/a/1", (("ttl", "2"),)))
    assert (acl_key(plain), acl_key(named)) == (None, "/locks/a/1")
    assert acl_key(decode_call(encode_call(OP_SET, U, "/k", (), b"v"))) == "/k"
    frames = encode_call(OP_LEASE_GRANT, U, "/k", (("ttl", "2"),))
    with pytest.raises(ProtocolError, match="no body"):
        decode_call([*frames[:5], b"v"])
    reserved = decode_call([*frames[:3], b"/_clone/lease/x", *frames[4:]])
    assert check_call(reserved) is not None and check_call(reserved)[0] == "reserved"


@pytest.mark.parametrize(
    ("op", "props", "key", "reason"),
    [
        (OP_SET, (("if_sequence", "-1"),), "/a", "bad-if-sequence"),
        (OP_SET, (("if_sequence", "1.5"),), "/a", "bad-if-sequence"),
        (OP_SET, (("if_sequence", "x"),), "/a", "bad-if-sequence"),
        (OP_SET, (("if_sequence", str(2**64)),), "/a", "bad-if-sequence"),
        (OP_SET, (("lease", "nothex"),), "/a", "bad-lease"),
        (OP_SET, (), LEASE_PREFIX + "x", "reserved"),
        (OP_LEASE_GRANT, (), "", "bad-ttl"),
        (OP_LEASE_GRANT, (("ttl", "0.01"),), "", "bad-ttl"),
        (OP_LEASE_GRANT, (("ttl", "nan"),), "", "bad-ttl"),
        (OP_LEASE_KEEPALIVE, (), "", "bad-lease"),
        (OP_LEASE_KEEPALIVE, (("lease", LEASE.upper()),), "", "bad-lease"),
    ],
)
def test_check_call_gives_a_specific_reason(
    op: str, props: tuple[tuple[str, str], ...], key: str, reason: str
) -> None:
    problem = check_call(Call(op, U, key, props))
    assert problem is not None
    assert problem[0] == reason
    assert problem[1]


def test_reply_round_trips() -> None:
    for reply in (
        Reply(U, "ok", 42),
        Reply(U, "conflict", 0, current=9),
        Reply(U, "refused", reason="unknown-lease", detail="no\nsuch lease"),
        Reply(U, "ok", 3, lease=LEASE, ttl=2.0),
    ):
        got = decode_reply(encode_reply(reply))
        assert got.uuid == reply.uuid
        assert got.status == reply.status
        assert got.sequence == reply.sequence
        assert got.current == reply.current
        assert got.reason == reply.reason
        assert got.lease == reply.lease
        assert got.ttl == reply.ttl
    # Details are one line.
    multi = encode_reply(Reply(U, "refused", reason="x", detail="a\nb"))
    assert decode_reply(multi).detail == "a b"


@pytest.mark.parametrize(
    "frames",
    [
        [b"REPLY", U, bytes(8)],
        [b"REPLY", U[:3], bytes(8), b"status=ok\n"],
        [b"REPLY", U, bytes(7), b"status=ok\n"],
        [b"REPLY", U, bytes(8), b"status=maybe\n"],
        [b"REPLY", U, bytes(8), b"status=conflict\n"],
        [b"REPLY", U, bytes(8), b"status=refused\n"],
        [b"REPLY", U, bytes(8), b"status=ok\nlease=zz\n"],
        [b"REPLY", U, bytes(8), b"status=ok\nttl=-1\n"],
        [b"NOPE", U, bytes(8), b"status=ok\n"],
    ],
)
def test_bad_replies_are_protocol_errors(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(frames)


def test_call_uuid_of_a_broken_call() -> None:
    assert call_uuid([b"CALL?", b"bogus", U]) == U
    assert call_uuid([b"CALL?", b"set"]) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_decoders_are_total(frames: list[bytes]) -> None:
    for decode in (decode_call, decode_reply):
        try:
            decode(frames)
        except ProtocolError:
            pass
    for prefix in (b"CALL?", b"REPLY"):
        try:
            decode_call([prefix, *frames])
        except ProtocolError:
            pass
        try:
            decode_reply([prefix, *frames])
        except ProtocolError:
            pass


def _jobs_only(key: bytes) -> bool:
    return key.startswith(b"/jobs/")


@pytest.mark.parametrize(
    ("call", "writes_somewhere", "refused"),
    [
        (Call(OP_SET, U, "/jobs/a"), True, False),
        (Call(OP_SET, U, "/locks/a"), True, True),
        (Call(OP_LEASE_GRANT, U, "/jobs/locks/a"), True, False),
        (Call(OP_LEASE_GRANT, U, "/locks/a"), True, True),  # a lock outside the ACL
        (Call(OP_LEASE_GRANT, U), True, False),  # unnamed: the right to write somewhere
        (Call(OP_LEASE_GRANT, U), False, True),
        (Call(OP_LEASE_KEEPALIVE, U, "", (("lease", LEASE),)), True, False),
        (Call(OP_LEASE_KEEPALIVE, U, "", (("lease", LEASE),)), False, True),
    ],
)
def test_acl_refusal_judges_the_acl_key_else_any_write_right(
    call: Call, writes_somewhere: bool, refused: bool
) -> None:
    why = acl_refusal(call, _jobs_only, writes_somewhere)
    assert (why is not None) is refused
    if refused and call.key:
        assert repr(call.key) in str(why)


def test_ahead_and_secret_round_trip_and_are_checked() -> None:
    from clone.wire.calls import OP_AHEAD, check_call, decode_call, decode_reply

    uuid = b"\x01" * 16
    call = decode_call(encode_call(OP_AHEAD, uuid, "/lk/a"))
    assert (call.op, call.key, check_call(call)) == (OP_AHEAD, "/lk/a", None)
    for frames in (encode_call(OP_AHEAD, uuid), encode_call(OP_AHEAD, uuid, "/k", body=b"x")):
        with pytest.raises(ProtocolError):
            decode_call(frames)
    reply = Reply(uuid, "ok", 9, ahead=2, secret="ab" * 16, lease="cd" * 16, ttl=1.0)
    assert decode_reply(encode_reply(reply)) == reply
    bad = decode_call(
        encode_call("lease-revoke", uuid, properties=(("lease", "ab" * 16), ("secret", "x")))
    )
    assert check_call(bad) == ("bad-secret", "a lease secret is 32 lowercase hex digits")
    forged = decode_call(encode_call("set", uuid, "/k", (("caller", "root"),), b"v"))
    assert check_call(forged)[0] == "malformed"  # type: ignore[index]
    # Neither the secret nor a relay's caller is ever stored.
    kept = decode_call(
        encode_call(
            "set",
            uuid,
            "/k",
            (("lease", "ab" * 16), ("secret", "cd" * 16), ("caller", "name:a")),
            b"v",
        )
    )
    assert kept.stored_properties() == (("lease", "ab" * 16),)
