"""The stop-signal guard (tests/support/signals.py) names what left SIGINT or
SIGTERM undeliverable, puts it right, and undoes what pytest inherited.

Small inline sessions (pytester, in this process) with tests and fixtures
that leave the state wrong; and one real pytest started as a non-interactive
shell starts a background job (SIGINT ignored), whose xdist worker must start
its children with SIGINT deliverable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.signals import restore_stop_signals, stop_signals_wrong

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

#: The inline sessions: the guard, no xdist, no pytest-asyncio (which warns
#: without the setup.cfg the inline directory lacks).
_INLINE = ("-p", "tests.support.signals", "-p", "no:xdist", "-p", "no:asyncio")

_LEAKS = '''
import signal

import pytest


def deliverable():
    return (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
        and not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, ())
    )


@pytest.fixture
def ignores_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield


@pytest.fixture
def blocks_sigterm_at_teardown():
    yield
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def test_ignores():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_after_the_test():
    assert deliverable()


def test_with_a_fixture(ignores_sigint):
    assert deliverable()  # put right before the test's body


def test_with_a_teardown(blocks_sigterm_at_teardown):
    assert deliverable()


def test_after_the_teardown():
    assert deliverable()
'''


def test_the_warning_names_the_test_or_fixture_that_left_the_state(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_leaks=_LEAKS)
    result = pytester.runpytest_inprocess(*_INLINE)
    result.assert_outcomes(passed=5, warnings=3)
    result.stdout.fnmatch_lines(
        [
            "*StopSignalsLeft: SIGINT ignored in this process,"
            " left by the test test_leaks.py::test_ignores: restored",
            "*StopSignalsLeft: SIGINT ignored in this process,"
            " left by fixture 'ignores_sigint' (its setup, for test_leaks.py::test_with_a_fixture):"
            " restored",
            "*StopSignalsLeft: SIGTERM blocked in this process,"
            " left by fixture 'blocks_sigterm_at_teardown'"
            " (its teardown, after test_leaks.py::test_with_a_teardown): restored",
        ],
        consecutive=False,
    )
    assert stop_signals_wrong() == []


def test_what_pytest_inherited_is_put_right_when_it_starts(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="import signal\n\n"
        "def test_deliverable():\n"
        "    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job starts
    try:
        result = pytester.runpytest_inprocess(*_INLINE)
    finally:
        signal.signal(signal.SIGINT, previous)
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*StopSignalsLeft: SIGINT ignored when pytest started, inherited from what started it*"]
    )


def test_restore_unblocks_and_unignores_and_says_what_it_found() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        assert stop_signals_wrong() == ["SIGINT blocked", "SIGTERM ignored"]
        assert restore_stop_signals() == ["SIGINT blocked", "SIGTERM ignored"]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert stop_signals_wrong() == []
        assert restore_stop_signals() == []
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGTERM, previous)


_CHILD = '''
import subprocess

import pytest


@pytest.fixture(scope="module")
def child_status():
    # Started as a module's servers are: before the test's own fixtures.
    return subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True).stdout


def test_a_child_can_be_interrupted(child_status):
    # SigIgn is a hex mask: bit 1 (value 2) is SIGINT.
    line = next(l for l in child_status.splitlines() if l.startswith("SigIgn:"))
    assert not int(line.split()[1], 16) & 2, line
'''


def _as_a_background_job() -> None:
    """What a non-interactive shell does to ``cmd &``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def test_a_pytest_started_in_the_background_starts_children_that_see_sigint(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_child=_CHILD)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *_INLINE[:2], "-p", "no:asyncio",
         "-n", "1", "test_child.py"],
        cwd=pytester.path, env=env, capture_output=True, text=True, timeout=120,
        preexec_fn=_as_a_background_job,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout
    # Once, in the controller, before it started its worker: the worker inherits it right.
    assert done.stdout.count("SIGINT ignored when pytest started") == 1, done.stdout
