"""The catch-up stream and the decision to give one, without sockets."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from clone.server.delta import DeltaStream, open_catch_up
from clone.server.history import History
from clone.wire.applied import encode_kvapplied
from clone.wire.codec import KVMsg, SnapshotEnd, decode_snapshot_reply, encode_kthxbai
from clone.wire.delta import SinceRequest, decode_kvdelta, encode_kvdelta, update_digest

ID = b"\0peer"


def upd(seq: int, body: bytes = b"v") -> list[bytes]:
    """A KVPUB's five frames at ``seq`` (an empty body is a delete)."""
    return [b"/k/%d" % (seq % 3), seq.to_bytes(8, "big"), bytes(16), b"", body]


def history(first: int, last: int, max_updates: int = 100) -> History:
    h = History(max_updates, 1 << 20)
    for seq in range(first, last + 1):
        h.append(upd(seq, b"" if seq % 4 == 0 else b"v%d" % seq), term=1)
    return h


def drain(stream: DeltaStream) -> list[Sequence[bytes]]:
    out = []
    while not stream.done:
        frames = stream.peek()
        assert frames is not None
        assert frames[0] == stream.identity
        out.append(frames[1:])
        stream.advance()
    assert stream.peek() is None
    return out


def test_stream_is_kvdelta_updates_then_kthxbai() -> None:
    updates = [upd(6), upd(7, b""), upd(8)]
    stream = DeltaStream(ID, updates, 5, 8)
    assert (stream.identity, stream.sequence, stream.subtree, stream.total_keys) == (ID, 8, "", 3)
    assert (stream.batch, stream.batches_sent, stream.sent, stream.done) == (False, 0, 0, False)
    out = drain(stream)
    assert out == [encode_kvdelta(5), *updates, encode_kthxbai(8, "")]
    assert decode_kvdelta(out[0]) == 5
    msgs = [decode_snapshot_reply(m) for m in out[1:]]
    assert [m.sequence for m in msgs if isinstance(m, KVMsg)] == [6, 7, 8]
    assert isinstance(msgs[1], KVMsg) and msgs[1].is_delete
    assert msgs[-1] == SnapshotEnd(8, "")
    assert (stream.sent, stream.done, stream.batches_sent) == (3, True, 0)


def test_an_empty_delta_says_the_requester_is_up_to_date() -> None:
    assert drain(DeltaStream(ID, [], 9, 9)) == [encode_kvdelta(9), encode_kthxbai(9, "")]


def test_preamble_comes_before_kvdelta() -> None:
    applied = encode_kvapplied(8, [bytes(16)], span=1.5)
    stream = DeltaStream(ID, [upd(8)], 7, 8, preamble=applied)
    out = drain(stream)
    assert out == [*applied, encode_kvdelta(7), upd(8), encode_kthxbai(8, "")]
    assert stream.sent == 1  # the preamble and KVDELTA are not updates


def test_peek_without_advance_returns_the_same_frames() -> None:
    stream = DeltaStream(ID, [upd(2), upd(3)], 1, 3)
    seen = []
    while not stream.done:
        first = stream.peek()
        assert stream.peek() == first  # a failed send retries these frames
        seen.append(first)
        stream.advance()
    assert len(seen) == 4 and stream.sent == 2


def test_advance_without_peek_is_misuse() -> None:
    stream = DeltaStream(ID, [upd(2)], 1, 2)
    with pytest.raises(ValueError):
        stream.advance()
    stream.peek()
    stream.advance()
    with pytest.raises(ValueError):
        stream.advance()


@pytest.mark.parametrize(("count", "since", "seq"), [(2, 1, 4), (2, 1, 2), (0, 3, 4)])
def test_updates_must_lead_from_since_to_sequence(count: int, since: int, seq: int) -> None:
    with pytest.raises(ValueError):
        DeltaStream(ID, [upd(since + 1 + i) for i in range(count)], since, seq)


# --------------------------------------------------------------------------
# open_catch_up: a delta, or None for a full snapshot


def request(h: History, seq: int) -> SinceRequest:
    held = h.entry(seq)
    assert held is not None
    return SinceRequest(seq, update_digest(held[0]))


@pytest.mark.parametrize("since", [5, 6, 9, 10])
def test_covered_and_matching_gets_a_delta(since: int) -> None:
    h = history(1, 10, max_updates=6)  # holds 5..10
    applied = encode_kvapplied(10, [], span=0.0)
    stream = open_catch_up(h, request(h, since), ID, 10, applied)
    assert stream is not None
    out = drain(stream)
    held = [list(frames) for frames in h.since(since)]  # the history holds tuples
    assert out == [*applied, encode_kvdelta(since), *held, encode_kthxbai(10, "")]
    assert stream.sent == 10 - since


def test_digest_mismatch_gets_a_snapshot() -> None:
    h = history(1, 10)
    diverged = upd(7, b"written by another active")
    assert open_catch_up(h, SinceRequest(7, update_digest(diverged)), ID, 10) is None


def test_not_covered_gets_a_snapshot() -> None:
    h = history(1, 10, max_updates=6)  # holds 5..10: 4 is the base, no entry to compare
    assert open_catch_up(h, SinceRequest(3, bytes(8)), ID, 10) is None
    assert open_catch_up(h, SinceRequest(4, update_digest(upd(4))), ID, 10) is None


def test_since_zero_gets_a_snapshot() -> None:
    h = History(10, 1000)
    assert open_catch_up(h, SinceRequest(0, bytes(8)), ID, 0) is None


def test_since_beyond_our_last_gets_a_snapshot() -> None:
    h = history(1, 10)
    assert open_catch_up(h, SinceRequest(11, update_digest(upd(11))), ID, 10) is None
    assert open_catch_up(h, SinceRequest(50, bytes(8)), ID, 10) is None


def test_a_history_behind_the_store_gets_a_snapshot() -> None:
    h = history(1, 10)  # the store is at 12: updates 11 and 12 are not held
    assert open_catch_up(h, request(h, 8), ID, 12) is None


def test_an_empty_history_after_reset_gets_a_snapshot() -> None:
    h = History(10, 1000)
    h.reset(10)
    assert open_catch_up(h, SinceRequest(10, bytes(8)), ID, 10) is None


def test_a_subtree_request_gets_a_snapshot() -> None:
    h = history(1, 10)
    assert open_catch_up(h, request(h, 8), ID, 10, subtree="/k/") is None
