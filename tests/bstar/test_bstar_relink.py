"""A subscriber to the peer that hears nothing is replaced: real zmq sockets on 127.0.0.1.

Chaos run seed 7 (docs/drills.md, "Chaos") ended with both servers active for
67 s: after a cut of the Binary Star link the primary, elected later (epoch 38),
heard the backup (ACTIVE, epoch 37) and kept serving, but the backup's
subscriber never delivered another message from the primary, so the backup,
the one that had to step down, never learnt it had lost. Whatever layer stays
stuck (a TCP connect in backed-off SYN retries, the subscription, the stream),
the connection looks alive to libzmq, which therefore never reconnects.

Here the backup's subscriber is made deaf the same way, with its TCP connection
up: its subscription is withdrawn, so the primary's publisher sends it nothing.
The tests assert that the backup replaces its subscriber after
``RELINK_AFTER`` silent heartbeats, hears the primary again, and that the
split brain of the chaos run then heals.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import zmq
from tornado.ioloop import IOLoop

from bstar import BinaryStar, State
from bstar.reactor import RELINK_AFTER
from tests.support.ports import free_ports

A, S = State.ACTIVE, State.PASSIVE
HEARTBEAT, MISSED = 0.1, 2
# Generous for a busy machine: the relink itself comes after RELINK_AFTER * HEARTBEAT.
DEADLINE = 10.0


async def _until(predicate: Callable[[], bool], what: str, stars: list[BinaryStar]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        if time.monotonic() > deadline:
            details = "\n  ".join(f"{star!r} counters={star.counters}" for star in stars)
            pytest.fail(f"timed out after {DEADLINE} s waiting for {what}:\n  {details}")
        await asyncio.sleep(0.005)


def _deafen(star: BinaryStar) -> None:
    """Withdraw the subscription of ``star``'s subscriber: its connection stays
    up (ZMTP heartbeats flow) but no state message reaches it."""
    sub = star._sub
    assert sub is not None
    sub.socket.setsockopt(zmq.UNSUBSCRIBE, b"")


def _undeafen(star: BinaryStar) -> None:
    sub = star._sub
    assert sub is not None
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"")


def _pair(ctx: zmq.Context, loop: IOLoop) -> tuple[BinaryStar, BinaryStar]:
    pa, pb = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    primary = BinaryStar(ctx, loop, True, pa, pb, heartbeat=HEARTBEAT, missed=MISSED)
    backup = BinaryStar(ctx, loop, False, pb, pa, heartbeat=HEARTBEAT, missed=MISSED)
    return primary, backup


async def _vote_until_active(star: BinaryStar, stars: list[BinaryStar]) -> None:
    await _until(lambda: star.accept_vote() and star.state is A, f"{star!r} active", stars)


def test_a_deaf_subscriber_is_replaced_and_the_peer_heard_again(
    ctx: zmq.Context, loop: IOLoop
) -> None:
    async def scenario() -> None:
        primary, backup = _pair(ctx, loop)
        stars = [primary, backup]
        try:
            backup.start()
            primary.start()
            await _until(lambda: (primary.state, backup.state) == (A, S), "A/S", stars)
            assert backup.counters.relinks == 0, "a healthy link is never replaced"
            received = backup.counters.state_messages_received
            _deafen(backup)
            deafened_at = time.monotonic()
            await _until(lambda: backup.counters.relinks >= 1, "the backup's relink", stars)
            assert time.monotonic() - deafened_at >= (RELINK_AFTER - 1) * HEARTBEAT
            await _until(
                lambda: backup.counters.state_messages_received > received and backup.peer_alive,
                "the backup hearing the primary again",
                stars,
            )
            assert primary.counters.relinks == 0, "the primary heard the backup all along"
            assert (primary.state, backup.state) == (A, S)
        finally:
            primary.stop()
            backup.stop()

    loop.run_sync(scenario, timeout=30.0)


def test_the_loser_of_a_split_brain_that_cannot_hear_the_winner_steps_down(
    ctx: zmq.Context, loop: IOLoop
) -> None:
    """The chaos run's shape: the backup goes active (epoch 2) while deaf, the
    primary is elected after it (epoch 3) and hears it: only the backup can end
    the split brain, and it must hear the primary to do so."""

    async def scenario() -> None:
        primary, backup = _pair(ctx, loop)
        stars = [primary, backup]
        try:
            backup.start()
            primary.start()
            await _until(lambda: (primary.state, backup.state) == (A, S), "A/S", stars)
            _deafen(backup)
            await _until(lambda: not backup.peer_alive, "the backup's expiry of the primary", stars)
            await _vote_until_active(backup, stars)
            assert backup.epoch == 2
            await _until(lambda: primary.state is S, "the primary stepping down", stars)
            # The primary is cut off in turn, elected, and then hears the backup.
            _deafen(primary)
            await _until(lambda: not primary.peer_alive, "the primary's expiry", stars)
            await _vote_until_active(primary, stars)
            assert primary.epoch == 3
            _undeafen(primary)
            await _until(
                lambda: (primary.state, backup.state) == (A, S),
                "the backup (epoch 2) stepping down before the primary (epoch 3)",
                stars,
            )
            assert backup.counters.relinks >= 1
            assert backup.counters.fsm.split_brain_count >= 1
        finally:
            primary.stop()
            backup.stop()

    loop.run_sync(scenario, timeout=30.0)
