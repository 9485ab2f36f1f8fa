"""``--handshake-timeout``: a connection to a bound socket of ours that does not
finish its ZMTP handshake is closed after it, not after libzmq's 30 s.  A
real socket and a raw TCP peer that never greets; no server process."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest
import zmq

from clone.ratelimit import Throttle
from clone.server.access import Access
from clone.server.config import ServerConfig
from clone.server.security import Security
from clone.server.shared import Shared
from clone.server.sockets import ServerSockets
from tests.support.ports import free_base_port

CEILING = 30.0  # bounds a hang only: libzmq's own default is 30 s


def _sockets(ctx: zmq.Context[Any], timeout: float | None) -> ServerSockets:
    shared = Shared(Throttle(logging.getLogger("test.handshake"), time.monotonic),
                    counters={"internal_errors": 0})  # fmt: skip
    config = ServerConfig(port=free_base_port(), bind="127.0.0.1")
    security = Security(config, ctx, shared, Access(), publish=lambda f: None)
    return ServerSockets(ctx, security, shared.counters, timeout)


def test_a_bound_socket_takes_the_timeout_and_a_connecting_one_does_not(
    ctx: zmq.Context[Any],
) -> None:
    sockets = _sockets(ctx, 0.25)
    bound = sockets.socket(zmq.ROUTER, bound=True)
    dealer = sockets.socket(zmq.DEALER)
    try:
        assert bound.getsockopt(zmq.HANDSHAKE_IVL) == 250
        assert dealer.getsockopt(zmq.HANDSHAKE_IVL) == 30_000  # libzmq's default
    finally:
        bound.close(0)
        dealer.close(0)


def test_a_peer_that_never_greets_is_closed_after_the_timeout(ctx: zmq.Context[Any]) -> None:
    bound = _sockets(ctx, 0.25).socket(zmq.ROUTER, bound=True)
    port = bound.bind_to_random_port("tcp://127.0.0.1")
    silent = socket.create_connection(("127.0.0.1", port), timeout=CEILING)
    try:
        started = time.monotonic()
        # libzmq sends its greeting, then closes the connection when our side
        # has said nothing for the handshake timeout: recv reaches the EOF.
        while chunk := silent.recv(4096):
            assert chunk
        assert time.monotonic() - started < CEILING / 2
    finally:
        silent.close()
        bound.close(0)


def test_the_flag_is_positive() -> None:
    with pytest.raises(ValueError, match="handshake_timeout"):
        ServerConfig(port=free_base_port(), handshake_timeout=0)
