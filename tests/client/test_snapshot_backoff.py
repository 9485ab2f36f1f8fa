"""Sync rounds that get no snapshot data make the next ones longer and their
re-asks rarer and spread (clone.client.backoff), on the state machine with a
fake clock and a fixed draw."""

from __future__ import annotations

import pytest

from clone.client.actions import RequestSnapshot
from clone.client.backoff import (
    REASK_GROWTH_MAX,
    REASK_JITTER,
    ROUND_GROWTH_MAX,
    reask_delay,
    round_window,
)
from clone.client.fsm import AgentFSM, State
from tests.client.test_agent_fsm import CFG, MemoryServer, feed_snapshot, snapshot_reply


@pytest.mark.parametrize(
    ("unanswered", "window", "reask"),
    [(0, 2.5, 0.25), (1, 5.0, 0.5), (2, 10.0, 1.0), (3, 10.0, 2.0), (4, 10.0, 2.0),
     (99, 10.0, 2.0)],
)
def test_the_round_and_its_reasks_grow_with_unanswered_rounds_up_to_a_cap(
    unanswered: int, window: float, reask: float
) -> None:
    assert round_window(2.5, unanswered) == pytest.approx(window)
    assert reask_delay(0.25, unanswered, lambda: 0.5) == pytest.approx(reask)
    assert window <= 2.5 * ROUND_GROWTH_MAX and reask <= 0.25 * REASK_GROWTH_MAX


def test_backed_off_reasks_are_spread_but_a_first_round_is_not() -> None:
    low, high = reask_delay(0.25, 1, lambda: 0.0), reask_delay(0.25, 1, lambda: 0.999999)
    assert low == pytest.approx(0.5 * (1 - REASK_JITTER))
    assert high == pytest.approx(0.5 * (1 + REASK_JITTER), rel=1e-5)
    # The first round asks as it always did, whatever the draw.
    assert reask_delay(0.25, 0, lambda: 0.0) == reask_delay(0.25, 0, lambda: 0.9) == 0.25


def _rounds(fsm: AgentFSM, until: float, step: float = 0.01) -> list[tuple[float, int]]:
    """Tick to ``until``; every request (time, server) the machine makes."""
    asked: list[tuple[float, int]] = []
    t = 0.0
    while t < until:
        t = round(t + step, 2)
        asked += [(t, a.server) for a in fsm.tick(t) if isinstance(a, RequestSnapshot)]
    return asked


def test_rounds_without_data_lengthen_and_a_completed_sync_resets_them() -> None:
    fsm = AgentFSM(None, CFG, now=0.0, draw=lambda: 0.5)
    fsm.connect("tcp://a:1", 0.0)
    fsm.connect("tcp://b:1", 0.0)
    asked = _rounds(fsm, 20.0)
    # Round ends (a request to the other server): 2.5, then 2.5 + 5, then + 10, + 10.
    switches = [t for (t, s), (_, before) in zip(asked[1:], asked, strict=False) if s != before]
    assert switches == pytest.approx([2.5, 7.5, 17.5])
    # Each round still asks at most requests_per_server times, less often when longer.
    on_first_long_round = [t for t, s in asked if 2.5 <= t < 7.5]
    assert len(on_first_long_round) == CFG.requests_per_server
    assert on_first_long_round[1] - on_first_long_round[0] == pytest.approx(0.5)
    # Served at last: the next failover's round is a first round again.
    assert fsm.current is not None
    feed_snapshot(fsm, MemoryServer(fsm.current), 20.0)
    assert fsm.state is State.ACTIVE
    actions = fsm.server_disconnected(fsm.current, 20.1)
    assert any(isinstance(a, RequestSnapshot) for a in actions)
    assert fsm.next_deadline() == pytest.approx(20.1 + CFG.reask_interval)
    assert fsm.silence_timeout() == pytest.approx(CFG.server_timeout)


def test_entries_that_keep_arriving_keep_a_long_snapshot_going() -> None:
    """Once snapshot data flows, each message extends the wait: a slow
    50,000-key snapshot is not abandoned while it streams."""
    fsm = AgentFSM(None, CFG, now=0.0, draw=lambda: 0.5)
    fsm.connect("tcp://a:1", 0.0)
    srv = MemoryServer(0)
    for n in range(40):
        srv.apply(f"k{n}", b"v")
    msgs = srv.snapshot("")
    t = 0.1
    snapshot_reply(fsm, 0, msgs[0], t)  # the first data: no more re-asks
    for msg in msgs[1:-1]:  # then one entry every 2 s, 80 s in all
        t += 2.0
        assert [a for a in fsm.tick(t) if isinstance(a, RequestSnapshot)] == []
        snapshot_reply(fsm, 0, msg, t)
    snapshot_reply(fsm, 0, msgs[-1], t + 2.0)
    assert fsm.state is State.ACTIVE and fsm.counters.failovers == 0
