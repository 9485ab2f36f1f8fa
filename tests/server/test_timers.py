"""The heartbeat's lateness split into the host's part (its thread waiting for
a CPU) and the loop's own (clone.server.timers)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from clone.server.lateness import ThreadCounters
from clone.server.timers import own_lateness


def test_the_wait_for_a_cpu_is_taken_off_the_lateness() -> None:
    assert own_lateness(900, 10.0, 10.75) == (750, 150)  # mostly the host's
    assert own_lateness(900, 10.0, 10.05) == (50, 850)  # mostly the loop's
    assert own_lateness(300, 10.0, 11.0) == (1000, 0)  # waits before the due time too


def test_without_the_kernels_figure_the_whole_lateness_is_the_loops() -> None:
    assert own_lateness(400, None, 3.0) == (0, 400)
    assert own_lateness(400, 3.0, None) == (0, 400)
    assert own_lateness(400, 3.0, 2.0) == (0, 400)  # never a negative wait


@pytest.mark.skipif(sys.platform != "linux", reason="schedstat is Linux's")
def test_a_thread_that_competes_for_a_cpu_waits_for_one() -> None:
    """More spinning processes than cores: this thread, spinning too, must
    spend some time runnable without a CPU."""
    counters = ThreadCounters()
    before = counters.cpu_wait()
    assert before is not None and before >= 0
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range((os.cpu_count() or 1) + 1)
    ]
    try:
        deadline = time.monotonic() + 30  # bounds a hang only
        waited = 0.0
        while waited <= 0 and time.monotonic() < deadline:
            sum(range(100_000))
            now = counters.cpu_wait()  # the same descriptor, read afresh
            assert now is not None
            waited = now - before
    finally:
        for p in spinners:
            p.kill()
            p.wait(10)
        counters.close()
    assert waited > 0
