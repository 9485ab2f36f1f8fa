"""The relay link part (clone.server.relaying.RelayLink) driven alone: a relay
core, a fake clock, the follower's callbacks recorded, sockets on an IOLoop
that never runs (nothing listens upstream: the link's decisions are what is
under test here; tests/server/test_relay_e2e.py runs whole relays)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import ServerCore
from clone.server.forwarding import ANY_WRITER
from clone.server.relaying import RelayLink
from clone.server.shared import Shared
from clone.wire.calls import OP_SET, Reply, encode_call
from clone.wire.codec import encode_hugz
from clone.wire.control import Refusal, decode_control, encode_refusal
from tests.support.ports import free_base_port

UUID = bytes(range(16))


class _Sockets:
    def __init__(self, ctx: zmq.Context[Any], loop: IOLoop) -> None:
        self.ctx, self.loop = ctx, loop
        self.opened: list[zmq.Socket[Any]] = []

    def socket(self, kind: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.opened.append(sock)
        return sock

    def stream(self, sock: zmq.Socket[Any], handler: Callable[[list[bytes]], None]) -> ZMQStream:
        return ZMQStream(sock, self.loop)

    def forget(self, stream: ZMQStream) -> None:
        stream.close(linger=0)

    def live(self, kind: int) -> list[zmq.Socket[Any]]:
        return [s for s in self.opened if s.type == kind and not s.closed]


class _Rig:
    def __init__(self, ctx: zmq.Context[Any], *, named: bool) -> None:
        self.now = 50.0
        self.loop = IOLoop(make_current=False)
        self.sockets = _Sockets(ctx, self.loop)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.config = ServerConfig(
            port=free_base_port(),
            mode=ServerMode.RELAY,
            bind="127.0.0.1",
            upstream=(f"127.0.0.1:{free_base_port()}", f"127.0.0.1:{free_base_port()}"),
            heartbeat=0.1,
            ha_missed=2,
        )
        self.shared = Shared(
            Throttle(logging.getLogger("test.relay_link"), lambda: self.now),
            clock=lambda: self.now,
            counters={
                name: 0
                for name in (
                    "upstream_switches",
                    "upstream_handshake_failures",
                    "kvset_refused_upstream",
                    "calls_forward_not_synced",
                    "calls_forward_refused_acl",
                    "calls_forwarded",
                    "calls_forward_dropped",
                )
            },
        )
        self.core = ServerCore(relay=True)
        self.follows: list[str] = []
        self.closes = 0
        self.replies: list[tuple[bytes, Reply]] = []
        self.published: list[list[bytes]] = []
        self.told: list[tuple[str | None, bytes, str]] = []
        self.views_moved = 0
        self.link = RelayLink(
            self.config,
            self.core,
            self.shared,
            Access(),
            self.sockets,
            router=self.router,
            router_backlog=None,
            upstream_keypair=None,
            follow=self._follow,
            close_follow=self._close,
            sync_progress=lambda: self.now,
            reply=lambda identity, reply: self.replies.append((identity, reply)),
            publish=self.published.append,
            refuse=self._refuse if named else None,
            views_replaced=self._views,
        )

    def _follow(self) -> zmq.Socket[Any] | None:
        self.follows.append(self.link.followed)
        return None  # no fresh SUB to watch: the follower is not under test

    def _close(self) -> None:
        self.closes += 1

    def _refuse(self, name: str | None, uuid: bytes, reason: str) -> None:
        self.told.append((name, uuid, reason))

    def _views(self) -> None:
        self.views_moved += 1

    def close(self) -> None:
        self.link.close()
        for sock in self.sockets.opened:
            sock.close(0)
        self.router.close(0)
        self.loop.close(all_fds=False)


@pytest.fixture
def rig(ctx: zmq.Context[Any]) -> Iterator[_Rig]:
    rig = _Rig(ctx, named=False)
    rig.link.start()
    try:
        yield rig
    finally:
        rig.close()


def test_it_follows_the_first_upstream_and_is_stale_until_synced(rig: _Rig) -> None:
    first, _second = rig.config.upstream
    assert rig.follows == [first] and rig.link.followed == first
    assert rig.link.stale()
    rig.core.sync.last_sync = "full"  # as SyncCore records a full sync
    rig.link.synced()
    assert not rig.link.stale()
    assert rig.views_moved == 1  # a full sync: restricted views move on
    assert len(rig.sockets.live(zmq.DEALER)) == 1  # the call DEALER, to the synced upstream


def test_a_silent_upstream_is_given_up_for_the_next(rig: _Rig) -> None:
    first, second = rig.config.upstream
    rig.link.synced()
    rig.now += 0.19  # under 2 missed heartbeats of 0.1 s
    rig.link.check()
    assert rig.link.followed == first and rig.shared.counters["upstream_switches"] == 0
    rig.now += 0.02
    rig.link.check()
    assert rig.link.followed == second and rig.shared.counters["upstream_switches"] == 1
    assert rig.closes == 1 and rig.follows == [first, second]
    assert rig.link.stale()  # until the new upstream speaks
    assert not rig.sockets.live(zmq.DEALER)  # calls went with the old one


def test_the_upstreams_own_staleness_makes_us_stale(rig: _Rig) -> None:
    rig.link.synced()
    rig.link.heard(encode_hugz(5, 100, stale=True))
    assert rig.link.stale()
    assert rig.link.hugz(100) == encode_hugz(rig.core.store.sequence, 100, stale=True)
    rig.link.heard(encode_hugz(5, 100))
    assert not rig.link.stale()


def test_a_call_before_the_first_sync_is_answered_not_active(rig: _Rig) -> None:
    rig.link.forward_call(b"caller", encode_call(OP_SET, UUID, "/k", (), b"v"))
    ((identity, reply),) = rig.replies
    assert identity == b"caller" and (reply.status, reply.reason) == ("refused", "not-active")
    assert "not synced" in reply.detail
    assert rig.shared.counters["calls_forward_not_synced"] == 1


def test_a_plain_relay_passes_the_pairs_refusal_on_to_everyone(rig: _Rig) -> None:
    rig.link.on_control(encode_refusal("relay", UUID, "acl"))
    assert [decode_control(f) for f in rig.published] == [Refusal(ANY_WRITER, UUID, "acl")]
    assert rig.shared.counters["kvset_refused_upstream"] == 1


def test_a_named_relay_tells_the_writer_it_forwarded_for(ctx: zmq.Context[Any]) -> None:
    rig = _Rig(ctx, named=True)
    rig.link.start()
    try:
        forwarder = rig.link.forwarder
        assert forwarder is not None
        forwarder.writers.add(UUID, "alice", rig.now)
        rig.link.on_control(encode_refusal("relay", UUID, "acl"))
        assert rig.told == [("alice", UUID, "acl")] and not rig.published
    finally:
        rig.close()
