"""HistoryReplay, the sans-IO rules of changes(since=N): frames in, changes out."""

from __future__ import annotations

import pytest

from clone.client.history import HistoryReplay, ReplayRestart
from clone.errors import HistoryCompacted, ProtocolError
from clone.wire.codec import encode_hugz, encode_kthxbai
from clone.wire.control import encode_view_heartbeat
from clone.wire.delta import encode_kvdelta


def upd(seq: int, key: str = "/k") -> list[bytes]:
    return [key.encode(), seq.to_bytes(8, "big"), bytes(16), b"", b"v"]


def _seqs(entries: list) -> list[int]:  # type: ignore[type-arg]
    return [e.sequence for e in entries]


def test_delta_then_buffered_then_live_without_duplicates() -> None:
    r = HistoryReplay(2)
    assert r.update(upd(5)) == []  # live while the delta streams: buffered
    assert r.reply(encode_kvdelta(2)) == []
    assert _seqs(r.reply(upd(3)) + r.reply(upd(4))) == [3, 4]
    assert r.update(upd(6)) == []  # still buffered until KTHXBAI
    assert _seqs(r.reply(encode_kthxbai(5))) == [6]  # 5 was in the delta's range: dropped
    assert r.update(upd(6)) == []  # a duplicate
    assert _seqs(r.update(upd(7))) == [7]
    assert r.update(encode_hugz(7)) == []
    assert r.last == 7


def test_a_hole_restarts_from_the_last_sequence_handed_out() -> None:
    r = HistoryReplay(0)
    r.reply(encode_kvdelta(0))
    r.reply(upd(1))
    r.reply(encode_kthxbai(1))
    with pytest.raises(ReplayRestart):
        r.update(upd(3))
    assert r.last == 1
    with pytest.raises(ReplayRestart):
        r.update(encode_hugz(2))


def test_compacted_reply_raises_with_the_oldest() -> None:
    r = HistoryReplay(3, requested=1)
    with pytest.raises(HistoryCompacted) as caught:
        r.reply(encode_kvdelta(3, compacted=9))
    assert (caught.value.requested, caught.value.oldest) == (1, 9)


@pytest.mark.parametrize(
    "first", [upd(1), encode_kthxbai(4), encode_kvdelta(7)], ids=["snapshot", "empty", "wrong"]
)
def test_anything_but_our_kvdelta_first_is_a_protocol_error(first: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        HistoryReplay(3).reply(first)


def test_a_filtered_delta_skips_sequences_and_prefixes_filter_the_changes() -> None:
    r = HistoryReplay(0, ("/a/",))
    r.reply(encode_kvdelta(0))
    assert _seqs(r.reply(upd(2, "/a/x"))) == [2]
    assert r.reply(upd(3, "/b/x")) == []
    r.reply(encode_kthxbai(5, "/a/"))
    assert r.last == 5
    assert r.update(upd(6, "/b/y")) == [] and r.last == 6


def test_restricted_reader_checks_the_view_count_instead_of_plus_one() -> None:
    view = "0123456789ab"
    r = HistoryReplay(0)
    r.reply(encode_kvdelta(0))
    r.reply(encode_kthxbai(10, "", (("view", view), ("view_count", "4"))))
    assert _seqs(r.update(upd(13))) == [13]  # a hole by design
    r.update(encode_view_heartbeat(view, 13, 100, 5))
    with pytest.raises(ReplayRestart):
        r.update(encode_view_heartbeat(view, 20, 100, 7))
    with pytest.raises(ReplayRestart):
        r.update(encode_view_heartbeat("ba9876543210", 20, 100, 5))
