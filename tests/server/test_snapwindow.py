"""The snapshot byte budget's accounting (clone.server.snapwindow), with explicit
sizes and trackers a test completes by hand: what libzmq may hold for one
requester and for all, when a message is tracked, and who loses a slot."""

from __future__ import annotations

import pytest

from clone.server.snapwindow import (
    FIRST_WINDOW,
    GROW_AFTER,
    RETRY_MAX,
    RETRY_MIN,
    SendWindow,
    SnapshotBudget,
    retry_delay,
    stalest,
)

KB = 1024
MB = 1024 * KB


class FakeTracker:
    def __init__(self) -> None:
        self.done = False


def _fill(window: SendWindow, size: int) -> list[FakeTracker]:
    """Send messages of ``size`` while the window allows; the trackers made."""
    made = []
    while window.may_send():
        tracker = FakeTracker() if window.track_next(size) else None
        if tracker is not None:
            made.append(tracker)
        window.sent(size, tracker)
    return made


def test_the_budget_gives_each_slot_an_equal_share() -> None:
    # A quarter for the shared snapshots' encoded messages, the rest in windows.
    budget = SnapshotBudget(64 * MB, 48)
    assert (budget.shared, budget.window) == (16 * MB, 1 * MB)
    assert budget.shared + budget.window * budget.max_snapshots == budget.total
    assert SnapshotBudget(10, 64).window == 1  # always one message
    with pytest.raises(ValueError):
        SnapshotBudget(0, 64)


def test_a_requester_that_reads_nothing_holds_at_most_its_first_window() -> None:
    window = SendWindow(1 * MB)
    assert window.window == FIRST_WINDOW
    trackers = _fill(window, 1 * KB)
    assert window.in_flight == FIRST_WINDOW
    assert not window.may_send()
    # The message that filled the window is tracked: a read opens it again.
    assert trackers and window.track_next(0) is True
    assert window.update() is False
    assert window.done_bytes == 0


def test_the_window_ends_on_a_tracked_message_so_a_reader_always_reopens_it() -> None:
    window = SendWindow(1 * MB, first=64 * KB)
    trackers = _fill(window, 1 * KB)
    # A quarter window between checkpoints: 4 trackers for 64 KiB of 1 KiB messages.
    assert len(trackers) == 4
    for t in trackers:
        t.done = True
    assert window.update() is True
    assert window.in_flight == 0 and window.done_bytes == 64 * KB
    assert window.settled
    # 64 KiB read could be the kernel's send buffer filling: no growth yet.
    assert window.window == 64 * KB


def _read_all(window: SendWindow, size: int) -> None:
    for t in _fill(window, size):
        t.done = True
    window.update()


def test_a_reader_past_what_the_kernel_could_take_gets_its_share() -> None:
    window = SendWindow(2 * MB)
    while window.done_bytes < GROW_AFTER:
        assert window.window == FIRST_WINDOW
        _read_all(window, 4 * KB)
    assert window.window == 2 * MB  # its share, no more
    _fill(window, 4 * KB)
    assert 2 * MB <= window.in_flight < 2 * MB + 4 * KB


def test_a_requester_proves_it_reads_past_what_the_kernel_could_take() -> None:
    # Proven: its host weighs as a reader's in the loop's slice (fairshare).
    window = SendWindow(1 * MB)
    _fill(window, 1 * KB)
    assert not window.proven  # sent, not read: what a non-reader's kernel takes
    window = SendWindow(1 * MB)
    while window.done_bytes < GROW_AFTER:
        assert not window.proven
        _read_all(window, 1 * KB)
    assert window.proven
    # Counted only once update() takes the completed checkpoints.
    other = SendWindow(8 * MB, first=8 * MB)
    trackers = _fill(other, 1 * MB)
    for t in trackers:
        t.done = True
    assert other.done_bytes == 0 and not other.proven
    other.update()
    assert other.proven


def test_a_reader_paced_by_its_full_pipe_shows_progress_with_a_large_window() -> None:
    """A reader's window grown to a 64 MiB share is tracked every 16 MiB; when
    its pipe (the high-water mark), not the window, stops the sends, the first
    message after the full pipe is tracked, so its reading shows at once
    (it used to show nothing for 16 MiB and was aborted as stalled)."""
    window = SendWindow(64 * MB, first=64 * MB)
    for _ in range(10):  # a pipe's worth, none tracked
        assert not window.track_next(4 * KB)
        window.sent(4 * KB)
    window.blocked()  # the eleventh found the pipe full
    assert window.track_next(4 * KB)
    tracker = FakeTracker()
    window.sent(4 * KB, tracker)
    assert not window.track_next(4 * KB)  # only the first after the full pipe
    assert not window.update()
    tracker.done = True  # the requester drained its pipe
    assert window.update() and window.done_bytes == 44 * KB


def test_a_full_pipe_right_after_a_checkpoint_adds_no_tracking() -> None:
    window = SendWindow(64 * MB, first=64 * MB)
    window.sent(4 * KB, FakeTracker())
    window.blocked()  # nothing untracked: the last message is a checkpoint already
    assert not window.track_next(4 * KB)


def test_checkpoints_complete_in_order_and_count_every_byte_before_them() -> None:
    window = SendWindow(1 * MB, first=16 * KB)
    trackers = _fill(window, 1 * KB)
    trackers[0].done = True
    window.update()
    assert window.done_bytes == 4 * KB
    trackers[2].done = True  # libzmq frees in order; a later one alone is not enough
    window.update()
    assert window.done_bytes == 4 * KB


def test_slow_start_stops_at_the_share() -> None:
    window = SendWindow(200 * KB, first=64 * KB)
    while window.window < 200 * KB:
        _read_all(window, 8 * KB)
    assert window.window == 200 * KB
    _fill(window, 8 * KB)
    assert window.in_flight < 200 * KB + 8 * KB
    assert not window.settled


def test_one_message_larger_than_the_window_still_goes_when_it_is_empty() -> None:
    window = SendWindow(1 * MB, first=64 * KB)
    assert window.may_send() and window.track_next(2 * MB)
    tracker = FakeTracker()
    window.sent(2 * MB, tracker)
    assert not window.may_send()
    tracker.done = True
    window.update()
    assert window.may_send() and window.in_flight == 0


def test_requesters_that_never_read_hold_their_first_window_and_one_message() -> None:
    windows = [SendWindow(1 * MB) for _ in range(200)]
    for w in windows:
        _fill(w, 60 * KB)
    assert sum(w.in_flight for w in windows) <= 200 * (FIRST_WINDOW + 60 * KB)


def test_all_streams_together_stay_within_the_budget_plus_one_message_each() -> None:
    budget = SnapshotBudget(64 * MB, 64)
    windows = [SendWindow(budget.window) for _ in range(64)]
    for w in windows:  # every requester reads until its window is at its share
        while w.window < budget.window:
            _read_all(w, 60 * KB)
        _fill(w, 60 * KB)  # and then stops reading
    assert all(w.window == budget.window for w in windows)
    total = sum(w.in_flight for w in windows)
    assert total <= budget.total + 64 * 60 * KB


def test_retry_delay_backs_off_for_a_requester_that_stopped_reading() -> None:
    assert retry_delay(0.0) == RETRY_MIN
    assert retry_delay(0.1) == pytest.approx(0.025)
    assert retry_delay(30.0) == RETRY_MAX


def test_stalest_picks_the_longest_unread_past_the_idle_time() -> None:
    progress = {"a": 10.0, "b": 9.0, "c": 9.5}
    assert stalest(progress, now=10.0, idle=0.25) == "b"
    assert stalest(progress, now=9.2, idle=0.25) is None
    assert stalest(progress, now=10.0, idle=0.25, exclude=["b"]) == "c"
