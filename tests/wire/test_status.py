"""STATUS? / STATUS: byte-exact frames, round trips and a total decoder."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import ProtocolError
from clone.wire import protocol
from clone.wire.status import (
    decode_status,
    encode_status,
    encode_status_request,
    is_status_request,
)


def test_constants_are_exported_by_protocol() -> None:
    assert protocol.STATUS_REQUEST == b"STATUS?"
    assert protocol.STATUS_REPLY == b"STATUS"
    for name in ("STATUS_REQUEST", "STATUS_REPLY", "MAX_STATUS_BYTES"):
        assert name in protocol.__all__


def test_request_frames() -> None:
    assert encode_status_request() == [b"STATUS?"]
    assert is_status_request([b"STATUS?"])
    for other in ([b"STATUS?", b""], [b"ICANHAZ?", b""], [b"STATUS"], [], [b"status?"]):
        assert not is_status_request(other)


def test_reply_is_compact_sorted_json() -> None:
    frames = encode_status({"role": "active", "keys": 3, "peer": None})
    assert frames == [b"STATUS", b'{"keys":3,"peer":null,"role":"active"}']
    assert decode_status(frames) == {"role": "active", "keys": 3, "peer": None}


def test_encode_refuses_what_does_not_fit_or_is_not_json() -> None:
    with pytest.raises(ValueError):
        encode_status({"x": "a" * protocol.MAX_STATUS_BYTES})
    with pytest.raises(ValueError):
        encode_status({"x": float("nan")})
    with pytest.raises(TypeError):
        encode_status({"x": b"bytes"})


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"STATUS"], "frames"),
        ([b"STATUS", b"{}", b""], "frames"),
        ([b"KTHXBAI", b"{}"], "expected STATUS"),
        ([b"STATUS", b"[1, 2]"], "not an object"),
        ([b"STATUS", b"\xff{}"], "not UTF-8 JSON"),
        ([b"STATUS", b"{"], "not UTF-8 JSON"),
        ([b"STATUS", b'{"x": NaN}'], "not UTF-8 JSON"),
        ([b"STATUS", b"{}" + b" " * protocol.MAX_STATUS_BYTES], "exceeds"),
        ([b"STATUS", b"[" * 50_000], "not UTF-8 JSON"),  # too deep
    ],
)
def test_decode_says_what_was_wrong(frames: list[bytes], why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode_status(frames)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=16), json_values, max_size=8))
def test_round_trip(status: dict[str, object]) -> None:
    assert decode_status(encode_status(status)) == json.loads(json.dumps(status))


frame = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"STATUS", b"STATUS?", b"{}", b"[]", b'{"a":', b"null", b"\xff"]),
    st.builds(lambda v: json.dumps(v).encode(), json_values),
)


@settings(max_examples=500)
@given(st.lists(frame, max_size=4))
def test_decoder_is_total(frames: list[bytes]) -> None:
    try:
        out = decode_status(frames)
    except ProtocolError:
        return
    assert isinstance(out, dict)
