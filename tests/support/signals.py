"""Every test starts with SIGINT and SIGTERM deliverable in the worker.

A child inherits its parent thread's signal mask and any signal set to
``SIG_IGN`` across ``exec``: a worker left with SIGINT blocked or ignored
would start every later ``clone watch``, keeper or server unable to see its
Ctrl-C, and the test that sends one would wait out its ceiling (two clean
runs: a watch and a keeper that outlived SIGINT by 10 and 30 s, their main
threads never interrupted).  So before each test this fixture unblocks both
and puts an ignored SIGINT back to Python's default, and warns, naming the
test, when it had to: the warning points at whatever left them so.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Iterator

import pytest

_STOPS = {signal.SIGINT, signal.SIGTERM}


@pytest.fixture(autouse=True)
def _stop_signals_deliverable(request: pytest.FixtureRequest) -> Iterator[None]:
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS) & _STOPS
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if blocked or ignored:
        what = [f"{signal.Signals(s).name} blocked" for s in sorted(blocked)]
        what += ["SIGINT ignored"] * ignored
        warnings.warn(
            f"{', '.join(what)} in this worker before {request.node.nodeid}: restored",
            RuntimeWarning,
            stacklevel=1,
        )
    yield
