"""The split of a late heartbeat's wait: the loop's work, the CPU queue, the rest."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from clone.ratelimit import Throttle
from clone.server.config import ServerConfig
from clone.server.lateness import (
    IntervalSplit,
    LoopSample,
    ThreadCounters,
    parse_major_faults,
    parse_schedstat,
    split_interval,
)
from clone.server.shared import IO_COUNTERS, Shared
from clone.server.timers import Timers


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("220750424 92199349 1541\n", (0.220750424, 0.092199349)),
        ("0 0 1", (0.0, 0.0)),
        ("5 7", (5e-9, 7e-9)),
        ("", None),
        ("12", None),
        ("a b c", None),
        ("-1 3 1", None),
    ],
)
def test_schedstat_lines_parse_or_are_refused(text: str, want: tuple[float, float] | None) -> None:
    assert parse_schedstat(text) == want


def test_major_faults_are_read_past_a_command_with_spaces_and_parentheses() -> None:
    line = "4242 (clone (server) x) S 1 2 3 0 -1 4194560 1234 0 17 0 5 6 0 0 20 0 4 0\n"
    assert parse_major_faults(line) == 17
    assert parse_major_faults("no parenthesis here") is None
    assert parse_major_faults("1 (x) S 1 2") is None
    assert parse_major_faults("1 (x) S 1 2 3 0 -1 4 5 6 many 0") is None


def test_a_stall_spent_reading_pages_back_says_so() -> None:
    before = LoopSample(wall=0.0, ran=0.0, waited=0.0, process=0.0, major_faults=3)
    after = LoopSample(wall=0.79, ran=0.009, waited=0.03, process=0.057, major_faults=41)
    split = split_interval(before, after)
    assert (split.off_cpu_ms, split.major_faults) == (751, 38)
    assert split.describe().endswith("the loop thread's major page faults: 38")


def test_a_stall_spent_running_is_the_loops() -> None:
    before = LoopSample(wall=10.0, ran=1.0, waited=0.5, process=2.0)
    after = LoopSample(wall=10.9, ran=1.8, waited=0.55, process=2.9)
    split = split_interval(before, after)
    assert split == IntervalSplit(wall_ms=900, ran_ms=800, waited_ms=50, process_ms=900,
                                  major_faults=0)
    assert split.off_cpu_ms == 50
    assert "ran 800 ms, waited 50 ms for a CPU and was off CPU 50 ms" in split.describe()


def test_a_stall_spent_waiting_for_a_cpu_is_the_machines() -> None:
    before = LoopSample(wall=0.0, ran=0.0, waited=0.0, process=0.0)
    after = LoopSample(wall=0.75, ran=0.02, waited=0.7, process=0.03)
    split = split_interval(before, after)
    assert (split.ran_ms, split.waited_ms, split.off_cpu_ms) == (20, 700, 30)


def test_off_cpu_behind_a_starved_thread_of_ours_is_the_hosts() -> None:
    # The loop off CPU 300 ms while the commit writer, holding the
    # interpreter lock, waited 280 ms for a CPU: 280 ms of the block are the
    # host's (at most the time off CPU, however long the others waited).
    before = LoopSample(wall=0.0, ran=0.0, waited=0.0, process=0.0, others_waited=1.0)
    after = LoopSample(wall=1.09, ran=0.026, waited=0.754, process=0.031, others_waited=1.28)
    split = split_interval(before, after)
    assert (split.off_cpu_ms, split.others_waited_ms, split.host_off_cpu_ms()) == (310, 280, 280)
    assert "its other Python threads waited 280 ms for a CPU" in split.describe()
    longer = split_interval(before, LoopSample(1.09, 0.026, 0.754, 0.031, others_waited=2.0))
    assert longer.host_off_cpu_ms() == 310
    alone = split_interval(before, LoopSample(1.09, 0.026, 0.754, 0.031, others_waited=1.0))
    assert alone.host_off_cpu_ms() == 0  # blocked while nothing of ours waited: the loop's


def test_only_the_other_python_threads_waits_are_summed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # /proc/self/task as the kernel lays it out: this thread, two other Python
    # threads (one ended before its file was read), and a libzmq I/O thread,
    # which never holds the interpreter lock and is not counted.
    own = threading.get_native_id()
    for tid, line in [(own, "5 9000000000 1"), (101, "7 250000000 3"), (103, "1 2 1"),
                      (104, "1 40000000000 9")]:  # fmt: skip
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "schedstat").write_text(line + "\n")
    threads = [SimpleNamespace(native_id=n) for n in (own, 101, 102, 103, None)]
    monkeypatch.setattr("clone.server.lateness.threading.enumerate", lambda: threads)
    counters = ThreadCounters(str(tmp_path))
    try:
        assert counters.others_waited() == pytest.approx(0.25 + 2e-9)
        assert counters.descriptors == 2  # 101 and 103: 102 has no file
        # Kept open, read afresh: 101 waited more; 103 ended (Python no
        # longer lists it), and its descriptor is closed.
        (tmp_path / "101" / "schedstat").write_text("7 750000000 4\n")
        threads.remove(threads[3])
        assert counters.others_waited() == pytest.approx(0.75)
        assert counters.descriptors == 1
    finally:
        counters.close()
    assert counters.descriptors == 0


def test_counters_that_went_back_give_no_negative_time() -> None:
    # A sample from another thread, or a counter reset: never below zero.
    split = split_interval(LoopSample(5.0, 3.0, 3.0, 3.0), LoopSample(4.0, 1.0, 1.0, 1.0))
    assert split == IntervalSplit(0, 0, 0, 0)
    assert split.off_cpu_ms == 0


def test_the_kernel_counts_this_threads_own_work() -> None:
    counters = ThreadCounters()
    first = counters.sample(time.monotonic())
    if first is None:
        pytest.skip("no /proc/thread-self/schedstat on this kernel")
    # Run 20 ms of CPU on this thread (however long a busy machine takes to
    # give them), then sleep: the run time grows by the spin, not the sleep.
    start_cpu, deadline = time.thread_time(), time.monotonic() + 60
    while time.thread_time() - start_cpu < 0.02 and time.monotonic() < deadline:
        pass
    done = threading.Event()
    done.wait(0.05)
    second = counters.sample(time.monotonic())  # the same descriptors, read afresh
    counters.close()
    assert second is not None
    split = split_interval(first, second)
    assert split.wall_ms >= 70
    assert split.ran_ms >= 19  # the spin (the kernel's count and thread_time agree)
    assert split.ran_ms + split.waited_ms <= split.wall_ms + 5
    assert split.off_cpu_ms >= 40  # the sleep


def _timers(counters: dict[str, int]) -> Timers:
    parts: Any = None  # the late-heartbeat warning uses none of the other parts
    shared = Shared(Throttle(logging.getLogger("test"), lambda: 20.0), clock=lambda: 20.0,
                    counters=counters)  # fmt: skip
    return Timers(
        ServerConfig(port=5556), parts, shared,
        parts, heartbeat_ms=250, publisher=parts, publisher_port=parts, security=parts,
        durability=parts, healer=parts, streams=parts, votes=parts, follower=None, relay=None,
        log_stats=lambda level: None, stopping=lambda: False,
    )  # fmt: skip


def test_a_late_heartbeat_says_where_the_wait_went(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    counters = dict.fromkeys(IO_COUNTERS, 0)
    timers = _timers(counters)
    timers._loop_sample = LoopSample(wall=19.1, ran=4.0, waited=1.0, process=6.0)
    now = LoopSample(wall=20.0, ran=4.1, waited=1.7, process=6.5)
    monkeypatch.setattr(timers._counters, "sample", lambda wall: now)
    with caplog.at_level(logging.WARNING, logger="clone.server.reactor"):
        timers._warn_late(650, 700, "the host kept the server from running", worst=True)
    assert counters["heartbeat_max_late_ran_ms"] == 100
    assert counters["heartbeat_max_late_waited_ms"] == 700
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        "heartbeat ran 650 ms late, 700 ms of it waiting for a CPU:"
        " the host kept the server from running (")
    assert "of the last 900 ms the loop thread ran 100 ms, waited 700 ms for a CPU" in line
    assert ("all the process's threads ran 500 ms, its other Python threads waited 0 ms"
            " for a CPU; the loop thread's major page faults: 0") in line


def test_without_the_kernels_counters_the_warning_is_the_plain_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    counters = dict.fromkeys(IO_COUNTERS, 0)
    timers = _timers(counters)
    timers._loop_sample = None
    monkeypatch.setattr(timers._counters, "sample", lambda wall: None)
    with caplog.at_level(logging.WARNING, logger="clone.server.reactor"):
        timers._warn_late(300, 0, "the reactor was blocked", worst=True)
    assert [r.getMessage() for r in caplog.records] == [
        "heartbeat ran 300 ms late, 0 ms of it waiting for a CPU: the reactor was blocked"]
    assert counters["heartbeat_max_late_waited_ms"] == 0
