"""A Binary Star link socket under the pressure of zeromq/libzmq#3937, in a process of its own.

    python -m tests.support.link_pressure --seconds 5 [--rcvhwm N]

A PUB floods a SUB set up as bstar sets up its link (``bstar.reactor.keep_alive``:
ZMTP heartbeats), whose reader stalls, then drains, again and again.  With a
bounded receive pipe libzmq stops reading the stalled connection, the ZMTP
heartbeat kills it, and the reconnection aborts the process (``Assertion
failed: _input_stopped (src/stream_engine_base.cpp:396)``, SIGABRT), usually
within a second.  ``--rcvhwm N`` sets a bound after bstar's options, to show
that the hazard is there; without it the process must live and exit 0.
A fast heartbeat (50 ms x 3) and a 10 ms reconnection make the cycles many.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import zmq

from bstar.link import keep_alive


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rcvhwm", type=int, default=None)
    args = parser.parse_args()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.linger = 0
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def flood() -> None:
        body = b"x" * 100
        while not stop.is_set():
            for _ in range(200):
                pub.send(body)
            time.sleep(0.001)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    keep_alive(sub, 0.05, 3)
    if args.rcvhwm is not None:
        sub.rcvhwm = args.rcvhwm
    sub.reconnect_ivl = 10
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    received = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        time.sleep(0.2)  # a stalled loop: the pipe fills
        while sub.poll(0):
            sub.recv()
            received += 1
    stop.set()
    flooder.join()
    sub.close()
    pub.close()
    ctx.term()
    print(f"received {received} messages", flush=True)
    return 0 if received else 1


if __name__ == "__main__":
    sys.exit(main())
