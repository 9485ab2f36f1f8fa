"""The security part (clone.server.security.Security) driven alone: real
certificates and a real ZAP handler, real CURVE sockets on loopback, no
server.  What it publishes (refusal notices) is recorded."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from clone.ratelimit import Throttle
from clone.security import PEER_USER
from clone.server.access import Access
from clone.server.config import ServerConfig
from clone.server.security import Security
from clone.server.shared import Shared
from clone.wire.control import Refusal, ViewHeartbeat, decode_control
from tests.support.curve import CurveKeys, curve_socket
from tests.support.ports import free_base_port

UUID = bytes(range(16))
COUNTERS = (
    "kvset_refused_acl",
    "security_reloads",
    "security_reload_errors",
    "subscriptions",
    "subscriptions_refused",
    "subscriptions_at_heartbeat",
)


class _Rig:
    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys | None) -> None:
        extra: dict[str, Any] = {}
        if keys is not None:
            extra = {
                "curve_secret": str(keys.pair_secret),
                "clients_dir": str(keys.clients),
                "acl": str(keys.acl),
            }
        self.config = ServerConfig(port=free_base_port(), bind="127.0.0.1", **extra)
        self.shared = Shared(
            Throttle(logging.getLogger("test.security"), time.monotonic),
            counters=dict.fromkeys(COUNTERS, 0),
        )
        self.published: list[list[bytes]] = []
        self.part = Security(
            self.config, ctx, self.shared, Access(), publish=self.published.append
        )


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    keys = CurveKeys.make(tmp_path, admitted=("writer", "reader"), strangers=("mallory",))
    keys.write_acl({"writer": ([""], ["/jobs/"]), "reader": (["/public/"], [])})
    return keys


@pytest.fixture
def secure(ctx: zmq.Context[Any], keys: CurveKeys) -> Iterator[_Rig]:
    rig = _Rig(ctx, keys)
    rig.part.open()
    try:
        yield rig
    finally:
        rig.part.close()


def test_without_a_curve_secret_everything_stays_open(ctx: zmq.Context[Any]) -> None:
    rig = _Rig(ctx, None)
    rig.part.open()
    assert rig.part.keypair is None and rig.part.gatekeeper is None
    assert not rig.part.access.secure
    assert rig.part.reload() is False  # nothing to reload
    rig.part.close()


def test_it_installs_the_admitted_names_and_their_rights(secure: _Rig) -> None:
    access = secure.part.access
    assert access.secure and secure.part.keypair is not None
    assert access.admitted == {"writer", "reader", PEER_USER}
    assert access.rights_of("writer").can_write(b"/jobs/1")
    assert not access.rights_of("mallory").can_write(b"/jobs/1")  # fail closed
    assert "writer" not in access.write_all and PEER_USER in access.write_all


def test_a_write_outside_the_prefixes_is_refused_and_the_writer_told(
    ctx: zmq.Context[Any], keys: CurveKeys, secure: _Rig
) -> None:
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.LINGER, 0)
    secure.part.secure(collector, bound=True)  # a CURVE server, guarded by the ZAP handler
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    port = collector.bind_to_random_port("tcp://127.0.0.1")
    writer = curve_socket(ctx, zmq.PUB, keys, "writer")
    writer.connect(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while not collector.poll(20):  # the handshake and subscription take a moment
            assert time.monotonic() < deadline, "the CURVE PUB never reached the collector"
            writer.send_multipart([b"/jobs/probe", bytes(8), b"", b"", b"p"])
        while collector.poll(50):
            collector.recv_multipart()
        writer.send_multipart([b"/jobs/a", bytes(8), UUID, b"", b"v"])
        writer.send_multipart([b"/etc/passwd", bytes(8), UUID, b"", b"v"])
        judged = []
        for _ in range(2):
            assert collector.poll(10_000)
            parts = collector.recv_multipart(copy=False)
            judged.append(secure.part.judge(parts[0], [p.bytes for p in parts], notify=True))
        assert judged == [(True, "writer"), (False, "writer")]
        assert secure.shared.counters["kvset_refused_acl"] == 1
        (notice,) = [decode_control(frames) for frames in secure.published]
        assert notice == Refusal("writer", UUID, "acl")
    finally:
        writer.close(0)
        collector.close(0)


def test_reload_says_when_the_publisher_must_be_bound_again(
    keys: CurveKeys, secure: _Rig
) -> None:
    assert secure.part.reload() is False  # nothing changed
    keys.write_acl({"writer": ([""], ["/jobs/"]), "reader": (["/public/", "/news/"], [])})
    assert secure.part.reload() is True  # the reader's read rights changed
    keys.revoke("writer")
    assert secure.part.reload() is True  # a name removed
    assert "writer" not in secure.part.access.admitted
    secure.part.refusal("writer", UUID, "acl")
    assert secure.published == []  # no notice to a name no longer admitted
    keys.acl.write_text("[client.reader\nread = ")  # does not parse: kept as it was
    assert secure.part.reload() is False
    assert secure.shared.counters["security_reload_errors"] == 1
    assert secure.shared.counters["security_reloads"] == 3


def test_each_restricted_view_counts_what_was_published_in_it(secure: _Rig) -> None:
    part = secure.part
    (vid,) = part.view_counts  # the reader's view; the writer reads everything
    part.count_views([[b"/public/a"], [b"/jobs/b"], [b"/public/c"]])
    assert part.view_counts == {vid: 2}
    (beat,) = part.view_heartbeats(7, 1000, stale=True)
    msg = decode_control(beat)
    assert isinstance(msg, ViewHeartbeat) and msg.view == vid
    part.views_replaced()  # a relay's full resync: every view moves on
    assert part.view_counts == {vid: 3}
