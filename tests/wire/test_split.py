"""The peer-only split-write properties and CONFLICTS?/CONFLICTS (clone.wire.split,
clone.wire.conflicts): round trips, and total decoders under hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import ProtocolError
from clone.wire.codec import new_uuid
from clone.wire.conflicts import (
    decode_conflicts,
    decode_conflicts_request,
    encode_conflicts,
    encode_conflicts_request,
)
from clone.wire.split import GONE, SplitOrigin, parse_split_origin, split_properties, uuid_time

origins = st.builds(
    SplitOrigin,
    term=st.integers(0, 2**63),
    fork=st.integers(0, 2**64 - 1),
    at=st.floats(0, 4e9, allow_nan=False).map(lambda t: round(t, 3)),
    prev=st.none() | st.just(GONE) | st.binary(min_size=16, max_size=16).filter(bool),
    condition=st.none() | st.integers(0, 2**64 - 1),
)


@given(origins)
def test_split_properties_round_trip(origin: SplitOrigin) -> None:
    assert parse_split_origin(split_properties(origin)) == origin


def test_no_split_properties_is_no_origin() -> None:
    assert parse_split_origin((("ttl", "5"),)) is None


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["split_term", "split_fork", "split_at", "split_prev", "split_if", "ttl"]
            ),
            st.text(max_size=40),
        )
    )
)
def test_parse_split_origin_is_total(props: list[tuple[str, str]]) -> None:
    try:
        parse_split_origin(props)
    except ValueError:
        pass


def test_uuid_time_reads_a_uuid7_only() -> None:
    v7 = (1_700_000_000_123).to_bytes(6, "big") + bytes([0x70, 0, 0x80]) + bytes(7)
    assert uuid_time(v7) == 1_700_000_000.123
    assert uuid_time(bytes(16)) is None and uuid_time(b"short") is None
    # The version nibble without RFC 9562's variant bits is not a UUIDv7.
    assert uuid_time(v7[:8] + bytes(8)) is None
    assert uuid_time(new_uuid()) is not None


def test_conflicts_round_trip_and_cut() -> None:
    rec = {"id": 1, "key": "/k", "loser": {"value": "x" * 5000}, "winner": {"value": None}}
    listing = decode_conflicts(encode_conflicts([rec], total=3, unresolved=1))
    assert (listing["total"], listing["unresolved"], listing["truncated"]) == (3, 1, False)
    (got,) = listing["conflicts"]
    assert len(got["loser"]["value"]) == 1000 and got["loser"]["value_cut"] is True
    assert decode_conflicts_request(encode_conflicts_request(everything=True)) is True
    assert decode_conflicts_request(encode_conflicts_request()) is False
    with pytest.raises(ProtocolError):
        decode_conflicts_request([b"CONFLICTS?", b"some"])


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_decode_conflicts_is_total(frames: list[bytes]) -> None:
    try:
        decode_conflicts(frames)
    except ProtocolError:
        pass
