"""The two sockets of a one-off reader that talks to one server directly.

How this works: ``clone backup`` (:mod:`.backup`) and a watch from a sequence
(:mod:`.history`) do not go through the agent: each needs the updates a server
publishes *and* one reply on its snapshot port, read side by side so that
nothing published between the two is missed.  :func:`server_sockets` opens
exactly that: a SUB on the server's publisher, subscribed to everything and
connected first, and a DEALER on its snapshot port carrying the ZMTP metadata
of the request, both with the client's CURVE keys when given, the message-size
caps, a bounded queue and linger 0, and a poller over both.  Leaving the
``with`` closes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import zmq

from clone.client.agent import split_endpoint
from clone.security import KeyPair, configure_client_socket
from clone.wire.frames import MAX_FRAME_BYTES, MAX_SYNC_FRAME_BYTES, cap_message_size
from clone.wire.protocol import PUBLISHER_OFFSET, SNAPSHOT_OFFSET

__all__ = ["server_sockets"]

log = logging.getLogger(__name__)

#: Messages each socket may queue: the live updates that arrive while a big
#: snapshot or a long delta streams are read only after it.
RCVHWM = 1_000_000


@contextmanager
def server_sockets(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    *,
    curve: tuple[KeyPair, bytes] | None = None,
    metadata: Sequence[bytes] = (),
    optional_metadata: Sequence[bytes] = (),
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Poller]]:
    """``(sub, dealer, poller)`` for the server at ``endpoint`` (its base port).

    ``metadata`` must reach the server (a libzmq that cannot send ZMTP
    metadata raises here, loudly); ``optional_metadata`` is dropped with a
    debug line by such a libzmq (the server then answers the standard way).
    """
    host, base = split_endpoint(endpoint)
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        for sock in (sub, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            if curve is not None:
                configure_client_socket(sock, *curve)
        cap_message_size(sub, MAX_FRAME_BYTES)
        cap_message_size(dealer, MAX_SYNC_FRAME_BYTES)
        for item in metadata:
            dealer.setsockopt(zmq.METADATA, item)
        for item in optional_metadata:
            try:
                dealer.setsockopt(zmq.METADATA, item)
            except zmq.ZMQError:  # a libzmq older than 4.3
                log.debug("this libzmq cannot send ZMTP metadata; asking without %r", item)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"{host}:{base + PUBLISHER_OFFSET}")
        dealer.connect(f"{host}:{base + SNAPSHOT_OFFSET}")
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        yield sub, dealer, poller
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
