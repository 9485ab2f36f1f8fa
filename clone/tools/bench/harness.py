"""Benchmarks of a real clone-server, next to the ceilings of ZeroMQ on this machine.

How this works: every measurement moves CHP-shaped traffic (five-frame KVSETs
with 100-byte values) from a *writer* process to one or more *watcher*
processes through a *target*:

* ``clone``: a real ``clone-server --standalone`` (KVSET in its collector, KVPUB
  out of its publisher);
* ``c-proxy``: libzmq's own ``zmq.proxy(XSUB, XPUB)`` in its own process, the
  ceiling of what ZeroMQ can forward here;
* ``py-forwarder``: a trivial pyzmq SUB -> PUB ``recv_multipart``/``send_multipart``
  loop in its own process, the ceiling of a Python process doing nothing else.

Writer and watchers run in separate processes (``multiprocessing``, spawn), so
the load generator and the target do not share a GIL.  With more than one
subscriber, ``probes`` of them (default 1) are measuring Python watchers and the
rest are C-level sinks (``zmq.proxy`` from a SUB into a PUB with no peers, one
thread each, in one process): the target pays for every subscriber, but ten
Python watchers would saturate two cores by themselves and measure the watchers,
not the target.  Before any clock starts,
the writer builds every message and sends *warm-up* messages until each watcher
has seen one (subscriptions propagate asynchronously, so without this the first
messages would be dropped by PUB).  Then:

* **throughput**: the writer sends N messages as fast as it can; each watcher
  counts what it receives and when the last one arrived.  Rate per subscriber =
  received / (last arrival - writer's first send).
* **latency**: the writer sends on a fixed schedule; each message carries its
  *intended* send time (CLOCK_MONOTONIC, shared by all processes on Linux) and a
  watcher records ``arrival - intended`` in an HDR histogram.  Measuring from the
  intended time, not from the actual send, means a stall in the writer or the
  server delays the messages queued behind it and is counted for each of them:
  no coordinated omission.
* **snapshot**: load N keys into a fresh server, then time a raw ICANHAZ? until
  KTHXBAI (serve time, completeness checked) and a real ``clone.Clone`` client
  until ``wait_synced`` returns (sync time), while a watcher process records
  every HUGZ, so the largest heartbeat gap during the snapshot is known.
* **memory**: server RSS before and after loading N keys (psutil).

``--profile DIR`` runs ``py-spy record`` on the server during each section and
reports the functions where it spent its time.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import logging
import multiprocessing
import os
import platform
import queue
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.context import SpawnContext, SpawnProcess
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import zmq

from clone.errors import CloneError
from clone.tools.histogram import LatencyHistogram
from clone.tools.procs import (
    ProcessGroup,
    ServerAddress,
    free_base_port,
    server_argv,
    wait_listening,
)
from clone.wire.protocol import (
    BATCH_METADATA,
    COLLECTOR_OFFSET,
    HUGZ,
    KTHXBAI,
    KVBATCH,
    PUBLISHER_OFFSET,
    SNAPSHOT_OFFSET,
)

__all__ = [
    "SECTIONS",
    "TARGETS",
    "BenchConfig",
    "machine_info",
    "main",
    "run_benchmarks",
]

log = logging.getLogger(__name__)

SECTIONS: tuple[str, ...] = ("throughput", "latency", "snapshot", "memory")
TARGETS: tuple[str, ...] = ("clone", "c-proxy", "py-forwarder")

_MP: SpawnContext = multiprocessing.get_context("spawn")
_ZERO_SEQ = bytes(8)
_WARM_KEY = b"/bench/warm"
_TPUT_PREFIX = b"/bench/t/"
_LAT_PREFIX = b"/bench/l/"
_SNAP_SUBTREE = "/bench/snap/"
_DONE_PREFIX = b"/bench/done/"
_PR_SET_TIMERSLACK = 29

Say = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    """What to run and how big; :meth:`quick` and :meth:`default` are the presets."""

    sections: tuple[str, ...] = SECTIONS
    value_size: int = 100
    throughput_messages: int = 100_000
    subscriber_counts: tuple[int, ...] = (1, 10)
    throughput_targets: tuple[str, ...] = TARGETS
    rates: tuple[int, ...] = (1_000, 2_000, 5_000, 10_000)
    rate_seconds: float = 5.0
    multi_sub_rate: int = 10_000
    multi_subs: int = 10
    latency_targets: tuple[str, ...] = ("clone", "c-proxy")
    snapshot_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    snapshot_repeats: int = 3
    snapshot_heartbeat_ms: int = 200
    memory_keys: int = 100_000
    # Subscribers measured by a Python watcher process each; the others are C sinks.
    probes: int = 1
    # Throughput and latency runs are repeated, interleaved; the median is reported.
    repeats: int = 3
    server_heartbeat_ms: int | None = None
    profile_dir: Path | None = None
    log_dir: Path = Path("results/bench-logs")

    @classmethod
    def quick(cls, **changes: Any) -> BenchConfig:
        base = cls(
            throughput_messages=5_000,
            subscriber_counts=(1, 3),
            rates=(1_000, 2_000),
            rate_seconds=1.0,
            multi_sub_rate=2_000,
            multi_subs=3,
            latency_targets=("clone",),
            snapshot_sizes=(2_000,),
            snapshot_repeats=1,
            memory_keys=5_000,
            repeats=1,
        )
        return replace(base, **changes)


# --------------------------------------------------------------------------
# Messages


def _uuid(i: int) -> bytes:
    # Unique and cheap: the benchmark needs distinct ids (the server deduplicates
    # on them), not timestamps.  A v7-like layout keeps them sortable anyway.
    return struct.pack(">QQ", time.time_ns() // 1_000_000 << 16 | 0x7000, i)


def _kvset(key: bytes, body: bytes, i: int) -> list[bytes]:
    return [key, _ZERO_SEQ, _uuid(i), b"", body]


def _throughput_messages(n: int, size: int) -> list[list[bytes]]:
    body = b"v" * size
    return [_kvset(_TPUT_PREFIX + str(i % 10_000).encode(), body, i) for i in range(n)]


def _warm_message(i: int) -> list[bytes]:
    return _kvset(_WARM_KEY, b"w", 1 << 40 | i)


def _set_timer_slack_ns(ns: int) -> None:
    """Make sleep() wake on time (Linux: default slack is 50 us)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0)


# --------------------------------------------------------------------------
# Processes: the writer, the watchers and the ceilings.  Module-level functions,
# so that the spawn start method can import them.


def _proxy_main(kind: str, in_port: int, out_port: int) -> None:
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


def _sink_main(out_endpoint: str, count: int) -> None:
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


def _writer_main(
    in_endpoint: str, mode: str, params: dict[str, Any], go: MpEvent, results: Any
) -> None:
    """Build every message, warm up until ``go``, then send (as fast as possible or
    on schedule) and report timings."""
    _set_timer_slack_ns(1_000)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0  # never drop in the writer: TCP back-pressure paces it instead
    pub.connect(in_endpoint)
    size = int(params["value_size"])
    if mode == "throughput":
        msgs = _throughput_messages(int(params["messages"]), size)
    else:
        rate, seconds = float(params["rate"]), float(params["seconds"])
        count = max(1, int(rate * seconds))
        pad = b"p" * max(0, size - 8)
        keys = [_LAT_PREFIX + str(i % 1000).encode() for i in range(count)]
        uuids = [_uuid(i) for i in range(count)]
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
            [keys[i], _ZERO_SEQ, uuids[i], b"", struct.pack("!d", t0 + i * interval) + pad]
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


def _watcher_main(
    idx: int,
    out_endpoint: str,
    mode: str,
    expected: int,
    idle_s: float,
    ready: Any,
    results: Any,
    stop: MpEvent,
) -> None:
    """Subscribe, announce readiness at the first warm-up (or HUGZ), then measure."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.setsockopt(zmq.SUBSCRIBE, HUGZ if mode == "hugz" else b"")
    sub.connect(out_endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    mono = time.monotonic
    recv = sub.recv_multipart
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
                frames = recv(zmq.NOBLOCK)
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


def _reap(procs: Sequence[SpawnProcess], timeout: float = 3.0) -> None:
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


# --------------------------------------------------------------------------
# Targets


@dataclass
class Target:
    """Something running that forwards KVSET-shaped traffic."""

    name: str
    in_endpoint: str
    out_endpoint: str
    pid: int
    snapshot_endpoint: str = ""


@contextlib.contextmanager
def _running_target(
    kind: str, group: ProcessGroup, heartbeat_ms: int | None = None
) -> Iterator[Target]:
    deadline = time.monotonic() + 15
    if kind == "clone":
        base = free_base_port(3)
        name = f"clone-server-{len(group.procs)}"
        proc = group.add(
            name, server_argv("standalone", ServerAddress(name, base), heartbeat_ms=heartbeat_ms)
        )
        try:
            for off in (SNAPSHOT_OFFSET, PUBLISHER_OFFSET, COLLECTOR_OFFSET):
                if not wait_listening(base + off, deadline):
                    raise RuntimeError(
                        f"clone-server did not listen on {base + off}:\n{proc.log_tail()}"
                    )
            yield Target(
                kind,
                f"tcp://127.0.0.1:{base + COLLECTOR_OFFSET}",
                f"tcp://127.0.0.1:{base + PUBLISHER_OFFSET}",
                proc.pid,
                f"tcp://127.0.0.1:{base + SNAPSHOT_OFFSET}",
            )
        finally:
            proc.stop()
        return
    if kind not in TARGETS:
        raise ValueError(f"unknown target {kind!r}")
    base = free_base_port(2)
    p = _MP.Process(target=_proxy_main, args=(kind, base, base + 1), daemon=True)
    p.start()
    try:
        for port in (base, base + 1):
            if not wait_listening(port, deadline):
                raise RuntimeError(f"{kind} did not listen on {port}")
        assert p.pid is not None
        yield Target(kind, f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}", p.pid)
    finally:
        _reap([p], 0.0)


# --------------------------------------------------------------------------
# Profiling


class _Profiler:
    """``py-spy record`` on one pid for the duration of a ``with`` block."""

    def __init__(self, out_dir: Path | None, label: str, pid: int) -> None:
        self.out_dir, self.label, self.pid = out_dir, label, pid
        self.proc: subprocess.Popen[bytes] | None = None
        self.summary: dict[str, Any] | None = None
        self.path: Path | None = None

    def __enter__(self) -> _Profiler:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if self.out_dir is None:
            return self
        if not Path(exe).exists():
            log.warning("py-spy not found: pip install py-spy; not profiling %s", self.label)
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"{self.label}.txt"
        argv = [exe, "record", "--pid", str(self.pid), "--format", "raw", "--rate", "250"]
        argv += ["--nonblocking", "-o", str(self.path)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # let it attach before the clock starts
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.path is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self.path.exists():
            self.summary = summarise_profile(self.path)


def summarise_profile(path: Path, top: int = 15) -> dict[str, Any]:
    """Top functions by self and by total samples from a py-spy ``raw`` file."""
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    samples = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n_text = line.rpartition(" ")
        if not stack or not n_text.isdigit():
            continue
        n = int(n_text)
        frames = [_short_frame(f) for f in stack.split(";")[1:]]  # [0] is the process
        if not frames:
            continue
        samples += n
        self_c[frames[-1]] += n
        for f in set(frames):
            total_c[f] += n
    if not samples:
        return {"samples": 0, "self": [], "total": []}

    def pct(c: Counter[str]) -> list[list[Any]]:
        return [[f, round(100.0 * k / samples, 1)] for f, k in c.most_common(top)]

    return {"file": str(path), "samples": samples, "self": pct(self_c), "total": pct(total_c)}


def _short_frame(frame: str) -> str:
    """'handle (/x/clone/server/reactor.py:120)' -> 'handle (server/reactor.py)'."""
    name, _, where = frame.partition(" (")
    filename = where.rsplit(":", 1)[0].rstrip(")")
    parts = filename.replace("\\", "/").split("/")
    tail = "/".join(parts[-2:])
    return f"{name} ({tail})" if where else name


# --------------------------------------------------------------------------
# One traffic run: N watchers + one writer through a target


def _traffic(
    target: Target,
    mode: str,
    subscribers: int,
    expected: int,
    params: dict[str, Any],
    deadline_s: float,
    probes: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run a writer and ``subscribers`` subscribers through ``target``.

    ``probes`` of the subscribers are measuring watchers (one process each); the
    rest are C-level sinks in one more process (see :func:`_sink_main`).
    """
    sinks = max(0, subscribers - probes)
    subscribers -= sinks
    ready = _MP.Queue()
    results = _MP.Queue()
    go, stop = _MP.Event(), _MP.Event()
    idle_s = 3.0 if mode == "latency" else 1.5
    watchers = [
        _MP.Process(
            target=_watcher_main,
            args=(i, target.out_endpoint, mode, expected, idle_s, ready, results, stop),
            daemon=True,
        )
        for i in range(subscribers)
    ]
    writer = _MP.Process(
        target=_writer_main, args=(target.in_endpoint, mode, params, go, results), daemon=True
    )
    procs = [*watchers, writer]
    if sinks:
        sink = _MP.Process(target=_sink_main, args=(target.out_endpoint, sinks), daemon=True)
        sink.start()
        time.sleep(0.5)  # connected and subscribed before the measurement starts
        procs.append(sink)
    for p in [*watchers, writer]:
        p.start()
    try:
        seen: set[int] = set()
        end = time.monotonic() + 30
        while len(seen) < subscribers:
            try:
                seen.add(ready.get(timeout=max(0.01, end - time.monotonic())))
            except queue.Empty:
                raise RuntimeError(
                    f"{target.name}: only {len(seen)}/{subscribers} watchers got the warm-up"
                ) from None
        time.sleep(0.05)
        go.set()
        got: list[dict[str, Any]] = []
        end = time.monotonic() + deadline_s
        while len(got) < subscribers + 1:
            try:
                got.append(results.get(timeout=max(0.01, end - time.monotonic())))
            except queue.Empty:
                stop.set()
                end = time.monotonic() + 5  # let the watchers report what they have
                with contextlib.suppress(queue.Empty):
                    while len(got) < subscribers + 1:
                        got.append(results.get(timeout=max(0.01, end - time.monotonic())))
                break
    finally:
        stop.set()
        _reap([*watchers, writer])
        _reap(procs, 0.0)
    writer_res = next((r for r in got if r["role"] == "writer"), None)
    if writer_res is None:
        raise RuntimeError(f"{target.name}: the writer did not report")
    return writer_res, sorted((r for r in got if r["role"] == "watcher"), key=lambda r: r["idx"])


def _throughput_once(
    cfg: BenchConfig, group: ProcessGroup, kind: str, subs: int, rep: int
) -> dict[str, Any]:
    n = cfg.throughput_messages
    with _running_target(kind, group, cfg.server_heartbeat_ms) as target:
        label = f"throughput-{kind}-{subs}sub"
        profile_dir = cfg.profile_dir if kind == "clone" and rep == 0 else None
        with _Profiler(profile_dir, label, target.pid) as prof:
            writer, watchers = _traffic(
                target,
                "throughput",
                subs,
                n,
                {"messages": n, "value_size": cfg.value_size},
                deadline_s=60 + n / 1000,
                probes=cfg.probes,
            )
    rates = [
        w["received"] / (w["last"] - writer["t_start"])
        for w in watchers
        if w["received"] and w["last"] > writer["t_start"]
    ]
    run: dict[str, Any] = {
        "received_min": min((w["received"] for w in watchers), default=0),
        "probes": len(watchers),
        "delivered": round(sum(w["received"] for w in watchers) / (n * len(watchers)), 4),
        "rate": round(min(rates)) if rates else 0,
        "writer_enqueue_rate": round(n / max(1e-9, writer["t_enqueued"] - writer["t_start"])),
    }
    if prof.summary:
        run["profile"] = prof.summary
    return run


def run_throughput(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Messages/s received per subscriber, for each target and subscriber count.

    Each combination runs ``repeats`` times, the targets interleaved, so that a
    burst of other work on the machine hits all of them alike; the median counts.
    """
    combos = [(kind, subs) for subs in cfg.subscriber_counts for kind in cfg.throughput_targets]
    reps: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in combos}
    for rep in range(cfg.repeats):
        for kind, subs in combos:
            one = _throughput_once(cfg, group, kind, subs, rep)
            reps[(kind, subs)].append(one)
            say(
                f"  throughput {kind:>12} {subs:>2} sub: {one['rate']:>8,} msg/s per subscriber"
                f" (delivered {one['delivered']:.1%})"
                + (f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else "")
            )
    runs: list[dict[str, Any]] = []
    for (kind, subs), ones in reps.items():
        rates = [o["rate"] for o in ones]
        run: dict[str, Any] = {
            "target": kind,
            "subscribers": subs,
            "messages": cfg.throughput_messages,
            "probes": ones[0]["probes"],
            "received_min": min(o["received_min"] for o in ones),
            "delivered": min(o["delivered"] for o in ones),
            "rate_median": round(statistics.median(rates)),
            "rate_min": min(rates),
            "rate_max": max(rates),
            "rates": rates,
            "writer_enqueue_rate": round(statistics.median(o["writer_enqueue_rate"] for o in ones)),
        }
        profile = next((o["profile"] for o in ones if "profile" in o), None)
        if profile:
            run["profile"] = profile
        runs.append(run)
    # Our throughput as a fraction of each ceiling, same subscriber count.
    by = {(r["target"], r["subscribers"]): r["rate_median"] for r in runs}
    ratios: dict[str, float] = {}
    for subs in cfg.subscriber_counts:
        ours = by.get(("clone", subs))
        for ceiling in ("c-proxy", "py-forwarder"):
            theirs = by.get((ceiling, subs))
            if ours is not None and theirs:
                ratios[f"{subs}sub_vs_{ceiling}"] = round(ours / theirs, 3)
    return {"runs": runs, "ratios": ratios}


def _latency_once(
    cfg: BenchConfig, group: ProcessGroup, kind: str, rate: int, subs: int, rep: int
) -> dict[str, Any]:
    with _running_target(kind, group, cfg.server_heartbeat_ms) as target:
        label = f"latency-{kind}-{rate}-{subs}sub"
        profiled = kind == "clone" and rate == max(cfg.rates) and rep == 0
        with _Profiler(cfg.profile_dir if profiled else None, label, target.pid) as prof:
            count = max(1, int(rate * cfg.rate_seconds))
            writer, watchers = _traffic(
                target,
                "latency",
                subs,
                count,
                {"rate": rate, "seconds": cfg.rate_seconds, "value_size": cfg.value_size},
                deadline_s=cfg.rate_seconds + 60,
                probes=cfg.probes,
            )
    merged = LatencyHistogram()
    for w in watchers:
        merged.merge(LatencyHistogram.decode(w["hist"]))
    lag = LatencyHistogram.decode(writer["lag"])
    run: dict[str, Any] = {
        "target": kind,
        "rate": rate,
        "subscribers": subs,
        "seconds": cfg.rate_seconds,
        "sent": writer["sent"],
        "received_min": min((w["received"] for w in watchers), default=0),
        "probes": len(watchers),
        "lost": writer["sent"] * len(watchers) - sum(w["received"] for w in watchers),
        "latency": merged.summary(),
        "writer_lag": lag.summary(),
        "distribution": merged.distribution(),
    }
    if prof.summary:
        run["profile"] = prof.summary
    return run


def run_latency(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Latency percentiles at fixed offered rates, measured from the intended send time.

    With ``repeats`` > 1 every (target, rate, subscribers) runs that many times,
    interleaved; the run with the median p99 is reported in full and every
    repeat's percentiles are kept (``repeats``), so a disturbed run shows.
    """
    plan: list[tuple[str, int, int]] = []
    for kind in cfg.latency_targets:
        plan += [(kind, rate, 1) for rate in cfg.rates]
        if cfg.multi_subs > 1:
            plan.append((kind, cfg.multi_sub_rate, cfg.multi_subs))
    reps: dict[tuple[str, int, int], list[dict[str, Any]]] = {p: [] for p in plan}
    for rep in range(cfg.repeats):
        for kind, rate, subs in plan:
            one = _latency_once(cfg, group, kind, rate, subs, rep)
            reps[(kind, rate, subs)].append(one)
            lat = one["latency"]
            say(
                f"  latency {kind:>8} {rate:>6}/s {subs:>2} sub: p50 {lat['p50_ms']:.3f} "
                f"p99 {lat['p99_ms']:.3f} p99.9 {lat['p99_9_ms']:.3f} max {lat['max_ms']:.3f} ms"
                f" (lost {one['lost']}, writer lag p99 {one['writer_lag']['p99_ms']:.3f})"
                + (f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else "")
            )
    runs: list[dict[str, Any]] = []
    for ones in reps.values():
        ranked = sorted(ones, key=lambda o: o["latency"]["p99_ms"])
        run = dict(ranked[(len(ranked) - 1) // 2])
        run["lost"] = sum(o["lost"] for o in ones)
        run["repeats"] = [
            {k: o["latency"][k] for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")}
            | {"writer_lag_p99_ms": o["writer_lag"]["p99_ms"]}
            for o in ones
        ]
        profile = next((o["profile"] for o in ones if "profile" in o), None)
        if profile:
            run["profile"] = profile
        runs.append(run)
    return {"runs": runs}


# --------------------------------------------------------------------------
# Snapshots and memory


def _rss(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def _load_keys(ctx: zmq.Context[Any], target: Target, n: int, size: int) -> float:
    """Set keys ``/bench/snap/0000000`` .. in the server; seconds until all applied."""
    done = ctx.socket(zmq.SUB)
    done.setsockopt(zmq.SUBSCRIBE, _DONE_PREFIX)
    done.connect(target.out_endpoint)
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.connect(target.in_endpoint)
    time.sleep(0.2)
    body = b"s" * size
    t0 = time.monotonic()
    send = pub.send_multipart
    prefix = _SNAP_SUBTREE.encode()
    for i in range(n):
        send([prefix + b"%07d" % i, _ZERO_SEQ, _uuid(i), b"", body])
    # A sentinel after the keys: when it comes back, every key before it is applied.
    # Resent until seen, because the first one may precede our subscription.
    deadline = time.monotonic() + 60 + n / 2000
    k = 0
    try:
        while time.monotonic() < deadline:
            send(_kvset(_DONE_PREFIX + str(k).encode(), b"d", (1 << 41) + k))
            k += 1
            if done.poll(500):
                done.recv_multipart()
                return time.monotonic() - t0
        raise RuntimeError(f"loading {n} keys did not finish in time")
    finally:
        pub.close(linger=0)
        done.close(linger=0)


def _raw_snapshot(
    ctx: zmq.Context[Any], endpoint: str, subtree: str, timeout: float, *, batched: bool = False
) -> dict[str, Any]:
    """ICANHAZ? until KTHXBAI on a raw DEALER, counting entries.

    The receive loop is as cheap as pyzmq allows (no-copy frames, ``Frame.more``
    instead of a RCVMORE getsockopt per frame, ~3.5 us per entry here), so that
    the requester is not what limits the serve time.  ``batched`` asks for our
    KVBATCH extension (entries counted from each batch's key lengths frame).
    """
    dealer = ctx.socket(zmq.DEALER)
    dealer.rcvhwm = 0
    if batched:
        dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
    dealer.connect(endpoint)
    try:
        t0 = time.monotonic()
        dealer.send_multipart([b"ICANHAZ?", subtree.encode()])
        count = 0
        first = 0.0
        recv = dealer.recv
        deadline = t0 + timeout
        while True:
            try:
                head = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not dealer.poll(max(1, int(remaining * 1000))):
                    return {"complete": False, "entries": count, "seconds": None}
                continue
            frame = head
            entries = 1
            if frame.more:
                frame = recv(zmq.NOBLOCK, copy=False)
                if head.bytes == KVBATCH:
                    entries = len(frame) // 4  # the key lengths: 4 bytes per entry
            while frame.more:
                frame = recv(zmq.NOBLOCK, copy=False)
            if head.bytes == KTHXBAI:
                t1 = time.monotonic()
                return {
                    "complete": True,
                    "entries": count,
                    "seconds": round(t1 - t0, 4),
                    "first_entry_s": round(first - t0, 4) if count else None,
                }
            if count == 0:
                first = time.monotonic()
            count += entries
    finally:
        dealer.close(linger=0)


def _client_sync(endpoint: str, subtree: str, timeout: float) -> dict[str, Any]:
    """Time a real clone.Clone from construction to wait_synced()."""
    try:
        from clone import Clone
    except ImportError:
        return {"available": False}
    t0 = time.monotonic()
    with Clone([endpoint], subtree=subtree, command_timeout=30.0) as client:
        try:
            client.wait_synced(timeout)
        except CloneError as exc:
            return {"available": True, "seconds": None, "error": str(exc)}
        t1 = time.monotonic()
        # status() rather than items(): listing a million entries through the
        # agent's command pipe is not what is measured here.
        keys = client.status().keys
    return {"available": True, "seconds": round(t1 - t0, 4), "keys": keys}


def _max_gap(times: Sequence[float], start: float, end: float) -> float:
    """The longest silence between HUGZ that overlaps [start, end]."""
    if not times:
        return end - start
    gap = 0.0
    for a, b in itertools.pairwise(times):
        if b >= start and a <= end:
            gap = max(gap, b - a)
    if times[-1] < end:  # silence at the end is a gap too
        gap = max(gap, end - times[-1])
    return gap


def run_snapshot(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Serve and sync times per store size, with the heartbeat gap meanwhile."""
    runs: list[dict[str, Any]] = []
    hb = cfg.snapshot_heartbeat_ms / 1000.0
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        for n in cfg.snapshot_sizes:
            try:
                run = _snapshot_one(cfg, group, ctx, n)
            except Exception as exc:  # keep the other sizes
                log.exception("snapshot of %d keys failed", n)
                say(f"  snapshot {n:>9,} keys: FAILED: {exc}")
                runs.append({"keys": n, "error": repr(exc)})
                continue
            runs.append(run)
            sync = run["client_sync"]
            sync_text = f"{sync['seconds']}s" if sync.get("available") else "n/a"
            say(
                f"  snapshot {n:>9,} keys: served {run['serve_s']}s "
                f"(complete={run['serve_complete']}), batched {run['serve_batched_s']}s, "
                f"client sync {sync_text}, "
                f"max HUGZ gap {run['hugz_max_gap_s']}s (heartbeat {hb}s), "
                f"{run['bytes_per_key']} B/key"
            )
    finally:
        ctx.term()
    return {"runs": runs}


def _snapshot_one(
    cfg: BenchConfig, group: ProcessGroup, ctx: zmq.Context[Any], n: int
) -> dict[str, Any]:
    hb = cfg.snapshot_heartbeat_ms / 1000.0
    with _running_target("clone", group, cfg.snapshot_heartbeat_ms) as target:
        time.sleep(0.3)
        rss0 = _rss(target.pid)
        load_s = _load_keys(ctx, target, n, cfg.value_size)
        time.sleep(0.3)
        rss1 = _rss(target.pid)
        ready, results, stop = _MP.Queue(), _MP.Queue(), _MP.Event()
        hugz = _MP.Process(
            target=_watcher_main,
            args=(0, target.out_endpoint, "hugz", 0, 3600.0, ready, results, stop),
            daemon=True,
        )
        hugz.start()
        try:
            ready.get(timeout=15)
            windows: list[tuple[float, float]] = []
            serves: list[dict[str, Any]] = []
            batched: list[dict[str, Any]] = []
            with _Profiler(cfg.profile_dir, f"snapshot-{n}", target.pid) as prof:
                for _ in range(cfg.snapshot_repeats):
                    for out, batch in ((serves, False), (batched, True)):
                        t0 = time.monotonic()
                        out.append(
                            _raw_snapshot(
                                ctx, target.snapshot_endpoint, _SNAP_SUBTREE, 60, batched=batch
                            )
                        )
                        windows.append((t0, time.monotonic()))
                        time.sleep(hb)
                t0 = time.monotonic()
                sync = _client_sync(target.snapshot_endpoint, _SNAP_SUBTREE, 120)
                windows.append((t0, time.monotonic()))
            time.sleep(hb * 1.5)
            stop.set()
            hugz_times = results.get(timeout=15)["hugz"]
        finally:
            stop.set()
            _reap([hugz])
    gaps = [_max_gap(hugz_times, a, b) for a, b in windows]
    ok_serves = [s for s in serves if s["complete"] and s["entries"] == n]
    ok_batched = [s for s in batched if s["complete"] and s["entries"] == n]
    run: dict[str, Any] = {
        "keys": n,
        "load_s": round(load_s, 3),
        "load_rate": round(n / load_s),
        "rss_before": rss0,
        "rss_after": rss1,
        "bytes_per_key": round((rss1 - rss0) / n, 1),
        "serve_s": min((s["seconds"] for s in ok_serves), default=None),
        "serve_all": serves,
        "serve_complete": len(ok_serves) == len(serves) and len(ok_batched) == len(batched),
        # Our KVBATCH extension, as our own client asks for it.
        "serve_batched_s": min((s["seconds"] for s in ok_batched), default=None),
        "serve_batched_all": batched,
        "client_sync": sync,
        "heartbeat_s": hb,
        "hugz_max_gap_s": round(max(gaps), 4) if gaps else None,
        "hugz_max_gap_during_sync_s": round(gaps[-1], 4),
        "hugz_missed": bool(gaps) and max(gaps) > 1.5 * hb,
    }
    if prof.summary:
        run["profile"] = prof.summary
    return run


def run_memory(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Server RSS per key after loading keys with 100-byte values."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with _running_target("clone", group, cfg.server_heartbeat_ms) as target:
            time.sleep(0.3)
            rss0 = _rss(target.pid)
            load_s = _load_keys(ctx, target, cfg.memory_keys, cfg.value_size)
            time.sleep(0.5)
            rss1 = _rss(target.pid)
    finally:
        ctx.term()
    per_key = (rss1 - rss0) / cfg.memory_keys
    say(
        f"  memory: {cfg.memory_keys:,} keys of {cfg.value_size} B: "
        f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, {per_key:.0f} B/key"
    )
    return {
        "keys": cfg.memory_keys,
        "value_size": cfg.value_size,
        "rss_empty": rss0,
        "rss_loaded": rss1,
        "bytes_per_key": round(per_key, 1),
        "load_rate": round(cfg.memory_keys / load_s),
    }


# --------------------------------------------------------------------------
# The run


def cpu_pressure() -> float | None:
    """Linux PSI: % of the last 10 s in which some task waited for a CPU."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(line.split()[1].partition("=")[2])
    return None


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = ""
    with contextlib.suppress(Exception):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "platform": platform.platform(),
        "commit": commit,
        # Other work on the machine skews every number: record how busy it was.
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "cpu_pressure_at_start": cpu_pressure(),
    }


_RUNNERS: dict[str, Callable[[BenchConfig, ProcessGroup, Say], dict[str, Any]]] = {
    "throughput": run_throughput,
    "latency": run_latency,
    "snapshot": run_snapshot,
    "memory": run_memory,
}


def run_benchmarks(
    cfg: BenchConfig, say: Say | None = None, command: str = ""
) -> dict[str, Any]:
    """Run the configured sections; the results as one JSON-able dict."""
    say = say or log.info
    results: dict[str, Any] = {
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "sections": {},
    }
    with ProcessGroup(cfg.log_dir) as group:
        for section in cfg.sections:
            say(f"[{section}]")
            t0 = time.monotonic()
            try:
                results["sections"][section] = _RUNNERS[section](cfg, group, say)
            except Exception as exc:  # one broken section must not lose the others
                log.exception("section %s failed", section)
                say(f"  {section} FAILED: {exc}")
                results.setdefault("errors", {})[section] = repr(exc)
                continue
            results["sections"][section]["elapsed_s"] = round(time.monotonic() - t0, 1)
            # CPU pressure includes our own processes; far above what the section
            # itself causes, it means someone else was using the machine.
            results["sections"][section]["cpu_pressure_at_end"] = cpu_pressure()
            results["sections"][section]["loadavg_at_end"] = [
                round(x, 2) for x in os.getloadavg()
            ]
    results["targets"] = evaluate_targets(results)
    return results


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and met / missed."""
    out: list[dict[str, Any]] = []
    s = results["sections"]

    def add(name: str, value: Any, limit: str, met: bool | None) -> None:
        out.append({"target": name, "value": value, "limit": limit, "met": met})

    if "throughput" in s:
        for key, ratio in s["throughput"]["ratios"].items():
            if key.endswith("vs_c-proxy"):
                add(f"throughput {key.replace('_', ' ')}", ratio, ">= 0.5", ratio >= 0.5)
    if "latency" in s:
        for run in s["latency"]["runs"]:
            if run["target"] != "clone":
                continue
            lat = run["latency"]
            if run["rate"] == 2000 and run["subscribers"] == 1:
                add("latency 2k/s p99 ms", lat["p99_ms"], "<= 2", lat["p99_ms"] <= 2)
                add("latency 2k/s p99.9 ms", lat["p99_9_ms"], "<= 5", lat["p99_9_ms"] <= 5)
            if run["rate"] == 10_000 and run["subscribers"] >= 10:
                add(
                    f"latency 10k/s {run['subscribers']} sub p99 ms",
                    lat["p99_ms"],
                    "< 5",
                    lat["p99_ms"] < 5,
                )
    if "snapshot" in s:
        for run in s["snapshot"]["runs"]:
            if "error" in run:
                add(f"{run['keys']:,}-key snapshot ran", run["error"], "no error", False)
                continue
            if run["keys"] == 100_000:
                serve = run["serve_s"]
                add("100k snapshot served s", serve, "<= 0.5", serve is not None and serve <= 0.5)
            if run["keys"] == 1_000_000:
                sync = run["client_sync"].get("seconds")
                add("1M client sync s", sync, "<= 5", sync is not None and sync <= 5)
                add("1M no heartbeat missed", run["hugz_max_gap_s"], "gap <= 1.5 hb",
                    not run["hugz_missed"])
    return out


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(float(x)) for x in text.split(",") if x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Benchmark clone-server against libzmq's C proxy and a raw pyzmq forwarder.",
    )
    p.add_argument("sections", nargs="*", metavar="SECTION",
                   help=f"sections to run (default: all of {', '.join(SECTIONS)})")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds per section")
    p.add_argument("--out", type=Path, default=Path("results/bench.json"), help="JSON results")
    p.add_argument("--plot", type=Path, default=None, help="PNG of latency against rate")
    p.add_argument("--md", type=Path, default=None,
                   help="markdown file whose generated section gets the results table")
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for py-spy profiles of the server (needs py-spy)")
    p.add_argument(
        "--log-dir", type=Path, default=None, help="server logs (default: next to --out)"
    )
    p.add_argument("--messages", type=int, help="throughput: messages per run")
    p.add_argument("--subscribers", type=_ints, help="throughput: subscriber counts, e.g. 1,10")
    p.add_argument("--rates", type=_ints, help="latency: offered rates, e.g. 1000,2000,5000,10000")
    p.add_argument("--rate-seconds", type=float, help="latency: seconds per rate")
    p.add_argument("--snapshot-sizes", type=_ints, help="snapshot: key counts, e.g. 10000,100000")
    p.add_argument("--memory-keys", type=int, help="memory: keys to load")
    p.add_argument("--repeats", type=int,
                   help="throughput/latency: runs of each case, median reported (default 3)")
    p.add_argument("--probes", type=int,
                   help="measuring watcher processes per run (the other subscribers are C sinks)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    changes: dict[str, Any] = {}
    if args.sections:
        changes["sections"] = tuple(dict.fromkeys(args.sections))
    for arg, name in [
        ("messages", "throughput_messages"),
        ("subscribers", "subscriber_counts"),
        ("rates", "rates"),
        ("rate_seconds", "rate_seconds"),
        ("snapshot_sizes", "snapshot_sizes"),
        ("memory_keys", "memory_keys"),
        ("probes", "probes"),
        ("repeats", "repeats"),
    ]:
        value = getattr(args, arg)
        if value is not None:
            changes[name] = value
    changes["profile_dir"] = args.profile
    changes["log_dir"] = args.log_dir or args.out.parent / (args.out.stem + "-logs")
    return BenchConfig.quick(**changes) if args.quick else replace(BenchConfig(), **changes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [x for x in args.sections if x not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from clone.tools import report

    cfg = config_from_args(args)
    command = "scripts/bench " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"clone bench: sections {', '.join(cfg.sections)}{' (quick)' if args.quick else ''}",
          flush=True)
    results = run_benchmarks(cfg, say=lambda line: print(line, flush=True), command=command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print(report.bench_text(results))
    print(f"\nresults: {args.out}")
    if args.plot is not None and "latency" in results["sections"]:
        report.plot_latency(results, args.plot)
        print(f"plot: {args.plot}")
    if args.md is not None:
        report.update_markdown(args.md, report.bench_markdown(results))
        print(f"markdown: {args.md}")
    if results.get("errors"):
        print(f"FAILED sections: {', '.join(results['errors'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
