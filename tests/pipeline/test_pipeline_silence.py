"""The snapshot reader's silence rule on a fake clock: handling time is not silence."""

from __future__ import annotations

import pytest

from clone.pipeline.snapshot import SilenceClock


def test_time_spent_handling_batches_is_not_silence() -> None:
    silence = SilenceClock(5.0, now=100.0)
    # Heard at 101, then 30 s spent handling 1,024 batches: the heartbeat that
    # arrived meanwhile is waiting, so the reader polls (for 0 s) and goes on.
    silence.heard(101.0)
    assert silence.left(131.0) < 0
    assert not silence.expired(131.0, waiting=True)
    silence.heard(131.0)  # it read the waiting message
    assert silence.left(131.0) == 5.0
    assert not silence.expired(135.9, waiting=False)
    assert silence.expired(136.0, waiting=False)


@pytest.mark.parametrize(
    ("heard", "now", "waiting", "expired"),
    [
        (None, 104.9, False, False),  # silent since the start, not for long
        (None, 105.0, False, True),  # silent for the whole timeout
        (None, 500.0, True, False),  # something waits: never silent
        (103.0, 107.9, False, False),  # counted from the last message
        (103.0, 108.0, False, True),
        (90.0, 104.0, False, False),  # an older time never moves the clock back
    ],
)
def test_rule(heard: float | None, now: float, waiting: bool, expired: bool) -> None:
    silence = SilenceClock(5.0, now=100.0)
    if heard is not None:
        silence.heard(heard)
    assert silence.expired(now, waiting=waiting) is expired


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SilenceClock(0.0, now=0.0)
