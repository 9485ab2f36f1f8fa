"""Fixtures of the Binary Star reactor tests: a socket-tracking context, a
private IOLoop, and bstar's debug log in every failure report."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from tornado.ioloop import IOLoop

from tests.support.tracking import TrackingContext, tracking_context


@pytest.fixture(autouse=True)
def _debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="bstar")


@pytest.fixture
def ctx() -> Iterator[TrackingContext]:
    yield from tracking_context()


@pytest.fixture
def loop() -> Iterator[IOLoop]:
    io_loop = IOLoop(make_current=False)
    yield io_loop
    io_loop.close(all_fds=False)
