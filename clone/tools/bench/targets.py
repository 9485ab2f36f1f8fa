"""The targets traffic goes through, one traffic run through a target, and loading keys.

A target is a real ``clone-server --standalone``, libzmq's C proxy or a trivial
pyzmq forwarder (see :mod:`clone.tools.bench`); every section runs through
:func:`running_target`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from clone.tools.bench.config import TARGETS
from clone.tools.bench.processes import (
    DONE_PREFIX,
    MP,
    SNAP_SUBTREE,
    ZERO_SEQ,
    ClientCurve,
    kvset,
    proxy_main,
    reader_main,
    reap,
    sink_main,
    uuid,
    watcher_main,
    writer_main,
)
from clone.tools.procs import (
    ManagedProcess,
    ProcessGroup,
    ServerAddress,
    free_base_port,
    server_argv,
    wait_listening,
)
from clone.wire.frames import cap_message_size, recv_frames
from clone.wire.protocol import COLLECTOR_OFFSET, PUBLISHER_OFFSET, SNAPSHOT_OFFSET

log = logging.getLogger(__name__)

__all__ = [
    "CurveOptions",
    "ServerOptions",
    "Target",
    "cpu_seconds",
    "final_stats",
    "server_summary",
    "load_keys",
    "rss",
    "running_target",
    "traffic",
]


@dataclass
class Target:
    """Something running that forwards KVSET-shaped traffic."""

    name: str
    in_endpoint: str
    out_endpoint: str
    pid: int
    snapshot_endpoint: str = ""
    #: How the writer, watchers and sinks connect: CURVE, or plain when None.
    curve: ClientCurve | None = None
    #: What the restricted reader (:attr:`CurveOptions.restricted`) counted, once stopped.
    restricted: dict[str, Any] | None = None
    #: A clone-server's counters as it logged them when stopped (its last
    #: ``stats: {json}`` line), once the ``with`` block of :func:`running_target` ends.
    server_stats: dict[str, Any] | None = None


@dataclass(frozen=True)
class CurveOptions:
    """A ``clone`` target with CURVE on every socket.

    The server gets ``--curve-secret``/``--clients`` (and ``--acl`` if given);
    the load generators connect as ``client``.  With ``restricted``, one more
    subscriber connects with that key for the target's whole life (its ACL
    lets it read ``restricted_read`` only), so that the server filters the
    stream and counts a view while the traffic runs.
    """

    server_secret: Path
    clients_dir: Path
    client: ClientCurve
    acl: Path | None = None
    restricted: ClientCurve | None = None
    restricted_read: tuple[bytes, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        acl = ("--acl", str(self.acl)) if self.acl is not None else ()
        return ("--curve-secret", str(self.server_secret), "--clients", str(self.clients_dir),
                *acl)


@dataclass(frozen=True)
class ServerOptions:
    """How a ``clone`` target keeps its state (in memory by default, or in ``data_dir``)
    and whether it speaks CURVE."""

    data_dir: Path | None = None
    extra: tuple[str, ...] = ()
    curve: CurveOptions | None = None

    @property
    def label(self) -> str:
        if self.data_dir is None:
            label = "in-memory"
        else:
            fsync = self.extra[self.extra.index("--fsync") + 1] if "--fsync" in self.extra else ""
            label = f"fsync-{fsync or 'batch'}"
        if self.curve is not None:
            label += "-curve-acl" if self.curve.acl is not None else "-curve"
        return label


#: Starts of a clone target whose ports another process took meanwhile.
_PORT_TRIES = 3


def _start_clone(
    group: ProcessGroup, opts: ServerOptions, heartbeat_ms: int | None, deadline: float
) -> tuple[ManagedProcess, int]:
    """A clone-server on free ports, and its base port.  Ports are free when
    drawn, not when bound: another process (a test, a benchmark, next to us)
    can take one meanwhile, and the server then exits at once with
    ``Address already in use``; it is started again on other ports."""
    for attempt in range(1, _PORT_TRIES + 1):
        base = free_base_port(3)
        name = f"clone-server-{len(group.procs)}"
        proc = group.add(
            name,
            server_argv(
                "standalone",
                ServerAddress(name, base),
                heartbeat_ms=heartbeat_ms,
                data_dir=opts.data_dir,
                extra=(*opts.extra, *(opts.curve.argv if opts.curve else ())),
            ),
        )
        offsets = (SNAPSHOT_OFFSET, PUBLISHER_OFFSET, COLLECTOR_OFFSET)
        while proc.alive and time.monotonic() < deadline:
            if all(wait_listening(base + off, time.monotonic() + 0.1) for off in offsets):
                break
        if proc.alive or "Address already in use" not in proc.log_text():
            return proc, base
        if attempt < _PORT_TRIES:
            log.warning("%s: port taken before it bound (%d..%d); other ports", name, base,
                        base + 2)
    return proc, base


@contextlib.contextmanager
def running_target(
    kind: str,
    group: ProcessGroup,
    heartbeat_ms: int | None = None,
    server: ServerOptions | None = None,
) -> Iterator[Target]:
    """A fresh target of ``kind`` for the ``with`` block, stopped after it.

    ``server`` applies to ``clone`` only: a durable server gets a fresh, empty
    ``data_dir`` (removed first if it exists).
    """
    deadline = time.monotonic() + 15
    if kind == "clone":
        opts = server or ServerOptions()
        if opts.data_dir is not None:
            shutil.rmtree(opts.data_dir, ignore_errors=True)
        proc, base = _start_clone(group, opts, heartbeat_ms, deadline)
        target = Target(
            kind,
            f"tcp://127.0.0.1:{base + COLLECTOR_OFFSET}",
            f"tcp://127.0.0.1:{base + PUBLISHER_OFFSET}",
            proc.pid,
            f"tcp://127.0.0.1:{base + SNAPSHOT_OFFSET}",
            curve=opts.curve.client if opts.curve else None,
        )
        try:
            for off in (SNAPSHOT_OFFSET, PUBLISHER_OFFSET, COLLECTOR_OFFSET):
                if not wait_listening(base + off, deadline):
                    raise RuntimeError(
                        f"clone-server did not listen on {base + off}:\n{proc.log_tail()}"
                    )
            if opts.curve is not None and opts.curve.restricted is not None:
                with _restricted_reader(target, opts.curve, proc.log_tail):
                    yield target
            else:
                yield target
        finally:
            proc.stop()
            target.server_stats = final_stats(proc.log_text())
            if opts.data_dir is not None:
                shutil.rmtree(opts.data_dir, ignore_errors=True)
        return
    if kind not in TARGETS:
        raise ValueError(f"unknown target {kind!r}")
    base = free_base_port(2)
    p = MP.Process(target=proxy_main, args=(kind, base, base + 1), daemon=True)
    p.start()
    try:
        for port in (base, base + 1):
            if not wait_listening(port, deadline):
                raise RuntimeError(f"{kind} did not listen on {port}")
        assert p.pid is not None
        yield Target(kind, f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}", p.pid)
    finally:
        reap([p], 0.0)



@contextlib.contextmanager
def _restricted_reader(
    target: Target, curve: CurveOptions, log_tail: Callable[[], str]
) -> Iterator[None]:
    """Run :func:`reader_main` through the block; its counts into ``target.restricted``."""
    assert curve.restricted is not None
    ready, stop, results = MP.Event(), MP.Event(), MP.Queue()
    p = MP.Process(
        target=reader_main,
        args=(target.out_endpoint, curve.restricted, curve.restricted_read, ready, stop, results),
        daemon=True,
    )
    p.start()
    try:
        if not ready.wait(15):
            raise RuntimeError(f"the restricted reader's CURVE handshake failed:\n{log_tail()}")
        time.sleep(0.1)  # its subscription reaches the server before the traffic starts
        yield
        stop.set()
        target.restricted = results.get(timeout=10)
    finally:
        stop.set()
        reap([p])


def traffic(
    target: Target,
    mode: str,
    subscribers: int,
    expected: int,
    params: dict[str, Any],
    deadline_s: float,
    probes: int,
    idle_s: float | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run a writer and ``subscribers`` subscribers through ``target``.

    ``probes`` of the subscribers are measuring watchers (one process each); the
    rest are C-level sinks in one more process (see :func:`sink_main`).  A
    watcher stops after ``idle_s`` seconds without a message (default 3 s for
    latency, 1.5 s for throughput).
    """
    sinks = max(0, subscribers - probes)
    subscribers -= sinks
    ready = MP.Queue()
    results = MP.Queue()
    go, stop = MP.Event(), MP.Event()
    if idle_s is None:
        idle_s = 3.0 if mode == "latency" else 1.5
    watchers = [
        MP.Process(
            target=watcher_main,
            args=(i, target.out_endpoint, mode, expected, idle_s, ready, results, stop,
                  target.curve),
            daemon=True,
        )
        for i in range(subscribers)
    ]
    writer = MP.Process(
        target=writer_main,
        args=(target.in_endpoint, mode, params, go, results, target.curve),
        daemon=True,
    )
    procs = [*watchers, writer]
    if sinks:
        sink = MP.Process(
            target=sink_main, args=(target.out_endpoint, sinks, target.curve), daemon=True
        )
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
        reap([*watchers, writer])
        reap(procs, 0.0)
    writer_res = next((r for r in got if r["role"] == "writer"), None)
    if writer_res is None:
        raise RuntimeError(f"{target.name}: the writer did not report")
    return writer_res, sorted((r for r in got if r["role"] == "watcher"), key=lambda r: r["idx"])



def final_stats(log_text: str) -> dict[str, Any] | None:
    """The counters of the last ``stats: {json}`` line of a server's log (a
    stopping server logs one), or None."""
    at = log_text.rfind("stats: {")
    if at < 0:
        return None
    line = log_text[at + len("stats: "):].split("\n", 1)[0]
    try:
        stats = json.loads(line)
    except ValueError:
        return None
    return stats if isinstance(stats, dict) else None


#: What a run keeps of a clone-server's final counters.
_SERVER_KEYS = ("sequence", "heartbeat_max_late_ms", "commits", "commit_write_us",
                "commit_sync_us", "commit_max_us")


def server_summary(target: Target) -> dict[str, Any]:
    """The final counters a run reports about a clone target (empty for the ceilings)."""
    stats = target.server_stats or {}
    return {k: stats[k] for k in _SERVER_KEYS if k in stats}


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) ``pid`` has used: its main thread's, its other threads'.

    For a clone-server the main thread runs the Python loop and the others are
    libzmq's I/O threads (framing, TCP, and CURVE's encryption).
    """
    import psutil

    main = other = 0.0
    for t in psutil.Process(pid).threads():
        if t.id == pid:
            main += t.user_time + t.system_time
        else:
            other += t.user_time + t.system_time
    return main, other


def rss(pid: int) -> int:
    """The resident set size of ``pid`` in bytes."""
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def load_keys(ctx: zmq.Context[Any], target: Target, n: int, size: int,
              chunk: int | None = None) -> float:
    """Set keys ``/bench/snap/0000000`` .. in the server; seconds until all applied.

    ``chunk``: wait for each ``chunk`` keys to be applied before sending more,
    so that the server's receive queue stays small (the memory section: a
    queue of a million messages leaves its high-water in the RSS).
    """
    done = ctx.socket(zmq.SUB)
    done.setsockopt(zmq.SUBSCRIBE, DONE_PREFIX)
    cap_message_size(done)
    done.connect(target.out_endpoint)
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.connect(target.in_endpoint)
    time.sleep(0.2)
    body = b"s" * size
    t0 = time.monotonic()
    send = pub.send_multipart
    prefix = SNAP_SUBTREE.encode()
    step = chunk or n
    k = 0
    try:
        for start in range(0, n, step):
            for i in range(start, min(n, start + step)):
                send([prefix + b"%07d" % i, ZERO_SEQ, uuid(i), b"", body])
            # A sentinel after the keys: when it comes back, every key before it is
            # applied.  Resent until seen, because the first one may precede our
            # subscription.
            deadline = time.monotonic() + 60 + step / 2000
            while True:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"loading {n} keys did not finish in time")
                send(kvset(DONE_PREFIX + str(k).encode(), b"d", (1 << 41) + k))
                k += 1
                if done.poll(500):
                    while done.poll(0):  # earlier sentinels of this chunk too
                        recv_frames(done)
                    break
        return time.monotonic() - t0
    finally:
        pub.close(linger=0)
        done.close(linger=0)
