"""The commit double buffer's gate (clone.server.gathering), alone: the table,
the bounds, and what it asks of the sockets.  Pure: no clock, no sockets."""

from __future__ import annotations

import pytest

from clone.server.gathering import (
    GATHER_BYTES,
    GATHER_ROWS,
    TABLE,
    Gate,
    GateAction,
    GateEvent,
    GateState,
)


class _Sockets:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def gate(self, **bounds: int) -> Gate:
        return Gate(lambda: self.calls.append("pause"), lambda: self.calls.append("resume"),
                    **bounds)  # fmt: skip


def test_the_table_covers_every_state_and_event() -> None:
    assert set(TABLE) == {(s, e) for s in GateState for e in GateEvent}


@pytest.mark.parametrize(("state", "event"), sorted(TABLE, key=lambda p: (p[0].value, p[1].value)))
def test_each_pair_moves_and_acts_as_the_table_says(state: GateState, event: GateEvent) -> None:
    sockets = _Sockets()
    gate = sockets.gate()
    gate.state = state
    want_state, want_action = TABLE[(state, event)]
    assert gate.handle(event) is want_action
    assert gate.state is want_state
    expected = [] if want_action is GateAction.NONE else [want_action.value]
    assert sockets.calls == expected


def test_a_failed_commit_is_final() -> None:
    """Fail-stop: nothing is read again, whatever lands or ends afterwards."""
    sockets = _Sockets()
    gate = sockets.gate()
    gate.handle(GateEvent.FAILED)
    for event in GateEvent:
        gate.handle(event)
    assert gate.state is GateState.STOPPED and sockets.calls == ["pause"]


def test_the_loop_reads_on_until_the_gathering_passes_a_bound() -> None:
    sockets = _Sockets()
    gate = sockets.gate(max_bytes=1000, max_rows=10)
    assert gate.turn_ended(in_flight=True, nbytes=1000, rows=10) is GateAction.NONE
    assert gate.turn_ended(in_flight=True, nbytes=1001, rows=1) is GateAction.PAUSE
    assert gate.state is GateState.FULL and gate.pauses == 1
    # Timers' turns while paused: still full, no second pause.
    assert gate.turn_ended(in_flight=True, nbytes=2000, rows=11) is GateAction.NONE
    assert gate.handle(GateEvent.LANDED) is GateAction.RESUME
    assert gate.turn_ended(in_flight=True, nbytes=10, rows=11) is GateAction.PAUSE
    assert gate.pauses == 2
    assert sockets.calls == ["pause", "resume", "pause"]


def test_without_a_commit_in_flight_nothing_gathers_to_pause_for() -> None:
    """A turn's end with nothing in flight hands its changes to the writer at once."""
    sockets = _Sockets()
    gate = sockets.gate(max_bytes=1, max_rows=1)
    assert gate.turn_ended(in_flight=False, nbytes=10**9, rows=10**6) is GateAction.NONE
    assert sockets.calls == [] and gate.state is GateState.READING


def test_a_landing_while_reading_changes_nothing() -> None:
    sockets = _Sockets()
    gate = sockets.gate()
    assert gate.handle(GateEvent.LANDED) is GateAction.NONE and sockets.calls == []


def test_the_bounds_are_positive_and_documented() -> None:
    with pytest.raises(ValueError):
        Gate(max_bytes=0)
    with pytest.raises(ValueError):
        Gate(max_rows=0)
    gate = Gate()
    assert (gate.max_bytes, gate.max_rows) == (GATHER_BYTES, GATHER_ROWS) == (4 << 20, 8192)
