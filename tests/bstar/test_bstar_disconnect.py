"""Fast failover on a lost connection: real zmq sockets on 127.0.0.1, DEFAULT timing.

The pair runs at the default heartbeat (1 s) and missed count (2), where the
heartbeat alone declares a dead peer 2 s after it was last heard. Stopping a
server closes its sockets, which is what its peer sees when the process dies:
the TCP connection to its publisher closes at once. The tests assert what the
backup does about it (the vote it accepts or refuses, its state, its counters),
each with a deadline that is generous for the machine yet well inside the 2 s the
heartbeat would need, so that only the disconnect can explain the outcome.

Every socket made in the context is tracked and must be closed by the end of the
test (the monitor sockets included), and the context must then terminate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import pytest
import zmq
from tornado.ioloop import IOLoop

from bstar import BinaryStar, State
from tests.support.ports import free_ports
from tests.support.tracking import TrackingContext

A, S = State.ACTIVE, State.PASSIVE
HEARTBEAT, MISSED = 1.0, 2  # the defaults, spelled out so the arithmetic is visible
SETTLE_DEADLINE = 2.5  # pair up: the backup's first heartbeat can be lost (slow joiner)
# How long the disconnect may take to reach the backup. Generous for loopback (it
# takes milliseconds) but shorter than the 1 s by which the heartbeat rule lags.
DISCONNECT_DEADLINE = 0.5


def _run(loop: IOLoop, scenario: Callable[[], Awaitable[None]]) -> None:
    loop.run_sync(scenario, timeout=10.0)


class _Pair:
    """A primary and a backup on loopback at default timing; closes both at the end."""

    def __init__(self, ctx: zmq.Context, loop: IOLoop, *, fast_failover: bool = True) -> None:
        pa, pb = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
        self.stars: list[BinaryStar] = []
        self.fired: dict[str, list[str]] = {}
        self.backup = self.make(ctx, loop, False, pb, pa, fast_failover)
        self.primary = self.make(ctx, loop, True, pa, pb, fast_failover)

    def make(
        self, ctx: zmq.Context, loop: IOLoop, primary: bool, local: str, peer: str, fast: bool
    ) -> BinaryStar:
        star = BinaryStar(
            ctx, loop, primary, local, peer, heartbeat=HEARTBEAT, missed=MISSED, fast_failover=fast
        )
        fired = self.fired.setdefault("primary" if primary else "backup", [])
        star.on_active(lambda: fired.append("active"))
        star.on_passive(lambda: fired.append("passive"))
        self.stars.append(star)
        return star

    def describe(self) -> str:
        return "\n  ".join(
            f"{star!r} alive={star.peer_alive} fired={self.fired} counters={star.counters}"
            for star in self.stars
        )

    async def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout} s waiting for {what}:\n  {self.describe()}")
            await asyncio.sleep(0.005)

    async def settle(self) -> None:
        """Start both (backup first) and wait for primary ACTIVE, backup PASSIVE."""
        self.backup.start()
        self.primary.start()
        await self.wait_until(
            lambda: (
                (self.primary.state, self.backup.state) == (A, S)
                and self.backup.last_peer_contact is not None
            ),
            "primary ACTIVE, backup PASSIVE",
            SETTLE_DEADLINE,
        )
        assert self.backup.peer_alive

    def close(self) -> None:
        for star in self.stars:
            star.stop()


def test_backup_fails_over_on_the_first_vote_after_the_primary_is_gone(
    ctx: zmq.Context, loop: IOLoop, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        pair = _Pair(ctx, loop)
        try:
            await pair.settle()
            backup = pair.backup
            assert backup.fast_failover
            assert backup.counters.peer_connects >= 1
            assert not backup.accept_vote(), "the primary lives: the vote is refused"

            pair.primary.stop()  # closes its publisher: the TCP connection closes
            stopped_at = time.monotonic()
            await pair.wait_until(
                lambda: backup.counters.peer_disconnects >= 1,
                "the backup to see the connection close",
                DISCONNECT_DEADLINE,
            )
            assert not backup.peer_alive
            assert backup.state is S, "a lost connection alone must not make the backup active"
            voted_at = time.monotonic()
            contact = backup.last_peer_contact
            assert contact is not None
            heartbeat_expiry = contact + MISSED * HEARTBEAT
            assert voted_at < heartbeat_expiry, "the heartbeat alone would still refuse"
            assert backup.accept_vote(voted_at)
            assert voted_at - stopped_at < DISCONNECT_DEADLINE + 0.1
            assert backup.state is A and backup.epoch == 2
            assert pair.fired["backup"] == ["passive", "active"]
            counters = backup.counters
            assert counters.peer_disconnects == 1
            assert counters.fsm.votes_accepted == 1 and counters.fsm.votes_refused == 1
            assert counters.fsm.peer_expirations == 1, "the loss counts as the expiry"
        finally:
            pair.close()

    _run(loop, scenario)
    lost = [r for r in caplog.records if "peer connection lost" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelno == logging.INFO
    # The expiry was reported with the loss; the next heartbeat must not repeat it.
    assert not [r for r in caplog.records if "presumed dead (" in r.getMessage()]


def test_without_fast_failover_the_vote_waits_for_the_heartbeat(
    ctx: zmq.Context, loop: IOLoop
) -> None:
    async def scenario() -> None:
        pair = _Pair(ctx, loop, fast_failover=False)
        try:
            await pair.settle()
            backup = pair.backup
            assert not backup.fast_failover
            pair.primary.stop()
            # Long enough for a disconnect to have been seen, were it watched.
            await asyncio.sleep(0.3)
            now = time.monotonic()
            assert now < backup.peer_expiry, "the heartbeat has not expired the primary yet"
            assert backup.peer_alive
            assert not backup.accept_vote(now)
            assert backup.state is S
            assert backup.counters.peer_disconnects == backup.counters.peer_connects == 0
            assert backup.counters.fsm.peer_expirations == 0
        finally:
            pair.close()

    _run(loop, scenario)


def test_restarted_peer_is_heard_again_and_the_loss_is_forgotten(
    ctx: zmq.Context, loop: IOLoop
) -> None:
    """After a loss, a new process at the peer endpoint reconnects; its state
    messages put expiry back on the heartbeat."""

    async def scenario() -> None:
        pair = _Pair(ctx, loop)
        try:
            await pair.settle()
            backup = pair.backup
            connects = backup.counters.peer_connects
            pair.primary.stop()
            await pair.wait_until(
                lambda: backup.counters.peer_disconnects == 1, "the loss", DISCONNECT_DEADLINE
            )
            assert not backup.peer_alive
            # The primary comes back as a new instance at the same endpoint. The
            # backup, passive behind an active primary that lost its state, takes
            # over when it hears it (that rule is the table's, not the loss's).
            restarted = pair.make(
                ctx, loop, True, pair.primary.local_endpoint, pair.primary.peer_endpoint, True
            )
            restarted.start()
            await pair.wait_until(
                lambda: backup.counters.peer_connects > connects, "the reconnection", 1.0
            )
            await pair.wait_until(
                lambda: (restarted.state, backup.state) == (S, A),
                "backup ACTIVE, primary PASSIVE",
                2.5,
            )
            assert backup.peer_alive
            assert backup.peer_expiry > time.monotonic()
            assert pair.fired["backup"] == ["passive", "active"]
        finally:
            pair.close()

    _run(loop, scenario)


def test_stop_closes_the_monitor_and_a_stopped_star_ignores_the_loss(
    ctx: TrackingContext, loop: IOLoop
) -> None:
    async def scenario() -> None:
        pair = _Pair(ctx, loop)
        try:
            await pair.settle()
            pairs = [s for s in ctx.made if s.type == zmq.PAIR]
            # Per started star: one on the peer subscription, one on our publisher.
            assert len(pairs) == 4, "two monitor sockets per started star"
            pair.backup.stop()
            pair.primary.stop()
            assert all(s.closed for s in ctx.made)
            await asyncio.sleep(0.05)  # any event still in flight finds nobody
            assert pair.backup.counters.peer_disconnects == 0
            pair.backup.stop()  # idempotent, monitor included
        finally:
            pair.close()

    _run(loop, scenario)
