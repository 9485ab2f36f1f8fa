"""KVDELTA and X-CHP-Since, our catch-up extension: byte-exact frames, round
trips, the digest, and totality of the decoders."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import ProtocolError
from clone.wire.delta import (
    DeltaHead,
    SinceRequest,
    decode_kvdelta,
    decode_kvdelta_head,
    encode_kvdelta,
    is_kvdelta,
    parse_since,
    parse_since_term,
    since_metadata,
    since_term_metadata,
    update_digest,
)
from clone.wire.protocol import KVDELTA, SINCE_PROPERTY, SINCE_TERM_PROPERTY

DIGEST = bytes.fromhex("0123456789abcdef")
UPDATE = [b"/k", struct.pack("!Q", 7), bytes(16), b"ttl=5\n", b"value"]


# --------------------------------------------------------------------------
# X-CHP-Since


def test_since_metadata_is_the_property_and_its_value() -> None:
    assert SINCE_PROPERTY == "X-CHP-Since"
    assert since_metadata(42, DIGEST) == b"X-CHP-Since:42,0123456789abcdef"


@pytest.mark.parametrize(
    ("seq", "digest"), [(-1, DIGEST), (2**64, DIGEST), (1, b"short"), (1, DIGEST + b"x")]
)
def test_since_metadata_rejects_misuse(seq: int, digest: bytes) -> None:
    with pytest.raises(ValueError):
        since_metadata(seq, digest)


@given(st.integers(0, 2**64 - 1), st.binary(min_size=8, max_size=8))
def test_since_round_trip(seq: int, digest: bytes) -> None:
    name, _, value = since_metadata(seq, digest).decode().partition(":")
    assert name == SINCE_PROPERTY
    assert parse_since(value) == SinceRequest(seq, digest)


def test_since_accepts_upper_case_hex() -> None:
    assert parse_since("1,0123456789ABCDEF") == SinceRequest(1, DIGEST)


@pytest.mark.parametrize(
    "value",
    [
        "",
        ",",
        "0123456789abcdef",
        "42,0123456789abcdef,",
        "42,0123456789abcdef,1",
        "-1,0123456789abcdef",
        "+1,0123456789abcdef",
        " 1,0123456789abcdef",
        "1 ,0123456789abcdef",
        "0x10,0123456789abcdef",
        "1.0,0123456789abcdef",
        "\u0661,0123456789abcdef",  # an Arabic-Indic digit one: isdigit() but not ASCII
        f"{2**64},0123456789abcdef",
        "9" * 5000 + ",0123456789abcdef",  # over int()'s digit limit: still ours
        "1,0123456789abcde",
        "1,0123456789abcdef0",
        "1,0123456789abcdeg",
        "1,01 23456789abcde",
        "1, 0123456789abcdef",
        "1,",
    ],
)
def test_since_rejects_malformed_values(value: str) -> None:
    with pytest.raises(ProtocolError):
        parse_since(value)


def test_since_accepts_the_largest_sequence() -> None:
    assert parse_since(f"{2**64 - 1},{DIGEST.hex()}").sequence == 2**64 - 1


@settings(max_examples=500)
@given(
    st.one_of(
        st.text(max_size=60),
        st.builds(
            lambda a, b: f"{a},{b}",
            st.one_of(st.text(max_size=25), st.integers(-5, 2**65).map(str)),
            st.one_of(st.text(max_size=20), st.binary(min_size=7, max_size=9).map(bytes.hex)),
        ),
    )
)
def test_parse_since_is_total(value: str) -> None:
    """For any text parse_since returns a request or raises ProtocolError."""
    try:
        request = parse_since(value)
    except ProtocolError:
        return
    assert 0 <= request.sequence < 2**64
    assert request.digest is None or len(request.digest) == 8


# --------------------------------------------------------------------------
# The update digest


def test_digest_is_blake2b_of_length_prefixed_frames() -> None:
    h = hashlib.blake2b(digest_size=8)
    for frame in UPDATE:
        h.update(struct.pack("!I", len(frame)) + frame)
    assert update_digest(UPDATE) == h.digest()
    assert len(update_digest(UPDATE)) == 8


def test_digest_tells_apart_updates_at_the_same_sequence() -> None:
    other_body = [*UPDATE[:4], b"other"]
    moved = [b"/kv", UPDATE[1], UPDATE[2], UPDATE[3], b"alue"]  # same bytes, other frames
    delete = [*UPDATE[:4], b""]
    digests = {update_digest(f) for f in (UPDATE, other_body, moved, delete)}
    assert len(digests) == 4
    assert update_digest(list(UPDATE)) == update_digest(tuple(UPDATE))


@pytest.mark.parametrize("count", [0, 4, 6])
def test_digest_needs_five_frames(count: int) -> None:
    with pytest.raises(ValueError):
        update_digest([b""] * count)


# --------------------------------------------------------------------------
# KVDELTA


def test_kvdelta_frames_by_hand() -> None:
    assert KVDELTA == b"KVDELTA"
    assert encode_kvdelta(258) == [b"KVDELTA", b"\0\0\0\0\0\0\x01\x02", b""]


@given(st.integers(0, 2**64 - 1))
def test_kvdelta_round_trip(seq: int) -> None:
    frames = encode_kvdelta(seq)
    assert is_kvdelta(frames)
    assert decode_kvdelta(frames) == seq


@pytest.mark.parametrize("seq", [-1, 2**64])
def test_encode_kvdelta_rejects_misuse(seq: int) -> None:
    with pytest.raises(ValueError):
        encode_kvdelta(seq)


def test_kvdelta_ignores_properties_it_does_not_know() -> None:
    assert decode_kvdelta([KVDELTA, struct.pack("!Q", 9), b"later=1\n"]) == 9


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([KVDELTA, struct.pack("!Q", 1)], "frames"),
        ([KVDELTA, struct.pack("!Q", 1), b"", b""], "frames"),
        ([b"KVSYNC", struct.pack("!Q", 1), b""], "frames"),
        ([KVDELTA, b"\0" * 7, b""], "8"),
        ([KVDELTA, b"\0" * 9, b""], "8"),
        ([KVDELTA, struct.pack("!Q", 1), b"no-equals\n"], "="),
        ([KVDELTA, struct.pack("!Q", 1), b"a=1"], "newline"),
        ([KVDELTA, struct.pack("!Q", 1), b"\xff=1\n"], "UTF-8"),
        ([KVDELTA, struct.pack("!Q", 1), b"a=" + b"x" * 5000 + b"\n"], "limit"),
    ],
)
def test_malformed_kvdelta_is_rejected_with_its_reason(frames: list[bytes], why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode_kvdelta(frames)


def test_is_kvdelta_is_a_cheap_claim() -> None:
    # A malformed KVDELTA still claims to be one (and is refused when decoded),
    # never a snapshot entry; a KVSYNC for the key "KVDELTA" has five frames.
    assert is_kvdelta([KVDELTA, b""])
    assert not is_kvdelta([KVDELTA, b"", b"", b"", b"v"])
    assert not is_kvdelta([b"KTHXBAI", b"", b""])
    assert is_kvdelta([KVDELTA, b"bad", b"bad"])  # decode to know


frame = st.one_of(
    st.binary(max_size=20),
    st.sampled_from([KVDELTA, b"", struct.pack("!Q", 3), b"a=1\n", b"=\n", b"KTHXBAI"]),
)


@settings(max_examples=500)
@given(st.lists(frame, max_size=5), st.booleans())
def test_decode_kvdelta_is_total(frames: list[bytes], as_delta: bool) -> None:
    """For any input decode_kvdelta returns a sequence or raises ProtocolError."""
    if as_delta and frames:
        frames[0] = KVDELTA  # get past the command check more often
    try:
        assert 0 <= decode_kvdelta(frames) < 2**64
    except ProtocolError:
        pass


# --------------------------------------------------------------------------
# History requests: X-CHP-Since without a digest, and the compacted reply


def test_history_request_is_the_sequence_alone() -> None:
    assert since_metadata(20) == b"X-CHP-Since:20"
    assert parse_since("20") == SinceRequest(20, None)
    assert parse_since("20").history and not parse_since(f"20,{DIGEST.hex()}").history
    assert parse_since("0") == SinceRequest(0)


@given(st.integers(0, 2**64 - 1))
def test_history_request_round_trip(seq: int) -> None:
    _, _, value = since_metadata(seq).decode().partition(":")
    assert parse_since(value) == SinceRequest(seq)


@pytest.mark.parametrize("value", ["", "-1", "+1", " 1", "1 ", "0x10", "\u0661", f"{2**64}"])
def test_history_request_is_as_strict_as_a_catch_up(value: str) -> None:
    with pytest.raises(ProtocolError):
        parse_since(value)


def test_compacted_kvdelta_frames_by_hand() -> None:
    assert encode_kvdelta(20, compacted=41) == [KVDELTA, struct.pack("!Q", 20), b"compacted=41\n"]
    assert decode_kvdelta_head(encode_kvdelta(20, 41)) == DeltaHead(20, 41)
    assert decode_kvdelta_head(encode_kvdelta(20)) == DeltaHead(20, None)
    assert decode_kvdelta(encode_kvdelta(20, 41)) == 20


@pytest.mark.parametrize("value", [b"", b"x", b"-1", b"1.5", str(2**64).encode(), b"9" * 30])
def test_compacted_must_be_a_sequence(value: bytes) -> None:
    with pytest.raises(ProtocolError, match="compacted"):
        decode_kvdelta_head([KVDELTA, struct.pack("!Q", 1), b"compacted=" + value + b"\n"])


@settings(max_examples=500)
@given(
    st.lists(frame, max_size=4),
    st.one_of(st.text(max_size=25), st.integers(-3, 2**65).map(str)),
)
def test_decode_kvdelta_head_is_total(frames: list[bytes], compacted: str) -> None:
    """For any input decode_kvdelta_head returns a head or raises ProtocolError."""
    candidates = [frames, [KVDELTA, struct.pack("!Q", 2), f"compacted={compacted}\n".encode()]]
    for candidate in candidates:
        try:
            head = decode_kvdelta_head(candidate)
        except ProtocolError:
            continue
        assert 0 <= head.from_sequence < 2**64
        assert head.compacted is None or 0 <= head.compacted < 2**64


# --------------------------------------------------------------------------
# X-CHP-Since-Term: the term of a pair server's last update, beside its digest


def test_since_term_metadata_is_its_own_property() -> None:
    assert since_term_metadata(7) == f"{SINCE_TERM_PROPERTY}:7".encode()
    assert SINCE_TERM_PROPERTY != SINCE_PROPERTY  # an older server ignores it whole
    with pytest.raises(ValueError):
        since_term_metadata(-1)


@given(st.integers(0, 2**64 - 1))
def test_since_term_round_trip(term: int) -> None:
    value = since_term_metadata(term).decode().split(":", 1)[1]
    assert parse_since_term(value) == term


@pytest.mark.parametrize("value", ["", "-1", "1.0", " 1", "1,2", "\u0663", "x", str(2**64),
                                   "9" * 30])
def test_since_term_rejects_malformed_values(value: str) -> None:
    with pytest.raises(ProtocolError, match=SINCE_TERM_PROPERTY):
        parse_since_term(value)
