"""ServerSockets.pause/resume (what a commit in flight does to the server's
streams): a real PUSH/PULL pair on loopback and a real tornado loop, driven
by hand; no server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
from tornado.ioloop import IOLoop

from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.config import ServerConfig
from clone.server.security import Security
from clone.server.shared import Shared
from clone.server.sockets import ServerSockets
from tests.support.ports import free_base_port

WAIT = 20.0


def _run_until(loop: IOLoop, check: Callable[[], bool], timeout: float = WAIT) -> bool:
    """Let the loop run, 10 ms at a time, until ``check()`` or ``timeout``; whether it held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            return False
        loop.asyncio_loop.run_until_complete(asyncio.sleep(0.01))
    return True


def test_a_paused_stream_reads_nothing_and_catches_up_on_resume(ctx: zmq.Context[Any]) -> None:
    shared = Shared(Throttle(logging.getLogger("test.sockets"), time.monotonic),
                    counters={"internal_errors": 0})  # fmt: skip
    config = ServerConfig(port=free_base_port(), bind="127.0.0.1")
    sockets = ServerSockets(ctx, Security(config, ctx, shared, Access(), publish=lambda f: None),
                            shared.counters)  # fmt: skip
    loop = IOLoop(make_current=False)
    sockets.loop = loop
    pull = sockets.socket(zmq.PULL, bound=True)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    got: list[bytes] = []
    try:
        sockets.stream(pull, lambda frames: got.append(frames[0]))
        push.send(b"1")
        assert _run_until(loop, lambda: got == [b"1"])
        sockets.pause()
        push.send(b"2")
        push.send(b"3")
        # Both are in the socket (the poll says so) and the loop turns: unread.
        assert pull.poll(int(WAIT * 1000)) == zmq.POLLIN
        assert not _run_until(loop, lambda: len(got) > 1, timeout=0.2)
        assert got == [b"1"]
        # A stream opened while paused starts paused too.
        late = sockets.socket(zmq.PULL, bound=True)
        late_port = late.bind_to_random_port("tcp://127.0.0.1")
        late_push = ctx.socket(zmq.PUSH)
        late_push.setsockopt(zmq.LINGER, 0)
        late_push.connect(f"tcp://127.0.0.1:{late_port}")
        late_got: list[bytes] = []
        sockets.stream(late, lambda frames: late_got.append(frames[0]))
        late_push.send(b"a")
        assert late.poll(int(WAIT * 1000)) == zmq.POLLIN
        assert not _run_until(loop, lambda: bool(late_got), timeout=0.2)
        sockets.resume()
        assert _run_until(loop, lambda: got == [b"1", b"2", b"3"] and late_got == [b"a"])
        late_push.close(0)
    finally:
        push.close(0)
        sockets.close()
        loop.close(all_fds=False)
