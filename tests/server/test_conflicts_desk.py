"""The conflicts desk (clone.server.admin.ConflictsDesk) driven alone: a real
ROUTER and DEALER on loopback, a ServerCore whose conflict book holds two
records, the STATUS? bucket with a fake clock."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.admin import ConflictsDesk
from clone.server.conflicts import ConflictRecord
from clone.server.core import ServerCore
from clone.server.shared import Shared
from clone.server.status import StatusLimiter
from clone.wire.conflicts import decode_conflicts, encode_conflicts_request


def _record(cid: int, key: bytes) -> ConflictRecord:
    return ConflictRecord(
        id=cid, key=key, reason="changed", loser_uuid=bytes(16), loser_props=b"",
        loser_body=b"v", loser_at=1.0, loser_term=1, winner_seq=3, winner_uuid=None,
        winner_props=None, winner_body=None, winner_at=None, recorded=2.0,
    )  # fmt: skip


class _Rig:
    def __init__(self, router: zmq.Socket[Any], dealer: zmq.Socket[Any]) -> None:
        self.router, self.dealer = router, dealer
        self.now = 10.0
        self.shared = Shared(
            Throttle(logging.getLogger("test.desk"), lambda: self.now),
            clock=lambda: self.now,
            counters={"conflicts_requests": 0, "conflicts_dropped": 0},
        )
        self.core = ServerCore(standalone=True)
        self.core.conflicts.record(_record(1, b"/a"))
        self.core.conflicts.record(_record(2, b"/b"))
        self.core.conflicts.resolve(2, "discarded")
        self.part = ConflictsDesk(
            self.core, self.shared, Access(), router, StatusLimiter(1.0, 2, self.now)
        )

    def ask(self, frames: list[bytes]) -> dict[str, Any] | None:
        self.dealer.send_multipart(frames)
        assert self.router.poll(10_000)
        parts = self.router.recv_multipart(copy=False)
        self.part.on_request(parts[0].bytes, parts)
        if not self.dealer.poll(300):
            return None
        return decode_conflicts(self.dealer.recv_multipart())


@pytest.fixture
def rig(ctx: zmq.Context[Any]) -> Iterator[_Rig]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield _Rig(router, dealer)
    finally:
        dealer.close(0)
        router.close(0)


def test_it_lists_the_unresolved_or_everything(rig: _Rig) -> None:
    some = rig.ask(encode_conflicts_request())
    assert some is not None and [r["id"] for r in some["conflicts"]] == [1]
    every = rig.ask(encode_conflicts_request(everything=True))
    assert every is not None and [r["id"] for r in every["conflicts"]] == [1, 2]
    assert rig.shared.counters["conflicts_requests"] == 2


def test_it_shares_the_status_bucket_and_drops_beyond_it(rig: _Rig) -> None:
    assert rig.ask(encode_conflicts_request()) is not None
    assert rig.ask(encode_conflicts_request()) is not None
    assert rig.ask(encode_conflicts_request()) is None  # the burst of 2 is spent
    assert rig.shared.counters["conflicts_dropped"] == 1
    rig.now += 1.0  # one token back
    assert rig.ask(encode_conflicts_request()) is not None


def test_a_malformed_request_is_dropped_and_counted_as_asked(rig: _Rig) -> None:
    assert rig.ask([b"CONFLICTS?", b"what", b"extra"]) is None
    assert rig.shared.counters["conflicts_requests"] == 1
