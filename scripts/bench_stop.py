"""How long a server takes from SIGTERM to its exit.

Starts COUNT servers one after the other on loopback (forked from this
process, which has imported the server already, so only the run itself is
measured), waits until each serves and half a second more, sends SIGTERM and
times until the process has exited.  Prints the times in milliseconds,
sorted.  Extra arguments go to every server, e.g. ``--in-memory``
(docs/benchmarks.md, "Stopping without waiting out a poll")::

    .venv/bin/python scripts/bench_stop.py 8
    .venv/bin/python scripts/bench_stop.py 8 --in-memory

``--pair`` stops the *active* of a durable pair instead, whose passive hands
over first (clone.server.handover); ``--writes N`` keeps N KVSETs a second
going to both collectors meanwhile, so that the stop comes with writes in
flight; the passive's sequence at the end is checked against the active's
(docs/benchmarks.md, "The handover at a stop")::

    .venv/bin/python scripts/bench_stop.py 8 --pair --writes 2000
    .venv/bin/python scripts/bench_stop.py 8 --pair --writes 2000 --handover-timeout 0
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import threading
import time
import uuid

import zmq

from clone.server import cli
from clone.tools.procs import free_base_port, free_port, wait_listening


def _fork_server(workdir: str, name: str, argv: list[str]) -> int:
    log = os.open(os.path.join(workdir, f"{name}.log"), os.O_WRONLY | os.O_CREAT)
    pid = os.fork()
    if pid == 0:  # the server
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.argv = ["clone-server", "--bind", "127.0.0.1", *argv]
        try:
            cli.main()
        finally:
            os._exit(0)
    os.close(log)
    return pid


def _wait_for(what: str, check: object, pids: list[int], workdir: str) -> None:
    deadline = time.monotonic() + 30
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            raise SystemExit(f"{what} did not happen: see {workdir}")
        time.sleep(0.02)


def _one(args: list[str], workdir: str) -> float:
    port = free_base_port()
    data = [] if "--in-memory" in args else ["--data-dir", os.path.join(workdir, f"data-{port}")]
    pid = _fork_server(workdir, f"server-{port}", ["--standalone", "--port", str(port),
                                                    *data, *args])  # fmt: skip
    if not wait_listening(port, time.monotonic() + 30):
        os.kill(pid, signal.SIGKILL)
        raise SystemExit(f"the server on port {port} did not start: see {workdir}")
    time.sleep(0.5)  # serving and idle, as a test's server is at its teardown
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)
    return time.monotonic() - started


def _writer(ports: list[int], rate: int, stop: threading.Event) -> None:
    """KVSETs to both collectors at ``rate`` a second, in 10 ms batches."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    for port in ports:
        pub.connect(f"tcp://127.0.0.1:{port + 2}")
    n = 0
    per_tick = max(1, rate // 100)
    next_tick = time.monotonic()
    while not stop.is_set():
        for _ in range(per_tick):
            key = b"/bench/stop/%d" % (n % 1000)
            pub.send_multipart([key, bytes(8), uuid.uuid4().bytes, b"", b"v%d" % n])
            n += 1
        next_tick += 0.01
        time.sleep(max(0.0, next_tick - time.monotonic()))
    pub.close()
    ctx.term()


def _sequence(log: str, pattern: str) -> int | None:
    found = re.findall(pattern, log)
    return int(found[-1]) if found else None


def _one_pair(args: list[str], workdir: str, rate: int) -> tuple[float, int, str]:
    """SIGTERM to exit of a pair's active; how many updates the passive lacked; the
    active's handover line."""
    p, b = free_base_port(), free_base_port()
    p_ha, b_ha = free_port(), free_port()
    tag = f"pair-{p}"
    common = ["--heartbeat", "250"]
    primary = _fork_server(workdir, f"{tag}-primary", [
        "--primary", "--port", str(p), "--peer", f"127.0.0.1:{b}", "--ha-port", str(p_ha),
        "--peer-ha", f"127.0.0.1:{b_ha}", "--data-dir", os.path.join(workdir, f"{tag}-p"),
        *common, *args])  # fmt: skip
    backup = _fork_server(workdir, f"{tag}-backup", [
        "--backup", "--port", str(b), "--peer", f"127.0.0.1:{p}", "--ha-port", str(b_ha),
        "--peer-ha", f"127.0.0.1:{p_ha}", "--data-dir", os.path.join(workdir, f"{tag}-b"),
        *common, *args])  # fmt: skip
    logs = {n: os.path.join(workdir, f"{tag}-{n}.log") for n in ("primary", "backup")}

    def read(name: str) -> str:
        with open(logs[name], errors="replace") as f:
            return f.read()

    _wait_for("the backup's sync", lambda: "synced from" in read("backup"), [primary, backup],
              workdir)  # fmt: skip
    stop = threading.Event()
    writer = threading.Thread(target=_writer, args=([p, b], rate, stop), daemon=True)
    if rate:
        writer.start()
    time.sleep(1.0)  # the writes flowing, and the passive's rank heard
    started = time.monotonic()
    os.kill(primary, signal.SIGTERM)
    os.waitpid(primary, 0)
    took = time.monotonic() - started
    stop.set()
    if rate:
        writer.join()
    os.kill(backup, signal.SIGTERM)
    os.waitpid(backup, 0)
    ours = _sequence(read("primary"), r"stopping \(active, sequence (\d+)\)")
    theirs = _sequence(read("backup"), r"stopping \(passive, sequence (\d+)\)")
    lacked = -1 if ours is None or theirs is None else max(0, ours - theirs)
    line = re.findall(r"(handed over in [\d.]+ ms|stopping without a complete handover)",
                      read("primary"))  # fmt: skip
    return took, lacked, line[-1] if line else "no handover"


def main() -> None:
    argv = sys.argv[1:]
    count = int(argv.pop(0)) if argv and argv[0].isdigit() else 8
    pair = "--pair" in argv
    if pair:
        argv.remove("--pair")
    rate = 0
    if "--writes" in argv:
        i = argv.index("--writes")
        rate = int(argv[i + 1])
        del argv[i : i + 2]
    with tempfile.TemporaryDirectory(prefix="clone-bench-stop-") as workdir:
        if not pair:
            times = sorted(_one(argv, workdir) * 1000 for _ in range(count))
            print(" ".join(f"{t:.1f}" for t in times), "ms", " ".join(argv))
            return
        runs = [_one_pair(argv, workdir, rate) for _ in range(count)]
    times = sorted(t * 1000 for t, _, _ in runs)
    print(" ".join(f"{t:.1f}" for t in times), "ms", f"--pair --writes {rate}", " ".join(argv))
    print("passive lacked:", " ".join(str(n) for _, n, _ in runs))
    for _, _, line in runs:
        print("  ", line)


if __name__ == "__main__":
    main()
