"""Control messages: view heartbeats and refusal notices, byte-exact
frames from docs/protocol.md, round trips and a total decoder."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import ProtocolError
from clone.wire import control, protocol
from clone.wire.control import Refusal, ViewHeartbeat

UUID = bytes(range(16))


def seq(n: int) -> bytes:
    return struct.pack("!Q", n)


def test_constants_are_exported_by_protocol() -> None:
    assert protocol.VIEW_TAG == control.VIEW_TAG == b"\x00V"
    assert protocol.REFUSAL_TAG == control.REFUSAL_TAG == b"\x00R"
    for name in ("VIEW_TAG", "REFUSAL_TAG", "VIEW_PROPERTY", "VIEW_COUNT_PROPERTY"):
        assert name in protocol.__all__


def test_view_id_is_twelve_hex_of_the_sorted_deduplicated_prefixes() -> None:
    import hashlib

    expected = hashlib.sha256(b"/a/\n/public/").hexdigest()[:12]
    assert control.view_id([b"/public/", b"/a/"]) == expected
    assert control.view_id([b"/a/", b"/public/", b"/a/"]) == expected
    assert control.view_id([]) == hashlib.sha256(b"").hexdigest()[:12]
    assert control.view_id([b"/a/"]) != control.view_id([b"/b/"])
    with pytest.raises(TypeError):
        control.view_id(["/a/"])  # type: ignore[list-item]


def test_topics() -> None:
    assert control.view_topic("0123456789ab") == b"\x00V0123456789ab\x00"
    assert control.refusal_topic("reader") == b"\x00Rreader\x00"
    assert control.refusal_topic("é") == b"\x00R\xc3\xa9\x00"
    for bad in ("", "a\x00b"):
        with pytest.raises(ValueError):
            control.refusal_topic(bad)
    for bad_view in ("0123", "0123456789AB", "0123456789ag"):
        with pytest.raises(ValueError):
            control.view_topic(bad_view)


def test_view_heartbeat_frames_are_the_contracts() -> None:
    frames = control.encode_view_heartbeat("0123456789ab", 42, 250, 7)
    assert frames == [
        b"\x00V0123456789ab\x00",
        seq(42),
        b"",
        b"heartbeat=250\nview_count=7\n",
        b"",
    ]
    assert control.decode_control(frames) == ViewHeartbeat("0123456789ab", 42, 0.25, 7)
    bare = control.encode_view_heartbeat("0123456789ab", 1, None, 0)
    assert bare[3] == b"view_count=0\n"
    assert control.decode_control(bare) == ViewHeartbeat("0123456789ab", 1, None, 0)
    # A stale relay says so, as in its HUGZ; a decoder that does not know it ignores it.
    stale = control.encode_view_heartbeat("0123456789ab", 1, None, 0, stale=True)
    assert stale[3] == b"view_count=0\nstale=1\n"
    assert control.decode_control(stale) == ViewHeartbeat("0123456789ab", 1, None, 0, True)


def test_refusal_frames_are_the_contracts() -> None:
    frames = control.encode_refusal("reader", UUID, "acl")
    assert frames == [b"\x00Rreader\x00", bytes(8), UUID, b"reason=acl\n", b""]
    assert control.decode_control(frames) == Refusal("reader", UUID, "acl")
    with pytest.raises(ValueError):
        control.encode_refusal("reader", UUID, "because")
    with pytest.raises(ValueError):
        control.encode_refusal("reader", b"short", "acl")


def test_a_newer_servers_reason_is_still_a_refusal() -> None:
    frames = [b"\x00Rme\x00", bytes(8), UUID, b"reason=quota\n", b""]
    assert control.decode_control(frames) == Refusal("me", UUID, "quota")


def test_is_control() -> None:
    assert control.is_control([b"\x00V..."])
    assert not control.is_control([b"HUGZ", seq(0), b"", b"", b""])
    assert not control.is_control([b"/a", seq(1), b"", b"", b"v"])
    assert not control.is_control([])
    assert not control.is_control([b""])


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x00V0123456789ab\x00", seq(1), b"", b"heartbeat=250\n", b""],  # no count
        [b"\x00V0123456789ab\x00", seq(1), b"", b"view_count=x\n", b""],
        [b"\x00V0123456789ab\x00", seq(1), b"", b"view_count=1\nheartbeat=0\n", b""],
        [b"\x00V0123456789ab\x00", b"\x01", b"", b"view_count=1\n", b""],
        [b"\x00V0123456789ab\x00", seq(1), UUID, b"view_count=1\n", b""],
        [b"\x00V0123456789ab\x00", seq(1), b"", b"view_count=1\n", b"body"],
        [b"\x00V0123\x00", seq(1), b"", b"view_count=1\n", b""],
        [b"\x00V0123456789ab", seq(1), b"", b"view_count=1\n", b""],  # no closing NUL
        [b"\x00Rme\x00", bytes(8), UUID, b"", b""],  # no reason
        [b"\x00Rme\x00", bytes(8), b"abc", b"reason=acl\n", b""],
        [b"\x00R\x00", bytes(8), UUID, b"reason=acl\n", b""],  # no name
        [b"\x00Rm\x00e\x00", bytes(8), UUID, b"reason=acl\n", b""],
        [b"\x00R\xff\x00", bytes(8), UUID, b"reason=acl\n", b""],
        [b"\x00X\x00", bytes(8), UUID, b"reason=acl\n", b""],  # unknown tag
        [b"\x00Rme\x00", bytes(8), UUID, b"reason=acl\n"],  # four frames
    ],
)
def test_malformed_control_messages_are_protocol_errors(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        control.decode_control(frames)


views = st.text(alphabet="0123456789abcdef", min_size=12, max_size=12)
names = st.text(min_size=1, max_size=40).filter(lambda s: "\x00" not in s)


@given(
    views,
    st.integers(0, 2**64 - 1),
    st.one_of(st.none(), st.integers(1, 3_600_000)),
    st.integers(0, 2**64 - 1),
)
def test_view_heartbeat_round_trip(view: str, sequence: int, ms: int | None, count: int) -> None:
    msg = control.decode_control(control.encode_view_heartbeat(view, sequence, ms, count))
    assert msg == ViewHeartbeat(view, sequence, None if ms is None else ms / 1000.0, count)


@given(
    names,
    st.one_of(st.just(b""), st.binary(min_size=16, max_size=16)),
    st.sampled_from(sorted(protocol.REFUSAL_REASONS)),
)
def test_refusal_round_trip(name: str, uuid: bytes, reason: str) -> None:
    assert control.decode_control(control.encode_refusal(name, uuid, reason)) == Refusal(
        name, uuid, reason
    )


control_frame = st.one_of(
    st.binary(max_size=40),
    st.sampled_from(
        [
            b"\x00V0123456789ab\x00",
            b"\x00Rname\x00",
            b"\x00V",
            b"\x00R",
            bytes(8),
            UUID,
            b"",
            b"view_count=3\n",
            b"heartbeat=250\nview_count=3\n",
            b"reason=acl\n",
            b"view_count=99999999999999999999999\n",
        ]
    ),
)


@settings(max_examples=1000)
@given(st.lists(control_frame, max_size=7))
def test_decode_control_is_total(frames: list[bytes]) -> None:
    """For any input: a control message or ProtocolError, nothing else."""
    try:
        msg = control.decode_control(frames)
    except ProtocolError:
        return
    assert isinstance(msg, ViewHeartbeat | Refusal)
    assert control.is_control(frames)


@pytest.mark.parametrize("reason", ["stale", "overloaded"])
def test_a_relays_reasons_round_trip(reason: str) -> None:
    frames = control.encode_refusal("*", UUID, reason)
    assert frames[0] == b"\x00R*\x00"
    assert control.decode_control(frames) == Refusal("*", UUID, reason)
