"""Clients of real server processes, for end-to-end tests: a synced `Clone`
and a raw CHP peer, each closed when the ``with`` block ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from clone import Clone
from tests.support.chp_peer import ChpPeer
from tests.support.servers import ServerProcess

__all__ = ["endpoint", "raw_peer", "synced_client"]


def endpoint(server: ServerProcess) -> str:
    """The CHP base endpoint a client gives for ``server``."""
    return f"tcp://127.0.0.1:{server.port}"


@contextmanager
def synced_client(
    *servers: ServerProcess, heartbeat: float = 0.1, timeout: float = 10.0
) -> Iterator[Clone]:
    """A `Clone` of ``servers`` (in failover order), synced before it is handed out."""
    client = Clone(
        [endpoint(s) for s in servers], heartbeat=heartbeat, server_timeout=5 * heartbeat
    )
    try:
        client.wait_synced(timeout)
        yield client
    finally:
        client.close()


@contextmanager
def raw_peer() -> Iterator[ChpPeer]:
    """A raw CHP peer on its own context."""
    ctx = zmq.Context()
    peer = ChpPeer(ctx)
    try:
        yield peer
    finally:
        peer.close()
        ctx.term()
