"""The subscribers section's child processes: the writer, the sinks, the resync requesters.

Each runs in a process of its own (spawned by :mod:`.subscribers`, the driver,
which says how the section works) and reports through a queue: the writer
sends ``sub_rate`` updates a second on a schedule; a sink process holds
hundreds to thousands of subscribers (C-level proxies and a few Python probes
with latency histograms); a requester process asks its relays (or the backup)
for a snapshot the moment the failover's marker reaches them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import struct
import threading
import time
from collections.abc import Sequence
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import zmq

from clone.tools.bench.processes import SNAP_SUBTREE, ZERO_SEQ, kvset, uuid
from clone.tools.histogram import LatencyHistogram
from clone.wire.codec import Hugz, decode_update
from clone.wire.frames import MAX_SYNC_FRAME_BYTES, cap_message_size, recv_frames
from clone.wire.protocol import (
    BATCH_METADATA,
    HUGZ,
    KTHXBAI,
    KVBATCH,
    KVDELTA,
)
from clone.wire.requester import requester_metadata

__all__ = ["raise_nofile"]

log = logging.getLogger(__name__)

_PREFIX = b"/bench/l/"
_WARM = b"/bench/warm"
_FRAMES_PER_UPDATE = 5
# A resync requester that heard nothing for this long asks again (within
# +-_RETRY_JITTER of it, as our client spreads its re-asks: clone/client/backoff.py).
_RETRY_S = 2.0
_RETRY_JITTER = 0.25
_IDLE_S = 3.0  # a subscriber that got nothing for this long after the writer is done
_MARKER = (SNAP_SUBTREE + "failover").encode()
_VOTE_SUBTREE = b"/bench/vote/"  # an empty subtree: the vote's snapshot is one KTHXBAI


def raise_nofile() -> int:
    """Raise this process's open-file soft limit to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return int(soft)


# --------------------------------------------------------------------------
# Processes (module level: the spawn start method imports them)


def _cpu(pids: Sequence[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _writer_main(in_endpoint: str, rate: float, seconds: float, value_size: int,
                 go: MpEvent, results: Any) -> None:
    """Warm up until ``go``, then send ``rate`` updates/s stamped with their intended time."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.connect(in_endpoint)
    count = max(1, int(rate * seconds))
    pad = b"p" * max(0, value_size - 8)
    keys = [_PREFIX + str(i % 1000).encode() for i in range(count)]
    uuids = [uuid(i) for i in range(count)]
    warm = 0
    while not go.wait(0.05):
        pub.send_multipart(kvset(_WARM, b"w", 1 << 40 | warm))
        warm += 1
    interval = 1.0 / rate
    t0 = time.monotonic() + 0.5
    msgs = [[keys[i], ZERO_SEQ, uuids[i], b"", struct.pack("!d", t0 + i * interval) + pad]
            for i in range(count)]
    lag = LatencyHistogram()
    mono, sleep, send = time.monotonic, time.sleep, pub.send_multipart
    for i, m in enumerate(msgs):
        intended = t0 + i * interval
        delay = intended - mono()
        if delay > 0:
            sleep(delay)
        send(m)
        lag.record_seconds(mono() - intended)
    results.put({"role": "writer", "sent": count, "t_start": t0, "t_end": mono(),
                 "lag": lag.encode()})
    pub.close(linger=10_000)
    ctx.term()


def _sink_proxy(sub: zmq.Socket[Any], void: zmq.Socket[Any], control: zmq.Socket[Any]) -> None:
    with contextlib.suppress(zmq.ZMQError):
        zmq.proxy_steerable(sub, void, None, control)


def _probe_positions(count: int, probes: int) -> set[int]:
    """Which of a process's ``count`` subscribers are probes: spread over its order."""
    probes = min(probes, count)
    return {i * count // probes for i in range(probes)} if probes else set()


def _connection(endpoint: str, g: int) -> str:
    """Subscriber ``g``'s connection to ``endpoint`` (``tcp://host:port``), from a source
    address of its own: libzmq makes one connection per distinct endpoint string, so one
    SUB socket can hold many subscribers, each a TCP connection and a pipe of the server."""
    return f"tcp://127.1.{g // 250}.{1 + g % 250}:0;{endpoint.removeprefix('tcp://')}"


def _sink_process_main(idx: int, endpoints: Sequence[str], first: int, count: int, probes: int,
                       per_socket: int, ready: Any, stop: MpEvent, expected: Any,
                       results: Any) -> None:
    """``count`` subscribers (global indices ``first`` ..), round-robin over ``endpoints``.

    C-level sinks except the probes (see the module): each sink is one SUB
    socket holding ``per_socket`` subscribers (connections) drained by a proxy
    thread; reports each sink's count (and how many subscribers it holds) and
    the probes' histograms once ``stop`` is set.
    """
    nofile = raise_nofile()
    threading.stack_size(256 * 1024)
    ctx = zmq.Context()
    ctx.max_sockets = 4 * count + 64
    positions = _probe_positions(count, probes)
    sinks: list[tuple[int, zmq.Socket[Any], threading.Thread]] = []
    held: dict[int, int] = {}  # a sink (by its first subscriber) -> subscribers it holds
    probe_socks: dict[zmq.Socket[Any], int] = {}
    plain = [first + k for k in range(count) if k not in positions]
    for k in sorted(positions):
        g = first + k
        sub = ctx.socket(zmq.SUB)
        sub.rcvhwm = 0
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, _PREFIX)
        sub.setsockopt(zmq.SUBSCRIBE, _WARM)
        cap_message_size(sub)
        sub.connect(endpoints[g % len(endpoints)])
        probe_socks[sub] = g
    for j in range(0, len(plain), max(1, per_socket)):
        group = plain[j:j + max(1, per_socket)]
        sub = ctx.socket(zmq.SUB)
        sub.rcvhwm = 0
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, _PREFIX)
        for g in group:
            sub.connect(_connection(endpoints[g % len(endpoints)], g))
        void = ctx.socket(zmq.PUB)
        void.linger = 0
        void.bind(f"inproc://void-{j}")
        ctl, ctl_peer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        ctl.linger = ctl_peer.linger = 0
        ctl.bind(f"inproc://ctl-{j}")
        ctl_peer.connect(f"inproc://ctl-{j}")
        t = threading.Thread(target=_sink_proxy, args=(sub, void, ctl_peer), daemon=True)
        t.start()
        sinks.append((group[0], ctl, t))
        held[group[0]] = len(group)
    poller = zmq.Poller()
    for s in probe_socks:
        poller.register(s, zmq.POLLIN)
    warmed: set[int] = set()
    lats: dict[int, list[float]] = {g: [] for g in probe_socks.values()}
    counts: dict[int, int] = dict.fromkeys(probe_socks.values(), 0)
    announced = not probe_socks
    if announced:
        ready.put(idx)
    mono, unpack = time.monotonic, struct.unpack_from
    last = mono()
    while True:
        for sock, _ in poller.poll(100):
            g = probe_socks[sock]
            while True:
                try:
                    frames = recv_frames(sock)
                except zmq.Again:
                    break
                now = last = mono()
                if frames[0].startswith(_PREFIX):
                    counts[g] += 1
                    lats[g].append(now - unpack("!d", frames[4])[0])
                elif not announced:
                    warmed.add(g)
                    if len(warmed) == len(probe_socks):
                        ready.put(idx)
                        announced = True
        if stop.is_set():
            # Done when every probe has every update, or when nothing came for
            # _IDLE_S: a server far behind is still draining, which is latency,
            # not loss.
            if all(c >= expected.value for c in counts.values()) or mono() - last > _IDLE_S:
                break
    # Every C sink's count, from its proxy's statistics (frames in at the SUB),
    # until all are complete or the total stops moving for _IDLE_S.
    received: dict[int, int] = dict(counts)
    total, moved = -1, mono()
    while True:
        for g, ctl, _ in sinks:
            ctl.send(b"STATISTICS")
            stats = ctl.recv_multipart()
            received[g] = int.from_bytes(stats[0], "little") // _FRAMES_PER_UPDATE
        if all(received[g] >= held[g] * expected.value for g, _, _ in sinks):
            break
        now_total = sum(received.values())
        if now_total != total:
            total, moved = now_total, mono()
        elif mono() - moved > _IDLE_S:
            break
        time.sleep(0.5)
    hists: dict[int, LatencyHistogram] = {}
    merged = LatencyHistogram()
    for g, values in lats.items():
        h = LatencyHistogram()
        for v in values:
            h.record_seconds(v)
        hists[g] = h
        merged.merge(h)
    results.put({
        "idx": idx,
        "nofile": nofile,
        "cpu_s": _cpu([os.getpid()]),
        "received": received,
        "held": held,
        "probes": {g: {"count": h.count, "p99_ms": round(h.percentile_ms(99.0), 3),
                       "max_ms": round(h.max_ms(), 3)} for g, h in hists.items()},
        "hist": merged.encode(),
    })
    for _, ctl, _ in sinks:
        ctl.send(b"TERMINATE")
    for _, _, t in sinks:
        t.join(1.0)
    ctx.destroy(linger=0)


def _requester_main(idx: int, relays: Sequence[tuple[str, str]], first: int, count: int,
                    subtree: bytes, marker_seq: Any, ready: Any, stop: MpEvent,
                    results: Any, since: bytes | None = None) -> None:
    """``count`` snapshot requesters (global ``first`` ..) round-robin over ``relays``
    ((publisher, snapshot) endpoints); each asks once its relay holds the marker.

    ``since``: the ``X-CHP-Since`` metadata of the last update every requester
    holds (a client that followed the old active): each asks for a catch-up, as
    our client does, and records whether it got a KVDELTA and the marker in it.

    A relay holds it when it publishes the marker's KVPUB, or when its HUGZ say
    a sequence at or past the marker's (``marker_seq``, set by the driver once
    known): after a *full* resync a relay replaces its copy without publishing
    the difference, and its HUGZ are what tell a client to resync.

    Each requester names itself on every DEALER (``X-CHP-Requester``, as our
    client does), so the server replaces its older stream when it asks again
    instead of streaming to a closed socket beside the new one; and it asks
    again after ``_RETRY_S`` within +-25 %, so that requesters that asked
    together do not all ask again together.
    """
    raise_nofile()
    ctx = zmq.Context()
    ctx.max_sockets = 2 * count + len(relays) + 64
    watch: dict[zmq.Socket[Any], int] = {}
    for r, (pub, _) in enumerate(relays):
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, _MARKER)
        sub.setsockopt(zmq.SUBSCRIBE, HUGZ)
        cap_message_size(sub)
        sub.connect(pub)
        watch[sub] = r
    poller = zmq.Poller()
    for s in watch:
        poller.register(s, zmq.POLLIN)
    dealers: dict[zmq.Socket[Any], int] = {}
    sock_of: dict[int, zmq.Socket[Any]] = {}

    def dealer(g: int) -> zmq.Socket[Any]:
        """A fresh DEALER for requester ``g`` (a retry must not read the old stream)."""
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        d.rcvhwm = 0
        cap_message_size(d, MAX_SYNC_FRAME_BYTES)
        d.setsockopt(zmq.METADATA, BATCH_METADATA)
        d.setsockopt(zmq.METADATA, requester_metadata(f"{g + 1:016x}"))
        if since is not None:
            d.setsockopt(zmq.METADATA, since)
        d.connect(relays[g % len(relays)][1])
        dealers[d] = g
        sock_of[g] = d
        poller.register(d, zmq.POLLIN)
        return d

    by_relay: dict[int, list[int]] = {r: [] for r in range(len(relays))}
    for g in range(first, first + count):
        dealer(g)
        by_relay[g % len(relays)].append(g)
    ready.put(idx)
    mono = time.monotonic
    marker_at: dict[int, float] = {}
    how: dict[int, str] = {}
    entries: dict[int, int] = {}
    done: dict[int, float] = {}
    asked: dict[int, float] = {}
    deltas: set[int] = set()  # answered with a KVDELTA (a catch-up)
    marked: set[int] = set()  # the marker came as one entry of the stream
    retries = 0
    draw = random.Random(first).random
    wait_for: dict[int, float] = {}  # requester -> its silence before it asks again
    heard: dict[int, float] = {}  # requester -> its last message on its current DEALER
    while len(done) < count and not stop.is_set():
        for sock, _ in poller.poll(100):
            if sock in watch:
                r = watch[sock]
                with contextlib.suppress(zmq.Again):
                    while True:
                        frames = recv_frames(sock)
                        if r in marker_at:
                            continue
                        if frames[0] == HUGZ:
                            want = marker_seq.value
                            msg = decode_update(frames)
                            if not (want and isinstance(msg, Hugz) and msg.sequence >= want):
                                continue
                            how[r] = "hugz"
                        else:
                            how[r] = "kvpub"
                        marker_at[r] = now = mono()
                        for g in by_relay[r]:
                            sock_of[g].send_multipart([b"ICANHAZ?", subtree])
                            asked[g] = now
                continue
            g = dealers[sock]
            with contextlib.suppress(zmq.Again):
                while True:
                    frames = recv_frames(sock)
                    heard[g] = mono()
                    if frames[0] == KTHXBAI:
                        done[g] = mono()
                    elif frames[0] == KVBATCH and len(frames) > 1:
                        entries[g] = entries.get(g, 0) + len(frames[1]) // 4
                    elif frames[0] == KVDELTA:
                        deltas.add(g)
                    else:
                        entries[g] = entries.get(g, 0) + 1
                        if frames[0] == _MARKER:
                            marked.add(g)
        # A requester that heard nothing for _RETRY_S asks again on a fresh DEALER,
        # as a client does after its silence timeout, and starts over: also one
        # whose stream stopped part way (the server evicted or aborted it), which
        # else waited for the rest for ever.
        now = mono()
        for g, t in list(asked.items()):
            if g not in wait_for:
                wait_for[g] = _RETRY_S * (1 - _RETRY_JITTER + 2 * _RETRY_JITTER * draw())
            if g not in done and now - max(t, heard.get(g, t)) > wait_for[g]:
                old = sock_of[g]
                poller.unregister(old)
                del dealers[old]
                old.close(linger=0)
                dealer(g).send_multipart([b"ICANHAZ?", subtree])
                asked[g] = now
                del wait_for[g]
                heard.pop(g, None)
                entries.pop(g, None)
                deltas.discard(g)
                marked.discard(g)
                retries += 1
    results.put({"idx": idx, "marker_at": marker_at, "how": how, "done": done,
                 "retries": retries, "deltas": sorted(deltas), "marked": sorted(marked),
                 "entries": {g: entries.get(g, 0) for g in dealers.values()}})
    ctx.destroy(linger=0)
