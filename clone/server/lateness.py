"""Why the loop ran a timer late: our own work, or no CPU to run on.

How this works: a late heartbeat says the loop thread did not get back to its
timers in time, but not why.  Linux keeps, per thread, the time it ran on a
CPU and the time it waited, runnable, for one (``/proc/self/task/TID/schedstat``:
run and run-queue delay, in ns).  The heartbeat reads both every time it runs
(on the loop thread) and, for a late one, splits the wall time since the
previous heartbeat into: *ran* (the loop's own work, ours or libzmq's in its
calls), *waited for a CPU* (the machine was busy: the scheduler, not our code)
and the rest, *off CPU* (idle in ``epoll``, or blocked: the interpreter lock
held by another thread, a page fault on disk); beside them, the CPU time of
all the process's threads (another of ours busy meanwhile), the time the
process's *other* Python threads waited for a CPU (``/proc/self/task/*/schedstat``)
and the loop thread's major page faults (``/proc/self/task/TID/stat``: off CPU
reading a page of code or data back from disk, as a process near its memory
cgroup's limit does).  A stall mostly *ran* is ours to slice; one mostly
*waited* is the machine's.  So is an *off CPU* one while our other threads
waited for a CPU: the loop thread needs the interpreter lock back after every
``epoll`` and takes it from whichever of our threads holds it (the commit
writer, between its SQLite calls); on a starved host that thread, runnable,
waits for a CPU before it can let go, and the loop waits, off CPU, behind it
(:meth:`IntervalSplit.host_off_cpu_ms`).

:func:`parse_schedstat` and :func:`split_interval` are pure; :class:`ThreadCounters`
is the one reader of the kernel (None where there is no such file: the split
is then left out).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

__all__ = [
    "IntervalSplit",
    "LoopSample",
    "ThreadCounters",
    "parse_major_faults",
    "parse_schedstat",
    "split_interval",
]

_TASKS = "/proc/self/task"
#: Enough for a thread's ``stat`` line (52 numbers and a 16-byte name).
_READ_BYTES = 1024
#: majflt's place among the fields after the command's closing parenthesis
#: (proc(5): field 12; the state, field 3, comes first).
_MAJFLT_AFTER_COMM = 12 - 3


@dataclass(frozen=True, slots=True)
class LoopSample:
    """The calling thread's counters at one instant, in seconds."""

    wall: float  # the server's monotonic clock
    ran: float  # on a CPU
    waited: float  # runnable, waiting for a CPU
    process: float  # CPU time of all the process's threads
    major_faults: int = 0  # the thread's page faults that read from disk
    others_waited: float = 0.0  # the process's other Python threads' waits for a CPU


@dataclass(frozen=True, slots=True)
class IntervalSplit:
    """Where the wall time between two samples went, in milliseconds."""

    wall_ms: int
    ran_ms: int
    waited_ms: int
    process_ms: int  # every thread's CPU: far above ran_ms, another thread was busy
    major_faults: int = 0
    others_waited_ms: int = 0  # our other Python threads, runnable, waiting for a CPU

    def host_off_cpu_ms(self) -> int:
        """Of the loop's time off CPU, at most what our other threads spent
        waiting for a CPU meanwhile: the loop blocked on the interpreter lock
        held by one the host did not run (the host's doing, as the loop's own
        wait for a CPU is).  An upper bound: their waits are not known to
        have overlapped the loop's block, only to have fitted in the same
        interval."""
        return min(self.off_cpu_ms, self.others_waited_ms)

    @property
    def off_cpu_ms(self) -> int:
        """Neither running nor runnable: idle, or blocked in a call."""
        return max(0, self.wall_ms - self.ran_ms - self.waited_ms)

    def describe(self) -> str:
        """The clause a late heartbeat's warning ends with."""
        return (
            f"of the last {self.wall_ms} ms the loop thread ran {self.ran_ms} ms, "
            f"waited {self.waited_ms} ms for a CPU and was off CPU {self.off_cpu_ms} ms; "
            f"all the process's threads ran {self.process_ms} ms, "
            f"its other Python threads waited {self.others_waited_ms} ms for a CPU; "
            f"the loop thread's major page faults: {self.major_faults}"
        )


def parse_schedstat(text: str) -> tuple[float, float] | None:
    """(ran, waited) in seconds from a schedstat line ``run_ns wait_ns slices``;
    None if it is not one."""
    parts = text.split()
    if len(parts) < 2:
        return None
    try:
        ran_ns, wait_ns = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if ran_ns < 0 or wait_ns < 0:
        return None
    return ran_ns / 1e9, wait_ns / 1e9


def parse_major_faults(text: str) -> int | None:
    """The major page faults in a ``/proc/.../stat`` line; None if it is not one."""
    _, paren, rest = text.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) <= _MAJFLT_AFTER_COMM:
        return None
    try:
        return int(fields[_MAJFLT_AFTER_COMM])
    except ValueError:
        return None


def split_interval(before: LoopSample, after: LoopSample) -> IntervalSplit:
    """The split of the time from ``before`` to ``after`` (same thread)."""
    return IntervalSplit(
        wall_ms=max(0, round((after.wall - before.wall) * 1000)),
        ran_ms=max(0, round((after.ran - before.ran) * 1000)),
        waited_ms=max(0, round((after.waited - before.waited) * 1000)),
        process_ms=max(0, round((after.process - before.process) * 1000)),
        major_faults=max(0, after.major_faults - before.major_faults),
        others_waited_ms=max(0, round((after.others_waited - before.others_waited) * 1000)),
    )


class ThreadCounters:
    """The kernel's counters of this process's threads, read through
    descriptors kept open.

    Each heartbeat reads the loop thread's run and wait times twice, its page
    faults once, and the wait of every other Python thread.  Opened, read and
    closed each time (``open()``: eight system calls a file), that took 116 µs
    a heartbeat; a ``pread`` at offset 0 of a kept descriptor makes the kernel
    write the line afresh, and the same reads take 16 µs (docs/benchmarks.md,
    "Idle CPU: the heartbeat's kernel counters").  The files are named by thread id
    (``/proc/self/task/TID``), not ``thread-self``, so that a descriptor serves
    the thread it was opened for, whichever thread reads it; one of a thread
    that ended is closed once Python no longer lists the thread, or at the
    first read that fails.  :meth:`close` closes the rest (the server's
    timers, when they stop).
    """

    def __init__(self, tasks: str = _TASKS) -> None:
        self._tasks = tasks
        self._schedstat: dict[int, int] = {}  # thread id -> descriptor
        self._stat: dict[int, int] = {}

    @property
    def descriptors(self) -> int:
        """How many descriptors are open now."""
        return len(self._schedstat) + len(self._stat)

    def close(self) -> None:
        """Close every descriptor; a later read opens what it needs again."""
        for table in (self._schedstat, self._stat):
            for fd in table.values():
                os.close(fd)
            table.clear()

    def _read(self, table: dict[int, int], tid: int, name: str) -> str | None:
        fd = table.get(tid)
        try:
            if fd is None:
                fd = table[tid] = os.open(f"{self._tasks}/{tid}/{name}", os.O_RDONLY)
            return os.pread(fd, _READ_BYTES, 0).decode("ascii", "replace")
        except OSError:  # no such file here, or the thread ended
            if (gone := table.pop(tid, None)) is not None:
                os.close(gone)
            return None

    def cpu_wait(self) -> float | None:
        """Seconds the calling thread has spent runnable but waiting for a
        CPU, or None where the kernel does not say."""
        text = self._read(self._schedstat, threading.get_native_id(), "schedstat")
        parsed = None if text is None else parse_schedstat(text)
        return None if parsed is None else parsed[1]

    def others_waited(self) -> float:
        """Seconds the process's other Python threads (those that can hold the
        interpreter lock; libzmq's I/O threads never do) have waited for a CPU,
        0 where the kernel does not say.  A thread that ended since the last
        sample takes its waits with it: the difference is then low, never high."""
        own = threading.get_native_id()
        alive = {own}
        total = 0.0
        for thread in threading.enumerate():
            tid = thread.native_id
            if tid is None or tid == own:
                continue
            alive.add(tid)
            text = self._read(self._schedstat, tid, "schedstat")
            parsed = None if text is None else parse_schedstat(text)
            if parsed is not None:
                total += parsed[1]
        for table in (self._schedstat, self._stat):
            for tid in [t for t in table if t not in alive]:  # ended: Python joined it
                os.close(table.pop(tid))
        return total

    def sample(self, now: float) -> LoopSample | None:
        """The calling thread's counters and the process's CPU time now (``now``:
        the server's clock); None where the kernel does not keep them."""
        own = threading.get_native_id()
        text = self._read(self._schedstat, own, "schedstat")
        parsed = None if text is None else parse_schedstat(text)
        if parsed is None:
            return None
        stat = self._read(self._stat, own, "stat")
        faults = (parse_major_faults(stat) if stat is not None else None) or 0
        return LoopSample(wall=now, ran=parsed[0], waited=parsed[1], process=time.process_time(),
                          major_faults=faults, others_waited=self.others_waited())
