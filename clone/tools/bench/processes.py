"""The benchmark's processes: the writer, the watchers, the C sinks and the ceilings.

Module-level functions, so that a fresh process can import them; the
messages they send are built here too, before any clock starts.

The processes are started by a fork server (``MP``) that has imported the
bench's process modules once: a spawned process imported them again each
time, about 0.15 s of CPU (a Python start and zmq, the histogram, the wire
code), and a bench run or test starts dozens.  A fork server's child starts
from a fresh interpreter's state too (never a copy of the parent's), so the
processes are as separate as spawned ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.context import ForkServerContext, ForkServerProcess
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import zmq

from clone.security import KeyPair, configure_client_socket
from clone.tools.histogram import LatencyHistogram
from clone.wire.frames import cap_message_size, recv_frames
from clone.wire.protocol import HUGZ

__all__ = [
    "DONE_PREFIX",
    "MP",
    "ClientCurve",
    "SNAP_SUBTREE",
    "ZERO_SEQ",
    "kvset",
    "proxy_main",
    "reap",
    "reader_main",
    "secure",
    "sink_main",
    "uuid",
    "watcher_main",
    "writer_main",
]

MP: ForkServerContext = multiprocessing.get_context("forkserver")
MP.set_forkserver_preload([
    "clone.tools.bench.processes",
    "clone.tools.bench.calls",
    "clone.tools.bench.leasedriver",
    "clone.tools.bench.subscriberprocs",
])
ZERO_SEQ = bytes(8)
SNAP_SUBTREE = "/bench/snap/"
DONE_PREFIX = b"/bench/done/"
_WARM_KEY = b"/bench/warm"
_TPUT_PREFIX = b"/bench/t/"
_LAT_PREFIX = b"/bench/l/"
_PR_SET_TIMERSLACK = 29


@dataclass(frozen=True)
class ClientCurve:
    """What a load generator needs to be a CURVE client: its key pair, the server's key.

    Plain bytes (Z85), so that it pickles into a spawned process.
    """

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes = b""


def secure(sock: zmq.Socket[Any], curve: ClientCurve | None) -> None:
    """Make ``sock`` a CURVE client if ``curve`` is given; before ``connect``."""
    if curve is not None:
        configure_client_socket(sock, KeyPair(curve.public, curve.secret), curve.server_public)


def uuid(i: int) -> bytes:
    """A KVSET uuid frame, distinct for each ``i``."""
    # Unique and cheap: the benchmark needs distinct ids (the server deduplicates
    # on them), not timestamps.  A v7-like layout keeps them sortable anyway.
    return struct.pack(">QQ", time.time_ns() // 1_000_000 << 16 | 0x7000, i)


def kvset(key: bytes, body: bytes, i: int) -> list[bytes]:
    """A KVSET as a client sends it (sequence 0, no properties)."""
    return [key, ZERO_SEQ, uuid(i), b"", body]


def _throughput_messages(n: int, size: int) -> list[list[bytes]]:
    body = b"v" * size
    return [kvset(_TPUT_PREFIX + str(i % 10_000).encode(), body, i) for i in range(n)]


def _warm_message(i: int) -> list[bytes]:
    return kvset(_WARM_KEY, b"w", 1 << 40 | i)


def _set_timer_slack_ns(ns: int) -> None:
    """Make sleep() wake on time (Linux: default slack is 50 us)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0)



def proxy_main(kind: str, in_port: int, out_port: int) -> None:
    """Run a ceiling forwarder until killed."""
    ctx = zmq.Context()
    if kind == "c-proxy":
        front = ctx.socket(zmq.XSUB)
        back = ctx.socket(zmq.XPUB)
        front.bind(f"tcp://127.0.0.1:{in_port}")
        back.bind(f"tcp://127.0.0.1:{out_port}")
        zmq.proxy(front, back)
        return
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub = ctx.socket(zmq.PUB)
    sub.bind(f"tcp://127.0.0.1:{in_port}")
    pub.bind(f"tcp://127.0.0.1:{out_port}")
    recv, send = sub.recv_multipart, pub.send_multipart
    while True:
        send(recv())


def sink_main(out_endpoint: str, count: int, curve: ClientCurve | None = None) -> None:
    """``count`` subscribers that drain everything at C speed, until killed.

    Each is ``zmq.proxy(SUB, PUB)`` in its own thread, the PUB bound to nowhere, so
    libzmq receives and drops every message without Python in the loop: the target
    pays for ``count`` more subscribers while the machine's two cores stay free for
    the target and the measuring watchers.
    """
    import threading

    ctx = zmq.Context()

    def drain(i: int) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.rcvhwm = 0
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        secure(sub, curve)
        sub.connect(out_endpoint)
        void = ctx.socket(zmq.PUB)
        void.bind(f"inproc://void-{i}")
        with contextlib.suppress(zmq.ZMQError):
            zmq.proxy(sub, void)

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def writer_main(
    in_endpoint: str,
    mode: str,
    params: dict[str, Any],
    go: MpEvent,
    results: Any,
    curve: ClientCurve | None = None,
) -> None:
    """Build every message, warm up until ``go``, then send (as fast as possible or
    on schedule) and report timings."""
    _set_timer_slack_ns(1_000)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0  # never drop in the writer: TCP back-pressure paces it instead
    secure(pub, curve)
    pub.connect(in_endpoint)
    size = int(params["value_size"])
    if mode == "throughput":
        msgs = _throughput_messages(int(params["messages"]), size)
    else:
        rate, seconds = float(params["rate"]), float(params["seconds"])
        count = max(1, int(rate * seconds))
        pad = b"p" * max(0, size - 8)
        keys = [_LAT_PREFIX + str(i % 1000).encode() for i in range(count)]
        uuids = [uuid(i) for i in range(count)]
    warm = 0
    while not go.wait(0.05):
        pub.send_multipart(_warm_message(warm))
        warm += 1
    send = pub.send_multipart
    if mode == "throughput":
        t_start = time.monotonic()
        for m in msgs:
            send(m)
        t_end = time.monotonic()
        results.put({"role": "writer", "t_start": t_start, "t_enqueued": t_end, "sent": len(msgs)})
    else:
        interval = 1.0 / rate
        t0 = time.monotonic() + 0.2
        # Bodies carry the intended send time: built now, before t0.
        msgs = [
            [keys[i], ZERO_SEQ, uuids[i], b"", struct.pack("!d", t0 + i * interval) + pad]
            for i in range(count)
        ]
        lag = LatencyHistogram()
        mono, sleep = time.monotonic, time.sleep
        for i, m in enumerate(msgs):
            intended = t0 + i * interval
            delay = intended - mono()
            if delay > 0:
                sleep(delay)
            send(m)
            lag.record_seconds(mono() - intended)
        results.put(
            {
                "role": "writer",
                "t_start": t0,
                "t_enqueued": time.monotonic(),
                "sent": count,
                "lag": lag.encode(),
            }
        )
    pub.close(linger=10_000)
    ctx.term()


def watcher_main(
    idx: int,
    out_endpoint: str,
    mode: str,
    expected: int,
    idle_s: float,
    ready: Any,
    results: Any,
    stop: MpEvent,
    curve: ClientCurve | None = None,
) -> None:
    """Subscribe, announce readiness at the first warm-up (or HUGZ), then measure."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.setsockopt(zmq.SUBSCRIBE, HUGZ if mode == "hugz" else b"")
    cap_message_size(sub)
    secure(sub, curve)
    sub.connect(out_endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    mono = time.monotonic
    announced = False
    count = 0
    first = last = 0.0
    hugz: list[float] = []
    latencies: list[float] = []  # seconds; into the histogram after the run, off the hot path
    prefix = _TPUT_PREFIX if mode == "throughput" else _LAT_PREFIX
    hard_deadline = mono() + 3600
    while not stop.is_set() and mono() < hard_deadline:
        if not poller.poll(100):
            if count and mono() - last > idle_s:
                break
            continue
        while True:
            try:
                frames = recv_frames(sub)
            except zmq.Again:
                break
            now = mono()
            key = frames[0]
            if mode == "hugz":
                if key == HUGZ:
                    hugz.append(now)
                    if not announced:
                        ready.put(idx)
                        announced = True
                continue
            if key.startswith(prefix):
                count += 1
                last = now
                if count == 1:
                    first = now
                if mode == "latency":
                    latencies.append(now - struct.unpack_from("!d", frames[4])[0])
            elif key == _WARM_KEY and not announced:
                ready.put(idx)
                announced = True
        if expected and count >= expected:
            break
    hist = LatencyHistogram()
    for lat in latencies:
        hist.record_seconds(lat)
    results.put(
        {
            "role": "watcher",
            "idx": idx,
            "received": count,
            "first": first,
            "last": last,
            "hist": hist.encode() if mode == "latency" else "",
            "hugz": hugz,
        }
    )
    sub.close(linger=0)
    ctx.term()


def reader_main(
    out_endpoint: str,
    curve: ClientCurve,
    prefixes: tuple[bytes, ...],
    ready: MpEvent,
    stop: MpEvent,
    results: Any,
) -> None:
    """A restricted subscriber: what the server's filtering and per-view counting serve.

    Subscribes to everything (the server narrows it to the reader's view), says
    ``ready`` once its CURVE handshake is done, then counts until ``stop``: the
    updates under ``prefixes``, anything else that is not a control topic (the
    filter failing), and at each view heartbeat whether the updates it received
    match the server's ``view_count`` (they do unless the stream dropped some).
    """
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    cap_message_size(sub)
    secure(sub, curve)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(out_endpoint)
    if monitor.poll(10_000):
        monitor.recv_multipart()
        ready.set()
    received = outside = 0
    checks: list[tuple[int, int]] = []  # (view_count, received) at each view heartbeat
    last = time.monotonic()
    while True:
        if not sub.poll(100):
            if stop.is_set() and time.monotonic() - last > 0.2:
                break
            continue
        frames = recv_frames(sub)
        last = time.monotonic()
        key = frames[0]
        if key.startswith(b"\x00V"):
            props = dict(
                line.split(b"=", 1) for line in frames[3].split(b"\n") if b"=" in line
            )
            if b"view_count" in props:
                checks.append((int(props[b"view_count"]), received))
        elif key.startswith(prefixes):
            received += 1
        elif not key.startswith(b"\x00"):
            outside += 1
    results.put(
        {
            "received": received,
            "outside_view": outside,
            "view_heartbeats": len(checks),
            "view_count_last": checks[-1][0] if checks else None,
            "view_count_mismatches": sum(1 for n, got in checks if n != got),
        }
    )
    sub.disable_monitor()
    monitor.close(linger=0)
    sub.close(linger=0)
    ctx.term()


def reap(procs: Sequence[ForkServerProcess], timeout: float = 3.0) -> None:
    """Join ``procs`` within ``timeout``, then terminate and kill what is left."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
