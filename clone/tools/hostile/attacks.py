"""The attacks on a server's memory, descriptors and loop, each run in a
process of its own until SIGTERM.

``python -m clone.tools.hostile.attacks NAME --host H --port P --http-port N
--scale S`` runs one attack against the server whose CHP base port is P (its
snapshot port P, publisher P+1, collector P+2).  Each is a careless or hostile
client as the issue's table describes; ``--scale`` (0 < S <= 1) shrinks the
volumes for a quick run or a test.  The process prints ``ready`` once its
attack is in place (a preload written, its sockets connected) and keeps it up
until it is told to stop, so the harness measures the server under it.  An
attack on a preloaded store prints ``loaded`` first and waits for SIGUSR1, so
that the harness can time a healthy sync of that store without the attack.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from clone.wire.protocol import COLLECTOR_OFFSET, ICANHAZ, PUBLISHER_OFFSET

__all__ = ["ATTACKS", "main"]

_stop = threading.Event()
_go = threading.Event()


def _kvset(key: bytes, body: bytes, i: int) -> list[bytes]:
    uuid = struct.pack(">QQ", time.time_ns(), i)
    return [key, bytes(8), uuid, b"", body]


def _flood_applied(ctx: zmq.Context[Any], host: str, port: int, keys: int, size: int,
                   prefix: bytes, rounds: int, timeout: float = 900.0) -> None:  # fmt: skip
    """Write ``keys`` values of ``size`` bytes ``rounds`` times, fire and forget
    but none dropped on our side (no send limit), and return once the server
    has taken all of them: a marker key, written first and overwritten last
    with a value of the same size (so a full store does not refuse it), comes
    back on the publisher."""
    marker = prefix + b"~marker"
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, marker)
    sub.connect(f"tcp://{host}:{port + PUBLISHER_OFFSET}")
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    pub.sndhwm = 0  # the queue is ours: the server takes what its bounds let in
    pub.connect(f"tcp://{host}:{port + COLLECTOR_OFFSET}")

    def marker_back(value: bytes, wait: float) -> bool:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not _stop.is_set():
            if sub.poll(200) and sub.recv_multipart()[-1] == value:
                return True
        return False

    while not _stop.is_set():  # the PUB drops what it sends before it is connected
        pub.send_multipart(_kvset(marker, b"0", 0))
        if marker_back(b"0", 0.5):
            break
    body = os.urandom(size)
    for r in range(rounds):
        for i in range(keys):
            if _stop.is_set():
                return
            pub.send_multipart(_kvset(prefix + str(i).encode(), body[r:] + body[:r], i))
    pub.send_multipart(_kvset(marker, b"1", 1))
    marker_back(b"1", timeout)
    pub.close()
    sub.close()


def _via() -> str:
    """The source part of an attacker's endpoint: it connects from the
    address ``CLONE_HOSTILE_SOURCE`` (default 127.0.0.2: another host than the
    healthy client's 127.0.0.1, as a misbehaving node of a fleet would be;
    empty: the system's choice)."""
    source = os.environ.get("CLONE_HOSTILE_SOURCE", "127.0.0.2")
    return f"{source}:0;" if source else ""


def _ready() -> None:
    print("ready", flush=True)


def _loaded() -> None:
    """Say the preload is in and wait for SIGUSR1 before attacking: the harness
    times a healthy sync of the same data first, so the attack is compared with
    the store it attacks, not with an empty one."""
    print("loaded", flush=True)
    while not _go.wait(0.2) and not _stop.is_set():
        pass


def _hold() -> None:
    while not _stop.wait(0.2):
        pass


def sub_flood(ctx: zmq.Context[Any], host: str, port: int, http: int, scale: float) -> None:
    """16 raw XSUB sockets send 160 MB of subscription messages to the publisher."""
    socks = []
    for _ in range(16):
        s = ctx.socket(zmq.XSUB)
        s.linger = 0
        s.sndhwm = 0
        s.connect(f"tcp://{host}:{port + PUBLISHER_OFFSET}")
        socks.append(s)
    _ready()
    total = int(160e6 * scale)
    per = 1000
    sent = 0
    i = 0
    while sent < total and not _stop.is_set():
        for s in socks:
            topic = b"\x01/" + os.urandom(per // 2).hex().encode()[: per - 2]
            with contextlib.suppress(zmq.Again):
                s.send(topic, zmq.NOBLOCK)
            sent += len(topic)
            i += 1
    _hold()


def sub_flood_valid(ctx: zmq.Context[Any], host: str, port: int, http: int,
                    scale: float) -> None:  # fmt: skip
    """16 raw XSUB sockets send valid (200-byte) subscriptions as fast as they
    can, for as long as the attack is held: each cycles through its own 500
    distinct topics (a scale of them), and libzmq's XSUB replays every topic it
    ever sent each time its connection comes back (every 100 ms after a drop).
    Each message is under the publisher's ``MAXMSGSIZE``, so what stops it is
    the server's per-connection caps, its inbound watch and its flood penalty.
    It connects from another host (:func:`_via`)."""
    via = _via()
    socks = []
    for _ in range(16):
        s = ctx.socket(zmq.XSUB)
        s.linger = 0
        s.sndhwm = 0
        s.connect(f"tcp://{via}{host}:{port + PUBLISHER_OFFSET}")
        socks.append(s)
    per = 200
    count = max(16, int(500 * scale))
    topics = [[b"\x01/" + os.urandom(per).hex().encode()[: per - 2] for _ in range(count)]
              for _ in socks]
    _ready()
    i = 0
    while not _stop.is_set():
        for s, own in zip(socks, topics, strict=True):
            with contextlib.suppress(zmq.Again):
                s.send(own[i % count], zmq.NOBLOCK)
        i += 1


def slow_subscribers(ctx: zmq.Context[Any], host: str, port: int, http: int,
                     scale: float) -> None:  # fmt: skip
    """10 subscribers that never read while 60 KiB values are written."""
    subs = []
    for _ in range(10):
        s = ctx.socket(zmq.SUB)
        s.linger = 0
        s.rcvhwm = 1
        s.setsockopt(zmq.RCVBUF, 4096)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://{host}:{port + PUBLISHER_OFFSET}")
        subs.append(s)
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    pub.connect(f"tcp://{host}:{port + COLLECTOR_OFFSET}")
    time.sleep(0.5)
    _ready()
    body = os.urandom(60 * 1024)
    i = 0
    keys = max(10, int(1000 * scale))
    while not _stop.is_set():
        pub.send_multipart(_kvset(b"/hostile/slow/" + str(i % keys).encode(), body, i))
        i += 1
        time.sleep(0.005)


def _requesters(ctx: zmq.Context[Any], host: str, port: int, count: int) -> None:
    """``count`` DEALERs from another host (:func:`_via`) that ask for a
    snapshot and never read."""
    via = _via()
    dealers = []
    for _ in range(count):
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        d.rcvhwm = 1
        d.setsockopt(zmq.RCVBUF, 4096)
        d.connect(f"tcp://{via}{host}:{port}")
        dealers.append(d)
    for d in dealers:
        d.send_multipart([ICANHAZ, b""])
    _ready()
    # Ask again now and then: a server that dropped a requester's stream sees it back.
    while not _stop.wait(5.0):
        for d in dealers:
            with contextlib.suppress(zmq.Again):
                d.send_multipart([ICANHAZ, b""], zmq.NOBLOCK)


def snapshot_requesters(ctx: zmq.Context[Any], host: str, port: int, http: int,
                        scale: float) -> None:  # fmt: skip
    """200 requesters that send ICANHAZ? and never read, over 20k keys of 1 KB."""
    _flood_applied(ctx, host, port, max(100, int(20_000 * scale)), 1024, b"/hostile/snap/", 1)
    _loaded()
    _requesters(ctx, host, port, max(4, int(200 * scale)))


def snapshot_requesters_big(ctx: zmq.Context[Any], host: str, port: int, http: int,
                            scale: float) -> None:  # fmt: skip
    """64 such requesters over 60 KiB values (a 96 MB store)."""
    _flood_applied(ctx, host, port, max(20, int(1600 * scale)), 60 * 1024, b"/hostile/big/", 1)
    _loaded()
    _requesters(ctx, host, port, max(2, int(64 * scale)))


def ws_viewers(ctx: zmq.Context[Any], host: str, port: int, http: int, scale: float) -> None:
    """40 status-page viewers that never read."""
    socks = []
    for _ in range(40):
        s = socket.create_connection((host, http))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(f"GET /ws HTTP/1.1\r\nHost: {host}:{http}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        socks.append(s)
    _ready()
    _hold()


def idle_http(ctx: zmq.Context[Any], host: str, port: int, http: int, scale: float) -> None:
    """Idle, half-sent HTTP requests, as many as the descriptor limit allows (19,000)."""
    socks = []
    want = max(50, int(19_000 * scale))
    for _ in range(want):
        if _stop.is_set():
            break
        try:
            s = socket.create_connection((host, http), timeout=2)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            time.sleep(0.05)
            continue
        socks.append(s)
    _ready()
    _hold()


def disk(ctx: zmq.Context[Any], host: str, port: int, http: int, scale: float) -> None:
    """660 MB of 512 KB values, written twice (old versions become free pages);
    ready once the server has taken every write (applied, or refused ``full``)."""
    keys = max(4, int(1320 * scale))
    _flood_applied(ctx, host, port, keys, 512 * 1024, b"/hostile/disk/", rounds=2)
    _ready()
    _hold()


ATTACKS: dict[str, Callable[[zmq.Context[Any], str, int, int, float], None]] = {
    "sub-flood": sub_flood,
    "sub-flood-valid": sub_flood_valid,
    "slow-subscribers": slow_subscribers,
    "snapshot-requesters": snapshot_requesters,
    "snapshot-requesters-big": snapshot_requesters_big,
    "ws-viewers": ws_viewers,
    "idle-http": idle_http,
    "disk": disk,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clone.tools.hostile.attacks")
    p.add_argument("attack", choices=sorted(ATTACKS))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: _stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: _go.set())
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        ATTACKS[args.attack](ctx, args.host, args.port, args.http_port, args.scale)
    finally:
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
