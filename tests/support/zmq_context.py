"""The ``ctx`` fixture: a zmq context of the test's own, destroyed with linger 0,
so that no socket a test forgot outlives it (tests/bstar overrides it with a
context that also checks every socket was closed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)
