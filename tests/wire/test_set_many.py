"""``set-many`` (issue 29): many sets in one CALL?, its body, its limits in
bytes and entries, and its five-frame REPLY (clone.wire.calls)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import LimitExceeded, ProtocolError
from clone.wire.calls import (
    MAX_SET_MANY_BYTES,
    MAX_SET_MANY_ENTRIES,
    OP_SET,
    OP_SET_MANY,
    SET_MANY_ENTRY_OVERHEAD,
    Call,
    Reply,
    acl_refusal,
    check_call,
    decode_call,
    decode_reply,
    decode_set_many,
    encode_call,
    encode_reply,
    encode_set_many,
)
from clone.wire.codec import encode_properties


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def _entries(n: int, value: bytes = b"v" * 100) -> list[tuple[bytes, bytes, bytes, bytes]]:
    return [(_uuid(i + 1), f"/fleet/node-{i:07d}/cpu".encode(), b"", value) for i in range(n)]


def _call(body: bytes, props: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
    return encode_call(OP_SET_MANY, _uuid(99), "", props, body)


def test_round_trip_gives_each_entry_as_its_own_set_call() -> None:
    ttl = encode_properties((("ttl", "30.0"),))
    body = encode_set_many([(_uuid(1), b"/a", ttl, b"one"), (_uuid(2), b"/b", b"", b"")])
    call = decode_call(_call(body))
    assert call.op == OP_SET_MANY and call.key == "" and call.body == body
    assert call.entries == (
        Call(OP_SET, _uuid(1), "/a", (("ttl", "30.0"),), b"one"),
        Call(OP_SET, _uuid(2), "/b", (), b""),  # an empty value deletes, as a set's
    )
    assert check_call(call) is None
    # Each entry takes the overhead, its key, properties and value: no more.
    assert len(body) == 2 * SET_MANY_ENTRY_OVERHEAD + len(b"/a" + ttl + b"one" + b"/b")


def test_limits_are_in_bytes_and_entries_and_refuse_the_whole_batch() -> None:
    # Over the byte limit: the encoder will not build it, the decoder says "size".
    big = b"x" * (MAX_SET_MANY_BYTES // 2)
    with pytest.raises(ValueError, match="byte limit"):
        encode_set_many([(_uuid(1), b"/a", b"", big), (_uuid(2), b"/b", b"", big)])
    raw = b"".join(encode_set_many([e]) for e in [(_uuid(1), b"/a", b"", big),
                                                   (_uuid(2), b"/b", b"", big)])  # fmt: skip
    with pytest.raises(LimitExceeded, match=f"{MAX_SET_MANY_BYTES}-byte limit"):
        decode_call(_call(raw))
    # Over the entry limit.
    with pytest.raises(ValueError, match="entries"):
        encode_set_many(_entries(MAX_SET_MANY_ENTRIES + 1, b"v"))
    raw = encode_set_many(_entries(MAX_SET_MANY_ENTRIES, b"v")) + encode_set_many(
        _entries(1, b"v")
    )
    with pytest.raises(LimitExceeded, match=f"over {MAX_SET_MANY_ENTRIES} entries"):
        decode_call(_call(raw))
    assert len(decode_call(_call(encode_set_many(_entries(MAX_SET_MANY_ENTRIES, b"v")))).entries) \
        == MAX_SET_MANY_ENTRIES
    with pytest.raises(ValueError, match="at least one"):
        encode_set_many([])


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ((_uuid(1), b"", b"", b"v"), "entry 1: empty key"),
        ((_uuid(1), b"\xff\xfe", b"", b"v"), "entry 1: key is not UTF-8"),
        ((_uuid(1), b"HUGZ", b"", b"v"), "entry 1: key 'HUGZ' is reserved"),
        ((_uuid(1), b"\x00ctl", b"", b"v"), "entry 1: key '\\\\x00ctl'"),
        ((_uuid(1), b"k" * 1025, b"", b"v"), "entry 1: key of 1025 bytes"),
        ((_uuid(1), b"/a", b"no equals sign\n", b"v"), "entry 1: "),
        ((_uuid(1), b"/a", b"caller=name:x\n", b"v"), "entry 1: caller= belongs on the call"),
    ],
)
def test_an_entry_a_set_call_would_not_decode_refuses_the_batch(
    entry: tuple[bytes, bytes, bytes, bytes], why: str
) -> None:
    body = encode_set_many([(_uuid(7), b"/fine", b"", b"v"), entry])
    with pytest.raises(ProtocolError, match=why):
        decode_call(_call(body))


def test_a_cut_body_and_a_key_on_the_call_are_malformed() -> None:
    body = encode_set_many(_entries(2))
    for cut in (1, SET_MANY_ENTRY_OVERHEAD + 3, len(body) - 1):
        with pytest.raises(ProtocolError, match="cut short"):
            decode_set_many(body[:cut])
    with pytest.raises(ProtocolError, match="one entry or more"):
        decode_call(_call(b""))
    frames = _call(body)
    frames[3] = b"/a"
    with pytest.raises(ProtocolError, match="takes no key"):
        decode_call(frames)


def test_only_a_relays_caller_may_sit_on_the_call_itself() -> None:
    body = encode_set_many(_entries(1))
    assert check_call(decode_call(_call(body, (("caller", "name:alice"),)))) is None
    problem = check_call(decode_call(_call(body, (("ttl", "5"),))))
    assert problem is not None and problem[0] == "malformed"


def test_the_acl_judges_key_by_key_and_one_outside_refuses_the_batch() -> None:
    def mine(key: bytes) -> bool:
        return key.startswith(b"/fleet/node-0000001/")

    inside = encode_set_many([(_uuid(1), b"/fleet/node-0000001/cpu", b"", b"v"),
                              (_uuid(2), b"/fleet/node-0000001/mem", b"", b"v")])  # fmt: skip
    assert acl_refusal(decode_call(_call(inside)), mine, True) is None
    outside = encode_set_many([(_uuid(1), b"/fleet/node-0000001/cpu", b"", b"v"),
                               (_uuid(2), b"/fleet/node-0000002/cpu", b"", b"v")])  # fmt: skip
    why = acl_refusal(decode_call(_call(outside)), mine, True)
    assert why is not None and "/fleet/node-0000002/cpu" in why and "entry 1" in why
    # A client that may write somewhere is not enough: the keys decide.
    assert acl_refusal(decode_call(_call(outside)), lambda key: False, True) is not None


def test_reply_round_trip_with_sequences_and_failures() -> None:
    reply = Reply(_uuid(99), "ok", 12, sequences=(10, 0, 12, 0),
                  failures=((1, "reserved", "keys under /_clone/lease/ are the server's\nleases"),
                            (3, "conflict", "7")))  # fmt: skip
    frames = encode_reply(reply)
    assert len(frames) == 5
    back = decode_reply(frames)
    assert back.sequences == (10, 0, 12, 0)
    assert back.failures == ((1, "reserved", "keys under /_clone/lease/ are the server's leases"),
                             (3, "conflict", "7"))  # fmt: skip
    assert back.kept is None and back.ok and back.sequence == 12


def test_a_bad_set_many_reply_is_a_protocol_error() -> None:
    good = encode_reply(Reply(_uuid(99), "ok", 3, sequences=(1, 2, 3)))
    for fifth in (good[4][:-1], good[4] + b"x 1 y\n", good[4] + b"9 acl no\n"):
        with pytest.raises(ProtocolError):
            decode_reply([*good[:4], fifth])
    with pytest.raises(ProtocolError):
        decode_reply(good[:4])  # entries= without its frame


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_the_body_decoder_is_total(body: bytes) -> None:
    try:
        decode_set_many(body)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=30)),
                min_size=1, max_size=20))  # fmt: skip
def test_whatever_decodes_comes_back_entry_for_entry(pairs: list[tuple[bytes, bytes]]) -> None:
    entries = [(_uuid(i), key, b"", value) for i, (key, value) in enumerate(pairs)]
    try:
        calls = decode_set_many(encode_set_many(entries))
    except ProtocolError:
        return  # some key is not a valid key: the batch is refused whole
    assert [(c.uuid, c.key.encode(), c.body) for c in calls] == [
        (u, k, v) for u, k, _, v in entries
    ]
