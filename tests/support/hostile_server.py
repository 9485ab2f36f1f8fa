"""A CHP server that sends what no server should, run as its own process.

``python -m tests.support.hostile_server PORT MODE`` binds a snapshot ROUTER on
PORT and a PUB on PORT+1, prints ``ready``, and serves until killed:

* ``frames``: every snapshot reply and every publication is preceded by a
  message of :data:`LONG_MESSAGE_FRAMES` frames;
* ``huge-pub``: snapshots are answered (empty), then a KVPUB whose body is
  :data:`HUGE_FRAME_BYTES` is published every heartbeat;
* ``huge-sync``: snapshot requests are answered with such a KVSYNC only.

HUGZ go out every heartbeat (saying it), so the client has no reason but the
hostile messages to leave.  A process of its own, so that the memory it
spends building and sending huge frames is not counted as the client's.
"""

from __future__ import annotations

import sys
import time

import zmq

from clone.wire.codec import KVMsg, decode_icanhaz, encode_hugz, encode_kthxbai, encode_kv
from clone.wire.protocol import PUBLISHER_OFFSET

__all__ = ["HEARTBEAT", "HUGE_FRAME_BYTES", "LONG_MESSAGE_FRAMES", "MODES", "main"]

HEARTBEAT = 0.05
LONG_MESSAGE_FRAMES = 100
HUGE_FRAME_BYTES = 64 * 1024 * 1024
MODES = ("frames", "huge-pub", "huge-sync")


def main(port: int, mode: str) -> None:
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, not {mode!r}")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(f"tcp://127.0.0.1:{port}")
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    pub.bind(f"tcp://127.0.0.1:{port + PUBLISHER_OFFSET}")
    long_message = [b"k"] * LONG_MESSAGE_FRAMES
    huge = encode_kv(KVMsg("huge", 1, b"", (), bytes(HUGE_FRAME_BYTES)))
    print("ready", flush=True)
    next_beat = 0.0
    while True:
        if router.poll(int(HEARTBEAT * 1000)):
            identity, *request = router.recv_multipart()
            subtree = decode_icanhaz(request).subtree
            if mode == "frames":
                router.send_multipart([identity, *long_message])
            if mode == "huge-sync":
                router.send_multipart([identity, *huge])
            else:
                router.send_multipart([identity, *encode_kthxbai(0, subtree)])
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + HEARTBEAT
            if mode == "frames":
                pub.send_multipart(long_message)
            elif mode == "huge-pub":
                pub.send_multipart(huge)
            pub.send_multipart(encode_hugz(0, int(HEARTBEAT * 1000)))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
