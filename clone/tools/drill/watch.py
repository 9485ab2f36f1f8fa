"""Watching a drill's server pair from the outside: who is active, what it holds.

How this works: only the active server of a Binary Star pair sends HUGZ, so a
thread subscribed to both servers' publishers (:class:`HugzMonitor`) knows at
any moment which one is active, and when both are.  :func:`raw_snapshot` asks a
server for its items with a bare ICANHAZ? (a passive does not answer), and
:func:`server_stats` makes a server log its stats line (SIGUSR1) and parses it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

from clone.tools.procs import ManagedProcess
from clone.wire.protocol import DEFAULT_MISSED_HEARTBEATS, HUGZ, KTHXBAI

__all__ = ["HugzMonitor", "raw_snapshot", "served_sequence", "server_stats", "subscribe_hugz"]

#: A subtree that holds no key: asking for it returns just the KTHXBAI.
_EMPTY_SUBTREE = "/drill-probe/nothing/"



def subscribe_hugz(
    ctx: zmq.Context[Any], poller: zmq.Poller, publishers: Iterable[tuple[str, str]]
) -> dict[zmq.Socket[Any], str]:
    """A SUB socket per ``(name, endpoint)`` publisher, subscribed to HUGZ
    only and registered with ``poller``; the server name of each socket."""
    names: dict[zmq.Socket[Any], str] = {}
    for name, endpoint in publishers:
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, HUGZ)
        sub.connect(endpoint)
        poller.register(sub, zmq.POLLIN)
        names[sub] = name
    return names


class HugzMonitor:
    """Listens to the HUGZ of both servers in a thread; HUGZ means 'I am active'."""

    def __init__(self, publishers: dict[str, str], heartbeat: float) -> None:
        self.publishers = publishers
        self.heartbeat = heartbeat
        self.history: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drill-hugz", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Safe before :meth:`start` and twice: a drill that failed before the
        pair was up stops it in a ``finally``, and must show that failure, not
        "cannot join thread before it is started"."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5)

    def _run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        poller = zmq.Poller()
        try:
            names = subscribe_hugz(ctx, poller, self.publishers.items())
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    with contextlib.suppress(zmq.Again):
                        while True:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                            if frames[0] == HUGZ:
                                with self._lock:
                                    self.history.append((time.time(), names[sock]))
        finally:
            ctx.destroy(linger=0)

    def active(self, at: float | None = None) -> list[str]:
        """Servers that sent HUGZ in the ``missed`` heartbeats before ``at`` (default
        now): the same window in which a client would still trust them."""
        at = time.time() if at is None else at
        window = DEFAULT_MISSED_HEARTBEATS * self.heartbeat
        with self._lock:
            return sorted({n for t, n in self.history if at - window <= t <= at})

    def hugz_after(self, name: str, t: float, until: float = math.inf) -> list[float]:
        with self._lock:
            return [ts for ts, n in self.history if n == name and t < ts < until]

    def dual_active_seconds(self, since: float) -> float:
        """How long, after ``since``, both servers were sending HUGZ."""
        with self._lock:
            hist = [(t, n) for t, n in self.history if t >= since]
        window = 1.5 * self.heartbeat
        last: dict[str, float] = {}
        dual = 0.0
        prev_t: float | None = None
        for t, n in hist:
            if prev_t is not None and len([x for x in last.values() if t - x <= window]) >= 2:
                dual += t - prev_t
            last[n] = t
            prev_t = t
        return dual


def raw_snapshot(endpoint: str, subtree: str, timeout: float) -> dict[str, bytes] | None:
    """The server's state under ``subtree``, or None if it does not answer (passive)."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(endpoint)
        dealer.send_multipart([b"ICANHAZ?", subtree.encode()])
        items: dict[str, bytes] = {}
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(int(remaining * 1000) + 1):
                return None
            frames = dealer.recv_multipart()
            if frames[0] == KTHXBAI:
                return items
            if len(frames) == 5 and frames[4]:
                items[frames[0].decode()] = frames[4]
    finally:
        ctx.destroy(linger=0)


def served_sequence(endpoint: str, timeout: float) -> int | None:
    """The sequence a server serves now (its KTHXBAI to a snapshot of nothing),
    or None if it does not answer (a passive does not)."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(endpoint)
        dealer.send_multipart([b"ICANHAZ?", _EMPTY_SUBTREE.encode()])
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(int(remaining * 1000) + 1):
                return None
            frames = dealer.recv_multipart()
            if frames[0] == KTHXBAI and len(frames) > 1:
                return int.from_bytes(frames[1], "big")
    finally:
        ctx.destroy(linger=0)


_STATS_RE = re.compile(r"stats: (\{.*\})\s*$")


def server_stats(proc: ManagedProcess, timeout: float = 2.0) -> dict[str, Any]:
    """Ask a running server for its stats line (SIGUSR1) and parse it from the log.

    The line is ``stats: {json}`` with every counter and gauge of
    ``CloneServer.stats()``; ``alive`` is added.
    """
    if not proc.alive:
        return {"alive": False}
    before = len(proc.log_path.read_text(errors="replace").splitlines())
    proc.signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = proc.log_path.read_text(errors="replace").splitlines()[before:]
        for line in lines:
            m = _STATS_RE.search(line)
            if m:
                try:
                    stats = json.loads(m.group(1))
                except ValueError:
                    continue  # a line cut short while being written: read it again
                out: dict[str, Any] = {"alive": True, **stats}
                return out
        time.sleep(0.05)
    return {"alive": True}
