"""Clone's pytest plugin: ``clone_server`` and ``fake_clone`` fixtures.

Enable it in a conftest.py (``pytest_plugins = ["clone.testing.pytest_plugin"]``)
or on the command line (``pytest -p clone.testing.pytest_plugin``).

* ``clone_server``: a real standalone ``clone-server``, in memory, on free
  loopback ports (:class:`clone.testing.CloneServer`), one per test, stopped
  after it; connect with ``Clone(clone_server.endpoint)``.
* ``fake_clone``: a fresh :class:`clone.testing.FakeClone`, closed after the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clone.testing import CloneServer, FakeClone


@pytest.fixture
def clone_server(tmp_path: Path) -> Iterator[CloneServer]:
    with CloneServer(log_dir=tmp_path) as server:
        yield server


@pytest.fixture
def fake_clone() -> Iterator[FakeClone]:
    with FakeClone() as client:
        yield client
