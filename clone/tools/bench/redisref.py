"""Redis with ``appendfsync always``: the durable reference of the durability section.

The durable-write target puts the durable server's latency next to Redis's every-write
fsync, measured in the same run on the same disk.  When ``redis-server`` is
installed (Debian: ``apt-get install redis-server``), each run starts a fresh
one (``--appendonly yes --appendfsync always``, no RDB snapshots, its AOF in
a fresh directory beside the clone servers' data) and a writer process
speaking RESP on a plain socket, so no Redis client library is needed.  When
it is not installed, the row is skipped with a message.

What is measured, and how it differs from the clone rows: Redis confirms a
write with the SET's reply, which it sends after the fsync of the event loop
turn that ran the command; so the writer measures each SET from its
**intended** send time to its reply (coordinated omission avoided as in the
latency section), and throughput as SETs confirmed per second.  A clone write
is confirmed by its KVPUB, which a watcher process times: one more process
hop than the Redis row pays.
"""

from __future__ import annotations

import contextlib
import select
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clone.tools.bench.processes import MP, reap
from clone.tools.histogram import LatencyHistogram
from clone.tools.procs import free_port, wait_listening

__all__ = ["REDIS_ALWAYS", "redis_latency_once", "redis_server", "redis_throughput_once"]

#: The mode name of the Redis row in the durability tables.
REDIS_ALWAYS = "redis-always"
_OK = b"+OK\r\n"


def redis_server() -> str | None:
    """The ``redis-server`` executable, or None when it is not installed."""
    return shutil.which("redis-server")


def _set_command(key: bytes, value: bytes) -> bytes:
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(key), key, len(value), value)


@contextlib.contextmanager
def _running_redis(exe: str, data_dir: Path) -> Iterator[int]:
    """A fresh ``redis-server`` with ``appendfsync always`` for the block; its port."""
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data_dir),
            "--protected-mode", "no", "--daemonize", "no", "--logfile", str(data_dir / "log")]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        if not wait_listening(port, time.monotonic() + 15):
            raise RuntimeError(f"redis-server did not listen on {port}")
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(data_dir, ignore_errors=True)


def redis_writer_main(port: int, mode: str, params: dict[str, Any], results: Any) -> None:
    """SETs through one connection: as fast as possible, or on a schedule; each
    reply is a confirmation.  Reports what :func:`_run` turns into a row."""
    size = int(params["value_size"])
    value = b"v" * size
    if mode == "throughput":
        n = int(params["messages"])
        cmds = [_set_command(b"/bench/t/%d" % (i % 10_000), value) for i in range(n)]
    else:
        rate, seconds = float(params["rate"]), float(params["seconds"])
        n = max(1, int(rate * seconds))
        cmds = [_set_command(b"/bench/l/%d" % (i % 1000), value) for i in range(n)]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    confirmed = 0
    pending = b""
    bad = 0

    def take(now: float, sink: list[float] | None) -> None:
        """Read what replies have arrived (non-blocking); stamp each with ``now``."""
        nonlocal confirmed, pending, bad
        try:
            data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        if not data:
            raise ConnectionError("redis-server closed the connection")
        data = pending + data
        whole, rest = divmod(len(data), len(_OK))
        pending = data[len(data) - rest:]
        bad += whole - data.count(_OK, 0, whole * len(_OK))
        if sink is not None:
            sink.extend([now] * whole)
        confirmed += whole

    mono = time.monotonic
    if mode == "throughput":
        t_start = mono()
        chunk = 500
        for at in range(0, n, chunk):
            sock.sendall(b"".join(cmds[at:at + chunk]))
            take(mono(), None)
        deadline = mono() + 60
        while confirmed < n and mono() < deadline:
            select.select([sock], [], [], 0.5)
            take(mono(), None)
        results.put({"t_start": t_start, "t_end": mono(), "sent": n, "confirmed": confirmed,
                     "bad": bad})
    else:
        interval = 1.0 / float(params["rate"])
        t0 = mono() + 0.2
        arrivals: list[float] = []
        lag = LatencyHistogram()
        for i, cmd in enumerate(cmds):
            intended = t0 + i * interval
            while True:
                delay = intended - mono()
                if delay <= 0:
                    break
                select.select([sock], [], [], delay)
                take(mono(), arrivals)
            sock.sendall(cmd)
            lag.record_seconds(mono() - intended)
            take(mono(), arrivals)
        deadline = mono() + 30
        while confirmed < n and mono() < deadline:
            select.select([sock], [], [], 0.5)
            take(mono(), arrivals)
        hist = LatencyHistogram()
        for i, arrived in enumerate(arrivals):
            hist.record_seconds(arrived - (t0 + i * interval))
        results.put({"sent": n, "confirmed": confirmed, "bad": bad, "hist": hist.encode(),
                     "lag": lag.encode()})
    sock.close()


def _run(exe: str, data_dir: Path, mode: str, params: dict[str, Any],
         timeout: float) -> dict[str, Any]:
    with _running_redis(exe, data_dir) as port:
        results = MP.Queue()
        p = MP.Process(target=redis_writer_main, args=(port, mode, params, results),
                       daemon=True)
        p.start()
        try:
            out: dict[str, Any] = results.get(timeout=timeout)
        finally:
            reap([p])
    if out["bad"]:
        raise RuntimeError(f"redis-server answered {out['bad']} SETs with something but +OK")
    return out


def redis_throughput_once(exe: str, data_dir: Path, messages: int,
                          value_size: int) -> dict[str, Any]:
    """SETs confirmed per second, pipelined through one connection."""
    out = _run(exe, data_dir, "throughput", {"messages": messages, "value_size": value_size},
               timeout=120 + messages / 500)
    elapsed = max(1e-9, out["t_end"] - out["t_start"])
    return {"rate": round(out["confirmed"] / elapsed),
            "delivered": round(out["confirmed"] / messages, 4)}


def redis_latency_once(exe: str, data_dir: Path, rate: int, seconds: float,
                       value_size: int) -> dict[str, Any]:
    """Each SET from its intended send time to its reply, at ``rate`` SETs/s."""
    out = _run(exe, data_dir, "latency",
               {"rate": rate, "seconds": seconds, "value_size": value_size},
               timeout=seconds + 90)
    return {
        "latency": LatencyHistogram.decode(out["hist"]).summary(),
        "writer_lag": LatencyHistogram.decode(out["lag"]).summary(),
        "lost": out["sent"] - out["confirmed"],
    }
