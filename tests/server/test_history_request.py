"""A client's history request (X-CHP-Since without a digest), decided by the
server core with explicit times and no sockets: the updates after a sequence,
filtered by subtree and read prefixes, or a compacted reply; never a snapshot."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from clone.server.core import CoreSettings, ServerCore
from clone.server.delta import DeltaStream
from clone.wire.codec import SnapshotEnd, decode_snapshot_reply
from clone.wire.delta import DeltaHead, SinceRequest, decode_kvdelta_head, update_digest
from tests.support.published import kvset


def _kvset(key: str, n: int, body: bytes = b"v") -> list[bytes]:
    return [key.encode(), bytes(8), n.to_bytes(16, "big"), b"", body]


def _active(keys: Sequence[str], history_max: int = 100) -> tuple[ServerCore, list[list[bytes]]]:
    core = ServerCore(CoreSettings(history_max=history_max), standalone=True)
    pubs = []
    for n, key in enumerate(keys, 1):
        pub = kvset(core, _kvset(key, n, body=b"" if key.endswith("!") else b"v"), float(n))
        assert pub is not None
        pubs.append(pub)
    return core, pubs


def _drain(stream: DeltaStream) -> list[list[bytes]]:
    out = []
    while not stream.done:
        frames = stream.peek()
        assert frames is not None
        assert frames[0] == b"client"
        out.append(list(frames[1:]))
        stream.advance()
    return out


def _ask(core: ServerCore, since: int, subtree: str = "", **kw: object) -> list[list[bytes]]:
    stream = core.open_snapshot(b"client", subtree, now=100.0, since=SinceRequest(since), **kw)  # type: ignore[arg-type]
    assert isinstance(stream, DeltaStream)  # never a snapshot
    return _drain(stream)


def _seqs(frames: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(f[1], "big") for f in frames]


def _end(frames: list[bytes]) -> SnapshotEnd:
    end = decode_snapshot_reply(frames)
    assert isinstance(end, SnapshotEnd)
    return end


@pytest.mark.parametrize("since", [0, 1, 20, 49, 50])
def test_covered_request_replays_every_update_after_it(since: int) -> None:
    core, pubs = _active([f"/k{i % 7}" for i in range(50)])
    head, *updates, end = _ask(core, since)
    assert decode_kvdelta_head(head).from_sequence == since
    assert decode_kvdelta_head(head).compacted is None
    assert updates == pubs[since:]  # the KVPUBs as published, byte for byte
    assert _end(end) == SnapshotEnd(50, "")


def test_deletes_are_replayed_in_order() -> None:
    core, _ = _active(["/a", "/a!", "/a"])
    _, *updates, _ = _ask(core, 0)
    assert [u[4] for u in updates] == [b"v", b"", b"v"]


def test_compacted_history_says_the_oldest_sequence_held() -> None:
    core, _ = _active([f"/k{i}" for i in range(50)], history_max=10)
    out = _ask(core, 20)
    assert len(out) == 2  # KVDELTA, then KTHXBAI directly
    assert decode_kvdelta_head(out[0]).compacted == 41
    assert decode_kvdelta_head(out[0]).from_sequence == 20
    assert _end(out[1]).sequence == 50
    # The oldest held is servable: since = oldest - 1.
    _, *updates, _ = _ask(core, 40)
    assert _seqs(updates) == list(range(41, 51))


def test_an_empty_history_after_a_reset_is_compacted_from_the_next_update() -> None:
    core, _ = _active(["/a", "/b"])
    core.history.reset(core.store.sequence)
    out = _ask(core, 1)
    assert decode_kvdelta_head(out[0]).compacted == 3


def test_a_request_at_or_beyond_the_store_is_an_empty_delta() -> None:
    core, _ = _active(["/a", "/b"])
    for since in (2, 9):
        head, end = _ask(core, since)
        assert decode_kvdelta_head(head) == DeltaHead(since, None)
        assert _end(end).sequence == 2


def test_a_subtree_request_gets_only_its_updates_and_names_the_subtree() -> None:
    core, _ = _active(["/a/1", "/b/1", "/a/2", "/b/2", "/a/3"])
    _, *updates, end = _ask(core, 1, "/a/")
    assert _seqs(updates) == [3, 5]
    assert _end(end) == SnapshotEnd(5, "/a/")


def test_read_prefixes_filter_the_delta_and_the_view_rides_on_kthxbai() -> None:
    core, _ = _active(["/pub/1", "/secret/1", "/pub/2", "/other/1"])
    view = (("view", "0123456789ab"), ("view_count", "2"))
    _, *updates, end = _ask(core, 0, allowed=(b"/pub/",), end_properties=view)
    assert [u[0] for u in updates] == [b"/pub/1", b"/pub/2"]
    assert _end(end).properties == view
    # No read right under the subtree asked for: nothing, but still a delta.
    _, end = _ask(core, 0, "/secret/", allowed=(b"/pub/",))
    assert _end(end).subtree == "/secret/"


def test_a_digest_request_is_still_a_catch_up_or_a_snapshot() -> None:
    core, pubs = _active(["/a", "/b", "/c"])
    good = SinceRequest(1, update_digest(pubs[0]))
    assert isinstance(core.open_snapshot(b"peer", "", since=good), DeltaStream)
    bad = SinceRequest(1, bytes(8))
    assert not isinstance(core.open_snapshot(b"peer", "", since=bad), DeltaStream)
    # Never for a restricted requester, even with the right digest.
    assert not isinstance(
        core.open_snapshot(b"peer", "", since=good, allowed=(b"/a",)), DeltaStream
    )
