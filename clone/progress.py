"""Progress of long work: a ``rich`` bar on a terminal, periodic log lines elsewhere.

How this works: :class:`Progress` is a context manager around one piece of work
(a pipeline load, a drill run, a benchmark, a client's sync).  The work reports
how far it is with :meth:`Progress.update` (or a ``poll`` function that a daemon
thread calls, for work that only something else can observe: Spark's status
tracker, the client agent's key count).  Where the output goes is decided once,
when the block is entered:

* stderr is a terminal: a :class:`rich.progress.Progress` bar on stderr (done,
  total, elapsed, ETA and a status text), removed again when ``transient``;
* otherwise (a log file, CI, a pipe): one plain line at INFO on this module's
  logger at most every ``interval`` seconds -- done/total, rate, ETA, status --
  and a last line when work that took longer than ``interval`` ends.  A redrawn
  bar in a log file is noise; a line every few seconds is not.

Nothing is printed: entry points that want the lines without ``--verbose`` set
this module's logger (:data:`LOGGER_NAME`) to INFO.  The clock is injected, so
the tests drive the log lines with a fake one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

__all__ = ["LOGGER_NAME", "Progress", "format_line"]

LOGGER_NAME = __name__
log = logging.getLogger(__name__)

#: Seconds between two calls of a ``poll`` function.
POLL_EVERY = 0.5


class Progress:
    """Show the progress of ``what`` while the ``with`` block runs.

    ``total`` may be None (unknown: the bar pulses, the lines give no ETA) and
    may be set later with :meth:`update`.  ``unit`` names what is counted
    ("rows", "s", "keys"); ``rate=False`` leaves the rate out of the lines (a
    count of seconds has none worth reading).  ``poll(progress)`` is called every ``poll_every``
    seconds from a daemon thread; an exception stops the polling (logged at
    DEBUG: the thing polled may be shutting down under us).  ``show_after``
    delays the bar, so that work that ends quickly draws nothing.  ``console``
    replaces the default (stderr) console, for tests.
    """

    def __init__(
        self,
        what: str,
        total: float | None = None,
        *,
        unit: str = "",
        rate: bool = True,
        interval: float = 5.0,
        poll: Callable[[Progress], None] | None = None,
        poll_every: float = POLL_EVERY,
        show_after: float = 0.0,
        transient: bool = False,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0 or poll_every <= 0:
            raise ValueError("interval and poll_every must be > 0")
        self.what = what
        self.unit = unit
        self.rate = rate
        self.interval = interval
        self._total = total
        self._done = 0.0
        self._status = ""
        self._poll = poll
        self._poll_every = poll_every
        self._show_after = show_after
        self._transient = transient
        self._console = console
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._terminal = False
        self._started = 0.0
        self._last_line = 0.0

    # -- the work reports ---------------------------------------------------

    @property
    def completed(self) -> float:
        return self._done

    @property
    def total(self) -> float | None:
        return self._total

    def update(
        self,
        completed: float | None = None,
        *,
        advance: float = 0.0,
        total: float | None = None,
        status: str | None = None,
    ) -> None:
        """Set how far the work is (``completed``, or ``advance`` by some)."""
        with self._lock:
            if completed is not None:
                self._done = float(completed)
            self._done += advance
            if total is not None:
                self._total = total
            if status is not None:
                self._status = status
            self._show()

    def advance(self, amount: float = 1.0) -> None:
        self.update(advance=amount)

    def line(self) -> str:
        """The progress as one plain line, as logged."""
        return format_line(
            self.what, self._done, self._total, self._clock() - self._started,
            unit=self.unit, status=self._status, rate=self.rate,
        )

    # -- the context ----------------------------------------------------------

    def __enter__(self) -> Progress:
        console = self._console or Console(stderr=True)
        self._terminal = console.is_terminal
        self._started = self._last_line = self._clock()
        if self._terminal:
            self._bar = RichProgress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=console,
                transient=self._transient,
                get_time=self._clock,
                # stdout goes above the bar only when it shares the terminal:
                # redirected to a file, it must stay in the file.
                redirect_stdout=self._console is None and sys.stdout.isatty(),
                redirect_stderr=False,
            )
        with self._lock:
            self._show()
        if self._poll is not None:
            self._thread = threading.Thread(
                target=self._run_poll, name=f"progress-{self.what}", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._poll_every + 5.0)
        with self._lock:
            if self._bar is not None and self._task is not None:
                self._bar.update(self._task, completed=self._done, total=self._total,
                                 status=self._status)
                self._bar.stop()
            elif not self._terminal and self._clock() - self._started >= self.interval:
                log.info("%s%s", self.line(), " (failed)" if exc_type is not None else " (done)")

    # -- internals ------------------------------------------------------------

    def _show(self) -> None:
        """Draw or log the current state; called with the lock held."""
        now = self._clock()
        if self._terminal:
            if self._bar is None:
                return
            if self._task is None:
                if now - self._started < self._show_after:
                    return
                self._bar.start()
                self._task = self._bar.add_task(
                    self.what, total=self._total, completed=int(self._done),
                    unit=self.unit, status=self._status,
                )
            self._bar.update(self._task, completed=self._done, total=self._total,
                             status=self._status)
        elif now - self._last_line >= self.interval:
            self._last_line = now
            log.info("%s", self.line())

    def _run_poll(self) -> None:
        assert self._poll is not None
        while not self._stop.wait(self._poll_every):
            try:
                self._poll(self)
            except Exception:
                log.debug("progress poll of %s failed; no more updates", self.what, exc_info=True)
                return


def format_line(
    what: str,
    done: float,
    total: float | None,
    elapsed: float,
    *,
    unit: str = "",
    status: str = "",
    rate: bool = True,
) -> str:
    """``what: done/total unit (pct), rate unit/s, ETA m:ss; status``."""
    unit_text = f" {unit}" if unit else ""
    per_s = done / elapsed if elapsed > 0 else 0.0
    parts = []
    if total:
        parts.append(f"{_num(done)}/{_num(total)}{unit_text} ({100.0 * done / total:.0f}%)")
    else:
        parts.append(f"{_num(done)}{unit_text}")
    if rate:
        parts.append(f"{_num(per_s)}{unit_text}/s")
    if total and per_s > 0:
        parts.append(f"ETA {_clock_text(max(0.0, total - done) / per_s)}")
    elif total:
        parts.append("ETA ?")
    else:
        parts.append(f"{_clock_text(elapsed)} elapsed")
    text = f"{what}: " + ", ".join(parts)
    return f"{text}; {status}" if status else text


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 or float(x).is_integer() else f"{x:,.1f}"


def _clock_text(seconds: float) -> str:
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
