"""The snapshot port's parts alone (clone.server.serving, streaming, voting):
a real ROUTER and DEALERs on loopback, a standalone core, the server's loop
run by the test until a condition holds, and plain callbacks in place of the
caller, the conflicts desk, the monitor and the role switch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from tornado.ioloop import IOLoop

from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.config import ServerConfig
from clone.server.core import ServerCore
from clone.server.healing import Healer
from clone.server.metrics import DurationHistogram
from clone.server.serving import SnapshotPort
from clone.server.shared import Shared
from clone.server.status import StatusLimiter
from clone.server.streaming import SnapshotStreams
from clone.server.voting import HeldVotes
from clone.wire.calls import CALL
from clone.wire.conflicts import CONFLICTS_REQUEST
from clone.wire.frames import recv_zero_copy
from clone.wire.protocol import ICANHAZ, KTHXBAI, REQUESTER_PROPERTY, STATUS_REQUEST
from clone.wire.requester import new_requester_id, requester_metadata
from tests.support.ports import free_base_port

KEYS = 2000


class _Rig:
    def __init__(self, ctx: zmq.Context[Any], *, max_snapshots: int = 4,
                 value: bytes = b"v") -> None:  # fmt: skip
        self.ctx = ctx
        self.port = free_base_port()
        self.config = ServerConfig(port=self.port, max_snapshots=max_snapshots, snapshot_chunk=10)
        self.core = ServerCore(self.config.core, standalone=True)
        self.core.become_active(0.0)
        for n in range(KEYS):
            frames = [b"/k/%d" % n, bytes(8), (n + 1).to_bytes(16, "big"), b"", value]
            self.core.on_kvset(frames, 0.0, 0.0)
        self.core.journal.take()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "snapshots_served", "snapshots_aborted", "snapshots_refused",
                "snapshots_held_heal", "snapshot_stalls", "snapshot_unroutable_retries",
                "snapshots_idle_aborted", "snapshots_evicted", "snapshots_yielded",
                "snapshot_turns_paced", "snapshots_replaced",
                "snapshot_requester_invalid",
                "snapshots_queued", "snapshot_entries_sent", "snapshots_batched",
                "snapshot_batches_sent", "internal_errors", "catchups_served",
                "client_catchups_served", "status_requests", "status_dropped",
                "votes_deferred", "votes_deferred_served", "votes_deferred_expired",
                "votes_deferred_overflow", "votes_deferred_gone", "failovers",
                "snapshots_shared", "snapshot_encodings_shared", "snapshot_shares_over_budget",
            ),
            0,
        )  # fmt: skip
        self.shared = Shared(
            Throttle(logging.getLogger("test.snapshot_port"), time.monotonic),
            counters=self.counters,
        )
        self.loop = IOLoop(make_current=False)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind(f"tcp://127.0.0.1:{self.port}")
        self.calls: list[bytes] = []
        self.conflicts: list[bytes] = []
        self.promotions = 0
        self.durations = DurationHistogram()
        self.healer = Healer(
            self.config,
            self.core,
            self.shared,
            _NoSockets(),
            next_turn=self._next_turn,
            followed=lambda: None,
            commit_and_publish=lambda: None,
            publish=lambda frames: None,
            won_split=lambda: True,
            serve=lambda identity, subtree, options: self.streams.serve(
                identity, subtree, **options
            ),
            stopping=lambda: False,
        )
        self.streams = SnapshotStreams(
            self.config,
            self.core,
            self.shared,
            Access(),
            self.router,
            self.loop,
            secure=False,
            backlog=lambda: self.part.take_backlog(),
            promote=self._promote,
            peer_sync_opened=self.healer.peer_sync_served,
            peer_sync_done=self.healer.peer_sync_done,
            view_count=lambda vid: 0,
            durations=self.durations,
            stopping=lambda: False,
        )
        self.votes = HeldVotes(
            self.config, self.shared, self.loop, ha=lambda: None, serve=self.streams.serve,
            stopping=lambda: False,
        )  # fmt: skip
        self.part = SnapshotPort(
            self.core,
            self.shared,
            Access(),
            self.router,
            self.loop,
            secure=False,
            healer=self.healer,
            votes=self.votes,
            serve=self.streams.serve,
            on_call=lambda identity, parts: self.calls.append(parts[1].bytes),
            on_conflicts=lambda identity, parts: self.conflicts.append(parts[1].bytes),
            status=lambda: {"role": "active"},
            status_limiter=StatusLimiter(20.0, 40, time.monotonic()),
            ha=lambda: None,
        )

    def _next_turn(self, callback: Callable[[], None]) -> bool:
        self.loop.add_callback(callback)
        return True

    def _promote(self) -> None:
        self.promotions += 1

    def dealer(self, *metadata: bytes, source: str = "", reads: bool = True) -> zmq.Socket[Any]:
        """A requester (from the address ``source``, the system's choice if
        empty); one that does not read holds 1 message and a 4 KB buffer."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        for prop in metadata:
            sock.setsockopt(zmq.METADATA, prop)
        if not reads:
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
        via = f"{source}:0;" if source else ""
        sock.connect(f"tcp://{via}127.0.0.1:{self.port}")
        return sock

    def read(self) -> None:
        """What the ROUTER's stream does: the next request to the reader."""
        assert self.router.poll(10_000), "no request arrived"
        self.part.on_router(recv_zero_copy(self.router))

    def run_until(self, done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        """Run the loop (the pump's turns, its retries) until ``done``."""

        async def wait() -> None:
            deadline = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.005)

        self.loop.run_sync(wait)

    def close(self) -> None:
        self.votes.close()
        self.streams.close()
        self.part.close()
        self.router.close(0)
        self.loop.close(all_fds=False)


class _NoSockets:
    def socket(self, kind: int) -> zmq.Socket[Any]:
        raise AssertionError("no socket expected")

    def stream(self, sock: zmq.Socket[Any], handler: Callable[[list[bytes]], None]) -> Any:
        raise AssertionError("no stream expected")

    def forget(self, stream: Any) -> None:
        raise AssertionError("no stream expected")


@pytest.fixture
def rig(ctx: zmq.Context[Any]) -> Iterator[_Rig]:
    rig = _Rig(ctx)
    try:
        yield rig
    finally:
        rig.close()


def _snapshot(rig: _Rig, dealer: zmq.Socket[Any]) -> list[list[bytes]]:
    """Read a whole snapshot (KVSYNCs, then KTHXBAI) while the loop pumps it."""
    got: list[list[bytes]] = []

    def done() -> bool:
        while dealer.poll(0):
            got.append(dealer.recv_multipart())
        return bool(got) and got[-1][0] == KTHXBAI

    rig.run_until(done, "the whole snapshot")
    return got


def test_a_request_is_streamed_in_chunks_then_counted(rig: _Rig) -> None:
    dealer = rig.dealer()
    dealer.send_multipart([ICANHAZ, b""])
    rig.read()
    got = _snapshot(rig, dealer)
    assert sorted(m[0] for m in got[:-1]) == sorted(b"/k/%d" % n for n in range(KEYS))
    assert int.from_bytes(got[-1][1], "big") == KEYS  # KTHXBAI says the sequence
    rig.run_until(lambda: rig.counters["snapshots_served"] == 1, "the stream counted")
    assert rig.counters["snapshot_entries_sent"] == KEYS
    assert rig.durations.count == 1 and len(rig.streams) == 0
    dealer.close(0)


def test_status_calls_and_conflicts_go_where_they_belong(rig: _Rig) -> None:
    dealer = rig.dealer()
    dealer.send_multipart([STATUS_REQUEST])
    rig.read()
    assert dealer.poll(10_000) and rig.counters["status_requests"] == 1
    dealer.recv_multipart()
    dealer.send_multipart([CALL, b"x"])
    rig.read()
    dealer.send_multipart([CONFLICTS_REQUEST, b"y"])
    rig.read()
    assert rig.calls == [CALL] and rig.conflicts == [CONFLICTS_REQUEST]
    assert len(rig.streams) == 0  # none of them is a snapshot
    dealer.close(0)


def test_a_request_waits_for_a_slot_and_is_served_when_one_frees(
    ctx: zmq.Context[Any],
) -> None:
    rig = _Rig(ctx, max_snapshots=1)
    try:
        first, second = rig.dealer(), rig.dealer()
        first.send_multipart([ICANHAZ, b""])
        rig.read()
        second.send_multipart([ICANHAZ, b""])
        rig.read()
        # The first requester reads (it is no idle slot holder): the second waits.
        assert _snapshot(rig, first)[-1][0] == KTHXBAI
        assert _snapshot(rig, second)[-1][0] == KTHXBAI
        assert rig.counters["snapshots_queued"] >= 1
        rig.run_until(lambda: rig.counters["snapshots_served"] == 2, "both counted")
        assert rig.counters["snapshots_refused"] == 0
        first.close(0)
        second.close(0)
    finally:
        rig.close()


def test_a_client_request_waits_while_a_split_brain_heals(rig: _Rig) -> None:
    rig.healer.on_split_brain()  # won: client snapshots wait for the heal
    dealer = rig.dealer()
    dealer.send_multipart([ICANHAZ, b"/a/"])
    rig.read()
    assert rig.counters["snapshots_held_heal"] == 1 and len(rig.streams) == 0
    rig.healer.check()
    assert len(rig.streams) == 0  # still healing
    dealer.close(0)


def test_requests_hidden_by_the_pumps_sends_are_read_by_its_backlog_look(rig: _Rig) -> None:
    """The pump sends from loop callbacks, which can consume the edge that
    would wake the ROUTER's stream: its burst reads the backlog itself, so
    requests that came meanwhile are served without the stream waking."""
    dealers = [rig.dealer() for _ in range(3)]
    for dealer in dealers:
        dealer.send_multipart([ICANHAZ, b""])
    rig.read()  # the stream's one wake-up; the first stream's turns look for the rest
    for dealer in dealers:
        assert _snapshot(rig, dealer)[-1][0] == KTHXBAI
        dealer.close(0)
    rig.run_until(lambda: rig.counters["snapshots_served"] == 3, "all three counted")


def test_a_client_asking_again_on_a_fresh_socket_replaces_its_stream_not_a_slot(
    ctx: zmq.Context[Any],
) -> None:
    """A client re-asks on a fresh DEALER, naming itself (X-CHP-Requester): its
    older stream goes and the new one takes the slot, so a second client's
    request is served at once instead of waiting behind a dead stream."""
    rig = _Rig(ctx, max_snapshots=1)
    me = requester_metadata(new_requester_id())
    try:
        old = rig.dealer(me)
        old.send_multipart([ICANHAZ, b""])
        rig.read()
        assert len(rig.streams) == 1
        old.close(0)  # what our agent does before it asks again
        new = rig.dealer(me)
        new.send_multipart([ICANHAZ, b""])
        rig.read()
        assert rig.counters["snapshots_replaced"] == 1 and len(rig.streams) == 1
        assert rig.counters["snapshots_queued"] == 0  # it did not wait for a slot
        assert _snapshot(rig, new)[-1][0] == KTHXBAI
        rig.run_until(lambda: rig.counters["snapshots_served"] == 1, "the new stream counted")
        # Waiting for a slot, too: a second request of another client waits,
        # and its own re-ask replaces it there (one waiting request each).
        other = requester_metadata(new_requester_id())
        busy, first, second = rig.dealer(me), rig.dealer(other), rig.dealer(other)
        busy.send_multipart([ICANHAZ, b""])
        rig.read()
        first.send_multipart([ICANHAZ, b""])
        rig.read()
        first.close(0)
        second.send_multipart([ICANHAZ, b""])
        rig.read()
        assert rig.counters["snapshots_queued"] == 2 and rig.counters["snapshots_replaced"] == 2
        assert _snapshot(rig, busy)[-1][0] == KTHXBAI
        assert _snapshot(rig, second)[-1][0] == KTHXBAI
        rig.run_until(lambda: rig.counters["snapshots_served"] == 3, "all counted")
        assert rig.counters["snapshots_refused"] == 0
        for sock in (new, busy, second):
            sock.close(0)
    finally:
        rig.close()


def test_a_bad_requester_id_is_counted_and_the_request_served_as_anyones(rig: _Rig) -> None:
    dealer = rig.dealer(f"{REQUESTER_PROPERTY}:not-hex".encode())
    dealer.send_multipart([ICANHAZ, b""])
    rig.read()
    assert rig.counters["snapshot_requester_invalid"] == 1
    assert _snapshot(rig, dealer)[-1][0] == KTHXBAI
    dealer.close(0)


def test_a_client_held_through_a_heal_keeps_only_its_newest_request(rig: _Rig) -> None:
    rig.healer.on_split_brain()
    me = requester_metadata(new_requester_id())
    socks = [rig.dealer(me) for _ in range(3)]
    for sock in socks:
        sock.send_multipart([ICANHAZ, b""])
        rig.read()
    assert rig.counters["snapshots_held_heal"] == 3
    held = list(rig.healer._heal_requests)
    assert len(held) == 1 and held[0][2]["requester"] is not None
    for sock in socks:
        sock.close(0)


def test_a_host_holding_every_slot_gives_one_to_another_hosts_request(
    ctx: zmq.Context[Any],
) -> None:
    """Four requesters from 127.0.0.2 that never read take every slot, and
    look like readers (their streams wait for the pump, not for them): a
    request from 127.0.0.1 takes one of theirs at once, and gets its whole
    snapshot; another from 127.0.0.2 waits (its host holds the most)."""
    rig = _Rig(ctx, max_snapshots=4, value=bytes(4096))  # 8 MB: more than the kernel takes
    try:
        flood = [rig.dealer(source="127.0.0.2", reads=False) for _ in range(4)]
        for sock in flood:
            sock.send_multipart([ICANHAZ, b""])
            rig.read()
        assert len(rig.streams) == 4
        healthy = rig.dealer(source="127.0.0.1")
        healthy.send_multipart([ICANHAZ, b""])
        rig.read()
        assert rig.counters["snapshots_yielded"] == 1 and rig.counters["snapshots_queued"] == 0
        assert len(rig.streams) == 4 and rig.counters["snapshots_aborted"] == 1
        more = rig.dealer(source="127.0.0.2", reads=False)
        more.send_multipart([ICANHAZ, b""])
        rig.read()
        assert rig.counters["snapshots_yielded"] == 1 and rig.counters["snapshots_queued"] == 1
        got = _snapshot(rig, healthy)
        assert len(got) == KEYS + 1 and got[-1][0] == KTHXBAI
        for sock in (*flood, more, healthy):
            sock.close(0)
    finally:
        rig.close()


def test_on_one_host_a_request_still_waits_for_a_slot(ctx: zmq.Context[Any]) -> None:
    """Every requester on one host (a test, a fleet behind one address): the
    slots are taken as before, no host gives one up."""
    rig = _Rig(ctx, max_snapshots=2, value=bytes(4096))
    try:
        flood = [rig.dealer(source="127.0.0.2", reads=False) for _ in range(2)]
        for sock in flood:
            sock.send_multipart([ICANHAZ, b""])
            rig.read()
        same = rig.dealer(source="127.0.0.2")
        same.send_multipart([ICANHAZ, b""])
        rig.read()
        assert rig.counters["snapshots_yielded"] == 0 and rig.counters["snapshots_queued"] == 1
        assert len(rig.streams) == 2
        for sock in (*flood, same):
            sock.close(0)
    finally:
        rig.close()


@pytest.mark.slow  # the paused requester reads 8 MB a message a turn: about 20 s
def test_a_flooders_request_does_not_take_an_idle_slot_from_a_host_holding_fewer(
    ctx: zmq.Context[Any],
) -> None:
    """A client on 127.0.0.1 that has read nothing for a while (starved of
    CPU, say) holds the stalest stream; a request from 127.0.0.2, whose host
    holds the other three slots, evicts one of its own host's instead."""
    rig = _Rig(ctx, max_snapshots=4, value=bytes(4096))
    try:
        paused = rig.dealer(source="127.0.0.1", reads=False)
        paused.send_multipart([ICANHAZ, b""])
        rig.read()
        started = time.monotonic()
        rig.run_until(lambda: time.monotonic() > started + 0.5, "its stream idle")
        flood = [rig.dealer(source="127.0.0.2", reads=False) for _ in range(4)]
        for sock in flood[:3]:
            sock.send_multipart([ICANHAZ, b""])
            rig.read()
        started = time.monotonic()
        rig.run_until(lambda: time.monotonic() > started + 1.0, "their streams idle too")
        flood[3].send_multipart([ICANHAZ, b""])
        rig.read()
        # One of theirs gave its slot up, or (every one of theirs waiting for a
        # pump turn, so not idle) the request waits; the paused one keeps its.
        c = rig.counters
        assert c["snapshots_evicted"] + c["snapshots_queued"] == 1 and c["snapshots_yielded"] == 0
        got = _snapshot(rig, paused)  # it reads again: its stream was kept
        assert len(got) == KEYS + 1 and got[-1][0] == KTHXBAI
        for sock in (*flood, paused):
            sock.close(0)
    finally:
        rig.close()
