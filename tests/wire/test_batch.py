"""KVBATCH, our batched-snapshot extension: byte-exact frames, round trips, and
every way a batch can be malformed, each rejected whole with its reason."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clone.errors import LimitExceeded, ProtocolError
from clone.wire import codec
from clone.wire.batch import (
    KVBatch,
    announced_entries,
    batch_size,
    decode_kvbatch,
    encode_kvbatch,
    is_kvbatch,
)
from clone.wire.codec import KVMsg
from clone.wire.protocol import (
    BATCH_TARGET_BYTES,
    MAX_BATCH_BYTES,
    MAX_BATCH_ENTRIES,
    MAX_KEY_BYTES,
    MAX_PROPERTIES_BYTES,
    MAX_VALUE_BYTES,
)

UUID = bytes(range(16))


def seq(n: int) -> bytes:
    return struct.pack("!Q", n)


def lens(*sizes: int) -> bytes:
    """A lengths frame built by hand: 32-bit unsigned, network order."""
    return struct.pack(f"!{len(sizes)}I", *sizes)


def by_hand(entries: list[tuple[bytes, int, bytes, bytes, bytes]]) -> list[bytes]:
    """A KVBATCH built from the spec's layout, without clone.wire.batch."""
    columns = list(zip(*entries, strict=True))
    keys, seqs, uuids, props, bodies = columns
    return [
        b"KVBATCH",
        lens(*map(len, keys)),
        b"".join(keys),
        b"".join(map(seq, seqs)),
        lens(*map(len, uuids)),
        b"".join(uuids),
        lens(*map(len, props)),
        b"".join(props),
        lens(*map(len, bodies)),
        b"".join(bodies),
    ]


GOOD = [
    (b"/a/1", 7, UUID, b"", b"one"),
    ("/a/é".encode(), 8, b"", b"ttl=30\nexpires=1.5\n", b"\x00\xff"),
    (b"k\x00with-nul", 2**64 - 1, UUID, b"", b"x" * 300),
]


def _store_entries(
    rows: list[tuple[bytes, int, bytes, bytes, bytes]],
) -> tuple[list[bytes], list[tuple[bytes, bytes, bytes, bytes]]]:
    keys = [r[0] for r in rows]
    return keys, [(seq(r[1]), r[2], r[3], r[4]) for r in rows]


# --------------------------------------------------------------------------
# Byte-exact frames and round trips


def test_encoder_matches_the_spec_layout_byte_for_byte() -> None:
    assert encode_kvbatch(*_store_entries(GOOD)) == by_hand(GOOD)


def test_decoded_columns_hold_both_raw_and_decoded_values() -> None:
    batch = decode_kvbatch(by_hand(GOOD))
    assert len(batch) == 3
    assert batch.keys == ["/a/1", "/a/é", "k\x00with-nul"]
    assert batch.raw_keys == [r[0] for r in GOOD]
    assert batch.sequences == [7, 8, 2**64 - 1]
    assert batch.sequence_frames() == [seq(7), seq(8), seq(2**64 - 1)]
    assert batch.uuids == [UUID, b"", UUID]
    assert batch.raw_properties == [b"", b"ttl=30\nexpires=1.5\n", b""]
    assert batch.properties == [(), (("ttl", "30"), ("expires", "1.5")), ()]
    assert batch.bodies == [b"one", b"\x00\xff", b"x" * 300]
    assert batch.messages()[1] == KVMsg(
        "/a/é", 8, b"", (("ttl", "30"), ("expires", "1.5")), b"\x00\xff"
    )


def test_each_entry_decodes_as_the_kvsync_it_stands_for() -> None:
    batch = decode_kvbatch(by_hand(GOOD))
    for row, msg in zip(GOOD, batch.messages(), strict=True):
        kvsync = [row[0], seq(row[1]), row[2], row[3], row[4]]
        assert codec.decode_snapshot_reply(kvsync) == msg


def test_a_batch_of_one_and_a_full_batch() -> None:
    one = [(b"k", 1, b"", b"", b"v")]
    assert decode_kvbatch(by_hand(one)).keys == ["k"]
    full = [(b"/k/%d" % i, i, UUID, b"", b"v%d" % i) for i in range(MAX_BATCH_ENTRIES)]
    batch = decode_kvbatch(encode_kvbatch(*_store_entries(full)))
    assert len(batch) == MAX_BATCH_ENTRIES and batch.bodies[-1] == b"v4095"


def test_values_of_one_size_and_of_mixed_sizes_split_the_same() -> None:
    """The decoder cuts equal-size columns, small mixed ones and ones with large
    values three different ways; all must agree with the layout."""
    rows = [(b"/k/%d" % i, i, UUID, b"", b"v" * (i % 7 + 1)) for i in range(50)]
    rows.append((b"/big", 99, b"", b"", b"B" * 5000))  # over the format table
    for sample in (rows[:1], rows[:3], rows[:50], rows, [rows[-1]] * 2):
        batch = decode_kvbatch(by_hand(sample))
        assert batch.bodies == [r[4] for r in sample]
        assert batch.raw_keys == [r[0] for r in sample]


def test_is_kvbatch_looks_at_the_shape_only() -> None:
    assert is_kvbatch(by_hand(GOOD))
    assert not is_kvbatch([b"KVBATCH", seq(1), b"", b"", b"v"])  # a KVSYNC for key KVBATCH
    assert not is_kvbatch([b"other", *by_hand(GOOD)[1:]])


def test_announced_entries_reads_the_key_lengths_frame_only() -> None:
    assert announced_entries(by_hand(GOOD)) == len(GOOD)
    assert announced_entries(encode_kvbatch(*_store_entries(GOOD))) == len(GOOD)
    # A claim, not a decode: garbage announces what it likes.
    assert announced_entries([b"KVBATCH", bytes(4 * 1000), *[b""] * 8]) == 1000


def test_a_kvsync_whose_key_is_kvbatch_is_still_a_kvsync() -> None:
    assert codec.decode_snapshot_reply([b"KVBATCH", seq(1), b"", b"", b"v"]) == KVMsg(
        "KVBATCH", 1, b"", (), b"v"
    )


def test_encoder_refuses_empty_oversized_or_mismatched_batches() -> None:
    with pytest.raises(ValueError, match="1 to 4096 entries, not 0"):
        encode_kvbatch([], [])
    keys, entries = _store_entries([(b"k", 1, b"", b"", b"v")] * (MAX_BATCH_ENTRIES + 1))
    with pytest.raises(ValueError, match="not 4097"):
        encode_kvbatch(keys, entries)
    with pytest.raises(ValueError, match="2 keys but 1 entries"):
        encode_kvbatch([b"a", b"b"], entries[:1])


def test_batch_size_stops_at_the_byte_target_but_takes_at_least_one() -> None:
    small = _store_entries([(b"/k/%d" % i, i, b"", b"", b"v") for i in range(10)])
    assert batch_size(*small) == 10
    third = BATCH_TARGET_BYTES // 3 - 10
    big = _store_entries([(b"k%d" % i, i, b"", b"", b"x" * third) for i in range(10)])
    # Keys and bodies count: three entries stay under the target, the fourth
    # reaches it and is the last one in.
    assert 3 * (2 + third) < BATCH_TARGET_BYTES <= 4 * (2 + third)
    assert batch_size(*big) == 4
    huge = _store_entries([(b"k", 1, b"", b"", b"x" * MAX_VALUE_BYTES)] * 3)
    assert batch_size(*huge) == 1
    with pytest.raises(ValueError):
        batch_size([], [])


entry_rows = st.tuples(
    st.text(min_size=1, max_size=40)
    # Keys beginning with NUL are control topics: no server stores or sends one.
    .filter(lambda k: k not in codec.RESERVED_KEYS and not k.startswith("\x00"))
    .map(lambda k: k.encode()),
    st.integers(0, 2**64 - 1),
    st.one_of(st.just(b""), st.binary(min_size=16, max_size=16)),
    st.dictionaries(
        st.text(min_size=1, max_size=8).filter(
            lambda s: "=" not in s and "\n" not in s and "\r" not in s
        ),
        st.text(max_size=8).filter(lambda s: "\n" not in s and "\r" not in s),
        max_size=3,
    ).map(lambda d: codec.encode_properties(tuple(d.items()))),
    st.binary(max_size=64),
)


@given(st.lists(entry_rows, min_size=1, max_size=40))
def test_round_trip(rows: list[tuple[bytes, int, bytes, bytes, bytes]]) -> None:
    frames = encode_kvbatch(*_store_entries(rows))
    assert frames == by_hand(rows)
    batch = decode_kvbatch(frames)
    expected = [codec.decode_snapshot_reply([r[0], seq(r[1]), r[2], r[3], r[4]]) for r in rows]
    assert batch.messages() == expected


frame = st.one_of(
    st.binary(max_size=24),
    st.sampled_from([b"KVBATCH", b"", lens(1), lens(0), lens(1, 2), seq(1), b"a=1\n", b"k"]),
)


@settings(max_examples=500)
@given(st.lists(frame, min_size=9, max_size=11), st.booleans())
def test_decoder_is_total(frames: list[bytes], as_batch: bool) -> None:
    """For any input the decoder returns a batch or raises ProtocolError."""
    if as_batch:
        frames[0] = b"KVBATCH"  # get past the command check more often
    try:
        assert isinstance(decode_kvbatch(frames), KVBatch)
    except ProtocolError:
        pass


@settings(max_examples=500)
@given(st.integers(1, 9), st.one_of(st.binary(max_size=40), st.sampled_from([lens(0), lens(1)])))
def test_decoder_is_total_on_a_good_batch_with_one_frame_changed(index: int, raw: bytes) -> None:
    frames = by_hand(GOOD)
    frames[index] = raw
    try:
        assert len(decode_kvbatch(frames)) >= 1
    except ProtocolError:
        pass


# --------------------------------------------------------------------------
# Malformed batches: each rejected whole, with a message that says why


def _bad(**changes: bytes) -> list[bytes]:
    """The good batch with some frames replaced, by name."""
    names = [
        "head", "key_lens", "keys", "seqs", "uuid_lens", "uuids",
        "props_lens", "props", "body_lens", "bodies",
    ]  # fmt: skip
    frames = by_hand(GOOD)
    for name, value in changes.items():
        frames[names.index(name)] = value
    return frames


one = [(b"k", 1, UUID, b"", b"v")]
BAD: list[tuple[list[bytes], str]] = [
    (by_hand(GOOD)[:9], "must have 10 frames, got 9"),
    ([*by_hand(GOOD), b""], "must have 10 frames, got 11"),
    (_bad(head=b"KVBATCHX"), "expected KVBATCH"),
    (_bad(key_lens=lens(4, 5, 12)[:-1]), "key lengths frame of 11 bytes is not a multiple of 4"),
    (_bad(body_lens=b"\x00" * 13), "body lengths frame of 13 bytes"),
    (_bad(uuid_lens=lens(16, 0)), "columns disagree: 3 keys, 2 uuids, 3 properties, 3 bodies"),
    (_bad(seqs=seq(1) * 2), "needs 24 bytes of sequences, got 16"),
    (_bad(seqs=seq(1) * 3 + b"\x00"), "needs 24 bytes of sequences, got 25"),
    (_bad(key_lens=lens(4, 5, 13)), "key lengths add up to 22 bytes but the frame has 19"),
    (_bad(body_lens=lens(3, 2, 299)), "body lengths add up to 304 bytes but the frame has 305"),
    (_bad(props=b""), "properties lengths add up to 19 bytes but the frame has 0"),
    (_bad(uuids=UUID + UUID + b"x"), "uuid lengths add up to 32 bytes but the frame has 33"),
    ([b"KVBATCH", b"", b"", b"", b"", b"", b"", b"", b"", b""], "KVBATCH with no entries"),
    (
        by_hand([(b"k", 1, b"", b"", b"v")] * (MAX_BATCH_ENTRIES + 1)),
        "4097 entries is over the 4096-entry limit",
    ),
    (by_hand([(b"", 1, UUID, b"", b"v")]), "entry 0: empty key"),
    (by_hand([*one, (b"k" * (MAX_KEY_BYTES + 1), 1, UUID, b"", b"v")]), "entry 1: key of 1025"),
    (by_hand([*one, (b"\xff\xfe", 1, UUID, b"", b"v")]), "entry 1: key is not UTF-8"),
    (by_hand([*one, *one, (b"KTHXBAI", 1, UUID, b"", b"v")]), "entry 2: key 'KTHXBAI' is reserved"),
    (by_hand([(b"HUGZ", 1, UUID, b"", b"v")]), "key 'HUGZ' is reserved"),
    (
        by_hand([*one, (b"\x00Vabc", 1, UUID, b"", b"v")]),
        "entry 1: keys beginning with NUL are reserved",
    ),
    (by_hand([*one, (b"k", 1, b"\x01" * 15, b"", b"v")]), "entry 1: uuid must be 0 or 16 bytes"),
    (by_hand([*one, (b"k", 1, b"", b"novalue\n", b"v")]), "entry 1: property 'novalue' has no '='"),
    (by_hand([(b"k", 1, b"", b"a=\xff\n", b"v")]), "entry 0: properties are not UTF-8"),
    (
        by_hand([*one, (b"k", 1, b"", b"a=" + b"x" * MAX_PROPERTIES_BYTES + b"\n", b"v")]),
        "entry 1: properties of 4099 bytes are over the 4096-byte limit",
    ),
    (
        by_hand([*one, (b"k", 1, b"", b"", b"v" * (MAX_VALUE_BYTES + 1))]),
        "entry 1: value of 1048577 bytes is over the 1048576-byte limit",
    ),
    (
        by_hand([(b"k", 1, b"", b"", b"v" * MAX_VALUE_BYTES)] * 3),
        f"is over the {MAX_BATCH_BYTES}-byte limit",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("frames", "why"), BAD)
def test_malformed_batches_are_rejected_whole(frames: list[bytes], why: str) -> None:
    with pytest.raises(ProtocolError, match=why.replace("?", r"\?")):
        decode_kvbatch(frames)


def test_limits_raise_limit_exceeded() -> None:
    over = [
        by_hand([(b"k", 1, b"", b"", b"v")] * (MAX_BATCH_ENTRIES + 1)),
        by_hand([(b"k" * (MAX_KEY_BYTES + 1), 1, b"", b"", b"v")]),
        by_hand([(b"k", 1, b"", b"", b"v" * (MAX_VALUE_BYTES + 1))]),
    ]
    for frames in over:
        with pytest.raises(LimitExceeded):
            decode_kvbatch(frames)
    # At the limits exactly: accepted.
    edge = by_hand([(b"k" * MAX_KEY_BYTES, 1, b"", b"", b"v" * MAX_VALUE_BYTES)])
    assert len(decode_kvbatch(edge).bodies[0]) == MAX_VALUE_BYTES
