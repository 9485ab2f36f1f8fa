"""The pair link connects again when libzmq gives up: real zmq sockets on 127.0.0.1.

libzmq reconnects a SUB after a connection error, but after a protocol error
(the socket at the other end is of an incompatible type) it drops the endpoint
for good.  A primary whose peer's publishing port answered for another program
when it first connected (another server's CHP ROUTER, on a busy test machine)
never heard the backup that bound the port a moment later: the suite's pair
start waited 60 s for "now ACTIVE".  Here a ROUTER squats the backup's
publishing port while the primary starts, then leaves, and the backup starts
there: the primary must hear it and the pair must form, with or without fast
failover.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import zmq
from tornado.ioloop import IOLoop
from zmq.utils.monitor import parse_monitor_message

from bstar import BinaryStar, State
from tests.support.ports import free_ports, port_is_free

HEARTBEAT, MISSED = 0.1, 4  # the test servers' timing
#: Only bounds a hang: the repair comes within 0.25 s of the lost connection.
CEILING = 30.0


async def _until(check: Callable[[], bool], what: str, timeout: float = CEILING) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-failover", "heartbeat-only"])
def test_a_primary_that_first_met_another_socket_type_hears_the_backup(
    ctx: zmq.Context, loop: IOLoop, fast: bool
) -> None:
    pa_port, pb_port = free_ports(2)
    pa, pb = f"tcp://127.0.0.1:{pa_port}", f"tcp://127.0.0.1:{pb_port}"
    squatter = ctx.socket(zmq.ROUTER)
    squatter.setsockopt(zmq.LINGER, 0)
    events = squatter.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    squatter.bind(pb)
    stars: list[BinaryStar] = []

    def star(primary: bool, local: str, peer: str) -> BinaryStar:
        made = BinaryStar(
            ctx, loop, primary, local, peer, heartbeat=HEARTBEAT, missed=MISSED, fast_failover=fast
        )
        stars.append(made)
        return made

    seen: list[int] = []

    def squatter_saw(event: int) -> bool:
        while events.poll(0):
            seen.append(parse_monitor_message(events.recv_multipart())["event"])
        return event in seen

    async def scenario() -> None:
        primary = star(True, pa, pb)
        primary.start()
        # The primary's SUB met the ROUTER and libzmq closed the connection.
        await _until(lambda: squatter_saw(zmq.EVENT_DISCONNECTED), "the failed handshake")
        assert zmq.EVENT_ACCEPTED in seen
        squatter.disable_monitor()
        events.close(linger=0)
        squatter.close(linger=0)
        # libzmq's I/O thread closes the listener a moment after close().
        await _until(lambda: port_is_free(pb_port), "the squatter's port to be free")
        backup = star(False, pb, pa)
        backup.start()
        await _until(
            lambda: (primary.state, backup.state) == (State.ACTIVE, State.PASSIVE),
            "primary ACTIVE, backup PASSIVE",
        )
        assert primary.counters.peer_reconnects >= 1
        assert primary.counters.state_messages_received >= 1

    try:
        loop.run_sync(scenario, timeout=CEILING + 10)
    finally:
        for s in stars:
            s.stop()
        events.close(linger=0)
        squatter.close(linger=0)
