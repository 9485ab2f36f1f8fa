"""How long a standalone server takes from SIGTERM to its exit.

Starts COUNT standalone servers one after the other on loopback (forked from
this process, which has imported the server already, so only the run itself
is measured), waits until each accepts connections and half a second more,
sends SIGTERM and times until the process has exited.  Prints the times in
milliseconds, sorted.  Extra arguments go to every server, e.g.
``--in-memory`` (docs/benchmarks.md, "Stopping without waiting out a poll")::

    .venv/bin/python scripts/bench_stop.py 8
    .venv/bin/python scripts/bench_stop.py 8 --in-memory
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time

from clone.server import cli


def _free_port() -> int:
    """A base port whose next two are free too (snapshot, publisher, collector)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + 2 >= 65536:
            continue
        try:
            for port in (base + 1, base + 2):
                with socket.socket() as other:
                    other.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


def _one(args: list[str], workdir: str) -> float:
    port = _free_port()
    data = [] if "--in-memory" in args else ["--data-dir", os.path.join(workdir, f"data-{port}")]
    pid = os.fork()
    if pid == 0:  # the server
        log = os.open(os.path.join(workdir, f"server-{port}.log"), os.O_WRONLY | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.argv = ["clone-server", "--standalone", "--port", str(port), "--bind", "127.0.0.1",
                    *data, *args]  # fmt: skip
        try:
            cli.main()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                raise SystemExit(f"the server on port {port} did not start: see {workdir}") from exc
            time.sleep(0.02)
    time.sleep(0.5)  # serving and idle, as a test's server is at its teardown
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)
    return time.monotonic() - started


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    args = sys.argv[2:]
    with tempfile.TemporaryDirectory(prefix="clone-bench-stop-") as workdir:
        times = sorted(_one(args, workdir) * 1000 for _ in range(count))
    print(" ".join(f"{t:.1f}" for t in times), "ms", " ".join(args))


if __name__ == "__main__":
    main()
