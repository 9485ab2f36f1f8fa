"""The CHP codec: byte-exact frames from the spec, round trips, and totality."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import LimitExceeded, ProtocolError
from clone.wire import codec
from clone.wire.codec import Hugz, KVMsg, SnapshotEnd, SnapshotRequest
from clone.wire.protocol import (
    COLLECTOR_OFFSET,
    MAX_KEY_BYTES,
    MAX_PROPERTIES_BYTES,
    MAX_VALUE_BYTES,
    PUBLISHER_OFFSET,
    SNAPSHOT_OFFSET,
)

UUID = bytes(range(16))


def seq(n: int) -> bytes:
    """A sequence frame built by hand: 8 bytes, network order."""
    return struct.pack("!Q", n)


# --------------------------------------------------------------------------
# Byte-exact frames, built from the spec's tables


def test_port_offsets_are_the_specs() -> None:
    assert (SNAPSHOT_OFFSET, PUBLISHER_OFFSET, COLLECTOR_OFFSET) == (0, 1, 2)


def test_icanhaz_frames() -> None:
    assert codec.encode_icanhaz("/client/") == [b"ICANHAZ?", b"/client/"]
    assert codec.encode_icanhaz() == [b"ICANHAZ?", b""]


def test_kvpub_frames() -> None:
    msg = KVMsg("/a/b", 7, UUID, (("ttl", "30"), ("x", "y=z")), b"value")
    assert codec.encode_kv(msg) == [b"/a/b", seq(7), UUID, b"ttl=30\nx=y=z\n", b"value"]


def test_kthxbai_frames() -> None:
    assert codec.encode_kthxbai(1234, "/s/") == [b"KTHXBAI", seq(1234), b"", b"", b"/s/"]


def test_hugz_frames() -> None:
    assert codec.encode_hugz() == [b"HUGZ", b"\x00" * 8, b"", b"", b""]
    assert codec.encode_hugz(5)[1] == seq(5)


def test_hugz_says_the_heartbeat_when_asked() -> None:
    frames = codec.encode_hugz(7, 250)
    assert frames == [b"HUGZ", seq(7), b"", b"heartbeat=250\n", b""]
    assert codec.decode_update(frames) == Hugz(7, 0.25)
    # Another property alongside is fine; no heartbeat property means "not said".
    both = [b"HUGZ", seq(1), b"", b"x=1\nheartbeat=1000\n", b""]
    assert codec.decode_update(both) == Hugz(1, 1.0)
    assert codec.decode_update([b"HUGZ", seq(1), b"", b"x=1\n", b""]) == Hugz(1, None)


@pytest.mark.parametrize("value", ["", "0", "-5", "1.5", "abc", "\u0661", "3600001"])
def test_hugz_with_a_bad_heartbeat_is_malformed(value: str) -> None:
    frames = [b"HUGZ", seq(1), b"", f"heartbeat={value}\n".encode(), b""]
    with pytest.raises(ProtocolError, match="heartbeat property"):
        codec.decode_update(frames)


@pytest.mark.parametrize("ms", [0, -1, 3_600_001])
def test_encode_hugz_refuses_a_heartbeat_out_of_range(ms: int) -> None:
    with pytest.raises(ValueError, match="heartbeat"):
        codec.encode_hugz(1, ms)


def test_decode_hand_built_kvpub() -> None:
    frames = [b"k\xc3\xa9", seq(2**64 - 1), UUID, b"a=1\nb=\n", b"\x00\xff"]
    assert codec.decode_update(frames) == KVMsg(
        "ké", 2**64 - 1, UUID, (("a", "1"), ("b", "")), b"\x00\xff"
    )


def test_decode_guide_style_kvsync_without_uuid_or_properties() -> None:
    frames = [b"key", seq(0), b"", b"", b"v"]
    assert codec.decode_snapshot_reply(frames) == KVMsg("key", 0, b"", (), b"v")


def test_decode_kthxbai_and_hugz() -> None:
    assert codec.decode_snapshot_reply([b"KTHXBAI", seq(9), b"", b"", b"/x/"]) == SnapshotEnd(
        9, "/x/"
    )
    assert codec.decode_update([b"HUGZ", seq(3), b"", b"", b""]) == Hugz(3)


def test_decode_icanhaz() -> None:
    assert codec.decode_icanhaz([b"ICANHAZ?", b""]) == SnapshotRequest("")
    assert codec.decode_icanhaz([b"ICANHAZ?", b"/a/b/"]) == SnapshotRequest("/a/b/")


def test_delete_is_an_empty_body() -> None:
    msg = codec.decode_kvset([b"gone", seq(0), UUID, b"", b""])
    assert msg.is_delete


# --------------------------------------------------------------------------
# Strict decoding: each rule, with the message that says what was wrong

BAD_KV: list[tuple[list[bytes], str]] = [
    ([b"k", seq(1), UUID, b""], "must have 5 frames, got 4"),
    ([b"k", seq(1), UUID, b"", b"", b""], "must have 5 frames, got 6"),
    ([b"k", b"\x00" * 4, UUID, b"", b"v"], "sequence frame must be 8 bytes, got 4"),
    ([b"k", seq(1), b"\x01" * 15, b"", b"v"], "uuid frame must be 0 or 16 bytes, got 15"),
    ([b"\xff\xfe", seq(1), UUID, b"", b"v"], "key is not UTF-8"),
    ([b"", seq(1), UUID, b"", b"v"], "empty key"),
    ([b"k", seq(1), UUID, b"novalue\n", b"v"], "has no '='"),
    ([b"k", seq(1), UUID, b"=v\n", b"v"], "empty name"),
    ([b"k", seq(1), UUID, b"a=1", b"v"], "must end with a newline"),
    ([b"k", seq(1), UUID, b"a=1\na=2\n", b"v"], "appears twice"),
    ([b"k", seq(1), UUID, b"a=\xff\n", b"v"], "properties are not UTF-8"),
    ([b"k", seq(1), UUID, b"a=1\r\n", b"v"], "carriage return"),
    ([b"k" * (MAX_KEY_BYTES + 1), seq(1), UUID, b"", b"v"], "over the 1024-byte limit"),
    ([b"k", seq(1), UUID, b"", b"v" * (MAX_VALUE_BYTES + 1)], "over the 1048576-byte limit"),
    ([b"k", seq(1), UUID, b"a=" + b"x" * MAX_PROPERTIES_BYTES + b"\n", b"v"], "4096-byte limit"),
    ([b"HUGZ", seq(1), UUID, b"", b"v"], "reserved"),
]


@pytest.mark.parametrize(("frames", "why"), BAD_KV)
def test_kvset_rejects(frames: list[bytes], why: str) -> None:
    with pytest.raises(ProtocolError, match=why.replace("?", r"\?")):
        codec.decode_kvset(frames)


def test_limits_raise_limit_exceeded() -> None:
    with pytest.raises(LimitExceeded):
        codec.decode_kvset([b"k", seq(1), UUID, b"", b"v" * (MAX_VALUE_BYTES + 1)])
    assert (
        len(codec.decode_kvset([b"k", seq(1), UUID, b"", b"v" * MAX_VALUE_BYTES]).body)
        == MAX_VALUE_BYTES
    )


BAD_ICANHAZ: list[tuple[list[bytes], str]] = [
    ([b"ICANHAZ?"], "must have 2 frames, got 1"),
    ([b"ICANHAZ?", b"", b""], "must have 2 frames, got 3"),
    ([b"GIMME", b""], "expected ICANHAZ"),
    ([], "expected ICANHAZ"),
    ([b"ICANHAZ?", b"client"], "neither empty nor"),
    ([b"ICANHAZ?", b"/client"], "neither empty nor"),
    ([b"ICANHAZ?", b"/"], "neither empty nor"),
    ([b"ICANHAZ?", b"/a//"], "neither empty nor"),
    ([b"ICANHAZ?", b"/\xff/"], "not UTF-8"),
]


@pytest.mark.parametrize(("frames", "why"), BAD_ICANHAZ)
def test_icanhaz_rejects(frames: list[bytes], why: str) -> None:
    with pytest.raises(ProtocolError, match=why.replace("?", r"\?")):
        codec.decode_icanhaz(frames)


def test_kthxbai_with_bad_subtree_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="subtree"):
        codec.decode_snapshot_reply([b"KTHXBAI", seq(1), b"", b"", b"nope"])


def test_build_validates_application_input() -> None:
    with pytest.raises(TypeError):
        KVMsg.build(b"key", b"v", uuid=b"")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KVMsg.build("key", "v", uuid=b"")  # type: ignore[arg-type]
    with pytest.raises(LimitExceeded):
        KVMsg.build("key", b"x" * (MAX_VALUE_BYTES + 1), uuid=b"")
    with pytest.raises(ProtocolError, match="reserved"):
        KVMsg.build("KTHXBAI", b"v", uuid=b"")
    with pytest.raises(ProtocolError, match="has no '='"):
        KVMsg.build("k", b"v", uuid=b"", properties={"a\nb": "1"})
    with pytest.raises(ValueError, match="uuid"):
        KVMsg.build("k", b"v", uuid=b"short")


def test_build_takes_the_uuid_it_is_given() -> None:
    """No hidden clock or randomness: the same input builds the same message."""
    uuid = bytes(range(16))
    assert KVMsg.build("k", b"v", uuid=uuid) == KVMsg.build("k", b"v", uuid=uuid)
    assert KVMsg.build("k", b"v", uuid=uuid).uuid == uuid
    assert KVMsg.build("k", b"v", uuid=b"").uuid == b""
    with pytest.raises(TypeError):
        KVMsg.build("k", b"v")  # type: ignore[call-arg]


def test_new_uuid_draws_time_ordered_uuid7() -> None:
    ids = [codec.new_uuid() for _ in range(50)]
    assert all(len(i) == 16 for i in ids)
    assert all((i[6] >> 4) == 7 for i in ids), "version nibble must be 7"
    assert ids == sorted(ids)
    assert len(set(ids)) == 50


def test_prop_and_with_props() -> None:
    msg = KVMsg("k", properties=(("ttl", "5"), ("a", "b")))
    assert msg.prop("ttl") == "5"
    assert msg.prop("nope", "d") == "d"
    assert msg.with_props(ttl=None, expires="12.5") == (("a", "b"), ("expires", "12.5"))


def test_key_in_subtree_is_a_prefix_match() -> None:
    assert codec.key_in_subtree("/a/b", "/a/")
    assert not codec.key_in_subtree("/ab", "/a/")
    assert codec.key_in_subtree("anything", "")


# --------------------------------------------------------------------------
# Round trips and totality (hypothesis)

keys = st.text(min_size=1, max_size=64).filter(
    lambda k: k not in codec.RESERVED_KEYS and not k.startswith("\x00")
)
prop_names = st.text(min_size=1, max_size=12).filter(
    lambda s: "=" not in s and "\n" not in s and "\r" not in s
)
prop_values = st.text(max_size=20).filter(lambda s: "\n" not in s and "\r" not in s)
props = st.dictionaries(prop_names, prop_values, max_size=5).map(lambda d: tuple(d.items()))
messages = st.builds(
    KVMsg,
    key=keys,
    sequence=st.integers(0, 2**64 - 1),
    uuid=st.one_of(st.just(b""), st.binary(min_size=16, max_size=16)),
    properties=props,
    body=st.binary(max_size=256),
)


@given(messages)
def test_kv_round_trip(msg: KVMsg) -> None:
    frames = codec.encode_kv(msg)
    assert codec.decode_update(frames) == msg
    assert codec.decode_kvset(frames) == msg
    assert codec.decode_snapshot_reply(frames) == msg


subtrees = st.one_of(
    st.just(""),
    st.lists(
        st.text(min_size=1, max_size=8).filter(lambda s: "/" not in s), min_size=1, max_size=4
    ).map(lambda segs: "/" + "/".join(segs) + "/"),
)


@given(subtrees, st.integers(0, 2**64 - 1))
def test_icanhaz_and_kthxbai_round_trip(subtree: str, sequence: int) -> None:
    assert codec.decode_icanhaz(codec.encode_icanhaz(subtree)) == SnapshotRequest(subtree)
    end = codec.decode_snapshot_reply(codec.encode_kthxbai(sequence, subtree))
    assert end == SnapshotEnd(sequence, subtree)


frame = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"ICANHAZ?", b"KTHXBAI", b"HUGZ", b"", seq(1), b"a=1\n", b"/a/"]),
)


@settings(max_examples=500)
@given(st.lists(frame, max_size=7))
def test_decoders_are_total(frames: list[bytes]) -> None:
    """For any input a decoder returns a message or raises ProtocolError."""
    for decode in (
        codec.decode_icanhaz,
        codec.decode_kvset,
        codec.decode_update,
        codec.decode_snapshot_reply,
    ):
        try:
            decode(frames)
        except ProtocolError:
            pass


kvsync_frame = frame | st.sampled_from(
    [
        bytes(8),
        bytes(16),
        b"\xff",
        b"\x00",
        b"\x00Vabc\x00",
        b"a=1\na=2\n",
        b"k" * (MAX_KEY_BYTES + 1),
        b"k" * MAX_KEY_BYTES,
    ]
)


@settings(max_examples=1000)
@given(st.one_of(st.lists(kvsync_frame, max_size=7), messages.map(codec.encode_kv)))
def test_fast_kvsync_entry_accepts_exactly_what_the_codec_accepts(frames: list[bytes]) -> None:
    """The sync's fast path is the codec's KVSYNC rule, never looser or stricter."""
    fast = codec.fast_kvsync_entry(frames)
    try:
        msg = codec.decode_snapshot_reply(frames)
    except ProtocolError:
        assert fast is None
        return
    if isinstance(msg, SnapshotEnd):
        assert fast is None
    else:
        assert fast == (msg.key, (msg.sequence, msg.uuid, msg.properties, msg.body))


def test_fast_kvsync_entry_at_the_limits() -> None:
    long_key = "k" * MAX_KEY_BYTES
    biggest = codec.encode_kv(KVMsg(long_key, 1, bytes(16), (), b"v" * MAX_VALUE_BYTES))
    assert codec.fast_kvsync_entry(biggest) is not None
    too_long = codec.encode_kv(KVMsg(long_key + "k", 1, b"", (), b"v"))
    too_big = codec.encode_kv(KVMsg("k", 1, b"", (), b"v" * (MAX_VALUE_BYTES + 1)))
    for frames in (too_long, too_big, codec.encode_kthxbai(1), codec.encode_hugz(1)):
        assert codec.fast_kvsync_entry(frames) is None


@given(st.binary(max_size=200))
def test_properties_decoder_is_total(raw: bytes) -> None:
    try:
        parsed = codec.decode_properties(raw)
    except ProtocolError:
        return
    assert codec.encode_properties(parsed) == raw


# --------------------------------------------------------------------------
# Security: KTHXBAI properties (the view of a restricted requester), NUL keys


def test_kthxbai_without_properties_is_byte_identical() -> None:
    assert codec.encode_kthxbai(5, "/s/") == codec.encode_kthxbai(5, "/s/", ())
    assert codec.encode_kthxbai(5, "/s/", {}) == [b"KTHXBAI", seq(5), b"", b"", b"/s/"]


def test_kthxbai_carries_the_view_of_a_restricted_requester() -> None:
    frames = codec.encode_kthxbai(9, "", {"view": "0123456789ab", "view_count": "4"})
    assert frames[3] == b"view=0123456789ab\nview_count=4\n"
    end = codec.decode_snapshot_reply(frames)
    assert isinstance(end, SnapshotEnd)
    assert (end.sequence, end.view, end.view_count) == (9, "0123456789ab", 4)


def test_kthxbai_of_an_unrestricted_requester_has_no_view() -> None:
    end = codec.decode_snapshot_reply(codec.encode_kthxbai(9))
    assert isinstance(end, SnapshotEnd)
    assert end.view is None and end.view_count is None and end.properties == ()
    other = codec.decode_snapshot_reply(codec.encode_kthxbai(9, "", {"x": "y"}))
    assert isinstance(other, SnapshotEnd) and other.view is None


@pytest.mark.parametrize(
    "props",
    [
        b"view=0123456789ab\n",  # no count
        b"view_count=3\n",  # no view
        b"view=XYZ\nview_count=3\n",  # not an id
        b"view=0123456789ab\nview_count=-1\n",
        b"view=0123456789ab\nview_count=three\n",
        b"view=0123456789ab\nview_count=%d\n" % 2**64,
        b"no newline",
    ],
)
def test_kthxbai_with_a_bad_view_is_malformed(props: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_snapshot_reply([b"KTHXBAI", seq(1), b"", props, b""])


@pytest.mark.parametrize("key", [b"\x00", b"\x00Vabc\x00", b"\x00R" + b"x" * 10])
def test_keys_beginning_with_nul_are_reserved(key: bytes) -> None:
    frames = [key, seq(1), b"", b"", b"v"]
    for decode in (codec.decode_kvset, codec.decode_update, codec.decode_snapshot_reply):
        with pytest.raises(ProtocolError, match="reserved for control topics"):
            decode(frames)
    assert codec.fast_kvsync_entry(frames) is None
    with pytest.raises(ProtocolError, match="reserved for control topics"):
        KVMsg.build(key.decode(), b"v", uuid=b"")
    # A NUL elsewhere in a key is only a byte.
    assert codec.decode_kvset([b"/a\x00", seq(1), b"", b"", b"v"]).key == "/a\x00"


@given(
    st.integers(0, 2**64 - 1),
    subtrees,
    st.text(alphabet="0123456789abcdef", min_size=12, max_size=12),
    st.integers(0, 2**64 - 1),
)
def test_kthxbai_view_round_trip(sequence: int, subtree: str, view: str, count: int) -> None:
    props = {"view": view, "view_count": str(count)}
    end = codec.decode_snapshot_reply(codec.encode_kthxbai(sequence, subtree, props))
    assert isinstance(end, SnapshotEnd)
    assert (end.sequence, end.subtree, end.view, end.view_count) == (
        sequence,
        subtree,
        view,
        count,
    )
