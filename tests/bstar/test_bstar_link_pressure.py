"""zeromq/libzmq#3937 on the Binary Star link: a stalled reader, a flooding peer, ZMTP heartbeats.

The combination that aborted a backup under a bulk load (the Spark pipeline's) is a
connection with ZMTP heartbeats whose input libzmq stopped because the
receive pipe was full.  bstar's link sockets take no receive limit, so the
input never stops; the control run, the same with libzmq's default limit,
shows the test drives the pressure that aborts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from bstar.link import keep_alive

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.link_pressure", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_link_sockets_have_heartbeats_and_no_receive_limit() -> None:
    ctx = zmq.Context()
    try:
        for kind in (zmq.PUB, zmq.SUB):
            sock = ctx.socket(kind)
            keep_alive(sock, 0.25, 4)
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 250
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 1000
            assert sock.getsockopt(zmq.RCVHWM) == 0
            sock.close(linger=0)
    finally:
        ctx.term()


@pytest.mark.slow
def test_a_stalled_link_under_a_flood_lives() -> None:
    done = _run("--seconds", "5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "received" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    zmq.zmq_version_info() > (4, 3, 5),
    reason="libzmq newer than 4.3.5 may have fixed zeromq/libzmq#3937 (its #4830): the control "
    "would not abort",
)
def test_the_same_pressure_with_a_bounded_pipe_aborts_in_libzmq() -> None:
    """The control: libzmq's default receive limit (1000), same flood, same stalls
    (libzmq 4.3.5, the one pyzmq 27 ships, aborts within a second here)."""
    done = _run("--seconds", "60", "--rcvhwm", "1000")
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "_input_stopped" in done.stderr
