"""The heartbeat goes on when the wall clock steps: real zmq sockets on 127.0.0.1.

Tornado's ``IOLoop.time()`` is the wall clock (``time.time``). The heartbeat
used to be scheduled on it with ``call_at``: after a step back of 30 s the next
tick was 30 s away, and after a step of an hour forward and back it was an
hour away. In chaos run seed 7 (docs/drills.md, "Chaos") that silenced the
primary's state messages after its clock-step fault, and the backup, the loser
of the next split brain, never heard it and stayed active until the run ended.

Here the wall clock of the test process (both servers) is stepped with
``time.time`` patched, as libfaketime steps it for a server in the chaos run;
the monotonic clock goes on. Each server must keep publishing at the heartbeat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import zmq
from tornado.ioloop import IOLoop

from bstar import BinaryStar, State
from tests.support.ports import free_ports

A, S = State.ACTIVE, State.PASSIVE
HEARTBEAT, MISSED = 0.1, 10  # expiry 1 s: no false expiry on a busy machine
# Generous for a busy machine, far below the 30 s or 3600 s a stalled tick waits.
DEADLINE = 8.0
#: State messages that must arrive after a step: a second's worth of heartbeats.
MESSAGES = 10


async def _until(predicate: Callable[[], bool], what: str, stars: list[BinaryStar]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        if time.monotonic() > deadline:
            details = "\n  ".join(f"{star!r} counters={star.counters}" for star in stars)
            pytest.fail(f"timed out after {DEADLINE} s waiting for {what}:\n  {details}")
        await asyncio.sleep(0.01)


async def _both_keep_publishing(stars: list[BinaryStar], what: str) -> None:
    """Each server hears ``MESSAGES`` more state messages from the other."""
    base = [star.counters.state_messages_received for star in stars]
    await _until(
        lambda: all(
            star.counters.state_messages_received >= seen + MESSAGES
            for star, seen in zip(stars, base, strict=True)
        ),
        f"{MESSAGES} state messages each way {what}",
        stars,
    )


@pytest.mark.parametrize(
    "steps",
    [pytest.param((-30.0,), id="back-30s"), pytest.param((3600.0, 0.0), id="forward-1h-and-back")],
)
def test_the_heartbeat_survives_a_wall_clock_step(
    ctx: zmq.Context, loop: IOLoop, monkeypatch: pytest.MonkeyPatch, steps: tuple[float, ...]
) -> None:
    real_time = time.time
    offset = [0.0]
    monkeypatch.setattr(time, "time", lambda: real_time() + offset[0])

    async def scenario() -> None:
        pa, pb = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
        primary = BinaryStar(ctx, loop, True, pa, pb, heartbeat=HEARTBEAT, missed=MISSED)
        backup = BinaryStar(ctx, loop, False, pb, pa, heartbeat=HEARTBEAT, missed=MISSED)
        stars = [primary, backup]
        try:
            backup.start()
            primary.start()
            await _until(lambda: (primary.state, backup.state) == (A, S), "A/S", stars)
            await _both_keep_publishing(stars, "before the step")
            for step in steps:
                offset[0] = step
                await _both_keep_publishing(stars, f"after the wall clock moved to {step:+.0f} s")
            assert (primary.state, backup.state) == (A, S)
            assert primary.peer_alive and backup.peer_alive
            assert primary.counters.fsm.peer_expirations == 0
            assert backup.counters.fsm.peer_expirations == 0
        finally:
            primary.stop()
            backup.stop()

    loop.run_sync(scenario, timeout=60.0)
