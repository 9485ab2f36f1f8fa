"""recv_monitor_event reads libzmq's socket monitor events as pyzmq's
recv_monitor_message does, without importing zmq.utils.monitor (asyncio)."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import zmq

from clone.wire.frames import recv_monitor_event
from tests.support.waiting import eventually


def test_a_real_connect_is_read_as_pyzmq_reads_it(ctx: zmq.Context[Any]) -> None:
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    monitor = client.get_monitor_socket(zmq.EVENT_CONNECTED)
    client.connect(f"tcp://127.0.0.1:{port}")
    events: list[dict[str, Any]] = []

    def connected() -> bool:
        try:
            events.append(recv_monitor_event(monitor))
        except zmq.Again:
            pass
        return bool(events)

    eventually(connected, timeout=10, what="the monitor's EVENT_CONNECTED")
    (event,) = events
    assert event["event"] == zmq.EVENT_CONNECTED and isinstance(event["event"], zmq.Event)
    assert event["endpoint"] == f"tcp://127.0.0.1:{port}".encode()
    assert isinstance(event["value"], int)  # the connection's file descriptor
    client.disable_monitor()
    for sock in (monitor, client, server):
        sock.close(linger=0)


def test_a_message_that_is_no_event_is_refused(ctx: zmq.Context[Any]) -> None:
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://monitor-event-test")
    b.connect("inproc://monitor-event-test")
    a.send_multipart([struct.pack("=hi", zmq.EVENT_DISCONNECTED, 7), b"tcp://h:1"])
    assert recv_monitor_event(b, 0) == {
        "event": zmq.EVENT_DISCONNECTED, "value": 7, "endpoint": b"tcp://h:1",
    }  # fmt: skip
    a.send_multipart([b"short", b"tcp://h:1"])
    with pytest.raises(RuntimeError, match="not a socket monitor event"):
        recv_monitor_event(b, 0)
    a.send(b"one frame")
    with pytest.raises(RuntimeError, match="1 frames"):
        recv_monitor_event(b, 0)
    with pytest.raises(zmq.Again):
        recv_monitor_event(b)
    for sock in (a, b):
        sock.close(linger=0)
