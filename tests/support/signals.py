"""Every test starts with SIGINT and SIGTERM deliverable, and whatever left
them otherwise is named.

A child inherits its parent thread's signal mask and any signal set to
``SIG_IGN`` across ``exec``: a pytest process left with SIGINT blocked or
ignored would start every later ``clone watch``, keeper or server unable to
see its Ctrl-C, and the test that sends one would wait out its ceiling (two
clean runs: a watch and a keeper that outlived SIGINT by 10 and 30 s, their
main threads never interrupted).

Two sources, told apart:

* **What started pytest.**  A non-interactive shell starts a background job
  (``cmd &``, without job control) with SIGINT and SIGQUIT ignored, and Python
  keeps an inherited ``SIG_IGN`` instead of installing its KeyboardInterrupt
  handler; pytest-xdist's workers inherit it from the controller.  At
  ``pytest_configure`` (in the controller before it starts its workers, and in
  each worker) the state is put right, with one config-time warning saying it
  was inherited.  This was the whole story of the warnings the first version
  of this guard gave before the first test of each worker.
* **A test or a fixture.**  The state is checked after every fixture's setup
  and teardown (its finalizers) and after each test's setup, call and
  teardown: the first check that finds it wrong puts it right and warns
  (:class:`StopSignalsLeft`, on that test), naming the fixture or the test
  that left it.

tests/conftest.py registers this module as a plugin; an inline pytester
session takes it with ``-p tests.support.signals``.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Generator

import pytest

__all__ = ["StopSignalsLeft", "restore_stop_signals", "stop_signals_wrong"]

_STOPS = (signal.SIGINT, signal.SIGTERM)
#: What an ignored stop signal goes back to: Python's own for SIGINT (a
#: KeyboardInterrupt, as when Python starts with it at its default).
_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


class StopSignalsLeft(RuntimeWarning):
    """SIGINT or SIGTERM was blocked or ignored in a pytest process (and has
    been made deliverable again); the message says what left it so."""


def stop_signals_wrong() -> list[str]:
    """What keeps SIGINT or SIGTERM from a child started now, e.g.
    ``["SIGINT ignored"]``; empty when both are deliverable."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ()) & set(_STOPS)
    wrong = [f"{signal.Signals(s).name} blocked" for s in sorted(blocked)]
    wrong += [f"{s.name} ignored" for s in _STOPS if signal.getsignal(s) == signal.SIG_IGN]
    return wrong


def restore_stop_signals() -> list[str]:
    """Unblock SIGINT and SIGTERM and put an ignored one back to its default;
    returns what was wrong (:func:`stop_signals_wrong`).  Main thread only."""
    wrong = stop_signals_wrong()
    if wrong:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
        for sig, default in _DEFAULTS.items():
            if signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, default)
    return wrong


class _Guard:
    """The checks around every fixture and test phase of one pytest session."""

    def __init__(self) -> None:
        self._item: pytest.Item | None = None

    def _check(self, left_by: str) -> None:
        wrong = restore_stop_signals()
        if wrong:
            warnings.warn(
                StopSignalsLeft(f"{', '.join(wrong)} in this process, left by {left_by}: restored"),
                stacklevel=2,
            )

    def _during(self) -> str:
        return self._item.nodeid if self._item is not None else "the collection"

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[object], request: pytest.FixtureRequest
    ) -> Generator[None, object, object]:
        try:
            return (yield)
        finally:
            self._check(f"fixture {fixturedef.argname!r} (its setup, for {self._during()})")

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[object]) -> None:
        # Called after the fixture's own finalizers have run.
        self._check(f"fixture {fixturedef.argname!r} (its teardown, after {self._during()})")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        # Nothing of this session runs between one test's teardown check and
        # this one but pytest and other plugins; the first test finds here
        # what the collection (a test module's import) left.
        before = f"the collection or a plugin, before {item.nodeid}"
        self._check(before if self._item is None else f"something between the tests: {before}")
        self._item = item
        try:
            return (yield)
        finally:
            self._check(f"the setup of {item.nodeid} (outside its fixtures)")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            self._check(f"the test {item.nodeid}")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            self._check(f"the teardown of {item.nodeid} (outside its fixtures)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    wrong = restore_stop_signals()
    if wrong:
        config.issue_config_time_warning(
            StopSignalsLeft(
                f"{', '.join(wrong)} when pytest started, inherited from what started it"
                " (a non-interactive shell starts a background job with SIGINT ignored):"
                " restored, so that the processes the tests start can be stopped"
            ),
            stacklevel=2,
        )
    config.pluginmanager.register(_Guard(), "clone-stop-signals-guard")
