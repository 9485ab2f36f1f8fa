"""The server's own CPU cost per published update, for before/after comparisons.

Usage: ``python scripts/examples/server_cpu_per_update.py TREE [N]``, where TREE
is a checkout with its own ``.venv`` (a clean clone of each version to compare).
It starts a standalone ``clone-server`` of that tree on free loopback ports,
sends N KVSETs (default 100,000) from one raw PUB, waits for every KVPUB, and
prints the rate and the server process's CPU time (user + system) per update.
CPU time is what the server spent, whatever the sender or the machine's other
load did to the wall time; run the trees alternately, several times each.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import zmq


def _free_base_port() -> int:
    """A port P with P+1 and P+2 also free (the server binds all three)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port + 2 < 65536 and all(_free(port + i) for i in (1, 2)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def main(tree: Path, count: int) -> None:
    port = _free_base_port()
    module = "clone.server.cli" if (tree / "clone" / "server").is_dir() else "clone.server_cli"
    argv = [str(tree / ".venv/bin/python"), "-m", module, "--standalone", "--port", str(port),
            "--bind", "127.0.0.1"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    server = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"/t/")
        sub.rcvhwm = 0
        sub.connect(f"tcp://127.0.0.1:{port + 1}")
        pub = ctx.socket(zmq.PUB)
        pub.sndhwm = 0
        pub.connect(f"tcp://127.0.0.1:{port + 2}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until a write comes back
            pub.send_multipart([b"/t/warm", bytes(8), os.urandom(16), b"", b"x"])
            if sub.poll(200):
                sub.recv_multipart()
                break
        else:
            raise SystemExit("the server never answered")
        time.sleep(0.3)
        while sub.poll(0):
            sub.recv_multipart()
        msgs = [[b"/t/%d" % (i % 1000), bytes(8), os.urandom(16), b"", b"x" * 64]
                for i in range(count)]  # fmt: skip
        proc = psutil.Process(server.pid)
        cpu0 = _cpu(proc)
        t0 = time.perf_counter()
        for m in msgs:
            pub.send_multipart(m)
        got = 0
        while got < count and sub.poll(5000):
            sub.recv_multipart()
            got += 1
        wall = time.perf_counter() - t0
        cpu = _cpu(proc) - cpu0
        print(
            f"{tree}: {got}/{count} in {wall:.3f} s = {got / wall:,.0f}/s; "
            f"server cpu {cpu:.2f} s = {cpu / max(got, 1) * 1e6:.1f} us/update"
        )
    finally:
        ctx.destroy(linger=0)
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 100_000)
