"""Fill a server with many keys fast: raw KVSETs on its collector, no confirmations.

A confirmed load of 200k keys takes a minute on a busy machine; a test that
needs a large store (export, dump, a writer that must not copy it) only needs
the keys there.  A sentinel key written last tells when every key before it is
applied (the collector is one ordered stream).
"""

from __future__ import annotations

import time

import zmq

from clone.wire.codec import KVMsg, encode_kv, new_uuid
from clone.wire.protocol import COLLECTOR_OFFSET, PUBLISHER_OFFSET

__all__ = ["fill_store"]


def fill_store(port: int, n: int, prefix: str = "/fleet/", value_bytes: int = 100,
               timeout: float = 300.0) -> None:  # fmt: skip
    """Set ``{prefix}node-NNNNNNN/cpu`` for ``n`` keys on the server at ``port``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    done = ctx.socket(zmq.SUB)
    pub = ctx.socket(zmq.PUB)
    try:
        sentinel = f"{prefix}~done"
        done.setsockopt(zmq.SUBSCRIBE, sentinel.encode())
        done.connect(f"tcp://127.0.0.1:{port + PUBLISHER_OFFSET}")
        pub.sndhwm = 0
        pub.connect(f"tcp://127.0.0.1:{port + COLLECTOR_OFFSET}")
        body = b"v" * value_bytes
        deadline = time.monotonic() + timeout
        # The PUB drops what it sends before the connection is up: the
        # sentinel is resent until it comes back, and the keys then again.
        while not done.poll(100):
            pub.send_multipart(encode_kv(KVMsg(sentinel, 0, new_uuid(), (), b"x")))
            assert time.monotonic() < deadline, "the server never answered"
        while done.poll(0):
            done.recv_multipart()
        for i in range(n):
            key = f"{prefix}node-{i:07d}/cpu"
            pub.send_multipart(encode_kv(KVMsg(key, 0, new_uuid(), (), body)))
        pub.send_multipart(encode_kv(KVMsg(sentinel, 0, new_uuid(), (), b"y")))
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{n} keys not applied in {timeout:g}s"
            if done.poll(int(left * 1000)) and done.recv_multipart()[-1] == b"y":
                return
    finally:
        pub.close(linger=0)
        done.close(linger=0)
        ctx.term()
