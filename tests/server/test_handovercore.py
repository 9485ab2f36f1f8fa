"""The handover's table (clone.server.handovercore), alone: pure, no clock, no sockets."""

from __future__ import annotations

import pytest

from clone.server.handovercore import (
    TABLE,
    Action,
    Event,
    HandoverCore,
    PeerView,
    Phase,
    stop_event,
    watch_event,
)

LIVE = PeerView(active=True, peer_alive=True, peer_passive=True, peer_sequence=10)


def test_a_stop_with_a_live_ranked_passive_hands_over() -> None:
    assert stop_event(LIVE, 0.5) is Event.STOP_PAIRED


@pytest.mark.parametrize(
    ("view", "timeout"),
    [
        (None, 0.5),  # not paired
        (LIVE, 0.0),  # --handover-timeout 0
        (PeerView(active=False, peer_alive=True, peer_passive=True, peer_sequence=10), 0.5),
        (PeerView(active=True, peer_alive=False, peer_passive=True, peer_sequence=10), 0.5),
        (PeerView(active=True, peer_alive=True, peer_passive=False, peer_sequence=10), 0.5),
        (PeerView(active=True, peer_alive=True, peer_passive=True, peer_sequence=None), 0.5),
    ],
    ids=["unpaired", "disabled", "not-active", "peer-dead", "peer-not-passive", "peer-in-memory"],
)
def test_any_other_stop_is_done_at_once(view: PeerView | None, timeout: float) -> None:
    core = HandoverCore()
    assert core.handle(stop_event(view, timeout)) is Action.FINISH
    assert core.phase is Phase.DONE and not core.running


def test_the_whole_way_drain_announce_confirm() -> None:
    core = HandoverCore()
    assert core.handle(Event.STOP_PAIRED) is Action.HOLD_WRITES
    assert core.running and core.phase is Phase.DRAINING
    # The peer's sequence is not looked at before everything is published.
    assert core.handle(Event.CAUGHT_UP) is Action.NONE
    assert core.handle(Event.PUBLISHED) is Action.ANNOUNCE
    assert core.phase is Phase.CONFIRMING
    assert core.handle(Event.CAUGHT_UP) is Action.FINISH
    assert core.phase is Phase.DONE and core.last_event is Event.CAUGHT_UP
    # Late events change nothing.
    for event in Event:
        assert core.handle(event) is Action.NONE
    assert core.phase is Phase.DONE


@pytest.mark.parametrize("phase_events", [[], [Event.PUBLISHED]], ids=["draining", "confirming"])
@pytest.mark.parametrize("end", [Event.PEER_LOST, Event.TIMED_OUT, Event.ASKED_AGAIN])
def test_every_wait_ends(phase_events: list[Event], end: Event) -> None:
    core = HandoverCore()
    core.handle(Event.STOP_PAIRED)
    for event in phase_events:
        core.handle(event)
    assert core.handle(end) is Action.FINISH
    assert core.phase is Phase.DONE and core.last_event is end


def test_no_phase_but_done_is_a_dead_end() -> None:
    # Every waiting phase can be left by the deadline: a stop always ends.
    for phase in (Phase.DRAINING, Phase.CONFIRMING):
        assert TABLE[(phase, Event.TIMED_OUT)] == (Phase.DONE, Action.FINISH)
    assert not any(phase is Phase.DONE for phase, _ in TABLE)


@pytest.mark.parametrize(
    ("view", "ours", "expected"),
    [
        (LIVE, 10, Event.CAUGHT_UP),
        (LIVE, 9, Event.CAUGHT_UP),
        (LIVE, 11, None),
        (PeerView(active=True, peer_alive=False, peer_passive=True, peer_sequence=10), 11,
         Event.PEER_LOST),
        (PeerView(active=True, peer_alive=True, peer_passive=False, peer_sequence=10), 11,
         Event.PEER_LOST),
        (PeerView(active=False, peer_alive=True, peer_passive=True, peer_sequence=10), 11,
         Event.PEER_LOST),
        (PeerView(active=True, peer_alive=True, peer_passive=True, peer_sequence=None), 11,
         Event.PEER_LOST),
    ],
)
def test_watching_the_passive(view: PeerView, ours: int, expected: Event | None) -> None:
    assert watch_event(view, ours) is expected
