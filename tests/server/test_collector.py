"""The collector part (clone.server.collecting) driven alone: a real PUB and
SUB on loopback, no server and no loop.  One Collector for every kind of
server: what it does with a KVSET is the sink's (apply, or a relay's forward)
and, under CURVE, the judge's."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from clone.ratelimit import Throttle
from clone.server.collecting import Applier, Collector
from clone.server.core import CoreSettings, ServerCore
from clone.server.shared import Shared
from clone.wire.codec import KVMsg, encode_kv, new_uuid


class _Recorder:
    """A sink that records its turns."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def begin(self) -> None:
        self.calls.append(("begin", None))

    def take(self, frames: list[bytes], writer: str | None) -> None:
        self.calls.append(("take", (frames[0], writer)))

    def end(self) -> None:
        self.calls.append(("end", None))


@pytest.fixture
def wire(ctx: zmq.Context[Any]) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """A client's PUB connected to a collector SUB over inproc: once a send
    returns, the message is in the SUB's queue (no I/O thread in between)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"inproc://collector-{id(sub)}")
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"inproc://collector-{id(sub)}")
    deadline = time.monotonic() + 30
    while not sub.poll(10):  # subscribed once a probe gets through (the ceiling bounds a hang)
        assert time.monotonic() < deadline, "the PUB never reached the SUB"
        pub.send(b"probe")
    while sub.poll(0):
        sub.recv_multipart()
    try:
        yield pub, sub
    finally:
        pub.close(0)
        sub.close(0)


def _kvset(key: str, value: bytes = b"v") -> list[bytes]:
    return encode_kv(KVMsg(key, 0, new_uuid(), (), value))


def _shared() -> Shared:
    return Shared(Throttle(logging.getLogger("test.collector"), time.monotonic))


def test_a_turn_takes_at_most_a_batch_and_leaves_the_rest_queued(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = wire
    sink = _Recorder()
    part = Collector(sub, _shared(), sink, batch=3)
    assert not part.secure
    for i in range(5):
        pub.send_multipart(_kvset(f"/k{i}"))
    part.on_message(sub.recv_multipart())
    assert sink.calls == [
        ("begin", None),
        ("take", (b"/k0", None)),
        ("take", (b"/k1", None)),
        ("take", (b"/k2", None)),
        ("end", None),
    ]
    # Nothing received was left unhandled: the next two wait in the socket.
    assert sub.recv_multipart()[0] == b"/k3"


def test_the_turn_ends_when_the_socket_is_empty(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = wire
    sink = _Recorder()
    part = Collector(sub, _shared(), sink, batch=1000)
    pub.send_multipart(_kvset("/a"))
    pub.send_multipart(_kvset("/b"))
    part.on_message(sub.recv_multipart())
    assert [arg for kind, arg in sink.calls if kind == "take"] == [(b"/a", None), (b"/b", None)]
    assert sink.calls[-1] == ("end", None)


def test_an_applier_applies_and_commits_once_per_turn(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = wire
    core = ServerCore(standalone=True)
    commits: list[int] = []
    shared = _shared()
    part = Collector(
        sub,
        shared,
        Applier(core, shared, end_turn=lambda: commits.append(core.store.sequence)),
        batch=100,
    )
    pub.send_multipart(_kvset("/a"))
    pub.send_multipart(_kvset("/b"))
    part.on_message(sub.recv_multipart())
    assert core.store.sequence == 2 and commits == [2]


def test_a_bad_update_is_dropped_and_the_turn_goes_on(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    _pub, sub = wire
    core = ServerCore(standalone=True)
    ends: list[bool] = []
    shared = _shared()
    applier = Applier(core, shared, end_turn=lambda: ends.append(True))
    part = Collector(sub, shared, applier, batch=10)
    part.on_message([b"not", b"a", b"kvset"])  # a malformed message, then nothing queued
    assert core.store.sequence == 0 and ends == [True]


def test_an_active_applier_tells_a_named_writer_the_store_is_full() -> None:
    core = ServerCore(CoreSettings(max_keys=1), standalone=True)
    told: list[tuple[str | None, bytes, str]] = []
    applier = Applier(
        core,
        _shared(),
        end_turn=lambda: None,
        refuse=lambda name, uuid, why: told.append((name, uuid, why)),
    )
    applier.take(_kvset("/one"), "alice")
    frames = _kvset("/two")
    applier.take(frames, "alice")
    assert told == [("alice", frames[2], "full")] and core.store.sequence == 1
    # A passive server parks writes; it tells nobody.
    passive = ServerCore(CoreSettings(max_keys=1))
    Applier(passive, _shared(), end_turn=lambda: None, refuse=lambda *a: told.append(a)).take(
        _kvset("/three"), "alice"
    )
    assert len(told) == 1


def test_a_secure_collector_judges_each_write_and_passes_the_writer(
    wire: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    pub, sub = wire
    sink = _Recorder()
    judged: list[bytes] = []

    def judge(first: zmq.Frame, frames: list[bytes]) -> tuple[bool, str | None]:
        judged.append(frames[0])
        return frames[0].startswith(b"/ok"), "bob"

    part = Collector(sub, _shared(), sink, batch=10, judge=judge)
    assert part.secure
    pub.send_multipart(_kvset("/no"))
    pub.send_multipart(_kvset("/ok"))
    part.on_frames(sub.recv_multipart(copy=False))
    assert judged == [b"/no", b"/ok"]
    assert [arg for kind, arg in sink.calls if kind == "take"] == [(b"/ok", "bob")]
