"""clone.progress in both modes: a rich bar on a (forced) terminal, log lines elsewhere."""

from __future__ import annotations

import io
import logging
import threading

import pytest
from rich.console import Console

from clone.progress import LOGGER_NAME, Progress, format_line


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False), out


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]


def test_terminal_draws_a_rich_bar_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    clock = FakeClock()
    with Progress("load", 200, unit="rows", console=console, clock=clock) as p:
        for _ in range(4):
            clock.now += 10
            p.update(advance=50, status="partition 3")
    drawn = out.getvalue()
    assert "load" in drawn and "200/200" in drawn and "partition 3" in drawn
    assert "\x1b[" in drawn  # a terminal rendering, not plain lines
    assert _lines(caplog) == []


def test_terminal_bar_waits_for_show_after() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    clock = FakeClock()
    with Progress("sync", console=console, clock=clock, show_after=1.0) as p:
        clock.now += 0.5
        p.update(10)
    assert "sync" not in out.getvalue()  # quick work draws nothing


def test_not_a_terminal_logs_a_line_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    console, out = _plain_console()
    clock = FakeClock()
    with Progress("load", 1000, unit="rows", interval=5.0, console=console, clock=clock) as p:
        for _ in range(10):  # 100 rows every 2 s: lines at 6 s, 12 s, 18 s
            clock.now += 2.0
            p.update(advance=100, status="stage 1")
    lines = _lines(caplog)
    assert lines == [
        "load: 300/1,000 rows (30%), 50 rows/s, ETA 0:14; stage 1",
        "load: 600/1,000 rows (60%), 50 rows/s, ETA 0:08; stage 1",
        "load: 900/1,000 rows (90%), 50 rows/s, ETA 0:02; stage 1",
        "load: 1,000/1,000 rows (100%), 50 rows/s, ETA 0:00; stage 1 (done)",
    ]
    assert out.getvalue() == ""  # nothing printed to the console


def test_short_work_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    console, _ = _plain_console()
    clock = FakeClock()
    with Progress("sync", console=console, clock=clock) as p:
        clock.now += 1.0
        p.update(5)
    assert _lines(caplog) == []


def test_failed_work_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER_NAME)
    console, _ = _plain_console()
    clock = FakeClock()
    with pytest.raises(RuntimeError), Progress("x", 10, console=console, clock=clock) as p:
        clock.now += 6
        p.update(4)
        raise RuntimeError("boom")
    assert _lines(caplog)[-1].endswith("(failed)")


def test_poll_runs_in_a_thread_until_the_block_ends() -> None:
    console, _ = _plain_console()
    polled = threading.Event()
    seen: list[float] = []

    def poll(p: Progress) -> None:
        p.update(p.completed + 1)
        seen.append(p.completed)
        if len(seen) >= 3:
            polled.set()

    with Progress("spark", poll=poll, poll_every=0.01, console=console) as p:
        assert polled.wait(5)
    count = len(seen)
    assert p.completed >= 3
    assert len(seen) == count  # stopped with the block


def test_a_failing_poll_stops_polling(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER_NAME)
    console, _ = _plain_console()
    calls: list[int] = []

    def poll(p: Progress) -> None:
        calls.append(1)
        raise ConnectionError("jvm gone")

    with Progress("spark", poll=poll, poll_every=0.01, console=console):
        threading.Event().wait(0.1)
    assert calls == [1]
    assert any("poll of spark failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("done", "total", "elapsed", "unit", "rate", "status", "expected"),
    [
        (0, 10, 0.0, "", True, "", "w: 0/10 (0%), 0/s, ETA ?"),
        (12.5, 40, 12.5, "s", False, "writes=3", "w: 12.5/40 s (31%), ETA 0:28; writes=3"),
        (1500, None, 30.0, "keys", True, "", "w: 1,500 keys, 50 keys/s, 0:30 elapsed"),
        (10, 7200, 1.0, "", True, "", "w: 10/7,200 (0%), 10/s, ETA 11:59"),
        (10, 100_000, 1.0, "", True, "", "w: 10/100,000 (0%), 10/s, ETA 2:46:39"),
    ],
)
def test_format_line(
    done: float, total: float | None, elapsed: float, unit: str, rate: bool, status: str,
    expected: str,
) -> None:
    line = format_line("w", done, total, elapsed, unit=unit, status=status, rate=rate)
    assert line == expected


def test_bad_interval() -> None:
    with pytest.raises(ValueError):
        Progress("x", interval=0)
