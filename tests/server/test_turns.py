"""The collector's drain deadline leaves room for the turn's commit (clone.server.turns)."""

from __future__ import annotations

import pytest

from clone.server.turns import TurnBudget


def test_without_history_the_drain_gets_the_whole_budget() -> None:
    assert TurnBudget(0.01).drain_until(100.0) == pytest.approx(100.01)


def test_a_commit_as_long_as_the_drain_halves_the_drain() -> None:
    turns = TurnBudget(0.01)
    for _ in range(60):  # converged
        turns.observe(drain_s=0.004, commit_s=0.004)
    assert turns.ratio == pytest.approx(1.0, rel=1e-3)
    assert turns.drain_until(0.0) == pytest.approx(0.005, rel=1e-3)


def test_a_slow_fsync_shortens_the_drain_and_a_cheap_one_lengthens_it_again() -> None:
    """A quiet durable server: one update per turn, the fsync dominates; then
    the load grows and the fixed cost is shared, so the turns lengthen."""
    turns = TurnBudget(0.01)
    for _ in range(30):
        turns.observe(drain_s=20e-6, commit_s=800e-6)  # one update, one fsync
    short = turns.drain_until(0.0)
    # Drain + the commit the ratio predicts stays within the budget.
    assert short * (1 + turns.ratio) == pytest.approx(0.01)
    assert short < 0.001
    for _ in range(30):
        turns.observe(drain_s=0.004, commit_s=0.002)  # many updates, one fsync shared
    assert turns.drain_until(0.0) > 0.006


def test_one_stalled_commit_cannot_pin_the_drain_to_nothing() -> None:
    turns = TurnBudget(0.01)
    turns.observe(drain_s=1e-6, commit_s=5.0)  # a stalled disk
    assert turns.drain_until(0.0) >= 0.01 / (1 + 50.0)
    for _ in range(20):
        turns.observe(drain_s=0.004, commit_s=0.001)
    assert turns.drain_until(0.0) > 0.007


def test_nonsense_times_are_ignored_and_a_budget_must_be_positive() -> None:
    turns = TurnBudget(0.01)
    turns.observe(drain_s=0.0, commit_s=0.01)
    turns.observe(drain_s=0.01, commit_s=-1.0)
    assert turns.ratio == 0.0
    with pytest.raises(ValueError):
        TurnBudget(0.0)
