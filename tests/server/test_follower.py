"""The follower part (clone.server.following.Follower) driven alone: a fake
active server on loopback (a ROUTER as its snapshot port, a PUB as its
publisher), a real passive ServerCore, a fake clock, and the callbacks
recorded.  The streams sit on an IOLoop that never runs: the test reads each
socket and hands the message to the part, as the stream would."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from clone.ratelimit import Throttle
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import Role, ServerCore, SyncState
from clone.server.following import Follower
from clone.server.shared import Shared
from clone.wire.codec import KVMsg, encode_hugz, encode_kthxbai, encode_kv
from clone.wire.protocol import ICANHAZ
from tests.support.ports import free_base_port


class _Sockets:
    """The server's Sockets: plain sockets, streams on a loop that never runs."""

    def __init__(self, ctx: zmq.Context[Any], loop: IOLoop) -> None:
        self.ctx, self.loop = ctx, loop
        self.opened: list[zmq.Socket[Any]] = []
        self.handlers: dict[int, Callable[[list[bytes]], None]] = {}

    def socket(self, kind: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.opened.append(sock)
        return sock

    def stream(self, sock: zmq.Socket[Any], handler: Callable[[list[bytes]], None]) -> ZMQStream:
        self.handlers[int(sock.type)] = handler
        return ZMQStream(sock, self.loop)

    def forget(self, stream: ZMQStream) -> None:
        stream.close(linger=0)

    def live(self, kind: int) -> zmq.Socket[Any]:
        (sock,) = [s for s in self.opened if s.type == kind and not s.closed]
        return sock


class _Active:
    """The fake active: its snapshot ROUTER (P) and its PUB (P+1)."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.port = free_base_port()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{self.port}")
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port + 1}")

    def request(self) -> bytes:
        """The next ICANHAZ? a follower sent: its DEALER's identity."""
        assert self.router.poll(10_000), "no snapshot request"
        identity, *frames = self.router.recv_multipart()
        assert frames[0] == ICANHAZ
        return bytes(identity)

    def close(self) -> None:
        self.router.close(0)
        self.pub.close(0)


class _Rig:
    def __init__(self, ctx: zmq.Context[Any], active: _Active) -> None:
        self.active = active
        self.now = 100.0
        self.loop = IOLoop(make_current=False)
        self.sockets = _Sockets(ctx, self.loop)
        self.shared = Shared(
            Throttle(logging.getLogger("test.follower"), lambda: self.now),
            clock=lambda: self.now,
            wallclock=lambda: 1.7e9 + self.now,
            counters={"sync_timeouts": 0},
        )
        self.core = ServerCore()
        self.core.become_passive()
        self.turns_ended = 0
        self.synced = 0
        self.later: list[Callable[[], None]] = []
        cfg = ServerConfig(
            port=free_base_port(), mode=ServerMode.BACKUP, peer=f"127.0.0.1:{active.port}",
            ha_port=1, peer_ha="127.0.0.1:2", sync_timeout=3.0,
        )  # fmt: skip
        self.part = Follower(
            cfg,
            self.core,
            self.shared,
            self.sockets,
            followed=lambda: cfg.peer,
            term=lambda: None,
            after_turn=self._end_turn,
            next_turn=self._next_turn,
            fork_known=lambda: None,
            synced=self._synced,
            resyncing=self._resyncing,
            heard_hugz=self._heard_hugz,
        )
        self.resyncs = 0
        self.hugz_turns = 0

    def _heard_hugz(self) -> None:
        self.hugz_turns += 1

    def _resyncing(self) -> None:
        self.resyncs += 1

    def _end_turn(self) -> None:
        self.turns_ended += 1
        self.core.journal.take()  # the commit

    def _synced(self) -> None:
        self.synced += 1

    def _next_turn(self, callback: Callable[[], None]) -> bool:
        self.later.append(callback)
        return True

    def deliver(self, kind: int) -> None:
        """What the stream of ``kind`` would do: read a message, hand it over."""
        sock = self.sockets.live(kind)
        assert sock.poll(10_000), "nothing arrived"
        self.sockets.handlers[kind](sock.recv_multipart())

    def close(self) -> None:
        self.part.close()
        for sock in self.sockets.opened:
            sock.close(0)
        self.loop.close(all_fds=False)


@pytest.fixture
def rig(ctx: zmq.Context[Any]) -> Iterator[_Rig]:
    active = _Active(ctx)
    rig = _Rig(ctx, active)
    try:
        yield rig
    finally:
        rig.close()
        active.close()


def _kv(key: str, sequence: int) -> list[bytes]:
    return encode_kv(KVMsg(key, sequence, bytes(16), (), b"v"))


def _sync(rig: _Rig, sequence: int) -> None:
    """Answer the follower's request with one entry and KTHXBAI."""
    identity = rig.active.request()
    rig.active.router.send_multipart([identity, *_kv("/a", sequence)])
    rig.active.router.send_multipart([identity, *encode_kthxbai(sequence)])
    for _ in range(2):
        if rig.core.sync_state is SyncState.SYNCED:
            break
        rig.deliver(zmq.DEALER)



def _joined(rig: _Rig, sub: zmq.Socket[Any], handle: bool = False) -> None:
    """Until the SUB has joined the fake active's publisher (a HUGZ at 5 got
    through), then read what came: handed to the part if ``handle``."""
    deadline = time.monotonic() + 30
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the SUB never joined the publisher"
        rig.active.pub.send_multipart(encode_hugz(5))
    while sub.poll(50):
        frames = sub.recv_multipart()
        if handle:
            rig.sockets.handlers[zmq.SUB](frames)

def test_it_syncs_then_follows_the_publisher_in_order(rig: _Rig) -> None:
    rig.part.follow()
    _sync(rig, 5)
    assert rig.core.sync_state is SyncState.SYNCED and rig.core.store.sequence == 5
    assert rig.synced == 1 and rig.turns_ended >= 1
    # The sync's DEALER is closed on the next turn, not from inside its own callback.
    assert len(rig.later) == 1
    rig.later.pop()()
    assert not [s for s in rig.sockets.opened if s.type == zmq.DEALER and not s.closed]
    # The publisher's stream: the SUB joins once a HUGZ gets through.
    sub = rig.sockets.live(zmq.SUB)
    _joined(rig, sub, handle=True)
    rig.active.pub.send_multipart(_kv("/b", 6))
    rig.deliver(zmq.SUB)
    assert rig.core.store.sequence == 6 and rig.core.role is Role.PASSIVE


def test_a_gap_asks_again_on_a_fresh_dealer(rig: _Rig) -> None:
    rig.part.follow()
    _sync(rig, 5)
    first = rig.sockets.live(zmq.SUB)
    _joined(rig, first)
    rig.active.pub.send_multipart(_kv("/c", 9))  # 6..8 missed
    assert rig.resyncs == 0
    rig.deliver(zmq.SUB)
    assert rig.core.sync_state is SyncState.SYNCING
    # Told before it asks: the role switch refuses votes until the resync is done.
    assert rig.resyncs == 1 and rig.synced == 1
    rig.active.request()  # asked again
    assert rig.core.store.sequence == 5


def test_a_sync_that_does_not_move_is_asked_again_after_the_timeout(rig: _Rig) -> None:
    rig.part.follow()
    rig.active.request()  # and never answered
    rig.now += 2.9
    rig.part.check_timeout()
    assert rig.shared.counters["sync_timeouts"] == 0
    rig.now += 0.2
    rig.part.check_timeout()
    assert rig.shared.counters["sync_timeouts"] == 1
    rig.active.request()  # a fresh request, on a fresh DEALER
    assert len([s for s in rig.sockets.opened if s.type == zmq.DEALER and not s.closed]) == 1


def test_before_a_promotion_it_takes_what_the_old_active_already_sent(rig: _Rig) -> None:
    rig.part.follow()
    _sync(rig, 5)
    sub = rig.sockets.live(zmq.SUB)
    _joined(rig, sub)
    for seq in (6, 7, 8):
        rig.active.pub.send_multipart(_kv(f"/k{seq}", seq))
    deadline = time.monotonic() + 30
    while not sub.poll(20):
        assert time.monotonic() < deadline
    time_left = time.monotonic() + 30
    taken = 0
    while rig.core.store.sequence < 8 and time.monotonic() < time_left:
        taken += rig.part.take_backlog()
        sub.poll(20)
    assert rig.core.store.sequence == 8 and taken == 3
    rig.part.close()
    assert rig.part.take_backlog() == 0  # nothing to take once closed


def test_a_turn_that_reads_a_hugz_ends_by_saying_so(rig: _Rig) -> None:
    # The passive then announces its sequence on the pair's link at once, so
    # that an active handing over at its stop hears it in a round trip
    # (clone.server.handover); updates alone announce nothing.
    rig.part.follow()
    _sync(rig, 5)
    sub = rig.sockets.live(zmq.SUB)
    _joined(rig, sub)
    rig.active.pub.send_multipart(_kv("/d", 6))
    rig.deliver(zmq.SUB)
    assert rig.core.store.sequence == 6 and rig.hugz_turns == 0
    rig.active.pub.send_multipart(encode_hugz(6))
    rig.deliver(zmq.SUB)
    assert rig.hugz_turns == 1
